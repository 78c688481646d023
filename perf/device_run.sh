#!/usr/bin/env bash
# The one script the lead runs on the lent H200 (way A of ../shared/device/README.md: prebuilt kernels,
# no CuTe DSL on the device). Runs the GPU tests, then an optional bench command, logging to $OUT.
#
# Prepare here (CPU machine, repo root):
#   bash ../shared/device/prepare_runtime.sh                        # -> .devstage/rt
#   python -m h3cute build --arch sm_90a --candidates --out .prebuilt  # the product kernels and every sweep candidate
#                                                                  # (the GPU suite and perf scripts run every config)
#   PYTHONPATH=src python tests/test_runtime.py .prebuilt/runtime_test   # the runtime's own test kernel
#   bash perf/stage_peers.sh                                       # optional: the peers -> .devstage/{whl,peers}
# Device `run`: carry [".devstage", ".prebuilt"], command
#   bash perf/device_run.sh [python3 -m h3cute.bench ...]
#
# h3cute is not installed on the device: src/ goes on PYTHONPATH (h3cute.kernels is src/h3cute/kernels, a link to
# the top-level kernels/ folder).
set -uo pipefail
START=$(date +%s)
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/.device-out}
mkdir -p "$OUT"

[ -f .devstage/rt/rt_env.sh ] || { echo "device_run: .devstage/rt missing (bash ../shared/device/prepare_runtime.sh)" >&2; exit 2; }
[ -f .prebuilt/manifest.json ] || { echo "device_run: .prebuilt/manifest.json missing (python -m h3cute build --arch sm_90a --candidates --out .prebuilt)" >&2; exit 2; }
# shellcheck disable=SC1091
source .devstage/rt/rt_env.sh || { echo "device_run: runtime install failed" >&2; exit 3; }

# Optional pure-Python peers carried as wheels (diffusers for the real-module candidate, vllm-omni, liger-kernel),
# and single peer files extracted from wheels too large to carry (SGLang's and Megatron's batch-invariant modes).
if ls .devstage/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/h3-peers .devstage/whl/*.whl \
    && export PYTHONPATH=/tmp/h3-peers${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .devstage/peers ] && export H3CUTE_PEER_FILES=$ROOT/.devstage/peers
# Optional CuTe DSL with flash-attn-4 and quack-kernels (perf/stage_dsl.sh), unpacked once per machine into
# /opt/h3dsl; it serves FA4 and quack, while h3cute's own kernels still come from the bundle. The archive arrives in
# a call of its own (it is too large to travel with .snap): from .devdsl here, or from ../.devdsl when the command
# runs inside .snap.
DSL=/opt/h3dsl
for a in .devdsl/h3dsl.tar.xz ../.devdsl/h3dsl.tar.xz; do
  if [ ! -f $DSL/.ok ] && [ -f "$a" ]; then
    rm -rf $DSL && mkdir -p $DSL && xz -d -c "$a" | tar -x -C $DSL \
      && cp /opt/h3rt/lib/libcute_dsl_runtime.so $DSL/nvidia_cutlass_dsl/cu13/lib/ && touch $DSL/.ok
  fi
done
if [ -f $DSL/.ok ]; then
  export PYTHONPATH=$PYTHONPATH:$DSL:$DSL/nvidia_cutlass_dsl/dsl_packages
  # FA4 keeps its compiled kernels on disk, so each process of a run compiles them once per machine
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-cache
  # the DSL's own dependencies, behind the image's packages (.devstage/dsl, staged by perf/stage_dsl.sh)
  if ls .devstage/dsl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/h3-dsl-deps .devstage/dsl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/h3-dsl-deps
  fi
fi
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
export H3CUTE_PREBUILT=$ROOT/.prebuilt
export H3CUTE_CACHE_DIR=/tmp/h3cute-cache   # stays empty unless something compiles (it cannot here)
[ -f .prebuilt/runtime_test/manifest.json ] && export H3CUTE_TEST_BUNDLE=$ROOT/.prebuilt/runtime_test
export PYTHONDONTWRITEBYTECODE=1

{
  echo "== $(date -u +%FT%TZ)  $(git rev-parse --short HEAD 2>/dev/null || echo no-git)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  python3 - <<'PY'
import json, sys, torch, tvm_ffi
import h3cute.runtime as rt
from h3cute.runtime import sources
m = json.load(open(".prebuilt/manifest.json"))
print("python", sys.version.split()[0], "torch", torch.__version__, "tvm_ffi", tvm_ffi.__version__)
print("bundle", m["fingerprint"][:12], "sources", sources.source_fingerprint()[:12], "entries", len(m["entries"]))
print("cutlass importable:", sources.dsl_available())
from importlib import metadata
for dist in ("flash-attn-4", "quack-kernels"):
    try:
        print(dist, metadata.version(dist))
    except metadata.PackageNotFoundError:
        print(dist, "not installed")
print("gpu", torch.cuda.get_device_name(), torch.cuda.get_device_capability(), "->", rt.arch_of(0))
from h3cute.bench import peers
print("peer files", peers.versions())
PY
} 2>&1 | tee "$OUT/env.txt"

STAMP=$(mktemp)
# H3CUTE_GPU_TESTS: pytest selection (default: the whole tests/ folder); "skip" runs no tests.
rc_tests=0
if [ "${H3CUTE_GPU_TESTS:-tests}" != skip ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$OUT/pytest_gpu.xml" ${H3CUTE_GPU_TESTS:-tests} 2>&1 | tee "$OUT/pytest_gpu.log"
  rc_tests=${PIPESTATUS[0]}
fi

rc_bench=0
if [ $# -gt 0 ]; then
  export H3CUTE_OUT=$OUT
  # H3CUTE_DEADLINE_S (the call's time limit, from this script's start): the bench is stopped 30 s before it, so the
  # reports it finished are still packed below (a call killed at its limit returns nothing of what was left here).
  limit=()
  if [ -n "${H3CUTE_DEADLINE_S:-}" ]; then
    left=$(( H3CUTE_DEADLINE_S - ($(date +%s) - START) - 30 ))
    [ "$left" -gt 0 ] || left=1
    limit=(timeout "$left")
  fi
  ${limit[@]+"${limit[@]}"} "$@" 2>&1 | tee "$OUT/bench.log"
  rc_bench=${PIPESTATUS[0]}
  # reports the bench wrote under perf/results come back as one archive ($OUT returns at most 8 files)
  find perf/results -type f -newer "$STAMP" -print0 | tar --null -czf "$OUT/results.tgz" -T - 2>/dev/null
fi
rm -f "$STAMP"
echo "device_run: pytest rc=$rc_tests bench rc=$rc_bench" | tee -a "$OUT/env.txt"
[ "$rc_tests" -eq 0 ] && [ "$rc_bench" -eq 0 ]
