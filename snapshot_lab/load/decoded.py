"""The trace of a snapshot read straight into columns (``load/_decode.c``), without building one
dict per trace entry.

The compiled reader builds every object outside ``device_traces`` exactly as ``pickle.load``
does; inside it, each entry's fields go into per-device numpy columns and each entry's
``frames`` list becomes a key into a table of distinct stacks (tuples of the shared frame
dicts). It gives up (None) on anything but the regular case, and the caller then reads the
file with the restricted unpickler, which is the reference and names what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._compiled import compiled

ABSENT = -(2**63)  # an integer column's value for an entry without that key


@dataclass(frozen=True)
class DeviceTrace:
    """One device's trace entries as columns, in the file's order.

    ``action`` and ``metadata`` are codes into ``action_names`` and ``metadata_names`` (the
    distinct strings, ``metadata_names[0] == ''`` stands for an absent ``user_metadata``);
    ``size, address, stream, time_us, device_free`` are int64 with :data:`ABSENT` for a missing
    key (``size`` is always there, ``stream`` defaults to 0, ``device_free`` is kept only on
    ``oom`` entries); ``stack`` indexes :attr:`DecodedTraces.stacks`; ``forward`` maps an
    entry's position to its ``forward_frames`` list of strings; ``first_keys`` says which of
    ``time_us``, ``compile_context``, ``user_metadata``, ``pool_id`` the first entry holds;
    ``pools`` maps an entry's position to its ``pool_id`` when that is not ``(0, 0)`` and
    ``contexts`` to its ``compile_context`` when that is not ``'N/A'`` (torch >= 2.12 and 2.8
    write them on every entry: only the informative ones are kept). Every value was checked:
    ints in their ranges, strings, frames that are dicts of the documented types.
    """

    size_of_trace: int
    action: np.ndarray
    action_names: list[str]
    size: np.ndarray
    address: np.ndarray
    stream: np.ndarray
    time_us: np.ndarray
    device_free: np.ndarray
    metadata: np.ndarray
    metadata_names: list[str]
    stack: np.ndarray
    forward: dict[int, list[str]]
    first_keys: frozenset[str]
    pools: dict[int, tuple[int, int]]
    contexts: dict[int, str]
    left_out: int = 0  # the device's first entries not read (the window of ``max_entries``)


@dataclass(frozen=True)
class DecodedTraces:
    """Every device's trace (one :class:`DeviceTrace` per ordinal, possibly empty) and the
    distinct stacks they use: ``stacks[k]`` is a tuple of frame dicts (or strings), innermost
    first, the same objects wherever the file shared them; ``stacks[0] == ()``."""

    devices: list[DeviceTrace]
    stacks: list[tuple[Any, ...]]


_FIRST_KEYS = ((1, "time_us"), (2, "compile_context"), (4, "user_metadata"), (8, "pool_id"))


def _device(parts: tuple[Any, ...]) -> DeviceTrace:
    n, action, action_names, size, addr, stream, time, free, meta, meta_names, stack, forward, hints, pools, ctx = (
        parts[:15]
    )

    def int64(b: bytearray) -> np.ndarray:
        return np.frombuffer(b, dtype=np.int64)

    return DeviceTrace(
        size_of_trace=n,
        action=np.frombuffer(action, dtype=np.int16),
        action_names=action_names,
        size=int64(size),
        address=int64(addr),
        stream=int64(stream),
        time_us=int64(time),
        device_free=int64(free),
        metadata=np.frombuffer(meta, dtype=np.int32),
        metadata_names=meta_names,
        stack=int64(stack),
        forward=forward,
        first_keys=frozenset(key for bit, key in _FIRST_KEYS if hints & bit),
        pools=pools,
        contexts=ctx,
        left_out=parts[15] if len(parts) > 15 else 0,
    )


def decode_pickle(
    data: Any,
    mapped_file: bool = False,
    on_progress: Callable[[int], object] | None = None,
    max_entries: int | None = None,
) -> tuple[Any, DecodedTraces | None] | None:
    """``(root object, decoded traces or None when the file has none)`` of a pickle held in
    ``data`` (bytes, or any buffer), or None when the compiled reader is not built, is switched
    off, or gives up (then read the file with :func:`~snapshot_lab.load.unpickler.safe_load`).
    ``mapped_file``: ``data`` is a read-only ``mmap`` of a file, whose pages are given back to
    the system as they are read, so the file does not add to the process's memory.
    ``on_progress(offset)``: told how many bytes of ``data`` were read, as the reading goes on
    (every 16 MiB of a pickle of protocol 4 or later, whose frames say where it is).
    ``max_entries``: keep each device's last ``max_entries`` trace entries only (the others are
    dropped as the reading goes on; :attr:`DeviceTrace.left_out` counts them); None: all."""
    decoder = compiled("snapshot_lab.load._decode")
    if decoder is None:
        return None
    # the arguments given are the ones an extension built before on_progress or keep existed takes
    args: tuple[Any, ...] = (data, "oom", mapped_file)
    if on_progress is not None or max_entries is not None:
        args += (on_progress,)
    if max_entries is not None:
        args += (max_entries if max_entries < 2**62 else 0,)  # 0: every entry (no file holds 2**62)
    out = decoder.decode(*args)
    if out is None:
        return None
    root, traces = out
    if traces is None:
        return root, None
    devices, stacks = traces
    return root, DecodedTraces([_device(d) for d in devices], stacks)
