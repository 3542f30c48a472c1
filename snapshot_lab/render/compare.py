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
from .html import _css, _environment
from .text import format_findings, table


def _fmt(name: str, v: float | None) -> str:
    if v is None:
        return "no trace" if name.startswith("peak_") else "unknown"
    if name == "external_fragmentation":
        return f"{v:.3f}"
    if name == "segments":
        return f"{int(v):,}"
    return format_bytes(v)


def _delta(name: str, c: Change) -> str:
    d = c.delta
    if d is None:
        return "not comparable"
    if name == "external_fragmentation":
        return f"{d:+.3f}"
    if name == "segments":
        return f"{int(d):+,}"
    return ("+" if d > 0 else "") + format_bytes(d)


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
            "name": MEASURE_NAMES.get(c.name, c.name),
            "before": _fmt(c.name, c.before),
            "after": _fmt(c.name, c.after),
            "delta": _delta(c.name, c),
        }
        for c in changes
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


def _diff_headline(d: SnapshotDiff) -> str:
    r = d.totals[0]
    text = f"Reserved {_fmt(r.name, r.before)} → {_fmt(r.name, r.after)} ({_delta(r.name, r)})"
    grown = [s for s in d.sites if s.delta_bytes > 0]
    if grown:
        text += f"; largest growth at {site_change_text(grown[0])}"
    return text + "."


SAME_WITHIN = 0.02  # a change of the peak smaller than this share reads as "no change"


def diff_verdict(d: SnapshotDiff) -> str:
    """One line: did the second run need more memory, less, or about the same, and why."""
    a, b = d.before, d.after
    if b.oom_cause and not a.oom_cause:
        return f"The second run ran out of memory ({b.oom_cause}); the first did not."
    if a.oom_cause and not b.oom_cause:
        return f"The second run no longer runs out of memory (the first did: {a.oom_cause})."
    before = a.peak_requested_bytes if a.peak_requested_bytes is not None else a.allocated
    after = b.peak_requested_bytes if b.peak_requested_bytes is not None else b.allocated
    what = (
        "peak requested" if a.peak_requested_bytes is not None and b.peak_requested_bytes is not None else "allocated"
    )
    if not before or abs(after - before) < SAME_WITHIN * before:
        return f"About the same: {what} {format_bytes(before)} → {format_bytes(after)}."
    more = after > before
    text = (
        f"The second run needs {'more' if more else 'less'} memory: {what} {format_bytes(before)} → "
        f"{format_bytes(after)} ({'+' if more else ''}{format_percent((after - before) / before)})"
    )
    moved = [c for c in d.sites if (c.delta_bytes > 0) == more and c.delta_bytes]
    if moved:
        text += f", most at {site_change_text(moved[0])}"
    return text + "."


UNLIKE_PARAMETERS = 1.5  # parameters this many times larger in one file: another model


def diff_warnings(d: SnapshotDiff) -> list[str]:
    """Signs that the two files are not two runs of one job: then the diff compares unlike things."""
    a, b = d.before, d.after
    out = []
    if a.devices != b.devices:
        out.append(
            f"The files hold different devices ({', '.join(map(str, a.devices)) or 'none'} and "
            f"{', '.join(map(str, b.devices)) or 'none'})."
        )
    sites_a, sites_b = {s["site"] for s in a.sites}, {s["site"] for s in b.sites}
    if sites_a and sites_b and not sites_a & sites_b:
        out.append("No allocation site is common to both files: they look like different programs.")
    params_a, params_b = a.categories.get("parameter", 0), b.categories.get("parameter", 0)
    if params_a and params_b and max(params_a, params_b) > UNLIKE_PARAMETERS * min(params_a, params_b):
        out.append(
            f"The parameters differ ({format_bytes(params_a)} and {format_bytes(params_b)}): "
            "two different models, or one model of two sizes."
        )
    if out:
        out.append("Compare two snapshots of the same job (before and after a change) for a meaningful diff.")
    return out


def render_diff_html(d: SnapshotDiff, version: str) -> str:
    ctx: dict[str, Any] = {
        "css": _css(),
        "version": version,
        "before_name": _name(d.before.path),
        "after_name": _name(d.after.path),
        "verdict": diff_verdict(d),
        "warnings": diff_warnings(d),
        "headline": _diff_headline(d),
        "totals": _rows(d.totals),
        "categories": _rows([c for c in d.categories if c.before or c.after]),
        "sites": [{**s.__dict__, "delta": _signed(s.delta_bytes)} for s in d.sites],
        "timeline_png": _timeline_png(d),
        "findings_new": d.findings_new,
        "findings_gone": d.findings_gone,
        "modules": [
            {**m.__dict__, "delta": ("+" if m.delta_bytes > 0 else "") + format_bytes(m.delta_bytes)}
            for m in d.modules
            if m.delta_bytes
        ][:25],
        "modules_note": _modules_note(d),
    }
    return _environment().get_template("diff.html.j2").render(ctx=ctx)


def _timeline_png(d: SnapshotDiff) -> str | None:
    """Both files' memory over their traces in one chart (None when either has no trace)."""
    if not d.before.timelines or not d.after.timelines:
        return None
    names = (f"before: {_name(d.before.path)}", f"after: {_name(d.after.path)}")
    return figure_png_data_uri(plot_diff_timelines(d.before.timelines, d.after.timelines, names))


def _modules_note(d: SnapshotDiff) -> str:
    if d.modules_source == "tags":
        return "Requested bytes alive at each file's peak, by the module that allocated them (module tags)."
    if d.modules_source == "stacks":
        return (
            "Requested bytes alive at each file's peak, by the innermost forward frame of their stacks: an "
            "approximation (record with snaplab run or recording() to tag allocations with module names)."
        )
    return ""


def format_diff(d: SnapshotDiff) -> str:
    warnings = "".join(f"WARNING: {w}\n" for w in diff_warnings(d))
    head = f"{d.before.path} -> {d.after.path}\n{warnings}{diff_verdict(d)}\n{_diff_headline(d)}\n"
    totals = table(["measure", "before", "after", "change"], [list(r.values()) for r in _rows(d.totals)])
    cats = table(
        ["category", "before", "after", "change"],
        [list(r.values()) for r in _rows([c for c in d.categories if c.before or c.after])],
    )
    sites = table(
        ["site", "status", "before", "after", "change"],
        [
            [
                site_text(s),
                s.status,
                format_bytes(s.before_bytes),
                format_bytes(s.after_bytes),
                _signed(s.delta_bytes),
            ]
            for s in d.sites[:20]
        ],
    )
    mods = [m for m in d.modules if m.delta_bytes][:15]
    if mods:
        sites += (
            "\n\n"
            + _modules_note(d)
            + "\n"
            + table(
                ["module at the peak", "before", "after", "change"],
                [
                    [
                        m.site,
                        format_bytes(m.before_bytes),
                        format_bytes(m.after_bytes),
                        ("+" if m.delta_bytes > 0 else "") + format_bytes(m.delta_bytes),
                    ]
                    for m in mods
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


def _who(r: RankRow) -> str:
    return f"rank {r.label}" if r.labelled_by == "rank" else r.label


def _noun(rows: list[RankRow]) -> str:
    """'ranks' when every row is a rank of its own, 'files' when some numbers are shared or missing."""
    return "ranks" if all(r.labelled_by == "rank" for r in rows) else "files"


def _number_runs(numbers: list[int], most: int = 6) -> str:
    """0–7, 12, 14–15 (sorted, distinct numbers; the first ``most`` runs, then …)."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    text = ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs[:most])
    return text + (", …" if len(runs) > most else "")


def rank_notice(rows: list[RankRow]) -> str | None:
    """One line saying that rank numbers were shared or missing and how those rows are labelled
    (None when every file has a rank number of its own)."""
    counts = Counter(r.rank for r in rows if r.rank is not None)
    shared = sorted(k for k, n in counts.items() if n > 1)
    missing = sum(r.rank is None for r in rows)
    if not shared and not missing:
        return None
    what = []
    if len(shared) == 1:
        what.append(f"rank {shared[0]} is in {counts[shared[0]]} files")
    elif shared:
        what.append(f"ranks {_number_runs(shared)} are each in several files ({sum(counts[k] for k in shared)} files)")
    if missing == 1:
        what.append("1 file has no rank number in its name")
    elif missing:
        what.append(f"{missing} files have no rank number in their names")

    def example(r: RankRow) -> str:  # a file name may hold a newline: the notice stays one line
        return "".join(c if c.isprintable() else "?" for c in r.label)

    how = []
    by_host = [r for r in rows if r.labelled_by == "host"]
    by_file = [r for r in rows if r.labelled_by == "file"]
    if by_host:
        how.append(f"host/rank (e.g. {example(by_host[0])})")
    if by_file:
        how.append(f"{'by ' if not by_host else ''}file name (e.g. {example(by_file[0])})")
    compared = (
        "each compared within its pipeline stage"
        if any(r.group for r in rows)
        else f"all {len(rows)} files are compared together"
    )
    return f"{' and '.join(what)}: those rows are labelled {' or '.join(how)}; {compared}"


def _rank_headline(rows: list[RankRow]) -> str:
    flagged = [r for r in rows if r.flags]
    if not flagged:
        return f"{len(rows)} {_noun(rows)}, none stands out."
    return (
        f"{len(rows)} {_noun(rows)}; {len(flagged)} {'stands' if len(flagged) == 1 else 'stand'} out: "
        + "; ".join(f"{_who(r)}: {r.flags[0]}" for r in flagged[:5])
        + ("" if len(flagged) <= 5 else "; …")
    )


def layout_text(lay: ParallelLayout | None) -> str:
    """'pp 1 · tp 0' (the coordinates along the degrees above 1, or all of them when the
    degrees are unknown); '' without a layout."""
    if lay is None:
        return ""
    if lay.source == "stacks":  # only the pipeline stage, inferred: the last computes the loss
        return "pp last (inferred)" if lay.pp_stage == 1 else "pp earlier (inferred)"
    shown = [k for k in KINDS if k in lay.coordinates and lay.degrees.get(k, 2) > 1]
    return " · ".join(f"{k} {lay.coordinates[k]}" for k in shown)


def _mb(n: int | None) -> str:
    return "" if n is None else f"{n} microbatch{'es' if n != 1 else ''}"


def _schedule_rule(skew: PipelineSkew) -> str:
    name = (skew.schedule or "").lower()
    if name == "1f1b":
        return "1F1B keeps up to S-s microbatches in flight on stage s"
    if name == "gpipe":
        return "GPipe keeps every microbatch in flight on every stage"
    return ""


def pipeline_view(skew: PipelineSkew, rows: list[RankRow]) -> dict[str, Any]:
    """The pipeline's stages as display strings (shared by the terminal and the HTML page)."""
    label = {r.summary.path: _who(r) for r in rows}
    how = [x for x in (skew.schedule, f"{skew.microbatches} microbatches" if skew.microbatches else None) if x]
    stages = [
        {
            "stage": str(s.stage),
            "ranks": ", ".join(label.get(p, _name(p)) for p in s.files),
            "peak": format_bytes(s.peak_requested_bytes),
            "inflight": format_bytes(s.inflight_activation_bytes),
            "in_flight_mb": _mb(s.microbatches_in_flight),
        }
        for s in skew.stages
    ]
    h, lo = skew.heaviest, skew.lightest
    parts = []
    if skew.inflight_difference_bytes:
        d = skew.inflight_difference_bytes
        parts.append(f"in-flight activations {'+' if d > 0 else '-'}{format_bytes(abs(d))}")
    for c, d in skew.by_category.items():
        if c != "inflight_activation" and abs(d) >= skew.spread_bytes * 0.05:
            parts.append(f"{c.replace('_', ' ')} {'+' if d > 0 else '-'}{format_bytes(abs(d))}")
    sites = "; ".join(f"{d.site} +{format_bytes(d.delta_bytes)}" for d in skew.by_site[:2])
    rule = _schedule_rule(skew)
    skew_text = (
        f"Pipeline skew across {len(skew.stages)} stages"
        + (f" ({', '.join(how)})" if how else " (schedule unknown)")
        + ", not outliers: each rank is compared with the ranks of its own stage, the stages with each other. "
        + (
            f"Stage {h.stage} peaks {format_bytes(skew.spread_bytes)} ({format_percent(skew.spread_ratio, 0)}) "
            f"above stage {lo.stage}"
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
        "with_layout": any(r.layout is not None for r in rows),
        "pipeline": pipeline_view(pipeline, rows) if pipeline is not None else None,
        "findings": findings or [],
        "rows": [
            {
                "label": r.label,
                "labelled_by": r.labelled_by,
                "host": r.host,
                "layout": layout_text(r.layout),
                "group": r.group or "",
                "name": _name(r.summary.path),
                "peak": r.summary.peak_requested_bytes,
                "reserved": r.summary.reserved,
                "allocated": r.summary.allocated,
                "frag": r.summary.external_fragmentation,
                "stranded": r.summary.stranded_bytes,
                "oom": r.summary.oom_cause,
                "flags": r.flags,
            }
            for r in rows
        ],
        "errors": errors,
    }
    return _environment().get_template("ranks.html.j2").render(ctx=ctx)


def format_ranks(
    rows: list[RankRow], pipeline: PipelineSkew | None = None, findings: list[Finding] | None = None
) -> str:
    """The table of ``ranks``; with a pipeline, its stages and the findings across the files below."""
    with_layout = any(r.layout is not None for r in rows)
    body = table(
        ["rank", *(["layout"] if with_layout else []), "peak requested", "reserved", "allocated", "stranded", "flags"],
        [
            [
                r.label,
                *([layout_text(r.layout)] if with_layout else []),
                _peak_text(r.summary.peak_requested_bytes),
                format_bytes(r.summary.reserved),
                format_bytes(r.summary.allocated),
                format_bytes(r.summary.stranded_bytes),
                "; ".join(r.flags),
            ]
            for r in rows
        ],
    )
    out = f"{_rank_headline(rows)}\n\n{body}\n"
    if pipeline is not None:
        view = pipeline_view(pipeline, rows)
        stages = table(
            ["stage", "ranks", "peak requested", "in flight at peak", "schedule keeps in flight"],
            [[s["stage"], s["ranks"], s["peak"], s["inflight"], s["in_flight_mb"]] for s in view["stages"]],
        )
        out += f"\n{view['text']}\n\n{stages}\n"
    if findings:
        out += "\n" + format_findings(findings)
    return out
