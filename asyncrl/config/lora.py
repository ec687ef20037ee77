"""The ``lora`` section: train a LoRA adapter (PEFT) instead of the whole actor."""

from __future__ import annotations

from asyncrl.config.base import NonNegative, NonNegativeFloat, OpenFraction, PositiveFloat, _Section

__all__ = ["LoraConfig"]


class LoraConfig(_Section, frozen=True):
    """LoRA reinforcement learning (the ``lora`` extra: PEFT). ``rank = 0`` (the default) trains
    the whole actor. With ``rank > 0`` the trainer wraps the actor with a PEFT LoRA adapter and
    trains only the adapter; weight sync pushes only the adapter's tensors; every embedded
    engine keeps up to ``controller.max_staleness + 1`` adapter versions in memory (a request
    runs to its end on the version it was admitted under), so an update pauses and aborts
    nothing; SGLang and vLLM engines load each version from a folder (``adapter_dir``) and
    keep as many. The run's final adapter is written in PEFT's folder format to
    ``RUN_DIR/final/adapter``."""

    rank: NonNegative = 0
    """LoRA rank ``r``; 0: off (full fine-tuning)."""
    alpha: PositiveFloat = 16.0
    """LoRA ``alpha``: the adapter's output is scaled by ``alpha / rank``."""
    dropout: OpenFraction = 0.0
    """Dropout on the adapter's input while training (PEFT's ``lora_dropout``); in [0, 1)."""
    target_modules: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
    )  # fmt: skip
    """Names (last component) of the linear layers that get an adapter (PEFT's
    ``target_modules``). Default: every linear layer of a Qwen2/Llama decoder layer (LoRA
    on the MLPs too learns like full fine-tuning far more often than attention alone) and the
    output head: with a frozen head the logits' scale is bounded by the head's weights, so a
    policy may never get sharp (the tiny default model's reward stays below 0.2 without it,
    docs/results/lora.md)."""
    lr: NonNegativeFloat = 5e-3
    """The learning rate of a LoRA run, in place of ``trainer.lr`` (LoRA wants a higher rate
    than full fine-tuning); 0: ``trainer.lr``."""
    export_merged: bool = False
    """Also write the merged model (base + adapter) as a Hugging Face folder to
    ``RUN_DIR/final`` at the end of a run (the adapter alone is always written to
    ``RUN_DIR/final/adapter``)."""
    adapter_dir: str = ""
    """Engines that load adapters from a folder (SGLang, vLLM): where the trainer writes each
    version (PEFT's folder format, ``{adapter_dir}/{name}-v{N}``); every engine must read it at
    this same path (one node, or a shared file system). Versions no engine holds any more are
    deleted. ``""``: ``adapters/`` in the run folder. The embedded engine gets adapters over
    the collective transport instead."""
    name: str = "policy"
    """The adapter's name on the engines; version ``N`` is served as ``{name}-v{N}`` (SGLang's
    ``lora_path`` names)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank and not self.target_modules:
            raise ValueError("lora.target_modules must name at least one linear layer")
        if not self.name or "-v" in self.name or "/" in self.name:
            raise ValueError(
                f"lora.name must be non-empty without '-v' or '/' (versions are served as "
                f"NAME-vN), got {self.name!r}"
            )

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (``rank > 0``)."""
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """``alpha / rank``: the factor of the adapter's output (PEFT's ``scaling``)."""
        return self.alpha / self.rank if self.rank else 0.0
