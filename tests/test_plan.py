"""snaplab plan (issue #15): memory per GPU under DDP, FSDP/ZeRO, tensor and pipeline
parallelism, planned from one single-GPU snapshot, against the real 2-GPU recordings of the same
jobs (``sample_snapshots/workloads_parallel.py``: a config-built GPT decoder and an 8 x
Linear(2048) MLP, same per-rank batch, 3 AdamW steps, H200, torch 2.11).

The same rules predict both models; nothing is fitted to a recording. Simpler rules that these
recordings break (the first two are checked below, the others were measured while building it):

- tensor parallelism, "every activation divided by the degree": 26% too low for the MLP and
  18% for the GPT (the row-parallel outputs, norms, residual adds and logits are replicated);
- pipeline parallelism, "the stage's parameters, gradients and optimizer state plus its share of
  the recorded activations times the microbatches in flight": 1F1B's last stage of the MLP 23%
  too low (it keeps every microbatch's output until the step ends and has receive buffers);
- a block's backward taken to begin with the first backward allocation after the previous
  block's (its output counted as its own saved tensor): FSDP2 on the MLP came out 6.9% too high,
  the next unit gathered before the loss's backward had run; the loss consumes the last block's
  output and is the first to be differentiated;
- FSDP2's root taken as never resharding after forward (FSDP1's rule): the GPT 2.0% too high;
- FSDP1 taken to shard parameters one by one like FSDP2: the MLP's reserved memory 15% too low
  (FSDP1 flattens each unit first, and that shapes the cache for the rest of the run).
"""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from snapshot_lab import api, cli
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_BAD_INPUT, EXIT_USAGE
from snapshot_lab.metrics.allocator.model import recorded_settings
from snapshot_lab.metrics.categories import CODES
from snapshot_lab.metrics.plan import (
    PlanUnsupported,
    Strategy,
    plan_memory,
    plan_table,
    training_structure,
    would_it_fit,
)
from snapshot_lab.metrics.plan import data_parallel as dp
from snapshot_lab.metrics.plan import pipeline as pp
from snapshot_lab.metrics.plan import tensor_parallel as tpm
from snapshot_lab.metrics.plan.program import replay
from snapshot_lab.metrics.plan.rewrite import Rewrite

from .conftest import sample_path, sample_truth

MODELS = ("mlp", "transformer")
CASES = {
    "ddp_nobucketview": Strategy("ddp", 2),
    "ddp_bucketview": Strategy("ddp", 2, bucket_view=True),
    "fsdp2_reshard": Strategy("fsdp", 2),
    "fsdp2_noreshard": Strategy("fsdp", 2, reshard_after_forward=False),
    "fsdp1_fullshard": Strategy("fsdp1", 2),
    "fsdp1_shardgradop": Strategy("fsdp1", 2, reshard_after_forward=False),
    "tp": Strategy("tp", 2),
    "pp_gpipe": Strategy("pp", 2, microbatches=8, schedule="gpipe"),
    "pp_1f1b": Strategy("pp", 2, microbatches=8, schedule="1f1b"),
}
# torch 2.11 kept DDP's first-iteration bucket (every gradient, 265 MiB) alive until the third
# iteration's first all-reduce in this one run (the MLP and the bucket-view runs free it at the
# rebuild); the plan follows DDP's documented rebuild and is 7.9% low here
BEYOND_FIVE_PERCENT = {("ddp_nobucketview", "transformer")}
runner = CliRunner()


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


def _rank_plan(p, rank: int):
    return p.ranks[min(rank, len(p.ranks) - 1)]  # data/tensor parallel: every rank alike


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", list(CASES))
def test_prediction_against_the_real_run(plans, case, model, rank):
    """Planned from the single-GPU snapshot: allocated peak within 10% of the real run's
    ``allocated_bytes.all.peak`` (5% for all but one pair), reserved within 15%."""
    r = _rank_plan(plans(case, model), rank)
    alloc, reserved = _truth(f"{case}_{model}_rank{rank}")
    err_alloc = r.peak_allocated_bytes / alloc - 1
    err_reserved = r.peak_reserved_bytes / reserved - 1
    assert abs(err_alloc) <= 0.10, f"allocated {err_alloc:+.1%}"
    assert abs(err_reserved) <= 0.15, f"reserved {err_reserved:+.1%}"
    if (case, model) not in BEYOND_FIVE_PERCENT:
        assert abs(err_alloc) <= 0.05, f"allocated {err_alloc:+.1%}"


def test_the_recorded_run_replays_exactly(plans):
    for model in MODELS:
        p = plans("fsdp2_reshard", model)
        alloc, reserved = _truth(f"single_{model}")
        assert p.recorded.peak_allocated_bytes == alloc
        assert p.recorded.peak_reserved_bytes == reserved
        assert p.recorded_torch_peaks == {"allocated_bytes.all.peak": alloc, "reserved_bytes.all.peak": reserved}


# --------------------------------------------------------------------------- what the trace shows


@pytest.mark.parametrize("model", MODELS)
def test_blocks_and_their_parameters(real_frames, model):
    """The repeated blocks and which parameters belong to which: as FSDP2 wrapped them."""
    s = training_structure(real_frames(f"single_{model}"), 0)
    cfg = sample_truth(f"single_{model}")["workload"]["model_config"]
    assert s.n_blocks == cfg.get("n_layer", cfg.get("depth"))
    assert len(s.passes) == 3
    units = {u["module"]: u for u in sample_truth(f"fsdp2_reshard_{model}_rank0")["workload"]["fsdp_units"]}
    per_block = s.params[s.params["block"] >= 0].groupby("block")["size"].sum()
    for j, nbytes in per_block.items():
        assert nbytes == units[f"layers.{j}"]["full_bytes"]
    root = int(s.params.loc[s.params["block"] < 0, "size"].sum())
    assert root == units["<root>"]["full_bytes"]


@pytest.mark.parametrize("model", MODELS)
def test_the_allocation_table_is_small_a_row(real_frames, model):
    """The structure's table of allocations (1.6M rows at 5M entries, in fit's child) holds its
    phase and part as categories and its counters as int32: at most 100 bytes a row (135 with
    phase and part as strings and every column int64)."""
    s = training_structure(real_frames(f"single_{model}"), 0)
    allocs = s.allocs
    assert allocs.memory_usage(deep=True, index=False).sum() <= 100 * len(allocs)
    phases = allocs["phase"].to_numpy()
    assert {"setup", "forward", "backward"} <= set(phases.tolist()) <= {"setup", "data", "forward", "backward", "step"}
    assert set(allocs["part"].tolist()) >= {"pre", "block", "post"}
    assert (allocs["block"].to_numpy()[allocs["part"].to_numpy() == "block"] >= 0).all()
    assert allocs["param"].to_numpy().max() == len(s.params) - 1


@pytest.mark.parametrize("model", MODELS)
def test_tensor_parallel_layers(real_frames, model):
    """Column/row pairs found in the stacks: the sharded matrices are those the real run sharded
    (its column-parallel biases, a few KiB, aside)."""
    fr = real_frames(f"single_{model}")
    s = training_structure(fr, 0)
    tp = tpm.plan_tensor_parallel(fr, s, 2)
    truth = sample_truth(f"tp_{model}_rank0")["workload"]
    sharded = int(s.params["size"].to_numpy()[tp.param_scale < 1].sum())
    assert sharded == pytest.approx(truth["tp_sharded_full_bytes"], rel=0.01)
    # the GPT: q, k, v, fc1 | o, fc2 in each of 8 blocks; the MLP: layers 0, 2, 4, 6 | 1, 3, 5, 7
    assert (tp.column_layers, tp.row_layers) == ((32, 16) if model == "transformer" else (4, 4))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rank", [0, 1])
def test_pipeline_stages_hold_the_real_stages_parameters(real_frames, model, rank):
    s = training_structure(real_frames(f"single_{model}"), 0)
    assign = pp.assign_stages(s, 2, None)
    p_stage = assign.row_stage[s.params["row"].to_numpy()]
    mine = int(s.params["size"].to_numpy()[p_stage == rank].sum())
    truth = sample_truth(f"pp_1f1b_{model}_rank{rank}")["workload"]
    assert mine == truth["pp_stage_param_bytes"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stage", [0, 1])
def test_schedules_hold_the_microbatches_torch_holds(schedule, stage):
    ops = pp.schedule_ops(schedule, stage, 2, 8)
    in_flight = most = 0
    for op, _ in ops:
        in_flight += 1 if op == "F" else -1
        most = max(most, in_flight)
    assert sorted(i for o, i in ops if o == "F") == list(range(8)) == sorted(i for o, i in ops if o == "B")
    expect = sample_truth(f"pp_{schedule}_mlp_rank{stage}")["workload"]["expect"]["max_microbatches_in_flight"]
    assert most == expect


@pytest.mark.parametrize("model", MODELS)
def test_ddp_rebuilt_buckets_are_the_recorded_ones(real_frames, model):
    """The buckets DDP rebuilds at the second iteration: first closed at 1 MiB, then at 25 MiB,
    gradients in reverse parameter order."""
    s = training_structure(real_frames(f"single_{model}"), 0)
    planned = dp.ddp_buckets([int(x) for x in s.params["size"].to_numpy()[::-1]], 25 << 20)
    real = training_structure(real_frames(f"ddp_nobucketview_{model}_rank0"), 0).allocs
    recorded = real[(real["code_recorded"] == CODES["ddp_bucket"]) & (real["size"] > 1 << 20)]["size"].tolist()
    assert recorded[0] == sum(planned)  # the first iteration: one bucket of every gradient
    assert recorded[1:] == planned


# --------------------------------------------------------------------------- simpler rules


@pytest.mark.parametrize(("model", "at_least"), [("mlp", 0.20), ("transformer", 0.15)])
def test_uniform_tensor_parallel_rule_is_too_low(real_frames, model, at_least):
    """Every activation divided by the degree: far below the real run (the plan is within 2%)."""
    fr = real_frames(f"single_{model}")
    s = training_structure(fr, 0)
    tp = tpm.plan_tensor_parallel(fr, s, 2)
    rw = Rewrite.identity(s)
    a = s.allocs
    code = a["code"].to_numpy()
    act = np.flatnonzero((code == CODES["activation"]) & np.isin(a["phase"].to_numpy(), ["forward", "backward"]))
    rw.size[act] = np.ceil(rw.size[act] / 2).astype(np.int64)
    mirrors = np.flatnonzero(np.isin(code, [CODES["gradient"], CODES["optimizer_state"]]))
    rw.size[mirrors] = np.ceil(a["size"].to_numpy()[mirrors] * tp.row_scale[mirrors]).astype(np.int64)
    dp.shard_at_wrap(rw, np.ceil(s.params["size"].to_numpy() * tp.param_scale).astype(np.int64), "sharded")
    simple = replay(rw.build(), recorded_settings(fr.info.allocator_settings)).peak_allocated_bytes
    alloc, _ = _truth(f"tp_{model}_rank0")
    assert simple / alloc - 1 < -at_least


def test_pipeline_sum_rule_misses_the_last_stage(real_frames, plans):
    """P+G+O of the stage plus its share of the recorded activations times those in flight."""
    fr = real_frames("single_mlp")
    s = training_structure(fr, 0)
    rec = plans("pp_1f1b", "mlp").recorded.by_category
    model_states = (rec["parameter"] + rec["optimizer_state"]) / 2 + s.params["size"].sum() / 2  # + gradients
    activations = (rec["activation"] + rec["other"]) / 2
    simple = model_states + activations * 1 / 8  # the last stage of 2 holds one microbatch
    alloc, _ = _truth("pp_1f1b_mlp_rank1")
    assert simple / alloc - 1 < -0.15
    planned = plans("pp_1f1b", "mlp").ranks[1].peak_allocated_bytes
    assert abs(planned / alloc - 1) < 0.02


# --------------------------------------------------------------------------- what the output says


def test_every_number_says_where_it_came_from(plans):
    p = plans("fsdp2_reshard", "transformer")
    d = p.to_dict()
    json.dumps(d)
    s_events = p.events
    for r in d["ranks"]:
        parts = r["at_peak"]
        assert sum(x["planned_bytes"] for x in parts) == r["peak_allocated_bytes"]
        assert sum(r["at_peak_by_category"].values()) == r["peak_allocated_bytes"]
        for x in parts:
            assert x["what"] and x["category"]
            lo, hi = x["from_recorded_events"]
            assert 0 <= lo <= hi < s_events
            assert x["added_by_the_plan"] == (x["recorded_bytes"] == 0)
        assert r["peak_moment"].startswith("iteration")
    whats = {x["what"] for x in d["ranks"][0]["at_peak"]}
    assert "parameters, 1/2 shard per rank (FSDP2)" in whats
    assert d["assumptions"] and d["not_modelled"]
    assert d["structure"]["blocks"] == 8


@pytest.mark.parametrize("source", ["ddp_nobucketview", "ddp_bucketview"])
@pytest.mark.parametrize("model", MODELS)
def test_planned_from_one_rank_of_a_ddp_run(real_frames, source, model):
    """A DDP rank's snapshot is planned as the single-GPU run it stands for."""
    for case in ("fsdp2_reshard", "tp", "pp_1f1b"):
        p = plan_memory(real_frames(f"{source}_{model}_rank0"), CASES[case])
        alloc, reserved = _truth(f"{case}_{model}_rank0")
        assert abs(p.ranks[0].peak_allocated_bytes / alloc - 1) <= 0.05, case
        assert abs(p.ranks[0].peak_reserved_bytes / reserved - 1) <= 0.15, case


def test_table_of_the_usual_strategies(real_frames):
    t = plan_table(real_frames("single_transformer"), 4)
    labels = [p.strategy.label() for p in t.plans]
    assert labels[0] == "DDP over 4 GPUs"
    assert any(label.startswith("FSDP2 x tensor parallel: 2 x 2") for label in labels)
    assert any(label.startswith("pipeline, 4 stages, 16 microbatches") for label in labels)
    by = {p.strategy.label(): p.peak_allocated_bytes for p in t.plans}
    assert by["tensor parallel, degree 4"] < by["FSDP2, reshard after forward (ZeRO-3), over 4 GPUs"]
    assert by["FSDP2, reshard after forward (ZeRO-3), over 4 GPUs"] < by["DDP over 4 GPUs"]


def test_an_oom_snapshot_is_judged_against_the_limit_it_ran_out_of(real_frames):
    fr = real_frames("capture_oomx_oom_rank0")
    p = plan_memory(fr, Strategy("tp", 2))
    assert p.memory_limit_bytes == 3 << 30
    assert p.recorded.fits is False
    assert any("ran out of memory" in a for a in p.assumptions)
    tables = would_it_fit(fr, 0)
    assert [t.world_size for t in tables] == [2, 4]
    assert all(p.memory_limit_bytes == 3 << 30 for t in tables for p in t.plans)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("deep_forward_python", "no whole training iteration"),
        ("state_only", "no stacks"),
    ],
)
def test_what_is_missing_is_said(real_frames, name, why):
    with pytest.raises(PlanUnsupported, match=why):
        plan_memory(real_frames(name), Strategy("fsdp", 2))


def test_bad_strategies_are_refused():
    for st, msg in [
        (Strategy("megatron", 2), "unknown strategy"),
        (Strategy("tp", 4, tp=2), "needs tp=4"),
        (Strategy("fsdp+tp", 6, tp=4), "does not divide"),
        (Strategy("pp", 2, pp_split=(3, 3, 2)), "needs 2 block counts"),
        (Strategy("pp", 2, schedule="zb"), "unknown schedule"),
    ]:
        with pytest.raises(ValueError, match=msg):
            st.resolved()
    assert Strategy("zero2", 8).resolved().reshard_after_forward is False
    assert Strategy("pp", 4).resolved().microbatches == 16


# --------------------------------------------------------------------------- command line


def _invoke(*args: str):
    return runner.invoke(app, ["plan", *args])


def test_cli_json_is_the_api(tmp_path):
    path = str(sample_path("single_mlp"))
    r = _invoke(path, "--strategy", "fsdp", "--world-size", "2", "--json", "-q")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    again = api.plan(path, strategy="fsdp", world_size=2)
    assert out["peak_allocated_bytes"] == again.peak_allocated_bytes
    assert out["strategy"]["label"] == "FSDP2, reshard after forward (ZeRO-3), over 2 GPUs"
    assert out["fits"] is True and math.isclose(out["memory_limit_bytes"], 150109880320)


def test_cli_text_and_html(tmp_path):
    out = tmp_path / "plan.html"
    r = _invoke(str(sample_path("single_transformer")), "--strategy", "pp", "--world-size", "2", "-o", str(out), "-q")
    assert r.exit_code == 0, r.output
    assert "stage 0 (rank 0: blocks 0–3 + the layers before the blocks)" in r.stdout
    assert "what, and where in the recorded run it came from" in r.stdout and "Not modelled:" in r.stdout
    html = out.read_text()
    assert "<h1>pipeline, 2 stages, 8 microbatches, 1F1B</h1>" in html
    assert "http://" not in html and "https://" not in html and "<script" not in html
    assert "Content-Security-Policy" in html


def test_cli_table():
    r = _invoke(str(sample_path("single_mlp")), "--world-size", "2", "-q")
    assert r.exit_code == 0, r.output
    assert "ZeRO-1 (optimizer state sharded) over 2 GPUs" in r.stdout
    assert "pipeline, 2 stages, 8 microbatches, 1F1B" in r.stdout


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--strategy", "nope", "--world-size", "2"], EXIT_USAGE, "unknown strategy"),
        (["--strategy", "pp", "--world-size", "2", "--pp-split", "4,x"], EXIT_USAGE, "--pp-split"),
        (["--strategy", "fsdp", "--world-size", "2", "--memory-limit", "lots"], EXIT_USAGE, "--memory-limit"),
        (["--strategy", "fsdp"], EXIT_USAGE, "world-size"),
    ],
)
def test_cli_usage_errors(args, code, message):
    r = _invoke(str(sample_path("single_mlp")), *args, "-q")
    assert r.exit_code == code
    assert message in r.output


def test_cli_says_what_is_missing(tmp_path):
    r = _invoke(str(sample_path("deep_forward_python")), "--strategy", "fsdp", "--world-size", "2", "-q")
    assert r.exit_code == EXIT_BAD_INPUT
    assert "cannot plan from this snapshot: no whole training iteration" in r.output
    assert "Traceback" not in r.output
    r = _invoke(str(tmp_path / "missing.pickle"), "--world-size", "2", "-q")
    assert r.exit_code == EXIT_BAD_INPUT


def test_cli_and_api_share_names_and_defaults():
    def params(fn):
        return {n: p.default for n, p in inspect.signature(fn).parameters.items()}

    c = {k: v for k, v in params(cli.plan).items() if k not in {"json_out", "quiet", "debug"}}
    a = {k: v for k, v in params(api.plan).items() if k != "progress"}
    assert set(c) == set(a)
    for k, v in a.items():
        if v is not inspect.Parameter.empty:
            assert c[k] == v, k


def test_report_answers_would_it_fit_after_an_oom(tmp_path):
    out = tmp_path / "r.html"
    api.report(sample_path("capture_oomx_oom_rank0"), output=out)
    html = out.read_text()
    assert "Would it fit on more GPUs?" in html
    assert "tensor parallel, degree 4" in html
    api.report(sample_path("single_mlp"), output=out)
    assert "Would it fit on more GPUs?" not in out.read_text()
