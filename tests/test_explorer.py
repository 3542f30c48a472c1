"""The report's explorer: data embedded safely, a CSP that allows only the inlined script, the
size bound on a 1M-entry trace, and (marked ``browser``) the page driven in headless Chromium."""

from __future__ import annotations

import base64
import hashlib
import json
import pickle
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from snapshot_lab import api

from .browser import chromium, needs_browser, open_page
from .conftest import ROOT, sample_path, write_pickle
from .test_report import _hostile_snapshot

BIG_BUDGET = 5 * 1024 * 1024


def _scripts(html: str) -> tuple[dict, str]:
    data = re.search(r'<script type="application/json" id="snaplab-data">(.*?)</script>', html, re.S)
    code = re.search(r"<script>(.*?)</script>", html, re.S)
    assert data and code
    return json.loads(data.group(1)), code.group(1)


@pytest.fixture(scope="module")
def report_html(tmp_path_factory):
    out = tmp_path_factory.mktemp("explorer")
    return {
        name: api.report(sample_path(name), output=out / f"{name}.html").read_text()
        for name in ("oom_fragmentation", "transformer_varlen")
    }


def test_csp_allows_exactly_the_inlined_script(report_html):
    html = report_html["oom_fragmentation"]
    _, code = _scripts(html)
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', html).group(1)
    digest = base64.b64encode(hashlib.sha256(code.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp.replace("&#39;", "'")
    assert csp.replace("&#39;", "'").startswith("default-src 'none'; img-src data:;")
    assert html.count("<script") == 2  # the data (not executed) and the explorer


def test_embedded_data_matches_the_metrics(report_html):
    data, _ = _scripts(report_html["oom_fragmentation"])
    dev = data["devices"][0]
    assert max(dev["b"]["hi"]) == dev["peak"]["bytes"]
    assert len(dev["b"]["x0"]) == len(next(r for r in dev["catLv"] if r)) == len(dev["siteLv"][0])
    assert dev["catLv"][dev["cats"].index("parameter")] is None  # nothing but "other" in this run
    assert dev["segments"] and all(b[1] > 0 for s in dev["segments"] for b in s["blocks"])
    assert sum(s["size"] for s in dev["segments"]) <= 1_572_864_000
    time_data, _ = _scripts(report_html["transformer_varlen"])
    assert time_data["devices"][0]["axis"] == "time_s"


def test_no_string_from_the_file_can_close_the_script(tmp_path):
    html = api.report(write_pickle(tmp_path / "h.pickle", _hostile_snapshot()), output=tmp_path / "h.html").read_text()
    data_text = re.search(r'id="snaplab-data">(.*?)</script>', html, re.S).group(1)
    assert "<" not in data_text and ">" not in data_text and "&" not in data_text
    data, _ = _scripts(html)
    assert any("<script>alert('pwned')</script>" in f for f in data["frames"])  # intact after parsing


@pytest.fixture(scope="module")
def big_trace(tmp_path_factory):
    """A 1M-entry trace modelled on a real run (benchmarks/gen_snapshot.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gen_snapshot import generate
    finally:
        sys.path.pop(0)
    path = tmp_path_factory.mktemp("big") / "big.pickle"
    with path.open("wb") as f:
        pickle.dump(generate(1_000_000, extra_frames=4), f, protocol=4)
    return path


@pytest.fixture(scope="module")
def big_report(big_trace, tmp_path_factory):
    # the what-if replay (about 20 s at 1M entries) does not change what the page carries
    mp = pytest.MonkeyPatch()
    mp.setattr("snapshot_lab.metrics.diagnose._whatifs", lambda *a, **k: {})
    try:
        return api.report(big_trace, output=tmp_path_factory.mktemp("bigr") / "big.html")
    finally:
        mp.undo()


def test_a_million_entries_stay_within_budget(big_report):
    html = big_report.read_text()
    assert len(html.encode()) <= BIG_BUDGET
    data, _ = _scripts(html)
    dev = data["devices"][0]
    assert len(dev["b"]["x0"]) <= 1000 and len(dev["allocs"]["x0"]) <= 1500
    assert dev["unlisted"] > 300_000  # (of about 1M / 3 allocations) the rest live on only in the levels


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


_open = open_page


@pytest.mark.parametrize("name", ["oom_fragmentation", "transformer_varlen"])
@needs_browser
def test_explorer_in_chromium(browser, report_html, tmp_path, name):
    path = tmp_path / f"{name}.html"
    path.write_text(report_html[name])
    page, problems, requests = _open(browser, path)
    rng = page.locator("#explorer-0 .xp-range")
    before = float(rng.get_attribute("data-end")) - float(rng.get_attribute("data-start"))
    page.click("#explorer-0 .xp-zoom-in")
    canvas = page.locator("#explorer-0 canvas.xp-timeline")
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + 60)
    page.mouse.wheel(0, -300)
    after = float(rng.get_attribute("data-end")) - float(rng.get_attribute("data-start"))
    assert after < before / 2
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + 80)
    tip = page.locator("#xp-tip")
    assert tip.is_visible() and re.search(r"\d+(\.\d+)? (B|KiB|MiB|GiB)", tip.text_content())
    page.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + 80)
    live = page.locator("#explorer-0 .xp-live")
    assert "Live at" in live.text_content() and live.locator(".xp-cols table").count() == 2
    page.click("#layout-explorer-0 .xp-seg >> nth=0")
    assert page.locator("#layout-explorer-0 .xp-detail table tr").count() >= 2
    assert problems == []
    assert requests == [path.as_uri()]  # nothing but the page itself


@needs_browser
def test_a_million_entries_are_interactive_within_two_seconds(browser, big_report):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    start = time.perf_counter()
    page.goto(big_report.as_uri())
    page.wait_for_selector("html[data-explorer=ready]", timeout=10_000)
    page.click("#explorer-0 .xp-zoom-in")
    assert time.perf_counter() - start < 2.0


def _alloc_point(page) -> tuple[float, float] | None:
    """A point on the allocations canvas over a drawn allocation (scan rows for a coloured pixel)."""
    return page.evaluate(
        """() => {
        const c = document.querySelector('#explorer-0 canvas.xp-allocs');
        const g = c.getContext('2d'), r = c.getBoundingClientRect(), k = c.width / r.width;
        const img = g.getImageData(0, 0, c.width, c.height).data;  // one readback
        for (let y = 3; y < r.height; y += 2) for (let x = 5; x < r.width; x += 7) {
          const at = (Math.floor(y * k) * c.width + Math.floor(x * k)) * 4;
          if (img[at + 3] > 200) return [r.left + x, r.top + y];
        }
        return null; }"""
    )


@needs_browser
def test_an_allocation_shows_size_lifetime_category_module_and_stack(browser, report_html, tmp_path):
    path = tmp_path / "r.html"
    path.write_text(report_html["transformer_varlen"])
    page, problems, _ = _open(browser, path)
    page.locator("#explorer-0 canvas.xp-allocs").scroll_into_view_if_needed()
    point = _alloc_point(page)
    assert point is not None
    page.mouse.move(*point)
    text = page.locator("#xp-tip").text_content()
    assert re.search(r"\d+(\.\d+)? (B|KiB|MiB|GiB) · \w+", text)
    assert "lifetime:" in text and "site:" in text and "module:" in text
    page.mouse.click(*point)
    detail = page.locator("#explorer-0 .xp-detail")
    assert "Allocation" in detail.text_content() and detail.locator("ol.stack li").count() >= 1
    assert problems == []


@needs_browser
def test_readable_with_scripts_off(browser, report_html, tmp_path):
    path = tmp_path / "r.html"
    path.write_text(report_html["oom_fragmentation"])
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto(path.as_uri())
    assert not page.locator("#explorer-0").is_visible()  # hidden until the script runs
    assert page.locator("img[alt^='Memory of device 0']").is_visible()
    assert page.locator("#answer").is_visible()
    context.close()


@needs_browser
def test_each_device_gets_its_explorer(browser, tmp_path):
    path = api.report(sample_path("dataparallel"), output=tmp_path / "dp.html")
    page, problems, _ = _open(browser, path)
    for dev in (0, 1):
        assert page.locator(f"#explorer-{dev} canvas.xp-timeline").is_visible()
        assert page.locator(f"#layout-explorer-{dev} .xp-seg").count() > 0
    assert problems == []


# issue #39 §2: search, flame graph, histograms, wall-clock/event toggle, segments at a moment,
# two explorers on the diff page (their browser tests: tests/test_explorer_browser.py)


def _exploration(name: str):
    from snapshot_lab.metrics import compute_stats
    from snapshot_lab.metrics.diagnose import device_timelines
    from snapshot_lab.metrics.explore import explore

    frames = api.load_frames(sample_path(name))
    timeline = device_timelines(frames, compute_stats(frames))[0]
    return explore(frames, timeline), timeline


@pytest.mark.parametrize("name", ["oom_fragmentation", "transformer_varlen"])
def test_segments_at_the_peak_hold_the_peak(name):
    """The moment of the peak is among those carried; its blocks are the peak's requested bytes
    (each rounded up to the allocator's 512 bytes) and its segments the reserved bytes then."""
    from snapshot_lab.metrics.explore import MOMENT_BLOCKS, MOMENT_SEGMENTS, SEGMENT_MOMENTS

    ex, timeline = _exploration(name)
    assert 2 <= len(ex.segment_moments) <= SEGMENT_MOMENTS
    peak = next(m for m in ex.segment_moments if m.position == ex.peak_position)
    blocks = int(peak.block_size.sum()) + peak.hidden_block_bytes
    assert ex.peak_bytes <= blocks <= ex.peak_bytes + 512 * (peak.block_size.size + peak.hidden_blocks)
    assert int(peak.segment_size.sum()) + peak.hidden_segment_bytes == timeline.reserved_bytes[ex.peak_position]
    for moment in ex.segment_moments:
        assert moment.segment_size.size <= MOMENT_SEGMENTS and moment.block_size.size <= MOMENT_BLOCKS
        ends = moment.block_offset + moment.block_size
        assert (moment.block_offset >= 0).all() and (ends <= moment.segment_size[moment.block_segment]).all()


@pytest.mark.parametrize("name", ["oom_fragmentation", "transformer_varlen"])
def test_the_moments_read_only_the_blocks_live_at_them(name, monkeypatch):
    """The segments' moments are made from the blocks live at one of the moments drawn; made
    from every block of the trace instead (each position a moment) they are the same."""
    from snapshot_lab.metrics import explore as explorer

    ex, _ = _exploration(name)
    every = explorer._block_spans

    def from_every_block(frames, ev, lt, lives, positions):
        return every(frames, ev, lt, lives, np.arange(len(ev) + 1))

    monkeypatch.setattr(explorer, "_block_spans", from_every_block)
    all_blocks, _ = _exploration(name)
    assert len(ex.segment_moments) >= 2 and len(all_blocks.segment_moments) == len(ex.segment_moments)
    assert sum(moment.block_size.size for moment in ex.segment_moments) > 10
    for mine, theirs in zip(ex.segment_moments, all_blocks.segment_moments, strict=True):
        for field in ("block_segment", "block_offset", "block_size", "block_row", "segment_address"):
            assert getattr(mine, field).tolist() == getattr(theirs, field).tolist()
        assert (mine.hidden_blocks, mine.hidden_block_bytes) == (theirs.hidden_blocks, theirs.hidden_block_bytes)


def test_histograms_count_every_allocation_of_the_trace():
    ex, _ = _exploration("transformer_varlen")
    allocations = len(ex.allocations) + ex.unlisted_allocations
    assert sum(ex.size_histogram.counts) == allocations
    for hist in (ex.lifetime_events, ex.lifetime_seconds):
        assert hist is not None and sum(hist.counts) + hist.zero + hist.open == allocations
    # what is still alive at the end is the listed allocations' (everything alive at the peak is listed)
    assert ex.lifetime_events.open >= int(ex.allocations["x_free"].isna().sum()) > 0


def test_the_page_carries_both_axes_only_with_times(report_html, tmp_path):
    data, _ = _scripts(report_html["transformer_varlen"])
    dev = data["devices"][0]
    assert dev["axis"] == "time_s"
    ev = dev["ev"]
    assert len(ev["b"]["x0"]) == len(dev["b"]["x0"]) and ev["b"]["x0"] == sorted(ev["b"]["x0"])
    assert len(ev["allocs"]["x0"]) == len(dev["allocs"]["x0"])
    assert set(dev["hist"]) == {"size", "lifeEvents", "lifeSeconds"} and dev["moments"]
    html = api.report(write_pickle(tmp_path / "n.pickle", _untimed_snapshot()), output=tmp_path / "n.html").read_text()
    untimed = _scripts(html)[0]["devices"][0]
    assert untimed["axis"] == "event" and "ev" not in untimed and untimed["hist"]["lifeSeconds"] is None


def _untimed_snapshot() -> dict:
    """The hostile snapshot with no time on any trace entry: the explorer's x is the event order."""
    snap = _hostile_snapshot()
    for entry in snap["device_traces"][0]:
        entry.pop("time_us", None)
    return snap


def _diff_html(before: Path, after: Path) -> str:
    from snapshot_lab import __version__
    from snapshot_lab.render.compare import render_diff_html
    from snapshot_lab.render.explorer import diff_payload

    explorers = diff_payload(api.load_frames(before), api.load_frames(after), (before.name, after.name))
    return render_diff_html(api.diff(before, after), __version__, explorers)


@pytest.fixture(scope="module")
def diff_html():
    return _diff_html(sample_path("capture_single_step2"), sample_path("capture_single_step4"))


def test_the_diff_page_carries_two_linked_explorers_under_its_csp(diff_html):
    data, code = _scripts(diff_html)
    assert data["linked"] is True and [d["dom"] for d in data["devices"]] == ["explorer-a", "explorer-b"]
    assert all(key.startswith(("a:", "b:")) for key in data["stacks"])
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', diff_html).group(1)
    digest = base64.b64encode(hashlib.sha256(code.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp.replace("&#39;", "'")
    assert not re.search(r"(src|href)=\"https?:", diff_html)


def test_the_diff_page_without_explorers_has_no_script():
    from snapshot_lab import __version__
    from snapshot_lab.render.compare import render_diff_html

    html = render_diff_html(
        api.diff(sample_path("capture_single_step2"), sample_path("capture_single_step4")), __version__
    )
    assert "<script" not in html and "script-src" not in html


def test_hostile_stacks_stay_text_on_the_diff_page(tmp_path):
    hostile = write_pickle(tmp_path / "h.pickle", _hostile_snapshot())
    html = _diff_html(hostile, hostile)
    data_text = re.search(r'id="snaplab-data">(.*?)</script>', html, re.S).group(1)
    assert "<" not in data_text and ">" not in data_text
    assert html.count("<script") == 2
