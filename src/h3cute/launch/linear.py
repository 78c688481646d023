"""Host side of `h3::linear` (+ backward) on CUDA: rows made contiguous, outputs allocated, one GEMM each.

Forward: y = x weight^T + bias, one `linear_gemm` "fwd" launch (bias None: a -0.0 bias, the IEEE additive
identity, so y is the bare K sum bit for bit). Backward: dx = grad weight ("dgrad", weight read N-major in place
through its transposed view), dweight = grad^T x ("wgrad", grad and x read through their transposed views, the
M-deep K tail zero-filled in shared memory), dbias = grad.sum(0) (torch's column sum: a fixed reduction order for
a given shape, no atomics, so bitwise repeatable run to run). Tiles are static per (role, N, K)
(kernels/_linear_configs.py), never a function of M, so the launch sequence is the same at every M >= 1. The op
layer validates dtypes, shapes and devices (h3cute.ops.validate.check_linear).
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.kernels._linear_configs import TILES
from h3cute.launch.timestep_mlp import transposed

_ALIGN = 16  # bytes: the GEMM's cp.async vectors (GemmTF32x3's 16-byte aligned rows)


def _gemm(device, role: str, weight: torch.Tensor):
    n, k = weight.shape
    return runtime.kernel("linear_gemm", device, role=role, out_features=n, in_features=k, tile=TILES[role, n, k])


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (..., width) as contiguous, 16-byte aligned (M, width) rows (a copy only when t is not already)."""
    rows = t.reshape(-1, width)
    if not rows.is_contiguous() or rows.data_ptr() % _ALIGN:
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y (..., N) = x (..., K) weight (N, K)^T + bias (N,)."""
    n, k = weight.shape
    rows = _rows(x, k)
    y = torch.empty((rows.shape[0], n), dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        if bias is None:
            bias = torch.full((n,), -0.0, dtype=torch.float32, device=x.device)
        _gemm(x.device, "fwd", weight)(rows, _aligned(weight), _aligned(bias), y)
    return y.view(*x.shape[:-1], n)


def backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, x_grad: bool = True):
    """(dx, dweight, dbias) of y = linear(x, weight, bias) for upstream grad (..., N); dx is x-shaped, or (0, K)
    when `x_grad` is False (not computed)."""
    n, k = weight.shape
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    g = _rows(grad, n)
    rows = g.shape[0]
    if rows == 0:
        return (torch.empty(x.shape if x_grad else (0, k), **f32), torch.zeros((n, k), **f32),
                torch.zeros((n,), **f32))
    w = _aligned(weight)
    dx = torch.empty((0, k), **f32)
    if x_grad:
        dx = torch.empty((1, rows, k), **f32)
        _gemm(dev, "dgrad", weight)(g, transposed(w), dx)  # B = weight.t() (K, N), N-major in place
        dx = dx.view(x.shape)
    xr = _rows(x, k)
    dweight = torch.empty((1, n, k), **f32)
    _gemm(dev, "wgrad", weight)(transposed(g), transposed(xr), dweight)  # A = grad^T (N, M), B = x^T (K, M)
    return dx, dweight[0], g.sum(0)
