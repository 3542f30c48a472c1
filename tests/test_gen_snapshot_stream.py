"""benchmarks/gen_snapshot.py writes its pickle as it goes (write_snapshot): the file must be the
one pickle.dump(generate(N), f, protocol=4) writes, frame dicts shared as there."""

from __future__ import annotations

import io
import pickle
import pickletools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import gen_snapshot
finally:
    sys.path.pop(0)

SMALL = ROOT / "sample_snapshots" / "cuda_graph.pickle.xz"  # 127 steady-state entries, 57 without frames


def _streamed(n: int, template: Path = gen_snapshot.DEFAULT_TEMPLATE, extra_frames: int = 22) -> bytes:
    buf = io.BytesIO()
    gen_snapshot.write_snapshot(n, buf, template, extra_frames)
    return buf.getvalue()


def _frames(data: bytes) -> list[int]:
    return [arg for op, arg, _ in pickletools.genops(data) if op.name == "FRAME"]


@pytest.mark.parametrize(
    ("n", "template", "extra"),
    [
        (0, gen_snapshot.DEFAULT_TEMPLATE, 22),
        (1, gen_snapshot.DEFAULT_TEMPLATE, 22),
        (2, gen_snapshot.DEFAULT_TEMPLATE, 22),
        (5000, gen_snapshot.DEFAULT_TEMPLATE, 22),  # past the first pass (4672) and a batch
        (1, SMALL, 3),
        (127, SMALL, 3),
        (12345, SMALL, 3),  # 97 passes, 13 batches
        (3001, SMALL, 0),
    ],
)
def test_the_streamed_pickle_is_pickle_dump_of_generate(n, template, extra):
    data = _streamed(n, template, extra)
    snap = gen_snapshot.generate(n, template, extra)
    assert data == pickle.dumps(snap, protocol=4)  # byte for byte, FRAME opcodes included
    assert pickle.loads(data) == snap
    assert pickle._loads(data) == snap  # the Python unpickler: no opcode straddles a frame
    assert all(size <= 65536 + 4096 for size in _frames(data))


def test_frame_dicts_stay_shared_objects():
    b = len(gen_snapshot._Recording(SMALL, 3).body)
    data = _streamed(5 * b + 7, SMALL, 3)
    trace = pickle.loads(data)["device_traces"][0]
    assert len(trace) == 5 * b + 7
    with_frames = [i for i in range(b) if trace[i]["frames"]]
    assert len(with_frames) > b // 3
    for i in with_frames:
        for rep in range(1, 5):
            a, c = trace[i]["frames"], trace[rep * b + i]["frames"]
            assert a is not c  # a list per entry
            assert [id(f) for f in a] == [id(f) for f in c]  # over the same frame dicts
    ids = {id(f) for e in trace for f in e["frames"]}
    assert ids == {id(f) for e in trace[:b] for f in e["frames"]}  # no frame dict past the first pass is new


def test_a_tail_that_refers_to_itself_is_pickled_memoising_nothing(monkeypatch):
    """After the entries past the first pass, the Pickler's memo is behind the reader's: what
    follows the trace may not refer to what it memoises itself."""
    shared = ["an object seen only in allocator_settings"]
    root = gen_snapshot._Recording.root

    def root_with_shared(self, trace):
        out = root(self, trace)
        out["allocator_settings"] = {"a": shared, "b": shared}
        return out

    monkeypatch.setattr(gen_snapshot._Recording, "root", root_with_shared)
    data = _streamed(300, SMALL, 1)
    snap = pickle.loads(data)
    assert snap == gen_snapshot.generate(300, SMALL, 1)
    assert snap["allocator_settings"] == {"a": shared, "b": shared}


def test_the_script_writes_its_file_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    out = tmp_path / "snap.pickle"
    monkeypatch.setattr(sys, "argv", ["gen_snapshot.py", "300", str(out), "--template", str(SMALL)])
    gen_snapshot.main()
    assert pickle.loads(out.read_bytes()) == gen_snapshot.generate(300, SMALL)
    assert capsys.readouterr().out.startswith(f"{out}: 300 entries, ")
    assert [p.name for p in tmp_path.iterdir()] == ["snap.pickle"]

    def fail(n, f, *args):
        f.write(b"\x80\x04partial")
        raise KeyboardInterrupt

    out.unlink()
    monkeypatch.setattr(gen_snapshot, "write_snapshot", fail)
    with pytest.raises(KeyboardInterrupt):
        gen_snapshot.main()
    assert list(tmp_path.iterdir()) == []
