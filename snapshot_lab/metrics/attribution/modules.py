"""Memory by module: which module instance (``transformer.h.3.attn``) holds the bytes at the peak.

Two sources, in this order:

* **tags** (exact): allocations recorded under :func:`snapshot_lab.module_tags.tag_modules`
  (``snaplab run``, ``recording()``, the framework callbacks) carry ``user_metadata`` naming the
  innermost module whose forward (``fwd:``), backward (``bwd:``) or recomputed forward
  (``rec:``) made them (PyTorch >= 2.10). Allocations with ``''`` were made outside any module
  (the optimizer, the data, the loss), and metadata that snaplab did not write is kept as its own
  row, under its own text.
* **stacks** (an approximation, labelled as one): without tags, each allocation whose Python
  stack runs through a ``forward`` method is put on the innermost such frame (a line of a
  module's code, not a module instance: the layers of a stack share it); allocations by the
  backward pass are "backward, module unknown" unless their stack runs through a forward (a
  recomputed forward under activation checkpointing); the rest is outside any module.

Every row counts *self* bytes (allocated while the module itself was innermost) and, for tags,
*inclusive* bytes (the module and everything inside it). The totals add up exactly: the self
bytes of every row, plus the bytes allocated outside any module, plus those allocated before the
trace began (their module cannot be known), equal the bytes allocated at the peak.

Pure functions on the frames; ``parse_tag`` is the tag format's one definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from ...module_tags import NEEDS, PHASES, parent_fqn, parse_tag
from .._memo import memo
from ..categories import CATEGORIES, categorize
from ..categories.gradients import THREAD_CODES, thread_codes
from ..categories.stacks import stack_threads
from ..history.lifetimes import device_lifetimes
from ..history.timeline import device_timeline
from ..stats.torch_stats import compute_torch_stats
from .sites import allocation_forward_ids, frame_label

ROOT_LABEL = "<model>"  # the tagged model's own forward code (fqn '')
UNKNOWN_BACKWARD = "<backward, module unknown>"
OUTSIDE_ROW = "<outside any module>"
BEFORE_ROW = "<allocated before the trace>"
PHASE_NAMES = tuple(PHASES)  # fwd, bwd, rec
_NO_MODULE = -1


@dataclass(frozen=True)
class ModuleRow:
    """One module (tags) or one forward line (stacks). Bytes are requested bytes."""

    # fqn ('' is the root module) or, from stacks, the forward frame's label
    module: str
    # live at the peak, allocated while this module was the innermost
    self_bytes: int
    # the same, with every module inside this one (tags only; else = self)
    inclusive_bytes: int
    by_phase: dict[str, int]  # self bytes at the peak by phase: fwd / bwd / rec
    by_category: dict[str, int]  # self bytes at the peak by category
    peak_bytes: int  # the most self bytes alive at any moment of the trace
    # every allocation of the trace made by this module, summed
    allocated_bytes: int
    allocations: int  # how many of them
    depth: int  # nesting depth (0 = the root or a top-level module)

    @property
    def label(self) -> str:
        return self.module if self.module else ROOT_LABEL

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "self_bytes_at_peak": self.self_bytes,
            "inclusive_bytes_at_peak": self.inclusive_bytes,
            "by_phase_at_peak": self.by_phase,
            "by_category_at_peak": self.by_category,
            "peak_self_bytes": self.peak_bytes,
            "allocated_bytes": self.allocated_bytes,
            "allocations": self.allocations,
            "depth": self.depth,
        }


@dataclass(frozen=True)
class ModuleBreakdown:
    device: int
    source: str  # "tags", "stacks" (approximation) or "none"
    peak_index: int | None
    peak_bytes: int  # bytes allocated (requested) at the peak
    # live at the peak, allocated in the trace outside any module
    outside_bytes: int
    # live at the peak, allocated before the trace began
    before_trace_bytes: int
    rows: tuple[ModuleRow, ...]
    note: str
    # every row's self bytes by phase
    phase_totals: dict[str, int] = field(default_factory=dict)

    @property
    def module_bytes(self) -> int:
        return sum(row.self_bytes for row in self.rows)

    def largest(self, limit: int) -> list[ModuleRow]:
        """The ``limit`` rows holding the most bytes at the peak by themselves (none with 0)."""
        rows = sorted(self.rows, key=lambda row: (-row.self_bytes, row.module))[:limit]
        return [row for row in rows if row.self_bytes]

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "source": self.source,
            "approximate": self.source != "tags",
            "note": self.note,
            "peak_index": self.peak_index,
            "peak_bytes": self.peak_bytes,
            "module_bytes_at_peak": self.module_bytes,
            "outside_any_module_bytes_at_peak": self.outside_bytes,
            "before_trace_bytes_at_peak": self.before_trace_bytes,
            "by_phase_at_peak": self.phase_totals,
            "modules": [row.to_dict() for row in self.rows],
        }


# --------------------------------------------------------------------------- attribution


@dataclass(frozen=True)
class _Attribution:
    """Per allocation (a row of the lifetimes): a module code (-1: none) and a phase code."""

    names: list[str]  # module code -> name
    module: np.ndarray  # int64 per allocation
    # int8 per allocation: index into PHASE_NAMES, -1 for none
    phase: np.ndarray
    source: str


def _from_tags(events: pd.DataFrame, lifetimes: pd.DataFrame) -> _Attribution | None:
    metadata = events["user_metadata"]
    cats = list(metadata.cat.categories)
    if not any(cats):
        return None
    codes = metadata.cat.codes.to_numpy()[lifetimes["event_index"].to_numpy(dtype=np.int64)]
    index: dict[str, int] = {}  # module name -> code, in the order first seen
    mod_of_cat = np.full(len(cats) + 1, _NO_MODULE, dtype=np.int64)
    phase_of_cat = np.full(len(cats) + 1, -1, dtype=np.int8)
    for cat_code, text in enumerate(cats):
        if not text:
            continue
        parsed = parse_tag(text)
        if parsed is None:
            # the program's own metadata: a row of its own, no phase
            name = f"metadata {text!r}"
        else:
            phase_of_cat[cat_code] = PHASE_NAMES.index(parsed[0])
            name = parsed[1]
        mod_of_cat[cat_code] = index.setdefault(name, len(index))
    return _Attribution(list(index), mod_of_cat[codes], phase_of_cat[codes], "tags")


def _forward_frames(frames: SnapshotFrames) -> pd.Series:
    """The innermost Python frame named ``forward`` of every stack that has one, as a label."""
    frame_table, stacks = frames.stack_frames, frames.stacks
    if frame_table.empty or stacks.empty:
        return pd.Series([], dtype=object)
    fwd = frame_table[(frame_table["name"] == "forward") & frame_table["filename"].astype(str).str.endswith(".py")]
    if fwd.empty:
        return pd.Series([], dtype=object)
    labels = pd.Series(
        [
            frame_label(filename, int(line), name)
            for filename, line, name in fwd[["filename", "line", "name"]].itertuples(index=False)
        ],
        index=fwd["frame_id"].to_numpy(),
    )
    hit = stacks[stacks["frame_id"].isin(labels.index)].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id")
    return pd.Series(
        labels.reindex(hit["frame_id"]).to_numpy(),
        index=hit["stack_id"].to_numpy(),
        dtype=object,
    )


def _from_stacks(frames: SnapshotFrames, device: int, lifetimes: pd.DataFrame) -> _Attribution:
    sid = lifetimes["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    fwd = memo(frames, "forward_frame_labels", lambda: _forward_frames(frames))
    # anomaly mode: the forward stack that created a backward allocation's autograd node
    fwd_ids = allocation_forward_ids(
        frames,
        device,
        lifetimes["event_index"].to_numpy(dtype=np.int64),
    )
    codes, uniq = pd.factorize(fwd.to_numpy())
    names = [str(label) for label in uniq]
    # module code per stack id; ids -1 (no stack) read the last slot: no module
    size = max(int(sid.max(initial=-1)), int(fwd.index.max()) if len(fwd) else -1) + 2
    if fwd_ids is not None:
        size = max(size, int(fwd_ids.max(initial=-1)) + 2)
    table = np.full(size, _NO_MODULE, dtype=np.int64)
    table[fwd.index.to_numpy(dtype=np.int64)] = codes
    module = table[sid]
    phase = np.full(sid.size, -1, dtype=np.int8)
    threads = thread_codes(sid, stack_threads(frames))
    # no stack at all: with stacks='python', autograd's thread records no frames
    backward = (threads == THREAD_CODES["autograd"]) | (threads == THREAD_CODES["none"])
    in_forward = module != _NO_MODULE
    phase[in_forward] = np.where(
        backward[in_forward],
        PHASE_NAMES.index("rec"),
        PHASE_NAMES.index("fwd"),
    )
    lost = backward & ~in_forward
    if fwd_ids is not None:
        by_forward = table[fwd_ids]
        named = lost & (by_forward != _NO_MODULE)
        module[named] = by_forward[named]
        phase[named] = PHASE_NAMES.index("bwd")
        lost &= ~named
    if lost.any():
        module[lost] = len(names)
        phase[lost] = PHASE_NAMES.index("bwd")
        names.append(UNKNOWN_BACKWARD)
    return _Attribution(names, module, phase, "stacks")


# --------------------------------------------------------------------------- the breakdown


def _self_peaks(
    module: np.ndarray,
    lifetimes: pd.DataFrame,
    sizes: np.ndarray,
    n_modules: int,
) -> np.ndarray:
    """The most bytes alive at once, per module, over the trace (allocations of the module only)."""
    has = module != _NO_MODULE
    end = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)[has]
    freed = end >= 0
    times = np.concatenate([lifetimes["event_index"].to_numpy(dtype=np.int64)[has], end[freed]])
    del end
    mod, size = module[has], sizes[has]
    mods = np.concatenate([mod, mod[freed]])
    deltas = np.concatenate([size, -size[freed]])
    del mod, size, freed
    order = np.lexsort((times, mods))
    del times  # each step lets go of what it read: at 5M entries this peaked 100 MiB higher
    mods = mods[order]
    deltas = deltas[order]
    del order
    level = np.cumsum(deltas, out=deltas)
    peaks = np.zeros(n_modules, dtype=np.int64)
    if mods.size:
        first = np.flatnonzero(np.r_[True, mods[1:] != mods[:-1]])
        # the running total where each module's run begins, taken off its run
        before = np.r_[0, level[first[1:] - 1]]
        level -= np.repeat(before, np.diff(np.r_[first, mods.size]))
        np.maximum.at(peaks, mods, level)
    return peaks


def _ancestors(names: list[str], source: str) -> list[list[int]]:
    """For each module code, the codes of the modules that enclose it (tags only)."""
    if source != "tags":
        return [[] for _ in names]
    code = {name: i for i, name in enumerate(names)}
    out = []
    for name in names:
        chain: list[int] = []
        parent = parent_fqn(name) if not name.startswith("metadata ") else None
        while parent is not None:
            if parent in code:
                chain.append(code[parent])
            parent = parent_fqn(parent)
        out.append(chain)
    return out


def _inclusive(self_bytes: np.ndarray, names: list[str], source: str) -> np.ndarray:
    """Each module's self bytes plus those of every module inside it (tags only)."""
    inclusive = self_bytes.copy()
    for code, chain in enumerate(_ancestors(names, source)):
        for ancestor in chain:
            inclusive[ancestor] += self_bytes[code]
    return inclusive


def _depth(name: str, source: str) -> int:
    if source != "tags" or not name or name.startswith("metadata "):
        return 0
    return name.count(".") + 1


def module_breakdown(
    frames: SnapshotFrames,
    device: int,
    limit: int | None = None,
) -> ModuleBreakdown:
    """Bytes by module at the device's peak (the requested peak of its timeline; see the module
    docstring); ``limit``: keep the rows with the most inclusive bytes (the totals count all)."""
    return memo(frames, ("modules", device, limit), lambda: _breakdown(frames, device, limit))


# the note that says where the module view's numbers come from
NOTE_FROM_TAGS = "From the module tags (user_metadata), exact"
NOTE_FROM_STACKS = (
    "Approximated from the stacks: each allocation is put on the innermost forward() frame of its "
    "stack (a line of a module's code, not a module instance); backward allocations on the forward line "
    "that created their autograd node where the recording has forward stacks (anomaly mode), else on "
    "no module; "
)
ADVICE_TAG = "record with snaplab run / recording() to tag allocations by module"
ADVICE_NEEDS_TAGS = ", and snaplab run / recording() to tag them"


def _attribution(
    frames: SnapshotFrames, device: int, events: pd.DataFrame, lifetimes: pd.DataFrame
) -> tuple[_Attribution, str]:
    """The tags where the recording has them, else the stacks; and the note that says which."""
    attribution = _from_tags(events, lifetimes)
    if attribution is not None:
        return attribution, NOTE_FROM_TAGS
    has_key = "user_metadata (torch>=2.10)" in frames.info.format_hints
    advice = ADVICE_TAG if has_key else NEEDS + ADVICE_NEEDS_TAGS
    return _from_stacks(frames, device, lifetimes), NOTE_FROM_STACKS + advice


def _breakdown(frames: SnapshotFrames, device: int, limit: int | None) -> ModuleBreakdown:
    events = frames.device_events(device)
    torch_stats = compute_torch_stats(
        frames.segments[frames.segments["device"] == device], frames.blocks[frames.blocks["device"] == device]
    )
    requested_at_end = torch_stats["requested_bytes.all.current"]
    timeline = device_timeline(
        frames,
        device,
        requested_at_end,
        torch_stats["reserved_bytes.all.current"],
    )
    if timeline is None:
        return ModuleBreakdown(
            device,
            "none",
            None,
            requested_at_end,
            0,
            requested_at_end,
            (),
            "no trace recorded",
        )
    lifetimes = device_lifetimes(frames, device)
    attribution, note = _attribution(frames, device, events, lifetimes)
    names, module, phase = attribution.names, attribution.module, attribution.phase
    sizes = lifetimes["size_bytes"].to_numpy(dtype=np.int64)
    start = lifetimes["event_index"].to_numpy(dtype=np.int64)
    end = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).max)
    alive = (start <= timeline.peak_index) & (end > timeline.peak_index)
    cat_codes = categorize(frames).alloc_codes.get(device, np.full(sizes.size, len(CATEGORIES) - 1))
    n_modules = len(names)
    a_mod, a_size, a_phase, a_cat = module[alive], sizes[alive], phase[alive], cat_codes[alive]
    in_mod = a_mod != _NO_MODULE
    self_bytes = np.bincount(a_mod[in_mod], weights=a_size[in_mod], minlength=n_modules).astype(np.int64)
    by_phase = np.zeros((n_modules, len(PHASE_NAMES)), dtype=np.int64)
    with_phase = in_mod & (a_phase >= 0)
    np.add.at(by_phase, (a_mod[with_phase], a_phase[with_phase]), a_size[with_phase])
    by_cat = np.zeros((n_modules, len(CATEGORIES)), dtype=np.int64)
    np.add.at(by_cat, (a_mod[in_mod], a_cat[in_mod]), a_size[in_mod])
    has = module != _NO_MODULE
    allocated = np.bincount(module[has], weights=sizes[has], minlength=n_modules).astype(np.int64)
    counts = np.bincount(module[has], minlength=n_modules)
    peaks = _self_peaks(module, lifetimes, sizes, n_modules)
    inclusive = _inclusive(self_bytes, names, attribution.source)
    outside = int(a_size[~in_mod].sum())
    before = int(timeline.peak_requested_bytes) - int(a_size.sum())
    rows = [
        ModuleRow(
            module=names[i],
            self_bytes=int(self_bytes[i]),
            inclusive_bytes=int(inclusive[i]),
            by_phase={
                phase_name: int(by_phase[i, column])
                for column, phase_name in enumerate(PHASE_NAMES)
                if by_phase[i, column]
            },
            by_category={
                category: int(by_cat[i, column]) for column, category in enumerate(CATEGORIES) if by_cat[i, column]
            },
            peak_bytes=int(peaks[i]),
            allocated_bytes=int(allocated[i]),
            allocations=int(counts[i]),
            depth=_depth(names[i], attribution.source),
        )
        for i in range(n_modules)
    ]
    rows.sort(key=lambda row: (-row.inclusive_bytes, -row.peak_bytes, row.module))
    totals = {phase_name: int(by_phase[:, column].sum()) for column, phase_name in enumerate(PHASE_NAMES)}
    return ModuleBreakdown(
        device=device,
        source=attribution.source,
        peak_index=timeline.peak_index,
        peak_bytes=int(timeline.peak_requested_bytes),
        outside_bytes=outside,
        before_trace_bytes=before,
        rows=tuple(rows[:limit] if limit is not None else rows),
        note=note,
        phase_totals=totals,
    )
