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

import gc
from collections.abc import Iterator
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
