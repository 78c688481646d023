"""Input checks for every `torch.ops.h3` op, shared by the CPU, CUDA and fake impls.

Two tiers. `check_*` functions look only at tensor attributes (dtype, shape, strides, device): they cost
no device sync and run on every call, fake tensors included. `check_*_values` functions read tensor
contents (index ranges, timestep range, NaN): they sync the device, so the ops run them only when their
`check_*` flag is true. Every message names the op, the argument, what was expected and what was given.

H3's widths come from `h3cute.widths`.
"""
import torch

from h3cute.widths import (BLOCK_CHUNKS, BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, FREQ, HIDDEN, LINEAR_SHAPES,
                           MLP_HIDDEN, TEMB)

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64
# Timesteps in these dtypes are widened exactly to FP32, as diffusers' `timesteps[:, None].float()` does.
TIMESTEP_WIDENED = (torch.float16, torch.bfloat16, torch.float64)

MLP_DTYPE_HINT = " (the H3 time_embedder is an FP32 module: do not cast its inputs or weights down)"
TEMB_DTYPE_HINT = (
    " (known defect: cast after SiLU, not before; pass the FP32 time_embedder output, the op casts "
    "silu(temb) to BF16 itself)"
)

CONTIGUOUS, ROW_STRIDED = "contiguous", "row-strided"

# Device keys: the CUDA index, CPU for CPU, META for meta. `Tensor.get_device()` says -1 for both CPU and meta,
# so a meta tensor among CPU inputs would pass for a CPU one (and the op would return uninitialised memory).
CPU, META = -1, -2


class _NoArg:
    """`NO_ARG`: an argument the calling op does not have (a backward op's check skips the forward-only pieces).

    Distinct from None: a `Tensor` schema argument given as None reaches the impls as None, and the checks refuse
    it, naming the op and the argument."""

    def __repr__(self):
        return "NO_ARG"


NO_ARG = _NoArg()


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _key(t) -> int:
    d = t.get_device()
    return META if d < 0 and t.is_meta else d


def device_of(op, name, t) -> int:
    """The device key of `t` (CUDA index, CPU or META): the device every other input of `op` must be on."""
    if t is None:
        raise TypeError(f"h3::{op}: {name} is None; the op takes a tensor there")
    return _key(t)


def _device_name(key) -> str:
    return "meta" if key == META else "cpu" if key == CPU else f"cuda:{key}"


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"


def check_tensor(op, name, t, dtype, shape, device, layout=CONTIGUOUS, hint=""):
    """Checks one tensor's dtype, rank, fixed widths (ints in `shape`; strs name free dims), layout and device
    (a key from `device_of`).

    `ROW_STRIDED` accepts a 2-D view whose rows are unit-stride and do not overlap (row stride >= width),
    such as a column chunk of the modulation table; `CONTIGUOUS` needs a dense tensor. The passing path is
    one short-circuit expression (it runs on every CUDA call); the messages are built only on failure.
    """
    if t is None:
        raise TypeError(f"h3::{op}: {name} is None; the op takes a {_name(dtype)} tensor of shape "
                        f"{_shape_text(shape)} there")
    s = t.shape
    n = len(shape)
    if (
        t.dtype is dtype
        and len(s) == n
        and (shape[0].__class__ is str or s[0] == shape[0])
        and (n == 1 or s[1] == shape[1])
        and (t.get_device() == device if device >= 0 else _key(t) == device)
        and (t.is_contiguous() if layout is CONTIGUOUS else t.stride(-1) == 1 and (s[0] <= 1 or t.stride(0) >= s[1]))
    ):
        return
    _explain(op, name, t, dtype, shape, device, layout, hint)


def _explain(op, name, t, dtype, shape, device, layout, hint):
    if t.dtype != dtype:
        raise TypeError(f"h3::{op}: {name} must be {_name(dtype)}, got {_name(t.dtype)}{hint}")
    if t.dim() != len(shape) or any(type(w) is int and g != w for g, w in zip(t.shape, shape)):
        raise ValueError(f"h3::{op}: {name} must have shape {_shape_text(shape)}, got {tuple(t.shape)}")
    if _key(t) != device:
        raise ValueError(f"h3::{op}: {name} is on {t.device}, expected {_device_name(device)} "
                         "(the device of the other inputs)")
    if layout is CONTIGUOUS:
        raise ValueError(
            f"h3::{op}: {name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)} "
            "(call .contiguous())"
        )
    raise ValueError(
        f"h3::{op}: {name} must have unit-stride, non-overlapping rows (stride(-1) == 1, "
        f"stride(0) >= {t.shape[-1]}), got strides {t.stride()}"
    )


def _rows(op, name, n, other, m):
    if n != m:
        raise ValueError(f"h3::{op}: {name} has {n} rows, {other} has {m}; they must agree")


def _eps(op, eps):
    if not eps > 0:  # also refuses NaN
        raise ValueError(f"h3::{op}: eps must be > 0, got {eps}")


def check_timestep_sinusoid(t):
    op = "timestep_sinusoid"
    device_of(op, "t", t)  # refuses None
    if t.dim() != 1:
        raise ValueError(f"h3::{op}: t must be 1-D (T,) timesteps in [0, 1], got shape {tuple(t.shape)}")
    if t.dtype != F32 and t.dtype not in TIMESTEP_WIDENED:
        raise TypeError(
            f"h3::{op}: t must be a floating tensor of timesteps in [0, 1], got {_name(t.dtype)} "
            "(integer timesteps 0..999 are the scaled-by-1000 convention: pass t / 1000 as float32)"
        )
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"h3::{op}: t must be contiguous, got stride {t.stride()}")


def check_timestep_values(t):
    op = "timestep_sinusoid"
    bad = ~((t >= 0) & (t <= 1))  # NaN compares false both ways, so it is bad too
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        v = float(t[i])
        if v != v:
            raise ValueError(f"h3::{op}: t[{i}] is NaN")
        why = (
            " (t looks scaled by 1000, the classic diffusers-scheduler convention; H3 takes t in [0, 1]: "
            "divide by 1000)"
            if v > 1
            else ""
        )
        raise ValueError(f"h3::{op}: t must lie in [0, 1], got t[{i}] = {v}{why}")


def check_indices(op, name, idx, rows, what):
    """Value check: every index in [0, rows). Names the first bad row. Syncs the device."""
    if idx.numel() == 0:
        return
    lo, hi = torch.aminmax(idx)
    if int(lo) < 0 or int(hi) >= rows:
        bad = (idx < 0) | (idx >= rows)
        i = int(bad.nonzero()[0, 0])
        raise IndexError(
            f"h3::{op}: {name}[{i}] = {int(idx[i])} is outside [0, {rows}) ({what}); "
            "indices are never clamped"
        )


def check_index_tensor(op, name, idx, device):
    check_tensor(op, name, idx, I64, ("S",), device)


def check_timestep_mlp(x, w1, b1, w2, b2=NO_ARG, grad=NO_ARG):
    """The forward's arguments, or with `grad` the backward's (which has no b2)."""
    op = "timestep_mlp" if grad is NO_ARG else "timestep_mlp_backward"
    d = device_of(op, "x", x)
    check_tensor(op, "x", x, F32, ("T", FREQ), d, hint=MLP_DTYPE_HINT)
    check_tensor(op, "w1", w1, F32, (MLP_HIDDEN, FREQ), d, hint=MLP_DTYPE_HINT)
    check_tensor(op, "b1", b1, F32, (MLP_HIDDEN,), d, hint=MLP_DTYPE_HINT)
    check_tensor(op, "w2", w2, F32, (TEMB, MLP_HIDDEN), d, hint=MLP_DTYPE_HINT)
    if b2 is not NO_ARG:
        check_tensor(op, "b2", b2, F32, (TEMB,), d, hint=MLP_DTYPE_HINT)
    if grad is not NO_ARG:
        check_tensor(op, "grad", grad, F32, ("T", TEMB), d)
        _rows(op, "grad", grad.shape[0], "x", x.shape[0])


def _check_temb_projection(op, temb, weight, bias, width, d):
    check_tensor(op, "temb", temb, F32, ("T", TEMB), d, hint=TEMB_DTYPE_HINT)
    check_tensor(op, "weight" if width == BLOCK_PROJECTION else "proj_weight", weight, BF16, (width, TEMB), d)
    if bias is not NO_ARG:
        check_tensor(op, "bias" if width == BLOCK_PROJECTION else "proj_bias", bias, BF16, (width,), d)


def check_adaln_projection(temb, weight, bias=NO_ARG, grad=NO_ARG):
    """The forward's arguments, or with `grad` the backward's (which has no bias)."""
    op = "adaln_projection" if grad is NO_ARG else "adaln_projection_backward"
    d = device_of(op, "temb", temb)
    _check_temb_projection(op, temb, weight, bias, BLOCK_PROJECTION, d)
    if grad is not NO_ARG:
        check_tensor(op, "grad", grad, BF16, ("T", BLOCK_PROJECTION), d)
        _rows(op, "grad", grad.shape[0], "temb", temb.shape[0])


def check_final_adaln_out(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps, grad=NO_ARG,
                          table=None):
    """The forward's arguments, or with `grad` the backward's (`table` is the backward's optional argument)."""
    op = "final_adaln_out" if grad is NO_ARG else "final_adaln_out_backward"
    d = device_of(op, "x", x)
    check_tensor(op, "x", x, BF16, ("S", HIDDEN), d)
    check_tensor(op, "norm_weight", norm_weight, BF16, (HIDDEN,), d)
    _check_temb_projection(op, temb, proj_weight, proj_bias, FINAL_PROJECTION, d)
    check_index_tensor(op, "timestep_indices", timestep_indices, d)
    _rows(op, "timestep_indices", timestep_indices.shape[0], "x", x.shape[0])
    _eps(op, eps)
    if grad is not NO_ARG:
        check_tensor(op, "grad", grad, BF16, ("S", HIDDEN), d)
        _rows(op, "grad", grad.shape[0], "x", x.shape[0])
    if table is not None:  # the forward's projection (h3::final_adaln_out_fwd)
        check_tensor(op, "table", table, BF16, ("T", FINAL_PROJECTION), d)
        _rows(op, "table", table.shape[0], "temb", temb.shape[0])


def check_adaln_row_gather(table, adaln_indices):
    op = "adaln_row_gather"
    d = device_of(op, "table", table)
    check_tensor(op, "table", table, BF16, ("3T", BLOCK_TABLE), d, ROW_STRIDED)
    check_index_tensor(op, "adaln_indices", adaln_indices, d)


def check_adaln_row_gather_backward(grads, adaln_indices, table_rows):
    op = "adaln_row_gather_backward"
    if len(grads) != BLOCK_CHUNKS:
        raise ValueError(f"h3::{op}: grads must hold {BLOCK_CHUNKS} tensors (one per chunk), got {len(grads)}")
    d = device_of(op, "adaln_indices", adaln_indices)
    check_index_tensor(op, "adaln_indices", adaln_indices, d)
    for c, g in enumerate(grads):
        check_tensor(op, f"grads[{c}]", g, BF16, ("S", HIDDEN), d)
        _rows(op, f"grads[{c}]", g.shape[0], "adaln_indices", adaln_indices.shape[0])
    if table_rows < 0:
        raise ValueError(f"h3::{op}: table_rows must be >= 0, got {table_rows}")


def check_norm_modulate(x, weight, shift, scale, adaln_indices, eps, grad=NO_ARG):
    """The forward's arguments, or with `grad` the backward's (shift `NO_ARG`: the backward has none)."""
    op = "norm_modulate" if grad is NO_ARG else "norm_modulate_backward"
    d = device_of(op, "x", x)
    _check_row_tensor(op, "x", x, d)
    _check_modulation(op, weight, shift, scale, d)
    check_index_tensor(op, "adaln_indices", adaln_indices, d)
    _rows(op, "adaln_indices", adaln_indices.shape[0], "x", x.shape[0])
    _eps(op, eps)
    if grad is not NO_ARG:
        _check_row_tensor(op, "grad", grad, d, "x", x)


def check_gate_residual(residual, y, gate, adaln_indices, grad=NO_ARG, *, op=None, grad_name="grad"):
    """The forward's arguments, or with `grad` the backward's (residual `NO_ARG`: the backward has none).
    `op`/`grad_name`: how the fused op's checks name them (its gate_residual half)."""
    op = op or ("gate_residual" if grad is NO_ARG else "gate_residual_backward")
    d = device_of(op, "y", y)
    if residual is not NO_ARG:
        _check_row_tensor(op, "residual", residual, d, "y", y)
    _check_row_tensor(op, "y", y, d)
    check_tensor(op, "gate", gate, BF16, ("3T", HIDDEN), d, ROW_STRIDED)
    check_index_tensor(op, "adaln_indices", adaln_indices, d)
    _rows(op, "adaln_indices", adaln_indices.shape[0], "y", y.shape[0])
    if grad is not NO_ARG:
        _check_row_tensor(op, grad_name, grad, d, "y", y)


def check_gate_residual_norm_modulate(residual, y, gate, weight, shift, scale, adaln_indices, eps):
    """The fused op's forward: gate_residual's checks, then norm_modulate's on the tables (its x is the h it
    computes); one `adaln_indices` addresses all three tables, so they have the same row count."""
    op = "gate_residual_norm_modulate"
    check_gate_residual(residual, y, gate, adaln_indices, op=op)
    _check_modulation(op, weight, shift, scale, device_of(op, "y", y))
    _rows(op, "scale", scale.shape[0], "gate", gate.shape[0])
    _eps(op, eps)


def check_gate_residual_norm_modulate_backward(grad_h, grad_out, y, gate, h, weight, scale, adaln_indices, eps,
                                               table_rows):
    """`grad_h` None (the schema's `Tensor?`): h itself has no consumer, its gradient is norm_modulate's dx."""
    op = "gate_residual_norm_modulate_backward"
    d = device_of(op, "y", y)
    check_gate_residual(NO_ARG, y, gate, adaln_indices, grad_out, op=op, grad_name="grad_out")
    _check_row_tensor(op, "h", h, d, "y", y)
    if grad_h is not None:
        _check_row_tensor(op, "grad_h", grad_h, d, "y", y)
    _check_modulation(op, weight, NO_ARG, scale, d)
    _eps(op, eps)
    for name, t in (("gate", gate), ("scale", scale)):
        if t.shape[0] != table_rows:
            raise ValueError(f"h3::{op}: {name} has {t.shape[0]} rows but table_rows = {table_rows}")


def _check_row_tensor(op, name, t, d, other=None, like=None):
    """An (S, H) BF16 row tensor; with `like`, its rows must agree with `other`'s."""
    check_tensor(op, name, t, BF16, ("S", HIDDEN), d)
    if like is not None:
        _rows(op, name, t.shape[0], other, like.shape[0])


def _check_modulation(op, weight, shift, scale, d):
    """The RMSNorm weight and the (3T, H) shift / scale tables (row-strided views allowed; shift `NO_ARG`: the
    backward's)."""
    check_tensor(op, "weight", weight, BF16, (HIDDEN,), d)
    if shift is not NO_ARG:
        check_tensor(op, "shift", shift, BF16, ("3T", HIDDEN), d, ROW_STRIDED)
    check_tensor(op, "scale", scale, BF16, ("3T", HIDDEN), d, ROW_STRIDED)
    if shift is not NO_ARG:
        _rows(op, "shift", shift.shape[0], "scale", scale.shape[0])


LINEAR_HINT = " (the H3 input and output heads are FP32 modules: do not cast their inputs or weights down)"


def _linear_served():
    return ", ".join(_shape_text(s) for s in LINEAR_SHAPES)


def check_linear(x, weight, bias=NO_ARG, grad=NO_ARG):
    """h3::linear's arguments (x (..., K), weight (N, K), bias (N,) or None), or with `grad` (..., N) the backward's
    (which has no bias). x and grad may have any strides (the CUDA impl makes rows contiguous); weight and bias are
    contiguous; (N, K) must be one of the four FP32 heads' weight shapes (widths.LINEAR_SHAPES)."""
    op = "linear" if grad is NO_ARG else "linear_backward"
    d = device_of(op, "x", x)
    # (N, K) as given (check_tensor's fast path takes a free width only in dim 0); its value is checked next
    check_tensor(op, "weight", weight, F32, tuple(weight.shape) if weight is not None and weight.dim() == 2
                 else ("N", "K"), d, hint=LINEAR_HINT)
    n, k = weight.shape
    if (n, k) not in LINEAR_SHAPES:
        raise ValueError(f"h3::{op}: weight has shape {tuple(weight.shape)}; the op serves the MiniMax-H3 FP32 heads' "
                         f"(out_features, in_features) {_linear_served()} only")
    _check_rows_tensor(op, "x", x, k, d)
    if bias is not NO_ARG and bias is not None:
        check_tensor(op, "bias", bias, F32, (n,), d, hint=LINEAR_HINT)
    if grad is not NO_ARG:
        _check_rows_tensor(op, "grad", grad, n, d)
        if grad.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"h3::{op}: grad has leading shape {tuple(grad.shape[:-1])}, x has "
                             f"{tuple(x.shape[:-1])}; they must agree")


def _check_rows_tensor(op, name, t, width, d):
    """An FP32 (..., width) tensor on device d, any strides."""
    if t is None:
        raise TypeError(f"h3::{op}: {name} is None; the op takes a float32 tensor of shape (..., {width}) there")
    if t.dtype is not F32:
        raise TypeError(f"h3::{op}: {name} must be float32, got {_name(t.dtype)}{LINEAR_HINT}")
    if t.dim() < 1 or t.shape[-1] != width:
        raise ValueError(f"h3::{op}: {name} must have shape (..., {width}), got {tuple(t.shape)}")
    if _key(t) != d:
        raise ValueError(f"h3::{op}: {name} is on {t.device}, expected {_device_name(d)} "
                         "(the device of the other inputs)")
