"""The allocator's state at any event of a real trace, rebuilt from the snapshot (issue #12,
sections 4 and 5): the state at the trace's start undone backwards from the dump, then the
trace followed as recorded."""

from __future__ import annotations

import pytest

from snapshot_lab import api, stats
from snapshot_lab.metrics.allocator.model import recorded_settings
from snapshot_lab.metrics.allocator.state import follow, layout_of, same_layout, start_state
from snapshot_lab.metrics.history.moments import last_oom_index, moment_at
from snapshot_lab.metrics.stats.oom import analyse_oom

from .conftest import block, event, make_snapshot, sample_names, sample_path, sample_truth, segment


@pytest.mark.parametrize("name", sample_names())
def test_following_the_trace_ends_on_the_snapshot(real_frames, name):
    """Every real trace, complete, wrapped, recorded late, expandable, with CUDA graphs or several
    devices: followed as recorded from the rebuilt start, it ends exactly on the dump."""
    fr = real_frames(name)
    settings = recorded_settings(fr.info.allocator_settings)
    for dev in fr.info.devices:
        f = follow(fr, dev, settings)
        assert f.mismatches == 0
        assert same_layout(f.model.layout([lb.block for lb in f.live.values()]), layout_of(fr, dev))
        truth = sample_truth(name)["memory_stats"][str(dev)]
        assert f.model.stats.reserved_bytes == truth["reserved_bytes.all.current"]


def test_start_state_of_a_wrapped_trace(real_frames):
    """twin_wrapped keeps the last 2,500 events of a job; before them the allocator already held
    segments with live parameters and optimizer state. twin_complete recorded the same job from
    its start, so its state at the same step is known: same segments and live bytes."""
    wrapped, complete = real_frames("twin_wrapped"), real_frames("twin_complete")
    start = start_state(wrapped, 0, recorded_settings(wrapped.info.allocator_settings))
    assert len(start.segments) > 0 and start.unplaced_blocks == 0
    first_time = int(wrapped.events["time_us"].iloc[0])
    # the wrapped trace's first event is the complete one's event at the same position from the end
    offset = len(complete.events) - len(wrapped.events)
    assert complete.events["action"].iloc[offset:].tolist() == wrapped.events["action"].tolist()
    assert first_time > int(complete.events["time_us"].iloc[0])
    before = follow(complete, 0, recorded_settings(complete.info.allocator_settings), offset - 1)
    assert sum(s.size for s in start.segments) == before.model.stats.reserved_bytes
    # the same blocks were alive, at the same places (the two processes' addresses differ, so
    # each block is taken relative to its segment, segments in address order)
    rebuilt = [(s.size, sorted((a - s.address, n) for a, n in s.live.items())) for s in start.segments]
    real = sorted(
        (chain[0].addr, sum(b.size for b in chain), [(b.addr - chain[0].addr, b.size) for b in chain if b.allocated])
        for chain in before.model.segments([lb.block for lb in before.live.values()])
    )
    assert [n for n, _ in rebuilt] == [n for _, n, _ in real]
    short = []
    for (_, mine), (_, _, theirs) in zip(rebuilt, real, strict=True):
        assert [o for o, _ in mine] == [o for o, _ in theirs]
        short += [b - a for (_, a), (_, b) in zip(mine, theirs, strict=True) if a != b]
    # sizes are exact, except blocks the trace frees whose allocation took a cached block and
    # kept its unsplittable remainder (<= 1 MiB, large pool): the trace records only the request
    assert short and all(0 < d <= 2**20 for d in short)
    assert len(short) < sum(len(m) for _, m in rebuilt) / 4


def test_a_freed_block_keeps_the_remainder_the_trace_shows(snap_file):
    """A block alive before a wrapped trace, freed in it, was placed with its rounded request;
    but a 6.75 MiB request that took a cached 7.5 MiB block kept the 768 KiB it could not
    split. The trace shows it: while the block is live, the next allocation starts at 7.5 MiB
    (the free block after a live one starts at its end), so the start state must end it there."""
    from snapshot_lab import load_frames

    base, req, real = 0x7F0000000000, 7077888, 7864320
    trace = [
        event("alloc", base + real, 4 << 20, 1),
        event("free_requested", base, req, 2),
        event("free_completed", base, req, 2),
        event("free_requested", base + real, 4 << 20, 3),
        event("free_completed", base + real, 4 << 20, 3),
    ]
    fr = load_frames(snap_file(make_snapshot([segment(base, [block(20 << 20, "inactive")])], [trace])))
    settings = recorded_settings(fr.info.allocator_settings)
    assert start_state(fr, 0, settings).segments[0].live == {base: real}
    assert follow(fr, 0, settings).mismatches == 0


def test_the_wrapped_midrun_trace_shows_an_unsplit_remainder(real_frames):
    """midrun_wrapped_python: a 7077888 B block alive before the trace held 7864320 B; the
    trace's 72 MiB allocation at its real end (event 121) says so."""
    fr = real_frames("midrun_wrapped_python")
    start = start_state(fr, 0, recorded_settings(fr.info.allocator_settings))
    host = next(s for s in start.segments if s.address == 0x7F8448000000)
    assert host.live == {0x7F844AD00000: 7864320}


def test_the_oom_incident_explained_from_either_file(real_frames):
    """snaplab run wrote two files of one OOM: the observer's (at the failing request) and the
    one after the OutOfMemoryError unwound. Rebuilt at its OOM event, the second file's state is
    the first file's dump, block for block, and both give the same explanation."""
    oom, exc = real_frames("capture_oomx_oom_rank0"), real_frames("capture_oomx_exception_rank0")
    assert exc.info.capture["incident"]["same_as"] == "capture_oomx_oom_rank0.pickle"
    idx = last_oom_index(exc, 0)
    m = moment_at(exc, 0, idx)
    assert m is not None and not m.at_dump and "rebuilt from the trace" in m.description
    assert same_layout(layout_of_moment(m), layout_of(oom, 0))
    a, b = stats(sample_path("capture_oomx_oom_rank0")).oom, stats(sample_path("capture_oomx_exception_rank0")).oom
    keep = ("requested_bytes", "cause", "free_in_reserved_bytes", "largest_free_block_bytes", "allocated_bytes")
    assert {k: getattr(a, k) for k in keep} == {k: getattr(b, k) for k in keep}
    assert b.cause == "capacity" and b.free_in_reserved_bytes == 0 and b.allocated_bytes > 2.8 * 2**30
    # what the dump alone says, and why it was wrong: the unwinding freed the step's memory
    dump_only = analyse_oom(exc.segments, exc.blocks, exc.events)
    assert dump_only.largest_free_block_bytes >= dump_only.requested_bytes
    assert dump_only.allocated_bytes < 100 * 2**20


def layout_of_moment(m):
    out = []
    for _, g in m.blocks.groupby("segment_id", sort=False):
        out.append([(int(s), st != "inactive") for s, st in zip(g["size_bytes"], g["state"].astype(str), strict=True)])
    return out


def test_report_says_which_moment_it_shows(tmp_path):
    html = api.report(sample_path("capture_oomx_exception_rank0"), output=tmp_path / "r.html").read_text()
    assert "rebuilt from the trace at event" in html
    assert "oom-capacity" in html and "oom-fragmentation" not in html
