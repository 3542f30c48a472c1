"""Loading: the only stage that knows the pickle and the format's versions."""

from .loader import BLOCK_STATES, PickleSize, Snapshot, SourceInfo, load_snapshot, normalise, pickle_size
from .sidecar import load_sidecar, sidecar_path
from .unpickler import SafeUnpickler, safe_load

__all__ = [
    "BLOCK_STATES",
    "PickleSize",
    "SafeUnpickler",
    "Snapshot",
    "SourceInfo",
    "load_sidecar",
    "load_snapshot",
    "normalise",
    "pickle_size",
    "safe_load",
    "sidecar_path",
]
