"""Elementwise numeric-contract checks for the tests: BF16 rounding bounds against FP64, and the documented
fixed-order FP32 sums of the row kernels' table gradients (docs/row_kernels.md, "Cross-row sums").

A result "rounded once to BF16" from an FP32 value v that is within e of the exact value r satisfies, per
element, |out - r| <= U_BF16 |r| + (1 + U_BF16) e (round to nearest moves v by at most U_BF16 |v|). The FP32
error e of a sum or GEMM is far below `FP32_SLACK` times the sum of its terms' magnitudes for the sizes tested
(a forward bound would be n 2^-24 of that, the observed error is ~sqrt(n) 2^-24), so a second BF16 rounding
anywhere on the path shows up as elements outside the bound.
"""
import torch

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


def final_adaln_out_fp64(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, table, eps=1e-5):
    """final_adaln_out in FP64 on the op's own (T, 10752) BF16 table: the projection is BF16 by the op's
    definition (diffusers' Linear in BF16), so the norm half reads `table`'s values while gradients reach the
    projection's FP64 inputs straight through that rounding (as `reference._silu_bf16_fp64` does for silu)."""
    from h3cute import reference

    exact = reference.adaln_projection_fp64(temb, proj_weight, proj_bias)
    rounded = exact + (table.double() - exact).detach()
    shift, scale = rounded.chunk(2, dim=-1)
    return reference.norm_modulate_fp64(x, norm_weight, shift, scale, timestep_indices, eps)
