"""What an allocation stack says: its category, and the thread it was recorded on.

Categories from the frames (Python-only and mixed C++ stacks both). The *innermost decisive
frame* of a stack decides: a frame deep in the stack (the caller) must not outvote the frames
below it (what the call did). Lightning's automatic optimization runs ``training_step`` inside
``optimizer.step(closure)``: the forward's allocations have ``torch.optim`` frames above them, and
are activations all the same.

- ``ddp_bucket``: allocated by DistributedDataParallel itself (its Python code is the innermost
  Python frame, or the C++ ``Reducer`` is on the stack);
- ``optimizer_state``: allocated by an optimizer's own code (``torch.optim``, bitsandbytes, apex,
  torchao, DeepSpeed's Adam/LAMB, transformers' Adafactor): state such as Adam's moments, and the
  step's temporaries. Code outside torch running inside the step (a closure) is not the
  optimizer's: what it allocates is decided by the frames below it;
- ``parameter``: allocated while building or moving the model (``Module._apply``/``to``/
  ``cuda``, ``nn.init``, modules' ``__init__``/``reset_parameters``, weight initialisation);
- ``gradient``: allocated by autograd's ``AccumulateGrad`` (only when it accumulates out of
  place; the usual gradient buffer is made by the backward op itself and is found by the
  lifetime rule in :mod:`.gradients`);
- ``kv_cache``: allocated by a KV cache: transformers' cache classes (``cache_utils.py``:
  ``DynamicCache.update``'s ``torch.cat``, ``StaticCache``'s preallocation), vLLM's cache engine,
  or a Python function whose name says it allocates one (``_allocate_kv_cache``);
- ``activation``: allocated inside a module's forward or by the autograd engine;
- ``other``: everything else, and C++ library caches such as cuBLAS workspaces (wherever they
  are on the stack).

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
# a torch.nn.Module's call: these functions of this file (plan/structure.py reads module calls too)
MODULE_PY = "torch/nn/modules/module.py"
MODULE_CALL_NAMES = frozenset({"_call_impl", "_wrapped_call_impl"})
_FORWARD_NAMES = {*MODULE_CALL_NAMES, "forward"}
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


# decisive frames, in the order that breaks a tie within one frame (earlier wins)
_FRAME_RULES = ("gradient", "kv_cache", "optimizer_state", "parameter", "activation")
# optimizers outside torch.optim whose own code allocates their state
_OPTIMIZER_PATHS = (
    "/torch/optim/",
    "/bitsandbytes/optim/",
    "/apex/optimizers/",
    "/torchao/optim/",
    "/deepspeed/ops/adam/",
    "/deepspeed/ops/lamb/",
    "/transformers/optimization.py",
    "/megatron/core/optimizer/",
)
# KV caches: transformers' cache classes (DynamicCache, StaticCache, ...), vLLM's cache engine
# and model runners' preallocation of the cache blocks
_KV_CACHE_PATHS = ("/transformers/cache_utils.py", "/vllm/worker/cache_engine.py")
# Python frames of generated code (torch.compile's graphs) belong to whatever called them
_GENERATED_PARTS = ("torchinductor", "/torch_compile_", "<eval_with_key")


def _frame_flags(rows: pd.DataFrame) -> pd.DataFrame:
    """For every stack row: which rule its frame is decisive for (one column per category of
    :data:`_FRAME_RULES`), whether it is a library cache or DDP's reducer (decisive wherever they
    are), and whether it is *foreign*: Python code outside torch and outside every optimizer."""
    fn, nm = rows["filename"].str.replace("\\", "/", regex=False), rows["name"]
    module_py = fn.str.endswith(MODULE_PY)
    cache = pd.Series(False, index=rows.index)
    for part in _CPP_CACHE_PARTS:
        cache |= nm.str.contains(part, regex=False)
    optim = pd.Series(False, index=rows.index)
    for path in _OPTIMIZER_PATHS:
        optim |= fn.str.contains(path, regex=False)
    python = _is_python(rows)
    kv = python & nm.str.contains("kv_cache", case=False, regex=False)  # vLLM's _allocate_kv_cache, ...
    for path in _KV_CACHE_PATHS:
        kv |= fn.str.contains(path, regex=False)
    generated = pd.Series(False, index=rows.index)
    for part in _GENERATED_PARTS:
        generated |= fn.str.contains(part, regex=False)
    # Python source, not CPython's own C files (a conda build records them with line numbers)
    source = fn.str.endswith(".py") | fn.str.startswith("<")
    optim |= _own_optimizer_step(rows, fn, source)
    return pd.DataFrame(
        {
            "gradient": nm.str.contains("AccumulateGrad|accumulate_grad", regex=True),
            "kv_cache": kv,
            "optimizer_state": optim,
            "parameter": (module_py & nm.isin(_MODULE_MOVE))
            | fn.str.endswith("torch/nn/parameter.py")
            | fn.str.endswith("torch/nn/init.py")
            | nm.isin(_PARAM_NAMES)
            | (fn.str.contains("/torch/nn/modules/", regex=False) & (nm == "__init__")),
            "activation": (module_py & nm.isin(_FORWARD_NAMES))
            | fn.str.contains("/torch/autograd/", regex=False)
            | nm.str.contains("autograd::Engine", regex=False),
            "cache": cache,
            "reducer": nm.str.contains("Reducer::", regex=False),
            "foreign": python & source & ~fn.str.contains("/torch/", regex=False) & ~optim & ~generated,
        }
    )


# decorators between torch's step wrapper and a subclass's step (``@torch.no_grad()``, dynamo's
# ``disable``): they pass the call through
_DECORATOR_FILES = (
    "torch/utils/_contextlib.py",
    "torch/autograd/grad_mode.py",
    "torch/_dynamo/eval_frame.py",
    "torch/_compile.py",
)


def _own_optimizer_step(rows: pd.DataFrame, fn: pd.Series, source: pd.Series) -> pd.Series:
    """Frames of an optimizer written by hand: a ``torch.optim.Optimizer`` subclass's own code,
    called straight from torch's step wrapper (``optimizer.py``'s ``wrapper``, which every
    subclass's ``step`` is wrapped in), through decorators at most (``_DECORATOR_FILES``). Its
    state, made in its first ``step()``, was ``other`` (course assignments' AdamW). A closure
    that an optimizer calls runs inside the optimizer's own ``step`` (``adamw.py``,
    ``lbfgs.py``), never straight from the wrapper."""
    py = rows[source & ~fn.str.contains("/torch/", regex=False)].index
    passing = pd.Series(False, index=rows.index)
    for part in _DECORATOR_FILES:
        passing |= fn.str.endswith(part)
    source = source & ~passing
    src = rows.loc[source, ["stack_id", "depth"]].assign(wrapper=fn[source].str.endswith("torch/optim/optimizer.py"))
    src = src.sort_values(["stack_id", "depth"])
    outer_is_wrapper = src.groupby("stack_id")["wrapper"].shift(-1, fill_value=False).astype(bool)
    hit = pd.Series(False, index=rows.index)
    hit[outer_is_wrapper.index[outer_is_wrapper.to_numpy()]] = True
    return hit & rows.index.isin(py)


def _innermost_decisive(rows: pd.DataFrame, flags: pd.DataFrame) -> pd.Series:
    """stack_id -> the category of its innermost decisive frame (stacks with none are left out).

    An optimizer's frames decide only for what the optimizer's own code allocated: when foreign
    code (a closure: Lightning's ``training_step``, LBFGS's loss closure) runs inside
    ``optimizer.step``, the frames below it say what it allocated, and if none is decisive it is
    no optimizer state (``lightning_fit_step3``: the forward and the loss inside the closure were
    called optimizer state by "any torch.optim frame wins")."""
    depth = rows["depth"].to_numpy(dtype=np.int64)
    sid = rows["stack_id"].to_numpy(dtype=np.int64)
    foreign_depth = pd.Series(np.where(flags["foreign"], depth, np.iinfo(np.int64).max)).groupby(sid).min()
    closure_outside = flags["optimizer_state"].to_numpy() & (depth > foreign_depth.reindex(sid).to_numpy())
    code = np.full(len(rows), -1, dtype=np.int64)
    for k, rule in reversed(list(enumerate(_FRAME_RULES))):  # earlier rules win a tie
        code[flags[rule].to_numpy()] = k
    code[closure_outside & (code == _FRAME_RULES.index("optimizer_state"))] = -1
    decided = pd.DataFrame({"stack_id": sid, "depth": depth, "code": code})
    decided = decided[decided["code"] >= 0].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id")
    names = np.array(_FRAME_RULES, dtype=object)
    return pd.Series(names[decided["code"].to_numpy()], index=decided["stack_id"].to_numpy(), dtype=object)


def stack_categories(frames: SnapshotFrames) -> pd.Series:
    """Category of every stack_id from its frames: its innermost decisive frame's (see
    :func:`_innermost_decisive`); a library cache or DDP's own code anywhere on it wins."""
    if frames.stacks.empty:
        return pd.Series([], dtype=object)
    rows = _stack_rows(frames)
    flags = _frame_flags(rows)
    ids = pd.Index(rows["stack_id"].unique())
    cat = pd.Series("other", index=ids, dtype=object)
    decisive = _innermost_decisive(rows, flags)
    cat[decisive.index] = decisive.to_numpy()
    anywhere = flags[["cache", "reducer"]].groupby(rows["stack_id"].to_numpy()).any()
    # DDP: its own code is the innermost Python frame of the stack
    py_rows = rows[_is_python(rows)].sort_values(["stack_id", "depth"]).drop_duplicates("stack_id")
    ddp_inner = set(py_rows.loc[py_rows["filename"].str.endswith("torch/nn/parallel/distributed.py"), "stack_id"])
    cat[anywhere.index[anywhere["cache"].to_numpy()]] = "other"
    cat[anywhere.index[anywhere["reducer"].to_numpy() | anywhere.index.isin(list(ddp_inner))]] = "ddp_bucket"
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
    return stacks_where(frames, frames.stack_frames["name"].astype(str) == name)


# torch.compile's autotuning (inductor benchmarks each kernel's configurations on the first run of
# a compiled graph): its buffers, an L2-flushing buffer of fixed size and clones of the kernel's
# arguments freed after each try, are one-off work of compilation, not the step's
_AUTOTUNE_FILES = (
    "torch/_inductor/runtime/benchmarking.py",
    "torch/_inductor/select_algorithm.py",
    "torch/_inductor/autotune_process.py",
)


# a compiled graph runs from these: inductor's compiled module, AOT autograd's runtime wrappers
_COMPILED_GRAPH_FILES = ("torch/_inductor/output_code.py", "torch/_functorch/_aot_autograd/runtime_wrappers.py")


def stack_filenames(frames: SnapshotFrames) -> pd.Series:
    """Every stack frame's file, with ``/`` separators (aligned with ``frames.stack_frames``)."""
    return frames.stack_frames["filename"].astype(str).str.replace("\\", "/", regex=False)


def stacks_where(frames: SnapshotFrames, hit: pd.Series) -> set[int]:
    """stack_ids with a frame where ``hit`` (a mask aligned with ``frames.stack_frames``) holds."""
    if frames.stacks.empty:
        return set()
    fids = frames.stack_frames.loc[hit, "frame_id"]
    return set(frames.stacks.loc[frames.stacks["frame_id"].isin(fids), "stack_id"].astype(int))


def module_call_stacks(frames: SnapshotFrames) -> set[int]:
    """stack_ids made inside a torch.nn.Module's call (a frame of ``module.py``'s ``_call_impl``)."""
    if frames.stacks.empty:
        return set()
    files, names = stack_filenames(frames), frames.stack_frames["name"].astype(str)
    return stacks_where(frames, files.str.endswith(MODULE_PY) & names.isin(MODULE_CALL_NAMES))


def stacks_with_file(frames: SnapshotFrames, names: tuple[str, ...]) -> set[int]:
    """stack_ids with a frame in a file whose path ends with one of ``names``."""
    if frames.stacks.empty:
        return set()
    files = stack_filenames(frames)
    hit = pd.Series(False, index=files.index)
    for name in names:
        hit |= files.str.endswith(name)
    return stacks_where(frames, hit)


def autotune_stacks(frames: SnapshotFrames) -> set[int]:
    """stack_ids with a frame of inductor's autotuning (``_AUTOTUNE_FILES``)."""
    return stacks_with_file(frames, _AUTOTUNE_FILES)


def one_off_stacks(frames: SnapshotFrames) -> set[int]:
    """stack_ids of memory no batch changes: library caches kept for the process's life
    (:func:`cache_stacks`) and torch.compile's autotuning (:func:`autotune_stacks`)."""
    return cache_stacks(frames) | autotune_stacks(frames)


def compiled_graph_stacks(frames: SnapshotFrames) -> set[int]:
    """stack_ids of a ``torch.compile`` graph at run time: its tensors are made by generated
    kernels, whose frames name no layer of the model."""
    return stacks_with_file(frames, _COMPILED_GRAPH_FILES)


def cache_stacks(frames: SnapshotFrames) -> set[int]:
    """stack_ids of C++ library caches (cuBLAS workspaces): held for the process's life."""
    if frames.stacks.empty:
        return set()
    nm = frames.stack_frames["name"].astype(str)
    hit = pd.Series(False, index=nm.index)
    for part in _CPP_CACHE_PARTS:
        hit |= nm.str.contains(part, regex=False)
    return stacks_where(frames, hit)
