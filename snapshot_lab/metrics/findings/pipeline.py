"""Pipeline parallelism across files: one stage needs materially more memory than another.

A rule over several files (the ranks of one job): it reads the pipeline's stages from
:mod:`..pipeline` and raises ``pipeline-stage-imbalance`` when balancing the stages would take a
useful amount off the heaviest one. Every pipeline is somewhat skewed (1F1B keeps more
microbatches in flight on earlier stages; the last stage holds the output layer and the loss),
so the bar is what a user would act on: the heaviest stage's peak at least
``PP_MIN_GAIN_RATIO`` of it and ``PP_MIN_GAIN_BYTES`` above the stages' mean. On the
recordings in ``sample_snapshots/`` (2 stages, 8 microbatches) the transformer under GPipe is
8.2% (128 MiB) above, under 1F1B 3.4% (30 MiB); the MLP's stages 2.4% and 0.3%.
"""

from __future__ import annotations

from ...units import format_bytes, format_percent
from ..pipeline import PipelineSkew, microbatches_in_flight
from .base import Finding, FleetContext, MiB

PP_MIN_GAIN_RATIO = 0.05
PP_MIN_GAIN_BYTES = 64 * MiB
INFLIGHT_DOMINATES = 0.5  # share of the difference above which in-flight activations explain it
MAX_NAMED_SITES = 3


def _named_categories(skew: PipelineSkew) -> str:
    parts = [
        f"{c.replace('_', ' ')} +{format_bytes(d)}"
        for c, d in skew.by_category.items()
        if d > 0 and c != "inflight_activation"
    ]
    return ", ".join(parts[:4]) or "no category in particular"


def _named_sites(skew: PipelineSkew) -> str:
    return ", ".join(f"{d.site} (+{format_bytes(d.delta_bytes)})" for d in skew.by_site[:MAX_NAMED_SITES])


def onef1b_estimate(skew: PipelineSkew) -> dict[int, int]:  # stage -> bytes
    """Under GPipe, every stage holds all M microbatches in flight; 1F1B would hold at most
    S - s on stage s: each stage's in-flight activations at its peak scaled by that (the
    recordings of one job under both schedules agree within 15%)."""
    if skew.schedule is None or skew.schedule.lower() != "gpipe" or not skew.microbatches or not skew.num_stages:
        return {}
    out = {}
    for s in skew.stages:
        n = microbatches_in_flight("1F1B", s.stage, skew.num_stages, skew.microbatches)
        if n is not None and s.inflight_activation_bytes:
            out[s.stage] = round(s.inflight_activation_bytes * n / skew.microbatches)
    return out


def find(ctx: FleetContext) -> list[Finding]:
    skew = ctx.pipeline
    if skew is None:
        return []
    h, lo = skew.heaviest, skew.lightest
    gain = skew.balance_gain_bytes
    if gain < PP_MIN_GAIN_BYTES or gain < PP_MIN_GAIN_RATIO * h.peak_requested_bytes:
        return []
    spread = skew.spread_bytes
    inflight_d = skew.inflight_difference_bytes
    sched = skew.schedule
    sched_l = (sched or "").lower()
    m = skew.microbatches
    how = f"{sched or 'schedule unknown'}" + (f", {m} microbatches" if m else "")
    last = skew.num_stages - 1 if skew.num_stages else max(s.stage for s in skew.stages)
    in_flight = (
        f"{format_bytes(h.inflight_activation_bytes)} on stage {h.stage} at its peak, "
        f"{format_bytes(lo.inflight_activation_bytes)} on stage {lo.stage}"
    )
    advice: list[str] = []
    if inflight_d >= INFLIGHT_DOMINATES * spread:
        dominated_by = "inflight_activation"
        advice.append(f"Most of the difference is activations kept for microbatches in flight ({in_flight}).")
        if sched_l == "1f1b":
            advice.append(
                f"1F1B keeps up to S-s microbatches in flight on stage s ({h.microbatches_in_flight} on stage "
                f"{h.stage}, {lo.microbatches_in_flight} on stage {lo.stage}), so the first stages hold the most. "
                f"Move layers from stage {h.stage} to later stages, or use an interleaved schedule "
                "(ScheduleInterleaved1F1B, several virtual stages per rank), which gives every rank layers from "
                "early and late in the model and evens out what the ranks keep in flight; activation "
                f"checkpointing on stage {h.stage}'s layers trades recomputation for most of its in-flight "
                "activations, and with the global batch fixed, more and smaller microbatches make each one "
                "in flight smaller."
            )
        elif sched_l == "gpipe":
            advice.append(
                f"GPipe keeps all {m or 'M'} microbatches in flight on every stage, so stage {h.stage}'s layers "
                f"keep more activations per microbatch than stage {lo.stage}'s: move layers from stage {h.stage} "
                f"toward stage {lo.stage}."
            )
        else:
            advice.append(
                f"Move layers from stage {h.stage} toward stage {lo.stage}; under 1F1B-like schedules earlier "
                "stages keep more microbatches in flight, and an interleaved schedule (ScheduleInterleaved1F1B, "
                "virtual stages) evens that out."
            )
    else:
        positive = {c: d for c, d in skew.by_category.items() if d > 0 and c != "inflight_activation"}
        dominated_by = max(positive, key=lambda c: positive[c]) if positive else "other"
        why = f": GPipe keeps all {m or 'M'} microbatches in flight on every stage" if sched_l == "gpipe" else ""
        sites = _named_sites(skew)
        advice.append(
            f"The difference is not in-flight activations ({in_flight}{why}) but {_named_categories(skew)} at "
            f"the peak" + (f", largest at {sites}" if sites else "") + "."
        )
        if h.stage == last:
            advice.append(
                f"Stage {h.stage} is the last stage, which computes the loss and usually holds the output layer "
                f"and its logits: give it fewer layers, moving them toward stage {lo.stage}; balanced stages "
                f"would take up to {format_bytes(gain)} off its peak."
            )
        else:
            advice.append(
                f"Move layers from stage {h.stage} toward stage {lo.stage}: balanced stages would take up to "
                f"{format_bytes(gain)} off stage {h.stage}'s peak."
            )
    estimate = onef1b_estimate(skew)
    if estimate and h.stage in estimate:
        saved = h.inflight_activation_bytes - estimate[h.stage]
        advice.append(
            f"1F1B (Schedule1F1B) would keep at most S-s of the {m} microbatches in flight on stage s: about "
            f"{format_bytes(estimate[h.stage])} instead of "
            f"{format_bytes(h.inflight_activation_bytes)} on stage {h.stage}"
            + (
                f" and {format_bytes(estimate[lo.stage])} instead of {format_bytes(lo.inflight_activation_bytes)} "
                f"on stage {lo.stage}"
                if lo.stage in estimate
                else ""
            )
            + (", more than balancing the stages gives." if saved > gain else ".")
        )
    evidence = {
        **skew.to_dict(),
        "inflight_difference_bytes": inflight_d,
        "other_difference_bytes": spread - inflight_d,
        "dominated_by": dominated_by,
    }
    if estimate:
        evidence["inflight_under_1f1b_estimate"] = [{"stage": st, "bytes": b} for st, b in estimate.items()]
    return [
        Finding(
            id="pipeline-stage-imbalance",
            severity="warning",
            title=(
                f"Pipeline stage {h.stage} peaks {format_bytes(spread)} ({format_percent(skew.spread_ratio, 0)}) "
                f"above stage {lo.stage} ({format_bytes(h.peak_requested_bytes)} vs "
                f"{format_bytes(lo.peak_requested_bytes)} in use; {how})"
            ),
            advice=" ".join(advice),
            evidence=evidence,
            savings_bytes=gain,
        )
    ]
