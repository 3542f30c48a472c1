"""Under bf16 autocast a softmax stays float32 and saves its result; the matrix multiply that reads
it (the probabilities times the values) saves a bfloat16 copy of it as well (``levers.
_saved_result_casts``). In a float32 run the multiply saves the same tensor and the cast (BLOOM's
``.to(value.dtype)``, eager attention's ``.to(query.dtype)``) allocates nothing, so the float32
recording cannot show the copy.

Found on BLOOM and Swin-T (2026-11-27, second session): their bf16 was -12.5% and -13.4% (Swin's
softmax was also taken for a layer's float32 input, which goes once the layer has its copy: the
simpler rule). Checked on GPT-2 and Llama with transformers' eager attention, recorded after the
rule as its hold-outs: without it their bf16 was -32% and -19.5%, largest batches 4 where 2 ran and
7 where 6 ran (a user told them would run out of memory)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from snapshot_lab.metrics.fit import compute_fit, predict_step
from snapshot_lab.metrics.fit import evidence as ev_module
from snapshot_lab.metrics.fit.evidence import AUTOCAST_SAVED_FP32, allocation_codes, stack_innermost
from snapshot_lab.metrics.plan.structure import training_structure

from .conftest import SAMPLES, unmemoised

FAMILIES = json.loads((SAMPLES / "fit_truth.json").read_text())["families"]
RECORDED = {  # family -> (complete recording, its batch)
    "bloom": ("fit_bloom_b2_complete_python", 2),
    "swin": ("fit_swin_b16_complete_python", 16),
    "gpt2eager": ("fit_gpt2eager_b4_complete_python", 4),
    "llamaeager": ("fit_llamaeager_b2_complete_python", 2),
}


def _bf16_errors(frames, family: str, recorded_batch: int) -> list[float]:
    out = []
    for batch, run in FAMILIES[family]["levers"]["bf16"]["uncapped"].items():
        allocated, _ = predict_step(frames, batch_scale=int(batch) / recorded_batch, bf16=True)
        out.append(allocated / run["peak_process_bytes"] - 1)
    return out


def _kept_after_softmax(frames) -> tuple[int, int]:
    """In the first forward: softmax results kept into the backward, and tensors half their size
    made right after them and kept too."""
    s = training_structure(frames, 0)
    a = s.allocs
    pos, free, size = a["pos"].to_numpy(), a["free_pos"].to_numpy(), a["size"].to_numpy()
    names = stack_innermost(frames)["name"].reindex(a["sid"].to_numpy()).to_numpy()
    order = np.argsort(pos, kind="stable")
    backward = s.passes[0].backward_start
    forward = order[(pos[order] < backward) & (size[order] > 0)]
    kept = (free < 0) | (free >= backward)
    soft = [i for i, r in enumerate(forward[:-1]) if names[r] == "softmax" and kept[r]]
    copies = [i for i in soft if kept[forward[i + 1]] and 2 * size[forward[i + 1]] == size[forward[i]]]
    return len(soft), len(copies)


def test_blooms_bf16_recording_keeps_a_bfloat16_copy_beside_each_softmax(real_frames):
    assert _kept_after_softmax(real_frames("fit_bloom_b2_bf16_complete_python")) == (12, 12)
    assert _kept_after_softmax(real_frames("fit_bloom_b2_complete_python")) == (12, 0)


@pytest.mark.parametrize("family", list(RECORDED))
def test_bf16_with_the_softmax_copies_against_the_real_runs(real_frames, family):
    name, batch = RECORDED[family]
    errors = _bf16_errors(real_frames(name), family, batch)
    assert len(errors) == 5
    assert max(abs(e) for e in errors) < 0.03, errors


@pytest.mark.parametrize(("family", "without"), [("gpt2eager", -0.30), ("llamaeager", -0.15)])
def test_without_the_copies_the_hold_outs_are_far_low(real_frames, monkeypatch, family, without):
    monkeypatch.setattr(ev_module, "SAVED_FP32_OPS", frozenset())
    name, batch = RECORDED[family]
    assert min(_bf16_errors(unmemoised(real_frames(name)), family, batch)) < without


@pytest.mark.parametrize(("family", "largest"), [("gpt2eager", 2), ("llamaeager", 6), ("bloom", 10)])
def test_largest_bf16_batch_under_the_cap_is_the_real_one(real_frames, family, largest):
    name, batch = RECORDED[family]
    fit = compute_fit(real_frames(name), memory_limit=6 << 30, recorded_batch=batch, parallel=False)
    assert fit.largest_batch["bf16"] == largest == FAMILIES[family]["levers"]["bf16"]["largest_batch_under_cap"]


def test_sdpa_attention_makes_no_python_softmax(real_frames):
    """GPT-2 with SDPA (the issue's job) computes its softmax inside the kernel: no copy added."""
    frames = real_frames("fit_gpt2_b4_complete_python")
    assert not (allocation_codes(frames, training_structure(frames, 0)) == AUTOCAST_SAVED_FP32).any()
