"""Shared test set-up: GPU tests run only where a supported CUDA device is present, and on a CUDA machine no test
skips silently: any skip outside `ALLOWED_SKIPS` fails the session (a skipped GPU test is not a pass)."""
import importlib.util
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch


def _gpu_reason():
    if not torch.cuda.is_available():
        return "no CUDA device (GPU tests run on the device machine: perf/device_run.sh)"
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"GPU capability {major}.x is not a target (sm_90a / sm_100a)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- skips a CUDA run may report -------------------------------------------------------------------------

def _missing(module: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(module) is None


def _capability_is_not(major: int) -> Callable[[], bool]:
    return lambda: torch.cuda.get_device_capability()[0] != major


@dataclass(frozen=True)
class AllowedSkip:
    """A skip that a CUDA run may report: its test ids (regex on the node id), its reason (regex), the condition
    on this machine under which it is expected, and why that is not a hole in the GPU suite."""

    nodeids: str
    reason: str
    when: Callable[[], bool]
    why: str

    def covers(self, nodeid: str, reason: str) -> bool:
        return bool(re.match(self.nodeids, nodeid) and re.search(self.reason, reason) and self.when())


ALLOWED_SKIPS = (
    AllowedSkip(r"tests/test_(bundle_picks|compile_kernels|tf32_wgmma|timestep_mlp|timestep_sinusoid)\.py",
                r"CuTe DSL|cutlass", _missing("cutlass"),
                "compile-only CPU checks; the device runs prebuilt kernels without the CuTe DSL (the CPU suite "
                "compiles every variant)"),
    AllowedSkip(r"tests/test_patch_model_gpu\.py::", r"FlashAttention-4", _missing("flash_attn"),
                "scope='model' attends with FlashAttention-4, CuTe DSL kernels compiled at run time: the device has it "
                "only when the DSL travelled (perf/stage_dsl.sh); the CPU suite checks the patch with SDPA in its "
                "place"),
    AllowedSkip(r"tests/test_hardening\.py::test_gpu_.*\[attention", r"FlashAttention-4", _missing("flash_attn"),
                "h3::attention runs FlashAttention-4 on CUDA, CuTe DSL kernels compiled at run time: the device has it "
                "only when the DSL travelled (perf/stage_dsl.sh); tests/test_patch_model_gpu.py runs it then"),
    AllowedSkip(r"tests/test_adaln_projection\.py::test_configs_written_as_overrides", r"CuTe DSL",
                _missing("cutlass"), "a config written on the command line compiles on demand; the device runs the "
                "bundle's picks unless the DSL travelled (perf/stage_dsl.sh), and the CPU suite compiles overrides"),
    AllowedSkip(r"tests/test_adaln_projection\.py::", r"the wgmma family is sm_90a only", _capability_is_not(9),
                "the BF16 wgmma family exists for Hopper only; on Blackwell the op runs the warp family"),
    AllowedSkip(r"tests/test_timestep_mlp\.py::", r"the TF32 wgmma path is sm_90a only", _capability_is_not(9),
                "the TF32 wgmma path exists for Hopper only; on Blackwell the op runs mma.sync"),
    AllowedSkip(r"tests/test_bench\.py::", r"matplotlib", _missing("matplotlib"),
                "plots need the optional `plot` extra; the reports they draw are tested without it"),
)

_skipped: list = []


def _reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append((report.nodeid, _reason(report)))


def pytest_collectreport(report):
    if report.skipped:
        _skipped.append((report.nodeid, _reason(report)))


def unexpected_skips(skipped, allowed=ALLOWED_SKIPS) -> list:
    """The (node id, reason) pairs of `skipped` that no allow-list entry covers."""
    return [(nodeid, reason) for nodeid, reason in skipped if not any(a.covers(nodeid, reason) for a in allowed)]


def pytest_sessionfinish(session, exitstatus):
    if torch.cuda.is_available() and unexpected_skips(_skipped) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not torch.cuda.is_available() or not _skipped:
        return
    bad = unexpected_skips(_skipped)
    terminalreporter.section("skips on a CUDA machine")
    for nodeid, reason in bad:
        terminalreporter.line(f"UNEXPECTED SKIP {nodeid}: {reason}")
    terminalreporter.line(f"{len(_skipped) - len(bad)} allowed skips (tests/conftest.py ALLOWED_SKIPS), "
                          f"{len(bad)} unexpected" + (": the session fails" if bad else ""))


@pytest.fixture(autouse=True)
def _fresh_launch_plans(monkeypatch):
    """Launch plans keep the kernels `runtime.kernel` gave when they were built (h3cute.launch.plan): a test that
    stands in for `runtime.kernel` needs plans built through its stand-in, so each test starts with no plans."""
    from h3cute.launch import plan

    monkeypatch.setattr(plan, "_cache", {})
