"""Bounds on what reading one file may cost, whatever bytes it holds.

Two kinds of file cost far more than their size:

- a compressed stream that expands without end (a decompression bomb: gigabytes of valid
  opcodes from a few kilobytes of xz). :class:`BoundedReader` counts the bytes that come out of
  the decompressor and stops at a ceiling set from the compressed size.
- a pickle whose opcodes ask the unpickler itself for memory: ``LONG_BINPUT`` with an index of
  2**30 makes CPython's C unpickler grow and zero its memo table to 16 GiB from a 9-byte file.
  No Python hook sees that opcode at the speed of the C unpickler, so :func:`memory_limited`
  lowers the process's address-space limit (``RLIMIT_AS``) to the current size plus what a
  snapshot of that many bytes can legitimately need, for the time of the unpickling only. The
  allocation then fails at once with ``MemoryError``, which the loader reports as a refusal.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

# Bytes of memory that unpickling may take per byte of pickle. Measured: a real snapshot takes
# 3.2x its pickle (1M entries: 152 MiB file, 480 MiB of objects); a pickle of maximally shared
# small values can take about 8x. JSON takes less per byte than either.
MEMORY_PER_BYTE = 16
MEMORY_SLACK = 512 << 20  # malloc arenas of the reading threads, the decompressor's windows
# Real snapshots compress 3x to 80x with xz (the most: anomaly-mode traces, whose forward_frames
# repeat long strings); 1000x leaves room for JSON exports and stays far from what a bomb does.
MAX_EXPANSION = 1000
MIN_CEILING = 64 << 20


class ExpansionLimitError(Exception):
    """The decompressed stream grew past its ceiling."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        super().__init__(f"more than {ceiling:,} bytes")


def decompressed_ceiling(compressed_size: int) -> int:
    return max(MIN_CEILING, MAX_EXPANSION * compressed_size)


class BoundedReader(io.RawIOBase):
    """A raw stream over a decompressor that raises :class:`ExpansionLimitError` once more than
    ``ceiling`` bytes came out of it; ``consumed`` counts them."""

    def __init__(self, inner: IO[bytes], ceiling: int) -> None:
        super().__init__()
        self._inner = inner
        self.ceiling = ceiling
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._inner.readinto(b)  # type: ignore[attr-defined]
        if n:
            self.consumed += n
            if self.consumed > self.ceiling:
                raise ExpansionLimitError(self.ceiling)
        return n or 0

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            super().close()


_lock = threading.Lock()


def _address_space_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def memory_limited(budget_bytes: int) -> Iterator[None]:
    """While the block runs, allocations beyond ``budget_bytes`` more than the process has now
    fail with MemoryError. Linux only (elsewhere a no-op); the previous limit is restored."""
    try:
        import resource
    except ImportError:  # not POSIX
        yield
        return
    with _lock:
        current = _address_space_bytes()
        if current is None:
            yield
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        target = current + budget_bytes
        if hard != resource.RLIM_INFINITY:
            target = min(target, hard)
        if soft != resource.RLIM_INFINITY and soft <= target:
            yield  # already stricter than ours
            return
        try:
            resource.setrlimit(resource.RLIMIT_AS, (target, hard))
        except (ValueError, OSError):
            yield
            return
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
