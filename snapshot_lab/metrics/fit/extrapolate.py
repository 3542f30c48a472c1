"""A whole training step built from a trace that ran out of memory before its first step
completed (the most common ticket).

What the trace shows is kept: the model's construction, the input, the forward up to the
failure. The rest is extrapolated from it:

- the forward's remaining blocks: as many as the parameters repeat (the model's layers, counted
  from the repeat in the parameters' sizes and stacks, :func:`parameter_repeat`), each a copy
  of the last whole block the forward completed, its tail included (what it makes after its
  last submodule, up to the next block: the residual add, the block's output);
- the layers after the blocks, when the forward did not reach them: a final norm and a linear
  head the size of the parameter matrix after the blocks (or, without one, of the embedding:
  weights tied), their output kept by the program (the logits) and a log-softmax of it saved by
  the loss; the logits are per token (vocabulary / width times the stream the last block's
  first norm makes) for a language model's head (tied, or the size of an embedding before the
  blocks), none for a classifier's, which reads one pooled vector per sample;
- the backward: in reverse, a gradient the size of every tensor a part made (two alive at a time,
  a third being made); a saved tensor is freed once its gradient is made (what an operation
  saved of its input), or once the gradient after it is made (what a result-saving functional
  made: a softmax, the loss's log-softmax); a block's output goes before the block's backward
  (the next block, which saved it, is done); each part's parameter gradients (P in all) are made
  when its backward runs;
- the optimizer: its state (from the optimizer named in the stacks, else the one assumed) is
  made by the first step, per parameter as torch makes it (tensors its size: AdamW's two), and
  kept; every step's temporaries are made after the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ...frames import SnapshotFrames
from ..categories import CODES
from ..plan.structure import TrainingStructure
from . import convnet
from .blocks import block_instances
from .evidence import (
    AUTOCAST_ATTENTION,
    AUTOCAST_FOLLOWS,
    AUTOCAST_FP32,
    AUTOCAST_MATMUL,
    BLOCK_UID_STRIDE,
    KV_CACHE,
    BlockSpan,
    PassSpan,
    adapter_rows,
    allocation_codes,
    autocast_copied,
    forward_weight_copies,
    kv_cache_stacks,
    lightning_closure_in_stacks,
    parameter_repeat,
    stack_innermost,
)
from .frozen import ADAPTER_NOTE, FROZEN_NOTE, frozen_parameters, frozen_prefix, ran_without_autograd
from .precision import UPCAST_RATIO, sizes_matches, sizes_say_half, upcasts
from .tape import NEVER, Tape, empty_tape, make_tape

PARAM_KEY = 1_000_003
NO_WHOLE_BLOCK = (
    "the forward ran out of memory before its first repeated block completed: there is no block to extrapolate the "
    "rest of the model from (record at a smaller batch, or under a larger limit, so that one block completes)"
)

MORE_THAN_ONE_STACK = (
    "the model's parameters are more than one stack of repeated blocks between an embedding and a head: {before} "
    "parameters before its {count} repeated blocks and {after} after, where one block has {period} (a second stack, "
    "such as an encoder-decoder's, or stages of differing blocks, such as EfficientNet's): what the blocks the forward "
    "did not reach make cannot be copied from the ones it ran (record at a smaller batch, or under a larger limit, so "
    "that one whole step completes)"
)


def one_stack(pf: PartialForward) -> str:
    """ "" where the parameters are one run of repeated blocks between a few before (embeddings) and
    after (a final norm, a head), each fewer than a block's; else why the rest of the model cannot
    be extrapolated. GPT-2, ViT, Llama and BERT have 1 to 7 before and 2 to 6 after, a block 9 to 16;
    T5 has its encoder's 56 before its decoder's blocks, EfficientNet-B0 259 before its longest run
    of alike blocks and 35 after: copying the blocks they ran gave -37% and +600% (their OOMs)."""
    in_blocks = np.flatnonzero(pf.param_block >= 0)
    if not in_blocks.size:
        return ""
    period = int((pf.param_block == 0).sum())
    before, after = int(in_blocks[0]), int(pf.param_block.size - 1 - in_blocks[-1])
    if max(before, after) <= period:
        return ""
    count = int(pf.param_block.max()) + 1
    return MORE_THAN_ONE_STACK.format(before=before, after=after, count=count, period=period)


class FitUnsupportedStep(ValueError):
    """The trace shows too little of the step to extrapolate it."""


# functionals whose backward needs their result, which they save: what they make is freed after the
# gradient of their input (the others' outputs are saved by the operation they feed, as its input)
RESULT_SAVING_OPS = ("relu", "relu_", "threshold", "softmax", "log_softmax", "sigmoid", "tanh", "hardtanh", "elu")
PASSES = 2  # the first step makes the optimizer state; the second runs with it
GRADIENTS_ALIVE = 3  # a synthesized convnet block's: its output gradient, its input's, one temporary
# cuBLAS's workspaces, made by the first matrix multiply of each thread (torch's default on a Hopper GPU,
# as every complete recording shows: 32 MiB and cuBLASLt's 1 MiB in the forward, 32 MiB in the backward)
CUBLAS_WORKSPACE = 32 << 20
CUBLASLT_WORKSPACE = 1 << 20
HEAD_WORKSPACE_ASSUMED = (
    "no matrix multiply ran before the failure: the linear head makes cuBLAS's workspaces when it first runs, "
    "taken as torch's default on a Hopper GPU (32 MiB for the forward's thread and 1 MiB for cuBLASLt, 32 MiB for "
    "the backward's thread)"
)
INFERENCE_HEAD_ASSUMED = (
    "the forward did not reach the layers after the blocks: taken as a final norm and a linear head {head} reading "
    "{reads}, making {ratio:.1f}x the residual stream (the logits, returned: alive to the forward's end)"
)
INFERENCE_EXTRAPOLATED = (
    "the trace ends in the first forward, which ran without autograd: every block it completed kept nothing but its "
    "output and its KV cache (inference under torch.no_grad(), or a model frozen up to where it failed: if later "
    "layers train, record a step that completes); the rest of the forward is extrapolated ({layers} repeated blocks, "
    "counted from the parameters; {ran} ran), each block's KV cache alive to the forward's end, then a second forward "
    "as the first"
)
LIGHTNING_ZERO_GRAD = (
    "Lightning's automatic optimization runs the forward in the optimizer's step closure and zeroes the gradients "
    "there, after the forward: a step's gradients are alive through the next forward"
)
HEAD_ASSUMED = (
    "the forward did not reach the layers after the blocks: taken as a final norm, a linear head {head} reading "
    "{reads}, making {ratio:.1f}x the residual stream (the logits, freed once the loss has them) and a "
    "cross-entropy loss that saves its log-softmax"
)


@dataclass
class _Builder:
    """Rows of the synthesized step, on a fresh time line (ticks)."""

    rows: list[tuple[float, float, float, float, str, str, int, int]] = field(default_factory=list)
    now: float = 0.0

    def add(
        self,
        start: float,
        end: float,
        fixed: float,
        per_batch: float,
        cat: str,
        phase: str,
        block: int = -1,
        fp32: int = 0,
    ) -> int:
        self.rows.append((start, end, fixed, per_batch, cat, phase, block, fp32))
        return len(self.rows) - 1

    def set_end(self, row: int, end: float) -> None:
        r = self.rows[row]
        self.rows[row] = (r[0], end, *r[2:])

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def tape(self) -> Tape:
        if not self.rows:
            return empty_tape()
        cols = list(zip(*self.rows, strict=True))
        return make_tape(
            np.array(cols[0]),
            np.array(cols[1]),
            np.array(cols[2]),
            np.array(cols[3]),
            np.array(cols[4], dtype=object),
            0,
            np.array(cols[5], dtype=object),
            np.array(cols[6], dtype=np.int64),
            np.array(cols[7], dtype=np.int8),
        )


@dataclass(frozen=True)
class PartialForward:
    """What the trace shows of the first forward."""

    forward_start: int  # position
    pre: np.ndarray  # rows before the first block (embeddings); data rows before the forward too
    data: np.ndarray
    blocks: tuple[np.ndarray, ...]  # rows of each whole block seen
    after: np.ndarray  # rows after the last whole block (a block cut short, or the head)
    layers: int  # blocks the model has
    params: np.ndarray  # parameter rows, in order
    param_block: np.ndarray  # per parameter: its block (-1: outside)
    tails: tuple[np.ndarray, ...] = ()  # per whole block: rows after its last submodule, before the next block
    adapters: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # LoRA's (fit/frozen.py)


def partial_forward(frames: SnapshotFrames, s: TrainingStructure) -> PartialForward | None:
    """The first forward as far as the trace goes (None: no forward in it)."""
    a = s.allocs
    pos = a["pos"].to_numpy()
    main, module = a["main"].to_numpy(), a["module"].to_numpy()
    code = a["code"].to_numpy()
    in_fwd = np.flatnonzero(main & module)
    if in_fwd.size == 0:
        return None
    f0 = int(pos[in_fwd[0]])
    is_param = code == CODES["parameter"]
    params = np.flatnonzero(is_param & (pos < f0))
    # adapters (fit/frozen.py): parameters when moved with Module.to (PEFT's), else kept tensors
    adapter = adapter_rows(frames, a["sid"].to_numpy()[params])
    params, adapters = params[~adapter], params[adapter]
    data = np.flatnonzero((pos < f0) & ~is_param & (pos > (pos[params].max() if params.size else -1)))
    adapter = (a["free_pos"].to_numpy()[data] < 0) & adapter_rows(frames, a["sid"].to_numpy()[data])
    data, adapters = data[~adapter], np.sort(np.concatenate([adapters, data[adapter]]))
    fwd = np.flatnonzero(pos >= f0)
    mod_rows = fwd[main[fwd] & module[fwd]]
    found = block_instances(frames, mod_rows, a["sid"].to_numpy()[mod_rows])
    keys = a["size"].to_numpy()[params] * PARAM_KEY + a["sid"].to_numpy()[params]
    p_period, p_start, p_count = parameter_repeat(keys)
    param_block = np.full(params.size, -1, dtype=np.int64)
    if p_count >= 2:
        for j in range(p_count):
            param_block[p_start + j * p_period : p_start + (j + 1) * p_period] = j
    if not found:
        none = np.zeros(0, dtype=np.int64)
        return PartialForward(f0, fwd, data, (), none, max(p_count, 0), params, param_block, (), adapters)
    spans = [(int(pos[r[0]]), int(pos[r[-1]])) for r in found]
    blocks = [fwd[(pos[fwd] >= lo) & (pos[fwd] <= hi) & main[fwd]] for lo, hi in spans]
    # what a block makes in its own forward after its last submodule (ViT's and GPT-2's
    # residual add: the block's output, which the next block saves), up to the next block
    nexts = [lo for lo, _ in spans[1:]]
    tails = [fwd[(pos[fwd] > hi) & (pos[fwd] < nxt) & main[fwd]] for (_, hi), nxt in zip(spans, nexts, strict=False)]
    after = fwd[pos[fwd] > spans[-1][1]]
    # the forward ran past the blocks when something outside them followed the last one
    past = bool(np.isin(after, mod_rows).any())
    whole = tuple(blocks if past else blocks[:-1])
    tails.append(np.zeros(0, dtype=np.int64))  # the last block's: in what follows it (after)
    pre = fwd[pos[fwd] < spans[0][0]]
    return PartialForward(
        f0,
        pre,
        data,
        whole,
        after if past else np.zeros(0, dtype=np.int64),
        max(p_count, len(blocks)),
        params,
        param_block,
        tuple(tails[: len(whole)]),
        adapters,
    )


@dataclass(frozen=True)
class Extrapolated:
    tape: Tape
    blocks: tuple[BlockSpan, ...]
    passes: tuple[PassSpan, ...]
    notes: tuple[str, ...]
    forward_only: bool = False  # a forward without autograd (inference): no backward, no step


class _Step:
    """Synthesize the step on a fresh time line."""

    # a node makes its input's gradient while its output's is alive (and the residual stream's waits)
    gradients_alive = 2
    # a saved tensor goes with its gradient: its consumer saved it as an input (a linear layer's, a
    # GELU's), and frees it once it has made its gradient; a result-saving functional's output
    # (RESULT_SAVING_OPS, the loss's log-softmax) goes after the gradient after its own
    frees_inputs_first = True

    def __init__(self, frames: SnapshotFrames, s: TrainingStructure, pf: PartialForward) -> None:
        self.s, self.pf, self.b = s, pf, _Builder()
        a = s.allocs
        self.size = a["size"].to_numpy(dtype=np.float64)
        self.sid = a["sid"].to_numpy()
        self.pos = a["pos"].to_numpy()
        self.free_pos = a["free_pos"].to_numpy()
        self.sorted_pos = np.sort(self.pos)
        self.autocast = allocation_codes(frames, s)
        self.kv_cache = kv_cache_stacks(frames)
        self.p_size = self.size[pf.params]
        largest = self.p_size.max(initial=0)
        self.castable = autocast_copied(frames, self.sid[pf.params], self.p_size, self.p_size * 64 >= largest)
        self.notes: list[str] = []
        self.saved: list[tuple[str, int, list[int]]] = []  # (part, block, rows of the builder), forward order
        self.spans: list[list[float]] = []
        self.pass_index = 0
        self.grads: list[int] = []  # this pass's parameter gradients and inputs: freed by zero_grad
        self.block_spans: list[BlockSpan] = []
        self.pass_spans: list[PassSpan] = []
        self.tied_head = 0.0
        self.transients: dict[tuple[str, int], list[int]] = {}  # what each part's forward made and freed
        self.one_off = self.workspace_rows()
        inner = stack_innermost(frames)
        self.result_sids = set(inner.index[inner["name"].isin(RESULT_SAVING_OPS)].tolist())
        self.result_saved: set[int] = set()  # builder rows an operation saved as its result
        # autocast's copies of the weights: the same size whatever the batch (fit/weight_copies.py)
        self.weight_copy = forward_weight_copies(frames, s)
        self.copies: set[int] = set()  # builder rows that are weight copies
        # Lightning zeroes the gradients in its closure, before the next backward, not after the step
        self.zero_grad_before_backward = lightning_closure_in_stacks(frames)
        self.stale_grads: list[int] = []  # the last step's gradients, alive through this forward
        if self.zero_grad_before_backward:
            self.notes.append(LIGHTNING_ZERO_GRAD)
        self.frozen_blocks = 0  # the first blocks outside autograd (fit/frozen.py)
        self.no_autograd = False  # no block the trace holds kept anything for a backward: inference
        self.head_input = -1  # the final norm's output of an inference forward (its row)
        self.trained = np.ones(self.p_size.size, dtype=bool)  # parameters that take a gradient
        # LoRA's adapters: where there are any, the only trained parameters
        self.adapters = self.size[pf.adapters]
        if self.adapters.size:
            self.notes.append(ADAPTER_NOTE.format(n=self.adapters.size, size=int(self.adapters.sum())))

    def copy_rows(self, rows: np.ndarray, part: str, block: int, workspace: np.ndarray | None = None) -> list[int]:
        """Recorded forward rows placed from now on: those freed in the trace keep their
        lifetime; those alive at the failure are saved for the backward."""
        b = self.b
        if rows.size == 0:
            return []
        base = self.pos[rows[0]]
        t0 = b.now + 1
        kept = []
        for r in rows.tolist():
            start = t0 + (self.pos[r] - base)
            fp32 = int(self.autocast[r])
            if workspace is not None and workspace[r]:
                b.add(start, NEVER, self.size[r], 0.0, "workspace", "forward")
                continue
            copy = bool(self.weight_copy[r])
            fixed, per_batch = (self.size[r], 0.0) if copy else (0.0, self.size[r])
            if self.free_pos[r] >= 0:
                cat = KV_CACHE if int(self.sid[r]) in self.kv_cache else "activation"
                k = b.add(start, t0 + (self.free_pos[r] - base), fixed, per_batch, cat, "forward", block, fp32)
                self.transients.setdefault((part, block), []).append(k)
            elif workspace is None and part == "block" and self.one_off[r]:
                continue  # a one-off cache of the first pass: made once
            else:
                cat = KV_CACHE if int(self.sid[r]) in self.kv_cache else "activation"
                kept.append(b.add(start, NEVER, fixed, per_batch, cat, "forward", block, fp32))
                if int(self.sid[r]) in self.result_sids:
                    self.result_saved.add(kept[-1])
                if copy:
                    self.copies.add(kept[-1])
        b.now = t0 + float(self.closing(rows) - base) + 1
        return kept

    def closing(self, rows: np.ndarray) -> int:
        """Where these rows' part ends on the trace: its last allocation, or the last free of one of
        its temporaries before the next allocation (a block's last temporary, freed by its residual
        add, belongs to the block)."""
        last = int(self.pos[rows].max())
        later = self.sorted_pos[np.searchsorted(self.sorted_pos, last, "right") :]
        following = int(later[0]) if later.size else np.iinfo(np.int64).max
        freed = self.free_pos[rows]
        return max(last, int(freed[(freed > last) & (freed < following)].max(initial=last)))

    # ------------------------------------------------------------------ forward

    def model_state(self) -> None:
        """Parameters and memory older than the trace."""
        b = self.b
        for n in [*self.p_size.tolist(), *self.adapters.tolist()]:
            b.add(-2.0, NEVER, n, 0.0, "parameter", "setup")
        for n, cat, _ in self.s.untracked:
            b.add(-2.0, NEVER, float(n), 0.0, "parameter" if cat == "parameter" else "workspace", "setup")

    def inputs(self) -> None:
        """The batch, copied to the GPU (a temporary freed before the forward, if the trace says so)."""
        b = self.b
        for r in self.pf.data.tolist():
            t = b.tick()
            kept = self.free_pos[r] < 0
            row = b.add(t, NEVER if kept else t + 0.5, 0.0, self.size[r], "input", "data")
            if kept:
                self.grads.append(row)

    def workspace_rows(self) -> np.ndarray:
        """Kept allocations of the first block that the next block does not make again: one-off
        caches (cuBLAS's workspace), not activations. Either no later allocation shares its stack,
        or (with python stacks, the workspace has the stack of the linear layer that made it) the
        first block kept more tensors of its size than the second did: the first of them."""
        out = np.zeros(self.size.size, dtype=bool)
        if not self.pf.blocks:
            return out
        first = self.pf.blocks[0]
        out[first[self.lone_rows(first)]] = True
        kept_first = first[self.free_pos[first] < 0]
        if len(self.pf.blocks) >= 2:
            later = self.size[self.pf.blocks[1][self.free_pos[self.pf.blocks[1]] < 0]].tolist()
            for r in kept_first.tolist():
                if self.size[r] in later:
                    later.remove(self.size[r])
                else:
                    out[r] = True
            return out
        # one block ran (GPT-2's OOM): against what ran of the second, as far as it got, a size
        # the second never kept (its counts are partial: the failure cut them short)
        done = np.concatenate([first, *self.pf.tails[:1]])
        partial = np.flatnonzero(self.pos > self.pos[done].max())
        again = self.size[partial[self.free_pos[partial] < 0]]
        # only as far as the second got: what the first made after that point, the second never
        # tried (Qwen2's attention weights, 1.5 GiB at batch 32, were the request that failed)
        rank = np.argsort(np.argsort(self.pos[first], kind="stable"), kind="stable")
        reached = first[rank < partial.size]
        compared = reached[self.free_pos[reached] < 0]
        out[compared[~np.isin(self.size[compared], again)]] = True
        return out

    def backward_workspace(self) -> float:
        """The backward's own cuBLAS workspace: autograd runs the backward in a thread of its own,
        whose handle makes one as large as the forward's largest (every complete recording shows
        the pair: 32 MiB in the forward, 32 MiB in the backward on the H100); none when the forward
        showed none."""
        return float(self.size[self.one_off].max(initial=0.0))

    def lone_rows(self, rows: np.ndarray) -> np.ndarray:
        """Kept allocations of the first block whose stacks nothing else in the forward repeats,
        among as many of its first allocations as the forward made after it: a second block cut
        short by the failure repeats no more than that (Qwen2's and Gemma's OOMs, out early in
        their second block, had every later tensor of their first block taken for a one-off
        workspace, 4.4 GiB that no batch changed)."""
        later = np.flatnonzero(self.pos > self.pos[rows].max())
        reached = np.argsort(np.argsort(self.pos[rows], kind="stable"), kind="stable") < later.size
        return (self.free_pos[rows] < 0) & ~np.isin(self.sid[rows], self.sid[later]) & reached

    def forward(self) -> None:
        pf = self.pf
        self.saved, self.spans = [], []
        self.transients = {k: v for k, v in self.transients.items() if k[0] == "block"}  # this pass's own
        self.saved.append(("pre", -1, self.copy_rows(pf.pre, "pre", -1)))
        workspace = self.workspace_rows()
        none = np.zeros(0, dtype=np.int64)
        template = pf.blocks[-1] if pf.blocks else none
        if len(pf.blocks) == 1:  # the first block's one-off allocations (a workspace) are not repeated
            template = template[~self.lone_rows(template) & ~self.one_off[template]]
        template_tail = pf.tails[-1] if pf.tails else none
        for j in range(pf.layers if pf.blocks else 0):
            rows, tail = (pf.blocks[j], pf.tails[j]) if j < len(pf.blocks) else (template, template_tail)
            start = self.b.now + 1
            uid = self.pass_index * BLOCK_UID_STRIDE + j
            first_pass = workspace if self.pass_index == 0 else None
            made = len(self.b.rows)
            kept = self.copy_rows(np.concatenate([rows, tail]), "block", uid, first_pass)
            # the tail (the block's output) is saved by what follows: freed by its backward
            tail_start = start + float(self.pos[tail[0]] - self.pos[rows[0]]) if tail.size and rows.size else NEVER
            forward_end = self.b.now
            if tail_start < NEVER:
                # outside the block, as in a recorded step (the block's forward ends at its last
                # submodule): checkpointing frees what the block saved before its output is made
                forward_end = start + float(self.pos[rows[-1]] - self.pos[rows[0]]) + 0.25
                for k in range(made, len(self.b.rows)):
                    if self.b.rows[k][0] >= tail_start:
                        self.b.rows[k] = (*self.b.rows[k][:6], -1, self.b.rows[k][7])
            self.spans.append([start, forward_end, 0.0, 0.0])
            self.saved.append(("block", j, [k for k in kept if self.b.rows[k][0] < tail_start]))
            self.saved.append(("tail", j, [k for k in kept if self.b.rows[k][0] >= tail_start]))
        if len(pf.blocks) < pf.layers:
            k, n = len(pf.blocks), pf.layers
            copies = f"block {k} is a copy" if k == n - 1 else f"blocks {k}–{n - 1} are copies"
            self.notes.append(f"the forward failed in block {k} of {n}: {copies} of the last whole block it ran")
        if self.pass_index == 0:  # every block the trace holds kept nothing for a backward: inference
            self.no_autograd = ran_without_autograd(self.kept_for_backward(), len(pf.blocks))
        if len(pf.blocks) >= pf.layers and pf.after.size:
            kept = self.copy_rows(pf.after, "post", -1)
            for _, req, _ in self.s.ooms[-1:]:
                kept.append(self.b.add(self.b.tick(), NEVER, 0.0, float(req), "activation", "forward"))
            self.saved.append(("post", -1, kept))
        elif self.no_autograd:
            self.inference_head()
        else:
            self.head()

    def kept_for_backward(self) -> list[tuple[str, int, list[int]]]:
        """What each part of this pass's forward kept, as :attr:`saved`, but its KV cache:
        transformers' cache keeps its keys and values whether or not autograd does."""
        return [(part, j, [r for r in rows if self.b.rows[r][4] != KV_CACHE]) for part, j, rows in self.saved]

    def model_width(self) -> float:
        """Bytes per token of the blocks' width: the commonest size of the first block's
        vectors (norm weights and biases)."""
        first = self.p_size[self.pf.param_block == 0]
        vectors = first[first * 64 < first.max(initial=0)]
        if not vectors.size:
            return 0.0
        sizes, counts = np.unique(vectors, return_counts=True)
        return float(sizes[np.argmax(counts)])

    def _first_block_param(self) -> int:
        """How many parameters come before the first block's (the embeddings)."""
        inside = np.flatnonzero(self.pf.param_block >= 0)
        return int(inside[0]) if inside.size else 0

    def upcast(self) -> float:
        """2 where every whole block the forward ran first made a tensor twice its last (a norm's
        float32 copy of a half-precision stream: fit/precision.py), else 1."""
        size = self.s.allocs["size"].to_numpy()
        ratios = [size[rows[0]] / size[rows[-1]] for rows in self.pf.blocks if rows.size and size[rows[-1]]]
        return UPCAST_RATIO if upcasts(ratios) else 1.0

    def head_matrix(self) -> tuple[float, bool]:
        """The linear head's weight: the matrix after the blocks, or (none) the embedding's, tied."""
        pb = self.pf.param_block
        inside = np.flatnonzero(pb >= 0)
        after = np.flatnonzero((pb < 0) & (np.arange(pb.size) > (inside.max() if inside.size else pb.size)))
        embeddings = self.p_size[pb < 0][: self._first_block_param()]
        width = self.model_width()
        if after.size and width:
            # a decoder tied to the embedding with a bias of its own (BERT's masked-LM head, after a
            # transform as wide as the blocks): a vector after the blocks wider than the model has
            # one value per row of an embedding (4- or 2-byte values, as the width's); ViT's class
            # token, as wide as the model, matches its patch embedding that way and is no bias
            sizes = self.p_size[after]
            for rows in sizes[(sizes > width) & (sizes * 64 < self.p_size.max(initial=0))][::-1]:
                tied_to = embeddings[np.isin(embeddings, [rows * width / 4, rows * width / 2])]
                if tied_to.size:
                    return float(tied_to[0]), True
        mats = self.p_size[after][self.p_size[after] * 64 >= self.p_size.max(initial=0)]
        if mats.size:  # the last (a position embedding may come before it)
            return float(mats[-1]), False
        return float(self.p_size.max(initial=0)), True

    def head(self) -> None:
        """The layers after the blocks, not reached: final norm, linear head, loss."""
        b = self.b
        if not self.pf.blocks:
            return
        stream, logits, matrix, tied, per_token, half = self._head_sizes()
        kept = [b.add(b.tick(), NEVER, 0.0, stream, "activation", "forward", fp32=AUTOCAST_FP32)]  # final norm
        # a half-precision head's output (half precision, or autocast's), half the float32 logits
        # the loss casts it to (a float32 model's cast makes nothing)
        own = b.add(b.tick(), NEVER, 0.0, logits / 2, "activation", "forward") if half and logits else None
        made = b.add(b.tick(), NEVER, 0.0, logits, "activation", "forward", fp32=AUTOCAST_MATMUL)
        self.transients.setdefault(("post", -1), []).append(made)  # its gradient: the log-softmax's backward
        kept.append(b.add(b.tick(), NEVER, 0.0, logits, "activation", "forward", fp32=AUTOCAST_FP32))  # log-softmax
        self.result_saved.add(kept[-1])
        b.set_end(made, b.tick())  # the logits: once the loss has its log-softmax
        if own is not None:
            b.set_end(own, b.tick())
        b.add(b.tick(), NEVER, 4.0, 0.0, "activation", "forward")  # the loss
        self.saved.append(("post", -1, kept))
        self.notes.append(
            HEAD_ASSUMED.format(
                head="tied to the embedding" if tied else f"of {int(matrix):,} bytes",
                ratio=logits / max(stream, 1),
                reads="every token's output" if per_token else "one pooled vector per sample",
            )
        )

    def inference_head(self) -> None:
        """The layers after the blocks, not reached by a forward without autograd: a final norm,
        freed once the head has read it, and the logits the model returns (half precision where
        the model is), alive to the forward's end."""
        b = self.b
        if not self.pf.blocks:
            return
        stream, logits, matrix, tied, per_token, half = self._head_sizes()
        norm = b.add(b.tick(), NEVER, 0.0, stream, "activation", "forward", fp32=AUTOCAST_FP32)
        self.head_input = norm
        b.add(b.tick(), NEVER, 0.0, logits / 2 if half else logits, "activation", "forward", fp32=AUTOCAST_MATMUL)
        b.set_end(norm, b.tick())
        self.notes.append(
            INFERENCE_HEAD_ASSUMED.format(
                head="tied to the embedding" if tied else f"of {int(matrix):,} bytes",
                ratio=logits / max(stream, 1),
                reads="every token's output" if per_token else "one pooled vector per sample",
            )
        )

    def _head_sizes(self) -> tuple[float, float, float, bool, bool, bool]:
        """The head's sizes at the recorded batch, from the last whole block and the parameters:
        the stream (the final norm's output), the float32 logits, the head's matrix, whether it is
        tied to the embedding, whether it reads every token, whether it runs in half precision."""
        b = self.b
        j, last_block = next((j, rows) for part, j, rows in reversed(self.saved) if part == "block")
        if self.no_autograd:  # it kept its KV cache alone, narrower than the stream where grouped: what it made
            made = self.transients.get(("block", self.pass_index * BLOCK_UID_STRIDE + j), [])
            last_block = sorted(made, key=lambda row: b.rows[row][0])
        # a block's first output: a norm of its input; a norm's per-token statistics (RMSNorm's
        # variance, Llama's first saved tensor) are a sixty-fourth of the block's largest or less
        sizes = [b.rows[row][3] for row in last_block]
        stream = next((size for size in sizes if size * 64 > max(sizes)), 0.0)
        width = self.model_width()
        matrix, tied = self.head_matrix()
        # a language model's head predicts a token per position (its matrix the embedding's size, or
        # the embedding itself); a classifier's reads one pooled vector per sample (ViT's class
        # token): its logits are a token's worth of the stream or less, taken as none
        per_token = tied or bool(np.isin(matrix, self.p_size[self.pf.param_block < 0][: self._first_block_param()]))
        # a half-precision model's norm may save a float32 copy of the stream, twice its size: the
        # tokens are counted from the stream itself (fit/precision.py); a float32 model under
        # autocast (its weights copied) keeps a float32 stream, whose blocks end on a half-precision
        # tensor all the same: its stream is no copy
        autocast = bool(self.weight_copy.any())
        upcast = 1.0 if autocast else self.upcast()
        logits = stream / upcast * matrix * 4 / width**2 if width and per_token else 0.0
        self.tied_head = matrix if tied else 0.0
        half = autocast or upcast > 1 or sizes_say_half(sizes_matches(self.p_size))
        return stream, logits, matrix, tied, per_token, half

    # ------------------------------------------------------------------ backward and step

    def backward(self) -> float:
        """Every part in reverse; returns where the backward began."""
        b, pf = self.b, self.pf
        start = b.now + 1
        alive: list[int] = []  # gradients of activations, oldest first
        pending = -1  # the saved tensor whose gradient was made last
        to_block_end: list[int] = []  # saved attention probabilities: freed as their block's backward ends
        spans = {j: sp for j, sp in enumerate(self.spans)}
        for r in self.stale_grads:  # Lightning's zero_grad, in its closure before the backward
            b.set_end(r, start)
        self.stale_grads = []
        workspace = self.backward_workspace() if self.pass_index == 0 else 0.0
        if workspace:
            b.add(b.tick(), NEVER, workspace, 0.0, "workspace", "backward")
        kept = self.kept_for_backward()
        self.frozen_blocks = k = frozen_prefix(kept)
        self.trained = ~frozen_parameters(pf.param_block, k) & (self.adapters.size == 0)
        for n in self.adapters.tolist():  # tiny: made together, as the backward begins
            self.grads.append(b.add(b.tick(), NEVER, n, 0.0, "gradient", "backward"))
        if k:
            self.notes.append(FROZEN_NOTE.format(k=k, n=pf.layers))
        for part, j, rows in reversed(self.saved):
            if k and (part == "pre" or (part in ("block", "tail") and j < k)):  # where autograd's graph begins
                break
            if part == "block" and j in spans:
                spans[j][2] = b.now + 1
            owned = (pf.param_block == j if part == "block" else self._outside(part)) & self.trained
            for n in self.p_size[owned].tolist():
                self.grads.append(b.add(b.tick(), NEVER, n, 0.0, "gradient", "backward"))
            saved = set(rows)
            uid = self.pass_index * BLOCK_UID_STRIDE + j if part == "block" else -1
            made = [*rows, *self.transients.get((part, uid), [])]
            probabilities = self._attention_probabilities(made)
            for r in sorted(made, key=lambda k: -b.rows[k][0]):
                row = b.rows[r]
                # no stack says what made a gradient: bf16 treats it as it treats a recorded backward's,
                # but the math kernel's (bf16 runs flash attention, which makes none of them)
                code = AUTOCAST_ATTENTION if r in probabilities else AUTOCAST_FOLLOWS
                alive.append(b.add(b.tick(), NEVER, row[2], row[3], "activation", "backward", -1, code))
                if r in probabilities:  # the softmax's backward: a temporary of their size beside the gradients
                    b.set_end(b.add(b.tick(), NEVER, row[2], row[3], "activation", "backward", -1, code), b.tick())
                while len(alive) > self.gradients_alive:
                    b.set_end(alive.pop(0), b.tick())
                if pending >= 0:  # a saved tensor goes once the gradient after its own is made
                    b.set_end(pending, b.tick())
                pending = r if r in saved else -1
                if pending in probabilities:
                    to_block_end.append(pending)
                    pending = -1
                if self.frees_inputs_first and pending >= 0 and r not in self.result_saved:
                    b.set_end(pending, b.tick())  # saved as its consumer's input: goes with its gradient
                    pending = -1
            for r in to_block_end:
                b.set_end(r, b.tick())
            to_block_end.clear()
            if part == "tail" and pending >= 0:  # the next block's input goes before that block's backward
                b.set_end(pending, b.tick())
                pending = -1
            if part == "block" and j in spans:
                spans[j][3] = b.now
        if pending >= 0:
            b.set_end(pending, b.tick())
        for g in alive:
            b.set_end(g, b.tick())
        for r, row in enumerate(b.rows):  # what the program held (the logits) goes with the step
            if row[1] == NEVER and row[5] == "forward" and (row[3] > 0 or r in self.copies):
                b.set_end(r, b.now + 0.5)
        return start

    def _attention_probabilities(self, rows: list[int]) -> set[int]:
        """Of a block's rows, what its attention call made that is larger than anything its linear
        layers made: the probabilities of SDPA's math kernel (batch x heads x tokens squared), whose
        backward holds three tensors of their size at once (the probabilities' gradient, the
        scores', and the softmax's temporary), as the complete recordings of Llama, Gemma and Qwen2
        show in every block. Two (the simpler rule, one gradient per tensor, two alive) left the
        checkpointed step extrapolated from Gemma's and Qwen2's OOMs 22% and 24% low.

        The saved probabilities stay beside those three until their block's backward ends (the
        complete recordings free them after the queries' and keys' gradients), not once the next
        gradient is made, as other saved tensors are. Found on Gemma's complete recording (its
        checkpointed step from the OOM was 13.1% low at batch 16, three tensors of their size where
        the real backward held four); checked on Qwen2's and Mistral's OOMs (13.2% low each): the
        three within 4.0%, every other family's answers unchanged."""
        made = [self.b.rows[r] for r in rows]
        linear = max((row[3] for row in made if row[7] == AUTOCAST_MATMUL), default=np.inf)
        return {r for r, row in zip(rows, made, strict=True) if row[7] == AUTOCAST_ATTENTION and row[3] > linear}

    def _outside(self, part: str) -> np.ndarray:
        """Parameters outside the blocks: before them (pre) or after (post)."""
        idx = np.arange(self.pf.param_block.size)
        inside = np.flatnonzero(self.pf.param_block >= 0)
        first, last = (int(inside.min()), int(inside.max())) if inside.size else (idx.size, idx.size)
        if part == "tail":  # a block's own arithmetic: no parameters
            return np.zeros(idx.size, dtype=bool)
        if part == "pre":
            return (self.pf.param_block < 0) & (idx < first)
        return (self.pf.param_block < 0) & (idx > last) if inside.size else np.zeros(idx.size, dtype=bool)

    def step(self, state_ratio: float, temporary_ratio: float) -> None:
        """The optimizer step (its state made by the first), then zero_grad."""
        b = self.b
        t = b.tick()
        # per parameter, tensors its size (AdamW's exp_avg and exp_avg_sq), then what is left of the ratio
        whole, fraction = divmod(state_ratio, 1.0)
        shares = [1.0] * int(whole) + ([fraction] if fraction > 0 else [])
        trained = [*self.p_size[self.trained].tolist(), *self.adapters.tolist()]
        if self.pass_index == 0:
            for n in trained:
                for share in shares:
                    b.add(b.tick(), NEVER, n * share, 0.0, "optimizer_state", "step")
        if temporary_ratio > 0:
            t = b.tick()
            for n in trained:
                b.add(t, t + 0.5, n * temporary_ratio, 0.0, "workspace", "step")
        t = b.tick()
        stale = self.zero_grad_before_backward
        self.stale_grads = [r for r in self.grads if stale and b.rows[r][4] == "gradient"]
        for r in self.grads:
            if r not in self.stale_grads:
                b.set_end(r, t)
        self.grads = []

    def end_forward(self, forward_start: float) -> None:
        """The end of a forward without autograd: what came before a block (the embeddings'
        output, the last block's output) goes once that block, or the final norm, has made its
        own; what the model returns (every block's KV cache, the logits) and its inputs go when
        the forward is over."""
        b = self.b
        ends = [sp[1] for sp in self.spans] + [b.rows[self.head_input][0] if self.head_input >= 0 else b.now]
        for part, j, rows in self.saved:
            if part in ("pre", "tail"):
                for r in rows:
                    b.set_end(r, ends[j + 1] + 0.5)
        done = b.tick()
        for r, row in enumerate(b.rows):
            made = row[0] >= forward_start - 1 and row[5] in ("data", "forward")
            if row[1] == NEVER and made and row[4] in ("activation", KV_CACHE, "input"):
                b.set_end(r, done)
        self.grads = []

    def run_pass(self, state_ratio: float, temporary_ratio: float) -> None:
        """Data, forward, backward, optimizer step; where its blocks and itself are."""
        self.inputs()
        forward_start = self.b.now + 1
        self.head_input = -1
        self.forward()
        if self.no_autograd:
            self.end_forward(forward_start)
            self.pass_index += 1
            return
        backward_start = self.backward()
        pb = self.pf.param_block
        for j, sp in enumerate(self.spans):
            saves = j >= self.frozen_blocks  # autocast caches no copy of a frozen weight
            matrices = int(self.p_size[self.castable & (pb == j)].sum()) if saves else 0
            uid = self.pass_index * BLOCK_UID_STRIDE + j
            back = (sp[2], sp[3]) if saves else (self.b.now, self.b.now)  # a frozen block's: the backward's end
            self.block_spans.append(BlockSpan(uid, j, sp[0], sp[1], *back, matrices, saves))
        outside = self.p_size[self.castable & (pb < 0)]
        # a tied head's copy, unless its embedding is copied already (no creation stack named it)
        outside_bytes = int(outside.sum() + (0.0 if np.isin(self.tied_head, outside) else self.tied_head))
        self.pass_spans.append(PassSpan(forward_start, backward_start, self.b.now, outside_bytes))
        self.step(state_ratio, temporary_ratio)
        self.pass_index += 1


class _ConvStep(_Step):
    """A convolutional network that ran out of memory inside its first block: its blocks are
    synthesized from the parameters (:mod:`.convnet`)."""

    # its rows stand for more than one tensor each (a convolution's output is also the batch norm's
    # input; the batch norm's, the in-place ReLU's result): every saved one goes after the gradient
    # after its own, three gradients alive (ResNet-50: with the traced blocks' order its backward is
    # lighter than the recorded one, and its checkpointing answers 170 and 331 where 162 and 299 ran)
    gradients_alive = GRADIENTS_ALIVE
    frees_inputs_first = False

    def __init__(self, frames: SnapshotFrames, s: TrainingStructure, pf: PartialForward) -> None:
        super().__init__(frames, s, pf)
        self.layers: list[convnet.ConvLayer] = []
        # the head's workspaces, unless the process made them before (memory older than the trace)
        self.head_workspace = not any(n == CUBLAS_WORKSPACE for n, _, _ in s.untracked)
        if self.head_workspace:
            self.notes.append(HEAD_WORKSPACE_ASSUMED)

    def forward(self) -> None:
        self.saved, self.spans = [], []
        self.transients = {k: v for k, v in self.transients.items() if k[0] == "block"}  # this pass's own
        self.saved.append(("pre", -1, self.copy_rows(self.pf.pre, "pre", -1)))
        for j in range(self.pf.layers):
            start = self.b.now + 1
            uid = convnet.block_uid(self.pass_index, j)
            self.saved.append(("block", j, self.block_rows(j, uid)))
            self.spans.append([start, self.b.now, 0.0, 0.0])
        if self.head_workspace and self.pass_index == 0:
            self.b.add(self.b.tick(), NEVER, CUBLAS_WORKSPACE + CUBLASLT_WORKSPACE, 0.0, "workspace", "forward")
        self.saved.append(("post", -1, []))  # the head's parameter gradients

    def backward_workspace(self) -> float:
        """The backward thread's cuBLAS workspace, made by the head's first gradient."""
        return float(CUBLAS_WORKSPACE) if self.head_workspace else 0.0

    def block_rows(self, block: int, uid: int) -> list[int]:
        """The block's forward from now on: the rows kept for the backward. Its projection's
        batch-norm output is added to the block's output and freed with the block; the block's
        output (its last batch norm's, which the add and ReLU overwrite) is made last, so that the
        backward frees it first, as torch does (checkpointing keeps it)."""
        b = self.b
        kept: list[int] = []
        transient: list[int] = []
        layers = [x for x in self.layers if x.block == block]
        main = [x for x in layers if not x.projection]
        for layer in [*main[:-1], *(x for x in layers if x.projection), *main[-1:]]:
            out = layer.width * layer.bytes_per_channel
            kept.append(b.add(b.tick(), NEVER, 0.0, out, "activation", "forward", uid, AUTOCAST_MATMUL))
            for _ in range(2):  # the batch norm's saved mean and inverse deviation
                kept.append(b.add(b.tick(), NEVER, 4.0 * layer.width, 0.0, "activation", "forward", uid))
            normed = b.add(b.tick(), NEVER, 0.0, out, "activation", "forward", uid, AUTOCAST_FOLLOWS)
            (transient if layer.projection else kept).append(normed)
        end = b.tick()
        for r in transient:
            b.set_end(r, end)
        self.transients.setdefault(("block", uid), []).extend(transient)
        return kept


def _conv_step(frames: SnapshotFrames, s: TrainingStructure, pf: PartialForward) -> _ConvStep | None:
    """The step of a convolutional network whose forward ran out inside its first block (None:
    the parameters are not such a network, or the trace does not show its first convolution)."""
    p_size = s.allocs["size"].to_numpy()[pf.params]
    read = convnet.conv_blocks(p_size)
    fwd = pf.pre[s.allocs["free_pos"].to_numpy()[pf.pre] < 0]
    size = s.allocs["size"].to_numpy()
    at = convnet.first_block_start(frames, fwd, s.allocs["sid"].to_numpy(), size)
    if read is None or at < 0:
        return None
    stem_width, convs = read
    first = fwd[at]
    layers = convnet.feature_maps(stem_width, convs, p_size, size[first] / convs[0][1])
    param_block = np.full(p_size.size, -1, dtype=np.int64)
    for layer in layers:
        param_block[layer.weight : layer.weight + convnet.NORM_PARAMS + 1] = layer.block
    pos = s.allocs["pos"].to_numpy()
    pre = pf.pre[pos[pf.pre] < pos[first]]
    n_blocks = layers[-1].block + 1
    step = _ConvStep(frames, s, replace(pf, pre=pre, layers=n_blocks, param_block=param_block))
    step.layers = layers
    castable = np.zeros(p_size.size, dtype=bool)
    castable[[0, *(layer.weight for layer in layers)]] = True
    head = np.arange(p_size.size) > max(layer.weight for layer in layers) + convnet.NORM_PARAMS
    castable |= head & (p_size * 64 >= p_size.max(initial=0))
    step.castable = castable
    step.notes.append(convnet.ASSUMED.format(blocks=n_blocks))
    return step


def extrapolate_step(
    frames: SnapshotFrames, s: TrainingStructure, state_ratio: float, temporary_ratio: float
) -> Extrapolated | None:
    """The whole step from a trace that ended in its first forward (None: no forward seen)."""
    pf = partial_forward(frames, s)
    if pf is None:
        return None
    if pf.blocks and (why := one_stack(pf)):
        raise FitUnsupportedStep(why)
    step: _Step | None = _Step(frames, s, pf) if pf.blocks else _conv_step(frames, s, pf)
    if step is None:
        raise FitUnsupportedStep(NO_WHOLE_BLOCK)
    pf = step.pf  # a convnet's: its blocks read from the parameters
    step.model_state()
    for _ in range(PASSES):
        step.run_pass(state_ratio, temporary_ratio)
    if step.no_autograd:
        first = INFERENCE_EXTRAPOLATED.format(layers=pf.layers, ran=len(pf.blocks))
        return Extrapolated(step.b.tape(), (), (), (first, *dict.fromkeys(step.notes)), forward_only=True)
    notes = [
        f"the trace ends in the first forward: the rest of the step is extrapolated ({pf.layers} repeated blocks, "
        f"counted from the parameters; {len(pf.blocks)} ran), then a second step as the first, with the optimizer "
        "state its step made",
        *dict.fromkeys(step.notes),
    ]
    return Extrapolated(step.b.tape(), tuple(step.block_spans), tuple(step.pass_spans), tuple(notes))
