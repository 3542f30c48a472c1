"""Leak suspects: allocation sites whose surviving memory grows with every iteration.

An allocation *survives* when it is still live at the dump (no ``free_completed`` follows it).
For each site we count the bytes of surviving allocations made in each iteration. Parameters
are allocated before the first iteration, optimizer state and lazily built caches in the first
one, and activations do not survive: none of them grows in the steady iterations. A site that
leaves memory behind in most steady iterations is a suspect; its growth per iteration is the
mean of those bytes, so even a few KiB per iteration in a job of gigabytes stands out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..frames import SnapshotFrames
from .attribution.sites import allocation_forward_ids, block_forward_ids, site_labels, snapshot_sites
from .categories.stacks import stack_categories
from .history.iterations import Iterations, find_iterations
from .history.lifetimes import device_lifetimes

MIN_STEADY_ITERATIONS = 2
MIN_GROWING_SHARE = 0.6


@dataclass(frozen=True)
class LeakSuspect:
    device: int
    site: str
    frames: list[dict[str, Any]]  # innermost first, as in the snapshot
    bytes: int  # live at the dump, in blocks allocated from this site
    count: int  # live blocks from this site
    growth_bytes_per_iteration: int
    iterations_growing: int
    iterations_considered: int
    first_seen_us: int | None
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LeakAnalysis:
    device: int
    iterations: int
    iteration_source: str | None
    iteration_label: str | None
    suspects: list[LeakSuspect] = field(default_factory=list)
    note: str | None = None

    @property
    def growth_bytes_per_iteration(self) -> int:
        return sum(s.growth_bytes_per_iteration for s in self.suspects)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["growth_bytes_per_iteration"] = self.growth_bytes_per_iteration
        return d


def surviving_allocations(lifetimes: pd.DataFrame) -> pd.DataFrame:
    """Allocations with no ``free_completed`` after them: live at the dump."""
    return lifetimes[lifetimes["free_index"].isna()].drop(columns="free_index")


def _analyse(frames: SnapshotFrames, device: int, it: Iterations, lifetimes: pd.DataFrame) -> list[LeakSuspect]:
    survivors = surviving_allocations(lifetimes)
    survivors = survivors[survivors["stack_id"].notna()]
    k = it.count
    steady = np.arange(1, k - 1)  # skip the first iteration (state, caches) and the last (partial)
    if survivors.empty or steady.size < MIN_STEADY_ITERATIONS:
        return []
    interval = np.searchsorted(it.starts, survivors["event_index"].to_numpy(), side="right") - 1
    sites = snapshot_sites(frames)
    sid = survivors["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    fwd = allocation_forward_ids(frames, device, survivors["event_index"].to_numpy(dtype=np.int64))
    df = survivors.assign(interval=interval, site=site_labels(sid, sites, None, fwd)[0])
    in_steady = df[(df["interval"] >= 1) & (df["interval"] <= k - 2)]
    if in_steady.empty:
        return []
    per = in_steady.groupby(["site", "interval"])["size_bytes"].sum().unstack(fill_value=0)
    per = per.reindex(columns=steady, fill_value=0)
    growing = (per > 0).sum(axis=1)
    need = max(MIN_STEADY_ITERATIONS, math.ceil(MIN_GROWING_SHARE * steady.size))
    suspects_sites = growing[growing >= need].index
    live = frames.blocks[(frames.blocks["device"] == device) & (frames.blocks["state"] != "inactive")]
    live_site = pd.Series(
        site_labels(live["stack_id"].to_numpy(dtype=np.int64, na_value=-1), sites, None, block_forward_ids(live))[0],
        index=live.index,
    ).where(live["stack_id"].notna())
    out = []
    for site in suspects_sites:
        rows = df[df["site"] == site]
        biggest_stack = int(rows.groupby("stack_id")["size_bytes"].sum().idxmax())
        mask = (live_site == site).fillna(False).to_numpy(dtype=bool)
        times = rows["time_us"].dropna()
        share = float(growing[site]) / steady.size
        out.append(
            LeakSuspect(
                device=device,
                site=str(site),
                frames=frames.stack(biggest_stack),
                bytes=int(live.loc[mask, "size_bytes"].sum()),
                count=int(mask.sum()),
                growth_bytes_per_iteration=round(per.loc[site].sum() / steady.size),
                iterations_growing=int(growing[site]),
                iterations_considered=int(steady.size),
                first_seen_us=int(times.min()) if len(times) else None,
                confidence=round(share * min(1.0, steady.size / 8), 2),
            )
        )
    out.sort(key=lambda s: (-s.confidence, -s.growth_bytes_per_iteration, s.site))
    return out


# a state-only snapshot (no trace): many same-size live activations from one site. A site inside
# a model's layers runs once per layer in a forward pass, and no model keeps hundreds of layers'
# outputs of one size from one line; hooks or caches that keep every forward's outputs do.
STATE_MIN_BLOCKS = 256
STATE_MIN_BYTES = 256 * 1024 * 1024
STATE_CONFIDENCE = 0.4  # one snapshot shows how much, not that it grows: below a trace's suspects
STATE_SOURCE = "state-only snapshot: same-size live activations from one site, far more than one forward pass keeps"


def state_only_suspects(frames: SnapshotFrames, device: int) -> list[LeakSuspect]:
    """Leak suspects a single snapshot can show without a trace: at least ``STATE_MIN_BLOCKS``
    live activation blocks of one size from one allocation site, ``STATE_MIN_BYTES`` in all."""
    blocks = frames.blocks
    live = blocks[(blocks["device"] == device) & (blocks["state"] == "active_allocated") & blocks["stack_id"].notna()]
    if len(live) < STATE_MIN_BLOCKS:
        return []
    sid = live["stack_id"].to_numpy(dtype=np.int64)
    categories = stack_categories(frames)
    is_activation = pd.Series(sid).map(categories).eq("activation").to_numpy()
    live = live[is_activation]
    if len(live) < STATE_MIN_BLOCKS:
        return []
    # one allocation path (the whole stack, not only the job's line that called the model): a site
    # inside a model's layers has one stack per call site of the layer loop
    counted = live.groupby(["stack_id", "size_bytes"])["size_bytes"].agg(["count", "sum"])
    hits = counted[(counted["count"] >= STATE_MIN_BLOCKS) & (counted["sum"] >= STATE_MIN_BYTES)]
    if hits.empty:
        return []
    sites = snapshot_sites(frames)
    stack_ids = np.array([int(k[0]) for k in hits.index], dtype=np.int64)
    labels = site_labels(stack_ids, sites)[0]
    out = []
    for label, stack_id, (count, total) in zip(labels, stack_ids, hits.itertuples(index=False), strict=True):
        out.append(
            LeakSuspect(
                device=device,
                site=str(label),
                frames=frames.stack(int(stack_id)),
                bytes=int(total),
                count=int(count),
                growth_bytes_per_iteration=0,
                iterations_growing=0,
                iterations_considered=0,
                first_seen_us=None,
                confidence=STATE_CONFIDENCE,
            )
        )
    out.sort(key=lambda s: (-s.bytes, s.site))
    return out


def find_leaks(frames: SnapshotFrames, device: int, lifetimes: pd.DataFrame | None = None) -> LeakAnalysis:
    """Leak suspects of one device, most suspicious first."""
    it = find_iterations(frames, device)
    if it is None:
        ev = frames.device_events(device)
        if len(ev) <= 1 and (held := state_only_suspects(frames, device)):
            return LeakAnalysis(device, 0, STATE_SOURCE, None, held, "no allocation history (state-only recording)")
        why = (
            "no allocation history (state-only recording)"
            if len(ev) <= 1
            else "no iterations found: no step annotations, and no repeating allocation pattern that ends like an "
            "iteration (a backward pass, an optimizer step, or memory returning to where it started); one climb, "
            "such as a forward pass through many identical layers, is not a series of iterations"
        )
        return LeakAnalysis(device, 0, None, None, [], why)
    if lifetimes is None:
        lifetimes = device_lifetimes(frames, device)
    suspects = _analyse(frames, device, it, lifetimes)
    note: str | None = None
    if it.count - 2 < MIN_STEADY_ITERATIONS:
        note = f"only {it.count} iterations in the trace: at least {MIN_STEADY_ITERATIONS + 2} are needed"
    return LeakAnalysis(device, it.count, it.source, it.label, suspects, note)
