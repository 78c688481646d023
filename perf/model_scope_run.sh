#!/usr/bin/env bash
# The device runs behind h3cute.patch(scope="model")'s committed speed report, in two calls to one warm machine
# (docs/DEVICE.md: the DSL travels in a call of its own). Run through perf/device_run.sh, from the repo root.
#
#   plain   (a call carrying .snap) h3-bench model's unpatched variant (diffusers) eager, compiled and with CUDA
#           graphs (reduce-overhead, the forward), in a process without vLLM's settings; its JSON stays on the
#           machine for the second call
#   model   (a later call, the DSL staged) the scope="model" variant in the same modes, added with --resume in a process
#           started with vLLM's cuBLASLt settings
#
# H3CUTE_MODEL_SIZES (default "4097 32768") and H3CUTE_MODEL_BATCHES (default "1") pick the configurations;
# H3CUTE_MODEL_BUDGET_S (default 400) stops starting new ones. Reports go to $H3CUTE_OUT: model_scope.{json,md,png}.
set -uo pipefail
cd "$(dirname "$0")/.."
STATE=/tmp/h3-model-scope.json   # the bench report between the two calls (the machine keeps /tmp while warm)
# shellcheck disable=SC2206
BENCH=(python3 -m h3cute.bench model --modes eager compile cudagraphs --no-share
       --sizes ${H3CUTE_MODEL_SIZES:-4097 32768} --batches ${H3CUTE_MODEL_BATCHES:-1}
       --budget-s "${H3CUTE_MODEL_BUDGET_S:-400}")
rc=0
case "${1:?plain or model}" in
  plain)
    "${BENCH[@]}" --variants unpatched --out "$STATE" || rc=1
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
