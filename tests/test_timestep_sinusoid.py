"""timestep_sinusoid: compile-time PTX checks (CPU) and bitwise parity with diffusers on CUDA (gpu).

The contract (docs/timestep_sinusoid.md): for every FP32 t in [0, 1] the kernel's row equals, bit for
bit, diffusers' `get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)` run with
torch on the same GPU. The golden is `h3cute.reference.timestep_sinusoid_replay` on CUDA tensors
(op-for-op diffusers), and diffusers itself where it is installed. Comparisons are torch.equal on the
int32 bit patterns, so a NaN never passes and -0.0 != +0.0.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference
from h3cute.widths import FREQ as WIDTH

from compiled_ptx import ptx_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bits(x):
    return x.contiguous().view(torch.int32)


def _assert_bitwise(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.float32
    if not torch.equal(_bits(out), _bits(ref)):
        differ = (_bits(out) != _bits(ref)).nonzero()
        r, c = differ[0].tolist()
        raise AssertionError(
            f"{differ.shape[0]} of {out.numel()} outputs differ; first at row {r} col {c}: "
            f"kernel {out[r, c].item()!r} vs torch {ref[r, c].item()!r}"
        )


# ---- CPU: what the compiled code must contain ----------------------------------------------------------


@pytest.fixture(scope="module")
def ptx_by_arch():
    from h3cute.runtime.sources import kernels_package

    spec = kernels_package().all_specs()["timestep_sinusoid"]
    out = {}
    for arch in spec.archs:
        variants = {v["check_range"]: v for v in spec.variants(arch)}
        assert set(variants) == {True, False}, "one variant with the in-kernel range check, one without"
        for check, variant in variants.items():
            ptx = ptx_of(spec, arch, variant)
            assert len(ptx) == 1, "timestep_sinusoid is one compiled function"
            out[arch, check] = ptx[0]
    return spec, out


@pytest.mark.slow
def test_ptx_is_the_precise_libdevice_path(ptx_by_arch):
    spec, by_variant = ptx_by_arch
    by_arch = {arch: ptx for (arch, check), ptx in by_variant.items() if not check}
    assert set(by_arch) == {"sm_90a", "sm_100a"}
    for arch, ptx in by_arch.items():
        assert f".target {arch}" in ptx
        for marker in spec.ptx_markers:
            assert marker in ptx, f"{arch}: {marker!r} missing"
        for bad in spec.ptx_forbidden:
            assert bad not in ptx, f"{arch}: {bad!r} present"
        # Per lane: 4 frequencies x (k * c, * 2^-7, t * f), each an explicit round-to-nearest product.
        assert ptx.count("mul.rn.f32 %r") == 12, arch  # inline PTX; libdevice's own are tab-separated
        # One __nv_expf per frequency: the table is recomputed in registers, never loaded.
        assert ptx.count("ex2.approx.ftz.f32") == 4, arch
        # 4 sin + 4 cos, each with the Cody-Waite / Payne-Hanek switch at |a| = 105615.
        assert ptx.count("setp.ltu.f32") >= 8 and ptx.count("0f47CE4780") >= 8, arch
        # The only flush-to-zero and the only approximation is ex2 inside __nv_expf.
        assert ptx.count(".ftz") == ptx.count("ex2.approx.ftz.f32"), arch
        assert ptx.count(".approx") == ptx.count("ex2.approx.ftz.f32"), arch
        # One 4-byte load of t, two 16-byte stores (cos half, sin half) per lane.
        assert ptx.count("ld.global") == 1 and ptx.count("st.global.v4.b32") == 2, arch
        assert ptx.count("st.global") == 2, arch


@pytest.mark.slow
def test_range_check_variant_records_and_the_other_does_not(ptx_by_arch):
    """check_range=True: a bad t is recorded in the op's check slot (no host sync, no trap); False: no check
    code at all."""
    _, by_variant = ptx_by_arch
    for (arch, check), ptx in by_variant.items():
        assert "trap;" not in ptx and "vprintf" not in ptx, (arch, check)
        assert ("red.global.min.s64" in ptx) == check, (arch, check)
        # Either way the embedding itself is computed by the same precise path and written by two 16-byte stores
        # per lane (sm_100a emits the checked variant's as v2.b64).
        stores = ptx.count("st.global.v4.b32") + ptx.count("st.global.v2.b64")
        assert ptx.count("ex2.approx.ftz.f32") == 4 and stores == 2, (arch, check)


def test_frequency_constant_is_torchs_fp32_rounding():
    pytest.importorskip("cutlass")
    import importlib

    from h3cute.runtime.sources import kernels_package

    k = importlib.import_module(f"{kernels_package().__name__}.timestep_sinusoid")

    # torch's mul with a Python float casts it to the FP32 op-math type before multiplying.
    assert np.float32(k.NEG_LN_MAX_PERIOD_F32) == np.float32(-math.log(10000))
    assert np.float32(k.NEG_LN_MAX_PERIOD_F32).view(np.uint32) == 0xC1135D8E
    assert k.INV_HALF == 2.0**-7


def test_launch_module_does_not_import_cutlass():
    code = "import sys, h3cute.launch.timestep_sinusoid; sys.exit('cutlass' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]))
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


# ---- GPU: bitwise parity, invariance, no stray writes -------------------------------------------------

gpu = pytest.mark.gpu


def _op(t, check_range=True):
    return torch.ops.h3.timestep_sinusoid(t, check_range)


def _replay(t):
    return reference.timestep_sinusoid_replay(t)


def _check_chunked(t, chunk=1 << 20):
    for start in range(0, t.shape[0], chunk):
        part = t[start : start + chunk]
        _assert_bitwise(_op(part), _replay(part))


@gpu
def test_replay_is_diffusers_on_cuda():
    try:
        from diffusers.models import embeddings as diffusers_embeddings
    except ImportError as err:  # a GPU run without diffusers would not check the contract: fail, never skip
        pytest.fail(f"diffusers==0.42.1 is required on a CUDA machine (perf/device_run.sh installs the carried "
                    f"wheels from .devstage/whl): {err}")
    t = torch.rand(4097, device="cuda", generator=torch.Generator("cuda").manual_seed(11))
    ref = diffusers_embeddings.get_timestep_embedding(t, WIDTH, flip_sin_to_cos=True, downscale_freq_shift=0)
    _assert_bitwise(_replay(t), ref)
    _assert_bitwise(_op(t), ref)


@gpu
def test_bitwise_random_2_20():
    g = torch.Generator("cuda").manual_seed(1)
    t = torch.rand(1 << 20, device="cuda", generator=g)
    out = _op(t)
    assert not out.isnan().any()
    _assert_bitwise(out, _replay(t))


@gpu
def test_bitwise_endpoints_and_subnormals():
    special = [0.0, -0.0, 1.0, 0.5, 2.0**-149, 2.0**-126, 2.0**-126 - 2.0**-149, 1.0 - 2.0**-24, 2.0**-24,
               0.78539816, 0.7853982, 0.999, 1e-3, 1e-30]
    # -0.0 is in [0, 1] (it compares equal to 0): its sin half must keep the sign, as torch's does.
    t = torch.tensor(special, dtype=torch.float32, device="cuda")
    _assert_bitwise(_op(t), _replay(t))


@gpu
def test_bitwise_dense_grid_100001():
    t = torch.linspace(0, 1, 100001, dtype=torch.float32, device="cuda")
    _assert_bitwise(_op(t), _replay(t))


@gpu
def test_bitwise_every_fp32_in_half_to_one():
    # All 2^23 FP32 values of the binade [0.5, 1): bit patterns 0x3F000000 .. 0x3F7FFFFF.
    t = (torch.arange(1 << 23, dtype=torch.int32, device="cuda") + 0x3F000000).view(torch.float32)
    assert t[0].item() == 0.5 and t[-1].item() == 1.0 - 2.0**-24
    _check_chunked(t)


@gpu
def test_bitwise_log_uniform_over_all_binades():
    # Random bit patterns 0 .. 0x3F800000 (= 1.0): every binade of [0, 1] including subnormals, equally.
    g = torch.Generator("cuda").manual_seed(2)
    t = torch.randint(0, 0x3F800001, (1 << 20,), dtype=torch.int32, device="cuda", generator=g).view(torch.float32)
    _check_chunked(t)


@gpu
def test_bitwise_outside_the_contract_range_too():
    # With check_range=False the kernel still replays torch for any finite t (large |t| takes the
    # Payne-Hanek reduction in both); not part of the contract, but a cheap guard on the code path.
    g = torch.Generator("cuda").manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int32, device="cuda", generator=g)
    t = bits.view(torch.float32)
    t = t[torch.isfinite(t)]
    _assert_bitwise(_op(t, False), _replay(t))


@gpu
def test_accuracy_against_fp64():
    g = torch.Generator("cuda").manual_seed(4)
    t = torch.cat([torch.rand(65536, device="cuda", generator=g), torch.tensor([0.0, 1.0], device="cuda")])
    out = _op(t).double()
    gold = reference.timestep_sinusoid_fp64(t)
    rel = ((out - gold).abs().max() / gold.abs().max()).item()
    assert rel < 1e-6, rel


@gpu
def test_empty_and_single():
    empty = _op(torch.empty(0, device="cuda"))
    assert empty.shape == (0, WIDTH) and empty.dtype == torch.float32 and empty.is_cuda
    t = torch.tensor([0.25], device="cuda")
    _assert_bitwise(_op(t), _replay(t))


@gpu
@pytest.mark.parametrize("num_rows", [1, 2, 7, 8, 9, 257, 4097, 1 << 20])
def test_batch_invariance(num_rows):
    g = torch.Generator("cuda").manual_seed(100 + num_rows)
    t = torch.rand(num_rows, device="cuda", generator=g)
    full = _op(t)
    probes = sorted({0, num_rows - 1, num_rows // 2, num_rows // 3})
    for i in probes:
        _assert_bitwise(_op(t[i : i + 1]), full[i : i + 1])
    # The same rows inside a different, larger batch, shuffled and placed behind other timesteps.
    perm = torch.randperm(num_rows, device="cuda", generator=g)
    other = torch.rand(13, device="cuda", generator=g)
    mixed = _op(torch.cat([other, t[perm]]))
    _assert_bitwise(mixed[13:], full[perm])
    # Contiguous sub-batches that cover the whole batch.
    step = max(1, num_rows // 5)
    for start in range(0, num_rows, step):
        _assert_bitwise(_op(t[start : start + step]), full[start : start + step])


@gpu
@pytest.mark.parametrize("num_rows", [1, 5, 8, 13, 4099])
def test_poisoned_output_and_no_stray_writes(num_rows):
    from h3cute.launch import timestep_sinusoid as launch_mod

    t = torch.rand(num_rows, device="cuda")
    guard = 16
    buf = torch.full((num_rows + guard, WIDTH), float("nan"), device="cuda")
    launch_mod.launch(t, buf[:num_rows])
    assert not buf[:num_rows].isnan().any(), "an output element was never written"
    assert buf[num_rows:].isnan().all(), "the kernel wrote past row T"
    _assert_bitwise(buf[:num_rows], _replay(t))


@gpu
def test_strided_t():
    # The kernel takes t's stride as a runtime value (the op layer passes contiguous t only).
    from h3cute.launch import timestep_sinusoid as launch_mod

    base = torch.rand(2 * 1031, device="cuda")
    t = base[::2]
    out = torch.empty((t.shape[0], WIDTH), device="cuda")
    launch_mod.launch(t, out)
    _assert_bitwise(out, _replay(t.contiguous()))


@gpu
def test_runs_on_current_stream_without_host_sync():
    t = torch.rand(3001, device="cuda")
    ref = _replay(t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = _op(t, False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    side.synchronize()
    _assert_bitwise(out, ref)


@gpu
def test_repeatable():
    t = torch.rand(777, device="cuda")
    assert torch.equal(_bits(_op(t)), _bits(_op(t)))


@gpu
def test_rows_past_int32_byte_offsets():
    # Row 2^21 starts at byte 2^31; rows past 2^23 at element 2^31 (an 8 GiB output): 64-bit offsets.
    num_rows = (1 << 23) + 5
    t = torch.rand(num_rows, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    out = _op(t, False)
    for start in (0, (1 << 21) - 3, (1 << 23) - 3, num_rows - 64):
        _assert_bitwise(out[start : start + 64], _replay(t[start : start + 64]))


@gpu
def test_kernel_rejects_an_output_with_other_rows():
    # t and out share one symbolic row count in the compiled signature; a mismatch must raise, not
    # write past out (out is a view into a larger buffer so a missing check cannot corrupt memory).
    from h3cute.launch import timestep_sinusoid as launch_mod

    t = torch.rand(5, device="cuda")
    buf = torch.full((8, WIDTH), float("nan"), device="cuda")
    with pytest.raises((ValueError, TypeError, RuntimeError)):
        launch_mod.launch(t, buf[:4])
    torch.cuda.synchronize()
    assert buf.isnan().all()


_BAD_T_SCRIPT = """
import sys, torch, h3cute
t = torch.tensor([0.5, 0.25, float(sys.argv[1])], device="cuda")
out = torch.ops.h3.timestep_sinusoid(t)
try:
    h3cute.check_errors()
except ValueError as err:
    print("RAISED", err)
print("ROWS", out.isnan().all(1).tolist())
print("ALIVE", bool((torch.ops.h3.timestep_sinusoid(t[:2]) == out[:2]).all()))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["999.0", "nan", "-0.5"])
def test_range_check_raises_and_keeps_the_context(bad):
    """The default call checks t in the kernel: the bad row is NaN, check_errors raises a ValueError naming it,
    and the process (its CUDA context) goes on: a fresh process so that a broken context could not hide."""
    proc = subprocess.run([sys.executable, "-c", _BAD_T_SCRIPT, bad], capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "RAISED h3::timestep_sinusoid: t[2] is outside [0, 1]" in text, text
    assert "ROWS [False, False, True]" in text and "ALIVE True" in text, text


@pytest.mark.gpu
def test_range_check_off_computes_out_of_range_t():
    t = torch.tensor([0.5, 999.0], device="cuda")
    _assert_bitwise(torch.ops.h3.timestep_sinusoid(t, False), reference.timestep_sinusoid_replay(t))
