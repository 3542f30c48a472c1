"""Frames: declared schemas, derived addresses, interning."""

from __future__ import annotations

import pandas as pd

from snapshot_lab.frames import (
    BLOCKS_SCHEMA,
    EVENTS_SCHEMA,
    SEGMENTS_SCHEMA,
    build_frames,
)
from snapshot_lab.load import load_snapshot

from .conftest import FRAME_A, STACK, block, event, make_snapshot, segment


def _frames(snap_file, obj):
    return build_frames(load_snapshot(snap_file(obj)))


def _check_schema(df: pd.DataFrame, schema: dict) -> None:
    assert list(df.columns) == list(schema)
    for col, dtype in schema.items():
        assert str(df[col].dtype) == str(pd.Series([], dtype=dtype).dtype), col


def test_empty_snapshot_has_declared_schemas(snap_file):
    fr = _frames(snap_file, make_snapshot())
    _check_schema(fr.segments, SEGMENTS_SCHEMA)
    _check_schema(fr.blocks, BLOCKS_SCHEMA)
    _check_schema(fr.events, EVENTS_SCHEMA)
    assert fr.info.devices == ()


def test_blocks_frame_values(snap_file):
    seg = segment(
        1 << 40, [block(512, requested=100), block(1024, "inactive", requested=7), block(2048, "active_pending_free")]
    )
    fr = _frames(snap_file, make_snapshot([seg]))
    _check_schema(fr.blocks, BLOCKS_SCHEMA)
    assert fr.blocks["offset_bytes"].tolist() == [0, 512, 1536]
    assert fr.blocks["address"].tolist() == [(1 << 40), (1 << 40) + 512, (1 << 40) + 1536]
    # torch leaves a stale requested_size on free blocks: it is unknown, not 7
    assert fr.blocks["requested_size_bytes"].isna().tolist() == [False, True, False]
    s = fr.segments.iloc[0]
    assert (s["allocated_bytes"], s["active_bytes"], s["requested_bytes"], s["n_blocks"]) == (512, 2560, 2148, 3)


def test_events_frame_values(snap_file):
    oom = {"action": "oom", "size": 4096, "stream": 0, "time_us": 3, "device_free": 123}
    tr = [event("alloc", 4096, 100, 1, frames=STACK), event("free_requested", 4096, 100, 2, frames=STACK), oom]
    fr = _frames(snap_file, make_snapshot([], [tr]))
    ev = fr.events
    _check_schema(ev, EVENTS_SCHEMA)
    assert ev["action"].tolist() == ["alloc", "free_requested", "oom"]
    assert ev["address"].isna().tolist() == [False, False, True]
    assert ev["device_free_bytes"].isna().tolist() == [True, True, False]
    assert int(ev["device_free_bytes"].iloc[2]) == 123
    assert ev["time_us"].tolist() == [1, 2, 3]
    assert ev["stack_id"].iloc[0] == ev["stack_id"].iloc[1]
    assert pd.isna(ev["stack_id"].iloc[2])


def test_identical_stacks_interned_by_content(snap_file):
    copy = [dict(FRAME_A), {"filename": "model.py", "line": 20, "name": "<module>"}]  # equal, not identical
    seg = segment(0, [block(512, frames=STACK), block(512, frames=copy), block(512, frames=[])])
    fr = _frames(snap_file, make_snapshot([seg]))
    sids = fr.blocks["stack_id"]
    assert sids.iloc[0] == sids.iloc[1]
    assert pd.isna(sids.iloc[2])
    assert len(fr.stack_frames) == 2
    assert fr.stack(int(sids.iloc[0])) == STACK


def test_multi_device_traces(snap_file):
    segs = [segment(0, [block(512)], device=0), segment(1 << 30, [block(512)], device=1)]
    fr = _frames(snap_file, make_snapshot(segs, [[event("alloc", 0, 512, 1)], [event("alloc", 1 << 30, 512, 2)]]))
    assert fr.info.devices == (0, 1)
    assert fr.events["device"].tolist() == [0, 1]
    assert fr.events["event_index"].tolist() == [0, 0]


def test_unknown_action_is_kept(snap_file):
    fr = _frames(snap_file, make_snapshot([], [[event("some_future_action", 0, 1, 1)]]))
    assert fr.events["action"].tolist() == ["some_future_action"]


# --------------------------------------------------------------------------- forward_frames (torch >= 2.11)

_FWD = [  # as torch 2.11 writes them under anomaly mode: traceback order, outermost first
    '  File "train.py", line 588, in <module>\n    main()\n',
    '  File "train.py", line 566, in main\n    step(model)\n',
    '  File "/venv/torch/nn/modules/linear.py", line 134, in forward\n    return F.linear(input, self.weight)\n',
]


def test_forward_frames_become_a_forward_stack(snap_file):
    seg = segment(1 << 20, [block(512, frames=[]), block(512)])
    seg["blocks"][0]["forward_frames"] = list(_FWD)
    seg["forward_frames"] = list(_FWD)
    entry = event("alloc", 1 << 20, 512, 1, frames=[], forward_frames=list(_FWD))
    fr = _frames(snap_file, make_snapshot([seg], [[entry, event("free_requested", 1 << 20, 512, 2, frames=STACK)]]))
    _check_schema(fr.blocks, BLOCKS_SCHEMA)
    _check_schema(fr.events, EVENTS_SCHEMA)
    fwd = fr.events["forward_stack_id"]
    assert fwd.isna().tolist() == [False, True]
    assert fr.events["stack_id"].isna().tolist() == [True, False]  # stack_id keeps its meaning
    assert fr.blocks["forward_stack_id"].isna().tolist() == [False, True]
    assert fr.blocks["forward_stack_id"].iloc[0] == fwd.iloc[0]  # one stack, interned once
    assert fr.stack(fwd.iloc[0]) == [  # innermost first, like every stack
        {"filename": "/venv/torch/nn/modules/linear.py", "line": 134, "name": "forward"},
        {"filename": "train.py", "line": 566, "name": "main"},
        {"filename": "train.py", "line": 588, "name": "<module>"},
    ]


def test_forward_frames_share_frames_with_stacks(snap_file):
    """A forward frame equal to a recorded frame is the same row of stack_frames."""
    same = '  File "train.py", line 10, in forward\n    y = f(x)\n'  # FRAME_A
    entry = event("alloc", 0, 512, 1, frames=[FRAME_A], forward_frames=[same])
    fr = _frames(snap_file, make_snapshot([], [[entry]]))
    assert len(fr.stack_frames) == 1
    assert fr.events["stack_id"].iloc[0] == fr.events["forward_stack_id"].iloc[0]


def test_unparseable_forward_frame_is_kept_as_text():
    from snapshot_lab.frames import build

    assert build.parse_traceback_line('  File "a b.py", line 7, in <lambda>\n    x\n') == ("a b.py", 7, "<lambda>")
    assert build.parse_traceback_line("something else\nmore") == ("??", 0, "something else")
    assert build.parse_traceback_line('  File "x.py", line 99999999999999999999, in f') == (
        "??",
        0,
        'File "x.py", line 99999999999999999999, in f',
    )


def test_forward_frames_of_a_real_recording():
    """A cut of a real torch 2.11 recording under torch.autograd.detect_anomaly (grad_anomaly_python):
    backward's allocations have no Python stack (frames == []) but a forward traceback."""
    from pathlib import Path

    from snapshot_lab import load_frames

    fr = load_frames(Path(__file__).parent / "fuzz" / "corpus_extra" / "grad_anomaly_python_cut.pickle.xz")
    ev = fr.events
    assert ev["forward_stack_id"].notna().sum() == 26
    assert fr.blocks["forward_stack_id"].notna().sum() == 3
    fwd = fr.stack(ev["forward_stack_id"].dropna().iloc[0])
    assert [f["name"] for f in fwd][-2:] == ["main", "<module>"]  # outermost last
    assert fwd[-1]["line"] == 588
    assert ev.loc[ev["forward_stack_id"].notna(), "stack_id"].isna().all()


def _resident_pages(a) -> int:
    """Pages of ``a``'s buffer that are in memory (Linux ``mincore``)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = a.__array_interface__["data"][0]
    first = start - start % page
    n = (start + a.nbytes - first + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
    return int(np.frombuffer(vec, dtype=np.uint8).astype(bool).sum())


def test_the_events_frames_all_zero_columns_hold_no_memory():
    """device 0's number, one stream's, the values under an all-missing mask (forward stacks,
    device_free: absent from nearly every recording) and a mask with nothing missing (addresses)
    are never written: at 5M entries that is 35 bytes an entry of the frame that every process
    of a report shares. A column with one value present keeps its values."""
    import sys

    import numpy as np
    import pytest

    from snapshot_lab.frames.build import _MISSING, _TraceColumns

    if not sys.platform.startswith("linux"):
        pytest.skip("mincore: Linux")
    n = 5_000_000
    cols = _TraceColumns()
    zeros = {"action": np.int16, "metadata": np.int32}
    for key in cols.parts:
        cols.parts[key].append(np.zeros(n, dtype=zeros.get(key, np.int64)))
    cols.parts["forward"][0] = np.full(n, _MISSING, dtype=np.int64)
    cols.parts["address"][0] = np.full(n, 1 << 20, dtype=np.int64)
    cols.parts["stream"][0] = np.full(n, 0, dtype=np.int64)  # written zeros
    free = np.full(n, _MISSING, dtype=np.int64)
    free[-1] = 123
    cols.parts["free"][0] = free
    ev = cols.frame(0, [""])
    unwritten = {
        "device": ev["device"].to_numpy(),
        "stream": ev["stream"].to_numpy(),
        "forward_stack_id": ev["forward_stack_id"].array._data,
        "address's mask": ev["address"].array._mask,
    }
    for name, values in unwritten.items():
        assert _resident_pages(values) == 0, name  # of 9,766 (1,221 for a mask)
    assert ev["address"].notna().all() and ev["address"].iloc[0] == 1 << 20
    assert (ev["stream"] == 0).all()
    assert ev["forward_stack_id"].isna().all()
    assert (ev["device"] == 0).all()
    assert ev["device_free_bytes"].isna().sum() == n - 1
    assert int(ev["device_free_bytes"].iloc[-1]) == 123
    assert cols.frame(3, [""])["device"].unique().tolist() == [3]


def test_a_column_of_unwritten_zeros_is_private_to_a_forked_child():
    """The report forks workers over the frames: a child's write to a column of zeros (a shared
    mapping would carry it back) leaves the parent's column as it was."""
    import multiprocessing
    import sys

    import numpy as np
    import pytest

    from snapshot_lab.frames.build import _zeros

    if not sys.platform.startswith("linux"):
        pytest.skip("fork: Linux")
    a = _zeros(1 << 20, np.int64)
    child = multiprocessing.get_context("fork").Process(target=a.fill, args=(7,))
    child.start()
    child.join()
    assert child.exitcode == 0
    assert not a.any() and a.size == 1 << 20
    a[3] = 5  # writable
    assert int(a.sum()) == 5 and _zeros(0, np.bool_).size == 0
