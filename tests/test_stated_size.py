"""What a compressed snapshot states it decompresses to, read before the file is
(``load.compression.stated_size``, ``load.pickle_size``): exact where the container says it
(xz's index, zstd's frame headers), None where it does not or where the container is broken."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import pickle
from pathlib import Path

import pytest
import zstandard

from snapshot_lab.load import PickleSize, pickle_size
from snapshot_lab.load.compression import stated_size

from .conftest import sample_path

DATA = os.urandom(50_000) + bytes(range(256)) * 4_000  # 1,074,000 bytes, part incompressible


def _size(blob: bytes, compression: str) -> int | None:
    return stated_size(io.BytesIO(blob), compression)


@pytest.mark.parametrize("name", ["transformer_varlen", "cnn_clean", "cuda_graph", "capture_ddp_rank0"])
def test_xz_samples_state_their_exact_size(name: str) -> None:
    path = sample_path(name)
    with path.open("rb") as f:
        assert stated_size(f, "xz") == len(lzma.decompress(path.read_bytes()))


def test_xz_streams_and_padding_are_summed() -> None:
    one, two = lzma.compress(DATA), lzma.compress(b"tail", preset=1)
    assert _size(one, "xz") == len(DATA)
    assert _size(one + bytes(8) + two, "xz") == len(DATA) + 4
    assert _size(one + two + bytes(4), "xz") == len(DATA) + 4
    block = lzma.LZMACompressor(format=lzma.FORMAT_XZ, check=lzma.CHECK_NONE)
    assert _size(block.compress(b"") + block.flush(), "xz") == 0  # an empty stream


def test_broken_xz_states_nothing() -> None:
    good = lzma.compress(DATA)
    assert _size(good[:-1], "xz") is None  # truncated: no footer
    index_byte = len(good) - 16  # in the index: its CRC no longer matches
    broken = good[:index_byte] + bytes([good[index_byte] ^ 0xFF]) + good[index_byte + 1 :]
    assert _size(broken, "xz") is None
    assert _size(b"garbage" * 10, "xz") is None
    assert _size(good[12:], "xz") is None  # no stream header where the index says it starts
    assert _size(b"", "xz") is None
    assert _size(bytes(16), "xz") is None  # padding only: no stream


def test_zstd_frames_state_their_content_sizes() -> None:
    assert _size(zstandard.ZstdCompressor().compress(DATA), "zstd") == len(DATA)
    checked = zstandard.ZstdCompressor(write_checksum=True, level=1).compress(DATA)
    small = zstandard.ZstdCompressor().compress(b"hello")
    assert _size(checked + small, "zstd") == len(DATA) + 5
    skippable = (0x184D2A53).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    assert _size(skippable + small, "zstd") == 5
    # written by hand: one RLE block of 300 bytes, then a raw block of 2, content size 302 (2 bytes: +256)
    frame = bytes.fromhex("28b52ffd") + bytes([0x40 | 0x20]) + (302 - 256).to_bytes(2, "little")
    frame += ((300 << 3) | (1 << 1)).to_bytes(3, "little") + b"x"
    frame += ((2 << 3) | 1).to_bytes(3, "little") + b"yz"
    assert zstandard.ZstdDecompressor().decompress(frame) == b"x" * 300 + b"yz"
    assert _size(frame, "zstd") == 302


def test_zstd_without_sizes_or_broken_states_nothing() -> None:
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as writer:
        writer.write(DATA)  # streamed: the frame does not say how much it holds
    assert _size(out.getvalue(), "zstd") is None
    good = zstandard.ZstdCompressor().compress(DATA)
    assert _size(good[:-3], "zstd") is None  # truncated
    assert _size(good + b"junk", "zstd") is None  # not a frame after it
    assert _size(b"", "zstd") is None
    reserved = bytes.fromhex("28b52ffd") + bytes([0x20, 5]) + ((5 << 3) | (3 << 1) | 1).to_bytes(3, "little")
    assert _size(reserved, "zstd") is None


def test_gzip_and_bz2_state_nothing() -> None:
    """gzip states the size modulo 4 GiB only, bz2 none: not told rather than told wrong."""
    assert _size(gzip.compress(DATA), "gzip") is None
    assert _size(bz2.compress(DATA), "bz2") is None


def test_pickle_size_of_each_kind_of_file(tmp_path: Path) -> None:
    plain = sample_path("oom_fragmentation")
    assert pickle_size(plain) == PickleSize(plain.stat().st_size, False)
    xz = sample_path("transformer_varlen")
    assert pickle_size(xz) == PickleSize(len(lzma.decompress(xz.read_bytes())), True)
    data = pickle.dumps({"segments": [], "device_traces": []}, protocol=4)
    zst = tmp_path / "s.pickle.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(data))
    assert pickle_size(zst) == PickleSize(len(data), True)
    json_xz = tmp_path / "s.json.xz"
    json_xz.write_bytes(lzma.compress(json.dumps({"segments": []}).encode()))
    assert pickle_size(json_xz) is None  # a JSON snapshot: no pickle to map
    gz = tmp_path / "s.pickle.gz"
    gz.write_bytes(gzip.compress(data))
    assert pickle_size(gz) is None
    broken = tmp_path / "broken.pickle.xz"
    broken.write_bytes(lzma.compress(data)[:-1])
    assert pickle_size(broken) is None
    for name, content in (("empty.pickle", b""), ("garbage.pickle", b"\x00garbage")):
        (tmp_path / name).write_bytes(content)
        assert pickle_size(tmp_path / name) is None
    assert pickle_size(tmp_path / "missing.pickle") is None
    assert pickle_size(tmp_path) is None  # a folder


def test_hostile_containers_cost_little_and_state_nothing() -> None:
    """A footer claiming an index larger than the file, or one of gigabytes; a zstd frame of
    millions of empty blocks: refused without reading them."""
    good = bytearray(lzma.compress(DATA))
    footer = len(good) - 12
    for backward in (len(good), 0xFFFFFFFF):  # (backward + 1) * 4 bytes of index
        hostile = good.copy()
        hostile[footer + 4 : footer + 8] = backward.to_bytes(4, "little")
        assert _size(bytes(hostile), "xz") is None
    empty_raw = (0).to_bytes(3, "little")  # a raw block of 0 bytes, not the last
    frame = bytes.fromhex("28b52ffd") + bytes([0x20, 0]) + empty_raw * (1 << 20) + (1).to_bytes(3, "little")
    assert _size(frame, "zstd") is None
    shorter = bytes.fromhex("28b52ffd") + bytes([0x20, 0]) + empty_raw * 1000 + (1).to_bytes(3, "little")
    assert _size(shorter, "zstd") == 0 and zstandard.ZstdDecompressor().decompress(shorter) == b""
