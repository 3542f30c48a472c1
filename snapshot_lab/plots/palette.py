"""Colours shared by the plots and the HTML drawn without matplotlib (no matplotlib import here)."""

from __future__ import annotations

CATEGORY_COLORS = {
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
