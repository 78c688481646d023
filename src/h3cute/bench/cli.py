"""`h3cute-bench` command line.

  h3cute-bench prior-art --op OP|all [--quick] [--out FILE.json] [--plan FIELD=JSON ...]
      JSON report (the seeds' schema) + FILE.md summary + FILE_latency.png / FILE_invariance.png.
      With --op all, FILE.json names a stem: one FILE_<op>.json per op. Without a GPU every check runs at
      CPU smoke scale and the timings are not measurements. The torch.compile peers follow the plan:
      --plan 'inductor_modes=["default"]' (leave max-autotune out), --plan inductor_compile_budget_s=300,
      --plan inductor_dynamic=false (a graph per row count).
  h3cute-bench compare A.json B.json [--labels A B]
  h3cute-bench status DIR
      the fastest-peer table (each op, size, phase) over every prior-art report in DIR: the README's status table.
  h3cute-bench sweep --op OP [--config NAME ...] [--full] [--out FILE.json]
      every tile config of an op (or those named), ranked; adaln_projection and timestep_mlp also take field
      overrides of a named config (--config tma_wide:stages=4, --config MID_T:fc2.stages=5), compiled on demand and
      checked against the shipped picks.
  h3cute-bench model [--quick] [--out FILE.json] [--resume] [--budget-s SECONDS] [--sizes S ...] [--batches B ...]
      diffusers' MiniMax-H3 model with h3cute.patch against it unpatched (2 blocks at H3's widths): FILE.json,
      FILE.md, FILE.png. --resume continues FILE.json; --budget-s stops starting configurations after that long.
      --variants model (with vLLM's cuBLASLt settings exported) adds h3cute.patch(scope="model") to a report.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from h3cute.bench.problems import OPS, PROBLEMS

try:
    from rich.console import Console
    console = Console(stderr=True)
except ImportError:  # the lent device carries no rich: plain lines on stderr instead
    import contextlib

    class _PlainConsole:
        def log(self, msg):
            print(msg, file=sys.stderr, flush=True)
        print = log

        def rule(self, title):
            self.log(f"== {title}")

        def status(self, msg):
            self.log(msg)
            return contextlib.nullcontext()
    console = _PlainConsole()


def _log(msg: str) -> None:
    console.log(msg)


class UsageError(Exception):
    """A bad argument or input file: `main` prints the message, without a traceback, and returns 2."""


def _fits(value, hint) -> bool:
    """Whether a JSON value fits a Plan field's type (int, bool, tuple[int, ...], X | None)."""
    import types
    import typing
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is tuple:
        return isinstance(value, list) and all(_fits(v, typing.get_args(hint)[0]) for v in value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _overrides(items) -> dict:
    """`--plan key=value` pairs (values JSON: `--plan accuracy_sizes=[1,64]`) checked against Plan."""
    import typing
    from h3cute.bench.checks import Plan
    hints = typing.get_type_hints(Plan)
    out = {}
    for item in items or ():
        key, _, value = item.partition("=")
        if key not in hints:
            raise UsageError(f"--plan {item}: unknown field {key!r}; fields: {sorted(hints)}")
        try:
            out[key] = json.loads(value)
        except ValueError as e:
            raise UsageError(f"--plan {item}: the value is not JSON ({e}); e.g. --plan accuracy_sizes=[1,64]") from e
        if not _fits(out[key], hints[key]):
            want = str(hints[key]).replace("<class '", "").replace("'>", "")
            raise UsageError(f"--plan {item}: {key} takes {want}, got {value}")
    return out


def _prior_art(args) -> int:
    import torch

    from h3cute.bench.prior_art import CPU_NOTE, prior_art
    ops = OPS if args.op == "all" else (args.op,)
    if not torch.cuda.is_available():
        console.print(CPU_NOTE)
    for op in ops:
        if args.out is None:
            out = Path(f"h3_prior_art_{op}{'_quick' if args.quick else ''}.json")
        elif args.op == "all":
            out = args.out.with_name(f"{args.out.stem}_{op}.json")
        else:
            out = args.out
        console.rule(f"prior art: {op}")
        prior_art(op, args.quick, out, overrides=args.overrides, log=_log)
    return 0


def _mode(args) -> int:
    """Child process of one cuBLAS mode (its environment was set by the parent)."""
    from h3cute.bench.prior_art import default_device, mode_problem_plan, run_mode
    device = default_device()
    problem, plan = mode_problem_plan(args.op, args.quick, args.overrides, device)
    with console.status(f"{args.op} [{args.mode}]"):
        run_mode(problem, args.mode, plan, device, out=args.out, log=lambda m: _log(f"[{args.mode}] {m}"))
    return 0


def _compare(args) -> int:
    from h3cute.bench.report import compare_markdown, load_report
    a, b = load_report(args.a), load_report(args.b)
    labels = args.labels or [args.a.stem, args.b.stem]
    sys.stdout.write(compare_markdown(a, b, *labels))
    return 0


def _status(args) -> int:
    from h3cute.bench.report import status_markdown, load_report
    order = [*OPS, "gate_residual_norm_modulate"]
    paths = {p.stem: p for p in sorted(args.folder.glob("*.json"))}
    reports = {}
    for op in sorted(paths, key=lambda o: (order.index(o) if o in order else len(order), o)):
        try:
            reports[op] = load_report(paths[op])
        except Exception:  # another script's JSON in the same folder (row_kernels.json, model.json, ...)
            continue
    if not reports:
        raise UsageError(f"{args.folder}: no prior-art report (h3cute-bench prior-art --out DIR/OP.json)")
    sys.stdout.write("\n".join(status_markdown(reports)) + "\n")
    return 0


def _sweep(args) -> int:
    from h3cute.bench import checks
    from h3cute.bench.prior_art import default_device
    from h3cute.bench.sweep import NoConfigs, op_configs, select_configs, sweep, sweep_markdown
    device = default_device()
    try:
        mod, configs = op_configs(args.op, device)
    except NoConfigs as e:
        console.print(f"{args.op}: nothing to sweep: {e}")
        return 2
    try:
        configs = select_configs(mod, configs, args.config, device)
    except ValueError as e:
        console.print(str(e))
        return 2
    plan = (checks.FULL if args.full else checks.QUICK).with_overrides(args.overrides)
    res = sweep(PROBLEMS[args.op], configs, mod.forward, plan, device, log=_log)
    out = args.out or Path(f"h3_sweep_{args.op}.json")
    out.write_text(json.dumps(res, indent=2))
    md = sweep_markdown(res)
    out.with_suffix(".md").write_text(md)
    sys.stdout.write(md)
    console.print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if res["all_identical"] and res["all_invariant"] and not res["failed"] else 1


def _model(args) -> int:
    from h3cute.bench import model_bench
    plan = model_bench.plan_from_args(args)
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        rep = model_bench.run(plan, args.out, resume=args.resume, budget_s=args.budget_s, log=_log)
    else:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            rep = model_bench.run(plan, args.out, resume=args.resume, budget_s=args.budget_s,
                                  log=progress.console.log, progress=progress)
    sys.stdout.write(model_bench.markdown(rep))
    return 0 if rep["complete"] else 3


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="h3cute-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pa = sub.add_parser("prior-art", help="compare h3cute with the prior art for one op or all")
    pa.add_argument("--op", required=True, choices=(*OPS, "all"))
    pa.add_argument("--quick", action="store_true", help="fewer seeds and sizes, fewer timing samples")
    pa.add_argument("--out", type=Path)
    pa.add_argument("--plan", action="append", metavar="FIELD=JSON",
                    help="override a field of the check plan (h3cute.bench.checks.Plan), e.g. sweep_pool=256")
    pa.set_defaults(func=_prior_art)
    cp = sub.add_parser("compare", help="side-by-side table of two reports (seed or ours)")
    cp.add_argument("a", type=Path)
    cp.add_argument("b", type=Path)
    cp.add_argument("--labels", nargs=2)
    cp.set_defaults(func=_compare)
    st = sub.add_parser("status", help="one fastest-peer table over every prior-art report in a folder")
    st.add_argument("folder", type=Path)
    st.set_defaults(func=_status)
    sw = sub.add_parser("sweep", help="judge and rank every tile config of an op")
    sw.add_argument("--op", required=True, choices=OPS)
    sw.add_argument("--config", action="append",
                    help="only these configs (repeatable): names, or where the op allows field overrides of a named "
                         "config (adaln_projection: tma_wide:stages=4; timestep_mlp: MID_T:fc2.stages=5), compiled on "
                         "demand and run after the picks")
    sw.add_argument("--full", action="store_true", help="the full invariance method instead of the quick one")
    sw.add_argument("--out", type=Path)
    sw.add_argument("--plan", action="append", metavar="FIELD=JSON", help="override a field of the check plan")
    sw.set_defaults(func=_sweep)
    mb = sub.add_parser("model", help="diffusers' MiniMax-H3 model patched against unpatched, eager and compiled")
    mb.add_argument("--quick", action="store_true",
                    help="smoke scale (a CPU run in CI): 1 block, S = 48, B = 2, aot_eager, one sample")
    mb.add_argument("--out", type=Path, default=Path("h3_model.json"))
    mb.add_argument("--resume", action="store_true", help="keep the configurations --out already holds")
    mb.add_argument("--budget-s", type=float, default=480.0,
                    help="start no configuration after this many seconds (default 480: a 10-minute device call)")
    mb.add_argument("--sizes", type=int, nargs="+", metavar="S", help="packed rows (default 4097 32768)")
    mb.add_argument("--batches", type=int, nargs="+", metavar="B", help="replicas (default 1 4)")
    mb.add_argument("--modes", nargs="+", choices=("eager", "compile", "cudagraphs"),
                    help="default eager compile; cudagraphs: torch.compile(mode='reduce-overhead'), forward only")
    mb.add_argument("--phases", nargs="+", choices=("fwd", "fwd_bwd"))
    mb.add_argument("--backend", help="torch.compile backend (default inductor; --quick: aot_eager)")
    mb.add_argument("--no-share", action="store_true", help="skip the conditioning path's instrumented call")
    mb.add_argument("--variants", nargs="+", choices=("unpatched", "patched", "model"),
                    help="default unpatched patched; model (scope='model') needs vLLM's cuBLASLt settings in the "
                         "environment, so it runs in a process of its own: --variants model --resume")
    mb.set_defaults(func=_model)
    md = sub.add_parser("_mode", help=argparse.SUPPRESS)
    md.add_argument("--op", required=True, choices=OPS)
    md.add_argument("--mode", required=True)
    md.add_argument("--quick", action="store_true")
    md.add_argument("--out", type=Path, required=True)
    md.add_argument("--plan", action="append")
    md.set_defaults(func=_mode)
    return p


def main(argv=None) -> int:
    from h3cute.bench.report import ReportError
    args = parser().parse_args(argv)
    try:
        args.overrides = _overrides(getattr(args, "plan", None))  # checked before any work
        return args.func(args)
    except (UsageError, ReportError) as e:
        print(f"h3cute-bench {args.command}: error: {e}", file=sys.stderr)
        return 2
