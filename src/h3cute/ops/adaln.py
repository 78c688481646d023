"""The AdaLN ops of H3: `h3::adaln_projection`, `h3::adaln_row_gather`, `h3::norm_modulate`,
`h3::gate_residual`, `h3::gate_residual_norm_modulate`, `h3::final_adaln_out` (each with its `_backward` op),
and `adaln_indices`.

Row layout: a packed sequence row s carries `timestep_indices[s]` (one of T distinct timesteps) and a
modality tag in {0 video, 1 text, 2 audio}; `adaln_indices = ti * 3 + tag` addresses the (3T, ...) block
tables, `ti` addresses the (T, ...) final-norm tables. Indices are never clamped: a bad index gives NaN rows,
and with `check_indices` it raises, naming its row: at once on CPU; on CUDA the kernels check every index
without a host sync and the error is raised at the next h3 call or `h3cute.check_errors()`
(h3cute.launch.checks).

Forward CPU impls are the diffusers replays (`h3cute.reference`, BF16 op for op). Backward CPU impls
compute the true gradient in FP32 from the saved BF16/FP32 inputs and round each result once; reductions
over rows (weight, bias, table gradients) accumulate in FP32 in a fixed order (`sum(0)`, `index_add_`,
CPU matmul), so they are bitwise repeatable.
"""
import torch
import torch.nn.functional as F

from h3cute import reference
from h3cute.ops import validate
from h3cute.ops._library import Op, declare, resolve_launch
from h3cute.ops.validate import BF16, NO_ARG
from h3cute.widths import BLOCK_CHUNKS, BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, HIDDEN, MODALITIES, NORM_EPS

_INDICES = resolve_launch("adaln_indices")
_PROJECTION = resolve_launch("adaln_projection")
_ROW_GATHER = resolve_launch("adaln_row_gather")
_NORM_MODULATE = resolve_launch("norm_modulate")
_GATE_RESIDUAL = resolve_launch("gate_residual")
_GATE_RESIDUAL_NORM_MODULATE = resolve_launch("gate_residual_norm_modulate")
_FINAL = resolve_launch("final_adaln_out")


def adaln_indices(timestep_indices: torch.Tensor, token_tags: torch.Tensor, num_timesteps: int) -> torch.Tensor:
    """`timestep_indices * 3 + token_tags` (`h3::adaln_indices`), checking `0 <= ti < num_timesteps` and
    `tag in {0, 1, 2}`.

    Both are (S,) int64 on one device; a bad row's index is -1 (every h3 op then writes NaN for it) and the
    error names the first bad row: raised at once on CPU; on CUDA checked on the device without a host sync
    and raised at the next h3 call or `h3cute.check_errors()`. Build the indices once per forward with this
    and pass `check_indices=False` to the ops that take them.
    """
    if isinstance(num_timesteps, bool) or not isinstance(num_timesteps, int) or num_timesteps < 0:
        raise ValueError(f"h3::adaln_indices: num_timesteps must be an int >= 0, got {num_timesteps!r}")
    return torch.ops.h3.adaln_indices(timestep_indices, token_tags, num_timesteps)


def _check_index_pair(timestep_indices, token_tags, num_timesteps):
    op = "adaln_indices"
    d = validate.device_of(op, "timestep_indices", timestep_indices)
    validate.check_index_tensor(op, "timestep_indices", timestep_indices, d)
    validate.check_index_tensor(op, "token_tags", token_tags, d)
    if token_tags.shape != timestep_indices.shape:
        raise ValueError(
            f"h3::{op}: token_tags has shape {tuple(token_tags.shape)}, timestep_indices "
            f"{tuple(timestep_indices.shape)}; they must agree"
        )


def _adaln_indices_cpu(timestep_indices, token_tags, num_timesteps):
    op = "adaln_indices"
    validate.check_indices(op, "timestep_indices", timestep_indices, num_timesteps,
                           f"num_timesteps = {num_timesteps}")
    validate.check_indices(op, "token_tags", token_tags, MODALITIES, "tags are 0 video, 1 text, 2 audio")
    return timestep_indices * MODALITIES + token_tags


INDICES = declare(Op(
    "adaln_indices(Tensor timestep_indices, Tensor token_tags, int num_timesteps) -> Tensor",
    check=_check_index_pair,
    cpu=_adaln_indices_cpu,
    cuda=lambda *args: _INDICES.forward(*args),
    fake=lambda timestep_indices, token_tags, num_timesteps: torch.empty_like(timestep_indices),
))


def _check_table_indices(op, idx, rows):
    validate.check_indices(op, "adaln_indices", idx, rows, f"the table has {rows} rows: {MODALITIES} per timestep")


def _silu_grad(temb):
    s = torch.sigmoid(temb)
    return s * (1 + temb * (1 - s))


def _projection_backward_fp32(dproj, temb, weight):
    """Gradients of `linear(silu(temb).to(bf16), weight, bias)` for an FP32 upstream `dproj` (T, N)."""
    act = F.silu(temb).to(BF16).float()
    dweight = dproj.t() @ act
    dbias = dproj.sum(0)
    dtemb = (dproj @ weight.float()) * _silu_grad(temb)  # the BF16 cast passes the gradient through
    return dtemb, dweight.to(BF16), dbias.to(BF16)


def _modulate_backward_fp32(grad, x, weight, scale_rows, eps):
    """Per-row gradients of `rms_norm(x, weight, eps) * (1 + scale_rows) + shift_rows`, all FP32.

    Returns dx (FP32), dweight (FP32, summed over rows), the row-wise dshift and dscale.
    """
    g, x32, w = grad.float(), x.float(), weight.float()
    rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    xhat = x32 * rstd
    dnormed = g * (1 + scale_rows)
    dweight = (dnormed * xhat).sum(0)
    dxhat = dnormed * w
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx, dweight, g, g * (xhat * w)


def _table_sum(rows_grad, idx, table_rows):
    """Sums per-row gradients into their table rows, FP32, in row order."""
    return rows_grad.new_zeros((table_rows, rows_grad.shape[1])).index_add_(0, idx, rows_grad)


# ---- adaln_projection ----------------------------------------------------------------------------------

def _projection_setup_context(ctx, inputs, output):
    temb, weight, _ = inputs
    ctx.save_for_backward(temb, weight)


def _projection_backward(ctx, grad):
    temb, weight = ctx.saved_tensors
    return torch.ops.h3.adaln_projection_backward(grad.contiguous(), temb, weight)


PROJECTION = declare(Op(
    "adaln_projection(Tensor temb, Tensor weight, Tensor bias) -> Tensor",
    check=validate.check_adaln_projection,
    cpu=reference.adaln_projection_replay,
    cuda=lambda *args: _PROJECTION.forward(*args),
    fake=lambda temb, weight, bias: weight.new_empty((temb.shape[0], BLOCK_PROJECTION)),
    bf16=("weight", "bias"),
    rows="temb",
    backward_op=Op(
        "adaln_projection_backward(Tensor grad, Tensor temb, Tensor weight) "
        "-> (Tensor dtemb, Tensor dweight, Tensor dbias)",
        check=lambda grad, temb, weight: validate.check_adaln_projection(temb, weight, grad=grad),
        cpu=lambda grad, temb, weight: _projection_backward_fp32(grad.float(), temb, weight),
        cuda=lambda *args: _PROJECTION.backward(*args),
        fake=lambda grad, temb, weight: (torch.empty_like(temb), torch.empty_like(weight),
                                         weight.new_empty((BLOCK_PROJECTION,))),
        bf16=("grad", "weight"),
        rows="temb",
    ),
    setup_context=_projection_setup_context,
    backward=_projection_backward,
))


# ---- adaln_row_gather ----------------------------------------------------------------------------------

def _gather_cpu(table, adaln_indices, check_indices=True):
    if check_indices:
        _check_table_indices("adaln_row_gather", adaln_indices, table.shape[0])
    return reference.adaln_row_gather_replay(table, adaln_indices)


def _gather_backward_cpu(grads, adaln_indices, table_rows):
    return torch.cat([_table_sum(g.float(), adaln_indices, table_rows) for g in grads], dim=1).to(BF16)


def _gather_setup_context(ctx, inputs, output):
    table, idx, _ = inputs
    ctx.save_for_backward(idx)
    ctx.table_rows = table.shape[0]


def _gather_backward(ctx, grads):
    (idx,) = ctx.saved_tensors
    grads = [g.contiguous() for g in grads]
    dtable = torch.ops.h3.adaln_row_gather_backward(grads, idx, ctx.table_rows)
    # Tensor[]-output ops check the gradient tuple against the arguments as called (defaults not filled
    # in): return one entry per argument the caller passed.
    return (dtable, None, None)[: len(ctx.needs_input_grad)]


ROW_GATHER = declare(Op(
    "adaln_row_gather(Tensor table, Tensor adaln_indices, bool check_indices=True) -> Tensor[]",
    check=lambda table, adaln_indices, check_indices=True: validate.check_adaln_row_gather(table, adaln_indices),
    cpu=_gather_cpu,
    cuda=lambda *args: _ROW_GATHER.forward(*args),
    fake=lambda table, adaln_indices, check_indices=True: [
        table.new_empty((adaln_indices.shape[0], HIDDEN)) for _ in range(BLOCK_CHUNKS)
    ],
    bf16=("table",),
    rows="adaln_indices",
    backward_op=Op(
        "adaln_row_gather_backward(Tensor[] grads, Tensor adaln_indices, int table_rows) -> Tensor",
        check=validate.check_adaln_row_gather_backward,
        cpu=_gather_backward_cpu,
        cuda=lambda *args: _ROW_GATHER.backward(*args),
        fake=lambda grads, adaln_indices, table_rows: grads[0].new_empty((table_rows, BLOCK_TABLE)),
        bf16=("grads",),
        rows="adaln_indices",
    ),
    setup_context=_gather_setup_context,
    backward=_gather_backward,
))


# ---- norm_modulate -------------------------------------------------------------------------------------

def _check_norm_modulate(x, weight, shift, scale, adaln_indices, eps=NORM_EPS, check_indices=True):
    validate.check_norm_modulate(x, weight, shift, scale, adaln_indices, eps)


def _norm_modulate_cpu(x, weight, shift, scale, adaln_indices, eps=NORM_EPS, check_indices=True):
    if check_indices:
        _check_table_indices("norm_modulate", adaln_indices, shift.shape[0])
    return reference.norm_modulate_replay(x, weight, shift, scale, adaln_indices, eps)


def _check_norm_modulate_backward(grad, x, weight, scale, adaln_indices, eps, table_rows):
    validate.check_norm_modulate(x, weight, NO_ARG, scale, adaln_indices, eps, grad=grad)
    _check_rows("norm_modulate_backward", "scale", scale, table_rows)


def _norm_modulate_backward_cpu(grad, x, weight, scale, adaln_indices, eps, table_rows):
    dx, dweight, dshift_rows, dscale_rows = _modulate_backward_fp32(
        grad, x, weight, scale.float().index_select(0, adaln_indices), eps
    )
    dshift = _table_sum(dshift_rows, adaln_indices, table_rows)
    dscale = _table_sum(dscale_rows, adaln_indices, table_rows)
    return dx.to(BF16), dweight.to(BF16), dshift.to(BF16), dscale.to(BF16)


def _check_rows(op, name, table, table_rows):
    if table.shape[0] != table_rows:
        raise ValueError(f"h3::{op}: {name} has {table.shape[0]} rows but table_rows = {table_rows}")


def _norm_modulate_setup_context(ctx, inputs, output):
    x, weight, shift, scale, idx, eps, _ = inputs
    ctx.save_for_backward(x, weight, scale, idx)
    ctx.eps, ctx.table_rows = eps, shift.shape[0]


def _norm_modulate_backward(ctx, grad):
    x, weight, scale, idx = ctx.saved_tensors
    dx, dweight, dshift, dscale = torch.ops.h3.norm_modulate_backward(
        grad.contiguous(), x, weight, scale, idx, ctx.eps, ctx.table_rows
    )
    return dx, dweight, dshift, dscale, None, None, None


NORM_MODULATE = declare(Op(
    f"norm_modulate(Tensor x, Tensor weight, Tensor shift, Tensor scale, Tensor adaln_indices, float eps={NORM_EPS!r}, "
    "bool check_indices=True) -> Tensor",
    check=_check_norm_modulate,
    cpu=_norm_modulate_cpu,
    cuda=lambda *args: _NORM_MODULATE.forward(*args),
    fake=lambda x, *_: torch.empty_like(x),
    bf16=("x", "weight", "shift", "scale"),
    rows="x",
    backward_op=Op(
        "norm_modulate_backward(Tensor grad, Tensor x, Tensor weight, Tensor scale, Tensor adaln_indices, float eps, "
        "int table_rows) -> (Tensor dx, Tensor dweight, Tensor dshift, Tensor dscale)",
        check=_check_norm_modulate_backward,
        cpu=_norm_modulate_backward_cpu,
        cuda=lambda *args: _NORM_MODULATE.backward(*args),
        fake=lambda grad, x, weight, scale, adaln_indices, eps, table_rows: (
            torch.empty_like(x), torch.empty_like(weight), scale.new_empty((table_rows, HIDDEN)),
            scale.new_empty((table_rows, HIDDEN))),
        bf16=("grad", "x", "weight", "scale"),
        rows="x",
    ),
    setup_context=_norm_modulate_setup_context,
    backward=_norm_modulate_backward,
))


# ---- gate_residual -------------------------------------------------------------------------------------

def _gate_residual_cpu(residual, y, gate, adaln_indices, check_indices=True):
    if check_indices:
        _check_table_indices("gate_residual", adaln_indices, gate.shape[0])
    return reference.gate_residual_replay(residual, y, gate, adaln_indices)


def _gate_residual_backward_cpu(grad, y, gate, adaln_indices):
    g = grad.float()
    dy = g * gate.float().index_select(0, adaln_indices)
    dgate = _table_sum(g * y.float(), adaln_indices, gate.shape[0])
    return dy.to(BF16), dgate.to(BF16)


def _gate_residual_setup_context(ctx, inputs, output):
    _, y, gate, idx, _ = inputs
    ctx.save_for_backward(y, gate, idx)


def _gate_residual_backward(ctx, grad):
    y, gate, idx = ctx.saved_tensors
    grad = grad.contiguous()
    dy, dgate = torch.ops.h3.gate_residual_backward(grad, y, gate, idx)
    return grad, dy, dgate, None, None  # d residual is the upstream gradient itself


GATE_RESIDUAL = declare(Op(
    "gate_residual(Tensor residual, Tensor y, Tensor gate, Tensor adaln_indices, bool check_indices=True) -> Tensor",
    check=lambda residual, y, gate, adaln_indices, check_indices=True: validate.check_gate_residual(
        residual, y, gate, adaln_indices),
    cpu=_gate_residual_cpu,
    cuda=lambda *args: _GATE_RESIDUAL.forward(*args),
    fake=lambda residual, y, *_: torch.empty_like(y),
    bf16=("residual", "y", "gate"),
    rows="y",
    backward_op=Op(
        "gate_residual_backward(Tensor grad, Tensor y, Tensor gate, Tensor adaln_indices) -> (Tensor dy, Tensor dgate)",
        check=lambda grad, y, gate, adaln_indices: validate.check_gate_residual(NO_ARG, y, gate, adaln_indices,
                                                                               grad=grad),
        cpu=_gate_residual_backward_cpu,
        cuda=lambda *args: _GATE_RESIDUAL.backward(*args),
        fake=lambda grad, y, gate, adaln_indices: (torch.empty_like(y), gate.new_empty(gate.shape)),
        bf16=("grad", "y", "gate"),
        rows="y",
    ),
    setup_context=_gate_residual_setup_context,
    backward=_gate_residual_backward,
))


# ---- gate_residual_norm_modulate -----------------------------------------------------------------------
# A block's attention-half gated residual and its MLP-half norm/modulate of the same rows in one op:
# h = residual + gate[idx] * y, out = norm_modulate(h, ...), both bitwise the two ops back to back. Backward:
# h's gradient is grad_h (from h's other consumer, the next residual) plus norm_modulate's dx, summed in BF16
# as autograd sums the two-op chain's; gate_residual's backward then runs on it and d_residual is that sum.

def _check_fused(residual, y, gate, weight, shift, scale, adaln_indices, eps=NORM_EPS, check_indices=True):
    validate.check_gate_residual_norm_modulate(residual, y, gate, weight, shift, scale, adaln_indices, eps)


def _fused_cpu(residual, y, gate, weight, shift, scale, adaln_indices, eps=NORM_EPS, check_indices=True):
    if check_indices:
        _check_table_indices("gate_residual_norm_modulate", adaln_indices, gate.shape[0])
    return reference.gate_residual_norm_modulate_replay(residual, y, gate, weight, shift, scale, adaln_indices, eps)


def _fused_backward_cpu(grad_h, grad_out, y, gate, h, weight, scale, adaln_indices, eps, table_rows):
    dx, dweight, dshift, dscale = _norm_modulate_backward_cpu(grad_out, h, weight, scale, adaln_indices, eps,
                                                              table_rows)
    dh = dx if grad_h is None else grad_h + dx
    dy, dgate = _gate_residual_backward_cpu(dh, y, gate, adaln_indices)
    return dh, dy, dgate, dweight, dshift, dscale


def _fused_backward_fake(grad_h, grad_out, y, gate, h, weight, scale, adaln_indices, eps, table_rows):
    table = scale.new_empty((table_rows, HIDDEN))
    return (torch.empty_like(y), torch.empty_like(y), table, torch.empty_like(weight), torch.empty_like(table),
            torch.empty_like(table))


def _fused_setup_context(ctx, inputs, output):
    _, y, gate, weight, shift, scale, idx, eps, _ = inputs
    ctx.save_for_backward(y, gate, output[0], weight, scale, idx)
    ctx.eps, ctx.table_rows = eps, shift.shape[0]
    # An output nobody used gets None, not zeros: h is often consumed only through `out` (grad_h None), and
    # a missing grad_out leaves gate_residual's backward alone (the two-op chain would not run norm_modulate's).
    ctx.set_materialize_grads(False)


def _fused_backward(ctx, grad_h, grad_out):
    y, gate, h, weight, scale, idx = ctx.saved_tensors
    if grad_h is not None:
        grad_h = grad_h.contiguous()
    if grad_out is None:
        if grad_h is None:
            return (None,) * 9
        dy, dgate = torch.ops.h3.gate_residual_backward(grad_h, y, gate, idx)
        return grad_h, dy, dgate, None, None, None, None, None, None
    grads = torch.ops.h3.gate_residual_norm_modulate_backward(grad_h, grad_out.contiguous(), y, gate, h, weight,
                                                               scale, idx, ctx.eps, ctx.table_rows)
    return *grads, None, None, None


GATE_RESIDUAL_NORM_MODULATE = declare(Op(
    "gate_residual_norm_modulate(Tensor residual, Tensor y, Tensor gate, Tensor weight, Tensor shift, Tensor scale, "
    f"Tensor adaln_indices, float eps={NORM_EPS!r}, bool check_indices=True) -> (Tensor h, Tensor out)",
    check=_check_fused,
    cpu=_fused_cpu,
    cuda=lambda *args: _GATE_RESIDUAL_NORM_MODULATE.forward(*args),
    fake=lambda residual, y, *_: (torch.empty_like(y), torch.empty_like(y)),
    bf16=("residual", "y", "gate", "weight", "shift", "scale"),
    rows="y",
    backward_op=Op(
        "gate_residual_norm_modulate_backward(Tensor? grad_h, Tensor grad_out, Tensor y, Tensor gate, Tensor h, "
        "Tensor weight, Tensor scale, Tensor adaln_indices, float eps, int table_rows) "
        "-> (Tensor d_residual, Tensor dy, Tensor dgate, Tensor dweight, Tensor dshift, Tensor dscale)",
        check=validate.check_gate_residual_norm_modulate_backward,
        cpu=_fused_backward_cpu,
        cuda=lambda *args: _GATE_RESIDUAL_NORM_MODULATE.backward(*args),
        fake=_fused_backward_fake,
        bf16=("grad_h", "grad_out", "y", "gate", "h", "weight", "scale"),
        rows="y",
    ),
    setup_context=_fused_setup_context,
    backward=_fused_backward,
))


# ---- final_adaln_out -----------------------------------------------------------------------------------

def _check_final(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps=NORM_EPS, check_indices=True):
    validate.check_final_adaln_out(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps)


def _final_fwd_cpu(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps=NORM_EPS, check_indices=True):
    if check_indices:
        validate.check_indices("final_adaln_out", "timestep_indices", timestep_indices, temb.shape[0],
                               f"temb has {temb.shape[0]} timestep rows")
    table = reference.final_projection_table(temb, proj_weight, proj_bias)
    shift, scale = table.chunk(2, dim=-1)
    return reference.norm_modulate_replay(x, norm_weight, shift, scale, timestep_indices, eps), table


def _final_fwd_fake(x, norm_weight, temb, *_):
    return torch.empty_like(x), x.new_empty((temb.shape[0], FINAL_PROJECTION))


def _check_final_backward(grad, x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps, table=None):
    validate.check_final_adaln_out(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps, grad=grad,
                                   table=table)


def _final_backward_cpu(grad, x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps, table=None):
    if table is None:
        table = reference.final_projection_table(temb, proj_weight, proj_bias)
    dx, dnorm_weight, dshift_rows, dscale_rows = _modulate_backward_fp32(
        grad, x, norm_weight, table[:, HIDDEN:].float().index_select(0, timestep_indices), eps
    )
    rows = temb.shape[0]
    dproj = torch.cat(
        [_table_sum(dshift_rows, timestep_indices, rows), _table_sum(dscale_rows, timestep_indices, rows)], dim=1
    )
    dtemb, dproj_weight, dproj_bias = _projection_backward_fp32(dproj, temb, proj_weight)
    return dx.to(BF16), dnorm_weight.to(BF16), dtemb, dproj_weight, dproj_bias


def _final_backward_fake(grad, x, norm_weight, temb, proj_weight, proj_bias, *_):
    return (torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(temb),
            torch.empty_like(proj_weight), torch.empty_like(proj_bias))


def _final_setup_context(ctx, inputs, output):
    x, norm_weight, temb, proj_weight, proj_bias, ti, eps, _ = inputs
    ctx.save_for_backward(x, norm_weight, temb, proj_weight, proj_bias, ti, output[1])  # output: (out, table)
    ctx.eps = eps


def _final_backward(ctx, grad):
    x, norm_weight, temb, proj_weight, proj_bias, ti, table = ctx.saved_tensors
    grads = torch.ops.h3.final_adaln_out_backward(grad.contiguous(), x, norm_weight, temb, proj_weight, proj_bias,
                                                  ti, ctx.eps, table)
    return *grads, None, None, None


_FINAL_ARGS = ("Tensor x, Tensor norm_weight, Tensor temb, Tensor proj_weight, Tensor proj_bias, "
               f"Tensor timestep_indices, float eps={NORM_EPS!r}, bool check_indices=True")
_FINAL_BF16 = ("x", "norm_weight", "proj_weight", "proj_bias")  # temb is FP32
FINAL = declare(Op(
    f"final_adaln_out({_FINAL_ARGS}) -> Tensor",
    check=_check_final,
    cpu=lambda *args: _final_fwd_cpu(*args)[0],
    cuda=lambda *args: _FINAL.forward_with_table(*args)[0],
    fake=lambda x, *_: torch.empty_like(x),
    bf16=_FINAL_BF16,
    # final_adaln_out's autograd forward: the output and the (T, 10752) projection the backward reuses.
    forward_op=Op(
        f"final_adaln_out_fwd({_FINAL_ARGS}) -> (Tensor out, Tensor table)",
        check=_check_final,
        cpu=_final_fwd_cpu,
        cuda=lambda *args: _FINAL.forward_with_table(*args),
        fake=_final_fwd_fake,
        bf16=_FINAL_BF16,
    ),
    backward_op=Op(
        "final_adaln_out_backward(Tensor grad, Tensor x, Tensor norm_weight, Tensor temb, Tensor proj_weight, "
        "Tensor proj_bias, Tensor timestep_indices, float eps, Tensor? table=None) "
        "-> (Tensor dx, Tensor dnorm_weight, Tensor dtemb, Tensor dproj_weight, Tensor dproj_bias)",
        check=_check_final_backward,
        cpu=_final_backward_cpu,
        cuda=lambda *args: _FINAL.backward(*args),
        fake=_final_backward_fake,
        bf16=("grad", *_FINAL_BF16, "table"),
        rows="x",
    ),
    setup_context=_final_setup_context,
    backward=_final_backward,
))


# The Python CUDA impls, by the names h3_native.cpp calls for inputs off its fast path.
_projection_cuda = PROJECTION.cuda_impl
_projection_backward_cuda = PROJECTION.backward_op.cuda_impl
_gather_cuda = ROW_GATHER.cuda_impl
_gather_backward_cuda = ROW_GATHER.backward_op.cuda_impl
_norm_modulate_cuda = NORM_MODULATE.cuda_impl
_norm_modulate_backward_cuda = NORM_MODULATE.backward_op.cuda_impl
_gate_residual_cuda = GATE_RESIDUAL.cuda_impl
_gate_residual_backward_cuda = GATE_RESIDUAL.backward_op.cuda_impl
_fused_cuda = GATE_RESIDUAL_NORM_MODULATE.cuda_impl
_fused_backward_cuda = GATE_RESIDUAL_NORM_MODULATE.backward_op.cuda_impl
_final_fwd_cuda = FINAL.forward_op.cuda_impl
_final_backward_cuda = FINAL.backward_op.cuda_impl
