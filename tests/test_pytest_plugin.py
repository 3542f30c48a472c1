"""The pytest plugin, run inside pytest (pytester) over a fake CUDA allocator (tests/fake_cuda.py):
the marker, --snaplab-max-peak, what is kept, the failure message, and the skips without a GPU.
The same plugin ran for real on a GPU (sample_snapshots/jobs/integrations_gpu.py)."""

from __future__ import annotations

import importlib.metadata
import re
import textwrap

import pytest

from .conftest import ROOT

pytest_plugins = ["pytester"]

FAKE_CUDA = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import snapshot_lab.capture
from tests.fake_cuda import FakeCudaTorch

FAKE = FakeCudaTorch()
sys.modules["torch"] = FAKE.module
sys.modules["torch.distributed"] = FAKE.dist
snapshot_lab.capture._OBSERVER_ATTACHED = False
"""

TESTS = """
import pytest
import torch


@pytest.mark.limit_cuda_memory("1 MiB")
def test_within():
    a = torch.cuda._fake_alloc(256 * 1024)
    torch.cuda._fake_free(a)


@pytest.mark.limit_cuda_memory("1 MiB")
def test_over():
    weights = torch.cuda._fake_alloc(3 * 2**20)  # the largest site at the peak
    scratch = torch.cuda._fake_alloc(2**20)
    torch.cuda._fake_free(scratch)


def test_unmarked():
    torch.cuda._fake_alloc(5 * 2**20)
"""


def _plugin_args() -> list[str]:
    """The plugin loads by itself when snaplab is installed (entry point pytest11), else by -p."""
    installed = any(
        ep.value == "snapshot_lab.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11")
    )
    return [] if installed else ["-p", "snapshot_lab.pytest_plugin"]


@pytest.fixture
def run(pytester):
    def go(*args: str, tests: str = TESTS, conftest: str = FAKE_CUDA):
        pytester.makeconftest(conftest)
        pytester.makepyfile(test_mem=tests)
        return pytester.runpytest(*_plugin_args(), "-p", "no:cacheprovider", *args)

    return go


def test_marker_fails_the_test_over_its_limit_and_keeps_the_evidence(run, pytester):
    r = run()
    r.assert_outcomes(passed=2, failed=1)
    out = r.stdout.str()
    assert "CUDA memory peak 4.00 MiB on device 0 exceeds the limit of 1.00 MiB" in out
    assert "@pytest.mark.limit_cuda_memory('1 MiB')" in out
    # the sites live at the peak, largest first, named by the test's own lines (read from the
    # failure section: newer pytest repeats the whole message in its short summary)
    failure = out.split("short test summary info")[0]
    sites = re.findall(r"(\d+\.\d+ MiB)\s+(\d+\.\d)%\s+(\S*test_mem\.py:(\d+) in test_over)", failure)
    assert [(s[0], s[1], int(s[3])) for s in sites] == [("3.00 MiB", "75.0", 13), ("1.00 MiB", "25.0", 14)]
    snapshot = re.search(r"Snapshot: (\S+\.pickle)", out).group(1)
    report = re.search(r"Report:   (\S+\.html)", out).group(1)
    kept = sorted(p.name for p in (pytester.path / "snaplab-pytest").iterdir())
    assert len(kept) == 3 and all(n.startswith("test_mem.py_test_over_rank0_") for n in kept)
    assert snapshot.endswith("_peak.pickle") and (pytester.path / snapshot).exists()
    html = (pytester.path / report).read_text()
    assert html.startswith("<!DOCTYPE html>") and "test_over" in html
    assert "snaplab: CUDA memory peaks" in out
    assert re.search(r"OVER\s+4.00 MiB / 1.00 MiB\s+test_mem.py::test_over", out)
    assert re.search(r"ok\s+256.00 KiB / 1.00 MiB\s+test_mem.py::test_within", out)


def test_max_peak_option_applies_to_every_test_and_the_marker_wins(run):
    r = run("--snaplab-max-peak", "4.5MiB")
    r.assert_outcomes(passed=1, failed=2)
    out = r.stdout.str()
    # test_over left 3 MiB allocated: the next test's peak counts them, and the message says so
    assert "8.00 MiB on device 0 exceeds the limit of 4.50 MiB (--snaplab-max-peak 4.50 MiB); 3.00 MiB were" in out
    # shares are of the whole peak; what predates the test's recording is a line of its own
    failure = out.split("short test summary info")[0]
    assert re.search(r"5\.00 MiB\s+62\.5%\s+\S*test_mem\.py:19 in test_unmarked", failure)
    assert re.search(r"3\.00 MiB\s+37\.5%\s+<allocated before the recording began \(no site\)>", failure)
    assert "exceeds the limit of 1.00 MiB (@pytest.mark.limit_cuda_memory('1 MiB'))" in out
    assert "snaplab: CUDA memory peak limit 4.50 MiB, keep failed" in out


def test_keep_all_and_keep_none(run, pytester):
    r = run("--snaplab-keep=all", "--snaplab-dir", "kept")
    r.assert_outcomes(passed=2, failed=1)
    names = [p.name for p in (pytester.path / "kept").iterdir()]
    assert sum(n.endswith(".html") for n in names) == 2  # the two measured tests, passing or not
    assert any(n.startswith("test_mem.py_test_within") and n.endswith("_test.pickle") for n in names)

    r = run("--snaplab-keep=none", "--snaplab-dir", "none")
    r.assert_outcomes(passed=2, failed=1)
    out = r.stdout.str()
    assert "test_mem.py:13 in test_over" in out and "Snapshot:" not in out
    assert not (pytester.path / "none").exists()


def test_an_oom_keeps_the_snapshot_taken_at_the_failing_request(run):
    tests = """
    import pytest
    import torch
    from conftest import FAKE

    class OutOfMemoryError(RuntimeError):
        pass

    @pytest.mark.limit_cuda_memory("10 MiB")
    def test_ooms():
        torch.cuda._fake_alloc(2**20)
        FAKE.observers[0](0, 2**30, 3 * 2**30, 10 * 2**30)
        raise OutOfMemoryError("CUDA out of memory")
    """
    r = run(tests=textwrap.dedent(tests))
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    assert "OutOfMemoryError: CUDA out of memory" in out  # the test's own failure stands
    assert re.search(r"Snapshot: \S+_oom\.pickle", out) and "Report:" in out


def test_without_cuda_the_marker_skips_with_a_reason(run):
    no_cuda = FAKE_CUDA + "\nFAKE.module.cuda.is_available = lambda: False\n"
    r = run("-rs", conftest=no_cuda)
    r.assert_outcomes(skipped=2, passed=1)
    assert "limit_cuda_memory: CUDA is not available" in r.stdout.str()


def test_without_torch_the_marker_skips_and_the_option_says_it_measures_nothing(run):
    tests = """
    import pytest

    @pytest.mark.limit_cuda_memory("1 GiB")
    def test_marked():
        pass

    def test_plain():
        pass
    """
    r = run(
        "-rs",
        "--snaplab-max-peak",
        "1GiB",
        tests=textwrap.dedent(tests),
        conftest="import sys\nsys.modules['torch'] = None\n",
    )
    r.assert_outcomes(skipped=1, passed=1)
    out = r.stdout.str()
    assert "limit_cuda_memory: torch is not installed" in out
    assert "snaplab: --snaplab-max-peak measures nothing: torch is not installed" in out


def test_inert_unless_asked(run):
    tests = "def test_plain():\n    assert True\n"
    r = run(tests=tests, conftest="import sys\nsys.modules['torch'] = None\n")
    r.assert_outcomes(passed=1)
    assert "snaplab:" not in r.stdout.str() and "CUDA memory" not in r.stdout.str()


def test_bad_sizes_are_usage_errors(run):
    r = run("--snaplab-max-peak", "lots")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "--snaplab-max-peak:" in r.stderr.str() and "'lots'" in r.stderr.str()
    tests = """
    import pytest

    @pytest.mark.limit_cuda_memory("big")
    def test_x():
        pass
    """
    r = run(tests=textwrap.dedent(tests))
    assert "@pytest.mark.limit_cuda_memory: not a byte size: 'big'" in r.stdout.str() + r.stderr.str()
    assert r.ret != 0


def _test_shaped_snapshot():
    """What a GPU test records: the model built in the test (parameters with stacks), a forward
    (an activation), a backward on autograd's thread (no Python stack: the gradients and a
    temporary), then the test returns and frees everything before the snapshot is taken."""
    from .conftest import event, make_snapshot

    test_frame = {"filename": "/work/tests/test_model.py", "line": 12, "name": "test_backward"}
    init = [{"filename": "/site/torch/nn/modules/linear.py", "line": 100, "name": "__init__"}, test_frame]
    forward = [{"filename": "/site/torch/nn/modules/module.py", "line": 1750, "name": "_call_impl"}, test_frame]
    MiB = 2**20
    params = [(0x1000000, 4 * MiB), (0x2000000, 8 * MiB)]
    grads = [(0x3000000, 4 * MiB), (0x4000000, 8 * MiB)]
    trace = [event("alloc", a, s, t, frames=init) for t, (a, s) in enumerate(params)]
    trace.append(event("alloc", 0x5000000, 16 * MiB, 10, frames=forward))
    trace += [event("alloc", a, s, 20 + t, frames=[]) for t, (a, s) in enumerate(grads)]
    trace += [event("alloc", 0x6000000, 2 * MiB, 30, frames=[]), event("free_completed", 0x6000000, 2 * MiB, 31)]
    trace.append(event("free_completed", 0x5000000, 16 * MiB, 32, frames=[]))
    trace += [event("free_completed", a, s, 40 + t, frames=[test_frame]) for t, (a, s) in enumerate(params + grads)]
    return make_snapshot([], [trace])


def test_failure_message_names_a_tests_gradients_as_gradients(snap_file):
    """The test's gradients are freed before the snapshot, with its model: the full category rules
    (parameters alive during the backward give the gradients' sizes) still call them gradients,
    where the sites said '<no stack recorded: activation>'."""
    from snapshot_lab.pytest_plugin import peak_sites

    sites, peak, before = peak_sites(snap_file(_test_shaped_snapshot()), 0)
    labels = {s.label: s.bytes for s in sites}
    assert labels["<no stack recorded: gradient>"] == 12 * 2**20
    assert labels["<no stack recorded: activation>"] == 2 * 2**20  # the backward's temporary
    assert peak == (4 + 8 + 16 + 4 + 8 + 2) * 2**20 and before == 0
