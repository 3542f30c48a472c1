"""What the peak was made of: the bytes alive at one moment, by category, by module and by site.

The report's first screen answers "what filled the memory" in three lines; this module holds
the numbers behind them (bytes and share of the total), nothing about how they are shown.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from .modules import ModuleBreakdown
from .sites import Site


@dataclass(frozen=True)
class Part:
    label: str
    bytes: int
    share: float  # of the composition's total_bytes


@dataclass(frozen=True)
class Composition:
    moment: str  # "peak" (from the trace) or "dump" (the snapshot's own blocks)
    total_bytes: int
    event_index: int | None  # the trace event of the peak; None at the dump
    by_category: tuple[Part, ...]
    by_module: tuple[Part, ...]  # empty when no module view exists
    module_source: str  # "tags", "stacks" or "none"
    top_site: Site | None


def _share(part: int, total: int) -> float:
    return part / total if total else 0.0


def compose(
    moment: str,
    category_bytes: pd.Series,
    sites: list[Site],
    modules: ModuleBreakdown | None = None,
    event_index: int | None = None,
    limit: int = 3,
) -> Composition:
    """``category_bytes``: bytes per category (any order); ``sites``: the top sites, largest first;
    ``modules``: the module view of the same moment (the peak), when there is one."""
    by_cat = category_bytes[category_bytes > 0].sort_values(ascending=False, kind="stable")
    total = int(by_cat.sum())
    cats = tuple(Part(str(c), int(b), _share(int(b), total)) for c, b in by_cat.items())
    mods: tuple[Part, ...] = ()
    source = "none"
    if modules is not None and modules.source != "none":
        source = modules.source
        mods = tuple(Part(r.label, r.self_bytes, _share(r.self_bytes, total)) for r in modules.largest(limit))
    return Composition(moment, total, event_index, cats, mods, source, sites[0] if sites else None)
