"""One receiving TP rank of an SGLang server, built from SGLang's own code.

Run as ``python -m tests.engines.rollout.sglang.rank --version V`` with SGLang
``V``'s source first on ``PYTHONPATH`` (``code.sglang_env``). It reads one JSON
command per line on stdin and answers one JSON line on stdout (with ``--connect PATH``: per
line of a unix socket it connects to, as when forked):

- ``init`` {master_address, master_port, rank_offset, tp_rank, world_size,
  group_name, backend}: joins the weight group as rank ``rank_offset + tp_rank``
  with SGLang's ``init_custom_process_group`` (0.5.23
  ``model_runner_components/weight_updater.py:124-134``; 0.5.10
  ``model_executor/model_runner.py:1524-1539``).
- ``recv`` {names, dtypes, shapes, group_name, load_format, asyncrl_bucket}: one broadcast,
  received and rebuilt as SGLang's version does it (flattened_bucket: 0.5.23
  ``FlattenedTensorBucket.empty`` ``weight_updater.py:300-310``; 0.5.22
  ``FlattenedTensorBucket(named_tensors=...)`` ``weight_updater.py:298-316``;
  0.5.10 ``model_runner.py:1618-1637``; else one broadcast per tensor), then
  "loaded": kept by name (SGLang's ``load_weights`` copies each tensor into the
  live parameter as it arrives, no staging). The answer's ``checksum`` is asyncrl's
  manifest checksum of the received bytes (``asyncrl_bucket``: ground truth only).
- ``checksums``: sha256 of every loaded tensor's bytes; ``destroy`` {group_name}.

Under 0.5.10, ``sglang.srt.utils.common`` imports torchvision (whose PyPI build
does not load beside a CPU torch), so the function is taken from that very
file's source with ``ast`` and run as SGLang wrote it; ``tensor_bucket.py`` is
loaded from its file (it imports only torch).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from asyncrl.transports.weights.bucket import BucketEntry, BucketManifest
from asyncrl.transports.weights.integrity import bucket_checksum
from tests.session_forks import as_imported


def as_sent(flat: torch.Tensor, c: dict[str, Any]) -> int | None:
    """asyncrl's manifest ``checksum`` of these received bytes, as its ``verify`` mode computes
    it (ground truth only: SGLang ignores ``asyncrl_bucket``; None with ``verify = off``)."""
    meta = c.get("asyncrl_bucket") or {}
    mode = meta.get("verify", "full")
    if mode == "off" or "index" not in meta:
        return None
    entries = tuple(BucketEntry(n, tuple(s)) for n, s in zip(c["names"], c["shapes"], strict=True))
    dtype = str(c["dtypes"][0]).removeprefix("torch.")
    m = BucketManifest(dtype, entries, meta["index"], meta["count"], meta["version"], verify=mode)
    return bucket_checksum(flat, m, mode)


def load_sglang() -> tuple[Any, Any, str]:
    """SGLang's ``init_custom_process_group``, ``FlattenedTensorBucket`` and how they loaded."""
    import sglang

    root = Path(sglang.__file__).parent
    spec = importlib.util.spec_from_file_location(
        "_sglang_tensor_bucket", root / "srt" / "weight_sync" / "tensor_bucket.py"
    )
    try:
        from sglang.srt.utils.common import init_custom_process_group
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        return init_custom_process_group, FlattenedTensorBucket, "imported"
    except ImportError as exc:
        how = f"from source ({type(exc).__name__}: {exc})"
    tb = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tb  # dataclasses resolve their module by name
    spec.loader.exec_module(tb)
    src = (root / "srt" / "utils" / "common.py").read_text()
    fn = next(
        n
        for n in ast.parse(src).body
        if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group"
    )
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    ns: dict[str, Any] = {"torch_release": release}
    exec(compile(ast.Module([fn], []), str(root / "srt/utils/common.py"), "exec"), ns)
    return ns["init_custom_process_group"], tb.FlattenedTensorBucket, how


class Rank:
    def __init__(self, version: str):
        self.version = version
        self.init_group, self.Bucket, self.loaded_how = load_sglang()
        self.groups: dict[str, Any] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.received: list[tuple[str, torch.Tensor]] = []

    def init(self, c: dict[str, Any]) -> dict[str, Any]:
        rank = int(c["rank_offset"]) + int(c["tp_rank"])
        self.groups[c["group_name"]] = self.init_group(
            backend=c.get("backend", "gloo"),
            init_method=f"tcp://{c['master_address']}:{c['master_port']}",
            world_size=int(c["world_size"]),
            rank=rank,
            group_name=c["group_name"],
        )
        return {"rank": rank, "loaded_how": self.loaded_how}

    def recv(self, c: dict[str, Any]) -> dict[str, Any]:
        group = self.groups[c["group_name"]]
        names, dtypes, shapes = c["names"], c["dtypes"], c["shapes"]
        if c.get("load_format") == "flattened_bucket":
            if hasattr(self.Bucket, "empty"):  # 0.5.23
                bucket = self.Bucket.empty(names, dtypes, shapes, "cpu")
            else:  # 0.5.10, 0.5.22
                bucket = self.Bucket(
                    named_tensors=[
                        (n, torch.empty(s, dtype=getattr(torch, d)))
                        for n, d, s in zip(names, dtypes, shapes, strict=True)
                    ]
                )
            flat = bucket.get_flattened_tensor()
            torch.distributed.broadcast(flat, src=0, group=group)
            named = bucket.reconstruct_tensors()
            got = as_sent(flat, c)  # of the bytes SGLang received, to compare with the sender's
        else:
            got = None
            named = []
            for n, d, s in zip(names, dtypes, shapes, strict=True):
                t = torch.empty(s, dtype=getattr(torch, d))
                torch.distributed.broadcast(t, src=0, group=group)
                named.append((n, t))
        self.received = named
        if c.get("load", True):
            self.load(named)
        return {"loaded": len(named), "checksum": got}

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Whole named tensors into the live weights, as SGLang's ``load_weights`` does."""
        for n, t in named:
            old = self.weights.get(n)
            if old is not None and old.shape != t.shape:
                raise ValueError(f"{n}: shape {tuple(t.shape)} != loaded {tuple(old.shape)}")
            self.weights[n] = t.clone()

    def checksums(self, c: dict[str, Any]) -> dict[str, Any]:
        return {
            "sha256": {
                n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for n, t in self.weights.items()
            }
        }

    def destroy(self, c: dict[str, Any]) -> dict[str, Any]:
        group = self.groups.pop(c["group_name"], None)
        if group is not None:
            torch.distributed.destroy_process_group(group)
        return {"destroyed": group is not None}


def main() -> None:
    """JSON lines over stdin/stdout, or over the unix socket of ``--connect PATH``
    (``standin_proc.RankProc``, as when forked from the version's session fork server)."""
    p = argparse.ArgumentParser()
    p.add_argument("--version", required=True)
    p.add_argument("--connect", default="", help="a unix socket to talk over")
    args = p.parse_args()
    as_imported()
    rx, tx = sys.stdin, sys.stdout
    if args.connect:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(args.connect)
        rx, tx = sock.makefile("r"), sock.makefile("w")
    rank = Rank(args.version)
    print(json.dumps({"ok": True, "ready": rank.loaded_how}), file=tx, flush=True)
    for line in rx:
        c = json.loads(line)
        try:
            out = {"ok": True, **getattr(rank, c["op"])(c)}
        except Exception as exc:  # reported to the driver, which decides
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc(file=sys.stderr)
        print(json.dumps(out), file=tx, flush=True)


if __name__ == "__main__":
    main()
