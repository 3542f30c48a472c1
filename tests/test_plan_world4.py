"""snaplab plan at world size 4 (issue #24, what a one-GPU machine allows).

No machine with four GPUs was lent, so these recordings put four ranks on one H100 over gloo
(``sample_snapshots/jobs/run_world4_one_gpu.sh``: ``train_parallel.py`` with
``SNAPLAB_ONE_GPU=1``, one process per rank, each with its own caching allocator and its own
``memory_stats()``). The two models of ``workloads_parallel.py`` under DDP (both bucket-view
settings) and tensor parallelism of degree 4; per-rank batch as in the 2-GPU runs.

The plans come from the same single-GPU snapshots as the world-size-2 checks in
``test_plan.py``: nothing here was fitted to these runs (they were recorded after the rules).
"""

from __future__ import annotations

import pytest

from snapshot_lab.metrics.plan import Strategy, plan_memory

from .conftest import sample_truth

WORLD = 4
MODELS = ("mlp", "transformer")
CASES = {
    "ddp_nobucketview": Strategy("ddp", WORLD),
    "ddp_bucketview": Strategy("ddp", WORLD, bucket_view=True),
    "tp": Strategy("tp", WORLD),
}
# The rule that misses: ``distribute_tensor`` scatters every column/row-sharded weight from the
# mesh's first rank, which allocates the shard list (eight 16 MiB chunks for the MLP) before the
# model trains; its segment stays cached on rank 0 alone, 16 MiB that the plan (every TP rank
# alike) does not have: rank 0's reserved peak is 742 MiB against 726 MiB on the other ranks.
RESERVED_MISSES = {("tp", "mlp", 0): 0.12}


@pytest.fixture(scope="module")
def plans(real_frames):
    cache: dict[tuple[str, str], object] = {}

    def get(case: str, model: str):
        if (case, model) not in cache:
            cache[(case, model)] = plan_memory(real_frames(f"single_{model}"), CASES[case])
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


@pytest.mark.parametrize("model", MODELS)
def test_world4_ranks_record_their_layout(model):
    """The sidecar's layout of every rank says world size 4, and the TP degree where it applies."""
    for case in CASES:
        for rank in range(WORLD):
            truth = sample_truth(f"{case}_ws4gloo_{model}_rank{rank}")
            assert truth["workload"]["world_size"] == WORLD
            assert truth["workload"]["rank"] == rank
            assert truth["workload"]["ranks_share_one_gpu_over_gloo"] is True
