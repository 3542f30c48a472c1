"""Free memory split into stranded holes (what fragmentation costs) and cached, releasable segments."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from snapshot_lab.cli import app
from snapshot_lab.frames import build_frames
from snapshot_lab.load import load_snapshot
from snapshot_lab.metrics.stats.fragmentation import compute_fragmentation

from .conftest import block, make_snapshot, sample_path, segment

MiB = 1 << 20
runner = CliRunner()


def test_free_memory_splits_into_stranded_and_cached_releasable(snap_file):
    segs = [
        segment(0, [block(4 * MiB), block(6 * MiB, "inactive"), block(4 * MiB), block(6 * MiB, "inactive")]),
        segment(1 << 30, [block(20 * MiB, "inactive")]),  # wholly free: a cache, not a loss
        segment(2 << 30, [block(4 * MiB, requested=3 * MiB)]),
    ]
    fr = build_frames(load_snapshot(snap_file(make_snapshot(segs))))
    f = compute_fragmentation(fr.segments, fr.blocks)["all"]
    assert f.stranded_bytes == 12 * MiB
    assert f.cached_releasable_bytes == 20 * MiB
    assert f.stranded_bytes + f.cached_releasable_bytes == f.free_bytes
    assert f.stranded_share == pytest.approx(12 / 44, abs=1e-6)  # of 44 MiB reserved


def test_nothing_reserved_means_no_fragmentation(snap_file):
    fr = build_frames(load_snapshot(snap_file(make_snapshot([]))))
    f = compute_fragmentation(fr.segments, fr.blocks)["all"]
    assert (f.stranded_share, f.cached_releasable_bytes) == (0.0, 0)


def test_stats_json_adds_keys_and_keeps_the_old_ones():
    r = runner.invoke(app, ["stats", str(sample_path("oom_fragmentation")), "--json"])
    assert r.exit_code == 0, r.output
    frag = json.loads(r.stdout)["fragmentation"]["all"]
    for old in (
        "free_bytes",
        "largest_free_block_bytes",
        "external_fragmentation",
        "stranded_bytes",
        "releasable_bytes",
    ):
        assert old in frag
    assert frag["stranded_bytes"] == frag["free_bytes"]  # every hole sits beside a live block
    assert frag["cached_releasable_bytes"] == 0
    assert frag["stranded_share"] == pytest.approx(frag["stranded_bytes"] / frag["reserved_bytes"], abs=1e-6)


def test_stats_text_leads_with_the_stranded_share():
    r = runner.invoke(app, ["stats", str(sample_path("oom_fragmentation"))])
    assert r.exit_code == 0, r.output
    assert "fragmentation: 70.0% of reserved memory is stranded (1.03 GiB in holes" in r.stdout
    assert "cached, releasable (empty_cache)" in r.stdout
