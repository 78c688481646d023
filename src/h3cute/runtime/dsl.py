"""Thin helpers over the CuTe DSL compiler; imported only on the compile path.

compile → export → link: `compile_for` is what kernel modules call from their `build`;
`compile_variant` runs a spec's build under the process-wide compile lock (cute.compile is not
thread-safe) and can keep the generated PTX; `export_object` writes one variant as a relocatable
object exporting one TVM-FFI function; `link_library` links any number of such objects into one
shared library against the DSL's runtime libraries.
"""
from __future__ import annotations

import contextvars
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import cutlass.cute as cute
from cutlass.cute.runtime import find_runtime_libraries
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor  # noqa: F401

from .spec import SUPPORTED_ARCHS

COMPILE_LOCK = threading.RLock()
# Set while compile_variant(..., keep_ptx=True) runs: compile_for appends each compile's PTX here.
_ptx_sink: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("h3cute_ptx_sink", default=None)


def env_stream():
    """A fake stream argument: at call time the kernel runs on torch's current stream."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_for(arch: str, fn, *args, extra_options: str = ""):
    """cute.compile for `arch` with the TVM-FFI calling convention (raw torch tensors in)."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; h3cute targets {SUPPORTED_ARCHS}")
    options = f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip()
    sink = _ptx_sink.get()
    with COMPILE_LOCK:
        if sink is None:
            return cute.compile(fn, *args, options=options)
        # The DSL writes the PTX only into an existing dump folder; one folder per compile, since
        # its file name depends on the function and argument types only, not on static values.
        with tempfile.TemporaryDirectory(prefix="h3cute-ptx-") as dump:
            compiled = cute.compile(fn, *args, options=f"{options} --keep-ptx --dump-dir {dump}")
            ptx = compiled.__ptx__
            if not ptx or ".target" not in ptx:
                raise RuntimeError(f"the CuTe DSL kept no PTX for {getattr(fn, '__name__', fn)} ({arch})")
            sink.append(ptx)
        return compiled


def compile_variant(spec, arch: str, static: dict, *, keep_ptx: bool = False):
    """spec.build(arch, **static) under the compile lock; returns (compiled, [ptx of each compile])."""
    if arch not in spec.archs:
        raise ValueError(f"kernel {spec.name} is not built for {arch} (its archs: {spec.archs})")
    ptx: list[str] = []
    token = _ptx_sink.set(ptx if keep_ptx else None)
    try:
        with COMPILE_LOCK:
            compiled = spec.build(arch, **static)
    finally:
        _ptx_sink.reset(token)
    return compiled, ptx


def export_object(compiled, path: Path, symbol: str) -> None:
    """Write `compiled` as a PIC object exporting only the TVM-FFI function `symbol`."""
    with COMPILE_LOCK:
        compiled.export_to_c(str(path), function_name=symbol, export_only_tvm_ffi_symbols=True)


def link_library(objects: list[Path], out: Path) -> None:
    """gcc -shared the objects into `out` (not atomic: callers link to a temp name and rename)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc, or $CC) to link kernel objects with")
    cmd = [cc, "-shared", "-o", str(out), *map(str, objects), *find_runtime_libraries(enable_tvm_ffi=True)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"linking {out.name} failed:\n{' '.join(cmd)}\n{result.stderr}")

