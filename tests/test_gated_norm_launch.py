"""The fused block path's launcher (src/h3cute/launch/gate_residual_norm_modulate.py) on a GPU: h and out bitwise
gate_residual's then norm_modulate's, every output element written, bad rows NaN and recorded, rows independent
of their neighbours, and the backward bitwise the two ops' chain under autograd."""
import pytest
import torch

import h3cute
from bitwise import assert_same_bits
from h3cute import reference
from h3cute.launch import gate_residual, gate_residual_norm_modulate as fused, norm_modulate
from h3cute.widths import HIDDEN as H, NORM_EPS

BF16 = torch.bfloat16
pytestmark = pytest.mark.gpu


def _inputs(rows, seed):
    res, w, shift, scale, idx = (t.cuda() for t in reference.example_inputs("norm_modulate", rows, seed=seed))
    g = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(rows, H, device="cuda", generator=g).to(BF16)
    gate = (torch.randn(9, H, device="cuda", generator=g) * 0.5).to(BF16)
    return res, y, gate, w, shift, scale, idx


@pytest.mark.parametrize("vec", [8, 4])  # both row layouts (kernels/norm_modulate.py ROW_VECS)
@pytest.mark.parametrize("rows", [1, 2, 63, 64, 65, 4097])
def test_forward_is_bitwise_the_two_ops(rows, vec):
    res, y, gate, w, shift, scale, idx = _inputs(rows, rows)
    junk = torch.full((8 * rows * H,), float("nan"), device="cuda")  # NaN left in the allocator's free blocks
    del junk
    h, out = fused.forward(res, y, gate, w, shift, scale, idx, vec=vec)
    assert not h.isnan().any() and not out.isnan().any()
    h_ref = gate_residual.forward(res, y, gate, idx)
    assert_same_bits(h, h_ref, "h")
    assert_same_bits(out, norm_modulate.forward(h_ref, w, shift, scale, idx), "out")
    assert torch.equal(h, reference.gate_residual_replay(res, y, gate, idx))
    assert torch.equal(out, reference.norm_modulate_replay(h, w, shift, scale, idx))


def test_rows_ignore_neighbours_and_bad_rows_are_recorded():
    res, y, gate, w, shift, scale, idx = _inputs(300, 7)
    probe = 123
    h1, o1 = fused.forward(res[probe:probe + 1], y[probe:probe + 1], gate, w, shift, scale, idx[probe:probe + 1])
    bad = idx.clone()
    bad[10], bad[200] = 9, -1
    res2 = res.clone()
    res2[probe + 1] = float("nan")
    h, out = fused.forward(res2, y, gate, w, shift, scale, bad)
    assert_same_bits(h[probe], h1[0], "h of the probe")
    assert_same_bits(out[probe], o1[0], "out of the probe")
    assert h[10].isnan().all() and out[200].isnan().all()
    with pytest.raises(IndexError, match=r"h3::gate_residual_norm_modulate: adaln_indices\[10\] is outside \[0, 9\)"):
        h3cute.check_errors()


@pytest.mark.parametrize("grad_h_used", [True, False])
def test_backward_is_the_two_ops_chain_under_autograd(grad_h_used):
    res, y, gate, w, shift, scale, idx = _inputs(1031, 11)
    g = torch.Generator(device="cuda").manual_seed(5)
    grad_out = torch.randn(1031, H, device="cuda", generator=g).to(BF16)
    grad_h = torch.randn(1031, H, device="cuda", generator=g).to(BF16) if grad_h_used else None
    h, _ = fused.forward(res, y, gate, w, shift, scale, idx)
    got = fused.backward(grad_h, grad_out, y, gate, h, w, scale, idx, NORM_EPS, 9)
    leaves = [t.clone().requires_grad_() for t in (res, y, gate, w, shift, scale)]
    h_chain = torch.ops.h3.gate_residual(leaves[0], leaves[1], leaves[2], idx)
    out_chain = torch.ops.h3.norm_modulate(h_chain, leaves[3], leaves[4], leaves[5], idx)
    outputs, grads = [out_chain], [grad_out]
    if grad_h_used:
        outputs.append(h_chain)
        grads.append(grad_h)
    torch.autograd.backward(outputs, grads)
    for name, a, leaf in zip(("d_residual", "dy", "dgate", "dweight", "dshift", "dscale"), got, leaves):
        assert_same_bits(a, leaf.grad, name)
