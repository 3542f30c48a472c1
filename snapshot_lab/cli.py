"""The ``snaplab`` command: a thin typer shell over :mod:`snapshot_lab.api`.

Every command funnels errors through :func:`_run`: a :class:`SnaplabError` becomes one line on
stderr and its exit code; anything else is a bug, reported as one line (exit 70) unless
``--debug`` asks for the traceback.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from . import __version__, api
from .errors import EXIT_INTERNAL, SnaplabError
from .progress import progress_bar

app = typer.Typer(
    name="snaplab",
    help="Answers from PyTorch CUDA memory snapshots: where the memory went, why it ran out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

T = TypeVar("T")

SnapshotArg = Annotated[
    Path,
    typer.Argument(
        help="Snapshot file from torch.cuda.memory._dump_snapshot (pickle or JSON; gzip/xz/zstd/bz2 ok).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar on stderr.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the Python traceback of an error.")]


def _run(fn: Callable[[], T], debug: bool) -> T:
    debug = debug or bool(os.environ.get("SNAPLAB_DEBUG"))
    try:
        return fn()
    except SnaplabError as exc:
        if debug:
            raise
        typer.echo(f"snaplab: error: {exc.message()}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        typer.echo("snaplab: interrupted", err=True)
        raise typer.Exit(130) from None
    except Exception as exc:
        if debug:
            raise
        typer.echo(
            f"snaplab: internal error: {type(exc).__name__}: {str(exc)[:200]} "
            "(a bug; rerun with --debug and report it)",
            err=True,
        )
        raise typer.Exit(EXIT_INTERNAL) from None


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"snaplab {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """snaplab reads snapshots offline: no GPU and no torch needed."""


@app.command()
def stats(snapshot: SnapshotArg, json_out: JsonOpt = False, quiet: QuietOpt = False, debug: DebugOpt = False) -> None:
    """Torch's memory counters (exactly as torch.cuda.memory_stats() had them), fragmentation and OOM cause."""

    def work() -> None:
        with progress_bar(quiet) as progress:
            result = api.stats(snapshot, progress=progress)
        if json_out:
            _print_json(result.to_dict())
        else:
            from .render.text import format_stats

            sys.stdout.write(format_stats(result))

    _run(work, debug)


@app.command()
def leaks(snapshot: SnapshotArg, json_out: JsonOpt = False, quiet: QuietOpt = False, debug: DebugOpt = False) -> None:
    """Leak suspects: allocation sites whose live memory grows with every iteration."""

    def work() -> None:
        with progress_bar(quiet) as progress:
            result = api.leaks(snapshot, progress=progress)
        suspects = [s.to_dict() for la in result.values() for s in la.suspects]
        if json_out:
            _print_json(
                {
                    "suspects": suspects,
                    "growth_bytes_per_iteration": sum(la.growth_bytes_per_iteration for la in result.values()),
                    "devices": {str(d): la.to_dict() for d, la in result.items()},
                }
            )
        else:
            from .render.text import format_leaks

            sys.stdout.write(format_leaks(result))

    _run(work, debug)


@app.command()
def findings(
    snapshot: SnapshotArg, json_out: JsonOpt = False, quiet: QuietOpt = False, debug: DebugOpt = False
) -> None:
    """Findings with evidence and advice: OOM cause, fragmentation, leaks, DDP, churn, imbalance."""

    def work() -> None:
        with progress_bar(quiet) as progress:
            result = api.findings(snapshot, progress=progress)
        if json_out:
            _print_json({"findings": [f.to_dict() for f in result]})
        else:
            from .render.text import format_findings

            sys.stdout.write(format_findings(result))

    _run(work, debug)


@app.command()
def report(
    snapshot: SnapshotArg,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="HTML file to write [default: reports/<snapshot name>.html]."),
    ] = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write one self-contained HTML report (plots, OOM cause, top allocation sites, findings)."""

    def work() -> None:
        with progress_bar(quiet) as progress:
            path = api.report(snapshot, output=output, progress=progress)
        typer.echo(str(path))

    _run(work, debug)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
