"""Positions of trace entries (frames.event_positions) and the trace's frees of blocks older
than it (history.lifetimes.orphan_frees), which finds them by position."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from snapshot_lab.frames import EVENTS_SCHEMA, event_positions
from snapshot_lab.frames.schema import conform
from snapshot_lab.metrics.history.lifetimes import allocation_lifetimes, orphan_frees


def test_positions_of_a_trace_without_gaps_are_offsets() -> None:
    index = np.arange(7, 17, dtype=np.int64)
    wanted = np.array([16, 7, 12, 12], dtype=np.int64)
    assert event_positions(index, wanted).tolist() == [9, 0, 5, 5]


def test_positions_of_indices_with_gaps_are_searched() -> None:
    index = np.array([0, 2, 3, 10, 11], dtype=np.int64)
    wanted = np.array([11, 0, 10, 3], dtype=np.int64)
    assert event_positions(index, wanted).tolist() == [4, 0, 3, 2]


def test_positions_of_an_empty_trace() -> None:
    assert event_positions(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)).tolist() == []


def _events(rows: list[tuple[str, int | None, int, int | None]], first_index: int, step: int) -> pd.DataFrame:
    """One device's trace: (action, address, size, stack id) per entry, event indices from
    ``first_index`` by ``step``."""
    n = len(rows)
    frame = pd.DataFrame(
        {
            "device": [0] * n,
            "event_index": [first_index + step * i for i in range(n)],
            "action": [r[0] for r in rows],
            "address": pd.array([r[1] for r in rows], dtype="Int64"),
            "size_bytes": [r[2] for r in rows],
            "stream": [0] * n,
            "time_us": pd.array([None] * n, dtype="Int64"),
            "stack_id": pd.array([r[3] for r in rows], dtype="Int64"),
            "forward_stack_id": pd.array([None] * n, dtype="Int64"),
            "device_free_bytes": pd.array([None] * n, dtype="Int64"),
            "user_metadata": [""] * n,
        }
    )
    return conform(frame, EVENTS_SCHEMA)


TRACE = [
    ("free_completed", 0x1000, 512, 4),  # older than the trace
    ("alloc", 0x2000, 1024, 1),
    ("free_requested", 0x2000, 1024, 1),
    ("free_completed", 0x2000, 1024, 1),  # the allocation's own free
    ("alloc", 0x2000, 2048, 2),
    ("oom", None, 4096, None),
    ("free_completed", 0x3000, 256, None),  # older than the trace, no stack
    ("free_completed", 0x2000, 2048, 3),  # the second allocation's free
]


@pytest.mark.parametrize(("first_index", "step"), [(0, 1), (5, 3)])
def test_orphan_frees_are_the_frees_no_allocation_made(first_index: int, step: int) -> None:
    events = _events(TRACE, first_index, step)
    out = orphan_frees(events, allocation_lifetimes(events, 0))
    assert out["event_index"].tolist() == [first_index, first_index + 6 * step]
    assert out["address"].tolist() == [0x1000, 0x3000]
    assert out["size_bytes"].tolist() == [512, 256]
    assert out["stack_id"].tolist() == [4, pd.NA]
    assert list(out.columns) == ["event_index", "address", "size_bytes", "stack_id"]
    assert out["address"].dtype == np.int64 and out.index.tolist() == [0, 1]


def test_no_orphan_frees_when_every_free_is_matched() -> None:
    events = _events(TRACE[1:5] + TRACE[7:], 0, 1)
    out = orphan_frees(events, allocation_lifetimes(events, 0))
    assert out.empty and list(out.columns) == ["event_index", "address", "size_bytes", "stack_id"]
