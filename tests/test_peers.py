"""The peers of the prior-art harness (h3cute.bench.peers): where they come from, why they cannot run, argument
order, numerics notes, compile bookkeeping, the modes that skip a CPU, and the fastest-peer summary."""
import json
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from h3cute import reference
from h3cute.bench import candidates, checks, peers, prior_art, report
from h3cute.bench.candidates import Candidate, candidates_for, mode_unavailable, modes_for
from h3cute.bench.problems import PROBLEMS, Problem, at_smoke_scale, randn
from h3cute.widths import BLOCK_PROJECTION, HIDDEN, NORM_EPS, TEMB

CPU = torch.device("cpu")
CUDA = torch.device("cuda")   # a device object only: nothing here touches CUDA unless marked gpu
TINY = checks.Plan(all_rows_sizes=(3,), all_rows_seeds=(3,), sub_seeds=(3,), full_batch=4, sub_batch_sizes=(1, 3),
                   sweep_pool=3, sweep_seeds=(3,), accuracy_sizes=(5,), warmup=0, samples=1, graphs=False)


def _inputs(op, n=5, seed=3):
    p = PROBLEMS[op]
    return p, p.draw(n, seed, CPU)


# ---- where a peer's file comes from ---------------------------------------------------------------------

def _extracted(tmp_path, dist, version, rel, text):
    path = tmp_path / f"{dist}-{version}" / rel
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_a_peer_missing_everywhere_says_so(monkeypatch, tmp_path):
    monkeypatch.delenv(peers.PEER_FILES_ENV, raising=False)
    pf = peers.PeerFile("h3cute-no-such-peer", ("pkg/mod.py",))
    with pytest.raises(peers.PeerUnavailable, match="^h3cute-no-such-peer is not installed$"):
        peers.locate(pf)
    monkeypatch.setenv(peers.PEER_FILES_ENV, str(tmp_path))
    _extracted(tmp_path, "h3cute-no-such-peer", "dev", "pkg/mod.py", "")   # not a version: ignored
    with pytest.raises(peers.PeerUnavailable, match="holds none of its files"):
        peers.locate(pf)


def test_extracted_file_loads_with_stand_ins_that_leave_no_trace(monkeypatch, tmp_path):
    _extracted(tmp_path, "h3cute-fake-peer", "1.2.3", "fakepeer/ops.py",
               "from h3cute_fakeroot.utils import scale\n\ndef triple(x):\n    return scale(x, 3)\n")
    monkeypatch.setenv(peers.PEER_FILES_ENV, str(tmp_path))
    made = []

    def stand_ins():
        made.append(1)
        utils = peers._package("h3cute_fakeroot.utils", scale=lambda x, k: x * k)
        return {"h3cute_fakeroot": peers._package("h3cute_fakeroot"), "h3cute_fakeroot.utils": utils}
    pf = peers.PeerFile("h3cute-fake-peer", ("fakepeer/missing.py", "fakepeer/ops.py"), stand_ins, "h3cute_fakeroot")
    module, desc = peers.load(pf)
    assert module.triple(2) == 6
    assert desc.startswith("h3cute-fake-peer 1.2.3 fakepeer/ops.py (extracted from its wheel")
    assert "stand-ins for h3cute_fakeroot.utils" in desc
    assert "h3cute_fakeroot" not in sys.modules and "h3cute_fakeroot.utils" not in sys.modules
    assert peers.load(pf)[0] is module and made == [1]          # executed once per process


def test_a_file_that_fails_to_execute_is_unavailable_with_its_error(monkeypatch, tmp_path):
    _extracted(tmp_path, "h3cute-broken-peer", "0.1", "b/m.py", "import h3cute_not_a_module_anywhere\n")
    monkeypatch.setenv(peers.PEER_FILES_ENV, str(tmp_path))
    with pytest.raises(peers.PeerUnavailable, match="h3cute-broken-peer 0.1 m.py: ModuleNotFoundError"):
        peers.load(peers.PeerFile("h3cute-broken-peer", ("b/m.py",)))


def test_installed_distribution_wins_over_extracted_files(monkeypatch, tmp_path):
    # pytest is installed: a PeerFile naming one of its files is found there, not in the extracted folder
    monkeypatch.setenv(peers.PEER_FILES_ENV, str(tmp_path))
    _extracted(tmp_path, "pytest", "0.0.1", "pytest/__init__.py", "")
    path, version, where = peers.locate(peers.PeerFile("pytest", ("pytest/__init__.py",)))
    assert where == "installed" and version == pytest.__version__ and tmp_path not in path.parents
    with pytest.raises(peers.PeerUnavailable, match=r"pytest .* is installed but has none of pytest/nope\.py"):
        peers.locate(peers.PeerFile("pytest", ("pytest/nope.py",)))


def test_sglang_stand_ins_are_sglangs_helpers_without_deepgemm(monkeypatch):
    mods = peers._sglang_stand_ins()
    common = mods["sglang.srt.utils.common"]
    assert mods["sglang.srt.layers.deep_gemm_wrapper.configurer"].ENABLE_JIT_DEEPGEMM is False
    assert mods["sglang.srt.utils"].is_npu() is False
    monkeypatch.setenv("H3_TEST_FLAG", "TRUE")
    assert common.get_bool_env_var("H3_TEST_FLAG") is True
    assert common.get_bool_env_var("H3_TEST_UNSET") is False and common.get_bool_env_var("H3_TEST_UNSET", "1")
    x = torch.randn(8, dtype=torch.float64)
    assert common.calc_diff(x, x).item() == pytest.approx(0.0, abs=1e-15)
    if not torch.cuda.is_available():
        assert common.get_device_core_count() == 0
        with pytest.raises(RuntimeError, match="No supported accelerator"):
            common.get_dispatch_device_backend()
    monkeypatch.setattr(peers, "_importable", lambda name: name == "deep_gemm")
    with pytest.raises(peers.PeerUnavailable, match="deep_gemm is installed"):
        peers._sglang_stand_ins()


# ---- modes ---------------------------------------------------------------------------------------------

def test_the_triton_modes_belong_to_the_two_gemm_ops_that_sglang_and_megatron_serve():
    six = ["plain", "vllm", "sglang", "sglang_ieee", "megatron_triton", "megatron_triton_ieee"]
    assert modes_for(PROBLEMS["timestep_mlp"]) == six and modes_for(PROBLEMS["adaln_projection"]) == six
    assert modes_for(PROBLEMS["final_adaln_out"]) == ["plain", "vllm"]
    assert modes_for(PROBLEMS["norm_modulate"]) == ["plain"]
    assert candidates.MODES["sglang_ieee"] == {"TRITON_F32_DEFAULT": "ieee"} and candidates.MODES["sglang"] == {}
    assert set(peers.TRITON_MODE_FILES) == set(candidates.TRITON_MODES)
    names = [c.name for c in candidates_for(PROBLEMS["timestep_mlp"], "megatron_triton_ieee", TINY, CPU)]
    assert names == ["diffusers[megatron_triton_ieee]"]
    (c,) = candidates_for(PROBLEMS["adaln_projection"], "sglang", TINY, CPU)
    assert "SGLang enable_batch_invariant_mode" in c.source and c.fn is reference.adaln_projection_replay


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answers")
def test_without_cuda_every_mode_but_plain_says_why():
    assert mode_unavailable("plain") is None
    assert "changes nothing" in mode_unavailable("vllm")
    for mode in candidates.TRITON_MODES:
        assert mode_unavailable(mode) == "needs a CUDA device: its Triton matmul replaces aten's CUDA kernels"
        assert candidates.apply_mode(mode) == mode_unavailable(mode)


def _toy_gemm_draw(n, seed, device):
    return {"x": randn((n, 4), seed, 0, device), "w": randn((3, 4), seed, 1, device)}


TOY_GEMM = Problem(op="toy_gemm", args=("x", "w"), row_args=("x",), row_grads=("x",), param_grads=("w",),
                   draw=_toy_gemm_draw, accuracy_sizes=(1, 4), full_batch=16, sub_batch_sizes=(1, 7),
                   gemm=True, triton_modes=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path")
def test_on_a_cpu_the_modes_are_recorded_with_why_and_start_no_process(monkeypatch, tmp_path):
    monkeypatch.setitem(prior_art.PROBLEMS, "toy_gemm", TOY_GEMM)

    def no_process(*a, **k):
        raise AssertionError("a mode process was started on a CPU")
    monkeypatch.setattr(prior_art, "_mode_subprocess", no_process)
    rep = prior_art.prior_art("toy_gemm", True, tmp_path / "toy.json", overrides={"accuracy_sizes": [4]},
                              log=lambda m: None)
    assert list(rep["results"]) == modes_for(TOY_GEMM)
    assert rep["results"]["vllm"]["diffusers[vllm]"]["unavailable"].startswith("mode vllm: a cuBLAS mode")
    sgl = rep["results"]["sglang_ieee"]["diffusers[sglang_ieee]"]
    assert sgl["unavailable"] == "mode sglang_ieee: needs a CUDA device: its Triton matmul replaces aten's CUDA kernels"
    assert rep["environment"]["mode_environment"]["megatron_triton_ieee"] == {"TRITON_F32_DEFAULT": "ieee"}
    assert rep["notes"][0] == prior_art.CPU_NOTE and "not measurements" in rep["notes"][0]
    md = (tmp_path / "toy.md").read_text()
    assert md.splitlines()[2] == f"**{prior_art.CPU_NOTE}**"
    assert report.validate_report(json.loads((tmp_path / "toy.json").read_text())) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path")
def test_a_run_stopped_midway_leaves_the_modes_it_finished(monkeypatch, tmp_path):
    monkeypatch.setitem(prior_art.PROBLEMS, "toy_gemm", TOY_GEMM)
    real = prior_art._without_process

    def stops_at_sglang_ieee(op, mode, *a):
        if mode == "sglang_ieee":
            raise KeyboardInterrupt   # as a time limit would stop it
        return real(op, mode, *a)
    monkeypatch.setattr(prior_art, "_without_process", stops_at_sglang_ieee)
    with pytest.raises(KeyboardInterrupt):
        prior_art.prior_art("toy_gemm", True, tmp_path / "toy.json", overrides={"accuracy_sizes": [4]},
                            log=lambda m: None)
    rep = report.load_report(tmp_path / "toy.json")
    assert list(rep["results"]) == ["plain", "vllm", "sglang"]
    assert rep["notes"][-1] == ("Incomplete: the modes sglang_ieee, megatron_triton, megatron_triton_ieee had not "
                                "finished when this was written.")
    assert "Incomplete" in (tmp_path / "toy.md").read_text()


def test_the_mode_process_sees_only_the_modes_own_precision_switch(monkeypatch, tmp_path):
    seen, real = {}, subprocess.run

    def fake_run(cmd, env=None, **kw):
        if "_mode" not in cmd:   # git, asked by the report's environment
            return real(cmd, env=env, **kw)
        seen[cmd[cmd.index("--mode") + 1]] = env.get("TRITON_F32_DEFAULT")
        return types.SimpleNamespace(returncode=1)
    monkeypatch.setattr(prior_art.subprocess, "run", fake_run)
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    monkeypatch.setitem(prior_art.PROBLEMS, "toy_gemm", TOY_GEMM)
    for mode in ("sglang", "sglang_ieee"):
        part = prior_art._mode_subprocess("toy_gemm", mode, True, {}, tmp_path, lambda m: None)
        assert part["results"][mode][f"diffusers[{mode}]"]["unavailable"] == "mode subprocess failed with exit status 1"
    assert seen == {"sglang": None, "sglang_ieee": "ieee"}


# ---- vllm-omni: argument order, numerics notes, why not --------------------------------------------------

def test_vllm_omni_kernels_take_the_ops_arguments_in_their_own_order():
    """Each kernel gets the tensor its parameter names: vllm-omni's gate kernels take (x, gate, other) where the
    op takes (residual, y, gate), and the norm kernels end with eps (H3's, the replay's default)."""
    signatures = {   # vllm-omni 0.30.0's parameters (indexed_modulation.py) -> the op argument each must receive
        "rms_norm_indexed_scale_shift": {"x": "x", "weight": "weight", "shift": "shift", "scale": "scale",
                                         "indices": "adaln_indices", "eps": None},
        "indexed_gate": {"x": "residual", "gate": "gate", "other": "y", "indices": "adaln_indices"},
        "indexed_gate_rms_norm_scale_shift": {"residual": "residual", "gate": "gate", "branch": "y",
                                              "weight": "weight", "shift": "shift", "scale": "scale",
                                              "indices": "adaln_indices", "eps": None},
    }
    fused = Problem(op="gate_residual_norm_modulate", args=("residual", "y", "gate", "weight", "shift", "scale",
                                                              "adaln_indices"),
                    row_args=("residual", "y", "adaln_indices"), row_grads=(), param_grads=(), draw=None,
                    accuracy_sizes=(1,), full_batch=4, sub_batch_sizes=(1,))
    for op, problem in (("norm_modulate", PROBLEMS["norm_modulate"]), ("gate_residual", PROBLEMS["gate_residual"]),
                        ("gate_residual_norm_modulate", fused)):
        kernel = peers.VLLM_OMNI[op]
        wants = signatures[kernel.function]
        args = [object() for _ in problem.args]
        got = {}
        peers._omni_call(problem, kernel, lambda *a, params=tuple(wants): got.update(zip(params, a)))(*args)
        by_name = dict(zip(problem.args, args))
        assert set(got) == set(wants)
        for param, arg in wants.items():
            if arg is None:
                assert got[param] == NORM_EPS == peers._eps()
            else:
                assert got[param] is by_name[arg], (op, param)


def _fake_omni_module():
    """vllm-omni's three functions with their signatures, computing diffusers' ops (CPU tensors)."""
    def rms_norm_indexed_scale_shift(x, weight, shift, scale, indices, eps):
        return reference.norm_modulate_replay(x, weight, shift, scale, indices, eps)

    def indexed_gate(x, gate, other, indices):
        return reference.gate_residual_replay(x, other, gate, indices)
    return types.SimpleNamespace(rms_norm_indexed_scale_shift=rms_norm_indexed_scale_shift, indexed_gate=indexed_gate)


def test_vllm_omni_candidate_is_forward_only_and_carries_its_numerics_note(monkeypatch):
    monkeypatch.setattr(peers, "load", lambda pf: (_fake_omni_module(), "vllm-omni 0.30.0 fake"))
    for op in ("norm_modulate", "gate_residual"):
        p, inputs = _inputs(op)
        c = peers.vllm_omni_candidate(p, CUDA)
        assert c.unavailable is None and c.has_backward is False
        assert c.source == f"vllm-omni 0.30.0 fake: {peers.VLLM_OMNI[op].function} (Triton)"
        assert "rounded to BF16 once" in c.notes and c.notes.startswith("forward only")
        args = [inputs[a] for a in p.args]
        assert torch.equal(c.fn(*args), getattr(reference, f"{op}_replay")(*args))
    assert peers.vllm_omni_candidate(PROBLEMS["timestep_mlp"], CUDA) is None


def test_vllm_omni_unavailable_reasons(monkeypatch):
    p = PROBLEMS["gate_residual"]
    assert "torch fallback, not the Triton kernel" in peers.vllm_omni_candidate(p, CPU).unavailable
    monkeypatch.delenv(peers.PEER_FILES_ENV, raising=False)
    monkeypatch.setattr(peers, "_LOADED", {})
    if not peers._importable("vllm_omni"):
        assert peers.vllm_omni_candidate(p, CUDA).unavailable == "vllm-omni is not installed"
    odd = Problem(op="gate_residual", args=("residual", "y", "table", "adaln_indices"), row_args=(), row_grads=(),
                  param_grads=(), draw=None, accuracy_sizes=(1,), full_batch=4, sub_batch_sizes=(1,))
    assert "lack ['gate']" in peers.vllm_omni_candidate(odd, CUDA).unavailable


@pytest.mark.skipif(not peers._importable("triton"), reason="the stand-in imports triton")
def test_vllm_stand_in_is_triton_itself():
    import triton
    mods = peers._vllm_stand_ins()
    assert mods["vllm.triton_utils"].triton is triton and mods["vllm.triton_utils"].tl is triton.language


# ---- liger / quack: norm swapped in, diffusers around it --------------------------------------------------

@pytest.mark.parametrize("op", peers.NORM_PEER_OPS)
def test_a_norm_peer_replaces_only_the_rmsnorm(op):
    """With torch's own RMSNorm in the peer's place, the composition is the diffusers replay, bit for bit."""
    p, inputs = _inputs(op, 6)
    calls = []

    def norm(x, w, eps):
        calls.append((x.shape, w.shape, eps))
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    args = [inputs[a] for a in p.args]
    out = peers._norm_then_modulate(p, norm)(*args)
    assert torch.equal(out, getattr(reference, f"{op}_replay")(*args))
    assert calls == [((6, HIDDEN), (HIDDEN,), NORM_EPS)]


def test_norm_peer_unavailable_reasons(monkeypatch):
    p = PROBLEMS["norm_modulate"]
    assert peers.liger_candidate(p, CPU).unavailable == "needs a CUDA device: liger's RMSNorm is a Triton kernel"
    assert peers.quack_candidate(p, CPU).unavailable == "needs a CUDA device: quack's RMSNorm is a CuTe DSL kernel"
    assert peers.liger_candidate(PROBLEMS["gate_residual"], CUDA) is None
    assert peers.quack_candidate(PROBLEMS["timestep_mlp"], CUDA) is None
    if not peers._importable("liger_kernel"):
        assert peers.liger_candidate(p, CUDA).unavailable == "liger-kernel is not installed"
    real = peers._importable
    monkeypatch.setattr(peers, "_importable", lambda name: False if name in ("cutlass", "quack") else real(name))
    why = peers.quack_candidate(PROBLEMS["final_adaln_out"], CUDA).unavailable
    assert why.startswith("the CuTe DSL (nvidia-cutlass-dsl) is not installed here")
    assert "compiles its kernels with it at run time" in why and why.endswith("(quack-kernels: not installed either)")
    monkeypatch.setattr(peers, "_importable", lambda name: name == "cutlass" or (name != "quack" and real(name)))
    assert peers.quack_candidate(p, CUDA).unavailable == "quack-kernels is not installed"


# ---- torch.compile ---------------------------------------------------------------------------------------

def test_inductor_is_judged_on_a_gpu_and_its_modes_follow_the_plan():
    cands = peers.peer_candidates(PROBLEMS["gate_residual"], TINY, CPU)
    ind = [c for c in cands if c.name.startswith("inductor")]
    assert [c.name for c in ind] == ["inductor", "inductor_max_autotune"]
    assert all("inductor_on_cpu=true" in c.unavailable for c in ind)
    assert "mode='max-autotune-no-cudagraphs'" in ind[1].source
    one = TINY.with_overrides({"inductor_modes": ["default"]})
    assert [c.name for c in peers.peer_candidates(PROBLEMS["timestep_mlp"], one, CPU)] == ["inductor"]


class _Totals:
    """A stand-in for torch's compile timers: (fwd s, bwd s, fwd count, bwd count, graphs)."""

    def __init__(self):
        self.now = [0.0, 0.0, 0, 0, 0]

    def __call__(self):
        return tuple(self.now)

    def forward(self, seconds):
        self.now[0] += seconds
        self.now[2] += 1
        self.now[4] += 1

    def backward(self, seconds):
        self.now[1] += seconds
        self.now[3] += 1


def test_compile_log_attributes_each_compile_to_its_call_and_stops_at_the_budget(monkeypatch):
    totals = _Totals()
    monkeypatch.setattr(peers, "_compile_totals", totals)
    monkeypatch.setattr(peers.CompileLog, "_last", None)
    monkeypatch.setattr(peers.CompileLog, "_mark", totals())
    a, b = peers.CompileLog("default", True, budget_s=10.0), peers.CompileLog("max-autotune-no-cudagraphs", True, 10.0)

    def compiling(seconds):
        return lambda *args: totals.forward(seconds) or "out"
    assert a.call(compiling(3.0), (), rows=1) == "out"
    totals.backward(2.0)                              # a's lazy backward, after its call returned
    b.call(lambda: None, (), rows=64)                 # b's call settles it to a
    with torch.no_grad():
        b.call(compiling(1.5), (), rows=64)
    sa, sb = a.summary(), b.summary()
    assert (sa["graphs"], sa["backward_compiles"], sa["compile_s"]) == (1, 1, 5.0)
    assert sa["events"] == [{"phase": "forward", "rows": 1, "grad": True, "seconds": 3.0, "compiles": 1},
                            {"phase": "backward", "rows": 1, "grad": True, "seconds": 2.0, "compiles": 1}]
    assert sb["events"] == [{"phase": "forward", "rows": 64, "grad": False, "seconds": 1.5, "compiles": 1}]
    assert sb["calls"] == 2 and sb["dynamic"] == "rows" and "maybe_mark_dynamic" in sb["why"]
    a.call(compiling(6.0), (), rows=7)                # 11 s: over the budget, found at the next call
    with pytest.raises(peers.CompileBudgetExceeded, match="compiling took 11.0 s, over .* = 10"):
        a.call(lambda: None, (), rows=7)


def test_compile_log_events_are_capped_and_counted(monkeypatch):
    totals = _Totals()
    monkeypatch.setattr(peers, "_compile_totals", totals)
    monkeypatch.setattr(peers.CompileLog, "_last", None)
    log = peers.CompileLog("default", False, budget_s=1e9)
    for rows in range(peers.CompileLog.MAX_EVENTS + 5):
        log.call(lambda: totals.forward(0.1), (), rows=rows)
    s = log.summary()
    assert s["graphs"] == peers.CompileLog.MAX_EVENTS + 5 and s["events_left_off"] == 5
    assert s["dynamic"] is False and s["recompile_limit"] == peers.RECOMPILE_LIMIT[False]


def test_compile_timer_keys_exist_in_this_torch():
    """The two timers CompileLog reads are torch._dynamo's own; a renamed key would read as no compile."""
    import inspect

    import torch._dynamo.convert_frame as cf
    from torch._functorch._aot_autograd import runtime_wrappers as rw
    assert f'"{peers._FWD_KEY}"' in inspect.getsource(cf)
    assert f'"{peers._BWD_KEY}"' in inspect.getsource(rw)


# ---- bits, the CPU smoke, the fastest peer --------------------------------------------------------------

def test_bits_vs_counts_differing_elements_bit_for_bit():
    a = torch.tensor([1.0, 0.0, float("nan"), 2.0], dtype=torch.bfloat16)
    same = a.clone()
    assert checks.bits_vs([a], [same]) == {"equal": True, "differing": 0.0}   # NaN bits equal NaN bits
    b = a.clone()
    b[1] = -0.0
    b[3] = 2.015625                                   # the next BF16 after 2
    assert checks.bits_vs([a, a], [b, same]) == {"equal": False, "differing": 2 / 8}
    assert checks.bits_vs([a], [a.float()]) == {"equal": False, "differing": 1.0}


def test_the_cpu_smoke_narrows_only_the_projection_and_h3cute_sits_it_out():
    proj = at_smoke_scale(PROBLEMS["adaln_projection"])
    assert f"weight ({BLOCK_PROJECTION // 16}, {TEMB})" in proj.narrowed and "not the op's widths" in proj.narrowed
    assert proj.draw(2, 3, CPU)["weight"].shape == (BLOCK_PROJECTION // 16, TEMB)
    h3 = candidates._h3cute(proj)
    assert h3.unavailable.startswith("the op takes the checkpoint's widths only; this problem is drawn narrower")
    assert at_smoke_scale(PROBLEMS["final_adaln_out"]) is PROBLEMS["final_adaln_out"]
    plan = checks.plan_for_device(checks.QUICK, CPU, proj)
    assert plan.accuracy_sizes == (4,) and plan.full_batch == 3 and plan.sweep_pool == 3 and not plan.graphs
    assert checks.plan_for_device(checks.QUICK, CPU, PROBLEMS["gate_residual"]).accuracy_sizes == (257,)


def _cand(us, invariant=True, err=1e-3, **extra):
    e = {"fwd_rel_err": err, "fwd_us": us[0], "fwd_bwd_us": us[1]}
    return {"source": "s", "has_backward": True, "accuracy_latency": {"64": e},
            "batch_invariance": {"all_rows": {}, "params_repeatable": None, "batch_size_sweep": {"comparisons": 0,
                                 "differ": 0}, "full_vs_sub_batches": {"full_batch": 4, "sub_batches": 0,
                                 "fwd_differ": 0, "rowgrad_differ": 0}, "batch_invariant": invariant}, **extra}


def test_fastest_peer_names_the_peer_that_beats_h3cute_plainly():
    rep = {"kind": report.KIND, "rfc": report.RFC, "op": "norm_modulate", "rl_kernel_commit": None,
           "tracked_tree_dirty": None, "quick": True,
           "environment": {"gpu": "G", "capability": [9, 0], "torch": "t", "cuda": "c", "python": "p", "tf32": False,
                           "libraries": {}, "mode_environment": {"plain": {}}},
           "results": {"plain": {
               "h3cute": _cand((10.0, 30.0)),
               "diffusers": _cand((20.0, 40.0)),
               "inductor": _cand((8.0, 50.0), invariant=False),
               "torch_bare_op": _cand((1.0, 1.0), comparable=False),
               "vllm_omni": {"source": "s", "unavailable": "not installed"}}}}
    f = report.fastest_peers(rep)["64"]
    assert f["fwd_us"]["fastest"]["peer"] == "inductor" and f["fwd_us"]["fastest"]["h3cute_over_peer"] == 10 / 8
    assert f["fwd_us"]["fastest_invariant"]["peer"] == "diffusers"
    assert f["fwd_bwd_us"]["fastest"]["peer"] == "diffusers" and f["fwd_bwd_us"]["h3cute_us"] == 30.0
    md = "\n".join(report.fastest_markdown(rep))
    assert ("A peer is faster than h3cute here: fwd_us at 64 rows: `inductor` 8.00 µs against h3cute 10.00 µs "
            "(1.25x); that peer is not batch-invariant.") in md
    rep["results"]["plain"]["inductor"]["accuracy_latency"]["64"]["fwd_us"] = 12.0
    assert "No peer is faster than h3cute" in "\n".join(report.fastest_markdown(rep))
    out = report.compare_markdown(rep, rep, "a", "b")
    assert "## Fastest peer: a" in out and "## Unavailable: b" in out and "- `vllm_omni`: not installed" in out
    assert "| `inductor` | **NO** | **NO** |" in out


def test_status_table_gathers_every_report_in_a_folder(tmp_path, capsys):
    """`h3cute-bench status DIR`: one row per op, size and phase, each op with its report's commit (a full hash as
    its first 7 characters); other JSON files in the folder (row_kernels.json, model.json) are passed over; a folder
    without reports is a usage error."""
    from h3cute.bench import cli
    assert cli.main(["status", str(tmp_path)]) == 2
    assert "no prior-art report" in capsys.readouterr().err

    def rep(op, h3, peer, commit, err=1e-3):
        return {"kind": report.KIND, "rfc": report.RFC, "op": op, "rl_kernel_commit": None,
                "tracked_tree_dirty": None, "quick": True,
                "environment": {"gpu": "G", "capability": [9, 0], "torch": "t", "cuda": "c", "python": "p",
                                "tf32": False, "libraries": {}, "mode_environment": {"plain": {}},
                                "h3cute": {"commit": commit}},
                "results": {"plain": {"h3cute": _cand(h3), "diffusers": _cand(peer, err=err)}}}
    (tmp_path / "gate_residual.json").write_text(json.dumps(rep("gate_residual", (10.0, 30.0), (20.0, 20.0), "abc1",
                                                                err=2e-2)))
    (tmp_path / "norm_modulate.json").write_text(json.dumps(rep("norm_modulate", (5.0, 9.0), (6.0, 12.0),
                                                                "abc2def" + "0" * 33)))
    (tmp_path / "model.json").write_text(json.dumps({"kind": "h3_model_bench"}))
    assert cli.main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| `")]
    assert [r.split(" | ")[0] for r in rows] == ["| `norm_modulate`"] * 2 + ["| `gate_residual`"] * 2  # OPS order
    assert rows[0].startswith("| `norm_modulate` | abc2def | 64 | fwd | 5.00 | ")
    assert "| `diffusers` | 6.00 | " in rows[0] and rows[0].split(" | ")[9] == "0.83"
    assert ("A peer is faster than h3cute at: `gate_residual` fwd_bwd_us at 64 rows: `diffusers` 20.00 µs "
            "against h3cute 30.00 µs (1.50x); its forward error against FP64 is 0.02, 20x h3cute's 0.001.") in out
    assert "1.50x)." not in "\n".join(out)  # a peer as accurate as h3cute gets no such note (norm_modulate's)


def test_candidate_notes_and_compile_details_reach_the_report(tmp_path):
    def x_plus_w(x, w, b):
        return x * w + b
    toy = Problem(op="toy_scale", args=("x", "w", "b"), row_args=("x",), row_grads=("x",), param_grads=("w", "b"),
                  draw=lambda n, s, d: {"x": randn((n, 4), s, 0, d), "w": randn((4,), s, 1, d),
                                        "b": randn((4,), s, 2, d)},
                  accuracy_sizes=(4,), full_batch=16, sub_batch_sizes=(1, 7))
    log = peers.CompileLog("default", True, budget_s=60.0)
    c = Candidate("peer", "a peer", x_plus_w, notes="rounds once", details=lambda: {"compile": log.summary()})
    gone = Candidate("gone", "gone", notes="never ran", unavailable="not here")
    part = prior_art.run_mode(toy, "plain", TINY.with_overrides({"accuracy_sizes": [4]}), CPU, cands=[c, gone])
    res = part["results"]["plain"]
    assert res["peer"]["notes"] == "rounds once" and res["peer"]["compile"]["graphs"] == 0
    assert res["gone"] == {"source": "gone", "unavailable": "not here", "notes": "never ran"}
    rep = prior_art.merge("toy_scale", [part], quick=True)
    assert report.validate_report(rep) == [] and "fastest_peer" in rep
    md = report.summary_markdown(rep)
    assert "- `peer`: rounds once" in md and "| `peer` | default | rows | 0 | 0 | 0 | 0 |" in md


def test_plain_mode_compares_every_candidates_bits_with_the_replay():
    p = PROBLEMS["gate_residual"]
    ref = checks.Reference(p, CPU, replay_bits=True)
    plan = checks.Plan(accuracy_sizes=(5,), warmup=0, samples=1, graphs=False)
    replay = next(c for c in candidates_for(p, "plain", TINY, CPU) if c.name == "diffusers")
    once = Candidate("once", "FP32, rounded once",
                     lambda r, y, g, i: (r.float() + g.index_select(0, i).float() * y.float()).bfloat16())
    assert "fwd_bits_vs_diffusers" not in checks.accuracy_latency(replay, p, plan, CPU, ref)["5"]
    bits = checks.accuracy_latency(once, p, plan, CPU, ref)["5"]["fwd_bits_vs_diffusers"]
    assert bits["equal"] is False and 0 < bits["differing"] < 0.5     # one rounding against diffusers' two
    assert "fwd_bits_vs_diffusers" not in checks.accuracy_latency(once, p, plan, CPU, checks.Reference(p, CPU))["5"]


# ---- on the device (the lead runs these with perf/stage_peers.sh's files carried; the Triton modes are run by
# tests/test_bench.py::test_gpu_modes_run_in_their_own_processes) ---------------------------------------------

SMALL_GPU = checks.Plan(all_rows_sizes=(64,), all_rows_seeds=(3,), sub_seeds=(3,), full_batch=4096,
                        sub_batch_sizes=(1, 7, 1024), sweep_pool=256, sweep_seeds=(3,), accuracy_sizes=(257,),
                        warmup=3, samples=10, inductor_modes=("default",))


def _staged():
    try:
        return peers.locate(peers.VLLM_OMNI_FILE)
    except peers.PeerUnavailable as e:
        pytest.skip(f"{e} (stage it: perf/stage_peers.sh, carried by perf/device_run.sh)")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["norm_modulate", "gate_residual"])
def test_gpu_vllm_omni_kernels_round_once_and_stay_row_local(op):
    _staged()
    p = PROBLEMS[op]
    c = peers.vllm_omni_candidate(p, CUDA)
    assert c.unavailable is None, c.unavailable
    inputs = p.draw(257, 3, CUDA)
    args = [inputs[a] for a in p.args]
    out = c.fn(*args)
    ref = getattr(reference, f"{op}_fp64")(*args)
    assert checks.rel_err(out, ref) < 2 ** -7
    if op == "gate_residual":   # the numerics note: one FP32 rounding, not diffusers' two
        r, y, g, i = args
        assert torch.equal(out, (r.float() + g.index_select(0, i).float() * y.float()).bfloat16())
        assert not torch.equal(out, reference.gate_residual_replay(*args))
    bi = checks.batch_invariance(c, p, SMALL_GPU, CUDA)
    assert bi["batch_invariant"] is True and bi["params_repeatable"] is None


@pytest.mark.gpu
def test_gpu_liger_norm_modulate_runs_forward_and_backward():
    if not peers._importable("liger_kernel"):
        pytest.skip("liger-kernel is not installed (perf/stage_peers.sh stages it)")
    p = PROBLEMS["norm_modulate"]
    c = peers.liger_candidate(p, CUDA)
    assert c.unavailable is None, c.unavailable
    e = checks.accuracy_latency(c, p, SMALL_GPU, CUDA, checks.Reference(p, CUDA, replay_bits=True))["257"]
    # the replay's own bounds: four BF16 roundings of the modulated row (tests/test_norm_modulate.py); the table
    # gradients are diffusers' modulation in torch, BF16 index_add sums (0.02-0.05 from FP64 in the H200 reports)
    assert e["fwd_rel_err"] < 1.6e-2 and max(e["grad_rel_err"].values()) < 0.1
    assert e["fwd_us"] > 0 and e["fwd_bwd_us"] > 0 and "equal" in e["fwd_bits_vs_diffusers"]


@pytest.mark.gpu
def test_gpu_quack_runs_or_says_exactly_why():
    c = peers.quack_candidate(PROBLEMS["norm_modulate"], CUDA)
    if peers._importable("cutlass") and peers._importable("quack"):
        assert c.unavailable is None
    else:
        assert c.unavailable.startswith("the CuTe DSL") or c.unavailable == "quack-kernels is not installed"


@pytest.mark.gpu
def test_gpu_inductor_gate_residual_is_judged_and_its_compiles_logged():
    p = PROBLEMS["gate_residual"]
    (c,) = [c for c in peers.peer_candidates(p, SMALL_GPU, CUDA) if c.name == "inductor"]
    part = prior_art.run_mode(p, "plain", SMALL_GPU, CUDA, cands=[c])
    res = part["results"]["plain"]["inductor"]
    assert "unavailable" not in res, res.get("unavailable")
    k = res["compile"]
    assert k["dynamic"] == "rows" and k["graphs"] >= 2 and k["compile_s"] > 0 and k["events"]
    assert {e["rows"] for e in k["events"] if e["phase"] == "forward"} >= {1}
    e = res["accuracy_latency"]["257"]
    assert e["fwd_rel_err"] < 2 ** -7 and e["fwd_us"] > 0 and "differing" in e["fwd_bits_vs_diffusers"]
    assert isinstance(res["batch_invariance"]["batch_invariant"], bool)
    from torch._dynamo.utils import compilation_time_metrics   # this torch's timers are the ones CompileLog reads
    assert compilation_time_metrics.get(peers._FWD_KEY) and compilation_time_metrics.get(peers._BWD_KEY)
