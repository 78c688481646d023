"""Tile-config sweep for kernel authors: every config of an op's launch module, judged and ranked.

The configs are `h3cute.launch.<op>.sweep_configs(device)` where the module defines it (a dict short name ->
config: the candidates of the device's kernel family), else `h3cute.launch.<op>.CONFIGS` (a dict name -> config,
or a sequence of configs, each named by its `name`, or the module-level name that holds it), and are passed as
`forward(..., config=cfg)`. Each config's forward is checked for batch invariance (the harness's forward checks)
and its outputs at every accuracy size are compared bitwise with the first config's: a config choice must never
change the bits. Ranked by forward latency at the largest size. A prebuilt bundle holds only the configs the op
picks (unless built with `--candidates`): the others compile on demand, which needs the CuTe DSL. Where the launcher
defines `sweep_config(text, device)` the command line may also name configs that are not declared (e.g. field
overrides of a named config, `tma_wide:stages=4`): they compile on demand and run after the op's shipped picks
(`sweep_picks(device)`), whose bits they must match.
"""
from __future__ import annotations

import importlib
import inspect

import torch

from h3cute.bench import checks, report, timing
from h3cute.bench.candidates import Candidate
from h3cute.bench.problems import Problem


class NoConfigs(LookupError):
    pass


def op_configs(op: str, device=None) -> tuple[object, list[tuple[str, object]]]:
    """(launch module, [(name, config)]) or NoConfigs saying why the op has nothing to sweep."""
    try:
        mod = importlib.import_module(f"h3cute.launch.{op}")
    except ModuleNotFoundError as e:
        raise NoConfigs(f"h3cute.launch.{op} does not exist ({e})") from None
    configs = mod.sweep_configs(device) if hasattr(mod, "sweep_configs") else getattr(mod, "CONFIGS", None)
    if not configs:
        raise NoConfigs(f"h3cute.launch.{op} declares no CONFIGS")
    if "config" not in inspect.signature(mod.forward).parameters:
        raise NoConfigs(f"h3cute.launch.{op}.forward takes no config= keyword")
    if isinstance(configs, dict):
        return mod, [(str(k), v) for k, v in configs.items()]
    return mod, [(config_name(mod, c), c) for c in configs]


def select_configs(mod, configs: list[tuple[str, object]], requested, device) -> list[tuple[str, object]]:
    """The configs a sweep runs: every declared one, or those `requested` by name; a requested text the op does not
    declare is parsed by the launcher's `sweep_config` (ValueError if it has none or the text is no config), and then
    the op's shipped picks run first, so every config is compared with their bits."""
    if not requested:
        return configs
    declared = dict(configs)
    extra = [r for r in dict.fromkeys(requested) if r not in declared]
    if extra and not hasattr(mod, "sweep_config"):
        raise ValueError(f"unknown configs {sorted(extra)}; the op declares {list(declared)}")
    custom = [mod.sweep_config(text, device) for text in extra]
    picks = mod.sweep_picks(device) if custom and hasattr(mod, "sweep_picks") else ()
    named = [n for n in dict.fromkeys([*picks, *requested]) if n in declared]
    return [(n, declared[n]) for n in named] + custom


def config_name(mod, config) -> str:
    """A config's short name: itself if a string, its `name`, the module-level name that holds it (SMALL_T), else
    its repr."""
    if isinstance(config, str):
        return config
    name = getattr(config, "name", None)
    if name:
        return name
    return next((n for n, v in vars(mod).items() if v is config and n.isupper()), repr(config))


def sweep(problem: Problem, configs: list[tuple[str, object]], forward, plan: checks.Plan, device,
          log=lambda m: None) -> dict:
    """Judge and rank `configs`; `forward(*tensor_args, config=cfg)` is the op's launch forward."""
    plan = plan.for_problem(problem)
    measure = timing.timer(device, plan.warmup, plan.samples)
    first_outs: dict[int, list] = {}
    results = {}
    for name, cfg in configs:
        cand = Candidate(name, repr(cfg), lambda *a, cfg=cfg: forward(*a, config=cfg), has_backward=False)
        entry = {"config": repr(cfg)}
        results[name] = entry
        try:
            log(f"{name}: batch invariance")
            bi = checks.batch_invariance(cand, problem, plan, device)
            entry["batch_invariant"] = bi["batch_invariant"]
            entry["batch_invariance"] = bi
            entry["fwd_us"], entry["identical_to_first"] = {}, True
            for n in plan.accuracy_sizes:
                log(f"{name}: {n} rows")
                inputs = problem.draw(n, checks.ACCURACY_SEED, device)
                args = [inputs[a] for a in problem.args]
                outs, _ = checks.run(cand, problem, inputs, None)
                ref = first_outs.setdefault(n, outs)
                entry["identical_to_first"] &= all(torch.equal(o, r) for o, r in zip(outs, ref))
                entry["fwd_us"][str(n)] = measure(lambda: cand.fn(*args))
        except Exception as e:
            entry["unavailable"] = f"{type(e).__name__}: {e}"
    largest = str(max(plan.accuracy_sizes))
    ok = [n for n, e in results.items() if "unavailable" not in e]
    ranking = sorted(ok, key=lambda n: results[n]["fwd_us"][largest])
    # over the configs that ran; none ran proves nothing (False), and the failed ones are named
    return {
        "kind": "h3_config_sweep",
        "op": problem.op,
        "environment": report.environment(device, {"plain": {}}),
        "configs": results,
        "ranking": ranking,
        "failed": [n for n in results if n not in ok],
        "all_identical": bool(ok) and all(results[n]["identical_to_first"] for n in ok),
        "all_invariant": bool(ok) and all(results[n]["batch_invariant"] for n in ok),
    }


def sweep_markdown(res: dict) -> str:
    sizes = sorted({int(s) for e in res["configs"].values() for s in e.get("fwd_us", {})})
    lines = [f"# {res['op']}: tile-config sweep", "",
             f"{len(res['ranking'])} of {len(res['configs'])} configs ran; identical bits across them: "
             f"{res['all_identical']}; all batch-invariant: {res['all_invariant']}", "",
             "| rank | config | invariant | identical | " + " | ".join(f"fwd_us@{n}" for n in sizes) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in sizes) + " |"]
    for i, name in enumerate(res["ranking"], 1):
        e = res["configs"][name]
        lines.append(f"| {i} | `{name}` | {e['batch_invariant']} | {e['identical_to_first']} | "
                     + " | ".join(f"{e['fwd_us'][str(n)]:.2f}" for n in sizes) + " |")
    for name, e in res["configs"].items():
        if "unavailable" in e:
            lines.append(f"\n`{name}` failed: {e['unavailable']}")
    return "\n".join(lines) + "\n"
