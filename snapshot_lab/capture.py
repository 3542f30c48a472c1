"""Getting a good snapshot out of a training job, in one line.

    from snapshot_lab.capture import recording

    with recording("snaps/", max_entries=100_000, on_oom=True, every_n_steps=None) as rec:
        for batch in loader:
            train_step(batch)
            rec.step()

or as a decorator, ``@recording("snaps/")``, or from the command line: ``snaplab run train.py``.

It turns on PyTorch's allocator history with the right call for the installed version, dumps a
snapshot when the block exits (normally or by an exception), when an out-of-memory error
happens (from the allocator's OOM observer, before anything is unwound) and every N steps if
asked. Files are named per rank and host (``<prefix>_rank<R>_<host>_<time>[_<why>].pickle``),
each with a ``.meta.json`` sidecar (torch version, ``memory_stats()``, allocator settings, world
size, step) that the analyzer shows. Dumping never crashes the training job: failures are
logged and swallowed. torch is imported here only, and lazily: analysis never needs it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import socket
import sys
import time
from contextlib import ContextDecorator
from pathlib import Path
from typing import Any

from .errors import SnaplabError

log = logging.getLogger("snapshot_lab.capture")

SIDECAR_SUFFIX = ".meta.json"


class CaptureError(SnaplabError):
    """Recording cannot start (no torch, no CUDA, bad arguments)."""

    exit_code = 2


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise CaptureError(
            "recording needs PyTorch with CUDA: pip install torch (snaplab's analysis commands do not need it)"
        ) from None
    return torch


def _torch_version(torch: Any) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", str(getattr(torch, "__version__", "0.0")))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _rank_info() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when initialised, else torchrun's variables."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # a half-initialised process group must not stop a dump
        pass
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def snapshot_name(prefix: str, rank: int, host: str, when: float, why: str | None = None) -> str:
    """``<prefix>_rank<R>_<host>_<YYYYmmdd-HHMMSS>[_<why>].pickle``; host made file-name safe."""
    safe_host = re.sub(r"[^A-Za-z0-9.-]+", "-", host)[:64] or "host"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    tail = f"_{why}" if why else ""
    return f"{prefix}_rank{rank}_{safe_host}_{stamp}{tail}.pickle"


# one OOM observer per process (torch cannot detach them): it forwards to the active recorders
_ACTIVE: list[recording] = []
_OBSERVER_ATTACHED = False


def _on_oom(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    for rec in list(_ACTIVE):
        rec._handle_oom(device, alloc, device_allocated, device_free)


class recording(ContextDecorator):  # lower case: used like a function, with recording(...)
    """Record the CUDA allocator's history; dump snapshots on exit, on OOM and every N steps."""

    def __init__(
        self,
        out_dir: str | os.PathLike[str] = "snapshots",
        *,
        max_entries: int = 100_000,
        stacks: str = "python",
        context: str = "all",
        on_oom: bool = True,
        every_n_steps: int | None = None,
        prefix: str = "snapshot",
        dump_on_exit: bool = True,
    ) -> None:
        if stacks not in ("python", "all"):
            raise CaptureError(f"stacks must be 'python' or 'all', not {stacks!r}")
        if context not in ("state", "alloc", "all"):
            raise CaptureError(f"context must be 'state', 'alloc' or 'all', not {context!r}")
        if max_entries < 1:
            raise CaptureError("max_entries must be at least 1")
        if every_n_steps is not None and every_n_steps < 1:
            raise CaptureError("every_n_steps must be at least 1")
        self.out_dir = Path(out_dir)
        self.max_entries = max_entries
        self.stacks = stacks
        self.context = context
        self.on_oom = on_oom
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.dump_on_exit = dump_on_exit
        self.steps = 0
        self.written: list[Path] = []
        self.exit_reason: str | None = None  # set by a runner that caught the program's exception
        self.exception_type: str | None = None  # the class name of that exception
        self._torch: Any = None
        self._oom_dumped = False
        self._oom_path: Path | None = None  # the snapshot the OOM observer wrote

    # -- recording state -------------------------------------------------------------------

    def _enable(self) -> None:
        torch = self._torch
        mem = torch.cuda.memory
        if _torch_version(torch) >= (2, 1):
            mem._record_memory_history(
                enabled="all", context=self.context, stacks=self.stacks, max_entries=self.max_entries
            )
        else:  # 2.0: the boolean API
            mem._record_memory_history(
                True, trace_alloc_max_entries=self.max_entries, trace_alloc_record_context=self.context != "state"
            )

    def _disable(self) -> None:
        mem = self._torch.cuda.memory
        if _torch_version(self._torch) >= (2, 1):
            mem._record_memory_history(enabled=None)
        else:
            mem._record_memory_history(False)

    def __enter__(self) -> recording:
        global _OBSERVER_ATTACHED
        torch = self._torch = _torch()
        if not torch.cuda.is_available():
            raise CaptureError("CUDA is not available: there is no GPU memory to record")
        self._enable()
        _ACTIVE.append(self)
        if self.on_oom and not _OBSERVER_ATTACHED:
            try:
                torch._C._cuda_attach_out_of_memory_observer(_on_oom)
                _OBSERVER_ATTACHED = True
            except Exception as exc:  # an old torch without the observer API: record anyway
                log.warning("snaplab: cannot watch for out-of-memory errors: %s", exc)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if self.dump_on_exit:
                failed = exc_type is not None and exc_type is not SystemExit
                if failed and isinstance(exc_type, type):
                    self.exception_type = exc_type.__name__
                self.dump("exception" if failed else self.exit_reason, extra=self._incident())
        finally:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            with contextlib.suppress(Exception):
                if _ACTIVE:  # an enclosing recording goes on with its own settings
                    _ACTIVE[-1]._enable()
                else:
                    self._disable()

    # -- events ----------------------------------------------------------------------------

    def step(self) -> None:
        """Call once per training iteration: counts steps and dumps every ``every_n_steps``."""
        self.steps += 1
        if self.every_n_steps and self.steps % self.every_n_steps == 0:
            self.dump(f"step{self.steps}")

    def _handle_oom(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if not self.on_oom or self._oom_dumped:
            return
        self._oom_dumped = True  # one dump per recording: later OOMs while unwinding add nothing
        self._oom_path = self.dump(
            "oom",
            extra={
                "oom": {
                    "device": device,
                    "alloc_bytes": alloc,
                    "limit_bytes": device_allocated,
                    "device_free_bytes": device_free,
                }
            },
        )

    def _incident(self) -> dict[str, Any]:
        """For the dump made after the program died of an out-of-memory error that the observer
        already dumped: the two files are one incident. The OOM file shows the allocator at the
        failing request; this one shows it after the stack unwound (analysis reconstructs the
        moment of the OOM from its trace)."""
        if self._oom_path is None or self.exception_type not in ("OutOfMemoryError", "OutOfMemory"):
            return {}
        return {"incident": {"same_as": self._oom_path.name, "moment": "after the out-of-memory error unwound"}}

    def dump(self, why: str | None = None, extra: dict[str, Any] | None = None) -> Path | None:
        """Write a snapshot now (and its sidecar); returns its path, or None if it failed."""
        try:
            return self._dump(why, extra or {})
        except Exception as exc:  # never crash the training job
            log.warning("snaplab: could not write a memory snapshot: %s", exc)
            return None

    def _dump(self, why: str | None, extra: dict[str, Any]) -> Path:
        torch = self._torch
        rank, world = _rank_info()
        host = socket.gethostname()
        now = time.time()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / snapshot_name(self.prefix, rank, host, now, why)
        # counters of this process's device; of every device only for one process driving several
        # (asking about another rank's GPU would create a CUDA context there)
        devices = [torch.cuda.current_device()]
        if world == 1 and torch.cuda.device_count() > 1:
            devices = list(range(torch.cuda.device_count()))
        stats = {}
        with contextlib.suppress(Exception):
            stats = {str(d): dict(torch.cuda.memory_stats(d)) for d in devices}
        totals = {}
        with contextlib.suppress(Exception):  # tells a per-process cap from the device's capacity
            totals = {str(d): int(torch.cuda.get_device_properties(d).total_memory) for d in devices}
        snap = torch.cuda.memory._snapshot()
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as f:
            pickle.dump(snap, f, protocol=4)  # 4, not 3.14's default 5: memory_viz reads only <= 4
        os.replace(tmp, path)
        meta = {
            "snaplab_capture": 1,
            "torch_version": str(torch.__version__),
            "python": sys.version.split()[0],
            "host": host,
            "rank": rank,
            "world_size": world,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0") or 0),
            "pid": os.getpid(),
            "reason": why or "exit",
            "step": self.steps,
            "time_unix_s": now,
            "argv": list(sys.argv),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", "")),
            "recording": {"max_entries": self.max_entries, "stacks": self.stacks, "context": self.context},
            "memory_stats": stats,
            "device_total_bytes": totals,
            **extra,
        }
        sidecar = path.with_name(path.name[: -len(".pickle")] + SIDECAR_SUFFIX)
        sidecar.write_text(json.dumps(meta, indent=1, default=str))
        self.written.append(path)
        log.info("snaplab: wrote %s", path)
        return path


def active() -> recording | None:
    """The innermost active recording of this process (e.g. the one ``snaplab run`` started)."""
    return _ACTIVE[-1] if _ACTIVE else None


def step() -> None:
    """Count a training iteration for every active recording (see ``every_n_steps``)."""
    for rec in list(_ACTIVE):
        rec.step()
