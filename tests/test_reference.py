"""h3cute.reference: the FP64 goldens are the documented math, the replays agree with them to their
precision, and example_inputs follows the seed reports' recipe."""
import math

import pytest
import torch
import torch.nn.functional as F

from h3cute import reference as R
from h3cute.widths import FINAL_PROJECTION, FREQ, FREQ_HALF, MODALITIES, NORM_EPS, TEMB



def test_sinusoid_golden_is_cos_then_sin_of_t_times_frequencies():
    t = torch.tensor([0.0, 0.37, 1.0], dtype=torch.float64)
    out = R.timestep_sinusoid_fp64(t)
    assert out.shape == (3, FREQ) and out.dtype == torch.float64
    assert torch.equal(out[0], torch.cat([torch.ones(FREQ_HALF), torch.zeros(FREQ_HALF)]).double())
    k = 77
    f = 10000 ** (-k / 128)
    assert math.isclose(out[1, k], math.cos(0.37 * f), rel_tol=1e-15)
    assert math.isclose(out[1, 128 + k], math.sin(0.37 * f), rel_tol=1e-15)


def test_norm_modulate_golden_by_hand():
    x, w, shift, scale, idx = R.example_inputs("norm_modulate", 4, num_timesteps=2)
    out = R.norm_modulate_fp64(x, w, shift, scale, idx, NORM_EPS)
    r = 3
    xr = x[r].double()
    expect = xr / math.sqrt(float((xr * xr).mean()) + NORM_EPS) * w.double() * (1 + scale[idx[r]].double()) \
        + shift[idx[r]].double()
    assert torch.allclose(out[r], expect, rtol=1e-12, atol=1e-12)


def test_projection_golden_rounds_silu_to_bf16_but_not_its_gradient():
    temb = torch.randn(2, TEMB, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, TEMB, dtype=torch.float64)
    # A small stand-in for the weight: the golden's math does not depend on the width.
    out = F.linear(R._silu_bf16_fp64(temb), w)
    assert torch.equal(out, F.linear(F.silu(temb).to(torch.bfloat16).double(), w))
    out.sum().backward()
    t = temb.detach()
    s = torch.sigmoid(t)
    assert torch.allclose(temb.grad, w.sum(0) * s * (1 + t * (1 - s)), rtol=1e-12)


@pytest.mark.parametrize("op, tol", [
    ("timestep_sinusoid", 2e-6), ("timestep_mlp", 2e-6), ("adaln_projection", 8e-3), ("final_adaln_out", 8e-3),
    ("adaln_row_gather", 0.0), ("norm_modulate", 8e-3), ("gate_residual", 8e-3), ("gate_residual_norm_modulate", 8e-3),
])
def test_replays_agree_with_fp64_goldens(op, tol):
    rows = 3 if op in ("timestep_mlp", "adaln_projection") else 33
    args = R.example_inputs(op, rows, seed=2)
    rep, gold = R.REPLAY[op](*args), R.FP64[op](*args)
    flat = lambda v: list(v) if isinstance(v, (list, tuple)) else [v]  # noqa: E731
    assert len(flat(rep)) == len(flat(gold))
    for r, g in zip(flat(rep), flat(gold)):
        assert r.shape == g.shape and not r.isnan().any()
        err = float((r.double() - g).abs().max() / g.abs().max())
        assert err <= tol, (op, err)


def test_example_inputs_row_layout_and_reproducibility():
    ti, tags = R.row_layout(64, 3, seed=4)
    assert tags[:3].tolist() == [0, 1, 2]
    assert set(tags.tolist()) == {0, 1, 2} and set(ti.tolist()) == {0, 1, 2}
    a, b = R.example_inputs("gate_residual", 64, seed=4), R.example_inputs("gate_residual", 64, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], R.example_inputs("gate_residual", 64, seed=5)[0])
    assert torch.equal(a[3], ti * MODALITIES + tags)
    x, nw, temb, pw, pb, t_idx = R.example_inputs("final_adaln_out", 9, num_timesteps=2)
    assert x.dtype == torch.bfloat16 and temb.dtype == torch.float32 and pw.shape == (FINAL_PROJECTION, TEMB)
    assert int(t_idx.max()) < 2 and float(nw.min()) >= 0.5
    with pytest.raises(ValueError, match="unknown h3 op 'rms_norm'"):
        R.example_inputs("rms_norm", 1)
