"""Turn the output of ``integrations_gpu.py`` into samples: ``<name>.pickle.xz`` + ``<name>.meta.json``
+ ``<name>.truth.json`` in ``sample_snapshots/``.

    python sample_snapshots/jobs/import_integrations.py RESULTS_DIR [RESULTS_DIR...]

Each RESULTS_DIR is a folder where the job's ``<part>.tar.xz`` files were unpacked, with its
``results.json``. The truth is the capture sidecar's own ``memory_stats`` (taken by
``snapshot_lab.capture`` right before the dump) plus what the job knows about the workload;
sidecar pointers to other files of the same incident (``incident.same_as``) are renamed too.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

SAMPLES = Path(__file__).resolve().parents[1]

# (part folder, the original file name without its date, sample name, workload)
PLAN: list[tuple[str, str, str, dict[str, Any]]] = [
    (
        "tags",
        "gpt2_tagged_",
        "modtags_gpt2_python",
        {
            "kind": "module-tags",
            "model": "GPT-2 (4 layers, 512 wide, vocab 8192) from its config, AdamW, bf16 autocast",
            "steps": "3 training steps, 8 x 256/384/320 tokens",
            "stacks": "python",
            "tagged": "tag_modules(model): forward and backward",
            "built_inside_the_recording": True,
            "job": "sample_snapshots/jobs/integrations_gpu.py (tags)",
        },
    ),
    (
        "tags",
        "gpt2_untagged_",
        "modtags_gpt2_python_untagged",
        {
            "kind": "module-tags",
            "model": "the same GPT-2 run as modtags_gpt2_python, not tagged",
            "stacks": "python",
            "tagged": False,
            "built_inside_the_recording": True,
            "job": "sample_snapshots/jobs/integrations_gpu.py (tags)",
        },
    ),
    (
        "tags_holdout",
        "llama_ckpt_tagged_",
        "modtags_llama_ckpt_all",
        {
            "kind": "module-tags",
            "model": "Llama (4 layers, 512 wide, GQA 8/4 heads, vocab 8192) from its config, "
            "activation checkpointing (non-reentrant), AdamW, bf16 autocast",
            "steps": "3 training steps, 8 x 256/384/320 tokens",
            "stacks": "all",
            "tagged": "tag_modules(model): forward, backward and recomputed forwards",
            "built_inside_the_recording": True,
            "job": "sample_snapshots/jobs/integrations_gpu.py (tags_holdout)",
        },
    ),
    (
        "tags_holdout",
        "llama_ckpt_untagged_",
        "modtags_llama_ckpt_all_untagged",
        {
            "kind": "module-tags",
            "model": "the same Llama run as modtags_llama_ckpt_all, not tagged",
            "stacks": "all",
            "tagged": False,
            "built_inside_the_recording": True,
            "job": "sample_snapshots/jobs/integrations_gpu.py (tags_holdout)",
        },
    ),
    (
        "tags_cnn",
        "resnet_tagged_",
        "modtags_resnet50_process",
        {
            "kind": "module-tags",
            "model": "torchvision ResNet-50 (channels_last), SGD with momentum, bf16 autocast",
            "steps": "3 training steps, batches of 16/24/16 images of 224 x 224",
            "stacks": "python",
            "tagged": "tag_modules(None): every module of the process, named after its class",
            "built_inside_the_recording": True,
            "job": "sample_snapshots/jobs/integrations_gpu.py (tags_cnn)",
        },
    ),
    (
        "tags_cnn",
        "resnet_untagged_",
        "modtags_resnet50_process_untagged",
        {
            "kind": "module-tags",
            "model": "the same ResNet-50 run as modtags_resnet50_process, not tagged",
            "stacks": "python",
            "tagged": False,
            "built_inside_the_recording": True,
            "job": "sample_snapshots/jobs/integrations_gpu.py (tags_cnn)",
        },
    ),
]
LIGHTNING = {
    "kind": "integration",
    "integration": "snapshot_lab.integrations.lightning.SnaplabCallback(every_n_steps=3, report=True)",
    "model": "GPT-2 (2 layers, 256 wide) LightningModule, lightning.pytorch Trainer",
    "job": "sample_snapshots/jobs/integrations_gpu.py (lightning)",
}
TRANSFORMERS = {
    "kind": "integration",
    "integration": "snapshot_lab.integrations.transformers.SnaplabCallback(every_n_steps=3, report=True)",
    "model": "GPT-2 (2 layers, 256 wide) from its config, transformers Trainer, in-memory dataset",
    "job": "sample_snapshots/jobs/integrations_gpu.py (transformers)",
}
PYTEST = {
    "kind": "integration",
    "integration": "pytest -p snapshot_lab.pytest_plugin, @pytest.mark.limit_cuda_memory('256 MiB')",
    "test": "sample_snapshots/jobs/gpu_limit_tests.py::test_over_its_limit (fails: peak 416 MiB)",
    "job": "sample_snapshots/jobs/integrations_gpu.py (pytest)",
}


def _find(folder: Path, start: str, end: str = ".pickle.xz") -> Path:
    hits = sorted(p for p in folder.rglob(f"{start}*{end}"))
    if len(hits) != 1:
        raise SystemExit(f"expected one {start}*{end} under {folder}, found {[h.name for h in hits]}")
    return hits[0]


def _sidecar(pickle_xz: Path) -> Path:
    return pickle_xz.with_name(pickle_xz.name[: -len(".pickle.xz")] + ".meta.json")


def import_one(src: Path, name: str, workload: dict[str, Any], renames: dict[str, str]) -> None:
    meta = json.loads(_sidecar(src).read_text())
    incident = meta.get("incident")
    if isinstance(incident, dict) and incident.get("same_as"):
        incident["same_as"] = renames.get(incident["same_as"], incident["same_as"])
    shutil.copyfile(src, SAMPLES / f"{name}.pickle.xz")
    (SAMPLES / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    truth = {
        "name": name,
        "torch_version": meta.get("torch_version"),
        "alloc_conf": meta.get("alloc_conf", ""),
        "device_total_bytes": meta.get("device_total_bytes"),
        "memory_stats": meta["memory_stats"],
        "workload": {
            **workload,
            "captured_by": "snapshot_lab.capture",
            "reason": meta.get("reason"),
            "step": meta.get("step"),
            "truth_from": "the capture sidecar's memory_stats, taken right before the dump",
        },
    }
    (SAMPLES / f"{name}.truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True) + "\n")
    print(f"{name}: {src.name}")


def main(dirs: list[Path]) -> int:
    for d in dirs:
        results = json.loads((d / "results.json").read_text()) if (d / "results.json").exists() else {}
        for part, start, name, workload in PLAN:
            if (d / part).is_dir():
                extra = {}
                census = results.get(part, {}).get("tagged_census" if "untagged" not in name else "untagged_census")
                if census and workload.get("tagged"):
                    extra = {
                        "peak_live_bytes_in_trace": census["peak_live_bytes_in_trace"],
                        "outside_any_module_at_peak": census["outside_any_module_at_peak"],
                        "live_bytes_per_tag_at_peak": dict(census["top_tags_at_peak"]),
                    }
                import_one(_find(d / part, start), name, {**workload, **extra}, {})
        if (d / "lightning").is_dir():
            fit, oom = d / "lightning" / "fit", d / "lightning" / "oom"
            for suffix, name in (("_step3", "lightning_fit_step3"), ("_step6", "lightning_fit_step6")):
                import_one(_find(fit, "snapshot_rank0", f"{suffix}.pickle.xz"), name, LIGHTNING, {})
            end = [p for p in fit.glob("*.pickle.xz") if "_step" not in p.name]
            import_one(end[0], "lightning_fit_end", {**LIGHTNING, "report_written_by_the_callback": True}, {})
            oom_file = _find(oom, "snapshot_rank0", "_oom.pickle.xz")
            renames = {oom_file.name[: -len(".xz")]: "lightning_oom_oom.pickle.xz"}
            oom_meta = json.loads(_sidecar(oom_file).read_text()).get("oom", {})
            crash = {
                **LIGHTNING,
                "oom": "a 1.5 TiB request at the third batch",
                "oom_observed": True,
                "requested_bytes": oom_meta.get("alloc_bytes"),
                "expect": {"oom": "capacity"},
            }
            import_one(
                oom_file,
                "lightning_oom_oom",
                {
                    **crash,
                    "dumped": "from the OOM observer, at the failing request",
                    "same_incident_as": None,
                },
                renames,
            )
            import_one(
                _find(oom, "snapshot_rank0", "_exception.pickle.xz"),
                "lightning_oom_exception",
                {
                    **crash,
                    "dumped": "from on_exception, after the error unwound",
                    "same_incident_as": "lightning_oom_oom",
                },
                renames,
            )
        if (d / "transformers").is_dir():
            train = d / "transformers" / "train"
            for suffix, name in (("_step3", "hf_trainer_step3"), ("_step6", "hf_trainer_step6")):
                import_one(_find(train, "snapshot_rank0", f"{suffix}.pickle.xz"), name, TRANSFORMERS, {})
            end = [p for p in train.glob("*.pickle.xz") if "_step" not in p.name]
            import_one(end[0], "hf_trainer_end", {**TRANSFORMERS, "report_written_by_the_callback": True}, {})
        if (d / "pytest").is_dir():
            import_one(_find(d / "pytest" / "kept", "gpu_limit_tests"), "pytest_over_limit_peak", PYTEST, {})
    return 0


if __name__ == "__main__":
    sys.exit(main([Path(a) for a in sys.argv[1:]] or [Path(".")]))
