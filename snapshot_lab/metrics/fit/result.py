"""The answer: the step under the levers asked for, and per lever the largest batch that fits."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ...frames import SnapshotFrames
from .._jobs import Spread, in_turn
from .._memo import memo
from ..allocator.model import AllocatorSettings, recorded_settings
from ..allocator.whatif import quick_grid, settings_label
from ..plan.planner import _device, _limit, _recorded_reserved_peak
from ..plan.structure import forget_structure, training_structure
from . import levers as lv
from . import workload as wl
from .evidence import StepEvidence
from .model import NO_CHECKPOINTING_AGAIN, NO_LEVER_COMPILED, FitUnsupported, recorded_batch_bytes, step_evidence
from .precision import NO_BF16
from .search import FRACTION_STEPS, LONG_TAPE_ROWS, PeakCurve, largest_batch, largest_batch_no_retry
from .strategies import StrategyOutcome, parallel_strategies
from .tape import Tape, forget_order, peak_allocated, simulate

AS_RECORDED = "as recorded"
# the levers the one-line answer names (report's first screen, the headline of `snaplab fit`)
HEADLINE_LEVERS = (AS_RECORDED, "bf16", "checkpointing", "checkpointing+bf16")
ASSUMPTIONS = {
    AS_RECORDED: "the step as the trace shows it, only the batch changed: inputs and what the forward and backward "
    "make scale with it, parameters, gradients, optimizer state and workspaces do not",
    "checkpointing": "activation checkpointing of every repeated block (torch.utils.checkpoint, non-reentrant): each "
    "block keeps its input, re-runs its forward just before its backward",
    "bf16": "torch.autocast(dtype=torch.bfloat16), float32 parameters: what matrix multiplies (Linear, convolution, "
    "attention) and the modules after them make halves; softmax, norms, losses and the model's own arithmetic stay "
    "float32 (a layer saves a bfloat16 copy of its float32 input, the multiply after a softmax one of the softmax's "
    "result beside it), gradients take their tensor's dtype, inputs "
    "stay; a bfloat16 copy of every Linear and convolution weight lives from its forward to its backward",
    "checkpointing+bf16": "both: checkpointing of every repeated block under bf16 autocast",
    "sgd-momentum": "torch.optim.SGD with momentum instead: one state tensor per parameter (P)",
    "8-bit adam": "bitsandbytes 8-bit AdamW instead: two 1-byte states per parameter element (0.5 P)",
    "adafactor": "Adafactor instead: factored second moments, no momentum (about 0.02 P)",
    "optimizer offload": "optimizer state and step on the CPU (ZeRO-Offload style): no optimizer state on the GPU, "
    "gradients still made there",
    "gradient accumulation": "the batch split into micro-batches whose gradients are summed before one step: the step "
    "needs what one micro-batch needs, so any batch runs as enough micro-batches of the largest that fits as recorded",
}
ALLOCATOR_PREFIX = "PYTORCH_CUDA_ALLOC_CONF="
ALLOCATOR_ASSUMPTION = (
    ALLOCATOR_PREFIX + "{conf} (an alternative snaplab whatif tries): the step as recorded, laid out by the "
    "allocator under these settings"
)
LONG_TAPE_NOTE = (
    "the step has {rows:,} allocations: the largest batches are bounded by the peak allocated only, without "
    "replaying the allocator for each (fragmentation can make them a little smaller)"
)
OPTIMIZER_SWAPS = ("sgd-momentum", "8-bit adam", "adafactor")
# the levers that rewrite the recorded step (levers.py). How the allocator lays out a step it never
# ran is only as good as the order the rewrite guesses: over docs/fit.md's table, their capped
# replay's largest batch was below the real one in 74 of 184 answers and above it in 67. Their range
# ends where the step's tensors alone, packed without a gap, reach the limit
# (``largest_batch_at_most``): at or above the real largest batch in 170 of the 184 (110 before).
REWRITTEN = frozenset({"checkpointing", "bf16", "checkpointing+bf16"})
OFFLOAD = "optimizer offload"
ACCUMULATION = "gradient accumulation"


@dataclass(frozen=True)
class LeverOutcome:
    lever: str
    assumption: str
    peak_allocated_bytes: int  # of the whole step at the batch asked for
    peak_reserved_bytes: int
    largest_batch: float | None  # samples (with the recorded batch) or a fraction of the recorded batch
    fits: bool | None = None  # at the batch asked for, under the limit
    # the largest batch whose step never reaches the limit (search.largest_batch_no_retry): up to
    # it the step fits whatever the process did before, above it as fragmentation allows
    largest_batch_no_retry: float | None = None
    # a lever that rewrites the step (REWRITTEN): the largest batch whose tensors alone stay within
    # the limit, where that is above ``largest_batch``; the top of its range (None: the range ends at
    # ``largest_batch``)
    largest_batch_at_most: float | None = None

    @property
    def batch_range(self) -> tuple[float | None, float | None]:
        """The largest batch as a range: from the one that never reaches the limit to the most it
        can be (both None without a limit)."""
        top = self.largest_batch if self.largest_batch_at_most is None else self.largest_batch_at_most
        return (top if self.largest_batch_no_retry is None else self.largest_batch_no_retry), top

    def to_dict(self) -> dict[str, Any]:
        return {
            "lever": self.lever,
            "assumption": self.assumption,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "largest_batch": self.largest_batch,
            "largest_batch_no_retry": self.largest_batch_no_retry,
            "largest_batch_at_most": self.largest_batch_at_most,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class FitResult:
    device: int
    recorded_batch: int | None
    batch_scale: float
    checkpointing: bool
    bf16: bool
    peak_allocated_bytes: int  # the whole step with the levers asked for
    peak_reserved_bytes: int
    memory_limit_bytes: int | None
    memory_limit_source: str
    complete: bool  # a whole step was recorded (else extrapolated from a forward that ran out of memory)
    optimizer: str
    optimizer_source: str
    breakdown: dict[str, int]
    levers: tuple[LeverOutcome, ...]
    notes: tuple[str, ...] = field(default=())
    # planned at the recorded batch by snaplab plan under the memory limit, least change first
    parallel_strategies: tuple[StrategyOutcome, ...] = field(default=())
    parallel_refused: dict[str, str] = field(default_factory=dict)  # label ("all": every one) -> why
    workload: str = ""  # what the trace recorded (workload.KINDS): a training step, forward passes only...
    # the request the recorded run ran out of memory on, where it alone is larger than the memory
    # limit: no batch or lever makes it fit, and no recorded step made it (None: no such request)
    oom_request_over_limit: int | None = None

    @property
    def batch(self) -> float | None:
        return None if self.recorded_batch is None else self.recorded_batch * self.batch_scale

    @property
    def largest_batch(self) -> dict[str, float | None]:
        return {o.lever: o.largest_batch for o in self.levers}

    @property
    def largest_batch_no_retry(self) -> dict[str, float | None]:
        return {o.lever: o.largest_batch_no_retry for o in self.levers}

    @property
    def largest_batch_at_most(self) -> dict[str, float | None]:
        return {o.lever: o.largest_batch_at_most for o in self.levers}

    @property
    def batch_range(self) -> dict[str, tuple[float | None, float | None]]:
        """Per lever, the largest batch as a range (:attr:`LeverOutcome.batch_range`)."""
        return {o.lever: o.batch_range for o in self.levers}

    @property
    def ways_to_fit(self) -> list[dict[str, str]]:
        """What makes the step fit, least change to the job first: the allocator's settings (no
        code changed), then the levers (at the batch asked for), then more GPUs (at the recorded
        batch: per strategy, the fewest GPUs that fit). None where the job fits as recorded at the
        batch asked for: there is nothing to change."""
        if any(o.lever == AS_RECORDED and o.fits for o in self.levers):
            return []
        confs = [o for o in self.levers if o.assumption.startswith(ALLOCATOR_PREFIX)]
        levers = [o for o in self.levers if o not in confs and o.lever != AS_RECORDED]
        out = [{"kind": "allocator settings", "label": o.lever} for o in confs if o.fits]
        out += [{"kind": "lever", "label": o.lever} for o in levers if o.fits]
        seen: set[str] = set()
        for p in self.parallel_strategies:
            if p.fits and p.strategy not in seen:
                seen.add(p.strategy)
                out.append({"kind": "parallel strategy", "label": p.label})
        return out

    @property
    def accumulation(self) -> dict[str, float | int | None]:
        """Gradient accumulation: micro-batches of the largest batch that fits as recorded, as
        many as the batch asked for needs (none for forward passes only: no gradients to sum)."""
        if self.workload == wl.FORWARD_ONLY:
            return {"micro_batch": None, "accumulation_steps": None}
        micro = self.largest_batch.get(AS_RECORDED)
        wanted = self.batch if self.batch is not None else self.batch_scale
        steps = -(-round(wanted * 100) // round(micro * 100)) if micro else None
        return {"micro_batch": micro, "accumulation_steps": steps}

    @property
    def _accumulation_assumption(self) -> str:
        return wl.INFERENCE_OPTIMIZER_SOURCE if self.workload == wl.FORWARD_ONLY else ASSUMPTIONS[ACCUMULATION]

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "recorded_batch": self.recorded_batch,
            "batch_scale": self.batch_scale,
            "batch": self.batch,
            "checkpointing": self.checkpointing,
            "bf16": self.bf16,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "memory_limit_bytes": self.memory_limit_bytes,
            "memory_limit_source": self.memory_limit_source,
            "whole_step_recorded": self.complete,
            "optimizer": self.optimizer,
            "optimizer_source": self.optimizer_source,
            "breakdown": self.breakdown,
            "largest_batch": self.largest_batch,
            "largest_batch_no_retry": self.largest_batch_no_retry,
            "largest_batch_at_most": self.largest_batch_at_most,
            "gradient_accumulation": {**self.accumulation, "assumption": self._accumulation_assumption},
            "levers": [o.to_dict() for o in self.levers],
            "parallel_strategies": [p.to_dict() for p in self.parallel_strategies],
            "parallel_strategies_refused": self.parallel_refused,
            "ways_to_fit": self.ways_to_fit,
            "notes": list(self.notes),
            "workload": self.workload,
            "oom_request_over_limit_bytes": self.oom_request_over_limit,
        }


def lever_tapes(ev: StepEvidence) -> dict[str, Callable[[], Tape]]:
    """Every lever that makes sense for this step, as a way to build its tape."""
    t = ev.tape
    out: dict[str, Callable[[], Tape]] = {AS_RECORDED: lambda: t}
    checkpointed: list[Tape] = []  # built once for both levers that checkpoint

    def checkpoint() -> Tape:
        if not checkpointed:
            checkpointed.append(_checkpointed(ev))
        return checkpointed[0]

    def checkpoint_bf16() -> Tape:
        tape = checkpoint()
        checkpointed.clear()  # the last to read it (:func:`_lever_outcomes` builds it after "checkpointing")
        forget_order(tape)  # the bf16 tape has rows of its own: 36 MiB at 5M entries, dropped before it is made
        return lv.bf16_autocast(tape, ev, checkpointed=True)

    can_checkpoint = bool(ev.blocks) and not ev.checkpointed and not ev.compiled
    if can_checkpoint:
        out["checkpointing"] = checkpoint
    if not ev.half_precision and not ev.compiled:
        out["bf16"] = lambda: lv.bf16_autocast(t, ev)
    if can_checkpoint and not ev.half_precision:
        out["checkpointing+bf16"] = checkpoint_bf16
    for name in OPTIMIZER_SWAPS:
        if name != ev.optimizer and lv.OPTIMIZER_STATE_RATIO.get(ev.optimizer, 0.0) > 0:
            out[name] = lambda name=name: lv.swap_optimizer(t, ev, name)  # type: ignore[misc]
    if lv.OPTIMIZER_STATE_RATIO.get(ev.optimizer, 0.0) > 0:
        out[OFFLOAD] = lambda: lv.swap_optimizer(t, ev, "offload")
    return out


def _lever_outcomes(
    ev: StepEvidence,
    search: _Search,
    levers: Collection[str] | None,
    settings: list[tuple[str, AllocatorSettings]],
    spread: Spread = in_turn,
) -> list[LeverOutcome]:
    """Each lever's outcome (``levers``: only these), in :func:`lever_tapes`' order, the step as
    recorded under each of ``settings`` (label, allocator settings) after the first: each a replay
    of the step, computed by ``spread`` (:mod:`.._jobs`). In one process the two
    that checkpoint come one after the other, so that the checkpointed tape they share is dropped
    before the next lever's tape is made (at 5M trace entries, 130 MiB of fit's peak)."""
    builders = {name: build for name, build in lever_tapes(ev).items() if levers is None or name in levers}
    order = sorted(builders, key=lambda name: name.startswith("checkpointing"))

    def lever(name: str) -> Callable[[], LeverOutcome]:
        return lambda: search.outcome(name, wl.assumption(ev, name, ASSUMPTIONS[name]), builders[name]())

    def setting(conf: str, alt: AllocatorSettings) -> Callable[[], LeverOutcome]:
        return lambda: search.outcome(conf, ALLOCATOR_ASSUMPTION.format(conf=conf), ev.tape, alt)

    done = spread([*map(lever, order), *(setting(conf, alt) for conf, alt in settings)])
    by_lever = dict(zip(order, done, strict=False))  # done: the levers', then the settings'
    outcomes = [by_lever[name] for name in builders]
    outcomes[1:1] = done[len(order) :]
    return outcomes


def _checkpointed(ev: StepEvidence) -> Tape:
    """The step's tape under activation checkpointing (the one place it is built)."""
    return lv.checkpoint(ev.tape, ev.blocks, ev.frozen_join_when_checkpointed)


def requested_tape(ev: StepEvidence, checkpointing: bool, bf16: bool) -> Tape:
    tape = ev.tape
    if ev.compiled and (checkpointing or bf16):
        raise FitUnsupported(NO_LEVER_COMPILED)
    if checkpointing:
        if wl.is_forward_only(ev):
            raise FitUnsupported(wl.NO_CHECKPOINTING)
        if not ev.blocks:
            raise FitUnsupported("checkpointing needs repeated blocks, and the trace shows none")
        if ev.checkpointed:
            raise FitUnsupported(NO_CHECKPOINTING_AGAIN)
        tape = _checkpointed(ev)
    if bf16 and ev.half_precision:
        raise FitUnsupported(NO_BF16)
    return lv.bf16_autocast(tape, ev, checkpointed=checkpointing) if bf16 else tape


def predict_step(
    frames: SnapshotFrames,
    *,
    batch_scale: float = 1.0,
    checkpointing: bool = False,
    bf16: bool = False,
    optimizer: str | None = None,
    device: int | None = None,
) -> tuple[int, int]:
    """Peak allocated and reserved bytes of one whole step at ``batch_scale`` times the recorded
    batch under the levers asked for (no limit, nothing searched)."""
    dev = _device(frames) if device is None else device
    ev = step_evidence(frames, dev, optimizer)
    sim = simulate(
        requested_tape(ev, checkpointing, bf16), batch_scale, recorded_settings(frames.info.allocator_settings)
    )
    return sim.peak_allocated_bytes, sim.peak_reserved_bytes


def step_peak_allocated(frames: SnapshotFrames, device: int) -> int | None:
    """Most bytes one whole step at the recorded batch holds at once on ``device``, in fit's
    model of the step (what the trace shows, the rest of a step cut short by an out-of-memory
    error extrapolated), with no allocator replay: what no allocator setting can pack tighter.
    None where the trace shows no step to build on. Computed once per device (two findings ask)."""

    def peak() -> int | None:
        try:
            return peak_allocated(step_evidence(frames, device).tape, 1.0)
        except FitUnsupported:
            return None

    return memo(frames, ("fit.step_peak_allocated", device), peak)


@dataclass(frozen=True)
class _Search:
    settings: AllocatorSettings
    limit: int | None
    batch_scale: float
    recorded_batch: int | None

    def outcome(
        self, name: str, assumption: str, tape: Tape, settings: AllocatorSettings | None = None
    ) -> LeverOutcome:
        """The step at the batch asked for, and the largest batch under the limit."""
        st = settings or self.settings
        at = simulate(tape, self.batch_scale, st)
        fits = found = sure = most = None
        if self.limit is not None:
            clear = at.peak_reserved_bytes <= self.limit
            fits = clear or bool(simulate(tape, self.batch_scale, st, self.limit).fits)
            units = self.recorded_batch or FRACTION_STEPS
            asked = int(self.batch_scale * units + 1e-9)
            bound = PeakCurve(tape).largest(units, self.limit)
            best = largest_batch(tape, units, st, self.limit, asked if fits else 0, bound)  # it runs: not below it
            below = largest_batch_no_retry(tape, units, st, self.limit, best)
            if below is not None:
                sure = self._batches(max(below, asked) if clear else below)
            found = self._batches(best)
            most = self._batches(bound) if name in REWRITTEN and bound > best else None
        return LeverOutcome(name, assumption, at.peak_allocated_bytes, at.peak_reserved_bytes, found, fits, sure, most)

    def _batches(self, units: int) -> float:
        """A batch found in units: samples with the recorded batch, else a fraction of it."""
        return float(units) if self.recorded_batch else round(units / FRACTION_STEPS, 2)


OOM_OVER_LIMIT_NOTE = (
    "the recorded run ran out of memory on a request of {request:,} bytes, alone more than the memory limit "
    "({limit:,} bytes): no batch size or lever makes it fit and no recorded step made it; it is the code that asked "
    "for it (the out-of-memory error's stack) that must change"
)


def _breakdown(ev: StepEvidence, recorded_batch: int | None) -> dict[str, int]:
    by = recorded_batch_bytes(ev)
    acts = by.pop("activations")
    return {
        "parameters_bytes": by["parameter"],
        "gradients_bytes": by["gradient"],
        "optimizer_state_bytes": by["optimizer_state"],
        "activations_per_sample_bytes" if recorded_batch else "activations_at_recorded_batch_bytes": (
            acts // recorded_batch if recorded_batch else acts
        ),
        "workspaces_bytes": by["workspaces"],
        # part of the activations: a transformers KV cache's keys and values alive at the peak
        **({"kv_cache_at_peak_bytes": by["kv_cache"]} if by["kv_cache"] else {}),
    }


def compute_fit(
    frames: SnapshotFrames,
    *,
    memory_limit: int | None = None,
    recorded_batch: int | None = None,
    batch_scale: float = 1.0,
    checkpointing: bool = False,
    bf16: bool = False,
    optimizer: str | None = None,
    device: int | None = None,
    parallel: bool | None = None,
    levers: Collection[str] | None = None,
    keep_structure: bool = True,
    spread: Spread = in_turn,
) -> FitResult:
    """The whole step under the levers asked for and, under the memory limit (given, or the one
    the recorded run ran out of, or the device's capacity), the largest batch per lever and
    (``parallel``; by default when a memory limit is given) the parallel strategies planned at
    the recorded batch. ``levers``: only these (each replay of a long trace costs seconds; the
    report's first screen needs :data:`HEADLINE_LEVERS` alone), without the allocator settings.
    ``keep_structure=False``: the training structure is dropped once the step's evidence is
    built, before the levers' tapes are (where no strategy is planned; for a caller that reads it
    no more: the report's answer, whose peak it lowers by its size). ``spread``: how the levers'
    replays and the strategies' plans are computed (:mod:`.._jobs`: in turn, or over the CPUs). Raises
    :class:`~.model.FitUnsupported` when the trace shows no step to build on."""
    if optimizer is not None and optimizer not in lv.OPTIMIZER_STATE_RATIO:
        raise ValueError(f"unknown optimizer {optimizer!r}: one of {', '.join(lv.OPTIMIZER_STATE_RATIO)}")
    dev = _device(frames) if device is None else device
    ev = step_evidence(frames, dev, optimizer)
    work = wl.workload(frames, training_structure(frames, dev))
    plans = parallel if parallel is not None else memory_limit is not None
    if not keep_structure and not plans:
        forget_structure(frames, dev)  # its pages back to the system before the levers' tapes are made
    settings = recorded_settings(frames.info.allocator_settings)
    limit, source, _ = _limit(
        frames, dev, memory_limit, "given" if memory_limit else "", _recorded_reserved_peak(frames, dev)
    )
    asked = simulate(requested_tape(ev, checkpointing, bf16), batch_scale, settings)
    search = _Search(settings, limit, batch_scale, recorded_batch)
    confs = []
    if limit is not None and levers is None:  # the allocator's settings: the same step, less fragmentation
        confs = [(settings_label(alt.describe()), alt) for alt in quick_grid(settings, limit)]
    outcomes = _lever_outcomes(ev, search, levers, confs, spread)
    notes = [*ev.notes, f"optimizer: {ev.optimizer} ({ev.optimizer_source})"]
    if limit is not None and len(ev.tape) > LONG_TAPE_ROWS:
        notes.append(LONG_TAPE_NOTE.format(rows=len(ev.tape)))
    over = work.oom_request if limit is not None and work.oom_request is not None and work.oom_request > limit else None
    if over is not None:
        notes.append(OOM_OVER_LIMIT_NOTE.format(request=over, limit=limit))
    planned: tuple[StrategyOutcome, ...] = ()
    refused: dict[str, str] = {}
    if limit is not None and plans:
        planned, refused = parallel_strategies(frames, dev, limit, ev.complete, spread)
    return FitResult(
        device=dev,
        recorded_batch=recorded_batch,
        batch_scale=batch_scale,
        checkpointing=checkpointing,
        bf16=bf16,
        peak_allocated_bytes=asked.peak_allocated_bytes,
        peak_reserved_bytes=asked.peak_reserved_bytes,
        memory_limit_bytes=limit,
        memory_limit_source=source,
        complete=ev.complete,
        optimizer=ev.optimizer,
        optimizer_source=ev.optimizer_source,
        breakdown=_breakdown(ev, recorded_batch),
        levers=tuple(outcomes),
        notes=tuple(notes),
        parallel_strategies=planned,
        parallel_refused=refused,
        workload=wl.FORWARD_ONLY if wl.is_forward_only(ev) else work.kind,  # an inference forward extrapolated
        oom_request_over_limit=over,
    )
