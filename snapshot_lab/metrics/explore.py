"""The data behind the report's explorer: a trace reduced to what a page can carry.

A trace of a million entries cannot travel whole inside an HTML file. What the explorer needs:

- the memory levels over the trace as buckets (each bucket: first and last x, lowest and highest
  requested bytes, highest reserved bytes), so a zoom shows every spike down to a bucket;
- at each bucket's highest point, the bytes live by category and by site (the largest sites by
  name, the rest as one row): "what was live then" for any moment clicked;
- the allocations worth a look one by one, with their stacks: everything alive at the peak and
  the largest of the trace, up to a fixed count; the rest is only in the levels.

x is seconds since the trace's first entry when every entry has a time, else the entry's
position in the device's trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..frames import SnapshotFrames
from .attribution.sites import site_labels, snapshot_sites
from .categories import CATEGORIES, categorize
from .history.lifetimes import device_lifetimes
from .history.timeline import Timeline

BUCKETS = 1000  # about one per pixel of the report's timeline
TOP_SITES = 16  # sites with levels of their own; the others are summed in one row
MAX_ALLOCATIONS = 1500  # allocations listed one by one (with stacks)
OTHER_SITES = "other sites"


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
    allocations: pd.DataFrame  # x_alloc, x_free (NaN: alive at the end), size_bytes, category, site, module, stack_id
    site_names: tuple[str, ...]  # what allocations' "site" codes name
    module_names: tuple[str, ...]  # what allocations' "module" codes name (-1: none)
    listed_bytes_at_peak: int
    unlisted_allocations: int  # allocations of the trace only counted in the levels
    peak_x: float
    peak_bytes: int
    oom_x: tuple[float, ...]
    markers: tuple[tuple[float, str], ...]


def _axis(frames: SnapshotFrames, tl: Timeline) -> tuple[np.ndarray, str, str, np.ndarray]:
    """x of every entry of the device's trace, the axis kind and label, and the entries' event_index."""
    ev = frames.events[frames.events["device"] == tl.device]
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

    ev = frames.events[frames.events["device"] == device]
    att = modules._from_tags(ev, lifetimes) or modules._from_stacks(frames, device, lifetimes)
    return att.module, tuple(att.names)


def _chosen(alive_at_peak: np.ndarray, size: np.ndarray, limit: int) -> np.ndarray:
    """Positions (into the lifetimes) of the allocations listed one by one: alive at the peak
    first, largest first, then the largest of the rest."""
    order = np.lexsort((-size, ~alive_at_peak))
    return np.sort(order[:limit])


def explore(frames: SnapshotFrames, tl: Timeline, buckets: int = BUCKETS, limit: int = MAX_ALLOCATIONS) -> Exploration:
    """The explorer's data for one device with a trace."""
    x, axis, x_label, index = _axis(frames, tl)
    b = _buckets(x, tl, buckets, axis == "time_s")
    lt = device_lifetimes(frames, tl.device)
    size = lt["size_bytes"].to_numpy(dtype=np.int64)
    start = np.searchsorted(index, lt["event_index"].to_numpy(dtype=np.int64))
    freed = lt["free_index"].notna().to_numpy()
    end = np.where(
        freed, np.searchsorted(index, lt["free_index"].to_numpy(dtype=np.int64, na_value=-1)), index.size
    ).astype(np.int64)
    cat = categorize(frames).alloc_codes[tl.device].astype(np.int64)
    sid = lt["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    labels, _ = site_labels(sid, snapshot_sites(frames), np.array(CATEGORIES, dtype=object)[cat])
    site_code, site_names = pd.factorize(pd.Series(labels, dtype=object))
    peak_pos = int(np.searchsorted(index, tl.peak_index))
    alive = (start <= peak_pos) & (end > peak_pos)
    by_peak = np.bincount(site_code[alive], weights=size[alive], minlength=len(site_names))
    top = np.argsort(-by_peak, kind="stable")[:TOP_SITES]
    top = top[by_peak[top] > 0]
    level_code = np.full(len(site_names), top.size, dtype=np.int64)
    level_code[top] = np.arange(top.size)
    module, module_names = _modules(frames, tl.device, lt)
    chosen = _chosen(alive, size, limit)
    allocations = pd.DataFrame(
        {
            "x_alloc": x[start[chosen]],
            "x_free": np.where(freed[chosen], x[np.minimum(end[chosen], index.size - 1)], np.nan),
            "size_bytes": size[chosen],
            "category": cat[chosen],
            "site": site_code[chosen],
            "module": module[chosen],
            "stack_id": sid[chosen],
            "event_index": lt["event_index"].to_numpy(dtype=np.int64)[chosen],
        }
    )
    return Exploration(
        device=tl.device,
        axis=axis,
        x_label=x_label,
        buckets=b,
        categories=tuple(CATEGORIES),
        category_levels=_levels(cat, len(CATEGORIES), start, end, size, b.sample),
        sites=(*(str(site_names[i]) for i in top), OTHER_SITES),
        site_levels=_levels(level_code[site_code], top.size + 1, start, end, size, b.sample),
        allocations=allocations,
        site_names=tuple(str(s) for s in site_names),
        module_names=module_names,
        listed_bytes_at_peak=int(size[chosen][alive[chosen]].sum()),
        unlisted_allocations=int(size.size - chosen.size),
        peak_x=float(x[peak_pos]),
        peak_bytes=tl.peak_requested_bytes,
        oom_x=tuple(float(x[int(m.x)]) for m in tl.ooms),
        markers=tuple((float(x[int(m.x)]), m.label) for m in tl.markers),
    )
