"""The explorer's features of issue #39 §2 driven in headless Chromium (Playwright over Debian's
chromium, as tests/test_explorer.py does): typing a search, clicking moments, frames, blocks and
the axis toggle, and reading back what the page shows. Skipped without chromium or playwright."""

from __future__ import annotations

import re

import pytest

from snapshot_lab import api

from .browser import chromium, needs_browser, open_page
from .conftest import sample_path, write_pickle
from .test_explorer import _diff_html, _untimed_snapshot
from .test_report import _hostile_snapshot

ORANGE_PIXELS = """() => {
  const c = document.querySelector('#explorer-0 canvas.xp-timeline');
  const img = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < img.length; i += 4)
    if (img[i] > 200 && img[i + 1] > 70 && img[i + 1] < 130 && img[i + 2] < 60) n++;
  return n; }"""


@pytest.fixture(scope="module", name="browser")
def _browser():
    yield from chromium()


@pytest.fixture(scope="module", name="report_html")
def _report_html(tmp_path_factory):
    out = tmp_path_factory.mktemp("explorer")
    return {"transformer_varlen": api.report(sample_path("transformer_varlen"), output=out / "tv.html").read_text()}


@pytest.fixture(scope="module", name="diff_html")
def _diff_page():
    return _diff_html(sample_path("capture_single_step2"), sample_path("capture_single_step4"))


def _page(browser, tmp_path, html: str, name: str = "r.html"):
    path = tmp_path / name
    path.write_text(html)
    return open_page(browser, path)


def _search(page, root: str, text: str) -> None:
    box = page.locator(f"{root} input.xp-search")
    box.fill("")
    box.press_sequentially(text)
    from playwright.sync_api import expect

    # the page's CSP forbids eval, so the wait reads an attribute rather than running a predicate
    expect(page.locator(f"{root} .xp-time")).to_have_attribute("data-searched", text, timeout=5000)


@needs_browser
def test_search_highlights_counts_and_filters(browser, report_html, tmp_path):
    page, problems, requests = _page(browser, tmp_path, report_html["transformer_varlen"])
    page.locator("#explorer-0 input.xp-search").scroll_into_view_if_needed()
    assert page.evaluate(ORANGE_PIXELS) == 0
    _search(page, "#explorer-0", "forward")
    count = page.locator("#explorer-0 .xp-search-count").text_content()
    hits, total = (int(n.replace(",", "")) for n in re.match(r"([\d,]+) of ([\d,]+) listed", count).groups())
    assert 0 < hits < total
    assert page.locator("#explorer-0 .xp-time").get_attribute("data-matches") == str(hits)
    assert page.evaluate(ORANGE_PIXELS) > 100  # the matches' strip along the timeline
    page.click("#explorer-0 .xp-peak")
    live = page.locator("#explorer-0 .xp-live")
    assert "that match the search" in live.text_content()
    assert "matching the search" in live.locator("table >> nth=1").text_content()
    # a regular expression, then one that matches nothing, then one that is not valid
    _search(page, "#explorer-0", "/modeling_gpt2\\.py:\\d+/")
    assert re.match(r"[\d,]+ of", page.locator("#explorer-0 .xp-search-count").text_content())
    _search(page, "#explorer-0", "no such frame anywhere")
    assert page.locator("#explorer-0 .xp-search-count").text_content().startswith("0 of")
    assert "0 that match" not in live.text_content() and "that match the search: 0" in live.text_content()
    _search(page, "#explorer-0", "/(unclosed/")
    assert "Not a valid regular expression" in page.locator("#explorer-0 .xp-search-msg").text_content()
    assert page.locator("#explorer-0 .xp-search-count").text_content() == ""  # no filter applied
    _search(page, "#explorer-0", "x" * 230)  # the box takes 250
    assert "longer than 200" in page.locator("#explorer-0 .xp-search-msg").text_content()
    # (the test's own pixel reads draw chromium's advice about willReadFrequently)
    assert [p for p in problems if "willReadFrequently" not in p] == [] and requests == [page.url]


@needs_browser
def test_search_reads_hostile_stacks_as_text(browser, tmp_path):
    path = api.report(write_pickle(tmp_path / "h.pickle", _untimed_snapshot()), output=tmp_path / "h.html")
    page, problems, _ = open_page(browser, path)
    _search(page, "#explorer-0", "alert('pwned')")
    assert page.locator("#explorer-0 .xp-time").get_attribute("data-matches") == "1"
    page.click("#explorer-0 .xp-peak")
    frames = page.locator("#explorer-0 .xp-fl").all_text_contents()
    assert any("<script>alert('pwned')</script>" in text for text in frames)  # shown as text
    assert page.locator("#explorer-0 .xp-flame script").count() == 0
    assert page.evaluate("typeof window.pwned") == "undefined" and problems == []


@needs_browser
def test_flame_graph_of_a_moment_zooms_into_a_frame(browser, report_html, tmp_path):
    page, problems, _ = _page(browser, tmp_path, report_html["transformer_varlen"])
    page.click("#explorer-0 .xp-peak")
    nodes = page.locator("#explorer-0 .xp-flame .xp-fl")
    root_bytes = int(nodes.first.get_attribute("data-bytes"))
    assert nodes.first.text_content() == "listed allocations live here" and root_bytes > 0
    live_total = page.locator("#explorer-0 .xp-live h4").first.text_content()
    assert "2.22 GiB requested" in live_total  # the peak
    # the frames one row down add up to the root (widths are bytes)
    tops = page.evaluate(
        """() => Array.from(document.querySelectorAll('#explorer-0 .xp-flame .xp-fl'))
        .filter(e => e.style.top === '18px').map(e => +e.dataset.bytes)"""
    )
    assert sum(tops) <= root_bytes and sum(tops) > 0.95 * root_bytes
    deep = page.locator("#explorer-0 .xp-flame .xp-fl").filter(has_text="forward").first
    name, nbytes = deep.text_content(), deep.get_attribute("data-bytes")
    deep.click()
    first = page.locator("#explorer-0 .xp-flame .xp-fl").first
    assert first.text_content() == name and first.get_attribute("data-bytes") == nbytes
    first.click()  # back out
    assert page.locator("#explorer-0 .xp-flame .xp-fl").first.text_content() == "listed allocations live here"
    assert problems == []


@needs_browser
def test_size_and_lifetime_histograms(browser, report_html, tmp_path):
    html = report_html["transformer_varlen"]
    page, problems, _ = _page(browser, tmp_path, html)
    dev = page.evaluate("JSON.parse(document.getElementById('snaplab-data').textContent).devices[0]")
    allocations = len(dev["allocs"]["x0"]) + dev["unlisted"]
    for kind in ("size", "life"):
        bars = page.locator(f"#explorer-0 .xp-hist-{kind} .xp-hbar")
        assert bars.count() >= 5
        counts = [
            int(c)
            for c in page.eval_on_selector_all(
                f"#explorer-0 .xp-hist-{kind} .xp-hbar", "e => e.map(b => b.dataset.count)"
            )
        ]
        opened = dev["hist"]["lifeSeconds"]["open"] + dev["hist"]["lifeSeconds"]["zero"] if kind == "life" else 0
        assert sum(counts) + opened == allocations
    tallest = page.locator("#explorer-0 .xp-hist-size .xp-hbar").nth(
        max(range(len(dev["hist"]["size"]["n"])), key=lambda k: dev["hist"]["size"]["n"][k])
    )
    tallest.hover()
    assert re.search(r"\d+(\.\d+)? (B|KiB|MiB|GiB) to .*: [\d,]+ allocations", tallest.get_attribute("title"))
    assert "in time" in page.locator("#explorer-0 .xp-hist-life h4").text_content()
    assert problems == []


@needs_browser
def test_wall_clock_and_event_order_toggle(browser, report_html, tmp_path):
    page, problems, _ = _page(browser, tmp_path, report_html["transformer_varlen"])
    toggle = page.locator("#explorer-0 .xp-axis")
    rng = page.locator("#explorer-0 .xp-range")
    assert toggle.get_attribute("data-axis") == "time_s" and rng.text_content().endswith(" s")
    toggle.click()
    assert toggle.get_attribute("data-axis") == "event" and "event" in rng.text_content()
    assert float(rng.get_attribute("data-end")) > 1000  # entries, no longer seconds
    assert "allocator events" in page.locator("#explorer-0 .xp-hist-life h4").text_content()
    page.click("#explorer-0 .xp-peak")
    assert "event" in page.locator("#explorer-0 .xp-live h4").first.text_content()
    toggle.click()
    assert toggle.get_attribute("data-axis") == "time_s" and rng.text_content().endswith(" s")
    # a file without times has one axis and no toggle
    path = api.report(write_pickle(tmp_path / "n.pickle", _untimed_snapshot()), output=tmp_path / "n.html")
    untimed, more, _ = open_page(browser, path)
    assert untimed.locator("#explorer-0 .xp-axis").count() == 0
    assert "event" in untimed.locator("#explorer-0 .xp-range").text_content()
    assert problems == [] and more == []


@needs_browser
def test_segments_at_the_chosen_moment(browser, report_html, tmp_path):
    page, problems, _ = _page(browser, tmp_path, report_html["transformer_varlen"])
    page.click("#explorer-0 .xp-peak")
    box = page.locator("#explorer-0 .xp-moment-segs")
    assert "Allocator segments at" in box.locator("h4").text_content()
    assert "the nearest" not in box.locator("h4").text_content()  # the peak's own moment
    assert box.locator(".xp-mseg").count() > 10
    summary = box.locator("p.note").text_content()
    assert re.search(r"\d+ segments, .* reserved, 2\.22 GiB in the allocated blocks", summary)
    listed = box.locator(".xp-mblk[title*='click for its stack']:not([title*='no stack recorded'])").first
    listed.click()
    detail = page.locator("#explorer-0 .xp-detail")
    assert "Allocation" in detail.text_content() and detail.locator("ol.stack li").count() >= 1
    # another moment: the start of the trace, fewer segments
    canvas = page.locator("#explorer-0 canvas.xp-timeline")
    page.click("#explorer-0 .xp-reset")
    b = canvas.bounding_box()
    page.mouse.click(b["x"] + 3, b["y"] + 100)
    assert box.locator(".xp-mseg").count() < 10
    assert problems == []


@needs_browser
def test_the_diff_page_links_its_two_explorers(browser, diff_html, tmp_path):
    page, problems, requests = _page(browser, tmp_path, diff_html, "diff.html")
    for key in ("a", "b"):
        assert page.locator(f"#explorer-{key} canvas.xp-timeline").is_visible()
    ranges = [page.locator(f"#explorer-{key} .xp-range") for key in ("a", "b")]

    def spans():
        return [(r.get_attribute("data-start"), r.get_attribute("data-end")) for r in ranges]

    assert spans()[0] == spans()[1]
    page.click("#explorer-a .xp-zoom-in")
    page.click("#explorer-a .xp-zoom-in")
    assert spans()[0] == spans()[1] and float(spans()[1][1]) - float(spans()[1][0]) < 0.3
    canvas = page.locator("#explorer-b canvas.xp-timeline").bounding_box()
    page.mouse.click(canvas["x"] + canvas["width"] * 0.5, canvas["y"] + 100)
    for key in ("a", "b"):
        assert "Live at" in page.locator(f"#explorer-{key} .xp-live h4").first.text_content()
    # one search asks both files; the same frame has the same colour in both flame graphs
    _search(page, "#explorer-a", "train_single")
    assert page.locator("#explorer-b input.xp-search").input_value() == "train_single"
    assert page.locator("#explorer-b .xp-time").get_attribute("data-matches") not in (None, "")
    page.click("#explorer-b .xp-peak")
    colours = page.evaluate(
        """() => ['a', 'b'].map(k => Object.fromEntries(Array.from(
          document.querySelectorAll('#explorer-' + k + ' .xp-fl')).map(e => [e.textContent, e.style.background])))"""
    )
    common = set(colours[0]) & set(colours[1])
    assert len(common) > 3 and all(colours[0][name] == colours[1][name] for name in common)
    # the histograms over the same bins in both
    for kind in ("size", "life"):
        bars = [page.locator(f"#explorer-{k} .xp-hist-{kind} .xp-hbar").count() for k in ("a", "b")]
        assert bars[0] == bars[1] > 3
    page.click("#explorer-a .xp-axis")
    assert [page.locator(f"#explorer-{k} .xp-axis").get_attribute("data-axis") for k in ("a", "b")] == ["event"] * 2
    assert spans()[0] == spans()[1]
    assert problems == [] and requests == [page.url]


@needs_browser
def test_hostile_names_on_the_diff_page(browser, tmp_path):
    hostile = write_pickle(tmp_path / "h.pickle", _hostile_snapshot())
    page, problems, _ = _page(browser, tmp_path, _diff_html(hostile, hostile), "hd.html")
    assert page.locator("#explorer-a .xp-name").text_content() == "h.pickle"
    page.click("#explorer-a .xp-peak")
    assert page.evaluate("typeof window.pwned") == "undefined" and problems == []
