"""Where the kernel sources live and what identifies them, without importing the CuTe DSL.

The source fingerprint (sha256 over every file of the `h3cute.kernels` package plus the host modules the kernels
compile with, `COMPILE_INPUTS`: runtime/dsl.py and widths.py) keys the disk cache and stamps prebuilt bundles:
compiled code is only ever served for the exact sources it was built from.

`h3cute.kernels` is always the kernels of the `h3cute` package that was imported: in an installed wheel the
package's own `h3cute/kernels/`; in a checkout (`<repo>/src/h3cute`, on PYTHONPATH or installed editable) the
checkout's top-level `kernels/` folder, which `map_source_tree_kernels` (run by `import h3cute`, before anything
imports a kernel module) puts in `sys.modules` itself. An editable install's import finder maps `h3cute.kernels`
to the kernels of the checkout it was installed from, so a second checkout on PYTHONPATH would otherwise import
its own `h3cute` with the first checkout's kernels.
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
_PACKAGE_DIR = _RUNTIME_DIR.parent  # the h3cute package that was imported
_SOURCE_TREE_KERNELS = _RUNTIME_DIR.parents[2] / "kernels"  # <repo>/src/h3cute/runtime -> <repo>/kernels
# Modules of the h3cute package (paths relative to it) that the kernels read while they compile: the DSL glue and
# H3's widths. An edit to one of them changes the source fingerprint like an edit to a kernel.
COMPILE_INPUTS = ("runtime/dsl.py", "widths.py")


def _checkout_kernels() -> Path | None:
    """The `kernels/` folder of the checkout the imported h3cute lives in; None for an installed package (its
    `h3cute/kernels` is a subpackage that the ordinary import finds)."""
    if (_PACKAGE_DIR / "kernels" / "__init__.py").is_file():
        return None
    if _PACKAGE_DIR.parent.name == "src" and (_SOURCE_TREE_KERNELS / "__init__.py").is_file():
        return _SOURCE_TREE_KERNELS
    return None


def map_source_tree_kernels() -> None:
    """Make `h3cute.kernels` the kernels of this checkout (a no-op for an installed package), whatever import
    finder (an editable install's) would map it elsewhere."""
    folder = _checkout_kernels()
    if folder is None:
        return
    loaded = sys.modules.get("h3cute.kernels")
    if loaded is not None:
        where = Path(loaded.__path__[0]).resolve()
        if where != folder:
            raise ImportError(f"h3cute.kernels was imported from {where}, but h3cute comes from {_PACKAGE_DIR}, whose "
                              f"kernels are {folder}: import h3cute before anything imports h3cute.kernels")
        return
    init = folder / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "h3cute.kernels", init, submodule_search_locations=[str(folder)]
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
