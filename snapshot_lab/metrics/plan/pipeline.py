"""Pipeline parallelism (``torch.distributed.pipelining``): each stage holds some blocks (the
first also the embeddings, the last the final norm, head and loss), and runs the recorded
forward and backward of its own layers once per microbatch, in the schedule's order.

- Stages: the blocks divided evenly, the remainder to the last stage (``split`` overrides:
  blocks per stage); parameters, gradients and optimizer state of the stage's layers only.
- Microbatches: every activation of the recorded forward and backward is the recorded batch's,
  so one microbatch's is 1/m of it (sizes proportional to the batch). A stage replays its part
  of the recorded forward for microbatch i (F_i) and of the recorded backward (B_i), which frees
  what F_i saved. GPipe runs every F, then every B; 1F1B runs ``stages - stage`` forwards, then
  alternates one backward and one forward, then the remaining backwards, so stage s holds at
  most ``stages - s`` microbatches' activations.
- Gradients are allocated by the first microbatch's backward; later microbatches' weight
  gradients are temporaries accumulated into them.
- The last stage keeps every microbatch's output until the step ends (the schedule merges them).
- Receive buffers: one per microbatch for the activations coming in (every stage but the first)
  and one per microbatch for the gradients coming back (every stage but the last), each the size
  of one microbatch of the tensor that crosses the stage boundary, allocated at the first step
  and kept.
- Allocations outside the forward and backward (inputs, the optimizer step) are made once, as
  recorded; allocations made inside them and never freed (caches, workspaces) once, unscaled.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..categories import CATEGORIES, CODES
from .messages import (
    RULE_FIRST_GRADIENTS,
    RULE_LATER_GRADIENTS,
    RULE_MERGED_OUTPUTS,
    RULE_MODEL_OUTPUT,
    RULE_ONE_MICROBATCH,
    RULE_RECV_ACTIVATIONS,
    RULE_RECV_GRADIENTS,
    RULE_SAVED_ACTIVATIONS,
    RULE_STAGE_OUTPUT,
)
from .program import MB_KEY, Program
from .rewrite import recorded_rule
from .structure import Pass, TrainingStructure

SCHEDULES = ("1f1b", "gpipe")
PASS_PHASES = ["forward", "backward"]
# split between the stages
MODEL_STATE = ("parameter", "gradient", "optimizer_state")

# Program keys of what is not a recorded allocation (those are keyed by their row, >= 0, and
# their microbatch copies by microbatch_key): negative, one range per kind
RECV_BUFFER_KEYS = 10  # the stage's receive buffer i: -(RECV_BUFFER_KEYS + i)
# the merged microbatch outputs of pass p: -(MERGED_OUTPUT_KEYS + p)
MERGED_OUTPUT_KEYS = 1000
# memory older than the trace, entry i: -(UNTRACKED_KEYS + i)
UNTRACKED_KEYS = 100_000


def schedule_ops(
    schedule: str,
    stage: int,
    stages: int,
    microbatches: int,
) -> list[tuple[str, int]]:
    """The order of forwards and backwards one stage runs (torch's ScheduleGPipe and
    Schedule1F1B)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    warmup = min(microbatches, stages - stage)
    ops = [("F", i) for i in range(warmup)]
    next_forward, next_backward = warmup, 0
    while True:
        ops.append(("B", next_backward))
        next_backward += 1
        if next_forward == microbatches:
            break
        ops.append(("F", next_forward))
        next_forward += 1
    ops += [("B", i) for i in range(next_backward, microbatches)]
    return ops


def stage_blocks(n_blocks: int, stages: int, split: tuple[int, ...] | None = None) -> list[int]:
    """Stage of every block."""
    if split:
        counts = list(split)
    else:
        per_stage = n_blocks // stages
        counts = [per_stage] * (stages - 1) + [n_blocks - per_stage * (stages - 1)]
    out: list[int] = []
    for stage, count in enumerate(counts):
        out += [stage] * count
    return out


@dataclass(frozen=True)
class StageAssignment:
    block_stage: tuple[int, ...]
    # per recorded allocation: its stage, -1: every stage (inputs, setup)
    row_stage: np.ndarray
    # per stage boundary s|s+1: recorded bytes of the tensor that crosses it
    boundary_bytes: tuple[int, ...]


def assign_stages(
    structure: TrainingStructure,
    stages: int,
    split: tuple[int, ...] | None,
) -> StageAssignment:
    """Which stage holds each block and each recorded allocation, and what crosses the stage
    boundaries."""
    allocs = structure.allocs
    block_stage = stage_blocks(structure.n_blocks, stages, split)
    last = stages - 1
    part = allocs["part"].to_numpy()
    block = allocs["block"].to_numpy()
    code = allocs["code"].to_numpy()
    param = allocs["param"].to_numpy()
    row_stage = np.full(len(allocs), -1, dtype=np.int64)
    in_pass = np.isin(allocs["phase"].to_numpy(), PASS_PHASES)
    row_stage[in_pass & (part == "pre")] = 0
    row_stage[in_pass & (part == "post")] = last
    for j, stage in enumerate(block_stage):
        row_stage[in_pass & (part == "block") & (block == j)] = stage
    param_block = structure.params["block"].to_numpy()
    param_part = structure.params["part"].to_numpy()
    block_stage_or_first = np.array([*block_stage, 0])[np.clip(param_block, 0, len(block_stage))]
    param_stage = np.where(param_block >= 0, block_stage_or_first, 0)
    param_stage = np.where((param_block < 0) & (param_part == "post"), last, param_stage)
    mirrors = np.isin(code, [CODES[name] for name in MODEL_STATE]) & (param >= 0)
    row_stage[mirrors] = param_stage[param[mirrors]]
    # kept for the whole run from inside a pass (a library's cache or workspace): every process
    # has one
    never_freed = allocs["free_pos"].to_numpy() < 0
    kept = in_pass & never_freed & ~np.isin(code, [CODES["gradient"], CODES["parameter"]])
    row_stage[kept] = -1
    boundaries = _boundary_bytes(structure, block_stage, stages)
    return StageAssignment(tuple(block_stage), row_stage, boundaries)


def _boundary_bytes(
    structure: TrainingStructure,
    block_stage: list[int],
    stages: int,
) -> tuple[int, ...]:
    """Per boundary s|s+1, the recorded bytes of the tensor crossing it: the output of stage s's
    last block (first pass)."""
    allocs = structure.allocs
    first_pass = structure.passes[0] if structure.passes else None
    positions = allocs["pos"].to_numpy()
    sizes = allocs["size"].to_numpy()
    out = []
    for stage in range(stages - 1):
        blocks = [j for j, holder in enumerate(block_stage) if holder == stage]
        nbytes = 0
        if first_pass is not None and blocks and blocks[-1] < len(first_pass.block_forward):
            last_position = first_pass.block_forward[blocks[-1]][1]
            hit = np.flatnonzero(positions == last_position)
            nbytes = int(sizes[int(hit[0])]) if hit.size else 0
        out.append(nbytes)
    return tuple(out)


def microbatch_key(row: int, microbatch: int) -> int:
    """The program key of ``microbatch``'s copy of recorded allocation ``row``."""
    return row + (microbatch + 1) * MB_KEY


class StageBuilder:
    """Builds the program of one ``stage`` (:meth:`build`): the recorded run's allocations of
    its layers, replayed once per microbatch in the schedule's order, with what the pipeline
    adds (receive buffers, the outputs held until the step ends). Step by step: memory older
    than the trace, then per recorded pass the data loading (once), the shape-inferring
    microbatch (first pass only), the schedule's forwards and backwards, the step's end; after
    the last pass the rest of the trace (once)."""

    def __init__(
        self,
        structure: TrainingStructure,
        assignment: StageAssignment,
        stage: int,
        stages: int,
        microbatches: int,
        schedule: str,
    ) -> None:
        allocs = structure.allocs
        self.structure = structure
        self.assignment = assignment
        self.stage = stage
        self.stages = stages
        self.microbatches = microbatches
        self.schedule = schedule
        self.origin = structure.origin
        self.program = Program()
        self.row_at = np.full(structure.n_events, -1, dtype=np.int64)
        self.row_at[allocs["pos"].to_numpy()] = allocs["row"].to_numpy()
        # one value at a time from here on: Python ints, read straight from the columns
        self.size = _ints(allocs["size"])
        self.stream = _ints(allocs["stream"])
        self.code = _ints(allocs["code"])
        self.phase = allocs["phase"].to_numpy()
        self.free_pos = _ints(allocs["free_pos"])
        self.event_index = _ints(allocs["event_index"])
        self.categories = np.array(CATEGORIES, dtype=object)
        row_stage = assignment.row_stage
        dropped = allocs["dropped"].to_numpy()
        self.mine = ((row_stage == stage) | (row_stage < 0)) & ~dropped
        # trace position -> the stage's recorded rows freed there (no other row is ever live)
        self.free_rows: dict[int, list[int]] = {}
        mine_rows = np.flatnonzero(self.mine)
        for row, free_position in zip(
            mine_rows.tolist(), allocs["free_pos"].to_numpy()[mine_rows].tolist(), strict=True
        ):
            if free_position >= 0:
                self.free_rows.setdefault(free_position, []).append(row)
        self.releases = set(structure.releases)
        # the trace positions where something happens for this stage (see _span)
        allocated = self.row_at >= 0
        self.active = np.zeros(structure.n_events, dtype=bool)
        self.active[allocated] = self.mine[self.row_at[allocated]]
        self.active[[p for p in [*self.free_rows, *self.releases] if 0 <= p < structure.n_events]] = True
        self.spans: dict[tuple[int, int], list[tuple[int, int, int, list[int], bool]]] = {}
        self.one_microbatch_rules: dict[str, str] = {}
        # recorded row -> (source, bytes) of its microbatch copies, while saved_until and the pass hold
        self.copies: dict[int, tuple[int, int]] = {}
        self.saved_rule = RULE_SAVED_ACTIVATIONS.format(microbatches=microbatches)
        # every stage keeps each microbatch's output until the step ends (the schedule's output
        # chunks): the model's output on the last stage, its last block's output on the others
        self.outputs = _stage_outputs(structure, assignment, stage, stages)
        in_pass = np.isin(allocs["phase"].to_numpy(), PASS_PHASES)
        pass_id = allocs["pass_id"].to_numpy()
        self.pass_rows = {
            training_pass.index: set(np.flatnonzero((pass_id == training_pass.index) & in_pass).tolist())
            for training_pass in structure.passes
        }
        # recorded row -> live keys (its copies); a row stays (its list emptied) until freed whole
        self.live: dict[int, list[int]] = {}
        # recorded row -> when it entered self.live (the order the step's end frees outputs in)
        self.entered: dict[int, int] = {}
        self.entries = itertools.count()
        # activations freed from here on were saved for the backward (the pass's backward start;
        # 0 while the first step infers its shapes)
        self.saved_until = 0
        # made once, freed after the schedule's step() returns
        self.after_step: list[int] = []

    # ------------------------------------------------------------------ the steps

    def build(self) -> Program:
        """The stage's program."""
        self._alloc_untracked()
        passes = self.structure.passes
        for index, training_pass in enumerate(passes):
            self._replay_once(training_pass.data_start, training_pass.forward_start)
            if index == 0:
                self._infer_shapes(training_pass)
            self._run_schedule(training_pass)
            self._end_step(training_pass)
            if index == len(passes) - 1:
                self._replay_once(training_pass.backward_end, self.structure.n_events)
            self.spans.clear()  # a pass's spans are not replayed again
            self.copies.clear()
        return self.program

    def _alloc_untracked(self) -> None:
        """Memory older than the trace: the model state split between the stages, the rest on
        each stage as recorded."""
        for index, (nbytes, category, stream) in enumerate(self.structure.untracked):
            shared = category in MODEL_STATE
            share = f", 1/{self.stages} per stage" if shared else ", as recorded"
            what = f"{category.replace('_', ' ')} older than the trace{share}"
            self.program.alloc(
                -(UNTRACKED_KEYS + index),
                _ceil_div(nbytes, self.stages) if shared else nbytes,
                stream,
                self.program.source_id(category, what),
                self.origin(0),
                nbytes,
            )

    def _replay_once(self, start: int, stop: int) -> None:
        """Trace positions ``start`` to ``stop`` as recorded (data loading, the optimizer step)."""
        for position, origin, row, freed, release in self._span(start, stop):
            if row >= 0:
                category = self._category(row)
                self._alloc(row, row, self.size[row], category, recorded_rule(category))
            for freed_row in freed:
                self._free_all(freed_row, position)
            if release:
                self.program.empty_cache(origin)

    def _infer_shapes(self, training_pass: Pass) -> None:
        """The stage's first step infers its shapes by running one microbatch's forward
        (PipelineStage without input_args), then allocates its receive buffers."""
        extra = self.microbatches  # the microbatch after the schedule's own
        self._replay_microbatch(
            training_pass,
            training_pass.forward_start,
            training_pass.backward_start,
            extra,
            False,
            False,
        )
        for row in list(self.live):
            key = microbatch_key(row, extra)
            if key in self.live[row]:
                self.live[row].remove(key)
                self.program.free(key, self.origin(training_pass.forward_start))
        start = self.origin(training_pass.forward_start)
        _recv_buffers(
            self.program,
            self.assignment,
            self.stage,
            self.stages,
            self.microbatches,
            start,
        )

    def _run_schedule(self, training_pass: Pass) -> None:
        """The schedule's forwards and backwards, each over the pass's recorded span."""
        self.saved_until = training_pass.backward_start
        self.copies.clear()
        first_backward = True
        ops = schedule_ops(self.schedule, self.stage, self.stages, self.microbatches)
        last_forward = max(index for index, (step, _) in enumerate(ops) if step == "F")
        last_backward = max(index for index, (step, _) in enumerate(ops) if step == "B")
        forward = (training_pass.forward_start, training_pass.backward_start)
        backward = (training_pass.backward_start, training_pass.backward_end)
        for index, (operation, microbatch) in enumerate(ops):
            if operation == "F":
                self._replay_microbatch(training_pass, *forward, microbatch, False, index == last_forward)
                continue
            self._replay_microbatch(training_pass, *backward, microbatch, first_backward, index == last_backward)
            first_backward = False
            if self.stage < self.stages - 1:
                self._release_sent_outputs(microbatch, training_pass.backward_end - 1)

    def _release_sent_outputs(self, microbatch: int, position: int) -> None:
        """The output was sent to the next stage (record_stream on the communication stream):
        released after this microbatch's backward, its block back at the step's end."""
        live, offset = self.live, microbatch_key(0, microbatch)
        for row in self.outputs:
            keys = live.get(row)
            if keys and row + offset in keys:
                self.program.free_requested(row + offset, self.origin(position))

    def _end_step(self, training_pass: Pass) -> None:
        """The step's end: the last stage merges the microbatches' outputs into one (then
        dropped); the held outputs and what waited for the step are freed."""
        last_position = training_pass.backward_end - 1
        if self.stage == self.stages - 1 and training_pass.output_row >= 0:
            row = training_pass.output_row
            key = -(MERGED_OUTPUT_KEYS + training_pass.index)
            source = self.program.source_id("activation", RULE_MERGED_OUTPUTS)
            at = self.origin(last_position)
            self.program.alloc(key, int(self.size[row]), int(self.stream[row]), source, at, 0)
            self.program.free(key, self.origin(last_position))
        held = [row for row in self.outputs if row in self.live]
        for row in sorted(held, key=self.entered.__getitem__):  # in self.live's order
            self._free_all(row, last_position)
        for row in self.after_step:
            self._free_all(row, last_position)
        self.after_step.clear()

    # ------------------------------------------------------------------ one microbatch

    def _replay_microbatch(
        self,
        training_pass: Pass,
        start: int,
        stop: int,
        microbatch: int,
        first_backward: bool,
        final: bool,
    ) -> None:
        """Trace positions ``start`` to ``stop`` of ``training_pass`` for one microbatch;
        ``final``: the schedule's last forward or backward of the step."""
        pass_rows = self.pass_rows[training_pass.index]
        for _, origin, row, freed, release in self._span(start, stop):
            if row >= 0:
                self._alloc_for_microbatch(row, origin, microbatch, first_backward, training_pass)
            if freed:
                self._free_for_microbatch(freed, origin, microbatch, pass_rows, final)
            if release:
                self.program.empty_cache(origin)

    def _span(self, start: int, stop: int) -> list[tuple[int, int, int, list[int], bool]]:
        """What happens for this stage at trace positions ``start`` to ``stop``, where anything
        does: (position, its recorded event index, the stage's row allocated there or -1, the
        stage's rows freed there, whether the cache is emptied there). Made once a pass for the
        microbatches that replay it."""
        span = self.spans.get((start, stop))
        if span is None:
            positions = (np.flatnonzero(self.active[start:stop]) + start).tolist()
            rows = self.row_at[positions]
            mine = self.mine[np.maximum(rows, 0)] & (rows >= 0)
            span = [
                (
                    position,
                    self.origin(position),
                    row if own else -1,
                    self.free_rows.get(position, []),
                    position in self.releases,
                )
                for position, row, own in zip(positions, rows.tolist(), mine.tolist(), strict=True)
            ]
            self.spans[(start, stop)] = span
        return span

    def _alloc_for_microbatch(
        self, row: int, origin: int, microbatch: int, first_backward: bool, training_pass: Pass
    ) -> None:
        if self.code[row] == CODES["gradient"]:
            if first_backward:
                self._alloc(row, row, self.size[row], "gradient", RULE_FIRST_GRADIENTS)
            else:
                key = microbatch_key(row, microbatch)
                self._alloc(key, row, self.size[row], "activation", RULE_LATER_GRADIENTS)
                self.program.free(key, origin)
                self.live[row].remove(key)
        elif self.free_pos[row] < 0:
            if microbatch == 0:  # kept for the run: a cache or workspace
                category = self._category(row)
                self._alloc(row, row, self.size[row], category, recorded_rule(category))
        else:
            copy = self.copies.get(row)
            if copy is None:  # the same for every microbatch of the pass
                category, rule = self._microbatch_source(row, training_pass)
                nbytes = max(_ceil_div(self.size[row], self.microbatches), 1)
                copy = self.copies[row] = (self.program.source_id(category, rule), nbytes)
            self._alloc_as(microbatch_key(row, microbatch), row, copy[1], copy[0])

    def _microbatch_source(self, row: int, training_pass: Pass) -> tuple[str, str]:
        """Category and rule of one microbatch's copy of recorded allocation ``row``."""
        free_position = self.free_pos[row]
        saved = self.phase[row] == "forward" and free_position >= 0 and free_position < training_pass.backward_end
        if row in self.outputs:
            last = self.stage == self.stages - 1
            return "activation", RULE_MODEL_OUTPUT if last else RULE_STAGE_OUTPUT
        if saved and int(free_position) >= self.saved_until:
            return "inflight_activation", self.saved_rule
        category = self._category(row)
        rule = self.one_microbatch_rules.get(category)
        if rule is None:
            rule = self.one_microbatch_rules[category] = RULE_ONE_MICROBATCH.format(
                what=category.replace("_", " "),
                microbatches=self.microbatches,
            )
        return (category if category != "inflight_activation" else "activation"), rule

    def _free_for_microbatch(
        self,
        freed: list[int],
        origin: int,
        microbatch: int,
        pass_rows: set[int],
        final: bool,
    ) -> None:
        live, outputs, offset = self.live, self.outputs, microbatch_key(0, microbatch)
        for row in freed:
            keys = live.get(row)
            if not keys or row in outputs:
                continue
            key = row + offset
            if key in keys:
                keys.remove(key)
                self.program.free(key, origin)
            elif row not in pass_rows and final:
                # made once (inputs) and freed by the program after its backward call: in a
                # pipeline that is after the schedule's step() returned
                self.after_step.append(row)

    # ------------------------------------------------------------------ helpers

    def _category(self, row: int) -> str:
        return str(self.categories[self.code[row]])

    def _alloc(self, key: int, row: int, nbytes: int, category: str, rule: str) -> None:
        self._alloc_as(key, row, max(int(nbytes), 1), self.program.source_id(category, rule))

    def _alloc_as(self, key: int, row: int, nbytes: int, source: int) -> None:
        """Allocate ``nbytes`` (at least 1) as ``key``, a copy of recorded allocation ``row``."""
        self.program.alloc(key, nbytes, self.stream[row], source, self.event_index[row], self.size[row])
        if row not in self.live:
            self.live[row] = []
            self.entered[row] = next(self.entries)
        self.live[row].append(key)

    def _free_all(self, row: int, position: int) -> None:
        for key in self.live.pop(row, []):
            self.program.free(key, self.origin(position))


def _ints(column: pd.Series) -> memoryview:
    """A column's values as Python ints, one at a time, without a copy of each (a memoryview
    of its int64 array: indexing it is several times cheaper than indexing the array)."""
    return np.ascontiguousarray(column.to_numpy(), dtype=np.int64).data


def _ceil_div(nbytes: int, parts: int) -> int:
    return -(-nbytes // parts)


def _stage_outputs(
    structure: TrainingStructure,
    assignment: StageAssignment,
    stage: int,
    stages: int,
) -> set[int]:
    """Rows of the outputs the stage keeps per microbatch: the model's on the last stage, its
    last block's on the others."""
    if stage == stages - 1:
        return {one_pass.output_row for one_pass in structure.passes if one_pass.output_row >= 0}
    blocks = [j for j, holder in enumerate(assignment.block_stage) if holder == stage]
    if not blocks:
        return set()
    positions = structure.allocs["pos"].to_numpy()
    out: set[int] = set()
    for training_pass in structure.passes:
        if blocks[-1] < len(training_pass.block_forward):
            hit = np.flatnonzero(positions == training_pass.block_forward[blocks[-1]][1])
            out.update(int(row) for row in hit.tolist())
    return out


def _recv_buffers(
    program: Program,
    assignment: StageAssignment,
    stage: int,
    stages: int,
    microbatches: int,
    origin: int,
) -> None:
    """One receive buffer per microbatch for the activations coming in (every stage but the
    first) and one for the gradients coming back (every stage but the last)."""
    if stage > 0:
        nbytes = assignment.boundary_bytes[stage - 1]
        source = program.source_id("comm_buffer", RULE_RECV_ACTIVATIONS.format(stage=stage - 1))
        for i in range(microbatches):
            program.alloc(
                -(RECV_BUFFER_KEYS + i),
                _ceil_div(nbytes, microbatches),
                0,
                source,
                origin,
                0,
            )
    if stage < stages - 1:
        nbytes = assignment.boundary_bytes[stage]
        source = program.source_id("comm_buffer", RULE_RECV_GRADIENTS.format(stage=stage + 1))
        for i in range(microbatches):
            key = -(RECV_BUFFER_KEYS + microbatches + i)
            program.alloc(key, _ceil_div(nbytes, microbatches), 0, source, origin, 0)
