"""What a plan tells its reader, in words: one place to read and review the plan package's prose.

Templates use :meth:`str.format` fields; the code fills them in. Grouped by where they show:
why a plan cannot be made, the assumptions listed with a plan, what it leaves out, whether it
fits, the strategy's errors, and the rules that explain one planned allocation.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- why no plan (PlanUnsupported)

MISSING_STACKS = (
    "the trace has no stacks: the plan needs them to tell the forward, the backward and the "
    "layers apart (record with torch.cuda.memory._record_memory_history(stacks='python') or "
    "snaplab run)"
)
MISSING_ITERATION = (
    "no whole training iteration in the trace (a forward pass followed by its backward): the "
    "plan replays at least one; record longer (max_entries) or from before a step"
)
PIPELINE_TOO_FEW_BLOCKS = (
    "a pipeline of {stages} stages needs at least {stages} repeated "
    "blocks in the forward pass; the trace shows {n_blocks}"
)

# --------------------------------------------------------------------------- assumptions noted on a plan

NOTE_UNTRACKED = (
    "{count} blocks ({nbytes:,} bytes) were allocated before the trace began: they are kept, "
    "rescaled by their category only"
)
NOTE_NO_BLOCKS = (
    "no repeated layers found in the forward pass: the model is taken as one unit (FSDP wraps "
    "the root only, tensor parallelism shards nothing, pipeline parallelism cannot split it)"
)
NOTE_UNEVEN_BLOCKS = "passes show different numbers of blocks ({counts}); {n_blocks} taken"
NOTE_PARAMETERS_NOT_REPEATED = (
    "the parameters do not repeat {n_blocks} times in allocation order: which "
    "parameters belong to which block is unknown; every parameter is taken as the "
    "model's own (FSDP: the root unit)"
)
NOTE_RECORDED_DDP = "the recorded run used DDP: its buckets are left out, the plan adds its own"
NOTE_BUCKET_VIEW = (
    "it ran with gradient_as_bucket_view: {found} parameter-sized tensors the backward copied "
    "into the buckets are taken as its gradients, alive until the next forward"
)
NOTE_PARAMETERS_BEFORE_TRACE = (
    "the parameters ({nbytes:,} bytes) were allocated before the trace began: which block each "
    "belongs to is unknown, so FSDP's all-gathers and tensor parallelism's shards of them are "
    "not planned (DDP's buckets are)"
)
NOTE_ACTIVATIONS_AS_RECORDED = "every rank runs the recorded per-rank batch: activations as recorded"
TP_LAYERS_NOTE = {
    "blocks": "Linear layers inside the repeated blocks; embeddings, norms and head replicated",
    "all": "every matrix, head and embeddings included",
}
NOTE_TENSOR_PARALLEL = (
    "tensor parallelism: {column_layers} column- and "
    "{row_layers} row-parallel Linear layers per iteration ({tp_layers}: "
    "{which})"
)
NOTE_FSDP_UNITS = "FSDP units: {count} ({named}): each repeated block one unit, the root (everything else) one more"
NOTE_PIPELINE_STAGES = (
    "pipeline stages: {counts} blocks; microbatches of 1/{microbatches} of the "
    "recorded batch (activations taken as proportional to it)"
)
NOTE_RECORDED_OOM = (
    "the recorded run ran out of memory: the plan replays it up to that moment (the "
    "failing request included); what the rest of that iteration would have needed is not "
    "in the trace"
)
NOTE_STRUCTURE = (
    "the structure came from the trace: {iterations} iterations, {n_blocks} repeated "
    "blocks (called from {call_site}), parameters assigned to "
    "blocks by their order"
)

# --------------------------------------------------------------------------- what no plan models

NOT_MODELLED = (
    "memory outside PyTorch's caching allocator: the CUDA context, NCCL's own buffers and "
    "communicators, cuBLAS/cuDNN handles made outside it (typically 0.5–2 GiB per GPU): compare "
    "the plan with the device's capacity minus that",
    "compute-communication overlap and timing: the plan follows the recorded order of operations; "
    "a collective that finishes late (or early) shifts when its buffers are freed, which moves "
    "reserved memory more than the allocated peak",
    "tensor parallelism's backward all-reduces (their buffers) and sequence parallelism; "
    "activations are divided between column- and row-parallel layers only",
    "DDP keeping the first iteration's bucket alive into the next iteration (seen in one recorded "
    "run), uneven ZeRO-1 partitions, FSDP's per-parameter padding beyond 1/N, mixed precision "
    "policies and CPU offload",
    "optimizer state that is not a mirror of the parameters (it is scaled like the parameters it mirrors, by size)",
)

# --------------------------------------------------------------------------- does it fit

FITS_ONLY_BY_RELEASING = (
    "fits only because the allocator releases cached blocks under the limit (peak "
    "reserved {peak_reserved:,} bytes then): expect cudaMalloc "
    "retries"
)
OOM_UNDER_LIMIT = "under the limit the replay runs out of memory at recorded event {event:,}"

# --------------------------------------------------------------------------- a strategy that makes no sense

UNKNOWN_STRATEGY = "unknown strategy {name!r}: one of {strategies} (or zero2, zero3)"
# the strategy's parameters in braces (errors.ParameterError): ``tp=4`` in Python, ``--tp 4`` on the command line
TP_NEEDS_WORLD = "tp over {world} GPUs needs {tp:{world}} (or fsdp+tp for a 2-D mesh)"
TP_DOES_NOT_DIVIDE = "{tp:{degree}} does not divide the world size {world}"
PP_STAGES = "pp over {world} GPUs has {world} stages"
UNKNOWN_SCHEDULE = "unknown schedule {schedule!r}: gpipe or 1f1b"
PP_SPLIT_COUNTS = "{pp_split} needs {stages} block counts of at least 1"
PP_SPLIT_SUM = "{pp_split:{split}} does not add up to the {n_blocks} blocks"
TP_LAYERS_CHOICES = "{tp_layers}: one of {choices}"
BUCKET_CAP_POSITIVE = "{bucket_cap_mb} must be positive"

# --------------------------------------------------------------------------- rules: why one allocation is planned so

# kept as recorded
AS_RECORDED = "as recorded"
RECORDED_RULES = {
    "parameter": "parameters, as recorded",
    "gradient": "gradients, as recorded",
    "optimizer_state": "optimizer state, as recorded",
    "activation": "activations and temporaries, as recorded",
    "inflight_activation": "pipeline in-flight activations, as recorded",
    "fsdp_unsharded_params": "FSDP unsharded parameters, as recorded",
    "comm_buffer": "communication buffers, as recorded",
    "ddp_bucket": "DDP buckets, as recorded",
    "cuda_graph_pool": "CUDA-graph pool, as recorded",
    "private_pool": "private memory pool (owner unknown), as recorded",
    "unknown": "memory older than the trace (unknown), as recorded",
    "other": "other allocations (inputs, caches, workspaces), as recorded",
}
OOM_REQUEST = "the request that ran out of memory, as recorded"
RULE_RECORDED_DDP_DROPPED = "the recorded run's DDP buckets: left out"

# data parallelism (DDP, ZeRO-1, FSDP2, FSDP1); {label} names the strategy
RULE_UNTRACKED_SHARDED = "{category}, 1/{world} per rank ({label})"
RULE_UNTRACKED_KEPT = "{category}, as recorded"
RULE_DDP_BROADCAST = "{label} wrapping: parameter broadcast (flat, temporary)"
RULE_DDP_FIRST_BUCKET = "{label} bucket of the first iteration (every parameter's gradient)"
RULE_DDP_REBUILT_BUCKETS = "{label} buckets, rebuilt at the second iteration"
RULE_DDP_BUCKET_VIEW_GRADIENTS = "gradients: copied into the DDP buckets (gradient_as_bucket_view) and freed"
RULE_PARAMETER_SHARDS = "parameters, 1/{world} shard per rank ({label})"
RULE_SHARDED_OPTIMIZER_STATE = "optimizer state, 1/{world} per rank ({label})"
RULE_FSDP1_FLATTEN = "{label} wrapping: a unit's parameters flattened (temporary)"
RULE_FSDP1_FLAT_SHARD = "parameters, one flat 1/{world} shard per unit ({label})"
RULE_FSDP1_UNSHARDED = "{label} unsharded flat parameter of a unit (all-gathered, padded)"
RULE_FSDP_ALL_GATHER = "{label} all-gather output (flat, one unit{why})"
RULE_FSDP_UNSHARDED = "{label} unsharded parameters of a unit (copied out of the all-gather)"
RULE_FSDP1_REDUCE_SCATTER_INPUT = "{label} reduce-scatter input (a unit's gradients, flat, padded)"
RULE_FSDP_REDUCE_SCATTER_INPUT = "{label} reduce-scatter input (a unit's gradients, flat)"
RULE_FSDP_UNSHARDED_GRADIENTS = "gradients, unsharded, until their unit's reduce-scatter ({label})"
RULE_FSDP_ACCUMULATED = "reduce-scatter output, accumulated into the sharded gradient ({label})"
RULE_FSDP_SHARDED_GRADIENTS = "gradients, 1/{world} shard per rank ({label})"

# tensor parallelism
RULE_GRADIENTS = "gradients of sharded matrices, 1/{degree} (tensor parallel)"
RULE_OPTIMIZER_STATE = "optimizer state of sharded matrices, 1/{degree} (tensor parallel)"
RULE_SHARDED_ACTIVATIONS = "activations between column- and row-parallel layers, 1/{degree} (tensor parallel)"
RULE_BACKWARD_TEMPORARIES = (
    "backward temporaries, scaled like the block's forward tensors of their size (tensor parallel)"
)
RULE_PARTIAL_SUMS = "tensor-parallel all-reduce input: a row-parallel layer's partial sums"
RULE_ROW_OUTPUTS = "row-parallel outputs, all-reduced (replicated, tensor parallel)"
RULE_PARAMETERS = "parameters: sharded matrices 1/{degree}, the rest replicated (tensor parallel)"
RULE_COLUMN_CHUNKS = "distribute_tensor: column chunks (temporary)"

# pipeline parallelism
RULE_FIRST_GRADIENTS = "gradients of the stage's parameters (first microbatch)"
RULE_LATER_GRADIENTS = "weight gradients of later microbatches (accumulated)"
RULE_MODEL_OUTPUT = "the model's output, kept per microbatch until the step ends"
RULE_STAGE_OUTPUT = "the stage's output, sent to the next stage (held until the step ends)"
RULE_SAVED_ACTIVATIONS = "activations saved for a microbatch's backward, 1/{microbatches} of the batch"
RULE_ONE_MICROBATCH = "{what}, one microbatch (1/{microbatches} of the batch)"
RULE_MERGED_OUTPUTS = "the microbatches' outputs, merged into one at the step's end"
RULE_RECV_ACTIVATIONS = "pipeline receive buffers: activations from stage {stage}, one per microbatch"
RULE_RECV_GRADIENTS = "pipeline receive buffers: gradients from stage {stage}, one per microbatch"
