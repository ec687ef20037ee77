"""The vLLM engine family (vLLM 0.33's RL API): client, launcher, weight control, and the
trainer's end of vLLM's NCCL weight group (``trainer_nccl``, the extra ``vllm-trainer``)."""

TRAINER_EXTRA = "asyncrl[vllm-trainer]"
TRAINER_MISSING = (
    "rollout.backend='vllm' with weights.backend='nccl' joins vLLM's NCCL weight group with "
    "vLLM's own trainer-side code (vllm.distributed.weight_transfer.nccl_common), which is "
    f"not importable here: pip install '{TRAINER_EXTRA}' (vllm==0.33.0, the version asyncrl "
    "speaks) into the trainer's environment, or use weights.backend='gloo' (vLLM's workers "
    "speak NCCL only: gloo serves asyncrl's tests and stand-ins, not a real vLLM)"
)
