"""The report as GitHub-flavoured Markdown, to paste into a ticket (``snaplab report --format md``).

GitHub refuses a comment over 65,536 characters, so the text is built to a budget: the answer,
the key numbers and the levers always fit; the stacks of the top sites are shortened (fewer
frames, then fewer sites) until the whole does. Text from the snapshot is escaped: HTML as
entities, Markdown's punctuation with backslashes, stacks inside code fences longer than any run
of backticks they contain.
"""

from __future__ import annotations

import html
import re
from typing import Any

from ..units import format_bytes, format_percent
from .html import ReportContext, SiteView

LIMIT_CHARS = 65_536
BUDGET_CHARS = 60_000  # room under GitHub's limit for the reporter's own words
# anywhere; < > & become HTML entities
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]|~])")
# what makes a heading, list or quote of a line
_LINE_START = re.compile(r"^(\s*)([#+\-=>!])")
_ORDERED = re.compile(r"^(\s*\d+)\.")  # ... or an ordered list


def md(text: object) -> str:
    """Text from the file, inert in Markdown and HTML (one line, inside a line)."""
    escaped = html.escape(str(text), quote=False).replace("\n", " ").replace("\r", " ")
    return _MD_SPECIAL.sub(r"\\\1", escaped)


def md_line(text: object) -> str:
    """:func:`md` for text that starts a line: no heading, list or quote either."""
    return _ORDERED.sub(r"\1\\.", _LINE_START.sub(r"\1\\\2", md(text)))


def _fence(lines: list[str]) -> str:
    longest = max((len(ticks) for line in lines for ticks in re.findall(r"`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n" + "\n".join(lines) + f"\n{fence}"


def _stack_lines(view: SiteView, frames: int) -> list[str]:
    lines = [
        f"{frame['name']} — {frame['filename']}" + (f":{frame['line']}" if frame.get("line") else "")
        for frame in view.stack
    ]
    if len(lines) > frames:
        lines = [*lines[:frames], f"… {len(lines) - frames} more frames (the HTML report has them all)"]
    return lines


def _answer(ctx: ReportContext) -> list[str]:
    first = ctx.first
    src = ctx.source
    out = [f"## snaplab: {md(ctx.file_name)}", ""]
    if src is not None:
        out.append(
            f"<sub>snaplab {md(ctx.version)} · {md(src.name)}, {format_bytes(src.size_bytes)}"
            + (f", sha256 `{src.sha256_prefix}`" if src.sha256_prefix else "")
            + "</sub>"
        )
        out.append("")
    if first is None:
        return [*out, md_line(ctx.headline), ""]
    mark = {"critical": "🔴", "warning": "🟠", "ok": "🟢"}.get(first.status, "")
    out += [f"**{mark} {md(first.answer)}**", ""]
    if first.method:
        # GitHub folds a <details> element; a blank line after <summary> lets Markdown in
        out += ["<details>", "<summary>How snaplab fit found it, and what it assumes</summary>", ""]
        out += [line for sentence in first.method for line in (md_line(sentence), "")]
        out += ["</details>", ""]
    said = [first.verdict] if first.answered_by_fit else []
    if said or first.cause:
        out += [md_line(" ".join([*said, first.cause]).strip()), ""]
    out += [f"### What the memory was: {md(first.made_of_title)}", "", "| | |", "|---|---|"]
    out += [f"| {md(label)} | {md(value)} |" for label, value in first.made_of]
    out += [f"| | {md(line)} |" for line in first.others]
    out += ["", "### What to change", ""]
    if not first.shown_levers:
        out.append("Nothing to change: no finding calls for it.")
    for i, lever in enumerate(first.shown_levers, start=1):
        stake = f" (at stake: {lever.stake})" if lever.stake else ""
        out.append(f"{i}. **{md(lever.title)}**{stake}  ")
        out.append(f"   {md(lever.detail)}")
    return [*out, ""]


def _numbers(ctx: ReportContext) -> list[str]:
    out = [
        "### Key numbers",
        "",
        "| device | reserved | allocated | peak requested | fragmentation (stranded) | cached, releasable | OOM |",
        "|---|--:|--:|--:|--:|--:|---|",
    ]
    for section in ctx.devices:
        cards = {card.label: card.value for card in section.cards}
        oom = f"{section.oom.cause}, request of {format_bytes(section.oom.requested_bytes)}" if section.oom else "no"
        out.append(
            f"| {section.device} | {cards.get('reserved', '')} | {cards.get('allocated', '')} | "
            f"{cards.get('peak requested', 'no trace')} | {cards.get('fragmentation', '')} | "
            f"{_releasable(section)} | {oom} |"
        )
    return [*out, ""]


def _releasable(section: Any) -> str:
    for row in section.fragmentation_rows:
        if row.name == "cached, releasable":
            return str(row.values[0])
    return ""


def _sites(ctx: ReportContext, sites: int, frames: int) -> list[str]:
    out: list[str] = []
    for section in ctx.devices:
        views = section.oom_sites or section.peak_sites or section.live_sites
        if not views:
            continue
        where = (
            "live at the OOM" if section.oom_sites else "live at the peak" if section.peak_sites else "live at the dump"
        )
        dev = f" (device {section.device})" if len(ctx.devices) > 1 else ""
        out += [f"### Top allocation sites, {where}{dev}", ""]
        for view in views[:sites]:
            site = view.site
            summary = (
                f"<code>{html.escape(site.label)}</code> — {format_bytes(site.bytes)} ({format_percent(site.share)}), "
                f"{site.count:,} block{'s' if site.count != 1 else ''}"
            )
            texts = ctx.site_annotations.get(site.label)
            if texts:
                summary += " — annotated: " + ", ".join(f"<code>{md(text)}</code>" for text in texts)
            body = _fence(_stack_lines(view, frames)) if view.stack else "No stack was recorded for these blocks."
            out += ["<details>", f"<summary>{summary}</summary>", "", body, "", "</details>", ""]
    return out


def _findings(ctx: ReportContext) -> list[str]:
    if not ctx.findings:
        return []
    out = ["### Findings", ""]
    for finding in ctx.findings:
        dev = f" (device {finding.device})" if finding.device is not None and len(ctx.devices) > 1 else ""
        out.append(f"- **{finding.severity}** `{finding.id}`{dev}: {md(finding.title)}")
    return [*out, ""]


MD_STAGE_ROWS = 30  # ranges per device in the Markdown report (the HTML has more, --json all)


def _stages(ctx: ReportContext) -> list[str]:
    """Memory by stage (only when the file has record_function ranges)."""
    out = []
    for st in ctx.stages:
        dev = f" (device {st['device']})" if len(ctx.stages) > 1 else ""
        out += [
            f"### Memory by stage{dev}",
            "",
            "| stage | kind | peak | at start | at end | allocated | kept | flags |",
            "|---|---|--:|--:|--:|--:|--:|---|",
        ]
        for r in st["rows"][:MD_STAGE_ROWS]:
            out.append(
                f"| {'· ' * r['depth']}{md(r['name'])} | {r['kind']} | {format_bytes(r['peak'])} | "
                f"{format_bytes(r['start'])} | {format_bytes(r['end'])} | {format_bytes(r['allocated'])} | "
                f"{format_bytes(r['kept'])} | {md(r['flags'])} |"
            )
        more = len(st["rows"]) - MD_STAGE_ROWS + st["hidden"]
        out += ([f"\n{more} more ranges: `snaplab stats --stages --json` lists every one."] if more > 0 else []) + [""]
    return out


def _host(ctx: ReportContext) -> list[str]:
    """Pinned host memory beside device memory (only when the file records it)."""
    if not ctx.host:
        return []
    out = ["### Pinned host memory", "", "| memory | reserved | allocated |", "|---|--:|--:|"]
    out += [
        f"| {md(row['memory'])} | {format_bytes(row['reserved'])} | {format_bytes(row['allocated'])} |"
        for row in ctx.host["rows"]
    ]
    out += ["", "| | |", "|---|--:|"]
    out += [f"| {md(t['label'])} | {format_bytes(t['bytes'])} |" for t in ctx.host["totals"]]
    if ctx.host["peak"] is not None:
        out.append(f"| peak allocated in the host trace | {format_bytes(ctx.host['peak'])} |")
    if ctx.host["sites"]:
        out += ["", "| host allocation site | allocated | blocks |", "|---|--:|--:|"]
        out += [f"| {md(s['frame'])} | {format_bytes(s['bytes'])} | {s['blocks']:,} |" for s in ctx.host["sites"]]
    return [*out, ""]


def render_markdown(ctx: ReportContext, budget: int = BUDGET_CHARS) -> str:
    """The report as Markdown, always under GitHub's 65,536-character limit."""
    head = _answer(ctx) + _numbers(ctx) + _host(ctx) + _stages(ctx)
    tail = [
        *_findings(ctx),
        f"<sub>Made by snaplab {md(ctx.version)}; the HTML report has the timeline, layout and every stack.</sub>",
        "",
    ]
    for sites, frames in ((8, 16), (8, 8), (5, 6), (3, 4), (3, 0), (0, 0)):
        text = "\n".join(head + _sites(ctx, sites, frames) + tail)
        if len(text) <= budget:
            return text
    return text[: LIMIT_CHARS - 200] + "\n\n… (shortened to fit GitHub's limit)\n"
