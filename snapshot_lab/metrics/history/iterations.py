"""Training iterations: where each one starts in a device's trace.

Preferred source: ``external_annotations`` (torch >= 2.5 records ``record_function`` ranges while
history is recorded; every ``torch.optim`` optimizer wraps ``step()`` in one named
``Optimizer.step#<Class>.step``). Otherwise the trace's own repeating pattern: the allocation
site that fires once per iteration at a steady rhythm.

A repeating pattern alone is not an iteration: the layers of one deep model repeat too. An
iteration is something that ends, so a pattern counts only when its repetitions show it: each
holds a backward pass or an optimizer step, or memory returns towards where the repetition
started. One forward pass through 32 identical layers (``deep_forward_python``, and the C++-stack
``deep_llama_forward_all``) is one climb: every layer keeps what it saved for backward, nearly
all of its rise (median 97%), and the simpler rule took the layers for iterations and their
saved activations for a leak.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from ..categories import stack_categories, stack_threads
from ..categories.gradients import THREAD_CODES, thread_codes
from ..categories.stacks import module_call_stacks

# annotation name patterns, most specific first
_ANNOTATION_PATTERNS = (
    (r"^Optimizer\.step#", "optimizer step annotations (Optimizer.step#...)"),
    (r"optimi[sz]er[ _.-]?step", "optimizer step annotations"),
    (r"^ProfilerStep#", "profiler steps (ProfilerStep#N)"),
    (r"(?:train|training)[ _-]?(?:step|iter)", "training step annotations"),
    (r"step|iter", "step annotations"),
)
MIN_ITERATIONS = 3
# collectives torch records among the annotations (NCCL's ``nccl:all_gather``, ...): they run many
# times a step, and mark no iteration
_COLLECTIVE_PREFIXES = ("nccl:", "gloo:", "c10d::", "ncclKernel", "nccl_")


@dataclass(frozen=True)
class Iterations:
    device: int
    # event_index of the first event of each iteration (ascending)
    starts: np.ndarray
    source: str  # how they were found
    label: str | None  # annotation name or site that marks them

    @property
    def count(self) -> int:
        return int(self.starts.size)


def _from_annotations(
    events: pd.DataFrame,
    annotations: pd.DataFrame,
    device: int,
) -> tuple[Iterations | None, bool]:
    """Iterations from annotations, and whether step-like annotations exist at all (then a trace
    with too few of them is too short to judge: guessing from the pattern would be wrong)."""
    if annotations.empty or events["time_us"].isna().any():
        return None, False
    # annotations are per process, not per device: one process's iterations span all its devices
    starts = annotations[(annotations["stage"] == "START") & annotations["time_us"].notna()]
    starts = starts[~starts["name"].astype(str).str.startswith(_COLLECTIVE_PREFIXES)]
    names = starts["name"].astype(str)
    times = events["time_us"].to_numpy(dtype=np.int64)
    seen = False
    for pattern, source in _ANNOTATION_PATTERNS:
        chosen = starts[names.str.contains(pattern, case=False, regex=True)]
        seen = seen or len(chosen) > 0
        if len(chosen) < MIN_ITERATIONS:
            continue
        # one family only (e.g. "Optimizer.step#AdamW.step"), digits folded
        family = chosen["name"].map(lambda name: re.sub(r"\d+", "N", str(name)))
        top = family.value_counts().index[0]
        chosen = chosen[family == top]
        if len(chosen) < MIN_ITERATIONS:
            continue
        pos = np.searchsorted(times, chosen["time_us"].to_numpy(dtype=np.int64), side="left")
        pos = np.unique(pos[pos < len(times)])
        if pos.size >= MIN_ITERATIONS:
            return Iterations(device, events["event_index"].to_numpy()[pos], source, str(top)), True
    return None, seen


# a rhythm guessed from the trace needs more evidence than annotations
MIN_PATTERN_ITERATIONS = 6


MIN_ENDING_SHARE = 0.8  # of the repetitions that must show an end
# what a repetition may keep of its rise and still have "returned"
MAX_NET_RISE = 0.5


def _pattern_ends(frames: SnapshotFrames, events: pd.DataFrame, starts: np.ndarray) -> bool:
    """Whether the repetitions starting at ``starts`` (event indexes) end like iterations."""
    base = int(events["event_index"].iloc[0])
    pos = starts - base
    sid = events["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    threads = thread_codes(sid, stack_threads(frames))
    cats = stack_categories(frames)
    optim = np.isin(sid, cats.index[cats == "optimizer_state"].to_numpy(dtype=np.int64))
    marks = (threads == THREAD_CODES["autograd"]) | (threads == THREAD_CODES["none"]) | optim
    bounds = np.r_[pos, len(events)]
    with_end = sum(bool(marks[start:stop].any()) for start, stop in itertools.pairwise(bounds))
    if with_end >= MIN_ENDING_SHARE * pos.size:
        return True
    if _inside_one_call(frames, events, pos):
        return False
    action = events["action"].astype(str).to_numpy()
    size = events["size_bytes"].to_numpy()
    level = np.cumsum(np.where(action == "alloc", size, 0) - np.where(action == "free_completed", size, 0))
    kept = []
    for start, stop in itertools.pairwise(bounds):
        before = level[start - 1] if start > 0 else 0
        rise = level[start:stop].max() - before
        kept.append((level[stop - 1] - before) / rise if rise > 0 else 0.0)
    # and the last whole one has returned too: a forward whose first layers are frozen frees what
    # they make, and its trained layers then keep theirs (GPT-2 fine-tuned above its sixth block,
    # out of memory in its first forward: six layers were taken as iterations and the trained
    # ones' activations as a leak, fit_gpt2frozen_b32_oom_python)
    last_whole = kept[-2] if len(kept) >= 2 else kept[-1]
    return float(np.median(kept)) <= MAX_NET_RISE and last_whole <= MAX_NET_RISE


def _inside_one_call(frames: SnapshotFrames, events: pd.DataFrame, pos: np.ndarray) -> bool:
    """Whether every allocation from the first repetition on was made inside a module's call: the
    repetitions are the layers of one forward, not iterations (an iteration's inputs, loss or
    optimizer step are made outside the model). GPT-2 under ``torch.no_grad()``, out of memory in
    its sixth block, keeps each layer's KV cache: six layers were taken for iterations and the
    cache for a leak (``fit_gpt2infer_b54_oom_python``)."""
    tail = events.iloc[int(pos[0]) :]
    sid = tail.loc[(tail["action"] == "alloc") & tail["stack_id"].notna(), "stack_id"].to_numpy(dtype=np.int64)
    inside = module_call_stacks(frames)
    return bool(sid.size) and bool(inside) and bool(np.isin(sid, np.fromiter(inside, dtype=np.int64)).all())


def _from_pattern(events: pd.DataFrame, device: int) -> Iterations | None:
    """The allocation site that fires at the steadiest rhythm, least often (once per iteration
    rather than once per layer), over most of the trace."""
    allocs = events.loc[(events["action"] == "alloc") & events["stack_id"].notna(), ["stack_id", "event_index"]]
    if allocs.empty:
        return None
    n_events = len(events)
    best: tuple[int, float, int, np.ndarray] | None = None
    for sid, idx in allocs.groupby("stack_id")["event_index"]:
        pos = idx.to_numpy()
        if pos.size < MIN_PATTERN_ITERATIONS or pos.size > n_events // 3:
            continue
        gaps = np.diff(pos)
        if gaps.mean() <= 0 or gaps.std() / gaps.mean() > 0.35:
            continue
        if (pos[-1] - pos[0]) < 0.5 * n_events:
            continue
        key = (pos.size, float(gaps.std() / gaps.mean()), int(sid), pos)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return None
    return Iterations(device, best[3], "repeating allocation pattern", f"stack {best[2]}")


# a gap this many times the median one ends a group of repetitions
OUTER_GAP_FACTOR = 2.0


def _outer_loop(pattern: Iterations) -> Iterations:
    """The loop around the pattern, when its repetitions come in equal groups split by longer
    gaps: the layers of a model run once per batch (``deep_inference_python``: 32 layers x 3
    batches, where each layer frees what it allocated and the layer site fired 96 times). The
    groups are the iterations; a pattern with no such groups is returned as it is."""
    gaps = np.diff(pattern.starts)
    ends = np.flatnonzero(gaps > OUTER_GAP_FACTOR * np.median(gaps))
    if ends.size + 1 < MIN_ITERATIONS:
        return pattern
    group_starts = np.r_[0, ends + 1]
    sizes = np.diff(np.r_[group_starts, pattern.starts.size])
    # every group as long as the first (the last may be cut short by the dump)
    if sizes[0] < 2 or (sizes[:-1] != sizes[0]).any() or sizes[-1] > sizes[0]:
        return pattern
    return Iterations(
        pattern.device,
        pattern.starts[group_starts],
        f"repeating allocation pattern, in groups of {int(sizes[0])} (an outer loop: one group per iteration)",
        pattern.label,
    )


def find_iterations(frames: SnapshotFrames, device: int) -> Iterations | None:
    """Iteration starts of one device (None when fewer than three can be found)."""
    events = frames.device_events(device)
    if len(events) < 2:
        return None
    found, has_step_annotations = _from_annotations(events, frames.annotations, device)
    if found is not None:
        return found
    if has_step_annotations:
        return None
    pattern = _from_pattern(events, device)
    if pattern is None or not _pattern_ends(frames, events, pattern.starts):
        return None
    return _outer_loop(pattern)
