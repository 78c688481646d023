"""Every validation error of torch.ops.h3 fires on CPU with a message naming op, argument, expectation."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import h3cute
from h3cute import reference as R
from h3cute.widths import BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, FREQ, HIDDEN as H, MLP_HIDDEN, NORM_EPS, TEMB

ops = torch.ops.h3
BF16, F16 = torch.bfloat16, torch.float16


@pytest.fixture(scope="module")
def mlp():
    return R.example_inputs("timestep_mlp", 2)


@pytest.fixture(scope="module")
def final():
    return R.example_inputs("final_adaln_out", 5, num_timesteps=2)


@pytest.fixture(scope="module")
def nm():
    return R.example_inputs("norm_modulate", 5, num_timesteps=2)


@pytest.fixture(scope="module")
def gr():
    return R.example_inputs("gate_residual", 5, num_timesteps=2)


@pytest.fixture(scope="module")
def gather():
    return R.example_inputs("adaln_row_gather", 5, num_timesteps=2)


# ---- timestep_sinusoid -------------------------------------------------------------------------------

@pytest.mark.parametrize("t, err, match", [
    (torch.tensor([0.2, 750.0]), ValueError, r"t\[1\] = 750.0 \(t looks scaled by 1000"),
    (torch.tensor([0.2, 1.0001]), ValueError, r"t must lie in \[0, 1\], got t\[1\]"),
    (torch.tensor([0.5, -0.25]), ValueError, r"got t\[1\] = -0.25$"),
    (torch.tensor([0.5, float("nan")]), ValueError, r"t\[1\] is NaN"),
    (torch.tensor([10, 20]), TypeError, r"t must be a floating tensor.*got int64.*t / 1000"),
    (torch.rand(2, 2), ValueError, r"t must be 1-D \(T,\).*got shape \(2, 2\)"),
    (torch.rand(4)[::2], ValueError, r"t must be contiguous"),
])
def test_timestep_sinusoid_rejects(t, err, match):
    with pytest.raises(err, match=rf"h3::timestep_sinusoid: .*{match}"):
        ops.timestep_sinusoid(t)


def test_timestep_sinusoid_range_check_is_optional_and_narrow_t_is_widened_as_diffusers_does():
    assert ops.timestep_sinusoid(torch.tensor([750.0]), False).shape == (1, FREQ)
    assert ops.timestep_sinusoid(torch.tensor([0.0, 1.0])).shape == (2, 256)  # both ends are in range
    for dtype in (BF16, F16, torch.float64):
        t = torch.rand(4).to(dtype)
        out = ops.timestep_sinusoid(t)
        assert out.dtype == torch.float32 and torch.equal(out, ops.timestep_sinusoid(t.float()))


# ---- timestep_mlp --------------------------------------------------------------------------------------

@pytest.mark.parametrize("i, bad, err, match", [
    (0, lambda a: a.to(BF16), TypeError, r"x must be float32, got bfloat16 \(the H3 time_embedder is an FP32"),
    (3, lambda a: a.to(F16), TypeError, r"w2 must be float32, got float16"),
    (0, lambda a: a[:, :128], ValueError, rf"x must have shape \(T, {FREQ}\), got \(2, 128\)"),
    (2, lambda a: a[:100], ValueError, rf"b1 must have shape \({MLP_HIDDEN},\), got \(100,\)"),
    (1, lambda a: a.t().contiguous().t(), ValueError, r"w1 must be contiguous"),
])
def test_timestep_mlp_rejects(mlp, i, bad, err, match):
    args = list(mlp)
    args[i] = bad(args[i])
    with pytest.raises(err, match=rf"h3::timestep_mlp: {match}"):
        ops.timestep_mlp(*args)


def test_timestep_mlp_backward_rejects_row_mismatch(mlp):
    x, w1, b1, w2, _ = mlp
    with pytest.raises(ValueError, match=r"h3::timestep_mlp_backward: grad has 3 rows, x has 2"):
        ops.timestep_mlp_backward(torch.zeros(3, TEMB), x, w1, b1, w2)


# ---- final_adaln_out / adaln_projection ----------------------------------------------------------------

@pytest.mark.parametrize("i, bad, err, match", [
    (2, lambda a: a.to(BF16), TypeError, r"temb must be float32, got bfloat16 \(known defect: cast after SiLU"),
    (2, lambda a: a.to(F16), TypeError, r"temb must be float32, got float16 \(known defect"),
    (0, lambda a: a.float(), TypeError, r"x must be bfloat16, got float32"),
    (1, lambda a: a[:-1], ValueError, rf"norm_weight must have shape \({H},\)"),
    (3, lambda a: a[:H], ValueError, rf"proj_weight must have shape \({FINAL_PROJECTION}, {TEMB}\)"),
    (4, lambda a: a.float(), TypeError, r"proj_bias must be bfloat16"),
    (5, lambda a: a.int(), TypeError, r"timestep_indices must be int64, got int32"),
    (5, lambda a: a[:3], ValueError, r"timestep_indices has 3 rows, x has 5"),
    (5, lambda a: torch.tensor([0, 1, 1, 2, 9]), IndexError,
     r"timestep_indices\[3\] = 2 is outside \[0, 2\) \(temb has 2 timestep rows\); indices are never clamped"),
    (5, lambda a: torch.tensor([0, -1, 1, 0, 0]), IndexError, r"timestep_indices\[1\] = -1 is outside"),
])
def test_final_adaln_out_rejects(final, i, bad, err, match):
    args = list(final)
    args[i] = bad(args[i])
    with pytest.raises(err, match=rf"h3::final_adaln_out: {match}"):
        ops.final_adaln_out(*args)


@pytest.mark.parametrize("eps", [0.0, -NORM_EPS, float("nan")])
def test_eps_must_be_positive(final, nm, eps):
    with pytest.raises(ValueError, match=r"h3::final_adaln_out: eps must be > 0"):
        ops.final_adaln_out(*final, eps)
    with pytest.raises(ValueError, match=r"h3::norm_modulate: eps must be > 0"):
        ops.norm_modulate(*nm, eps)


def test_adaln_projection_rejects():
    temb = torch.zeros(2, TEMB)
    w, b = torch.zeros(BLOCK_PROJECTION, TEMB, dtype=BF16), torch.zeros(BLOCK_PROJECTION, dtype=BF16)
    with pytest.raises(TypeError, match=r"h3::adaln_projection: temb must be float32, got bfloat16 \(known defect"):
        ops.adaln_projection(temb.to(BF16), w, b)
    with pytest.raises(ValueError, match=rf"h3::adaln_projection: weight must have shape "
                                         rf"\({BLOCK_PROJECTION}, {TEMB}\), got \({FINAL_PROJECTION}"):
        ops.adaln_projection(temb, w[:FINAL_PROJECTION], b)
    with pytest.raises(ValueError, match=rf"h3::adaln_projection: temb must have shape \(T, {TEMB}\)"):
        ops.adaln_projection(temb[:, :256], w, b)
    with pytest.raises(TypeError, match=r"h3::adaln_projection: bias must be bfloat16, got float32"):
        ops.adaln_projection(temb, w, b.float())
    with pytest.raises(ValueError, match=r"h3::adaln_projection_backward: grad has 1 rows, temb has 2"):
        ops.adaln_projection_backward(torch.zeros(1, BLOCK_PROJECTION, dtype=BF16), temb, w)


# ---- adaln_row_gather / norm_modulate / gate_residual --------------------------------------------------

def test_adaln_row_gather_rejects(gather):
    table, idx = gather
    with pytest.raises(ValueError, match=rf"h3::adaln_row_gather: table must have shape \(3T, {BLOCK_TABLE}\)"):
        ops.adaln_row_gather(table[:, :H], idx)
    overlapping = table.as_strided((6, BLOCK_TABLE), (H, 1))
    with pytest.raises(ValueError, match=r"table must have unit-stride, non-overlapping rows"):
        ops.adaln_row_gather(overlapping, idx)
    with pytest.raises(IndexError, match=r"adaln_indices\[2\] = 6 is outside \[0, 6\) \(the table has 6 rows"):
        ops.adaln_row_gather(table, torch.tensor([0, 5, 6, 7]))
    with pytest.raises(ValueError, match=r"adaln_indices must have shape \(S,\), got \(5, 1\)"):
        ops.adaln_row_gather(table, idx[:, None])
    grads = [torch.zeros(5, H, dtype=BF16)] * 5
    with pytest.raises(ValueError, match=r"h3::adaln_row_gather_backward: grads must hold 6 tensors.*got 5"):
        ops.adaln_row_gather_backward(grads, idx, 6)


def test_norm_modulate_rejects(nm):
    x, w, shift, scale, idx = nm
    with pytest.raises(ValueError, match=r"h3::norm_modulate: shift has 3 rows, scale has 6"):
        ops.norm_modulate(x, w, shift[:3], scale, idx)
    with pytest.raises(ValueError, match=r"h3::norm_modulate: scale must have unit-stride"):
        ops.norm_modulate(x, w, shift, scale.t().contiguous().t(), idx)
    with pytest.raises(ValueError, match=r"h3::norm_modulate: x must be contiguous"):
        ops.norm_modulate(torch.cat([x, x], 1)[:, ::2], w, shift, scale, idx)
    with pytest.raises(TypeError, match=r"h3::norm_modulate: weight must be bfloat16, got float32"):
        ops.norm_modulate(x, w.float(), shift, scale, idx)
    with pytest.raises(IndexError, match=r"h3::norm_modulate: adaln_indices\[0\] = -3 is outside \[0, 6\)"):
        ops.norm_modulate(x, w, shift, scale, -3 * torch.ones_like(idx))
    with pytest.raises(ValueError, match=r"h3::norm_modulate_backward: scale has 6 rows but table_rows = 9"):
        ops.norm_modulate_backward(x, x, w, scale, idx, NORM_EPS, 9)


def test_gate_residual_rejects(gr):
    res, y, gate, idx = gr
    with pytest.raises(ValueError, match=r"h3::gate_residual: residual has 4 rows, y has 5"):
        ops.gate_residual(res[:4], y, gate, idx)
    with pytest.raises(TypeError, match=r"h3::gate_residual: gate must be bfloat16, got float16"):
        ops.gate_residual(res, y, gate.to(F16), idx)
    with pytest.raises(IndexError, match=r"h3::gate_residual: adaln_indices\[4\] = 6 is outside \[0, 6\)"):
        ops.gate_residual(res, y, gate, torch.tensor([0, 1, 2, 3, 6]))


def test_devices_must_agree(gr):
    res, y, gate, idx = gr
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda1 = torch.empty(5, H, dtype=BF16, device="cuda:1")
        with pytest.raises(ValueError, match=r"h3::gate_residual: residual is on cuda:1"):
            ops.gate_residual(cuda1, y.to("cuda:0"), gate.to("cuda:0"), idx.to("cuda:0"))
        with pytest.raises(ValueError, match=r"h3::gate_residual: adaln_indices is on cpu"):
            ops.gate_residual(cuda1, cuda1, gate.to("cuda:1"), idx)


# ---- adaln_indices ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ti, tags, T, err, match", [
    ([0, 1, 2, 1], [0, 1, 2, 0], 2, IndexError, r"timestep_indices\[2\] = 2 is outside \[0, 2\) \(num_timesteps = 2\)"),
    ([0, -1, 0, 0], [0, 1, 2, 0], 2, IndexError, r"timestep_indices\[1\] = -1"),
    ([0, 0, 0, 0], [0, 1, 2, 3], 2, IndexError, r"token_tags\[3\] = 3 is outside \[0, 3\) \(tags are 0 video, 1 text"),
    ([0, 0, 0, 0], [0, -2, 2, 1], 2, IndexError, r"token_tags\[1\] = -2"),
    ([0, 0, 0], [0, 1, 2, 1], 2, ValueError, r"token_tags has shape \(4,\), timestep_indices \(3,\)"),
    ([0, 0, 0], [0, 1, 2], -1, ValueError, r"num_timesteps must be an int >= 0, got -1"),
    ([0, 0, 0], [0, 1, 2], True, ValueError, r"num_timesteps must be an int >= 0, got True"),
])
def test_adaln_indices_rejects(ti, tags, T, err, match):
    with pytest.raises(err, match=rf"h3::adaln_indices: {match}"):
        h3cute.adaln_indices(torch.tensor(ti), torch.tensor(tags), T)


def test_adaln_indices_requires_int64():
    with pytest.raises(TypeError, match=r"h3::adaln_indices: token_tags must be int64, got int32"):
        h3cute.adaln_indices(torch.tensor([0]), torch.tensor([0], dtype=torch.int32), 1)
