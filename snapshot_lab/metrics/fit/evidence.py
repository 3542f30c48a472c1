"""What the trace shows of one training step, as a :class:`~.tape.Tape` plus the facts the
levers need: the parameters (and which are matrices autocast would copy), the optimizer, the
repeated blocks and where each one's forward and backward are.

Which allocations scale with the batch is decided by what they are: parameters, gradients,
optimizer state, anything made while the model was built or during the optimizer step, and
library caches kept for the process's life (cuBLAS workspaces) do not; the inputs and whatever
the forward and backward made does, except tensors the size of a parameter made by the backward
(a weight's gradient before it is accumulated) and, in a step recorded under autocast, its
copies of the weights and their half-precision gradients (``weight_copies.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo
from ..categories import CATEGORIES, CODES
from ..categories.stacks import one_off_stacks, stack_filenames, stacks_where, stacks_with_file
from ..plan.structure import TrainingStructure, index_ranges, tandem_repeat
from .blocks import block_instances
from .labels import Labels
from .tape import NEVER, Tape, make_tape
from .weight_copies import WEIGHT_MIN_BYTES, weight_copies, weight_sizes

# operations autocast runs in float32 whatever their inputs (torch's "fp32 list" and losses)
AUTOCAST_FP32_OPS = frozenset(
    {
        "softmax",
        "log_softmax",
        "layer_norm",
        "group_norm",
        "rms_norm",
        "cross_entropy",
        "nll_loss",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "normalize",
        "cosine_similarity",
    }
)
_FUNCTIONAL = "torch/nn/functional.py"
# parameters of these modules are what autocast casts to bfloat16 (Linear, convolutions)
_CAST_MODULES = ("torch/nn/modules/linear.py", "torch/nn/modules/conv.py", "transformers/pytorch_utils.py")
OPTIMIZER_FILES = {
    "adamw.py": "adamw",
    "adam.py": "adam",
    "sgd.py": "sgd-momentum",
    "adafactor.py": "adafactor",
    "adagrad.py": "adagrad",
    "rmsprop.py": "rmsprop",
    "lbfgs.py": "lbfgs",
    "bitsandbytes": "8-bit adam",
}


@dataclass(frozen=True)
class BlockSpan:
    """One repeated block's instance in one pass, as positions on the tape."""

    uid: int
    index: int  # which block of the model (0..n-1)
    forward_start: float
    forward_end: float
    backward_start: float
    backward_end: float
    matrix_bytes: int  # its parameters autocast would copy
    # whether its forward saved anything for the backward: a block outside autograd (its parameters
    # frozen and its input needing no gradient, as a fine-tuned model's first layers) saves nothing
    # and has no backward; checkpointing leaves it as it is (fit/frozen.py)
    saves: bool = True


@dataclass(frozen=True)
class PassSpan:
    forward_start: float
    backward_start: float
    backward_end: float
    outside_matrix_bytes: int  # matrices outside the blocks autocast would copy (a head)


@dataclass(frozen=True)
class StepEvidence:
    tape: Tape
    complete: bool  # a whole step (forward, backward, optimizer step) was recorded
    parameter_bytes: int
    optimizer: str
    optimizer_source: str
    optimizer_state_bytes: int  # as recorded (0 when the step was not reached)
    n_blocks: int
    blocks: tuple[BlockSpan, ...]
    passes: tuple[PassSpan, ...]
    notes: tuple[str, ...]
    # the step computes in fp16/bf16 already, its parameters or autocast (precision.py): bf16 autocast halves nothing
    half_precision: bool = False
    # the recorded step checkpoints its activations already: checkpointing it again is no lever
    checkpointed: bool = False
    # the forward runs a torch.compile graph: no layer to checkpoint or cast (fit/model.py)
    compiled: bool = False
    # checkpointing makes the input embeddings' output require a gradient (transformers'): frozen
    # first blocks join autograd under it (fit/frozen.py)
    frozen_join_when_checkpointed: bool = False


MODEL_STATE_CODES = (CODES["parameter"], CODES["gradient"], CODES["optimizer_state"])


def after_the_model(allocs: pd.DataFrame) -> np.ndarray:
    """Per allocation, whether it was made after the model's last parameter (not while it was
    built)."""
    code, pos = allocs["code"].to_numpy(), allocs["pos"].to_numpy()
    params = pos[code == CODES["parameter"]]
    return pos > (params.max() if params.size else -1)


def stack_innermost(frames: SnapshotFrames) -> pd.DataFrame:
    """Per stack_id, its innermost Python frame's file and function (computed once per snapshot)."""
    return memo(frames, "fit.stack_innermost", lambda: _stack_innermost(frames))


def _stack_innermost(frames: SnapshotFrames) -> pd.DataFrame:
    if frames.stacks.empty:
        return pd.DataFrame({"filename": [], "name": []})
    sf = frames.stack_frames.set_index("frame_id")
    rows = frames.stacks.join(sf, on="frame_id")
    rows = rows[rows["line"] > 0].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id")
    return pd.DataFrame(
        {
            "filename": rows["filename"].astype(str).str.replace("\\", "/", regex=False).to_numpy(),
            "name": rows["name"].astype(str).to_numpy(),
        },
        index=rows["stack_id"].to_numpy(),
    )


AUTOCAST_FOLLOWS, AUTOCAST_FP32, AUTOCAST_MATMUL, AUTOCAST_ATTENTION = 0, 1, 2, 3
AUTOCAST_INTEGER = 4  # an integer tensor (max pooling's indices): autocast changes nothing, casts nothing
# a float32-list operation that saves its own result (softmax): it stays float32 under autocast, and
# the matrix multiply that reads it (attention's probabilities times the values) saves a bfloat16
# copy of it as well, where the float32 run's multiply saves the same tensor
AUTOCAST_SAVED_FP32 = 5
SAVED_FP32_OPS = frozenset({"softmax"})
# code that makes and runs fine-tuning adapters (LoRA, PEFT), by its file or function (fit/frozen.py)
ADAPTER_NAMES = re.compile(r"lora|adapter|peft", re.IGNORECASE)
_MATMUL_FILES = r"torch/nn/modules/(?:linear|conv)\.py$|transformers/pytorch_utils\.py$"
_ATTENTION_NAMES = r"attention|attn|scaled_dot_product"


def adapter_rows(frames: SnapshotFrames, sid: np.ndarray) -> np.ndarray:
    """Per allocation (its stack ``sid``), whether code naming LoRA, an adapter or PEFT made it (a
    frame's file or function): among the tensors kept from the model's construction to the
    forward, the adapters that fine-tuning trains in place of the model's parameters
    (fit/frozen.py)."""
    return np.isin(sid, list(memo(frames, "fit.adapter_stacks", lambda: _adapter_stacks(frames))))


def _adapter_stacks(frames: SnapshotFrames) -> set[int]:
    names = frames.stack_frames["name"].astype(str)
    return stacks_where(frames, stack_filenames(frames).str.contains(ADAPTER_NAMES) | names.str.contains(ADAPTER_NAMES))


def autocast_codes(frames: SnapshotFrames) -> dict[int, int]:
    """:func:`_autocast_codes`, computed once per snapshot."""
    return memo(frames, "fit.autocast_codes", lambda: _autocast_codes(frames))


def _autocast_codes(frames: SnapshotFrames) -> dict[int, int]:
    """Per stack, what autocast makes of the tensors made there: float32 (a functional on its
    float32 list, or arithmetic written in the model's own code, where a float32 operand such
    as the residual stream wins), bfloat16 out of a matrix multiply (Linear, convolution) or an
    attention call (its own code: what a float32 kernel kept there may not be made at all under
    bf16, :func:`~snapshot_lab.metrics.fit.levers.bf16_autocast`), or the dtype of the input
    (torch's other modules: norms, ReLU, pooling)."""
    inner = stack_innermost(frames)
    fn, name = inner["filename"], inner["name"]
    fp32 = fn.str.endswith(_FUNCTIONAL) & name.isin(AUTOCAST_FP32_OPS)
    in_torch = fn.str.contains(r"(?:^|/)torch/(?:nn|autograd|utils|_tensor|functional|_jit)", regex=True)
    attention = name.str.contains(_ATTENTION_NAMES, regex=True) & ~fn.str.contains(_MATMUL_FILES, regex=True)
    matmul = fn.str.contains(_MATMUL_FILES, regex=True)
    code = np.where(
        attention,
        AUTOCAST_ATTENTION,
        np.where(matmul, AUTOCAST_MATMUL, np.where(fp32 | ~in_torch, AUTOCAST_FP32, AUTOCAST_FOLLOWS)),
    )
    code = np.where(fp32 & name.isin(SAVED_FP32_OPS), AUTOCAST_SAVED_FP32, code)
    # an adapter's own arithmetic (PEFT's LoRA: its update scaled and added to the frozen layer's
    # output) reads matrix multiplies' outputs only: bfloat16 under autocast, not the float32 of a
    # model's own arithmetic (GPT-2 with PEFT's LoRA under bf16 was +21%, fit_gpt2peft_*)
    adapter = fn.str.contains(ADAPTER_NAMES) & ~in_torch
    code = np.where(adapter & (code == AUTOCAST_FP32), AUTOCAST_FOLLOWS, code)
    return {int(s): int(c) for s, c in zip(inner.index, code, strict=True)}


# nn.MultiheadAttention multiplies by its two weights in these functions of torch.nn.functional
_MHA_FUNCTIONS = ("_in_projection_packed", "_in_projection", "multi_head_attention_forward")


def mha_stacks(frames: SnapshotFrames) -> set[int]:
    """Stacks whose innermost frame is ``nn.MultiheadAttention``'s functional forward (its
    projections, and the attention between them)."""
    inner = stack_innermost(frames)
    hit = inner["filename"].str.endswith(_FUNCTIONAL) & inner["name"].isin(_MHA_FUNCTIONS)
    return set(inner.index[hit].astype(int).tolist())


def layer_weights(s: TrainingStructure) -> np.ndarray:
    """The bytes of the weights layers multiply by (``weight_copies.weight_sizes``), those older
    than the trace too (a ring buffer that wrapped: no parameter was made in it)."""
    older = [n for n, c, _ in s.untracked if c == "parameter" and n >= WEIGHT_MIN_BYTES]
    return np.concatenate([weight_sizes(s.params), np.array(older, dtype=np.int64)])


def multiplies_weights(frames: SnapshotFrames, sid: np.ndarray) -> np.ndarray:
    """Per allocation (its stack ``sid``), whether its innermost frame multiplies by a weight: a
    Linear, a convolution, ``nn.MultiheadAttention``'s functions."""
    matmul = [s for s, code in autocast_codes(frames).items() if code == AUTOCAST_MATMUL]
    return np.isin(sid, matmul) | np.isin(sid, list(mha_stacks(frames)))


def forward_weight_copies(frames: SnapshotFrames, s: TrainingStructure) -> np.ndarray:
    """Per allocation, whether it is autocast's copy of a weight made by a forward on the
    program's thread, after the model was built (``fit/weight_copies.py``). A library's cache is
    no part of a layer's run: cuBLAS's workspace, made on the first matrix multiply's line after
    its output, made that output look like a copy (float32 L-BFGS MLP, ``fw_lbfgs_python``)."""

    def compute() -> np.ndarray:
        a = s.allocs
        sid = a["sid"].to_numpy()
        made = after_the_model(a) & a["main"].to_numpy() & ~np.isin(sid, list(one_off_stacks(frames)))
        return weight_copies(frames, a, made, multiplies_weights(frames, sid), layer_weights(s))

    return memo(frames, ("fit.forward_weight_copies", s.device), compute)


KV_CACHE_FILE = "transformers/cache_utils.py"
KV_CACHE = "kv_cache"  # the tape category of a KV cache's copies of keys and values


def kv_cache_stacks(frames: SnapshotFrames) -> set[int]:
    """Stacks whose innermost frame is a transformers KV cache (its update copies the layer's
    keys and values): under gradient checkpointing transformers turns the cache off."""
    inner = stack_innermost(frames)
    return set(inner.index[inner["filename"].str.endswith(KV_CACHE_FILE)].astype(int).tolist())


def cast_param_stacks(frames: SnapshotFrames) -> set[int]:
    """Stacks that made a Linear's or convolution's parameter."""
    return stacks_with_file(frames, _CAST_MODULES)


def autocast_copied(frames: SnapshotFrames, sid: np.ndarray, sizes: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """Per parameter (creation stack ``sid``, bytes ``sizes``, whether it is a matrix), whether
    autocast makes a bfloat16 copy of it for the forward: a matrix a Linear or a convolution made.
    A model moved with ``.to("cuda")`` makes every parameter in ``Module._apply``, so no stack
    names the module: then every matrix is copied, but the first when the last has its size (an
    embedding with an untied head of its shape, Llama's: looked up, not multiplied). The bf16
    recordings of every fit family show the copies (GPT-2's tied embedding, copied for its head)."""
    named = np.isin(sid, list(cast_param_stacks(frames)))
    if named.any():
        return named & matrix
    copied = matrix.copy()
    mats = np.flatnonzero(matrix)
    if mats.size >= 2 and sizes[mats[0]] == sizes[mats[-1]]:
        copied[mats[0]] = False
    return copied


# the optimizer classes torch's step annotations name (``Optimizer.step#AdamW.step``) where their
# source file does not tell them apart: torch's AdamW runs Adam's code (torch/optim/adam.py)
ANNOTATED_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam"}


def optimizer_in_stacks(frames: SnapshotFrames) -> str | None:
    """The optimizer whose source file appears on the stacks (None: none did), named by the
    class the step's annotation gives where the file is another class's (every AdamW recording of
    torch 2.11 steps in ``adam.py``: it was called Adam)."""
    files = stack_filenames(frames)
    for key, name in OPTIMIZER_FILES.items():
        pattern = "bitsandbytes/optim" if key == "bitsandbytes" else f"/torch/optim/{key}"
        if files.str.contains(pattern, regex=False).any():
            annotated = _annotated_optimizer(frames)
            return annotated if name in ANNOTATED_OPTIMIZERS.values() and annotated else name
    return None


def _annotated_optimizer(frames: SnapshotFrames) -> str | None:
    """The optimizer class of the trace's ``Optimizer.step#<Class>.step`` annotations, when it is
    one of :data:`ANNOTATED_OPTIMIZERS` (None: no such annotation)."""
    names = frames.annotations.get("name")
    if names is None or names.empty:
        return None
    found = names.astype(str).str.extract(r"^Optimizer\.step#(\w+)\.step$")[0].dropna()
    return next((ANNOTATED_OPTIMIZERS[c] for c in found.unique() if c in ANNOTATED_OPTIMIZERS), None)


def transformers_token_model(frames: SnapshotFrames) -> bool:
    """Whether a transformers model that reads token ids ran the forward: a model file of
    transformers' on a stack whose innermost frame is an embedding lookup. Its
    ``gradient_checkpointing_enable()`` makes the input embeddings' output require a gradient
    (transformers 5: for every model whose main input is ``input_ids``), so that under
    checkpointing its frozen first layers join autograd (fit/frozen.py)."""
    inner = stack_innermost(frames)
    lookups = set(inner.index[inner["name"] == "embedding"].astype(int).tolist())
    if not lookups:
        return False
    model_file = stack_filenames(frames).str.contains("/transformers/models/", regex=False)
    return bool(lookups & stacks_where(frames, model_file))


def hf_trainer_in_stacks(frames: SnapshotFrames) -> bool:
    """Whether transformers' Trainer ran the recorded job (its training loop on the stacks)."""
    return bool(stacks_with_file(frames, ("/transformers/trainer.py",)))


# Lightning's automatic optimization: the closure it runs inside the optimizer's step
LIGHTNING_CLOSURE_FILES = (
    "/lightning/pytorch/loops/optimization/automatic.py",
    "/pytorch_lightning/loops/optimization/automatic.py",
)


def lightning_closure_in_stacks(frames: SnapshotFrames) -> bool:
    """Whether Lightning's automatic optimization ran the recorded forward: it runs the training
    step inside ``optimizer.step(closure)`` and zeroes the gradients in the closure, after the
    forward and before the backward, so a step's gradients live through the next forward."""
    return bool(stacks_with_file(frames, LIGHTNING_CLOSURE_FILES))


# the files that make a checkpointed forward: torch's (its own, transformers' gradient
# checkpointing, FSDP's checkpoint_wrapper and Lightning's all call it) and DeepSpeed's
CHECKPOINT_FILES = ("/torch/utils/checkpoint.py", "/deepspeed/runtime/activation_checkpointing/")


def checkpointing_in_stacks(frames: SnapshotFrames) -> bool:
    """Whether the recorded job checkpoints activations: a checkpointing function on the stacks
    (its forward, or the forward it re-runs in the backward). In the samples, exactly those
    recorded with checkpointing (tests/test_fit_checkpointed.py): torch.utils.checkpoint called
    directly (ResNet-50, ConvNeXt, ViT) or by transformers (GPT-2, Llama, T5), with Python or C++
    stacks."""
    files = stack_filenames(frames)
    return any(files.str.contains(pattern, regex=False).any() for pattern in CHECKPOINT_FILES)


def phase_column(s: TrainingStructure) -> Labels:
    """Every recorded allocation's phase: the structure's own codes, one byte a row."""
    column = s.allocs["phase"]
    return Labels(column.cat.codes.to_numpy(), tuple(column.cat.categories))


def row_categories(frames: SnapshotFrames, s: TrainingStructure, complete: bool) -> tuple[Labels, np.ndarray]:
    """Tape category of every recorded allocation and whether it scales with the batch."""
    a = s.allocs
    code = a["code"].to_numpy()
    phases = phase_column(s)
    size = a["size"].to_numpy()
    sid = a["sid"].to_numpy()
    model_state = np.isin(code, MODEL_STATE_CODES)
    data = phases == "data"
    in_pass = phases.isin(("data", "forward", "backward"))
    # library caches, and torch.compile's autotuning on a compiled graph's first run: neither
    # grows with the batch (the autotuning grew the compiled MLP's step by 134% at 64x its batch)
    cache = np.isin(sid, list(one_off_stacks(frames)))
    kept = complete & (a["free_pos"].to_numpy() < 0) & ~data
    # the forward, and a checkpointed block's forward run again in the backward (it has stacks)
    ran = phases.isin(("forward", "backward")) & ~model_state & ~cache & ~kept
    made = ran & (phases == "forward")
    weights = layer_weights(s)
    copies = weight_copies(frames, a, ran, multiplies_weights(frames, sid), weights)
    # a weight's gradient before it is accumulated (GPT-2's tied embedding; under autocast, half
    # a weight) does not scale; a size the forward also made as an activation is the gradient of
    # one (Llama's logits at batch 2 x 512 tokens are its 32000 x 1024 head's size)
    made_by_forward = size[made & ~copies]
    grad_sizes = np.concatenate([s.params["size"].to_numpy(), weights // 2 if copies.any() else weights[:0]])
    param_sized = (phases == "backward") & np.isin(size, grad_sizes)
    param_sized[param_sized] = ~np.isin(size[param_sized], made_by_forward)
    scales = in_pass & ~model_state & ~cache & ~kept & ~param_sized & ~copies
    # by position in NAMES: the recorded category of model state, else what the row is
    names = (*CATEGORIES, "input", "activation", "workspace", KV_CACHE)
    made = np.where(scales, np.where(data, len(CATEGORIES), len(CATEGORIES) + 1), len(CATEGORIES) + 2)
    which = np.where(model_state, np.clip(code, 0, len(CATEGORIES) - 1), made).astype(np.int8)
    which[scales & np.isin(sid, list(kv_cache_stacks(frames)))] = len(CATEGORIES) + 3
    return Labels(which, names), scales


def allocation_codes(frames: SnapshotFrames, s: TrainingStructure) -> np.ndarray:
    """Per allocation, what autocast makes of it: its stack's code (:func:`autocast_codes`), but
    for max pooling's indices (:func:`pool_indices`), int64 whatever autocast does, and a KV
    cache's copies, which take the dtype of the tensor made last before them: transformers' cache
    makes its keys and values in its first key's dtype, bfloat16 where the key comes straight out
    of a projection (GPT-2's, halved by bf16), float32 where the model's own arithmetic made it
    (a rotary embedding with float32 cos and sin: Phi, GPT-NeoX, Llama, whose bf16 recordings keep
    their caches at the float32 recording's size)."""
    a = s.allocs
    sid = a["sid"].to_numpy()
    codes = _stack_codes(sid, autocast_codes(frames))
    codes[pool_indices(frames, a)] = AUTOCAST_INTEGER
    cache = np.isin(sid, list(kv_cache_stacks(frames)))
    if cache.any():
        order = np.argsort(a["pos"].to_numpy(), kind="stable")
        made = np.where(cache[order], -1, np.arange(order.size))
        source = np.maximum.accumulate(made)[cache[order]]  # the tensor made last before each update
        codes[order[cache[order]]] = np.where(source >= 0, codes[order[np.maximum(source, 0)]], AUTOCAST_FOLLOWS)
    return codes


def pool_indices(frames: SnapshotFrames, allocs: pd.DataFrame) -> np.ndarray:
    """Per allocation, whether it is the indices a max pooling saves for its backward: made on
    a max-pool's stack right after its output, twice a float32 output's size (int64) or four
    times a half-precision one's. ResNet-18 keeps 1.6 MB of them per sample beside its 0.8 MB
    output: taken as halved by bf16, its bf16 answer was 7% low at batch 256 (ResNet-50's, of
    the same size but a larger whole, 1%)."""
    inner = stack_innermost(frames)
    hit = inner["filename"].str.endswith(_FUNCTIONAL) & inner["name"].str.contains("max_pool", regex=False)
    sid = allocs["sid"].to_numpy()
    size = allocs["size"].to_numpy()
    out = np.zeros(sid.size, dtype=bool)
    if not hit.any() or sid.size < 2:
        return out
    order = np.argsort(allocs["pos"].to_numpy(), kind="stable")
    sid_o, size_o = sid[order], size[order]
    pooled = np.isin(sid_o[1:], inner.index[hit].to_numpy())
    ratio = size_o[1:] / np.maximum(size_o[:-1], 1)
    after_output = pooled & (sid_o[1:] == sid_o[:-1]) & ((ratio == 2) | (ratio == 4))
    out[order[1:][after_output]] = True
    return out


def _stack_codes(sid: np.ndarray, codes: dict[int, int]) -> np.ndarray:
    """Per allocation its stack's autocast code (AUTOCAST_FOLLOWS for a stack without one)."""
    if not sid.size:
        return np.zeros(0, dtype=np.int8)
    low, high = int(sid.min()), int(sid.max())
    if high - low > 4 * sid.size + (1 << 16):  # sparse ids: one code per distinct stack
        distinct, inverse = np.unique(sid, return_inverse=True)
        per_stack = np.array([codes.get(stack_id, AUTOCAST_FOLLOWS) for stack_id in distinct.tolist()], dtype=np.int8)
        return per_stack[inverse.reshape(-1)]
    table = np.full(high - low + 1, AUTOCAST_FOLLOWS, dtype=np.int8)
    for stack_id, code in codes.items():
        if low <= stack_id <= high:
            table[stack_id - low] = code
    return table[sid - low]


def param_facts(frames: SnapshotFrames, s: TrainingStructure) -> tuple[int, np.ndarray]:
    """Parameter bytes and, per parameter, whether autocast would copy it."""
    sizes = s.params["size"].to_numpy(dtype=np.int64)
    rows = s.params["row"].to_numpy()
    sid = s.allocs["sid"].to_numpy()[rows]
    older = sum(n for n, c, _ in s.untracked if c == "parameter")
    # adapters (PEFT's, parameters after the model's) are no layer's weight autocast would copy, and
    # would hide the head that autocast_copied compares with the embedding
    model = ~adapter_rows(frames, sid)
    castable = np.zeros(sizes.size, dtype=bool)
    castable[model] = autocast_copied(frames, sid[model], sizes[model], s.params["matrix"].to_numpy(dtype=bool)[model])
    return int(sizes.sum()) + int(older), castable


def recorded_tape(frames: SnapshotFrames, s: TrainingStructure, complete: bool, uid: np.ndarray) -> Tape:
    """Every allocation of the trace (and the blocks older than it, from the start); ``uid``:
    per allocation, the block instance it belongs to (-1: none)."""
    a = s.allocs
    fp32 = allocation_codes(frames, s)
    cat, scales = row_categories(frames, s, complete)
    size = a["size"].to_numpy(dtype=np.float64)
    free_pos = a["free_pos"].to_numpy()
    end = np.where(free_pos >= 0, free_pos.astype(np.float64), NEVER)
    tape = make_tape(
        a["pos"].to_numpy(dtype=np.float64),
        end,
        np.where(scales, 0.0, size),
        np.where(scales, size, 0.0),
        cat,
        a["stream"].to_numpy(dtype=np.int64),
        phase_column(s),
        uid,
        fp32,
    )
    if not s.untracked:
        return tape
    old = np.array([n for n, _, _ in s.untracked], dtype=np.float64)
    older = make_tape(
        np.full(old.size, -1.0),
        np.full(old.size, NEVER),
        old,
        np.zeros(old.size),
        np.array([c if c in CATEGORIES else "workspace" for _, c, _ in s.untracked], dtype=object),
        np.array([st for _, _, st in s.untracked], dtype=np.int64),
        "setup",
    )
    return older.with_rows(tape)


BLOCK_UID_STRIDE = 1_000  # block instance uid: pass * stride + block


def block_spans(
    frames: SnapshotFrames, s: TrainingStructure, castable: np.ndarray
) -> tuple[np.ndarray, tuple[BlockSpan, ...], tuple[PassSpan, ...]]:
    """Per allocation its block instance (-1: none), and where every block instance and every
    pass is on the recorded trace: a block's backward from the first of its saved tensors freed
    to the last."""
    a = s.allocs
    pos, free_pos = a["pos"].to_numpy(), a["free_pos"].to_numpy()
    main = a["main"].to_numpy()
    uid = np.full(len(a), -1, dtype=np.int64)
    found = _forward_blocks(frames, s)
    first_pos, last_pos = pos[found.first], pos[found.last]
    # a block's allocations on the program's thread: from its first forward allocation to its last
    rows, owner = index_ranges(np.searchsorted(pos, first_pos, "left"), np.searchsorted(pos, last_pos, "right"))
    rows, owner = rows[main[rows]], owner[main[rows]]
    block_uid = found.pass_index * BLOCK_UID_STRIDE + found.index
    uid[rows] = block_uid[owner]
    backward_start = np.array([one_pass.backward_start for one_pass in s.passes], dtype=np.int64)
    backward_end = np.array([one_pass.backward_end for one_pass in s.passes], dtype=np.int64)
    saved = free_pos[rows] >= backward_start[found.pass_index][owner]
    first_free, last_free = _segment_bounds(free_pos[rows][saved], owner[saved], first_pos.size)
    some = np.bincount(owner[saved], minlength=first_pos.size) > 0
    start = np.where(some, first_free - 0.5, backward_start[found.pass_index].astype(np.float64))
    end = np.where(some, last_free, backward_end[found.pass_index].astype(np.float64))
    # a block's backward begins once the next block's is over: before the gradients its own
    # backward makes, not at the first saved tensor it frees
    follows = (block_uid[1:] == block_uid[:-1] + 1) & (end[1:] + 0.25 < start[:-1])
    own_start = start.copy()
    start[:-1][follows] = end[1:][follows] + 0.25
    # nor before the backward of what ran between it and the next block is over (its output, which
    # the next block saved; ConvNeXt's downsampling layers): the latest free of what they made
    same_pass = found.pass_index[1:] == found.pass_index[:-1]
    lo, hi = np.searchsorted(pos, last_pos[:-1], "right"), np.searchsorted(pos, first_pos[1:], "left")
    limit = backward_end[found.pass_index[:-1]]
    for i in np.flatnonzero(same_pass & (hi > lo)).tolist():
        frees = free_pos[lo[i] : hi[i]][main[lo[i] : hi[i]]]
        frees = frees[(frees < limit[i]) & (frees >= backward_start[found.pass_index[i]])]
        if frees.size:
            start[i] = max(start[i], min(float(frees.max()) + 0.25, own_start[i]))
    p_size = s.params["size"].to_numpy()
    adapters = adapter_rows(frames, s.allocs["sid"].to_numpy()[s.params["row"].to_numpy()])
    matrices = {count: _matrix_bytes(s, count, p_size, castable, adapters) for count in set(found.counts.tolist())}
    blocks = tuple(
        BlockSpan(*fields)
        for fields in zip(
            block_uid.tolist(),
            found.index.tolist(),
            first_pos.astype(np.float64).tolist(),
            last_pos.astype(np.float64).tolist(),
            start.tolist(),
            end.tolist(),
            [
                # autocast caches no copy of a frozen weight: it casts it at each use, and frees it
                matrices[count][index] if saves else 0
                for count, index, saves in zip(
                    found.count_of.tolist(), found.index.tolist(), some.tolist(), strict=True
                )
            ],
            some.tolist(),
            strict=True,
        )
    )
    passes = tuple(
        PassSpan(one_pass.forward_start, one_pass.backward_start, one_pass.backward_end, matrices[count][-1])
        for one_pass, count in zip(s.passes, found.counts.tolist(), strict=True)
    )
    return uid, blocks, passes


@dataclass(frozen=True)
class _FoundBlocks:
    """The block instances :func:`~.blocks.block_instances` finds in every pass's forward, in
    pass order: per instance its pass, its index in the pass, its first and last row and how
    many its pass has; per pass how many it has."""

    pass_index: np.ndarray
    index: np.ndarray
    first: np.ndarray
    last: np.ndarray
    count_of: np.ndarray
    counts: np.ndarray


def _forward_blocks(frames: SnapshotFrames, s: TrainingStructure) -> _FoundBlocks:
    allocs = s.allocs
    pos, sid = allocs["pos"].to_numpy(), allocs["sid"].to_numpy()
    forward = np.flatnonzero(allocs["main"].to_numpy() & allocs["module"].to_numpy())
    low = np.searchsorted(pos[forward], [one_pass.forward_start for one_pass in s.passes], "left").tolist()
    high = np.searchsorted(pos[forward], [one_pass.backward_start for one_pass in s.passes], "left").tolist()
    # a training loop repeats the same forward: each distinct one is cut into blocks once
    cuts: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
    firsts, lasts = [], []
    for start, stop in zip(low, high, strict=True):
        rows = forward[start:stop]
        stack_ids = sid[rows]
        key = stack_ids.tobytes()
        if key not in cuts:
            instances = block_instances(frames, np.arange(rows.size), stack_ids)
            cuts[key] = (
                np.array([members[0] for members in instances], dtype=np.int64),
                np.array([members[-1] for members in instances], dtype=np.int64),
            )
        firsts.append(rows[cuts[key][0]])
        lasts.append(rows[cuts[key][1]])
    counts = np.array([first.size for first in firsts], dtype=np.int64)
    pass_index = np.repeat(np.arange(counts.size), counts)
    empty = np.zeros(0, dtype=np.int64)
    return _FoundBlocks(
        pass_index=pass_index,
        index=np.arange(pass_index.size) - (np.cumsum(counts) - counts)[pass_index],
        first=np.concatenate([empty, *firsts]),
        last=np.concatenate([empty, *lasts]),
        count_of=counts[pass_index],
        counts=counts,
    )


def _segment_bounds(values: np.ndarray, owner: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per segment the smallest and the largest of its ``values``, as floats (infinite: none)."""
    smallest, largest = np.full(count, np.inf), np.full(count, -np.inf)
    np.minimum.at(smallest, owner, values.astype(np.float64))
    np.maximum.at(largest, owner, values.astype(np.float64))
    return smallest, largest


def parameter_repeat(keys: np.ndarray, reach: int = 8) -> tuple[int, int, int]:
    """:func:`~..plan.structure.tandem_repeat` of the parameters' keys, the period also sought
    among the distances from a key to its next ``reach`` occurrences, not only the next one: a
    Llama layer makes every size at least twice (q and o, k and v, its three MLP matrices, its
    two norms), so no key's next occurrence is a layer away and the best repeat was its MLP's
    three matrices (3 layers of 8)."""
    period, start, count = tandem_repeat(keys)
    order = np.argsort(keys, kind="stable")
    candidates: set[int] = set()
    for ahead in range(2, reach + 1):
        same = keys[order][ahead:] == keys[order][:-ahead]
        candidates.update(int(gap) for gap in np.unique((order[ahead:] - order[:-ahead])[same]))
    best = (count * period, -period, start, count)
    for candidate in sorted(gap for gap in candidates if 0 < gap <= keys.size // 2):
        equal = keys[:-candidate] == keys[candidate:]
        padded = np.r_[False, equal, False]
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        if not edges.size:
            continue
        longest = int(np.argmax(edges[1::2] - edges[::2]))
        run, run_start = int(edges[1::2][longest] - edges[::2][longest]), int(edges[::2][longest])
        run_count = (run + candidate) // candidate
        key = (run_count * candidate, -candidate, run_start, run_count)
        if run_count >= 2 and key > best:
            best = key
    return (-best[1], best[2], best[3]) if best[0] else (0, 0, 0)


def _matrix_bytes(
    s: TrainingStructure, n_blocks: int, p_size: np.ndarray, castable: np.ndarray, adapters: np.ndarray
) -> list[int]:
    """With ``n_blocks`` blocks in the forward: per block the bytes of its parameters autocast
    would copy, then those of the parameters outside the blocks. Adapters (``adapters``, a mask)
    are neither: PEFT's repeat once a block as well, and were taken for the blocks' parameters,
    the model's every matrix for one outside them, copied for the whole pass (GPT-2 and the Llama
    with PEFT's LoRA, checkpointing and bf16 +18% to +23% at their smallest batches)."""
    mapped = _param_blocks(s, n_blocks, ~adapters)
    model = castable & ~adapters
    inside = [int(p_size[model & (mapped == j)].sum()) for j in range(n_blocks)]
    return [*inside, int(p_size[model & (mapped < 0)].sum())]


def _param_blocks(s: TrainingStructure, n_blocks: int, keep: np.ndarray) -> np.ndarray:
    """Per parameter its block, when the parameters in ``keep`` (a mask) repeat as many times as
    the forward's blocks (else -1: all taken as outside the blocks; -1 outside ``keep``)."""
    kept = np.flatnonzero(keep)
    sizes = s.params["size"].to_numpy()[kept]
    keys = sizes * 1_000_003 + s.allocs["sid"].to_numpy()[s.params["row"].to_numpy()[kept]]
    out = np.full(keep.size, -1, dtype=np.int64)
    for k in (keys, sizes):
        period, start, count = parameter_repeat(k)
        if count >= n_blocks >= 2 and period:
            for j in range(n_blocks):
                out[kept[start + j * period : start + (j + 1) * period]] = j
            return out
    return out
