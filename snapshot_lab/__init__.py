"""snaplab: answers from PyTorch CUDA memory snapshots, offline and without torch."""

import importlib as _importlib
import sys as _sys
import types as _types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .api import check, diff, export, findings, leaks, load_frames, ranks, report, stats
    from .errors import OutputError, SnaplabError, SnapshotFormatError
    from .frames import SnapshotFrames, build_frames
    from .load import Snapshot, load_snapshot
    from .metrics import SnapshotStats, compute_stats

__version__ = "0.1.0"

# each name's module, imported the first time the name is read: importing the package (the
# command line's --help, the pytest plugin) does not import pandas and every analysis
_WHERE = {
    **dict.fromkeys(
        ("check", "diff", "export", "findings", "leaks", "load_frames", "ranks", "report", "stats"), ".api"
    ),
    **dict.fromkeys(("OutputError", "SnaplabError", "SnapshotFormatError"), ".errors"),
    **dict.fromkeys(("SnapshotFrames", "build_frames"), ".frames"),
    **dict.fromkeys(("Snapshot", "load_snapshot"), ".load"),
    **dict.fromkeys(("SnapshotStats", "compute_stats"), ".metrics"),
}

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

    def __getattr__(self, name: str) -> object:
        """A name of ``__all__`` not read yet: from its module, kept here from now on."""
        if name not in _WHERE:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(_importlib.import_module(_WHERE[name], __name__), name)
        setattr(self, name, value)
        return value


_sys.modules[__name__].__class__ = _Package
