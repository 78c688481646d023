#!/usr/bin/env bash
# The device runs behind h3cute.patch(scope="model")'s committed reports, in two calls to one warm machine
# (docs/DEVICE.md: the DSL travels in a call of its own). Run through perf/device_run.sh, from the repo root.
#
#   plain   (first call, carry .snap)   h3::linear against cuBLAS (perf/linear_bench.py); h3cute-bench model's
#           unpatched and conditioning-patched variants, eager, in a process without vLLM's settings; its JSON
#           stays on the machine for the second call
#   model   (second call, carry .devdsl, H3CUTE_GPU_TESTS=tests/test_patch_model_gpu.py: the five proofs, whose
#           fixture runs perf/model_invariance.py) the model bench's scope="model" variant, added with --resume in a
#           process started with vLLM's cuBLASLt settings
#
# Reports go to $H3CUTE_OUT: linear_bench.json, model_invariance.json (the GPU tests), model_scope.{json,md,png}.
set -uo pipefail
cd "$(dirname "$0")/.."
STATE=/tmp/h3-model-scope.json   # the bench report between the two calls (the machine keeps /tmp while warm)
BENCH=(python3 -m h3cute.bench model --modes eager --no-share --budget-s "${H3CUTE_MODEL_BUDGET_S:-400}")
rc=0
case "${1:?plain or model}" in
  plain)
    python3 perf/linear_bench.py || rc=1
    "${BENCH[@]}" --variants unpatched patched --out "$STATE" || rc=1
    ;;
  model)
    [ -f "$STATE" ] || { echo "model_scope_run: $STATE missing (run 'plain' first on this machine)" >&2; exit 2; }
    env CUBLASLT_WORKSPACE_SIZE=1 CUBLAS_WORKSPACE_CONFIG=:16:8 "${BENCH[@]}" --variants model --resume \
      --out "$STATE" || rc=1
    ;;
  *) echo "model_scope_run: plain or model" >&2; exit 2 ;;
esac
for f in "$STATE" "${STATE%.json}.md" "${STATE%.json}.png"; do
  [ -f "$f" ] && cp "$f" "$H3CUTE_OUT/model_scope.${f##*.}"
done
exit $rc
