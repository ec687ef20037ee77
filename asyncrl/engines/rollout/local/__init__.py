"""asyncrl.engines.rollout.local."""
