"""The ``.meta.json`` sidecar that ``snapshot_lab.capture`` writes beside each snapshot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SIDECAR_SUFFIX = ".meta.json"
_SNAPSHOT_SUFFIXES = (".gz", ".xz", ".zst", ".zstd", ".bz2", ".pickle", ".pkl", ".json")
_MAX_SIDECAR_BYTES = 4 * 1024 * 1024


def sidecar_path(snapshot: str | Path) -> Path:
    p = Path(snapshot)
    name = p.name
    for suffix in _SNAPSHOT_SUFFIXES:
        name = name.removesuffix(suffix)
    return p.with_name(name + SIDECAR_SUFFIX)


def load_sidecar(snapshot: str | Path) -> dict[str, Any] | None:
    """The sidecar's content, or None when there is none or it is unreadable (a sidecar is a
    convenience: analysis never fails because of it)."""
    path = sidecar_path(snapshot)
    try:
        if not path.is_file() or path.stat().st_size > _MAX_SIDECAR_BYTES:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return _checked(data) if isinstance(data, dict) and data.get("snaplab_capture") else None


def _plain(v: Any) -> bool:
    return v is None or type(v) in (str, int, float, bool)


def _checked(meta: dict[str, Any]) -> dict[str, Any]:
    """The sidecar with every value the analysis reads of the type capture writes; a value
    edited into something else is dropped (the sidecar is a convenience, never a reason to fail)."""
    out: dict[str, Any] = {}
    for key, v in meta.items():
        if key == "argv":
            if type(v) is list and all(type(a) is str for a in v):
                out[key] = v
        elif key == "oom":
            if type(v) is dict and all(type(k) is str and _plain(x) for k, x in v.items()):
                out[key] = v
        elif key == "batch_size":
            if type(v) is int and v > 0:
                out[key] = v
        elif key in ("incident", "module_tags", "parallel"):
            if type(v) is dict:
                out[key] = v  # read defensively where read (metrics.parallelism) or only shown
        elif key in ("memory_stats", "device_total_bytes", "recording") or _plain(v):
            out[key] = v  # the first three are only passed through
    return out


def sidecar_batch_size(capture: dict[str, Any] | None) -> int | None:
    """The batch size, in samples, that the capture recorded (``recording(batch_size=...)``, a
    framework callback that read it), or None when the sidecar has none."""
    value = capture.get("batch_size") if isinstance(capture, dict) else None
    return value if type(value) is int and value > 0 else None
