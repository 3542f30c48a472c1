"""Read a snapshot file into one internal form, whatever PyTorch version wrote it.

This is the only module that knows the on-disk format: pickle protocols, compression, JSON
exports, and the shapes of 1.13 (a bare list of segments), 2.0 (blocks with ``history``) and
2.1+ (blocks with ``address``/``frames``/``requested_size``). Everything downstream sees a
:class:`Snapshot` whose segments and blocks always carry the same keys.
"""

from __future__ import annotations

import json
import lzma
import pickle
import struct
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._gc import gc_paused
from ..errors import SnapshotFormatError
from ..progress import NullProgress, ProgressSink
from .compression import open_decompressed, sniff_compression
from .sidecar import load_sidecar
from .unpickler import ForbiddenGlobalError, ForbiddenPersistentIdError, safe_load

BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
# Docstrings of torch 2.1+ call the pending state "active_awaiting_free"; the producer emits
# "active_pending_free". Accept both.
_STATE_ALIASES = {"active_awaiting_free": "active_pending_free"}


@dataclass(frozen=True)
class SourceInfo:
    """Where a snapshot came from and what kind of file it was."""

    path: str
    file_size_bytes: int
    compression: str | None  # None, 'gzip', 'xz', 'zstd', 'bz2'
    encoding: str  # 'pickle' or 'json'
    pickle_protocol: int | None


@dataclass
class Snapshot:
    """A loaded snapshot in the one internal form.

    ``segments``: list of dicts with keys ``device, address, total_size, stream, segment_type,
    segment_pool_id (tuple), is_expandable, frames (list), blocks``; each block a dict with
    ``address, size, requested_size, state, frames``. ``device_traces``: one list of entry dicts
    per device ordinal (possibly empty lists). Entry dicts are passed through as PyTorch wrote
    them; ``frames`` lists and frame dicts are shared objects and must not be mutated.
    """

    source: SourceInfo
    segments: list[dict[str, Any]]
    device_traces: list[list[dict[str, Any]]]
    allocator_settings: dict[str, Any] | None
    external_annotations: list[dict[str, Any]]
    format_hints: list[str] = field(default_factory=list)
    legacy: str | None = None  # '1.13' or '2.0' when a legacy shape was normalised
    capture: dict[str, Any] | None = None  # the snapshot_lab.capture sidecar, when there is one


def _pickle_protocol(head: bytes) -> int | None:
    if len(head) >= 2 and head[0] == 0x80:
        return head[1]
    return None


def _describe_unpickle_error(exc: BaseException) -> str:
    if isinstance(exc, ForbiddenGlobalError):
        return (
            f"refused: the pickle references the Python global '{exc}' — a memory snapshot "
            "contains only plain data, and loading this file could run code"
        )
    if isinstance(exc, ForbiddenPersistentIdError):
        return f"refused: the pickle uses persistent references ({exc}); not a memory snapshot"
    if isinstance(exc, EOFError):
        return "truncated file: the data ends before the pickle is complete"
    text = str(exc)
    if "truncated" in text or "ran out of input" in text.lower():
        return "truncated file: the data ends before the pickle is complete"
    if isinstance(exc, (lzma.LZMAError, zlib.error, OSError)):
        return f"corrupt compressed data ({type(exc).__name__}: {text[:120]})"
    return f"not a valid pickle ({type(exc).__name__}: {text[:120]})"


@contextmanager
def _watch_position(raw: Any, progress: ProgressSink) -> Iterator[None]:
    """Report how far into the file the reader is. The C unpickler holds the GIL but releases it
    at every file read, which is when this thread gets to run."""
    if isinstance(progress, NullProgress):
        yield
        return
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.1):
            try:
                progress.update(raw.tell())
            except (OSError, ValueError):
                return

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()


def _read_object(path: Path, progress: ProgressSink) -> tuple[Any, SourceInfo]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
    except FileNotFoundError:
        raise SnapshotFormatError(path, "no such file") from None
    except IsADirectoryError:
        raise SnapshotFormatError(path, "is a directory, not a snapshot file") from None
    except PermissionError:
        raise SnapshotFormatError(path, "permission denied") from None
    except OSError as exc:
        raise SnapshotFormatError(path, f"cannot read: {exc.strerror or exc}") from None
    if not path.is_file():
        raise SnapshotFormatError(path, "not a regular file")
    if size == 0:
        raise SnapshotFormatError(path, "empty file (0 bytes)")
    compression = sniff_compression(head)
    progress.stage(f"Reading {path.name}", total=size)
    try:
        raw = path.open("rb")
        with open_decompressed(raw, compression) as stream, _watch_position(raw, progress):
            first = stream.peek(8)[:8] if hasattr(stream, "peek") else b""
            if not first:
                raise SnapshotFormatError(path, "empty after decompression")
            stripped = first.lstrip()
            if stripped[:1] in (b"{", b"[") and _pickle_protocol(first) is None:
                obj = json.load(stream)
                return obj, SourceInfo(str(path), size, compression, "json", None)
            protocol = _pickle_protocol(first)
            if protocol is None and first[:1] not in (b"(", b"]", b"}", b"l", b"d"):
                raise SnapshotFormatError(
                    path,
                    "not a PyTorch memory snapshot: neither a pickle nor JSON"
                    + (f" (compressed with {compression})" if compression else "")
                    + f"; file starts with {first[:8]!r}",
                )
            with gc_paused():
                obj = safe_load(stream)
            return obj, SourceInfo(str(path), size, compression, "pickle", protocol)
    except SnapshotFormatError:
        raise
    except json.JSONDecodeError as exc:
        raise SnapshotFormatError(path, f"invalid JSON at line {exc.lineno}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise SnapshotFormatError(path, "not a valid pickle or JSON (undecodable text)") from None
    except MemoryError:
        raise SnapshotFormatError(path, "ran out of memory while reading the file") from None
    except RecursionError:
        raise SnapshotFormatError(path, "refused: nesting too deep to be a memory snapshot") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
        OverflowError,
        struct.error,
        lzma.LZMAError,
        zlib.error,
        OSError,
    ) as exc:
        raise SnapshotFormatError(path, _describe_unpickle_error(exc)) from None
    except Exception as exc:  # zstandard.ZstdError and friends have no common base
        if type(exc).__module__.startswith(("zstandard", "compression")):
            raise SnapshotFormatError(path, f"corrupt zstd data ({exc})") from None
        raise


def _type_name(obj: Any) -> str:
    return type(obj).__name__


_INT64_MAX = 2**63 - 1


def _is_count(v: Any) -> bool:
    """A non-negative int that fits the frames' int64 columns (bools are not counts)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _INT64_MAX


def _is_int64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_INT64_MAX <= v <= _INT64_MAX


def _normalise_block(block: Any, seg_addr: int, offset: int, path: Path, where: str) -> dict[str, Any]:
    if not isinstance(block, dict):
        raise SnapshotFormatError(path, f"{where}: block is a {_type_name(block)}, expected a dict")
    size = block.get("size")
    state = block.get("state")
    if not _is_count(size):
        raise SnapshotFormatError(path, f"{where}: block 'size' is {str(size)[:40]!r}, expected a non-negative int")
    if not isinstance(state, str):
        raise SnapshotFormatError(path, f"{where}: block 'state' is {state!r}, expected a string")
    state = _STATE_ALIASES.get(state, state)
    if state not in BLOCK_STATES:
        raise SnapshotFormatError(path, f"{where}: unknown block state {state[:60]!r}")
    frames = block.get("frames")
    requested = block.get("requested_size")
    if frames is None:
        history = block.get("history")
        if isinstance(history, list) and history and isinstance(history[0], dict):
            frames = history[0].get("frames")
            if requested is None:
                requested = history[0].get("real_size")
    if requested is None:
        requested = size
    if not _is_int64(requested):
        raise SnapshotFormatError(path, f"{where}: block 'requested_size' is {str(requested)[:40]!r}, expected an int")
    address = block.get("address")
    derived = seg_addr + offset
    if address is None:
        address = derived
    elif not _is_count(address):
        raise SnapshotFormatError(path, f"{where}: block 'address' is {str(address)[:40]!r}, expected an int")
    elif address != derived:
        raise SnapshotFormatError(
            path, f"{where}: block address {address:#x} does not follow its neighbours (expected {derived:#x})"
        )
    return {
        "address": address,
        "size": size,
        "requested_size": requested,
        "state": state,
        "frames": frames if isinstance(frames, list) else [],
    }


def _normalise_segment(seg: Any, path: Path, index: int) -> dict[str, Any]:
    where = f"segment {index}"
    if not isinstance(seg, dict):
        raise SnapshotFormatError(path, f"{where} is a {_type_name(seg)}, expected a dict")
    address = seg.get("address")
    total = seg.get("total_size")
    blocks = seg.get("blocks")
    for key, val in (("address", address), ("total_size", total)):
        if not _is_count(val):
            raise SnapshotFormatError(path, f"{where}: '{key}' is {str(val)[:40]!r}, expected a non-negative int")
    assert isinstance(address, int) and isinstance(total, int)  # for the type checker
    if not isinstance(blocks, list):
        raise SnapshotFormatError(path, f"{where}: 'blocks' is {_type_name(blocks)}, expected a list")
    out_blocks = []
    offset = 0
    for j, b in enumerate(blocks):
        nb = _normalise_block(b, address, offset, path, f"{where} block {j}")
        offset += nb["size"]
        out_blocks.append(nb)
    if offset != total:
        raise SnapshotFormatError(path, f"{where}: its blocks add up to {offset} bytes but 'total_size' is {total}")
    seg_type = seg.get("segment_type", "large")
    if seg_type not in ("small", "large"):
        raise SnapshotFormatError(path, f"{where}: unknown segment_type {str(seg_type)[:40]!r}")
    pool_id = seg.get("segment_pool_id", (0, 0))
    if isinstance(pool_id, list):
        pool_id = tuple(pool_id)
    if not (isinstance(pool_id, tuple) and len(pool_id) == 2 and all(_is_int64(x) for x in pool_id)):
        raise SnapshotFormatError(path, f"{where}: 'segment_pool_id' is {str(pool_id)[:40]!r}, expected two ints")
    device = seg.get("device", 0)
    stream = seg.get("stream", 0)
    if not _is_count(device) or device > 65535 or not _is_int64(stream):
        raise SnapshotFormatError(path, f"{where}: 'device' and 'stream' must be ints")
    frames = seg.get("frames")
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "stream": stream,
        "segment_type": seg_type,
        "segment_pool_id": pool_id,
        "is_expandable": bool(seg.get("is_expandable", False)),
        "frames": frames if isinstance(frames, list) else [],
        "blocks": out_blocks,
    }


def _format_hints(data: dict[str, Any], segments: list[dict[str, Any]], traces: list[list[Any]]) -> list[str]:
    hints = []
    if "allocator_settings" in data:
        hints.append("allocator_settings (torch>=2.3)")
    if "external_annotations" in data:
        hints.append("external_annotations (torch>=2.5)")
    first = next((t[0] for t in traces if t), None)
    if isinstance(first, dict):
        if "time_us" in first:
            hints.append("time_us (torch>=2.2)")
        if "compile_context" in first:
            hints.append("compile_context (torch>=2.8)")
        if "user_metadata" in first:
            hints.append("user_metadata (torch>=2.10)")
    return hints


def normalise(obj: Any, source: SourceInfo) -> Snapshot:
    """Turn an unpickled object into a :class:`Snapshot` or raise SnapshotFormatError."""
    path = Path(source.path)
    legacy = None
    if isinstance(obj, list):  # torch 1.13, or torch.cuda.memory_snapshot() output
        data: dict[str, Any] = {"segments": obj, "device_traces": []}
        legacy = "1.13"
    elif isinstance(obj, dict):
        data = obj
    else:
        raise SnapshotFormatError(
            path, f"not a PyTorch memory snapshot: the file holds a {_type_name(obj)}, expected a dict"
        )
    raw_segments = data.get("segments")
    if raw_segments is None:
        keys = ", ".join(sorted(str(k)[:30] for k in list(data)[:8]))
        raise SnapshotFormatError(
            path, f"not a PyTorch memory snapshot: no 'segments' key (found keys: {keys or 'none'})"
        )
    if not isinstance(raw_segments, list):
        raise SnapshotFormatError(path, f"'segments' is a {_type_name(raw_segments)}, expected a list")
    segments = [_normalise_segment(s, path, i) for i, s in enumerate(raw_segments)]
    if legacy is None and any(isinstance(b, dict) and "history" in b for s in raw_segments for b in s["blocks"]):
        legacy = "2.0"
    traces = data.get("device_traces", [])
    if traces is None:
        traces = []
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotFormatError(path, "'device_traces' must be a list with one list of events per device")
    settings = data.get("allocator_settings")
    if settings is not None and not isinstance(settings, dict):
        raise SnapshotFormatError(path, f"'allocator_settings' is a {_type_name(settings)}, expected a dict")
    annotations = data.get("external_annotations") or []
    if not isinstance(annotations, list):
        raise SnapshotFormatError(path, "'external_annotations' must be a list")
    return Snapshot(
        source=source,
        segments=segments,
        device_traces=traces,
        allocator_settings=settings,
        external_annotations=[a for a in annotations if isinstance(a, dict)],
        format_hints=_format_hints(data, segments, traces),
        legacy=legacy,
    )


def load_snapshot(path: str | Path, progress: ProgressSink | None = None) -> Snapshot:
    """Load a snapshot file (pickle or JSON, optionally gzip/xz/zstd/bz2-compressed) safely.

    Raises :class:`~snapshot_lab.errors.SnapshotFormatError` for anything that is not a
    readable snapshot, including pickles that reference Python globals.
    """
    p = Path(path)
    obj, source = _read_object(p, progress or NullProgress())
    snap = normalise(obj, source)
    snap.capture = load_sidecar(p)
    return snap
