"""The C++ op layer (`h3_native.cpp`): CUDA impls and autograd kernels of the hot `torch.ops.h3` calls, with
no Python per call.

It is built against the running torch with its C++ extension builder (a C++ compiler and ninja), once per
torch / tvm-ffi / Python version and source hash, under `$H3CUTE_CACHE_DIR/native/`. It is optional:
`load()` returns None when `H3CUTE_NATIVE=0`, when no CUDA device is visible (CPU tensors take the
Python reference impls), or when the build fails (the reason is logged once). Then the ops keep their
Python CUDA impls: the same kernels and bits, more host time per call.

Order matters: the ops are defined in Python first (`h3cute.ops`), the ops in `OPS` get no Python CUDA
impl and those in `AUTOGRAD_OPS` no Python autograd kernel, and `install(module)` registers the C++ ones.

The C++ source declares no width and no launch constant: `install` hands the library `constants()` (H3's widths
from `h3cute.widths`, the launchers' split counts, paddings and table caps) before it registers anything, so a
value lives in one Python module and the built library serves whatever that module says at load.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("h3_native.cpp")
MODULE_NAME = "h3cute_native"
log = logging.getLogger("h3cute.native")
_loaded: dict[str, object] = {}


def build_dir() -> Path:
    """Build folder keyed by the source and every ABI the extension binds to."""
    import torch
    import tvm_ffi

    from h3cute.runtime.cache import cache_dir

    record = f"{torch.__version__}|{tvm_ffi.__version__}|{sys.version_info[:2]}".encode()
    return cache_dir() / "native" / hashlib.sha256(SOURCE.read_bytes() + record).hexdigest()[:16]


def build(verbose: bool = False):
    """Imports the extension built for this source and ABI, compiling it first if the build folder has none;
    raises when it cannot."""
    folder = build_dir()
    library = folder / f"{MODULE_NAME}.so"
    if library.exists():  # the folder is keyed by the source and the ABIs: this library is this source's
        try:
            return _import_library(library)
        except ImportError as err:  # e.g. a link cut short: build again
            log.warning("h3cute: rebuilding the C++ op layer (%s)", str(err).splitlines()[0] if str(err) else err)
    import torch
    import tvm_ffi.libinfo
    from torch.utils.cpp_extension import load as load_extension

    folder.mkdir(parents=True, exist_ok=True)
    log.warning("h3cute: building the C++ op layer for torch %s (once)", torch.__version__)
    libdir = str(Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent)
    return load_extension(
        name=MODULE_NAME,
        sources=[str(SOURCE)],
        extra_include_paths=tvm_ffi.libinfo.include_paths(),
        extra_cflags=["-O2"],
        extra_ldflags=[f"-L{libdir}", "-ltvm_ffi", f"-Wl,-rpath,{libdir}"],
        build_directory=str(folder),
        with_cuda=False,  # c10's device-generic stream API only: no CUDA headers needed
        verbose=verbose,
    )


def _import_library(path: Path):
    """The built extension module at `path` (torch is imported first: the library links against it)."""
    import importlib.util

    import torch  # noqa: F401

    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The extension module, or None (see the module docstring). Decided once per process."""
    if "module" in _loaded:
        return _loaded["module"]
    module = None
    if os.environ.get("H3CUTE_NATIVE", "1") != "0":
        import torch

        if torch.cuda.is_available():
            try:
                module = build()
            except Exception as err:  # no compiler, headers, ...: the Python impls serve
                log.warning("h3cute: C++ op layer unavailable, CUDA ops use their Python impls (%s: %s)",
                            type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    _loaded["module"] = module
    return module


def constants() -> dict:
    """What h3_native.cpp computes with (its `Constants`), by field name: H3's widths and its fast paths' limits
    (ints) and h3::linear's weight shapes ([N, K] pairs), read from the modules that own them."""
    from h3cute import widths
    from h3cute.launch import norm_modulate

    return dict(
        hidden=widths.HIDDEN, freq=widths.FREQ, mlp_hidden=widths.MLP_HIDDEN, temb=widths.TEMB,
        block_chunks=widths.BLOCK_CHUNKS, block_table=widths.BLOCK_TABLE, block_projection=widths.BLOCK_PROJECTION,
        final_projection=widths.FINAL_PROJECTION,
        max_fused_table_rows=max(norm_modulate.FUSED_CAPS), max_table_rows=norm_modulate.MAX_TABLE_ROWS,
        linear_shapes=[list(shape) for shape in widths.LINEAR_SHAPES],
    )


def install(module) -> None:
    """Hands the built library (`load()`'s module) its constants, then it registers its impls (once; call after
    every op is defined)."""
    module.install(constants())


def native_ops() -> frozenset[str]:
    """Ops whose CUDA impl is the C++ one."""
    module = load()
    return frozenset(module.OPS) if module is not None else frozenset()


def native_autograd_ops() -> frozenset[str]:
    """Ops whose autograd kernel is the C++ one."""
    module = load()
    return frozenset(module.AUTOGRAD_OPS) if module is not None else frozenset()
