"""How the stages of a pipeline differ: each stage's peak, what it holds then (in-flight
activations above all), and what makes the heaviest stage heavier than the lightest.

Works on the small per-file summaries ``ranks`` and ``findings`` collect. A stage is all the
files of one pipeline stage (its data-parallel replicas, FSDP shards, tensor-parallel peers);
the file whose peak is the stage's (lower) median stands for it, so one odd replica (flagged by
``ranks`` against its peers) does not make its stage look heavy.

A schedule decides how many microbatches a stage keeps in flight (forward done, backward not yet):
GPipe runs every forward before any backward, so every stage holds all ``M``; 1F1B starts
backwards as soon as the last stage can, so stage ``s`` of ``S`` holds at most ``S - s``. Other
schedules (interleaved, zero-bubble) are not modelled here.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .parallelism import ParallelLayout, pipeline_stages

if TYPE_CHECKING:
    from ..comparison.snapshot_summary import SnapshotSummary

# sites alive at the peak kept in a summary, largest first
PEAK_SITES_LIMIT = 50
MAX_SITE_DELTAS = 5


@dataclass(frozen=True)
class StageProfile:
    stage: int
    files: list[str]  # every file of the stage
    # the file whose numbers stand for the stage (its peak is the stage's lower median)
    path: str
    peak_requested_bytes: int
    inflight_activation_bytes: int  # at that peak
    peak_categories: dict[str, int]  # requested bytes per category at that peak
    # what the schedule keeps in flight on this stage, when modelled
    microbatches_in_flight: int | None


@dataclass(frozen=True)
class SiteDelta:
    site: str
    heaviest_bytes: int
    lightest_bytes: int

    @property
    def delta_bytes(self) -> int:
        return self.heaviest_bytes - self.lightest_bytes


@dataclass(frozen=True)
class PipelineSkew:
    """The stages side by side (``stages`` by stage number) and the heaviest against the lightest."""

    stages: list[StageProfile]
    # from the sidecars; None when only file names tell the stages
    num_stages: int | None
    schedule: str | None
    microbatches: int | None
    heaviest: StageProfile
    lightest: StageProfile
    # heaviest - lightest at their peaks, nonzero, largest change first
    by_category: dict[str, int]
    # the sites that make the heaviest stage heavier, most first
    by_site: list[SiteDelta]
    # the schedule was read from the order of the traces (no sidecar said it: .schedule)
    schedule_from_trace: bool = False

    @property
    def spread_bytes(self) -> int:
        return self.heaviest.peak_requested_bytes - self.lightest.peak_requested_bytes

    @property
    def spread_ratio(self) -> float:
        return self.spread_bytes / self.heaviest.peak_requested_bytes if self.heaviest.peak_requested_bytes else 0.0

    @property
    def balance_gain_bytes(self) -> int:
        """How far the heaviest stage's peak is above the stages' mean: what perfectly balanced
        stages would take off it, at most."""
        mean = statistics.fmean(stage.peak_requested_bytes for stage in self.stages)
        return max(0, round(self.heaviest.peak_requested_bytes - mean))

    @property
    def inflight_difference_bytes(self) -> int:
        return self.heaviest.inflight_activation_bytes - self.lightest.inflight_activation_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_stages": self.num_stages,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            **({"schedule_from_trace": True} if self.schedule_from_trace else {}),
            "stages": [asdict(stage) for stage in self.stages],
            "heaviest_stage": self.heaviest.stage,
            "lightest_stage": self.lightest.stage,
            "spread_bytes": self.spread_bytes,
            "spread_ratio": round(self.spread_ratio, 4),
            "balance_gain_bytes": self.balance_gain_bytes,
            "difference_by_category": self.by_category,
            "sites_behind_difference": [{**asdict(delta), "delta_bytes": delta.delta_bytes} for delta in self.by_site],
        }


def microbatches_in_flight(
    schedule: str | None, stage: int, num_stages: int | None, microbatches: int | None
) -> int | None:
    """How many microbatches ``schedule`` keeps in flight on ``stage`` at most (None when the
    schedule is not one modelled here, or a number is missing)."""
    if schedule is None or microbatches is None:
        return None
    name = schedule.lower()
    if name == "gpipe":
        return microbatches
    if name == "1f1b" and num_stages is not None and 0 <= stage < num_stages:
        return min(microbatches, num_stages - stage)
    return None


def _common(values: list[Any]) -> Any:
    """The value every file agrees on (None when they disagree or none says)."""
    known = {value for value in values if value is not None}
    return known.pop() if len(known) == 1 else None


def _site_bytes(summary: SnapshotSummary) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in summary.peak_sites:
        out[row["site"]] = out.get(row["site"], 0) + int(row["bytes"])
    return out


def _site_deltas(heavy: SnapshotSummary, light: SnapshotSummary) -> list[SiteDelta]:
    heavy_bytes, light_bytes = _site_bytes(heavy), _site_bytes(light)
    # a summary keeps only its largest sites: one missing from a full list is of unknown size
    heavy_full, light_full = len(heavy.peak_sites) < PEAK_SITES_LIMIT, len(light.peak_sites) < PEAK_SITES_LIMIT
    out = []
    for site in set(heavy_bytes) | set(light_bytes):
        if (site not in heavy_bytes and not heavy_full) or (site not in light_bytes and not light_full):
            continue
        delta = SiteDelta(site, heavy_bytes.get(site, 0), light_bytes.get(site, 0))
        if delta.delta_bytes > 0:
            out.append(delta)
    out.sort(key=lambda delta: (-delta.delta_bytes, delta.site))
    return out[:MAX_SITE_DELTAS]


def pipeline_skew(
    summaries: Mapping[str, SnapshotSummary], layouts: Mapping[str, ParallelLayout | None]
) -> PipelineSkew | None:
    """The stages of the pipeline these files belong to, or None when they do not span two
    stages with a trace (a peak) each."""
    stage_of = pipeline_stages({path: layouts.get(path) for path in summaries})
    if stage_of is None:
        return None
    members: dict[int, list[str]] = {}
    for path, stage in stage_of.items():
        if stage is not None and summaries[path].peak_requested_bytes is not None:
            members.setdefault(stage, []).append(path)
    if len(members) < 2:
        return None
    reps = {}
    for stage, files in members.items():
        peak = {path: int(summaries[path].peak_requested_bytes or 0) for path in files}
        # the lower median: of two replicas, one odd (a bigger batch, an OOM), the usual one
        median = statistics.median_low(peak.values())
        reps[stage] = min(files, key=lambda path: (peak[path] != median, path))
    # the schedule the stages' usual ranks agree on (an odd replica's own sidecar aside)
    lays = [lay for path in reps.values() if (lay := layouts.get(path)) is not None]
    num_stages = _common([lay.num_stages for lay in lays])
    schedule = _common([lay.schedule for lay in lays])
    microbatches = _common([lay.microbatches for lay in lays])
    told = [lay for lay in lays if lay.schedule is not None]
    from_trace = schedule is not None and all(lay.source == "stacks" for lay in told)
    stages = []
    for stage in sorted(members):
        summary = summaries[reps[stage]]
        stages.append(
            StageProfile(
                stage=stage,
                files=members[stage],
                path=reps[stage],
                peak_requested_bytes=int(summary.peak_requested_bytes or 0),
                inflight_activation_bytes=int(summary.peak_categories.get("inflight_activation", 0)),
                peak_categories={category: value for category, value in summary.peak_categories.items() if value},
                microbatches_in_flight=microbatches_in_flight(
                    schedule,
                    stage,
                    num_stages,
                    microbatches,
                ),
            )
        )
    heaviest = max(stages, key=lambda profile: (profile.peak_requested_bytes, -profile.stage))
    lightest = min(stages, key=lambda profile: (profile.peak_requested_bytes, profile.stage))
    cats = set(heaviest.peak_categories) | set(lightest.peak_categories)
    delta = {
        category: heaviest.peak_categories.get(category, 0) - lightest.peak_categories.get(category, 0)
        for category in cats
    }
    by_category = {
        category: difference
        for category, difference in sorted(
            delta.items(),
            key=lambda item: (-abs(item[1]), item[0]),
        )
        if difference
    }
    return PipelineSkew(
        stages=stages,
        num_stages=num_stages,
        schedule=schedule,
        microbatches=microbatches,
        heaviest=heaviest,
        lightest=lightest,
        by_category=by_category,
        by_site=_site_deltas(summaries[heaviest.path], summaries[lightest.path]),
        schedule_from_trace=from_trace,
    )
