"""``fit`` on inference jobs under ``torch.no_grad()`` against real runs: the Llama and GPT-2 fit
families' models, two forwards per run with transformers' KV cache, their peaks at five batches
and the largest batch whose forwards ran under 6 GiB (``workloads_fit.py``, ``INFER_OOMS``;
recorded on 2026-11-27, third session). From a recording at batch 8 every peak is within 4% and
the largest batch within one of the real one; their OOMs, at batches 128 and 256, ran out inside
the first block (attention's scores) and are refused with the reason, not answered."""

from __future__ import annotations

import json

import pytest

from snapshot_lab.metrics.fit import compute_fit, predict_step
from snapshot_lab.metrics.fit.extrapolate import NO_WHOLE_BLOCK
from snapshot_lab.metrics.fit.model import FitUnsupported

from .conftest import SAMPLES

FAMILIES = json.loads((SAMPLES / "fit_truth.json").read_text())["families"]
CAP = 6 << 30
INFERENCE = {"llamainfer": 128, "gpt2infer": 256}  # family -> the batch its OOM ran at


@pytest.mark.parametrize("family", list(INFERENCE))
def test_inference_peaks_and_largest_batch_against_the_real_runs(real_frames, family):
    frames = real_frames(f"fit_{family}_b8_complete_python")
    truth = FAMILIES[family]["levers"]["plain"]
    for batch, run in truth["uncapped"].items():
        allocated, _ = predict_step(frames, batch_scale=int(batch) / 8)
        assert abs(allocated / run["peak_process_bytes"] - 1) < 0.04, (batch, allocated, run["peak_process_bytes"])
    fit = compute_fit(frames, memory_limit=CAP, recorded_batch=8)
    assert fit.workload == "forward passes only"
    assert abs(fit.largest_batch["as recorded"] - truth["largest_batch_under_cap"]) <= 1
    assert "checkpointing" not in fit.largest_batch  # no backward to checkpoint


@pytest.mark.parametrize("family", list(INFERENCE))
def test_an_inference_oom_inside_the_first_block_is_refused(real_frames, family):
    with pytest.raises(FitUnsupported, match=NO_WHOLE_BLOCK[:40]):
        compute_fit(real_frames(f"fit_{family}_b{INFERENCE[family]}_oom_python"), memory_limit=CAP)


# OOM in the first forward under torch.no_grad() -> (family, recorded batch, bound on the peaks'
# error, the largest batch's range); the table's largest batches: GPT-2 37, the Llama 41, Qwen2 35
INFERENCE_OOMS = {
    "fit_gpt2infer_b54_oom_python": ("gpt2infer", 54, 0.025, (31, 36)),  # the rule's source
    "fit_gpt2infer_b44_oom_python": ("gpt2infer", 44, 0.025, (31, 36)),  # recorded before it, read after
    "fit_llamainfer_b80_oom_python": ("llamainfer", 80, 0.035, (42, 42)),  # the same; see below
    "fit_llamainfer_b96_oom_python": ("llamainfer", 96, 0.035, (42, 42)),
    "fit_qwen2infer_b38_oom_python": ("qwen2infer", 38, 0.05, (35, 36)),  # recorded after both rules
    "fit_qwen2infer_b42_oom_python": ("qwen2infer", 42, 0.05, (35, 36)),
}


@pytest.mark.parametrize("name", list(INFERENCE_OOMS))
def test_an_inference_oom_past_the_first_block_is_extrapolated_as_inference(real_frames, name):
    """GPT-2 under ``torch.no_grad()`` at batch 54, out of memory in its sixth block
    (``workloads_fit.py``, ``INFER_LATE_OOMS``; 2026-11-27, fourth session). The simpler rule, "an
    OOM in the first forward is a training step's", extrapolated a step with a backward and AdamW:
    22 as recorded, where the inference runs at 37. Every block it completed kept nothing but its
    output and its KV cache (frozen.ran_without_autograd): the rest of the forward is extrapolated
    without autograd (each block's KV cache alive to the forward's end, the logits returned).

    The hold-outs, recorded before and read after: GPT-2 at 44 (out in its tenth block) agreed; the
    Llama at 80 and 96 (out in its eighth and third block) was 10% to 19% low, 67 where 41 ran: the
    head read the stream's size from what the last block kept, the KV cache alone, which grouped
    queries make narrower than the stream (extrapolate._Step._head_sizes reads what the block
    made now), and the Llama's logits (vocabulary 32,000 at width 1,024) make its peak. So the
    Llama is no hold-out of that fix; Qwen2 (grouped queries too), recorded after it, is of the
    whole: within 5%, 35-36 where 35 ran."""
    family, recorded, bound, (first, last) = INFERENCE_OOMS[name]
    frames = real_frames(name)
    plain = FAMILIES[family]["levers"]["plain"]
    for batch, run in plain["uncapped"].items():
        allocated, _ = predict_step(frames, batch_scale=int(batch) / recorded)
        assert abs(allocated / run["peak_process_bytes"] - 1) <= bound, (batch, allocated)
    fit = compute_fit(frames, memory_limit=CAP, recorded_batch=recorded)
    assert fit.workload == "forward passes only"
    assert (fit.largest_batch_no_retry["as recorded"], fit.largest_batch["as recorded"]) == (first, last)
    assert abs(plain["largest_batch_under_cap"] - last) <= 1
    assert "checkpointing" not in fit.largest_batch and "sgd-momentum" not in fit.largest_batch
    assert fit.breakdown["gradients_bytes"] == fit.breakdown["optimizer_state_bytes"] == 0


def test_a_frozen_first_half_is_no_inference(real_frames):
    """The hold-out: GPT-2 with its first six blocks frozen, out of memory in its first forward at
    batch 32, kept nothing in those six blocks; the trained ones after them did. It is a training
    step still, its largest batch as recorded 7 where 7 ran."""
    frames = real_frames("fit_gpt2frozen_b32_oom_python")
    fit = compute_fit(frames, memory_limit=CAP, recorded_batch=32)
    assert fit.workload == "out of memory in the first forward"
    assert fit.largest_batch["as recorded"] == FAMILIES["gpt2frozen"]["levers"]["plain"]["largest_batch_under_cap"] == 7


def test_an_inference_oom_in_a_later_forward_answers_from_the_whole_first(real_frames):
    """The Llama under ``torch.no_grad()`` at batch 60 ran its first forward and ran out of memory on
    its second one's logits: forward passes only, and the largest batch is 41, as the table's
    search found, and as a fresh process ran (``fresh_process`` in fit_truth.json)."""
    fit = compute_fit(real_frames("fit_llamainfer_b60_oom_python"), memory_limit=CAP, recorded_batch=60)
    assert fit.workload == "forward passes only"
    plain = FAMILIES["llamainfer"]["levers"]["plain"]
    assert fit.largest_batch["as recorded"] == plain["largest_batch_under_cap"] == 41
    assert plain["fresh_process"]["41"]["ok"]


def test_the_layers_of_one_inference_forward_are_no_iterations(real_frames):
    """GPT-2's inference OOM at batch 54 keeps each layer's KV cache, 324 MiB of a 2.5 GiB rise
    per layer: its layers passed as iterations that return (the rule the frozen GPT-2 gave,
    tests/test_fit_frozen.py) and the cache was a leak of 486 MiB an iteration. Repetitions whose
    every allocation was made inside a module's call are one forward's layers. The hold-outs: an
    inference loop's layers, whose inputs are made outside the model between batches, are still
    grouped into its iterations (``deep_inference_python``, 32 layers x 3 batches), and a training
    loop's iterations are found as before (``inf_flush_python``)."""
    from snapshot_lab.metrics.history.iterations import find_iterations

    assert find_iterations(real_frames("fit_gpt2infer_b54_oom_python"), 0) is None
    deep = find_iterations(real_frames("deep_inference_python"), 0)
    assert deep is not None and deep.count == 3
    assert find_iterations(real_frames("inf_flush_python"), 0) is not None
