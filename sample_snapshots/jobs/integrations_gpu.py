"""One GPU run that validates issue #16's integrations for real (about 3-5 minutes on one GPU).

    PYTHONPATH=$PWD python3 sample_snapshots/jobs/integrations_gpu.py --out "$OUT"

Parts (each independent: one that fails is recorded in results.json and the others still run):

1. lightning:    a small GPT-2 LightningModule trained by lightning.pytorch's Trainer with
                 SnaplabCallback(every_n_steps=3, report=True); then a run that runs out of
                 memory at its third batch (the OOM observer's dump, then on_exception's).
2. transformers: a small GPT-2 (from a config, an in-memory dataset) trained by transformers'
                 Trainer with its SnaplabCallback(every_n_steps=3, report=True).
3. pytest:       pytest -p snapshot_lab.pytest_plugin over gpu_limit_tests.py (one test within
                 its limit_cuda_memory, one over it, one unmarked under --snaplab-max-peak).
4. overhead:     GPT-2 small (124M, from its config) training steps (AdamW, bf16 autocast) untagged
                 vs tag_modules(model) (and backward=False; and with the allocator's history
                 recorded, untagged vs tagged), in a GPU-bound and a launch-bound shape: warm-up,
                 alternating repeats, median step time, overhead in percent.
5. tags:         a tagged training run of a 4-layer GPT-2 recorded with stacks='python' (the
                 by-module sample), the same run untagged (for the stack-based approximation),
                 and what the trace's user_metadata holds: tags by phase, live bytes per tag at the
                 peak (they must add up to the live bytes), the autograd thread's metadata at the
                 start of each backward (must be '' after the first), the process-wide mode.
4b. overhead_medium: the same, tagged vs untagged, on GPT-2 medium (355M) at 8 x 1024.
6. tags_holdout: the same for another family and recipe: a 4-layer Llama with activation
                 checkpointing (rec: tags), recorded with stacks='all', tagged and untagged.

$OUT gets at most 9 files: log.txt (from the command line's tee), results.json, and one
<part>.tar.xz per part holding its snapshots (.pickle.xz), sidecars and reports.

``--dry-run`` runs every part on the CPU with the capture side stood in for (tests/fake_torch.py)
and the allocator's metadata recorded in Python: it checks the script itself, not the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import lzma
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network on the GPU machine: never try
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
START = time.monotonic()
BUDGET_S = 540  # parts that would start after this are skipped (the call's limit is 600 s)
RESULTS: dict[str, Any] = {}
DRY = False
DEVICE = "cuda"


def log(*args: Any) -> None:
    print(f"[{time.monotonic() - START:6.1f}s]", *args, flush=True)


def part(name: str):
    """Run a part, record its result or its traceback; never let it stop the others."""

    def wrap(fn):
        def run(work: Path, out: Path) -> None:
            if time.monotonic() - START > BUDGET_S:
                RESULTS[name] = {"status": "skipped", "why": "out of time"}
                log(f"== {name}: skipped (out of time)")
                return
            log(f"== {name}")
            folder = work / name
            folder.mkdir(parents=True, exist_ok=True)
            t = time.monotonic()
            try:
                res = fn(folder) or {}
                res.setdefault("status", "ok" if all(res.get("checks", {}).values()) else "check failed")
            except BaseException as exc:
                res = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                log(traceback.format_exc())
            res["seconds"] = round(time.monotonic() - t, 1)
            RESULTS[name] = res
            log(f"== {name}: {res['status']} in {res['seconds']} s; checks {res.get('checks')}")
            pack(folder, out / f"{name}.tar.xz")
            write_results(out)

        run.__name__ = name
        return run

    return wrap


def pack(folder: Path, dest: Path, limit: int = 15 * 2**20) -> None:
    """Snapshots xz-compressed, everything in one .tar.xz (the largest files dropped if over 15 MiB)."""
    for p in list(folder.rglob("*.pickle")):
        with p.open("rb") as src, lzma.open(p.with_name(p.name + ".xz"), "wb", preset=6) as dst:
            shutil.copyfileobj(src, dst)
        p.unlink()
    files = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    while True:
        with tarfile.open(dest, "w:xz") as tar:
            for p in files:
                tar.add(p, arcname=str(p.relative_to(folder.parent)))
        if dest.stat().st_size <= limit or not files:
            break
        dropped = files.pop()
        log(f"   {dest.name} too large: leaving out {dropped.name}")
    log(f"   packed {dest.name}: {dest.stat().st_size / 2**20:.2f} MiB, {len(files)} files")


def write_results(out: Path) -> None:
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


# --------------------------------------------------------------------------- shared helpers


def gpt2(n_layer: int = 2, n_embd: int = 256, n_head: int = 4, vocab: int = 8192, positions: int = 256):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab,
        n_positions=positions,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(cfg)


def snapshot_trace(path: Path) -> list[dict[str, Any]]:
    import pickle

    with path.open("rb") as f:
        snap = pickle.load(f)
    traces = snap.get("device_traces") or [[]]
    return [e for tr in traces for e in tr]


def tag_census(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """What user_metadata says: allocations by phase, live bytes per tag at the peak (they add
    up to the live bytes at the peak, by construction: a check that every allocation has a tag
    value, '' included), and the top tags there."""
    from snapshot_lab.module_tags import parse_tag

    allocs = [e for e in entries if e.get("action") == "alloc"]
    has_key = sum("user_metadata" in e for e in allocs)
    phases: dict[str, int] = {}
    for e in allocs:
        p = parse_tag(e.get("user_metadata", ""))
        key = p[0] if p else ("outside" if not e.get("user_metadata") else "other")
        phases[key] = phases.get(key, 0) + 1
    live: dict[int, tuple[int, str]] = {}
    level = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in entries:
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = (e["size"], e.get("user_metadata", ""))
            level += e["size"]
            if level > peak:
                peak, at_peak = level, dict(live)
        elif a == "free_completed" and e["addr"] in live:
            level -= live.pop(e["addr"])[0]
    by_tag: dict[str, int] = {}
    for size, tag in at_peak.values():
        by_tag[tag] = by_tag.get(tag, 0) + size
    top = sorted(by_tag.items(), key=lambda kv: -kv[1])[:25]
    return {
        "trace_entries": len(entries),
        "allocs": len(allocs),
        "allocs_with_user_metadata_key": has_key,
        "allocs_by_phase": phases,
        "peak_live_bytes_in_trace": peak,
        "sum_of_tags_at_peak": sum(by_tag.values()),
        "outside_any_module_at_peak": by_tag.get("", 0),
        "tags_at_peak": len(by_tag),
        "top_tags_at_peak": top,
    }


def snapshot_tags(path: Path) -> dict[str, Any]:
    return tag_census(snapshot_trace(path))


def requested(key: str) -> int:
    """torch's ``requested_bytes.all.<key>`` (``current`` or ``peak``); 0 in a dry run."""
    import torch

    return int(torch.cuda.memory_stats().get(f"requested_bytes.all.{key}", 0)) if not DRY else 0


def record_tags_in_sidecar(path: Path | None, describe: Any) -> None:
    """Put ``ModuleTags.describe()`` into a snapshot's sidecar, as ``recording()`` does when it tags."""
    if describe is None or path is None:
        return
    side = path.with_name(path.name.replace(".pickle", ".meta.json"))
    meta = json.loads(side.read_text())
    meta["module_tags"] = describe
    side.write_text(json.dumps(meta, indent=1))


def log_census(census: dict[str, Any]) -> None:
    log("   tagged census:", json.dumps({k: v for k, v in census.items() if k != "top_tags_at_peak"}))
    for tag, size in census.get("top_tags_at_peak", [])[:12]:
        log(f"     {size / 2**20:9.2f} MiB  {tag!r}")


def report_ok(path: Path | None) -> bool:
    if path is None or not Path(path).exists():
        return False
    html = Path(path).read_text()
    return html.startswith("<!DOCTYPE html>") and 'id="findings"' in html and "<script" not in html


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- 1. Lightning


@part("lightning")
def lightning_part(folder: Path) -> dict[str, Any]:
    import torch

    try:
        import lightning.pytorch as pl

        from snapshot_lab.integrations.lightning import SnaplabCallback
    except ImportError:
        import pytorch_lightning as pl

        from snapshot_lab.integrations.pytorch_lightning import SnaplabCallback

    class LitGPT(pl.LightningModule):
        def __init__(self, oom_at: int | None = None):
            super().__init__()
            self.model = gpt2()
            self.oom_at = oom_at

        def training_step(self, batch, batch_idx):
            if self.oom_at is not None and batch_idx == self.oom_at:
                big = torch.empty(int(1.5 * 2**40), dtype=torch.uint8, device=self.device)  # 1.5 TiB: OOM
                return big.sum()
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 8192, (96, 128)))
    kw = dict(
        accelerator="cpu" if DRY else "gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    cb = SnaplabCallback(out=folder / "fit", every_n_steps=3, report=True)
    pl.Trainer(max_steps=7, callbacks=[cb], **kw).fit(LitGPT(), torch.utils.data.DataLoader(data, batch_size=8))
    final = cb.written[-1] if cb.written else None
    tags = snapshot_tags(final) if final else {}
    log("   fit wrote", [p.name for p in cb.written], "reports", [p.name for p in cb.reports])

    cb2 = SnaplabCallback(out=folder / "oom", report=True)
    raised = None
    try:
        pl.Trainer(max_steps=7, callbacks=[cb2], **kw).fit(
            LitGPT(oom_at=2), torch.utils.data.DataLoader(data, batch_size=8)
        )
    except Exception as exc:  # the OOM, re-raised by Lightning after on_exception
        raised = type(exc).__name__
    log("   oom run raised", raised, "wrote", [p.name for p in cb2.written])
    meta = {}
    if cb2.written:
        side = cb2.written[-1].with_name(cb2.written[-1].name.replace(".pickle", ".meta.json"))
        meta = json.loads(side.read_text()) if side.exists() else {}
    whys = [p.name.rsplit("_", 1)[-1].removesuffix(".pickle") for p in cb.written]
    return {
        "package": pl.__name__,
        "version": getattr(sys.modules.get(pl.__name__.split(".")[0]), "__version__", "?"),
        "fit_written": [p.name for p in cb.written],
        "fit_reports": [p.name for p in cb.reports],
        "fit_tags": tags,
        "oom_raised": raised,
        "oom_written": [p.name for p in cb2.written],
        "oom_reports": [p.name for p in cb2.reports],
        "oom_incident": meta.get("incident"),
        "files": files(folder),
        "checks": {
            "dumps_at_steps_3_6_and_end": whys[:2] == ["step3", "step6"] and len(cb.written) == 3,
            "report_written": report_ok(cb.reports[-1] if cb.reports else None),
            "tags_in_trace": DRY or tags.get("allocs_by_phase", {}).get("fwd", 0) > 0,
            "backward_tags_in_trace": DRY or tags.get("allocs_by_phase", {}).get("bwd", 0) > 0,
            "oom_raised": raised is not None and "OutOfMemory" in raised if not DRY else True,
            "oom_dumped_then_exception": DRY
            or [n.rsplit("_", 1)[-1] for n in map(str, (p.name for p in cb2.written))]
            == ["oom.pickle", "exception.pickle"],
            "oom_report": report_ok(cb2.reports[-1] if cb2.reports else None),
        },
    }


# --------------------------------------------------------------------------- 2. transformers


@part("transformers")
def transformers_part(folder: Path) -> dict[str, Any]:
    import torch
    import transformers

    from snapshot_lab.integrations.transformers import SnaplabCallback

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 8192, (96, 128), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    cb = SnaplabCallback(out=folder / "train", every_n_steps=3, report=True)
    args = transformers.TrainingArguments(
        output_dir=str(folder / "hf_out"),
        max_steps=7,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=DRY,
    )
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=Tokens(), callbacks=[cb])
    out = trainer.train()
    shutil.rmtree(folder / "hf_out", ignore_errors=True)
    final = cb.written[-1] if cb.written else None
    tags = snapshot_tags(final) if final else {}
    whys = [p.name.rsplit("_", 1)[-1].removesuffix(".pickle") for p in cb.written]
    log("   wrote", [p.name for p in cb.written], "reports", [p.name for p in cb.reports])
    return {
        "version": transformers.__version__,
        "global_step": out.global_step,
        "written": [p.name for p in cb.written],
        "reports": [p.name for p in cb.reports],
        "tags": tags,
        "files": files(folder),
        "checks": {
            "dumps_at_steps_3_6_and_end": whys[:2] == ["step3", "step6"] and len(cb.written) == 3,
            "report_written": report_ok(cb.reports[-1] if cb.reports else None),
            "tags_in_trace": DRY or tags.get("allocs_by_phase", {}).get("fwd", 0) > 0,
            "backward_tags_in_trace": DRY or tags.get("allocs_by_phase", {}).get("bwd", 0) > 0,
        },
    }


# --------------------------------------------------------------------------- 3. pytest plugin


@part("pytest")
def pytest_part(folder: Path) -> dict[str, Any]:
    tests = folder / "gpu_limit_tests.py"
    shutil.copy(HERE / "gpu_limit_tests.py", tests)
    (folder / "pytest.ini").write_text("[pytest]\n")
    import importlib.metadata

    # an installed snaplab loads the plugin by its entry point; from PYTHONPATH it needs -p
    installed = any(
        ep.value == "snapshot_lab.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11")
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *([] if installed else ["-p", "snapshot_lab.pytest_plugin"]),
        "-p",
        "no:cacheprovider",
        "-rA",
        "--snaplab-max-peak",
        "1GiB",
        "--snaplab-dir",
        "kept",
        "gpu_limit_tests.py",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if DRY:
        env["SNAPLAB_JOB_DRY_RUN"] = "1"
    r = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=240, env=env)
    out = r.stdout + r.stderr
    (folder / "pytest_output.txt").write_text(out)
    log("   " + "\n   ".join(out.strip().splitlines()[-40:]))
    kept = sorted((folder / "kept").glob("*")) if (folder / "kept").exists() else []
    html = [p for p in kept if p.suffix == ".html"]
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    return {
        "returncode": r.returncode,
        "summary": summary,
        "kept": [p.name for p in kept],
        "checks": {
            "one_failed_two_passed": ("1 failed, 2 passed" in summary) if not DRY else ("skipped" in summary),
            "message_names_the_site": DRY
            or ("gpu_limit_tests.py:" in out and "exceeds the limit of 256.00 MiB" in out),
            "snapshot_and_report_kept": DRY or (len(html) == 1 and report_ok(html[0]) and "Report:" in out),
        },
    }


# --------------------------------------------------------------------------- 4. overhead


def _train_step(model, opt, ids, autocast: bool) -> None:
    import torch

    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@part("overhead")
def overhead_part(folder: Path) -> dict[str, Any]:
    if DRY:
        model = gpt2(n_layer=2, n_embd=64, n_head=2, vocab=512, positions=64)
        return _overhead(folder, model, "tiny GPT-2", {"gpu_bound": (2, 64), "launch_bound": (1, 16)}, 3, 2, 1)
    model = gpt2(n_layer=12, n_embd=768, n_head=12, vocab=50257, positions=1024)  # GPT-2 small, 124M
    return _overhead(
        folder, model, "GPT-2 small from its config", {"gpu_bound": (8, 1024), "launch_bound": (1, 64)}, 15, 7, 5
    )


@part("overhead_medium")
def overhead_medium_part(folder: Path) -> dict[str, Any]:
    """The same measurement on a larger model (GPT-2 medium, 355M, 24 layers: twice the module
    calls) in a training shape, tagged and not only: how the cost scales with the step."""
    if DRY:
        model = gpt2(n_layer=2, n_embd=64, n_head=2, vocab=512, positions=64)
        return _overhead(folder, model, "tiny GPT-2", {"train": (2, 64)}, 3, 2, 1, recorded=False)
    model = gpt2(n_layer=24, n_embd=1024, n_head=16, vocab=50257, positions=1024)
    return _overhead(folder, model, "GPT-2 medium from its config", {"train": (8, 1024)}, 10, 5, 3, recorded=False)


def _overhead(
    folder: Path,
    model: Any,
    label: str,
    shapes: dict[str, tuple[int, int]],
    steps: int,
    repeats: int,
    warm: int,
    recorded: bool = True,
) -> dict[str, Any]:
    import torch

    from snapshot_lab.module_tags import tag_modules

    torch.manual_seed(0)
    model = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_params = sum(p.numel() for p in model.parameters())
    calls = {"n": 0}

    def counting(_: str) -> None:
        calls["n"] += 1

    modes: dict[str, Any] = {
        "untagged": lambda: contextlib.nullcontext(),
        "tagged": lambda: tag_modules(model),
        "tagged_forward_only": lambda: tag_modules(model, backward=False),
    }
    if recorded:
        modes["recorded"] = lambda: _recording(folder)
        modes["recorded_tagged"] = lambda: _Both(_recording(folder), lambda: tag_modules(model))
    out: dict[str, Any] = {"model": label, "parameters": n_params}
    for shape_name, (batch, seq) in shapes.items():
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=DEVICE)
        for _ in range(warm):
            _train_step(model, opt, ids, autocast=not DRY)
        with tag_modules(model, set_metadata=counting):
            calls["n"] = 0
            _train_step(model, opt, ids, autocast=not DRY)
        per_repeat: dict[str, list[float]] = {m: [] for m in modes}
        names = list(modes)
        for r in range(repeats):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no mode always first
            for m in order:
                with modes[m]():
                    _train_step(model, opt, ids, autocast=not DRY)  # settle after switching
                    times = []
                    for _ in range(steps):
                        if DEVICE == "cuda":
                            torch.cuda.synchronize()
                        t = time.perf_counter()
                        _train_step(model, opt, ids, autocast=not DRY)
                        if DEVICE == "cuda":
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t)
                per_repeat[m].append(statistics.median(times))
        med = {m: statistics.median(v) for m, v in per_repeat.items()}
        base = med["untagged"]
        pct = {
            "tagged": round(100 * (med["tagged"] - base) / base, 2),
            "tagged_forward_only": round(100 * (med["tagged_forward_only"] - base) / base, 2),
        }
        if recorded:
            rec = med["recorded"]
            pct["recording_python_stacks"] = round(100 * (rec - base) / base, 2)
            pct["tagging_on_top_of_recording"] = round(100 * (med["recorded_tagged"] - rec) / rec, 2)
        row = {
            "batch": batch,
            "seq": seq,
            "metadata_sets_per_step": calls["n"],
            "median_step_ms": {m: round(v * 1e3, 3) for m, v in med.items()},
            "repeat_medians_ms": {m: [round(x * 1e3, 3) for x in v] for m, v in per_repeat.items()},
            "overhead_pct": pct,
            "spread_pct_untagged": round(100 * (max(per_repeat["untagged"]) - min(per_repeat["untagged"])) / base, 2),
        }
        out[shape_name] = row
        log(f"   {shape_name} {batch}x{seq}: {row['median_step_ms']} overhead {row['overhead_pct']}")
    first = out[next(iter(shapes))]
    out["checks"] = {"measured": True, "tagging_within_5pct": DRY or first["overhead_pct"]["tagged"] <= 5.0}
    return out


def _recording(folder: Path):
    from snapshot_lab.capture import recording

    return recording(folder / "scratch", stacks="python", dump_on_exit=False, on_oom=False, tag_modules=False)


class _Both:
    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer, self.inner_make, self.inner = outer, inner, None

    def __enter__(self) -> None:
        self.outer.__enter__()
        self.inner = self.inner_make()

    def __exit__(self, *exc: Any) -> None:
        self.inner.remove()
        self.outer.__exit__(*exc)


# --------------------------------------------------------------------------- 5. the tagged sample


@part("tags")
def tags_part(folder: Path) -> dict[str, Any]:
    import torch

    from snapshot_lab.capture import recording
    from snapshot_lab.module_tags import tag_modules

    get_md = getattr(torch.cuda.memory, "_get_memory_metadata", None)

    peaks: dict[str, dict[str, int]] = {}

    def run(name: str, tagged: bool, process_wide: bool = False) -> tuple[Path | None, list[Any], Any]:
        torch.manual_seed(0)
        if not DRY:
            torch.cuda.reset_peak_memory_stats()
        peaks[name] = {"before": requested("current")}
        with recording(
            folder, stacks="python", max_entries=200_000, prefix=name, dump_on_exit=False, tag_modules=False
        ) as rec:
            model = gpt2(n_layer=4, n_embd=512, n_head=8, vocab=8192, positions=512).to(DEVICE)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            handle = tag_modules(None if process_wide else model) if tagged else None
            seen: list[Any] = []
            main = threading.get_ident()
            for step, seq in enumerate([256, 384, 320], 1):
                ids = torch.randint(0, 8192, (8, seq), device=DEVICE)
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=not DRY):
                    loss = model(input_ids=ids, labels=ids).loss
                if get_md is not None and not DRY:
                    # what autograd's thread has as metadata when this backward begins: '' from the
                    # second step on (reset when each backward ends)
                    loss.register_hook(lambda g, s=step: seen.append((s, get_md(), threading.get_ident() != main)))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec.step()
            describe = handle.describe() if handle is not None else None
            if handle is not None:
                handle.remove()
            path = rec.dump()
            peaks[name]["torch_requested_peak"] = requested("peak")
        return path, seen, describe

    tagged, seen, describe = run("gpt2_tagged", True)
    untagged, _, _ = run("gpt2_untagged", False)
    census = snapshot_tags(tagged) if tagged else {}
    plain = snapshot_tags(untagged) if untagged else {}
    process_path, _, process_describe = run("gpt2_process_wide", True, process_wide=True)
    process = snapshot_tags(process_path) if process_path else {}
    if process_path is not None:
        process_path.unlink()  # its census is enough; the file would only repeat the tagged one
        process_path.with_name(process_path.name.replace(".pickle", ".meta.json")).unlink(missing_ok=True)
    record_tags_in_sidecar(tagged, describe)  # the sidecar says what recording() will say
    log_census(census)
    log("   backward-start metadata on autograd's thread:", seen)
    log("   process-wide top tags:", process.get("top_tags_at_peak", [])[:5])
    phases = census.get("allocs_by_phase", {})
    return {
        "tagged": tagged.name if tagged else None,
        "untagged": untagged.name if untagged else None,
        "tagged_census": census,
        "untagged_census": plain,
        "process_wide_census": process,
        "process_wide_modules": len((process_describe or {}).get("modules", {})),
        "backward_start_metadata": seen,
        "backward_start_probe": get_md is not None,
        "torch_requested": peaks,
        "files": files(folder),
        "checks": {
            "every_alloc_has_user_metadata": DRY or census.get("allocs_with_user_metadata_key") == census.get("allocs"),
            "forward_and_backward_tags": DRY or (phases.get("fwd", 0) > 0 and phases.get("bwd", 0) > 0),
            "tags_add_up_at_peak": census.get("sum_of_tags_at_peak") == census.get("peak_live_bytes_in_trace"),
            "autograd_thread_clean_at_each_backward_start": DRY
            or get_md is None  # no probe in this torch: see backward_start_probe
            or (len(seen) == 3 and all(md == "" for s, md, _ in seen if s > 1) and all(t for *_, t in seen)),
            # the trace holds every allocation of the run (the model is built inside the recording,
            # on a device with nothing allocated): its peak is torch's own requested peak
            "trace_peak_is_torchs_peak": DRY
            or (
                peaks["gpt2_tagged"]["before"] == 0
                and census.get("peak_live_bytes_in_trace") == peaks["gpt2_tagged"]["torch_requested_peak"]
            ),
            "untagged_has_no_tags": DRY or set(plain.get("allocs_by_phase", {})) <= {"outside"},
            "process_wide_names_by_class": DRY
            or any(
                str(t).split(":", 1)[-1].startswith("GPT2LMHeadModel") for t, _ in process.get("top_tags_at_peak", [])
            ),
        },
    }


# --------------------------------------------------------------------------- 6. the hold-out tagged sample


def llama(layers: int = 4, hidden: int = 512, heads: int = 8, kv_heads: int = 4, vocab: int = 8192):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


@part("tags_holdout")
def tags_holdout_part(folder: Path) -> dict[str, Any]:
    """Another model family, stack mode and training recipe than ``tags``: a Llama (RMSNorm,
    SwiGLU, grouped-query attention) with activation checkpointing (non-reentrant: its recomputed
    forwards are tagged ``rec:``), recorded with ``stacks='all'`` (C++ frames too), tagged and,
    for the stack-based approximation, untagged."""
    import torch

    from snapshot_lab.capture import recording
    from snapshot_lab.module_tags import tag_modules

    out: dict[str, Any] = {"torch_requested": {}}

    def run(name: str, tagged: bool) -> Path | None:
        torch.manual_seed(0)
        if not DRY:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = requested("current")
        with recording(
            folder, stacks="all", max_entries=200_000, prefix=name, dump_on_exit=False, tag_modules=False
        ) as rec:
            model = llama().to(DEVICE)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            handle = tag_modules(model) if tagged else None
            for seq in (256, 384, 320):
                ids = torch.randint(0, 8192, (8, seq), device=DEVICE)
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=not DRY):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec.step()
            describe = handle.describe() if handle is not None else None
            if handle is not None:
                handle.remove()
            path = rec.dump()
            out["torch_requested"][name] = {"before": before, "torch_requested_peak": requested("peak")}
        record_tags_in_sidecar(path, describe)
        return path

    tagged = run("llama_ckpt_tagged", True)
    untagged = run("llama_ckpt_untagged", False)
    census = snapshot_tags(tagged) if tagged else {}
    phases = census.get("allocs_by_phase", {})
    log_census(census)
    out.update(
        tagged=tagged.name if tagged else None,
        untagged=untagged.name if untagged else None,
        tagged_census=census,
        files=files(folder),
        checks={
            "forward_backward_and_recomputed_tags": DRY or all(phases.get(p, 0) > 0 for p in ("fwd", "bwd", "rec")),
            "tags_add_up_at_peak": census.get("sum_of_tags_at_peak") == census.get("peak_live_bytes_in_trace"),
            "trace_peak_is_torchs_peak": DRY
            or census.get("peak_live_bytes_in_trace")
            == out["torch_requested"]["llama_ckpt_tagged"]["torch_requested_peak"]
            - out["torch_requested"]["llama_ckpt_tagged"]["before"],
        },
    )
    return out


@part("tags_cnn")
def tags_cnn_part(folder: Path) -> dict[str, Any]:
    """A third family for the by-module view: a CNN (torchvision ResNet-50: BatchNorm, in-place
    ReLU, residual adds), SGD with momentum, channels_last, bf16 autocast, tagged process-wide
    (``tag_modules(None)``: names start with the class, as under ``snaplab run``), and untagged."""
    import torch

    from snapshot_lab.capture import recording
    from snapshot_lab.module_tags import tag_modules

    def resnet50() -> Any:
        if DRY:  # no torchvision on the development machine: a stand-in of the same kind of layers
            nn = torch.nn
            return nn.Sequential(
                nn.Conv2d(3, 8, 3, stride=4), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 1000),
            )  # fmt: skip
        import torchvision

        return torchvision.models.resnet50(weights=None)

    out: dict[str, Any] = {"torch_requested": {}}

    def run(name: str, tagged: bool) -> Path | None:
        torch.manual_seed(0)
        if not DRY:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = requested("current")
        handle = tag_modules(None) if tagged else None
        with recording(
            folder, stacks="python", max_entries=200_000, prefix=name, dump_on_exit=False, tag_modules=False
        ) as rec:
            model = resnet50().to(DEVICE, memory_format=torch.channels_last)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            for batch in (16, 24, 16):
                x = torch.randn(batch, 3, 224, 224, device=DEVICE).to(memory_format=torch.channels_last)
                y = torch.randint(0, 1000, (batch,), device=DEVICE)
                with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=not DRY):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec.step()
            describe = handle.describe() if handle is not None else None
            path = rec.dump()
            out["torch_requested"][name] = {"before": before, "torch_requested_peak": requested("peak")}
        if handle is not None:
            handle.remove()
        record_tags_in_sidecar(path, describe)
        return path

    tagged = run("resnet_tagged", True)
    untagged = run("resnet_untagged", False)
    census = snapshot_tags(tagged) if tagged else {}
    plain = snapshot_tags(untagged) if untagged else {}
    phases = census.get("allocs_by_phase", {})
    log_census(census)
    out.update(
        tagged=tagged.name if tagged else None,
        untagged=untagged.name if untagged else None,
        tagged_census=census,
        untagged_census=plain,
        files=files(folder),
        checks={
            "forward_and_backward_tags": DRY or (phases.get("fwd", 0) > 0 and phases.get("bwd", 0) > 0),
            "tags_add_up_at_peak": census.get("sum_of_tags_at_peak") == census.get("peak_live_bytes_in_trace"),
            "trace_peak_is_torchs_peak": DRY
            or census.get("peak_live_bytes_in_trace")
            == out["torch_requested"]["resnet_tagged"]["torch_requested_peak"]
            - out["torch_requested"]["resnet_tagged"]["before"],
            "untagged_has_no_tags": DRY or set(plain.get("allocs_by_phase", {})) <= {"outside"},
        },
    )
    return out


# --------------------------------------------------------------------------- main


def dry_run_setup() -> None:
    """CPU stand-ins: the capture side (no CUDA here) and the allocator's metadata."""
    global DEVICE, DRY
    DRY, DEVICE = True, "cpu"
    sys.path.insert(0, str(ROOT))
    import snapshot_lab.capture as capture
    import snapshot_lab.module_tags as module_tags
    from tests.fake_torch import FakeTorch

    fake = FakeTorch()
    capture._torch = lambda: fake.module
    module_tags._metadata_setter = lambda torch: (lambda s: None, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    # tags first: its check against torch's peak counter wants a device with nothing allocated yet
    ap.add_argument("--parts", default="tags,lightning,transformers,pytest,overhead")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, capture stood in for: checks the script")
    args = ap.parse_args()
    if args.dry_run:
        dry_run_setup()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"snaplab_integrations_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    import torch

    RESULTS["environment"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu": platform.processor() or _cpu_name(),
        "set_memory_metadata": hasattr(torch.cuda.memory, "_set_memory_metadata"),
        "dry_run": DRY,
    }
    log("environment", RESULTS["environment"])
    parts = {
        "lightning": lightning_part,
        "transformers": transformers_part,
        "pytest": pytest_part,
        "overhead": overhead_part,
        "overhead_medium": overhead_medium_part,
        "tags": tags_part,
        "tags_holdout": tags_holdout_part,
        "tags_cnn": tags_cnn_part,
    }
    for name in args.parts.split(","):
        parts[name](work, args.out)
    write_results(args.out)
    log("summary:", {k: v.get("status") for k, v in RESULTS.items() if isinstance(v, dict) and "status" in v})
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    sys.exit(main())
