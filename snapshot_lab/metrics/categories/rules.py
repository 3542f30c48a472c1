"""The names: categories, and the rules that assign them (which rule labelled what is shown
beside the category, so that an inferred label reads as one)."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

CATEGORIES = (
    "parameter",
    "gradient",
    "optimizer_state",
    "activation",
    "kv_cache",
    "inflight_activation",
    "fsdp_unsharded_params",
    "comm_buffer",
    "ddp_bucket",
    "cuda_graph_pool",
    "private_pool",
    "unknown",
    "other",  # last: code -1 (no category) reads as "other" wherever codes index this tuple
)
CODES = {c: i for i, c in enumerate(CATEGORIES)}
NONE = -1  # no category yet

# rule -> what it says (the allocation's own frames decide only for "stack" and "pre_trace_stack")
RULE_HELP = {
    "stack": "the allocation's own stack",
    "pre_trace_stack": "the stack the block kept from before the trace",
    "no_stack": "no stack and no other evidence",
    "gradient_lifetime": "made on autograd's thread, parameter-sized, outlives backward",
    "sharded_gradient_lifetime": "a reduce-scatter's output that outlives backward",
    "pipeline_inflight": "saved by a pipeline stage's forward, freed by its backward",
    "kv_cache_replaced": "freed by a KV cache that replaced it with a larger tensor",
    "kv_cache_in_training": "filled by a KV cache during a training forward (use_cache on): activations",
    "kv_cache_in_grad_forward": "filled by a KV cache in a forward that kept every layer's activations (grad on)",
    "parameter_mirror": "one stack of the program's own code whose allocations mirror the parameters",
    "backward_temporary": "no stack (autograd's thread), made and freed in the trace",
    "stackless_survivor": "no stack, made in the trace and alive at the end",
    "graph_pool_id": "inside a pool a CUDA graph made for itself (pool id (n, 0))",
    "graph_capture_stack": (
        "inside a private pool that graph-capture code allocated in (torch.cuda.graphs, cudagraph trees)"
    ),
    "private_pool": "inside a private memory pool (torch.cuda.MemPool or a shared graph pool), owner unknown",
    "pre_trace_autograd_gradient": "older than the trace, made on autograd's thread, parameter-sized",
    "pre_trace_parameter_sized": "older than the trace, no stack, parameter-sized",
    "pre_trace_copies": "older than the trace, no stack: the copies of each parameter size split by role",
    "pre_trace_workspace": "older than the trace, no stack, a cuBLAS workspace's size (none made in the trace)",
    "pre_trace_weights": "older than the trace, no stack, alive through every forward of an inference trace",
    "pre_trace_freed_by_zero_grad": "older than the trace, freed by zero_grad",
    "pre_trace_freed_by_optimizer": "older than the trace, freed by the optimizer that replaced it",
    "pre_trace_freed": "older than the trace, freed in it",
    "pre_trace_other": "older than the trace, no stack, no other evidence",
    "pre_trace_extra_copy": "older than the trace, no stack, a parameter's size beyond its copies (a buffer?)",
    "state_only_weights": "no trace, no stack: sizes repeated once per layer, as a model's weights are",
}
RULES = tuple(RULE_HELP)
RULE_CODES = {r: i for i, r in enumerate(RULES)}
# rules that label from evidence other than the allocation's own frames
INFERRED_RULES = frozenset(RULES) - {"stack", "pre_trace_stack"}


@dataclass(frozen=True)
class StackFacts:
    """What the stacks say, computed once per snapshot."""

    category: pd.Series  # stack_id -> category (the parallel libraries' rules over the generic ones)
    threads: pd.Series  # stack_id -> main / autograd / other
    eligible: set[int]  # stacks whose category the gradient rule may override
    zero_grad: set[int]  # stacks of zero_grad()
    reduce_scatter: set[int]  # FSDP reduce-scatters: their outputs are sharded gradients
    pipeline_forward: set[int]  # a pipeline stage's forward
    kv_cache: set[int]  # stacks a KV cache allocated or replaced its tensors on
