"""Memory categories: parameter, gradient, optimizer_state, activation, ddp_bucket,
cuda_graph_pool, other.

Read from the allocation stacks (Python-only and mixed C++ stacks both):

- ``cuda_graph_pool``: blocks of private pools (CUDA graphs, ``torch.cuda.MemPool``);
- ``ddp_bucket``: allocated by DistributedDataParallel itself (its Python code is the innermost
  Python frame, or the C++ ``Reducer`` is on the stack);
- ``optimizer_state``: allocated inside ``torch.optim`` (state such as Adam's moments, and the
  step's temporaries);
- ``parameter``: allocated while building or moving the model (``Module._apply``/``to``/
  ``cuda``, ``nn.init``, modules' ``__init__``/``reset_parameters``, weight initialisation);
- ``gradient``: allocated by autograd's ``AccumulateGrad`` (visible with C++ stacks). With
  Python-only stacks, backward runs on a C++ thread and records no stack: such allocations that
  have a parameter's exact size are gradients, the others the backward pass's activations;
- ``activation``: allocated inside a module's forward or during backward;
- ``other``: everything else (including allocations with no stack at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..frames import SnapshotFrames
from .lifetimes import allocation_lifetimes

CATEGORIES = (
    "parameter",
    "gradient",
    "optimizer_state",
    "activation",
    "ddp_bucket",
    "cuda_graph_pool",
    "other",
)

_PARAM_NAMES = {"reset_parameters", "_init_weights", "init_weights", "post_init", "from_pretrained", "_apply"}
_MODULE_MOVE = {"_apply", "to", "cuda", "convert", "_load_from_state_dict", "load_state_dict"}
_FORWARD_NAMES = {"_call_impl", "_wrapped_call_impl", "forward"}


@dataclass(frozen=True)
class CategoryBreakdown:
    device: int
    live_bytes: dict[str, int]  # allocated blocks at the dump, by category
    live_blocks: dict[str, int]
    # requested bytes over the trace per category (aligned with the device's event order)
    timeline: pd.DataFrame | None


def stack_categories(frames: SnapshotFrames) -> pd.Series:
    """Category of every stack_id from its frames."""
    st = frames.stacks
    if st.empty:
        return pd.Series([], dtype=object)
    sf = frames.stack_frames.set_index("frame_id")
    rows = st.join(sf, on="frame_id")
    fn = rows["filename"].astype(str)
    nm = rows["name"].astype(str)
    is_py = fn.str.endswith(".py")
    module_py = fn.str.endswith("torch/nn/modules/module.py")
    flags = pd.DataFrame(
        {
            "stack_id": rows["stack_id"],
            "reducer": nm.str.contains("Reducer::", regex=False),
            "optim": fn.str.contains("/torch/optim/", regex=False),
            "param": (module_py & nm.isin(_MODULE_MOVE))
            | fn.str.endswith("torch/nn/parameter.py")
            | fn.str.endswith("torch/nn/init.py")
            | nm.isin(_PARAM_NAMES)
            | (fn.str.contains("/torch/nn/modules/", regex=False) & (nm == "__init__")),
            "grad": nm.str.contains("AccumulateGrad", regex=False) | nm.str.contains("accumulate_grad", regex=False),
            "act": (module_py & nm.isin(_FORWARD_NAMES))
            | fn.str.contains("/torch/autograd/", regex=False)
            | nm.str.contains("autograd::Engine", regex=False),
        }
    )
    # DDP: its own code is the innermost Python frame of the stack
    py_rows = rows[is_py].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id")
    ddp_inner = set(
        py_rows.loc[py_rows["filename"].astype(str).str.endswith("torch/nn/parallel/distributed.py"), "stack_id"]
    )
    any_flag = flags.groupby("stack_id").any()
    cat = pd.Series("other", index=any_flag.index, dtype=object)
    # lowest precedence first; later assignments win
    cat[any_flag["act"]] = "activation"
    cat[any_flag["param"]] = "parameter"
    cat[any_flag["grad"]] = "gradient"
    cat[any_flag["optim"]] = "optimizer_state"
    cat[any_flag["reducer"] | any_flag.index.isin(list(ddp_inner))] = "ddp_bucket"
    return cat


def _in_private_pool(addresses: np.ndarray, segments: pd.DataFrame) -> np.ndarray:
    priv = segments[segments["is_private_pool"]].sort_values("address")
    if priv.empty or addresses.size == 0:
        return np.zeros(addresses.size, dtype=bool)
    starts = priv["address"].to_numpy()
    ends = starts + priv["total_size_bytes"].to_numpy()
    i = np.searchsorted(starts, addresses, side="right") - 1
    ok = i >= 0
    inside = np.zeros(addresses.size, dtype=bool)
    inside[ok] = addresses[ok] < ends[i[ok]]
    return inside


def _no_stack_category(sizes: np.ndarray, param_sizes: set[int], freed: np.ndarray | None) -> np.ndarray:
    is_grad = np.isin(sizes, list(param_sizes)) if param_sizes else np.zeros(sizes.size, dtype=bool)
    out = np.where(is_grad, "gradient", "other").astype(object)
    if freed is not None:
        out[~is_grad & freed] = "activation"  # backward temporaries: created and freed again
    return out


def categorize_blocks(frames: SnapshotFrames, stack_cat: pd.Series | None = None) -> pd.Series:
    """Category of every row of ``frames.blocks`` (index aligned)."""
    stack_cat = stack_categories(frames) if stack_cat is None else stack_cat
    b = frames.blocks
    cat = b["stack_id"].map(stack_cat).to_numpy(dtype=object, na_value=None).copy()  # type: ignore[call-overload]
    no_stack = pd.isna(cat)
    params = set(b.loc[cat == "parameter", "requested_size_bytes"].dropna().astype(int))
    if not params:  # fall back on optimizer state, which mirrors parameter sizes
        params = set(b.loc[cat == "optimizer_state", "requested_size_bytes"].dropna().astype(int))
    if no_stack.any():
        sizes = b.loc[no_stack, "requested_size_bytes"].fillna(-1).astype(int).to_numpy()
        cat[no_stack] = _no_stack_category(sizes, params, None)
    cat[b["is_private_pool"].to_numpy()] = "cuda_graph_pool"
    return pd.Series(cat, index=b.index, name="category")


def _lifetime_codes(
    frames: SnapshotFrames, device: int, stack_cat: pd.Series, params: set[int], lifetimes: pd.DataFrame
) -> np.ndarray:
    """Category code (index into CATEGORIES) of every allocation in ``lifetimes``."""
    codes = {c: i for i, c in enumerate(CATEGORIES)}
    sid = lifetimes["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    table = np.full(max(int(sid.max(initial=-1)), int(stack_cat.index.max()) if len(stack_cat) else -1) + 2, -1)
    table[stack_cat.index.to_numpy(dtype=np.int64)] = stack_cat.map(codes).to_numpy(dtype=np.int64)
    code = table[sid]  # sid -1 reads the last slot, which stays -1 (no stack)
    no_stack = code < 0
    if no_stack.any():
        freed = lifetimes["free_index"].notna().to_numpy()[no_stack]
        names = _no_stack_category(lifetimes["size_bytes"].to_numpy()[no_stack], params, freed)
        code[no_stack] = pd.Series(names).map(codes).to_numpy(dtype=np.int64)
    addr = lifetimes["address"].to_numpy(dtype=np.int64)
    code[_in_private_pool(addr, frames.segments[frames.segments["device"] == device])] = codes["cuda_graph_pool"]
    return code


def category_timeline(
    frames: SnapshotFrames, device: int, stack_cat: pd.Series, params: set[int], lifetimes: pd.DataFrame
) -> pd.DataFrame | None:
    """Requested bytes per category after every event of the device (columns = categories);
    each free counts against the category of the allocation it releases."""
    ev = frames.events[frames.events["device"] == device]
    if len(ev) < 2:
        return None
    code = _lifetime_codes(frames, device, stack_cat, params, lifetimes)
    base = int(ev["event_index"].iloc[0])
    size = lifetimes["size_bytes"].to_numpy()
    mat = np.zeros((len(ev), len(CATEGORIES)), dtype=np.int64, order="F")  # column-major: no copy into pandas
    mat[lifetimes["event_index"].to_numpy() - base, code] = size
    free_at = lifetimes["free_index"].to_numpy(dtype=np.int64, na_value=-1)
    freed = free_at >= 0
    mat[free_at[freed] - base, code[freed]] = -size[freed]
    levels = np.cumsum(mat, axis=0, out=mat)
    # allocations older than the trace are not in it: anchor each category at zero
    levels -= np.minimum(levels.min(axis=0), 0)
    return pd.DataFrame(levels, columns=list(CATEGORIES), copy=False)


def compute_categories(
    frames: SnapshotFrames,
    device: int,
    with_timeline: bool = True,
    lifetimes: pd.DataFrame | None = None,
    stack_cat: pd.Series | None = None,
    block_cat: pd.Series | None = None,
) -> CategoryBreakdown:
    """Live bytes per category at the dump and, with ``with_timeline``, over the trace. Pass
    ``stack_cat``/``block_cat`` (from :func:`stack_categories`/:func:`categorize_blocks`) when
    calling once per device, so they are computed once."""
    stack_cat = stack_categories(frames) if stack_cat is None else stack_cat
    cats = categorize_blocks(frames, stack_cat) if block_cat is None else block_cat
    b = frames.blocks
    live = (b["device"] == device) & (b["state"] == "active_allocated")
    by = b.loc[live, "size_bytes"].groupby(cats[live]).agg(["sum", "count"])
    params = set(b.loc[cats == "parameter", "requested_size_bytes"].dropna().astype(int)) or set(
        b.loc[cats == "optimizer_state", "requested_size_bytes"].dropna().astype(int)
    )
    timeline = None
    if with_timeline:
        if lifetimes is None:
            lifetimes = allocation_lifetimes(frames.events, device)
        timeline = category_timeline(frames, device, stack_cat, params, lifetimes)
    return CategoryBreakdown(
        device=device,
        live_bytes={c: int(by["sum"].get(c, 0)) for c in CATEGORIES},
        live_blocks={c: int(by["count"].get(c, 0)) for c in CATEGORIES},
        timeline=timeline,
    )
