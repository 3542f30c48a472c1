"""The parallel strategies that would make the recorded batch fit, from ``snaplab plan``.

Each is planned by :mod:`..plan` from the recorded trace (the recorded batch on every GPU, the
model state sharded or split), under the memory limit, and ranked by how much it changes the job:
the optimizer state sharded (ZeRO-1) before the gradients too (ZeRO-2) before the parameters too
(ZeRO-3), before the model's layers split (tensor parallel, then a pipeline); fewer GPUs first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...frames import SnapshotFrames
from .._jobs import Spread, in_turn
from ..plan import Strategy, training_structure
from ..plan.planner import WOULD_IT_FIT_FULL_EVENTS, plan_or_why

WORLD_SIZES = (2, 4, 8)
NO_WHOLE_STEP = (
    "plan replays a recorded whole iteration and this trace ends in the first forward: record a whole step "
    "(at a smaller batch, or without the cap) to plan the parallel strategies"
)
ZERO1_ANY = "ZeRO-1 (optimizer state sharded), over any number of GPUs"
NO_OPTIMIZER_STATE = (
    "not applicable: the trace has no optimizer step, so there is no optimizer state to shard "
    "(ZeRO-2 and ZeRO-3 also shard the gradients and parameters)"
)


@dataclass(frozen=True)
class StrategyOutcome:
    label: str
    strategy: str  # zero1, zero2, zero3, tp, pp
    world_size: int
    peak_allocated_bytes: int  # per GPU, at the recorded batch
    peak_reserved_bytes: int
    fits: bool | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "strategy": self.strategy,
            "world_size": self.world_size,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "fits": self.fits,
        }


# the strategies tried, least change to the job first (the order the answer ranks them in)
_STRATEGIES: dict[str, Callable[[int], Strategy]] = {
    "zero1": lambda n: Strategy("zero1", n),
    "zero2": lambda n: Strategy("fsdp", n, reshard_after_forward=False),
    "zero3": lambda n: Strategy("fsdp", n),
    "tp": lambda n: Strategy("tp", n),
    "pp": lambda n: Strategy("pp", n),
}
CHANGE_ORDER = tuple(_STRATEGIES)


def parallel_strategies(
    frames: SnapshotFrames, device: int, memory_limit: int, complete: bool, spread: Spread = in_turn
) -> tuple[tuple[StrategyOutcome, ...], dict[str, str]]:
    """Every strategy planned at the recorded batch under ``memory_limit`` (ranked by how little
    it changes the job), and those plan refused, with why (``"all"``: none could be planned);
    each plan a replay, computed by ``spread`` (:mod:`.._jobs`)."""
    if not complete:
        return (), {"all": NO_WHOLE_STEP}
    structure = training_structure(frames, device)
    if structure.missing:
        return (), {"all": "; ".join(structure.missing)}
    long = structure.n_events > WOULD_IT_FIT_FULL_EVENTS  # as the report does: 2 GPUs, no pipeline
    refused: dict[str, str] = {}
    tried: list[tuple[str, Strategy]] = []
    for n in WORLD_SIZES[:1] if long else WORLD_SIZES:
        for key in CHANGE_ORDER[:-1] if long else CHANGE_ORDER:
            if key == "zero1" and not structure.steps:
                refused[ZERO1_ANY] = NO_OPTIMIZER_STATE
                continue
            tried.append((key, _STRATEGIES[key](n)))
    out: list[StrategyOutcome] = []
    planned = spread([functools.partial(_planned, frames, key, s, device, memory_limit) for key, s in tried])
    for (_, strategy), outcome in zip(tried, planned, strict=True):
        if isinstance(outcome, str):
            refused[strategy.resolved().label()] = outcome
        else:
            out.append(outcome)
    out.sort(key=lambda o: (CHANGE_ORDER.index(o.strategy), o.world_size))
    return tuple(out), refused


def _planned(
    frames: SnapshotFrames, key: str, strategy: Strategy, device: int, memory_limit: int
) -> StrategyOutcome | str:
    """One strategy planned, or why plan refused it."""
    p = plan_or_why(frames, strategy, device, memory_limit, "memory_limit")
    if isinstance(p, str):
        return p
    fits = p.fits if p.fits is not None else p.peak_reserved_bytes <= memory_limit
    return StrategyOutcome(
        p.strategy.label(), key, strategy.world_size, p.peak_allocated_bytes, p.peak_reserved_bytes, fits
    )
