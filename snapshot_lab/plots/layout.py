"""Block layout: each segment a bar, its blocks drawn to scale and coloured by state."""

from __future__ import annotations

import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..metrics.stats.layout import PoolLayout
from ..units import format_bytes
from .common import COLORS, new_figure, styled

_ROW_INCHES = 0.2


def _rects(x0: np.ndarray, w: np.ndarray, y: np.ndarray, h: float) -> np.ndarray:
    return np.stack(
        [
            np.stack([x0, y - h / 2], 1),
            np.stack([x0 + w, y - h / 2], 1),
            np.stack([x0 + w, y + h / 2], 1),
            np.stack([x0, y + h / 2], 1),
        ],
        axis=1,
    )


@styled
def plot_block_layout(pools: list[PoolLayout]) -> Figure:
    """One panel per pool; each row is one segment (largest first), all drawn to one scale (the
    largest segment of the figure spans the axis), so sizes compare across rows and panels."""
    rows = [len(p.segments) for p in pools] or [1]
    height = sum(max(r, 3) * _ROW_INCHES + 0.9 for r in rows) + 0.4
    fig = new_figure(10.5, height)
    scale = float(max((p.segments["total_size_bytes"].max() for p in pools), default=1) or 1)
    axes = fig.subplots(len(pools) or 1, 1, squeeze=False, height_ratios=[max(r, 3) + 4 for r in rows])[:, 0]
    for ax, pool in zip(axes, pools, strict=False):
        segs = pool.segments.reset_index(drop=True)
        ypos = {sid: i for i, sid in enumerate(segs["segment_id"])}
        blk = pool.blocks
        x0 = blk["offset_bytes"].to_numpy() / scale
        w = blk["size_bytes"].to_numpy() / scale
        ax.barh(
            range(len(segs)),
            segs["total_size_bytes"].to_numpy() / scale,
            height=0.72,
            color="none",
            edgecolor="#8c8c8c",
            lw=0.5,
        )
        y = blk["segment_id"].map(ypos).to_numpy(dtype=np.float64)
        for state in ("inactive", "active_allocated", "active_pending_free"):
            m = (blk["state"] == state).to_numpy()
            if m.any():
                edge = "#bdbdbd" if state == "inactive" else "white"
                ax.add_collection(
                    PolyCollection(
                        list(_rects(x0[m], w[m], y[m], 0.72)), facecolors=COLORS[state], edgecolors=edge, linewidths=0.3
                    )
                )
        labels, label_colors = [], []
        for _, s in segs.iterrows():
            times = pool.repeats.get(int(s["segment_id"]), 1)
            size = format_bytes(s["total_size_bytes"], 1) + (f" ×{times}" if times > 1 else "")
            if s["is_private_pool"]:
                labels.append(f"{size} · graph pool ({s['pool_id_0']},{s['pool_id_1']})")
                label_colors.append(COLORS["private"])
            elif s["is_expandable"]:
                labels.append(f"{size} · expandable")
                label_colors.append(COLORS["expandable"])
            else:
                labels.append(size)
                label_colors.append("black")
        ax.set_yticks(range(len(segs)), labels, fontsize=7)
        for tick, color in zip(ax.get_yticklabels(), label_colors, strict=True):
            tick.set_color(color)
        ax.set_ylim(len(segs) - 0.5, -0.5)
        ax.set_xlim(0, 1)
        ticks = [0, 0.25, 0.5, 0.75, 1]
        ax.set_xticks(ticks, [format_bytes(t * scale, 1) for t in ticks])
        ax.set_xlabel("offset in the segment (one scale for every segment)")
        ax.tick_params(axis="y", length=0)
        ax.spines["left"].set_visible(False)
        drawn = sum(pool.repeats.get(int(sid), 1) for sid in segs["segment_id"])
        title = f"{pool.pool} pool: {drawn} largest segments"
        if drawn > len(segs):
            title += f" in {len(segs)} row{'s' if len(segs) > 1 else ''} (alike segments drawn once, ×N)"
        if pool.hidden_segments:
            title += (
                f" (+{pool.hidden_segments} smaller not drawn: {format_bytes(pool.hidden_reserved_bytes)} reserved, "
                f"{format_bytes(pool.hidden_allocated_bytes)} allocated, {format_bytes(pool.hidden_free_bytes)} free)"
            )
        ax.set_title(title, loc="left")
    fig.legend(handles=_legend(pools), loc="outside lower center", ncols=5)
    return fig


def _legend(pools: list[PoolLayout]) -> list[Patch]:
    """Only what the figure shows: the block states that occur, the label colours in use."""
    states = set().union(*(set(p.blocks["state"].astype(str)) for p in pools)) if pools else set()
    segs = [p.segments for p in pools]
    entries = [
        ("active_allocated" in states, Patch(facecolor=COLORS["active_allocated"], label="allocated")),
        (
            "active_pending_free" in states,
            Patch(facecolor=COLORS["active_pending_free"], label="freed, awaiting other stream"),
        ),
        ("inactive" in states, Patch(facecolor=COLORS["inactive"], edgecolor="#bdbdbd", label="free (cached)")),
        (
            any(s["is_private_pool"].any() for s in segs),
            Patch(facecolor=COLORS["private"], label="label colour: CUDA graph / private pool"),
        ),
        (
            any(s["is_expandable"].any() for s in segs),
            Patch(facecolor=COLORS["expandable"], label="label colour: expandable segment"),
        ),
    ]
    return [patch for shown, patch in entries if shown]
