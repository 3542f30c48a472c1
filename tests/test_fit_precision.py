"""fit reads from the parameters' sizes whether a model is half precision already, and then
leaves bf16 autocast out: it halves nothing (issue #20; precision.py). The trace holds no
dtypes; each fp32 case below is a real recording that a simpler rule gets wrong."""

from __future__ import annotations

import pytest

from snapshot_lab.metrics.fit import compute_fit
from snapshot_lab.metrics.fit import workload as wl
from snapshot_lab.metrics.fit.model import FitUnsupported, step_evidence
from snapshot_lab.metrics.fit.precision import NO_BF16, square_matches
from snapshot_lab.metrics.fit.result import predict_step

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
    with pytest.raises(FitUnsupported, match=NO_BF16):
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
