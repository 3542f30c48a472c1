"""snaplab: answers from PyTorch CUDA memory snapshots, offline and without torch."""

import sys as _sys
import types as _types

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


class _Package(_types.ModuleType):
    """``snapshot_lab.report`` is the API function, and ``snapshot_lab/report.py`` a module of the
    same name: the first import of that module (by the first report made) would make the package
    attribute the module, so a second ``snapshot_lab.report(...)`` failed. The function stays."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "report" and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
