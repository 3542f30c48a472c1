"""The command line: output, exit codes, and one clear line for every bad input."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from snapshot_lab import __version__, _compiled
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_BAD_INPUT, EXIT_INTERNAL

from .conftest import sample_path, sample_truth, write_pickle

runner = CliRunner()
ANALYSIS_COMMANDS = ["stats", "leaks", "findings", "check", "ranks", "whatif"]
COMMANDS = [*ANALYSIS_COMMANDS, "report"]


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_stats_json_equals_torch_counters():
    r = invoke("stats", str(sample_path("oom_fragmentation")), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    truth = sample_truth("oom_fragmentation")["memory_stats"]["0"]
    for key, value in out["torch_stats"].items():
        assert value == truth[key], key
    assert out["oom"]["cause"] == "fragmentation"
    assert out["devices"]["0"]["torch_stats"] == out["torch_stats"]
    assert out["fragmentation"]["large_pool"]["largest_free_block_bytes"] == 14 * 2**20
    hist = out["fragmentation"]["large_pool"]["free_block_histogram"]
    assert hist == [{"lower_bytes": 8 * 2**20, "upper_bytes": 16 * 2**20, "count": 75, "bytes": 75 * 14 * 2**20}]


def test_stats_text():
    r = invoke("stats", str(sample_path("oom_fragmentation")))
    assert r.exit_code == 0
    assert "reserved_bytes" in r.stdout and "1.46 GiB" in r.stdout
    assert "OUT OF MEMORY (fragmentation)" in r.stdout


def test_stats_on_two_devices_shows_both():
    r = invoke("stats", str(sample_path("dataparallel")))
    assert r.exit_code == 0
    assert "== device 0" in r.stdout and "== device 1" in r.stdout


@pytest.mark.parametrize("cmd", [*COMMANDS, "diff", "export"])
def test_help_of_every_command(cmd):
    r = invoke(cmd, "--help")
    assert r.exit_code == 0
    assert "--debug" in r.stdout and "--quiet" in r.stdout
    assert ("--json" in r.stdout) == (cmd in [*ANALYSIS_COMMANDS, "diff"])


def test_version():
    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.startswith("snaplab ")
    # which path this installation is on: the C extensions, or the pure-Python code alone (built
    # or not, or switched off with SNAPLAB_PURE_PYTHON=1, as CI's second pass does)
    assert r.stdout == f"snaplab {__version__} ({_compiled.describe()})\n"
    assert _compiled.describe().startswith(("compiled (C)", "pure Python (", "partly compiled ("))


def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "empty.pickle").write_bytes(b"")
    (tmp / "garbage.pickle").write_bytes(bytes(range(1, 200)))
    raw = sample_path("oom_fragmentation").read_bytes()
    (tmp / "trunc.pickle").write_bytes(raw[:1000])
    (tmp / "text.txt").write_text("hello\n")
    write_pickle(tmp / "list_of_int.pickle", {"segments": 5})
    write_pickle(tmp / "nondict.pickle", "a string")
    (tmp / "evil.pickle").write_bytes(b"\x80\x02cos\nsystem\nq\x00X\x05\x00\x00\x00echo!q\x01\x85q\x02Rq\x03.")
    return {
        "missing": (tmp / "missing.pickle", "no such file"),
        "empty": (tmp / "empty.pickle", "empty file"),
        "garbage": (tmp / "garbage.pickle", "not a PyTorch memory snapshot"),
        "truncated": (tmp / "trunc.pickle", "truncated"),
        "text": (tmp / "text.txt", "neither a pickle nor JSON"),
        "bad segments": (tmp / "list_of_int.pickle", "'segments' is a int"),
        "non-dict": (tmp / "nondict.pickle", "holds a str"),
        "global": (tmp / "evil.pickle", "os.system"),
    }


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize(
    "case", ["missing", "empty", "garbage", "truncated", "text", "bad segments", "non-dict", "global"]
)
def test_bad_input_one_line_no_traceback(tmp_path, cmd, case):
    path, fragment = _bad_inputs(tmp_path)[case]
    r = runner.invoke(app, [cmd, str(path)])
    assert r.exit_code == EXIT_BAD_INPUT, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("snaplab: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in r.output
    assert r.stdout == ""


def test_debug_shows_traceback(tmp_path):
    r = runner.invoke(app, ["stats", str(tmp_path / "missing.pickle"), "--debug"])
    assert r.exit_code != 0
    assert r.exception is not None  # re-raised for the traceback


def test_internal_error_is_one_line(monkeypatch, tmp_path):
    from snapshot_lab import api

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(api, "stats", boom)
    r = invoke("stats", str(sample_path("oom_fragmentation")))
    assert r.exit_code == EXIT_INTERNAL
    assert "internal error" in r.stderr and "kaboom" in r.stderr and "--debug" in r.stderr


def _console_script() -> list[str]:
    exe = shutil.which("snaplab", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "snapshot_lab"]


def test_console_script_subprocess(tmp_path):
    ok = subprocess.run(
        [*_console_script(), "stats", "--json", str(sample_path("cuda_graph"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert (
        json.loads(ok.stdout)["torch_stats"]["segment.all.current"]
        == sample_truth("cuda_graph")["memory_stats"]["0"]["segment.all.current"]
    )
    assert ok.stderr == ""  # no progress bar when stderr is not a terminal
    bad = tmp_path / "x.pickle"
    bad.write_bytes(pickle.dumps([1, 2]))
    r = subprocess.run([*_console_script(), "stats", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_BAD_INPUT
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_the_console_script_keeps_its_exit_codes_and_output_with_its_quick_exit():
    """main() ends the process with os._exit once stdout and stderr are flushed (no interpreter
    teardown): a usage error still exits 2 with its message, and help arrives whole."""
    usage = subprocess.run([*_console_script(), "no-such-command"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "No such command" in usage.stderr
    helped = subprocess.run([*_console_script(), "report", "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--output" in helped.stdout and helped.stdout.rstrip().endswith("╯")


def test_python_dash_m(tmp_path):
    r = subprocess.run([sys.executable, "-m", "snapshot_lab", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "snaplab" in r.stdout


@pytest.mark.parametrize("case", ["missing", "truncated", "global"])
def test_bad_input_two_file_commands(tmp_path, case):
    path, fragment = _bad_inputs(tmp_path)[case]
    good = str(sample_path("cuda_graph"))
    for args in (
        ["diff", good, str(path)],
        ["diff", str(path), good],
        ["export", str(path), "-o", str(tmp_path / "x")],
        ["check", good, "--baseline", str(path)],
    ):
        r = runner.invoke(app, args)
        assert r.exit_code == EXIT_BAD_INPUT, (args, r.output)
        assert r.stderr.count("\n") == 1 and fragment in r.stderr and "Traceback" not in r.output
