"""Loading: the only stage that knows the pickle and the format's versions."""

from .loader import BLOCK_STATES, Snapshot, SourceInfo, load_snapshot, normalise
from .unpickler import SafeUnpickler, safe_load

__all__ = ["BLOCK_STATES", "SafeUnpickler", "Snapshot", "SourceInfo", "load_snapshot", "normalise", "safe_load"]
