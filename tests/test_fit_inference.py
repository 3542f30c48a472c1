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
