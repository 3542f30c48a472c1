"""FSDP2's prefetched parameters setting the peak: several units gathered at once.

FSDP2 gathers a unit's parameters into one flat all-gather output per unit
(``foreach_all_gather``) and copies them out when the unit runs. By default it gathers one unit
ahead (the one in use and the next: two outputs at once); explicit prefetching
(``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` with several modules)
issues more all-gathers early, and each holds a whole unit's unsharded parameters until its unit
runs. When several of them are alive at the device's peak, the prefetch is part of what set it.

Evidence, from the stacks: the all-gather outputs (allocated under ``foreach_all_gather``, not
under its copy-out) alive at the peak, counted as units by the unit's usual output size. Real
cases: ``fsdp2_prefetch3_small_ws4gloo_mlp_rank*`` (8 x Linear(2048) at a small batch, 3 units
prefetched: 4 outputs, 64 MiB, 22% of the peak) raise it; the same job without explicit
prefetch (2 outputs), the GPT with the same prefetch (3 outputs, 9% of a peak set by
activations) and every FSDP2 run at its defaults do not. A simpler rule, "explicit prefetch
configured" or "more than two outputs alive at some moment", would fire on the GPT, whose peak
the prefetch did not set. FSDP1 (flat parameters, ``limit_all_gathers``) is not covered.
"""

from __future__ import annotations

import numpy as np

from ...units import format_bytes
from ..categories.stacks import stacks_with_frame
from ..history.lifetimes import device_lifetimes
from .base import Finding, FindingContext

DEFAULT_UNITS_IN_FLIGHT = 2  # the unit in use and FSDP2's one implicit prefetch
MIN_UNITS_AT_PEAK = 3
MIN_SHARE_OF_PEAK = 0.15

TITLE = "FSDP prefetching sets the peak: {units} units' parameters gathered at once ({gathered}, {share:.0%} of it)"
ADVICE = (
    "FSDP2 holds each prefetched unit's all-gathered parameters from the moment the all-gather is issued until "
    "the unit runs. At this device's peak {units} units were gathered at once, {extra} more than FSDP2's default "
    "of one unit ahead. Prefetch fewer modules (set_modules_to_forward_prefetch / "
    "set_modules_to_backward_prefetch with one module each, or none), or shard coarser units less often; "
    "that frees about {extra_bytes} at the peak, at the cost of less overlap between communication and compute."
)


def gathered_at_peak(ctx: FindingContext, device: int) -> tuple[int, int, int] | None:
    """(all-gather outputs alive at the peak, their bytes, one unit's usual output size)."""
    timeline = ctx.timelines.get(device)
    gather_stacks = stacks_with_frame(ctx.frames, "foreach_all_gather")
    if timeline is None or not gather_stacks:
        return None
    copy_out = stacks_with_frame(ctx.frames, "foreach_all_gather_copy_out")
    lifetimes = device_lifetimes(ctx.frames, device)
    stack_ids = lifetimes["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    is_output = np.isin(stack_ids, list(gather_stacks - copy_out))
    if not is_output.any():
        return None
    start = lifetimes["event_index"].to_numpy()
    end = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).max)
    sizes = lifetimes["size_bytes"].to_numpy(dtype=np.int64)
    alive = is_output & (start <= timeline.peak_index) & (end > timeline.peak_index)
    unit_bytes = int(np.median(sizes[is_output]))
    return int(alive.sum()), int(sizes[alive].sum()), unit_bytes


def find(ctx: FindingContext) -> list[Finding]:
    out = []
    for device in ctx.stats.devices:
        timeline = ctx.timelines.get(device)
        gathered = gathered_at_peak(ctx, device)
        if timeline is None or gathered is None or not timeline.peak_requested_bytes:
            continue
        outputs, nbytes, unit_bytes = gathered
        units = round(nbytes / unit_bytes) if unit_bytes else outputs
        share = nbytes / timeline.peak_requested_bytes
        if units < MIN_UNITS_AT_PEAK or share < MIN_SHARE_OF_PEAK:
            continue
        extra = units - DEFAULT_UNITS_IN_FLIGHT
        extra_bytes = extra * unit_bytes
        out.append(
            Finding(
                id="fsdp-prefetch-peak",
                severity="warning",
                title=TITLE.format(units=units, gathered=format_bytes(nbytes), share=share),
                advice=ADVICE.format(units=units, extra=extra, extra_bytes=format_bytes(extra_bytes)),
                evidence={
                    "units_gathered_at_peak": units,
                    "all_gather_outputs_at_peak": outputs,
                    "gathered_bytes_at_peak": nbytes,
                    "unit_bytes": unit_bytes,
                    "share_of_peak": round(share, 4),
                    "default_units_in_flight": DEFAULT_UNITS_IN_FLIGHT,
                },
                savings_bytes=extra_bytes,
                device=device,
            )
        )
    return out
