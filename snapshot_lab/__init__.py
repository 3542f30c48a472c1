"""snaplab: answers from PyTorch CUDA memory snapshots, offline and without torch."""

from .api import check, diff, export, findings, leaks, load_frames, ranks, report, stats
from .errors import OutputError, SnaplabError, SnapshotFormatError
from .frames import SnapshotFrames, build_frames
from .load import Snapshot, load_snapshot
from .metrics import SnapshotStats, compute_stats

__version__ = "0.1.0"

__all__ = [
    "OutputError",
    "SnaplabError",
    "Snapshot",
    "SnapshotFormatError",
    "SnapshotFrames",
    "SnapshotStats",
    "__version__",
    "build_frames",
    "check",
    "compute_stats",
    "diff",
    "export",
    "findings",
    "leaks",
    "load_frames",
    "load_snapshot",
    "ranks",
    "report",
    "stats",
]
