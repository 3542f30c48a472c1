"""Memory by the user's own stages (``metrics.history.stages``, issue #38 §2).

Unit: synthetic traces with nested, unclosed, before-trace, early and crossing ranges, exact
figures. Real: on transformer_varlen (train_step#k around optimizer_step), every range's peak,
levels and allocation equal a replay of the raw pickle written here (no snaplab code). CLI:
``--stages`` adds the view, and without it the outputs carry no ``stages`` key."""

from __future__ import annotations

import json
import lzma
import pickle
from typing import Any

import pytest
from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import app
from snapshot_lab.frames import build_frames
from snapshot_lab.load import load_snapshot
from snapshot_lab.metrics.categories import CATEGORIES
from snapshot_lab.metrics.comparison.stages import compare_stages
from snapshot_lab.metrics.history.stages import MAX_ANNOTATIONS, Stages, compute_stages, range_kind

from .conftest import event, make_snapshot, sample_path

A, B, C = 0x1000, 0x2000, 0x3000
TRACE = [
    event("alloc", A, 100, 10),
    event("alloc", B, 50, 20),
    event("free_completed", A, 100, 30),
    event("alloc", C, 30, 40),
    event("free_completed", B, 50, 50),
    event("free_completed", C, 30, 60),
]  # levels after each event: 100 150 50 80 30 0


def _ann(stage: str, name: str, t: int, device: int = 0) -> dict[str, Any]:
    return {"stage": stage, "name": name, "device": device, "time_us": t}


def _stages(snap_file, annotations: list[dict[str, Any]]) -> Stages:
    frames = build_frames(load_snapshot(snap_file(make_snapshot([], [TRACE], external_annotations=annotations))))
    return compute_stages(frames, 0)


def _by_name(st: Stages) -> dict[str, Any]:
    return {r.name: r for r in st.ranges}


def test_nested_ranges_nest_with_exact_figures(snap_file):
    st = _stages(
        snap_file,
        [_ann("START", "outer", 15), _ann("START", "inner", 25), _ann("END", "inner", 45), _ann("END", "outer", 55)],
    )
    outer, inner = st.ranges
    assert (outer.name, outer.depth, outer.parent) == ("outer", 0, None)
    assert (inner.name, inner.depth, inner.parent) == ("inner", 1, 0)
    assert (outer.live_at_start_bytes, outer.peak_requested_bytes, outer.live_at_end_bytes) == (100, 150, 30)
    assert outer.peak_event_index is not None
    assert (outer.allocated_bytes, outer.kept_bytes, outer.n_events) == (80, 30, 4)
    # inside 'inner' memory only falls below its start: the peak is the level at its start
    assert (inner.live_at_start_bytes, inner.peak_requested_bytes, inner.peak_event_index) == (150, 150, None)
    assert (inner.live_at_end_bytes, inner.allocated_bytes, inner.kept_bytes) == (80, 30, 30)
    for r in st.ranges:
        assert set(r.kept_by_category) <= set(CATEGORIES)
        assert sum(r.allocated_by_category.values()) == r.allocated_bytes
        assert sum(r.kept_by_category.values()) == r.kept_bytes
        assert r.flags == ()
    assert st.notes == ()
    assert "no thread" in st.threads


def test_unclosed_range_runs_to_the_trace_end_and_is_said(snap_file):
    st = _stages(snap_file, [_ann("START", "tail", 35)])
    (tail,) = st.ranges
    assert tail.flags == ("unclosed",) and tail.end_time_us is None
    assert (tail.live_at_start_bytes, tail.peak_requested_bytes, tail.live_at_end_bytes) == (50, 80, 0)
    assert (tail.allocated_bytes, tail.kept_bytes) == (30, 0)
    assert any("no END" in n for n in st.notes)


def test_range_that_began_before_the_recording(snap_file):
    st = _stages(snap_file, [_ann("END", "head", 25), _ann("START", "early", 5), _ann("END", "early", 12)])
    r = _by_name(st)
    assert r["head"].flags == ("before_trace",) and r["head"].start_time_us is None
    assert (r["head"].live_at_start_bytes, r["head"].peak_requested_bytes, r["head"].live_at_end_bytes) == (0, 150, 150)
    assert r["early"].flags == ("starts_before_trace",)
    assert (r["early"].peak_requested_bytes, r["early"].n_events) == (100, 1)
    # the range with no START holds every range that starts after the trace does
    assert r["head"].depth == 0


def test_ranges_of_another_thread_cross_and_are_flagged(snap_file):
    st = _stages(
        snap_file, [_ann("START", "x", 22), _ann("START", "y", 32), _ann("END", "x", 52), _ann("END", "y", 58)]
    )
    r = _by_name(st)
    assert r["x"].flags == () and r["y"].flags == ("crosses",)
    assert r["y"].parent is None and r["y"].depth == 0
    assert any("another thread" in n for n in st.notes)


def test_a_name_nested_in_itself_pairs_innermost_first(snap_file):
    st = _stages(
        snap_file, [_ann("START", "f", 15), _ann("START", "f", 25), _ann("END", "f", 45), _ann("END", "f", 55)]
    )
    assert [(r.start_time_us, r.end_time_us, r.depth) for r in st.ranges] == [(15, 55, 0), (25, 45, 1)]


def test_other_devices_and_files_without_ranges(snap_file):
    st = _stages(snap_file, [_ann("START", "gpu1", 15, device=1), _ann("END", "gpu1", 55, device=1)])
    assert st.ranges == () and st.notes


def test_kinds():
    assert range_kind("nccl:all_reduce") == "nccl"
    assert range_kind("Torch-Compiled Region: 0/0") == "compiled"
    assert range_kind("CompiledFunction") == "compiled"
    assert range_kind("aten::mm") == "op"
    assert range_kind("train_step#3") == "record_function"
    assert MAX_ANNOTATIONS >= 1000


def test_compare_stages_by_name(snap_file):
    a = _stages(snap_file, [_ann("START", "s", 15), _ann("END", "s", 55)])
    b = _stages(snap_file, [_ann("START", "s", 35), _ann("END", "s", 45), _ann("START", "t", 50)])
    d = compare_stages(a, b)
    rows = {row.name: row for row in d.rows}
    assert (rows["s"].peak_before, rows["s"].peak_after, rows["s"].peak_change) == (150, 80, -70)
    assert rows["t"].status == "new" and rows["t"].peak_change is None
    assert compare_stages(None, None).rows == ()


# --------------------------------------------------------------------------- truth on a real run

REAL = "transformer_varlen"


def _replay(path) -> tuple[list[tuple[str, int, int]], list[int], list[int], list[tuple[str, int]]]:
    """From the raw pickle alone: the ranges (name, start, end), the entries' times, the requested
    level after each entry (anchored at the blocks alive at the dump) and (action, size)."""
    with lzma.open(path) as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    level, levels = 0, []
    for e in trace:
        level += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        levels.append(level)
    at_dump = sum(
        b["requested_size"]
        for s in snap["segments"]
        if s["device"] == 0
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    )
    levels = [x + at_dump - levels[-1] for x in levels]
    ranges, open_ = [], {}
    for a in snap["external_annotations"]:
        if a["stage"] == "START":
            open_.setdefault(a["name"], []).append(a["time_us"])
        else:
            ranges.append((a["name"], open_[a["name"]].pop(), a["time_us"]))
    return ranges, [e["time_us"] for e in trace], levels, [(e["action"], e["size"]) for e in trace]


def test_peak_inside_every_range_equals_the_replayed_one(real_frames):
    ranges, times, levels, entries = _replay(sample_path(REAL))
    stages = compute_stages(real_frames(REAL), 0)
    ours = {(r.name, r.start_time_us, r.end_time_us): r for r in stages.ranges}
    assert len(ours) == len(ranges) == len(stages.ranges)
    names = {name.split("#")[0] for name, _, _ in ranges}
    assert {"train_step", "optimizer_step"} <= names
    for name, start, end in ranges:
        inside = [i for i, t in enumerate(times) if start <= t <= end]
        before = levels[inside[0] - 1] if inside[0] > 0 else levels[0] - entries[0][1]
        r = ours[(name, start, end)]
        assert r.peak_requested_bytes == max([before] + [levels[i] for i in inside]), name
        assert r.live_at_start_bytes == before, name
        assert r.live_at_end_bytes == levels[inside[-1]], name
        assert r.allocated_bytes == sum(entries[i][1] for i in inside if entries[i][0] == "alloc"), name
        assert r.flags == ()
    # train_step#k holds optimizer_step
    by_index = stages.ranges
    for r in by_index:
        if r.name == "optimizer_step":
            assert by_index[r.parent].name.startswith("train_step#")


# --------------------------------------------------------------------------- CLI and API


def test_stats_json_has_stages_only_with_the_flag():
    path = str(sample_path(REAL))
    runner = CliRunner()
    plain = json.loads(runner.invoke(app, ["stats", path, "--json", "-q"]).stdout)
    assert "stages" not in plain
    res = runner.invoke(app, ["stats", path, "--json", "-q", "--stages"])
    assert res.exit_code == 0, res.output
    staged = json.loads(res.stdout)
    assert {k: v for k, v in staged.items() if k != "stages"} == plain
    ranges = staged["stages"]["0"]["ranges"]
    assert ranges[0]["name"] == "train_step#1" and ranges[1]["parent"] == 0
    assert api.stats(path, stages=True).stages[0].to_dict() == staged["stages"]["0"]


def test_stats_text_prints_the_stage_table():
    res = CliRunner().invoke(app, ["stats", str(sample_path(REAL)), "-q", "--stages"])
    assert res.exit_code == 0, res.output
    assert "== stages of device 0" in res.stdout and "  optimizer_step" in res.stdout


@pytest.mark.parametrize("json_out", [False, True])
def test_diff_stages(json_out):
    a, b = str(sample_path(REAL)), str(sample_path("transformer_varlen_step4"))
    args = ["diff", a, b, "-q", "--stages"] + (["--json"] if json_out else [])
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    if json_out:
        rows = {row["name"]: row for row in json.loads(res.stdout)["stages"]["rows"]}
        assert rows["optimizer_step"]["count_before"] == 8
    else:
        assert "== stages by name" in res.stdout
    plain = CliRunner().invoke(app, ["diff", a, b, "-q", "--json"])
    assert "stages" not in json.loads(plain.stdout)


# --------------------------------------------------------------------------- report section


def _report_context(snap_file, annotations):
    from snapshot_lab.metrics import compute_stats
    from snapshot_lab.report import build_report_context

    frames = build_frames(load_snapshot(snap_file(make_snapshot([], [TRACE], external_annotations=annotations))))
    return frames, build_report_context(frames, compute_stats(frames))


def test_report_section_only_with_ranges_and_escaped(snap_file):
    from snapshot_lab.metrics.history.stages import file_stages, has_stages
    from snapshot_lab.render.html import render_report
    from snapshot_lab.render.stages import stages_view

    frames, ctx = _report_context(
        snap_file, [_ann("START", "<script>x</script>", 15), _ann("END", "<script>x</script>", 55)]
    )
    assert has_stages(frames) and ctx.stages == stages_view(file_stages(frames))  # the report fills it
    html = render_report(ctx)
    assert 'id="stages"' in html and "Memory by stage" in html
    assert "<script>x</script>" not in html and "&lt;script&gt;x&lt;/script&gt;" in html
    frames, ctx = _report_context(snap_file, [])
    assert not has_stages(frames) and stages_view(file_stages(frames)) == [] == ctx.stages
    assert 'id="stages"' not in render_report(ctx)  # no ranges: the section is left out


def test_markdown_section_only_with_ranges_and_escaped(snap_file):
    from snapshot_lab.metrics.history.stages import file_stages
    from snapshot_lab.render.markdown import render_markdown
    from snapshot_lab.render.stages import stages_view

    frames, ctx = _report_context(snap_file, [_ann("START", "<b>|x", 15), _ann("END", "<b>|x", 55)])
    assert ctx.stages == stages_view(file_stages(frames))
    assert "Memory by stage" not in render_markdown(_report_context(snap_file, [])[1])
    text = render_markdown(ctx)
    assert "### Memory by stage" in text and "&lt;b&gt;\\|x" in text and "<b>" not in text
