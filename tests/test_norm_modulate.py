"""norm_modulate: the kernels' reduction order (CPU), host-side contracts (CPU) and, on a GPU, bitwise parity
with the diffusers replay, FP64 accuracy, batch invariance, deterministic parameter gradients, strided tables
and 64-bit row offsets.
"""
import numpy as np
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference
from h3cute.launch import norm_modulate as launch
from h3cute.widths import FINAL_PROJECTION, HIDDEN as H, NORM_EPS

from bitwise import bits, same_bits
from numerics import assert_norm_modulate_backward, assert_within, one_rounding
from poison import poison_allocator

BF16 = torch.bfloat16


# ---- CPU: the torch-order sum of squares ---------------------------------------------------------------

def _fma32(a, b, c):
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _torch_fused_sumsq(x):
    """torch's vectorized rms_norm (layer_norm_kernel.cu compute_stats): a (32, 4) block, thread t summing
    fma(v, v, acc) over 4-element chunks t, t + 128, ...; shfl_down tree over lanes, tree over the 4 warps."""
    chunks = x.reshape(-1, 4)
    acc = [np.float32(0)] * 128
    for t in range(128):
        for c in range(t, len(chunks), 128):
            for v in chunks[c]:
                acc[t] = _fma32(v, v, acc[t])
    warps = []
    for w in range(4):
        lanes = acc[32 * w: 32 * w + 32]
        for off in (16, 8, 4, 2, 1):
            lanes = [np.float32(lanes[i] + lanes[i + off]) if i + off < 32 else lanes[i] for i in range(32)]
        warps.append(lanes[0])
    for off in (2, 1):
        warps = [np.float32(warps[i] + warps[i + off]) for i in range(off)] + warps[off:]
    return warps[0]


def _kernel_sumsq(x):
    """kernels/rowwise.torch_sumsq in a 64-thread CTA: thread u sums low / high halves of its 8-element
    vectors u, u + 64, ...; xor butterflies 8..1 in each half-warp; lo + hi; 4 warp sums folded 2, 1."""
    vecs = x.reshape(-1, 8)
    lo, hi = [np.float32(0)] * 64, [np.float32(0)] * 64
    for u in range(64):
        for v in range(u, len(vecs), 64):
            for e in vecs[v][:4]:
                lo[u] = _fma32(e, e, lo[u])
            for e in vecs[v][4:]:
                hi[u] = _fma32(e, e, hi[u])
    for off in (8, 4, 2, 1):
        lo = [np.float32(lo[u] + lo[u ^ off]) for u in range(64)]
        hi = [np.float32(hi[u] + hi[u ^ off]) for u in range(64)]
    w = [np.float32(lo[16 * i] + hi[16 * i]) for i in range(4)]
    for half in (2, 1):
        w = [np.float32(w[i] + w[i + half]) for i in range(half)]
    return w[0]


def _kernel_sumsq_v4(x):
    """kernels/rowwise.torch_sumsq_v4 in a 128-thread CTA of 4-vectors: thread t sums its chunks t, t + 128, ...;
    xor butterfly 16..1 over each warp; the 4 warp sums folded 2, 1."""
    chunks = x.reshape(-1, 4)
    acc = [np.float32(0)] * 128
    for t in range(128):
        for c in range(t, len(chunks), 128):
            for e in chunks[c]:
                acc[t] = _fma32(e, e, acc[t])
    for off in (16, 8, 4, 2, 1):
        acc = [np.float32(acc[t] + acc[t ^ off]) for t in range(128)]
    w = [acc[32 * i] for i in range(4)]
    for half in (2, 1):
        w = [np.float32(w[i] + w[i + half]) for i in range(half)]
    return w[0]


def _wide_range_row(seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(H) * np.exp2(rng.integers(-12, 12, H))).astype(np.float32)
    return torch.from_numpy(x).to(BF16).float().numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_reduction_order_is_torch_fused_rms_norm_order(seed):
    x = _wide_range_row(seed)
    assert _kernel_sumsq(x).tobytes() == _torch_fused_sumsq(x).tobytes()
    assert _kernel_sumsq_v4(x).tobytes() == _torch_fused_sumsq(x).tobytes()  # the 128-thread row layout


def test_reduction_order_check_has_power():
    """A plausible wrong order (one partial per thread, low and high halves merged) must differ somewhere,
    or the bitwise check above would prove nothing."""
    def merged_halves(x):
        vecs = x.reshape(-1, 8)
        acc = [np.float32(0)] * 64
        for u in range(64):
            for v in range(u, len(vecs), 64):
                for e in vecs[v]:
                    acc[u] = _fma32(e, e, acc[u])
        for off in (16, 8, 4, 2, 1):
            acc = [np.float32(acc[u] + acc[u ^ off]) for u in range(64)]
        return np.float32(acc[0] + acc[32])

    xs = [_wide_range_row(seed) for seed in range(3)]
    assert any(merged_halves(x) != _torch_fused_sumsq(x) for x in xs)



# 2 x rows of a step: 16 (the most it takes), 8 (FUSED_STEP), a tail row
@pytest.mark.parametrize("values", [32, 16, 2])
def test_fused_warp_reduce_scatter_is_the_xor_butterfly(values):
    """The fused backward's warp sums (kernels/norm_modulate._fused_step): a reduce-scatter over offsets
    16..1, lane l ending with value l // (32 / values), must give the xor all-reduce's bits for every value."""
    rng = np.random.default_rng(values)
    lanes = (rng.standard_normal((32, values)) * np.exp2(rng.integers(-20, 20, (32, values)))).astype(np.float32)
    allreduce = lanes.copy()
    for off in (16, 8, 4, 2, 1):
        allreduce = allreduce + allreduce[np.arange(32) ^ off]
    held = [list(row) for row in lanes]
    for off in (16, 8, 4, 2, 1):
        half = len(held[0]) // 2
        if half == 0:
            held = [[held[lane][0] + held[lane ^ off][0]] for lane in range(32)]
            continue
        upper = [bool(lane & off) for lane in range(32)]
        keep = [held[lane][half:] if upper[lane] else held[lane][:half] for lane in range(32)]
        send = [held[lane][:half] if upper[lane] else held[lane][half:] for lane in range(32)]
        held = [[np.float32(k + r) for k, r in zip(keep[lane], send[lane ^ off])] for lane in range(32)]
    spread = 32 // values
    for lane in range(0, 32, spread):
        assert held[lane][0].tobytes() == allreduce[0, lane // spread].tobytes()

def test_launch_constants_match_kernels():
    from h3cute.runtime.sources import kernels_package

    kernels_package()
    from h3cute.kernels import rowwise

    assert launch.TABLE_ROWS_CAPS == rowwise.TABLE_ROWS_CAPS
    assert launch.COL_TILE == rowwise.COL_TILE
    assert H % rowwise.COL_TILE == 0
    from h3cute.kernels import norm_modulate as kernel

    assert launch.FUSED_CAPS == kernel.FUSED_CAPS and launch.FUSED_CLUSTER == kernel.CLUSTER
    assert launch.FUSED_VEC == kernel.FUSED_VEC
    assert launch.FUSED_STEP in kernel.FUSED_STEPS and launch.FUSED_STEPS_BUNDLED == kernel.FUSED_STEPS
    assert H % (kernel.FUSED_VEC * 32 * kernel.CLUSTER) == 0  # whole warps per column slice
    for arch, groups in launch.FUSED_ROW_GROUPS.items():
        assert sorted(groups) == sorted(kernel.FUSED_CAPS), arch


def test_tables_are_read_in_place_when_aligned_else_copied():
    table = torch.zeros(3, 2 * H, dtype=BF16)
    for half in (table[:, :H], table[:, H:]):  # final_adaln_out's shift | scale: read in place
        assert launch.table_view("final_adaln_out", "shift", half, H) is half
    for odd in (table[:, ::2], table[:, 1:H + 1]):  # non-unit stride, rows not 16-byte aligned: compact copy
        view = launch.table_view("norm_modulate", "scale", odd, H)
        assert view.is_contiguous() and view.data_ptr() % 16 == 0 and torch.equal(view, odd)
    with pytest.raises(ValueError, match="BF16 table"):
        launch.table_view("norm_modulate", "scale", table[:, :H].float(), H)
    with pytest.raises(ValueError, match="contiguous"):
        launch.check_rows("norm_modulate", "x", torch.zeros(H, 4, dtype=BF16).t(), H)


# ---- GPU -----------------------------------------------------------------------------------------------

def _inputs(rows, seed=0, T=3):
    return [t.cuda() for t in reference.example_inputs("norm_modulate", rows, num_timesteps=T, seed=seed)]


def _rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 255, 256, 257, 4097])
def test_forward_is_bitwise_the_replay(rows):
    x, w, shift, scale, idx = _inputs(rows, seed=rows)
    poison_allocator()
    out = torch.ops.h3.norm_modulate(x, w, shift, scale, idx)
    assert not out.isnan().any()
    replay = reference.norm_modulate_replay(x, w, shift, scale, idx)
    differ = bits(out) != bits(replay)  # -0.0 and +0.0 differ too
    # A mismatch here (with the FP64 bound below still met) means torch's fused rms_norm summed x^2 in
    # another order than kernels/rowwise.torch_sumsq models (a torch build with another block shape).
    assert not differ.any(), (f"{int(differ.sum())} elements in {int(differ.any(1).sum())} of {rows} rows differ "
                              f"from the replay (torch {torch.__version__})")
    assert _rel_err(out, reference.norm_modulate_fp64(x, w, shift, scale, idx)) < 1.6e-2  # 4 BF16 roundings


@pytest.mark.gpu
def test_forward_strided_tables_and_timestep_indices():
    """final_adaln_out's reuse: shift | scale are the halves of a (T, 2H) tensor, indices are timesteps."""
    x, w, _, _, _ = _inputs(1000, seed=11)
    T = 4
    proj = (torch.randn(T, FINAL_PROJECTION, device="cuda") * 0.5).to(BF16)
    ti = torch.randint(0, T, (1000,), device="cuda")
    out = launch.forward_rows(x, w, proj[:, :H], proj[:, H:], ti, NORM_EPS)
    assert same_bits(out, reference.norm_modulate_replay(x, w, proj[:, :H], proj[:, H:], ti))
    grad = torch.randn_like(x)
    got = launch.backward_rows(grad, x, w, proj[:, H:], ti, NORM_EPS)
    assert got[2].shape == got[3].shape == (T, H)
    for a, b in zip(got, launch.backward_rows(grad, x, w, proj[:, H:].contiguous(), ti, NORM_EPS)):
        assert same_bits(a, b)
    odd = proj[:, 1:H + 1]  # rows not 16-byte aligned: copied compact, same bits
    assert same_bits(launch.forward_rows(x, w, odd, odd, ti, NORM_EPS),
                     reference.norm_modulate_replay(x, w, odd, odd, ti))


@pytest.mark.gpu
@pytest.mark.parametrize("junk", [float("nan"), float("inf"), 1e30])
def test_probe_row_bits_ignore_other_rows(junk):
    x, w, shift, scale, idx = _inputs(513, seed=5)
    grad = torch.randn_like(x)
    probe = 300
    alone = torch.ops.h3.norm_modulate(x[probe:probe + 1], w, shift, scale, idx[probe:probe + 1])
    dx_alone = torch.ops.h3.norm_modulate_backward(grad[probe:probe + 1], x[probe:probe + 1], w, scale,
                                                   idx[probe:probe + 1], NORM_EPS, scale.shape[0])[0]
    x_bad, g_bad = x.clone(), grad.clone()
    keep = torch.zeros(513, dtype=torch.bool, device="cuda")
    keep[probe] = True
    x_bad[~keep] = junk
    g_bad[~keep] = junk
    for xs, gs in ((x, grad), (x_bad, g_bad)):
        out = torch.ops.h3.norm_modulate(xs, w, shift, scale, idx)
        dx = torch.ops.h3.norm_modulate_backward(gs, xs, w, scale, idx, NORM_EPS, scale.shape[0])[0]
        assert same_bits(out[probe], alone[0])
        assert same_bits(dx[probe], dx_alone[0])
    # the probe at other positions of batches of other sizes
    for rows, pos in ((2, 1), (64, 0), (2049, 1000), (2049, 2048)):
        xb, _, _, _, ib = _inputs(rows, seed=rows)
        xb[pos], ib[pos] = x[probe], idx[probe]
        gb = torch.randn_like(xb)
        gb[pos] = grad[probe]
        assert same_bits(torch.ops.h3.norm_modulate(xb, w, shift, scale, ib)[pos], alone[0])
        dxb = torch.ops.h3.norm_modulate_backward(gb, xb, w, scale, ib, NORM_EPS, scale.shape[0])[0]
        assert same_bits(dxb[pos], dx_alone[0])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16, 17, 43, 44, 45, 44 * 7 + 1, 32 * 8 + 3, 32 * 24, 32 * 16 + 1,
                                  32 * 33 + 31, 4097])
def test_backward_matches_fp64_and_is_repeatable(rows):
    """Row counts around both backward layouts' boundaries: 44 row groups of the two-kernel path, 32 clusters
    x 8-row exchange steps (+ single-row tail steps) of the fused one."""
    x, w, shift, scale, idx = _inputs(rows, seed=rows + 1)
    grad = torch.randn_like(x)
    poison_allocator()
    got = torch.ops.h3.norm_modulate_backward(grad, x, w, scale, idx, NORM_EPS, scale.shape[0])
    assert_norm_modulate_backward(got, grad, x, w, shift, scale, idx, f"S={rows}")
    again = torch.ops.h3.norm_modulate_backward(grad, x, w, scale, idx, NORM_EPS, scale.shape[0])
    for a, b in zip(got, again):
        assert same_bits(a, b)


@pytest.mark.gpu
def test_fused_backward_dx_ignores_step_slot_and_neighbours():
    """The fused backward reduces 8 rows per cluster exchange, single rows at a group's tail: a probe row's
    dx is bitwise the same in every slot of a step, in a tail step, and next to NaN rows."""
    x, w, _, scale, idx = _inputs(513, seed=21)  # 32 groups of 17 rows: two 8-row steps + one tail row each
    grad = torch.randn_like(x)
    probe = 100
    alone = launch.backward_rows(grad[probe:probe + 1], x[probe:probe + 1], w, scale, idx[probe:probe + 1], NORM_EPS)[0]
    for pos in list(range(17)) + [33, 512]:
        xb, gb, ib = x.clone(), grad.clone(), idx.clone()
        xb[pos], gb[pos], ib[pos] = x[probe], grad[probe], idx[probe]
        if pos % 2:
            xb[pos - 1] = float("nan")  # a NaN neighbour in the same exchange step
        dx = launch.backward_rows(gb, xb, w, scale, ib, NORM_EPS)[0]
        assert same_bits(dx[pos], alone[0]), pos


@pytest.mark.gpu
@pytest.mark.parametrize("table_rows", [9, 20])
def test_fused_and_two_kernel_backward_agree(table_rows):
    """9 or 20 table rows take the fused backward (caps 12, 24); the same rows with the table padded to 30
    rows (no index reaches the padding) take bwd_rows + bwd_params. dx is bitwise the same (bwd_rows sums in
    the fused order); the parameter gradients are FP32 sums in other orders: within 2 BF16 ulps of the largest
    element."""
    x, w, _, _, _ = _inputs(3000, seed=22)
    scale = (torch.randn(table_rows, H, device="cuda") * 0.5).to(BF16)
    idx = torch.randint(0, table_rows, (3000,), device="cuda")
    grad = torch.randn_like(x)
    fused = launch.backward_rows(grad, x, w, scale, idx, NORM_EPS)
    padded = torch.cat([scale, torch.randn(30 - table_rows, H, device="cuda").to(BF16)])
    split = launch.backward_rows(grad, x, w, padded, idx, NORM_EPS)
    assert not split[2][table_rows:].any() and not split[3][table_rows:].any()
    used = (split[0], split[1], split[2][:table_rows], split[3][:table_rows])
    assert torch.equal(fused[0].view(torch.int16), split[0].view(torch.int16))
    for name, a, b in zip(("dx", "dweight", "dshift", "dscale"), fused, used):
        assert not a.isnan().any(), name
        assert _rel_err(a, b.double()) <= 2.0 ** -7, name  # 2 BF16 ulps of the largest element


@pytest.mark.gpu
def test_autograd_and_unused_table_rows():
    x, w, shift, scale, idx = _inputs(300, seed=3, T=4)
    idx = idx % 6  # table rows 6..11 receive no row: their gradients are exact zeros
    leaves = [t.clone().requires_grad_() for t in (x, w, shift, scale)]
    out = torch.ops.h3.norm_modulate(*leaves, idx)
    grad = torch.randn_like(out)
    out.backward(grad)
    dx, dw, dsh, dsc = torch.ops.h3.norm_modulate_backward(grad, x, w, scale, idx, NORM_EPS, 12)
    for leaf, g in zip(leaves, (dx, dw, dsh, dsc)):
        assert same_bits(leaf.grad, g)
    assert not dsh[6:].any() and not dsc[6:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("table_rows", [24, 48, 49, 150])
def test_large_tables(table_rows):
    x, w, _, _, _ = _inputs(999, seed=8)
    shift = torch.randn(table_rows, H, device="cuda").to(BF16)
    scale = torch.randn(table_rows, H, device="cuda").to(BF16) * 0.5
    idx = torch.randint(0, table_rows, (999,), device="cuda")
    out = torch.ops.h3.norm_modulate(x, w, shift, scale, idx)
    assert torch.equal(out, reference.norm_modulate_replay(x, w, shift, scale, idx))
    grad = torch.randn_like(x)
    _, _, dsh, _ = torch.ops.h3.norm_modulate_backward(grad, x, w, scale, idx, NORM_EPS, table_rows)
    ref = torch.zeros(table_rows, H, dtype=torch.float64, device="cuda").index_add_(0, idx, grad.double())
    assert _rel_err(dsh, ref) < 1e-2


@pytest.mark.gpu
def test_out_of_range_index_without_check_gives_nan_rows_only():
    x, w, shift, scale, idx = _inputs(64, seed=9)
    bad = idx.clone()
    bad[5], bad[9] = 9, -1
    out = torch.ops.h3.norm_modulate(x, w, shift, scale, bad, NORM_EPS, False)
    assert out[5].isnan().all() and out[9].isnan().all()
    keep = torch.ones(64, dtype=torch.bool, device="cuda")
    keep[5] = keep[9] = False
    assert same_bits(out[keep], reference.norm_modulate_replay(x, w, shift, scale, idx)[keep])


@pytest.mark.gpu
def test_64bit_row_offsets():
    rows = (1 << 19) + 1  # rows * H > 2^31 elements
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, H, device="cuda", generator=g) * 2).to(BF16)
    w, shift, scale, _ = _inputs(1, seed=1)[1:]
    idx = torch.randint(0, 9, (rows,), device="cuda", generator=g)
    out = torch.ops.h3.norm_modulate(x, w, shift, scale, idx)
    tail = slice(rows - 300, rows)
    assert same_bits(out[tail], reference.norm_modulate_replay(x[tail], w, shift, scale, idx[tail]))
    del out
    grad = x.roll(1, 0)
    dx, _, dsh, _ = torch.ops.h3.norm_modulate_backward(grad, x, w, scale, idx, NORM_EPS, 9)
    dx_tail = torch.ops.h3.norm_modulate_backward(grad[tail], x[tail], w, scale, idx[tail], NORM_EPS, 9)[0]
    assert same_bits(dx[tail], dx_tail)
    for cols in (slice(0, 256), slice(H - 256, H)):  # dshift: FP32 sums of grad rows, one rounding
        ref = torch.zeros(9, 256, dtype=torch.float64, device="cuda").index_add_(0, idx, grad[:, cols].double())
        mag = torch.zeros_like(ref).index_add_(0, idx, grad[:, cols].double().abs())
        assert_within(dsh[:, cols], ref, one_rounding(ref, mag), f"dshift columns {cols}, S=2^19+1")


@pytest.mark.gpu
@pytest.mark.parametrize("run_length", [1, 5, 37, 700])
def test_fused_backward_table_runs_and_bad_rows(run_length):
    """The fused backward sums each run of rows with one table row in registers and adds the run to shared
    memory when the table row changes: runs of every length across 8-row steps, tail rows and cluster groups,
    with out-of-range rows inside runs (they add nothing and get NaN dx), against FP64 of the valid rows."""
    rows = 32 * 40 + 21
    x, w, shift, scale, _ = _inputs(rows, seed=run_length)
    idx = (torch.arange(rows, device="cuda") // run_length * 5) % 9
    bad = idx.clone()
    bad[3::97] = 9
    bad[50::131] = -4
    keep = bad == idx
    grad = torch.randn_like(x)
    dx, dw, dsh, dsc = torch.ops.h3.norm_modulate_backward(grad, x, w, scale, bad, NORM_EPS, 9)
    assert dx[~keep].isnan().all() and not dx[keep].isnan().any()
    assert_norm_modulate_backward((dx[keep], dw, dsh, dsc), grad[keep], x[keep], w, shift, scale, idx[keep],
                                  f"runs of {run_length}")
