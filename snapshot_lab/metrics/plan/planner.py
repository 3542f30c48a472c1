"""One plan: a strategy, the recorded run rewritten for it, replayed, and what the numbers mean."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ...errors import ParameterError
from ...frames import SnapshotFrames
from .._jobs import Spread, in_turn
from .._memo import memo
from ..allocator.model import AllocatorSettings, recorded_settings
from ..categories import CATEGORIES
from . import data_parallel, messages, pipeline, tensor_parallel
from .messages import NOT_MODELLED
from .program import PeakPart, Program, Replayed, replay
from .rewrite import Rewrite
from .structure import TrainingStructure, training_structure

STRATEGIES = ("ddp", "zero1", "fsdp", "fsdp1", "tp", "pp", "fsdp+tp")
ALIASES = {
    "zero2": ("fsdp", False),
    "zero3": ("fsdp", True),
    "fsdpxtp": ("fsdp+tp", None),
    "fsdp×tp": ("fsdp+tp", None),
    "fsdp*tp": ("fsdp+tp", None),
    "fsdp2": ("fsdp", None),
    "hsdp": ("fsdp", None),
}


class PlanUnsupported(ValueError):
    """The trace cannot support a plan (no whole iteration, no stacks...)."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__("; ".join(reasons))


@dataclass(frozen=True)
class Strategy:
    """A parallel layout to plan for. ``tp``: tensor-parallel degree (``tp``: the world size;
    ``fsdp+tp``: 2). ``stages``: pipeline stages (the world size); ``microbatches``: 4 per stage
    unless given."""

    name: str
    world_size: int
    bucket_view: bool = False
    bucket_cap_mb: float = 25.0
    reshard_after_forward: bool = True
    tp: int | None = None
    tp_layers: str = "blocks"
    stages: int | None = None
    microbatches: int | None = None
    schedule: str = "1f1b"
    pp_split: tuple[int, ...] | None = None

    def resolved(self) -> Strategy:
        """Defaults filled in and the combination checked (ValueError when it makes no sense)."""
        name = self.name.strip().lower()
        strategy = self
        if name in ALIASES:
            base, reshard = ALIASES[name]
            if reshard is not None:
                strategy = replace(strategy, reshard_after_forward=reshard)
            name = base
        if name not in STRATEGIES:
            known = ", ".join(STRATEGIES)
            raise ValueError(messages.UNKNOWN_STRATEGY.format(name=self.name, strategies=known))
        world = strategy.world_size
        if world < 1:
            raise ValueError("the world size must be at least 1")
        tp_degree = strategy.tp
        if name == "tp":
            tp_degree = tp_degree or world
            if tp_degree != world:
                raise ParameterError("tp", messages.TP_NEEDS_WORLD, world=world)
        elif name == "fsdp+tp":
            tp_degree = tp_degree or (2 if world % 2 == 0 and world >= 2 else 1)
            if tp_degree < 1 or world % tp_degree:
                raise ParameterError("tp", messages.TP_DOES_NOT_DIVIDE, degree=tp_degree, world=world)
        else:
            tp_degree = 1
        stages = strategy.stages
        micro = strategy.microbatches
        schedule = strategy.schedule.lower().replace("-", "")
        if name == "pp":
            stages = stages or world
            if stages != world:
                raise ValueError(messages.PP_STAGES.format(world=world))
            micro = micro or 4 * stages
            if schedule not in pipeline.SCHEDULES:
                raise ValueError(messages.UNKNOWN_SCHEDULE.format(schedule=strategy.schedule))
            if strategy.pp_split is not None and (len(strategy.pp_split) != stages or min(strategy.pp_split) < 1):
                raise ParameterError("pp_split", messages.PP_SPLIT_COUNTS, stages=stages)
        else:
            stages, micro = 1, 1
        if strategy.tp_layers not in tensor_parallel.TP_LAYERS:
            raise ParameterError("tp_layers", messages.TP_LAYERS_CHOICES, choices=", ".join(tensor_parallel.TP_LAYERS))
        if strategy.bucket_cap_mb <= 0:
            raise ParameterError("bucket_cap_mb", messages.BUCKET_CAP_POSITIVE)
        return replace(
            strategy,
            name=name,
            tp=tp_degree,
            stages=stages,
            microbatches=micro,
            schedule=schedule,
        )

    @property
    def dp(self) -> int:
        return self.world_size // max(self.tp or 1, 1) // max(self.stages or 1, 1)

    def label(self) -> str:
        gpus = f"{self.world_size} GPU" + ("s" if self.world_size != 1 else "")
        if self.name == "ddp":
            return f"DDP over {gpus}" + (", gradient_as_bucket_view" if self.bucket_view else "")
        if self.name == "zero1":
            return f"ZeRO-1 (optimizer state sharded) over {gpus}"
        if self.name in ("fsdp", "fsdp1"):
            version = "FSDP2" if self.name == "fsdp" else "FSDP1"
            how = (
                ("reshard after forward" if self.reshard_after_forward else "no reshard after forward")
                if self.name == "fsdp"
                else ("FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP")
            )
            zero = "ZeRO-3" if self.reshard_after_forward else "ZeRO-2"
            return f"{version}, {how} ({zero}), over {gpus}"
        if self.name == "tp":
            return f"tensor parallel, degree {self.tp}"
        if self.name == "pp":
            schedule = self.schedule.upper()
            return f"pipeline, {self.stages} stages, {self.microbatches} microbatches, {schedule}"
        return f"FSDP2 x tensor parallel: {self.dp} x {self.tp} over {gpus}"

    def to_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["pp_split"] = list(self.pp_split) if self.pp_split else None
        fields["label"] = self.label()
        return fields


@dataclass(frozen=True)
class RankPlan:
    """The predicted memory of one rank (all data-parallel and tensor-parallel ranks alike; one
    per pipeline stage)."""

    label: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_event: int  # the recorded event the predicted peak is placed at
    peak_moment: str  # in words: which iteration, pass and layer
    by_category: dict[str, int]
    parts: tuple[PeakPart, ...]
    cuda_malloc_calls: int
    fits: bool | None = None
    headroom_bytes: int | None = None
    fits_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_at_recorded_event": self.peak_event,
            "peak_moment": self.peak_moment,
            "at_peak_by_category": self.by_category,
            "at_peak": [part.to_dict() for part in self.parts],
            "cuda_malloc_calls": self.cuda_malloc_calls,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "fits_note": self.fits_note,
        }


@dataclass(frozen=True)
class MemoryPlan:
    device: int
    strategy: Strategy
    recorded: RankPlan  # the recording replayed as it was (world size 1)
    # torch's own counters from the capture sidecar, when present
    recorded_torch_peaks: dict[str, int]
    ranks: tuple[RankPlan, ...]
    memory_limit_bytes: int | None
    memory_limit_source: str
    structure: dict[str, Any]
    assumptions: tuple[str, ...]
    not_modelled: tuple[str, ...] = NOT_MODELLED
    events: int = 0

    @property
    def peak_allocated_bytes(self) -> int:
        return max(rank_plan.peak_allocated_bytes for rank_plan in self.ranks)

    @property
    def peak_reserved_bytes(self) -> int:
        return max(rank_plan.peak_reserved_bytes for rank_plan in self.ranks)

    @property
    def fits(self) -> bool | None:
        verdicts = [rank_plan.fits for rank_plan in self.ranks]
        if any(verdict is None for verdict in verdicts):
            return None
        return all(bool(verdict) for verdict in verdicts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "strategy": self.strategy.to_dict(),
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "fits": self.fits,
            "memory_limit_bytes": self.memory_limit_bytes,
            "memory_limit_source": self.memory_limit_source,
            "ranks": [rank_plan.to_dict() for rank_plan in self.ranks],
            "recorded": self.recorded.to_dict(),
            "recorded_torch_peaks": self.recorded_torch_peaks,
            "structure": self.structure,
            "assumptions": list(self.assumptions),
            "not_modelled": list(self.not_modelled),
            "events": self.events,
        }


# --------------------------------------------------------------------------- planning


def _moment(structure: TrainingStructure, event: int) -> str:
    allocs = structure.allocs
    if not len(allocs) or event < 0:
        return ""
    position = structure.position(event)
    for one_pass in structure.passes:
        if one_pass.data_start <= position < one_pass.end:
            iteration = f"iteration {one_pass.index + 1}"
            if position < one_pass.forward_start:
                return f"{iteration}, before the forward (data, optimizer step)"
            if position < one_pass.backward_start:
                blocks = one_pass.block_forward
                for j, (first, last) in enumerate(blocks):
                    next_first = blocks[j + 1][0] if j + 1 < len(blocks) else last + 1
                    if first <= position < next_first:
                        return f"{iteration}, forward, block {j}"
                if one_pass.block_forward and position < one_pass.block_forward[0][0]:
                    return f"{iteration}, forward, before the blocks (embeddings)"
                return f"{iteration}, forward, after the blocks (head, loss)"
            if position < one_pass.backward_end:
                if position <= one_pass.post_backward[1]:
                    return f"{iteration}, backward, start (loss, head)"
                for j, (first, last) in enumerate(one_pass.block_backward):
                    if first <= position <= last:
                        return f"{iteration}, backward, block {j}"
                return f"{iteration}, backward, end (embeddings)"
            return f"{iteration}, optimizer step"
    return (
        "before the first iteration (model set-up)"
        if structure.passes and position < structure.passes[0].forward_start
        else ""
    )


def _rank(
    label: str,
    replayed: Replayed,
    structure: TrainingStructure,
    limit: int | None,
    program: Program | None = None,
    settings: AllocatorSettings | None = None,
    limit_is_cap: bool = False,
) -> RankPlan:
    """The plan of one rank; under ``limit``, whether it fits: without releasing anything when
    the peak reserved stays under it, else only if the allocator, replayed under the limit,
    can release cached blocks and retry instead of running out."""
    fits = headroom = None
    note = ""
    if limit is not None:
        headroom = limit - replayed.peak_reserved_bytes
        fits = headroom >= 0
        if not fits and program is not None and settings is not None:
            capped = replay(program, settings, limit, limit_is_cap)
            if capped.oom_at is None:
                fits = True
                headroom = limit - capped.peak_reserved_bytes
                note = messages.FITS_ONLY_BY_RELEASING.format(peak_reserved=capped.peak_reserved_bytes)
            else:
                note = messages.OOM_UNDER_LIMIT.format(event=capped.oom_at)
    return RankPlan(
        label=label,
        peak_allocated_bytes=replayed.peak_allocated_bytes,
        peak_reserved_bytes=replayed.peak_reserved_bytes,
        peak_event=replayed.peak_origin,
        peak_moment=_moment(structure, replayed.peak_origin),
        by_category={category: int(replayed.by_category.get(category, 0)) for category in CATEGORIES},
        parts=replayed.parts,
        cuda_malloc_calls=replayed.cuda_malloc_calls,
        fits=fits,
        headroom_bytes=headroom,
        fits_note=note,
    )


def _local_after_tp(
    structure: TrainingStructure,
    tp_plan: tensor_parallel.TensorParallel | None,
) -> np.ndarray:
    sizes = structure.params["size"].to_numpy().astype(np.int64)
    if tp_plan is None:
        return sizes
    return np.ceil(sizes * tp_plan.param_scale).astype(np.int64)


def programs_for(
    frames: SnapshotFrames, structure: TrainingStructure, strategy: Strategy, notes: list[str]
) -> list[tuple[str, Callable[[], Program]]]:
    """The planned program of every distinct rank (one for data/tensor parallelism, one per
    pipeline stage), each as the way to build it (a pipeline stage's takes seconds at 1M events)."""
    if strategy.name == "pp":
        return _pipeline_programs(structure, strategy, notes)
    rewrite = Rewrite.identity(structure)
    tp_plan = None
    if strategy.name in ("tp", "fsdp+tp") and (strategy.tp or 1) > 1:
        tp_plan = tensor_parallel.plan_tensor_parallel(
            frames,
            structure,
            strategy.tp or 1,
            strategy.tp_layers,
        )
        notes.append(_tensor_parallel_note(tp_plan, strategy.tp_layers))
    local = _local_after_tp(structure, tp_plan)
    older = np.array(
        [nbytes for nbytes, category, _ in structure.untracked if category == "parameter"],
        dtype=np.int64,
    )
    if not len(structure.params) and older.size:
        notes.append(messages.NOTE_PARAMETERS_BEFORE_TRACE.format(nbytes=int(older.sum())))
    if tp_plan is not None:
        # under FSDP x TP, FSDP shards the parameters when it wraps
        wrap = strategy.name == "tp" or strategy.dp == 1
        tensor_parallel.apply_tensor_parallel(rewrite, tp_plan, local, wrap=wrap)
    bucketed = local if len(structure.params) else older
    _apply_data_parallel(rewrite, strategy, local, bucketed, notes)
    if strategy.name not in ("tp", "fsdp+tp") and strategy.name != "pp":
        notes.append(messages.NOTE_ACTIVATIONS_AS_RECORDED)
    label = "every rank" if strategy.world_size > 1 else "the one GPU"
    return [(label, rewrite.build)]


def _tensor_parallel_note(tp_plan: tensor_parallel.TensorParallel, tp_layers: str) -> str:
    which = messages.TP_LAYERS_NOTE["blocks" if tp_layers == "blocks" else "all"]
    return messages.NOTE_TENSOR_PARALLEL.format(
        column_layers=tp_plan.column_layers, row_layers=tp_plan.row_layers, tp_layers=tp_layers, which=which
    )


def _apply_data_parallel(
    rewrite: Rewrite,
    strategy: Strategy,
    local: np.ndarray,
    bucketed: np.ndarray,
    notes: list[str],
) -> None:
    """DDP's buckets, ZeRO-1's optimizer shards or FSDP's units, as the strategy says."""
    name = strategy.name
    if name == "ddp":
        data_parallel.apply_ddp(rewrite, strategy.bucket_view, strategy.bucket_cap_mb, bucketed)
    elif name == "zero1":
        label = "DDP (under ZeRO-1)"
        data_parallel.apply_ddp(
            rewrite,
            strategy.bucket_view,
            strategy.bucket_cap_mb,
            bucketed,
            label=label,
        )
        data_parallel.apply_zero1(rewrite, strategy.world_size)
        rewrite.untracked = data_parallel.untracked_sharded(
            ("optimizer_state",),
            strategy.world_size,
            "ZeRO-1",
        )
    elif name in ("fsdp", "fsdp1", "fsdp+tp"):
        world = strategy.dp if name == "fsdp+tp" else strategy.world_size
        if world <= 1:
            return
        version = 1 if name == "fsdp1" else 2
        units = data_parallel.apply_fsdp(
            rewrite,
            world,
            strategy.reshard_after_forward,
            version,
            local,
        )
        rewrite.untracked = data_parallel.untracked_sharded(
            ("parameter", "gradient", "optimizer_state"),
            world,
            "FSDP",
        )
        named = ", ".join(unit.name for unit in units)
        if len(units) > 4:
            named = f"{units[0].name}, …, {units[-1].name}"
        notes.append(messages.NOTE_FSDP_UNITS.format(count=len(units), named=named))


def _pipeline_programs(
    structure: TrainingStructure,
    strategy: Strategy,
    notes: list[str],
) -> list[tuple[str, Callable[[], Program]]]:
    """One program per pipeline stage."""
    stages = strategy.stages or 1
    if structure.n_blocks < stages:
        raise PlanUnsupported(
            [
                messages.PIPELINE_TOO_FEW_BLOCKS.format(
                    stages=strategy.stages,
                    n_blocks=structure.n_blocks,
                )
            ]
        )
    split = strategy.pp_split
    if split is not None and sum(split) != structure.n_blocks:
        raise ParameterError(
            "pp_split", messages.PP_SPLIT_SUM, split=",".join(map(str, split)), n_blocks=structure.n_blocks
        )
    assignment = pipeline.assign_stages(structure, stages, split)
    parts = set(structure.params.loc[structure.params["block"] < 0, "part"].tolist())
    out: list[tuple[str, Callable[[], Program]]] = []
    for stage in range(stages):
        blocks = [j for j, holder in enumerate(assignment.block_stage) if holder == stage]
        where = f"blocks {blocks[0]}–{blocks[-1]}" if blocks else "no blocks"
        extra = " + the layers before the blocks" if stage == 0 and "pre" in parts else ""
        if stage == stages - 1:
            extra += " + the layers after the blocks and the loss" if "post" in parts else " + the loss"
        build = functools.partial(
            _stage_program,
            structure,
            assignment,
            stage,
            stages,
            strategy.microbatches or 1,
            strategy.schedule,
        )
        out.append((f"stage {stage} (rank {stage}: {where}{extra})", build))
    counts = ", ".join(str(assignment.block_stage.count(stage)) for stage in range(stages))
    notes.append(messages.NOTE_PIPELINE_STAGES.format(counts=counts, microbatches=strategy.microbatches))
    return out


def structure_summary(structure: TrainingStructure) -> dict[str, Any]:
    params = structure.params
    blocks = params[params["block"] >= 0]
    return {
        "iterations": len(structure.passes),
        "blocks": structure.n_blocks,
        "allocations_per_block_forward": structure.block_period,
        "blocks_called_from": structure.block_call_site,
        "parameters": len(params),
        "parameter_bytes": int(params["size"].sum()),
        "parameter_bytes_in_blocks": int(blocks["size"].sum()),
        "parameter_bytes_per_block": int(blocks.groupby("block")["size"].sum().max()) if len(blocks) else 0,
        "model_built_before_event": structure.wrap_pos,
        "passes": [
            {
                "forward_from_position": one_pass.forward_start,
                "backward_from_position": one_pass.backward_start,
                "backward_to_position": one_pass.backward_end,
            }
            for one_pass in structure.passes
        ],
    }


def plan_memory(
    frames: SnapshotFrames,
    strategy: Strategy,
    device: int | None = None,
    memory_limit: int | None = None,
    memory_limit_source: str = "",
    spread: Spread = in_turn,
) -> MemoryPlan:
    """Plan ``strategy`` from the recorded run on ``device`` (the first device with a trace by
    default); ``spread``: how its ranks (a pipeline's stages) are built and replayed
    (:mod:`.._jobs`). Raises :class:`PlanUnsupported` when the trace cannot support a plan, ValueError
    for a strategy that makes no sense."""
    resolved = strategy.resolved()
    device_index = _device(frames) if device is None else device
    structure = training_structure(frames, device_index)
    if structure.missing:
        raise PlanUnsupported(list(structure.missing))
    settings = recorded_settings(frames.info.allocator_settings)
    notes: list[str] = list(structure.notes)
    rec_prog, rec_replay = memo(
        frames,
        ("plan.recorded", device_index),
        lambda: _recorded(structure, settings),
    )
    limit, source, is_cap = _limit(
        frames,
        device_index,
        memory_limit,
        memory_limit_source,
        _recorded_reserved_peak(frames, device_index),
    )
    recorded = _rank("recorded run", rec_replay, structure, limit, rec_prog, settings, is_cap)
    ranks = spread(
        [
            functools.partial(_planned_rank, label, build, structure, limit, settings, is_cap)
            for label, build in programs_for(frames, structure, resolved, notes)
        ]
    )
    if structure.ooms:
        notes.append(messages.NOTE_RECORDED_OOM)
    notes.append(
        messages.NOTE_STRUCTURE.format(
            iterations=len(structure.passes),
            n_blocks=structure.n_blocks,
            call_site=structure.block_call_site or "an unnamed site",
        )
    )
    return MemoryPlan(
        device=device_index,
        strategy=resolved,
        recorded=recorded,
        recorded_torch_peaks=_torch_peaks(frames, device_index),
        ranks=tuple(ranks),
        memory_limit_bytes=limit,
        memory_limit_source=source,
        structure=structure_summary(structure),
        assumptions=tuple(dict.fromkeys(notes)),
        events=structure.n_events,
    )


def _stage_program(
    structure: TrainingStructure,
    assignment: pipeline.StageAssignment,
    stage: int,
    stages: int,
    microbatches: int,
    schedule: str,
) -> Program:
    """One pipeline stage's program."""
    return pipeline.StageBuilder(structure, assignment, stage, stages, microbatches, schedule).build()


def _planned_rank(
    label: str,
    build: Callable[[], Program],
    structure: TrainingStructure,
    limit: int | None,
    settings: AllocatorSettings,
    is_cap: bool,
) -> RankPlan:
    """One rank's program built and replayed, and its plan."""
    program = build()
    return _rank(label, replay(program, settings), structure, limit, program, settings, is_cap)


def _recorded(
    structure: TrainingStructure,
    settings: AllocatorSettings,
) -> tuple[Program, Replayed]:
    program = Rewrite.identity(structure, as_recorded=True).build()
    return program, replay(program, settings)


def _device(frames: SnapshotFrames) -> int:
    events = frames.events
    if len(events):
        counts = events["device"].value_counts()
        return int(counts.index[0])
    return int(frames.info.devices[0]) if frames.info.devices else 0


def _limit(
    frames: SnapshotFrames, dev: int, given: int | None, given_source: str, reserved_peak: int
) -> tuple[int | None, str, bool]:
    """The memory each GPU has: ``--memory-limit``; else what the recorded run ran out of (the
    limit the OOM observer saw, or the device's capacity at the OOM, or, under a per-process cap
    the snapshot does not record, read from the bounds the trace sets, labelled inferred); else the
    device's capacity from the capture sidecar."""
    if given is not None:
        return given, given_source or "--memory-limit", False
    from ..allocator.whatif import infer_memory_limit

    inferred = infer_memory_limit(frames, dev, reserved_peak)
    if inferred.bytes is not None:
        return inferred.bytes, inferred.source, inferred.is_cap
    cap = frames.info.capture if isinstance(frames.info.capture, dict) else {}
    totals = cap.get("device_total_bytes")
    if isinstance(totals, dict) and isinstance(totals.get(str(dev)), int):
        return int(totals[str(dev)]), "the device's capacity (capture sidecar)", False
    return None, "none known (give --memory-limit)", False


def _recorded_reserved_peak(frames: SnapshotFrames, dev: int) -> int:
    """The most the recorded run reserved (from its trace, anchored at the dump): before an OOM,
    the smallest per-process cap consistent with it."""
    from ..history.timeline import peak_reserved

    reserved = int(frames.segments.loc[frames.segments["device"] == dev, "total_size_bytes"].sum())
    peak = peak_reserved(frames.events, dev, reserved)
    return peak if peak is not None else reserved


def _torch_peaks(frames: SnapshotFrames, dev: int) -> dict[str, int]:
    cap = frames.info.capture if isinstance(frames.info.capture, dict) else {}
    stats = cap.get("memory_stats")
    if not isinstance(stats, dict):
        return {}
    device_stats = stats.get(str(dev))
    if not isinstance(device_stats, dict):
        return {}
    keys = ("allocated_bytes.all.peak", "reserved_bytes.all.peak")
    return {key: int(device_stats[key]) for key in keys if isinstance(device_stats.get(key), int)}


# --------------------------------------------------------------------------- the usual choices


def usual_strategies(world_size: int, n_blocks: int) -> list[Strategy]:
    """What to compare when no strategy is named."""
    world = world_size
    out = [
        Strategy("ddp", world),
        Strategy("ddp", world, bucket_view=True),
        Strategy("zero1", world),
        Strategy("fsdp", world, reshard_after_forward=False),
        Strategy("fsdp", world),
        Strategy("tp", world),
    ]
    if n_blocks >= world:
        out.append(Strategy("pp", world))
    if world >= 4 and world % 2 == 0:
        out.append(Strategy("fsdp+tp", world, tp=2))
    return out


@dataclass(frozen=True)
class PlanTable:
    world_size: int
    plans: tuple[MemoryPlan, ...]
    # strategy label -> why it could not be planned
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "plans": [plan.to_dict() for plan in self.plans],
            "skipped": self.skipped,
        }


WOULD_IT_FIT_WORLD_SIZES = (2, 4)
# above this, the report plans for 2 GPUs only, without a pipeline
WOULD_IT_FIT_FULL_EVENTS = 200_000


def would_it_fit(frames: SnapshotFrames, device: int) -> list[PlanTable]:
    """The report's table for a snapshot that ran out of memory: the strategies that shard
    or split the model, for 2 and 4 GPUs (for a long trace: 2, and no pipeline). Empty when the
    trace cannot support a plan."""
    structure = training_structure(frames, device)
    if structure.missing:
        return []
    long = structure.n_events > WOULD_IT_FIT_FULL_EVENTS
    sizes = WOULD_IT_FIT_WORLD_SIZES[:1] if long else WOULD_IT_FIT_WORLD_SIZES
    out = []
    for world in sizes:
        choices = [
            Strategy("zero1", world),
            Strategy("fsdp", world, reshard_after_forward=False),
            Strategy("fsdp", world),
            Strategy("tp", world),
        ]
        # a pipeline replays every microbatch: too slow for a report here
        if structure.n_blocks >= world and not long:
            choices.append(Strategy("pp", world))
        out.append(plan_table(frames, world, device, strategies=choices))
    return out


def plan_table(
    frames: SnapshotFrames,
    world_size: int,
    device: int | None = None,
    memory_limit: int | None = None,
    memory_limit_source: str = "",
    strategies: list[Strategy] | None = None,
    spread: Spread = in_turn,
) -> PlanTable:
    """Every usual strategy for ``world_size`` GPUs (or ``strategies``), each plan a replay
    computed by ``spread`` (:mod:`.._jobs`)."""
    device_index = _device(frames) if device is None else device
    structure = training_structure(frames, device_index)
    if structure.missing:
        raise PlanUnsupported(list(structure.missing))
    tried = strategies or usual_strategies(world_size, structure.n_blocks)
    plans = []
    skipped = {}
    jobs = [
        functools.partial(plan_or_why, frames, s, device_index, memory_limit, memory_limit_source, spread)
        for s in tried
    ]
    for strategy, plan in zip(tried, spread(jobs), strict=True):
        if isinstance(plan, str):
            label = strategy.resolved().label() if strategy.name in STRATEGIES else strategy.name
            skipped[label] = plan
        else:
            plans.append(plan)
    return PlanTable(world_size, tuple(plans), skipped)


def plan_or_why(
    frames: SnapshotFrames,
    strategy: Strategy,
    device: int,
    memory_limit: int | None,
    memory_limit_source: str,
    spread: Spread = in_turn,
) -> MemoryPlan | str:
    """One strategy's plan, or why it cannot be planned (:class:`PlanUnsupported`, or a strategy
    that makes no sense)."""
    try:
        return plan_memory(frames, strategy, device, memory_limit, memory_limit_source, spread)
    except (PlanUnsupported, ValueError) as exc:
        return str(exc)
