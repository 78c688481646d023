"""torch.ops.h3 on CPU: schemas, opcheck, torch.compile tracing, autograd, empty inputs, and the CUDA
path's behaviour while a launch module is missing. Validation errors are in test_ops_validation.py."""
import pathlib
import re

import pytest
import torch

import h3cute
from h3cute import reference as R
from h3cute.ops import _library

BACKWARD = {  # ops with an autograd formula -> their backward op
    "timestep_mlp": "timestep_mlp_backward",
    "final_adaln_out": "final_adaln_out_backward",
    "adaln_projection": "adaln_projection_backward",
    "adaln_row_gather": "adaln_row_gather_backward",
    "norm_modulate": "norm_modulate_backward",
    "gate_residual": "gate_residual_backward",
    "gate_residual_norm_modulate": "gate_residual_norm_modulate_backward",
}
FORWARD = {"final_adaln_out": "final_adaln_out_fwd"}  # ops whose autograd runs another forward op (saving more)
ROWS = {"timestep_sinusoid": 5, "timestep_mlp": 3, "adaln_projection": 2}  # T for the T-ops; S = 7 otherwise
_INPUTS = {}


def inputs(op, requires_grad=False):
    """Cached small H3-width inputs (adaln_projection's weight is 520 MB: build it once); fresh leaves."""
    if op not in _INPUTS:
        _INPUTS[op] = R.example_inputs(op, ROWS.get(op, 7), num_timesteps=2, seed=1)
    return [a.detach().clone().requires_grad_(requires_grad and a.is_floating_point() and op != "timestep_sinusoid")
            for a in _INPUTS[op]]


def upstream(out, seed=9):
    g = torch.Generator().manual_seed(seed)
    if isinstance(out, (list, tuple)):
        return [upstream(o, seed + i) for i, o in enumerate(out)]
    return torch.randn(out.shape, generator=g).to(out.dtype)


def backward_args(op):
    """Arguments of `h3::<op>_backward` for the cached inputs, in schema order."""
    a = inputs(op)
    grad = upstream(getattr(torch.ops.h3, op)(*a))
    if op == "timestep_mlp":
        return [grad, *a[:4]]
    if op == "final_adaln_out":
        return [grad, *a, 1e-5]
    if op == "adaln_projection":
        return [grad, *a[:2]]
    if op == "adaln_row_gather":
        return [grad, a[1], a[0].shape[0]]
    if op == "norm_modulate":
        x, w, shift, scale, idx = a
        return [grad, x, w, scale, idx, 1e-5, shift.shape[0]]
    if op == "gate_residual":
        return [grad, *a[1:]]
    if op == "gate_residual_norm_modulate":
        res, y, gate, w, shift, scale, idx = a
        h, _ = torch.ops.h3.gate_residual_norm_modulate(*a)
        return [grad[0], grad[1], y, gate, h, w, scale, idx, 1e-5, gate.shape[0]]
    raise AssertionError(op)


def documented_schemas():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## The `h3` schemas", 1)[1]
    return re.findall(r"^\|[^|]*\| `([a-z_]+\(.*\) -> .*?)`", section, flags=re.M)


def test_every_documented_schema_is_registered_exactly():
    schemas = documented_schemas()
    assert len(schemas) == 16
    for s in schemas:
        name = s.split("(", 1)[0]
        assert getattr(torch.ops.h3, name).default._schema == torch._C.parse_schema("h3::" + s), name
    assert {s.split("(", 1)[0] for s in schemas} == set(R.OPS) | set(BACKWARD.values()) | set(FORWARD.values())


def _opcheck_utils(op):
    # adaln_projection's 520 MB weight makes aot_dispatch_dynamic take minutes on 2 CPU cores; its tracing
    # is covered by test_torch_compile_fullgraph_traces_forward_and_backward.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    return utils if op == "adaln_projection" else utils + ("test_aot_dispatch_dynamic",)


@pytest.mark.parametrize("op", R.OPS)
def test_opcheck_forward(op):
    torch.library.opcheck(getattr(torch.ops.h3, op).default, inputs(op, requires_grad=True),
                          test_utils=_opcheck_utils(op))


@pytest.mark.parametrize("op", sorted(BACKWARD))
def test_opcheck_backward_op(op):
    torch.library.opcheck(getattr(torch.ops.h3, BACKWARD[op]).default, backward_args(op),
                          test_utils=_opcheck_utils(op))


def test_final_adaln_out_fwd_and_backward_with_its_table():
    """The autograd forward op returns the op's output and the replay's projection; the backward given that
    table is bitwise the backward that computes it again; both pass opcheck."""
    a = inputs("final_adaln_out")
    out, table = torch.ops.h3.final_adaln_out_fwd(*a)
    assert torch.equal(out, torch.ops.h3.final_adaln_out(*a))
    assert torch.equal(table, R.final_projection_table(*a[2:5]))
    torch.library.opcheck(torch.ops.h3.final_adaln_out_fwd.default, a, test_utils=_opcheck_utils("final_adaln_out"))
    args = backward_args("final_adaln_out")
    with_table = torch.ops.h3.final_adaln_out_backward(*args, table)
    assert all(torch.equal(u, v) for u, v in zip(with_table, torch.ops.h3.final_adaln_out_backward(*args)))
    torch.library.opcheck(torch.ops.h3.final_adaln_out_backward.default, [*args, table],
                          test_utils=_opcheck_utils("final_adaln_out"))
    for bad, err in ((table[:1], ValueError), (table.float(), TypeError), (table[:, :5376], ValueError)):
        with pytest.raises(err, match=r"h3::final_adaln_out_backward: table"):
            torch.ops.h3.final_adaln_out_backward(*args, bad)


@pytest.mark.parametrize("op", R.OPS)
def test_cpu_forward_is_the_diffusers_replay(op):
    a = inputs(op)
    out, ref = _flat(getattr(torch.ops.h3, op)(*a)), _flat(R.REPLAY[op](*a))
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert torch.equal(o, r)


def _flat(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


@pytest.mark.parametrize("op", sorted(BACKWARD))
def test_cpu_gradients_match_fp64_autograd(op):
    a = inputs(op, requires_grad=True)
    out = getattr(torch.ops.h3, op)(*a)
    grads = upstream(out)
    torch.autograd.backward(_flat(out), _flat(grads))
    a64 = [x.detach().double().requires_grad_() if x.is_floating_point() else x for x in a]
    torch.autograd.backward(_flat(R.FP64[op](*a64)), [g.double() for g in _flat(grads)])
    checked = 0
    for x, x64 in zip(a, a64):
        if not x.is_floating_point():
            continue
        assert x.grad is not None and x.grad.dtype == x.dtype and x.grad.shape == x.shape
        assert not x.grad.isnan().any()
        err = (x.grad.double() - x64.grad).abs().max() / x64.grad.abs().max().clamp_min(1e-30)
        tol = 2e-6 if x.dtype == torch.float32 and op == "timestep_mlp" else 1.2e-2
        assert err < tol, (op, tuple(x.shape), float(err))
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("op", sorted(BACKWARD))
def test_parameter_gradients_are_bitwise_repeatable(op):
    def grads():
        a = inputs(op, requires_grad=True)
        out = getattr(torch.ops.h3, op)(*a)
        torch.autograd.backward(_flat(out), _flat(upstream(out)))
        return [x.grad for x in a if x.grad is not None]

    assert all(torch.equal(g1, g2) for g1, g2 in zip(grads(), grads()))


@pytest.mark.parametrize("op", R.OPS)
def test_torch_compile_fullgraph_traces_forward_and_backward(op):
    torch._dynamo.reset()
    fn = getattr(torch.ops.h3, op)
    compiled = torch.compile(lambda *a: fn(*a), fullgraph=True, backend="aot_eager")
    a = inputs(op, requires_grad=True)
    out = compiled(*a)
    for o, r in zip(_flat(out), _flat(fn(*inputs(op)))):
        assert torch.equal(o, r)
    if op in BACKWARD:
        torch.autograd.backward(_flat(out), _flat(upstream(out)))
        assert all(x.grad is not None for x in a if x.is_floating_point())


@pytest.mark.parametrize("op", ["timestep_mlp", "final_adaln_out", "gate_residual_norm_modulate"])
def test_ops_keep_their_dtypes_under_autocast(op):
    """The ops have no autocast kernel: under autocast they compute exactly as without it (the CPU impls switch
    CPU autocast off around the replay's torch ops)."""
    a = inputs(op)
    want = _flat(getattr(torch.ops.h3, op)(*a))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _flat(getattr(torch.ops.h3, op)(*a))
        if op == "timestep_mlp":  # the control: autocast does recast the replay's torch ops
            assert R.REPLAY[op](*a).dtype == torch.bfloat16
    assert all(torch.equal(u, v) and u.dtype == v.dtype for u, v in zip(got, want))


def test_gradient_through_timestep_sinusoid_is_refused():
    t = torch.rand(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="timestep_sinusoid has no backward"):
        torch.ops.h3.timestep_sinusoid(t)
    assert torch.ops.h3.timestep_sinusoid(t.detach()).shape == (3, 256)
    with torch.no_grad():
        assert torch.ops.h3.timestep_sinusoid(t).shape == (3, 256)


def test_row_gather_gradient_with_every_calling_convention():
    table, idx = inputs("adaln_row_gather")
    expected = None
    for extra in ((), (True,), (False,)):
        leaf = table.clone().requires_grad_()
        outs = torch.ops.h3.adaln_row_gather(leaf, idx, *extra)
        torch.autograd.backward(outs[2:4], upstream(outs[2:4]))
        expected = leaf.grad if expected is None else expected
        assert torch.equal(leaf.grad, expected)
        assert leaf.grad[:, : 2 * 5376].count_nonzero() == 0  # chunks 0, 1 got no gradient


def test_row_strided_tables_match_contiguous_copies():
    """shift/scale/gate as column chunks of the (3T, 6H) block table (row stride 6H)."""
    x, w, _, _, idx = inputs("norm_modulate")
    table = inputs("adaln_row_gather")[0]
    shift, scale, gate = table[:, :5376], table[:, 5376:10752], table[:, 10752:16128]
    assert shift.stride() == (6 * 5376, 1)
    assert torch.equal(torch.ops.h3.norm_modulate(x, w, shift, scale, idx),
                       torch.ops.h3.norm_modulate(x, w, shift.contiguous(), scale.contiguous(), idx))
    assert torch.equal(torch.ops.h3.gate_residual(x, x, gate, idx),
                       torch.ops.h3.gate_residual(x, x, gate.contiguous(), idx))


def test_adaln_indices():
    ti = torch.tensor([0, 1, 1, 0, 2])
    tags = torch.tensor([0, 1, 2, 2, 1])
    assert torch.equal(h3cute.adaln_indices(ti, tags, 3), torch.tensor([0, 4, 5, 2, 7]))
    assert h3cute.adaln_indices(ti[:0], tags[:0], 0).shape == (0,)


# ---- empty inputs ------------------------------------------------------------------------------------

def _empty_args(op):
    a = inputs(op)
    if op in ROWS:
        return [a[0][:0], *a[1:]]
    if op == "final_adaln_out":
        return [a[0][:0], *a[1:5], a[5][:0]]
    if op == "adaln_row_gather":
        return [a[0], a[1][:0]]
    if op == "gate_residual":
        return [a[0][:0], a[1][:0], a[2], a[3][:0]]
    if op == "gate_residual_norm_modulate":
        return [a[0][:0], a[1][:0], *a[2:6], a[6][:0]]
    return [a[0][:0], *a[1:4], a[4][:0]]


@pytest.mark.parametrize("op", R.OPS)
def test_empty_rows_give_empty_outputs_and_zero_parameter_gradients(op):
    a = [x.requires_grad_(x.is_floating_point() and op != "timestep_sinusoid") for x in _empty_args(op)]
    out = getattr(torch.ops.h3, op)(*a)
    width = {"timestep_sinusoid": 256, "timestep_mlp": 2688, "adaln_projection": 96768}.get(op, 5376)
    for o in _flat(out):
        assert o.shape == (0, width)
    if op in BACKWARD:
        torch.autograd.backward(_flat(out), _flat(upstream(out)))
        for x in a:
            if x.is_floating_point():
                assert x.grad.shape == x.shape and x.grad.count_nonzero() == 0


# ---- the CUDA impls while a launch module is missing (no GPU needed) -----------------------------------

def test_resolve_launch_reports_a_missing_module(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "h3cute.launch.gate_residual", None)
    stub = _library.resolve_launch("gate_residual")
    with pytest.raises(NotImplementedError, match=r"h3::gate_residual: the CUDA kernel is not built yet"):
        stub.forward()


CUDA_IMPLS = [  # (module, launch attribute, CUDA impl of the op, CUDA impl of its backward)
    ("timestep", "_SINUSOID", "timestep_sinusoid", "_sinusoid_cuda", None),
    ("timestep", "_MLP", "timestep_mlp", "_mlp_cuda", "_mlp_backward_cuda"),
    ("adaln", "_PROJECTION", "adaln_projection", "_projection_cuda", "_projection_backward_cuda"),
    ("adaln", "_ROW_GATHER", "adaln_row_gather", "_gather_cuda", "_gather_backward_cuda"),
    ("adaln", "_NORM_MODULATE", "norm_modulate", "_norm_modulate_cuda", "_norm_modulate_backward_cuda"),
    ("adaln", "_GATE_RESIDUAL", "gate_residual", "_gate_residual_cuda", "_gate_residual_backward_cuda"),
    ("adaln", "_GATE_RESIDUAL_NORM_MODULATE", "gate_residual_norm_modulate", "_fused_cuda", "_fused_backward_cuda"),
    ("adaln", "_FINAL", "final_adaln_out", "_final_cuda", "_final_backward_cuda"),
]


@pytest.mark.parametrize("module, launch, op, fwd, bwd", CUDA_IMPLS, ids=[c[2] for c in CUDA_IMPLS])
def test_cuda_impl_raises_not_implemented_without_its_launch_module(monkeypatch, module, launch, op, fwd, bwd):
    mod = __import__(f"h3cute.ops.{module}", fromlist=["_"])
    monkeypatch.setattr(mod, launch, _library.MissingLaunch(op))
    with pytest.raises(NotImplementedError, match=rf"h3::{op}: the CUDA kernel is not built yet"):
        getattr(mod, fwd)(*inputs(op))
    if bwd is not None:
        with pytest.raises(NotImplementedError, match=rf"h3::{op}: the CUDA kernel is not built yet"):
            getattr(mod, bwd)(*backward_args(op))


def test_cuda_impl_calls_the_launch_module_with_schema_arguments(monkeypatch):
    from h3cute.ops import adaln

    calls = []

    class Launch:
        def forward(self, *args):
            calls.append(("forward", args))
            return "out"

        def backward(self, *args):
            calls.append(("backward", args))
            return "grads"

    monkeypatch.setattr(adaln, "_NORM_MODULATE", Launch())
    a = inputs("norm_modulate")
    assert adaln._norm_modulate_cuda(*a, 1e-5, False) == "out"
    b = backward_args("norm_modulate")
    assert adaln._norm_modulate_backward_cuda(*b) == "grads"
    assert calls[0][0] == "forward" and calls[0][1][:5] == tuple(a) and calls[0][1][5:] == (1e-5, False)
    assert calls[1][0] == "backward" and calls[1][1] == tuple(b)
