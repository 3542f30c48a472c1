"""The report's first screen: what happened, what the peak was made of, what to change.

Everything here is display text built from finished metrics; the ranking of the levers is the
only decision taken: ``snaplab fit``'s answer first when there is one, then the findings by
severity and by the memory at stake, then the parallel layouts that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..metrics.attribution.composition import Composition, Part
from ..metrics.findings import Finding
from ..metrics.findings.base import SEVERITY_ORDER
from ..metrics.findings.recovered_oom import FINDING_ID as RECOVERED_ID
from ..metrics.stats.oom import OomAnalysis
from ..units import format_bytes, format_percent


@dataclass(frozen=True)
class FitSummary:
    """What ``snaplab fit`` concluded for this snapshot (filled by that command when it ran)."""

    # one sentence, e.g. "Fits on one 80 GiB GPU with activation checkpointing"
    verdict: str
    steps: tuple[str, ...] = ()  # the changes it takes, in order
    saved_bytes: int | None = None
    # listed after the findings' advice: fit could not size the step, or the request that failed
    # is not the step's (verdict and steps say which)
    last: bool = False
    # what fits, in one sentence of at most 45 words (render/fit.py answer_sentence): the first
    # screen leads with it, verdict and steps folded under it ("": the verdict is the answer)
    answer: str = ""


@dataclass(frozen=True)
class Lever:
    title: str  # what to change, with its number
    detail: str  # how, and why
    stake: str = ""  # the memory it frees or makes usable, formatted
    source: str = ""  # where the advice comes from (finding id, "plan", "fit"; "fit-aside": fit's, listed last)


@dataclass(frozen=True)
class SourceFile:
    name: str
    size_bytes: int
    # first 12 hex digits; "" when the file could not be read again
    sha256_prefix: str
    version: str


@dataclass
class FirstScreen:
    status: str  # "critical", "warning" or "ok": the colour of the answer
    verdict: str  # what happened, one sentence
    cause: str  # why, one or two sentences ("" when nothing went wrong)
    # (by what, the line): category, module, top site
    made_of: list[tuple[str, str]]
    made_of_title: str
    levers: list[Lever]
    chart_svg: str
    # one line per further device
    others: list[str] = field(default_factory=list)
    fit_answer: FitSummary | None = None
    # the one bold sentence the screen leads with (fit's answer, else the verdict), and what
    # folds under it: how it was found, what it assumes
    answer: str = ""
    method: tuple[str, ...] = ()

    @property
    def answered_by_fit(self) -> bool:
        """Whether fit's answer leads (its lever is then not listed again under the levers)."""
        return self.fit_answer is not None and bool(self.fit_answer.answer) and not self.fit_answer.last

    @property
    def shown_levers(self) -> list[Lever]:
        """The levers listed under "What to change": fit's is the answer where it leads."""
        return [lever for lever in self.levers if not (self.answered_by_fit and lever.source == "fit")]


def _parts(parts: tuple[Part, ...], limit: int = 4) -> str:
    shown = ", ".join(
        f"{part.label} {format_bytes(part.bytes)} ({format_percent(part.share)})" for part in parts[:limit]
    )
    rest = parts[limit:]
    if rest:
        shown += f", {len(rest)} more {format_bytes(sum(part.bytes for part in rest))}"
    return shown


def _count(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def made_of(comp: Composition) -> list[tuple[str, str]]:
    """One line each: by category, by module (when known), the top allocation site."""
    lines = [("by category", _parts(comp.by_category) or "nothing allocated")]
    if comp.by_module:
        approx = "" if comp.module_source == "tags" else " (approximate, from forward frames)"
        lines.append((f"by module{approx}", _parts(comp.by_module)))
    site = comp.top_site
    if site is not None:
        share = site.bytes / comp.total_bytes if comp.total_bytes else 0.0
        lines.append(
            (
                "top allocation site",
                f"{site.label}"
                + (f" → {site.detail}" if site.detail else "")
                + f": {format_bytes(site.bytes)} ({format_percent(share)}) in {_count(site.count, 'block')}",
            )
        )
    return lines


def oom_cause(o: OomAnalysis, finding: Finding | None = None) -> str:
    """The OOM in plain words: fragmentation or capacity, with the numbers that decide it;
    ``finding``: the device's OOM finding, which says capacity where the replay under the cap
    found no setting that serves the request, or where the whole iteration holds more than the
    limit (its ``whole_step_peak_allocated_bytes``), however the free memory was split."""
    if o.cause == "fragmentation" and finding is not None and finding.id == "oom-capacity":
        whole = finding.evidence.get("whole_step_peak_allocated_bytes")
        limit = finding.evidence.get("memory_limit_bytes")
        if isinstance(whole, int) and isinstance(limit, int):  # present only where it decided capacity
            return (
                f"Capacity: {format_bytes(o.free_in_reserved_bytes)} was free in reserved memory, in holes no "
                f"larger than {format_bytes(o.largest_free_block_bytes)}, but one whole iteration at this batch "
                f"holds about {format_bytes(whole)} at once, more than the {format_bytes(limit)} limit."
            )
        return (
            f"Capacity: {format_bytes(o.free_in_reserved_bytes)} was free in reserved memory, in holes no larger "
            f"than {format_bytes(o.largest_free_block_bytes)}, but no allocator setting the replay tried would "
            "have served the request: the job needs more memory than it had."
        )
    if o.cause == "fragmentation":
        return (
            f"Fragmentation: {format_bytes(o.free_in_reserved_bytes)} was free in reserved memory, but the "
            f"largest free hole was {format_bytes(o.largest_free_block_bytes)}, smaller than the request."
        )
    return (
        f"Capacity: {format_bytes(o.reserved_bytes)} was reserved ({format_bytes(o.allocated_bytes)} allocated) and "
        f"all cached free memory together ({format_bytes(o.free_in_reserved_bytes)}) was less than the request."
    )


OOM_CAUSES = ("oom-fragmentation", "oom-capacity")  # the findings that explain the OOM that ended the job


def verdict(
    ooms: dict[int, OomAnalysis], findings: list[Finding], peak: str, with_history: bool = True
) -> tuple[str, str, str]:
    """(status, verdict, cause) from the OOMs (by device) and the findings; ``peak``: the numbers
    a healthy run is summed up by; ``with_history``: whether the trace let leaks be checked."""
    if ooms:
        dev, oom = next(iter(ooms.items()))
        where = f" on device {dev}" if len(ooms) > 1 or dev != 0 else ""
        said = next((f for f in findings if f.id in OOM_CAUSES and f.device == dev), None)
        return (
            "critical",
            f"Out of memory{where}: a request of {format_bytes(oom.requested_bytes)} could not be served.",
            oom_cause(oom, said),
        )
    ranked = sorted(findings, key=lambda finding: SEVERITY_ORDER.get(finding.severity, 9))
    worst = ranked[0] if ranked else None
    if worst is not None and worst.severity in ("critical", "warning"):
        # out-of-memory errors the job went on from say so themselves: "no out-of-memory error" would be false
        but = "" if worst.id == RECOVERED_ID else "No out-of-memory error, but: "
        return worst.severity, f"{but}{worst.title}.", worst.advice.split(". ")[0] + "."
    if not with_history:
        return (
            "ok",
            "Nothing wrong at the dump: no out-of-memory error, no warning (no history, so no leak check).",
            peak,
        )
    return "ok", "Nothing wrong: no out-of-memory error and no warning among the findings.", peak


def _sentences(text: str, limit: int = 2) -> str:
    """The first ``limit`` sentences: the full advice stays in the finding below."""
    parts = text.split(". ")
    return text if len(parts) <= limit else ". ".join(parts[:limit]) + ". (More under Findings.)"


def levers(
    findings: list[Finding], plans: list[dict[str, Any]], fit: FitSummary | None = None, limit: int = 6
) -> list[Lever]:
    """What to change, best first."""
    out: list[Lever] = []
    if fit is not None and not fit.last:
        out.append(
            Lever(fit.verdict, " ".join(fit.steps), format_bytes(fit.saved_bytes) if fit.saved_bytes else "", "fit")
        )
    ranked = sorted(
        findings, key=lambda finding: (SEVERITY_ORDER.get(finding.severity, 9), -(finding.savings_bytes or 0))
    )
    seen: set[str] = set()
    for finding in ranked:
        if not finding.advice or finding.advice in seen:
            continue
        seen.add(finding.advice)
        dev = f" (device {finding.device})" if finding.device is not None and finding.device != 0 else ""
        out.append(
            Lever(
                finding.title + dev,
                _sentences(finding.advice),
                format_bytes(finding.savings_bytes) if finding.savings_bytes else "",
                finding.id,
            )
        )
    for table in plans:
        for row in table.get("rows", [])[1:]:
            if row[3] == "yes":
                out.append(
                    Lever(
                        f"{row[0]}: peak reserved {row[2]} per GPU, fits with {row[4]} to spare",
                        "Replayed from the recorded run with every allocation rescaled for this layout "
                        "(snaplab plan shows each rank).",
                        source="plan",
                    )
                )
    out = out[:limit]
    if fit is not None and fit.last:  # not an answer that makes the job fit: not styled as one
        out.append(Lever(fit.verdict, " ".join(fit.steps), source="fit-aside"))
    return out


__all__ = ["FirstScreen", "FitSummary", "Lever", "SourceFile", "levers", "made_of", "oom_cause", "verdict"]
