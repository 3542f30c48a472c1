"""snaplab fit's answer under --memory-limit also lists the allocator settings and the parallel
strategies (planned by snaplab plan at the recorded batch) that would make the job fit, least
change to the job first (issue #20)."""

from __future__ import annotations

import json

import pytest

from snapshot_lab import api
from snapshot_lab.metrics.fit import compute_fit
from snapshot_lab.metrics.fit.strategies import CHANGE_ORDER
from snapshot_lab.render.fit import format_fit

from .conftest import SAMPLES, sample_path

CAP = json.loads((SAMPLES / "fit_truth.json").read_text())["cap_bytes"]


@pytest.fixture(scope="module")
def gpt2(real_frames):
    return compute_fit(real_frames("fit_gpt2_b4_complete_python"), memory_limit=CAP, recorded_batch=4)


def test_the_strategies_are_planned_and_ranked_by_how_little_they_change_the_job(gpt2):
    planned = gpt2.parallel_strategies
    assert {p.strategy for p in planned} == set(CHANGE_ORDER)
    assert {p.world_size for p in planned} == {2, 4, 8}
    ranks = [(CHANGE_ORDER.index(p.strategy), p.world_size) for p in planned]
    assert ranks == sorted(ranks)
    by = {(p.strategy, p.world_size): p for p in planned}
    # the recorded step reserves 6.08 GiB: sharding the optimizer state over 2 GPUs is not enough
    # (plan: 6.04 GiB), over 4 it is; sharding the gradients too (ZeRO-2) fits on 2
    assert by[("zero1", 2)].fits is False and by[("zero1", 2)].peak_reserved_bytes > CAP
    assert by[("zero1", 4)].fits is True
    assert by[("zero2", 2)].fits is True
    # more sharding, less memory per GPU
    assert by[("zero3", 2)].peak_allocated_bytes < by[("zero2", 2)].peak_allocated_bytes
    assert by[("zero2", 2)].peak_allocated_bytes < by[("zero1", 2)].peak_allocated_bytes


def test_ways_to_fit_list_the_fewest_gpus_per_strategy_after_the_levers(gpt2):
    ways = gpt2.ways_to_fit
    kinds = [w["kind"] for w in ways]
    order = ["allocator settings", "lever", "parallel strategy"]
    assert kinds == sorted(kinds, key=order.index)
    parallel = [w["label"] for w in ways if w["kind"] == "parallel strategy"]
    assert parallel[0] == "ZeRO-1 (optimizer state sharded) over 4 GPUs"
    assert "FSDP2, no reshard after forward (ZeRO-2), over 2 GPUs" in parallel
    # expandable segments make the recorded batch fit (5.85 GiB reserved, as whatif replays it; a
    # fresh process ran batch 4 with them under the cap: tests/test_fit_moe.py), no other setting
    settings = [w["label"] for w in ways if w["kind"] == "allocator settings"]
    assert settings == ["expandable_segments:True", "expandable_segments:True,roundup_power2_divisions:4"]
    assert {"checkpointing", "bf16"} <= {w["label"] for w in ways if w["kind"] == "lever"}


def test_the_text_shows_the_strategies_and_what_makes_it_fit(gpt2):
    text = format_fit(gpt2, "fit_gpt2_b4_complete_python.pickle.xz")
    assert "Parallel strategies (snaplab plan" in text
    assert "ZeRO-1 (optimizer state sharded) over 2 GPUs" in text
    assert "more GPUs (the fewest that fit): ZeRO-1 (optimizer state sharded) over 4 GPUs" in text


def test_an_oom_in_the_first_forward_says_why_plan_cannot_help(real_frames):
    r = compute_fit(real_frames("fit_gpt2_b32_oom_python"), memory_limit=CAP, recorded_batch=32)
    assert r.parallel_strategies == ()
    assert "ends in the first forward" in r.parallel_refused["all"]
    assert "Parallel strategies: not planned: plan replays a recorded whole iteration" in format_fit(r)


def test_strategies_only_when_a_memory_limit_is_given(real_frames):
    """The report's fit summary (no limit given) does not pay for the plans."""
    r = compute_fit(real_frames("fit_resnet50_b16_complete_python"), recorded_batch=16)
    assert r.parallel_strategies == () and r.parallel_refused == {}


def test_the_json_keeps_its_top_level_answer():
    out = json.loads(
        json.dumps(
            api.fit(str(sample_path("fit_gpt2_b4_complete_python")), memory_limit="6GiB", recorded_batch=4).to_dict()
        )
    )
    assert out["largest_batch"]["as recorded"] == 3
    assert out["peak_allocated_bytes"] > 0 and out["peak_reserved_bytes"] >= out["peak_allocated_bytes"]
    assert out["parallel_strategies"][0]["label"] == "ZeRO-1 (optimizer state sharded) over 2 GPUs"
    assert out["parallel_strategies_refused"] == {}
    assert out["ways_to_fit"][-1]["kind"] == "parallel strategy"


def test_zero1_is_not_proposed_where_the_trace_has_no_optimizer_state(real_frames, gpt2):
    """ZeRO-1 shards the optimizer state only. A forward and backward without an optimizer step
    (``bench_fwdbwd_python``, a benchmark loop) has none: ZeRO-1 there would be planned as the
    job unchanged and listed as a way to fit, so it is refused with the reason; ZeRO-2 (the
    gradients too) is still planned. A training step (GPT-2's) keeps it: the simpler rule (always
    propose it) is what the benchmark breaks."""
    r = compute_fit(real_frames("bench_fwdbwd_python"), memory_limit=1 << 30)
    assert r.workload == "forward and backward"
    assert "zero1" not in {p.strategy for p in r.parallel_strategies}
    assert {p.strategy for p in r.parallel_strategies} >= {"zero2", "zero3"}
    reasons = {label: why for label, why in r.parallel_refused.items() if label.startswith("ZeRO-1")}
    assert list(reasons) == ["ZeRO-1 (optimizer state sharded), over any number of GPUs"]
    assert next(iter(reasons.values())).startswith("not applicable: the trace has no optimizer step")
    assert "zero1" in {p.strategy for p in gpt2.parallel_strategies}


@pytest.mark.parametrize(
    "name, limit, recorded_batch",
    [("deep_inference_python", 2 << 30, None), ("fit_resnet50_b16_complete_python", CAP, 16)],
)
def test_nothing_is_listed_to_change_where_the_job_fits_as_recorded(real_frames, name, limit, recorded_batch):
    """Forward passes at 526 MiB under 2 GiB, and ResNet-50's step at batch 16 under 6 GiB (its
    largest is 69), fit as recorded: every allocator setting and lever fits too, and listing them
    as "what makes it fit" told the user to change a job that needs no change. GPT-2's step, which
    does not fit (above), keeps its list."""
    r = compute_fit(real_frames(name), memory_limit=limit, recorded_batch=recorded_batch)
    assert r.levers[0].lever == "as recorded" and r.levers[0].fits is True
    assert [o.lever for o in r.levers if o.fits][1:]  # the other levers fit as well
    assert r.ways_to_fit == []
    assert "What makes it fit" not in format_fit(r)
