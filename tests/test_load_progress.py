"""The reading stage's progress tells the truth about the bytes of the file read (issue #40):
the compiled reader reports its offset in the mapped file as it goes, a compressed file the
compressed bytes taken from it; what is read is the same with or without a progress display."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pandas as pd
import pytest

from snapshot_lab import _compiled
from snapshot_lab.frames import build_frames
from snapshot_lab.load import load_snapshot

from .conftest import FRAME_A, event, make_snapshot


class Recorder:
    def __init__(self) -> None:
        self.stages: list[tuple[str, float | None]] = []
        self.updates: list[float] = []

    def stage(self, description: str, total: float | None = None) -> None:
        self.stages.append((description, total))

    def update(self, completed: float) -> None:
        self.updates.append(completed)


@pytest.fixture(scope="module")
def big_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pickle of some 30 MiB: a few progress reports at 16 MiB steps."""
    stack = [FRAME_A, *({"filename": f"lib_{d}.py", "line": d, "name": "call"} for d in range(40))]
    trace = [event("alloc", 0x1000 + 512 * i, 512, 10 + i, frames=list(stack)) for i in range(250_000)]
    path = tmp_path_factory.mktemp("progress") / "big.pickle"
    with path.open("wb") as f:
        pickle.dump(make_snapshot([], [trace]), f, protocol=4)
    return path


def _events(path: Path, progress: Recorder | None = None) -> pd.DataFrame:
    return build_frames(load_snapshot(path, progress=progress)).events


@pytest.fixture(scope="module")
def reference(big_trace: Path) -> pd.DataFrame:
    """The events read without a progress display."""
    return _events(big_trace)


@pytest.mark.skipif(not _compiled.describe().startswith("compiled"), reason="the compiled reader is not built")
def test_the_mapped_file_reports_its_offset(big_trace: Path, reference: pd.DataFrame) -> None:
    progress = Recorder()
    events = _events(big_trace, progress)
    size = big_trace.stat().st_size
    assert progress.stages == [(f"Reading {big_trace.name}", size)]
    assert len(progress.updates) >= 1
    assert progress.updates == sorted(progress.updates)
    assert progress.updates[0] > 0 and progress.updates[-1] <= size
    pd.testing.assert_frame_equal(events, reference)


@pytest.mark.skipif(not _compiled.describe().startswith("compiled"), reason="the compiled reader is not built")
def test_a_window_is_named_beside_the_bytes_read(big_trace: Path) -> None:
    progress = Recorder()
    snap = load_snapshot(big_trace, progress=progress, max_entries=1_000)
    size = big_trace.stat().st_size
    assert progress.stages == [(f"Reading {big_trace.name}, keeping each trace's last 1,000 entries", size)]
    assert progress.updates and progress.updates == sorted(progress.updates) and progress.updates[-1] <= size
    assert snap.decoded_traces is not None and snap.decoded_traces.devices[0].size_of_trace == 1_000


def test_a_compressed_file_reports_the_compressed_bytes_read(
    big_trace: Path, reference: pd.DataFrame, tmp_path: Path
) -> None:
    packed = tmp_path / "big.pickle.gz"
    packed.write_bytes(gzip.compress(big_trace.read_bytes(), compresslevel=1))
    progress = Recorder()
    events = _events(packed, progress)
    size = packed.stat().st_size
    assert progress.stages == [(f"Reading {packed.name}", size)]
    assert progress.updates and all(0 < u <= size for u in progress.updates)
    pd.testing.assert_frame_equal(events, reference)


def test_a_failing_progress_display_does_not_stop_the_reading(big_trace: Path, reference: pd.DataFrame) -> None:
    class Broken(Recorder):
        def update(self, completed: float) -> None:
            raise RuntimeError("display gone")

    pd.testing.assert_frame_equal(_events(big_trace, Broken()), reference)


def test_a_compressed_file_is_decoded_from_a_temporary_file_or_in_memory(
    big_trace: Path, reference: pd.DataFrame, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decompressed pickle goes to a temporary file that is mapped (it does not stay in the
    process's memory); where no temporary file can be made it is read in memory: same frames."""
    from snapshot_lab.load import loader

    packed = tmp_path / "big.pickle.gz"
    packed.write_bytes(gzip.compress(big_trace.read_bytes(), compresslevel=1))
    made: list[object] = []
    real_spool = loader._spool

    def counting_spool() -> object:
        spool = real_spool()
        made.append(spool)
        return spool

    monkeypatch.setattr(loader, "_spool", counting_spool)
    pd.testing.assert_frame_equal(_events(packed), reference)
    assert made and made[0] is not None
    monkeypatch.setattr(loader, "_spool", lambda: None)
    snap = load_snapshot(packed)
    assert snap.decoded_traces is not None or not _compiled.describe().startswith("compiled")
    pd.testing.assert_frame_equal(build_frames(snap).events, reference)
