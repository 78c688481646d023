"""TF32 wgmma (kernels/wgmma_tf32.py) against the mma.sync 3xTF32 kernel's bits.

CPU (slow: compiles): every probe variant compiles for sm_90a to TF32 wgmma, three per k8 chunk, one
IEEE add per accumulator register per chunk; where ptxas is installed, no spills.
GPU (`-m gpu`, H200): the probe's (64, N) output equals, bit for bit, the one-slice partial of the
production mma.sync kernel (timestep_mlp_gemm role fc2, slice s of a T = 64 call; columns past K in
the slice are zero, whose chunks add +0 and leave every bit alone) on random normal data, a wide
exponent range, cancelling pairs and subnormal-range products, for K = 8, 64, 896; non-finite inputs
give NaN / inf exactly where the mma.sync kernel gives them. Every output is poisoned with NaN first
and checked against FP64 before the bit comparison, so a layout bug and a rounding difference read
differently.
"""
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
    if shutil.which("ptxas"):
        src = tmp_path / "probe.ptx"
        src.write_text(ptx)
        run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "probe.cubin")],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert "0 bytes spill stores" in run.stderr, run.stderr


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
