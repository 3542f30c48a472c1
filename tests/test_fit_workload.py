"""What ``snaplab fit`` decides the trace recorded (``metrics/fit/workload.py``), on every real
sample, against what the sample's job really ran (its ``.truth.json`` "workload"), and what it
answers for the kinds that are not a training step (issue #20).

The expected kind of every sample is written from its truth file (the workload's "kind", and
the facts it names: an optimizer, an out-of-memory error, the integration), never from the
function under test.

Hold-outs (each a real sample that breaks a simpler rule):

- "no optimizer step in the trace ⇒ it ran out of memory in its first forward" (the rule ``fit``
  had): ``deep_inference_python`` (three inference batches, no failure) and
  ``bench_fwdbwd_python`` (a forward+backward benchmark, no optimizer);
- "an out-of-memory error and no backward ⇒ the first forward failed":
  ``capture_oom_rank0`` (a loop of forwards that keeps its outputs: 30 calls completed before
  the cap was hit);
- "no backward and no out-of-memory error ⇒ inference": ``midrun_late_python`` (a training
  job recorded mid-step: gradients and optimizer state older than the trace);
- "a forward call is a run from the call site of the last one": ``inf_llama_start_python``
  (generate()'s prefill calls the model from another line than its 63 decoding steps: 64
  forwards, as the truth counts them).
"""

from __future__ import annotations

from typing import Any

import pytest

from snapshot_lab import api
from snapshot_lab.errors import EXIT_BAD_INPUT, SnapshotFormatError
from snapshot_lab.metrics.fit import compute_fit, predict_step
from snapshot_lab.metrics.fit import workload as wl
from snapshot_lab.metrics.fit.model import FitUnsupported, step_evidence
from snapshot_lab.metrics.plan.planner import _device
from snapshot_lab.metrics.plan.structure import training_structure

from .conftest import sample_names, sample_path, sample_truth

# truth "kind" -> what the job ran, as its truth file describes it
TRAINING_KINDS = {
    "capture-ddp",
    "capture-oom-incident",  # Linear layers + Adam, out of memory after six whole steps
    "capture-series",
    "cnn",
    "dataparallel",
    "ddp",
    "ddp-gloo-shared-gpu",
    "ddp-nccl",
    "fabric",
    "fit-complete",
    "fit-compile",
    "gradients-accum",
    "gradients-amp",
    "gradients-anomaly-mode",
    "gradients-ckpt",
    "gradients-compile",
    "gradients-plain",
    "hf-trainer",
    "hf-trainer-bf16",
    "lbfgs-closure",
    "lightning-automatic",
    "lightning-manual",
    "lightning-mixed",
    "midrun-grads-never-zeroed",
    "midrun-wrapped",
    "mlp-leak",
    "module-tags",
    "one-empty-cache-then-train",
    "parallel-ddp",
    "parallel-fsdp1",
    "parallel-fsdp2",
    "parallel-fsdp_tp",
    "parallel-pp",
    "parallel-single",
    "parallel-tp",
    "parallel-zero1",
    "recorded-after-model-construction",
    "ring",
    "transformer",
    "transformer-ring-wrapped",
    "whatif",
    "whatif-gc",  # training steps; the capped ones run out of memory after their first whole step
    # a capped run at its largest batch and one more: at least one whole step, then maybe an OOM
    "fit-capped-boundary",
    "fit-precision-train",
    # one more than the largest batch under the cap: a whole step, then out of memory in the next
    "fit-oom-late",
    # issue #37's strangers: steps recorded after warm-up, a step dumped before its backward
    # (the trace holds whole steps before it), Megatron's DistributedOptimizer
    "training-step-recorded-after-warmup",
    "training-step-before-backward",
    "megatron-distributed-optimizer",
}
# a backward ran and the truth names no optimizer and no optimizer state (no "optimizer" key, or
# "optimizer": null for the benchmark): forward and backward without an optimizer step
FORWARD_BACKWARD_KINDS = {
    "forward-backward-benchmark",
    "one-forward-backward",
    "cnn-expandable",
    "cuda-graph",
    "empty-cache-churn",
    "mlp-cpp-stacks",
}
# no backward: generation, inference batches, one forward ("no backward, no optimizer"), and
# train_oom.py's loop of forwards that keeps every output until the cap
FORWARD_ONLY_KINDS = {
    "inference",
    "inference-kv-cache",
    "inference-allocator-flush",
    "one-forward",
    "capture-oom",
    "fit-precision-inference",
    "fit-inference-autocast",
    "fit-inference",
    # recorded to run out of memory in its first forward, it did in its second (its truth's note)
    "fit-inference-oom",
    # no_grad forwards: a CUDA graph of one replayed beside a MemPool, weights in a MemPool
    "cuda-graph-beside-mempool",
    "weights-in-mempool",
}
# an inference job out of memory in its first forward shows no more than a training job's first
# forward does (fit refuses the two of them: each ran out inside its first block)
OOM_IN_FORWARD_KINDS = {"fit-oom-first-forward", "fit-inference-oom-first-forward"}
# a training job dumped after a forward of a step whose start the trace does not hold; OOMs
# provoked by raw allocations outside any model; a record_stream test; a trace without stacks
TOO_LITTLE_KINDS = {
    "midrun-late",
    "oom-capacity",
    "oom-fragmentation",
    "record-stream",
    "transformer-state-only",
    "state-only-weights",
    "state-only-hook-leak",
}
CLAIMS_OF_OOM = ("ran out of memory", "forward failed", "ends in the first forward", "ends in an out-of-memory error")


def expected_kind(truth: dict[str, Any]) -> str:
    """What the job ran, from its truth file alone."""
    work = truth["workload"]
    kind = work["kind"]
    if kind == "fit-capped-boundary" and work["steps_done"] == 0:  # ConvNeXt at 195: out in its first backward
        return wl.TOO_LITTLE
    if kind == "integration":  # a training loop's callback, or a pytest test's tensors (no model)
        return wl.TOO_LITTLE if "pytest" in work["integration"] else wl.TRAINING_STEP
    for kinds, expected in (
        (TRAINING_KINDS, wl.TRAINING_STEP),
        (FORWARD_BACKWARD_KINDS, wl.FORWARD_BACKWARD),
        (FORWARD_ONLY_KINDS, wl.FORWARD_ONLY),
        (OOM_IN_FORWARD_KINDS, wl.OOM_IN_FORWARD),
        (TOO_LITTLE_KINDS, wl.TOO_LITTLE),
    ):
        if kind in kinds:
            return expected
    raise AssertionError(f"no expectation written for the truth kind {kind!r}")


def truth_has_oom(truth: dict[str, Any]) -> bool:
    work = truth["workload"]
    if work["kind"] == "fit-capped-boundary":  # its observer also saw the OOMs cuDNN caught: "oom" ended it
        return "oom" in work
    return bool(work.get("oom_observed") or work.get("oom") or (work.get("expect") or {}).get("oom"))


def _workload(real_frames: Any, name: str) -> wl.Workload:
    frames = real_frames(name)
    return wl.workload(frames, training_structure(frames, _device(frames)))


NOT_TRAINING = [name for name in sample_names() if expected_kind(sample_truth(name)) != wl.TRAINING_STEP]


@pytest.mark.parametrize("name", sample_names())
def test_every_sample_is_what_its_truth_says(real_frames: Any, name: str) -> None:
    assert _workload(real_frames, name).kind == expected_kind(sample_truth(name))


@pytest.mark.parametrize("name", NOT_TRAINING)
def test_no_oom_claimed_where_none_happened(real_frames: Any, name: str) -> None:
    """What fit says (its notes, or why it refuses) claims an out-of-memory error only where the
    job had one."""
    try:
        said = " ".join(step_evidence(real_frames(name), _device(real_frames(name))).notes)
    except FitUnsupported as exc:
        said = str(exc)
    claimed = [claim for claim in CLAIMS_OF_OOM if claim in said]
    if not truth_has_oom(sample_truth(name)):
        assert claimed == [], said
    assert said  # something is always said


def test_every_kind_is_met() -> None:
    """The samples hold every kind at least once (else a kind's branch goes untested)."""
    assert {expected_kind(sample_truth(name)) for name in sample_names()} == set(wl.KINDS)


def test_simpler_rules_break_on_real_samples(real_frames: Any) -> None:
    """Each hold-out of the module docstring, with the fact that breaks the simpler rule."""
    inference = _workload(real_frames, "deep_inference_python")
    assert (inference.backwards, inference.optimizer_steps, inference.oom_request) == (0, 0, None)
    assert inference.forwards == sample_truth("deep_inference_python")["workload"]["batches"] == 3
    bench = _workload(real_frames, "bench_fwdbwd_python")
    assert (bench.kind, bench.optimizer_steps, bench.oom_request) == (wl.FORWARD_BACKWARD, 0, None)
    looped = _workload(real_frames, "capture_oom_rank0")
    assert (looped.kind, looped.forwards, looped.oom_request) == (wl.FORWARD_ONLY, 30, 33554432)
    assert looped.oom_request == sample_truth("capture_oom_rank0")["workload"]["requested_bytes"]
    midrun = _workload(real_frames, "midrun_late_python")
    assert (midrun.forwards, midrun.oom_request) == (1, None)
    assert midrun.older_training_state == ("gradient", "optimizer_state")
    generation = _workload(real_frames, "inf_llama_start_python")
    assert generation.forwards == sample_truth("inf_llama_start_python")["workload"]["forwards"] == 64


def test_refusals_say_what_the_trace_shows(real_frames: Any) -> None:
    """Refused as other snapshots fit cannot use are (bad input, exit code 3), saying what the
    trace holds."""
    with pytest.raises(SnapshotFormatError, match="cannot fit from this snapshot: forward passes only") as refused:
        api.fit(sample_path("midrun_late_python"))
    assert refused.value.exit_code == EXIT_BAD_INPUT == 3
    assert "gradients and optimizer state older than the trace" in str(refused.value)
    with pytest.raises(FitUnsupported, match=r"^forward passes only, no out-of-memory error: 1 forward call"):
        step_evidence(real_frames("midrun_late_python"), 0)
    with pytest.raises(FitUnsupported, match=r"^the trace shows no forward pass .* and no out-of-memory error"):
        step_evidence(real_frames("pending_free"), 0)
    with pytest.raises(FitUnsupported, match=r"^the trace ran out of memory outside any module's forward"):
        step_evidence(real_frames("oom_fragmentation"), 0)


# inference samples: predicted peak = torch's peak, byte for byte; inf_llama_late_python's
# recording began after the model was loaded (its parameters are older than the trace), and
# inf_flush_python's ran under a cap that made the allocator flush its cache (allocated bytes
# do not see it)
INFERENCE_PEAKS = [
    "deep_inference_python",
    "deep_forward_python",
    "deep_llama_forward_all",
    "inf_llama_start_python",
    "inf_llama_late_python",
    "inf_flush_python",
]


@pytest.mark.parametrize("name", INFERENCE_PEAKS)
def test_inference_peak_at_the_recorded_batch_is_torchs(real_frames: Any, name: str) -> None:
    allocated, _ = predict_step(real_frames(name))
    assert allocated == sample_truth(name)["memory_stats"]["0"]["allocated_bytes.all.peak"]


def test_inference_answer_has_no_training_parts(real_frames: Any) -> None:
    """deep_inference_python: no gradients, no optimizer state; checkpointing and the optimizer
    levers left out (with the reason in the notes); parameters do not scale with the batch,
    activations do; bf16 remains and lowers the peak."""
    frames = real_frames("deep_inference_python")
    result = compute_fit(frames, memory_limit=6 << 30, parallel=False)
    truth = sample_truth("deep_inference_python")["workload"]
    assert result.breakdown["gradients_bytes"] == result.breakdown["optimizer_state_bytes"] == 0
    assert result.breakdown["parameters_bytes"] == truth["param_bytes"] == 110528512
    levers = {o.lever: o for o in result.levers}
    assert {"checkpointing", "sgd-momentum", "optimizer offload"}.isdisjoint(levers)
    assert levers["bf16"].peak_allocated_bytes < levers["as recorded"].peak_allocated_bytes
    assert wl.FORWARD_ONLY_LEVERS_NOTE in result.notes
    assert levers["as recorded"].assumption == wl.FORWARD_ONLY_ASSUMPTIONS["as recorded"]
    with pytest.raises(FitUnsupported, match="not applicable to forward passes only"):
        predict_step(frames, checkpointing=True)
    assert result.optimizer == wl.NO_OPTIMIZER
    assert result.to_dict()["workload"] == wl.FORWARD_ONLY == "forward passes only"
    # no gradients to sum: gradient accumulation is not offered (it once was, as for a training step)
    assert result.to_dict()["gradient_accumulation"] == {
        "micro_batch": None,
        "accumulation_steps": None,
        "assumption": wl.INFERENCE_OPTIMIZER_SOURCE,
    }
    at_half, _ = predict_step(frames, batch_scale=0.5)
    at_one, _ = predict_step(frames)
    # peak(k) = fixed + k * scaling while the peak stays where it is: what does not scale is
    # the parameters (the model's construction made nothing else that lives)
    assert 2 * at_half - at_one == truth["param_bytes"]


def test_forward_backward_without_optimizer(real_frames: Any) -> None:
    """bench_fwdbwd_python: the recorded pass is the step, no optimizer state, and fit says so;
    its peak is torch's; AdamW given adds its state (2 P, alive at the peak) to the step."""
    frames = real_frames("bench_fwdbwd_python")
    ev = step_evidence(frames, 0)
    assert (ev.optimizer, ev.optimizer_state_bytes) == (wl.NO_OPTIMIZER, 0)
    assert any(note.startswith("no optimizer step in the trace") for note in ev.notes)
    allocated, _ = predict_step(frames)
    assert allocated == sample_truth("bench_fwdbwd_python")["memory_stats"]["0"]["allocated_bytes.all.peak"]
    with_adamw = step_evidence(frames, 0, "adamw")
    assert with_adamw.optimizer_state_bytes == 2 * with_adamw.parameter_bytes
    # one state tensor per parameter and moment: the allocator model rounds each as torch would
    # (a large block keeps a remainder under 1 MiB), 1.5 MiB in all
    added = predict_step(frames, optimizer="adamw")[0] - allocated
    assert 0 <= added - with_adamw.optimizer_state_bytes <= 0.01 * with_adamw.optimizer_state_bytes


def test_the_answer_names_the_job_it_models(real_frames: Any) -> None:
    """The headline speaks of what was recorded: inference is "the recorded forwards" with no
    gradients and no optimizer state; a forward+backward says "no optimizer state" (it once read
    "gradients 0.00, none 0.00" and "a whole step" for both)."""
    from snapshot_lab.render.fit import format_fit, headline

    inference = compute_fit(real_frames("deep_inference_python"), memory_limit=6 << 30, parallel=False)
    first = headline(inference)
    assert first.startswith("The recorded forwards at the recorded batch need about 526.4 MiB: parameters 0.10;")
    assert "(inference: no gradients, no optimizer state)" in first and "none" not in first
    text = format_fit(inference, "deep_inference_python.pickle.xz")
    assert "The recorded forwards (bytes):" in text and "The step (bytes):" not in text
    benchmark = compute_fit(real_frames("bench_fwdbwd_python"), memory_limit=6 << 30, parallel=False)
    first = headline(benchmark)
    assert first.startswith("A forward and backward at the recorded batch need about ")
    assert "no optimizer state" in first and "none 0.00" not in first
