"""Whether the model's parameters are already half precision (float16 or bfloat16), read from
the trace alone (issue #20).

The trace holds no dtypes, only sizes. A transformer's parameters are vectors of its width
(norms, biases: ``d * e`` bytes, ``e`` bytes an element) and square matrices of it (attention's
projections: ``d * d * e``), so a vector size ``v`` whose square over ``e`` is also a parameter's
size tells ``e``: ``v * v / 2`` for half precision, ``v * v / 4`` for float32. A layer from C
to 2C features in float32 is ``8 C^2`` bytes, the size a half-precision square of 2C would be,
so the rule asks for more than chance gives:

- at least four two-byte matches (a float32 MLP from 1024 to 2048 and back matches once);
- more than four times as many as four-byte ones (a float32 GPT-2's position table, 1024 x 512,
  matches by chance; FSDP's shards of a float32 transformer, halved along their first dimension,
  match 148 times against 82);
- no more convolutions than linear layers among the stacks (a float32 ResNet's 1x1
  convolutions from C to 2C channels match 60 times against none; transformers' ``Conv1D`` of
  GPT-2 is a linear layer, and an OOM before the head may show no matrix multiply at all).

Sizes alone cannot always tell: with grouped-query attention (k and v half as wide), a bfloat16
Llama's vectors match the 4-byte square as often as the 2-byte one, and a float32 model half as
wide would have the same sizes. A second rule reads an operation only a half-precision model
makes: a norm that computes in float32 (RMSNorm, as transformers writes it) first casts its
half-precision input up, a tensor twice the block's output; in float32 that cast makes nothing,
and the first tensor is as large as the output (the same Llama in float32), or a layer norm's
output, or a convolution's. Every recorded block's first tensor must be exactly twice its last
(BERT's last is a small tensor, 768 times smaller; a simpler "the first is larger than the last"
takes it for half precision).

That second rule also holds for a float32 model recorded under bf16 autocast (GPT-2's, Llama's
and ViT's bf16 recordings, a mid-run GPT-2 under autocast): its blocks end on a half-precision
tensor. There too the recorded step already computes in half precision, and a bf16 lever would
apply autocast twice, so its note says either.

A convolutional network (more convolutions than linear layers among the stacks) is read from
its convolutions and their batch norms instead. A batch norm's weight, bias and two running
statistics are four vectors of its width C (``C * e`` bytes each), then an 8-byte count; the
parameter just before them is its convolution's weight, ``C * C_in * k * k * e`` bytes, where
C_in is the previous batch norm's width in a sequential network. So its kernel area is
``weight * e / (C bytes * C_in bytes)``: 1, 9, 25 or 49 at the right ``e``, and twice or half
of it, which is no kernel area, at the other. The rule asks for the same margin as the sizes
rule (at least four matches at 2 bytes, more than four times those at 4). Convolutions whose
input is not the previous batch norm's output (a projection shortcut, a depthwise convolution)
match at neither and are not counted. Tested on ResNet-50 and EfficientNet-B0 in float16
inference, a ResNet-18 trained with bfloat16 parameters, and their float32 twins (a float32
ResNet-18 matches the sizes rule 60 times against none: the reason for the split).

Autocast itself is read from the copies it makes: in its forward, a float32 model under
autocast makes a half-precision copy of every weight a matrix multiply or convolution reads,
half the weight's size. A recording whose forward makes a tensor of half the size of at least
90% of its distinct weight sizes of 64 KiB or more ran under autocast. Eight distinct sizes
are needed at least: a small model's few sizes meet activations of half their size by chance
(an MLP's 5 sizes, 4 of them met without autocast). ResNet-50, EfficientNet-B0 and ConvNeXt-Tiny
recorded under bf16 autocast meet 13 of 13, 13 of 13 and 10 of 10, and a ResNet-50 job of another
session (channels_last, module tags) 13 of 13. The same models without autocast meet 2 of 13,
0 of 13 and 3 of 10 (activations of that size by chance).

Where any of these holds, bf16 autocast makes nothing smaller (what it would halve is 2 bytes an
element already), so ``fit`` leaves the lever out and says why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from ...frames import SnapshotFrames
from .evidence import BlockSpan, stack_innermost
from .tape import Tape

LINEAR_FILES = ("torch/nn/modules/linear.py", "transformers/pytorch_utils.py")
CONV_FILE = "torch/nn/modules/conv.py"
LARGE_WEIGHT = 64 * 1024  # bytes: the weights whose autocast copies are counted
AUTOCAST_MIN_SIZES = 8
AUTOCAST_SHARE = 0.9
KERNEL_AREAS = (1, 9, 25, 49)
COUNT_BYTES = 8  # a batch norm's num_batches_tracked
NORM_GROUP = 6  # a convolution's weight, then its batch norm's weight, bias, two statistics and count
MIN_MATCHES = 4  # two-byte matches needed at least
MARGIN = 4  # and more than this many times the four-byte ones

HALF_PRECISION_NOTE = (
    "the parameters are half precision already ({matches} width-sized vectors whose square at 2 bytes an element is a "
    "parameter's size, {others} at 4 bytes): bf16 autocast left out, it makes nothing smaller"
)
UPCAST_NOTE = (
    "the recorded step computes in half precision already (every block of the step, {blocks} in all, first makes a "
    "tensor twice its output: a float32 tensor beside half-precision ones; half-precision parameters, or bf16 "
    "autocast already on): bf16 autocast left out, it makes nothing smaller"
)
CONV_HALF_NOTE = (
    "the parameters are half precision already ({matches} convolutions whose size at 2 bytes an element is a kernel "
    "of 1, 3, 5 or 7 over its batch norm's width and the previous one's, {others} at 4 bytes): bf16 autocast left "
    "out, it makes nothing smaller"
)
AUTOCAST_NOTE = (
    "the recorded step runs under autocast already (its forward makes a copy of half the size of {copied} of its "
    "{sizes} distinct large weight sizes, as autocast does): bf16 autocast left out, it is what was recorded"
)
WEIGHT_COPIES_NOTE = (
    "the recorded step runs under autocast already (its forward makes {copies} half-size copies of its weights "
    "just before the layers that multiply by them, as autocast does): bf16 autocast left out, it is what was recorded"
)
UPCAST_RATIO = 2.0  # a float32 copy of a 2-byte stream
NO_BF16 = (
    "bf16 autocast is not applicable: the recorded step computes in half precision already (its parameters, or "
    "autocast), it makes nothing smaller"
)


def parameter_sizes(tape: Tape) -> np.ndarray:
    """The bytes of every parameter on the tape, in the order the model made them."""
    return tape.fixed[tape.category == "parameter"].astype(np.int64)


def square_matches(tape: Tape) -> dict[int, int]:
    """Per element size (2, 4): how many parameters are vectors ``v`` with a parameter of ``v * v / e`` bytes."""
    return sizes_matches(parameter_sizes(tape))


def sizes_matches(parameter_sizes: np.ndarray) -> dict[int, int]:
    """:func:`square_matches` of the parameters' sizes."""
    counts = Counter(parameter_sizes.astype(np.int64).tolist())
    return {e: sum(n for v, n in counts.items() if (v * v) % e == 0 and (v * v) // e in counts) for e in (2, 4)}


def sizes_say_half(matches: dict[int, int]) -> bool:
    """The sizes rule: enough two-byte matches, and far more than four-byte ones."""
    return matches[2] >= MIN_MATCHES and matches[2] > MARGIN * matches[4]


def first_to_last(tape: Tape, blocks: Sequence[BlockSpan]) -> list[float]:
    """Per recorded block, the size of the first tensor its forward makes over the last's (one
    search for all blocks: a 1M-entry trace has thousands)."""
    if not blocks:
        return []
    sizes = tape.sizes(1.0)
    forward = np.flatnonzero(tape.phase == "forward")
    forward = forward[np.argsort(tape.start[forward], kind="stable")]
    starts = tape.start[forward]
    lo = np.searchsorted(starts, [span.forward_start for span in blocks], side="left")
    hi = np.searchsorted(starts, [span.forward_end for span in blocks], side="right") - 1
    made = (hi >= lo) & (hi >= 0)
    first, last = sizes[forward[lo[made]]], sizes[forward[hi[made]]]
    return [float(a / b) for a, b in zip(first, last, strict=True) if b]


def upcasts(ratios: Iterable[float]) -> bool:
    """Whether blocks with these first-to-last sizes (:func:`first_to_last`) are a half-precision
    model's: every one exactly :data:`UPCAST_RATIO`, and at least one."""
    return set(ratios) == {UPCAST_RATIO}


def conv_norm_matches(parameter_sizes: np.ndarray) -> dict[int, int]:
    """Per element size (2, 4): how many convolutions followed by a batch norm have a kernel area
    of 1, 9, 25 or 49 with the previous batch norm's width as their input (module docstring)."""
    p = parameter_sizes.astype(np.int64)
    if p.size < 2 * NORM_GROUP:
        return {2: 0, 4: 0}
    # a batch norm: four equal sizes, then the 8-byte count; the parameter before them its convolution's weight
    windows = np.lib.stride_tricks.sliding_window_view(p, NORM_GROUP)
    is_norm = (windows[:, 1:5] == windows[:, 1:2]).all(axis=1) & (windows[:, 5] == COUNT_BYTES)
    at = np.flatnonzero(is_norm)
    weight, width = p[at][1:], p[at + 1][1:]
    previous = p[at + 1][:-1]
    out = {}
    for e in (2, 4):
        area = weight * e / (width * previous).astype(np.float64)
        out[e] = int(np.isin(area, KERNEL_AREAS).sum())
    return out


def autocast_copies(tape: Tape) -> tuple[int, int]:
    """The distinct sizes of the large weights, and how many of them the forward made a tensor
    of half of (autocast's copies)."""
    weights = parameter_sizes(tape)
    sizes = np.unique(weights[weights >= LARGE_WEIGHT])
    forward = (tape.phase == "forward") & (tape.category != "parameter")
    made = np.unique(tape.sizes(1.0)[forward])
    return int(sizes.size), int(np.isin(sizes // 2, made).sum())


def under_autocast(tape: Tape) -> tuple[bool, str]:
    """Whether the recorded forward ran under autocast (module docstring), and the note."""
    sizes, copied = autocast_copies(tape)
    if sizes >= AUTOCAST_MIN_SIZES and copied >= AUTOCAST_SHARE * sizes:
        return True, AUTOCAST_NOTE.format(copied=copied, sizes=sizes)
    return False, ""


def half_precision_parameters(
    frames: SnapshotFrames, tape: Tape, blocks: Sequence[BlockSpan] = (), weight_copies: int = 0
) -> tuple[bool, str]:
    """Whether the step computes in half precision already (its parameters, or autocast), and
    the note that says so ("" when not). ``weight_copies``: autocast's copies of the weights the
    recorded forward made (``fit/weight_copies.py``), which the float16 MLP under GradScaler and
    autocast inference show where too few distinct weight sizes leave the sizes rule silent."""
    if weight_copies:
        return True, WEIGHT_COPIES_NOTE.format(copies=weight_copies)
    autocast, note = under_autocast(tape)
    if autocast:
        return True, note
    files = stack_innermost(frames)["filename"]
    if files.str.endswith(CONV_FILE).sum() > files.str.endswith(LINEAR_FILES).sum():
        convs = conv_norm_matches(parameter_sizes(tape))
        if sizes_say_half(convs):
            return True, CONV_HALF_NOTE.format(matches=convs[2], others=convs[4])
        return False, ""
    matches = square_matches(tape)
    if sizes_say_half(matches):
        return True, HALF_PRECISION_NOTE.format(matches=matches[2], others=matches[4])
    ratios = first_to_last(tape, blocks)
    if upcasts(ratios):
        return True, UPCAST_NOTE.format(blocks=len(ratios))
    return False, ""
