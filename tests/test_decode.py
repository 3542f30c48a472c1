"""The compiled pickle reader (``load/_decode.c``) gives what the restricted unpickler gives.

It decodes ``device_traces`` straight into columns and builds everything else as
``pickle.load`` does; on anything irregular it gives None and the loader reads the file with
the restricted unpickler (the reference). Checked here: every sample's frames equal the pinned
ones (``tests/frames_identity.json``, recorded with the Python path) through the decoder; the
decoded columns equal the entries ``pickle.loads`` builds; and hostile bytes (every truncation
of a real pickle, seeded byte flips, forbidden opcodes, memo abuse, deep nesting) never crash
it and end in the Python path's result or error.
"""

from __future__ import annotations

import json
import lzma
import pickle
import random
import re
from pathlib import Path
from typing import Any

import pytest

from snapshot_lab import _compiled
from snapshot_lab.errors import SnaplabError
from snapshot_lab.frames import build_frames, check_frames
from snapshot_lab.load import load_snapshot
from snapshot_lab.load.decoded import ABSENT, DecodedTraces, decode_pickle

from .conftest import event, make_snapshot, sample_names, sample_path, write_pickle
from .test_frames_identity import _frames_only, frames_identity

DIGESTS = json.loads((Path(__file__).parent / "frames_identity.json").read_text())
DECODER = _compiled.compiled("snapshot_lab.load._decode")
pytestmark = pytest.mark.skipif(DECODER is None, reason="the C extension is not built here")


def _data(name: str) -> bytes:
    path = sample_path(name)
    return lzma.open(path).read() if path.suffix == ".xz" else path.read_bytes()


@pytest.mark.parametrize("name", sample_names())
def test_sample_frames_through_the_decoder_equal_the_pinned_ones(name: str) -> None:
    snap = load_snapshot(sample_path(name))
    assert snap.decoded_traces is not None  # every real sample is regular: the decoder read it
    frames = build_frames(snap)
    assert frames_identity.frames_digests(frames) == _frames_only(DIGESTS[name])


def _int(entry: dict[str, Any], key: str, default: int = ABSENT) -> int:
    return entry.get(key, default)


def _same(a: Any, b: Any) -> bool:
    """``a == b``, also for structures that hold themselves (a flipped byte can make a memo
    reference to an enclosing container): then their pickles, which follow the same shape."""
    try:
        return bool(a == b)
    except RecursionError:
        return pickle.dumps(a, protocol=4) == pickle.dumps(b, protocol=4)


def _assert_same_as_pickle(decoded: tuple[Any, DecodedTraces | None], reference: Any) -> None:
    """The decoder's output holds what ``pickle.loads`` built, field by field."""
    root, traces = decoded
    if traces is None:
        assert _same(root, reference)
        return
    entries_of = reference["device_traces"]
    assert _same(
        {k: v for k, v in root.items() if k != "device_traces"},
        {k: v for k, v in reference.items() if k != "device_traces"},
    )
    assert root["device_traces"] == []
    assert len(traces.devices) == len(entries_of)
    for dev, entries in zip(traces.devices, entries_of, strict=True):
        assert dev.size_of_trace == len(entries)
        assert [dev.action_names[c] for c in dev.action.tolist()] == [e["action"] for e in entries]
        assert dev.size.tolist() == [e["size"] for e in entries]
        assert dev.address.tolist() == [_int(e, "addr") for e in entries]
        assert dev.stream.tolist() == [_int(e, "stream", 0) for e in entries]
        assert dev.time_us.tolist() == [_int(e, "time_us") for e in entries]
        oom_free = [_int(e, "device_free") if e["action"] == "oom" else ABSENT for e in entries]
        assert dev.device_free.tolist() == [ABSENT if v is None else v for v in oom_free]
        assert [dev.metadata_names[c] for c in dev.metadata.tolist()] == [e.get("user_metadata", "") for e in entries]
        for key, entry in zip(dev.stack.tolist(), entries, strict=True):
            assert _same(list(traces.stacks[key]), entry.get("frames", []))
        assert dev.forward == {i: e["forward_frames"] for i, e in enumerate(entries) if e.get("forward_frames")}


COLUMN_SAMPLES = ["pending_free", "cnn_clean", "cpp_stacks", "capture_oom_rank0", "grad_anomaly_python"]


@pytest.mark.parametrize("name", COLUMN_SAMPLES)
def test_decoded_columns_equal_the_unpickled_entries(name: str) -> None:
    if name not in sample_names():
        pytest.skip(f"no sample {name}")
    data = _data(name)
    decoded = decode_pickle(data)
    assert decoded is not None
    _assert_same_as_pickle(decoded, pickle.loads(data))


def _outcome(path: Path) -> str:
    """What loading and checking a file gives: 'ok' or the error's text."""
    try:
        check_frames(load_snapshot(path))
    except SnaplabError as exc:
        return str(exc)
    return "ok"


def _both_paths(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    compiled = _outcome(path)
    monkeypatch.setenv(_compiled.PURE_PYTHON_VARIABLE, "1")
    try:
        return compiled, _outcome(path)
    finally:
        monkeypatch.delenv(_compiled.PURE_PYTHON_VARIABLE)


def _check_against_pickle(data: bytes) -> bool:
    """The decoder on ``data`` gives None, or exactly what pickle.loads builds; True when it decoded."""
    decoded = decode_pickle(data)
    if decoded is None:
        return False
    reference = pickle.loads(data)  # it decoded: pickle must read it too
    _assert_same_as_pickle(decoded, reference)
    return True


def test_every_truncation_of_a_real_pickle_gives_up() -> None:
    for name in ("pending_free", "pytest_over_limit_peak"):  # 2.9 and 5.8 kB, real traces with frames
        data = _data(name)
        assert _check_against_pickle(data)
        for end in range(len(data)):
            assert decode_pickle(data[:end]) is None, end  # no STOP: nothing to return


@pytest.mark.parametrize("name", ["pending_free", "pytest_over_limit_peak"])
def test_seeded_byte_flips_never_crash_and_match_pickle(name: str) -> None:
    # pytest_over_limit_peak: frames lists of 32 memo references, read as one batch; a flip in
    # the last one (a memo index not yet written) once slipped past the batch's check
    data = _data(name)
    rng = random.Random(2326)
    decoded = 0
    for _ in range(3000):
        mutated = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        decoded += _check_against_pickle(bytes(mutated))
    assert decoded > 100  # flips inside values still decode (and equal pickle's objects)


def test_seeded_byte_flips_load_as_the_python_path_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _data("pending_free")
    rng = random.Random(23)
    path = tmp_path / "flipped.pickle"
    for _ in range(150):
        mutated = bytearray(data)
        mutated[rng.randrange(2, len(mutated))] = rng.randrange(256)
        path.write_bytes(bytes(mutated))
        compiled, pure = _both_paths(path, monkeypatch)
        assert compiled == pure


def _entries() -> list[dict[str, Any]]:
    frame = {"filename": "a.py", "line": 1, "name": "f"}
    return [
        event("alloc", 4096, 512, 1, frames=[frame]),
        event("free_requested", 4096, 512, 2, frames=[frame]),
        {"action": "oom", "size": 1 << 30, "device_free": 5, "time_us": 3},
    ]


HOSTILE = {
    # another opcode: a global, refused by the Python path with its own message
    "a global": lambda d: d.replace(b"\x8c\x06action", b"c" + b"os\nsystem\n", 1),
    # a reference to an entry that exists only as columns
    "memo of an entry": lambda d: d.replace(b"\x8c\x04size", b"h\x07\x8c\x04size", 1),
    "a memo index past the end": lambda d: d.replace(b"\x8c\x04size", b"j\xff\xff\xff\x00", 1),
    "an int too big for the trace": lambda d: d.replace(b"M\x00\x02", b"\x8a\x09" + b"\x00" * 8 + b"\x01", 1),
    "a frame past its end": lambda d: d[:2] + b"\x95\xff\xff\xff\xff\x00\x00\x00\x00" + d[11:],
    "a stack underflow": lambda d: d.replace(b"u", b"uu", 1),
    "nothing after a mark": lambda d: d[:-1] + b"(.",
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_pickles_give_the_python_result(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = pickle.dumps(make_snapshot(traces=[_entries()]), protocol=4)
    mutated = HOSTILE[case](data)
    assert mutated != data
    assert decode_pickle(mutated) is None
    path = tmp_path / "hostile.pickle"
    path.write_bytes(mutated)
    compiled, pure = _both_paths(path, monkeypatch)
    assert compiled == pure


def test_a_frames_batch_ending_on_an_unwritten_memo_index_gives_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = _entries()
    second = {"filename": "b.py", "line": 2, "name": "g"}
    entries[0]["frames"].append(second)
    entries[1]["frames"].append(second)  # the second entry's frames: MARK, two memo references, APPENDS
    data = pickle.dumps(make_snapshot(traces=[entries]), protocol=4)
    batches = list(re.finditer(rb"\(h.h(.)e", data, re.DOTALL))
    assert batches
    at = batches[-1].start(1)
    mutated = data[:at] + b"\xf0" + data[at + 1 :]  # memo index 240: never written
    assert decode_pickle(mutated) is None
    path = tmp_path / "unwritten.pickle"
    path.write_bytes(mutated)
    compiled, pure = _both_paths(path, monkeypatch)
    assert compiled == pure
    assert "not a valid pickle" in compiled


def test_deep_nesting_is_read_like_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = pickle.dumps(make_snapshot(traces=[_entries()], external_annotations="DEEP"), protocol=4)
    depth = 200_000  # lists in lists, beyond what pickle.dump can write
    data = data.replace(b"\x8c\x04DEEP", b"]" * depth + b"a" * (depth - 1), 1)
    path = tmp_path / "deep.pickle"
    path.write_bytes(data)
    decoded = decode_pickle(data)
    assert decoded is not None and decoded[1] is not None  # nesting is no limit to a loop
    compiled, pure = _both_paths(path, monkeypatch)
    assert compiled == pure
    assert compiled.endswith("external_annotations[0]: expected an annotation (a dict), got a list of 1 item")


IRREGULAR_ENTRIES = {
    "bool size": ("size", True),
    "negative addr": ("addr", -1),
    "float time": ("time_us", 1.5),
    "frames None": ("frames", None),
    "frames of ints": ("frames", [1, 2]),
    "a frame with a bool line": ("frames", [{"filename": "a.py", "line": True, "name": "f"}]),
    "metadata not a string": ("user_metadata", 3),
    "forward frames of ints": ("forward_frames", [1]),
    "an action that is not a string": ("action", 7),
    "an unknown action": ("action", "segment_defrag"),
    "a tuple pool id": ("pool_id", (0, 1)),
}


@pytest.mark.parametrize("case", list(IRREGULAR_ENTRIES))
def test_irregular_entries_give_the_python_result(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key, value = IRREGULAR_ENTRIES[case]
    entries = _entries()
    entries[1][key] = value
    path = write_pickle(tmp_path / "irregular.pickle", make_snapshot(traces=[entries, []]))
    compiled, pure = _both_paths(path, monkeypatch)
    assert compiled == pure
    data = path.read_bytes()
    _check_against_pickle(data)  # decoded or not, never different from pickle


def test_shared_frames_lists_and_a_missing_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = _entries()
    shared = entries[0]["frames"]
    entries[1]["frames"] = shared  # the same list object: a memo reference to a decoded list
    assert _check_against_pickle(pickle.dumps(make_snapshot(traces=[entries]), protocol=4))
    del entries[2]["size"]
    path = write_pickle(tmp_path / "nosize.pickle", make_snapshot(traces=[entries]))
    assert decode_pickle(path.read_bytes()) is None
    compiled, pure = _both_paths(path, monkeypatch)
    assert compiled == pure
    assert "device_traces[0][2].size" in compiled


def test_a_long_list_shared_by_every_entry_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the Python path interns a shared list once (by identity); reading its frames again for
    # every entry would cost entries x frames (here 10**8), a bomb in a few hundred kB
    frames = [{"filename": f"f{i}.py", "line": i, "name": "f"} for i in range(5_000)]
    forward = [f'  File "x.py", line {i}, in f\n' for i in range(5_000)]
    entries = [event("alloc", 4096 * i, 512, i, frames=frames, forward_frames=forward) for i in range(20_000)]
    path = write_pickle(tmp_path / "shared.pickle", make_snapshot(traces=[entries]))
    decoded = decode_pickle(path.read_bytes())
    assert decoded is not None and decoded[1] is not None
    traces = decoded[1]
    assert len(traces.stacks) == 2 and len(traces.stacks[1]) == 5_000
    assert set(traces.devices[0].stack.tolist()) == {1}
    assert len({id(v) for v in traces.devices[0].forward.values()}) == 1
    compiled, pure = _both_paths(path, monkeypatch)
    assert compiled == pure == "ok"


def test_device_traces_are_read_again_when_asked_for() -> None:
    snap = load_snapshot(sample_path("pending_free"))
    assert snap.decoded_traces is not None
    assert snap.device_traces == pickle.loads(_data("pending_free"))["device_traces"]
