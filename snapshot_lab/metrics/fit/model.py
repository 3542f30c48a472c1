"""The step's evidence, from a trace with a whole step or from one that ran out of memory in
its first forward."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...frames import SnapshotFrames
from .._memo import memo
from ..categories.stacks import compiled_graph_stacks
from ..plan.structure import TrainingStructure, training_structure
from . import workload as wl
from .evidence import (
    KV_CACHE,
    MODEL_STATE_CODES,
    StepEvidence,
    after_the_model,
    block_spans,
    checkpointing_in_stacks,
    forward_weight_copies,
    hf_trainer_in_stacks,
    optimizer_in_stacks,
    param_facts,
    recorded_tape,
    transformers_token_model,
)
from .extrapolate import Extrapolated, FitUnsupportedStep, extrapolate_step
from .frozen import FROZEN_JOIN_NOTE, FROZEN_NOTE
from .levers import OPTIMIZER_STATE_RATIO, STEP_TEMPORARY_RATIO
from .precision import half_precision_parameters
from .search import PeakCurve
from .steady import ends_after_a_step, steady_step

ASSUMED_OPTIMIZER = "adamw"
OPTIMIZER_NAMED = "named in the stacks"
OPTIMIZER_GIVEN = "given"
OPTIMIZER_ASSUMED = "assumed: the step never ran and the stacks name no optimizer; give optimizer to change it"
# transformers' Trainer makes its optimizer after the first forward; its default is torch's AdamW
# with fused=True: two states per parameter and no temporaries of the parameters' size in its step
TRAINER_OPTIMIZER = "adamw-fused"
OPTIMIZER_TRAINER = (
    "assumed: the step never ran and the stacks show transformers' Trainer, whose default optimizer is AdamW with "
    "fused=True (two states per parameter, no step temporaries); give optimizer to change it"
)


CHECKPOINTED_NOTE = (
    "the recorded step checkpoints its activations already (a checkpointing function on the stacks): activation "
    "checkpointing left out, it is what was recorded"
)
NO_CHECKPOINTING_AGAIN = (
    "checkpointing is not applicable: the recorded step checkpoints its activations already (a checkpointing "
    "function on the stacks)"
)


COMPILED_NOTE = (
    "the step runs a torch.compile graph (most of its forward's tensors are made by generated kernels, whose "
    "stacks name no layer): activation checkpointing and bf16 autocast are not modelled from it; record the model "
    "without torch.compile to compare them, or compile with them and record again"
)
NO_LEVER_COMPILED = (
    "checkpointing and bf16 are not modelled for a torch.compile graph: its tensors are made by generated kernels, "
    "whose stacks name no layer (record the model without torch.compile to compare them)"
)


class FitUnsupported(ValueError):
    """The trace shows no training step to build on."""


class FitUnsupportedOom(FitUnsupported):
    """The trace ran out of memory in its first forward, but the rest of the step cannot be
    extrapolated from what it shows (the report says why, beside its other advice)."""


def _extrapolated(frames: SnapshotFrames, s: TrainingStructure, name: str) -> Extrapolated | None:
    try:
        return extrapolate_step(frames, s, OPTIMIZER_STATE_RATIO.get(name, 2.0), STEP_TEMPORARY_RATIO.get(name, 0.0))
    except FitUnsupportedStep as exc:
        raise FitUnsupportedOom(str(exc)) from None


def step_evidence(frames: SnapshotFrames, device: int, optimizer: str | None = None) -> StepEvidence:
    """What the trace shows of one training step on ``device`` (computed once per optimizer)."""
    return memo(frames, ("fit.evidence", device, optimizer), lambda: _with_precision(frames, device, optimizer))


def compiled_forward(frames: SnapshotFrames, device: int) -> bool:
    """Whether most of what the program's thread made after the model was built, model state
    aside (the forwards' tensors, by bytes), came from a ``torch.compile`` graph
    (``categories.stacks.compiled_graph_stacks``)."""
    a = training_structure(frames, device).allocs
    made = after_the_model(a) & a["main"].to_numpy() & ~np.isin(a["code"].to_numpy(), MODEL_STATE_CODES)
    size = a["size"].to_numpy()
    compiled = np.isin(a["sid"].to_numpy(), list(compiled_graph_stacks(frames)))
    return 2 * int(size[made & compiled].sum()) > int(size[made].sum())


def _with_precision(frames: SnapshotFrames, device: int, optimizer: str | None) -> StepEvidence:
    """The evidence, with what the recorded step does already: half precision, checkpointing,
    and whether it runs a compiled graph."""
    ev = _evidence(frames, device, optimizer)
    if ev.passes and checkpointing_in_stacks(frames):
        ev = replace(ev, checkpointed=True, notes=(*ev.notes, CHECKPOINTED_NOTE))
    if compiled_forward(frames, device):
        ev = replace(ev, compiled=True, notes=(*ev.notes, COMPILED_NOTE))
    if any(not b.saves for b in ev.blocks) and transformers_token_model(frames):
        ev = replace(ev, frozen_join_when_checkpointed=True, notes=(*ev.notes, FROZEN_JOIN_NOTE))
    copies = int(forward_weight_copies(frames, training_structure(frames, device)).sum())
    half, note = half_precision_parameters(frames, ev.tape, ev.blocks, copies)
    if not half:
        return ev
    notes = tuple(wl.FORWARD_ONLY_HALF_LEVERS_NOTE if n == wl.FORWARD_ONLY_LEVERS_NOTE else n for n in ev.notes)
    return replace(ev, half_precision=True, notes=(*notes, note))


def _optimizer(frames: SnapshotFrames, given: str | None) -> tuple[str, str]:
    if given is not None:
        return given, OPTIMIZER_GIVEN
    named = optimizer_in_stacks(frames)
    if named is not None:
        return named, OPTIMIZER_NAMED
    if hf_trainer_in_stacks(frames):
        return TRAINER_OPTIMIZER, OPTIMIZER_TRAINER
    return ASSUMED_OPTIMIZER, OPTIMIZER_ASSUMED


def _evidence(frames: SnapshotFrames, device: int, optimizer: str | None) -> StepEvidence:
    s = training_structure(frames, device)
    if frames.stacks.empty:
        raise FitUnsupported("the trace has no stacks: record with stacks='python' (or snaplab run)")
    name, source = _optimizer(frames, optimizer)
    params, castable = param_facts(frames, s)
    work = wl.workload(frames, s)  # what the trace recorded: a step, forward+backward, inference, an OOM...
    if work.refusal:
        raise FitUnsupported(work.refusal)
    if work.kind == wl.FORWARD_ONLY:
        return wl.forward_only_evidence(frames, s, work, params, optimizer)
    name, source = wl.step_optimizer(work, name, source, optimizer)
    complete = work.kind in (wl.TRAINING_STEP, wl.FORWARD_BACKWARD)
    if complete:
        uid, blocks, passes = block_spans(frames, s, castable)
        ratio = OPTIMIZER_STATE_RATIO.get(name, 0.0)
        tape = wl.with_given_optimizer(recorded_tape(frames, s, True, uid), work, s, name, ratio)
        steady = ""
        if work.kind == wl.TRAINING_STEP and ends_after_a_step(s):  # out in a later step: the step it ran
            tape, blocks, passes, steady = steady_step(tape, blocks, passes, s)
        state = int(tape.fixed[(tape.category == "optimizer_state") & ~np.isfinite(tape.end)].sum())
        n_blocks = len(blocks) // max(len(passes), 1)
        notes = list(wl.step_notes(work, n_blocks, name, optimizer, ratio)) or [
            f"a whole step was recorded ({len(s.passes)} iterations, {n_blocks} repeated blocks)"
        ]
        notes += [steady] if steady else []
        frozen = next((b.index for b in blocks if b.saves), 0)  # the first pass's frozen first blocks
        notes += [FROZEN_NOTE.format(k=frozen, n=n_blocks)] if frozen else []
        return StepEvidence(tape, True, params, name, source, state, n_blocks, blocks, passes, tuple(notes))
    ex = _extrapolated(frames, s, name)
    if ex is None:
        raise FitUnsupported("the trace shows no forward pass (no allocation inside a module's forward)")
    if ex.forward_only:  # inference: as wl.forward_only_evidence, from the forward extrapolated
        said = (*ex.notes, wl.FORWARD_ONLY_LEVERS_NOTE)
        return StepEvidence(ex.tape, False, params, wl.NO_OPTIMIZER, wl.INFERENCE_OPTIMIZER_SOURCE, 0, 0, (), (), said)
    return StepEvidence(ex.tape, False, params, name, source, 0, len(ex.blocks), ex.blocks, ex.passes, ex.notes)


def recorded_batch_bytes(ev: StepEvidence) -> dict[str, int]:
    """The breakdown: model state; the activations at their own peak (the most of what grows with
    the batch alive at once: saved for the backward and the backward's own, at the recorded
    batch; where the optimizer step makes the peak, as in an MLP's whose state outweighs its
    activations, what the batch adds to the peak is nothing, and the activations are not);
    workspaces; the KV cache alive at the peak (part of the activations)."""
    tape = ev.tape
    kept = ~np.isfinite(tape.end)
    by = {c: int(tape.fixed[(tape.category == c) & kept].sum()) for c in ("parameter", "optimizer_state")}
    by["parameter"] = max(by["parameter"], ev.parameter_bytes)
    by["gradient"] = ev.parameter_bytes if ev.passes else 0  # no passes: forwards only, no gradients
    for p in ev.passes[:1]:
        made = (tape.category == "gradient") & (tape.start >= p.forward_start) & (tape.start <= p.backward_end)
        by["gradient"] = int(tape.fixed[made].sum()) or ev.parameter_bytes
    curve = PeakCurve(tape)
    by["activations"] = curve.batch_part_peak()
    by["workspaces"] = int(tape.fixed[(tape.category == "workspace") & kept].sum())
    by["kv_cache"] = curve.alive_at_peak(1.0, tape.category == KV_CACHE)
    return by
