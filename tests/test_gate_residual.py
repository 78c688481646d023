"""gate_residual: host contracts (CPU) and, on a GPU, bitwise parity with `residual + gate[idx] * y`, torch's
BF16 dy bits, FP64 accuracy of dgate, batch invariance, deterministic dgate and 64-bit row offsets.
"""
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference
from h3cute.launch import gate_residual as launch
from h3cute.widths import BLOCK_TABLE, HIDDEN as H

from bitwise import same_bits
from numerics import assert_table_sum
from poison import poison_allocator

BF16 = torch.bfloat16


def test_forward_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="differ"):
        launch.forward(torch.zeros(3, H, dtype=BF16), torch.zeros(2, H, dtype=BF16), torch.zeros(9, H, dtype=BF16),
                       torch.zeros(2, dtype=torch.int64))


# ---- GPU -----------------------------------------------------------------------------------------------

def _inputs(rows, seed=0, T=3):
    return [t.cuda() for t in reference.example_inputs("gate_residual", rows, num_timesteps=T, seed=seed)]


def _rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 257, 4097])
def test_forward_is_bitwise_the_replay(rows):
    res, y, gate, idx = _inputs(rows, seed=rows)
    poison_allocator()
    out = torch.ops.h3.gate_residual(res, y, gate, idx)
    assert not out.isnan().any()
    assert same_bits(out, reference.gate_residual_replay(res, y, gate, idx))
    assert _rel_err(out, reference.gate_residual_fp64(res, y, gate, idx)) < 8e-3


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 44, 45, 44 * 7 + 1, 4097])
def test_backward_bits_accuracy_and_repeatability(rows):
    res, y, gate, idx = _inputs(rows, seed=rows + 1)
    grad = torch.randn_like(y)
    poison_allocator()
    dy, dgate = torch.ops.h3.gate_residual_backward(grad, y, gate, idx)
    assert not dy.isnan().any() and not dgate.isnan().any()
    # dy is torch autograd's BF16 product exactly
    leaves = [t.clone().requires_grad_() for t in (res, y, gate)]
    reference.gate_residual_replay(*leaves, idx).backward(grad)
    assert same_bits(dy, leaves[1].grad)
    assert same_bits(leaves[0].grad, grad)
    assert_table_sum(dgate, grad.float() * y.float(), idx, f"dgate, S={rows}")  # the products are exact in FP32
    again = torch.ops.h3.gate_residual_backward(grad, y, gate, idx)
    assert same_bits(dy, again[0]) and same_bits(dgate, again[1])


@pytest.mark.gpu
def test_autograd_uses_the_kernels():
    res, y, gate, idx = _inputs(100, seed=4)
    leaves = [t.clone().requires_grad_() for t in (res, y, gate)]
    out = torch.ops.h3.gate_residual(*leaves, idx)
    grad = torch.randn_like(out)
    out.backward(grad)
    dy, dgate = torch.ops.h3.gate_residual_backward(grad, y, gate, idx)
    assert same_bits(leaves[0].grad, grad)
    assert same_bits(leaves[1].grad, dy) and same_bits(leaves[2].grad, dgate)


@pytest.mark.gpu
@pytest.mark.parametrize("junk", [float("nan"), float("inf"), 1e30])
def test_probe_row_bits_ignore_other_rows(junk):
    res, y, gate, idx = _inputs(300, seed=6)
    grad = torch.randn_like(y)
    probe = 150
    one = slice(probe, probe + 1)
    alone = torch.ops.h3.gate_residual(res[one], y[one], gate, idx[one])[0]
    dy_alone = torch.ops.h3.gate_residual_backward(grad[one], y[one], gate, idx[one])[0][0]
    mask = torch.ones(300, dtype=torch.bool, device="cuda")
    mask[probe] = False
    res_b, y_b, g_b = res.clone(), y.clone(), grad.clone()
    res_b[mask], y_b[mask], g_b[mask] = junk, junk, junk
    assert same_bits(torch.ops.h3.gate_residual(res_b, y_b, gate, idx)[probe], alone)
    assert same_bits(torch.ops.h3.gate_residual_backward(g_b, y_b, gate, idx)[0][probe], dy_alone)


@pytest.mark.gpu
def test_out_of_range_index_without_check_gives_nan_rows_only():
    res, y, gate, idx = _inputs(64, seed=2)
    bad = idx.clone()
    bad[3] = 1000
    out = torch.ops.h3.gate_residual(res, y, gate, bad, False)
    assert out[3].isnan().all()
    keep = torch.arange(64, device="cuda") != 3
    assert same_bits(out[keep], reference.gate_residual_replay(res, y, gate, idx)[keep])


@pytest.mark.gpu
def test_strided_gate_table():
    res, y, _, idx = _inputs(500, seed=7)
    table = (torch.randn(9, BLOCK_TABLE, device="cuda") * 0.5).to(BF16)
    gate = table[:, 2 * H:3 * H]
    out = torch.ops.h3.gate_residual(res, y, gate, idx)
    assert same_bits(out, reference.gate_residual_replay(res, y, gate, idx))
    grad = torch.randn_like(y)
    dy, dgate = launch.backward(grad, y, gate, idx)
    dy_c, dgate_c = launch.backward(grad, y, gate.contiguous(), idx)
    assert same_bits(dy, dy_c) and same_bits(dgate, dgate_c)


@pytest.mark.gpu
def test_64bit_row_offsets():
    rows = (1 << 19) + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(rows, H, device="cuda", generator=g).to(BF16)
    res = y.roll(7, 0)
    gate = _inputs(1)[2]
    idx = torch.randint(0, 9, (rows,), device="cuda", generator=g)
    out = torch.ops.h3.gate_residual(res, y, gate, idx)
    tail = slice(rows - 300, rows)
    assert same_bits(out[tail], reference.gate_residual_replay(res[tail], y[tail], gate, idx[tail]))
    del out
    dy, dgate = torch.ops.h3.gate_residual_backward(res, y, gate, idx)
    assert same_bits(dy[tail], (res[tail] * gate[idx[tail]]))
    for cols in (slice(0, 256), slice(H - 256, H)):  # the order is per column: two column tiles stand for all
        assert_table_sum(dgate[:, cols], res[:, cols].float() * y[:, cols].float(), idx, f"dgate columns {cols}")
