"""Work beside the report (``snapshot_lab.aside``): the value is the one computed here, whether a
forked child computed it or not; a child that fails in any way leaves the work to this process,
which raises the error itself; ``SNAPLAB_JOBS=1`` or one CPU keeps everything in one process."""

from __future__ import annotations

import os
import threading

import pytest

from snapshot_lab import aside
from snapshot_lab.aside import Aside

forks = pytest.mark.skipif(not aside.may_fork(), reason="no fork here, or one CPU")


class Calls:
    """Counts calls made in this process (a forked child's calls do not reach it)."""

    def __init__(self, value: object) -> None:
        self.value, self.here = value, 0

    def __call__(self) -> object:
        self.here += 1
        return self.value


@forks
@pytest.mark.parametrize("value", [{"peak": 123, "levers": ["bf16", "checkpointing"]}, None, 0, ""])
def test_a_child_computes_the_value_and_this_process_does_not(value):
    """None and other falsy values count as sent: computing them again here would double the time."""
    calls = Calls(value)
    job = Aside(calls)
    assert job.forked
    assert job.result() == value
    assert calls.here == 0
    assert job.result() == value  # asked twice, waited for once
    assert calls.here == 0


def test_one_job_keeps_the_work_here(monkeypatch):
    monkeypatch.setenv(aside.JOBS_VARIABLE, "1")
    calls = Calls([1, 2, 3])
    job = Aside(calls)
    assert not job.forked
    assert calls.here == 0  # nothing runs before it is asked for
    assert job.result() == [1, 2, 3]
    assert calls.here == 1


def test_one_cpu_keeps_the_work_here(monkeypatch):
    monkeypatch.delenv(aside.JOBS_VARIABLE, raising=False)
    monkeypatch.setattr(aside, "cpus", lambda: 1)
    assert not aside.may_fork()
    monkeypatch.setattr(aside, "cpus", lambda: 2)
    monkeypatch.setenv(aside.JOBS_VARIABLE, "0")
    assert not aside.may_fork()


@forks
def test_an_error_in_the_child_is_raised_here():
    def fail() -> int:
        raise ValueError("no step in this trace")

    job = Aside(fail)
    assert job.forked
    with pytest.raises(ValueError, match="no step in this trace"):
        job.result()


@forks
def test_a_value_that_does_not_pickle_is_computed_here():
    lock = threading.Lock()  # locks do not pickle
    calls = Calls(lock)
    job = Aside(calls)
    assert job.result() is lock
    assert calls.here == 1


@forks
def test_a_child_that_dies_leaves_the_work_here():
    parent = os.getpid()
    here = []

    def die_in_the_child() -> str:
        if os.getpid() != parent:
            os._exit(3)
        here.append(1)
        return "computed here"

    job = Aside(die_in_the_child)
    assert job.result() == "computed here"
    assert here == [1]


@forks
def test_the_report_is_the_same_with_the_fit_beside_it_or_not(tmp_path, monkeypatch):
    """A real OOM snapshot whose report leads with fit's answer: the same bytes either way."""
    from pathlib import Path

    from snapshot_lab import api

    sample = Path(__file__).resolve().parents[1] / "sample_snapshots" / "fit_gpt2_b32_oom_python.pickle.xz"
    beside = api.report(sample, output=tmp_path / "beside.html")
    monkeypatch.setenv(aside.JOBS_VARIABLE, "1")
    here = api.report(sample, output=tmp_path / "here.html")
    text = Path(beside).read_text()
    assert "A whole step at the recorded batch needs about 38.2 GiB" in text
    assert text == Path(here).read_text()


@forks
def test_the_report_figures_are_drawn_in_one_child_and_set_on_their_sections():
    """report.py's figures: those asked for before a start are drawn together in one child (a
    child per figure made five processes share two CPUs), then set in order on their sections."""
    from types import SimpleNamespace

    from snapshot_lab.report import _Figures

    parent = os.getpid()
    first, second = SimpleNamespace(histogram_svg="", layout_png=""), SimpleNamespace(timeline_png="")
    figures = _Figures()
    figures.later(first, "histogram_svg", lambda: f"histogram {os.getpid()}")  # type: ignore[arg-type]
    figures.later(first, "layout_png", lambda: f"layout {os.getpid()}")  # type: ignore[arg-type]
    figures.start()
    figures.later(second, "timeline_png", lambda: f"timeline {os.getpid()}")  # type: ignore[arg-type]
    figures.resolve()  # starts what is pending, then waits for both children
    one = first.histogram_svg.split()[1]
    assert first.layout_png == f"layout {one}" and int(one) != parent
    assert second.timeline_png.startswith("timeline ") and second.timeline_png.split()[1] not in (one, str(parent))
