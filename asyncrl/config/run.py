"""The run's root config (:class:`RunConfig`) and its smaller sections."""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from asyncrl.config.base import NonNegative, NonNegativeFloat, Positive, PositiveFloat, _Section
from asyncrl.config.evaluation import EvalConfig
from asyncrl.config.gateway import GatewayConfig
from asyncrl.config.lora import LoraConfig
from asyncrl.config.rollout import (
    DEFAULT_MAX_NEW_TOKENS,
    LocalRolloutConfig,
    RolloutConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
)
from asyncrl.config.trainer import AlgoConfig, TrainerConfig
from asyncrl.config.weights import AutoWeightsConfig, CudaIpcWeightsConfig, WeightSyncConfig

MATH_BUDGET = 512
"""The ``math`` task's generation budget when ``task.max_new_tokens`` is 0."""
TINY_MATH_BUDGET = 16
"""... on the tiny default model (a 64-token context: room for the prompt)."""


class ModelConfig(_Section, frozen=True):
    path: str = ""
    """Local Hugging Face model directory. Empty: build (once) and use the tiny default model."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trainer and the embedded engine."""


class LongTailConfig(_Section, frozen=True):
    """``task.name = "longtail"``: the reverse task, each response continuing for a length
    drawn per episode from Pareto(``alpha``) of scale ``min_len``, capped at ``max_len``
    (``asyncrl.tasks.workloads.LongTail``). With the defaults half the responses are <= 8
    tokens and ~1 in 128 reaches the cap of 512: a synchronous step waits for its longest."""

    min_len: Positive = 4
    """Shortest response (the Pareto scale), >= ``task.num_digits``."""
    alpha: PositiveFloat = 1.0
    """Pareto shape: smaller is a heavier tail."""
    max_len: Positive = 512
    """Longest response (the cap), also the run's generation budget."""


class AgenticConfig(_Section, frozen=True):
    """``task.name = "agentic"``: ``turns`` rounds of the reverse task in one episode, a tool
    call between rounds that waits (``asyncio.sleep``, no CPU) a Pareto(``alpha``) latency of
    scale ``latency_min_s``, capped at ``latency_max_s`` (``asyncrl.tasks.workloads.Agentic``)."""

    turns: Annotated[int, msgspec.Meta(ge=2)] = 2
    """Rounds per episode (>= 2: a tool call between rounds)."""
    latency_min_s: PositiveFloat = 0.02
    """Shortest tool latency (the Pareto scale), seconds."""
    alpha: PositiveFloat = 1.0
    """Pareto shape of the tool latency: smaller is a heavier tail."""
    latency_max_s: PositiveFloat = 0.6
    """Longest tool latency (the cap), seconds."""


WORKLOAD_TASKS: Final[tuple[str, ...]] = ("longtail", "agentic")
"""Task names that are learning workloads (``asyncrl.tasks.workloads``): each changes some
defaults, see :data:`TaskConfig.name`."""


class TaskConfig(_Section, frozen=True):
    name: Literal["reverse", "math", "agent", "longtail", "agentic"] = "reverse"
    """Built-in task. ``reverse``: repeat n digits in reverse order; reward = fraction right;
    generation budget ``num_digits + 1`` (the digits and the end token). ``math``: prompts
    from a local JSONL/Parquet file (``path``), rendered with the model's chat template;
    reward 1 when the last integer in the response equals the answer, else 0. ``agent``:
    ``agent`` (an OpenAI-API agent) runs once per episode against the gateway, on samples
    from ``path`` (JSONL rows: ``prompt`` or ``messages``, ``answer``) or, without a path,
    the built-in weather chat task. ``longtail`` / ``agentic``: the learning workloads where
    asynchrony pays (heavy-tailed response lengths; multi-turn episodes waiting on a slow
    tool), knobs in ``task.longtail`` / ``task.agentic``, reward the reverse task's partial
    credit. They change these defaults (a key the file or the command line sets wins):
    ``task.num_digits = 1``; ``longtail`` also ``algo.loss_agg = "seq-mean"`` and, on the
    embedded engine with the tiny default model (64 positions), ``rollout.extra_args =
    ["--context-length", num_digits + 2 + max_len]``."""
    num_digits: Positive = 2
    """Digits per prompt of the ``reverse`` task and of the workloads (their default: 1)."""
    longtail: LongTailConfig = msgspec.field(default_factory=LongTailConfig)
    """``longtail``: the response-length distribution."""
    agentic: AgenticConfig = msgspec.field(default_factory=AgenticConfig)
    """``agentic``: turns and the tool's latency distribution."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name == "longtail" and self.longtail.min_len < self.num_digits:
            raise ValueError(
                f"task.longtail.min_len ({self.longtail.min_len}) must be >= task.num_digits "
                f"({self.num_digits}): the answer is the response's first num_digits tokens"
            )

    seed: int = 0
    """Seed of the prompt stream."""
    path: str = ""
    """``math``: local ``.jsonl`` or ``.parquet`` file with one problem per row."""
    prompt_key: str = "question"
    """``math``: column holding the problem text."""
    answer_key: str = "answer"
    """``math``: column holding the integer answer (``#### 42`` / ``\\boxed{42}`` also accepted)."""
    system_prompt: str = ""
    """``math``: optional system message put before each problem."""
    prompt_format: Literal["auto", "chat", "raw"] = "auto"
    """``math``: ``chat``: the model's chat template over ``[system?, user: problem]``;
    ``raw``: the text itself (``system_prompt``, a space, the problem), after the model's
    BOS token if it has one, as for a base model; ``auto``: ``chat`` when the model's
    tokenizer has a chat template, else ``raw`` (the tiny default model has none)."""
    max_new_tokens: NonNegative = 0
    """``math``: generation budget per response (``rollout.max_new_tokens`` overrides it);
    0: 512, or 16 on the tiny default model (no ``model.path``: a 64-token context)."""
    shuffle: bool = True
    """``math``: visit the rows in a seeded random order each pass (else file order)."""
    agent: str = ""
    """``agent``: ``package.module:function``, ``async def fn(client, sample) -> float | None``
    with ``client`` an ``openai.AsyncOpenAI`` on the episode's gateway session; the float is
    the reward, None rejects the sample."""
    agent_command: list[str] = []
    """``agent`` without ``agent``: an external command (argv) run once per episode with
    ``OPENAI_BASE_URL`` (the episode's session), ``OPENAI_API_KEY`` (its key),
    ``ASYNCRL_SAMPLE`` (the sample as JSON) and ``ASYNCRL_REWARD_URL`` set; it posts
    ``{"reward": x}`` there before it exits (no reward, a non-zero exit or
    ``gateway.agent_timeout_s`` passing: the sample is rejected)."""
    reward_fn: str = ""
    """Custom reward replacing the task's own: ``package.module:function`` (importable, or a
    module in the working directory) or ``path/to/file.py:function``. The one reward
    signature, as ``ctx.reward``'s: ``fn(sample, response_ids) -> float`` (may be ``async
    def``); declare a keyword-only ``text`` (``fn(sample, response_ids, *, text)``) to get
    the decoded response. ``sample.answer`` holds the row's answer (``math``) or the digits.
    The old ``fn(sample, response_ids, response_text)`` still works, with a deprecation
    warning."""


class ControllerConfig(_Section, frozen=True):
    batch_size: Positive = 32
    """GRPO groups (prompts) per train step."""
    max_staleness: NonNegative = 1
    """A sample generated by policy version v may train at step t only if t - v <= this."""
    total_steps: Positive = 120
    """Train steps of the run."""
    stale_policy: Literal["drop", "regenerate"] = "regenerate"
    """What happens to a group that would exceed the staleness bound at its step."""
    max_retries: NonNegative = 3
    """Retries of a failed engine request before the episode is reported failed."""
    max_failed_groups: NonNegative = 64
    """The run stops (exit 1, naming the last cause) once this many groups in a row failed or
    were rejected, none finishing in between: a run whose every request fails (an engine's
    "bad request", a budget over the context), whose every agent raises or times out, or
    whose every episode returns None can never train. 0: never stop for that."""
    retry_backoff_s: NonNegativeFloat = 0.05
    """First back-off before retrying a failed request on another engine; doubles per retry."""
    retry_backoff_max_s: NonNegativeFloat = 2.0
    """Upper bound of one retry back-off."""
    outage_timeout_s: PositiveFloat = 300.0
    """How long a request waits while no engine is in rotation (every engine restarting,
    re-syncing or not answering) before its episode fails; such a wait is no retry."""
    health_interval_s: PositiveFloat = 1.0
    """How often engines out of rotation are probed for liveness (``/model_info``; SGLang's
    ``/health`` runs a generation and is never used as a probe)."""
    inline_reward_s: NonNegativeFloat = 0.0002
    """A sync reward function whose calls take less than this runs on the event loop (no
    thread hop); slower ones run in a worker thread. 0: always a thread."""
    batch_requests: bool = True
    """Generation requests to one engine with identical ``input_ids`` started in the same
    event-loop turn (a GRPO group's samples of one prompt) travel as one batched
    ``/generate``: one HTTP round trip and one prefill instead of ``group_size``. Each waits
    for the slowest of its batch (a group finishes with its slowest sample anyway; a
    multi-turn episode's first turn waits for its group's). False: one request each."""


class ExperienceConfig(_Section, frozen=True):
    host: str = "127.0.0.1"
    """Address the controller binds its experience and control sockets to."""
    max_message_mb: Positive = 256
    """Largest experience message a receiver accepts, MiB."""
    transport: Literal["tcp", "ipc"] = "tcp"
    """``tcp``: bind ``tcp://{host}:<free port>`` (reachable across hosts when ``host`` is);
    ``ipc``: a Unix socket in the run folder (one host)."""
    endpoint: str = ""
    """Explicit ZeroMQ endpoint the controller binds (e.g. ``tcp://10.0.0.5:5555``); overrides
    ``host`` and ``transport``."""
    credits: Positive = 4
    """Messages one producer may have unacknowledged at one trainer rank; a producer without
    credit waits (back-pressure), so this bounds memory on both sides."""
    heartbeat_s: PositiveFloat = 1.0
    """Interval of the trainer ranks' heartbeats to the producers."""
    peer_timeout_s: PositiveFloat = 30.0
    """A trainer rank silent this long is reported lost; its unacknowledged messages stay
    pending and are redelivered if it says hello again."""
    assignment: Literal["balanced", "modulo"] = "balanced"
    """How whole GRPO groups map to trainer ranks: ``balanced`` (equal group counts, token-
    balanced, per step) or ``modulo`` (group_id mod world size, stateless)."""
    shm: Literal["auto", "on", "off"] = "auto"
    """Same-host fast path: batch payloads go through a shared-memory ring per trainer rank
    (``/dev/shm``) and ZeroMQ carries only headers. ``auto``: for every trainer rank that
    shares the controller's ``/dev/shm`` (same host; frames for the others); ``on``: the
    same, but an error where ``/dev/shm`` is missing; ``off``: always frames."""
    shm_mb: Positive = 64
    """Size of each shared-memory ring (one per producer and trainer rank), MiB; a message
    that finds no room in it goes as frames."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.peer_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"experience.peer_timeout_s ({self.peer_timeout_s}) must exceed twice "
                f"experience.heartbeat_s ({self.heartbeat_s})"
            )


class ClusterConfig(_Section, frozen=True):
    backend: Literal["local", "ray"] = "local"
    """Where the run's processes live. ``local``: child processes of ``asyncrl run`` on this
    host. ``ray``: the same processes inside Ray actors placed on a Ray cluster (install
    ``asyncrl[ray]``); every address is discovered on the node a process runs on."""
    address: str = ""
    """``ray``: the cluster to join (``ray.init(address=...)``); empty: ``RAY_ADDRESS`` or the
    cluster this node belongs to (``"auto"``)."""
    node_address: str = ""
    """``ray``: this (the driver's) node's address as the cluster knows it (Ray's
    ``_node_ip_address``); empty: Ray finds it."""
    trainer_resources: dict[str, float] = msgspec.field(default_factory=dict)
    """``ray``: extra custom resources each trainer rank's actor requires (e.g. ``{"trainer" =
    1}`` to keep trainers on nodes that offer that resource)."""
    engine_resources: dict[str, float] = msgspec.field(default_factory=dict)
    """``ray``: extra custom resources each engine's actor requires."""
    cpus_per_trainer: NonNegativeFloat = 1.0
    """``ray``: CPUs reserved per trainer rank."""
    cpus_per_engine: NonNegativeFloat = 1.0
    """``ray``: CPUs reserved per engine."""
    colocate: bool = False
    """``ray``: place engine i on the GPU(s) of trainer rank i (needed by
    ``weights.backend = "cuda-ipc"``, which works only within one GPU)."""
    start_timeout_s: PositiveFloat = 300.0
    """``ray``: how long the run waits for the cluster to place an actor."""
    fork_server: Literal["auto", "on", "off"] = "auto"
    """``local``: start the trainer ranks and embedded engines by forking one process that
    imported torch, transformers and the model's class once (``asyncrl.forkserver``): each
    start and restart skips ~3 CPU-seconds of imports. ``auto``: on when no process of the
    run uses a GPU (a process forked after CUDA was initialised cannot use CUDA; the server
    never initialises it, but this is unchecked on GPUs yet); ``off``: every process is a
    fresh interpreter."""
    secret_file: str = ""
    """A file (mode 0600) holding the run secret: the Bearer key of every engine and the
    root of the experience channel's CURVE keys (docs/security.md). Give one when engines
    run outside the run (``rollout.urls``: start them with the same key). Empty:
    ``ASYNCRL_SECRET`` / ``ASYNCRL_SECRET_FILE`` from the environment, else a fresh secret
    per run. Only the path is recorded, never the secret."""


class CheckpointConfig(_Section, frozen=True):
    every_steps: NonNegative = 20
    """Checkpoint the whole run (trainer + controller) into ``RUN_DIR/checkpoints/step-N``
    every this many train steps (also on SIGTERM/SIGINT and at the end); 0: only at those."""
    keep: Positive = 2
    """Complete checkpoints kept (the oldest are deleted once a newer one is complete)."""
    export_hf: bool = False
    """Also export the actor as a Hugging Face folder inside every checkpoint (``hf/``); the
    final policy is always exported to ``RUN_DIR/final``."""
    on_signal: bool = True
    """SIGTERM / first SIGINT: checkpoint the run before stopping (a second signal stops at
    once)."""
    timeout_s: PositiveFloat = 600.0
    """How long the run waits for the trainer to finish writing one checkpoint."""


class TraceConfig(_Section, frozen=True):
    enabled: bool = True
    """Write the run's timeline, ``RUN_DIR/trace.json`` (Chrome / Perfetto trace events)."""
    every: Positive = 1
    """Sampling for long runs: trace the work of every ``every``-th step (policy version)."""
    max_mb: PositiveFloat = 128.0
    """Each process stops tracing once its file holds this many MB (and marks where). 128: the
    merged ``trace.json`` of a controller, an engine and a trainer stays under ~400 MB, which
    Perfetto's in-browser UI still opens (its ~2 GB of memory holds a JSON trace 2-4x its
    size; a 900 MB one fails); the default job writes ~56 KB per step (~2,000 steps fit)."""


class TensorBoardConfig(_Section, frozen=True):
    enabled: bool = False
    """Also log every metric to TensorBoard (the ``tensorboard`` extra)."""
    log_dir: str = ""
    """Event file folder; empty: ``RUN_DIR/tensorboard``."""


class WandbConfig(_Section, frozen=True):
    enabled: bool = False
    """Also log every metric to Weights & Biases (the ``wandb`` extra)."""
    project: str = "asyncrl"
    """The W&B project the run is logged to."""
    name: str = ""
    """The W&B run's name; empty: the run folder's name."""
    mode: Literal["online", "offline"] = "online"
    """``offline``: write the run under ``RUN_DIR/wandb`` only (``wandb sync`` uploads it)."""
    entity: str = ""
    """The W&B team or user the project belongs to; empty: your default entity."""


class LoggingConfig(_Section, frozen=True):
    trace: TraceConfig = msgspec.field(default_factory=TraceConfig)
    """The run's timeline, ``RUN_DIR/trace.json`` (Perfetto)."""
    tensorboard: TensorBoardConfig = msgspec.field(default_factory=TensorBoardConfig)
    """Every metric to TensorBoard as well (the ``tensorboard`` extra)."""
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)
    """Every metric to Weights & Biases as well (the ``wandb`` extra)."""
    trajectories: bool = False
    """Write every trained trajectory to ``RUN_DIR/trajectories.jsonl`` (step, session,
    episode, group, reward, and per token of the prompt then the response: token_ids,
    loss_mask, logprobs, versions; the schema: docs/trajectories.md)."""


class RunConfig(_Section, frozen=True):
    """A whole run's configuration: one section per part (``RunConfig()`` is the embedded
    default job). Built by :func:`~asyncrl.load_config` from a TOML file and
    ``--section.key=value`` overrides; every field, its default and meaning:
    docs/config.md (``asyncrl config``)."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """The policy model: a local Hugging Face folder, or the tiny default model."""
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    """What the episodes are: a built-in task, its data and reward, or an OpenAI-API agent."""
    rollout: RolloutConfig = msgspec.field(default_factory=LocalRolloutConfig)
    """The rollout engines: which family, how many, where, sampling, pausing for updates."""
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    """The trainer processes: optimizer, micro-batching, precision, devices
    (docs/train-engine.md)."""
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    """The RL algorithm (GRPO or PPO), its objective and its corrections (docs/algorithms.md)."""
    controller: ControllerConfig = msgspec.field(default_factory=ControllerConfig)
    """Admission under the staleness bound, batches, steps, retries (docs/controller.md)."""
    weights: WeightSyncConfig = msgspec.field(default_factory=AutoWeightsConfig)
    """How trainer weights reach the engines after each step (docs/weight-sync.md)."""
    experience: ExperienceConfig = msgspec.field(default_factory=ExperienceConfig)
    """The channel trajectories travel from the controller to the trainer ranks
    (docs/experience-transport.md)."""
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    """Where the processes run (this host or a Ray cluster) and the run secret
    (docs/cluster.md, docs/security.md)."""
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    """Run checkpoints and resume (docs/fault-tolerance.md)."""
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    """The timeline, metric sinks and the trajectories file (docs/observability.md)."""
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    """The OpenAI-compatible gateway agent runs use (docs/agents.md)."""
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    """Train a LoRA adapter instead of the whole model, pushed adapter-only."""
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    """Evaluation during training: held-out prompts, how often, how (docs/algorithms.md)."""
    run_dir: str = ""
    """Output folder (metrics.jsonl, config.json, logs). Empty: a new folder under ``runs/``."""
    seed: int = 0
    """Seed of model init, sampling and training."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.rollout, SGLangRolloutConfig) and isinstance(
            self.weights, CudaIpcWeightsConfig
        ):
            raise ValueError(
                "weights.backend='cuda-ipc' works with rollout.backend='local' only: SGLang's "
                "scheduler dies on asyncrl's CUDA IPC descriptor (load_format='asyncrl_ipc'); "
                "use weights.backend='nccl' (or 'auto') with rollout.backend='sglang'"
            )
        if isinstance(self.rollout, VLLMRolloutConfig) and isinstance(
            self.weights, CudaIpcWeightsConfig
        ):
            raise ValueError(
                "weights.backend='cuda-ipc' works with rollout.backend='local' only: vLLM's "
                "IPC weight transfer takes pickled handles (vllm/distributed/weight_transfer/"
                "clients.py:26-47), which asyncrl does not send; use weights.backend='nccl' "
                "(or 'auto', 'gloo') with rollout.backend='vllm'"
            )
        self._check_lora()

    def _check_lora(self) -> None:
        """What a LoRA run (``lora.rank > 0``) cannot be combined with (yet), by key."""
        if not self.lora.enabled:
            return
        if not isinstance(self.weights, CudaIpcWeightsConfig) and self.weights.delta != "off":
            raise ValueError(
                "weights.delta must be 'off' with lora.rank > 0 (an adapter push is small and "
                "loads beside the served versions, never into them)"
            )

    def generation_budget(self) -> int:
        """Most response tokens of one episode of a built-in task (the one rule; the embedding
        API's episodes get ``rollout.max_new_tokens or DEFAULT_MAX_NEW_TOKENS``):
        ``rollout.max_new_tokens`` when set, else the task's own: ``num_digits + 1`` for
        ``reverse`` and per turn of ``agentic`` (the digits and the end token),
        ``task.longtail.max_len`` for ``longtail``, ``task.max_new_tokens`` for ``math``
        (0: ``MATH_BUDGET``, or ``TINY_MATH_BUDGET`` on the tiny default model, whose
        context is 64 tokens); per completion of ``agent`` (a request naming no
        ``max_tokens``), ``task.max_new_tokens`` or ``DEFAULT_MAX_NEW_TOKENS``."""
        if self.rollout.max_new_tokens > 0:
            return self.rollout.max_new_tokens
        if self.task.name == "agent":
            return self.task.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        if self.task.name == "longtail":
            return self.task.longtail.max_len
        if self.task.name in ("reverse", "agentic"):
            return self.task.num_digits + 1
        if self.task.max_new_tokens:
            return self.task.max_new_tokens
        return MATH_BUDGET if self.model.path else TINY_MATH_BUDGET
