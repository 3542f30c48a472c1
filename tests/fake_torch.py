"""A stand-in for the bits of torch that snapshot_lab.capture calls, so CI (no GPU, no torch)
exercises the capture logic for real: arguments, file names, sidecars, OOM, restore."""

from __future__ import annotations

import types
from typing import Any

from .conftest import block, event, make_snapshot, segment


class FakeTorch:
    def __init__(self, version: str = "2.11.0", devices: int = 1, fail_snapshot: bool = False) -> None:
        self.history_calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.observers: list[Any] = []
        self.fail_snapshot = fail_snapshot
        self.current = 0
        torch = types.ModuleType("torch")
        torch.__version__ = version
        cuda = types.SimpleNamespace(
            is_available=lambda: True,
            device_count=lambda: devices,
            current_device=lambda: self.current,
            memory_stats=lambda d=None: {"reserved_bytes.all.current": 2097152 * (1 + (d or 0)), "num_ooms": 0},
            memory=types.SimpleNamespace(_record_memory_history=self._record, _snapshot=self._snapshot),
            get_device_properties=lambda d=None: types.SimpleNamespace(total_memory=80 * 2**30),
        )
        torch.cuda = cuda
        torch._C = types.SimpleNamespace(_cuda_attach_out_of_memory_observer=self.observers.append)
        dist = types.ModuleType("torch.distributed")
        dist.is_available = lambda: False
        dist.is_initialized = lambda: False
        torch.distributed = dist
        self.module = torch
        self.dist = dist

    def _record(self, *args: Any, **kwargs: Any) -> None:
        self.history_calls.append((args, kwargs))

    def _snapshot(self) -> dict[str, Any]:
        if self.fail_snapshot:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        seg = segment(1 << 30, [block(1024, frames=[]), block(2096128, "inactive", frames=[])], segment_type="small")
        return make_snapshot([seg], [[event("alloc", 1 << 30, 1000, 1)]])

    def install(self, monkeypatch: Any) -> None:
        monkeypatch.setitem(__import__("sys").modules, "torch", self.module)
        monkeypatch.setitem(__import__("sys").modules, "torch.distributed", self.dist)
        for name, mod in getattr(self, "extra_modules", {}).items():
            monkeypatch.setitem(__import__("sys").modules, name, mod)

    def distributed(self, rank: int, world: int) -> FakeParallel:
        """An initialised process group, and the torch.distributed classes whose live instances
        capture reads the parallel layout from (fresh classes: instances left by other tests are
        not theirs)."""
        self.dist.is_available = lambda: True
        self.dist.is_initialized = lambda: True
        self.dist.get_rank = lambda group=None: rank
        self.dist.get_world_size = lambda group=None: world
        par = FakeParallel()
        self.extra_modules = par.modules
        return par


class FakeParallel:
    """Stand-ins for DeviceMesh, DDP, FSDP1, FSDP2 modules and pipelining stages and schedules,
    registered under the module names torch defines them in."""

    def __init__(self) -> None:
        class DeviceMesh:
            def __init__(
                self,
                shape: tuple[int, ...],
                names: tuple[str, ...] | None = None,
                coordinate: tuple[int, ...] | None = None,
                root: Any = None,
                device_type: str = "cuda",
            ) -> None:
                self.shape = tuple(shape)
                self.mesh_dim_names = names
                self._coordinate = coordinate
                self._root_mesh = root
                self.device_type = device_type

            def get_coordinate(self) -> tuple[int, ...] | None:
                return self._coordinate

        class DistributedDataParallel:
            def __init__(self, size: int, rank: int, bucket_view: bool) -> None:
                self.gradient_as_bucket_view = bucket_view
                self.bucket_bytes_cap = 25 * 2**20
                self.process_group = types.SimpleNamespace(size=lambda: size, rank=lambda: rank)

        class FullyShardedDataParallel:
            def __init__(self, strategy: str, world_size: int, rank: int, is_root: bool) -> None:
                self.sharding_strategy = types.SimpleNamespace(name=strategy)
                self.world_size, self.rank, self._is_root = world_size, rank, is_root

        class FSDPModule:
            def __init__(self, mesh: Any, reshard: bool, is_root: bool, replicate_dim: int | None = None) -> None:
                shard_dim = 0 if replicate_dim is None else 1
                info = types.SimpleNamespace(mesh=mesh, shard_mesh_dim=shard_dim, replicate_mesh_dim=replicate_dim)
                group = types.SimpleNamespace(mesh_info=info, post_forward_mesh_info=info if reshard else None)
                self._state = types.SimpleNamespace(_fsdp_param_group=group, _is_root=is_root)

            def _get_fsdp_state(self) -> Any:
                return self._state

        class _PipelineStageBase:
            def __init__(self, stage_index: int, num_stages: int) -> None:
                self.stage_index, self.num_stages = stage_index, num_stages

        class _PipelineSchedule:
            def __init__(self, n_microbatches: int) -> None:
                self._n_microbatches = n_microbatches

        class Schedule1F1B(_PipelineSchedule):
            pass

        self.DeviceMesh = DeviceMesh
        self.DDP = DistributedDataParallel
        self.FSDP = FullyShardedDataParallel
        self.FSDPModule = FSDPModule
        self.Stage = _PipelineStageBase
        self.Schedule1F1B = Schedule1F1B
        self.mesh_resources = types.SimpleNamespace(mesh_stack=[])
        spec = {
            "torch.distributed.device_mesh": {"DeviceMesh": DeviceMesh, "_mesh_resources": self.mesh_resources},
            "torch.nn.parallel.distributed": {"DistributedDataParallel": DistributedDataParallel},
            "torch.distributed.fsdp.fully_sharded_data_parallel": {
                "FullyShardedDataParallel": FullyShardedDataParallel
            },
            "torch.distributed.fsdp._fully_shard._fully_shard": {"FSDPModule": FSDPModule},
            "torch.distributed.pipelining.stage": {"_PipelineStageBase": _PipelineStageBase},
            "torch.distributed.pipelining.schedules": {
                "_PipelineSchedule": _PipelineSchedule,
                "Schedule1F1B": Schedule1F1B,
            },
        }
        self.modules: dict[str, types.ModuleType] = {}
        for name, attrs in spec.items():
            mod = types.ModuleType(name)
            for key, value in attrs.items():
                setattr(mod, key, value)
            self.modules[name] = mod
