"""Issue #19, part 4: the allocator's own cache flush (``release_cached_blocks`` before a retried
cudaMalloc) is not the program's ``empty_cache()``.

Real positives: ``inf_flush_python`` (a small Llama in fp16, prefills of growing length under a
per-process cap: six flushes, no OOM) and ``gcretry_default_cap990`` (three flushes under a cap,
no OOM). Real negatives: ``empty_cache_churn`` (the program's own empty_cache() in its loop) and
every sample whose torch counters show no retry.
"""

from __future__ import annotations

import pytest

from snapshot_lab.metrics.allocator.releases import find_releases
from snapshot_lab.metrics.allocator.whatif import analyse_whatif, infer_memory_limit, recorded_settings

from .conftest import block, event, make_snapshot, sample_names, sample_truth, segment

MiB = 1 << 20
FLUSHED = ("inf_flush_python", "gcretry_default_cap990")


@pytest.fixture
def diagnoses(real_diagnosis):
    return lambda name: real_diagnosis(name)[1]


def _successful_retries(name: str, device: int) -> int:
    stats = sample_truth(name)["memory_stats"].get(str(device), {})
    return int(stats.get("num_alloc_retries") or 0) - int(stats.get("num_ooms") or 0)


@pytest.mark.parametrize("name", FLUSHED)
def test_each_flush_is_found_and_counted_like_torch(real_frames, diagnoses, name):
    """The flushes in the trace are torch's num_alloc_retries, one for one; the finding says how
    many, and there is no empty-cache-churn advice for a job that calls no empty_cache()."""
    stats = sample_truth(name)["memory_stats"]["0"]
    assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] > 0
    flushes = [r for r in find_releases(real_frames(name), 0) if r.cause == "flush"]
    assert len(flushes) == stats["num_alloc_retries"]
    findings = {f.id: f for f in diagnoses(name).findings}
    assert "empty-cache-churn" not in findings
    flush = findings["cache-flush"]
    assert flush.evidence["flushes"] == stats["num_alloc_retries"]
    assert f"flushed its cache {stats['num_alloc_retries']} times" in flush.title
    assert flush.evidence["bytes_released"] == sum(r.bytes for r in flushes) > 0
    assert flush.evidence["first_flush_s"] <= flush.evidence["last_flush_s"]
    assert flush.evidence["flush_time_us"] > 0 and "ms from their first cudaFree" in flush.advice
    assert "not torch.cuda.empty_cache() calls" in flush.advice


def test_the_inference_job_is_the_issues_case(real_frames, diagnoses):
    """inf_flush_python: prefills of 256..2048 tokens under a cap of 1.12x the need. The job calls
    no empty_cache(); the replay under the limit the flushes imply reproduces the six retries and
    the recorded peak, and no setting is claimed against a peak the recording never had."""
    truth = sample_truth("inf_flush_python")
    assert truth["workload"]["calls_empty_cache"] is False
    stats = truth["memory_stats"]["0"]
    w = diagnoses("inf_flush_python").whatifs[0]
    assert w.memory_limit_inferred and w.memory_limit_source.startswith("inferred from the 6 cache flushes")
    # the peak reserved is the lower bound; the real cap lies between it and the flushes' bound
    assert stats["reserved_bytes.all.peak"] <= w.memory_limit_bytes <= truth["workload"]["cap_bytes"]
    recorded = w.scenarios[0]
    assert w.replay_check.exact, w.replay_check.reasons
    assert recorded.alloc_retries == stats["num_alloc_retries"]
    assert recorded.peak_reserved_bytes == stats["reserved_bytes.all.peak"]
    for f in diagnoses("inf_flush_python").findings:
        if f.id == "allocator-settings":
            assert f.evidence["predicted_peak_reserved_bytes"] < stats["reserved_bytes.all.peak"]


def test_the_replay_reproduces_flushes_under_the_true_cap(real_frames):
    """Under the cap the job really ran with, the model flushes where the recording did."""
    fr = real_frames("inf_flush_python")
    truth = sample_truth("inf_flush_python")
    w = analyse_whatif(fr, 0, [recorded_settings(fr.info.allocator_settings)], truth["workload"]["cap_bytes"])
    assert w.replay_check.exact, w.replay_check.reasons
    assert w.scenarios[0].alloc_retries == truth["memory_stats"]["0"]["num_alloc_retries"]
    assert not w.scenarios[0].ooms


def test_the_program_s_empty_cache_loop_is_still_churn(diagnoses, real_frames):
    ids = {f.id for f in diagnoses("empty_cache_churn").findings}
    assert "empty-cache-churn" in ids and "cache-flush" not in ids
    assert {r.cause for r in find_releases(real_frames("empty_cache_churn"), 0)} == {"empty_cache"}


@pytest.mark.parametrize("name", sample_names())
def test_no_flush_where_torch_counted_no_retry(real_frames, name):
    """Over every real sample: a release is called a flush only where torch counted retries, and
    never more of them than torch counted retries that succeeded."""
    fr = real_frames(name)
    for dev in fr.info.trace_devices:
        flushes = [r for r in find_releases(fr, dev) if r.cause == "flush"]
        assert len(flushes) <= max(_successful_retries(name, dev), 0), (name, dev)


@pytest.mark.parametrize(
    "name",
    [
        "empty_cache_churn",
        "bulk_release_python",
        "gcretry_gc06_cap990",
        "gcretry_split64gc06_cap990",
        "whatif_maxsplit_capA",
        "cnn_clean",
        "transformer_varlen",
        "whatif_gc_capA",
    ],
)
def test_no_flush_finding_without_retries(diagnoses, name):
    """Garbage collection and oversize-block releases under a cap (the gc and max_split runs) are
    the allocator's too, but they are not flushes: torch counted no retry there."""
    assert sample_truth(name)["memory_stats"]["0"]["num_alloc_retries"] == 0
    assert "cache-flush" not in {f.id for f in diagnoses(name).findings}


def test_a_stackless_flush_on_a_thread_without_python_stacks(real_frames):
    """gcretry_default_cap990's first flush ran in backward (the autograd thread has no Python
    stack): the trace records stacks on its other frees, so the program did not call
    empty_cache() there."""
    first = find_releases(real_frames("gcretry_default_cap990"), 0)[0]
    assert first.cause == "flush" and first.followed_by == "segment_alloc"


# --------------------------------------------------------------------------- synthetic


def _flush_trace(with_stack: bool, frames_name: str = "forward") -> dict:
    """Two cached 20 MiB segments, then an allocation of 40 MiB that needs a new segment: the
    frees right before it are the flush (or the program's empty_cache() when its frame is there)."""
    fr = [{"filename": "job.py", "line": 7, "name": frames_name}] if with_stack else []
    seg_a, seg_b, seg_c = 0x10000000, 0x20000000, 0x30000000
    trace = [
        event("segment_alloc", seg_a, 20 * MiB, 1, fr),
        event("alloc", seg_a, 20 * MiB, 2, fr),
        event("free_requested", seg_a, 20 * MiB, 3, fr),
        event("free_completed", seg_a, 20 * MiB, 4, fr),
        event("segment_alloc", seg_b, 20 * MiB, 5, fr),
        event("alloc", seg_b, 20 * MiB, 6, fr),
        event("free_requested", seg_b, 20 * MiB, 7, fr),
        event("free_completed", seg_b, 20 * MiB, 8, fr),
        event("segment_free", seg_a, 20 * MiB, 9, fr),
        event("segment_free", seg_b, 20 * MiB, 10, fr),
        event("segment_alloc", seg_c, 40 * MiB, 11, fr),
        event("alloc", seg_c, 40 * MiB, 12, fr),
    ]
    segments = [segment(seg_c, [block(40 * MiB, frames=fr)])]
    return make_snapshot(segments=segments, traces=[trace])


def test_synthetic_flush_and_its_limit(snap_file):
    from snapshot_lab import load_frames

    fr = load_frames(snap_file(_flush_trace(True)))
    (release,) = find_releases(fr, 0)
    assert release.cause == "flush"
    assert release.reserved_before_bytes == 40 * MiB and release.next_segment_bytes == 40 * MiB
    limit = infer_memory_limit(fr, 0, 40 * MiB)
    assert limit.inferred and limit.bytes == 40 * MiB  # the peak: at most 80 MiB - 1 by the flush
    w = analyse_whatif(fr, 0, [recorded_settings(None)], limit.bytes)
    assert w.replay_check.exact and w.scenarios[0].alloc_retries == 1


def test_synthetic_empty_cache_is_not_a_flush(snap_file):
    from snapshot_lab import load_frames

    fr = load_frames(snap_file(_flush_trace(True, "empty_cache")))
    (release,) = find_releases(fr, 0)
    assert release.cause == "empty_cache"
    assert infer_memory_limit(fr, 0, 40 * MiB).bytes is None


@pytest.mark.parametrize(("small_freed", "cause"), [(True, "flush"), (False, "allocator")])
def test_under_garbage_collection_only_a_small_pool_release_is_a_flush(snap_file, small_freed, cause):
    """Garbage collection and max_split_size free large-pool segments only; the flush frees
    every unsplit cached segment, the small pool's 2 MiB ones too."""
    from snapshot_lab import load_frames

    fr_ = [{"filename": "job.py", "line": 7, "name": "forward"}]
    small, large, new = 0x10000000, 0x20000000, 0x30000000
    trace = [
        event("segment_alloc", small, 2 * MiB, 1, fr_),
        event("segment_alloc", large, 20 * MiB, 2, fr_),
        *([event("segment_free", small, 2 * MiB, 3, fr_)] if small_freed else []),
        event("segment_free", large, 20 * MiB, 4, fr_),
        event("segment_alloc", new, 40 * MiB, 5, fr_),
        event("alloc", new, 40 * MiB, 6, fr_),
    ]
    segments = [segment(new, [block(40 * MiB, frames=fr_)])]
    if not small_freed:
        segments.append(segment(small, [block(2 * MiB, "inactive", frames=[])], segment_type="small"))
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.6}
    fr = load_frames(snap_file(make_snapshot(segments, [trace], allocator_settings=settings)))
    (release,) = find_releases(fr, 0)
    assert release.cause == cause


def _two_releases() -> dict:
    """Two segments given back (a snapshot marker after them), two new ones, the last given back
    at the end of the trace; one without a time."""
    a, b, c, d = 0x10000000, 0x20000000, 0x30000000, 0x40000000
    trace = [
        event("segment_alloc", a, 20 * MiB, 1),
        event("segment_alloc", b, 30 * MiB, 2),
        event("segment_free", a, 20 * MiB, 3),
        event("segment_free", b, 30 * MiB, 4),
        event("snapshot", None, 0, 5),
        event("segment_alloc", c, 40 * MiB, 11),
        event("alloc", c, 40 * MiB, 12),
        event("segment_alloc", d, 10 * MiB, 13),
        {"action": "segment_free", "addr": d, "size": 10 * MiB, "stream": 0},
    ]
    return make_snapshot(segments=[segment(c, [block(40 * MiB)])], traces=[trace])


def test_every_field_of_a_release_is_read_at_its_rows(snap_file):
    """What each release says, worked out by hand: the bytes reserved before it (from the dump
    back), the new segments before the next one, what follows it past a snapshot marker, its
    time and how long until the next segment (none where the trace has no time)."""
    from snapshot_lab import load_frames

    first, last = find_releases(load_frames(snap_file(_two_releases())), 0)
    assert (first.start, first.end, first.segments, first.bytes) == (2, 4, 2, 50 * MiB)
    assert first.reserved_before_bytes == 50 * MiB and first.reserved_again_bytes == 50 * MiB
    assert (first.followed_by, first.next_segment_bytes) == ("segment_alloc", 40 * MiB)
    assert (first.time_us, first.duration_us) == (3, 8)
    assert (last.start, last.end, last.segments, last.bytes) == (8, 9, 1, 10 * MiB)
    assert last.reserved_before_bytes == 50 * MiB and last.reserved_again_bytes == 0
    assert (last.followed_by, last.next_segment_bytes) == ("", 0)
    assert (last.time_us, last.duration_us) == (None, None)
