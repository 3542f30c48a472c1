"""What the trace recorded, before ``snaplab fit`` models anything (issue #20).

``fit`` models one training step; a trace is not always one. From the trace alone:

- a *training step*: a forward, its backward and an optimizer step (optimizer state made);
- a *forward and backward* without an optimizer step: a backward was recorded (allocations on
  autograd's backward thread after a forward) but no optimizer state was ever made (a benchmark
  of forward+backward, or an optimizer that keeps no state, such as plain SGD);
- *forward passes only* (inference): allocations inside a module's forward, none on autograd's
  backward thread, and no optimizer state or gradients older than the trace (those would say
  that a training job was recorded mid-step);
- an *out-of-memory error in the first forward* of a job: the trace holds an ``oom`` action
  during the first forward call it shows and no backward: the rest of the step is extrapolated
  (:mod:`.extrapolate`);
- *too little*: no forward at all, or forwards of a training job whose backward and optimizer
  step the trace does not hold, without an out-of-memory error to extrapolate from, or a pass
  whose backward ran out of memory before any optimizer step.

A *forward call* is a run of the program thread's allocations inside modules, between
allocations outside any module (the inputs of the next call, the program's own arithmetic),
whose outermost module is the one the last run called: repeated calls of the model (a
generation's prefill and tokens, an inference loop's batches) count once each; a submodule the
program calls on its own before the model (ViT's patch embedding) does not.

For forward passes only, the recorded forwards are the job: inputs, activations and the KV cache
scale with the batch; parameters, what was made while the model was built, and library
workspaces do not; there are no gradients and no optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ...frames import SnapshotFrames
from .._memo import memo
from ..categories import CODES
from ..categories.stacks import one_off_stacks
from ..plan.structure import TrainingStructure, stack_info
from .evidence import (
    KV_CACHE,
    MODEL_STATE_CODES,
    StepEvidence,
    after_the_model,
    allocation_codes,
    forward_weight_copies,
    kv_cache_stacks,
)
from .tape import NEVER, Tape, make_tape

TRAINING_STEP = "training step"
FORWARD_BACKWARD = "forward and backward"
FORWARD_ONLY = "forward passes only"
OOM_IN_FORWARD = "out of memory in the first forward"
TOO_LITTLE = "too little to model"
KINDS = (TRAINING_STEP, FORWARD_BACKWARD, FORWARD_ONLY, OOM_IN_FORWARD, TOO_LITTLE)

NO_OPTIMIZER = "none"
NO_OPTIMIZER_SOURCE = "no optimizer step in the trace: no optimizer state made; give optimizer to add one"
INFERENCE_OPTIMIZER_SOURCE = "not applicable: no backward in the trace"

# notes (one sentence each, as ``fit`` lists them)
FORWARD_BACKWARD_NOTE = (
    "no optimizer step in the trace: {passes} forward and backward pass(es) ({blocks} repeated blocks) and no "
    "optimizer state made (none ran, or one that keeps no state, such as plain SGD): the recorded pass is the step"
)
NO_OPTIMIZER_STATE = ", with optimizer state 0"
GIVEN_OPTIMIZER_NOTE = (
    "optimizer {name} (given): its state ({ratio:g}x the parameters) is added to the recorded pass, alive from the "
    "start as in every step after the first"
)
FORWARD_ONLY_NOTE = (
    "inference / forward passes only: {forwards} forward call(s), no backward (no allocation on autograd's backward "
    "thread, no gradients) and no optimizer step; the recorded forwards are the job: inputs, activations and the KV "
    "cache scale with the batch, parameters, what the model's construction made and library workspaces do not; no "
    "gradients, no optimizer state"
)
FORWARD_ONLY_LEVERS_NOTE = (
    "not applicable without a training step, so left out: activation checkpointing (the forward saves nothing for a "
    "backward that never runs), optimizer choice and optimizer offload (there is no optimizer state); bf16 autocast "
    "and the batch remain"
)
FORWARD_ONLY_HALF_LEVERS_NOTE = FORWARD_ONLY_LEVERS_NOTE.replace("; bf16 autocast and the batch remain", "")
FORWARD_ONLY_OOM_NOTE = (
    "the trace ends in an out-of-memory error after {forwards} forward call(s) (a request of {request:,} bytes that "
    "could not be served): the request is kept in the job, as the next allocation it needed"
)
OPTIMIZER_IGNORED_NOTE = "optimizer {name} (given): not applicable, the trace has no backward and no optimizer step"

# what the levers left assume when the recorded forwards are the job
FORWARD_ONLY_ASSUMPTIONS = {
    "as recorded": "the recorded forwards as the job, only the batch changed: inputs, activations and the KV cache "
    "scale with it, parameters, what the model's construction made and workspaces do not; no gradients, no optimizer "
    "state",
    "bf16": "torch.autocast(dtype=torch.bfloat16) over the forwards, float32 parameters: what matrix multiplies "
    "(Linear, convolution, attention) and the modules after them make halves, and so does the KV cache they fill; "
    "softmax, norms and the model's own arithmetic stay float32; inputs stay",
}

NO_CHECKPOINTING = (
    "checkpointing is not applicable to forward passes only: the trace has no backward, for which a forward would "
    "save activations"
)
# refusals (the trace shows too little), never claiming an out-of-memory error the trace does not hold
NO_FORWARD = (
    "the trace shows no forward pass (no allocation inside a torch.nn.Module's forward) and no out-of-memory error: "
    "nothing to model a step or an inference from (record the job's forward, backward and optimizer step)"
)
NO_FORWARD_OOM = (
    "the trace ran out of memory outside any module's forward (no allocation inside a torch.nn.Module's forward): "
    "nothing to model a step from (record the job's forward, backward and optimizer step)"
)
STATE_WORDS = {"gradient": "gradients", "optimizer_state": "optimizer state"}
OOM_IN_BACKWARD = (
    "the trace ran out of memory in a backward before any optimizer step: the recorded pass is cut short, and fit "
    "extrapolates a step only from a forward (record at a smaller batch, or under a larger limit, so that one whole "
    "step completes)"
)
MID_STEP = (
    "forward passes only, no out-of-memory error: {forwards} forward call(s) and no backward, but {state} older than "
    "the trace show a training job recorded in the middle of a step, whose backward and optimizer step the trace "
    "does not hold: record a whole step (from before a forward to after optimizer.step())"
)


@dataclass(frozen=True)
class Workload:
    """What the trace recorded on one device."""

    kind: str  # one of KINDS
    forwards: int  # forward calls (see the module's docstring)
    backwards: int  # passes whose backward was recorded
    optimizer_steps: int
    oom_request: int | None  # bytes of the request the trace ends in an out-of-memory error for (None: none)
    older_training_state: tuple[str, ...]  # categories older than the trace that only training makes
    refusal: str | None = None  # why ``fit`` cannot answer (kind TOO_LITTLE)


def workload(frames: SnapshotFrames, s: TrainingStructure) -> Workload:
    """What the trace of ``s``'s device recorded (computed once per snapshot and device)."""
    return memo(frames, ("fit.workload", s.device), lambda: _classify(frames, s))


def forward_calls(frames: SnapshotFrames, s: TrainingStructure) -> np.ndarray:
    """Positions where each forward call begins (see the module's docstring)."""
    a = s.allocs
    main = np.flatnonzero(a["main"].to_numpy())
    inside = a["module"].to_numpy()[main]
    starts = main[inside & ~np.r_[False, inside[:-1]]]
    if starts.size == 0:
        return starts
    callee = stack_info(frames).callee
    called = np.array([(callee.get(int(x)) or ("",))[0] for x in a["sid"].to_numpy()[starts]], dtype=object)
    return a["pos"].to_numpy()[starts[called == called[-1]]]


def _classify(frames: SnapshotFrames, s: TrainingStructure) -> Workload:
    calls = forward_calls(frames, s)
    state = tuple(sorted({c for _, c, _ in s.untracked if c in ("gradient", "optimizer_state")}))
    oom = s.ooms[-1] if s.ooms else None
    seen = Workload(TOO_LITTLE, int(calls.size), len(s.passes), len(s.steps), None if oom is None else oom[1], state)
    if s.passes and not s.steps and oom is not None and oom[0] >= s.passes[-1].backward_start:
        return replace(seen, refusal=OOM_IN_BACKWARD)  # the pass was cut short: it is no step to build on
    if s.passes:
        return replace(seen, kind=TRAINING_STEP if s.steps else FORWARD_BACKWARD)
    if calls.size == 0:
        return replace(seen, refusal=NO_FORWARD_OOM if oom else NO_FORWARD)
    if oom is not None and oom[0] > calls[0] and int((calls < oom[0]).sum()) == 1:
        return replace(seen, kind=OOM_IN_FORWARD)
    if state:
        words = " and ".join(STATE_WORDS[c] for c in state)
        return replace(seen, refusal=MID_STEP.format(forwards=calls.size, state=words))
    return replace(seen, kind=FORWARD_ONLY)


def step_notes(work: Workload, n_blocks: int, name: str, given: str | None, state_ratio: float) -> tuple[str, ...]:
    """What ``fit`` says of a recorded pass that is not a whole training step (empty: it is one)."""
    if work.kind != FORWARD_BACKWARD:
        return ()
    head = FORWARD_BACKWARD_NOTE.format(passes=work.backwards, blocks=n_blocks)
    if given is not None and state_ratio > 0:
        return (head, GIVEN_OPTIMIZER_NOTE.format(name=name, ratio=state_ratio))
    return (head + NO_OPTIMIZER_STATE,)


def step_optimizer(work: Workload, name: str, source: str, given: str | None) -> tuple[str, str]:
    """The optimizer of the step: none for a forward and backward without one, unless given."""
    if work.kind == FORWARD_BACKWARD and given is None:
        return NO_OPTIMIZER, NO_OPTIMIZER_SOURCE
    return name, source


def with_given_optimizer(tape: Tape, work: Workload, s: TrainingStructure, name: str, state_ratio: float) -> Tape:
    """A forward and backward with an optimizer given: its state added, alive from the start,
    per parameter (``state_ratio`` tensors its size, or one ``state_ratio`` times it)."""
    if work.kind != FORWARD_BACKWARD or name == NO_OPTIMIZER or state_ratio <= 0:
        return tape
    sizes = np.r_[s.params["size"].to_numpy(dtype=np.float64), [n for n, c, _ in s.untracked if c == "parameter"]]
    whole = float(state_ratio).is_integer()
    state = np.repeat(sizes, int(state_ratio)) if whole else sizes * state_ratio
    start, end = np.full(state.size, -1.0), np.full(state.size, NEVER)
    return tape.with_rows(make_tape(start, end, state, np.zeros(state.size), "optimizer_state", 0, "setup"))


def forward_only_evidence(
    frames: SnapshotFrames, s: TrainingStructure, work: Workload, parameter_bytes: int, given: str | None
) -> StepEvidence:
    """The recorded forwards as the job: no blocks to checkpoint, no passes, no optimizer."""
    notes = [FORWARD_ONLY_NOTE.format(forwards=work.forwards), FORWARD_ONLY_LEVERS_NOTE]
    if work.oom_request is not None:
        notes.append(FORWARD_ONLY_OOM_NOTE.format(forwards=work.forwards, request=work.oom_request))
    if given is not None:
        notes.append(OPTIMIZER_IGNORED_NOTE.format(name=given))
    tape = forward_only_tape(frames, s, work)
    return StepEvidence(
        tape, True, parameter_bytes, NO_OPTIMIZER, INFERENCE_OPTIMIZER_SOURCE, 0, 0, (), (), tuple(notes)
    )


def forward_only_tape(frames: SnapshotFrames, s: TrainingStructure, work: Workload) -> Tape:
    """Every allocation of the trace; what the forwards make (and their inputs) scales with the
    batch, the model's construction and library caches do not; memory older than the trace is
    alive from the start; an out-of-memory request at the end is kept as made."""
    a = s.allocs
    code, pos, sid = a["code"].to_numpy(), a["pos"].to_numpy(), a["sid"].to_numpy()
    size = a["size"].to_numpy(dtype=np.float64)
    is_param = code == CODES["parameter"]
    scales = after_the_model(a) & ~np.isin(code, MODEL_STATE_CODES) & ~np.isin(sid, list(one_off_stacks(frames)))
    first_forward = forward_calls(frames, s)[0] if work.forwards else 0
    scales &= ~forward_weight_copies(frames, s)  # autocast's copies of the weights: their size whatever the batch
    kv = np.isin(sid, list(kv_cache_stacks(frames))) | (code == CODES.get(KV_CACHE, -1))
    made = np.where(kv, KV_CACHE, np.where(pos < first_forward, "input", "activation"))
    category = np.where(is_param, "parameter", np.where(scales, made, "workspace")).astype(object)
    autocast = allocation_codes(frames, s)
    free_pos = a["free_pos"].to_numpy()
    tape = make_tape(
        pos.astype(np.float64),
        np.where(free_pos >= 0, free_pos.astype(np.float64), NEVER),
        np.where(scales, 0.0, size),
        np.where(scales, size, 0.0),
        category,
        a["stream"].to_numpy(dtype=np.int64),
        np.where(scales, np.where(pos < first_forward, "data", "forward"), "setup").astype(object),
        -1,
        autocast,
    )
    return _older(s).with_rows(tape, *_failed_request(s, work))


def _older(s: TrainingStructure) -> Tape:
    """Memory older than the trace, alive from the start, whatever the batch."""
    old = s.untracked
    return make_tape(
        np.full(len(old), -1.0),
        np.full(len(old), NEVER),
        np.array([n for n, _, _ in old], dtype=np.float64),
        np.zeros(len(old)),
        np.array(["parameter" if c == "parameter" else "workspace" for _, c, _ in old], dtype=object),
        np.array([st for _, _, st in old], dtype=np.int64),
        "setup",
    )


def _failed_request(s: TrainingStructure, work: Workload) -> tuple[Tape, ...]:
    if work.oom_request is None or not s.ooms:
        return ()
    at, request, stream = s.ooms[-1]
    row = make_tape(
        np.array([float(at)]), np.array([NEVER]), np.zeros(1), np.array([float(request)]), "activation", stream
    )
    return (row,)


def is_forward_only(ev: StepEvidence) -> bool:
    """The evidence is the recorded forwards (no pass, no optimizer): see :func:`forward_only_evidence`."""
    return ev.optimizer == NO_OPTIMIZER and not ev.passes


def assumption(ev: StepEvidence, lever: str, default: str) -> str:
    """What ``lever`` assumes of this evidence (``default``: of a training step)."""
    return FORWARD_ONLY_ASSUMPTIONS.get(lever, default) if is_forward_only(ev) else default
