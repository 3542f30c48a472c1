"""``snaplab report --format md|png``: Markdown for a ticket (under GitHub's limit, escaped) and
the first screen as an image."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import app
from snapshot_lab.render.markdown import LIMIT_CHARS, md, md_line

from .conftest import block, event, make_snapshot, sample_path, segment, write_pickle
from .test_report import HOSTILE_NAME, _hostile_snapshot

runner = CliRunner()
MiB = 1 << 20


def test_markdown_answers_with_numbers_and_stacks(tmp_path):
    text = api.report(sample_path("oom_fragmentation"), output=tmp_path / "r.md", format="md").read_text()
    assert text.startswith("## snaplab: oom\\_fragmentation.pickle")
    assert "**🔴 Out of memory: a request of 15.00 MiB could not be served.**" in text
    assert "| 0 | 1.46 GiB | 450.00 MiB | 1.32 GiB | 70.0% | 0 B | fragmentation, request of 15.00 MiB |" in text
    assert "<details>\n<summary><code>main/sample_snapshots/workloads.py:207 in _frag_setup</code>" in text
    assert "_frag_setup — /work/main/sample_snapshots/workloads.py:207" in text  # inside the fence, verbatim
    assert "1. **Out of memory caused by fragmentation" in text
    assert len(text) < LIMIT_CHARS


def test_markdown_escapes_what_comes_from_the_file(tmp_path):
    p = write_pickle(tmp_path / "h.pickle", _hostile_snapshot())
    text = api.report(p, output=tmp_path / "h.md", format="md").read_text()
    outside_fences = re.sub(r"```+text\n.*?\n```+", "", text, flags=re.S)
    assert HOSTILE_NAME not in outside_fences and "<img" not in outside_fences
    assert md("a|b") == "a\\|b" and md("<b>") == "&lt;b&gt;" and md_line("# x") == "\\# x"
    assert md_line("1. x") == "1\\. x" and md("v1.2") == "v1.2"


def test_markdown_stays_under_githubs_limit_with_huge_stacks(tmp_path):
    """40 sites with 300-frame stacks of long names: the stacks are shortened, the answer stays."""
    segs, trace = [], []
    for i in range(40):
        frames = [
            {"filename": f"/very/long/path/{'x' * 80}/module_{i}_{d}.py", "line": d + 1, "name": f"fn_{'```' * 3}{d}"}
            for d in range(300)
        ]
        addr = (i + 1) << 32
        segs.append(segment(addr, [block(8 * MiB, frames=frames)]))
        trace += [event("segment_alloc", addr, 8 * MiB, 2 * i), event("alloc", addr, 8 * MiB, 2 * i + 1, frames)]
    p = write_pickle(tmp_path / "deep.pickle", make_snapshot(segs, [trace]))
    text = api.report(p, output=tmp_path / "d.md", format="md").read_text()
    assert len(text) < LIMIT_CHARS
    assert "### What to change" in text and "### Key numbers" in text
    assert "more frames (the HTML report has them all)" in text
    for fence in re.findall(r"^(`{3,})text$", text, flags=re.M):
        assert len(fence) > 9  # longer than the runs of backticks in the names


def test_png_is_the_first_screen(tmp_path):
    out = api.report(sample_path("transformer_varlen"), output=tmp_path / "r.png", format="png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_cli_format_option_and_default_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "job.pickle.xz"
    shutil.copy(sample_path("transformer_varlen"), src)
    for fmt in ("md", "png"):
        r = runner.invoke(app, ["report", str(src), "--format", fmt, "-q"])
        assert r.exit_code == 0, r.output
        assert r.stderr.strip() == f"wrote {Path('reports') / f'job.{fmt}'}"
    r = runner.invoke(app, ["report", str(src), "--format", "pdf", "-q"])
    assert r.exit_code == 2
    assert not (tmp_path / "reports" / "job.html").exists()  # html stays the default, made only when asked


def test_evidence_inside_a_value_keeps_its_units_and_its_names():
    """reserved-gap's what-if rows: allocator settings as keys (not machine keys: kept as they
    are, underscores and all) and bytes as values (the unit from the outer key)."""
    from snapshot_lab.render.evidence import evidence_value

    rows = {"expandable_segments:True,max_split_size_mb:64": 2462056448, "peak_allocated_bytes": 1024}
    assert evidence_value(rows, "whatif_peak_reserved_bytes") == (
        "expandable_segments:True,max_split_size_mb:64: 2.29 GiB; peak allocated: 1.00 KiB"
    )
