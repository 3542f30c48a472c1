"""Which out-of-memory errors ended the job, and which it went on from.

The allocator records an ``oom`` entry before it raises, and not every error it raises ends the
job. PyTorch's cuDNN convolutions catch the error on their workspace and try an algorithm that
needs less (``fit_resnet50_b162_ckpt_capped_python``: ResNet-50 with checkpointing at batch 162
under a 6 GiB cap, the largest batch that ran, records 37 of them, each run of them followed by
a smaller workspace that fits, and finishes both its steps); a program may catch one itself (skip
the batch, halve it). After such an error the device goes on allocating. After the error that
ended the job, it only frees (the stack unwinding) until the dump: in every sample that ran out
of memory, the last ``oom`` entry is followed by no allocation
(``fit_resnet50_b163_ckpt_capped_python``: 84 caught, then the one that stopped it).

A snapshot dumped by the OOM observer at an error that was caught ends at it, and so reads as
the one that ended the job: the trace holds nothing to tell them apart.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def recovered(events: pd.DataFrame) -> np.ndarray:
    """Per event: an ``oom`` its device went on allocating after (one that was caught)."""
    action = events["action"]
    device = events["device"].to_numpy()
    index = events["event_index"].to_numpy()
    is_alloc = (action == "alloc").to_numpy(dtype=bool)
    is_oom = (action == "oom").to_numpy(dtype=bool)
    out = np.zeros(len(events), dtype=bool)
    if not is_oom.any() or not is_alloc.any():
        return out
    for d in np.unique(device[is_oom]).tolist():
        allocs = index[is_alloc & (device == d)]
        if allocs.size:
            mine = is_oom & (device == d)
            out[mine] = index[mine] < allocs.max()
    return out


def fatal_rows(events: pd.DataFrame) -> np.ndarray:
    """Per event: an ``oom`` after its device's last allocation (its last one ended the job)."""
    return (events["action"] == "oom").to_numpy(dtype=bool) & ~recovered(events)


def fatal(events: pd.DataFrame) -> pd.DataFrame:
    """The ``oom`` events after their device's last allocation (its last one ended the job; the
    OOM explained is that one)."""
    return events[fatal_rows(events)]
