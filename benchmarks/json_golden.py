"""Every analysis command's ``--json`` output over every sample snapshot, written into one folder.

A refactor must leave these bytes unchanged: generate the folder before the change, again after,
and compare the two with ``diff -r``::

    python benchmarks/json_golden.py /tmp/golden_before          # on the untouched code
    python benchmarks/json_golden.py /tmp/golden_after           # after the change
    diff -r /tmp/golden_before /tmp/golden_after

Per sample it runs ``stats``, ``findings``, ``leaks``, ``whatif`` and ``plan`` (the table of
usual strategies over 2 and over 4 GPUs, and a few named strategies with their options); per
pair of ranks (``*_rank0`` beside ``*_rank1``) ``findings`` over both files, ``ranks`` and
``diff``. Each run gives one file ``<sample>/<command>.json`` holding the exit code, stdout and
stderr. The commands run in-process through typer's test runner (the same code the console
script calls, without a fresh interpreter per run); ``--jobs`` spreads samples over processes.
:mod:`tests.test_golden` checks a few samples against copies kept in ``tests/golden/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_snapshots"

# (file name, arguments after the snapshot path); every run adds --json and --quiet
SINGLE_COMMANDS: list[tuple[str, list[str]]] = [
    ("stats", ["stats"]),
    ("findings", ["findings"]),
    ("leaks", ["leaks"]),
    ("whatif", ["whatif"]),
    ("whatif_expandable", ["whatif", "--set", "expandable_segments:True"]),
    ("plan_table_2", ["plan", "--world-size", "2"]),
    ("plan_table_4", ["plan", "--world-size", "4"]),
    ("plan_pp_gpipe_2", ["plan", "--world-size", "2", "--strategy", "pp", "--schedule", "gpipe"]),
    ("plan_pp_split_2", ["plan", "--world-size", "2", "--strategy", "pp", "--pp-split", "1,2"]),
    ("plan_pp_mb3_4", ["plan", "--world-size", "4", "--strategy", "pp", "--microbatches", "3"]),
    ("plan_tp_all_2", ["plan", "--world-size", "2", "--strategy", "tp", "--tp-layers", "all"]),
    ("plan_fsdp_tp_8", ["plan", "--world-size", "8", "--strategy", "fsdp+tp", "--tp", "4"]),
    ("plan_fsdp1_2", ["plan", "--world-size", "2", "--strategy", "fsdp1"]),
]

# commands over both ranks of a pair: (file name, command)
PAIR_COMMANDS: list[tuple[str, str]] = [
    ("findings", "findings"),
    ("ranks", "ranks"),
    ("diff", "diff"),
]


def sample_paths(pattern: str) -> list[Path]:
    """The sample snapshots matching ``pattern`` (a glob inside sample_snapshots), by name."""
    return sorted(path for path in SAMPLES.glob(pattern) if ".pickle" in path.name)


def sample_name(path: Path) -> str:
    """``ddp_bucketview_rank0.pickle.xz`` -> ``ddp_bucketview_rank0``."""
    return path.name.split(".pickle")[0]


def rank_pairs(paths: list[Path]) -> Iterator[tuple[str, Path, Path]]:
    """(pair name, rank 0, rank 1) for every ``*_rank0`` sample with a ``*_rank1`` beside it."""
    by_name = {sample_name(path): path for path in paths}
    for name, path in by_name.items():
        if name.endswith("_rank0") and name[: -len("0")] + "1" in by_name:
            yield name[: -len("_rank0")] + "_pair", path, by_name[name[: -len("0")] + "1"]


def run_command(arguments: list[str]) -> str:
    """One ``snaplab`` command run in-process: exit code, stdout and stderr as one JSON text."""
    from typer.testing import CliRunner

    from snapshot_lab.cli import app

    result = CliRunner().invoke(app, [*arguments, "--json", "--quiet"])
    record = {
        "arguments": arguments,
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
    }
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        record["exception"] = repr(result.exception)
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def relative(path: Path) -> str:
    """The path as the commands see it: relative to the repository, so outputs do not depend on
    where the checkout lives."""
    return str(path.relative_to(ROOT))


def single_jobs(path: Path, only: set[str] | None = None) -> list[tuple[Path, list[str]]]:
    """(output file relative to the folder, arguments) of every command over one sample (those
    labelled in ``only``, when given)."""
    name = sample_name(path)
    return [
        (Path(name) / f"{label}.json", [command, relative(path), *options])
        for label, (command, *options) in SINGLE_COMMANDS
        if only is None or label in only
    ]


def pair_jobs(
    name: str,
    first: Path,
    second: Path,
    only: set[str] | None = None,
) -> list[tuple[Path, list[str]]]:
    """(output file relative to the folder, arguments) of every command over one pair of ranks
    (those labelled in ``only``, when given)."""
    arguments = [relative(first), relative(second)]
    return [
        (Path(name) / f"{label}.json", [command, *arguments])
        for label, command in PAIR_COMMANDS
        if only is None or label in only
    ]


def run_jobs(out: Path, jobs: list[tuple[Path, list[str]]]) -> int:
    """Run ``jobs`` one after another, writing each output under ``out``; how many ran."""
    for target, arguments in jobs:
        (out / target).parent.mkdir(parents=True, exist_ok=True)
        (out / target).write_text(run_command(arguments))
    return len(jobs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="Folder to write the outputs into.")
    parser.add_argument(
        "--samples",
        default="*.pickle*",
        help="Comma-separated globs inside sample_snapshots/.",
    )
    parser.add_argument("--jobs", "-j", type=int, default=1, help="Worker processes.")
    parser.add_argument("--only", help="Comma-separated labels of the outputs to write.")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)  # the commands get paths relative to the checkout
    only = set(args.only.split(",")) if args.only else None
    paths = [path for pattern in args.samples.split(",") for path in sample_paths(pattern)]
    batches = [single_jobs(path, only) for path in paths]
    batches += [pair_jobs(*pair, only) for pair in rank_pairs(paths)]
    out.mkdir(parents=True, exist_ok=True)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            done = sum(pool.map(run_jobs, [out] * len(batches), batches))
    else:
        done = sum(run_jobs(out, batch) for batch in batches)
    print(f"{done} outputs of {len(paths)} samples in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
