"""Kernel runtime: arch selection, compile → export → link, disk cache, prebuilt bundles, loading.

`kernel(name, device, **static)` returns a `tvm_ffi.Function` that takes raw torch tensors and runs
on torch's current stream. After the first call for a (name, device, static) it is one dict hit.
The first call resolves, in order: the prebuilt bundle in `H3CUTE_PREBUILT` (no CuTe DSL needed),
the disk cache in `H3CUTE_CACHE_DIR`, then a compile with the CuTe DSL into that cache.
Importing this package does not import cutlass; `compile_for` (for kernel modules) does, on access.
"""
from __future__ import annotations

import logging
import os
import threading

from .spec import SM_COUNT, SUPPORTED_ARCHS, KernelSpec, canonical_static

__all__ = ["MAX_ROWS", "row_range", "KernelSpec", "compile_for", "kernel", "kernel_for_arch", "arch_of", "SM_COUNT",
           "sm_count", "SUPPORTED_ARCHS", "canonical_static"]

log = logging.getLogger("h3cute.runtime")

# Row-count bound of launch plans' row ranges (h3cute.launch.plan; h3cute.native's plan tables): "any number of rows".
MAX_ROWS = 1 << 62


def row_range(bounds, rows: int) -> tuple[int, int]:
    """The range [lo, hi] of ascending upper `bounds` (the last MAX_ROWS) that holds `rows`: hi is the first
    bound >= rows, lo the bound before it + 1 (0 below the first). Launchers cut their row-count choices
    (tile configs) at such bounds; the launch plans serve one range each."""
    lo = 0
    for hi in bounds:
        if rows <= hi:
            return lo, hi
        lo = hi + 1
    raise ValueError(f"{rows} rows is past the last bound {bounds[-1]}")


_by_call: dict = {}  # (name, device, static items) -> function: the hot path
_by_arch: dict = {}  # (name, arch, canonical static) -> function
_arch_of_device: dict = {}
_sm_count_of_device: dict = {}
_resolve_lock = threading.RLock()
_bundle_warned: set = set()  # H3CUTE_PREBUILT values already warned about (a bundle that cannot serve)


def __getattr__(attr):
    if attr == "compile_for":
        from .dsl import compile_for

        return compile_for
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def arch_of(device) -> str:
    """Compile target of a CUDA device: capability 9.0 -> sm_90a, 10.x -> sm_100a."""
    arch = _arch_of_device.get(device)
    if arch is None:
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) == (9, 0):
            arch = "sm_90a"
        elif major == 10:
            arch = "sm_100a"
        else:
            raise RuntimeError(
                f"GPU {torch.cuda.get_device_name(device)!r} has capability {major}.{minor}; h3cute kernels "
                f"target {SUPPORTED_ARCHS} (capability 9.0 Hopper, 10.x Blackwell)"
            )
        _arch_of_device[device] = arch
    return arch


def sm_count(device) -> int:
    """The streaming multiprocessors of a CUDA device (an H100 PCIe has 114, an H200 132, a B200 148): for launch
    choices that model rounds of CTAs over the GPU. Without a GPU to ask (CPU emulation, ahead-of-time work) the
    arch's `SM_COUNT`. Compiled grids stay sized from the arch."""
    count = _sm_count_of_device.get(device)
    if count is None:
        import torch

        if not (torch.cuda.is_available() and torch.device(device).type == "cuda"):
            return SM_COUNT[arch_of(device)]
        count = _sm_count_of_device[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def kernel(name: str, device, **static):
    """The compiled kernel `name` for `device` (a torch.device, index or string) and static args."""
    key = (name, device, tuple(static.items()))
    try:
        return _by_call[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable static value (a list): take the canonical path every time
        return kernel_for_arch(name, arch_of(device), **static)
    fn = _by_call[key] = kernel_for_arch(name, arch_of(device), **static)
    return fn


def kernel_for_arch(name: str, arch: str, **static):
    """The compiled kernel `name` for `arch` ("sm_90a" / "sm_100a") and static args."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; h3cute targets {SUPPORTED_ARCHS}")
    canon = canonical_static(static)
    key = (name, arch, canon)
    fn = _by_arch.get(key)
    if fn is None:
        with _resolve_lock:
            fn = _by_arch.get(key)
            if fn is None:
                fn = _by_arch[key] = _resolve(name, arch, static, canon)
    return fn


def _resolve(name: str, arch: str, static: dict, canon: tuple):
    from .sources import dsl_available

    prebuilt = os.environ.get("H3CUTE_PREBUILT")
    if prebuilt:
        from .bundle import BundleError, open_bundle

        try:
            bundle = open_bundle(prebuilt)
            fn = bundle.function(name, arch, canon)
        except BundleError as e:  # built from other sources, or damaged
            if not dsl_available():
                raise
            if prebuilt not in _bundle_warned:
                _bundle_warned.add(prebuilt)
                log.warning("%s; compiling with the CuTe DSL instead", e)
        else:
            if fn is not None:
                return fn
            if not dsl_available():
                raise LookupError(
                    f"prebuilt bundle H3CUTE_PREBUILT={prebuilt} has no {arch} variant of {name} with static args "
                    f"{static}, and the CuTe DSL is not installed to compile it (a bundle holds the op layer's picks; "
                    f"`python -m h3cute build --candidates` also bundles every sweep candidate); bundled variants: "
                    f"{bundle.variants_of(name, arch)}"
                )
            log.warning("prebuilt bundle H3CUTE_PREBUILT=%s lacks %s %s %s; compiling it", prebuilt, name, arch, static)
    if not dsl_available():
        raise RuntimeError(
            f"kernel {name} ({arch}) needs compiling but the CuTe DSL (nvidia-cutlass-dsl) is not installed; "
            "set H3CUTE_PREBUILT to a prebuilt bundle (python -m h3cute build)"
        )
    from . import cache
    from .sources import kernels_package

    return cache.load_or_build(name, arch, static, lambda: kernels_package().get_spec(name))
