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
