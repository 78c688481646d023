"""What a kernel family declares: how to build it, which variants exist, what its code must contain."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")
# Streaming multiprocessors per target GPU (H200, B200): persistent grids are sized from the arch,
# never queried, so kernels compile without a GPU and a grid is the same on every GPU of one kind.
SM_COUNT = {"sm_90a": 132, "sm_100a": 148}


@dataclass(frozen=True)
class KernelSpec:
    """One compiled entry point of a kernel family (see docs/ARCHITECTURE.md).

    build(arch, **static) returns a CuTe DSL compiled function (from `compile_for`).
    variants(arch) lists every static-argument set the op layer may request on that arch (the picks):
    what `python -m h3cute build` prebuilds and the compile-only tests check.
    candidates(arch), default `variants`, lists everything a kernel author may run on that arch (the picks and
    the configs `h3cute-bench sweep` ranks against them; a superset of `variants`): `ptx-digest` digests them
    all, `python -m h3cute build --candidates` prebuilds them too, otherwise the others compile on demand.
    ptx_markers / ptx_forbidden: substrings the generated PTX must / must not contain
    (checked by the compile-only tests for every variant and arch).
    """

    name: str
    build: Callable[..., Any]
    variants: Callable[[str], Iterable[Mapping[str, Any]]]
    candidates: Callable[[str], Iterable[Mapping[str, Any]]] | None = None
    ptx_markers: tuple[str, ...] = ()
    ptx_forbidden: tuple[str, ...] = ()
    archs: tuple[str, ...] = field(default=SUPPORTED_ARCHS)

    def __post_init__(self):
        if self.candidates is None:
            object.__setattr__(self, "candidates", self.variants)

    def statics(self, arch: str, candidates: bool = False) -> list[dict]:
        """The distinct static-argument sets of `variants(arch)` (and with `candidates`, then those of
        `candidates(arch)`), in listing order: the first of several spellings of one variant."""
        seen, out = set(), []
        for static in (*self.variants(arch), *(self.candidates(arch) if candidates else ())):
            canon = canonical_static(static)
            if canon not in seen:
                seen.add(canon)
                out.append(dict(static))
        return out


def canonical_static(static: Mapping[str, Any]) -> tuple:
    """A hashable, order-independent form of static arguments (tile configs included)."""
    return tuple(sorted((k, _canon(v)) for k, v in static.items()))


def _canon(v: Any):
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v).__name__,) + tuple((f.name, _canon(getattr(v, f.name))) for f in dataclasses.fields(v))
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return tuple(_canon(x) for x in v)
    raise TypeError(f"static kernel argument of type {type(v).__name__} is not allowed: {v!r}")


def static_key(canon: tuple) -> str:
    """The JSON text of a canonical static-argument tuple: how manifests and cache sidecars store it."""
    return json.dumps(canon, separators=(",", ":"))


def symbol_name(name: str, arch: str, canon: tuple, fingerprint: str) -> str:
    """Exported C symbol of one compiled variant.

    A valid C identifier, unique per (kernel, arch, static args, sources): many variants link into one
    library, and libraries built from different sources never share a symbol within a process.
    """
    digest = hashlib.sha256(json.dumps([name, arch, static_key(canon), fingerprint]).encode()).hexdigest()
    return f"h3_{re.sub(r'[^0-9A-Za-z_]', '_', name)}_{digest[:16]}"
