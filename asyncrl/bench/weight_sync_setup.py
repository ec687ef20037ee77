"""What the weight-sync benchmark pushes against: the model's shapes and bits, the
receiving processes, and the link's floor (run by ``asyncrl bench weight-sync``).

Contract: :data:`MODELS` names the Qwen2 sizes (shapes from a local ``Qwen2Config``, no
download); :func:`random_weights` makes the sender's tensors (random bits, one flat
buffer or one allocation each); :class:`Children` starts the receiving side's processes
(children of this process, or processes in Ray actors on another node) running this
benchmark's hidden modes: :func:`serve_engine` (a real embedded engine around the
model's shapes, uninitialised) and :func:`floor_peer` (the floor's receiving rank);
:class:`Floor` times one flat transfer of the same bytes on the same link; :func:`cpu_s`
reads the CPU seconds of this process and its children from ``/proc``.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from typing import Any

from asyncrl.bench.common import qwen2
from asyncrl.procs import cpu_seconds

__all__ = [
    "DEVICE",
    "MODELS",
    "Children",
    "Floor",
    "cpu_s",
    "floor_peer",
    "model_shapes",
    "random_weights",
    "serve_engine",
]

MODELS: dict[str, dict[str, Any]] = {  # Qwen2Config keyword arguments
    "tiny": qwen2(64, 128, 2, 4, 2, 1024, tie_word_embeddings=True),  # a smoke run, unmeasured
    "qwen2-0.5b": qwen2(896, 4864, 24, 14, 2, 151936, tie_word_embeddings=True),
    "qwen2-1.5b": qwen2(1536, 8960, 28, 12, 2, 151936, tie_word_embeddings=True),
}
DEVICE = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu", "cuda-ipc": "cuda"}


def model_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        m = Qwen2ForCausalLM(Qwen2Config(**MODELS[model]))
    return [(n, tuple(p.shape)) for n, p in m.named_parameters()]


def serve_engine(args: argparse.Namespace) -> None:
    """A real engine process: the embedded server around the model's shapes (uninitialised)."""
    import torch
    from aiohttp import web
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl import secret
    from asyncrl.engines.rollout.local.engine import LocalEngine
    from asyncrl.engines.rollout.local.server import EngineServer, build_app
    from asyncrl.loops import new_event_loop

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**MODELS[args.model], dtype=args.dtype))
    device = DEVICE[args.backend]
    model = model.to_empty(device=device).to(getattr(torch, args.dtype))
    model.tie_weights()  # to_empty unties: the served model must have the sender's parameters
    engine = LocalEngine(model, {0}, device=device)
    if args.lora_rank:  # --lora: adapters of this rank on the default targets, a ring of 2
        from asyncrl.config import LoraConfig
        from asyncrl.engines.rollout.local.lora import LoraSpec

        targets = LoraConfig().target_modules
        engine.enable_lora(LoraSpec(args.lora_rank, 16.0, targets, 2))
    masters = f"loopback,{args.send_host}"  # the sender: this host, or --send-host's node
    server = EngineServer(engine, f"{args.model}-shapes", args.recv_host, masters)
    app = build_app(server, secret.load())
    loop = new_event_loop()  # as the engine server's main does
    web.run_app(app, host=args.recv_host, port=args.port, print=None, access_log=None, loop=loop)


def floor_peer(args: argparse.Namespace) -> None:
    """Receiving side of the floor: ``repeats + 1`` flat broadcasts of ``nbytes``."""
    import torch

    from asyncrl.transports.weights.collective_wire import broadcast, new_weight_group

    torch.set_num_threads(1)
    group = new_weight_group(
        args.backend, args.send_host, args.port, 1, 2, "floor", 120.0, args.recv_host
    )
    buf = torch.empty(args.nbytes, dtype=torch.uint8, device=DEVICE[args.backend])
    while True:  # until the benchmark stops this process
        broadcast(group, buf)


# -- the sending side's tensors and the floor ------------------------------------
def random_weights(model: str, dtype: str, device: str, separate: bool = False) -> dict[str, Any]:
    """Random bits in the model's shapes: views of one flat tensor, or (``separate``) one
    allocation per tensor, like a trainer's parameters (what cuda-ipc must map)."""
    import torch

    shapes = model_shapes(model)
    total = sum(torch.Size(s).numel() for _, s in shapes)
    period = (1 << 24) + 7  # random bits, repeated with a period that no tensor size shares
    base = torch.empty(period, dtype=torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    words = total * getattr(torch, dtype).itemsize // 2  # int16 words of random bits
    flat = base.repeat(-(-words // period))[:words].clone()
    flat = flat.view(getattr(torch, dtype)).to(device)
    out, off = {}, 0
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        out[name] = flat[off : off + n].view(shape)
        if separate:
            out[name] = out[name].clone()
        off += n
    return out


class Floor:
    """One flat transfer of ``nbytes`` on the same link: a broadcast to a peer process
    (for ``cuda-ipc``: a device-to-device copy), measured between our pushes."""

    def __init__(
        self, backend: str, nbytes: int, children: Children, send_host: str, buf: Any = None
    ):
        """``buf``: the bytes to send (flat uint8 of ``nbytes``, e.g. the weights' own), else
        random ones."""
        import torch

        from asyncrl.procs import free_port
        from asyncrl.transports.weights.collective_wire import new_weight_group

        self.peer, self.group = None, None
        # Real bytes: a never-written buffer reads as the kernel's shared zero page (always
        # in cache), which would make the floor faster than any transfer of real weights.
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE[backend]).random_(0, 256)
        self.buf = buf
        if backend == "cuda-ipc":
            self.dst = torch.empty_like(self.buf)
            return
        port = free_port(send_host)  # the peer joins our store, on our address
        self.peer = children.start(
            "peer", ["--_peer", "--port", str(port), "--nbytes", str(nbytes)]
        )
        self.group = new_weight_group(backend, send_host, port, 0, 2, "floor", 120.0, send_host)
        self.once()  # warm-up

    def once(self) -> float:
        import torch

        from asyncrl.transports.weights.collective_wire import broadcast

        if self.group is None:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.dst.copy_(self.buf)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        broadcast(self.group, self.buf)
        return time.perf_counter() - t0


class Children:
    """The receiving side's processes: children of this process on ``--recv-host``, or
    (``--ray``) processes in Ray actors on the Ray node at ``--recv-host``."""

    def __init__(self, args: argparse.Namespace, me: list[str], logs: Path):
        netns = getattr(args, "netns", "")
        self.args, self.me, self.logs = args, [*me, *(["--_netns", netns] if netns else [])], logs
        self.procs: list[Any] = []
        if args.ray:
            import ray

            ray.init(address=args.ray, _node_ip_address=args.send_host, log_to_driver=False)

    def start(self, name: str, extra: list[str]) -> Any:
        """Start ``extra`` (``{port}`` in it: a port free on the receiving node)."""
        from asyncrl.forkserver import spawn_shared
        from asyncrl.procs import free_port, python_env

        proc: Any  # a NodeProcess or a Popen, tagged with the port it serves on
        if self.args.ray:
            from asyncrl.launchers.ray import NodeProcess

            proc = NodeProcess(self.args.recv_host, self.logs)
            port = proc.free_port()
            proc.start(f"{name}-{len(self.procs)}", [*self.me, *_fill(extra, port)])
        else:
            # in an emulated link's namespace nothing else listens: any port free here will do
            port = free_port(
                "127.0.0.1" if getattr(self.args, "netns", "") else self.args.recv_host
            )
            log = self.logs / f"{name}-{len(self.procs)}.log"
            cmd = [*self.me, *_fill(extra, port)]
            proc = spawn_shared(cmd, log, python_env(), die_with_parent=True)
        self.procs.append(proc)
        proc.bench_port = port
        return proc

    def local(self, *procs: Any) -> list[Any]:
        """The ones whose pid means something in this /proc (for the CPU columns)."""
        from asyncrl.forkserver import Forked

        return [p for p in procs if isinstance(p, (subprocess.Popen, Forked))]

    def stop(self) -> None:
        from asyncrl.procs import stop

        local = self.local(*self.procs)
        stop(local)
        for p in self.procs:
            if p not in local:  # a Ray NodeProcess
                p.stop()
        if self.args.ray:
            import ray

            ray.shutdown()


def _fill(extra: list[str], port: int) -> list[str]:
    return [a.replace("{port}", str(port)) for a in extra]


def cpu_s(*children: Any) -> float:
    """CPU seconds (user + system) used so far by this process and ``children`` (Linux /proc)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    for child in children:
        if child is None:
            continue
        cpu = cpu_seconds(child.pid)
        if cpu is None:
            return float("nan")
        total += cpu
    return total
