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
# H3CUTE_MODEL_CONFIGS (default "4097x1 32768x1 4097x4 32768x4": S x B, run in that order, each one bench process
# resuming the report) picks the configurations; H3CUTE_MODEL_BUDGET_S (default 400) stops starting new ones, counted
# from the first. Reports go to $H3CUTE_OUT: model_scope.{json,md,png}.
set -uo pipefail
cd "$(dirname "$0")/.."
STATE=/tmp/h3-model-scope.json   # the bench report between the two calls (the machine keeps /tmp while warm)
START=$(date +%s)
BUDGET=${H3CUTE_MODEL_BUDGET_S:-400}
run_configs() {  # run_configs VARIANT [env ...]: each configuration in order, the report resumed
  local variant=$1 cfg left; shift
  for cfg in ${H3CUTE_MODEL_CONFIGS:-4097x1 32768x1 4097x4 32768x4}; do
    left=$(( BUDGET - ($(date +%s) - START) ))
    if [ "$left" -le 0 ]; then echo "model_scope_run: budget spent, $cfg not run" >&2; return 1; fi
    env "$@" python3 -m h3cute.bench model --modes eager compile cudagraphs --no-share --sizes "${cfg%x*}" \
      --batches "${cfg#*x}" --budget-s "$left" --variants "$variant" --resume --out "$STATE" || return 1
  done
}
rc=0
case "${1:?plain or model}" in
  plain)
    rm -f "$STATE"
    run_configs unpatched || rc=1
    ;;
  model)
    [ -f "$STATE" ] || { echo "model_scope_run: $STATE missing (run 'plain' first on this machine)" >&2; exit 2; }
    run_configs model CUBLASLT_WORKSPACE_SIZE=1 CUBLAS_WORKSPACE_CONFIG=:16:8 || rc=1
    ;;
  *) echo "model_scope_run: plain or model" >&2; exit 2 ;;
esac
for f in "$STATE" "${STATE%.json}.md" "${STATE%.json}.png"; do
  [ -f "$f" ] && cp "$f" "$H3CUTE_OUT/model_scope.${f##*.}"
done
exit $rc
