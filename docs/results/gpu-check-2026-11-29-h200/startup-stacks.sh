set -u
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/asyncrl-site .whl/*.whl || exit 99
export PYTHONPATH=/tmp/asyncrl-site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_VERBOSITY=error ASYNCRL_CACHE=/tmp/probe-cache
python3 -c "from asyncrl.tasks.tiny_model import default_model_dir, ensure_tiny_model; ensure_tiny_model(default_model_dir())"
export PYTHONPATH=$PWD/.gpu/site:$PYTHONPATH
date '+start %H:%M:%S.%N'
timeout 120 python3 -m asyncrl.cli run --run-dir /tmp/run3 --quiet --controller.total_steps=5 \
  --trainer.device=cuda --rollout.device=cuda --weights.backend=cuda-ipc >$OUT/cli.log 2>&1
echo rc=$?
date '+end %H:%M:%S.%N'
cp /tmp/run3/engine0.log /tmp/run3/trainer0.log $OUT/ 2>/dev/null
grep -h "start-up" /tmp/run3/*.log
python3 -c "import json; r=[json.loads(l) for l in open('/tmp/run3/metrics.jsonl')]; print('step0 wall_s', r[0]['wall_s'])"
