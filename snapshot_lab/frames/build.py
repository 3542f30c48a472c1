"""Build pandas frames from a loaded :class:`~snapshot_lab.load.Snapshot`.

The trace can hold millions of entries; each column is pulled out with one C-level pass
(``map`` over the entry dicts, through ``operator.index``, which refuses anything but an
integer, into an int64 array, which refuses anything beyond int64) and checked for its range
with numpy at once. Only when a chunk fails
are its entries walked one by one in Python, to name the first bad field. Stack traces are
interned: the producer shares one list object per distinct traceback, so we key on ``id()``
first (cheap), then deduplicate by content, giving a ``stack_frames`` table, a ``stacks`` table
(stack_id, depth, frame_id) and a ``stack_id`` column everywhere a stack appears. The forward
pass's traceback that torch >= 2.11 records under autograd anomaly mode (``forward_frames``,
formatted strings) is parsed into the same tables and becomes ``forward_stack_id``.
"""

from __future__ import annotations

import mmap
import operator
import re
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import itemgetter
from typing import Any

import numpy as np
import pandas as pd

from .._compiled import compiled
from .._gc import gc_paused, release_freed_memory
from ..errors import SnapshotFormatError
from ..load import Snapshot, SourceInfo
from ..load.decoded import DecodedTraces, DeviceTrace
from ..load.validate import (
    INT64_MAX,
    INT64_MIN,
    UINT64_MAX,
    FieldError,
    check_int,
    check_str,
    describe,
    int_range,
)
from .schema import (
    ANNOTATIONS_SCHEMA,
    BLOCKS_SCHEMA,
    EVENT_DETAILS_SCHEMA,
    EVENTS_SCHEMA,
    FRAME_FX_SCHEMA,
    FX_KEYS,
    KNOWN_ACTIONS,
    SEGMENTS_SCHEMA,
    STACK_FRAMES_SCHEMA,
    STACKS_SCHEMA,
    conform,
    empty_frame,
)


@dataclass(frozen=True)
class SnapshotInfo:
    """Facts about the file and the recording that are not rows of a frame."""

    source: SourceInfo
    legacy: str | None
    format_hints: tuple[str, ...]
    allocator_settings: dict[str, Any] | None
    devices: tuple[int, ...]
    trace_devices: tuple[int, ...]  # ordinals whose trace has at least one entry
    n_trace_devices: int  # len(device_traces) in the file (== visible device count)
    stacks_kind: str  # 'none', 'python', 'python+cpp'
    capture: dict[str, Any] | None = None  # sidecar written by snapshot_lab.capture
    # the window the file was read with (load_snapshot's max_entries; None: every entry) and the
    # entries it left out at the start of each device's trace (by ordinal; () without a window)
    max_entries: int | None = None
    entries_left_out: tuple[int, ...] = ()


@dataclass
class SnapshotFrames:
    """All tables of one snapshot. See :mod:`snapshot_lab.frames.schema` for the columns."""

    info: SnapshotInfo
    segments: pd.DataFrame
    blocks: pd.DataFrame
    events: pd.DataFrame
    stack_frames: pd.DataFrame
    stacks: pd.DataFrame
    annotations: pd.DataFrame
    _stack_cache: dict[int, list[dict[str, Any]]] = field(default_factory=dict, repr=False)
    # torch >= 2.14: pinned host memory (host_segments: SEGMENTS_SCHEMA with device -1, one block
    # each; host_events: EVENTS_SCHEMA with device -1); empty when the file has none
    host_segments: pd.DataFrame = field(default_factory=lambda: empty_frame(SEGMENTS_SCHEMA))
    host_events: pd.DataFrame = field(default_factory=lambda: empty_frame(EVENTS_SCHEMA))
    event_details: pd.DataFrame = field(default_factory=lambda: empty_frame(EVENT_DETAILS_SCHEMA))
    frame_fx: pd.DataFrame = field(default_factory=lambda: empty_frame(FRAME_FX_SCHEMA))
    backend: str | None = None  # the accelerator the file names (load.loader.detect_backend)

    @property
    def has_host_memory(self) -> bool:
        """The file holds pinned host memory data (torch >= 2.14, record_pinned_host_memory)."""
        return bool(len(self.host_segments) or len(self.host_events))

    @property
    def trace_overflowed(self) -> bool | None:
        """What ``allocator_settings.trace_alloc_overflowed`` says (newer than torch 2.14.1): True
        when the ring buffer dropped its oldest events, False when it did not, None when the
        file does not say (then a trace that misses the job's start is only a guess between the
        two)."""
        v = (self.info.allocator_settings or {}).get("trace_alloc_overflowed")
        return v if type(v) is bool else None

    @property
    def trace_max_entries(self) -> int | None:
        """``allocator_settings.trace_alloc_max_entries``: the ring buffer's size, when said."""
        v = (self.info.allocator_settings or {}).get("trace_alloc_max_entries")
        return v if type(v) is int and v >= 0 else None

    def stack(self, stack_id: int | None) -> list[dict[str, Any]]:
        """The frames of one stack, innermost first, as ``{filename, line, name}`` dicts."""
        if stack_id is None or pd.isna(stack_id):
            return []
        sid = int(stack_id)
        cached = self._stack_cache.get(sid)
        if cached is None:
            rows = self.stacks[self.stacks["stack_id"] == sid].sort_values("depth")
            fr = self.stack_frames.set_index("frame_id").loc[rows["frame_id"]]
            cached = [
                {"filename": f, "line": int(ln), "name": n}
                for f, ln, n in zip(fr["filename"], fr["line"], fr["name"], strict=True)
            ]
            self._stack_cache[sid] = cached
        return cached

    def device_events(self, device: int) -> pd.DataFrame:
        """The events of one device, in trace order: what ``events[events["device"] == device]``
        gives, without copying the whole frame (about 80 bytes per entry) when every event is
        that device's, as in a one-GPU recording. Then it is a shallow copy of ``events``
        (pandas' copy-on-write keeps ``events`` as it is whatever the caller does with it);
        else the selected rows."""
        return device_rows(self.events, device)


def device_rows(events: pd.DataFrame, device: int) -> pd.DataFrame:
    """:meth:`SnapshotFrames.device_events` of any events frame: ``events[events["device"] ==
    device]``, a shallow copy (no column copied) when every row is that device's."""
    on_device = events["device"] == device
    if bool(on_device.all()) and len(events):
        return events.copy(deep=False)
    return events[on_device]


def event_positions(index: np.ndarray, event_index: np.ndarray) -> np.ndarray:
    """Positions in one device's trace (``index``: its event indices, sorted and unique) of
    ``event_index``, entries of that trace: their offsets where the indices run without a gap
    (as a trace's do: no sort, no search), else found by binary search. (A value not in
    ``index`` has no position; the caller masks it.)"""
    if index.size and int(index[-1]) - int(index[0]) == index.size - 1:
        return event_index - index[0]
    return np.searchsorted(index, event_index)


# '  File "x.py", line 37, in f\n    code\n' (traceback.format_list); the name runs to the line's end
_TRACEBACK_LINE = re.compile(r'\s*File "(.*)", line (\d{1,19}), in (.*)')


def parse_traceback_line(text: str) -> tuple[str, int, str]:
    """``(filename, line, name)`` of one formatted traceback entry; a string that is not one
    becomes a frame named after its first line, in file ``??``."""
    first = text.split("\n", 1)[0]
    m = _TRACEBACK_LINE.fullmatch(first)
    if m is None:
        return ("??", 0, first.strip())
    line = int(m.group(2))
    return (m.group(1), line if line <= INT64_MAX else -1, m.group(3))


def _frame_key(fr: Any) -> tuple[str, int, str]:
    """The content of one frame, checked: ``{filename: str, line: int, name: str}`` (C++ frames
    write ``line`` as a uint64 whose -1 means unknown; it becomes -1). Legacy ``cpp_frames``
    are preformatted strings."""
    if type(fr) is dict:
        filename = check_str(fr.get("filename", "??"), "filename")
        name = check_str(fr.get("name", "??"), "name")
        line = fr.get("line", 0)
        if type(line) is not int or not INT64_MIN <= line <= UINT64_MAX:
            raise FieldError("line", f"expected {int_range(-(2**63), 2**64)}, got {describe(line)}")
        return (filename, line if line <= INT64_MAX else -1, name)
    if type(fr) is str:
        return ("??", 0, fr)
    raise FieldError("", f"expected a frame (a dict of filename, line and name), got {describe(fr)}")


def _fx_of(fr: dict[str, Any]) -> tuple[str | None, ...] | None:
    """A frame's FX keys (``_snapshot(augment_with_fx_traces=True)``, torch >= 2.10, added by
    torch._utils._augment_memory_snapshot_stack_traces), or None when it has none."""
    values = tuple(fr.get(k) for k in FX_KEYS)
    if values.count(None) == len(values):
        return None
    for key, v in zip(FX_KEYS, values, strict=True):
        if v is not None and type(v) is not str:
            raise FieldError(key, f"expected a string, got {describe(v)}")
    return values


class _StackInterner:
    """Interns frames lists into stack ids and frame dicts into frame ids, checking each
    distinct object once. FieldErrors carry paths starting at ``frames``."""

    def __init__(self) -> None:
        self.by_obj: dict[int, int | None] = {}
        self.keep: list[Any] = []  # keeps interned objects alive so their id() stays unique
        self.by_content: dict[tuple[int, ...], int] = {}
        self.frame_by_obj: dict[int, int] = {}
        self.frame_by_content: dict[tuple[str, int, str], int] = {}
        self.frame_by_text: dict[str, int] = {}
        self.frames: list[tuple[str, int, str]] = []
        self.stack_rows: list[tuple[int, ...]] = []
        self.forward_by_obj: dict[int, int | None] = {}
        self.metadata: dict[str, int] = {"": 0}  # user_metadata strings (torch >= 2.10) -> code
        self.fx: dict[int, tuple[str | None, ...]] = {}  # frame_id -> its FX keys (FX_KEYS order)

    def _content_id(self, key: tuple[str, int, str]) -> int:
        fid = self.frame_by_content.get(key)
        if fid is None:
            fid = len(self.frames)
            self.frames.append(key)
            self.frame_by_content[key] = fid
        return fid

    def _frame_id(self, fr: Any) -> int:
        fid = self.frame_by_obj.get(id(fr))
        if fid is not None:
            return fid
        fid = self._content_id(_frame_key(fr))
        if type(fr) is dict and len(fr) > 3 and fid not in self.fx:
            fx = _fx_of(fr)
            if fx is not None:
                self.fx[fid] = fx
        self.frame_by_obj[id(fr)] = fid
        self.keep.append(fr)
        return fid

    def _stack_of(self, content: tuple[int, ...]) -> int | None:
        if not content:
            return None
        sid = self.by_content.get(content)
        if sid is None:
            sid = len(self.stack_rows)
            self.stack_rows.append(content)
            self.by_content[content] = sid
        return sid

    def intern(self, frames: Any) -> int | None:
        """Stack id for a frames list (None when there is no stack)."""
        key = id(frames)
        if key in self.by_obj:
            return self.by_obj[key]
        if type(frames) is not list:
            raise FieldError("frames", f"expected a list of frames, got {describe(frames)}")
        ids = []
        for k, f in enumerate(frames):
            try:
                ids.append(self._frame_id(f))
            except FieldError as exc:
                raise exc.under(f"frames[{k}]") from None
        sid = self._stack_of(tuple(ids))
        self.keep.append(frames)
        self.by_obj[key] = sid
        return sid

    def intern_forward(self, texts: Any) -> int | None:
        """Stack id for a ``forward_frames`` list (formatted traceback entries, outermost first
        as Python prints them; stacks are innermost first)."""
        key = id(texts)
        if key in self.forward_by_obj:
            return self.forward_by_obj[key]
        if type(texts) is not list:
            raise FieldError("forward_frames", f"expected a list of traceback strings, got {describe(texts)}")
        ids = []
        for k in range(len(texts) - 1, -1, -1):
            t = texts[k]
            if type(t) is not str:
                raise FieldError(f"forward_frames[{k}]", f"expected a traceback string, got {describe(t)}")
            fid = self.frame_by_text.get(t)
            if fid is None:
                fid = self.frame_by_text[t] = self._content_id(parse_traceback_line(t))
            ids.append(fid)
        sid = self._stack_of(tuple(ids))
        self.keep.append(texts)
        self.forward_by_obj[key] = sid
        return sid

    def fx_table(self) -> pd.DataFrame:
        if not self.fx:
            return empty_frame(FRAME_FX_SCHEMA)
        ids = sorted(self.fx)
        cols = {k: [self.fx[i][j] for i in ids] for j, k in enumerate(FX_KEYS)}
        return conform(pd.DataFrame({"frame_id": ids, **cols}), FRAME_FX_SCHEMA)

    def tables(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        if self.frames:
            fn, ln, nm = zip(*self.frames, strict=True)
            sf = pd.DataFrame({"frame_id": np.arange(len(self.frames)), "filename": fn, "line": ln, "name": nm})
        else:
            sf = empty_frame(STACK_FRAMES_SCHEMA)
        lengths = np.fromiter((len(r) for r in self.stack_rows), dtype=np.int64, count=len(self.stack_rows))
        if lengths.sum():
            st = pd.DataFrame(
                {
                    "stack_id": np.repeat(np.arange(len(self.stack_rows)), lengths),
                    "depth": np.concatenate([np.arange(n) for n in lengths]),
                    "frame_id": np.fromiter(
                        (f for r in self.stack_rows for f in r), dtype=np.int64, count=int(lengths.sum())
                    ),
                }
            )
        else:
            st = empty_frame(STACKS_SCHEMA)
        return conform(sf, STACK_FRAMES_SCHEMA), conform(st, STACKS_SCHEMA)


def _collect_segments_blocks(
    snap: Snapshot, interner: _StackInterner
) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """The rows of the segments and blocks frames, column by column, with their stacks interned."""
    seg_rows: dict[str, list[Any]] = {k: [] for k in SEGMENTS_SCHEMA}
    blk_rows: dict[str, list[Any]] = {k: [] for k in BLOCKS_SCHEMA}
    block_id = 0
    for sid, seg in enumerate(snap.segments):
        pool = seg["segment_type"]
        pid = seg["segment_pool_id"]
        private = pid != (0, 0)
        alloc = active = requested = 0
        for j, b in enumerate(seg["blocks"]):
            state = b["state"]
            if state == "active_allocated":
                alloc += b["size"]
                active += b["size"]
                requested += b["requested_size"]
            elif state == "active_pending_free":  # torch still counts its request (see metrics.torch_stats)
                active += b["size"]
                requested += b["requested_size"]
            try:
                stack_id = interner.intern(b["frames"])
                forward = b["forward_frames"]
                forward_id = None if forward is None else interner.intern_forward(forward)
            except FieldError as exc:
                raise exc.under(f"segments[{sid}].blocks[{j}]") from None
            blk_rows["block_id"].append(block_id)
            blk_rows["segment_id"].append(sid)
            blk_rows["device"].append(seg["device"])
            blk_rows["address"].append(b["address"])
            blk_rows["offset_bytes"].append(b["address"] - seg["address"])
            blk_rows["size_bytes"].append(b["size"])
            blk_rows["requested_size_bytes"].append(None if state == "inactive" else b["requested_size"])
            blk_rows["state"].append(state)
            blk_rows["stream"].append(seg["stream"])
            blk_rows["pool"].append(pool)
            blk_rows["is_private_pool"].append(private)
            blk_rows["is_expandable"].append(seg["is_expandable"])
            blk_rows["stack_id"].append(stack_id)
            blk_rows["forward_stack_id"].append(forward_id)
            block_id += 1
        try:
            seg_stack = interner.intern(seg["frames"])
        except FieldError as exc:
            raise exc.under(f"segments[{sid}]") from None
        seg_rows["segment_id"].append(sid)
        seg_rows["device"].append(seg["device"])
        seg_rows["address"].append(seg["address"])
        seg_rows["total_size_bytes"].append(seg["total_size"])
        seg_rows["allocated_bytes"].append(alloc)
        seg_rows["active_bytes"].append(active)
        seg_rows["requested_bytes"].append(requested)
        seg_rows["n_blocks"].append(len(seg["blocks"]))
        seg_rows["stream"].append(seg["stream"])
        seg_rows["pool"].append(pool)
        seg_rows["pool_id_0"].append(pid[0])
        seg_rows["pool_id_1"].append(pid[1])
        seg_rows["is_private_pool"].append(private)
        seg_rows["is_expandable"].append(seg["is_expandable"])
        seg_rows["stack_id"].append(seg_stack)
    return seg_rows, blk_rows


def _frame_of(rows: dict[str, list[Any]], schema: dict[str, object]) -> pd.DataFrame:
    return conform(pd.DataFrame(rows), schema) if rows["segment_id"] else empty_frame(schema)


_CHUNK = 1 << 17  # entries converted at a time: bounds the temporary per-entry Python objects
_ACTION_CODES = {a: i for i, a in enumerate(KNOWN_ACTIONS)}
_OOM = _ACTION_CODES["oom"]
_MISSING = INT64_MIN  # internal only: never leaves this module (absent keys, <NA> in the frames)

# The integer fields of a trace entry: (key, smallest allowed, default when absent). None as
# default: the key is required. Every one must be below 2**63.
_INT_FIELDS = (
    ("size", 0, None),
    ("addr", 0, _MISSING),
    ("stream", INT64_MIN, 0),
    ("time_us", 0, _MISSING),
)

_NO_FRAMES: list[Any] = []


def _values(chunk: list[Any], key: str, default: Any) -> Iterator[Any]:
    """``entry.get(key, default)`` of every entry, at C speed (TypeError on a non-dict entry)."""
    return map(dict.get, chunk, repeat(key), repeat(default))


def _int_column(chunk: list[Any], key: str, lo: int, default: int | None) -> np.ndarray:
    """One integer column of a chunk, exactly typed and in range, or TypeError/OverflowError/
    ValueError (the caller then finds the entry at fault). ``operator.index`` refuses floats,
    strings and None, which numpy would convert silently; numpy refuses ints beyond int64."""
    values = map(itemgetter(key), chunk) if default is None else _values(chunk, key, default)
    col = np.fromiter(map(operator.index, values), dtype=np.int64, count=len(chunk))
    if lo > INT64_MIN:
        low = col < lo
        if default == _MISSING:
            low &= col != _MISSING
        if low.any():
            raise ValueError(key)
        if default == _MISSING and lo >= 0 and (col == _MISSING).any():
            # absent, or really -2**63? only the entries that hold the key can tell
            missing = np.flatnonzero(col == _MISSING)
            if any(key in chunk[i] for i in missing):
                raise ValueError(key)
    return col


def _stack_groups(lists: list[Any]) -> tuple[np.ndarray, list[int]]:
    """Groups of frames lists by (length, identity of the first item): each list's group code,
    codes numbered in order of first appearance, and the position of each group's last member.
    TypeError (or KeyError) for a value that is not a sequence."""
    n = len(lists)
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=n)
    nonempty = lengths > 0
    firsts = np.zeros(n, dtype=np.uint64)  # every empty list falls in the group of length 0
    firsts[nonempty] = np.fromiter(
        map(id, map(itemgetter(0), compress(lists, nonempty.tolist()))), dtype=np.uint64, count=int(nonempty.sum())
    )
    first_codes, _ = pd.factorize(firsts)
    length_codes, length_values = pd.factorize(lengths)
    codes, _ = pd.factorize(first_codes.astype(np.int64) * len(length_values) + length_codes)
    return codes, _last_members(codes)


def _last_members(codes: np.ndarray) -> list[int]:
    """The position of each group's last member, for group codes numbered 0, 1, ... in order of
    first appearance (np.unique of the reversed codes finds them)."""
    return (len(codes) - 1 - np.unique(codes[::-1], return_index=True)[1]).tolist()


def _scanned_columns(chunk: list[Any]) -> tuple[tuple[np.ndarray, ...], _Groups] | None:
    """The compiled twin of ``_python_columns`` and ``_stack_groups`` (``frames/_scan.c``): the
    same columns and groups in one C pass, or None when it is not built or the chunk holds
    anything irregular (the Python code then converts the chunk and names the entry at fault)."""
    scan = compiled("snapshot_lab.frames._scan")
    if scan is None:
        return None
    out = scan.scan_chunk(chunk, _ACTION_CODES, _OOM)
    if out is None:
        return None
    action, *ints, group, last, same = out
    columns: tuple[np.ndarray, ...] = (
        np.frombuffer(action, dtype=np.int16),
        *(np.frombuffer(c, dtype=np.int64) for c in ints),
    )
    last_members: list[int] = np.frombuffer(last, dtype=np.int64).tolist()
    return columns, (np.frombuffer(group, dtype=np.int64), last_members, np.frombuffer(same, dtype=np.bool_))


# each entry's group code, each group's last member, and (when known) whether each entry's
# frames list equals its group's last one
_Groups = tuple[np.ndarray, list[int], np.ndarray]


def _stack_ids(chunk: list[Any], interner: _StackInterner, groups: _Groups | None = None) -> np.ndarray:
    """Stack id of every entry (``_MISSING`` for none), exactly, in a few C-level passes.

    Real pickles give every entry its own ``frames`` list but share the frame dicts. Entries are
    grouped by (stack depth, identity of the innermost frame) with numpy; the last entry of each
    group represents it and is interned once, and every entry is checked against it with list
    equality (identical frame objects compare in C at pointer speed; the comparison goes through
    a 1-tuple's ``in`` so that a list shared by many entries costs one pointer test each, not
    its length). Entries that differ from their representative are keyed by the identities of
    all their frames.
    """
    n = len(chunk)
    lists = list(_values(chunk, "frames", _NO_FRAMES))
    codes, last = _stack_groups(lists) if groups is None else groups[:2]
    representatives = [lists[i] for i in last]
    rep_sids = [interner.intern(rep) for rep in representatives]
    sids = np.array([_MISSING if sid is None else sid for sid in rep_sids], dtype=np.int64)[codes]
    if groups is None:
        singles = [(rep,) for rep in representatives]
        same = np.fromiter(map(operator.contains, map(singles.__getitem__, codes.tolist()), lists), dtype=bool, count=n)
    else:
        same = groups[2]
    differ = np.flatnonzero(~same)
    if differ.size:
        rest = [lists[i] for i in differ]
        keys: list[tuple[int, ...]] = list(map(tuple, map(map, repeat(id), rest)))
        sid_of: dict[tuple[int, ...], int] = {}
        for full_key, lst in dict(zip(keys, rest, strict=True)).items():
            sid_full = interner.intern(lst)
            sid_of[full_key] = _MISSING if sid_full is None else sid_full
        sids[differ] = np.fromiter(map(sid_of.__getitem__, keys), dtype=np.int64, count=len(keys))
    return sids


def _metadata_codes(chunk: list[Any], codes: dict[str, int]) -> np.ndarray:
    """Codes of every entry's ``user_metadata`` (``''`` when absent) in ``codes``, which grows
    with the strings first seen; TypeError for anything but a string. A trace holds few
    distinct strings (one per tagged module and phase): one pass to find them, one to code."""
    n = len(chunk)
    if operator.countOf(_values(chunk, "user_metadata", ""), "") == n:  # untagged: one C-level pass
        return np.zeros(n, dtype=np.int32)
    values = list(_values(chunk, "user_metadata", ""))
    for v in dict.fromkeys(values):  # TypeError on an unhashable value
        if v not in codes:
            if type(v) is not str:
                raise TypeError("user_metadata")
            codes[v] = len(codes)
    return np.fromiter(map(codes.__getitem__, values), dtype=np.int32, count=n)


def _forward_stack_ids(chunk: list[Any], interner: _StackInterner) -> np.ndarray:
    """``forward_stack_id`` of every entry (``_MISSING`` for none): most entries have no
    ``forward_frames``, so one C-level pass finds the few that do."""
    forward = list(_values(chunk, "forward_frames", None))
    out = np.full(len(chunk), _MISSING, dtype=np.int64)
    if forward.count(None) != len(forward):
        for i, texts in enumerate(forward):
            if texts is not None:
                sid = interner.intern_forward(texts)
                out[i] = _MISSING if sid is None else sid
    return out


class _TraceColumns:
    """Accumulates one device's columns chunk by chunk."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {
            k: [] for k in ("action", "address", "size", "stream", "time", "stack", "forward", "free", "metadata")
        }
        self.extra_actions: dict[str, int] = {}
        self.done = 0  # entries added so far
        self.pools: dict[int, tuple[int, int]] = {}  # position -> pool_id, when not (0, 0)
        self.contexts: dict[int, str] = {}  # position -> compile_context, when not 'N/A'

    def _details(self, chunk: list[Any]) -> None:
        """The chunk's pool ids and compiled regions, kept where informative. Both keys sit on
        every entry of newer files: one C-level count each finds the few that say something."""
        pools = list(_values(chunk, "pool_id", None))
        if pools.count(None) + operator.countOf(pools, _DEFAULT_POOL) != len(pools):
            for i, v in enumerate(pools):
                if v is not None and v != _DEFAULT_POOL and _pool_id(v) != _DEFAULT_POOL:
                    self.pools[self.done + i] = _pool_id(v)
        contexts = list(_values(chunk, "compile_context", _NO_REGION))
        if operator.countOf(contexts, _NO_REGION) != len(contexts):
            for i, c in enumerate(contexts):
                if c != _NO_REGION:
                    if type(c) is not str:
                        raise TypeError("compile_context")
                    self.contexts[self.done + i] = c

    def add(self, chunk: list[Any], interner: _StackInterner) -> None:
        scanned = _scanned_columns(chunk)
        if scanned is None:
            codes, size, address, stream, time, free = self._python_columns(chunk)
            groups = None
        else:
            (codes, size, address, stream, time, free), groups = scanned
        p = self.parts
        p["action"].append(codes)
        p["size"].append(size)
        p["address"].append(address)
        p["stream"].append(stream)
        p["time"].append(time)
        p["stack"].append(_stack_ids(chunk, interner, groups))
        p["forward"].append(_forward_stack_ids(chunk, interner))
        p["free"].append(free)
        p["metadata"].append(_metadata_codes(chunk, interner.metadata))
        self._details(chunk)
        self.done += len(chunk)

    def _python_columns(self, chunk: list[Any]) -> tuple[np.ndarray, ...]:
        """The action, size, address, stream, time and device_free columns, the reference way."""
        n = len(chunk)
        actions = list(map(itemgetter("action"), chunk))
        codes = np.fromiter(map(_ACTION_CODES.get, actions, repeat(-1)), dtype=np.int16, count=n)
        for i in np.flatnonzero(codes < 0):  # actions newer than this version of snaplab: keep them
            name = actions[i]
            if type(name) is not str:
                raise TypeError("action")
            codes[i] = len(KNOWN_ACTIONS) + self.extra_actions.setdefault(name, len(self.extra_actions))
        size, address, stream, time = (_int_column(chunk, *f) for f in _INT_FIELDS)
        free = np.full(n, _MISSING, dtype=np.int64)
        for i in np.flatnonzero(codes == _OOM):  # only oom entries carry device_free
            v = chunk[i].get("device_free")
            if v is not None:
                free[i] = check_int(v, 0, 2**63)
        return codes, size, address, stream, time, free

    def frame(self, device: int, metadata: list[str]) -> pd.DataFrame:
        col = {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in self.parts.items()}
        n = col["size"].size
        categories = KNOWN_ACTIONS + sorted(self.extra_actions, key=self.extra_actions.__getitem__)

        def nullable(a: np.ndarray) -> pd.arrays.IntegerArray:
            missing = a == _MISSING
            if missing.all():  # none recorded (forward stacks, device_free: the usual case)
                a = _filled(a.size, 0)
            return pd.arrays.IntegerArray(a, _unwritten_if_zero(missing))  # none missing: addresses

        return pd.DataFrame(
            {
                "device": _filled(n, device),
                "event_index": np.arange(n, dtype=np.int64),
                "action": pd.Categorical.from_codes(col["action"], categories=categories),  # type: ignore[call-overload]
                "address": nullable(col["address"]),
                "size_bytes": col["size"],
                "stream": _unwritten_if_zero(col["stream"]),  # one stream: the usual case
                "time_us": nullable(col["time"]),
                "stack_id": nullable(col["stack"]),
                "forward_stack_id": nullable(col["forward"]),
                "device_free_bytes": nullable(col["free"]),
                "user_metadata": pd.Categorical.from_codes(col["metadata"], categories=metadata),  # type: ignore[call-overload]
            },
            copy=False,  # the columns are fresh: no copy, and no consolidation into one block
        )


def _filled(n: int, value: int) -> np.ndarray:
    """``n`` int64s equal to ``value`` (zeros as ``_zeros`` makes them)."""
    return _zeros(n, np.int64) if value == 0 else np.full(n, value, dtype=np.int64)


def _unwritten_if_zero(a: np.ndarray) -> np.ndarray:
    """``a``, or when it holds only zeros ``_zeros`` in its place."""
    return a if a.any() else _zeros(a.size, a.dtype)


def _zeros(n: int, dtype: np.dtype | type) -> np.ndarray:
    """``n`` zeros in an anonymous mapping of their own, whose pages the kernel maps only when
    written: a column of zeros (device 0's number, one stream's, the values under an all-missing
    mask, a mask with nothing missing) costs no resident memory, in this process or a forked
    one. ``np.zeros`` may reuse written heap memory (glibc's mmap threshold moves up to 32 MiB)."""
    size = n * np.dtype(dtype).itemsize
    if size < 1 << 20 or not hasattr(mmap, "MAP_ANONYMOUS"):  # small (a page or two), or Windows
        return np.zeros(n, dtype=dtype)
    # private: a page read maps the kernel's zero page; a forked child's writes stay its own
    return np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=dtype)


_INT_RANGES = {key: (lo, 2**63) for key, lo, _ in _INT_FIELDS}
_DEFAULT_POOL = (0, 0)
_NO_REGION = "N/A"  # torch's compile_context outside a compiled region


def _pool_id(v: Any) -> tuple[int, int]:
    """A trace entry's ``pool_id`` (torch >= 2.12): two int64s, as segment_pool_id."""
    if type(v) not in (tuple, list) or len(v) != 2:
        raise FieldError("pool_id", f"expected two integers, got {describe(v)}")
    return (check_int(v[0], INT64_MIN, 2**63, "pool_id[0]"), check_int(v[1], INT64_MIN, 2**63, "pool_id[1]"))


def _check_entry(e: Any, interner: _StackInterner) -> None:
    """Every field of one trace entry that snaplab reads, in Python (the slow path)."""
    if type(e) is not dict:
        raise FieldError("", f"expected a trace entry (a dict), got {describe(e)}")
    action = e.get("action")
    if type(action) is not str:
        raise FieldError("action", f"expected a string, got {describe(action)}")
    for key, (lo, hi) in _INT_RANGES.items():
        if key in e or key == "size":
            check_int(e.get(key), lo, hi, key)
    if action == "oom" and e.get("device_free") is not None:
        check_int(e["device_free"], 0, 2**63, "device_free")
    if type(e.get("user_metadata", "")) is not str:
        raise FieldError("user_metadata", f"expected a string, got {describe(e['user_metadata'])}")
    if e.get("pool_id") is not None:
        _pool_id(e["pool_id"])
    if type(e.get("compile_context", "")) is not str:
        raise FieldError("compile_context", f"expected a string, got {describe(e['compile_context'])}")
    interner.intern(e.get("frames", _NO_FRAMES))
    if e.get("forward_frames") is not None:
        interner.intern_forward(e["forward_frames"])


def _explain(chunk: list[Any], offset: int, interner: _StackInterner, exc: BaseException) -> FieldError:
    """The first entry of a chunk that failed the fast path, and what is wrong with it."""
    for i, e in enumerate(chunk, offset):
        try:
            _check_entry(e, interner)
        except FieldError as err:
            return err.under(f"[{i}]")
    return FieldError("", f"malformed trace entry ({type(exc).__name__})")


def _add_checked(cols: _TraceColumns, chunk: list[Any], offset: int, interner: _StackInterner) -> None:
    try:
        cols.add(chunk, interner)
    except (FieldError, KeyError, TypeError, AttributeError, ValueError, OverflowError) as exc:
        raise _explain(chunk, offset, interner, exc) from None


def _trace_columns(tr: list[Any], interner: _StackInterner, consume: bool) -> _TraceColumns:
    cols = _TraceColumns()
    if consume:  # free the entry dicts as we go: the peak stays near that of pickle.load
        offset = 0
        while tr:
            chunk = tr[:_CHUNK]
            del tr[:_CHUNK]
            _add_checked(cols, chunk, offset, interner)
            offset += len(chunk)
            del chunk
    else:
        for start in range(0, len(tr), _CHUNK):
            _add_checked(cols, tr[start : start + _CHUNK], start, interner)
    return cols


class _DecodedStacks:
    """The decoder's distinct stacks as the lists the interner takes (one list object per stack
    key, made when first needed, so each is interned once), with each one's length and the
    identity of its first frame (what :func:`_stack_groups` groups by)."""

    def __init__(self, decoded: DecodedTraces) -> None:
        self.tuples = decoded.stacks
        n = len(self.tuples)
        lengths = np.fromiter(map(len, self.tuples), dtype=np.int64, count=n)
        firsts = np.fromiter((id(t[0]) if t else 0 for t in self.tuples), dtype=np.uint64, count=n)
        # one number per distinct (length, first frame): grouping a chunk is one factorize
        self.group = pd.factorize(pd.MultiIndex.from_arrays([lengths, firsts]))[0]
        self.lists: dict[int, list[Any]] = {}

    def list_of(self, key: int) -> list[Any]:
        lst = self.lists.get(key)
        if lst is None:
            lst = self.lists[key] = list(self.tuples[key])
        return lst


def _decoded_stack_ids(keys: np.ndarray, stacks: _DecodedStacks, interner: _StackInterner) -> np.ndarray:
    """What :func:`_stack_ids` gives for a chunk whose frames lists are the stacks ``keys``: the
    same groups, representatives, comparisons and interning order, hence the same ids."""
    codes, _ = pd.factorize(stacks.group[keys])  # numbered in order of first appearance
    last = _last_members(codes)
    rep_keys = keys[last]
    rep_sids = [interner.intern(stacks.list_of(k)) for k in rep_keys.tolist()]
    sids = np.array([_MISSING if sid is None else sid for sid in rep_sids], dtype=np.int64)[codes]
    reps = rep_keys[codes]
    same = keys == reps
    odd = np.flatnonzero(~same)
    if odd.size:  # different frame objects can still make equal lists (equal frame dicts)
        pairs = list(zip(keys[odd].tolist(), reps[odd].tolist(), strict=True))
        equal = {p for p in dict.fromkeys(pairs) if stacks.list_of(p[0]) == stacks.list_of(p[1])}
        if equal:
            same[odd] = [p in equal for p in pairs]
    differ = np.flatnonzero(~same)
    if differ.size:
        differing = keys[differ]
        sid_of = {}
        for key in pd.unique(differing).tolist():
            sid = interner.intern(stacks.list_of(key))
            sid_of[key] = _MISSING if sid is None else sid
        sids[differ] = np.fromiter(map(sid_of.__getitem__, differing.tolist()), dtype=np.int64, count=differ.size)
    return sids


def _decoded_codes(codes: np.ndarray, names: list[str], code_of: Any, dtype: type) -> np.ndarray:
    """``codes`` (into ``names``) recoded by ``code_of(name)``, called in order of each name's
    first appearance in ``codes`` (as the entry-by-entry path meets them)."""
    lut: np.ndarray = np.zeros(len(names), dtype=dtype)
    for code in pd.unique(codes).tolist():
        lut[code] = code_of(names[code])
    return lut[codes]


def _decoded_trace_columns(dev: DeviceTrace, stacks: _DecodedStacks, interner: _StackInterner) -> _TraceColumns:
    """One device's decoded trace as the same columns :meth:`_TraceColumns.add` makes, chunk by
    chunk where the order of interning matters (stacks, then forward stacks, per chunk)."""
    cols = _TraceColumns()
    extra = cols.extra_actions

    def action_code(name: str) -> int:
        known = _ACTION_CODES.get(name)
        return known if known is not None else len(KNOWN_ACTIONS) + extra.setdefault(name, len(extra))

    def metadata_code(name: str) -> int:
        return interner.metadata.setdefault(name, len(interner.metadata))

    p = cols.parts
    p["action"].append(_decoded_codes(dev.action, dev.action_names, action_code, np.int16))
    p["metadata"].append(_decoded_codes(dev.metadata, dev.metadata_names, metadata_code, np.int32))
    p["size"].append(dev.size)
    p["address"].append(dev.address)
    p["stream"].append(dev.stream)
    p["time"].append(dev.time_us)
    p["free"].append(dev.device_free)
    cols.pools = {row: _pool_id(v) for row, v in dev.pools.items()}
    cols.contexts = dict(dev.contexts)
    cols.done = dev.size_of_trace
    forward_rows = sorted(dev.forward)
    n = dev.size_of_trace
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        p["stack"].append(_decoded_stack_ids(dev.stack[start:stop], stacks, interner))
        forward = np.full(stop - start, _MISSING, dtype=np.int64)
        for row in forward_rows[bisect_left(forward_rows, start) : bisect_left(forward_rows, stop)]:
            sid = interner.intern_forward(dev.forward[row])
            forward[row - start] = _MISSING if sid is None else sid
        p["forward"].append(forward)
    return cols


def _collect_decoded(decoded: DecodedTraces, interner: _StackInterner) -> list[tuple[int, _TraceColumns]]:
    """Every device's decoded trace as columns (the decoder checked every field)."""
    stacks = _DecodedStacks(decoded)
    out = []
    for device, dev in enumerate(decoded.devices):
        if dev.size_of_trace:
            try:
                out.append((device, _decoded_trace_columns(dev, stacks, interner)))
            except FieldError as exc:
                raise exc.under(f"device_traces[{device}]") from None
    return out


def _collect_events(snap: Snapshot, interner: _StackInterner, consume: bool) -> list[tuple[int, _TraceColumns]]:
    """Every device's trace as checked columns."""
    if snap.decoded_traces is not None:
        return _collect_decoded(snap.decoded_traces, interner)
    out = []
    for device, tr in enumerate(snap.device_traces):
        if not tr:
            continue
        try:
            out.append((device, _trace_columns(tr, interner, consume)))
        except FieldError as exc:
            raise exc.under(f"device_traces[{device}]") from None
    return out


def _events_frame(columns: list[tuple[int, _TraceColumns]], metadata: list[str]) -> pd.DataFrame:
    parts = [cols.frame(device, metadata) for device, cols in columns]
    if not parts:
        return empty_frame(EVENTS_SCHEMA)
    if len(parts) == 1:
        return conform(parts[0], EVENTS_SCHEMA)
    categories = max((list(p["action"].cat.categories) for p in parts), key=len)
    for p in parts:
        p["action"] = p["action"].cat.set_categories(categories)
    return conform(pd.concat(parts, ignore_index=True), EVENTS_SCHEMA)


def _details_frame(columns: list[tuple[bool, int, _TraceColumns]]) -> pd.DataFrame:
    """The sparse ``event_details`` rows of every trace (device traces first, then the host's)."""
    rows: dict[str, list[Any]] = {k: [] for k in EVENT_DETAILS_SCHEMA}
    for host, device, cols in columns:
        for i in sorted(cols.pools.keys() | cols.contexts.keys()):
            pool = cols.pools.get(i)
            rows["host"].append(host)
            rows["device"].append(device)
            rows["event_index"].append(i)
            rows["pool_id_0"].append(None if pool is None else pool[0])
            rows["pool_id_1"].append(None if pool is None else pool[1])
            rows["compile_context"].append(cols.contexts.get(i))
    return conform(pd.DataFrame(rows), EVENT_DETAILS_SCHEMA) if rows["host"] else empty_frame(EVENT_DETAILS_SCHEMA)


@dataclass
class _HostParts:
    """Pinned host memory's rows (torch >= 2.14), interned after the device's."""

    segments: pd.DataFrame
    columns: _TraceColumns | None


def _collect_host(snap: Snapshot, interner: _StackInterner) -> _HostParts:
    if not snap.host_segments and not snap.host_traces:
        return _HostParts(empty_frame(SEGMENTS_SCHEMA), None)
    host = Snapshot(snap.source, snap.host_segments, [], None, [])
    try:
        seg_rows, _ = _collect_segments_blocks(host, interner)
    except FieldError as exc:  # paths below segments[i] are host_segments[i]'s
        raise FieldError(f"host_{exc.path}", exc.message) from None
    columns = None
    if snap.host_traces:
        try:
            columns = _trace_columns(snap.host_traces, interner, consume=False)
        except FieldError as exc:
            raise exc.under("host_traces") from None
    return _HostParts(_frame_of(seg_rows, SEGMENTS_SCHEMA), columns)


def _build_annotations(snap: Snapshot) -> pd.DataFrame:
    rows = snap.external_annotations  # checked by the loader
    if not rows:
        return empty_frame(ANNOTATIONS_SCHEMA)
    df = pd.DataFrame(
        {
            "device": [a["device"] for a in rows],
            "time_us": pd.array([a["time_us"] for a in rows], dtype="Int64"),
            "stage": [a["stage"] for a in rows],
            "name": [a["name"] for a in rows],
        }
    )
    return conform(df, ANNOTATIONS_SCHEMA)


_CPP_SUFFIXES = (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh", ".c")


def _stacks_kind(stack_frames: pd.DataFrame) -> str:
    if stack_frames.empty:
        return "none"
    fn = stack_frames["filename"].astype(str)
    cpp = fn.str.endswith(_CPP_SUFFIXES) | stack_frames["name"].astype(str).str.contains("::", regex=False)
    return "python+cpp" if bool(cpp.any()) else "python"


def _collect(
    snap: Snapshot, interner: _StackInterner, consume: bool
) -> tuple[dict[str, list[Any]], dict[str, list[Any]], list[tuple[int, _TraceColumns]], _HostParts]:
    try:
        with gc_paused():
            seg_rows, blk_rows = _collect_segments_blocks(snap, interner)
            columns = _collect_events(snap, interner, consume)
            host = _collect_host(snap, interner)
    except FieldError as exc:
        raise SnapshotFormatError(snap.source.path, str(exc)) from None
    return seg_rows, blk_rows, columns, host


def check_frames(snap: Snapshot) -> None:
    """Every check :func:`build_frames` makes (each trace entry's fields, every stack), without
    building the pandas frames: raises SnapshotFormatError exactly when build_frames would.
    The fuzzer runs it on every input; building the frames costs ten times more."""
    _collect(snap, _StackInterner(), consume=False)


def build_frames(snap: Snapshot, consume: bool = False) -> SnapshotFrames:
    """Turn a loaded snapshot into :class:`SnapshotFrames`.

    Raises :class:`~snapshot_lab.errors.SnapshotFormatError` naming the first field of a trace
    entry or a stack that no snapshot can hold. With ``consume=True`` the trace lists of
    ``snap`` are emptied while they are converted (or its decoded traces let go once converted),
    so their memory is released as the frames grow (use it when the snapshot is not needed
    after).
    """
    interner = _StackInterner()
    n_trace_devices = len(snap.device_traces if snap.decoded_traces is None else snap.decoded_traces.devices)
    seg_rows, blk_rows, columns, host = _collect(snap, interner, consume)
    if consume and snap.decoded_traces is not None:
        # the decoded columns not taken into the frames (stack keys, action and metadata codes)
        # are let go now, as the Python path empties the entry lists
        snap.device_traces = [[] for _ in range(n_trace_devices)]
        snap.decoded_traces = None
    segments, blocks = _frame_of(seg_rows, SEGMENTS_SCHEMA), _frame_of(blk_rows, BLOCKS_SCHEMA)
    metadata = list(interner.metadata)
    events = _events_frame(columns, metadata)
    host_events = empty_frame(EVENTS_SCHEMA) if host.columns is None else _events_frame([(-1, host.columns)], metadata)
    details = [(False, d, c) for d, c in columns] + ([] if host.columns is None else [(True, -1, host.columns)])
    event_details = _details_frame(details)
    del columns, details
    stack_frames, stacks = interner.tables()
    annotations = _build_annotations(snap)
    release_freed_memory()  # what building the frames freed, back to the system (glibc keeps it)
    # every _snapshot() call leaves a 'snapshot' marker in every device's trace: a device with
    # only those markers and no segments was never used by this process
    used = events.loc[events["action"] != "snapshot", "device"].unique().tolist()
    devices = sorted(set(segments["device"].tolist()) | set(used))
    info = SnapshotInfo(
        source=snap.source,
        legacy=snap.legacy,
        format_hints=tuple(snap.format_hints),
        allocator_settings=snap.allocator_settings,
        devices=tuple(int(d) for d in devices),
        trace_devices=tuple(int(d) for d in sorted(used)),
        n_trace_devices=n_trace_devices,
        stacks_kind=_stacks_kind(stack_frames),
        capture=snap.capture,
        max_entries=snap.max_entries,
        entries_left_out=snap.entries_left_out,
    )
    return SnapshotFrames(
        info=info,
        segments=segments,
        blocks=blocks,
        events=events,
        stack_frames=stack_frames,
        stacks=stacks,
        annotations=annotations,
        host_segments=host.segments,
        host_events=host_events,
        event_details=event_details,
        frame_fx=interner.fx_table(),
        backend=snap.backend,
    )


__all__ = ["SnapshotFrames", "SnapshotInfo", "build_frames", "check_frames", "parse_traceback_line"]
