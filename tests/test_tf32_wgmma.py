"""TF32 wgmma (kernels/wgmma_tf32.py) against the mma.sync 3xTF32 kernel's bits.

CPU (slow: compiles): every probe variant compiles for sm_90a to TF32 wgmma, three per k8 chunk, one
IEEE add per accumulator register per chunk, staging stores swizzled; where ptxas is installed, it
assembles (the GEMM and the split without spills).
GPU, the launcher's roles: fc2_dgrad (grad x w2^T through the transposing split of w2, 3 slices) and the
T-deep fc2_wgrad (grad^T x h^T, K = T zero-padded, with extra all-zero k tiles too) equal the mma.sync
role's partials bit for bit, zero rows and signed-zero products included.
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

from h3cute.widths import MLP_HIDDEN as HIDDEN, TEMB

from bitwise import bits
from compiled_ptx import ptx_of

N = TEMB  # fc2's out features
M, K_SLICE = 64, 896
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

    assert [dict(v) for v in W.PROBE_VARIANTS] == list(PROBE_VARIANTS)
    spec = W.SPECS[0]
    assert spec.archs == ("sm_90a",)
    ptxs = ptx_of(spec, "sm_90a", static)
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


# Every probe variant at every K that is a multiple of its tile_k (a probe runs whole k tiles only).
_PROBE_CASES = [(static, k) for static in PROBE_VARIANTS for k in (8, 64, 896) if k % static["tile_k"] == 0]


@pytest.mark.gpu
@pytest.mark.parametrize("data", ("normal", "wide_exponents", "cancellation", "subnormal_products"))
@pytest.mark.parametrize("static, k", _PROBE_CASES,
                         ids=[f"{_VARIANT_IDS[PROBE_VARIANTS.index(s)]}-{k}" for s, k in _PROBE_CASES])
def test_probe_gives_the_mma_sync_bits(static, k, data):
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


# ---- the TMA + wgmma 3xTF32 GEMM and its split ----------------------------------------------------------

FC2_SPLITS = HIDDEN // K_SLICE


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


def _tma_gemm_ptx(name: str, tmp_path, loads_per_k_tile: int):
    """(static, PTX, bn, chunks) of every sm_90a variant of the TF32 TMA GEMM `name`, after the checks both GEMMs
    share: a multiple of `loads_per_k_tile` TMA loads (the producer's loop may be unrolled), an IEEE add per
    accumulator register (64 x bn over 128 threads) per chunk, no local memory, no atomics; ptxas: no spills,
    no serialization warning."""
    from h3cute.kernels import get_spec

    spec = get_spec(name)
    assert spec.archs == ("sm_90a",)
    for static in spec.variants("sm_90a"):
        ptxs = ptx_of(spec, "sm_90a", static)
        ptx = "\n".join(ptxs)
        bn, bk, _ = static["tile"]
        chunks = bk // 8
        assert ptx.count("add.rn.f32 ") == (bn // 2) * chunks, static
        n_tma = ptx.count("cp.async.bulk.tensor.2d")
        assert n_tma and n_tma % loads_per_k_tile == 0, (static, n_tma)
        assert ".local" not in ptx and "atom." not in ptx
        if shutil.which("ptxas"):
            report = _ptxas_ok(ptx, tmp_path)
            assert _no_spills(report) and "warning" not in report.lower(), report
        yield static, ptx, bn, chunks


@pytest.mark.slow
def test_wgmma_gemm_compiles_to_three_tf32_wgmma_per_chunk(tmp_path):
    """Both operands from shared memory: 3 wgmma per chunk (the consumer's k-tile body is emitted once), four
    TMA loads per k tile."""
    pytest.importorskip("cutlass", exc_type=ImportError)
    from h3cute.kernels import get_spec
    from h3cute.kernels import wgmma_tf32 as W

    for static, ptx, bn, chunks in _tma_gemm_ptx("tf32x3_wgmma_gemm", tmp_path, 4):
        assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{bn}k8.f32.tf32.tf32") == 3 * chunks, static
    variants = get_spec("tf32x3_wgmma_gemm").variants("sm_90a")
    assert {v["tile"] for v in variants if v["k"] == HIDDEN} == set(W.GEMM_TILES)  # fc2: every measured tile
    for k, splits in W.ROLE_GEMMS.values():
        assert dict(k=k, splits=splits, tile=W.LAUNCH_TILE) in variants


@pytest.mark.slow
def test_weight_gemm_compiles_to_three_register_a_tf32_wgmma_per_chunk(tmp_path):
    """The weight split in registers: per k8 chunk three m64nNk8 TF32 wgmmas whose A operand is four registers
    (no A descriptor) and four 32-bit shared loads of W; three TMA loads per k tile."""
    pytest.importorskip("cutlass", exc_type=ImportError)

    for static, ptx, bn, chunks in _tma_gemm_ptx("tf32x3_wgmma_weight_gemm", tmp_path, 3):
        # the A operand after the accumulator list: a register list, or a descriptor (%rd)
        wgmmas = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k8\.f32\.tf32\.tf32 "
                            r"\{[^}]*\}, (\{[^}]*\}|%rd\d+)", ptx)
        assert len(wgmmas) == 3 * chunks, static
        assert all(a.startswith("{") and a.count("%r") == 4 for a in wgmmas), wgmmas  # A from registers
        assert ptx.count("ld.shared.b32") == 4 * chunks, static


def test_wgmma_tiles_are_checked():
    pytest.importorskip("cutlass", exc_type=ImportError)
    from h3cute.kernels.wgmma_tf32 import GEMM_TILES, WgmmaTile

    for tile in GEMM_TILES:
        assert WgmmaTile(*tile).astuple() == tile
    for bad in ((256, 32, 3), (120, 32, 3), (128, 64, 2), (128, 32, 4), (128, 8, 6), (128, 32, 1)):
        with pytest.raises(ValueError):
            WgmmaTile(*bad)


def test_perf_script_times_every_wgmma_tile():
    pytest.importorskip("cutlass", exc_type=ImportError)
    import runpy
    from pathlib import Path

    from h3cute.kernels.wgmma_tf32 import GEMM_TILES, WEIGHT_SMALL_TILES, WEIGHT_TILE

    perf = runpy.run_path(str(Path(__file__).parents[1] / "perf" / "mlp_kernels.py"), run_name="imported")
    assert tuple(perf["WGMMA_FC2_TILES"]) == GEMM_TILES
    assert tuple(perf["WEIGHT_TILES"]) == (WEIGHT_TILE,) + WEIGHT_SMALL_TILES


@pytest.mark.slow
def test_split_compiles_to_vector_copies(tmp_path):
    pytest.importorskip("cutlass", exc_type=ImportError)
    from h3cute.kernels import get_spec

    spec = get_spec("tf32_split")
    for static in spec.variants("sm_90a"):
        ptxs = ptx_of(spec, "sm_90a", static)
        ptx = "\n".join(ptxs)
        assert "and.b32" in ptx and "db, 4096;" in ptx
        if not static["transpose"]:
            assert "ld.global.v4.b32" in ptx and ptx.count("st.global.v4.b32") == 2
        if shutil.which("ptxas"):
            assert _no_spills(_ptxas_ok(ptx, tmp_path))


def _reference_split(x: torch.Tensor):
    """big = x & 0xffffe000, small = bits(x - big) + 2^12 (x - big is exact in FP32): gemm_tf32x3's split."""
    big = bits(x) & -8192
    small = bits(x - big.view(torch.float32)) + 4096
    return big.view(torch.float32), small.view(torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, depth", ((1, 8), (5, HIDDEN), (TEMB, HIDDEN), (200, TEMB)))
def test_split_gives_the_mma_sync_operand_bits(rows, depth):
    from h3cute import runtime

    x = torch.randn(rows, depth, generator=_gen(rows + depth), device="cuda")
    x[0, 0] = float("nan")
    if depth > 3:
        x[0, 1], x[0, 2], x[0, 3] = float("inf"), -0.0, 1e-40  # subnormal
    big, small = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    runtime.kernel("tf32_split", x.device, transpose=False)(x, big, small)
    want_big, want_small = _reference_split(x)
    assert torch.equal(bits(big), bits(want_big)) and torch.equal(bits(small), bits(want_small))


@pytest.mark.gpu
@pytest.mark.parametrize("depth, rows, depth_out", ((1, TEMB, 32), (5, HIDDEN, 32), (200, TEMB, 224),
                                                     (TEMB, HIDDEN, TEMB), (2048, 256, 2048), (33, 40, 64)))
def test_transposing_split_feeds_k_major_with_a_zero_tail(depth, rows, depth_out):
    """X^T (K, R) in (the backward's grad, h, dz, x and w^T operands) -> big, small (R, K_out), zero past K."""
    from h3cute import runtime

    xt = torch.randn(depth, rows, generator=_gen(depth * rows), device="cuda")
    big, small = (torch.full((rows, depth_out), float("nan"), device="cuda") for _ in range(2))
    runtime.kernel("tf32_split", xt.device, transpose=True)(xt, big, small)
    padded = torch.zeros(rows, depth_out, device="cuda")
    padded[:, :depth] = xt.t()
    want_big, want_small = _reference_split(padded)
    assert torch.equal(bits(big), bits(want_big)) and torch.equal(bits(small), bits(want_small))
    assert torch.equal(bits(big[:, depth:]), torch.zeros_like(bits(big[:, depth:])))


def _fc2_inputs(num_rows: int, seed: int):
    g = _gen(seed)
    h = torch.nn.functional.silu(torch.randn(num_rows, HIDDEN, generator=g, device="cuda") * 2)
    w2 = torch.randn(N, HIDDEN, generator=g, device="cuda") * HIDDEN ** -0.5
    return h, w2


def _wgmma_fc2(h, w2, tile):
    from h3cute import runtime

    split = runtime.kernel("tf32_split", h.device, transpose=False)
    parts = [torch.full_like(t, float("nan")) for t in (h, h, w2, w2)]
    split(h, parts[0], parts[1])
    split(w2, parts[2], parts[3])
    partials = torch.full((FC2_SPLITS, h.shape[0], N), float("nan"), device="cuda")
    runtime.kernel("tf32x3_wgmma_gemm", h.device, k=HIDDEN, splits=FC2_SPLITS, tile=tile)(*parts, partials)
    return partials


_GEMM_TILES = ((128, 32, 3), (128, 16, 6), (64, 32, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", _GEMM_TILES, ids=["bn128_bk32", "bn128_bk16", "bn64_bk32"])
@pytest.mark.parametrize("num_rows", (1, 5, 64, 200, 2048))
def test_wgmma_fc2_partials_equal_the_mma_sync_partials(num_rows, tile):
    """Bitwise: every slice partial of fc2 (T rows, K = 5376, 6 slices) equals timestep_mlp_gemm's for the
    launcher's config at that T; FP64 first, so a layout bug reads as such."""
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    h, w2 = _fc2_inputs(num_rows, 5000 + num_rows)
    got = _wgmma_fc2(h, w2, tile)
    want = torch.full_like(got, float("nan"))
    runtime.kernel("timestep_mlp_gemm", h.device, role="fc2", tile=L.pick_config(num_rows).fc2.astuple())(
        h, w2, want)
    for s in range(FC2_SPLITS):
        k = slice(K_SLICE * s, K_SLICE * (s + 1))
        ref = h[:, k].double() @ w2[:, k].double().t()
        scale = h[:, k].double().abs() @ w2[:, k].double().abs().t()
        assert torch.isfinite(got[s]).all(), s
        assert ((got[s].double() - ref).abs() <= 1e-5 * scale).all(), (s, "far from FP64")
        assert torch.equal(bits(got[s]), bits(want[s])), f"slice {s}: {_describe_difference(got[s], want[s])}"


@pytest.mark.gpu
def test_wgmma_fc2_rows_are_batch_invariant():
    """A row alone, and inside batches where it sits at other tile positions, gives the same partial bits."""
    h, w2 = _fc2_inputs(300, 6001)
    full = _wgmma_fc2(h, w2, _GEMM_TILES[0])
    for lo, hi in ((0, 1), (137, 138), (5, 200), (299, 300), (100, 300)):
        part = _wgmma_fc2(h[lo:hi].contiguous(), w2, _GEMM_TILES[0])
        assert torch.equal(bits(part), bits(full[:, lo:hi])), (lo, hi)


# ---- the backward's roles: fc2_dgrad and the T-deep fc2_wgrad -------------------------------------------


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


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (1, 200, 2048))
def test_wgmma_fc2_dgrad_partials_equal_the_mma_sync_partials(num_rows):
    """dh partials (3, T, 5376) = grad (T, 2688) x w2 (2688, 5376) in 3 slices: A split in place, B = w2^T
    through the transposing split; the mma.sync role reads w2 N-major in place."""
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    g = _gen(7000 + num_rows)
    grad = torch.randn(num_rows, N, generator=g, device="cuda")
    w2 = torch.randn(N, HIDDEN, generator=g, device="cuda") * HIDDEN ** -0.5
    k, splits = L.WGMMA_ROLES["fc2_dgrad"]
    parts = [torch.full_like(grad, float("nan")) for _ in range(2)] + \
        [torch.full((HIDDEN, N), float("nan"), device="cuda") for _ in range(2)]
    runtime.kernel("tf32_split", grad.device, transpose=False)(grad, parts[0], parts[1])
    runtime.kernel("tf32_split", grad.device, transpose=True)(w2, parts[2], parts[3])
    got = torch.full((splits, num_rows, HIDDEN), float("nan"), device="cuda")
    runtime.kernel("tf32x3_wgmma_gemm", grad.device, k=k, splits=splits, tile=L.WGMMA_TILE)(*parts, got)
    want = torch.full_like(got, float("nan"))
    runtime.kernel("timestep_mlp_gemm", grad.device, role="fc2_dgrad",
                   tile=L.pick_config(num_rows).fc2_dgrad.astuple())(grad, L.transposed(w2), want)
    _check_partials(got, want, grad, w2, "fc2_dgrad")


def _weight_gemm(role, w, x, tile=None):
    """P of the weight-in-registers GEMM: W = w2 (fc2) or w2^T read in place (fc2_dgrad), X split first."""
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    _, splits, w_k_major, _ = L.WEIGHT_ROLES[role]
    parts = [torch.full_like(x, float("nan")) for _ in range(2)]
    runtime.kernel("tf32_split", x.device, transpose=False)(x, *parts)
    features = w.shape[0] if w_k_major else w.shape[1]
    out = torch.full((splits, x.shape[0], features), float("nan"), device="cuda")
    w_arg = w if w_k_major else L.transposed(w)
    runtime.kernel("tf32x3_wgmma_weight_gemm", x.device, role=role, tile=tile or L.WEIGHT_TILE)(w_arg, *parts, out)
    return out


_WEIGHT_TILES = ((128, 32, 4), (16, 32, 10), (8, 32, 12))  # wgmma_tf32.WEIGHT_TILE + WEIGHT_SMALL_TILES


@pytest.mark.gpu
@pytest.mark.parametrize("tile", _WEIGHT_TILES, ids=lambda t: f"bn{t[0]}")
@pytest.mark.parametrize("num_rows", (1, 5, 9, 17, 64, 200, 256, 300, 2048))
def test_weight_gemm_fc2_partials_equal_the_mma_sync_partials(num_rows, tile):
    """fc2 with w2 split in registers (the weight as wgmma's A operand, D^T stored), every tile: every slice
    partial bitwise equal to timestep_mlp_gemm's, FP64 first."""
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    h, w2 = _fc2_inputs(num_rows, 9000 + num_rows)
    got = _weight_gemm("fc2", w2, h, tile)
    want = torch.full_like(got, float("nan"))
    runtime.kernel("timestep_mlp_gemm", h.device, role="fc2", tile=L.pick_config(num_rows).fc2.astuple())(
        h, w2, want)
    _check_partials(got, want, h, w2.t(), "fc2 (weight in registers)")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", _WEIGHT_TILES, ids=lambda t: f"bn{t[0]}")
@pytest.mark.parametrize("num_rows", (1, 4, 130, 256, 2048))
def test_weight_gemm_fc2_dgrad_partials_equal_the_mma_sync_partials(num_rows, tile):
    """dh partials with w2^T read in place (M-major weight tiles split in registers): bitwise equal to the
    mma.sync role's, FP64 first; non-finite grad values land where mma.sync puts them."""
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    g = _gen(9500 + num_rows)
    grad = torch.randn(num_rows, N, generator=g, device="cuda")
    w2 = torch.randn(N, HIDDEN, generator=g, device="cuda") * HIDDEN ** -0.5
    got = _weight_gemm("fc2_dgrad", w2, grad, tile)
    want = torch.full_like(got, float("nan"))
    runtime.kernel("timestep_mlp_gemm", grad.device, role="fc2_dgrad",
                   tile=L.pick_config(num_rows).fc2_dgrad.astuple())(grad, L.transposed(w2), want)
    _check_partials(got, want, grad, w2, "fc2_dgrad (weight in registers)")
    grad[0, 7], w2[11, 3] = float("inf"), float("nan")
    got, want = _weight_gemm("fc2_dgrad", w2, grad, tile), torch.full_like(want, 0.0)
    runtime.kernel("timestep_mlp_gemm", grad.device, role="fc2_dgrad",
                   tile=L.pick_config(num_rows).fc2_dgrad.astuple())(grad, L.transposed(w2), want)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (1, 100, 256, 2048))
def test_weight_gemm_fc1_equals_the_mma_sync_fc1(num_rows):
    """fc1 with w1 split in registers (x split first): h's operand pair (fc1_split) and z, h (fc1_zh) bitwise
    equal to timestep_mlp_gemm's fc1_split / fc1_zh, whose h is FP64-checked by the role tests."""
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    g = _gen(9700 + num_rows)
    x = torch.randn(num_rows, 256, generator=g, device="cuda")
    w1 = torch.randn(HIDDEN, 256, generator=g, device="cuda") * 256 ** -0.5
    b1 = torch.randn(HIDDEN, generator=g, device="cuda") * 0.02
    x_parts = [torch.full_like(x, float("nan")) for _ in range(2)]
    runtime.kernel("tf32_split", x.device, transpose=False)(x, *x_parts)
    mma_tile = L.pick_config(num_rows).fc1.astuple()
    for role in ("fc1_split", "fc1_zh"):
        got = [torch.full((num_rows, HIDDEN), float("nan"), device="cuda") for _ in range(2)]
        want = [torch.full_like(got[0], float("nan")) for _ in range(2)]
        runtime.kernel("tf32x3_wgmma_weight_gemm", x.device, role=role, tile=L.WEIGHT_FC1_TILE)(w1, *x_parts, b1,
                                                                                               *got)
        runtime.kernel("timestep_mlp_gemm", x.device, role=role, tile=mma_tile)(x, w1, b1, *want)
        assert all(torch.isfinite(t).all() for t in got), role
        for a, b in zip(got, want):
            assert torch.equal(bits(a), bits(b)), f"{role}: {_describe_difference(a, b)}"
    z = (x.double() @ w1.double().t() + b1.double())
    assert ((got[0].double() - z).abs() <= 1e-5 * (x.double().abs() @ w1.double().abs().t() + 1)).all()


@pytest.mark.gpu
def test_weight_gemm_rows_are_batch_invariant():
    """A row alone, and inside batches where it sits at other T-tile positions, gives the same partial bits."""
    h, w2 = _fc2_inputs(300, 9901)
    full = _weight_gemm("fc2", w2, h)
    for lo, hi in ((0, 1), (137, 138), (5, 200), (299, 300), (100, 300)):
        part = _weight_gemm("fc2", w2, h[lo:hi].contiguous())
        assert torch.equal(bits(part), bits(full[:, lo:hi])), (lo, hi)


def _wgmma_wgrad(grad, h, depth_out):
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    split = runtime.kernel("tf32_split", grad.device, transpose=True)
    parts = []
    for xt in (grad, h):
        pair = [torch.full((xt.shape[1], depth_out), float("nan"), device="cuda") for _ in range(2)]
        split(xt, *pair)
        parts += pair
    out = torch.full((1, N, HIDDEN), float("nan"), device="cuda")
    runtime.kernel("tf32x3_wgmma_gemm", grad.device, k=None, splits=1, tile=L.WGMMA_TILE)(*parts, out)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", (1, 33, 257, 2048))
def test_wgmma_fc2_wgrad_equals_the_mma_sync_wgrad_for_any_zero_padding(num_rows):
    """dW2 (1, 2688, 5376) = grad^T h over K = T: the transposing splits pad K with zeros to a multiple of
    32, here also with 64 more (two more all-zero k tiles). Relied on: acc starts at +0 and an RN sum is -0
    only when both terms are, so acc is never -0 and adding a zero chunk (+0 or -0) changes no bit; the
    mma.sync kernel pads to its own tile_k. Zero rows and a -0 column of grad put signed zeros in chunks."""
    from h3cute import runtime
    from h3cute.launch import timestep_mlp as L

    g = _gen(8000 + num_rows)
    grad = torch.randn(num_rows, N, generator=g, device="cuda")
    h = torch.nn.functional.silu(torch.randn(num_rows, HIDDEN, generator=g, device="cuda") * 2)
    grad[::4] = 0.0
    grad[:, 3] = -0.0
    tiles = {cfg.fc2_wgrad.astuple() for cfg in L.CONFIGS}
    wants = []
    for tile in sorted(tiles):  # every mma.sync wgrad tile agrees (tile_k 32: its own padding)
        want = torch.full((1, N, HIDDEN), float("nan"), device="cuda")
        runtime.kernel("timestep_mlp_gemm", grad.device, role="fc2_wgrad", tile=tile)(
            L.transposed(grad), L.transposed(h), want)
        wants.append(want)
    depth = -(-num_rows // L.WGMMA_K_PAD) * L.WGMMA_K_PAD
    for depth_out in (depth, depth + 64):
        got = _wgmma_wgrad(grad, h, depth_out)
        _check_partials(got, wants[0], grad.t(), h, f"fc2_wgrad K padded to {depth_out}")
        assert not got[0, 3].any()
    for want in wants[1:]:
        assert torch.equal(bits(want), bits(wants[0]))
