"""A pickle reader that never runs code.

A memory snapshot is a tree of builtin containers (dict, list, tuple, str, int, float, bool,
None). Such a pickle never needs ``find_class``; any pickle that names a global (a class or a
function, e.g. ``os.system``) is refused before the global is even looked up, so nothing in it
can run. We subclass the C unpickler, so loading stays as fast as ``pickle.load``.
"""

from __future__ import annotations

import pickle
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


def safe_load(stream: IO[bytes]) -> Any:
    """Unpickle ``stream`` refusing every global. Raises the errors of :mod:`pickle`."""
    return SafeUnpickler(stream).load()
