#!/usr/bin/env bash
# Stages the CuTe DSL and the attention kernels built on it (flash-attn-4, its quack-kernels and einops) for a
# device call, on this CPU machine (nothing here is committed):
#   .devdsl/h3dsl.tar.xz  the CPython 3.12 wheels' files, unpacked by perf/device_run.sh into /opt/h3dsl once per
#                         machine; the DSL's run-time library (libcute_dsl_runtime.so) is not in it: .devstage/rt
#                         carries that one
#   .devstage/dsl/        the DSL's own dependencies (cuda-bindings, protobuf) as wheels, which device_run.sh puts
#                         behind the image's packages; they travel with .devstage
#
# The archive (about 50 MiB) and a call's usual carry (.snap with .devstage and the bundle, about 37 MiB) exceed
# the 64 MiB one call carries together, so they travel in two calls to the same warm machine, the first carrying
# .snap, the second .devdsl (docs/DEVICE.md): ignored paths a call does not name stay on the machine.
#
# Usage, from the repo root:  bash perf/stage_dsl.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${H3_DEVSTAGE_CACHE:-/tmp/h3-devstage-cache}/dsl
WHEELS=(nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
        nvidia-cutlass-dsl-libs-cu13==4.8.1 flash-attn-4==4.0.0b36 quack-kernels==0.6.5 einops==0.8.2)
DEPS=(cuda-bindings==13.5.0 protobuf==7.36.2)
LIMIT_MIB=64

grep -qx '/.devdsl/' .git/info/exclude 2>/dev/null || git check-ignore -q .devdsl/ \
  || { echo "stage_dsl: .devdsl is not git-ignored" >&2; exit 2; }
mkdir -p "$CACHE/whl" "$CACHE/deps" .devdsl .devstage/dsl
fetch() {   # fetch DIR SPEC...: each wheel for the device (CPython 3.12, x86-64 Linux) into DIR, once
  local dir=$1 spec norm; shift
  for spec in "$@"; do
    norm=$(echo "${spec%%==*}" | tr '-' '_')
    ls "$dir/${norm}-${spec##*==}-"*.whl >/dev/null 2>&1 \
      || "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
           --platform manylinux_2_28_x86_64 -d "$dir" "$spec"
  done
}
fetch "$CACHE/deps" "${DEPS[@]}"
rm -f .devstage/dsl/*.whl && cp "$CACHE"/deps/*.whl .devstage/dsl/
fetch "$CACHE/whl" "${WHEELS[@]}"

SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
for w in "$CACHE"/whl/*.whl; do unzip -q -o "$w" -d "$SITE"; done
# what the device does not need: the run-time library (carried by .devstage/rt), its static twin and other
# platforms' stubs
rm -rf "$SITE"/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so "$SITE"/nvidia_cutlass_dsl/cu13/lib/stubs \
       "$SITE"/nvidia_cutlass_dsl/cu13/lib/libcuda_dialect_runtime_static.a
tar -C "$SITE" -cf - . | xz -9 -T0 > .devdsl/h3dsl.tar.xz.tmp
mv .devdsl/h3dsl.tar.xz.tmp .devdsl/h3dsl.tar.xz
size=$(du -sm .devdsl | cut -f1)
echo "stage_dsl: .devdsl is ${size} MiB (a call carries ${LIMIT_MIB} MiB with the working tree)"
