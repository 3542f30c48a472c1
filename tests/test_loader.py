"""The loader: every supported shape loads; every bad input is refused with one clear reason."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import pickle
import re
from pathlib import Path

import pytest
import zstandard

from snapshot_lab import SnapshotFormatError, load_snapshot
from snapshot_lab.frames import build_frames

from .conftest import block, event, make_snapshot, sample_path, segment, write_pickle


def _good(tmp_path: Path) -> dict:
    return make_snapshot(
        [segment(0x7F0000000000, [block(512), block(1536, "inactive")], segment_type="small")],
        [[event("alloc", 0x7F0000000000, 100, 1)]],
    )


# --------------------------------------------------------------------------- good inputs


@pytest.mark.parametrize(
    "compress",
    [
        ("gzip", gzip.compress),
        ("xz", lzma.compress),
        ("bz2", bz2.compress),
        ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
    ids=lambda c: c[0],
)
def test_compressed_files_are_sniffed_not_named(tmp_path, compress):
    name, fn = compress
    raw = sample_path("oom_fragmentation").read_bytes()
    p = tmp_path / "renamed_for_the_ticket.bin"  # the suffix says nothing
    p.write_bytes(fn(raw))
    snap = load_snapshot(p)
    assert snap.source.compression == name
    assert len(snap.segments) == 75


def test_all_pickle_protocols(tmp_path):
    obj = _good(tmp_path)
    for proto in range(0, pickle.HIGHEST_PROTOCOL + 1):
        p = tmp_path / f"p{proto}.pickle"
        p.write_bytes(pickle.dumps(obj, protocol=proto))
        snap = load_snapshot(p)
        assert snap.segments[0]["blocks"][1]["state"] == "inactive", proto


def test_json_export_loads(tmp_path):
    obj = _good(tmp_path)
    obj["segments"][0]["segment_pool_id"] = [0, 0]  # JSON has no tuples
    p = tmp_path / "snap.json"
    p.write_text(json.dumps(obj))
    snap = load_snapshot(p)
    assert snap.source.encoding == "json"
    assert snap.segments[0]["segment_pool_id"] == (0, 0)


def test_legacy_113_list_of_segments(tmp_path):
    seg = segment(4096, [block(512), block(512, "inactive")])
    for b in seg["blocks"]:  # 1.13: no address, frames or requested_size; history instead
        del b["address"], b["frames"], b["requested_size"]
    seg["blocks"][0]["history"] = [
        {"addr": 4096, "real_size": 100, "frames": [{"filename": "a.py", "line": 3, "name": "f"}]}
    ]
    snap = load_snapshot(write_pickle(tmp_path / "old.pickle", [seg]))
    assert snap.legacy == "1.13"
    b0, b1 = snap.segments[0]["blocks"]
    assert (b0["address"], b0["requested_size"], b0["frames"][0]["name"]) == (4096, 100, "f")
    assert b1["address"] == 4096 + 512
    assert snap.device_traces == []


def test_legacy_20_history_blocks(tmp_path):
    seg = segment(8192, [block(1024)])
    b = seg["blocks"][0]
    del b["frames"], b["requested_size"]
    b["history"] = [{"addr": 8192, "real_size": 1000, "frames": []}]
    snap = load_snapshot(write_pickle(tmp_path / "v20.pickle", make_snapshot([seg])))
    assert snap.legacy == "2.0"
    assert snap.segments[0]["blocks"][0]["requested_size"] == 1000


def test_awaiting_free_spelling_is_accepted(tmp_path):
    snap = make_snapshot([segment(0, [block(512, "active_awaiting_free")])])
    loaded = load_snapshot(write_pickle(tmp_path / "s.pickle", snap))
    assert loaded.segments[0]["blocks"][0]["state"] == "active_pending_free"


# --------------------------------------------------------------------------- bad inputs


def _refused(path: Path, *fragments: str) -> str:
    with pytest.raises(SnapshotFormatError) as ei:
        load_snapshot(path)
    msg = str(ei.value)
    assert str(path) in msg
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_missing_file(tmp_path):
    _refused(tmp_path / "nope.pickle", "no such file")


def test_directory(tmp_path):
    _refused(tmp_path, "directory")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.pickle"
    p.write_bytes(b"")
    _refused(p, "empty file")


def test_garbage(tmp_path):
    p = tmp_path / "garbage.pickle"
    p.write_bytes(bytes(range(256)) * 10)
    _refused(p, "neither a pickle nor JSON")


def test_text_file(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("this is my training log\nloss=1.0\n")
    _refused(p, "neither a pickle nor JSON")


def test_truncated_pickle(tmp_path):
    raw = sample_path("oom_fragmentation").read_bytes()
    p = tmp_path / "cut.pickle"
    p.write_bytes(raw[: len(raw) // 2])
    _refused(p, "truncated")


def test_truncated_gzip(tmp_path):
    raw = gzip.compress(sample_path("oom_fragmentation").read_bytes())
    p = tmp_path / "cut.pickle.gz"
    p.write_bytes(raw[: len(raw) // 2])
    _refused(p, "truncated")


def test_corrupt_xz(tmp_path):
    raw = bytearray(lzma.compress(sample_path("oom_fragmentation").read_bytes()))
    raw[40:60] = b"\x00" * 20
    p = tmp_path / "bad.pickle.xz"
    p.write_bytes(bytes(raw))
    _refused(p, "")


def test_non_dict_pickle(tmp_path):
    _refused(write_pickle(tmp_path / "int.pickle", 42), "holds an int, expected a dict")


def test_dict_without_segments(tmp_path):
    _refused(write_pickle(tmp_path / "d.pickle", {"weights": [1, 2]}), "no 'segments' key", "weights")


def test_state_dict_is_not_a_snapshot(tmp_path):
    # people attach the wrong pickle; one with numbers inside segments must still be refused
    _refused(
        write_pickle(tmp_path / "s.pickle", {"segments": [1, 2, 3]}), "segments[0]: expected a segment (a dict), got 1"
    )


def test_bad_block_fields(tmp_path):
    snap = make_snapshot([segment(0, [block(512)])])
    snap["segments"][0]["blocks"][0]["state"] = "<script>alert(1)</script>"
    _refused(write_pickle(tmp_path / "s.pickle", snap), "segments[0].blocks[0].state: expected one of")


def test_blocks_must_tile_segment(tmp_path):
    snap = make_snapshot([segment(0, [block(512)])])
    snap["segments"][0]["total_size"] = 4096
    _refused(write_pickle(tmp_path / "s.pickle", snap), "segments[0].total_size: the blocks add up to 512 bytes")


def test_malformed_trace_entry(tmp_path):
    snap = make_snapshot([], [[event("alloc", 0, 512, 1), "not-a-dict"]])
    p = write_pickle(tmp_path / "s.pickle", snap)
    with pytest.raises(
        SnapshotFormatError, match=re.escape("device_traces[0][1]: expected a trace entry (a dict), got")
    ):
        build_frames(load_snapshot(p))


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch " + str(_Evil.marker),))


def test_pickle_with_global_is_refused_without_running(tmp_path):
    _Evil.marker = tmp_path / "pwned"
    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "x": _Evil()}, protocol=2))
    msg = _refused(p, "refused", "system")
    assert "could run code" in msg
    assert not _Evil.marker.exists()


@pytest.mark.parametrize("proto", [0, 4])
def test_any_global_is_refused(tmp_path, proto):
    import collections

    p = tmp_path / "g.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "od": collections.OrderedDict()}, protocol=proto))
    _refused(p, "refused", "OrderedDict")


def test_hostile_strings_survive_loading(tmp_path):
    evil = {"filename": "<script>alert('x')</script>.py", "line": 1, "name": "<img src=x onerror=alert(1)>"}
    snap = make_snapshot([segment(0, [block(512, frames=[evil])])])
    fr = build_frames(load_snapshot(write_pickle(tmp_path / "s.pickle", snap)))
    assert fr.stack_frames["name"].tolist() == ["<img src=x onerror=alert(1)>"]
