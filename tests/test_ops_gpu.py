"""torch.ops.h3 on CUDA (device machine only): opcheck, FP64 accuracy, no NaN through poisoned memory,
bitwise batch invariance of outputs and per-row gradients, repeatable parameter gradients, value checks.

Every op of `reference.OPS` runs here: an op whose `h3cute.launch.<op>` module is missing fails
(`test_every_op_has_its_launch_module`), it is not left out."""
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference as R
from h3cute.ops import _library

from bitwise import assert_same_bits, same_bits
from poison import poison_allocator

pytestmark = pytest.mark.gpu

OPS = R.OPS
ROW_ARGS = {  # positional arguments that carry one entry per row
    "timestep_sinusoid": (0,), "timestep_mlp": (0,), "adaln_projection": (0,), "final_adaln_out": (0, 5),
    "adaln_row_gather": (1,), "norm_modulate": (0, 4), "gate_residual": (0, 1, 3),
}
ROW_GRADS = {  # float row arguments whose gradients are per-row (batch-invariant, not reductions)
    "timestep_sinusoid": (), "timestep_mlp": (0,), "adaln_projection": (0,), "final_adaln_out": (0,),
    "adaln_row_gather": (), "norm_modulate": (0,), "gate_residual": (0, 1),
}
T_OPS = ("timestep_sinusoid", "timestep_mlp", "adaln_projection")
DIFFERENTIABLE = lambda op: op != "timestep_sinusoid"  # noqa: E731
TOL = {"timestep_sinusoid": 2e-6, "timestep_mlp": 1e-5}  # BF16 ops: 1e-2


def cuda_inputs(op, rows, seed=0, requires_grad=False):
    args = R.example_inputs(op, rows, num_timesteps=3, device="cuda", seed=seed)
    return [a.requires_grad_(requires_grad and DIFFERENTIABLE(op) and a.is_floating_point()) for a in args]


def flat(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def upstream(outs, seed=9):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(o.shape, generator=g, device="cuda").to(o.dtype) for o in outs]


def run(op, args, ups=None):
    """Outputs, and (with `ups`) the gradients of every float argument, of one call with fresh leaves."""
    leaves = [a.detach().clone().requires_grad_(ups is not None and a.is_floating_point()) for a in args]
    outs = flat(getattr(torch.ops.h3, op)(*leaves))
    if ups is None:
        return [o.detach() for o in outs], None
    torch.autograd.backward(outs, ups)
    return [o.detach() for o in outs], [a.grad for a in leaves]


def flat_results(result):
    """The outputs, then the gradients that exist, of a `run`."""
    outs, grads = result
    return [*outs, *(g for g in grads or () if g is not None)]


def rows_of(op, args, sl):
    return [a[sl] if i in ROW_ARGS[op] else a for i, a in enumerate(args)]


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_its_launch_module(op):
    launch = _library.resolve_launch(op)
    assert not isinstance(launch, _library.MissingLaunch), f"h3cute.launch.{op} is missing: the op has no CUDA kernel"


@pytest.mark.parametrize("op", OPS)
def test_opcheck_cuda(op):
    torch.library.opcheck(getattr(torch.ops.h3, op).default, cuda_inputs(op, 3 if op in T_OPS else 9, requires_grad=True))


@pytest.mark.parametrize("rows", [1, 4, 257])
@pytest.mark.parametrize("op", OPS)
def test_accuracy_against_fp64_forward_and_backward(op, rows):
    if op == "adaln_projection" and rows == 257:
        rows = 64
    args = cuda_inputs(op, rows, seed=rows)
    ups = upstream(flat(R.FP64[op](*args))) if DIFFERENTIABLE(op) else None
    outs, grads = run(op, args, ups)
    tol = TOL.get(op, 1e-2)
    args64 = [a.detach().double().requires_grad_(ups is not None) if a.is_floating_point() else a for a in args]
    gold = flat(R.FP64[op](*args64))
    for o, g in zip(outs, gold):
        assert torch.isfinite(o).all()
        assert float((o.double() - g.detach()).abs().max() / g.detach().abs().max()) <= tol, op
    if ups is None:
        return
    torch.autograd.backward(gold, [u.double() for u in ups])
    for a, g, a64 in zip(args, grads, args64):
        if a.is_floating_point():
            assert g is not None and g.dtype == a.dtype and g.shape == a.shape and torch.isfinite(g).all()
            err = float((g.double() - a64.grad).abs().max() / a64.grad.abs().max().clamp_min(1e-30))
            assert err <= (2e-5 if a.dtype == torch.float32 and op == "timestep_mlp" else 2e-2), (op, a.shape, err)


@pytest.mark.parametrize("op", OPS)
def test_poisoned_memory_never_reaches_the_output(op):
    """Outputs and gradients of a call on NaN-poisoned allocator pools (33 rows: most of them small-pool blocks)."""
    args = cuda_inputs(op, 33, seed=3)
    ups = upstream(flat(getattr(torch.ops.h3, op)(*args))) if DIFFERENTIABLE(op) else None
    clean = run(op, args, ups)
    poison_allocator()
    again = run(op, args, ups)
    for a, b in zip(flat_results(clean), flat_results(again)):
        assert torch.isfinite(b).all()
        assert_same_bits(b, a, f"{op} on poisoned memory")


# adaln_projection at 64 rows only: its per-T configs are covered by tests/test_adaln_projection.py; larger T here
# only costs memory.
INVARIANCE_CASES = [(op, rows) for op in OPS for rows in (64, 257, 2048) if op != "adaln_projection" or rows == 64]


@pytest.mark.parametrize("op, rows", INVARIANCE_CASES)
def test_rows_alone_equal_rows_in_the_batch_bitwise(op, rows):
    args = cuda_inputs(op, rows, seed=rows % 7 + 3)
    ups = upstream(flat(getattr(torch.ops.h3, op)(*args))) if DIFFERENTIABLE(op) else None
    outs, grads = run(op, args, ups)
    probes = sorted({0, rows - 1, *torch.randperm(rows, generator=torch.Generator().manual_seed(rows))[:14].tolist()})
    for r in probes:
        sl = slice(r, r + 1)
        one_ups = [u[sl] for u in ups] if ups is not None else None
        o1, g1 = run(op, rows_of(op, args, sl), one_ups)
        assert all(torch.equal(a, b[sl]) for a, b in zip(o1, outs)), (op, rows, r, "fwd")
        for i in ROW_GRADS[op]:
            assert torch.equal(g1[i], grads[i][sl]), (op, rows, r, "rowgrad", i)


@pytest.mark.parametrize("op", OPS)
def test_contiguous_sub_batches_equal_the_full_batch_bitwise(op):
    big = 4096 if op in T_OPS else 16384
    if op == "adaln_projection":
        big = 256
    args = cuda_inputs(op, big, seed=3)
    full, _ = run(op, args)
    start = 0
    for size in (1, 7, big // 8, big // 4, big):
        stop = min(start + size, big)
        part, _ = run(op, rows_of(op, args, slice(start, stop)))
        assert all(torch.equal(p, f[start:stop]) for p, f in zip(part, full)), (op, start, stop)
        start = stop
        if start == big:
            break


@pytest.mark.parametrize("op", [op for op in OPS if DIFFERENTIABLE(op)])
def test_parameter_gradients_are_bitwise_repeatable(op):
    args = cuda_inputs(op, 64 if op in T_OPS else 4097, seed=4)
    ups = upstream(flat(getattr(torch.ops.h3, op)(*args)))
    _, g1 = run(op, args, ups)
    _, g2 = run(op, args, ups)
    for a, b in zip(g1, g2):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_value_checks_raise_on_cuda():
    x, w, shift, scale, idx = cuda_inputs("norm_modulate", 9)
    bad = idx.clone()
    bad[4] = 9
    with pytest.raises(IndexError, match=r"h3::norm_modulate: adaln_indices\[4\] = 9 is outside \[0, 9\)"):
        torch.ops.h3.norm_modulate(x, w, shift, scale, bad)
    # timestep_sinusoid's range check is a device-side trap on CUDA: tests/test_timestep_sinusoid.py


def test_row_strided_tables_on_cuda():
    x, w, _, _, idx = cuda_inputs("norm_modulate", 65)
    table = R.example_inputs("adaln_row_gather", 1, num_timesteps=3, device="cuda")[0]
    c = table.chunk(6, dim=-1)
    assert torch.equal(torch.ops.h3.norm_modulate(x, w, c[0], c[1], idx),
                       torch.ops.h3.norm_modulate(x, w, c[0].contiguous(), c[1].contiguous(), idx))
    assert torch.equal(torch.ops.h3.gate_residual(x, x, c[2], idx),
                       torch.ops.h3.gate_residual(x, x, c[2].contiguous(), idx))


@pytest.mark.parametrize("op", OPS)
def test_empty_rows_on_cuda(op):
    args = cuda_inputs(op, 0)
    for o in flat(getattr(torch.ops.h3, op)(*args)):
        assert o.shape[0] == 0 and o.is_cuda
