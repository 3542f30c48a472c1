"""Acceptance: snaplab's numbers equal what torch itself reported on a real GPU.

Each ``sample_snapshots/<name>.truth.json`` holds ``torch.cuda.memory_stats(d)`` taken right
before the snapshot was dumped (see sample_snapshots/workloads.py).
"""

from __future__ import annotations

import pytest

from snapshot_lab.metrics import STAT_NAMES, compute_stats

from .conftest import sample_names, sample_truth

NAMES = sample_names()
POOLS = ("all", "large_pool", "small_pool")


def test_samples_are_present():
    # the acceptance suite must not silently shrink to nothing
    assert len(NAMES) >= 25
    for required in (
        "transformer_varlen",
        "oom_fragmentation",
        "expandable",
        "state_only",
        "cpp_stacks",
        "cuda_graph",
        "ddp_nobucketview_rank0",
        "ddp_nobucketview_rank1",
        "dataparallel",
    ):
        assert required in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_torch_counters_exact_per_device(name, real_frames):
    truth = sample_truth(name)
    stats = compute_stats(real_frames(name))
    used = {int(d) for d, c in truth["memory_stats"].items() if c.get("reserved_bytes.all.current", 0)}
    assert set(stats.devices) == used  # devices torch reports with nothing reserved are not shown
    for dev, torch_counters in truth["memory_stats"].items():
        if int(dev) not in used:
            assert all(v == 0 for k, v in torch_counters.items() if k.endswith(".current"))
            continue
        mine = stats.devices[int(dev)].torch_stats
        for stat in STAT_NAMES:
            for pool in POOLS:
                key = f"{stat}.{pool}.current"
                assert mine[key] == torch_counters[key], f"{name} device {dev}: {key}"


@pytest.mark.parametrize("name", NAMES)
def test_top_level_torch_stats(name, real_frames):
    truth = sample_truth(name)
    stats = compute_stats(real_frames(name))
    for stat in STAT_NAMES:
        for pool in POOLS:
            key = f"{stat}.{pool}.current"
            expected = sum(c[key] for c in truth["memory_stats"].values())
            assert stats.torch_stats[key] == expected, key


def test_oom_fragmentation_cause(real_frames):
    truth = sample_truth("oom_fragmentation")
    oom = compute_stats(real_frames("oom_fragmentation")).oom
    w = truth["workload"]
    assert oom is not None
    assert oom.cause == "fragmentation"
    assert oom.requested_bytes == w["requested_bytes"]
    assert oom.device_free_bytes == w["observer_args"]["device_free"]
    # 75 segments of 20 MiB, each holding one live 6 MiB block and a 14 MiB hole
    assert oom.free_in_reserved_bytes == 75 * 14 * 2**20
    assert oom.largest_free_block_bytes == 14 * 2**20
    assert oom.reserved_bytes == truth["memory_stats"]["0"]["reserved_bytes.all.current"]
    assert oom.snapshot_at_oom is True
    assert oom.oom_count == truth["memory_stats"]["0"]["num_ooms"]


def test_oom_capacity_cause(real_frames):
    truth = sample_truth("oom_capacity")
    oom = compute_stats(real_frames("oom_capacity")).oom
    assert oom is not None and oom.cause == "capacity"
    assert oom.requested_bytes == truth["workload"]["requested_bytes"]
    assert oom.free_in_reserved_bytes == 0
    assert oom.device_free_bytes == truth["workload"]["observer_args"]["device_free"]


@pytest.mark.parametrize("name", [n for n in NAMES if not sample_truth(n)["workload"].get("oom_observed")])
def test_no_oom_where_none_happened(name, real_frames):
    assert compute_stats(real_frames(name)).oom is None


def test_fragmentation_of_the_oom_layout(real_frames):
    frag = compute_stats(real_frames("oom_fragmentation")).fragmentation["large_pool"]
    assert frag.free_bytes == 75 * 14 * 2**20
    assert frag.free_blocks == 75
    assert frag.stranded_bytes == frag.free_bytes  # every hole sits next to a live block
    assert frag.releasable_bytes == 0
    assert frag.external_fragmentation == pytest.approx(1 - 1 / 75, abs=1e-6)
    assert [(b.lower_bytes, b.count) for b in frag.free_block_histogram] == [(8 * 2**20, 75)]


def test_pending_free_blocks(real_frames):
    fr = real_frames("pending_free")
    pending = fr.blocks[fr.blocks["state"] == "active_pending_free"]
    assert len(pending) == sample_truth("pending_free")["workload"]["expect"]["pending_free_blocks"]
    assert (
        int(pending["requested_size_bytes"].sum())
        == sample_truth("pending_free")["workload"]["pending_bytes_requested"]
    )


def test_cuda_graph_private_pool(real_frames):
    stats = compute_stats(real_frames("cuda_graph"))
    assert stats.devices[0].private_pool_reserved_bytes > 0
    fr = real_frames("cuda_graph")
    assert set(map(tuple, fr.segments.loc[fr.segments["is_private_pool"], ["pool_id_0", "pool_id_1"]].to_numpy())) == {
        (1, 0)
    }


def test_expandable_segments(real_frames):
    fr = real_frames("expandable")
    assert fr.segments["is_expandable"].all()
    assert fr.info.allocator_settings["expandable_segments"] is True
    assert (fr.events["action"] == "segment_map").sum() > 0
    assert (fr.events["action"] == "segment_alloc").sum() == 0


def test_recording_modes(real_frames):
    assert compute_stats(real_frames("state_only")).recording.mode == "state"
    assert compute_stats(real_frames("transformer_varlen")).recording.mode == "trace"
    assert compute_stats(real_frames("cpp_stacks")).recording.stacks == "python+cpp"
    assert compute_stats(real_frames("transformer_varlen")).recording.stacks == "python"


def test_history_completeness(real_frames):
    # recording started before the first allocation: nothing is missing
    assert compute_stats(real_frames("transformer_varlen")).recording.history_complete
    # a 3000-entry ring buffer over a longer run lost its early history
    wrapped = compute_stats(real_frames("ring_wrapped")).recording
    assert not wrapped.history_complete
    assert wrapped.devices[0].live_bytes_before_trace > 0


def test_orphan_frees_are_the_addresses_freed_before_the_trace_allocates_them(real_frames):
    """An address is an orphan free where its first free in the trace comes before its first
    allocation there, or it is never allocated there; a free without an address is no address."""
    import numpy as np
    import pandas as pd

    from snapshot_lab.metrics.recording import device_recording

    rows = [  # (action, address): A freed then allocated, D only freed: two orphans
        ("free_requested", 0xA), ("alloc", 0xB), ("free_requested", 0xB), ("alloc", 0xA), ("alloc", 0xE),
        ("free_completed", 0xD), ("free_requested", 0xE), ("free_completed", 0xE), ("free_requested", None),
        ("segment_alloc", 0xF), ("alloc", 0xC),
    ]  # fmt: skip
    events = pd.DataFrame(
        {
            "device": np.zeros(len(rows), dtype=np.int64),
            "event_index": np.arange(len(rows)),
            "action": pd.Categorical([a for a, _ in rows]),
            "address": pd.array([x for _, x in rows], dtype="Int64"),
            "time_us": pd.array([None] * len(rows), dtype="Int64"),
        }
    )
    blocks = pd.DataFrame({"device": [0], "state": ["active_allocated"], "address": [0xC], "size_bytes": [512]})
    assert device_recording(0, events, blocks).orphan_frees == 2
    ring = real_frames("ring_wrapped")
    ev = ring.events
    first = ev.dropna(subset=["address"]).groupby(["address", "action"], observed=True)["event_index"].min().unstack()
    alloc = first["alloc"]
    free = first[["free_requested", "free_completed"]].min(axis=1)
    expected = int((free.notna() & (alloc.isna() | (free < alloc))).sum())
    assert expected > 0
    assert compute_stats(ring).recording.devices[0].orphan_frees == expected


def test_ddp_rank_trace_index(real_frames):
    # rank 1 of a DDP job: its trace is at index 1, with an empty trace before it
    fr = real_frames("ddp_nobucketview_rank1")
    assert fr.info.devices == (1,)
    assert fr.info.trace_devices == (1,)
    assert fr.info.n_trace_devices == 2


def test_dataparallel_two_devices(real_frames):
    stats = compute_stats(real_frames("dataparallel"))
    assert set(stats.devices) == {0, 1}
    truth = sample_truth("dataparallel")["memory_stats"]
    assert stats.torch_stats["reserved_bytes.all.current"] == sum(
        t["reserved_bytes.all.current"] for t in truth.values()
    )


def test_stacks_are_interned(real_frames):
    fr = real_frames("transformer_varlen")
    with_stack = fr.events["stack_id"].notna().sum()
    # thousands of events share a few hundred distinct stacks (backward-pass allocations run on
    # autograd's C++ thread and have no Python stack)
    assert with_stack > 3000
    assert fr.stacks["stack_id"].nunique() < with_stack / 5
    # a stack resolves to frames, innermost first, naming the workload's code
    sid = int(fr.events.loc[fr.events["action"] == "alloc", "stack_id"].dropna().iloc[0])
    frames = fr.stack(sid)
    assert frames and all(set(f) == {"filename", "line", "name"} for f in frames)
    assert any(f["filename"].endswith("workloads.py") for f in frames)


def test_cpp_stacks_name_what_allocated(real_frames):
    """With C++ stacks, allocator and dispatcher frames are internals: the cuBLAS workspaces
    (one for the main thread, one for autograd's) are named as such, with what first used them."""
    from snapshot_lab.metrics.attribution.sites import display_stack, live_sites, snapshot_sites

    fr = real_frames("cpp_stacks")
    sites = live_sites(fr.blocks, snapshot_sites(fr), 10)
    labels = {s.label: s.detail for s in sites}
    assert labels["cuBLAS workspace, first used by AddmmBackward0 (backward)"].startswith("at::cuda::")
    assert any(s.startswith("cuBLAS workspace, first used at ") and "workloads.py" in s for s in labels)
    shown = display_stack(fr.stack(sites[0].stack_id))
    assert shown and not any("CUDACachingAllocator" in str(f["name"]) for f in shown)
