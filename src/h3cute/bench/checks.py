"""Batch-invariance, accuracy and latency checks of one candidate, exactly as the seed reports judge.

Batch invariance (every comparison bitwise, `torch.equal`, forward outputs and per-row input gradients
under a fixed random upstream gradient per seed; a batch is a row selection of a seeded pool):

- `all_rows`: pools of 64, 257, 2048 rows (seeds 3, 4, 5); every row alone vs in the full pool.
- `params_repeatable`: parameter gradients of every full pool recomputed, bitwise (null when the op
  or the candidate has none).
- `full_vs_sub_batches`: one large pool (seeds 3, 4) vs contiguous sub-batches of each size, starting
  every max(size, full // 512) rows, the last one cut at the pool's end; counts differing sub-batches.
- `batch_size_sweep`: eight probe rows (0, n-1, and i*(n//8)+3 for i = 1..6) of a 2048-row pool, each
  at the front, middle and back of a random batch of every size 1..9 and 2^k-1, 2^k, 2^k+1 up to the
  pool size (other rows drawn per size from a CPU generator), plus the whole pool reversed; compared
  with the probe computed alone. `first_failures` keeps the first eight {seed, batch, position, row}.

Accuracy: `max|out - ref| / max|ref|` against `h3cute.reference.<op>_fp64` (inputs upcast to FP64,
upstream gradient `randn` from a generator seeded 9, global modes off). In the plain mode each candidate's
forward is also compared bit for bit with the diffusers replay's on the same inputs (`fwd_bits_vs_diffusers`:
equal, and the fraction of elements whose bits differ). Latency: median of
`samples` timed calls after `warmup` calls; each sample is one whole call from Python (fwd_bwd: fresh
leaves, backward with all-ones upstream). On CUDA samples are CUDA-event times; on a CPU-only machine
(CI) they are `time.perf_counter` wall times and the report's `environment.timer` says so. Kernel-only
times replay a captured CUDA graph of one call under `timing.device_timer` (a spin kernel holds the GPU while
the host queues each sample, so they are device time: replay and kernels, not the host's launch cost; null
with the reason where capture fails).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from h3cute.bench import timing
from h3cute.bench.candidates import Candidate, modes_off
from h3cute.bench.problems import Problem, take_rows

ACCURACY_SEED = 0
UPSTREAM_SEED = 9


@dataclass(frozen=True)
class Plan:
    """How much of the method to run; `FULL` is the seeds' method, `QUICK` a smoke run."""
    all_rows_sizes: tuple[int, ...] = (64, 257, 2048)
    all_rows_seeds: tuple[int, ...] = (3, 4, 5)
    sub_seeds: tuple[int, ...] = (3, 4)
    full_batch: int | None = None            # None: the problem's own
    sub_batch_sizes: tuple[int, ...] | None = None
    sweep_pool: int = 2048
    sweep_seeds: tuple[int, ...] = (3, 4, 5)
    accuracy_sizes: tuple[int, ...] | None = None
    warmup: int = 20
    samples: int = 100
    max_failures: int = 8
    graphs: bool = True
    # torch.compile peers (h3cute.bench.peers): their modes, dynamic rows or a graph per row count, and the
    # compile seconds after which a compiled candidate stops and says so
    inductor_modes: tuple[str, ...] = ("default", "max-autotune-no-cudagraphs")
    inductor_dynamic: bool = True
    inductor_compile_budget_s: float = 90.0
    inductor_on_cpu: bool = False

    def for_problem(self, problem: Problem) -> "Plan":
        return replace(
            self,
            full_batch=self.full_batch or problem.full_batch,
            sub_batch_sizes=self.sub_batch_sizes or problem.sub_batch_sizes,
            accuracy_sizes=self.accuracy_sizes or problem.accuracy_sizes,
        )


    def with_overrides(self, overrides: dict) -> "Plan":
        """This plan with fields replaced (lists become tuples), e.g. from `--plan sweep_pool=256`."""
        return replace(self, **{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})


FULL = Plan()
QUICK = Plan(all_rows_sizes=(64, 257), all_rows_seeds=(3,), sub_seeds=(3,), sweep_pool=512,
             sweep_seeds=(3,), warmup=5, samples=30)
# Where there is no GPU the same four checks run at smoke scale, so that the whole command finishes on a
# 2-core machine in minutes: a few rows per batch (the H3 widths stay, except where the problem's
# `smoke_draw` narrows them), one accuracy size. CPU timings are wall times, not measurements.
CPU_SMOKE = Plan(all_rows_sizes=(2,), all_rows_seeds=(3,), sub_seeds=(3,), full_batch=3,
                 sub_batch_sizes=(1, 2), sweep_pool=3, sweep_seeds=(3,), warmup=1, samples=1,
                 graphs=False)


def plan_for_device(plan: Plan, device: torch.device, problem: Problem) -> Plan:
    """`plan` on a GPU; `CPU_SMOKE` on a CPU, with one accuracy size of the op (4 rows, or 257 for an S-op)."""
    if device.type != "cpu":
        return plan
    sizes = tuple(n for n in problem.accuracy_sizes if n == 4) or (257,)
    return replace(CPU_SMOKE, accuracy_sizes=sizes)


# ---- running a candidate -------------------------------------------------------------------------

def _as_list(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def run(cand: Candidate, problem: Problem, inputs: dict, upstream: list | None):
    """Forward (and, given an upstream gradient, backward). Returns (outputs, {arg: gradient})."""
    want = upstream is not None and cand.has_backward and problem.has_backward
    grad_args = problem.row_grads + problem.param_grads if want else ()
    leaves = {n: inputs[n].detach().requires_grad_(True) for n in grad_args}
    args = [leaves.get(n, inputs[n]) for n in problem.args]
    with torch.set_grad_enabled(want):
        outs = _as_list(cand.fn(*args))
    grads = {}
    if want:
        gs = torch.autograd.grad(outs, list(leaves.values()), upstream[: len(outs)], allow_unused=True)
        grads = {n: g if g is not None else torch.zeros_like(leaves[n]) for n, g in zip(leaves, gs)}
    return [o.detach() for o in outs], grads


def upstream_like(outs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=outs[0].device)
    g.manual_seed(seed)
    return [torch.randn(o.shape, generator=g, device=o.device).to(o.dtype) for o in outs]


def _pool(cand: Candidate, problem: Problem, n: int, seed: int, device):
    """A seeded pool, its fixed upstream gradient, and the candidate's outputs/gradients on all of it."""
    inputs = problem.draw(n, seed, device)
    shapes, _ = run(cand, problem, inputs, None)
    up = upstream_like(shapes, seed * 1000 + 999)
    outs, grads = run(cand, problem, inputs, up)
    return inputs, up, outs, grads


def _rows_equal(problem, outs, grads, ref_outs, ref_grads, at, ref_at):
    """(forward equal, row gradients equal) of batch rows `at` vs reference rows `ref_at`."""
    fwd = all(torch.equal(o[at], r[ref_at]) for o, r in zip(outs, ref_outs))
    rg = all(torch.equal(grads[n][at], ref_grads[n][ref_at]) for n in problem.row_grads if n in grads)
    return fwd, rg


def _params_equal(problem, a: dict, b: dict) -> bool:
    return all(torch.equal(a[n], b[n]) for n in problem.param_grads if n in a)


# ---- batch invariance ----------------------------------------------------------------------------

def sweep_sizes(pool: int) -> list[int]:
    sizes = [b for b in range(1, 10) if b <= pool]
    k = 4
    while 2 ** k - 1 <= pool:
        sizes += [b for b in (2 ** k - 1, 2 ** k, 2 ** k + 1) if b <= pool]
        k += 1
    return sizes


def sub_batches(full: int, size: int) -> list[tuple[int, int]]:
    """(start, stop) of the sub-batches of one size: every max(size, full // 512) rows, cut at the end."""
    return [(start, min(start + size, full)) for start in range(0, full, max(size, full // 512))]


def probe_rows(pool: int) -> list[int]:
    return sorted({0, pool - 1, *(min(i * (pool // 8) + 3, pool - 1) for i in range(1, 7))})


def batch_invariance(cand: Candidate, problem: Problem, plan: Plan, device, log=None) -> dict:
    plan = plan.for_problem(problem)
    log = log or (lambda msg: None)
    with_params = cand.has_backward and bool(problem.param_grads)
    repeatable = True

    log("all_rows")
    all_rows = {}
    for n in plan.all_rows_sizes:
        fwd_d = rg_d = 0
        for seed in plan.all_rows_seeds:
            inputs, up, outs, grads = _pool(cand, problem, n, seed, device)
            if with_params:
                repeatable &= _params_equal(problem, grads, run(cand, problem, inputs, up)[1])
            for i in range(n):
                rows = torch.tensor([i])
                o, g = run(cand, problem, take_rows(problem, inputs, rows), [u[i:i + 1] for u in up])
                f, r = _rows_equal(problem, o, g, outs, grads, 0, i)
                fwd_d += not f
                rg_d += not r
        all_rows[str(n)] = {"rows": n * len(plan.all_rows_seeds), "fwd_differ": fwd_d, "rowgrad_differ": rg_d}

    log("full_vs_sub_batches")
    full = plan.full_batch
    subs = fwd_d = rg_d = 0
    for seed in plan.sub_seeds:
        inputs, up, outs, grads = _pool(cand, problem, full, seed, device)
        if with_params:
            repeatable &= _params_equal(problem, grads, run(cand, problem, inputs, up)[1])
        for size in plan.sub_batch_sizes:
            for start, stop in sub_batches(full, size):
                rows = torch.arange(start, stop)
                o, g = run(cand, problem, take_rows(problem, inputs, rows), [u[start:stop] for u in up])
                f, r = _rows_equal(problem, o, g, outs, grads, slice(None), slice(start, stop))
                subs += 1
                fwd_d += not f
                rg_d += not r
    full_vs_sub = {"full_batch": full, "sub_batch_sizes": list(plan.sub_batch_sizes), "sub_batches": subs,
                   "fwd_differ": fwd_d, "rowgrad_differ": rg_d}

    log("batch_size_sweep")
    sweep = _batch_size_sweep(cand, problem, plan, device)

    params_repeatable = repeatable if with_params else None
    invariant = (all(v["fwd_differ"] == 0 and v["rowgrad_differ"] == 0 for v in all_rows.values())
                 and params_repeatable is not False
                 and full_vs_sub["fwd_differ"] == 0 and full_vs_sub["rowgrad_differ"] == 0
                 and sweep["differ"] == 0)
    return {"all_rows": all_rows, "params_repeatable": params_repeatable,
            "full_vs_sub_batches": full_vs_sub, "batch_size_sweep": sweep, "batch_invariant": invariant}


def _batch_size_sweep(cand, problem, plan, device) -> dict:
    pool = plan.sweep_pool
    sizes, probes = sweep_sizes(pool), probe_rows(pool)
    comparisons = differ = 0
    failures = []

    def judge(seed, batch, position, row, o, g, ref):
        nonlocal comparisons, differ
        f, r = _rows_equal(problem, o, g, ref[0], ref[1], position, 0)
        comparisons += 1
        if not (f and r):
            differ += 1
            if len(failures) < plan.max_failures:
                failures.append({"seed": seed, "batch": batch, "position": position, "row": row})

    for seed in plan.sweep_seeds:
        inputs, up, _, _ = _pool(cand, problem, pool, seed, device)
        alone = {r: run(cand, problem, take_rows(problem, inputs, torch.tensor([r])), [u[r:r + 1] for u in up])
                 for r in probes}
        for batch in sizes:
            others = torch.randint(0, pool, (batch,), generator=torch.Generator().manual_seed(seed * 1000 + batch))
            for row in probes:
                for position in sorted({0, batch // 2, batch - 1}):
                    rows = others.clone()
                    rows[position] = row
                    o, g = run(cand, problem, take_rows(problem, inputs, rows), [u[rows.to(u.device)] for u in up])
                    judge(seed, batch, position, row, o, g, alone[row])
        rows = torch.arange(pool - 1, -1, -1)
        o, g = run(cand, problem, take_rows(problem, inputs, rows), [u.flip(0) for u in up])
        for row in probes:
            judge(seed, pool, pool - 1 - row, row, o, g, alone[row])
    return {"batch_sizes": sizes, "probe_rows": probes, "comparisons": comparisons, "differ": differ,
            "first_failures": failures}


# ---- accuracy and latency ------------------------------------------------------------------------

def rel_err(out: torch.Tensor | list, ref: torch.Tensor | list) -> float:
    outs, refs = _as_list(out), _as_list(ref)
    num = max((o.double() - r.double()).abs().max().item() if o.numel() else 0.0 for o, r in zip(outs, refs))
    den = max(r.abs().max().item() if r.numel() else 0.0 for r in refs)
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


class Reference:
    """FP64 goldens per accuracy size, computed once and shared by all candidates of a mode; with
    `replay_bits`, also the diffusers replay's forward on the same inputs, for the bitwise comparison."""

    def __init__(self, problem: Problem, device, replay_bits: bool = False):
        self.problem, self.device, self.cache = problem, device, {}
        self.replay, self.replay_cache = None, {}
        try:
            from h3cute import reference
            self.fn = getattr(reference, f"{problem.op}_fp64")
            self.missing = None
            if replay_bits:
                self.replay = getattr(reference, f"{problem.op}_replay", None)
        except Exception as e:
            self.fn, self.missing = None, f"{type(e).__name__}: {e}"

    def replay_at(self, n: int) -> list[torch.Tensor] | None:
        """The diffusers replay's forward outputs on the accuracy inputs of size n (None: not compared)."""
        if self.replay is None or self.fn is None:
            return None
        if n not in self.replay_cache:
            inputs = self.at(n)[0]
            with torch.no_grad():
                self.replay_cache = {n: _as_list(self.replay(*[inputs[a] for a in self.problem.args]))}
        return self.replay_cache[n]

    def clear(self) -> None:
        self.cache.clear()
        self.replay_cache.clear()

    def at(self, n: int):
        """(inputs, upstream in the op's dtypes, FP64 outputs, FP64 gradients) of an n-row batch."""
        if n not in self.cache:
            p = self.problem
            inputs = p.draw(n, ACCURACY_SEED, self.device)
            wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
            ref = Candidate("fp64", "reference", self.fn, has_backward=p.has_backward)
            with modes_off():
                outs, _ = run(ref, p, wide, None)
                # drawn in the op's output dtype so that candidates and the golden see the same values
                up = [u.to(p.out_dtype) for u in upstream_like(outs, UPSTREAM_SEED)]
                if p.has_backward:
                    outs, grads = run(ref, p, wide, [u.double() for u in up])
                else:
                    grads = {}
            self.cache = {n: (inputs, up, outs, grads)}   # one size at a time: the S-op goldens are large
        return self.cache[n]


def bits_vs(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    """{equal, differing}: whether every output's bits equal the reference's, and the fraction of elements
    whose bits differ (a NaN's bits count as they are; -0.0 differs from 0.0)."""
    differ = total = 0
    for o, r in zip(outs, refs):
        if o.shape != r.shape or o.dtype != r.dtype:
            return {"equal": False, "differing": 1.0}
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[o.element_size()]
        differ += int((o.contiguous().view(ints) != r.contiguous().view(ints)).sum())
        total += o.numel()
    return {"equal": differ == 0, "differing": differ / total if total else 0.0}


def accuracy_latency(cand: Candidate, problem: Problem, plan: Plan, device, reference: Reference,
                     sizes=None, log=None) -> dict:
    plan = plan.for_problem(problem)
    measure = timing.timer(device, plan.warmup, plan.samples)

    def kernel_us(fn):  # (device time of fn's graph replay, or None and why)
        return timing.graph_time(fn, device, plan.warmup, plan.samples)
    backward = cand.has_backward and problem.has_backward
    grad_args = problem.row_grads + problem.param_grads
    result = {}
    for n in sizes or plan.accuracy_sizes:
        (log or (lambda m: None))(f"accuracy/latency {n}")
        entry = {}
        if reference.fn is not None:
            inputs, up, ref_outs, ref_grads = reference.at(n)
        else:
            inputs, up = problem.draw(n, ACCURACY_SEED, device), None
        if not cand.comparable or reference.fn is None:
            entry["fwd_rel_err"] = None
            if backward:
                entry["grad_rel_err"] = None
        else:
            outs, grads = run(cand, problem, inputs, up if backward else None)
            entry["fwd_rel_err"] = rel_err(outs, ref_outs)
            replay_outs = reference.replay_at(n) if cand.fn is not reference.replay else None
            if replay_outs is not None:
                entry["fwd_bits_vs_diffusers"] = bits_vs(outs, replay_outs)
            if backward:
                entry["grad_rel_err"] = {problem.grad_name(a): rel_err(grads[a], ref_grads[a]) for a in grad_args}
        args = [inputs[a] for a in problem.args]
        entry["fwd_us"] = measure(lambda: cand.fn(*args))
        kernel_notes = {}
        if plan.graphs:
            entry["fwd_kernel_us"], kernel_notes["fwd"] = kernel_us(lambda: cand.fn(*args))
        if backward:
            ones = [torch.ones_like(o) for o in _as_list(cand.fn(*args))]

            def fwd_bwd():
                leaves = {a: inputs[a].detach().requires_grad_(True) for a in grad_args}
                torch.autograd.backward(_as_list(cand.fn(*[leaves.get(a, inputs[a]) for a in problem.args])), ones)
            entry["fwd_bwd_us"] = measure(fwd_bwd)
            if plan.graphs:
                static = {a: inputs[a].detach().requires_grad_(True) for a in grad_args}
                static_args = [static.get(a, inputs[a]) for a in problem.args]

                def graphed():
                    torch.autograd.grad(_as_list(cand.fn(*static_args)), list(static.values()), ones)
                entry["fwd_bwd_kernel_us"], kernel_notes["fwd_bwd"] = kernel_us(graphed)
        notes = {k: v for k, v in kernel_notes.items() if v}
        if notes:
            entry["kernel_us_unavailable"] = notes
        result[str(n)] = entry
    return result


# ---- the ceilings that turn bytes and flops into floors ------------------------------------------

def measure_ceilings(device, samples: int = 10) -> dict:
    """Copy bandwidth and BF16 / FP32 (TF32 off) matmul peaks measured now, on this device."""
    if device.type != "cuda":
        return {"copy_bytes_per_s": None, "bf16_flops_per_s": None, "fp32_flops_per_s": None,
                "note": "no CUDA device: floors carry bytes and flops only"}
    measure = timing.timer(device, 3, samples)
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)   # 1 GiB
    dst = torch.empty_like(src)
    copy_us = measure(lambda: dst.copy_(src))
    n = 8192
    peaks = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        peaks[name] = 2 * n ** 3 / (measure(lambda: a @ b) * 1e-6)
        a = b = None  # frees the operands before the next dtype's (the timed lambda refers to the names)
    src = dst = None
    return {"copy_bytes_per_s": 2 * (1 << 30) / (copy_us * 1e-6), "bf16_flops_per_s": peaks["bf16"],
            "fp32_flops_per_s": peaks["fp32"], "matmul": "8192^3, TF32 off", "copy": "1 GiB device-to-device"}


def floors(problem: Problem, plan: Plan, device, ceilings: dict, cand: Candidate) -> dict:
    """Per size: minimal bytes (every input and output once; backward adds upstream and gradients,
    and reads the inputs again) and flops, and the times they take at the measured ceilings.
    `cand` (any working candidate) only tells the output shapes."""
    plan = plan.for_problem(problem)
    out = {}
    for n in plan.accuracy_sizes:
        inputs = problem.draw(n, ACCURACY_SEED, device)
        outs = _as_list(cand.fn(*[inputs[a] for a in problem.args]))
        in_bytes = sum(v.numel() * v.element_size() for v in inputs.values())
        out_bytes = sum(o.numel() * o.element_size() for o in outs)
        grad_bytes = sum(inputs[a].numel() * inputs[a].element_size()
                         for a in problem.row_grads + problem.param_grads)
        flops, kind = problem.fwd_flops(n) if problem.fwd_flops else (0, "fp32")
        entry = {"bytes_fwd": in_bytes + out_bytes, "flops_fwd": flops}
        if problem.has_backward:
            entry.update(bytes_fwd_bwd=2 * in_bytes + 2 * out_bytes + grad_bytes, flops_fwd_bwd=3 * flops)
        bw, peak = ceilings.get("copy_bytes_per_s"), ceilings.get(f"{kind}_flops_per_s")
        for phase in ("fwd", "fwd_bwd") if problem.has_backward else ("fwd",):
            mem = entry[f"bytes_{phase}"] / bw * 1e6 if bw else None
            comp = entry[f"flops_{phase}"] / peak * 1e6 if peak else None
            entry[f"{phase}_memory_us"], entry[f"{phase}_compute_us"] = mem, comp
            entry[f"{phase}_us"] = None if mem is None else max(mem, comp or 0.0)
        out[str(n)] = entry
    return out
