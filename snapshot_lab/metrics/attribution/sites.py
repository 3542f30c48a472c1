"""Allocation sites: which lines of code hold the memory, now and at the peak.

A *site* is the innermost frame of a stack that is the user's own code (not PyTorch, not an
installed library, not the interpreter); when a stack has no such frame, its innermost library
frame. Interpreter and allocator internals (the C++ unwinder, CPython's eval loop, dispatcher
boxing) are filtered out of displayed stacks; the full stack stays available.

Allocations made on autograd's thread are named after the autograd node that made them
(``AddmmBackward0 (backward)``): its C++ stack holds no user frame, and the innermost library
frame is an ATen internal such as ``create_out`` that says nothing to a user. Where the
recording has them (anomaly mode), the forward frames that created the node follow. The detail
of a site is the ATen operator that allocated (``aten::mm``) when the stack names one.
Allocations recorded with no stack are grouped by their category (``<no stack recorded:
gradient>``): with ``stacks='python'`` the backward pass records none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .._memo import memo

# frames that only say "the interpreter / the recorder was running" (as the stock viewers filter)
INTERNAL_NAMES = (
    "unwind::unwind",
    "CapturedTraceback::gather",
    "gather_with_cpp",
    "__libc_start_main",
    "PyEval_",
    "PyObject_",
    "PyFunction_",
    "_PyEval",
    "_PyObject",
    "_PyFunction",
)
INTERNAL_EXACT_NAMES = ("_start",)
# C++ frames of the recorder, the allocator itself and the dispatcher: they say how memory is
# allocated, never why
INTERNAL_NAME_PARTS = (
    "unwind::unwind",
    "CapturedTraceback::gather",
    "gather_with_cpp",
    "CUDACachingAllocator",
    "CachingDeviceAllocator",
    "at::detail::empty_",
    "c10::impl::",
    "c10::Dispatcher",
    "c10::KernelFunction",
    "c10::BoxedKernel",
    "at::_ops::",
)
INTERNAL_FILES = (
    "core/boxing",
    "/Register",
    # C++ frames carry bare file names (RegisterCUDA_0.cpp): generated dispatch wrappers
    "Register",
    "/Redispatch",
    "pythonrun.c",
    "Modules/main.c",
    "Objects/call.c",
    "Objects/methodobject.c",
    "pycore_ceval.h",
    "ceval.c",
    "cpython/abstract.h",
)
LIBRARY_FILES = ("/torch/", "site-packages/", "dist-packages/", "<frozen ", "/lib/python3", "/lib64/python3")

NO_STACK_LABEL = "<no stack recorded>"
_NODE_RE = re.compile(r"torch::autograd::(?:generated::)?(\w+?)(?:_apply_functional)?(?:::apply|\()")
_GENERIC_NODES = {"Node", "Engine", "python", "VariableType", "details", "GraphTask"}
_CACHE_PARTS = ("setWorkspaceForHandle", "getCUDABlasLtWorkspace", "getNewWorkspace")
_OP_RE = re.compile(r"at::_ops::(\w+)::(?:call|redispatch)")


@dataclass(frozen=True)
class Site:
    label: str
    # the innermost library frame below the site (what the user's line called)
    detail: str | None
    filename: str
    line: int
    name: str
    bytes: int
    count: int
    stack_id: int | None  # the stack holding the most bytes at this site
    share: float  # of the bytes considered


def classify_frames(stack_frames: pd.DataFrame) -> pd.Series:
    """'internal', 'library' or 'user' per frame_id."""
    filenames = stack_frames["filename"].astype(str)
    names = stack_frames["name"].astype(str)
    internal = names.str.startswith(INTERNAL_NAMES) | names.isin(INTERNAL_EXACT_NAMES)
    for pattern in INTERNAL_FILES:
        internal |= filenames.str.contains(pattern, regex=False)
    for pattern in INTERNAL_NAME_PARTS:
        internal |= names.str.contains(pattern, regex=False)
    cpp = stack_frames["line"].eq(0) & ~filenames.str.endswith(".py")
    library = cpp.copy()
    for pattern in LIBRARY_FILES:
        library |= filenames.str.contains(pattern, regex=False)
    kind = np.where(internal, "internal", np.where(library, "library", "user"))
    return pd.Series(kind, index=stack_frames["frame_id"].to_numpy(), name="kind")


def site_frames(stacks: pd.DataFrame, stack_frames: pd.DataFrame) -> pd.Series:
    """The site frame_id of every stack_id (user frame first, then library, then anything)."""
    if stacks.empty:
        return pd.Series([], dtype="int64")
    kind = classify_frames(stack_frames)
    ranked = stacks.assign(kind=stacks["frame_id"].map(kind))
    rank = ranked["kind"].map({"user": 0, "library": 1, "internal": 2})
    ranked = ranked.assign(rank=rank).sort_values(["stack_id", "rank", "depth"])
    return ranked.drop_duplicates("stack_id").set_index("stack_id")["frame_id"]


def innermost_frames(stacks: pd.DataFrame, stack_frames: pd.DataFrame) -> pd.Series:
    """The innermost non-internal frame_id of every stack_id."""
    if stacks.empty:
        return pd.Series([], dtype="int64")
    kind = classify_frames(stack_frames)
    outer_stacks = stacks[stacks["frame_id"].map(kind).to_numpy() != "internal"].sort_values(["stack_id", "depth"])
    return outer_stacks.drop_duplicates("stack_id").set_index("stack_id")["frame_id"]


def frame_label(filename: str, line: int, name: str) -> str:
    if line:
        return f"{short_path(filename)}:{line} in {name}"
    return f"{name} ({short_path(filename)})" if filename and filename != "??" else name


def display_stack(stack: list[dict[str, object]]) -> list[dict[str, object]]:
    """A stack without interpreter/allocator internals, innermost first."""
    frames = pd.DataFrame(stack or [], columns=["filename", "line", "name"])
    if frames.empty:
        return []
    frames["frame_id"] = range(len(frames))
    kind = classify_frames(frames)
    kinds = kind.to_numpy()
    return [
        {**frame, "kind": frame_kind}
        for frame, frame_kind in zip(stack, kinds, strict=True)
        if frame_kind != "internal"
    ]


def short_path(filename: str, parts: int = 3) -> str:
    bits = filename.replace("\\", "/").split("/")
    return "/".join(bits[-parts:]) if len(bits) > parts else filename


def autograd_nodes(stacks: pd.DataFrame, stack_frames: pd.DataFrame) -> pd.Series:
    """The innermost autograd node of every stack that has one (``AddmmBackward0``); ``autograd
    engine`` for the engine's own work outside any node (reducing a gradient to its input's
    shape, for instance)."""
    names = stack_frames["name"].astype(str)
    node = names.str.extract(_NODE_RE, expand=False)
    node = node.where(~node.isin(list(_GENERIC_NODES)) & names.str.contains("apply", regex=False))
    engine = pd.Series("autograd engine", index=names.index).where(
        names.str.contains("autograd::Engine::", regex=False)
    )
    node = node.fillna(engine)
    node_of_frame = pd.Series(node.to_numpy(), index=stack_frames["frame_id"].to_numpy()).dropna()
    if node_of_frame.empty or stacks.empty:
        return pd.Series([], dtype=object)
    holders = stacks[stacks["frame_id"].isin(node_of_frame.index)].sort_values(["stack_id", "depth"])
    holders = holders.drop_duplicates("stack_id")
    return pd.Series(
        node_of_frame.reindex(holders["frame_id"]).to_numpy(),
        index=holders["stack_id"].to_numpy(),
        dtype=object,
    )


def aten_ops(stacks: pd.DataFrame, stack_frames: pd.DataFrame) -> pd.Series:
    """The innermost ATen operator of every stack whose C++ frames name one (``aten::mm``)."""
    ops = stack_frames["name"].astype(str).str.extract(_OP_RE, expand=False)
    op_of_frame = pd.Series(ops.to_numpy(), index=stack_frames["frame_id"].to_numpy()).dropna()
    if op_of_frame.empty or stacks.empty:
        return pd.Series([], dtype=object)
    holders = stacks[stacks["frame_id"].isin(op_of_frame.index)].sort_values(["stack_id", "depth"])
    holders = holders.drop_duplicates("stack_id")
    return pd.Series(
        ["aten::" + name for name in op_of_frame.reindex(holders["frame_id"]).to_numpy()],
        index=holders["stack_id"].to_numpy(),
    )


@dataclass(frozen=True)
class StackSites:
    """For every stack_id: the site's text label, its detail (what the site's line called, or the
    operator), and the site frame (filename, line, name; empty for an autograd node)."""

    # index stack_id; columns label, detail, filename, line, name
    table: pd.DataFrame

    def label(self, stack_id: int | None, category: str | None = None) -> str:
        if stack_id is None or stack_id not in self.table.index:
            return f"{NO_STACK_LABEL[:-1]}: {category}>" if category else NO_STACK_LABEL
        return str(self.table.at[stack_id, "label"])


def stack_sites(stacks: pd.DataFrame, stack_frames: pd.DataFrame) -> StackSites:
    """Labels of every stack's site (see the module docstring)."""
    cols = ["label", "detail", "filename", "line", "name"]
    if stacks.empty:
        return StackSites(pd.DataFrame(columns=cols))
    site_of = site_frames(stacks, stack_frames)
    inner_of = innermost_frames(stacks, stack_frames)
    frame_table = stack_frames.set_index("frame_id")
    labels = {
        int(fid): frame_label(str(filename), int(line), str(name))
        for fid, filename, line, name in zip(
            frame_table.index,
            frame_table["filename"],
            frame_table["line"],
            frame_table["name"],
            strict=True,
        )
    }
    ids = site_of.index.to_numpy()
    site_fid = site_of.to_numpy()
    table = pd.DataFrame(
        {
            "label": [labels[int(frame_id)] for frame_id in site_fid],
            "detail": [
                labels.get(int(inner_of.get(stack_id, frame_id)), "")
                for stack_id, frame_id in zip(ids, site_fid, strict=True)
            ],
            "filename": frame_table.loc[site_fid, "filename"].astype(str).to_numpy(),
            "line": frame_table.loc[site_fid, "line"].to_numpy(),
            "name": frame_table.loc[site_fid, "name"].astype(str).to_numpy(),
        },
        index=ids,
    )
    ops = aten_ops(stacks, stack_frames)
    if len(ops):
        table.loc[ops.index, "detail"] = ops.to_numpy()
    nodes = autograd_nodes(stacks, stack_frames)
    kind = classify_frames(stack_frames)
    user = stacks.assign(kind=stacks["frame_id"].map(kind).to_numpy())
    has_user = set(user.loc[user["kind"] == "user", "stack_id"].astype(int))
    # a user frame still names the site best
    named = [stack_id for stack_id in nodes.index if int(stack_id) not in has_user]
    if named:
        table.loc[named, "label"] = [f"{nodes[stack_id]} (backward)" for stack_id in named]
        table.loc[named, ["filename", "name"]] = ""
        table.loc[named, "line"] = 0
    # library caches kept for the process's life (cuBLAS workspaces): named as such, with the
    # operation that first needed them
    cache = stack_frames["name"].astype(str).str.contains("|".join(_CACHE_PARTS), regex=True)
    cache_frames = set(stack_frames.loc[cache, "frame_id"].astype(int))
    cache_stacks = (
        stacks[stacks["frame_id"].isin(cache_frames)].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id")
    )
    for stack_id, fid in zip(
        cache_stacks["stack_id"].astype(int),
        cache_stacks["frame_id"].astype(int),
        strict=True,
    ):
        if stack_id in table.index:
            first = table.at[stack_id, "label"]
            table.at[stack_id, "label"] = (
                f"cuBLAS workspace, first used {'by' if '(backward)' in first else 'at'} {first}"
            )
            table.at[stack_id, "detail"] = labels[fid]
    table["detail"] = table["detail"].where(table["detail"] != table["label"], "")
    return StackSites(table)


def snapshot_sites(frames: SnapshotFrames) -> StackSites:
    """:func:`stack_sites` of a snapshot's stacks (computed once)."""
    return memo(frames, "sites", lambda: stack_sites(frames.stacks, frames.stack_frames))


def site_labels(
    stack_ids: np.ndarray,
    sites: StackSites,
    categories: np.ndarray | None = None,
    forward_ids: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Label and detail of each allocation (its stack id, -1 for none): the site of its stack;
    stackless allocations are grouped by their ``categories``; an allocation the backward pass
    made under anomaly mode (``forward_ids``: the forward stack that created its autograd node)
    is named after that forward site as well (``AddmmBackward0 (backward) of model.py:12 in
    forward``; ``backward of model.py:12 in forward`` when it has no stack of its own)."""
    table = sites.table
    row = _rows_of(table.index, stack_ids)
    known = row >= 0
    labels = np.empty(stack_ids.size, dtype=object)
    detail = np.full(stack_ids.size, "", dtype=object)
    # the table's own string objects, one lookup each (no new string per allocation)
    labels[known] = table["label"].to_numpy(dtype=object)[row[known]]
    detail[known] = table["detail"].fillna("").to_numpy(dtype=object)[row[known]]
    unknown = np.flatnonzero(~known)
    if categories is None:
        labels[unknown] = sites.label(None)
    elif unknown.size:
        # one label per category, shared by its stackless allocations
        cats = np.asarray(categories, dtype=object)[unknown]
        missing = pd.isna(cats)
        labels[unknown[missing]] = [sites.label(None, c) for c in cats[missing]]
        code, names = pd.factorize(cats[~missing])
        labels[unknown[~missing]] = np.array([sites.label(None, c) for c in names], dtype=object)[code]
    if forward_ids is not None:
        forward_row = _rows_of(table.index, forward_ids)
        has = np.flatnonzero(forward_row >= 0)
        if has.size:
            forward = table["label"].to_numpy(dtype=object)[forward_row[has]]
            for i, forward_label in zip(has, forward, strict=True):
                base = str(labels[i])
                if base.endswith("(backward)"):
                    labels[i] = f"{base} of {forward_label}"
                elif base.startswith(NO_STACK_LABEL[:-1]):
                    labels[i] = f"backward of {forward_label}"
    return labels, detail


def site_codes(
    stack_ids: np.ndarray, sites: StackSites, category: np.ndarray, category_names: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`site_labels`' labels of allocations (stackless ones by their ``category``, codes
    into ``category_names``) as ``pd.factorize`` numbers them: codes in order of first
    appearance, and the labels. Worked out on the few distinct labels instead of a string per
    allocation (an object array and its hashing: 1.6M allocations at 5M entries)."""
    candidates = np.array(
        [*sites.table["label"].tolist(), *(sites.label(None, name) for name in category_names)], dtype=object
    )
    label_id, distinct = pd.factorize(candidates)  # equal labels share one id
    if (label_id < 0).any():  # a missing label: as site_labels gives it
        codes, names = pd.factorize(pd.Series(site_labels(stack_ids, sites, np.asarray(category_names)[category])[0]))
        return codes, np.asarray(names, dtype=object)
    row = _rows_of(sites.table.index, stack_ids)
    per_allocation = np.where(row >= 0, label_id[np.maximum(row, 0)], label_id[len(sites.table) + category])
    codes, first = pd.factorize(per_allocation)
    return codes, np.asarray(distinct, dtype=object)[first]


def _rows_of(index: pd.Index, stack_ids: np.ndarray) -> np.ndarray:
    """Position in ``index`` (the site table's stack ids, one row per stack) of every stack id,
    -1 where it has no site: the table's few rows are hashed, not the allocations."""
    return index.get_indexer(pd.Index(stack_ids)).astype(np.int64, copy=False)


def allocation_forward_ids(
    frames: SnapshotFrames,
    device: int,
    event_index: np.ndarray,
) -> np.ndarray | None:
    """``forward_stack_id`` (-1 for none) of the allocations at ``event_index`` of a device's
    trace; None when the recording has no forward stacks (no anomaly mode)."""
    forward_ids = memo(
        frames,
        ("forward_stack_ids", device),
        lambda: _device_forward_ids(frames.events, device),
    )
    return None if forward_ids is None else forward_ids[event_index]


def _device_forward_ids(events: pd.DataFrame, device: int) -> np.ndarray | None:
    if not events["forward_stack_id"].notna().any():  # the usual case: no copy of the column
        return None
    fwd = events.loc[events["device"] == device, "forward_stack_id"]
    return fwd.to_numpy(dtype=np.int64, na_value=-1) if fwd.notna().any() else None


def block_forward_ids(blocks: pd.DataFrame) -> np.ndarray | None:
    fwd = blocks["forward_stack_id"]
    return fwd.to_numpy(dtype=np.int64, na_value=-1) if fwd.notna().any() else None


def top_sites(
    stack_ids: pd.Series,
    sizes: pd.Series,
    sites: StackSites,
    limit: int = 15,
    categories: pd.Series | None = None,
    forward_ids: np.ndarray | None = None,
) -> list[Site]:
    """Group allocations (their stack ids and byte sizes) by site label, largest first;
    ``categories`` (aligned with ``stack_ids``) names the groups of stackless allocations,
    ``forward_ids`` the forward sites of backward allocations (see :func:`site_labels`)."""
    total = int(sizes.sum())
    if total == 0:
        return []
    sid = stack_ids.to_numpy(dtype=np.int64, na_value=-1) if len(stack_ids) else np.zeros(0, dtype=np.int64)
    cats = categories.to_numpy(dtype=object) if categories is not None else None
    labels, _ = site_labels(sid, sites, cats, forward_ids)
    table = sites.table
    df = pd.DataFrame({"label": labels, "stack_id": sid, "bytes": sizes.to_numpy()})
    by_stack = df.groupby(["label", "stack_id"])["bytes"].agg(["sum", "count"]).reset_index()
    out = []
    for label, grp in by_stack.groupby("label"):
        nbytes, count = int(grp["sum"].sum()), int(grp["count"].sum())
        best = int(grp.sort_values("sum", ascending=False).iloc[0]["stack_id"])
        if best >= 0 and best in table.index:
            site_row = table.loc[best]
            filename, line, name, detail = (
                str(site_row["filename"]),
                int(site_row["line"]),
                str(site_row["name"]),
                str(site_row["detail"]) or None,
            )
            out.append(Site(str(label), detail, filename, line, name, nbytes, count, best, nbytes / total))
        else:
            out.append(Site(str(label), None, "", 0, "", nbytes, count, None, nbytes / total))
    out.sort(key=lambda site: (-site.bytes, site.label))
    return out[:limit]


def live_sites(
    blocks: pd.DataFrame, sites: StackSites, limit: int = 15, categories: pd.Series | None = None
) -> list[Site]:
    """Sites of the blocks allocated at dump time, by block size (``categories`` aligned with
    ``blocks``)."""
    live = blocks["state"] == "active_allocated"
    cats = categories[live] if categories is not None else None
    fwd = block_forward_ids(blocks[live])
    return top_sites(
        blocks.loc[live, "stack_id"],
        blocks.loc[live, "size_bytes"],
        sites,
        limit,
        cats,
        fwd,
    )


def alive_at(lifetimes: pd.DataFrame, index: int) -> pd.DataFrame:
    """Allocations of the trace alive just after event ``index`` (from
    :func:`~snapshot_lab.metrics.history.lifetimes.allocation_lifetimes`). Allocations made before the
    trace began are not in it."""
    alive = (lifetimes["event_index"] <= index) & (lifetimes["free_index"].isna() | (lifetimes["free_index"] > index))
    return lifetimes.loc[alive.to_numpy(dtype=bool), ["event_index", "address", "size_bytes", "stack_id"]]


def allocation_annotations(frames: SnapshotFrames) -> pd.DataFrame:
    """What ``torch.cuda.memory._annotate_tensor`` attached to allocations (torch >= 2.14): one
    row per ``annotate`` entry with the allocation it names, the latest ``alloc`` of the same
    address before it on its device (``alloc_event_index`` <NA> when that allocation predates
    the trace). Columns: device, alloc_event_index, address, annotate_event_index, annotation
    (the entry's ``user_metadata``, raw text: escape it where it is shown), stack_id (the
    annotation site's own stack). Empty when the trace has no annotations."""
    ev = frames.events
    columns = ["device", "alloc_event_index", "address", "annotate_event_index", "annotation", "stack_id"]
    ann = ev[ev["action"] == "annotate"]
    if ann.empty:
        return pd.DataFrame({c: pd.Series([], dtype="Int64" if c != "annotation" else object) for c in columns})
    allocs = ev.loc[ev["action"] == "alloc", ["device", "address", "event_index"]].dropna(subset=["address"])
    left = ann[["device", "address", "event_index", "user_metadata", "stack_id"]].rename(
        columns={"event_index": "annotate_event_index", "user_metadata": "annotation"}
    )
    left = left.dropna(subset=["address"]).astype({"address": "int64", "annotate_event_index": "int64"})
    right = allocs.rename(columns={"event_index": "alloc_event_index"}).astype(
        {"address": "int64", "alloc_event_index": "int64"}
    )
    merged = pd.merge_asof(
        left.sort_values("annotate_event_index"),
        right.sort_values("alloc_event_index"),
        left_on="annotate_event_index",
        right_on="alloc_event_index",
        by=["device", "address"],
        direction="backward",
    )
    merged["annotation"] = merged["annotation"].astype(str)
    merged["alloc_event_index"] = merged["alloc_event_index"].astype("Int64")
    return merged[columns].sort_values(["device", "annotate_event_index"], ignore_index=True)
