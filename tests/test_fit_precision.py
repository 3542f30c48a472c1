"""fit reads from the parameters' sizes whether a model is half precision already, and then
leaves bf16 autocast out: it halves nothing (issue #20; precision.py). The trace holds no
dtypes; each fp32 case below is a real recording that a simpler rule gets wrong."""

from __future__ import annotations

import re

import pytest

from snapshot_lab.metrics.fit import compute_fit
from snapshot_lab.metrics.fit import workload as wl
from snapshot_lab.metrics.fit.evidence import forward_weight_copies
from snapshot_lab.metrics.fit.model import FitUnsupported, step_evidence
from snapshot_lab.metrics.fit.precision import NO_BF16, square_matches
from snapshot_lab.metrics.fit.result import predict_step
from snapshot_lab.metrics.plan.structure import training_structure

from .conftest import sample_truth

# LlamaForCausalLM in fp16: generate() with a KV cache (12 layers), and prefills under a cap (4
# layers); per layer its two norms, and the final norm
HALF = {"inf_llama_start_python": (25, 2), "inf_llama_late_python": (25, 0), "inf_flush_python": (9, 0)}
# name: (two-byte matches, four-byte matches), as the rule reads them
FULL = {
    # the same Llama architecture in float32 (a training step): "a Llama is half precision" fails here
    "fit_llama_b2_complete_python": (0, 19),
    # GPT-2 in float32 whose position table (1024 x 512 x 4 bytes) is the 2-byte square of its
    # width by chance: "any 2-byte square means half precision" fails here
    "transformer_varlen": (26, 30),
    # ResNet-18 in float32: its 1x1 convolutions from C to 2C channels are 8 C^2 bytes, the size of
    # a half-precision square of 2C, and only they match. Without the rule that Linear layers must
    # make the matrix multiplies, it is taken for half precision
    "cnn_clean": (60, 0),
    # an MLP inference in float32
    "deep_inference_python": (32, 194),
    # a float32 MLP from 1024 to 2048 and back: its biases match once, none at 4 bytes ("more
    # two-byte than four-byte matches" fails here)
    "cuda_graph": (1, 0),
    # FSDP2's shards of a float32 GPT (halved along the first dimension, as are the norms):
    # "twice as many" would still hold, "more than" fails
    "fsdp2_reshard_transformer_rank0": (148, 82),
}


@pytest.mark.parametrize("name", HALF)
def test_a_half_precision_model_gets_no_bf16_lever(real_frames, name):
    assert "fp16" in sample_truth(name)["workload"]["model"]
    frames = real_frames(name)
    ev = step_evidence(frames, 0)
    assert ev.half_precision
    assert tuple(square_matches(ev.tape).values()) == HALF[name]
    r = compute_fit(frames, memory_limit=2 << 30)
    assert [o.lever for o in r.levers if "bf16" in o.lever] == []
    assert wl.FORWARD_ONLY_HALF_LEVERS_NOTE in r.notes and wl.FORWARD_ONLY_LEVERS_NOTE not in r.notes
    assert any(n.startswith("the parameters are half precision already") for n in r.notes)
    with pytest.raises(FitUnsupported, match=re.escape(NO_BF16)):
        predict_step(frames, bf16=True)


@pytest.mark.parametrize("name", FULL)
def test_a_float32_model_keeps_its_bf16_lever(real_frames, name):
    frames = real_frames(name)
    ev = step_evidence(frames, 0)
    assert not ev.half_precision
    assert tuple(square_matches(ev.tape).values()) == FULL[name]
    plain, _ = predict_step(frames)
    autocast, _ = predict_step(frames, bf16=True)
    # bf16 is modelled: it changes the peak (down, or up where its weight copies weigh more than
    # what it halves: the MLP in a CUDA graph, 173.0 -> 176.2 MB)
    assert autocast != plain


@pytest.mark.parametrize("name", ["fit_llamabf16_b2_complete_python", "fit_llamabf16_b64_oom_python"])
def test_half_precision_read_from_a_norms_float32_copy_where_sizes_cannot_tell(real_frames, name):
    """Llama with bfloat16 parameters and grouped-query attention: k and v half as wide, so its
    vectors match the 4-byte square (17) nearly as often as the 2-byte one (19), and a float32
    model half as wide would have these sizes. Every block first makes RMSNorm's float32 copy of
    its bfloat16 input, twice the block's output: from the complete recording, and from the OOM
    (its extrapolated blocks copy the recorded ones)."""
    from snapshot_lab.metrics.fit.precision import UPCAST_RATIO, first_to_last

    ev = step_evidence(real_frames(name), 0, "adamw")
    assert tuple(square_matches(ev.tape).values()) == (19, 17)
    assert first_to_last(ev.tape, ev.blocks) == [UPCAST_RATIO] * 16
    assert ev.half_precision
    assert any("a float32 tensor beside half-precision ones" in n for n in ev.notes)


@pytest.mark.parametrize(
    ("name", "ratios"), [("fit_llama_b2_complete_python", {1.0}), ("fit_bert_b2_complete_python", {768.0})]
)
def test_a_float32_block_does_not_start_at_twice_its_output(real_frames, name, ratios):
    """The same Llama in float32 (the norm's first tensor, its square, is as large as the output)
    and BERT, whose blocks end on a small tensor: "the first tensor is larger than the last" would
    take BERT for half precision."""
    from snapshot_lab.metrics.fit.precision import first_to_last

    ev = step_evidence(real_frames(name), 0)
    assert set(first_to_last(ev.tape, ev.blocks)) == ratios
    assert not ev.half_precision


def test_an_oom_that_reached_no_linear_layer_still_reads_its_precision(real_frames):
    """GPT-2 with bfloat16 parameters, out of memory in its first forward: its matrix multiplies
    are transformers' Conv1D and the head was never reached, so no stack is torch's Linear. "Linear
    layers outnumber convolutions" turned the sizes rule off there (74 two-byte matches, none at 4
    bytes); now only more convolutions than linear layers does (ResNet-18, above)."""
    from snapshot_lab.metrics.fit.evidence import stack_innermost

    frames = real_frames("fit_gpt2bf16_b64_oom_python")
    files = stack_innermost(frames)["filename"]
    assert files.str.endswith("torch/nn/modules/linear.py").sum() == 0
    ev = step_evidence(frames, 0, "adamw")
    assert tuple(square_matches(ev.tape).values()) == (74, 0)
    assert ev.half_precision


@pytest.mark.parametrize("name", ["fit_gpt2_b4_bf16_complete_python", "modtags_gpt2_python"])
def test_a_float32_model_recorded_under_autocast_is_said_to_compute_in_half_precision(real_frames, name):
    """The float-copy rule also holds for float32 GPT-2s recorded under bf16 autocast (issue #20's
    bf16 recording; a module-tags job, recorded for another question): their blocks end on a
    half-precision tensor. A bf16 lever there would apply autocast twice; the note says the step
    computes in half precision already, its parameters or autocast, not that the parameters are."""
    from snapshot_lab.metrics.fit.precision import UPCAST_NOTE, WEIGHT_COPIES_NOTE, first_to_last, upcasts

    frames = real_frames(name)
    ev = step_evidence(frames, 0)
    assert square_matches(ev.tape)[2] == 0  # float32 parameters: no 2-byte square
    assert ev.half_precision
    ratios = first_to_last(ev.tape, ev.blocks)
    assert upcasts(ratios)  # the float-copy rule holds: its note would say so
    assert "autocast already on" in UPCAST_NOTE
    # autocast's weight copies, found one by one (fit/weight_copies.py), say it first and exactly
    copies = int(forward_weight_copies(frames, training_structure(frames, 0)).sum())
    # 49 weights (12 x 4 and the tied head) in 2 passes; 17 (4 x 4 and the head) in 3
    assert copies == {"fit_gpt2_b4_bf16_complete_python": 98, "modtags_gpt2_python": 51}[name]
    assert WEIGHT_COPIES_NOTE.format(copies=copies) in ev.notes


# convolutional networks (precision.conv_norm_matches), recorded on 2026-11-26 (later) with the rule
# written: name: (parameter dtype, convolution matches at 2 bytes, at 4 bytes)
CONVNETS = {
    "fit_resnet50_fp16_inference_b64_python": ("float16", 48, 3),
    "fit_effnet_fp16_inference_b64_python": ("float16", 32, 0),  # depthwise convolutions, squeeze-excitation
    "fit_resnet18bf16_b32_complete_python": ("bfloat16", 16, 3),  # a training step
    "fit_resnet50_fp32_inference_b64_python": ("float32", 0, 48),
    "fit_effnet_fp32_inference_b64_python": ("float32", 0, 32),
    "fit_resnet50_b16_complete_python": ("float32", 0, 48),
    # ResNet-18 in float32, whose 1x1 convolutions match the sizes rule 60 times (FULL above)
    "cnn_clean": ("float32", 0, 16),
}


@pytest.mark.parametrize("name", CONVNETS)
def test_a_convolutional_networks_precision_is_read_from_its_convolutions(real_frames, name):
    """Before this rule, every CNN kept its bf16 lever: an fp16 ResNet-50's inference was told bf16
    brings it down, where its real run computes in half precision already. The sizes rule cannot
    serve (ResNet-18 in float32 matches it 60 times against none)."""
    from snapshot_lab.metrics.fit.precision import CONV_HALF_NOTE, conv_norm_matches, parameter_sizes

    dtype, two, four = CONVNETS[name]
    truth = sample_truth(name)["workload"]
    assert truth.get("parameter_dtype", "float32") == dtype
    frames = real_frames(name)
    ev = step_evidence(frames, 0)
    assert tuple(conv_norm_matches(parameter_sizes(ev.tape)).values()) == (two, four)
    assert ev.half_precision is (dtype != "float32")
    r = compute_fit(frames, memory_limit=6 << 30)
    bf16 = [o.lever for o in r.levers if "bf16" in o.lever]
    if dtype == "float32":
        assert bf16
        return
    assert bf16 == []
    assert any(n == CONV_HALF_NOTE.format(matches=two, others=four) for n in r.notes)
    with pytest.raises(FitUnsupported, match=re.escape(NO_BF16)):
        predict_step(frames, bf16=True)


# autocast read from its weight copies (precision.under_autocast): name -> (distinct large weight
# sizes, how many the forward copies at half their size, recorded under autocast)
AUTOCAST = {
    "fit_resnet50_b16_bf16_complete_python": (13, 13, True),
    "fit_effnet_b16_bf16_complete_python": (13, 13, True),
    # linear layers outnumber its convolutions, and its blocks end on a float32 tensor: neither
    # the convolution rule nor the float-copy rule sees it
    "fit_convnext_b16_bf16_complete_python": (10, 10, True),
    # another session's job (channels_last, module tags), recorded for another question
    "modtags_resnet50_process": (13, 13, True),
    # their twins without autocast: activations of half a weight's size by chance
    "fit_resnet50_b16_complete_python": (13, 2, False),
    "fit_effnet_b16_complete_python": (13, 0, False),
    "fit_convnext_b16_complete_python": (10, 3, False),
    # FSDP's shards of a float32 transformer: 8 sizes, the fewest the rule reads
    "fsdp2_reshard_transformer_rank0": (8, 3, False),
}


@pytest.mark.parametrize("name", AUTOCAST)
def test_autocast_is_read_from_its_weight_copies(real_frames, name):
    """A CNN recorded under bf16 autocast was offered the bf16 lever, autocast applied twice. A
    small model's few weight sizes meet activations of half their size by chance (an MLP meets 4
    of its 5 without autocast: ``twin_complete``), hence the eight sizes at least."""
    from snapshot_lab.metrics.fit.precision import AUTOCAST_NOTE, WEIGHT_COPIES_NOTE, autocast_copies, under_autocast

    sizes, copied, autocast = AUTOCAST[name]
    frames = real_frames(name)
    ev = step_evidence(frames, 0)
    assert autocast_copies(ev.tape) == (sizes, copied)
    assert ev.half_precision is autocast
    if autocast:  # the weight copies found one by one say it first (fit/weight_copies.py); this rule agrees
        copies = int(forward_weight_copies(frames, training_structure(frames, 0)).sum())
        assert copies > 0 and WEIGHT_COPIES_NOTE.format(copies=copies) in ev.notes
        assert under_autocast(ev.tape) == (True, AUTOCAST_NOTE.format(copied=copied, sizes=sizes))
        assert [o.lever for o in compute_fit(frames, memory_limit=6 << 30).levers if "bf16" in o.lever] == []


def test_a_small_model_s_few_weight_sizes_say_nothing(real_frames):
    from snapshot_lab.metrics.fit.precision import autocast_copies

    assert autocast_copies(step_evidence(real_frames("twin_complete"), 0).tape) == (5, 4)
    assert not step_evidence(real_frames("twin_complete"), 0).half_precision


@pytest.mark.parametrize(
    ("float32", "half"),
    [
        ("fit_resnet50_fp32_inference_b64_python", "fit_resnet50_fp16_inference_b64_python"),
        ("fit_effnet_fp32_inference_b64_python", "fit_effnet_fp16_inference_b64_python"),
    ],
)
def test_the_bf16_lever_on_a_float32_inference_lands_near_its_half_precision_twin(real_frames, float32, half):
    """The same inference (3 batches of 64) in float32 and in float16, recorded after the lever was
    written: the lever's peak at the recorded batch against what the half-precision run measured
    (ResNet-50 453.0 against 445.0 MiB, EfficientNet-B0 378.7 against 382.1 MiB). Autocast keeps the
    float32 weights and makes half-precision copies where the twin's weights are half precision,
    so the two differ by a part of the weights; the activations halve alike."""
    measured = sample_truth(half)["memory_stats"]["0"]["allocated_bytes.all.peak"]
    predicted, _ = predict_step(real_frames(float32), bf16=True)
    plain, _ = predict_step(real_frames(float32))
    assert abs(predicted - measured) <= 0.02 * measured
    assert predicted < 0.6 * plain  # the lever halves: ResNet-50 804.5 -> 453.0 MiB
