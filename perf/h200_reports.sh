#!/usr/bin/env bash
# The committed H200 reports: the prior-art comparison of each op (h3cute beside the diffusers replay, the
# real diffusers modules where carried, cuBLAS modes for the GEMM ops, floors from ceilings measured in the
# same run) and the host-time breakdown (`host_profile`). Run on the device through perf/device_run.sh:
#   bash perf/device_run.sh bash perf/h200_reports.sh [OP ...]      (default: every op)
# Each op gets its own time limit so one slow op cannot starve the others inside the 10-minute call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=perf/results/h200
mkdir -p "$OUT_DIR"
OPS=("$@")
[ ${#OPS[@]} -gt 0 ] || OPS=(timestep_sinusoid timestep_mlp adaln_projection final_adaln_out norm_modulate gate_residual adaln_row_gather)
rc=0
for op in "${OPS[@]}"; do
  if [ "$op" = host_profile ]; then
    timeout 180 python3 perf/host_profile.py "$OUT_DIR/host_profile.json" || rc=1
    continue
  fi
  start=$(date +%s)
  timeout "${H3CUTE_OP_TIMEOUT:-240}" python3 -m h3cute.bench prior-art --op "$op" --out "$OUT_DIR/$op.json" || rc=1
  echo "h200_reports: $op took $(( $(date +%s) - start )) s"
done
exit $rc
