"""The repeated blocks of a forward pass, found from where their modules are called.

A model's repeated blocks (a GPT's decoder layers, a ResNet's bottlenecks, whatever their
shapes) are called one after the other from one call site (``x = block(x)``, a ``Sequential``'s
loop). Among the call sites on the forward allocations' stacks, the one whose calls cover the
most allocations in at least two instances is taken; an instance begins where the first call
inside the block (its first layer) comes round again.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np

from ...frames import SnapshotFrames
from ..plan.structure import stack_info


def _instances(inner: list[int]) -> list[int]:
    """Indexes (into the site's rows) where an instance begins."""
    first = inner[0]
    return [i for i, f in enumerate(inner) if f == first and (i == 0 or inner[i - 1] != first)]


def block_instances(frames: SnapshotFrames, rows: np.ndarray, sids: np.ndarray) -> list[np.ndarray]:
    """The forward's repeated blocks: per instance, the subset of ``rows`` (allocation rows of
    one forward, in order; ``sids`` their stacks) it made. Empty when nothing repeats."""
    info = stack_info(frames)
    by_site: dict[tuple[int, int], list[int]] = defaultdict(list)
    inner_of: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, sid in enumerate(sids.tolist()):
        path = info.call_path.get(int(sid), ())
        for depth in range(len(path) - 1):
            key = (depth, path[depth])
            by_site[key].append(i)
            inner_of[key].append(path[depth + 1])
    best: tuple[int, int, int] = (0, 0, 0)
    best_key = None
    for key, idx in by_site.items():
        starts = _instances(inner_of[key])
        if len(starts) < 2:
            continue
        score = (len(idx), len(starts), key[0])
        if score > best:
            best, best_key = score, key
    if best_key is None:
        return []
    members = np.array(by_site[best_key])
    starts = [*_instances(inner_of[best_key]), members.size]
    return [rows[members[a:b]] for a, b in itertools.pairwise(starts)]
