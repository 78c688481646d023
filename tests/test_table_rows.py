"""Per-row results never depend on T: every row op's outputs and per-row gradients are bitwise the same whatever
the number of timesteps in the call, i.e. however many rows its tables hold (unused rows padded at the
boundaries of the backward layouts: fused caps 12 / 24, the two-kernel path to 48, windows beyond), and the
table gradients stay FP32 fixed-order sums at every size (GPU). The host-side layout rules are checked on CPU.
"""
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from bitwise import assert_same_bits, same_bits
from h3cute import reference
from h3cute.launch import norm_modulate as launch
from h3cute.widths import BLOCK_CHUNKS, BLOCK_TABLE, FINAL_PROJECTION, HIDDEN as H, NORM_EPS, TEMB

BF16 = torch.bfloat16
USED = 3  # table rows the rows address: one timestep, three modalities
# 3: the fused backward (cap 12); 24: its largest table; 25 and 48: bwd_rows + bwd_params; 49, 6144: windows
TABLE_ROWS = (3, 24, 25, 48, 49, 6144)


# ---- CPU: the reduction layout ------------------------------------------------------------------------

def test_reduction_layout_windows_beyond_48_rows(monkeypatch):
    monkeypatch.setattr(launch, "row_groups", lambda device: launch.ROW_GROUPS["sm_90a"])  # the H200's P
    dev = torch.device("cpu")
    assert launch.reduction_layout(9, dev) == (12, 1, 44)
    assert launch.reduction_layout(24, dev) == (24, 1, 44)
    assert launch.reduction_layout(48, dev) == (48, 1, 44)
    assert launch.reduction_layout(49, dev) == (48, 2, 43)
    assert launch.reduction_layout(6144, dev) == (48, 128, 1)
    for rows in range(49, 7000, 37):
        cap, windows, groups = launch.reduction_layout(rows, dev)
        assert cap * windows >= rows > cap * (windows - 1)  # every table row in exactly one window
        assert groups >= 1 and (groups == 1 or groups * rows <= 44 * 48)  # partials within the plain bound


def test_table_rows_cap():
    assert [launch.table_rows_cap(r) for r in (1, 12, 13, 24, 25, 48, 49, 6144)] == [12, 12, 24, 24, 48, 48, 48, 48]


# ---- GPU -----------------------------------------------------------------------------------------------

def _padded(table, rows, seed):
    """`table` (USED rows) followed by rows - USED random rows no index reaches (first `rows` when fewer)."""
    if rows <= table.shape[0]:
        return table[:rows].contiguous()
    g = torch.Generator(device="cuda").manual_seed(seed)
    pad = torch.randn(rows - table.shape[0], table.shape[1], device="cuda", generator=g).to(BF16)
    return torch.cat([table, pad])


def _rows(seed, rows=1031):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, H, device="cuda", generator=g) * 2).to(BF16)
    grad = torch.randn(rows, H, device="cuda", generator=g).to(BF16)
    idx = torch.randint(0, USED, (rows,), device="cuda", generator=g)
    return x, grad, idx, g


def _rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
def test_norm_modulate_rows_ignore_table_rows():
    x, grad, idx, g = _rows(1)
    w = (0.5 + torch.rand(H, device="cuda", generator=g)).to(BF16)
    shift = torch.randn(USED, H, device="cuda", generator=g).to(BF16)
    scale = (torch.randn(USED, H, device="cuda", generator=g) * 0.5).to(BF16)
    first = None
    for rows in TABLE_ROWS:
        sh, sc = _padded(shift, rows, 2), _padded(scale, rows, 3)
        leaves = [t.clone().requires_grad_() for t in (x, w, sh, sc)]
        out = torch.ops.h3.norm_modulate(*leaves, idx)
        out.backward(grad)
        dx, dw, dsh, dsc = (t.grad for t in leaves)
        for name, t in (("out", out), ("dx", dx), ("dweight", dw), ("dshift", dsh), ("dscale", dsc)):
            assert not t.isnan().any(), (rows, name)
        assert not dsh[USED:].any() and not dsc[USED:].any(), rows  # unused table rows: exact zeros
        ref = [t.double().requires_grad_() for t in (x, w, shift, scale)]
        reference.norm_modulate_fp64(*ref, idx).backward(grad.double())
        checked = (("dweight", dw, ref[1]), ("dshift", dsh[:USED], ref[2]), ("dscale", dsc[:USED], ref[3]))
        for name, got, leaf in checked:
            assert _rel_err(got, leaf.grad) < 1e-2, (rows, name)
        if first is None:
            first = (out.detach(), dx)
            continue
        assert_same_bits(out.detach(), first[0], f"out at {rows} table rows")
        assert_same_bits(dx, first[1], f"dx at {rows} table rows")


@pytest.mark.gpu
def test_gate_residual_rows_ignore_table_rows():
    x, grad, idx, g = _rows(4)
    y = torch.randn_like(x)
    gate = torch.randn(USED, H, device="cuda", generator=g).to(BF16)
    first = None
    for rows in TABLE_ROWS:
        leaves = [t.clone().requires_grad_() for t in (x, y, _padded(gate, rows, 5))]
        out = torch.ops.h3.gate_residual(*leaves, idx)
        out.backward(grad)
        dres, dy, dgate = (t.grad for t in leaves)
        assert not dgate[USED:].any(), rows
        ref = torch.zeros(USED, H, dtype=torch.float64, device="cuda").index_add_(0, idx, grad.double() * y.double())
        assert _rel_err(dgate[:USED], ref) < 1e-2, rows
        if first is None:
            first = (out.detach(), dy)
            continue
        assert_same_bits(out.detach(), first[0], f"out at {rows} table rows")
        assert_same_bits(dy, first[1], f"dy at {rows} table rows")


@pytest.mark.gpu
def test_row_gather_rows_ignore_table_rows():
    _, _, idx, g = _rows(6)
    table = torch.randn(USED, BLOCK_TABLE, device="cuda", generator=g).to(BF16)
    grads = [torch.randn(idx.shape[0], H, device="cuda", generator=g).to(BF16) for _ in range(BLOCK_CHUNKS)]
    first = None
    for rows in TABLE_ROWS:
        leaf = _padded(table, rows, 7).requires_grad_()
        outs = torch.ops.h3.adaln_row_gather(leaf, idx)
        torch.autograd.backward(outs, grads)
        assert not leaf.grad[USED:].any(), rows
        ref = torch.cat([torch.zeros(USED, H, dtype=torch.float64, device="cuda").index_add_(0, idx, gr.double())
                         for gr in grads], dim=1)
        assert _rel_err(leaf.grad[:USED], ref) < 1e-2, rows
        outs = [o.detach() for o in outs]
        if first is None:
            first = outs
            continue
        assert same_bits(outs, first), rows


@pytest.mark.gpu
@pytest.mark.parametrize("timesteps", [(1, 8, 9, 24, 25, 48, 49), (1, 2048)])
def test_final_adaln_out_rows_ignore_timesteps(timesteps):
    """final_adaln_out's table has one row per timestep: an unused timestep appended to temb changes no row's out
    or dx (the C++ backward up to T = 24, the two-kernel and windowed paths beyond)."""
    x, grad, _, g = _rows(8)
    ti = torch.zeros(x.shape[0], dtype=torch.int64, device="cuda")  # every row on timestep 0
    nw = (0.5 + torch.rand(H, device="cuda", generator=g)).to(BF16)
    pw = (torch.randn(FINAL_PROJECTION, TEMB, device="cuda", generator=g) * TEMB ** -0.5).to(BF16)
    pb = (torch.randn(FINAL_PROJECTION, device="cuda", generator=g) * 0.02).to(BF16)
    temb = torch.randn(max(timesteps), TEMB, device="cuda", generator=g)
    first = None
    for t in timesteps:
        leaves = [x.clone().requires_grad_(), nw.clone().requires_grad_(), temb[:t].clone().requires_grad_()]
        out = torch.ops.h3.final_adaln_out(leaves[0], leaves[1], leaves[2], pw, pb, ti)
        out.backward(grad)
        dx = leaves[0].grad
        assert not dx.isnan().any() and not out.isnan().any(), t
        assert not leaves[2].grad[1:].any(), t  # unused timesteps: d_temb exactly zero
        if first is None:
            first = (out.detach(), dx)
            continue
        assert_same_bits(out.detach(), first[0], f"out at T = {t}")
        assert_same_bits(dx, first[1], f"dx at T = {t}")


@pytest.mark.gpu
@pytest.mark.parametrize("table_rows", [49, 100, 6144])
def test_windowed_table_gradients(table_rows):
    """Indices spread over every row of a large table: the windowed reductions against FP64, unused rows zero,
    rows with a bad index adding nothing (their dx / dy NaN), bitwise repeatable."""
    rows = 4097
    x, grad, _, g = _rows(9, rows)
    idx = torch.randint(0, table_rows, (rows,), device="cuda", generator=g)
    idx[7::101] = table_rows  # out of range
    idx[11::211] = -1
    keep = (idx >= 0) & (idx < table_rows)
    w = (0.5 + torch.rand(H, device="cuda", generator=g)).to(BF16)
    scale = (torch.randn(table_rows, H, device="cuda", generator=g) * 0.5).to(BF16)
    y = torch.randn_like(x)
    gate = torch.randn(table_rows, H, device="cuda", generator=g).to(BF16)
    runs = []
    for _ in range(2):
        nm = torch.ops.h3.norm_modulate_backward(grad, x, w, scale, idx, NORM_EPS, table_rows)
        gr = torch.ops.h3.gate_residual_backward(grad, y, gate, idx)
        ga = torch.ops.h3.adaln_row_gather_backward([grad] * 6, idx, table_rows)
        runs.append((*nm, *gr, ga))
    assert same_bits(runs[0], runs[1])
    dx, dw, dsh, dsc, dy, dgate, dtable = runs[0]
    assert dx[~keep].isnan().all() and dy[~keep].isnan().all()
    assert not dx[keep].isnan().any() and not dy[keep].isnan().any()
    leaves = [t.double().requires_grad_() for t in (x[keep], w)]
    sh = torch.zeros(table_rows, H, dtype=torch.float64, device="cuda").requires_grad_()
    sc = scale.double().requires_grad_()
    reference.norm_modulate_fp64(leaves[0], leaves[1], sh, sc, idx[keep]).backward(grad[keep].double())
    for name, got, ref in (("dweight", dw, leaves[1].grad), ("dshift", dsh, sh.grad), ("dscale", dsc, sc.grad)):
        assert not got.isnan().any(), name
        assert _rel_err(got, ref) < 1e-2, name
    ref = torch.zeros(table_rows, H, dtype=torch.float64, device="cuda")
    ref.index_add_(0, idx[keep], grad[keep].double() * y[keep].double())
    assert _rel_err(dgate, ref) < 1e-2
    ref = torch.zeros(table_rows, H, dtype=torch.float64, device="cuda").index_add_(0, idx[keep], grad[keep].double())
    assert _rel_err(dtable, ref.repeat(1, 6)) < 1e-2
    untouched = torch.ones(table_rows, dtype=torch.bool, device="cuda")
    untouched[idx[keep]] = False
    for t in (dsh, dsc, dgate, dtable):
        assert not t[untouched].any()


@pytest.mark.gpu
def test_table_rows_check_has_power():
    """Negative control: the bitwise comparison above does see a path that sums a row in another order. The
    replay's autograd (torch's own rms_norm backward) gives dx that differs from ours in some rows while both
    meet the FP64 bound: were the paths' sums ordered differently, assert_same_bits would fail the same way."""
    x, grad, idx, g = _rows(10)
    w = (0.5 + torch.rand(H, device="cuda", generator=g)).to(BF16)
    shift = torch.randn(USED, H, device="cuda", generator=g).to(BF16)
    scale = (torch.randn(USED, H, device="cuda", generator=g) * 0.5).to(BF16)
    ours = torch.ops.h3.norm_modulate_backward(grad, x, w, scale, idx, NORM_EPS, USED)[0]
    xr = x.clone().requires_grad_()
    reference.norm_modulate_replay(xr, w, shift, scale, idx).backward(grad)
    with pytest.raises(AssertionError, match="elements differ"):
        assert_same_bits(ours, xr.grad, "dx against torch's autograd")
