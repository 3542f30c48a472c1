"""Gradients by lifetime, in both stack modes.

A parameter's gradient buffer is made during backward. On the first backward, autograd's
``AccumulateGrad`` *steals* the tensor the backward op produced (``AddmmBackward0`` -> ``mm``),
so the allocation's stack shows the op and the engine, never ``AccumulateGrad`` (with
``stacks='python'`` it shows nothing at all: the engine's thread has no Python frames). What
tells a gradient apart from the backward pass's own temporaries is its lifetime:

- it is allocated on autograd's thread (see :func:`.stacks.stack_threads`; with Python stacks,
  an allocation recorded inside the trace without a stack was made on a thread with no Python
  frames, which in a training step is the engine's);
- it outlives its backward pass: it is still alive at the first event of the program's own
  thread after it (the backward call has returned by then);
- and it is parameter-shaped: its size is that of a parameter (or of the optimizer state that
  mirrors the parameters), or it is released by ``zero_grad``.

Real workloads that break simpler rules (tests/test_categories.py): with ``stacks='all'`` a
stack rule finds no ``AccumulateGrad`` and calls every gradient an activation
(``grad_plain_all``); a size-only rule for stackless blocks calls the parameters of a run
recorded after the model was built gradients (``late_gpt2_python``); the autograd thread's
cuBLAS workspace also outlives backward and is never freed (``grad_plain_python``, 32 MiB), so
"survives backward" alone is not enough; with ``gradient_as_bucket_view=True`` DDP copies the
backward's buffers into its buckets and frees them before backward returns
(``gloo_bucketview_*``), so they are not gradients.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

THREAD_CODES = {"none": 0, "main": 1, "autograd": 2, "other": 3}


def thread_codes(stack_ids: np.ndarray, thread_of: pd.Series) -> np.ndarray:
    """Thread code (``THREAD_CODES``) of each stack id (-1: no stack -> ``none``)."""
    size = max(int(stack_ids.max(initial=-1)), int(thread_of.index.max()) if len(thread_of) else -1) + 2
    table = np.full(size, THREAD_CODES["other"], dtype=np.int8)
    table[-1] = THREAD_CODES["none"]  # stack id -1 reads the last slot
    if len(thread_of):
        table[thread_of.index.to_numpy(dtype=np.int64)] = thread_of.map(THREAD_CODES).to_numpy(dtype=np.int8)
    return table[stack_ids]


def next_main_event(alloc_index: np.ndarray, main_index: np.ndarray) -> np.ndarray:
    """Event index of the first main-thread event after each allocation (int64 max if none)."""
    main_index = np.sort(main_index)
    pos = np.searchsorted(main_index, alloc_index, side="right")
    out = np.full(alloc_index.size, np.iinfo(np.int64).max, dtype=np.int64)
    ok = pos < main_index.size
    out[ok] = main_index[pos[ok]]
    return out


def free_stack_ids(lifetimes: pd.DataFrame, events: pd.DataFrame) -> np.ndarray:
    """The stack id recorded at each allocation's free (-1: none, or never freed)."""
    ev_sid = events["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    base = int(events["event_index"].iloc[0]) if len(events) else 0
    free = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)
    out = np.full(free.size, -1, dtype=np.int64)
    freed = free >= 0
    out[freed] = ev_sid[free[freed] - base]
    return out


def gradient_mask(
    lifetimes: pd.DataFrame,
    events: pd.DataFrame,
    thread_of: pd.Series,
    eligible_stacks: set[int] | None,
    param_sizes: set[int] | None,
    zero_grad_stacks: set[int],
) -> np.ndarray:
    """Which allocations of ``lifetimes`` (one device) are gradients.

    ``eligible_stacks``: stack ids whose own category may be overridden (activation, other,
    gradient; never parameters, optimizer state or DDP buckets, nor library caches); stackless
    allocations are always eligible. ``param_sizes``: requested sizes of parameters and of the
    optimizer state that mirrors them; None: any size (a reduce-scatter output that outlives
    backward is a sharded gradient whatever its size)."""
    n = len(lifetimes)
    if n == 0:
        return np.zeros(0, dtype=bool)
    sid = lifetimes["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    th = thread_codes(sid, thread_of)
    # with Python stacks, an allocation without a stack came from a thread with no Python frames
    backward = (th == THREAD_CODES["autograd"]) | (th == THREAD_CODES["none"])
    if eligible_stacks is not None:
        listed = np.isin(sid, np.fromiter(eligible_stacks, dtype=np.int64, count=len(eligible_stacks)))
        # stackless allocations may be gradients of the ordinary kind, never a library's buffer
        backward &= listed | ((sid < 0) & (param_sizes is not None))
    if not backward.any():
        return backward
    ev_sid = events["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    is_main = thread_codes(ev_sid, thread_of) == THREAD_CODES["main"]
    main_index = events["event_index"].to_numpy()[is_main]
    alloc_index = lifetimes["event_index"].to_numpy(dtype=np.int64)
    nxt = next_main_event(alloc_index, main_index)
    free = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).max)
    survives = free >= nxt  # freed by the program's thread, after backward returned, or never
    sizes = lifetimes["size_bytes"].to_numpy(dtype=np.int64)
    if param_sizes is None:
        return backward & survives
    shaped = np.isin(sizes, np.fromiter(param_sizes, dtype=np.int64, count=len(param_sizes)))
    if zero_grad_stacks:
        free_sid = free_stack_ids(lifetimes, events)
        shaped |= np.isin(free_sid, np.fromiter(zero_grad_stacks, dtype=np.int64, count=len(zero_grad_stacks)))
    return backward & survives & shaped
