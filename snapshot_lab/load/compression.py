"""Open a snapshot file, transparently decompressing it; the format is sniffed, not guessed
from the suffix (people rename files when they attach them to tickets)."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zlib
from typing import IO

GZIP_MAGIC = b"\x1f\x8b"
XZ_MAGIC = b"\xfd7zXZ\x00"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BZ2_MAGIC = b"BZh"
# what stated_size reads at most of a container's own records: an xz index (a few bytes a block;
# xz writes blocks of megabytes) and zstd block headers (one per 128 KiB of data at most): bounds
# a hostile file's cost, far above what a snapshot of terabytes needs
MAX_INDEX_BYTES = 64 << 20
MAX_BLOCKS = 1 << 20


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


def stated_size(f: IO[bytes], compression: str) -> int | None:
    """The decompressed size a compressed file states, read from its headers and index without
    decompressing anything: xz (its streams' indexes) and zstd (its frames' content sizes, when
    every frame has one); None for gzip (it states the size modulo 4 GiB only), bz2 (it states
    none) or a container that is not regular."""
    try:
        if compression == "xz":
            return _xz_size(f)
        if compression == "zstd":
            return _zstd_size(f)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """xz's multibyte integer at ``at``: (value, the offset after it)."""
    value = 0
    for i in range(9):
        byte = data[at + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, at + i + 1
    raise ValueError("xz: integer too long")


def _xz_size(f: IO[bytes]) -> int | None:
    """The sum of the uncompressed sizes in the indexes of an xz file's streams, walked from the
    end (each stream's footer says how long its index is; padding between streams is skipped)."""
    end = f.seek(0, io.SEEK_END)
    total, streams = 0, 0
    while end > 0:
        f.seek(end - 4)
        if f.read(4) == b"\0\0\0\0":  # stream padding
            end -= 4
            continue
        f.seek(end - 12)
        footer = f.read(12)
        if len(footer) != 12 or footer[10:] != b"YZ":
            return None
        index_size = (int.from_bytes(footer[4:8], "little") + 1) * 4
        if index_size > min(end - 24, MAX_INDEX_BYTES):  # no room for it, or more than a file's blocks need
            return None
        f.seek(end - 12 - index_size)
        index = f.read(index_size)
        if len(index) != index_size or index[0] != 0 or zlib.crc32(index[:-4]) != int.from_bytes(index[-4:], "little"):
            return None
        records, at = _varint(index, 1)
        blocks = 0
        for _ in range(records):
            unpadded, at = _varint(index, at)
            uncompressed, at = _varint(index, at)
            blocks += (unpadded + 3) // 4 * 4
            total += uncompressed
        end -= 12 + blocks + index_size + 12  # header, blocks, index, footer
        f.seek(max(end, 0))
        if end < 0 or f.read(6) != XZ_MAGIC:
            return None
        streams += 1
    return total if streams else None


def _zstd_size(f: IO[bytes]) -> int | None:
    """The sum of the content sizes of a zstd file's frames, walked block header by block header
    (skippable frames skipped); None when a frame does not state its size."""
    total, frames, blocks = 0, 0, 0
    at = 0
    end = f.seek(0, io.SEEK_END)
    while at < end:
        f.seek(at)
        magic = f.read(4)
        if len(magic) == 4 and magic[1:] == b"\x2a\x4d\x18" and magic[0] & 0xF0 == 0x50:  # skippable
            at += 8 + int.from_bytes(f.read(4), "little")
            continue
        if magic != ZSTD_MAGIC:
            return None
        descriptor = f.read(1)[0]
        single = bool(descriptor & 0x20)
        dictionary = (0, 1, 2, 4)[descriptor & 0x03]
        content = (1 if single else 0, 2, 4, 8)[descriptor >> 6]
        header = f.read((0 if single else 1) + dictionary + content)
        if content == 0:
            return None
        size = int.from_bytes(header[len(header) - content :], "little")
        total += size + (256 if content == 2 else 0)
        at += 5 + len(header)
        last = False
        while not last:
            blocks += 1
            if blocks > MAX_BLOCKS:
                return None
            f.seek(at)
            block = int.from_bytes(f.read(3), "little")
            last, kind, length = bool(block & 1), (block >> 1) & 3, block >> 3
            if kind == 3:
                return None
            at += 3 + (1 if kind == 1 else length)
        at += 4 if descriptor & 0x04 else 0  # the content checksum
        frames += 1
    return total if at == end and frames else None
