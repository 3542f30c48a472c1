"""The fuzz corpus: the real snapshots of ``sample_snapshots/``, cut small and written in every
encoding snaplab reads.

A whole real snapshot takes a second to analyse; a cut one (a few segments, whole, with their
blocks; the first and last entries of each device's trace, so OOM and snapshot markers stay;
a few annotations; the recorded allocator settings) takes milliseconds, which is what lets a
campaign try a million inputs on two cores. Cutting keeps what torch wrote: shared frame
dicts and frames lists, block tiling, the recorded key order.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import pickle
from pathlib import Path
from typing import Any

import zstandard

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_snapshots"
EXTRA = Path(__file__).resolve().parent / "corpus_extra"  # grad_anomaly_python: forward_frames (torch 2.11)

ENCODINGS = ("pickle4", "pickle2", "pickle5", "pickle0", "gzip", "xz", "zstd", "bz2", "json", "json.gz")


def sample_files() -> list[Path]:
    return sorted(p for p in SAMPLES.iterdir() if ".pickle" in p.name)


def read_sample(path: Path) -> Any:
    """A real sample, unpickled (these are trusted files of this repository)."""
    raw = path.read_bytes()
    if raw[:6] == b"\xfd7zXZ\x00":
        raw = lzma.decompress(raw)
    return pickle.loads(raw)


def cut(obj: Any, segments: int = 4, head: int = 16, tail: int = 16, annotations: int = 4) -> Any:
    """A small snapshot made of pieces of a real one (see the module's docstring)."""
    if isinstance(obj, list):  # 1.13: a bare list of segments
        return obj[:segments]
    out = dict(obj)
    segs = obj.get("segments", [])
    step = max(1, len(segs) // segments)
    out["segments"] = segs[::step][:segments]
    traces = []
    for tr in obj.get("device_traces", []):
        traces.append(tr if len(tr) <= head + tail else tr[:head] + tr[-tail:])
    out["device_traces"] = traces
    if "external_annotations" in obj:
        out["external_annotations"] = obj["external_annotations"][:annotations]
    return out


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=list))  # tuples (pool ids) become lists, as in a JSON export


def encode(obj: Any, encoding: str) -> bytes:
    """``obj`` written the way a snapshot file can be: pickle of a protocol, compressed, JSON."""
    if encoding == "json" or encoding == "json.gz":
        text = json.dumps(obj, allow_nan=True, default=list).encode()
        return gzip.compress(text, mtime=0) if encoding == "json.gz" else text
    if encoding.startswith("pickle"):
        return pickle.dumps(obj, protocol=int(encoding[6:]))
    raw = pickle.dumps(obj, protocol=4)
    if encoding == "gzip":
        return gzip.compress(raw, compresslevel=1, mtime=0)
    if encoding == "xz":
        return lzma.compress(raw, preset=0)
    if encoding == "zstd":
        return zstandard.ZstdCompressor(level=1).compress(raw)
    if encoding == "bz2":
        return bz2.compress(raw, compresslevel=1)
    raise ValueError(encoding)


def seed_corpus() -> dict[str, bytes]:
    """name -> bytes: every sample cut small, each in two encodings (rotating through all of
    them across samples), plus one whole small sample in every encoding."""
    corpus: dict[str, bytes] = {}
    for i, path in enumerate(sample_files()):
        small = cut(read_sample(path))
        stem = path.name.split(".pickle")[0]
        for enc in ("pickle4", ENCODINGS[1 + i % (len(ENCODINGS) - 1)]):
            corpus[f"{stem}.{enc}"] = encode(small, enc)
    for path in sorted(EXTRA.iterdir()):  # real recordings of formats the samples lack, already cut
        stem = path.name.split(".pickle")[0]
        for enc in ("pickle4", "xz", "json"):
            corpus[f"{stem}.{enc}"] = encode(read_sample(path), enc)
    whole = read_sample(SAMPLES / "pending_free.pickle.xz")
    for enc in ENCODINGS:
        corpus[f"pending_free_whole.{enc}"] = encode(whole, enc)
    return corpus


def write_corpus(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in seed_corpus().items():
        p = folder / name
        if not p.exists() or p.read_bytes() != data:
            p.write_bytes(data)
        paths.append(p)
    return paths
