"""The compiled parts give the answers of their pure-Python twins.

``frames/_scan.c`` turns a chunk of trace entries into columns in one C pass; anything irregular
sends the chunk back to the Python code (the reference, which names the entry at fault).
``tests/test_frames_identity.py`` pins the frames of every sample with whichever path this
installation uses; here every sample is built again with ``SNAPLAB_PURE_PYTHON=1`` and
compared, and the irregular entries are checked to take the Python path with the same result.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from snapshot_lab import _compiled
from snapshot_lab.errors import SnaplabError
from snapshot_lab.frames import build_frames
from snapshot_lab.frames.build import _ACTION_CODES, _MISSING, _OOM
from snapshot_lab.load import load_snapshot

from .conftest import event, make_snapshot, sample_names, sample_path, write_pickle
from .test_frames_identity import _frames_only, frames_identity

DIGESTS = json.loads((Path(__file__).parent / "frames_identity.json").read_text())
SCAN = _compiled.compiled("snapshot_lab.frames._scan")
needs_scan = pytest.mark.skipif(SCAN is None, reason="the C extension is not built here")


@pytest.fixture
def pure_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_compiled.PURE_PYTHON_VARIABLE, "1")


def test_the_path_in_use_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_compiled.PURE_PYTHON_VARIABLE, raising=False)
    built = [name for name in _compiled.MODULES if _compiled.compiled(name) is not None]
    if len(built) == len(_compiled.MODULES):
        expected = "compiled (C)"
    elif not built:
        expected = "pure Python (the C extensions were not built)"
    else:
        expected = f"partly compiled ({', '.join(name.rsplit('.', 1)[1] for name in built)})"
    assert _compiled.describe() == expected
    monkeypatch.setenv(_compiled.PURE_PYTHON_VARIABLE, "1")
    assert _compiled.describe() == "pure Python (SNAPLAB_PURE_PYTHON is set)"
    assert _compiled.compiled("snapshot_lab.frames._scan") is None
    monkeypatch.setenv(_compiled.PURE_PYTHON_VARIABLE, "0")  # "0" is off, like unset
    assert (_compiled.compiled("snapshot_lab.frames._scan") is None) == (SCAN is None)


@pytest.mark.parametrize("name", sample_names())
def test_pure_python_frames_equal_the_pinned_ones(name: str, pure_python: None) -> None:
    frames = build_frames(load_snapshot(sample_path(name)))
    assert frames_identity.frames_digests(frames) == _frames_only(DIGESTS[name])


def _entries() -> list[dict[str, Any]]:
    shared = [{"filename": "a.py", "line": 1, "name": "f"}, {"filename": "b.py", "line": 2, "name": "g"}]
    return [
        event("alloc", 4096, 512, 1, frames=list(shared)),
        event("alloc", 8192, 1024, 2, frames=list(shared[1:])),
        event("free_requested", 4096, 512, 3, frames=[dict(shared[0]), shared[1]]),  # equal, not identical
        event("free_completed", 4096, 512, 4),
        {"action": "oom", "size": 1 << 30, "device_free": 5, "time_us": 5, "frames": []},
        event("alloc", 12288, 512, 6, frames=[shared[0], {"filename": "c.py", "line": 3, "name": "h"}]),
    ]


@needs_scan
def test_a_regular_chunk_is_scanned_in_c() -> None:
    entries = _entries()
    out = SCAN.scan_chunk(entries, _ACTION_CODES, _OOM)
    types = (np.int16, *[np.int64] * 7, np.bool_)
    action, size, addr, stream, time, free, group, last, same = (
        np.frombuffer(column, dtype=kind).tolist() for column, kind in zip(out, types, strict=True)
    )
    codes = _ACTION_CODES
    alloc = codes["alloc"]
    assert action == [alloc, alloc, codes["free_requested"], codes["free_completed"], _OOM, alloc]
    assert size == [512, 1024, 512, 512, 1 << 30, 512]
    assert addr == [4096, 8192, 4096, 4096, _MISSING, 12288]  # the oom entry has no address
    assert stream == [0] * 6
    assert time == [1, 2, 3, 4, 5, 6]
    assert free == [_MISSING] * 4 + [5, _MISSING]
    # groups by (depth, innermost frame object): the third entry's first frame is an equal
    # copy, not the same object, so it is a group of its own; the fourth and fifth have no
    # frames; the last shares the first's depth and innermost frame but not its caller
    assert group == [0, 1, 2, 3, 3, 0]
    assert last == [5, 1, 2, 4]
    assert same == [False, True, True, True, True, True]


def _self_holding(entries: list[dict[str, Any]]) -> None:
    """Two lists that hold themselves, alike: comparing them recurses without end."""
    frame = {"filename": "a.py", "line": 1, "name": "f"}
    first: list[Any] = [frame]
    first.append(first)
    second: list[Any] = [frame]
    second.append(second)
    entries[0]["frames"] = first
    entries[2]["frames"] = second  # the same depth and innermost frame: compared


IRREGULAR = {
    "lists that hold themselves": _self_holding,
    "not a dict": lambda e: e.__setitem__(1, ["alloc"]),
    "an action snaplab does not know": lambda e: e[1].__setitem__("action", "segment_defrag"),
    "an action that is not a string": lambda e: e[1].__setitem__("action", 3),
    "no size": lambda e: e[1].pop("size"),
    "a float address": lambda e: e[1].__setitem__("addr", 4096.0),
    "a negative size": lambda e: e[1].__setitem__("size", -1),
    "a size beyond int64": lambda e: e[1].__setitem__("size", 1 << 63),
    "a stream that is None": lambda e: e[1].__setitem__("stream", None),
    "frames in a tuple": lambda e: e[1].__setitem__("frames", tuple(e[1]["frames"])),
    "frames that are None": lambda e: e[1].__setitem__("frames", None),
    "a bool device_free": lambda e: e[4].__setitem__("device_free", True),
}


@needs_scan
@pytest.mark.parametrize("case", list(IRREGULAR))
def test_an_irregular_chunk_goes_back_to_python(case: str) -> None:
    entries = _entries()
    IRREGULAR[case](entries)
    assert SCAN.scan_chunk(entries, _ACTION_CODES, _OOM) is None


@needs_scan
def test_lists_that_hold_themselves_go_back_to_python() -> None:
    entries = _entries()
    _self_holding(entries)
    assert SCAN.scan_chunk(entries, _ACTION_CODES, _OOM) is None


def _outcome(path: Path) -> str:
    try:
        frames = build_frames(load_snapshot(path))
    except SnaplabError as exc:
        return f"error: {exc}"
    return json.dumps(frames_identity.frames_digests(frames), sort_keys=True)


@pytest.mark.parametrize("case", [None, *IRREGULAR])
def test_both_paths_give_the_same_frames_or_error(
    case: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    entries = _entries()
    if case is not None:
        IRREGULAR[case](entries)
    path = write_pickle(tmp_path / "snap.pickle", make_snapshot([], traces=[entries]))
    monkeypatch.delenv(_compiled.PURE_PYTHON_VARIABLE, raising=False)
    default = _outcome(path)
    monkeypatch.setenv(_compiled.PURE_PYTHON_VARIABLE, "1")
    assert _outcome(path) == default
    # a new action is kept (the Python path numbers it); every other irregular entry is named
    assert default.startswith("error: ") == (case not in (None, "an action snaplab does not know"))
    if case == "a bool device_free":
        assert "device_traces[0][4].device_free: expected an integer in [0, 2**63), got True" in default


def _columns(chunk: list[Any]) -> dict[str, list[Any]] | str:
    """Every column ``_TraceColumns.add`` makes of ``chunk``, or the name of the error it raised."""
    from snapshot_lab.frames.build import _StackInterner, _TraceColumns

    columns = _TraceColumns()
    try:
        columns.add(chunk, _StackInterner())
    except Exception as exc:  # the same exception on both paths is what is compared
        return type(exc).__name__
    return {key: np.concatenate(parts).tolist() for key, parts in columns.parts.items()}


def _random_chunk(rng: random.Random) -> list[Any]:
    frames = [{"filename": f"{i}.py", "line": i, "name": "f"} for i in range(3)]
    values: list[Any] = [0, 1, 7, -1, 2**62, 2**63, -(2**63), True, None, 1.5, "x", [], (1,), {}]
    stacks: list[Any] = [None, [], frames[:1], frames[:2], frames[1:], [dict(frames[0])], tuple(frames), "ab"]
    actions = ["alloc", "free_requested", "free_completed", "oom", "segment_map", "snapshot", "new", 5, None]
    chunk: list[Any] = []
    for _ in range(rng.randint(0, 12)):
        if rng.random() < 0.03:
            chunk.append(rng.choice([None, [], "entry", 3]))
            continue
        entry: dict[str, Any] = {"action": rng.choice(actions), "size": rng.choice([512, 4096, *values])}
        for key in ("addr", "stream", "time_us", "device_free", "frames"):
            if rng.random() < 0.7:
                entry[key] = rng.choice(stacks if key == "frames" else [4096, 8192, *values])
        chunk.append(entry)
    return chunk


@needs_scan
def test_random_chunks_give_what_the_python_code_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded random entries (every value type a hostile file can hold, at every field): the C pass
    and the Python code make the same columns, or raise the same error (through the fallback)."""
    rng = random.Random(20261123)
    fell_back = scanned = 0
    for _ in range(3000):
        chunk = _random_chunk(rng)
        monkeypatch.delenv(_compiled.PURE_PYTHON_VARIABLE, raising=False)
        compiled_columns = _columns(chunk)
        if SCAN.scan_chunk(chunk, _ACTION_CODES, _OOM) is None:
            fell_back += 1
        else:
            scanned += 1
        monkeypatch.setenv(_compiled.PURE_PYTHON_VARIABLE, "1")
        assert _columns(chunk) == compiled_columns
    assert scanned > 150 and fell_back > 1500  # both paths were exercised (243 and 2,757 with this seed)
