"""Allocator settings that would have avoided the OOM or lowered the peak (from the what-if
replay; see :mod:`snapshot_lab.metrics.allocator.whatif`).

Every number the replay gives is a replayed one: the peak of the recorded settings as the model
replays them is ``replayed_peak_reserved_bytes``, never "recorded". The claim compares the
alternative with the peak the recording really had (its timeline) as well as with the replay of
the recorded settings, and is made only when it holds against both: a replay that misses what
the allocator did by itself (a cache flush or garbage collection under a cap the snapshot does
not record) reaches a peak the recording never had, and a saving measured against it is not one.

A trace that starts mid-run (a ring buffer that wrapped) replays the alternatives from a steady
state, and the recorded settings from the same steady state too (the what-if's
``steady_baseline``); a lower peak is measured against that baseline, like for like, when it is
lower still: the recorded cache holds segments from before the trace that no steady state sees
(``twin_wrapped``: expandable segments save 0.34 GiB really, 0.41 GiB against the baseline of
1.65 GiB, 0.49 GiB against the recorded 1.74 GiB). Not when the recorded settings have
``max_split_size_mb``: the baseline is then a lower bound (the segments that earlier steps kept
at their own sizes are not seen), while the recorded cache is what the job really reserved; the
real runs break the simpler rule "always the baseline" (``gaptwin_split64_wrapped``: 3.03 GiB
saved really and against the recorded 5.09 GiB, 1.20 GiB against the baseline of 3.26;
``twin_split64_wrapped``: 1.97 really, 2.14 and 0.75; ``gaptwin_split128_wrapped``: 3.12 really,
3.12 and 0.99). A setting that avoids an OOM is still compared with the recorded peak.
"""

from __future__ import annotations

from ...frames import SnapshotFrames
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
from .iteration import over_the_limit, whole_iteration

SET_IT = "Set PYTORCH_CUDA_ALLOC_CONF={label} in the job's environment (before its first CUDA allocation). "
# a setting that serves the failing request of a job whose whole iteration outgrows the limit
NOT_THE_FIX = (
    "PYTORCH_CUDA_ALLOC_CONF={label} alone does not make the job fit: the out-of-memory finding and `snaplab fit` "
    "say what does. "
)
REPLAYED = (
    "Predicted by replaying this trace through snaplab's model of the caching allocator; the replay of the "
    "recorded settings reproduced the snapshot {how}. `snaplab whatif` compares more settings."
)
# what the one-line claim assumes, said before the advice (the title stays one readable line)
OOM_CAP_ASSUMPTION = (
    "This assumes a per-process cap of {cap}: the snapshot does not record the cap, and the trace bounds it (its "
    "peak reserved from below, its failing request from above). "
)
OOM_ONLY = "The trace ends at the OOM, so later steps are not predicted. "
STEADY_BASELINE = (
    ", the recorded settings replayed from the same steady state as it (the trace starts mid-run; the recorded "
    "peak was {recorded})"
)
NOT_THE_JOB = (
    ", but not the job: one whole iteration at this batch holds about {whole} at once, more than the {cap} limit"
)
NOT_THE_JOB_WHY = (
    "The whole iteration is snaplab fit's model of it at the recorded batch: with this setting the error would "
    "only come later. "
)
FLUSH_CAP_ASSUMPTION = (
    "This assumes a memory limit of {cap}: the snapshot does not record it, and the allocator's cache flushes in "
    "the trace bound it. "
)


def _assumption(whatif: WhatIf) -> str:
    """The memory limit the claim assumes, where the snapshot does not record it ("": none)."""
    if not whatif.memory_limit_inferred or whatif.memory_limit_bytes is None:
        return ""
    text = FLUSH_CAP_ASSUMPTION if whatif.memory_limit_source.startswith("inferred from the") else OOM_CAP_ASSUMPTION
    return text.format(cap=format_bytes(whatif.memory_limit_bytes))


def _worth_it(baseline: int, predicted: int) -> bool:
    saved = baseline - predicted
    return saved >= MIN_SAVING_BYTES and saved >= MIN_SAVING_SHARE * baseline


def _steady_baseline(whatif: WhatIf) -> int | None:
    """The recorded settings' peak from the same steady state as the alternatives, where the
    saving is measured against it (module docstring): a trace that starts mid-run, recorded
    without max_split_size_mb."""
    if whatif.steady_baseline is None or not whatif.scenarios or whatif.scenarios[0].settings.get("max_split_size_mb"):
        return None
    return whatif.steady_baseline.peak_reserved_bytes


def _not_the_job(whatif: WhatIf, whole: int) -> str:
    return NOT_THE_JOB.format(whole=format_bytes(whole), cap=format_bytes(whatif.memory_limit_bytes or 0))


def _title(
    whatif: WhatIf, best: ScenarioResult, why: str, recorded_peak: int, steady: int | None = None, whole: int = 0
) -> str:
    """The finding's one line; ``whole``: what one whole iteration holds at once, when it is more
    than the limit (0: not known to be)."""
    label = settings_label(best.settings)
    if why == "avoids the OOM":
        return (
            f"{label} would have served the allocation that failed: predicted peak reserved "
            f"{format_bytes(best.peak_reserved_bytes)} up to that point"
            + (f" instead of {format_bytes(recorded_peak)}" if recorded_peak > best.peak_reserved_bytes else "")
            + (_not_the_job(whatif, whole) if whole else "")
        )
    if steady is not None:
        return (
            f"{label} would lower the peak reserved memory to {format_bytes(best.peak_reserved_bytes)} instead of "
            f"{format_bytes(steady)}{STEADY_BASELINE.format(recorded=format_bytes(recorded_peak))}"
        )
    return (
        f"{label} would lower the peak reserved memory to {format_bytes(best.peak_reserved_bytes)} instead of "
        f"{format_bytes(recorded_peak)}"
    )


def _caveats(whatif: WhatIf, why: str, not_the_job: bool) -> str:
    """What the title's claim rests on, before the advice: the limit assumed, and for an OOM that
    the trace ends there (and what the whole iteration is)."""
    text = _assumption(whatif)
    if why == "avoids the OOM":
        text += OOM_ONLY + (NOT_THE_JOB_WHY if not_the_job else "")
    return text


def _finding(whatif: WhatIf, recorded_peak: int | None, frames: SnapshotFrames) -> Finding | None:
    """A setting that serves the failing request of a job whose whole iteration outgrows the limit
    (:mod:`.iteration`, from ``frames``) is told as information, not as the fix."""
    found = best_alternative(whatif)
    if found is None:
        return None
    best, why = found
    whole = whole_iteration(frames, whatif.device, whatif) if why == "avoids the OOM" else None
    not_the_job = over_the_limit(whatif, whole)
    replayed = whatif.scenarios[0].peak_reserved_bytes
    recorded = replayed if recorded_peak is None else recorded_peak
    baseline = min(replayed, recorded)
    steady = _steady_baseline(whatif) if why != "avoids the OOM" else None
    if steady is not None and steady < baseline:
        baseline = steady  # like for like: both from the same steady state
    else:
        steady = None
    if why != "avoids the OOM" and not _worth_it(baseline, best.peak_reserved_bytes):
        # the replay's saving is against a peak the recording never had
        return None
    label = settings_label(best.settings)
    saved = baseline - best.peak_reserved_bytes
    evidence = {
        "settings": label,
        "predicted_peak_reserved_bytes": best.peak_reserved_bytes,
        "replayed_peak_reserved_bytes": replayed,
        "recorded_peak_reserved_bytes": recorded_peak,
        "memory_limit_bytes": whatif.memory_limit_bytes,
        "memory_limit_inferred": whatif.memory_limit_inferred,
        "replay_check": "exact" if whatif.replay_check.exact else "approximate",
    }
    if not_the_job:
        evidence["whole_step_peak_allocated_bytes"] = whole
    if whatif.steady_baseline is not None:  # a trace that starts mid-run
        evidence["steady_baseline_peak_reserved_bytes"] = whatif.steady_baseline.peak_reserved_bytes
        evidence["saving_measured_against"] = "steady baseline" if steady is not None else "recorded peak"
    return Finding(
        id="allocator-settings",
        severity="warning" if why == "avoids the OOM" and not not_the_job else "info",
        title=_title(whatif, best, why, recorded, steady, (whole or 0) if not_the_job else 0),
        advice=_caveats(whatif, why, not_the_job)
        + (NOT_THE_FIX if not_the_job else SET_IT).format(label=label)
        + REPLAYED.format(how="exactly" if whatif.replay_check.exact else "approximately"),
        evidence=evidence,
        savings_bytes=max(saved, 0) or None,
        device=whatif.device,
    )


def find(ctx: FindingContext) -> list[Finding]:
    out = []
    for dev, whatif in ctx.whatifs.items():
        timeline = ctx.timelines.get(dev)
        finding = _finding(whatif, timeline.peak_reserved_bytes if timeline is not None else None, ctx.frames)
        if finding is not None:
            out.append(finding)
    return out
