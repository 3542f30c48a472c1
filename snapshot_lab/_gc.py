"""Pause Python's cyclic garbage collector around bulk object creation.

Unpickling a snapshot creates millions of dicts and lists; each batch of allocations triggers a
collection that walks every live container, which made loading three times slower than the
unpickling itself. Snapshots hold no reference cycles, so nothing is lost by waiting.

The collector counts allocations even while it is disabled, so the first allocation after it
is enabled again would start a collection of the youngest generation, which by then holds every
object created in the pause: walking the two million containers of a 1M-entry trace took longer
than half the unpickling. Those objects are moved to the oldest generation instead (what
collections would have done with survivors), which also resets the count; the next full
collection still examines them, so no cyclic garbage is lost, only found later.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _age_young_objects() -> None:
    """Move every tracked object to the oldest generation, unless someone froze objects (then
    unfreezing would thaw theirs too, and the collector is left to do its usual work)."""
    if gc.get_freeze_count() == 0:
        gc.freeze()  # moves every generation into the permanent one and zeroes the counts
        gc.unfreeze()  # and back, into the oldest generation


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            _age_young_objects()
            gc.enable()


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None elsewhere (musl, macOS, Windows: nothing to call)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]  # the padding to leave: a size_t, not an int
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_MALLOC_TRIM: list[Callable[[int], int] | None] = []


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``). Building the
    frames allocates and frees many arrays of a few megabytes; glibc keeps what they leave free
    in the middle of its heap, which stayed resident for the rest of the command (about 27 bytes
    a trace entry: 260 MiB at 10M entries), raising every later stage's peak by as much."""
    if not _MALLOC_TRIM:
        _MALLOC_TRIM.append(_load_malloc_trim())
    trim = _MALLOC_TRIM[0]
    if trim is not None:
        trim(0)
