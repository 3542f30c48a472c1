"""How much memory per GPU would the recorded job need under another parallel layout (issue #15)?

From one snapshot of the job on one GPU (or one rank of a DDP run) whose trace covers at least
one whole iteration, the recorded run is replayed with every allocation rescaled by what it is
and by the strategy, and through the model of the caching allocator, so the predicted peak is
reached at the moment it would be, in allocated and in reserved bytes:

- :mod:`.structure`: what the trace shows of the program (iterations, forward and backward, the
  repeated blocks, which parameter belongs to which block);
- :mod:`.rewrite` and :mod:`.program`: the rewritten program, its replay, what its peak is made of;
- :mod:`.data_parallel` (DDP, ZeRO-1, FSDP2, FSDP1), :mod:`.tensor_parallel`, :mod:`.pipeline`:
  one module per strategy family;
- :mod:`.planner`: the strategies, one plan, a table of the usual choices.
- :mod:`.messages`: everything a plan says in words (notes, reasons, rules), to read as text.
"""

from .planner import (
    NOT_MODELLED,
    STRATEGIES,
    MemoryPlan,
    PlanTable,
    PlanUnsupported,
    RankPlan,
    Strategy,
    plan_memory,
    plan_table,
    usual_strategies,
    would_it_fit,
)
from .program import PeakPart
from .structure import TrainingStructure, training_structure

__all__ = [
    "NOT_MODELLED",
    "STRATEGIES",
    "MemoryPlan",
    "PeakPart",
    "PlanTable",
    "PlanUnsupported",
    "RankPlan",
    "Strategy",
    "TrainingStructure",
    "plan_memory",
    "plan_table",
    "training_structure",
    "usual_strategies",
    "would_it_fit",
]
