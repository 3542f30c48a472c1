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


def test_two_models_of_one_script_are_flagged_by_their_parameters():
    """single_mlp and single_transformer: one training script (they share its sites), two models."""
    d = api.diff(sample_path("single_mlp"), sample_path("single_transformer"))
    assert (d.before.categories["parameter"], d.after.categories["parameter"]) == (134_283_264, 277_936_128)
    assert diff_warnings(d)[0] == (
        "The parameters differ (128.06 MiB and 265.06 MiB): two different models, or one model of two sizes."
    )
    # one job under two allocator settings is one job: nothing to warn about
    assert diff_warnings(api.diff(sample_path("twin_complete"), sample_path("twin_expandable_complete"))) == []


def test_the_page_overlays_both_timelines(tmp_path):
    d = api.diff(sample_path("capture_single_step2"), sample_path("capture_single_step6"), output=tmp_path / "d.html")
    for summary in (d.before, d.after):
        (series,) = summary.timelines  # one device
        assert series["x_label"] == "seconds" and series["x"][0] == 0.0 and len(series["x"]) <= 400
        assert max(series["requested"]) == summary.peak_requested_bytes  # the buckets keep the peak
        assert max(series["reserved"]) == summary.peak_reserved_bytes
    assert d.before.peak_requested_bytes == 451_484_680
    html = (tmp_path / "d.html").read_text()
    assert '<img src="data:image/png;base64,' in html and "Each file on its own axis from its first event" in html
    assert html.index('class="verdict"') < html.index("data:image/png")
