"""What is the smallest change that makes this job fit (issue #20)?

From one snapshot of a training job (a whole step recorded, or a run that ran out of memory in
its first forward), one whole training step (forward, backward, optimizer step) is modelled as a
tape of allocations whose sizes follow the batch (:mod:`.evidence`, :mod:`.extrapolate`), each
lever rewrites it (:mod:`.levers`), and the tape is replayed through the caching-allocator model
for the peak allocated and reserved bytes and, under a memory limit, for the largest batch whose
whole step runs (:mod:`.search`).
"""

from .model import FitUnsupported
from .result import FitResult, LeverOutcome, compute_fit, predict_step, step_peak_allocated

__all__ = ["FitResult", "FitUnsupported", "LeverOutcome", "compute_fit", "predict_step", "step_peak_allocated"]
