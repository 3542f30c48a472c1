"""The HTML report: structure, self-containment, escaping, no partial files, and a real browser."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_BAD_INPUT, EXIT_OUTPUT

from .conftest import block, event, make_snapshot, sample_path, segment, write_pickle

runner = CliRunner()
HOSTILE_NAME = "<script>alert('pwned')</script>"
HOSTILE_FILE = '"><img src=x onerror=alert(1)>.py'
SIZE_BUDGET = 3 * 1024 * 1024


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    made = {}
    for name in ("oom_fragmentation", "transformer_varlen", "dataparallel", "state_only", "cuda_graph", "expandable"):
        made[name] = api.report(sample_path(name), output=out / f"{name}.html").read_text()
    return made


def _hostile_snapshot() -> dict:
    frames = [
        {"filename": HOSTILE_FILE, "line": 7, "name": HOSTILE_NAME},
        {"filename": "$x$ {{7*7}}", "line": 1, "name": "$\\frac{a}{b}$"},
    ]
    segs = [segment(1 << 30, [block(4 << 20, frames=frames), block(16 << 20, "inactive")])]
    tr = [
        event("segment_alloc", 1 << 30, 20 << 20, 1, frames=frames),
        event("alloc", 1 << 30, 4 << 20, 2, frames=frames),
    ]
    snap = make_snapshot(segs, [tr])
    snap["external_annotations"] = [
        {"stage": "START", "name": f"{HOSTILE_NAME}$\\bogus{{$ step 1", "device": 0, "time_us": 1},
        {"stage": "START", "name": f"{HOSTILE_NAME}$\\bogus{{$ step 2", "device": 0, "time_us": 2},
    ]
    snap["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] = HOSTILE_NAME
    return snap


def test_sections_present(reports):
    html = reports["oom_fragmentation"]
    for anchor in ('id="findings"', 'id="device-0"', 'id="oom-0"', 'id="recording"'):
        assert anchor in html
    for heading in (
        "Memory over time",
        "Allocator counters",
        "Fragmentation",
        "Block layout",
        "Top allocation sites: live at the dump",
        "Top allocation sites: live at the peak",
    ):
        assert heading in html
    assert "oom-fragmentation" in html
    assert html.count("<svg") >= 1 and html.count("data:image/png;base64,") >= 2


def test_numbers_in_report_are_torchs(reports):
    # reserved 1.46 GiB and 75 segments, as torch.cuda.memory_stats() said
    html = reports["oom_fragmentation"]
    assert "1.46 GiB" in html
    assert re.search(r'<td class="mono">segment</td><td class="num">75</td>', html)


@pytest.mark.parametrize("name", ["oom_fragmentation", "transformer_varlen", "dataparallel", "state_only"])
def test_self_contained(reports, name):
    html = reports[name]
    assert len(html.encode()) < SIZE_BUDGET
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "@import" not in html and "url(http" not in html and "<link" not in html
    # two scripts: the explorer's data (not executed) and the explorer itself, allowed by its hash
    assert re.findall(r"<script[^>]*>", html) == ['<script type="application/json" id="snaplab-data">', "<script>"]
    assert "default-src &#39;none&#39;" in html or "default-src 'none'" in html


def test_multi_device_report(reports):
    html = reports["dataparallel"]
    assert 'id="device-0"' in html and 'id="device-1"' in html and 'id="compare"' in html


def test_state_only_report_explains_missing_timeline(reports):
    assert "enabled=&#39;state&#39;" in reports["state_only"] or "enabled='state'" in reports["state_only"]
    assert "no-trace" in reports["state_only"]


def test_hostile_strings_are_escaped(tmp_path):
    p = write_pickle(tmp_path / "hostile.pickle", _hostile_snapshot())
    html = api.report(p, output=tmp_path / "h.html").read_text()
    assert "<script>alert" not in html
    assert "<img src=x" not in html
    assert "&lt;script&gt;alert(&#39;pwned&#39;)&lt;/script&gt;" in html  # visible, inert
    assert "{{7*7}}" in html or "{{ 7*7 }}" in html  # not evaluated as a template


def test_bad_input_leaves_no_file(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04\x95garbage")
    out = tmp_path / "out" / "r.html"
    r = runner.invoke(app, ["report", str(bad), "-o", str(out)])
    assert r.exit_code == EXIT_BAD_INPUT
    assert not out.exists()
    assert not any(out.parent.glob("*")) if out.parent.exists() else True


def test_unwritable_output(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = runner.invoke(app, ["report", str(sample_path("oom_fragmentation")), "-o", str(blocker / "r.html")])
    assert r.exit_code == EXIT_OUTPUT
    assert r.stderr.startswith("snaplab: error: ") and "cannot write" in r.stderr


def test_default_output_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "job_rank3.pickle.xz"
    shutil.copy(sample_path("cuda_graph"), src)
    r = runner.invoke(app, ["report", str(src), "-q"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "" and r.stderr.strip() == f"wrote {Path('reports') / 'job_rank3.html'}"
    assert (tmp_path / "reports" / "job_rank3.html").stat().st_size > 10_000


def test_report_is_deterministic(tmp_path):
    a = api.report(sample_path("oom_fragmentation"), output=tmp_path / "a.html").read_bytes()
    b = api.report(sample_path("oom_fragmentation"), output=tmp_path / "b.html").read_bytes()
    assert a.replace(b"a.html", b"") == b.replace(b"b.html", b"")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
@pytest.mark.parametrize("name", ["oom_fragmentation", "hostile"])
def test_renders_in_headless_chromium(tmp_path, name):
    src = write_pickle(tmp_path / "hostile.pickle", _hostile_snapshot()) if name == "hostile" else sample_path(name)
    html = api.report(src, output=tmp_path / "r.html")
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1280,2000",
            f"--screenshot={shot}",
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists() and shot.stat().st_size > 20_000, proc.stderr[-2000:]
    console = [ln for ln in proc.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert console == []


def test_thousands_of_segments_stay_readable(tmp_path):
    """3000 segments, no two alike: the layout draws the largest per pool and summarises the rest."""
    from .conftest import block, make_snapshot, segment, write_pickle

    segs = []
    for i in range(3000):
        size = (2 + (i % 7) * 2) << 20
        first = size // 2 + (i % 1000) * 512  # a different split in each segment
        segs.append(segment((i + 1) << 32, [block(first), block(size - first, "inactive")]))
    html = api.report(
        write_pickle(tmp_path / "many.pickle", make_snapshot(segs)), output=tmp_path / "m.html"
    ).read_text()
    assert len(html.encode()) < SIZE_BUDGET
    assert "2960 smaller segments are summarised in the panel titles" in html


def test_alike_segments_are_one_row_that_says_how_many():
    """oom_fragmentation's 75 segments of 20 MiB each hold one 6 MiB tensor and a 14 MiB hole:
    one row ×75 (it took a screen of 40 identical bars and a note about 35 more)."""
    from snapshot_lab import load_frames
    from snapshot_lab.metrics.stats.layout import select_layout

    from .conftest import sample_path

    fr = load_frames(sample_path("oom_fragmentation"))
    (large,) = select_layout(fr.segments, fr.blocks)
    assert len(large.segments) == 1 and large.hidden_segments == 0
    assert large.repeats == {int(large.segments["segment_id"].iloc[0]): 75}
    # every one of transformer_varlen's 84 segments is a row, stood for by a row, or summarised
    varlen = load_frames(sample_path("transformer_varlen"))
    pools = select_layout(varlen.segments, varlen.blocks)
    assert sum(sum(p.repeats.values()) + p.hidden_segments for p in pools) == len(varlen.segments) == 84


def _answer(html: str) -> str:
    start = html.index('<section id="answer"')
    return html[start : html.index("</section>", start)]


def test_first_screen_says_capacity_where_the_replay_finds_no_setting_that_serves(tmp_path):
    """BERT's first forward under a 6 GiB cap: 67.75 MiB free in holes of 17.75 MiB for a 48 MiB
    request, and no allocator setting the replay tried serves it (the step needs 16 GiB). The
    first screen says capacity, as the finding does; it said "Fragmentation" before."""
    html = api.report(sample_path("fit_bert_b32_oom_python"), output=tmp_path / "bert.html").read_text()
    a = _answer(html)
    assert "Capacity: 67.75 MiB was free in reserved memory, in holes no larger than 17.75 MiB" in a
    assert "Fragmentation:" not in a
    assert "oom-capacity" in html and "oom-fragmentation" not in html


def test_first_screen_answers_an_oom(reports):
    import hashlib

    html = reports["oom_fragmentation"]
    assert html.index('id="answer"') < html.index('id="findings"')
    a = _answer(html)
    assert 'class="answer critical"' in a
    assert "Out of memory: a request of 15.00 MiB could not be served." in a
    assert "Fragmentation: 1.03 GiB was free in reserved memory, but the largest free hole was 14.00 MiB" in a
    assert "main/sample_snapshots/workloads.py:207 in _frag_setup: 1.32 GiB (100.0%) in 225 blocks" in a
    assert a.index("Out of memory caused by fragmentation") < a.index("expandable_segments:True would have served")
    assert "at stake: 1.03 GiB" in a
    digest = hashlib.sha256(sample_path("oom_fragmentation").read_bytes()).hexdigest()[:12]
    assert f'sha256 <span class="mono">{digest}' in html and "snaplab 0." in html


def test_first_screen_of_a_healthy_run(reports):
    a = _answer(reports["transformer_varlen"])
    assert 'class="answer ok"' in a and "Nothing wrong" in a
    assert "activation 2.00 GiB (89.9%), optimizer_state 132.21 MiB (5.8%)" in a
    assert "by module (approximate" in a
    assert "would lower the peak reserved memory to 2.25 GiB instead of 2.62 GiB" in a


def test_first_screen_of_several_devices_and_no_trace(reports):
    a = _answer(reports["dataparallel"])
    assert "on device 0" in a and "Device 1:" in a
    state_only = _answer(reports["state_only"])
    assert "Nothing wrong at the dump" in state_only and "no leak check" in state_only
    assert "110.09 MiB requested at the dump; 298.00 MiB reserved at the dump, 6.7% of it stranded" in state_only


def test_fit_answer_leads_the_levers():
    from snapshot_lab.api import compute_stats, load_frames
    from snapshot_lab.render.answer import FitSummary
    from snapshot_lab.report import build_report

    frames = load_frames(sample_path("oom_fragmentation"))
    fit = FitSummary("Fits on one GPU with expandable segments", ("Set expandable_segments:True.",), 1 << 30)
    a = _answer(build_report(frames, compute_stats(frames), fit_answer=fit))
    assert a.index("Fits on one GPU with expandable segments") < a.index("Out of memory caused by fragmentation")


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("fit_t5_b64_oom_python", "more than one stack of repeated blocks"),  # T5: encoder and decoder
        ("fit_convnext_b512_oom_python", "before its first repeated block completed"),  # out inside block 1
    ],
)
def test_an_oom_fit_cannot_size_says_why_after_the_other_advice(name, reason):
    """An OOM in the first forward is the ticket fit answers; where it cannot (fit/extrapolate.py
    refuses), the report says so and why, last, instead of nothing. GPT-2's OOM leads with fit's
    answer (test_aside)."""
    from snapshot_lab.api import compute_stats, load_frames
    from snapshot_lab.report import FIT_REFUSED, build_report

    frames = load_frames(sample_path(name))
    html = build_report(frames, compute_stats(frames))
    a = _answer(html)
    assert a.index("the job needed more than the device had") < a.index(FIT_REFUSED)
    assert reason in a[a.index(FIT_REFUSED) :]
    # listed, not styled as an answer that makes the job fit (green: class "lever fit")
    assert f'<li class="lever fit-aside"><div class="lt">{FIT_REFUSED}' in str(html)
    assert 'class="lever fit"' not in str(html)


def test_evidence_reads_as_words_with_units(reports):
    from snapshot_lab.render.evidence import evidence_label, evidence_rows, evidence_value

    rows = evidence_rows(
        {"requested_bytes": 15 << 20, "settings_that_serve_the_request": ["a:1", "b:2"], "memory_limit_bytes": None},
        1 << 30,
    )
    assert [(label, value) for label, value, _ in rows] == [
        ("request that failed", "15.00 MiB"),
        ("settings that serve the request", "a:1; b:2"),
        ("memory limit", "not recorded"),
        ("at stake", "1.00 GiB (memory this advice would free or make usable)"),
    ]
    assert evidence_label("allocated_bytes_device_1") == "allocated on device 1"
    assert evidence_value(0.25, "external_fragmentation") == "25.0%"
    assert evidence_value(True, "snapshot_at_oom") == "yes"
    html = reports["oom_fragmentation"]
    table = html[html.index('<table class="evidence">') :]
    table = table[: table.index("</table>")]
    assert "<td>15.00 MiB</td>" in table and "<td>75.75 GiB</td>" in table
    assert (
        "requested_bytes</td>" not in table
        and "[" not in table
        and "—" not in table
        and "_" not in table.split("title=")[0]
    )
