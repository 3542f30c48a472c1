"""snaplab fit on a run that ran out of memory after its first whole step (``fit/steady.py``).

Recorded after the rule for the first forward's OOMs, with every fit rule as it stood
(``sample_snapshots/workloads_fit.py``, group ``fit_late_oom``): six families as recorded, under
the 6 GiB cap, at one more than the largest batch that ran. Each finished its first step and ran
out in its second: GPT-2, BERT, ViT-B/16, GPT-NeoX and OPT in their second backward, Llama in its
second forward. The first step makes AdamW's state after its backward; the second runs with it.

Taken as recorded, the cut pass's tensors (never freed) were taken for memory that does not grow
with the batch. Every one was told its batch fits ("1x the recorded batch as is") and that bf16
fits none ("0x"; with checkpointing 0.08x to 1.37x). Now the trace is cut after the whole step
and its pass runs again with the state alive, as the next step does. The largest batches are
those of the tables of complete recordings, and the real ones within one.

The capped boundary runs of an earlier session (``fit_*_ckpt_capped_python``, out after their
first step too) are the hold-out for the steady pass. ResNet-50 at 163 (it ran at 162, and failed
here in its second step) was told 163 fits; now 158 (``test_resnet_at_its_boundary``).
"""

from __future__ import annotations

import json

import pytest

from snapshot_lab.metrics.fit import compute_fit, predict_step
from snapshot_lab.metrics.fit.steady import STEADY_NOTE

from .conftest import SAMPLES

FAMILIES = json.loads((SAMPLES / "fit_truth.json").read_text())["families"]
CAP = 6 << 30
# recording -> (family, recorded batch, largest batches predicted: as recorded, checkpointing, bf16, both)
LATE = {
    "fit_gpt2_b4_late_oom_python": ("gpt2", 4, (3, 28, 5, 29)),
    "fit_bert_b10_late_oom_python": ("bert", 10, (9, 21, 12, 19)),
    "fit_llama_b7_late_oom_python": ("llama", 7, (6, 16, 8, 16)),
    "fit_vit_b39_late_oom_python": ("vit", 39, (38, 197, 65, 265)),
    "fit_neox_b8_late_oom_python": ("neox", 8, (7, 31, 9, 32)),
    "fit_opt_b9_late_oom_python": ("opt", 9, (8, 27, 12, 33)),
}
# the real runs: GPT-2 3, 27, 5, 28; BERT 9, 20, 10, 20; Llama 6, 17, 8, 16; ViT 38, 232, 71, 327;
# NeoX 7, 30, 9, 32; OPT 8, 28, 11, 32: as recorded exact in all six, 11 of 24 exact in all (NeoX's bf16
# since its float32 KV cache and the attention's bfloat16 copies of it are modelled: 10 before)
LEVERS = {"plain": "as recorded", "ckpt": "checkpointing", "bf16": "bf16", "ckpt+bf16": "checkpointing+bf16"}


@pytest.fixture(scope="module")
def fits(real_frames):
    return {
        name: compute_fit(real_frames(name), memory_limit=CAP, recorded_batch=batch, parallel=False)
        for name, (_, batch, _) in LATE.items()
    }


@pytest.mark.parametrize("name", list(LATE))
def test_the_step_that_ran_out_is_modelled(fits, name):
    fit = fits[name]
    assert STEADY_NOTE.format(failed=2, done=1) in fit.notes
    assert fit.workload == "training step"
    # the recorded batch is the one that failed: it does not fit
    assert fit.largest_batch["as recorded"] < LATE[name][1]


@pytest.mark.parametrize("name", list(LATE))
def test_largest_batches_against_the_real_runs(fits, name):
    family, _, expected = LATE[name]
    fit = fits[name]
    got = tuple(int(fit.largest_batch[ours]) for ours in LEVERS.values())
    assert got == expected
    real = tuple(FAMILIES[family]["levers"][lever]["largest_batch_under_cap"] for lever in LEVERS)
    # as recorded exact; every lever within 20% (BERT's bf16 12 / 10, ViT's 197 / 232 and 265 / 327, as
    # from their complete recordings)
    assert got[0] == real[0], (got, real)
    assert all(abs(g - r) <= max(1, 0.2 * r) for g, r in zip(got, real, strict=True)), (got, real)


@pytest.mark.parametrize("name", list(LATE))
def test_whole_step_against_the_real_runs(real_frames, name):
    """Every lever and measured batch within 10%, as from a complete recording (NeoX under bf16 at
    16 -11.1%, as from its complete recording: its own casts, ``test_fit_holdout_late.OUTSIDE``)."""
    family, batch, _ = LATE[name]
    frames = real_frames(name)
    for lever, ours in LEVERS.items():
        for measured_batch, run in FAMILIES[family]["levers"][lever]["uncapped"].items():
            if not run["ok"]:
                continue
            allocated, _ = predict_step(
                frames, batch_scale=int(measured_batch) / batch, checkpointing="ckpt" in lever, bf16="bf16" in lever
            )
            error = allocated / run["peak_process_bytes"] - 1
            bound = 0.12 if (family, lever) == ("neox", "bf16") else 0.10
            assert abs(error) <= bound, (ours, measured_batch, f"{error:+.1%}")


def test_resnet_at_its_boundary(real_frames):
    """The hold-out: ResNet-50 with checkpointing under the cap ran both steps at 162 (cuDNN caught
    37 out-of-memory errors on its workspaces, ``oom-recovered``) and ran out in its second step at
    163. The caught errors end no step: 162 is answered from its steps as recorded (162); 163 from
    its first step and that pass again (158, where it said 163 before)."""
    ran, failed = (
        compute_fit(
            real_frames(f"fit_resnet50_b{batch}_ckpt_capped_python"),
            memory_limit=CAP,
            recorded_batch=batch,
            parallel=False,
            levers=("as recorded",),
        )
        for batch in (162, 163)
    )
    assert not any("ran out of memory in its step" in n for n in ran.notes)
    assert ran.largest_batch["as recorded"] == 162
    assert STEADY_NOTE.format(failed=2, done=1) in failed.notes
    assert failed.largest_batch["as recorded"] == 158
