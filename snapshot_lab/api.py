"""The Python API: the same operations as the command line, with the same names and options.

>>> import snapshot_lab
>>> s = snapshot_lab.stats("sample_snapshots/oom_fragmentation.pickle.gz")
>>> s.oom.cause
'fragmentation'
"""

from __future__ import annotations

from pathlib import Path

from .frames import SnapshotFrames, build_frames
from .load import load_snapshot
from .metrics import SnapshotStats, compute_stats
from .progress import NullProgress, ProgressSink


def load_frames(snapshot: str | Path, *, progress: ProgressSink | None = None) -> SnapshotFrames:
    """Load a snapshot file and return its frames (segments, blocks, events, stacks...)."""
    progress = progress or NullProgress()
    snap = load_snapshot(snapshot, progress=progress)
    progress.stage("Building frames")
    return build_frames(snap)


def stats(snapshot: str | Path, *, progress: ProgressSink | None = None) -> SnapshotStats:
    """Torch's memory counters, fragmentation and OOM cause for one snapshot file."""
    frames = load_frames(snapshot, progress=progress)
    (progress or NullProgress()).stage("Computing statistics")
    return compute_stats(frames)
