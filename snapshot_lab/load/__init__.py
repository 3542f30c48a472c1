"""Loading: the only stage that knows the pickle and the format's versions."""

from .loader import BLOCK_STATES, Snapshot, SourceInfo, load_snapshot, normalise, plain_pickle_size
from .sidecar import load_sidecar, sidecar_path
from .unpickler import SafeUnpickler, safe_load

__all__ = [
    "BLOCK_STATES",
    "SafeUnpickler",
    "Snapshot",
    "SourceInfo",
    "load_sidecar",
    "load_snapshot",
    "normalise",
    "plain_pickle_size",
    "safe_load",
    "sidecar_path",
]
