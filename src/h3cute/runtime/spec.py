"""What a kernel family declares: how to build it, which variants exist, what its code must contain."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")


@dataclass(frozen=True)
class KernelSpec:
    """One compiled entry point of a kernel family (see docs/ARCHITECTURE.md).

    build(arch, **static) returns a CuTe DSL compiled function (from `compile_for`).
    variants(arch) lists every static-argument set the op layer may request on that arch,
    so `python -m h3cute build` can prebuild them all.
    ptx_markers / ptx_forbidden: substrings the generated PTX must / must not contain
    (checked by the compile-only tests for every variant and arch).
    """

    name: str
    build: Callable[..., Any]
    variants: Callable[[str], Iterable[Mapping[str, Any]]]
    ptx_markers: tuple[str, ...] = ()
    ptx_forbidden: tuple[str, ...] = ()
    archs: tuple[str, ...] = field(default=SUPPORTED_ARCHS)


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
