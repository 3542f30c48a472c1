"""What an allocation stack says: its category, and the thread it was recorded on.

Categories from the frames (Python-only and mixed C++ stacks both):

- ``ddp_bucket``: allocated by DistributedDataParallel itself (its Python code is the innermost
  Python frame, or the C++ ``Reducer`` is on the stack);
- ``optimizer_state``: allocated inside ``torch.optim`` (state such as Adam's moments, and the
  step's temporaries);
- ``parameter``: allocated while building or moving the model (``Module._apply``/``to``/
  ``cuda``, ``nn.init``, modules' ``__init__``/``reset_parameters``, weight initialisation);
- ``gradient``: allocated by autograd's ``AccumulateGrad`` (only when it accumulates out of
  place; the usual gradient buffer is made by the backward op itself and is found by the
  lifetime rule in :mod:`.gradients`);
- ``activation``: allocated inside a module's forward or by the autograd engine;
- ``other``: everything else, and C++ library caches such as cuBLAS workspaces.

Threads: ``main`` (the program's own thread: its outermost Python frame is the program's entry,
a script's ``<module>``, runpy or multiprocessing), ``autograd`` (the engine's worker thread:
a C++ ``autograd::Engine`` frame, or Python frames that start inside torch, such as
checkpoint's recompute hook or a compiled graph's backward), ``other`` (C++ frames only: a
library's worker thread).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames

_PARAM_NAMES = {"reset_parameters", "_init_weights", "init_weights", "post_init", "from_pretrained", "_apply"}
_MODULE_MOVE = {"_apply", "to", "cuda", "convert", "_load_from_state_dict", "load_state_dict"}
_FORWARD_NAMES = {"_call_impl", "_wrapped_call_impl", "forward"}
# C++ caches that live as long as the process: cuBLAS/cuBLASLt workspaces (one per handle and
# stream, the autograd thread gets its own)
_CPP_CACHE_PARTS = ("setWorkspaceForHandle", "getCUDABlasLtWorkspace", "getNewWorkspace", "getChosenWorkspaceSize")
_ENGINE_PARTS = ("autograd::Engine::", "PythonEngine::thread_init")


def _stack_rows(frames: SnapshotFrames) -> pd.DataFrame:
    sf = frames.stack_frames.set_index("frame_id")
    rows = frames.stacks.join(sf, on="frame_id")
    return rows.assign(filename=rows["filename"].astype(str), name=rows["name"].astype(str))


def _is_python(rows: pd.DataFrame) -> pd.Series:
    """Python frames have a line number (C++ frames are symbolised with line 0) or a .py file."""
    fn = rows["filename"]
    return (rows["line"] > 0) | fn.str.endswith(".py") | fn.str.startswith("<")


def stack_categories(frames: SnapshotFrames) -> pd.Series:
    """Category of every stack_id from its frames."""
    if frames.stacks.empty:
        return pd.Series([], dtype=object)
    rows = _stack_rows(frames)
    fn, nm = rows["filename"], rows["name"]
    module_py = fn.str.endswith("torch/nn/modules/module.py")
    cache = pd.Series(False, index=rows.index)
    for part in _CPP_CACHE_PARTS:
        cache |= nm.str.contains(part, regex=False)
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
            "cache": cache,
        }
    )
    # DDP: its own code is the innermost Python frame of the stack
    py_rows = rows[_is_python(rows)].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id")
    ddp_inner = set(py_rows.loc[py_rows["filename"].str.endswith("torch/nn/parallel/distributed.py"), "stack_id"])
    any_flag = flags.groupby("stack_id").any()
    cat = pd.Series("other", index=any_flag.index, dtype=object)
    # lowest precedence first; later assignments win
    cat[any_flag["act"]] = "activation"
    cat[any_flag["param"]] = "parameter"
    cat[any_flag["grad"]] = "gradient"
    cat[any_flag["optim"]] = "optimizer_state"
    cat[any_flag["cache"]] = "other"
    cat[any_flag["reducer"] | any_flag.index.isin(list(ddp_inner))] = "ddp_bucket"
    return cat


def stack_threads(frames: SnapshotFrames) -> pd.Series:
    """``main``, ``autograd`` or ``other`` for every stack_id (see the module docstring).

    Why the outermost Python frame: with ``stacks='python'`` the autograd thread records no
    frames for the built-in backward ops, but Python code it calls back into (non-reentrant
    checkpoint's recompute, a compiled graph's backward, custom autograd Functions) is recorded
    with frames that begin inside torch, never at the program's entry."""
    if frames.stacks.empty:
        return pd.Series([], dtype=object)
    rows = _stack_rows(frames)
    py = _is_python(rows)
    engine = pd.Series(False, index=rows.index)
    for part in _ENGINE_PARTS:
        engine |= rows["name"].str.contains(part, regex=False)
    has_engine = engine.groupby(rows["stack_id"]).any()
    outer = rows[py].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id", keep="last")
    outer_in_torch = pd.Series(
        outer["filename"].str.contains("/torch/", regex=False).to_numpy(), index=outer["stack_id"].to_numpy()
    )
    ids = has_engine.index
    thread = np.where(
        has_engine.to_numpy(),
        "autograd",
        np.where(
            ids.isin(outer_in_torch.index),
            np.where(outer_in_torch.reindex(ids, fill_value=False).to_numpy(dtype=bool), "autograd", "main"),
            "other",
        ),
    )
    return pd.Series(thread, index=ids, dtype=object)


def stacks_with_frame(frames: SnapshotFrames, name: str) -> set[int]:
    """stack_ids that have a frame with exactly this function name (e.g. ``zero_grad``)."""
    if frames.stacks.empty:
        return set()
    fids = frames.stack_frames.loc[frames.stack_frames["name"].astype(str) == name, "frame_id"]
    return set(frames.stacks.loc[frames.stacks["frame_id"].isin(fids), "stack_id"].astype(int))


def cache_stacks(frames: SnapshotFrames) -> set[int]:
    """stack_ids of C++ library caches (cuBLAS workspaces): held for the process's life."""
    if frames.stacks.empty:
        return set()
    nm = frames.stack_frames["name"].astype(str)
    hit = pd.Series(False, index=nm.index)
    for part in _CPP_CACHE_PARTS:
        hit |= nm.str.contains(part, regex=False)
    fids = frames.stack_frames.loc[hit, "frame_id"]
    return set(frames.stacks.loc[frames.stacks["frame_id"].isin(fids), "stack_id"].astype(int))
