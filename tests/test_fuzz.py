"""Corrupted snapshots never crash snaplab: each gives exit code 3 and one line, or loads."""

from __future__ import annotations

import pickle
import random

import pytest

from snapshot_lab import SnapshotFormatError, api, load_frames
from snapshot_lab.metrics import compute_stats
from snapshot_lab.metrics.diagnose import diagnose

from .conftest import block, event, make_snapshot, sample_path, segment


def _mutations(raw: bytes, seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        b = bytearray(raw)
        kind = rng.choice(["flip", "truncate", "splice", "zero"])
        if kind == "flip":
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == "truncate":
            b = b[: rng.randrange(1, len(b))]
        elif kind == "splice":
            i = rng.randrange(len(b))
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            i = rng.randrange(len(b))
            b[i : i + rng.randint(1, 32)] = bytes(32)
        yield bytes(b)


@pytest.mark.parametrize("seed", range(4))
def test_mutated_real_snapshot(tmp_path, seed):
    raw = sample_path("oom_fragmentation").read_bytes()
    for i, data in enumerate(_mutations(raw, seed, 60)):
        p = tmp_path / f"m{i}.pickle"
        p.write_bytes(data)
        try:
            frames = load_frames(p)
            diagnose(frames, compute_stats(frames))  # a mutation that still parses must still analyse
        except SnapshotFormatError as exc:
            assert "\n" not in str(exc)


def test_wrong_types_everywhere(tmp_path):
    """Type confusion inside otherwise valid structure: strings for ints, dicts for lists..."""
    base = make_snapshot(
        [segment(1 << 20, [block(512), block(1024, "inactive")])],
        [[event("alloc", 1 << 20, 512, 1, frames=[{"filename": "a.py", "line": 1, "name": "f"}])]],
    )
    bad_values = ["x", None, -5, 3.5, [], {}, True, 2**70]
    paths = [
        ("segments", 0, "address"),
        ("segments", 0, "total_size"),
        ("segments", 0, "device"),
        ("segments", 0, "segment_pool_id"),
        ("segments", 0, "blocks"),
        ("segments", 0, "blocks", 0, "address"),
        ("segments", 0, "blocks", 0, "state"),
        ("segments", 0, "blocks", 0, "frames"),
        ("device_traces", 0, 0, "size"),
        ("device_traces", 0, 0, "addr"),
        ("device_traces", 0, 0, "time_us"),
        ("device_traces", 0, 0, "frames"),
        ("device_traces", 0, 0, "action"),
        ("allocator_settings",),
        ("external_annotations",),
    ]
    n = 0
    for path in paths:
        for v in bad_values:
            snap = pickle.loads(pickle.dumps(base))
            target = snap
            for k in path[:-1]:
                target = target[k]
            target[path[-1]] = v
            p = tmp_path / f"t{n}.pickle"
            p.write_bytes(pickle.dumps(snap))
            n += 1
            try:
                frames = load_frames(p)
                diagnose(frames, compute_stats(frames))
            except SnapshotFormatError as exc:
                assert "\n" not in str(exc)
                continue
            if path[0] in ("allocator_settings", "external_annotations"):
                api.report(p, output=tmp_path / f"t{n}.html")  # rendered as text, whatever the type
