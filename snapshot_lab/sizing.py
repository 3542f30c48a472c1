"""Whether a snapshot file may need more memory than the machine has, and the window that fits.

Read before the file is: its trace's length is not known yet, so it is bounded from the size of
the pickle it holds (:func:`~snapshot_lab.load.pickle_size`; a trace entry takes at least
``MIN_PICKLE_BYTES_PER_ENTRY`` of an uncompressed pickle at scale; torch's files take 60 to 160),
which errs towards saying it. The costs per entry are the ones ``benchmarks/RESULTS.md`` measured
with the C extensions (all of a command's processes together, at 1M to 50M entries). Nothing
here reads the file: a note is only ever a warning, the command runs as asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIN_PICKLE_BYTES_PER_ENTRY = 64
FIXED_BYTES = 400 << 20  # the interpreter, numpy, pandas, matplotlib's worker, the report's page
# ranks: each worker summarises one file as findings reads it; fit and plan: their largest
# process (fit with its levers searched under a limit; plan's table with its pipeline of 16
# microbatches: 440 bytes an entry at 5M), the others spread where the memory allows
# (aside.spread); diff and check read one file at a time, export writes the frames as they are
# (60 bytes an entry or less at 5M, 100 with margin)
BYTES_PER_ENTRY = {
    "report": 220,
    "stats": 140,
    "findings": 150,
    "leaks": 150,
    "ranks": 150,
    "whatif": 200,
    "fit": 540,
    "plan": 500,
    "diff": 100,
    "check": 100,
    "export": 100,
}
HEADROOM = 0.8  # of the memory available, what a window is chosen to fill
SMALLEST_WINDOW = 10_000

_NEED = (
    "{name} ({size}) may hold up to {entries:,} trace entries, which `{command}` can need up to {need} "
    "of memory for; this machine has {available} available"
)
NOTE = _NEED + (
    ". If it runs out, `--max-entries {window:,}` reads each device's last {window:,} entries in about {window_need}."
)
NOTE_NO_WINDOW = _NEED + ", too little for any window of the trace."
RANKS_NOTE = (
    "{files} of the files ({size} together) may hold up to {entries:,} trace entries; `ranks` with {jobs} workers, "
    "each reading one file at a time, can need up to {need} of memory for the largest {jobs} at once; this machine "
    "has {available} available. If it runs out, {remedy}."
)
RANKS_FEWER = "`--jobs {fewer}` keeps {fewer} files in memory at once"
RANKS_WINDOW = "`--max-entries {window:,}` reads each file's last {window:,} entries per device"
RANKS_ELSEWHERE = "read the files on a bigger machine (`--scheduler`)"


@dataclass(frozen=True)
class MemoryNeed:
    """What a command may need for a file, against what the machine has."""

    entries: int  # at most this many trace entries
    need: int  # bytes a command may need for them
    available: int  # bytes the machine has available now
    window: int | None  # the --max-entries that fits the available memory (None: none does)
    window_need: int  # bytes the command needs with that window


def entries_at_most(data_bytes: int) -> int:
    """The most trace entries an uncompressed pickle of ``data_bytes`` may hold."""
    return data_bytes // MIN_PICKLE_BYTES_PER_ENTRY


def needed(command: str, entries: int) -> int:
    """The bytes ``command`` needs (all its processes) for a trace of ``entries`` entries."""
    return FIXED_BYTES + BYTES_PER_ENTRY[command] * entries


def window_that_fits(command: str, available: int) -> int | None:
    """The largest window (entries per device) whose need fills ``HEADROOM`` of ``available``
    (a window's need does not grow with the file), rounded down to a million (a thousand below
    that); None when not even a small one fits."""
    entries = (int(available * HEADROOM) - FIXED_BYTES) // BYTES_PER_ENTRY[command]
    step = 1_000_000 if entries >= 1_000_000 else 1_000
    entries -= entries % step
    return entries if entries >= SMALLEST_WINDOW else None


def memory_need(command: str, data_bytes: int, available: int) -> MemoryNeed | None:
    """The need of ``command`` for an uncompressed pickle of ``data_bytes`` where ``available``
    bytes are available, when it may be more than that; None when it fits."""
    entries = entries_at_most(data_bytes)
    need = needed(command, entries)
    if need <= available:
        return None
    window = window_that_fits(command, available)
    return MemoryNeed(entries, need, available, window, needed(command, window) if window else 0)


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` in bytes (Linux), or None where the system does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class RanksNeed:
    """What ``ranks``' workers may need at once, against what the machine has."""

    need: int  # bytes the workers may need together (the largest files at once)
    available: int
    fewer: int | None  # the --jobs whose largest files fit (None: not even one alone)
    window: int | None  # the --max-entries that fits every worker (None: none does)


def ranks_need(data_bytes: list[int], jobs: int, available: int) -> RanksNeed | None:
    """The need of ``jobs`` workers, each reading one of the uncompressed pickles of
    ``data_bytes`` at a time (the largest ones at once, at worst), when it may be more than
    ``available``; None when it fits."""
    needs = sorted((needed("ranks", entries_at_most(size)) for size in data_bytes), reverse=True)
    need = sum(needs[:jobs])
    if need <= available:
        return None
    fits = [k for k in range(1, jobs) if sum(needs[:k]) <= available * HEADROOM]
    return RanksNeed(need, available, max(fits) if fits else None, window_that_fits("ranks", available // jobs))
