"""FSDP keeping unsharded parameters alive from forward into backward.

With FSDP2's ``reshard_after_forward=False`` (or FSDP1's ``SHARD_GRAD_OP``, ZeRO-2) every unit's
all-gathered parameters stay alive after its forward until its backward, instead of being freed
and gathered again: the whole model's unsharded parameters are alive at the start of backward,
where the activations peak too. Seen in the trace as unsharded-parameter buffers allocated by the
program's thread (the forward's all-gather) and freed by autograd's (the backward's reshard),
nearly all of what the forward gathered. Some of it is normal: FSDP keeps the root unit, and FSDP1
the last units of the forward, unsharded into backward (``fsdp1_fullshard_transformer``: the
root and three blocks, 24% of what its forwards gathered over the trace, which simpler rules —
"unsharded parameters kept across forward and backward", or "more than one unit kept" — took
for the setting); with the setting, everything the forwards gather is kept (100% with FSDP2;
75% with FSDP1 over a trace whose first gather is FSDP1's own initialisation).
"""

from __future__ import annotations

import numpy as np

from ...units import format_bytes
from ..categories import CODES, categorize, stack_threads
from ..categories.gradients import THREAD_CODES, free_stack_ids, thread_codes
from ..history.lifetimes import device_lifetimes
from ..history.timeline import Timeline
from ..parallel.parallelism import detect_parallel
from .base import Finding, FindingContext

MIN_KEPT_SHARE = 0.5  # of the unsharded bytes the forwards gathered


def kept_unsharded(ctx: FindingContext, device: int) -> tuple[float, int, int]:
    """(share of the bytes the forward gathered that stayed alive into backward, the most of
    those bytes alive at once, those alive at the device's peak)."""
    frames = ctx.frames
    lifetimes = device_lifetimes(frames, device)
    codes = categorize(frames).alloc_codes[device]
    unsharded = codes == CODES["fsdp_unsharded_params"]
    if not unsharded.any():
        return 0, 0, 0
    events = frames.device_events(device)
    threads = stack_threads(frames)
    made = thread_codes(lifetimes["stack_id"].to_numpy(dtype=np.int64, na_value=-1), threads)
    freed_by = thread_codes(free_stack_ids(lifetimes, events), threads)
    never = lifetimes["free_index"].isna().to_numpy()
    gathered_in_forward = unsharded & (made == THREAD_CODES["main"])
    kept = gathered_in_forward & ((freed_by == THREAD_CODES["autograd"]) | (freed_by == THREAD_CODES["none"]) | never)
    if not kept.any():
        return 0.0, 0, 0
    sizes = lifetimes["size_bytes"].to_numpy()
    share = float(sizes[kept].sum() / sizes[gathered_in_forward].sum())
    start = lifetimes["event_index"].to_numpy()[kept]
    end = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).max)[kept]
    size = lifetimes["size_bytes"].to_numpy()[kept]
    order = np.argsort(np.r_[start, end], kind="stable")
    nbytes = np.r_[size, -size][order]
    total = np.cumsum(nbytes)
    best = int(np.argmax(total))
    timeline: Timeline | None = ctx.timelines.get(device)
    at_peak = 0
    if timeline is not None:
        alive = (start <= timeline.peak_index) & (end > timeline.peak_index)
        at_peak = int(size[alive].sum())
    return share, int(total[best]), at_peak


def find(ctx: FindingContext) -> list[Finding]:
    layout = detect_parallel(ctx.frames)
    if not {"fsdp1", "fsdp2"} & set(layout.strategies):
        return []
    out = []
    for dev in ctx.stats.devices:
        share, nbytes, at_peak = kept_unsharded(ctx, dev)
        if share < MIN_KEPT_SHARE:
            continue
        setting = (
            "fully_shard(..., reshard_after_forward=True)"
            if "fsdp2" in layout.strategies
            else "ShardingStrategy.FULL_SHARD"
        )
        world = layout.world_size or 0
        comm = (
            f" That costs one more all-gather per unit in backward: about {format_bytes(nbytes * (world - 1) // world)}"
            f" received per rank per step at world size {world}."
            if world > 1
            else " That costs one more all-gather per unit in backward."
        )
        out.append(
            Finding(
                id="fsdp-unsharded-kept",
                severity="warning",
                title=(
                    f"FSDP keeps {share:.0%} of the parameters its forward gathered unsharded into backward "
                    f"({format_bytes(nbytes)} at once" + (f", {format_bytes(at_peak)} at the peak)" if at_peak else ")")
                ),
                advice=(
                    "Each unit's all-gathered parameters stay alive after its forward until its backward "
                    "(reshard_after_forward=False in FSDP2, SHARD_GRAD_OP in FSDP1), so at the start of backward, "
                    f"where activations peak, the whole model is unsharded. {setting} frees them after forward "
                    f"and gathers them again for backward, lowering the peak by about {format_bytes(at_peak)}." + comm
                ),
                evidence={
                    "kept_share_of_forward_gathers": round(share, 4),
                    "unsharded_bytes_kept": nbytes,
                    "kept_bytes_at_peak": at_peak,
                    "strategy": " + ".join(strategy for strategy in layout.strategies if strategy.startswith("fsdp")),
                    "world_size": layout.world_size,
                },
                savings_bytes=at_peak or None,
                device=dev,
            )
        )
    return out
