"""Issue #20's truth: what one job really needs at other batch sizes and under other levers.

Two families, each trained from a fresh model for every measurement:

- ``gpt2``: GPT-2 from a config (12 layers, d=768, 12 heads, vocab 8192, 1024 tokens, dropout 0),
  fp32 weights, AdamW;
- ``resnet50``: torchvision's ResNet-50 at 224x224, 1000 classes, SGD with momentum;
- ``vit``: torchvision's ViT-B/16 at 224x224 (an encoder; dropout 0), AdamW: recorded after the
  fit model was written, as a family it was never tuned on (hold-out);
- ``llama``: a Llama from a Hugging Face config (8 layers, d=1024, SwiGLU 2816, 16 heads with 8
  key/value heads, RMSNorm, rotary, untied head, vocab 32000, 512 tokens), fp32 weights, AdamW;
- ``convnext``: torchvision's ConvNeXt-Tiny at 224x224 (stochastic depth 0), AdamW. These two were
  recorded after every fit rule was written (hold-outs of a later session);
- ``bert``: BERT-base for masked language modelling from a Hugging Face config (12 layers, d=768,
  vocab 30522, 512 tokens, dropout 0), AdamW: a hold-out recorded after the ``.to("cuda")`` weight
  copy rule, before any rule was checked against it;
- ``effnet``: torchvision's EfficientNet-B0 at 224x224 (stochastic depth 0; depthwise
  convolutions, squeeze-and-excitation, SiLU), SGD with momentum; and ``t5``: T5 from a Hugging
  Face config (an encoder-decoder: 6 + 6 layers, d=512, d_ff 2048, 8 heads, vocab 32128, 512 input
  and 128 target tokens, dropout 0), AdamW. Both recorded on 2026-11-26 after every rule, as
  hold-outs of two designs no family had (two kinds of repeated block in one model, for T5);
- ``llamabf16``: the ``llama`` family with bfloat16 parameters and AdamW state (pure bf16
  training), recorded on 2026-11-26: is the precision read right, and the rest unchanged?
- ``gpt2bf16``: the ``gpt2`` family with bfloat16 parameters, recorded after the rules that
  ``llamabf16`` broke were rewritten (a layer norm, no float32 upcast: their hold-out).
- ``neox``: GPT-NeoX from a Hugging Face config (12 layers, d=768, rotary, attention and MLP in
  parallel off one residual, untied head, vocab 8192, 1024 tokens), AdamW; ``opt``: OPT from a
  config (12 layers, d=768, learned positions with an offset of 2, ReLU, tied head, vocab 8192,
  1024 tokens), AdamW. Recorded on 2026-11-26 (later) with every rule untouched: how fit does on
  two decoders it has never seen.
- ``phi`` (partial rotary, attention and MLP in parallel, biased untied head), ``distilbert`` (6
  layers, tied decoder, 512 tokens), ``gpt2m`` (GPT-2 of 24 layers, d=1024, 512 tokens, under an
  8 GiB cap), ``resnet18`` (basic blocks, SGD with momentum) and ``resnet101`` (AdamW): recorded
  on 2026-11-27 with every rule untouched (DistilBERT's checkpointed recordings crash torch 2.11's
  recorder: a SystemError in the backward). Then ``mistral``, ``resnet34`` and ``wrn50`` (Wide
  ResNet-50-2, SGD with momentum), hold-outs of the rules those five changed.
- ``mobilenet`` (MobileNetV2), ``densenet`` (DenseNet-121, its checkpointing torchvision's own
  ``memory_efficient``), ``swin`` (the Swin-T architecture) and ``bloom`` (BLOOM from a config):
  recorded on 2026-11-27 (second session) with every rule untouched; then ``gpt2eager`` and
  ``llamaeager`` (eager attention) and ``regnet`` (RegNetY-400MF), the hold-outs of the two rules
  those four changed (docs/fit-history.md).

Lever snapshots: the complete recording again under ``bf16``, ``ckpt`` and ``ckpt+bf16`` (names
with ``_`` for ``+``), to see what autocast and checkpointing really allocate, tensor by tensor.

Levers: ``plain``, ``ckpt`` (activation checkpointing of every repeated block), ``bf16`` (autocast),
``ckpt+bf16``. For every lever and batch size (a list spanning 16x) the peak allocated and reserved
over the first two whole training steps (forward, backward, optimizer step) of a fresh model,
uncapped; and under a 6 GiB per-process cap, the largest batch whose two whole steps really ran
(searched by doubling then bisection, each try a fresh model after ``empty_cache``).

Snapshots (with truth): a complete recording of two steps at one batch size, and a recording
that runs out of memory in its first forward under the cap (dumped by the OOM observer).

    python3 sample_snapshots/workloads_fit.py all --out /tmp/fit --jobs 8
    python3 sample_snapshots/workloads_fit.py all --groups fit_vit --out /tmp/fit --jobs 6   # one family
"""

from __future__ import annotations

import gc
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads_holdout as H

CAP_BYTES = 6 * 2**30
LEVERS = ("plain", "ckpt", "bf16", "ckpt+bf16")
FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 64},
    "resnet50": {"batches": [8, 16, 32, 64, 128], "complete": 16, "oom": 512, "search_max": 1024},
    "vit": {"batches": [4, 8, 16, 32, 64], "complete": 8, "oom": 128, "search_max": 256},
    "llama": {"batches": [1, 2, 4, 8, 16], "complete": 2, "oom": 32, "search_max": 128},
    "convnext": {"batches": [8, 16, 32, 64, 128], "complete": 16, "oom": 512, "search_max": 1024},
    "bert": {"batches": [1, 2, 4, 8, 16], "complete": 2, "oom": 32, "search_max": 128},
    "effnet": {"batches": [8, 16, 32, 64, 128], "complete": 16, "oom": 256, "search_max": 1024},
    "t5": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 64, "search_max": 256},
    "llamabf16": {"batches": [1, 2, 4, 8, 16], "complete": 2, "oom": 64, "search_max": 256},
    "gpt2bf16": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 64, "search_max": 256},
    "neox": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 64},
    "opt": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 64},
    # 2026-11-26 (third session), recorded with every rule untouched: Gemma (multi-query attention,
    # GeGLU, a tied and scaled embedding) and Qwen2 (grouped-query attention with biased q/k/v)
    "gemma": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 64},
    "qwen2": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 64},
    # 2026-11-27, recorded with every rule untouched: Phi (partial rotary, attention and MLP in
    # parallel, biased head), DistilBERT (6 layers, tied decoder), a GPT-2 of 24 layers of d=1024 at
    # 512 tokens under an 8 GiB cap (another size, sequence length and cap than the issue's),
    # ResNet-18 (basic blocks: no projection in its first stage) and ResNet-101 with AdamW
    "phi": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 64},
    "distilbert": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 64, "search_max": 256},
    "gpt2m": {"batches": [1, 2, 4, 8, 16], "complete": 2, "oom": 32, "search_max": 128, "cap": 8 * 2**30},
    "resnet18": {"batches": [16, 32, 64, 128, 256], "complete": 32, "oom": 512, "search_max": 1024},
    "resnet101": {"batches": [8, 16, 32, 64, 128], "complete": 16, "oom": 512, "search_max": 1024},
    # 2026-11-27 (later), after the rules the five above changed: Mistral (GQA, SwiGLU, untied head),
    # ResNet-34 (basic blocks, 16 of them) and Wide ResNet-50-2 (bottlenecks twice as wide)
    "mistral": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 64},
    "resnet34": {"batches": [16, 32, 64, 128, 256], "complete": 32, "oom": 512, "search_max": 1024},
    "wrn50": {"batches": [8, 16, 32, 64, 128], "complete": 16, "oom": 512, "search_max": 1024},
    # 2026-11-27 (second session), recorded with every rule untouched: MobileNetV2 (inverted
    # residuals, depthwise convolutions, ReLU6), DenseNet-121 (concatenating dense layers, its own
    # memory-efficient checkpointing), Swin-T (windowed attention in stages with patch merging) and
    # BLOOM (ALiBi attention, whose scores torch materialises in float32) from a config
    "mobilenet": {"batches": [16, 32, 64, 128, 256], "complete": 32, "oom": 1024, "search_max": 2048},
    "densenet": {"batches": [8, 16, 32, 64, 128], "complete": 16, "oom": 512, "search_max": 1024},
    "swin": {"batches": [8, 16, 32, 64, 128], "complete": 16, "oom": 512, "search_max": 1024},
    "bloom": {"batches": [1, 2, 4, 8, 16], "complete": 2, "oom": 32, "search_max": 128},
    # the same session, after the rule BLOOM's and Swin-T's bf16 recordings gave (a softmax's result is
    # kept in float32 and a bfloat16 copy of it too): its hold-outs, GPT-2 and the Llama above with
    # transformers' eager attention (a softmax in Python, then a cast to the values' dtype)
    "gpt2eager": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 64},
    "llamaeager": {"batches": [1, 2, 4, 8, 16], "complete": 2, "oom": 32, "search_max": 128},
    # and the hold-out of the rule Swin-T and DenseNet-121 gave (a block site nested in a stage loop):
    # torchvision's RegNetY-400MF, whose trunk loops over its stages, then each stage's blocks
    "regnet": {"batches": [16, 32, 64, 128, 256], "complete": 32, "oom": 1024, "search_max": 2048},
    # 2026-11-27 (third session), fine-tuning, which no family did: parameters that take no gradient
    # and have no optimizer state. GPT-2 with its (tied) embeddings and first six blocks frozen,
    # ResNet-50 with its stem, layer1 and layer2 frozen (layer3, layer4 and the head trained), and
    # GPT-2 frozen whole with LoRA adapters (rank 16) on every block's c_attn and c_fc. Then, left
    # unread until the rules these three give were committed: ViT-B/16 with its patch embedding and
    # first six encoder layers frozen, and the Llama above with LoRA adapters on q_proj and v_proj
    "gpt2frozen": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 128},
    "resnet50ft": {"batches": [16, 32, 64, 128, 256], "complete": 32, "oom": 512, "search_max": 2048},
    "gpt2lora": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 128},
    "vitft": {"batches": [4, 8, 16, 32, 64], "complete": 8, "oom": 256, "search_max": 1024},
    "llamalora": {"batches": [1, 2, 4, 8, 16], "complete": 2, "oom": 32, "search_max": 128},
    # and, after those were committed, a hold-out made by the library users fine-tune with: GPT-2 with
    # PEFT's LoRA (rank 16, alpha 32, on c_attn and c_fc; peft 0.21.2 carried as a wheel)
    "gpt2peft": {"batches": [1, 2, 4, 8, 16], "complete": 4, "oom": 32, "search_max": 128},
    # the hold-out of the two rules GPT-2 with PEFT gave (PEFT's adapters are parameters; their
    # arithmetic is bfloat16 under autocast): the llama family's model with PEFT's LoRA on q_proj and v_proj
    "llamapeft": {"batches": [1, 2, 4, 8, 16], "complete": 2, "oom": 32, "search_max": 128},
}
# their lever snapshots go in their own group
NEW_FAMILIES = ("effnet", "t5", "llamabf16", "gpt2bf16", "neox", "opt", "gemma", "qwen2", "phi", "distilbert",
                "gpt2m", "resnet18", "resnet101", "mistral", "resnet34", "wrn50", "mobilenet", "densenet", "swin",
                "bloom", "gpt2eager", "llamaeager", "regnet", "gpt2frozen", "resnet50ft", "gpt2lora", "vitft",
                "llamalora", "gpt2peft", "llamapeft")
LLAMA_TOKENS = 512
TOKENS = {"gpt2": (8192, 1024), "llama": (32000, LLAMA_TOKENS), "bert": (30522, 512), "t5": (32128, 512),
          "llamabf16": (32000, LLAMA_TOKENS), "gpt2bf16": (8192, 1024), "neox": (8192, 1024), "opt": (8192, 1024),
          "gemma": (8192, 1024), "qwen2": (8192, 1024), "phi": (8192, 1024), "distilbert": (30522, 512),
          "gpt2m": (8192, 512), "mistral": (8192, 1024), "bloom": (8192, 512),
          "gpt2eager": (8192, 1024), "llamaeager": (32000, LLAMA_TOKENS), "gpt2frozen": (8192, 1024),
          "gpt2lora": (8192, 1024), "llamalora": (32000, LLAMA_TOKENS),
          "gpt2peft": (8192, 1024), "llamapeft": (32000, LLAMA_TOKENS)}
T5_TARGET_TOKENS = 128


def _cap(family: str) -> int:
    return int(FAMILIES.get(family, {}).get("cap", CAP_BYTES))


def _transformers_model(model, lever: str, freeze=None):
    """A Hugging Face model in training, checkpointed (non-reentrant) when asked, with AdamW over
    the parameters that ``freeze(model)`` (when given) left trainable."""
    import torch

    if freeze is not None:
        freeze(model)
    if "ckpt" in lever:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def _frozen(*modules) -> None:
    for module in modules:
        module.requires_grad_(False)


def _lora(base, d_in: int, d_out: int, rank: int = 16):
    """``base`` (frozen) plus a trainable low-rank update, as LoRA adapters add it."""
    import torch

    class LoRA(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = base
            self.lora_a = torch.nn.Parameter(torch.randn(d_in, rank, device="cuda") * 0.01)
            self.lora_b = torch.nn.Parameter(torch.zeros(rank, d_out, device="cuda"))

        def forward(self, x):
            return self.base(x) + (x @ self.lora_a) @ self.lora_b * 2.0

    return LoRA()


def _gpt2_lora(model) -> None:
    """GPT-2 frozen whole, adapters on every block's c_attn and c_fc (transformers' Conv1D: weight
    ``(in, out)``)."""
    _frozen(model)
    for block in model.transformer.h:
        block.attn.c_attn = _lora(block.attn.c_attn, *block.attn.c_attn.weight.shape)
        block.mlp.c_fc = _lora(block.mlp.c_fc, *block.mlp.c_fc.weight.shape)


def _llama_lora(model) -> None:
    """Llama frozen whole, adapters on every layer's q_proj and v_proj."""
    _frozen(model)
    for layer in model.model.layers:
        for name in ("q_proj", "v_proj"):
            base = getattr(layer.self_attn, name)
            setattr(layer.self_attn, name, _lora(base, base.in_features, base.out_features))


def build(family: str, lever: str):
    import torch

    torch.manual_seed(0)
    if family in ("gpt2", "gpt2bf16", "gpt2eager", "gpt2frozen", "gpt2lora"):
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=8192, n_positions=1024,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        if family == "gpt2eager":
            cfg._attn_implementation = "eager"
        dtype = torch.bfloat16 if family == "gpt2bf16" else torch.float32
        freeze = {"gpt2frozen": lambda m: _frozen(m.transformer.wte, m.transformer.wpe, *m.transformer.h[:6]),
                  "gpt2lora": _gpt2_lora}.get(family)
        model, opt = _transformers_model(GPT2LMHeadModel(cfg).to("cuda", dtype=dtype), lever, freeze)
    elif family == "gpt2peft":
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=8192, n_positions=1024,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["c_attn", "c_fc"],
                          fan_in_fan_out=True)
        model, opt = _transformers_model(get_peft_model(GPT2LMHeadModel(cfg).to("cuda"), lora), lever)
    elif family == "gpt2m":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, vocab_size=8192, n_positions=512,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model, opt = _transformers_model(GPT2LMHeadModel(cfg).to("cuda"), lever)
    elif family == "phi":
        from transformers import PhiConfig, PhiForCausalLM

        cfg = PhiConfig(vocab_size=8192, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=1024, partial_rotary_factor=0.5,
                        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, tie_word_embeddings=False)
        model, opt = _transformers_model(PhiForCausalLM(cfg).to("cuda"), lever)
    elif family == "distilbert":
        from transformers import DistilBertConfig, DistilBertForMaskedLM

        cfg = DistilBertConfig(vocab_size=30522, max_position_embeddings=512, n_layers=6, n_heads=12, dim=768,
                               hidden_dim=3072, dropout=0.0, attention_dropout=0.0)
        model, opt = _transformers_model(DistilBertForMaskedLM(cfg).to("cuda"), lever)
    elif family == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        cfg = MistralConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                            num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024,
                            tie_word_embeddings=False, attention_dropout=0.0)
        model, opt = _transformers_model(MistralForCausalLM(cfg).to("cuda"), lever)
    elif family in ("resnet50", "resnet18", "resnet101", "resnet34", "wrn50"):
        import torchvision

        arch = "wide_resnet50_2" if family == "wrn50" else family
        model = getattr(torchvision.models, arch)().to("cuda").train()
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-4) if family == "resnet101"
               else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    elif family == "resnet50ft":
        import torchvision

        model = torchvision.models.resnet50().to("cuda").train()
        _frozen(model.conv1, model.bn1, model.layer1, model.layer2)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    elif family in ("llama", "llamabf16", "llamaeager", "llamalora", "llamapeft"):
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1024,
                          tie_word_embeddings=False, attention_dropout=0.0)
        if family == "llamaeager":
            cfg._attn_implementation = "eager"
        # llamabf16: the same model with bfloat16 parameters (and so AdamW state), as LLM
        # fine-tuning often runs: the bf16 lever has nothing to halve
        dtype = torch.bfloat16 if family == "llamabf16" else torch.float32
        freeze = _llama_lora if family == "llamalora" else None
        model = LlamaForCausalLM(cfg).to("cuda", dtype=dtype)
        if family == "llamapeft":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                     target_modules=["q_proj", "v_proj"]))
        model, opt = _transformers_model(model, lever, freeze)
    elif family == "bert":
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model, opt = _transformers_model(BertForMaskedLM(cfg).to("cuda"), lever)
    elif family == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_decoder_layers=6, num_heads=8,
                       vocab_size=32128, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        model, opt = _transformers_model(T5ForConditionalGeneration(cfg).to("cuda"), lever)
    elif family == "neox":
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        cfg = GPTNeoXConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                            vocab_size=8192, max_position_embeddings=1024, use_parallel_residual=True,
                            hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False)
        model, opt = _transformers_model(GPTNeoXForCausalLM(cfg).to("cuda"), lever)
    elif family == "opt":
        from transformers import OPTConfig, OPTForCausalLM

        cfg = OPTConfig(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
                        vocab_size=8192, max_position_embeddings=1024, word_embed_proj_dim=768,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        model, opt = _transformers_model(OPTForCausalLM(cfg).to("cuda"), lever)
    elif family == "gemma":
        from transformers import GemmaConfig, GemmaForCausalLM

        cfg = GemmaConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                          num_key_value_heads=1, head_dim=64, vocab_size=8192, max_position_embeddings=1024,
                          attention_dropout=0.0)
        model, opt = _transformers_model(GemmaForCausalLM(cfg).to("cuda"), lever)
    elif family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                          num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024,
                          tie_word_embeddings=False, attention_dropout=0.0)
        model, opt = _transformers_model(Qwen2ForCausalLM(cfg).to("cuda"), lever)
    elif family == "bloom":
        from transformers import BloomConfig, BloomForCausalLM

        cfg = BloomConfig(vocab_size=8192, hidden_size=768, n_layer=12, n_head=12, hidden_dropout=0.0,
                          attention_dropout=0.0)
        model, opt = _transformers_model(BloomForCausalLM(cfg).to("cuda"), lever)
    elif family == "mobilenet":
        import torchvision

        model = torchvision.models.mobilenet_v2(dropout=0.0).to("cuda").train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif family == "densenet":
        import torchvision

        # torchvision's own checkpointing of each dense layer's bottleneck (memory_efficient)
        model = torchvision.models.densenet121(memory_efficient="ckpt" in lever).to("cuda").train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif family == "regnet":
        import torchvision

        model = torchvision.models.regnet_y_400mf().to("cuda").train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif family == "swin":
        import torchvision

        model = torchvision.models.swin_transformer.SwinTransformer(
            patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24], window_size=[7, 7],
            stochastic_depth_prob=0.0).to("cuda").train()  # swin_t's architecture, stochastic depth 0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif family == "effnet":
        import torchvision

        model = torchvision.models.efficientnet_b0(stochastic_depth_prob=0.0).to("cuda").train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif family == "convnext":
        import torchvision

        model = torchvision.models.convnext_tiny(stochastic_depth_prob=0.0).to("cuda").train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        import torchvision

        model = torchvision.models.vit_b_16().to("cuda").train()
        if family == "vitft":
            _frozen(model.conv_proj, *model.encoder.layers[:6])
            model.class_token.requires_grad_(False)
            model.encoder.pos_embedding.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def resnet_forward(model, x, ckpt: bool):
    from torch.utils.checkpoint import checkpoint

    x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in stage:
            x = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
    return model.fc(model.avgpool(x).flatten(1))


def vit_forward(model, x, ckpt: bool):
    """torchvision's VisionTransformer.forward, with each encoder block checkpointed when asked."""
    import torch
    from torch.utils.checkpoint import checkpoint

    x = model._process_input(x)
    x = torch.cat([model.class_token.expand(x.shape[0], -1, -1), x], dim=1)
    enc = model.encoder
    x = enc.dropout(x + enc.pos_embedding)
    for block in enc.layers:
        x = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
    return model.heads(enc.ln(x)[:, 0])


def staged_forward(model, x, ckpt: bool, block: str, flatten: bool, head: bool = True):
    """torchvision's ConvNeXt.forward (``block="CNBlock"``) and EfficientNet.forward (``"MBConv"``,
    whose pooled features are flattened before the classifier): ``features`` stage by stage, with
    each block of the stages made of ``block`` checkpointed when asked."""
    import torch
    from torch.utils.checkpoint import checkpoint

    for stage in model.features:
        if ckpt and isinstance(stage, torch.nn.Sequential) and type(stage[0]).__name__ == block:
            for each in stage:
                x = checkpoint(each, x, use_reentrant=False)
        else:
            x = stage(x)
    if not head:
        return x
    pooled = model.avgpool(x)
    return model.classifier(pooled.flatten(1) if flatten else pooled)


def mobilenet_forward(model, x, ckpt: bool):
    """torchvision's MobileNetV2.forward, with each inverted residual checkpointed when asked."""
    import torch
    from torch.utils.checkpoint import checkpoint

    for layer in model.features:
        checkpointed = ckpt and type(layer).__name__ == "InvertedResidual"
        x = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
    return model.classifier(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, (1, 1)), 1))


def regnet_forward(model, x, ckpt: bool):
    """torchvision's RegNet.forward (its own, which loops over the stages, then each stage's
    blocks), or with each block checkpointed when asked."""
    from torch.utils.checkpoint import checkpoint

    if not ckpt:
        return model(x)
    x = model.stem(x)
    for stage in model.trunk_output:
        for block in stage:
            x = checkpoint(block, x, use_reentrant=False)
    return model.fc(model.avgpool(x).flatten(1))


def swin_forward(model, x, ckpt: bool):
    """torchvision's SwinTransformer.forward, with each Swin block checkpointed when asked."""
    x = staged_forward(model, x, ckpt, "SwinTransformerBlock", flatten=False, head=False)
    return model.head(model.flatten(model.avgpool(model.permute(model.norm(x)))))


def step(family: str, lever: str, model, opt, batch: int, gen) -> None:
    import torch

    if family in TOKENS:
        vocab, tokens = TOKENS[family]
        ids = torch.randint(0, vocab, (batch, tokens), generator=gen).to("cuda")
        labels = ids[:, :T5_TARGET_TOKENS].contiguous() if family == "t5" else ids
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled="bf16" in lever):
            loss = model(input_ids=ids, labels=labels).loss
    else:
        x = torch.randn(batch, 3, 224, 224, generator=gen).to("cuda")
        y = torch.randint(0, 1000, (batch,), generator=gen).to("cuda")
        forward = {"resnet50": resnet_forward, "resnet18": resnet_forward, "resnet101": resnet_forward,
                   "resnet34": resnet_forward, "wrn50": resnet_forward, "resnet50ft": resnet_forward,
                   "vit": vit_forward, "vitft": vit_forward,
                   "convnext": partial(staged_forward, block="CNBlock", flatten=False),
                   "effnet": partial(staged_forward, block="MBConv", flatten=True),
                   "mobilenet": mobilenet_forward, "swin": swin_forward, "regnet": regnet_forward,
                   "densenet": lambda model, x, ckpt: model(x)}[family]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled="bf16" in lever):
            loss = torch.nn.functional.cross_entropy(forward(model, x, "ckpt" in lever), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(family: str, lever: str, batch: int) -> dict[str, Any]:
    """Two whole steps from a fresh model: peak allocated/reserved, or the OOM."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gen = torch.Generator().manual_seed(batch)
    model = opt = None
    try:
        model, opt = build(family, lever)
        for _ in range(2):
            step(family, lever, model, opt, batch, gen)
        torch.cuda.synchronize()
        # base: what the process held before the model, after an earlier measurement: cuBLAS's
        # workspaces (made by the first run, kept by its handles), so the first measurement's
        # peak_allocated_bytes counts them and the others' do not; peak_process_bytes counts
        # them always, as a capped job and a snapshot of it do
        res = {"ok": True, "peak_allocated_bytes": torch.cuda.max_memory_allocated() - base,
               "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "base_bytes": base,
               "peak_process_bytes": torch.cuda.max_memory_allocated()}
    except torch.OutOfMemoryError:
        res = {"ok": False}
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return res


def largest_under_cap(measure_at, top: int) -> tuple[int, dict[str, Any]]:
    """Doubling, then bisection: the largest batch whose run (``measure_at(batch)``, a
    :func:`measure`-like result) ran under the cap."""
    tries: dict[str, Any] = {}

    def fits(batch: int) -> bool:
        res = measure_at(batch)
        tries[str(batch)] = res
        return bool(res["ok"])

    lo, hi = 0, 1
    while hi <= top and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, tries


def table_job(family: str, lever: str, measure_at=None, batches=None, top: int | None = None) -> None:
    """The family's peaks at ``batches`` uncapped and its largest batch under its cap, measured by
    ``measure_at(batch)`` (default: :func:`measure` of the family's model and ``FAMILIES``' batches):
    ``fittable_<family>_<lever>.json``."""
    import torch

    measure_at = measure_at or (lambda batch: measure(family, lever, batch))
    out: dict[str, Any] = {"family": family, "lever": lever, "uncapped": {}}
    for batch in batches or FAMILIES[family]["batches"]:
        out["uncapped"][str(batch)] = measure_at(batch)
        print(family, lever, batch, out["uncapped"][str(batch)], flush=True)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(_cap(family) / total)
    best, tries = largest_under_cap(measure_at, top or FAMILIES[family]["search_max"])
    out["cap_bytes"] = _cap(family)
    out["largest_batch_under_cap"] = best
    out["cap_tries"] = tries
    print(family, lever, "largest under cap:", best, flush=True)
    (H.OUT / f"fittable_{family}_{lever}.json").write_text(json.dumps(out, indent=1))


for _family in FAMILIES:
    for _lever in LEVERS:
        H.workload(f"fittable_{_family}_{_lever}", f"fit_{_family}")(lambda f=_family, v=_lever: table_job(f, v))


def _dump_at_first_oom(name: str, info: dict[str, Any], cap: int = CAP_BYTES) -> None:
    """Cap the process at ``cap`` and dump the snapshot at its first out-of-memory error."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    dumped = {"done": False}

    def on_oom(device, alloc, device_alloc, device_free):
        if not dumped["done"]:
            dumped["done"] = True
            H.dump(name, {**info, "dumped": "by the OOM observer", "oom_request_bytes": alloc,
                          "oom_observed": True, "requested_bytes": alloc,
                          "observer_device_allocated": device_alloc, "observer_device_free": device_free})

    torch._C._cuda_attach_out_of_memory_observer(on_oom)


def _snapshot_run(family: str, batch: int, capped: bool, lever: str = "plain") -> None:
    import torch

    tag = "" if lever == "plain" else lever.replace("+", "_") + "_"
    name = f"fit_{family}_b{batch}_{tag}" + ("oom_python" if capped else "complete_python")
    info: dict[str, Any] = {"kind": "fit-oom-first-forward" if capped else "fit-complete", "family": family,
                            "lever": lever, "batch": batch, "stacks": "python",
                            "cap_bytes": _cap(family) if capped else None}
    if capped:
        _dump_at_first_oom(name, info, _cap(family))
    H.record(stacks="python")
    model, opt = build(family, lever)
    gen = torch.Generator().manual_seed(batch)
    try:
        for _ in range(2):
            step(family, lever, model, opt, batch, gen)
    except torch.OutOfMemoryError as exc:
        info["oom"] = str(exc)[:300]
        print(name, "OOM as planned" if capped else "UNEXPECTED OOM", flush=True)
        return
    params = list(model.parameters())
    H.dump(name, {**info, "steps_done": 2, "dumped": "after two whole steps (after zero_grad)",
                  "param_bytes": sum(p.numel() * p.element_size() for p in params),
                  "optimizer_state_bytes": sum(t.numel() * t.element_size() for st in opt.state.values()
                                               for t in st.values() if torch.is_tensor(t) and t.is_cuda),
                  "trainable_param_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
                  "optimizer": type(opt).__name__})


for _family, _cfg in FAMILIES.items():
    H.workload(f"fit_{_family}_b{_cfg['complete']}_complete_python", f"fit_{_family}")(
        lambda f=_family, b=_cfg["complete"]: _snapshot_run(f, b, False))
    H.workload(f"fit_{_family}_b{_cfg['oom']}_oom_python", f"fit_{_family}")(
        lambda f=_family, b=_cfg["oom"]: _snapshot_run(f, b, True))
    for _lever in LEVERS[1:]:
        H.workload(f"fit_{_family}_b{_cfg['complete']}_{_lever.replace('+', '_')}_complete_python",
                   "fit_bert" if _family == "bert" else f"fit_{_family}" if _family in NEW_FAMILIES else "fitlever")(
            lambda f=_family, b=_cfg["complete"], v=_lever: _snapshot_run(f, b, False, v))



# 2026-11-26 (later): two questions the tables above cannot answer.
# 1. Precision of convolutional networks (group fit_precision): half-precision parameters read
#    from the sizes of convolutions and their batch norms, tested on ResNet-50 and EfficientNet-B0
#    in float16 inference, a ResNet-18 trained with bfloat16 parameters, and float32 controls.
# 2. What a capped run does at its largest batch (group fit_boundary): the job at the largest
#    batch that ran under the cap and at one more, recorded, with every out-of-memory error the
#    observer saw (cuDNN catches one on a convolution's workspace and tries another algorithm).
PRECISION_RUNS = {
    "fit_resnet50_fp16_inference_b64_python": ("resnet50", "float16", "inference", 64),
    "fit_effnet_fp16_inference_b64_python": ("efficientnet_b0", "float16", "inference", 64),
    "fit_resnet18bf16_b32_complete_python": ("resnet18", "bfloat16", "train", 32),
    "fit_resnet50_fp32_inference_b64_python": ("resnet50", "float32", "inference", 64),
    "fit_effnet_fp32_inference_b64_python": ("efficientnet_b0", "float32", "inference", 64),
}
BOUNDARY_RUNS = {
    "resnet50": ("ckpt", (162, 163)),
    "convnext": ("ckpt", (194, 195)),
    "gpt2": ("ckpt", (27, 28)),
    "vit": ("ckpt", (232, 233)),
}


def _precision_run(name: str, arch: str, dtype_name: str, mode: str, batch: int) -> None:
    import torch
    import torchvision

    dtype = getattr(torch, dtype_name)
    H.record(stacks="python")
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)().to("cuda", dtype=dtype)
    gen = torch.Generator().manual_seed(batch)
    info: dict[str, Any] = {"kind": f"fit-precision-{mode}", "arch": arch, "parameter_dtype": dtype_name,
                            "batch": batch, "stacks": "python",
                            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    if mode == "inference":
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(batch, 3, 224, 224, generator=gen).to("cuda", dtype=dtype)
                model(x).argmax(1)
        info["forwards"] = 3
    else:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            x = torch.randn(batch, 3, 224, 224, generator=gen).to("cuda", dtype=dtype)
            y = torch.randint(0, 1000, (batch,), generator=gen).to("cuda")
            torch.nn.functional.cross_entropy(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        info.update(steps_done=2, optimizer="SGD")
    torch.cuda.synchronize()
    H.dump(name, info)


def _boundary_run(family: str, lever: str, batch: int) -> None:
    import torch

    name = f"fit_{family}_b{batch}_{lever.replace('+', '_')}_capped_python"
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total)
    seen: list[list[int]] = []
    torch._C._cuda_attach_out_of_memory_observer(
        lambda device, alloc, device_alloc, device_free: seen.append([int(alloc), int(device_alloc), int(device_free)]))
    H.record(stacks="python")
    model, opt = build(family, lever)
    gen = torch.Generator().manual_seed(batch)
    info: dict[str, Any] = {"kind": "fit-capped-boundary", "family": family, "lever": lever, "batch": batch,
                            "stacks": "python", "cap_bytes": CAP_BYTES, "steps_done": 0}
    try:
        for _ in range(2):
            step(family, lever, model, opt, batch, gen)
            info["steps_done"] += 1
    except torch.OutOfMemoryError as exc:
        info["oom"] = str(exc)[:300]
    torch.cuda.synchronize()
    info["oom_observed"] = seen  # (request, device allocated, device free) of every OOM, caught or not
    H.dump(name, info)


# an OOM in the first forward of a checkpointed job (GPT-2 at batch 128 with checkpointing under the
# cap: every block keeps its input, 384 MiB each): does fit read the step as checkpointed?
H.workload("fit_gpt2_b128_ckpt_oom_python", "fit_ckptoom")(lambda: _snapshot_run("gpt2", 128, True, "ckpt"))
for _name, _run in PRECISION_RUNS.items():
    H.workload(_name, "fit_precision")(lambda n=_name, r=_run: _precision_run(n, *r))
for _family, (_lever, _batches) in BOUNDARY_RUNS.items():
    for _batch in _batches:
        H.workload(f"fit_{_family}_b{_batch}_{_lever}_capped_python", "fit_boundary")(
            lambda f=_family, v=_lever, b=_batch: _boundary_run(f, v, b))

# 2026-11-26 (third session): recordings made under autocast, which users attach as often as
# float32 ones (group fit_autocast). fit took autocast's weight copies for activations:
# 1. OOMs in the first forward under bf16 autocast (GPT-2, Llama, ViT), against the bf16 tables;
# 2. transformers' Trainer with bf16=True on the frameworks' small GPT-2 (4 layers, d=512, 256
#    tokens): a snapshot at batch 8, and the whole two steps' peak at 8, 16, 32 and 64 (truth);
# 3. Llama inference under bf16 autocast (no_grad, three forwards): a snapshot at batch 8, and the
#    peak at 8, 16 and 32.
AUTOCAST_OOMS = {"gpt2": 32, "llama": 32, "vit": 256}
TRAINER_BATCHES = (8, 16, 32, 64)
INFER_BATCHES = (8, 16, 32)


def _trainer(batch: int, steps: int, on_end=None):
    import transformers
    import workloads_frameworks as F

    model = F.gpt2()

    class End(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == steps and on_end is not None:
                on_end(model)

    args = transformers.TrainingArguments(
        output_dir=str(H.OUT / f"hf_tmp_{batch}"),
        per_device_train_batch_size=batch,
        max_steps=steps,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        bf16=True,
    )
    transformers.Trainer(model=model, args=args, train_dataset=F.lm_dataset(batch * steps), callbacks=[End()]).train()



# 2026-11-27: the ticket as a Hugging Face Trainer job (group fit_hftrainer_oom): GPT-2 of
# 12 layers, d=768, vocab 8192, 1024 tokens, fp32, the Trainer's own AdamW, gradient clipping and
# schedule, out of memory in its first forward at batch 32 under 6 GiB; the truth is Trainer runs
# under the four levers (bf16=True, gradient_checkpointing=True), as a user would change them
TRAINER_OOM_BATCHES = [1, 2, 4, 8, 16]


def _trainer_gpt2(batch: int, lever: str, steps: int = 2) -> None:
    import torch
    import transformers
    import workloads_frameworks as F

    model = F.gpt2(n_layer=12, n_embd=768, n_head=12)
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch * steps, 1024), generator=gen)

    class Ids(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    args = transformers.TrainingArguments(
        output_dir=str(H.OUT / f"hf_oom_tmp_{batch}_{lever}"), per_device_train_batch_size=batch, max_steps=steps,
        report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        bf16="bf16" in lever, gradient_checkpointing="ckpt" in lever,
        gradient_checkpointing_kwargs={"use_reentrant": False})
    transformers.Trainer(model=model, args=args, train_dataset=Ids()).train()


def framework_table(family: str, run, lever: str) -> None:
    """:func:`table_job` of ``run(batch, lever)``, a framework's training job, at TRAINER_OOM_BATCHES."""
    table_job(family, lever, lambda batch: _peak_of(lambda: run(batch, lever)), TRAINER_OOM_BATCHES, 64)


def framework_oom_snapshot(family: str, run, how: str) -> None:
    """``run(32, "plain")`` under the cap, dumped at its first out-of-memory error."""
    import torch

    name = f"fit_{family}_b32_oom_python"
    _dump_at_first_oom(name, {"kind": "fit-oom-first-forward", "family": family, "lever": "plain", "batch": 32,
                              "stacks": "python", "cap_bytes": CAP_BYTES,
                              "model": "GPT2LMHeadModel(n_layer=12,n_embd=768,vocab=8192), 1024 tokens, fp32",
                              "trainer": how})
    H.record(stacks="python")
    try:
        run(32, "plain")
    except torch.OutOfMemoryError:
        print(name, "OOM as planned", flush=True)


def framework_jobs(family: str, run, how: str) -> None:
    """Group ``fit_<family>_oom``: the four lever tables of ``run`` and its OOM snapshot at batch 32."""
    for lever in LEVERS:
        H.workload(f"fittable_{family}_{lever}", f"fit_{family}_oom")(
            lambda v=lever: framework_table(family, run, v))
    H.workload(f"fit_{family}_b32_oom_python", f"fit_{family}_oom")(lambda: framework_oom_snapshot(family, run, how))


framework_jobs("hftrainer", _trainer_gpt2, "transformers.Trainer, default optimizer (AdamW), max_grad_norm 1.0")


def _peak_of(run) -> dict[str, Any]:
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # what an earlier run left (cuBLAS's workspaces), in the peak
    try:
        run()
        torch.cuda.synchronize()
        res = {
            "ok": True,
            "base_bytes": base,
            "peak_process_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        }
    except torch.OutOfMemoryError:
        res = {"ok": False}
    gc.collect()
    torch.cuda.empty_cache()
    return res


def trainer_bf16_snapshot() -> None:
    H.record(stacks="python")
    _trainer(
        8,
        2,
        lambda model: H.dump(
            "fit_hftrainer_bf16_b8_python",
            {
                "kind": "hf-trainer-bf16",
                "stacks": "python",
                "batch": 8,
                "seq": 256,
                "steps_done": 2,
                "model": "GPT2LMHeadModel(n_layer=4,n_embd=512,vocab=8192)",
                "precision": "bf16=True (autocast)",
                "dumped": "on_step_end of the second step",
            },
        ),
    )


def trainer_bf16_truth() -> None:
    out = {str(b): _peak_of(lambda b=b: _trainer(b, 2)) for b in TRAINER_BATCHES}
    (H.OUT / "fittruth_hftrainer_bf16.json").write_text(json.dumps(out, indent=1))


def _infer(batch: int, dump_as: str | None = None) -> None:
    import torch

    vocab, tokens = TOKENS["llama"]
    model, _ = build("llama", "plain")
    model.eval()
    gen = torch.Generator().manual_seed(batch)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):
            model(input_ids=torch.randint(0, vocab, (batch, tokens), generator=gen).to("cuda")).logits.argmax(-1)
    torch.cuda.synchronize()
    if dump_as:
        H.dump(
            dump_as,
            {
                "kind": "fit-inference-autocast",
                "family": "llama",
                "batch": batch,
                "forwards": 3,
                "stacks": "python",
                "precision": "float32 parameters under bf16 autocast",
            },
        )


def infer_bf16_snapshot() -> None:
    H.record(stacks="python")
    _infer(8, "fit_llama_infer_bf16_b8_python")


def infer_bf16_truth() -> None:
    out = {str(b): _peak_of(lambda b=b: _infer(b)) for b in INFER_BATCHES}
    (H.OUT / "fittruth_llama_infer_bf16.json").write_text(json.dumps(out, indent=1))


for _family, _batch in AUTOCAST_OOMS.items():
    H.workload(f"fit_{_family}_b{_batch}_bf16_oom_python", "fit_autocast")(
        lambda f=_family, b=_batch: _snapshot_run(f, b, True, "bf16")
    )
H.workload("fit_hftrainer_bf16_b8_python", "fit_autocast")(trainer_bf16_snapshot)
H.workload("fittruth_hftrainer_bf16", "fit_autocast")(trainer_bf16_truth)
H.workload("fit_llama_infer_bf16_b8_python", "fit_autocast")(infer_bf16_snapshot)
H.workload("fittruth_llama_infer_bf16", "fit_autocast")(infer_bf16_truth)

# Lightning with mixed precision (group fit_lightning_mixed), recorded after the autocast rule:
# the frameworks' 4-layer GPT-2 under Trainer(precision="bf16-mixed") and "16-mixed" (float16 with
# a GradScaler), AdamW, 256 tokens: a snapshot at batch 8 (Python stacks) and, each in a fresh
# process, the peak of two steps at 8, 16, 32 and 64.
LIGHTNING_PRECISIONS = {"bf16": "bf16-mixed", "fp16": "16-mixed"}


def _lightning_fit(precision: str, batch: int, dump_as: str | None = None) -> None:
    import torch
    import workloads_frameworks as F

    pl = F._lightning()

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = F.gpt2()

        def training_step(self, batch_, batch_idx):
            (ids,) = batch_
            return self.model(input_ids=ids, labels=ids).loss

        def on_train_batch_end(self, outputs, batch_, batch_idx) -> None:
            if dump_as and batch_idx == 1:
                H.dump(dump_as, {"kind": "lightning-mixed", "precision": LIGHTNING_PRECISIONS[precision],
                                 "batch": batch, "seq": 256, "steps_done": 2, "stacks": "python",
                                 "model": "GPT2LMHeadModel(n_layer=4,n_embd=512,vocab=8192)", "optimizer": "AdamW",
                                 "dumped": "on_train_batch_end of the second step"})

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = torch.utils.data.TensorDataset(F.tokens(batch * 2))
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         precision=LIGHTNING_PRECISIONS[precision])
    trainer.fit(Lit(), torch.utils.data.DataLoader(data, batch_size=batch))


def lightning_truth(precision: str) -> None:
    out = {str(b): _peak_of(lambda b=b: _lightning_fit(precision, b)) for b in TRAINER_BATCHES}
    (H.OUT / f"fittruth_lightning_{precision}.json").write_text(json.dumps(out, indent=1))


def lightning_snapshot(precision: str) -> None:
    H.record(stacks="python")
    _lightning_fit(precision, 8, f"fit_lightning_{precision}_b8_python")


for _precision in LIGHTNING_PRECISIONS:
    H.workload(f"fit_lightning_{_precision}_b8_python", "fit_lightning_mixed")(
        lambda p=_precision: lightning_snapshot(p))
    H.workload(f"fittruth_lightning_{_precision}", "fit_lightning_mixed")(lambda p=_precision: lightning_truth(p))



# 2026-11-27: the ticket as a Lightning job (group fit_lightning_oom): the same GPT-2 in a
# LightningModule, torch's AdamW from configure_optimizers, precision "32-true"; Lightning runs the
# forward inside the optimizer's step (its closure), so the first forward's stacks show AdamW.step.
# Truth: Lightning runs under the four levers ("bf16-mixed", gradient checkpointing)
def _lightning_gpt2(batch: int, lever: str, steps: int = 2) -> None:
    import torch
    import workloads_frameworks as F

    pl = F._lightning()

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = F.gpt2(n_layer=12, n_embd=768, n_head=12)
            if "ckpt" in lever:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch_, batch_idx):
            (ids,) = batch_
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    gen = torch.Generator().manual_seed(batch)
    data = torch.utils.data.TensorDataset(torch.randint(0, 8192, (batch * steps, 1024), generator=gen))
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         precision="bf16-mixed" if "bf16" in lever else "32-true")
    trainer.fit(Lit(), torch.utils.data.DataLoader(data, batch_size=batch))


framework_jobs("lightning", _lightning_gpt2, "lightning Trainer, precision 32-true, torch.optim.AdamW")


# OOMs after the first forward (group fit_late_oom): each family as recorded, under the cap, at one
# more than its largest batch: the first step runs out in its backward or its optimizer step,
# where the first forward completed. Dumped by the OOM observer, as the first-forward OOMs.
LATE_OOMS = {"gpt2": 4, "llama": 7, "vit": 39, "bert": 10, "neox": 8, "opt": 9}


def _late_oom_run(family: str, batch: int) -> None:
    import torch

    name = f"fit_{family}_b{batch}_late_oom_python"
    info: dict[str, Any] = {"kind": "fit-oom-late", "family": family, "lever": "plain", "batch": batch,
                            "stacks": "python", "cap_bytes": CAP_BYTES}
    _dump_at_first_oom(name, info)
    H.record(stacks="python")
    model, opt = build(family, "plain")
    gen = torch.Generator().manual_seed(batch)
    try:
        for _ in range(2):
            step(family, "plain", model, opt, batch, gen)
        print(name, "UNEXPECTED: no OOM", flush=True)
    except torch.OutOfMemoryError as exc:
        print(name, "OOM:", str(exc)[:200], flush=True)


for _family, _batch in LATE_OOMS.items():
    H.workload(f"fit_{_family}_b{_batch}_late_oom_python", "fit_late_oom")(
        lambda f=_family, b=_batch: _late_oom_run(f, b))


# torch.compile (group fit_compile): the frameworks' MLP of six Linear(2048, 2048) + GELU with
# AdamW, and the frameworks' 4-layer GPT-2, each process with an empty inductor cache (its first
# step compiles and autotunes, as a user's first run does). Snapshots with Python and with C++
# stacks; truth: the peak of the first step (compilation, autotuning) and of the two after it.
COMPILE_BATCHES = {"mlp": (256, 1024, 4096, 16384), "gpt2": (8, 16, 32, 64)}


def _compiled(arch: str):
    import torch

    if arch == "mlp":
        model = H.mlp()
    else:
        import workloads_frameworks as F

        model = F.gpt2().to("cuda")
    return model, torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-4)


def _compiled_step(arch: str, run, opt, batch: int, gen) -> None:
    import torch

    if arch == "mlp":
        run(torch.randn(batch, 2048, generator=gen).to("cuda")).pow(2).mean().backward()
    else:
        ids = torch.randint(0, 8192, (batch, 256), generator=gen).to("cuda")
        run(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def compile_truth(arch: str, batch: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(batch)
    torch.cuda.reset_peak_memory_stats()
    _model, run, opt = _compiled(arch)
    out: dict[str, Any] = {"arch": arch, "batch": batch}
    try:
        _compiled_step(arch, run, opt, batch, gen)
        torch.cuda.synchronize()
        out["first_step_peak_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            _compiled_step(arch, run, opt, batch, gen)
        torch.cuda.synchronize()
        out["later_steps_peak_bytes"] = torch.cuda.max_memory_allocated()
        out["ok"] = True
    except torch.OutOfMemoryError:
        out["ok"] = False
    (H.OUT / f"fittruth_compile_{arch}_{batch}.json").write_text(json.dumps(out, indent=1))


def compile_snapshot(arch: str, batch: int, stacks: str) -> None:
    import torch

    H.record(stacks=stacks)
    _model, run, opt = _compiled(arch)
    gen = torch.Generator().manual_seed(batch)
    for _ in range(3):
        _compiled_step(arch, run, opt, batch, gen)
    torch.cuda.synchronize()
    H.dump(f"fit_compile_{arch}_b{batch}_{stacks}", {
        "kind": "fit-compile", "arch": arch, "batch": batch, "stacks": stacks, "steps_done": 3,
        "optimizer": "AdamW", "inductor_cache": "empty at the start (the first step compiles and autotunes)"})


for _arch, _batches in COMPILE_BATCHES.items():
    for _batch in _batches:
        _name = f"fittruth_compile_{_arch}_{_batch}"
        H.workload(_name, "fit_compile", env={"TORCHINDUCTOR_CACHE_DIR": f"/tmp/inductor_{_name}"})(
            lambda a=_arch, b=_batch: compile_truth(a, b))
    for _stacks in ("python", "all"):
        _name = f"fit_compile_{_arch}_b{_batches[0]}_{_stacks}"
        H.workload(_name, "fit_compile", env={"TORCHINDUCTOR_CACHE_DIR": f"/tmp/inductor_{_name}"})(
            lambda a=_arch, b=_batches[0], st=_stacks: compile_snapshot(a, b, st))



# 2026-11-27 (third session): an inference job that runs out of memory in its first forward. Such a
# trace has no backward, as a training job's first forward has none; under torch.no_grad() nothing
# is saved for a backward. The Llama (seen) and GPT-2 (its hold-out, whose KV cache is kept by
# transformers as the forward goes) at 512 and 1024 tokens, fp32, two forwards per run under
# no_grad: peaks at five batches, the largest under 6 GiB, and an OOM in the first forward.
INFER_OOMS = {"llamainfer": ("llama", (4, 8, 16, 32, 64), 128), "gpt2infer": ("gpt2", (4, 8, 16, 32, 64), 256)}


def _infer_run(family: str, batch: int, dump_as: str | None = None) -> None:
    import torch

    base = INFER_OOMS[family][0]
    vocab, tokens = TOKENS[base]
    model, _ = build(base, "plain")
    model.eval()
    gen = torch.Generator().manual_seed(batch)
    with torch.no_grad():
        for _ in range(2):
            model(input_ids=torch.randint(0, vocab, (batch, tokens), generator=gen).to("cuda")).logits.argmax(-1)
    torch.cuda.synchronize()
    if dump_as:
        params = list(model.parameters())
        H.dump(dump_as, {"kind": "fit-inference", "family": family, "batch": batch, "forwards": 2,
                         "stacks": "python", "grad_mode": "torch.no_grad()",
                         "param_bytes": sum(p.numel() * p.element_size() for p in params)})


def infer_table(family: str) -> None:
    _, batches, oom = INFER_OOMS[family]
    table_job(family, "plain", measure_at=lambda b: _peak_of(lambda: _infer_run(family, b)), batches=batches,
              top=2 * oom)


def infer_oom_snapshot(family: str, batch: int | None = None) -> None:
    import torch

    batch = batch or INFER_OOMS[family][2]
    name = f"fit_{family}_b{batch}_oom_python"
    info = {"kind": "fit-inference-oom-first-forward", "family": family, "batch": batch, "stacks": "python",
            "grad_mode": "torch.no_grad()", "cap_bytes": CAP_BYTES}
    _dump_at_first_oom(name, info)
    H.record(stacks="python")
    try:
        _infer_run(family, batch)
    except torch.OutOfMemoryError:
        print(name, "OOM as planned", flush=True)


def infer_snapshot(family: str) -> None:
    H.record(stacks="python")
    _infer_run(family, 8, f"fit_{family}_b8_complete_python")


for _family in INFER_OOMS:
    H.workload(f"fittable_{_family}_plain", f"fit_{_family}")(lambda f=_family: infer_table(f))
    H.workload(f"fit_{_family}_b{INFER_OOMS[_family][2]}_oom_python", f"fit_{_family}")(
        lambda f=_family: infer_oom_snapshot(f))
    H.workload(f"fit_{_family}_b8_complete_python", f"fit_{_family}")(lambda f=_family: infer_snapshot(f))


# 2026-11-27 (fourth session): fit gives the largest batch as a range where fragmentation decides
# it, first the largest batch whose step never takes the allocator to the cap. Does that batch
# run in a fresh process (group fit_fresh)? Each job runs two whole steps from a fresh model in a
# process of its own, under the family's cap, without memory history (as a user's job runs), at
# the range's first batch from the family's OOM recording; GPT-2's also at the batches up to the
# table's, to find its boundary in a fresh process. OPT and Gemma, whose ranges start above the
# table's largest batch, at that batch. fresh_<family>_<lever>_b<batch>.json: measure()'s result.
FRESH_RUNS = {
    ("gpt2", "ckpt"): (25, 26),
    ("gpt2", "ckpt+bf16"): (26, 27, 28),
    ("phi", "ckpt"): (25,),
    ("qwen2", "ckpt"): (18,),
    ("mistral", "ckpt"): (18,),
    ("gpt2bf16", "ckpt"): (33,),
    ("bloom", "ckpt"): (38,),
    ("gpt2lora", "ckpt"): (25,),
    ("llamalora", "ckpt"): (20,),
    ("opt", "ckpt"): (28, 31),
    ("gemma", "ckpt"): (14, 18),
}
# then, after the saved attention probabilities were kept to their block's backward end (Gemma's
# range from 18 to 15, Qwen2's and Mistral's from 18-20 to 16), those first batches, the batch above
# them, and GPT-2's with both levers one above the table's (29 failed there)
FRESH_RUNS_LATER = {
    ("gemma", "ckpt"): (15,),
    ("qwen2", "ckpt"): (16, 17),
    ("mistral", "ckpt"): (16, 17),
    ("gpt2", "ckpt+bf16"): (29,),
}


def _fresh_run(family: str, lever: str, batch: int) -> None:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(_cap(family) / total)
    res = measure(family, lever, batch)
    out = {"family": family, "lever": lever, "batch": batch, "cap_bytes": _cap(family), "fresh_process": True,
           "result": res, "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    print(family, lever, batch, res, flush=True)
    (H.OUT / f"fresh_{family}_{lever.replace('+', '_')}_b{batch}.json").write_text(json.dumps(out, indent=1))


for _group, _runs in (("fit_fresh", FRESH_RUNS), ("fit_fresh_later", FRESH_RUNS_LATER)):
    for (_family, _lever), _batches in _runs.items():
        for _batch in _batches:
            H.workload(f"fresh_{_family}_{_lever.replace('+', '_')}_b{_batch}", _group)(
                lambda f=_family, v=_lever, b=_batch: _fresh_run(f, v, b))

# 2026-11-27 (fourth session): the inference OOMs above ran out inside the first block and are
# refused; an inference job a little over its largest batch runs out later in its forward, with
# the KV cache of the layers before alive (group fit_infer_late): just over the largest batch
# that ran (41 and 37) and half as much again (60 and 54).
INFER_LATE_OOMS = {"llamainfer": (41, 60), "gpt2infer": (37, 54)}
# then hold-outs for extrapolating an inference forward cut short (group fit_infer_holdout): the
# Llama between 60 (out in its second forward) and 128 (out in its first block), GPT-2 between 37
# and 54
INFER_HOLDOUT_OOMS = {"llamainfer": (80, 96), "gpt2infer": (44,)}
for _group, _ooms in (("fit_infer_late", INFER_LATE_OOMS), ("fit_infer_holdout", INFER_HOLDOUT_OOMS)):
    for _family, _batches in _ooms.items():
        for _batch in _batches:
            H.workload(f"fit_{_family}_b{_batch}_oom_python", _group)(
                lambda f=_family, b=_batch: infer_oom_snapshot(f, b))

# then, a hold-out for the grouped-query fix those hold-outs gave (the head read the stream from the
# block's narrower KV cache: the Llama's logits were halved): Qwen2 (grouped-query attention)
# under torch.no_grad() (group fit_infer_holdout2): its table (peaks at five batches, the largest
# batch under the cap) and OOMs at three batches, to find one out in its first forward
INFER_OOMS["qwen2infer"] = ("qwen2", (4, 8, 16, 32, 64), 128)
H.workload("fittable_qwen2infer_plain", "fit_infer_holdout2")(lambda: infer_table("qwen2infer"))
for _batch in (64, 80, 96):  # each out in its first block (refused): then just over its largest, 35
    H.workload(f"fit_qwen2infer_b{_batch}_oom_python", "fit_infer_holdout2")(
        lambda b=_batch: infer_oom_snapshot("qwen2infer", b))
for _batch in (38, 42, 48):
    H.workload(f"fit_qwen2infer_b{_batch}_oom_python", "fit_infer_holdout3")(
        lambda b=_batch: infer_oom_snapshot("qwen2infer", b))

if __name__ == "__main__":
    H.__file__ = __file__  # the pool spawns this script, whose workloads these are
    H.main()
