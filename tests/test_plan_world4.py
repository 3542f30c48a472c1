"""snaplab plan at world size 4 (issue #24): on four GPUs over NCCL (the end of this file), and
first, before a machine with four GPUs was lent, on one GPU.

Those recordings put four ranks on one H100 over gloo
(``sample_snapshots/jobs/run_world4_one_gpu.sh``: ``train_parallel.py`` with
``SNAPLAB_ONE_GPU=1``, one process per rank, each with its own caching allocator and its own
``memory_stats()``). The two models of ``workloads_parallel.py`` under DDP (both bucket-view
settings), ZeRO-1 (``ZeroRedundancyOptimizer`` over DDP), FSDP2 (both ``reshard_after_forward``
settings), FSDP1 (FULL_SHARD) and tensor parallelism of degree 4; per-rank batch as in the 2-GPU
runs. Pipelines could not run this way: gloo's send/recv of CUDA tensors fails ("writev: Bad
address"), and FSDP+TP needs two GPUs per dimension to mean anything; both wait for a 4-GPU machine.

The plans come from the same single-GPU snapshots as the world-size-2 checks in
``test_plan.py``: nothing here was fitted to these runs (they were recorded after the rules).
"""

from __future__ import annotations

import pytest

from snapshot_lab.metrics.plan import Strategy, plan_memory

from .conftest import sample_path, sample_truth

WORLD = 4
MODELS = ("mlp", "transformer")
CASES = {
    "ddp_nobucketview": Strategy("ddp", WORLD),
    "ddp_bucketview": Strategy("ddp", WORLD, bucket_view=True),
    "tp": Strategy("tp", WORLD),
    "zero1": Strategy("zero1", WORLD),
    "fsdp2_reshard": Strategy("fsdp", WORLD),
    "fsdp2_noreshard": Strategy("fsdp", WORLD, reshard_after_forward=False),
    "fsdp1_fullshard": Strategy("fsdp1", WORLD),
}
# over NCCL on four GPUs (the end of this file) the 4-stage pipelines ran too
NCCL_CASES = {
    **CASES,
    "pp_gpipe": Strategy("pp", WORLD, microbatches=8, schedule="gpipe"),
    "pp_1f1b": Strategy("pp", WORLD, microbatches=8, schedule="1f1b"),
    "fsdp_tp": Strategy("fsdp+tp", WORLD),  # FSDP2 over TP pairs, a 2 x 2 mesh
}
# The MLP under FSDP+TP reserves 9.4-11.1% more than planned on every rank (its allocated peak is
# 2.3% off): the job moves the whole model to the GPU (``model.to("cuda")``) before sharding it, one
# 16 MiB segment per weight on every rank; the shards replace the weights and those segments stay
# cached, reused only by blocks of 16 MiB or less. The plan starts from the shards. The GPT's
# smaller weights' segments are reused by its activations: its plan is within 1.1%.
NCCL_RESERVED_MISSES = {("fsdp_tp", "mlp"): 0.12}
SETUP_SEGMENT_BYTES = 16 * 2**20
# The rule that misses: ``distribute_tensor`` scatters every column/row-sharded weight from the
# mesh's first rank, which allocates the shard list (eight 16 MiB chunks for the MLP) before the
# model trains; its segment stays cached on rank 0 alone, 16 MiB that the plan (every TP rank
# alike) does not have: rank 0's reserved peak is 742 MiB against 726 MiB on the other ranks.
#
# The second: gloo has no reduce-scatter of CUDA tensors, so ``reduce_scatter_tensor`` falls back to
# staging buffers of its own (54 MiB of segments on the MLP's rank 0, under
# ``distributed_c10d.py:reduce_scatter_tensor``) that NCCL does not allocate; the plan models NCCL.
# The same plan of FSDP2 without resharding is exact (+0.0% reserved) against the world-size-2 NCCL
# runs of test_plan.py. Only the MLP's reserved memory, where those buffers are a larger share, misses.
RESERVED_MISSES = {("tp", "mlp", 0): 0.12, **{("fsdp2_noreshard", "mlp", rank): 0.11 for rank in range(WORLD)}}


@pytest.fixture(scope="module")
def plans(real_frames):
    cache: dict[tuple[str, str], object] = {}

    def get(case: str, model: str):
        if (case, model) not in cache:
            cache[(case, model)] = plan_memory(real_frames(f"single_{model}"), NCCL_CASES[case])
        return cache[(case, model)]

    return get


def _truth(name: str) -> tuple[int, int]:
    stats = next(iter(sample_truth(name)["memory_stats"].values()))
    return stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", list(CASES))
def test_prediction_against_the_real_world4_run(plans, case, model, rank):
    """Allocated within 5% and reserved within 10% of each real rank, but the one named miss."""
    plan = plans(case, model)
    predicted = plan.ranks[min(rank, len(plan.ranks) - 1)]
    alloc, reserved = _truth(f"{case}_ws4gloo_{model}_rank{rank}")
    err_alloc = predicted.peak_allocated_bytes / alloc - 1
    err_reserved = predicted.peak_reserved_bytes / reserved - 1
    assert abs(err_alloc) <= 0.05, f"allocated {err_alloc:+.1%}"
    assert abs(err_reserved) <= RESERVED_MISSES.get((case, model, rank), 0.10), f"reserved {err_reserved:+.1%}"


def test_the_named_miss_is_the_scatter_source_only():
    """Ranks 1-3 of the TP MLP reserve the same; rank 0 exactly one 16 MiB segment more."""
    reserved = [_truth(f"tp_ws4gloo_mlp_rank{rank}")[1] for rank in range(WORLD)]
    assert len(set(reserved[1:])) == 1
    assert reserved[0] - reserved[1] == 16 * 2**20


def test_gloo_stages_the_reduce_scatter():
    """The gloo run's segments include the fallback's staging; the NCCL twin's have none."""
    assert _segment_bytes_under("fsdp2_noreshard_ws4gloo_mlp_rank0", "reduce_scatter_tensor") >= 48 * 2**20
    assert _segment_bytes_under("fsdp2_noreshard_mlp_rank0", "reduce_scatter_tensor") == 0


def _segment_bytes_under(name: str, function: str) -> int:
    import lzma
    import pickle

    with lzma.open(sample_path(name)) as f:
        snapshot = pickle.load(f)  # our own sample, recorded by us: not an untrusted file
    return sum(
        entry["size"]
        for entry in snapshot["device_traces"][0]
        if entry["action"] == "segment_alloc" and function in (entry.get("frames") or [{}])[0].get("name", "")
    )


@pytest.mark.parametrize("model", MODELS)
def test_world4_ranks_record_their_layout(model):
    """The sidecar's layout of every rank says world size 4, and the TP degree where it applies."""
    for case in CASES:
        for rank in range(WORLD):
            truth = sample_truth(f"{case}_ws4gloo_{model}_rank{rank}")
            assert truth["workload"]["world_size"] == WORLD
            assert truth["workload"]["rank"] == rank
            assert truth["workload"]["ranks_share_one_gpu_over_gloo"] is True


# --------------------------------------------------------------------------- four GPUs over NCCL
# Recorded on 2026-11-26 when a 4-GPU kind was first lent (4 x H200, ``workloads_parallel.py``,
# group ``world4``): the same jobs over NCCL, one GPU per rank, and the 4-stage pipelines
# (GPipe and 1F1B, 8 microbatches) that gloo could not run. The plans are the same ones, from
# the same single-GPU snapshots, untouched by these runs.
# The rule that misses: DDP's first bucket storage (265 MiB for the GPT, made by
# ``_ddp_init_helper``) is freed when the reducer rebuilds its buckets, and each rank gets there at
# its own moment: before the second iteration's peak on some ranks, after it on others, which
# then peak 266 MiB higher. The plan frees it as the early ranks do (exact on them); nothing in a
# single-GPU recording tells a rank's timing. ZeRO-1 wraps the same DDP.
LATE_FIRST_BUCKETS = {
    ("ddp_nobucketview", "transformer"): (0, 1, 3),
    ("ddp_bucketview", "transformer"): (2,),
    ("zero1", "transformer"): (1,),
}
FIRST_BUCKETS_BYTES = 277_936_128


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", list(NCCL_CASES))
def test_prediction_against_the_real_world4_nccl_run(plans, case, model, rank):
    """Allocated within 5% and reserved within 10% of each real rank on four GPUs, but the ranks
    whose first DDP buckets were freed late, where the plan is below by those buckets, and the
    MLP's FSDP+TP reserved memory (the whole model's segments, cached after sharding)."""
    plan = plans(case, model)
    predicted = plan.ranks[min(rank, len(plan.ranks) - 1)]
    alloc, reserved = _truth(f"{case}_ws4nccl_{model}_rank{rank}")
    late = rank in LATE_FIRST_BUCKETS.get((case, model), ())
    expected = alloc - FIRST_BUCKETS_BYTES if late else alloc
    assert abs(predicted.peak_allocated_bytes / expected - 1) <= 0.05, (
        f"allocated {predicted.peak_allocated_bytes / alloc - 1:+.1%}"
    )
    bound = NCCL_RESERVED_MISSES.get((case, model), 0.10)
    assert abs(predicted.peak_reserved_bytes / reserved - 1) <= bound, (
        f"reserved {predicted.peak_reserved_bytes / reserved - 1:+.1%}"
    )


@pytest.mark.parametrize(("case", "late"), [(c, r) for (c, _), r in LATE_FIRST_BUCKETS.items()])
def test_the_first_buckets_are_freed_at_each_ranks_own_moment(real_frames, case, late):
    """The late ranks free the 265 MiB later in their trace than the others, and peak higher."""
    freed = {}
    for rank in range(WORLD):
        ev = real_frames(f"{case}_ws4nccl_transformer_rank{rank}").events
        done = ev[(ev["size_bytes"] == FIRST_BUCKETS_BYTES) & (ev["action"] == "free_completed")]["event_index"]
        freed[rank] = int(done.max())
    early = [r for r in range(WORLD) if r not in late]
    assert min(freed[r] for r in late) > max(freed[r] for r in early)
    peaks = {r: _truth(f"{case}_ws4nccl_transformer_rank{r}")[0] for r in range(WORLD)}
    assert min(peaks[r] for r in late) > max(peaks[r] for r in early)


@pytest.mark.parametrize("model", MODELS)
def test_world4_nccl_ranks_record_their_layout(model):
    """Every rank on its own GPU, world size 4; each pipeline stage holds its own blocks."""
    for case in NCCL_CASES:
        for rank in range(WORLD):
            work = sample_truth(f"{case}_ws4nccl_{model}_rank{rank}")["workload"]
            assert (work["world_size"], work["rank"], work["ranks_share_one_gpu_over_gloo"]) == (WORLD, rank, False)
            if case.startswith("pp_"):
                assert (work["pp_num_stages"], work["pp_stage"]) == (WORLD, rank)
            if case == "fsdp_tp":
                assert (work["tp_degree"], work["fsdp_degree"], work["mesh_dim_names"]) == (2, 2, ["dp", "tp"])


def test_the_mlp_is_moved_whole_to_each_gpu_before_it_is_sharded():
    """Every FSDP+TP rank of the MLP makes eight 16 MiB segments in ``Module._apply`` (its eight
    weights, whole; its biases go in a small segment) before the shards exist: the reserved
    memory the plan does not count."""
    import lzma
    import pickle

    for rank in range(WORLD):
        with lzma.open(sample_path(f"fsdp_tp_ws4nccl_mlp_rank{rank}")) as f:
            snapshot = pickle.load(f)  # our own sample, recorded by us: not an untrusted file
        made = [
            entry["size"]
            for entry in snapshot["device_traces"][rank]
            if entry["action"] == "segment_alloc" and (entry.get("frames") or [{}])[0].get("name") == "convert"
        ]
        assert [size for size in made if size >= SETUP_SEGMENT_BYTES] == [SETUP_SEGMENT_BYTES] * 8  # and 2 MiB ones
