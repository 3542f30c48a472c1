"""Issue #37: what strangers attach, reproduced on our own H200 (``sample_snapshots/workloads_strangers.py``).

Each recording's truth lists the tensors the program held (``observations``) or the bytes it
knows (parameter buffers, pools); :mod:`tests.truth` replays the raw trace by itself. The rules
these files check, and where each was written:

- the last backward's gradients when parameters and optimizer state are older than the trace
  (their sizes come from the older copies): written on ``warm_torch_none_*``;
- the copies older than the trace split by the parameter counts one backward's gradients give,
  the rest (BatchNorm's running statistics) ``unknown``: written on ``vgg_prebwd_late_*``;
- a hand-written ``Optimizer`` subclass's own ``step`` is the optimizer's code: written on the
  public corpus' rules half (CS336 files); the decorator pass-through was found on
  ``warm_hand_none_step0_*``, recorded after the rule;
- private pools told apart by pool id and capture stacks: ``pool_*``;
- a state-only file's repeated sizes are weights: ``state_llama_fp16``;
- Megatron-Core's buffers and DistributedOptimizer: ``megatron_distopt_bf16_python``.

Hold-outs recorded before the rules and not read while writing them: ``warm_hand_*`` and
``warm_torch_keep_*`` (the gradient-size rule), ``warm_hand_none_bf16_python_afterfwd``.
"""

from __future__ import annotations

import pytest

from snapshot_lab.metrics import compute_stats
from snapshot_lab.metrics.categories import compute_categories
from snapshot_lab.metrics.categories.pools import pool_owners
from snapshot_lab.metrics.diagnose import diagnose
from snapshot_lab.metrics.leaks import STATE_SOURCE, find_leaks

from .conftest import SAMPLES, sample_path, sample_truth
from .truth import truth_categories

MiB = 2**20
STATE = ("parameter", "gradient", "optimizer_state")
WARM = [
    "warm_hand_none_python_afterstep",
    "warm_hand_none_all_afterstep",
    "warm_torch_keep_python_afterfwd",
    "warm_hand_none_bf16_python_afterfwd",
    "warm_hand_none_step0_python_afterstep",
    "warm_hand_none_step0_all_afterfwd",
    "vgg_prebwd_late_python",
    "vgg_prebwd_late_all",
]


def _live(real_frames, name):
    return compute_categories(real_frames(name), 0, with_timeline=False)


@pytest.mark.parametrize("name", WARM)
def test_model_state_older_than_the_trace_equals_what_the_job_held(real_frames, name):
    """Parameters, gradients and optimizer state at the dump, to the byte, against the tensors the
    program held; everything else together likewise."""
    truth = truth_categories(sample_path(name), SAMPLES / f"{name}.truth.json").at_dump
    mine = _live(real_frames, name).live_requested_bytes
    for key in STATE:
        assert mine[key] == truth.get(key, 0), f"{name}: {key}"
    rest = sum(v for k, v in mine.items() if k not in STATE)
    assert rest == sum(v for k, v in truth.items() if k not in STATE)
    assert mine["parameter"] > 0 and mine["optimizer_state"] == 2 * mine["parameter"]


def test_the_last_backwards_gradients_are_gradients_when_the_parameters_are_older(real_frames):
    by_rule = _live(real_frames, "warm_hand_none_all_afterstep").live_requested_by_rule
    assert set(by_rule["gradient"]) == {"gradient_lifetime"}
    assert set(by_rule["parameter"]) == {"pre_trace_copies"}


def test_a_batchnorms_running_statistics_are_no_copy_of_a_parameter(real_frames):
    """VGG-16-BN between its loss and backward: parameters P and Adam's moments 2P, no gradient;
    the running statistics share the BatchNorm weights' sizes and stay unknown."""
    cats = _live(real_frames, "vgg_prebwd_late_python")
    param = sample_truth("vgg_prebwd_late_python")["workload"]["param_bytes"]
    assert cats.live_requested_bytes["parameter"] == param
    assert cats.live_requested_bytes["optimizer_state"] == 2 * param
    assert cats.live_requested_bytes["gradient"] == 0
    assert "pre_trace_extra_copy" in cats.live_requested_by_rule["unknown"]


def test_a_hand_written_optimizers_state_is_named_by_its_own_stack(real_frames):
    for name in ("warm_hand_none_step0_python_afterstep", "warm_hand_none_step0_all_afterfwd"):
        assert _live(real_frames, name).live_requested_by_rule["optimizer_state"] == {
            "stack": sample_truth(name)["workload"]["optimizer_state_bytes"]
        }


@pytest.mark.parametrize("stacks", ["python", "all"])
def test_a_graphs_pool_and_a_mempool_are_told_apart(real_frames, stacks):
    name = f"pool_graph_mempool_{stacks}"
    fr = real_frames(name)
    work = sample_truth(name)["workload"]
    owners = pool_owners(fr).set_index(["pool_id_0", "pool_id_1"])
    assert owners.loc[tuple(work["graph_pool_id"]), "rule"] == "graph_pool_id"
    assert owners.loc[tuple(work["mempool_id"]), "owner"] == "unknown"
    cats = compute_categories(fr, 0, with_timeline=False).live_requested_bytes
    assert cats["private_pool"] == work["mempool_bytes"] == 512 * MiB
    graph = fr.blocks[fr.blocks["is_private_pool"] & (fr.blocks["state"] == "active_allocated")]
    graph_requested = int(graph["requested_size_bytes"].sum()) - work["mempool_bytes"]
    assert cats["cuda_graph_pool"] == graph_requested > 0
    ids = {f.id for f in diagnose(fr, compute_stats(fr), False).findings}
    assert {"cuda-graph-pool", "private-pool"} <= ids


def test_weights_in_a_mempool_stay_parameters(real_frames):
    name = "pool_mempool_weights_python"
    fr = real_frames(name)
    cats = compute_categories(fr, 0, with_timeline=False).live_requested_bytes
    assert cats["parameter"] == sample_truth(name)["workload"]["param_bytes"]
    assert cats["cuda_graph_pool"] == 0
    ids = {f.id for f in diagnose(fr, compute_stats(fr), False).findings}
    assert "private-pool" in ids and "cuda-graph-pool" not in ids


def test_a_state_only_files_repeated_sizes_are_weights(real_frames):
    cats = _live(real_frames, "state_llama_fp16")
    work = sample_truth("state_llama_fp16")["workload"]
    # the rotary embedding's two buffers (64 bytes each) repeat a size too: sizes cannot tell a
    # buffer from a weight, so the model's state is what the rule labels
    model_state = work["param_bytes"] + work["buffer_bytes"]
    assert cats.live_requested_bytes["parameter"] == model_state
    assert cats.live_requested_by_rule["parameter"] == {"state_only_weights": model_state}
    assert sum(cats.live_requested_bytes.values()) == model_state


def test_a_forward_hook_that_keeps_every_output_is_named_without_a_trace(real_frames):
    work = sample_truth("state_hook_leak_python")["workload"]
    la = find_leaks(real_frames("state_hook_leak_python"), 0)
    assert la.iteration_source == STATE_SOURCE
    (suspect,) = la.suspects
    assert suspect.count == work["leaked_storages"] == 300
    assert suspect.bytes == work["leaked_bytes"]


def test_megatron_buffers_and_distributed_optimizer(real_frames):
    """The bf16 parameter buffer, the fp32 gradient buffer, and fp32 main parameters with Adam's
    two moments, as the job's own objects hold them."""
    work = sample_truth("megatron_distopt_bf16_python")["workload"]
    cats = _live(real_frames, "megatron_distopt_bf16_python").live_requested_bytes
    assert cats["parameter"] == work["parameter_bytes"]
    assert cats["gradient"] == work["gradient_bytes"] == 2 * work["parameter_bytes"]
    assert work["optimizer_state_bytes"] == 3 * work["gradient_bytes"]
    # and the optimizer's own unity loss scale (``_scale_one``, 4 bytes: no grad scaler under bf16)
    assert cats["optimizer_state"] == work["optimizer_state_bytes"] + 4
