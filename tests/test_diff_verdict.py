"""The diff page's one-line verdict and its warning when the two files look unrelated."""

from __future__ import annotations

from snapshot_lab import api
from snapshot_lab.render.compare import diff_verdict, diff_warnings

from .conftest import sample_path


def test_verdict_of_two_steps_of_one_job(tmp_path):
    d = api.diff(sample_path("capture_single_step2"), sample_path("capture_single_step6"), output=tmp_path / "d.html")
    assert diff_verdict(d) == "The second run needs more memory: peak requested 430.57 MiB → 541.90 MiB (+25.9%)."
    assert diff_warnings(d) == []
    html = (tmp_path / "d.html").read_text()
    assert '<p class="verdict">The second run needs more memory' in html and 'class="diff-warning"' not in html


def test_unrelated_files_are_flagged(tmp_path):
    d = api.diff(sample_path("oom_fragmentation"), sample_path("transformer_varlen"), output=tmp_path / "d.html")
    assert diff_verdict(d) == "The second run no longer runs out of memory (the first did: fragmentation)."
    assert diff_warnings(d)[0] == "No allocation site is common to both files: they look like different programs."
    assert 'class="diff-warning"' in (tmp_path / "d.html").read_text()


def test_files_with_different_devices_are_flagged():
    d = api.diff(sample_path("transformer_varlen"), sample_path("dataparallel"))
    assert any(w.startswith("The files hold different devices (0 and 0, 1)") for w in diff_warnings(d))
