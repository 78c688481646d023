"""Thin helpers over the CuTe DSL compiler; imported only on the compile path."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor  # noqa: F401

from .spec import SUPPORTED_ARCHS


def env_stream():
    """A fake stream argument: at call time the kernel runs on torch's current stream."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_for(arch: str, fn, *args, extra_options: str = ""):
    """cute.compile for `arch` with the TVM-FFI calling convention (raw torch tensors in)."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; h3cute targets {SUPPORTED_ARCHS}")
    options = f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip()
    return cute.compile(fn, *args, options=options)
