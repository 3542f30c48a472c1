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

    module: str  # fqn ('' is the root module) or, from stacks, the forward frame's label
    self_bytes: int  # live at the peak, allocated while this module was the innermost
    inclusive_bytes: int  # the same, with every module inside this one (tags only; else = self)
    by_phase: dict[str, int]  # self bytes at the peak by phase: fwd / bwd / rec
    by_category: dict[str, int]  # self bytes at the peak by category
    peak_bytes: int  # the most self bytes alive at any moment of the trace
    allocated_bytes: int  # every allocation of the trace made by this module, summed
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
    outside_bytes: int  # live at the peak, allocated in the trace outside any module
    before_trace_bytes: int  # live at the peak, allocated before the trace began
    rows: tuple[ModuleRow, ...]
    note: str
    phase_totals: dict[str, int] = field(default_factory=dict)  # every row's self bytes by phase

    @property
    def module_bytes(self) -> int:
        return sum(r.self_bytes for r in self.rows)

    def largest(self, limit: int) -> list[ModuleRow]:
        """The ``limit`` rows holding the most bytes at the peak by themselves (none with 0)."""
        rows = sorted(self.rows, key=lambda r: (-r.self_bytes, r.module))[:limit]
        return [r for r in rows if r.self_bytes]

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
            "modules": [r.to_dict() for r in self.rows],
        }


# --------------------------------------------------------------------------- attribution


@dataclass(frozen=True)
class _Attribution:
    """Per allocation (a row of the lifetimes): a module code (-1: none) and a phase code."""

    names: list[str]  # module code -> name
    module: np.ndarray  # int64 per allocation
    phase: np.ndarray  # int8 per allocation: index into PHASE_NAMES, -1 for none
    source: str


def _from_tags(events: pd.DataFrame, lifetimes: pd.DataFrame) -> _Attribution | None:
    md = events["user_metadata"]
    cats = list(md.cat.categories)
    if not any(cats):
        return None
    codes = md.cat.codes.to_numpy()[lifetimes["event_index"].to_numpy(dtype=np.int64)]
    index: dict[str, int] = {}  # module name -> code, in the order first seen
    mod_of_cat = np.full(len(cats) + 1, _NO_MODULE, dtype=np.int64)
    phase_of_cat = np.full(len(cats) + 1, -1, dtype=np.int8)
    for c, text in enumerate(cats):
        if not text:
            continue
        parsed = parse_tag(text)
        if parsed is None:  # the program's own metadata: a row of its own, no phase
            name = f"metadata {text!r}"
        else:
            phase_of_cat[c] = PHASE_NAMES.index(parsed[0])
            name = parsed[1]
        mod_of_cat[c] = index.setdefault(name, len(index))
    return _Attribution(list(index), mod_of_cat[codes], phase_of_cat[codes], "tags")


def _forward_frames(frames: SnapshotFrames) -> pd.Series:
    """The innermost Python frame named ``forward`` of every stack that has one, as a label."""
    sf, st = frames.stack_frames, frames.stacks
    if sf.empty or st.empty:
        return pd.Series([], dtype=object)
    fwd = sf[(sf["name"] == "forward") & sf["filename"].astype(str).str.endswith(".py")]
    if fwd.empty:
        return pd.Series([], dtype=object)
    labels = pd.Series(
        [frame_label(f, int(ln), n) for f, ln, n in fwd[["filename", "line", "name"]].itertuples(index=False)],
        index=fwd["frame_id"].to_numpy(),
    )
    hit = st[st["frame_id"].isin(labels.index)].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id")
    return pd.Series(labels.reindex(hit["frame_id"]).to_numpy(), index=hit["stack_id"].to_numpy(), dtype=object)


def _from_stacks(frames: SnapshotFrames, device: int, lifetimes: pd.DataFrame) -> _Attribution:
    sid = lifetimes["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    fwd = memo(frames, "forward_frame_labels", lambda: _forward_frames(frames))
    # anomaly mode: the forward stack that created a backward allocation's autograd node
    fwd_ids = allocation_forward_ids(frames, device, lifetimes["event_index"].to_numpy(dtype=np.int64))
    codes, uniq = pd.factorize(fwd.to_numpy())
    names = [str(u) for u in uniq]
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
    phase[in_forward] = np.where(backward[in_forward], PHASE_NAMES.index("rec"), PHASE_NAMES.index("fwd"))
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


def _self_peaks(module: np.ndarray, lifetimes: pd.DataFrame, sizes: np.ndarray, n_modules: int) -> np.ndarray:
    """The most bytes alive at once, per module, over the trace (allocations of the module only)."""
    has = module != _NO_MODULE
    start = lifetimes["event_index"].to_numpy(dtype=np.int64)[has]
    end = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)[has]
    mod, size = module[has], sizes[has]
    freed = end >= 0
    t = np.concatenate([start, end[freed]])
    m = np.concatenate([mod, mod[freed]])
    d = np.concatenate([size, -size[freed]])
    order = np.lexsort((t, m))
    m, d = m[order], d[order]
    level = np.cumsum(d)
    first = np.flatnonzero(np.r_[True, m[1:] != m[:-1]]) if m.size else np.array([], dtype=np.int64)
    base = np.zeros_like(level)
    if m.size:
        before = np.r_[0, level[first[1:] - 1]]  # the running total where each module's run begins
        base = np.repeat(before, np.diff(np.r_[first, m.size]))
    peaks = np.zeros(n_modules, dtype=np.int64)
    if m.size:
        np.maximum.at(peaks, m, level - base)
    return peaks


def _ancestors(names: list[str], source: str) -> list[list[int]]:
    """For each module code, the codes of the modules that enclose it (tags only)."""
    if source != "tags":
        return [[] for _ in names]
    code = {n: i for i, n in enumerate(names)}
    out = []
    for n in names:
        chain: list[int] = []
        p = parent_fqn(n) if not n.startswith("metadata ") else None
        while p is not None:
            if p in code:
                chain.append(code[p])
            p = parent_fqn(p)
        out.append(chain)
    return out


def _inclusive(self_bytes: np.ndarray, names: list[str], source: str) -> np.ndarray:
    """Each module's self bytes plus those of every module inside it (tags only)."""
    inclusive = self_bytes.copy()
    for code, chain in enumerate(_ancestors(names, source)):
        for a in chain:
            inclusive[a] += self_bytes[code]
    return inclusive


def _depth(name: str, source: str) -> int:
    if source != "tags" or not name or name.startswith("metadata "):
        return 0
    return name.count(".") + 1


def module_breakdown(frames: SnapshotFrames, device: int, limit: int | None = None) -> ModuleBreakdown:
    """Bytes by module at the device's peak (the requested peak of its timeline; see the module
    docstring); ``limit``: keep the rows with the most inclusive bytes (the totals count all)."""
    return memo(frames, ("modules", device, limit), lambda: _breakdown(frames, device, limit))


def _attribution(
    frames: SnapshotFrames, device: int, events: pd.DataFrame, lifetimes: pd.DataFrame
) -> tuple[_Attribution, str]:
    """The tags where the recording has them, else the stacks; and the note that says which."""
    attribution = _from_tags(events, lifetimes)
    if attribution is not None:
        return attribution, "From the module tags (user_metadata), exact"
    has_key = "user_metadata (torch>=2.10)" in frames.info.format_hints
    note = (
        "Approximated from the stacks: each allocation is put on the innermost forward() frame of its "
        "stack (a line of a module's code, not a module instance); backward allocations on the forward line "
        "that created their autograd node where the recording has forward stacks (anomaly mode), else on "
        "no module; "
        + (
            "record with snaplab run / recording() to tag allocations by module"
            if has_key
            else NEEDS + ", and snaplab run / recording() to tag them"
        )
    )
    return _from_stacks(frames, device, lifetimes), note


def _breakdown(frames: SnapshotFrames, device: int, limit: int | None) -> ModuleBreakdown:
    ev = frames.events[frames.events["device"] == device]
    ts = compute_torch_stats(
        frames.segments[frames.segments["device"] == device], frames.blocks[frames.blocks["device"] == device]
    )
    requested_at_end = ts["requested_bytes.all.current"]
    tl = device_timeline(frames, device, requested_at_end, ts["reserved_bytes.all.current"])
    if tl is None:
        return ModuleBreakdown(device, "none", None, requested_at_end, 0, requested_at_end, (), "no trace recorded")
    lifetimes = device_lifetimes(frames, device)
    attribution, note = _attribution(frames, device, ev, lifetimes)
    names, module, phase = attribution.names, attribution.module, attribution.phase
    sizes = lifetimes["size_bytes"].to_numpy(dtype=np.int64)
    start = lifetimes["event_index"].to_numpy(dtype=np.int64)
    end = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).max)
    alive = (start <= tl.peak_index) & (end > tl.peak_index)
    cat_codes = categorize(frames).alloc_codes.get(device, np.full(sizes.size, len(CATEGORIES) - 1))
    n = len(names)
    a_mod, a_size, a_phase, a_cat = module[alive], sizes[alive], phase[alive], cat_codes[alive]
    in_mod = a_mod != _NO_MODULE
    self_bytes = np.bincount(a_mod[in_mod], weights=a_size[in_mod], minlength=n).astype(np.int64)
    by_phase = np.zeros((n, len(PHASE_NAMES)), dtype=np.int64)
    with_phase = in_mod & (a_phase >= 0)
    np.add.at(by_phase, (a_mod[with_phase], a_phase[with_phase]), a_size[with_phase])
    by_cat = np.zeros((n, len(CATEGORIES)), dtype=np.int64)
    np.add.at(by_cat, (a_mod[in_mod], a_cat[in_mod]), a_size[in_mod])
    has = module != _NO_MODULE
    allocated = np.bincount(module[has], weights=sizes[has], minlength=n).astype(np.int64)
    counts = np.bincount(module[has], minlength=n)
    peaks = _self_peaks(module, lifetimes, sizes, n)
    inclusive = _inclusive(self_bytes, names, attribution.source)
    outside = int(a_size[~in_mod].sum())
    before = int(tl.peak_requested_bytes) - int(a_size.sum())
    rows = [
        ModuleRow(
            module=names[i],
            self_bytes=int(self_bytes[i]),
            inclusive_bytes=int(inclusive[i]),
            by_phase={p: int(by_phase[i, k]) for k, p in enumerate(PHASE_NAMES) if by_phase[i, k]},
            by_category={c: int(by_cat[i, k]) for k, c in enumerate(CATEGORIES) if by_cat[i, k]},
            peak_bytes=int(peaks[i]),
            allocated_bytes=int(allocated[i]),
            allocations=int(counts[i]),
            depth=_depth(names[i], attribution.source),
        )
        for i in range(n)
    ]
    rows.sort(key=lambda r: (-r.inclusive_bytes, -r.peak_bytes, r.module))
    totals = {p: int(by_phase[:, k].sum()) for k, p in enumerate(PHASE_NAMES)}
    return ModuleBreakdown(
        device=device,
        source=attribution.source,
        peak_index=tl.peak_index,
        peak_bytes=int(tl.peak_requested_bytes),
        outside_bytes=outside,
        before_trace_bytes=before,
        rows=tuple(rows[:limit] if limit is not None else rows),
        note=note,
        phase_totals=totals,
    )
