"""A step recorded with activation checkpointing gets no checkpointing lever (issue #20): fit
applied it again, and told a GPT-2 whose blocks were checkpointed already that checkpointing
nearly doubles its peak (1.86 -> 3.65 GiB). The checkpointing function on the stacks says so
(evidence.checkpointing_in_stacks).

The rule is held to every sample: it must name exactly those recorded with checkpointing, and
they are of three kinds, each of which a simpler rule would miss: torch.utils.checkpoint called
by the training script (ResNet-50, ConvNeXt, ViT: ``fit_*_ckpt_*``), by transformers'
gradient_checkpointing_enable (GPT-2, Llama, T5), and recorded with C++ frames
(``grad_ckpt_all``, ``modtags_llama_ckpt_all``): "a module named like a checkpoint wrapper" or
"transformers' own checkpointing" each finds one kind only.
"""

from __future__ import annotations

import re

import pytest

from snapshot_lab.metrics.fit import compute_fit
from snapshot_lab.metrics.fit.evidence import checkpointing_in_stacks
from snapshot_lab.metrics.fit.model import CHECKPOINTED_NOTE, NO_CHECKPOINTING_AGAIN, FitUnsupported
from snapshot_lab.metrics.fit.result import predict_step

from .conftest import SAMPLES, sample_truth

CHECKPOINTED_LEVERS = ("checkpointing", "checkpointing+bf16")


def _names() -> list[str]:
    return sorted(p.name.split(".pickle")[0] for p in SAMPLES.glob("*.pickle*"))


def _recorded_with_checkpointing(name: str) -> bool:
    return "_ckpt" in name  # the workloads' names say it (workloads.py, workloads_fit.py, the module-tags runs)


def test_exactly_the_checkpointed_recordings_are_found(real_frames):
    found = [n for n in _names() if checkpointing_in_stacks(real_frames(n))]
    assert found == [n for n in _names() if _recorded_with_checkpointing(n)]
    assert len(found) == 76  # 63 fit lever recordings, 8 capped boundary runs, an OOM, 4 others
    assert {"grad_ckpt_all", "grad_ckpt_python", "modtags_llama_ckpt_all"} <= set(found)


@pytest.mark.parametrize(
    "name, off_by",
    [
        ("fit_gpt2_b4_ckpt_complete_python", 524_288),  # transformers' checkpointing
        ("fit_resnet50_b16_ckpt_complete_python", 0),  # torch.utils.checkpoint from the script
    ],
)
def test_a_checkpointed_step_gets_no_checkpointing_lever(real_frames, name, off_by):
    frames = real_frames(name)
    r = compute_fit(frames, memory_limit=6 << 30)
    levers = [o.lever for o in r.levers]
    assert "as recorded" in levers and "bf16" in levers
    assert not set(CHECKPOINTED_LEVERS) & set(levers)
    assert not set(CHECKPOINTED_LEVERS) & set(r.largest_batch)
    assert CHECKPOINTED_NOTE in r.notes
    # the step as recorded: torch's peak allocated (GPT-2's one 512 KiB block above it)
    assert r.peak_allocated_bytes - sample_truth(name)["memory_stats"]["0"]["allocated_bytes.all.peak"] == off_by
    with pytest.raises(FitUnsupported, match=re.escape(NO_CHECKPOINTING_AGAIN)):
        predict_step(frames, checkpointing=True)


def test_an_uncheckpointed_step_keeps_its_checkpointing_lever(real_frames):
    r = compute_fit(real_frames("fit_gpt2_b4_complete_python"), memory_limit=6 << 30)
    assert {"checkpointing", "checkpointing+bf16"} <= {o.lever for o in r.levers}
    assert CHECKPOINTED_NOTE not in r.notes


def test_a_checkpointed_job_runs_out_inside_its_first_block(real_frames):
    """Where a checkpointed job runs out of memory in its first forward: GPT-2 with checkpointing
    at batch 128 under 6 GiB keeps only each block's input (384 MiB), and runs out inside the
    first block, on its MLP's 1.5 GiB (a block's own tensors are alive while it runs). No block
    completed, so fit refuses, saying why, rather than extrapolating a step from blocks it never
    saw; at batch 256 it ran out there too."""
    from snapshot_lab.metrics.fit.evidence import checkpointing_in_stacks

    frames = real_frames("fit_gpt2_b128_ckpt_oom_python")
    assert checkpointing_in_stacks(frames)
    ooms = frames.events[frames.events["action"] == "oom"]
    assert ooms["size_bytes"].tolist() == [128 * 1024 * 3072 * 4]
    with pytest.raises(FitUnsupported, match="before its first repeated block completed"):
        compute_fit(frames, memory_limit=6 << 30)
