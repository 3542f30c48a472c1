"""The repeated blocks of a forward pass, found from where their modules are called.

A model's repeated blocks (a GPT's decoder layers, a ResNet's bottlenecks, whatever their
shapes) are called one after the other from one call site (``x = block(x)``, a ``Sequential``'s
loop). Among the call sites on the forward allocations' stacks, the one whose calls cover the
most allocations in at least two instances is taken; an instance begins where the first call
inside the block (its first layer) comes round again. A model that loops over its stages, then
over each stage's blocks (torchvision's Swin-T and DenseNet-121), has its stages at that site: a
site nested in it with more instances, covering most of its allocations, is taken instead. A site
whose instances are not alike in size (MobileNetV2's ``features`` loop, whose first layer comes
round only at its last) is no block site.

A block whose allocations are all made under one call of its own (torchvision's ConvNeXt
``CNBlock``: ``self.layer_scale * self.block(input)``) shows the same first call inside it all
along. Only when no call site repeats by that rule, an instance begins where the whole rest of
the first allocation's call chain (the call sites and the modules they call, down to the layer
that allocates) comes round again, and the site with the most instances is taken (a stage that
also comes round, stem and downsampling layers included, has fewer).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Hashable, Sequence

import numpy as np

from ...frames import SnapshotFrames
from ..plan.structure import StackInfo, stack_info


def _instances(inner: Sequence[Hashable]) -> list[int]:
    """Indexes (into the site's rows) where an instance begins."""
    first = inner[0]
    return [i for i, f in enumerate(inner) if f == first and (i == 0 or inner[i - 1] != first)]


def _sites(
    info: StackInfo, sids: np.ndarray, whole_chain: bool
) -> tuple[dict[tuple[int, int], list[int]], dict[tuple[int, int], list[Hashable]]]:
    """Per call site (depth, frame): the rows made under it and, per row, what is inside the
    site: the next call site, or (``whole_chain``) every call site and called module below it."""
    by_site: dict[tuple[int, int], list[int]] = defaultdict(list)
    inner_of: dict[tuple[int, int], list[Hashable]] = defaultdict(list)
    for i, sid in enumerate(sids.tolist()):
        path = info.call_path.get(int(sid), ())
        callee = info.callee.get(int(sid), ())
        for depth in range(len(path) - 1):
            key = (depth, path[depth])
            by_site[key].append(i)
            inner_of[key].append((path[depth + 1 :], callee[depth + 1 :]) if whole_chain else path[depth + 1])
    return by_site, inner_of


NESTED_COVER = 0.8  # a site inside the best one, with more instances, covering this share of its rows
ALIKE = 4  # a site's instances are blocks when none has more than this many times the rows of the next largest


def _alike(inner: Sequence[Hashable], starts: list[int], cut: bool) -> bool:
    """Whether no instance is more than ``ALIKE`` times the next largest (MobileNetV2's
    ``features`` loop comes round once, at its last layer: a "block" of the stem and seventeen
    inverted residuals, then one of a convolution, is no block). ``cut``: the site's rows end the
    forward's, so the last instance may have been cut short by an out-of-memory error and is
    not compared."""
    counts = np.sort(np.diff([*starts, len(inner)])[: -1 if cut else None])
    return counts.size < 2 or bool(counts[-1] <= ALIKE * counts[-2])


def _best_site(
    by_site: dict[tuple[int, int], list[int]],
    inner_of: dict[tuple[int, int], list[Hashable]],
    whole_chain: bool,
    n_rows: int,
) -> tuple[int, int] | None:
    """The site whose calls cover the most rows (``whole_chain``: make the most instances);
    then, without ``whole_chain``, a site nested in it with more instances that covers most of its
    rows, repeatedly: the blocks, not the stages that hold them (torchvision's Swin-T and
    DenseNet-121 loop over their stages in ``features``, then over each stage's blocks)."""
    found: dict[tuple[int, int], tuple[int, int, int]] = {}
    for key, idx in by_site.items():
        starts = _instances(inner_of[key])
        if len(starts) < 2 or not _alike(inner_of[key], starts, idx[-1] == n_rows - 1):
            continue
        found[key] = (len(starts), len(idx), key[0]) if whole_chain else (len(idx), len(starts), key[0])
    if not found:
        return None
    best_key = max(found, key=lambda k: found[k])
    if whole_chain:
        return best_key
    while True:
        rows = set(by_site[best_key])
        inside = [
            k
            for k, (covered, n_inst, depth) in found.items()
            if depth > best_key[0]
            and n_inst > found[best_key][1]
            and covered >= NESTED_COVER * len(rows)
            and rows.issuperset(by_site[k])
        ]
        if not inside:
            return best_key
        best_key = max(inside, key=lambda k: found[k])


def block_instances(frames: SnapshotFrames, rows: np.ndarray, sids: np.ndarray) -> list[np.ndarray]:
    """The forward's repeated blocks: per instance, the subset of ``rows`` (allocation rows of
    one forward, in order; ``sids`` their stacks) it made. Empty when nothing repeats."""
    info = stack_info(frames)
    for whole_chain in (False, True):
        by_site, inner_of = _sites(info, sids, whole_chain)
        best_key = _best_site(by_site, inner_of, whole_chain, rows.size)
        if best_key is not None:
            members = np.array(by_site[best_key])
            starts = [*_instances(inner_of[best_key]), members.size]
            return [rows[members[a:b]] for a, b in itertools.pairwise(starts)]
    return []
