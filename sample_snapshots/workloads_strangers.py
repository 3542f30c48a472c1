"""Issue #37's recordings: what strangers attach, reproduced on our own GPU so that each rule has
a recording it was not written against.

Workloads:

- ``warm_<opt>_<zero>_<stacks>``: a hand-written GPT-style language model (no transformers: its
  own attention, RMSNorm and SwiGLU, as course assignments write it) trained with AdamW;
  recording starts after five warm-up steps, two steps are recorded, and two snapshots are
  dumped: ``..._afterstep`` right after the third recorded ``optimizer.step()`` and
  ``..._afterfwd`` after the next step's ``zero_grad`` and forward. ``<opt>``: ``hand`` (a
  ``torch.optim.Optimizer`` subclass whose state is made in its first ``step()``) or ``torch``
  (``torch.optim.AdamW``); ``<zero>``: ``none`` (``zero_grad(set_to_none=True)``, the default) or
  ``keep`` (``set_to_none=False``: the gradients are the warm-up's tensors, older than the
  trace); ``<stacks>``: ``python`` or ``all``. ``warm_hand_none_bf16_python`` runs the forward
  under bf16 autocast; ``warm_hand_none_step0_<stacks>`` records from the first step, after the
  model was built (the hand-written optimizer makes its state inside the trace).
- ``vgg_prebwd_<when>_<stacks>``: torchvision's VGG-16 (BatchNorm) with Adam, dumped after the
  loss and before ``backward()`` (parameters and Adam's two moments live, no gradients);
  ``<when>``: ``late`` (recording started after two warm-up steps) or ``start``.
- ``pool_graph_mempool_<stacks>``: a CUDA graph of an MLP's forward beside 512 MiB placed with
  ``torch.cuda.use_mem_pool(torch.cuda.MemPool())``; ``pool_mempool_weights_<stacks>``: a model's
  weights allocated inside a ``MemPool`` (as vLLM's sleep mode keeps them), run outside it.
- ``state_llama_fp16``: ``torch.cuda.memory._snapshot()`` pickled with no recording at all (no
  trace, no stacks): a Llama-style fp16 model's weights. ``state_hook_leak_python``: recorded
  with ``enabled='state'`` (blocks keep their stacks, no trace); a forward hook registered per
  image and never removed keeps every attention output alive.
- ``megatron_distopt_bf16_python``: Megatron-Core's GPTModel under its DistributedDataParallel
  (contiguous bf16 parameter buffer, fp32 gradient buffer) and DistributedOptimizer (fp32 main
  parameters and Adam's moments), one GPU, dumped after the second ``optimizer.step()``.

Truth: ``memory_stats()`` right before each dump, and ``observations`` (the ``[data_ptr,
nbytes]`` of every tensor of each category at the marked moment, see
``workloads_frameworks.observe``) wherever the program can name what it holds.

    python3 sample_snapshots/workloads_strangers.py all --out /tmp/strangers --jobs 8
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads_frameworks as F
import workloads_holdout as H

VOCAB = 8192

# --------------------------------------------------------------------------- a hand-written LM


def hand_lm(d_model: int = 512, n_layers: int = 4, n_heads: int = 8, d_ff: int = 1344, context: int = 256):
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = RMSNorm(d_model), RMSNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
            self.out = nn.Linear(d_model, d_model, bias=False)
            self.w1 = nn.Linear(d_model, d_ff, bias=False)
            self.w3 = nn.Linear(d_model, d_ff, bias=False)
            self.w2 = nn.Linear(d_ff, d_model, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d_model, dim=-1)
            q, k, v = (z.view(b, t, n_heads, -1).transpose(1, 2) for z in (q, k, v))
            scores = q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5)
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
            attn = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
            x = x + self.out(attn.transpose(1, 2).reshape(b, t, d_model))
            h = self.ln2(x)
            return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
            self.ln_f = RMSNorm(d_model)
            self.head = nn.Linear(d_model, VOCAB, bias=False)

        def forward(self, ids):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    return LM()


def hand_adamw():
    """AdamW written by hand, as course assignments write it: state made in the first step()."""
    import math

    import torch

    class AdamW(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                b1, b2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["t"] = 0
                        state["m"] = torch.zeros_like(p)
                        state["v"] = torch.zeros_like(p)
                    state["t"] += 1
                    m, v, t = state["m"], state["v"], state["t"]
                    m.mul_(b1).add_(p.grad, alpha=1 - b1)
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    lr_t = group["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t)
                    p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-lr_t)
                    p.mul_(1 - group["lr"] * group["weight_decay"])

    return AdamW


def _warm(opt_kind: str, zero: str, stacks: str, bf16: bool = False, warmup: int = 5) -> None:
    import torch

    name = f"warm_{opt_kind}_{zero}{'_bf16' if bf16 else ''}{'_step0' if not warmup else ''}_{stacks}"
    model = hand_lm().to("cuda")
    opt_cls = hand_adamw() if opt_kind == "hand" else torch.optim.AdamW
    opt = opt_cls(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(3)
    recorded = 2
    info = {
        "kind": "training-step-recorded-after-warmup", "stacks": stacks,
        "model": "hand-written LM (d_model=512, 4 layers, SwiGLU, RMSNorm, vocab 8192, untied head)",
        "batch": 8, "seq": 256, "autocast": "bf16" if bf16 else None,
        "optimizer_impl": "hand-written AdamW (Optimizer subclass, state made in first step())"
        if opt_kind == "hand" else "torch.optim.AdamW",
        "zero_grad": "set_to_none=True" if zero == "none" else "set_to_none=False",
        "warmup_steps": warmup, "recording_started": f"after {warmup} warm-up steps",
    }
    for step in range(warmup + recorded + 2):
        if step == warmup:
            H.record(stacks=stacks)
        ids = torch.randint(0, VOCAB, (8, 257), generator=g).to("cuda")
        opt.zero_grad(set_to_none=zero == "none")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
        if step == warmup + recorded + 1:
            F.observe("after_forward", model, opt, logits=[logits])
            H.dump(f"{name}_afterfwd", {**info, "dumped": "after the next step's zero_grad and forward (loss alive)",
                                        **F.facts(model, opt, logits=[logits])})
            return
        loss.backward()
        opt.step()
        del logits, loss
        if step == warmup + recorded:
            F.observe("after_step", model, opt)
            H.dump(f"{name}_afterstep", {**info, "dumped": "right after optimizer.step()", **F.facts(model, opt)})


for _opt in ("hand", "torch"):
    for _zero in ("none", "keep"):
        for _mode in H.STACK_MODES:
            H.workload(f"warm_{_opt}_{_zero}_{_mode}", "warm")(lambda o=_opt, z=_zero, m=_mode: _warm(o, z, m))
H.workload("warm_hand_none_bf16_python", "warm")(lambda: _warm("hand", "none", "python", bf16=True))
# recorded from the first step: the hand-written optimizer makes its state inside the trace
for _mode in H.STACK_MODES:
    H.workload(f"warm_hand_none_step0_{_mode}", "warm0")(lambda m=_mode: _warm("hand", "none", m, warmup=0))


# --------------------------------------------------------------------------- VGG between forward and backward


def _vgg(when: str, stacks: str) -> None:
    import torch
    import torchvision

    name = f"vgg_prebwd_{when}_{stacks}"
    if when == "start":
        H.record(stacks=stacks)
    torch.manual_seed(0)
    model = torchvision.models.vgg16_bn(num_classes=10).to("cuda")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        if step == 2 and when == "late":
            H.record(stacks=stacks)
        x = torch.randn(16, 3, 64, 64, generator=g).to("cuda")
        y = torch.randint(0, 10, (16,), generator=g).to("cuda")
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 3:
            F.observe("before_backward", model, opt)
            H.dump(name, {
                "kind": "training-step-before-backward", "stacks": stacks,
                "model": "torchvision vgg16_bn(num_classes=10)", "batch": 16, "image": 64, "optimizer": "Adam",
                "recording_started": "after two warm-up steps" if when == "late" else "before the model",
                "dumped": "after the loss, before backward() (no gradients: zero_grad(set_to_none=True))",
                **F.facts(model, opt),
            })
            return
        loss.backward()
        opt.step()


for _when in ("late", "start"):
    for _mode in H.STACK_MODES:
        H.workload(f"vgg_prebwd_{_when}_{_mode}", "vgg")(lambda w=_when, m=_mode: _vgg(w, m))


# --------------------------------------------------------------------------- private pools


def _pool_graph(stacks: str) -> None:
    import torch

    name = f"pool_graph_mempool_{stacks}"
    H.record(stacks=stacks)
    model = H.mlp(width=1024, depth=4).to("cuda")
    static_x = torch.randn(64, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = model(static_x)
    graph.replay()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        staged = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    F.observe("dump", model, mempool=[staged], graph_output=[static_y])
    H.dump(name, {
        "kind": "cuda-graph-beside-mempool", "stacks": stacks,
        "graph_pool_id": list(graph.pool()), "mempool_id": list(pool.id),
        "mempool_bytes": staged.untyped_storage().nbytes(),
        "dumped": "after one replay, with 512 MiB held in a MemPool",
        **F.facts(model, mempool=[staged], graph_output=[static_y]),
    })


def _pool_weights(stacks: str) -> None:
    import torch

    name = f"pool_mempool_weights_{stacks}"
    H.record(stacks=stacks)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        model = H.mlp(width=2048, depth=6).to("cuda")
    x = torch.randn(32, 2048, device="cuda")
    with torch.no_grad():
        y = model(x)
    torch.cuda.synchronize()
    F.observe("dump", model, output=[y])
    H.dump(name, {
        "kind": "weights-in-mempool", "stacks": stacks, "mempool_id": list(pool.id),
        "dumped": "after one forward under no_grad, the weights inside a MemPool (as vLLM's sleep mode keeps them)",
        **F.facts(model, output=[y]),
    })


for _mode in H.STACK_MODES:
    H.workload(f"pool_graph_mempool_{_mode}", "pool")(lambda m=_mode: _pool_graph(m))
    H.workload(f"pool_mempool_weights_{_mode}", "pool")(lambda m=_mode: _pool_weights(m))


# --------------------------------------------------------------------------- state-only files


@H.workload("state_llama_fp16", "state")
def state_llama() -> None:
    import lzma
    import pickle

    import torch

    model = H.llama(n_layer=8, hidden=1024, heads=16).to("cuda", torch.float16)
    torch.cuda.synchronize()
    stats = dict(torch.cuda.memory_stats())
    snap = torch.cuda.memory._snapshot()
    with lzma.open(H.OUT / "state_llama_fp16.pickle.xz", "wb", preset=6) as f:
        pickle.dump(snap, f, protocol=4)
    facts = H.model_facts(model)
    _truth("state_llama_fp16", stats, {
        "kind": "state-only-weights", "model": "LlamaForCausalLM (8 layers, hidden 1024) in fp16",
        "recording": "none: torch.cuda.memory._snapshot() pickled with no history recorded", **facts,
    })


def _truth(name: str, stats: dict[str, Any], info: dict[str, Any]) -> None:
    import json
    import socket
    import time

    import torch

    truth = {
        "name": name, "torch_version": torch.__version__,
        "device_names": {"0": torch.cuda.get_device_name(0)},
        "device_total_bytes": {"0": torch.cuda.get_device_properties(0).total_memory},
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "hostname": socket.gethostname(),
        "dumped_at_unix_s": time.time(), "memory_stats": {"0": stats}, "workload": info,
    }
    (H.OUT / f"{name}.truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True, default=str))
    print(f"[{name}] dumped", flush=True)


@H.workload("state_hook_leak_python", "state")
def state_hook_leak() -> None:
    import torch
    from torch import nn

    torch.cuda.memory._record_memory_history(enabled="state", stacks="python")
    torch.manual_seed(0)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(640, 10, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(640, 2560), nn.GELU(), nn.Linear(2560, 640))

        def forward(self, x):
            x = x + self.attn(x, x, x, need_weights=False)[0]
            return x + self.mlp(x)

    layer = Encoder().to("cuda").eval()
    kept: list[torch.Tensor] = []

    def keep_output(module, inputs, output):  # the leak: one line, every image
        kept.append(output[0])

    n_images = 300
    with torch.no_grad():
        for _ in range(n_images):
            handle = layer.attn.register_forward_hook(keep_output)  # registered per image, never removed
            layer(torch.randn(1, 1024, 640, device="cuda"))
            del handle
    torch.cuda.synchronize()
    F.observe("dump", layer, leaked=kept)
    H.dump("state_hook_leak_python", {
        "kind": "state-only-hook-leak", "recording": "enabled='state', stacks='python' (no trace)",
        "images": n_images, "leaked_tensors": len(kept), "leaked_tensor_bytes": kept[0].untyped_storage().nbytes(),
        "leaked_storages": len({t.untyped_storage().data_ptr() for t in kept}),
        "leak_line": "keep_output: kept.append(...)", "expect": {"leak": True}, **F.facts(layer, leaked=kept),
    })


# --------------------------------------------------------------------------- Megatron-Core


def _megatron_model():
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=4, hidden_size=512, num_attention_heads=8, use_cpu_initialization=False,
                            bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    from megatron.core.transformer.module import Float16Module

    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                   max_sequence_length=512).cuda()
    return Float16Module(cfg, gpt), cfg  # as Megatron's training loop wraps it: bf16 in, fp32 loss out


@H.workload("megatron_distopt_bf16_python", "megatron")
def megatron_distopt() -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    H.record(stacks="python")
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model, cfg = _megatron_model()
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=True)
    model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True),
                                 [model])
    g = torch.Generator().manual_seed(6)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (4, 513), generator=g).to("cuda")
        pos = torch.arange(512, device="cuda").unsqueeze(0).expand(4, -1)
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = model(ids[:, :-1], pos, None, labels=ids[:, 1:]).float().mean()
        loss.backward()
        model.finish_grad_sync()
        opt.step()
    del loss
    torch.cuda.synchronize()
    buffers = list(getattr(model, "buffers", [])) + list(getattr(model, "expert_parallel_buffers", []))
    params = [p for p in model.parameters()]
    inner = [o for o in getattr(opt, "chained_optimizers", [opt])]
    state = [t for o in inner for st in o.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    main = [p for o in inner for grp in o.optimizer.param_groups for p in grp["params"]]
    tensors = {"parameter": [b.param_data for b in buffers if b.param_data is not None] or params,
               "gradient": [b.grad_data for b in buffers], "optimizer_state": state + main}
    F.OBSERVATIONS.append({"marker": "dump", "tensors": {k: F.storages(v) for k, v in tensors.items()}})
    with torch.profiler.record_function("snaplab_truth:dump"):
        pass
    H.dump("megatron_distopt_bf16_python", {
        "kind": "megatron-distributed-optimizer", "stacks": "python",
        "model": "megatron.core GPTModel (4 layers, hidden 512, vocab 8192), local layer spec, bf16",
        "ddp": "megatron DistributedDataParallel(grad_reduce_in_fp32, use_distributed_optimizer), world size 1",
        "optimizer": "DistributedOptimizer(adam, bf16): fp32 main params + exp_avg + exp_avg_sq",
        "dumped": "after the second optimizer.step()", "observations": F.OBSERVATIONS,
        **{f"{k}_bytes": sum(n for _, n in F.storages(v)) for k, v in tensors.items()},
    })
    dist.destroy_process_group()


if __name__ == "__main__":
    H.__file__ = __file__  # the pool spawns this script, whose workloads these are
    H.main()
