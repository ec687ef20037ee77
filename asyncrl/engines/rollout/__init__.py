"""asyncrl.engines.rollout."""
