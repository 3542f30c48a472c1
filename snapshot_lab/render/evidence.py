"""A finding's evidence for people: each machine key as words, each value with its unit.

The findings keep their machine keys (``--json`` prints them unchanged); only here do they
become labels. One number format everywhere: bytes in binary units (``format_bytes``),
shares as percentages, counts with thousands separators, "not recorded" for a missing value.
"""

from __future__ import annotations

import re
from typing import Any

from ..units import format_bytes, format_percent

# wording for the keys whose words alone would not read well
LABELS = {
    "requested_bytes": "request that failed",
    "free_in_reserved_bytes": "free in reserved memory",
    "largest_free_block_bytes": "largest free block",
    "device_free_bytes": "free on the device (CUDA)",
    "oom_count": "out-of-memory errors in the trace",
    "recovered_count": "out-of-memory errors the job went on from",
    "largest_request_bytes": "largest request refused",
    "smallest_request_bytes": "smallest request refused",
    "first_event_index": "first refused at event",
    "last_event_index": "last refused at event",
    "ended_by_an_oom": "then one ended the job",
    "snapshot_at_oom": "snapshot taken at the OOM",
    "layout_from": "layout from",
    "memory_limit_bytes": "memory limit",
    "memory_limit_inferred": "memory limit inferred",
    "settings_that_serve_the_request": "settings that serve the request",
    "predicted_peak_reserved_bytes": "predicted peak reserved",
    "recorded_peak_reserved_bytes": "recorded peak reserved",
    "replay_check": "replay of the recorded settings",
    "iterations_from": "iterations found from",
    "growth_bytes_per_iteration": "growth per iteration",
    "top_site_growth_bytes_per_iteration": "top site's growth per iteration",
    "leaked_bytes_live": "leaked and still live",
    "external_fragmentation": "external fragmentation (1 − largest free / free)",
    "levels_anchored_at_dump": "levels anchored at the dump",
    "kept_share_of_forward_gathers": "share of forward all-gathers kept",
    "tp_degree": "tensor-parallel degree",
    "ddp_bucket_bytes": "DDP bucket memory",
    "ddp_bucket_blocks": "DDP bucket blocks",
}
SHARE_WORDS = ("fragmentation", "share", "fraction", "ratio")
MACHINE_KEY = re.compile(r"[a-z][a-z0-9_]*")
STAKE_HELP = "memory this advice would free or make usable"


def evidence_label(key: str) -> str:
    """``predicted_peak_reserved_bytes`` -> ``predicted peak reserved``."""
    if key in LABELS:
        return LABELS[key]
    words = key.replace("_bytes_", "_").removesuffix("_bytes").split("_")
    text = " ".join(words)
    return text.replace("device ", "on device ") if "device " in text and not text.startswith("device") else text


def evidence_value(value: Any, key: str = "") -> str:
    """One value with its unit."""
    if value is None:
        return "not recorded"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and "bytes" in key:
        return format_bytes(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if any(word in key for word in SHARE_WORDS):
            return format_percent(value)
        return f"{value:,.3g}"
    if isinstance(value, list | tuple | set):
        items = [evidence_value(item, key) for item in value]
        return "; ".join(items) if items else "none"
    if isinstance(value, dict):
        return (
            "; ".join(
                f"{_inner_label(str(inner))}: {evidence_value(item, _inner_key(str(inner), key))}"
                for inner, item in value.items()
            )
            or "none"
        )
    return str(value)


def _inner_label(key: str) -> str:
    """A key inside a value: a machine key becomes words, anything else (an allocator setting such
    as ``max_split_size_mb:64``, a site, a module) stays as it is."""
    return evidence_label(key) if MACHINE_KEY.fullmatch(key) else key


def _inner_key(key: str, outer: str) -> str:
    """The key that decides an inner value's unit: its own when it is a machine key, else the
    outer one (``{"expandable_segments:True": 2462056448}`` under ``..._bytes`` is bytes)."""
    return key if MACHINE_KEY.fullmatch(key) else outer


def evidence_rows(evidence: dict[str, Any], savings_bytes: int | None = None) -> list[tuple[str, str, str]]:
    """(label, value, tooltip) per key, then what is at stake; the tooltip names the machine key."""
    rows = [(evidence_label(key), evidence_value(value, key), f"--json key: {key}") for key, value in evidence.items()]
    if savings_bytes:
        rows.append(("at stake", f"{format_bytes(savings_bytes)} ({STAKE_HELP})", "--json key: savings_bytes"))
    return rows
