"""Memory older than the trace: blocks alive at the dump that no allocation of the trace made,
and allocations the trace frees without having made them.

A recording started late (after the model was loaded, at step k of a run) or a ring buffer that
wrapped leaves these without an allocation stack, or with only the stack the block kept. What
tells them apart is evidence from the rest of the recording, used in this order:

1. the block's own stack (kept from before the trace), and the thread it was recorded on: a
   parameter-sized block made on autograd's thread and alive at the dump is a gradient of an
   earlier backward (``ToCopyBackward0`` under autocast);
2. what the trace does to it: freed by ``zero_grad`` (a gradient), by the optimizer that
   replaced it (optimizer state), by a KV cache that grew (the cache's);
3. its size: a parameter's (known from parameters with stacks, or from the optimizer state,
   which mirrors the parameters), and how many stackless copies of each such size there are;
4. what kind of trace it is: in an inference trace (forwards, no backward, no optimizer) the
   stackless blocks that stay alive through every forward are the weights.

Every label given here is inferred, and says by which rule (:data:`.rules.RULE_HELP`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..history.lifetimes import orphan_frees
from .gradients import THREAD_CODES, thread_codes
from .rules import CODES, NONE, RULE_CODES, StackFacts

# cuBLAS/cuBLASLt workspaces torch allocates through the caching allocator (per handle and
# stream; 32 MiB on Hopper): one for the program's thread, one for autograd's
WORKSPACE_SIZES = frozenset({32 * 2**20})
MAX_WORKSPACES = 2
# a hand-written optimizer's stack must mirror this share of the parameter sizes
MIRROR_COVERAGE = 0.8
# the share of blocks of repeated sizes whose count a number of copies must divide
COPIES_AGREEMENT = 0.95
# roles of the copies of each parameter size older than the trace, most copies first; between
# two patterns of as many copies, the first listed wins
ROLE_PATTERNS: tuple[tuple[str, ...], ...] = (
    ("parameter", "gradient", "optimizer_state", "optimizer_state"),  # Adam/AdamW, before zero_grad
    ("parameter", "gradient", "optimizer_state"),  # SGD with momentum, before zero_grad
    ("parameter", "optimizer_state", "optimizer_state"),  # Adam, gradients set to None
    ("parameter", "gradient"),  # no optimizer state (a forward+backward benchmark)
    ("parameter", "optimizer_state"),  # momentum, gradients set to None
    ("parameter",),
)


@dataclass(frozen=True)
class TraceFacts:
    """What the trace of one device says about the run (see :meth:`_DeviceCategories.trace_facts`)."""

    param_sizes: frozenset[int]  # parameters' and optimizer state's sizes known from the trace
    params_have_stacks: bool  # some parameter was allocated inside the recording
    has_backward: bool  # allocations on autograd's thread (or without a stack) in the trace
    has_forward: bool  # activations (a module's forward) in the trace
    optimizer_state_sizes: np.ndarray  # sizes of optimizer state allocated in the trace, alive at the end
    trace_gradient_sizes: np.ndarray  # sizes of the gradients the trace allocated (kept or freed since)
    mirror_stacks: frozenset[int] = frozenset()  # a hand-written optimizer's stacks (rule parameter_mirror)
    workspace_in_trace: bool = False  # a block of a cuBLAS workspace's size was made in the trace and kept
    # size -> how many parameters have it: the most gradients of that size the trace held at once
    # (one backward makes one per parameter); empty when the trace made no gradient
    param_counts: dict[int, int] = field(default_factory=dict)
    has_trace: bool = True  # the device's trace holds any event (a state-only file has none)

    def possible_roles(self) -> list[tuple[str, ...]]:
        """The role patterns the trace allows for the copies older than it: a backward that made
        gradients in the trace leaves none older than it (even when ``zero_grad`` freed them since:
        ``bulk_release_python``, where "a backward and no gradient kept" meant parameter, gradient
        and one state, for AdamW's parameter and two states); a backward that made none
        accumulated into gradients older than the trace; optimizer state made in the trace and
        kept is not older either."""
        grads_in_trace = self.trace_gradient_sizes.size > 0
        older_grads = self.has_backward and not grads_in_trace
        state_in_trace = self.optimizer_state_sizes.size > 0
        out = []
        for roles in ROLE_PATTERNS:
            if ("gradient" in roles and grads_in_trace) or ("optimizer_state" in roles and state_in_trace):
                continue
            if older_grads and "gradient" not in roles:
                continue
            out.append(roles)
        return out or [("parameter",)]


def mirrored_sizes(sizes: np.ndarray) -> np.ndarray:
    """Sizes that several stackless blocks older than the trace share (the copies of the
    parameters: parameter, gradient, optimizer state), minus a cuBLAS workspace's."""
    values, counts = np.unique(sizes, return_counts=True)
    keep = (counts >= 2) & ~np.isin(values, list(WORKSPACE_SIZES))
    return values[keep]


def copies_per_parameter(sizes: np.ndarray, patterns: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The role pattern whose number of copies divides the count of nearly every repeated size
    (``COPIES_AGREEMENT`` of their blocks): GPT-2 with AdamW recorded mid-run has 4 copies of
    every parameter size; Llama's weights alone do not divide by 2 or 3 (its norms: 2 per layer
    and a final one)."""
    values, counts = np.unique(sizes, return_counts=True)
    repeated = counts >= 2
    if not repeated.any():
        return patterns[-1]
    counts, nbytes = counts[repeated], counts[repeated] * values[repeated]
    for roles in sorted(patterns, key=len, reverse=True):
        k = len(roles)
        divides = counts % k == 0
        # both by blocks and by bytes: by blocks alone, GPT-2's many small vectors let 4 copies
        # win over the 2 of a benchmark's parameters and gradients (bench_fwdbwd_python); by
        # bytes alone, Llama's weights look like 2 copies (inf_llama_late_python)
        by_blocks = counts[divides].sum() >= COPIES_AGREEMENT * counts.sum()
        if k == 1 or (by_blocks and nbytes[divides].sum() >= COPIES_AGREEMENT * nbytes.sum()):
            return roles
    return ("parameter",)


def copies_by_parameter_count(
    sizes: np.ndarray, counts: dict[int, int], patterns: list[tuple[str, ...]]
) -> tuple[str, ...] | None:
    """The role pattern that explains the most bytes of the stackless blocks older than the trace
    when the trace's gradients say how many parameters have each size: ``k`` copies of a size
    need ``k`` times its parameters' count, and what is left over (a BatchNorm's running
    statistics share its weight's size: ``vgg_prebwd_late_python``) is no copy. None when no
    older size is a parameter's."""
    values, have = np.unique(sizes, return_counts=True)
    known = np.isin(values, np.fromiter(counts, dtype=np.int64, count=len(counts)))
    if not known.any():
        return None
    values, have = values[known], have[known]
    params = np.array([counts[int(v)] for v in values], dtype=np.int64)

    def explained(roles: tuple[str, ...]) -> int:
        need = len(roles) * params
        return int((values * need)[have >= need].sum())

    best = max(patterns, key=lambda roles: (explained(roles), len(roles)))
    return best if explained(best) else None


class PreTraceBlocks:
    """The judge of one device's memory older than its trace."""

    def __init__(
        self,
        blocks: pd.DataFrame,
        block_base: np.ndarray,
        block_sid: np.ndarray,
        older: np.ndarray,
        frees: pd.DataFrame,
        facts: StackFacts,
        trace: TraceFacts,
    ) -> None:
        self.blocks = blocks
        self.block_base = block_base
        self.block_sid = block_sid
        self.block_req = blocks["requested_size_bytes"].to_numpy(dtype=np.int64, na_value=-1)
        self.frees = frees
        self.facts = facts
        self.trace = trace
        sizes = trace.param_sizes
        self.param_size_array = np.fromiter(sizes, dtype=np.int64, count=len(sizes))
        self.older_stackless_sizes = self.block_req[older & (block_sid < 0)]
        candidates = self._without_workspaces(self.older_stackless_sizes)
        counted = copies_by_parameter_count(candidates, trace.param_counts, trace.possible_roles())
        self.roles = counted or copies_per_parameter(candidates, trace.possible_roles())

    @property
    def training(self) -> bool:
        """Whether the run trains: a backward in the trace, optimizer state in it, or gradients or
        optimizer state among the copies older than it (a trace of one training forward)."""
        return self.trace.has_backward or bool(self.trace.optimizer_state_sizes.size) or len(self.roles) > 1

    def _shaped(self, sizes: np.ndarray) -> np.ndarray:
        return np.isin(sizes, self.param_size_array)

    def judge_blocks(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Category and rule codes of the blocks at ``positions`` (alive at the dump, made
        before the trace)."""
        sizes = self.block_req[positions]
        sid = self.block_sid[positions]
        code = self.block_base[positions].copy()
        rule = np.full(positions.size, RULE_CODES["pre_trace_stack"], dtype=np.int64)
        with_stack = sid >= 0
        thread = thread_codes(np.where(with_stack, sid, -1), self.facts.threads)
        by_autograd = with_stack & (thread == THREAD_CODES["autograd"])
        by_autograd &= np.isin(code, [CODES["activation"], CODES["other"]]) & self._shaped(sizes)
        code[by_autograd] = CODES["gradient"]
        rule[by_autograd] = RULE_CODES["pre_trace_autograd_gradient"]
        stackless = ~with_stack
        if stackless.any():
            code[stackless], rule[stackless] = self._stackless(sizes[stackless])
        return code, rule

    def _stackless(self, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Blocks without any stack (see the module docstring for the order of the evidence).

        When parameters have stacks, recording began before the model and parameter-sized ones
        are gradients of a backward that fell out of the ring buffer. Otherwise the copies of
        each size are counted (:func:`copies_per_parameter`): with one copy, a parameter-sized
        block is a parameter (``late_gpt2_python``, where "every stackless parameter-sized block
        is a gradient" called every parameter a gradient), and in an inference trace every one is
        a weight; with more, each size's copies are split by role."""
        code = np.full(sizes.size, CODES["unknown"], dtype=np.int64)
        rule = np.full(sizes.size, RULE_CODES["pre_trace_other"], dtype=np.int64)
        shaped = self._shaped(sizes)
        if self.trace.params_have_stacks:
            code[shaped], rule[shaped] = CODES["gradient"], RULE_CODES["pre_trace_parameter_sized"]
            return code, rule
        if len(self.roles) > 1:
            return self._split_copies(sizes, self.roles)
        if shaped.any():
            code[shaped], rule[shaped] = CODES["parameter"], RULE_CODES["pre_trace_parameter_sized"]
        elif self.trace.has_forward and not self.trace.has_backward and not self.trace.optimizer_state_sizes.size:
            return self._weights(sizes)
        elif not self.trace.has_trace:
            return self._state_only_weights(sizes)
        return code, rule

    def _state_only_weights(self, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A file with no trace and no stacks (``_snapshot()`` pickled, or recording switched on
        with no history): a size that several blocks share is a weight repeated once per layer
        (a Llama's projections, norms, embedding and untied head: ``state_llama_fp16``, where its
        rotary embedding's two 64-byte buffers are taken along: sizes cannot tell a buffer from a
        weight); a size of its own stays unknown (a buffer, an input, a workspace)."""
        code = np.full(sizes.size, CODES["unknown"], dtype=np.int64)
        rule = np.full(sizes.size, RULE_CODES["pre_trace_other"], dtype=np.int64)
        repeated = np.isin(sizes, mirrored_sizes(sizes))
        code[repeated], rule[repeated] = CODES["parameter"], RULE_CODES["state_only_weights"]
        return code, rule

    def _weights(self, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """An inference trace: every stackless block older than it stays alive through all its
        forwards, and is a weight, but for a cuBLAS workspace made by a forward before recording
        began (a workspace-sized block that at most ``MAX_WORKSPACES`` blocks share: a weight
        of that size comes once per layer). ``inf_flush_python``: 32 MiB of its 321 MiB were
        the workspace, not Llama's weights."""
        code = np.full(sizes.size, CODES["parameter"], dtype=np.int64)
        rule = np.full(sizes.size, RULE_CODES["pre_trace_weights"], dtype=np.int64)
        workspace = self._workspace_mask(sizes)
        for size in np.unique(sizes[workspace]):
            if (sizes == size).sum() > MAX_WORKSPACES:
                workspace[sizes == size] = False
        code[workspace], rule[workspace] = CODES["other"], RULE_CODES["pre_trace_workspace"]
        return code, rule

    def _workspace_mask(self, sizes: np.ndarray) -> np.ndarray:
        """Up to ``MAX_WORKSPACES`` blocks of a cuBLAS workspace's size, when the trace made none."""
        out = np.zeros(sizes.size, dtype=bool)
        if self.trace.workspace_in_trace:
            return out
        for size in WORKSPACE_SIZES:
            out[np.flatnonzero(sizes == size)[:MAX_WORKSPACES]] = True
        return out

    def _without_workspaces(self, sizes: np.ndarray) -> np.ndarray:
        return sizes[~self._workspace_mask(sizes)]

    def _split_copies(self, sizes: np.ndarray, roles: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Each size whose count the number of copies divides: its blocks split evenly between
        the roles (equal sizes: which block plays which role does not change any total). When
        the trace's gradients count the parameters of each size, only that many copies are
        split, of parameters' sizes only; the rest stays ``unknown``."""
        code = np.full(sizes.size, CODES["unknown"], dtype=np.int64)
        rule = np.full(sizes.size, RULE_CODES["pre_trace_other"], dtype=np.int64)
        workspace = self._workspace_mask(sizes)
        code[workspace], rule[workspace] = CODES["other"], RULE_CODES["pre_trace_workspace"]
        k = len(roles)
        counts = self.trace.param_counts
        for size in np.unique(sizes[~workspace]):
            members = np.flatnonzero((sizes == size) & ~workspace)
            if counts:
                if int(size) not in counts:
                    continue
                members = self._counted_copies(members, counts[int(size)] * k, rule)
            if not members.size or members.size % k:
                continue
            per_role = members.size // k
            for i, role in enumerate(roles):
                code[members[i * per_role : (i + 1) * per_role]] = CODES[role]
            rule[members] = RULE_CODES["pre_trace_copies"]
        return code, rule

    @staticmethod
    def _counted_copies(members: np.ndarray, copies: int, rule: np.ndarray) -> np.ndarray:
        """The first ``copies`` blocks of one size, the parameters' copies; the rest are marked
        as extra (equal sizes: which block plays which role changes no total)."""
        if members.size < copies:
            return members[:0]
        rule[members[copies:]] = RULE_CODES["pre_trace_extra_copy"]
        return members[:copies]

    def freed_in_trace(self) -> pd.DataFrame:
        """The trace's frees of allocations older than it, with category and rule codes."""
        f = self.frees
        code = np.full(len(f), CODES["activation"], dtype=np.int64)
        rule = np.full(len(f), RULE_CODES["pre_trace_freed"], dtype=np.int64)
        free_sid = f["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
        facts = self.facts
        zero_grad = np.isin(free_sid, list(facts.zero_grad))
        code[zero_grad], rule[zero_grad] = CODES["gradient"], RULE_CODES["pre_trace_freed_by_zero_grad"]
        kv = np.isin(free_sid, list(facts.kv_cache))
        code[kv], rule[kv] = CODES["kv_cache"], RULE_CODES["kv_cache_replaced"]
        stack_cat = facts.category
        optim_stacks = stack_cat.index[stack_cat == "optimizer_state"].to_numpy(dtype=np.int64)
        optim_stacks = np.concatenate([optim_stacks, self._replacing_stacks(f, free_sid)])
        by_optim = np.isin(free_sid, optim_stacks) & ~zero_grad
        code[by_optim], rule[by_optim] = CODES["optimizer_state"], RULE_CODES["pre_trace_freed_by_optimizer"]
        return f.assign(code=code, rule=rule)

    def _replacing_stacks(self, frees: pd.DataFrame, free_sid: np.ndarray) -> np.ndarray:
        """Stacks of the program's own code that free older copies of (nearly) every parameter
        size, in a trace where a hand-written optimizer makes its state anew: they free the
        state it replaces (``midrun_nozero_python``: the old momentum buffers)."""
        mirrored = mirrored_sizes(self.older_stackless_sizes)
        if not self.trace.mirror_stacks or not mirrored.size:
            return np.zeros(0, dtype=np.int64)
        threads = thread_codes(free_sid, self.facts.threads)
        category = self.facts.category.reindex(free_sid).to_numpy()
        eligible = (threads == THREAD_CODES["main"]) & (category == "other")
        eligible &= np.isin(frees["size_bytes"].to_numpy(dtype=np.int64), mirrored)
        out = [
            stack_id
            for stack_id in np.unique(free_sid[eligible])
            if np.unique(frees["size_bytes"].to_numpy()[eligible & (free_sid == stack_id)]).size
            >= MIRROR_COVERAGE * mirrored.size
        ]
        return np.array(out, dtype=np.int64)


def judge_pre_trace(
    blocks: pd.DataFrame,
    block_base: np.ndarray,
    block_sid: np.ndarray,
    older: np.ndarray,
    trace_tables: tuple[pd.DataFrame, pd.DataFrame],
    facts: StackFacts,
    trace: TraceFacts,
) -> PreTraceBlocks:
    """The judge of the device's memory older than its trace (see the module docstring);
    ``older``: the blocks alive at the dump that no allocation of the trace made;
    ``trace_tables``: the device's events and lifetimes."""
    frees = orphan_frees(*trace_tables)
    return PreTraceBlocks(blocks, block_base, block_sid, older, frees, facts, trace)


__all__ = [
    "MIRROR_COVERAGE",
    "NONE",
    "WORKSPACE_SIZES",
    "PreTraceBlocks",
    "TraceFacts",
    "copies_by_parameter_count",
    "copies_per_parameter",
    "judge_pre_trace",
    "mirrored_sizes",
    "orphan_frees",
]
