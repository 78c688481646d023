"""Run the prior-art comparison of one op: one subprocess per mode, merged into one report.

`run_mode` is what a mode's process does (also called in-process by tests and on a CPU): every
candidate is probed on one row (a missing CUDA kernel becomes `unavailable: <reason>`), then judged for
batch invariance, then all candidates are measured size by size (the FP64 golden of a size is shared).
The partial result is rewritten after each candidate, so a crash keeps what was finished. The parent
(`prior_art`) starts each mode with its environment set before CUDA starts and merges the partials; a mode
that cannot run on this machine (`candidates.mode_unavailable`) is recorded with why, without a process.
Without a GPU the plain mode runs in the parent at CPU smoke scale (`checks.CPU_SMOKE`, `at_smoke_scale`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import h3cute

from h3cute.bench import checks, report
from h3cute.bench.candidates import (MODE_OWNED_ENV, MODES, Candidate, apply_mode, candidates_for, mode_unavailable,
                                     modes_for)
from h3cute.bench.problems import PROBLEMS, Problem, at_smoke_scale, take_rows

CPU_NOTE = ("No CUDA device: every check runs at CPU smoke scale (checks.CPU_SMOKE) on the PyTorch reference code. "
            "CPU timings are wall times of that code on this machine, not measurements of any kernel.")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _probe(cand: Candidate, problem: Problem, device) -> str | None:
    """Why the candidate cannot run (None when a one-row call with a backward works)."""
    try:
        inputs = take_rows(problem, problem.draw(4, 3, device), torch.tensor([0]))
        outs, _ = checks.run(cand, problem, inputs, None)
        checks.run(cand, problem, inputs, [torch.ones_like(o) for o in outs])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return None
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {msg}"


def run_mode(problem: Problem, mode: str, plan: checks.Plan, device=None, cands=None, out: Path | None = None,
             log=None) -> dict:
    """Results of every candidate of `problem` under `mode` in this process (the mode already applied)."""
    device = device or default_device()
    log = log or (lambda msg: None)
    mode_reason = apply_mode(mode)
    cands = cands if cands is not None else candidates_for(problem, mode, plan, device)
    partial = {"mode": mode, "results": {mode: {}},
               "environment": report.environment(device, {mode: MODES.get(mode, {})})}
    if problem.narrowed:
        partial["notes"] = [f"{problem.op} {problem.narrowed}."]
    results = partial["results"][mode]

    def save():
        from h3cute.bench import peers
        if peers.mode_notes():
            partial["mode_notes"] = peers.mode_notes()
        if out is not None:
            Path(out).write_text(json.dumps(partial, indent=1))

    def described(c: Candidate, entry: dict) -> dict:
        if c.notes:
            entry["notes"] = c.notes
        if c.details is not None:
            entry.update(c.details())
        if not c.comparable:
            entry["comparable"] = False
        return entry

    working = []
    for c in cands:
        reason = (f"mode {mode}: {mode_reason}" if mode_reason else None) or c.unavailable or _probe(c, problem, device)
        if reason:
            log(f"{c.name}: unavailable: {reason}")
            results[c.name] = described(c, {"source": c.source, "unavailable": reason})
            save()
            continue
        log(f"{c.name}: batch invariance")
        try:
            bi = checks.batch_invariance(c, problem, plan, device, log=lambda m, n=c.name: log(f"{n}: {m}"))
        except Exception as e:  # a candidate that breaks mid-check is reported, the others still run
            results[c.name] = described(c, {"source": c.source,
                                             "unavailable": f"failed during checks: {type(e).__name__}: {e}"})
            save()
            continue
        results[c.name] = described(c, {"source": c.source, "has_backward": c.has_backward and problem.has_backward,
                                        "batch_invariance": bi, "accuracy_latency": {}})
        working.append(c)
        save()

    reference = checks.Reference(problem, device, replay_bits=mode == "plain")
    if reference.missing:
        log(f"FP64 reference missing ({reference.missing}): rel errors are null")
        partial["reference_missing"] = reference.missing
    for n in plan.for_problem(problem).accuracy_sizes:
        for c in working:
            log(f"{c.name}: accuracy/latency at {n} rows")
            try:
                entry = checks.accuracy_latency(c, problem, plan, device, reference, sizes=(n,))[str(n)]
            except Exception as e:  # e.g. out of memory at one size: record it, keep the other sizes
                entry = {"fwd_rel_err": None, "fwd_us": None, "error": f"{type(e).__name__}: {e}"}
                if results[c.name]["has_backward"]:
                    entry.update(grad_rel_err=None, fwd_bwd_us=None)
            results[c.name]["accuracy_latency"][str(n)] = entry
            described(c, results[c.name])
            save()
        reference.clear()

    if mode == "plain":
        log("ceilings and floors")
        ceilings = checks.measure_ceilings(device)
        partial["environment"]["ceilings"] = ceilings
        shaper = next((c for c in working if c.comparable), None)
        partial["floors"] = checks.floors(problem, plan, device, ceilings, shaper) if shaper else {}
        save()
    return partial


def merge(op: str, partials: list[dict], quick: bool) -> dict:
    """One report in the seeds' schema from the partials of all modes (plain first)."""
    plain = next((p for p in partials if p["mode"] == "plain"), partials[0])
    env = dict(plain["environment"])
    env["mode_environment"] = {p["mode"]: MODES.get(p["mode"], {}) for p in partials}
    notes = list(dict.fromkeys(([CPU_NOTE] if env.get("gpu") is None else [])
                               + [n for p in partials for n in p.get("notes", []) + p.get("mode_notes", [])]))
    rep = {
        "kind": report.KIND,
        "rfc": report.RFC,
        "op": op,
        "rl_kernel_commit": None,
        "tracked_tree_dirty": (env.get("h3cute") or {}).get("tree_dirty"),
        "environment": env,
        "quick": quick,
        "results": {p["mode"]: p["results"][p["mode"]] for p in partials},
        "floors": plain.get("floors", {}),
    }
    if notes:
        rep["notes"] = notes
    rep["fastest_peer"] = report.fastest_peers(rep)
    return rep


def _mode_subprocess(op: str, mode: str, quick: bool, overrides: dict, workdir: Path, log) -> dict:
    out = workdir / f"{op}.{mode}.json"
    cmd = [sys.executable, "-m", "h3cute.bench", "_mode", "--op", op, "--mode", mode, "--out", str(out)]
    if quick:
        cmd.append("--quick")
    for key, value in overrides.items():
        cmd += ["--plan", f"{key}={json.dumps(value)}"]
    env = {k: v for k, v in os.environ.items() if k not in MODE_OWNED_ENV}
    env.update(MODES[mode])
    # The child imports the same h3cute as this process, installed or run from a checkout.
    package_root = str(Path(h3cute.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    log(f"mode {mode}: {' '.join(f'{k}={v}' for k, v in MODES[mode].items())} subprocess")
    proc = subprocess.run(cmd, env=env)
    if out.exists():
        partial = json.loads(out.read_text())
        if proc.returncode != 0:
            partial["mode_error"] = f"exit status {proc.returncode} (partial results kept)"
        return partial
    return _without_process(op, mode, quick, overrides, f"mode subprocess failed with exit status {proc.returncode}")


def _without_process(op: str, mode: str, quick: bool, overrides: dict, reason: str) -> dict:
    """The partial of a mode that did not run: each of its candidates unavailable, with why."""
    device = default_device()
    problem, plan = mode_problem_plan(op, quick, overrides, device)
    return {"mode": mode, "environment": report.environment(device, {mode: MODES.get(mode, {})}), "results": {mode: {
        c.name: {"source": c.source, "unavailable": reason}
        for c in candidates_for(problem, mode, plan, device)}}}


def mode_problem_plan(op: str, quick: bool, overrides: dict, device) -> tuple[Problem, checks.Plan]:
    """The problem and check plan a mode of `op` runs on `device` (CPU: smoke scale), overrides applied."""
    problem = PROBLEMS[op] if device.type != "cpu" else at_smoke_scale(PROBLEMS[op])
    plan = checks.plan_for_device(checks.QUICK if quick else checks.FULL, device, problem)
    return problem, plan.with_overrides(overrides)


def prior_art(op: str, quick: bool, out: Path, overrides: dict | None = None, log=print) -> dict:
    """Run every mode of `op` in its own subprocess (without a GPU: plain in this process, at smoke scale);
    write the JSON, the markdown summary and plots. `overrides` replace fields of the plan (a report made
    with them says so under `plan_overrides`). After each mode the report so far is written (JSON and
    markdown, its `notes` naming the modes still to run), so a run stopped by a time limit keeps them."""
    problem = PROBLEMS[op]
    overrides = overrides or {}
    cpu = not torch.cuda.is_available()
    modes = modes_for(problem)
    partials = []

    def merged(final: bool) -> dict:
        rep = merge(op, partials, quick)
        if overrides:
            rep["plan_overrides"] = overrides
        if not final:
            rep.setdefault("notes", []).append(
                f"Incomplete: the modes {', '.join(modes[len(partials):])} had not finished when this was written.")
        return rep

    with tempfile.TemporaryDirectory(prefix="h3bench-") as tmp:
        for mode in modes:
            reason = mode_unavailable(mode)
            if reason:
                log(f"mode {mode}: not run: {reason}")
                partials.append(_without_process(op, mode, quick, overrides, f"mode {mode}: {reason}"))
            elif cpu and mode == "plain":
                device = torch.device("cpu")
                p, plan = mode_problem_plan(op, quick, overrides, device)
                partials.append(run_mode(p, mode, plan, device, log=lambda m: log(f"[{mode}] {m}")))
            else:
                partials.append(_mode_subprocess(op, mode, quick, overrides, Path(tmp), log))
            if len(partials) < len(modes):
                write_outputs(merged(final=False), out, lambda m: None, plots=False)
    rep = merged(final=True)
    write_outputs(rep, out, log)
    return rep


def write_outputs(rep: dict, out: Path, log=print, plots: bool = True) -> list[Path]:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = report.validate_report(rep)
    if errors:   # a harness bug: keep the file for inspection but say so loudly
        log("report does not validate:\n  " + "\n  ".join(errors[:20]))
    out.write_text(json.dumps(rep, indent=2))
    md = out.with_suffix(".md")
    md.write_text(report.summary_markdown(rep))
    written = [out, md] + (report.write_plots(rep, out.with_suffix(""), say=log) if plots else [])
    log("wrote " + ", ".join(str(p) for p in written))
    return written
