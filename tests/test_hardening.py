"""Behaviour at the edges, on CPU: None and meta tensors, forward-mode AD, autocast, damaged caches and
bundles, a second checkout beside an editable install, and the command lines' errors."""
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)

ops = torch.ops.h3
BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64
H, S, T = 5376, 3, 1


def _z(*shape, dtype=BF16):
    return torch.zeros(*shape, dtype=dtype)


def _idx(rows):
    return torch.zeros(rows, dtype=I64)


_VALID: dict = {}


def valid_args(op):
    """Positional arguments of `h3::<op>` (every forward and backward op) that pass validation: zeros at the H3
    widths, S = 3 rows, T = 1 timestep. Built once per op (the projection weight is 520 MB); a fresh list."""
    if op not in _VALID:
        _VALID[op] = _build_valid_args(op)
    return [list(a) if isinstance(a, list) else a for a in _VALID[op]]


def _build_valid_args(op):
    mlp = [_z(T, 256, dtype=F32), _z(5376, 256, dtype=F32), _z(5376, dtype=F32), _z(2688, 5376, dtype=F32)]
    final = [_z(S, H), _z(H), _z(T, 2688, dtype=F32), _z(2 * H, 2688), _z(2 * H), _idx(S)]
    return {
        "timestep_sinusoid": lambda: [_z(T, dtype=F32)],
        "timestep_mlp": lambda: [*mlp, _z(2688, dtype=F32)],
        "timestep_mlp_backward": lambda: [_z(T, 2688, dtype=F32), *mlp],
        "adaln_projection": lambda: [_z(T, 2688, dtype=F32), _z(18 * H, 2688), _z(18 * H)],
        "adaln_projection_backward": lambda: [_z(T, 18 * H), _z(T, 2688, dtype=F32), _z(18 * H, 2688)],
        "adaln_row_gather": lambda: [_z(3 * T, 6 * H), _idx(S)],
        "adaln_row_gather_backward": lambda: [[_z(S, H) for _ in range(6)], _idx(S), 3 * T],
        "norm_modulate": lambda: [_z(S, H), _z(H), _z(3 * T, H), _z(3 * T, H), _idx(S)],
        "norm_modulate_backward": lambda: [_z(S, H), _z(S, H), _z(H), _z(3 * T, H), _idx(S), 1e-5, 3 * T],
        "gate_residual": lambda: [_z(S, H), _z(S, H), _z(3 * T, H), _idx(S)],
        "gate_residual_backward": lambda: [_z(S, H), _z(S, H), _z(3 * T, H), _idx(S)],
        "final_adaln_out": lambda: final,
        "final_adaln_out_fwd": lambda: final,
        "final_adaln_out_backward": lambda: [_z(S, H), *final, 1e-5],
    }[op]()


ALL_OPS = ["timestep_sinusoid", "timestep_mlp", "timestep_mlp_backward", "adaln_projection",
           "adaln_projection_backward", "adaln_row_gather", "adaln_row_gather_backward", "norm_modulate",
           "norm_modulate_backward", "gate_residual", "gate_residual_backward", "final_adaln_out",
           "final_adaln_out_fwd", "final_adaln_out_backward"]


def test_all_ops_lists_every_registered_op():
    registered = {name for name in dir(ops) if isinstance(getattr(ops, name), torch._ops.OpOverloadPacket)}
    assert registered == set(ALL_OPS)


def tensor_args(op):
    """(position, name) of every required `Tensor` argument of `h3::<op>`."""
    schema = getattr(ops, op).default._schema
    return [(i, a.name) for i, a in enumerate(schema.arguments) if str(a.type) == "Tensor"]


def shown(op):
    """The op name the errors give: final_adaln_out's autograd forward speaks as the op the user called."""
    return "final_adaln_out" if op == "final_adaln_out_fwd" else op


CASES = [(op, i, name) for op in ALL_OPS for i, name in tensor_args(op)]
IDS = [f"{op}-{name}" for op, _, name in CASES]


@pytest.mark.parametrize("op", ALL_OPS)
def test_valid_args_pass(op):
    out = getattr(ops, op)(*valid_args(op))
    assert out is not None


# ---- None for a required tensor ------------------------------------------------------------------------

@pytest.mark.parametrize("op, i, name", CASES, ids=IDS)
def test_none_for_a_required_tensor_names_the_op_and_argument(op, i, name):
    """The dispatcher hands a `Tensor` argument given as None to the impls as None: every op refuses it."""
    args = valid_args(op)
    args[i] = None
    if op == "timestep_sinusoid":  # no tensor left to dispatch on: the dispatcher itself refuses, naming the op
        with pytest.raises(NotImplementedError, match=r"no tensor arguments.*schema h3::timestep_sinusoid"):
            getattr(ops, op)(*args)
        return
    with pytest.raises(TypeError, match=rf"^h3::{shown(op)}: {name} is None; the op takes a"):
        getattr(ops, op)(*args)


def test_none_is_refused_by_the_fake_impls_too():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = _build_valid_args("timestep_mlp")
        args[4] = None
        with pytest.raises(TypeError, match=r"^h3::timestep_mlp: b2 is None"):
            ops.timestep_mlp(*args)


# ---- meta tensors among CPU ones --------------------------------------------------------------------------

MIXED = [c for c in CASES if len(tensor_args(c[0])) > 1 or c[0] == "adaln_row_gather_backward"]


@pytest.mark.parametrize("op, i, name", MIXED, ids=[f"{op}-{name}" for op, _, name in MIXED])
def test_one_meta_tensor_among_cpu_tensors_is_refused(op, i, name):
    """Before: the meta (fake) impl ran and returned a CPU tensor of uninitialised memory."""
    args = valid_args(op)
    args[i] = args[i].to("meta")
    # the meta tensor is caught itself, or is the op's reference input and the next one checked is caught
    want = rf"({name} is on meta, expected cpu|[a-z_\[\]0-9]+ is on cpu, expected meta)"
    with pytest.raises(ValueError, match=rf"^h3::{shown(op)}: {want} \(the device of the other inputs\)"):
        getattr(ops, op)(*args)


def test_one_meta_grad_among_cpu_tensors_is_refused():
    args = valid_args("adaln_row_gather_backward")
    args[0][3] = args[0][3].to("meta")
    with pytest.raises(ValueError, match=r"^h3::adaln_row_gather_backward: grads\[3\] is on meta, expected cpu"):
        ops.adaln_row_gather_backward(*args)


@pytest.mark.parametrize("op", ALL_OPS)
def test_all_meta_inputs_give_meta_outputs(op):
    args = [[a.to("meta") for a in x] if isinstance(x, list) else x.to("meta") if isinstance(x, torch.Tensor) else x
            for x in valid_args(op)]
    out = getattr(ops, op)(*args)
    outs = out if isinstance(out, (list, tuple)) else [out]
    assert outs and all(o.is_meta for o in outs)


# ---- forward-mode AD ----------------------------------------------------------------------------------------

FORWARD_OPS = ["timestep_sinusoid", "timestep_mlp", "adaln_projection", "adaln_row_gather", "norm_modulate",
               "gate_residual", "final_adaln_out"]


def _split_floating(args):
    floating = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def call(op, *primals):
        full = list(args)
        for i, p in zip(floating, primals):
            full[i] = p
        return getattr(ops, op)(*full)

    return floating, call


@pytest.mark.parametrize("op", FORWARD_OPS[1:])
def test_torch_func_jvp_is_refused(op):
    """Before: an all-zero tangent, without complaint. (timestep_sinusoid has no autograd kernel, by design: under
    torch.func.jvp its impls never see the tangent; a dual `t` from torch.autograd.forward_ad is refused, below.)"""
    args = valid_args(op)
    floating, call = _split_floating(args)
    primals = tuple(args[i] for i in floating)
    tangents = tuple(torch.ones_like(p) for p in primals)
    with pytest.raises(RuntimeError, match=rf"^h3::{op}: forward-mode AD \(torch.func.jvp"):
        torch.func.jvp(lambda *p: call(op, *p), primals, tangents)


@pytest.mark.parametrize("op", FORWARD_OPS)
def test_forward_ad_dual_tensor_is_refused(op):
    import torch.autograd.forward_ad as fwAD

    args = valid_args(op)
    floating, _ = _split_floating(args)
    last = floating[-1]  # one dual input is enough
    with fwAD.dual_level():
        args[last] = fwAD.make_dual(args[last], torch.ones_like(args[last]))
        with pytest.raises(RuntimeError, match=rf"^h3::{op}: forward-mode AD"):
            getattr(ops, op)(*args)
        # inside a dual level, inputs without a tangent still run
        args[last] = fwAD.unpack_dual(args[last]).primal
        if op != "adaln_projection":  # (a 520 MB GEMM on CPU: its plain run is test_valid_args_pass)
            getattr(ops, op)(*args)
