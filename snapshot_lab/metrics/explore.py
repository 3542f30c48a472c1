"""The data behind the report's explorer: a trace reduced to what a page can carry.

A trace of a million entries cannot travel whole inside an HTML file. What the explorer needs:

- the memory levels over the trace as buckets (each bucket: first and last x, lowest and highest
  requested bytes, highest reserved bytes), so a zoom shows every spike down to a bucket;
- at each bucket's highest point, the bytes live by category and by site (the largest sites by
  name, the rest as one row): "what was live then" for any moment clicked;
- the allocations worth a look one by one, with their stacks: everything alive at the peak and
  the largest of the trace, up to a fixed count; the rest is only in the levels;
- histograms of every allocation's size and lifetime (powers of two), the whole trace's;
- the allocator's segments and their allocated blocks at a few sampled moments (the peak among
  them), each capped, for the "segments at this moment" view;
- with times, every x again as the entry's position, for the page's wall-clock/event toggle.

x is seconds since the trace's first entry when every entry has a time, else the entry's
position in the device's trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

from ..frames import SnapshotFrames, event_positions
from .attribution.sites import site_codes, snapshot_sites
from .categories import CODES, CategoryRules, categorize
from .history.lifetimes import device_lifetimes, orphan_frees
from .history.timeline import Timeline

BUCKETS = 1000  # about one per pixel of the report's timeline
TOP_SITES = 16  # sites with levels of their own; the others are summed in one row
MAX_ALLOCATIONS = 1500  # allocations listed one by one (with stacks)
OTHER_SITES = "other sites"
SEGMENT_MOMENTS = 24  # moments whose segments the page carries (the peak's among them)
MOMENT_SEGMENTS = 96  # the largest segments drawn at a moment; the rest are counted
MOMENT_BLOCKS = 600  # the largest allocated blocks drawn at a moment; the rest are counted
BLOCK_ROUND = 512  # the allocator's smallest block: a request occupies at least this


@dataclass(frozen=True)
class Buckets:
    x_start: np.ndarray  # float64, x of each bucket's first entry
    x_end: np.ndarray  # float64, x of each bucket's last entry
    requested_low: np.ndarray  # int64
    requested_high: np.ndarray  # int64
    reserved_high: np.ndarray  # int64
    requested_end: np.ndarray  # int64: the level after each bucket's last entry (until the next bucket)
    reserved_end: np.ndarray  # int64
    sample: np.ndarray  # int64: position of each bucket's highest requested level in the device's trace
    x_sample: np.ndarray  # float64: x of each bucket's highest point (its sample)
    first: np.ndarray  # int64: position of each bucket's first entry
    last: np.ndarray  # int64: position of each bucket's last entry


@dataclass(frozen=True)
class Histogram:
    """Counts and bytes by power of two: bin k holds values in [2**(low + k), 2**(low + k + 1))."""

    low: int
    counts: tuple[int, ...]
    bytes: tuple[int, ...]
    zero: int = 0  # values of 0 (a lifetime with no time between alloc and free)
    open: int = 0  # not measured (still alive at the end of the trace)


@dataclass(frozen=True)
class SegmentMoment:
    """The segments and allocated blocks after one entry of the trace (free space: the gaps)."""

    bucket: int  # the bucket whose sample this is
    position: int  # the entry's position in the device's trace
    segment_address: np.ndarray  # int64
    segment_size: np.ndarray  # int64
    block_segment: np.ndarray  # int64: index into the segments above
    block_offset: np.ndarray  # int64
    block_size: np.ndarray  # int64 (requested, rounded to the allocator's 512 bytes)
    block_row: np.ndarray  # int64: the listed allocation (row of ``allocations``), -1: not listed
    hidden_segments: int  # live segments not drawn (smaller than the drawn ones)
    hidden_segment_bytes: int
    hidden_blocks: int  # allocated blocks of drawn segments not drawn (the smallest)
    hidden_block_bytes: int


@dataclass(frozen=True)
class Exploration:
    device: int
    axis: str  # "time_s" or "event"
    x_label: str
    buckets: Buckets
    categories: tuple[str, ...]
    category_levels: np.ndarray  # (categories, buckets) live bytes at each bucket's sample
    sites: tuple[str, ...]  # the top sites, then OTHER_SITES
    site_levels: np.ndarray  # (sites, buckets)
    # x_alloc, x_free (NaN: alive at the end), e_alloc, e_free (positions; -1: alive at the end),
    # size_bytes, category, site, module, stack_id, event_index
    allocations: pd.DataFrame
    site_names: tuple[str, ...]  # what allocations' "site" codes name
    module_names: tuple[str, ...]  # what allocations' "module" codes name (-1: none)
    listed_bytes_at_peak: int
    unlisted_allocations: int  # allocations of the trace only counted in the levels
    peak_x: float
    peak_bytes: int
    oom_x: tuple[float, ...]
    markers: tuple[tuple[float, str], ...]
    peak_position: int = 0
    oom_positions: tuple[int, ...] = ()
    marker_positions: tuple[int, ...] = ()
    size_histogram: Histogram | None = None
    lifetime_events: Histogram | None = None  # lifetimes in entries of the trace
    lifetime_seconds: Histogram | None = None  # lifetimes in seconds (None: the trace has no times)
    segment_moments: tuple[SegmentMoment, ...] = ()
    segments_exact: bool = True  # False: expandable segments, drawn by their mapped ranges


def _axis(frames: SnapshotFrames, tl: Timeline) -> tuple[np.ndarray, str, str, np.ndarray]:
    """x of every entry of the device's trace, the axis kind and label, and the entries' event_index."""
    ev = frames.device_events(tl.device)
    index = ev["event_index"].to_numpy(dtype=np.int64)
    times = ev["time_us"]
    if len(times) and times.notna().all():
        t = times.to_numpy(dtype=np.int64)
        return (t - t[0]) / 1e6, "time_s", "seconds since the first entry of the trace", index
    return np.arange(len(ev), dtype=np.float64), "event", "allocator events, in trace order", index


def _starts(x: np.ndarray, n: int, by_time: bool) -> np.ndarray:
    """First entry of each bucket: half of them evenly over the entries (busy stretches keep
    their detail), half evenly over time (an idle stretch does not hide inside one bucket)."""
    size = x.size
    by_entry = np.linspace(0, size, min(n if not by_time else n // 2, size) + 1).astype(np.int64)[:-1]
    if not by_time or x[-1] <= x[0]:
        return np.unique(by_entry)
    by_x = np.searchsorted(x, np.linspace(x[0], x[-1], n // 2, endpoint=False), side="left")
    return np.unique(np.r_[by_entry, by_x[by_x < size]])


def _buckets(x: np.ndarray, tl: Timeline, n: int, by_time: bool) -> Buckets:
    size = tl.requested_bytes.size
    starts = _starts(x, n, by_time)
    ends = np.r_[starts[1:], size] - 1
    req = tl.requested_bytes
    high = np.maximum.reduceat(req, starts)
    # the highest point of each bucket: first position where the bucket reaches its maximum
    bucket_of = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, size]))
    at_max = np.flatnonzero(req == high[bucket_of])
    first = np.unique(bucket_of[at_max], return_index=True)[1]
    return Buckets(
        x_start=x[starts],
        x_end=x[ends],
        requested_low=np.minimum.reduceat(req, starts),
        requested_high=high,
        reserved_high=np.maximum.reduceat(tl.reserved_bytes, starts),
        requested_end=req[ends],
        reserved_end=tl.reserved_bytes[ends],
        sample=at_max[first],
        x_sample=x[at_max[first]],
        first=starts,
        last=ends,
    )


def _levels(codes: np.ndarray, n_codes: int, start: np.ndarray, end: np.ndarray, size: np.ndarray, sample: np.ndarray):
    """Bytes live at each sample position, per code: an allocation counts from its position
    (inclusive) to its free's (exclusive)."""
    levels = np.zeros((n_codes, sample.size + 1), dtype=np.int64)
    on = np.searchsorted(sample, start, side="left")  # first sample at or after the allocation
    off = np.searchsorted(sample, end, side="left")  # first sample at or after the free
    np.add.at(levels, (codes, on), size)
    np.add.at(levels, (codes, off), -size)
    return np.cumsum(levels, axis=1)[:, :-1]


def _modules(frames: SnapshotFrames, device: int, lifetimes: pd.DataFrame) -> tuple[np.ndarray, tuple[str, ...]]:
    """Each allocation's module code (-1: none) and the module names, as the module view sees them."""
    from .attribution import modules  # the attribution the module table uses, so the two always agree

    ev = frames.device_events(device)
    att = modules._from_tags(ev, lifetimes) or modules._from_stacks(frames, device, lifetimes)
    return att.module, tuple(att.names)


def _chosen(alive_at_peak: np.ndarray, size: np.ndarray, limit: int) -> np.ndarray:
    """Positions (into the lifetimes) of the allocations listed one by one: alive at the peak
    first, largest first, then the largest of the rest."""
    order = np.lexsort((-size, ~alive_at_peak))
    return np.sort(order[:limit])


def histogram(values: np.ndarray, weights: np.ndarray, open_count: int = 0) -> Histogram:
    """``values`` (> 0) counted by power of two, with the ``weights`` (bytes) of each bin."""
    positive = values > 0
    exps = np.floor(np.log2(values[positive])).astype(np.int64)
    zero = int(values.size - exps.size)
    if exps.size == 0:
        return Histogram(0, (), (), zero, open_count)
    low = int(exps.min())
    counts = np.bincount(exps - low)
    nbytes = np.bincount(exps - low, weights=weights[positive].astype(np.float64), minlength=counts.size)
    return Histogram(low, tuple(int(c) for c in counts), tuple(int(b) for b in nbytes), zero, open_count)


@dataclass(frozen=True)
class _Spans:
    """Address ranges live from position ``start`` (inclusive, -1: before the trace) to ``end``
    (exclusive; the trace's length: still live at the end)."""

    address: np.ndarray
    size: np.ndarray
    start: np.ndarray
    end: np.ndarray
    row: np.ndarray  # the listed allocation (-1: none)

    def live_at(self, position: int) -> np.ndarray:
        return np.flatnonzero((self.start <= position) & (self.end > position))


_MAKES = ("segment_alloc", "segment_map")
_RELEASES = ("segment_free", "segment_unmap")


def _at(ev: pd.DataFrame, column: str, rows: np.ndarray, missing: int) -> np.ndarray:
    """An integer column's values at ``rows`` (positions), ``missing`` where it has none: only
    those rows are read, not the whole column copied."""
    return ev[column].iloc[rows].to_numpy(dtype=np.int64, na_value=missing)


def _ranges_of_trace(
    ev: pd.DataFrame, made: np.ndarray, released: np.ndarray, n: int
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Ranges the trace makes (each until the next release at its address) and ranges it releases
    without having made them (there since before the trace)."""
    ons, offs = (
        pd.DataFrame(
            {
                "pos": rows,
                "address": _at(ev, "address", rows, -1),
                "size": _at(ev, "size_bytes", rows, 0),
            }
        )
        for rows in (np.flatnonzero(made), np.flatnonzero(released))
    )
    ended = pd.merge_asof(
        ons, offs[["pos", "address"]].assign(end=offs["pos"]), on="pos", by="address", direction="forward"
    )
    ended["end"] = ended["end"].fillna(n)
    begun = pd.merge_asof(
        offs, ons[["pos", "address"]].assign(begun=ons["pos"]), on="pos", by="address", direction="backward"
    )
    older = begun[begun["begun"].isna()]
    return ended, pd.DataFrame({"address": older["address"], "size": older["size"], "end": older["pos"]})


def _spans(made: pd.DataFrame, older: pd.DataFrame, always: pd.DataFrame, n: int, row: np.ndarray) -> _Spans:
    """One table of the three kinds of range: made in the trace, older than it, there throughout."""
    return _Spans(
        address=np.r_[made["address"], older["address"], always["address"]].astype(np.int64),
        size=np.r_[made["size"], older["size"], always["size"]].astype(np.int64),
        start=np.r_[made["pos"], np.full(len(older) + len(always), -1)].astype(np.int64),
        end=np.r_[made["end"], older["end"], np.full(len(always), n)].astype(np.int64),
        row=np.r_[row, np.full(len(older) + len(always), -1)].astype(np.int64),
    )


def _segment_spans(frames: SnapshotFrames, ev: pd.DataFrame, action: pd.Series) -> tuple[_Spans, bool]:
    """The device's segments over the trace (expandable ones by their mapped ranges), and whether
    that is exact (no expandable segment)."""
    made, older = _ranges_of_trace(ev, action.isin(_MAKES).to_numpy(), action.isin(_RELEASES).to_numpy(), len(ev))
    dump = frames.segments[frames.segments["device"] == ev["device"].iloc[0]] if len(ev) else frames.segments[:0]
    seen = set(made["address"].tolist()) | set(older["address"].tolist())
    kept = dump[~dump["is_expandable"].to_numpy(dtype=bool) & ~dump["address"].isin(seen).to_numpy()]
    always = pd.DataFrame({"address": kept["address"], "size": kept["total_size_bytes"]})
    exact = not bool(dump["is_expandable"].any()) and not bool((action == "segment_map").any())
    return _spans(made, older, always, len(ev), np.full(len(made), -1)), exact


def _block_spans(
    frames: SnapshotFrames,
    ev: pd.DataFrame,
    lt: pd.DataFrame,
    lives: tuple[np.ndarray, np.ndarray, np.ndarray],
    positions: np.ndarray,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The allocated blocks' address ranges: the trace's allocations (``lt``; ``lives``: their
    positions, their frees' and their listed rows) live at one of ``positions`` (ascending: the
    moments shown; the others are never drawn), those it frees without having made them, and the
    dump's live blocks older than the trace."""
    start, end, row = lives
    # live at the first moment at or after its start, or at none (the last: after every end)
    ahead = np.r_[positions, np.iinfo(np.int64).max]
    shown = np.flatnonzero(ahead[np.searchsorted(positions, start, side="left")] < end)
    size = lt["size_bytes"].to_numpy(dtype=np.int64)[shown]
    made = pd.DataFrame(
        {
            "address": lt["address"].to_numpy(dtype=np.int64)[shown],
            "size": -(-size // BLOCK_ROUND) * BLOCK_ROUND,
            "pos": start[shown],
            "end": end[shown],
            "row": row[shown],
        }
    )
    orphan = orphan_frees(ev, lt)
    older = pd.DataFrame(
        {
            "address": orphan["address"].to_numpy(dtype=np.int64),
            "size": -(-orphan["size_bytes"].to_numpy(dtype=np.int64) // BLOCK_ROUND) * BLOCK_ROUND,
            "end": event_positions(ev["event_index"].to_numpy(dtype=np.int64), orphan["event_index"].to_numpy()),
        }
    )
    dump = frames.blocks[(frames.blocks["device"] == ev["device"].iloc[0]) & (frames.blocks["state"] != "inactive")]
    still = set(lt.loc[lt["free_index"].isna(), "address"].tolist())
    kept = dump[~dump["address"].isin(still).to_numpy()]
    always = pd.DataFrame({"address": kept["address"], "size": kept["size_bytes"]})
    return made, older, always


def _moment(bucket: int, position: int, segments: _Spans, blocks: _Spans) -> SegmentMoment:
    """The largest segments live after entry ``position``, their largest allocated blocks."""
    live = segments.live_at(position)
    by_size = live[np.argsort(-segments.size[live], kind="stable")]
    shown = np.sort(by_size[:MOMENT_SEGMENTS])
    shown = shown[np.argsort(segments.address[shown], kind="stable")]
    seg_addr, seg_size = segments.address[shown], segments.size[shown]
    alive = blocks.live_at(position)
    k = np.searchsorted(seg_addr, blocks.address[alive], side="right") - 1
    inside = (k >= 0) & (blocks.address[alive] < seg_addr[k.clip(0)] + seg_size[k.clip(0)]) if shown.size else k < -1
    alive, k = alive[inside], k[inside]
    keep = np.sort(np.argsort(-blocks.size[alive], kind="stable")[:MOMENT_BLOCKS])
    dropped = np.setdiff1d(np.arange(alive.size), keep)
    hidden = by_size[MOMENT_SEGMENTS:]
    return SegmentMoment(
        bucket=bucket,
        position=position,
        segment_address=seg_addr,
        segment_size=seg_size,
        block_segment=k[keep],
        block_offset=blocks.address[alive[keep]] - seg_addr[k[keep]],
        block_size=blocks.size[alive[keep]],
        block_row=blocks.row[alive[keep]],
        hidden_segments=int(hidden.size),
        hidden_segment_bytes=int(segments.size[hidden].sum()),
        hidden_blocks=int(dropped.size),
        hidden_block_bytes=int(blocks.size[alive[dropped]].sum()),
    )


def segment_moments(
    frames: SnapshotFrames,
    device: int,
    lt: pd.DataFrame,
    start: np.ndarray,
    end: np.ndarray,
    row: np.ndarray,
    b: Buckets,
    peak_bucket: int,
) -> tuple[tuple[SegmentMoment, ...], bool]:
    """The segments at :data:`SEGMENT_MOMENTS` buckets' highest points, evenly spread, and the
    peak's; ``row``: each lifetime's listed allocation (-1: not listed)."""
    ev = frames.device_events(device)
    action = ev["action"]  # categorical: compared by code, not as a million strings
    segments, exact = _segment_spans(frames, ev, action)
    n = b.sample.size
    chosen = np.unique(np.r_[np.linspace(0, n - 1, SEGMENT_MOMENTS - 1).round().astype(np.int64), peak_bucket])
    made, older, always = _block_spans(frames, ev, lt, (start, end, row), np.sort(b.sample[chosen]))
    blocks = _spans(made, older, always, len(ev), made["row"].to_numpy())
    return tuple(_moment(int(i), int(b.sample[i]), segments, blocks) for i in chosen), exact


def _lifetimes(lt: pd.DataFrame, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each allocation's position, its free's (the trace's length: alive at the end), whether freed."""
    start = event_positions(index, lt["event_index"].to_numpy(dtype=np.int64))
    freed = lt["free_index"].notna().to_numpy()
    end = np.where(
        freed, event_positions(index, lt["free_index"].to_numpy(dtype=np.int64, na_value=-1)), index.size
    ).astype(np.int64)
    return start, end, freed


def _histograms(
    x: np.ndarray, axis: str, size: np.ndarray, start: np.ndarray, end: np.ndarray, freed: np.ndarray
) -> tuple[Histogram, Histogram, Histogram | None]:
    """Sizes, lifetimes in entries and (with times) in seconds, of every allocation of the trace."""
    still = int((~freed).sum())
    last = np.minimum(end[freed], x.size - 1)
    by_events = histogram((end[freed] - start[freed]).astype(np.float64), size[freed], still)
    by_seconds = histogram(x[last] - x[start[freed]], size[freed], still) if axis == "time_s" else None
    return histogram(size.astype(np.float64), size), by_events, by_seconds


class _Lives(NamedTuple):
    """Every allocation of the trace: its size, position, free's position, whether freed, whether
    alive at the peak; and which are listed one by one (positions into the lifetimes)."""

    size: np.ndarray
    start: np.ndarray
    end: np.ndarray
    freed: np.ndarray
    alive: np.ndarray
    chosen: np.ndarray


def _lives(lt: pd.DataFrame, index: np.ndarray, peak_pos: int, limit: int) -> _Lives:
    size = lt["size_bytes"].to_numpy(dtype=np.int64)
    start, end, freed = _lifetimes(lt, index)
    alive = (start <= peak_pos) & (end > peak_pos)
    return _Lives(size, start, end, freed, alive, _chosen(alive, size, limit))


@dataclass(frozen=True)
class _Labelled:
    """What the explorer says each allocation is: category, site and module, as levels per sample
    and as the listed allocations' columns."""

    categories: tuple[str, ...]
    category_levels: np.ndarray
    sites: tuple[str, ...]
    site_levels: np.ndarray
    site_names: tuple[str, ...]
    module_names: tuple[str, ...]
    columns: dict[str, np.ndarray]  # category, site, module, stack_id of the listed allocations


def _labelled(
    frames: SnapshotFrames,
    device: int,
    lt: pd.DataFrame,
    lives: _Lives,
    sample: np.ndarray,
    rules: CategoryRules | None,
) -> _Labelled:
    labelled = categorize(frames, rules)
    categories = labelled.names  # the one place the explorer's category names come from
    # an allocation no rule labelled is other (with the user's names after the built-in ones,
    # -1 would index the last of those)
    cat = labelled.alloc_codes[device].astype(np.int64)
    cat = np.where(cat < 0, CODES["other"], cat)
    sid = lt["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    site_code, site_names = site_codes(sid, snapshot_sites(frames), cat, categories)
    size, alive, chosen = lives.size, lives.alive, lives.chosen
    by_peak = np.bincount(site_code[alive], weights=size[alive], minlength=len(site_names))
    top = np.argsort(-by_peak, kind="stable")[:TOP_SITES]
    top = top[by_peak[top] > 0]
    level_code = np.full(len(site_names), top.size, dtype=np.int64)
    level_code[top] = np.arange(top.size)
    module, module_names = _modules(frames, device, lt)
    return _Labelled(
        categories=categories,
        category_levels=_levels(cat, len(categories), lives.start, lives.end, size, sample),
        sites=(*(str(site_names[i]) for i in top), OTHER_SITES),
        site_levels=_levels(level_code[site_code], top.size + 1, lives.start, lives.end, size, sample),
        site_names=tuple(str(s) for s in site_names),
        module_names=module_names,
        columns={"category": cat[chosen], "site": site_code[chosen], "module": module[chosen], "stack_id": sid[chosen]},
    )


def explore(
    frames: SnapshotFrames,
    tl: Timeline,
    buckets: int = BUCKETS,
    limit: int = MAX_ALLOCATIONS,
    rules: CategoryRules | None = None,
) -> Exploration:
    """The explorer's data for one device with a trace (categories by the user's ``rules`` first,
    when given). The segments' moments come first, the explorer's largest step, made before the
    arrays of what each allocation is labelled exist (at 5M entries 13 MiB an array)."""
    x, axis, x_label, index = _axis(frames, tl)
    b = _buckets(x, tl, buckets, axis == "time_s")
    lt = device_lifetimes(frames, tl.device)
    peak_pos = int(np.searchsorted(index, tl.peak_index))
    lives = _lives(lt, index, peak_pos, limit)
    size, start, end, freed, chosen = lives.size, lives.start, lives.end, lives.freed, lives.chosen
    row = np.full(size.size, -1, dtype=np.int64)
    row[chosen] = np.arange(chosen.size)
    peak_bucket = int(np.searchsorted(b.first, peak_pos, side="right") - 1)
    moments, exact = segment_moments(frames, tl.device, lt, start, end, row, b, peak_bucket)
    del row
    named = _labelled(frames, tl.device, lt, lives, b.sample, rules)
    allocations = pd.DataFrame(
        {
            "x_alloc": x[start[chosen]],
            "x_free": np.where(freed[chosen], x[np.minimum(end[chosen], index.size - 1)], np.nan),
            "e_alloc": start[chosen],
            "e_free": np.where(freed[chosen], end[chosen], -1),
            "size_bytes": size[chosen],
            **named.columns,
            "event_index": lt["event_index"].to_numpy(dtype=np.int64)[chosen],
        }
    )
    sizes, by_events, by_seconds = _histograms(x, axis, size, start, end, freed)
    return Exploration(
        device=tl.device,
        axis=axis,
        x_label=x_label,
        buckets=b,
        categories=named.categories,
        category_levels=named.category_levels,
        sites=named.sites,
        site_levels=named.site_levels,
        allocations=allocations,
        site_names=named.site_names,
        module_names=named.module_names,
        listed_bytes_at_peak=int(size[chosen][lives.alive[chosen]].sum()),
        unlisted_allocations=int(size.size - chosen.size),
        peak_x=float(x[peak_pos]),
        peak_bytes=tl.peak_requested_bytes,
        oom_x=tuple(float(x[int(m.x)]) for m in tl.ooms),
        markers=tuple((float(x[int(m.x)]), m.label) for m in tl.markers),
        peak_position=peak_pos,
        oom_positions=tuple(int(m.x) for m in tl.ooms),
        marker_positions=tuple(int(m.x) for m in tl.markers),
        size_histogram=sizes,
        lifetime_events=by_events,
        lifetime_seconds=by_seconds,
        segment_moments=moments,
        segments_exact=exact,
    )
