"""A convolutional network whose forward ran out of memory inside its first block (ResNet-50 at
a large batch): the rest of the model is read from its parameters.

The parameters, in the order the model made them (which is the order its forward runs them in
torchvision's ResNets and most CNNs), are convolutions each followed by a batch norm (a weight,
a bias, two running statistics and a count of 8 bytes), then a linear head. From their sizes:

- each convolution's output width (its batch norm's) and input width: the previous layer's output,
  or, for a projection shortcut, the block's input (the one of the two whose kernel area is
  1, 9, 25 or 49);
- the blocks: every block has as many convolutions on its main path (the first count that reads
  the whole sequence); a block ends at that count when it keeps its input's width, else at the
  projection shortcut that follows;
- the feature map: the trace shows it at the first block (its first convolution's output); it
  halves in each dimension in every block whose projection doubles the width (the ResNet paper's
  rule), from that block's first 3x3 convolution (torchvision's ResNet v1.5 strides there) and
  in its projection.

Every convolution and batch norm keeps its output for the backward (a batch norm's input, a
ReLU's result), plus the batch norm's two statistics; a projection's batch-norm output is added to
the block's output and freed with the block. Pooling and the head make one vector per sample and
are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...frames import SnapshotFrames
from .evidence import BLOCK_UID_STRIDE, stack_innermost

KERNEL_AREAS = (1, 9, 25, 49)
MAX_MAIN_PATH = 4  # convolutions on a block's main path, at most
NORM_PARAMS = 5  # weight, bias, running mean, running variance, count
COUNT_BYTES = 8
CONV_FILE = "torch/nn/modules/conv.py"
ASSUMED = (
    "the forward ran out of memory inside its first block: the model's {blocks} blocks are read from its "
    "parameters (convolutions each followed by a batch norm; widths from their sizes, blocks from the projection "
    "shortcuts); the feature map halves in each dimension in every block whose projection doubles the width (the "
    "ResNet paper's rule, from the block's first 3x3 convolution); pooling and the head are left out"
)


@dataclass(frozen=True)
class ConvLayer:
    weight: int  # index among the parameters
    width: int  # output channels
    block: int  # -1: before the blocks (the stem)
    projection: bool = False
    bytes_per_channel: float = 0.0  # output bytes per channel at the recorded batch


def _conv_norm_pairs(p_size: np.ndarray) -> tuple[list[tuple[int, int]], int] | None:
    """(weight index, output width) of every convolution followed by a batch norm, and where the
    parameters after them (the head) begin; None when the parameters are not such a sequence."""
    out, i, n = [], 0, p_size.size
    while i + NORM_PARAMS < n:
        norm = p_size[i + 1 : i + NORM_PARAMS]
        if p_size[i + NORM_PARAMS] != COUNT_BYTES or len(set(norm.tolist())) != 1 or norm[0] % 4:
            break
        out.append((i, int(norm[0]) // 4))
        i += NORM_PARAMS + 1
    return (out, i) if len(out) >= 3 and n - i <= 2 else None


def _area(elements: float, width: int, inputs: int) -> bool:
    area = elements / (width * inputs)
    return area in KERNEL_AREAS


def conv_blocks(p_size: np.ndarray) -> tuple[int, list[tuple[int, int, int, bool]]] | None:
    """The stem's width and, per convolution after it: (weight index, width, block, projection);
    None when the blocks cannot be read (no projection shortcut, a size that fits no kernel).

    Every block has the same number of convolutions on its main path, the first count from 1 to
    4 that reads the whole sequence: ResNet-50's bottlenecks have three, ResNet-18's basic blocks
    two, and ResNet-18's first stage has no projection (its blocks keep the stem's width), so the
    count cannot be read off the first block alone."""
    pairs = _conv_norm_pairs(p_size)
    if pairs is None:
        return None
    (_, stream), *rest = pairs[0]
    for main_len in range(1, MAX_MAIN_PATH + 1):
        if (blocks := _blocks(p_size, rest, stream, main_len)) is not None:
            return stream, blocks
    return None


def _blocks(
    p_size: np.ndarray, convs: list[tuple[int, int]], stream: int, main_len: int
) -> list[tuple[int, int, int, bool]] | None:
    """``convs`` read as blocks of ``main_len`` convolutions on the main path, each ending there
    when it keeps its input's width, else at the projection that follows (None: they are not)."""
    out: list[tuple[int, int, int, bool]] = []
    block, block_in, prev, main, projections = 0, stream, stream, 0, 0
    for w, width in convs:
        elements = p_size[w] / 4
        if main == main_len and _area(elements, width, block_in) and not _area(elements, width, prev):
            out.append((w, width, block, True))
            block, block_in, prev, main, projections = block + 1, width, width, 0, projections + 1
            continue
        if main == main_len or not _area(elements, width, prev):
            return None
        out.append((w, width, block, False))
        prev, main = width, main + 1
        if main == main_len and width == block_in:  # else its projection follows
            block, main = block + 1, 0
    return out if main == 0 and projections else None


def feature_maps(
    stem_width: int, convs: list[tuple[int, int, int, bool]], p_size: np.ndarray, first_bytes_per_channel: float
) -> list[ConvLayer]:
    """Every convolution with its output's bytes per channel (at the recorded batch)."""
    per_channel = first_bytes_per_channel
    block_in = stem_width
    out: list[ConvLayer] = []
    for block in sorted({c[2] for c in convs}):
        layers = [c for c in convs if c[2] == block]
        halves = any(p and width == 2 * block_in for _, width, _, p in layers)
        prev, here, strided = block_in, per_channel, False
        for w, width, _, projection in layers:
            area = p_size[w] / 4 / (width * (block_in if projection else prev))
            if halves and not strided and (area > 1 or projection):
                here, strided = per_channel / 4, True
            out.append(ConvLayer(w, width, block, projection, here))
            prev = prev if projection else width
        per_channel, block_in = here, layers[-1][1]
    return out


def first_block_start(frames: SnapshotFrames, rows: np.ndarray, sid: np.ndarray, size: np.ndarray) -> int:
    """Of the forward's ``rows`` (kept ones), the index of the second convolution's output (the
    first block's first), or -1."""
    inner = stack_innermost(frames)
    conv_sids = set(inner.index[inner["filename"].str.endswith(CONV_FILE)].tolist())
    seen = 0
    for i, r in enumerate(rows.tolist()):
        if int(sid[r]) in conv_sids and size[r] > 0:
            seen += 1
            if seen == 2:
                return i
    return -1


def block_uid(pass_index: int, block: int) -> int:
    return pass_index * BLOCK_UID_STRIDE + block
