"""Fingerprints of the frames and of ``snaplab stats --json``, to prove a change to the loader or
to the frame builder leaves every result identical to the byte.

``record`` writes, for every snapshot in ``sample_snapshots/`` and for one generated
100k-entry snapshot (benchmarks/gen_snapshot.py), a SHA-256 of each frame (column names,
dtypes with their categories, index, every column's values through
``pd.util.hash_pandas_object`` and its raw arrays: the data and mask of nullable integers (a
value under the mask counted as 0), the codes of categoricals, the Python types in object
columns) and of the ``SnapshotInfo``, plus a SHA-256 of the bytes ``snaplab stats --json``
prints for each sample. ``check`` recomputes them with the code of the working tree and lists
every difference (exit code 1 when there is one).

    python benchmarks/frames_identity.py record tests/frames_identity.json   # with the old code
    python benchmarks/frames_identity.py check tests/frames_identity.json    # with the new code
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pickle
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from snapshot_lab import load_frames  # noqa: E402
from snapshot_lab.frames import SnapshotFrames  # noqa: E402

SAMPLES = ROOT / "sample_snapshots"
GENERATED_ENTRIES = 100_000
GENERATED_NAME = f"generated_{GENERATED_ENTRIES}"
FRAME_NAMES = ("segments", "blocks", "events", "stack_frames", "stacks", "annotations")


def sample_paths() -> dict[str, Path]:
    """Every sample snapshot with a truth file, by name (as tests/conftest.py finds them)."""
    out = {}
    for truth in sorted(SAMPLES.glob("*.truth.json")):
        name = truth.name[: -len(".truth.json")]
        for suffix in (".pickle", ".pickle.xz", ".pickle.gz", ".pickle.zst"):
            path = SAMPLES / f"{name}{suffix}"
            if path.exists():
                out[name] = path
                break
    return out


def _array_bytes(series: pd.Series) -> Iterator[bytes]:
    """The raw buffers behind one column's values."""
    values: Any = series.array
    if isinstance(values, pd.arrays.NumpyExtensionArray):
        values = series.to_numpy()
    if isinstance(values, pd.Categorical):
        yield values.codes.dtype.str.encode() + values.codes.tobytes()
    elif isinstance(values, pd.arrays.IntegerArray | pd.arrays.BooleanArray):
        # what lies under the mask is never seen (the builder may leave it unwritten): hashed as 0
        data = np.where(values._mask, values._data.dtype.type(0), values._data)
        yield values._data.dtype.str.encode() + data.tobytes()
        yield values._mask.tobytes()
    elif isinstance(values, np.ndarray) and values.dtype != object:
        yield values.dtype.str.encode() + values.tobytes()
    else:
        yield repr(sorted({type(v).__name__ for v in values})).encode()


def frame_digest(df: pd.DataFrame) -> str:
    """SHA-256 of everything observable in one frame."""
    h = hashlib.sha256()
    h.update(repr(list(df.columns)).encode())
    h.update(repr([repr(t) for t in df.dtypes]).encode())
    h.update(repr(df.index).encode())
    h.update(pd.util.hash_pandas_object(df.index.to_series(), index=False).to_numpy().tobytes())
    for column in df.columns:
        series = df[column]
        h.update(pd.util.hash_pandas_object(series, index=False).to_numpy().tobytes())
        for chunk in _array_bytes(series):
            h.update(chunk)
    return h.hexdigest()


def info_digest(frames: SnapshotFrames) -> str:
    """SHA-256 of the SnapshotInfo, with the file's path reduced to its name; the window's fields
    (``max_entries``, ``entries_left_out``) only where a window was asked for, so a file read
    whole hashes as it did before they existed."""
    info = dataclasses.asdict(frames.info)
    info["source"]["path"] = Path(info["source"]["path"]).name
    if info["max_entries"] is None:
        del info["max_entries"], info["entries_left_out"]
    return hashlib.sha256(repr(info).encode()).hexdigest()


def frames_digests(frames: SnapshotFrames) -> dict[str, str]:
    out = {name: frame_digest(getattr(frames, name)) for name in FRAME_NAMES}
    out["info"] = info_digest(frames)
    return out


def stats_json_digest(path: Path) -> str:
    """SHA-256 of what ``snaplab stats --json`` prints for one file (through the CLI itself)."""
    from typer.testing import CliRunner

    from snapshot_lab.cli import app

    result = CliRunner().invoke(app, ["stats", "--json", "-q", str(path)])
    if result.exit_code != 0:
        raise RuntimeError(f"stats --json {path.name}: exit {result.exit_code}: {result.output[-500:]}")
    return hashlib.sha256(result.stdout_bytes).hexdigest()


def generated_snapshot(directory: Path) -> Path:
    import gen_snapshot

    path = directory / f"{GENERATED_NAME}.pickle"
    with path.open("wb") as f:
        pickle.dump(gen_snapshot.generate(GENERATED_ENTRIES), f, protocol=4)
    return path


def fingerprints(with_stats: bool = True, names: list[str] | None = None) -> dict[str, dict[str, str]]:
    """Digests of every sample (or of ``names``) and of the generated snapshot."""
    paths = sample_paths()
    out: dict[str, dict[str, str]] = {}
    for name, path in paths.items():
        if names is not None and name not in names:
            continue
        out[name] = frames_digests(load_frames(path))
        if with_stats:
            out[name]["stats_json"] = stats_json_digest(path)
    if names is None or GENERATED_NAME in names:
        with tempfile.TemporaryDirectory() as tmp:
            out[GENERATED_NAME] = frames_digests(load_frames(generated_snapshot(Path(tmp))))
    return out


def differences(expected: dict[str, dict[str, str]], actual: dict[str, dict[str, str]]) -> list[str]:
    out = []
    for name in sorted(set(expected) | set(actual)):
        want, got = expected.get(name, {}), actual.get(name, {})
        for key in sorted(set(want) | set(got)):
            if want.get(key) != got.get(key):
                out.append(f"{name}: {key} differs")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("digests", type=Path, help="the JSON file of digests")
    a = ap.parse_args()
    actual = fingerprints()
    if a.mode == "record":
        a.digests.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n")
        print(f"{a.digests}: {len(actual)} snapshots recorded")
        return
    diffs = differences(json.loads(a.digests.read_text()), actual)
    print("\n".join(diffs) if diffs else f"all {len(actual)} snapshots identical")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
