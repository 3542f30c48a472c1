"""Ground truth of categories for recordings whose truth.json has ``observations``.

The GPU job observed the live tensors of each category (``[data_ptr, nbytes]``) at moments it
marked in the snapshot's ``external_annotations`` (``snaplab_truth:<marker>``, on the trace's
clock). This module replays the raw trace by itself (no snaplab code: it checks snaplab) to two
moments, the dump and the requested-bytes peak, and gives every block alive then the category of
an observation of its address made while that block was alive (allocation time <= observation
time < free time; a block older than the trace is alive from -inf). Blocks never observed are
``activation`` (the rest: activations, temporaries, workspaces, inputs).

Truth categories snaplab has no name for are mapped onto snaplab's: ``logits`` (a forward's
output kept alive) -> activation; ``lbfgs_history`` (LBFGS's ``old_dirs``/``old_stps``, kept in
the optimizer's state and allocated by its own code) -> optimizer_state.
"""

from __future__ import annotations

import json
import lzma
import pickle
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REST = "activation"
TRUTH_ALIASES = {"logits": "activation", "lbfgs_history": "optimizer_state"}
ACTIVE = ("active_allocated", "active_pending_free")
_INF = float("inf")
BEFORE_TRACE = -1e30


@dataclass(frozen=True)
class LiveBlock:
    address: int
    requested_bytes: int
    alloc_time_us: float  # -inf: older than the trace
    free_time_us: float  # +inf: alive at the dump


@dataclass(frozen=True)
class TruthCategories:
    at_dump: dict[str, int]
    at_peak: dict[str, int]
    peak_requested_bytes: int
    peak_event: int  # position of the peak in the device's trace
    # address -> (requested bytes, true category or None) of every block alive at the peak; None:
    # alive at no observation moment, so the observations cannot say what it was
    peak_blocks: dict[int, tuple[int, str | None]]


def _observations(snapshot: dict[str, Any], truth: dict[str, Any]) -> dict[int, list[tuple[float, str]]]:
    """address -> [(observation time, category)], sorted by time."""
    by_address: dict[int, list[tuple[float, str]]] = defaultdict(list)
    observed = truth["workload"].get("observations", [])
    for t, obs in zip(_marker_times(snapshot, truth), observed, strict=True):
        for category, tensors in obs["tensors"].items():
            for data_ptr, _nbytes in tensors:
                by_address[int(data_ptr)].append((t, TRUTH_ALIASES.get(category, category)))
    for seen in by_address.values():
        seen.sort()
    return by_address


def _category(block: LiveBlock, seen: list[tuple[float, str]], moment: float) -> str:
    """The category of the observation of this block nearest before ``moment`` (else the first
    after it), among those made while the block was alive."""
    alive = [(t, c) for t, c in seen if block.alloc_time_us <= t < block.free_time_us]
    if not alive:
        return REST
    before = [c for t, c in alive if t <= moment]
    return before[-1] if before else alive[0][1]


def _replay(
    trace: list[dict[str, Any]], dump_blocks: dict[int, int]
) -> tuple[list[LiveBlock], list[LiveBlock], int, int]:
    """Blocks alive at the dump and at the peak, the peak's requested bytes and position."""
    open_allocs: dict[int, tuple[int, float, int]] = {}  # address -> size, time, position
    ended: list[tuple[int, int, float, float, int, int]] = []  # address, size, t0, t1, i0, i1
    older_freed: list[tuple[int, int, float, int]] = []  # address, size, free time, position
    level, levels = 0, []
    for i, e in enumerate(trace):
        action, addr, size, t = e["action"], e.get("addr"), int(e.get("size", 0)), float(e.get("time_us", 0))
        if action == "alloc":
            open_allocs[addr] = (size, t, i)
            level += size
        elif action == "free_completed":
            level -= size
            if addr in open_allocs:
                s, t0, i0 = open_allocs.pop(addr)
                ended.append((addr, s, t0, t, i0, i))
            else:
                older_freed.append((addr, size, t, i))
        levels.append(level)
    offset = sum(dump_blocks.values()) - level
    peak = max(range(len(levels)), key=lambda k: (levels[k], -k))
    at_dump = [
        LiveBlock(a, size, open_allocs[a][1] if a in open_allocs else -_INF, _INF) for a, size in dump_blocks.items()
    ]
    at_peak = [LiveBlock(a, s, t0, t1) for a, s, t0, t1, i0, i1 in ended if i0 <= peak < i1]
    at_peak += [LiveBlock(a, s, t, _INF) for a, (s, t, i) in open_allocs.items() if i <= peak]
    at_peak += [LiveBlock(a, s, -_INF, t) for a, s, t, i in older_freed if i > peak]
    at_peak += [LiveBlock(a, s, -_INF, _INF) for a, s in dump_blocks.items() if a not in open_allocs]
    return at_dump, at_peak, levels[peak] + offset, peak


def _observable(block: LiveBlock, moments: list[float]) -> bool:
    return any(block.alloc_time_us <= t < block.free_time_us for t in moments)


def _sum(blocks: list[LiveBlock], observations: dict[int, list[tuple[float, str]]], moment: float) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for b in blocks:
        out[_category(b, observations.get(b.address, []), moment)] += b.requested_bytes
    return dict(out)


def truth_categories(pickle_path: Path, truth_path: Path, device: int = 0) -> TruthCategories:
    """Requested bytes by true category at the dump and at the trace's requested peak."""
    with lzma.open(pickle_path) if pickle_path.suffix == ".xz" else pickle_path.open("rb") as f:
        snapshot = pickle.load(f)
    truth = json.loads(truth_path.read_text())
    dump_blocks = {
        int(b["address"]): int(b["requested_size"])
        for seg in snapshot["segments"]
        if seg.get("device", 0) == device
        for b in seg["blocks"]
        if b["state"] in ACTIVE
    }
    trace = snapshot["device_traces"][device]
    at_dump, at_peak, peak_bytes, peak = _replay(trace, dump_blocks)
    observations = _observations(snapshot, truth)
    peak_time = float(trace[peak].get("time_us", 0))
    moments = _marker_times(snapshot, truth)
    peak_blocks = {
        b.address: (
            b.requested_bytes,
            _category(b, observations.get(b.address, []), peak_time) if _observable(b, moments) else None,
        )
        for b in at_peak
    }
    return TruthCategories(
        _sum(at_dump, observations, _INF), _sum(at_peak, observations, peak_time), peak_bytes, peak, peak_blocks
    )


def _marker_times(snapshot: dict[str, Any], truth: dict[str, Any]) -> list[float]:
    """Every observation's moment (also those that found no tensor of any category)."""
    times = {
        a["name"].split(":", 1)[1]: float(a["time_us"])
        for a in snapshot.get("external_annotations", [])
        if a.get("stage") == "START" and str(a.get("name", "")).startswith("snaplab_truth:")
    }
    observed = truth["workload"].get("observations", [])
    # a marker missing from the snapshot was observed before recording began: before every
    # allocation of the trace, while the blocks older than the trace were alive
    return [times.get(o["marker"], BEFORE_TRACE + k) for k, o in enumerate(observed)]


__all__ = ["REST", "TRUTH_ALIASES", "LiveBlock", "TruthCategories", "truth_categories"]
