"""Annotations on allocations (``torch.cuda.memory._annotate_tensor``, torch >= 2.14), shown where
the allocation is: its site in the top-sites tables, its entry in the explorer, ``--json``.

The texts are the user's raw strings: every renderer escapes them (jinja2's autoescape, ``md()``,
the explorer's JSON escapes). Nothing here exists for a file without ``annotate`` entries, so
every output of such a file stays as it was.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .sites import allocation_annotations, site_labels, snapshot_sites

MAX_PER_SITE = 5  # distinct annotation texts shown per site; --json has every annotated allocation


@dataclass(frozen=True)
class AnnotatedAllocation:
    device: int
    address: int
    size_bytes: int | None  # None when neither the trace nor the dump knows the allocation
    alloc_event_index: int | None  # None when the allocation predates the trace
    stack_id: int | None  # the allocation's own stack (the annotation's is annotation_stack_id)
    site: str  # the allocation's site label, as the top-sites tables name it
    annotation: str  # raw text: escape it where it is shown
    annotation_stack_id: int | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _int_or_none(value: object) -> int | None:
    return None if value is None or pd.isna(value) else int(value)  # type: ignore[call-overload]


def _allocation_rows(frames: SnapshotFrames, ann: pd.DataFrame) -> pd.DataFrame:
    """Each annotation with its allocation's size and stack: from its ``alloc`` event, else (made
    before the trace) from the block of that address in the dump."""
    ev = frames.events.loc[frames.events["action"] == "alloc", ["device", "event_index", "size_bytes", "stack_id"]]
    ev = ev.rename(columns={"event_index": "alloc_event_index", "stack_id": "alloc_stack_id"})
    ev = ev.astype({"alloc_event_index": "Int64"})
    out = ann.rename(columns={"stack_id": "annotation_stack_id"}).merge(
        ev, on=["device", "alloc_event_index"], how="left"
    )
    blocks = frames.blocks[["device", "address", "size_bytes", "stack_id"]].drop_duplicates(["device", "address"])
    blocks = blocks.rename(columns={"size_bytes": "block_size_bytes", "stack_id": "block_stack_id"})
    out = out.astype({"address": "int64"}).merge(blocks, on=["device", "address"], how="left")
    from_trace = out["alloc_event_index"].notna()
    out["size_bytes"] = out["size_bytes"].where(from_trace, out["block_size_bytes"]).astype("Int64")
    out["stack_id"] = out["alloc_stack_id"].where(from_trace, out["block_stack_id"]).astype("Int64")
    return out


def annotated_allocations(frames: SnapshotFrames) -> list[AnnotatedAllocation]:
    """Every ``annotate`` entry of the trace on the allocation it names (see
    :func:`~snapshot_lab.metrics.attribution.sites.allocation_annotations`), in trace order; empty
    when the file has none."""
    ann = allocation_annotations(frames)
    if ann.empty:
        return []
    rows = _allocation_rows(frames, ann)
    sid = rows["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    labels, _ = site_labels(sid, snapshot_sites(frames))
    return [
        AnnotatedAllocation(
            device=int(device),
            address=int(address),
            size_bytes=_int_or_none(size),
            alloc_event_index=_int_or_none(alloc_index),
            stack_id=_int_or_none(stack_id),
            site=str(label),
            annotation=str(text),
            annotation_stack_id=_int_or_none(annotation_stack),
        )
        for device, address, size, alloc_index, stack_id, label, text, annotation_stack in zip(
            rows["device"],
            rows["address"],
            rows["size_bytes"],
            rows["alloc_event_index"],
            rows["stack_id"],
            labels,
            rows["annotation"],
            rows["annotation_stack_id"],
            strict=True,
        )
    ]


def site_annotations(annotated: list[AnnotatedAllocation]) -> dict[str, list[str]]:
    """Site label -> the distinct annotation texts of its allocations (first seen first, at most
    :data:`MAX_PER_SITE`); empty when nothing is annotated."""
    out: dict[str, list[str]] = {}
    for item in annotated:
        texts = out.setdefault(item.site, [])
        if item.annotation not in texts and len(texts) < MAX_PER_SITE:
            texts.append(item.annotation)
    return out
