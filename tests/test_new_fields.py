"""Issue #38 §1: what torch 2.12 to 2.14 and later write, read and shown.

The fixtures follow torch's own serialiser, read for torch 2.14.1 (the newest wheel the registry
carries here): ``THCPModule_memorySnapshot`` in ``torch/csrc/cuda/Module.cpp`` (its string table
and code in ``libtorch_python.so``), ``at::CachingHostAllocatorImpl::getSegments`` in
``ATen/core/CachingHostAllocator.h``, ``HostSegmentInfo``/``TraceEntry`` in
``c10/core/CachingDeviceAllocator.h`` and ``torch/cuda/memory.py``'s docstrings. One test per
field fails when the field is dropped; each fixture is read by the compiled decoder and by the
pure-Python path, which must agree.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from snapshot_lab import _compiled
from snapshot_lab.cli import app
from snapshot_lab.errors import SnapshotFormatError
from snapshot_lab.frames import build_frames
from snapshot_lab.load import load_snapshot
from snapshot_lab.metrics.stats.summary import compute_stats

from .conftest import make_snapshot

FRAME = {"name": "pin", "filename": "loader.py", "line": 7}
HOST = 0x7F00_0000_0000
DEV = 0x7E00_0000_0000


def entry(action: str, addr: int, size: int, t: int, **extra: Any) -> dict[str, Any]:
    """A trace entry as torch >= 2.12's pybind serialiser writes it (the TraceEntry lambda of
    THCPModule_memorySnapshot): action, addr (device_free for oom), size, stream, frames when a
    context was gathered, time_us, compile_context ('N/A' outside compiled regions),
    user_metadata ('' unless set) and pool_id."""
    e: dict[str, Any] = {"action": action, "addr": addr, "size": size, "stream": 0, "frames": [FRAME]}
    e.update(time_us=t, compile_context="N/A", user_metadata="", pool_id=(0, 0))
    e.update(extra)
    return e


def host_segment(address: int, size: int, allocated: bool, active: bool, pool: tuple[int, int] = (0, 0)) -> dict:
    """A pinned host segment as THCPModule_memorySnapshot writes one HostSegmentInfo (flat, one
    block): device -1, stream 0, segment_type 'small', is_expandable False, allocated_size and
    active_size are size or 0, requested_size is size; the block's state follows allocated, then
    active (event_count > 0)."""
    state = "active_allocated" if allocated else "active_pending_free" if active else "inactive"
    block = {"address": address, "size": size, "requested_size": size, "state": state, "frames": [FRAME]}
    return {
        "device": -1,
        "address": address,
        "total_size": size,
        "allocated_size": size if allocated else 0,
        "active_size": size if active else 0,
        "requested_size": size,
        "stream": 0,
        "segment_type": "small",
        "segment_pool_id": pool,
        "is_expandable": False,
        "frames": [FRAME],
        "blocks": [block],
    }


def device_segment(blocks: list[tuple[int, str]]) -> dict[str, Any]:
    out, offset = [], 0
    for size, state in blocks:
        out.append({"address": DEV + offset, "size": size, "requested_size": size, "state": state, "frames": []})
        offset += size
    return {"device": 0, "address": DEV, "total_size": offset, "stream": 0, "segment_type": "large", "blocks": out}


HOST_SEGMENTS = [
    host_segment(HOST, 1 << 20, allocated=True, active=True),
    host_segment(HOST + (1 << 20), 1 << 16, allocated=False, active=True),  # awaiting its CUDA event
    host_segment(HOST + (2 << 20), 1 << 12, allocated=False, active=False, pool=(1, 0)),
]
HOST_TRACES = [
    entry("segment_alloc", HOST, 1 << 20, 10),
    entry("alloc", HOST, 1 << 20, 11),
    entry("alloc", HOST + (2 << 20), 1 << 12, 12),
    entry("free_requested", HOST + (2 << 20), 1 << 12, 13),
    entry("free_completed", HOST + (2 << 20), 1 << 12, 14),
]


@pytest.fixture(params=["compiled", "pure"])
def read(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Factory: pickle a dict and read its frames, by the compiled decoder or the Python path."""
    if request.param == "pure":
        monkeypatch.setenv(_compiled.PURE_PYTHON_VARIABLE, "1")
    else:
        monkeypatch.delenv(_compiled.PURE_PYTHON_VARIABLE, raising=False)

    def go(obj: Any, protocol: int = 4):
        path = tmp_path / "snap.pickle"
        path.write_bytes(pickle.dumps(obj, protocol=protocol))
        return build_frames(load_snapshot(path))

    return go


def stats_json(tmp_path: Path, obj: Any) -> dict[str, Any]:
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(obj, protocol=4))
    result = CliRunner().invoke(app, ["stats", "--json", "-q", str(path)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def stats_text(tmp_path: Path, obj: Any) -> str:
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(obj, protocol=4))
    result = CliRunner().invoke(app, ["stats", str(path)])
    assert result.exit_code == 0, result.output
    return result.stdout


# ---- pinned host memory -----------------------------------------------------------------------


def test_host_segments_are_read(read) -> None:
    frames = read(make_snapshot(host_segments=HOST_SEGMENTS))
    hs = frames.host_segments
    assert hs["device"].tolist() == [-1, -1, -1]
    assert hs["total_size_bytes"].tolist() == [1 << 20, 1 << 16, 1 << 12]
    assert hs["allocated_bytes"].tolist() == [1 << 20, 0, 0]
    assert hs["active_bytes"].tolist() == [1 << 20, 1 << 16, 0]
    assert hs["is_private_pool"].tolist() == [False, False, True]
    assert frames.stack(hs["stack_id"].iloc[0])[0]["name"] == "pin"
    assert frames.segments.empty  # host memory is never counted as a device's


def test_host_traces_are_read(read) -> None:
    frames = read(make_snapshot(host_segments=HOST_SEGMENTS, host_traces=HOST_TRACES))
    ev = frames.host_events
    assert ev["action"].astype(str).tolist() == [e["action"] for e in HOST_TRACES]
    assert ev["device"].unique().tolist() == [-1]
    assert frames.events.empty


def test_host_totals_beside_device_memory(tmp_path: Path) -> None:
    obj = make_snapshot(
        [device_segment([(1 << 21, "active_allocated")])], host_segments=HOST_SEGMENTS, host_traces=HOST_TRACES
    )
    host = stats_json(tmp_path, obj)["host"]
    assert host["reserved_bytes"] == (1 << 20) + (1 << 16) + (1 << 12)
    assert host["allocated_bytes"] == 1 << 20
    assert host["pending_free_bytes"] == 1 << 16
    assert host["cached_bytes"] == 1 << 12
    assert host["private_pool_bytes"] == 1 << 12
    assert host["peak_allocated_in_trace_bytes"] == (1 << 20) + (1 << 12)
    assert host["sites"][0]["frame"] == "loader.py:7:pin"
    assert stats_json(tmp_path, obj)["torch_stats"]["reserved_bytes.all.current"] == 1 << 21


def test_host_only_file_is_a_snapshot(tmp_path: Path) -> None:
    """record_cuda=False: empty segments and device traces, host data only."""
    obj = make_snapshot(host_segments=HOST_SEGMENTS, host_traces=HOST_TRACES)
    text = stats_text(tmp_path, obj)
    assert "no segments" not in text
    assert "== pinned host memory: " in text and " reserved in 3 blocks, 1.00 MiB allocated" in text


def test_no_host_key_without_host_data(tmp_path: Path) -> None:
    out = stats_json(tmp_path, make_snapshot([device_segment([(1 << 21, "active_allocated")])]))
    assert "host" not in out and "backend" not in out["file"]
    assert "overflowed" not in out["recording"]


def test_bad_host_segment_is_one_line_error(read) -> None:
    bad = [dict(HOST_SEGMENTS[0], total_size="big")]
    with pytest.raises(SnapshotFormatError, match=r"host_segments\[0\]\.total_size"):
        read(make_snapshot(host_segments=bad))
    with pytest.raises(SnapshotFormatError, match="host_traces"):
        read(make_snapshot(host_traces=[{"action": "alloc", "size": -1}]))


# ---- annotate ---------------------------------------------------------------------------------


def test_annotate_entries_keep_their_metadata_and_stack(read) -> None:
    """_annotate_tensor: an 'annotate' entry keyed to the allocation's base address, its text in
    user_metadata, the annotation site's own stack (torch/cuda/memory.py, TraceEntry::ANNOTATE)."""
    site = {"name": "pack_hook", "filename": "autograd.py", "line": 99}
    trace = [
        entry("alloc", DEV, 1000, 1),
        entry("annotate", DEV, 1000, 2, user_metadata="<b>saved for backward</b>", frames=[site]),
    ]
    frames = read(make_snapshot([device_segment([(1024, "active_allocated")])], [trace]))
    ann = frames.events[frames.events["action"] == "annotate"]
    assert ann["user_metadata"].astype(str).tolist() == ["<b>saved for backward</b>"]
    assert int(ann["address"].iloc[0]) == DEV
    assert frames.stack(ann["stack_id"].iloc[0])[0]["name"] == "pack_hook"


# ---- the ring buffer's own word ---------------------------------------------------------------


def _late_trace(settings: dict[str, Any]) -> dict[str, Any]:
    seg = device_segment([(1024, "active_allocated"), (1024, "active_allocated")])
    trace = [entry("alloc", DEV + 1024, 1024, 1), entry("free_completed", DEV + 4096, 512, 2)]
    base = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1}
    return make_snapshot([seg], [trace], allocator_settings={**base, **settings})


def test_overflow_flag_says_the_ring_buffer_overflowed(tmp_path: Path) -> None:
    obj = _late_trace({"trace_alloc_overflowed": True, "trace_alloc_max_entries": 2})
    assert "the ring buffer overflowed at 2 entries: earlier events were lost" in stats_text(tmp_path, obj)
    rec = stats_json(tmp_path, obj)["recording"]
    assert rec["overflowed"] is True and rec["max_entries"] == 2


def test_no_overflow_says_recording_started_late(tmp_path: Path) -> None:
    obj = _late_trace({"trace_alloc_overflowed": False, "trace_alloc_max_entries": 100})
    assert "recording started after these blocks were made" in stats_text(tmp_path, obj)


def test_overflow_flag_on_frames_and_findings(read) -> None:
    from snapshot_lab.metrics.findings import recording as rec_findings
    from snapshot_lab.metrics.findings.base import FindingContext

    frames = read(_late_trace({"trace_alloc_overflowed": True, "trace_alloc_max_entries": 2}))
    assert frames.trace_overflowed is True and frames.trace_max_entries == 2
    ctx = FindingContext.__new__(FindingContext)
    object.__setattr__(ctx, "stats", compute_stats(frames))
    found = [f for f in rec_findings.find(ctx) if f.id == "history-incomplete"]
    assert found and found[0].advice.startswith("The ring buffer overflowed at 2 entries: earlier events were lost.")
    assert found[0].evidence["trace_alloc_overflowed"] is True


def test_silent_file_still_guesses(read) -> None:
    frames = read(_late_trace({}))
    assert frames.trace_overflowed is None
    assert compute_stats(frames).recording.missing_history_cause == "ring buffer wrapped or recording started late"


@pytest.mark.parametrize(
    ("key", "value"),
    [("trace_alloc_overflowed", "yes"), ("trace_alloc_max_entries", -5), ("max_cached_size", 1.5)],
)
def test_bad_settings_are_refused(read, key: str, value: Any) -> None:
    with pytest.raises(SnapshotFormatError, match=f"allocator_settings.{key}"):
        read(make_snapshot(allocator_settings={key: value}))


def test_max_round_threshold_and_max_cached_size_kept(read) -> None:
    """torch 2.14's settings dict (THCPModule_memorySnapshot writes both after roundup_power2_divisions)."""
    settings = {"max_round_threshold": 0, "max_cached_size": 2**64 - 1, "graph_capture_record_stream_reuse": False}
    frames = read(make_snapshot(allocator_settings=settings))
    assert frames.info.allocator_settings == {**settings, "max_cached_size": -1}


# ---- pool_id, compile_context, FX frames, forward_frames --------------------------------------


def test_pool_id_on_entries(read) -> None:
    trace = [entry("alloc", DEV, 512, 1), entry("alloc", DEV + 512, 512, 2, pool_id=(1, 0))]
    frames = read(make_snapshot([device_segment([(1024, "active_allocated")])], [trace]))
    d = frames.event_details
    assert d["event_index"].tolist() == [1]
    assert (int(d["pool_id_0"].iloc[0]), int(d["pool_id_1"].iloc[0])) == (1, 0)
    assert "pool_id (torch>=2.12)" in frames.info.format_hints


def test_compile_context_groups_by_compiled_region(read) -> None:
    trace = [
        entry("alloc", DEV, 512, 1, compile_context="Torch-Compiled Region: 0/0"),
        entry("alloc", DEV + 512, 512, 2),
    ]
    frames = read(make_snapshot([device_segment([(1024, "active_allocated")])], [trace]))
    d = frames.event_details
    assert d["compile_context"].tolist() == ["Torch-Compiled Region: 0/0"]
    assert d["pool_id_0"].isna().all()


def test_bad_pool_id_is_one_line_error(read) -> None:
    trace = [entry("alloc", DEV, 512, 1, pool_id=(1, "x"))]
    with pytest.raises(SnapshotFormatError, match=r"device_traces\[0\]\[0\]\.pool_id\[1\]"):
        read(make_snapshot([device_segment([(512, "active_allocated")])], [trace]))


def test_fx_frame_keys_kept(read) -> None:
    """torch._utils._augment_memory_snapshot_stack_traces adds these keys to FX-generated frames."""
    fx = {
        "name": "forward",
        "filename": "/tmp/torchinductor/fx.py",
        "line": 5,
        "fx_node_op": "call_function",
        "fx_node_name": "linear",
        "fx_node_target": "aten.mm.default",
        "fx_original_trace": 'File "model.py", line 3, in forward\n    y = self.lin(x)',
    }
    trace = [entry("alloc", DEV, 512, 1, frames=[fx])]
    frames = read(make_snapshot([device_segment([(512, "active_allocated")])], [trace]))
    row = frames.frame_fx.iloc[0]
    assert (row["fx_node_op"], row["fx_node_name"], row["fx_node_target"]) == (
        "call_function",
        "linear",
        "aten.mm.default",
    )
    assert row["fx_original_trace"].startswith('File "model.py"')


def test_forward_frames_are_read(read) -> None:
    trace = [entry("alloc", DEV, 512, 1, frames=[], forward_frames=['  File "m.py", line 4, in forward\n    x\n'])]
    frames = read(make_snapshot([device_segment([(512, "active_allocated")])], [trace]))
    sid = frames.events["forward_stack_id"].iloc[0]
    assert frames.stack(sid)[0] == {"filename": "m.py", "line": 4, "name": "forward"}


# ---- skip_actions, pending state, protocol 5, other backends ---------------------------------


def test_skip_actions_trace_breaks_nothing(tmp_path: Path) -> None:
    """skip_actions=['free_requested', 'segment_alloc', 'segment_free']: only allocs and completions."""
    trace = [entry("alloc", DEV, 512, 1), entry("free_completed", DEV, 512, 2), entry("alloc", DEV, 512, 3)]
    out = stats_json(tmp_path, make_snapshot([device_segment([(512, "active_allocated")])], [trace]))
    assert out["recording"]["mode"] == "trace"


def test_active_pending_free_block(read) -> None:
    frames = read(make_snapshot([device_segment([(512, "active_pending_free"), (512, "inactive")])]))
    assert frames.blocks["state"].astype(str).tolist() == ["active_pending_free", "inactive"]


def test_protocol_5_pickle(read) -> None:
    """Python 3.14's default: _dump_snapshot calls bare pickle.dump."""
    obj = make_snapshot([device_segment([(512, "active_allocated")])], [[entry("alloc", DEV, 512, 1)]])
    frames = read(obj, protocol=5)
    assert frames.info.source.pickle_protocol == 5
    assert len(frames.events) == 1


def test_ascend_npu_file_is_read_and_named(read) -> None:
    """torch_npu writes the CUDA format: raw 64-bit stream handles, no time_us, expandable
    segments mapped with segment_map/segment_unmap; its settings key names the backend."""
    stream = 0xFFFF_8000_1234_5678 - 2**64  # a handle above 2**63, as int64
    seg = dict(device_segment([(2 << 20, "active_allocated")]), stream=stream, is_expandable=True)
    trace = [
        {"action": "segment_map", "addr": DEV, "size": 2 << 20, "stream": stream, "frames": []},
        {"action": "alloc", "addr": DEV, "size": 2 << 20, "stream": stream, "frames": [FRAME]},
        {"action": "segment_unmap", "addr": DEV + (4 << 20), "size": 2 << 20, "stream": stream},
    ]
    obj = make_snapshot([seg], [trace], allocator_settings={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"})
    frames = read(obj)
    assert frames.backend == "Ascend NPU (torch_npu)"
    assert frames.events["time_us"].isna().all()
    assert frames.events["stream"].unique().tolist() == [stream]


def test_backend_in_stats(tmp_path: Path) -> None:
    obj = make_snapshot(allocator_settings={"PYTORCH_XPU_ALLOC_CONF": ""})
    assert stats_json(tmp_path, obj)["file"]["backend"] == "Intel XPU"
    assert "backend: Intel XPU (as the file names it)" in stats_text(tmp_path, obj)


def test_annotations_attach_to_their_allocation(read) -> None:
    from snapshot_lab.metrics.attribution.sites import allocation_annotations

    trace = [
        entry("alloc", DEV, 512, 1),
        entry("free_completed", DEV, 512, 2),
        entry("alloc", DEV, 512, 3),
        entry("annotate", DEV, 512, 4, user_metadata="kv cache"),
        entry("annotate", DEV, 512, 5, user_metadata="<script>x</script>"),
    ]
    frames = read(make_snapshot([device_segment([(512, "active_allocated")])], [trace]))
    ann = allocation_annotations(frames)
    assert ann["alloc_event_index"].tolist() == [2, 2]  # the live allocation, not the freed one
    assert ann["annotation"].tolist() == ["kv cache", "<script>x</script>"]
