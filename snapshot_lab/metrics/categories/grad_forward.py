"""A KV cache filled by a forward that keeps every layer's activations: the keys and values are
activations saved for backward, not an inference cache.

transformers builds a ``DynamicCache`` whenever ``use_cache`` is on, in training too, and its
``torch.cat`` copies every layer's keys and values; the attention then saves those copies for
backward. Rule ``kv_cache_in_training`` calls them activations once the trace shows a backward or
an optimizer. A trace that ends inside the first forward shows neither: ``fit_gpt2_b32_oom_python``
(GPT-2 training at batch 32, out of memory in the first forward) had its 384 MiB of keys and values
called an inference cache. What such a trace does show is how the forward keeps memory:

- with grad enabled, every layer leaves behind what autograd saved for its backward (the inputs of
  the q/k/v projection and of the MLP, the attention's output, the MLP's hidden state...): several
  times the layer's keys and values, and none of it is freed before the backward;
- under ``torch.no_grad``/``inference_mode`` (``generate`` included) nothing but the residual stream
  survives a layer, and each layer's replaces the previous one's.

So between a forward's first and last cache allocation, the memory that is not the cache grows by
more than the cache itself in a forward with grad, and stays flat in an inference forward. Measured
on the recordings, as the growth per byte of cache allocated after the forward's first: 4.6
(``fw_lightning_auto_python``), 6.9 (``late_llama_python``), 8.8 (``deep_llama_forward_all``), 9.3
(``fit_gpt2_b32_oom_python``), 14.0 (``deep_forward_python``) with grad; 0.0 to 0.04 generating
with ``generate`` (``inf_llama_*``), 0.0 (``deep_inference_python``) and 0.14 (``inf_flush_python``)
under a ``with torch.no_grad()`` that leaves no frame on any stack. The threshold, 1, lies between
the two by a factor of more than four on each side. The stacks cannot say it: the forward under
``no_grad`` and the training forward have the same frames (the context manager is no frame), and
``torch.no_grad`` used as a decorator is on Llama's rotary embedding in a forward with grad too.

A forward is a run of cache allocations of one size (as in :mod:`.kv_cache`); one with a single
cache allocation (a one-layer model's keys alone) says nothing and is left as it is.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

# the growth of the other live bytes, per byte of cache, above which a forward kept its layers'
# activations (see the module docstring for the measured values on both sides)
SAVED_PER_CACHE_BYTE = 1.0


def _live_bytes_at(positions: np.ndarray, starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Bytes of the allocations (start, end, size; end -1: never freed) alive just after each
    event index of ``positions``."""
    order = np.argsort(starts, kind="stable")
    made = np.r_[0, np.cumsum(sizes[order])][np.searchsorted(starts[order], positions, side="right")]
    freed_at = ends >= 0
    by_end = np.argsort(ends[freed_at], kind="stable")
    freed_sizes = np.r_[0, np.cumsum(sizes[freed_at][by_end])]
    freed = freed_sizes[np.searchsorted(ends[freed_at][by_end], positions, side="right")]
    return made - freed


def forward_growth(lifetimes: pd.DataFrame, cache: np.ndarray) -> list[tuple[np.ndarray, float]]:
    """Each forward's cache allocations (rows of one device's ``lifetimes``; ``cache``: the mask
    of the cache allocations) and how much the rest of the live memory grew between its first and
    last, per byte of cache allocated after the first (NaN for a forward of one allocation)."""
    rows = np.flatnonzero(cache)
    if not rows.size:
        return []
    starts = lifetimes["event_index"].to_numpy(dtype=np.int64)
    ends = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)
    sizes = lifetimes["size_bytes"].to_numpy(dtype=np.int64)
    rows = rows[np.argsort(starts[rows], kind="stable")]
    rest = ~cache
    level = _live_bytes_at(starts[rows], starts[rest], ends[rest], sizes[rest])
    cache_sizes = sizes[rows]
    first = np.flatnonzero(np.r_[True, cache_sizes[1:] != cache_sizes[:-1]])
    last = np.r_[first[1:], rows.size] - 1
    out = []
    for begin, end in zip(first.tolist(), last.tolist(), strict=True):
        added = int(cache_sizes[begin + 1 : end + 1].sum())
        ratio = (level[end] - level[begin]) / added if added else float("nan")
        out.append((rows[begin : end + 1], float(ratio)))
    return out


def grad_forward_mask(lifetimes: pd.DataFrame, cache: np.ndarray) -> np.ndarray:
    """Which of the cache allocations (``cache``: a mask over one device's ``lifetimes``) were
    made by a forward that kept its layers' activations (see the module docstring)."""
    out = np.zeros(len(lifetimes), dtype=bool)
    for rows, ratio in forward_growth(lifetimes, cache):
        if ratio > SAVED_PER_CACHE_BYTE:  # NaN (one allocation) is not
            out[rows] = True
    return out


__all__ = ["SAVED_PER_CACHE_BYTE", "forward_growth", "grad_forward_mask"]
