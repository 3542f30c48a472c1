"""Parallel-training recordings on a 2-GPU machine (issues #12, #14 and #15), one snapshot per rank.

- Parallel strategies and the planner (#14, #15): two models (a GPT-style decoder built from a
  config, and 8 x (Linear(2048, 2048) + GELU)), each on ONE GPU (``single_<model>``) and at world
  size 2 under DDP (``gradient_as_bucket_view`` False/True), FSDP2 (``reshard_after_forward``
  True/False), FSDP1 (FULL_SHARD / SHARD_GRAD_OP), tensor parallelism (DTensor) and pipeline
  parallelism (GPipe / 1F1B, 8 microbatches); same per-rank batch everywhere. Each is one run of
  ``jobs/train_parallel.py`` under ``torchrun ... -m snapshot_lab run`` (``python3 -m
  snapshot_lab run`` for one GPU): the sidecar records memory_stats() and the parallel layout.
- DDP over NCCL (#12): the gloo workload of ``workloads_holdout.py`` (6 x (Linear(2048, 2048) +
  GELU), AdamW, batch 256, 3 steps, dumped after ``opt.step()`` before ``zero_grad()``) on two
  GPUs over NCCL, ``gradient_as_bucket_view`` False/True, ``stacks='python'`` and ``'all'``.
- World size 4 (#24, group ``world4``, on a 4-GPU machine): the parallel jobs above but FSDP1
  SHARD_GRAD_OP, ZeRO-1, and FSDP2 over tensor parallelism on a 2 x 2 mesh (``fsdp_tp``), with
  four ranks over NCCL (``<job>_ws4nccl_<model>_rank<r>``); the pipelines have four stages.

Every snapshot lands in ``<out>/final`` as ``<name>.pickle.xz`` + ``<name>.truth.json`` (+
``<name>.meta.json`` for ``snaplab run`` captures); ``--bundle DIR`` then packs them into at most
7 tar files of at most 15.5 MiB each, and writes ``DIR/run.log``.

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=$PWD python3 sample_snapshots/workloads_parallel.py all --out /tmp/par --bundle "$OUT" --seconds 450
    PYTHONPATH=$PWD python3 sample_snapshots/workloads_parallel.py all --only pp_1f1b_transformer --out /tmp/par
    python3 sample_snapshots/workloads_parallel.py list

``SNAPLAB_DRY=1`` runs everything on the CPU over gloo, small, without recording (a check of the
scripts): each job writes ``<name>.dry.json`` (its facts and the detected parallel layout). With
``SNAPLAB_DRY_CAPTURE=1`` as well, the jobs run under ``snaplab run`` as on the GPU, with
``jobs/dry_capture/sitecustomize.py`` standing in for torch.cuda inside the capture: the dump,
compression, sidecar and truth code of the real run is exercised, with dummy counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import lzma
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOB_SCRIPT = HERE / "jobs" / "train_parallel.py"
OUT = Path(".")
DRY = bool(os.environ.get("SNAPLAB_DRY"))
DEV = "cpu" if DRY else "cuda"
# dry runs through `snaplab run` too (with a stand-in for torch.cuda in the capture, for tests)
DRY_CAPTURE = bool(os.environ.get("SNAPLAB_DRY_CAPTURE"))
SNAPLAB_CLI = True  # False when `python -m snapshot_lab` cannot import (then jobs/capture_run.py records)
MAX_TARS = 7  # + run.log = 8 files
MAX_TAR_BYTES = int(15.5 * 2**20)
LOG_TAIL_BYTES = 200_000


@dataclass
class Job:
    name: str
    group: str
    ranks: int  # 1: one GPU (alternating), 2: both GPUs
    argv: list[str] = field(default_factory=list)  # for train_parallel.py, or "nccl" jobs' own
    outputs: list[str] = field(default_factory=list)
    slow: bool = False
    port: int = 0  # the rendezvous port, one per job so that concurrent jobs never clash


def _jobs() -> list[Job]:
    jobs: list[Job] = []
    for bv in (False, True):
        for stacks in ("all", "python"):
            tag = "bucketview" if bv else "nobucketview"
            name = f"ddp_nccl_{tag}_{stacks}"
            jobs.append(Job(name, "nccl", 2, ["nccl", str(int(bv)), stacks],
                            [f"{name}_rank{r}" for r in (0, 1)], slow=stacks == "all"))
    variants = [
        ("ddp_nobucketview", ["--strategy", "ddp", "--bucket-view", "0"]),
        ("ddp_bucketview", ["--strategy", "ddp", "--bucket-view", "1"]),
        ("fsdp2_reshard", ["--strategy", "fsdp2", "--reshard", "1"]),
        ("fsdp2_noreshard", ["--strategy", "fsdp2", "--reshard", "0"]),
        ("fsdp1_fullshard", ["--strategy", "fsdp1", "--sharding", "FULL_SHARD"]),
        ("fsdp1_shardgradop", ["--strategy", "fsdp1", "--sharding", "SHARD_GRAD_OP"]),
        ("tp", ["--strategy", "tp"]),
        ("pp_gpipe", ["--strategy", "pp", "--schedule", "gpipe", "--microbatches", "8"]),
        ("pp_1f1b", ["--strategy", "pp", "--schedule", "1f1b", "--microbatches", "8"]),
    ]
    for model in ("transformer", "mlp"):
        for prefix, args in variants:
            name = f"{prefix}_{model}"
            jobs.append(Job(name, f"parallel-{model}", 2, [*args, "--model", model, "--name", name],
                            [f"{name}_rank{r}" for r in (0, 1)]))
        name = f"single_{model}"
        jobs.append(Job(name, f"single-{model}", 1, ["--strategy", "single", "--model", model, "--name", name], [name]))
    # issue #24 on a 4-GPU machine: world size 4 over NCCL, 4-stage pipelines among them (group "world4")
    zero1 = ("zero1", ["--strategy", "zero1", "--bucket-view", "0"])
    world4 = [v for v in variants if v[0] != "fsdp1_shardgradop"] + [zero1]
    for model in ("transformer", "mlp"):
        small = "64" if model == "mlp" else "4"  # activations far below one unit's parameters
        # group "world4b", recorded after "world4": FSDP2 over TP on a 2 x 2 mesh, and FSDP2 at a small
        # batch with and without an explicit 3-unit prefetch (fsdp-prefetch-peak's positive and negative)
        fsdp2_small = ["--strategy", "fsdp2", "--reshard", "1", "--batch", small]
        later = [("fsdp_tp", ["--strategy", "fsdp_tp", "--reshard", "1"]),
                 ("fsdp2_prefetch3_small", [*fsdp2_small, "--prefetch", "3"]),
                 ("fsdp2_default_small", fsdp2_small)]
        for group, specs in (("world4", world4), ("world4b", later)):
            for prefix, args in specs:
                name = f"{prefix}_ws4nccl_{model}"
                jobs.append(Job(name, group, 4, [*args, "--model", model, "--name", name],
                                [f"{name}_rank{r}" for r in range(4)]))
    return jobs


JOBS = {j.name: j for j in _jobs()}


# --------------------------------------------------------------------------- DDP over NCCL (issue #12)


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
        state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.device.type == DEV]
        facts["optimizer_state_bytes"] = tensor_bytes(state)
        facts["optimizer"] = type(opt).__name__
    return facts


def _parallel_layout() -> dict[str, Any] | None:
    """What snaplab's sidecar would record as "parallel" (capture is stdlib-only: no pandas needed)."""
    sys.path.insert(0, str(HERE / "jobs"))
    try:
        from capture_run import import_capture

        return import_capture().parallel_layout()
    except Exception as exc:
        return {"error": repr(exc)}


def dump(name: str, info: dict[str, Any], devices: list[int] | None = None) -> None:
    """memory_stats() of each device, then the snapshot (xz-compressed), with nothing allocated
    between the two; then ``<name>.truth.json`` (as workloads_holdout.py)."""
    info = {**info, "parallel_layout": _parallel_layout()}
    if DRY:
        print(f"[{name}] dry run: {json.dumps(info, default=str)[:600]}", flush=True)
        (OUT / f"{name}.dry.json").write_text(json.dumps({"workload": info}, indent=1, default=str))
        return
    import pickle

    import torch

    devs = devices if devices is not None else [torch.cuda.current_device()]
    stats = {str(d): dict(torch.cuda.memory_stats(d)) for d in devs}
    snap = torch.cuda.memory._snapshot()
    with lzma.open(OUT / f"{name}.pickle.xz", "wb", preset=6) as f:
        pickle.dump(snap, f, protocol=4)
    dev = str(devs[0])
    info["peak_allocated_bytes"] = stats[dev].get("allocated_bytes.all.peak")
    info["peak_reserved_bytes"] = stats[dev].get("reserved_bytes.all.peak")
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


MLP_BATCH = 256


def _nccl_worker(rank: int, world: int, bucket_view: bool, stacks: str, outdir: str, port: int) -> None:
    """workloads_holdout._gloo_worker on NCCL, one GPU per rank."""
    import torch
    import torch.distributed as dist

    global OUT
    OUT = Path(outdir)
    if DEV == "cuda":
        torch.cuda.set_device(rank)
    record(stacks=stacks)  # before the model is built
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    model = mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[rank] if DEV == "cuda" else None, gradient_as_bucket_view=bucket_view
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
    dump(f"ddp_nccl_{tag}_{stacks}_rank{rank}", {
        "kind": "ddp-nccl", "backend": "nccl" if DEV == "cuda" else "gloo (dry run)", "rank": rank,
        "world_size": world, "stacks": stacks, "gradient_as_bucket_view": bucket_view, "steps_done": steps,
        "bucket_cap_mb": 25, "batch": MLP_BATCH, "per_rank_batch": MLP_BATCH,
        "model": "MLP 6 x (Linear(2048, 2048) + GELU)", "strategy": "ddp",
        "dumped": "after opt.step(), before zero_grad()", "recording_started": "before the model was built",
        "gloo_twin": f"gloo_{tag}_{stacks}_rank{rank}",
        **model_facts(model, opt),
        "expect": {"ddp_duplicate_grads": not bucket_view, "gradient_bytes": "param_bytes",
                   "optimizer_state_bytes": "2 * param_bytes", "leak": False},
    }, devices=[rank] if DEV == "cuda" else None)
    dist.barrier()
    dist.destroy_process_group()


def nccl_run(bucket_view: bool, stacks: str, port: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_nccl_worker, args=(2, bucket_view, stacks, str(OUT), port), nprocs=2, join=True)


# --------------------------------------------------------------------------- driver


def command(job: Job, final: Path, raw: Path, port: int) -> list[str]:
    py = sys.executable
    if job.argv[0] == "nccl":
        return [py, str(Path(__file__).resolve()), "nccl-one", job.argv[1], job.argv[2], str(port), "--out", str(final)]
    script = [str(JOB_SCRIPT), *job.argv, "--final-dir", str(final)]
    runner = ["-m", "snapshot_lab", "run"] if SNAPLAB_CLI else [str(HERE / "jobs" / "capture_run.py")]
    capture = [] if DRY and not DRY_CAPTURE else [*runner, "--out", str(raw / job.name),
                                                  "--max-entries", "1000000", "--stacks", "python"]
    if job.ranks == 1:
        return [py, *(capture or []), *script]
    launcher = [py, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(job.ranks),
                "--master_addr", "127.0.0.1", "--master_port", str(port)]
    return [*launcher, *capture, *script] if capture else [*launcher, *script]


def _env(job: Job, gpu: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    shim = str(HERE / "jobs" / "dry_capture") if DRY and DRY_CAPTURE else ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    env.setdefault("OMP_NUM_THREADS", "2")
    if job.ranks == 1 and not DRY:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def run_jobs(jobs: list[Job], out: Path, parallel: int, deadline: float, job_seconds: float, log) -> dict[str, Any]:
    final, raw, logs = out / "final", out / "raw", out / "logs"
    for d in (final, raw, logs):
        d.mkdir(parents=True, exist_ok=True)
    pending = list(jobs)
    running: dict[str, tuple[subprocess.Popen, float, Job]] = {}
    results: dict[str, Any] = {}
    n_single = 0
    expected = (".truth.json", ".dry.json") if DRY else (".truth.json",)
    port_base = 29650 + (os.getpid() % 50) * 40
    for i, job in enumerate(jobs):
        job.port = port_base + i
    while pending or running:
        while pending and len(running) < parallel and time.time() < deadline - 10:
            job = pending.pop(0)
            gpu = n_single % 2
            if job.ranks == 1:
                n_single += 1
            cmd = command(job, final, raw, job.port)
            fh = (logs / f"{job.name}.log").open("w")
            fh.write(" ".join(cmd) + "\n\n")
            fh.flush()
            p = subprocess.Popen(cmd, env=_env(job, gpu), stdout=fh, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                 start_new_session=True)
            running[job.name] = (p, time.time(), job)
            log(f"start {job.name} (pid {p.pid}{f', GPU {gpu}' if job.ranks == 1 and not DRY else ''})")
        if not running and pending:
            for job in pending:
                results[job.name] = {"rc": None, "status": "not started: out of time"}
                log(f"skip  {job.name}: out of time")
            break
        for name, (p, t0, job) in list(running.items()):
            rc = p.poll()
            status = None
            if rc is None and (time.time() > deadline or time.time() - t0 > job_seconds):
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc, status = p.returncode, "killed: past its deadline"
            if rc is None:
                continue
            del running[name]
            missing = [o for o in job.outputs if not any((final / (o + ext)).exists() for ext in expected)]
            status = status or ("ok" if rc == 0 and not missing else "FAILED")
            earlier = results.get(name, {}).get("attempts", [])
            results[name] = {"rc": rc, "status": status, "seconds": round(time.time() - t0, 1), "missing": missing,
                             "attempts": [*earlier, status]}
            gone = f" missing {missing}" if missing else ""
            log(f"done  {name}: {status} rc={rc} in {time.time() - t0:.0f}s{gone}")
            if status != "ok":
                tail = (logs / f"{name}.log").read_text(errors="replace")[-3000:]
                (logs / f"{name}.attempt{len(earlier) + 1}.log").write_text(tail)
                log("      " + tail.replace("\n", "\n      "))
                # one more try, at the end of the queue and on another port (a port taken, a
                # transient NCCL error), when there is time for it
                if status == "FAILED" and not earlier and time.time() + job_seconds / 2 < deadline:
                    job.port += 2000
                    pending.append(job)
                    log(f"retry {name} later (port {job.port})")
        time.sleep(0.3)
    return results


def bundle(out: Path, dest: Path, results: dict[str, Any], log) -> list[Path]:
    """Pack final/ (per job, a job's files together) and the logs' tails into <= MAX_TARS tars."""
    final, logs = out / "final", out / "logs"
    groups: dict[str, list[Path]] = {}
    for f in sorted(final.iterdir()):
        job = next((j for j in JOBS if f.name.startswith(j + "_rank") or f.name.startswith(j + ".")), f.name)
        groups.setdefault(job, []).append(f)
    extras = out / "bundle_extras"
    extras.mkdir(exist_ok=True)
    (extras / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    for lf in sorted(logs.glob("*.log")):
        data = lf.read_bytes()
        (extras / lf.name).write_bytes(data[-LOG_TAIL_BYTES:])
    groups["_logs"] = sorted(extras.iterdir())
    bins: list[tuple[int, list[Path]]] = []
    left_out = []
    for key, files in sorted(groups.items(), key=lambda kv: -sum(f.stat().st_size for f in kv[1])):
        size = sum(f.stat().st_size + 1024 for f in files) + 10240
        for i, (used, members) in enumerate(bins):
            if used + size <= MAX_TAR_BYTES:
                bins[i] = (used + size, members + files)
                break
        else:
            if len(bins) < MAX_TARS and size <= MAX_TAR_BYTES:
                bins.append((size, list(files)))
            else:
                left_out.append(key)
    dest.mkdir(parents=True, exist_ok=True)
    tars = []
    for i, (_, members) in enumerate(bins, 1):
        path = dest / f"parallel_snapshots_{i}.tar"
        with tarfile.open(path, "w") as tf:
            for f in members:
                arc = f"logs/{f.name}" if f.parent == extras else f.name
                tf.add(f, arcname=arc)
        tars.append(path)
        log(f"bundle {path.name}: {len(members)} files, {path.stat().st_size / 2**20:.2f} MiB")
    if left_out:
        log(f"bundle: LEFT OUT (no room): {left_out}")
    return tars


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["all", "list", "nccl-one"])
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--out", default="/tmp/snaplab_parallel")
    ap.add_argument("--bundle", default="", help="folder for the tar files and run.log")
    ap.add_argument("--seconds", type=float, default=450, help="deadline for all jobs")
    ap.add_argument("--job-seconds", type=float, default=240, help="deadline of one job")
    ap.add_argument("--parallel", type=int, default=4, help="jobs at a time")
    ap.add_argument("--only", default="", help="comma-separated job names or groups")
    a = ap.parse_args()
    if a.cmd == "list":
        for j in JOBS.values():
            print(f"{j.group:20} {j.name:28} ranks={j.ranks} -> {', '.join(j.outputs)}")
        return
    if a.cmd == "nccl-one":
        OUT = Path(a.out)
        OUT.mkdir(parents=True, exist_ok=True)
        bv, stacks, port = a.rest
        nccl_run(bool(int(bv)), stacks, int(port))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dest = Path(a.bundle) if a.bundle else None
    log_lines: list[str] = []
    t_start = time.time()

    def log(msg: str) -> None:
        line = f"[{time.time() - t_start:6.1f}s] {msg}"
        print(line, flush=True)
        log_lines.append(line)

    log(f"workloads_parallel: dry={DRY} python={sys.version.split()[0]} host={socket.gethostname()} out={out}")
    try:
        import torch

        info = f"torch {torch.__version__}"
        if not DRY and torch.cuda.is_available():
            info += f", {torch.cuda.device_count()} GPUs: " + ", ".join(
                torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        log(info)
    except Exception as exc:
        log(f"torch: {exc!r}")
    global SNAPLAB_CLI
    check = subprocess.run([sys.executable, "-c", "import snapshot_lab.cli"], env=_env(JOBS["single_mlp"], 0),
                           cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    SNAPLAB_CLI = check.returncode == 0
    if not SNAPLAB_CLI:
        err = (check.stderr.strip().splitlines() or ["?"])[-1]
        log(f"`python -m snapshot_lab` cannot import ({err}): recording through jobs/capture_run.py")
    wanted = {w for w in a.only.split(",") if w}
    jobs = [j for j in JOBS.values() if not wanted or j.name in wanted or j.group in wanted]
    jobs.sort(key=lambda j: (not j.slow, j.ranks == 1, j.name))  # C++ stacks first: they dump slowly
    results: dict[str, Any] = {}
    try:
        results = run_jobs(jobs, out, a.parallel, t_start + a.seconds, a.job_seconds, log)
    except Exception:
        log("driver error:\n" + traceback.format_exc())
    bad = {k: v["status"] for k, v in results.items() if v["status"] != "ok"}
    log(f"jobs: {len(results)} run, {len(results) - len(bad)} ok; FAILED: {bad if bad else 'none'}")
    if dest is not None:
        try:
            bundle(out, dest, results, log)
        except Exception:
            log("bundle error:\n" + traceback.format_exc())
        log(f"total {time.time() - t_start:.0f}s")
        (dest / "run.log").write_text("\n".join(log_lines) + "\n")


if __name__ == "__main__":
    main()
