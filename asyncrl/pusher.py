"""The embedding API's weight sync: your own trainer's weights into the engines a
:class:`~asyncrl.Controller` generates with (sending side, in your process).

``asyncrl run`` pushes from its trainer process; a user who embeds the controller in
their own loop trains in their own process and pushes from there with
:class:`WeightPusher`, over the same transport (``weights.*`` of the run's config: Gloo
on CPU, NCCL on CUDA, CUDA IPC for colocated engines; the engine family from
``rollout.backend``). See docs/weight-sync.md for what each engine family guarantees.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from asyncrl.controllers.controller import Controller
    from asyncrl.transports.weights.base import WeightTransport

__all__ = ["WeightPusher"]


class WeightPusher:
    """Pushes a trainer's weights into the controller's engines, then tells the controller.

    ``async with WeightPusher(ctl) as weights:`` forms the weight group with the engines of
    ``ctl.config.rollout.urls`` (or ``engine_urls``); then, after each optimizer step,
    ``await weights.push(model.state_dict().items(), version)``.

    Contract of :meth:`push`:

    - the tensors are read (the iterable consumed) in a worker thread while the caller
      awaits, so they must not change before it returns; it returns once every engine
      holds them, verified, as ``version`` (Hugging Face parameter names, any dtype: the
      engine casts to its own); only then is ``ctl.set_version(version)`` called, which
      opens admission for the next step. Versions must increase.
    - the engines pause only as ``weights.pause_scope`` says (around the switch, by
      default) with ``rollout.pause_mode``; requests a pause aborted are resumed by their
      episodes, so no episode sees the push. Generation always goes on afterwards.
    - a failed push raises :class:`~asyncrl.transports.weights.base.WeightSyncError`
      naming the engine; the embedded engine then keeps its previous weights and version
      (SGLang/vLLM: see docs/weight-sync.md), the controller's version is not moved, and
      the next push re-forms the group.
    - it must not run concurrently with another push of the same pusher.

    ``device``: where the pushed tensors live (``cpu``, ``cuda``...): it picks the
    collective backend when ``weights.backend = "auto"``. Forming the group and pushing
    block in a worker thread, never the event loop; torch is imported only then.
    """

    def __init__(
        self,
        controller: Controller,
        device: str = "cpu",
        engine_urls: Sequence[str] | None = None,
    ):
        urls = list(engine_urls if engine_urls is not None else controller.config.rollout.urls)
        if not urls:
            raise ValueError(
                "WeightPusher needs the engines' URLs: rollout.urls is empty (pass engine_urls=)"
            )
        self.controller = controller
        self.device = device
        self.engine_urls = urls
        self._transport: WeightTransport | None = None

    async def __aenter__(self) -> WeightPusher:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Form the weight group with every engine (again, if formed: a restarted engine
        joins this way). Raises ValueError when ``weights.backend`` cannot run here."""
        if self._transport is None:
            from asyncrl.engines.rollout.factory import make_weight_transport

            cfg = self.controller.config
            self._transport = make_weight_transport(
                cfg.weights, self.engine_urls, self.device, cfg.rollout.pause_mode, cfg.rollout
            )
        await asyncio.to_thread(self._transport.connect)

    async def push(
        self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> dict[str, float]:
        """Deliver ``named_weights`` to every engine as ``version``, then
        ``controller.set_version(version)``; returns the push's timing stats (seconds,
        bytes). See the class docstring for the contract."""
        if self._transport is None:
            raise RuntimeError("WeightPusher.push() before connect(): use `async with`")
        transport = self._transport

        def deliver() -> dict[str, float]:  # every wait inside has the transport's timeouts
            return transport.push(named_weights, version).wait()

        stats = await asyncio.to_thread(deliver)
        await self.controller.set_version(version)
        return stats

    async def close(self) -> None:
        """Wait for the push in flight and tear the weight group down (engines keep serving)."""
        transport, self._transport = self._transport, None
        if transport is not None:
            await asyncio.to_thread(transport.close)
