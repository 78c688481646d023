#!/usr/bin/env bash
# The committed H200 reports: the prior-art comparison of each op (h3cute beside the diffusers replay, the
# real diffusers modules where carried, torch.compile of the replay, the serving engines' and libraries' kernels
# staged by perf/stage_peers.sh, cuBLAS modes for the GEMM ops and SGLang's / Megatron's Triton modes for the
# MLP and the projection, floors from ceilings measured in the same run) and the host-time breakdown
# (`host_profile`). Run on the device through perf/device_run.sh:
#   bash perf/device_run.sh bash perf/h200_reports.sh [OP ...]      (default: every op)
# Each op gets its own time limit so one slow op cannot starve the others inside the 10-minute call:
# H3CUTE_OP_TIMEOUT (default 240 s), and H3CUTE_TRITON_OP_TIMEOUT (default 540 s) for timestep_mlp and
# adaln_projection, which also run four Triton-mode processes (give each of those two a call of its own).
# H3CUTE_BENCH_ARGS passes more arguments to every op, e.g.
#   H3CUTE_BENCH_ARGS='--plan inductor_modes=["default"]' to leave max-autotune out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=perf/results/h200
mkdir -p "$OUT_DIR"
OPS=("$@")
[ ${#OPS[@]} -gt 0 ] || OPS=(timestep_sinusoid timestep_mlp adaln_projection final_adaln_out norm_modulate gate_residual adaln_row_gather)
read -ra BENCH_ARGS <<< "${H3CUTE_BENCH_ARGS:-}"   # split on blanks, no globbing of the JSON's brackets
rc=0
for op in "${OPS[@]}"; do
  if [ "$op" = host_profile ]; then
    timeout 180 python3 perf/host_profile.py "$OUT_DIR/host_profile.json" || rc=1
    continue
  fi
  start=$(date +%s)
  limit=${H3CUTE_OP_TIMEOUT:-240}
  case $op in timestep_mlp|adaln_projection) limit=${H3CUTE_TRITON_OP_TIMEOUT:-540} ;; esac
  timeout "$limit" python3 -m h3cute.bench prior-art --op "$op" --out "$OUT_DIR/$op.json" \
    ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} || rc=1
  echo "h200_reports: $op took $(( $(date +%s) - start )) s"
done
exit $rc
