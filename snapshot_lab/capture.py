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
size, step, parallel layout) that the analyzer shows. Dumping never crashes the training job:
failures are logged and swallowed. torch is imported here only, and lazily: analysis never needs
it.

The sidecar's ``"parallel"`` key says how this rank's job was split (what is known of it)::

    "parallel": {
      "world_size": 2, "rank": 0,
      "mesh": {"dim_names": ["dp", "tp"], "shape": [1, 2], "coordinate": [0, 0],
               "device_type": "cuda"},
      "meshes": [...],                   # every root DeviceMesh of the process, when several
      "degrees": {"dp": 1, "fsdp": 1, "tp": 2, "pp": 1, "cp": 1},   # + "ep" when a mesh names it
      "coordinates": {"dp": 0, "tp": 0},  # this rank's index along each degree, when known
      "strategies": ["tensor_parallel"],  # of ddp, fsdp1, fsdp2, tensor_parallel, context_parallel,
                                          # pipeline, and the strategy describe_parallel() named
      "sources": {"tp": "mesh"},         # where each degree came from: mesh, fsdp2, fsdp1, ddp,
                                         # pipeline, declared, or rest (1: the others fill the
                                         # world)
      "ddp": {"gradient_as_bucket_view": true, "bucket_cap_bytes": 26214400},
      "fsdp": {"version": 2, "units": 9, "reshard_after_forward": true},   # or version 1 with
                                         # "sharding_strategy": "FULL_SHARD"
      "pp": {"stage": 0, "num_stages": 2, "schedule": "1F1B", "microbatches": 8},
      "declared": {...}                  # what describe_parallel() was told, verbatim
    }

Keys other than ``world_size`` and ``rank`` appear only when known (the degrees not seen are set
to 1 only when those seen account for the whole world; if detection itself fails, ``"error"``
says why). They are read, at dump time, from the objects of torch.distributed that the process
holds (DeviceMesh: dimension names, shape, coordinate; DistributedDataParallel;
FullyShardedDataParallel; fully_shard modules; pipelining stages and schedules); what cannot be
seen that way (a pipeline driven by hand, a layout spread over process groups without a mesh) is
declared with :func:`describe_parallel`, whose values win over detection.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import logging
import os
import pickle
import re
import socket
import sys
import time
from collections.abc import Callable
from contextlib import ContextDecorator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from . import module_tags
from .errors import SnaplabError

log = logging.getLogger("snapshot_lab.capture")

SIDECAR_SUFFIX = ".meta.json"
NEEDS_TORCH = (
    "recording needs PyTorch with CUDA: pip install torch "
    # torch is imported here only, and lazily
    "(snaplab's analysis commands do not need it)"
)
DEFAULT_OUT_DIR = "snapshots"
STACKS = ("python", "all")
CONTEXTS = ("state", "alloc", "all")


class CaptureError(SnaplabError):
    """Recording cannot start (no torch, no CUDA, bad arguments)."""

    exit_code = 2


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise CaptureError(NEEDS_TORCH) from None
    return torch


def _torch_version(torch: Any) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", str(getattr(torch, "__version__", "0.0")))
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


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


@dataclass(frozen=True)
class CaptureOptions:
    """How to record: the options that :class:`recording`, ``snaplab run``, the framework
    callbacks and their :class:`~snapshot_lab.integrations._session.CaptureSession` share, with
    their defaults, defined here once. Each entry point takes them as keywords and builds one of
    these; bad values raise :class:`CaptureError` when it is built.

    (``snaplab run``/``api.run`` take all but ``context`` and ``prefix`` and still spell out
    their defaults; they should take them from here too: ``CAPTURE_DEFAULTS.max_entries``...)
    """

    #: trace ring-buffer size: the allocator events kept (older ones are dropped)
    max_entries: int = 100_000
    #: ``python`` (fast) or ``all`` (adds C++ frames; slow to dump)
    stacks: str = "python"
    #: what torch records: ``state`` (the segments only), ``alloc`` or ``all`` (frees too)
    context: str = "all"
    #: dump a snapshot at an out-of-memory error, from the allocator's OOM observer
    on_oom: bool = True
    #: also dump every N calls of ``step()`` (None: never)
    every_n_steps: int | None = None
    #: file names start with it: ``<prefix>_rank<R>_<host>_<time>[_<why>].pickle``
    prefix: str = "snapshot"
    #: tag allocations with the module that made them, for memory by module (torch >= 2.10)
    tag_modules: bool = True
    #: the batch size in samples, written to the sidecar so that reports give batches in samples
    #: (None: unknown; the framework callbacks read it from the trainer where they can)
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.stacks not in STACKS:
            raise CaptureError(f"stacks must be 'python' or 'all', not {self.stacks!r}")
        if self.context not in CONTEXTS:
            raise CaptureError(f"context must be 'state', 'alloc' or 'all', not {self.context!r}")
        if self.max_entries < 1:
            raise CaptureError("max_entries must be at least 1")
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise CaptureError("every_n_steps must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise CaptureError("batch_size must be at least 1")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names, in order."""
        return tuple(field.name for field in fields(cls))


CAPTURE_DEFAULTS = CaptureOptions()


def with_capture_options(function: Callable[..., Any]) -> inspect.Signature:
    """The signature of ``function``, which takes the capture options as ``**options``, with
    them spelled out instead: keyword-only, each with its default (for help() and inspect)."""
    signature = inspect.signature(function)
    options = [
        inspect.Parameter(
            field.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=getattr(CAPTURE_DEFAULTS, field.name),
            annotation=field.type,
        )
        for field in fields(CaptureOptions)
    ]
    var_keyword = inspect.Parameter.VAR_KEYWORD
    kept = [param for param in signature.parameters.values() if param.kind is not var_keyword]
    return signature.replace(parameters=[*kept, *options])


# one OOM observer per process (torch cannot detach them): it forwards to the active recorders
_ACTIVE: list[recording] = []
_OBSERVER_ATTACHED = False


def _on_oom(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    for rec in list(_ACTIVE):
        rec._handle_oom(device, alloc, device_allocated, device_free)


class recording(ContextDecorator):
    # lower case: used like a function, with recording(...)
    """Record the CUDA allocator's history; dump snapshots on exit, on OOM and every N steps."""

    def __init__(
        self,
        out_dir: str | os.PathLike[str] = DEFAULT_OUT_DIR,
        *,
        max_entries: int = CAPTURE_DEFAULTS.max_entries,
        stacks: str = CAPTURE_DEFAULTS.stacks,
        context: str = CAPTURE_DEFAULTS.context,
        on_oom: bool = CAPTURE_DEFAULTS.on_oom,
        every_n_steps: int | None = CAPTURE_DEFAULTS.every_n_steps,
        prefix: str = CAPTURE_DEFAULTS.prefix,
        dump_on_exit: bool = True,
        tag_modules: bool = CAPTURE_DEFAULTS.tag_modules,
        batch_size: int | None = CAPTURE_DEFAULTS.batch_size,
        model: Any = None,
    ) -> None:
        """The options are :class:`CaptureOptions`'s; ``dump_on_exit``: dump when the block
        exits; ``model``: the module to tag (None: every module of the process, what ``snaplab
        run`` does)."""
        self.options = CaptureOptions(
            max_entries=max_entries,
            stacks=stacks,
            context=context,
            on_oom=on_oom,
            every_n_steps=every_n_steps,
            prefix=prefix,
            tag_modules=tag_modules,
            batch_size=batch_size,
        )
        self.out_dir = Path(out_dir)
        # what the sidecar says of the batch: the option, or what a framework callback read
        self.batch_size = batch_size
        self.dump_on_exit = dump_on_exit
        self.model = model
        self._tags: Any = None
        self.steps = 0
        self.written: list[Path] = []
        # set by a runner that caught the program's exception
        self.exit_reason: str | None = None
        # the class name of that exception
        self.exception_type: str | None = None
        self._torch: Any = None
        self._oom_dumped = False
        # the snapshot the OOM observer wrote
        self._oom_path: Path | None = None
        self._oom_record: dict[str, int] = {}

    @classmethod
    def from_options(
        cls,
        out_dir: str | os.PathLike[str],
        options: CaptureOptions,
        *,
        dump_on_exit: bool = True,
        model: Any = None,
    ) -> recording:
        """A recording with ``options`` (what the callbacks and ``snaplab run`` build)."""
        return cls(out_dir, **asdict(options), dump_on_exit=dump_on_exit, model=model)

    # -- recording state -------------------------------------------------------------------

    def _enable(self) -> None:
        torch = self._torch
        memory = torch.cuda.memory
        options = self.options
        if _torch_version(torch) >= (2, 1):
            memory._record_memory_history(
                enabled="all",
                context=options.context,
                stacks=options.stacks,
                max_entries=options.max_entries,
            )
        else:  # 2.0: the boolean API
            memory._record_memory_history(
                True,
                trace_alloc_max_entries=options.max_entries,
                trace_alloc_record_context=options.context != "state",
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
        if self.options.tag_modules:
            # never raises: says why when it cannot
            self._tags = module_tags.tag_modules(self.model)
        _ACTIVE.append(self)
        if self.options.on_oom and not _OBSERVER_ATTACHED:
            try:
                torch._C._cuda_attach_out_of_memory_observer(_on_oom)
                _OBSERVER_ATTACHED = True
            except Exception as exc:
                # an old torch without the observer API: record anyway
                log.warning("snaplab: cannot watch for out-of-memory errors: %s", exc)
        return self

    def __exit__(self, exc_type: object, exc: object, exc_tb: object) -> None:
        try:
            if self.dump_on_exit:
                failed = exc_type is not None and exc_type is not SystemExit
                if failed and isinstance(exc_type, type):
                    self.exception_type = exc_type.__name__
                self.dump("exception" if failed else self.exit_reason, extra=self._incident())
        finally:
            if self._tags is not None:
                with contextlib.suppress(Exception):
                    self._tags.remove()
                self._tags = None
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            with contextlib.suppress(Exception):
                if _ACTIVE:
                    # an enclosing recording goes on with its own settings
                    _ACTIVE[-1]._enable()
                else:
                    self._disable()

    # -- events ----------------------------------------------------------------------------

    def step(self) -> None:
        """Call once per training iteration: counts steps and dumps every ``every_n_steps``."""
        self.steps += 1
        every_n_steps = self.options.every_n_steps
        if every_n_steps and self.steps % every_n_steps == 0:
            self.dump(f"step{self.steps}")

    def _handle_oom(self, device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        if not self.options.on_oom or self._oom_dumped:
            return
        # one dump per recording: later OOMs while unwinding add nothing
        self._oom_dumped = True
        self._oom_record = {
            "device": device,
            "alloc_bytes": alloc,
            "limit_bytes": device_allocated,
            "device_free_bytes": device_free,
        }
        self._oom_path = self.dump("oom", extra={"oom": self._oom_record})

    def _incident(self) -> dict[str, Any]:
        """For the dump made after the program died of an out-of-memory error that the observer
        already dumped: the two files are one incident. The OOM file shows the allocator at the
        failing request; this one shows it after the stack unwound (analysis reconstructs the
        moment of the OOM from its trace)."""
        if self._oom_path is None or self.exception_type not in ("OutOfMemoryError", "OutOfMemory"):
            return {}
        return {
            "incident": {
                "same_as": self._oom_path.name,
                "moment": "after the out-of-memory error unwound",
            },
            # the observer's record: the limit the OOM happened under
            "oom": self._oom_record,
        }

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
        path = self.out_dir / snapshot_name(self.options.prefix, rank, host, now, why)
        # counters of this process's device; of every device only for one process driving several
        # (asking about another rank's GPU would create a CUDA context there)
        devices = [torch.cuda.current_device()]
        if world == 1 and torch.cuda.device_count() > 1:
            devices = list(range(torch.cuda.device_count()))
        stats = {}
        with contextlib.suppress(Exception):
            stats = {str(device_index): dict(torch.cuda.memory_stats(device_index)) for device_index in devices}
        totals = {}
        with contextlib.suppress(Exception):
            # tells a per-process cap from the device's capacity
            totals = {
                str(device_index): int(torch.cuda.get_device_properties(device_index).total_memory)
                for device_index in devices
            }
        snap = torch.cuda.memory._snapshot()
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as file:
            # 4, not 3.14's default 5: memory_viz reads only <= 4
            pickle.dump(snap, file, protocol=4)
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
            "alloc_conf": _alloc_conf(),
            "recording": {
                "max_entries": self.options.max_entries,
                "stacks": self.options.stacks,
                "context": self.options.context,
            },
            "module_tags": self._tags.describe() if self._tags is not None else None,
            "memory_stats": stats,
            "device_total_bytes": totals,
            **({"batch_size": self.batch_size} if self.batch_size is not None else {}),
            "parallel": _parallel_layout_or_error(rank, world),
            **extra,
        }
        sidecar = path.with_name(path.name[: -len(".pickle")] + SIDECAR_SUFFIX)
        sidecar.write_text(json.dumps(meta, indent=1, default=str))
        self.written.append(path)
        log.info("snaplab: wrote %s", path)
        return path


def _alloc_conf() -> str:
    """The allocator settings the process runs under (the newer variable's name second)."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))


def active() -> recording | None:
    """The innermost active recording of this process (e.g. the one ``snaplab run`` started)."""
    return _ACTIVE[-1] if _ACTIVE else None


def step() -> None:
    """Count a training iteration for every active recording (see ``every_n_steps``)."""
    for rec in list(_ACTIVE):
        rec.step()


# --------------------------------------------------------------------------- parallel layout

# the degrees every layout has (1 when unused); "ep" appears only when a mesh or the user names it
_DEGREES = ("dp", "fsdp", "tp", "pp", "cp")
_DECLARED: dict[str, Any] = {}

# where torch keeps the classes whose instances say how a job is split; only modules the program
# already imported are looked at (importing them here would be slow and could fail)
_WATCHED: dict[str, tuple[tuple[str, str], ...]] = {
    "torch.distributed.device_mesh": (("DeviceMesh", "mesh"),),
    "torch.nn.parallel.distributed": (("DistributedDataParallel", "ddp"),),
    "torch.distributed.fsdp.fully_sharded_data_parallel": (("FullyShardedDataParallel", "fsdp1"),),
    # 2.6+
    "torch.distributed.fsdp._fully_shard._fully_shard": (("FSDPModule", "fsdp2"),),
    # 2.4-2.5
    "torch.distributed._composable.fsdp.fully_shard": (("FSDPModule", "fsdp2"),),
    "torch.distributed.pipelining.stage": (("_PipelineStageBase", "stage"),),
    "torch.distributed.pipelining.schedules": (("_PipelineSchedule", "schedule"),),
}


def describe_parallel(
    *,
    dp: int | None = None,
    fsdp: int | None = None,
    tp: int | None = None,
    cp: int | None = None,
    ep: int | None = None,
    pp_degree: int | None = None,
    pp_stage: int | None = None,
    schedule: str | None = None,
    microbatches: int | None = None,
    strategy: str | None = None,
    coordinates: dict[str, int] | None = None,
    **notes: Any,
) -> None:
    """Declare what the sidecar cannot detect by itself, e.g. for a pipeline driven by hand:
    ``describe_parallel(pp_stage=rank, pp_degree=2, schedule="1F1B", microbatches=8)``.

    Degrees are ``dp`` (replicas), ``fsdp`` (shards), ``tp``, ``pp_degree``, ``cp``, ``ep``;
    ``coordinates`` this rank's index along them (``{"tp": 1}``); ``notes`` anything JSON can
    hold. Calls add up; declared values win over detected ones in the sidecar's ``"parallel"``."""
    given = {
        "dp": dp,
        "fsdp": fsdp,
        "tp": tp,
        "cp": cp,
        "ep": ep,
        "pp_degree": pp_degree,
        "pp_stage": pp_stage,
        "schedule": schedule,
        "microbatches": microbatches,
        "strategy": strategy,
    }
    for key, value in given.items():
        if value is not None:
            _DECLARED[key] = value
    if coordinates:
        _DECLARED.setdefault("coordinates", {}).update(coordinates)
    if notes:
        _DECLARED.setdefault("notes", {}).update(notes)


def _dim_kind(name: str) -> str | None:
    """The degree a mesh dimension stands for, from its name (torchtitan, tutorials, Megatron)."""
    lowered = name.lower().replace("-", "_")
    if lowered in ("tp", "tensor", "tensor_parallel", "model", "mp"):
        return "tp"
    if lowered in ("pp", "pipe", "pipeline", "pipeline_parallel"):
        return "pp"
    if lowered in ("cp", "context", "context_parallel"):
        return "cp"
    if lowered in ("ep", "expert", "expert_parallel"):
        return "ep"
    if lowered in ("fsdp", "shard", "dp_shard", "sharded", "zero"):
        return "fsdp"
    if lowered in ("dp", "ddp", "data", "data_parallel", "replicate", "dp_replicate", "hsdp"):
        return "dp"
    return None


def _parallel_objects() -> dict[str, list[Any]]:
    """The live DeviceMesh, DDP, FSDP, pipeline stage and schedule objects of this process."""
    classes: list[tuple[type, str]] = []
    for mod_name, attrs in _WATCHED.items():
        mod = sys.modules.get(mod_name)
        for attr, kind in attrs:
            cls = getattr(mod, attr, None) if mod is not None else None
            if isinstance(cls, type):
                classes.append((cls, kind))
    if not classes:
        return {}
    wanted = tuple(cls for cls, _ in classes)
    found: dict[str, list[Any]] = {}
    for obj in gc.get_objects():
        # not isinstance: it would ask proxies (deprecated modules) for __class__
        cls_of = type(obj)
        if not issubclass(cls_of, wanted):
            continue
        for cls, kind in classes:
            if issubclass(cls_of, cls):
                bucket = found.setdefault(kind, [])
                if all(other is not obj for other in bucket):
                    bucket.append(obj)
    return found


def _root_mesh(mesh: Any) -> Any:
    # 2.9+: slices and flattened meshes know their root
    root = getattr(mesh, "_root_mesh", None)
    if root is None:  # 2.4-2.8: a registry of the process
        resources = getattr(
            sys.modules.get("torch.distributed.device_mesh"),
            "_mesh_resources",
            None,
        )
        mapping = getattr(resources, "child_to_root_mapping", None)
        if isinstance(mapping, dict):
            with contextlib.suppress(Exception):
                root = mapping.get(mesh)
    return mesh if root is None else root


def _mesh_shape(mesh: Any) -> list[int]:
    shape = getattr(mesh, "shape", None)
    if shape is None or callable(shape):
        shape = tuple(mesh.mesh.shape)
    return [int(size) for size in shape]


def _describe_mesh(mesh: Any) -> dict[str, Any]:
    names = getattr(mesh, "mesh_dim_names", None)
    desc: dict[str, Any] = {"dim_names": [str(name) for name in names] if names else None}
    desc["shape"] = _mesh_shape(mesh)
    coord = None
    with contextlib.suppress(Exception):
        coordinate = mesh.get_coordinate()
        coord = None if coordinate is None else [int(value) for value in coordinate]
    desc["coordinate"] = coord
    with contextlib.suppress(Exception):
        desc["device_type"] = str(mesh.device_type)
    return desc


def _mesh_dim(desc: dict[str, Any], dim: int | None) -> tuple[str | None, int, int | None] | None:
    """(name, size, this rank's coordinate) of one dimension of a described mesh."""
    if dim is None or dim >= len(desc["shape"]):
        return None
    names, coord = desc.get("dim_names"), desc.get("coordinate")
    return (
        names[dim] if names else None,
        desc["shape"][dim],
        coord[dim] if coord is not None else None,
    )


class _Layout:
    """Degrees, coordinates and where each came from, filled by the detectors in turn."""

    def __init__(self) -> None:
        self.degrees: dict[str, int] = {}
        self.coordinates: dict[str, int] = {}
        self.sources: dict[str, str] = {}
        self.strategies: list[str] = []

    def set(
        self,
        kind: str,
        size: int | None,
        coord: int | None,
        source: str,
        *,
        override: bool = False,
    ) -> None:
        if size is None or (kind in self.degrees and not override):
            return
        self.degrees[kind] = int(size)
        self.sources[kind] = source
        if coord is not None:
            self.coordinates[kind] = int(coord)
        elif override:
            self.coordinates.pop(kind, None)

    def strategy(self, name: str) -> None:
        if name not in self.strategies:
            self.strategies.append(name)


def _fsdp2_info(units: list[Any], lay: _Layout, kind_of_name: dict[str, str]) -> dict[str, Any]:
    info: dict[str, Any] = {"version": 2, "units": len(units)}
    reshard: list[bool] = []
    mesh_done = False
    for mod in units:
        try:
            state = mod._get_fsdp_state()
            group = getattr(state, "_fsdp_param_group", None)
        except Exception:
            continue
        if group is None:
            continue
        is_root = getattr(state, "_is_root", None) is True
        if not is_root and hasattr(group, "post_forward_mesh_info"):
            reshard.append(group.post_forward_mesh_info is not None)
        mesh_info = getattr(group, "mesh_info", None)
        if mesh_done or mesh_info is None:
            continue
        with contextlib.suppress(Exception):
            desc = _describe_mesh(mesh_info.mesh)
            for kind, attr in (("fsdp", "shard_mesh_dim"), ("dp", "replicate_mesh_dim")):
                dim = _mesh_dim(desc, getattr(mesh_info, attr, None))
                if dim is None:
                    continue
                name, size, coord = dim
                if name is not None:
                    # FSDP shards over it, whatever the name says
                    kind_of_name[name] = kind
                lay.set(kind, size, coord, "fsdp2", override=True)
            mesh_done = True
    if reshard:
        info["reshard_after_forward"] = any(reshard)
    return info


def _fsdp1_info(units: list[Any], lay: _Layout) -> dict[str, Any]:
    root = next((unit for unit in units if getattr(unit, "_is_root", None) is True), units[0])
    info: dict[str, Any] = {"version": 1, "units": len(units)}
    strategy = getattr(root, "sharding_strategy", None)
    name = getattr(strategy, "name", None if strategy is None else str(strategy))
    if name:
        info["sharding_strategy"] = name
    size, rank = getattr(root, "world_size", None), getattr(root, "rank", None)
    if name == "NO_SHARD":
        lay.set("dp", size, rank, "fsdp1")
    elif name and "HYBRID" in name and isinstance(size, int) and size > 0:
        lay.set("fsdp", size, rank, "fsdp1")
        world = _rank_info()[1]
        lay.set("dp", world // size if world % size == 0 else None, None, "fsdp1")
    else:
        lay.set("fsdp", size, rank, "fsdp1")
    return info


def _pipeline_info(stages: list[Any], schedules: list[Any], lay: _Layout) -> dict[str, Any]:
    info: dict[str, Any] = {}
    if stages:
        indices = sorted({int(stage.stage_index) for stage in stages if hasattr(stage, "stage_index")})
        if len(indices) == 1:
            info["stage"] = indices[0]
        elif indices:
            # interleaved / looped schedules: several stages per rank
            info["stages"] = indices
        num = getattr(stages[0], "num_stages", None)
        if num is not None:
            info["num_stages"] = int(num)
        size = getattr(stages[0], "group_size", None)
        coord = getattr(stages[0], "group_rank", None)
        if size is None and num is not None and indices:
            size = int(num) // len(indices)
        if coord is None and len(indices) == 1:
            coord = indices[0]
        lay.set("pp", size, coord, "pipeline")
    if schedules:
        sched = schedules[0]
        name = type(sched).__name__
        prefixed = name.startswith("Schedule") and len(name) > len("Schedule")
        info["schedule"] = name[len("Schedule") :] if prefixed else name
        microbatches = getattr(sched, "_n_microbatches", None)
        if microbatches is not None:
            info["microbatches"] = int(microbatches)
    return info


def parallel_layout() -> dict[str, Any]:
    """How this rank's job is split, as the sidecar's ``"parallel"`` key records it (see the
    module docstring). Detection reads live torch.distributed objects; never imports torch."""
    rank, world = _rank_info()
    out: dict[str, Any] = {"world_size": world, "rank": rank}
    found = _parallel_objects()
    layout = _Layout()
    # mesh dimension name -> the degree FSDP shards over
    kind_of_name: dict[str, str] = {}
    descriptions = _mesh_descriptions(found.get("mesh", []))
    if descriptions:
        out["mesh"] = descriptions[0]
        if len(descriptions) > 1:
            out["meshes"] = descriptions
    if found.get("fsdp2"):
        layout.strategy("fsdp2")
        out["fsdp"] = _fsdp2_info(found["fsdp2"], layout, kind_of_name)
    if found.get("fsdp1"):
        layout.strategy("fsdp1")
        out["fsdp"] = _fsdp1_info(found["fsdp1"], layout)
    _set_mesh_degrees(descriptions, kind_of_name, layout)
    if found.get("ddp"):
        layout.strategy("ddp")
        out["ddp"] = _ddp_info(found["ddp"][0], layout)
    if found.get("stage") or found.get("schedule"):
        layout.strategy("pipeline")
        out["pp"] = _pipeline_info(found.get("stage", []), found.get("schedule", []), layout)
    if _DECLARED:
        _apply_declared(dict(_DECLARED), out, layout)
    if layout.degrees or world == 1:
        _set_degrees(out, layout, world)
    if layout.strategies:
        out["strategies"] = layout.strategies
    return out


def _mesh_descriptions(meshes: list[Any]) -> list[dict[str, Any]]:
    """Every root DeviceMesh of the process, described, the main one (the largest) first."""
    roots: list[Any] = []
    for mesh in meshes:
        root = _root_mesh(mesh)
        if all(known is not root for known in roots):
            roots.append(root)
    descriptions = []
    for root in roots:
        with contextlib.suppress(Exception):
            descriptions.append(_describe_mesh(root))

    def main_first(desc: dict[str, Any]) -> tuple[int, int, bool]:
        return -_prod(desc["shape"]), -len(desc["shape"]), desc.get("dim_names") is None

    descriptions.sort(key=main_first)
    return descriptions


def _set_mesh_degrees(
    descriptions: list[dict[str, Any]],
    kind_of_name: dict[str, str],
    layout: _Layout,
) -> None:
    """The degrees the named mesh dimensions say, the main mesh first."""
    for desc in descriptions:
        for dim, name in enumerate(desc.get("dim_names") or []):
            kind = kind_of_name.get(name) or _dim_kind(name)
            spec = _mesh_dim(desc, dim)
            if kind is None or spec is None:
                continue
            layout.set(kind, spec[1], spec[2], "mesh")
            if kind == "tp" and spec[1] > 1:
                layout.strategy("tensor_parallel")
            if kind == "cp" and spec[1] > 1:
                layout.strategy("context_parallel")


def _ddp_info(ddp: Any, layout: _Layout) -> dict[str, Any]:
    size = coord = None
    with contextlib.suppress(Exception):
        size, coord = int(ddp.process_group.size()), int(ddp.process_group.rank())
    layout.set("dp", size, coord, "ddp")
    return {
        "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
        "bucket_cap_bytes": getattr(ddp, "bucket_bytes_cap", None),
    }


def _apply_declared(declared: dict[str, Any], out: dict[str, Any], layout: _Layout) -> None:
    """What :func:`describe_parallel` was told wins over detection."""
    out["declared"] = declared
    coords = declared.get("coordinates") or {}
    for kind in (*_DEGREES, "ep"):
        key = "pp_degree" if kind == "pp" else kind
        if declared.get(key) is not None:
            layout.set(kind, declared[key], coords.get(kind), "declared", override=True)
    if declared.get("pp_stage") is not None:
        out.setdefault("pp", {})["stage"] = declared["pp_stage"]
        layout.coordinates.setdefault("pp", int(declared["pp_stage"]))
    for key in ("schedule", "microbatches"):
        if declared.get(key) is not None:
            out.setdefault("pp", {})[key] = declared[key]
    if declared.get("pp_degree") is not None:
        out.setdefault("pp", {})["num_stages"] = declared["pp_degree"]
    for kind, coord in coords.items():
        layout.coordinates[kind] = coord
    if isinstance(declared.get("strategy"), str):
        layout.strategy(declared["strategy"])


def _set_degrees(out: dict[str, Any], layout: _Layout, world: int) -> None:
    """The degrees, coordinates and sources known; the degrees not seen are 1 when those seen
    account for the whole world."""
    if _prod(list(layout.degrees.values())) == world:
        for kind in _DEGREES:
            if kind not in layout.degrees:
                layout.set(kind, 1, 0, "rest")
    degrees = {kind: layout.degrees[kind] for kind in (*_DEGREES, "ep") if kind in layout.degrees}
    out["degrees"] = degrees
    coordinates = layout.coordinates
    out["coordinates"] = {kind: coordinates[kind] for kind in degrees if kind in coordinates}
    out["sources"] = {kind: layout.sources[kind] for kind in degrees}


def _prod(sizes: list[int]) -> int:
    product = 1
    for size in sizes:
        product *= int(size)
    return product


def _parallel_layout_or_error(rank: int, world: int) -> dict[str, Any]:
    try:
        return parallel_layout()
    except Exception as exc:
        # detection is a nicety: the dump goes on without it
        return {"world_size": world, "rank": rank, "error": f"{type(exc).__name__}: {exc}"}
