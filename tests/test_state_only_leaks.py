"""Issue #19, part 5: a leak in a state-only snapshot (a legacy recording: no trace, a stack per
block). Many same-size live activations from one allocation path, far more than one forward
pass keeps, is a leak signal one snapshot can give; it is reported with a lower confidence than
a trace's growth per iteration, and stays silent on every real sample that has no leak."""

from __future__ import annotations

import pytest

from snapshot_lab import load_frames
from snapshot_lab.metrics import compute_stats
from snapshot_lab.metrics.diagnose import diagnose
from snapshot_lab.metrics.leaks import STATE_CONFIDENCE, STATE_SOURCE, find_leaks, state_only_suspects

from .conftest import block, make_snapshot, sample_names, sample_truth, segment

MiB = 1 << 20
MODULE = {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py", "line": 1790, "name": "_call_impl"}
HOOKED = [
    {"filename": "/job/model.py", "line": 41, "name": "forward"},
    MODULE,
    {"filename": "/job/serve.py", "line": 12, "name": "answer"},
]
PARAM = [
    {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/linear.py", "line": 106, "name": "__init__"},
    {"filename": "/job/model.py", "line": 10, "name": "__init__"},
]
LAYER = [{"filename": "/job/model.py", "line": 55, "name": "forward"}, MODULE]


def _state_only(kept: int, params: int = 300, layer_outputs: int = 24) -> dict:
    """``kept`` outputs of 2.5 MiB from one line (a forward hook that stores them), ``params``
    weights of the same size from one constructor line, and one forward's worth of outputs."""
    blocks = [block(5 * MiB // 2, frames=HOOKED) for _ in range(kept)]
    blocks += [block(5 * MiB // 2, frames=PARAM) for _ in range(params)]
    blocks += [block(5 * MiB // 2, frames=LAYER) for _ in range(layer_outputs)]
    segments = [segment((i + 1) << 32, blocks[i : i + 64]) for i in range(0, len(blocks), 64)]
    return make_snapshot(segments, [[]])


def test_a_hook_that_keeps_every_output_is_a_suspect(snap_file):
    fr = load_frames(snap_file(_state_only(1241)))
    la = find_leaks(fr, 0)
    assert la.iteration_source == STATE_SOURCE
    (suspect,) = la.suspects
    assert suspect.count == 1241 and suspect.bytes == 1241 * 5 * MiB // 2
    assert "model.py:41" in suspect.site or "serve.py:12" in suspect.site
    assert suspect.confidence == STATE_CONFIDENCE < 0.5
    findings = diagnose(fr, compute_stats(fr), False).findings
    (leak,) = [f for f in findings if f.id == "leak-suspect"]
    assert "1,241 live blocks of 2.50 MiB" in leak.title and "no-trace" in {f.id for f in findings}
    assert leak.evidence["confidence"] == STATE_CONFIDENCE and "register_forward_hook" in leak.advice


def test_one_forward_and_the_parameters_are_not_a_leak(snap_file):
    """The parameters (300 of one size from one line) are not activations; 24 layer outputs
    are what one forward keeps."""
    fr = load_frames(snap_file(_state_only(0, params=1000, layer_outputs=200)))
    assert not find_leaks(fr, 0).suspects


@pytest.mark.parametrize("name", sample_names())
def test_silent_on_real_samples_without_a_leak(real_frames, name):
    """Read as if they had no trace, the live blocks of every real recording whose job does not
    leak raise no suspect (the deepest: one forward through 32 layers keeps 226 blocks of one
    size, from one line of the job, spread over many allocation paths)."""
    expect = sample_truth(name)["workload"].get("expect", {})
    if expect.get("leak"):
        pytest.skip("a recording of a leak")
    fr = real_frames(name)
    for dev in fr.info.devices:
        assert not state_only_suspects(fr, dev), (name, dev)


def test_leaks_text_of_a_state_only_suspect(snap_file):
    """``snaplab leaks`` on a state-only snapshot says what the site holds, never "0 iterations"
    or "grows by 0 B per iteration"."""
    from typer.testing import CliRunner

    from snapshot_lab.cli import app

    result = CliRunner().invoke(app, ["leaks", str(snap_file(_state_only(1241)))])
    assert result.exit_code == 0, result.output
    assert "0 iterations" not in result.output and "per iteration" not in result.output
    assert "1,241" in result.output and "3.03 GiB" in result.output and "0.40" in result.output
