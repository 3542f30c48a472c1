"""Parallel training understood (issue #14): FSDP2, FSDP1, tensor and pipeline parallelism, on
real 2-GPU recordings (sample_snapshots/workloads_parallel.py) of a config-built GPT decoder and
an 8 x Linear(2048) MLP, each rank one file with its truth.

Which rules they break: the generic rules called FSDP's sharded parameters "other" (their stacks
hold FSDP's frames, not a module's constructor) and FSDP2's sharded gradients "activation" (a
reduce-scatter output is one flat buffer per unit, the size of no parameter); parameter sizes
taken from every parameter ever allocated made FSDP1 call 107 MiB of stale, unsharded-size
backward buffers gradients; a pipeline stage's last microbatches' logits, kept to merge the
step's outputs, looked like in-flight activations until "freed by the backward" was required.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from snapshot_lab.metrics import compute_stats
from snapshot_lab.metrics.categories import compute_categories
from snapshot_lab.metrics.history.timeline import compute_timeline

from .conftest import sample_truth

MODELS = ("transformer", "mlp")
FSDP = [
    f"fsdp{v}_{s}_{m}_rank{r}"
    for v, s in (("2", "reshard"), ("2", "noreshard"), ("1", "fullshard"), ("1", "shardgradop"))
    for m in MODELS
    for r in (0, 1)
]


def _cats(real_frames, name):
    fr = real_frames(name)
    return compute_categories(fr, fr.info.devices[0], with_timeline=False).live_requested_bytes


def _at_peak(real_frames, name):
    fr = real_frames(name)
    dev = fr.info.devices[0]
    st = compute_stats(fr).devices[dev].torch_stats
    tl = compute_timeline(fr.events, dev, st["requested_bytes.all.current"], st["reserved_bytes.all.current"])
    cats = compute_categories(fr, dev).timeline
    return cats.iloc[int(np.argmax(tl.requested_bytes))]


@pytest.mark.parametrize("name", FSDP)
def test_fsdp_shards(real_frames, name):
    """Each rank's sharded parameters are P / world size (1%), so are its sharded gradients,
    and its Adam state twice that."""
    w = sample_truth(name)["workload"]
    cats = _cats(real_frames, name)
    assert w["param_bytes_local"] == w["param_bytes_total"] // w["world_size"]
    assert cats["parameter"] == pytest.approx(w["param_bytes_local"], rel=0.01)
    assert cats["gradient"] == pytest.approx(w["grad_bytes_local"], rel=0.01)
    assert cats["optimizer_state"] == pytest.approx(w["optimizer_state_bytes"], rel=0.01)


def _unit_sums(units):
    sizes = [u["allgather_output_bytes"] for u in units if u.get("allgather_output_bytes")]
    return {sum(c) for k in range(len(sizes) + 1) for c in itertools.combinations(sizes, k)}


@pytest.mark.parametrize("name", [n for n in FSDP if "transformer" in n])
def test_unsharded_parameters_at_the_peak_are_whole_units(real_frames, name):
    """At the peak, the unsharded parameters alive are exactly the all-gather outputs of the
    units gathered at that moment: all of them when nothing reshards after forward."""
    w = sample_truth(name)["workload"]
    unsharded = int(_at_peak(real_frames, name)["fsdp_unsharded_params"])
    assert unsharded in _unit_sums(w["fsdp_units"])
    everything = sum(u.get("allgather_output_bytes") or 0 for u in w["fsdp_units"])
    keeps = w.get("reshard_after_forward") is False or w.get("sharding_strategy") == "SHARD_GRAD_OP"
    assert (unsharded == everything) == keeps


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_and_replicas(real_frames, model, rank):
    """A rank's parameters: its shards of the Colwise/Rowwise layers plus the replicated rest."""
    w = sample_truth(f"tp_{model}_rank{rank}")["workload"]
    cats = _cats(real_frames, f"tp_{model}_rank{rank}")
    assert cats["parameter"] == pytest.approx(w["tp_sharded_local_bytes"] + w["tp_replicated_bytes"], rel=0.01)
    assert cats["gradient"] == pytest.approx(w["grad_bytes_local"], rel=0.01)


@pytest.mark.parametrize("model", MODELS)
def test_pipeline_inflight_activations_follow_the_schedule(real_frames, model):
    """GPipe keeps every microbatch's activations until the backwards start; 1F1B keeps at
    most (stages - stage) on each stage, so its first stage keeps more than its last."""
    gpipe = [int(_at_peak(real_frames, f"pp_gpipe_{model}_rank{r}")["inflight_activation"]) for r in (0, 1)]
    onef = [int(_at_peak(real_frames, f"pp_1f1b_{model}_rank{r}")["inflight_activation"]) for r in (0, 1)]
    micro = sample_truth(f"pp_1f1b_{model}_rank0")["workload"]["microbatches"]
    assert micro >= 8
    assert onef[0] > onef[1] > 0
    assert onef[0] == pytest.approx(2 * onef[1], rel=0.15)  # 2 microbatches in flight vs 1
    for stage in (0, 1):
        assert gpipe[stage] > 3 * onef[stage]  # nearly all microbatches vs at most two


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rank", [0, 1])
def test_pipeline_stage_params(real_frames, model, rank):
    w = sample_truth(f"pp_1f1b_{model}_rank{rank}")["workload"]
    cats = _cats(real_frames, f"pp_1f1b_{model}_rank{rank}")
    assert cats["parameter"] == pytest.approx(w["pp_stage_param_bytes"], rel=0.01)
    assert cats["inflight_activation"] == 0  # nothing in flight after the step


def test_every_category_has_words_and_a_colour():
    from snapshot_lab.metrics.categories import CATEGORIES
    from snapshot_lab.plots.categories import CATEGORY_COLORS
    from snapshot_lab.report import CATEGORY_HELP

    assert set(CATEGORY_HELP) == set(CATEGORIES) == set(CATEGORY_COLORS)


@pytest.mark.parametrize("name", ["pp_gpipe_transformer_rank1", "fsdp2_noreshard_transformer_rank0", "tp_mlp_rank0"])
def test_reports_of_parallel_runs(tmp_path, name):
    from snapshot_lab import api

    from .conftest import sample_path

    html = api.report(sample_path(name), output=tmp_path / "r.html").read_text()
    assert "What the memory is" in html


def _findings(real_frames, name):
    from snapshot_lab.metrics.diagnose import diagnose

    fr = real_frames(name)
    return {f.id: f for f in diagnose(fr, compute_stats(fr), False).findings}


@pytest.mark.parametrize("name", FSDP)
def test_fsdp_unsharded_kept_fires_for_the_setting_only(real_frames, name):
    """FSDP2 reshard_after_forward=False and FSDP1 SHARD_GRAD_OP keep the unsharded parameters
    from forward into backward; reshard_after_forward=True and FULL_SHARD do not (FULL_SHARD still
    keeps its root and last units: the finding must not take that for the setting)."""
    w = sample_truth(name)["workload"]
    keeps = w.get("reshard_after_forward") is False or w.get("sharding_strategy") == "SHARD_GRAD_OP"
    f = _findings(real_frames, name).get("fsdp-unsharded-kept")
    assert (f is not None) == keeps
    if f is not None:
        full = sum(u.get("allgather_output_bytes") or 0 for u in w["fsdp_units"])
        assert f.evidence["kept_bytes_at_peak"] == full  # the whole model, unsharded, at the peak
        assert f.savings_bytes == full
        # what the setting really cost: the same job's peak with resharding is lower by about that
        other = name.replace("noreshard", "reshard").replace("shardgradop", "fullshard")
        real = w["peak_allocated_bytes"] - sample_truth(other)["workload"]["peak_allocated_bytes"]
        assert f.savings_bytes == pytest.approx(real, rel=0.35)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rank", [0, 1])
def test_tp_replicated_params(real_frames, model, rank):
    """The transformer replicates its embeddings, norms and head on each TP rank (31% of its
    parameters): named, with the bytes; the MLP replicates only its row-parallel biases: silent."""
    name = f"tp_{model}_rank{rank}"
    w = sample_truth(name)["workload"]
    f = _findings(real_frames, name).get("tp-replicated-params")
    assert (f is not None) == (model == "transformer")
    if f is not None:
        assert f.evidence["replicated_parameter_bytes"] == pytest.approx(w["tp_replicated_bytes"], rel=0.01)
        assert f.evidence["tp_degree"] == 2


def test_parallel_findings_nowhere_else(real_frames):
    from .conftest import sample_names

    for name in sample_names():
        if name.startswith(("fsdp", "tp_")):
            continue
        ids = set(_findings(real_frames, name))
        assert not ids & {"fsdp-unsharded-kept", "tp-replicated-params"}, name
