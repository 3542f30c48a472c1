"""Colours shared by the plots and the HTML drawn without matplotlib (no matplotlib import here)."""

from __future__ import annotations

import hashlib

# the user's own categories (``--category``): colours none of the built-in ones has, one per name
USER_CATEGORY_COLORS = ("#17becf", "#8c564b", "#bcbd22", "#7f7f7f", "#2ca02c", "#9467bd", "#d62728", "#1f77b4")


class _CategoryColors(dict[str, str]):
    """The built-in categories' colours; a name it lacks (a user's category) reads a colour of
    :data:`USER_CATEGORY_COLORS` chosen by the name, the same in every run and every figure.
    ``get`` keeps dict's meaning (its default for a name it lacks)."""

    def __missing__(self, name: str) -> str:
        digest = hashlib.sha256(name.encode("utf-8")).digest()
        return USER_CATEGORY_COLORS[digest[0] % len(USER_CATEGORY_COLORS)]


CATEGORY_COLORS = _CategoryColors(
    {
        "parameter": "#4e79a7",
        "gradient": "#f28e2b",
        "optimizer_state": "#59a14f",
        "activation": "#e15759",
        "kv_cache": "#f1a2c0",
        "inflight_activation": "#ff9d9a",
        "fsdp_unsharded_params": "#76b7b2",
        "comm_buffer": "#edc948",
        "ddp_bucket": "#b07aa1",
        "cuda_graph_pool": "#9c755f",
        "private_pool": "#d4a373",
        "unknown": "#dcd7d2",
        "other": "#bab0ac",
    }
)


def category_color(name: str) -> str:
    """The colour of a category, built-in or the user's."""
    return CATEGORY_COLORS[name]
