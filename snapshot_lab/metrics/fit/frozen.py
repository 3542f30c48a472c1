"""Fine-tuning: layers whose parameters take no gradient (issue #20).

A fine-tuned model often trains only its last layers: the first ones are frozen, and their input
(the embeddings' output, an image) needs no gradient. Autograd records nothing for them: their
forward saves no tensor for the backward, the backward stops before them, their parameters get
no gradient and no optimizer state, and checkpointing them changes nothing (there is no backward
in which to re-run them).

What a trace shows of it:

- a whole step: a block none of whose forward tensors the backward frees
  (:attr:`.evidence.BlockSpan.saves`, read in :func:`.evidence.block_spans`);
- a forward that ran out of memory: the first blocks keep nothing they made past their forward
  but their output, which the next block reads (:func:`frozen_prefix`). What comes before the last
  of them (the embeddings) is frozen too: had its output needed a gradient, the block would have
  saved what that gradient is computed from.

Under checkpointing that changes where the model is transformers': its
``gradient_checkpointing_enable()`` makes the input embeddings' output require a gradient, so every
block joins autograd, each frozen one keeping its input (as a checkpointed block does) until its
backward, which runs after the trained blocks' at the end of the backward
(:func:`join_frozen`; GPT-2 with its first six blocks frozen keeps all twelve blocks' inputs at
its loss, then re-runs and runs the backward of each frozen block after the trained ones',
``fit_gpt2frozen_b4_ckpt_complete_python``). Each frozen block's re-run and backward are taken as
those of the first trained block (the same layer, with no parameter gradients). torch's own
checkpoint, called on a frozen block whose input needs no gradient (torchvision's ResNet-50 with
its first stages frozen), leaves it out.

A frozen layer after a trained one (LoRA's frozen weights, a frozen block between trained ones)
still saves what the gradient of its input needs: it is not told apart from a trained one by
its forward. Adapters are told by where they are made (:func:`.evidence.adapter_rows`): tensors kept from
after the model is built to the first forward, made by code whose file or function names LoRA,
an adapter or PEFT. Where there are such, only they are trained: the model's own parameters take
no gradient and no optimizer state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from .evidence import BLOCK_UID_STRIDE, BlockSpan
from .tape import Tape

FROZEN_INPUT_REACH = 64  # a frozen block's input is among the last rows outside the blocks made before it

FROZEN_NOTE = (
    "the first {k} of {n} blocks saved nothing for the backward (frozen, their input needing no gradient, as "
    "when fine-tuning the last layers): no backward, gradients or optimizer state for them and the layers "
    "before them, and checkpointing leaves them as they are"
)

ADAPTER_NOTE = (
    "{n} tensors ({size:,} bytes) made after the model and before the forward by LoRA/adapter code: taken as the only "
    "trained parameters (their gradients and optimizer state), the model's own parameters frozen"
)
FROZEN_JOIN_NOTE = (
    "under checkpointing, transformers' gradient_checkpointing_enable() makes the input embeddings' output require "
    "a gradient: the frozen first blocks are checkpointed too, each keeping its input until the end of the backward"
)


def frozen_prefix(saved: Sequence[tuple[str, int, Sequence[int]]]) -> int:
    """How many of the first blocks kept nothing for the backward, given each part of the forward
    as ``(part, block, rows it kept)`` in forward order (``part`` "block" for a block's own rows,
    its output being the "tail"). 0 when none did, or when no block kept anything (a forward
    without autograd at all: inference)."""
    kept = [len(rows) > 0 for part, _, rows in saved if part == "block"]
    k = next((i for i, any_kept in enumerate(kept) if any_kept), len(kept))
    return k if k < len(kept) else 0


def ran_without_autograd(saved: Sequence[tuple[str, int, Sequence[int]]], ran: int) -> bool:
    """Whether none of the first ``ran`` blocks (those the trace holds, ``saved`` as for
    :func:`frozen_prefix`) kept anything for the backward: the forward ran outside autograd.
    ``fit_gpt2infer_b54_oom_python`` (GPT-2 under ``torch.no_grad()``, out in its sixth block):
    taken for a training step, its largest batch was 22 where inference runs 37; its forward is
    extrapolated as inference (extrapolate._Step.end_forward)."""
    kept = [len(rows) > 0 for part, j, rows in saved if part == "block" and j < ran]
    return bool(kept) and not any(kept)


def frozen_parameters(param_block: np.ndarray, k: int) -> np.ndarray:
    """Per parameter, whether it belongs to the first ``k`` blocks or comes before the blocks (the
    embeddings), ``param_block`` giving each parameter's block (-1: outside the blocks)."""
    if k <= 0:
        return np.zeros(param_block.size, dtype=bool)
    inside = np.flatnonzero(param_block >= 0)
    first = int(inside[0]) if inside.size else param_block.size
    before = (param_block < 0) & (np.arange(param_block.size) < first)
    return before | ((param_block >= 0) & (param_block < k))


def join_frozen(tape: Tape, blocks: tuple[BlockSpan, ...]) -> Tape:
    """A checkpointed step (its trained blocks re-run before their backward) with its frozen first
    blocks joining autograd, pass by pass: each keeps its input, then, after the trained blocks'
    backward and in reverse, re-runs and runs the backward of the first trained block (the last
    in the backward; its parameter gradients aside), its input freed at the end of its own.
    What every pass reads of the tape is found once (a 10M-entry trace has thousands of passes)."""
    end = tape.end.copy()
    added: list[Tape] = []
    by_pass: dict[int, list[BlockSpan]] = {}
    for b in blocks:
        by_pass.setdefault(b.uid // BLOCK_UID_STRIDE, []).append(b)
    template = np.flatnonzero((tape.phase == "backward") & (tape.category != "gradient"))
    template_start, starts = tape.start[template], np.sort(tape.start)
    candidates = _input_candidates(tape)
    for uid_pass in sorted(by_pass):
        mine = by_pass[uid_pass]
        frozen = sorted((b for b in mine if not b.saves), key=lambda b: -b.index)  # backward order
        trained = [b for b in mine if b.saves]
        if not frozen or not trained:
            continue
        first = min(trained, key=lambda b: b.index)
        lo, hi = first.backward_start - 0.5, first.backward_end  # its re-run starts half a position early
        rows = template[(template_start >= lo) & (template_start <= hi)]
        later = int(np.searchsorted(starts, hi, "right"))  # the first tensor made after it
        width = ((float(starts[later]) if later < starts.size else hi + 1.0) - hi) / (len(frozen) + 1)
        inputs = _inputs(tape, candidates, tuple(frozen))
        for i in range(len(frozen)):
            slot = hi + width * (i + 0.5)
            start = slot + (tape.start[rows] - lo) / max(hi - lo, 1.0) * width * 0.5
            # what the template keeps past its backward (its input's gradient) lives into the next slot
            inside = tape.end[rows] <= hi
            stop = np.where(
                inside,
                slot + (np.minimum(tape.end[rows], hi) - lo) / max(hi - lo, 1.0) * width * 0.5,
                slot + width * 1.5,
            )
            added.append(_moved(tape.select(rows), start, np.maximum(stop, start + 1e-6)))
            if inputs[i] >= 0:
                end[inputs[i]] = slot + width * 0.75
    return replace(tape, end=end).with_rows(*added)


def _moved(rows: Tape, start: np.ndarray, end: np.ndarray) -> Tape:
    """``rows`` made again at ``start`` and freed at ``end``, in no block."""
    return replace(rows, start=start, end=end, block=np.full(start.size, -1, dtype=np.int64))


def _input_candidates(tape: Tape) -> np.ndarray:
    """Rows that may be a frozen block's input (made in the forward, outside the blocks, growing
    with the batch), by when they are made."""
    cand = np.flatnonzero((tape.phase == "forward") & (tape.block < 0) & (tape.per_batch > 0))
    return cand[np.argsort(tape.start[cand], kind="stable")]


def _inputs(tape: Tape, cand: np.ndarray, frozen: tuple[BlockSpan, ...]) -> list[int]:
    """Per frozen block, the row of its input (-1: not found): the last tensor made outside the
    blocks (the embeddings' sum, the previous block's output) before the block starts and alive
    when it does (``cand``: :func:`_input_candidates`)."""
    out = []
    for b in frozen:
        before = cand[: np.searchsorted(tape.start[cand], b.forward_start, "left")][-FROZEN_INPUT_REACH:]
        alive = before[tape.end[before] >= b.forward_start]
        out.append(int(alive[-1]) if alive.size else -1)
    return out
