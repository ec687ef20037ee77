"""The ``task`` section: one config type per task (tag ``name``), each with only its own keys.

``[task] name = "math"`` picks :class:`MathTaskConfig`; an omitted ``name`` is ``reverse``
(the default job). A key of another task is refused, naming the task(s) it belongs to. What
the choice of task decides beyond its own keys is said here, once, by the type: the task's
own generation budget (``own_budget``), its prompt length for the context
check, which tiny default model it runs on, whether the run serves the gateway, its held-out
split and the defaults it changes in other sections (:meth:`~_TaskBase.defaults`). What it
*builds* (the task, its episodes) is :func:`asyncrl.task_factory.build_task`'s.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

from asyncrl.config.base import NonNegative, Positive, PositiveFloat, _Section
from asyncrl.config.rollout import DEFAULT_MAX_NEW_TOKENS

TaskName: TypeAlias = Literal["reverse", "math", "agent", "longtail", "agentic"]

MATH_BUDGET = 512
"""The ``math`` task's generation budget when ``task.max_new_tokens`` is 0."""
TINY_MATH_BUDGET = 16
"""... on the tiny default model (a 64-token context: room for the prompt)."""


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


class DataSource(_Section, frozen=True):
    """One source of rows (``task.sources = [{path = "a.jsonl", weight = 3}, ...]``, or
    ``eval.sources``): a file or dataset folder, its share of the stream, and column names
    where they differ from the task's."""

    path: str
    """A ``.jsonl`` / ``.parquet`` file or a folder written by Hugging Face ``datasets``'
    ``save_to_disk`` (one split: ``folder/train`` for a ``DatasetDict``)."""
    weight: PositiveFloat = 1.0
    """Mixing weight: each sample comes from this source with probability ``weight`` over the
    sum of the sources' weights (seeded by ``task.seed``)."""
    name: str = ""
    """The source's name, carried by its samples (``sample.source``) and used in per-source
    eval metrics (``eval/<name>/...``); empty: the file or folder name without its suffix."""
    prompt_key: str = ""
    """This source's prompt column; empty: ``task.prompt_key``."""
    messages_key: str = ""
    """This source's chat-messages column; empty: ``task.messages_key``."""
    answer_key: str = ""
    """This source's answer column; empty: ``task.answer_key``."""

    @property
    def label(self) -> str:
        """``name``, else the path's last part without its suffix."""
        if self.name:
            return self.name
        stem = self.path.rstrip("/").rsplit("/", 1)[-1]
        return stem.rsplit(".", 1)[0] if "." in stem else stem


class RewardSpec(_Section, frozen=True):
    """One reward function of several (``task.rewards = [{fn = "pkg.mod:fn", weight = 1.0,
    name = "format"}, ...]``): each is logged on its own (``reward/<name>_mean``), the
    trajectory's reward is their weighted combination (``task.reward_aggregation``)."""

    fn: str
    """``package.module:function`` or ``path/to/file.py:function`` (the one reward signature,
    as ``task.reward_fn``'s), or ``task``: the task's own reward."""
    weight: float = 1.0
    """Its weight in the combination (negative: a penalty; 0: logged only). The weights must
    sum to more than 0."""
    name: str = ""
    """Its name in metrics (``reward/<name>_mean``) and in ``Trajectory.rewards``; empty: the
    function's name (``task`` for the task's own)."""

    @property
    def label(self) -> str:
        """``name``, else the function's name."""
        if self.name:
            return self.name
        return self.fn.rpartition(":")[2] if ":" in self.fn else self.fn.rpartition(".")[2]


RewardAggregation: TypeAlias = Literal["sum", "normalize_then_sum"]


class _TaskBase(_Section, frozen=True, tag_field="name"):
    """What every task takes; ``name`` (the tag) picks the subclass.

    Every task type also defines (``TaskConfig``, the union of them, is what callers hold,
    so mypy checks each type has both):

    - ``own_budget(tiny: bool) -> int``: the most response tokens of one episode (per turn
      of ``agentic``, per completion of ``agent``) when ``rollout.max_new_tokens`` is 0;
      ``tiny``: no ``model.path`` (the tiny default model);
    - ``budget_key: str`` (property): the key that sets it (named when it does not fit the
      context)."""

    seed: int = 0
    """Seed of the prompt stream."""

    @property
    def name(self) -> TaskName:
        """The tag: which task this is."""
        return typing.cast(TaskName, self.__struct_config__.tag)

    def prompt_tokens(self) -> int | None:
        """Tokens of the longest prompt an episode sends, where the task fixes it; None: it
        depends on the data (at least 1)."""
        return None

    @property
    def chat_model(self) -> bool:
        """Whether the run's tiny default model (no ``model.path``) is the chat one: a task
        whose episodes need a chat template (agents)."""
        return False

    @property
    def serves_gateway(self) -> bool:
        """Whether the run serves the OpenAI-compatible gateway (``gateway.enabled``)."""
        return False

    @property
    def workload(self) -> bool:
        """Whether the task is a learning workload (``asyncrl.tasks.workloads``: long
        responses or many turns, for which the engines may be given a longer context)."""
        return False

    @property
    def single_turn(self) -> bool:
        """Whether the task is a prompt stream and a reward (``asyncrl.tasks.make_task``),
        which is also what evals run on."""
        return False

    def held_out(
        self, seed_offset: int, path: str, sources: tuple[DataSource, ...] = ()
    ) -> TaskConfig:
        """The task's held-out split for evals: another ``seed`` (``seed_offset`` added) and,
        for a file-backed task, ``path`` or ``sources`` (``eval.path`` / ``eval.sources``).
        ValueError naming the keys for a task without one."""
        raise ValueError(
            f"eval runs on the single-turn tasks ('reverse', 'math'), not task.name={self.name!r}: "
            "set eval.every_steps=0, eval.before_train=false and eval.at_end=false, or "
            "evaluate from the embedding API (await ctl.evaluate(...))"
        )

    @classmethod
    def defaults(cls, tree: dict[str, Any]) -> dict[str, Any]:
        """The defaults this task changes in other sections, as dotted keys -> values, for the
        config tree ``tree`` (set where the tree gives no value). Empty for most tasks."""
        return {}


class _SingleTurnBase(_TaskBase, frozen=True):
    """A prompt stream and a reward for one response; its reward may be the user's."""

    reward_fn: str = ""
    """Custom reward replacing the task's own: ``package.module:function`` (importable, or a
    module in the working directory) or ``path/to/file.py:function``. The one reward
    signature, as ``ctx.reward``'s: ``fn(sample, response_ids) -> float`` (may be ``async
    def``); declare a keyword-only ``text`` (``fn(sample, response_ids, *, text)``) to get
    the decoded response. ``sample.answer`` holds the row's answer (``math``) or the digits.
    The old ``fn(sample, response_ids, response_text)`` still works, with a deprecation
    warning."""
    rewards: list[RewardSpec] = []
    """Several reward functions with weights, instead of ``reward_fn``: ``[{fn = "task"},
    {fn = "my_rewards:brevity", weight = 0.5}]``. Each is kept on the trajectory
    (``Trajectory.rewards[name]``) and logged on its own (``reward/<name>_mean``, and
    ``eval/reward/<name>_mean`` in eval rows); the trajectory's ``reward`` is their weighted
    sum."""
    reward_aggregation: RewardAggregation = "sum"
    """How ``rewards`` make the advantage: ``sum``: the weighted sum is the reward, and the
    estimator (``algo.name``) runs on it (TRL's ``sum_then_normalize``);
    ``normalize_then_sum`` (``algo.name = "grpo"`` only; TRL 1.16's
    ``multi_objective_aggregation``, GDPO): each function normalised within its group,
    ``(x - mean) / (std + 1e-4)``, then the weighted sum, then the advantage is that sum
    normalised over the batch, ``(r - mean) / (std + 1e-4)`` (``algo.scale_rewards`` does
    not apply)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_rewards(self.reward_fn, self.rewards, self.reward_aggregation)

    @property
    def single_turn(self) -> bool:
        return True


class ReverseTaskConfig(_SingleTurnBase, frozen=True, tag="reverse"):
    """``task.name = "reverse"`` (the default): repeat ``num_digits`` digits in reverse order;
    reward = the fraction of positions right; generation budget ``num_digits + 1`` (the digits
    and the end token)."""

    num_digits: Positive = 2
    """Digits per prompt."""

    def own_budget(self, tiny: bool) -> int:
        return self.num_digits + 1

    @property
    def budget_key(self) -> str:
        return "task.num_digits"

    def prompt_tokens(self) -> int | None:
        return self.num_digits + 2  # BOS, the digits, "="

    def held_out(
        self, seed_offset: int, path: str, sources: tuple[DataSource, ...] = ()
    ) -> ReverseTaskConfig:
        if path or sources:
            raise ValueError(
                "eval.path / eval.sources hold rows of the 'math' task's format; "
                "task.name='reverse' has its own eval split (leave eval.path empty)"
            )
        return msgspec.structs.replace(self, seed=self.seed + seed_offset)


class MathTaskConfig(_SingleTurnBase, frozen=True, tag="math"):
    """``task.name = "math"``: prompts from local data (``path``, or several ``sources`` mixed
    by weight: JSONL, Parquet or a ``datasets.save_to_disk`` folder), rendered with the model's
    chat template (``prompt_format``); reward 1 when the last integer in the response equals
    the answer, else 0. Each sample carries its source's name (``sample.source``) and the
    ``extra_keys`` columns (``sample.fields``) to the reward."""

    path: str = ""
    """Local ``.jsonl`` or ``.parquet`` file, or a folder written by Hugging Face ``datasets``'
    ``save_to_disk``, one problem per row (the one-source form of ``sources``)."""
    sources: list[DataSource] = []
    """Several sources mixed by weight, instead of ``path``: ``[{path = "a.jsonl", weight =
    3}, {path = "b.parquet", weight = 1, prompt_key = "problem"}]``."""
    prompt_key: str = "question"
    """Column holding the problem text."""
    messages_key: str = "messages"
    """Column holding a chat (a list of ``{role, content}``), used for a row without
    ``prompt_key``: rendered with the chat template (``raw``: the contents joined by spaces);
    ``system_prompt`` is put first when the chat has no system message."""
    answer_key: str = "answer"
    """Column holding the integer answer (``#### 42`` / ``\\boxed{42}`` also accepted)."""
    extra_keys: list[str] = []
    """Further columns each row must hold, passed to the reward in ``sample.fields`` (a dict:
    column -> value, plain data)."""
    system_prompt: str = ""
    """Optional system message put before each problem."""
    prompt_format: Literal["auto", "chat", "raw"] = "auto"
    """``chat``: the model's chat template over ``[system?, user: problem]``; ``raw``: the
    text itself (``system_prompt``, a space, the problem), after the model's BOS token if it
    has one, as for a base model; ``auto``: ``chat`` when the model's tokenizer has a chat
    template, else ``raw`` (the tiny default model has none)."""
    max_new_tokens: NonNegative = 0
    """Generation budget per response (``rollout.max_new_tokens`` overrides it); 0: 512, or
    16 on the tiny default model (no ``model.path``: a 64-token context)."""
    shuffle: bool = True
    """Visit the rows in a seeded random order each pass (else file order)."""

    def own_budget(self, tiny: bool) -> int:
        return self.max_new_tokens or (TINY_MATH_BUDGET if tiny else MATH_BUDGET)

    @property
    def budget_key(self) -> str:
        return "task.max_new_tokens"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path and self.sources:
            raise ValueError("task.path and task.sources are exclusive: give one or the other")

    def all_sources(self) -> list[DataSource]:
        """The sources rows come from: ``sources``, else ``path`` as the one source."""
        return list(self.sources) or ([DataSource(path=self.path)] if self.path else [])

    def held_out(
        self, seed_offset: int, path: str, sources: tuple[DataSource, ...] = ()
    ) -> MathTaskConfig:
        if not path and not sources:
            raise ValueError(
                "eval with task.name='math' needs eval.path or eval.sources (held-out rows)"
            )
        return msgspec.structs.replace(
            self, seed=self.seed + seed_offset, path=path, sources=list(sources), shuffle=False
        )


class AgentTaskConfig(_TaskBase, frozen=True, tag="agent"):
    """``task.name = "agent"``: an OpenAI-API agent (``agent``, or the command
    ``agent_command``) runs once per episode against the gateway, on samples from ``path``
    (or several ``sources`` mixed by weight: JSONL, Parquet or a ``datasets.save_to_disk``
    folder, as the ``math`` task reads them; rows: ``prompt`` or ``messages``, ``answer``) or,
    without data, the built-in weather chat task (``prompt`` "What is the weather in CITY?",
    ``answer`` the city; an agent for it: ``examples/agents.py:weather_agent``). Without
    ``model.path`` the run uses the tiny chat model (agents need a chat template)."""

    path: str = ""
    """Local ``.jsonl`` or ``.parquet`` file, or a ``datasets`` ``save_to_disk`` folder, of
    samples, one per row: ``prompt`` (text) or ``messages`` (a chat), and ``answer``. Empty
    (and no ``sources``): the built-in weather task's samples."""
    sources: list[DataSource] = []
    """Several sources mixed by weight, instead of ``path`` (``task.sources`` of ``math``)."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (``sample.prompt``)."""
    messages_key: str = "messages"
    """Column holding a chat (``sample.messages``: a list of ``{role, content}``), for a row
    without ``prompt_key``."""
    answer_key: str = "answer"
    """Column holding the answer (``sample.answer``, any JSON value; may be absent)."""
    extra_keys: list[str] = []
    """Further columns each row must hold, passed to the agent in ``sample.fields``."""
    shuffle: bool = False
    """Visit the rows in a seeded random order each pass (else file order, again and again)."""
    agent: str = ""
    """``package.module:function`` (or ``path/to/file.py:function``), ``async def fn(client,
    sample) -> float | None`` with ``client`` an ``openai.AsyncOpenAI`` on the episode's
    gateway session; the float is the reward, None rejects the sample."""
    agent_command: list[str] = []
    """Without ``agent``: an external command (argv) run once per episode with
    ``OPENAI_BASE_URL`` (the episode's session), ``OPENAI_API_KEY`` (its key),
    ``ASYNCRL_SAMPLE`` (the sample as JSON) and ``ASYNCRL_REWARD_URL`` set; it posts
    ``{"reward": x}`` there before it exits (no reward, a non-zero exit or
    ``gateway.agent_timeout_s`` passing: the sample is rejected)."""
    max_new_tokens: NonNegative = 0
    """Generation budget of a completion whose request names no ``max_tokens``
    (``rollout.max_new_tokens`` overrides it); 0: ``DEFAULT_MAX_NEW_TOKENS`` (128)."""

    def own_budget(self, tiny: bool) -> int:
        return self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS

    @property
    def budget_key(self) -> str:
        return "task.max_new_tokens"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path and self.sources:
            raise ValueError("task.path and task.sources are exclusive: give one or the other")

    def all_sources(self) -> list[DataSource]:
        """The sources rows come from: ``sources``, else ``path`` as the one source (none:
        the built-in weather task)."""
        return list(self.sources) or ([DataSource(path=self.path)] if self.path else [])

    @property
    def chat_model(self) -> bool:
        return True

    @property
    def serves_gateway(self) -> bool:
        return True


class LongTailTaskConfig(_TaskBase, frozen=True, tag="longtail"):
    """``task.name = "longtail"``: a learning workload where asynchrony pays — the reverse
    task with heavy-tailed response lengths (knobs in ``task.longtail``), reward the reverse
    task's partial credit. It changes these defaults in other sections (a key the file or the
    command line sets wins): ``algo.loss_agg = "seq-mean"`` (each response weighs 1, however
    long its tail) and, on the embedded engine with the tiny default model (64 positions),
    ``rollout.extra_args = ["--context-length", num_digits + 2 + max_len]``."""

    num_digits: Positive = 1
    """Digits per prompt (the answer is the response's first ``num_digits`` tokens)."""
    longtail: LongTailConfig = msgspec.field(default_factory=LongTailConfig)
    """The response-length distribution."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.longtail.min_len < self.num_digits:
            raise ValueError(
                f"task.longtail.min_len ({self.longtail.min_len}) must be >= task.num_digits "
                f"({self.num_digits}): the answer is the response's first num_digits tokens"
            )

    @property
    def workload(self) -> bool:
        return True

    def own_budget(self, tiny: bool) -> int:
        return self.longtail.max_len

    @property
    def budget_key(self) -> str:
        return "task.longtail.max_len"

    def prompt_tokens(self) -> int | None:
        return self.num_digits + 2

    @classmethod
    def defaults(cls, tree: dict[str, Any]) -> dict[str, Any]:
        task, model, rollout = (tree.get(k) or {} for k in ("task", "model", "rollout"))
        out: dict[str, Any] = {"algo.loss_agg": "seq-mean"}
        digits = task.get("num_digits") or cls().num_digits
        max_len = (task.get("longtail") or {}).get("max_len") or LongTailConfig().max_len
        local = rollout.get("backend") in (None, "local")
        tiny = not model.get("path") and not rollout.get("urls")
        if local and tiny and isinstance(digits, int) and isinstance(max_len, int):
            out["rollout.extra_args"] = ["--context-length", str(digits + 2 + max_len)]
        return out


class AgenticTaskConfig(_TaskBase, frozen=True, tag="agentic"):
    """``task.name = "agentic"``: a learning workload where asynchrony pays — multi-turn
    episodes of the reverse task waiting on a slow tool between turns (knobs in
    ``task.agentic``), reward the mean partial credit of the turns; generation budget
    ``num_digits + 1`` per turn."""

    num_digits: Positive = 1
    """Digits per question (each turn's)."""
    agentic: AgenticConfig = msgspec.field(default_factory=AgenticConfig)
    """Turns and the tool's latency distribution."""

    @property
    def workload(self) -> bool:
        return True

    def own_budget(self, tiny: bool) -> int:
        return self.num_digits + 1

    @property
    def budget_key(self) -> str:
        return "task.agentic.turns"

    def prompt_tokens(self) -> int | None:
        # the last turn's prompt: the first question, then every earlier answer and question
        return self.num_digits + 2 + (self.agentic.turns - 1) * (2 * self.num_digits + 3)


def check_rewards(
    reward_fn: str, rewards: list[RewardSpec], aggregation: RewardAggregation
) -> None:
    """ValueError naming the key when ``task.rewards`` cannot be combined: given with
    ``task.reward_fn``, a name twice, weights summing to 0 or less, ``normalize_then_sum``
    without ``task.rewards``."""
    if reward_fn and rewards:
        raise ValueError(
            "task.reward_fn and task.rewards are exclusive: give one function or several "
            '(task.rewards = [{fn = "task"}, {fn = "pkg.mod:fn", weight = 0.5}])'
        )
    names = [r.label for r in rewards]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(
            f"task.rewards names {dup} more than once: give each function its own name "
            '({fn = "...", name = "..."})'
        )
    for n in names:
        if not n or "/" in n:
            raise ValueError(f"task.rewards name {n!r} must be non-empty and hold no '/'")
    if rewards and sum(r.weight for r in rewards) <= 0:
        weights = [r.weight for r in rewards]
        raise ValueError(
            f"task.rewards weights {weights} sum to {sum(weights):g}: they must sum to more "
            "than 0 (a negative weight is a penalty beside a positive one)"
        )
    if aggregation == "normalize_then_sum" and not rewards:
        raise ValueError(
            "task.reward_aggregation='normalize_then_sum' normalises each of task.rewards "
            "within its group: name the functions in task.rewards"
        )


TaskConfig: TypeAlias = (
    ReverseTaskConfig | MathTaskConfig | AgentTaskConfig | LongTailTaskConfig | AgenticTaskConfig
)
"""The ``task`` section: one type per ``task.name``."""
