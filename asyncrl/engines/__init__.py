"""asyncrl.engines."""
