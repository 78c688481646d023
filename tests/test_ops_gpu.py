"""torch.ops.h3 on CUDA (device machine only): opcheck, FP64 accuracy, no NaN through poisoned memory,
bitwise batch invariance of outputs and per-row gradients, repeatable parameter gradients, value checks.

Every op of `reference.OPS` runs here: an op whose `h3cute.launch.<op>` module is missing fails
(`test_every_op_has_its_launch_module`), it is not left out."""
import itertools

import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference as R
from h3cute.ops import _library
from h3cute.widths import HIDDEN as H

import numerics
from bitwise import assert_same_bits, same_bits
from poison import poison_allocator

pytestmark = pytest.mark.gpu

OPS = R.OPS
ROW_ARGS = {  # positional arguments that carry one entry per row
    "timestep_sinusoid": (0,), "timestep_mlp": (0,), "adaln_projection": (0,), "final_adaln_out": (0, 5),
    "adaln_row_gather": (1,), "norm_modulate": (0, 4), "gate_residual": (0, 1, 3),
    "gate_residual_norm_modulate": (0, 1, 6),
}
ROW_GRADS = {  # float row arguments whose gradients are per-row (batch-invariant, not reductions)
    "timestep_sinusoid": (), "timestep_mlp": (0,), "adaln_projection": (0,), "final_adaln_out": (0,),
    "adaln_row_gather": (), "norm_modulate": (0,), "gate_residual": (0, 1), "gate_residual_norm_modulate": (0, 1),
}
T_OPS = ("timestep_sinusoid", "timestep_mlp", "adaln_projection")
DIFFERENTIABLE = lambda op: op != "timestep_sinusoid"  # noqa: E731


def cuda_inputs(op, rows, seed=0, requires_grad=False):
    args = R.example_inputs(op, rows, num_timesteps=3, device="cuda", seed=seed)
    return [a.requires_grad_(requires_grad and DIFFERENTIABLE(op) and a.is_floating_point()) for a in args]


def flat(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def upstream(outs, seed=9):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(o.shape, generator=g, device="cuda").to(o.dtype) for o in outs]


def run(op, args, ups=None, fn=None):
    """Outputs, and (with `ups`) the gradients of every float argument, of one call of `fn` (torch.ops.h3.<op>) with
    fresh leaves."""
    leaves = [a.detach().clone().requires_grad_(ups is not None and a.is_floating_point()) for a in args]
    outs = flat((fn or getattr(torch.ops.h3, op))(*leaves))
    if ups is None:
        return [o.detach() for o in outs], None
    torch.autograd.backward(outs, ups)
    return [o.detach() for o in outs], [a.grad for a in leaves]


def flat_results(result):
    """The outputs, then the gradients that exist, of a `run`."""
    outs, grads = result
    return [*outs, *(g for g in grads or () if g is not None)]


def run_replay(op, args, ups=None):
    """`run` on the diffusers replay (cuBLAS GEMMs, torch autograd): the negative controls' subject."""
    return run(op, args, ups, fn=R.REPLAY[op])


def rows_of(op, args, sl):
    return [a[sl] if i in ROW_ARGS[op] else a for i, a in enumerate(args)]


def row_invariance_failures(call, op, args, ups, probes) -> list:
    """(row, what) for each probe row whose output, or per-row gradient, computed alone by `call` (run or
    run_replay) differs in any bit from its row computed inside the whole batch."""
    outs, grads = call(op, args, ups)
    failures = []
    for r in probes:
        sl = slice(r, r + 1)
        o1, g1 = call(op, rows_of(op, args, sl), [u[sl] for u in ups] if ups is not None else None)
        if not all(same_bits(a, b[sl]) for a, b in zip(o1, outs)):
            failures.append((r, "fwd"))
        failures += [(r, f"rowgrad {i}") for i in ROW_GRADS[op] if not same_bits(g1[i], grads[i][sl])]
    return failures


def repeatability_failures(call, op, args, ups) -> list:
    """Indices of the arguments whose gradients differ in any bit between two calls of `call` on the same inputs."""
    _, first = call(op, args, ups)
    _, second = call(op, args, ups)
    return [i for i, (a, b) in enumerate(zip(first, second))
            if (a is None) != (b is None) or (a is not None and not same_bits(a, b))]


@pytest.mark.parametrize("op", OPS)
def test_every_op_has_its_launch_module(op):
    launch = _library.resolve_launch(op)
    assert not isinstance(launch, _library.MissingLaunch), f"h3cute.launch.{op} is missing: the op has no CUDA kernel"


@pytest.mark.parametrize("op", OPS)
def test_opcheck_cuda(op):
    args = cuda_inputs(op, 3 if op in T_OPS else 9, requires_grad=True)
    torch.library.opcheck(getattr(torch.ops.h3, op).default, args)


# ---- each op's numeric contract (docs/timestep_sinusoid.md, timestep_mlp.md, adaln_projection.md, row_kernels.md) --

MLP_FWD_TOL, MLP_GRAD_TOL = 2e-6, 1e-5  # docs/timestep_mlp.md: FP32 accuracy on tensor cores (test_timestep_mlp.py)


def _sinusoid_contract(args, ups, outs, grads):
    assert_same_bits(outs[0], R.timestep_sinusoid_replay(*args), "timestep_sinusoid vs torch's (diffusers') bits")


def _mlp_contract(args, ups, outs, grads):
    leaves = [a.detach().double().requires_grad_() for a in args]
    gold = R.timestep_mlp_fp64(*leaves)
    assert numerics.rel_err(outs[0], gold.detach()) <= MLP_FWD_TOL
    gold.backward(ups[0].double())
    for name, g, leaf in zip(("dx", "dw1", "db1", "dw2", "db2"), grads, leaves):
        assert g.dtype == torch.float32 and numerics.rel_err(g, leaf.grad) <= MLP_GRAD_TOL, name


def _projection_contract(args, ups, outs, grads):
    temb, w, b = args
    replay_out, _, replay_dw, replay_db = numerics.projection_replay(temb, w, b, ups[0])
    numerics.assert_no_worse_than_replay(outs[0], replay_out, R.adaln_projection_fp64(temb, w, b), "table")
    ref_dtemb, ref_dw, ref_db = numerics.projection_grads_fp64(ups[0], temb, w)
    assert numerics.rel_err(grads[0], ref_dtemb) <= numerics.DTEMB_TOL
    numerics.assert_no_worse_than_replay(grads[1], replay_dw, ref_dw, "dW")
    numerics.assert_no_worse_than_replay(grads[2], replay_db, ref_db, "db")


def _final_contract(args, ups, outs, grads):
    x, nw, temb, w, b, ti = args
    out, table = torch.ops.h3.final_adaln_out_fwd(*args)
    assert_same_bits(out, outs[0], "final_adaln_out_fwd's output vs final_adaln_out's")
    numerics.assert_no_worse_than_replay(table, R.final_projection_table(temb, w, b),
                                         R.adaln_projection_fp64(temb, w, b), "final_adaln_out table")
    assert_same_bits(out, R.norm_modulate_replay(x, nw, table[:, :H], table[:, H:], ti), "the norm on the table")
    numerics.assert_final_adaln_out_backward(grads[:5], ups[0], x, nw, temb, w, b, ti, table, "final_adaln_out")


def _gather_contract(args, ups, outs, grads):
    table, idx = args
    for k, (o, r) in enumerate(zip(outs, R.adaln_row_gather_replay(table, idx))):
        assert_same_bits(o, r, f"gathered chunk {k} vs index_select")
    numerics.assert_table_sum(grads[0], torch.cat([u.float() for u in ups], dim=1), idx, "d_table")


def _norm_modulate_contract(args, ups, outs, grads):
    x, w, shift, scale, idx = args
    assert_same_bits(outs[0], R.norm_modulate_replay(*args), "norm_modulate vs the replay")
    numerics.assert_norm_modulate_backward(grads[:4], ups[0], x, w, shift, scale, idx, "norm_modulate")


def _gate_residual_contract(args, ups, outs, grads):
    residual, y, gate, idx = args
    (grad,) = ups
    assert_same_bits(outs[0], R.gate_residual_replay(*args), "gate_residual vs the replay")
    assert_same_bits(grads[0], grad, "d residual vs the upstream gradient")
    assert_same_bits(grads[1], (grad.float() * gate.float()[idx]).to(torch.bfloat16), "dy vs bf16(grad * gate[idx])")
    numerics.assert_table_sum(grads[2], grad.float() * y.float(), idx, "dgate")  # the products are exact in FP32


def _two_ops(residual, y, gate, w, shift, scale, idx):
    h = torch.ops.h3.gate_residual(residual, y, gate, idx)
    return h, torch.ops.h3.norm_modulate(h, w, shift, scale, idx)


def _fused_contract(args, ups, outs, grads):
    residual, y, gate, w, shift, scale, idx = args
    h = R.gate_residual_replay(residual, y, gate, idx)
    assert_same_bits(outs[0], h, "h vs gate_residual's replay")
    assert_same_bits(outs[1], R.norm_modulate_replay(h, w, shift, scale, idx), "out vs norm_modulate's replay of h")
    _, chain = run("gate_residual_norm_modulate", args, ups, fn=_two_ops)  # the two ops under autograd
    for name, got, want in zip(("d_residual", "dy", "dgate", "dweight", "dshift", "dscale"), grads, chain):
        assert_same_bits(got, want, f"{name} vs the two ops' chain")


CONTRACTS = {
    "timestep_sinusoid": _sinusoid_contract, "timestep_mlp": _mlp_contract, "adaln_projection": _projection_contract,
    "final_adaln_out": _final_contract, "adaln_row_gather": _gather_contract, "norm_modulate": _norm_modulate_contract,
    "gate_residual": _gate_residual_contract, "gate_residual_norm_modulate": _fused_contract,
}
CONTRACT_CASES = [(op, rows) for op in OPS for rows in ((1, 4, 64) if op == "adaln_projection" else (1, 4, 257))]


@pytest.mark.parametrize("op, rows", CONTRACT_CASES)
def test_outputs_and_gradients_hold_the_numeric_contract(op, rows):
    """Each op through torch.ops.h3 and its autograd, on poisoned memory, against its documented contract: bitwise
    where the contract is bitwise (sinusoid, the row ops' forwards, gate_residual's dy and d residual, the gather's
    and dgate's fixed-order FP32 sums), FP32 accuracy for the MLP, the projection's replay bar and d_temb's 1e-5,
    one BF16 rounding per element for the norm's gradients and table sums."""
    args = cuda_inputs(op, rows, seed=rows)
    ups = upstream(flat(getattr(torch.ops.h3, op)(*args))) if DIFFERENTIABLE(op) else None  # in the outputs' dtypes
    poison_allocator()
    outs, grads = run(op, args, ups)
    CONTRACTS[op](args, ups, outs, grads)


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
    probes = sorted({0, rows - 1, *torch.randperm(rows, generator=torch.Generator().manual_seed(rows))[:14].tolist()})
    assert row_invariance_failures(run, op, args, ups, probes) == [], (op, rows)


@pytest.mark.parametrize("op", ["timestep_mlp", "adaln_projection"])
def test_row_invariance_check_catches_the_cublas_replay(op):
    """Negative control: the diffusers replay's cuBLAS GEMMs give a row computed alone other bits than inside 257
    rows (H200: every row of the MLP forward and dx; the projection's d_temb from T = 257, its forward not;
    perf/results/h200/*.json, all_rows). The check that passes our op on the same inputs must report it."""
    rows = 257
    args = cuda_inputs(op, rows, seed=5)
    ups = upstream(flat(getattr(torch.ops.h3, op)(*args)))
    probes = [0, 1, rows // 2, rows - 1]
    caught = row_invariance_failures(run_replay, op, args, ups, probes)
    assert caught, f"{op}: the cuBLAS replay was invariant on these probes: the check cannot be trusted"
    if op == "timestep_mlp":
        assert {what for _, what in caught} == {"fwd", "rowgrad 0"}, caught
    assert row_invariance_failures(run, op, args, ups, probes) == [], op


def _shuffled_dgate(op, args, ups, _calls=itertools.count()):
    """A planted non-repeatable reduction: gate_residual's replay whose dgate adds each table row's terms in a new
    row order on every call (what atomics or a run-dependent split do), FP32 so no rounding hides it."""
    residual, y, gate, idx = args
    (grad,) = ups
    out = R.gate_residual_replay(residual, y, gate, idx)
    perm = torch.randperm(idx.shape[0], generator=torch.Generator().manual_seed(next(_calls))).to(idx.device)
    terms, rows = (grad.float() * y.float())[perm], idx[perm]
    dgate = torch.stack([terms[rows == t].sum(0) for t in range(gate.shape[0])])
    return [out], [grad, (grad.float() * gate.float()[idx]).to(grad.dtype), dgate, None]


def test_repeatability_check_catches_a_shuffled_reduction():
    """Negative control: the repeatability check reports a reduction whose order changes between calls (and not
    gate_residual's fixed-order dgate on the same inputs)."""
    args = cuda_inputs("gate_residual", 4097, seed=6)
    ups = upstream(flat(torch.ops.h3.gate_residual(*args)))
    assert repeatability_failures(_shuffled_dgate, "gate_residual", args, ups) == [2]
    assert repeatability_failures(run, "gate_residual", args, ups) == []


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
        assert all(same_bits(p, f[start:stop]) for p, f in zip(part, full)), (op, start, stop)
        start = stop
        if start == big:
            break


@pytest.mark.parametrize("op", [op for op in OPS if DIFFERENTIABLE(op)])
def test_parameter_gradients_are_bitwise_repeatable(op):
    args = cuda_inputs(op, 64 if op in T_OPS else 4097, seed=4)
    ups = upstream(flat(getattr(torch.ops.h3, op)(*args)))
    assert repeatability_failures(run, op, args, ups) == [], op


def test_value_checks_raise_on_cuda():
    x, w, shift, scale, idx = cuda_inputs("norm_modulate", 9)
    bad = idx.clone()
    bad[4] = 9
    torch.ops.h3.norm_modulate(x, w, shift, scale, bad)  # checked on the device, raised after
    with pytest.raises(IndexError, match=r"h3::norm_modulate: adaln_indices\[4\] is outside \[0, 9\)"):
        h3cute.check_errors()
    # every op's checks: tests/test_error_flags.py


def test_row_strided_tables_on_cuda():
    x, w, _, _, idx = cuda_inputs("norm_modulate", 65)
    table = R.example_inputs("adaln_row_gather", 1, num_timesteps=3, device="cuda")[0]
    c = table.chunk(6, dim=-1)
    assert same_bits(torch.ops.h3.norm_modulate(x, w, c[0], c[1], idx),
                     torch.ops.h3.norm_modulate(x, w, c[0].contiguous(), c[1].contiguous(), idx))
    assert same_bits(torch.ops.h3.gate_residual(x, x, c[2], idx),
                     torch.ops.h3.gate_residual(x, x, c[2].contiguous(), idx))


@pytest.mark.parametrize("op", OPS)
def test_empty_rows_on_cuda(op):
    args = cuda_inputs(op, 0)
    for o in flat(getattr(torch.ops.h3, op)(*args)):
        assert o.shape[0] == 0 and o.is_cuda
