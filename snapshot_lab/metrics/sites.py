"""Allocation sites: which lines of code hold the memory, now and at the peak.

A *site* is the innermost frame of a stack that is the user's own code (not PyTorch, not an
installed library, not the interpreter); when a stack has no such frame, its innermost library
frame. Interpreter and allocator internals (the C++ unwinder, CPython's eval loop, dispatcher
boxing) are filtered out of displayed stacks; the full stack stays available.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

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


@dataclass(frozen=True)
class Site:
    label: str
    detail: str | None  # the innermost library frame below the site (what the user's line called)
    filename: str
    line: int
    name: str
    bytes: int
    count: int
    stack_id: int | None  # the stack holding the most bytes at this site
    share: float  # of the bytes considered


def classify_frames(stack_frames: pd.DataFrame) -> pd.Series:
    """'internal', 'library' or 'user' per frame_id."""
    fn = stack_frames["filename"].astype(str)
    nm = stack_frames["name"].astype(str)
    internal = nm.str.startswith(INTERNAL_NAMES) | nm.isin(INTERNAL_EXACT_NAMES)
    for pat in INTERNAL_FILES:
        internal |= fn.str.contains(pat, regex=False)
    for pat in INTERNAL_NAME_PARTS:
        internal |= nm.str.contains(pat, regex=False)
    cpp = stack_frames["line"].eq(0) & ~fn.str.endswith(".py")
    library = cpp.copy()
    for pat in LIBRARY_FILES:
        library |= fn.str.contains(pat, regex=False)
    kind = np.where(internal, "internal", np.where(library, "library", "user"))
    return pd.Series(kind, index=stack_frames["frame_id"].to_numpy(), name="kind")


def site_frames(stacks: pd.DataFrame, stack_frames: pd.DataFrame) -> pd.Series:
    """The site frame_id of every stack_id (user frame first, then library, then anything)."""
    if stacks.empty:
        return pd.Series([], dtype="int64")
    kind = classify_frames(stack_frames)
    st = stacks.assign(kind=stacks["frame_id"].map(kind))
    rank = st["kind"].map({"user": 0, "library": 1, "internal": 2})
    st = st.assign(rank=rank).sort_values(["stack_id", "rank", "depth"])
    return st.drop_duplicates("stack_id").set_index("stack_id")["frame_id"]


def innermost_frames(stacks: pd.DataFrame, stack_frames: pd.DataFrame) -> pd.Series:
    """The innermost non-internal frame_id of every stack_id."""
    if stacks.empty:
        return pd.Series([], dtype="int64")
    kind = classify_frames(stack_frames)
    st = stacks[stacks["frame_id"].map(kind).to_numpy() != "internal"].sort_values(["stack_id", "depth"])
    return st.drop_duplicates("stack_id").set_index("stack_id")["frame_id"]


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
    return [{**f, "kind": k} for f, k in zip(stack, kind.to_numpy(), strict=True) if k != "internal"]


def short_path(filename: str, parts: int = 3) -> str:
    bits = filename.replace("\\", "/").split("/")
    return "/".join(bits[-parts:]) if len(bits) > parts else filename


def top_sites(
    stack_ids: pd.Series,
    sizes: pd.Series,
    stacks: pd.DataFrame,
    stack_frames: pd.DataFrame,
    limit: int = 15,
) -> list[Site]:
    """Group allocations (their stack ids and byte sizes) by site, largest first."""
    total = int(sizes.sum())
    if total == 0:
        return []
    site_of = site_frames(stacks, stack_frames)
    inner_of = innermost_frames(stacks, stack_frames)
    df = pd.DataFrame({"stack_id": stack_ids.to_numpy(), "bytes": sizes.to_numpy()})
    df["site"] = df["stack_id"].map(site_of).astype("Int64")
    by_stack = df.groupby(["site", "stack_id"], dropna=False)["bytes"].agg(["sum", "count"]).reset_index()
    frames = stack_frames.set_index("frame_id")
    out = []
    for site, grp in by_stack.groupby("site", dropna=False):
        nbytes, count = int(grp["sum"].sum()), int(grp["count"].sum())
        best = grp.sort_values("sum", ascending=False).iloc[0]
        best_stack = None if pd.isna(best["stack_id"]) else int(best["stack_id"])
        detail = None
        if pd.isna(site):
            label, fn, line, name = NO_STACK_LABEL, "", 0, ""
        else:
            f = frames.loc[int(site)]
            fn, line, name = str(f["filename"]), int(f["line"]), str(f["name"])
            label = frame_label(fn, line, name)
            inner = inner_of.get(best_stack) if best_stack is not None else None
            if inner is not None and int(inner) != int(site):
                g = frames.loc[int(inner)]
                detail = frame_label(str(g["filename"]), int(g["line"]), str(g["name"]))
        out.append(Site(label, detail, fn, line, name, nbytes, count, best_stack, nbytes / total))
    out.sort(key=lambda s: (-s.bytes, s.label))
    return out[:limit]


def live_sites(blocks: pd.DataFrame, stacks: pd.DataFrame, stack_frames: pd.DataFrame, limit: int = 15) -> list[Site]:
    """Sites of the blocks allocated at dump time, by block size."""
    live = blocks[blocks["state"] == "active_allocated"]
    return top_sites(live["stack_id"], live["size_bytes"], stacks, stack_frames, limit)


def alive_at(lifetimes: pd.DataFrame, index: int) -> pd.DataFrame:
    """Allocations of the trace alive just after event ``index`` (from
    :func:`~snapshot_lab.metrics.lifetimes.allocation_lifetimes`). Allocations made before the
    trace began are not in it."""
    alive = (lifetimes["event_index"] <= index) & (lifetimes["free_index"].isna() | (lifetimes["free_index"] > index))
    return lifetimes.loc[alive.to_numpy(dtype=bool), ["event_index", "address", "size_bytes", "stack_id"]]
