"""Compile-only CI test: every variant of every kernel spec, for sm_90a and sm_100a, on a CPU.

The variants are the specs' `variants` (the picks the bundle builds); with H3CUTE_TEST_CANDIDATES=1 also every sweep
candidate (`KernelSpec.candidates`; `python -m h3cute ptx-digest` compiles those too).

Each variant compiles once per session through the runtime's own compile path (`dsl.compile_variant`,
PTX kept; tests/compiled_ptx.py shares it with the per-family instruction tests), then its PTX is checked:
the `.target` is the arch, every `ptx_markers` substring is present and no `ptx_forbidden` substring is.
Specs are discovered the way the runtime discovers them (`h3cute.kernels.all_specs()`), so a new kernel
module is covered as soon as it defines SPECS; a module that fails to import fails collection.
"""
import os

import pytest

pytest.importorskip("cutlass", reason="compiling needs the CuTe DSL (the device runs prebuilt kernels only)",
                    exc_type=ImportError)

from h3cute.runtime import SUPPORTED_ARCHS
from h3cute.runtime.sources import kernels_package

from compiled_ptx import ptx_of

SPECS = kernels_package().all_specs()
CANDIDATES = os.environ.get("H3CUTE_TEST_CANDIDATES") == "1"
CASES = [(name, arch) for name, spec in sorted(SPECS.items()) for arch in SUPPORTED_ARCHS if arch in spec.archs]


def compiled_variants(name: str, arch: str) -> list:
    """[(static, [ptx, ...])] for every distinct variant (and with CANDIDATES, candidate) of `name` on `arch`
    (compiled once per session)."""
    spec = SPECS[name]
    return [(static, ptx_of(spec, arch, static)) for static in spec.statics(arch, CANDIDATES)]


def test_every_spec_targets_a_supported_arch():
    for name, spec in SPECS.items():
        assert spec.archs and set(spec.archs) <= set(SUPPORTED_ARCHS), (name, spec.archs)


@pytest.mark.slow
@pytest.mark.parametrize("name, arch", CASES, ids=[f"{n}-{a}" for n, a in CASES])
def test_spec_compiles_with_expected_ptx(name, arch):
    spec = SPECS[name]
    variants = compiled_variants(name, arch)
    assert variants, f"{name} lists no variants for {arch}"
    for static, ptxs in variants:
        assert ptxs, f"{name} {static}: build() did not compile through compile_for"
        assert all(f".target {arch}" in p for p in ptxs), f"{name} {static}: PTX not for {arch}"
        text = "\n".join(ptxs)
        missing = [m for m in spec.ptx_markers if m not in text]
        present = [f for f in spec.ptx_forbidden if f in text]
        assert not missing, f"{name} {arch} {static}: PTX lacks {missing}"
        assert not present, f"{name} {arch} {static}: PTX contains forbidden {present}"


@pytest.mark.slow
def test_ptx_digest_is_stable_and_names_what_changed(tmp_path):
    # `python -m h3cute ptx-digest` (refactors of kernel source that must not change device code): two
    # compiles of the same source give the same digests; a changed, added or removed variant is named.
    import json
    import subprocess
    import sys

    from h3cute.runtime import ptx_digest

    args = ["--arch", "sm_90a", "--arch", "sm_100a", "--kernel", "timestep_sinusoid"]
    first = tmp_path / "first.json"
    run = subprocess.run([sys.executable, "-m", "h3cute", "ptx-digest", *args, "--out", str(first)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    digests = json.loads(first.read_text())
    assert len(digests) == 4 and all(len(v) == 64 for v in digests.values())  # 2 archs x check_range on/off
    assert ptx_digest.digests(["sm_90a", "sm_100a"], ["timestep_sinusoid"], log=lambda _: None) == digests

    key = sorted(digests)[0]
    tampered = dict(digests, **{key: "0" * 64, "sm_90a gone []": "1" * 64})
    (tmp_path / "old.json").write_text(json.dumps(tampered))
    again = subprocess.run([sys.executable, "-m", "h3cute", "ptx-digest", *args, "--out", str(tmp_path / "new.json"),
                            "--against", str(tmp_path / "old.json")], capture_output=True, text=True, timeout=600)
    assert again.returncode == 1
    assert f"changed  {key}" in again.stdout and "removed  sm_90a gone []" in again.stdout
