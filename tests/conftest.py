"""Shared fixtures: a builder of small synthetic snapshots, and the real sample snapshots."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_snapshots"

FRAME_A = {"filename": "train.py", "line": 10, "name": "forward"}
FRAME_B = {"filename": "model.py", "line": 20, "name": "<module>"}
STACK = [FRAME_A, FRAME_B]


def block(
    size: int, state: str = "active_allocated", requested: int | None = None, frames: Any = None
) -> dict[str, Any]:
    return {
        "size": size,
        "requested_size": size if requested is None else requested,
        "state": state,
        "frames": STACK if frames is None else frames,
    }


def segment(
    address: int,
    blocks: Iterable[dict[str, Any]],
    *,
    segment_type: str = "large",
    device: int = 0,
    stream: int = 0,
    pool_id: tuple[int, int] = (0, 0),
    expandable: bool = False,
) -> dict[str, Any]:
    """A segment whose block addresses follow from the segment address (as torch writes them)."""
    out_blocks = []
    offset = 0
    for b in blocks:
        out_blocks.append({**b, "address": address + offset})
        offset += b["size"]
    alloc = sum(b["size"] for b in out_blocks if b["state"] == "active_allocated")
    active = sum(b["size"] for b in out_blocks if b["state"] != "inactive")
    return {
        "device": device,
        "address": address,
        "total_size": offset,
        "allocated_size": alloc,
        "active_size": active,
        "requested_size": sum(b["requested_size"] for b in out_blocks if b["state"] != "inactive"),
        "stream": stream,
        "segment_type": segment_type,
        "segment_pool_id": pool_id,
        "is_expandable": expandable,
        "frames": [],
        "blocks": out_blocks,
    }


def event(action: str, addr: int | None, size: int, t: int, frames: Any = None, **extra: Any) -> dict[str, Any]:
    e: dict[str, Any] = {"action": action, "size": size, "stream": 0, "time_us": t}
    if addr is not None:
        e["addr"] = addr
    if frames is not None:
        e["frames"] = frames
    e.update(extra)
    return e


def make_snapshot(
    segments: list[dict[str, Any]] | None = None,
    traces: list[list[dict[str, Any]]] | None = None,
    **top: Any,
) -> dict[str, Any]:
    snap: dict[str, Any] = {
        "segments": segments if segments is not None else [],
        "device_traces": traces if traces is not None else [[]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False},
        "external_annotations": [],
    }
    snap.update(top)
    return snap


def write_pickle(path: Path, obj: Any) -> Path:
    with path.open("wb") as f:
        pickle.dump(obj, f, protocol=4)
    return path


@pytest.fixture
def snap_file(tmp_path: Path):
    """Factory: write a synthetic snapshot dict to a pickle file and return its path."""

    def make(obj: Any, name: str = "snap.pickle") -> Path:
        return write_pickle(tmp_path / name, obj)

    return make


@pytest.fixture
def torch(monkeypatch):
    """The stand-in torch of the capture side (tests/fake_torch.py), installed for one test, with
    the OOM observer not yet attached."""
    from .fake_torch import FakeTorch

    fake = FakeTorch()
    fake.install(monkeypatch)
    monkeypatch.setattr("snapshot_lab.capture._OBSERVER_ATTACHED", False)
    return fake


def sample_names() -> list[str]:
    return sorted(p.name[: -len(".truth.json")] for p in SAMPLES.glob("*.truth.json"))


def sample_path(name: str) -> Path:
    for suffix in (".pickle", ".pickle.xz", ".pickle.gz", ".pickle.zst"):
        p = SAMPLES / f"{name}{suffix}"
        if p.exists():
            return p
    raise FileNotFoundError(name)


def sample_truth(name: str) -> dict[str, Any]:
    return json.loads((SAMPLES / f"{name}.truth.json").read_text())


_FRAMES_CACHE: dict[str, Any] = {}


@pytest.fixture(scope="session")
def real_frames():
    """Parse each real sample once per test session."""
    from snapshot_lab import load_frames

    def get(name: str):
        if name not in _FRAMES_CACHE:
            _FRAMES_CACHE[name] = load_frames(sample_path(name))
        return _FRAMES_CACHE[name]

    return get


def unmemoised(frames: Any) -> Any:
    """The same frames as a new object: what ``snapshot_lab.metrics._memo`` keeps per object (the
    fit evidence, the autocast codes) is computed again, for a test that patches a rule."""
    return frames.__class__(**vars(frames))


_DIAGNOSIS_CACHE: dict[str, Any] = {}


@pytest.fixture(scope="session")
def real_diagnosis(real_frames):
    """``(stats, diagnosis)`` of a real sample, as the report computes them (without the
    category timelines), once per test session."""
    from snapshot_lab.metrics import compute_stats
    from snapshot_lab.metrics.diagnose import diagnose

    def get(name: str):
        if name not in _DIAGNOSIS_CACHE:
            frames = real_frames(name)
            stats = compute_stats(frames)
            _DIAGNOSIS_CACHE[name] = (stats, diagnose(frames, stats, with_category_timelines=False))
        return _DIAGNOSIS_CACHE[name]

    return get
