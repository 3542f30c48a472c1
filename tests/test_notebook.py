"""Notebooks: the API's results display themselves (``_repr_html_``) and stay what they were; the
example notebook runs top to bottom (nbclient, a real Jupyter kernel)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import snapshot_lab
from snapshot_lab import api
from snapshot_lab.metrics import SnapshotStats, compute_stats
from snapshot_lab.metrics.comparison.compare import SnapshotDiff
from snapshot_lab.metrics.findings import Finding
from snapshot_lab.notebook import Diff, Findings, ReportFile, Stats
from snapshot_lab.render.notebook import SCOPE, page_fragment, render_findings_fragment

from .conftest import ROOT, sample_path

OOM = sample_path("oom_fragmentation")


def _assert_safe_fragment(html: str) -> None:
    assert html.startswith(f'<div class="{SCOPE}"><style>') and html.endswith("</div>")
    assert "<script" not in html.lower() and "<html" not in html and "<body" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "@import" not in html and "url(http" not in html
    css = re.search(r"<style>(.*?)</style>", html, re.DOTALL).group(1)
    for selectors in re.findall(r"([^{}]+)\{", css):
        assert all(s.strip().startswith(f".{SCOPE}") for s in selectors.split(",")), selectors


def test_stats_is_still_snapshot_stats_and_displays():
    s = snapshot_lab.stats(OOM)
    assert isinstance(s, SnapshotStats) and isinstance(s, Stats)
    plain = compute_stats(snapshot_lab.load_frames(OOM))
    assert s == plain and plain == s
    assert json.dumps(s.to_dict(), sort_keys=True) == json.dumps(plain.to_dict(), sort_keys=True)
    assert dataclasses.replace(s, categories={}).categories == {}
    html = s._repr_html_()
    _assert_safe_fragment(html)
    assert "Memory statistics" in html and "oom_fragmentation.pickle" in html
    assert "Out of memory (fragmentation)" in html and "external fragmentation" in html


def test_findings_are_a_list_of_findings_that_displays():
    found = snapshot_lab.findings(OOM)
    assert isinstance(found, list) and isinstance(found, Findings)
    assert all(isinstance(f, Finding) for f in found) and found[0].id == "oom-fragmentation"
    assert found == list(found)
    html = found._repr_html_()
    _assert_safe_fragment(html)
    assert 'class="finding critical"' in html and "oom-fragmentation" in html


def test_hostile_text_is_escaped():
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    f = Finding(id="x", severity="warning", title=evil, advice=evil, evidence={evil: evil})
    html = render_findings_fragment([f])
    assert "<script>" not in html and "<img" not in html and "&lt;script&gt;" in html


def test_report_is_a_path_that_displays_the_report(tmp_path):
    out = api.report(OOM, output=tmp_path / "r.html")
    assert isinstance(out, Path) and isinstance(out, ReportFile) and out == tmp_path / "r.html"
    assert out.read_text().startswith("<!DOCTYPE html>")
    html = out._repr_html_()
    _assert_safe_fragment(html)
    for section in ('id="findings"', 'id="device-0"', 'id="recording"', "Top allocation sites"):
        assert section in html
    assert out.with_suffix(".txt")._repr_html_() is None  # derived paths are plain paths
    out.unlink()
    assert "No report at" in out._repr_html_()


def test_a_page_that_snaplab_did_not_write_is_not_shown():
    html = page_fragment("<html><body><main><script>alert(1)</script></main></body></html>")
    assert "alert" not in html and "not a page snaplab wrote" in html


def test_diff_is_a_snapshot_diff_that_displays():
    d = snapshot_lab.diff(sample_path("capture_single_step2"), sample_path("capture_single_step6"))
    assert isinstance(d, SnapshotDiff) and isinstance(d, Diff)
    assert d.to_dict()["totals"][0]["name"] == "reserved_bytes"
    html = d._repr_html_()
    _assert_safe_fragment(html)
    assert "Memory diff" in html and "capture_single_step6" in html


def test_the_example_notebook_runs_top_to_bottom():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    examples = ROOT / "examples"
    nb = nbformat.read(examples / "notebook.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(examples)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    # stats, findings, the pandas table, the diff and the report each rendered as HTML
    assert len(html) == 5
    assert any("Memory statistics" in h for h in html) and any('id="recording"' in h for h in html)
    assert any("<table" in h and "active_allocated" in h for h in html)  # a DataFrame


def test_report_can_be_called_again(tmp_path):
    """``snapshot_lab/report.py`` shares the API function's name: importing it (the first report
    does) must not replace ``snapshot_lab.report``, or a notebook's second report fails."""
    import snapshot_lab.report

    assert callable(snapshot_lab.report)
    first = snapshot_lab.report(OOM, output=tmp_path / "a.html")
    second = snapshot_lab.report(OOM, output=tmp_path / "b.html")
    assert first.exists() and second.exists() and callable(snapshot_lab.report)
    from snapshot_lab.report import build_report

    assert callable(build_report)
