"""timestep_mlp: the 3xTF32 contract on CPU (splits, configs, compiled code, numerics) and on the GPU.

CPU: the launcher's split counts and tiles are exactly what the kernels were built for; every variant
compiles for sm_90a and sm_100a with the three tf32 mma per k8 step and no atomics; a bit-level NumPy
model of the big/small split meets the accuracy budget that plain TF32 misses.
GPU (`-m gpu`): FP64 accuracy at the report sizes, bitwise batch invariance (row alone vs in batches
straddling every tile edge, any position, poisoned neighbours), identical bits for every config,
repeatable parameter gradients, poisoned (NaN-filled) output memory never leaking through. On sm_90a
the TF32-wgmma path (fc2, fc2_dgrad, fc2_wgrad; the default from WGMMA_MIN_ROWS rows) gives the
mma.sync path's bits for the whole op, forward and all five gradients, at any T.
"""

import importlib.util

import numpy as np

import pytest
import torch

from h3cute.launch import timestep_mlp as L
from h3cute.widths import FREQ as F1, MLP_HIDDEN as HIDDEN, TEMB as D

from bitwise import same_bits
from compiled_ptx import ptx_of
from poison import poison_allocator

REPORT_SIZES = (1, 3, 4, 64, 256, 2048)
FWD_TOL, GRAD_TOL = 2e-6, 1e-5


# ---- CPU: launcher <-> kernel contract ---------------------------------------------------------------


@pytest.fixture(scope="module")
def K():
    from h3cute.kernels import timestep_mlp

    return timestep_mlp


def test_split_counts_match_the_kernels(K):
    assert L.SPLITS == {r: K.role_splits(r) for r in L.SPLITS}
    assert L.SPLITS == {"fc2": 6, "fc2_dgrad": 3, "fc1_dgrad": 6}
    assert K.role_splits("fc1") == 1 and K.role_splits("fc2_wgrad") == 1
    assert {r for r, _ in K.FOLDS} | {"fc2_dgrad"} == set(L.SPLITS)  # fc2_dgrad: colsum's dz mode


def test_every_pickable_tile_is_a_built_variant(K):
    assert L.GemmConfig is __import__("h3cute.kernels._tiles", fromlist=["GemmConfig"]).GemmConfig
    for cfg in L.CONFIGS:
        for role in ("fc1", "fc2", "fc2_dgrad", "fc1_dgrad", "fc2_wgrad", "fc1_wgrad"):
            assert getattr(cfg, role).astuple() in K.GEMM_TILES[role], (cfg, role)
        assert cfg.fc1.astuple() in K.GEMM_TILES["fc1_zh"], cfg  # the backward's recompute uses cfg.fc1
    assert {L.pick_config(t) for t in range(1, 5000)} <= set(L.CONFIGS)  # the rest are sweep candidates
    # The bundle builds the picked configs' tiles (tests/test_bundle_picks.py), the sweep compiles the rest.
    assert K.GEMM_TILES == K.role_tiles(L.CONFIGS) and K.PICKED_TILES == K.role_tiles(c for _, c in L.T_BOUNDS)
    assert all(set(K.PICKED_TILES[r]) < set(K.GEMM_TILES[r]) for r in ("fc1", "fc2", "fc2_dgrad", "fc2_wgrad"))


def test_transposed_views_have_the_compiled_strides():
    """The MN-major kernels are compiled for (N, T) views with strides (1, N); a contiguous (1, N)
    tensor may report any stride for its size-1 dim (here the .t() of an (N, 1) column)."""
    for a in (torch.randn(5, 96), torch.randn(96, 1).t(), torch.randn(3, 96)[1:2]):
        assert a.is_contiguous()
        v = L.transposed(a)
        assert v.shape == (96, a.shape[0]) and v.stride() == (1, 96) and torch.equal(v, a.t())


def test_wgmma_roles_are_built_variants():
    """The launcher's wgmma roles, tile and K padding are what kernels/wgmma_tf32.py builds."""
    pytest.importorskip("cutlass", exc_type=ImportError)
    from h3cute.kernels import get_spec
    from h3cute.kernels import wgmma_tf32 as W

    assert L.WGMMA_ROLES == W.ROLE_GEMMS and L.WGMMA_TILE == W.LAUNCH_TILE
    assert L.WGMMA_K_PAD == W.TRANSPOSE_TILE and L.WGMMA_K_PAD % W.WgmmaTile(*L.WGMMA_TILE).bk == 0
    built = get_spec("tf32x3_wgmma_gemm").variants("sm_90a")
    for k, splits in L.WGMMA_ROLES.values():
        assert dict(k=k, splits=splits, tile=L.WGMMA_TILE) in built, (k, splits)
    assert get_spec("tf32x3_wgmma_gemm").archs == ("sm_90a",)
    assert L.WEIGHT_ROLES == W.WEIGHT_GEMMS and L.WEIGHT_TILE == W.WEIGHT_TILE
    assert L.WEIGHT_FC1_TILE == W.WEIGHT_FC1_TILE
    for role in ("fc2", "fc2_dgrad"):  # the same K and slices as the pre-split GEMM's roles
        assert L.WEIGHT_ROLES[role][:2] == L.WGMMA_ROLES[role]
    built = get_spec("tf32x3_wgmma_weight_gemm").variants("sm_90a")
    assert all(dict(role=r, tile=L.WEIGHT_TILE) in built for r in ("fc2", "fc2_dgrad"))
    assert all(dict(role=r, tile=t) in built for _, t in L.WEIGHT_SMALL_TILES for r in ("fc2", "fc2_dgrad"))
    assert all(dict(role=r, tile=L.WEIGHT_FC1_TILE) in built for r in ("fc1_split", "fc1_zh"))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_plans_mark_the_wgmma_sequence(monkeypatch, arch):
    """The C++ layer caches one plan per [lo, hi]: on sm_90a the backward from WGMMA_MIN_ROWS runs the wgmma
    sequence's 12 launches and no mma.sync range reaches past it; the forward's fc2 is the weight GEMM at
    T <= WEIGHT_SMALL_ROWS and from WGMMA_MIN_ROWS (fc1 too from there), one tile per range; every range holds one
    config."""
    from h3cute import runtime
    from h3cute.launch.plan import Phase

    monkeypatch.setattr(runtime, "arch_of", lambda device: arch)
    for phase in Phase:
        for rows in (1, 16, 17, 64, 65, 255, 256, 257, 300, 511, 512, 513, 2048, 100000):
            plan = L.build(phase, 0, L.Key(), rows)
            lo, hi = plan.lo, plan.hi
            assert lo <= rows <= hi
            assert all(L.build(phase, 0, L.Key(), r) == plan for r in (lo, min(hi, 4096)))
            wgmma = arch == "sm_90a" and rows >= L.WGMMA_MIN_ROWS
            assert L.uses_wgmma(0, rows) == wgmma, (rows, phase)
            names = [step.kernel.name for step in plan.steps]
            if phase is Phase.FORWARD:  # fc2 on the weight GEMM; fc1 too (after the split of x) from WGMMA_MIN_ROWS
                small = arch == "sm_90a" and rows <= L.WEIGHT_SMALL_ROWS
                assert len(names) == (4 if wgmma else 3)
                assert (names[-2] == "tf32x3_wgmma_weight_gemm") == (wgmma or small)
                assert (L.forward_weight_tile(0, rows) is not None) == (wgmma or small)
                assert {L.forward_weight_tile(0, r) for r in (lo, rows, min(hi, 4096))} == \
                    {L.forward_weight_tile(0, rows)}
                continue
            assert len(names) == (12 if wgmma else 8) and ("tf32x3_wgmma_gemm" in names) == wgmma
            if arch == "sm_90a":  # the whole range takes the same path
                assert (lo >= L.WGMMA_MIN_ROWS) == wgmma and (hi < L.WGMMA_MIN_ROWS) != wgmma, (rows, lo, hi)
            assert L.pick_config(max(lo, 1)) == L.pick_config(rows) == L.pick_config(min(hi, 4096))


def test_gemm_config_rejects_tiles_the_kernel_cannot_run():
    from h3cute.kernels.gemm_tf32x3 import GemmConfig

    GemmConfig(16, 64)
    for bad in (dict(tile_m=24, tile_n=64), dict(tile_m=16, tile_n=60), dict(tile_m=16, tile_n=64, tile_k=16),
                dict(tile_m=16, tile_n=64, stages=2), dict(tile_m=16, tile_n=16, warps_n=4)):
        with pytest.raises(ValueError):
            GemmConfig(**bad)


def test_configs_written_on_the_command_line():
    """`h3cute-bench sweep --op timestep_mlp --config TEXT`: a named config, or field overrides of its GEMM tiles for
    one role (`ROLE.FIELD=N`) or for every role (`FIELD=N`); bad text fails naming the op, the text and what it
    takes; the picks a command-line config is checked against are the T picks' configs."""
    import dataclasses

    roles = [f.name for f in dataclasses.fields(L.MlpConfig)]
    assert L.parse_config("MID_T") is L.MID_T and sorted(L.CONFIG_NAMES) == sorted(
        n for n, v in vars(L).items() if n.isupper() and isinstance(v, L.MlpConfig))
    assert set(map(id, L.CONFIG_NAMES.values())) == set(map(id, L.CONFIGS))
    c = L.parse_config("MID_T:fc2.stages=5")
    assert c.fc2 == dataclasses.replace(L.MID_T.fc2, stages=5)
    assert all(getattr(c, r) == getattr(L.MID_T, r) for r in roles if r != "fc2")
    c = L.parse_config("SMALL_T:tile_k=64,fc1.stages=3")
    assert all(getattr(c, r).tile_k == 64 for r in roles) and c.fc1.stages == 3
    assert c.fc2.stages == L.SMALL_T.fc2.stages
    assert L.sweep_config("MID_T:fc2.stages=5", None) == ("MID_T:fc2.stages=5", L.parse_config("MID_T:fc2.stages=5"))
    for text, msg in (("HUGE_T", "not a named config"), ("MID_T:stages", r"\[ROLE.\]FIELD=N"),
                      ("MID_T:fc3.stages=5", "a role of"), ("MID_T:fc2.colour=1", "a field of"),
                      ("MID_T:stages=four", "stages takes an integer"), ("MID_T:fc2.stages=2", "at least 3 stages")):
        with pytest.raises(ValueError, match=msg) as e:
            L.parse_config(text)
        named = text.partition(":")[0] if "named" in msg else text
        assert f"timestep_mlp config {named!r}" in str(e.value), e.value
    assert L.sweep_picks(None) == ("SMALL_T", "WIDE_T", "MID_T", "LARGE_T")


@pytest.mark.slow
def test_a_command_line_tile_compiles_on_demand(K):
    """A tile no config declares (what a command-line config asks for) compiles like the declared ones."""
    tile = L.parse_config("MID_T:fc2.stages=5").fc2.astuple()
    assert tile not in K.GEMM_TILES["fc2"]
    spec = next(s for s in K.SPECS if s.name == "timestep_mlp_gemm")
    ptx = "\n".join(ptx_of(spec, "sm_90a", dict(role="fc2", tile=tile)))
    assert ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == _expected_mma_per_k_tile(tile)


def _expected_mma_per_k_tile(tile):
    tm, tn, tk, _, wm, wn = tile
    return (tm // (16 * wm)) * (tn // (8 * wn)) * (tk // 8) * 3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_every_variant_compiles_with_three_tf32_mma_per_step(K, arch):
    for spec in K.SPECS:
        for static in spec.variants(arch):
            ptxs = ptx_of(spec, arch, static)
            ptx = "\n".join(ptxs)
            assert f".target {arch}" in ptx
            for marker in spec.ptx_markers:
                assert marker in ptx, (spec.name, static, marker)
            for bad in spec.ptx_forbidden:
                assert bad not in ptx, (spec.name, static, bad)
            if spec.name == "timestep_mlp_gemm":
                # The mainloop body is emitted once: 3 mma per (m16, n8, k8) step of the warp tile,
                # then one IEEE add per accumulator register (4 per m16n8 atom and thread).
                n_mma = ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")
                assert n_mma == _expected_mma_per_k_tile(static["tile"]), (static, n_mma)
                assert ptx.count("add.rn.f32 ") == 4 * n_mma // 3, (static, ptx.count("add.rn.f32 "))
                assert ".local" not in ptx, static


# ---- CPU: the 3xTF32 numerics, bit for bit in NumPy ---------------------------------------------------


def _big(x):
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def _tf32_rna(x):
    # Round the magnitude half away from zero at bit 13 (sign-magnitude: adding to the pattern does it).
    return ((x.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _mma_model_gemm(a, b, terms, k_slice=896):
    """Per K slice, FP32 accumulation of each k8 step's exactly summed products (the best an mma can
    do); then the slices are added in order in FP32, as the fold kernel does."""
    out = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for s0 in range(0, a.shape[1], k_slice):
        acc = np.zeros_like(out)
        for k0 in range(s0, s0 + k_slice, 8):
            step = np.zeros(acc.shape, np.float64)
            for lhs, rhs in terms:
                step += lhs[:, k0:k0 + 8].astype(np.float64) @ rhs[:, k0:k0 + 8].astype(np.float64).T
            acc = (acc.astype(np.float64) + step).astype(np.float32)
        out = out + acc
    return out


def test_split_is_exact_and_3xtf32_meets_the_fp32_budget_tf32_misses():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, HIDDEN)).astype(np.float32)
    b = (rng.standard_normal((96, HIDDEN)) * HIDDEN ** -0.5).astype(np.float32)
    a_big, b_big = _big(a), _big(b)
    assert np.array_equal((a - a_big).astype(np.float64), a.astype(np.float64) - a_big.astype(np.float64))
    a_small, b_small = _tf32_rna(a - a_big), _tf32_rna(b - b_big)
    assert np.all(np.abs(a - a_big - a_small) <= np.abs(a) * 2.0 ** -21)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    three = _mma_model_gemm(a, b, [(a_small, b_big), (a_big, b_small), (a_big, b_big)])
    one = _mma_model_gemm(_tf32_rna(a), _tf32_rna(b), [(_tf32_rna(a), _tf32_rna(b))])
    rel = lambda out: np.abs(out - ref).max() / np.abs(ref).max()  # noqa: E731
    assert rel(three) <= FWD_TOL / 2, rel(three)
    assert rel(one) > FWD_TOL * 10, rel(one)


def _rz_fp32(s):
    """float64 -> FP32 rounded toward zero."""
    f = s.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(s)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def _tensor_core_mma(c, a, b, block, guard):
    """One m16n8k8 TF32 mma, d = c + a b^T over 8 k, as published measurements of the V100..H100
    tensor cores describe it: per block of `block` k, the exact products and c are aligned to the
    largest of them with the bits below 24 + `guard` truncated, summed, and normalised toward zero."""
    for j in range(0, 8, block):
        terms = np.concatenate([c.astype(np.float64)[..., None],
                                a[:, None, j:j + block].astype(np.float64) * b[None, :, j:j + block]], axis=-1)
        _, e = np.frexp(np.abs(terms).max(axis=-1, keepdims=True))
        lsb = e - 1 - 23 - guard
        c = _rz_fp32((np.sign(terms) * np.ldexp(np.floor(np.ldexp(np.abs(terms), -lsb)), lsb)).sum(axis=-1))
    return c


def _tensor_core_gemm(a, b, chunked, block, guard, k_slice):
    """3xTF32 per K slice, slices added in order in FP32. chunked=False: the three mma of every k8 step
    chain into one accumulator (the old kernel); True: each k8 step's three mma start from zero and
    the chunk is added to the running sum in IEEE FP32 (the kernel's contract)."""
    a_big, b_big = _big(a), _big(b)
    a_small, b_small = _tf32_rna(a - a_big), _tf32_rna(b - b_big)
    out = None
    for s0 in range(0, a.shape[1], k_slice):
        acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
        for k0 in range(s0, s0 + k_slice, 8):
            k = slice(k0, k0 + 8)
            c = np.zeros_like(acc) if chunked else acc
            for lhs, rhs in ((a_small, b_big), (a_big, b_small), (a_big, b_big)):
                c = _tensor_core_mma(c, lhs[:, k], rhs[:, k], block, guard)
            acc = acc + c if chunked else c
        out = acc if out is None else out + acc
    return out


@pytest.mark.parametrize("block, guard", [(8, 3), (4, 0)])
def test_truncating_tensor_core_accumulation_needs_the_ieee_chunk_sum(block, guard):
    """fc1- and fc2-shaped GEMMs (fewer columns). The chained model reproduces the GPU's misses of the
    bar (measured fc1 2.2e-6, forward 8e-6; at full size this model gives 2.1e-6 and 9.9e-6 for
    block 8, guard 3); the chunked scheme stays at FP32 level whichever way the hardware aligns."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, F1)).astype(np.float32)
    w1 = (rng.standard_normal((512, F1)) * F1 ** -0.5).astype(np.float32)
    z = rng.standard_normal((2, HIDDEN))
    h = (z / (1 + np.exp(-z))).astype(np.float32)
    w2 = (rng.standard_normal((192, HIDDEN)) * HIDDEN ** -0.5).astype(np.float32)
    for a, b, k_slice in ((x, w1, F1), (h, w2, 896)):
        ref = a.astype(np.float64) @ b.astype(np.float64).T
        rel = lambda out: np.abs(out - ref).max() / np.abs(ref).max()  # noqa: E731
        chained = rel(_tensor_core_gemm(a, b, False, block, guard, k_slice))
        chunked = rel(_tensor_core_gemm(a, b, True, block, guard, k_slice))
        assert chained > FWD_TOL, (a.shape, chained)
        assert chunked <= FWD_TOL / 4, (a.shape, chunked)


# ---- GPU ----------------------------------------------------------------------------------------------


def _params(seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed * 1000 + 7)
    w1 = torch.randn(HIDDEN, F1, generator=g, device=device) * F1 ** -0.5
    b1 = torch.randn(HIDDEN, generator=g, device=device) * 0.02
    w2 = torch.randn(D, HIDDEN, generator=g, device=device) * HIDDEN ** -0.5
    b2 = torch.randn(D, generator=g, device=device) * 0.02
    return w1, b1, w2, b2


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")


def _fp64(x, w1, b1, w2, b2, grad):
    leaves = [t.double().requires_grad_() for t in (x, w1, b1, w2, b2)]
    xd, w1d, b1d, w2d, b2d = leaves
    out = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(xd, w1d, b1d)), w2d, b2d)
    out.backward(grad.double())
    return out.detach(), [t.grad for t in leaves]


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (1, 5, 33, 100))
def test_each_gemm_role_against_fp64(num_rows):
    """Localizes a failure: fc1's z and h, the fc2 slice partials and a T-deep weight-gradient GEMM."""
    from h3cute import runtime

    w1, b1, w2, b2 = _params(7)
    x = _randn((num_rows, F1), 71)
    poison_allocator()
    z = torch.full((num_rows, w1.shape[0]), float("nan"), device="cuda")  # fc1_zh: the backward's recompute
    h = torch.full_like(z, float("nan"))
    runtime.kernel("timestep_mlp_gemm", x.device, role="fc1_zh", tile=L.SMALL_T.fc1.astuple())(x, w1, b1, z, h)
    z64 = x.double() @ w1.double().t() + b1.double()
    assert _rel(z, z64) <= FWD_TOL
    assert _rel(h, torch.nn.functional.silu(z64)) <= FWD_TOL
    for cfg in L.CONFIGS:  # the forward's h-only fc1 gives the backward recompute's bits
        h_only = torch.full_like(h, float("nan"))
        runtime.kernel("timestep_mlp_gemm", x.device, role="fc1", tile=cfg.fc1.astuple())(x, w1, b1, h_only)
        assert same_bits(h_only, h), cfg
    partials = torch.full((6, num_rows, D), float("nan"), device="cuda")
    runtime.kernel("timestep_mlp_gemm", x.device, role="fc2", tile=L.MID_T.fc2.astuple())(h, w2, partials)
    for s in range(6):
        k = slice(896 * s, 896 * (s + 1))
        assert _rel(partials[s], h[:, k].double() @ w2[:, k].double().t()) <= FWD_TOL, s
    # The dgrad GEMMs read w2 / w1 N-major in place (their W.t() views): each slice against FP64.
    grad = _randn((num_rows, D), 72)
    dh_partials = torch.full((3, num_rows, HIDDEN), float("nan"), device="cuda")
    dx_partials = torch.full((6, num_rows, F1), float("nan"), device="cuda")
    for cfg in L.CONFIGS:
        runtime.kernel("timestep_mlp_gemm", x.device, role="fc2_dgrad", tile=cfg.fc2_dgrad.astuple())(
            grad, w2.t(), dh_partials)
        for s in range(3):
            k = slice(896 * s, 896 * (s + 1))
            assert _rel(dh_partials[s], grad[:, k].double() @ w2[k].double()) <= FWD_TOL, (cfg, s)
        runtime.kernel("timestep_mlp_gemm", x.device, role="fc1_dgrad", tile=cfg.fc1_dgrad.astuple())(
            h, w1.t(), dx_partials)
        for s in range(6):
            k = slice(896 * s, 896 * (s + 1))
            assert _rel(dx_partials[s], h[:, k].double() @ w1[k].double()) <= FWD_TOL, (cfg, s)
    # The T-deep weight gradients and bias sums read (T, N) activations in place; the rows past T
    # (NaN here, inside the allocation) must never be read: the K tail is zero-filled in smem.
    def rows_then_nan(rows):
        big = torch.full((num_rows + 40, rows.shape[1]), float("nan"), device="cuda")
        big[:num_rows] = rows
        return big[:num_rows]

    dz = rows_then_nan(_randn((num_rows, HIDDEN), 73))
    g, hh, xx = rows_then_nan(grad), rows_then_nan(h), rows_then_nan(x)
    for tile in {cfg.fc1_wgrad for cfg in L.CONFIGS}:
        dw1 = torch.full((1, HIDDEN, F1), float("nan"), device="cuda")
        runtime.kernel("timestep_mlp_gemm", x.device, role="fc1_wgrad", tile=tile.astuple())(
            L.transposed(dz), L.transposed(xx), dw1)
        assert _rel(dw1[0], dz.double().t() @ x.double()) <= GRAD_TOL, tile
    for tile in {cfg.fc2_wgrad for cfg in L.CONFIGS}:
        dw2 = torch.full((1, D, HIDDEN), float("nan"), device="cuda")
        runtime.kernel("timestep_mlp_gemm", x.device, role="fc2_wgrad", tile=tile.astuple())(
            L.transposed(g), L.transposed(hh), dw2)
        assert _rel(dw2[0], grad.double().t() @ h.double()) <= GRAD_TOL, tile
    db2 = torch.full((D,), float("nan"), device="cuda")
    runtime.kernel("timestep_mlp_colsum", x.device, cols=D, fold_dz=False)(g, g, g, db2)
    assert _rel(db2, grad.double().sum(0)) <= GRAD_TOL
    # dz mode: dz = (dh slice partials in order) * silu'(z), and db1 = its column sums
    dh_partials = torch.stack([_randn((num_rows, HIDDEN), 74 + s) for s in range(3)])
    zz = rows_then_nan(z)
    dz_out = torch.full((num_rows, HIDDEN), float("nan"), device="cuda")
    db1 = torch.full((HIDDEN,), float("nan"), device="cuda")
    runtime.kernel("timestep_mlp_colsum", x.device, cols=HIDDEN, fold_dz=True)(dh_partials, zz, dz_out, db1)
    sig = torch.sigmoid(z.double())
    dz64 = dh_partials.double().sum(0) * sig * (1 + z.double() * (1 - sig))
    assert _rel(dz_out, dz64) <= FWD_TOL
    assert _rel(db1, dz_out.double().sum(0)) <= GRAD_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", REPORT_SIZES)
def test_accuracy_against_fp64(num_rows):
    w1, b1, w2, b2 = _params()
    x = _randn((num_rows, F1), 11)
    grad = _randn((num_rows, D), 9)
    ref_out, (dx, dw1, db1, dw2, db2) = _fp64(x, w1, b1, w2, b2, grad)
    poison_allocator()
    out = L.forward(x, w1, b1, w2, b2)
    assert _rel(out, ref_out) <= FWD_TOL
    poison_allocator()
    got = L.backward(grad, x, w1, b1, w2)
    for name, g, r in zip(("dx", "dw1", "db1", "dw2", "db2"), got, (dx, dw1, db1, dw2, db2)):
        assert g.shape == r.shape and g.dtype == torch.float32, name
        assert _rel(g, r) <= GRAD_TOL, (name, _rel(g, r))


@pytest.mark.gpu
def test_op_and_autograd_match_the_launcher():
    import h3cute  # noqa: F401  (registers torch.ops.h3)

    w1, b1, w2, b2 = _params(1)
    x = _randn((5, F1), 12)
    grad = _randn((5, D), 13)
    assert same_bits(torch.ops.h3.timestep_mlp(x, w1, b1, w2, b2), L.forward(x, w1, b1, w2, b2))
    leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    torch.ops.h3.timestep_mlp(*leaves).backward(grad)
    dx, dw1, db1, dw2, db2 = L.backward(grad, x, w1, b1, w2)
    for leaf, want in zip(leaves, (dx, dw1, db1, dw2, db2)):
        assert leaf.grad is not None and same_bits(leaf.grad, want)


# Batch sizes straddling every tile edge (16, 32, 64, 128 rows), the config switch points and the
# weight-gradient padding (32).
SWEEP = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300,
         511, 512, 513, 1023, 1025, 2047, 2048, 2049)


@pytest.mark.gpu
def test_probe_rows_alone_equal_in_every_batch_size_and_position():
    w1, b1, w2, b2 = _params(2)
    probes = _randn((3, F1), 21)
    probe_grads = _randn((3, D), 22)
    alone = [L.forward(probes[i:i + 1], w1, b1, w2, b2) for i in range(3)]
    alone_dx = [L.backward(probe_grads[i:i + 1], probes[i:i + 1], w1, b1, w2)[0] for i in range(3)]
    for n in SWEEP:
        x = _randn((n, F1), 1000 + n)
        grad = _randn((n, D), 2000 + n)
        positions = sorted({0, n // 2, n - 1})
        for i, pos in enumerate(positions):
            x[pos] = probes[i]
            grad[pos] = probe_grads[i]
        out = L.forward(x, w1, b1, w2, b2)
        dx = L.backward(grad, x, w1, b1, w2)[0]
        for i, pos in enumerate(positions):
            assert same_bits(out[pos:pos + 1], alone[i]), (n, pos)
            assert same_bits(dx[pos:pos + 1], alone_dx[i]), (n, pos)


def _sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (1, 17, 100, 300))
def test_every_config_gives_identical_bits(num_rows):
    """Every mma.sync config (forced: on sm_90a the default from WGMMA_MIN_ROWS rows is the wgmma path), and on
    sm_90a the wgmma path (which any T may take), give the same bits."""
    w1, b1, w2, b2 = _params(3)
    x = _randn((num_rows, F1), 31)
    grad = _randn((num_rows, D), 32)
    runs = [(c, False) for c in L.CONFIGS] + ([(L.pick_config(num_rows), True)] if _sm90() else [])
    fwd = [L.forward(x, w1, b1, w2, b2, config=c, wgmma=w) for c, w in runs]
    bwd = [L.backward(grad, x, w1, b1, w2, config=c, wgmma=w) for c, w in runs]
    for run, out, grads in zip(runs[1:], fwd[1:], bwd[1:]):
        assert same_bits(out, fwd[0]), run
        for name, g, g0 in zip(("dx", "dw1", "db1", "dw2", "db2"), grads, bwd[0]):
            assert same_bits(g, g0), (run, name)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (1, 100))
def test_configs_written_as_overrides_give_the_picks_bits(num_rows):
    """Configs written on `h3cute-bench sweep`'s command line compile on demand and give the shipped picks' bits
    (forced onto the mma.sync path, whose tiles they change)."""
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("compiling a config on demand needs the CuTe DSL (the device's bundle holds the picks)")
    w1, b1, w2, b2 = _params(5)
    x = _randn((num_rows, F1), 41)
    grad = _randn((num_rows, D), 42)
    want, want_grads = L.forward(x, w1, b1, w2, b2, wgmma=False), L.backward(grad, x, w1, b1, w2, wgmma=False)
    for text in ("MID_T:fc2.stages=5", "SMALL_T:stages=5", "LARGE_T:fc2_dgrad.tile_n=64"):
        config = L.parse_config(text)
        assert same_bits(L.forward(x, w1, b1, w2, b2, config=config, wgmma=False), want), text
        for name, g, g0 in zip(("dx", "dw1", "db1", "dw2", "db2"),
                               L.backward(grad, x, w1, b1, w2, config=config, wgmma=False), want_grads):
            assert same_bits(g, g0), (text, name)


def _both_paths(x, w1, b1, w2, b2, grad):
    """(forward, backward) of the mma.sync path and of the wgmma path, each on NaN-poisoned memory."""
    runs = []
    for wgmma in (False, True):
        poison_allocator()
        out = L.forward(x, w1, b1, w2, b2, wgmma=wgmma)
        poison_allocator()
        runs.append((out, L.backward(grad, x, w1, b1, w2, wgmma=wgmma)))
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (1, 4, 8, 9, 16, 17, 256, 257, 300, 512, 2048))  # small T: the weight fc2 tiles
def test_wgmma_path_gives_the_mma_sync_bits(num_rows):
    """sm_90a: the whole op on the TF32-wgmma GEMMs (operand splits, TMA, warpgroup MMA; at small T the forward's
    8- and 16-row weight tiles) equals the mma.sync path bit for bit, forward and all five gradients; FP64
    first, so a layout bug reads as such."""
    if not _sm90():
        pytest.skip("the TF32 wgmma path is sm_90a only")
    assert L.uses_wgmma(torch.device("cuda"), num_rows) == (num_rows >= L.WGMMA_MIN_ROWS)
    w1, b1, w2, b2 = _params(10 + num_rows)
    x = _randn((num_rows, F1), 3000 + num_rows)
    grad = _randn((num_rows, D), 4000 + num_rows)
    ref_out, ref_grads = _fp64(x, w1, b1, w2, b2, grad)
    (out0, grads0), (out1, grads1) = _both_paths(x, w1, b1, w2, b2, grad)
    assert _rel(out1, ref_out) <= FWD_TOL
    for name, g, r in zip(("dx", "dw1", "db1", "dw2", "db2"), grads1, ref_grads):
        assert _rel(g, r) <= GRAD_TOL, (name, _rel(g, r))
    assert same_bits(out1, out0)
    for name, g1, g0 in zip(("dx", "dw1", "db1", "dw2", "db2"), grads1, grads0):
        assert same_bits(g1, g0), name
    assert same_bits(L.forward(x, w1, b1, w2, b2), out1)  # the default path at this T: the same bits


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (257, 2048))
def test_wgmma_path_keeps_zero_rows_and_signed_zeros(num_rows):
    """Zero rows of grad (and a zero grad column: a dW2 row of +-0 products only) through both paths: dW2 is
    a T-deep sum whose K tail the two paths pad differently (to 32 vs the mma.sync tile_k); the zero chunks
    must leave every bit alone, signed zeros included."""
    if not _sm90():
        pytest.skip("the TF32 wgmma path is sm_90a only")
    w1, b1, w2, b2 = _params(20)
    x = _randn((num_rows, F1), 5000 + num_rows)
    grad = _randn((num_rows, D), 6000 + num_rows)
    grad[::3] = 0.0
    grad[-7:] = 0.0  # the last rows before the K tail
    grad[:, 5] = 0.0
    grad[:, 6] = -0.0
    (out0, grads0), (out1, grads1) = _both_paths(x, w1, b1, w2, b2, grad)
    assert same_bits(out1, out0)
    for name, g1, g0 in zip(("dx", "dw1", "db1", "dw2", "db2"), grads1, grads0):
        assert same_bits(g1, g0), name
    dw2 = grads1[3]
    assert torch.isfinite(dw2).all() and not dw2[5].any() and not dw2[6].any()


@pytest.mark.gpu
@pytest.mark.parametrize("poison", (float("nan"), float("inf"), 1e30))
def test_poisoned_neighbours_leave_the_probe_row_alone(poison):
    w1, b1, w2, b2 = _params(4)
    probe, probe_grad = _randn((1, F1), 41), _randn((1, D), 42)
    alone = L.forward(probe, w1, b1, w2, b2)
    alone_dx = L.backward(probe_grad, probe, w1, b1, w2)[0]
    for n, pos in ((2, 0), (17, 9), (130, 129), (300, 64)):
        x = torch.full((n, F1), poison, device="cuda")
        grad = torch.full((n, D), poison, device="cuda")
        x[pos], grad[pos] = probe[0], probe_grad[0]
        assert same_bits(L.forward(x, w1, b1, w2, b2)[pos:pos + 1], alone), (n, pos)
        assert same_bits(L.backward(grad, x, w1, b1, w2)[0][pos:pos + 1], alone_dx), (n, pos)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (3, 257, 2048))
def test_parameter_gradients_are_repeatable(num_rows):
    w1, b1, w2, b2 = _params(5)
    x = _randn((num_rows, F1), 51)
    grad = _randn((num_rows, D), 52)
    first = L.backward(grad, x, w1, b1, w2)
    poison_allocator()
    second = L.backward(grad, x, w1, b1, w2)
    for name, a, b in zip(("dx", "dw1", "db1", "dw2", "db2"), first, second):
        assert same_bits(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (1, 64, 300, 600))  # 600: on sm_90a the wgmma path
def test_cuda_graph_replay_gives_the_eager_bits(num_rows):
    """Every kernel is launched with PDL (programmatic dependent launch): captured into a graph the
    launches keep their programmatic edges; the bits must be those of the eager calls."""
    w1, b1, w2, b2 = _params(8)
    x, grad = _randn((num_rows, F1), 81), _randn((num_rows, D), 82)
    want_out = L.forward(x, w1, b1, w2, b2)
    want_grads = L.backward(grad, x, w1, b1, w2)
    L.forward(x, w1, b1, w2, b2), L.backward(grad, x, w1, b1, w2)  # warm, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = L.forward(x, w1, b1, w2, b2)
        grads = L.backward(grad, x, w1, b1, w2)
    for _ in range(3):
        out.fill_(float("nan"))
        for g in grads:
            g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(out, want_out)
        for name, g, w in zip(("dx", "dw1", "db1", "dw2", "db2"), grads, want_grads):
            assert same_bits(g, w), name


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (3, 600))  # 600: on sm_90a the wgmma path (splits read the weights)
def test_weights_written_just_before_the_call_are_seen(num_rows):
    """fc2 and the dgrad GEMMs stream their weight before waiting on the previous kernel (PDL); a
    torch kernel that rewrites the weights right before the call must still be fully visible."""
    w1, b1, w2, b2 = _params(9)
    x, grad = _randn((num_rows, F1), 91), _randn((num_rows, D), 92)
    want = {}
    for sign in (1.0, -1.0):
        want[sign] = (L.forward(x, sign * w1, b1, sign * w2, b2), L.backward(grad, x, sign * w1, b1, sign * w2))
    torch.cuda.synchronize()
    sign = 1.0
    for i in range(20):
        w1.neg_(), w2.neg_()  # on the stream, immediately before the op's first kernel
        sign = -sign
        if i % 2:
            assert same_bits(L.forward(x, w1, b1, w2, b2), want[sign][0]), i
        else:
            for name, g, w in zip(("dx", "dw1", "db1", "dw2", "db2"), L.backward(grad, x, w1, b1, w2), want[sign][1]):
                assert same_bits(g, w), (i, name)


@pytest.mark.gpu
def test_zero_rows():
    w1, b1, w2, b2 = _params(6)
    x = torch.empty((0, F1), device="cuda")
    assert L.forward(x, w1, b1, w2, b2).shape == (0, D)
    dx, dw1, db1, dw2, db2 = L.backward(torch.empty((0, D), device="cuda"), x, w1, b1, w2)
    assert dx.shape == (0, F1) and not dw1.any() and not db1.any() and not dw2.any() and not db2.any()


def test_launcher_imports_no_cutlass():
    # The launcher shares GemmConfig with the kernels through h3cute.kernels._tiles, which is DSL-free:
    # machines that only load prebuilt kernels have no cutlass.
    import os
    import subprocess
    import sys

    code = "import sys, h3cute.launch.timestep_mlp; sys.exit('cutlass' in sys.modules)"
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0
