#!/usr/bin/env bash
# Device script (after device_run.sh's setup): per-kernel times of chosen launches under Nsight Compute,
# each kernel alone (ncu serializes them), clocks left as they are. Usage, through device_run.sh:
#   bash perf/device_run.sh bash perf/ncu_probe.sh OUTNAME "CASES..." ["DETAIL_CASES..."]
# CASES are perf/ncu_launches.py's; every kernel of DETAIL_CASES is profiled again with the speed-of-light,
# memory, warp-state and scheduler sections. Writes $H3CUTE_OUT/OUTNAME.csv (and OUTNAME_detail.txt).
set -uo pipefail
name=$1; cases=$2; detail=${3:-}
out=${H3CUTE_OUT:-.}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu_probe: no ncu on this machine" >&2; exit 4; }
# shellcheck disable=SC2086
"$NCU" --profile-from-start off --clock-control none --csv --print-units base \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__registers_per_thread \
  python3 perf/ncu_launches.py $cases > "$out/$name.csv" 2> "$out/${name}_stderr.txt"
rc=$?
if [ -n "$detail" ]; then
  # shellcheck disable=SC2086
  "$NCU" --profile-from-start off --clock-control none \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats \
    python3 perf/ncu_launches.py $detail > "$out/${name}_detail.txt" 2>> "$out/${name}_stderr.txt" || rc=$?
fi
exit $rc
