#!/usr/bin/env bash
# Create .venv (if missing) and install asyncrl with its test extras.
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build that this
# kind of machine ships as a local file (torch==2.13.0); GPU machines get whatever
# torch the resolver picks within pyproject's range. Override with ASYNCRL_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# pip, minus this kind of machine's noise about local index folders it does not have
pip_install() { python -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if [ -n "${ASYNCRL_TORCH_SPEC:-}" ]; then
    pip_install "$ASYNCRL_TORCH_SPEC"
  elif ! command -v nvidia-smi >/dev/null 2>&1; then
    pip_install "torch==2.13.0"
  fi
fi
# sglang-wire: what SGLang's weight-sync modules need to import here (skipped where SGLang
# itself is installed, e.g. a GPU machine, which brings its own, possibly other, versions)
extras=test
python -c "import sglang" >/dev/null 2>&1 || extras=test,sglang-wire
pip_install -e ".[$extras]"
# SGLang's own source for the tests that play SGLang's side with SGLang's code (the weight
# group's receiving ranks, its flattened-bucket class): each covered version's wheel is
# unpacked, Python files only, under .cache/sglang/VERSION (not installed: one venv cannot
# hold three versions, and SGLang's GPU dependencies are not needed for these modules), with
# its dist-info's METADATA and entry_points.txt (importlib.metadata then sees that version's
# console scripts when the folder is on the path: the launcher tests read them).
# Without a package registry the download fails and those tests skip, naming this step.
for v in 0.5.10 0.5.22 0.5.23; do
  dest=.cache/sglang/$v
  [ -f "$dest/sglang/__init__.py" ] && [ -f "$dest/sglang-$v.dist-info/entry_points.txt" ] && continue
  tmp=$(mktemp -d)
  if python -m pip download -q --no-deps "sglang==$v" -d "$tmp" 2>&1 \
      | { grep -v "^WARNING: Location 'file:" || true; }; then
    mkdir -p "$dest" && python - "$tmp" "$dest" <<'PY'
import pathlib, sys, zipfile
src, dest = pathlib.Path(sys.argv[1]), sys.argv[2]
with zipfile.ZipFile(next(src.glob("sglang-*.whl"))) as z:
    meta = (".dist-info/METADATA", ".dist-info/entry_points.txt")
    z.extractall(dest, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")
                        or n.startswith("sglang-") and n.endswith(meta)])
PY
  else
    echo "setup: could not download sglang==$v; tests against SGLang's code will skip" >&2
  fi
  rm -rf "$tmp"
done
# vLLM 0.33.0's own source, the same way (Python files and dist-info only, under
# .cache/vllm/0.33.0, not installed: a 336 MB CUDA wheel): the tests of the vLLM family
# run its StatelessProcessGroup and packed_tensor.py on this CPU and cite its file:line
# (tests/engines/rollout/vllm/code.py says what imports here and what does not).
v=0.33.0
dest=.cache/vllm/$v
if [ ! -f "$dest/vllm/distributed/utils.py" ]; then
  tmp=$(mktemp -d)
  if python -m pip download -q --no-deps "vllm==$v" -d "$tmp" 2>&1 \
      | { grep -v "^WARNING: Location 'file:" || true; }; then
    mkdir -p "$dest" && python - "$tmp" "$dest" <<'PY'
import pathlib, sys, zipfile
src, dest = pathlib.Path(sys.argv[1]), sys.argv[2]
with zipfile.ZipFile(next(src.glob("vllm-*.whl"))) as z:
    meta = (".dist-info/METADATA", ".dist-info/entry_points.txt")
    z.extractall(dest, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")
                        or n.startswith("vllm-") and n.endswith(meta)])
PY
  else
    echo "setup: could not download vllm==$v; tests against vLLM's code will skip" >&2
  fi
  rm -rf "$tmp"
fi
# The type checker scripts/test runs (also in the test extra), pinned: another mypy reports
# other errors. Skipped when that version is there.
MYPY=2.4.1
python -c "import sys, importlib.metadata as m; sys.exit(m.version('mypy') != '$MYPY')" \
  >/dev/null 2>&1 || pip_install "mypy==$MYPY"
# Ray (the optional extra asyncrl[ray]) for the two-node cluster tests, pinned; ~8 s from a
# warm pip cache. Nothing in asyncrl imports it unless cluster.backend = "ray".
pip_install "ray==2.60.0"
# The optional extras the tests exercise (asyncrl itself never needs them): pinned, and
# skipped when already there. A fresh install of the three takes ~10 s from a warm pip cache.
EXTRAS="matplotlib==3.11.2 tensorboard==2.21.0 wandb==0.28.2"
if ! python - $EXTRAS <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
sys.exit(any(version(n) != v for n, v in (a.split("==") for a in sys.argv[1:])))
PY
then
  pip_install $EXTRAS
fi
