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


STATE = {"table": [1, 2, 3]}


def _drop_table() -> None:
    STATE.pop("table")


@forks
def test_first_runs_in_the_child_alone():
    """What the child drops before its work is dropped there, not here."""
    job = Aside(lambda: sorted(STATE), first=_drop_table)
    assert job.forked and job.result() == []
    assert STATE == {"table": [1, 2, 3]}


def test_first_is_not_called_without_a_child(monkeypatch):
    monkeypatch.setenv(aside.JOBS_VARIABLE, "1")
    job = Aside(lambda: sorted(STATE), first=_drop_table)
    assert not job.forked and job.result() == ["table"]
    assert STATE == {"table": [1, 2, 3]}


def test_one_job_keeps_the_work_here(monkeypatch):
    monkeypatch.setenv(aside.JOBS_VARIABLE, "1")
    calls = Calls([1, 2, 3])
    job = Aside(calls)
    assert not job.forked
    assert calls.here == 0  # nothing runs before it is asked for
    assert job.result() == [1, 2, 3]
    assert calls.here == 1


def test_a_pool_worker_keeps_the_work_here(monkeypatch):
    """``ranks``' pool workers are made to compute each file themselves (one_process)."""
    monkeypatch.setenv(aside.JOBS_VARIABLE, "")  # put back as it was after the test
    monkeypatch.setattr(aside, "cpus", lambda: 8)
    assert aside.may_fork() == ("fork" in aside.mp.get_all_start_methods())
    aside.one_process()
    assert os.environ[aside.JOBS_VARIABLE] == "1"
    assert not aside.may_fork() and not Aside(Calls([1])).forked


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
def test_a_worker_answers_its_jobs_in_its_own_process_in_order():
    parent = os.getpid()
    worker = aside.Worker("os")
    assert worker.forked
    jobs = [worker.submit("getpid"), worker.submit("getcwd"), worker.submit("getpid")]
    child = worker.result(jobs[0])
    assert child != parent and worker.result(jobs[2]) == child
    assert worker.result(jobs[1]) == os.getcwd()
    worker.close()
    assert not worker._child.is_alive()  # it ended when its job pipe closed


@forks
def test_a_job_that_fails_in_the_worker_is_computed_here_and_raises_here():
    worker = aside.Worker("math")
    bad, good = worker.submit("sqrt", -1.0), worker.submit("sqrt", 16.0)
    with pytest.raises(ValueError, match="math domain error"):
        worker.result(bad)
    assert worker.result(good) == 4.0
    worker.close()


def test_without_a_second_process_the_worker_computes_here(monkeypatch):
    monkeypatch.setenv(aside.JOBS_VARIABLE, "1")
    worker = aside.Worker("os")
    assert not worker.forked
    assert worker.result(worker.submit("getpid")) == os.getpid()
    worker.close()


@forks
def test_the_report_figures_are_drawn_by_the_worker_and_set_on_their_sections():
    """report.py's figures: each asked of the worker as soon as it is known, set in order on its
    section at resolve (here the worker's module is ``os``, its "figure" the process it ran in)."""
    from types import SimpleNamespace

    from snapshot_lab.report import _Figures

    first, second = SimpleNamespace(getpid=""), SimpleNamespace(getpid="", getcwd="")
    worker = aside.Worker("os")
    figures = _Figures(worker)
    figures.later(first, "getpid")  # type: ignore[arg-type]
    figures.later(second, "getcwd")  # type: ignore[arg-type]
    figures.later(second, "getpid")  # type: ignore[arg-type]
    figures.resolve()
    worker.close()
    assert first.getpid == second.getpid != os.getpid()
    assert second.getcwd == os.getcwd()


@forks
def test_the_dumps_figures_are_asked_before_the_analyses(monkeypatch):
    """The block layout and the free-block histogram (half a 1M-entry report's drawing) need
    only the dump and the OOM's moment: the worker is asked for them before the explorer's and
    the findings' analyses, and draws them meanwhile; the timeline's figures after."""
    import importlib

    from snapshot_lab import api

    from .conftest import sample_path

    report = importlib.import_module("snapshot_lab.report")
    order: list[str] = []

    class Asked(aside.Worker):
        def submit(self, name, *args):
            order.append(name)
            return super().submit(name, *args)

    explore = report.explore
    monkeypatch.setattr(report, "explore", lambda *a, **k: order.append("explore") or explore(*a, **k))
    for name in ("oom_fragmentation", "transformer_varlen"):
        order.clear()
        frames = api.load_frames(sample_path(name))
        drawer = Asked(report.DRAWN)
        ctx = report.build_report_context(frames, api._stats_beside(frames), drawer=drawer)
        drawer.close()
        assert order.index("histogram_svg") < order.index("explore"), (name, order)
        assert order.index("layout_png") < order.index("explore") < order.index("timeline_png"), (name, order)
        section = ctx.devices[0]
        assert len(section.layout_png) > 1000 and "<svg" in section.histogram_svg, name  # set at resolve


@forks
def test_a_child_never_waits_on_the_parents_streams(monkeypatch):
    """A child prints nothing through the streams it inherited: a parent thread (a progress bar's
    refresh) may have held their locks at the fork, and a warning the child printed (matplotlib
    building its font cache) would wait for them forever. Here the parent's stderr blocks every
    write; the child's goes to the null device."""
    import sys

    held = threading.Lock()
    held.acquire()

    class Stuck:
        def write(self, text: str) -> int:
            held.acquire()  # as a lock held at the fork: never released in the child
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Stuck())

    def noisy() -> int:
        print("Matplotlib is building the font cache; this may take a moment.", file=sys.stderr)
        return os.getpid()

    job = Aside(noisy)
    assert job.forked
    assert job._conn is not None and job._conn.poll(30)  # it answered (before: it waited forever)
    assert job.result() != os.getpid()
    worker = aside.Worker("warnings")  # its warning is printed to stderr
    answer = worker.submit("warn", "from the worker")
    waited: list[object] = []
    reader = threading.Thread(target=lambda: waited.append(worker.result(answer)), daemon=True)
    reader.start()
    reader.join(30)
    assert waited == [None]  # it answered (before: it waited on the parent's stderr forever)
    worker.close()


def test_beside_computes_in_another_thread_and_gives_its_value():
    from snapshot_lab.aside import Beside

    started = threading.Event()
    release = threading.Event()

    def work():
        started.set()
        release.wait(5)
        return threading.get_ident(), 6 * 7

    beside = Beside(work)
    assert started.wait(5)  # running before result() is asked for
    release.set()
    ident, value = beside.result()
    assert value == 42
    assert ident != threading.get_ident()
    assert beside.result() == (ident, 42)  # asked again: the same value


def test_beside_raises_what_its_function_raised_in_the_caller():
    from snapshot_lab.aside import Beside

    def work():
        raise KeyError("gone")

    beside = Beside(work)
    with pytest.raises(KeyError, match="gone"):
        beside.result()


def test_the_report_names_the_file_by_its_sha256(tmp_path):
    import hashlib

    from snapshot_lab import api

    sample = os.path.join(os.path.dirname(__file__), "..", "sample_snapshots", "cnn_clean.pickle.xz")
    out = api.report(sample, output=tmp_path / "r.md", format="md")
    with open(sample, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    assert f"sha256 `{digest}`" in out.read_text()


def test_a_daemon_process_keeps_the_work_here(monkeypatch):
    """A daemonic process (an Aside's own child, a Dask worker) may not have children: it
    computes the value itself rather than fail to fork."""
    import multiprocessing as mp

    monkeypatch.setattr(mp.current_process(), "daemon", True, raising=False)
    monkeypatch.setattr(aside, "cpus", lambda: 4)
    assert aside.may_fork() is False
    value = Aside(lambda: os.getpid())
    assert not value.forked
    assert value.result() == os.getpid()


def test_the_stats_are_the_same_with_the_recording_described_beside_or_here(monkeypatch):
    from snapshot_lab import api
    from snapshot_lab.metrics.recording import recording_of
    from snapshot_lab.metrics.stats.summary import compute_stats

    sample = os.path.join(os.path.dirname(__file__), "..", "sample_snapshots", "fit_gpt2_b4_late_oom_python.pickle.xz")
    frames = api.load_frames(sample)
    here = compute_stats(frames)
    given = compute_stats(frames, recording=lambda: recording_of(frames))
    monkeypatch.setattr(aside, "cpus", lambda: 4)
    beside = api._stats_beside(frames)
    assert here.recording.to_dict()["devices"][0]["events"] > 1000  # a real trace
    assert here.to_dict() == given.to_dict() == beside.to_dict()


# --------------------------------------------------------------------------- spread


def _pid_and(value: object) -> tuple[int, object]:
    return os.getpid(), value


@forks
def test_spread_computes_the_shares_in_children_and_keeps_the_order(monkeypatch):
    """Job i goes to process i mod n (this one takes 0, n, ...); the values come back in order."""
    monkeypatch.setattr(aside, "cpus", lambda: 8)
    monkeypatch.setenv(aside.JOBS_VARIABLE, "3")
    out = aside.spread([lambda v=v: _pid_and(v) for v in "abcdefg"])
    assert [value for _, value in out] == list("abcdefg")
    pids = [pid for pid, _ in out]
    assert pids[0] == pids[3] == pids[6] == os.getpid()
    assert pids[1] == pids[4] != pids[2] == pids[5]
    assert os.getpid() not in (pids[1], pids[2])


def test_spread_in_one_process_computes_each_here_in_turn(monkeypatch):
    monkeypatch.setenv(aside.JOBS_VARIABLE, "1")
    order: list[int] = []
    out = aside.spread([lambda i=i: order.append(i) or _pid_and(i) for i in range(4)])
    assert order == [0, 1, 2, 3]
    assert out == [(os.getpid(), i) for i in range(4)]
    assert aside.spread([]) == []


def test_workers_are_the_cpus_unless_snaplab_jobs_says_fewer(monkeypatch):
    monkeypatch.setattr(aside, "cpus", lambda: 8)
    monkeypatch.delenv(aside.JOBS_VARIABLE, raising=False)
    assert aside.workers() == 8
    monkeypatch.setenv(aside.JOBS_VARIABLE, "3")
    assert aside.workers() == 3
    monkeypatch.setenv(aside.JOBS_VARIABLE, "64")
    assert aside.workers() == 8
    monkeypatch.setenv(aside.JOBS_VARIABLE, "0")
    assert aside.workers() == 1
    monkeypatch.setenv(aside.JOBS_VARIABLE, "many")
    assert aside.workers() == 8


@forks
def test_spread_raises_the_first_error_in_the_jobs_order(monkeypatch):
    """Job 1 (a child's) fails and so does job 2 (this process's): job 1's error is the one raised,
    computed again here, as computing the jobs in turn would raise it."""
    monkeypatch.setenv(aside.JOBS_VARIABLE, "2")
    parent = os.getpid()
    raised_here: list[int] = []

    def fail(i: int) -> int:
        if os.getpid() == parent:
            raised_here.append(i)
        raise ValueError(f"job {i}")

    jobs = [lambda: 0, lambda: fail(1), lambda: fail(2), lambda: 3]
    with pytest.raises(ValueError, match="job 1"):
        aside.spread(jobs)
    assert raised_here == [2, 1]  # 2 in this process's share, then 1 again here


@forks
def test_spread_computes_here_what_a_child_could_not_send(monkeypatch):
    """A child that dies, and a value that does not pickle: computed here, the same values."""
    monkeypatch.setattr(aside, "cpus", lambda: 8)
    monkeypatch.setenv(aside.JOBS_VARIABLE, "3")
    parent = os.getpid()
    lock = threading.Lock()

    def die_in_a_child() -> str:
        if os.getpid() != parent:
            os._exit(3)
        return "computed here"

    out = aside.spread([lambda: 0, die_in_a_child, lambda: lock, lambda: "sent"])
    assert out == [0, "computed here", lock, "sent"]


@forks
def test_an_asides_child_spreads_its_work_too():
    """fit's child in the report (a daemon, which multiprocessing lets have no children) forks the
    levers' replays all the same."""
    job = Aside(lambda: (os.getpid(), [pid for pid, _ in aside.spread([lambda: _pid_and(0), lambda: _pid_and(1)])]))
    child, pids = job.result()
    assert job.forked and child != os.getpid()
    assert pids[0] == child and pids[1] not in (child, os.getpid())


@forks
@pytest.mark.parametrize("workers", ["2", "5"])
def test_fit_and_its_strategies_are_the_same_spread_or_in_turn(real_frames, monkeypatch, workers):
    """A recorded whole step under a limit: every lever, the allocator settings and the parallel
    strategies (a dozen replays), computed by processes of their own or in turn, equal."""
    from snapshot_lab.metrics._jobs import in_turn
    from snapshot_lab.metrics.fit.result import compute_fit

    monkeypatch.setattr(aside, "cpus", lambda: 8)
    monkeypatch.setenv(aside.JOBS_VARIABLE, workers)
    frames = real_frames("fit_gpt2_b4_complete_python")
    spread_out = compute_fit(frames, memory_limit=6 << 30, recorded_batch=4, spread=aside.spread)
    turn = compute_fit(frames, memory_limit=6 << 30, recorded_batch=4, spread=in_turn)
    assert len(turn.levers) >= 8 and len(turn.parallel_strategies) >= 10
    assert spread_out == turn


@forks
def test_a_plan_table_is_the_same_spread_or_in_turn(real_frames, monkeypatch):
    """``snaplab plan``'s table of every usual strategy: the plans come back whole from the children."""
    from snapshot_lab.metrics._jobs import in_turn
    from snapshot_lab.metrics.plan import plan_table

    monkeypatch.setattr(aside, "cpus", lambda: 8)
    frames = real_frames("fit_gpt2_b4_complete_python")
    turn = plan_table(frames, 4, memory_limit=6 << 30, spread=in_turn)
    assert len(turn.plans) == 8 and not turn.skipped
    assert plan_table(frames, 4, memory_limit=6 << 30, spread=aside.spread) == turn


@forks
def test_a_pipelines_stages_are_the_same_spread_or_in_turn(real_frames, monkeypatch):
    """``plan --strategy pp``: each stage's program built and replayed by a process of its own."""
    from snapshot_lab.metrics.plan import Strategy, plan_memory

    monkeypatch.setattr(aside, "cpus", lambda: 8)
    frames = real_frames("fit_gpt2_b4_complete_python")
    turn = plan_memory(frames, Strategy("pp", 4))
    assert [rank.label.split(" (")[0] for rank in turn.ranks] == [f"stage {i}" for i in range(4)]
    assert len({rank.peak_allocated_bytes for rank in turn.ranks}) > 1
    assert plan_memory(frames, Strategy("pp", 4), spread=aside.spread) == turn


@forks
def test_the_whatif_is_the_same_spread_or_in_turn(real_frames, monkeypatch):
    """A trace that starts mid-run: the scenarios from a steady state and its baseline, spread."""
    from snapshot_lab.metrics.allocator.model import AllocatorSettings, apply_conf
    from snapshot_lab.metrics.allocator.whatif import START_STEADY, analyse_whatif

    monkeypatch.setattr(aside, "cpus", lambda: 8)
    settings = [
        apply_conf(AllocatorSettings(), conf) for conf in ([], ["expandable_segments:True"], ["max_split_size_mb:64"])
    ]
    frames = real_frames("twin_wrapped")
    spread_out = analyse_whatif(frames, 0, settings, None, spread=aside.spread)
    turn = analyse_whatif(frames, 0, settings, None)
    assert spread_out.steady_baseline is not None and spread_out.scenarios[1].start == START_STEADY
    assert spread_out == turn


class _Interrupted(BaseException):
    """Stands for KeyboardInterrupt (which pytest would take as the user's)."""


@forks
def test_an_interrupted_spread_kills_its_children_and_raises(monkeypatch):
    """Interrupted in its own share, this process does not wait for the children's (here a
    minute's sleep): they are killed and reaped, and the interrupt goes on up."""
    import time

    monkeypatch.setattr(aside, "cpus", lambda: 8)
    monkeypatch.setenv(aside.JOBS_VARIABLE, "2")

    def interrupt() -> None:
        time.sleep(0.2)  # the child is in its sleep by now
        raise _Interrupted

    forked = []
    fork_share = aside._fork_share

    def recorded(*args):
        child = fork_share(*args)
        forked.append(child[0])
        return child

    monkeypatch.setattr(aside, "_fork_share", recorded)
    started = time.monotonic()
    with pytest.raises(_Interrupted):
        aside.spread([interrupt, lambda: time.sleep(60)])
    assert time.monotonic() - started < 10
    assert len(forked) == 1
    with pytest.raises(ChildProcessError):
        os.waitpid(forked[0], os.WNOHANG)  # reaped already: not even a zombie left


def test_spread_forks_no_more_children_than_the_memory_allows(monkeypatch, tmp_path):
    """A child may come to need what its parent holds: 3 GiB held, 10 GiB available, 80% of it
    used: room for this process and two children; with 2 GiB available, for this one alone (the
    jobs then computed here, in turn); where the system does not say, every CPU."""
    from snapshot_lab import sizing

    monkeypatch.setattr(aside, "cpus", lambda: 8)
    monkeypatch.delenv(aside.JOBS_VARIABLE, raising=False)
    monkeypatch.setattr(aside, "_resident_bytes", lambda: 3 << 30)
    monkeypatch.setattr(sizing, "available_memory", lambda: 10 << 30)
    assert aside._room_for() == 3
    monkeypatch.setattr(sizing, "available_memory", lambda: 2 << 30)
    assert aside._room_for() == 1
    assert aside.spread([lambda: _pid_and(0), lambda: _pid_and(1)]) == [(os.getpid(), 0), (os.getpid(), 1)]
    monkeypatch.setattr(sizing, "available_memory", lambda: None)
    assert aside._room_for() > 1000
    statm = tmp_path / "statm"
    statm.write_text("5000 1200 300 1 0 900 0\n")
    monkeypatch.undo()
    assert aside._resident_bytes(str(statm)) == 1200 * os.sysconf("SC_PAGE_SIZE")
    assert aside._resident_bytes(str(tmp_path / "absent")) is None
