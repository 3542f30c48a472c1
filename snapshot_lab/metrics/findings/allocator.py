"""Allocator settings that would have avoided the OOM or lowered the peak (from the what-if
replay; see :mod:`snapshot_lab.metrics.allocator.whatif`).

Every number the replay gives is a replayed one: the peak of the recorded settings as the model
replays them is ``replayed_peak_reserved_bytes``, never "recorded". The claim compares the
alternative with the peak the recording really had (its timeline) as well as with the replay of
the recorded settings, and is made only when it holds against both: a replay that misses what
the allocator did by itself (a cache flush or garbage collection under a cap the snapshot does
not record) reaches a peak the recording never had, and a saving measured against it is not one.
"""

from __future__ import annotations

from ...units import format_bytes
from ..allocator.whatif import (
    MIN_SAVING_BYTES,
    MIN_SAVING_SHARE,
    ScenarioResult,
    WhatIf,
    best_alternative,
    settings_label,
)
from .base import Finding, FindingContext

ADVICE = (
    "Set PYTORCH_CUDA_ALLOC_CONF={label} in the job's environment (before its first CUDA allocation). "
    "Predicted by replaying this trace through snaplab's model of the caching allocator; the replay of the "
    "recorded settings reproduced the snapshot {how}. `snaplab whatif` compares more settings."
)
OOM_CAP_ASSUMPTION = (
    " assuming a per-process cap of {cap} (the snapshot does not record the cap; this is the peak reserved "
    "before the OOM, the smallest cap consistent with the recording)"
)
FLUSH_CAP_ASSUMPTION = (
    " assuming a memory limit of {cap} (the snapshot does not record it; the allocator's cache flushes in the "
    "trace bound it)"
)


def _assumption(w: WhatIf) -> str:
    if not w.memory_limit_inferred or w.memory_limit_bytes is None:
        return ""
    text = FLUSH_CAP_ASSUMPTION if w.memory_limit_source.startswith("inferred from the") else OOM_CAP_ASSUMPTION
    return text.format(cap=format_bytes(w.memory_limit_bytes))


def _worth_it(baseline: int, predicted: int) -> bool:
    saved = baseline - predicted
    return saved >= MIN_SAVING_BYTES and saved >= MIN_SAVING_SHARE * baseline


def _title(w: WhatIf, best: ScenarioResult, why: str, recorded_peak: int) -> str:
    label = settings_label(best.settings)
    if why == "avoids the OOM":
        return (
            f"{label} would have served the allocation that failed{_assumption(w)}: predicted peak reserved "
            f"{format_bytes(best.peak_reserved_bytes)} up to that point"
            + (f" instead of {format_bytes(recorded_peak)}" if recorded_peak > best.peak_reserved_bytes else "")
            + " (the trace ends at the OOM, so later steps are not predicted)"
        )
    return (
        f"{label} would lower the peak reserved memory to {format_bytes(best.peak_reserved_bytes)} instead of "
        f"{format_bytes(recorded_peak)}{_assumption(w)}"
    )


def _finding(w: WhatIf, recorded_peak: int | None) -> Finding | None:
    found = best_alternative(w)
    if found is None:
        return None
    best, why = found
    replayed = w.scenarios[0].peak_reserved_bytes
    recorded = replayed if recorded_peak is None else recorded_peak
    if why != "avoids the OOM" and not _worth_it(min(replayed, recorded), best.peak_reserved_bytes):
        return None  # the replay's saving is against a peak the recording never had
    label = settings_label(best.settings)
    saved = min(replayed, recorded) - best.peak_reserved_bytes
    return Finding(
        id="allocator-settings",
        severity="warning" if why == "avoids the OOM" else "info",
        title=_title(w, best, why, recorded),
        advice=ADVICE.format(label=label, how="exactly" if w.replay_check.exact else "approximately"),
        evidence={
            "settings": label,
            "predicted_peak_reserved_bytes": best.peak_reserved_bytes,
            "replayed_peak_reserved_bytes": replayed,
            "recorded_peak_reserved_bytes": recorded_peak,
            "memory_limit_bytes": w.memory_limit_bytes,
            "memory_limit_inferred": w.memory_limit_inferred,
            "replay_check": "exact" if w.replay_check.exact else "approximate",
        },
        savings_bytes=max(saved, 0) or None,
        device=w.device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    out = []
    for dev, w in ctx.whatifs.items():
        timeline = ctx.timelines.get(dev)
        finding = _finding(w, timeline.peak_reserved_bytes if timeline is not None else None)
        if finding is not None:
            out.append(finding)
    return out
