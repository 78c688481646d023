"""Elementwise numeric-contract checks for the tests: BF16 rounding bounds against FP64, and the documented
fixed-order FP32 sums of the row kernels' table gradients (docs/row_kernels.md, "Cross-row sums").

A result "rounded once to BF16" from an FP32 value v that is within e of the exact value r satisfies, per
element, |out - r| <= U_BF16 |r| + (1 + U_BF16) e (round to nearest moves v by at most U_BF16 |v|). The FP32
error e of a sum or GEMM is far below `FP32_SLACK` times the sum of its terms' magnitudes for the sizes tested
(a forward bound would be n 2^-24 of that, the observed error is ~sqrt(n) 2^-24), so a second BF16 rounding
anywhere on the path shows up as elements outside the bound.
"""
import torch
from h3cute.widths import NORM_EPS

U_BF16 = 2.0 ** -8  # unit roundoff of BF16 (8-bit significand)
FP32_SLACK = 2.0 ** -16  # room for FP32 accumulation, relative to the sum of |terms|


def one_rounding(ref: torch.Tensor, abs_terms=0.0) -> torch.Tensor:
    """Bound on |out - ref| of one BF16 rounding of an FP32 value computed from terms whose |.| sums to
    `abs_terms` (elementwise tensor or scalar)."""
    err32 = FP32_SLACK * abs_terms
    return U_BF16 * ref.abs() + (1 + U_BF16) * err32


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound, what: str) -> None:
    """Elementwise |got - ref| <= bound in FP64 (NaN never passes); names the worst element."""
    assert got.shape == ref.shape, (what, tuple(got.shape), tuple(ref.shape))
    err = (got.double() - ref.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64, device=err.device).expand_as(err)
    ok = err <= bound
    if not bool(ok.all()):
        excess = torch.where(ok, torch.zeros_like(err), (err / bound).nan_to_num(float("inf")))
        worst = int(excess.flatten().argmax())
        at = list(torch.unravel_index(torch.tensor(worst), err.shape))
        at = [int(i) for i in at]
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {err.numel()} elements outside the bound; worst at {at}: "
            f"got {got.flatten()[worst].item()!r}, ref {ref.flatten()[worst].item()!r}, "
            f"bound {bound.flatten()[worst].item():.3g}")


def fixed_order_table_sum(rows: torch.Tensor, idx: torch.Tensor, table_rows: int, groups: int) -> torch.Tensor:
    """The row kernels' cross-row sum, written out in FP32 adds: row group p of `groups` owns rows
    [p ceil(S/P), (p+1) ceil(S/P)) and adds them in row order from +0 into its partial of table row idx[s]; the
    partials of groups 0..P-1 are added in order from +0; one rounding to BF16. rows: (S, C) FP32 terms."""
    num_rows, cols = rows.shape
    per_group = -(-num_rows // groups)
    partial = torch.zeros((groups, table_rows, cols), dtype=torch.float32, device=rows.device)
    starts = torch.arange(groups, device=rows.device) * per_group
    for step in range(per_group):  # one row of every group per step: no two adds hit one accumulator
        s = starts + step
        live = s < num_rows
        g, s = torch.arange(groups, device=rows.device)[live], s[live]
        partial[g, idx[s]] = partial[g, idx[s]] + rows[s].float()
    total = torch.zeros((table_rows, cols), dtype=torch.float32, device=rows.device)
    for p in range(groups):
        total = total + partial[p]
    return total.to(torch.bfloat16)


def final_adaln_out_fp64(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, table, eps=NORM_EPS):
    """final_adaln_out in FP64 on the op's own (T, 10752) BF16 table: the projection is BF16 by the op's
    definition (diffusers' Linear in BF16), so the norm half reads `table`'s values while gradients reach the
    projection's FP64 inputs straight through that rounding (as `reference._silu_bf16_fp64` does for silu)."""
    from h3cute import reference

    exact = reference.adaln_projection_fp64(temb, proj_weight, proj_bias)
    rounded = exact + (table.double() - exact).detach()
    shift, scale = rounded.chunk(2, dim=-1)
    return reference.norm_modulate_fp64(x, norm_weight, shift, scale, timestep_indices, eps)


def row_groups(device) -> int:
    """P of the row kernels' cross-row sums on `device`'s arch (`launch.norm_modulate.ROW_GROUPS`)."""
    from h3cute import runtime
    from h3cute.launch import norm_modulate

    return norm_modulate.ROW_GROUPS[runtime.arch_of(device)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; a non-finite output fails."""
    out = out.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).abs().max() / ref.abs().max()).item()


# ---- the BF16 projection's accuracy bar (docs/adaln_projection.md, "Accuracy bar") -----------------------
# Our BF16 results (table, dW, db) may be at most REPLAY_SLACK times worse than the diffusers replay's (cuBLAS,
# torch autograd) on the same inputs and GPU (max-error statistics of two roundings of nearly the same FP32
# values), and never above the ceiling; d_temb (FP32) is held to DTEMB_TOL against FP64.
REPLAY_SLACK = 1.05
BF16_ERR_CEILING = 5e-3
DTEMB_TOL = 1e-5


def projection_replay(temb, w, b, grad=None):
    """The diffusers replay of the projection (cuBLAS) and, given an upstream grad, its autograd (dtemb, dW, db)."""
    from h3cute import reference

    if grad is None:
        with torch.no_grad():
            return reference.adaln_projection_replay(temb, w, b)
    leaves = [x.detach().clone().requires_grad_() for x in (temb, w, b)]
    out = reference.adaln_projection_replay(*leaves)
    out.backward(grad)
    return out.detach(), *(x.grad for x in leaves)


def assert_no_worse_than_replay(ours, replay, ref, what):
    """max-rel error of `ours` <= REPLAY_SLACK x the replay's on the same inputs, and <= the ceiling."""
    err, replay_err = rel_err(ours, ref), rel_err(replay, ref)
    assert err <= BF16_ERR_CEILING, f"{what}: rel err {err:.3g} above the ceiling {BF16_ERR_CEILING}"
    assert err <= REPLAY_SLACK * replay_err + 1e-7, f"{what}: rel err {err:.4g} vs replay (cuBLAS) {replay_err:.4g}"


def projection_grads_fp64(grad, temb, weight):
    """FP64 dtemb, dW, db of linear(bf16(silu(temb)), W, b) (the BF16 cast passes the gradient through)."""
    g, t, w = grad.double(), temb.double(), weight.double()
    act = torch.nn.functional.silu(temb).to(torch.bfloat16).double()
    s = torch.sigmoid(t)
    return (g @ w) * (s * (1 + t * (1 - s))), g.t() @ act, g.sum(0)


# ---- per-op contracts shared by the op-level GPU tests --------------------------------------------------

def norm_modulate_backward_fp64(grad, x, weight, shift, scale, idx, eps=NORM_EPS):
    """FP64 autograd of norm_modulate: (dx, dweight, dshift, dscale) and, for the reductions, the same at
    |inputs| (an upper bound on the sum of each reduction's |terms|: 1 + |scale| >= |1 + scale|)."""
    from h3cute import reference

    def grads(f):
        leaves = [f(t).requires_grad_() for t in (x, weight, shift, scale)]
        reference.norm_modulate_fp64(*leaves, idx, eps).backward(f(grad))
        return [t.grad for t in leaves]

    return grads(lambda t: t.detach().double()), grads(lambda t: t.detach().double().abs())


def assert_norm_modulate_backward(got, grad, x, weight, shift, scale, idx, what, eps=NORM_EPS):
    """dx: FP32 math, one BF16 rounding (FP32 room relative to the largest element); dweight, dshift, dscale: FP32
    sums, one rounding (FP32 room relative to the sum of |terms|). docs/row_kernels.md's numeric contract."""
    ref, mag = norm_modulate_backward_fp64(grad, x, weight, shift, scale, idx, eps)
    for name, g, r, m in zip(("dx", "dweight", "dshift", "dscale"), got, ref, mag):
        room = float(r.abs().max()) if name == "dx" else m
        assert g.dtype == torch.bfloat16 and g.shape == r.shape, (what, name)
        assert_within(g, r, one_rounding(r, room), f"{what} {name}")


def assert_final_adaln_out_backward(got, grad, x, norm_weight, temb, proj_weight, proj_bias, ti, table, what,
                                    eps=NORM_EPS):
    """final_adaln_out's backward contract on the op's own BF16 `table`: dx and d_norm_weight as norm_modulate's;
    the table gradient d(shift | scale) BF16 (the norm backward's fixed-order sums, one rounding, read from
    `h3::norm_modulate_backward` on the same table: the same sums, docs/adaln_projection.md); d_temb within
    DTEMB_TOL of FP64 of the projection backward of that BF16 table gradient; dW and db no worse than the replay's
    autograd on it."""
    hidden = x.shape[1]
    dx, dnorm_weight, dtemb, dw, db = got
    shift, scale = table[:, :hidden], table[:, hidden:]
    dtable = torch.ops.h3.norm_modulate_backward(grad, x, norm_weight, scale, ti, eps, table.shape[0])
    assert_norm_modulate_backward((dx, dnorm_weight, *dtable[2:]), grad, x, norm_weight, shift, scale, ti, what, eps)
    dproj = torch.cat(dtable[2:], dim=1)
    ref_dtemb, ref_dw, ref_db = projection_grads_fp64(dproj, temb, proj_weight)
    assert dtemb.dtype == torch.float32 and rel_err(dtemb, ref_dtemb) <= DTEMB_TOL, (what, rel_err(dtemb, ref_dtemb))
    _, _, replay_dw, replay_db = projection_replay(temb, proj_weight, proj_bias, dproj)
    assert_no_worse_than_replay(dw, replay_dw, ref_dw, f"{what} dW")
    assert_no_worse_than_replay(db, replay_db, ref_db, f"{what} db")


def assert_table_sum(got: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, what: str) -> None:
    """A row kernel's table gradient (R, C) BF16 from per-row FP32 terms `rows` (S, C) (exact: BF16 values or
    products of two): bit for bit the fixed-order FP32 sum (`fixed_order_table_sum`), and within one rounding
    of the FP64 sum."""
    want = fixed_order_table_sum(rows, idx, got.shape[0], row_groups(got.device))
    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
        bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} elements differ from the fixed-order FP32 sum, first at "
                             f"{bad[0].tolist()}")
    ref = torch.zeros(got.shape, dtype=torch.float64, device=got.device).index_add_(0, idx, rows.double())
    mag = torch.zeros_like(ref).index_add_(0, idx, rows.double().abs())
    assert_within(got, ref, one_rounding(ref, mag), f"{what} vs FP64")
