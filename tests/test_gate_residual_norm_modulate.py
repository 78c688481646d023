"""gate_residual_norm_modulate on CPU: its outputs and gradients are bitwise the two-op chain it fuses
(gate_residual, then norm_modulate of the result) with autograd's BF16 sum of h's two gradients, accurate against
FP64, opcheck with and without grad_h, and its input errors. The generic op tests (opcheck, fake, compile,
empty rows, missing launch module) run in test_ops.py."""
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference as R
from h3cute.widths import HIDDEN as H, NORM_EPS

ops = torch.ops.h3
BF16 = torch.bfloat16


def _inputs(rows=13, T=3, seed=2):
    return R.example_inputs("gate_residual_norm_modulate", rows, num_timesteps=T, seed=seed)


def _upstream(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, H, generator=g).to(BF16) for _ in range(2)]


def _leaves(args):
    return [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]


def _chain(residual, y, gate, weight, shift, scale, idx):
    h = ops.gate_residual(residual, y, gate, idx)
    return h, ops.norm_modulate(h, weight, shift, scale, idx)


def test_forward_is_bitwise_the_two_ops():
    a = _inputs()
    h, out = ops.gate_residual_norm_modulate(*a)
    ch, cout = _chain(*a)
    assert torch.equal(h, ch) and torch.equal(out, cout)
    assert not out.isnan().any()
    res, y, gate, w, shift, scale, idx = a
    assert torch.equal(out, R.norm_modulate_replay(R.gate_residual_replay(res, y, gate, idx), w, shift, scale, idx))


@pytest.mark.parametrize("used", ["both", "out", "h"])
def test_gradients_are_bitwise_the_two_op_chain(used):
    """Autograd through the fused op gives the chain's gradients bit for bit: with h consumed downstream too
    (grad_h + dx summed in BF16 as autograd sums them), through `out` alone, and through `h` alone."""
    a = _inputs(rows=17, seed=5)
    g_h, g_out = _upstream(17, 7)
    pick = {"both": (0, 1), "out": (1,), "h": (0,)}[used]
    grads = []
    for fn in (lambda *x: ops.gate_residual_norm_modulate(*x), _chain):
        leaves = _leaves(a)
        outs = fn(*leaves)
        torch.autograd.backward([outs[i] for i in pick], [(g_h, g_out)[i] for i in pick])
        grads.append([x.grad for x in leaves[:6]])
    fused, chain = grads
    for name, f, c in zip(("residual", "y", "gate", "weight", "shift", "scale"), fused, chain):
        assert (f is None) == (c is None), name
        assert f is None or torch.equal(f, c), (used, name)
    if used == "h":
        assert fused[3] is None and fused[4] is None and fused[5] is None


def test_backward_op_is_the_chain_of_backward_ops():
    res, y, gate, w, shift, scale, idx = _inputs(rows=9, seed=3)
    g_h, g_out = _upstream(9, 4)
    h, _ = ops.gate_residual_norm_modulate(res, y, gate, w, shift, scale, idx)
    d_res, dy, dgate, dw, dshift, dscale = ops.gate_residual_norm_modulate_backward(
        g_h, g_out, y, gate, h, w, scale, idx, NORM_EPS, 9)
    dx, dw2, dshift2, dscale2 = ops.norm_modulate_backward(g_out, h, w, scale, idx, NORM_EPS, 9)
    assert torch.equal(d_res, g_h + dx)
    assert d_res.dtype == BF16 and not torch.equal(d_res, dx)  # grad_h is in it
    dy2, dgate2 = ops.gate_residual_backward(d_res, y, gate, idx)
    for u, v in ((dy, dy2), (dgate, dgate2), (dw, dw2), (dshift, dshift2), (dscale, dscale2)):
        assert torch.equal(u, v)
    without = ops.gate_residual_norm_modulate_backward(None, g_out, y, gate, h, w, scale, idx, NORM_EPS, 9)
    assert torch.equal(without[0], dx)
    assert torch.equal(without[1], ops.gate_residual_backward(dx, y, gate, idx)[0])


def test_gradients_against_fp64():
    a = _inputs(rows=33, seed=6)
    ups = _upstream(33, 8)
    leaves = _leaves(a)
    torch.autograd.backward(list(ops.gate_residual_norm_modulate(*leaves)), ups)
    a64 = [x.detach().double().requires_grad_() if x.is_floating_point() else x for x in a]
    gold = R.gate_residual_norm_modulate_fp64(*a64)
    for o, g in zip(ops.gate_residual_norm_modulate(*a), gold):
        assert float((o.double() - g.detach()).abs().max() / g.detach().abs().max()) < 8e-3
    torch.autograd.backward(list(gold), [u.double() for u in ups])
    for x, x64 in zip(leaves[:6], a64[:6]):
        assert x.grad.dtype == x.dtype and not x.grad.isnan().any()
        err = float((x.grad.double() - x64.grad).abs().max() / x64.grad.abs().max())
        assert err < 1.2e-2, (tuple(x.shape), err)


def test_fp64_golden_normalizes_h_as_returned():
    res, y, gate, w, shift, scale, idx = _inputs(rows=5, seed=1)
    h64, out64 = R.gate_residual_norm_modulate_fp64(res, y, gate, w, shift, scale, idx)
    assert torch.equal(h64, R.gate_residual_fp64(res, y, gate, idx))
    assert torch.equal(out64, R.norm_modulate_fp64(h64.to(BF16), w, shift, scale, idx))


def test_opcheck_backward_without_grad_h():
    res, y, gate, w, shift, scale, idx = _inputs(rows=7, T=2, seed=1)
    h, _ = ops.gate_residual_norm_modulate(res, y, gate, w, shift, scale, idx)
    g_out = _upstream(7, 3)[1]
    torch.library.opcheck(ops.gate_residual_norm_modulate_backward.default,
                          [None, g_out, y, gate, h, w, scale, idx, NORM_EPS, 6])


def test_strided_block_table_chunks():
    res, y, _, w, _, _, idx = _inputs(rows=11, seed=4)
    table = R.example_inputs("adaln_row_gather", 1, num_timesteps=3, seed=4)[0]
    c = table.chunk(6, dim=-1)
    got = ops.gate_residual_norm_modulate(res, y, c[2], w, c[3], c[4], idx)
    want = ops.gate_residual_norm_modulate(res, y, c[2].contiguous(), w, c[3].contiguous(), c[4].contiguous(), idx)
    assert all(torch.equal(u, v) for u, v in zip(got, want))


# ---- bad input ---------------------------------------------------------------------------------------

OP = "h3::gate_residual_norm_modulate"


def test_forward_rejects():
    res, y, gate, w, shift, scale, idx = _inputs(rows=5, T=2)
    with pytest.raises(ValueError, match=rf"{OP}: residual has 4 rows, y has 5"):
        ops.gate_residual_norm_modulate(res[:4], y, gate, w, shift, scale, idx)
    with pytest.raises(TypeError, match=rf"{OP}: y must be bfloat16, got float32"):
        ops.gate_residual_norm_modulate(res, y.float(), gate, w, shift, scale, idx)
    with pytest.raises(TypeError, match=rf"{OP}: weight must be bfloat16, got float32"):
        ops.gate_residual_norm_modulate(res, y, gate, w.float(), shift, scale, idx)
    with pytest.raises(ValueError, match=rf"{OP}: shift has 3 rows, scale has 6"):
        ops.gate_residual_norm_modulate(res, y, gate, w, shift[:3], scale, idx)
    with pytest.raises(ValueError, match=rf"{OP}: scale has 3 rows, gate has 6"):
        ops.gate_residual_norm_modulate(res, y, gate, w, shift[:3], scale[:3], idx)
    with pytest.raises(ValueError, match=rf"{OP}: gate must have shape \(3T, {H}\), got \(6, 4096\)"):
        ops.gate_residual_norm_modulate(res, y, gate[:, :4096], w, shift, scale, idx)
    with pytest.raises(ValueError, match=rf"{OP}: scale must have unit-stride"):
        ops.gate_residual_norm_modulate(res, y, gate, w, shift, scale.t().contiguous().t(), idx)
    with pytest.raises(ValueError, match=rf"{OP}: residual must be contiguous"):
        ops.gate_residual_norm_modulate(torch.cat([res, res], 1)[:, ::2], y, gate, w, shift, scale, idx)
    with pytest.raises(ValueError, match=rf"{OP}: eps must be > 0, got nan"):
        ops.gate_residual_norm_modulate(res, y, gate, w, shift, scale, idx, float("nan"))
    with pytest.raises(TypeError, match=rf"{OP}: adaln_indices must be int64, got int32"):
        ops.gate_residual_norm_modulate(res, y, gate, w, shift, scale, idx.int())
    with pytest.raises(IndexError, match=rf"{OP}: adaln_indices\[4\] = 6 is outside \[0, 6\) \(the table has 6 rows"):
        ops.gate_residual_norm_modulate(res, y, gate, w, shift, scale, torch.tensor([0, 1, 2, 3, 6]))
    # check_indices=False skips only the value check (the kernels still never read out of bounds)
    ops.gate_residual_norm_modulate(res, y, gate, w, shift, scale, torch.tensor([0, 1, 2, 3, 5]), NORM_EPS, False)


def test_backward_rejects():
    res, y, gate, w, shift, scale, idx = _inputs(rows=5, T=2)
    g = torch.zeros_like(y)
    bwd = ops.gate_residual_norm_modulate_backward
    with pytest.raises(ValueError, match=rf"{OP}_backward: gate has 6 rows but table_rows = 9"):
        bwd(g, g, y, gate, res, w, scale, idx, NORM_EPS, 9)
    with pytest.raises(ValueError, match=rf"{OP}_backward: scale has 3 rows but table_rows = 6"):
        bwd(g, g, y, gate, res, w, scale[:3], idx, NORM_EPS, 6)
    with pytest.raises(ValueError, match=rf"{OP}_backward: grad_h has 4 rows, y has 5"):
        bwd(g[:4], g, y, gate, res, w, scale, idx, NORM_EPS, 6)
    with pytest.raises(ValueError, match=rf"{OP}_backward: grad_out has 4 rows, y has 5"):
        bwd(g, g[:4], y, gate, res, w, scale, idx, NORM_EPS, 6)
    with pytest.raises(TypeError, match=rf"{OP}_backward: h must be bfloat16, got float32"):
        bwd(g, g, y, gate, res.float(), w, scale, idx, NORM_EPS, 6)
