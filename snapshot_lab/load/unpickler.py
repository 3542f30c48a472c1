"""A pickle reader that never runs code.

A memory snapshot is a tree of builtin containers (dict, list, tuple, str, int, float, bool,
None). Such a pickle never needs ``find_class``; any pickle that names a global (a class or a
function, e.g. ``os.system``) is refused before the global is even looked up, so nothing in it
can run. We subclass the C unpickler, so loading stays as fast as ``pickle.load``.
"""

from __future__ import annotations

import pickle
import sys
from typing import IO, Any


class ForbiddenGlobalError(pickle.UnpicklingError):
    """The pickle names a global; a real snapshot never does."""

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name
        super().__init__(f"{module}.{name}")


class ForbiddenPersistentIdError(pickle.UnpicklingError):
    """The pickle uses persistent ids (a framework's own object references)."""


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that refuses every global and every persistent id."""

    def find_class(self, module: str, name: str) -> Any:
        raise ForbiddenGlobalError(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise ForbiddenPersistentIdError(f"persistent id {str(pid)[:80]!r}")


_SPURIOUS = "deallocated bytearray object has exported buffers"


def _quiet_spurious_system_error(previous: Any) -> Any:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if exc_type is SystemError and str(exc) == _SPURIOUS:
            return
        previous(exc_type, exc, tb)

    return hook


def safe_load(stream: IO[bytes]) -> Any:
    """Unpickle ``stream`` refusing every global. Raises the errors of :mod:`pickle`.

    A ``BYTEARRAY8`` opcode of an impossible size makes CPython (3.11 at least) fail to allocate
    the bytearray and then free it with an uninitialised export count, which it reports by
    printing ``SystemError: deallocated bytearray object has exported buffers`` through
    ``sys.excepthook`` beside the MemoryError it raises. Nothing was exported and nothing leaks;
    that print alone is silenced while unpickling, so a refused file still gives one line."""
    previous = sys.excepthook
    sys.excepthook = _quiet_spurious_system_error(previous)
    try:
        return SafeUnpickler(stream).load()
    finally:
        sys.excepthook = previous
