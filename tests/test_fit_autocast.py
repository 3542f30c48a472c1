"""snaplab fit from a step recorded under autocast (issue #20): autocast's weight copies do not
grow with the batch (``fit/weight_copies.py``).

A user's snapshot is as often a bf16 or float16 mixed-precision run (Hugging Face's
``bf16=True``, Lightning's ``"bf16-mixed"``, ``torch.autocast`` by hand) as a float32 one. Those
copies were taken for activations, so every prediction from such a recording at a larger batch
was too high. Before the rule, from each family's recording under bf16 autocast (and with
checkpointing too), against the real runs at 1/4 to 8x the recorded batch:

- bf16: ViT-B/16 +22.0% at 8x, BERT +20.8%, Llama +19.4%, T5 +8.4%, OPT +6.6%, NeoX +5.8%,
  ResNet-50 +5.6%, ConvNeXt-Tiny +4.2%, EfficientNet-B0 +4.0%, GPT-2 +3.3%;
- checkpointing + bf16: ViT +52.4%, Llama +26.6%, T5 +17.8%, OPT +14.6%, GPT-2 +14.5%, NeoX
  +14.2%; largest batches under 6 GiB far too small (ViT 146 where 327 ran, GPT-2 23 for 28,
  OPT 23 for 32, NeoX 24 for 32).

Every family is a hold-out for the rule's parts written on others: the run rule was written on
the float16 MLP and Llama (where the queries are the size of a copy), the weights without a
repeated block on T5, ``nn.MultiheadAttention`` on ViT, the re-run of checkpointed blocks on
GPT-2 and ViT, and the count of distinct sizes on GPT-2 with bfloat16 parameters (which autocast
does not copy, but whose cast layer-norm outputs are half its embedding).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from snapshot_lab.metrics.fit import compute_fit, predict_step
from snapshot_lab.metrics.fit.evidence import forward_weight_copies, phase_column
from snapshot_lab.metrics.fit.weight_copies import weight_sizes
from snapshot_lab.metrics.plan.structure import training_structure

from .conftest import SAMPLES, sample_truth
from .fit_known_misses import BatchMiss, PeakMiss, Tally, check_largest, check_peak, check_tally, tally

FAMILIES = json.loads((SAMPLES / "fit_truth.json").read_text())["families"]
CAP = 6 << 30
BOUND = 0.05
RECORDED = {"gpt2": 4, "resnet50": 16, "vit": 8, "llama": 2, "convnext": 16, "bert": 2, "effnet": 16, "t5": 4}
RECORDED |= {"neox": 4, "opt": 4}
# recorded after the rule, with every rule untouched (2026-11-26, third session): within 0.7% at
# every batch, largest batches 6 / 6 and 30 / 30 (Gemma), 7 / 7 and 32 / 32 (Qwen2)
RECORDED |= {"gemma": 4, "qwen2": 4}
# recorded on 2026-11-27 with every rule untouched (tests/test_fit_holdout_late.py's docstring)
RECORDED |= {"phi": 4, "distilbert": 4, "gpt2m": 2, "resnet18": 32, "resnet101": 16}
RECORDED |= {"mistral": 4, "resnet34": 32, "wrn50": 16}
# recording -> (family, lever its real runs measured); EfficientNet's checkpointed runs crash
# torch 2.11 under memory history, BERT's checkpointing+bf16 recording was not made
RECORDINGS = {
    f"fit_{family}_b{batch}_{tag}_complete_python": (family, lever)
    for family, batch in RECORDED.items()
    for tag, lever in (("bf16", "bf16"), ("ckpt_bf16", "ckpt+bf16"))
    if (SAMPLES / f"fit_{family}_b{batch}_{tag}_complete_python.pickle.xz").exists()
}
_WORKSPACE = (
    "a tensor of the backward at the peak, {mib} MiB at the recorded batch, is taken as growing with it; "
    "the real run at {batch} does not hold {times}x it (a convolution's or attention's backward workspace, "
    "which one recording cannot tell from an activation)"
)
OUTSIDE = {  # (recording, batch) -> the known miss of the peak; (recording, None) -> of the largest batch
    **{
        ("fit_convnext_b16_ckpt_bf16_complete_python", batch): PeakMiss(
            error, _WORKSPACE.format(mib=132, batch=batch, times=batch // 16)
        )
        for batch, error in ((32, +0.0934), (64, +0.1234), (128, +0.1494))
    },
    ("fit_convnext_b16_ckpt_bf16_complete_python", None): BatchMiss(
        188, 296, _WORKSPACE.format(mib=132, batch=296, times=18.5)
    ),
    ("fit_vit_b8_ckpt_bf16_complete_python", 64): PeakMiss(+0.0649, _WORKSPACE.format(mib=37.5, batch=64, times=8)),
    ("fit_vit_b8_ckpt_bf16_complete_python", None): BatchMiss(
        235, 327, _WORKSPACE.format(mib=37.5, batch=327, times=41)
    ),
}
# the largest batches as recorded (under autocast) from these recordings: exact, within one, in the range
TALLY = Tally(answers=37, exact=19, within_one=4, in_range=21, sure_runs=37)


def _copies(frames):
    """The structure, and autocast's copies of the weights its forwards made."""
    s = training_structure(frames, 0)
    return s, forward_weight_copies(frames, s)


# recording -> copies per forward pass: one per weight a layer multiplies (bf16 autocast; the MLP float16)
COPIES = {
    "fit_gpt2_b4_bf16_complete_python": 49,  # 12 x 4 Conv1D, and the tied embedding for the head
    "fit_llama_b2_bf16_complete_python": 57,  # 8 x 7, and the untied head
    "fit_t5_b4_bf16_complete_python": 97,  # 6 x 6 encoder, 6 x 10 decoder, the head
    "fit_vit_b8_bf16_complete_python": 50,  # 12 x 4 (two in nn.MultiheadAttention), patch embedding, head
    "fit_neox_b4_bf16_complete_python": 49,
    "grad_amp_python": 6,  # an MLP of six Linear(2048, 2048) under float16 autocast
    "grad_amp_all": 6,  # the same with C++ frames on the stacks
}
NO_COPIES = (  # float32 twins, and models whose parameters are bfloat16 already
    "fit_gpt2_b4_complete_python",
    "fit_llama_b2_complete_python",
    "fit_t5_b4_complete_python",
    "fit_vit_b8_complete_python",
    "fit_convnext_b16_complete_python",
    "fit_opt_b4_complete_python",
    "grad_plain_python",
    # one float32 weight size: cuBLAS's workspace, made after the first output on its line, made
    # that output look like a copy, once (hence two copies at least)
    "fw_lbfgs_python",
    "fit_gpt2bf16_b4_bf16_complete_python",
    "fit_llamabf16_b2_bf16_complete_python",
)


@pytest.mark.parametrize("name", list(COPIES))
def test_one_copy_per_weight_and_forward_pass(real_frames, name):
    s, found = _copies(real_frames(name))
    pos = s.allocs["pos"].to_numpy()
    per_pass = [int(found[(pos >= p.forward_start) & (pos < p.backward_start)].sum()) for p in s.passes]
    assert per_pass == [COPIES[name]] * len(s.passes)


def test_a_simpler_rule_takes_activations_for_copies(real_frames):
    """Every forward tensor of half a weight's size: the float32 GPT-2's residual stream (12 MiB at
    batch 4) is half its tied embedding, and the bf16 Llama's queries (2 MiB) half its query weight."""
    for name, copies in (("fit_gpt2_b4_complete_python", 0), ("fit_llama_b2_bf16_complete_python", 114)):
        s, found = _copies(real_frames(name))
        half = np.isin(s.allocs["size"].to_numpy(), weight_sizes(s.params) // 2) & (phase_column(s) == "forward")
        assert int(found.sum()) == copies
        assert int(half.sum()) > copies + 100


@pytest.mark.parametrize("name", NO_COPIES)
def test_no_copies_without_autocast_or_in_half_precision(real_frames, name):
    assert int(_copies(real_frames(name))[1].sum()) == 0


def _cases():
    return [
        (name, int(batch))
        for name, (family, lever) in RECORDINGS.items()
        for batch, measured in FAMILIES[family]["levers"][lever]["uncapped"].items()
        if measured["ok"]
    ]


@pytest.mark.parametrize(("name", "batch"), _cases())
def test_whole_step_from_a_recording_under_autocast(real_frames, name, batch):
    family, lever = RECORDINGS[name]
    allocated, _ = predict_step(real_frames(name), batch_scale=batch / RECORDED[family])
    measured = FAMILIES[family]["levers"][lever]["uncapped"][str(batch)]["peak_process_bytes"]
    check_peak(allocated / measured - 1, BOUND, OUTSIDE.get((name, batch)), f"{name} at {batch}")


def test_every_known_miss_is_a_case_of_these_tests():
    for name, batch in OUTSIDE:
        assert (name, batch) in _cases() if batch is not None else name in RECORDINGS, (name, batch)
        assert isinstance(OUTSIDE[name, batch], BatchMiss if batch is None else PeakMiss), (name, batch)


@pytest.fixture(scope="module")
def autocast_fits(real_frames):
    out = {}
    for name, (family, _) in RECORDINGS.items():
        cap = FAMILIES[family]["levers"]["plain"].get("cap_bytes", CAP)  # gpt2m: 8 GiB
        out[name] = compute_fit(
            real_frames(name),
            memory_limit=cap,
            recorded_batch=RECORDED[family],
            parallel=False,
            levers=("as recorded",),
        )
    return out


@pytest.mark.parametrize("name", list(RECORDINGS))
def test_largest_batch_from_a_recording_under_autocast(autocast_fits, name):
    """Within 15% of the real runs, or two batches (the rest are within 2: GPT-2 5 / 5 and 28 / 28,
    ResNet-50 133 / 134 and 269 / 299, Llama 8 / 8 and 18 / 16, ViT 69 / 71, BERT 10 / 10, T5
    24 / 24 and 67 / 70, NeoX 9 / 9 and 32 / 32, OPT 11 / 11 and 31 / 32)."""
    family, lever = RECORDINGS[name]
    predicted = autocast_fits[name].largest_batch["as recorded"]
    measured = FAMILIES[family]["levers"][lever]["largest_batch_under_cap"]
    check_largest(predicted, measured, max(2, 0.15 * measured), OUTSIDE.get((name, None)), name)


def test_the_largest_batch_tables_counts(autocast_fits):
    rows = []
    for name, (family, lever) in RECORDINGS.items():
        fit = autocast_fits[name]
        real = FAMILIES[family]["levers"][lever]["largest_batch_under_cap"]
        rows.append((fit.largest_batch_no_retry.get("as recorded"), fit.largest_batch["as recorded"], real, None))
    check_tally(tally(rows), TALLY, "the largest batches from recordings under autocast")


# --------------------------------------------------------------------------- recorded after the rule
# sample_snapshots/workloads_fit.py, group fit_autocast: the rule above was written before these
# ran; only the extrapolated head's reading of the stream was changed for them (below)

AUTOCAST_TRUTH = json.loads((SAMPLES / "fit_autocast_truth.json").read_text())


@pytest.mark.parametrize("kind", ["hftrainer_bf16", "lightning_bf16", "lightning_fp16", "llama_infer_bf16"])
def test_trainer_and_inference_under_autocast_at_other_batches(real_frames, kind):
    """transformers' Trainer with ``bf16=True`` (accelerate's autocast; the frameworks' 4-layer
    GPT-2) from its snapshot at batch 8, within 0.3% at 8, 16, 32 and 64 (+2.3%, +3.6% and +4.9%
    at 16 to 64 before the rule); Lightning's ``"bf16-mixed"`` and ``"16-mixed"`` (float16 with a
    GradScaler), the same model, recorded after the rule and its change for the Trainer: within
    0.2% (+2.3%, +4.0% and +4.8% before); a Llama's inference under autocast (no_grad, three
    forwards) from batch 8, within 4% at 16 and 32 (+16% and +33% before)."""
    truth = AUTOCAST_TRUTH[kind]
    frames = real_frames(truth["snapshot"])
    bound = 0.04 if kind == "llama_infer_bf16" else 0.003
    for batch, measured in truth["uncapped"].items():
        allocated, _ = predict_step(frames, batch_scale=int(batch) / truth["recorded_batch"])
        error = allocated / measured["peak_process_bytes"] - 1
        assert abs(error) <= bound, (batch, allocated, measured["peak_process_bytes"], f"{error:+.1%}")


# OOM in the first forward under bf16 autocast -> (family, recorded batch, bound, exact largest batches)
AUTOCAST_OOMS = {
    "fit_gpt2_b32_bf16_oom_python": ("gpt2", 32, 0.06, {"bf16": 5}),
    "fit_llama_b32_bf16_oom_python": ("llama", 32, 0.06, {"bf16": 8, "ckpt+bf16": 16}),
    "fit_vit_b256_bf16_oom_python": ("vit", 256, 0.07, {}),
}


@pytest.mark.parametrize("name", list(AUTOCAST_OOMS))
def test_oom_in_the_first_forward_under_autocast(real_frames, name):
    """The step extrapolated from an OOM recorded under autocast, against the bf16 and
    checkpointing+bf16 tables. Its weight copies stay their size, and a float32 model's stream is
    no float32 copy of a half-precision one, though its blocks end on a half-precision tensor
    (``_Step.head``): with the copies alone Llama was -14.2% and -24.4% at batch 16 (its logits
    counted from half the tokens) and its largest batches 11 and 28 (8 and 16 ran); before either,
    GPT-2 -10.3..-7.7%. Now within 6% (ViT's checkpointing at 64 +6.0%), largest batches GPT-2
    5 / 5 and 33 / 28, Llama 8 / 8 and 16 / 16, ViT 72 / 71 and 344 / 327."""
    family, recorded, bound, exact = AUTOCAST_OOMS[name]
    frames = real_frames(name)
    fit = compute_fit(frames, memory_limit=CAP, recorded_batch=recorded, parallel=False, optimizer="adamw")
    assert "bf16" not in fit.largest_batch  # the lever is what was recorded
    for lever, ours in (("bf16", "as recorded"), ("ckpt+bf16", "checkpointing")):
        table = FAMILIES[family]["levers"][lever]
        for batch, measured in table["uncapped"].items():
            if not measured["ok"]:
                continue
            allocated, _ = predict_step(
                frames, batch_scale=int(batch) / recorded, checkpointing=lever != "bf16", optimizer="adamw"
            )
            error = allocated / measured["peak_process_bytes"] - 1
            assert abs(error) <= bound, (lever, batch, f"{error:+.1%}")
        real = table["largest_batch_under_cap"]
        predicted = fit.largest_batch[ours]
        assert predicted == exact[lever] if lever in exact else abs(predicted - real) <= 0.2 * real, (predicted, real)


def test_weights_older_than_a_wrapped_trace(real_frames):
    """A GPT-2 of 6 layers under bf16 autocast, recorded with a ring buffer that wrapped: no
    parameter was made in the trace, so its weights are those older than it (the structure's
    ``untracked``). 25 copies a forward (6 x 4 and the tied head), in the two forwards the ring
    holds; without the older weights, none, and its activations grew with 50 weight copies."""
    frames = real_frames("midrun_wrapped_python")
    s, found = _copies(frames)
    assert s.params.empty and int(found.sum()) == 50
    assert sample_truth("midrun_wrapped_python")["workload"]["autocast"] == "bf16"
