"""The `h3_prior_art` report: environment capture, the schema reader, markdown summaries and plots.

One reader (`validate_report` / `load_report`) accepts both the B200 seed reports and ours. Our
reports carry the seeds' keys exactly and add, all optional for the reader: top-level `floors`, `notes`
(what a reader must know first, e.g. CPU smoke scale) and `fastest_peer` (`fastest_peers`),
`environment.{h3cute, ceilings, timer, scale, peer_files}`, per candidate `notes`, `compile` (torch.compile
peers: graphs and seconds) and `comparable: false` (the bare-launch floor), per size `fwd_kernel_us`,
`fwd_bwd_kernel_us`, `kernel_us_unavailable`, `fwd_bits_vs_diffusers`, and candidates recorded as
`{"source", "unavailable": reason}`.
matplotlib is optional: without it `write_plots` says so and returns no files.
"""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path

KIND = "h3_prior_art"
RFC = "RL-Align/RL-Kernel#420"
LIBRARIES = ("torch", "triton", "diffusers", "nvidia-cutlass-dsl", "apache-tvm-ffi", "vllm", "vllm-omni",
             "flashinfer-python", "sglang", "liger-kernel", "quack-kernels", "transformer_engine", "megatron-core")
PHASES = ("fwd_us", "fwd_bwd_us")
INVARIANCE_CHECKS = ("all_rows", "params_repeatable", "full_vs_sub_batches", "batch_size_sweep")


def write_device_json(report: dict, name: str, path: str | None = None) -> str:
    """A device script's JSON report written to `path`, else to $H3CUTE_OUT/<name> (the folder the device run
    brings back, perf/device_run.sh), else to ./<name>; returns where."""
    path = path or os.path.join(os.environ.get("H3CUTE_OUT", "."), name)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return path


# ---- environment ---------------------------------------------------------------------------------

def child_json(cmd: list[str], env: dict, what: str) -> dict:
    """Runs a measurement's child process (a process of its own: cuBLAS reads its environment when CUDA starts)
    and returns the JSON it printed; a failed child stops the run, naming `what`."""
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit {done.returncode})")
    return json.loads(done.stdout)


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def h3cute_commit() -> dict:
    """{commit, tree_dirty}: H3CUTE_COMMIT / H3CUTE_TREE_DIRTY when set (a snapshot of a commit run elsewhere,
    e.g. on the device), else git, when the checkout beside the package is a repository's top level (a
    snapshot inside another checkout must not report that checkout's HEAD)."""
    if os.environ.get("H3CUTE_COMMIT"):
        dirty = os.environ.get("H3CUTE_TREE_DIRTY")
        return {"commit": os.environ["H3CUTE_COMMIT"],
                "tree_dirty": None if dirty is None else dirty.lower() in ("1", "true", "yes")}
    root = Path(__file__).resolve().parents[3]
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()
        if Path(top).resolve() != root:
            return {"commit": None, "tree_dirty": None}
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip() != ""
        return {"commit": commit, "tree_dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "tree_dirty": None}


def environment(device, mode_environment: dict) -> dict:
    import torch

    from h3cute.bench import peers
    cuda = device.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32),
        "libraries": {name: _version(name) for name in LIBRARIES},
        "megatron_source_commit": None,
        "mode_environment": mode_environment,
        "h3cute": h3cute_commit(),
        "timer": "cuda_event" if cuda else "perf_counter (CPU wall time; not comparable with GPU reports)",
        "scale": "seed method" if cuda else "CPU smoke scale (checks.CPU_SMOKE): no GPU, not a measurement",
        "peer_files": peers.versions(),
    }


# ---- schema --------------------------------------------------------------------------------------

def _num_or_none(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _is_count(key) -> bool:
    """A row-count key ("64"): ASCII digits only (str.isdigit also takes "²", which int() refuses)."""
    return isinstance(key, str) and key.isascii() and key.isdigit()


def _ints(d, keys) -> bool:
    return isinstance(d, dict) and all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) for k in keys)


def _check_candidate(where: str, c, errors: list) -> None:
    if not isinstance(c, dict) or not isinstance(c.get("source"), str):
        errors.append(f"{where}: needs a dict with a 'source' string")
        return
    if "unavailable" in c:
        if not isinstance(c["unavailable"], str):
            errors.append(f"{where}.unavailable: must be a reason string")
        return
    if not isinstance(c.get("has_backward"), bool):
        errors.append(f"{where}.has_backward: must be a bool")
    bi = c.get("batch_invariance")
    if not isinstance(bi, dict):
        errors.append(f"{where}.batch_invariance: missing")
    else:
        for key in INVARIANCE_CHECKS + ("batch_invariant",):
            if key not in bi:
                errors.append(f"{where}.batch_invariance.{key}: missing")
        all_rows = bi.get("all_rows")
        if not isinstance(all_rows, dict):
            errors.append(f"{where}.batch_invariance.all_rows: must map row counts to results")
            all_rows = {}
        for n, v in all_rows.items():
            if not (_is_count(n) and _ints(v, ("rows", "fwd_differ", "rowgrad_differ"))):
                errors.append(f"{where}.batch_invariance.all_rows.{n}: needs int rows/fwd_differ/rowgrad_differ")
        if bi.get("params_repeatable") not in (True, False, None):
            errors.append(f"{where}.batch_invariance.params_repeatable: must be bool or null")
        fvs = bi.get("full_vs_sub_batches")
        for k in ("full_batch", "sub_batches", "fwd_differ", "rowgrad_differ"):
            if not _ints(fvs, (k,)):
                errors.append(f"{where}.batch_invariance.full_vs_sub_batches.{k}: must be an int")
        sw = bi.get("batch_size_sweep")
        for k in ("comparisons", "differ"):
            if not _ints(sw, (k,)):
                errors.append(f"{where}.batch_invariance.batch_size_sweep.{k}: must be an int")
        failures = sw.get("first_failures", []) if isinstance(sw, dict) else []
        if not isinstance(failures, list):
            errors.append(f"{where}.batch_invariance.batch_size_sweep.first_failures: must be a list")
            failures = []
        for f in failures:
            if not (isinstance(f, dict) and set(f) == {"seed", "batch", "position", "row"}
                    and _ints(f, ("seed", "batch", "position", "row"))):
                errors.append(f"{where}.batch_invariance.batch_size_sweep.first_failures: bad entry {f}")
        if not isinstance(bi.get("batch_invariant"), bool):
            errors.append(f"{where}.batch_invariance.batch_invariant: must be a bool")
    al = c.get("accuracy_latency")
    if not isinstance(al, dict):
        errors.append(f"{where}.accuracy_latency: missing")
        return
    for n, e in al.items():
        at = f"{where}.accuracy_latency.{n}"
        if not _is_count(n) or not isinstance(e, dict):
            errors.append(f"{at}: keys are row counts, values dicts")
            continue
        for k in ("fwd_rel_err", "fwd_us"):
            if k not in e or not _num_or_none(e[k]):
                errors.append(f"{at}.{k}: must be a number or null")
        if c.get("has_backward"):
            g = e.get("grad_rel_err")
            if not (g is None or (isinstance(g, dict) and all(_num_or_none(v) for v in g.values()))):
                errors.append(f"{at}.grad_rel_err: must map gradient names to numbers")
            if "fwd_bwd_us" not in e or not _num_or_none(e["fwd_bwd_us"]):
                errors.append(f"{at}.fwd_bwd_us: must be a number or null")


def validate_report(report) -> list[str]:
    """Every schema violation of an h3_prior_art report (empty list: valid)."""
    errors = []
    if not isinstance(report, dict):
        return ["report: must be a JSON object"]
    for key in ("kind", "rfc", "op", "rl_kernel_commit", "tracked_tree_dirty", "environment", "quick", "results"):
        if key not in report:
            errors.append(f"{key}: missing")
    if report.get("kind") != KIND:
        errors.append(f"kind: expected {KIND!r}, got {report.get('kind')!r}")
    env = report.get("environment")
    if isinstance(env, dict):
        for key in ("gpu", "capability", "torch", "cuda", "python", "tf32", "libraries", "mode_environment"):
            if key not in env:
                errors.append(f"environment.{key}: missing")
    else:
        errors.append("environment: must be an object")
    results = report.get("results")
    if not isinstance(results, dict) or not results:
        errors.append("results: must map modes to candidates")
    else:
        for mode, cands in results.items():
            if not isinstance(cands, dict):
                errors.append(f"results.{mode}: must map candidate names to results")
                continue
            for name, c in cands.items():
                _check_candidate(f"results.{mode}.{name}", c, errors)
    floors = report.get("floors")
    if floors is not None and not isinstance(floors, dict):
        errors.append("floors: must map sizes to floors")
    return errors


class ReportError(ValueError):
    pass


def load_report(path) -> dict:
    """The report in `path`; ReportError naming the file when it cannot be read, is not JSON or breaks the
    schema."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"{path}: cannot be read ({e})") from e
    try:
        report = json.loads(text)
    except ValueError as e:
        raise ReportError(f"{path}: not JSON ({e})") from e
    errors = validate_report(report)
    if errors:
        raise ReportError(f"{path}: not an h3_prior_art report:\n  " + "\n  ".join(errors[:20]))
    return report


def candidates(report: dict) -> dict:
    """{candidate name: result} over all modes (names already carry their mode where it matters)."""
    return {name: c for cands in report["results"].values() for name, c in cands.items()}


def fastest_peers(report: dict) -> dict:
    """Per size and phase: h3cute's time, the fastest peer (any other candidate whose output is the op's) and
    the fastest batch-invariant peer, each with its time and `h3cute_over_peer` = h3cute / peer (below 1:
    h3cute is faster). Sizes or phases h3cute has no time for are left out."""
    cands = candidates(report)
    h3 = cands.get("h3cute") or {}
    out = {}
    for n, h3e in (h3.get("accuracy_latency") or {}).items():
        for phase in PHASES:
            mine = h3e.get(phase)
            if mine is None:
                continue
            rows = []
            for name, c in cands.items():
                if name == "h3cute" or "unavailable" in c or c.get("comparable") is False:
                    continue
                e = (c.get("accuracy_latency") or {}).get(n) or {}
                if e.get(phase) is not None:
                    rows.append((e[phase], name, c["batch_invariance"]["batch_invariant"], e.get("fwd_rel_err")))
            entry = {"h3cute_us": mine, "h3cute_fwd_rel_err": h3e.get("fwd_rel_err")}
            for key, pool in (("fastest", rows), ("fastest_invariant", [r for r in rows if r[2]])):
                if pool:
                    us, name, inv, err = min(pool)
                    entry[key] = {"peer": name, "us": us, "batch_invariant": inv, "fwd_rel_err": err,
                                  "h3cute_over_peer": mine / us if us else None}
            out.setdefault(n, {})[phase] = entry
    return out


# ---- markdown ------------------------------------------------------------------------------------

def _fmt(v, unit=""):
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return f"{v:.3g}{unit}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.2f}{unit}"
    return f"{v}{unit}"


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _invariance_cells(bi: dict) -> list[str]:
    rows = bi["all_rows"]
    ar = sum(v["fwd_differ"] + v["rowgrad_differ"] for v in rows.values())
    fvs = bi["full_vs_sub_batches"]
    sw = bi["batch_size_sweep"]
    return [
        "ok" if ar == 0 else f"{ar} differ",
        _fmt(bi["params_repeatable"]),
        "ok" if fvs["fwd_differ"] + fvs["rowgrad_differ"] == 0
        else f"{fvs['fwd_differ']}/{fvs['rowgrad_differ']} differ",
        "ok" if sw["differ"] == 0 else f"{sw['differ']}/{sw['comparisons']} differ",
        _fmt(bi["batch_invariant"]),
    ]


def _bits_cell(e: dict) -> str:
    b = e.get("fwd_bits_vs_diffusers")
    if not b:
        return "–"
    return "yes" if b["equal"] else f"no ({_fmt(100 * b['differing'])}% differ)"


_FASTEST_HEADER = ("h3cute µs", "h3cute fwd err", "fastest peer", "µs", "fwd err", "h3cute / peer",
                   "fastest batch-invariant peer", "µs", "fwd err", "h3cute / peer")


def _error_note(peer_err, h3_err) -> str:
    """Says when the faster peer is also far less accurate (10x or more h3cute's forward error against FP64)."""
    if peer_err is None or not h3_err or peer_err < 10 * h3_err:
        return ""
    return f"; its forward error against FP64 is {_fmt(peer_err)}, {peer_err / h3_err:.0f}x h3cute's {_fmt(h3_err)}"


def _fastest_rows(report: dict):
    """(size, phase, cells under _FASTEST_HEADER, sentence or None when a peer beats h3cute) per size and phase.
    Recomputed from the results (a stored `fastest_peer` may predate a field)."""
    fastest = fastest_peers(report)
    for n in sorted(fastest, key=int):
        for phase, e in fastest[n].items():
            cells, beaten = [_fmt(e["h3cute_us"]), _fmt(e.get("h3cute_fwd_rel_err"))], None
            for key in ("fastest", "fastest_invariant"):
                f = e.get(key)
                cells += ([f"`{f['peer']}`", _fmt(f["us"]), _fmt(f["fwd_rel_err"]), _fmt(f["h3cute_over_peer"])]
                          if f else ["–"] * 4)
                if f and key == "fastest" and f["h3cute_over_peer"] is not None and f["h3cute_over_peer"] > 1:
                    beaten = (f"{phase} at {n} rows: `{f['peer']}` {_fmt(f['us'])} µs against h3cute "
                              f"{_fmt(e['h3cute_us'])} µs ({_fmt(f['h3cute_over_peer'])}x)"
                              + ("" if f["batch_invariant"] else "; that peer is not batch-invariant")
                              + _error_note(f.get("fwd_rel_err"), e.get("h3cute_fwd_rel_err")))
            yield n, phase, cells, beaten


def fastest_markdown(report: dict) -> list[str]:
    """The fastest-peer table of a report and, in words, every size where a peer beats h3cute."""
    rows = list(_fastest_rows(report))
    if not rows:
        return []
    lines = ["## Fastest peer", "",
             "h3cute / peer below 1: h3cute is faster. Peers: every other candidate whose output is the op's.", "",
             _row("size", "phase", *_FASTEST_HEADER), _row(*["---"] * (2 + len(_FASTEST_HEADER)))]
    lines += [_row(n, phase, *cells) for n, phase, cells, _ in rows]
    faster = [b for *_, b in rows if b]
    lines += ["", ("A peer is faster than h3cute here: " + "; ".join(faster) + ".") if faster
              else "No peer is faster than h3cute at any size measured here."]
    return lines


_PHASE_LABEL = {"fwd_us": "fwd", "fwd_bwd_us": "fwd+bwd"}


def status_markdown(reports: dict[str, dict]) -> list[str]:
    """One fastest-peer table over several ops' reports ({op: report}, in the order given): the README's status
    table. Each op's row names the commit its report measured (a full hash shortened to 7), so a stale report shows
    as one."""
    lines = [_row("op", "report's commit", "size", "phase", *_FASTEST_HEADER),
             _row(*["---"] * (4 + len(_FASTEST_HEADER)))]
    faster = []
    for op, rep in reports.items():
        commit = ((rep.get("environment") or {}).get("h3cute") or {}).get("commit") or "–"
        if re.fullmatch(r"[0-9a-f]{40}", commit):
            commit = commit[:7]
        for n, phase, cells, beaten in _fastest_rows(rep):
            lines.append(_row(f"`{op}`", commit, n, _PHASE_LABEL.get(phase, phase), *cells))
            if beaten:
                faster.append(f"`{op}` {beaten}")
    lines += ["", ("A peer is faster than h3cute at: " + "; ".join(faster) + ".") if faster
              else "No peer is faster than h3cute at any size measured."]
    return lines


def _compile_lines(cands: dict) -> list[str]:
    rows = [(n, c["compile"]) for n, c in cands.items() if isinstance(c.get("compile"), dict)]
    if not rows:
        return []
    lines = ["## torch.compile", "", "Compile time is excluded from every timing above.", "",
             _row("candidate", "mode", "dynamic", "graphs", "backward compiles", "compile s", "calls"),
             _row(*["---"] * 7)]
    for name, k in rows:
        lines.append(_row(f"`{name}`", k["mode"], k["dynamic"], k["graphs"], k["backward_compiles"],
                          _fmt(k["compile_s"]), k["calls"]))
    lines += ["", f"Dynamic: {rows[0][1]['why']}."]
    for name, k in rows:
        events = ", ".join(f"{e['phase']} {e['rows']} rows{' grad' if e['grad'] else ''} {_fmt(e['seconds'])} s"
                           for e in k["events"])
        more = f" and {k['events_left_off']} more" if k.get("events_left_off") else ""
        lines.append(f"- `{name}` compiled at: {events or 'nothing'}{more}.")
    return lines


def summary_markdown(report: dict) -> str:
    env = report["environment"]
    h3 = env.get("h3cute") or {}
    lines = [
        f"# {report['op']}: prior art{' (quick)' if report.get('quick') else ''}",
        "",
        *[f"**{note}**" for note in report.get("notes", [])],
        *([""] if report.get("notes") else []),
        f"GPU {env.get('gpu')} (capability {env.get('capability')}), torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"python {env.get('python')}, TF32 {env.get('tf32')}, timer {env.get('timer', 'cuda_event')}, "
        f"h3cute {h3.get('commit')}{' (dirty)' if h3.get('tree_dirty') else ''}.",
        *([f"Scale: {env['scale']}."] if env.get("scale", "seed method") != "seed method" else []),
        "",
        "## Batch invariance",
        "",
        "| candidate | all_rows | params_repeatable | full_vs_sub_batches | batch_size_sweep | batch_invariant |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    cands = candidates(report)
    unavailable = []
    for name, c in cands.items():
        if "unavailable" in c:
            unavailable.append(f"- `{name}` ({c['source']}): {c['unavailable']}")
            continue
        lines.append(f"| `{name}` | " + " | ".join(_invariance_cells(c["batch_invariance"])) + " |")
    lines += ["", "## Accuracy and latency (µs, median)", "",
              "bits = diffusers: the forward's bits against the diffusers replay's on the same inputs.", "",
              _row("size", "candidate", "fwd_rel_err", "grad_rel_err (max)", "bits = diffusers", "fwd_us",
                   "fwd_bwd_us", "fwd_kernel_us", "fwd_bwd_kernel_us"), _row(*["---"] * 9)]
    sizes = sorted({int(n) for c in cands.values() for n in c.get("accuracy_latency", {})})
    floors = report.get("floors") or {}
    for n in sizes:
        for name, c in cands.items():
            e = c.get("accuracy_latency", {}).get(str(n))
            if e is None:
                continue
            grads = e.get("grad_rel_err")
            gmax = max((v for v in grads.values() if v is not None), default=None) if grads else None
            times = (_fmt(e.get(k)) for k in ("fwd_us", "fwd_bwd_us", "fwd_kernel_us", "fwd_bwd_kernel_us"))
            lines.append(_row(n, f"`{name}`", _fmt(e.get("fwd_rel_err")), _fmt(gmax), _bits_cell(e), *times))
        f = floors.get(str(n))
        if f and f.get("fwd_us") is not None:
            lines.append(_row(n, "floor (memory / compute)", "", "", "",
                              *(f"{_fmt(f.get(p + '_memory_us'))} / {_fmt(f.get(p + '_compute_us'))}"
                                for p in ("fwd", "fwd_bwd")), "", ""))
    fastest = fastest_markdown(report)
    if fastest:
        lines += [""] + fastest
    compiled = _compile_lines(cands)
    if compiled:
        lines += [""] + compiled
    notes = [f"- `{name}`: {c['notes']}" for name, c in cands.items() if c.get("notes")]
    if notes:
        lines += ["", "## Notes on candidates", ""] + notes
    if unavailable:
        lines += ["", "## Unavailable", ""] + unavailable
    ceilings = env.get("ceilings")
    if ceilings and ceilings.get("copy_bytes_per_s"):
        lines += ["", f"Ceilings measured in this run: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
                      f"BF16 {ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, "
                      f"FP32 {ceilings['fp32_flops_per_s'] / 1e12:.1f} TFLOP/s."]
    return "\n".join(lines) + "\n"


def compare_markdown(a: dict, b: dict, label_a: str = "A", label_b: str = "B") -> str:
    """Side-by-side: invariance and per-size fwd / fwd_bwd latency of every candidate in either report."""
    ca, cb = candidates(a), candidates(b)
    gpu_a, gpu_b = a["environment"].get("gpu"), b["environment"].get("gpu")
    lines = [f"# {a['op']}: {label_a} ({gpu_a}) vs {label_b} ({gpu_b})", ""]
    if a["op"] != b["op"]:
        lines += [f"Warning: different ops ({a['op']} vs {b['op']}).", ""]
    lines += [f"| candidate | invariant {label_a} | invariant {label_b} |", "| --- | --- | --- |"]

    def inv(c):
        if c is None:
            return "–"
        return "unavailable" if "unavailable" in c else _fmt(c["batch_invariance"]["batch_invariant"])
    names = list(dict.fromkeys([*ca, *cb]))
    for name in names:
        lines.append(f"| `{name}` | {inv(ca.get(name))} | {inv(cb.get(name))} |")

    def latency(c) -> dict:  # an unavailable candidate has none (the reader does not look inside it)
        return {} if c is None or "unavailable" in c else c["accuracy_latency"]
    metrics = ("fwd_us", "fwd_bwd_us", "fwd_rel_err")
    lines += ["", _row("size", "candidate", *(f"{m} {label}" for m in metrics for label in (label_a, label_b))),
              _row(*["---"] * 8)]
    sizes = sorted({int(n) for c in [*ca.values(), *cb.values()] for n in latency(c)})
    for n in sizes:
        for name in names:
            ea = latency(ca.get(name)).get(str(n)) or {}
            eb = latency(cb.get(name)).get(str(n)) or {}
            if not ea and not eb:
                continue
            lines.append(_row(n, f"`{name}`", *(_fmt(e.get(m)) for m in metrics for e in (ea, eb))))
    for label, rep, cands in ((label_a, a, ca), (label_b, b, cb)):
        fastest = fastest_markdown(rep)
        if fastest:
            lines += ["", fastest[0].replace("## Fastest peer", f"## Fastest peer: {label}")] + fastest[1:]
        gone = [f"- `{name}`: {c['unavailable']}" for name, c in cands.items() if "unavailable" in c]
        if gone:
            lines += ["", f"## Unavailable: {label}", ""] + gone
    return "\n".join(lines) + "\n"


# ---- plots ---------------------------------------------------------------------------------------

def write_plots(report: dict, stem: Path, say=print) -> list[Path]:
    """`<stem>_latency.png` (latency vs rows per candidate, log axes, floor dashed) and
    `<stem>_invariance.png` (pass/fail matrix). Returns the files written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: skipping plots (pip install 'h3cute[plot]')")
        return []
    cands = {n: c for n, c in candidates(report).items() if "unavailable" not in c}
    floors = report.get("floors") or {}
    phases = [p for p in ("fwd_us", "fwd_bwd_us")
              if any(p in e for c in cands.values() for e in c["accuracy_latency"].values())]
    written = []
    if not phases:
        say(f"{report['op']}: no candidate has latencies: skipping the latency plot")
        return written
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4.5), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for name, c in cands.items():
            pts = sorted((int(n), e[phase]) for n, e in c["accuracy_latency"].items() if e.get(phase))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        fl = sorted((int(n), f[phase]) for n, f in floors.items() if f and f.get(phase))
        if fl:
            ax.plot(*zip(*fl), "k--", label="floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rows")
        ax.set_ylabel(f"{phase} (µs)")
        ax.set_title(f"{report['op']}: {phase}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(f"{stem}_latency.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    names = list(cands)
    cols = INVARIANCE_CHECKS + ("batch_invariant",)
    grid, text = [], []
    for name in names:
        bi = cands[name]["batch_invariance"]
        cells = _invariance_cells(bi)
        grid.append([1.0 if cell in ("ok", "yes") else 0.5 if cell == "–" else 0.0 for cell in cells])
        text.append(cells)
    fig, ax = plt.subplots(figsize=(2 + 1.8 * len(cols), 1 + 0.45 * max(len(names), 1)))
    if names:
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for i, row in enumerate(text):
            for j, cell in enumerate(row):
                ax.text(j, i, cell, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), cols, fontsize=8, rotation=20)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_title(f"{report['op']}: batch invariance")
    fig.tight_layout()
    path = Path(f"{stem}_invariance.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
