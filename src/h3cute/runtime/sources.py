"""Where the kernel sources live and what identifies them, without importing the CuTe DSL.

The source fingerprint (sha256 over every file of the `h3cute.kernels` package plus the host modules the kernels
compile with, `COMPILE_INPUTS`: runtime/dsl.py and widths.py) keys the disk cache and stamps prebuilt bundles:
compiled code is only ever served for the exact sources it was built from.

`h3cute.kernels` is an ordinary subpackage of the `h3cute` that was imported: in a checkout `src/h3cute/kernels` is
a link to the top-level `kernels/` folder, so a checkout on PYTHONPATH, an editable install and a wheel (which
holds the files themselves) each import their own kernels, with no import hook of h3cute's.
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
# Modules of the h3cute package (paths relative to it) that the kernels read while they compile: the DSL glue and
# H3's widths. An edit to one of them changes the source fingerprint like an edit to a kernel.
COMPILE_INPUTS = ("runtime/dsl.py", "widths.py")


def kernels_package() -> ModuleType:
    """The `h3cute.kernels` package (its __init__ imports no kernel module, hence no cutlass)."""
    return importlib.import_module("h3cute.kernels")


def kernels_dir() -> Path:
    return Path(kernels_package().__path__[0]).resolve()


@functools.cache
def source_fingerprint() -> str:
    """sha256 over (relative path, content) of every kernel source file and of COMPILE_INPUTS."""
    root = kernels_dir()
    files = sorted(
        (f"kernels/{p.relative_to(root).as_posix()}", p)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    files += [(rel, _RUNTIME_DIR.parent / rel) for rel in COMPILE_INPUTS]
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
