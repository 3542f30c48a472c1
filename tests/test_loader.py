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


# --------------------------------------------------------------------------- every field checked, named


def _refused_frames(tmp_path: Path, obj, name: str = "s.pickle") -> str:
    """Refused by the loader or by the frame builder, with one line naming the field."""
    from snapshot_lab.frames import check_frames

    p = write_pickle(tmp_path / name, obj)
    with pytest.raises(SnapshotFormatError) as ei:
        snap = load_snapshot(p)
        check_frames(snap)
    # build_frames refuses the same inputs
    with pytest.raises(SnapshotFormatError) as ei2:
        build_frames(load_snapshot(p))
    assert str(ei.value) == str(ei2.value)
    msg = str(ei.value)
    assert "\n" not in msg and msg.isprintable()
    return msg.split(": ", 1)[1]


def _entry(**kw):
    return make_snapshot(
        [],
        [
            [event("alloc", 4096, 512, 1)] * 0
            + [event("alloc", 4096, 512, 1), {**event("free_completed", 4096, 512, 2), **kw}]
        ],
    )


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("size", 2**64, "device_traces[0][1].size: expected an integer in [0, 2**63), got 2**64"),
        ("size", -1, "device_traces[0][1].size: expected an integer in [0, 2**63), got -1"),
        ("size", 3.5, "device_traces[0][1].size: expected an integer in [0, 2**63), got 3.5"),
        ("size", None, "device_traces[0][1].size: expected an integer in [0, 2**63), got None"),
        ("size", "512", "device_traces[0][1].size: expected an integer in [0, 2**63), got '512'"),
        ("addr", -(2**63), "device_traces[0][1].addr: expected an integer in [0, 2**63), got -2**63"),
        ("addr", float("nan"), "device_traces[0][1].addr: expected an integer in [0, 2**63), got nan"),
        ("time_us", [1], "device_traces[0][1].time_us: expected an integer in [0, 2**63), got a list of 1 item"),
        ("stream", 2**63, "device_traces[0][1].stream: expected an integer in [-2**63, 2**63), got 2**63"),
        ("action", 7, "device_traces[0][1].action: expected a string, got 7"),
        ("frames", None, "device_traces[0][1].frames: expected a list of frames, got None"),
        ("frames", [1], "device_traces[0][1].frames[0]: expected a frame (a dict of filename, line and name), got 1"),
        (
            "frames",
            [{"filename": 1, "line": 1, "name": "f"}],
            "device_traces[0][1].frames[0].filename: expected a string, got 1",
        ),
        (
            "frames",
            [{"filename": "a", "line": 2**64, "name": "f"}],
            "device_traces[0][1].frames[0].line: expected an integer in [-2**63, 2**64), got 2**64",
        ),
        ("forward_frames", "x", "device_traces[0][1].forward_frames: expected a list of traceback strings, got 'x'"),
        ("forward_frames", [None], "device_traces[0][1].forward_frames[0]: expected a traceback string, got None"),
    ],
)
def test_trace_entry_fields_are_checked(tmp_path, field, value, expected):
    assert _refused_frames(tmp_path, _entry(**{field: value})) == expected


def test_missing_size_is_named(tmp_path):
    snap = _entry()
    del snap["device_traces"][0][1]["size"]
    assert _refused_frames(tmp_path, snap) == "device_traces[0][1].size: expected an integer in [0, 2**63), got None"


def test_oom_device_free_out_of_range(tmp_path):
    snap = make_snapshot([], [[{"action": "oom", "size": 1024, "stream": 0, "device_free": 2**64}]])
    assert _refused_frames(tmp_path, snap).startswith("device_traces[0][0].device_free: expected an integer")


def test_bad_entry_found_in_a_later_chunk(tmp_path):
    from snapshot_lab.frames import build as build_mod

    entries = [event("alloc", 4096 * i, 512, i) for i in range(build_mod._CHUNK + 10)]
    entries[build_mod._CHUNK + 3]["size"] = 2**64
    msg = _refused_frames(tmp_path, make_snapshot([], [[], entries]))
    assert msg == f"device_traces[1][{build_mod._CHUNK + 3}].size: expected an integer in [0, 2**63), got 2**64"


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("address",), 2**64, "segments[0].address: expected an integer in [0, 2**63), got 2**64"),
        (("total_size",), -512, "segments[0].total_size: expected an integer in [0, "),
        (("device",), 70000, "segments[0].device: expected an integer in [0, 2**16), got 70000"),
        (("stream",), "0", "segments[0].stream: expected an integer in [-2**63, 2**63), got '0'"),
        (("is_expandable",), [], "segments[0].is_expandable: expected True or False, got a list of 0 items"),
        (("segment_pool_id",), (0, 2**64), "segments[0].segment_pool_id[1]: expected an integer in [-2**63, 2**63)"),
        (("segment_type",), None, "segments[0].segment_type: expected 'small' or 'large', got None"),
        (("frames",), {}, "segments[0].frames: expected a list of frames, got a dict of 0 keys"),
        (("blocks", 1, "size"), 2**63, "segments[0].blocks[1].size: expected an integer in [0, 2**63), got 2**63"),
        (
            ("blocks", 0, "requested_size"),
            1024,
            "segments[0].blocks[0].requested_size: expected an integer in [0, 513), got 1024",
        ),
        (
            ("blocks", 1, "address"),
            7,
            "segments[0].blocks[1].address: expected 0x200 (the end of the block before it), got 0x7",
        ),
        (("blocks", 0, "state"), None, "segments[0].blocks[0].state: expected one of 'active_allocated'"),
        (("blocks", 0, "frames", 0, "name"), 5, "segments[0].blocks[0].frames[0].name: expected a string, got 5"),
        (
            ("blocks", 0, "forward_frames"),
            [b"x"],
            "segments[0].blocks[0].forward_frames[0]: expected a traceback string, got bytes of length 1",
        ),
        (("blocks", 0, "history"), 5, "segments[0].blocks[0].history: expected a list, got 5"),
    ],
)
def test_segment_and_block_fields_are_checked(tmp_path, path, value, expected):
    snap = make_snapshot([segment(0, [block(512, frames=[{"filename": "a.py", "line": 1, "name": "f"}]), block(512)])])
    target = snap["segments"][0]
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    if path == ("blocks", 0, "history"):
        target["frames"] = None
    assert _refused_frames(tmp_path, snap).startswith(expected)


def test_segment_whose_end_passes_int64(tmp_path):
    snap = make_snapshot([segment(2**63 - 512, [block(1024)])])
    assert _refused_frames(tmp_path, snap).startswith(
        "segments[0].total_size: expected an integer in [0, 512), got 1024"
    )


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (
            "max_split_size",
            float("nan"),
            "allocator_settings.max_split_size: expected an integer in [-1, 2**63), got nan",
        ),
        (
            "garbage_collection_threshold",
            [0.5],
            "allocator_settings.garbage_collection_threshold: expected a number in [0, 1], got a list",
        ),
        (
            "garbage_collection_threshold",
            float("inf"),
            "allocator_settings.garbage_collection_threshold: expected a number in [0, 1], got inf",
        ),
        ("expandable_segments", "True", "allocator_settings.expandable_segments: expected True or False, got 'True'"),
        ("roundup_power2_divisions", [4], "allocator_settings.roundup_power2_divisions: expected a dict of divisions"),
        (
            "roundup_power2_divisions",
            {"1": 2**64},
            "allocator_settings.roundup_power2_divisions['1']: expected an integer in [0, 2**31)",
        ),
        (
            "roundup_power2_divisions",
            {"x": 1},
            "allocator_settings.roundup_power2_divisions['x']: expected an interval label",
        ),
        ("PYTORCH_CUDA_ALLOC_CONF", None, "allocator_settings.PYTORCH_CUDA_ALLOC_CONF: expected a string, got None"),
        ("new_setting", [[1]], "allocator_settings.new_setting[0]: expected a plain value, got a list of 1 item"),
    ],
)
def test_allocator_settings_are_checked(tmp_path, key, value, expected):
    snap = make_snapshot()
    snap["allocator_settings"][key] = value
    assert _refused_frames(tmp_path, snap).startswith(expected)


def test_allocator_settings_normalised(tmp_path):
    snap = make_snapshot()
    snap["allocator_settings"].update(
        {"max_split_size": 2**64 - 1, "garbage_collection_threshold": 1, "future_flag": True, "future_list": [1, "a"]}
    )
    s = load_snapshot(write_pickle(tmp_path / "s.pickle", snap)).allocator_settings
    assert s["max_split_size"] == -1  # SIZE_MAX: unlimited
    assert s["garbage_collection_threshold"] == 1.0
    assert s["future_flag"] is True and s["future_list"] == [1, "a"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("x", "external_annotations[0]: expected an annotation (a dict), got 'x'"),
        (
            {"stage": "START", "name": "n", "device": 0, "time_us": 2**64},
            "external_annotations[0].time_us: expected an integer in [0, 2**63), got 2**64",
        ),
        (
            {"stage": "START", "name": ["n"], "device": 0},
            "external_annotations[0].name: expected a string, got a list of 1 item",
        ),
        (
            {"stage": "START", "name": "n", "device": float("inf")},
            "external_annotations[0].device: expected an integer in [0, 2**16), got inf",
        ),
    ],
)
def test_annotations_are_checked(tmp_path, value, expected):
    assert _refused_frames(tmp_path, make_snapshot(external_annotations=[value])) == expected


def test_cpp_line_uint64_max_reads_as_unknown(tmp_path):
    """torch.compile recordings hold C++-filled frames whose line is (uint64)-1 (seen in a real
    grad_compile recording); the frame keeps line -1 instead of failing the int64 column."""
    fr = {"filename": "fake_tensor.py", "line": 2**64 - 1, "name": "init_gpu_context"}
    snap = make_snapshot([segment(0, [block(512, frames=[fr])])], [[event("alloc", 0, 512, 1, frames=[fr])]])
    frames = build_frames(load_snapshot(write_pickle(tmp_path / "s.pickle", snap)))
    assert frames.stack_frames["line"].tolist() == [-1]


def test_long_string_described_briefly(tmp_path):
    snap = _entry(action=["x" * 10**6])
    assert _refused_frames(tmp_path, snap) == "device_traces[0][1].action: expected a string, got a list of 1 item"
    snap = make_snapshot([segment(0, [block(512)])])
    snap["segments"][0]["segment_type"] = "\x1b[31m" + "y" * 10**6
    msg = _refused_frames(tmp_path, snap)
    assert len(msg) < 200 and "1,000,005 characters" in msg and "\x1b" not in msg


# --------------------------------------------------------------------------- bombs


def test_shared_segment_is_refused(tmp_path):
    seg = segment(0, [block(512)])
    snap = make_snapshot([seg, seg])
    assert _refused_frames(tmp_path, snap) == "segments[1]: the same segment object appears twice (a shared reference)"


def test_shared_trace_entries_are_refused_not_expanded(tmp_path):
    """A billion-laughs trace: one entry referenced a million times takes 2 bytes per entry."""
    e = event("alloc", 0, 512, 1, frames=STACK_DEEP)
    snap = make_snapshot([], [[e] * 1_000_000])
    msg = _refused_frames(tmp_path, snap)
    assert msg.startswith("refused: 1,000,000 trace entries in ")
    assert "pickle bomb" in msg


STACK_DEEP = [{"filename": f"f{i}.py", "line": i, "name": "g"} for i in range(1000)]


def test_shared_frames_list_costs_one_pointer_test(tmp_path):
    """Many distinct entries sharing one deep stack list: each costs O(1), not O(depth)."""
    import time

    entries = [event("alloc", 512 * i, 512, i, frames=STACK_DEEP) for i in range(20000)]
    p = write_pickle(tmp_path / "s.pickle", make_snapshot([], [entries]))
    t = time.perf_counter()
    fr = build_frames(load_snapshot(p))
    assert time.perf_counter() - t < 5
    assert fr.events["stack_id"].nunique() == 1


def test_memo_bomb_is_refused(tmp_path):
    """LONG_BINPUT with index 2**30: CPython's unpickler would zero a 16 GiB memo table."""
    import struct

    p = tmp_path / "bomb.pickle"
    p.write_bytes(b"\x80\x02N" + b"r" + struct.pack("<I", 2**30) + b".")
    _refused(p, "refused: reading it needs more memory than 9 bytes of snapshot can")


def test_decompression_bomb_is_refused(tmp_path):
    raw = b"\x80\x04(" + b"N0" * (40 << 20) + b"t."  # 80 MiB of valid opcodes
    p = tmp_path / "bomb.pickle.xz"
    p.write_bytes(lzma.compress(raw))
    assert p.stat().st_size < 64 << 10
    _refused(p, "refused: decompresses to more than", "decompression bomb")


def test_bytearray8_of_impossible_size_prints_nothing(tmp_path, capfd):
    """CPython prints 'SystemError: deallocated bytearray object has exported buffers' when it
    fails to allocate a BYTEARRAY8 of 2**54 bytes; the refusal must stay one line."""
    import struct

    body = b"\x96" + struct.pack("<Q", 2**54) + b"x" * 100 + b"."
    p = tmp_path / "ba.pickle"
    p.write_bytes(b"\x80\x05" + body)
    for _ in range(5):  # the print depends on uninitialised memory: try a few times
        _refused(p, "refused")
    assert capfd.readouterr().err == ""


def test_deep_nesting_is_refused(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text('{"segments": ' + "[" * 100000 + "]" * 100000 + "}")
    _refused(p, "nesting too deep")
    p = tmp_path / "deep.pickle"
    p.write_bytes(b"\x80\x04}(\x8c\x08segments" + b"]" * 1 + b"(" * 0 + b"u" + b".")
    load_snapshot(p)  # a flat one loads
    deep = b"\x80\x04}(\x8c\x08segments" + b"(" * 200000 + b"]" + b"l" * 0
    p.write_bytes(deep)
    _refused(p, "")


def test_cycle_in_segments_is_refused(tmp_path):
    snap = make_snapshot([segment(0, [block(512)])])
    snap["segments"][0]["blocks"].append(snap["segments"][0])
    assert (
        _refused_frames(tmp_path, snap)
        == "segments[0].blocks[1]: the same block object appears twice (a shared reference)"
    )


def test_sidecar_values_of_the_wrong_type_are_dropped(tmp_path):
    from snapshot_lab.load import load_sidecar

    p = write_pickle(tmp_path / "run_rank0.pickle", make_snapshot())
    meta = {"snaplab_capture": 1, "argv": 5, "oom": {"limit_bytes": [1]}, "rank": 0, "host": {"x": 1}, "step": 3}
    (tmp_path / "run_rank0.meta.json").write_text(json.dumps(meta))
    assert load_sidecar(p) == {"snaplab_capture": 1, "rank": 0, "step": 3}
    # the structured keys capture writes stay (the parallel layout, the incident, the tags)
    # when they are objects, and go when they are not
    par = {"degrees": {"dp": 2}, "coordinates": {"dp": 1}}
    meta = {"snaplab_capture": 1, "parallel": par, "incident": {"same_as": "a.pickle"}, "module_tags": [1]}
    (tmp_path / "run_rank0.meta.json").write_text(json.dumps(meta))
    assert load_sidecar(p) == {"snaplab_capture": 1, "parallel": par, "incident": {"same_as": "a.pickle"}}
    (tmp_path / "run_rank0.meta.json").write_text("[" * 100000 + "]" * 100000)
    assert load_sidecar(p) is None
