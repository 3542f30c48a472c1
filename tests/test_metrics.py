"""Metrics on small synthetic layouts, with values worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from snapshot_lab.frames import build_frames
from snapshot_lab.load import load_snapshot
from snapshot_lab.metrics import compute_fragmentation, compute_stats, compute_torch_stats
from snapshot_lab.metrics.stats.fragmentation import free_block_histogram

from .conftest import block, event, make_snapshot, segment

MiB = 2**20


def _frames(snap_file, obj):
    return build_frames(load_snapshot(snap_file(obj)))


def test_torch_counters_by_hand(snap_file):
    segs = [
        segment(
            0,
            [block(512, requested=100), block(512, "inactive"), block(1024, "active_pending_free", requested=900)],
            segment_type="small",
        ),
        segment(1 << 30, [block(20 * MiB, requested=20 * MiB - 5)]),  # unsplit, fully used
        segment(2 << 30, [block(4 * MiB), block(16 * MiB, "inactive")]),
        segment(3 << 30, [block(2 * MiB, "inactive"), block(2 * MiB)], expandable=True),
    ]
    fr = _frames(snap_file, make_snapshot(segs))
    c = compute_torch_stats(fr.segments, fr.blocks)
    assert c["reserved_bytes.all.current"] == 2048 + 20 * MiB + 20 * MiB + 4 * MiB
    assert c["allocated_bytes.small_pool.current"] == 512
    assert c["active_bytes.small_pool.current"] == 1536
    assert c["requested_bytes.small_pool.current"] == 1000  # pending frees still count as requested
    assert c["allocation.all.current"] == 4
    assert c["active.all.current"] == 5
    assert c["segment.all.current"] == 3  # the expandable one is not a cudaMalloc segment
    assert c["inactive_split.all.current"] == 2  # small-pool hole + large hole, not the expandable one
    assert c["inactive_split_bytes.large_pool.current"] == 16 * MiB
    assert c["inactive_split_bytes.small_pool.current"] == 512


def test_fragmentation_by_hand(snap_file):
    segs = [
        segment(0, [block(4 * MiB), block(6 * MiB, "inactive"), block(4 * MiB), block(6 * MiB, "inactive")]),
        segment(1 << 30, [block(20 * MiB, "inactive")]),  # wholly free: releasable
        segment(2 << 30, [block(4 * MiB, requested=3 * MiB)]),
    ]
    fr = _frames(snap_file, make_snapshot(segs))
    f = compute_fragmentation(fr.segments, fr.blocks)["large_pool"]
    assert f.free_bytes == 32 * MiB
    assert f.largest_free_block_bytes == 20 * MiB
    assert f.external_fragmentation == pytest.approx(1 - 20 / 32)
    assert f.stranded_bytes == 12 * MiB
    assert f.releasable_bytes == 20 * MiB
    assert f.internal_waste_bytes == MiB
    assert [(b.lower_bytes, b.count, b.bytes) for b in f.free_block_histogram] == [
        (4 * MiB, 2, 12 * MiB),
        (8 * MiB, 0, 0),
        (16 * MiB, 1, 20 * MiB),
    ]


def test_histogram_bins_exact_at_powers_of_two():
    h = free_block_histogram(np.array([512, 1023, 1024, 2**40 - 1, 2**40], dtype=np.int64))
    counts = {b.lower_bytes: b.count for b in h}
    assert counts[512] == 2 and counts[1024] == 1 and counts[2**39] == 1 and counts[2**40] == 1
    assert free_block_histogram(np.array([], dtype=np.int64)) == ()


def test_expandable_releasable_counts_whole_pages(snap_file):
    # a free 50 MiB block in an expandable large segment starting at a page boundary: 2 whole 20 MiB pages
    base = 200 * 20 * MiB
    segs = [segment(base, [block(10 * MiB), block(50 * MiB, "inactive")], expandable=True)]
    fr = _frames(snap_file, make_snapshot(segs))
    f = compute_fragmentation(fr.segments, fr.blocks)["all"]
    assert f.releasable_bytes == 40 * MiB


def _oom_snapshot(free_sizes, request):
    segs = [segment(i << 30, [block(6 * MiB), block(s, "inactive")]) for i, s in enumerate(free_sizes)]
    oom = {"action": "oom", "size": request, "stream": 0, "time_us": 9, "device_free": 1000}
    return make_snapshot(segs, [[event("alloc", 0, 6 * MiB, 1), oom]])


def test_oom_cause_fragmentation(snap_file):
    s = compute_stats(_frames(snap_file, _oom_snapshot([14 * MiB, 14 * MiB], 16 * MiB)))
    assert s.oom.cause == "fragmentation"
    assert (s.oom.free_in_reserved_bytes, s.oom.largest_free_block_bytes) == (28 * MiB, 14 * MiB)
    assert s.oom.snapshot_at_oom


def test_oom_cause_capacity(snap_file):
    s = compute_stats(_frames(snap_file, _oom_snapshot([2 * MiB], 16 * MiB)))
    assert s.oom.cause == "capacity"
    assert s.oom.device_free_bytes == 1000


def test_oom_ignores_other_pools_and_streams(snap_file):
    snap = _oom_snapshot([14 * MiB, 14 * MiB], 16 * MiB)
    snap["segments"][1]["stream"] = 77  # another stream's cache cannot serve the request
    s = compute_stats(_frames(snap_file, snap))
    assert s.oom.free_in_reserved_bytes == 14 * MiB
    assert s.oom.cause == "capacity"


def test_the_failing_device_comes_first(snap_file):
    """Issue #19, part 5: an OOM on device 1 of a two-device file: the stats, the what-if and the
    diagnosis lead with device 1."""
    from snapshot_lab import api
    from snapshot_lab.metrics.diagnose import diagnose

    segs = [
        segment(1 << 30, [block(6 * MiB), block(14 * MiB, "inactive")], device=0),
        segment(2 << 30, [block(6 * MiB), block(14 * MiB, "inactive")], device=1),
    ]
    oom = {"action": "oom", "size": 16 * MiB, "stream": 0, "time_us": 9, "device_free": 1000}
    traces = [
        [event("segment_alloc", 1 << 30, 20 * MiB, 1), event("alloc", 1 << 30, 6 * MiB, 2)],
        [event("segment_alloc", 2 << 30, 20 * MiB, 3), event("alloc", 2 << 30, 6 * MiB, 4), oom],
    ]
    path = snap_file(make_snapshot(segs, traces))
    fr = _frames(snap_file, make_snapshot(segs, traces))
    stats = compute_stats(fr)
    assert list(stats.devices) == [1, 0] and stats.oom.device == 1
    assert list(diagnose(fr, stats, False).whatifs) == [1, 0]
    assert [w.device for w in api.whatif(path)] == [1, 0]
    # without an OOM, index order
    quiet = compute_stats(_frames(snap_file, make_snapshot(segs, [traces[0], traces[1][:2]])))
    assert list(quiet.devices) == [0, 1]
    # findings of one severity follow the same order: the failing device's first
    from snapshot_lab.metrics import findings as findings_module
    from snapshot_lab.metrics.findings.base import Finding

    def both_devices(ctx):
        return [Finding(id=f"probe-{d}", severity="info", title="", advice="", device=d) for d in (0, 1)]

    rules = findings_module.RULES
    try:
        findings_module.RULES = [both_devices]
        assert [f.device for f in findings_module.compute_findings(stats, fr)] == [1, 0]
        assert [f.device for f in findings_module.compute_findings(quiet, fr)] == [0, 1]
    finally:
        findings_module.RULES = rules
