"""The recorded program, rewritten in one pass: per recorded allocation a planned size (0: not
made on this rank), a stream, a category and the rule that says why; frees moved; operations a
strategy adds inserted before or after recorded events. Data-parallel, sharded and
tensor-parallel plans are such rewrites (:mod:`.data_parallel`, :mod:`.tensor_parallel`);
pipeline stages re-run parts of the recording per microbatch (:mod:`.pipeline`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..categories import CATEGORIES
from .messages import AS_RECORDED, OOM_REQUEST, RECORDED_RULES, RULE_RECORDED_DDP_DROPPED
from .program import ALLOC, EMPTY_CACHE, FREE, FREE_REQUESTED, Program
from .structure import TrainingStructure

# ("a", key, size, stream, category, rule) | ("f", key) | ("r", key): free requested | ("e",)
Operation = tuple


def recorded_rule(category: str) -> str:
    """The rule of a recorded allocation kept as it was."""
    return RECORDED_RULES.get(category, AS_RECORDED)


@dataclass
class Rewrite:
    structure: TrainingStructure
    size: np.ndarray
    stream: np.ndarray
    category: np.ndarray  # object: category names
    rule: np.ndarray  # object: rule texts
    # position after which the allocation is freed (-1: never)
    free_after: np.ndarray
    before: dict[int, list[Operation]] = field(default_factory=dict)
    after: dict[int, list[Operation]] = field(default_factory=dict)
    # memory older than the trace
    untracked: Callable[[int, str], tuple[int, str]] | None = None
    _next_key: int = -2

    @classmethod
    def identity(cls, structure: TrainingStructure, as_recorded: bool = False) -> Rewrite:
        """Every recorded allocation as the single-GPU run made it (``as_recorded``: exactly as
        recorded, a DDP rank's own buckets included)."""
        allocs = structure.allocs
        code = allocs["code_recorded" if as_recorded else "code"].to_numpy()
        cats = np.array(CATEGORIES, dtype=object)[code]
        size = allocs["size"].to_numpy(dtype=np.int64).copy()
        codes, inverse = np.unique(code, return_inverse=True)
        rule = np.array([recorded_rule(CATEGORIES[c]) for c in codes.tolist()], dtype=object)[inverse.reshape(-1)]
        if not as_recorded:
            dropped = allocs["dropped"].to_numpy()
            size[dropped] = 0
            rule[dropped] = RULE_RECORDED_DDP_DROPPED
        return cls(
            structure=structure,
            size=size,
            stream=allocs["stream"].to_numpy(dtype=np.int64).copy(),
            category=cats.copy(),
            rule=rule,
            free_after=allocs["free_pos_recorded" if as_recorded else "free_pos"].to_numpy(dtype=np.int64).copy(),
        )

    def new_key(self) -> int:
        self._next_key -= 1
        return self._next_key

    def add(self, pos: int, operation: Operation, before: bool = True) -> None:
        (self.before if before else self.after).setdefault(int(pos), []).append(operation)

    def alloc_at(
        self,
        pos: int,
        size: int,
        stream: int,
        category: str,
        rule: str,
        before: bool = True,
        key: int | None = None,
        source_row: int = -1,
    ) -> int:
        """An allocation the strategy adds at recorded position ``pos``; ``source_row``: the
        recorded allocation it stands for (a parameter's shard), for the record."""
        new = self.new_key() if key is None else key
        self.add(pos, ("a", new, int(size), int(stream), category, rule, int(source_row)), before)
        return new

    def free_at(self, pos: int, key: int, before: bool = True) -> None:
        self.add(pos, ("f", key), before)

    def set(
        self,
        rows: np.ndarray,
        size: np.ndarray | int,
        category: str | None,
        rule: str,
    ) -> None:
        """Planned size, category (None: unchanged) and rule of the recorded allocations
        ``rows``."""
        self.size[rows] = size
        if category is not None:
            self.category[rows] = category
        self.rule[rows] = rule

    def build(self) -> Program:
        """The program: memory older than the trace, then at every recorded position what the
        strategy adds before it, the recorded allocation (rescaled), a recorded OOM's request,
        the frees, an empty_cache() and what the strategy adds after it. Built as columns and
        put in that order by one sort (a recording of millions of events has as many rows)."""
        program = Program()
        self._alloc_untracked(program)
        table = _OpTable(self.structure)
        made = self._recorded_allocs(table)
        self._recorded_ooms(table)
        self._recorded_frees(table, made)
        releases = np.array(sorted(set(self.structure.releases)), dtype=np.int64)
        table.sizeless(releases[(releases >= 0) & (releases < table.n)], _RELEASE, EMPTY_CACHE, -1)
        for slot, added in ((_BEFORE, self.before), (_AFTER, self.after)):
            table.added(added, slot)
        table.write(program)
        return program

    def _recorded_allocs(self, table: _OpTable) -> np.ndarray:
        """Each recorded allocation the plan makes, at its position; returns which are made."""
        allocs = self.structure.allocs
        rows = np.arange(len(allocs), dtype=np.int64)
        pos = allocs["pos"].to_numpy(dtype=np.int64)
        alloc_row = np.full(table.n, -1, dtype=np.int64)
        alloc_row[pos] = rows
        made = (alloc_row[pos] == rows) & (self.size > 0)
        chosen = rows[made]
        table.add(
            pos[chosen],
            slot=_ALLOC,
            sub=0,
            kind=ALLOC,
            key=chosen,
            size=self.size[chosen],
            stream=self.stream[chosen],
            category=self.category[chosen],
            rule=self.rule[chosen],
            origin=table.event_index[chosen],
            recorded=table.recorded[chosen],
            placed=table.event_index[chosen],
        )
        return made

    def _recorded_ooms(self, table: _OpTable) -> None:
        """A recorded OOM's request, at its position (keys given in the order of positions)."""
        ooms = {position: (requested, stream) for position, requested, stream in self.structure.ooms}
        at = np.array(sorted(p for p in ooms if 0 <= p < table.n), dtype=np.int64)
        requested = np.array([ooms[int(p)][0] for p in at], dtype=np.int64)
        keys = np.array([self.new_key() for _ in at], dtype=np.int64)
        origin = table.origin(at)
        table.add(
            at,
            slot=_OOM,
            sub=0,
            kind=ALLOC,
            key=keys,
            size=requested,
            stream=np.array([ooms[int(p)][1] for p in at], dtype=np.int64),
            category=np.full(at.size, "other", dtype=object),
            rule=np.full(at.size, OOM_REQUEST, dtype=object),
            origin=origin,
            recorded=requested,
            placed=origin,
        )

    def _recorded_frees(self, table: _OpTable, made: np.ndarray) -> None:
        """The frees of the allocations made, after the position they are freed at (by row)."""
        free_after = self.free_after
        pos = self.structure.allocs["pos"].to_numpy(dtype=np.int64)
        rows = np.flatnonzero(made & (free_after >= pos) & (free_after >= 0) & (free_after < table.n))
        table.sizeless(free_after[rows], _FREE, FREE, rows, sub=rows)

    def _alloc_untracked(self, program: Program) -> None:
        """Memory older than the trace: alive from the start."""
        base = self.structure.origin(0)
        for old_bytes, category, old_stream in self.structure.untracked:
            if self.untracked is not None:
                new_bytes, why = self.untracked(old_bytes, category)
            else:
                new_bytes, why = old_bytes, recorded_rule(category)
            if new_bytes > 0:
                source = program.source_id(category, why + " (older than the trace)")
                program.alloc(self.new_key(), new_bytes, old_stream, source, base, old_bytes)


# where an operation goes among those at one recorded position
_BEFORE, _ALLOC, _OOM, _FREE, _RELEASE, _AFTER = range(6)
_COLUMNS = ("pos", "slot", "sub", "kind", "key", "size", "stream", "origin", "recorded", "placed")


class _OpTable:
    """A rewrite's operations as columns, each with its place (recorded position, slot, order
    within the slot), written into a program in that order."""

    def __init__(self, structure: TrainingStructure) -> None:
        allocs = structure.allocs
        self.n = structure.n_events
        self.positions = structure.event_index  # trace position -> recorded event index
        self.event_index = allocs["event_index"].to_numpy(dtype=np.int64)  # per recorded allocation
        self.recorded = allocs["size"].to_numpy(dtype=np.int64)  # per recorded allocation
        self.parts: list[dict[str, np.ndarray]] = []

    def origin(self, pos: np.ndarray) -> np.ndarray:
        """The recorded event index at trace positions ``pos``."""
        if self.n == 0:
            return np.zeros(len(pos), dtype=np.int64)
        return self.positions[np.clip(pos, 0, self.n - 1)].astype(np.int64)

    def add(self, pos: np.ndarray, **columns: Any) -> None:
        """Operations at trace positions ``pos``: every column of _COLUMNS, category and rule
        (a single value stands for all)."""
        part = {name: np.broadcast_to(np.asarray(value), pos.shape) for name, value in columns.items()}
        self.parts.append({"pos": pos, **part})

    def sizeless(self, pos: np.ndarray, slot: int, kind: int, key: np.ndarray | int, sub: Any = 0) -> None:
        """Frees and empty_cache() calls at positions ``pos``."""
        origin = self.origin(pos)
        self.add(
            pos,
            slot=slot,
            sub=sub,
            kind=kind,
            key=key,
            size=0,
            stream=0,
            category=None,
            rule=None,
            origin=origin,
            recorded=0,
            placed=origin,
        )

    def added(self, added: dict[int, list[Operation]], slot: int) -> None:
        """What a strategy adds before or after recorded positions, in the order it added them."""
        rows: list[tuple[Any, ...]] = []
        for position, operations in added.items():
            if 0 <= position < self.n:
                rows += [(position, order, *_flat(op)) for order, op in enumerate(operations)]
        if not rows:
            return
        pos, sub, kind, key, size, stream, category, rule, source_row = map(list, zip(*rows, strict=True))
        at = np.array(pos, dtype=np.int64)
        row = np.array(source_row, dtype=np.int64)
        placed = self.origin(at)
        origin, recorded = placed, np.zeros(at.size, dtype=np.int64)
        if len(self.event_index):  # one that stands for a recorded allocation comes from it
            has_row, safe = row >= 0, np.maximum(row, 0)
            origin = np.where(has_row, self.event_index[safe], placed)
            recorded = np.where(has_row, self.recorded[safe], 0)
        self.add(
            at,
            slot=slot,
            sub=np.array(sub),
            kind=np.array(kind),
            key=np.array(key, dtype=np.int64),
            size=np.array(size, dtype=np.int64),
            stream=np.array(stream, dtype=np.int64),
            category=np.array(category, dtype=object),
            rule=np.array(rule, dtype=object),
            origin=origin,
            recorded=recorded,
            placed=placed,
        )

    def _pairs(self, alloc: np.ndarray) -> tuple[np.ndarray, dict[int, tuple[str, str]]]:
        """Per operation, its (category, rule) pair's number (-1: not an allocation), and each
        number's pair."""
        category = np.concatenate([part["category"] for part in self.parts])[alloc]
        rule = np.concatenate([part["rule"] for part in self.parts])[alloc]
        category_code, categories = pd.factorize(category)
        rule_code, rules = pd.factorize(rule)
        pair = np.full(alloc.size, -1, dtype=np.int64)
        pair[alloc] = category_code.astype(np.int64) * len(rules) + rule_code
        sources = {p: (categories[p // len(rules)], rules[p % len(rules)]) for p in np.unique(pair[alloc]).tolist()}
        return pair, sources

    def write(self, program: Program) -> None:
        """Every operation into ``program``, in order; a source per (category, rule) in the
        order they first appear."""
        if not self.parts:
            return
        col = {name: np.concatenate([part[name] for part in self.parts]) for name in _COLUMNS}
        order = np.lexsort((col["sub"], col["slot"], col["pos"]))
        pair, sources = self._pairs(col["kind"] == ALLOC)
        col = {name: values[order] for name, values in col.items()}
        source = np.full(order.size, -1, dtype=np.int64)
        pair = pair[order]
        allocs = pair >= 0
        if allocs.any():
            first, pairs = pd.factorize(pair[allocs])  # in the order they first appear
            ids = [program.source_id(*sources[p]) for p in pairs.tolist()]
            source[allocs] = np.array(ids, dtype=np.int64)[first]
        col["source"] = source
        for name in ("kind", "key", "size", "stream", "source", "origin", "recorded", "placed"):
            # one column at a time in memory twice
            getattr(program, name).frombytes(np.ascontiguousarray(col.pop(name), dtype=np.int64).tobytes())


def _flat(op: Operation) -> tuple[Any, ...]:
    """An added operation as (kind, key, size, stream, category, rule, source row)."""
    if op[0] == "a":
        return ALLOC, op[1], int(op[2]), int(op[3]), op[4], op[5], int(op[6])
    kind = {"f": FREE, "r": FREE_REQUESTED}.get(op[0], EMPTY_CACHE)
    return kind, op[1] if kind != EMPTY_CACHE else -1, 0, 0, None, None, -1
