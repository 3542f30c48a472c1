"""The report job: metrics -> plots -> context -> HTML, in that order, for one snapshot."""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import __version__
from .aside import Aside, Beside, Worker
from .frames import SnapshotFrames
from .load.sidecar import sidecar_batch_size
from .metrics import SnapshotStats
from .metrics.allocator.whatif import WhatIf
from .metrics.attribution.annotations import AnnotatedAllocation
from .metrics.attribution.composition import compose
from .metrics.attribution.modules import ModuleBreakdown, ModuleRow
from .metrics.attribution.sites import (
    alive_at,
    allocation_forward_ids,
    display_stack,
    live_sites,
    snapshot_sites,
    top_sites,
)
from .metrics.categories import (
    CATEGORIES,
    INFERRED_RULES,
    RULE_HELP,
    CategoryBreakdown,
    CategoryRules,
    categorize,
    category_levels,
    compute_categories,
)
from .metrics.categories.custom import USER_RULE_PREFIX
from .metrics.categories.kv_cache import KvCacheGrowth
from .metrics.diagnose import device_timelines, diagnose
from .metrics.explore import Exploration, explore
from .metrics.fit import compute_fit
from .metrics.fit.model import FitUnsupported, FitUnsupportedOom
from .metrics.fit.result import HEADLINE_LEVERS
from .metrics.history.moments import Moment, oom_moment
from .metrics.history.stages import file_stages, has_stages
from .metrics.history.timeline import Timeline
from .metrics.leaks import LeakAnalysis
from .metrics.stats.fragmentation import compute_fragmentation
from .metrics.stats.layout import PoolLayout, select_layout
from .metrics.stats.summary import DeviceStats
from .module_tags import parent_fqn
from .plots.views import category_view, timeline_view
from .progress import NullProgress, ProgressSink
from .render.annotations import show_annotations
from .render.answer import FirstScreen, FitSummary, SourceFile, levers, made_of, verdict
from .render.explorer import Payload, allocation_notes, layout_data, timeline_data, without_internals
from .render.fit import answer_sentence, batch_range_note, samples_note
from .render.fit import headline as fit_headline
from .render.host import host_view
from .render.html import Card, DeviceSection, ReportContext, Row, SiteView, render_report
from .render.markdown import render_markdown
from .render.stages import stages_view
from .render.text import whatif_view
from .units import format_bytes, format_percent

POOLS = ("all", "large_pool", "small_pool")
COUNTERS = (
    ("reserved_bytes", True, "held from CUDA (cudaMalloc'd or mapped): allocated or cached"),
    ("allocated_bytes", True, "in blocks handed to tensors (sizes rounded up by the allocator)"),
    ("active_bytes", True, "allocated + freed blocks still waiting for another stream"),
    ("requested_bytes", True, "what tensors asked for, before rounding (active blocks)"),
    ("inactive_split_bytes", True, "free bytes inside split segments (cannot be released)"),
    ("segment", False, "cudaMalloc'd segments (expandable segments not counted)"),
    ("allocation", False, "allocated blocks"),
    ("active", False, "active blocks"),
    ("inactive_split", False, "free blocks inside split segments"),
)
MAX_SITES = 12


def _counter_rows(torch_stats: dict[str, int]) -> list[Row]:
    rows = []
    for name, is_bytes, help_text in COUNTERS:
        vals = [torch_stats[f"{name}.{pool}.current"] for pool in POOLS]
        rows.append(Row(name, [format_bytes(value) if is_bytes else f"{value:,}" for value in vals], help_text))
    return rows


def _fragmentation_rows(device_stats: DeviceStats) -> list[Row]:
    by_pool = device_stats.fragmentation
    spec: list[tuple[str, Any, str]] = [
        (
            "fragmentation (stranded share)",
            lambda frag: format_percent(frag.stranded_share),
            "stranded bytes / reserved bytes: the part of reserved memory lost to holes",
        ),
        (
            "stranded",
            lambda frag: format_bytes(frag.stranded_bytes),
            "free holes inside segments that still hold live tensors: only a request that fits a hole can "
            "use them, and empty_cache() cannot return them",
        ),
        (
            "cached, releasable",
            lambda frag: format_bytes(frag.cached_releasable_bytes),
            "whole free segments (or pages): reusable by any request; empty_cache() gives them back to CUDA",
        ),
        (
            "free in reserved",
            lambda frag: format_bytes(frag.free_bytes),
            "all cached free blocks: stranded + releasable",
        ),
        ("free blocks", lambda frag: f"{frag.free_blocks:,}", ""),
        (
            "largest free block",
            lambda frag: format_bytes(frag.largest_free_block_bytes),
            "the largest request the cache can serve without a new segment",
        ),
        (
            "external fragmentation",
            lambda frag: format_percent(frag.external_fragmentation),
            "1 − largest free block / free bytes: 0% one hole, near 100% many small holes",
        ),
        (
            "internal waste",
            lambda frag: format_bytes(frag.internal_waste_bytes),
            "rounding: block size − requested size of allocated blocks",
        ),
    ]
    return [Row(name, [cell(by_pool[pool]) for pool in POOLS], help_text) for name, cell, help_text in spec]


def _cards(device_stats: DeviceStats, timeline: Timeline | None) -> list[Card]:
    torch_stats = device_stats.torch_stats
    frag = device_stats.fragmentation["all"]
    free = frag.free_bytes
    cards = [
        Card(
            "reserved", format_bytes(torch_stats["reserved_bytes.all.current"]), "held from CUDA by PyTorch's allocator"
        ),
        Card(
            "allocated",
            format_bytes(torch_stats["allocated_bytes.all.current"]),
            "in blocks of live tensors at the dump",
        ),
        Card("free in reserved", format_bytes(free), "cached, reusable by PyTorch, not by other processes"),
        Card(
            "fragmentation",
            format_percent(frag.stranded_share),
            f"of reserved memory stranded in holes beside live tensors ({format_bytes(frag.stranded_bytes)}); "
            f"{format_bytes(frag.cached_releasable_bytes)} more is cached and releasable",
        ),
    ]
    if timeline is not None:
        cards.append(
            Card(
                "peak requested",
                format_bytes(timeline.peak_requested_bytes),
                "largest requested total during the trace",
            )
        )
        cards.append(
            Card("peak reserved", format_bytes(timeline.peak_reserved_bytes), "largest reserved total during the trace")
        )
    if device_stats.private_pool_reserved_bytes:
        cards.append(
            Card(
                "CUDA-graph pools", format_bytes(device_stats.private_pool_reserved_bytes), "reserved by private pools"
            )
        )
    return cards


def _site_views(frames: SnapshotFrames, sites: list[Any]) -> list[SiteView]:
    fulls = [frames.stack(site.stack_id) for site in sites]
    return [
        SiteView(site=site, stack=shown, full_stack=[{**frame, "kind": "frame"} for frame in full])
        for site, full, shown in zip(sites, fulls, without_internals(fulls, with_kind=True), strict=True)
    ]


CATEGORY_HELP = {
    "parameter": "model weights, or this rank's shards of them (FSDP, tensor parallel)",
    "gradient": "parameter gradients (made in backward and kept past it), or their shards",
    "optimizer_state": "allocated inside torch.optim (e.g. Adam's moments)",
    "activation": "allocated in forward or backward (saved activations, temporaries, workspaces)",
    "kv_cache": "an inference KV cache (transformers' cache classes, vLLM blocks, a growing cache)",
    "inflight_activation": "activations a pipeline stage keeps for microbatches whose backward has not run",
    "fsdp_unsharded_params": "FSDP's all-gathered (unsharded) parameters, alive until the unit reshards",
    "comm_buffer": "buffers of collectives: FSDP all-gather/reduce-scatter, tensor-parallel and pipeline transfers",
    "ddp_bucket": "DistributedDataParallel's gradient buckets",
    "cuda_graph_pool": "private pools a CUDA graph made or allocated in",
    "private_pool": "a private memory pool (torch.cuda.MemPool, a shared graph pool) whose owner is unknown",
    "unknown": "older than the trace, and nothing in the file says what it holds",
    "other": "everything else, including blocks with no recorded stack",
}


def _category_rows(cats: CategoryBreakdown) -> list[Row]:
    """One row per category with blocks at the dump: the built-in ones, then the user's (the
    breakdown's own order)."""
    total = sum(cats.live_bytes.values()) or 1
    return [
        Row(
            category,
            [
                format_bytes(cats.live_bytes[category]),
                f"{cats.live_blocks[category]:,}",
                format_percent(cats.live_bytes[category] / total),
            ],
            _category_help(category, cats.live_requested_by_rule.get(category, {})),
        )
        for category in cats.live_bytes
        if cats.live_blocks[category]
    ]


def _shown_categories(
    frames: SnapshotFrames, dev: int, builtin: CategoryBreakdown, rules: CategoryRules | None
) -> CategoryBreakdown:
    """The categories the table shows: the built-in ones, or the user's rules first (the figure reads
    them one at a time, :func:`_trace_views`)."""
    return builtin if rules is None else compute_categories(frames, dev, with_timeline=False, rules=rules)


def _category_help(category: str, by_rule: dict[str, int]) -> str:
    """What a category holds (a user's category: the rules that labelled it), and which rules
    labelled its bytes when they are not its own stack's built-in rule."""
    yours = {rule.removeprefix(USER_RULE_PREFIX): n for rule, n in by_rule.items() if rule.startswith(USER_RULE_PREFIX)}
    if category not in CATEGORY_HELP:
        return "your category, labelled by your rule " + ", ".join(yours) if yours else "your category"
    return CATEGORY_HELP[category] + _labelled_by(by_rule) + _by_your_rules(yours)


def _by_your_rules(yours: dict[str, int]) -> str:
    """The bytes of a built-in category that the user's rules forced into it."""
    if not yours:
        return ""
    parts = [f"{format_bytes(nbytes)} by your rule {rule}" for rule, nbytes in yours.items()]
    return ". Labelled " + "; ".join(parts)


def _labelled_by(by_rule: dict[str, int]) -> str:
    """Which rules labelled a category's bytes, the inferred ones said to be inferred."""
    inferred = {rule: nbytes for rule, nbytes in by_rule.items() if rule in INFERRED_RULES and nbytes}
    if not inferred:
        return ""
    parts = [
        f"{format_bytes(nbytes)} {RULE_HELP[rule]}"
        for rule, nbytes in sorted(inferred.items(), key=lambda item: -item[1])
    ]
    return ". Inferred, not from the allocation's own stack: " + "; ".join(parts)


def _whatif_view(whatif: WhatIf | None) -> dict[str, Any] | None:
    return None if whatif is None else whatif_view(whatif)


def _leak_view(frames: SnapshotFrames, leaks: LeakAnalysis) -> dict[str, Any]:
    return {
        "analysis": leaks,
        "suspects": [{"s": suspect, "stack": display_stack(suspect.frames)} for suspect in leaks.suspects],
    }


DRAWN = "snapshot_lab.plots.drawn"  # the module that draws the figures (matplotlib with it)


def _drawn() -> Any:
    """:data:`DRAWN`, imported where a figure is drawn (matplotlib with it): a report whose
    figures are drawn by the worker never imports matplotlib here."""
    return importlib.import_module(DRAWN)


class _Figures:
    """The sections' figures, each asked of a :class:`~.aside.Worker` (a process that imported
    matplotlib while the snapshot was read: :func:`~snapshot_lab.api.report` starts it first) as
    soon as what it draws is known, and set on its section when :meth:`resolve` collects them:
    the same bytes as drawn here (issue #23: matplotlib's import and drawing were a third of a
    1M-entry report's wall time, with a CPU idle)."""

    def __init__(self, worker: Worker | None = None) -> None:
        self._own = worker is None  # started here, so let go here once its figures are in
        self._worker = worker or Worker(DRAWN)
        self._asked: list[tuple[DeviceSection, str, int]] = []

    def later(self, section: DeviceSection, field: str, *args: Any) -> None:
        """``section.field`` is what :mod:`.plots.drawn`'s function of that name draws of ``args``."""
        self.attach(section, self.ask(field, *args))

    def ask(self, field: str, *args: Any) -> tuple[str, int]:
        """:meth:`later` for a section not made yet: the figure asked now, set by :meth:`attach`."""
        return field, self._worker.submit(field, *args)

    def attach(self, section: DeviceSection, asked: tuple[str, int]) -> None:
        self._asked.append((section, *asked))

    def resolve(self) -> None:
        for section, field, job in self._asked:
            setattr(section, field, self._worker.result(job))
        self._asked.clear()
        if self._own:
            self._worker.close()


@dataclass
class _DumpFigures:
    """A device's figures of the dump (or of its OOM's moment), asked of the drawing worker
    before the analyses, which it draws meanwhile (half of a 1M-entry report's drawing time)."""

    at_oom: Moment | None  # the OOM's moment where the snapshot was dumped after the stack unwound
    layouts: list[PoolLayout]
    histogram: tuple[str, int]
    layout: tuple[str, int]


def _dump_figures(frames: SnapshotFrames, stats: SnapshotStats, figures: _Figures) -> dict[int, _DumpFigures]:
    """Every device's :class:`_DumpFigures`, asked of ``figures`` now."""
    out = {}
    for dev, device_stats in stats.devices.items():
        moment = oom_moment(frames, dev) if device_stats.oom is not None else None
        at_oom = moment if moment is not None and not moment.at_dump else None
        if at_oom is not None:
            shown_seg, shown_blk = at_oom.segments, at_oom.blocks
            frag = compute_fragmentation(shown_seg, shown_blk)
        else:
            shown_seg = frames.segments[frames.segments["device"] == dev]
            shown_blk = frames.blocks[frames.blocks["device"] == dev]
            frag = device_stats.fragmentation
        layouts = select_layout(shown_seg, shown_blk)
        oom_req = device_stats.oom.requested_bytes if device_stats.oom else None
        histogram = figures.ask("histogram_svg", frag, oom_req)
        out[dev] = _DumpFigures(at_oom, layouts, histogram, figures.ask("layout_png", layouts))
    return out


def _device_section(
    frames: SnapshotFrames,
    stats: SnapshotStats,
    dev: int,
    timeline: Timeline | None,
    cats: CategoryBreakdown,
    leaks: LeakAnalysis,
    lifetimes: pd.DataFrame,
    whatif: WhatIf | None,
    exploration: Exploration | None,
    figures: _Figures,
    dumped: _DumpFigures,
    rules: CategoryRules | None = None,
) -> DeviceSection:
    """One device's section: what the dump shows (its figures asked as ``dumped``), the moment
    of its OOM, then what the trace shows (its figures, once ``figures`` resolves; the
    explorer's data ``exploration``, which a device has where it has a timeline; categories by
    ``rules`` first)."""
    device_stats = stats.devices[dev]
    at_oom = dumped.at_oom
    section = _dump_section(frames, device_stats, dev, timeline, cats, leaks, whatif, dumped, figures)
    if stats.parallel and stats.parallel.get("strategies"):
        section.parallel = str(stats.parallel["description"])
    if at_oom is not None:
        _show_oom_moment(section, frames, at_oom)
    if timeline is None or exploration is None:
        _without_trace(section, frames, stats, dev, cats, figures)
    else:
        _trace_views(section, frames, device_stats, dev, timeline, lifetimes, figures, rules, exploration)
    return section


def _dump_section(
    frames: SnapshotFrames,
    device_stats: DeviceStats,
    dev: int,
    timeline: Timeline | None,
    cats: CategoryBreakdown,
    leaks: LeakAnalysis,
    whatif: WhatIf | None,
    dumped: _DumpFigures,
    figures: _Figures,
) -> DeviceSection:
    """The counters, layout, histogram, sites and categories (of the OOM's moment where the
    snapshot was dumped after the stack unwound)."""
    blk = frames.blocks[frames.blocks["device"] == dev]
    layouts = dumped.layouts
    hidden = sum(layout.hidden_segments for layout in layouts)
    layout_note = (
        "Each bar is one segment (a cudaMalloc'd or mapped range), largest first, all to one scale (the "
        "largest segment spans the width); blocks are coloured by state; segments alike (the same size and blocks) "
        "are one bar marked ×N." + (f" {hidden} smaller segments are summarised in the panel titles." if hidden else "")
    )
    section = DeviceSection(
        device=dev,
        cards=_cards(device_stats, timeline),
        counter_rows=_counter_rows(device_stats.torch_stats),
        fragmentation_rows=_fragmentation_rows(device_stats),
        histogram_svg="",
        layout_png="",
        layout_note=layout_note,
        live_sites=_site_views(
            frames, live_sites(blk, snapshot_sites(frames), MAX_SITES, categorize(frames).block_category[blk.index])
        ),
        oom=device_stats.oom,
        oom_stack=display_stack(frames.stack(device_stats.oom.stack_id)) if device_stats.oom else [],
        category_rows=_category_rows(cats),
        leaks=_leak_view(frames, leaks),
        whatif=_whatif_view(whatif),
        kv_cache_note=_kv_cache_note(device_stats.kv_cache_growth),
    )
    figures.attach(section, dumped.histogram)
    figures.attach(section, dumped.layout)
    section.layout_data = layout_data(layouts)
    return section


def _show_oom_moment(section: DeviceSection, frames: SnapshotFrames, moment: Moment) -> None:
    section.layout_title = "Block layout at the OOM"
    section.histogram_title = "Free (cached) blocks by size at the OOM."
    section.oom_moment_note = (
        f"This snapshot was dumped after the OOM, once the stack had unwound and freed what the failing step "
        f"held. The explanation above, the free-block histogram, the block layout and the sites live at the "
        f"OOM are those of the moment of the OOM, {moment.description}; the counters and the other tables "
        "are those of the dump."
    )
    section.oom_sites = _site_views(frames, live_sites(moment.blocks, snapshot_sites(frames), MAX_SITES))


def _chart(section: DeviceSection, figures: _Figures) -> None:
    """The first screen's chart of what the section's composition is made of, drawn as the
    section's figures are."""
    if section.composition is not None:
        figures.later(section, "composition_svg", section.composition)


def _without_trace(
    section: DeviceSection,
    frames: SnapshotFrames,
    stats: SnapshotStats,
    dev: int,
    cats: CategoryBreakdown,
    figures: _Figures,
) -> None:
    blk = frames.blocks[frames.blocks["device"] == dev]
    dump_sites = live_sites(blk, snapshot_sites(frames), MAX_SITES, categorize(frames).block_category[blk.index])
    section.composition = compose("dump", pd.Series(cats.live_bytes), dump_sites)
    _chart(section, figures)
    section.timeline_missing = (
        "No timeline: this snapshot was recorded with enabled='state' (no event history)."
        if stats.recording.mode == "state"
        else "No timeline: the trace of this device is empty."
    )


def _timeline_notes(timeline: Timeline) -> list[str]:
    notes = [
        "Blue: bytes requested by live tensors; grey: bytes reserved from CUDA. Both are exact sums of the "
        "trace's events.",
    ]
    if timeline.anchored_at_end:
        notes.append(
            "The trace does not reach back to the start of the job (ring buffer wrapped or recording started "
            "late): levels are anchored at the dump, where the snapshot gives them exactly."
        )
    if timeline.markers:
        notes.append(f"Dashed lines: starts of '{timeline.marker_group}' from the recorded annotations.")
    return notes


def _trace_views(
    section: DeviceSection,
    frames: SnapshotFrames,
    device_stats: DeviceStats,
    dev: int,
    timeline: Timeline,
    lifetimes: pd.DataFrame,
    figures: _Figures,
    rules: CategoryRules | None,
    exploration: Exploration,
) -> None:
    """The timeline, the explorer's data ``exploration`` and what was alive at the peak (the
    figures first, drawn beside the rest)."""
    figures.later(section, "timeline_png", timeline_view(timeline))
    levels = category_levels(frames, dev, rules)  # one category at a time, not the whole table kept
    if levels is not None and levels.n_events == timeline.n_events:
        figures.later(section, "category_png", category_view(levels, timeline.x, timeline.x_label))
    alive = alive_at(lifetimes, timeline.peak_index)
    codes = categorize(frames).alloc_codes[dev][alive.index.to_numpy()]
    alive_cats = pd.Series(np.array(CATEGORIES, dtype=object)[codes], index=alive.index)
    fwd = allocation_forward_ids(frames, dev, alive["event_index"].to_numpy(dtype=np.int64))
    peak_sites = top_sites(alive["stack_id"], alive["size_bytes"], snapshot_sites(frames), MAX_SITES, alive_cats, fwd)
    section.peak_sites = _site_views(frames, peak_sites)
    # the categories at the peak include memory older than the trace (weights of an inference
    # recorded after loading, a mid-run recording's gradients) where the stats could tell them
    by_category = (
        pd.Series(device_stats.categories_at_peak)
        if device_stats.categories_at_peak is not None
        else alive["size_bytes"].groupby(alive_cats).sum()
    )
    section.composition = compose("peak", by_category, peak_sites, device_stats.modules, timeline.peak_index)
    _chart(section, figures)
    section.exploration = exploration
    section.timeline_notes = _timeline_notes(timeline)
    section.peak_note = (
        f"Allocations alive at the peak ({format_bytes(timeline.peak_requested_bytes)} requested, event "
        f"{timeline.peak_index:,}), by requested bytes."
        + ("" if not timeline.anchored_at_end else " Allocations made before the trace began are not included.")
    )
    if device_stats.modules is not None and device_stats.modules.source != "none":
        section.modules = _module_view(device_stats.modules)


def _kv_cache_note(growth: KvCacheGrowth | None) -> str:
    if growth is None or not growth.steps:
        return ""
    return (
        f"KV cache: {format_bytes(growth.bytes_at_end)} at the end of {growth.steps} decode steps, growing by "
        f"{format_bytes(growth.bytes_per_step)} per step ({format_bytes(growth.bytes_after_first_step)} after "
        "the first forward, the prompt's)."
    )


MODULE_ROWS = 40
# rows below half a percent of the peak are left out of the table (still in the totals)
MODULE_MIN_SHARE = 0.005


def _module_view(modules: ModuleBreakdown) -> dict[str, Any]:
    """The by-module table: for tags, the module tree depth first, children by bytes (a row only
    when it holds at least MODULE_MIN_SHARE of the peak); from stacks, the forward lines by bytes."""
    floor = modules.peak_bytes * MODULE_MIN_SHARE
    if modules.source == "tags":
        by_name = {row.module: row for row in modules.rows}
        children: dict[str | None, list[ModuleRow]] = {}
        for row in modules.rows:
            parent = parent_fqn(row.module) if not row.module.startswith("metadata ") else None
            while parent is not None and parent not in by_name:
                parent = parent_fqn(parent)
            children.setdefault(parent, []).append(row)
        ordered: list[tuple[ModuleRow, int]] = []

        def walk(parent: str | None, depth: int) -> None:
            for row in sorted(children.get(parent, []), key=lambda row: (-row.inclusive_bytes, row.module)):
                if row.inclusive_bytes >= floor and len(ordered) < MODULE_ROWS:
                    ordered.append((row, depth))
                    walk(row.module, depth + 1)

        walk(None, 0)
    else:
        ordered = [
            (row, 0) for row in sorted(modules.rows, key=lambda row: -row.self_bytes) if row.self_bytes >= floor
        ][:MODULE_ROWS]
    rows = [
        {
            "label": row.label,
            "depth": depth,
            "self": row.self_bytes,
            "inclusive": row.inclusive_bytes,
            "fwd": row.by_phase.get("fwd", 0),
            "bwd": row.by_phase.get("bwd", 0),
            "rec": row.by_phase.get("rec", 0),
            "peak": row.peak_bytes,
            "categories": ", ".join(
                f"{category} {format_bytes(nbytes)}"
                for category, nbytes in sorted(row.by_category.items(), key=lambda item: -item[1])[:3]
            ),
        }
        for row, depth in ordered
    ]
    shown = len(rows)
    return {
        "exact": modules.source == "tags",
        "note": modules.note,
        "rows": rows,
        "hidden": len(modules.rows) - shown,
        "peak": modules.peak_bytes,
        "peak_index": modules.peak_index,
        "modules": modules.module_bytes,
        "outside": modules.outside_bytes,
        "before": modules.before_trace_bytes,
        "phases": modules.phase_totals,
        "min_share_pct": f"{MODULE_MIN_SHARE * 100:g}",
    }


def _meta_rows(frames: SnapshotFrames, stats: SnapshotStats) -> list[tuple[str, str]]:
    file_info = stats.file
    rec = stats.recording
    rows = [
        ("file", file_info["path"]),
        (
            "size",
            f"{format_bytes(file_info['file_size_bytes'])}"
            + (f", {file_info['compression']}-compressed" if file_info["compression"] else ""),
        ),
        (
            "encoding",
            f"{file_info['encoding']}"
            + (f", protocol {file_info['pickle_protocol']}" if file_info["pickle_protocol"] else ""),
        ),
        (
            "format",
            ", ".join(file_info["format_hints"])
            or (f"legacy {file_info['legacy_format']}" if file_info["legacy_format"] else "not recognised"),
        ),
        ("devices", ", ".join(str(device) for device in file_info["devices"]) or "none"),
        ("segments / blocks", f"{file_info['segments']:,} / {file_info['blocks']:,}"),
        ("trace entries", f"{file_info['trace_entries']:,}"),
        (
            "recording",
            {
                "trace": "allocation history (trace) + state",
                "state": "state only (no history)",
                "none": "nothing recorded",
            }[rec.mode],
        ),
        ("stacks", {"python": "Python", "python+cpp": "Python + C++", "none": "none recorded"}[rec.stacks]),
    ]
    if stats.parallel:
        layout = stats.parallel
        degrees = ", ".join(
            f"{dim} {degree}" for dim, degree in (layout.get("degrees") or {}).items() if degree and degree > 1
        )
        seen = "stacks" if layout.get("from_stacks") else ""
        seen += (" and " if seen and layout.get("from_sidecar") else "") + (
            "capture sidecar" if layout.get("from_sidecar") else ""
        )
        rows.append(
            (
                "parallel training",
                str(layout["description"])
                + (f"; degrees: {degrees}" if degrees else "")
                + (f" (from the {seen})" if seen else ""),
            )
        )
    cap = file_info.get("capture")
    if cap:
        rows.append(
            (
                "captured by snaplab",
                f"rank {cap.get('rank', '?')} of {cap.get('world_size', '?')} on {cap.get('host', '?')}, "
                f"torch {cap.get('torch_version', '?')}, {cap.get('reason', '?')} at step {cap.get('step', '?')}",
            )
        )
        if cap.get("argv"):
            rows.append(("command", " ".join(str(arg) for arg in cap["argv"])))
    for device in rec.devices:
        if rec.mode == "trace":
            complete = (
                "complete from the first allocation"
                if device.history_complete
                else (
                    f"starts mid-run: {device.orphan_frees} frees without their allocation, "
                    f"{format_bytes(device.live_bytes_before_trace)} live from before the trace"
                )
            )
            span = ""
            if device.first_time_us is not None and device.last_time_us is not None:
                span = f", {(device.last_time_us - device.first_time_us) / 1e6:.3f} s"
            rows.append((f"trace of device {device.device}", f"{device.events:,} events{span}; history {complete}"))
    return rows


def _settings_rows(frames: SnapshotFrames) -> list[tuple[str, str]]:
    settings = frames.info.allocator_settings or {}
    rows = []
    for key, value in settings.items():
        if key == "roundup_power2_divisions" and isinstance(value, dict):
            nonzero = {size: divisions for size, divisions in value.items() if divisions}
            value = ", ".join(f"{size}: {divisions}" for size, divisions in nonzero.items()) or "off"
        elif key == "max_split_size" and value == -1:
            value = "unlimited (-1)"
        rows.append((str(key), str(value) if value != "" else "''"))
    return rows


def _recorded_line(frames: SnapshotFrames, stats: SnapshotStats) -> str:
    """One line for the header: what was recorded and under which allocator settings."""
    rec = stats.recording
    file_info = stats.file
    parts = [
        f"{format_bytes(file_info['file_size_bytes'])} file",
        f"device{'s' if len(file_info['devices']) != 1 else ''} {', '.join(map(str, file_info['devices'])) or 'none'}",
        {"trace": "allocation history + state", "state": "state only (no history)", "none": "nothing recorded"}[
            rec.mode
        ],
        {"python": "Python stacks", "python+cpp": "Python + C++ stacks", "none": "no stacks"}[rec.stacks],
    ]
    if rec.mode == "trace":
        parts.append(
            "history complete"
            if rec.history_complete
            else f"early history missing ({rec.window_cause or 'recording started late or the ring buffer wrapped'})"
        )
    cap = file_info.get("capture")
    if stats.parallel and stats.parallel.get("strategies"):
        parts.append(str(stats.parallel["description"]))
    elif cap:
        parts.append(f"rank {cap.get('rank', '?')}/{cap.get('world_size', '?')}")
    if cap:
        parts.append(f"torch {cap.get('torch_version', '?')}")
    conf = (frames.info.allocator_settings or {}).get("PYTORCH_CUDA_ALLOC_CONF")
    parts.append(f"PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else "default allocator settings")
    return " · ".join(parts)


def _headline(stats: SnapshotStats, findings: list[Any]) -> str:
    torch_stats = stats.torch_stats
    text = (
        f"{format_bytes(torch_stats['reserved_bytes.all.current'])} reserved, "
        f"{format_bytes(torch_stats['allocated_bytes.all.current'])} allocated"
        f" on {len(stats.devices)} device{'s' if len(stats.devices) != 1 else ''}."
    )
    crit = [finding for finding in findings if finding.severity == "critical"]
    if crit:
        text += " " + crit[0].title + "."
    return text


REPORT_FORMATS = ("html", "md", "png")
FIT_HOW = (
    "Predicted by snaplab fit from the step this trace recorded, replayed through the allocator model; "
    "`snaplab fit SNAP --memory-limit SIZE --batch N` gives every lever, its assumption, and batches "
    "in samples."
)


FIT_REFUSED = "What would make it fit: snaplab fit cannot size the whole step from this trace"


def fit_summary(
    frames: SnapshotFrames, *, recorded_batch: int | None = None, memory_limit: int | None = None
) -> FitSummary | None:
    """``snaplab fit``'s answer for the first screen, of the device that ran out of memory (else
    fit's device), under ``memory_limit`` (else the limit the run ran out of, else the device's
    capacity), in samples where the recorded batch is known (``recorded_batch``, else the capture
    sidecar's); None when the trace shows no step to build on."""
    batch = recorded_batch if recorded_batch is not None else sidecar_batch_size(frames.info.capture)
    try:
        result = compute_fit(
            frames,
            levers=HEADLINE_LEVERS,
            memory_limit=memory_limit,
            recorded_batch=batch,
            device=_failing_device(frames),
            parallel=False,
            keep_structure=False,  # dropped after fit's evidence: the OOM plan (_would_it_fit) builds one if needed
            # the levers in turn (not aside.spread): at once, their tapes took the report of a
            # 10M-entry window from 2.1 to 3.0 GiB of memory, for 0.2 s of 9 at 5M entries
        )
    except FitUnsupportedOom as why:
        return FitSummary(verdict=FIT_REFUSED, steps=(_sentence(str(why)),), last=True)
    except (FitUnsupported, ValueError):
        return None
    ranges = batch_range_note(result)
    samples = samples_note(result)
    steps = (*([ranges] if ranges else []), *map(_sentence, result.notes), *([samples] if samples else []), FIT_HOW)
    # a request no step made, larger than the limit: the OOM finding's advice comes first
    verdict = fit_headline(result, range_note=False)
    several = len(frames.info.devices) > 1
    return FitSummary(
        verdict=verdict,
        steps=steps,
        last=result.oom_request_over_limit is not None,
        answer=answer_sentence(result, several) or "",
    )


def _failing_device(frames: SnapshotFrames) -> int | None:
    """The device of the last out-of-memory error in the trace (None: none, fit picks the device)."""
    events = frames.events
    if not len(events):
        return None
    ooms = events.loc[events["action"] == "oom", "device"]
    return int(ooms.iloc[-1]) if len(ooms) else None


def _sentence(note: str) -> str:
    note = note.strip()
    return note[:1].upper() + note[1:] + ("" if note.endswith(".") else ".")


def build_report(
    frames: SnapshotFrames,
    stats: SnapshotStats,
    progress: ProgressSink | None = None,
    fit_answer: FitSummary | Aside[FitSummary | None] | None = None,
    format: str = "html",
    whatifs: Callable[[], dict[int, WhatIf]] | None = None,
    drawer: Worker | None = None,
    category_rules: CategoryRules | None = None,
) -> str | bytes:
    """The whole report for one snapshot: an HTML page (``format="html"``), GitHub-flavoured
    Markdown for a ticket (``"md"``) or the first screen as a PNG image (``"png"``, bytes);
    ``fit_answer`` (what ``snaplab fit`` concluded, or the :class:`Aside` computing it) leads the
    levers when given; ``whatifs``, the what-if replays when they are computed elsewhere
    (:func:`~snapshot_lab.metrics.diagnose.diagnose`); ``drawer``, the worker that draws the
    figures (:data:`DRAWN`), started before the snapshot was read (else one is started here);
    ``category_rules``, the user's categories for the category table and figure (the rest of the
    report reads the built-in ones)."""
    if format not in REPORT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(REPORT_FORMATS)}, not {format!r}")
    if fit_answer is None:
        fit_answer = fit_summary(frames)
    ctx = build_report_context(frames, stats, progress, fit_answer, whatifs, drawer, category_rules)
    if format == "md":
        return render_markdown(ctx)
    if format == "png":
        return _first_screen_png(ctx)
    return render_report(ctx)


def _first_screen_png(ctx: ReportContext) -> bytes:
    first, source = ctx.first, ctx.source
    provenance = f"snaplab {ctx.version} · {ctx.file_name}"
    if source is not None and source.size_bytes:
        provenance += f", {format_bytes(source.size_bytes)}, sha256 {source.sha256_prefix}…"
    if first is None:
        return _drawn().first_screen_png(provenance, "ok", ctx.headline, "", [], [], None)
    comp = next((section.composition for section in ctx.devices if section.composition is not None), None)
    levers = [
        (lever.title + (f" (at stake: {lever.stake})" if lever.stake else ""), lever.detail) for lever in first.levers
    ]
    return _drawn().first_screen_png(  # type: ignore[no-any-return]
        provenance,
        first.status,
        first.verdict,
        first.cause,
        [(f"{label}", value) for label, value in first.made_of] + [("", line) for line in first.others],
        levers,
        comp,
        first.made_of_title,
    )


def build_report_context(
    frames: SnapshotFrames,
    stats: SnapshotStats,
    progress: ProgressSink | None = None,
    fit_answer: FitSummary | Aside[FitSummary | None] | None = None,
    whatifs: Callable[[], dict[int, WhatIf]] | None = None,
    drawer: Worker | None = None,
    category_rules: CategoryRules | None = None,
) -> ReportContext:
    """Everything every format of the report shows, computed once (the figures by ``drawer``);
    the category table and figure by ``category_rules`` first when given."""
    progress = progress or NullProgress()
    figures = _Figures(drawer)  # (its worker, when none was given, forked before the thread below)
    # the file's digest by a thread that reads and hashes it (outside the interpreter's lock)
    # while this one goes on: about a second of a 10M-entry report's wall time otherwise
    source = Beside(lambda: _source_file(frames))
    progress.stage("Analysing")
    dumped = _dump_figures(frames, stats, figures)
    # the explorer's data first: computed here while the what-if replays, which the findings
    # wait for, finish in their own child (api._report_content)
    explorations = _explorations(frames, stats, category_rules)
    diagnosis = diagnose(frames, stats, with_category_timelines=False, whatifs=whatifs)
    timelines, findings = diagnosis.timelines, diagnosis.findings
    progress.stage("Plotting")
    sections = []
    for dev in stats.devices:
        sections.append(
            _device_section(
                frames,
                stats,
                dev,
                timelines[dev],
                _shown_categories(frames, dev, diagnosis.categories[dev], category_rules),
                diagnosis.leaks[dev],
                diagnosis.lifetimes[dev],
                diagnosis.whatifs.get(dev),
                explorations.get(dev),
                figures,
                dumped[dev],
                category_rules,
            )
        )
    _would_it_fit(frames, stats, sections)
    if isinstance(fit_answer, Aside):
        fit_answer = fit_answer.result()
    payload = _payload(frames, sections, stats.annotations or [])
    figures.resolve()  # the first screen's chart is one of them
    first = _first_screen(stats, findings, sections, fit_answer)
    progress.stage("Rendering")
    ctx = ReportContext(
        file_name=str(frames.info.source.path).replace("\\", "/").split("/")[-1],
        recorded=_recorded_line(frames, stats),
        headline=_headline(stats, findings),
        findings=findings,
        devices=sections,
        meta_rows=_meta_rows(frames, stats),
        settings_rows=_settings_rows(frames),
        version=__version__,
        first=first,
        fit_answer=fit_answer,
        source=source.result(),
        explorer_json=payload.to_json(),
    )
    if has_stages(frames):
        ctx.stages = stages_view(file_stages(frames, category_rules))
    if stats.annotations:
        show_annotations(ctx, stats.annotations)
    ctx.host = host_view(stats)
    if len(sections) > 1:
        _compare_devices(ctx, stats, timelines)
    return ctx


def _compare_devices(ctx: ReportContext, stats: SnapshotStats, timelines: dict[int, Timeline | None]) -> None:
    """The devices side by side: a row each and their chart."""
    rows = []
    for dev, device_stats in stats.devices.items():
        timeline = timelines[dev]
        rows.append(
            {
                "device": dev,
                "reserved": device_stats.torch_stats["reserved_bytes.all.current"],
                "allocated": device_stats.torch_stats["allocated_bytes.all.current"],
                "free": device_stats.fragmentation["all"].free_bytes,
                "frag": device_stats.fragmentation["all"].stranded_share,
                "peak": timeline.peak_requested_bytes if timeline else None,
            }
        )
    ctx.compare_rows = rows
    ctx.compare_svg = _drawn().device_comparison_svg(pd.DataFrame(rows))


def _explorations(frames: SnapshotFrames, stats: SnapshotStats, rules: CategoryRules | None) -> dict[int, Exploration]:
    """The explorer's data of every device with a trace (categories by ``rules`` first)."""
    timelines = device_timelines(frames, stats)
    return {dev: explore(frames, tl, rules=rules) for dev, tl in timelines.items() if tl is not None}


def _payload(frames: SnapshotFrames, sections: list[DeviceSection], annotated: list[AnnotatedAllocation]) -> Payload:
    """The explorer's data for every device, with the stacks it refers to (display frames only)
    and, for a file with annotations, the annotations of its listed allocations."""
    payload = Payload()
    for section in sections:
        data: dict[str, Any] = {"device": section.device, "segments": section.layout_data}
        data["layoutNote"] = (
            "Each bar is one segment, all to one scale (the widest is the largest); click one for its blocks "
            "and the stacks that allocated them."
        )
        stack_ids = [block[3] for seg in section.layout_data for block in seg["blocks"]]
        if section.exploration is not None:
            data.update(timeline_data(section.exploration))
            stack_ids += section.exploration.allocations["stack_id"].tolist()
            if notes := allocation_notes(section.exploration, annotated):
                data["allocs"]["notes"] = notes
        shown = [sid for sid in sorted(set(stack_ids)) if sid >= 0]
        stacks = without_internals([frames.stack(sid) for sid in shown], with_kind=True)
        for sid, stack in zip(shown, stacks, strict=True):
            payload.add_stack(sid, stack)
        payload.devices.append(data)
    return payload


def _source_file(frames: SnapshotFrames) -> SourceFile:
    """Which file the report came from: name, size and the start of its sha256."""
    path = Path(str(frames.info.source.path))
    digest = hashlib.sha256()
    try:
        with path.open("rb") as stream:
            for chunk in iter(lambda: stream.read(8 << 20), b""):
                digest.update(chunk)
        size, prefix = path.stat().st_size, digest.hexdigest()[:12]
    except OSError:
        size, prefix = 0, ""
    return SourceFile(path.name, size, prefix, __version__)


def _first_screen(
    stats: SnapshotStats, findings: list[Any], sections: list[DeviceSection], fit: FitSummary | None
) -> FirstScreen | None:
    """The answer at the top: the device that failed (else the one with the largest peak) in full,
    one line for each other device."""
    with_comp = [section for section in sections if section.composition is not None]
    if not with_comp:
        return None
    ooms = {dev: device_stats.oom for dev, device_stats in stats.devices.items() if device_stats.oom is not None}
    main = next((section for section in with_comp if section.device in ooms), None) or max(
        with_comp, key=lambda section: section.composition.total_bytes if section.composition else 0
    )
    comp = main.composition
    assert comp is not None
    where = "at the peak" if comp.moment == "peak" else "at the dump"
    frag = stats.devices[main.device].fragmentation["all"]
    peak = (
        f"{format_bytes(comp.total_bytes)} requested {where}; {format_bytes(frag.reserved_bytes)} reserved at the "
        f"dump, {format_percent(frag.stranded_share)} of it stranded in holes beside live tensors "
        f"({format_bytes(frag.stranded_bytes)})."
    )
    status, said, cause = verdict(ooms, findings, peak, comp.moment == "peak")
    plans = [plan for section in sections for plan in section.would_it_fit]
    dev = f" on device {main.device}" if len(sections) > 1 else ""
    return FirstScreen(
        status=status,
        verdict=said,
        cause=cause,
        made_of=made_of(comp),
        made_of_title=f"{format_bytes(comp.total_bytes)} requested {where}{dev}",
        levers=levers(findings, plans, fit),
        chart_svg=main.composition_svg,  # drawn with its section's figures (_chart)
        others=[
            f"Device {section.device}: {format_bytes(section.composition.total_bytes)} {where}; "
            + made_of(section.composition)[0][1]
            for section in with_comp
            if section is not main and section.composition is not None
        ],
        fit_answer=fit,
        answer=fit.answer if fit is not None and fit.answer and not fit.last else said,
        method=(fit.verdict, *fit.steps) if fit is not None and fit.answer and not fit.last else (),
    )


def _would_it_fit(frames: SnapshotFrames, stats: SnapshotStats, sections: list[DeviceSection]) -> None:
    """For a device that ran out of memory: the plans of the layouts that shard or split the
    model (issue #15), when the trace holds a whole iteration; none where the request alone is
    more than the process could hold on the device (what it reserved and what the device had
    free): every GPU of a layout has as much memory, and no layout serves it."""
    from .metrics.plan import PlanUnsupported, would_it_fit
    from .render.plan import plan_view

    for section in sections:
        oom = stats.devices[section.device].oom
        if oom is None:
            continue
        if oom.device_free_bytes is not None and oom.requested_bytes > oom.reserved_bytes + oom.device_free_bytes:
            continue
        try:
            section.would_it_fit = [
                plan_view(fit_plan) for fit_plan in would_it_fit(frames, section.device) if fit_plan.plans
            ]
        except (PlanUnsupported, ValueError):
            section.would_it_fit = []


__all__ = ["REPORT_FORMATS", "build_report", "build_report_context"]
