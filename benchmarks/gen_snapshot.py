"""Write a realistic large snapshot of N trace entries, modelled on a real one.

The template is a real snapshot recorded on a GPU (default: the bundled GPT-2 training run).
Its steady-state iterations are repeated until N entries: the same action mix, sizes, address
reuse and stacks. As in real pickles, every entry gets its own ``frames`` list while frame
dicts are shared objects (pickle memoises them). ``--extra-frames`` adds outer frames (a
training framework's loop) to deepen stacks to what large jobs record (~180 bytes per entry on
disk at the default, matching "1M entries ≈ 180 MB").

    python benchmarks/gen_snapshot.py 1000000 /tmp/snap_1m.pickle

The pickle is written as it is made, in bounded memory (~130 MiB at any N; building the
snapshot as objects took 5.4 GiB at 10M entries and would take ~29 GB at 50M) and several
times faster: the same bytes as ``pickle.dump(generate(N), f, protocol=4)``, frames included
(see write_snapshot). ``generate`` still builds the snapshot as objects, for the callers that
want them.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import pickletools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snapshot_lab.load import load_snapshot  # noqa: E402

DEFAULT_TEMPLATE = ROOT / "sample_snapshots" / "transformer_varlen.pickle.xz"


def outer_frames(n: int) -> list[dict[str, Any]]:
    names = [
        "fit",
        "_run",
        "run_stage",
        "_run_train",
        "advance",
        "run",
        "training_step",
        "optimizer_step",
        "_call_strategy_hook",
        "step",
        "closure",
        "wrapper",
        "__call__",
        "main",
        "<module>",
        "run_path",
    ]
    return [
        {
            "name": names[i % len(names)],
            "filename": f"/opt/venv/lib/python3.12/site-packages/lightning/loop_{i}.py",
            "line": 100 + i,
        }
        for i in range(n)
    ]


class _Recording:
    """The template's steady state, and the entries made from it: entry ``i`` of repetition
    ``rep`` is ``body[i]`` shifted by ``rep`` spans, with its own frames list over the shared
    frame dicts."""

    def __init__(self, template: Path, extra_frames: int) -> None:
        self.snap = load_snapshot(template)
        trace = self.snap.device_traces[0]
        # steady state: from the first optimizer step on (the template's second half)
        self.body = [e for e in trace[len(trace) // 2 :] if e["action"] != "snapshot"]
        if not self.body:
            raise ValueError(f"{template}: no trace entries in its second half")
        self.outer = outer_frames(extra_frames)
        self.span_us = self.body[-1]["time_us"] - self.body[0]["time_us"] + 1000
        self.t0 = trace[0]["time_us"]
        self.deep: dict[int, list[dict[str, Any]]] = {}

    def time_us(self, rep: int, i: int) -> int:
        return self.body[i]["time_us"] - self.body[0]["time_us"] + self.t0 + rep * self.span_us

    def entries(self, rep: int, start: int, stop: int) -> list[dict[str, Any]]:
        """Entries start to stop (indices into body) of repetition rep."""
        out = []
        b0, shift, deep, outer = self.body[0]["time_us"], self.t0 + rep * self.span_us, self.deep, self.outer
        for e in self.body[start:stop]:
            ne = dict(e)
            ne["time_us"] = e["time_us"] - b0 + shift
            frames = e.get("frames")
            if frames:
                base = deep.get(id(frames))
                if base is None:
                    base = deep[id(frames)] = frames + outer
                ne["frames"] = list(base)  # a new list per entry, shared frame dicts
            out.append(ne)
        return out

    def root(self, trace: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "segments": [dict(s) for s in self.snap.segments],
            "device_traces": [trace],
            "allocator_settings": self.snap.allocator_settings,
            "external_annotations": [],
        }


def generate(n_entries: int, template: Path = DEFAULT_TEMPLATE, extra_frames: int = 22) -> dict[str, Any]:
    """The snapshot as objects (all of it in memory: ~5 GiB at 10M entries)."""
    rec = _Recording(template, extra_frames)
    out: list[dict[str, Any]] = []
    rep = 0
    while len(out) < n_entries:
        out += rec.entries(rep, 0, n_entries - len(out))
        rep += 1
    return rec.root(out)


# ---------- writing the pickle as it is made ----------
#
# The file is what pickle.dump(generate(N), f, protocol=4) writes. One C Pickler pickles the
# pieces (the root's keys and values, the first pass over the template's entries), each by its
# own dump(): a Pickler keeps its memo across dumps, so a piece refers to the strings and frame
# dicts an earlier one memoised, and its memo stays in step with the reader's (every MEMOIZE
# written is one memo entry, the root dict and the two trace lists included: they are written as
# a stand-in {} or [] pickled in their place). The pieces lose their PROTO, FRAME and STOP
# opcodes and are framed again as one stream. From the second pass on, entry i of every pass is
# entry i of the second pass with another time_us: its opcodes are pickled once (by a copy of
# the Pickler, whose memo holds everything the first pass memoised) and repeated with the
# time's encoding spliced in. Those entries' MEMOIZE opcodes (of the entry dict and its frames
# list) are written but not put in the Pickler's memo (it would hold every entry), so the
# memo is behind the reader's after them; the pieces after the trace are checked to refer to
# nothing they memoise themselves (else they are pickled in fast mode, memoising nothing).

FRAME_TARGET = 64 * 1024  # pickle's _FRAME_SIZE_TARGET: a frame ends at the first save() past it
FRAME_MIN = 4  # a last frame shorter than this gets no FRAME header (_pickle.c's FRAME_SIZE_MIN)
BATCH = 1000  # pickle's batch size for APPENDS / SETITEMS
_MARK_OPS = {"APPENDS", "SETITEMS", "TUPLE"}  # pop to the mark
_LONG1_7 = b"\x8a\x07"  # LONG1 of 7 bytes: the time_us of real recordings (2**47 <= t < 2**55)
_SENTINEL = 0x5AC3A5F00D1E57  # a time_us whose encoding marks the spot in an entry's opcodes


class _Piece:
    """Opcodes of one pickled object, without PROTO/FRAME/STOP: ``data``, the offsets where the
    C pickler checks whether to end its frame (each save() of an object), and the largest memo
    index it refers to (-1: none)."""

    __slots__ = ("bounds", "data", "max_get")

    def __init__(self, data: bytes, bounds: list[int], max_get: int) -> None:
        self.data, self.bounds, self.max_get = data, bounds, max_get


def _piece(pickled: bytes) -> _Piece:
    ops = list(pickletools.genops(pickled))
    body = bytearray()
    bounds: set[int] = set()
    stack: list[int] = []  # where each object on the stack starts; a mark at m: -1 - m
    max_get = -1
    for k, (op, arg, pos) in enumerate(ops):
        name = op.name
        if name in ("PROTO", "FRAME", "STOP"):
            continue
        at = len(body)
        body += pickled[pos : ops[k + 1][2] if k + 1 < len(ops) else len(pickled)]
        if name == "MARK":
            stack.append(-1 - at)
        elif name == "MEMOIZE":
            pass
        elif name in ("APPEND", "SETITEM"):
            del stack[len(stack) - (1 if name == "APPEND" else 2) :]
        elif name in _MARK_OPS:
            mark = stack.pop()
            while mark >= 0:
                mark = stack.pop()
            if name == "TUPLE":  # a tuple of 4 or more: its save() starts at its MARK
                stack.append(-1 - mark)
                bounds.add(-1 - mark)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            start = stack[-n]
            del stack[-n:]
            stack.append(start)
            bounds.add(start)
        elif not op.stack_before and len(op.stack_after) == 1:
            stack.append(at)
            bounds.add(at)
            if name in ("BINGET", "LONG_BINGET"):
                max_get = max(max_get, int(arg))  # type: ignore[arg-type]
        else:
            raise ValueError(f"opcode {name} is not one a snapshot's pickle holds")
    return _Piece(bytes(body), sorted(bounds), max_get)


def _encode_int(v: int) -> bytes:
    """An int's opcode as pickle (protocol 2+) writes it."""
    if 0 <= v < 0x100:
        return b"K" + v.to_bytes(1, "little")
    if 0 <= v < 0x10000:
        return b"M" + v.to_bytes(2, "little")
    if -0x80000000 <= v < 0x80000000:
        return b"J" + v.to_bytes(4, "little", signed=True)
    data = v.to_bytes((v.bit_length() >> 3) + 1, "little", signed=True)
    if v < 0 and len(data) > 1 and data[-1] == 0xFF and data[-2] & 0x80:
        data = data[:-1]
    if len(data) > 255:
        raise ValueError("int too large for LONG1")
    return b"\x8a" + bytes([len(data)]) + data


class _Framed:
    """Protocol 4 framing as the C pickler does it: a frame is closed at the first save()
    boundary at which it holds FRAME_TARGET bytes or more, and at the end."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.parts: list[bytes] = []
        self.size = 0

    def put(self, data: bytes, bounds: Sequence[int] = ()) -> None:
        pos = 0
        for b in bounds:
            if self.size + b - pos >= FRAME_TARGET:
                if b > pos:
                    self.parts.append(data[pos:b])
                    self.size += b - pos
                self.commit()
                pos = b
        if pos < len(data):
            self.parts.append(data[pos:] if pos else data)
            self.size += len(data) - pos

    def commit(self) -> None:
        if self.size >= FRAME_MIN:
            self.f.write(b"\x95" + self.size.to_bytes(8, "little"))
        self.f.write(b"".join(self.parts))
        self.parts = []
        self.size = 0


class _Pickling:
    """One C Pickler whose dumps are pieces of one pickle (its memo carries over)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.pickler = pickle.Pickler(self.buf, protocol=4)

    def __call__(self, obj: Any) -> _Piece:
        self.buf.seek(0)
        self.buf.truncate()
        self.pickler.dump(obj)
        return _piece(self.buf.getvalue())

    def memo_size(self) -> int:
        return len(self.pickler.memo.copy())


class _Steady:
    """Entries of the second pass on: entry i's opcodes around its time_us, pickled once."""

    def __init__(self, rec: _Recording, pk: _Pickling) -> None:
        copy = _Pickling()
        copy.pickler.memo = pk.pickler.memo  # a copy of the first pass' memo
        known = pk.memo_size()
        sentinel = _encode_int(_SENTINEL)
        assert sentinel[:2] == _LONG1_7
        self.rec = rec
        self.pre: list[bytes] = []  # opcodes before the time's, with the LONG1 header
        self.post: list[bytes] = []
        self.pre_bounds: list[list[int]] = []
        self.post_bounds: list[list[int]] = []  # offsets in post
        self.size: list[int] = []  # bytes of the entry less the time's 7
        self.lim: list[int] = []  # no frame ends in the entry when frame size + 9 < lim
        self.base = [rec.time_us(0, i) for i in range(len(rec.body))]
        for ne in rec.entries(1, 0, len(rec.body)):
            ne["time_us"] = _SENTINEL
            p = copy(ne)
            if p.max_get >= known:
                raise ValueError("a steady-state entry refers to an object no earlier entry has")
            at = p.data.find(sentinel)
            if at < 0 or p.data.find(sentinel, at + 1) >= 0 or at not in p.bounds:
                raise ValueError("time_us not found once in an entry's opcodes")
            end = at + len(sentinel)
            self.pre.append(p.data[:at] + _LONG1_7)
            self.post.append(p.data[end:])
            self.pre_bounds.append([b for b in p.bounds if b <= at])
            self.post_bounds.append([b - end for b in p.bounds if b > at])
            self.size.append(len(p.data) - 7)
            # the entry's last boundary: the time's (at) or the last after it
            last = end + self.post_bounds[-1][-1] if self.post_bounds[-1] else at + len(sentinel)
            self.lim.append(FRAME_TARGET - last + len(sentinel))

    def put(self, out: _Framed, g: int, end: int) -> None:
        """Entries g to end (global indices, all past the first pass) into the stream."""
        b = len(self.base)
        pre, post, size, lim, base = self.pre, self.post, self.size, self.lim, self.base
        span = self.rec.span_us
        lo, hi = 1 << 47, 1 << 55
        parts, n = out.parts, out.size
        while g < end:
            rep, i = divmod(g, b)
            j = min(b, i + end - g)
            shift = rep * span
            for k in range(i, j):
                t = base[k] + shift
                if lo <= t < hi and n + 9 < lim[k]:
                    parts += (pre[k], t.to_bytes(7, "little"), post[k])
                    n += size[k] + 7
                    continue
                out.size = n
                self._put_one(out, k, t)
                parts, n = out.parts, out.size
            g += j - i
        out.size = n

    def _put_one(self, out: _Framed, k: int, t: int) -> None:
        head = self.pre[k][:-2]
        enc = _encode_int(t)
        tail = len(head) + len(enc)
        bounds = self.pre_bounds[k] + [tail + b for b in self.post_bounds[k]]
        out.put(head + enc + self.post[k], bounds)


def _write_trace(out: _Framed, pk: _Pickling, rec: _Recording, n: int) -> bool:
    """The trace list's items (after its EMPTY_LIST MEMOIZE), as save_list batches them. True
    when the Pickler's memo fell behind (entries of the second pass on were written)."""
    b = len(rec.body)
    if n == 1:  # a list of one: its item and APPEND
        p = pk(rec.entries(0, 0, 1)[0])
        out.put(p.data, p.bounds)
        out.put(b"a")
        return False
    steady: _Steady | None = None
    g = 0
    while g < n:
        end = min(g + BATCH, n)
        out.put(b"(")
        if g < b:  # the first pass: pickled entry by entry, memoising what later ones refer to
            for ne in rec.entries(0, g, min(end, b)):
                p = pk(ne)
                out.put(p.data, p.bounds)
            g = min(end, b)
        if g < end:
            if steady is None:
                steady = _Steady(rec, pk)
            steady.put(out, g, end)
            g = end
        out.put(b"e")
    return steady is not None


def write_snapshot(n_entries: int, f: IO[bytes], template: Path = DEFAULT_TEMPLATE, extra_frames: int = 22) -> None:
    """Write the pickle of ``generate(n_entries, template, extra_frames)`` (protocol 4) to ``f``,
    as it is made: the same file as ``pickle.dump`` of it (byte for byte where the C pickler
    places its frames as CPython 3.11's does)."""
    rec = _Recording(template, extra_frames)
    pk = _Pickling()
    root = rec.root([])
    keys = list(root)
    assert 1 < len(keys) <= BATCH and keys.count("device_traces") == 1
    f.write(b"\x80\x04")  # PROTO 4
    out = _Framed(f)
    p = pk({})  # the root dict: EMPTY_DICT MEMOIZE
    out.put(p.data, p.bounds)
    out.put(b"(")
    behind = False  # the Pickler's memo is behind the reader's
    for key in keys:
        if key == "device_traces":
            stand_ins: tuple[Any, ...] = (key, [], [])  # the key, the list of traces, the trace
            for obj in stand_ins:
                p = pk(obj)
                out.put(p.data, p.bounds)
            if n_entries:
                behind = _write_trace(out, pk, rec, n_entries)
            out.put(b"a")  # the one trace into the list of traces
            continue
        memo = pk.pickler.memo.copy() if behind else {}
        pieces = [pk(key), pk(root[key])]
        if behind and max(q.max_get for q in pieces) >= len(memo):
            # a reference to an object memoised after the memo fell behind: memoise nothing
            pk.pickler.memo = memo
            pk.pickler.fast = True
            pieces = [pk(key), pk(root[key])]
        for q in pieces:
            out.put(q.data, q.bounds)
    out.put(b"u.")  # SETITEMS, STOP
    out.commit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("entries", type=int)
    ap.add_argument("output", type=Path)
    ap.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE)
    ap.add_argument("--extra-frames", type=int, default=22)
    a = ap.parse_args()
    # written beside the output under another name, renamed when complete: a run that fails or
    # is killed leaves no file at the output's name
    tmp = a.output.with_name(f".{a.output.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            write_snapshot(a.entries, f, a.template, a.extra_frames)
        os.replace(tmp, a.output)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    size = a.output.stat().st_size
    print(f"{a.output}: {a.entries:,} entries, {size / 1e6:.1f} MB ({size / max(a.entries, 1):.0f} B/entry)")


if __name__ == "__main__":
    main()
