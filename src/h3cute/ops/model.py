"""The model scope's ops: everything `h3cute.patch(transformer, scope="model")` computes outside the conditioning
path, each one opaque to `torch.compile`.

Why ops. Inductor regenerates whatever it can trace: it fuses pointwise chains without the intermediate BF16
roundings eager makes, differently in a no-grad graph (the rollout) than in a training graph that saves
activations; it picks a reduction's block shape and warp count from the row count, so a norm's backward sums a
row in another order at another batch size; and `max-autotune` swaps cuBLAS for its own GEMM templates by timing.
Each of those changes bits. An op it cannot see through runs the same kernels in every graph, mode and batch, and
the same as in eager. So under the model scope every computation of the forward and backward is an h3 op, and
all that is left for Inductor between them is exact: views, index copies, dtype casts and single BF16 adds.

- `attention(q, k, v)`: softmax attention over (B, S, heads, head_dim) rows, scale head_dim^-0.5 (every
  `MiniMaxH3Attention`): FlashAttention-4's forward, always with the LSE the backward needs (so a rollout runs the
  training forward's kernel), and its deterministic backward.
- `dense(x, weight, bias)`: `F.linear` of the BF16 linears (q/k/v/out projections, the SwiGLU's, context_embedder):
  cuBLASLt under vLLM's settings (`h3cute.invariant`).
- `rms_norm(x, weight, eps)`: `F.rms_norm` (the token refiner's norms): torch's row-wise kernels.
- `rotary(x, cos, sin)`: diffusers' `_apply_rotary_emb`: torch's elementwise kernels.
- `qk_norm_rotary(x, weight, cos, sin, eps)`: `rotary(rms_norm(x, weight, eps), cos, sin)` over each head (every
  attention's q and k): on CUDA one pass of h3cute's kernels (kernels/qk_norm_rotary.py) with eager torch's forward
  bits at H3's heads (head_dim 128, 96 rotated channels; other widths take the eager expressions), a backward of
  its own (dx per row, the weight's gradient as a fixed-order sum).
- `swiglu(x)`: `a * silu(g)` with `a, g = x.chunk(2, -1)` (diffusers' `SwiGLU` after its projection): on CUDA one
  pass of h3cute's kernels (kernels/swiglu.py) with eager torch's bits, forward and backward.
- `rotary_table(position_ids, inv_freq)`: `MiniMaxH3RotaryPosEmbed`'s (cos, sin): torch's elementwise kernels.

Every row of every output, and of every input gradient, depends on that row alone (attention: on that sample's
rows alone), never on the batch size or the neighbours; weight gradients are deterministic. The eager-kernel ops
compute diffusers' own expressions, so their outputs are diffusers' eager bits; their backward ops recompute the
forward under autograd and differentiate it, so their gradients are eager autograd's bits too (the fused kernels
reproduce those bits, but for qk_norm_rotary's gradients, which are the kernel's own). `dense`'s backward
is two GEMMs and a column sum (no recomputation): dx = g w, dw = g^T x, db = sum of g's rows.

CPU impls: the same expressions; `attention` on a CPU is an FP32 reference (the tests' and `--quick` runs'
stand-in for FlashAttention-4, which needs a GPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from h3cute.invariant import FA4_DISTRIBUTION
from h3cute.ops import validate
from h3cute.ops._library import Op, declare
from h3cute.runtime import SM_COUNT, arch_of, kernel
from h3cute.widths import ATTENTION_HEAD_DIM, ROTARY_DIM

BF16, F32 = torch.bfloat16, torch.float32
_INTEGER = (torch.int64, torch.int32)


def _fail(op: str, what: str):
    raise ValueError(f"h3::{op}: {what}")


def _tensor(op: str, name: str, t, dtype, device: int, rank: int | None = None) -> None:
    """One argument's dtype, device (a key from `validate.device_of`: the first tensor argument's) and rank, with the
    messages every h3 op gives (`h3cute.ops.validate`)."""
    if t is None:
        want = "int64 or int32" if dtype is _INTEGER else validate._name(dtype)
        raise TypeError(f"h3::{op}: {name} is None; the op takes a {want} tensor there")
    if t.dtype != dtype and not (dtype is _INTEGER and t.dtype in _INTEGER):
        want = "int64 or int32" if dtype is _INTEGER else validate._name(dtype)
        raise TypeError(f"h3::{op}: {name} must be {want}, got {validate._name(t.dtype)}")
    if validate._key(t) != device:
        raise ValueError(f"h3::{op}: {name} is on {t.device}, expected {validate._device_name(device)} "
                         "(the device of the other inputs)")
    if rank is not None and t.dim() != rank:
        _fail(op, f"{name} has shape {tuple(t.shape)}; it must have {rank} dimensions")


def _width(op: str, name: str, t, width: int, last: str) -> None:
    if t.dim() < 1 or t.shape[-1] != width:
        _fail(op, f"{name} has shape {tuple(t.shape)}; its last dimension must be {last} ({width})")


def _like(op: str, name: str, t, shape, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        _fail(op, f"{name} has shape {tuple(t.shape)}; it must be {what}'s, {tuple(shape)}")


# ---- attention ------------------------------------------------------------------------------------------------

def _check_attention(q, k, v, op="attention", d=None):
    """q, k, v: (batch, rows, heads, head_dim) BF16 of one shape."""
    d = validate.device_of(op, "q", q) if d is None else d
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(op, name, t, BF16, d, rank=4)
    _like(op, "k", k, q.shape, "q")
    _like(op, "v", v, q.shape, "q")


def _check_attention_backward(grad, q, k, v, out, lse):
    op = "attention_backward"
    d = validate.device_of(op, "grad", grad)
    _tensor(op, "grad", grad, BF16, d, rank=4)
    _check_attention(q, k, v, op, d)
    _tensor(op, "out", out, BF16, d)
    _tensor(op, "lse", lse, F32, d)
    _like(op, "grad", grad, q.shape, "q")
    _like(op, "out", out, q.shape, "q")
    _like(op, "lse", lse, (q.shape[0], q.shape[2], q.shape[1]), "(batch, heads, rows) of q")


def _fa4():
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        raise RuntimeError(f"h3::attention on CUDA runs FlashAttention-4, which is not importable ({e}); install "
                           f"{FA4_DISTRIBUTION} (pip install 'h3cute[model]')") from e
    return interface


def _attention_cuda(q, k, v):
    # Always with the LSE: the no-grad forward (a rollout) runs the kernel the training forward runs.
    out, lse, *_ = _fa4()._flash_attn_fwd(q, k, v, causal=False, return_lse=True)
    return out.contiguous(), lse.contiguous()


def _attention_math(q, k, v):
    """FP32 softmax attention of (B, S, heads, head_dim) rows: out (q's dtype) and lse (B, heads, S) FP32."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # (B, heads, S, head_dim)
    scores = qf @ kf.transpose(-1, -2) * (q.shape[-1] ** -0.5)
    lse = scores.logsumexp(-1)
    out = (torch.exp(scores - lse[..., None]) @ vf).transpose(1, 2).to(q.dtype)
    return out.contiguous(), lse


def _attention_fake(q, k, v):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


def _attention_backward_cuda(grad, q, k, v, out, lse):
    grads = _fa4()._flash_attn_bwd(q, k, v, out, grad.contiguous(), lse, causal=False, deterministic=True)
    return tuple(g.contiguous() for g in grads)


def _attention_backward_math(grad, q, k, v, out, lse):
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        grads = torch.autograd.grad(_attention_math_f32(*leaves), leaves, grad.float())
    return tuple(g.to(q.dtype).contiguous() for g in grads)


def _attention_math_f32(q, k, v):
    qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
    scores = qf @ kf.transpose(-1, -2) * (q.shape[-1] ** -0.5)
    return (scores.softmax(-1) @ vf).transpose(1, 2)


def _attention_setup_context(ctx, inputs, output):
    q, k, v = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _attention_backward(ctx, grad):
    q, k, v, out, lse = ctx.saved_tensors
    return torch.ops.h3.attention_backward(grad, q, k, v, out, lse)


ATTENTION = declare(Op(
    "attention(Tensor q, Tensor k, Tensor v) -> Tensor",
    check=_check_attention,
    cpu=lambda q, k, v: _attention_math(q, k, v)[0],
    cuda=lambda q, k, v: _attention_cuda(q, k, v)[0],
    fake=lambda q, k, v: q.new_empty(q.shape),
    bf16=("q", "k", "v"),
    forward_op=Op(
        "attention_with_lse(Tensor q, Tensor k, Tensor v) -> (Tensor out, Tensor lse)",
        check=lambda q, k, v: _check_attention(q, k, v, "attention_with_lse"), cpu=_attention_math,
        cuda=_attention_cuda, fake=_attention_fake, bf16=("q", "k", "v"),
    ),
    backward_op=Op(
        "attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse) "
        "-> (Tensor dq, Tensor dk, Tensor dv)",
        check=_check_attention_backward,
        cpu=_attention_backward_math,
        cuda=_attention_backward_cuda,
        fake=lambda grad, q, k, v, out, lse: (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)),
        bf16=("grad", "q", "k", "v", "out"),
    ),
    setup_context=_attention_setup_context,
    backward=_attention_backward,
))


# ---- dense: the BF16 linears ----------------------------------------------------------------------------------

def _check_dense(x, weight, bias=None, op="dense", d=None):
    """x (..., in_features), weight (out_features, in_features), bias (out_features,) or None: BF16."""
    d = validate.device_of(op, "x", x) if d is None else d
    _tensor(op, "x", x, BF16, d)
    _tensor(op, "weight", weight, BF16, d, rank=2)
    _width(op, "x", x, weight.shape[1], "weight's in_features")
    if bias is not None:
        _tensor(op, "bias", bias, BF16, d)
        _like(op, "bias", bias, weight.shape[:1], "(out_features,) of weight")


def _check_dense_backward(grad, x, weight, *flags):
    op = "dense_backward"
    d = validate.device_of(op, "grad", grad)
    _tensor(op, "grad", grad, BF16, d)
    _check_dense(x, weight, None, op, d)
    _like(op, "grad", grad, (*x.shape[:-1], weight.shape[0]), "(x's rows, out_features)")


def _dense_backward(grad, x, weight, x_grad=True, weight_grad=True, bias_grad=True):
    n, k = weight.shape
    g = grad.reshape(-1, n)
    dx = torch.mm(g, weight).view(x.shape) if x_grad else x.new_empty((0,))
    dw = torch.mm(g.t(), x.reshape(-1, k)) if weight_grad else weight.new_empty((0,))
    db = g.sum(0) if bias_grad else weight.new_empty((0,))
    return dx, dw, db


def _dense_backward_fake(grad, x, weight, x_grad=True, weight_grad=True, bias_grad=True):
    empty = weight.new_empty((0,))
    return (x.new_empty(x.shape) if x_grad else x.new_empty((0,)), weight.new_empty(weight.shape) if weight_grad
            else empty, weight.new_empty((weight.shape[0],)) if bias_grad else empty)


def _dense_setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight)


def _dense_grads(ctx, grad):
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dw, db = torch.ops.h3.dense_backward(grad, x, weight, need[0], need[1], ctx.has_bias and need[2])
    return dx if need[0] else None, dw if need[1] else None, db if ctx.has_bias and need[2] else None


DENSE = declare(Op(
    "dense(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
    check=_check_dense,
    cpu=lambda x, weight, bias=None: F.linear(x, weight, bias).contiguous(),
    cuda=lambda x, weight, bias=None: F.linear(x, weight, bias).contiguous(),
    fake=lambda x, weight, bias=None: x.new_empty((*x.shape[:-1], weight.shape[0])),
    bf16=("x", "weight", "bias"),
    backward_op=Op(
        "dense_backward(Tensor grad, Tensor x, Tensor weight, bool x_grad=True, bool weight_grad=True, "
        "bool bias_grad=True) -> (Tensor dx, Tensor dweight, Tensor dbias)",
        check=_check_dense_backward,
        cpu=_dense_backward, cuda=_dense_backward, fake=_dense_backward_fake, bf16=("grad", "x", "weight"),
    ),
    setup_context=_dense_setup_context,
    backward=_dense_grads,
))


# ---- row-wise and elementwise ops: diffusers' own expressions, differentiated by eager autograd ----------------

def _recomputed_grads(forward, grad, inputs, needs):
    """The gradients eager autograd gives `forward(*inputs)` for the inputs flagged in `needs` (others: empty)."""
    leaves = [t.detach().requires_grad_(bool(n)) if t is not None else None for t, n in zip(inputs, needs)]
    wanted = [t for t, n in zip(leaves, needs) if n]
    with torch.enable_grad():
        got = iter(torch.autograd.grad(forward(*leaves), wanted, grad) if wanted else ())
    return tuple(next(got).contiguous() if n else t.new_empty((0,)) for t, n in zip(inputs, needs))


def _rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps).contiguous()


def _check_rms_norm(x, weight, eps, op="rms_norm", d=None):
    """x (..., width), weight (width,): BF16; eps > 0."""
    d = validate.device_of(op, "x", x) if d is None else d
    _tensor(op, "x", x, BF16, d)
    _tensor(op, "weight", weight, BF16, d, rank=1)
    _width(op, "x", x, weight.shape[0], "weight's width")
    validate._eps(op, eps)


def _check_rms_norm_backward(grad, x, weight, eps, *flags):
    op = "rms_norm_backward"
    d = validate.device_of(op, "grad", grad)
    _tensor(op, "grad", grad, BF16, d)
    _check_rms_norm(x, weight, eps, op, d)
    _like(op, "grad", grad, x.shape, "x")


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, weight)


def _rms_norm_grads(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.h3.rms_norm_backward(grad, x, weight, ctx.eps, ctx.needs_input_grad[0],
                                           ctx.needs_input_grad[1])
    return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None)


def _rms_norm_backward(grad, x, weight, eps, x_grad=True, weight_grad=True):
    return _recomputed_grads(lambda a, w: _rms_norm(a, w, eps), grad, (x, weight), (x_grad, weight_grad))


def _rms_norm_backward_fake(grad, x, weight, eps, x_grad=True, weight_grad=True):
    return (x.new_empty(x.shape) if x_grad else x.new_empty((0,)),
            weight.new_empty(weight.shape) if weight_grad else weight.new_empty((0,)))


RMS_NORM = declare(Op(
    "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    check=_check_rms_norm,
    cpu=_rms_norm, cuda=_rms_norm,
    fake=lambda x, weight, eps: x.new_empty(x.shape),
    bf16=("x", "weight"),
    backward_op=Op(
        "rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps, bool x_grad=True, "
        "bool weight_grad=True) -> (Tensor dx, Tensor dweight)",
        check=_check_rms_norm_backward,
        cpu=_rms_norm_backward, cuda=_rms_norm_backward, fake=_rms_norm_backward_fake, bf16=("grad", "x", "weight"),
    ),
    setup_context=_rms_norm_setup_context,
    backward=_rms_norm_grads,
))


def _rotary(x, cos, sin):
    """diffusers' `_apply_rotary_emb`: the leading cos.shape[-1] channels of each (B, S, heads, head_dim) head
    rotated by the row's angles (cos / sin (S, rotary_dim), cast to x's dtype), the rest passed through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    c = cos.to(x.dtype)[None, :, None, :]
    s = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = rot.chunk(2, dim=-1)
    return torch.cat((rot * c + torch.cat((-x2, x1), dim=-1) * s, rest), dim=-1).contiguous()


def _rotary_backward(grad, cos, sin):
    """The transpose of `_rotary`, as eager autograd computes it: g c + [ (g s)_2, -(g s)_1 ] (each product and the
    sum rounded to the dtype, exactly as the autograd graph of `_rotary` does)."""
    rd = cos.shape[-1]
    g, rest = grad[..., :rd], grad[..., rd:]
    c = cos.to(grad.dtype)[None, :, None, :]
    s = sin.to(grad.dtype)[None, :, None, :]
    gs1, gs2 = (g * s).chunk(2, dim=-1)
    return torch.cat((g * c + torch.cat((gs2, -gs1), dim=-1), rest), dim=-1).contiguous()


def _check_rotary(x, cos, sin, op="rotary", name="x"):
    """x (batch, rows, heads, head_dim) BF16; cos, sin (rows, rotary_dim) FP32, rotary_dim even, <= head_dim."""
    d = validate.device_of(op, name, x)
    _tensor(op, name, x, BF16, d, rank=4)
    _tensor(op, "cos", cos, F32, d)
    _tensor(op, "sin", sin, F32, d)
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != x.shape[1] or cos.shape[1] > x.shape[-1] \
            or cos.shape[1] % 2:
        _fail(op, f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be (rows = {x.shape[1]}, "
                  f"rotary_dim), rotary_dim even and at most head_dim = {x.shape[-1]}")


def _rotary_setup_context(ctx, inputs, output):
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _rotary_grads(ctx, grad):
    cos, sin = ctx.saved_tensors
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError("h3::rotary: gradients reach the rotated rows only, not the angles (MiniMax-H3's cos / "
                           "sin come from fixed position ids)")
    return torch.ops.h3.rotary_backward(grad, cos, sin), None, None


ROTARY = declare(Op(
    "rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor",
    check=_check_rotary,
    cpu=_rotary, cuda=_rotary,
    fake=lambda x, cos, sin: x.new_empty(x.shape),
    bf16=("x",),
    backward_op=Op(
        "rotary_backward(Tensor grad, Tensor cos, Tensor sin) -> Tensor",
        check=lambda grad, cos, sin: _check_rotary(grad, cos, sin, "rotary_backward", "grad"),
        cpu=_rotary_backward, cuda=_rotary_backward,
        fake=lambda grad, cos, sin: grad.new_empty(grad.shape), bf16=("grad",),
    ),
    setup_context=_rotary_setup_context,
    backward=_rotary_grads,
))


_QK_GRAD_CTAS_PER_SM = 8  # qk_norm_rotary_bwd's grid: enough CTAs per SM to keep HBM busy


def _kernel_rows(t, width: int):
    """t as contiguous (rows, width) rows at a 16-byte aligned address: what the kernels' 16-byte accesses need."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t.view(-1, width)


def _qk_norm_rotary(x, weight, cos, sin, eps):
    """The attention's q / k norm then the rotary embedding, as diffusers evaluates them (eager kernels)."""
    return _rotary(_rms_norm(x, weight, eps), cos, sin)


def _qk_kernels_serve(x, cos) -> bool:
    """The fused kernels serve H3's heads (head_dim 128, 96 rotated channels), some rows of them; other widths take
    the eager expressions (the same forward bits)."""
    return x.is_cuda and x.shape[-1] == ATTENTION_HEAD_DIM and cos.shape[-1] == ROTARY_DIM and x.numel() > 0


def _qk_norm_rotary_cuda(x, weight, cos, sin, eps):
    if not _qk_kernels_serve(x, cos):
        return _qk_norm_rotary(x, weight, cos, sin, eps)
    b, s, heads, d = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    cos, sin = _kernel_rows(cos, ROTARY_DIM), _kernel_rows(sin, ROTARY_DIM)
    kernel("qk_norm_rotary_fwd", x.device)(_kernel_rows(x, d), _kernel_rows(weight, d)[0], cos, sin, out.view(-1, d),
                                           float(eps), heads, s)
    return out


def _qk_norm_rotary_backward(grad, x, weight, cos, sin, eps, x_grad=True, weight_grad=True):
    """Eager autograd of the rotary's transpose, then the norm's (the CPU impl and other widths')."""
    g = _rotary_backward(grad, cos, sin)
    return _rms_norm_backward(g, x, weight, eps, x_grad, weight_grad)


def _qk_norm_rotary_backward_cuda(grad, x, weight, cos, sin, eps, x_grad=True, weight_grad=True):
    if not _qk_kernels_serve(x, cos):
        return _qk_norm_rotary_backward(grad, x, weight, cos, sin, eps, x_grad, weight_grad)
    b, s, heads, d = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    # the weight gradient's partial rows: one per CTA of a grid fixed per arch (never per GPU or row count)
    partials = torch.empty((_QK_GRAD_CTAS_PER_SM * SM_COUNT[arch_of(x.device)], d), dtype=F32, device=x.device)
    kernel("qk_norm_rotary_bwd", x.device)(_kernel_rows(grad, d), _kernel_rows(x, d), _kernel_rows(weight, d)[0],
                                           _kernel_rows(cos, ROTARY_DIM), _kernel_rows(sin, ROTARY_DIM), dx.view(-1, d),
                                           partials, float(eps), heads, s)
    dweight = weight.new_empty((0,))
    if weight_grad:
        dweight = torch.empty_like(weight)
        kernel("rowwise_fold", x.device)(partials, dweight)
    return dx if x_grad else x.new_empty((0,)), dweight


def _check_qk_norm_rotary(x, weight, cos, sin, eps, op="qk_norm_rotary", d=None):
    """x (batch, rows, heads, head_dim) BF16, weight (head_dim,) BF16, cos / sin (rows, rotary_dim) FP32, eps > 0."""
    d = validate.device_of(op, "x", x) if d is None else d
    _tensor(op, "x", x, BF16, d, rank=4)
    _check_rotary(x, cos, sin, op)
    _tensor(op, "weight", weight, BF16, d, rank=1)
    _width(op, "x", x, weight.shape[0], "weight's width")
    validate._eps(op, eps)


def _check_qk_norm_rotary_backward(grad, x, weight, cos, sin, eps, *flags):
    op = "qk_norm_rotary_backward"
    d = validate.device_of(op, "grad", grad)
    _tensor(op, "grad", grad, BF16, d, rank=4)
    _check_qk_norm_rotary(x, weight, cos, sin, eps, op, d)
    _like(op, "grad", grad, x.shape, "x")


def _qk_norm_rotary_setup_context(ctx, inputs, output):
    x, weight, cos, sin, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, weight, cos, sin)


def _qk_norm_rotary_grads(ctx, grad):
    x, weight, cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    if need[2] or need[3]:
        raise RuntimeError("h3::qk_norm_rotary: gradients reach the rows and the norm's weight, not the angles "
                           "(MiniMax-H3's cos / sin come from fixed position ids)")
    dx, dw = torch.ops.h3.qk_norm_rotary_backward(grad, x, weight, cos, sin, ctx.eps, need[0], need[1])
    return dx if need[0] else None, dw if need[1] else None, None, None, None


QK_NORM_ROTARY = declare(Op(
    "qk_norm_rotary(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps) -> Tensor",
    check=_check_qk_norm_rotary,
    cpu=_qk_norm_rotary, cuda=_qk_norm_rotary_cuda,
    fake=lambda x, weight, cos, sin, eps: x.new_empty(x.shape),
    bf16=("x", "weight"),
    backward_op=Op(
        "qk_norm_rotary_backward(Tensor grad, Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps, "
        "bool x_grad=True, bool weight_grad=True) -> (Tensor dx, Tensor dweight)",
        check=_check_qk_norm_rotary_backward,
        cpu=_qk_norm_rotary_backward, cuda=_qk_norm_rotary_backward_cuda,
        fake=lambda grad, x, weight, cos, sin, eps, x_grad=True, weight_grad=True: _rms_norm_backward_fake(
            grad, x, weight, eps, x_grad, weight_grad),
        bf16=("grad", "x", "weight"),
    ),
    setup_context=_qk_norm_rotary_setup_context,
    backward=_qk_norm_rotary_grads,
))


def _swiglu(x):
    a, gate = x.chunk(2, dim=-1)
    return (a * F.silu(gate)).contiguous()


def _swiglu_rows(x):
    """x as (rows, 2 F) rows for the kernels (None where they do not serve: F % 8 != 0, or no rows)."""
    if x.numel() == 0 or x.shape[-1] % 16:
        return None
    return _kernel_rows(x, x.shape[-1])


def _swiglu_cuda(x):
    rows = _swiglu_rows(x)
    if rows is None:
        return _swiglu(x)
    out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    kernel("swiglu_fwd", x.device)(rows, out.view(-1, out.shape[-1]))
    return out


def _swiglu_backward(grad, x):
    return _recomputed_grads(_swiglu, grad, (x,), (True,))[0]


def _swiglu_backward_cuda(grad, x):
    rows = _swiglu_rows(x)
    if rows is None:
        return _swiglu_backward(grad, x)
    dx = x.new_empty(x.shape)
    kernel("swiglu_bwd", x.device)(_kernel_rows(grad, grad.shape[-1]), rows, dx.view(-1, dx.shape[-1]))
    return dx


def _check_swiglu(x, op="swiglu", d=None):
    """x (..., 2 F) BF16: the value | gate halves."""
    d = validate.device_of(op, "x", x) if d is None else d
    _tensor(op, "x", x, BF16, d)
    if x.dim() < 1 or x.shape[-1] % 2:
        _fail(op, f"x has shape {tuple(x.shape)}; its last dimension must be even (the value | gate halves)")


def _check_swiglu_backward(grad, x):
    op = "swiglu_backward"
    d = validate.device_of(op, "grad", grad)
    _tensor(op, "grad", grad, BF16, d)
    _check_swiglu(x, op, d)
    _like(op, "grad", grad, (*x.shape[:-1], x.shape[-1] // 2), "swiglu's output of x")


SWIGLU = declare(Op(
    "swiglu(Tensor x) -> Tensor",
    check=_check_swiglu,
    cpu=_swiglu, cuda=_swiglu_cuda,
    fake=lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)),
    bf16=("x",),
    backward_op=Op(
        "swiglu_backward(Tensor grad, Tensor x) -> Tensor",
        check=_check_swiglu_backward, bf16=("grad", "x"),
        cpu=_swiglu_backward, cuda=_swiglu_backward_cuda,
        fake=lambda grad, x: x.new_empty(x.shape),
    ),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]),
    backward=lambda ctx, grad: torch.ops.h3.swiglu_backward(grad, ctx.saved_tensors[0]),
))


def _rotary_table(position_ids, inv_freq):
    """`MiniMaxH3RotaryPosEmbed.forward`: (S, 3) positions -> cos, sin (S, 2 * 3 * len(inv_freq)) FP32."""
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq.view(1, 1, -1)
    freqs = torch.cat(freqs.unbind(dim=1), dim=-1)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos().contiguous(), freqs.sin().contiguous()


def _check_rotary_table(position_ids, inv_freq):
    """position_ids (rows, 3) int64 / int32, inv_freq (freqs,) FP32."""
    op = "rotary_table"
    d = validate.device_of(op, "position_ids", position_ids)
    _tensor(op, "position_ids", position_ids, _INTEGER, d, rank=2)
    _tensor(op, "inv_freq", inv_freq, F32, d, rank=1)
    _width(op, "position_ids", position_ids, 3, "the (t, h, w) axes")


def _rotary_table_fake(position_ids, inv_freq):
    shape = (position_ids.shape[0], 6 * inv_freq.shape[0])
    return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


ROTARY_TABLE = declare(Op(
    "rotary_table(Tensor position_ids, Tensor inv_freq) -> (Tensor cos, Tensor sin)",
    check=_check_rotary_table,
    cpu=_rotary_table, cuda=_rotary_table, fake=_rotary_table_fake,
))

