"""Time and peak memory of snaplab against bare ``pickle.load`` and torch's own tool, in one run.

For each size N it writes a realistic snapshot (benchmarks/gen_snapshot.py), then runs, each in
a fresh process (so peak RSS is that command's alone):

- ``pickle.load`` of the file, bare (the floor: any tool must at least unpickle it);
- ``snaplab stats --json`` and ``snaplab report`` (whole commands, imports included);
- ``python -m torch.cuda._memory_viz stats`` and ``trace_plot`` when a Python with torch is
  given (``--torch-python``), the tools users compare snaplab with.

and prints each as wall seconds, peak RSS and CPU seconds (user + system), with their ratios to
``pickle.load``.

    python benchmarks/bench.py --sizes 100000 1000000 --torch-python .bench/torchvenv/bin/python
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gen_snapshot  # noqa: E402

sys.path.insert(0, str(ROOT))
from snapshot_lab import _compiled  # noqa: E402

PURE_PYTHON = {_compiled.PURE_PYTHON_VARIABLE: "1"}


def run_timed(
    cmd: list[str], stdout: Path | None = None, env: dict[str, str] | None = None
) -> tuple[float, float, int, float]:
    """(wall seconds, peak RSS in MiB, exit code, CPU seconds) of one command in a fresh process;
    the peak and the CPU time (user + system) come from GNU time (/usr/bin/time), NaN without
    it. On a machine shared with other work the CPU time is the steadier of the two."""
    gnu_time = Path("/usr/bin/time")
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        prefix = [str(gnu_time), "-f", "%M %U %S", "-o", rss.name] if gnu_time.exists() else []
        t0 = time.perf_counter()
        with open(stdout or os.devnull, "wb") as out:
            proc = subprocess.run(
                [*prefix, *cmd], stdout=out, stderr=subprocess.PIPE, check=False, env={**os.environ, **(env or {})}
            )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr.decode(errors="replace")[-2000:])
        text = Path(rss.name).read_text().strip().splitlines()
        fields = text[-1].split() if text else []
        if len(fields) == 3:
            peak, cpu = int(fields[0]) / 1024, float(fields[1]) + float(fields[2])
        else:
            peak = cpu = float("nan")
    return wall, peak, proc.returncode, cpu


REPLAY_CODE = """
import sys, time
from snapshot_lab import load_frames
from snapshot_lab.metrics.allocator.model import recorded_settings
from snapshot_lab.metrics.allocator.whatif import _program, _replay
from snapshot_lab.metrics.fit.model import step_evidence
from snapshot_lab.metrics.fit.result import requested_tape
from snapshot_lab.metrics.fit.tape import ordered_ops, simulate
from snapshot_lab.metrics.plan.planner import _device
fr = load_frames(sys.argv[1]); s = recorded_settings(fr.info.allocator_settings)
p = _program(fr, 0)
t, c = time.perf_counter(), time.process_time(); _replay(p, s, None)
print(len(p.kind) / (time.perf_counter() - t), len(p.kind) / (time.process_time() - c))
tape = requested_tape(step_evidence(fr, _device(fr), None), False, False)
c = time.process_time(); simulate(tape, 1.0, s)
print(len(ordered_ops(tape)[0]) / (time.process_time() - c))
"""


def replay_rates(snap: Path) -> tuple[float, float, float]:
    """Events per second of one what-if replay (the recorded settings; wall-clock, then CPU
    time), and operations per second of one ``fit`` replay of the whole step (CPU time: the
    report runs about nine), in a fresh process."""
    out = subprocess.run([sys.executable, "-c", REPLAY_CODE, str(snap)], capture_output=True, text=True, check=True)
    wall, cpu, fit = (float(v) for v in out.stdout.split())
    return wall, cpu, fit


Timing = tuple[float, float, int, float]  # wall seconds, peak MiB, exit code, CPU seconds


def faster_baseline(first: Timing, again: Timing) -> Timing:
    """The baseline of two runs of ``pickle.load``: the shorter wall time and the shorter CPU time
    (each can only make snaplab's ratios look worse, never better), the first run's peak."""
    return (min(first[0], again[0]), first[1], first[2], min(first[3], again[3]))


def print_table(n: int, size_mb: float, base: Timing, cases: dict[str, Timing]) -> None:
    print(f"\nN = {n:,} trace entries, {size_mb:.1f} MiB pickle")
    print(
        f"  {'command':28s} {'seconds':>8s} {'peak MiB':>9s} {'time ×load':>11s} {'RSS ×load':>10s}"
        f" {'CPU s':>7s} {'CPU ×load':>10s}"
    )
    print(f"  {'bare pickle.load':28s} {base[0]:8.2f} {base[1]:9.0f} {1:11.2f} {1:10.2f} {base[3]:7.2f} {1:10.2f}")
    for name, (t, m, rc, cpu) in cases.items():
        flag = "" if rc == 0 else f"  (exit {rc})"
        print(
            f"  {name:28s} {t:8.2f} {m:9.0f} {t / base[0]:11.2f} {m / base[1]:10.2f}"
            f" {cpu:7.2f} {cpu / base[3]:10.2f}{flag}"
        )


def compile_package() -> None:
    """Write snaplab's bytecode before anything is timed. An installed package has it; a checkout
    run with ``PYTHONDONTWRITEBYTECODE=1`` (as on the development VM) would otherwise compile its
    ~200 modules in every timed command (0.2 to 0.3 s of CPU)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "snapshot_lab")], check=True)


def snapshot_file(workdir: Path, n: int) -> Path:
    """The benchmark's snapshot of ``n`` entries, written unless it is there already."""
    snap = workdir / f"bench_{n}.pickle"
    if not snap.exists():
        partial = snap.with_suffix(".partial")
        with partial.open("wb") as f:  # written as it is generated, in bounded memory
            gen_snapshot.write_snapshot(n, f)
        partial.rename(snap)
    return snap


def bench_size(a: argparse.Namespace, n: int) -> None:
    """Every command on one snapshot of ``n`` entries, and the table of their ratios."""
    py = sys.executable
    snaplab = [py, "-m", "snapshot_lab"]
    snap = snapshot_file(a.workdir, n)
    size_mb = snap.stat().st_size / 2**20
    load_cmd = [py, "-c", f"import pickle; pickle.load(open({str(snap)!r}, 'rb'))"]
    base = run_timed(load_cmd)
    stats_cmd = [*snaplab, "stats", "--json", "-q", str(snap)]
    cases = {"snaplab stats --json": run_timed(stats_cmd)}
    if a.pure_python:
        cases["snaplab stats, pure Python"] = run_timed(stats_cmd, env=PURE_PYTHON)
    if not a.stats_only:
        report = a.workdir / f"bench_{n}.html"
        report_cmd = [*snaplab, "report", "-q", str(snap), "-o", str(report)]
        cases["snaplab report"] = run_timed(report_cmd)
        if a.pure_python:
            cases["snaplab report, pure Python"] = run_timed(report_cmd, env=PURE_PYTHON)
        viz = a.workdir / f"bench_{n}_viz.html"
        if a.torch_python:
            viz_module = [a.torch_python, "-m", "torch.cuda._memory_viz"]
            cases["_memory_viz stats"] = run_timed([*viz_module, "stats", str(snap)])
            cases["_memory_viz trace_plot"] = run_timed([*viz_module, "trace_plot", str(snap), "-o", str(viz)])
    if a.memory_viz_script:  # torch's file run on its own: no `import torch` (its stats needs none)
        cases["_memory_viz.py stats (file)"] = run_timed([py, str(a.memory_viz_script), "stats", str(snap)])
    # the baseline again, now that the file is surely in the page cache
    base = faster_baseline(base, run_timed(load_cmd))
    print_table(n, size_mb, base, cases)
    if not a.stats_only:
        wall, cpu, fit = replay_rates(snap)
        print(
            f"  allocator what-if replay (one scenario, one core): {wall / 1e3:,.0f}k events/s"
            f" ({cpu / 1e3:,.0f}k per CPU second); fit step replay: {fit / 1e3:,.0f}k operations per CPU second"
        )
        report_mb = report.stat().st_size / 2**20 if report.exists() else float("nan")
        print(f"  snaplab report size: {report_mb:.2f} MiB", end="")
        if a.torch_python:
            viz_mb = viz.stat().st_size / 2**20 if viz.exists() else float("nan")
            print(f"; trace_plot HTML size: {viz_mb:.1f} MiB (and it needs the network to show anything)")
        else:
            print()
    if not a.keep:
        snap.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--torch-python", help="a python that has torch, for torch.cuda._memory_viz")
    ap.add_argument(
        "--memory-viz-script",
        type=Path,
        help="torch's torch/cuda/_memory_viz.py, run as a file by this Python for its `stats` (where no torch is"
        " installed: it does not import torch, which makes it faster than `python -m torch.cuda._memory_viz`)",
    )
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    ap.add_argument("--keep", action="store_true", help="keep the generated snapshots")
    ap.add_argument("--stats-only", action="store_true", help="time only pickle.load and snaplab stats")
    ap.add_argument(
        "--pure-python", action="store_true", help="also time each snaplab command without its C extensions"
    )
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    compile_package()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}; snaplab: {_compiled.describe()}"
    )
    for n in a.sizes:
        bench_size(a, n)


if __name__ == "__main__":
    main()
