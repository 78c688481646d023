#!/usr/bin/env bash
# Stages the peers of the prior-art harness for a device call (docs/DEVICE.md), on this CPU machine, into the
# git-ignored .devstage/ (nothing here is committed):
#   .devstage/whl/    wheels perf/device_run.sh installs: diffusers + importlib_metadata (the real-module
#                     candidate), vllm-omni (its MiniMax-H3 Triton kernels), liger-kernel (its RMSNorm)
#   .devstage/peers/  the one file each of SGLang's and Megatron's batch-invariant modes loads, extracted from
#                     their wheels (SGLang's is 39 MB whole); device_run.sh points $H3CUTE_PEER_FILES here
# Pure-Python needs of these that the device lacks travel too; torch, triton, numpy, packaging, zipp, filelock,
# huggingface-hub, regex, requests, safetensors and Pillow are in the device's image. quack-kernels compiles its
# kernels with the CuTe DSL, which the device lacks: it travels with the DSL, in a call of its own
# (perf/stage_dsl.sh).
# Then prints what a call carrying [".devstage", ".prebuilt"] sends, against the 64 MiB a call carries.
#
# Usage, from the repo root:  bash perf/stage_peers.sh        (after ../shared/device/prepare_runtime.sh and the
#                                                               sm_90a build, so that the total is the call's)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${H3_DEVSTAGE_CACHE:-/tmp/h3-devstage-cache}/peers
WHEELS=(diffusers==0.42.1 importlib_metadata==8.7.0 vllm-omni==0.30.0 liger-kernel==0.8.4)
# dist==version  path inside its wheel
FILES=("sglang==0.5.21 sglang/srt/batch_invariant_ops/batch_invariant_ops.py"
       "megatron-core==0.19.2 megatron/core/transformer/custom_layers/batch_invariant_kernels.py")
LIMIT_MIB=64

mkdir -p "$CACHE" .devstage/whl .devstage/peers
grep -qx '/.devstage/' .git/info/exclude 2>/dev/null || git check-ignore -q .devstage/ \
  || { echo "stage_peers: .devstage is not git-ignored" >&2; exit 2; }

download() {   # download SPEC into DIR (a wheel for the device: CPython 3.12, x86-64 Linux)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$2" "$1"
}

for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}; norm=$(echo "$name" | tr '-' '_')
  ls "$CACHE/whl/${norm}-${spec##*==}-"*.whl >/dev/null 2>&1 || download "$spec" "$CACHE/whl"
  rm -f .devstage/whl/"${norm}"-*.whl
  cp "$CACHE/whl/${norm}-${spec##*==}-"*.whl .devstage/whl/
done

for entry in "${FILES[@]}"; do
  spec=${entry%% *}; rel=${entry#* }
  dist=${spec%%==*}; version=${spec##*==}; norm=$(echo "$dist" | tr '-' '_')
  ls "$CACHE/whl/${norm}-${version}-"*.whl >/dev/null 2>&1 || download "$spec" "$CACHE/whl"
  wheel=$(ls "$CACHE/whl/${norm}-${version}-"*.whl | head -1)
  rm -rf .devstage/peers/"${dist}"-*
  mkdir -p ".devstage/peers/${dist}-${version}/$(dirname "$rel")"
  unzip -p "$wheel" "$rel" > ".devstage/peers/${dist}-${version}/$rel"
  [ -s ".devstage/peers/${dist}-${version}/$rel" ] || { echo "stage_peers: $rel is not in $wheel" >&2; exit 3; }
done

mib() { du -sb "$@" 2>/dev/null | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "%.1f", $1 / 1048576}')
echo "stage_peers: a call carrying [\".devstage\", \".prebuilt\"] sends (MiB):"
printf '  %-22s %6s\n' "tracked tree" "$tracked"
for part in .devstage/rt .prebuilt .devstage/whl .devstage/peers; do
  [ -e "$part" ] && printf '  %-22s %6s\n' "$part" "$(mib "$part")" || printf '  %-22s %6s\n' "$part" "absent"
done
other=$(find .devstage -mindepth 1 -maxdepth 1 ! -name rt ! -name whl ! -name peers -print)
[ -z "$other" ] || printf '  %-22s %6s  (%s)\n' ".devstage, other" "$(mib $other)" "$(echo $other)"
total=$(echo "$tracked $(mib .devstage .prebuilt)" | awk '{printf "%.1f", $1 + $2}')
echo "  total                  $total of $LIMIT_MIB"
awk -v t="$total" -v l="$LIMIT_MIB" 'BEGIN {exit !(t < l)}' \
  || { echo "stage_peers: over the $LIMIT_MIB MiB a call carries" >&2; exit 4; }
