"""snaplab fit on a family it was never tuned on: torchvision's ViT-B/16 with AdamW, recorded on the
H100 after the fit model was written (``sample_snapshots/workloads_fit.py``, family ``vit``;
truth in ``sample_snapshots/fit_truth.json``). GPT-2 and ResNet-50 (``tests/test_fit.py``) are what
the rules were built against; an encoder with a patch embedding, a class token and no repeated
``h.N``/``layerN`` naming of GPT-2's kind is what they must also get right.

The same bounds as the issue asks of the two families: the whole step's peak allocated within 10%
from the complete snapshot and within 15% from the one that ran out of memory in its first forward.
The later rules that make the step extrapolated from an OOM follow the recorded one (docs/fit.md)
were checked on ViT as on the two others: for them it is a third family, not a hold-out.
"""

from __future__ import annotations

import json

import pytest

from snapshot_lab.metrics.fit import compute_fit, predict_step

from .conftest import SAMPLES
from .fit_known_misses import TALLIES, check_tally, tally

TRUTH = json.loads((SAMPLES / "fit_truth.json").read_text())["families"]["vit"]["levers"]
CAP = 6 << 30
LEVERS = {"plain": (False, False), "ckpt": (True, False), "bf16": (False, True), "ckpt+bf16": (True, True)}
OUR_NAMES = {"plain": "as recorded", "ckpt": "checkpointing", "bf16": "bf16", "ckpt+bf16": "checkpointing+bf16"}
SNAPSHOTS = {  # name -> (recorded batch, optimizer assumed for the part of the step never reached, bound)
    "fit_vit_b8_complete_python": (8, None, 0.10),
    "fit_vit_b128_oom_python": (128, "adamw", 0.15),
}


def _cases() -> list[tuple[str, str, int]]:
    return [
        (name, lever, int(batch))
        for name in SNAPSHOTS
        for lever in LEVERS
        for batch, measured in TRUTH[lever]["uncapped"].items()
        if measured["ok"]
    ]


@pytest.mark.parametrize(("name", "lever", "batch"), _cases())
def test_whole_step_peak_allocated_on_a_family_never_tuned_on(real_frames, name, lever, batch):
    recorded, optimizer, bound = SNAPSHOTS[name]
    ckpt, bf16 = LEVERS[lever]
    extra = {"optimizer": optimizer} if optimizer else {}
    allocated, _ = predict_step(real_frames(name), batch_scale=batch / recorded, checkpointing=ckpt, bf16=bf16, **extra)
    measured = TRUTH[lever]["uncapped"][str(batch)]["peak_process_bytes"]
    assert abs(allocated / measured - 1) <= bound, (allocated, measured)


@pytest.fixture(scope="module")
def under_the_cap(real_frames):
    out = {}
    for name, (recorded, optimizer, _) in SNAPSHOTS.items():
        out[name] = compute_fit(real_frames(name), memory_limit=CAP, recorded_batch=recorded, optimizer=optimizer)
    return out


@pytest.mark.parametrize("lever", list(LEVERS))
@pytest.mark.parametrize("name", list(SNAPSHOTS))
def test_largest_batch_under_the_cap_near_the_real_runs(under_the_cap, name, lever):
    """Within 40% (or one batch) in every case since the fit replay places segments top-down and
    frees saved tensors after the next gradient (the OOM snapshot's checkpointing+bf16 went from
    481 to 436 where 327 ran), and 325 since the extrapolated step follows the recorded one (a
    block's tail copied with it, saved inputs freed with their gradient) and bf16 casts the norms'
    outputs (docs/fit.md)."""
    predicted = under_the_cap[name].largest_batch[OUR_NAMES[lever]]
    measured = TRUTH[lever]["largest_batch_under_cap"]
    assert predicted is not None
    assert abs(predicted - measured) <= max(1, 0.4 * measured), (predicted, measured)


def test_the_largest_batch_tables_counts(under_the_cap):
    """ViT's rows of docs/fit.md's table: exact, within one, the real run in the range."""
    rows = [
        (fit.largest_batch_no_retry.get(ours), fit.largest_batch[ours], real, fit.largest_batch_at_most[ours])
        for fit in under_the_cap.values()
        for lever in LEVERS
        for real, ours in [(TRUTH[lever]["largest_batch_under_cap"], OUR_NAMES[lever])]
    ]
    check_tally(tally(rows), TALLIES["tests/test_fit_holdout.py"], "ViT-B/16")


def _outputs_kept_at_the_first_block_backward(frames, recorded: int, optimizer: str | None) -> int:
    import numpy as np

    from snapshot_lab.metrics.fit.evidence import BLOCK_UID_STRIDE
    from snapshot_lab.metrics.fit.levers import checkpoint
    from snapshot_lab.metrics.fit.model import step_evidence

    ev = step_evidence(frames, 0, optimizer)
    tape = checkpoint(ev.tape, ev.blocks)
    last = max(ev.blocks, key=lambda b: (b.uid // BLOCK_UID_STRIDE, b.index))  # the second pass's last block
    at = last.backward_start - 0.5
    stream = 197 * 768 * 4  # tokens x width x float32, per sample
    alive = (tape.start < at) & (tape.end > at) & (tape.phase == "forward")
    return int((alive & np.isclose(tape.per_batch / recorded, stream)).sum())


def test_checkpointing_keeps_every_blocks_output_as_the_recorded_step(real_frames):
    """Under checkpointing, the recorded step holds the twelve checkpoints (the embedding's output and
    the first eleven blocks' outputs) when the last block's backward begins, and so does the step
    extrapolated from the OOM. The simpler rule (a block ends at its last submodule call) dropped
    ViT's residual add, the block's output, from the extrapolated forward: it held one, and the
    OOM's checkpointing+bf16 answer was 436 where 327 ran."""
    assert _outputs_kept_at_the_first_block_backward(real_frames("fit_vit_b8_complete_python"), 8, None) == 12
    assert _outputs_kept_at_the_first_block_backward(real_frames("fit_vit_b128_oom_python"), 128, "adamw") == 12


@pytest.mark.parametrize("lever", list(LEVERS))
def test_the_step_from_the_oom_grows_per_sample_as_the_complete_recordings(real_frames, lever):
    """Between half the real largest batch and it, the peak allocated of the step extrapolated from
    the OOM (batch 128) grows per sample as that of the complete recording (batch 8): within 1%
    under every lever (-0.3, -0.1, +0.1, -0.2%). The simpler extrapolation (blocks cut at their last
    submodule call, so no block output kept under checkpointing; saved tensors freed one gradient
    late) was off by -4.0, -18.8, -8.3 and -35.8%."""
    from snapshot_lab.metrics.fit.model import step_evidence
    from snapshot_lab.metrics.fit.result import requested_tape
    from snapshot_lab.metrics.fit.search import PeakCurve

    real = TRUTH[lever]["largest_batch_under_cap"]
    growth = []
    for name, (recorded, optimizer, _) in SNAPSHOTS.items():
        curve = PeakCurve(requested_tape(step_evidence(real_frames(name), 0, optimizer), *LEVERS[lever]))
        growth.append(curve.peak(real / recorded) - curve.peak(real / 2 / recorded))
    assert abs(growth[1] / growth[0] - 1) <= 0.01, growth


def test_largest_batch_from_the_oom_with_bf16_near_the_real_run(under_the_cap):
    """67 where 71 ran. It was 71 (67 before bf16 cast each layer norm's output for the linear layer
    after it rather than the norm's statistics), but without two things every recording shows:
    the bfloat16 copies of the weights (no creation stack names a Linear in a model moved with
    ``.to("cuda")``; ViT's bf16 recording ``fit_vit_b8_bf16_complete_python`` has a copy of every
    matrix, 165 MiB) and the backward's own cuBLAS workspace (32 MiB, beside the forward's). With
    them the peak allocated is within 3% at every batch; the exact 71 had them missing, standing
    in for an error elsewhere."""
    predicted = under_the_cap["fit_vit_b128_oom_python"].largest_batch["bf16"]
    assert predicted == 67
    assert abs(predicted - TRUTH["bf16"]["largest_batch_under_cap"]) <= 0.1 * TRUTH["bf16"]["largest_batch_under_cap"]
