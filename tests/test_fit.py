"""snaplab fit (issue #20): what makes a job fit, predicted from one snapshot, against real
H100 runs of two families (``sample_snapshots/fit_truth.json``, from
``sample_snapshots/workloads_fit.py``: GPT-2 from a config with AdamW, torchvision's ResNet-50
with SGD momentum; every batch of a list spanning 16x under four levers, and the largest batch
whose two whole steps ran under a 6 GiB per-process cap).

The rules are the same for both families; nothing is fitted to a recording.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from snapshot_lab import api, cli
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_BAD_INPUT, EXIT_USAGE
from snapshot_lab.metrics.allocator_model import AllocatorSettings
from snapshot_lab.metrics.fit import compute_fit, predict_step
from snapshot_lab.metrics.fit.evidence import BlockSpan
from snapshot_lab.metrics.fit.levers import checkpoint
from snapshot_lab.metrics.fit.search import largest_batch
from snapshot_lab.metrics.fit.tape import NEVER, make_tape, peak_allocated, simulate
from snapshot_lab.render.fit import format_fit

from .conftest import SAMPLES, sample_path

runner = CliRunner()
TRUTH = json.loads((SAMPLES / "fit_truth.json").read_text())
CAP = TRUTH["cap_bytes"]
LEVERS = {"plain": (False, False), "ckpt": (True, False), "bf16": (False, True), "ckpt+bf16": (True, True)}
OUR_NAMES = {"plain": "as recorded", "ckpt": "checkpointing", "bf16": "bf16", "ckpt+bf16": "checkpointing+bf16"}
COMPLETE = {"gpt2": ("fit_gpt2_b4_complete_python", 4, None), "resnet50": ("fit_resnet50_b16_complete_python", 16, None)}
OOM = {"gpt2": ("fit_gpt2_b32_oom_python", 32, "adamw")}
MiB = 1 << 20


def _cases(snapshots: dict[str, tuple[str, int, str | None]]) -> list[tuple[str, str, str, int]]:
    out = []
    for family, (name, _, _) in snapshots.items():
        for lever in LEVERS:
            for batch, measured in TRUTH["families"][family]["levers"][lever]["uncapped"].items():
                if measured.get("ok"):
                    out.append((family, name, lever, int(batch)))
    return out


# --------------------------------------------------------------------------- unit: the tape


def _tape():
    """Parameters (100), a forward of two blocks saving 10 per sample each, its backward, a step."""
    return make_tape(
        start=np.array([0, 1, 2, 3, 4, 9, 10]),
        end=np.array([NEVER, 8, 7, 6, 5, NEVER, 11]),
        fixed=np.array([100, 0, 0, 0, 0, 100, 50]),
        per_batch=np.array([0, 10, 10, 10, 10, 0, 0]),
        category=np.array(["parameter", "activation", "activation", "activation", "activation", "gradient", "x"]),
        phase=np.array(["setup", "forward", "forward", "forward", "backward", "step", "step"]),
        block=np.array([-1, 0, 0, 1, -1, -1, -1]),
    )


def test_the_peak_allocated_follows_the_batch():
    t = _tape()
    assert peak_allocated(t, 1.0) == 5 * 512  # five blocks of 512 bytes, the smallest the allocator makes
    big = make_tape(np.array([0, 1]), np.array([NEVER, 2]), np.array([1 << 20, 0]), np.array([0, 1 << 20]), "a")
    assert peak_allocated(big, 3.0) == 4 << 20
    assert simulate(big, 3.0, AllocatorSettings()).peak_allocated_bytes == 4 << 20


def test_checkpointing_keeps_the_blocks_output_and_recomputes_the_rest():
    mib = 1 << 20
    t = make_tape(
        start=np.array([0, 1, 2, 3, 10]),
        end=np.array([NEVER, 20, 21, 11, 12]),
        fixed=np.zeros(5),
        per_batch=np.array([0, 8, 8, 8, 1]) * mib,
        category="activation",
        phase=np.array(["setup", "forward", "forward", "forward", "backward"]),
        block=np.array([-1, 0, 0, 0, -1]),
    )
    block = BlockSpan(0, 0, 1.0, 3.0, 19.5, 21.0, 0)
    ck = checkpoint(t, (block,))
    assert peak_allocated(t, 1.0) == 25 * mib  # three saved tensors and the backward's first
    # the output (the first saved tensor the backward frees) is kept; the two others go when the
    # block's forward ends and are made again just before its backward
    assert peak_allocated(ck, 1.0) == 24 * mib
    assert len(ck) == len(t) + 2
    again = ck.select(np.arange(len(ck)) >= len(t))
    assert (again.start >= 19).all() and (again.start < 19.5).all()
    assert list(again.end) == [20.0, 21.0]


def test_largest_batch_is_the_last_that_fits():
    mib = 1 << 20
    t = make_tape(np.array([0, 1]), np.array([NEVER, 2]), np.array([64 * mib, 0]), np.array([0, 32 * mib]), "a")
    # 64 MiB fixed + 8 MiB per sample (recorded batch 4): 256 MiB fits 24 samples
    assert largest_batch(t, 4, AllocatorSettings(), 256 * mib) == 24


# --------------------------------------------------------------------------- real: accuracy


@pytest.mark.parametrize(("family", "name", "lever", "batch"), _cases(COMPLETE))
def test_whole_step_from_a_complete_recording_within_10_percent(real_frames, family, name, lever, batch):
    recorded = COMPLETE[family][1]
    ckpt, bf16 = LEVERS[lever]
    allocated, _ = predict_step(real_frames(name), batch_scale=batch / recorded, checkpointing=ckpt, bf16=bf16)
    measured = TRUTH["families"][family]["levers"][lever]["uncapped"][str(batch)]["peak_allocated_bytes"]
    assert abs(allocated / measured - 1) <= 0.10


@pytest.mark.parametrize(("family", "name", "lever", "batch"), _cases(OOM))
def test_whole_step_from_an_oom_in_the_first_forward_within_15_percent(real_frames, family, name, lever, batch):
    _, recorded, optimizer = OOM[family]
    ckpt, bf16 = LEVERS[lever]
    frames = real_frames(name)
    allocated, _ = predict_step(frames, batch_scale=batch / recorded, checkpointing=ckpt, bf16=bf16, optimizer=optimizer)
    measured = TRUTH["families"][family]["levers"][lever]["uncapped"][str(batch)]["peak_allocated_bytes"]
    assert abs(allocated / measured - 1) <= 0.15
