"""`python -m h3cute ptx-digest`: a sha256 of the generated PTX of every kernel variant, for refactors.

Every variant: the op layer's picks and every sweep candidate (`KernelSpec.candidates`), so the guard covers configs
the bundle does not build.

A change to kernel source that should not change the device code (a helper extracted, a config moved) is
shown to be exactly that when every variant's PTX digest is unchanged. Compiles on a machine without a GPU.

    python -m h3cute ptx-digest --arch sm_90a --arch sm_100a --out before.json
    ... edit kernels/ ...
    python -m h3cute ptx-digest --arch sm_90a --arch sm_100a --out after.json --against before.json

With `--against`, prints the variants whose PTX changed, appeared or disappeared and exits 1 if any did.
With `--ptx-dir DIR`, also writes each variant's PTX there (for `ptxas -v`: registers, spills, shared memory).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path
from typing import Sequence

from .spec import SUPPORTED_ARCHS, canonical_static, static_key


def kernel_specs(names: Sequence[str] | None) -> dict:
    """Every kernel spec by name; ValueError naming the unknown and the known kernels if `names` has others."""
    from .sources import kernels_package

    specs = kernels_package().all_specs()
    unknown = sorted(set(names or ()) - set(specs))
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; known: {sorted(specs)}")
    return specs


def digests(archs: Sequence[str], names: Sequence[str] | None = None, log=print,
            ptx_dir: Path | None = None) -> dict[str, str]:
    """{"<arch> <kernel> <static>": sha256 of the variant's PTX} for every variant and candidate of the named
    kernels; with `ptx_dir`, each variant's PTX is written there as <arch>.<kernel>.<static values>.<i>.ptx."""
    from .dsl import compile_variant

    specs = kernel_specs(names)
    out = {}
    for arch in archs:
        for name in sorted(names or specs):
            spec = specs[name]
            if arch not in spec.archs:
                continue
            for static in spec.statics(arch, candidates=True):
                _, ptxs = compile_variant(spec, arch, static, keep_ptx=True)
                key = f"{arch} {name} {static_key(canonical_static(static))}"
                out[key] = hashlib.sha256("\n".join(ptxs).encode()).hexdigest()
                if ptx_dir is not None:
                    parts = (re.sub(r"[^\w-]+", "", f"{k}{v}") for k, v in canonical_static(static))
                    stem = ".".join([arch, name, *parts])
                    for i, ptx in enumerate(ptxs):
                        (ptx_dir / f"{stem}.{i}.ptx").write_text(ptx)
                log(f"{key} {out[key][:12]}")
    return out


def compare(new: dict[str, str], old: dict[str, str]) -> list[str]:
    """One line per variant that differs between two digest maps (sorted); empty when identical."""
    lines = [f"changed  {k}" for k in sorted(new.keys() & old.keys()) if new[k] != old[k]]
    lines += [f"added    {k}" for k in sorted(new.keys() - old.keys())]
    lines += [f"removed  {k}" for k in sorted(old.keys() - new.keys())]
    return lines


def _read_digests(parser: argparse.ArgumentParser, path: Path) -> dict[str, str]:
    """An earlier digest file (`--against`), or the parser's error naming it."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        parser.error(f"--against {path}: cannot be read as a digest file ({e})")
    if not (isinstance(old, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in old.items())):
        parser.error(f"--against {path}: not a digest file (a JSON object of variant -> sha256, from --out)")
    return old


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m h3cute ptx-digest`: PTX digests of kernel variants, optionally compared with an earlier file."""
    parser = argparse.ArgumentParser(prog="python -m h3cute ptx-digest", description=main.__doc__)
    parser.add_argument("--arch", action="append", choices=SUPPORTED_ARCHS, required=True,
                        help="target arch (repeatable)")
    parser.add_argument("--kernel", action="append", metavar="NAME", help="only these kernels (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the digests (JSON)")
    parser.add_argument("--against", type=Path, help="an earlier digest file: report and fail on differences")
    parser.add_argument("--ptx-dir", type=Path, help="also write each variant's PTX into this folder")
    args = parser.parse_args(argv)
    # Everything that can be wrong with the arguments fails here, before minutes of compiling.
    try:
        kernel_specs(args.kernel)
    except ValueError as e:
        parser.error(str(e))
    old = None if args.against is None else _read_digests(parser, args.against)
    if not args.out.parent.is_dir():
        parser.error(f"--out {args.out}: folder {args.out.parent} does not exist")
    if args.ptx_dir is not None:
        args.ptx_dir.mkdir(parents=True, exist_ok=True)
    new = digests(args.arch, args.kernel, log=lambda line: None, ptx_dir=args.ptx_dir)
    args.out.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
    print(f"{len(new)} variants -> {args.out}")
    if old is None:
        return 0
    lines = compare(new, old)
    print("\n".join(lines) if lines else f"identical PTX for all {len(new)} variants")
    return 1 if lines else 0
