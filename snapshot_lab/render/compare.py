"""HTML and text for ``diff`` and ``ranks``: the report's conventions (inline CSS, escaped)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..metrics.comparison.compare import Change, RankRow, SiteChange, SnapshotDiff
from ..metrics.findings import Finding
from ..metrics.parallel.parallelism import KINDS, ParallelLayout
from ..metrics.parallel.pipeline import PipelineSkew
from ..plots.common import figure_png_data_uri
from ..plots.compare import plot_diff_timelines
from ..units import format_bytes, format_percent
from .explorer import Payload, content_security_policy, explorer_script
from .html import _css, _environment
from .text import format_findings, table


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "no trace" if name.startswith("peak_") else "unknown"
    if name == "external_fragmentation":
        return f"{value:.3f}"
    if name == "segments":
        return f"{int(value):,}"
    return format_bytes(value)


def _delta(name: str, change: Change) -> str:
    delta = change.delta
    if delta is None:
        return "not comparable"
    if name == "external_fragmentation":
        return f"{delta:+.3f}"
    if name == "segments":
        return f"{int(delta):+,}"
    return ("+" if delta > 0 else "") + format_bytes(delta)


# the totals' names as the other pages say them (docs/glossary.md); --json keeps the keys
MEASURE_NAMES = {
    "reserved_bytes": "reserved",
    "allocated_bytes": "allocated",
    "requested_bytes": "requested",
    "free_in_reserved_bytes": "free in reserved",
    "stranded_bytes": "stranded (holes in live segments)",
    "external_fragmentation": "external fragmentation",
    "peak_requested_bytes": "peak requested (trace)",
    "peak_reserved_bytes": "peak reserved (trace)",
    "segments": "segments",
}


def _rows(changes: list[Change]) -> list[dict[str, str]]:
    return [
        {
            "name": MEASURE_NAMES.get(change.name, change.name),
            "before": _fmt(change.name, change.before),
            "after": _fmt(change.name, change.after),
            "delta": _delta(change.name, change),
        }
        for change in changes
    ]


def _name(path: str) -> str:
    return path.replace("\\", "/").split("/")[-1]


def site_change_text(s: SiteChange) -> str:
    """'model.py:12 in forward (+6.80 GiB over 15 call paths)': a site and its change, all paths summed."""
    over = f" over {s.paths} call paths" if s.paths > 1 else ""
    return f"{s.site} ({_signed(s.delta_bytes)}{over})"


def site_text(s: SiteChange) -> str:
    """A site's label, with how many call paths reach it when several do (their bytes summed)."""
    return f"{s.site} ({s.paths} call paths)" if s.paths > 1 else s.site


def _signed(nbytes: int) -> str:
    return ("+" if nbytes > 0 else "") + format_bytes(nbytes)


def _diff_headline(diff: SnapshotDiff) -> str:
    total = diff.totals[0]
    text = f"Reserved {_fmt(total.name, total.before)} → {_fmt(total.name, total.after)} ({_delta(total.name, total)})"
    grown = [site for site in diff.sites if site.delta_bytes > 0]
    if grown:
        text += f"; largest growth at {site_change_text(grown[0])}"
    return text + "."


# a change of the peak smaller than this share reads as "no change"
SAME_WITHIN = 0.02


def diff_verdict(d: SnapshotDiff) -> str:
    """One line: did the second run need more memory, less, or about the same, and why."""
    first, second = d.before, d.after
    if second.oom_cause and not first.oom_cause:
        return f"The second run ran out of memory ({second.oom_cause}); the first did not."
    if first.oom_cause and not second.oom_cause:
        return f"The second run no longer runs out of memory (the first did: {first.oom_cause})."
    before = first.peak_requested_bytes if first.peak_requested_bytes is not None else first.allocated
    after = second.peak_requested_bytes if second.peak_requested_bytes is not None else second.allocated
    what = (
        "peak requested"
        if first.peak_requested_bytes is not None and second.peak_requested_bytes is not None
        else "allocated"
    )
    if not before or abs(after - before) < SAME_WITHIN * before:
        return f"About the same: {what} {format_bytes(before)} → {format_bytes(after)}."
    more = after > before
    text = (
        f"The second run needs {'more' if more else 'less'} memory: {what} {format_bytes(before)} → "
        f"{format_bytes(after)} ({'+' if more else ''}{format_percent((after - before) / before)})"
    )
    moved = [site for site in d.sites if (site.delta_bytes > 0) == more and site.delta_bytes]
    if moved:
        text += f", most at {site_change_text(moved[0])}"
    return text + "."


# parameters this many times larger in one file: another model
UNLIKE_PARAMETERS = 1.5


def diff_warnings(d: SnapshotDiff) -> list[str]:
    """Signs that the two files are not two runs of one job: then the diff compares unlike things."""
    first, second = d.before, d.after
    out = []
    if first.devices != second.devices:
        out.append(
            f"The files hold different devices ({', '.join(map(str, first.devices)) or 'none'} and "
            f"{', '.join(map(str, second.devices)) or 'none'})."
        )
    sites_a, sites_b = {site["site"] for site in first.sites}, {site["site"] for site in second.sites}
    if sites_a and sites_b and not sites_a & sites_b:
        out.append("No allocation site is common to both files: they look like different programs.")
    params_a, params_b = first.categories.get("parameter", 0), second.categories.get("parameter", 0)
    if params_a and params_b and max(params_a, params_b) > UNLIKE_PARAMETERS * min(params_a, params_b):
        out.append(
            f"The parameters differ ({format_bytes(params_a)} and {format_bytes(params_b)}): "
            "two different models, or one model of two sizes."
        )
    if out:
        out.append("Compare two snapshots of the same job (before and after a change) for a meaningful diff.")
    return out


NO_SCRIPT_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def render_diff_html(d: SnapshotDiff, version: str, explorers: Payload | None = None) -> str:
    """The diff page; with ``explorers`` (:func:`~.explorer.diff_payload`), the two traces'
    explorers side by side, linked, and the script that draws them (the CSP allows it alone)."""
    script = explorer_script() if explorers is not None and explorers.devices else ""
    ctx: dict[str, Any] = {
        "css": _css(),
        "script": script,
        "csp": content_security_policy(script) if script else NO_SCRIPT_CSP,
        "explorer_json": explorers.to_json() if script and explorers is not None else "",
        "version": version,
        "before_name": _name(d.before.path),
        "after_name": _name(d.after.path),
        "verdict": diff_verdict(d),
        "warnings": diff_warnings(d),
        "headline": _diff_headline(d),
        "totals": _rows(d.totals),
        "categories": _rows([change for change in d.categories if change.before or change.after]),
        "sites": [{**site.__dict__, "delta": _signed(site.delta_bytes)} for site in d.sites],
        "timeline_png": _timeline_png(d),
        "findings_new": d.findings_new,
        "findings_gone": d.findings_gone,
        "modules": [
            {**module.__dict__, "delta": ("+" if module.delta_bytes > 0 else "") + format_bytes(module.delta_bytes)}
            for module in d.modules
            if module.delta_bytes
        ][:25],
        "modules_note": _modules_note(d),
    }
    return _environment().get_template("diff.html.j2").render(ctx=ctx)


def _timeline_png(diff: SnapshotDiff) -> str | None:
    """Both files' memory over their traces in one chart (None when either has no trace)."""
    if not diff.before.timelines or not diff.after.timelines:
        return None
    names = (f"before: {_name(diff.before.path)}", f"after: {_name(diff.after.path)}")
    return figure_png_data_uri(plot_diff_timelines(diff.before.timelines, diff.after.timelines, names))


def _modules_note(diff: SnapshotDiff) -> str:
    if diff.modules_source == "tags":
        return "Requested bytes alive at each file's peak, by the module that allocated them (module tags)."
    if diff.modules_source == "stacks":
        return (
            "Requested bytes alive at each file's peak, by the innermost forward frame of their stacks: an "
            "approximation (record with snaplab run or recording() to tag allocations with module names)."
        )
    return ""


def format_diff(d: SnapshotDiff) -> str:
    warnings = "".join(f"WARNING: {warning}\n" for warning in diff_warnings(d))
    head = f"{d.before.path} -> {d.after.path}\n{warnings}{diff_verdict(d)}\n{_diff_headline(d)}\n"
    totals = table(["measure", "before", "after", "change"], [list(row.values()) for row in _rows(d.totals)])
    cats = table(
        ["category", "before", "after", "change"],
        [list(row.values()) for row in _rows([change for change in d.categories if change.before or change.after])],
    )
    sites = table(
        ["site", "status", "before", "after", "change"],
        [
            [
                site_text(site),
                site.status,
                format_bytes(site.before_bytes),
                format_bytes(site.after_bytes),
                _signed(site.delta_bytes),
            ]
            for site in d.sites[:20]
        ],
    )
    mods = [module for module in d.modules if module.delta_bytes][:15]
    if mods:
        sites += (
            "\n\n"
            + _modules_note(d)
            + "\n"
            + table(
                ["module at the peak", "before", "after", "change"],
                [
                    [
                        module.site,
                        format_bytes(module.before_bytes),
                        format_bytes(module.after_bytes),
                        ("+" if module.delta_bytes > 0 else "") + format_bytes(module.delta_bytes),
                    ]
                    for module in mods
                ],
            )
        )
    extra = ""
    if d.findings_new or d.findings_gone:
        extra = f"\nfindings new: {', '.join(d.findings_new) or 'none'}; gone: {', '.join(d.findings_gone) or 'none'}\n"
    return f"{head}\n{totals}\n\n{cats}\n\n{sites}\n{extra}"


def _peak_text(nbytes: int | None) -> str:
    """A peak from the trace, or why there is none."""
    return "no trace" if nbytes is None else format_bytes(nbytes)


def _who(row: RankRow) -> str:
    return f"rank {row.label}" if row.labelled_by == "rank" else row.label


def _noun(rows: list[RankRow]) -> str:
    """'ranks' when every row is a rank of its own, 'files' when some numbers are shared or missing."""
    return "ranks" if all(row.labelled_by == "rank" for row in rows) else "files"


def _number_runs(numbers: list[int], most: int = 6) -> str:
    """0–7, 12, 14–15 (sorted, distinct numbers; the first ``most`` runs, then …)."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    text = ", ".join(str(low) if low == high else f"{low}–{high}" for low, high in runs[:most])
    return text + (", …" if len(runs) > most else "")


def rank_notice(rows: list[RankRow]) -> str | None:
    """One line saying that rank numbers were shared or missing and how those rows are labelled
    (None when every file has a rank number of its own)."""
    counts = Counter(rank_row.rank for rank_row in rows if rank_row.rank is not None)
    shared = sorted(rank for rank, files in counts.items() if files > 1)
    missing = sum(rank_row.rank is None for rank_row in rows)
    if not shared and not missing:
        return None
    what = []
    if len(shared) == 1:
        what.append(f"rank {shared[0]} is in {counts[shared[0]]} files")
    elif shared:
        what.append(
            f"ranks {_number_runs(shared)} are each in several files ({sum(counts[rank] for rank in shared)} files)"
        )
    if missing == 1:
        what.append("1 file has no rank number in its name")
    elif missing:
        what.append(f"{missing} files have no rank number in their names")

    # a file name may hold a newline: the notice stays one line
    def example(row: RankRow) -> str:
        return "".join(char if char.isprintable() else "?" for char in row.label)

    how = []
    by_host = [rank_row for rank_row in rows if rank_row.labelled_by == "host"]
    by_file = [rank_row for rank_row in rows if rank_row.labelled_by == "file"]
    if by_host:
        how.append(f"host/rank (e.g. {example(by_host[0])})")
    if by_file:
        how.append(f"{'by ' if not by_host else ''}file name (e.g. {example(by_file[0])})")
    compared = (
        "each compared within its pipeline stage"
        if any(rank_row.group for rank_row in rows)
        else f"all {len(rows)} files are compared together"
    )
    return f"{' and '.join(what)}: those rows are labelled {' or '.join(how)}; {compared}"


def _rank_headline(rows: list[RankRow]) -> str:
    flagged = [row for row in rows if row.flags]
    if not flagged:
        return f"{len(rows)} {_noun(rows)}, none stands out."
    return (
        f"{len(rows)} {_noun(rows)}; {len(flagged)} {'stands' if len(flagged) == 1 else 'stand'} out: "
        + "; ".join(f"{_who(row)}: {row.flags[0]}" for row in flagged[:5])
        + ("" if len(flagged) <= 5 else "; …")
    )


def layout_text(lay: ParallelLayout | None) -> str:
    """'pp 1 · tp 0' (the coordinates along the degrees above 1, or all of them when the
    degrees are unknown); '' without a layout."""
    if lay is None:
        return ""
    # only the pipeline stage, inferred: the last computes the loss
    if lay.source == "stacks":
        return "pp last (inferred)" if lay.pp_stage == 1 else "pp earlier (inferred)"
    shown = [kind for kind in KINDS if kind in lay.coordinates and lay.degrees.get(kind, 2) > 1]
    return " · ".join(f"{kind} {lay.coordinates[kind]}" for kind in shown)


def _mb(count: int | None) -> str:
    return "" if count is None else f"{count} microbatch{'es' if count != 1 else ''}"


def _schedule_rule(skew: PipelineSkew) -> str:
    name = (skew.schedule or "").lower()
    if name == "1f1b":
        return "1F1B keeps up to S-s microbatches in flight on stage s"
    if name == "gpipe":
        return "GPipe keeps every microbatch in flight on every stage"
    return ""


def pipeline_view(skew: PipelineSkew, rows: list[RankRow]) -> dict[str, Any]:
    """The pipeline's stages as display strings (shared by the terminal and the HTML page)."""
    label = {row.summary.path: _who(row) for row in rows}
    how = [item for item in (skew.schedule, f"{skew.microbatches} microbatches" if skew.microbatches else None) if item]
    stages = [
        {
            "stage": str(stage.stage),
            "ranks": ", ".join(label.get(path, _name(path)) for path in stage.files),
            "peak": format_bytes(stage.peak_requested_bytes),
            "inflight": format_bytes(stage.inflight_activation_bytes),
            "in_flight_mb": _mb(stage.microbatches_in_flight),
        }
        for stage in skew.stages
    ]
    heaviest, lightest = skew.heaviest, skew.lightest
    parts = []
    if skew.inflight_difference_bytes:
        delta = skew.inflight_difference_bytes
        parts.append(f"in-flight activations {'+' if delta > 0 else '-'}{format_bytes(abs(delta))}")
    for category, delta in skew.by_category.items():
        if category != "inflight_activation" and abs(delta) >= skew.spread_bytes * 0.05:
            parts.append(f"{category.replace('_', ' ')} {'+' if delta > 0 else '-'}{format_bytes(abs(delta))}")
    sites = "; ".join(f"{delta.site} +{format_bytes(delta.delta_bytes)}" for delta in skew.by_site[:2])
    rule = _schedule_rule(skew)
    skew_text = (
        f"Pipeline skew across {len(skew.stages)} stages"
        + (f" ({', '.join(how)})" if how else " (schedule unknown)")
        + ", not outliers: each rank is compared with the ranks of its own stage, the stages with each other. "
        + (
            f"Stage {heaviest.stage} peaks {format_bytes(skew.spread_bytes)} ({format_percent(skew.spread_ratio, 0)}) "
            f"above stage {lightest.stage}"
            + (f": {', '.join(parts)} at the peak" if parts else "")
            + (f" (largest: {sites})" if sites else "")
            + "."
            if skew.spread_bytes
            else "The stages peak alike."
        )
        + (f" {rule}." if rule else "")
    )
    return {"stages": stages, "text": skew_text}


def render_ranks_html(
    rows: list[RankRow],
    errors: dict[str, str],
    chart_png: str,
    version: str,
    pipeline: PipelineSkew | None = None,
    findings: list[Finding] | None = None,
) -> str:
    ctx: dict[str, Any] = {
        "css": _css(),
        "version": version,
        "noun": _noun(rows),
        "headline": _rank_headline(rows),
        "notice": rank_notice(rows),
        "chart_png": chart_png,
        "with_layout": any(row.layout is not None for row in rows),
        "pipeline": pipeline_view(pipeline, rows) if pipeline is not None else None,
        "findings": findings or [],
        "rows": [
            {
                "label": row.label,
                "labelled_by": row.labelled_by,
                "host": row.host,
                "layout": layout_text(row.layout),
                "group": row.group or "",
                "name": _name(row.summary.path),
                "peak": row.summary.peak_requested_bytes,
                "reserved": row.summary.reserved,
                "allocated": row.summary.allocated,
                "frag": row.summary.external_fragmentation,
                "stranded": row.summary.stranded_bytes,
                "oom": row.summary.oom_cause,
                "flags": row.flags,
            }
            for row in rows
        ],
        "errors": errors,
    }
    return _environment().get_template("ranks.html.j2").render(ctx=ctx)


def format_ranks(
    rows: list[RankRow], pipeline: PipelineSkew | None = None, findings: list[Finding] | None = None
) -> str:
    """The table of ``ranks``; with a pipeline, its stages and the findings across the files below."""
    with_layout = any(row.layout is not None for row in rows)
    body = table(
        ["rank", *(["layout"] if with_layout else []), "peak requested", "reserved", "allocated", "stranded", "flags"],
        [
            [
                row.label,
                *([layout_text(row.layout)] if with_layout else []),
                _peak_text(row.summary.peak_requested_bytes),
                format_bytes(row.summary.reserved),
                format_bytes(row.summary.allocated),
                format_bytes(row.summary.stranded_bytes),
                "; ".join(row.flags),
            ]
            for row in rows
        ],
    )
    out = f"{_rank_headline(rows)}\n\n{body}\n"
    if pipeline is not None:
        view = pipeline_view(pipeline, rows)
        stages = table(
            ["stage", "ranks", "peak requested", "in flight at peak", "schedule keeps in flight"],
            [
                [stage["stage"], stage["ranks"], stage["peak"], stage["inflight"], stage["in_flight_mb"]]
                for stage in view["stages"]
            ],
        )
        out += f"\n{view['text']}\n\n{stages}\n"
    if findings:
        out += "\n" + format_findings(findings)
    return out
