"""docs/fit.md's tables of ``snaplab fit`` against the real runs, printed as Markdown.

For every family of ``sample_snapshots/fit_truth.json`` and each of its two recordings (a
complete step, an OOM in the first forward), the error of the predicted whole-step peak
allocated (against the process's whole peak, cuBLAS workspaces included) and reserved, lowest
to highest over the five measured batches, per lever; then the largest batch under the family's
cap, predicted / real (the range's top where the step's tensors alone fill the cap in brackets, for
the levers that rewrite the step)::

    python benchmarks/fit_accuracy.py > /tmp/fit_tables.md
    python benchmarks/fit_accuracy.py t5 effnet   # some families only
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snapshot_lab import api  # noqa: E402
from snapshot_lab.metrics.fit import compute_fit, predict_step  # noqa: E402
from snapshot_lab.metrics.fit.model import step_evidence  # noqa: E402

SAMPLES = ROOT / "sample_snapshots"
NOT_APPLICABLE = "n/a (half precision)"
LEVERS = {"plain": (False, False), "ckpt": (True, False), "bf16": (False, True), "ckpt+bf16": (True, True)}
OURS = {"plain": "as recorded", "ckpt": "checkpointing", "bf16": "bf16", "ckpt+bf16": "checkpointing+bf16"}
# family -> (label, complete snapshot, its batch, OOM snapshot, its batch, optimizer of the OOM's step)
RECORDINGS = {
    "gpt2": ("GPT-2", "fit_gpt2_b4_complete_python", 4, "fit_gpt2_b32_oom_python", 32, "adamw"),
    "resnet50": (
        "ResNet-50",
        "fit_resnet50_b16_complete_python",
        16,
        "fit_resnet50_b512_oom_python",
        512,
        "sgd-momentum",
    ),
    "vit": ("ViT-B/16", "fit_vit_b8_complete_python", 8, "fit_vit_b128_oom_python", 128, "adamw"),
    "llama": ("Llama", "fit_llama_b2_complete_python", 2, "fit_llama_b32_oom_python", 32, "adamw"),
    "convnext": ("ConvNeXt-Tiny", "fit_convnext_b16_complete_python", 16, "fit_convnext_b512_oom_python", 512, "adamw"),
    "bert": ("BERT-base MLM", "fit_bert_b2_complete_python", 2, "fit_bert_b32_oom_python", 32, "adamw"),
    "effnet": (
        "EfficientNet-B0",
        "fit_effnet_b16_complete_python",
        16,
        "fit_effnet_b256_oom_python",
        256,
        "sgd-momentum",
    ),
    "t5": ("T5 (6+6 layers)", "fit_t5_b4_complete_python", 4, "fit_t5_b64_oom_python", 64, "adamw"),
    "llamabf16": (
        "Llama, bf16 parameters",
        "fit_llamabf16_b2_complete_python",
        2,
        "fit_llamabf16_b64_oom_python",
        64,
        "adamw",
    ),
    "gpt2bf16": (
        "GPT-2, bf16 parameters",
        "fit_gpt2bf16_b4_complete_python",
        4,
        "fit_gpt2bf16_b64_oom_python",
        64,
        "adamw",
    ),
    "neox": ("GPT-NeoX", "fit_neox_b4_complete_python", 4, "fit_neox_b32_oom_python", 32, "adamw"),
    "opt": ("OPT", "fit_opt_b4_complete_python", 4, "fit_opt_b32_oom_python", 32, "adamw"),
    "gemma": ("Gemma", "fit_gemma_b4_complete_python", 4, "fit_gemma_b32_oom_python", 32, "adamw"),
    "qwen2": ("Qwen2", "fit_qwen2_b4_complete_python", 4, "fit_qwen2_b32_oom_python", 32, "adamw"),
    "phi": ("Phi", "fit_phi_b4_complete_python", 4, "fit_phi_b32_oom_python", 32, "adamw"),
    "distilbert": (
        "DistilBERT MLM",
        "fit_distilbert_b4_complete_python",
        4,
        "fit_distilbert_b64_oom_python",
        64,
        "adamw",
    ),
    "gpt2m": ("GPT-2, 24 layers, 8 GiB", "fit_gpt2m_b2_complete_python", 2, "fit_gpt2m_b32_oom_python", 32, "adamw"),
    "resnet18": (
        "ResNet-18",
        "fit_resnet18_b32_complete_python",
        32,
        "fit_resnet18_b512_oom_python",
        512,
        "sgd-momentum",
    ),
    "mistral": ("Mistral", "fit_mistral_b4_complete_python", 4, "fit_mistral_b32_oom_python", 32, "adamw"),
    "resnet34": (
        "ResNet-34",
        "fit_resnet34_b32_complete_python",
        32,
        "fit_resnet34_b512_oom_python",
        512,
        "sgd-momentum",
    ),
    "wrn50": (
        "Wide ResNet-50-2",
        "fit_wrn50_b16_complete_python",
        16,
        "fit_wrn50_b512_oom_python",
        512,
        "sgd-momentum",
    ),
    "resnet101": (
        "ResNet-101 (AdamW)",
        "fit_resnet101_b16_complete_python",
        16,
        "fit_resnet101_b512_oom_python",
        512,
        "adamw",
    ),
    "mobilenet": (
        "MobileNetV2",
        "fit_mobilenet_b32_complete_python",
        32,
        "fit_mobilenet_b1024_oom_python",
        1024,
        "sgd-momentum",
    ),
    "densenet": (
        "DenseNet-121",
        "fit_densenet_b16_complete_python",
        16,
        "fit_densenet_b512_oom_python",
        512,
        "sgd-momentum",
    ),
    "swin": ("Swin-T", "fit_swin_b16_complete_python", 16, "fit_swin_b512_oom_python", 512, "adamw"),
    "bloom": ("BLOOM", "fit_bloom_b2_complete_python", 2, "fit_bloom_b32_oom_python", 32, "adamw"),
    "gpt2eager": (
        "GPT-2, eager attention",
        "fit_gpt2eager_b4_complete_python",
        4,
        "fit_gpt2eager_b32_oom_python",
        32,
        "adamw",
    ),
    "llamaeager": (
        "Llama, eager attention",
        "fit_llamaeager_b2_complete_python",
        2,
        "fit_llamaeager_b32_oom_python",
        32,
        "adamw",
    ),
    "regnet": (
        "RegNetY-400MF",
        "fit_regnet_b32_complete_python",
        32,
        "fit_regnet_b1024_oom_python",
        1024,
        "sgd-momentum",
    ),
    "gpt2frozen": (
        "GPT-2, half frozen",
        "fit_gpt2frozen_b4_complete_python",
        4,
        "fit_gpt2frozen_b32_oom_python",
        32,
        "adamw",
    ),
    "resnet50ft": (
        "ResNet-50, layer3-4 trained",
        "fit_resnet50ft_b32_complete_python",
        32,
        "fit_resnet50ft_b512_oom_python",
        512,
        "sgd-momentum",
    ),
    "gpt2lora": ("GPT-2, LoRA", "fit_gpt2lora_b4_complete_python", 4, "fit_gpt2lora_b32_oom_python", 32, "adamw"),
    "vitft": ("ViT-B/16, half frozen", "fit_vitft_b8_complete_python", 8, "fit_vitft_b256_oom_python", 256, "adamw"),
    "llamalora": ("Llama, LoRA", "fit_llamalora_b2_complete_python", 2, "fit_llamalora_b32_oom_python", 32, "adamw"),
    "gpt2peft": ("GPT-2, PEFT LoRA", "fit_gpt2peft_b4_complete_python", 4, "fit_gpt2peft_b32_oom_python", 32, "adamw"),
    "llamapeft": (
        "Llama, PEFT LoRA",
        "fit_llamapeft_b2_complete_python",
        2,
        "fit_llamapeft_b32_oom_python",
        32,
        "adamw",
    ),
}


def _span(errors: list[float]) -> str:
    if not errors:
        return "—"
    lo, hi = min(errors), max(errors)
    return f"{lo:+.1%} to {hi:+.1%}".replace("-", "−")


def _row(frames, levers: dict, recorded: int, optimizer: str | None) -> tuple[list[str], list[str]]:
    allocated, reserved = [], []
    extra = {"optimizer": optimizer} if optimizer else {}
    for lever, (ckpt, bf16) in LEVERS.items():
        a_err, r_err = [], []
        if bf16 and step_evidence(frames, 0, optimizer).half_precision:  # no such lever: nothing to halve
            allocated.append(NOT_APPLICABLE)
            reserved.append(NOT_APPLICABLE)
            continue
        for batch, run in levers[lever]["uncapped"].items():
            if not run["ok"]:
                continue
            a, r = predict_step(frames, batch_scale=int(batch) / recorded, checkpointing=ckpt, bf16=bf16, **extra)
            a_err.append(a / run["peak_process_bytes"] - 1)
            r_err.append(r / run["peak_reserved_bytes"] - 1)
        allocated.append(_span(a_err))
        reserved.append(_span(r_err))
    return allocated, reserved


def main() -> None:
    truth = json.loads((SAMPLES / "fit_truth.json").read_text())
    header = "as recorded | checkpointing | bf16 | checkpointing + bf16 |"
    peaks = [f"| from | | {header}", "| --- | --- | --- | --- | --- | --- |"]
    largest = [f"| from | {header}", "| --- | --- | --- | --- | --- |"]
    tally = Tally()
    only = set(sys.argv[1:])  # families to print (all when none is named)
    for family, (label, complete, c_batch, oom, o_batch, optimizer) in RECORDINGS.items():
        if only and family not in only:
            continue
        levers = truth["families"][family]["levers"]
        cap = levers["plain"].get("cap_bytes", truth["cap_bytes"])  # another cap for some families
        for name, recorded, opt, kind in ((complete, c_batch, None, "complete"), (oom, o_batch, optimizer, "OOM")):
            frames = api.load_frames(SAMPLES / f"{name}.pickle.xz")
            title = f"{label}, batch {recorded}, {kind}"
            try:
                allocated, reserved = _row(frames, levers, recorded, opt)
                fit = compute_fit(frames, memory_limit=cap, recorded_batch=recorded, optimizer=opt)
            except ValueError as error:  # FitUnsupported
                peaks.append(f"| {title} | refused | {type(error).__name__} | | | |")
                largest.append(f"| {title} | refused | | | |")
                continue
            peaks.append(f"| {title} | allocated | " + " | ".join(allocated) + " |")
            peaks.append("| | reserved | " + " | ".join(reserved) + " |")
            cells = []
            for lever in LEVERS:
                got, real = fit.largest_batch.get(OURS[lever]), levers[lever]["largest_batch_under_cap"]
                if got is None:
                    cells.append(NOT_APPLICABLE)
                    continue
                sure = fit.largest_batch_no_retry.get(OURS[lever])
                most = fit.largest_batch_at_most.get(OURS[lever])
                tally.add(sure if sure is not None else got, got, real, most)
                cell = f"{got:g}" if sure in (None, got) else f"{sure:g}–{got:g}"
                cell += (f" [{most:g}]" if most is not None else "") + f" / {real}"
                cells.append(f"**{cell}**" if got == real else cell)
            largest.append(f"| {title} | " + " | ".join(cells) + " |")
    print("\n".join(peaks))
    print()
    print("\n".join(largest))
    print()
    print(tally)


class Tally:
    """How the largest batches compare with the real runs', over every answer printed."""

    def __init__(self) -> None:
        self.answers = self.exact = self.within_one = self.in_range = self.sure_runs = 0

    def add(self, sure: float, got: float, real: int, most: float | None = None) -> None:
        self.answers += 1
        self.exact += got == real
        self.within_one += got != real and abs(got - real) <= 1
        self.in_range += sure <= real <= (got if most is None else most)
        self.sure_runs += sure <= real

    def __str__(self) -> str:
        return (
            f"{self.answers} answers: {self.exact} exact, {self.within_one} more within one; the real run's largest "
            f"batch within the range in {self.in_range}, at or above the range's first batch in {self.sure_runs}"
        )


if __name__ == "__main__":
    main()
