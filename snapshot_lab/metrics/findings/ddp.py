"""DistributedDataParallel keeping every gradient twice (without ``gradient_as_bucket_view``)."""

from __future__ import annotations

from ...units import format_bytes
from ..categories import CategoryBreakdown
from .base import Finding, FindingContext

# separate gradients must add up to this share of the bucket bytes
DDP_MIN_GRAD_SHARE = 0.5


def _finding(dev: int, cats: CategoryBreakdown) -> Finding | None:
    bucket = cats.live_bytes["ddp_bucket"]
    grads = cats.live_bytes["gradient"]
    if not bucket or grads < DDP_MIN_GRAD_SHARE * bucket:
        return None
    saved = min(bucket, grads)
    return Finding(
        id="ddp-bucket-duplicate-grads",
        severity="warning",
        title=(
            f"DDP keeps gradients twice: {format_bytes(grads)} of gradients beside {format_bytes(bucket)} "
            "of DDP gradient buckets"
        ),
        advice=(
            "DistributedDataParallel copies every gradient into its communication buckets. With "
            "DistributedDataParallel(model, gradient_as_bucket_view=True) the gradients become views into the "
            f"buckets, saving about {format_bytes(saved)} on every rank (the size of the gradients). Standard "
            "optimizers and gradient clipping work unchanged; only code that replaces p.grad with a new tensor "
            "must not be used with it."
        ),
        evidence={
            "ddp_bucket_bytes": bucket,
            "gradient_bytes": grads,
            "gradient_blocks": cats.live_blocks["gradient"],
            "ddp_bucket_blocks": cats.live_blocks["ddp_bucket"],
        },
        savings_bytes=saved,
        device=dev,
    )


def find(ctx: FindingContext) -> list[Finding]:
    return [finding for dev, cats in ctx.categories.items() if (finding := _finding(dev, cats)) is not None]
