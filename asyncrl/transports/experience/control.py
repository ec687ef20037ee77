"""Control messages of the experience channel: what the controller and the trainer ranks
tell each other beside the batches (the step announcement, save and restore, the engine
set, shutdown). Framing and flow control (Hello, Credit, Ring, TrainBatch) are in
``wire.py``; the protocol is in ``zmq_send.py``.

    producer -> consumer   Save, Shutdown, Engines
    consumer -> producer   StepDone (the version announcement of the trainer), Saved,
                           Synced, EnginesSynced, Shutdown
    producer-local         ConsumerLost
"""

from __future__ import annotations

import msgspec

__all__ = [
    "ConsumerLost",
    "Engines",
    "EnginesSynced",
    "Save",
    "Saved",
    "Shutdown",
    "StepDone",
    "Synced",
]

# Every wire Struct below is array_like (positional), gc=False (untracked), omit_defaults and
# forbid_unknown_fields: an extra trailing element is rejected, never silently ignored.


class StepDone(
    msgspec.Struct,
    tag="step_done",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Trainer -> producers (version announcement): step ``step`` is trained and ``version``
    is live on the engines."""

    step: int
    version: int
    metrics: dict[str, float] = {}


class Save(
    msgspec.Struct,
    tag="save",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Producer -> every consumer, in order after the batch of step ``step - 1``: save the
    trainer's state (every step before ``step`` trained) under ``checkpoint`` and/or export
    the actor as a Hugging Face folder to ``export`` ("": not asked)."""

    step: int
    checkpoint: str = ""
    export: str = ""


class Saved(
    msgspec.Struct,
    tag="saved",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Consumer rank 0 -> producers: what :class:`Save` asked for of ``step`` is on disk on
    every rank. ``stall_s``: how long training stood still for it (the rest ran in the
    background); ``save_s``: from the request to the files being complete."""

    step: int
    stall_s: float = 0.0
    save_s: float = 0.0
    error: str = ""


class Synced(
    msgspec.Struct,
    tag="synced",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Consumer rank 0 -> producers: a (re)started trainer restored step ``step`` from a
    checkpoint and the engines now serve its weights as ``version``."""

    step: int
    version: int


class Shutdown(
    msgspec.Struct,
    tag="shutdown",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Either side: stop after this message; ``reason`` says why. From the trainer,
    ``error`` is a failure the run may survive by restarting the trainer; ``fatal`` one it
    cannot (e.g. SGLang engines whose weights a failed push left undefined): the run stops
    with ``reason``."""

    reason: str = ""
    error: bool = False
    fatal: bool = False


class Engines(
    msgspec.Struct,
    tag="engines",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Producer -> every trainer rank: the rollout engines are now ``urls`` (one restarted,
    joined or left), as of the run's ``epoch``-th change of its engine set.

    Sent twice. On the data connection, between steps (never inside one step's messages):
    rank 0 re-forms the weight group with them and pushes the current weights (the other
    ranks take part in gathering them), then answers :class:`EnginesSynced`. On the control
    connection at once, as a notice (``ExperienceSender.notify``): rank 0's weight sender
    takes the new set for its next push and stops waiting on an engine that is not in it,
    while the trainer is still busy with a step. The newer ``epoch`` wins."""

    urls: list[str]
    epoch: int = 0


class EnginesSynced(
    msgspec.Struct,
    tag="engines_synced",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Trainer rank 0 -> producers: every engine of ``urls`` holds weight ``version``;
    ``error`` says why not (the engines keep their old weights)."""

    urls: list[str]
    version: int
    error: str = ""


class ConsumerLost(
    msgspec.Struct,
    tag="lost",
    array_like=True,
    gc=False,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Producer-local report: consumer ``rank`` went silent with messages unacknowledged.

    ``seqs`` and ``episode_ids`` name what it had not acked; they stay pending
    and are redelivered, in order, when the rank says Hello again.
    """

    rank: int
    seqs: list[int]
    episode_ids: list[int]
