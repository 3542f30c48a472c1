"""Annotations (``torch.cuda.memory._annotate_tensor``, torch >= 2.14) put on the report: beside
their site in the top-sites tables and on their allocation in the explorer's data. A file without
annotations never reaches this, so its report stays byte-identical."""

from __future__ import annotations

import json

from ..metrics.attribution.annotations import AnnotatedAllocation, site_annotations
from .explorer import annotation_data, escaped_json
from .html import ReportContext


def show_annotations(ctx: ReportContext, annotated: list[AnnotatedAllocation]) -> None:
    """Fill ``ctx.site_annotations`` and add the explorer's ``annotations`` (escaped as the rest
    of its JSON) to ``ctx.explorer_json``; nothing when ``annotated`` is empty."""
    if not annotated:
        return
    ctx.site_annotations = site_annotations(annotated)
    if ctx.explorer_json:
        body = json.loads(ctx.explorer_json)
        body["annotations"] = annotation_data(annotated)
        ctx.explorer_json = escaped_json(body)
