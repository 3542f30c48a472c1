"""One plan: a strategy, the recorded run rewritten for it, replayed, and what the numbers mean."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ...frames import SnapshotFrames
from .._memo import memo
from ..allocator.model import AllocatorSettings, recorded_settings
from ..categories import CATEGORIES
from . import data_parallel as dp
from . import pipeline as pp
from . import tensor_parallel as tpm
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

NOT_MODELLED = (
    "memory outside PyTorch's caching allocator: the CUDA context, NCCL's own buffers and "
    "communicators, cuBLAS/cuDNN handles made outside it (typically 0.5–2 GiB per GPU): compare "
    "the plan with the device's capacity minus that",
    "compute-communication overlap and timing: the plan follows the recorded order of operations; "
    "a collective that finishes late (or early) shifts when its buffers are freed, which moves "
    "reserved memory more than the allocated peak",
    "tensor parallelism's backward all-reduces (their buffers) and sequence parallelism; "
    "activations are divided between column- and row-parallel layers only",
    "DDP keeping the first iteration's bucket alive into the next iteration (seen in one recorded "
    "run), uneven ZeRO-1 partitions, FSDP's per-parameter padding beyond 1/N, mixed precision "
    "policies and CPU offload",
    "optimizer state that is not a mirror of the parameters (it is scaled like the parameters it mirrors, by size)",
)


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
        s = self
        if name in ALIASES:
            base, reshard = ALIASES[name]
            s = replace(s, reshard_after_forward=reshard if reshard is not None else s.reshard_after_forward)
            name = base
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}: one of {', '.join(STRATEGIES)} (or zero2, zero3)")
        n = s.world_size
        if n < 1:
            raise ValueError("the world size must be at least 1")
        tp = s.tp
        if name == "tp":
            tp = tp or n
            if tp != n:
                raise ValueError(f"tp over {n} GPUs needs --tp {n} (or fsdp+tp for a 2-D mesh)")
        elif name == "fsdp+tp":
            tp = tp or (2 if n % 2 == 0 and n >= 2 else 1)
            if tp < 1 or n % tp:
                raise ValueError(f"--tp {tp} does not divide the world size {n}")
        else:
            tp = 1
        stages = s.stages
        micro = s.microbatches
        schedule = s.schedule.lower().replace("-", "")
        if name == "pp":
            stages = stages or n
            if stages != n:
                raise ValueError(f"pp over {n} GPUs has {n} stages")
            micro = micro or 4 * stages
            if schedule not in pp.SCHEDULES:
                raise ValueError(f"unknown schedule {s.schedule!r}: gpipe or 1f1b")
            if s.pp_split is not None and (len(s.pp_split) != stages or min(s.pp_split) < 1):
                raise ValueError(f"--pp-split needs {stages} block counts of at least 1")
        else:
            stages, micro = 1, 1
        if s.tp_layers not in tpm.TP_LAYERS:
            raise ValueError(f"--tp-layers: one of {', '.join(tpm.TP_LAYERS)}")
        if s.bucket_cap_mb <= 0:
            raise ValueError("--bucket-cap-mb must be positive")
        return replace(s, name=name, tp=tp, stages=stages, microbatches=micro, schedule=schedule)

    @property
    def dp(self) -> int:
        return self.world_size // max(self.tp or 1, 1) // max(self.stages or 1, 1)

    def label(self) -> str:
        n = f"{self.world_size} GPU" + ("s" if self.world_size != 1 else "")
        if self.name == "ddp":
            return f"DDP over {n}" + (", gradient_as_bucket_view" if self.bucket_view else "")
        if self.name == "zero1":
            return f"ZeRO-1 (optimizer state sharded) over {n}"
        if self.name in ("fsdp", "fsdp1"):
            v = "FSDP2" if self.name == "fsdp" else "FSDP1"
            how = (
                ("reshard after forward" if self.reshard_after_forward else "no reshard after forward")
                if self.name == "fsdp"
                else ("FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP")
            )
            zero = "ZeRO-3" if self.reshard_after_forward else "ZeRO-2"
            return f"{v}, {how} ({zero}), over {n}"
        if self.name == "tp":
            return f"tensor parallel, degree {self.tp}"
        if self.name == "pp":
            schedule = self.schedule.upper()
            return f"pipeline, {self.stages} stages, {self.microbatches} microbatches, {schedule}"
        return f"FSDP2 x tensor parallel: {self.dp} x {self.tp} over {n}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pp_split"] = list(self.pp_split) if self.pp_split else None
        d["label"] = self.label()
        return d


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
            "at_peak": [p.to_dict() for p in self.parts],
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
        return max(r.peak_allocated_bytes for r in self.ranks)

    @property
    def peak_reserved_bytes(self) -> int:
        return max(r.peak_reserved_bytes for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        vals = [r.fits for r in self.ranks]
        return None if any(v is None for v in vals) else all(bool(v) for v in vals)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "strategy": self.strategy.to_dict(),
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "fits": self.fits,
            "memory_limit_bytes": self.memory_limit_bytes,
            "memory_limit_source": self.memory_limit_source,
            "ranks": [r.to_dict() for r in self.ranks],
            "recorded": self.recorded.to_dict(),
            "recorded_torch_peaks": self.recorded_torch_peaks,
            "structure": self.structure,
            "assumptions": list(self.assumptions),
            "not_modelled": list(self.not_modelled),
            "events": self.events,
        }


# --------------------------------------------------------------------------- planning


def _moment(s: TrainingStructure, event: int) -> str:
    a = s.allocs
    if not len(a) or event < 0:
        return ""
    p = s.position(event)
    for ps in s.passes:
        if ps.data_start <= p < ps.end:
            it = f"iteration {ps.index + 1}"
            if p < ps.forward_start:
                return f"{it}, before the forward (data, optimizer step)"
            if p < ps.backward_start:
                for j, (lo, hi) in enumerate(ps.block_forward):
                    nxt = ps.block_forward[j + 1][0] if j + 1 < len(ps.block_forward) else hi + 1
                    if lo <= p < nxt:
                        return f"{it}, forward, block {j}"
                if ps.block_forward and p < ps.block_forward[0][0]:
                    return f"{it}, forward, before the blocks (embeddings)"
                return f"{it}, forward, after the blocks (head, loss)"
            if p < ps.backward_end:
                if p <= ps.post_backward[1]:
                    return f"{it}, backward, start (loss, head)"
                for j, (lo, hi) in enumerate(ps.block_backward):
                    if lo <= p <= hi:
                        return f"{it}, backward, block {j}"
                return f"{it}, backward, end (embeddings)"
            return f"{it}, optimizer step"
    return "before the first iteration (model set-up)" if s.passes and p < s.passes[0].forward_start else ""


def _rank(
    label: str,
    r: Replayed,
    s: TrainingStructure,
    limit: int | None,
    prog: Program | None = None,
    settings: AllocatorSettings | None = None,
    limit_is_cap: bool = False,
) -> RankPlan:
    """The plan of one rank; under ``limit``, whether it fits: without releasing anything when
    the peak reserved stays under it, else only if the allocator, replayed under the limit,
    can release cached blocks and retry instead of running out."""
    fits = headroom = None
    note = ""
    if limit is not None:
        headroom = limit - r.peak_reserved_bytes
        fits = headroom >= 0
        if not fits and prog is not None and settings is not None:
            capped = replay(prog, settings, limit, limit_is_cap)
            if capped.oom_at is None:
                fits = True
                headroom = limit - capped.peak_reserved_bytes
                note = (
                    "fits only because the allocator releases cached blocks under the limit (peak "
                    f"reserved {capped.peak_reserved_bytes:,} bytes then): expect cudaMalloc "
                    "retries"
                )
            else:
                note = f"under the limit the replay runs out of memory at recorded event {capped.oom_at:,}"
    return RankPlan(
        label=label,
        peak_allocated_bytes=r.peak_allocated_bytes,
        peak_reserved_bytes=r.peak_reserved_bytes,
        peak_event=r.peak_origin,
        peak_moment=_moment(s, r.peak_origin),
        by_category={c: int(r.by_category.get(c, 0)) for c in CATEGORIES},
        parts=r.parts,
        cuda_malloc_calls=r.cuda_malloc_calls,
        fits=fits,
        headroom_bytes=headroom,
        fits_note=note,
    )


def _local_after_tp(s: TrainingStructure, tp: tpm.TensorParallel | None) -> np.ndarray:
    sizes = s.params["size"].to_numpy().astype(np.int64)
    if tp is None:
        return sizes
    return np.ceil(sizes * tp.param_scale).astype(np.int64)


def programs_for(
    frames: SnapshotFrames, structure: TrainingStructure, strategy: Strategy, notes: list[str]
) -> list[tuple[str, Program]]:
    """The planned program of every distinct rank (one for data/tensor parallelism, one per
    pipeline stage)."""
    if strategy.name == "pp":
        return _pipeline_programs(structure, strategy, notes)
    rewrite = Rewrite.identity(structure)
    tensor_parallel = None
    if strategy.name in ("tp", "fsdp+tp") and (strategy.tp or 1) > 1:
        tensor_parallel = tpm.plan_tensor_parallel(frames, structure, strategy.tp or 1, strategy.tp_layers)
        notes.append(_tensor_parallel_note(tensor_parallel, strategy.tp_layers))
    local = _local_after_tp(structure, tensor_parallel)
    older = np.array(
        [nbytes for nbytes, category, _ in structure.untracked if category == "parameter"],
        dtype=np.int64,
    )
    if not len(structure.params) and older.size:
        notes.append(NOTE_PARAMETERS_BEFORE_TRACE.format(nbytes=int(older.sum())))
    if tensor_parallel is not None:  # under FSDP x TP, FSDP shards the parameters when it wraps
        wrap = strategy.name == "tp" or strategy.dp == 1
        tpm.apply_tensor_parallel(rewrite, tensor_parallel, local, wrap=wrap)
    bucketed = local if len(structure.params) else older
    _apply_data_parallel(rewrite, strategy, local, bucketed, notes)
    if strategy.name not in ("tp", "fsdp+tp") and strategy.name != "pp":
        notes.append("every rank runs the recorded per-rank batch: activations as recorded")
    label = "every rank" if strategy.world_size > 1 else "the one GPU"
    return [(label, rewrite.build())]


NOTE_PARAMETERS_BEFORE_TRACE = (
    "the parameters ({nbytes:,} bytes) were allocated before the trace began: which block each "
    "belongs to is unknown, so FSDP's all-gathers and tensor parallelism's shards of them are "
    "not planned (DDP's buckets are)"
)
TP_LAYERS_NOTE = {
    "blocks": "Linear layers inside the repeated blocks; embeddings, norms and head replicated",
    "all": "every matrix, head and embeddings included",
}


def _tensor_parallel_note(tensor_parallel: tpm.TensorParallel, tp_layers: str) -> str:
    which = TP_LAYERS_NOTE["blocks" if tp_layers == "blocks" else "all"]
    return (
        f"tensor parallelism: {tensor_parallel.column_layers} column- and "
        f"{tensor_parallel.row_layers} row-parallel Linear layers per iteration ({tp_layers}: "
        f"{which})"
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
        dp.apply_ddp(rewrite, strategy.bucket_view, strategy.bucket_cap_mb, bucketed)
    elif name == "zero1":
        label = "DDP (under ZeRO-1)"
        dp.apply_ddp(rewrite, strategy.bucket_view, strategy.bucket_cap_mb, bucketed, label=label)
        dp.apply_zero1(rewrite, strategy.world_size)
        rewrite.untracked = dp.untracked_sharded(("optimizer_state",), strategy.world_size, "ZeRO-1")
    elif name in ("fsdp", "fsdp1", "fsdp+tp"):
        world = strategy.dp if name == "fsdp+tp" else strategy.world_size
        if world <= 1:
            return
        version = 1 if name == "fsdp1" else 2
        units = dp.apply_fsdp(rewrite, world, strategy.reshard_after_forward, version, local)
        rewrite.untracked = dp.untracked_sharded(("parameter", "gradient", "optimizer_state"), world, "FSDP")
        named = ", ".join(unit.name for unit in units) if len(units) <= 4 else f"{units[0].name}, …, {units[-1].name}"
        notes.append(
            f"FSDP units: {len(units)} ({named}): each repeated block one unit, the root (everything else) one more"
        )


def _pipeline_programs(structure: TrainingStructure, strategy: Strategy, notes: list[str]) -> list[tuple[str, Program]]:
    """One program per pipeline stage."""
    stages = strategy.stages or 1
    if structure.n_blocks < stages:
        raise PlanUnsupported(
            [
                f"a pipeline of {strategy.stages} stages needs at least {strategy.stages} repeated "
                f"blocks in the forward pass; the trace shows {structure.n_blocks}"
            ]
        )
    split = strategy.pp_split
    if split is not None and sum(split) != structure.n_blocks:
        raise ValueError(f"--pp-split {','.join(map(str, split))} does not add up to the {structure.n_blocks} blocks")
    assignment = pp.assign_stages(structure, stages, split)
    parts = set(structure.params.loc[structure.params["block"] < 0, "part"].tolist())
    out = []
    for stage in range(stages):
        blocks = [j for j, holder in enumerate(assignment.block_stage) if holder == stage]
        where = f"blocks {blocks[0]}–{blocks[-1]}" if blocks else "no blocks"
        extra = " + the layers before the blocks" if stage == 0 and "pre" in parts else ""
        if stage == stages - 1:
            extra += " + the layers after the blocks and the loss" if "post" in parts else " + the loss"
        builder = pp.StageBuilder(structure, assignment, stage, stages, strategy.microbatches or 1, strategy.schedule)
        program = builder.build()
        out.append((f"stage {stage} (rank {stage}: {where}{extra})", program))
    counts = ", ".join(str(assignment.block_stage.count(stage)) for stage in range(stages))
    notes.append(
        f"pipeline stages: {counts} blocks; microbatches of 1/{strategy.microbatches} of the "
        "recorded batch (activations taken as proportional to it)"
    )
    return out


def structure_summary(s: TrainingStructure) -> dict[str, Any]:
    p = s.params
    blocks = p[p["block"] >= 0]
    return {
        "iterations": len(s.passes),
        "blocks": s.n_blocks,
        "allocations_per_block_forward": s.block_period,
        "blocks_called_from": s.block_call_site,
        "parameters": len(p),
        "parameter_bytes": int(p["size"].sum()),
        "parameter_bytes_in_blocks": int(blocks["size"].sum()),
        "parameter_bytes_per_block": int(blocks.groupby("block")["size"].sum().max()) if len(blocks) else 0,
        "model_built_before_event": s.wrap_pos,
        "passes": [
            {
                "forward_from_position": ps.forward_start,
                "backward_from_position": ps.backward_start,
                "backward_to_position": ps.backward_end,
            }
            for ps in s.passes
        ],
    }


def plan_memory(
    frames: SnapshotFrames,
    strategy: Strategy,
    device: int | None = None,
    memory_limit: int | None = None,
    memory_limit_source: str = "",
) -> MemoryPlan:
    """Plan ``strategy`` from the recorded run on ``device`` (the first device with a trace by
    default). Raises :class:`PlanUnsupported` when the trace cannot support a plan, ValueError
    for a strategy that makes no sense."""
    st = strategy.resolved()
    dev = _device(frames) if device is None else device
    s = training_structure(frames, dev)
    if s.missing:
        raise PlanUnsupported(list(s.missing))
    settings = recorded_settings(frames.info.allocator_settings)
    notes: list[str] = list(s.notes)
    rec_prog, rec_replay = memo(frames, ("plan.recorded", dev), lambda: _recorded(s, settings))
    limit, source, is_cap = _limit(frames, dev, memory_limit, memory_limit_source, _recorded_reserved_peak(frames, dev))
    recorded = _rank("recorded run", rec_replay, s, limit, rec_prog, settings, is_cap)
    ranks = []
    for label, prog in programs_for(frames, s, st, notes):
        ranks.append(_rank(label, replay(prog, settings), s, limit, prog, settings, is_cap))
    if s.ooms:
        notes.append(
            "the recorded run ran out of memory: the plan replays it up to that moment (the "
            "failing request included); what the rest of that iteration would have needed is not "
            "in the trace"
        )
    notes.append(
        f"the structure came from the trace: {len(s.passes)} iterations, {s.n_blocks} repeated "
        f"blocks (called from {s.block_call_site or 'an unnamed site'}), parameters assigned to "
        "blocks by their order"
    )
    return MemoryPlan(
        device=dev,
        strategy=st,
        recorded=recorded,
        recorded_torch_peaks=_torch_peaks(frames, dev),
        ranks=tuple(ranks),
        memory_limit_bytes=limit,
        memory_limit_source=source,
        structure=structure_summary(s),
        assumptions=tuple(dict.fromkeys(notes)),
        events=s.n_events,
    )


def _recorded(s: TrainingStructure, settings: AllocatorSettings) -> tuple[Program, Replayed]:
    prog = Rewrite.identity(s, as_recorded=True).build()
    return prog, replay(prog, settings)


def _device(frames: SnapshotFrames) -> int:
    ev = frames.events
    if len(ev):
        counts = ev["device"].value_counts()
        return int(counts.index[0])
    return int(frames.info.devices[0]) if frames.info.devices else 0


def _limit(
    frames: SnapshotFrames, dev: int, given: int | None, given_source: str, reserved_peak: int
) -> tuple[int | None, str, bool]:
    """The memory each GPU has: ``--memory-limit``; else what the recorded run ran out of (the
    limit the OOM observer saw, or the device's capacity at the OOM, or, under a per-process cap
    the snapshot does not record, the peak reserved before the OOM, labelled inferred); else the
    device's capacity from the capture sidecar."""
    if given is not None:
        return given, given_source or "--memory-limit", False
    from ..allocator.whatif import infer_memory_limit

    ml = infer_memory_limit(frames, dev, reserved_peak)
    if ml.bytes is not None:
        return ml.bytes, ml.source, ml.is_cap
    cap = frames.info.capture if isinstance(frames.info.capture, dict) else {}
    totals = cap.get("device_total_bytes")
    if isinstance(totals, dict) and isinstance(totals.get(str(dev)), int):
        return int(totals[str(dev)]), "the device's capacity (capture sidecar)", False
    return None, "none known (give --memory-limit)", False


def _recorded_reserved_peak(frames: SnapshotFrames, dev: int) -> int:
    """The most the recorded run reserved (from its trace, anchored at the dump): before an OOM,
    the smallest per-process cap consistent with it."""
    from ..history.timeline import compute_timeline

    seg = frames.segments[frames.segments["device"] == dev]
    blk = frames.blocks[(frames.blocks["device"] == dev) & (frames.blocks["state"] != "inactive")]
    requested = int(blk["requested_size_bytes"].fillna(0).sum())
    tl = compute_timeline(frames.events, dev, requested, int(seg["total_size_bytes"].sum()))
    return tl.peak_reserved_bytes if tl is not None else int(seg["total_size_bytes"].sum())


def _torch_peaks(frames: SnapshotFrames, dev: int) -> dict[str, int]:
    cap = frames.info.capture if isinstance(frames.info.capture, dict) else {}
    stats = cap.get("memory_stats")
    if not isinstance(stats, dict):
        return {}
    d = stats.get(str(dev))
    if not isinstance(d, dict):
        return {}
    return {k: int(d[k]) for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak") if isinstance(d.get(k), int)}


# --------------------------------------------------------------------------- the usual choices


def usual_strategies(world_size: int, n_blocks: int) -> list[Strategy]:
    """What to compare when no strategy is named."""
    n = world_size
    out = [
        Strategy("ddp", n),
        Strategy("ddp", n, bucket_view=True),
        Strategy("zero1", n),
        Strategy("fsdp", n, reshard_after_forward=False),
        Strategy("fsdp", n),
        Strategy("tp", n),
    ]
    if n_blocks >= n:
        out.append(Strategy("pp", n))
    if n >= 4 and n % 2 == 0:
        out.append(Strategy("fsdp+tp", n, tp=2))
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
            "plans": [p.to_dict() for p in self.plans],
            "skipped": self.skipped,
        }


WOULD_IT_FIT_WORLD_SIZES = (2, 4)
# above this, the report plans for 2 GPUs only, without a pipeline
WOULD_IT_FIT_FULL_EVENTS = 200_000


def would_it_fit(frames: SnapshotFrames, device: int) -> list[PlanTable]:
    """The report's table for a snapshot that ran out of memory: the strategies that shard
    or split the model, for 2 and 4 GPUs (for a long trace: 2, and no pipeline). Empty when the
    trace cannot support a plan."""
    s = training_structure(frames, device)
    if s.missing:
        return []
    long = s.n_events > WOULD_IT_FIT_FULL_EVENTS
    sizes = WOULD_IT_FIT_WORLD_SIZES[:1] if long else WOULD_IT_FIT_WORLD_SIZES
    out = []
    for n in sizes:
        choices = [
            Strategy("zero1", n),
            Strategy("fsdp", n, reshard_after_forward=False),
            Strategy("fsdp", n),
            Strategy("tp", n),
        ]
        # a pipeline replays every microbatch: too slow for a report here
        if s.n_blocks >= n and not long:
            choices.append(Strategy("pp", n))
        out.append(plan_table(frames, n, device, strategies=choices))
    return out


def plan_table(
    frames: SnapshotFrames,
    world_size: int,
    device: int | None = None,
    memory_limit: int | None = None,
    memory_limit_source: str = "",
    strategies: list[Strategy] | None = None,
) -> PlanTable:
    """Every usual strategy for ``world_size`` GPUs (or ``strategies``)."""
    dev = _device(frames) if device is None else device
    s = training_structure(frames, dev)
    if s.missing:
        raise PlanUnsupported(list(s.missing))
    plans = []
    skipped = {}
    for st in strategies or usual_strategies(world_size, s.n_blocks):
        try:
            plans.append(plan_memory(frames, st, dev, memory_limit, memory_limit_source))
        except (PlanUnsupported, ValueError) as exc:
            skipped[st.resolved().label() if st.name in STRATEGIES else st.name] = str(exc)
    return PlanTable(world_size, tuple(plans), skipped)
