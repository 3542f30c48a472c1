"""Crashes the fuzzer found in code this change could not touch (``snapshot_lab/metrics``,
``report.py``, ``api.py``, ``cli.py``, ``render``, ``plots`` were being rewritten at the time):
valid snapshots, by the loader's rules, on which an analysis itself breaks.

Each is listed here with the minimised input kept in ``tests/fuzz/pending/`` and skipped by the
fuzz contract, explicitly: a crash matches an entry when its exception type and the innermost
snaplab frame (file and function) are the entry's. ``tests/test_fuzz.py`` replays every input
of ``tests/fuzz/pending/`` and fails once one stops crashing, so that a fixed case leaves this
list (and its input moves to ``tests/fuzz/regressions/``).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    name: str  # the input's file name in tests/fuzz/pending/, without suffix
    exception: str  # type name
    where: str  # innermost snaplab frame: 'metrics/allocator/whatif.py:recorded_settings'
    why: str


PENDING: tuple[Pending, ...] = ()


def innermost_snaplab_frame(exc: BaseException) -> str:
    where = "?"
    for fs in traceback.extract_tb(exc.__traceback__):
        if "snapshot_lab" in fs.filename:
            where = f"{fs.filename.split('snapshot_lab/')[-1]}:{fs.name}"
    return where


def known_pending(exc: BaseException) -> Pending | None:
    where = innermost_snaplab_frame(exc)
    for p in PENDING:
        if type(exc).__name__ == p.exception and where == p.where:
            return p
    return None
