"""The levers, each a rewrite of the step's tape.

- checkpointing: every repeated block keeps only its input; what its forward saved for the
  backward is freed when the block's forward ends and made again (the forward re-run) just
  before the block's backward, with the temporaries of that re-run (and the block's output
  again when the block itself saved it: the backward unpacks the re-run's tensors);
- bf16 autocast: what a matrix multiply (Linear, convolution, attention) makes is half as
  large, and so is what torch's other modules make from it (norms of a convolution's output,
  ReLU, pooling); float32 stays what autocast's float32 operations make (softmax, layer norm,
  losses) and the model's own arithmetic (a float32 operand such as the residual stream wins),
  except a layer's float32 input, which the layer saves as a bfloat16 copy (a softmax's result,
  which the softmax saves, stays beside the copy the multiply after it saves); the backward's own
  tensors take the dtype of the forward tensors of their size; the inputs stay; each block's
  Linear and convolution weights get a bfloat16 copy that lives from its forward to its
  backward;
- optimizer swaps: the optimizer state (and the step's temporaries) rescaled to what the other
  optimizer keeps per parameter byte; offload: none of it on the GPU.
"""

from __future__ import annotations

import numpy as np

from .evidence import (
    AUTOCAST_ATTENTION,
    AUTOCAST_FOLLOWS,
    AUTOCAST_FP32,
    AUTOCAST_INTEGER,
    AUTOCAST_MATMUL,
    AUTOCAST_SAVED_FP32,
    KV_CACHE,
    BlockSpan,
    StepEvidence,
)
from .frozen import join_frozen
from .tape import Tape, make_tape

# optimizer state and step temporaries, in parameter bytes (fp32 parameters)
OPTIMIZER_STATE_RATIO = {
    "adamw": 2.0,
    "adamw-fused": 2.0,  # fused=True: one kernel per step, no temporaries (transformers' Trainer's default)
    "adam": 2.0,
    "sgd-momentum": 1.0,
    "sgd": 0.0,
    "8-bit adam": 0.5,
    "adafactor": 0.02,
    "adagrad": 1.0,
    "rmsprop": 1.0,
    "offload": 0.0,
}
STEP_TEMPORARY_RATIO = {"adamw": 1.0, "adam": 1.0, "8-bit adam": 0.25, "adafactor": 0.5, "rmsprop": 1.0}
RECOMPUTE_WINDOW = 0.4  # the re-run forward is placed within the last positions before the block's backward


def _rows_by_block(tape: Tape) -> tuple[np.ndarray, np.ndarray]:
    """The forward rows whose size follows the batch, grouped by block: their blocks' uids
    sorted, and the rows in that order (each block's rows ascending, as a stable sort keeps
    them). One pass over the tape, where one scan per block made checkpointing quadratic."""
    candidates = np.flatnonzero((tape.phase == "forward") & (tape.per_batch > 0))
    order = np.argsort(tape.block[candidates], kind="stable")
    return tape.block[candidates][order], candidates[order]


def _block_rows(tape: Tape, blocks: tuple[BlockSpan, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The forward rows of every block with two or more (:func:`_rows_by_block`), block after
    block in the order of ``blocks``: the rows, and per row the index of its block."""
    uids, grouped = _rows_by_block(tape)
    wanted = np.array([b.uid for b in blocks], dtype=np.int64)
    lo, hi = np.searchsorted(uids, wanted, "left"), np.searchsorted(uids, wanted, "right")
    used = np.flatnonzero(hi - lo >= 2)
    count = (hi - lo)[used]
    first = np.repeat(lo[used] - (np.cumsum(count) - count), count)
    return grouped[first + np.arange(int(count.sum()))], np.repeat(used, count)


def _first_freed(block_of: np.ndarray, end: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per block, the position (into the rows) of its candidate row freed first (the earliest
    row among equals)."""
    at = np.flatnonzero(candidate)
    order = np.lexsort((at, end[at], block_of[at]))
    ranked = at[order]
    return ranked[np.r_[True, block_of[ranked][1:] != block_of[ranked][:-1]]] if ranked.size else ranked


def _output_outside(tape: Tape, f_end: np.ndarray, b_start: np.ndarray) -> np.ndarray:
    """Per block, whether the first forward tensor made after its span belongs to no block and
    lives to the block's backward: the block's output, made by its own forward after its last
    submodule call, which the next block saves (ConvNeXt's CNBlock). Then what the block kept
    inside its span is all saved for its own backward, recomputed under checkpointing."""
    forward = np.flatnonzero(tape.phase == "forward")
    forward = forward[np.argsort(tape.start[forward], kind="stable")]
    after = np.searchsorted(tape.start[forward], f_end, "right")
    found = after < forward.size
    row = forward[np.minimum(after, forward.size - 1)]
    made_before_backward = tape.start[row] < b_start  # not the next pass's first tensor
    return (
        found
        & made_before_backward
        & (tape.block[row] < 0)
        & (tape.end[row] >= b_start - 1.0)
        & (tape.per_batch[row] > 0)
    )


def checkpoint(tape: Tape, blocks: tuple[BlockSpan, ...], frozen_join: bool = False) -> Tape:
    """Activation checkpointing of every repeated block. transformers turns its KV cache off
    under gradient checkpointing: the cache's copies of keys and values are not made.

    The block's output (the next block's input, which the checkpoint keeps) is the first of its
    saved tensors the backward frees: in the next block's backward, or by its own first operation
    (an in-place ReLU saves its result); in that case the re-run forward makes it again (the
    backward unpacks the re-run's tensors: ResNet's bottlenecks), else the re-run stops before it
    (GPT-2's residual add saves nothing). Every block at once, as array operations. A block that
    saved nothing (outside autograd: a fine-tuned model's frozen first layers) has no backward in
    which to re-run its forward, and is left as it is; but ``frozen_join`` (transformers'
    checkpointing, fit/frozen.py) makes it keep its input until its backward, at the backward's end."""
    tape = tape.scaled(tape.category == KV_CACHE, 0.0)
    end = tape.end.copy()
    every = blocks
    blocks = tuple(b for b in blocks if b.saves)
    rows, block_of = _block_rows(tape, blocks)
    f_start, f_end, b_start = (
        np.array([getattr(b, f) for b in blocks], dtype=np.float64).reshape(-1)
        for f in ("forward_start", "forward_end", "backward_start")
    )
    row_end = tape.end[rows]
    kept = row_end > f_end[block_of]
    # a block whose output is made after its last submodule, outside its span (ConvNeXt's
    # ``layer_scale * ...``, then ``+= input``), keeps none of its own tensors for the next block
    kept_inside = kept & ~_output_outside(tape, f_end, b_start)[block_of]
    output = _first_freed(block_of, row_end, kept_inside)
    is_output = np.zeros(rows.size, dtype=bool)
    is_output[output] = True
    saved = kept & ~is_output
    end[rows[saved]] = f_end[block_of[saved]] + 0.5
    rerun = np.ones(rows.size, dtype=bool)
    rerun[output[row_end[output] < b_start[block_of[output]]]] = False
    rows, block_of = rows[rerun], block_of[rerun]
    span = np.maximum(f_end[block_of] - f_start[block_of], 1.0)
    offset = (tape.start[rows] - f_start[block_of]) / span * RECOMPUTE_WINDOW
    start = b_start[block_of] - 0.5 + offset
    life = np.where(
        tape.end[rows] > f_end[block_of],
        tape.end[rows],
        start + np.minimum(tape.end[rows] - tape.start[rows], span) / span * RECOMPUTE_WINDOW,
    )
    out = Tape(
        tape.start, end, tape.fixed, tape.per_batch, tape.category, tape.stream, tape.phase, tape.block, tape.autocast
    )
    if rows.size:
        uid = np.array([b.uid for b in blocks], dtype=np.int64)[block_of]
        recomputed = make_tape(
            start,
            np.maximum(life, start + 1e-6),
            tape.fixed[rows],
            tape.per_batch[rows],
            "activation",
            tape.stream[rows],
            "backward",
            uid,
            tape.autocast[rows],
        )
        out = out.with_rows(recomputed)
    return join_frozen(out, every) if frozen_join else out


def bf16_autocast(tape: Tape, ev: StepEvidence, checkpointed: bool = False) -> Tape:
    """Mixed precision with torch.autocast(dtype=torch.bfloat16), parameters kept in float32.
    A block's weight copies live from its forward to its backward; with the block checkpointed
    (``checkpointed``) they are not kept: freed after its forward, made again by the re-run."""
    made = tape.phase.isin(["forward", "backward"]) & (tape.per_batch > 0)
    cast_inputs = _matmul_inputs(tape)
    half = made & ~np.isin(tape.autocast, [AUTOCAST_FP32, AUTOCAST_SAVED_FP32, AUTOCAST_INTEGER])
    half |= made & cast_inputs
    # a KV cache copies the keys and values in its key's dtype (evidence.allocation_codes): bfloat16
    # where a projection made the key (GPT-2's bf16 recording keeps 144 MiB of them at batch 4 where
    # float32 kept 288), float32 where a rotary embedding's float32 arithmetic did
    half |= made & (tape.category == KV_CACHE) & (tape.autocast != AUTOCAST_FP32)
    half &= ~_float32_gradients(tape, cast_inputs)
    out = tape.scaled(half, 0.5).scaled(_math_kernel_probabilities(tape), 0.0)
    copies = []
    for b in ev.blocks:
        if b.matrix_bytes and checkpointed:
            copies.append((b.forward_start - 0.25, b.forward_end + 0.25, b.matrix_bytes / 2))
            copies.append((b.backward_start - 0.75, b.backward_end + 0.25, b.matrix_bytes / 2))
        elif b.matrix_bytes:
            copies.append((b.forward_start - 0.25, b.backward_end + 0.25, b.matrix_bytes / 2))
    for p in ev.passes:
        if p.outside_matrix_bytes:
            copies.append((p.forward_start - 0.25, p.backward_end - 0.25, p.outside_matrix_bytes / 2))
    arr = np.array(copies, dtype=np.float64).reshape(-1, 3)
    weight_copies = make_tape(arr[:, 0], arr[:, 1], arr[:, 2], np.zeros(len(copies)), "autocast_copy")
    # one concatenation for the three (each copies every column of the whole tape)
    return out.with_rows(weight_copies, _attention_input_casts(tape, made), _saved_result_casts(tape, made))


def _attention_input_casts(tape: Tape, made: np.ndarray) -> Tape:
    """A float32 KV cache's keys and values, cast to bfloat16 for the attention, which saves the
    copies for its backward: half the cache's size, alive as long as it (Phi's and GPT-NeoX's bf16
    recordings save three bfloat16 copies per layer, the query's too, beside the float32 cache)."""
    return _half_copies(tape, np.flatnonzero(made & (tape.category == KV_CACHE) & (tape.autocast == AUTOCAST_FP32)))


def _saved_result_casts(tape: Tape, made: np.ndarray) -> Tape:
    """A softmax's float32 result, which it saves, and the bfloat16 copy the matrix multiply
    after it casts and saves too: half its size, alive as long as it. BLOOM's bf16 recording keeps
    both per layer (its own code casts with ``.to(value.dtype)``; autocast casts Swin-T's in its
    multiply), where the float32 one keeps one tensor and the cast allocates nothing."""
    return _half_copies(tape, np.flatnonzero(made & (tape.autocast == AUTOCAST_SAVED_FP32)))


def _half_copies(tape: Tape, rows: np.ndarray) -> Tape:
    """A bfloat16 copy of each of ``rows`` (float32 tensors), made just after it and alive as long."""
    return make_tape(
        tape.start[rows] + 0.25,
        tape.end[rows],
        tape.fixed[rows] / 2,
        tape.per_batch[rows] / 2,
        "activation",
        tape.stream[rows],
        tape.phase[rows],
        tape.block[rows],
        AUTOCAST_FOLLOWS,
    )


def _math_kernel_probabilities(tape: Tape) -> np.ndarray:
    """What a float32 attention kept that flash attention, which bf16 autocast runs, does not
    make: per block, what the attention call made that is larger than anything the block's
    linear layers made (the probabilities of SDPA's math kernel, batch x heads x tokens squared;
    a kernel without them makes nothing larger than its output, batch x tokens x width, which a
    feed-forward layer's output exceeds). Llama's float32 recording (grouped-query attention: the
    math kernel) keeps 32 MiB of them per layer at batch 2 and its bf16 recording none. A simpler
    rule, the attention's largest tensor when four times its next, dropped ViT's output (its next
    is the 0.08 MiB log-sum-exp): its bf16 went from within 3% to -5%."""
    forward = (tape.phase == "forward") & (tape.per_batch > 0) & (tape.block >= 0)
    attention = np.flatnonzero(forward & (tape.autocast == AUTOCAST_ATTENTION))
    out = np.zeros(len(tape), dtype=bool)
    if not attention.size:
        return out
    matmul = np.flatnonzero(forward & (tape.autocast == AUTOCAST_MATMUL))
    largest = np.full(int(tape.block.max()) + 1, np.inf)  # per block: its linear layers' largest
    largest[np.unique(tape.block[matmul])] = -np.inf
    np.maximum.at(largest, tape.block[matmul], tape.per_batch[matmul])
    out[attention[tape.per_batch[attention] > largest[tape.block[attention]]]] = True
    # and in the backward: a checkpointed block's re-run, an extrapolated backward's tensors of their
    # size (extrapolate._Step._attention_probabilities); larger than any block's linear layers made
    backward = (tape.phase == "backward") & (tape.autocast == AUTOCAST_ATTENTION)
    out |= backward & (tape.per_batch > (tape.per_batch[matmul].max() if matmul.size else np.inf))
    return out


def _float32_gradients(tape: Tape, cast_inputs: np.ndarray) -> np.ndarray:
    """The backward's own tensors (no stack tells what made them) the size of a tensor the
    forward keeps in float32: gradients take the dtype of what they are the gradient of."""
    float32 = np.isin(tape.autocast, [AUTOCAST_FP32, AUTOCAST_SAVED_FP32])
    fwd = (tape.phase == "forward") & float32 & ~cast_inputs & (tape.per_batch > 0)
    sizes = np.unique(tape.per_batch[fwd])
    own = (tape.phase == "backward") & (tape.autocast == AUTOCAST_FOLLOWS) & (tape.block < 0)
    return own & np.isin(tape.per_batch, sizes)


def _matmul_inputs(tape: Tape) -> np.ndarray:
    """Float32 tensors of the forward made just before a matrix multiply's output: that layer's
    input, which autocast casts, so the layer saves a bfloat16 copy and the float32 one goes.
    Tensors a sixty-fourth of the forward's largest or less do not count (a layer norm's mean
    and deviation, made after its output, before the next layer's)."""
    fwd = np.flatnonzero(tape.phase == "forward")
    fwd = fwd[np.argsort(tape.start[fwd], kind="stable")]
    fwd = fwd[tape.per_batch[fwd] * 64 > tape.per_batch[fwd].max(initial=0)]
    code = tape.autocast[fwd]
    before = np.zeros(len(tape), dtype=bool)
    feeds = (code[:-1] == AUTOCAST_FP32) & np.isin(code[1:], [AUTOCAST_MATMUL, AUTOCAST_ATTENTION])
    before[fwd[:-1][feeds]] = True
    return before


def swap_optimizer(tape: Tape, ev: StepEvidence, target: str) -> Tape:
    """The recorded optimizer's state and step temporaries rescaled to ``target``'s."""
    was = OPTIMIZER_STATE_RATIO.get(ev.optimizer, 2.0)
    now = OPTIMIZER_STATE_RATIO[target]
    state = (tape.category == "optimizer_state") & ~np.isfinite(tape.end)
    out = tape.scaled(state, now / was if was else 0.0)
    temp_was = STEP_TEMPORARY_RATIO.get(ev.optimizer, 0.0)
    temp_now = STEP_TEMPORARY_RATIO.get(target, 0.0)
    model = tape.category.isin(["gradient", "parameter"])
    temps = ((tape.phase == "step") | (tape.category == "optimizer_state")) & ~state & ~model
    return out.scaled(temps, temp_now / temp_was if temp_was else 0.0)
