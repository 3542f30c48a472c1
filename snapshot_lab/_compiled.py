"""The optional compiled parts of snaplab (C sources built by ``setup.py`` when the machine
has a compiler). Each has a pure-Python twin that gives the same answers and that the tests
compare it with; ``SNAPLAB_PURE_PYTHON=1`` makes snaplab use only the Python code."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

PURE_PYTHON_VARIABLE = "SNAPLAB_PURE_PYTHON"

# every compiled module, by the name the code imports
MODULES = ("snapshot_lab.frames._scan", "snapshot_lab.load._decode", "snapshot_lab.metrics.allocator._replay")


def pure_python_forced() -> bool:
    return os.environ.get(PURE_PYTHON_VARIABLE, "") not in ("", "0")


def compiled(name: str) -> ModuleType | None:
    """The compiled module ``name``, or None when it was not built or is switched off."""
    if pure_python_forced():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def describe() -> str:
    """One line: which of the compiled parts this installation uses."""
    if pure_python_forced():
        return f"pure Python ({PURE_PYTHON_VARIABLE} is set)"
    built = [name.rsplit(".", 1)[1] for name in MODULES if compiled(name) is not None]
    if len(built) == len(MODULES):
        return "compiled (C)"
    if not built:
        return "pure Python (the C extensions were not built)"
    return f"partly compiled ({', '.join(built)})"
