"""Where the kernel sources live and what identifies them, without importing the CuTe DSL.

The source fingerprint (sha256 over every file of the `h3cute.kernels` package plus runtime/dsl.py)
keys the disk cache and stamps prebuilt bundles: compiled code is only ever served for the exact
sources it was built from.

`h3cute.kernels` is mapped to the top-level `kernels/` folder by the package build. In a source tree
that is only on PYTHONPATH (`src/`), `kernels_package()` maps it the same way itself.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_RUNTIME_DIR = Path(__file__).resolve().parent
_SOURCE_TREE_KERNELS = _RUNTIME_DIR.parents[2] / "kernels"  # <repo>/src/h3cute/runtime -> <repo>/kernels


def map_source_tree_kernels() -> None:
    """Make `import h3cute.kernels` work from a source tree on PYTHONPATH (a no-op when installed)."""
    if "h3cute.kernels" in sys.modules or importlib.util.find_spec("h3cute.kernels") is not None:
        return
    init = _SOURCE_TREE_KERNELS / "__init__.py"
    if not init.is_file():
        return
    spec = importlib.util.spec_from_file_location(
        "h3cute.kernels", init, submodule_search_locations=[str(_SOURCE_TREE_KERNELS)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["h3cute.kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["h3cute.kernels"]
        raise
    setattr(importlib.import_module("h3cute"), "kernels", module)


def kernels_package() -> ModuleType:
    """The `h3cute.kernels` package (its __init__ imports no kernel module, hence no cutlass)."""
    map_source_tree_kernels()
    return importlib.import_module("h3cute.kernels")


def kernels_dir() -> Path:
    return Path(kernels_package().__path__[0]).resolve()


@functools.cache
def source_fingerprint() -> str:
    """sha256 over (relative path, content) of every kernel source file and runtime/dsl.py."""
    root = kernels_dir()
    files = sorted(
        (f"kernels/{p.relative_to(root).as_posix()}", p)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    files.append(("runtime/dsl.py", _RUNTIME_DIR / "dsl.py"))
    h = hashlib.sha256()
    for rel, path in files:
        h.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


@functools.cache
def dsl_version() -> str | None:
    """Installed nvidia-cutlass-dsl version, read from package metadata (no import)."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def dsl_available() -> bool:
    """Whether the CuTe DSL compiler can be imported here (the device has only the runtime)."""
    if "cutlass" in sys.modules:
        return sys.modules["cutlass"] is not None
    try:
        return importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        return False
