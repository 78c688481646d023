"""Host side of `h3::timestep_sinusoid` on CUDA: allocate the (T, 256) FP32 output, launch one kernel.

The op layer (h3cute.ops.timestep) validates t's dtype and shape and widens it to FP32 before calling
`forward`. Here: one launch on torch's current stream, of the kernel variant of `check_range`. No host sync, no
per-call table: the frequencies are computed inside the kernel, and so is the range check (a t outside [0, 1] or
NaN writes a NaN row and is recorded in the op's check slot, h3cute.launch.checks).

The launch is a launch plan (h3cute.launch.plan): `build` writes it, `forward` walks it, and the C++ layer walks
the same plan (`native_plan`). Row ranges: T = 0 (no launch: a zero-sized grid is not a valid launch) and T >= 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from h3cute.launch import plan as P
from h3cute.launch.plan import M, Buffer, Kernel, Output, Phase, view
from h3cute.widths import FREQ

KERNEL = "timestep_sinusoid"


@dataclass(frozen=True)
class ForwardKey:
    check_range: bool  # False: a t outside [0, 1] writes the discard check slot


KEYS = {Phase.FORWARD: ForwardKey}


def build(phase: Phase, device, key, rows: int) -> P.Plan:
    """The launch plan of h3::timestep_sinusoid for `rows` timesteps: input t (T,) FP32, output (T, 256) FP32."""
    if phase is not Phase.FORWARD:
        raise ValueError(f"h3::{KERNEL} has no backward")
    return P.checked_launch(KERNEL, phase, key, device, rows, ("t",), (Buffer("out", torch.float32, (M, FREQ)),),
                            Kernel.of(KERNEL, width=FREQ, check_range=key.check_range), (view("t"), view("out")),
                            (Output(view("out")),), (KERNEL, "t", key.check_range))


def forward(t: torch.Tensor, check_range: bool = True) -> torch.Tensor:
    """(T,) FP32 CUDA t -> (T, 256) FP32 `[cos(t f_k) | sin(t f_k)]`, bitwise equal to diffusers on CUDA.

    `check_range=True` selects the kernel variant that checks t in [0, 1] (NaN is bad) on the device; this
    function never reads t's values on the host.
    """
    return P.run(build, Phase.FORWARD, ForwardKey(bool(check_range)), (t,), t.shape[0], t.shape, t.device)[0]


def launch(t: torch.Tensor, out: torch.Tensor, check_range: bool = False) -> None:
    """Writes the embedding of t into a preallocated contiguous (T, 256) FP32 `out` (16-byte aligned): the plan
    walked with `out` as its output buffer (the kernel checks that out has t's rows)."""
    P.run(build, Phase.FORWARD, ForwardKey(bool(check_range)), (t,), t.shape[0], t.shape, t.device, {"out": out})


def native_plan(device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For the C++ impl (h3cute.native): the encoded plan of key (check_range,) serving `rows`."""
    return P.native_plan(build, KEYS, device, phase, key, rows)
