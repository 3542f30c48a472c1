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
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("snaplab_capture") else None
