"""Frameworks whose own code allocates the model's state: Megatron-Core and vLLM.

- Megatron-Core's DistributedDataParallel keeps parameters and gradients in contiguous buffers
  (``distributed/param_and_grad_buffer.py``, ``_ParamAndGradBuffer.__init__``): with the
  distributed optimizer it first allocates the parameter buffer (``param_data``, bf16), then the
  gradient buffer (``grad_data``, fp32 under ``grad_reduce_in_fp32``); without it, the gradient
  buffer alone. Both are ``torch.zeros`` calls of that one function, told apart by their order
  in the file: the earlier line is the parameters', the later the gradients'. Its optimizers'
  own code (``megatron/core/optimizer/``: the fp32 main parameters, Adam's moments through
  ``torch.optim``) is an optimizer's (:data:`.stacks._OPTIMIZER_PATHS`).
- vLLM creates its weights in its layers' ``create_weights`` and loads them in its model
  loader: ``parameter``. Its KV cache is found by the generic rule (a function named for it).
"""

from __future__ import annotations

import pandas as pd

from ...frames import SnapshotFrames

_MEGATRON_BUFFER = "megatron/core/distributed/param_and_grad_buffer.py"
_VLLM_WEIGHT_FILES = ("/vllm/model_executor/layers/", "/vllm/model_executor/model_loader/")
_VLLM_WEIGHT_NAMES = frozenset(
    {"create_weights", "weight_loader", "load_weights", "default_weight_loader", "load_model"}
)


def _frame_categories(frames: SnapshotFrames) -> pd.Series:
    """frame_id -> category for the frames these rules decide."""
    sf = frames.stack_frames
    fn = sf["filename"].astype(str).str.replace("\\", "/", regex=False)
    nm = sf["name"].astype(str)
    cat = pd.Series(None, index=sf["frame_id"].to_numpy(), dtype=object)
    buffer = (fn.str.endswith(_MEGATRON_BUFFER) & (nm == "__init__")).to_numpy()
    if buffer.any():
        lines = sf["line"].to_numpy()[buffer]
        first = lines.min()
        cat[buffer] = ["parameter" if line == first and len(set(lines)) > 1 else "gradient" for line in lines]
    vllm = pd.Series(False, index=sf.index)
    for part in _VLLM_WEIGHT_FILES:
        vllm |= fn.str.contains(part, regex=False)
    cat[(vllm & nm.isin(_VLLM_WEIGHT_NAMES)).to_numpy()] = "parameter"
    return cat.dropna()


def framework_stack_categories(frames: SnapshotFrames) -> pd.Series:
    """stack_id -> category, for stacks whose innermost decided frame is one of these rules'."""
    frame_cat = _frame_categories(frames)
    if frame_cat.empty or frames.stacks.empty:
        return pd.Series([], dtype=object)
    st = frames.stacks[frames.stacks["frame_id"].isin(frame_cat.index)].sort_values(["stack_id", "depth"])
    st = st.drop_duplicates("stack_id")
    return pd.Series(frame_cat.reindex(st["frame_id"]).to_numpy(), index=st["stack_id"].to_numpy(), dtype=object)


__all__ = ["framework_stack_categories"]
