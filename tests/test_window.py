"""The window (``--max-entries N``): each device's last N trace entries read, as if torch had
recorded them with ``_record_memory_history(max_entries=N)``.

What must hold: the window's frames equal the frames of a copy of the file whose traces were cut
to their last N entries (what torch's ring buffer would have kept), through the compiled reader
and the Python one alike; the compiled reader holds about N rows, not the file's; the answers say
how many entries were left out; a bad N is refused before anything is read.
"""

from __future__ import annotations

import json
import lzma
import pickle
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from snapshot_lab import _compiled, api, sizing
from snapshot_lab.cli import app
from snapshot_lab.errors import ParameterError
from snapshot_lab.frames import build_frames
from snapshot_lab.load import PickleSize, load_snapshot
from snapshot_lab.load.decoded import decode_pickle
from snapshot_lab.load.unpickler import safe_load
from snapshot_lab.units import format_bytes

from .conftest import event, make_snapshot, sample_path, write_pickle
from .test_decode import _assert_same_as_pickle
from .test_frames_identity import frames_identity

DECODER = _compiled.compiled("snapshot_lab.load._decode")
needs_decoder = pytest.mark.skipif(DECODER is None, reason="the C extension is not built here")


def _unpickled(path: Path) -> Any:
    with lzma.open(path) if path.suffix == ".xz" else path.open("rb") as f:
        return safe_load(f)


def _cut(obj: dict[str, Any], keep: int, out: Path) -> Path:
    """The file torch would have written with max_entries=keep: each trace's last entries."""
    return write_pickle(out, {**obj, "device_traces": [t[-keep:] for t in obj["device_traces"]]})


def _digests(path: Path, max_entries: int | None = None) -> dict[str, str]:
    """Every frame's digest (the file's facts aside: its name and size, the window's own fields)."""
    digests = frames_identity.frames_digests(build_frames(load_snapshot(path, max_entries=max_entries)))
    del digests["info"]
    return digests


def _pure_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_compiled.PURE_PYTHON_VARIABLE, "1")


# a trace with forward stacks (anomaly mode), one of two devices, a GPT-2 recording, an OOM
SAMPLES = ["grad_anomaly_python", "dataparallel", "transformer_varlen", "oom_fragmentation"]


@pytest.mark.parametrize("name", SAMPLES)
@pytest.mark.parametrize("keep", [1, 37, 400])
def test_the_window_reads_what_a_recording_of_max_entries_would_hold(
    name: str, keep: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = sample_path(name)
    obj = _unpickled(path)
    lengths = [len(t) for t in obj["device_traces"]]
    assert max(lengths) > keep  # the window leaves something out
    expected = _digests(_cut(obj, keep, tmp_path / "cut.pickle"))
    snap = load_snapshot(path, max_entries=keep)
    assert (snap.decoded_traces is not None) == (DECODER is not None)
    assert snap.entries_left_out == tuple(max(n - keep, 0) for n in lengths)
    assert _digests(path, keep) == expected
    _pure_python(monkeypatch)
    pure = load_snapshot(path, max_entries=keep)
    assert pure.decoded_traces is None
    assert pure.entries_left_out == snap.entries_left_out
    assert _digests(path, keep) == expected


def test_a_window_as_long_as_the_trace_leaves_nothing_out(monkeypatch: pytest.MonkeyPatch) -> None:
    path = sample_path("transformer_varlen")
    whole = _digests(path)
    n = max(len(t) for t in _unpickled(path)["device_traces"])
    for keep in (n, n + 1, 10 * n, 2**62, 2**63 - 1, 2**70):
        snap = load_snapshot(path, max_entries=keep)
        assert (snap.decoded_traces is not None) == (DECODER is not None)
        assert snap.entries_left_out == (0,) * len(snap.entries_left_out) and len(snap.entries_left_out) >= 1
        assert _digests(path, keep) == whole


def _sparse_entries(n: int) -> list[dict[str, Any]]:
    """Entries whose forward stacks, private pools and compiled regions fall on either side of a
    window's edge (the compiled reader keeps them by row and renumbers them)."""
    frames = [{"filename": "train.py", "line": 7, "name": "step"}]
    out = []
    for i in range(n):
        extra: dict[str, Any] = {"compile_context": "N/A", "pool_id": (0, 0)}
        if i % 3 == 0:
            extra["forward_frames"] = [f"File model.py, line {i}, in forward"]
        if i % 4 == 1:
            extra["pool_id"] = (1, i)
        if i % 5 == 2:
            extra["compile_context"] = f"[0/{i}]"
        action = "alloc" if i % 2 == 0 else "free_completed"
        out.append(event(action, 0x100000 * (i // 2 + 1), 512 * (i // 2 + 1), i, frames=frames, **extra))
    return out


@pytest.mark.parametrize("keep", [1, 2, 5, 64, 65, 199])
def test_forward_stacks_pools_and_compiled_regions_cross_the_windows_edge(
    keep: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    obj = make_snapshot(traces=[_sparse_entries(200), _sparse_entries(90)])
    path = write_pickle(tmp_path / "sparse.pickle", obj)
    expected = _digests(_cut(obj, keep, tmp_path / "cut.pickle"))
    snap = load_snapshot(path, max_entries=keep)
    assert snap.entries_left_out == (max(200 - keep, 0), max(90 - keep, 0))
    if DECODER is not None:
        assert snap.decoded_traces is not None
        first = snap.decoded_traces.devices[0]
        assert first.size_of_trace == keep and first.left_out == 200 - keep
        # rows renumbered from the window's first entry: row r is the file's entry 200 - keep + r
        assert sorted(first.forward) == [r for r in range(keep) if (200 - keep + r) % 3 == 0]
        assert sorted(first.pools) == [r for r in range(keep) if (200 - keep + r) % 4 == 1]
        assert sorted(first.contexts) == [r for r in range(keep) if (200 - keep + r) % 5 == 2]
    assert _digests(path, keep) == expected
    _pure_python(monkeypatch)
    assert _digests(path, keep) == expected


@needs_decoder
def test_the_compiled_reader_holds_about_the_window_not_the_file() -> None:
    frames = [{"filename": "train.py", "line": k, "name": "step"} for k in range(8)]

    def peak(n: int, max_entries: int | None) -> int:
        # each entry with its own frames list over shared frame dicts, as torch writes them
        actions = ("alloc", "free_completed")
        entries = [event(actions[i % 2], 0x1000 * (i // 2), 512, i, list(frames)) for i in range(n)]
        data = pickle.dumps(make_snapshot(traces=[entries]), protocol=4)
        del entries
        tracemalloc.start()
        try:
            out = decode_pickle(data, max_entries=max_entries)
            _, top = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert out is not None and out[1] is not None
        assert out[1].devices[0].size_of_trace == min(n, max_entries or n)
        return top

    whole = peak(120_000, None)
    assert whole > 55 * 120_000  # the columns (55 bytes an entry) and the pickle's memo
    # a window's rows (and their slack) and a few chunks of the memo: the same for a file twice
    # as long, nothing that grows with the file
    window, twice = peak(120_000, 1_000), peak(240_000, 1_000)
    assert window < 400_000 and twice < 400_000
    assert abs(twice - window) < 16_000


def test_the_answers_say_what_the_window_left_out(tmp_path: Path) -> None:
    path = sample_path("transformer_varlen")
    n = len(_unpickled(path)["device_traces"][0])
    stats = api.stats(path, max_entries=100).to_dict()
    rec = stats["recording"]
    assert rec["window"] == 100
    assert rec["devices"][0]["entries_left_out"] == n - 100
    assert rec["history_complete"] is False
    whole = api.stats(path).to_dict()["recording"]
    assert "window" not in whole and "entries_left_out" not in whole["devices"][0]
    found = {f.id: f for f in api.findings(path, max_entries=100)}
    history = found["history-incomplete"]
    assert history.evidence["entries_left_out"] == n - 100
    assert f"the {n - 100:,} before them were left out" in history.advice
    assert "without max_entries" in history.advice
    out = api.report(path, max_entries=100, output=tmp_path / "r.html", format="md")
    assert f"the {n - 100:,} before them were left out" in Path(out).read_text()


def test_the_window_is_kept_when_the_entries_are_read_again() -> None:
    snap = load_snapshot(sample_path("pending_free"), max_entries=3)
    assert [len(t) for t in snap.device_traces] == [
        min(len(t), 3) for t in _unpickled(sample_path("pending_free"))["device_traces"]
    ]


@pytest.mark.parametrize("bad", [0, -5, True, 2.5, "10"])
def test_a_window_of_no_entries_is_refused(bad: Any) -> None:
    with pytest.raises(ParameterError, match="max_entries must be a whole number of 1 or more"):
        api.stats(sample_path("pending_free"), max_entries=bad)
    with pytest.raises(ParameterError):
        api.findings([sample_path("pending_free")], max_entries=bad)


def test_the_loader_refuses_a_window_of_no_entries() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_entries must be 1 or more"):
            load_snapshot(sample_path("pending_free"), max_entries=bad)


@pytest.mark.parametrize("command", ["stats", "leaks", "findings", "report"])
def test_the_command_line_refuses_a_window_of_no_entries(command: str) -> None:
    result = CliRunner().invoke(app, [command, str(sample_path("pending_free")), "--max-entries", "0"])
    assert result.exit_code == 2
    assert "--max-entries" in result.output


def test_stats_json_on_the_command_line_with_a_window() -> None:
    result = CliRunner().invoke(app, ["stats", str(sample_path("transformer_varlen")), "--max-entries", "50", "--json"])
    assert result.exit_code == 0, result.output
    rec = json.loads(result.output)["recording"]
    assert rec["window"] == 50 and rec["devices"][0]["entries_left_out"] > 0


# --------------------------------------------------------------------------- the note before reading


def test_a_file_that_fits_gets_no_note() -> None:
    assert sizing.memory_need("report", 150 << 20, 16 << 30) is None
    assert sizing.memory_need("stats", 8 << 30, 256 << 30) is None


def test_the_note_bounds_the_entries_and_names_the_window_that_fits() -> None:
    # a 7.6 GiB pickle (torch's 50M-entry file of benchmarks/) on a machine with 14 GiB available
    need = sizing.memory_need("report", 7_970_811_260, 14 << 30)
    assert need is not None
    assert need.entries == 7_970_811_260 // 64 == 124_543_925
    assert need.need == (400 << 20) + 220 * 124_543_925
    # 80% of 14 GiB, less the fixed cost, at 220 bytes an entry
    spare = int((14 << 30) * 0.8) - (400 << 20)
    assert need.window == spare // 220 - (spare // 220) % 1_000_000 == 52_000_000
    assert need.window_need == (400 << 20) + 220 * 52_000_000
    assert need.window_need <= (14 << 30) * 0.8
    small = sizing.memory_need("stats", 200 << 20, 700 << 20)
    assert small is not None and small.window == 1_000_000  # 1,198,372 fit: whole millions
    assert sizing.memory_need("report", 8 << 30, 256 << 20).window is None  # not even a small window


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   12345678 kB\n")
    assert sizing.available_memory(meminfo) == 12_345_678 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert sizing.available_memory(meminfo) is None
    assert sizing.available_memory(tmp_path / "absent") is None


def test_the_command_line_notes_a_file_that_may_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = sample_path("oom_fragmentation")
    assert plain.suffix == ".pickle"
    monkeypatch.setattr(sizing, "available_memory", lambda: 300 << 20)
    result = CliRunner().invoke(app, ["stats", str(plain), "--json"])
    assert result.exit_code == 0
    assert result.stderr == (
        f"snaplab: note: {plain.name} ({format_bytes(plain.stat().st_size)}) may hold up to "
        f"{plain.stat().st_size // 64:,} trace entries, which `stats` can need up to "
        f"{format_bytes(sizing.needed('stats', plain.stat().st_size // 64))} of memory for; this machine has "
        "300.00 MiB available, too little for any window of the trace.\n"
    )
    json.loads(result.stdout)  # the note is on stderr only
    windowed = CliRunner().invoke(app, ["stats", str(plain), "--json", "--max-entries", "1000"])
    assert windowed.exit_code == 0 and windowed.stderr == ""
    xz = sample_path("transformer_varlen")  # the size xz states it decompresses to
    assert api.memory_note(xz, "stats") == (
        f"{xz.name} (901.19 KiB decompressed) may hold up to 14,419 trace entries, which `stats` can need up to "
        f"{format_bytes(sizing.needed('stats', 14_419))} of memory for; this machine has 300.00 MiB available, too "
        "little for any window of the trace."
    )
    monkeypatch.setattr(sizing, "available_memory", lambda: 64 << 30)
    assert api.memory_note(plain, "report") is None


def test_the_note_names_the_window_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "pickle_size", lambda path: PickleSize(7_970_811_260, False))
    monkeypatch.setattr(sizing, "available_memory", lambda: 14 << 30)
    assert api.memory_note("big.pickle", "report") == (
        "big.pickle (7.42 GiB) may hold up to 124,543,925 trace entries, which `report` can need up to 25.91 GiB of "
        "memory for; this machine has 14.00 GiB available. If it runs out, `--max-entries 52,000,000` reads each "
        "device's last 52,000,000 entries in about 11.04 GiB."
    )


def test_diff_and_ranks_read_each_file_through_the_window(tmp_path: Path) -> None:
    a, b = sample_path("ddp_bucketview_mlp_rank0"), sample_path("ddp_bucketview_mlp_rank1")
    cut = [_cut(_unpickled(p), 40, tmp_path / p.name.replace(".xz", "")) for p in (a, b)]
    for p in (a, b):  # the sidecars name the ranks and the layout
        sidecar = p.with_name(p.name.split(".pickle")[0] + ".meta.json")
        (tmp_path / sidecar.name).write_bytes(sidecar.read_bytes())
    paths = ("before", "after")
    windowed = {k: v for k, v in api.diff(a, b, max_entries=40).to_dict().items() if k not in paths}
    expected = {k: v for k, v in api.diff(*cut).to_dict().items() if k not in paths}
    assert windowed == expected
    assert windowed != {k: v for k, v in api.diff(a, b).to_dict().items() if k not in paths}
    rows, errors = api.ranks([a, b], jobs=1, max_entries=40)
    cut_rows, _ = api.ranks(cut, jobs=1)
    assert errors == {} and len(rows) == 2
    assert [r.summary.peak_requested_bytes for r in rows] == [r.summary.peak_requested_bytes for r in cut_rows]
    with pytest.raises(ParameterError):
        api.ranks([a, b], max_entries=0)
    with pytest.raises(ParameterError):
        api.diff(a, b, max_entries=0)


def test_every_command_that_reads_a_snapshot_reads_it_through_the_window(tmp_path: Path) -> None:
    path = sample_path("transformer_varlen")
    cut = _cut(_unpickled(path), 3_000, tmp_path / "transformer_varlen.pickle")
    assert api.whatif(path, max_entries=3_000).to_dict() == api.whatif(cut).to_dict()
    assert api.fit(path, max_entries=3_000).to_dict() == api.fit(cut).to_dict()
    window, whole = api.plan(path, world_size=2, max_entries=3_000), api.plan(cut, world_size=2)
    assert window.to_dict() == whole.to_dict()
    assert api.check(path, max_peak="1GiB", max_entries=3_000).to_dict() == api.check(cut, max_peak="1GiB").to_dict()
    tables = api.export(path, output=tmp_path / "tables", format="csv", max_entries=3_000)
    events = next(p for p in tables if p.name == "events.csv")
    assert len(events.read_text().splitlines()) == 3_000 + 1
    with pytest.raises(ParameterError):
        api.check(path, max_entries=0)


def _cut_reference(reference: Any, keep: int) -> Any:
    if type(reference) is dict and type(reference.get("device_traces")) is list:
        traces = reference["device_traces"]
        if all(type(t) is list for t in traces):
            return {**reference, "device_traces": [t[-keep:] for t in traces]}
    return reference


@needs_decoder
@pytest.mark.parametrize("name", ["pytest_over_limit_peak", "grad_anomaly_python"])
@pytest.mark.parametrize("keep", [1, 3, 10])
def test_seeded_byte_flips_under_a_window_give_up_or_equal_the_cut_pickle(name: str, keep: int) -> None:
    path = sample_path(name)
    with lzma.open(path) if path.suffix == ".xz" else path.open("rb") as f:
        data = f.read()
    rng = random.Random(4040 + keep)
    decoded = 0
    for _ in range(600):
        mutated = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        out = decode_pickle(bytes(mutated), max_entries=keep)
        if out is None:
            continue
        reference = pickle.loads(bytes(mutated))  # it decoded: pickle must read it too
        _assert_same_as_pickle(out, _cut_reference(reference, keep))
        if out[1] is not None:
            lengths = [len(t) for t in reference["device_traces"]]
            assert [d.left_out for d in out[1].devices] == [max(n - keep, 0) for n in lengths]
        decoded += 1
    assert decoded > 20


@needs_decoder
def test_a_reference_to_a_forgotten_part_of_the_memo_gives_up_to_the_python_reader(tmp_path: Path) -> None:
    # the last entry's frames list is the very list of an entry 20,000 entries before: under a
    # window the memo has given that slot back, so the compiled reader gives up; the Python
    # reader answers the same as for the cut file
    frames = [{"filename": "train.py", "line": k, "name": "step"} for k in range(4)]
    lists = [list(frames) for _ in range(30_000)]
    entries = [event("alloc", 0x1000 * (i + 1), 512, i, lists[i]) for i in range(30_000)]
    entries.append(event("alloc", 0x1000 * 40_000, 512, 30_000, lists[10_000]))
    obj = make_snapshot(traces=[entries])
    data = pickle.dumps(obj, protocol=4)
    assert decode_pickle(data) is not None  # read whole, the memo keeps every slot
    assert decode_pickle(data, max_entries=100) is None
    path = write_pickle(tmp_path / "shared_late.pickle", obj)
    snap = load_snapshot(path, max_entries=100)
    assert snap.decoded_traces is None and snap.entries_left_out == (30_001 - 100,)
    assert _digests(path, 100) == _digests(_cut(obj, 100, tmp_path / "cut.pickle"))


def test_ranks_notes_workers_that_may_not_fit_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 rank files of 500 MB read by 16 workers: the 16 largest at once may need 23.71 GiB; with
    16 GiB available, 8 workers fit (80% of it), or each worker's 1 GiB fits a 2M-entry window."""
    files = [f"job_rank{r}.pickle" for r in range(64)]
    monkeypatch.setattr(api, "pickle_size", lambda path: PickleSize(500_000_000, False))
    monkeypatch.setattr(sizing, "available_memory", lambda: 16 << 30)
    assert api.ranks_memory_note(files, jobs=16) == (
        "64 of the files (29.80 GiB together) may hold up to 500,000,000 trace entries; `ranks` with 16 workers, "
        "each reading one file at a time, can need up to 23.71 GiB of memory for the largest 16 at once; this "
        "machine has 16.00 GiB available. If it runs out, `--jobs 8` keeps 8 files in memory at once or "
        "`--max-entries 2,000,000` reads each file's last 2,000,000 entries per device."
    )
    assert api.ranks_memory_note(files, jobs=10) is None  # 14.82 GiB
    assert api.ranks_memory_note(files[:4], jobs=16) is None  # one worker per file: 4
    monkeypatch.setattr(api, "pickle_size", lambda path: None)  # JSON, gzip: sizes not known
    assert api.ranks_memory_note(files, jobs=16) is None


def test_ranks_names_the_remedy_that_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not one file alone fits: no fewer workers to name; nor a window for two workers' share."""
    monkeypatch.setattr(api, "pickle_size", lambda path: PickleSize(8_000_000_000, False))
    monkeypatch.setattr(sizing, "available_memory", lambda: 8 << 30)
    note = api.ranks_memory_note(["a_rank0.pickle", "a_rank1.pickle"], jobs=2)
    assert note is not None and note.endswith(
        "If it runs out, `--max-entries 20,000,000` reads each file's last 20,000,000 entries per device."
    )
    monkeypatch.setattr(sizing, "available_memory", lambda: 600 << 20)
    note = api.ranks_memory_note(["a_rank0.pickle", "a_rank1.pickle"], jobs=2)
    assert note is not None and note.endswith("If it runs out, read the files on a bigger machine (`--scheduler`).")


def test_the_command_line_notes_ranks_that_may_not_fit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plain = sample_path("oom_fragmentation")
    files = []
    for r in range(2):
        files.append(tmp_path / f"job_rank{r}.pickle")
        files[-1].write_bytes(plain.read_bytes())
    monkeypatch.setattr(sizing, "available_memory", lambda: 300 << 20)
    result = CliRunner().invoke(app, ["ranks", *map(str, files), "--jobs", "2", "--json"])
    assert result.exit_code == 0
    assert result.stderr.startswith("snaplab: note: 2 of the files (") and "`ranks` with 2 workers" in result.stderr
    assert len(json.loads(result.stdout)["ranks"]) == 2  # the note is on stderr only
    windowed = CliRunner().invoke(app, ["ranks", *map(str, files), "--jobs", "2", "--json", "--max-entries", "1000"])
    assert windowed.exit_code == 0 and "note" not in windowed.stderr


@pytest.mark.parametrize(
    ("command", "args"),
    [
        ("whatif", ["--json"]),
        ("fit", ["--json"]),
        ("plan", ["--json", "--world-size", "2"]),
        ("check", ["--json", "--allow-oom"]),
        ("export", ["-o", "{tmp}/tables"]),
    ],
)
def test_other_commands_note_a_file_that_may_not_fit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str, args: list[str]
) -> None:
    """fit's need per entry is the largest (its levers' tapes): 540 bytes against stats' 140."""
    plain = sample_path("oom_fragmentation")
    monkeypatch.setattr(sizing, "available_memory", lambda: 300 << 20)
    result = CliRunner().invoke(app, [command, str(plain), *(a.format(tmp=tmp_path) for a in args)])
    entries = plain.stat().st_size // 64
    assert result.stderr.startswith(
        f"snaplab: note: {plain.name} ({format_bytes(plain.stat().st_size)}) may hold up to {entries:,} trace "
        f"entries, which `{command}` can need up to {format_bytes(sizing.needed(command, entries))} of memory"
    )
    assert sizing.needed("fit", 1_000_000) - sizing.needed("stats", 1_000_000) == 400_000_000
    assert result.stderr.count("snaplab: note:") == 1


def test_diff_and_check_note_each_file_they_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Both files are read, one after the other: a note for each that may not fit, one for a file
    given twice."""
    a = sample_path("oom_fragmentation")
    b = tmp_path / "copy.pickle"
    b.write_bytes(a.read_bytes())
    monkeypatch.setattr(sizing, "available_memory", lambda: 300 << 20)
    both = CliRunner().invoke(app, ["diff", str(a), str(b), "--json"])
    assert [line.split(" (")[0] for line in both.stderr.splitlines()] == [
        f"snaplab: note: {a.name}",
        "snaplab: note: copy.pickle",
    ]
    assert "`diff` can need up to" in both.stderr
    once = CliRunner().invoke(app, ["diff", str(a), str(a), "--json"])
    assert once.stderr.count("snaplab: note:") == 1
    gate = CliRunner().invoke(app, ["check", str(a), "--allow-oom", "--baseline", str(b), "--json"])
    assert gate.stderr.count("`check` can need up to") == 2
    windowed = CliRunner().invoke(app, ["diff", str(a), str(b), "--json", "--max-entries", "100"])
    assert windowed.exit_code == 0 and windowed.stderr == ""
