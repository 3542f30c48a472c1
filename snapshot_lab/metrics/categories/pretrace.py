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

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .gradients import THREAD_CODES, thread_codes
from .rules import CODES, NONE, RULE_CODES, StackFacts


@dataclass(frozen=True)
class TraceFacts:
    """What the trace of one device says about the run (see :meth:`_DeviceCategories.trace_facts`)."""

    param_sizes: frozenset[int]  # parameters' and optimizer state's sizes known from the trace
    params_have_stacks: bool  # some parameter was allocated inside the recording
    has_backward: bool  # allocations on autograd's thread (or without a stack) in the trace
    has_forward: bool  # activations (a module's forward) in the trace
    optimizer_state_sizes: np.ndarray  # sizes of optimizer state allocated in the trace, alive at the end
    trace_gradient_sizes: np.ndarray  # sizes of gradients allocated in the trace, alive at the end


class PreTraceBlocks:
    """The judge of one device's memory older than its trace."""

    def __init__(
        self,
        blocks: pd.DataFrame,
        block_base: np.ndarray,
        block_sid: np.ndarray,
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
        """Blocks without any stack: a parameter-sized one is a parameter when no parameter has a
        stack (recording started after the model was built: ``late_gpt2_python``, where "every
        stackless parameter-sized block is a gradient" called every parameter a gradient); when
        parameters do have stacks, recording began before the model and these are gradients of
        a backward pass that fell out of the ring buffer."""
        code = np.full(sizes.size, CODES["other"], dtype=np.int64)
        rule = np.full(sizes.size, RULE_CODES["pre_trace_other"], dtype=np.int64)
        shaped = self._shaped(sizes)
        code[shaped] = CODES["gradient"] if self.trace.params_have_stacks else CODES["parameter"]
        rule[shaped] = RULE_CODES["pre_trace_parameter_sized"]
        return code, rule

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
        by_optim = np.isin(free_sid, optim_stacks) & ~zero_grad
        code[by_optim], rule[by_optim] = CODES["optimizer_state"], RULE_CODES["pre_trace_freed_by_optimizer"]
        return f.assign(code=code, rule=rule)


def orphan_frees(events: pd.DataFrame, lifetimes: pd.DataFrame) -> pd.DataFrame:
    """``free_completed`` events of one device's trace whose allocation is older than the trace:
    event_index, address, size_bytes, stack_id (the free's own stack)."""
    frees = events[(events["action"] == "free_completed") & events["address"].notna()]
    matched = lifetimes["free_index"].dropna().to_numpy(dtype=np.int64)
    orphan = frees[~frees["event_index"].isin(matched)]
    out = orphan[["event_index", "address", "size_bytes", "stack_id"]].reset_index(drop=True)
    return out.astype({"address": "int64"})


def judge_pre_trace(
    blocks: pd.DataFrame,
    block_base: np.ndarray,
    block_sid: np.ndarray,
    events: pd.DataFrame,
    lifetimes: pd.DataFrame,
    facts: StackFacts,
    trace: TraceFacts,
) -> PreTraceBlocks:
    """The judge of the device's memory older than its trace (see the module docstring)."""
    return PreTraceBlocks(blocks, block_base, block_sid, orphan_frees(events, lifetimes), facts, trace)


__all__ = ["NONE", "PreTraceBlocks", "TraceFacts", "judge_pre_trace", "orphan_frees"]
