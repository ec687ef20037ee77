"""asyncrl.algorithms."""
