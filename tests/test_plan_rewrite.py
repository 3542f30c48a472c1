"""A plan's rewrite of the recording becomes one program (``metrics/plan/rewrite.py``): every
recorded position in order, and at one position what the strategy adds before it, the recorded
allocation, a recorded OOM's request, the frees (by row), an ``empty_cache()`` and what the
strategy adds after it. The program is built as columns and sorted once; these tests hold it to
that order and to the sources it names."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from snapshot_lab import load_frames
from snapshot_lab.metrics.plan.messages import OOM_REQUEST
from snapshot_lab.metrics.plan.program import ALLOC, EMPTY_CACHE, FREE, FREE_REQUESTED, Program, Source
from snapshot_lab.metrics.plan.rewrite import Rewrite
from snapshot_lab.metrics.plan.structure import TrainingStructure, training_structure

from .conftest import sample_path


@pytest.fixture(scope="module")
def structure() -> TrainingStructure:
    return training_structure(load_frames(sample_path("single_mlp")), 0)


def _ops(program: Program, start: int, stop: int) -> list[tuple[int, int, int]]:
    return list(zip(program.kind[start:stop], program.key[start:stop], program.size[start:stop], strict=True))


def test_one_position_holds_its_operations_in_order(structure):
    allocs = structure.allocs
    pos = allocs["pos"].to_numpy()
    r0 = len(pos) // 2
    p = int(pos[r0])
    early_a, early_b = (int(r) for r in np.flatnonzero(pos < p)[:2])
    rw = Rewrite.identity(dataclasses.replace(structure, ooms=((p, 4096, 7),), releases=(p,)))
    rw.free_after[[early_b, early_a]] = p  # freed after p: written by row
    added = rw.alloc_at(p, 1000, 0, "activation", "added before it")
    rw.add(p, ("r", early_a))
    rw.free_at(p, added, before=False)
    program = rw.build()
    at = next(i for i, (k, key) in enumerate(zip(program.kind, program.key, strict=True)) if k == ALLOC and key == r0)
    oom_key = program.key[at + 1]
    assert _ops(program, at - 2, at + 6) == [
        (ALLOC, added, 1000),
        (FREE_REQUESTED, early_a, 0),
        (ALLOC, r0, int(rw.size[r0])),
        (ALLOC, oom_key, 4096),
        (FREE, early_a, 0),
        (FREE, early_b, 0),
        (EMPTY_CACHE, -1, 0),
        (FREE, added, 0),
    ]
    assert oom_key < 0 and program.stream[at + 1] == 7
    assert program.sources[program.source[at + 1]] == Source("other", OOM_REQUEST)
    assert program.sources[program.source[at - 2]] == Source("activation", "added before it")
    here = int(structure.event_index[p])
    assert list(program.placed[at - 2 : at + 6]) == [here, here, program.origin[at], here, here, here, here, here]
    assert program.origin[at] == int(allocs["event_index"].to_numpy()[r0])


def test_every_made_allocation_is_written_once_and_freed_after_it(structure):
    rw = Rewrite.identity(structure)
    dropped = np.flatnonzero(rw.size > 0)[::3]
    rw.size[dropped] = 0  # not made on this rank: neither allocated nor freed
    program = rw.build()
    kind, key = np.array(program.kind), np.array(program.key)
    made = np.flatnonzero(rw.size > 0)
    written = key[(kind == ALLOC) & (key >= 0)]
    assert sorted(written.tolist()) == made.tolist()
    freed = key[kind == FREE]
    assert not np.isin(dropped, freed).any()
    expect_freed = made[(rw.free_after[made] >= 0) & (rw.free_after[made] < structure.n_events)]
    assert sorted(freed.tolist()) == expect_freed.tolist()
    first_alloc = {k: i for i, k in reversed(list(enumerate(key.tolist()))) if kind[i] == ALLOC}
    assert all(first_alloc[k] < i for i, k in enumerate(key.tolist()) if kind[i] == FREE)
    assert np.all(np.diff(np.array(program.placed)) >= 0)  # recorded positions in order


def test_sources_are_named_in_the_order_they_first_appear(structure):
    rw = Rewrite.identity(structure)
    rw.alloc_at(0, 10, 0, "other", "added at the start")  # written last, first in the program
    program = rw.build()
    firsts: list[int] = []
    for sid in program.source:
        if sid >= 0 and sid not in firsts:
            firsts.append(sid)
    assert firsts == list(range(len(program.sources)))
    categories = {program.sources[s].category for s in set(program.source) if s >= 0}
    assert {"parameter", "activation"} <= categories
    assert Source("other", "added at the start") in program.sources[: len(structure.untracked) + 1]
