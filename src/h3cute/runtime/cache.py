"""On-disk cache of compiled kernels: one shared library + JSON sidecar per variant.

Key: sha256 of (source fingerprint, DSL version, arch, kernel name, canonical static args); the
entry lives in `H3CUTE_CACHE_DIR` (default ~/.cache/h3cute) as `<key>.so` and `<key>.json` (the
library's sha256, its symbol and what it was built from). Writers hold a per-key file lock and
publish with os.replace (library first, sidecar last), so a reader sees a whole entry or none.
An entry whose library fails its sha256 or does not load is removed and rebuilt. A hit needs
neither the CuTe DSL nor the kernel's module.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from filelock import FileLock

from .loader import CorruptLibraryError, get_function, load_library, sha256_file
from . import sources
from .sources import dsl_version
from .spec import KernelSpec, canonical_static, static_key, symbol_name


def cache_dir() -> Path:
    return Path(os.environ.get("H3CUTE_CACHE_DIR") or Path.home() / ".cache" / "h3cute")


def entry_key(name: str, arch: str, canon: tuple) -> str:
    record = [sources.source_fingerprint(), dsl_version(), arch, name, static_key(canon)]
    return hashlib.sha256(json.dumps(record).encode()).hexdigest()


def _load_entry(so: Path, sidecar: Path):
    """The entry's function, None when absent; CorruptLibraryError when present but bad."""
    if not sidecar.is_file():
        return None
    try:
        meta = json.loads(sidecar.read_text())
        sha, symbol = meta["sha256"], meta["symbol"]
    except (ValueError, KeyError) as e:
        raise CorruptLibraryError(f"{sidecar}: unreadable sidecar") from e
    if not so.is_file():
        raise CorruptLibraryError(f"{so}: missing library")
    return get_function(load_library(so, sha), symbol, so)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_build(name: str, arch: str, static: dict, get_spec: Callable[[], KernelSpec]):
    """The tvm_ffi.Function for (name, arch, static), from the cache or compiled into it."""
    canon = canonical_static(static)
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    key = entry_key(name, arch, canon)
    so, sidecar = root / f"{key}.so", root / f"{key}.json"
    try:
        fn = _load_entry(so, sidecar)
        if fn is not None:
            return fn
    except CorruptLibraryError:
        pass  # rebuilt below, under the lock
    with FileLock(str(root / f"{key}.lock")):
        try:
            fn = _load_entry(so, sidecar)  # another process may have built it meanwhile
            if fn is not None:
                return fn
        except CorruptLibraryError:
            sidecar.unlink(missing_ok=True)
            so.unlink(missing_ok=True)
        spec = get_spec()
        symbol = symbol_name(name, arch, canon, sources.source_fingerprint())
        _build(spec, arch, static, symbol, so)
        meta = {
            "sha256": sha256_file(so),
            "symbol": symbol,
            "name": name,
            "arch": arch,
            "static": static_key(canon),
            "fingerprint": sources.source_fingerprint(),
            "dsl_version": dsl_version(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _atomic_write(sidecar, lambda p: p.write_text(json.dumps(meta, indent=1)))
        return get_function(load_library(so, meta["sha256"]), symbol, so)


def _build(spec: KernelSpec, arch: str, static: dict, symbol: str, so: Path) -> None:
    from . import dsl

    compiled, _ = dsl.compile_variant(spec, arch, static)
    with tempfile.TemporaryDirectory(prefix="h3cute-build-") as tmp:
        obj = Path(tmp) / f"{symbol}.o"
        dsl.export_object(compiled, obj, symbol)
        _atomic_write(so, lambda p: dsl.link_library([obj], p))
