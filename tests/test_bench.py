"""CPU tests of the prior-art harness (h3cute.bench): planted controls, the seeds' method, the schema."""
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from h3cute import reference as R
from h3cute.bench import checks, prior_art, report, timing
from h3cute.bench.candidates import Candidate, candidates_for, modes_for
from h3cute.bench.cli import main
from h3cute.bench.problems import PROBLEMS, Problem, randn, row_layout, take_rows
from h3cute.bench.sweep import sweep, sweep_markdown
from h3cute.widths import BLOCK_PROJECTION, FINAL_PROJECTION, HIDDEN

# The B200 seed reports the harness must read (copied from the project's shared/seeds).
SEEDS = sorted((Path(__file__).parent / "data" / "seeds").glob("*.json"))
assert len(SEEDS) == 3, "tests/data/seeds must hold the three seed reports"
CPU = torch.device("cpu")

# Tiny sizes: the method is the seeds', only the counts shrink.
TINY = checks.Plan(all_rows_sizes=(5, 9), all_rows_seeds=(3, 4), sub_seeds=(3,), full_batch=64,
                   sub_batch_sizes=(1, 7, 32), sweep_pool=32, sweep_seeds=(3,), accuracy_sizes=(1, 4),
                   warmup=1, samples=3)


def _child_env():
    """The environment for `python -m h3cute.bench` children: this h3cute, installed or from a checkout."""
    import os

    import h3cute

    root = str(Path(h3cute.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


_CHILD_ENV = _child_env()


def _toy_draw(n, seed, device):
    return {"x": randn((n, 4), seed, 0, device), "w": randn((4,), seed, 1, device),
            "b": randn((4,), seed, 2, device, 0.02)}


TOY = Problem(op="toy_scale", args=("x", "w", "b"), row_args=("x",), row_grads=("x",), param_grads=("w", "b"),
              draw=_toy_draw, accuracy_sizes=(1, 4), full_batch=64, sub_batch_sizes=(1, 7, 32))


class _NoisyParamGrad(torch.autograd.Function):
    """x * w whose weight gradient carries run-to-run noise, like an atomic reduction."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0) + torch.rand_like(w) * 1e-6


ROWWISE = Candidate("rowwise", "x * w + b", lambda x, w, b: x * w + b)
BATCH_MEAN = Candidate("batch_mean", "x * w + b + 1e-3 * mean(x)",
                       lambda x, w, b: x * w + b + 1e-3 * x.mean(0, keepdim=True))
NOISY = Candidate("noisy", "x * w + b, noisy dw", lambda x, w, b: _NoisyParamGrad.apply(x, w) + b)


def test_rowwise_candidate_is_batch_invariant():
    bi = checks.batch_invariance(ROWWISE, TOY, TINY, CPU)
    assert bi["batch_invariant"] is True
    assert bi["params_repeatable"] is True
    assert bi["all_rows"] == {"5": {"rows": 10, "fwd_differ": 0, "rowgrad_differ": 0},
                              "9": {"rows": 18, "fwd_differ": 0, "rowgrad_differ": 0}}
    assert bi["full_vs_sub_batches"]["sub_batches"] == 64 // 1 + 64 // 7 + 1 + 2   # step max(size, 64 // 512)
    sw = bi["batch_size_sweep"]
    assert sw["differ"] == 0 and sw["first_failures"] == [] and sw["comparisons"] > 0


def test_planted_batch_dependence_is_caught_with_its_first_failure():
    bi = checks.batch_invariance(BATCH_MEAN, TOY, TINY, CPU)
    assert bi["batch_invariant"] is False
    # the mean couples every row's output and, through d mean / dx, every row's gradient
    assert bi["all_rows"]["5"] == {"rows": 10, "fwd_differ": 10, "rowgrad_differ": 10}
    assert bi["full_vs_sub_batches"]["fwd_differ"] == bi["full_vs_sub_batches"]["sub_batches"]
    sw = bi["batch_size_sweep"]
    # Batch 1 is the probe alone (equal); batch 2 puts row 0 beside another pool row at position 0 first.
    others = torch.randint(0, 32, (2,), generator=torch.Generator().manual_seed(3 * 1000 + 2))
    assert others[1] != 0
    assert sw["first_failures"][0] == {"seed": 3, "batch": 2, "position": 0, "row": 0}
    assert len(sw["first_failures"]) == 8
    assert 0 < sw["differ"] <= sw["comparisons"]


def test_nondeterministic_parameter_gradient_fails_params_repeatable_only():
    bi = checks.batch_invariance(NOISY, TOY, TINY, CPU)
    assert bi["params_repeatable"] is False
    assert bi["batch_invariant"] is False
    assert bi["batch_size_sweep"]["differ"] == 0
    assert all(v["fwd_differ"] == 0 and v["rowgrad_differ"] == 0 for v in bi["all_rows"].values())


def test_method_reproduces_the_seed_counts():
    seed = json.loads(next(p for p in SEEDS if "timestep_mlp" in p.name).read_text())
    sw = seed["results"]["plain"]["rl_kernel"]["batch_invariance"]["batch_size_sweep"]
    assert checks.sweep_sizes(2048) == sw["batch_sizes"]
    assert checks.probe_rows(2048) == sw["probe_rows"]
    positions = sum(len({0, b // 2, b - 1}) for b in sw["batch_sizes"])
    assert 3 * 8 * (positions + 1) == sw["comparisons"]          # 3 seeds, 8 probes, + the reversed pool
    for op, subs in (("timestep_mlp", 2060), ("timestep_sinusoid", 2060), ("final_adaln_out", 2124)):
        p = PROBLEMS[op]
        assert 2 * sum(len(checks.sub_batches(p.full_batch, s)) for s in p.sub_batch_sizes) == subs


@pytest.mark.parametrize("path", SEEDS, ids=lambda p: p.name)
def test_seed_reports_load_with_our_reader(path):
    rep = report.load_report(path)
    assert report.candidates(rep)
    assert report.summary_markdown(rep).startswith(f"# {rep['op']}")


def test_reader_rejects_broken_reports():
    rep = json.loads(SEEDS[0].read_text())
    cand = next(iter(next(iter(rep["results"].values())).values()))
    cand["batch_invariance"]["batch_invariant"] = "yes"
    del rep["environment"]["tf32"]
    errors = report.validate_report(rep)
    assert any("batch_invariant" in e for e in errors) and any("tf32" in e for e in errors)


def test_row_layout_and_problem_table():
    tags, ti = row_layout(100, 3)
    assert tags[:3].tolist() == [0, 1, 2] and set(tags.tolist()) <= {0, 1, 2} and set(ti.tolist()) <= {0, 1, 2}
    assert torch.equal(row_layout(100, 3)[1], ti) and not torch.equal(row_layout(100, 4)[1], ti)
    for op in ("timestep_sinusoid", "timestep_mlp", "final_adaln_out", "adaln_row_gather", "norm_modulate",
               "gate_residual", "gate_residual_norm_modulate"):
        p = PROBLEMS[op]
        inputs = p.draw(6, 3, CPU)
        assert tuple(inputs) == p.args
        sub = take_rows(p, inputs, torch.tensor([5, 0]))
        for a in p.args:
            if a in p.row_args:
                assert sub[a].shape[0] == 2 and torch.equal(sub[a][1], inputs[a][0])
            else:
                assert sub[a] is inputs[a]
    t = PROBLEMS["timestep_sinusoid"].draw(1000, 3, CPU)["t"]
    assert 0 <= t.min() and t.max() <= 1
    idx = PROBLEMS["norm_modulate"].draw(50, 3, CPU)["adaln_indices"]
    assert idx.dtype == torch.int64 and 0 <= idx.min() and idx.max() < 9


def _toy_report(tmp_path):
    part = prior_art.run_mode(TOY, "plain", TINY, CPU, cands=[ROWWISE, BATCH_MEAN])
    return prior_art.merge("toy_scale", [part], quick=True)


def test_custom_problem_report_is_schema_valid(tmp_path):
    rep = _toy_report(tmp_path)
    assert report.validate_report(rep) == []
    res = rep["results"]["plain"]
    assert res["rowwise"]["batch_invariance"]["batch_invariant"] is True
    assert res["batch_mean"]["batch_invariance"]["batch_invariant"] is False
    e = res["rowwise"]["accuracy_latency"]["4"]
    assert e["fwd_rel_err"] is None                      # no FP64 golden for a custom problem
    assert e["fwd_us"] > 0 and e["fwd_bwd_us"] > 0
    assert e["fwd_kernel_us"] is None and "CUDA" in e["kernel_us_unavailable"]["fwd"]
    assert rep["floors"]["4"]["bytes_fwd"] == (4 * 4 + 4 + 4 + 4 * 4) * 4


def test_sinusoid_cpu_report_and_outputs(tmp_path):
    part = prior_art.run_mode(PROBLEMS["timestep_sinusoid"], "plain", TINY, CPU)
    rep = prior_art.merge("timestep_sinusoid", [part], quick=True)
    assert report.validate_report(rep) == []
    res = rep["results"]["plain"]
    assert res["diffusers"]["batch_invariance"]["batch_invariant"] is True
    assert 0 <= res["diffusers"]["accuracy_latency"]["4"]["fwd_rel_err"] < 1e-6
    assert res["torch_bare_op"]["accuracy_latency"]["1"]["fwd_rel_err"] is None
    assert "unavailable" in res["sglang"]
    written = prior_art.write_outputs(rep, tmp_path / "sin.json", log=lambda m: None)
    assert report.load_report(tmp_path / "sin.json")["op"] == "timestep_sinusoid"
    md = (tmp_path / "sin.md").read_text()
    assert "| `diffusers` | ok | – | ok | ok | yes |" in md
    pytest.importorskip("matplotlib")
    assert {p.name for p in written} >= {"sin_latency.png", "sin_invariance.png"}


def test_compare_on_a_seed_file(tmp_path, capsys):
    seed = next(p for p in SEEDS if "timestep_sinusoid" in p.name)
    rep = _toy_report(tmp_path)
    rep["op"] = "timestep_sinusoid"
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps(rep))
    assert main(["compare", str(seed), str(ours), "--labels", "B200", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| `rl_kernel` | yes | – |" in out and "| `batch_mean` | – | **NO** |" in out
    assert "fwd_us B200" in out


def test_modes_and_candidates():
    assert [c.name for c in candidates_for(PROBLEMS["timestep_mlp"], "vllm")] == [
        "diffusers[vllm]", "diffusers_module[vllm]"]
    names = [c.name for c in candidates_for(PROBLEMS["gate_residual"], "plain")]
    assert names[:3] == ["h3cute", "diffusers", "diffusers_module"] and "torch_bare_op" not in names
    assert "h3cute_two_ops" not in names
    fused = {c.name: c for c in candidates_for(PROBLEMS["gate_residual_norm_modulate"], "plain")}
    assert list(fused)[:4] == ["h3cute", "diffusers", "diffusers_module", "h3cute_two_ops"]
    assert fused["diffusers"].fn is R.gate_residual_norm_modulate_replay


def test_fused_op_cpu_report_has_its_baseline_and_the_two_ops(tmp_path):
    """`prior-art --op gate_residual_norm_modulate`'s mode run on CPU at smoke scale: the op, the diffusers replay
    and the two h3cute ops are judged and all three give the replay's bits."""
    problem = PROBLEMS["gate_residual_norm_modulate"]
    plan = TINY.with_overrides(dict(all_rows_sizes=[3], accuracy_sizes=[3], full_batch=8, sub_batch_sizes=[1, 7],
                                    sweep_pool=5))
    part = prior_art.run_mode(problem, "plain", plan, CPU)
    rep = prior_art.merge(problem.op, [part], quick=True)
    assert report.validate_report(rep) == []
    res = rep["results"]["plain"]
    for name in ("h3cute", "diffusers", "h3cute_two_ops"):
        assert res[name]["batch_invariance"]["batch_invariant"] is True, name
        e = res[name]["accuracy_latency"]["3"]
        assert 0 < e["fwd_rel_err"] < 8e-3 and set(e["grad_rel_err"]) == {"residual", "y", "gate", "w", "shift",
                                                                         "scale"}
    assert "unavailable" in res["diffusers_module"]
    inputs = problem.draw(3, 0, CPU)
    args = [inputs[a] for a in problem.args]
    outs = [checks._as_list(c.fn(*args)) for c in candidates_for(problem, "plain")[:4] if c.fn is not None]
    assert len(outs) == 3 and all(torch.equal(u, v) for o in outs[1:] for u, v in zip(o, outs[0]))
    assert rep["floors"]["3"]["bytes_fwd"] == 4 * 3 * HIDDEN * 2 + 3 * 9 * HIDDEN * 2 + HIDDEN * 2 + 3 * 8


def test_sweep_flags_configs_that_change_bits():
    configs = [("exact", 0.0), ("same", 0.0), ("off", 1e-7)]

    def forward(x, w, b, config):
        return x * w + b + config
    res = sweep(TOY, configs, forward, TINY, CPU)
    assert res["all_invariant"] is True
    assert res["all_identical"] is False
    assert [res["configs"][n]["identical_to_first"] for n, _ in configs] == [True, True, False]
    assert sorted(res["ranking"]) == ["exact", "off", "same"] and res["failed"] == []


def test_sweep_names_configs_that_fail_and_proves_nothing_when_none_ran():
    """A config that raises (e.g. a tile that does not compile) is named as failed, the others still ranked; a sweep
    in which no config ran is neither identical nor invariant, and the command exits non-zero either way."""
    def forward(x, w, b, config):
        if config is None:
            raise RuntimeError("no kernel")
        return x * w + b + config
    res = sweep(TOY, [("exact", 0.0), ("broken", None), ("same", 0.0)], forward, TINY, CPU)
    assert res["failed"] == ["broken"] and sorted(res["ranking"]) == ["exact", "same"]
    assert res["all_identical"] is True and res["all_invariant"] is True
    assert "2 of 3 configs ran" in sweep_markdown(res) and "`broken` failed: RuntimeError: no kernel" in \
        sweep_markdown(res)
    none = sweep(TOY, [("broken", None)], forward, TINY, CPU)
    assert none["ranking"] == [] and none["all_identical"] is False and none["all_invariant"] is False


def test_cli_sweep_exits_non_zero_when_a_config_fails(tmp_path, monkeypatch):
    """On a CPU the launchers cannot run: every config fails, and the command says so by its exit status."""
    monkeypatch.setattr(prior_art, "default_device", lambda: CPU)
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--op", "timestep_mlp", "--config", "MID_T", "--out", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["failed"] == ["MID_T"] and res["all_identical"] is False


def test_cli_quick_prior_art_sinusoid_subprocess(tmp_path):
    """The whole command on CPU: mode subprocess, merge, JSON + markdown (timestep_sinusoid is cheap)."""
    out = tmp_path / "sin.json"
    proc = subprocess.run([sys.executable, "-m", "h3cute.bench", "prior-art", "--op", "timestep_sinusoid",
                           "--quick", "--out", str(out), "--plan", "all_rows_sizes=[5]", "--plan", "full_batch=64",
                           "--plan", "sub_batch_sizes=[1, 7, 32]", "--plan", "sweep_pool=32",
                           "--plan", "accuracy_sizes=[1, 4]", "--plan", "samples=3"],
                          capture_output=True, text=True, timeout=600, env=_CHILD_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = report.load_report(out)
    assert rep["quick"] is True and rep["environment"]["mode_environment"] == {"plain": {}}
    assert rep["plan_overrides"]["sweep_pool"] == 32
    sweep = rep["results"]["plain"]["diffusers"]["batch_invariance"]["batch_size_sweep"]
    assert sweep["probe_rows"][-1] == 31
    assert rep["results"]["plain"]["diffusers"]["batch_invariance"]["batch_invariant"] is True
    assert out.with_suffix(".md").exists()


# ---- device checks (the lead runs these on the H200) -------------------------------------------------

SMALL_GPU = checks.Plan(all_rows_sizes=(64,), all_rows_seeds=(3,), sub_seeds=(3,), full_batch=4096,
                        sub_batch_sizes=(1, 7, 1024), sweep_pool=256, sweep_seeds=(3,), accuracy_sizes=(1, 64),
                        warmup=3, samples=10, inductor_modes=())   # torch.compile peers: tests/test_peers.py


@pytest.mark.gpu
def test_gpu_planted_controls_on_cuda():
    cuda = torch.device("cuda")
    assert checks.batch_invariance(ROWWISE, TOY, SMALL_GPU, cuda)["batch_invariant"] is True
    bi = checks.batch_invariance(BATCH_MEAN, TOY, SMALL_GPU, cuda)
    assert bi["batch_invariant"] is False and bi["batch_size_sweep"]["first_failures"][0]["batch"] == 2


@pytest.mark.gpu
def test_gpu_sinusoid_run_mode_fills_every_field():
    cuda = torch.device("cuda")
    part = prior_art.run_mode(PROBLEMS["timestep_sinusoid"], "plain", SMALL_GPU, cuda)
    rep = prior_art.merge("timestep_sinusoid", [part], quick=True)
    assert report.validate_report(rep) == []
    env = rep["environment"]
    assert env["gpu"] and env["timer"] == "cuda_event" and env["tf32"] is False
    ceil = env["ceilings"]
    assert ceil["copy_bytes_per_s"] > 1e11 and ceil["bf16_flops_per_s"] > ceil["fp32_flops_per_s"] > 1e12
    res = rep["results"]["plain"]
    for name in ("diffusers", "torch_bare_op"):
        e = res[name]["accuracy_latency"]["64"]
        assert e["fwd_us"] > 0 and e["fwd_kernel_us"] is not None and e["fwd_kernel_us"] <= e["fwd_us"]
        assert res[name]["batch_invariance"]["batch_invariant"] is True
    assert res["diffusers"]["accuracy_latency"]["64"]["fwd_rel_err"] < 1e-6
    h3 = res["h3cute"]
    assert "unavailable" in h3 or h3["batch_invariance"]["batch_invariant"] is True
    assert rep["floors"]["64"]["fwd_memory_us"] > 0


@pytest.mark.gpu
def test_gpu_modes_run_in_their_own_processes(tmp_path):
    """timestep_mlp: a subprocess per mode, merged; the vllm mode's environment is recorded; under SGLang's and
    Megatron's Triton modes (where perf/stage_peers.sh's files are carried; otherwise recorded unavailable) the
    replay is batch-invariant, TF32-accurate (~1e-3) without `_ieee` and FP32-accurate with it."""
    out = tmp_path / "mlp.json"
    proc = subprocess.run([sys.executable, "-m", "h3cute.bench", "prior-art", "--op", "timestep_mlp", "--quick",
                           "--out", str(out), "--plan", "all_rows_sizes=[64]", "--plan", "sweep_pool=128",
                           "--plan", "full_batch=512", "--plan", "sub_batch_sizes=[1, 7, 128]",
                           "--plan", "accuracy_sizes=[1, 64]", "--plan", "inductor_modes=[]"],
                          capture_output=True, text=True, timeout=600, env=_CHILD_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = report.load_report(out)
    assert list(rep["results"]) == modes_for(PROBLEMS["timestep_mlp"])
    assert rep["environment"]["mode_environment"]["vllm"]["CUBLASLT_WORKSPACE_SIZE"] == "1"
    for mode in ("plain", "vllm"):
        d = rep["results"][mode][f"diffusers[{mode}]"]
        assert d["accuracy_latency"]["64"]["fwd_rel_err"] < 1e-5
        assert set(d["accuracy_latency"]["64"]["grad_rel_err"]) == {"x", "w1", "b1", "w2", "b2"}
    staged = rep["environment"]["peer_files"]
    for mode in ("sglang", "sglang_ieee", "megatron_triton", "megatron_triton_ieee"):
        d = rep["results"][mode][f"diffusers[{mode}]"]
        if staged["sglang" if mode.startswith("sglang") else "megatron-core"] is None:
            assert d["unavailable"].startswith(f"mode {mode}: "), d
            continue
        assert "unavailable" not in d, d["unavailable"]
        assert d["batch_invariance"]["batch_invariant"] is True
        err = d["accuracy_latency"]["64"]["fwd_rel_err"]
        assert (err < 2e-5) if mode.endswith("_ieee") else (1e-4 < err < 1e-2), (mode, err)


def test_accuracy_of_a_bf16_s_op_against_the_fp64_golden():
    """gate_residual replay: the upstream gradient is BF16 for the candidate and the same values in FP64."""
    p = PROBLEMS["gate_residual"]
    plan = checks.Plan(accuracy_sizes=(5,), warmup=0, samples=1, graphs=False)
    cand = next(c for c in candidates_for(p, "plain") if c.name == "diffusers")
    e = checks.accuracy_latency(cand, p, plan, CPU, checks.Reference(p, CPU))["5"]
    assert 0 < e["fwd_rel_err"] < 2 ** -7
    assert set(e["grad_rel_err"]) == {"residual", "y", "gate"}
    assert e["grad_rel_err"]["residual"] == 0.0          # d residual is the upstream itself, exactly
    assert all(v < 2 ** -7 for v in e["grad_rel_err"].values())


def test_broken_candidates_are_recorded_and_the_run_goes_on():
    def breaks_at_four(x, w, b):
        if x.shape[0] == 4:
            raise RuntimeError("four rows")
        return x * w + b
    missing = Candidate("missing", "not built", unavailable="NotImplementedError: not built yet")
    broken = Candidate("broken", "raises at 4 rows", breaks_at_four)
    part = prior_art.run_mode(TOY, "plain", TINY, CPU, cands=[missing, broken, ROWWISE])
    res = part["results"]["plain"]
    assert res["missing"] == {"source": "not built", "unavailable": "NotImplementedError: not built yet"}
    assert res["broken"]["unavailable"] == "failed during checks: RuntimeError: four rows"
    assert res["rowwise"]["batch_invariance"]["batch_invariant"] is True
    assert report.validate_report(prior_art.merge("toy_scale", [part], quick=True)) == []


def test_cpu_runs_the_method_at_smoke_scale_and_gpu_at_the_seeds():
    """Without a GPU the command shrinks the sizes (the H3 weights stay full size); on a GPU the plan is untouched."""
    mlp, norm = PROBLEMS["timestep_mlp"], PROBLEMS["norm_modulate"]
    cpu_mlp = checks.plan_for_device(checks.QUICK, CPU, mlp)
    assert cpu_mlp.accuracy_sizes == (4,) and cpu_mlp.full_batch == 3 and not cpu_mlp.graphs
    assert checks.plan_for_device(checks.QUICK, CPU, norm).accuracy_sizes == (257,)
    assert checks.plan_for_device(checks.FULL, torch.device("cuda"), norm) is checks.FULL


def test_report_commit_prefers_the_declared_snapshot(monkeypatch):
    # A snapshot run elsewhere declares its commit; git beside the package is read only without it.
    from h3cute.bench import report

    monkeypatch.setenv("H3CUTE_COMMIT", "abc1234")
    monkeypatch.setenv("H3CUTE_TREE_DIRTY", "0")
    assert report.h3cute_commit() == {"commit": "abc1234", "tree_dirty": False}
    monkeypatch.delenv("H3CUTE_COMMIT")
    found = report.h3cute_commit()
    assert set(found) == {"commit", "tree_dirty"} and found["commit"] != "abc1234"


def test_device_json_goes_where_the_device_run_collects_it(tmp_path, monkeypatch):
    from h3cute.bench.report import write_device_json

    monkeypatch.setenv("H3CUTE_OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    assert write_device_json({"a": 1}, "x.json") == str(tmp_path / "out" / "x.json")
    assert json.loads((tmp_path / "out" / "x.json").read_text()) == {"a": 1}
    explicit = str(tmp_path / "y.json")
    assert write_device_json({"b": 2}, "x.json", explicit) == explicit and json.loads(open(explicit).read()) == {"b": 2}


@pytest.mark.parametrize("script", sorted(p.relative_to(Path(__file__).parents[1] / "perf").as_posix()
                                          for p in (Path(__file__).parents[1] / "perf").rglob("*.py")))
def test_perf_scripts_import(script):
    """The device scripts run only on the GPU machine; here their imports resolve (each has a __main__ guard)."""
    code = f"import runpy; runpy.run_path({str(Path(__file__).parents[1] / 'perf' / script)!r}, run_name='imported')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_adaln_kernels_rounds_time_every_step_in_turn():
    """perf/adaln_kernels.py --rounds: every launch is timed once per pass over the whole step list (round-robin, so
    a slow spell hits every config alike), reported as the median of the passes with their range; a missing kernel
    is recorded as missing, never timed. Its arguments: sizes, repeatable --family, --rounds >= 1, --out-features
    (one of the two tables)."""
    import runpy

    mod = runpy.run_path(str(Path(__file__).parents[1] / "perf" / "adaln_kernels.py"), run_name="imported")
    calls = []
    steps = [("fwd", "proj_fwd", "c1", "step", 2e6, 4e9, lambda tag: calls.append(tag), ("a",)),
             ("fwd", "proj_fwd", "c2", "alt", 2e6, 4e9, lambda tag: calls.append(tag), ("b",)),
             ("bwd", "bias_grad", "", "step", 1.0, 0, KeyError("not in this bundle"), ())]
    times = iter([10.0, 20.0, 30.0, 12.0, 11.0, 25.0])

    def measure(fn):
        fn()
        return next(times)

    records = mod["_time_rounds"](steps, measure, 3)
    assert calls == ["a", "b"] * 3
    a, b, missing = records
    assert (a["us"], a["us_min"], a["us_max"], a["rounds"]) == (11.0, 10.0, 30.0, 3) and a["kind"] == "step"
    assert (b["us"], b["us_min"], b["us_max"]) == (20.0, 12.0, 25.0) and b["config"] == "c2"
    assert a["gbps"] == pytest.approx(2e6 / 11.0 * 1e-3) and a["tflops"] == pytest.approx(4e9 / 11.0 * 1e-6)
    assert "us" not in missing and missing["missing"].startswith("KeyError")
    args = mod["_args"](["256", "2048", "--family", "wgmma", "--family", "warp", "--rounds", "3"])
    assert args.sizes == [256, 2048] and args.family == ["wgmma", "warp"] and args.rounds == 3
    defaults = mod["_args"]([])
    assert defaults.sizes == [] and defaults.family is None and defaults.rounds == 1
    assert defaults.out_features == BLOCK_PROJECTION
    assert mod["_args"](["--out-features", str(FINAL_PROJECTION)]).out_features == FINAL_PROJECTION
    for bad in (["--rounds", "0"], ["--out-features", "1000"]):
        with pytest.raises(SystemExit):
            mod["_args"](bad)


def test_host_trace_kernel_timeline_counts_overlaps_and_gaps():
    """perf/host_trace.py: a replay's kernels in start order, each with the gap to the previous kernel's end (negative
    when PDL overlaps them), and the span / busy / gap totals; a call's kernels are the ones its launches correlate
    with, and its calls the `label#i` annotations."""
    import runpy

    mod = runpy.run_path(str(Path(__file__).parents[1] / "perf" / "host_trace.py"), run_name="imported")
    kernels = [{"cat": "kernel", "name": "fold", "ts": 130.0, "dur": 5.0, "args": {"correlation": 3}},
               {"cat": "kernel", "name": "fc1", "ts": 100.0, "dur": 10.0, "args": {"correlation": 1}},
               {"cat": "kernel", "name": "fc2", "ts": 105.0, "dur": 10.0, "args": {"correlation": 2}}]
    lines = mod["_kernel_lines"](sorted(kernels, key=lambda k: k["ts"]))
    gaps = [line.split()[2] for line in lines[1:3]]
    assert gaps == ["-5.00", "15.00"] and lines[0].split()[-1] == "fc1"
    assert lines[-1].strip() == "span 35.00 us, kernels 25.00 us, gaps 10.00 us, 3 kernels"
    picked = mod["_kernels_between"](kernels, 0, 0, {1, 3})
    assert [k["name"] for k in picked] == ["fc1", "fold"]
    assert [k["name"] for k in mod["_kernels_between"](kernels, 104, 131)] == ["fc2", "fold"]
    marks = [{"cat": "user_annotation", "name": "op#1", "ts": 50.0},
             {"cat": "user_annotation", "name": "op#0", "ts": 10.0},
             {"cat": "user_annotation", "name": "other#0", "ts": 5.0}, {"cat": "cpu_op", "name": "op#2", "ts": 1.0}]
    assert [m["name"] for m in mod["_calls"](marks, "op")] == ["op#0", "op#1"]
    assert mod["_kernel_lines"]([]) == ["    (no kernels recorded)"]


def test_clock_probe_parses_nvidia_smi_samples():
    """perf/clock_probe.py: each `--format=csv,noheader,nounits` line is (MHz, W, C, reasons); "[N/A]" fields and a
    line cut off when the sampler is stopped are dropped, not read as zeros."""
    import runpy

    mod = runpy.run_path(str(Path(__file__).parents[1] / "perf" / "clock_probe.py"), run_name="imported")
    text = "1980, 450.12, 41, 0x0000000000000000\n1755, 699.80, 55, 0x0000000000000004\n" \
           "[N/A], 690.1, 55, 0x4\n1740, 70"
    assert mod["parse_samples"](text) == [(1980.0, 450.12, 41.0, "0x0000000000000000"),
                                          (1755.0, 699.8, 55.0, "0x0000000000000004")]
    assert mod["parse_samples"]("") == []


def test_device_timer_on_cpu_is_wall_time_and_graph_time_says_why():
    assert timing.device_timer("cpu", 1, 3)(lambda: sum(range(100))) > 0
    assert timing.graph_time(lambda: None, "cpu", 1, 3) == (None, "CUDA graphs need a CUDA device")


def test_device_timer_lengthens_the_spin_until_the_host_keeps_up(monkeypatch):
    """While the host takes longer to queue a sample than the spin lasts, the spin doubles and every sample is
    retaken; the figure is the median of the samples of the first pass the host kept up with."""
    clock = {"now": 0.0}
    spins, passes = [], []

    class Event:
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            self.t = clock["now"]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3  # ms, from the fake clock in s

    host_s = 150e-6  # the host queues each sample in 150 us; the call itself takes 20 us of "device time"

    def call():
        clock["now"] += 20e-6

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: spins.append(cycles))
    monkeypatch.setattr(timing, "_spin_us", lambda cycles, device: passes.append(cycles) or cycles / 2000.0)
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks) * host_s)
    us = timing.device_timer("cuda", 2, 5)(call)
    # 200k cycles spin 100 us < 150 us of host time: doubled once (200 us), then kept.
    assert passes == [timing.SPIN_CYCLES, 2 * timing.SPIN_CYCLES]
    assert spins == [timing.SPIN_CYCLES] * 7 + [2 * timing.SPIN_CYCLES] * 7
    assert us == pytest.approx(20.0)


@pytest.mark.gpu
def test_gpu_graph_time_is_the_device_time_of_the_replay():
    """A graph of one spin: its replay times as the spin alone does (the host's replay cost is not in it)."""
    cycles = 2_000_000
    spin = timing._spin_us(cycles, torch.device("cuda"))
    us, why = timing.graph_time(lambda: torch.cuda._sleep(cycles), "cuda", 3, 10)
    assert why is None and spin * 0.9 < us < spin * 1.1 + 10, (us, spin)


def test_sweep_names_configs_by_short_names():
    """The sweep's rows are named by short names: the launcher's module-level names (timestep_mlp), the AdaLN
    projection's config names (the forward candidates of the device's family, sm_90a's on a CPU, picks first)."""
    from h3cute.kernels._adaln_configs import candidates
    from h3cute.bench.sweep import op_configs

    _, mlp = op_configs("timestep_mlp")
    assert [n for n, _ in mlp][:4] == ["SMALL_T", "WIDE_T", "MID_T", "LARGE_T"]
    assert all(len(n) <= 16 for n, _ in mlp)
    _, proj = op_configs("adaln_projection", CPU)
    assert sorted(n for n, _ in proj) == sorted(candidates("fwd", "wgmma")) == sorted(c for _, c in proj)
    assert "tma_persist_m256" in dict(proj) and "skinny" not in dict(proj)


def test_sweep_selects_named_configs_and_command_line_configs_after_the_picks():
    """`--config` names declared configs; a text the op does not declare goes to the launcher's `sweep_config`
    (adaln_projection, timestep_mlp: field overrides of a named config), and then the shipped picks run first, so the
    new config's bits are compared with theirs; an op without `sweep_config` refuses it."""
    from h3cute.bench.sweep import op_configs, select_configs
    from h3cute.launch import adaln_projection

    mod, configs = op_configs("adaln_projection", CPU)
    assert select_configs(mod, configs, None, CPU) == configs
    assert select_configs(mod, configs, ["tma_mid"], CPU) == [("tma_mid", "tma_mid")]
    got = select_configs(mod, configs, ["tma_mid", "tma_wide:stages=4"], CPU)
    picks = adaln_projection.sweep_picks(CPU)
    assert [n for n, _ in got] == [*picks, "tma_mid", "tma_wide:stages=4"]
    with pytest.raises(ValueError, match="not a named config"):
        select_configs(mod, configs, ["huge:stages=4"], CPU)
    mlp, mlp_configs = op_configs("timestep_mlp")
    assert select_configs(mlp, mlp_configs, ["WIDE_T"], CPU) == [("WIDE_T", mlp.WIDE_T)]
    got = select_configs(mlp, mlp_configs, ["MID_T:fc2.stages=5"], CPU)
    assert got == [*((n, getattr(mlp, n)) for n in mlp.sweep_picks(CPU)),
                   ("MID_T:fc2.stages=5", mlp.parse_config("MID_T:fc2.stages=5"))]
    with pytest.raises(ValueError, match="not a named config"):
        select_configs(mlp, mlp_configs, ["HUGE_T:stages=4"], CPU)
    without = types.SimpleNamespace(**{k: v for k, v in vars(mlp).items() if k != "sweep_config"})
    with pytest.raises(ValueError, match="unknown configs"):
        select_configs(without, mlp_configs, ["SMALL_T:stages=4"], CPU)
