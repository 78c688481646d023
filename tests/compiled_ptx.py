"""The PTX of kernel variants, compiled once per test session.

The compile-only tests (tests/test_compile_kernels.py compiles every variant of every spec; the per-family
files check instructions of the same variants) ask here instead of calling `dsl.compile_variant` themselves,
so a variant compiles once per session, keyed like the disk cache by (kernel, arch, canonical static args).
Only the PTX is kept, never the compiled object.
"""
from h3cute.runtime import canonical_static

_PTX: dict = {}


def ptx_of(spec, arch: str, static: dict) -> list:
    """[PTX of each compile] of `spec.build(arch, **static)` through the runtime's compile path (`compile_for`)."""
    key = (spec.name, arch, canonical_static(static))
    if key not in _PTX:
        from h3cute.runtime.dsl import compile_variant

        _PTX[key] = compile_variant(spec, arch, dict(static), keep_ptx=True)[1]
    return _PTX[key]
