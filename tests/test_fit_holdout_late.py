"""snaplab fit on two families recorded after every fit rule was written: a Llama from a Hugging
Face config (8 layers, d=1024, GQA 16/8 heads, RMSNorm, SwiGLU 2816, untied head, vocab 32000, 512
tokens, fp32, AdamW) and torchvision's ConvNeXt-Tiny (AdamW), both recorded on the H100 by
``sample_snapshots/workloads_fit.py`` (families ``llama`` and ``convnext`` of
``sample_snapshots/fit_truth.json``).

They were hold-outs: run against the rules as they stood, each broke one. Those rules were then
changed (so for what follows they are no longer unseen), each change checked on GPT-2, ResNet-50
and ViT as well:

- ConvNeXt: no repeated block at all (checkpointing refused). A block instance began where the
  first call inside the block-calling loop came round again; a CNBlock makes everything under one
  call (``self.layer_scale * self.block(input)``), so the whole stage was one instance. Now, when
  no call site repeats by that rule, the whole rest of the call chain is compared (``fit/blocks.py``).
- Llama complete (batch 2): the head's backward did not scale. At 2 x 512 tokens the logits'
  gradient is the size of the 32000 x 1024 head, and backward tensors of a parameter's size were
  all taken as weight gradients; a size the forward also made as an activation now scales
  (``row_categories``). Checkpointing at 16 went from -17.9% to +1.3%.
- Llama OOM (batch 32): 3 layers counted from the parameters where there are 8 (every size
  recurs within a Llama layer, so the period was never among the distances to a size's next
  occurrence), and logits of 1/1024 of theirs (the stream the head reads was taken as the last
  block's first saved tensor: RMSNorm's per-token variance). Plain at 16 went from -56.6% to +3.0%.

A third, BERT-base for masked language modelling from a Hugging Face config (12 layers, d=768,
vocab 30522, 512 tokens, dropout 0, AdamW; family ``bert``), was recorded a session later, with
the same rules untouched. Its complete snapshot was within the bounds as it came (every lever and
batch within 5.1%, the largest batches 9/9, 21/20, 12/10, 20/20). Its OOM broke the head: BERT's
decoder is tied to the word embedding and has a bias of its own, after a transform as wide as the
model, so the matrix after the blocks was that transform's and the head was taken as a
classifier's (no per-token logits): -21% to -53% from batch 4 up. A vector after the blocks
wider than the model, with one value per row of an embedding, now marks a tied decoder
(``head_matrix``); ViT's class token, as wide as the model, matches its patch embedding that
way, which is why the vector must be wider.

ConvNeXt under checkpointing from the complete snapshot was high (+10.5% at batch 128, +2.7% at 8):
the lever took the first of a block's kept tensors that the backward frees for the block's
output, kept for the next block; a CNBlock's output is made after its last submodule call
(``layer_scale * ...``, then ``+= input``), outside its span, and the tensor so taken was the
last linear layer's output, saved for ``layer_scale``'s gradient. A block whose next tensor
belongs to no block and lives to its backward now keeps none of its own (``_output_outside``):
within 2.2% (ConvNeXt's checkpointed recording keeps 18.4 MiB of linear outputs at the peak where
the lever kept 55.1). Still outside the bounds, a known miss with its numbers (``OUTSIDE``, ``REFUSED``):
ConvNeXt's OOM, which ran out inside its first block, whose
layers (a depthwise convolution, a layer norm, two linear layers, a layer scale) the convolution
reader of ``fit/convnet.py`` (convolutions each followed by a batch norm) does not cover.

Two more, recorded on 2026-11-26 with every rule above untouched: torchvision's EfficientNet-B0
(depthwise convolutions, squeeze-and-excitation, SiLU; SGD with momentum; family ``effnet``) and
T5 from a Hugging Face config (an encoder-decoder, 6 + 6 layers, d=512, 512 input and 128 target
tokens, AdamW; family ``t5``). Their complete snapshots were within the bounds as they came except
T5 under bf16 (a known miss, ``OUTSIDE``). Their OOMs broke the extrapolation: it copied the blocks the
forward ran as many times as the longest run of alike blocks in the parameters, T5's decoder's
5 where its encoder ran, EfficientNet's 3 in its sixth stage where its first stage ran: -37% and
-72..+600%, and largest batches of 42 (22 ran) and 351 (69 ran). Such a model is now refused
with the reason (``one_stack``), not answered wrongly.

A third of that day, the Llama family again with bfloat16 parameters and AdamW state (pure bf16
training, family ``llamabf16``), found two gaps. The parameters' precision was not read with
grouped-query attention (k and v half as wide), so the bf16 lever was offered (-13%). And the step
extrapolated from its OOM was +22..+71%: the head counted its tokens from the norm's float32 copy
of the stream, twice the stream. The precision is now also read from that copy (every block's
first tensor twice its output, ``precision.first_to_last``), and the head counts tokens from the
stream: the OOM within 4.4%, its largest batches exact (12 / 12, 23 / 23). GPT-2 with bfloat16
parameters (``gpt2bf16``), recorded after that, is their hold-out: a layer norm, no float32 copy.
Its OOM broke the rule that matrix multiplies come from ``torch.nn.Linear``: GPT-2's are
transformers' ``Conv1D``, and its OOM reached no Linear layer, so the precision was not read
there. Now only more convolutions than linear layers turns the rule off. It is within 1.0% and
its largest batches exact as recorded (8 / 8), with checkpointing 40 / 37 and 38 / 37.

Two decoders it had never seen, recorded on 2026-11-26 (later) with every rule untouched:
GPT-NeoX (rotary, attention and MLP in parallel off one residual, untied head; family ``neox``)
and OPT (learned positions with an offset of 2, ReLU, tied head; family ``opt``), both 12 layers
of d=768 at 1024 tokens with AdamW. Every answer was within its bound as it came, but NeoX
under bf16 from its complete recording at batch 16 (-11.1%, -9.7% at 8: ``OUTSIDE``, with why);
from the OOMs -11.4% at worst. Largest batches, as recorded / checkpointing / bf16 / both: NeoX
7/7, 31/30, 10/9, 32/32 (complete) and 7/7, 31/30, 11/9, 32/32 (OOM); OPT 8/8, 27/28, 12/11,
33/32 and 8/8, 31/28, 12/11, 32/32: 9 of 16 exact.

Two more decoders, recorded on 2026-11-26 (third session) with every rule untouched: Gemma
(multi-query attention, GeGLU, a tied and scaled embedding) and Qwen2 (grouped-query attention,
biased q/k/v), 12 layers of d=768 at 1024 tokens with AdamW. From their complete recordings
every answer was within its bound but Gemma's checkpointing+bf16 (+11.8% at 8: ``OUTSIDE``);
largest batches 2/2, 16/14, 6/6, 22/30 and 3/3, 16/18, 8/7, 23/32. Their OOMs, out early in
their second block, broke the extrapolation: -58..+250%, every largest batch 0. The first
block's tensors past the point where the second was cut (Qwen2's 1.5 GiB of float32 attention
weights: the request that failed) were compared with a second block that never reached them,
and taken for one-off workspaces, 4.4 GiB that no batch changed. Only as far as the second got
is compared now (``_Step.lone_rows``, ``workspace_rows``): within 5.6% but checkpointing
(-22%, -24% at 16: ``OUTSIDE``); largest batches as recorded, with bf16 and with both 2/2, 6/6,
32/30 (Gemma) and 3/3, 8/7, 32/32 (Qwen2), with checkpointing 23/14 and 27/18.

Five more, recorded on 2026-11-27 with every rule above untouched: Phi (partial rotary, attention
and MLP in parallel; ``phi``), DistilBERT for masked language modelling (6 layers, tied decoder;
``distilbert``), a GPT-2 of 24 layers of d=1024 at 512 tokens under an 8 GiB cap (``gpt2m``: another
size, sequence length and cap than the issue's), torchvision's ResNet-18 (basic blocks, SGD with
momentum) and ResNet-101 (AdamW). DistilBERT, GPT-2 and ResNet-101 were within their bounds as they
came (largest batches as recorded exact from both recordings of DistilBERT and GPT-2). Three broke:

- ResNet-18's OOM (batch 512, out in its first basic block) was refused: the convolution reader
  took the count of a block's main-path convolutions from the first block's projection shortcut,
  and ResNet-18's first stage has none. The count is now the first from 1 to 4 that reads the
  whole sequence (``convnet.conv_blocks``): within 1.6% as recorded, largest batch 277 / 274.
  Its OOM and ResNet-50's and ResNet-101's, none of which reached a matrix multiply, lacked the
  head's cuBLAS workspaces (65 MiB): ResNet-50's went from -7.7% to -1.1% (69 / 69, exact).
- ResNet-18 under bf16 was 7% (complete) and 9% (OOM) low: max pooling's int64 indices (1.6 MB a
  sample) were halved, and taken for the float32 input a convolution casts
  (``evidence.pool_indices``): within 2.9% now.
- Phi under bf16 was 11% low, as GPT-NeoX's had been (``OUTSIDE`` before): transformers' KV cache
  copies keys and values in the key's dtype, float32 where a rotary embedding's float32 cos and
  sin made it, and the attention saves bfloat16 copies of them beside the cache. The cache was
  halved (GPT-2's, whose key comes out of its projection, is bfloat16). Now a cache copy takes
  the dtype of the tensor made before it (``evidence.allocation_codes``) and a float32 one gets
  the attention's copies (``levers._attention_input_casts``): Phi within 6.3%, NeoX from -11.1% to
  -1.3% (its largest batch under bf16 9 / 9 from both recordings, 10 and 11 before).

Three more, recorded after those changes, are their hold-outs: Mistral (grouped-query attention,
rotary: a float32 KV cache), ResNet-34 (16 basic blocks, its first stage without a projection) and
Wide ResNet-50-2 (``wrn50``), both with SGD with momentum, OOMs in the first forward at batch 512.
ResNet-34's OOM is within 2.8% under every lever (the reader refused it before), WRN-50-2's within
3.3%, Mistral's bf16 within 6.6% (largest batch 8 / 7) from both recordings. Outside, as for the
families named in ``OUTSIDE``: Mistral's checkpointing from its OOM (as Gemma's and Qwen2's) and
checkpointing+bf16 from its complete recording (as Gemma's), and checkpointing+bf16 from the
complete recordings of ResNet-34 (+10.4% at 16) and WRN-50-2 (+12.2% at 8), at their smallest
batches.

The issue's GPT-2 trained by transformers' Trainer (``hftrainer``: its defaults, the levers its own
``bf16=True`` and ``gradient_checkpointing=True``), out of memory in its first forward at batch 32
under 6 GiB, was within 0.3% as recorded and under bf16, but 16% high with checkpointing at batch 1:
the optimizer assumed for a step the trace never reached was torch's AdamW, whose step makes
temporaries the size of the parameters. The Trainer makes AdamW with ``fused=True``, which makes
none (its complete recording's step shows none). With the Trainer on the stacks, that is the
optimizer assumed now (``model.TRAINER_OPTIMIZER``): every lever within 2.5%, largest batches 4 / 4,
29 / 27, 5 / 5 and 30 / 28, and the limit inferred from the OOM 6 GiB.

The same GPT-2 in a LightningModule (``lightning``: torch's AdamW, precision ``32-true``; the levers
``bf16-mixed`` and gradient checkpointing), out in its first forward at batch 32, was 12% low as
recorded at batch 1 and 14% low under bf16: Lightning runs the forward inside the optimizer's
step closure and zeroes the gradients there, after the forward, so a step's gradients (0.34 GiB)
live through the next forward, where the extrapolation had freed them after the step. With
Lightning's closure on the stacks they live until the next backward now
(``extrapolate.LIGHTNING_ZERO_GRAD``): as recorded within 0.2%, every lever within 7%, largest
batches 3 / 3, 27 / 26, 5 / 4 and 30 / 28 (3, 29, 5, 30 before).

Two gaps those families shared with Gemma and Qwen2 are closed since (their ``OUTSIDE`` entries gone):

- Checkpointing from the OOMs of Gemma, Qwen2 and Mistral was 22% to 24% low. The complete
  recordings of Llama, Gemma and Qwen2 show three tensors the size of SDPA's math-kernel
  probabilities (batch x heads x tokens squared) alive at once in every block's backward: the
  probabilities' gradient, the scores' and the softmax's temporary. The synthesized backward made
  one gradient per tensor, two alive (``extrapolate._Step._attention_probabilities``): now -13.2%
  at worst, largest batches 18 / 14, 20 / 18 and 20 / 18 (23, 27 and 27 before). The recordings
  also keep the saved probabilities beside the three until the block's backward ends; since the
  synthesized backward does (2026-11-27, fourth session), within 4.0%, largest batches 15 / 14,
  16 / 18 and 16 / 18 (:func:`test_the_saved_probabilities_stay_to_their_blocks_backward_end`).
- Checkpointing+bf16 from the complete recordings of Gemma and Mistral was 12% high: the lever
  dropped the math kernel's probabilities from the forward (bf16 runs flash attention, which
  makes none), but not from the checkpointed block's re-run in the backward. It drops them there
  too, and the synthesized backward's tensors of their size, where larger than anything a linear
  layer made (all of the backward's attention tensors, the simpler rule, moved GPT-2's and ViT's
  answers and Phi's largest batch with both from 27 / 27 to 33 / 27): Gemma +6.7% (was +11.8%),
  Mistral +6.9% (+12.5%), largest batches 27 / 30 and 28 / 32 (22 and 23 before).

Three fine-tuning jobs (2026-11-27, third session): GPT-2 with its first six blocks frozen,
ResNet-50 with its stem, layer1 and layer2 frozen, and GPT-2 frozen whole with LoRA adapters. What
they broke and the rules they gave are in ``tests/test_fit_frozen.py``; outside still (``OUTSIDE``):
the LoRA job under bf16 (the adapters' sums taken as float32) and ResNet-50's OOM, out in its stem.
Their hold-outs, ViT-B/16 with its first six layers frozen and the Llama with LoRA adapters, are
here too, and GPT-2 and the Llama with PEFT's LoRA (``tests/test_fit_frozen.py``).
"""

from __future__ import annotations

import json
import re

import pytest

from snapshot_lab.metrics.fit import compute_fit, predict_step

from .conftest import SAMPLES
from .fit_known_misses import (
    TALLIES,
    BatchMiss,
    PeakMiss,
    Refusal,
    attempt,
    check_largest,
    check_peak,
    check_refused,
    check_tally,
    tally,
)

FAMILIES = json.loads((SAMPLES / "fit_truth.json").read_text())["families"]
CAP = 6 << 30
LEVERS = {"plain": (False, False), "ckpt": (True, False), "bf16": (False, True), "ckpt+bf16": (True, True)}
OUR_NAMES = {"plain": "as recorded", "ckpt": "checkpointing", "bf16": "bf16", "ckpt+bf16": "checkpointing+bf16"}
SNAPSHOTS = {  # name -> (family, recorded batch, optimizer assumed for the part of the step never reached, bound)
    "fit_llama_b2_complete_python": ("llama", 2, None, 0.10),
    "fit_llama_b32_oom_python": ("llama", 32, "adamw", 0.15),
    "fit_convnext_b16_complete_python": ("convnext", 16, None, 0.10),
    "fit_convnext_b512_oom_python": ("convnext", 512, "adamw", 0.15),
    "fit_bert_b2_complete_python": ("bert", 2, None, 0.10),
    "fit_bert_b32_oom_python": ("bert", 32, "adamw", 0.15),
    "fit_effnet_b16_complete_python": ("effnet", 16, None, 0.10),
    "fit_t5_b4_complete_python": ("t5", 4, None, 0.10),
    "fit_llamabf16_b2_complete_python": ("llamabf16", 2, None, 0.10),
    "fit_llamabf16_b64_oom_python": ("llamabf16", 64, "adamw", 0.15),
    "fit_gpt2bf16_b4_complete_python": ("gpt2bf16", 4, None, 0.10),
    "fit_gpt2bf16_b64_oom_python": ("gpt2bf16", 64, "adamw", 0.15),
    "fit_neox_b4_complete_python": ("neox", 4, None, 0.10),
    "fit_neox_b32_oom_python": ("neox", 32, "adamw", 0.15),
    "fit_opt_b4_complete_python": ("opt", 4, None, 0.10),
    "fit_opt_b32_oom_python": ("opt", 32, "adamw", 0.15),
    # recorded on 2026-11-26 (third session) with every rule untouched: Gemma (multi-query attention,
    # GeGLU, tied scaled embedding) and Qwen2 (grouped-query attention, biased q/k/v)
    "fit_gemma_b4_complete_python": ("gemma", 4, None, 0.10),
    "fit_gemma_b32_oom_python": ("gemma", 32, "adamw", 0.15),
    "fit_qwen2_b4_complete_python": ("qwen2", 4, None, 0.10),
    "fit_qwen2_b32_oom_python": ("qwen2", 32, "adamw", 0.15),
    # recorded on 2026-11-27 with every rule untouched (the module's docstring)
    "fit_phi_b4_complete_python": ("phi", 4, None, 0.10),
    "fit_phi_b32_oom_python": ("phi", 32, "adamw", 0.15),
    "fit_distilbert_b4_complete_python": ("distilbert", 4, None, 0.10),
    "fit_distilbert_b64_oom_python": ("distilbert", 64, "adamw", 0.15),
    "fit_gpt2m_b2_complete_python": ("gpt2m", 2, None, 0.10),
    "fit_gpt2m_b32_oom_python": ("gpt2m", 32, "adamw", 0.15),
    "fit_resnet18_b32_complete_python": ("resnet18", 32, None, 0.10),
    "fit_resnet18_b512_oom_python": ("resnet18", 512, "sgd-momentum", 0.15),
    "fit_resnet101_b16_complete_python": ("resnet101", 16, None, 0.10),
    "fit_resnet101_b512_oom_python": ("resnet101", 512, "adamw", 0.15),
    # recorded later that day, after the rules the five above changed: their hold-outs
    "fit_mistral_b4_complete_python": ("mistral", 4, None, 0.10),
    "fit_mistral_b32_oom_python": ("mistral", 32, "adamw", 0.15),
    "fit_resnet34_b32_complete_python": ("resnet34", 32, None, 0.10),
    "fit_resnet34_b512_oom_python": ("resnet34", 512, "sgd-momentum", 0.15),
    "fit_wrn50_b16_complete_python": ("wrn50", 16, None, 0.10),
    "fit_wrn50_b512_oom_python": ("wrn50", 512, "sgd-momentum", 0.15),
    # the issue's GPT-2 under transformers' Trainer, out in its first forward: no optimizer given, the
    # Trainer's default is read from the stacks (module docstring)
    "fit_hftrainer_b32_oom_python": ("hftrainer", 32, None, 0.15),
    # and in a LightningModule (Lightning's automatic optimization, torch's AdamW named in the stacks)
    "fit_lightning_b32_oom_python": ("lightning", 32, None, 0.15),
    # recorded on 2026-11-27 (second session) with every rule untouched (tests/test_fit_nested_blocks.py)
    "fit_mobilenet_b32_complete_python": ("mobilenet", 32, None, 0.10),
    "fit_mobilenet_b1024_oom_python": ("mobilenet", 1024, "sgd-momentum", 0.15),
    "fit_densenet_b16_complete_python": ("densenet", 16, None, 0.10),
    "fit_densenet_b512_oom_python": ("densenet", 512, "sgd-momentum", 0.15),
    "fit_swin_b16_complete_python": ("swin", 16, None, 0.10),
    "fit_swin_b512_oom_python": ("swin", 512, "adamw", 0.15),
    "fit_bloom_b2_complete_python": ("bloom", 2, None, 0.10),
    "fit_bloom_b32_oom_python": ("bloom", 32, "adamw", 0.15),
    # the hold-outs of the rule BLOOM and Swin-T gave (tests/test_fit_softmax_copy.py): eager attention
    "fit_gpt2eager_b4_complete_python": ("gpt2eager", 4, None, 0.10),
    "fit_gpt2eager_b32_oom_python": ("gpt2eager", 32, "adamw", 0.15),
    "fit_llamaeager_b2_complete_python": ("llamaeager", 2, None, 0.10),
    "fit_llamaeager_b32_oom_python": ("llamaeager", 32, "adamw", 0.15),
    # the hold-out of the nested-block rule (tests/test_fit_nested_blocks.py), recorded after it
    "fit_regnet_b32_complete_python": ("regnet", 32, None, 0.10),
    "fit_regnet_b1024_oom_python": ("regnet", 1024, "sgd-momentum", 0.15),
    "fit_gpt2frozen_b4_complete_python": ("gpt2frozen", 4, None, 0.10),
    "fit_gpt2frozen_b32_oom_python": ("gpt2frozen", 32, "adamw", 0.15),
    "fit_resnet50ft_b32_complete_python": ("resnet50ft", 32, None, 0.10),
    "fit_resnet50ft_b512_oom_python": ("resnet50ft", 512, "sgd-momentum", 0.15),
    "fit_gpt2lora_b4_complete_python": ("gpt2lora", 4, None, 0.10),
    "fit_gpt2lora_b32_oom_python": ("gpt2lora", 32, "adamw", 0.15),
    "fit_vitft_b8_complete_python": ("vitft", 8, None, 0.10),
    "fit_vitft_b256_oom_python": ("vitft", 256, "adamw", 0.15),
    "fit_llamalora_b2_complete_python": ("llamalora", 2, None, 0.10),
    "fit_llamalora_b32_oom_python": ("llamalora", 32, "adamw", 0.15),
    "fit_gpt2peft_b4_complete_python": ("gpt2peft", 4, None, 0.10),
    "fit_gpt2peft_b32_oom_python": ("gpt2peft", 32, "adamw", 0.15),
    "fit_llamapeft_b2_complete_python": ("llamapeft", 2, None, 0.10),
    "fit_llamapeft_b32_oom_python": ("llamapeft", 32, "adamw", 0.15),
}
HALF_PRECISION_FAMILIES = ("llamabf16", "gpt2bf16")  # no bf16 lever: fit refuses it (test below)
# refused, with the reason (their numbers before, in the module's docstring)
TWO_STACKS = {"fit_t5_b64_oom_python": (56, 5, 10, 13), "fit_effnet_b256_oom_python": (259, 3, 35, 22)}
_T5_BF16 = (
    "T5's own code casts autocast's outputs back to float32 (its feed-forward to the output layer's weight "
    "dtype, its attention scores plus a float32 position bias), which the float32 recording cannot show: "
    "bf16 saves 3% at batch 16, not 31%"
)
_RESNET18_CKPT = (
    "checkpointing from ResNet-18's complete recording keeps more than the real runs do, 16.8 MB a sample where "
    "they grow 15.1 (+10.4% at batch 256): not analysed; from its OOM, whose blocks are read from the "
    "parameters, within 0.7%"
)
_NO_READER = "ran out inside its first CNBlock, which the convolution/batch-norm reader does not cover"
_FIRST_BLOCK = (
    "ran out inside its first block (an inverted residual, a dense layer, a Swin block, a RegNet block), which the "
    "convolution/batch-norm reader does not cover"
)
_SMALL_BATCH_BOTH = (
    "checkpointing+bf16 from the complete recording of ResNet-34 and of Wide ResNet-50-2 is high at the smallest "
    "batches and nearer as the batch grows (ResNet-34 +10.4% at 16, +6.5% at 256; WRN-50-2 +12.2% at 8, +10.1% at 16, "
    "+0.2% at 128): a part that does not grow with the batch, kept by the lever and not by the real runs; not "
    "analysed (from their OOMs, whose blocks are read from the parameters, within 2.8% and 1.9%)"
)
_SMALL_BATCH_BOTH_AT = (
    ("fit_resnet34_b32_complete_python", 16),
    ("fit_wrn50_b16_complete_python", 8),
    ("fit_wrn50_b16_complete_python", 16),
)
_MOBILENET_CKPT = (
    "MobileNetV2's inverted residuals are not told apart by their stacks (each runs one Sequential of two "
    "conv-norm-activations and a projection, from one line of the features loop): the blocks found are halves of "
    "them, and checkpointing keeps more than the real runs, +21% to +27% (both levers; tests/test_fit_nested_blocks.py)"
)
_DENSENET_BF16 = (
    "DenseNet's concatenations are made in its own code (torchvision's bn_function), taken as arithmetic a float32 "
    "operand wins; every input is a convolution's or a batch norm's bfloat16 output, and the real runs make them "
    "bfloat16: bf16 +24% to +31%, with checkpointing +37% to +55% (the real lever is torchvision's memory_efficient, "
    "which checkpoints each dense layer's bottleneck only)"
)
_BLOOM_BOTH = (
    "BLOOM with checkpointing and bf16 at batch 16 is +14.9% (bf16 alone within 1.8%, checkpointing alone within "
    "3.9%): the real runs' peak falls with bf16 from 2.51 to 2.32 GiB where the lever's rises; not analysed (was "
    "+11.0% before the softmax's bfloat16 copy, tests/test_fit_nested_blocks.py)"
)
_LORA_BF16 = (
    "the LoRA adapters' sums (the frozen layer's output plus the adapter's, written in the model's code) are taken "
    "as arithmetic a float32 operand wins; both operands are matrix multiplies' bfloat16 outputs and the real runs "
    "make them bfloat16: bf16 +12.7% to +21.4%, largest batch 5 where 6 ran"
)
_STEM = "ran out in ResNet-50's stem (conv1's output at batch 512 is 1.5 GiB), before any block"
# (name, lever, batch) -> the known miss of the whole-step peak (today's error) and why; (name, lever,
# None) -> that of the largest batch under the cap (today's prediction and the real run's): the bound
# rule is tests/fit_known_misses.py's
OUTSIDE = {
    **{
        ("fit_t5_b4_complete_python", "bf16", batch): PeakMiss(error, _T5_BF16)
        for batch, error in ((4, -0.2092), (8, -0.2647), (16, -0.3104))
    },
    ("fit_t5_b4_complete_python", "bf16", None): BatchMiss(39, 24, _T5_BF16),
    ("fit_resnet18_b32_complete_python", "ckpt", 256): PeakMiss(+0.1038, _RESNET18_CKPT),
    ("fit_resnet34_b32_complete_python", "ckpt+bf16", 16): PeakMiss(+0.1040, _SMALL_BATCH_BOTH),
    ("fit_wrn50_b16_complete_python", "ckpt+bf16", 8): PeakMiss(+0.1215, _SMALL_BATCH_BOTH),
    ("fit_wrn50_b16_complete_python", "ckpt+bf16", 16): PeakMiss(+0.1013, _SMALL_BATCH_BOTH),
    **{
        ("fit_mobilenet_b32_complete_python", lever, batch): PeakMiss(error, _MOBILENET_CKPT)
        for lever, errors in (
            ("ckpt", (+0.2138, +0.2402, +0.2544, +0.2624, +0.2662)),
            ("ckpt+bf16", (+0.1784, +0.2005, +0.2190, +0.2264, +0.2314)),
        )
        for batch, error in zip((16, 32, 64, 128, 256), errors, strict=True)
    },
    **{
        ("fit_densenet_b16_complete_python", lever, batch): PeakMiss(error, _DENSENET_BF16)
        for lever, errors in (
            ("bf16", (+0.2380, +0.2640, +0.2880, +0.2963, +0.3088)),
            ("ckpt+bf16", (+0.3729, +0.4483, +0.4935, +0.5256, +0.5553)),
        )
        for batch, error in zip((8, 16, 32, 64, 128), errors, strict=True)
    },
    ("fit_bloom_b2_complete_python", "ckpt+bf16", 16): PeakMiss(+0.1493, _BLOOM_BOTH),
    **{
        ("fit_gpt2lora_b4_complete_python", "bf16", batch): PeakMiss(error, _LORA_BF16)
        for batch, error in ((1, +0.1273), (2, +0.1604), (4, +0.1860), (8, +0.2011), (16, +0.2115))
    },
    # from the OOM (a bound of 15%), at batch 1 within it: +13.6%
    **{
        ("fit_gpt2lora_b32_oom_python", "bf16", batch): PeakMiss(error, _LORA_BF16)
        for batch, error in ((2, +0.1665), (4, +0.1905), (8, +0.2045), (16, +0.2143))
    },
}
# refused where every number was wanted: the exception, the reason its message names, and why
_NO_BLOCK = "the forward ran out of memory before its first repeated block completed"
REFUSED = {
    "fit_convnext_b512_oom_python": Refusal("FitUnsupportedOom", _NO_BLOCK, _NO_READER),
    "fit_resnet50ft_b512_oom_python": Refusal("FitUnsupportedOom", _NO_BLOCK, _STEM),
    **{
        name: Refusal("FitUnsupportedOom", _NO_BLOCK, _FIRST_BLOCK)
        for name in (
            "fit_mobilenet_b1024_oom_python",
            "fit_densenet_b512_oom_python",
            "fit_swin_b512_oom_python",
            "fit_regnet_b1024_oom_python",
        )
    },
}
NOT_IN_DOCS = ("hftrainer", "lightning")  # families outside docs/fit.md's table (benchmarks/fit_accuracy.py)


def _levers(family: str) -> list[str]:
    return [lever for lever in LEVERS if family not in HALF_PRECISION_FAMILIES or not LEVERS[lever][1]]


def _cases() -> list[tuple[str, str, int]]:
    return [
        (name, lever, int(batch))
        for name, (family, _, _, _) in SNAPSHOTS.items()
        for lever in _levers(family)
        for batch, measured in FAMILIES[family]["levers"][lever]["uncapped"].items()
        if measured["ok"]
    ]


def test_every_known_miss_is_a_case_of_these_tests():
    """No entry outlives its case (a family or batch gone, a lever renamed), a refused snapshot has
    no other entry, and the largest batches' entries are batch misses, the peaks' peak misses."""
    cases = set(_cases())
    largest = {(name, lever, None) for name, v in SNAPSHOTS.items() for lever in _levers(v[0])}
    for (name, lever, batch), known in OUTSIDE.items():
        assert name not in REFUSED, name
        assert (name, lever, batch) in (largest if batch is None else cases), (name, lever, batch)
        assert isinstance(known, BatchMiss if batch is None else PeakMiss), (name, lever, batch)
    assert set(REFUSED) <= set(SNAPSHOTS)


@pytest.mark.parametrize(("name", "lever", "batch"), _cases())
def test_whole_step_peak_allocated_on_families_recorded_after_the_rules(real_frames, name, lever, batch):
    family, recorded, optimizer, bound = SNAPSHOTS[name]
    ckpt, bf16 = LEVERS[lever]
    extra = {"optimizer": optimizer} if optimizer else {}
    frames = real_frames(name)
    what = f"{name}, {lever} at {batch}"

    def predict():
        return predict_step(frames, batch_scale=batch / recorded, checkpointing=ckpt, bf16=bf16, **extra)

    if name in REFUSED:
        check_refused(attempt(predict), REFUSED[name], what)
        return
    allocated, _ = predict()
    measured = FAMILIES[family]["levers"][lever]["uncapped"][str(batch)]["peak_process_bytes"]
    check_peak(allocated / measured - 1, bound, OUTSIDE.get((name, lever, batch)), what)


@pytest.fixture(scope="module")
def under_the_cap(real_frames):
    out = {}
    for name, (family, recorded, optimizer, _) in SNAPSHOTS.items():
        cap = FAMILIES[family]["levers"]["plain"].get("cap_bytes", CAP)  # gpt2m: 8 GiB
        out[name] = attempt(
            lambda name=name, cap=cap, recorded=recorded, optimizer=optimizer: compute_fit(
                real_frames(name), memory_limit=cap, recorded_batch=recorded, optimizer=optimizer
            )
        )  # FitUnsupported: kept for the test to report
    return out


@pytest.mark.parametrize(("name", "lever"), [(n, lever) for n, v in SNAPSHOTS.items() for lever in _levers(v[0])])
def test_largest_batch_under_the_cap_near_the_real_runs(under_the_cap, name, lever):
    """Within 40% (or one batch), as for the three families the rules were built and checked on."""
    family = SNAPSHOTS[name][0]
    measured = FAMILIES[family]["levers"][lever]["largest_batch_under_cap"]
    fit = under_the_cap[name]
    what = f"{name}, {lever}"
    if name in REFUSED:
        check_refused(fit, REFUSED[name], f"{what} (real largest batch {measured})")
        return
    assert not isinstance(fit, ValueError), fit
    predicted = fit.largest_batch[OUR_NAMES[lever]]
    assert predicted is not None
    check_largest(predicted, measured, max(1, 0.4 * measured), OUTSIDE.get((name, lever, None)), what)


def test_the_largest_batch_tables_counts(under_the_cap):
    """docs/fit.md's table of largest batches (the families here of it) and the Trainer's and
    Lightning's OOMs: how many answers are exact, within one, hold the real run in their range."""
    rows = {False: [], True: []}
    for name, (family, _, _, _) in SNAPSHOTS.items():
        fit = under_the_cap[name]
        if isinstance(fit, ValueError):
            continue
        for lever in _levers(family):
            real = FAMILIES[family]["levers"][lever]["largest_batch_under_cap"]
            ours = OUR_NAMES[lever]
            answer = (
                fit.largest_batch_no_retry.get(ours),
                fit.largest_batch[ours],
                real,
                fit.largest_batch_at_most[ours],
            )
            rows[family in NOT_IN_DOCS].append(answer)
    check_tally(tally(rows[False]), TALLIES["tests/test_fit_holdout_late.py"], "docs/fit.md's families")
    check_tally(tally(rows[True]), TALLIES["tests/test_fit_holdout_late.py, not in docs/fit.md"], "Trainer, Lightning")


@pytest.mark.parametrize("name", [n for n, v in SNAPSHOTS.items() if v[0] in HALF_PRECISION_FAMILIES])
def test_a_model_in_half_precision_gets_no_bf16_lever_and_the_real_runs_agree(real_frames, name):
    """Llama and GPT-2 with bfloat16 parameters: bf16 autocast saved nothing in the real runs
    (Llama's peaks the same, GPT-2's up to 37% higher), and fit, reading the precision, offers no
    such lever, from the complete recordings and from the OOMs."""
    from snapshot_lab.metrics.fit.model import FitUnsupported
    from snapshot_lab.metrics.fit.precision import NO_BF16

    family, _, optimizer, _ = SNAPSHOTS[name]
    real = FAMILIES[family]["levers"]
    for batch, run in real["bf16"]["uncapped"].items():
        assert run["peak_process_bytes"] >= 0.99 * real["plain"]["uncapped"][batch]["peak_process_bytes"]
    with pytest.raises(FitUnsupported, match=re.escape(NO_BF16)):
        predict_step(real_frames(name), bf16=True, **({"optimizer": optimizer} if optimizer else {}))


@pytest.mark.parametrize("name", list(TWO_STACKS))
def test_an_oom_of_a_model_with_more_than_one_stack_of_blocks_is_refused(real_frames, name):
    """T5's encoder before its decoder's blocks, EfficientNet's stages of differing blocks: the
    blocks the forward ran are not the ones the rest of the model repeats, and copying them gave
    -37% and +600% (module docstring). GPT-2's, ViT's, Llama's and BERT's OOMs (1 to 7 parameters
    before their blocks, 2 to 6 after) are still answered (the tests above)."""
    from snapshot_lab.metrics.fit.extrapolate import MORE_THAN_ONE_STACK
    from snapshot_lab.metrics.fit.model import FitUnsupported

    before, count, after, period = TWO_STACKS[name]
    reason = MORE_THAN_ONE_STACK.format(before=before, count=count, after=after, period=period)
    with pytest.raises(FitUnsupported) as refused:
        predict_step(real_frames(name), optimizer="adamw")
    assert str(refused.value) == reason


def test_every_convnext_block_is_found(real_frames):
    """ConvNeXt-Tiny's 3 + 3 + 9 + 3 CNBlocks, in each of the two recorded passes: the rule that
    an instance begins where the first call inside the block comes round again found none (every
    CNBlock calls ``self.block`` from one line), and checkpointing was refused."""
    from snapshot_lab.metrics.fit.model import step_evidence

    ev = step_evidence(real_frames("fit_convnext_b16_complete_python"), 0, None)
    assert ev.n_blocks == 18
    assert [b.index for b in ev.blocks] == [*range(18), *range(18)]


def test_the_llama_oom_counts_its_eight_layers_and_its_head_from_the_parameters(real_frames):
    """8 layers (3 before: the MLP's three equal matrices were the longest repeat the next
    occurrence of a size showed), and logits 32000 / 1024 = 31.25 times the residual stream per
    token (0.0 before: the stream was read from RMSNorm's per-token variance)."""
    from snapshot_lab.metrics.fit.model import step_evidence

    ev = step_evidence(real_frames("fit_llama_b32_oom_python"), 0, "adamw")
    assert sorted({b.index for b in ev.blocks}) == list(range(8))
    assert "(8 repeated blocks, counted from the parameters; 2 ran)" in ev.notes[0]
    assert "making 31.2x the residual stream" in ev.notes[-1]


def test_the_bert_oom_reads_its_tied_decoder_from_the_bias_after_the_blocks(real_frames):
    """Logits 30522 / 768 = 39.7 times the stream per token, the decoder tied to the word
    embedding (before: a classifier's head of 2,359,296 bytes, the transform's 768 x 768, and no
    logits); ViT's OOM, whose class token is as wide as its model, keeps its classifier."""
    from snapshot_lab.metrics.fit.model import step_evidence

    bert = step_evidence(real_frames("fit_bert_b32_oom_python"), 0, "adamw")
    assert "a linear head tied to the embedding reading every token's output, making 39.7x" in bert.notes[-1]
    vit = step_evidence(real_frames("fit_vit_b128_oom_python"), 0, "adamw")
    assert "of 3,072,000 bytes reading one pooled vector per sample" in vit.notes[-1]


def _alive_at_forward_end(tape, category):
    """Bytes of ``category`` alive when the first pass's forward ends (recorded batch)."""
    first_backward = tape.start[tape.phase == "backward"].min()
    forward = (tape.phase == "forward") & (tape.start < first_backward)
    t = tape.start[forward].max()
    alive = (tape.start <= t) & (tape.end > t) & (tape.category == category)
    return int(tape.sizes(1.0)[alive].sum())


def test_bf16_weight_copies_and_kv_cache_as_the_bf16_recordings_show(real_frames):
    """From GPT-2's float32 recording, the bf16 lever makes a bfloat16 copy of every weight
    matrix (12 blocks' 4 matrices and the tied embedding, for the head), none before the copies
    rule (no creation stack names a module in a model moved with ``.to("cuda")``). It also copies
    the position table (1.5 MiB), which the recording does not (it is added, not multiplied): no
    rule yet tells it from ViT's patch convolution, which is copied. And it halves the KV cache's
    copies of keys and values, as the bf16 recording at the same batch keeps them (144 MiB where
    float32 kept 288; kept whole before)."""
    from snapshot_lab.metrics.fit import levers as lv
    from snapshot_lab.metrics.fit.model import step_evidence

    ev = step_evidence(real_frames("fit_gpt2_b4_complete_python"), 0)
    predicted = lv.bf16_autocast(ev.tape, ev)
    block_matrices = 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072) * 4
    position_table = 1024 * 768 * 4
    copies = (block_matrices + 8192 * 768 * 4 + position_table) // 2
    assert _alive_at_forward_end(predicted, "autocast_copy") == copies
    real = step_evidence(real_frames("fit_gpt2_b4_bf16_complete_python"), 0).tape
    assert _alive_at_forward_end(ev.tape, "kv_cache") == 288 << 20
    assert _alive_at_forward_end(real, "kv_cache") == 144 << 20
    assert _alive_at_forward_end(predicted, "kv_cache") == 144 << 20


def test_bf16_drops_the_probabilities_of_the_float32_attention_kernel(real_frames, under_the_cap):
    """Llama's float32 attention (grouped-query: SDPA's math kernel) keeps each layer's attention
    probabilities; under bf16 flash attention runs and keeps none (its bf16 recording). The lever
    drops what the attention call made beyond anything the block's linear layers made: Llama's
    largest batch with bf16 is 8 where 8 ran, from both recordings (7 when the probabilities were
    halved). ViT breaks the simpler rule "the attention's largest tensor when four times its next"
    (its next is a 0.08 MiB log-sum-exp, so its output was dropped: bf16 from within 3% to -5%);
    GPT-2's, BERT's and ViT's attention keep no probabilities in float32 and nothing is dropped."""
    from snapshot_lab.metrics.fit import levers as lv
    from snapshot_lab.metrics.fit.model import step_evidence

    for name in ("fit_llama_b2_complete_python", "fit_llama_b32_oom_python"):
        real = FAMILIES["llama"]["levers"]["bf16"]["largest_batch_under_cap"]
        assert under_the_cap[name].largest_batch["bf16"] == real
    llama = step_evidence(real_frames("fit_llama_b2_complete_python"), 0).tape
    dropped = lv._math_kernel_probabilities(llama)
    assert dropped.sum() == 32  # the scores and their softmax, per layer (8), per recorded step (2)
    assert set(llama.per_batch[dropped].tolist()) == {32 << 20}
    for name in ("fit_gpt2_b4_complete_python", "fit_bert_b2_complete_python", "fit_vit_b8_complete_python"):
        assert not lv._math_kernel_probabilities(step_evidence(real_frames(name), 0).tape).any(), name


def test_a_block_whose_output_is_made_outside_its_span_keeps_none_of_its_own(real_frames):
    """ConvNeXt's CNBlocks make their output after their last submodule (28 of its 36 block
    instances over the two recorded steps; the others are followed by a downsampling layer);
    ResNet-50's make theirs inside (an in-place ReLU), and its OOM's last extrapolated block is
    followed by the next pass's first tensor, made after the block's backward began: the rule
    that took any block-less tensor after the span fired there and moved ResNet's OOM
    checkpointing+bf16 answer from 297 to 316 (299 ran)."""
    import numpy as np

    from snapshot_lab.metrics.fit import levers as lv
    from snapshot_lab.metrics.fit.model import step_evidence

    def fired(name: str, optimizer: str | None = None) -> int:
        ev = step_evidence(real_frames(name), 0, optimizer)
        f_end = np.array([b.forward_end for b in ev.blocks])
        b_start = np.array([b.backward_start for b in ev.blocks])
        return int(lv._output_outside(ev.tape, f_end, b_start).sum())

    assert fired("fit_convnext_b16_complete_python") == 28
    assert fired("fit_resnet50_b16_complete_python") == 0
    assert fired("fit_resnet50_b512_oom_python", "sgd-momentum") == 0


@pytest.mark.parametrize("family", ["gemma", "qwen2", "mistral"])
def test_the_saved_probabilities_stay_to_their_blocks_backward_end(real_frames, family):
    """Gemma's complete recording frees each block's saved attention probabilities after the
    queries' and keys' gradients, four tensors of their size alive at once where the synthesized
    backward had three (freeing them once the next gradient was made, as other saved tensors):
    the checkpointed step from Gemma's OOM was -13.1% at batch 16. Found on Gemma, checked on
    Qwen2's and Mistral's OOMs (-13.2% each): all three within 4.1% at every batch measured (the
    tolerance of their general test, 15%, let the old rule pass)."""
    frames = real_frames(f"fit_{family}_b32_oom_python")
    for batch, measured in FAMILIES[family]["levers"]["ckpt"]["uncapped"].items():
        allocated, _ = predict_step(frames, batch_scale=int(batch) / 32, checkpointing=True, optimizer="adamw")
        assert abs(allocated / measured["peak_process_bytes"] - 1) <= 0.041, (family, batch)
