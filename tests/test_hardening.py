"""Behaviour at the edges, on CPU: None and meta tensors, forward-mode AD, autocast, damaged caches and
bundles, a second checkout beside an editable install, and the command lines' errors."""
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute.widths import (ATTENTION_HEAD_DIM, BLOCK_CHUNKS, BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, FREQ,
                           HIDDEN as H, MLP_HIDDEN, MODALITIES, NORM_EPS, TEMB, VIDEO_PATCH)

ops = torch.ops.h3
BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64
S, T = 3, 1
TABLE_ROWS = MODALITIES * T  # the block tables' rows: one per (timestep, modality)


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
    mlp = [_z(T, FREQ, dtype=F32), _z(MLP_HIDDEN, FREQ, dtype=F32), _z(MLP_HIDDEN, dtype=F32),
           _z(TEMB, MLP_HIDDEN, dtype=F32)]
    final = [_z(S, H), _z(H), _z(T, TEMB, dtype=F32), _z(FINAL_PROJECTION, TEMB), _z(FINAL_PROJECTION), _idx(S)]
    return {
        "timestep_sinusoid": lambda: [_z(T, dtype=F32)],
        "timestep_mlp": lambda: [*mlp, _z(TEMB, dtype=F32)],
        "timestep_mlp_backward": lambda: [_z(T, TEMB, dtype=F32), *mlp],
        "adaln_projection": lambda: [_z(T, TEMB, dtype=F32), _z(BLOCK_PROJECTION, TEMB), _z(BLOCK_PROJECTION)],
        "adaln_projection_backward": lambda: [_z(T, BLOCK_PROJECTION), _z(T, TEMB, dtype=F32),
                                              _z(BLOCK_PROJECTION, TEMB)],
        "adaln_row_gather": lambda: [_z(TABLE_ROWS, BLOCK_TABLE), _idx(S)],
        "adaln_row_gather_backward": lambda: [[_z(S, H) for _ in range(BLOCK_CHUNKS)], _idx(S), TABLE_ROWS],
        "norm_modulate": lambda: [_z(S, H), _z(H), _z(TABLE_ROWS, H), _z(TABLE_ROWS, H), _idx(S)],
        "norm_modulate_backward": lambda: [_z(S, H), _z(S, H), _z(H), _z(TABLE_ROWS, H), _idx(S), NORM_EPS, TABLE_ROWS],
        "gate_residual": lambda: [_z(S, H), _z(S, H), _z(TABLE_ROWS, H), _idx(S)],
        "gate_residual_backward": lambda: [_z(S, H), _z(S, H), _z(TABLE_ROWS, H), _idx(S)],
        "final_adaln_out": lambda: final,
        "final_adaln_out_fwd": lambda: final,
        "final_adaln_out_backward": lambda: [_z(S, H), *final, NORM_EPS, _z(T, FINAL_PROJECTION)],
        "adaln_indices": lambda: [_idx(S), _idx(S), T],
        "gate_residual_norm_modulate": lambda: [_z(S, H), _z(S, H), _z(TABLE_ROWS, H), _z(H), _z(TABLE_ROWS, H),
                                                _z(TABLE_ROWS, H), _idx(S)],
        "gate_residual_norm_modulate_backward": lambda: [_z(S, H), _z(S, H), _z(S, H), _z(TABLE_ROWS, H), _z(S, H),
                                                         _z(H), _z(TABLE_ROWS, H), _idx(S), NORM_EPS, TABLE_ROWS],
        "linear": lambda: [_z(S, VIDEO_PATCH, dtype=F32), _z(H, VIDEO_PATCH, dtype=F32), _z(H, dtype=F32)],
        "linear_backward": lambda: [_z(S, H, dtype=F32), _z(S, VIDEO_PATCH, dtype=F32), _z(H, VIDEO_PATCH, dtype=F32)],
        # the model scope's ops (h3cute.ops.model): q/k/v (1, S, heads, head_dim), small linears and widths
        "attention": lambda: _heads(3),
        "attention_with_lse": lambda: _heads(3),
        "attention_backward": lambda: _heads(5) + [_z(1, HEADS, S, dtype=F32)],
        "dense": lambda: [_z(S, 64), _z(32, 64), _z(32)],
        "dense_backward": lambda: [_z(S, 32), _z(S, 64), _z(32, 64)],
        "rms_norm": lambda: [_z(S, ATTENTION_HEAD_DIM), _z(ATTENTION_HEAD_DIM), NORM_EPS],
        "rms_norm_backward": lambda: [_z(S, ATTENTION_HEAD_DIM), _z(S, ATTENTION_HEAD_DIM), _z(ATTENTION_HEAD_DIM),
                                      NORM_EPS],
        "rotary": lambda: [*_heads(), _z(S, 96, dtype=F32), _z(S, 96, dtype=F32)],
        "rotary_backward": lambda: [*_heads(), _z(S, 96, dtype=F32), _z(S, 96, dtype=F32)],
        "qk_norm_rotary": lambda: [*_heads(), _z(ATTENTION_HEAD_DIM), _z(S, 96, dtype=F32), _z(S, 96, dtype=F32),
                                   NORM_EPS],
        "qk_norm_rotary_backward": lambda: [*_heads(2), _z(ATTENTION_HEAD_DIM), _z(S, 96, dtype=F32),
                                            _z(S, 96, dtype=F32), NORM_EPS],
        "swiglu": lambda: [_z(S, 64)],
        "swiglu_backward": lambda: [_z(S, 32), _z(S, 64)],
        "rotary_table": lambda: [_idx(S * 3).view(S, 3), _z(16, dtype=F32)],
    }[op]()


HEADS = 2


def _heads(n=1):
    """n (1, S, heads, head_dim) BF16 zeros: q / k / v and their gradients."""
    return [_z(1, S, HEADS, ATTENTION_HEAD_DIM) for _ in range(n)]


ALL_OPS = ["timestep_sinusoid", "timestep_mlp", "timestep_mlp_backward", "adaln_projection",
           "adaln_projection_backward", "adaln_row_gather", "adaln_row_gather_backward", "norm_modulate",
           "norm_modulate_backward", "gate_residual", "gate_residual_backward", "final_adaln_out",
           "final_adaln_out_fwd", "final_adaln_out_backward", "adaln_indices", "gate_residual_norm_modulate",
           "gate_residual_norm_modulate_backward", "linear", "linear_backward"] + [
    "attention", "attention_with_lse", "attention_backward", "dense", "dense_backward", "rms_norm",
    "rms_norm_backward", "rotary", "rotary_backward", "qk_norm_rotary", "qk_norm_rotary_backward", "swiglu",
    "swiglu_backward", "rotary_table"]
FA4_OPS = ("attention", "attention_with_lse", "attention_backward")  # on CUDA: FlashAttention-4, when importable


def _fa4_or_skip(op):
    import importlib.util
    if op in FA4_OPS and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("FlashAttention-4 (flash-attn-4) is not importable: h3::attention runs it on CUDA")


def test_all_ops_lists_every_registered_op():
    registered = {name for name in dir(ops) if isinstance(getattr(ops, name), torch._ops.OpOverloadPacket)}
    assert registered == set(ALL_OPS)


def tensor_args(op):
    """(position, name) of every required `Tensor` argument of `h3::<op>`."""
    schema = getattr(ops, op).default._schema
    return [(i, a.name) for i, a in enumerate(schema.arguments) if str(a.type) == "Tensor"]


def one_tensor(op) -> bool:
    """The op takes a single tensor (no Tensor[] either): given None there, the dispatcher has nothing to go on."""
    return sum("Tensor" in str(a.type) for a in getattr(ops, op).default._schema.arguments) == 1


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
    if one_tensor(op):  # no tensor left to dispatch on: the dispatcher itself refuses, naming the op
        with pytest.raises(NotImplementedError, match=rf"no tensor arguments.*schema h3::{op}"):
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
               "gate_residual", "final_adaln_out", "linear", "attention", "dense", "rms_norm", "rotary",
               "qk_norm_rotary", "swiglu"]


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


# ---- autocast -----------------------------------------------------------------------------------------------

_RANDOM: dict = {}


def random_args(op):
    """`valid_args` with random values (indices within their tables), for comparing bits."""
    if op not in _RANDOM:
        g = torch.Generator().manual_seed(7)

        def rand(a):
            if isinstance(a, list):
                return [rand(x) for x in a]
            if not isinstance(a, torch.Tensor):
                return a
            if a.dtype == I64:
                high = TABLE_ROWS if op.startswith(("adaln_row", "norm", "gate")) else T
                return torch.randint(0, high, a.shape, generator=g)
            if op == "timestep_sinusoid":
                return torch.rand(a.shape, generator=g)
            scale = a.shape[-1] ** -0.5 if a.dim() == 2 and a.shape[0] > 4 * H else 0.5
            return (torch.randn(a.shape, generator=g) * scale).to(a.dtype)

        _RANDOM[op] = [rand(a) for a in valid_args(op)]
    return [list(a) if isinstance(a, list) else a for a in _RANDOM[op]]


def _outs(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _bf16_args(op):
    from h3cute.ops import _library

    schema = getattr(ops, op).default._schema
    return [(i, a.name) for i, a in enumerate(schema.arguments) if a.name in _library.autocast_bf16(op)]


WITH_BF16 = [op for op in ALL_OPS if _bf16_args(op)]


def test_every_op_has_autocast_kernels_that_are_off_without_autocast():
    for op in ALL_OPS:
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"h3::{op}", key), (op, key)
    # outside torch.autocast the dispatcher excludes both keys: the kernels are never reached
    for key in (torch._C.DispatchKey.AutocastCPU, torch._C.DispatchKey.AutocastCUDA):
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(key)


def test_bf16_argument_lists_match_the_checks():
    """Every tensor argument the op validates as BF16 is in its autocast list, and nothing else: a listed argument
    refuses FP32 outside autocast, an unlisted floating one refuses BF16 (fake tensors: the same checks, no data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for op in ALL_OPS[1:]:  # timestep_sinusoid widens t from any floating dtype
            named = {n for _, n in _bf16_args(op)}
            checked = set()
            for i, a in enumerate(_build_valid_args(op)):
                name = getattr(ops, op).default._schema.arguments[i].name
                first = a[0] if isinstance(a, list) else a
                if not (isinstance(first, torch.Tensor) and first.is_floating_point()):
                    continue
                args = _build_valid_args(op)
                other = F32 if first.dtype == BF16 else BF16
                args[i] = [t.to(other) for t in a] if isinstance(a, list) else a.to(other)
                with pytest.raises(TypeError, match=rf"{name}(\[0\])? must be "
                                                    rf"{'bfloat16' if name in named else 'float32'}, got"):
                    getattr(ops, op)(*args)
                checked.add(name)
            assert named <= checked, (op, named - checked)


# (op, autocast dtype): FP16 autocast too, except for the projection's 520 MB CPU GEMMs (the same kernel path)
AUTOCAST_CASES = [(op, d) for op in ALL_OPS for d in (BF16, torch.float16)
                  if d == BF16 or not op.startswith("adaln_projection")]


@pytest.mark.parametrize("op, dtype", AUTOCAST_CASES, ids=[f"{op}-{str(d)[6:]}" for op, d in AUTOCAST_CASES])
def test_autocast_keeps_the_ops_dtypes_and_bits(op, dtype):
    """Before: timestep_mlp under CPU autocast ran its F.linear in BF16 and returned BF16."""
    args = random_args(op)
    want = _outs(getattr(ops, op)(*args))
    with torch.autocast("cpu", dtype=dtype):
        got = _outs(getattr(ops, op)(*args))
    assert [g.dtype for g in got] == [w.dtype for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("op", WITH_BF16)
def test_autocast_casts_fp32_into_bf16_arguments_as_linear_does(op):
    """FP32 (e.g. master weights) where the op takes BF16: cast under autocast, the bits of the BF16 call; outside
    autocast still refused."""
    args = random_args(op)
    bf16 = _bf16_args(op)
    widened = list(args)
    for i, _ in bf16:
        widened[i] = [t.float() for t in args[i]] if isinstance(args[i], list) else args[i].float()
    with pytest.raises(TypeError, match=r"must be bfloat16, got float32"):
        getattr(ops, op)(*widened)
    want = _outs(getattr(ops, op)(*args))
    with torch.autocast("cpu", dtype=BF16):
        got = _outs(getattr(ops, op)(*widened))
    assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("op, i, name", [("timestep_mlp", 0, "x"), ("timestep_mlp", 3, "w2"),
                                         ("adaln_projection", 0, "temb"), ("final_adaln_out", 2, "temb")])
def test_autocast_never_casts_fp32_arguments_up(op, i, name):
    """A BF16 temb or MLP input is the cast-too-early defect: refused under autocast as outside it."""
    args = random_args(op)
    args[i] = args[i].to(BF16)
    with torch.autocast("cpu", dtype=BF16), pytest.raises(TypeError, match=rf"h3::{op}: {name} must be float32"):
        getattr(ops, op)(*args)


def test_autocast_leaves_fp64_alone():
    args = random_args("norm_modulate")
    args[1] = args[1].double()
    with torch.autocast("cpu", dtype=BF16), pytest.raises(TypeError, match=r"weight must be bfloat16, got float64"):
        ops.norm_modulate(*args)


@pytest.mark.parametrize("op", ALL_OPS)
def test_fake_tensors_under_autocast_give_the_eager_dtypes(op):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = random_args(op)
    for i, _ in _bf16_args(op):  # the cast path as well
        args[i] = [t.float() for t in args[i]] if isinstance(args[i], list) else args[i].float()
    with torch.autocast("cpu", dtype=BF16):
        eager = _outs(getattr(ops, op)(*args))
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = _outs(getattr(ops, op)(*args))
    assert [(f.dtype, f.shape) for f in fake] == [(e.dtype, e.shape) for e in eager]


def _mlp_fwd_bwd(args, autocast):
    leaves = [a.detach().clone().requires_grad_() for a in args]
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = ops.timestep_mlp(*leaves)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))  # backward inside the region, too
    return out, [a.grad for a in leaves]


def test_timestep_mlp_backward_under_autocast_is_the_fp32_backward():
    """Before: the BF16 output's gradient reached the FP32 backward op and raised."""
    args = random_args("timestep_mlp")
    out, grads = _mlp_fwd_bwd(args, True)
    ref_out, ref_grads = _mlp_fwd_bwd(args, False)
    assert out.dtype == F32 and torch.equal(out, ref_out)
    assert all(g.dtype == F32 and torch.equal(g, r) for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("op", ["norm_modulate", "gate_residual", "final_adaln_out", "adaln_row_gather"])
def test_backward_under_autocast_reaches_fp32_master_weights(op):
    """FP32 leaves cast to BF16 by the autocast kernel get the BF16 call's gradients, widened."""
    args = random_args(op)
    floating = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def run(widen, autocast):
        leaves = list(args)
        for i in floating:
            leaves[i] = (args[i].float() if widen else args[i]).detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            outs = _outs(getattr(ops, op)(*leaves))
        g = torch.Generator().manual_seed(3)
        torch.autograd.backward(outs, [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs])
        return outs, [leaves[i].grad for i in floating], [leaves[i].dtype for i in floating]

    outs, grads, dtypes = run(True, True)
    ref_outs, ref_grads, _ = run(False, False)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref_outs))
    for g, r, d in zip(grads, ref_grads, dtypes):
        assert g.dtype == d and torch.equal(g, r.to(d))


@pytest.mark.parametrize("op", ["timestep_mlp", "norm_modulate", "final_adaln_out"])
def test_torch_compile_under_autocast_agrees_with_eager(op):
    torch._dynamo.reset()
    args = random_args(op)
    for i, _ in _bf16_args(op):
        args[i] = args[i].float()
    fn = getattr(ops, op)

    def f(*a):
        with torch.autocast("cpu", dtype=BF16):
            return fn(*a)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    got = _outs(compiled(*leaves))
    want = _outs(f(*args))
    assert [g.dtype for g in got] == [w.dtype for w in want] and all(torch.equal(g, w) for g, w in zip(got, want))
    torch.autograd.backward(got, [torch.ones_like(g) for g in got])
    assert all(a.grad is not None and a.grad.dtype == a.dtype for a in leaves if a.is_floating_point())


# ---- the disk cache -----------------------------------------------------------------------------------------
# One real compile of test_runtime's tiny kernel per module; the tests then "build" by copying that library
# (through the cache's own atomic write), so they exercise every file operation without compiling again.

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

from h3cute.runtime import bundle, cache, loader, sources  # noqa: E402
from h3cute.runtime.spec import canonical_static  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
STATIC = dict(addend=3.0)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """(ADD spec, a compiled library of ADD for sm_90a with STATIC): readable by every user."""
    from test_runtime import ADD

    folder = Path(tempfile.mkdtemp(prefix="h3cute-template-"))
    os.chmod(folder, 0o755)
    old = os.environ.get("H3CUTE_CACHE_DIR")
    os.environ["H3CUTE_CACHE_DIR"] = str(folder)
    try:
        cache.load_or_build(ADD.name, "sm_90a", STATIC, lambda: ADD)
    finally:
        if old is None:
            del os.environ["H3CUTE_CACHE_DIR"]
        else:
            os.environ["H3CUTE_CACHE_DIR"] = old
    [so] = folder.glob("*.so")
    yield ADD, so
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def copy_builds(template, monkeypatch):
    """cache._build copies the template library; returns the list of folders built into."""
    _, so = template
    built = []

    def build(spec, arch, static, symbol, out):
        assert static == STATIC, "the template holds only STATIC's library"
        built.append(out.parent)
        cache._atomic_write(out, lambda p: shutil.copyfile(so, p))

    monkeypatch.setattr(cache, "_build", build)
    monkeypatch.setattr(cache, "_fallbacks", {})
    return built


def _entry(root):
    from test_runtime import ADD

    key = cache.entry_key(ADD.name, "sm_90a", canonical_static(STATIC))
    return root / f"{key}.so", root / f"{key}.json"


def _load(template):
    spec, _ = template
    return cache.load_or_build(spec.name, "sm_90a", STATIC, lambda: spec)


@pytest.mark.parametrize("sidecar", ["null", "[]", "7", '"x"', "{}", '{"sha256": 1, "symbol": "s"}',
                                     '{"sha256": "ab", "symbol": null}', "\udcff"])
def test_a_sidecar_of_the_wrong_type_heals(template, copy_builds, tmp_path, monkeypatch, sidecar):
    """Before: valid JSON of the wrong type raised TypeError at every run, the entry never rebuilt."""
    monkeypatch.setenv("H3CUTE_CACHE_DIR", str(tmp_path))
    _load(template)
    so, side = _entry(tmp_path)
    side.write_bytes(sidecar.encode("utf-8", "surrogateescape"))
    assert type(_load(template)).__name__ == "Function"
    assert copy_builds == [tmp_path, tmp_path]
    assert json.loads(side.read_text())["sha256"] == loader.sha256_file(so)


def test_cache_files_are_world_readable_whatever_the_umask(template, copy_builds, tmp_path, monkeypatch):
    root = tmp_path / "shared" / "h3cute"
    monkeypatch.setenv("H3CUTE_CACHE_DIR", str(root))
    old = os.umask(0o077)
    try:
        _load(template)
    finally:
        os.umask(old)
    so, side = _entry(root)
    assert stat.S_IMODE(so.stat().st_mode) == 0o644 and stat.S_IMODE(side.stat().st_mode) == 0o644
    assert stat.S_IMODE(root.stat().st_mode) == 0o755 and stat.S_IMODE(root.parent.stat().st_mode) == 0o755
    [lock] = root.glob("*.lock")
    assert stat.S_IMODE(lock.stat().st_mode) == 0o666  # whoever may write the folder may build in it


class _DeniedLock:
    """FileLock for folders this user may not write: acquiring raises PermissionError."""

    def __init__(self, path, mode=None):
        self.path = path

    def acquire(self):
        raise PermissionError(13, "Permission denied", self.path)


def _deny_locks_under(monkeypatch, *roots):
    real = cache.FileLock

    def lock(path, mode=None):
        denied = any(Path(path).is_relative_to(r) for r in roots)
        return _DeniedLock(path) if denied else real(path, mode=mode)

    monkeypatch.setattr(cache, "FileLock", lock)


def test_a_cache_this_user_cannot_write_serves_what_it_holds_and_falls_back_with_one_warning(
        template, copy_builds, tmp_path, monkeypatch, caplog):
    shared, home = tmp_path / "shared", tmp_path / "home"
    monkeypatch.setenv("H3CUTE_CACHE_DIR", str(shared))
    monkeypatch.setenv("HOME", str(home))
    _load(template)  # built into the shared cache by someone who could write it
    _deny_locks_under(monkeypatch, shared)
    monkeypatch.setattr(cache, "_fallbacks", {})
    assert _load(template) is not None and copy_builds == [shared]  # a hit needs no lock
    for damaged in (True, False):  # a damaged shared entry, then a missing one: built in the fallback
        so, side = _entry(shared)
        side.write_text("null") if damaged else (side.unlink(), so.unlink())
        with caplog.at_level(logging.WARNING, logger="h3cute.runtime"):
            fn = _load(template)
        assert type(fn).__name__ == "Function"
    fallback = home / ".cache" / "h3cute"
    assert copy_builds == [shared, fallback]  # the second time the fallback's entry is a hit
    warnings = [r.getMessage() for r in caplog.records if "kernel cache" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"H3CUTE_CACHE_DIR={shared}" in warnings[0] and str(fallback) in warnings[0]
    assert "Permission denied" in warnings[0]


def test_an_unusable_cache_and_fallback_raise_naming_the_variable_and_path(template, copy_builds, tmp_path,
                                                                           monkeypatch, caplog):
    shared, home = tmp_path / "shared", tmp_path / "home"
    monkeypatch.setenv("H3CUTE_CACHE_DIR", str(shared))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    _deny_locks_under(monkeypatch, tmp_path)
    fallback = home / ".cache" / "h3cute"
    with pytest.raises(cache.CacheError) as err:
        _load(template)
    assert str(err.value).startswith(f"kernel cache H3CUTE_CACHE_DIR={shared} is unusable (cannot lock {shared}/")
    assert f"and so is the fallback cache folder {fallback}: cannot lock {fallback}/" in str(err.value)


def test_a_cache_path_that_is_a_file_falls_back(template, copy_builds, tmp_path, monkeypatch, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("H3CUTE_CACHE_DIR", str(not_a_folder))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with caplog.at_level(logging.WARNING, logger="h3cute.runtime"):
        assert type(_load(template)).__name__ == "Function"
    assert copy_builds == [tmp_path / "home" / ".cache" / "h3cute"]
    assert f"H3CUTE_CACHE_DIR={not_a_folder}: cannot create {not_a_folder}" in caplog.text


_NOBODY = 65534


def _as_another_user(code: str, env: dict) -> subprocess.CompletedProcess:
    """Runs `code` as the user nobody (needs root and setpriv), with this checkout's src first."""
    full = {**os.environ, **env, "PYTHONPATH": str(SRC), "HOME": "/nonexistent"}
    cmd = ["setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups", sys.executable, "-c",
           textwrap.dedent(code)]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=300)


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to act as a second user")


@needs_root
def test_a_cache_built_by_one_user_serves_another_who_falls_back_for_the_rest(template):
    """Entries root wrote are read by nobody; an entry nobody cannot read (written 0600, as earlier versions did)
    cannot be rebuilt in root's 0755 folder: it is built in a private folder, with one warning naming
    H3CUTE_CACHE_DIR and the path."""
    spec, template_so = template
    shared = Path(tempfile.mkdtemp(prefix="h3cute-shared-"))
    os.chmod(shared, 0o755)
    env = {"H3CUTE_CACHE_DIR": str(shared / "cache")}
    run = f"""
        import logging, os, shutil, sys
        logging.basicConfig(level=logging.WARNING, format="WARN %(message)s")
        from h3cute.runtime import cache, sources
        sources.source_fingerprint = lambda: {sources.source_fingerprint()!r}
        assert os.getuid() == {_NOBODY}
        built = []
        def build(spec, arch, static, symbol, out):
            built.append(str(out.parent))
            cache._atomic_write(out, lambda p: shutil.copyfile({str(template_so)!r}, p))
        cache._build = build
        for _ in range(2):
            fn = cache.load_or_build({spec.name!r}, "sm_90a", {STATIC!r}, lambda: None)
            assert type(fn).__name__ == "Function"
        print("BUILT", built)
    """
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("H3CUTE_CACHE_DIR", env["H3CUTE_CACHE_DIR"])
            mp.setattr(cache, "_build", lambda spec, arch, static, symbol, out: cache._atomic_write(
                out, lambda p: shutil.copyfile(template_so, p)))
            _load(template)  # root's entry
        first = _as_another_user(run, env)
        assert first.returncode == 0 and "BUILT []" in first.stdout and "WARN" not in first.stderr, first.stderr
        for f in _entry(shared / "cache"):
            os.chmod(f, 0o600)
        second = _as_another_user(run, env)
        assert second.returncode == 0, second.stderr
        warnings = [line for line in second.stderr.splitlines() if line.startswith("WARN")]
        assert len(warnings) == 1, second.stderr
        assert warnings[0].startswith(f"WARN h3cute: kernel cache H3CUTE_CACHE_DIR={shared / 'cache'}: cannot ")
        assert "Permission denied" in warnings[0]
        # HOME (/nonexistent) cannot hold ~/.cache/h3cute: a private temporary folder; built once, then a hit
        assert second.stdout.startswith("BUILT ['/tmp/h3cute-cache-") and second.stdout.count("h3cute-cache-") == 1
    finally:
        for leftover in Path(tempfile.gettempdir()).glob("h3cute-cache-*"):
            if leftover.stat().st_uid == _NOBODY:
                shutil.rmtree(leftover, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)


# ---- prebuilt bundles -------------------------------------------------------------------------------------

def _manifest(**changes):
    from test_runtime import ADD

    good = {"format": bundle.FORMAT, "fingerprint": sources.source_fingerprint(), "dsl_version": "x",
            "libraries": {"sm_90a": {"file": bundle.library_name("sm_90a"), "sha256": "0" * 64}},
            "entries": [{"name": ADD.name, "module": "m", "arch": "sm_90a",
                         "static": '[["addend",3.0]]', "symbol": "h3_test_add_0"}]}
    return {**good, **changes}


DAMAGES = {  # what the manifest's text is -> what the error says
    "truncated": (json.dumps(_manifest())[:40], "is not JSON"),
    "null": ("null", "holds NoneType, not an object"),
    "list": ("[]", "holds list, not an object"),
    "no_fingerprint": (json.dumps({k: v for k, v in _manifest().items() if k != "fingerprint"}),
                       "has no source fingerprint"),
    "fingerprint_int": (json.dumps(_manifest(fingerprint=7)), "has no source fingerprint"),
    "entries_object": (json.dumps(_manifest(entries={})), "has no 'entries' list"),
    "entry_without_symbol": (json.dumps(_manifest(entries=[{"name": "a", "arch": "sm_90a", "static": "[]"}])),
                             "has no 'entries' list"),
    "library_without_sha": (json.dumps(_manifest(libraries={"sm_90a": {}})), "has no 'libraries' object"),
    "entry_arch_without_library": (json.dumps(_manifest(libraries={})), "has entries for ['sm_90a'] but no library"),
    "not_utf8": ("\udcff", "cannot be read"),
}


def _write_bundle(folder: Path, text: str) -> Path:
    folder.mkdir()
    (folder / bundle.MANIFEST).write_bytes(text.encode("utf-8", "surrogateescape"))
    return folder


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_manifest_names_h3cute_prebuilt_and_the_path(tmp_path, damage):
    """Before: raw JSONDecodeError, AttributeError, KeyError or TypeError, naming nothing."""
    text, what = DAMAGES[damage]
    folder = _write_bundle(tmp_path / "bundle", text)
    with pytest.raises(bundle.DamagedBundleError) as err:
        bundle.open_bundle(folder)
    message = str(err.value)
    assert message.startswith(f"H3CUTE_PREBUILT={folder}: damaged bundle: {folder / bundle.MANIFEST} {what}"), message
    with pytest.raises(bundle.DamagedBundleError):  # remembered, and raised again
        bundle.open_bundle(folder)


def test_a_missing_manifest_is_a_bundle_error(tmp_path):
    with pytest.raises(bundle.DamagedBundleError, match=rf"H3CUTE_PREBUILT={tmp_path}: no manifest.json there"):
        bundle.open_bundle(tmp_path)


def test_a_valid_manifest_opens(tmp_path):
    folder = _write_bundle(tmp_path / "bundle", json.dumps(_manifest()))
    assert bundle.open_bundle(folder).variants_of("test_add", "sm_90a") == ['[["addend",3.0]]']


def _run_without_dsl(code: str, env: dict) -> subprocess.CompletedProcess:
    block = textwrap.dedent("""
        import sys
        class _NoCuteDSL:
            def find_spec(self, name, path=None, target=None):
                if name == "cutlass" or name.startswith("cutlass."):
                    raise ImportError("the CuTe DSL is blocked in this test: " + name)
        sys.meta_path.insert(0, _NoCuteDSL())
    """)
    prelude = block + textwrap.dedent(f"""
        import h3cute.runtime.sources
        h3cute.runtime.sources.source_fingerprint = lambda: {sources.source_fingerprint()!r}
    """)
    full = {**os.environ, **env, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=full, capture_output=True,
                          text=True, timeout=300)


def test_without_the_dsl_a_damaged_bundle_raises_the_bundle_error(tmp_path):
    folder = _write_bundle(tmp_path / "bundle", "null")
    result = _run_without_dsl("""
        import h3cute.runtime as rt
        from h3cute.runtime.bundle import DamagedBundleError
        try:
            rt.kernel_for_arch("test_add", "sm_90a", addend=3.0)
        except DamagedBundleError as e:
            print("REFUSED:", e)
    """, {"H3CUTE_PREBUILT": str(folder)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"REFUSED: H3CUTE_PREBUILT={folder}: damaged bundle:"), result.stdout


@pytest.mark.parametrize("damage", ["null", "truncated", "no_fingerprint", "library_sha256"])
def test_where_the_dsl_is_a_damaged_bundle_falls_back_to_compiling_with_one_warning(
        template, copy_builds, tmp_path, monkeypatch, caplog, damage):
    import h3cute.runtime as rt

    spec, template_so = template
    if damage == "library_sha256":  # a manifest that checks out, a library that does not match it
        folder = _write_bundle(tmp_path / "bundle", json.dumps(_manifest()))
        shutil.copyfile(template_so, folder / bundle.library_name("sm_90a"))
    else:
        folder = _write_bundle(tmp_path / "bundle", DAMAGES[damage][0])
    monkeypatch.setenv("H3CUTE_PREBUILT", str(folder))
    monkeypatch.setenv("H3CUTE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sources.kernels_package(), "get_spec", lambda name: spec)
    with caplog.at_level(logging.WARNING, logger="h3cute.runtime"):
        for _ in range(2):
            fn = rt._resolve(spec.name, "sm_90a", STATIC, canonical_static(STATIC))
            assert type(fn).__name__ == "Function"
    assert copy_builds == [tmp_path / "cache"]  # compiled once, then served from the disk cache
    warnings = [r.getMessage() for r in caplog.records if "H3CUTE_PREBUILT" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"H3CUTE_PREBUILT={folder}: damaged bundle: ")
    assert warnings[0].endswith("; compiling with the CuTe DSL instead")
    if damage == "library_sha256":
        assert "sha256 does not match" in warnings[0]


# ---- a second checkout beside an editable install -----------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def _checkout(folder: Path, marker: str) -> Path:
    """A copy of this checkout's src/ (its kernels link kept a link) and kernels/; `marker` in its kernels makes its
    fingerprint its own."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "src", folder / "src", ignore=ignore, symlinks=True)
    shutil.copytree(REPO / "kernels", folder / "kernels", ignore=ignore)
    assert (folder / "src" / "h3cute" / "kernels").is_symlink()
    (folder / "kernels" / "_checkout_marker.py").write_text(f"NAME = {marker!r}\n")
    return folder


def _editable_install(site: Path, checkout: Path) -> None:
    """What `pip install -e checkout` can leave in site-packages: setuptools' import finder and its .pth, here with an
    explicit mapping of h3cute.kernels to the checkout's kernels/ (the worst case for a second checkout)."""
    from setuptools.command.editable_wheel import _finder_template

    site.mkdir()
    mapping = {"h3cute": str(checkout / "src" / "h3cute"), "h3cute.kernels": str(checkout / "kernels")}
    (site / "__editable___h3cute_test_finder.py").write_text(
        _finder_template("__editable___h3cute_test_finder", mapping, {}))
    (site / "__editable__.h3cute_test.pth").write_text(
        "import __editable___h3cute_test_finder; __editable___h3cute_test_finder.install()\n")


def _imports(site: Path | None, pythonpath: Path | None) -> dict:
    """Where a fresh interpreter (no other site's finders: -S, then the venv's packages without their .pth files)
    takes h3cute and h3cute.kernels from."""
    import sysconfig

    code = textwrap.dedent(f"""
        import json, site, sys
        sys.path.append({sysconfig.get_paths()["purelib"]!r})
        if {str(site) if site else ''!r}:
            site.addsitedir({str(site) if site else ''!r})
        import h3cute, h3cute.kernels
        from h3cute.kernels import _checkout_marker
        from h3cute.runtime import sources
        print(json.dumps(dict(h3cute=h3cute.__file__, kernels=h3cute.kernels.__file__, marker=_checkout_marker.NAME,
                              kernels_dir=str(sources.kernels_dir()), fingerprint=sources.source_fingerprint())))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True,
                            timeout=300, cwd="/")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_second_checkout_on_pythonpath_imports_its_own_kernels(tmp_path):
    """Checkout B on PYTHONPATH beside an editable install of A takes B's kernels: the ordinary import finds
    src/h3cute/kernels in B's h3cute before the editable finder is asked."""
    a, b = _checkout(tmp_path / "A", "A"), _checkout(tmp_path / "B", "B")
    _editable_install(tmp_path / "site", a)
    only_a = _imports(tmp_path / "site", None)
    assert only_a["h3cute"] == str(a / "src" / "h3cute" / "__init__.py")
    assert only_a["marker"] == "A" and only_a["kernels_dir"] == str(a / "kernels")
    b_first = _imports(tmp_path / "site", b / "src")
    assert b_first["h3cute"] == str(b / "src" / "h3cute" / "__init__.py")
    assert Path(b_first["kernels"]).resolve() == b / "kernels" / "__init__.py"
    assert b_first["marker"] == "B" and b_first["kernels_dir"] == str(b / "kernels")
    assert b_first["fingerprint"] != only_a["fingerprint"]


def test_an_installed_package_imports_the_kernels_inside_it(tmp_path):
    """A wheel's layout: h3cute/kernels is a subpackage of the installed h3cute."""
    checkout = _checkout(tmp_path / "C", "wheel")
    installed = tmp_path / "site-packages"
    shutil.copytree(checkout / "src" / "h3cute", installed / "h3cute")  # a wheel holds the linked files themselves
    assert not (installed / "h3cute" / "kernels").is_symlink()
    (tmp_path / "kernels").mkdir()  # a stray kernels/ beside site-packages' parent is never taken
    got = _imports(None, installed)
    assert got["h3cute"] == str(installed / "h3cute" / "__init__.py")
    assert got["marker"] == "wheel" and got["kernels_dir"] == str(installed / "h3cute" / "kernels")


# ---- command lines ------------------------------------------------------------------------------------------

SEEDS = sorted((Path(__file__).parent / "data" / "seeds").glob("*.json"))


def _paths(node, path=()):
    """Every (path, value) inside a JSON document."""
    yield path, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, path + (k,))


def _distinct_paths(doc):
    """The paths of `doc`, one per shape: list items and row-count keys ("64") stand for their siblings."""
    seen = set()
    for path, _ in _paths(doc):
        shape = tuple("#" if not isinstance(k, str) or k.isdigit() else k for k in path)
        if shape not in seen:
            seen.add(shape)
            yield path


def _replaced(doc, path, value):
    doc = json.loads(json.dumps(doc))
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


@pytest.mark.parametrize("seed", SEEDS, ids=lambda p: p.name)
def test_report_reader_refuses_every_malformed_value_with_a_report_error(seed, tmp_path):
    """Any value anywhere replaced by one of another type: the reader accepts it (and compare then renders it) or
    raises ReportError naming the file; never another exception."""
    from h3cute.bench import report

    good, other = json.loads(seed.read_text()), report.load_report(seed)
    path = tmp_path / "r.json"
    refused = 0
    for where in list(_distinct_paths(good)):
        for value in (None, [], {}, "x", "²", 7, -1.5, True):
            path.write_text(json.dumps(_replaced(good, where, value)))
            try:
                rep = report.load_report(path)
            except report.ReportError as e:
                assert str(e).startswith(f"{path}: not an h3_prior_art report:\n  "), e
                refused += 1
                continue
            report.compare_markdown(rep, other)
    assert refused > 100


def _bench(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3cute.bench", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(SRC)}, cwd=cwd)


@pytest.mark.parametrize("text, what", [
    (None, "cannot be read"),
    ('{"kind": "h3_prior_art", "op": ', "not JSON"),
    ("null", "not an h3_prior_art report:\n  report: must be a JSON object"),
    ('{"kind": "h3_prior_art", "results": {"plain": {"c": {"source": "s", "batch_invariance": {"all_rows": []}}}}}',
     "not an h3_prior_art report:"),
])
def test_compare_on_a_malformed_file_prints_one_error_naming_it(tmp_path, text, what):
    """Before: a traceback (JSONDecodeError, AttributeError) that never named the file."""
    bad = tmp_path / "bad.json"
    if text is not None:
        bad.write_text(text)
    result = _bench("compare", SEEDS[0], bad)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"h3cute-bench compare: error: {bad}: {what}"), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("plan, what", [
    ("sweep_pool=abc", r"--plan sweep_pool=abc: the value is not JSON \("),
    ("sweep_pool", r"--plan sweep_pool: the value is not JSON"),
    ("sweep_pool=[256]", r"--plan sweep_pool=\[256\]: sweep_pool takes int, got \[256\]"),
    ("accuracy_sizes=[1,\"x\"]", r"accuracy_sizes takes tuple\[int, \.\.\.\] \| None, got"),
    ("graphs=1", r"graphs takes bool, got 1"),
    ("no_such_field=1", r"--plan no_such_field=1: unknown field 'no_such_field'; fields: \["),
])
def test_bad_plan_overrides_print_one_error(tmp_path, capsys, plan, what):
    from h3cute.bench.cli import main

    for argv in (["prior-art", "--op", "timestep_sinusoid", "--out", str(tmp_path / "r.json")],
                 ["sweep", "--op", "timestep_mlp", "--out", str(tmp_path / "s.json")]):
        assert main([*argv, "--plan", plan]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"h3cute-bench {argv[0]}: error: ") and len(err.splitlines()) == 1, err
        assert __import__("re").search(what, err), err
    assert not list(tmp_path.iterdir())  # nothing ran


def test_good_plan_overrides_are_parsed():
    from h3cute.bench.cli import _overrides

    assert _overrides(["sweep_pool=256", "accuracy_sizes=[1,64]", "full_batch=null", "graphs=false"]) == {
        "sweep_pool": 256, "accuracy_sizes": [1, 64], "full_batch": None, "graphs": False}


def _h3cute(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3cute", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(SRC)})


def test_python_m_h3cute_help_exits_0_and_a_bad_command_2():
    ok = _h3cute("--help")
    assert ok.returncode == 0 and "python -m h3cute ptx-digest" in ok.stdout and "build" in ok.stdout
    bad = _h3cute("nope")
    assert bad.returncode == 2 and bad.stderr.startswith("usage: python -m h3cute build")


def test_ptx_digest_names_the_valid_kernels_for_an_unknown_one(tmp_path):
    result = _h3cute("ptx-digest", "--arch", "sm_90a", "--out", tmp_path / "d.json", "--kernel", "nope")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("python -m h3cute ptx-digest: error: unknown kernel(s) ['nope']; known: [")
    assert "'timestep_sinusoid'" in last and "'norm_modulate_fwd'" in last


@pytest.mark.parametrize("against, what", [
    (None, "cannot be read as a digest file"),
    ("{not json", "cannot be read as a digest file"),
    ('["a"]', "not a digest file"),
    ('{"sm_90a k []": 7}', "not a digest file"),
])
def test_ptx_digest_refuses_a_bad_against_file_before_compiling(tmp_path, monkeypatch, capsys, against, what):
    from h3cute.runtime import ptx_digest

    monkeypatch.setattr(ptx_digest, "digests", lambda *a, **k: pytest.fail("compiled before checking --against"))
    path = tmp_path / "old.json"
    if against is not None:
        path.write_text(against)
    with pytest.raises(SystemExit) as exit_:
        ptx_digest.main(["--arch", "sm_90a", "--out", str(tmp_path / "new.json"), "--against", str(path)])
    assert exit_.value.code == 2
    assert f"error: --against {path}: {what}" in capsys.readouterr().err
    assert not (tmp_path / "new.json").exists()


def test_ptx_digest_refuses_an_out_in_a_missing_folder_before_compiling(tmp_path, monkeypatch, capsys):
    from h3cute.runtime import ptx_digest

    monkeypatch.setattr(ptx_digest, "digests", lambda *a, **k: pytest.fail("compiled before checking --out"))
    with pytest.raises(SystemExit):
        ptx_digest.main(["--arch", "sm_90a", "--out", str(tmp_path / "no" / "d.json")])
    assert f"error: --out {tmp_path / 'no' / 'd.json'}: folder" in capsys.readouterr().err


# ---- on the GPU: the same contracts through the CUDA impls (the C++ op layer where it is built) ----------------

def _to(a, device):
    if isinstance(a, list):
        return [_to(t, device) for t in a]
    return a.to(device) if isinstance(a, torch.Tensor) else a


def _cuda():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.parametrize("op", ALL_OPS)
def test_gpu_none_and_meta_are_refused_on_cuda(op):
    _fa4_or_skip(op)
    dev = _cuda()
    args = _to(valid_args(op), dev)
    getattr(ops, op)(*args)  # the valid call runs
    torch.cuda.synchronize()
    if one_tensor(op):
        return  # one tensor argument: None leaves nothing to dispatch on, meta alone is the meta call
    for i, name in tensor_args(op):
        bad = list(args)
        bad[i] = None
        with pytest.raises(TypeError, match=rf"^h3::{shown(op)}: {name} is None; the op takes a"):
            getattr(ops, op)(*bad)
        bad[i] = args[i].to("meta")
        want = rf"({name} is on meta, expected {dev}|[a-z_\[\]0-9]+ is on {dev}, expected meta)"
        with pytest.raises(ValueError, match=rf"^h3::{shown(op)}: {want} \(the device of the other inputs\)"):
            getattr(ops, op)(*bad)
    getattr(ops, op)(*args)  # and the device is fine afterwards
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("op, dtype", AUTOCAST_CASES, ids=[f"{op}-{str(d)[6:]}" for op, d in AUTOCAST_CASES])
def test_gpu_autocast_keeps_the_ops_dtypes_and_bits(op, dtype):
    _fa4_or_skip(op)
    args = _to(random_args(op), _cuda())
    want = _outs(getattr(ops, op)(*args))
    with torch.autocast("cuda", dtype=dtype):
        got = _outs(getattr(ops, op)(*args))
    assert [g.dtype for g in got] == [w.dtype for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("op", WITH_BF16)
def test_gpu_autocast_casts_fp32_into_bf16_arguments(op):
    _fa4_or_skip(op)
    args = _to(random_args(op), _cuda())
    widened = list(args)
    for i, _ in _bf16_args(op):
        widened[i] = [t.float() for t in args[i]] if isinstance(args[i], list) else args[i].float()
    want = _outs(getattr(ops, op)(*args))
    with torch.autocast("cuda", dtype=BF16):
        got = _outs(getattr(ops, op)(*widened))
    assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["timestep_mlp", "norm_modulate", "gate_residual", "final_adaln_out",
                                "adaln_row_gather", "adaln_projection"])
def test_gpu_backward_under_autocast_is_the_plain_backward(op):
    """FP32 leaves where the op takes BF16 (cast by the autocast kernel) get the BF16 call's gradients, widened;
    FP32 leaves stay FP32. The backward runs inside the autocast region."""
    args = _to(random_args(op), _cuda())
    floating = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def run(widen, autocast):
        leaves = list(args)
        for i in floating:
            leaves[i] = (args[i].float() if widen else args[i]).detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=BF16, enabled=autocast):
            outs = _outs(getattr(ops, op)(*leaves))
            g = torch.Generator(device=outs[0].device).manual_seed(3)
            torch.autograd.backward(outs, [torch.randn(o.shape, generator=g, device=o.device).to(o.dtype)
                                           for o in outs])
        return outs, [leaves[i].grad for i in floating], [leaves[i].dtype for i in floating]

    outs, grads, dtypes = run(True, True)
    ref_outs, ref_grads, _ = run(False, False)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref_outs))
    for g, r, d in zip(grads, ref_grads, dtypes):
        assert g.dtype == d and torch.equal(g, r.to(d))


@pytest.mark.gpu
def test_gpu_jvp_is_refused_by_the_python_autograd_kernels_on_cuda():
    """H3CUTE_NATIVE=0: the Python autograd kernels serve CUDA tensors too, and name the op."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from test_hardening import FORWARD_OPS, _split_floating, _to, valid_args
        failures = []
        for op in FORWARD_OPS[1:]:
            args = _to(valid_args(op), torch.device("cuda"))
            floating, call = _split_floating(args)
            primals = tuple(args[i] for i in floating)
            try:
                torch.func.jvp(lambda *p: call(op, *p), primals, tuple(torch.ones_like(p) for p in primals))
                failures.append(op + ": no error")
            except RuntimeError as e:
                if not str(e).startswith(f"h3::{{op}}: forward-mode AD"):
                    failures.append(op + ": " + str(e))
        print("FAILURES", failures)
    """)
    env = {**os.environ, "H3CUTE_NATIVE": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "FAILURES []" in result.stdout, result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("op", FORWARD_OPS[1:])
def test_gpu_jvp_raises_in_this_process(op):
    """Where the C++ op layer is built its autograd kernels serve; they refuse forward-mode AD with torch's C++
    custom-Function errors (which do not name the op), the Python kernels with h3's own."""
    args = _to(valid_args(op), _cuda())
    floating, call = _split_floating(args)
    primals = tuple(args[i] for i in floating)
    with pytest.raises(RuntimeError, match=rf"h3::{op}: forward-mode AD|C\+\+ torch::autograd::Function"
                                           r"|jvp is not implemented"):
        torch.func.jvp(lambda *p: call(op, *p), primals, tuple(torch.ones_like(p) for p in primals))
