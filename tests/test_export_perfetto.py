"""``snaplab export --format perfetto``: a Chrome trace (Trace Event Format, JSON object form)
that Perfetto and chrome://tracing open, whose counters peak where torch's counters did."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_BAD_INPUT, EXIT_OUTPUT, EXIT_USAGE
from snapshot_lab.render.perfetto import (
    EVENT_ORDER_CLOCK,
    MAX_COUNTER_POINTS,
    build_perfetto_trace,
    counter_points,
    select_slices,
)

from .conftest import event, make_snapshot, sample_path, sample_truth, segment, write_pickle

runner = CliRunner()

# --------------------------------------------------------------------------- the format's rules

# the keys an event may carry (Trace Event Format, "Event Descriptions")
KNOWN_KEYS = {"name", "cat", "ph", "ts", "tts", "pid", "tid", "dur", "tdur", "args", "id", "id2", "s", "bp", "cname"}
PHASES = set("BEXiICbnesftPNODMVvRc(),")
METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_event(e: dict[str, Any]) -> None:
    """One event against the format's rules for its phase (every event here carries name, ph,
    ts, pid and tid, metadata included)."""
    assert set(e) <= KNOWN_KEYS, set(e) - KNOWN_KEYS
    assert isinstance(e["name"], str) and e["name"]
    assert e["ph"] in PHASES
    assert _is_number(e["ts"]) and e["ts"] >= 0
    assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    if "args" in e:
        assert isinstance(e["args"], dict)
    ph = e["ph"]
    if ph == "X":
        assert _is_number(e["dur"]) and e["dur"] >= 0
    elif ph == "C":
        assert e["args"] and all(_is_number(v) for v in e["args"].values())
    elif ph in "bne":
        assert isinstance(e.get("cat"), str) and e["cat"]
        assert isinstance(e.get("id"), (int, str)) or isinstance(e.get("id2"), dict)
    elif ph in "iI":
        assert e.get("s", "t") in ("g", "p", "t")
    elif ph == "M":
        assert e["name"] in METADATA_NAMES
        key = {"process_labels": "labels"}.get(e["name"], "sort_index" if "sort" in e["name"] else "name")
        assert key in e["args"]


def check_trace(trace: dict[str, Any]) -> None:
    """The JSON object form: every event valid, async begins and ends paired (same pid, cat,
    name and id; the end not before the begin), counters in time order per track, and the whole
    thing plain JSON (no NaN, no objects json cannot write)."""
    assert set(trace) <= {"traceEvents", "displayTimeUnit", "otherData", "systemTraceEvents", "stackFrames"}
    assert trace["displayTimeUnit"] in ("ms", "ns")
    json.dumps(trace, allow_nan=False)
    opened: dict[tuple[Any, ...], float] = {}
    last_counter: dict[tuple[Any, ...], float] = {}
    for e in trace["traceEvents"]:
        check_event(e)
        key = (e["pid"], e.get("cat"), e["name"], e.get("id"))
        if e["ph"] == "b":
            assert key not in opened
            opened[key] = e["ts"]
        elif e["ph"] == "e":
            assert e["ts"] >= opened.pop(key)
        elif e["ph"] == "C":
            track = (e["pid"], e["name"])
            assert e["ts"] >= last_counter.get(track, 0.0)
            last_counter[track] = e["ts"]
    assert opened == {}


def counter_peak(trace: dict[str, Any], name: str, pid: int) -> int:
    return max(
        e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == name and e["pid"] == pid
    )


# --------------------------------------------------------------------------- real recordings


@pytest.mark.parametrize("name", ["oom_fragmentation", "dataparallel", "expandable", "cuda_graph", "ring_wrapped"])
def test_every_event_follows_the_trace_event_format(real_frames, name):
    trace = build_perfetto_trace(real_frames(name), source=name, version="test")
    check_trace(trace)
    phases = Counter(e["ph"] for e in trace["traceEvents"])
    assert phases["C"] and phases["b"] == phases["e"] > 0 and phases["M"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {f"GPU {d} memory" for d in real_frames(name).info.trace_devices}


# traces that cover the run: each counter's peak is torch's own, device by device
COVERING = [
    "oom_fragmentation",
    "oom_capacity",
    "pending_free",
    "cnn_clean",
    "dataparallel",
    "expandable",
    "cuda_graph",
    "empty_cache_churn",
    "transformer_varlen",
    "grad_ckpt_python",
    "fit_gpt2_b32_oom_python",
    "capture_oom_rank0",
]


@pytest.mark.parametrize("name", COVERING)
def test_peak_counters_are_torchs(real_frames, name):
    trace = build_perfetto_trace(real_frames(name), source=name, version="test")
    devices = trace["otherData"]["devices"]
    for device in real_frames(name).info.trace_devices:
        torch = sample_truth(name)["memory_stats"][str(device)]
        assert devices[str(device)]["trace_covers_start"] is True
        assert counter_peak(trace, "allocated", device) == torch["allocated_bytes.all.peak"]
        assert counter_peak(trace, "reserved", device) == torch["reserved_bytes.all.peak"]
        assert counter_peak(trace, "requested", device) == torch["requested_bytes.all.peak"]
        assert devices[str(device)]["peak_allocated_bytes"] == torch["allocated_bytes.all.peak"]


def test_a_trace_that_started_late_says_so(real_frames):
    """twin_expandable_wrapped's ring buffer wrapped: its peak came before the trace's first
    entry, so the counters stay below torch's peak, and otherData says the trace does not
    cover the run's start."""
    trace = build_perfetto_trace(real_frames("twin_expandable_wrapped"), source="x", version="test")
    torch = sample_truth("twin_expandable_wrapped")["memory_stats"]["0"]
    assert trace["otherData"]["devices"]["0"]["trace_covers_start"] is False
    assert counter_peak(trace, "allocated", 0) < torch["allocated_bytes.all.peak"]


def test_slices_carry_size_address_and_stack(real_frames):
    trace = build_perfetto_trace(real_frames("oom_fragmentation"), source="x", version="test")
    begins = [e for e in trace["traceEvents"] if e["ph"] == "b"]
    largest = max(begins, key=lambda e: e["args"]["size_bytes"])
    assert largest["args"]["address"].startswith("0x") and largest["args"]["stack"]
    assert any("workloads.py" in frame for frame in largest["args"]["stack"])
    assert largest["cat"] == "allocation" and largest["name"] == largest["args"]["category"]
    about = trace["otherData"]["devices"]["0"]
    assert about["allocation_slices"] == about["allocations_in_trace"] == len(begins)


def test_slices_are_bounded_peak_first(real_frames):
    frames = real_frames("oom_fragmentation")
    trace = build_perfetto_trace(frames, source="x", version="test", max_slices=7)
    check_trace(trace)
    begins = [e for e in trace["traceEvents"] if e["ph"] == "b"]
    assert len(begins) == 7 == trace["otherData"]["devices"]["0"]["allocation_slices"]
    assert trace["otherData"]["devices"]["0"]["allocations_in_trace"] > 7
    none = build_perfetto_trace(frames, source="x", version="test", max_slices=0)
    assert not any(e["ph"] in "be" for e in none["traceEvents"])


def test_select_slices_takes_those_alive_at_the_peak_then_the_largest():
    size = np.array([10, 500, 20, 400, 30])
    alloc = np.array([0, 1, 2, 3, 4])
    free = np.array([5, 2, -1, 6, 9])  # row 1 freed before the peak, row 2 never
    assert select_slices(size, alloc, free, peak_pos=4, limit=3).tolist() == [2, 3, 4]  # alive: 3, 4, 2, 0
    assert select_slices(size, alloc, free, peak_pos=4, limit=5).tolist() == [0, 1, 2, 3, 4]
    assert select_slices(size, alloc, free, peak_pos=0, limit=2).tolist() == [0, 1]


def test_a_long_counter_is_reduced_to_its_extremes_and_keeps_its_peak():
    rng = np.random.default_rng(0)
    values = np.cumsum(rng.integers(-1000, 1000, size=100_000))
    values[54_321] = values.max() + 12_345  # a one-event spike
    changed = np.r_[True, values[1:] != values[:-1]]
    kept = counter_points(values, changed, limit=1_000)
    assert kept.size <= 1_001 and np.all(np.diff(kept) > 0)
    assert values[kept].max() == values.max() and values[kept].min() == values.min()
    assert 54_321 in kept and kept[-1] == np.flatnonzero(changed)[-1]
    short = counter_points(values[:500], changed[:500])
    assert short.tolist() == np.flatnonzero(changed[:500]).tolist() and MAX_COUNTER_POINTS > 500


# --------------------------------------------------------------------------- without time_us


def _timeless_snapshot() -> dict[str, Any]:
    seg = segment(0x1000000, [{"size": 2 << 20, "requested_size": 2 << 20, "state": "inactive", "frames": []}])
    trace = [
        event("segment_alloc", 0x1000000, 2 << 20, 1),
        event("alloc", 0x1000000, 1 << 20, 2),
        event("alloc", 0x1100000, 512 << 10, 3),
        event("free_requested", 0x1100000, 512 << 10, 4),
        event("free_completed", 0x1100000, 512 << 10, 5),
        event("free_requested", 0x1000000, 1 << 20, 6),
        event("free_completed", 0x1000000, 1 << 20, 7),
    ]
    for e in trace:
        del e["time_us"]
    return make_snapshot([seg], [trace])


def test_a_snapshot_without_time_falls_back_to_event_order(tmp_path):
    path = write_pickle(tmp_path / "timeless.pickle", _timeless_snapshot())
    out = api.export(path, output=tmp_path / "t.json", format="perfetto")[0]
    trace = json.loads(out.read_text())
    check_trace(trace)
    assert trace["otherData"]["clock"] == EVENT_ORDER_CLOCK and trace["otherData"]["time_origin_unix_us"] is None
    assert counter_peak(trace, "allocated", 0) == (1 << 20) + (512 << 10)
    assert counter_peak(trace, "reserved", 0) == 2 << 20
    begins = sorted(e["ts"] for e in trace["traceEvents"] if e["ph"] == "b")
    assert begins == [1.0, 2.0]  # the allocations are the 2nd and 3rd events, 1 µs apart


# --------------------------------------------------------------------------- the command line


def test_cli_writes_the_default_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = sample_path("oom_fragmentation")
    r = runner.invoke(app, ["export", str(src), "--format", "perfetto", "-q"])
    assert r.exit_code == 0, r.output
    out = Path("reports/oom_fragmentation.perfetto.json")
    assert r.stdout.strip() == str(out)
    trace = json.loads(out.read_text())
    check_trace(trace)
    assert trace["otherData"]["snapshot"] == src.name


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(None, "no such file"), (b"", "empty"), (bytes(range(1, 200)), ""), ("trunc", "")],
)
def test_cli_bad_input_is_one_line_and_exit_3(tmp_path, content, fragment):
    path = tmp_path / "bad.pickle"
    if content == "trunc":
        path.write_bytes(sample_path("oom_fragmentation").read_bytes()[:1000])
    elif content is not None:
        path.write_bytes(content)
    r = runner.invoke(app, ["export", str(path), "-f", "perfetto", "-o", str(tmp_path / "t.json"), "-q"])
    assert r.exit_code == EXIT_BAD_INPUT, r.output
    assert r.stderr.startswith("snaplab: error: ") and r.stderr.count("\n") == 1 and fragment in r.stderr
    assert "Traceback" not in r.output and not (tmp_path / "t.json").exists()


def test_cli_bad_options_and_unwritable_output(tmp_path):
    src = str(sample_path("oom_fragmentation"))
    r = runner.invoke(app, ["export", src, "-f", "perfetto", "--max-slices", "-1", "-q"])
    assert (r.exit_code, r.stderr) == (EXIT_USAGE, "snaplab: error: --max-slices must be 0 or more\n")
    r = runner.invoke(app, ["export", src, "-f", "csv", "-q"])
    assert (r.exit_code, r.stderr) == (
        EXIT_USAGE,
        "snaplab: error: --output is needed: the folder to write the tables into\n",
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = runner.invoke(app, ["export", src, "-f", "perfetto", "-o", str(blocker / "t.json"), "-q"])
    assert r.exit_code == EXIT_OUTPUT and r.stderr.count("\n") == 1


# --------------------------------------------------------------------------- Perfetto itself


def _trace_processor_binary() -> str | None:
    """A trace_processor binary already on this machine (the perfetto package downloads one at
    run time, which CI cannot): $PERFETTO_TRACE_PROCESSOR or trace_processor_shell on PATH."""
    return os.environ.get("PERFETTO_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")


def test_perfetto_trace_processor_loads_the_file(tmp_path):
    tp_module = pytest.importorskip("perfetto.trace_processor")
    binary = _trace_processor_binary()
    if binary is None:
        pytest.skip("no trace_processor binary on this machine (set PERFETTO_TRACE_PROCESSOR)")
    out = api.export(sample_path("oom_fragmentation"), output=tmp_path / "t.json", format="perfetto")[0]
    config = tp_module.TraceProcessorConfig(bin_path=binary, load_timeout=60)
    with tp_module.TraceProcessor(trace=str(out), config=config) as tp:
        peak = tp.query(
            "select max(c.value) as v from counter c join counter_track t on c.track_id = t.id"
            " where t.name like '%allocated%'"
        ).as_pandas_dataframe()
        slices = tp.query("select count(*) as n from slice where category = 'allocation'").as_pandas_dataframe()
    assert int(peak["v"][0]) == sample_truth("oom_fragmentation")["memory_stats"]["0"]["allocated_bytes.all.peak"]
    assert int(slices["n"][0]) == json.loads(out.read_text())["otherData"]["devices"]["0"]["allocation_slices"]
