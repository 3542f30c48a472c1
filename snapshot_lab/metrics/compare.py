"""Comparing snapshots: two of one job (``diff``), many ranks of one job (``ranks``), and limits
for CI (``check``). Everything here works on small summaries, never on two sets of frames."""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from ..frames import SnapshotFrames
from ..units import format_bytes, format_percent
from .diagnose import Diagnosis
from .sites import frame_label, innermost_frames, site_frames
from .summary import SnapshotStats

MiB = 1024 * 1024


# --------------------------------------------------------------------------- summaries


def site_table(frames: SnapshotFrames) -> pd.DataFrame:
    """Allocated bytes at the dump per allocation site, keyed by text (comparable across files):
    columns site, detail, bytes, blocks."""
    b = frames.blocks[frames.blocks["state"] == "active_allocated"]
    site_of = site_frames(frames.stacks, frames.stack_frames)
    inner_of = innermost_frames(frames.stacks, frames.stack_frames)
    sf = frames.stack_frames.set_index("frame_id")
    labels = {int(fid): frame_label(str(r["filename"]), int(r["line"]), str(r["name"])) for fid, r in sf.iterrows()}
    site = b["stack_id"].map(site_of).map(labels).fillna("<no stack recorded>")
    detail = b["stack_id"].map(inner_of).map(labels).fillna("")
    detail = detail.where(detail != site, "")
    df = pd.DataFrame({"site": site.to_numpy(), "detail": detail.to_numpy(), "bytes": b["size_bytes"].to_numpy()})
    return df.groupby(["site", "detail"], as_index=False).agg(bytes=("bytes", "sum"), blocks=("bytes", "size"))


@dataclass(frozen=True)
class SnapshotSummary:
    """What ``diff``, ``ranks`` and ``check`` need of one snapshot (small, picklable)."""

    path: str
    devices: list[int]
    torch_stats: dict[str, int]
    external_fragmentation: float
    free_in_reserved_bytes: int
    stranded_bytes: int
    peak_requested_bytes: int | None
    peak_reserved_bytes: int | None
    oom_cause: str | None
    oom_requested_bytes: int | None
    categories: dict[str, int]
    findings: list[str]
    leak_growth_bytes_per_iteration: int
    sites: list[dict[str, Any]] = field(default_factory=list)

    @property
    def reserved(self) -> int:
        return self.torch_stats["reserved_bytes.all.current"]

    @property
    def allocated(self) -> int:
        return self.torch_stats["allocated_bytes.all.current"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(frames: SnapshotFrames, stats: SnapshotStats, dg: Diagnosis, with_sites: bool = True) -> SnapshotSummary:
    peaks = [tl for tl in dg.timelines.values() if tl is not None]
    frag = stats.fragmentation["all"]
    return SnapshotSummary(
        path=stats.file["path"],
        devices=list(stats.devices),
        torch_stats=stats.torch_stats,
        external_fragmentation=frag.external_fragmentation,
        free_in_reserved_bytes=frag.free_bytes,
        stranded_bytes=frag.stranded_bytes,
        peak_requested_bytes=sum(t.peak_requested_bytes for t in peaks) if peaks else None,
        peak_reserved_bytes=sum(t.peak_reserved_bytes for t in peaks) if peaks else None,
        oom_cause=stats.oom.cause if stats.oom else None,
        oom_requested_bytes=stats.oom.requested_bytes if stats.oom else None,
        categories=stats.categories,
        findings=[f.id for f in dg.findings],
        leak_growth_bytes_per_iteration=sum(la.growth_bytes_per_iteration for la in dg.leaks.values()),
        sites=[{str(k): v for k, v in r.items()} for r in site_table(frames).to_dict("records")] if with_sites else [],
    )


# --------------------------------------------------------------------------- diff


@dataclass(frozen=True)
class Change:
    name: str
    before: float | None
    after: float | None

    @property
    def delta(self) -> float | None:
        if self.before is None or self.after is None:
            return None
        return self.after - self.before


@dataclass(frozen=True)
class SiteChange:
    site: str
    detail: str
    before_bytes: int
    after_bytes: int
    status: str  # 'grown', 'shrunk', 'new', 'gone', 'same'

    @property
    def delta_bytes(self) -> int:
        return self.after_bytes - self.before_bytes


@dataclass(frozen=True)
class SnapshotDiff:
    before: SnapshotSummary
    after: SnapshotSummary
    totals: list[Change]
    categories: list[Change]
    sites: list[SiteChange]
    findings_new: list[str]
    findings_gone: list[str]

    def to_dict(self) -> dict[str, Any]:
        def ch(c: Change) -> dict[str, Any]:
            return {"name": c.name, "before": c.before, "after": c.after, "delta": c.delta}

        return {
            "before": self.before.path,
            "after": self.after.path,
            "totals": [ch(c) for c in self.totals],
            "categories": [ch(c) for c in self.categories],
            "sites": [{**asdict(s), "delta_bytes": s.delta_bytes} for s in self.sites],
            "findings_new": self.findings_new,
            "findings_gone": self.findings_gone,
        }


def diff_summaries(a: SnapshotSummary, b: SnapshotSummary, limit: int = 50) -> SnapshotDiff:
    totals = [
        Change("reserved_bytes", a.reserved, b.reserved),
        Change("allocated_bytes", a.allocated, b.allocated),
        Change(
            "requested_bytes",
            a.torch_stats["requested_bytes.all.current"],
            b.torch_stats["requested_bytes.all.current"],
        ),
        Change("free_in_reserved_bytes", a.free_in_reserved_bytes, b.free_in_reserved_bytes),
        Change("stranded_bytes", a.stranded_bytes, b.stranded_bytes),
        Change("external_fragmentation", a.external_fragmentation, b.external_fragmentation),
        Change("peak_requested_bytes", a.peak_requested_bytes, b.peak_requested_bytes),
        Change("peak_reserved_bytes", a.peak_reserved_bytes, b.peak_reserved_bytes),
        Change("segments", a.torch_stats["segment.all.current"], b.torch_stats["segment.all.current"]),
    ]
    cats = [Change(c, a.categories.get(c, 0), b.categories.get(c, 0)) for c in a.categories]
    sa = pd.DataFrame(a.sites, columns=["site", "detail", "bytes", "blocks"])
    sb = pd.DataFrame(b.sites, columns=["site", "detail", "bytes", "blocks"])
    m = sa.merge(sb, on=["site", "detail"], how="outer", suffixes=("_a", "_b"))
    m = m.fillna({"bytes_a": 0, "bytes_b": 0})
    m["delta"] = m["bytes_b"] - m["bytes_a"]
    m = m.reindex(m["delta"].abs().sort_values(ascending=False).index).head(limit)
    sites = []
    for r in m.itertuples(index=False):
        before, after = int(r.bytes_a), int(r.bytes_b)
        status = (
            "new"
            if before == 0
            else "gone"
            if after == 0
            else "grown"
            if after > before
            else "shrunk"
            if after < before
            else "same"
        )
        sites.append(SiteChange(str(r.site), str(r.detail), before, after, status))
    return SnapshotDiff(
        before=a,
        after=b,
        totals=totals,
        categories=cats,
        sites=sites,
        findings_new=sorted(set(b.findings) - set(a.findings)),
        findings_gone=sorted(set(a.findings) - set(b.findings)),
    )


# --------------------------------------------------------------------------- ranks

RANK_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
OUTLIER_RATIO = 0.15  # flagged when this far above the median...
OUTLIER_LOW_RATIO = 0.5  # ...or this far below it (a rank doing much less work than the others)
OUTLIER_MIN_BYTES = 128 * MiB  # ...and by at least this much


def rank_of(path: str, position: int) -> int:
    m = RANK_RE.findall(path.replace("\\", "/").split("/")[-1])
    return int(m[-1]) if m else position


@dataclass(frozen=True)
class RankRow:
    rank: int
    summary: SnapshotSummary
    flags: list[str]

    def to_dict(self) -> dict[str, Any]:
        s = self.summary
        return {
            "rank": self.rank,
            "path": s.path,
            "devices": s.devices,
            "reserved_bytes": s.reserved,
            "allocated_bytes": s.allocated,
            "peak_requested_bytes": s.peak_requested_bytes,
            "peak_reserved_bytes": s.peak_reserved_bytes,
            "external_fragmentation": s.external_fragmentation,
            "oom": s.oom_cause,
            "findings": s.findings,
            "outlier": bool(self.flags),
            "flags": self.flags,
        }


def rank_outliers(summaries: dict[int, SnapshotSummary]) -> dict[int, list[str]]:
    """Why each rank stands out from the others (empty list: it does not)."""
    flags: dict[int, list[str]] = {r: [] for r in summaries}
    metrics: dict[str, dict[int, int | None]] = {
        "peak in use": {r: s.peak_requested_bytes for r, s in summaries.items()},
        "reserved": {r: s.reserved for r, s in summaries.items()},
        "allocated": {r: s.allocated for r, s in summaries.items()},
    }
    if len(summaries) >= 2:
        for label, values in metrics.items():
            known = {r: v for r, v in values.items() if v is not None}
            if len(known) < 2:
                continue
            med = statistics.median(known.values())
            for r, v in known.items():
                diff = v - med
                ratio = OUTLIER_RATIO if diff > 0 else OUTLIER_LOW_RATIO
                if abs(diff) >= OUTLIER_MIN_BYTES and med and abs(diff) / med >= ratio:
                    word = "above" if diff > 0 else "below"
                    flags[r].append(
                        f"{label} {format_bytes(v)} is {format_percent(abs(diff) / med, 0)} {word} the median "
                        f"{format_bytes(med)}"
                    )
    for r, s in summaries.items():
        if s.oom_cause:
            flags[r].append(f"out of memory ({s.oom_cause}) on a request of {format_bytes(s.oom_requested_bytes)}")
    return flags


def rank_rows(summaries: dict[int, SnapshotSummary]) -> list[RankRow]:
    flags = rank_outliers(summaries)
    return [RankRow(r, summaries[r], flags[r]) for r in sorted(summaries)]


# --------------------------------------------------------------------------- check


@dataclass(frozen=True)
class Limits:
    max_reserved_bytes: int | None = None
    max_allocated_bytes: int | None = None
    max_peak_bytes: int | None = None
    max_fragmentation: float | None = None
    no_oom: bool = False
    no_leaks: bool = False
    max_growth: float | None = None  # against a baseline, e.g. 0.05


@dataclass(frozen=True)
class Violation:
    limit: str
    value: float | str
    threshold: float | str
    message: str


def check_limits(s: SnapshotSummary, limits: Limits, baseline: SnapshotSummary | None = None) -> list[Violation]:
    out = []

    def over(name: str, value: int | None, limit: int | None, what: str) -> None:
        if limit is not None and value is not None and value > limit:
            out.append(Violation(name, value, limit, f"{what} {format_bytes(value)} exceeds {format_bytes(limit)}"))

    over("max_reserved", s.reserved, limits.max_reserved_bytes, "reserved")
    over("max_allocated", s.allocated, limits.max_allocated_bytes, "allocated")
    over("max_peak", s.peak_requested_bytes, limits.max_peak_bytes, "peak in use")
    if limits.max_fragmentation is not None and s.external_fragmentation > limits.max_fragmentation:
        out.append(
            Violation(
                "max_fragmentation",
                s.external_fragmentation,
                limits.max_fragmentation,
                f"external fragmentation {s.external_fragmentation:.3f} exceeds {limits.max_fragmentation:.3f}",
            )
        )
    if limits.no_oom and s.oom_cause:
        out.append(Violation("no_oom", s.oom_cause, "none", f"the trace holds an out-of-memory error ({s.oom_cause})"))
    if limits.no_leaks and s.leak_growth_bytes_per_iteration:
        out.append(
            Violation(
                "no_leaks",
                s.leak_growth_bytes_per_iteration,
                0,
                f"memory leaks {format_bytes(s.leak_growth_bytes_per_iteration)} per iteration",
            )
        )
    if baseline is not None and limits.max_growth is not None:
        for name, now, then in (
            ("reserved", s.reserved, baseline.reserved),
            ("allocated", s.allocated, baseline.allocated),
            ("peak in use", s.peak_requested_bytes, baseline.peak_requested_bytes),
        ):
            if now is None or then is None or then == 0:
                continue
            growth = (now - then) / then
            if growth > limits.max_growth:
                out.append(
                    Violation(
                        f"max_growth:{name}",
                        round(growth, 6),
                        limits.max_growth,
                        f"{name} grew {format_percent(growth)} over the baseline ({format_bytes(then)} -> "
                        f"{format_bytes(now)}), more than {format_percent(limits.max_growth)}",
                    )
                )
    return out
