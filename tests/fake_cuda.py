"""A fake torch whose CUDA allocator can be driven by a test: ``torch.cuda._fake_alloc(n)``
allocates (with the caller's line as its stack), ``_fake_free(addr)`` frees; the peak counters
and the snapshot (blocks and trace) follow, so snaplab's analysis of what the pytest plugin dumps
sees the allocations of the test. Builds on tests/fake_torch.py."""

from __future__ import annotations

import sys
import weakref
from typing import Any

from .conftest import block, event, make_snapshot, segment
from .fake_torch import FakeTorch


class FakeTensor:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class FakeCudaTorch(FakeTorch):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.allocated = 0
        self.peak = 0
        self.live: dict[int, tuple[int, list[dict[str, Any]]]] = {}
        self.trace: list[dict[str, Any]] = []
        self.recording = False
        self.next_addr = 1 << 32
        self.t = 1_000_000
        cuda = self.module.cuda
        cuda.memory_allocated = lambda d=None: self.allocated
        cuda.max_memory_allocated = lambda d=None: self.peak
        cuda.reset_peak_memory_stats = self._reset_peak
        cuda.synchronize = lambda d=None: None
        cuda.memory_stats = lambda d=None: {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "num_ooms": 0,
        }
        cuda._fake_alloc = self.alloc
        cuda._fake_free = self.free
        self.module.empty = self.empty
        self.module.float32 = "float32"
        self.module.bfloat16 = "bfloat16"

    def empty(self, *shape: int, dtype: Any = "float32", device: Any = None) -> FakeTensor:
        """A tensor-like handle: allocates its bytes now, frees them when it is garbage."""
        n = 1
        for d in shape:
            n *= int(d)
        caller = sys._getframe(1)
        frames = [{"filename": caller.f_code.co_filename, "line": caller.f_lineno, "name": caller.f_code.co_name}]
        t = FakeTensor(n * (2 if dtype == "bfloat16" else 4))
        addr = self.alloc(t.nbytes, frames)
        weakref.finalize(t, self.free, addr)
        return t

    def _reset_peak(self, d: Any = None) -> None:
        self.peak = self.allocated

    def _record(self, *args: Any, **kwargs: Any) -> None:
        super()._record(*args, **kwargs)
        on = kwargs.get("enabled", args[0] if args else None)
        if on and not self.recording:
            self.trace = []
        self.recording = bool(on)

    def _event(self, *args: Any, **kwargs: Any) -> None:
        self.t += 10
        if self.recording:
            self.trace.append(event(*args, t=self.t, **kwargs))

    def alloc(self, nbytes: int, frames: list[dict[str, Any]] | None = None) -> int:
        if frames is None:
            caller = sys._getframe(1)
            frames = [{"filename": caller.f_code.co_filename, "line": caller.f_lineno, "name": caller.f_code.co_name}]
        addr = self.next_addr
        self.next_addr += (nbytes + 511) // 512 * 512 + 512
        self.live[addr] = (nbytes, frames)
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self._event("segment_alloc", addr, nbytes, frames=frames)
        self._event("alloc", addr, nbytes, frames=frames)
        return addr

    def free(self, addr: int) -> None:
        nbytes, frames = self.live.pop(addr)
        self.allocated -= nbytes
        self._event("free_requested", addr, nbytes, frames=frames)
        self._event("free_completed", addr, nbytes, frames=frames)
        self._event("segment_free", addr, nbytes, frames=frames)

    def _snapshot(self) -> dict[str, Any]:
        segments = [segment(addr, [block(n, frames=fr)]) for addr, (n, fr) in sorted(self.live.items())]
        return make_snapshot(segments, [list(self.trace)])
