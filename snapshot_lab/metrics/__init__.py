"""Metrics: pure functions of frames, one module per question."""

from .recording import Recording, describe_recording
from .stats.fragmentation import PoolFragmentation, compute_fragmentation
from .stats.oom import OomAnalysis, analyse_oom
from .stats.summary import DeviceStats, SnapshotStats, compute_stats
from .stats.torch_stats import STAT_NAMES, compute_torch_stats

__all__ = [
    "STAT_NAMES",
    "DeviceStats",
    "OomAnalysis",
    "PoolFragmentation",
    "Recording",
    "SnapshotStats",
    "analyse_oom",
    "compute_fragmentation",
    "compute_stats",
    "compute_torch_stats",
    "describe_recording",
]
