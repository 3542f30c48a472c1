"""SnapshotFrames.device_events: the same rows as selecting by device, without a copy of the
whole events frame when the recording has one device (issue #40)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from snapshot_lab.frames import build_frames
from snapshot_lab.load import load_snapshot

from .conftest import event, make_snapshot


def _frames(snap_file, traces):
    return build_frames(load_snapshot(snap_file(make_snapshot([], traces))))


def _selected(events: pd.DataFrame, device: int) -> pd.DataFrame:
    return events[events["device"] == device]


def test_one_device_gives_the_same_frame_without_copying(snap_file):
    fr = _frames(snap_file, [[event("alloc", 0x1000, 512, 10), event("free_requested", 0x1000, 512, 20)]])
    got = fr.device_events(0)
    pd.testing.assert_frame_equal(got, _selected(fr.events, 0), check_index_type=True)
    assert type(got.index) is type(_selected(fr.events, 0).index)
    assert np.shares_memory(got["size_bytes"].to_numpy(), fr.events["size_bytes"].to_numpy())
    assert got is not fr.events
    got["added"] = 1  # the caller's frame is its own: events is left as it was
    got.loc[0, "size_bytes"] = 7
    assert "added" not in fr.events.columns
    assert fr.events["size_bytes"].tolist() == [512, 512]


def test_several_devices_give_the_selected_rows(snap_file):
    fr = _frames(
        snap_file,
        [[event("alloc", 0x1000, 512, 10)], [event("alloc", 0x2000, 64, 11), event("free_requested", 0x2000, 64, 12)]],
    )
    for device in (0, 1, 2):
        pd.testing.assert_frame_equal(fr.device_events(device), _selected(fr.events, device))


def test_a_device_without_events_gives_an_empty_frame(snap_file):
    fr = _frames(snap_file, [[event("alloc", 0x1000, 512, 10)], []])
    pd.testing.assert_frame_equal(fr.device_events(1), _selected(fr.events, 1))
    assert fr.device_events(1).empty


def test_copies_of_frames_still_build(snap_file):
    """conftest.unmemoised rebuilds SnapshotFrames from vars(): device_events keeps no state."""
    from .conftest import unmemoised

    fr = _frames(snap_file, [[event("alloc", 0x1000, 512, 10)]])
    pd.testing.assert_frame_equal(unmemoised(fr).device_events(0), fr.device_events(0))


def test_real_samples(real_frames):
    """A one-device recording and one that names two devices (DataParallel)."""
    for name in ("transformer_varlen", "dataparallel"):
        fr = real_frames(name)
        for device in sorted({*fr.events["device"].unique().tolist(), 0}):
            pd.testing.assert_frame_equal(fr.device_events(device), _selected(fr.events, device))


def test_consume_lets_the_decoded_traces_go(snap_file):
    """build_frames(consume=True) of a decoded snapshot drops the decoded columns it did not take
    into the frames, as the Python path empties the entry lists; the frames are the same."""
    from snapshot_lab import _compiled

    traces = [[event("alloc", 0x1000, 512, 10), event("free_requested", 0x1000, 512, 20)], []]
    path = snap_file(make_snapshot([], traces))
    kept = build_frames(load_snapshot(path))
    snap = load_snapshot(path)
    decoded = snap.decoded_traces is not None
    consumed = build_frames(snap, consume=True)
    pd.testing.assert_frame_equal(consumed.events, kept.events)
    assert consumed.info == kept.info
    assert snap.decoded_traces is None
    assert snap.device_traces == [[], []]
    assert decoded == _compiled.describe().startswith("compiled")
