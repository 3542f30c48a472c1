"""Where a snaplab command's time and peak memory go, phase by phase, in one process.

Runs ``snaplab <args>`` in this process with a progress sink that, at every stage the command
announces (reading, building frames, statistics, analysing, plotting, rendering), writes the
wall time, the resident set (VmRSS) and the peak so far (VmHWM, from /proc/self/status) to
stderr; a phase that raises the peak is the one to look at. Linux only.

    python benchmarks/rss_phases.py report /tmp/snap_1m.pickle -o /tmp/r.html
    python benchmarks/rss_phases.py stats --json /tmp/snap_1m.pickle
    python benchmarks/rss_phases.py --watch snapshot_lab.metrics.stats.summary:compute_fragmentation \
        stats --json /tmp/snap_1m.pickle

With ``--watch module:function`` (repeatable), each call of that function logs the peak it
reached above where it started (VmHWM is reset around it, so the phases' peaks then count only
since the last watched call; the overall peak is printed at the end).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

T0 = time.perf_counter()


def memory_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def log(what: str) -> None:
    rss, hwm = memory_mib()
    sys.stderr.write(f"{time.perf_counter() - T0:7.2f} s  rss {rss:7.0f} MiB  peak {hwm:7.0f} MiB  {what}\n")


class PhaseSink:
    """A progress sink that logs each stage as it starts."""

    def stage(self, description: str, total: float | None = None) -> None:
        log(f"start: {description}")

    def update(self, completed: float) -> None:
        pass


@contextmanager
def phase_bar(quiet: bool = False) -> Iterator[PhaseSink]:
    yield PhaseSink()
    log("end of command")


def reset_peak() -> None:
    """Start VmHWM again from the current resident set (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def watch(spec: str) -> None:
    """Wrap ``module:function`` so that each call logs the peak it reached above the resident
    set it started from (the peak is reset before the call and put back after)."""
    import functools
    import importlib

    module_name, name = spec.split(":")
    module = importlib.import_module(module_name)
    inner = getattr(module, name)

    @functools.wraps(inner)
    def wrapper(*args: object, **kwargs: object) -> object:
        rss0, hwm0 = memory_mib()
        reset_peak()
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            rss1, hwm1 = memory_mib()
            sys.stderr.write(
                f"          {spec}: {time.perf_counter() - t0:6.2f} s, peak +{hwm1 - rss0:6.0f} MiB above its start,"
                f" rss {rss0:6.0f} -> {rss1:6.0f} MiB\n"
            )
            WATCH_PEAK[0] = max(WATCH_PEAK[0], hwm0, hwm1)

    setattr(module, name, wrapper)


WATCH_PEAK = [0.0]


def main() -> None:
    log("start")
    args = sys.argv[1:]
    while args and args[0] == "--watch":
        watch(args[1])
        args = args[2:]
    import snapshot_lab.progress as progress_module

    progress_module.progress_bar = phase_bar  # type: ignore[assignment]
    from snapshot_lab import cli

    cli.progress_bar = phase_bar  # type: ignore[attr-defined]
    log("imported")
    try:
        cli.app(args, standalone_mode=False)
    finally:
        log("exit")
        if WATCH_PEAK[0]:
            sys.stderr.write(
                f"peak over the whole run (with watched calls): {max(WATCH_PEAK[0], memory_mib()[1]):.0f} MiB\n"
            )


if __name__ == "__main__":
    main()
