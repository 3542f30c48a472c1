"""The HTML report: one context object, one jinja2 environment, one self-contained file.

Everything that came from the snapshot reaches the page through jinja2's autoescaping; only
the SVG that matplotlib wrote (which escapes its own text) is inserted as markup.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass, field
from typing import Any

import jinja2

from ..metrics.attribution.composition import Composition
from ..metrics.attribution.sites import Site
from ..metrics.explore import Exploration
from ..metrics.findings import Finding
from ..metrics.stats.oom import OomAnalysis
from ..units import format_bytes, format_percent
from .answer import FirstScreen, FitSummary, SourceFile
from .evidence import evidence_rows
from .explorer import content_security_policy, explorer_script


@dataclass(frozen=True)
class Card:
    label: str
    value: str
    help: str


@dataclass(frozen=True)
class Row:
    name: str
    values: list[str]
    help: str


@dataclass(frozen=True)
class SiteView:
    site: Site
    # display stack: internals removed, each frame with its 'kind'
    stack: list[dict[str, Any]]
    full_stack: list[dict[str, Any]]


@dataclass
class DeviceSection:
    device: int
    cards: list[Card]
    counter_rows: list[Row]
    fragmentation_rows: list[Row]
    histogram_svg: str
    layout_png: str
    layout_note: str
    live_sites: list[SiteView]
    timeline_png: str | None = None
    timeline_notes: list[str] = field(default_factory=list)
    timeline_missing: str = ""
    peak_sites: list[SiteView] = field(default_factory=list)
    peak_note: str = ""
    oom: OomAnalysis | None = None
    oom_stack: list[dict[str, Any]] = field(default_factory=list)
    category_rows: list[Row] = field(default_factory=list)
    category_png: str | None = None
    leaks: dict[str, Any] = field(default_factory=dict)
    whatif: dict[str, Any] | None = None
    layout_title: str = "Block layout"
    histogram_title: str = "Free (cached) blocks by size."
    # where the OOM explanation, layout and sites come from, when not the dump
    oom_moment_note: str = ""
    oom_sites: list[SiteView] = field(default_factory=list)
    # the parallel training strategy the snapshot came from, when one was seen
    parallel: str = ""
    # plan tables for an OOM (render/plan.py)
    would_it_fit: list[dict[str, Any]] = field(default_factory=list)
    # memory by module at the peak (report._module_view)
    modules: dict[str, Any] | None = None
    # the explorer's timeline data (metrics/explore.py)
    exploration: Exploration | None = None
    # the explorer's segments (render/explorer.py)
    layout_data: list[dict[str, Any]] = field(default_factory=list)
    # what the peak (or, with no trace, the dump) was made of
    composition: Composition | None = None
    composition_svg: str = ""  # its chart, for the first screen (drawn with the section's figures)
    kv_cache_note: str = ""  # inference: the KV cache's growth per decode step


@dataclass
class ReportContext:
    file_name: str
    recorded: str
    headline: str
    findings: list[Finding]
    devices: list[DeviceSection]
    meta_rows: list[tuple[str, str]]
    settings_rows: list[tuple[str, str]]
    version: str
    first: FirstScreen | None = None  # the answer at the top (render/answer.py)
    # what `snaplab fit` concluded; leads "What to change" when set
    fit_answer: FitSummary | None = None
    source: SourceFile | None = None
    # escaped JSON (render/explorer.py); empty: no explorer
    explorer_json: str = ""
    css: str = ""
    script: str = ""
    csp: str = ""
    compare_svg: str = ""
    compare_rows: list[dict[str, Any]] = field(default_factory=list)
    # memory by record_function range (render/stages.py stages_view); empty: the section is left out
    stages: list[dict[str, Any]] = field(default_factory=list)
    # pinned host memory (render/host.py host_view); empty: the section is left out
    host: dict[str, Any] = field(default_factory=dict)
    # site label -> the annotations (_annotate_tensor) of its allocations
    # (metrics/attribution/annotations.py site_annotations); empty: the tables are as before
    site_annotations: dict[str, list[str]] = field(default_factory=dict)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("snapshot_lab", "render/templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["bytes"] = format_bytes
    env.filters["pct"] = format_percent
    env.filters["evidence_rows"] = evidence_rows
    return env


def _css() -> str:
    return (importlib.resources.files("snapshot_lab") / "render" / "assets" / "report.css").read_text("utf-8")


def render_report(ctx: ReportContext) -> str:
    """The report as one HTML string."""
    if not ctx.css:
        ctx.css = _css()
    if ctx.explorer_json and not ctx.script:
        ctx.script = explorer_script()
    ctx.csp = (
        content_security_policy(ctx.script)
        if ctx.script
        else "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
    )
    return _environment().get_template("report.html.j2").render(ctx=ctx)
