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
            free_after=a["free_pos_recorded" if as_recorded else "free_pos"]
            .to_numpy(dtype=np.int64)
            .copy(),
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

    def set(
        self, rows: np.ndarray, size: np.ndarray | int, category: str | None, rule: str
    ) -> None:
        """Planned size, category (None: unchanged) and rule of the recorded allocations
        ``rows``."""
        self.size[rows] = size
        if category is not None:
            self.category[rows] = category
        self.rule[rows] = rule

    def build(self) -> Program:
        s = self.structure
        a = s.allocs
        prog = Program()
        sources: dict[tuple[str, str], int] = {}

        def src(category: str, rule: str) -> int:
            sid = sources.get((category, rule))
            if sid is None:
                sid = sources[(category, rule)] = prog.source_id(category, rule)
            return sid

        origin = s.origin
        base = s.origin(0)

        # memory older than the trace: alive from the start
        for old_bytes, cat, old_stream in s.untracked:
            new_bytes, why = (
                self.untracked(old_bytes, cat)
                if self.untracked is not None
                else (old_bytes, recorded_rule(cat))
            )
            if new_bytes > 0:
                prog.alloc(
                    self.new_key(),
                    new_bytes,
                    old_stream,
                    src(cat, why + " (older than the trace)"),
                    base,
                    old_bytes,
                )
        alloc_row = np.full(s.n_events, -1, dtype=np.int64)
        alloc_row[a["pos"].to_numpy()] = a["row"].to_numpy()
        frees: dict[int, list[int]] = {}
        for r, p in enumerate(self.free_after.tolist()):
            if p >= 0:
                frees.setdefault(int(p), []).append(r)
        releases = set(s.releases)
        ooms = {p: (req, st) for p, req, st in s.ooms}
        made = np.zeros(len(a), dtype=bool)
        recorded = a["size"].to_numpy()
        size, stream, category, rule = self.size, self.stream, self.category, self.rule
        event_index = a["event_index"].to_numpy()

        def emit(op: Op, p: int) -> None:
            if op[0] == "a":
                r = op[6]
                if r >= 0:  # stands for a recorded allocation: that is where it came from
                    prog.alloc(
                        op[1],
                        op[2],
                        op[3],
                        src(op[4], op[5]),
                        int(event_index[r]),
                        int(recorded[r]),
                        origin(p),
                    )
                else:
                    prog.alloc(op[1], op[2], op[3], src(op[4], op[5]), origin(p), 0)
            elif op[0] == "f":
                prog.free(op[1], origin(p))
            elif op[0] == "r":
                prog.free_requested(op[1], origin(p))
            else:
                prog.empty_cache(origin(p))

        for p in range(s.n_events):
            for op in self.before.get(p, ()):
                emit(op, p)
            r = int(alloc_row[p])
            if r >= 0 and size[r] > 0:
                prog.alloc(
                    r,
                    int(size[r]),
                    int(stream[r]),
                    src(category[r], rule[r]),
                    int(event_index[r]),
                    int(recorded[r]),
                )
                made[r] = True
            if p in ooms:
                req, st = ooms[p]
                prog.alloc(
                    self.new_key(),
                    req,
                    st,
                    src("other", "the request that ran out of memory, as recorded"),
                    origin(p),
                    req,
                )
            for fr in frees.get(p, ()):
                if made[fr]:
                    prog.free(fr, origin(p))
            if p in releases:
                prog.empty_cache(origin(p))
            for op in self.after.get(p, ()):
                emit(op, p)
        return prog
