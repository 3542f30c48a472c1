"""The Python API: the same operations as the command line, with the same names and options.

>>> import snapshot_lab
>>> s = snapshot_lab.stats("sample_snapshots/oom_fragmentation.pickle.gz")
>>> s.oom.cause
'fragmentation'
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from .errors import OutputError
from .frames import SnapshotFrames, build_frames
from .load import load_snapshot
from .metrics import SnapshotStats, compute_stats
from .metrics.diagnose import Diagnosis, diagnose
from .metrics.findings import Finding
from .metrics.leaks import LeakAnalysis
from .progress import NullProgress, ProgressSink


def load_frames(snapshot: str | Path, *, progress: ProgressSink | None = None) -> SnapshotFrames:
    """Load a snapshot file and return its frames (segments, blocks, events, stacks...)."""
    progress = progress or NullProgress()
    snap = load_snapshot(snapshot, progress=progress)
    progress.stage("Building frames")
    return build_frames(snap, consume=True)


def stats(snapshot: str | Path, *, progress: ProgressSink | None = None) -> SnapshotStats:
    """Torch's memory counters, fragmentation and OOM cause for one snapshot file."""
    frames = load_frames(snapshot, progress=progress)
    (progress or NullProgress()).stage("Computing statistics")
    return compute_stats(frames)


def _diagnosis(snapshot: str | Path, progress: ProgressSink | None) -> tuple[SnapshotStats, Diagnosis]:
    frames = load_frames(snapshot, progress=progress)
    (progress or NullProgress()).stage("Analysing")
    stats_ = compute_stats(frames)
    return stats_, diagnose(frames, stats_, with_category_timelines=False)


def leaks(snapshot: str | Path, *, progress: ProgressSink | None = None) -> dict[int, LeakAnalysis]:
    """Leak suspects per device: sites whose surviving memory grows every iteration."""
    return _diagnosis(snapshot, progress)[1].leaks


def findings(snapshot: str | Path, *, progress: ProgressSink | None = None) -> list[Finding]:
    """Findings with evidence and advice, most severe first."""
    return _diagnosis(snapshot, progress)[1].findings


def default_report_path(snapshot: str | Path) -> Path:
    """``reports/<snapshot name without .pickle/.json and compression suffixes>.html``."""
    name = Path(snapshot).name
    for suffix in (".gz", ".xz", ".zst", ".zstd", ".bz2"):
        name = name.removesuffix(suffix)
    for suffix in (".pickle", ".pkl", ".json"):
        name = name.removesuffix(suffix)
    return Path("reports") / f"{name or 'snapshot'}.html"


def report(
    snapshot: str | Path,
    *,
    output: str | Path | None = None,
    progress: ProgressSink | None = None,
) -> Path:
    """Write the self-contained HTML report of a snapshot; returns the path written.

    The file appears only when the report is complete (written to a temporary file, then
    renamed), so a failure never leaves a half-written report behind.
    """
    from .report import build_report  # matplotlib and jinja2 load only when a report is made

    out = Path(output) if output is not None else default_report_path(snapshot)
    frames = load_frames(snapshot, progress=progress)
    (progress or NullProgress()).stage("Computing statistics")
    html = build_report(frames, compute_stats(frames), progress)
    write_atomic(out, html)
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(path, exc.strerror or str(exc)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; a report is for sharing
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(path, exc.strerror or str(exc)) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
