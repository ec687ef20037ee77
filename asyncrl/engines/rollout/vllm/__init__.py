"""The vLLM engine family (vLLM 0.33's RL API): client, launcher, weight control."""
