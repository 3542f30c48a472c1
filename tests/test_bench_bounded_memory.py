"""benchmarks/bounded_memory.py fails (exit 1) exactly when the peak is over the bound (#40)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bounded_memory.py"

pytestmark = pytest.mark.skipif(
    not Path("/usr/bin/time").exists() or not Path("/proc/self/smaps_rollup").exists(),
    reason="needs Linux and GNU time",
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False)


def test_under_and_over_the_bound(tmp_path: Path) -> None:
    common = ["--entries", "2000", "--command", "stats", "--workdir", str(tmp_path), "--keep"]
    ok = _run(*common, "--max-rss-mib", "100000")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok: under the bound" in ok.stdout
    assert (tmp_path / "bench_2000.pickle").exists()  # generated once, then reused
    over = _run(*common, "--max-rss-mib", "1")
    assert over.returncode == 1, over.stdout + over.stderr
    assert "FAIL" in over.stdout and "over the bound of 1 MiB" in over.stdout
    tree = _run(*common, "--max-rss-mib", "1", "--measure", "tree")
    assert tree.returncode == 1, tree.stdout + tree.stderr


def test_a_failing_command_is_not_a_pass(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pickle"
    garbage.write_bytes(b"not a pickle")
    out = _run("--entries", "0", "--snapshot", str(garbage), "--max-rss-mib", "100000")
    assert out.returncode == 2, out.stdout + out.stderr
