#!/usr/bin/env bash
# GPU probe (session 13): the fixed CUDA run test, where a CUDA run's 33 s start-up goes,
# the embedded engine vs HF generate on CUDA. Everything to $OUT.
set -u
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/asyncrl-site .whl/*.whl || exit 99
export PYTHONPATH=/tmp/asyncrl-site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_VERBOSITY=error ASYNCRL_CACHE=/tmp/probe-cache
P=$OUT/probe.txt
t() { local t0; t0=$(date +%s.%N); "$@"; echo "   [$(python3 -c "print(round($(date +%s.%N)-$t0,2))") s] $*"; }
{
  echo "== imports (cold, then warm)"
  for i in 1 2; do t python3 -c "import torch, transformers; from transformers import Qwen2ForCausalLM"; done
  t python3 -c "import torch"
  echo "== CUDA context"
  python3 -c "import time, torch; t=time.time(); torch.zeros(1, device='cuda'); print('cuda init %.2f s' % (time.time()-t))"
  echo "== NCCL group, world 1"
  python3 - <<'PY'
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
t = time.time(); torch.cuda.set_device(0); dist.init_process_group("nccl", rank=0, world_size=1)
x = torch.ones(4, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
print("nccl init + first all_reduce %.2f s" % (time.time() - t)); dist.destroy_process_group()
PY
} >"$P" 2>&1
timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider --timeout=180 tests/test_run.py \
  >"$OUT/pytest.log" 2>&1; echo "== pytest tests/test_run.py -m gpu: rc=$? $(tail -1 "$OUT/pytest.log")" >>"$P"
for i in 1 2; do
  rm -rf /tmp/run$i; t0=$(date '+%H:%M:%S.%N')
  t timeout 150 python3 -m asyncrl.cli run --run-dir /tmp/run$i --quiet --controller.total_steps=20 \
    --trainer.device=cuda --rollout.device=cuda --weights.backend=cuda-ipc >>"$P" 2>&1
  { echo "== cuda run $i started $t0"; grep -h "start-up" /tmp/run$i/trainer0.log /tmp/run$i/engine0.log
    python3 -c "import json; r=[json.loads(l) for l in open('/tmp/run$i/metrics.jsonl')]; print('step0 wall_s', r[0]['wall_s'], 'last', r[-1]['wall_s'], 'train_s', [round(x['train_s'],3) for x in r[:4]])"; } >>"$P" 2>&1
done
rm -rf /tmp/runc; t0=$(date '+%H:%M:%S.%N')
t timeout 100 python3 -m asyncrl.cli run --run-dir /tmp/runc --quiet --controller.total_steps=20 >>"$P" 2>&1
{ echo "== cpu run started $t0"; grep -h "start-up" /tmp/runc/trainer0.log /tmp/runc/engine0.log
  python3 -c "import json; r=[json.loads(l) for l in open('/tmp/runc/metrics.jsonl')]; print('step0 wall_s', r[0]['wall_s'], 'last', r[-1]['wall_s'])"; } >>"$P" 2>&1
t timeout 150 python3 -m asyncrl.cli bench generation --device cuda --dtype bfloat16 \
  --json "$OUT/gen.json" >"$OUT/gen.log" 2>&1; echo "== bench generation rc=$?" >>"$P"
cat "$P"
