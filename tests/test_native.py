"""The C++ op layer (h3cute.native): it builds against the installed torch, registers C++ CUDA impls, and on
the GPU gives the Python impl's bits, messages and stream behaviour."""
import importlib
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import h3cute
from h3cute import native, reference
from h3cute.launch import checks
from h3cute.ops import _library, adaln, timestep
from h3cute.ops import linear as linear_ops
from h3cute.widths import (BLOCK_CHUNKS, BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, FP32_HEADS, FREQ, HIDDEN,
                           MLP_HIDDEN, NORM_EPS, TEMB)

from bitwise import same_bits
from poison import poison_allocator

# The ops the C++ layer implements (their CUDA impls); every other op keeps its Python CUDA impl.
NATIVE_OPS = ("timestep_sinusoid", "timestep_mlp", "timestep_mlp_backward", "norm_modulate", "norm_modulate_backward",
              "gate_residual", "gate_residual_backward", "final_adaln_out", "final_adaln_out_fwd",
              "final_adaln_out_backward", "adaln_row_gather", "adaln_row_gather_backward",
              "gate_residual_norm_modulate", "adaln_projection", "adaln_projection_backward", "linear",
              "linear_backward")
# The ops whose autograd kernel is the C++ one.
NATIVE_AUTOGRAD_OPS = ("timestep_mlp", "norm_modulate", "gate_residual", "final_adaln_out", "adaln_row_gather",
                       "gate_residual_norm_modulate", "adaln_projection", "linear")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
no_compiler = shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None

_REGISTER_SCRIPT = """
import torch, h3cute
from h3cute import native
module = native.build()
constants = native.constants()
# install() refuses constants it cannot take, and registers nothing then
renamed = {("hidden_size" if k == "hidden" else k): v for k, v in constants.items()}
for bad in (renamed, dict(constants, extra=1)):
    try:
        module.install(bad)
        print("accepted")
    except RuntimeError as e:
        print("refused:", str(e).splitlines()[0])
native.install(module)
print(list(module.OPS), list(module.AUTOGRAD_OPS))
print(torch._C._dispatch_dump("h3::timestep_sinusoid"))
print(torch._C._dispatch_dump("h3::norm_modulate"))
"""

_REIMPORT_SCRIPT = """
import torch.utils.cpp_extension as ce
def refuse(*args, **kwargs):
    raise AssertionError("the extension builder ran although the library was built")
ce.load = refuse
from h3cute import native
print(list(native.build().OPS))
"""


@pytest.mark.slow
@pytest.mark.skipif(no_compiler, reason="no C++ compiler or ninja on this machine")
def test_builds_against_this_torch_and_registers_the_cuda_impl(tmp_path, monkeypatch):
    # A fresh process and cache: the build from source, then the C++ kernel is what CUDA dispatches to, once the
    # library has taken its constants (h3cute.native.constants: the widths and launch constants it declares nowhere).
    env = dict(os.environ, H3CUTE_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _REGISTER_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    *refusals, ops_line, dump = proc.stdout.split("\n", 3)
    assert "'hidden'" in refusals[0] and "constants lack" in refusals[0], refusals
    assert f"takes {len(native.constants())} constants, got {len(native.constants()) + 1}" in refusals[1], refusals
    assert ops_line == f"{list(NATIVE_OPS)} {list(NATIVE_AUTOGRAD_OPS)}"
    cuda = [line for line in dump.splitlines() if line.startswith("CUDA:")]
    assert len(cuda) == 2 and all("h3_native.cpp" in line for line in cuda), dump
    autograd = [line for line in dump.splitlines() if line.startswith("Autograd[alias]:")]
    assert autograd and all("h3_native.cpp" in line for line in autograd), dump
    assert any(p.name.startswith(native.MODULE_NAME) for p in tmp_path.glob("native/*/*.so"))
    # A later process imports the built library without the extension builder (no ninja run per import).
    proc = subprocess.run([sys.executable, "-c", _REIMPORT_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == str(list(NATIVE_OPS)) and "building" not in proc.stderr, proc.stderr
    # The launch plans of the ops on plans: the library decodes each to itself and walks it (on meta tensors,
    # launching nothing) with the Python walker's kernels, argument views and outputs.
    from test_launch_plans import assert_cpp_walks_the_plans

    library = next(tmp_path.glob(f"native/*/{native.MODULE_NAME}*.so"))
    assert_cpp_walks_the_plans(native._import_library(library), monkeypatch)


def test_python_impls_the_cpp_layer_hands_off_to_are_the_declared_cuda_impls():
    """Off its fast path each C++ CUDA impl calls `<module>.<name>` (h3_native.cpp's python_impl): every such name
    is bound to a declared op's Python CUDA impl, and the C++ ops all have one."""
    calls = re.findall(r'python_impl<.*?>\(\s*"([\w.]+)",\s*"(\w+)"', native.SOURCE.read_text())
    declared = _library.DECLARED
    by_impl = {id(op.cuda_impl): name for name, op in declared.items()}
    called = set()
    for module, name in calls:
        impl = getattr(importlib.import_module(module), name)
        assert id(impl) in by_impl, f"{module}.{name} is no declared op's cuda_impl"
        called.add(by_impl[id(impl)])
    # final_adaln_out's C++ impl hands off to final_adaln_out_fwd's and keeps its first output.
    assert called == set(NATIVE_OPS) - {"final_adaln_out"}
    assert set(NATIVE_OPS) <= set(declared)


def test_load_builds_where_cuda_is_visible_unless_disabled(monkeypatch):
    """load() with the build and the CUDA query stubbed: H3CUTE_NATIVE=0 never builds, unset or 1 builds where
    CUDA is visible, no CUDA never builds, a failing build leaves the Python impls (None)."""
    built = []

    def build(verbose=False):
        built.append(os.environ.get("H3CUTE_NATIVE"))
        return "the C++ module"

    monkeypatch.setattr(native, "build", build)
    for cuda, setting, want in ((True, "0", None), (True, "1", "the C++ module"), (True, None, "the C++ module"),
                                (False, "1", None)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(native, "_loaded", {})
        if setting is None:
            monkeypatch.delenv("H3CUTE_NATIVE", raising=False)
        else:
            monkeypatch.setenv("H3CUTE_NATIVE", setting)
        assert native.load() == want, (cuda, setting)
        assert native.load() == want  # decided once per process
    assert built == ["1", None]

    def broken(verbose=False):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(native, "build", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("H3CUTE_NATIVE", "1")
    assert native.load() is None and native.native_ops() == frozenset()


def test_build_folder_changes_with_the_source_torch_and_tvm_ffi(tmp_path, monkeypatch):
    """The library's folder is keyed by h3_native.cpp and the ABIs it binds: an edited source, another torch or
    another tvm-ffi each get their own folder (a stale library is never imported); the same inputs the same one."""
    import tvm_ffi

    from h3cute.runtime.cache import cache_dir

    base = native.build_dir()
    assert base.parent == cache_dir() / "native" and len(base.name) == 16 and int(base.name, 16) >= 0
    source = tmp_path / "h3_native.cpp"
    source.write_bytes(native.SOURCE.read_bytes())
    monkeypatch.setattr(native, "SOURCE", source)
    assert native.build_dir() == base
    folders = {base}
    source.write_bytes(source.read_bytes() + b"\n// one edit\n")
    folders.add(native.build_dir())
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    folders.add(native.build_dir())
    monkeypatch.setattr(tvm_ffi, "__version__", tvm_ffi.__version__ + ".other")
    folders.add(native.build_dir())
    assert len(folders) == 4


# ---- GPU: the C++ impl is the one that runs, with the Python impl's results ---------------------------

gpu = pytest.mark.gpu


_DISPATCH_SCRIPT = """
import torch, h3cute
from h3cute import native
cuda = [line for line in torch._C._dispatch_dump("h3::norm_modulate").splitlines() if line.startswith("CUDA:")]
print(native.load() is not None, len(cuda) == 1 and "h3_native.cpp" in cuda[0])
"""


@gpu
def test_environment_variable_switches_the_cuda_impls():
    """On the GPU machine the C++ layer serves the CUDA impls by default, and H3CUTE_NATIVE=0 leaves the Python
    impls registered (fresh processes: the choice is made at import)."""
    for setting, want in (("1", "True True"), ("0", "False False")):
        env = dict(os.environ, H3CUTE_NATIVE=setting)
        proc = subprocess.run([sys.executable, "-c", _DISPATCH_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == want, (setting, proc.stdout, proc.stderr)


def _dispatches_to_native(op: str, key: str = "CUDA") -> bool:
    lines = [line for line in torch._C._dispatch_dump(f"h3::{op}").splitlines() if line.startswith(key + ":")]
    return len(lines) == 1 and "h3_native.cpp" in lines[0]


@gpu
@pytest.mark.parametrize("op", NATIVE_OPS)
def test_dispatches_to_the_cpp_impl(op):
    assert native.load() is not None, "the C++ op layer did not build on the GPU machine (see the log)"
    assert _dispatches_to_native(op)
    assert _dispatches_to_native(op, "Autograd[alias]") == (op in NATIVE_AUTOGRAD_OPS)


def _seeded(shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)


@gpu
# every launch range (on sm_90a the weight GEMM's fc2 at T <= 16 and from 256)
@pytest.mark.parametrize("num_rows", [1, 4, 9, 17, 65, 255, 256, 300, 2048])
def test_timestep_mlp_cpp_equals_python_impl(num_rows):
    x = _seeded((num_rows, FREQ), 1)
    w1, b1 = _seeded((MLP_HIDDEN, FREQ), 2, scale=0.05), _seeded((MLP_HIDDEN,), 3, scale=0.05)
    w2, b2 = _seeded((TEMB, MLP_HIDDEN), 4, scale=0.02), _seeded((TEMB,), 5, scale=0.02)
    grad = _seeded((num_rows, TEMB), 6)
    assert same_bits(torch.ops.h3.timestep_mlp(x, w1, b1, w2, b2), timestep._mlp_cuda(x, w1, b1, w2, b2))
    assert same_bits(torch.ops.h3.timestep_mlp_backward(grad, x, w1, b1, w2),
                       timestep._mlp_backward_cuda(grad, x, w1, b1, w2))


def _norm_inputs(rows, table_rows=9):
    x = _seeded((rows, HIDDEN), 7, torch.bfloat16, 2.0)
    weight = (0.5 + torch.rand(HIDDEN, device="cuda")).to(torch.bfloat16)
    shift = _seeded((table_rows, HIDDEN), 8, torch.bfloat16)
    scale = _seeded((table_rows, HIDDEN), 9, torch.bfloat16)
    idx = torch.randint(0, table_rows, (rows,), device="cuda")
    return x, weight, shift, scale, idx


@gpu
@pytest.mark.parametrize("rows", [1, 7, 4097])
def test_norm_modulate_cpp_equals_python_impl(rows):
    # Both walk the op's launch plan (the C++ one decoded from Python's): the same bits into poisoned outputs.
    x, weight, shift, scale, idx = _norm_inputs(rows)
    for check in (False, True):  # both on the C++ fast path: the kernel checks the indices itself
        slow = adaln._norm_modulate_cuda(x, weight, shift, scale, idx, NORM_EPS, check)
        poison_allocator()
        assert _finite([slow]) and same_bits(torch.ops.h3.norm_modulate(x, weight, shift, scale, idx, NORM_EPS, check),
                                             slow)
    # row-strided tables read in place, and tables the kernel cannot read in place (copied by Python)
    wide = _seeded((9, 2 * HIDDEN), 10, torch.bfloat16)
    odd = _seeded((9, HIDDEN + 4), 11, torch.bfloat16)
    for sh, sc in ((wide[:, :HIDDEN], wide[:, HIDDEN:]), (odd[:, :HIDDEN], odd[:, 4:])):
        assert same_bits(torch.ops.h3.norm_modulate(x, weight, sh, sc, idx, NORM_EPS, False),
                           reference.norm_modulate_replay(x, weight, sh, sc, idx, NORM_EPS))


@gpu
def test_norm_modulate_cpp_keeps_the_python_messages():
    x, weight, shift, scale, idx = _norm_inputs(5)
    with pytest.raises(ValueError, match="eps must be > 0"):
        torch.ops.h3.norm_modulate(x, weight, shift, scale, idx, 0.0, False)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        torch.ops.h3.norm_modulate(x.float(), weight, shift, scale, idx, NORM_EPS, False)
    bad = idx.clone()
    bad[3] = 9
    torch.ops.h3.norm_modulate(x, weight, shift, scale, bad)  # recorded on the device, raised after
    with pytest.raises(IndexError, match=r"h3::norm_modulate: adaln_indices\[3\] is outside \[0, 9\)"):
        h3cute.check_errors()
    assert torch.ops.h3.norm_modulate(x[:0], weight, shift, scale, idx[:0], NORM_EPS, False).shape == (0, HIDDEN)


@gpu
@pytest.mark.parametrize("timesteps", [1, 3, 20, 70])  # every projection-config range
def test_final_adaln_out_cpp_equals_python_impl(timesteps):
    rows = 1031
    x = _seeded((rows, HIDDEN), 12, torch.bfloat16, 2.0)
    nw = (0.5 + torch.rand(HIDDEN, device="cuda")).to(torch.bfloat16)
    temb = _seeded((timesteps, TEMB), 13)
    pw = _seeded((FINAL_PROJECTION, TEMB), 14, torch.bfloat16, 0.02)
    pb = _seeded((FINAL_PROJECTION,), 15, torch.bfloat16, 0.02)
    ti = torch.randint(0, timesteps, (rows,), device="cuda")
    for check in (False, True):  # both walk the projection's plan, then the norm rows': the same bits, poisoned outputs
        slow = adaln._final_fwd_cuda(x, nw, temb, pw, pb, ti, 1e-6, check)
        poison_allocator()
        assert _finite(slow) and same_bits(torch.ops.h3.final_adaln_out_fwd(x, nw, temb, pw, pb, ti, 1e-6, check), slow)
        poison_allocator()
        assert same_bits(torch.ops.h3.final_adaln_out(x, nw, temb, pw, pb, ti, 1e-6, check), slow[0])
        assert same_bits(slow[0], adaln.FINAL.cuda_impl(x, nw, temb, pw, pb, ti, 1e-6, check))
    assert _dispatches_to_native("final_adaln_out_fwd") and _dispatches_to_native("final_adaln_out")


@gpu
@pytest.mark.parametrize("num_rows", [1, 3, 1000, 65537])
def test_sinusoid_cpp_equals_python_impl(num_rows):
    t = torch.rand(num_rows, device="cuda", generator=torch.Generator("cuda").manual_seed(num_rows))
    for check_range in (True, False):
        fast = torch.ops.h3.timestep_sinusoid(t, check_range)
        slow = timestep._sinusoid_cuda(t, check_range)
        assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))
        assert torch.equal(fast.view(torch.int32), reference.timestep_sinusoid_replay(t).view(torch.int32))


@gpu
def test_sinusoid_cpp_hands_other_inputs_to_python():
    t = torch.rand(17, device="cuda")
    # widened exactly, as diffusers does
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = t.to(dtype)
        assert torch.equal(torch.ops.h3.timestep_sinusoid(x), reference.timestep_sinusoid_replay(x))
    # the Python impl's messages
    with pytest.raises(ValueError, match="t must be 1-D"):
        torch.ops.h3.timestep_sinusoid(t.view(1, 17))
    with pytest.raises(ValueError, match="t must be contiguous"):
        torch.ops.h3.timestep_sinusoid(torch.rand(34, device="cuda")[::2])
    with pytest.raises(TypeError, match="floating tensor"):
        torch.ops.h3.timestep_sinusoid(torch.ones(3, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match="has no backward"):
        torch.ops.h3.timestep_sinusoid(t.clone().requires_grad_(True))
    with torch.no_grad():
        torch.ops.h3.timestep_sinusoid(t.clone().requires_grad_(True))
    assert torch.ops.h3.timestep_sinusoid(t[:0]).shape == (0, FREQ)


@gpu
def test_sinusoid_cpp_under_a_cuda_graph():
    t = torch.rand(64, device="cuda")
    torch.ops.h3.timestep_sinusoid(t)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            out = torch.ops.h3.timestep_sinusoid(t)
    t.copy_(torch.rand(64, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, reference.timestep_sinusoid_replay(t))


@gpu
@pytest.mark.parametrize("table_rows", [9, 24, 30])  # fused caps 12 and 24 in C++; 30 is the Python impl's
def test_norm_modulate_backward_cpp_equals_python_impl(table_rows):
    x, weight, _, scale, idx = _norm_inputs(4097, table_rows)
    grad = _seeded((4097, HIDDEN), 16, torch.bfloat16)
    wide = _seeded((table_rows, 2 * HIDDEN), 17, torch.bfloat16)
    for table in (scale, wide[:, HIDDEN:]):  # compact, and a row-strided half read in place
        args = (grad, x, weight, table, idx, NORM_EPS, table_rows)
        slow = adaln._norm_modulate_backward_cuda(*args)
        poison_allocator()
        assert _finite(slow) and same_bits(torch.ops.h3.norm_modulate_backward(*args), slow)
        assert same_bits(torch.ops.h3.norm_modulate_backward(*args), slow)  # the plan table's cached plan


@gpu
@pytest.mark.parametrize("table_rows", [3, 9, 48])
@pytest.mark.parametrize("rows", [1, 4097])
def test_gate_residual_cpp_equals_python_impl(table_rows, rows):
    # Both walk the op's launch plans (the C++ one decoded from Python's): the same bits into poisoned outputs,
    # with a compact gate table and a row-strided half of a wider one read in place.
    residual, y = _seeded((rows, HIDDEN), 17, torch.bfloat16), _seeded((rows, HIDDEN), 18, torch.bfloat16)
    wide = _seeded((table_rows, 2 * HIDDEN), 19, torch.bfloat16)
    idx = torch.randint(0, table_rows, (rows,), device="cuda")
    grad = _seeded((rows, HIDDEN), 20, torch.bfloat16)
    for gate in (wide[:, :HIDDEN].contiguous(), wide[:, HIDDEN:]):
        for check in (False, True):
            slow = adaln._gate_residual_cuda(residual, y, gate, idx, check)
            poison_allocator()
            assert _finite([slow]) and same_bits(torch.ops.h3.gate_residual(residual, y, gate, idx, check), slow)
        slow = adaln._gate_residual_backward_cuda(grad, y, gate, idx)
        poison_allocator()
        assert _finite(slow) and same_bits(torch.ops.h3.gate_residual_backward(grad, y, gate, idx), slow)
        # a second call takes the plan table's cached plan
        assert same_bits(torch.ops.h3.gate_residual_backward(grad, y, gate, idx), slow)
    assert _dispatches_to_native("gate_residual") and _dispatches_to_native("gate_residual_backward")


@gpu
@pytest.mark.parametrize("table_rows", [9, 30])
def test_gate_residual_norm_modulate_cpp_equals_python_impl_and_autograd(table_rows):
    rows = 1031
    residual, y = _seeded((rows, HIDDEN), 21, torch.bfloat16), _seeded((rows, HIDDEN), 22, torch.bfloat16)
    x, weight, shift, scale, idx = _norm_inputs(rows, table_rows)
    gate = _seeded((table_rows, HIDDEN), 23, torch.bfloat16)
    args = (residual, y, gate, weight, shift, scale, idx)
    for check in (False, True):  # both walk the forward's launch plan: the same bits into poisoned outputs
        slow = adaln._fused_cuda(*args, NORM_EPS, check)
        poison_allocator()
        assert _finite(slow) and same_bits(torch.ops.h3.gate_residual_norm_modulate(*args, NORM_EPS, check), slow)
    # the C++ autograd kernel: both outputs used, only out, only h (no norm backward), as the Python kernel does
    grad_h, grad_out = _seeded((rows, HIDDEN), 24, torch.bfloat16), _seeded((rows, HIDDEN), 25, torch.bfloat16)
    for used in ((0, 1), (1,), (0,)):
        leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
        outs = torch.ops.h3.gate_residual_norm_modulate(*leaves)
        torch.autograd.backward([outs[i] for i in used], [(grad_h, grad_out)[i] for i in used])
        want = adaln._fused_backward_cuda(grad_h if 0 in used else None, grad_out, y, gate, outs[0].detach(), weight,
                                          scale, idx, NORM_EPS, table_rows)
        if 1 not in used:
            want = (grad_h, *torch.ops.h3.gate_residual_backward(grad_h, y, gate, idx), None, None, None)
        for got, ref in zip([a.grad for a in leaves[:6]], want):
            assert (got is None) == (ref is None) and (ref is None or same_bits(got, ref)), used


def _autograd_grads(op, args, grad):
    """Gradients of every floating argument through the op's autograd kernel."""
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
              for a in args]
    out = getattr(torch.ops.h3, op)(*leaves)
    torch.autograd.backward(out, grad)
    return out.detach(), [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.is_floating_point()]


@gpu
def test_cpp_autograd_gives_the_backward_ops_gradients():
    rows = 1031
    x, weight, shift, scale, idx = _norm_inputs(rows)
    g = _seeded((rows, HIDDEN), 21, torch.bfloat16)
    out, grads = _autograd_grads("norm_modulate", (x, weight, shift, scale, idx, NORM_EPS, False), g)
    assert same_bits(out, adaln._norm_modulate_cuda(x, weight, shift, scale, idx, NORM_EPS, False))
    assert same_bits(grads, adaln._norm_modulate_backward_cuda(g, x, weight, scale, idx, NORM_EPS, 9))

    y = _seeded((rows, HIDDEN), 22, torch.bfloat16)
    out, grads = _autograd_grads("gate_residual", (x, y, shift, idx, False), g)
    assert same_bits(out, adaln._gate_residual_cuda(x, y, shift, idx, False))
    assert same_bits(grads, (g, *adaln._gate_residual_backward_cuda(g, y, shift, idx)))

    temb, ti = _seeded((3, TEMB), 23), torch.randint(0, 3, (rows,), device="cuda")
    pw = _seeded((FINAL_PROJECTION, TEMB), 24, torch.bfloat16, 0.02)
    pb = _seeded((FINAL_PROJECTION,), 25, torch.bfloat16, 0.02)
    out, grads = _autograd_grads("final_adaln_out", (x, weight, temb, pw, pb, ti, 1e-6, False), g)
    assert same_bits(out, adaln.FINAL.cuda_impl(x, weight, temb, pw, pb, ti, 1e-6, False))
    assert same_bits(grads, adaln._final_backward_cuda(g, x, weight, temb, pw, pb, ti, 1e-6))

    xm = _seeded((5, FREQ), 26)
    w1, b1 = _seeded((MLP_HIDDEN, FREQ), 27, scale=0.05), _seeded((MLP_HIDDEN,), 28, scale=0.05)
    w2, b2 = _seeded((TEMB, MLP_HIDDEN), 29, scale=0.02), _seeded((TEMB,), 30, scale=0.02)
    gm = _seeded((5, TEMB), 31)
    out, grads = _autograd_grads("timestep_mlp", (xm, w1, b1, w2, b2), gm)
    assert same_bits(out, timestep._mlp_cuda(xm, w1, b1, w2, b2))
    assert same_bits(grads, timestep._mlp_backward_cuda(gm, xm, w1, b1, w2))


@gpu
@pytest.mark.parametrize("timesteps", [1, 12, 13, 20, 24, 30])  # C++ up to 24 (fused caps), 30: the Python impl
def test_final_adaln_out_backward_cpp_equals_python_impl(timesteps):
    rows = 2053
    x, g = _seeded((rows, HIDDEN), 32, torch.bfloat16, 2.0), _seeded((rows, HIDDEN), 33, torch.bfloat16)
    nw = (0.5 + torch.rand(HIDDEN, device="cuda")).to(torch.bfloat16)
    temb = _seeded((timesteps, TEMB), 34)
    pw = _seeded((FINAL_PROJECTION, TEMB), 35, torch.bfloat16, 0.02)
    pb = _seeded((FINAL_PROJECTION,), 36, torch.bfloat16, 0.02)
    ti = torch.randint(0, timesteps, (rows,), device="cuda")
    args = (g, x, nw, temb, pw, pb, ti, 1e-6)
    slow = adaln._final_backward_cuda(*args)
    poison_allocator()
    recomputed = torch.ops.h3.final_adaln_out_backward(*args)
    assert _finite(slow) and same_bits(recomputed, slow)
    # with the forward's projection (the autograd path): the same bits, C++ and Python
    out, table = torch.ops.h3.final_adaln_out_fwd(x, nw, temb, pw, pb, ti, 1e-6, False)
    assert same_bits((out, table), adaln._final_fwd_cuda(x, nw, temb, pw, pb, ti, 1e-6, False))
    poison_allocator()
    assert same_bits(torch.ops.h3.final_adaln_out_backward(*args, table), recomputed)
    assert same_bits(adaln._final_backward_cuda(*args, table), recomputed)


@gpu
@pytest.mark.parametrize("table_rows", [3, 30])
def test_adaln_row_gather_cpp_equals_python_impl(table_rows):
    rows = 4097
    table = _seeded((table_rows, BLOCK_TABLE), 37, torch.bfloat16)
    idx = torch.randint(0, table_rows, (rows,), device="cuda")
    grads = [_seeded((rows, HIDDEN), 38 + c, torch.bfloat16) for c in range(BLOCK_CHUNKS)]
    for check in (False, True):  # both walk the op's launch plans: the same bits into poisoned outputs
        slow = adaln._gather_cuda(table, idx, check)
        poison_allocator()
        assert _finite(slow) and same_bits(torch.ops.h3.adaln_row_gather(table, idx, check), slow)
    assert same_bits(torch.ops.h3.adaln_row_gather(table, idx, False),
                       reference.adaln_row_gather_replay(table, idx))
    slow = adaln._gather_backward_cuda(grads, idx, table_rows)
    poison_allocator()
    assert _finite([slow]) and same_bits(torch.ops.h3.adaln_row_gather_backward(grads, idx, table_rows), slow)
    leaf = table.detach().clone().requires_grad_(True)
    torch.autograd.backward(torch.ops.h3.adaln_row_gather(leaf, idx, False), grads)
    assert same_bits(leaf.grad, adaln._gather_backward_cuda(grads, idx, table_rows))


@pytest.fixture(scope="module")
def block_projection():
    """The (96768, 2688) BF16 weight (520 MB) and bias, drawn once for the module."""
    weight = _seeded((BLOCK_PROJECTION, TEMB), 50, torch.bfloat16, 0.02)
    return weight, _seeded((BLOCK_PROJECTION,), 51, torch.bfloat16, 0.02)


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@gpu
@pytest.mark.parametrize("timesteps", [1, 3, 4, 17, 64, 65, 129, 193, 256, 300, 385, 769])  # every T_BOUNDS range
def test_adaln_projection_cpp_equals_python_impl(block_projection, timesteps):
    weight, bias = block_projection
    temb = _seeded((timesteps, TEMB), 52 + timesteps)
    grad = _seeded((timesteps, BLOCK_PROJECTION), 53 + timesteps, torch.bfloat16)
    slow = adaln._projection_cuda(temb, weight, bias)
    slow_grads = adaln._projection_backward_cuda(grad, temb, weight)
    assert _finite([slow, *slow_grads])
    poison_allocator()
    fast = torch.ops.h3.adaln_projection(temb, weight, bias)
    poison_allocator()
    fast_grads = torch.ops.h3.adaln_projection_backward(grad, temb, weight)
    assert same_bits(fast, slow) and same_bits(fast_grads, slow_grads)
    assert _dispatches_to_native("adaln_projection") and _dispatches_to_native("adaln_projection_backward")
    # a second call takes the kernel table's cached entry
    assert same_bits(torch.ops.h3.adaln_projection(temb, weight, bias), slow)


@gpu
# dW tiles writing db below and beyond 64, and (on sm_90a beyond 384; the warp family beyond 64) adaln_bias_grad
@pytest.mark.parametrize("timesteps", [5, 65, 400])
def test_adaln_projection_cpp_autograd_gives_the_python_grads(block_projection, timesteps):
    weight, bias = block_projection
    temb = _seeded((timesteps, TEMB), 60 + timesteps)
    g = _seeded((timesteps, BLOCK_PROJECTION), 61 + timesteps, torch.bfloat16)
    out, grads = _autograd_grads("adaln_projection", (temb, weight, bias), g)
    assert same_bits(out, adaln._projection_cuda(temb, weight, bias))
    assert same_bits(grads, adaln._projection_backward_cuda(g, temb, weight))
    # a column-major upstream gradient is made dense before the backward op, as the Python autograd does
    gt = g.t().contiguous().t()
    out, grads_t = _autograd_grads("adaln_projection", (temb, weight, bias), gt)
    assert same_bits(grads_t, grads)
    with torch.no_grad():
        assert same_bits(torch.ops.h3.adaln_projection(temb.requires_grad_(True), weight, bias), out)


@gpu
def test_adaln_projection_cpp_keeps_the_python_messages(block_projection):
    weight, bias = block_projection
    temb = _seeded((3, TEMB), 70)
    grad = _seeded((3, BLOCK_PROJECTION), 71, torch.bfloat16)
    with pytest.raises(TypeError, match="h3::adaln_projection: temb must be float32, got bfloat16 .known defect"):
        torch.ops.h3.adaln_projection(temb.bfloat16(), weight, bias)
    with pytest.raises(ValueError, match=rf"temb must have shape \(T, {TEMB}\), got \(3, {TEMB - 1}\)"):
        torch.ops.h3.adaln_projection(temb[:, :TEMB - 1].contiguous(), weight, bias)
    final_rows = rf"\({BLOCK_PROJECTION}, {TEMB}\), got \({FINAL_PROJECTION}, {TEMB}\)"
    with pytest.raises(ValueError, match=rf"weight must have shape {final_rows}"):
        torch.ops.h3.adaln_projection(temb, weight[:FINAL_PROJECTION], bias)
    with pytest.raises(ValueError, match=rf"bias must have shape \({BLOCK_PROJECTION},\)"):
        torch.ops.h3.adaln_projection(temb, weight, bias[:FINAL_PROJECTION])
    with pytest.raises(ValueError, match="temb must be contiguous"):
        torch.ops.h3.adaln_projection(_seeded((3, 2 * TEMB), 72)[:, ::2], weight, bias)
    with pytest.raises(ValueError, match="bias is on cpu"):
        torch.ops.h3.adaln_projection(temb, weight, bias.cpu())
    with pytest.raises(TypeError, match="adaln_projection_backward: grad must be bfloat16, got float32"):
        torch.ops.h3.adaln_projection_backward(grad.float(), temb, weight)
    with pytest.raises(ValueError, match="adaln_projection_backward: grad has 2 rows, temb has 3"):
        torch.ops.h3.adaln_projection_backward(grad[:2], temb, weight)
    with pytest.raises(ValueError, match=rf"adaln_projection_backward: grad must have shape \(T, {BLOCK_PROJECTION}\)"):
        torch.ops.h3.adaln_projection_backward(grad[:, :FINAL_PROJECTION].contiguous(), temb, weight)
    # T = 0 is the Python impl's (a zero-sized grid is not a launch)
    assert torch.ops.h3.adaln_projection(temb[:0], weight, bias).shape == (0, BLOCK_PROJECTION)
    dtemb, dweight, dbias = torch.ops.h3.adaln_projection_backward(grad[:0], temb[:0], weight)
    assert dtemb.shape == (0, TEMB) and not dweight.any() and not dbias.any()


def _linear_inputs(head, rows, seed):
    n, k = FP32_HEADS[head]
    x = _seeded((rows, k), seed)
    weight, bias = _seeded((n, k), seed + 1, scale=k ** -0.5), _seeded((n,), seed + 2, scale=0.1)
    return x, weight, bias, _seeded((rows, n), seed + 3)


@gpu
@pytest.mark.parametrize("head", list(FP32_HEADS))
# one row, below / at / past the weight gradient's first chunk step (the k-tail GEMM alone, bulk only, both), a
# long call
@pytest.mark.parametrize("rows", [1, 255, 256, 257, 4097])
def test_linear_cpp_equals_python_impl(head, rows):
    x, weight, bias, grad = _linear_inputs(head, rows, 80 + rows)
    for b in (bias, None):
        slow = linear_ops._linear_cuda(x, weight, b)
        poison_allocator()
        assert _finite([slow]) and same_bits(torch.ops.h3.linear(x, weight, b), slow), (head, rows, b is None)
    for x_grad in (True, False):
        slow = linear_ops._linear_backward_cuda(grad, x, weight, x_grad)
        assert _finite(slow)
        poison_allocator()
        fast = torch.ops.h3.linear_backward(grad, x, weight, x_grad)
        assert same_bits(fast, slow) and fast[0].shape == slow[0].shape, (head, rows, x_grad)
    # leading dims: (2, rows, K) rows of x, the gradient of the same shape
    x3, g3 = torch.cat([x, x]).view(2, rows, -1), torch.cat([grad, grad]).view(2, rows, -1)
    assert same_bits(torch.ops.h3.linear_backward(g3, x3, weight), linear_ops._linear_backward_cuda(g3, x3, weight))
    assert _dispatches_to_native("linear") and _dispatches_to_native("linear_backward")


@gpu
@pytest.mark.parametrize("head", list(FP32_HEADS))
def test_linear_cpp_autograd_gives_the_python_grads(head):
    x, weight, bias, grad = _linear_inputs(head, 1031, 90)
    out, grads = _autograd_grads("linear", (x, weight, bias), grad)
    assert same_bits(out, linear_ops._linear_cuda(x, weight, bias))
    assert same_bits(grads, linear_ops._linear_backward_cuda(grad, x, weight))
    # no bias, frozen x: the backward skips dx and returns no bias gradient
    w = weight.detach().clone().requires_grad_(True)
    torch.autograd.backward(torch.ops.h3.linear(x, w), grad)
    assert same_bits(w.grad, linear_ops._linear_backward_cuda(grad, x, weight, False)[1])


@gpu
def test_linear_cpp_keeps_the_python_messages_and_strided_inputs():
    x, weight, bias, grad = _linear_inputs("proj_out", 5, 95)
    with pytest.raises(TypeError, match="h3::linear: x must be float32, got bfloat16"):
        torch.ops.h3.linear(x.bfloat16(), weight, bias)
    with pytest.raises(ValueError, match="h3::linear: weight has shape"):
        torch.ops.h3.linear(x[:, :64].contiguous(), weight[:, :64].contiguous(), bias)
    with pytest.raises(ValueError, match="h3::linear_backward: grad has leading shape"):
        torch.ops.h3.linear_backward(grad[:4], x, weight)
    # a column-strided x is off the C++ fast path: the Python impl copies its rows, same bits
    xs = torch.cat([x, x], 1)[:, ::2]
    assert not xs.is_contiguous() and same_bits(torch.ops.h3.linear(xs, weight, bias),
                                                torch.ops.h3.linear(xs.contiguous(), weight, bias))
    assert torch.ops.h3.linear(x[:0], weight, bias).shape == (0, weight.shape[0])  # no rows: the Python impl


# ---- CPU: the row ranges the C++ plan tables cache by ----------------------------------------------------
# A plan (lo, hi, ...) is reused for every row count in [lo, hi]: each launch choice the Python launcher would make
# must be the same across that whole range.

def test_mlp_row_ranges_hold_one_config():
    from h3cute.launch import timestep_mlp as L

    for rows in range(1, 3000):
        lo, hi, config = L._bucket(rows)
        assert lo <= rows <= hi and config == L.pick_config(rows)
        assert L.pick_config(max(lo, 1)) == config == L.pick_config(min(hi, 4096))


class _FakeKernel:
    """Stands in for a compiled kernel: its C handle encodes what was asked of the runtime."""

    asked: list = []

    def __init__(self, name, static):
        self.key = (name, tuple(sorted(static.items())))

    def __chandle__(self):
        _FakeKernel.asked.append(self.key)
        return len(_FakeKernel.asked)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_final_adaln_out_plans_ask_for_the_python_launchers_kernels(monkeypatch, arch):
    # The plan parts the C++ impls fetch (final_adaln_out.native_plan): which kernels, in launch order, over which
    # row range; the norm rows record bad indices in the op's own check slot.
    from h3cute import runtime
    from h3cute.launch import adaln_projection, final_adaln_out as F
    from h3cute.launch import plan as P

    monkeypatch.setattr(runtime, "kernel", lambda name, device, **static: _FakeKernel(name, static))
    monkeypatch.setattr(runtime, "arch_of", lambda device: arch)
    monkeypatch.setattr(runtime, "sm_count", lambda device: adaln_projection.H200_SMS)
    monkeypatch.setattr(P, "_cache", {})
    slots = {}  # check slot addresses as (op, argument, checked) stand-ins: no CUDA memory on a CPU machine
    monkeypatch.setattr(checks, "slot_addresses", lambda device, op, arg, checked=True:
                        slots.setdefault((op, arg, checked), (len(slots) + 1,) * 2))

    def asked(phase, key, rows):
        _FakeKernel.asked = []
        lo, hi, _, handles, _, steps, _ = F.native_plan(0, phase, key, rows)
        assert handles == tuple(range(1, len(handles) + 1))
        return (lo, hi), [_FakeKernel.asked[s[1]][0] for s in steps if s[0] == 0], steps

    proj = "adaln_proj_fwd_wgmma" if arch == "sm_90a" and adaln_projection.SM90_FAMILY == "wgmma" else "adaln_proj_fwd"
    assert asked("forward", (F.PROJECTION,), 3)[:2] == ((1, 16), ["adaln_silu_cast", proj])
    assert asked("forward", (F.PROJECTION,), 17)[0] == (17, 64)
    for check in (1, 0):
        span, names, steps = asked("forward", (F.ROWS, check), 1031)
        assert (span, names) == ((1, runtime.MAX_ROWS), ["norm_modulate_fwd"])
        slot = checks.slot_addresses(0, "final_adaln_out", "timestep_indices", bool(check))
        assert steps[0][4][-2:] == tuple((0, a) for a in slot)
    assert asked("backward", (F.ROWS, 3), 1031)[1] == ["norm_modulate_bwd_fused", "rowwise_fold"]
    assert asked("backward", (F.ROWS, 30), 7)[1] == ["norm_modulate_bwd_rows", "norm_modulate_bwd_params",
                                                      "rowwise_fold"]
    assert asked("backward", (F.PROJECTION,), 3)[1] == [proj.replace("fwd", "dgrad"), "adaln_dtemb_fold",
                                                         proj.replace("fwd", "wgrad")]
    with pytest.raises(ValueError, match="no plan part"):
        F.native_plan(0, "forward", (F.ROWS,), 3)


def test_final_adaln_out_plan_parts_are_the_python_ones():
    # h3_native.cpp names final_adaln_out's plan parts by the ints of launch/final_adaln_out.py
    from h3cute.launch import final_adaln_out as F

    source = native.SOURCE.read_text()
    assert f"constexpr int64_t kFinalProjection = {F.PROJECTION}, kFinalRows = {F.ROWS};" in source


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("n", [BLOCK_PROJECTION, FINAL_PROJECTION])  # adaln_projection's, final_adaln_out's
def test_adaln_projection_plans_hold_one_launch_sequence_per_row_range(monkeypatch, arch, n):
    # For every T, the plan the C++ table caches for T's range (built at T) is the one the launcher builds at both
    # ends of that range; the backward's tail: adaln_bias_grad where dW does not write db, the fold-warp dW where
    # wgrad_folds.
    from h3cute import runtime
    from h3cute.launch import adaln_projection as L
    from h3cute.launch.plan import Phase

    monkeypatch.setattr(runtime, "arch_of", lambda device: arch)
    monkeypatch.setattr(runtime, "sm_count", lambda device: L.H200_SMS)
    top = 5000
    assert L.T_BOUNDS[-1] == runtime.MAX_ROWS and list(L.T_BOUNDS) == sorted(L.T_BOUNDS)
    keys = {Phase.FORWARD: L.ForwardKey(n), Phase.BACKWARD: L.BackwardKey(n)}
    for phase, key in keys.items():
        for rows in [*range(1, 520), 768, 769, 1000, 2048, 4096]:
            plan = L.build(phase, 0, key, rows)
            assert plan.lo <= rows <= plan.hi
            for t in (max(plan.lo, 1), min(plan.hi, top)):
                assert L.build(phase, 0, key, t) == plan, (phase, rows, t)
            if phase is Phase.BACKWARD:
                wgmma = arch == "sm_90a" and L.SM90_FAMILY == "wgmma"
                wgrad = L.wgrad_config_for_rows(rows, wgmma)
                last = plan.steps[-1].kernel.name
                assert (last == "adaln_proj_wgrad_fold") == L.wgrad_folds(wgrad, wgmma)
                assert (last == "adaln_bias_grad") == (not L.wgrad_folds(wgrad, wgmma) and
                                                       not L.wgrad_writes_dbias(wgrad, rows))
