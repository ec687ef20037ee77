"""asyncrl.transports."""
