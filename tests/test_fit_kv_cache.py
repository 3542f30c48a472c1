"""fit's breakdown names the KV cache alive at the step's peak, a part of the activations
(issue #20): for inference the first thing to shrink (a shorter context, a smaller batch)."""

from __future__ import annotations

import pytest

from snapshot_lab.metrics.fit import compute_fit
from snapshot_lab.render.fit import format_fit

from .conftest import sample_truth

MIB = 1 << 20


@pytest.mark.parametrize("name", ["inf_llama_start_python", "inf_llama_late_python"])
def test_inference_kv_cache_at_the_peak_is_what_the_cache_held(real_frames, name):
    """generate() on an fp16 Llama: the peak comes at the end of the prefill (its activations and
    logits for 1024 tokens), when every layer's keys and values are made and before the first
    new token: the cache then held what the job measured after its first forward."""
    r = compute_fit(real_frames(name))
    measured = sample_truth(name)["workload"]["kv_cache_bytes_after_each_forward"][0]
    assert r.breakdown["kv_cache_at_peak_bytes"] == measured == 768 * MIB
    assert r.breakdown["kv_cache_at_peak_bytes"] < r.breakdown["activations_at_recorded_batch_bytes"]
    text = format_fit(r)
    assert "kv cache at peak: 768.00 MiB" in text
    assert "KV cache ≈ 1.17 GiB at the recorded batch, the KV cache 0.75 GiB of it at the peak" in text


def test_a_training_step_that_fills_a_cache_shows_it(real_frames):
    """GPT-2 in training keeps transformers' cache on (use_cache): 12 layers' keys and values for
    4 x 1024 tokens of width 768 in float32 (workloads_fit.py's config) are alive at the peak."""
    r = compute_fit(real_frames("fit_gpt2_b4_complete_python"), recorded_batch=4)
    assert r.breakdown["kv_cache_at_peak_bytes"] == 12 * 2 * 4 * 1024 * 768 * 4


@pytest.mark.parametrize("name", ["fit_resnet50_b16_complete_python", "fit_llama_b2_complete_python"])
def test_no_cache_no_line(real_frames, name):
    """A CNN has no cache; transformers' Llama in training makes none (no cache_utils frame)."""
    r = compute_fit(real_frames(name))
    assert "kv_cache_at_peak_bytes" not in r.breakdown
    assert "kv cache" not in format_fit(r)
