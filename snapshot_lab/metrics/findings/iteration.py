"""What one whole iteration at the recorded batch holds at once, against the memory limit: the
check that weighs a verdict taken at the moment of an out-of-memory error (a request that free
holes or another allocator setting would have served) against the job, which must also run the
rest of its iteration. Read by the OOM finding and the allocator-settings finding alike."""

from __future__ import annotations

from ...frames import SnapshotFrames
from ..allocator.whatif import WhatIf
from ..fit import step_peak_allocated


def whole_iteration(frames: SnapshotFrames, device: int, whatif: WhatIf | None) -> int | None:
    """The most bytes one whole iteration (a training step, or a forward in inference) at the
    recorded batch holds at once on ``device``, in fit's model of it; None where the what-if knows
    no memory limit to weigh it against or the trace shows no step to build on."""
    if whatif is None or whatif.memory_limit_bytes is None:
        return None
    return step_peak_allocated(frames, device)


def over_the_limit(whatif: WhatIf | None, whole: int | None) -> bool:
    """The whole iteration holds more at once than the limit: no allocator setting lets the job
    finish."""
    return (
        whole is not None
        and whatif is not None
        and whatif.memory_limit_bytes is not None
        and (whole > whatif.memory_limit_bytes)
    )
