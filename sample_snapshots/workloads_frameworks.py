"""Issue #19's recordings: the runs people attach (frameworks, inference, mid-run recordings, the
allocator's own cache flush), each with truth that says which bytes were what.

Workloads:

- ``fw_lightning_auto_*``: a GPT-2 LightningModule trained by Lightning's Trainer with automatic
  optimization (``training_step`` runs inside ``optimizer.step(closure)``), AdamW;
- ``fw_lightning_manual_python``: the same with manual optimization;
- ``fw_hf_trainer_python``: transformers' ``Trainer`` on a GPT-2 built from a config;
- ``fw_fabric_python``: a Lightning Fabric loop; ``fw_lbfgs_python``: a plain loop with LBFGS's closure;
- ``inf_llama_late_*`` / ``inf_llama_start_python``: a Llama-style fp16 model, prefill 8x1024 and
  64 decode steps with ``DynamicCache`` through ``generate``, dumped with the cache alive;
  ``late``: recorded after the model was moved to the GPU;
- ``midrun_late_python``: recording started at step k, dumped after a forward and before
  ``zero_grad`` (the previous backward's gradients are older than the trace);
  ``midrun_wrapped_python``: the same moment, recorded from the start with a ring buffer that
  wrapped, under bf16 autocast; ``midrun_nozero_python``: gradients never zeroed and an optimizer
  that re-allocates its state every step, recording started at step k;
- ``bench_fwdbwd_*``: forward + backward without an optimizer, recorded after two warm-up steps;
- ``inf_flush_python``: inference under a per-process cap where ``cudaMalloc`` failed and the
  allocator freed its cache and retried (``num_alloc_retries`` > 0, no OOM).

Truth: ``memory_stats()`` right before the dump, the bytes of the live parameters, gradients,
optimizer state, KV cache and logits at the dump, and ``observations``: at marked moments (a
``torch.profiler.record_function('snaplab_truth:<marker>')`` whose START lands in the snapshot's
``external_annotations`` with the trace's ``time_us`` clock) the ``[data_ptr, nbytes]`` of every
tensor of each category, so the category of every block at any moment (the peak) can be decided
from what the program held, not from snaplab's rules.

    python3 sample_snapshots/workloads_frameworks.py all --out /tmp/fw --jobs 8
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads_holdout as H

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

OBSERVATIONS: list[dict[str, Any]] = []
VOCAB = 8192


def storages(tensors) -> list[list[int]]:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type != "cuda":
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return [[ptr, n] for ptr, n in seen.items()]


def opt_state_tensors(opt) -> list:
    import torch

    return [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]


def observe(marker: str, model=None, opt=None, **extra) -> None:
    """Mark this moment in the snapshot and note which tensors the program holds."""
    import torch

    with torch.profiler.record_function(f"snaplab_truth:{marker}"):
        pass
    tensors: dict[str, list[list[int]]] = {}
    if model is not None:
        params = list(model.parameters())
        tensors["parameter"] = storages(params)
        tensors["gradient"] = storages([p.grad for p in params])
    if opt is not None:
        tensors["optimizer_state"] = storages(opt_state_tensors(opt))
    for cat, ts in extra.items():
        tensors[cat] = storages(ts)
    OBSERVATIONS.append({"marker": marker, "tensors": tensors})


def facts(model=None, opt=None, **extra) -> dict[str, Any]:
    out: dict[str, Any] = {"observations": OBSERVATIONS}
    if model is not None:
        params = list(model.parameters())
        out["param_bytes"] = sum(n for _, n in storages(params))
        out["param_count"] = len(params)
        out["grad_bytes"] = sum(n for _, n in storages([p.grad for p in params]))
    if opt is not None:
        out["optimizer_state_bytes"] = sum(n for _, n in storages(opt_state_tensors(opt)))
        out["optimizer"] = type(opt).__name__
    for key, ts in extra.items():
        out[f"{key}_bytes"] = sum(n for _, n in storages(ts))
    return out


def gpt2(n_layer=4, n_embd=512, n_head=8, positions=1024):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=VOCAB, n_positions=positions,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def tokens(n: int, batch: int = 8, seq: int = 256):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (n, seq), generator=g)


def lm_dataset(n: int):
    """``n`` rows of token ids as a causal language model's training set (the ids are the labels)."""
    import torch

    class Ids(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = tokens(n)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return Ids()


# --------------------------------------------------------------------------- frameworks


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def _lightning_run(name: str, stacks: str, manual: bool) -> None:
    import torch

    pl = _lightning()
    steps = 4
    H.record(stacks=stacks)

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                observe(f"after_backward_{batch_idx}", self.model, opt.optimizer)
                opt.step()
            return loss

        def on_after_backward(self) -> None:
            if not manual:
                observe(f"after_backward_{self.global_step}", self.model, self.optimizers().optimizer)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            opt = self.optimizers().optimizer
            observe(f"batch_end_{batch_idx}", self.model, opt)
            if batch_idx == steps - 1:
                H.dump(name, {
                    "kind": "lightning-manual" if manual else "lightning-automatic", "stacks": stacks,
                    "framework": f"{pl.__name__} {getattr(sys.modules[pl.__name__.split('.')[0]], '__version__', '?')}",
                    "model": "GPT2LMHeadModel(n_layer=4,n_embd=512,vocab=8192)", "batch": 8, "seq": 256,
                    "steps_done": steps, "dumped": "on_train_batch_end of the last step",
                    "recording_started": "before the model was built", **facts(self.model, opt),
                })

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = torch.utils.data.TensorDataset(tokens(8 * steps))
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Lit(), torch.utils.data.DataLoader(data, batch_size=8))


for _mode in H.STACK_MODES:
    H.workload(f"fw_lightning_auto_{_mode}", "fw")(lambda m=_mode: _lightning_run(f"fw_lightning_auto_{m}", m, False))
H.workload("fw_lightning_manual_python", "fw")(lambda: _lightning_run("fw_lightning_manual_python", "python", True))


@H.workload("fw_hf_trainer_python", "fw")
def hf_trainer() -> None:
    import transformers

    H.record(stacks="python")
    model = gpt2()
    steps = 4

    class Dump(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            observe(f"pre_optimizer_{state.global_step}", model, kw.get("optimizer"))

        def on_step_end(self, args, state, control, **kw):
            opt = kw.get("optimizer")
            opt = getattr(opt, "optimizer", opt)
            observe(f"step_end_{state.global_step}", model, opt)
            if state.global_step == steps:
                H.dump("fw_hf_trainer_python", {
                    "kind": "hf-trainer", "stacks": "python", "framework": f"transformers {transformers.__version__}",
                    "model": "GPT2LMHeadModel(n_layer=4,n_embd=512,vocab=8192)", "batch": 8, "seq": 256,
                    "steps_done": steps, "dumped": "on_step_end of the last step (after zero_grad)",
                    "recording_started": "before the model was built", **facts(model, opt),
                })

    args = transformers.TrainingArguments(output_dir=str(H.OUT / "hf_tmp"), per_device_train_batch_size=8,
                                          max_steps=steps, report_to=[], save_strategy="no", logging_strategy="no",
                                          dataloader_num_workers=0, disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=lm_dataset(8 * steps), callbacks=[Dump()]).train()


@H.workload("fw_fabric_python", "fw")
def fabric_loop() -> None:
    import torch

    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric
    H.record(stacks="python")
    fabric = Fabric(accelerator="cuda", devices=1)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = fabric.setup(model, opt)
    ids_all = tokens(32)
    steps = 4
    for step in range(steps):
        ids = ids_all[step * 8:(step + 1) * 8].to(fabric.device)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        observe(f"after_backward_{step}", model, opt.optimizer)
        opt.step()
    observe("end", model, opt.optimizer)
    H.dump("fw_fabric_python", {
        "kind": "fabric", "stacks": "python", "model": "GPT2LMHeadModel(n_layer=4,n_embd=512,vocab=8192)",
        "batch": 8, "seq": 256, "steps_done": steps, "dumped": "after opt.step(), before zero_grad()",
        "recording_started": "before the model was built", **facts(model, opt.optimizer),
    })


@H.workload("fw_lbfgs_python", "fw")
def lbfgs_loop() -> None:
    import torch

    H.record(stacks="python")
    model = H.mlp(width=1024, depth=4)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4, history_size=5)
    g = torch.Generator().manual_seed(1)
    steps = 3
    for step in range(steps):
        x = torch.randn(512, 1024, generator=g).to("cuda")

        def closure(x=x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)
        observe(f"step_{step}", model, opt, lbfgs_history=[t for st in opt.state.values()
                                                           for v in st.values() if isinstance(v, list)
                                                           for t in v if torch.is_tensor(t)])
    H.dump("fw_lbfgs_python", {
        "kind": "lbfgs-closure", "stacks": "python", "model": "MLP 4 x (Linear(1024, 1024) + GELU)",
        "batch": 512, "steps_done": steps, "dumped": "after opt.step(closure)",
        "recording_started": "before the model was built", **facts(model, opt),
    })


# --------------------------------------------------------------------------- inference with a KV cache


def llama_fp16(n_layer=12, hidden=2048, heads=16, vocab=32000):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=5632, num_hidden_layers=n_layer,
                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).to(dtype=torch.float16)


def cache_tensors(cache) -> list:
    import torch

    out = []
    for layer in getattr(cache, "layers", []) or []:
        for attr in ("keys", "values"):
            t = getattr(layer, attr, None)
            if torch.is_tensor(t):
                out.append(t)
    for attr in ("key_cache", "value_cache"):
        for t in getattr(cache, attr, []) or []:
            if torch.is_tensor(t):
                out.append(t)
    return out


def _inference_run(name: str, stacks: str, late: bool) -> None:
    import torch
    from transformers import DynamicCache

    if not late:
        H.record(stacks=stacks)
    model = llama_fp16().to("cuda").eval()
    if late:
        H.record(stacks=stacks)
    steps = {"n": 0}
    sizes: list[int] = []

    def hook(module, args, kwargs, output):
        cache = kwargs.get("past_key_values")
        kv = cache_tensors(cache) if cache is not None else []
        sizes.append(sum(n for _, n in storages(kv)))
        observe(f"forward_{steps['n']}", model, kv_cache=kv)
        steps["n"] += 1

    model.register_forward_hook(hook, with_kwargs=True)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32000, (8, 1024), generator=g).to("cuda")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                             min_new_tokens=64, do_sample=False, past_key_values=DynamicCache(),
                             return_dict_in_generate=True, pad_token_id=0)
    kv = cache_tensors(out.past_key_values)
    observe("end", model, kv_cache=kv)
    H.dump(name, {
        "kind": "inference-kv-cache", "stacks": stacks, "model": "LlamaForCausalLM fp16 (12 layers, 2048 wide)",
        "batch": 8, "prompt_tokens": 1024, "new_tokens": 64, "cache": "DynamicCache via generate()",
        "recording_started": "after the model was on the GPU" if late else "before the model was built",
        "kv_cache_bytes_after_each_forward": sizes, "forwards": steps["n"],
        **facts(model, kv_cache=kv, sequences=[out.sequences]),
    })


for _mode in H.STACK_MODES:
    H.workload(f"inf_llama_late_{_mode}", "inf")(lambda m=_mode: _inference_run(f"inf_llama_late_{m}", m, True))
H.workload("inf_llama_start_python", "inf")(lambda: _inference_run("inf_llama_start_python", "python", False))


@H.workload("inf_flush_python", "inf")
def inference_flush() -> None:
    """Prefills of growing length under a cap just above the longest one's need: the cached
    segments of the shorter ones no longer fit beside it, cudaMalloc fails, the allocator frees
    its cache and retries."""
    import torch

    model = llama_fp16(n_layer=4, hidden=1024, heads=8).to("cuda").eval()
    lengths = [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    g = torch.Generator().manual_seed(4)

    def prefill(length: int):
        ids = torch.randint(0, 32000, (8, length), generator=g).to("cuda")
        with torch.no_grad():
            return model(input_ids=ids).logits.float().softmax(-1).max(-1).values.sum().item()

    prefill(lengths[-1])
    need = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    for factor in (1.12, 1.05, 1.02):
        cap = int(need * factor)
        torch.cuda.set_per_process_memory_fraction(cap / total)
        torch.cuda.reset_peak_memory_stats()
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        OBSERVATIONS.clear()
        H.record(stacks="python")
        for length in lengths:
            prefill(length)
            observe(f"prefill_{length}", model)
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0
        if retries > 0:
            break
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.empty_cache()
    H.dump("inf_flush_python", {
        "kind": "inference-allocator-flush", "stacks": "python", "model": "LlamaForCausalLM fp16 (4 layers, 1024)",
        "batch": 8, "prefill_lengths": lengths, "cap_bytes": cap, "cap_factor_of_need": factor,
        "retries_during_recording": retries, "calls_empty_cache": False,
        "recording_started": "after the model was on the GPU", **facts(model),
        "expect": {"allocator_flush": retries > 0, "empty_cache_churn": False},
    })


# --------------------------------------------------------------------------- recordings started mid-run


def _train_step_forward(model, ids, autocast: bool):
    import torch

    if autocast:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids).loss
    return model(input_ids=ids, labels=ids).loss


def _midrun(name: str, how: str) -> None:
    import torch

    autocast = how == "wrapped"
    if how == "wrapped":
        H.record(stacks="python", max_entries=3000)
    model = gpt2(n_layer=6, n_embd=768, n_head=12).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(5)
    k = 3
    for step in range(k + 1):
        if step == k and how == "late":
            H.record(stacks="python")
        ids = torch.randint(0, VOCAB, (8, 512), generator=g).to("cuda")
        loss = _train_step_forward(model, ids, autocast)  # the pattern: forward, zero_grad, backward, step
        if step == k:
            observe("after_forward", model, opt)
            H.dump(name, {
                "kind": f"midrun-{how}", "stacks": "python", "model": "GPT2LMHeadModel(n_layer=6,n_embd=768)",
                "batch": 8, "seq": 512, "autocast": "bf16" if autocast else None, "steps_done": k,
                "dumped": "after the forward of step k+1, before zero_grad (last backward's gradients alive)",
                "recording_started": "at step k" if how == "late" else "before the model (ring of 3000 wrapped)",
                **facts(model, opt),
            })
            return
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


for _how in ("late", "wrapped"):
    H.workload(f"midrun_{_how}_python", "mid")(lambda h=_how: _midrun(f"midrun_{h}_python", h))


@H.workload("midrun_nozero_python", "mid")
def midrun_nozero() -> None:
    """Gradients never zeroed; an SGD with momentum written by hand that builds a new state tensor
    every step (``buf = buf * m + g``, not in place); recording started at step k."""
    import torch

    model = gpt2(n_layer=6, n_embd=768, n_head=12).to("cuda")
    state: dict[int, Any] = {}
    g = torch.Generator().manual_seed(6)

    class Holder:
        def __init__(self) -> None:
            self.state = {}

    holder = Holder()
    k = 3
    for step in range(k + 2):
        if step == k:
            H.record(stacks="python")
        ids = torch.randint(0, VOCAB, (8, 512), generator=g).to("cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                buf = state.get(i)
                buf = p.grad.clone() if buf is None else buf * 0.9 + p.grad
                state[i] = buf
                p.add_(buf, alpha=-1e-4)
        holder.state = {i: {"momentum_buffer": b} for i, b in state.items()}
        observe(f"step_{step}", model, holder)
    H.dump("midrun_nozero_python", {
        "kind": "midrun-grads-never-zeroed", "stacks": "python", "model": "GPT2LMHeadModel(n_layer=6,n_embd=768)",
        "batch": 8, "seq": 512, "steps_done": k + 2, "dumped": "after the update of the last step",
        "recording_started": "at step k=3", **facts(model, holder),
        "optimizer": "hand-written SGD momentum (new state each step)",
    })


@H.workload("bench_fwdbwd_python", "mid")
def bench_python() -> None:
    _bench("bench_fwdbwd_python", "python")


@H.workload("bench_fwdbwd_all", "mid")
def bench_all() -> None:
    _bench("bench_fwdbwd_all", "all")


def _bench(name: str, stacks: str) -> None:
    import torch

    model = gpt2(n_layer=6, n_embd=768, n_head=12).to("cuda")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (8, 512), generator=g).to("cuda")
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    H.record(stacks=stacks)
    out = None
    for step in range(2):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        observe(f"after_backward_{step}", model, logits=[out.logits])
    H.dump(name, {
        "kind": "forward-backward-benchmark", "stacks": stacks, "model": "GPT2LMHeadModel(n_layer=6,n_embd=768)",
        "batch": 8, "seq": 512, "optimizer": None, "warmup_steps": 2, "recorded_steps": 2,
        "dumped": "after the second recorded backward (logits kept alive)",
        "recording_started": "after two warm-up steps", **facts(model, logits=[out.logits]),
    })


if __name__ == "__main__":
    H.__file__ = __file__  # the pool spawns this script, whose workloads these are
    H.main()
