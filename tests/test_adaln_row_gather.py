"""adaln_row_gather: host contracts (CPU) and, on a GPU, bitwise index_select parity, row independence,
deterministic and accurate table gradients, and 64-bit row offsets.
"""
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference
from h3cute.launch import adaln_row_gather as launch
from h3cute.widths import BLOCK_CHUNKS, HIDDEN as H

from bitwise import same_bits
from numerics import assert_table_sum
from poison import poison_allocator

BF16 = torch.bfloat16


def test_backward_checks_grads():
    g = torch.zeros(4, H, dtype=BF16)
    idx = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="expected 6 grads"):
        launch.backward([g] * 5, idx, 9)
    with pytest.raises(ValueError, match="contiguous"):
        launch.backward([g] * 5 + [torch.zeros(H, 4, dtype=BF16).t()], idx, 9)


# ---- GPU -----------------------------------------------------------------------------------------------

def _inputs(rows, seed=0, T=3):
    return [t.cuda() for t in reference.example_inputs("adaln_row_gather", rows, num_timesteps=T, seed=seed)]


def _table_grad_fp64(grads, idx, table_rows):
    return torch.cat([torch.zeros(table_rows, H, dtype=torch.float64, device="cuda").index_add_(0, idx, g.double())
                      for g in grads], dim=1)


def _rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 257, 4097])
def test_forward_is_index_select(rows):
    table, idx = _inputs(rows, seed=rows)
    poison_allocator()
    outs = torch.ops.h3.adaln_row_gather(table, idx)
    assert len(outs) == 6
    for out, ref in zip(outs, reference.adaln_row_gather_replay(table, idx)):
        assert out.is_contiguous() and same_bits(out, ref)


@pytest.mark.gpu
def test_forward_rows_depend_only_on_their_index():
    table, idx = _inputs(3000, seed=1)
    probe = 1234
    alone = torch.ops.h3.adaln_row_gather(table, idx[probe:probe + 1])
    for rows, pos in ((1, 0), (2, 1), (2049, 2048)):
        _, ib = _inputs(rows, seed=rows)
        ib[pos] = idx[probe]
        for a, b in zip(alone, torch.ops.h3.adaln_row_gather(table, ib)):
            assert same_bits(a[0], b[pos])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 44, 45, 49 * 3 + 1, 44 * 17, 4097])
def test_backward_matches_fp64_and_is_repeatable(rows):
    """44 * 17 rows: each of the 44 row groups has one 16-row step and one single-row tail step."""
    table, idx = _inputs(rows, seed=rows + 2)
    grads = [torch.randn(rows, H, device="cuda").to(BF16) for _ in range(BLOCK_CHUNKS)]
    poison_allocator()
    got = torch.ops.h3.adaln_row_gather_backward(grads, idx, table.shape[0])
    assert got.shape == table.shape and got.dtype == BF16 and not got.isnan().any()
    assert_table_sum(got, torch.cat([g.float() for g in grads], dim=1), idx, f"d_table, S={rows}")
    # rows of the table that no row selects get exact zeros
    unused = torch.ones(table.shape[0], dtype=torch.bool, device="cuda")
    unused[idx] = False
    assert not got[unused].any()
    assert same_bits(got, torch.ops.h3.adaln_row_gather_backward(grads, idx, table.shape[0]))


@pytest.mark.gpu
def test_autograd_uses_the_kernels():
    table, idx = _inputs(300, seed=5, T=4)
    leaf = table.clone().requires_grad_()
    outs = torch.ops.h3.adaln_row_gather(leaf, idx)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    assert same_bits(leaf.grad, torch.ops.h3.adaln_row_gather_backward(grads, idx, table.shape[0]))


@pytest.mark.gpu
def test_out_of_range_index_without_check_gives_nan_rows_only():
    table, idx = _inputs(64, seed=3)
    bad = idx.clone()
    bad[10] = -3
    outs = torch.ops.h3.adaln_row_gather(table, bad, False)
    keep = torch.arange(64, device="cuda") != 10
    for out, ref in zip(outs, reference.adaln_row_gather_replay(table, idx)):
        assert out[10].isnan().all() and same_bits(out[keep], ref[keep])
    grads = [torch.ones(64, H, dtype=BF16, device="cuda")] * 6
    d_table = torch.ops.h3.adaln_row_gather_backward(grads, bad, table.shape[0])
    assert _rel_err(d_table, _table_grad_fp64([g[keep] for g in grads], idx[keep], table.shape[0])) == 0


@pytest.mark.gpu
def test_64bit_row_offsets():
    rows = (1 << 19) + 1
    table, _ = _inputs(1)
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, table.shape[0], (rows,), device="cuda", generator=g)
    outs = torch.ops.h3.adaln_row_gather(table, idx)
    tail = slice(rows - 300, rows)
    for out, ref in zip(outs, reference.adaln_row_gather_replay(table, idx[tail])):
        assert same_bits(out[tail], ref)
    del outs
    grads = [torch.randn(rows, H, device="cuda", generator=g).to(BF16) for _ in range(2)] * 3
    got = torch.ops.h3.adaln_row_gather_backward(grads, idx, table.shape[0])
    for c in (0, 1):  # chunks 2..5 repeat these grads; the order is per column, so two column tiles stand for all
        for cols in (slice(c * H, c * H + 256), slice((c + 1) * H - 256, (c + 1) * H)):
            assert_table_sum(got[:, cols], grads[c][:, cols.start - c * H:cols.stop - c * H].float(), idx,
                             f"d_table columns {cols}, S=2^19+1")
    assert same_bits(got[:, :2 * H].repeat(1, 3), got)
