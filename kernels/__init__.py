"""CuTe DSL kernels, one module per kernel family; each exposes `SPECS: list[KernelSpec]`.

Importing this package imports no kernel module (hence no cutlass): the prebuilt and disk-cache
paths never need one. `all_specs()` imports every module of the package once, on the compile path,
and indexes their specs by name (names must be unique across modules).
"""
from __future__ import annotations

import functools
import importlib
import pkgutil


@functools.cache
def _index() -> dict:
    from h3cute.runtime.spec import KernelSpec

    index = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module_name = f"{__name__}.{info.name}"
        module = importlib.import_module(module_name)
        for spec in getattr(module, "SPECS", ()):
            if not isinstance(spec, KernelSpec):
                raise TypeError(f"{module_name}.SPECS holds {type(spec).__name__}, not KernelSpec")
            if spec.name in index:
                raise ValueError(
                    f"kernel name {spec.name!r} is defined twice: in {index[spec.name][0]} and {module_name}"
                )
            index[spec.name] = (module_name, spec)
    return index


def all_specs() -> dict:
    """{kernel name: KernelSpec} over every kernel module (imports them all, once)."""
    return {name: spec for name, (_, spec) in _index().items()}


def module_of(name: str) -> str:
    return _index()[name][0]


def get_spec(name: str):
    """The KernelSpec called `name` (KeyError listing the known names otherwise)."""
    index = _index()
    if name not in index:
        raise KeyError(f"no kernel spec named {name!r}; known: {sorted(index)}")
    return index[name][1]
