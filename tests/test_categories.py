"""Memory categories against what the workloads are known to hold (issue #12, section 1).

Each workload was recorded twice, with torch's default stacks (``stacks='all'``, C++ frames) and
with ``stacks='python'``; dumped after ``opt.step()`` and before ``zero_grad()``, so it holds
parameters P, gradients P and Adam/AdamW state 2P (the truth files have the bytes torch itself
counted). Categories are compared by requested bytes (what the tensors asked for: the truth's
own unit); allocated bytes also include the allocator's rounding.

Which real runs break simpler rules (see snapshot_lab/metrics/categories/gradients.py):
- "AccumulateGrad on the stack = gradient": no such frame on the first backward, which steals the
  op's output (every ``*_all`` run, e.g. ``grad_plain_all``: gradient was 0);
- "stackless and parameter-sized = gradient": in runs recorded after the model was built the
  parameters are stackless (``late_*``: parameter was 0);
- "survives backward = gradient": the autograd thread's cuBLAS workspace survives too
  (``grad_plain_python``: 32 MiB, never freed).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from snapshot_lab.cli import app
from snapshot_lab.metrics import compute_stats
from snapshot_lab.metrics.categories import CATEGORIES, compute_categories

from .conftest import sample_path, sample_truth

runner = CliRunner()
MODES = ("python", "all")
GRAD_RUNS = [f"grad_{k}_{m}" for k in ("plain", "amp", "accum", "ckpt", "compile") for m in MODES]


def _requested(real_frames, name):
    fr = real_frames(name)
    return compute_categories(fr, fr.info.devices[0], with_timeline=False).live_requested_bytes


@pytest.mark.parametrize("name", [*GRAD_RUNS, "grad_anomaly_python"])
def test_parameters_gradients_and_adam_state(real_frames, name):
    """Plain loop, AMP + GradScaler, 4 micro-steps of accumulation, non-reentrant checkpointing,
    torch.compile, anomaly mode: P, P and 2P in both stack modes (within 1%)."""
    w = sample_truth(name)["workload"]
    cats = _requested(real_frames, name)
    assert cats["parameter"] == pytest.approx(w["param_bytes"], rel=0.01)
    assert cats["gradient"] == pytest.approx(w["grad_bytes"], rel=0.01) and w["grad_bytes"] == w["param_bytes"]
    assert cats["optimizer_state"] == pytest.approx(w["optimizer_state_bytes"], rel=0.01)
    assert w["optimizer_state_bytes"] == 2 * w["param_bytes"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_over_gloo_on_one_gpu(real_frames, mode, rank):
    """Two ranks sharing one GPU over gloo (the "DDP takes twice the memory" setup). Without
    gradient_as_bucket_view the gradients are P beside P of buckets; with it they live in the
    buckets, which are then the only copy."""
    P = sample_truth(f"gloo_nobucketview_{mode}_rank{rank}")["workload"]["param_bytes"]
    no_view = _requested(real_frames, f"gloo_nobucketview_{mode}_rank{rank}")
    view = _requested(real_frames, f"gloo_bucketview_{mode}_rank{rank}")
    assert no_view["gradient"] == pytest.approx(P, rel=0.01) and no_view["ddp_bucket"] == pytest.approx(P, rel=0.01)
    assert view["gradient"] == 0 and view["ddp_bucket"] == pytest.approx(P, rel=0.01)
    for cats in (no_view, view):
        assert cats["parameter"] == pytest.approx(P, rel=0.01)
        assert cats["optimizer_state"] == pytest.approx(2 * P, rel=0.01)


@pytest.mark.parametrize("name", [f"late_{a}_{m}" for a in ("gpt2", "llama") for m in MODES])
def test_recording_started_after_the_model_was_built(real_frames, name):
    """GPT-2 with Adam and Llama with AdamW, recording started after model and optimizer were
    built: parameters (stackless, older than the trace) and gradients each equal half of the
    optimizer state (within 5%), in both stack modes."""
    cats = _requested(real_frames, name)
    half = cats["optimizer_state"] / 2
    assert cats["parameter"] == pytest.approx(half, rel=0.05)
    assert cats["gradient"] == pytest.approx(half, rel=0.05)
    w = sample_truth(name)["workload"]
    assert cats["parameter"] == pytest.approx(w["param_bytes"], rel=0.01)


@pytest.mark.parametrize("name", ["grad_plain_all", "late_gpt2_python", "gloo_bucketview_all_rank0"])
def test_categories_add_up_to_allocated_bytes(real_frames, name):
    fr = real_frames(name)
    cats = compute_categories(fr, 0, with_timeline=False)
    truth = sample_truth(name)["memory_stats"]["0"]
    assert sum(cats.live_bytes.values()) == truth["allocated_bytes.all.current"]
    assert set(cats.live_bytes) == set(CATEGORIES)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_timeline_rises_in_backward_and_stays(real_frames, mode):
    """Over the trace, the gradient category holds P from each backward until zero_grad: at the
    dump (after the third step) it is P, and it was 0 between zero_grad and backward."""
    fr = real_frames(f"grad_plain_{mode}")
    tl = compute_categories(fr, 0).timeline
    P = sample_truth(f"grad_plain_{mode}")["workload"]["param_bytes"]
    assert int(tl["gradient"].iloc[-1]) == P
    assert int(tl["gradient"].max()) == P
    assert (tl["gradient"] == 0).sum() > len(tl) / 4


def test_stats_json_categories_both_ways():
    out = json.loads(runner.invoke(app, ["stats", "--json", str(sample_path("gloo_nobucketview_all_rank0"))]).stdout)
    P = sample_truth("gloo_nobucketview_all_rank0")["workload"]["param_bytes"]
    assert out["categories_requested"]["gradient"] == P
    assert out["categories"]["gradient"] == P  # 16 MiB blocks: no rounding
    assert sum(out["categories"].values()) == out["torch_stats"]["allocated_bytes.all.current"]


def test_ddp_finding_on_every_rank_file_without_bucket_view(real_frames):
    """Fires on every gradient_as_bucket_view=False rank file of both stack modes, with savings
    of the parameter bytes (within 15%), and never with bucket views."""
    from snapshot_lab.metrics.diagnose import diagnose

    for mode in MODES:
        for rank in (0, 1):
            for view, expect in (("nobucketview", True), ("bucketview", False)):
                name = f"gloo_{view}_{mode}_rank{rank}"
                fr = real_frames(name)
                found = [
                    f for f in diagnose(fr, compute_stats(fr), False).findings if f.id == "ddp-bucket-duplicate-grads"
                ]
                assert bool(found) == expect, name
                if found:
                    P = sample_truth(name)["workload"]["param_bytes"]
                    assert found[0].savings_bytes == pytest.approx(P, rel=0.15)


@pytest.mark.parametrize("name", ["lightning_fit_step3", "lightning_fit_end"])
def test_lightning_closure_is_not_optimizer_state(real_frames, name):
    """Hold-out for the innermost-decisive-frame rule: Lightning's automatic optimization runs
    training_step inside optimizer.step(closure). With "any torch.optim frame wins" the forward's
    activations were optimizer state (61.55 MiB of state for 14.28 MiB of parameters, and the
    module view called 128 MiB of the peak optimizer state); AdamW holds 2P, gradients P."""
    cats = _requested(real_frames, name)
    P = cats["parameter"]
    assert pytest.approx(14.28 * 2**20, rel=0.01) == P
    assert cats["optimizer_state"] == pytest.approx(2 * P, rel=0.01)
    assert cats["gradient"] == pytest.approx(P, rel=0.01)
    from snapshot_lab.metrics.attribution.modules import module_breakdown

    rows = module_breakdown(real_frames(name), 0).rows
    assert sum(r.by_category.get("optimizer_state", 0) for r in rows) == 0
    assert sum(r.by_category.get("activation", 0) for r in rows) > 100 * 2**20


# ---------------------------------------------------------------- hold-outs of issue #19's rules
# Each rule was written on the recordings of tests/test_categories_truth.py; here it meets older
# recordings it was not written on.


def _by_rule(real_frames, name):
    fr = real_frames(name)
    return compute_categories(fr, fr.info.devices[0], with_timeline=False).live_requested_by_rule


def test_copies_of_each_size_split_by_role_hold_out(real_frames):
    """bulk_release_python: recording started after a first step, dumped after zero_grad: every
    parameter size has 3 stackless copies older than the trace, AdamW's parameter and two states
    (the truth: P, 2P, no gradient). The trace's backward made gradients, so none is older than
    it; the simpler "a backward, and no gradient kept, so the gradients are older" split the
    copies as parameter, gradient and one state."""
    w = sample_truth("bulk_release_python")["workload"]
    cats = _requested(real_frames, "bulk_release_python")
    assert cats["parameter"] == pytest.approx(w["param_bytes"], rel=0.01)
    assert cats["optimizer_state"] == pytest.approx(w["optimizer_state_bytes"], rel=0.01)
    assert cats["gradient"] == 0
    rules = _by_rule(real_frames, "bulk_release_python")
    assert set(rules["parameter"]) == {"pre_trace_copies"}
    assert rules["other"]["pre_trace_workspace"] == 2 * 32 * 2**20  # the two threads' cuBLAS workspaces


@pytest.mark.parametrize("name", [f"late_{a}_{m}" for a in ("gpt2", "llama") for m in MODES])
def test_copies_need_the_trace_to_allow_them_hold_out(real_frames, name):
    """Parameters older than the trace, gradients and AdamW state made in it: the counts of
    Llama's and GPT-2's parameter sizes (once per layer: 12, 24, ...) divide by 4, and a copies rule
    that ignored what the trace made would have split the parameters into four roles."""
    assert set(_by_rule(real_frames, name)["parameter"]) == {"pre_trace_parameter_sized"}


OLDER_TRAINING = [
    "lightning_fit_step3",
    "hf_trainer_end",
    "late_llama_python",
    "late_gpt2_all",
    "modtags_gpt2_python_untagged",
    "grad_plain_python",
    "grad_ckpt_all",
    "ring_wrapped",
]


@pytest.mark.parametrize("name", OLDER_TRAINING)
def test_no_kv_cache_mirror_or_weights_in_older_training_runs_hold_out(real_frames, name):
    """Training runs whose GPT-2/Llama forward builds a DynamicCache (use_cache on): its copies of
    the keys and values are activations (rule kv_cache_in_training). With "a cache_utils frame
    means kv_cache", lightning_fit_step3's module view had 4 MiB of KV cache and late_llama_python
    32 MiB at the peak. No hand-written optimizer (parameter_mirror) and no inference weights
    either."""
    from snapshot_lab.metrics.categories import RULES, categorize

    fr = real_frames(name)
    d = fr.info.devices[0]
    result = categorize(fr)
    assert not (result.alloc_codes[d] == CATEGORIES.index("kv_cache")).any()
    used = {RULES[i] for i in set(result.alloc_rules[d].tolist())} | set(result.block_rule.dropna())
    assert used.isdisjoint({"parameter_mirror", "pre_trace_weights"})


def test_kv_cache_of_a_single_forward_hold_out(real_frames):
    """deep_llama_forward_all (one Llama forward with grad, no backward, 24 layers): the
    DynamicCache's copies of the keys and values are saved for backward, so activations (rule
    kv_cache_in_grad_forward, tests/test_categories_kvgap.py), as in fit_gpt2_b32_oom_python's
    training forward that no trace evidence tells it from: no kv_cache, no growth to report."""
    from snapshot_lab.metrics.categories.kv_cache import kv_cache_growth

    cats = _requested(real_frames, "deep_llama_forward_all")
    assert kv_cache_growth(real_frames("deep_llama_forward_all"), 0) is None
    assert cats["kv_cache"] == 0 and cats["activation"] >= 96 * 2**20  # 24 layers x keys and values x 2 MiB


def test_inference_weights_hold_out(real_frames):
    """inf_flush_python (Llama fp16, 4 layers, recorded after the model was on the GPU; written for
    the allocator flush, not for categories): its weights are the parameters, and the cuBLAS
    workspace a forward made before recording began is not ("every stackless block of an
    inference trace is a weight" counted it: 321 MiB of parameters for 289 MiB)."""
    from .conftest import SAMPLES

    if not (SAMPLES / "inf_flush_python.truth.json").exists():
        pytest.skip("inf_flush_python is not among the samples of this checkout")
    w = sample_truth("inf_flush_python")["workload"]
    cats = _requested(real_frames, "inf_flush_python")
    assert cats["parameter"] == pytest.approx(w["param_bytes"], rel=0.01)
    assert set(_by_rule(real_frames, "inf_flush_python")["parameter"]) == {"pre_trace_weights"}


def _frame(path: str, name: str, line: int = 10) -> dict:
    return {"filename": path, "line": line, "name": name}


SITE = "/venv/lib/python3.12/site-packages"
TRAIN = _frame("/work/train.py", "<module>")
ACCELERATE_STEP = [_frame(f"{SITE}/accelerate/optimizer.py", "step"), TRAIN]
ADAM_STATE = [_frame(f"{SITE}/torch/optim/adam.py", "_init_group"), _frame(f"{SITE}/torch/optim/adam.py", "step")]
FORWARD = [_frame(f"{SITE}/torch/nn/modules/module.py", "_call_impl"), _frame("/work/train.py", "closure")]
LBFGS_STEP = [_frame(f"{SITE}/torch/optim/lbfgs.py", "step"), TRAIN]


@pytest.mark.parametrize(
    ("stack", "expected"),
    [
        # accelerate wraps the step: Adam's own code still allocates its state
        (ADAM_STATE + ACCELERATE_STEP, "optimizer_state"),
        # a closure's forward inside LBFGS's step: the innermost decisive frame is the forward
        (FORWARD + LBFGS_STEP, "activation"),
        # the closure's own code (the loss, outside any module) is not the optimizer's
        (
            [
                _frame(f"{SITE}/torch/nn/functional.py", "cross_entropy"),
                _frame("/work/train.py", "closure"),
                *LBFGS_STEP,
            ],
            "other",
        ),
        # LBFGS's own history (torch.cat in lbfgs.py) is its state
        ([_frame(f"{SITE}/torch/optim/lbfgs.py", "_gather_flat_grad"), *LBFGS_STEP], "optimizer_state"),
        # a DeepSpeed engine's forward, and bitsandbytes' 8-bit Adam under it
        ([*FORWARD[:1], _frame(f"{SITE}/deepspeed/runtime/engine.py", "forward"), TRAIN], "activation"),
        ([_frame(f"{SITE}/bitsandbytes/optim/optimizer.py", "init_state"), TRAIN], "optimizer_state"),
        # transformers' cache under a module's forward; vLLM's preallocation
        ([_frame(f"{SITE}/transformers/cache_utils.py", "update"), *FORWARD], "kv_cache"),
        ([_frame(f"{SITE}/vllm/v1/worker/gpu_model_runner.py", "_allocate_kv_cache_tensors"), TRAIN], "kv_cache"),
    ],
)
def test_innermost_decisive_frame(snap_file, stack, expected):
    from snapshot_lab import load_frames
    from snapshot_lab.metrics.categories import stack_categories

    from .conftest import event, make_snapshot

    frames = load_frames(snap_file(make_snapshot([], [[event("alloc", 0x1000, 512, 1, frames=stack)]])))
    assert stack_categories(frames).tolist() == [expected]


def _facts(**kw):
    import numpy as np

    from snapshot_lab.metrics.categories.pretrace import TraceFacts

    empty = np.zeros(0, dtype=np.int64)
    base = dict(
        param_sizes=frozenset(),
        params_have_stacks=False,
        has_backward=False,
        has_forward=True,
        optimizer_state_sizes=empty,
        trace_gradient_sizes=empty,
    )
    return TraceFacts(**{**base, **kw})


def test_roles_the_trace_allows():
    """A backward that made no gradient accumulated into older ones; one that made gradients
    leaves none older; state made in the trace is not older."""
    import numpy as np

    some = np.array([4096])
    assert all("gradient" in r for r in _facts(has_backward=True).possible_roles())
    assert not any("gradient" in r for r in _facts(has_backward=True, trace_gradient_sizes=some).possible_roles())
    assert _facts(optimizer_state_sizes=some, trace_gradient_sizes=some).possible_roles() == [("parameter",)]


def test_copies_per_parameter_by_blocks_and_by_bytes():
    import numpy as np

    from snapshot_lab.metrics.categories.pretrace import ROLE_PATTERNS, copies_per_parameter

    def sizes(counts):
        return np.repeat(np.array(list(counts), dtype=np.int64), list(counts.values()))

    adam = sizes({3072: 4 * 38, 9437184: 4 * 12, 25165824: 4})  # GPT-2 mid-run: 4 copies
    assert copies_per_parameter(adam, list(ROLE_PATTERNS)) == ROLE_PATTERNS[0]
    # parameters and gradients: many small vectors divide by 4, the bytes do not
    bench = sizes({3072: 2 * 38, 12288: 2 * 6, 9437184: 2 * 12, 25165824: 2, 3145728: 2})
    assert len(copies_per_parameter(bench, list(ROLE_PATTERNS))) == 2
    # weights alone: 2 per layer and a final norm do not divide by 2
    llama = sizes({4096: 25, 8388608: 24, 23068672: 36, 131072000: 2})
    assert copies_per_parameter(llama, list(ROLE_PATTERNS)) == ("parameter",)


def test_gradient_older_than_the_trace_made_on_autograds_thread(snap_file):
    """A ring buffer that wrapped keeps the blocks' own stacks: a parameter-sized block that
    autograd's thread made (C++ frames of the engine, e.g. ToCopyBackward0 under autocast) and
    that is alive at the dump is a gradient of an earlier backward, not an activation."""
    from snapshot_lab import load_frames
    from snapshot_lab.metrics.categories import categorize

    from .conftest import block, event, make_snapshot, segment

    init = [_frame(f"{SITE}/torch/nn/modules/linear.py", "__init__"), TRAIN]
    engine = [
        {"filename": "", "line": 0, "name": "torch::autograd::generated::ToCopyBackward0::apply"},
        {"filename": "", "line": 0, "name": "torch::autograd::Engine::thread_main"},
    ]
    seg = segment(
        0x10000000, [block(4 * 2**20, frames=init), block(4 * 2**20, frames=engine), block(2**20, "inactive")]
    )
    trace = [event("alloc", 0x10800000, 2**20, 1, frames=[TRAIN]), event("free_completed", 0x10800000, 2**20, 2)]
    frames = load_frames(snap_file(make_snapshot([seg], [trace])))
    result = categorize(frames)
    assert result.block_category.tolist()[:2] == ["parameter", "gradient"]
    assert result.block_rule.tolist()[1] == "pre_trace_autograd_gradient"
