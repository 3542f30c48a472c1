"""The explorer's payload: the page's data as JSON that no string from the file can break out of,
the script that reads it, and the Content-Security-Policy that allows that script and nothing else.

Every string of the snapshot (file names, function names, annotations) reaches the page inside
``<script type="application/json">``; ``<``, ``>`` and ``&`` are written as ``\\u003c`` etc., so
neither ``</script>`` nor ``<!--`` can end or bend the element. The script is an inlined package
asset; the CSP allows it by its sha256, computed here from the very text that is inlined.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..frames import SnapshotFrames
from ..metrics import SnapshotStats, compute_stats
from ..metrics.attribution.annotations import AnnotatedAllocation
from ..metrics.attribution.sites import classify_frames
from ..metrics.categories import CategoryRules
from ..metrics.diagnose import device_timelines
from ..metrics.explore import Exploration, Histogram, SegmentMoment, explore
from ..metrics.stats.layout import PoolLayout
from ..plots.palette import CATEGORY_COLORS

STATES = ("active_allocated", "active_pending_free", "inactive")
MAX_STACK_FRAMES = 24  # frames kept per stack (innermost first)
MAX_BLOCKS_PER_SEGMENT = 300
_JSON_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026"}


@dataclass
class Payload:
    """Everything the explorer script reads; stacks and frame texts interned across devices."""

    devices: list[dict[str, Any]] = field(default_factory=list)
    frames: list[str] = field(default_factory=list)
    stacks: dict[str, list[int]] = field(default_factory=dict)
    _frame_ids: dict[str, int] = field(default_factory=dict)
    # annotated allocations (_annotate_tensor, torch >= 2.14), from :func:`annotation_data`; the
    # key is written only when there are some, so other files' pages stay as they were
    annotations: list[dict[str, Any]] = field(default_factory=list)
    # the diff page: its explorers share one time axis (zoom, pan, the moment chosen, the axis kind)
    linked: bool = False

    def add_stack(self, stack_id: int, frames: list[dict[str, Any]], prefix: str = "") -> None:
        """Intern one stack; ``prefix`` keeps two files' stack ids apart (the diff page)."""
        key = f"{prefix}{stack_id}"
        if key in self.stacks:
            return
        ids = []
        for frame in frames[:MAX_STACK_FRAMES]:
            text = f"{frame['name']} — {frame['filename']}" + (f":{frame['line']}" if frame.get("line") else "")
            fid = self._frame_ids.get(text)
            if fid is None:
                fid = self._frame_ids[text] = len(self.frames)
                self.frames.append(text)
            ids.append(fid)
        self.stacks[key] = ids

    def to_json(self) -> str:
        body = {
            "devices": self.devices,
            "frames": self.frames,
            "stacks": self.stacks,
            "states": list(STATES),
            # the built-in colours, and those of the user's own categories (#38) the devices show
            "colors": {**CATEGORY_COLORS, **{c: CATEGORY_COLORS[c] for d in self.devices for c in d.get("cats", ())}},
        }
        if self.annotations:
            body["annotations"] = self.annotations
        if self.linked:
            body["linked"] = True
        return escaped_json(body)


def escaped_json(body: dict[str, Any]) -> str:
    """``body`` as compact JSON that no string in it can break out of ``<script>`` with."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).translate(_JSON_ESCAPES)


def _round(values: np.ndarray) -> list[float]:
    return [float(f"{value:.6g}") for value in values.tolist()]


def _rows(levels: np.ndarray) -> list[list[int] | None]:
    """Level rows as lists; a row that is zero throughout as null (most categories, in most runs)."""
    return [row.tolist() if row.any() else None for row in levels]


def timeline_data(ex: Exploration) -> dict[str, Any]:
    """The timeline part of one device's payload (columns as lists)."""
    buckets, allocations = ex.buckets, ex.allocations
    return {
        "axis": ex.axis,
        "xLabel": ex.x_label,
        "b": {
            "x0": _round(buckets.x_start),
            "x1": _round(buckets.x_end),
            "xs": _round(buckets.x_sample),
            "lo": buckets.requested_low.tolist(),
            "hi": buckets.requested_high.tolist(),
            "res": buckets.reserved_high.tolist(),
            "end": buckets.requested_end.tolist(),
            "resEnd": buckets.reserved_end.tolist(),
        },
        "cats": list(ex.categories),
        "catLv": _rows(ex.category_levels),
        "sites": list(ex.sites),
        "siteLv": _rows(ex.site_levels),
        "allocs": {
            "x0": _round(allocations["x_alloc"].to_numpy()),
            "x1": [None if np.isnan(value) else float(f"{value:.6g}") for value in allocations["x_free"].to_numpy()],
            "size": allocations["size_bytes"].tolist(),
            "cat": allocations["category"].tolist(),
            "site": allocations["site"].tolist(),
            "mod": allocations["module"].tolist(),
            "stack": allocations["stack_id"].tolist(),
        },
        "siteNames": list(ex.site_names),
        "modNames": list(ex.module_names),
        "unlisted": ex.unlisted_allocations,
        "peak": {"x": ex.peak_x, "bytes": ex.peak_bytes},
        "ooms": list(ex.oom_x),
        "markers": [[marker_x, label] for marker_x, label in ex.markers],
        "hist": _histograms(ex),
        "moments": [_moment(moment) for moment in ex.segment_moments],
        "momentsExact": ex.segments_exact,
        **({"ev": _event_axis(ex)} if ex.axis == "time_s" else {}),
    }


def _event_axis(ex: Exploration) -> dict[str, Any]:
    """Every x again as the entry's position in the trace (the page's wall-clock/event toggle)."""
    allocations = ex.allocations
    return {
        "b": {"x0": ex.buckets.first.tolist(), "x1": ex.buckets.last.tolist(), "xs": ex.buckets.sample.tolist()},
        "allocs": {
            "x0": allocations["e_alloc"].tolist(),
            "x1": [None if value < 0 else value for value in allocations["e_free"].tolist()],
        },
        "peak": ex.peak_position,
        "ooms": list(ex.oom_positions),
        "markers": list(ex.marker_positions),
    }


def _histogram(hist: Histogram | None) -> dict[str, Any] | None:
    if hist is None:
        return None
    return {"low": hist.low, "n": list(hist.counts), "bytes": list(hist.bytes), "zero": hist.zero, "open": hist.open}


def _histograms(ex: Exploration) -> dict[str, Any]:
    return {
        "size": _histogram(ex.size_histogram),
        "lifeEvents": _histogram(ex.lifetime_events),
        "lifeSeconds": _histogram(ex.lifetime_seconds),
    }


def _moment(moment: SegmentMoment) -> dict[str, Any]:
    """One moment's segments (address as text, size) and blocks [segment, offset, size, listed row]."""
    return {
        "at": moment.bucket,
        "pos": moment.position,
        "segs": [
            [f"0x{address:x}", size]
            for address, size in zip(moment.segment_address.tolist(), moment.segment_size.tolist(), strict=True)
        ],
        "blocks": [
            list(block)
            for block in zip(
                moment.block_segment.tolist(),
                moment.block_offset.tolist(),
                moment.block_size.tolist(),
                moment.block_row.tolist(),
                strict=True,
            )
        ],
        "more": [moment.hidden_segments, moment.hidden_segment_bytes, moment.hidden_blocks, moment.hidden_block_bytes],
    }


def diff_payload(before: SnapshotFrames, after: SnapshotFrames, names: tuple[str, str]) -> Payload:
    """The diff page's two explorers, linked (see :func:`add_diff_explorer`)."""
    payload = Payload(linked=True)
    add_diff_explorer(payload, before, "a", names[0])
    add_diff_explorer(payload, after, "b", names[1])
    return payload


def add_diff_explorer(
    payload: Payload,
    frames: SnapshotFrames,
    key: str,
    name: str,
    rules: CategoryRules | None = None,
    stats: SnapshotStats | None = None,
) -> None:
    """One file's explorer for the diff page (``key``: "a" the first file, "b" the second): its
    first device with a trace (nothing for a file without one). Its stacks are keyed
    ``<key>:<id>``, two files' ids being unrelated. A caller that reads the files one at a time
    adds each as soon as it has its frames, so both need not be in memory at once; one that has
    computed the file's ``stats`` already passes them (None: computed here)."""
    timelines = device_timelines(frames, stats if stats is not None else compute_stats(frames))
    device = next((dev for dev, timeline in timelines.items() if timeline is not None), None)
    if device is None:
        return
    timeline = timelines[device]
    assert timeline is not None
    ex = explore(frames, timeline, rules=rules)
    data = {"device": device, "dom": f"explorer-{key}", "name": name, "stackPrefix": f"{key}:", "segments": []}
    data.update(timeline_data(ex))
    shown = sorted({sid for sid in ex.allocations["stack_id"].tolist() if sid >= 0})
    for stack_id, stack in zip(shown, without_internals([frames.stack(sid) for sid in shown]), strict=True):
        payload.add_stack(stack_id, stack, prefix=f"{key}:")
    payload.devices.append(data)


def without_internals(stacks: list[list[dict[str, Any]]], with_kind: bool = False) -> list[list[dict[str, Any]]]:
    """Each stack without the frames :func:`~..metrics.attribution.sites.classify_frames` calls
    internal (PyTorch's and Python's own machinery), as the report shows them (``with_kind``:
    each frame kept with its ``kind``); the frames of all the stacks are classified at once (the
    kind of a frame depends on that frame alone; each call costs tens of milliseconds)."""
    every_frame = [frame for stack in stacks for frame in stack]
    if not every_frame:
        return [[] for _ in stacks]
    table = pd.DataFrame(every_frame, columns=["filename", "line", "name"])
    table["frame_id"] = range(len(table))
    kinds = classify_frames(table).to_numpy()
    out, start = [], 0
    for stack in stacks:
        mine = kinds[start : start + len(stack)]
        start += len(stack)
        kept = [(frame, kind) for frame, kind in zip(stack, mine, strict=True) if kind != "internal"]
        out.append([{**frame, "kind": kind} if with_kind else frame for frame, kind in kept])
    return out


def annotation_data(annotated: list[AnnotatedAllocation]) -> list[dict[str, Any]]:
    """The explorer's record of each annotated allocation: device, address (as the layout's
    ``addr``), size, the allocation's stack and event index (null: made before the trace), its
    site and the annotation text, escaped with the rest of the JSON."""
    return [
        {
            "device": item.device,
            "addr": f"0x{item.address:x}",
            "size": item.size_bytes,
            "stack": item.stack_id if item.stack_id is not None else -1,
            "event": item.alloc_event_index,
            "site": item.site,
            "text": item.annotation,
        }
        for item in annotated
    ]


def allocation_notes(ex: Exploration, annotated: list[AnnotatedAllocation]) -> dict[str, list[str]]:
    """The annotations of the explorer's listed allocations of one device: row (as text) -> the
    annotation texts, matched by the event that made the allocation (escaped with the rest of
    the JSON)."""
    rows = {int(e): i for i, e in enumerate(ex.allocations["event_index"].tolist())}
    notes: dict[str, list[str]] = {}
    for item in annotated:
        if item.device != ex.device or item.alloc_event_index is None:
            continue  # another device's, or made before the trace (not on the timeline)
        row = rows.get(item.alloc_event_index)
        if row is not None:
            notes.setdefault(str(row), []).append(item.annotation)
    return notes


def layout_data(layouts: list[PoolLayout]) -> list[dict[str, Any]]:
    """The drawn segments and their blocks: [offset, size, state code, stack id (-1: none)]."""
    out = []
    for pool in layouts:
        blocks = pool.blocks.sort_values(["segment_id", "offset_bytes"])
        by_segment = dict(tuple(blocks.groupby("segment_id", sort=False)))
        segs = pool.segments
        for seg_id, address, size, name, stream in zip(
            segs["segment_id"].tolist(),
            segs["address"].tolist(),
            segs["total_size_bytes"].tolist(),
            segs["pool"].astype(str).tolist(),
            segs["stream"].tolist(),
            strict=True,
        ):
            blk = by_segment.get(seg_id, blocks.iloc[:0])
            shown = blk.head(MAX_BLOCKS_PER_SEGMENT)
            states = pd.Categorical(shown["state"].astype(str), categories=list(STATES)).codes
            out.append(
                {
                    "addr": f"0x{address:x}",
                    "size": size,
                    "pool": name,
                    "stream": stream,
                    "more": max(0, len(blk) - len(shown)),
                    "alike": pool.repeats.get(seg_id, 1),
                    "blocks": [
                        [int(offset), int(block_size), int(state_code), int(stack_id)]
                        for offset, block_size, state_code, stack_id in zip(
                            shown["offset_bytes"].tolist(),
                            shown["size_bytes"].tolist(),
                            states.tolist(),
                            shown["stack_id"].to_numpy(dtype=np.int64, na_value=-1).tolist(),
                            strict=True,
                        )
                    ],
                }
            )
    return out


def explorer_script() -> str:
    """The explorer's JavaScript, as inlined."""
    text = (importlib.resources.files("snapshot_lab") / "render" / "assets" / "explorer.js").read_text("utf-8")
    if "</script" in text.lower():
        raise AssertionError("explorer.js must not contain '</script'")
    return text


def script_hash(script: str) -> str:
    """The CSP source that allows exactly this inline script."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii") + "'"


def content_security_policy(script: str = "") -> str:
    """No request of any kind; images only from data: URIs; styles inline; ``script`` (when
    given) the only script allowed to run."""
    allowed = f"script-src {script_hash(script)}; " if script else ""
    return f"default-src 'none'; img-src data:; style-src 'unsafe-inline'; {allowed}base-uri 'none'; form-action 'none'"
