"""The optimizer fit names, against what each real recording's job used (its truth's
``workload.optimizer``). torch 2.11's AdamW steps in ``torch/optim/adam.py``, so its file alone
named every AdamW job "adam" (the report said "Adam(W)"); the step's annotation
(``Optimizer.step#AdamW.step``) tells the class. A job that really used Adam keeps "adam": taking
every ``adam.py`` for AdamW (the simpler rule) would name ``late_gpt2_python``'s Adam wrongly."""

from __future__ import annotations

import json

import pytest

from snapshot_lab.metrics.fit.evidence import optimizer_in_stacks

from .conftest import SAMPLES

OURS = {"AdamW": "adamw", "Adam": "adam"}


def _recorded_with(optimizer: str) -> list[str]:
    names = []
    for truth in sorted(SAMPLES.glob("*.truth.json")):
        workload = json.loads(truth.read_text()).get("workload") or {}
        if isinstance(workload, dict) and workload.get("optimizer") == optimizer:
            names.append(truth.name.removesuffix(".truth.json"))
    return names


ADAMW = _recorded_with("AdamW")
ADAM = _recorded_with("Adam")


def test_both_classes_have_real_recordings():
    # Adam: GPT-2 recorded after it was built (both stack modes), VGG-16-BN between its loss and
    # its backward (issue #37, both stack modes)
    assert len(ADAMW) > 100 and len(ADAM) == 4


@pytest.mark.parametrize("name", [*ADAM, *ADAMW[::20]])
def test_adam_and_adamw_are_told_apart(real_frames, name):
    expected = OURS["Adam" if name in ADAM else "AdamW"]
    named = optimizer_in_stacks(real_frames(name))
    if named is None:  # a recording that never reached its step, or an AdamW written by hand (#37)
        pytest.skip("no optimizer on the stacks")
    assert named == expected
