"""Prebuilt bundles: every variant of every kernel, one shared library per arch plus a manifest.

`python -m h3cute build --arch sm_90a --out DIR` compiles each spec's variants for each arch,
exports each as its own TVM-FFI symbol and links all of an arch's objects into DIR/h3cute_<arch>.so.
DIR/manifest.json records the source fingerprint, the DSL version and, per entry, the kernel name,
its module, arch, canonical static args, symbol, and each library's sha256.

With `H3CUTE_PREBUILT=DIR` the runtime serves kernels from the bundle with only apache-tvm-ffi and
libcute_dsl_runtime.so present (the device has no CuTe DSL). A bundle built from other sources is
never served: `open_bundle` raises BundleMismatchError, and the runtime compiles instead where the
DSL is installed.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .loader import get_function, load_library, sha256_file
from . import sources
from .sources import dsl_version
from .spec import SUPPORTED_ARCHS, KernelSpec, canonical_static, static_key, symbol_name

MANIFEST = "manifest.json"
FORMAT = 1


class BundleMismatchError(RuntimeError):
    """The bundle was built from different kernel sources than the installed ones."""


def library_name(arch: str) -> str:
    return f"h3cute_{arch}.so"


@dataclass
class Bundle:
    root: Path
    manifest: dict
    _symbols: dict  # (name, arch, static_key) -> symbol

    def function(self, name: str, arch: str, canon: tuple):
        """The bundled function, or None when the bundle lacks this variant."""
        symbol = self._symbols.get((name, arch, static_key(canon)))
        if symbol is None:
            return None
        lib = self.root / library_name(arch)
        return get_function(load_library(lib, self.manifest["libraries"][arch]["sha256"]), symbol, lib)

    def variants_of(self, name: str, arch: str) -> list[str]:
        return [s for (n, a, s) in self._symbols if n == name and a == arch]


_open: dict[Path, Bundle] = {}


def open_bundle(root: str | Path) -> Bundle:
    """Read and check DIR/manifest.json (memoized per folder)."""
    root = Path(root).resolve()
    if root in _open:
        return _open[root]
    path = root / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"H3CUTE_PREBUILT={root}: no {MANIFEST} there (build one: python -m h3cute build)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise BundleMismatchError(f"{path}: format {manifest.get('format')!r}, this runtime reads {FORMAT}")
    if manifest["fingerprint"] != sources.source_fingerprint():
        raise BundleMismatchError(
            f"prebuilt bundle {root} was built from kernel sources {manifest['fingerprint'][:12]} "
            f"but the installed sources are {sources.source_fingerprint()[:12]}: rebuild it "
            "(python -m h3cute build --out ...) or unset H3CUTE_PREBUILT"
        )
    symbols = {(e["name"], e["arch"], e["static"]): e["symbol"] for e in manifest["entries"]}
    bundle = _open[root] = Bundle(root, manifest, symbols)
    return bundle


def build_bundle(out: Path, archs: Sequence[str], specs: Iterable[KernelSpec], modules: dict[str, str], log=print) -> dict:
    """Compile every variant of `specs` for `archs` into `out`; returns the manifest written."""
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
                seen = set()
                for static in spec.variants(arch):
                    canon = canonical_static(static)
                    if canon in seen:
                        continue
                    seen.add(canon)
                    symbol = symbol_name(spec.name, arch, canon, fingerprint)
                    t0 = time.perf_counter()
                    compiled, _ = dsl.compile_variant(spec, arch, dict(static))
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
                            {n: kernels.module_of(n) for n in names}, log=console.log)
    console.log(f"[bold]{len(manifest['entries'])} variants, {len(names)} kernels, "
                f"{time.perf_counter() - t0:.0f} s -> {args.out / MANIFEST}")
    return 0
