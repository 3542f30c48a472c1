"""Frames: the snapshot as pandas tables with declared schemas."""

from .build import SnapshotFrames, SnapshotInfo, build_frames, check_frames, device_rows, event_positions
from .schema import (
    ANNOTATIONS_SCHEMA,
    BLOCKS_SCHEMA,
    EVENTS_SCHEMA,
    SEGMENTS_SCHEMA,
    STACK_FRAMES_SCHEMA,
    STACKS_SCHEMA,
)

__all__ = [
    "ANNOTATIONS_SCHEMA",
    "BLOCKS_SCHEMA",
    "EVENTS_SCHEMA",
    "SEGMENTS_SCHEMA",
    "STACKS_SCHEMA",
    "STACK_FRAMES_SCHEMA",
    "SnapshotFrames",
    "SnapshotInfo",
    "build_frames",
    "check_frames",
    "device_rows",
    "event_positions",
]
