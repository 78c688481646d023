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

The launches are launch plans (h3cute.launch.plan): `build` writes them, `forward` / `backward` make the rows
contiguous and aligned and walk them, and the C++ layer walks the same plans (`native_plan`). Row ranges: M = 0
(no launch), and for the backward M < SPLITS * tile_k (the one-slice k-tail GEMM alone) and beyond.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from h3cute.kernels._linear_configs import gemm_static, splits, wgrad_step
from h3cute.launch import plan as P
from h3cute.launch.plan import M, Buffer, ColumnSum, Cond, Fill, Kernel, Launch, Layout, Output, Phase, view

_ALIGN = 16  # bytes: the GEMM's cp.async vectors (GemmTF32x3's 16-byte aligned rows)
F32 = torch.float32


@dataclass(frozen=True)
class ForwardKey:
    out_features: int
    in_features: int
    bias: bool  # False: y is the bare K sum (a -0.0 bias)


@dataclass(frozen=True)
class BackwardKey:
    out_features: int
    in_features: int
    x_grad: bool  # False: dx is (0, K), not computed


KEYS = {Phase.FORWARD: ForwardKey, Phase.BACKWARD: BackwardKey}


def _gemm(gemm: str, n: int, k: int) -> Kernel:
    return Kernel.of("linear_gemm", **gemm_static(gemm, n, k))


def _fold(parts: int, width: int) -> Kernel:
    return Kernel.of("linear_fold", splits=parts, width=width)


def build(phase: Phase, device, key, rows: int) -> P.Plan:
    """The launch plan of h3::linear's `phase` for `rows` rows of a weight (N, K) = (key.out_features,
    key.in_features): inputs x (M, K) and weight (and bias with key.bias) forward; grad (M, N), x (M, K) and weight
    backward."""
    n, k = key.out_features, key.in_features
    lo, hi = P.any_rows(rows)
    if phase is Phase.FORWARD:
        inputs = ("x", "weight", "bias") if key.bias else ("x", "weight")
        buffers, steps = [Buffer("y", F32, (M, n))], []
        if rows:
            if not key.bias:  # -0.0, the IEEE additive identity: y is the bare K sum bit for bit
                buffers.append(Buffer("bias", F32, (n,)))
                steps.append(Fill(view("bias"), -0.0))
            steps.append(Launch(_gemm("fwd", n, k), (view("x"), view("weight"), view("bias"), view("y"))))
        return P.Plan("linear", phase, key, lo, hi, inputs, tuple(buffers), tuple(steps), (Output(view("y"), True),))
    inputs = ("grad", "x", "weight")
    dbias = Output(ColumnSum(view("grad")))  # torch's column sum: a fixed reduction order for a given shape
    if rows == 0:
        buffers = (Buffer("dx", F32, (M if key.x_grad else 0, k)), Buffer("dweight", F32, (n, k)),
                   Buffer("dbias", F32, (n,)))
        steps = (Fill(view("dweight"), 0.0), Fill(view("dbias"), 0.0))
        return P.Plan("linear", phase, key, lo, hi, inputs, buffers, steps,
                      (Output(view("dx"), key.x_grad), Output(view("dweight")), Output(view("dbias"))))
    buffers, steps = [], []
    if key.x_grad:  # dx = grad weight in the width's slices (B = weight.t() (K, N), N-major in place), folded
        parts = splits("dgrad", n, k)
        buffers.append(Buffer("dx_parts", F32, (parts, M, k)))
        steps.append(Launch(_gemm("dgrad", n, k), (view("grad"), view("weight", layout=Layout.T), view("dx_parts"))))
        dx = Output(view("dx_parts", layout=Layout.ITEM0), True)
        if parts > 1:  # the "sum" fold's (1,) aux operand is never read
            buffers.append(Buffer("dx", F32, (M, k)))
            steps.append(Launch(_fold(parts, k), (view("dx_parts"), view("dx", layout=Layout.FIRST), view("dx"))))
            dx = Output(view("dx"), True)
    else:
        buffers.append(Buffer("dx", F32, (0, k)))
        dx = Output(view("dx"))
    # dweight = grad^T x, both read in place through their transposed views (wgrad_rows: bulk + tail rows)
    step = wgrad_step(n, k)
    tail_gemm = _gemm("wgrad_tail", n, k)
    if rows < step:  # fewer rows than one chunk per slice: the one-slice k-tail GEMM alone
        buffers.append(Buffer("dweight", F32, (1, n, k)))
        steps.append(Launch(tail_gemm, (view("grad", layout=Layout.T), view("x", layout=Layout.T), view("dweight"))))
        return P.Plan("linear", phase, key, 1, step - 1, inputs, tuple(buffers), tuple(steps),
                      (dx, Output(view("dweight", layout=Layout.ITEM0)), dbias))
    chunks = splits("wgrad", n, k)
    bulk = P.whole_rows(step)
    tail = M - bulk
    buffers += [Buffer("partials", F32, (chunks + 1, n, k)), Buffer("dweight", F32, (n, k))]
    steps += [
        Launch(_gemm("wgrad", n, k), (view("grad", 0, bulk, Layout.T), view("x", 0, bulk, Layout.T),
                                      view("partials", 0, chunks))),
        # rows bulk.. (a 16-byte aligned start: N and K are multiples of 4 floats)
        Launch(tail_gemm, (view("grad", bulk, M, Layout.T), view("x", bulk, M, Layout.T),
                           view("partials", chunks, chunks + 1)), Cond(tail)),
        Fill(view("partials", chunks, chunks + 1), 0.0, Cond(tail, nonzero=False)),  # +0 leaves every sum's bits alone
        Launch(_fold(chunks + 1, k), (view("partials"), view("dweight", layout=Layout.FIRST), view("dweight"))),
    ]
    return P.Plan("linear", phase, key, step, hi, inputs, tuple(buffers), tuple(steps),
                  (dx, Output(view("dweight")), dbias))


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
    inputs = (rows, _aligned(weight)) + (() if bias is None else (_aligned(bias),))
    key = ForwardKey(n, k, bias is not None)
    return P.run(build, Phase.FORWARD, key, inputs, rows.shape[0], x.shape[:-1], x.device)[0]


def backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, x_grad: bool = True):
    """(dx, dweight, dbias) of y = linear(x, weight, bias) for upstream grad (..., N); dx is x-shaped, or (0, K)
    when `x_grad` is False (not computed)."""
    n, k = weight.shape
    g = _rows(grad, n)
    inputs = (g, _rows(x, k), _aligned(weight))
    return P.run(build, Phase.BACKWARD, BackwardKey(n, k, bool(x_grad)), inputs, g.shape[0], x.shape[:-1], x.device)


def native_plan(device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For the C++ impls (h3cute.native): the encoded plan of (phase, key (N, K, bias or x_grad)) serving `rows`."""
    return P.native_plan(build, KEYS, device, phase, key, rows)
