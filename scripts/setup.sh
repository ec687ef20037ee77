#!/usr/bin/env bash
# Create .venv (if missing) and install asyncrl with its test extras.
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build that this
# kind of machine ships as a local file (torch==2.13.0); GPU machines get whatever
# torch the resolver picks within pyproject's range. Override with ASYNCRL_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
# A registry connection that drops mid-download (CI lost a 286 MB triton wheel at 160 MB after
# pip's default 5 resumes): more resumes and connection retries for every pip call below
export PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-50} PIP_RETRIES=${PIP_RETRIES:-10}
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# SGLang's and vLLM's own source for the tests that play their side with their code (the
# weight group's receiving ranks, SGLang's flattened-bucket class, vLLM's StatelessProcessGroup
# and packed_tensor.py; tests/engines/rollout/vllm/code.py says what imports here): each
# covered version's wheel is unpacked, Python files only, under .cache/PKG/VERSION (not
# installed: one venv cannot hold three SGLang versions, vLLM's is a 336 MB CUDA wheel, and
# their GPU dependencies are not needed for these modules), with its dist-info's METADATA and
# entry_points.txt (importlib.metadata then sees that version's console scripts when the
# folder is on the path: the launcher tests read them). Without a package registry the
# download fails and those tests skip, naming this step.
unpack_source() {  # PKG VERSION FILE: skipped when .cache/PKG/VERSION/FILE is there
  local pkg=$1 v=$2 dest=.cache/$1/$2 tmp
  [ -f "$dest/$3" ] && return 0
  tmp=$(mktemp -d)
  if python -m pip download -q --no-deps "$pkg==$v" -d "$tmp" 2>&1 \
      | { grep -v "^WARNING: Location 'file:" || true; }; then
    mkdir -p "$dest" && python - "$tmp" "$dest" "$pkg" <<'PY'
import pathlib, sys, zipfile
src, dest, pkg = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
with zipfile.ZipFile(next(src.glob(f"{pkg}-*.whl"))) as z:
    meta = (".dist-info/METADATA", ".dist-info/entry_points.txt")
    z.extractall(dest, [n for n in z.namelist() if n.startswith(f"{pkg}/") and n.endswith(".py")
                        or n.startswith(f"{pkg}-") and n.endswith(meta)])
PY
  else
    echo "setup: could not download $pkg==$v; tests against its code will skip" >&2
  fi
  rm -rf "$tmp"
}
for v in 0.5.10 0.5.22 0.5.23; do
  unpack_source sglang "$v" "sglang-$v.dist-info/entry_points.txt"
done
unpack_source vllm 0.33.0 vllm/distributed/utils.py
# vLLM 0.33's API server (its CLI parser, app, routers, request models, error handlers,
# AsyncLLM) runs in the vLLM test server (tests/engines/rollout/vllm/app.py) with its own
# pinned server dependencies, installed BESIDE the test environment, not into it
# (.cache/vllm-deps/VERSION, on PYTHONPATH of that server process only): each one at the
# version range vLLM's METADATA requires (read from it here), --no-deps. The list is the
# minimal set those modules need to import on a CPU on top of the test environment's
# packages (what the test extra already has at an accepted version is not repeated).
VLLM_DEPS="fastapi cbor2 cachetools blake3 py-cpuinfo prometheus_client
  prometheus-fastapi-instrumentator oss-harmony cloudpickle partial-json-parser
  apache-tvm-ffi xgrammar llguidance watchfiles model-hosting-container-standards"
VLLM_DEPS_OF_DEPS="jmespath"  # model-hosting-container-standards' own (not in vLLM's METADATA)
vllm_deps() {  # VERSION: skipped when .cache/vllm-deps/VERSION/.done names this very list
  local v=$1 dest=.cache/vllm-deps/$1 meta
  meta=$(ls .cache/vllm/"$v"/vllm-*.dist-info/METADATA 2>/dev/null | head -1)
  [ -n "$meta" ] || return 0
  [ "$(cat "$dest/.done" 2>/dev/null)" = "$VLLM_DEPS $VLLM_DEPS_OF_DEPS" ] && return 0
  local specs
  specs=$(python - "$meta" $VLLM_DEPS <<'PY'
import re, sys
want = {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[2:]}
found = {}
for line in open(sys.argv[1]):
    if not line.startswith("Requires-Dist:") or "extra ==" in line:
        continue
    req = line.split(":", 1)[1].split(";")[0].strip()
    name = re.split(r"[\s\[<>=!~(]", req, maxsplit=1)[0]
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in want:
        found[key] = re.sub(r"\[.*?\]", "", req).replace(" ", "")
missing = want - found.keys()
if missing:
    sys.exit(f"setup: not in vLLM's METADATA: {sorted(missing)}")
print("\n".join(found.values()))
PY
) || return 1
  rm -rf "$dest" && mkdir -p "$dest"
  # shellcheck disable=SC2086
  if python -m pip install -q --no-deps --target "$dest" $specs $VLLM_DEPS_OF_DEPS 2>&1 \
      | { grep -v "^WARNING: Location 'file:" || true; }; then
    echo "$VLLM_DEPS $VLLM_DEPS_OF_DEPS" > "$dest/.done"
  else
    echo "setup: could not install vLLM $v's server dependencies; its server tests will skip" >&2
  fi
}
vllm_deps 0.33.0
# verl's and TRL's loss and advantage code, for tests/algorithms/test_reference.py (which loads
# the functions it compares against one by one from these files: importing either package
# needs omegaconf, tensordict, datasets and more that asyncrl does not)
unpack_source verl 0.9.1 verl/trainer/ppo/core_algos.py
unpack_source trl 1.16.0 trl/trainer/grpo_trainer.py
# The packages (a function, run below): skipped when this set-up already ran with this very
# pyproject.toml and setup.sh into this .venv (pip's resolver alone takes ~10 s, paid by every
# `bash scripts/test`); ASYNCRL_SETUP=force runs them anyway. A new .venv always runs them.
install_packages() {
# pip, minus this kind of machine's noise about local index folders it does not have
# (three tries: a download that fails past its resumes is started again from its beginning)
pip_install() {
  local try
  for try in 1 2 3; do
    python -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } \
      && return 0
    echo "setup: pip install $* failed (try $try of 3)" >&2
  done
  return 1
}
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
# peer: TRL for `asyncrl bench peer` and its smoke test (~7 s from a warm pip cache); torch is
# held at the version installed above by a constraint, so no extra can replace it
extras=test,peer
python -c "import sglang" >/dev/null 2>&1 || extras=$extras,sglang-wire
keep_torch=$(mktemp)
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$keep_torch" \
  2>/dev/null || true
# (setuptools' ten-line "Editable installation" warning box, about folders that shadow the
# package, says nothing for this layout: silenced)
PYTHONWARNINGS="ignore:Editable installation" pip_install -e ".[$extras]" -c "$keep_torch"
rm -f "$keep_torch"
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
}
stamp=.venv/.asyncrl-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "${ASYNCRL_SETUP:-}" = force ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
    || ! python -c "import asyncrl" >/dev/null 2>&1; then
  rm -f "$stamp"
  install_packages
  echo "$want" > "$stamp"
fi
