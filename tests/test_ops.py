"""torch.ops.h3 on CPU: schemas, opcheck, torch.compile tracing, autograd, empty inputs, and the CUDA
path's behaviour while a launch module is missing. Validation errors are in test_ops_validation.py."""
import dataclasses
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import h3cute
from h3cute import reference as R
from h3cute.ops import _library
from h3cute.widths import BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, FREQ, HIDDEN, NORM_EPS, TEMB

import numerics
from bitwise import assert_same_bits, same_bits

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
# the model scope's ops, not conditioning ops: the FP32 linear (tests/test_linear.py) and h3cute.ops.model's
# (tests/test_model_ops.py)
MODEL_OPS = {"linear", "linear_backward", "attention", "attention_with_lse", "attention_backward", "dense",
             "dense_backward", "rms_norm", "rms_norm_backward", "rotary", "rotary_backward", "qk_norm_rotary",
             "qk_norm_rotary_backward", "swiglu",
             "swiglu_backward", "rotary_table"}
ROWS = {"timestep_sinusoid": 5, "timestep_mlp": 3, "adaln_projection": 2}  # T for the T-ops; S = 7 otherwise
_INPUTS = {}


def inputs(op, requires_grad=False, rows=None):
    """Cached small H3-width inputs (adaln_projection's weight is 520 MB: build it once); fresh leaves. `rows`
    overrides S for the row ops."""
    rows = ROWS.get(op, rows or 7)
    if (op, rows) not in _INPUTS:
        _INPUTS[op, rows] = R.example_inputs(op, rows, num_timesteps=2, seed=1)
    return [a.detach().clone().requires_grad_(requires_grad and a.is_floating_point() and op != "timestep_sinusoid")
            for a in _INPUTS[op, rows]]


def upstream(out, seed=9):
    g = torch.Generator().manual_seed(seed)
    if isinstance(out, (list, tuple)):
        return [upstream(o, seed + i) for i, o in enumerate(out)]
    return torch.randn(out.shape, generator=g).to(out.dtype)


def backward_args(op, a=None):
    """Arguments of `h3::<op>_backward` for the cached inputs (or the forward arguments `a`), in schema order."""
    a = inputs(op) if a is None else a
    grad = upstream(getattr(torch.ops.h3, op)(*a))
    if op == "timestep_mlp":
        return [grad, *a[:4]]
    if op == "final_adaln_out":
        return [grad, *a, NORM_EPS]
    if op == "adaln_projection":
        return [grad, *a[:2]]
    if op == "adaln_row_gather":
        return [grad, a[1], a[0].shape[0]]
    if op == "norm_modulate":
        x, w, shift, scale, idx = a
        return [grad, x, w, scale, idx, NORM_EPS, shift.shape[0]]
    if op == "gate_residual":
        return [grad, *a[1:]]
    if op == "gate_residual_norm_modulate":
        res, y, gate, w, shift, scale, idx = a
        h, _ = torch.ops.h3.gate_residual_norm_modulate(*a)
        return [grad[0], grad[1], y, gate, h, w, scale, idx, NORM_EPS, gate.shape[0]]
    raise AssertionError(op)


def documented_schemas():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## The `h3` schemas", 1)[1]
    return re.findall(r"^\|[^|]*\| `([a-z_]+\(.*\) -> .*?)`", section, flags=re.M)


def test_every_documented_schema_is_registered_exactly():
    schemas = documented_schemas()
    assert len(schemas) == 18 + 14  # the conditioning ops, the model scope's
    for s in schemas:
        name = s.split("(", 1)[0]
        assert getattr(torch.ops.h3, name).default._schema == torch._C.parse_schema("h3::" + s), name
    documented = set(R.OPS) | set(BACKWARD.values()) | set(FORWARD.values()) | MODEL_OPS
    assert {s.split("(", 1)[0] for s in schemas} == documented


def test_every_registered_op_is_declared_once_with_its_schema():
    registered = {n for n in dir(torch.ops.h3) if isinstance(getattr(torch.ops.h3, n), torch._ops.OpOverloadPacket)}
    assert set(_library.DECLARED) == registered
    for name, op in _library.DECLARED.items():
        schema = getattr(torch.ops.h3, name).default._schema
        assert schema == torch._C.parse_schema("h3::" + op.schema)
        assert _library._argument_names(op.schema) == [a.name for a in schema.arguments]  # rows resolves by these
        assert op.rows is None or op.rows in _library._argument_names(op.schema)


def test_declare_refuses_a_row_argument_the_op_lacks_and_half_an_autograd():
    body = lambda *args: None  # noqa: E731
    with pytest.raises(ValueError, match=r"h3::h3_test_rows: rows names 'y', not an argument of the op"):
        _library.declare(_library.Op("h3_test_rows(Tensor x) -> Tensor", body, body, body, body, rows="y"))
    with pytest.raises(ValueError, match=r"h3::h3_test_grad: an autograd declaration needs both"):
        _library.declare(_library.Op("h3_test_grad(Tensor x) -> Tensor", body, body, body, body, backward=body))
    assert not hasattr(torch.ops.h3, "h3_test_rows") and not hasattr(torch.ops.h3, "h3_test_grad")


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
    assert same_bits(out, torch.ops.h3.final_adaln_out(*a))
    assert same_bits(table, R.final_projection_table(*a[2:5]))
    torch.library.opcheck(torch.ops.h3.final_adaln_out_fwd.default, a, test_utils=_opcheck_utils("final_adaln_out"))
    args = backward_args("final_adaln_out")
    with_table = torch.ops.h3.final_adaln_out_backward(*args, table)
    assert all(same_bits(u, v) for u, v in zip(with_table, torch.ops.h3.final_adaln_out_backward(*args)))
    torch.library.opcheck(torch.ops.h3.final_adaln_out_backward.default, [*args, table],
                          test_utils=_opcheck_utils("final_adaln_out"))
    for bad, err in ((table[:1], ValueError), (table.float(), TypeError), (table[:, :HIDDEN], ValueError)):
        with pytest.raises(err, match=r"h3::final_adaln_out_backward: table"):
            torch.ops.h3.final_adaln_out_backward(*args, bad)


def _flat(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


# The projection's golden on a slice of its 96768 output features (each feature is its own dot product; the whole
# FP64 weight would be 2 GB).
PROJECTION_COLUMNS = slice(0, 4096)


def _norm_modulate_golden(x, weight, shift, scale, idx, eps=NORM_EPS):
    """FP64 norm_modulate and its bound for the CPU op sequence: n = bf16(x rstd w) (one rounding, rstd FP32),
    a = bf16(1 + scale), m = bf16(n a), out = bf16(m + shift): out is within U|out| + ~3U|n a| (plus FP32 room)."""
    x64 = x.double()
    n = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * weight.double()
    na = n * (1 + scale.double()[idx])
    ref = na + shift.double()[idx]
    return ref, numerics.U_BF16 * ref.abs() + (3.1 * numerics.U_BF16 + numerics.FP32_SLACK) * na.abs()


def _projection_golden(temb, weight, bias):
    """FP64 projection of the BF16-rounded silu(temb) and its one-rounding bound (FP32 accumulation, bias included,
    then one BF16 rounding)."""
    act = F.silu(temb.double()).to(torch.bfloat16).double()
    ref = act @ weight.double().t() + bias.double()
    return ref, numerics.one_rounding(ref, act.abs() @ weight.double().abs().t() + bias.double().abs())


@pytest.mark.parametrize("op", R.OPS)
def test_cpu_forward_is_within_its_roundings_of_fp64(op):
    """Each output element of the CPU op against FP64 math, within the roundings of the op sequence the CPU impl
    runs (diffusers', bitwise: tests/test_diffusers_parity.py): FP32 for the timestep ops, one BF16 rounding of an
    FP32 GEMM for the projection, exact for the gather, product then sum for gate_residual, four roundings for
    norm_modulate; final_adaln_out as norm_modulate of its own projection, which is held to the projection's."""
    a = inputs(op)
    out = getattr(torch.ops.h3, op)(*a)
    if op == "timestep_sinusoid":
        numerics.assert_within(out, R.timestep_sinusoid_fp64(*a), 2.0 ** -20, op)
    elif op == "timestep_mlp":
        ref = R.timestep_mlp_fp64(*a)
        numerics.assert_within(out, ref, 2e-6 * float(ref.abs().max()), op)
    elif op == "adaln_projection":
        temb, weight, bias = a
        ref, bound = _projection_golden(temb, weight[PROJECTION_COLUMNS], bias[PROJECTION_COLUMNS])
        numerics.assert_within(out[:, PROJECTION_COLUMNS], ref, bound, op)
    elif op == "adaln_row_gather":
        for o, ref in zip(out, R.adaln_row_gather_fp64(*a)):
            numerics.assert_within(o, ref, 0.0, op)
    elif op == "gate_residual":
        residual, y, gate, idx = a
        product = gate.double()[idx] * y.double()
        ref = residual.double() + product
        numerics.assert_within(out, ref, numerics.U_BF16 * (ref.abs() + (1 + numerics.U_BF16) * product.abs()), op)
    elif op == "norm_modulate":
        numerics.assert_within(out, *_norm_modulate_golden(*a), op)
    elif op == "gate_residual_norm_modulate":  # gate_residual's h, and norm_modulate's out of that h
        residual, y, gate, w, shift, scale, idx = a
        h, out = out
        product = gate.double()[idx] * y.double()
        ref = residual.double() + product
        numerics.assert_within(h, ref, numerics.U_BF16 * (ref.abs() + (1 + numerics.U_BF16) * product.abs()), op)
        numerics.assert_within(out, *_norm_modulate_golden(h, w, shift, scale, idx), op)
    elif op == "final_adaln_out":
        x, nw, temb, weight, bias, ti = a
        fwd_out, table = torch.ops.h3.final_adaln_out_fwd(*a)
        assert_same_bits(fwd_out, out, "final_adaln_out_fwd's output")
        numerics.assert_within(table, *_projection_golden(temb, weight, bias), "final_adaln_out table")
        shift, scale = table.chunk(2, dim=-1)
        numerics.assert_within(out, *_norm_modulate_golden(x, nw, shift, scale, ti), op)
    else:
        raise AssertionError(op)


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
        # FP32 sums of up to 5376 products (~sqrt(K) u = 4e-6 of the largest gradient, seen up to 2.8e-6 with one
        # CPU's BLAS): 1e-5 holds FP32, and still fails a TF32 path (~5e-4) by far
        tol = 1e-5 if x.dtype == torch.float32 and op == "timestep_mlp" else 1.2e-2
        assert err < tol, (op, tuple(x.shape), float(err))
        checked += 1
    assert checked >= 1


# Per-row gradients through the RMSNorm's rstd (a difference of terms, not a sum of products): held to one rounding
# with FP32 room relative to the largest element.
THROUGH_RSTD = {"norm_modulate": 0, "final_adaln_out": 0}


# The MLP's gradients are FP32; the fused block op's are the two ops' chain by contract (h's gradient rounded once
# more between them: tests/test_gate_residual_norm_modulate.py checks them bitwise against the chain).
@pytest.mark.parametrize("op", sorted(set(BACKWARD) - {"timestep_mlp", "gate_residual_norm_modulate"}))
def test_cpu_backward_rounds_each_bf16_gradient_once(op):
    """The CPU backward computes every gradient in FP32 and rounds each BF16 one once; its reductions (weight,
    bias, table gradients) are FP32 sums. So each BF16 element is within one BF16 rounding of FP64 autograd, with
    FP32 room relative to the sum of the reduction's |terms| (FP64 autograd at |inputs| and |upstream|, an upper
    bound on it). A BF16 accumulation or a second rounding breaks it. (FP32 gradients:
    test_cpu_gradients_match_fp64_autograd.)"""
    a = inputs(op, requires_grad=True, rows=300)  # ~50 rows per table row: sums long enough to round differently
    out = getattr(torch.ops.h3, op)(*a)
    ups = _flat(upstream(out))
    torch.autograd.backward(_flat(out), ups)
    grads = [x.grad for x in a]
    if op == "adaln_projection":  # dW and db on a slice of the output features (see PROJECTION_COLUMNS)
        cols = PROJECTION_COLUMNS
        a, grads, ups = [a[0], a[1][cols], a[2][cols]], [None, grads[1][cols], grads[2][cols]], [ups[0][:, cols]]
    table = torch.ops.h3.final_adaln_out_fwd(*a)[1] if op == "final_adaln_out" else None
    golden, magnitude = _fp64_grads(op, a, ups, table), _fp64_grads(op, a, ups, table, absolute=True)
    checked = 0
    for i, (x, g, ref, abs_terms) in enumerate(zip(a, grads, golden, magnitude)):
        if x.dtype != torch.bfloat16:
            continue
        assert g is not None and g.dtype == x.dtype and g.shape == x.shape, (op, i)
        if THROUGH_RSTD.get(op) == i:
            abs_terms = float(ref.abs().max())
        numerics.assert_within(g, ref, numerics.one_rounding(ref, abs_terms), f"{op} gradient of argument {i}")
        checked += 1
    assert checked >= 1


def _fp64_grads(op, args, ups, table=None, absolute=False):
    """FP64 autograd of the golden: the gradient of each floating argument (None for the others); final_adaln_out's
    on the op's own BF16 `table` (numerics.final_adaln_out_fp64). With `absolute`, at |arguments|, |upstream| and
    |table| (silu(|t|) >= |silu(t)|, 1 + |scale| >= |1 + scale|: every reduction's terms become their magnitudes
    or more)."""
    f = (lambda t: t.detach().double().abs()) if absolute else (lambda t: t.detach().double())
    leaves = [f(x).requires_grad_() if x.is_floating_point() else x for x in args]
    if op == "final_adaln_out":
        outs = numerics.final_adaln_out_fp64(*leaves, table=f(table))
    else:
        outs = R.FP64[op](*leaves)
    torch.autograd.backward(_flat(outs), [f(u) for u in ups])
    return [x.grad if x.is_floating_point() else None for x in leaves]


@pytest.mark.parametrize("op", R.OPS)
def test_torch_compile_fullgraph_traces_forward_and_backward(op):
    torch._dynamo.reset()
    fn = getattr(torch.ops.h3, op)
    compiled = torch.compile(lambda *a: fn(*a), fullgraph=True, backend="aot_eager")
    a = inputs(op, requires_grad=True)
    out = compiled(*a)
    for o, r in zip(_flat(out), _flat(fn(*inputs(op)))):
        assert same_bits(o, r)
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
    assert torch.ops.h3.timestep_sinusoid(t.detach()).shape == (3, FREQ)
    with torch.no_grad():
        assert torch.ops.h3.timestep_sinusoid(t).shape == (3, FREQ)


def test_row_gather_gradient_with_every_calling_convention():
    table, idx = inputs("adaln_row_gather")
    expected = None
    for extra in ((), (True,), (False,)):
        leaf = table.clone().requires_grad_()
        outs = torch.ops.h3.adaln_row_gather(leaf, idx, *extra)
        torch.autograd.backward(outs[2:4], upstream(outs[2:4]))
        expected = leaf.grad if expected is None else expected
        assert same_bits(leaf.grad, expected)
        assert leaf.grad[:, : 2 * HIDDEN].count_nonzero() == 0  # chunks 0, 1 got no gradient


def test_row_strided_tables_match_contiguous_copies():
    """shift/scale/gate as column chunks of the (3T, 6H) block table (row stride 6H)."""
    x, w, _, _, idx = inputs("norm_modulate")
    table = inputs("adaln_row_gather")[0]
    shift, scale, gate = table[:, :HIDDEN], table[:, HIDDEN:FINAL_PROJECTION], table[:, FINAL_PROJECTION:16128]
    assert shift.stride() == (BLOCK_TABLE, 1)
    assert same_bits(torch.ops.h3.norm_modulate(x, w, shift, scale, idx),
                       torch.ops.h3.norm_modulate(x, w, shift.contiguous(), scale.contiguous(), idx))
    assert same_bits(torch.ops.h3.gate_residual(x, x, gate, idx),
                       torch.ops.h3.gate_residual(x, x, gate.contiguous(), idx))


def test_adaln_indices():
    ti = torch.tensor([0, 1, 1, 0, 2])
    tags = torch.tensor([0, 1, 2, 2, 1])
    assert same_bits(h3cute.adaln_indices(ti, tags, 3), torch.tensor([0, 4, 5, 2, 7]))
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
    width = {"timestep_sinusoid": FREQ, "timestep_mlp": TEMB, "adaln_projection": BLOCK_PROJECTION}.get(op, HIDDEN)
    for o in _flat(out):
        assert o.shape == (0, width)
    if op in BACKWARD:
        torch.autograd.backward(_flat(out), _flat(upstream(out)))
        for x in a:
            if x.is_floating_point():
                assert x.grad.shape == x.shape and x.grad.count_nonzero() == 0


def _nan_fake(declared):
    """`declared` with a fake impl whose outputs are NaN-filled."""
    def fake(*args):
        out = declared.fake(*args)
        for o in _flat(out):
            o.fill_(float("nan"))
        return out

    return dataclasses.replace(declared, fake=fake)


def _assert_same_values(got, want):
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("op", R.OPS)
def test_cuda_impls_serve_no_rows_without_a_launch(monkeypatch, op):
    """The declared `rows` argument with no rows: the Python CUDA impls return the CPU impls' outputs (shapes,
    dtypes, zero reductions; values compared, since the CPU reference may give -0 where the CUDA impl gives +0)
    and launch nothing (the launch modules are stand-ins that raise). The fake impls that shape the outputs are
    NaN-filled here, so an output the library does not zero fails."""
    module, launch, _, declaration = next(c for c in CUDA_IMPLS if c[2] == op)
    mod = __import__(f"h3cute.ops.{module}", fromlist=["_"])
    monkeypatch.setattr(mod, launch, _library.MissingLaunch(op))
    declared = getattr(mod, declaration)
    a = _empty_args(op)
    checked = []
    if declared.rows is not None:
        _assert_same_values(_nan_fake(declared).cuda_impl(*a), getattr(torch.ops.h3, op)(*a))
        checked.append(op)
    if declared.backward_op is not None and declared.backward_op.rows is not None:
        b = backward_args(op, a)
        want = getattr(torch.ops.h3, BACKWARD[op])(*b)
        assert any(w.numel() and w.count_nonzero() == 0 for w in _flat(want)) or op == "adaln_projection"
        _assert_same_values(_nan_fake(declared.backward_op).cuda_impl(*b), want)
        checked.append(BACKWARD[op])
    assert checked  # every op declares its row argument (final_adaln_out's forward: its launcher serves no rows)


# ---- the CUDA impls while a launch module is missing (no GPU needed) -----------------------------------

def test_resolve_launch_reports_a_missing_module(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "h3cute.launch.gate_residual", None)
    stub = _library.resolve_launch("gate_residual")
    with pytest.raises(NotImplementedError, match=r"h3::gate_residual: the CUDA kernel is not built yet"):
        stub.forward()


CUDA_IMPLS = [  # (module, launch attribute, op, its declaration)
    ("timestep", "_SINUSOID", "timestep_sinusoid", "SINUSOID"),
    ("timestep", "_MLP", "timestep_mlp", "MLP"),
    ("adaln", "_PROJECTION", "adaln_projection", "PROJECTION"),
    ("adaln", "_ROW_GATHER", "adaln_row_gather", "ROW_GATHER"),
    ("adaln", "_NORM_MODULATE", "norm_modulate", "NORM_MODULATE"),
    ("adaln", "_GATE_RESIDUAL", "gate_residual", "GATE_RESIDUAL"),
    ("adaln", "_GATE_RESIDUAL_NORM_MODULATE", "gate_residual_norm_modulate", "GATE_RESIDUAL_NORM_MODULATE"),
    ("adaln", "_FINAL", "final_adaln_out", "FINAL"),
]


@pytest.mark.parametrize("module, launch, op, declaration", CUDA_IMPLS, ids=[c[2] for c in CUDA_IMPLS])
def test_cuda_impl_raises_not_implemented_without_its_launch_module(monkeypatch, module, launch, op, declaration):
    mod = __import__(f"h3cute.ops.{module}", fromlist=["_"])
    monkeypatch.setattr(mod, launch, _library.MissingLaunch(op))
    declared = getattr(mod, declaration)
    assert declared.name == op
    with pytest.raises(NotImplementedError, match=rf"h3::{op}: the CUDA kernel is not built yet"):
        declared.cuda_impl(*inputs(op))
    if declared.backward_op is not None:
        with pytest.raises(NotImplementedError, match=rf"h3::{op}: the CUDA kernel is not built yet"):
            declared.backward_op.cuda_impl(*backward_args(op))
    if declared.forward_op is not None:
        with pytest.raises(NotImplementedError, match=rf"h3::{op}: the CUDA kernel is not built yet"):
            declared.forward_op.cuda_impl(*inputs(op))


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
    assert adaln._norm_modulate_cuda(*a, NORM_EPS, False) == "out"
    b = backward_args("norm_modulate")
    assert adaln._norm_modulate_backward_cuda(*b) == "grads"
    assert calls[0][0] == "forward" and calls[0][1][:5] == tuple(a) and calls[0][1][5:] == (NORM_EPS, False)
    assert calls[1][0] == "backward" and calls[1][1] == tuple(b)
