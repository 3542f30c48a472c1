"""Memory categories: parameter, gradient, optimizer_state, activation, kv_cache, ddp_bucket,
cuda_graph_pool, other (and the parallel libraries' own, see :mod:`.parallel`).

One module per question: :mod:`.stacks` (what a stack says, and on which thread it was
recorded), :mod:`.gradients` (the lifetime rule that finds gradients in both stack modes),
:mod:`.pretrace` (memory older than the trace), :mod:`.assign` (one category and the rule that
gave it per allocation and per block), :mod:`.rules` (the names), :mod:`.custom` (the user's own
categories, rules on stacks tried first, for what is shown only). This module sums them up:
bytes per category at the dump, at the peak and over the trace, and which rule labelled them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from ..history.lifetimes import device_lifetimes
from .assign import Categorization, categorize
from .custom import CategoryRule, CategoryRuleError, CategoryRules
from .rules import CATEGORIES, CODES, INFERRED_RULES, RULE_HELP, RULES
from .stacks import stack_categories, stack_threads


@dataclass(frozen=True)
class CategoryBreakdown:
    device: int
    live_bytes: dict[str, int]  # allocated blocks at the dump, by category (they add up to allocated_bytes)
    live_requested_bytes: dict[str, int]  # what those blocks' tensors asked for, before rounding
    live_blocks: dict[str, int]
    # requested bytes over the trace per category (aligned with the device's event order)
    timeline: pd.DataFrame | None
    # requested bytes at the dump by category and by the rule that labelled them (see RULE_HELP)
    live_requested_by_rule: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def inferred_requested_bytes(self) -> dict[str, int]:
        """Requested bytes at the dump per category labelled by a rule other than their own
        stack (an inference: older than the trace, stackless, ...)."""
        by_rule = self.live_requested_by_rule
        return {c: sum(b for r, b in rules.items() if r in INFERRED_RULES) for c, rules in by_rule.items()}


def categorize_blocks(frames: SnapshotFrames) -> pd.Series:
    """Category of every row of ``frames.blocks`` (index aligned)."""
    return categorize(frames).block_category


@dataclass(frozen=True)
class CategoryLevels:
    """Requested bytes per category after every event of a device, one category at a time
    (:func:`category_levels`): a column of :func:`category_timeline` each, without holding them
    all (at 5M events the whole table is 400 MiB, a column 40)."""

    names: tuple[str, ...]
    n_events: int
    size: np.ndarray  # per allocation of the device's lifetimes
    code: np.ndarray  # its category's code
    made: np.ndarray  # its event, from the device's first
    freed: np.ndarray  # its free's event from the first, -1 where it outlives the trace

    def column(self, code: int) -> np.ndarray:
        """The requested bytes of category ``code`` after every event (each free counts against
        the category of the allocation it releases), anchored at zero where allocations older
        than the trace are not in it."""
        out = np.zeros(self.n_events, dtype=np.int64)
        mine = self.code == code
        out[self.made[mine]] = self.size[mine]
        gone = mine & (self.freed >= 0)
        out[self.freed[gone]] = -self.size[gone]
        np.cumsum(out, out=out)
        out -= min(int(out.min(initial=0)), 0)
        return out

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        for code, name in enumerate(self.names):
            yield name, self.column(code)


def category_levels(frames: SnapshotFrames, device: int, rules: CategoryRules | None = None) -> CategoryLevels | None:
    """:class:`CategoryLevels` of ``device`` (the user's ``rules``' categories after the built-in
    ones); None without a trace of two events or more."""
    ev = frames.device_events(device)
    if len(ev) < 2:
        return None
    lifetimes = device_lifetimes(frames, device)
    result = categorize(frames, rules)
    base = int(ev["event_index"].iloc[0])
    return CategoryLevels(
        names=tuple(result.names),
        n_events=len(ev),
        size=lifetimes["size_bytes"].to_numpy(dtype=np.int64),
        code=result.alloc_codes[device],
        made=lifetimes["event_index"].to_numpy(dtype=np.int64) - base,
        freed=np.where((at := lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)) >= 0, at - base, -1),
    )


def category_timeline(frames: SnapshotFrames, device: int, rules: CategoryRules | None = None) -> pd.DataFrame | None:
    """Requested bytes per category after every event of the device (columns = categories, the
    user's ``rules``' after the built-in ones): every column of :func:`category_levels` at once."""
    levels = category_levels(frames, device, rules)
    if levels is None:
        return None
    mat = np.empty((levels.n_events, len(levels.names)), dtype=np.int64, order="F")  # no copy into pandas
    for code, (_, column) in enumerate(levels):
        mat[:, code] = column
    return pd.DataFrame(mat, columns=list(levels.names), copy=False)


def category_levels_at(
    frames: SnapshotFrames, device: int, event_index: int, rules: CategoryRules | None = None
) -> dict[str, int]:
    """Requested bytes per category just after event ``event_index`` of ``device``: the row of
    :func:`category_timeline` at that event, from the allocations alive then, without building
    the whole timeline (``ranks`` wants one row, at the peak, of every rank's file)."""
    lifetimes = device_lifetimes(frames, device)
    alive = (lifetimes["event_index"] <= event_index) & (
        lifetimes["free_index"].isna() | (lifetimes["free_index"] > event_index)
    )
    mask = alive.to_numpy(dtype=bool)
    result = categorize(frames, rules)
    code = result.alloc_codes[device][mask]
    code = np.where(code < 0, CODES["other"], code)  # as the timeline indexes it
    sums = np.zeros(len(result.names), dtype=np.int64)
    np.add.at(sums, code, lifetimes["size_bytes"].to_numpy(dtype=np.int64)[mask])
    return {c: int(sums[i]) for i, c in enumerate(result.names)}


def _peak_index(frames: SnapshotFrames, device: int) -> int | None:
    """Event index of the device's requested peak (None without a trace)."""
    from ..history.timeline import device_timeline
    from ..stats.torch_stats import compute_torch_stats

    ts = compute_torch_stats(
        frames.segments[frames.segments["device"] == device], frames.blocks[frames.blocks["device"] == device]
    )
    tl = device_timeline(frames, device, ts["requested_bytes.all.current"], ts["reserved_bytes.all.current"])
    return None if tl is None else tl.peak_index


def _labelled(
    address: np.ndarray, size: np.ndarray, code: np.ndarray, rule: np.ndarray, older: bool, result: Categorization
) -> pd.DataFrame:
    names, rules = np.array(result.names, dtype=object), np.array(result.rule_names, dtype=object)
    return pd.DataFrame(
        {
            "address": address.astype(np.int64),
            "size_bytes": size.astype(np.int64),
            "category": names[np.where(code < 0, CODES["other"], code)],
            "rule": rules[rule],
            "before_trace": older,
        }
    )


def blocks_at_peak(frames: SnapshotFrames, device: int, rules: CategoryRules | None = None) -> pd.DataFrame | None:
    """Every allocation alive at the device's peak (the requested peak of its timeline), with
    its category and the rule that gave it: the trace's own allocations alive then, blocks alive
    at the dump that the trace did not make, and older allocations the trace frees after the
    peak. Columns: address, size_bytes (requested), category, rule, before_trace. None without a
    trace. With ``rules``, the user's categories first (:mod:`.custom`)."""
    peak = _peak_index(frames, device)
    if peak is None:
        return None
    result = categorize(frames, rules)
    lt = device_lifetimes(frames, device)
    free_at = lt["free_index"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).max)
    alive = (lt["event_index"].to_numpy() <= peak) & (free_at > peak)
    parts = [
        _labelled(
            lt["address"].to_numpy()[alive],
            lt["size_bytes"].to_numpy()[alive],
            result.alloc_codes[device][alive],
            result.alloc_rules[device][alive],
            older=False,
            result=result,
        )
    ]
    b = frames.blocks
    older = (b["device"] == device).to_numpy() & result.block_before_trace.to_numpy(dtype=bool)
    name_codes = {c: i for i, c in enumerate(result.names)}
    codes = result.block_category[older].map(name_codes).fillna(CODES["other"]).to_numpy(dtype=np.int64)
    rule_codes = result.block_rule[older].map({r: i for i, r in enumerate(result.rule_names)})
    parts.append(
        _labelled(
            b["address"].to_numpy()[older],
            b["requested_size_bytes"].to_numpy()[older],
            codes,
            rule_codes.to_numpy(dtype=np.int64),
            True,
            result,
        )
    )
    frees = result.pre_trace_frees.get(device)
    if frees is not None and len(frees):
        later = frees[frees["event_index"] > peak]
        address, size, code, rule = (
            later[c].to_numpy(dtype=np.int64) for c in ("address", "size_bytes", "code", "rule")
        )
        parts.append(_labelled(address, size, code, rule, older=True, result=result))
    return pd.concat(parts, ignore_index=True)


def categories_at_peak(
    frames: SnapshotFrames, device: int, rules: CategoryRules | None = None
) -> dict[str, int] | None:
    """Requested bytes by category at the device's peak, the memory older than the trace
    included (see :func:`blocks_at_peak`); they add up to the peak's requested bytes. None
    without a trace. For ``stats --json``: ``devices.<d>.categories_at_peak``."""
    alive = blocks_at_peak(frames, device, rules)
    if alive is None:
        return None
    sums = alive.groupby("category")["size_bytes"].sum()
    return {c: int(sums.get(c, 0)) for c in categorize(frames, rules).names}


def compute_categories(
    frames: SnapshotFrames, device: int, with_timeline: bool = True, rules: CategoryRules | None = None
) -> CategoryBreakdown:
    """Live bytes per category at the dump and, with ``with_timeline``, over the trace; with
    ``rules``, the user's categories first (:mod:`.custom`), theirs after the built-in ones."""
    result = categorize(frames, rules)
    names = result.names
    cats = result.block_category
    b = frames.blocks
    live = (b["device"] == device) & (b["state"] == "active_allocated")
    grouped = b.loc[live, ["size_bytes", "requested_size_bytes"]].groupby(cats[live])
    by_rule = b.loc[live, "requested_size_bytes"].groupby([cats[live], result.block_rule[live]]).sum()
    by = grouped.agg(
        size=("size_bytes", "sum"), requested=("requested_size_bytes", "sum"), count=("size_bytes", "size")
    )
    return CategoryBreakdown(
        device=device,
        live_bytes={c: int(by["size"].get(c, 0)) for c in names},
        live_requested_bytes={c: int(by["requested"].get(c, 0)) for c in names},
        live_blocks={c: int(by["count"].get(c, 0)) for c in names},
        timeline=category_timeline(frames, device, rules) if with_timeline else None,
        live_requested_by_rule={
            c: {str(r): int(v) for r, v in by_rule[c].items() if v} for c in names if c in by_rule.index
        },
    )


__all__ = [
    "CATEGORIES",
    "CODES",
    "INFERRED_RULES",
    "RULES",
    "RULE_HELP",
    "Categorization",
    "CategoryBreakdown",
    "CategoryLevels",
    "CategoryRule",
    "CategoryRuleError",
    "CategoryRules",
    "blocks_at_peak",
    "categories_at_peak",
    "categorize",
    "categorize_blocks",
    "category_levels",
    "category_levels_at",
    "category_timeline",
    "compute_categories",
    "stack_categories",
    "stack_threads",
]
