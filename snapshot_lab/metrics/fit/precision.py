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
- matrix multiplies made by Linear layers rather than convolutions (a float32 ResNet's 1x1
  convolutions from C to 2C channels match 60 times against none).

Where it holds, bf16 autocast makes nothing smaller (what it would halve is 2 bytes an element
already), so ``fit`` leaves the lever out and says why.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ...frames import SnapshotFrames
from .evidence import stack_innermost
from .tape import Tape

LINEAR_FILE = "torch/nn/modules/linear.py"
CONV_FILE = "torch/nn/modules/conv.py"
MIN_MATCHES = 4  # two-byte matches needed at least
MARGIN = 4  # and more than this many times the four-byte ones

HALF_PRECISION_NOTE = (
    "the parameters are half precision already ({matches} width-sized vectors whose square at 2 bytes an element is a "
    "parameter's size, {others} at 4 bytes): bf16 autocast left out, it makes nothing smaller"
)
NO_BF16 = "bf16 autocast is not applicable: the parameters are half precision already, it makes nothing smaller"


def square_matches(tape: Tape) -> dict[int, int]:
    """Per element size (2, 4): how many parameters are vectors ``v`` with a parameter of ``v * v / e`` bytes."""
    sizes = tape.fixed[tape.category == "parameter"].astype(np.int64).tolist()
    counts = Counter(sizes)
    return {e: sum(n for v, n in counts.items() if (v * v) % e == 0 and (v * v) // e in counts) for e in (2, 4)}


def half_precision_parameters(frames: SnapshotFrames, tape: Tape) -> tuple[bool, str]:
    """Whether the parameters are half precision, and the note that says so ("" when not)."""
    matches = square_matches(tape)
    if matches[2] < MIN_MATCHES or matches[2] <= MARGIN * matches[4]:
        return False, ""
    files = stack_innermost(frames)["filename"]
    if files.str.endswith(LINEAR_FILE).sum() <= files.str.endswith(CONV_FILE).sum():
        return False, ""
    return True, HALF_PRECISION_NOTE.format(matches=matches[2], others=matches[4])
