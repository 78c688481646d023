"""TF32 wgmma (kernels/wgmma_tf32.py) against the mma.sync 3xTF32 kernel's bits.

CPU (slow: compiles): every probe variant compiles for sm_90a to TF32 wgmma, three per k8 chunk, one
IEEE add per accumulator register per chunk, staging stores swizzled; where ptxas is installed, it
assembles (the GEMM and the split without spills).
GPU, the GEMM (operands TMA-loaded raw and split into big / small in shared memory): fc2 in every tile,
fc2_dgrad (grad x w2^T, w2 read MN-major, 3 slices) and the T-deep fc2_wgrad (grad^T x h^T, both MN-major,
K = T with TMA's zero fill past T) equal the mma.sync role's partials bit for bit at T = 1, 33, 200, 257,
2048, zero rows, signed zeros and non-finite / subnormal operands included; rows are batch-invariant.
GPU (`-m gpu`, H200): the probe's (64, N) output equals, bit for bit, the one-slice partial of the
production mma.sync kernel (timestep_mlp_gemm role fc2, slice s of a T = 64 call; columns past K in
the slice are zero, whose chunks add +0 and leave every bit alone) on random normal data, a wide
exponent range, cancelling pairs and subnormal-range products, for K = 8, 64, 896; non-finite inputs
give NaN / inf exactly where the mma.sync kernel gives them. Every output is poisoned with NaN first
and checked against FP64 before the bit comparison, so a layout bug and a rounding difference read
differently.
"""
import re
import shutil
import subprocess

import pytest
import torch

from bitwise import bits

M, N, HIDDEN, K_SLICE = 64, 2688, 5376, 896
PROBE_VARIANTS = (
    dict(tile_k=8),
    dict(tile_k=32),
    dict(tile_k=32, zero_c=True),
    dict(tile_k=32, mask_small=True),
)
_VARIANT_IDS = ["k8", "k32", "k32_zero_c", "k32_mask_small"]


# ---- CPU: the compiled probe ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("static", PROBE_VARIANTS, ids=_VARIANT_IDS)
def test_probe_compiles_to_tf32_wgmma(static, tmp_path):
    pytest.importorskip("cutlass", exc_type=ImportError)
    from h3cute.kernels import wgmma_tf32 as W
    from h3cute.runtime.dsl import compile_variant

    assert [dict(v) for v in W.PROBE_VARIANTS] == list(PROBE_VARIANTS)
    spec = W.SPECS[0]
    assert spec.archs == ("sm_90a",)
    _, ptxs = compile_variant(spec, "sm_90a", static, keep_ptx=True)
    ptx = "\n".join(ptxs)
    assert "wgmma.mma_async.sync.aligned.m64n" in ptx and ".tf32" in ptx
    chunks = static["tile_k"] // 8
    # The k loop body is emitted once: 3 wgmma per k8 chunk, then 64 accumulator registers per thread
    # (64 x 128 over 128 threads) each take one IEEE add.
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32") == 3 * chunks
    assert ptx.count("add.rn.f32 ") == 64 * chunks
    assert "fence.proxy.async.shared::cta" in ptx and ".local" not in ptx
    # The staging stores go through wgmma's swizzle (a byte-address XOR; an unswizzled store, as
    # recast_tensor of the smem tensor gave, would feed wgmma permuted operands).
    assert "xor.b32" in ptx
    if shutil.which("ptxas"):  # assembles (zero_c spills ~260 B: a probe, its speed does not matter)
        _ptxas_ok(ptx, tmp_path)


def test_probe_is_built_for_sm_90a_only():
    pytest.importorskip("cutlass", exc_type=ImportError)
    from h3cute.kernels import get_spec

    assert get_spec("tf32_wgmma_probe").archs == ("sm_90a",)


# ---- GPU: the probe against the mma.sync kernel ------------------------------------------------------


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _operands(data: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """(rows, k) FP32 test operand of the named kind."""
    g = _gen(seed)
    x = torch.randn(rows, k, generator=g, device="cuda")
    if data == "normal":
        return x
    if data == "wide_exponents":  # 2^-24 .. 2^24 per element: chunk sums mix very different magnitudes
        e = torch.randint(-24, 25, (rows, k), generator=g, device="cuda").float()
        return x * torch.exp2(e)
    if data == "subnormal_products":  # |a b| around 2^-126 and below: FP32's subnormal range
        return x * 2.0 ** -63
    raise ValueError(data)


def _pair(data: str, k: int, seed: int):
    """A (64, k), B (N, k). "cancellation": columns in pairs, b[2j+1] = -b[2j] (1 + 2^-12 r), a[2j+1] = a[2j],
    so every chunk sum is a few ulps of its products and the running sum cancels too."""
    if data != "cancellation":
        return _operands(data, M, k, seed), _operands(data, N, k, seed + 1)
    a = _operands("normal", M, k // 2, seed).repeat_interleave(2, dim=1)
    b_even = _operands("normal", N, k // 2, seed + 1)
    r = _operands("normal", N, k // 2, seed + 2)
    b = torch.stack([b_even, -b_even * (1 + r * 2.0 ** -12)], dim=2).reshape(N, k)
    return a.contiguous(), b


def _mma_sync_partials(slices_a, slices_b):
    """gemm_tf32x3's fc2 partials P[s] (T = 64) with slice s holding (a_s, b_s) in its first K columns."""
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    h = torch.zeros(M, HIDDEN, device="cuda")
    w2 = torch.zeros(N, HIDDEN, device="cuda")
    for s, (a, b) in enumerate(zip(slices_a, slices_b)):
        h[:, K_SLICE * s:K_SLICE * s + a.shape[1]] = a
        w2[:, K_SLICE * s:K_SLICE * s + b.shape[1]] = b
    partials = torch.full((HIDDEN // K_SLICE, M, N), float("nan"), device="cuda")
    runtime.kernel("timestep_mlp_gemm", h.device, role="fc2", tile=L.MID_T.fc2.astuple())(h, w2, partials)
    return partials


def _probe(static, a, b):
    from h3cute import runtime

    out = torch.full((M, N), float("nan"), device="cuda")
    runtime.kernel("tf32_wgmma_probe", a.device, **static)(a, b, out)
    return out


def _describe_difference(got, want) -> str:
    gi, wi = bits(got).long(), bits(want).long()
    bad = gi != wi
    ulps = (gi - wi).abs()[bad]
    first = bad.nonzero()[0].tolist()
    return (f"{int(bad.sum())} of {bad.numel()} elements differ, max {int(ulps.max())} ulp, first at {first}: "
            f"{got[tuple(first)].item()!r} vs {want[tuple(first)].item()!r}")


@pytest.mark.gpu
@pytest.mark.parametrize("data", ("normal", "wide_exponents", "cancellation", "subnormal_products"))
@pytest.mark.parametrize("k", (8, 64, 896))
@pytest.mark.parametrize("static", PROBE_VARIANTS, ids=_VARIANT_IDS)
def test_probe_gives_the_mma_sync_bits(static, k, data):
    if k % static["tile_k"]:
        pytest.skip(f"K = {k} is not a multiple of tile_k = {static['tile_k']}")
    seed = 1000 * k + sum(map(ord, data))
    pairs = [_pair(data, k, seed + 10 * s) for s in range(HIDDEN // K_SLICE)]
    want = _mma_sync_partials(*zip(*pairs))
    for s, (a, b) in enumerate(pairs):
        got = _probe(static, a, b)
        assert torch.isfinite(want[s]).all() and torch.isfinite(got).all(), s
        # Layout and split sanity first: 3xTF32 with IEEE chunk sums is FP32-class per |a| |b| sum.
        ref = a.double() @ b.double().t()
        scale = a.double().abs() @ b.double().abs().t()
        tiny = 2.0 ** -126 * k if data == "subnormal_products" else 0.0  # FP32 subnormals may flush
        assert ((got.double() - ref).abs() <= 1e-5 * scale + tiny).all(), (s, "probe far from FP64")
        assert torch.equal(bits(got), bits(want[s])), f"slice {s}: {_describe_difference(got, want[s])}"


@pytest.mark.gpu
@pytest.mark.parametrize("static", PROBE_VARIANTS, ids=_VARIANT_IDS)
def test_probe_non_finite_inputs_land_where_mma_sync_puts_them(static):
    k = 64
    a, b = _pair("normal", k, 77)
    a[3, 5] = float("nan")
    a[9, 40] = float("inf")
    b[17, 2] = float("-inf")
    b[100, 63] = float("nan")
    want = _mma_sync_partials([a], [b])[0]
    got = _probe(static, a, b)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.isnan(want).any() and finite.any()
    assert torch.equal(bits(got[finite]), bits(want[finite])), _describe_difference(got[finite], want[finite])


# ---- the TMA + wgmma 3xTF32 GEMM (operands split in shared memory) ----------------------------------------

FC2_SPLITS = HIDDEN // K_SLICE
_GEMM_TILES = ((128, 32, 3, 2), (128, 32, 2, 2), (128, 16, 6, 3), (128, 16, 4, 4))
_TILE_IDS = ["bk32_s3_2", "bk32_s2_2", "bk16_s6_3", "bk16_s4_4"]


def _no_spills(report: str) -> bool:
    return re.search(r"(?<!\d)0 bytes spill stores", report) is not None


def _ptxas_ok(ptx: str, tmp_path) -> str:
    """ptxas -v's report (where ptxas is installed: CUDA 13.0 here); fails on an error."""
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stderr


@pytest.mark.slow
def test_wgmma_gemm_splits_in_shared_memory_and_runs_three_tf32_wgmma_per_chunk(tmp_path):
    pytest.importorskip("cutlass", exc_type=ImportError)
    from h3cute.kernels import get_spec
    from h3cute.kernels import wgmma_tf32 as W
    from h3cute.runtime.dsl import compile_variant

    spec = get_spec("tf32x3_wgmma_gemm")
    assert spec.archs == ("sm_90a",)
    for static in spec.variants("sm_90a"):
        _, ptxs = compile_variant(spec, "sm_90a", static, keep_ptx=True)
        ptx = "\n".join(ptxs)
        bn, bk, _, _ = static["tile"]
        _, _, a_mn, b_mn = W.ROLE_GEMMS[static["role"]]
        chunks = bk // 8
        # The consumer's k-tile body is emitted once: 3 wgmma per chunk, an IEEE add per accumulator
        # register (64 x bn over 128 threads) per chunk.
        assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{bn}k8.f32.tf32.tf32") == 3 * chunks, static
        assert ptx.count("add.rn.f32 ") == (bn // 2) * chunks, static
        assert "cp.async.bulk.tensor.2d" in ptx and "fence.proxy.async.shared::cta" in ptx
        assert "setmaxnreg.dec.sync.aligned.u32 \t80;" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t208;" in ptx
        # The split, once per k tile (the converter loop body is emitted once): per thread of the producer
        # warpgroup, a K-major operand's (128 x bk) tile in 16-byte vectors, one load and two stores each; an
        # MN-major one element by element, one load and two stores each.
        elems = 128 * bk // 128
        vec_ops = sum(elems // 4 for mn in (a_mn, b_mn) if not mn)
        scalar_ops = sum(elems for mn in (a_mn, b_mn) if mn)
        assert ptx.count("ld.shared.v4.b32") == vec_ops and ptx.count("st.shared.v4.b32") == 2 * vec_ops, static
        assert ptx.count("ld.shared.b32") == scalar_ops and ptx.count("st.shared.b32") == 2 * scalar_ops, static
        assert ptx.count("and.b32 \t%r") >= 4 * vec_ops + scalar_ops
        assert ".local" not in ptx and "atom." not in ptx
        if shutil.which("ptxas"):
            report = _ptxas_ok(ptx, tmp_path)
            assert _no_spills(report) and "warning" not in report.lower(), report
    variants = spec.variants("sm_90a")
    assert {v["tile"] for v in variants if v["role"] == "fc2"} == set(W.GEMM_TILES)  # fc2: every measured tile
    for role in W.ROLE_GEMMS:
        assert dict(role=role, tile=W.LAUNCH_TILE) in variants


@pytest.mark.slow
@pytest.mark.parametrize("bk", (16, 32))
def test_transposing_split_addresses_are_the_layouts_and_conflict_free(bk):
    """`_transpose_plan` (raises otherwise) for A and B at both k depths: the XOR addressing equals the MN-major
    raw and K-major big / small layouts' offsets for every element, and every warp access hits 32 banks."""
    pytest.importorskip("cutlass", exc_type=ImportError)
    import cutlass.cute as cute

    from h3cute.kernels import wgmma_tf32 as W

    plans = []

    @cute.jit
    def plan_all():
        for is_a in (True, False):
            raw = W._raw_smem_layout(128, bk, 3, True, is_a)
            mma = W.tf32_smem_layout(128, bk, 2, is_a=is_a)
            plans.append(W._transpose_plan(raw, mma, 128, bk))

    cute.compile(plan_all, options="--gpu-arch sm_90a")
    assert len(plans) == 2 and all(p.kb == min(bk, 32) for p in plans)


def test_wgmma_tiles_are_checked():
    pytest.importorskip("cutlass", exc_type=ImportError)
    from h3cute.kernels.wgmma_tf32 import GEMM_TILES, LAUNCH_TILE, WgmmaTile

    assert GEMM_TILES == _GEMM_TILES and LAUNCH_TILE in GEMM_TILES
    for tile in GEMM_TILES:
        assert WgmmaTile(*tile).astuple() == tile
    for bad in ((64, 32, 3, 2), (256, 32, 2, 2), (128, 64, 2, 2), (128, 32, 4, 2), (128, 32, 3, 3), (128, 8, 6, 3),
                (128, 32, 1, 2), (128, 32, 2, 1)):
        with pytest.raises(ValueError):
            WgmmaTile(*bad)


def test_perf_script_times_every_wgmma_tile():
    pytest.importorskip("cutlass", exc_type=ImportError)
    import runpy
    from pathlib import Path

    from h3cute.kernels.wgmma_tf32 import GEMM_TILES

    perf = runpy.run_path(str(Path(__file__).parents[1] / "perf" / "mlp_kernels.py"), run_name="imported")
    assert tuple(perf["WGMMA_FC2_TILES"]) == GEMM_TILES


def _wgmma(role, tile, a, b, shape):
    """Partials of the wgmma GEMM on NaN-poisoned output (a, b as the launcher passes them)."""
    from h3cute import runtime

    out = torch.full(shape, float("nan"), device="cuda")
    runtime.kernel("tf32x3_wgmma_gemm", a.device, role=role, tile=tile)(a, b, out)
    return out


def _fc2_inputs(num_rows: int, seed: int):
    g = _gen(seed)
    h = torch.nn.functional.silu(torch.randn(num_rows, HIDDEN, generator=g, device="cuda") * 2)
    w2 = torch.randn(N, HIDDEN, generator=g, device="cuda") * HIDDEN ** -0.5
    return h, w2


def _wgmma_fc2(h, w2, tile):
    return _wgmma("fc2", tile, h, w2, (FC2_SPLITS, h.shape[0], N))


def _mma_sync(role, num_rows, a, b, shape):
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    want = torch.full(shape, float("nan"), device="cuda")
    tile = getattr(L.pick_config(num_rows), role).astuple()
    runtime.kernel("timestep_mlp_gemm", a.device, role=role, tile=tile)(a, b, want)
    return want


def _check_partials(got, want, ref_a, ref_b, what):
    """got / want (S, M, N) against FP64 slice by slice (ref_a (M, K), ref_b (K, N)), then bitwise."""
    slices = got.shape[0]
    depth = ref_a.shape[1] // slices
    for s in range(slices):
        k = slice(depth * s, depth * (s + 1))
        ref = ref_a[:, k].double() @ ref_b[k].double()
        scale = ref_a[:, k].double().abs() @ ref_b[k].double().abs()
        assert torch.isfinite(got[s]).all(), (what, s)
        assert ((got[s].double() - ref).abs() <= 1e-5 * scale).all(), (what, s, "far from FP64")
        assert torch.equal(bits(got[s]), bits(want[s])), f"{what} slice {s}: {_describe_difference(got[s], want[s])}"


ROWS = (1, 33, 200, 257, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", _GEMM_TILES, ids=_TILE_IDS)
@pytest.mark.parametrize("num_rows", ROWS)
def test_wgmma_fc2_partials_equal_the_mma_sync_partials(num_rows, tile):
    """Bitwise: every slice partial of fc2 (T rows, K = 5376, 6 slices) equals timestep_mlp_gemm's for the
    launcher's config at that T; FP64 first, so a layout bug reads as such."""
    h, w2 = _fc2_inputs(num_rows, 5000 + num_rows)
    got = _wgmma_fc2(h, w2, tile)
    want = _mma_sync("fc2", num_rows, h, w2, got.shape)
    _check_partials(got, want, h, w2.t(), f"fc2 {tile}")


@pytest.mark.gpu
def test_wgmma_fc2_non_finite_and_special_inputs_land_where_mma_sync_puts_them():
    """NaN, +-inf, -0 and subnormal operands go through the shared-memory split as through mma.sync's."""
    h, w2 = _fc2_inputs(300, 5500)
    h[3, 5], h[9, 4000], h[17, 17] = float("nan"), float("inf"), -0.0
    h[40, 100:140] = 1e-40
    w2[100, 2000], w2[7, 900] = float("-inf"), float("nan")
    w2[50, 200:240] = -1e-39
    got = _wgmma_fc2(h, w2, _GEMM_TILES[0])
    want = _mma_sync("fc2", 300, h, w2, got.shape)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want).any()
    finite = ~torch.isnan(want)
    assert torch.equal(bits(got[finite]), bits(want[finite])), _describe_difference(got[finite], want[finite])


@pytest.mark.gpu
def test_wgmma_fc2_rows_are_batch_invariant():
    """A row alone, and inside batches where it sits at other tile positions, gives the same partial bits."""
    h, w2 = _fc2_inputs(300, 6001)
    full = _wgmma_fc2(h, w2, _GEMM_TILES[0])
    for lo, hi in ((0, 1), (137, 138), (5, 200), (299, 300), (100, 300)):
        part = _wgmma_fc2(h[lo:hi].contiguous(), w2, _GEMM_TILES[0])
        assert torch.equal(bits(part), bits(full[:, lo:hi])), (lo, hi)


# ---- the backward's roles: fc2_dgrad (w2 read MN-major) and the T-deep fc2_wgrad (both MN-major) ----------


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", ROWS)
def test_wgmma_fc2_dgrad_partials_equal_the_mma_sync_partials(num_rows):
    """dh partials (3, T, 5376) = grad (T, 2688) x w2 (2688, 5376) in 3 slices; both GEMMs read w2 through its
    transposed view (B = w2^T, MN-major), the wgmma one transposing it in shared memory."""
    from h3cute.launch import timestep_mlp as L

    g = _gen(7000 + num_rows)
    grad = torch.randn(num_rows, N, generator=g, device="cuda")
    w2 = torch.randn(N, HIDDEN, generator=g, device="cuda") * HIDDEN ** -0.5
    shape = (L.SPLITS["fc2_dgrad"], num_rows, HIDDEN)
    got = _wgmma("fc2_dgrad", L.WGMMA_TILE, grad, L.transposed(w2), shape)
    want = _mma_sync("fc2_dgrad", num_rows, grad, L.transposed(w2), shape)
    _check_partials(got, want, grad, w2, "fc2_dgrad")


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", ROWS)
def test_wgmma_fc2_wgrad_equals_the_mma_sync_wgrad(num_rows):
    """dW2 (1, 2688, 5376) = grad^T h over K = T, both read MN-major in place; TMA zero-fills the last k tile
    past T (the mma.sync kernel pads to its own tile_k). Relied on: acc starts at +0 and an RN sum is -0 only
    when both terms are, so a zero chunk (+0 or -0) changes no bit. Zero rows and a -0 column of grad put
    signed zeros in chunks; every mma.sync wgrad tile agrees."""
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    g = _gen(8000 + num_rows)
    grad = torch.randn(num_rows, N, generator=g, device="cuda")
    h = torch.nn.functional.silu(torch.randn(num_rows, HIDDEN, generator=g, device="cuda") * 2)
    grad[::4] = 0.0
    grad[:, 3] = -0.0
    wants = []
    for tile in sorted({cfg.fc2_wgrad.astuple() for cfg in L.CONFIGS}):
        want = torch.full((1, N, HIDDEN), float("nan"), device="cuda")
        runtime.kernel("timestep_mlp_gemm", grad.device, role="fc2_wgrad", tile=tile)(
            L.transposed(grad), L.transposed(h), want)
        wants.append(want)
    got = _wgmma("fc2_wgrad", L.WGMMA_TILE, L.transposed(grad), L.transposed(h), (1, N, HIDDEN))
    _check_partials(got, wants[0], grad.t(), h, "fc2_wgrad")
    assert not got[0, 3].any()
    for want in wants[1:]:
        assert torch.equal(bits(want), bits(wants[0]))


@pytest.mark.gpu
def test_wgmma_fc2_wgrad_reads_only_the_first_t_rows():
    """K = T exactly: rows of grad / h past T in the same allocation (NaN) never reach dW2."""
    from h3cute.launch import timestep_mlp as L

    g = _gen(8500)
    grad_buf = torch.full((300, N), float("nan"), device="cuda")
    h_buf = torch.full((300, HIDDEN), float("nan"), device="cuda")
    grad_buf[:257] = torch.randn(257, N, generator=g, device="cuda")
    h_buf[:257] = torch.randn(257, HIDDEN, generator=g, device="cuda")
    grad, h = grad_buf[:257], h_buf[:257]
    got = _wgmma("fc2_wgrad", L.WGMMA_TILE, L.transposed(grad), L.transposed(h), (1, N, HIDDEN))
    clean = _wgmma("fc2_wgrad", L.WGMMA_TILE, L.transposed(grad.clone()), L.transposed(h.clone()), (1, N, HIDDEN))
    assert torch.isfinite(got).all() and torch.equal(bits(got), bits(clean))
