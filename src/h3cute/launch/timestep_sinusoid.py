"""Host side of `h3::timestep_sinusoid` on CUDA: allocate the (T, 256) FP32 output, launch one kernel.

The op layer (h3cute.ops.timestep) validates t's dtype and shape and widens it to FP32 before calling
`forward`. Here: one `torch.empty`, one dict hit for the compiled kernel of (device, check_range), one
launch on torch's current stream. No host sync, no per-call table: the frequencies are computed inside
the kernel, and so is the range check (a t outside [0, 1] or NaN writes a NaN row and is recorded in the
op's check slot, h3cute.launch.checks).
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.launch import checks
from h3cute.widths import FREQ

KERNEL = "timestep_sinusoid"

_kernels: dict[tuple[int, bool], object] = {}  # (CUDA device index, check_range) -> kernel (t, out) -> None


def forward(t: torch.Tensor, check_range: bool = True) -> torch.Tensor:
    """(T,) FP32 CUDA t -> (T, 256) FP32 `[cos(t f_k) | sin(t f_k)]`, bitwise equal to diffusers on CUDA.

    `check_range=True` selects the kernel variant that checks t in [0, 1] (NaN is bad) on the device; this
    function never reads t's values on the host.
    """
    num_rows = t.shape[0]
    out = torch.empty((num_rows, FREQ), dtype=torch.float32, device=t.device)
    if num_rows:  # a zero-sized grid is not a valid launch
        launch(t, out, check_range)
    return out


def launch(t: torch.Tensor, out: torch.Tensor, check_range: bool = False) -> None:
    """Writes the embedding of t into a preallocated contiguous (T, 256) FP32 `out` (16-byte aligned)."""
    device = t.get_device()
    _kernel(device, check_range)(t, out, *checks.slot_addresses(device, KERNEL, "t", check_range))


def _kernel(device: int, check_range: bool):
    key = (device, bool(check_range))
    fn = _kernels.get(key)
    if fn is None:
        fn = _kernels[key] = runtime.kernel(KERNEL, torch.device("cuda", device), width=FREQ, check_range=key[1])
    return fn


def kernel_handles(device: int, check_range: int, num_rows: int) -> tuple[int, int, list[int], list[int]]:
    """For the C++ impl (h3cute.native): every row count, the kernel's C handle (`_kernels` keeps it alive) and
    its check slot's addresses (the discard slot's without check_range)."""
    return (0, runtime.MAX_ROWS, [_kernel(device, bool(check_range)).__chandle__()],
            list(checks.slot_addresses(device, KERNEL, "t", bool(check_range))))
