"""Issue #38 §1, shown: annotations on their allocation (top sites, explorer, report), pinned host
memory's report section, memory by compiled region (``stats --compiled-regions``). The fixtures
are tests/test_new_fields.py's, built after torch 2.14.1's serialiser."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import app
from snapshot_lab.frames import build_frames
from snapshot_lab.load import load_snapshot
from snapshot_lab.metrics import compute_stats
from snapshot_lab.metrics.attribution.annotations import annotated_allocations, site_annotations
from snapshot_lab.metrics.history.compiled import compiled_regions
from snapshot_lab.render.host import host_view
from snapshot_lab.render.html import ReportContext, render_report
from snapshot_lab.render.markdown import render_markdown

from .conftest import make_snapshot
from .test_new_fields import DEV, HOST_SEGMENTS, HOST_TRACES, device_segment, entry, read  # noqa: F401

HOSTILE = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
SITE = {"name": "forward", "filename": "model.py", "line": 12}
PACK = {"name": "pack_hook", "filename": "autograd.py", "line": 99}

ANNOTATED_TRACE = [
    entry("alloc", DEV, 1024, 1, frames=[SITE]),
    entry("annotate", DEV, 1024, 2, user_metadata=HOSTILE, frames=[PACK]),
    entry("annotate", DEV, 1024, 3, user_metadata="kv cache", frames=[PACK]),
]
ANNOTATED = make_snapshot([device_segment([(1024, "active_allocated")])], [ANNOTATED_TRACE])
PLAIN = make_snapshot([device_segment([(1024, "active_allocated")])], [ANNOTATED_TRACE[:1]])


def _write(tmp_path: Path, obj: dict[str, Any], name: str = "s.pickle") -> Path:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(obj, protocol=4))
    return path


def _context(tmp_path: Path, obj: dict[str, Any]) -> ReportContext:
    """The report's context as ``report`` builds it (annotations and host memory included)."""
    from snapshot_lab.report import build_report_context

    frames = build_frames(load_snapshot(_write(tmp_path, obj)))
    return build_report_context(frames, compute_stats(frames))


# --------------------------------------------------------------------------- annotations


def test_annotated_allocations_name_their_site_and_stack(read) -> None:  # noqa: F811
    frames = read(ANNOTATED)
    items = annotated_allocations(frames)
    assert [item.annotation for item in items] == [HOSTILE, "kv cache"]
    assert {(item.size_bytes, item.alloc_event_index, item.site) for item in items} == {
        (1024, 0, "model.py:12 in forward")
    }
    assert frames.stack(items[0].annotation_stack_id)[0]["name"] == "pack_hook"
    assert site_annotations(items) == {"model.py:12 in forward": [HOSTILE, "kv cache"]}
    assert json.loads(json.dumps([item.to_dict() for item in items]))[0]["annotation"] == HOSTILE
    assert annotated_allocations(read(PLAIN)) == []


def test_annotation_of_an_allocation_older_than_the_trace_takes_the_dumped_block(read) -> None:  # noqa: F811
    trace = [entry("annotate", DEV, 1024, 2, user_metadata="weights")]
    seg = device_segment([(1024, "active_allocated")])
    seg["blocks"][0]["frames"] = [SITE]
    (item,) = annotated_allocations(read(make_snapshot([seg], [trace])))
    assert (item.alloc_event_index, item.size_bytes, item.site) == (None, 1024, "model.py:12 in forward")


def test_stats_json_and_text_carry_annotations_only_when_present(tmp_path: Path) -> None:
    path = str(_write(tmp_path, ANNOTATED))
    out = CliRunner().invoke(app, ["stats", "--json", "-q", path])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)["annotations"]
    assert [(r["annotation"], r["site"], r["size_bytes"]) for r in rows] == [
        (HOSTILE, "model.py:12 in forward", 1024),
        ("kv cache", "model.py:12 in forward", 1024),
    ]
    text = CliRunner().invoke(app, ["stats", path]).stdout
    assert "== annotated allocations (2)" in text and "kv cache" in text
    plain = str(_write(tmp_path, PLAIN, "p.pickle"))
    assert "annotations" not in json.loads(CliRunner().invoke(app, ["stats", "--json", "-q", plain]).stdout)
    assert "annotated allocations" not in CliRunner().invoke(app, ["stats", plain]).stdout


def test_report_shows_annotations_on_the_site_escaped(tmp_path: Path) -> None:
    ctx = _context(tmp_path, ANNOTATED)
    assert ctx.site_annotations == {"model.py:12 in forward": [HOSTILE, "kv cache"]}
    html = render_report(ctx)
    assert HOSTILE not in html and ESCAPED in html and 'class="mono annotation">kv cache<' in html
    explorer = json.loads(ctx.explorer_json)
    assert [a["text"] for a in explorer["annotations"]] == [HOSTILE, "kv cache"]
    assert explorer["annotations"][0]["addr"] == f"0x{DEV:x}" and explorer["annotations"][0]["size"] == 1024
    assert "<script>alert" not in ctx.explorer_json and "\\u003cscript\\u003ealert(1)" in ctx.explorer_json
    text = render_markdown(ctx)
    assert "annotated: <code>&lt;script&gt;alert(1)&lt;/script&gt;</code>" in text and HOSTILE not in text


def test_no_annotations_no_change(tmp_path: Path) -> None:
    ctx = _context(tmp_path, PLAIN)
    assert ctx.site_annotations == {} and "annotations" not in json.loads(ctx.explorer_json)
    html = re.sub(r"<script.*?</script>", "", render_report(ctx), flags=re.S)  # the explorer's code names it
    assert "annotated:" not in html and 'id="host"' not in html


# --------------------------------------------------------------------------- pinned host memory

WITH_HOST = make_snapshot(
    [device_segment([(1 << 21, "active_allocated")])], host_segments=HOST_SEGMENTS, host_traces=HOST_TRACES
)


def test_host_view_totals_beside_device_memory(tmp_path: Path) -> None:
    frames = build_frames(load_snapshot(_write(tmp_path, WITH_HOST)))
    view = host_view(compute_stats(frames))
    assert view["rows"] == [
        {"memory": "pinned host", "reserved": (1 << 20) + (1 << 16) + (1 << 12), "allocated": 1 << 20},
        {"memory": "device 0", "reserved": 1 << 21, "allocated": 1 << 21},
    ]
    assert {t["label"]: t["bytes"] for t in view["totals"]}["freed, waiting on a CUDA event"] == 1 << 16
    assert view["peak"] == (1 << 20) + (1 << 12)
    assert view["sites"] == [{"frame": "loader.py:7:pin", "bytes": 1 << 20, "blocks": 1}]


def test_report_host_section_only_with_host_data(tmp_path: Path) -> None:
    ctx = _context(tmp_path, WITH_HOST)
    html = render_report(ctx)
    assert 'id="host"' in html and "Pinned host memory" in html and "loader.py:7:pin" in html
    text = render_markdown(ctx)
    assert "### Pinned host memory" in text and "| pinned host | 1.07 MiB | 1.00 MiB |" in text
    plain = _context(tmp_path, PLAIN)
    assert plain.host == {} and "Pinned host memory" not in render_report(plain)
    assert "Pinned host memory" not in render_markdown(plain)


def test_host_only_file_report(tmp_path: Path) -> None:
    ctx = _context(tmp_path, make_snapshot(host_segments=HOST_SEGMENTS, host_traces=HOST_TRACES))
    assert [row["memory"] for row in ctx.host["rows"]] == ["pinned host"]
    assert 'id="host"' in render_report(ctx)


# --------------------------------------------------------------------------- compiled regions

R1, R2 = "Torch-Compiled Region: 0/0", "Torch-Compiled Region: 1/0"
COMPILED_TRACE = [
    entry("alloc", DEV, 1000, 1, compile_context=R1),
    entry("alloc", DEV + 1024, 500, 2, compile_context=R1),
    entry("free_requested", DEV, 1000, 3, compile_context=R1),
    entry("free_completed", DEV, 1000, 4, compile_context=R1),
    entry("alloc", DEV + 2048, 2000, 5, compile_context=R2),
    entry("alloc", DEV, 300, 6),  # outside any compiled region
    entry("alloc", DEV + 4096, 700, 7, compile_context=R1),
    entry("free_completed", DEV + 2048, 2000, 8),  # freed outside: still R2's
]
COMPILED = make_snapshot([device_segment([(8192, "inactive")])], [COMPILED_TRACE])


def test_compiled_regions_totals_exact(read) -> None:  # noqa: F811
    regions = {r.compile_context: r for r in compiled_regions(read(COMPILED))}
    assert set(regions) == {R1, R2}
    one, two = regions[R1], regions[R2]
    assert (one.device, one.allocations, one.allocated_bytes, one.peak_bytes, one.live_at_end_bytes) == (
        0,
        3,
        2200,
        1500,
        1200,
    )
    assert (two.allocations, two.allocated_bytes, two.peak_bytes, two.live_at_end_bytes) == (1, 2000, 2000, 0)
    assert compiled_regions(read(PLAIN)) == []


def test_stats_compiled_regions_cli_and_api(tmp_path: Path) -> None:
    path = str(_write(tmp_path, COMPILED))
    out = CliRunner().invoke(app, ["stats", "--compiled-regions", "--json", "-q", path])
    assert out.exit_code == 0, out.output
    regions = json.loads(out.stdout)["compiled_regions"]
    assert [(r["compile_context"], r["allocated_bytes"], r["peak_bytes"]) for r in regions] == [
        (R1, 2200, 1500),
        (R2, 2000, 2000),
    ]
    assert regions == [r.to_dict() for r in api.stats(path, compiled_regions=True).compiled_regions or []]
    plain = CliRunner().invoke(app, ["stats", "--json", "-q", path])
    assert "compiled_regions" not in json.loads(plain.stdout)
    text = CliRunner().invoke(app, ["stats", "--compiled-regions", path]).stdout
    assert "== memory by compiled region (2)" in text and R1 in text
    none = CliRunner().invoke(app, ["stats", "--compiled-regions", str(_write(tmp_path, PLAIN, "p.pickle"))])
    assert "compiled regions: none recorded" in none.stdout


@pytest.mark.parametrize("obj", [ANNOTATED, WITH_HOST, COMPILED])
def test_new_files_report_end_to_end(tmp_path: Path, obj: dict[str, Any]) -> None:
    """The report (as report.py writes it today) still renders these files."""
    out = api.report(_write(tmp_path, obj), output=tmp_path / "r.html")
    assert Path(out).read_text("utf-8").startswith("<!DOCTYPE html>")


def test_explorer_shows_an_annotation_on_its_allocation(tmp_path: Path) -> None:
    """The explorer's allocation carries its annotations (matched by the event that made it), so
    its tooltip and detail show them; escaped inside the page's JSON."""
    later = [
        entry("alloc", DEV + 1024, 512, 4, frames=[SITE]),
        entry("free_requested", DEV + 1024, 512, 5, frames=[SITE]),
        entry("free_completed", DEV + 1024, 512, 6, frames=[SITE]),
    ]
    blocks = [device_segment([(1024, "active_allocated"), (512, "inactive")])]
    ctx = _context(tmp_path, make_snapshot(blocks, [[*ANNOTATED_TRACE, *later]]))
    (device,) = json.loads(ctx.explorer_json)["devices"]
    assert device["allocs"]["notes"] == {"0": [HOSTILE, "kv cache"]}
    assert HOSTILE not in render_report(ctx)
    plain = _context(tmp_path, make_snapshot(blocks, [[ANNOTATED_TRACE[0], *later]]))
    (device,) = json.loads(plain.explorer_json)["devices"]
    assert len(device["allocs"]["size"]) == 2 and "notes" not in device["allocs"]
