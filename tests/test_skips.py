"""The suite's skip rule (tests/conftest.py): on a CUDA machine a skip outside ALLOWED_SKIPS fails the session and
is named in the summary; an allowed skip, and any skip on a CPU machine, does not. Runs small pytest sessions
under this conftest with torch's CUDA queries stubbed (CPU only)."""
import textwrap
from pathlib import Path

import pytest

from conftest import ALLOWED_SKIPS, AllowedSkip, unexpected_skips

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


def test_every_allowed_skip_names_its_reason():
    for entry in ALLOWED_SKIPS:
        assert entry.nodeids.startswith("tests/") and entry.reason and len(entry.why) > 20, entry


def test_unexpected_skips_need_node_reason_and_condition():
    entry = AllowedSkip(r"tests/test_a\.py::", r"sm_90a only", lambda: True, "only Hopper has it")
    never = AllowedSkip(r"tests/test_a\.py::", r"sm_90a only", lambda: False, "the condition does not hold here")
    skipped = [("tests/test_a.py::test_x", "the path is sm_90a only"),
               ("tests/test_b.py::test_x", "the path is sm_90a only"),  # another file
               ("tests/test_a.py::test_y", "launch module missing")]  # another reason
    assert unexpected_skips(skipped, (entry,)) == skipped[1:]
    assert unexpected_skips(skipped, (never,)) == skipped


def _session(pytester, cuda: bool, capability=(10, 0), unexpected=False):
    """A session with one passing test and one skip that ALLOWED_SKIPS covers on sm_100a (plus, with
    `unexpected`, one it does not), under this conftest with torch.cuda stubbed."""
    pytester.makeini("[pytest]\n")
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "conftest.py").write_text(textwrap.dedent(f"""
        import torch
        torch.cuda.is_available = lambda: {cuda}
        torch.cuda.get_device_capability = lambda *args: {capability}
        exec(compile(open({str(CONFTEST)!r}).read(), {str(CONFTEST)!r}, "exec"))
    """))
    (pytester.path / "tests" / "test_timestep_mlp.py").write_text(textwrap.dedent("""
        import pytest

        def test_runs():
            pass

        def test_wgmma_path():
            pytest.skip("the TF32 wgmma path is sm_90a only")
    """))
    if unexpected:
        (pytester.path / "tests" / "test_ops_gpu.py").write_text(textwrap.dedent("""
            import pytest

            def test_op():
                pytest.skip("launch module missing")
        """))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "tests")


def test_an_allowed_skip_passes_on_cuda(pytester):
    result = _session(pytester, cuda=True)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["*1 allowed skips*, 0 unexpected*"])


def test_an_unexpected_skip_fails_on_cuda_and_is_named(pytester):
    result = _session(pytester, cuda=True, unexpected=True)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(["UNEXPECTED SKIP tests/test_ops_gpu.py::test_op: launch module missing",
                                 "*1 unexpected: the session fails*"])


def test_an_allowed_skip_is_allowed_only_where_its_condition_holds(pytester):
    result = _session(pytester, cuda=True, capability=(9, 0))  # on Hopper the wgmma path must run
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(["UNEXPECTED SKIP tests/test_timestep_mlp.py::test_wgmma_path:*"])


def test_skips_on_a_cpu_machine_do_not_fail(pytester):
    result = _session(pytester, cuda=False, unexpected=True)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
