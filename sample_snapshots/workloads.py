"""Real workloads that produce the bundled sample snapshots (run on a CUDA machine).

Every sample is recorded by real PyTorch on a real GPU.  For each ``<name>.pickle`` this
script also writes ``<name>.truth.json`` holding ``torch.cuda.memory_stats(d)`` for every
device, taken immediately before ``_dump_snapshot`` (no GPU allocation happens between the
two), plus what is known about the workload (parameter bytes, leak growth, OOM request...).

Usage (on the GPU machine)::

    python3 sample_snapshots/workloads.py all --out /tmp/samples --jobs 6
    python3 sample_snapshots/workloads.py one transformer_varlen --out /tmp/samples
    python3 sample_snapshots/workloads.py multi --out /tmp/samples   # needs 2 GPUs

Each workload runs in its own process so that allocator settings (which are read at CUDA
initialisation) and allocator state never leak from one sample into another.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

OUT = Path(".")
WORKLOADS: dict[str, Callable[[], None]] = {}
ENV: dict[str, dict[str, str]] = {}


def workload(name: str, env: dict[str, str] | None = None):
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        WORKLOADS[name] = fn
        ENV[name] = env or {}
        return fn

    return deco


# --------------------------------------------------------------------------- helpers


def record(enabled: str = "all", context: str = "all", stacks: str = "python", max_entries: int = 200_000):
    import torch

    torch.cuda.memory._record_memory_history(
        enabled=enabled, context=context, stacks=stacks, max_entries=max_entries
    )


def dump(name: str, info: dict[str, Any], devices: list[int] | None = None) -> None:
    """memory_stats() of each device, then the snapshot, with nothing allocated between."""
    import torch

    devs = devices if devices is not None else [torch.cuda.current_device()]
    stats = {str(d): dict(torch.cuda.memory_stats(d)) for d in devs}
    path = OUT / f"{name}.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
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
    (OUT / f"{name}.truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True))
    print(f"[{name}] dumped {path.stat().st_size} bytes", flush=True)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def gpt2(n_layer=4, n_embd=512, n_head=8, vocab=8192, n_positions=1024):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=n_positions,
    )
    return GPT2LMHeadModel(cfg).cuda()


# --------------------------------------------------------------------------- single-GPU workloads


@workload("transformer_varlen")
def transformer_varlen():
    """GPT-2 (from a config) trained 8 steps on batches of varying sequence length; a snapshot at
    step 4 and one at the end (same job, for diff)."""
    import torch

    record(max_entries=400_000)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    seq_lens = [int(x) for x in torch.randint(64, 768, (8,), generator=g)]
    per_step_allocated = []
    for step, seq in enumerate(seq_lens, 1):
        with torch.profiler.record_function(f"train_step#{step}"):
            ids = torch.randint(0, 8192, (8, seq), device="cuda")
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            with torch.profiler.record_function("optimizer_step"):
                opt.step()
            opt.zero_grad(set_to_none=True)
            del out, ids
        per_step_allocated.append(torch.cuda.memory_allocated())
        if step == 4:
            dump("transformer_varlen_step4", {
                "kind": "transformer", "model": "GPT2LMHeadModel(n_layer=4,n_embd=512,vocab=8192)",
                "optimizer": "AdamW", "steps_done": 4, "seq_lens": seq_lens[:4], "batch": 8,
                "param_bytes": param_bytes(model), "per_step_allocated_bytes": list(per_step_allocated),
                "expect": {"leak": False, "oom": None},
            })
    dump("transformer_varlen", {
        "kind": "transformer", "model": "GPT2LMHeadModel(n_layer=4,n_embd=512,vocab=8192)",
        "optimizer": "AdamW", "steps_done": 8, "seq_lens": seq_lens, "batch": 8,
        "param_bytes": param_bytes(model), "per_step_allocated_bytes": per_step_allocated,
        "expect": {"leak": False, "oom": None},
    })


@workload("cnn_clean")
def cnn_clean():
    """torchvision ResNet-18, SGD with momentum, 6 clean steps."""
    import torch
    import torchvision

    record()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=100).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_step = []
    for step in range(1, 7):
        with torch.profiler.record_function(f"train_step#{step}"):
            x = torch.randn(32, 3, 224, 224, device="cuda")
            y = torch.randint(0, 100, (32,), device="cuda")
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            with torch.profiler.record_function("optimizer_step"):
                opt.step()
            opt.zero_grad(set_to_none=True)
            del x, y, loss
        per_step.append(torch.cuda.memory_allocated())
    dump("cnn_clean", {
        "kind": "cnn", "model": "torchvision resnet18(num_classes=100)", "optimizer": "SGD(momentum=0.9)",
        "steps_done": 6, "batch": 32, "param_bytes": param_bytes(model), "per_step_allocated_bytes": per_step,
        "expect": {"leak": False, "oom": None},
    })


@workload("leak_graph")
def leak_graph():
    """An MLP training loop with two classic leaks: each step's output appended to a list, and an
    auxiliary loss computed with grad enabled and kept (with its graph and saved activations)."""
    import torch

    record()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024),
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    outputs, aux_losses = [], []
    per_step = []
    for step in range(1, 31):
        with torch.profiler.record_function(f"train_step#{step}"):
            x = torch.randn(64, 1024, device="cuda")
            out = model(x)
            loss = out.pow(2).mean()
            loss.backward()
            with torch.profiler.record_function("optimizer_step"):
                opt.step()
            opt.zero_grad(set_to_none=True)
            outputs.append(out.detach())  # leak 1: 64*1024*4 = 256 KiB per step
            probe = torch.randn(4, 1024, device="cuda")
            aux_losses.append(model(probe).mean())  # leak 2: graph + saved activations kept
            del x, out, loss, probe
        per_step.append(torch.cuda.memory_allocated())
    growth = [b - a for a, b in zip(per_step, per_step[1:])]
    dump("leak_graph", {
        "kind": "mlp-leak", "steps_done": 30, "batch": 64, "param_bytes": param_bytes(model),
        "per_step_allocated_bytes": per_step, "growth_bytes_per_step": growth,
        "leak_sites": ["outputs.append(out.detach())", "aux_losses.append(model(probe).mean())"],
        "expect": {"leak": True, "oom": None},
    })


def _frag_setup(cap_extra: int):
    """Fill ~1.5 GiB with 6 MiB blocks (3 per 20 MiB segment), then free 2 of every 3 so each
    segment keeps one live block and a 14 MiB hole.  Returns the kept tensors."""
    import torch

    torch.cuda.set_per_process_memory_fraction(1.0)
    blocks = [torch.empty(6 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(225)]
    keep = blocks[::3]
    del blocks
    reserved = torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((reserved + cap_extra) / total)
    return keep, reserved, total


def _oom_observer(name: str, info: dict[str, Any]):
    import torch

    fired = []

    def observer(device, alloc, device_allocated, device_free):
        if fired:
            return
        fired.append(1)
        info["oom_observed"] = True
        info["observer_args"] = {
            "device": device, "alloc": alloc, "device_allocated_or_limit": device_allocated,
            "device_free": device_free,
        }
        dump(name, info)

    torch._C._cuda_attach_out_of_memory_observer(observer)
    return fired


@workload("oom_fragmentation")
def oom_fragmentation():
    """Fragmentation OOM: plenty of free bytes in reserved segments but no hole of 15 MiB, and a
    memory cap that forbids a new segment. The OOM observer dumps the snapshot."""
    import torch

    record()
    info: dict[str, Any] = {"kind": "oom-fragmentation", "expect": {"leak": False, "oom": "fragmentation"}}
    fired = _oom_observer("oom_fragmentation", info)
    keep, reserved, total = _frag_setup(cap_extra=8 * 2**20)
    info.update({"reserved_before_request": reserved, "device_total_bytes": total,
                 "memory_cap_bytes": reserved + 8 * 2**20, "requested_bytes": 15 * 2**20,
                 "live_blocks": len(keep), "live_block_bytes": 6 * 2**20})
    try:
        torch.empty(15 * 2**20, dtype=torch.uint8, device="cuda")
        raise SystemExit("expected an OOM")
    except torch.OutOfMemoryError:
        assert fired, "observer did not fire"


@workload("oom_capacity")
def oom_capacity():
    """Capacity OOM: under a 1 GiB cap the job keeps 96 MiB activations alive until the cap is hit."""
    import torch

    record()
    info: dict[str, Any] = {"kind": "oom-capacity", "expect": {"leak": False, "oom": "capacity"}}
    fired = _oom_observer("oom_capacity", info)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(2**30 / total)
    info.update({"memory_cap_bytes": 2**30, "device_total_bytes": total, "requested_bytes": 96 * 2**20})
    acts = []
    try:
        for _ in range(100):
            acts.append(torch.empty(96 * 2**20, dtype=torch.uint8, device="cuda"))
        raise SystemExit("expected an OOM")
    except torch.OutOfMemoryError:
        assert fired
        info["live_tensors_at_oom"] = len(acts)


@workload("expandable", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
def expandable():
    """ResNet-18 with expandable segments; batch size changes and an empty_cache() in the middle
    make the allocator map and unmap pages."""
    import torch
    import torchvision

    record()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [64, 16, 48, 8]
    for step, bs in enumerate(batches, 1):
        with torch.profiler.record_function(f"train_step#{step}"):
            x = torch.randn(bs, 3, 160, 160, device="cuda")
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x, loss
        if step == 2:
            torch.cuda.empty_cache()
    small = [torch.randn(1000 + i, device="cuda") for i in range(20)]
    dump("expandable", {
        "kind": "cnn-expandable", "batches": batches, "param_bytes": param_bytes(model),
        "small_live": len(small), "expect": {"leak": False, "oom": None},
    })


@workload("state_only")
def state_only():
    """enabled='state': stacks on live blocks only, no trace history."""
    import torch

    record(enabled="state")
    model = gpt2(n_layer=2, n_embd=256)
    opt = torch.optim.Adam(model.parameters())
    for step in range(2):
        ids = torch.randint(0, 8192, (4, 256), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    dump("state_only", {"kind": "transformer-state-only", "param_bytes": param_bytes(model),
                        "expect": {"leak": False, "oom": None}})


@workload("cpp_stacks")
def cpp_stacks():
    """stacks='all': Python frames interleaved with symbolised C++ frames."""
    import torch

    record(stacks="all", max_entries=4000)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        x = torch.randn(128, 512, device="cuda")
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    dump("cpp_stacks", {"kind": "mlp-cpp-stacks", "param_bytes": param_bytes(model),
                        "expect": {"leak": False, "oom": None}})


@workload("cuda_graph")
def cuda_graph():
    """Forward+backward captured in a CUDA graph: its memory lives in a private pool."""
    import torch

    record()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    static_x = torch.randn(256, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(static_x).pow(2).mean().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        static_loss = model(static_x).pow(2).mean()
        static_loss.backward()
        opt.step()
    for _ in range(3):
        static_x.copy_(torch.randn(256, 1024, device="cuda"))
        g.replay()
    dump("cuda_graph", {"kind": "cuda-graph", "param_bytes": param_bytes(model),
                        "expect": {"leak": False, "oom": None, "private_pool": True}})


@workload("pending_free")
def pending_free():
    """A tensor used on a side stream (record_stream) and freed while that stream is still busy:
    the snapshot shows it as active_pending_free."""
    import torch

    record()
    keep = torch.randn(4096, 1024, device="cuda")
    x = torch.randn(2048, 1024, device="cuda")
    small = torch.randn(100, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(3_000_000_000)
        y = x * 2
        z = small + 1
    x.record_stream(side)
    small.record_stream(side)
    del x, small
    dump("pending_free", {"kind": "record-stream", "pending_bytes_requested": 2048 * 1024 * 4 + 400,
                          "expect": {"leak": False, "oom": None, "pending_free_blocks": 2}})
    torch.cuda.synchronize()
    del y, z, keep


@workload("ring_wrapped")
def ring_wrapped():
    """A ring buffer of 3000 entries over a longer run: the trace misses the early history."""
    import torch

    record(max_entries=3000)
    model = gpt2(n_layer=2, n_embd=256)
    opt = torch.optim.AdamW(model.parameters())
    for step in range(1, 13):
        with torch.profiler.record_function(f"train_step#{step}"):
            ids = torch.randint(0, 8192, (4, 128 * (1 + step % 4)), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    dump("ring_wrapped", {"kind": "transformer-ring-wrapped", "max_entries": 3000,
                          "param_bytes": param_bytes(model), "expect": {"leak": False, "oom": None}})


@workload("empty_cache_churn")
def empty_cache_churn():
    """A training loop that calls torch.cuda.empty_cache() every step: the allocator gives its
    segments back and cudaMallocs them again each iteration."""
    import torch

    record()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 2048)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 11):
        with torch.profiler.record_function(f"train_step#{step}"):
            x = torch.randn(512, 2048, device="cuda")
            model(x).pow(2).mean().backward()
            with torch.profiler.record_function("optimizer_step"):
                opt.step()
            opt.zero_grad(set_to_none=True)
            del x
        torch.cuda.empty_cache()
    dump("empty_cache_churn", {"kind": "empty-cache-churn", "steps_done": 10, "param_bytes": param_bytes(model),
                               "expect": {"empty_cache_churn": True, "leak": False, "oom": None}})


# --------------------------------------------------------------------------- allocator what-if family

WHATIF_SETTINGS = {
    "default": "",
    "expandable": "expandable_segments:True",
    "maxsplit": "max_split_size_mb:64",
    "roundup": "roundup_power2_divisions:4",
    "gc": "garbage_collection_threshold:0.6",
}


def whatif_workload(cap_bytes: int | None, name: str):
    """Deterministic varlen transformer-like workload (fixed seed and shapes)."""
    import torch

    record()
    info: dict[str, Any] = {"kind": "whatif", "memory_cap_bytes": cap_bytes, "oom": False}
    total = torch.cuda.get_device_properties(0).total_memory
    if cap_bytes:
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total)
        _oom_observer(name, info)
    torch.manual_seed(0)
    model = gpt2(n_layer=3, n_embd=512)
    opt = torch.optim.AdamW(model.parameters())
    seq_lens = [700, 96, 512, 1000, 128, 900, 256, 1024]
    try:
        for step, seq in enumerate(seq_lens, 1):
            ids = torch.randint(0, 8192, (6, seq), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del ids
    except torch.OutOfMemoryError:
        info["oom"] = True
        return
    info["seq_lens"] = seq_lens
    dump(name, info)


def _whatif_entry(argv: list[str]) -> None:
    cap = int(argv[1]) if argv[1] != "none" else None
    whatif_workload(cap, argv[0])


# --------------------------------------------------------------------------- multi-GPU workloads


def _ddp_worker(rank: int, world: int, bucket_view: bool, name: str, outdir: str) -> None:
    import torch
    import torch.distributed as dist

    global OUT
    OUT = Path(outdir)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533" if bucket_view else "29534")
    torch.cuda.set_device(rank)
    record()
    dist.init_process_group("nccl", rank=rank, world_size=world)
    model = gpt2(n_layer=4, n_embd=512)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], gradient_as_bucket_view=bucket_view)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    for step in range(1, 5):
        with torch.profiler.record_function(f"train_step#{step}"):
            ids = torch.randint(0, 8192, (8, 256), device="cuda")
            ddp(input_ids=ids, labels=ids).loss.backward()
            with torch.profiler.record_function("optimizer_step"):
                opt.step()
            opt.zero_grad(set_to_none=False)
            del ids
    torch.cuda.synchronize()
    dump(f"{name}_rank{rank}", {
        "kind": "ddp", "rank": rank, "world_size": world, "gradient_as_bucket_view": bucket_view,
        "param_bytes": param_bytes(model), "bucket_cap_mb": 25, "steps_done": 4,
        "expect": {"ddp_duplicate_grads": not bucket_view, "leak": False, "oom": None},
    }, devices=[rank])
    dist.barrier()
    dist.destroy_process_group()


def ddp_run(bucket_view: bool, name: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, bucket_view, name, str(OUT)), nprocs=2, join=True)


def dataparallel_run() -> None:
    import torch
    import torchvision

    record()
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000).cuda(0)
    dp = torch.nn.DataParallel(model, device_ids=[0, 1])
    opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, 4):
        with torch.profiler.record_function(f"train_step#{step}"):
            x = torch.randn(64, 3, 224, 224, device="cuda:0")
            y = torch.randint(0, 1000, (64,), device="cuda:0")
            torch.nn.functional.cross_entropy(dp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del x, y
    dump("dataparallel", {
        "kind": "dataparallel", "devices": [0, 1], "param_bytes": param_bytes(model), "batch": 64,
        "expect": {"dataparallel_imbalance": True, "leak": False, "oom": None},
    }, devices=[0, 1])


# --------------------------------------------------------------------------- drivers


def run_one(name: str) -> None:
    WORKLOADS[name]()


def _spawn(args: list[str], env_extra: dict[str, str], log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def run_pool(jobs: list[tuple[str, list[str], dict[str, str]]], parallel: int, deadline_s: float) -> dict[str, int]:
    start = time.time()
    pending = list(jobs)
    running: dict[str, subprocess.Popen] = {}
    results: dict[str, int] = {}
    while pending or running:
        while pending and len(running) < parallel:
            label, args, env = pending.pop(0)
            running[label] = _spawn(args, env, OUT / f"{label}.log")
        for label, p in list(running.items()):
            rc = p.poll()
            if rc is None and time.time() - start > deadline_s:
                p.kill()
                rc = -9
            if rc is not None:
                results[label] = rc
                del running[label]
                print(f"{label}: rc={rc} at {time.time() - start:.0f}s", flush=True)
        time.sleep(0.2)
    return results


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["all", "one", "multi", "whatif-one"])
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--out", default="samples_out")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--deadline", type=float, default=420)
    a = ap.parse_args()
    OUT = Path(a.out)
    OUT.mkdir(parents=True, exist_ok=True)
    if a.cmd == "one":
        for k, v in ENV[a.rest[0]].items():
            assert os.environ.get(k) == v, f"{k} must be set before CUDA init"
        run_one(a.rest[0])
        return
    if a.cmd == "whatif-one":
        _whatif_entry(a.rest)
        return
    if a.cmd == "multi":
        for label, fn in [("ddp_bucketview", lambda: ddp_run(True, "ddp_bucketview")),
                          ("ddp_nobucketview", lambda: ddp_run(False, "ddp_nobucketview")),
                          ("dataparallel", dataparallel_run)]:
            try:
                fn()
                print(f"{label}: ok", flush=True)
            except Exception:
                traceback.print_exc()
                print(f"{label}: FAILED", flush=True)
        return
    jobs = [(n, ["one", n, "--out", str(OUT)], ENV[n]) for n in WORKLOADS]
    res = run_pool(jobs, a.jobs, a.deadline)
    # what-if family: uncapped first, then two caps placed between the settings' peaks
    wjobs = [(f"whatif_{k}_uncapped", ["whatif-one", f"whatif_{k}_uncapped", "none", "--out", str(OUT)],
              {"PYTORCH_CUDA_ALLOC_CONF": v}) for k, v in WHATIF_SETTINGS.items()]
    res.update(run_pool(wjobs, a.jobs, a.deadline))
    peaks = {}
    for k in WHATIF_SETTINGS:
        t = OUT / f"whatif_{k}_uncapped.truth.json"
        if t.exists():
            peaks[k] = json.loads(t.read_text())["memory_stats"]["0"]["reserved_bytes.all.peak"]
    print("whatif uncapped peak reserved:", peaks, flush=True)
    if peaks:
        lo, hi = min(peaks.values()), max(peaks.values())
        caps = {"capA": (lo + hi) // 2 if hi > lo else int(lo * 0.98), "capB": int(lo * 0.9)}
        (OUT / "whatif_caps.json").write_text(json.dumps({"peaks": peaks, "caps": caps}, indent=1))
        wjobs = [(f"whatif_{k}_{c}", ["whatif-one", f"whatif_{k}_{c}", str(cb), "--out", str(OUT)],
                  {"PYTORCH_CUDA_ALLOC_CONF": v})
                 for c, cb in caps.items() for k, v in WHATIF_SETTINGS.items()]
        res.update(run_pool(wjobs, a.jobs, a.deadline))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
