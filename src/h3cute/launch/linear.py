"""Host side of `h3::linear` (+ backward) on CUDA: rows made contiguous, outputs allocated, GEMMs and folds launched.

Forward: y = x weight^T + bias, one `linear_gemm` "fwd" launch (bias None: a -0.0 bias, the IEEE additive
identity, so y is the bare K sum bit for bit). Backward: dx = grad weight ("dgrad", weight read N-major in place
through its transposed view, in the width's SPLITS slices folded in slice order by `linear_fold`); dweight = grad^T x
(grad and x read through their transposed views: "wgrad" sums the first `bulk` rows in SPLITS equal chunks,
"wgrad_tail" the rest with its k tail zero-filled in shared memory, one partial more, and `linear_fold` adds the
partials in row order; see `wgrad_rows`); dbias = grad.sum(0) (torch's column sum: a fixed reduction order for a
given shape, no atomics, so bitwise repeatable run to run). Tiles and the forward's and dgrad's slice counts are
static per (role, N, K) (kernels/_linear_configs.py), never a function of M, so y's and dx's launch sequence is the
same at every M >= 1; the wgrad's depends on M alone. The op layer validates dtypes, shapes and devices
(h3cute.ops.validate.check_linear).
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.kernels._linear_configs import gemm_static, splits, wgrad_rows, wgrad_step
from h3cute.launch.timestep_mlp import transposed
from h3cute.widths import LINEAR_SHAPES

_ALIGN = 16  # bytes: the GEMM's cp.async vectors (GemmTF32x3's 16-byte aligned rows)


def _gemm(device, gemm: str, shape: tuple):
    """The `linear_gemm` kernel of GEMM kind `gemm` for a weight of shape (N, K)."""
    return runtime.kernel("linear_gemm", device, **gemm_static(gemm, *shape))


def _fold(device, parts: int, width: int):
    return runtime.kernel("linear_fold", device, splits=parts, width=width)


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
        _gemm(x.device, "fwd", weight.shape)(rows, _aligned(weight), _aligned(bias), y)
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
        parts = splits("dgrad", n, k)
        dx = torch.empty((parts, rows, k), **f32)
        _gemm(dev, "dgrad", weight.shape)(g, transposed(w), dx)  # B = weight.t() (K, N), N-major in place
        if parts > 1:
            folded = torch.empty((rows, k), **f32)
            _fold(dev, parts, k)(dx, folded[0, :1], folded)
            dx = folded
        dx = dx.view(x.shape)
    return dx, _dweight(g, _rows(x, k), weight), g.sum(0)


def _dweight(g: torch.Tensor, xr: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dweight (N, K) = g^T xr over rows >= 1: A = g^T (N, rows), B = xr^T (K, rows), both read in place."""
    n, k = weight.shape
    dev = g.device
    bulk, tail = wgrad_rows(n, k, g.shape[0])
    if not bulk:  # fewer rows than one chunk per slice: the one-slice k-tail GEMM alone
        dweight = torch.empty((1, n, k), dtype=torch.float32, device=dev)
        _gemm(dev, "wgrad_tail", weight.shape)(transposed(g), transposed(xr), dweight)
        return dweight[0]
    chunks = splits("wgrad", n, k)
    partials = torch.empty((chunks + 1, n, k), dtype=torch.float32, device=dev)
    _gemm(dev, "wgrad", weight.shape)(transposed(g[:bulk]), transposed(xr[:bulk]), partials[:chunks])
    if tail:  # rows bulk.. (a 16-byte aligned start: N and K are multiples of 4 floats)
        _gemm(dev, "wgrad_tail", weight.shape)(transposed(g[bulk:]), transposed(xr[bulk:]), partials[chunks:])
    else:
        partials[chunks].zero_()  # +0 leaves every sum's bits alone
    dweight = torch.empty((n, k), dtype=torch.float32, device=dev)
    _fold(dev, chunks + 1, k)(partials, dweight[0, :1], dweight)
    return dweight


def kernel_handles(device: int, head: int, rows: int):
    """For the C++ impls (h3cute.native): every row count shares one launch sequence per weight shape
    LINEAR_SHAPES[head] = (N, K). The C handles of `linear_gemm` fwd, dgrad, wgrad and wgrad_tail, the wgrad's fold
    and, where the dgrad has more than one slice, its fold; the launch constants are the dgrad's slice count, the
    wgrad's chunk count and its row step (the bulk rows are a multiple of it, `wgrad_rows`)."""
    dev = torch.device("cuda", device)
    n, k = LINEAR_SHAPES[head]
    parts, chunks = splits("dgrad", n, k), splits("wgrad", n, k)
    fns = [_gemm(dev, g, (n, k)) for g in ("fwd", "dgrad", "wgrad", "wgrad_tail")]
    fns.append(_fold(dev, chunks + 1, k))
    if parts > 1:
        fns.append(_fold(dev, parts, k))
    return 0, 2**62, [fn.__chandle__() for fn in fns], [parts, chunks, wgrad_step(n, k)]
