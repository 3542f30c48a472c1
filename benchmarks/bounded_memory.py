"""Fail when ``snaplab report`` (or another command) of an N-entry snapshot needs more memory than a bound.

Writes (or reuses) a snapshot of N trace entries (benchmarks/gen_snapshot.py, in a child process
so that the generator's memory is not this script's), runs the command on it in a fresh process
and measures two peaks:

- the largest peak RSS of one process of the command (GNU time's ``%M``: the command, or one of
  the children it forks to draw figures and compute fit answers beside it, whichever is largest);
- the peak of the whole process tree's proportional set size (PSS: pages shared between a parent
  and its forked children are counted once), sampled every ``--interval`` seconds from
  ``/proc/<pid>/smaps_rollup``: the memory the machine had to have.

It exits with 1 when the peak the bound applies to (``--measure``, the single process' peak by
default) is above ``--max-rss-mib``, 2 when the command itself failed, 0 otherwise. Linux only.

    python benchmarks/bounded_memory.py --entries 10000000 --max-rss-mib 3072
    python benchmarks/bounded_memory.py --entries 50000000 --max-rss-mib 3072 --workdir /big/disk --keep
    python benchmarks/bounded_memory.py --entries 50000000 --max-rss-mib 3072 --max-entries 10000000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the commands other than report, each with --json and these options (fit: its levers searched
# under a limit, as for a recording that ran out of memory; plan: its table of strategies)
COMMANDS = {
    "stats": [],
    "findings": [],
    "leaks": [],
    "whatif": [],
    "fit": ["--memory-limit", "40GiB"],
    "plan": ["--world-size", "4"],
    "check": ["--allow-oom"],
}


def command_args(command: str, snap: Path, tmp: Path) -> list[str]:
    """The snaplab command line that measures ``command`` on ``snap`` (files it writes go to ``tmp``)."""
    if command == "report":
        return ["report", "-q", str(snap), "-o", str(tmp / "report.html")]
    if command == "export":  # the frames as parquet tables
        return ["export", "-q", str(snap), "-o", str(tmp / "tables")]
    if command == "diff":  # the file against itself: each read in turn
        return ["diff", "--json", "-q", str(snap), str(snap)]
    return [command, "--json", "-q", str(snap), *COMMANDS[command]]


def snapshot_file(workdir: Path, entries: int) -> Path:
    """``workdir/bench_<entries>.pickle`` (the name benchmarks/bench.py uses), written by
    benchmarks/gen_snapshot.py in a child process unless it is there already."""
    path = workdir / f"bench_{entries}.pickle"
    if not path.exists():
        partial = path.with_suffix(".partial")
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "gen_snapshot.py"), str(entries), str(partial)], check=True
        )
        partial.rename(path)
    return path


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeSampler:
    """The peak of the summed PSS of a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, interval: float) -> None:
        self.pid, self.interval = pid, interval
        self.peak_kib = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak_kib = max(self.peak_kib, sum(_pss_kib(p) for p in _tree(self.pid)))
            self._done.wait(self.interval)

    def stop(self) -> float:
        """The peak in MiB."""
        self._done.set()
        self._thread.join()
        return self.peak_kib / 1024


def measure(command: list[str], interval: float) -> tuple[int, float, float, float]:
    """``(exit code, wall seconds, largest one-process peak RSS MiB, peak tree PSS MiB)`` of one
    command in a fresh process, under GNU time."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            ["/usr/bin/time", "-f", "%M", "-o", out.name, *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        sampler = TreeSampler(proc.pid, interval)
        _, err = proc.communicate()
        tree = sampler.stop()
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.stderr.write(err.decode(errors="replace")[-2000:])
        lines = Path(out.name).read_text().split()
        peak = int(lines[-1]) / 1024 if lines and lines[-1].isdigit() else float("nan")
    return proc.returncode, wall, peak, tree


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, required=True, help="trace entries of the snapshot")
    ap.add_argument("--max-rss-mib", type=float, required=True, help="the bound, in MiB")
    ap.add_argument("--command", choices=("report", "export", "diff", *COMMANDS), default="report")
    ap.add_argument(
        "--measure",
        choices=("process", "tree"),
        default="process",
        help="the bound applies to the largest one-process peak RSS (default) or the tree's peak PSS",
    )
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench", help="where the snapshot is written or found")
    ap.add_argument("--snapshot", type=Path, help="measure this file instead of a generated one")
    ap.add_argument("--keep", action="store_true", help="keep a generated snapshot")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between two samples of the tree")
    ap.add_argument("--max-entries", type=int, help="the command's --max-entries: read each trace's last N entries")
    a = ap.parse_args()
    if not Path("/usr/bin/time").exists() or not Path("/proc/self/smaps_rollup").exists():
        sys.exit("needs Linux and GNU time (/usr/bin/time)")
    generated = a.snapshot is None
    if generated:
        a.workdir.mkdir(parents=True, exist_ok=True)
    snap = a.snapshot or snapshot_file(a.workdir, a.entries)
    size = snap.stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        args = command_args(a.command, snap, Path(tmp))
        if a.max_entries is not None:
            args += ["--max-entries", str(a.max_entries)]
        code, wall, peak, tree = measure([sys.executable, "-m", "snapshot_lab", *args], a.interval)
    if generated and not a.keep:
        snap.unlink()
    print(
        f"snaplab {a.command} of {a.entries:,} entries"
        + f" ({size / 2**20:,.0f} MiB)"
        + ("" if a.max_entries is None else f", the last {a.max_entries:,} of each trace read (--max-entries)")
        + f": {wall:.1f} s, peak RSS {peak:,.0f} MiB (largest process), {tree:,.0f} MiB PSS (whole tree),"
        f" bound {a.max_rss_mib:,.0f} MiB on the {'largest process' if a.measure == 'process' else 'tree'}"
    )
    if code != 0:
        print(f"FAIL: the command exited with {code}")
        return 2
    measured = peak if a.measure == "process" else tree
    if not measured <= a.max_rss_mib:
        print(f"FAIL: {measured:,.0f} MiB is over the bound of {a.max_rss_mib:,.0f} MiB")
        return 1
    print("ok: under the bound")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
