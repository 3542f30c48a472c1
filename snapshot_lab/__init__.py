"""snaplab: answers from PyTorch CUDA memory snapshots, offline and without torch."""

from .api import findings, leaks, load_frames, report, stats
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
    "compute_stats",
    "findings",
    "leaks",
    "load_frames",
    "load_snapshot",
    "report",
    "stats",
]
