"""Hold-out workloads: real recordings that the category and finding rules must also get right.

Each rule in snaplab was first written against ``workloads.py``; these are the workloads that
broke the simpler rules (issue #12), recorded on a GPU with torch's default stacks
(``stacks='all'``, C++ frames) and with ``stacks='python'``:

- gradients: an MLP of six 2048x2048 Linear+GELU layers with AdamW, plain, with AMP +
  GradScaler, with 4 micro-steps of gradient accumulation, with activation checkpointing, and
  under torch.compile; dumped after ``opt.step()`` and before ``zero_grad()``;
- recording started after the model was built (GPT-2 with Adam, Llama with AdamW);
- autograd anomaly mode (backward allocations carry the forward frames);
- DDP over gloo with two ranks sharing one GPU, with and without ``gradient_as_bucket_view``;
- garbage collection what-ifs: one deterministic job under five allocator settings and three
  per-process caps;
- a job recorded completely and the same job with a ring buffer that wrapped (also with
  expandable segments);
- one forward pass (and forward + backward) through deep transformers, which have a repeating
  pattern but no iterations;
- a training step whose trace begins with one bulk ``empty_cache()``.

Usage (on the GPU machine; CUDA_VISIBLE_DEVICES picks the GPU)::

    python3 sample_snapshots/workloads_holdout.py all --out /tmp/h --jobs 10
    python3 sample_snapshots/workloads_holdout.py one grad_plain_python --out /tmp/h

``SNAPLAB_DRY=1`` runs every workload on the CPU without recording (a check of the scripts).
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT = Path(".")
DRY = bool(os.environ.get("SNAPLAB_DRY"))
DEV = "cpu" if DRY else "cuda"
WORKLOADS: dict[str, Callable[[], None]] = {}
ENV: dict[str, dict[str, str]] = {}
GROUP: dict[str, str] = {}


def workload(name: str, group: str, env: dict[str, str] | None = None):
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        WORKLOADS[name] = fn
        ENV[name] = env or {}
        GROUP[name] = group
        return fn

    return deco


# --------------------------------------------------------------------------- helpers


def record(stacks: str = "python", max_entries: int = 1_000_000, context: str = "all") -> None:
    if DRY:
        return
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context=context, stacks=stacks, max_entries=max_entries)


def tensor_bytes(ts) -> int:
    seen, total = set(), 0
    for t in ts:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def model_facts(model, opt=None) -> dict[str, Any]:
    import torch

    params = list(model.parameters())
    facts: dict[str, Any] = {
        "param_bytes": tensor_bytes(params),
        "param_count": len(params),
        "param_sizes": sorted({p.numel() * p.element_size() for p in params}),
        "buffer_bytes": tensor_bytes(list(model.buffers())),
        "grad_bytes": tensor_bytes([p.grad for p in params if p.grad is not None]),
    }
    if opt is not None:
        state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.device.type != "cpu"]
        facts["optimizer_state_bytes"] = tensor_bytes(state)
        facts["optimizer"] = type(opt).__name__
    return facts


def dump(name: str, info: dict[str, Any], devices: list[int] | None = None) -> None:
    """memory_stats() of each device, then the snapshot (xz-compressed), with nothing allocated
    between the two; then ``<name>.truth.json``."""
    if DRY:
        print(f"[{name}] dry run: {json.dumps(info, default=str)[:300]}", flush=True)
        return
    import pickle

    import torch

    devs = devices if devices is not None else [torch.cuda.current_device()]
    stats = {str(d): dict(torch.cuda.memory_stats(d)) for d in devs}
    snap = torch.cuda.memory._snapshot()
    with lzma.open(OUT / f"{name}.pickle.xz", "wb", preset=6) as f:
        pickle.dump(snap, f, protocol=4)
    truth = {
        "name": name,
        "torch_version": torch.__version__,
        "device_names": {str(d): torch.cuda.get_device_name(d) for d in devs},
        "device_total_bytes": {str(d): torch.cuda.get_device_properties(d).total_memory for d in devs},
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "hostname": socket.gethostname(),
        "dumped_at_unix_s": time.time(),
        "memory_stats": stats,
        "workload": info,
    }
    (OUT / f"{name}.truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True, default=str))
    print(f"[{name}] dumped", flush=True)


def mlp(width: int = 2048, depth: int = 6):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(DEV)


def gpt2(n_layer=4, n_embd=512, n_head=8, vocab=8192, n_positions=1024):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=n_positions)
    return GPT2LMHeadModel(cfg).to(DEV)


def llama(n_layer=4, hidden=512, heads=8, vocab=8192):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=n_layer,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=2048,
    )
    return LlamaForCausalLM(cfg).to(DEV)


# --------------------------------------------------------------------------- gradients (issue #12, section 1)

STACK_MODES = ("python", "all")
GRAD_KINDS = ("plain", "amp", "accum", "ckpt", "compile")
MLP_BATCH = 256


def _grad_run(kind: str, stacks: str) -> None:
    import torch
    from torch.utils.checkpoint import checkpoint

    record(stacks=stacks)  # before the model is built, as the README tells users
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(DEV) if kind == "amp" else None
    run = torch.compile(model) if kind == "compile" else model
    blocks = [torch.nn.Sequential(model[i], model[i + 1]) for i in range(0, len(model), 2)]
    steps, micro = 3, (4 if kind == "accum" else 1)
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        for _ in range(micro):
            x = torch.randn(MLP_BATCH, 2048, generator=g).to(DEV)
            if kind == "amp":
                with torch.autocast(DEV, dtype=torch.float16 if DEV == "cuda" else torch.bfloat16):
                    loss = run(x).float().pow(2).mean()
                scaler.scale(loss).backward()
            elif kind == "ckpt":
                h = x
                for blk in blocks:
                    h = checkpoint(blk, h, use_reentrant=False)
                (h.pow(2).mean() / micro).backward()
            else:
                (run(x).pow(2).mean() / micro).backward()
            del x
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if step < steps:
            opt.zero_grad(set_to_none=True)
    dump(f"grad_{kind}_{stacks}", {
        "kind": f"gradients-{kind}", "stacks": stacks, "model": "MLP 6 x (Linear(2048, 2048) + GELU)",
        "batch": MLP_BATCH, "micro_steps": micro, "steps_done": steps,
        "dumped": "after opt.step(), before zero_grad()", "recording_started": "before the model was built",
        **model_facts(model, opt),
        "expect": {"gradient_bytes": "param_bytes", "optimizer_state_bytes": "2 * param_bytes", "leak": False},
    })


for _kind in GRAD_KINDS:
    for _mode in STACK_MODES:
        workload(f"grad_{_kind}_{_mode}", "grads")(lambda k=_kind, m=_mode: _grad_run(k, m))


def _late_run(arch: str, stacks: str) -> None:
    """Recording starts after the model and optimizer exist (how most people profile a step)."""
    import torch

    model = gpt2() if arch == "gpt2" else llama()
    opt = (torch.optim.Adam if arch == "gpt2" else torch.optim.AdamW)(model.parameters(), lr=1e-4)
    record(stacks=stacks)
    g = torch.Generator().manual_seed(2)
    steps = 2
    for step in range(1, steps + 1):
        ids = torch.randint(0, 8192, (8, 256), generator=g).to(DEV)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        if step < steps:
            opt.zero_grad(set_to_none=True)
        del ids
    dump(f"late_{arch}_{stacks}", {
        "kind": "recorded-after-model-construction", "arch": arch, "stacks": stacks, "steps_done": steps,
        "dumped": "after opt.step(), before zero_grad()", "recording_started": "after the model and optimizer",
        **model_facts(model, opt),
        "expect": {"gradient_bytes": "param_bytes", "optimizer_state_bytes": "2 * param_bytes", "leak": False},
    })


for _arch in ("gpt2", "llama"):
    for _mode in STACK_MODES:
        workload(f"late_{_arch}_{_mode}", "late")(lambda a=_arch, m=_mode: _late_run(a, m))


@workload("grad_anomaly_python", "grads")
def grad_anomaly():
    """Autograd anomaly mode: allocations made in backward carry the forward frames."""
    import torch

    record(stacks="python")
    model = mlp(depth=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with torch.autograd.set_detect_anomaly(True):
        for step in range(1, 3):
            x = torch.randn(MLP_BATCH, 2048).to(DEV)
            model(x).pow(2).mean().backward()
            opt.step()
            if step < 2:
                opt.zero_grad(set_to_none=True)
    dump("grad_anomaly_python", {
        "kind": "gradients-anomaly-mode", "stacks": "python", "model": "MLP 3 x (Linear(2048, 2048) + GELU)",
        "dumped": "after opt.step(), before zero_grad()", **model_facts(model, opt),
        "expect": {"gradient_bytes": "param_bytes", "forward_frames": True},
    })


# --------------------------------------------------------------------------- DDP over gloo, two ranks on one GPU


def _gloo_worker(rank: int, world: int, bucket_view: bool, stacks: str, outdir: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    global OUT
    OUT = Path(outdir)
    if DEV == "cuda":
        torch.cuda.set_device(0)  # both ranks share GPU 0: the "DDP takes twice the memory" setup
    record(stacks=stacks)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[0] if DEV == "cuda" else None, gradient_as_bucket_view=bucket_view
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    steps = 3
    for step in range(1, steps + 1):
        x = torch.randn(MLP_BATCH, 2048).to(DEV)
        ddp(x).pow(2).mean().backward()
        opt.step()
        if step < steps:
            opt.zero_grad(set_to_none=True)
        del x
    if DEV == "cuda":
        torch.cuda.synchronize()
    tag = "bucketview" if bucket_view else "nobucketview"
    dump(f"gloo_{tag}_{stacks}_rank{rank}", {
        "kind": "ddp-gloo-shared-gpu", "backend": "gloo", "rank": rank, "world_size": world, "stacks": stacks,
        "gradient_as_bucket_view": bucket_view, "steps_done": steps, "bucket_cap_mb": 25,
        "dumped": "after opt.step(), before zero_grad()", **model_facts(model, opt),
        "expect": {"ddp_duplicate_grads": not bucket_view, "leak": False},
    })
    dist.barrier()
    dist.destroy_process_group()


def _gloo_run(bucket_view: bool, stacks: str, port: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_gloo_worker, args=(2, bucket_view, stacks, str(OUT), port), nprocs=2, join=True)


for _i, (_bv, _mode) in enumerate([(b, m) for b in (False, True) for m in STACK_MODES]):
    _tag = "bucketview" if _bv else "nobucketview"
    workload(f"gloo_{_tag}_{_mode}", "gloo")(lambda b=_bv, m=_mode, p=29610 + _i: _gloo_run(b, m, p))


# --------------------------------------------------------------------------- garbage collection what-if


GC_SETTINGS = {
    "default": "",
    "gc06": "garbage_collection_threshold:0.6",
    "gc08": "garbage_collection_threshold:0.8",
    "split64gc06": "max_split_size_mb:64,garbage_collection_threshold:0.6",
    "split128gc08": "max_split_size_mb:128,garbage_collection_threshold:0.8",
}
GC_SEQ_LENS = [384, 1024, 160, 896, 512, 64, 768, 1000, 256, 640]


def gc_job(name: str, cap_bytes: int | None) -> None:
    """A deterministic GPT-2 job of varying sequence lengths (not the what-if family of
    workloads.py: other widths, lengths and batch)."""
    import torch

    record()
    info: dict[str, Any] = {"kind": "whatif-gc", "memory_cap_bytes": cap_bytes, "oom": False,
                            "seq_lens": GC_SEQ_LENS, "batch": 8}
    if cap_bytes and not DRY:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total)
        fired = []

        def observer(device, alloc, limit, device_free):
            if not fired:
                fired.append(1)
                info.update(oom=True, oom_observed=True, observer_args={
                    "device": device, "alloc": alloc, "limit": limit, "device_free": device_free})
                dump(name, info)

        torch._C._cuda_attach_out_of_memory_observer(observer)
    model = gpt2(n_layer=4, n_embd=384, n_head=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(3)
    try:
        for seq in GC_SEQ_LENS:
            ids = torch.randint(0, 8192, (8, seq), generator=g).to(DEV)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del ids
    except torch.OutOfMemoryError:
        return
    dump(name, info)


# --------------------------------------------------------------------------- complete vs wrapped ring buffer


RING_LENS = [256, 640, 128, 896, 384, 512, 192, 768]
# a longer schedule whose lengths climb and fall: the cache fills with segments of many sizes, so the peak reserved
# ends far above the peak in use under the defaults (the case a what-if from a wrapped trace got wrong)
GAP_LENS = [128, 1024, 192, 896, 256, 768, 320, 640, 384, 512, 448, 960, 64, 1024, 160, 832]


def ring_job(name: str, max_entries: int, lens: list[int] = RING_LENS, batch: int = 6) -> None:
    import torch

    record(max_entries=max_entries)
    model = gpt2(n_layer=3, n_embd=384, n_head=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(4)
    for step, seq in enumerate(lens, 1):
        with torch.profiler.record_function(f"train_step#{step}"):
            ids = torch.randint(0, 8192, (batch, seq), generator=g).to(DEV)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del ids
    dump(name, {"kind": "ring", "max_entries": max_entries, "seq_lens": lens, "batch": batch,
                **model_facts(model, opt),
                "twin": name.replace("_wrapped", "_complete") if "wrapped" in name else name.replace(
                    "_complete", "_wrapped"),
                "expect": {"leak": False, "oom": None}})


# twins: one job recorded whole and with a ring buffer that wrapped, under each allocator setting, so a what-if
# from the wrapped recording can be checked against what the setting really did from the job's start
TWIN_SETTINGS = {"": "", "_expandable": "expandable_segments:True", "_split64": "max_split_size_mb:64",
                 "_split128": "max_split_size_mb:128", "_roundup4": "roundup_power2_divisions:4"}
for _exp, _conf in TWIN_SETTINGS.items():
    _env = {"PYTORCH_CUDA_ALLOC_CONF": _conf} if _conf else {}
    workload(f"twin{_exp}_complete", "ring", _env)(lambda e=_exp: ring_job(f"twin{e}_complete", 1_000_000))
    workload(f"twin{_exp}_wrapped", "ring", _env)(lambda e=_exp: ring_job(f"twin{e}_wrapped", 2500))
    workload(f"gaptwin{_exp}_complete", "ring", _env)(
        lambda e=_exp: ring_job(f"gaptwin{e}_complete", 1_000_000, GAP_LENS, batch=8))
    workload(f"gaptwin{_exp}_wrapped", "ring", _env)(
        lambda e=_exp: ring_job(f"gaptwin{e}_wrapped", 4000, GAP_LENS, batch=8))


# --------------------------------------------------------------------------- deep models: a climb, not iterations


@workload("deep_forward_python", "deep")
def deep_forward():
    """ONE training-mode forward pass through a 32-layer GPT-2: every layer saves activations
    for a backward that never comes (the most common thing people profile)."""
    import torch

    record()
    model = gpt2(n_layer=32, n_embd=256, n_head=4)
    ids = torch.randint(0, 8192, (8, 512)).to(DEV)
    out = model(input_ids=ids, labels=ids)
    dump("deep_forward_python", {"kind": "one-forward", "layers": 32, "**": "no backward, no optimizer",
                                 **model_facts(model), "expect": {"leak": False, "iterations": 0}})
    del out


@workload("deep_fwdbwd_python", "deep")
def deep_fwdbwd():
    import torch

    record()
    model = gpt2(n_layer=32, n_embd=256, n_head=4)
    ids = torch.randint(0, 8192, (8, 512)).to(DEV)
    model(input_ids=ids, labels=ids).loss.backward()
    dump("deep_fwdbwd_python", {"kind": "one-forward-backward", "layers": 32, **model_facts(model),
                                "expect": {"leak": False, "iterations": 0}})


@workload("deep_llama_forward_all", "deep")
def deep_llama_forward():
    """A 24-layer Llama, one forward with grad, C++ stacks."""
    import torch

    record(stacks="all")
    model = llama(n_layer=24, hidden=256, heads=4)
    ids = torch.randint(0, 8192, (4, 512)).to(DEV)
    out = model(input_ids=ids, labels=ids)
    dump("deep_llama_forward_all", {"kind": "one-forward", "layers": 24, **model_facts(model),
                                    "expect": {"leak": False, "iterations": 0}})
    del out


@workload("deep_inference_python", "deep")
def deep_inference():
    import torch

    record()
    model = gpt2(n_layer=32, n_embd=256, n_head=4).eval()
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, 8192, (8, 512)).to(DEV)
            model(input_ids=ids)
    dump("deep_inference_python", {"kind": "inference", "layers": 32, "batches": 3, **model_facts(model),
                                   "expect": {"leak": False}})


# --------------------------------------------------------------------------- one bulk empty_cache() before profiling


@workload("bulk_release_python", "deep")
def bulk_release():
    """Warm up with varying shapes (many segments), then start recording, call empty_cache()
    once and train two steps: one bulk release, not churn."""
    import torch

    model = gpt2(n_layer=4, n_embd=384, n_head=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for seq in (1024, 96, 700, 300, 900, 50):
        ids = torch.randint(0, 8192, (8, seq)).to(DEV)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    keep = [torch.empty(3 * 2**20 + 4096 * i, dtype=torch.uint8, device=DEV) for i in range(40)][::2]
    record()
    if not DRY:
        torch.cuda.empty_cache()
    for seq in (512, 768):
        ids = torch.randint(0, 8192, (8, seq)).to(DEV)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dump("bulk_release_python", {"kind": "one-empty-cache-then-train", **model_facts(model, opt),
                                 "kept_tensors": len(keep), "expect": {"empty_cache_churn": False}})


# --------------------------------------------------------------------------- drivers


def _spawn(args: list[str], env_extra: dict[str, str], log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def run_pool(
    jobs: list[tuple[str, list[str], dict[str, str]]],
    parallel: int,
    deadline: float,
    on_done: Callable[[str, dict[str, int]], list[tuple[str, list[str], dict[str, str]]]] | None = None,
) -> dict[str, int]:
    """Run jobs ``parallel`` at a time until ``deadline``; ``on_done`` may add jobs (run first)."""
    pending = list(jobs)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    results: dict[str, int] = {}
    while pending or running:
        while pending and len(running) < parallel and time.time() < deadline:
            label, args, env = pending.pop(0)
            running[label] = (_spawn(args, env, OUT / f"{label}.log"), time.time())
        if not running and pending:
            for label, _, _ in pending:
                results[label] = -2  # never started: out of time
            break
        for label, (p, t0) in list(running.items()):
            rc = p.poll()
            if rc is None and time.time() > deadline:
                p.kill()
                rc = -9
            if rc is not None:
                results[label] = rc
                del running[label]
                print(f"{label}: rc={rc} in {time.time() - t0:.0f}s", flush=True)
                if on_done is not None:
                    pending[:0] = on_done(label, results)
        time.sleep(0.2)
    return results


# caps as shares of a family's uncapped peak reserved: "gcwhatif" squeezes every run into an OOM;
# "gcretry" sits just under the default run's peak, where its out-of-memory retries succeed
GC_FAMILIES = {
    "gcwhatif": lambda peaks, lo: {
        "capH": int(peaks["default"] * 0.93),
        "capM": int(lo * 0.82),
        "capL": int(lo * 0.68),
    },
    "gcretry": lambda peaks, lo: {f"cap{int(f * 1000)}": int(peaks["default"] * f) for f in (0.99, 0.975, 0.96)},
}
GC_RETRY_SETTINGS = ("default", "gc06", "gc08", "split64gc06")


def _family_settings(family: str) -> dict[str, str]:
    return GC_SETTINGS if family == "gcwhatif" else {k: GC_SETTINGS[k] for k in GC_RETRY_SETTINGS}


def _gc_caps(label: str, results: dict[str, int]) -> list[tuple[str, list[str], dict[str, str]]]:
    """Once every uncapped run of a GC family is in, its capped runs: caps placed from the peaks."""
    family = label.split("_")[0]
    if family not in GC_FAMILIES or DRY:
        return []
    settings = _family_settings(family)
    uncapped = [f"{family}_{k}_uncapped" for k in settings]
    if label not in uncapped or not all(u in results for u in uncapped):
        return []
    peaks = {}
    for k in settings:
        t = OUT / f"{family}_{k}_uncapped.truth.json"
        if t.exists():
            peaks[k] = json.loads(t.read_text())["memory_stats"]["0"]["reserved_bytes.all.peak"]
    if "default" not in peaks:
        return []
    caps = GC_FAMILIES[family](peaks, min(peaks.values()))
    (OUT / f"{family}_caps.json").write_text(json.dumps({"peaks": peaks, "caps": caps}, indent=1))
    return [(f"{family}_{k}_{c}", ["gc-one", f"{family}_{k}_{c}", str(cb), "--out", str(OUT)],
             {"PYTORCH_CUDA_ALLOC_CONF": v}) for c, cb in caps.items() for k, v in settings.items()]


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["all", "one", "gc-one", "list"])
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--out", default="holdout_out")
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=480)
    ap.add_argument("--groups", default="")
    a = ap.parse_args()
    OUT = Path(a.out)
    OUT.mkdir(parents=True, exist_ok=True)
    if a.cmd == "list":
        print("\n".join(f"{GROUP[n]:6} {n}" for n in WORKLOADS))
        return
    if a.cmd == "one":
        name = a.rest[0]
        for k, v in ENV[name].items():
            assert os.environ.get(k) == v, f"{k} must be set before CUDA init"
        WORKLOADS[name]()
        return
    if a.cmd == "gc-one":
        gc_job(a.rest[0], None if a.rest[1] == "none" else int(a.rest[1]))
        return
    deadline = time.time() + a.seconds
    groups = set(a.groups.split(",")) if a.groups else None
    names = [n for n in WORKLOADS if groups is None or GROUP[n] in groups]
    # the slow ones (compile, C++ stacks) first
    names.sort(key=lambda n: (0 if ("compile" in n or n.endswith("_all")) else 1, n))
    jobs = [(n, ["one", n, "--out", str(OUT)], ENV[n]) for n in names]
    gc_jobs = []
    for family in GC_FAMILIES:
        if groups is None or family in groups:
            gc_jobs += [(f"{family}_{k}_uncapped", ["gc-one", f"{family}_{k}_uncapped", "none", "--out", str(OUT)],
                         {"PYTORCH_CUDA_ALLOC_CONF": v}) for k, v in _family_settings(family).items()]
    res = run_pool(gc_jobs + jobs, a.jobs, deadline, on_done=_gc_caps)
    print(json.dumps(res, indent=1))
    bad = {k: v for k, v in res.items() if v != 0}
    print("FAILED:", bad if bad else "none", flush=True)


if __name__ == "__main__":
    main()
