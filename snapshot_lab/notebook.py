"""Results that show themselves in Jupyter: what ``snapshot_lab.stats``, ``findings``, ``diff`` and
``report`` return. Each is the usual result (a ``SnapshotStats``, a list of ``Finding``, a
``SnapshotDiff``, a ``Path``), with a ``_repr_html_`` that renders it the way the report does:
the report's sections and style, scoped to the output cell, no script. The frames
(``snapshot_lab.load_frames``) are pandas already and display as such. Rendering is imported
only when a notebook asks for it.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import PosixPath, WindowsPath

from .metrics.comparison.compare import SnapshotDiff
from .metrics.findings import Finding
from .metrics.stats.summary import SnapshotStats

if sys.platform == "win32":
    _ConcretePath = WindowsPath
else:
    _ConcretePath = PosixPath


class ReportFile(_ConcretePath):
    """The path of a written report; in a notebook, the report itself."""

    def _repr_html_(self) -> str | None:
        from .render.notebook import missing_fragment, page_fragment

        if self.suffix != ".html":
            # a path derived from this one (with_suffix...): a plain path
            return None
        try:
            return page_fragment(self.read_text(encoding="utf-8"))
        except OSError:
            return missing_fragment(str(self))


class Stats(SnapshotStats):
    """A :class:`SnapshotStats` that displays itself in Jupyter (equal to the plain one)."""

    @classmethod
    def of(cls, stats: SnapshotStats) -> Stats:
        return cls(**{field.name: getattr(stats, field.name) for field in fields(SnapshotStats)})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SnapshotStats):
            return NotImplemented
        return all(getattr(self, field.name) == getattr(other, field.name) for field in fields(SnapshotStats))

    __hash__ = SnapshotStats.__hash__

    def _repr_html_(self) -> str:
        from .render.notebook import render_stats_fragment

        return render_stats_fragment(self)


class Findings(list[Finding]):
    """The list of findings, most severe first; displays like the report's Findings section."""

    def _repr_html_(self) -> str:
        from .render.notebook import render_findings_fragment

        return render_findings_fragment(list(self))


class Diff(SnapshotDiff):
    """A :class:`SnapshotDiff` that displays itself as ``snaplab diff -o`` writes it."""

    @classmethod
    def of(cls, diff: SnapshotDiff) -> Diff:
        return cls(**{field.name: getattr(diff, field.name) for field in fields(SnapshotDiff)})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SnapshotDiff):
            return NotImplemented
        return all(getattr(self, field.name) == getattr(other, field.name) for field in fields(SnapshotDiff))

    __hash__ = SnapshotDiff.__hash__

    def _repr_html_(self) -> str:
        from . import __version__
        from .render.compare import render_diff_html
        from .render.notebook import page_fragment

        return page_fragment(render_diff_html(self, __version__))


__all__ = ["Diff", "Findings", "ReportFile", "Stats"]
