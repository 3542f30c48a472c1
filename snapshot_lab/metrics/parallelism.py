"""Which parallel training strategy a snapshot came from.

Two sources, both kept: the capture sidecar's ``parallel`` key (``snaplab run`` records the world
size, the mesh, degrees and coordinates it could see, and what ``describe_parallel()`` declared),
and the allocation stacks, whose library frames show what ran in this process even without a
sidecar: DistributedDataParallel, FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``),
DTensor tensor parallelism, ``torch.distributed.pipelining``, ``nn.DataParallel``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..frames import SnapshotFrames
from ._memo import memo

# strategy -> path fragments of the library's Python files
_STACK_MARKS: dict[str, tuple[str, ...]] = {
    "ddp": ("torch/nn/parallel/distributed.py",),
    "fsdp2": ("torch/distributed/fsdp/_fully_shard/",),
    "fsdp1": ("torch/distributed/fsdp/_flat_param.py", "torch/distributed/fsdp/fully_sharded_data_parallel.py"),
    "tp": ("torch/distributed/tensor/parallel/", "torch/distributed/tensor/placement_types.py"),
    "pp": ("torch/distributed/pipelining/",),
    "dataparallel": ("torch/nn/parallel/data_parallel.py",),
}
NAMES = {
    "ddp": "DistributedDataParallel",
    "fsdp2": "FSDP2 (fully_shard)",
    "fsdp1": "FSDP1 (FullyShardedDataParallel)",
    "tp": "tensor parallel (DTensor)",
    "pp": "pipeline parallel (torch.distributed.pipelining)",
    "dataparallel": "nn.DataParallel",
}


@dataclass(frozen=True)
class ParallelLayout:
    strategies: tuple[str, ...]  # keys of NAMES, in that order
    world_size: int | None
    rank: int | None
    degrees: dict[str, int] = field(default_factory=dict)  # from the sidecar
    settings: dict[str, Any] = field(default_factory=dict)  # fsdp / pp / ddp settings from the sidecar
    from_stacks: tuple[str, ...] = ()
    from_sidecar: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        if not self.strategies:
            return "single process, no parallel training library seen"
        names = " + ".join(NAMES[s] for s in self.strategies)
        where = f", rank {self.rank} of {self.world_size}" if self.world_size else ""
        return names + where

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["description"] = self.description
        return d


def _from_stacks(frames: SnapshotFrames) -> tuple[str, ...]:
    fn = frames.stack_frames["filename"].astype(str).str.replace("\\", "/", regex=False)
    return tuple(s for s, marks in _STACK_MARKS.items() if any(fn.str.contains(m, regex=False).any() for m in marks))


def _from_sidecar(parallel: dict[str, Any]) -> tuple[str, ...]:
    named = {str(s).lower() for s in parallel.get("strategies") or [] if isinstance(s, str)}
    raw = parallel.get("degrees")
    degrees: dict[Any, Any] = raw if isinstance(raw, dict) else {}
    out = set()
    for s in named:
        if s in _STACK_MARKS:
            out.add(s)
        elif s.startswith("fsdp"):
            out.add("fsdp2" if "2" in s else "fsdp1")
    for key, strategy in (("tp", "tp"), ("pp", "pp")):
        if isinstance(degrees.get(key), int) and degrees[key] > 1:
            out.add(strategy)
    return tuple(s for s in _STACK_MARKS if s in out)


def detect_parallel(frames: SnapshotFrames) -> ParallelLayout:
    """The parallel layout of one snapshot (computed once)."""

    def compute() -> ParallelLayout:
        cap: dict[str, Any] = frames.info.capture if isinstance(frames.info.capture, dict) else {}
        raw_parallel = cap.get("parallel")
        parallel: dict[str, Any] = raw_parallel if isinstance(raw_parallel, dict) else {}
        stacks = _from_stacks(frames)
        sidecar = _from_sidecar(parallel)
        strategies = tuple(s for s in _STACK_MARKS if s in set(stacks) | set(sidecar))
        world = parallel.get("world_size", cap.get("world_size"))
        rank = parallel.get("rank", cap.get("rank"))
        raw = parallel.get("degrees")
        degrees: dict[Any, Any] = raw if isinstance(raw, dict) else {}
        settings = {k: parallel[k] for k in ("fsdp", "pp", "ddp", "mesh") if isinstance(parallel.get(k), dict)}
        return ParallelLayout(
            strategies=strategies,
            world_size=world if isinstance(world, int) else None,
            rank=rank if isinstance(rank, int) else None,
            degrees={str(k): v for k, v in degrees.items() if isinstance(v, int)},
            settings=settings,
            from_stacks=stacks,
            from_sidecar=sidecar,
        )

    return memo(frames, "parallel", compute)
