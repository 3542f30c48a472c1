"""What :mod:`snapshot_lab.api` returns where a metric gives several results at once: the usual
containers (a dict of leak analyses per device, a list of what-ifs, of violations, of findings;
the rows and errors of ``ranks``), each with the ``to_dict()`` that ``snaplab <command> --json``
prints, so the command line builds no JSON of its own.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .metrics.allocator.whatif import WhatIf
from .metrics.comparison.compare import RankRow, Violation, rank_pipeline
from .metrics.findings import Finding
from .metrics.leaks import LeakAnalysis
from .metrics.parallel.pipeline import PipelineSkew
from .notebook import Findings


class Leaks(dict[int, LeakAnalysis]):
    """Leak analysis per device (``{device: LeakAnalysis}``)."""

    def to_dict(self) -> dict[str, Any]:
        """Every device's suspects in one list, their growth summed, and each device's analysis."""
        return {
            "suspects": [suspect.to_dict() for analysis in self.values() for suspect in analysis.suspects],
            "growth_bytes_per_iteration": sum(analysis.growth_bytes_per_iteration for analysis in self.values()),
            "devices": {str(device): analysis.to_dict() for device, analysis in self.items()},
        }


class WhatIfs(list[WhatIf]):
    """One allocator replay per device, in the order the devices were analysed."""

    def to_dict(self) -> dict[str, Any]:
        """The first device's replay at the top level, every device under ``devices``."""
        first = self[0].to_dict() if self else {"replay_check": None, "scenarios": []}
        return {
            "device": first.get("device"),
            "replay_check": first["replay_check"],
            "scenarios": first["scenarios"],
            "memory_limit_bytes": first.get("memory_limit_bytes"),
            "devices": [whatif.to_dict() for whatif in self],
        }


class FileFindings(Findings):
    """One file's findings, most severe first."""

    def to_dict(self) -> dict[str, Any]:
        return {"findings": [finding.to_dict() for finding in self]}


class Violations(list[Violation]):
    """The limits a ``check`` found violated; empty when every limit holds."""

    def to_dict(self) -> dict[str, Any]:
        return {"ok": not self, "violations": [violation.to_dict() for violation in self]}


class Ranks(NamedTuple):
    """One row per rank file that could be read, and per file that could not, its error
    (unpacks as ``rows, errors = snapshot_lab.ranks(...)``)."""

    rows: list[RankRow]
    errors: dict[str, str]

    def pipeline(self) -> tuple[PipelineSkew | None, list[Finding]]:
        """The pipeline's stages side by side (None unless the rows span two stages) and the
        findings across the files."""
        return rank_pipeline(self.rows)

    def to_dict(self) -> dict[str, Any]:
        skew, across = self.pipeline()
        return {
            "ranks": [row.to_dict() for row in self.rows],
            "errors": self.errors,
            "pipeline": skew.to_dict() if skew is not None else None,
            "findings": [finding.to_dict() for finding in across],
        }
