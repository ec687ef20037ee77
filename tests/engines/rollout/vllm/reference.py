"""vLLM's own trainer-side HTTP client driving one push, as the reference for the wire.

Run as ``python -m tests.engines.rollout.vllm.reference URL MODEL_DIR`` with vLLM's source
on ``PYTHONPATH``. ``HTTPVLLMWeightSyncClient`` (vllm/distributed/weight_transfer/
clients.py:58-96) is loaded from its file; the names it imports from ``base.py`` (request
types only its Ray client uses) are stubbed, because ``base.py`` imports ``vllm.config``,
which does not import here (``code.py``). The trainer's side follows vLLM's
``NCCLTrainerWeightTransferEngine`` (nccl_engine.py:289-394): the init call in a thread
while rank 0 joins (nc:150-158), start, update in flight while the packed chunks are
broadcast (``pack_tensors``, pt:69-140), finish with the version. Rank 0 is asyncrl's
Gloo group (NCCL cannot run on a CPU).
"""

from __future__ import annotations

import sys
import types
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import load_file

from asyncrl.procs import free_port
from asyncrl.transports.weights.collective_wire import broadcast, new_weight_group
from tests.engines.rollout.vllm.code import load_file as load_vllm
from tests.engines.rollout.vllm.code import packed_tensor
from tests.engines.rollout.vllm.rank import GROUP

CAP = 1 << 20


def main() -> None:
    url, model_dir = sys.argv[1], sys.argv[2]
    stub = types.ModuleType("vllm.distributed.weight_transfer.base")
    for name in ("WeightTransferInitRequest", "WeightTransferUpdatePayload",
                 "WeightTransferUpdateRequest"):  # fmt: skip
        setattr(stub, name, object)
    sys.modules["vllm.distributed.weight_transfer"] = types.ModuleType("wt")
    sys.modules["vllm.distributed.weight_transfer.base"] = stub
    clients = load_vllm("vllm/distributed/weight_transfer/clients.py", "vllm_clients")
    client = clients.HTTPVLLMWeightSyncClient(url)
    port = free_port()
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "packed": True,
        "packed_buffer_size_bytes": CAP,
        "packed_num_buffers": 2,
    }  # fmt: skip  (build_worker_init_payload, nc:130-147)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weight_transfer_engine, init)
        group = new_weight_group("gloo", "127.0.0.1", port, 0, 2, GROUP, 60.0)
        joined.result()
    weights = {n: w + 1 for n, w in load_file(f"{model_dir}/model.safetensors").items()}
    meta = {
        "names": list(weights),
        "dtype_names": [str(w.dtype).split(".")[-1] for w in weights.values()],
        "shapes": [list(w.shape) for w in weights.values()],
    }
    pt = packed_tensor()
    client.start_weight_update()
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(client.update_weights, meta)
        it = iter(weights.items())
        while (chunk := pt.pack_tensors(it, lambda x: x[1], CAP)) is not None:
            broadcast(group, chunk.packed_tensor, 0)
        done.result()
    client.finish_weight_update("1")
    torch.distributed.destroy_process_group(group)


if __name__ == "__main__":
    main()
