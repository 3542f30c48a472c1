"""Corrupted snapshots never crash snaplab: each gives exit code 3 and one line, or loads."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from snapshot_lab import SnapshotFormatError, api, load_frames
from snapshot_lab.frames import check_frames
from snapshot_lab.load import load_snapshot
from snapshot_lab.metrics import compute_stats
from snapshot_lab.metrics.diagnose import diagnose

from .conftest import ROOT, block, event, make_snapshot, sample_path, segment
from .fuzz.contract import Contract


def _mutations(raw: bytes, seed: int, n: int):
    rng = random.Random(seed)
    for _ in range(n):
        b = bytearray(raw)
        kind = rng.choice(["flip", "truncate", "splice", "zero"])
        if kind == "flip":
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == "truncate":
            b = b[: rng.randrange(1, len(b))]
        elif kind == "splice":
            i = rng.randrange(len(b))
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            i = rng.randrange(len(b))
            b[i : i + rng.randint(1, 32)] = bytes(32)
        yield bytes(b)


@pytest.mark.parametrize("seed", range(4))
def test_mutated_real_snapshot(tmp_path, seed):
    raw = sample_path("oom_fragmentation").read_bytes()
    for i, data in enumerate(_mutations(raw, seed, 60)):
        p = tmp_path / f"m{i}.pickle"
        p.write_bytes(data)
        try:
            frames = load_frames(p)
            diagnose(frames, compute_stats(frames))  # a mutation that still parses must still analyse
        except SnapshotFormatError as exc:
            assert "\n" not in str(exc)


def test_wrong_types_everywhere(tmp_path):
    """Type confusion inside otherwise valid structure: strings for ints, dicts for lists..."""
    base = make_snapshot(
        [segment(1 << 20, [block(512), block(1024, "inactive")])],
        [[event("alloc", 1 << 20, 512, 1, frames=[{"filename": "a.py", "line": 1, "name": "f"}])]],
    )
    bad_values = ["x", None, -5, 3.5, [], {}, True, 2**70]
    paths = [
        ("segments", 0, "address"),
        ("segments", 0, "total_size"),
        ("segments", 0, "device"),
        ("segments", 0, "segment_pool_id"),
        ("segments", 0, "blocks"),
        ("segments", 0, "blocks", 0, "address"),
        ("segments", 0, "blocks", 0, "state"),
        ("segments", 0, "blocks", 0, "frames"),
        ("device_traces", 0, 0, "size"),
        ("device_traces", 0, 0, "addr"),
        ("device_traces", 0, 0, "time_us"),
        ("device_traces", 0, 0, "frames"),
        ("device_traces", 0, 0, "action"),
        ("allocator_settings",),
        ("external_annotations",),
    ]
    n = 0
    for path in paths:
        for v in bad_values:
            snap = pickle.loads(pickle.dumps(base))
            target = snap
            for k in path[:-1]:
                target = target[k]
            target[path[-1]] = v
            p = tmp_path / f"t{n}.pickle"
            p.write_bytes(pickle.dumps(snap))
            n += 1
            try:
                frames = load_frames(p)
                diagnose(frames, compute_stats(frames))
            except SnapshotFormatError as exc:
                assert "\n" not in str(exc)
                continue
            if path[0] in ("allocator_settings", "external_annotations"):
                api.report(p, output=tmp_path / f"t{n}.html")  # rendered as text, whatever the type


# --------------------------------------------------------------------------- issue #13: the fuzz harness

FUZZ = Path(__file__).parent / "fuzz"
REGRESSIONS = sorted((FUZZ / "regressions").iterdir())
PENDING_INPUTS = sorted(p for p in (FUZZ / "pending").iterdir() if p.suffix != ".md")

# every crash class the fuzzer found, as its minimised input and the one line it now gets
EXPECTED = {
    # OverflowError inside pandas' astype (numbers outside int64), or an int() of inf/NaN
    "annotation_device_inf": "external_annotations[0].device: expected an integer in [0, 2**16), got inf",
    "annotation_time_2_64": "external_annotations[0].time_us: expected an integer in [0, 2**63), got 2**64",
    "oom_device_free_2_64": "device_traces[0][3].device_free: expected an integer in [0, 2**63), got 2**64",
    "trace_size_2_64": "device_traces[0][1].size: expected an integer in [0, 2**63), got 2**64",
    "block_address_past_int64": "segments[0].total_size: expected an integer in [0, 1024), got 2048",
    "requested_sum_past_int64": "segments[0].blocks[0].requested_size: expected an integer in [0, 513), got 2**62",
    # allocator_settings of the wrong type: whatif and the report crashed
    "settings_gc_threshold_list": "allocator_settings.garbage_collection_threshold: expected a number in [0, 1], got a",
    "settings_max_split_nan": "allocator_settings.max_split_size: expected an integer in [-1, 2**63), got nan",
    "settings_divisions_str": "allocator_settings.roundup_power2_divisions['32']: expected an integer in [0, 2**31)",
    # a long key cut inside its quotes, so that the path stays a path (found by the campaign)
    "settings_divisions_long_key": "allocator_settings.roundup_power2_divisions['" + "+" * 32 + "...']: expected an",
    # values read leniently before (silently 0, or 'no stack'), now named
    "frame_line_nan": "device_traces[0][0].frames[0].line: expected an integer in [-2**63, 2**64), got nan",
    "trace_frames_none": "device_traces[0][0].frames: expected a list of frames, got None",
    "trace_action_list": "device_traces[0][0].action: expected a string, got a list of 1 item",
    "segment_expandable_str": "segments[0].is_expandable: expected True or False, got 'no'",
    # messages that were not one printable line
    "keys_with_control_chars": "no 'segments' key (found keys: '\\x01gments', device_traces)",
    "pickle_float_raw_bytes": "not a valid pickle (ValueError: could not convert string to float",
    # a STACK_GLOBAL name with a newline and an escape code (found by the 1M-input campaign)
    "global_name_control_chars": "refused: the pickle references the Python global 'os \\x1b[.sys\\x00tem'",
    # ...and one of 80 NUL bytes, whose escapes made the line 4x longer than its cut (campaign 5)
    "global_name_nul_bytes": "refused: the pickle references the Python global '_codecs.en\\x00\\x00",
    # 'SystemError: deallocated bytearray object has exported buffers' on stderr besides the line
    "bytearray8_2_54": "refused: reading it needs more memory than 112 bytes of snapshot can",
    # bombs: memory or time far beyond the file's size
    "memo_long_binput_2_30": "refused: reading it needs more memory than 9 bytes of snapshot can (a pickle bomb?)",
    "shared_entry_bomb": "refused: 100,000 trace entries in 200,839 bytes of data",
    "shared_segment_bomb": "refused: 50,000 segments in 100,763 bytes of data",
    "deep_nesting": "segments[0]: expected a segment (a dict), got a list of 1 item",
}


def _contract(tmp_path: Path) -> Contract:
    return Contract(tmp_path / "work", sample_path("oom_capacity"))


def test_every_regression_input_has_its_expected_line():
    assert {p.name.split(".")[0] for p in REGRESSIONS} == set(EXPECTED)


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: p.name.split(".")[0])
def test_regression_input_keeps_the_contract(tmp_path, path):
    """Refused with its one line by the API, and the whole contract holds (every stage)."""
    with pytest.raises(SnapshotFormatError) as ei:
        check_frames(load_snapshot(path))
    assert EXPECTED[path.name.split(".")[0]] in ei.value.reason
    _contract(tmp_path).run(path.read_bytes(), everything=True)


ACCEPTED = sorted((FUZZ / "accepted").iterdir())


@pytest.mark.parametrize("path", ACCEPTED, ids=lambda p: p.name.split(".")[0])
def test_accepted_crash_input_now_analyses(tmp_path, path):
    """Inputs the loader rightly accepts that crashed an analysis stage, found by the campaign.
    trace_of_frees_only: every trace entry frees memory allocated before recording began, so no
    category ever rises above 0 and the category plot had nothing to stack (matplotlib:
    'facecolor must not be an empty sequence', exit 70 from `snaplab report`).
    expandable_request_past_its_range: one request of 217 TB; the what-if grid's expandable-segments
    scenario tried to grow a range of 2**47 bytes past its end and tripped the model's assertion
    (torch's own TORCH_INTERNAL_ASSERT): now the request is out of memory, as on a GPU."""
    _contract(tmp_path).run(path.read_bytes(), everything=True)
    out = tmp_path / "r.html"
    api.report(path, output=out)
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert 'alt="Memory by category over the trace of device 0" src="data:image/png;base64,' in html


def _snaplab() -> list[str]:
    script = Path(sys.executable).with_name("snaplab")
    return [str(script)] if script.exists() else [sys.executable, "-m", "snapshot_lab"]


CLI_COMMANDS = [
    ["stats"],
    ["findings", "--json"],
    ["leaks"],
    ["whatif"],
    ["report", "-o", "{tmp}/r.html"],
    ["diff", "{reference}"],
    ["export", "-o", "{tmp}/export", "-f", "csv"],
    ["check", "--max-reserved", "1GiB"],
]


def test_real_cli_prints_exactly_one_line_for_every_refused_input(tmp_path):
    """The console script in its own process, stderr captured: every regression input under a
    command (rotating through all eight; the allocator_settings ones also under whatif, which
    crashed on them), and the one that printed a SystemError under all eight."""
    jobs = []
    for i, path in enumerate(REGRESSIONS):
        cmds = [CLI_COMMANDS[i % len(CLI_COMMANDS)]]
        if path.name.startswith("settings_") and cmds[0][0] != "whatif":
            cmds.append(["whatif"])
        if path.name.startswith("bytearray8"):
            cmds = CLI_COMMANDS
        for cmd in cmds:
            args = [a.format(tmp=tmp_path, reference=sample_path("oom_capacity")) for a in cmd]
            if args[0] == "diff":  # the bad file on either side
                args = ["diff", str(path), args[1]] if i % 2 else ["diff", args[1], str(path)]
            else:
                args = [args[0], str(path), *args[1:]]
            jobs.append((path, args))
    results = []
    for k in range(0, len(jobs), 4):  # four processes at a time
        batch = [
            (path, args, subprocess.Popen([*_snaplab(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            for path, args in jobs[k : k + 4]
        ]
        for path, args, proc in batch:
            out, err = proc.communicate(timeout=300)
            results.append((path, args, proc.returncode, out.decode(), err.decode()))
    for path, args, rc, out, err in results:
        lines = err.splitlines()
        assert rc == 3, (args, rc, err)
        assert len(lines) == 1, (args, err)
        assert lines[0].startswith(f"snaplab: error: {path}: "), (args, err)
        assert EXPECTED[path.name.split(".")[0]] in lines[0]
        assert out == ""
    assert not (tmp_path / "r.html").exists()  # no report, not even a partial one


@pytest.mark.parametrize("path", PENDING_INPUTS, ids=lambda p: p.name)
def test_pending_inputs_still_crash(tmp_path, path):
    """Known crashes outside the loader (tests/fuzz/pending.py): once one is fixed this fails,
    and its input moves to tests/fuzz/regressions/."""
    from .fuzz.pending import PENDING

    c = _contract(tmp_path)
    c.run(path.read_bytes(), everything=True)
    assert c.stats.pending_skipped == 1, f"{path.name} no longer crashes: move it to regressions/"
    assert any(p.name == path.name.split(".")[0] for p in PENDING)


FUZZ_RUNS = int(os.environ.get("SNAPLAB_FUZZ_RUNS", "2500"))


def test_bounded_fuzz_session(tmp_path):
    """A coverage-guided session on every run of the suite: libFuzzer (atheris), seed 1, a
    fixed number of inputs from the real samples; any contract violation fails it. Without
    atheris (a platform it has no wheel for), the same contract over the same mutators driven
    by a seeded random generator instead of coverage."""
    # analysis and outputs sampled more often than in a campaign, so that a short session runs them
    env = dict(
        os.environ,
        SNAPLAB_FUZZ_WORKDIR=str(tmp_path / "work"),
        SNAPLAB_FUZZ_SAMPLING="8,80,400",
        SNAPLAB_FUZZ_STATS=str(tmp_path / "stats.json"),
        PYTHONPATH=str(ROOT),
    )
    if importlib.util.find_spec("atheris") is None:
        _fallback_session(tmp_path, FUZZ_RUNS // 4)
        pytest.skip("atheris is not installed: ran the contract over seeded random mutations only")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "tests.fuzz.fuzz_snaplab",
        "-seed=1",
        f"-runs={FUZZ_RUNS}",
        "-max_len=262144",
        "-rss_limit_mb=3072",
        "-timeout=120",
        "-max_total_time=240",
        f"-artifact_prefix={tmp_path}/",
        str(corpus),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    tail = "\n".join(proc.stderr.splitlines()[-40:])
    assert proc.returncode == 0, tail
    done = re.findall(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+)", proc.stderr)
    assert done, tail
    runs, cov, ft = map(int, done[-1])
    stats = json.loads((tmp_path / "stats.json").read_text())  # written every 1000 inputs
    print(f"fuzz session: {runs} inputs, cov {cov} ft {ft}, stages {stats}")
    assert runs >= FUZZ_RUNS and cov > 300
    assert stats["loaded"] and stats["frames"] and stats["analysed"], stats


def _fallback_session(tmp_path: Path, n: int) -> None:
    import random

    from .fuzz import mutate
    from .fuzz.seeds import seed_corpus

    seeds = list(seed_corpus().values())
    rng = random.Random(1)
    c = _contract(tmp_path)
    for _ in range(n):
        c.run(mutate.mutate(rng.choice(seeds), rng))
