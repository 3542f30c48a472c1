"""The plan page: every cell says a value or why there is none, and a rank's stacked bar of
categories is one line whatever the window's width (widths in percent of its cell)."""

from __future__ import annotations

import re

from snapshot_lab import api
from snapshot_lab.render.plan import format_plan, plan_view, render_plan_html

from .conftest import sample_path


def test_without_a_memory_limit_fits_and_headroom_say_so():
    """transformer_varlen has no capture sidecar: no device capacity, no limit to judge by."""
    plan = api.plan(sample_path("transformer_varlen"), world_size=2, strategy="ddp")
    assert plan.memory_limit_bytes is None
    html = render_plan_html(plan, "transformer_varlen", "test")
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", html)
    assert "—" not in cells and cells.count("unknown") == 2 and cells.count("no limit known") == 2
    text = format_plan(plan)
    rows = [line for line in text.splitlines() if line.startswith(("recorded run", "every rank")) and ":" not in line]
    assert len(rows) == 2 and all(line.split()[-4:] == ["unknown", "no", "limit", "known"] for line in rows)


def test_stacked_bars_are_percentages_of_one_line():
    plan = api.plan(sample_path("transformer_varlen"), world_size=2, strategy="ddp")
    view = plan_view(plan)
    widths = [sum(bar["width"] for bar in rank["bars"]) for rank in view["ranks"]]
    # the largest peak allocated (every rank under DDP: 2.29 GiB) fills its cell, the recorded run less
    assert max(widths) <= 100.02 and widths[1] > 99.9 and widths[0] < widths[1]
    html = render_plan_html(plan, "transformer_varlen", "test")
    assert re.search(r'class="bar" title="activation: [^"]+" style="width:\d+(\.\d+)?%', html)
