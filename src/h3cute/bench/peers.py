"""The peers a user would pick instead of h3cute, as candidates of the prior-art harness.

- `inductor` / `inductor_max_autotune`: `torch.compile` of the op's diffusers replay (`h3cute.reference.<op>_replay`)
  in the modes of `Plan.inductor_modes`, judged like any candidate. Rows are dynamic, the H3 widths static
  (`DYNAMIC_WHY`); every graph it compiles, and the seconds it took, go to the report (`CompileLog`), never into
  a timing (a timed call is always preceded by warm-up calls of the same shapes). Over
  `Plan.inductor_compile_budget_s` of compile time the candidate stops and says so.
- `vllm_omni`: vllm-omni's MiniMax-H3 Triton kernels (`VLLM_OMNI`), forward only (they define no backward).
- `liger` / `quack`: their RMSNorm, then diffusers' modulation in torch (`reference.modulation_replay`), for
  norm_modulate and final_adaln_out's norm (whose projection stays diffusers' F.linear).
- SGLang's / Megatron's Triton batch-invariant modes (`candidates.TRITON_MODES`, `TRITON_MODE_FILES`): each
  library's `enable_batch_invariant_mode()` reroutes aten::mm / addmm (and a few reductions) to its persistent
  Triton matmul process-wide; the diffusers replay then runs under it (`diffusers[sglang]` ...), as in the seeds.

No peer code is copied here. Each adapter imports the installed package, or loads the one file it needs from an
installed distribution or from files extracted from the peer's wheel into `$H3CUTE_PEER_FILES/<dist>-<version>/`
(perf/stage_peers.sh), with stand-ins for the few imports of the peer's own package that are not installed
(`PeerFile.stand_ins`: vllm-omni's `vllm.triton_utils`, SGLang's `sglang.srt.utils` helpers). A peer that cannot
run here is a candidate with `unavailable` set to the reason.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from h3cute.bench.candidates import TRITON_MODES, Candidate
from h3cute.bench.problems import Problem

PEER_FILES_ENV = "H3CUTE_PEER_FILES"


class PeerUnavailable(Exception):
    """Why a peer cannot run here; the message is what the report says."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):   # a parent package missing, or a module without a spec
        return False


def _eps() -> float:
    """H3's RMSNorm epsilon: the default of the diffusers replay the peers are compared with."""
    from h3cute import reference
    return inspect.signature(reference.norm_modulate_replay).parameters["eps"].default


# ---- a peer's file: where it is, and loading it alone --------------------------------------------------

@dataclass(frozen=True)
class PeerFile:
    """One module of a peer distribution, loaded from its file without importing the peer's package.

    `paths` are where the module may sit inside the distribution, preferred first. `stand_ins` builds modules
    for the imports of the peer's own package the file makes; they are used only while `stand_in_root` (that
    package) is not importable, and only while the file executes."""
    dist: str
    paths: tuple[str, ...]
    stand_ins: Callable[[], dict[str, types.ModuleType]] | None = None
    stand_in_root: str | None = None


def locate(pf: PeerFile) -> tuple[Path, str, str]:
    """(file, version, where it comes from), from the installed distribution or `$H3CUTE_PEER_FILES`."""
    try:
        dist = importlib.metadata.distribution(pf.dist)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for rel in pf.paths:
            path = Path(dist.locate_file(rel))
            if path.is_file():
                return path, dist.version, "installed"
        raise PeerUnavailable(f"{pf.dist} {dist.version} is installed but has none of {', '.join(pf.paths)}")
    root = os.environ.get(PEER_FILES_ENV)
    if root:
        for folder in sorted(Path(root).glob(f"{pf.dist}-*")):
            version = folder.name[len(pf.dist) + 1:]
            if not version[:1].isdigit():
                continue
            for rel in pf.paths:
                if (folder / rel).is_file():
                    return folder / rel, version, f"extracted from its wheel into {folder}"
    where = f"; ${PEER_FILES_ENV} ({root}) holds none of its files" if root else ""
    raise PeerUnavailable(f"{pf.dist} is not installed{where}")


_LOADED: dict[PeerFile, tuple[types.ModuleType, str]] = {}


def load(pf: PeerFile) -> tuple[types.ModuleType, str]:
    """(module, description) of `pf`, executed once per process; PeerUnavailable says why not."""
    if pf in _LOADED:
        return _LOADED[pf]
    path, version, where = locate(pf)
    stand = {}
    if pf.stand_ins is not None and not _importable(pf.stand_in_root):
        try:
            stand = pf.stand_ins()
        except PeerUnavailable:
            raise
        except Exception as e:
            raise PeerUnavailable(f"{pf.dist} {version}: {_first_line(e)}") from e
    inserted = [n for n in stand if n not in sys.modules]
    sys.modules.update({n: stand[n] for n in inserted})
    name = "h3cute_peer_" + re.sub(r"\W", "_", f"{pf.dist}_{path.stem}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # Triton's JIT and inspect look a function's module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise PeerUnavailable(f"{pf.dist} {version} {path.name}: {_first_line(e)}") from e
    finally:
        for n in inserted:
            sys.modules.pop(n, None)
    rel = next(r for r in pf.paths if str(path).endswith(r))
    leaves = sorted(n for n in stand if not any(m.startswith(n + ".") for m in stand))
    desc = f"{pf.dist} {version} {rel} ({where}" + (f"; stand-ins for {', '.join(leaves)})" if stand else ")")
    _LOADED[pf] = (module, desc)
    return _LOADED[pf]


def _package(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []   # a package, so that submodules can sit under it
    m.__dict__.update(attrs)
    return m


def _vllm_stand_ins() -> dict[str, types.ModuleType]:
    """`vllm.triton_utils` as vllm-omni's file uses it: `triton` and `triton.language as tl`."""
    import triton
    import triton.language as tl
    return {"vllm": _package("vllm"),
            "vllm.triton_utils": _package("vllm.triton_utils", triton=triton, tl=tl, HAS_TRITON=True)}


def _sglang_stand_ins() -> dict[str, types.ModuleType]:
    """The five names SGLang's batch_invariant_ops imports from `sglang.srt`, as SGLang defines them on a CUDA
    machine without DeepGEMM or an NPU (the only case they stand in for: otherwise PeerUnavailable)."""
    if hasattr(torch, "npu"):
        raise PeerUnavailable("torch has an NPU backend: SGLang's NPU path needs the real sglang.srt.utils")
    if _importable("deep_gemm"):
        raise PeerUnavailable("deep_gemm is installed: SGLang would route BF16 GEMMs to DeepGEMM, which its "
                              "batch_invariant_ops decides through sglang.srt, not installed here")

    def get_bool_env_var(name, default="false"):
        return os.getenv(name, default).lower() in ("true", "1")

    def get_device_core_count(device_id=0):
        return torch.cuda.get_device_properties(device_id).multi_processor_count if torch.cuda.is_available() else 0

    def get_dispatch_device_backend():
        if not torch.cuda.is_available():
            raise RuntimeError("No supported accelerator (CUDA/XPU) available")
        return "CUDA"

    def calc_diff(x, y):
        x, y = x.double(), y.double()
        return 1 - 2 * (x * y).sum() / (x * x + y * y).sum()

    common = _package("sglang.srt.utils.common", get_bool_env_var=get_bool_env_var, calc_diff=calc_diff,
                      get_device_core_count=get_device_core_count,
                      get_dispatch_device_backend=get_dispatch_device_backend)
    return {
        "sglang": _package("sglang"), "sglang.srt": _package("sglang.srt"),
        "sglang.srt.utils": _package("sglang.srt.utils", is_npu=lambda: False, common=common),
        "sglang.srt.utils.common": common,
        "sglang.srt.layers": _package("sglang.srt.layers"),
        "sglang.srt.layers.deep_gemm_wrapper": _package("sglang.srt.layers.deep_gemm_wrapper"),
        "sglang.srt.layers.deep_gemm_wrapper.configurer": _package(
            "sglang.srt.layers.deep_gemm_wrapper.configurer", ENABLE_JIT_DEEPGEMM=False),
    }


VLLM_OMNI_FILE = PeerFile(
    "vllm-omni", ("vllm_omni/diffusion/attention/ops/minimax_h3_modulation.py",
                  "vllm_omni/diffusion/layers/indexed_modulation.py"),
    _vllm_stand_ins, "vllm")
SGLANG_FILE = PeerFile("sglang", ("sglang/srt/batch_invariant_ops/batch_invariant_ops.py",),
                       _sglang_stand_ins, "sglang")
MEGATRON_FILE = PeerFile("megatron-core", ("megatron/core/transformer/custom_layers/batch_invariant_kernels.py",))


def versions() -> dict[str, str | None]:
    """Where each file-loaded peer would come from here (None: nowhere), for the report's environment."""
    out = {}
    for pf in (VLLM_OMNI_FILE, SGLANG_FILE, MEGATRON_FILE):
        try:
            path, version, where = locate(pf)
            out[pf.dist] = f"{version} ({where})"
        except PeerUnavailable:
            out[pf.dist] = None
    return out


# ---- SGLang's / Megatron's Triton batch-invariant modes ------------------------------------------------

# mode (candidates.TRITON_MODES, with the environment each sets) -> the file holding its enable_batch_invariant_mode
TRITON_MODE_FILES: dict[str, PeerFile] = {
    "sglang": SGLANG_FILE, "sglang_ieee": SGLANG_FILE,
    "megatron_triton": MEGATRON_FILE, "megatron_triton_ieee": MEGATRON_FILE,
}
assert set(TRITON_MODE_FILES) == set(TRITON_MODES)
TRITON_MODE_SOURCES = {
    "sglang": "SGLang enable_batch_invariant_mode (Triton persistent matmul; TF32 tl.dot)",
    "sglang_ieee": "SGLang enable_batch_invariant_mode (Triton persistent matmul; TRITON_F32_DEFAULT=ieee)",
    "megatron_triton": "Megatron enable_batch_invariant_mode (Triton persistent matmul; TF32 tl.dot)",
    "megatron_triton_ieee": "Megatron enable_batch_invariant_mode (Triton persistent matmul; TRITON_F32_DEFAULT=ieee)",
}

_active_mode: types.ModuleType | None = None
_mode_notes: list[str] = []


def triton_mode_unavailable(mode: str) -> str | None:
    """Why `mode` cannot run on this machine, found without loading anything (None: try it)."""
    if not torch.cuda.is_available():
        return "needs a CUDA device: its Triton matmul replaces aten's CUDA kernels"
    if not _importable("triton"):
        return "triton is not installed"
    try:
        locate(TRITON_MODE_FILES[mode])
    except PeerUnavailable as e:
        return str(e)
    return None


def _enable(module: types.ModuleType) -> None:
    try:
        module.enable_batch_invariant_mode()
    except ModuleNotFoundError as e:
        # Megatron's enable registers its aten overrides first, then imports Transformer Engine to patch it.
        if not (e.name or "").startswith("transformer_engine") or not module.is_batch_invariant_mode_enabled():
            raise
        note = ("Transformer Engine is not installed: Megatron's enable_batch_invariant_mode registered its aten "
                "overrides (mm, addmm, _log_softmax, mean.dim) and stopped at patching TE, which the replay "
                "does not call")
        if note not in _mode_notes:
            _mode_notes.append(note)


def enable_triton_mode(mode: str) -> str:
    """Turn `mode` on for this process; returns the description of what runs. PeerUnavailable: why not."""
    global _active_mode
    reason = triton_mode_unavailable(mode)
    if reason:
        raise PeerUnavailable(reason)
    module, desc = load(TRITON_MODE_FILES[mode])
    try:
        _enable(module)
    except Exception as e:
        raise PeerUnavailable(f"{desc}: enable_batch_invariant_mode: {_first_line(e)}") from e
    _active_mode = module
    return desc


def mode_notes() -> list[str]:
    return list(_mode_notes)


@contextlib.contextmanager
def triton_mode_suspended():
    """The active Triton mode off (aten's own kernels back), then on again: for the FP64 reference."""
    if _active_mode is None:
        yield
        return
    _active_mode.disable_batch_invariant_mode()
    try:
        yield
    finally:
        _enable(_active_mode)


# ---- torch.compile (Inductor) ---------------------------------------------------------------------------

INDUCTOR_NAMES = {"default": "inductor", "max-autotune-no-cudagraphs": "inductor_max_autotune"}
DYNAMIC_WHY = {
    True: "rows dynamic (maybe_mark_dynamic on dim 0 of every per-row input), H3 widths static: one graph serves "
          "every row count, as torch.compile's automatic dynamic shapes do once a row count changes; dynamo "
          "still specializes 1-row calls, and grad mode and inputs requiring grad are guarded, so a no-grad call, "
          "a training call and a grad-enabled call without such inputs each compile their own graph. "
          "A graph per row count (inductor_dynamic=false) compiles for each of the dozens of row counts the "
          "checks use",
    False: "dynamic=False: every row count compiles its own graph (the recompile limit is raised so that dynamo "
           "never falls back to eager silently)",
}
RECOMPILE_LIMIT = {True: 64, False: 1024}
_FWD_KEY, _BWD_KEY = "_compile.compile_inner", "backward._backward_impl"   # torch._dynamo's compile timers


def _compile_totals() -> tuple[float, float, int, int, int]:
    """(forward compile s, lazy backward compile s, their counts, graphs dynamo made), process-wide so far."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    fwd, bwd = compilation_time_metrics.get(_FWD_KEY, ()), compilation_time_metrics.get(_BWD_KEY, ())
    return sum(fwd), sum(bwd), len(fwd), len(bwd), counters["stats"]["unique_graphs"]


class CompileBudgetExceeded(RuntimeError):
    pass


class CompileLog:
    """Every compile of one compiled candidate: which call (rows, grad mode) made it and how long it took.

    Forward graphs compile inside the candidate's call; AOTAutograd compiles a backward lazily at its first
    backward, after the call returned, so that time is attributed when any compiled candidate is next called
    (or the log is read) to the candidate that was called last. Calls run one at a time, so nothing else
    compiles in between."""
    _last: "CompileLog | None" = None
    _mark: tuple = (0.0, 0.0, 0, 0, 0)
    MAX_EVENTS = 32

    def __init__(self, mode: str, dynamic: bool, budget_s: float):
        self.mode, self.dynamic, self.budget_s = mode, dynamic, budget_s
        self.events: list[dict] = []
        self.left_off = 0
        self.fwd_s = self.bwd_s = 0.0
        self.graphs = self.backward_compiles = 0
        self.calls = 0
        self.context = (0, False)

    def _record(self, phase: str, seconds: float, count: int, graphs: int) -> None:
        rows, grad = self.context
        if phase == "forward":
            self.fwd_s += seconds
            self.graphs += graphs
        else:
            self.bwd_s += seconds
            self.backward_compiles += count
        if len(self.events) < self.MAX_EVENTS:
            self.events.append({"phase": phase, "rows": rows, "grad": grad, "seconds": round(seconds, 3),
                                "compiles": count})
        else:
            self.left_off += 1

    @classmethod
    def settle(cls) -> None:
        """Give the compile time spent since the last compiled call (its lazy backward) to that call's log."""
        now = _compile_totals()
        last, mark = cls._last, cls._mark
        if last is not None and now[3] > mark[3]:
            last._record("backward", now[1] - mark[1], now[3] - mark[3], 0)
        cls._mark = now

    @property
    def compile_s(self) -> float:
        return self.fwd_s + self.bwd_s

    def call(self, fn, args, rows: int):
        CompileLog.settle()
        if self.compile_s > self.budget_s:
            raise CompileBudgetExceeded(
                f"compiling took {self.compile_s:.1f} s, over the plan's inductor_compile_budget_s = "
                f"{self.budget_s:g} (graphs so far: {self.graphs}; --plan inductor_compile_budget_s=... "
                f"or inductor_modes=... changes it)")
        self.calls += 1
        before = _compile_totals()
        self.context = (rows, torch.is_grad_enabled())
        out = fn(*args)
        after = _compile_totals()
        if after[2] > before[2] or after[4] > before[4]:
            self._record("forward", after[0] - before[0], after[2] - before[2], after[4] - before[4])
        CompileLog._last, CompileLog._mark = self, after
        return out

    def summary(self) -> dict:
        CompileLog.settle()
        return {"mode": self.mode, "dynamic": "rows" if self.dynamic else False, "why": DYNAMIC_WHY[self.dynamic],
                "graphs": self.graphs, "backward_compiles": self.backward_compiles,
                "compile_s": round(self.compile_s, 3), "forward_compile_s": round(self.fwd_s, 3),
                "backward_compile_s": round(self.bwd_s, 3), "budget_s": self.budget_s, "calls": self.calls,
                "recompile_limit": RECOMPILE_LIMIT[self.dynamic], "events": list(self.events),
                "events_left_off": self.left_off}


def _raise_recompile_limit(dynamic: bool) -> None:
    """Room for every graph the checks need, and an error instead of dynamo's silent fall-back to eager."""
    cfg = torch._dynamo.config
    limit = RECOMPILE_LIMIT[dynamic]
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))
            break
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


def inductor_candidate(problem: Problem, mode: str, plan, device) -> Candidate:
    name = INDUCTOR_NAMES.get(mode, "inductor_" + re.sub(r"\W+", "_", mode))
    source = f"torch.compile(h3cute.reference.{problem.op}_replay, mode={mode!r}), torch {torch.__version__}"
    if device.type != "cuda" and not plan.inductor_on_cpu:
        return Candidate(name, source, unavailable=(
            "judged on a GPU only: on a CPU Inductor compiles C++ for every graph, which the CPU smoke's time "
            "does not cover (--plan inductor_on_cpu=true runs it)"))
    try:
        from h3cute import reference
        replay = getattr(reference, f"{problem.op}_replay")
    except Exception as e:
        return Candidate(name, source, unavailable=_first_line(e))
    importlib.import_module("torch._dynamo")   # a plain import here would make `torch` a local name
    _raise_recompile_limit(plan.inductor_dynamic)
    compiled = torch.compile(replay, mode=None if mode == "default" else mode,
                             dynamic=None if plan.inductor_dynamic else False)
    log = CompileLog(mode, plan.inductor_dynamic, plan.inductor_compile_budget_s)
    rows_at = [i for i, a in enumerate(problem.args) if a in problem.row_args]

    def call(*args):
        if plan.inductor_dynamic:
            for i in rows_at:
                torch._dynamo.maybe_mark_dynamic(args[i], 0)
        return log.call(compiled, args, args[rows_at[0]].shape[0] if rows_at else 0)
    return Candidate(name, source, call, has_backward=problem.has_backward, details=lambda: {"compile": log.summary()},
                     notes="compile time is not in any timing: it is listed under compile")


# ---- vllm-omni's MiniMax-H3 kernels -----------------------------------------------------------------------

@dataclass(frozen=True)
class OmniKernel:
    function: str
    args: tuple[str, ...]     # the op's argument names in the function's parameter order (eps follows)
    with_eps: bool
    numerics: str


VLLM_OMNI: dict[str, OmniKernel] = {
    "norm_modulate": OmniKernel(
        "rms_norm_indexed_scale_shift", ("x", "weight", "shift", "scale", "adaln_indices"), True,
        "one Triton program per row: RMSNorm, weight, scale and shift all in FP32, rounded to BF16 once at the "
        "store (diffusers rounds the normed value, its weight product and each modulation op to BF16)"),
    "gate_residual": OmniKernel(
        "indexed_gate", ("residual", "gate", "y", "adaln_indices"), False,
        "residual + gate[idx] * y in FP32, rounded to BF16 once (diffusers rounds the product, then the sum)"),
    "gate_residual_norm_modulate": OmniKernel(
        "indexed_gate_rms_norm_scale_shift",
        ("residual", "gate", "y", "weight", "shift", "scale", "adaln_indices"), True,
        "h = residual + gate[idx] * y in FP32, rounded to BF16 once; out = RMSNorm and modulation of that BF16 h "
        "in FP32, rounded once"),
}


def vllm_omni_candidate(problem: Problem, device) -> Candidate | None:
    kernel = VLLM_OMNI.get(problem.op)
    if kernel is None:
        return None
    name, source = "vllm_omni", f"vllm-omni {kernel.function} (Triton)"
    missing = [a for a in kernel.args if a not in problem.args]
    if missing:
        return Candidate(name, source, unavailable=(
            f"the op's arguments {problem.args} lack {missing}, which vllm-omni's {kernel.function} takes"))
    if device.type != "cuda":
        return Candidate(name, source, has_backward=False, unavailable=(
            "needs a CUDA device: on CPU tensors vllm-omni takes a torch fallback, not the Triton kernel"))
    try:
        module, desc = load(VLLM_OMNI_FILE)
        fn = getattr(module, kernel.function)
    except (PeerUnavailable, AttributeError) as e:
        return Candidate(name, source, has_backward=False, unavailable=str(e) if isinstance(e, PeerUnavailable)
                         else f"vllm-omni has no {kernel.function}")
    return Candidate(name, f"{desc}: {kernel.function} (Triton)", _omni_call(problem, kernel, fn),
                     has_backward=False, notes=f"forward only; numerics: {kernel.numerics}")


def _omni_call(problem: Problem, kernel: OmniKernel, fn):
    """The op's arguments in the kernel's order (eps = H3's, after them)."""
    order = [problem.args.index(a) for a in kernel.args]
    tail = (_eps(),) if kernel.with_eps else ()
    return lambda *args: fn(*(args[i] for i in order), *tail)


# ---- liger / quack RMSNorm, diffusers' modulation after it -----------------------------------------------

NORM_PEER_OPS = ("norm_modulate", "final_adaln_out")


def _norm_then_modulate(problem: Problem, norm):
    """The op with its RMSNorm replaced by `norm(x, weight, eps)`; everything else is the diffusers replay."""
    from h3cute import reference
    eps = _eps()
    if problem.op == "norm_modulate":
        return lambda x, weight, shift, scale, idx: reference.modulation_replay(norm(x, weight, eps), shift, scale, idx)

    def final_adaln_out(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices):
        shift, scale = reference.final_projection_replay(temb, proj_weight, proj_bias)
        return reference.modulation_replay(norm(x, norm_weight, eps), shift, scale, timestep_indices)
    return final_adaln_out


def liger_candidate(problem: Problem, device) -> Candidate | None:
    if problem.op not in NORM_PEER_OPS:
        return None
    name, source = "liger", "liger-kernel LigerRMSNormFunction (Triton, casting_mode='llama'), modulation in torch"
    if device.type != "cuda":
        return Candidate(name, source, unavailable="needs a CUDA device: liger's RMSNorm is a Triton kernel")
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction   # the Triton one (no backend dispatch)
        version = importlib.metadata.version("liger-kernel")
    except Exception as e:
        return Candidate(name, source, unavailable=(
            "liger-kernel is not installed" if not _importable("liger_kernel") else _first_line(e)))

    def norm(x, weight, eps):   # LigerRMSNorm's defaults: offset 0, llama casting, in-place dY, no row mode
        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", True, None)
    return Candidate(name, f"liger-kernel {version} LigerRMSNormFunction (Triton, casting_mode='llama'), "
                     "modulation in torch", _norm_then_modulate(problem, norm),
                     notes="llama casting: x and rstd in FP32, the normed value rounded to BF16 before the BF16 "
                           "weight product; the modulation (and final_adaln_out's projection) is diffusers'")


def quack_candidate(problem: Problem, device) -> Candidate | None:
    if problem.op not in NORM_PEER_OPS:
        return None
    name, source = "quack", "quack-kernels rmsnorm (CuTe DSL), modulation in torch"
    if device.type != "cuda":
        return Candidate(name, source, unavailable="needs a CUDA device: quack's RMSNorm is a CuTe DSL kernel")
    if not _importable("cutlass"):
        state = "installed" if _importable("quack") else "not installed either"
        return Candidate(name, source, unavailable=(
            "the CuTe DSL (nvidia-cutlass-dsl) is not installed here, and quack-kernels compiles its kernels with "
            f"it at run time, so it cannot run (quack-kernels: {state})"))
    try:
        from quack import rmsnorm
        version = importlib.metadata.version("quack-kernels")
    except Exception as e:
        return Candidate(name, source, unavailable=(
            "quack-kernels is not installed" if not _importable("quack") else _first_line(e)))
    return Candidate(name, f"quack-kernels {version} rmsnorm (CuTe DSL), modulation in torch",
                     _norm_then_modulate(problem, lambda x, w, eps: rmsnorm(x, w, eps=eps)),
                     notes="quack rounds x * rstd * weight (FP32) to BF16 once; the modulation (and "
                           "final_adaln_out's projection) is diffusers'")


# SGLang's timestep_embedding, measured by the B200 seed, is a JIT-built CUDA kernel of sglang.kernels.
NO_ADAPTER = {"timestep_sinusoid": ("sglang", "SGLang timestep_embedding",
                                    "no adapter here for SGLang's timestep_embedding (a CUDA kernel sglang builds "
                                    "at run time with its own JIT toolchain); the B200 seed report measured it")}


def peer_candidates(problem: Problem, plan, device) -> list[Candidate]:
    """The plain-mode peers of `problem` (each either runnable or unavailable with its reason)."""
    out = [inductor_candidate(problem, mode, plan, device) for mode in plan.inductor_modes]
    out += [c for c in (vllm_omni_candidate(problem, device), liger_candidate(problem, device),
                        quack_candidate(problem, device)) if c is not None]
    if problem.op in NO_ADAPTER:
        name, source, reason = NO_ADAPTER[problem.op]
        out.append(Candidate(name, source, unavailable=reason))
    return out
