"""What-if from a trace that starts mid-run (issue #20): a ring buffer that wrapped replays every
other setting from a steady state, checked against the same job recorded whole under that setting.

The twins (``sample_snapshots/workloads_holdout.py``, ``ring_job``, recorded on an H100): ``twin_*``
(3-layer GPT-2, 8 steps of lengths 256..896, batch 6) and ``gaptwin_*`` (16 steps of lengths
64..1024, batch 8), each recorded whole (``_complete``) and with a ring of 2,500 / 4,000 entries
(``_wrapped``) under five settings. ``<twin>_complete.truth.json``'s ``reserved_bytes.all.peak``
is what the setting really reserved from the job's start.

Predicted peak reserved from each wrapped recording (rows) under each other setting (columns),
error against the truth (the recorded setting's own row is the recorded cache: exact):

==========================  ========  ==========  ========  ========  ========
wrapped recording           default   expandable  split64   split128  roundup4
==========================  ========  ==========  ========  ========  ========
twin_wrapped                exact     -11.3%      -41.8%    -29.1%    -7.9%
twin_expandable_wrapped     -3.9%     exact       -41.7%    -28.4%    -7.9%
twin_split64_wrapped        -5.2%     -12.7%      exact     -29.3%    -8.6%
twin_split128_wrapped       -4.8%     -12.7%      -41.8%    exact     -7.9%
twin_roundup4_wrapped       -1.6%     -11.3%      -40.5%    -26.6%    exact
gaptwin_wrapped             exact     +0.0%       -35.9%    -41.1%    -0.9%
gaptwin_expandable_wrapped  +7.5%     exact       -35.6%    -40.9%    -0.7%
gaptwin_split64_wrapped     +7.0%     +0.0%       exact     -41.1%    -0.9%
gaptwin_split128_wrapped    +7.1%     +0.0%       -35.8%    exact     -0.9%
gaptwin_roundup4_wrapped    -0.9%     +0.0%       -38.9%    -43.9%    exact
==========================  ========  ==========  ========  ========  ========

The goal was 5%; what the steady state honestly meets:
- settings without ``max_split_size_mb``: within 8% where the trace holds the job's largest step
  (gaptwin: its 1024-token step is in the window), within 13% where it does not (twin: its
  896-token step ran before the window, and no replay of the window sees it);
- ``max_split_size_mb``: a lower bound, 27-44% under. Under it every request above the limit
  keeps a segment of its own size; the job's earlier steps (other lengths, other sizes) left
  such segments that nothing in the window asks for.
"""

from __future__ import annotations

import pytest

from snapshot_lab.metrics.allocator.model import AllocatorSettings, apply_conf
from snapshot_lab.metrics.allocator.state import start_state
from snapshot_lab.metrics.allocator.whatif import (
    START_REBUILT,
    START_STEADY,
    _program,
    _replay,
    analyse_whatif,
    best_alternative,
    recorded_settings,
    settings_label,
)

from .conftest import sample_truth

SETTINGS = {
    "": [],
    "_expandable": ["expandable_segments:True"],
    "_split64": ["max_split_size_mb:64"],
    "_split128": ["max_split_size_mb:128"],
    "_roundup4": ["roundup_power2_divisions:4"],
}
SPLITS = ("_split64", "_split128")
# what the steady state meets without max_split_size (module docstring): the twin's largest step
# ran before its window
TOLERANCE = {"twin": 0.13, "gaptwin": 0.08}
# (wrapped recording, setting) -> the twin's truth; every other setting that has a twin
CASES = [
    (f"{job}{rec}_wrapped", other, job) for job in TOLERANCE for rec in SETTINGS for other in SETTINGS if other != rec
]


def _peak_truth(name: str) -> int:
    return sample_truth(name)["memory_stats"]["0"]["reserved_bytes.all.peak"]


def _settings(key: str) -> AllocatorSettings:
    return apply_conf(AllocatorSettings(), SETTINGS[key])


@pytest.fixture(scope="module")
def predictions(real_frames):
    """Every wrapped twin under the five settings: (wrapped name) -> the what-if."""
    out = {}
    for job in TOLERANCE:
        for rec in SETTINGS:
            name = f"{job}{rec}_wrapped"
            # the recorded settings first, as `snaplab whatif` orders them
            order = [rec, *(k for k in SETTINGS if k != rec)]
            out[name] = analyse_whatif(real_frames(name), 0, [_settings(k) for k in order], None)
    return out


def _row(w, key: str):
    label = settings_label(_settings(key).describe())
    (row,) = [s for s in w.scenarios if settings_label(s.settings) == label]
    return row


@pytest.mark.parametrize(("wrapped", "other", "job"), CASES)
def test_wrapped_trace_predicts_the_whole_run_under_another_setting(predictions, wrapped, other, job):
    """The steady-state prediction against what the setting really reserved from the job's start
    (its twin recorded whole): within the job's tolerance without max_split_size, a lower bound
    with it."""
    row = _row(predictions[wrapped], other)
    truth = _peak_truth(f"{job}{other}_complete")
    assert row.start == START_STEADY
    assert not row.ooms
    if other in SPLITS:
        assert 0.5 * truth < row.peak_reserved_bytes < truth
    else:
        assert row.peak_reserved_bytes == pytest.approx(truth, rel=TOLERANCE[job])


@pytest.mark.parametrize("wrapped", sorted({c[0] for c in CASES}))
def test_the_recorded_settings_replay_exactly_from_the_recorded_cache(predictions, wrapped):
    """The recorded settings' row stays the replay from the cache rebuilt backwards from the dump:
    exact, and the job's real peak (every twin's reserved memory only grows)."""
    w = predictions[wrapped]
    recorded = w.scenarios[0]
    assert w.replay_check.exact, w.replay_check.reasons
    assert w.replay_check.start.startswith("rebuilt from the snapshot backwards")
    assert recorded.start == START_REBUILT
    assert recorded.peak_reserved_bytes == _peak_truth(wrapped)
    assert w.scenario_start.startswith("other settings from a steady state")
    assert w.steady_baseline is not None and w.steady_baseline.start == START_STEADY
    assert w.to_dict()["scenarios"][1]["start"] == START_STEADY


def test_the_recorded_cache_is_no_start_for_another_setting(real_frames, predictions):
    """The simpler rule, every setting replayed from the recorded cache at the trace's start,
    breaks on ``gaptwin_split64_wrapped``: the cache max_split_size_mb:64 left (5.09 GiB) serves
    the whole window under expandable segments, which really reserve 2.06 GiB; the steady state
    gives 2.06 GiB. On ``twin_wrapped`` the same rule says expandable segments change nothing
    (1.74 GiB; really 1.40)."""
    for job, wrapped, other in (
        ("gaptwin", "gaptwin_split64_wrapped", "_expandable"),
        ("twin", "twin_wrapped", "_expandable"),
    ):
        fr = real_frames(wrapped)
        base = recorded_settings(fr.info.allocator_settings)
        start = start_state(fr, 0, base)
        _, _, _, explicit = _replay(_program(fr, 0), base, None, start)
        from_cache, _, _, _ = _replay(_program(fr, 0), _settings(other), None, start, explicit)
        truth = _peak_truth(f"{job}{other}_complete")
        steady = _row(predictions[wrapped], other).peak_reserved_bytes
        assert abs(from_cache.stats.peak_reserved_bytes / truth - 1) > 0.2
        assert abs(steady / truth - 1) < abs(from_cache.stats.peak_reserved_bytes / truth - 1) / 2


def test_suggestions_compare_like_with_like(predictions):
    """A mid-run trace's alternatives are compared with the recorded settings from the same
    steady state too: on ``twin_wrapped`` expandable segments are suggested (they really save
    0.34 GiB), with a predicted saving measured against the steady baseline, not the recorded
    cache."""
    w = predictions["twin_wrapped"]
    found = best_alternative(w)
    assert found is not None
    best, why = found
    assert why == "lowers the peak reserved memory" and best.settings["expandable_segments"]
    assert w.steady_baseline is not None
    saving = w.steady_baseline.peak_reserved_bytes - best.peak_reserved_bytes
    true_saving = _peak_truth("twin_complete") - _peak_truth("twin_expandable_complete")
    assert true_saving < saving < w.scenarios[0].peak_reserved_bytes - best.peak_reserved_bytes


@pytest.mark.parametrize("job", sorted(TOLERANCE))
def test_complete_recordings_replay_once_from_empty(real_frames, job):
    """A trace that starts with the job replays every setting from empty, once, as before: each
    setting's real peak exactly, and no start label in its output."""
    w = analyse_whatif(real_frames(f"{job}_complete"), 0, [_settings(k) for k in SETTINGS], None)
    assert w.replay_check.start.startswith("empty")
    assert w.steady_baseline is None and not w.scenario_start
    for key, row in zip(SETTINGS, w.scenarios, strict=True):
        assert row.start is None and "start" not in row.to_dict()
        assert row.peak_reserved_bytes == _peak_truth(f"{job}{key}_complete"), key
    assert "scenario_start" not in w.to_dict() and "steady_baseline" not in w.to_dict()
