"""Results derived from one snapshot's frames, computed once and kept while the frames live.

Several metrics need the same derived tables (allocation lifetimes, categories); the commands
and the report call them in different orders. Keyed by the frames object's identity, dropped
when it is garbage collected."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .._gc import release_freed_memory

T = TypeVar("T")
_STORE: dict[int, dict[Hashable, Any]] = {}


def memo(owner: object, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()`` once per (owner, key)."""
    slot = _STORE.get(id(owner))
    if slot is None:
        slot = _STORE[id(owner)] = {}
        weakref.finalize(owner, _STORE.pop, id(owner), None)
    if key not in slot:
        slot[key] = compute()
    return slot[key]  # type: ignore[no-any-return]


def forget(owner: object, key: Hashable) -> None:
    """Drop what :func:`memo` keeps for (owner, key), where a caller knows nothing after it
    reads it again (a later :func:`memo` computes it anew); its pages go back to the system."""
    _drop(owner, lambda k: k == key)


def forget_named(owner: object, name: str) -> None:
    """:func:`forget` every key of ``owner`` that is ``name`` or a tuple that starts with it (the
    same table for every device and argument)."""
    _drop(owner, lambda k: k == name or (isinstance(k, tuple) and k[:1] == (name,)))


def _drop(owner: object, dropped: Callable[[Hashable], bool]) -> None:
    slot = _STORE.get(id(owner))
    if slot is None:
        return
    for key in [k for k in slot if dropped(k)]:
        del slot[key]
    release_freed_memory()  # glibc keeps what a large table leaves free in the middle of its heap
