"""Checks of single fields, with the one-line messages that name the field.

A snapshot arrives hand-edited, truncated or written by a torch version snaplab has not seen, so
every value is checked where the pickle is read and nothing downstream sees an impossible one. A
refusal names the field by its path in the file and says what was expected and what was there::

    device_traces[0][1532].size: expected an integer in [0, 2**63), got 2**64

Values are described without ``repr`` of containers: a value can be a cycle, a list nested a
million deep or a string of a megabyte, and the message must stay one short line.
"""

from __future__ import annotations

import math
from typing import Any

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1
MAX_DEVICE = 65535  # CUDA ordinals are small (c10::DeviceIndex is int8); this leaves room for new kinds


class FieldError(ValueError):
    """A field has a value no snapshot can hold. ``path`` is relative to the container checked."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)

    def under(self, prefix: str) -> FieldError:
        """The same error with its path below ``prefix`` (``segments[3]`` + ``.size``)."""
        if not self.path:
            return FieldError(prefix, self.message)
        sep = "" if self.path.startswith("[") else "."
        return FieldError(f"{prefix}{sep}{self.path}", self.message)


def describe(v: Any) -> str:
    """A short, one-line, bounded description of any value, for ``got ...``."""
    if v is None or isinstance(v, bool):
        return repr(v)
    if isinstance(v, int):
        if v != 0 and abs(v) & (abs(v) - 1) == 0 and abs(v) >= 2**32:
            return f"{'-' if v < 0 else ''}2**{abs(v).bit_length() - 1}"
        if v.bit_length() > 96:
            return f"{'-' if v < 0 else ''}an integer of {v.bit_length()} bits"
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        if len(v) > 40:
            return f"{v[:32]!r}... ({len(v):,} characters)"
        return repr(v)
    if isinstance(v, (list, tuple, dict, set, frozenset)):
        kind = type(v).__name__
        n = len(v)
        unit = "key" if isinstance(v, dict) else "item"
        return f"a {kind} of {n:,} {unit}{'' if n == 1 else 's'}"
    if isinstance(v, (bytes, bytearray)):
        return f"{type(v).__name__} of length {len(v):,}"
    name = type(v).__name__
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"


def _bound(x: int) -> str:
    for p in (63, 64, 31, 32, 16):
        if x == 2**p:
            return f"2**{p}"
        if x == -(2**p):
            return f"-2**{p}"
    return str(x)


def int_range(lo: int, hi_excl: int) -> str:
    return f"an integer in [{_bound(lo)}, {_bound(hi_excl)})"


def check_int(v: Any, lo: int = 0, hi_excl: int = 2**63, path: str = "") -> int:
    """``v`` itself when it is an int (not a bool) in ``[lo, hi_excl)``; else a FieldError."""
    if type(v) is int and lo <= v < hi_excl:
        return v
    raise FieldError(path, f"expected {int_range(lo, hi_excl)}, got {describe(v)}")


def check_str(v: Any, path: str = "") -> str:
    if type(v) is str:
        return v
    raise FieldError(path, f"expected a string, got {describe(v)}")


def check_bool(v: Any, path: str = "") -> bool:
    if type(v) is bool:
        return v
    raise FieldError(path, f"expected True or False, got {describe(v)}")


def check_number(v: Any, lo: float, hi: float, path: str = "") -> float:
    """A finite int or float in ``[lo, hi]``, as a float."""
    if type(v) in (int, float) and math.isfinite(v) and lo <= v <= hi:
        return float(v)
    raise FieldError(path, f"expected a number in [{lo:g}, {hi:g}], got {describe(v)}")


def check_list(v: Any, path: str = "", what: str = "a list") -> list[Any]:
    if type(v) is list:
        return v
    raise FieldError(path, f"expected {what}, got {describe(v)}")


def check_dict(v: Any, path: str = "", what: str = "a dict") -> dict[Any, Any]:
    if type(v) is dict:
        return v
    raise FieldError(path, f"expected {what}, got {describe(v)}")


def key_path(key: Any) -> str:
    """``.name`` for identifier-like string keys, ``['odd key']`` otherwise (bounded)."""
    if isinstance(key, str) and key.isidentifier() and len(key) <= 40:
        return key
    return f"[{key_repr(key)}]"


def key_repr(key: Any) -> str:
    """A dict key as it goes between brackets in a field's path: ``'1024'``, ``7``, a long
    string cut (``'++++...'``), anything else described."""
    if isinstance(key, str):
        return repr(key if len(key) <= 40 else key[:32] + "...")
    if key is None or isinstance(key, (int, float)):
        return describe(key)
    return describe(key).replace("[", "(").replace("]", ")")
