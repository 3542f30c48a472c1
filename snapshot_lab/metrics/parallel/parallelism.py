"""Which parallel training strategy a snapshot came from, where its rank sits in the job's
layout, and which ranks should look alike (``ranks``).

The layout comes from the capture sidecar's ``"parallel"`` key (``snaplab run`` records the
degrees and this rank's coordinates, see :mod:`snapshot_lab.capture`) or, without one, from the
file name (``pp1``, ``stage1``, ``tp0``, ``dp3``...). The strategies come from the sidecar and
from the allocation stacks, whose library frames show what ran in the process even without a
sidecar: DistributedDataParallel, FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``),
DTensor tensor parallelism, ``torch.distributed.pipelining``, ``nn.DataParallel``.

Ranks of one pipeline stage are peers: data parallel replicas, FSDP shards and tensor-parallel
peers of a stage hold the same amounts, so a rank is compared with them; different stages hold
different layers and different numbers of microbatches in flight, so stages are compared with
each other as the pipeline's skew.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from ...frames import SnapshotFrames
from .._memo import memo
from .filenames import slashed_filenames
from .schedule import PIPELINING_FILES, schedule_from_trace

KINDS = ("pp", "tp", "dp", "fsdp", "cp", "ep")

LayoutSource = Literal["sidecar", "file name", "stacks", "none"]

# strategy -> path fragments of the library's Python files
_STACK_MARKS: dict[str, tuple[str, ...]] = {
    "ddp": ("torch/nn/parallel/distributed.py",),
    "fsdp2": ("torch/distributed/fsdp/_fully_shard/",),
    "fsdp1": ("torch/distributed/fsdp/_flat_param.py", "torch/distributed/fsdp/fully_sharded_data_parallel.py"),
    "tp": ("torch/distributed/tensor/parallel/", "torch/distributed/tensor/placement_types.py"),
    "pp": ("torch/distributed/pipelining/",),
    "dataparallel": ("torch/nn/parallel/data_parallel.py",),
}
STRATEGY_NAMES = {
    "ddp": "DistributedDataParallel",
    "fsdp2": "FSDP2 (fully_shard)",
    "fsdp1": "FSDP1 (FullyShardedDataParallel)",
    "tp": "tensor parallel (DTensor)",
    "pp": "pipeline parallel (torch.distributed.pipelining)",
    "dataparallel": "nn.DataParallel",
}

# the spellings a file name uses for a coordinate: pp1, pp_1, pp-rank1, stage1, pipe1, tp0,
# tp_rank0, dp3, cp1, ep2. The token must stand on its own ('fsdp2' names FSDP's version, and
# 'pp_1f1b' a schedule), so neither a letter or digit before it nor after its number.
_NAME_TOKEN = re.compile(
    r"(?<![A-Za-z0-9])(pp|stage|pipe|tp|dp|cp|ep)[_-]?(?:rank[_-]?)?(\d{1,6})(?![A-Za-z0-9])", re.IGNORECASE
)
_NAME_KIND = {"pp": "pp", "stage": "pp", "pipe": "pp", "tp": "tp", "dp": "dp", "cp": "cp", "ep": "ep"}


@dataclass(frozen=True)
class ParallelLayout:
    """One rank's place in the layout: its coordinates (``{"pp": 1, "tp": 0, ...}``, only those
    known), the degrees when known, and the pipeline's schedule and microbatches. Small and
    picklable: it travels inside :class:`~snapshot_lab.metrics.comparison.compare.SnapshotSummary`."""

    source: LayoutSource
    coordinates: dict[str, int] = field(default_factory=dict)
    degrees: dict[str, int] = field(default_factory=dict)
    # keys of STRATEGY_NAMES once detected
    strategies: list[str] = field(default_factory=list)
    world_size: int | None = None
    num_stages: int | None = None
    schedule: str | None = None
    microbatches: int | None = None
    rank: int | None = None
    # the strategies the stacks showed
    from_stacks: list[str] = field(default_factory=list)

    @property
    def pp_stage(self) -> int | None:
        return self.coordinates.get("pp")

    @property
    def description(self) -> str:
        known = [name for name in self.strategies if name in STRATEGY_NAMES]
        if not known:
            return "single process, no parallel training library seen"
        names = " + ".join(STRATEGY_NAMES[strategy] for strategy in known)
        if self.world_size and self.rank is not None:
            return f"{names}, rank {self.rank} of {self.world_size}"
        return names

    def to_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["description"] = self.description
        return fields


def _int(value: Any) -> int | None:
    # JSON from a file: bool is an int to Python, and neither it nor a float is a coordinate
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return value if is_int and 0 <= value < 1 << 31 else None


def _text(value: Any, limit: int = 40) -> str | None:
    """A short printable string (sidecars are files anyone can edit: these go into one-line
    messages and HTML)."""
    if not isinstance(value, str) or not value.strip():
        return None
    shown = (char if char.isprintable() and not char.isspace() else "-" for char in value.strip())
    return "".join(shown)[:limit]


def layout_from_sidecar(capture: Mapping[str, Any] | None) -> ParallelLayout | None:
    """The layout the capture sidecar records (None for an old sidecar without ``"parallel"``,
    one whose detection failed, or one that says nothing about coordinates or a pipeline)."""
    par = capture.get("parallel") if isinstance(capture, Mapping) else None
    if not isinstance(par, Mapping):
        return None

    def mapping(key: str) -> Mapping[str, Any]:
        value = par.get(key)
        return value if isinstance(value, Mapping) else {}

    degrees_in, coords_in, pp_in = mapping("degrees"), mapping("coordinates"), mapping("pp")
    given_degrees = {kind: _int(degrees_in.get(kind)) for kind in KINDS}
    degrees = {kind: degree for kind, degree in given_degrees.items() if degree is not None and degree >= 1}
    given_coords = {kind: _int(coords_in.get(kind)) for kind in KINDS}
    coords = {kind: coordinate for kind, coordinate in given_coords.items() if coordinate is not None}
    stage = _int(pp_in.get("stage"))
    if stage is not None:
        coords.setdefault("pp", stage)
    num_stages = _int(pp_in.get("num_stages")) or degrees.get("pp")
    if not coords and not pp_in:
        return None
    listed = par.get("strategies")
    strategies: list[Any] = listed if isinstance(listed, list) else []
    return ParallelLayout(
        source="sidecar",
        coordinates=coords,
        degrees=degrees,
        strategies=[text for strategy in strategies[:16] if (text := _text(strategy)) is not None],
        world_size=_int(par.get("world_size")),
        num_stages=num_stages if num_stages and num_stages >= 1 else None,
        schedule=_text(pp_in.get("schedule")),
        microbatches=_int(pp_in.get("microbatches")) or None,
    )


def layout_from_name(path: str) -> ParallelLayout | None:
    """Coordinates spelled in a file's name (``job_pp1_tp0_rank3.pickle``: pp 1, tp 0); the last
    spelling of a kind wins, as for ``rank<N>``. None when the name has none."""
    name = path.replace("\\", "/").split("/")[-1]
    coords: dict[str, int] = {}
    for match in _NAME_TOKEN.finditer(name):
        coords[_NAME_KIND[match.group(1).lower()]] = int(match.group(2))
    return ParallelLayout(source="file name", coordinates=coords) if coords else None


def pipeline_stages(layouts: Mapping[str, ParallelLayout | None]) -> dict[str, int | None] | None:
    """Each file's pipeline stage when the files span at least two stages (files whose stage is
    unknown map to None); None when there is no pipeline to speak of, and every file is a peer
    of every other."""
    stage = {path: (lay.pp_stage if lay is not None else None) for path, lay in layouts.items()}
    if len({known for known in stage.values() if known is not None}) < 2:
        return None
    return stage


def group_label(stage: int | None, inferred: bool = False) -> str:
    if stage is None:
        return "pp stage unknown"
    if inferred:
        return (
            "pp last stage (inferred from the stacks)" if stage == 1 else "pp earlier stage (inferred from the stacks)"
        )
    return f"pp stage {stage}"


# torch.distributed.pipelining's functions that only the last stage runs: it computes the loss
LAST_STAGE_FUNCTIONS = frozenset({"_maybe_compute_loss", "_compute_loss"})


def layout_from_pipeline_stacks(frames: SnapshotFrames) -> ParallelLayout | None:
    """A pipeline stage inferred from the stacks, for files without a sidecar or stage tokens in
    their names: ``torch.distributed.pipelining`` frames say the file is a stage, and only the
    last stage computes the loss. Coordinates ``{"pp": 1}`` for the last stage and ``{"pp": 0}``
    for a stage before it (exact for two stages; with more, the stages before the last are one
    group), and the schedule the trace's order shows (:mod:`.schedule`). None when no
    allocation has a pipelining frame."""
    stack_frames = frames.stack_frames
    in_pipelining = slashed_filenames(stack_frames).str.contains(PIPELINING_FILES, regex=False)
    used = stack_frames.loc[in_pipelining & stack_frames["frame_id"].isin(frames.stacks["frame_id"])]
    if used.empty:
        return None
    last = bool(set(used["name"].astype(str)) & LAST_STAGE_FUNCTIONS)
    read = schedule_from_trace(frames)
    return ParallelLayout(
        source="stacks",
        coordinates={"pp": 1 if last else 0},
        strategies=["pp"],
        schedule=read.schedule if read else None,
        microbatches=read.microbatches if read else None,
    )


def _normalised(strategies: list[str]) -> list[str]:
    out = set()
    for raw in strategies:
        lowered = raw.lower()
        if lowered in _STACK_MARKS:
            out.add(lowered)
        elif lowered.startswith("fsdp"):
            out.add("fsdp2" if "2" in lowered else "fsdp1")
    return [name for name in _STACK_MARKS if name in out]


def strategies_in_stacks(stack_frames: Any) -> list[str]:
    """The strategies whose library frames appear in a snapshot's stacks."""
    filenames = slashed_filenames(stack_frames)
    return [
        strategy
        for strategy, marks in _STACK_MARKS.items()
        if any(filenames.str.contains(mark, regex=False).any() for mark in marks)
    ]


def detect_parallel(frames: SnapshotFrames) -> ParallelLayout:
    """One snapshot's layout and strategies, from its sidecar (or file name) and its stacks
    (computed once)."""

    def compute() -> ParallelLayout:
        cap = frames.info.capture if isinstance(frames.info.capture, Mapping) else {}
        layout = layout_from_sidecar(cap) or layout_from_name(frames.info.source.path) or ParallelLayout("none")
        par = cap.get("parallel") if isinstance(cap.get("parallel"), Mapping) else {}
        stacks = strategies_in_stacks(frames.stack_frames)
        degrees = dict(layout.degrees)
        for kind in ("tp", "pp"):
            # a degree the sidecar saw counts as the strategy even if no stack shows it
            if degrees.get(kind, 1) > 1:
                stacks = stacks if kind in stacks else [*stacks, kind]
        seen = set(_normalised(layout.strategies)) | set(stacks)
        strategies = [strategy for strategy in _STACK_MARKS if strategy in seen]
        rank = _int(par.get("rank")) if par else None
        world = layout.world_size or (_int(par.get("world_size")) if par else None) or _int(cap.get("world_size"))
        return replace(
            layout,
            strategies=strategies,
            rank=rank if rank is not None else _int(cap.get("rank")),
            world_size=world,
            from_stacks=strategies_in_stacks(frames.stack_frames),
        )

    return memo(frames, "parallel", compute)
