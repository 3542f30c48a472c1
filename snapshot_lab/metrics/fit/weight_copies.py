"""Which tensors of a recorded forward are autocast's copies of the weights (issue #20).

Under ``torch.autocast`` a float32 model's Linear and convolution layers make a half-precision
copy of their weight in every forward, half the weight's size, and a half-precision weight
gradient in the backward before it is accumulated into the float32 one. Neither depends on the
batch. Taken for activations, they grew with the batch: from a step recorded under bf16
autocast, every prediction at a larger batch was too high (ViT-B/16 at 8x its recorded batch:
+22%, with checkpointing +52%; Llama +19%, BERT +21%) and every largest batch too small.

The trace has sizes and stacks, no dtypes. A layer's call makes its casts and then its output
on one line of Python (``F.linear(input, self.weight, self.bias)``), so they share one Python
stack; the casts come first (torch casts the arguments right to left: bias, weight, input) and
the output last. In each run of consecutive allocations on one Python stack whose innermost
frame multiplies by a weight (a Linear, a convolution, ``nn.MultiheadAttention``'s functions in
``torch.nn.functional``), the first that is half the size of a weight is that weight's copy,
unless it is the run's last (the output). The forward's runs, and a checkpointed block's forward
run again in the backward, which has stacks too. Weights are the parameters the structure takes
for matrices, and any of 256 KiB or more (where no repeated block was found, T5's, nothing is a
matrix; a bias is rarely that large).

Measured, copies per forward pass against the layers' weights:

- under bf16 autocast: GPT-2 49 (48 of its blocks, the tied head), Llama 57, BERT 74, GPT-NeoX
  49, OPT 73, T5 97 (six encoder and six decoder layers and the head), ViT-B/16 50 (24 of them
  in ``nn.MultiheadAttention``), ResNet-50 42, ConvNeXt-Tiny 34, EfficientNet-B0 25 (the
  smallest convolutions' copies are below the weights' sizes); an MLP under float16 autocast 6
  of 6, with Python or C++ stacks;
- the same models without autocast: none, but one per pass in float32 ConvNeXt-Tiny and OPT (an
  output of that size made before another on the same line); GPT-2 with bfloat16 parameters
  under autocast, which casts no weight, 25 per pass: the float32 outputs of its layer norms
  cast for the next layer, 6 MiB at batch 4, half its 12 MiB embedding.

With Python stacks alone, cuBLAS's workspace, made on the first matrix multiply's line after its
output, makes that output look like a copy: once in a trace (the float32 L-BFGS MLP of
``fw_lbfgs_python``, one weight size). So the copies count only where there are two or more, of
more than half of the weights' distinct sizes, as autocast copies every weight: 1 of 1 to 10 of
10 under autocast (BERT and OPT 3 of 4), 1 of 7, 1 of 4 and 1 of 5 in those three.

Weights older than the trace count too: a ring buffer that wrapped holds no parameter's making
(``midrun_wrapped_python``, a GPT-2 under bf16 autocast, read as float32 without them).

A simpler rule, "every forward tensor half a weight's size", takes 222 tensors of float32 GPT-2
at batch 4 for copies (its float32 residual stream, 12 MiB, is half its tied embedding) and 406
of Llama under bf16 at batch 2 (its queries are 2 MiB, half of its query weight), against 98
and 114 copies.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo

MIN_COPIES = 2
WEIGHT_MIN_BYTES = 256 * 1024  # a parameter this large is a weight even when not a matrix of a block
_MULTIPLIERS = np.arange(1, 62, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


def python_stack_keys(frames: SnapshotFrames) -> pd.Series:
    """Per stack id, a hash of its Python frames alone (C++ frames differ between a cast and the
    operation after it; their Python frames do not)."""
    return memo(frames, ("fit.python_stack_keys",), lambda: _python_stack_keys(frames))


def _python_stack_keys(frames: SnapshotFrames) -> pd.Series:
    if frames.stacks.empty:
        return pd.Series(dtype=np.uint64)
    line = frames.stack_frames.set_index("frame_id")["line"]
    st = frames.stacks
    py = st[line.reindex(st["frame_id"]).to_numpy() > 0].sort_values(["stack_id", "depth"], kind="stable")
    rank = py.groupby("stack_id").cumcount().to_numpy() % _MULTIPLIERS.size
    with np.errstate(over="ignore"):
        h = (py["frame_id"].to_numpy().astype(np.uint64) + np.uint64(1)) * _MULTIPLIERS[rank]
    ids, inverse = np.unique(py["stack_id"].to_numpy(), return_inverse=True)
    out = np.zeros(ids.size, dtype=np.uint64)
    np.add.at(out, inverse.reshape(-1), h)
    return pd.Series(out, index=ids)


def weight_copies(
    frames: SnapshotFrames,
    allocs: pd.DataFrame,
    forward: np.ndarray,
    matmul: np.ndarray,
    weight_sizes: np.ndarray,
) -> np.ndarray:
    """Per row of ``allocs``, whether it is autocast's copy of a weight (module docstring).
    ``forward``: the rows a forward made (a checkpointed block's re-run in the backward too);
    ``matmul``: the rows whose innermost frame multiplies by a weight (a Linear, a convolution,
    ``nn.MultiheadAttention``'s functions); ``weight_sizes``: the weights' bytes."""
    out = np.zeros(len(allocs), dtype=bool)
    half = np.unique(weight_sizes // 2)
    if not forward.any() or not half.size:
        return out
    order = np.argsort(allocs["pos"].to_numpy(), kind="stable")
    rows = order[forward[order]]
    keys = python_stack_keys(frames)
    key = keys.reindex(allocs["sid"].to_numpy()[rows]).fillna(0).to_numpy(dtype=np.uint64)
    mm = matmul[rows]
    starts = np.ones(rows.size, dtype=bool)
    starts[1:] = (key[1:] != key[:-1]) | ~mm[1:] | ~mm[:-1]
    run = np.cumsum(starts) - 1
    last = np.ones(rows.size, dtype=bool)
    last[:-1] = starts[1:]
    candidate = np.flatnonzero(mm & ~last & np.isin(allocs["size"].to_numpy()[rows], half))
    first = rows[candidate[np.unique(run[candidate], return_index=True)[1]]]
    distinct = np.unique(weight_sizes)
    covered = np.isin(distinct // 2, allocs["size"].to_numpy()[first])
    # autocast copies every weight, not one size by chance, nor one tensor: with Python stacks
    # alone, cuBLAS's workspace is made on the first matrix multiply's line, after its output
    if 2 * int(covered.sum()) > distinct.size and first.size >= MIN_COPIES:
        out[first] = True
    return out


def weight_sizes(params: pd.DataFrame) -> np.ndarray:
    """The bytes of the parameters a layer multiplies (the structure's matrices, and any of
    WEIGHT_MIN_BYTES or more)."""
    size = params["size"].to_numpy(dtype=np.int64)
    return size[params["matrix"].to_numpy(dtype=bool) | (size >= WEIGHT_MIN_BYTES)]
