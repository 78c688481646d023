"""Host side of `h3::timestep_sinusoid` on CUDA: allocate the (T, 256) FP32 output, launch one kernel.

The op layer (h3cute.ops.timestep) validates t, widens it to FP32 and runs the range check (the only
host sync, skipped with check_range=False) before calling `forward`. Here: one `torch.empty`, one
dict hit for the compiled kernel of t's device, one launch on torch's current stream. No host sync,
no per-call table: the frequencies are computed inside the kernel (kernels/timestep_sinusoid.py).
"""
from __future__ import annotations

import torch

from h3cute import runtime

KERNEL = "timestep_sinusoid"
WIDTH = 256

_by_device: dict[int, object] = {}  # CUDA device index -> compiled kernel (t, out) -> None


def forward(t: torch.Tensor, check_range: bool = True) -> torch.Tensor:
    """(T,) FP32 CUDA t -> (T, 256) FP32 `[cos(t f_k) | sin(t f_k)]`, bitwise equal to diffusers on CUDA.

    `check_range` is accepted so the op layer can pass its arguments through; that layer has already
    done the check, and this function never reads t's values on the host.
    """
    num_rows = t.shape[0]
    out = torch.empty((num_rows, WIDTH), dtype=torch.float32, device=t.device)
    if num_rows:  # a zero-sized grid is not a valid launch
        launch(t, out)
    return out


def launch(t: torch.Tensor, out: torch.Tensor) -> None:
    """Writes the embedding of t into a preallocated contiguous (T, 256) FP32 `out` (16-byte aligned)."""
    device = t.get_device()
    fn = _by_device.get(device)
    if fn is None:
        fn = _by_device[device] = runtime.kernel(KERNEL, t.device, width=WIDTH)
    fn(t, out)
