"""Loading compiled kernel libraries through apache-tvm-ffi, with or without the CuTe DSL installed.

A kernel library needs libcute_dsl_runtime.so (its DT_NEEDED) already loaded with RTLD_GLOBAL.
It is looked up in order: `H3CUTE_RUNTIME_LIB` (a file), the runtime the imported DSL uses, the
installed DSL wheel (found through package metadata, without importing cutlass), then every folder
on LD_LIBRARY_PATH (the device's /opt/h3rt/lib, set by rt_env.sh).

A library's bytes are checked against their recorded sha256 before dlopen: a truncated shared
object can crash the process in the loader rather than raise.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import sys
import threading
from pathlib import Path

RUNTIME_LIB_NAME = "libcute_dsl_runtime.so"

_lock = threading.Lock()
_runtime_handle: ctypes.CDLL | None = None
_modules: dict[str, object] = {}  # resolved path -> tvm_ffi.Module (dlopen'ed once, never unloaded)


class CorruptLibraryError(RuntimeError):
    """A library file does not match its recorded sha256, or does not load."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def find_runtime_library() -> Path:
    env = os.environ.get("H3CUTE_RUNTIME_LIB")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"H3CUTE_RUNTIME_LIB={env} is not a file")
        return Path(env)
    if sys.modules.get("cutlass") is not None:
        from cutlass.cute.runtime import find_runtime_libraries

        for lib in find_runtime_libraries(enable_tvm_ffi=False):
            if lib.endswith(RUNTIME_LIB_NAME):
                return Path(lib)
    for dist in ("nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-base"):
        try:
            files = importlib.metadata.distribution(dist).files or ()
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.name == RUNTIME_LIB_NAME:
                return Path(f.locate()).resolve()
    for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        if (Path(folder) / RUNTIME_LIB_NAME).is_file():
            return Path(folder) / RUNTIME_LIB_NAME
    raise FileNotFoundError(
        f"{RUNTIME_LIB_NAME} not found: install nvidia-cutlass-dsl, set H3CUTE_RUNTIME_LIB to the file, "
        "or put its folder on LD_LIBRARY_PATH (on the device: source .devstage/rt/rt_env.sh)"
    )


def _ensure_runtime() -> None:
    global _runtime_handle
    if _runtime_handle is None:
        _runtime_handle = ctypes.CDLL(str(find_runtime_library()), mode=ctypes.RTLD_GLOBAL)


def load_library(path: Path, sha256: str | None):
    """tvm_ffi.Module of a kernel library, verified against `sha256` (None: trusted, just built)."""
    key = str(Path(path).resolve())
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module
        if sha256 is not None and sha256_file(Path(key)) != sha256:
            raise CorruptLibraryError(f"{key}: sha256 does not match its record")
        _ensure_runtime()
        import tvm_ffi

        try:
            module = tvm_ffi.load_module(key)
        except Exception as e:  # tvm_ffi reports dlopen failures as RuntimeError
            raise CorruptLibraryError(f"{key}: failed to load: {e}") from e
        _modules[key] = module
        return module


def get_function(module, symbol: str, where: Path):
    try:
        return module[symbol]
    except Exception as e:
        raise CorruptLibraryError(f"{where}: has no exported function {symbol}") from e
