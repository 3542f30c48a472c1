"""Comparing snapshots: two of one job (``diff``), many ranks of one job (``ranks``), and limits
for CI (``check``). Everything here works on small summaries, never on two sets of frames."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from ...units import format_bytes, format_percent
from ..attribution.modules import BEFORE_ROW, OUTSIDE_ROW, module_breakdown
from ..attribution.sites import alive_at, allocation_forward_ids, block_forward_ids, site_labels, snapshot_sites
from ..categories import CATEGORIES, CategoryRules, categorize, category_levels_at
from ..diagnose import Diagnosis
from ..findings import Finding, compute_fleet_findings
from ..history.lifetimes import device_lifetimes
from ..history.timeline import Timeline, envelope
from ..parallel.parallelism import (
    ParallelLayout,
    group_label,
    layout_from_name,
    layout_from_pipeline_stacks,
    layout_from_sidecar,
    pipeline_stages,
)
from ..parallel.pipeline import PEAK_SITES_LIMIT, PipelineSkew, pipeline_skew
from ..stats.summary import SnapshotStats, with_category_rules
from .snapshot_summary import SnapshotSummary
from .stages import StagesDiff

MiB = 1024 * 1024
# buckets of the timelines a summary keeps for diff's overlaid chart
TIMELINE_POINTS = 400


# --------------------------------------------------------------------------- summaries


def site_table(frames: SnapshotFrames) -> pd.DataFrame:
    """Allocated bytes at the dump per allocation site, keyed by text (comparable across files):
    columns site, detail, bytes, blocks (stackless blocks grouped by category)."""
    blocks = frames.blocks[frames.blocks["state"] == "active_allocated"]
    sites = snapshot_sites(frames)
    cats = categorize(frames).block_category[blocks.index]
    stack_ids = blocks["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    site, detail = site_labels(stack_ids, sites, cats.to_numpy(dtype=object), block_forward_ids(blocks))
    df = pd.DataFrame({"site": site, "detail": detail, "bytes": blocks["size_bytes"].to_numpy()})
    return df.groupby(["site", "detail"], as_index=False).agg(
        bytes=("bytes", "sum"),
        blocks=("bytes", "size"),
    )


def peak_site_table(frames: SnapshotFrames, device: int, peak_index: int) -> pd.DataFrame:
    """Requested bytes of the allocations alive at the device's peak (event ``peak_index``) per
    allocation site and category, keyed by text (comparable across files): columns site,
    detail, category, bytes; largest first."""
    alive = alive_at(device_lifetimes(frames, device), peak_index)
    sites = snapshot_sites(frames)
    codes = categorize(frames).alloc_codes[device][alive.index.to_numpy()]
    cats = np.array(CATEGORIES, dtype=object)[np.where(codes < 0, len(CATEGORIES) - 1, codes)]
    sid = alive["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    fwd = allocation_forward_ids(frames, device, alive["event_index"].to_numpy(dtype=np.int64))
    site, detail = site_labels(sid, sites, cats, fwd)
    df = pd.DataFrame(
        {"site": site, "detail": detail, "category": cats, "bytes": alive["size_bytes"].to_numpy()},
    )
    out = df.groupby(["site", "detail", "category"], as_index=False)["bytes"].sum()
    return out.sort_values(["bytes", "site"], ascending=[False, True], ignore_index=True)


def summarize(
    frames: SnapshotFrames,
    stats: SnapshotStats,
    diagnosis: Diagnosis,
    with_sites: bool = True,
    rules: CategoryRules | None = None,
) -> SnapshotSummary:
    """The summary of one snapshot (``with_sites``: its allocation sites too). With ``rules``, its
    categories at the dump are labelled by the user's rules first (``diff`` and ``ranks`` show
    them); the categories at the peaks stay the built-in ones, which the pipeline's comparison
    reasons about."""
    peaks = [timeline for timeline in diagnosis.timelines.values() if timeline is not None]
    fragmentation = stats.fragmentation["all"]
    peak_categories, peak_sites = _at_peaks(frames, peaks)
    peak_modules, modules_source = _modules_at_peaks(frames, peaks)
    leaks = diagnosis.leaks.values()
    sites = site_table(frames).to_dict("records") if with_sites else []
    return SnapshotSummary(
        path=stats.file["path"],
        devices=list(stats.devices),
        torch_stats=stats.torch_stats,
        external_fragmentation=fragmentation.external_fragmentation,
        free_in_reserved_bytes=fragmentation.free_bytes,
        stranded_bytes=fragmentation.stranded_bytes,
        peak_requested_bytes=sum(peak.peak_requested_bytes for peak in peaks) if peaks else None,
        peak_reserved_bytes=sum(peak.peak_reserved_bytes for peak in peaks) if peaks else None,
        oom_cause=stats.oom.cause if stats.oom else None,
        oom_requested_bytes=stats.oom.requested_bytes if stats.oom else None,
        categories=stats.categories if rules is None else with_category_rules(stats, frames, rules).categories,
        findings=[finding.id for finding in diagnosis.findings],
        leak_growth_bytes_per_iteration=sum(leak.growth_bytes_per_iteration for leak in leaks),
        sites=[{str(key): value for key, value in row.items()} for row in sites],
        layout=layout_from_sidecar(frames.info.capture),
        stack_layout=layout_from_pipeline_stacks(frames),
        peak_categories=peak_categories,
        peak_sites=peak_sites,
        peak_modules=peak_modules,
        modules_source=modules_source,
        timelines=[timeline_series(frames, peak) for peak in peaks] if with_sites else [],
    )


def timeline_series(frames: SnapshotFrames, timeline: Timeline, points: int = TIMELINE_POINTS) -> dict[str, Any]:
    """A device's requested and reserved bytes over the trace in at most ``points`` buckets (each
    bucket's largest value, so the peaks survive), for the chart of two files overlaid: x in
    seconds since the device's first event when every event has a time, else the event index."""
    index = np.arange(timeline.n_events)
    requested = envelope(index, timeline.requested_bytes, points)
    reserved = envelope(index, timeline.reserved_bytes, points)
    starts = requested.x.astype(np.int64)
    times = frames.events.loc[frames.events["device"] == timeline.device, "time_us"]
    timed = len(times) == timeline.n_events and bool(times.notna().all())
    if timed:
        micros = times.to_numpy(dtype=np.int64)
        x_values = [float(seconds) for seconds in (micros[starts] - micros[0]) / 1e6]
    else:
        x_values = [float(start) for start in starts]
    return {
        "device": timeline.device,
        "x_label": "seconds" if timed else "event index",
        "x": x_values,
        "index": [int(start) for start in starts],
        "requested": [int(value) for value in requested.high],
        "reserved": [int(value) for value in reserved.high],
    }


def _at_peaks(
    frames: SnapshotFrames,
    peaks: list[Timeline],
) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """At each device's peak of requested bytes (summed over devices): requested bytes per
    category, and the largest sites alive then (at most PEAK_SITES_LIMIT)."""
    peak_categories: dict[str, int] = {}
    tables = []
    for timeline in peaks:
        levels = category_levels_at(frames, timeline.device, timeline.peak_index)
        for category, nbytes in levels.items():
            peak_categories[category] = peak_categories.get(category, 0) + nbytes
        tables.append(peak_site_table(frames, timeline.device, timeline.peak_index))
    columns = ["site", "detail", "category", "bytes"]
    peak_sites = tables[0] if len(tables) == 1 else pd.DataFrame(columns=columns)
    if len(tables) > 1:
        both = pd.concat(tables, ignore_index=True)
        summed = both.groupby(["site", "detail", "category"], as_index=False).sum()
        largest_first = [False, True]
        peak_sites = summed.sort_values(
            ["bytes", "site"],
            ascending=largest_first,
            ignore_index=True,
        )
    rows = peak_sites.head(PEAK_SITES_LIMIT).itertuples(index=False)
    return peak_categories, [
        {
            "site": str(row.site),
            "detail": str(row.detail),
            "category": str(row.category),
            "bytes": int(row.bytes),
        }
        for row in rows
    ]


def _modules_at_peaks(frames: SnapshotFrames, peaks: list[Timeline]) -> tuple[dict[str, int], str]:
    """Requested bytes by module at the same peaks (self bytes), with the bytes outside any
    module and those allocated before the trace as rows of their own; and where the modules
    came from: 'tags' (exact), 'stacks' (approximate) or 'none'."""
    peak_modules: dict[str, int] = {}
    sources = set()
    for timeline in peaks:
        breakdown = module_breakdown(frames, timeline.device)
        sources.add(breakdown.source)
        for row in breakdown.rows:
            peak_modules[row.label] = peak_modules.get(row.label, 0) + row.self_bytes
        outside = peak_modules.get(OUTSIDE_ROW, 0) + breakdown.outside_bytes
        peak_modules[OUTSIDE_ROW] = outside
        peak_modules[BEFORE_ROW] = peak_modules.get(BEFORE_ROW, 0) + breakdown.before_trace_bytes
    approximate = "stacks" if sources - {"none"} else "none"
    source = "tags" if sources == {"tags"} else approximate
    return {label: nbytes for label, nbytes in peak_modules.items() if nbytes}, source


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
    """One allocation site (its label, ``file:line in function``) before and after: the bytes and
    blocks of every call path that reaches it summed (``paths``: how many there are, in either
    file; ``detail``: the call path that holds the most bytes)."""

    site: str
    detail: str
    before_bytes: int
    after_bytes: int
    status: str  # 'grown', 'shrunk', 'new', 'gone', 'same'
    before_blocks: int = 0
    after_blocks: int = 0
    paths: int = 1

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
    # requested bytes at the peak by module (self bytes; rows for outside any module and before
    # the trace): they add up to the change of the peak. Empty unless both files name modules
    # the same way (both tagged, or both approximated from stacks)
    modules: list[SiteChange] = field(default_factory=list)
    modules_source: str = "none"
    stages: StagesDiff | None = None  # stages of the two runs by name; only when asked for (diff --stages)

    def to_dict(self) -> dict[str, Any]:
        def ch(change: Change) -> dict[str, Any]:
            return {"name": change.name, "before": change.before, "after": change.after, "delta": change.delta}

        return {
            "before": self.before.path,
            "after": self.after.path,
            "totals": [ch(change) for change in self.totals],
            "categories": [ch(change) for change in self.categories],
            "sites": [{**asdict(site), "delta_bytes": site.delta_bytes} for site in self.sites],
            "findings_new": self.findings_new,
            "findings_gone": self.findings_gone,
            "modules_source": self.modules_source,
            "modules": [
                {
                    "module": module.site,
                    "before_bytes": module.before_bytes,
                    "after_bytes": module.after_bytes,
                    "delta_bytes": module.delta_bytes,
                    "status": module.status,
                }
                for module in self.modules
            ],
            **({"stages": self.stages.to_dict()} if self.stages is not None else {}),
        }


def _status(before: int, after: int) -> str:
    """How a site's (or a module's) bytes changed."""
    if before == 0:
        return "new"
    if after == 0:
        return "gone"
    return "grown" if after > before else "shrunk" if after < before else "same"


def _module_changes(first: SnapshotSummary, second: SnapshotSummary, limit: int) -> list[SiteChange]:
    if first.modules_source != second.modules_source or first.modules_source == "none":
        return []
    rows = []
    # every name holds bytes in a or b
    for name in dict.fromkeys([*first.peak_modules, *second.peak_modules]):
        before, after = first.peak_modules.get(name, 0), second.peak_modules.get(name, 0)
        rows.append(SiteChange(name, "", before, after, _status(before, after)))
    rows.sort(key=lambda row: (-abs(row.delta_bytes), -row.after_bytes, row.site))
    return rows[:limit]


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
        Change(
            "segments",
            a.torch_stats["segment.all.current"],
            b.torch_stats["segment.all.current"],
        ),
    ]
    cats = [Change(category, a.categories.get(category, 0), b.categories.get(category, 0)) for category in a.categories]
    return SnapshotDiff(
        before=a,
        after=b,
        totals=totals,
        categories=cats,
        sites=site_changes(a.sites, b.sites, limit),
        findings_new=sorted(set(b.findings) - set(a.findings)),
        findings_gone=sorted(set(a.findings) - set(b.findings)),
        modules=_module_changes(a, b, limit),
        modules_source=a.modules_source if a.modules_source == b.modules_source else "none",
    )


SITE_COLUMNS = ["site", "detail", "bytes", "blocks"]


def _by_label(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per site label: bytes and blocks summed over its call paths (``detail``), the
    paths themselves listed largest first."""
    table = pd.DataFrame(rows, columns=SITE_COLUMNS).astype({"detail": str})
    table = table.sort_values(["bytes", "detail"], ascending=[False, True], kind="stable")
    return table.groupby("site", as_index=False, sort=False).agg(
        bytes=("bytes", "sum"), blocks=("blocks", "sum"), details=("detail", list)
    )


def site_changes(before: list[dict[str, Any]], after: list[dict[str, Any]], limit: int = 50) -> list[SiteChange]:
    """The sites (rows of :func:`site_table`) that changed most between two files, largest change
    first: the rows that share a site label are one (a line reached by many call paths, such as a
    forward hook of every layer, is one line that grew by the sum)."""
    merged = _by_label(before).merge(_by_label(after), on="site", how="outer", suffixes=("_a", "_b"))
    merged = merged.fillna({"bytes_a": 0, "bytes_b": 0, "blocks_a": 0, "blocks_b": 0})
    merged["delta"] = merged["bytes_b"] - merged["bytes_a"]
    merged["size"] = merged[["bytes_a", "bytes_b"]].max(axis=1)
    merged = merged.sort_values(["delta", "size", "site"], key=_magnitude, ascending=[False, False, True])
    out = []
    for row in merged.head(limit).itertuples(index=False):
        paths_a = row.details_a if isinstance(row.details_a, list) else []
        paths_b = row.details_b if isinstance(row.details_b, list) else []
        largest = (paths_b if row.bytes_b >= row.bytes_a else paths_a) or paths_a or paths_b
        paths = len(set(paths_a) | set(paths_b))
        before_bytes, after_bytes = int(row.bytes_a), int(row.bytes_b)
        out.append(
            SiteChange(
                str(row.site),
                str(largest[0]) if largest else "",
                before_bytes,
                after_bytes,
                _status(before_bytes, after_bytes),
                int(row.blocks_a),
                int(row.blocks_b),
                max(paths, 1),
            )
        )
    return out


def _magnitude(column: pd.Series) -> pd.Series:
    """Sort key: numbers by their size (a shrink as large as a growth ranks beside it)."""
    return column.abs() if pd.api.types.is_numeric_dtype(column) else column


# --------------------------------------------------------------------------- ranks

RANK_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
# ``snaplab run`` names files <prefix>_rank<R>_<host>_<YYYYmmdd-HHMMSS>[_<why>].pickle (host
# without '_')
CAPTURE_HOST_RE = re.compile(r"rank[_-]?\d+_([A-Za-z0-9.-]+)_\d{8}-\d{6}", re.IGNORECASE)
# otherwise only a token that plainly names a machine (node3, node-7, host12, nid001234): a bare
# prefix such as 'a_rank0' or 'run2_rank0' is not taken for a host
NAME_HOST_RE = re.compile(r"(?<![A-Za-z0-9])((?:node|host|nid)-?\d+)(?![A-Za-z0-9])", re.IGNORECASE)
# a rank is flagged when this far above the median...
OUTLIER_RATIO = 0.15
# ...or this far below it (a rank doing much less work than the others)...
OUTLIER_LOW_RATIO = 0.5
# ...and by at least this much
OUTLIER_MIN_BYTES = 128 * MiB

K = TypeVar("K", bound=Hashable)


def _file_name(path: str) -> str:
    return path.replace("\\", "/").split("/")[-1]


def rank_of(path: str) -> int | None:
    """The rank number in a file's name (the last ``rank<N>``), or None when it has none."""
    found = RANK_RE.findall(_file_name(path))
    return int(found[-1]) if found else None


def host_of(path: str, sidecar: dict[str, Any] | None = None) -> str | None:
    """The host a rank file came from: the capture sidecar's ``host``, else a host in the file
    name (``snaplab run``'s naming, or a token like ``node3``), else None."""
    if sidecar is not None and isinstance(sidecar.get("host"), str) and sidecar["host"].strip():
        # it goes into one-line messages and labels: no newline, control character or space
        recorded = sidecar["host"].strip()
        host = "".join(char if char.isprintable() and not char.isspace() else "-" for char in recorded)
        return host[:64]
    name = _file_name(path)
    match = CAPTURE_HOST_RE.search(name) or NAME_HOST_RE.search(name)
    return match.group(1) if match else None


LabelKind = Literal["rank", "host", "file"]


@dataclass(frozen=True)
class RankRow:
    """One file of a fleet. ``label`` is unique among the rows: the rank number when no other
    file has it, ``<host>/rank<N>`` when the host tells files of one number apart, else the file
    name (with as much of its directory as needed); ``labelled_by`` says which."""

    rank: int | None
    label: str
    labelled_by: LabelKind
    host: str | None
    summary: SnapshotSummary
    flags: list[str]
    # where the rank sits in the parallel layout (sidecar, else file name), and the group of
    # rows it was compared with ('pp stage 1'; None: all rows, as without a pipeline)
    layout: ParallelLayout | None = None
    group: str | None = None
    group_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        summary = self.summary
        lay = self.layout
        return {
            "rank": self.rank,
            "label": self.label,
            "host": self.host,
            "coordinates": dict(lay.coordinates) if lay is not None else {},
            "coordinates_from": lay.source if lay is not None else None,
            "group": self.group,
            "group_size": self.group_size,
            "path": summary.path,
            "devices": summary.devices,
            "reserved_bytes": summary.reserved,
            "allocated_bytes": summary.allocated,
            "peak_requested_bytes": summary.peak_requested_bytes,
            "peak_reserved_bytes": summary.peak_reserved_bytes,
            "external_fragmentation": summary.external_fragmentation,
            "oom": summary.oom_cause,
            "inflight_activation_bytes_at_peak": (
                summary.peak_categories.get("inflight_activation", 0) if summary.peak_categories else None
            ),
            "findings": summary.findings,
            "outlier": bool(self.flags),
            "flags": self.flags,
        }


def _how_far(label: str, value: int, others: list[int], median: float, of_group: str) -> str:
    """Why a value stands out, said against what it is compared with: its peer when there is one
    other file ('2.5× its peer's 1.74 GiB': a median of two is their mean, half way to the odd
    one), else the median ('43% above the median', '2.1× the median' once that reads better)."""
    if len(others) == 1:
        peer = others[0]
        if value > peer:
            return f"{label} {format_bytes(value)} is {value / peer:.1f}× its peer's {format_bytes(peer)}{of_group}"
        share = format_percent(value / peer, 0)
        return f"{label} {format_bytes(value)} is {share} of its peer's {format_bytes(peer)}{of_group}"
    if value >= 2 * median:
        return f"{label} {format_bytes(value)} is {value / median:.1f}× the median {format_bytes(median)}{of_group}"
    word = "above" if value > median else "below"
    return (
        f"{label} {format_bytes(value)} is {format_percent(abs(value - median) / median, 0)} {word} "
        f"the median {format_bytes(median)}{of_group}"
    )


def rank_outliers(
    summaries: dict[K, SnapshotSummary],
    within: str | None = None,
) -> dict[K, list[str]]:
    """Why each file stands out from the others (empty list: it does not); keys are anything
    that names a file (its rank, its path). A file stands out when it is far from the median of
    the files (``OUTLIER_RATIO`` above, ``OUTLIER_LOW_RATIO`` below, and ``OUTLIER_MIN_BYTES``);
    the message says it against its peer when there are two files. ``within`` names the group
    they form in the messages ('pp stage 1': '... the median ... of pp stage 1')."""
    of_group = f" of {within}" if within else ""
    flags: dict[K, list[str]] = {file_key: [] for file_key in summaries}
    metrics: dict[str, dict[K, int | None]] = {
        "peak requested": {file_key: summary.peak_requested_bytes for file_key, summary in summaries.items()},
        "reserved": {file_key: summary.reserved for file_key, summary in summaries.items()},
        "allocated": {file_key: summary.allocated for file_key, summary in summaries.items()},
    }
    if len(summaries) >= 2:
        for label, values in metrics.items():
            known = {file_key: nbytes for file_key, nbytes in values.items() if nbytes is not None}
            if len(known) < 2:
                continue
            med = statistics.median(known.values())
            for file_key, nbytes in known.items():
                diff = nbytes - med
                ratio = OUTLIER_RATIO if diff > 0 else OUTLIER_LOW_RATIO
                if abs(diff) >= OUTLIER_MIN_BYTES and med and abs(diff) / med >= ratio:
                    others = [other for key, other in known.items() if key != file_key]
                    flags[file_key].append(_how_far(label, nbytes, others, med, of_group))
    for file_key, summary in summaries.items():
        if summary.oom_cause:
            requested = format_bytes(summary.oom_requested_bytes)
            flags[file_key].append(f"out of memory ({summary.oom_cause}) on a request of {requested}")
    return flags


def _path_end(parts: list[str], depth: int) -> str | None:
    """The last ``depth`` parts of a path, joined; None when it has fewer."""
    return "/".join(parts[-depth:]) if depth <= len(parts) else None


def _path_labels(paths: list[str]) -> dict[str, str]:
    """The shortest end of each path (file name, then parent/file name, ...) that no other of
    ``paths`` shares; the whole path where nothing shorter tells them apart."""
    parts = {path: [part for part in path.replace("\\", "/").split("/") if part] or [path] for path in paths}
    depth = dict.fromkeys(paths, 1)
    while True:
        labels = {path: _path_end(parts[path], depth[path]) or path for path in paths}
        seen = Counter(labels.values())
        clash = [path for path in paths if seen[labels[path]] > 1 and labels[path] != path]
        if not clash:
            return labels
        for path in clash:
            depth[path] += 1


def rank_labels(
    paths: list[str],
    hosts: dict[str, str | None],
) -> dict[str, tuple[int | None, str, LabelKind]]:
    """Rank, label and what the label comes from, per path (see ``RankRow``)."""
    rank = {path: rank_of(path) for path in paths}
    count = Counter(number for number in rank.values() if number is not None)
    count_host = Counter((rank[path], hosts.get(path)) for path in paths)
    out: dict[str, tuple[int | None, str, LabelKind]] = {}
    by_file = []
    for path in paths:
        number, host = rank[path], hosts.get(path)
        if number is not None and count[number] == 1:
            out[path] = (number, str(number), "rank")
        elif number is not None and host is not None and count_host[number, host] == 1:
            out[path] = (number, f"{host}/rank{number}", "host")
        else:
            by_file.append(path)
    names = _path_labels(by_file)
    taken = {label for _, label, _ in out.values()}
    for path in by_file:
        # a file literally named like another row's label ('3', 'node3/rank0') keeps its whole path
        label = names[path] if names[path] not in taken else path if path not in taken else f"./{path}"
        out[path] = (rank[path], label, "file")
    return out


def rank_layouts(summaries: dict[str, SnapshotSummary]) -> dict[str, ParallelLayout | None]:
    """Each file's place in the parallel layout: its capture sidecar's, else its file name's,
    else the pipeline stage its stacks show."""
    return {
        path: summary.layout or layout_from_name(path) or summary.stack_layout for path, summary in summaries.items()
    }


def rank_groups(layouts: dict[str, ParallelLayout | None]) -> dict[str, str | None]:
    """The group each file is compared within: its pipeline stage ('pp stage 1') when the files
    span several stages, else None (every file with every other). The replicas, FSDP shards and
    tensor-parallel peers of one stage hold the same; different stages do not."""
    stage = pipeline_stages(layouts)
    if stage is None:
        return dict.fromkeys(layouts)
    inferred = {path for path, lay in layouts.items() if lay is not None and lay.source == "stacks"}
    return {path: group_label(stage_number, path in inferred) for path, stage_number in stage.items()}


def rank_rows(
    summaries: dict[str, SnapshotSummary],
    hosts: dict[str, str | None] | None = None,
) -> list[RankRow]:
    """One row per file (``summaries`` keyed by path), labelled (see ``RankRow``) and flagged
    against the median of the rows that should look like it: the other ranks of its pipeline
    stage when the files span several stages (see :func:`rank_groups`), else all rows. Rows are
    ordered by rank, then host, then file name (numbers in them by value); files without a rank
    number come last."""
    hosts = hosts or {}
    paths = list(summaries)
    labels = rank_labels(paths, hosts)
    layouts = rank_layouts(summaries)
    groups = rank_groups(layouts)
    members: dict[str | None, list[str]] = {}
    for path in paths:
        members.setdefault(groups[path], []).append(path)
    flags: dict[str, list[str]] = {}
    for group, group_paths in members.items():
        flags.update(rank_outliers({path: summaries[path] for path in group_paths}, within=group))

    def natural(text: str) -> list[str | int]:  # node2 before node10
        return [int(token) if i % 2 else token for i, token in enumerate(re.split(r"(\d+)", text))]

    def order(path: str) -> tuple[bool, int, list[str | int], list[str | int], str]:
        rank = labels[path][0]
        host, name = natural(hosts.get(path) or ""), natural(_file_name(path))
        return (rank is None, rank if rank is not None else 0, host, name, path)

    return [
        RankRow(
            labels[path][0],
            labels[path][1],
            labels[path][2],
            hosts.get(path),
            summaries[path],
            flags[path],
            layouts[path],
            groups[path],
            len(members[groups[path]]) if groups[path] is not None else None,
        )
        for path in sorted(paths, key=order)
    ]


def rank_pipeline(rows: list[RankRow]) -> tuple[PipelineSkew | None, list[Finding]]:
    """The pipeline's stages side by side (None unless the rows span two pipeline stages) and
    the findings across the files of ``rows`` (``pipeline-stage-imbalance``)."""
    summaries = {row.summary.path: row.summary for row in rows}
    layouts = {row.summary.path: row.layout for row in rows}
    return pipeline_skew(summaries, layouts), compute_fleet_findings(summaries, layouts)


# --------------------------------------------------------------------------- check


@dataclass(frozen=True)
class Limits:
    max_reserved_bytes: int | None = None
    max_allocated_bytes: int | None = None
    max_peak_bytes: int | None = None
    max_fragmentation: float | None = None
    # an OOM fails the gate unless allowed: a CI gate must not pass one by default
    no_oom: bool = True
    no_leaks: bool = False
    max_growth: float | None = None  # against a baseline, e.g. 0.05


@dataclass(frozen=True)
class Violation:
    limit: str
    value: float | str
    threshold: float | str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "value": self.value, "threshold": self.threshold, "message": self.message}


def check_limits(
    s: SnapshotSummary,
    limits: Limits,
    baseline: SnapshotSummary | None = None,
) -> list[Violation]:
    out = []

    def over(name: str, value: int | None, limit: int | None, what: str) -> None:
        if limit is not None and value is not None and value > limit:
            message = f"{what} {format_bytes(value)} exceeds {format_bytes(limit)}"
            out.append(Violation(name, value, limit, message))

    over("max_reserved", s.reserved, limits.max_reserved_bytes, "reserved")
    over("max_allocated", s.allocated, limits.max_allocated_bytes, "allocated")
    over("max_peak", s.peak_requested_bytes, limits.max_peak_bytes, "peak requested")
    if limits.max_fragmentation is not None and s.external_fragmentation > limits.max_fragmentation:
        fragmentation, limit = s.external_fragmentation, limits.max_fragmentation
        message = f"external fragmentation {fragmentation:.3f} exceeds {limit:.3f}"
        out.append(Violation("max_fragmentation", fragmentation, limit, message))
    if limits.no_oom and s.oom_cause:
        message = f"the trace holds an out-of-memory error ({s.oom_cause})"
        out.append(Violation("no_oom", s.oom_cause, "none", message))
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
            ("peak requested", s.peak_requested_bytes, baseline.peak_requested_bytes),
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
                        f"{name} grew {format_percent(growth)} over the baseline "
                        f"({format_bytes(then)} -> {format_bytes(now)}), more than "
                        f"{format_percent(limits.max_growth)}",
                    )
                )
    return out
