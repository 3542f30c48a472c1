"""One category for every allocation of the trace and every block of the snapshot, and the
rule that gave it.

Allocations in the trace get their stack's category (:mod:`.stacks`), then the gradient
lifetime rule (:mod:`.gradients`), the KV-cache lifetime rule and the private-pool rule. A block
alive at the dump takes the category of the allocation that made it, so the dump and the
timeline agree; blocks allocated before the trace began (a ring buffer that wrapped, or recording
started late), and those the trace frees, are judged by :mod:`.pretrace` from every piece of
evidence the recording has.

Every allocation and block also carries the *rule* that labelled it (:data:`RULES`): ``stack``
when its own frames said so, anything else when the category was inferred (see
:data:`INFERRED_RULES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo
from ..history.lifetimes import device_lifetimes
from .custom import CategoryRules, stack_rules
from .frameworks import framework_stack_categories
from .grad_forward import grad_forward_mask
from .gradients import THREAD_CODES, free_stack_ids, gradient_mask, thread_codes
from .parallel import inflight_mask, parallel_stack_categories, pipeline_forward_stacks, reduce_scatter_stacks
from .pools import pool_rules
from .pretrace import MIRROR_COVERAGE, WORKSPACE_SIZES, PreTraceBlocks, TraceFacts, judge_pre_trace, mirrored_sizes
from .rules import CATEGORIES, CODES, NONE, RULE_CODES, RULES, StackFacts
from .stacks import cache_stacks, stack_categories, stack_threads, stacks_with_frame

__all__ = ["CATEGORIES", "CODES", "RULES", "Categorization", "categorize"]


@dataclass(frozen=True)
class Categorization:
    """``block_category``: aligned with ``frames.blocks`` (None for free blocks without a
    stack); ``alloc_codes``: per device, the code (index into CATEGORIES) of every row of
    :func:`~snapshot_lab.metrics.history.lifetimes.device_lifetimes`; ``block_rule``/``alloc_rules``: the
    rule that labelled each (names / codes into :data:`RULES`); ``pre_trace_frees``: per device,
    the allocations older than the trace that the trace frees (event_index, address, size_bytes,
    code, rule). With the user's rules (:mod:`.custom`), codes index ``names`` (CATEGORIES, then
    the user's new names) and rule codes ``rule_names`` (RULES, then one per user rule)."""

    block_category: pd.Series
    alloc_codes: dict[int, np.ndarray]
    param_sizes: dict[int, frozenset[int]]
    block_rule: pd.Series = field(default_factory=lambda: pd.Series([], dtype=object))
    alloc_rules: dict[int, np.ndarray] = field(default_factory=dict)
    pre_trace_frees: dict[int, pd.DataFrame] = field(default_factory=dict)
    block_before_trace: pd.Series = field(default_factory=lambda: pd.Series([], dtype=bool))
    # the vocabulary the codes index: the built-in categories, then the user's (:mod:`.custom`)
    names: tuple[str, ...] = CATEGORIES
    rule_names: tuple[str, ...] = RULES  # the rules ``alloc_rules`` index, the user's after the built-in


def _codes(stack_ids: np.ndarray, stack_cat: pd.Series) -> np.ndarray:
    size = max(int(stack_ids.max(initial=-1)), int(stack_cat.index.max()) if len(stack_cat) else -1) + 2
    table = np.full(size, NONE, dtype=np.int64)
    if len(stack_cat):
        table[stack_cat.index.to_numpy(dtype=np.int64)] = stack_cat.map(CODES).to_numpy(dtype=np.int64)
    return table[stack_ids]  # stack id -1 reads the last slot: no stack


class _DeviceCategories:
    """The categories of one device, in named steps: the trace's allocations first, then the
    blocks at the dump, then what the trace freed of the time before it."""

    def __init__(self, frames: SnapshotFrames, device: int, facts: StackFacts) -> None:
        self.frames, self.device = frames, device
        self.facts = facts
        self.lt = device_lifetimes(frames, device)
        self.ev = frames.device_events(device)
        self.seg = frames.segments[frames.segments["device"] == device]
        self.block_mask = (frames.blocks["device"] == device).to_numpy()
        self.blocks = frames.blocks[self.block_mask]
        self.sid = self.lt["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
        self.code = _codes(self.sid, facts.category)
        self.rule = np.where(self.code == NONE, RULE_CODES["no_stack"], RULE_CODES["stack"]).astype(np.int64)
        self.sizes = self.lt["size_bytes"].to_numpy(dtype=np.int64)
        self.surviving = self.lt["free_index"].isna().to_numpy()
        b_sid = self.blocks["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
        self.block_sid = b_sid
        self.block_base = _codes(b_sid, facts.category)
        self.block_live = (self.blocks["state"] != "inactive").to_numpy()
        self.block_req = self.blocks["requested_size_bytes"].to_numpy(dtype=np.int64, na_value=-1)
        self.block_alloc = self._allocation_of_blocks()
        self.older = self.block_live & (self.block_alloc < 0)  # alive at the dump, made before the trace
        self.param_sizes = self._param_sizes()

    def _allocation_of_blocks(self) -> np.ndarray:
        """Row of the lifetimes that made each block alive at the dump (-1: none in the trace)."""
        surviving = self.surviving
        by_addr = pd.Series(np.arange(len(self.lt))[surviving], index=self.lt["address"].to_numpy()[surviving])
        by_addr = by_addr[~by_addr.index.duplicated(keep="last")]
        pos = by_addr.reindex(self.blocks["address"].to_numpy()).to_numpy()
        matched = self.block_live & ~np.isnan(pos)
        return np.where(matched, np.nan_to_num(pos, nan=-1), -1).astype(np.int64)

    def _set(self, mask: np.ndarray, category: str, rule: str) -> None:
        self.code[mask] = CODES[category]
        self.rule[mask] = RULE_CODES[rule]

    def _param_sizes(self) -> frozenset[int]:
        """Parameter sizes: parameters still alive or alive during a backward (FSDP frees the
        unsharded originals once it has sharded them, before any backward: their sizes are no
        parameter's any more; a test frees its model before the snapshot, after its backward),
        and the optimizer state that mirrors them (its temporaries excluded)."""
        code, live, base = self.code, self.block_live, self.block_base
        params = code == CODES["parameter"]
        return frozenset(
            set(self.sizes[params & (self.surviving | self._alive_during_backward())].tolist())
            | set(self.block_req[live & (base == CODES["parameter"])].tolist())
            | set(self.sizes[(code == CODES["optimizer_state"]) & self.surviving].tolist())
            | set(self.block_req[live & (base == CODES["optimizer_state"])].tolist())
        ) - {-1}

    def _gradient_sizes(self) -> set[int]:
        """Sizes a gradient may have: the parameters' known from the trace or, when the trace made
        neither parameters nor optimizer state (recording began after warm-up), the sizes that
        several stackless blocks older than it share, the copies of the parameters
        (``warm_torch_none_python_afterstep``: the last backward's gradients were activations)."""
        if self.param_sizes:
            return set(self.param_sizes)
        return set(mirrored_sizes(self.block_req[self.older & (self.block_sid < 0)]).tolist())

    def _parameter_counts(self, grad: np.ndarray) -> dict[int, int]:
        """Size -> the most gradients of that size alive at once in the trace: how many
        parameters have it (one backward makes one gradient per parameter)."""
        if not grad.any():
            return {}
        start = self.lt["event_index"].to_numpy(dtype=np.int64)[grad]
        end = self.lt["free_index"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).max)[grad]
        sizes = self.sizes[grad]
        steps = pd.DataFrame(
            {
                "size": np.concatenate([sizes, sizes]),
                "at": np.concatenate([start, end]),
                "delta": np.concatenate([np.ones(sizes.size, np.int64), -np.ones(sizes.size, np.int64)]),
            }
        ).sort_values(["size", "at", "delta"], kind="stable")
        live = steps.groupby("size")["delta"].cumsum()
        return {int(size): int(n) for size, n in live.groupby(steps["size"]).max().items()}

    def _alive_during_backward(self) -> np.ndarray:
        """Allocations alive at some allocation of autograd's thread (or one without a stack)."""
        threads = thread_codes(self.sid, self.facts.threads)
        backward = np.flatnonzero((threads == THREAD_CODES["autograd"]) | (threads == THREAD_CODES["none"]))
        if not backward.size:
            return np.zeros(len(self.lt), dtype=bool)
        when = self.lt["event_index"].to_numpy(dtype=np.int64)[backward]
        start = self.lt["event_index"].to_numpy(dtype=np.int64)
        end = self.lt["free_index"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).max)
        # the first backward allocation at or after each allocation's start: alive then?
        first = np.searchsorted(when, start, side="left")
        ok = first < when.size
        out = np.zeros(len(self.lt), dtype=bool)
        out[ok] = when[first[ok]] < end[ok]
        return out

    def in_trace(self) -> np.ndarray:
        """The rules for the trace's own allocations; returns the gradient mask."""
        facts, lt, ev = self.facts, self.lt, self.ev
        grad = gradient_mask(lt, ev, facts.threads, facts.eligible, self._gradient_sizes(), facts.zero_grad)
        self._set(grad, "gradient", "gradient_lifetime")
        if facts.reduce_scatter:
            sharded = gradient_mask(lt, ev, facts.threads, facts.reduce_scatter, None, set()) & ~grad
            self._set(sharded, "gradient", "sharded_gradient_lifetime")
            grad |= sharded
        if facts.pipeline_forward:
            free_thread = thread_codes(free_stack_ids(lt, ev), facts.threads)
            freed = lt["free_index"].notna().to_numpy()
            by_backward = freed & ((free_thread == THREAD_CODES["autograd"]) | (free_thread == THREAD_CODES["none"]))
            inflight = inflight_mask(self.sid, by_backward, facts.pipeline_forward)
            self._set(inflight & (self.code == CODES["activation"]), "inflight_activation", "pipeline_inflight")
        self._kv_cache_replaced()
        self._parameter_mirrors()
        stackless = (self.code == NONE) & ~grad
        self._set(stackless & ~self.surviving, "activation", "backward_temporary")  # made and freed again
        self._set(stackless & self.surviving, "other", "stackless_survivor")
        self.code, self.rule = self._private_pools(lt["address"].to_numpy(dtype=np.int64), self.code, self.rule)
        return grad

    def _private_pools(
        self, addresses: np.ndarray, code: np.ndarray, rule: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """What lies in a private pool (:mod:`.pools`): a CUDA graph's is ``cuda_graph_pool``
        whole; in a pool whose owner is unknown, what its own stack does not decide (``other``,
        ``unknown`` or no category) is ``private_pool``."""
        if not self.seg["is_private_pool"].any():
            return code, rule
        code, rule = code.copy(), rule.copy()
        evidence = pool_rules(self.frames, self.device, addresses)
        graph = np.isin(evidence, ["graph_pool_id", "graph_capture_stack"])
        undecided = np.isin(code, [NONE, CODES["other"], CODES["unknown"]]) & (evidence == "private_pool")
        for mask, category in ((graph, "cuda_graph_pool"), (undecided, "private_pool")):
            code[mask] = CODES[category]
            rule[mask] = pd.Series(evidence[mask], dtype=object).map(RULE_CODES).to_numpy(dtype=np.int64)
        return code, rule

    def _kv_cache_replaced(self) -> None:
        """A tensor that a KV cache frees while it allocates (``DynamicCache.update``'s
        ``torch.cat`` replaces the layer's keys and values) was that cache's, wherever it was
        allocated (the prefill's keys and values are made by the attention's own code)."""
        if not self.facts.kv_cache:
            return
        kv = np.fromiter(self.facts.kv_cache, dtype=np.int64, count=len(self.facts.kv_cache))
        replaced = np.isin(free_stack_ids(self.lt, self.ev), kv) & (self.code != CODES["kv_cache"])
        replaced &= np.isin(self.code, [CODES["activation"], CODES["other"], NONE])
        self._set(replaced, "kv_cache", "kv_cache_replaced")

    def kv_cache_in_training(self, training: bool) -> None:
        """A KV cache filled by a training forward (transformers builds a ``DynamicCache`` when
        ``use_cache`` is on, and its ``torch.cat`` copies every layer's keys and values) holds
        activations, not a generation's cache: truth of ``fw_lightning_auto_python`` (32 MiB at
        the peak). Kept apart by its rule, so the waste can still be named. A trace with no backward
        and no optimizer yet (out of memory in the first forward: ``fit_gpt2_b32_oom_python``) is
        judged by how its forwards keep memory (:mod:`.grad_forward`, rule
        ``kv_cache_in_grad_forward``)."""
        if training:
            self._set(self.code == CODES["kv_cache"], "activation", "kv_cache_in_training")
        else:
            saved = grad_forward_mask(self.lt, self.code == CODES["kv_cache"])
            self._set(saved, "activation", "kv_cache_in_grad_forward")

    def _parameter_mirrors(self) -> None:
        """An optimizer written by hand in the program's own code (no decisive frame) shows up as
        allocations that mirror the parameters: one stack, on the program's thread, whose
        allocations alive at the dump have the sizes of the parameter copies older than the
        trace, covering most of them (``midrun_nozero_python``: momentum buffers made anew each
        step by the training script)."""
        candidates = mirrored_sizes(self.block_req[self.older & (self.block_sid < 0)])
        if not candidates.size:
            return
        threads = thread_codes(self.sid, self.facts.threads)
        eligible = (self.code == CODES["other"]) & self.surviving & (threads == THREAD_CODES["main"])
        eligible &= np.isin(self.sizes, candidates)
        for stack_id in np.unique(self.sid[eligible]):
            mine = eligible & (self.sid == stack_id)
            if np.unique(self.sizes[mine]).size >= MIRROR_COVERAGE * candidates.size:
                self._set(mine, "optimizer_state", "parameter_mirror")

    def blocks_at_dump(self, pre_trace: PreTraceBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Category and rule codes of the device's blocks: alive ones take the allocation that
        made them, older ones (the third array says which) are judged by :mod:`.pretrace`."""
        out = self.block_base.copy()
        rule = np.where(out == NONE, RULE_CODES["no_stack"], RULE_CODES["pre_trace_stack"]).astype(np.int64)
        matched = self.block_alloc >= 0
        out[matched] = self.code[self.block_alloc[matched]]
        rule[matched] = self.rule[self.block_alloc[matched]]
        before = np.flatnonzero(self.older)
        if before.size:
            out[before], rule[before] = pre_trace.judge_blocks(before)
        out, rule = self._private_pools(self.blocks["address"].to_numpy(dtype=np.int64), out, rule)
        return out, rule, self.older

    def pre_trace(self, grad: np.ndarray) -> PreTraceBlocks:
        """The judge of the memory older than the trace, with what the trace says."""
        facts = self.trace_facts(grad)
        tables = (self.ev, self.lt)
        return judge_pre_trace(self.blocks, self.block_base, self.block_sid, self.older, tables, self.facts, facts)

    def trace_facts(self, grad: np.ndarray) -> TraceFacts:
        threads = thread_codes(self.sid, self.facts.threads)
        backward = (threads == THREAD_CODES["autograd"]) | (threads == THREAD_CODES["none"])
        kept_state = (self.code == CODES["optimizer_state"]) & self.surviving
        return TraceFacts(
            # with what the trace's rules found: gradients and optimizer state mirror the parameters
            param_sizes=self.param_sizes | frozenset(self.sizes[grad | kept_state].tolist()),
            params_have_stacks=bool(
                (self.code == CODES["parameter"]).any()
                or (self.block_live & (self.block_base == CODES["parameter"])).any()
            ),
            has_backward=bool(backward.any()),
            mirror_stacks=frozenset(np.unique(self.sid[self.rule == RULE_CODES["parameter_mirror"]]).tolist()),
            workspace_in_trace=bool((self.surviving & np.isin(self.sizes, list(WORKSPACE_SIZES))).any()),
            has_forward=bool((self.code == CODES["activation"]).any()),
            optimizer_state_sizes=self.sizes[kept_state],
            trace_gradient_sizes=self.sizes[grad],
            param_counts=self._parameter_counts(grad) if not self.param_sizes else {},
            has_trace=bool(len(self.ev)),
        )


def categorize(frames: SnapshotFrames, rules: CategoryRules | None = None) -> Categorization:
    """Categories of every allocation and block (computed once per snapshot); with ``rules``,
    the user's rules first (:mod:`.custom`: for what is shown, never for the analyses)."""
    builtin = memo(frames, "categories", lambda: _categorize(frames))
    if rules is None:
        return builtin
    return memo(frames, ("categories", rules), lambda: _with_user_rules(frames, builtin, rules))


def _with_user_rules(frames: SnapshotFrames, builtin: Categorization, rules: CategoryRules) -> Categorization:
    """``builtin`` with what the user's rules match relabelled: every allocation of the trace and
    every labelled block whose own stack a rule matches (memory without a stack keeps its label)."""
    table, codes = stack_rules(frames, rules), rules.codes()
    rule_codes = np.arange(len(RULES), len(RULES) + len(rules.rules), dtype=np.int64)
    alloc_codes, alloc_rules = {}, {}
    for d, code in builtin.alloc_codes.items():
        which = table[device_lifetimes(frames, d)["stack_id"].to_numpy(dtype=np.int64, na_value=-1)]
        hit = which >= 0
        alloc_codes[d] = np.where(hit, codes[np.maximum(which, 0)], code)
        alloc_rules[d] = np.where(hit, rule_codes[np.maximum(which, 0)], builtin.alloc_rules[d])
    which = table[frames.blocks["stack_id"].to_numpy(dtype=np.int64, na_value=-1)]
    hit = (which >= 0) & builtin.block_category.notna().to_numpy()
    names, rule_names = np.array(rules.names, dtype=object), np.array(rules.rule_names, dtype=object)
    block_category = builtin.block_category.copy()
    block_category[hit] = names[codes[which[hit]]]
    block_rule = builtin.block_rule.copy()
    block_rule[hit] = rule_names[rule_codes[which[hit]]]
    return replace(
        builtin,
        block_category=block_category,
        alloc_codes=alloc_codes,
        block_rule=block_rule,
        alloc_rules=alloc_rules,
        names=rules.names,
        rule_names=rules.rule_names,
    )


def _stack_facts(frames: SnapshotFrames) -> StackFacts:
    generic = stack_categories(frames)
    stack_cat = generic.copy()
    for library in (framework_stack_categories(frames), parallel_stack_categories(frames)):  # the last wins
        if len(library):
            stack_cat.loc[library.index] = library.to_numpy()
    caches = cache_stacks(frames)
    eligible = set(stack_cat.index[stack_cat.isin(["activation", "other", "gradient"])].astype(int)) - caches
    return StackFacts(
        category=stack_cat,
        threads=stack_threads(frames),
        eligible=eligible,
        zero_grad=stacks_with_frame(frames, "zero_grad"),
        reduce_scatter=reduce_scatter_stacks(frames),
        pipeline_forward=pipeline_forward_stacks(frames),
        kv_cache=set(stack_cat.index[stack_cat == "kv_cache"].astype(int)),
    )


def _categorize(frames: SnapshotFrames) -> Categorization:
    facts = _stack_facts(frames)
    block_codes = np.full(len(frames.blocks), NONE, dtype=np.int64)
    block_rules = np.full(len(frames.blocks), RULE_CODES["no_stack"], dtype=np.int64)
    before_trace = np.zeros(len(frames.blocks), dtype=bool)
    alloc_codes: dict[int, np.ndarray] = {}
    alloc_rules: dict[int, np.ndarray] = {}
    param_sizes: dict[int, frozenset[int]] = {}
    frees: dict[int, pd.DataFrame] = {}
    devices = sorted(set(frames.info.devices) | set(frames.blocks["device"].unique().tolist()))
    for d in devices:
        dev = _DeviceCategories(frames, d, facts)
        grad = dev.in_trace()
        pre_trace = dev.pre_trace(grad)
        dev.kv_cache_in_training(pre_trace.training)
        mask = dev.block_mask
        block_codes[mask], block_rules[mask], before_trace[mask] = dev.blocks_at_dump(pre_trace)
        alloc_codes[d], alloc_rules[d], param_sizes[d] = dev.code, dev.rule, dev.param_sizes
        frees[d] = pre_trace.freed_in_trace()
    names = np.array([*CATEGORIES, None], dtype=object)
    block_category = pd.Series(names[block_codes], index=frames.blocks.index, name="category")
    block_rule = pd.Series(np.array(RULES, dtype=object)[block_rules], index=frames.blocks.index, name="rule")
    before = pd.Series(before_trace, index=frames.blocks.index, name="before_trace")
    return Categorization(block_category, alloc_codes, param_sizes, block_rule, alloc_rules, frees, before)
