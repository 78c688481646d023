"""Checks that cost no sync and never kill the process (h3cute/launch/checks.py): on CUDA a bad index or timestep
writes NaN rows, is recorded in a check slot by the kernel itself, and is raised as a Python exception naming the
op, the argument and the first bad row at the next h3 call or h3cute.check_errors(); the CUDA context stays usable,
graph capture keeps working, and no checked call syncs the host. CPU: the slot table's contracts.
"""
import pathlib

import pytest
import torch

import h3cute
from h3cute import reference
from h3cute.launch import checks
from h3cute.widths import BLOCK_TABLE, FINAL_PROJECTION, MODALITIES, NORM_EPS, TEMB

BF16 = torch.bfloat16


# ---- CPU -----------------------------------------------------------------------------------------------

def test_every_checking_launcher_names_a_slot():
    """Each (op, argument) a launcher passes to slot_addresses is in SLOTS (a typo would KeyError at run time)."""
    import re

    src = pathlib.Path(checks.__file__).parent
    named = set()
    for path in src.glob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r'slot_addresses\([^,]+, (?:OP|KERNEL|op), "(\w+)"', text))
    assert named and named <= {arg for _, arg, _ in checks.SLOTS}
    assert len(checks.SLOT) == len(checks.SLOTS) == checks.DISCARD  # (op, argument) pairs are unique


def test_kernels_write_the_host_words_the_host_reads():
    """kernels/rowwise.record_bad_row stores row + 1 at the slot's first host word and the bound at the next: the
    layout checks.py reads (HOST_WORDS int64 per slot) and the C++ layer scans (words[2 s])."""
    import inspect

    from h3cute.runtime.sources import kernels_package

    kernels_package()
    from h3cute.kernels import rowwise

    asm = inspect.getsource(rowwise.record_bad_row)
    assert "st.volatile.global.s64 [$1], next" in asm and "[$1+8], $3" in asm and checks.HOST_WORDS == 2
    native = pathlib.Path(h3cute.__file__).parent / "native" / "h3_native.cpp"
    assert "words[2 * s]" in native.read_text()


# ---- GPU -----------------------------------------------------------------------------------------------

def _norm_inputs(rows=257, seed=0):
    return [t.cuda() for t in reference.example_inputs("norm_modulate", rows, num_timesteps=3, seed=seed)]


def _alive():
    """The context is usable: a following h3 op runs and gives the replay's bits."""
    x, w, shift, scale, idx = _norm_inputs(33, seed=99)
    out = torch.ops.h3.norm_modulate(x, w, shift, scale, idx)
    assert torch.equal(out, reference.norm_modulate_replay(x, w, shift, scale, idx))


@pytest.fixture(autouse=True)
def _no_pending():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        try:
            checks.raise_pending()
        except (IndexError, ValueError):
            pass
    yield


def _bad_calls():
    """(op name, argument, a checked call with bad rows 17 and 5) for every op that checks values on CUDA."""
    x, w, shift, scale, idx = _norm_inputs()
    bad = idx.clone()
    bad[17], bad[5] = 9, -2
    y = torch.randn_like(x)
    table = torch.randn(9, BLOCK_TABLE, device="cuda").to(BF16)
    temb = torch.randn(3, TEMB, device="cuda")
    pw = (torch.randn(FINAL_PROJECTION, TEMB, device="cuda") * 0.02).to(BF16)
    pb = torch.zeros(FINAL_PROJECTION, device="cuda").to(BF16)
    ti = (idx // 3).clone()
    ti[17], ti[5] = 3, -1
    t = torch.rand(40, device="cuda")
    t[17], t[5] = 500.0, float("nan")
    tags = idx % 3
    tags_bad = tags.clone()
    tags_bad[17], tags_bad[5] = 3, -1
    return [
        ("norm_modulate", "adaln_indices", lambda: torch.ops.h3.norm_modulate(x, w, shift, scale, bad)),
        ("gate_residual", "adaln_indices", lambda: torch.ops.h3.gate_residual(x, y, shift, bad)),
        ("adaln_row_gather", "adaln_indices", lambda: torch.ops.h3.adaln_row_gather(table, bad)[0]),
        ("final_adaln_out", "timestep_indices", lambda: torch.ops.h3.final_adaln_out(x, w, temb, pw, pb, ti)),
        ("timestep_sinusoid", "t", lambda: torch.ops.h3.timestep_sinusoid(t)),
        ("adaln_indices", "timestep_indices", lambda: h3cute.adaln_indices(ti, tags, 3)),
        ("adaln_indices", "token_tags", lambda: h3cute.adaln_indices(idx // 3, tags_bad, 3)),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(7))
def test_bad_input_raises_at_check_errors_naming_first_bad_row(case):
    op, argument, call = _bad_calls()[case]
    torch.cuda.set_sync_debug_mode("error")  # the checked call itself never syncs the host
    try:
        out = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises((IndexError, ValueError), match=rf"h3::{op}: {argument}\[5\]"):
        h3cute.check_errors()
    assert out[5].isnan().all() if out.dtype.is_floating_point else int(out[5]) == -1
    h3cute.check_errors()  # raised once, then cleared
    _alive()


@pytest.mark.gpu
def test_pending_error_raises_at_the_next_h3_call():
    _, _, call = _bad_calls()[0]
    call()
    torch.cuda.synchronize()  # the kernel has run: the host words are set
    x, w, shift, scale, idx = _norm_inputs(9, seed=3)
    with pytest.raises(IndexError, match=r"h3::norm_modulate: adaln_indices\[5\] is outside \[0, 9\)"):
        torch.ops.h3.gate_residual(x, x, shift, idx)  # any h3 op, C++ fast path or Python
    _alive()


@pytest.mark.gpu
def test_unchecked_calls_record_nothing():
    x, w, shift, scale, idx = _norm_inputs()
    bad = idx.clone()
    bad[3] = 100
    out = torch.ops.h3.norm_modulate(x, w, shift, scale, bad, NORM_EPS, False)
    t = torch.tensor([0.5, 7.0], device="cuda")
    emb = torch.ops.h3.timestep_sinusoid(t, False)
    h3cute.check_errors()  # nothing raised
    assert out[3].isnan().all() and not out[4].isnan().any()
    assert not emb.isnan().any()


@pytest.mark.gpu
def test_checked_calls_capture_in_a_graph_and_raise_on_replay():
    """A checked call is capturable (no sync); a graph replayed on bad indices records them like an eager call."""
    x, w, shift, scale, idx = _norm_inputs()
    static_idx = idx.clone()
    torch.ops.h3.norm_modulate(x, w, shift, scale, static_idx)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.h3.norm_modulate(x, w, shift, scale, static_idx)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, reference.norm_modulate_replay(x, w, shift, scale, idx))
    h3cute.check_errors()
    static_idx[40] = 9
    graph.replay()
    with pytest.raises(IndexError, match=r"adaln_indices\[40\]"):
        h3cute.check_errors()
    assert out[40].isnan().all()
    _alive()


@pytest.mark.gpu
def test_checked_and_unchecked_calls_give_the_same_bits():
    x, w, shift, scale, idx = _norm_inputs(1000, seed=4)
    for checked in (True, False):
        out = torch.ops.h3.norm_modulate(x, w, shift, scale, idx, NORM_EPS, checked)
        assert torch.equal(out, reference.norm_modulate_replay(x, w, shift, scale, idx))
    t = torch.rand(64, device="cuda")
    assert torch.equal(torch.ops.h3.timestep_sinusoid(t), torch.ops.h3.timestep_sinusoid(t, False))
    ti, tags = torch.randint(0, 5, (300,), device="cuda"), torch.randint(0, MODALITIES, (300,), device="cuda")
    assert torch.equal(h3cute.adaln_indices(ti, tags, 5), ti * MODALITIES + tags)
    h3cute.check_errors()


_GRAPH_WARM_UP_FIRST_USE = """
import torch, h3cute
from h3cute.widths import HIDDEN
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(37, HIDDEN, generator=g, device="cuda").bfloat16()
w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
shift, scale = (torch.randn(6, HIDDEN, generator=g, device="cuda").bfloat16() for _ in range(2))
idx = torch.randint(0, 6, (37,), generator=g, device="cuda")
f = torch.compile(lambda x: torch.ops.h3.norm_modulate(x, w, shift, scale, idx), mode="reduce-overhead")
outs = []
for _ in range(3):  # warm-up (the process's first h3 call, with its check slots), recording, replay
    torch.compiler.cudagraph_mark_step_begin()
    outs.append(f(x).clone())
assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs)
print("replayed")
"""


@pytest.mark.gpu
def test_the_first_checked_call_may_be_inside_torch_compiles_cuda_graph_warm_up():
    """A fresh process whose first h3 call is in torch.compile(mode="reduce-overhead")'s warm-up: the check slots,
    allocated then and kept for the process, stay out of the graphs' private pool (else cudagraph trees refuse
    the graph: a live tensor their pool does not track), and the replays give the warm-up's bits."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _GRAPH_WARM_UP_FIRST_USE], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "replayed" in done.stdout, done.stderr[-3000:]
