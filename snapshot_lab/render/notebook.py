"""HTML for Jupyter: what ``stats``, ``findings``, ``diff`` and ``report`` show in a notebook.

A notebook output is a fragment of the notebook's own page, not a document: everything sits in one
``<div class="snaplab-nb">`` whose stylesheet is the report's, scoped to that div (so it styles
nothing else of the notebook). No script, no external resource; everything that came from a
snapshot is escaped by jinja2. The report and the diff page are shown as they are written to
disk: their ``<main>`` in the scoped stylesheet.
"""

from __future__ import annotations

import html
import re
from typing import Any

from ..metrics.findings import Finding
from ..metrics.stats.summary import SnapshotStats
from ..units import format_bytes, format_percent
from .explorer import explorer_script
from .html import _css, _environment

SCOPE = "snaplab-nb"
# the page-level rules of the report's stylesheet, and what they become inside a notebook
_PAGE_SELECTORS = {":root", "html", "body", "main"}
_NOTEBOOK_CSS = f".{SCOPE} {{ max-width:none; margin:0; padding:4px 0 8px; }}"

_COUNTERS = (
    ("allocated_bytes", "in blocks handed to tensors"),
    ("reserved_bytes", "held from CUDA: allocated or cached"),
    ("active_bytes", "allocated + freed blocks still waiting for another stream"),
    ("requested_bytes", "what tensors asked for, before rounding"),
    ("inactive_split_bytes", "free bytes inside split segments"),
)
_POOLS = ("all", "large_pool", "small_pool")


def scope_css(css: str, scope: str = SCOPE) -> str:
    """Every rule of ``css`` limited to ``.scope`` (the page rules become rules of ``.scope``)."""

    def scoped(selector: str) -> str:
        sel = selector.strip()
        if sel in _PAGE_SELECTORS:
            return f".{scope}"
        return f".{scope} {sel}"

    def rule(match: re.Match[str]) -> str:
        selectors = ", ".join(scoped(part) for part in match.group(1).split(",") if part.strip())
        return f"{selectors} {{{match.group(2)}}}"

    return re.sub(r"([^{}]+)\{([^{}]*)\}", rule, css).strip() + "\n" + _NOTEBOOK_CSS


def _wrap(body: str) -> str:
    return f'<div class="{SCOPE}"><style>{scope_css(_css())}</style>{body}</div>'


def page_fragment(page: str) -> str:
    """A page snaplab wrote (report, diff) as a notebook fragment: its ``<main>``, restyled.
    Anything else (a file edited by hand, with a script in it) is not shown."""
    match = re.search(r"<main>(.*)</main>", page, re.DOTALL)
    if match is None or re.search(r"<\s*script", _without_explorer(page), re.IGNORECASE):
        return _wrap('<p class="note">This file is not a page snaplab wrote: not shown here.</p>')
    # the explorer stays behind: a notebook shows the static pictures
    return _wrap(match.group(1))


def _without_explorer(page: str) -> str:
    """The page less the report's own two scripts (its data and exactly the packaged explorer)."""
    tail = (
        '<script type="application/json" id="snaplab-data">[^<]*</script>\n<script>'
        + re.escape(explorer_script())
        + "</script>"
    )
    return re.sub(tail, "", page, count=1)


def missing_fragment(path: str) -> str:
    return _wrap(f'<p class="note">No report at <span class="mono">{html.escape(path)}</span>.</p>')


def _device_view(dev: int, device_stats: Any) -> dict[str, Any]:
    torch_stats = device_stats.torch_stats
    by_pool = device_stats.fragmentation
    cats = device_stats.categories or {}
    total = sum(cats.values()) or 1
    return {
        "device": dev,
        "cards": [
            ("reserved", format_bytes(torch_stats["reserved_bytes.all.current"])),
            ("allocated", format_bytes(torch_stats["allocated_bytes.all.current"])),
            ("free in reserved", format_bytes(by_pool["all"].free_bytes)),
            ("requested", format_bytes(torch_stats["requested_bytes.all.current"])),
            ("external fragmentation", format_percent(by_pool["all"].external_fragmentation)),
        ],
        "counters": [
            (name, [format_bytes(torch_stats.get(f"{name}.{pool}.current")) for pool in _POOLS], help_text)
            for name, help_text in _COUNTERS
        ],
        "fragmentation": [
            ("free blocks", [f"{by_pool[pool].free_blocks:,}" for pool in _POOLS]),
            ("largest free block", [format_bytes(by_pool[pool].largest_free_block_bytes) for pool in _POOLS]),
            ("external fragmentation", [format_percent(by_pool[pool].external_fragmentation) for pool in _POOLS]),
            ("stranded", [format_bytes(by_pool[pool].stranded_bytes) for pool in _POOLS]),
            ("releasable", [format_bytes(by_pool[pool].releasable_bytes) for pool in _POOLS]),
        ],
        "categories": [
            (category, format_bytes(nbytes), format_percent(nbytes / total))
            for category, nbytes in cats.items()
            if nbytes
        ],
        "oom": device_stats.oom,
        "modules": _modules_view(device_stats.modules),
    }


def _modules_view(modules: Any, limit: int = 10) -> dict[str, Any] | None:
    """The modules holding the most bytes at the peak (by themselves), as in ``snaplab stats``."""
    if modules is None or modules.source == "none" or not modules.rows:
        return None
    return {
        "exact": modules.source == "tags",
        "peak": format_bytes(modules.peak_bytes),
        "rows": [
            (
                row.label,
                format_bytes(row.self_bytes),
                format_bytes(row.by_phase.get("fwd", 0)),
                format_bytes(row.by_phase.get("bwd", 0)),
            )
            for row in modules.largest(limit)
        ],
        "outside": format_bytes(modules.outside_bytes),
        "before": format_bytes(modules.before_trace_bytes) if modules.before_trace_bytes else "",
    }


def render_stats_fragment(stats: SnapshotStats) -> str:
    """``snaplab stats`` as a notebook fragment: per device, the cards, counters, fragmentation,
    categories and the OOM, if any."""
    name = str(stats.file.get("path", "")).replace("\\", "/").split("/")[-1]
    body = (
        _environment()
        .get_template("notebook_stats.html.j2")
        .render(name=name, devices=[_device_view(dev, device_stats) for dev, device_stats in stats.devices.items()])
    )
    return _wrap(body)


def render_findings_fragment(findings: list[Finding]) -> str:
    """``snaplab findings`` as a notebook fragment, in the report's style."""
    multi = len({finding.device for finding in findings if finding.device is not None}) > 1
    body = _environment().get_template("notebook_findings.html.j2").render(findings=findings, multi_device=multi)
    return _wrap(body)
