"""Read a snapshot file into one internal form, whatever PyTorch version wrote it.

This is the only module that knows the on-disk format: pickle protocols, compression, JSON
exports, and the shapes of 1.13 (a bare list of segments), 2.0 (blocks with ``history``) and
2.1+ (blocks with ``address``/``frames``/``requested_size``). Everything downstream sees a
:class:`Snapshot` whose segments and blocks always carry the same keys.
"""

from __future__ import annotations

import io
import json
import lzma
import math
import mmap
import os
import pickle
import struct
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

from .._gc import gc_paused
from ..errors import SnapshotFormatError
from ..progress import NullProgress, ProgressSink
from .compression import open_decompressed, sniff_compression, stated_size
from .decoded import DecodedTraces, decode_pickle
from .guard import (
    MEMORY_PER_BYTE,
    MEMORY_SLACK,
    BoundedReader,
    ExpansionLimitError,
    decompressed_ceiling,
    memory_limited,
)
from .sidecar import load_sidecar
from .unpickler import ForbiddenGlobalError, ForbiddenPersistentIdError, safe_load
from .validate import (
    INT64_MIN,
    MAX_DEVICE,
    UINT64_MAX,
    FieldError,
    check_bool,
    check_dict,
    check_int,
    check_list,
    check_number,
    check_str,
    describe,
    key_path,
    key_repr,
)

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
    data_size_bytes: int | None = None  # after decompression; None when not known


@dataclass
class Snapshot:
    """A loaded snapshot in the one internal form.

    When the compiled reader decoded the traces (``decoded_traces`` is set), the entry dicts were
    never built: ``device_traces`` is then loaded again on first access, the slow way.

    ``segments``: list of dicts with keys ``device, address, total_size, stream, segment_type,
    segment_pool_id (tuple), is_expandable, frames (list), forward_frames (list of str or None),
    blocks``; each block a dict with ``address, size, requested_size, state, frames,
    forward_frames``, every value checked. ``device_traces``: one list of entry dicts per device
    ordinal (possibly empty lists). Entry dicts are passed through as PyTorch wrote them and are
    checked column by column when the frames are built; ``frames`` lists and frame dicts are
    shared objects and must not be mutated. ``allocator_settings`` and ``external_annotations``
    are checked copies (an annotation: ``device, time_us (or None), stage, name``).
    """

    source: SourceInfo
    segments: list[dict[str, Any]]
    device_traces: list[list[dict[str, Any]]]
    allocator_settings: dict[str, Any] | None
    external_annotations: list[dict[str, Any]]
    format_hints: list[str] = field(default_factory=list)
    legacy: str | None = None  # '1.13' or '2.0' when a legacy shape was normalised
    capture: dict[str, Any] | None = None  # the snapshot_lab.capture sidecar, when there is one
    # the traces read straight into columns (load/_decode.c); then ``device_traces`` is read
    # again from the file, with the Python reader, only if something asks for it
    decoded_traces: DecodedTraces | None = None
    # pinned host memory (torch >= 2.14, record_pinned_host_memory=True): segments checked as the
    # device's (device -1, one block each); entry dicts passed through like device_traces'
    host_segments: list[dict[str, Any]] = field(default_factory=list)
    host_traces: list[dict[str, Any]] = field(default_factory=list)
    backend: str | None = None  # the accelerator the file names (see detect_backend); None: CUDA or unsaid
    # the window asked for (load_snapshot's max_entries; None: every entry), and how many of each
    # device's first trace entries it left out (one count per device ordinal; () without a window)
    max_entries: int | None = None
    entries_left_out: tuple[int, ...] = ()

    def __getattr__(self, name: str) -> Any:
        # only called when ``device_traces`` was left out because the traces were decoded
        if name == "device_traces" and self.__dict__.get("decoded_traces") is not None:
            obj, source, _ = _read_object(Path(self.source.path), NullProgress(), decode=False)
            fresh = normalise(obj, source, max_entries=self.max_entries)
            # every part from the same reading, so objects are shared across them as in the file
            for part in ("segments", "device_traces", "allocator_settings", "external_annotations"):
                setattr(self, part, getattr(fresh, part))
            return fresh.device_traces
        raise AttributeError(name)


def _pickle_protocol(head: bytes) -> int | None:
    if len(head) >= 2 and head[0] == 0x80:
        return head[1]
    return None


def _describe_unpickle_error(exc: BaseException) -> str:
    if isinstance(exc, ForbiddenGlobalError):
        return (
            f"refused: the pickle references the Python global '{_one_line(str(exc), 80)}' — a memory snapshot "
            "contains only plain data, and loading this file could run code"
        )
    if isinstance(exc, ForbiddenPersistentIdError):
        return f"refused: the pickle uses persistent references ({_one_line(str(exc), 80)}); not a memory snapshot"
    if isinstance(exc, EOFError):
        return "truncated file: the data ends before the pickle is complete"
    text = _one_line(str(exc), 400)
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


def _read_object(
    path: Path, progress: ProgressSink, decode: bool = True, max_entries: int | None = None
) -> tuple[Any, SourceInfo, DecodedTraces | None]:
    """The unpickled (or JSON) object, where it came from, and its traces when the compiled
    reader decoded them into columns (``decode``; each device's last ``max_entries`` only, when
    given); else the restricted unpickler reads it."""
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
    window = "" if max_entries is None else f", keeping each trace's last {max_entries:,} entries"
    progress.stage(f"Reading {path.name}{window}", total=size)
    # the most bytes the data can have: the file's size, or a ceiling on what decompresses
    ceiling = size if compression is None else decompressed_ceiling(size)
    try:
        with path.open("rb") as raw:
            fast = _decode_whole(raw, size, compression, ceiling, progress, max_entries) if decode else None
            if fast is not None:
                obj, traces, data_size, protocol = fast
                return obj, SourceInfo(str(path), size, compression, "pickle", protocol, data_size), traces
            raw.seek(0)
            return (*_read_stream(path, raw, size, compression, ceiling, progress), None)
    except SnapshotFormatError:
        raise
    except ExpansionLimitError as exc:
        raise SnapshotFormatError(
            path,
            f"refused: decompresses to {exc}, over {ceiling // size:,} times the file's size (a decompression bomb?)",
        ) from None
    except MemoryError:
        raise SnapshotFormatError(
            path, f"refused: reading it needs more memory than {size:,} bytes of snapshot can (a pickle bomb?)"
        ) from None
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
            raise SnapshotFormatError(path, f"corrupt zstd data ({_one_line(str(exc))})") from None
        raise


def _decode_whole(
    raw: IO[bytes],
    size: int,
    compression: str | None,
    ceiling: int,
    progress: ProgressSink | None = None,
    max_entries: int | None = None,
) -> tuple[Any, DecodedTraces | None, int, int | None] | None:
    """The compiled reader's ``(object, traces, data size, protocol)`` of a pickle, or None when
    it is not a pickle, the reader is not built, or it gives up on anything irregular (the
    streaming reader then starts over and gives the reference result or error). A plain file is
    mapped, not read; a compressed one is decompressed first, into a temporary file that is then
    mapped (any failure there: None).
    ``progress`` is told the bytes of the file read so far: the mapped file's offset as the
    reader moves through it, or the compressed bytes taken from the file."""
    progress = progress or NullProgress()
    on_progress = None if isinstance(progress, NullProgress) else progress.update
    budget = MEMORY_PER_BYTE * ceiling + MEMORY_SLACK
    try:
        if compression is None:
            head = raw.read(8)
            if _pickle_protocol(head) is None:
                return None
            # mapped before the address-space limit is set: the mapping is not what it guards
            with mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) as mapped, gc_paused(), memory_limited(budget):
                out = decode_pickle(mapped, mapped_file=True, on_progress=on_progress, max_entries=max_entries)
            data_size = size
        else:
            stream = open_decompressed(raw, compression)
            head = stream.peek(8)[:8] if hasattr(stream, "peek") else b""
            if _pickle_protocol(head) is None:
                return None
            bounded = BoundedReader(stream, ceiling)
            out, data_size = _decode_decompressed(raw, bounded, budget, on_progress, max_entries)
    except Exception:  # whatever went wrong, the streaming reader starts over and says it exactly
        return None
    if out is None:
        return None
    return out[0], out[1], data_size, _pickle_protocol(head)


def _spool() -> IO[bytes] | None:
    """An anonymous temporary file to decompress into, or None where none can be made."""
    try:
        return tempfile.TemporaryFile(prefix="snaplab-")
    except OSError:
        return None


def _decode_decompressed(
    raw: IO[bytes],
    bounded: BoundedReader,
    budget: int,
    on_progress: Callable[[int], object] | None,
    max_entries: int | None = None,
) -> tuple[tuple[Any, DecodedTraces | None] | None, int]:
    """The compiled reader's result for a compressed pickle, and its decompressed size. The data
    goes to a temporary file that is then mapped and read like a plain file (its pages given
    back as they are read), so the decompressed bytes do not stay in this process's memory;
    where no temporary file can be made, they are gathered in memory."""
    spool = _spool()
    if spool is None:
        data = bytearray()
        with memory_limited(budget):
            _drain(bounded, data.extend, raw, on_progress)
        with gc_paused(), memory_limited(budget):
            return decode_pickle(data, max_entries=max_entries), len(data)
    with spool:
        _drain(bounded, spool.write, raw, on_progress)
        spool.flush()
        data_size = spool.tell()
        with mmap.mmap(spool.fileno(), 0, access=mmap.ACCESS_READ) as mapped, gc_paused(), memory_limited(budget):
            return decode_pickle(mapped, mapped_file=True, max_entries=max_entries), data_size


def _drain(
    bounded: BoundedReader,
    write: Callable[[bytes], object],
    raw: IO[bytes],
    on_progress: Callable[[int], object] | None,
) -> None:
    """Every decompressed byte of ``bounded`` to ``write``, in chunks of 4 MiB, telling
    ``on_progress`` how far into the compressed file ``raw`` the reading has come."""
    while chunk := bounded.read(4 << 20):
        write(chunk)
        if on_progress is not None:
            on_progress(raw.tell())


def _read_stream(
    path: Path, raw: IO[bytes], size: int, compression: str | None, ceiling: int, progress: ProgressSink
) -> tuple[Any, SourceInfo]:
    bounded: BoundedReader | None = None
    stream = open_decompressed(raw, compression)
    if compression is not None:
        bounded = BoundedReader(stream, ceiling)
        stream = io.BufferedReader(bounded, buffer_size=1 << 20)
    with stream, _watch_position(raw, progress):
        first = stream.peek(8)[:8] if hasattr(stream, "peek") else b""
        if not first:
            raise SnapshotFormatError(path, "empty after decompression")
        stripped = first.lstrip()
        protocol = _pickle_protocol(first)
        if stripped[:1] in (b"{", b"[") and protocol is None:
            try:
                with memory_limited(MEMORY_PER_BYTE * ceiling + MEMORY_SLACK):
                    obj = json.load(stream)
            except json.JSONDecodeError as exc:
                raise SnapshotFormatError(path, f"invalid JSON at line {exc.lineno}: {exc.msg}") from None
            except UnicodeDecodeError:
                raise SnapshotFormatError(path, "invalid JSON: the text is not UTF-8") from None
            except ValueError as exc:  # e.g. a number of more than 4300 digits
                raise SnapshotFormatError(path, f"invalid JSON: {_one_line(str(exc))}") from None
            encoding = "json"
        else:
            if protocol is None and first[:1] not in (b"(", b"]", b"}", b"l", b"d"):
                raise SnapshotFormatError(
                    path,
                    "not a PyTorch memory snapshot: neither a pickle nor JSON"
                    + (f" (compressed with {compression})" if compression else "")
                    + f"; file starts with {first[:8]!r}",
                )
            with gc_paused(), memory_limited(MEMORY_PER_BYTE * ceiling + MEMORY_SLACK):
                obj = safe_load(stream)
            encoding = "pickle"
        data_size = size if bounded is None else bounded.consumed
        return obj, SourceInfo(str(path), size, compression, encoding, protocol, data_size)


def _one_line(text: str, limit: int = 120) -> str:
    """An exception's text made one printable line (it can quote the file's raw bytes)."""
    text = " ".join(text.split())[: limit * 4]
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."  # escaped first: \x00 is 4 characters


def _type_name(obj: Any) -> str:
    return type(obj).__name__


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


# A trace entry, a block or a segment takes at least this many bytes of pickle (or JSON) even
# when every key and value in it is a shared reference; a file holding more of them than its
# size allows repeats the same objects by reference (a "billion laughs" bomb), which would
# expand to gigabytes once turned into rows.
MIN_BYTES_PER_RECORD = 8


def _normalise_block(block: Any, seg_addr: int, offset: int) -> dict[str, Any]:
    """One block, checked; FieldErrors carry paths relative to the block."""
    b = check_dict(block, what="a block (a dict)")
    size = check_int(b.get("size"), 0, 2**63, "size")
    state = b.get("state")
    if type(state) is str:
        state = _STATE_ALIASES.get(state, state)
    if state not in BLOCK_STATES:
        raise FieldError("state", f"expected one of {', '.join(map(repr, BLOCK_STATES))}, got {describe(state)}")
    frames = b.get("frames")
    requested = b.get("requested_size")
    where_req = "requested_size"
    if frames is None and "history" in b:  # torch 1.13 / 2.0: the stack of the (last) allocation
        history = check_list(b["history"], "history")
        if history:
            h0 = check_dict(history[0], "history[0]")
            frames = h0.get("frames")
            if frames is not None:
                check_list(frames, "history[0].frames", "a list of frames")
            if requested is None and "real_size" in h0:
                requested, where_req = h0["real_size"], "history[0].real_size"
    elif frames is not None:
        check_list(frames, "frames", "a list of frames")
    if requested is None:
        requested = size
    elif state == "inactive":  # stale: the last use's request, or 0; never shown
        check_int(requested, 0, 2**63, where_req)
    else:
        check_int(requested, 0, size + 1, where_req)
    forward = b.get("forward_frames")
    if forward is not None:
        check_forward_frames(forward, "forward_frames")
    derived = seg_addr + offset
    address = b.get("address")
    if address is None:
        address = derived
    elif address != derived or type(address) is not int:
        check_int(address, 0, 2**63, "address")
        raise FieldError("address", f"expected {derived:#x} (the end of the block before it), got {address:#x}")
    return {
        "address": address,
        "size": size,
        "requested_size": requested,
        "state": state,
        "frames": frames if frames is not None else [],
        "forward_frames": forward,
    }


def _normalise_segment(seg: Any, seen: set[int], min_device: int = 0) -> dict[str, Any]:
    """One segment and its blocks, checked; FieldErrors carry paths relative to the segment."""
    s = check_dict(seg, what="a segment (a dict)")
    address = check_int(s.get("address"), 0, 2**63, "address")
    total = check_int(s.get("total_size"), 0, 2**63 - address, "total_size")
    blocks = check_list(s.get("blocks"), "blocks", "a list of blocks")
    if id(blocks) in seen:
        raise FieldError("blocks", "the same list object as another segment's blocks (a shared reference)")
    seen.add(id(blocks))
    out_blocks = []
    offset = 0
    for j, b in enumerate(blocks):
        if id(b) in seen:
            raise FieldError(f"blocks[{j}]", "the same block object appears twice (a shared reference)")
        seen.add(id(b))
        try:
            nb = _normalise_block(b, address, offset)
        except FieldError as exc:
            raise exc.under(f"blocks[{j}]") from None
        offset += nb["size"]
        if offset > total:
            raise FieldError(f"blocks[{j}]", f"the blocks run past the segment's total_size of {total}")
        out_blocks.append(nb)
    if offset != total:
        raise FieldError("total_size", f"the blocks add up to {offset} bytes but total_size is {total}")
    seg_type = s.get("segment_type", "large")
    if seg_type not in ("small", "large") or type(seg_type) is not str:
        raise FieldError("segment_type", f"expected 'small' or 'large', got {describe(seg_type)}")
    pool_id = s.get("segment_pool_id", (0, 0))
    if type(pool_id) not in (tuple, list) or len(pool_id) != 2:
        raise FieldError("segment_pool_id", f"expected two integers, got {describe(pool_id)}")
    pool_id = (
        check_int(pool_id[0], INT64_MIN, 2**63, "segment_pool_id[0]"),
        check_int(pool_id[1], INT64_MIN, 2**63, "segment_pool_id[1]"),
    )
    device = check_int(s.get("device", 0), min_device, MAX_DEVICE + 1, "device")
    stream = check_int(s.get("stream", 0), INT64_MIN, 2**63, "stream")
    expandable = check_bool(s.get("is_expandable", False), "is_expandable")
    frames = s.get("frames")
    if frames is not None:
        check_list(frames, "frames", "a list of frames")
    forward = s.get("forward_frames")
    if forward is not None:
        check_forward_frames(forward, "forward_frames")
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "stream": stream,
        "segment_type": seg_type,
        "segment_pool_id": pool_id,
        "is_expandable": expandable,
        "frames": frames if frames is not None else [],
        "forward_frames": forward,
        "blocks": out_blocks,
    }


def check_forward_frames(v: Any, path: str) -> list[str]:
    """``forward_frames`` (torch >= 2.11, anomaly mode): a list of formatted traceback strings."""
    lst = check_list(v, path, "a list of traceback strings")
    for k, item in enumerate(lst):
        if type(item) is not str:
            raise FieldError(f"{path}[{k}]", f"expected a traceback string, got {describe(item)}")
    return lst


# allocator_settings (torch >= 2.3): the keys snaplab reads, and what each must hold
_SETTING_BOOLS = (
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "graph_capture_record_stream_reuse",
    "trace_alloc_overflowed",  # after torch 2.14.1 (PR #179276): the ring buffer dropped events
)
# byte and count settings of newer torch (size_t, SIZE_MAX meaning unlimited as for max_split_size)
_SETTING_SIZES = ("max_round_threshold", "max_cached_size", "trace_alloc_max_entries")
_MAX_SETTING_ITEMS = 1024


def _plain(v: Any) -> bool:
    return v is None or type(v) in (str, int, bool) or (type(v) is float and math.isfinite(v))


def normalise_settings(settings: Any) -> dict[str, Any] | None:
    """``allocator_settings`` with every known key of its documented type (FieldError otherwise);
    unknown keys (newer torch) are kept when they hold plain values or a small flat list or dict
    of them, so they can be shown, and refused otherwise."""
    if settings is None:
        return None
    s = check_dict(settings, what="a dict of settings")
    out: dict[str, Any] = {}
    for key, v in s.items():
        where = key_path(key)
        if type(key) is not str:
            raise FieldError(where, "expected a setting name (a string) as key")
        if key == "PYTORCH_CUDA_ALLOC_CONF":
            out[key] = check_str(v, where)
        elif key == "max_split_size":  # bytes; -1 (SIZE_MAX cast to int64) means unlimited
            out[key] = -1 if v == UINT64_MAX and type(v) is int else check_int(v, -1, 2**63, where)
        elif key == "garbage_collection_threshold":
            out[key] = check_number(v, 0.0, 1.0, where)
        elif key in _SETTING_BOOLS:
            out[key] = check_bool(v, where)
        elif key in _SETTING_SIZES:
            out[key] = -1 if v == UINT64_MAX and type(v) is int else check_int(v, -1, 2**63, where)
        elif key == "pinned_num_register_threads":
            out[key] = check_int(v, 0, 2**31, where)
        elif key == "roundup_power2_divisions":
            divs = check_dict(v, where, "a dict of divisions per size interval")
            if len(divs) > _MAX_SETTING_ITEMS:
                raise FieldError(where, f"expected at most {_MAX_SETTING_ITEMS} intervals, got {len(divs):,}")
            clean = {}
            for k, d in divs.items():
                if type(k) is not str or not k.isdigit() or len(k) > 19:
                    raise FieldError(f"{where}[{key_repr(k)}]", "expected an interval label such as '1024' as key")
                clean[k] = check_int(d, 0, 2**31, f"{where}[{k!r}]")
            out[key] = clean
        elif _plain(v):
            out[key] = v
        elif type(v) in (list, tuple, dict) and len(v) <= _MAX_SETTING_ITEMS:
            items = v.items() if type(v) is dict else enumerate(v)
            for k, item in items:
                if not (_plain(k) and _plain(item)):
                    raise FieldError(f"{where}[{key_repr(k)}]", f"expected a plain value, got {describe(item)}")
            out[key] = dict(v) if type(v) is dict else list(v)
        else:
            raise FieldError(where, f"expected a plain value, got {describe(v)}")
    return out


def _normalise_annotation(a: Any) -> dict[str, Any]:
    """One ``external_annotations`` item (torch >= 2.5): ``{stage, name, device, time_us}``."""
    d = check_dict(a, what="an annotation (a dict)")
    out = {
        "device": check_int(d.get("device", 0), 0, MAX_DEVICE + 1, "device"),
        "time_us": None if d.get("time_us") is None else check_int(d["time_us"], 0, 2**63, "time_us"),
        "stage": check_str(d.get("stage", ""), "stage"),
        "name": check_str(d.get("name", ""), "name"),
    }
    return out


def _format_hints(data: dict[str, Any], traces: list[list[Any]], decoded: DecodedTraces | None) -> list[str]:
    hints = []
    if "allocator_settings" in data:
        hints.append("allocator_settings (torch>=2.3)")
    if "external_annotations" in data:
        hints.append("external_annotations (torch>=2.5)")
    first: Any = next((t[0] for t in traces if t), None)
    if decoded is not None:  # the keys of the first entry are all that is looked at
        first = next((dict.fromkeys(t.first_keys) for t in decoded.devices if t.size_of_trace), None)
    if isinstance(first, dict):
        if "time_us" in first:
            hints.append("time_us (torch>=2.2)")
        if "compile_context" in first:
            hints.append("compile_context (torch>=2.8)")
        if "user_metadata" in first:
            hints.append("user_metadata (torch>=2.10)")
        if "pool_id" in first:
            hints.append("pool_id (torch>=2.12)")
    if "host_segments" in data or "host_traces" in data:
        hints.append("host_segments (torch>=2.14)")
    settings = data.get("allocator_settings")
    if type(settings) is dict and "trace_alloc_overflowed" in settings:
        hints.append("trace_alloc_overflowed (torch>2.14.1)")
    return hints


def _check_record_budget(path: Path, source: SourceInfo, what: str, n: int) -> None:
    size = source.data_size_bytes
    if size is not None and n * MIN_BYTES_PER_RECORD > size:
        raise SnapshotFormatError(
            path,
            f"refused: {n:,} {what} in {size:,} bytes of data; each takes at least "
            f"{MIN_BYTES_PER_RECORD} bytes, so objects are repeated by reference (a pickle bomb?)",
        )


def _checked_traces(
    path: Path, source: SourceInfo, data: dict[str, Any], decoded: DecodedTraces | None
) -> list[list[Any]]:
    """``device_traces``: one list of entries per device, checked as lists (the entries are
    checked where the frames are built); stand-in empty lists when the traces were decoded."""
    traces = data.get("device_traces", [])
    if traces is None:
        traces = []
    check_list(traces, "device_traces", "a list with one list of events per device")
    if decoded is not None:
        traces = [[] for _ in decoded.devices]  # stand-ins: no shared lists, checked entries
    if len(traces) > MAX_DEVICE + 1:
        raise FieldError("device_traces", f"expected at most {MAX_DEVICE + 1} devices, got {len(traces):,}")
    for d, t in enumerate(traces):
        check_list(t, f"device_traces[{d}]", "a list of events")
    n_entries = sum(map(len, traces)) if decoded is None else sum(t.size_of_trace + t.left_out for t in decoded.devices)
    _check_record_budget(path, source, "trace entries", n_entries)
    if len(set(map(id, traces))) != len(traces):
        raise FieldError("device_traces", "the same event list appears for two devices (a shared reference)")
    return traces


def _windowed(
    traces: list[list[Any]], decoded: DecodedTraces | None, max_entries: int | None
) -> tuple[list[list[Any]], tuple[int, ...]]:
    """Each device's last ``max_entries`` trace entries (None: all), as if torch had recorded
    them with that ``max_entries``, and how many of each device's first entries were left out
    (() without a window). The compiled reader dropped them as it read (``decoded``)."""
    if max_entries is None:
        return traces, ()
    if decoded is not None:
        return traces, tuple(t.left_out for t in decoded.devices)
    left_out = tuple(max(len(t) - max_entries, 0) for t in traces)
    return [t[k:] if k else t for t, k in zip(traces, left_out, strict=True)], left_out


def _top_level(obj: Any, path: Path) -> tuple[dict[str, Any], str | None]:
    """The snapshot's dict, and '1.13' where the file holds the list of segments that torch 1.13
    and ``torch.cuda.memory_snapshot()`` write (None otherwise)."""
    if type(obj) is list:
        return {"segments": obj, "device_traces": []}, "1.13"
    if type(obj) is dict:
        return obj, None
    raise SnapshotFormatError(
        path, f"not a PyTorch memory snapshot: the file holds {_a(_type_name(obj))}, expected a dict"
    )


def normalise(
    obj: Any, source: SourceInfo, decoded: DecodedTraces | None = None, max_entries: int | None = None
) -> Snapshot:
    """Turn an unpickled object into a :class:`Snapshot` or raise SnapshotFormatError.

    ``decoded``: the traces as the compiled reader decoded them (``obj['device_traces']`` then
    holds an empty list that stands for them); they get the checks the entry lists get here.
    ``max_entries``: keep each device's last ``max_entries`` trace entries only (the window the
    compiled reader applied to ``decoded`` already); None: every entry.

    Segments, blocks, settings and annotations are checked here, field by field. Trace entries,
    of which there can be millions, are checked column by column where the frames are built
    (:func:`snapshot_lab.frames.build_frames`); here only their lists are."""
    path = Path(source.path)
    data, legacy = _top_level(obj, path)
    raw_segments = data.get("segments")
    if raw_segments is None:
        keys = ", ".join(sorted(k[:30] if type(k) is str and k.isprintable() else describe(k) for k in list(data)[:8]))
        raise SnapshotFormatError(
            path, f"not a PyTorch memory snapshot: no 'segments' key (found keys: {keys or 'none'})"
        )
    try:
        if type(raw_segments) is not list:
            raise FieldError("segments", f"'segments' is a {_type_name(raw_segments)}, expected a list of segments")
        _check_record_budget(path, source, "segments", len(raw_segments))
        _check_record_budget(path, source, "blocks", sum(len(s["blocks"]) for s in raw_segments if _has_blocks(s)))
        seen: set[int] = set()
        segments = []
        for i, s in enumerate(raw_segments):
            if id(s) in seen:
                raise FieldError(f"segments[{i}]", "the same segment object appears twice (a shared reference)")
            seen.add(id(s))
            try:
                segments.append(_normalise_segment(s, seen))
            except FieldError as exc:
                raise exc.under(f"segments[{i}]") from None
        del seen
        if legacy is None and any("history" in b for s in raw_segments for b in s["blocks"]):
            legacy = "2.0"
        traces, left_out = _windowed(_checked_traces(path, source, data, decoded), decoded, max_entries)
        try:
            settings = normalise_settings(data.get("allocator_settings"))
        except FieldError as exc:
            raise exc.under("allocator_settings") from None
        raw_annotations = data.get("external_annotations")
        annotations = []
        if raw_annotations is not None:
            check_list(raw_annotations, "external_annotations", "a list of annotations")
            _check_record_budget(path, source, "annotations", len(raw_annotations))
            for k, a in enumerate(raw_annotations):
                try:
                    annotations.append(_normalise_annotation(a))
                except FieldError as exc:
                    raise exc.under(f"external_annotations[{k}]") from None
        host_segments, host_traces = _normalise_host(path, source, data)
    except FieldError as exc:
        raise SnapshotFormatError(path, str(exc)) from None
    snap = Snapshot(
        source=source,
        segments=segments,
        device_traces=traces,
        allocator_settings=settings,
        external_annotations=annotations,
        format_hints=_format_hints(data, traces, decoded),
        legacy=legacy,
        decoded_traces=decoded,
        host_segments=host_segments,
        host_traces=host_traces,
        backend=detect_backend(data),
        max_entries=max_entries,
        entries_left_out=left_out,
    )
    if decoded is not None:
        del snap.device_traces  # read again from the file if asked for (Snapshot.__getattr__)
    return snap


def _normalise_host(path: Path, source: SourceInfo, data: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """``host_segments`` and ``host_traces`` (torch >= 2.14, pinned host memory). torch writes a
    host segment as a device segment of device -1 with one block (THCPModule_memorySnapshot in
    torch/csrc/cuda/Module.cpp, from at::HostAllocator::get_segments' flat HostSegmentInfo), and
    its trace entries with the device entries' serialiser; the entries are checked where the
    frames are built. FieldErrors carry paths from the top."""
    raw_segments = data.get("host_segments")
    segments = []
    if raw_segments is not None:
        check_list(raw_segments, "host_segments", "a list of segments")
        _check_record_budget(path, source, "host segments", len(raw_segments))
        seen: set[int] = set()
        for i, s in enumerate(raw_segments):
            if id(s) in seen:
                raise FieldError(f"host_segments[{i}]", "the same segment object appears twice (a shared reference)")
            seen.add(id(s))
            try:
                segments.append(_normalise_segment(s, seen, min_device=-1))
            except FieldError as exc:
                raise exc.under(f"host_segments[{i}]") from None
    traces = data.get("host_traces")
    if traces is None:
        return segments, []
    check_list(traces, "host_traces", "a list of events")
    _check_record_budget(path, source, "host trace entries", len(traces))
    return segments, traces


# PYTORCH_<BACKEND>_ALLOC_CONF: the key a backend's allocator_settings names its raw config by
_BACKEND_NAMES = {"NPU": "Ascend NPU (torch_npu)", "XPU": "Intel XPU", "NEURON": "AWS Neuron", "HPU": "Intel Gaudi HPU"}


def detect_backend(data: dict[str, Any]) -> str | None:
    """The accelerator a file says it came from, or None (CUDA, or a file that does not say).

    Only the file's own words count: an ``allocator_settings`` key ``PYTORCH_<NAME>_ALLOC_CONF``
    other than CUDA's (torch_npu and other out-of-tree backends copy the CUDA serialiser and
    rename that key), or a top-level ``backend``/``device_type`` string. The same format from
    any backend is read alike; the name is only shown."""
    for key in ("backend", "device_type"):
        v = data.get(key)
        if type(v) is str and v and v.lower() not in ("cuda", "gpu"):
            return _BACKEND_NAMES.get(v.upper(), v[:40])
    settings = data.get("allocator_settings")
    if type(settings) is dict:
        for key in settings:
            if type(key) is str and key.startswith("PYTORCH_") and key.endswith("_ALLOC_CONF"):
                name = key[len("PYTORCH_") : -len("_ALLOC_CONF")]
                if name and name != "CUDA":
                    return _BACKEND_NAMES.get(name, name[:40])
    return None


def _has_blocks(s: Any) -> bool:
    return type(s) is dict and type(s.get("blocks")) is list


class PickleSize(NamedTuple):
    """How large the pickle a file holds is (what the compiled reader maps: the file itself, or
    the temporary file it decompresses into), told before reading it."""

    bytes: int
    compressed: bool  # the size is what the file's container states (xz, zstd)


def pickle_size(path: str | Path) -> PickleSize | None:
    """The size of the pickle ``path`` holds: the file's, uncompressed; what an xz or zstd file
    states it decompresses to. None for anything else: JSON, gzip or bz2 (their sizes are not
    stated), a container that states none, a file missing or unreadable (the loader says what is
    wrong)."""
    try:
        with Path(path).open("rb") as f:
            head = f.read(8)
            compression = sniff_compression(head)
            if compression is None:
                size = os.fstat(f.fileno()).st_size
                return PickleSize(size, False) if _pickle_protocol(head) is not None else None
            stated = stated_size(f, compression)
            if stated is None:
                return None
            f.seek(0)
            with open_decompressed(f, compression) as data:
                head = data.read(8)
    except Exception:  # whatever the file is, the loader says it; this only tells a size
        return None
    return PickleSize(stated, True) if _pickle_protocol(head) is not None else None


def load_snapshot(path: str | Path, progress: ProgressSink | None = None, max_entries: int | None = None) -> Snapshot:
    """Load a snapshot file (pickle or JSON, optionally gzip/xz/zstd/bz2-compressed) safely.

    ``max_entries``: read each device's last ``max_entries`` trace entries only, as if torch had
    recorded with ``_record_memory_history(max_entries=...)`` (the compiled reader keeps no more
    than about that many in memory: a window on a file too large for the machine); None: all.

    Raises :class:`~snapshot_lab.errors.SnapshotFormatError` for anything that is not a
    readable snapshot, including pickles that reference Python globals.
    """
    if max_entries is not None and max_entries < 1:
        raise ValueError(f"max_entries must be 1 or more, not {max_entries}")
    p = Path(path)
    obj, source, traces = _read_object(p, progress or NullProgress(), max_entries=max_entries)
    snap = normalise(obj, source, traces, max_entries)
    snap.capture = load_sidecar(p)
    return snap
