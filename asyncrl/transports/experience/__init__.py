"""asyncrl.transports.experience."""
