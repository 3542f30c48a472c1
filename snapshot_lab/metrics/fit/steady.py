"""A run that ran out of memory after its first whole step: the step every later one is
(issue #20).

The first step of a training job makes its optimizer state in ``optimizer.step()``, after the
backward has freed the activations; every later step runs its forward and backward with that
state alive. A job at the edge of its memory often finishes its first step and runs out in its
second (GPT-2, BERT, ViT, GPT-NeoX and OPT each at one more than their largest batch under
6 GiB ran out in their second backward, Llama in its second forward: ``fit_*_late_oom_python``).
Such a trace holds one whole step and a pass cut short. Taken as recorded, the cut pass's
tensors, never freed, were taken for memory that does not grow with the batch, and ``fit``
answered "1x fits" for the batch that failed, "0x" under bf16.

Here the trace is cut after the first whole step, and that step's pass (its inputs, forward and
backward) follows again, as the next step runs it: the state alive throughout, the gradients
made again where the first step's were freed (``zero_grad(set_to_none=True)`` after the step)
and kept where they were not, what the program still held from the first pass (its loss, its
logits) let go once the copy makes its own.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TypeVar

import numpy as np

from ..plan.structure import TrainingStructure
from .evidence import BLOCK_UID_STRIDE, BlockSpan, PassSpan
from .tape import NEVER, Tape

STEADY_NOTE = (
    "the run ran out of memory in its step {failed}, after {done} whole step(s): modelled from the last whole step, "
    "then its pass (inputs, forward and backward) again with the optimizer state alive, as the next step runs it"
)


def ends_after_a_step(s: TrainingStructure) -> bool:
    """The trace ends in an out-of-memory error after its last whole optimizer step."""
    return bool(s.steps and s.ooms and s.passes and s.ooms[-1][0] > s.steps[-1][1])


def steady_step(
    tape: Tape, blocks: tuple[BlockSpan, ...], passes: tuple[PassSpan, ...], s: TrainingStructure
) -> tuple[Tape, tuple[BlockSpan, ...], tuple[PassSpan, ...], str]:
    """The trace cut after its last whole step, and that step's pass again (module docstring)."""
    # the step ends at its last allocation; what it frees after it (its temporaries) is part of it
    step_end = float(s.steps[-1][1])
    later = tape.start[tape.start > step_end]
    cut = float(later.min()) - 0.5 if later.size else step_end
    whole = [i for i, p in enumerate(passes) if p.backward_end <= step_end]
    if not whole:
        return tape, blocks, passes, ""
    k = whole[-1]
    src = s.passes[k]
    kept = tape.select(tape.start <= cut)
    alive = kept.end > cut
    end = np.where(alive, NEVER, kept.end)
    ran = (kept.start >= src.data_start) & (kept.start <= passes[k].backward_end) & (kept.start >= 0)
    ran &= kept.phase.isin(("data", "forward", "backward"))
    ran &= ~((kept.category == "gradient") & alive)  # gradients not freed by the step: reused in place
    shift = cut + 1.0 - float(src.data_start)
    copy_end = np.where(alive[ran], NEVER, end[ran] + shift)
    # what the program still holds from the pass goes once the copy's own is made
    end = np.where(ran & alive, kept.start + shift, end)
    block = kept.block[ran]
    copy = replace(
        kept.select(ran),
        start=kept.start[ran] + shift,
        end=copy_end,
        block=np.where(block >= 0, block + BLOCK_UID_STRIDE, block),
    )
    steady = replace(kept, end=end).with_rows(copy)
    again = tuple(
        replace(_later(b, shift), uid=b.uid + BLOCK_UID_STRIDE) for b in blocks if b.uid // BLOCK_UID_STRIDE == k
    )
    kept_blocks = tuple(b for b in blocks if b.uid // BLOCK_UID_STRIDE <= k)
    note = STEADY_NOTE.format(failed=len(s.steps) + 1, done=len(s.steps))
    return steady, (*kept_blocks, *again), (*passes[: k + 1], _later(passes[k], shift)), note


_Span = TypeVar("_Span", BlockSpan, PassSpan)


def _later(span: _Span, shift: float) -> _Span:
    """The span moved ``shift`` positions later on the tape (its every start and end)."""
    moved = {f.name: getattr(span, f.name) + shift for f in fields(span) if f.name.endswith(("_start", "_end"))}
    return replace(span, **moved)
