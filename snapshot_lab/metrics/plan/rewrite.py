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
from .program import Program
from .structure import TrainingStructure

# ("a", key, size, stream, category, rule) | ("f", key) | ("r", key): free requested | ("e",)
Op = tuple

AS_RECORDED = "as recorded"


def recorded_rule(category: str) -> str:
    return {
        "parameter": "parameters, as recorded",
        "gradient": "gradients, as recorded",
        "optimizer_state": "optimizer state, as recorded",
        "activation": "activations and temporaries, as recorded",
        "inflight_activation": "pipeline in-flight activations, as recorded",
        "fsdp_unsharded_params": "FSDP unsharded parameters, as recorded",
        "comm_buffer": "communication buffers, as recorded",
        "ddp_bucket": "DDP buckets, as recorded",
        "cuda_graph_pool": "CUDA-graph pool, as recorded",
        "other": "other allocations (inputs, caches, workspaces), as recorded",
    }.get(category, AS_RECORDED)


@dataclass
class Rewrite:
    structure: TrainingStructure
    size: np.ndarray
    stream: np.ndarray
    category: np.ndarray  # object: category names
    rule: np.ndarray  # object: rule texts
    free_after: np.ndarray  # position after which the allocation is freed (-1: never)
    before: dict[int, list[Op]] = field(default_factory=dict)
    after: dict[int, list[Op]] = field(default_factory=dict)
    untracked: Callable[[int, str], tuple[int, str]] | None = None  # memory older than the trace
    _next_key: int = -2

    @classmethod
    def identity(cls, structure: TrainingStructure, as_recorded: bool = False) -> Rewrite:
        """Every recorded allocation as the single-GPU run made it (``as_recorded``: exactly as
        recorded, a DDP rank's own buckets included)."""
        a = structure.allocs
        code = a["code_recorded" if as_recorded else "code"].to_numpy()
        cats = np.array(CATEGORIES, dtype=object)[code]
        size = a["size"].to_numpy(dtype=np.int64).copy()
        rule = np.array([recorded_rule(c) for c in cats], dtype=object)
        if not as_recorded:
            dropped = a["dropped"].to_numpy()
            size[dropped] = 0
            rule[dropped] = "the recorded run's DDP buckets: left out"
        return cls(
            structure=structure,
            size=size,
            stream=a["stream"].to_numpy(dtype=np.int64).copy(),
            category=cats.copy(),
            rule=rule,
            free_after=a["free_pos_recorded" if as_recorded else "free_pos"].to_numpy(dtype=np.int64).copy(),
        )

    def new_key(self) -> int:
        self._next_key -= 1
        return self._next_key

    def add(self, pos: int, op: Op, before: bool = True) -> None:
        (self.before if before else self.after).setdefault(int(pos), []).append(op)

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
        k = self.new_key() if key is None else key
        self.add(pos, ("a", k, int(size), int(stream), category, rule, int(source_row)), before)
        return k

    def free_at(self, pos: int, key: int, before: bool = True) -> None:
        self.add(pos, ("f", key), before)

    def set(self, rows: np.ndarray, size: np.ndarray | int, category: str | None, rule: str) -> None:
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
            for op in self.before.get(position, ()):
                emit(op, position)
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
            for op in self.after.get(position, ()):
                emit(op, position)
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


OOM_REQUEST = "the request that ran out of memory, as recorded"


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

    def emit(self, op: Op, position: int) -> None:
        """One operation the strategy added at ``position``."""
        program, origin = self.program, self.origin(position)
        if op[0] == "a":
            source = program.source_id(op[4], op[5])
            row = op[6]
            if row >= 0:  # stands for a recorded allocation: that is where it came from
                event_index, recorded = int(self.event_index[row]), int(self.recorded[row])
                program.alloc(op[1], op[2], op[3], source, event_index, recorded, origin)
            else:
                program.alloc(op[1], op[2], op[3], source, origin, 0)
        elif op[0] == "f":
            program.free(op[1], origin)
        elif op[0] == "r":
            program.free_requested(op[1], origin)
        else:
            program.empty_cache(origin)
