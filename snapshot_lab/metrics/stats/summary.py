"""The ``stats`` result: torch's counters, fragmentation and OOM cause, per device and overall."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ...frames import SnapshotFrames
from ..attribution.annotations import AnnotatedAllocation, annotated_allocations
from ..attribution.modules import ModuleBreakdown, module_breakdown
from ..categories import CATEGORIES, CategoryRules, categories_at_peak, compute_categories
from ..categories.kv_cache import KvCacheGrowth, kv_cache_growth
from ..history.compiled import CompiledRegion
from ..history.stages import Stages
from ..parallel.parallelism import detect_parallel
from ..recording import Recording, recording_of
from .fragmentation import PoolFragmentation, compute_fragmentation
from .host import HostMemory, compute_host_memory
from .oom import OomAnalysis, analyse_device_oom
from .torch_stats import compute_torch_stats


@dataclass(frozen=True)
class DeviceStats:
    device: int
    torch_stats: dict[str, int]
    fragmentation: dict[str, PoolFragmentation]
    oom: OomAnalysis | None
    private_pool_reserved_bytes: int
    expandable_reserved_bytes: int
    # (total_size_bytes, n_blocks) of the large pool's non-expandable segments, for advice
    large_segments: tuple[tuple[int, int], ...] = ()
    categories: dict[str, int] | None = None  # allocated bytes at the dump by category
    categories_requested: dict[str, int] | None = None  # what those blocks' tensors requested
    modules: ModuleBreakdown | None = None  # bytes by module at the trace's peak (metrics.modules)
    # requested bytes by category at the trace's peak (memory older than the trace included)
    categories_at_peak: dict[str, int] | None = None
    kv_cache_growth: KvCacheGrowth | None = None  # inference: the KV cache per decode step

    def split_segments_larger_than(self, size_bytes: int) -> int:
        """How many large-pool segments bigger than ``size_bytes`` are split into several blocks."""
        return sum(1 for total, n in self.large_segments if total > size_bytes and n > 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch_stats": self.torch_stats,
            "fragmentation": {k: v.to_dict() for k, v in self.fragmentation.items()},
            "oom": self.oom.to_dict() if self.oom else None,
            "private_pool_reserved_bytes": self.private_pool_reserved_bytes,
            "expandable_reserved_bytes": self.expandable_reserved_bytes,
            "categories": self.categories,
            "categories_requested": self.categories_requested,
            "modules": self.modules.to_dict() if self.modules else None,
            "categories_at_peak": self.categories_at_peak,
            "kv_cache_growth": self.kv_cache_growth.to_dict() if self.kv_cache_growth else None,
        }


@dataclass(frozen=True)
class SnapshotStats:
    """Everything ``snaplab stats`` prints. ``torch_stats``/``fragmentation``/``oom`` at the top
    level are those of the only device, or the sum over devices for several devices."""

    file: dict[str, Any]
    recording: Recording
    torch_stats: dict[str, int]
    fragmentation: dict[str, PoolFragmentation]
    oom: OomAnalysis | None
    devices: dict[int, DeviceStats]
    categories: dict[str, int]
    categories_requested: dict[str, int] | None = None
    parallel: dict[str, Any] | None = None  # the parallel layout (metrics.parallelism)
    host: HostMemory | None = None  # pinned host memory (torch >= 2.14), beside the devices'
    # memory by record_function range, per device (metrics.history.stages); only when asked for
    stages: dict[int, Stages] | None = None
    # memory by compiled region (metrics.history.compiled); only when asked for
    compiled_regions: list[CompiledRegion] | None = None
    # what _annotate_tensor attached to allocations (torch >= 2.14); None: the file has none
    annotations: list[AnnotatedAllocation] | None = None
    # the user's category rules the categories were labelled with first (None: the built-in only)
    category_rules: CategoryRules | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "file": self.file,
            "recording": self.recording.to_dict(),
            "torch_stats": self.torch_stats,
            "fragmentation": {k: v.to_dict() for k, v in self.fragmentation.items()},
            "oom": self.oom.to_dict() if self.oom else None,
            "categories": self.categories,
            "categories_requested": self.categories_requested,
            "parallel": self.parallel,
            "devices": {str(d): s.to_dict() for d, s in self.devices.items()},
        }
        if self.host is not None:  # only files with host data carry the key
            out["host"] = self.host.to_dict()
        if self.stages is not None:  # only when asked for (stats --stages)
            out["stages"] = {str(d): st.to_dict() for d, st in self.stages.items()}
        if self.compiled_regions is not None:  # only when asked for (stats --compiled-regions)
            out["compiled_regions"] = [region.to_dict() for region in self.compiled_regions]
        if self.annotations:  # only files with annotate entries carry the key
            out["annotations"] = [item.to_dict() for item in self.annotations]
        if self.category_rules is not None:  # only when asked for (stats --category)
            out["category_rules"] = self.category_rules.to_dict()
        return out


def file_facts(frames: SnapshotFrames) -> dict[str, Any]:
    info = frames.info
    return {
        "path": info.source.path,
        "file_size_bytes": info.source.file_size_bytes,
        "compression": info.source.compression,
        "encoding": info.source.encoding,
        "pickle_protocol": info.source.pickle_protocol,
        "legacy_format": info.legacy,
        "format_hints": list(info.format_hints),
        "allocator_settings": info.allocator_settings,
        "devices": list(info.devices),
        "segments": len(frames.segments),
        "blocks": len(frames.blocks),
        "trace_entries": len(frames.events),
        "distinct_stacks": int(frames.stacks["stack_id"].nunique()),
        "capture": _capture_facts(info.capture),
        **({"backend": frames.backend} if frames.backend else {}),  # only when the file names one
    }


def _capture_facts(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the capture sidecar says about the job (its memory_stats stay out: the snapshot's
    own numbers are the ones reported)."""
    if not meta:
        return None
    keys = (
        "torch_version",
        "host",
        "rank",
        "world_size",
        "local_rank",
        "reason",
        "step",
        "time_unix_s",
        "alloc_conf",
        "argv",
        "oom",
    )
    return {k: meta[k] for k in keys if k in meta}


def failing_first(per_device: dict[int, DeviceStats]) -> dict[int, DeviceStats]:
    """The devices with the one that ran out of memory first (the latest OOM first when several
    did), then the others in index order: every view that walks the devices (the what-if, the
    findings, the report) leads with the failing one."""

    def key(item: tuple[int, DeviceStats]) -> tuple[int, int, int]:
        dev, ds = item
        if ds.oom is None:
            return (1, 0, dev)
        return (0, -(ds.oom.time_us or 0), -dev)  # the latest OOM, as SnapshotStats.oom picks it

    return dict(sorted(per_device.items(), key=key))


def compute_stats(frames: SnapshotFrames, recording: Callable[[], Recording] | None = None) -> SnapshotStats:
    """All of ``stats`` for one snapshot; ``recording`` gives :func:`~..recording.recording_of`'s
    answer when it is computed elsewhere (beside the rest: the API forks a child for it)."""
    seg, blk = frames.segments, frames.blocks
    # first, before the categories and modules keep their memoised arrays: its working memory
    # (at 5M entries about 200 MiB) then comes on top of less
    if recording is None:
        described = recording_of(frames)
        recording = lambda: described  # noqa: E731
    per_device = {}
    for d in frames.info.devices:
        s = seg[seg["device"] == d]
        b = blk[blk["device"] == d]
        per_device[d] = DeviceStats(
            device=d,
            torch_stats=compute_torch_stats(s, b),
            fragmentation=compute_fragmentation(s, b),
            oom=analyse_device_oom(frames, d),
            private_pool_reserved_bytes=int(s.loc[s["is_private_pool"], "total_size_bytes"].sum()),
            expandable_reserved_bytes=int(s.loc[s["is_expandable"], "total_size_bytes"].sum()),
            large_segments=tuple(
                (int(t), int(n))
                for t, n in s.loc[
                    (s["pool"] == "large") & ~s["is_expandable"], ["total_size_bytes", "n_blocks"]
                ].itertuples(index=False)
            ),
            categories=(cats := compute_categories(frames, d, with_timeline=False)).live_bytes,
            categories_requested=cats.live_requested_bytes,
            modules=module_breakdown(frames, d) if d in frames.info.trace_devices else None,
            categories_at_peak=categories_at_peak(frames, d) if d in frames.info.trace_devices else None,
            kv_cache_growth=kv_cache_growth(frames, d),
        )
    per_device = failing_first(per_device)
    if len(per_device) == 1:
        only = next(iter(per_device.values()))
        torch_stats, frag, oom = only.torch_stats, only.fragmentation, only.oom
    else:
        torch_stats = compute_torch_stats(seg, blk)
        frag = compute_fragmentation(seg, blk)
        ooms = [ds.oom for ds in per_device.values() if ds.oom is not None]
        oom = max(ooms, key=lambda o: (o.time_us or 0, o.device)) if ooms else None
    return SnapshotStats(
        file=file_facts(frames),
        recording=recording(),
        torch_stats=torch_stats,
        fragmentation=frag,
        oom=oom,
        devices=per_device,
        categories=_summed(per_device, "categories", CATEGORIES),
        categories_requested=_summed(per_device, "categories_requested", CATEGORIES),
        parallel=detect_parallel(frames).to_dict(),
        host=compute_host_memory(frames),
        annotations=annotated_allocations(frames) or None,
    )


def _summed(per_device: dict[int, DeviceStats], field: str, names: tuple[str, ...]) -> dict[str, int]:
    """One of the devices' category dicts (``categories``, ``categories_requested``) summed."""
    return {c: sum((getattr(ds, field) or {}).get(c, 0) for ds in per_device.values()) for c in names}


def with_category_rules(stats: SnapshotStats, frames: SnapshotFrames, rules: CategoryRules) -> SnapshotStats:
    """``stats`` with its categories (at the dump, requested, at the peak) labelled by the user's
    ``rules`` first (:mod:`~snapshot_lab.metrics.categories.custom`); their categories follow the
    built-in ones. What the analyses read stays :func:`compute_stats`' own."""
    devices = {}
    for d, ds in stats.devices.items():
        cats = compute_categories(frames, d, with_timeline=False, rules=rules)
        devices[d] = replace(
            ds,
            categories=cats.live_bytes,
            categories_requested=cats.live_requested_bytes,
            categories_at_peak=None if ds.categories_at_peak is None else categories_at_peak(frames, d, rules),
        )
    return replace(
        stats,
        devices=devices,
        categories=_summed(devices, "categories", rules.names),
        categories_requested=_summed(devices, "categories_requested", rules.names),
        category_rules=rules,
    )
