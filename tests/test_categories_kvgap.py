"""A KV cache filled by a forward with grad before any backward (issue #19's closing note).

``fit_gpt2_b32_oom_python``: GPT-2 training at batch 32 runs out of memory in its first forward
under a 6 GiB cap. transformers' ``DynamicCache`` (``use_cache`` on) had copied two layers' keys
and values, 384 MiB that the attention saved for backward; with no backward and no optimizer state
in the trace (AdamW makes its state at the first step), rule ``kv_cache_in_training`` could not see
the training and they were called an inference cache. Rule ``kv_cache_in_grad_forward``
(:mod:`snapshot_lab.metrics.categories.grad_forward`) reads it from how the forward keeps memory:
with grad, what is not the cache grows by several times the cache from the forward's first cache
allocation to its last; under ``no_grad`` it stays flat.

Real cases that break the simpler rules:

- "a cache filled by a plain forward (no ``generate``, no ``no_grad`` decorator on its stack) is
  training's": ``deep_inference_python`` (GPT-2 forwards under ``with torch.no_grad()``, a
  context manager, which is no frame) and ``inf_flush_python`` (Llama prefills, likewise) would
  lose their 768 MiB and 1152 MiB of cache allocations;
- "a ``no_grad`` decorator frame in the trace means inference": ``deep_llama_forward_all`` (one
  forward with grad) has one, on Llama's rotary embedding;
- "parameters made in the trace and no backward": true of ``deep_inference_python`` as much as of
  the OOM.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from snapshot_lab.metrics.categories import (
    CODES,
    RULES,
    blocks_at_peak,
    categories_at_peak,
    categorize,
    compute_categories,
)
from snapshot_lab.metrics.categories.grad_forward import SAVED_PER_CACHE_BYTE, forward_growth
from snapshot_lab.metrics.categories.stacks import stacks_with_frame
from snapshot_lab.metrics.history.lifetimes import device_lifetimes

from .conftest import sample_truth

MiB = 2**20
RULE = "kv_cache_in_grad_forward"

# forwards with grad and no backward: the cache's copies (bytes) are activations
GRAD_FORWARDS = {
    "fit_gpt2_b32_oom_python": 384 * MiB,  # 2 layers x keys and values x 96 MiB, then the OOM
    "deep_forward_python": 256 * MiB,  # GPT-2, 32 layers x 2 x 4 MiB
    "deep_llama_forward_all": 96 * MiB,  # Llama, 24 layers x 2 x 2 MiB
}
# inference with a real KV cache: the kv_cache bytes they had before the rule, allocated over the
# trace, alive at the dump and at the peak (requested bytes)
GENERATION = {
    "inf_llama_late_python": (53_125_054_464, 854_851_584, 805_306_368),
    "inf_llama_late_all": (53_125_054_464, 854_851_584, 805_306_368),
    "inf_llama_start_python": (53_125_054_464, 854_851_584, 805_306_368),
    "deep_inference_python": (805_306_368, 0, 268_435_456),
    "inf_flush_python": (1_207_959_552, 0, 0),
}
# training runs whose forward builds a DynamicCache: rule kv_cache_in_training (a backward or an
# optimizer in the trace) keeps labelling them, with the bytes it had before
TRAINING = {
    "fit_gpt2_b4_complete_python": 603_979_776,
    "late_gpt2_python": 67_108_864,
    "late_gpt2_all": 67_108_864,
    "late_llama_python": 67_108_864,
    "fw_lightning_auto_python": 134_217_728,
    "midrun_wrapped_python": 150_994_944,
    "lightning_fit_step3": 12_582_912,
}


def _bytes_by_rule(frames, rule: str) -> tuple[int, set[str]]:
    """Bytes of the trace's allocations labelled by ``rule`` on device 0, and their categories."""
    result = categorize(frames)
    mask = result.alloc_rules[0] == RULES.index(rule)
    sizes = device_lifetimes(frames, 0)["size_bytes"].to_numpy(dtype=np.int64)
    names = {list(CODES)[c] for c in set(result.alloc_codes[0][mask].tolist())}
    return int(sizes[mask].sum()), names


def _kv_in_trace(frames) -> int:
    sizes = device_lifetimes(frames, 0)["size_bytes"].to_numpy(dtype=np.int64)
    return int(sizes[categorize(frames).alloc_codes[0] == CODES["kv_cache"]].sum())


def test_oom_in_the_first_training_forward_has_no_kv_cache(real_frames):
    """The gap itself: at the peak (the OOM) no byte is kv_cache; the 384 MiB are activations."""
    name = "fit_gpt2_b32_oom_python"
    assert sample_truth(name)["workload"]["kind"] == "fit-oom-first-forward"
    fr = real_frames(name)
    at_peak = categories_at_peak(fr, 0)
    assert at_peak is not None and at_peak["kv_cache"] == 0
    alive = blocks_at_peak(fr, 0)
    assert alive is not None
    saved = alive[alive["rule"] == RULE]
    assert set(saved["category"]) == {"activation"} and int(saved["size_bytes"].sum()) == 384 * MiB
    assert sorted(saved["size_bytes"].tolist()) == [96 * MiB] * 4
    live = compute_categories(fr, 0, with_timeline=False)
    assert live.live_requested_bytes["kv_cache"] == 0
    assert live.live_requested_by_rule["activation"][RULE] == 384 * MiB


@pytest.mark.parametrize("name", list(GRAD_FORWARDS))
def test_forwards_with_grad_keep_their_keys_and_values_as_activations(real_frames, name):
    """deep_forward_python ("every layer saves activations for a backward that never comes") and
    deep_llama_forward_all ("one forward with grad") are the OOM's case without the OOM: train
    mode, labels, grad on, no backward. No trace evidence tells them from it (the optimizer the
    OOM's program built had allocated nothing), so they move with it."""
    fr = real_frames(name)
    assert _kv_in_trace(fr) == 0
    assert _bytes_by_rule(fr, RULE) == (GRAD_FORWARDS[name], {"activation"})


@pytest.mark.parametrize("name", list(GENERATION))
def test_generation_keeps_its_kv_cache(real_frames, name):
    fr = real_frames(name)
    in_trace, at_dump, at_peak = GENERATION[name]
    assert _kv_in_trace(fr) == in_trace
    assert compute_categories(fr, 0, with_timeline=False).live_requested_bytes["kv_cache"] == at_dump
    peak = categories_at_peak(fr, 0)
    assert peak is not None and peak["kv_cache"] == at_peak
    assert _bytes_by_rule(fr, RULE)[0] == 0


@pytest.mark.parametrize("name", list(TRAINING))
def test_training_runs_are_still_labelled_by_their_backward(real_frames, name):
    fr = real_frames(name)
    assert _kv_in_trace(fr) == 0
    assert _bytes_by_rule(fr, "kv_cache_in_training") == (TRAINING[name], {"activation"})
    assert _bytes_by_rule(fr, RULE)[0] == 0


def _ratios(fr) -> list[float]:
    """Growth of the rest of the memory per byte of cache, per forward, before any relabelling
    (the cache: kv_cache, or activation by one of the two KV rules)."""
    result = categorize(fr)
    rules = result.alloc_rules[0]
    cache = (result.alloc_codes[0] == CODES["kv_cache"]) | np.isin(
        rules, [RULES.index(RULE), RULES.index("kv_cache_in_training")]
    )
    return [ratio for _, ratio in forward_growth(device_lifetimes(fr, 0), cache) if not math.isnan(ratio)]


def test_the_threshold_lies_far_from_both_sides(real_frames):
    """Measured growth per byte of cache: every forward with grad above 4.5 (Lightning's GPT-2,
    the lowest), every inference forward below 0.15 (inf_flush_python's prefills, the highest):
    the threshold of 1 has a factor of more than four of room on each side."""
    with_grad = [r for name in [*GRAD_FORWARDS, *TRAINING] for r in _ratios(real_frames(name))]
    inference = [r for name in GENERATION for r in _ratios(real_frames(name))]
    assert min(with_grad) > 4.5 > 4 * SAVED_PER_CACHE_BYTE
    assert max(inference) < 0.15 < SAVED_PER_CACHE_BYTE / 4
    assert len(inference) == 3 * 64 + 1 + 8  # 64 forwards of generate x 3, 3 same-sized batches, 8 prefills


def test_the_stacks_cannot_tell(real_frames):
    """Why not a stack rule: the inference forwards under ``with torch.no_grad()`` show no
    ``generate`` and no decorator on any stack, as the OOM's training forward; and the forward with
    grad of deep_llama_forward_all shows torch's ``no_grad`` decorator (its rotary embedding)."""
    for name in ("deep_inference_python", "inf_flush_python", "fit_gpt2_b32_oom_python"):
        assert not stacks_with_frame(real_frames(name), "generate")
    assert not stacks_with_frame(real_frames("deep_inference_python"), "decorate_context")
    assert stacks_with_frame(real_frames("deep_llama_forward_all"), "decorate_context")
    assert stacks_with_frame(real_frames("inf_llama_late_python"), "generate")
