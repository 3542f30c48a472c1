"""Mutations of snapshot files, as a new user's files arrive: bytes flipped by an upload, numbers
edited by hand, keys removed, values swapped for None, NaN, a list or 2**64...

Two levels, both driven by one ``random.Random`` so that a seed replays a session:

- bytes: of the file as it is (compressed or not), or of the pickle inside its compression,
  recompressed with the same codec (so corruption reaches the unpickler behind a valid gzip);
- structure: the file is decoded (with the loader's own restricted unpickler, under the same
  memory limit), one node of the object tree is changed (type, range, missing or extra key,
  empty or huge list, shared reference, cycle, deep nesting, a string of a megabyte), and the
  result is written in any encoding snaplab reads.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import math
import pickle
import random
import zlib
from collections.abc import Callable
from typing import Any

import zstandard

from snapshot_lab.load.compression import sniff_compression
from snapshot_lab.load.guard import memory_limited
from snapshot_lab.load.unpickler import safe_load

from .seeds import ENCODINGS, encode

MAX_DECODED = 8 << 20

# values that break code which trusts a field's type or range
NASTY: tuple[Any, ...] = (
    None,
    math.nan,
    math.inf,
    -math.inf,
    2**64,
    2**63,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    -(2**63) - 1,
    -1,
    0,
    10**30,
    True,
    False,
    0.5,
    -0.0,
    1e308,
    "",
    "x",
    "0",
    "active_allocated",
    "alloc",
    "oom",
    "\x00\n\r\x1b[31m<script>",
    "é😀\u202e",
    [],
    [0],
    {},
    {"filename": "a.py", "line": 1, "name": "f"},
    (0, 0),
    b"bytes",
)


def decode(data: bytes) -> tuple[Any, str | None] | None:
    """(object, compression) of a snapshot file's bytes, or None when it does not decode."""
    try:
        comp = sniff_compression(data[:8])
        raw = decompress(data, comp)
        if raw is None:
            return None
        stripped = raw.lstrip()[:1]
        with memory_limited(256 << 20):
            if stripped in (b"{", b"[") and raw[:1] != b"\x80":
                return json.loads(raw), comp
            return safe_load(io.BytesIO(raw)), comp
    except (Exception, RecursionError, MemoryError):
        return None


def decompress(data: bytes, comp: str | None) -> bytes | None:
    try:
        if comp is None:
            return data
        if comp == "gzip":
            return zlib.decompressobj(wbits=31).decompress(data, MAX_DECODED)
        if comp == "xz":
            return lzma.LZMADecompressor().decompress(data, MAX_DECODED)
        if comp == "bz2":
            return bz2.BZ2Decompressor().decompress(data, MAX_DECODED)
        if comp == "zstd":
            return zstandard.ZstdDecompressor().decompressobj().decompress(data)[:MAX_DECODED]
    except Exception:
        return None
    return None


def compress(raw: bytes, comp: str | None) -> bytes:
    if comp == "gzip":
        return gzip.compress(raw, compresslevel=1, mtime=0)
    if comp == "xz":
        return lzma.compress(raw, preset=0)
    if comp == "bz2":
        return bz2.compress(raw, compresslevel=1)
    if comp == "zstd":
        return zstandard.ZstdCompressor(level=1).compress(raw)
    return raw


# --------------------------------------------------------------------------- bytes


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """A few byte-level edits (the fallback when libFuzzer's own mutator is not there)."""
    b = bytearray(data or b"\x80")
    for _ in range(rng.choice((1, 1, 1, 2, 4, 8))):
        kind = rng.randrange(7)
        i = rng.randrange(len(b))
        if kind == 0:
            b[i] = rng.randrange(256)
        elif kind == 1:
            b[i] ^= 1 << rng.randrange(8)
        elif kind == 2:
            del b[i : i + rng.randint(1, 16)]
        elif kind == 3:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif kind == 4:
            b = b[: max(1, i)]
        elif kind == 5:  # an integer opcode's payload made huge
            b[i : i + 4] = rng.choice((b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80", b"\xff\xff\xff\xff"))
        else:
            j = rng.randrange(len(b))
            n = rng.randint(1, 64)
            b[i:i] = b[j : j + n]
        if not b:
            b = bytearray(b"\x80")
    return bytes(b)


def mutate_inside(data: bytes, rng: random.Random, mutate: Callable[[bytes], bytes]) -> bytes:
    """Byte edits of what a compressed file holds, recompressed with the same codec."""
    comp = sniff_compression(data[:8])
    if comp is None:
        return mutate(data)
    raw = decompress(data, comp)
    if raw is None:
        return mutate(data)
    return compress(mutate(raw), comp)


# --------------------------------------------------------------------------- structure


def _nodes(root: Any, limit: int = 4000) -> list[tuple[Any, Any]]:
    """(container, key) of the nodes of an object tree, each container visited once."""
    out: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    stack = [root]
    while stack and len(out) < limit:
        c = stack.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        if isinstance(c, dict):
            items: Any = list(c.items())
        elif isinstance(c, list):
            items = list(enumerate(c))
        else:
            continue
        for k, v in items:
            out.append((c, k))
            if isinstance(v, (dict, list)):
                stack.append(v)
    return out


def _deep(depth: int, leaf: Any) -> Any:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def _number_variant(v: int | float, rng: random.Random) -> Any:
    return rng.choice(
        (
            -v,
            v + 1,
            v - 1,
            v * 2 ** rng.randint(1, 70),
            v // 2,
            float(v),
            str(v),
            2**63 - 1 - (v if isinstance(v, int) else 0),
            v + 2**63,
        )
    )


def mutate_structure(obj: Any, rng: random.Random) -> Any:
    """One structural edit, in place (the object is a fresh decode); returns the new root."""
    nodes = _nodes(obj)
    if not nodes:
        return rng.choice((*NASTY, {"segments": []}))
    c, k = rng.choice(nodes)
    v = c[k]
    op = rng.randrange(22)
    if op >= 16:  # edits a real file could hold: values in range, entries copied or dropped
        _soft(c, k, v, rng)
    elif op <= 3:  # a value of the wrong type or range
        c[k] = rng.choice(NASTY)
    elif op == 4 and isinstance(v, (int, float)) and not isinstance(v, bool):
        c[k] = _number_variant(v, rng)
    elif op == 5 and isinstance(c, dict):  # a key removed
        del c[k]
    elif op == 6 and isinstance(c, dict):  # an extra key
        c[rng.choice(("extra", "frames", "forward_frames", "history", "addr", "time_us", 7, None))] = rng.choice(NASTY)
    elif op == 7 and isinstance(v, list):  # emptied
        v.clear()
    elif op == 8 and isinstance(v, list) and v:  # huge: repeated by reference
        v.extend(v * rng.choice((2, 10, 1000)))
    elif op == 9 and isinstance(v, (list, dict)):  # a cycle
        if isinstance(v, list):
            v.append(v if rng.random() < 0.5 else c)
        else:
            v[rng.choice(("self", "frames", "blocks", "segments"))] = v if rng.random() < 0.5 else c
    elif op == 10:  # deep nesting
        c[k] = _deep(rng.choice((50, 500, 5000)), v)
    elif op == 11:  # a string of a megabyte
        c[k] = rng.choice(("A", "\n", "é")) * rng.choice((1 << 20, 1 << 16))
    elif op == 12 and isinstance(c, list):  # one element twice, by reference
        c.insert(rng.randrange(len(c) + 1), v)
    elif op == 13 and isinstance(v, list) and len(v) > 1:  # reordered or cut
        if rng.random() < 0.5:
            rng.shuffle(v)
        else:
            del v[rng.randrange(len(v)) :]
    elif op == 14 and isinstance(v, str):
        c[k] = rng.choice(
            ("active_pending_free", "active_awaiting_free", "inactive", "small", "segment_map", "free", v * 3, v[:1])
        )
    else:  # a value moved elsewhere (a dict where a list was, a frame where an int was...)
        c2, k2 = rng.choice(nodes)
        c[k] = c2[k2]
    return obj


_VOCAB = (
    (
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "oom",
        "snapshot",
    ),
    ("active_allocated", "active_pending_free", "inactive"),
    ("small", "large"),
    ("START", "END"),
)


def _soft(c: Any, k: Any, v: Any, rng: random.Random) -> None:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        c[k] = rng.choice((0, 1, 511, v // 2, v + 512, v * 2 if v < 2**40 else v, rng.randrange(2**48)))
    elif isinstance(v, str):
        for vocab in _VOCAB:
            if v in vocab:
                c[k] = rng.choice(vocab)
    elif isinstance(v, list) and v:
        i = rng.randrange(len(v))
        if rng.random() < 0.5:
            del v[i]
        else:
            item = v[i]
            v.insert(rng.randrange(len(v) + 1), dict(item) if isinstance(item, dict) else item)
    elif isinstance(c, list) and isinstance(v, dict):
        c.insert(rng.randrange(len(c) + 1), dict(v))


def encode_any(obj: Any, rng: random.Random, like: str | None = None) -> bytes:
    """``obj`` in a random encoding (mostly pickle 4; JSON only when it can hold it)."""
    enc = rng.choice(ENCODINGS) if rng.random() < 0.2 else (like or "pickle4")
    for candidate in (enc, "pickle4", "pickle2"):
        try:
            return encode(obj, candidate)
        except (ValueError, TypeError, RecursionError, OverflowError, pickle.PicklingError):
            continue
    return b"\x80\x04N."


def structural(data: bytes, rng: random.Random) -> bytes | None:
    decoded = decode(data)
    if decoded is None:
        return None
    obj, comp = decoded
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        obj = mutate_structure(obj, rng)
    like = {"gzip": "gzip", "xz": "xz", "zstd": "zstd", "bz2": "bz2"}.get(comp or "", "pickle4")
    return encode_any(obj, rng, like)


def mutate(data: bytes, rng: random.Random, byte_mutator: Callable[[bytes], bytes] | None = None) -> bytes:
    """One mutation of a snapshot file: bytes (as is, or inside the compression) or structure."""
    bm = byte_mutator or (lambda d: mutate_bytes(d, rng))
    r = rng.random()
    if r < 0.45:
        out = structural(data, rng)
        if out is not None:
            return out
    if r < 0.7:
        return mutate_inside(data, rng, bm)
    return bm(data)
