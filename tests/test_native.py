"""The C++ op layer (h3cute.native): it builds against the installed torch, registers C++ CUDA impls, and on
the GPU gives the Python impl's bits, messages and stream behaviour."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import h3cute  # noqa: F401
from h3cute import native, reference
from h3cute.ops import timestep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
no_compiler = shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None

_REGISTER_SCRIPT = """
import torch, h3cute
from h3cute import native
module = native.build()
module.install()
print(list(module.OPS))
print(torch._C._dispatch_dump("h3::timestep_sinusoid"))
"""


@pytest.mark.slow
@pytest.mark.skipif(no_compiler, reason="no C++ compiler or ninja on this machine")
def test_builds_against_this_torch_and_registers_the_cuda_impl(tmp_path):
    # A fresh process and cache: the build from source, then the C++ kernel is what CUDA dispatches to.
    env = dict(os.environ, H3CUTE_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _REGISTER_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ops_line, dump = proc.stdout.split("\n", 1)
    assert ops_line == "['timestep_sinusoid']"
    cuda = [line for line in dump.splitlines() if line.startswith("CUDA:")]
    assert len(cuda) == 1 and "h3_native.cpp" in cuda[0], dump
    assert any(p.name.startswith(native.MODULE_NAME) for p in tmp_path.glob("native/*/*.so"))


def test_disabled_by_environment():
    code = "from h3cute import native; import sys; sys.exit(native.load() is not None)"
    env = dict(os.environ, H3CUTE_NATIVE="0")
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_build_folder_tracks_the_source_and_torch():
    folder = native.build_dir()
    assert folder.parent.name == "native" and len(folder.name) == 16


# ---- GPU: the C++ impl is the one that runs, with the Python impl's results ---------------------------

gpu = pytest.mark.gpu


def _dispatches_to_native(op: str) -> bool:
    cuda = [line for line in torch._C._dispatch_dump(f"h3::{op}").splitlines() if line.startswith("CUDA:")]
    return bool(cuda) and "h3_native.cpp" in cuda[0]


@gpu
def test_sinusoid_dispatches_to_the_cpp_impl():
    assert native.load() is not None, "the C++ op layer did not build on the GPU machine (see the log)"
    assert _dispatches_to_native("timestep_sinusoid")


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
    assert torch.ops.h3.timestep_sinusoid(t[:0]).shape == (0, 256)


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
