"""What "the largest batch under the cap" is, in real runs (issue #20): the table's
(``fit_truth.json``) was searched in one process, try after try; each family's largest batch
with checkpointing and one more were run again, each in a fresh process with memory history
(``workloads_fit.py``, group ``fit_boundary``, on the same kind of H100).

The boundary moves with the process's history: GPT-2 at 27, ViT-B/16 at 232 and ConvNeXt-Tiny
at 194, the table's largest batches, each ran out of memory in a fresh process after its first
step; ResNet-50 ran at 162 and failed at 163 in both, its cuDNN convolutions catching 37 and 84
out-of-memory errors on their workspaces on the way. An answer "exactly right" is exact against
one history; docs/fit.md says so beside its tables.
"""

from __future__ import annotations

import json

import pytest

from .conftest import SAMPLES, sample_truth

# family: (lever, the table's largest batch, steps done at it in a fresh process, at one more)
BOUNDARY = {
    "gpt2": ("ckpt", 27, 1, 1),
    "vit": ("ckpt", 232, 1, 1),
    "convnext": ("ckpt", 194, 1, 0),
    "resnet50": ("ckpt", 162, 2, 1),
}


@pytest.mark.parametrize("family", BOUNDARY)
def test_the_largest_batch_depends_on_the_processs_history(family):
    lever, largest, at, above = BOUNDARY[family]
    table = json.loads((SAMPLES / "fit_truth.json").read_text())["families"][family]["levers"][lever]
    assert table["largest_batch_under_cap"] == largest
    assert table["cap_tries"][str(largest)]["ok"] and not table["cap_tries"][str(largest + 1)]["ok"]
    for batch, steps in ((largest, at), (largest + 1, above)):
        work = sample_truth(f"fit_{family}_b{batch}_{lever}_capped_python")["workload"]
        assert (work["batch"], work["cap_bytes"], work["steps_done"]) == (batch, 6 << 30, steps)
        assert ("oom" in work) is (steps < 2)  # two whole steps ran, or an OOM ended it
    fresh_largest_runs = at == 2
    assert fresh_largest_runs is (family == "resnet50")
