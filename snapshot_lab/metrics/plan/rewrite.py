"""The recorded program, rewritten in one pass: per recorded allocation a planned size (0: not
made on this rank), a stream, a category and the rule that says why; frees moved; operations a
strategy adds inserted before or after recorded events. Data-parallel, sharded and
tensor-parallel plans are such rewrites (:mod:`.data_parallel`, :mod:`.tensor_parallel`);
pipeline stages re-run parts of the recording per microbatch (:mod:`.pipeline`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..categories import CATEGORIES
from .messages import AS_RECORDED, OOM_REQUEST, RECORDED_RULES, RULE_RECORDED_DDP_DROPPED
from .program import Program
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
        rule = np.array([recorded_rule(category) for category in cats], dtype=object)
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
        the frees, an empty_cache() and what the strategy adds after it."""
        structure = self.structure
        allocs = structure.allocs
        writer = _ProgramWriter(
            Program(),
            structure.origin,
            allocs["event_index"].to_numpy(),
            allocs["size"].to_numpy(),
        )
        self._alloc_untracked(writer.program)
        alloc_row = np.full(structure.n_events, -1, dtype=np.int64)
        alloc_row[allocs["pos"].to_numpy()] = allocs["row"].to_numpy()
        frees: dict[int, list[int]] = {}  # position -> rows freed after it
        for row, position in enumerate(self.free_after.tolist()):
            if position >= 0:
                frees.setdefault(int(position), []).append(row)
        releases = set(structure.releases)
        ooms = {position: (requested, stream) for position, requested, stream in structure.ooms}
        made = np.zeros(len(allocs), dtype=bool)
        program, origin, size, emit = writer.program, structure.origin, self.size, writer.emit
        for position in range(structure.n_events):
            for operation in self.before.get(position, ()):
                emit(operation, position)
            row = int(alloc_row[position])
            if row >= 0 and size[row] > 0:
                writer.alloc_row(self, row)
                made[row] = True
            if position in ooms:
                requested, stream = ooms[position]
                source = program.source_id("other", OOM_REQUEST)
                at = origin(position)
                program.alloc(self.new_key(), requested, stream, source, at, requested)
            for freed in frees.get(position, ()):
                if made[freed]:
                    program.free(freed, origin(position))
            if position in releases:
                program.empty_cache(origin(position))
            for operation in self.after.get(position, ()):
                emit(operation, position)
        return program

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


@dataclass(frozen=True)
class _ProgramWriter:
    """Writes a rewrite's operations into ``program``, each with the recorded allocation it
    stands for or the recorded moment it is placed at."""

    program: Program
    origin: Callable[[int], int]  # trace position -> recorded event index
    event_index: np.ndarray  # per recorded allocation
    recorded: np.ndarray  # per recorded allocation: its recorded size

    def alloc_row(self, rewrite: Rewrite, row: int) -> None:
        """Recorded allocation ``row``, as planned."""
        self.program.alloc(
            row,
            int(rewrite.size[row]),
            int(rewrite.stream[row]),
            self.program.source_id(rewrite.category[row], rewrite.rule[row]),
            int(self.event_index[row]),
            int(self.recorded[row]),
        )

    def emit(self, operation: Operation, position: int) -> None:
        """One operation the strategy added at ``position``."""
        program, origin = self.program, self.origin(position)
        if operation[0] == "a":
            source = program.source_id(operation[4], operation[5])
            row = operation[6]
            if row >= 0:
                # stands for a recorded allocation: that is where it came from
                event_index, recorded = int(self.event_index[row]), int(self.recorded[row])
                program.alloc(
                    operation[1],
                    operation[2],
                    operation[3],
                    source,
                    event_index,
                    recorded,
                    origin,
                )
            else:
                program.alloc(operation[1], operation[2], operation[3], source, origin, 0)
        elif operation[0] == "f":
            program.free(operation[1], origin)
        elif operation[0] == "r":
            program.free_requested(operation[1], origin)
        else:
            program.empty_cache(origin)
