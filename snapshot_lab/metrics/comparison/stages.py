"""Stages of two runs by name (``diff --stages``): per ``record_function`` name, the largest
peak and kept bytes of its ranges in each run, and the change."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..history.stages import Stages


@dataclass(frozen=True)
class StageChange:
    name: str
    count_before: int
    count_after: int
    peak_before: int | None  # the largest peak of the name's ranges (None: no such range)
    peak_after: int | None
    kept_before: int | None
    kept_after: int | None

    @property
    def status(self) -> str:
        if self.peak_before is None:
            return "new"
        return "gone" if self.peak_after is None else "both"

    @property
    def peak_change(self) -> int | None:
        return None if self.peak_before is None or self.peak_after is None else self.peak_after - self.peak_before

    @property
    def kept_change(self) -> int | None:
        return None if self.kept_before is None or self.kept_after is None else self.kept_after - self.kept_before

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "status": self.status,
            "peak_change_bytes": self.peak_change,
            "kept_change_bytes": self.kept_change,
        }


@dataclass(frozen=True)
class StagesDiff:
    device_before: int | None
    device_after: int | None
    rows: tuple[StageChange, ...]  # names in the first run's order, then the second's new ones

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_before": self.device_before,
            "device_after": self.device_after,
            "rows": [row.to_dict() for row in self.rows],
        }


def compare_stages(before: Stages | None, after: Stages | None) -> StagesDiff:
    """The stages of ``before`` and ``after`` matched by name (None: the file has no ranges)."""
    a = before.by_name() if before is not None else {}
    b = after.by_name() if after is not None else {}
    rows = []
    for name in [*a, *(n for n in b if n not in a)]:
        x, y = a.get(name), b.get(name)
        rows.append(
            StageChange(
                name=name,
                count_before=x["count"] if x else 0,
                count_after=y["count"] if y else 0,
                peak_before=x["peak_requested_bytes"] if x else None,
                peak_after=y["peak_requested_bytes"] if y else None,
                kept_before=x["kept_bytes"] if x else None,
                kept_after=y["kept_bytes"] if y else None,
            )
        )
    return StagesDiff(
        before.device if before is not None else None, after.device if after is not None else None, tuple(rows)
    )
