"""Prebuilt bundles: every variant of every kernel, one shared library per arch plus a manifest.

`python -m h3cute build --arch sm_90a --out DIR` compiles each spec's variants (the configs the op layer picks;
with `--candidates` also every config `h3cute-bench sweep` may rank, `KernelSpec.candidates`) for each arch,
exports each as its own TVM-FFI symbol and links all of an arch's objects into DIR/h3cute_<arch>.so.
DIR/manifest.json records the source fingerprint, the DSL version and, per entry, the kernel name,
its module, arch, canonical static args, symbol, and each library's sha256.

With `H3CUTE_PREBUILT=DIR` the runtime serves kernels from the bundle with only apache-tvm-ffi and
libcute_dsl_runtime.so present (the device has no CuTe DSL). A bundle built from other sources is
never served (BundleMismatchError), nor is a damaged one (DamagedBundleError: a missing, truncated or
malformed manifest, a library that is missing or fails its sha256); both are BundleError, whose messages
name H3CUTE_PREBUILT and the path, and where the DSL is installed the runtime compiles instead, warning once.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from .loader import CorruptLibraryError, get_function, load_library, sha256_file
from . import sources
from .sources import dsl_version
from .spec import SUPPORTED_ARCHS, KernelSpec, canonical_static, static_key, symbol_name

MANIFEST = "manifest.json"
FORMAT = 1


class BundleError(RuntimeError):
    """H3CUTE_PREBUILT names a bundle this runtime cannot serve."""


class BundleMismatchError(BundleError):
    """The bundle was built from different kernel sources (or manifest format) than the installed ones."""


class DamagedBundleError(BundleError, CorruptLibraryError):
    """The bundle's manifest is missing or malformed, or a library is missing or fails its sha256."""


def library_name(arch: str) -> str:
    return f"h3cute_{arch}.so"


@dataclass
class Bundle:
    root: Path
    manifest: dict
    _symbols: dict  # (name, arch, static_key) -> symbol
    _broken: dict = field(default_factory=dict)  # arch -> DamagedBundleError of its library

    def function(self, name: str, arch: str, canon: tuple):
        """The bundled function, or None when the bundle lacks this variant; DamagedBundleError when its library
        is missing, fails its sha256 or lacks the symbol (remembered: a bad library is read once)."""
        symbol = self._symbols.get((name, arch, static_key(canon)))
        if symbol is None:
            return None
        if arch in self._broken:
            raise self._broken[arch]
        lib = self.root / library_name(arch)
        try:
            return get_function(load_library(lib, self.manifest["libraries"][arch]["sha256"]), symbol, lib)
        except (CorruptLibraryError, OSError) as e:
            self._broken[arch] = DamagedBundleError(f"H3CUTE_PREBUILT={self.root}: damaged bundle: {e}")
            raise self._broken[arch] from e

    def variants_of(self, name: str, arch: str) -> list[str]:
        return [s for (n, a, s) in self._symbols if n == name and a == arch]


_open: dict[Path, Bundle | BundleError] = {}


def open_bundle(root: str | Path) -> Bundle:
    """Read and check DIR/manifest.json (memoized per folder, a failure too): BundleError when unusable."""
    root = Path(root).resolve()
    opened = _open.get(root)
    if opened is None:
        try:
            opened = _read_bundle(root)
        except BundleError as e:
            opened = e
        _open[root] = opened
    if isinstance(opened, BundleError):
        raise opened
    return opened


def _read_bundle(root: Path) -> Bundle:
    path = root / MANIFEST

    def damaged(what: str) -> DamagedBundleError:
        return DamagedBundleError(f"H3CUTE_PREBUILT={root}: damaged bundle: {path} {what} "
                                  "(rebuild it: python -m h3cute build --out ...)")

    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DamagedBundleError(f"H3CUTE_PREBUILT={root}: no {MANIFEST} there (build one: python -m h3cute build)")
    except (OSError, UnicodeDecodeError) as e:
        raise damaged(f"cannot be read ({e})") from e
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise damaged(f"is not JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise damaged(f"holds {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT:
        raise BundleMismatchError(f"H3CUTE_PREBUILT={root}: {path} has format {manifest.get('format')!r}, this "
                                  f"runtime reads {FORMAT}")
    fingerprint = manifest.get("fingerprint")
    if not isinstance(fingerprint, str):
        raise damaged(f"has no source fingerprint (got {fingerprint!r})")
    if fingerprint != sources.source_fingerprint():
        raise BundleMismatchError(
            f"prebuilt bundle H3CUTE_PREBUILT={root} was built from kernel sources {fingerprint[:12]} "
            f"but the installed sources are {sources.source_fingerprint()[:12]}: rebuild it "
            "(python -m h3cute build --out ...) or unset H3CUTE_PREBUILT"
        )
    libraries, entries = manifest.get("libraries"), manifest.get("entries")
    if not (isinstance(libraries, dict)
            and all(isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in libraries.values())):
        raise damaged("has no 'libraries' object mapping each arch to its library's sha256")
    keys = ("name", "arch", "static", "symbol")
    if not (isinstance(entries, list)
            and all(isinstance(e, dict) and all(isinstance(e.get(k), str) for k in keys) for e in entries)):
        raise damaged(f"has no 'entries' list of objects with string {', '.join(keys)}")
    unlisted = sorted({e["arch"] for e in entries} - set(libraries))
    if unlisted:
        raise damaged(f"has entries for {unlisted} but no library for them")
    symbols = {(e["name"], e["arch"], e["static"]): e["symbol"] for e in entries}
    return Bundle(root, manifest, symbols)


def build_bundle(out: Path, archs: Sequence[str], specs: Iterable[KernelSpec], modules: dict[str, str],
                 log=print, candidates: bool = False) -> dict:
    """Compile every variant of `specs` for `archs` into `out` (with `candidates`, every candidate too); returns the
    manifest written."""
    from . import dsl

    out.mkdir(parents=True, exist_ok=True)
    specs = list(specs)
    fingerprint = sources.source_fingerprint()
    entries, libraries = [], {}
    for arch in dict.fromkeys(archs):
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported arch {arch!r}; h3cute targets {SUPPORTED_ARCHS}")
        with tempfile.TemporaryDirectory(prefix=f"h3cute-bundle-{arch}-") as tmp:
            objects = []
            for spec in specs:
                if arch not in spec.archs:
                    continue
                for static in spec.statics(arch, candidates):
                    canon = canonical_static(static)
                    symbol = symbol_name(spec.name, arch, canon, fingerprint)
                    t0 = time.perf_counter()
                    compiled, _ = dsl.compile_variant(spec, arch, static)
                    obj = Path(tmp) / f"{symbol}.o"
                    dsl.export_object(compiled, obj, symbol)
                    objects.append(obj)
                    entries.append(dict(name=spec.name, module=modules.get(spec.name), arch=arch,
                                        static=static_key(canon), symbol=symbol))
                    log(f"{arch}  {spec.name}  {static_key(canon)}  {time.perf_counter() - t0:.1f} s")
            if not objects:
                log(f"{arch}: no kernel variants to build")
                continue
            lib = out / library_name(arch)
            staged = out / f".{lib.name}.tmp"
            dsl.link_library(objects, staged)
            staged.replace(lib)
            libraries[arch] = dict(file=lib.name, sha256=sha256_file(lib))
            log(f"{arch}: linked {len(objects)} variants into {lib}")
    manifest = dict(format=FORMAT, fingerprint=fingerprint, dsl_version=dsl_version(),
                    built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    libraries=libraries, entries=entries)
    staged = out / f".{MANIFEST}.tmp"
    staged.write_text(json.dumps(manifest, indent=1))
    staged.replace(out / MANIFEST)
    _open.pop(out.resolve(), None)
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m h3cute build`: prebuild kernels into a bundle folder."""
    parser = argparse.ArgumentParser(prog="python -m h3cute build", description=main.__doc__)
    parser.add_argument("--arch", action="append", choices=SUPPORTED_ARCHS, required=True,
                        help="target arch (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="bundle folder (library per arch + manifest.json)")
    parser.add_argument("--kernel", action="append", metavar="NAME", help="only these kernels (repeatable)")
    parser.add_argument("--candidates", action="store_true",
                        help="also every sweep candidate, not only the variants the op layer picks (a bundle for the "
                             "GPU suite and the perf scripts, which run every config)")
    args = parser.parse_args(argv)

    from rich.console import Console

    from .sources import kernels_package

    console = Console(stderr=True, log_path=False)
    kernels = kernels_package()
    specs = kernels.all_specs()
    names = args.kernel or sorted(specs)
    unknown = sorted(set(names) - set(specs))
    if unknown:
        parser.error(f"unknown kernel(s) {unknown}; known: {sorted(specs)}")
    t0 = time.perf_counter()
    manifest = build_bundle(args.out, args.arch, [specs[n] for n in names],
                            {n: kernels.module_of(n) for n in names}, log=console.log, candidates=args.candidates)
    console.log(f"[bold]{len(manifest['entries'])} variants, {len(names)} kernels, "
                f"{time.perf_counter() - t0:.0f} s -> {args.out / MANIFEST}")
    return 0
