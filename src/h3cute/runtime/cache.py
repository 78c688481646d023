"""On-disk cache of compiled kernels: one shared library + JSON sidecar per variant.

Key: sha256 of (source fingerprint, DSL version, arch, kernel name, canonical static args); the
entry lives in `H3CUTE_CACHE_DIR` (default ~/.cache/h3cute) as `<key>.so` and `<key>.json` (the
library's sha256, its symbol and what it was built from). Writers hold a per-key file lock and
publish with os.replace (library first, sidecar last), so a reader sees a whole entry or none.
A hit needs neither the CuTe DSL nor the kernel's module.

Every bad entry heals: a sidecar that is not JSON, not an object, or lacks a string sha256 / symbol, a
library that is missing, fails its sha256 or does not load, an entry this user cannot read: the entry is
removed and rebuilt under the lock.

A cache may be shared between users (a cluster's common H3CUTE_CACHE_DIR): entries are written 0644 and the
folders this module creates 0755, so every user can read them; lock files are 0666, so whoever may write the
folder may also build in it. A cache this process cannot use (read-only, not writable for this user, not a
folder) never stops the run: it warns once, still serves the entries it can read, and builds the others into
the per-user default ~/.cache/h3cute, or where that fails too into a private temporary folder. Errors and
warnings about the cache name H3CUTE_CACHE_DIR and the path.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from filelock import FileLock

from .loader import CorruptLibraryError, get_function, load_library, sha256_file
from . import sources
from .sources import dsl_version
from .spec import KernelSpec, canonical_static, static_key, symbol_name

log = logging.getLogger("h3cute.runtime")

FILE_MODE, DIR_MODE, LOCK_MODE = 0o644, 0o755, 0o666
_fallbacks: dict[Path, tuple[Path, "_Unusable"]] = {}  # unusable cache -> (where this process builds instead, why)


class CacheError(RuntimeError):
    """No cache folder, not even a fallback, can hold a compiled kernel."""


class _Unusable(Exception):
    """This process cannot use a cache folder (permissions, read-only file system, not a folder)."""

    def __init__(self, folder: Path, detail: str):
        super().__init__(f"{named(folder)}: {detail}")
        self.detail = detail


def cache_dir() -> Path:
    return Path(os.environ.get("H3CUTE_CACHE_DIR") or _default_dir())


def _default_dir() -> Path:
    return Path.home() / ".cache" / "h3cute"


def named(folder: Path) -> str:
    """How messages name a cache folder: with the variable that chose it (or as the fallback it is)."""
    if folder != cache_dir():
        return f"fallback cache folder {folder}"
    if os.environ.get("H3CUTE_CACHE_DIR"):
        return f"H3CUTE_CACHE_DIR={folder}"
    return f"{folder} (H3CUTE_CACHE_DIR unset: the default)"


@contextmanager
def _fs(root: Path, what: str, path: Path):
    """File-system errors inside become _Unusable, naming the cache and the path."""
    try:
        yield
    except OSError as e:
        raise _Unusable(root, f"cannot {what} {path}: {e.strerror or e}") from e


def entry_key(name: str, arch: str, canon: tuple) -> str:
    record = [sources.source_fingerprint(), dsl_version(), arch, name, static_key(canon)]
    return hashlib.sha256(json.dumps(record).encode()).hexdigest()


def _load_entry(so: Path, sidecar: Path):
    """The entry's function, None when absent; CorruptLibraryError when present but bad or unreadable."""
    try:
        if not sidecar.is_file():
            return None
        meta = json.loads(sidecar.read_text())
    except (OSError, ValueError) as e:  # unreadable, or not JSON (ValueError: also bad UTF-8)
        raise CorruptLibraryError(f"{sidecar}: unreadable sidecar ({e})") from e
    sha, symbol = (meta.get("sha256"), meta.get("symbol")) if isinstance(meta, dict) else (None, None)
    if not (isinstance(sha, str) and isinstance(symbol, str)):
        raise CorruptLibraryError(f"{sidecar}: sidecar is not an object with string sha256 and symbol")
    try:
        if not so.is_file():
            raise CorruptLibraryError(f"{so}: missing library")
        return get_function(load_library(so, sha), symbol, so)
    except OSError as e:
        raise CorruptLibraryError(f"{so}: unreadable library ({e})") from e


def _make_dirs(root: Path, mode: int = DIR_MODE) -> None:
    """mkdir -p, each folder created here set to `mode` (umask aside)."""
    missing = []
    for folder in (root, *root.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue
        os.chmod(folder, mode)


def _atomic_write(path: Path, write: Callable[[Path], None], mode: int = FILE_MODE) -> None:
    root = path.parent
    with _fs(root, "write into", root):
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
    try:
        write(Path(tmp))
        with _fs(root, "publish", path):
            os.chmod(tmp, mode)
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_build(name: str, arch: str, static: dict, get_spec: Callable[[], KernelSpec]):
    """The tvm_ffi.Function for (name, arch, static), from the cache or compiled into it (or into the fallback
    folder, see the module docstring)."""
    canon = canonical_static(static)
    key = entry_key(name, arch, canon)
    root = cache_dir()
    if root not in _fallbacks:
        try:
            return _serve(root, key, name, arch, static, canon, get_spec)
        except _Unusable as e:
            _fallbacks[root] = _fallback_for(root, e), e
    try:  # an entry built by someone who could write the cache is still served
        fn = _load_entry(root / f"{key}.so", root / f"{key}.json")
        if fn is not None:
            return fn
    except CorruptLibraryError:
        pass
    fallback, why = _fallbacks[root]
    try:
        return _serve(fallback, key, name, arch, static, canon, get_spec)
    except _Unusable as e:
        raise CacheError(f"kernel cache {named(root)} is unusable ({why.detail}), and so is the {e}") from e


def _fallback_for(root: Path, why: _Unusable) -> Path:
    """The folder this process builds into instead of `root` (the per-user default, else a private temporary
    folder), with the one warning."""
    folder = _default_dir()
    if folder == root or not _writable(folder):
        try:
            folder = Path(tempfile.mkdtemp(prefix="h3cute-cache-"))
        except OSError as e:
            raise CacheError(f"kernel cache {why}, and no fallback folder could be made: {e}") from e
    log.warning("h3cute: kernel cache %s; kernels missing there are compiled into %s instead", why, folder)
    return folder


def _writable(folder: Path) -> bool:
    try:
        _make_dirs(folder)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def _serve(root: Path, key: str, name: str, arch: str, static: dict, canon: tuple, get_spec):
    so, sidecar = root / f"{key}.so", root / f"{key}.json"
    with _fs(root, "create", root):
        _make_dirs(root)
    try:
        fn = _load_entry(so, sidecar)
        if fn is not None:
            return fn
    except CorruptLibraryError:
        pass  # rebuilt below, under the lock
    lock = root / f"{key}.lock"
    with _fs(root, "lock", lock):
        held = FileLock(str(lock), mode=LOCK_MODE)
        held.acquire()
    try:
        try:
            fn = _load_entry(so, sidecar)  # another process may have built it meanwhile
            if fn is not None:
                return fn
        except CorruptLibraryError as e:
            with _fs(root, "remove the damaged entry", sidecar):
                sidecar.unlink(missing_ok=True)
                so.unlink(missing_ok=True)
            log.warning("h3cute: rebuilding a damaged kernel cache entry in %s: %s", named(root), e)
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
    finally:
        held.release()


def _build(spec: KernelSpec, arch: str, static: dict, symbol: str, so: Path) -> None:
    from . import dsl

    compiled, _ = dsl.compile_variant(spec, arch, static)
    with tempfile.TemporaryDirectory(prefix="h3cute-build-") as tmp:
        obj = Path(tmp) / f"{symbol}.o"
        dsl.export_object(compiled, obj, symbol)
        _atomic_write(so, lambda p: dsl.link_library([obj], p))
