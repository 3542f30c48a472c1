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
from ..parallel.pipeline import PipelineSkew, microbatches_in_flight
from .base import Finding, FleetContext, MiB

PP_MIN_GAIN_RATIO = 0.05
PP_MIN_GAIN_BYTES = 64 * MiB
# share of the difference above which in-flight activations explain it
INFLIGHT_DOMINATES = 0.5
MAX_NAMED_SITES = 3
MAX_NAMED_CATEGORIES = 4

# ---------------------------------------------------------------------- what the finding says
# (str.format templates; heavy/light: the heaviest and the lightest stage)

TITLE = (
    "Pipeline stage {heavy} peaks {spread} ({spread_percent}) above stage {light} ({heavy_peak} vs "
    "{light_peak} requested; {how})"
)
IN_FLIGHT = "{heavy_inflight} on stage {heavy} at its peak, {light_inflight} on stage {light}"
ADVICE_INFLIGHT = (
    # first, when in-flight activations explain most of the difference
    "Most of the difference is activations kept for microbatches in flight ({in_flight})."
)
ADVICE_INFLIGHT_1F1B = (
    "1F1B keeps up to S-s microbatches in flight on stage s ({heavy_microbatches} on stage "
    "{heavy}, {light_microbatches} on stage {light}), so the first stages hold the most. Move "
    "layers from stage {heavy} to later stages, or use an interleaved schedule "
    "(ScheduleInterleaved1F1B, several virtual stages per rank), which gives every rank layers "
    "from early and late in the model and evens out what the ranks keep in flight; activation "
    "checkpointing on stage {heavy}'s layers trades recomputation for most of its in-flight "
    "activations, and with the global batch fixed, more and smaller microbatches make each one in "
    "flight smaller."
)
ADVICE_INFLIGHT_GPIPE = (
    "GPipe keeps all {microbatches} microbatches in flight on every stage, so stage {heavy}'s "
    "layers keep more activations per microbatch than stage {light}'s: move layers from stage "
    "{heavy} toward stage {light}."
)
ADVICE_INFLIGHT_OTHER = (
    "Move layers from stage {heavy} toward stage {light}; under 1F1B-like schedules earlier stages "
    "keep more microbatches in flight, and an interleaved schedule (ScheduleInterleaved1F1B, "
    "virtual stages) evens that out."
)
SCHEDULE_FROM_TRACE = ", read from the order of the traces"
GPIPE_IN_FLIGHT = ": GPipe keeps all {microbatches} microbatches in flight on every stage"
ADVICE_NOT_INFLIGHT = (
    # first, when other categories explain most of the difference
    "The difference is not in-flight activations ({held}{why}) but {categories} at the peak{sites}."
)
LARGEST_AT = ", largest at {sites}"
ADVICE_LAST_STAGE = (
    "Stage {heavy} is the last stage, which computes the loss and usually holds the output layer "
    "and its logits: give it fewer layers, moving them toward stage {light}; balanced stages would "
    "take up to {gain} off its peak."
)
ADVICE_MOVE_LAYERS = (
    "Move layers from stage {heavy} toward stage {light}: balanced stages would take up to {gain} "
    "off stage {heavy}'s peak."
)
ADVICE_1F1B_ESTIMATE = (
    "1F1B (Schedule1F1B) would keep at most S-s of the {microbatches} microbatches in flight on "
    "stage s: about {heavy_estimate} instead of {heavy_inflight} on stage "
    "{heavy}{light_part}{comparison}"
)
ESTIMATE_LIGHT = " and {light_estimate} instead of {light_inflight} on stage {light}"
ESTIMATE_BEATS_BALANCING = ", more than balancing the stages gives."
NO_CATEGORY = "no category in particular"


def _named_categories(skew: PipelineSkew) -> str:
    parts = [
        f"{category.replace('_', ' ')} +{format_bytes(delta)}"
        for category, delta in skew.by_category.items()
        if delta > 0 and category != "inflight_activation"
    ]
    return ", ".join(parts[:MAX_NAMED_CATEGORIES]) or NO_CATEGORY


def _named_sites(skew: PipelineSkew) -> str:
    named = skew.by_site[:MAX_NAMED_SITES]
    return ", ".join(f"{delta.site} (+{format_bytes(delta.delta_bytes)})" for delta in named)


def onef1b_estimate(skew: PipelineSkew) -> dict[int, int]:  # stage -> bytes
    """Under GPipe, every stage holds all M microbatches in flight; 1F1B would hold at most
    S - s on stage s: each stage's in-flight activations at its peak scaled by that (the
    recordings of one job under both schedules agree within 15%)."""
    gpipe = skew.schedule is not None and skew.schedule.lower() == "gpipe"
    if not gpipe or not skew.microbatches or not skew.num_stages:
        return {}
    out = {}
    for profile in skew.stages:
        in_flight = microbatches_in_flight(
            "1F1B",
            profile.stage,
            skew.num_stages,
            skew.microbatches,
        )
        if in_flight is not None and profile.inflight_activation_bytes:
            estimate = profile.inflight_activation_bytes * in_flight / skew.microbatches
            out[profile.stage] = round(estimate)
    return out


def find(ctx: FleetContext) -> list[Finding]:
    """``pipeline-stage-imbalance`` when balancing the stages would take a useful amount off
    the heaviest one."""
    skew = ctx.pipeline
    if skew is None:
        return []
    heavy = skew.heaviest
    gain = skew.balance_gain_bytes
    if gain < PP_MIN_GAIN_BYTES or gain < PP_MIN_GAIN_RATIO * heavy.peak_requested_bytes:
        return []
    if skew.inflight_difference_bytes >= INFLIGHT_DOMINATES * skew.spread_bytes:
        dominated_by = "inflight_activation"
        advice = _inflight_advice(skew)
    else:
        dominated_by, advice = _other_advice(skew)
    estimate = onef1b_estimate(skew)
    if estimate and heavy.stage in estimate:
        advice.append(_estimate_advice(skew, estimate))
    return [
        Finding(
            id="pipeline-stage-imbalance",
            severity="warning",
            title=_title(skew),
            advice=" ".join(advice),
            evidence=_evidence(skew, dominated_by, estimate),
            savings_bytes=gain,
        )
    ]


def _stages(skew: PipelineSkew) -> dict[str, object]:
    """The heaviest and the lightest stage, for the templates."""
    return {"heavy": skew.heaviest.stage, "light": skew.lightest.stage}


def _in_flight(skew: PipelineSkew) -> str:
    heavy, light = skew.heaviest, skew.lightest
    return IN_FLIGHT.format(
        heavy_inflight=format_bytes(heavy.inflight_activation_bytes),
        light_inflight=format_bytes(light.inflight_activation_bytes),
        **_stages(skew),
    )


def _inflight_advice(skew: PipelineSkew) -> list[str]:
    """Most of the difference is activations kept for microbatches in flight: what the schedule
    does about it."""
    schedule = (skew.schedule or "").lower()
    advice = [ADVICE_INFLIGHT.format(in_flight=_in_flight(skew))]
    counted = None not in (skew.heaviest.microbatches_in_flight, skew.lightest.microbatches_in_flight)
    if schedule == "1f1b" and counted:
        advice.append(
            ADVICE_INFLIGHT_1F1B.format(
                heavy_microbatches=skew.heaviest.microbatches_in_flight,
                light_microbatches=skew.lightest.microbatches_in_flight,
                **_stages(skew),
            )
        )
    elif schedule == "gpipe":
        microbatches = skew.microbatches or "M"
        advice.append(ADVICE_INFLIGHT_GPIPE.format(microbatches=microbatches, **_stages(skew)))
    else:
        advice.append(ADVICE_INFLIGHT_OTHER.format(**_stages(skew)))
    return advice


def _other_advice(skew: PipelineSkew) -> tuple[str, list[str]]:
    """The difference is in other categories: which dominates, and what to move where."""
    positive = {
        category: delta
        for category, delta in skew.by_category.items()
        if delta > 0 and category != "inflight_activation"
    }
    dominated_by = max(positive, key=lambda category: positive[category]) if positive else "other"
    gpipe = (skew.schedule or "").lower() == "gpipe"
    why = GPIPE_IN_FLIGHT.format(microbatches=skew.microbatches or "M") if gpipe else ""
    sites = _named_sites(skew)
    advice = [
        ADVICE_NOT_INFLIGHT.format(
            held=_in_flight(skew),
            why=why,
            categories=_named_categories(skew),
            sites=LARGEST_AT.format(sites=sites) if sites else "",
        )
    ]
    last = skew.num_stages - 1 if skew.num_stages else max(stage.stage for stage in skew.stages)
    template = ADVICE_LAST_STAGE if skew.heaviest.stage == last else ADVICE_MOVE_LAYERS
    advice.append(template.format(gain=format_bytes(skew.balance_gain_bytes), **_stages(skew)))
    return dominated_by, advice


def _estimate_advice(skew: PipelineSkew, estimate: dict[int, int]) -> str:
    """What 1F1B would keep in flight instead of GPipe."""
    heavy, light = skew.heaviest, skew.lightest
    saved = heavy.inflight_activation_bytes - estimate[heavy.stage]
    light_part = ""
    if light.stage in estimate:
        light_part = ESTIMATE_LIGHT.format(
            light_estimate=format_bytes(estimate[light.stage]),
            light_inflight=format_bytes(light.inflight_activation_bytes),
            light=light.stage,
        )
    return ADVICE_1F1B_ESTIMATE.format(
        microbatches=skew.microbatches,
        heavy_estimate=format_bytes(estimate[heavy.stage]),
        heavy_inflight=format_bytes(heavy.inflight_activation_bytes),
        heavy=heavy.stage,
        light_part=light_part,
        comparison=ESTIMATE_BEATS_BALANCING if saved > skew.balance_gain_bytes else ".",
    )


def _title(skew: PipelineSkew) -> str:
    heavy, light = skew.heaviest, skew.lightest
    schedule, microbatches = skew.schedule, skew.microbatches
    count = f", {microbatches} microbatches" if microbatches else ""
    read = SCHEDULE_FROM_TRACE if skew.schedule_from_trace else ""
    how = f"{schedule or 'schedule unknown'}{read}{count}"
    return TITLE.format(
        spread=format_bytes(skew.spread_bytes),
        spread_percent=format_percent(skew.spread_ratio, 0),
        heavy_peak=format_bytes(heavy.peak_requested_bytes),
        light_peak=format_bytes(light.peak_requested_bytes),
        how=how,
        **_stages(skew),
    )


def _evidence(skew: PipelineSkew, dominated_by: str, estimate: dict[int, int]) -> dict[str, object]:
    inflight_difference = skew.inflight_difference_bytes
    evidence = {
        **skew.to_dict(),
        "inflight_difference_bytes": inflight_difference,
        "other_difference_bytes": skew.spread_bytes - inflight_difference,
        "dominated_by": dominated_by,
    }
    if estimate:
        evidence["inflight_under_1f1b_estimate"] = [
            {"stage": stage, "bytes": nbytes} for stage, nbytes in estimate.items()
        ]
    return evidence
