"""One receiving vLLM worker rank on cuda:1, with vLLM's own worker-side code (GPU test of
``test_vllm_trainer_nccl.py``; run as ``python nccl_worker.py PORT`` where vLLM is installed).

It joins as rank 1 of 2 through ``stateless_init_process_group`` (vLLM 0.33
``distributed/weight_transfer/nccl_common.py:194-214``, what ``worker_init_process_group``
calls, :262-291) and receives three float32 tensors of 1000, 3 and 4096 elements with
``packed_nccl_broadcast_consumer`` (``packed_tensor.py:196-288``) at a 1-byte cap (every
tensor closes its chunk), then prints the sha256 of each received tensor's bytes.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

SIZES = (1000, 3, 4096)


def main() -> None:
    port = int(sys.argv[1])
    torch.cuda.set_device(1)
    comm = stateless_init_process_group("127.0.0.1", port, 1, 2, device=1)
    got: list[str] = []

    def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for _, t in pairs:
            got.append(hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest())

    meta = ((f"t{i}", ([n], torch.float32)) for i, n in enumerate(SIZES))
    packed_nccl_broadcast_consumer(
        meta, comm, 0, load, buffer_size_bytes=1, num_buffers=2, device="cuda:1"
    )
    torch.cuda.synchronize()
    print(json.dumps({"sha256": got}), flush=True)


if __name__ == "__main__":
    main()
