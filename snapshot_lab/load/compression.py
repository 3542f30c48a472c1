"""Open a snapshot file, transparently decompressing it; the format is sniffed, not guessed
from the suffix (people rename files when they attach them to tickets)."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
from typing import IO

GZIP_MAGIC = b"\x1f\x8b"
XZ_MAGIC = b"\xfd7zXZ\x00"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BZ2_MAGIC = b"BZh"


def sniff_compression(head: bytes) -> str | None:
    """Return 'gzip', 'xz', 'zstd', 'bz2' or None (uncompressed) from the first bytes."""
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(XZ_MAGIC):
        return "xz"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    if head.startswith(BZ2_MAGIC) and len(head) >= 4 and head[3:4].isdigit():
        return "bz2"
    return None


def open_decompressed(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    """A buffered binary stream of the decompressed content of ``raw`` (closing it closes raw)."""
    if compression is None:
        return raw
    if compression == "gzip":
        return io.BufferedReader(gzip.GzipFile(fileobj=raw), buffer_size=1 << 20)  # type: ignore[arg-type]
    if compression == "xz":
        return io.BufferedReader(lzma.LZMAFile(raw), buffer_size=1 << 20)  # type: ignore[arg-type]
    if compression == "bz2":
        return io.BufferedReader(bz2.BZ2File(raw), buffer_size=1 << 20)  # type: ignore[arg-type]
    if compression == "zstd":
        try:
            from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14

            return io.BufferedReader(zstd.ZstdFile(raw), buffer_size=1 << 20)
        except ImportError:
            import zstandard

            reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
            return io.BufferedReader(reader, buffer_size=1 << 20)  # type: ignore[arg-type]
    raise ValueError(f"unknown compression {compression!r}")
