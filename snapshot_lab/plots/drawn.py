"""The report's figures as encoded text or bytes, each one call (issue #23).

``report.py`` imports this module only where a figure is drawn, so a report whose figures are
drawn in forked children (``report._Figures``) never imports matplotlib in the parent process.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from .categories import plot_category_timeline
from .common import figure_png_bytes, figure_png_data_uri, figure_svg
from .compare import plot_device_comparison
from .composition import plot_composition
from .first_screen import plot_first_screen
from .histogram import plot_free_histogram
from .layout import plot_block_layout
from .timeline import plot_timeline
from .views import CategoryView, TimelineView


def histogram_svg(pools: Any, oom_request_bytes: int | None) -> str:
    return figure_svg(plot_free_histogram(pools, oom_request_bytes))


def layout_png(layouts: Any) -> str:
    return figure_png_data_uri(plot_block_layout(layouts))


def timeline_png(view: TimelineView) -> str:
    return figure_png_data_uri(plot_timeline(view))


def category_png(view: CategoryView) -> str:
    return figure_png_data_uri(plot_category_timeline(view))


def composition_svg(comp: Any) -> str:
    return figure_svg(plot_composition(comp))


def device_comparison_svg(rows: pd.DataFrame) -> str:
    return figure_svg(plot_device_comparison(rows))


def first_screen_png(*args: Any) -> bytes:
    return figure_png_bytes(plot_first_screen(*args))
