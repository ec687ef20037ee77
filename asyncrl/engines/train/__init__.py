"""asyncrl.engines.train."""
