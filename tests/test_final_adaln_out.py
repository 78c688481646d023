"""final_adaln_out: the (T, 10752) projection (kernels/adaln_gemm.py) feeding the norm+modulate row kernels.

out[s] = rms_norm(x[s], nw) * (1 + scale[ti[s]]) + shift[ti[s]], (shift | scale) = projection of temb.
CPU: the launch glue on torch emulations of the kernels (tests/test_adaln_projection.py) and of the
norm launcher. GPU tests: accuracy against FP64 (forward and every gradient), bitwise per-row invariance of out and
dx, bitwise repeatable parameter gradients, the op's autograd equal to its backward op.
"""
import types

import pytest
import torch
from test_adaln_projection import _KernelEmulator, _close

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference
from h3cute.launch import adaln_projection as projection
from h3cute.launch import final_adaln_out as launch
from h3cute.ops.adaln import _final_backward_cpu
from h3cute.widths import FINAL_PROJECTION as N, HIDDEN as H, NORM_EPS, TEMB as D

import numerics
from bitwise import assert_same_bits



def test_final_adaln_out_glue_on_cpu_emulation(monkeypatch):
    """final_adaln_out slices shift | scale in that order and feeds d(shift | scale) back in that order."""
    calls = {}

    def forward_rows(x, w, shift, scale, idx, eps, op, argument, check):
        calls["strides"] = (shift.stride(0), scale.stride(0))
        calls["check"] = (op, argument, check)
        return reference.norm_modulate_replay(x, w, shift, scale, idx, eps)

    def backward_rows(grad, x, w, scale, idx, eps, op, table_grad):
        assert table_grad  # final_adaln_out takes [dshift | dscale] per timestep as one (T, 2H) tensor
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        sh = torch.zeros(scale.shape, dtype=torch.float64, requires_grad=True)
        sc = scale.double().requires_grad_()
        reference.norm_modulate_fp64(xd, wd, sh, sc, idx, eps).backward(grad.double())
        return xd.grad.to(x.dtype), wd.grad.to(w.dtype), torch.cat([sh.grad, sc.grad], 1).to(x.dtype)

    monkeypatch.setattr(launch, "norm_modulate",
                        types.SimpleNamespace(forward_rows=forward_rows, backward_rows=backward_rows))
    monkeypatch.setattr(projection.runtime, "kernel", _KernelEmulator())
    monkeypatch.setattr(projection.runtime, "arch_of", lambda device: "sm_90a")  # picks SM90_FAMILY

    g = torch.Generator().manual_seed(0)
    rows, timesteps = 37, 3
    x = (torch.randn((rows, H), generator=g) * 2).to(torch.bfloat16)
    nw = (0.5 + torch.rand((H,), generator=g)).to(torch.bfloat16)
    temb = torch.randn((timesteps, D), generator=g)
    w = (torch.randn((N, D), generator=g) * D ** -0.5).to(torch.bfloat16)
    b = (torch.randn((N,), generator=g) * 0.02).to(torch.bfloat16)
    ti = torch.randint(0, timesteps, (rows,), generator=g)
    out = launch.forward(x, nw, temb, w, b, ti, NORM_EPS, True)
    assert calls["strides"] == (N, N)  # row-strided halves of one table, no copy
    assert calls["check"] == ("final_adaln_out", "timestep_indices", True)  # its own check slot
    assert _close(out, reference.final_adaln_out_replay(x, nw, temb, w, b, ti, NORM_EPS), 1e-2)
    grad = torch.randn((rows, H), generator=g).to(torch.bfloat16)
    got = launch.backward(grad, x, nw, temb, w, b, ti, NORM_EPS)
    want = _final_backward_cpu(grad, x, nw, temb, w, b, ti, NORM_EPS)
    for a, ref, name in zip(got, want, ("dx", "dnw", "dtemb", "dW", "db")):
        assert _close(a, ref, 1e-2), name


gpu = pytest.mark.gpu


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _inputs(rows, timesteps=3, seed=3):
    g = _gen(seed)
    x = (torch.randn((rows, H), generator=g, device="cuda") * 2).to(torch.bfloat16)
    nw = (0.5 + torch.rand((H,), generator=g, device="cuda")).to(torch.bfloat16)
    temb = torch.randn((timesteps, D), generator=g, device="cuda")
    w = (torch.randn((N, D), generator=g, device="cuda") * D ** -0.5).to(torch.bfloat16)
    b = (torch.randn((N,), generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    ti = torch.randint(0, timesteps, (rows,), generator=torch.Generator().manual_seed(seed)).cuda()
    return x, nw, temb, w, b, ti


@gpu
@pytest.mark.parametrize("rows", [1, 4097, 32768])
def test_forward_contract(rows):
    """The (T, 10752) table holds the projection's bar (no worse than the replay's cuBLAS GEMM against FP64); the
    output is bitwise norm_modulate's replay on that table."""
    x, nw, temb, w, b, ti = _inputs(rows)
    out = torch.ops.h3.final_adaln_out(x, nw, temb, w, b, ti)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    fwd_out, table = torch.ops.h3.final_adaln_out_fwd(x, nw, temb, w, b, ti)
    assert_same_bits(fwd_out, out, "final_adaln_out_fwd vs final_adaln_out")
    numerics.assert_no_worse_than_replay(table, reference.final_projection_table(temb, w, b),
                                         reference.adaln_projection_fp64(temb, w, b), f"table, S={rows}")
    assert_same_bits(out, reference.norm_modulate_replay(x, nw, table[:, :H], table[:, H:], ti),
                     f"out vs the norm's replay on the table, S={rows}")


@gpu
@pytest.mark.parametrize("rows", [1, 4097])
def test_backward_contract(rows):
    """dx, d_norm_weight and the BF16 table gradient: one rounding of FP32 math and sums; d_temb within 1e-5 of
    FP64 of the projection backward of that table gradient; dW, db no worse than the replay's on it."""
    x, nw, temb, w, b, ti = _inputs(rows, seed=5)
    grad = torch.randn(x.shape, generator=_gen(9), device="cuda").to(torch.bfloat16)
    got = torch.ops.h3.final_adaln_out_backward(grad, x, nw, temb, w, b, ti, NORM_EPS)
    for g, name in zip(got, ("dx", "dnw", "dtemb", "dW", "db")):
        assert g.dtype == (torch.float32 if name == "dtemb" else torch.bfloat16), name
    table = torch.ops.h3.final_adaln_out_fwd(x, nw, temb, w, b, ti)[1]
    numerics.assert_final_adaln_out_backward(got, grad, x, nw, temb, w, b, ti, table, f"S={rows}")


@gpu
def test_row_invariance_of_out_and_dx():
    rows = 4097
    x, nw, temb, w, b, ti = _inputs(rows, seed=7)
    x[5::13] *= 50  # adversarial neighbours
    grad = torch.randn(x.shape, generator=_gen(10), device="cuda").to(torch.bfloat16)
    full = launch.forward(x, nw, temb, w, b, ti)
    full_dx = launch.backward(grad, x, nw, temb, w, b, ti, NORM_EPS)[0]
    for size in (1, 7, 1024, 2048):
        for start in {0, (rows - size) // 2, rows - size}:
            sl = slice(start, start + size)
            assert_same_bits(launch.forward(x[sl], nw, temb, w, b, ti[sl]), full[sl], f"out rows {start}+{size}")
            dx = launch.backward(grad[sl], x[sl], nw, temb, w, b, ti[sl], NORM_EPS)[0]
            assert_same_bits(dx, full_dx[sl], f"dx rows {start}+{size}")
    rev = torch.arange(rows - 1, -1, -1, device="cuda")
    assert_same_bits(launch.forward(x[rev], nw, temb, w, b, ti[rev]), full[rev], "out reversed")


@gpu
def test_params_repeatable():
    x, nw, temb, w, b, ti = _inputs(4097, seed=11)
    grad = torch.randn(x.shape, generator=_gen(12), device="cuda").to(torch.bfloat16)
    first = launch.backward(grad, x, nw, temb, w, b, ti, NORM_EPS)
    second = launch.backward(grad, x, nw, temb, w, b, ti, NORM_EPS)
    for a, b_, name in zip(first, second, ("dx", "dnw", "dtemb", "dW", "db")):
        assert_same_bits(a, b_, name)


@gpu
def test_autograd_matches_backward_op():
    x, nw, temb, w, b, ti = _inputs(257, seed=13)
    leaves = [t.clone().requires_grad_() for t in (x, nw, temb, w, b)]
    out = torch.ops.h3.final_adaln_out(*leaves, ti)
    grad = torch.randn(out.shape, generator=_gen(14), device="cuda").to(torch.bfloat16)
    out.backward(grad)
    expect = torch.ops.h3.final_adaln_out_backward(grad, x, nw, temb, w, b, ti, NORM_EPS)
    for leaf, e, name in zip(leaves, expect, ("dx", "dnw", "dtemb", "dW", "db")):
        assert_same_bits(leaf.grad, e, name)
