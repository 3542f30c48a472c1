"""Free-block size histogram: are the free bytes in a few big holes or many small ones?"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from ..metrics.stats.fragmentation import PoolFragmentation
from ..units import format_bytes
from .common import COLORS, bytes_axis, new_figure, styled


@styled
def plot_free_histogram(pools: dict[str, PoolFragmentation], oom_request_bytes: int | None = None) -> Figure:
    """One panel per pool (large, small) with free blocks binned by power of two; bar height is
    the free bytes in the bin, the label the number of blocks."""
    names = [("large_pool", "large pool"), ("small_pool", "small pool")]
    present = [(k, title) for k, title in names if pools[k].free_blocks]
    if not present:
        present = names[:1]
    fig = new_figure(10.5, 2.9)
    axes = fig.subplots(1, len(present), squeeze=False)[0]
    for ax, (key, title) in zip(axes, present, strict=True):
        frag = pools[key]
        bins = frag.free_block_histogram
        if not bins:
            ax.text(0.5, 0.5, "no free blocks", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        lo_exp = int(np.log2(bins[0].lower_bytes))
        hi_exp = int(np.log2(bins[-1].lower_bytes))
        is_oom_pool = oom_request_bytes is not None and (key == "large_pool") == (oom_request_bytes > 1024 * 1024)
        if oom_request_bytes is not None and is_oom_pool:
            req_exp = int(np.log2(oom_request_bytes))
            lo_exp, hi_exp = min(lo_exp, req_exp), max(hi_exp, req_exp)
        # pad to a readable span of bins: empty neighbours show where the free bytes are not
        lo_exp, hi_exp = max(lo_exp - 1, 9), hi_exp + 1
        by_exp = {int(np.log2(b.lower_bytes)): b for b in bins}
        exps = list(range(lo_exp, hi_exp + 1))
        xs = np.arange(len(exps))
        heights = [by_exp[e].bytes if e in by_exp else 0 for e in exps]
        counts = [by_exp[e].count if e in by_exp else 0 for e in exps]
        # bin i spans [i, i + 1) on the axis: its tick, at the left edge, is the bin's start
        bars = ax.bar(xs, heights, width=0.92, align="edge", color=COLORS["inactive"], edgecolor="#8c8c8c", lw=0.6)
        for bar, count in zip(bars, counts, strict=True):
            if count:
                ax.annotate(
                    f"{count} block{'s' if count > 1 else ''}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 1),
                    textcoords="offset points",
                )
        ax.set_xticks(xs, [format_bytes(1 << e, 0).replace(".0 ", " ") for e in exps], rotation=45, ha="right")
        bytes_axis(ax.yaxis)
        # headroom: the block counts stay below the OOM annotation at the top
        ax.set_ylim(0, max(heights) * 1.7 if max(heights) else 1)
        ax.set_xlim(-0.1, len(exps) + 0.02)
        ax.set_xlabel("free block size (power-of-two bins; tick = bin start)")
        ax.set_ylabel("free bytes in bin")
        ax.set_title(
            f"{title}: {format_bytes(frag.free_bytes)} free in {frag.free_blocks} blocks, "
            f"largest {format_bytes(frag.largest_free_block_bytes)}",
            loc="left",
        )
        if oom_request_bytes is not None and is_oom_pool:
            pos = float(np.log2(oom_request_bytes)) - lo_exp  # on the same log2 scale as the bin edges
            ax.axvspan(-0.1, pos, color=COLORS["oom"], alpha=0.06, lw=0)
            ax.axvline(pos, color=COLORS["oom"], lw=1.5)
            ax.annotate(
                f"OOM request {format_bytes(oom_request_bytes)}:\nblocks left of this line are too small",
                (pos, ax.get_ylim()[1] * 0.97),
                color=COLORS["oom"],
                fontsize=8,
                ha="right",
                va="top",
                xytext=(-4, 0),
                textcoords="offset points",
            )
    return fig
