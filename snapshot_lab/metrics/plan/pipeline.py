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

from dataclasses import dataclass

import numpy as np

from ..categories import CATEGORIES, CODES
from .program import MB_KEY, Program
from .rewrite import recorded_rule
from .structure import TrainingStructure

SCHEDULES = ("1f1b", "gpipe")


def schedule_ops(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of forwards and backwards one stage runs (torch's ScheduleGPipe and Schedule1F1B)."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, stages - stage)
    ops = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while True:
        ops.append(("B", b))
        b += 1
        if f == m:
            break
        ops.append(("F", f))
        f += 1
    ops += [("B", i) for i in range(b, m)]
    return ops


def stage_blocks(n_blocks: int, stages: int, split: tuple[int, ...] | None = None) -> list[int]:
    """Stage of every block."""
    if split:
        counts = list(split)
    else:
        per = n_blocks // stages
        counts = [per] * (stages - 1) + [n_blocks - per * (stages - 1)]
    out: list[int] = []
    for s, c in enumerate(counts):
        out += [s] * c
    return out


@dataclass(frozen=True)
class StageAssignment:
    block_stage: tuple[int, ...]
    row_stage: np.ndarray  # per recorded allocation: its stage, -1: every stage (inputs, setup)
    boundary_bytes: tuple[int, ...]  # per stage boundary s|s+1: recorded bytes of the tensor that crosses it


def assign_stages(s: TrainingStructure, stages: int, split: tuple[int, ...] | None) -> StageAssignment:
    a = s.allocs
    bstage = stage_blocks(s.n_blocks, stages, split)
    last = stages - 1
    part = a["part"].to_numpy()
    block = a["block"].to_numpy()
    phase = a["phase"].to_numpy()
    code = a["code"].to_numpy()
    param = a["param"].to_numpy()
    out = np.full(len(a), -1, dtype=np.int64)
    in_pass = np.isin(phase, ["forward", "backward"])
    out[in_pass & (part == "pre")] = 0
    out[in_pass & (part == "post")] = last
    for j, st in enumerate(bstage):
        out[in_pass & (part == "block") & (block == j)] = st
    p_block = s.params["block"].to_numpy()
    p_part = s.params["part"].to_numpy()
    p_stage = np.where(p_block >= 0, np.array([*bstage, 0])[np.clip(p_block, 0, len(bstage))], 0)
    p_stage = np.where((p_block < 0) & (p_part == "post"), last, p_stage)
    mirrors = np.isin(code, [CODES["parameter"], CODES["gradient"], CODES["optimizer_state"]]) & (param >= 0)
    out[mirrors] = p_stage[param[mirrors]]
    # kept for the whole run from inside a pass (a library's cache or workspace): every process has one
    kept = in_pass & (a["free_pos"].to_numpy() < 0) & ~np.isin(code, [CODES["gradient"], CODES["parameter"]])
    out[kept] = -1
    # the tensor crossing boundary s|s+1: the output of stage s's last block (first pass)
    bounds = []
    p0 = s.passes[0] if s.passes else None
    pos = a["pos"].to_numpy()
    for st in range(stages - 1):
        js = [j for j, x in enumerate(bstage) if x == st]
        size = 0
        if p0 is not None and js and js[-1] < len(p0.block_forward):
            last_pos = p0.block_forward[js[-1]][1]
            hit = np.flatnonzero(pos == last_pos)
            size = int(a["size"].to_numpy()[int(hit[0])]) if hit.size else 0
        bounds.append(size)
    return StageAssignment(tuple(bstage), out, tuple(bounds))


def build_stage(
    s: TrainingStructure,
    assign: StageAssignment,
    stage: int,
    stages: int,
    microbatches: int,
    schedule: str,
) -> Program:
    a = s.allocs
    m = microbatches
    prog = Program()
    n = s.n_events
    row_at = np.full(n, -1, dtype=np.int64)
    row_at[a["pos"].to_numpy()] = a["row"].to_numpy()
    free_rows: dict[int, list[int]] = {}
    for r, p in enumerate(a["free_pos"].tolist()):
        if p >= 0:
            free_rows.setdefault(int(p), []).append(r)
    size = a["size"].to_numpy()
    stream = a["stream"].to_numpy()
    code = a["code"].to_numpy()
    phase = a["phase"].to_numpy()
    free_pos = a["free_pos"].to_numpy()
    pass_id = a["pass_id"].to_numpy()
    event_index = a["event_index"].to_numpy()
    row_stage = assign.row_stage
    origin = s.origin
    live: dict[int, list[int]] = {}  # recorded row -> live keys (its copies)
    cats = np.array(CATEGORIES, dtype=object)
    mine = ((row_stage == stage) | (row_stage < 0)) & ~a["dropped"].to_numpy()
    releases = set(s.releases)
    # every stage keeps each microbatch's output until the step ends (the schedule's output
    # chunks): the model's output on the last stage, its last block's output on the others
    outputs = _stage_outputs(s, assign, stage, stages)

    def src(cat: str, rule: str) -> int:
        return prog.source_id(cat, rule)

    def alloc(key: int, r: int, nbytes: int, cat: str, rule: str) -> None:
        prog.alloc(key, max(int(nbytes), 1), int(stream[r]), src(cat, rule), int(event_index[r]), int(size[r]))
        live.setdefault(r, []).append(key)

    def free_all(r: int, p: int) -> None:
        for k in live.pop(r, []):
            prog.free(k, origin(p))

    def once(lo: int, hi: int) -> None:
        for p in range(lo, hi):
            r = int(row_at[p])
            if r >= 0 and mine[r]:
                c = str(cats[code[r]])
                alloc(r, r, size[r], c, recorded_rule(c))
            for fr in free_rows.get(p, ()):
                free_all(fr, p)
            if p in releases:
                prog.empty_cache(origin(p))

    pass_rows: dict[int, set[int]] = {}
    for p_ in s.passes:
        span = (pass_id == p_.index) & np.isin(phase, ["forward", "backward"])
        pass_rows[p_.index] = set(np.flatnonzero(span).tolist())

    def micro(
        lo: int, hi: int, mb: int, first_backward: bool, final: bool, pass_index: int, last_pass_end: int
    ) -> None:
        in_pass = pass_rows[pass_index]
        for p in range(lo, hi):
            r = int(row_at[p])
            if r >= 0 and mine[r]:
                c = str(cats[code[r]])
                if code[r] == CODES["gradient"]:
                    if first_backward:
                        alloc(r, r, size[r], "gradient", "gradients of the stage's parameters (first microbatch)")
                    else:
                        k = r + (mb + 1) * MB_KEY
                        alloc(k, r, size[r], "activation", "weight gradients of later microbatches (accumulated)")
                        prog.free(k, origin(p))
                        live[r].remove(k)
                elif free_pos[r] < 0:
                    if mb == 0:  # kept for the run: a cache or workspace
                        alloc(r, r, size[r], c, recorded_rule(c))
                else:
                    saved = phase[r] == "forward" and free_pos[r] >= 0 and free_pos[r] < last_pass_end
                    held = saved and int(free_pos[r]) >= lo_b[0]
                    if r in outputs:
                        cat, rule = (
                            "activation",
                            (
                                "the model's output, kept per microbatch until the step ends"
                                if stage == stages - 1
                                else "the stage's output, sent to the next stage (held until the step ends)"
                            ),
                        )
                    elif held:
                        cat, rule = (
                            "inflight_activation",
                            f"activations saved for a microbatch's backward, 1/{m} of the batch",
                        )
                    else:
                        cat, rule = (
                            c if c != "inflight_activation" else "activation",
                            f"{c.replace('_', ' ')}, one microbatch (1/{m} of the batch)",
                        )
                    alloc(r + (mb + 1) * MB_KEY, r, -(-int(size[r]) // m), cat, rule)
            for fr in free_rows.get(p, ()):
                if fr in outputs:
                    continue
                k = fr + (mb + 1) * MB_KEY
                keys = live.get(fr)
                if not keys:
                    continue
                if k in keys:
                    keys.remove(k)
                    prog.free(k, origin(p))
                elif fr not in in_pass and final:
                    # made once (inputs) and freed by the program after its backward call: in a
                    # pipeline that is after the schedule's step() returned
                    after_step.append(fr)
            if p in releases:
                prog.empty_cache(origin(p))

    # memory older than the trace: the model state split between the stages, the rest on each
    for k, (nbytes, cat, st_) in enumerate(s.untracked):
        shared = cat in ("parameter", "gradient", "optimizer_state")
        what = f"{cat.replace('_', ' ')} older than the trace" + (
            f", 1/{stages} per stage" if shared else ", as recorded"
        )
        prog.alloc(-(100_000 + k), -(-nbytes // stages) if shared else nbytes, st_, src(cat, what), origin(0), nbytes)
    lo_b = [0]
    after_step: list[int] = []
    recv_done = False
    for i, p_ in enumerate(s.passes):
        once(p_.data_start, p_.forward_start)
        if not recv_done:
            recv_done = True
            # the stage's first step infers its shapes by running one microbatch's forward
            # (PipelineStage without input_args), then allocates its receive buffers
            micro(p_.forward_start, p_.backward_start, m, False, False, p_.index, p_.backward_end)
            for r in list(live):
                key = r + (m + 1) * MB_KEY
                if key in live[r]:
                    live[r].remove(key)
                    prog.free(key, origin(p_.forward_start))
            _recv_buffers(prog, assign, stage, stages, m, origin(p_.forward_start))
        lo_b[0] = p_.backward_start
        first_b = True
        ops = schedule_ops(schedule, stage, stages, m)
        last_f = max(i for i, (o, _) in enumerate(ops) if o == "F")
        last_b = max(i for i, (o, _) in enumerate(ops) if o == "B")
        for k, (op, mb) in enumerate(ops):
            if op == "F":
                micro(p_.forward_start, p_.backward_start, mb, False, k == last_f, p_.index, p_.backward_end)
            else:
                micro(p_.backward_start, p_.backward_end, mb, first_b, k == last_b, p_.index, p_.backward_end)
                first_b = False
                if stage < stages - 1:
                    # the output was sent to the next stage (record_stream on the communication
                    # stream): released after this microbatch's backward, its block back at the step's end
                    for r in outputs:
                        key = r + (mb + 1) * MB_KEY
                        if key in live.get(r, []):
                            prog.free_requested(key, origin(p_.backward_end - 1))
        if stage == stages - 1 and p_.output_row >= 0:
            # the schedule concatenates the microbatches' outputs into one (then dropped here)
            r = p_.output_row
            k = -(1000 + p_.index)
            what = "the microbatches' outputs, merged into one at the step's end"
            prog.alloc(k, int(size[r]), int(stream[r]), src("activation", what), origin(p_.backward_end - 1), 0)
            prog.free(k, origin(p_.backward_end - 1))
        for r in list(live):
            if r in outputs:
                free_all(r, p_.backward_end - 1)
        for r in after_step:
            free_all(r, p_.backward_end - 1)
        after_step.clear()
        if i == len(s.passes) - 1:
            once(p_.backward_end, n)
    return prog


def _stage_outputs(s: TrainingStructure, assign: StageAssignment, stage: int, stages: int) -> set[int]:
    if stage == stages - 1:
        return {p.output_row for p in s.passes if p.output_row >= 0}
    js = [j for j, x in enumerate(assign.block_stage) if x == stage]
    if not js:
        return set()
    pos = s.allocs["pos"].to_numpy()
    out: set[int] = set()
    for p in s.passes:
        if js[-1] < len(p.block_forward):
            hit = np.flatnonzero(pos == p.block_forward[js[-1]][1])
            out.update(int(h) for h in hit.tolist())
    return out


def _recv_buffers(prog: Program, assign: StageAssignment, stage: int, stages: int, m: int, origin: int) -> None:
    if stage > 0:
        b = assign.boundary_bytes[stage - 1]
        sid = prog.source_id(
            "comm_buffer", f"pipeline receive buffers: activations from stage {stage - 1}, one per microbatch"
        )
        for i in range(m):
            prog.alloc(-(10 + i), -(-b // m), 0, sid, origin, 0)
    if stage < stages - 1:
        b = assign.boundary_bytes[stage]
        sid = prog.source_id(
            "comm_buffer", f"pipeline receive buffers: gradients from stage {stage + 1}, one per microbatch"
        )
        for i in range(m):
            prog.alloc(-(10 + m + i), -(-b // m), 0, sid, origin, 0)
