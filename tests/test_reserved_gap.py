"""The reserved-gap finding (issue #20): peak reserved far above peak in use, and what the what-if
rows say other settings would reserve, on the real twins of ``workloads_holdout.py``."""

from __future__ import annotations

import pytest

from .conftest import sample_truth

GiB = 2**30
# max_split_size_mb on a job whose sizes change each step: 5.09 / 5.17 GiB reserved for 2.01 GiB
GAPTWIN = [f"gaptwin_{split}_{kind}" for split in ("split64", "split128") for kind in ("complete", "wrapped")]
# and 3.37 GiB for 1.38 GiB (the twin's wrapped ring misses its largest step: 1.20 GiB in use in it)
FIRES = [*GAPTWIN, "twin_split64_complete", "twin_split64_wrapped"]
# the same jobs under settings that keep the cache near the need, and the clean runs of the suite
# (cnn_clean, 1.7x and 0.6 GiB, is the closest: the byte bound keeps it out); a Lightning fit that
# starts with 1.25 GiB an earlier workload left and uses 0.26 GiB (4.8x, 0.99 GiB) is silenced by
# its steady state, not by the byte bound: its own work reserves 0.29 GiB under its settings
SILENT = [
    "twin_complete",
    "twin_expandable_complete",
    "gaptwin_complete",
    "cnn_clean",
    "transformer_varlen",
    "lightning_fit_end",
    "twin_split128_complete",
]


@pytest.fixture
def findings(real_diagnosis):
    return lambda name: real_diagnosis(name)[1].findings


def _gap(findings, name):
    return [f for f in findings(name) if f.id == "reserved-gap"]


@pytest.mark.parametrize("name", FIRES)
def test_the_gap_is_named_with_the_real_peaks(findings, name):
    """The finding's numbers are the run's own (memory_stats right before the dump): peak reserved
    exactly, whole or wrapped; peak requested exactly where the trace holds the job's peak step
    (gaptwin's wrapped ring does; the twin's misses its 896-token step: the window's own peak)."""
    (f,) = _gap(findings, name)
    stats = sample_truth(name)["memory_stats"]["0"]
    in_use = f.evidence["peak_requested_bytes"]
    assert f.evidence["peak_reserved_bytes"] == stats["reserved_bytes.all.peak"]
    if name == "twin_split64_wrapped":
        assert 0.8 * stats["requested_bytes.all.peak"] < in_use < stats["requested_bytes.all.peak"]
    else:
        assert in_use == stats["requested_bytes.all.peak"]
    assert f.evidence["gap_bytes"] == stats["reserved_bytes.all.peak"] - in_use > 1.9 * GiB
    assert f.evidence["reserved_over_requested"] == round(stats["reserved_bytes.all.peak"] / in_use, 3) > 2.4
    assert f"max_split_size_mb:{name.split('_')[1][5:]}" in f.advice


@pytest.mark.parametrize("name", GAPTWIN)
def test_the_gap_says_what_dropping_the_split_limit_would_reserve(findings, name):
    """The what-if row without max_split_size_mb (with expandable segments) predicts the job's real
    peak under that setting (gaptwin_expandable_complete: 2.06 GiB) within 1%, from the complete
    trace and from the steady state of the wrapped one, and the savings follow from it."""
    (f,) = _gap(findings, name)
    row = f.evidence["whatif_peak_reserved_bytes"]["expandable_segments:True without max_split_size_mb"]
    truth = sample_truth("gaptwin_expandable_complete")["memory_stats"]["0"]["reserved_bytes.all.peak"]
    assert row == pytest.approx(truth, rel=0.01)
    assert f.savings_bytes == f.evidence["peak_reserved_bytes"] - min(f.evidence["whatif_peak_reserved_bytes"].values())
    assert ("steady state" in f.advice) == name.endswith("_wrapped")


@pytest.mark.parametrize("name", SILENT)
def test_no_gap_on_clean_runs(findings, name):
    """Silent where the cache stays near the need (twin_split128_complete: 2.28 GiB for 1.38, 1.65x:
    max_split_size_mb's cost there is below the 2x bound)."""
    assert not _gap(findings, name)


def test_a_cache_from_before_the_trace_is_not_the_allocator_s_gap(findings):
    """lightning_fit_end would pass the ratio (4.8x) and nearly the bytes; its steady state says
    the trace's work reserves 0.29 GiB under the recorded settings, so the 1.25 GiB came before."""
    assert "history-incomplete" in {f.id for f in findings("lightning_fit_end")}
    assert not _gap(findings, "lightning_fit_end")
