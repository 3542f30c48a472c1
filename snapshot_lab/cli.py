"""The ``snaplab`` command: a thin typer shell over :mod:`snapshot_lab.api`.

Every command funnels errors through :func:`_run`: a :class:`SnaplabError` becomes one line on
stderr and its exit code (a :class:`ParameterError`, said in the API's words, names the
command's own flag instead: ``pp_split`` becomes ``--pp-split``); anything else is a bug,
reported as one line (exit 70) unless ``--debug`` asks for the traceback.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
import typer.main

from . import __version__, _compiled
from .capture import CAPTURE_DEFAULTS, DEFAULT_OUT_DIR
from .errors import EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_INTERNAL, ParameterError, SnaplabError
from .limits import DEFAULT_MAX_SLICES
from .progress import progress_bar

if TYPE_CHECKING:
    from . import api
else:

    class _Imported:
        """:mod:`.api`, imported the first time one of its names is read: it imports pandas and
        every analysis, which ``snaplab --help`` and a command's ``--help`` need none of."""

        def __getattr__(self, name: str) -> Any:
            return getattr(importlib.import_module("snapshot_lab.api"), name)

    api = _Imported()

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
# fit's inputs, which the report's answer takes too
FitMemoryLimitOpt = Annotated[
    str | None,
    typer.Option(
        "--memory-limit",
        help="Memory to fit in, e.g. 6GiB [default: the limit the recorded run ran out of, else the device's "
        "capacity].",
    ),
]
RecordedBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--recorded-batch",
        "--batch",
        help="The recorded batch in samples (answers in samples, not fractions) [default: the capture sidecar's].",
    ),
]


@functools.cache
def _flags() -> dict[str, str]:
    """Each command parameter as its user types it, from the typer options themselves: the
    option's long flag (``pp_split``: ``--pp-split``, ``settings``: ``--set``) or the argument's
    name (``TARGET``). A name means one flag in every command (tests/test_cli_errors.py)."""
    group = typer.main.get_command(app)
    flags = {}
    for command in group.commands.values():  # type: ignore[attr-defined]
        for param in command.params:
            if param.param_type_name == "option":
                flags[param.name] = next((opt for opt in param.opts if opt.startswith("--")), param.opts[0])
            else:
                flags[param.name] = param.metavar or param.name.upper()
    return flags


def _spell_as_flag(parameter: str, value: str | None) -> str:
    """A parameter as the command line writes it, followed by ``value`` when given."""
    name = _flags().get(parameter, parameter)
    return name if value is None else f"{name} {value}"


def _error_line(exc: SnaplabError) -> str:
    """The one line an error prints: in the command line's words."""
    return exc.spelled(_spell_as_flag) if isinstance(exc, ParameterError) else exc.message()


def _run(fn: Callable[[], T], debug: bool) -> T:
    debug = debug or bool(os.environ.get("SNAPLAB_DEBUG"))
    try:
        return fn()
    except typer.Exit:
        raise
    except SnaplabError as exc:
        if debug:
            raise
        typer.echo(f"snaplab: error: {_error_line(exc)}", err=True)
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


def _note_memory(command: str, max_entries: int | None, *snapshots: Path | None) -> None:
    """Say before reading when a file may need more memory than the machine has, for each
    distinct file the command reads one after the other (not when a window was asked for: that
    is the answer to it)."""
    if max_entries is None:
        for snapshot in dict.fromkeys(p for p in snapshots if p is not None):
            _note(api.memory_note(snapshot, command))


def _note(text: str | None) -> None:
    """Every note (something the user may want to know, not an error) is one line on stderr."""
    if text:
        typer.echo(f"snaplab: note: {text}", err=True)


def _wrote(path: Path | str) -> None:
    """Every command that writes a file confirms it the same way: one line on stderr (stdout
    keeps the tables and the JSON)."""
    typer.echo(f"wrote {path}", err=True)


def _print_json(obj: Any) -> None:
    sys.stdout.write(api.json_text(obj) + "\n")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"snaplab {__version__} ({_compiled.describe()})")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """snaplab reads snapshots offline: no GPU and no torch needed."""


# a window on a trace too large for the machine's memory (every command that reads a snapshot)
MaxEntriesOpt = Annotated[
    int | None,
    typer.Option(
        "--max-entries",
        min=1,
        help="Read only the last N entries of each device's trace, as if recorded with max_entries=N: a file "
        "too large for this machine's memory analysed from its end (the state at the dump is read whole; "
        "the output says how many entries were left out).",
        show_default=False,
    ),
]
StagesOpt = Annotated[
    bool, typer.Option("--stages", help="Also memory by the file's record_function ranges (peak, kept, by category).")
]
# your own categories, wherever categories are shown (stats, report, diff, export --format perfetto)
CategoryOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--category",
        metavar="NAME=KIND:PATTERN",
        help="Your own category, tried before the built-in ones: allocations with a stack frame that PATTERN "
        "matches (KIND file:GLOB on its path, func:GLOB on its function, frame:GLOB or re:REGEX on "
        "file:line:function); repeat it, the first rule that matches wins. A built-in name forces that category.",
        show_default=False,
    ),
]
CategoriesFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--categories-file",
        help='Rules of --category from a file: TOML (.toml) or JSON, NAME = "KIND:PATTERN" (or a list), '
        "tried in the file's order after the --category rules.",
        show_default=False,
    ),
]


@app.command()
def stats(
    snapshot: SnapshotArg,
    stages: StagesOpt = False,
    compiled_regions: Annotated[
        bool,
        typer.Option(
            "--compiled-regions",
            help="Also memory by torch.compile'd region (recorded with compile_context=True): allocated, peak.",
        ),
    ] = False,
    category: CategoryOpt = None,
    categories_file: CategoriesFileOpt = None,
    max_entries: MaxEntriesOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Torch's memory counters (exactly as torch.cuda.memory_stats() had them), fragmentation and OOM cause."""

    def work() -> None:
        _note_memory("stats", max_entries, snapshot)
        with progress_bar(quiet) as progress:
            result = api.stats(
                snapshot,
                stages=stages,
                compiled_regions=compiled_regions,
                category=category,
                categories_file=categories_file,
                progress=progress,
                max_entries=max_entries,
            )
        if json_out:
            _print_json(result.to_dict())
        else:
            from .render.text import format_stats

            sys.stdout.write(format_stats(result))

    _run(work, debug)


@app.command()
def leaks(
    snapshot: SnapshotArg,
    max_entries: MaxEntriesOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Leak suspects: allocation sites whose live memory grows with every iteration."""

    def work() -> None:
        _note_memory("leaks", max_entries, snapshot)
        with progress_bar(quiet) as progress:
            result = api.leaks(snapshot, progress=progress, max_entries=max_entries)
        if json_out:
            _print_json(result.to_dict())
        else:
            from .render.text import format_leaks

            sys.stdout.write(format_leaks(result))

    _run(work, debug)


@app.command()
def findings(
    snapshot: Annotated[
        list[Path],
        typer.Argument(
            help="Snapshot file(s). Several (the ranks of one job): each file's findings, plus those across"
            " the files (pipeline stages from the capture sidecars or 'pp1'/'stage1' in the names).",
            show_default=False,
        ),
    ],
    max_entries: MaxEntriesOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Findings with evidence and advice: OOM cause, fragmentation, leaks, DDP, churn, imbalance."""

    def work() -> None:
        paths = list(dict.fromkeys(snapshot))
        _note_memory("findings", max_entries, *paths)
        with progress_bar(quiet) as progress:
            if len(paths) == 1:  # one file: as it always was
                one = api.findings(paths[0], progress=progress, max_entries=max_entries)
            else:
                several = api.findings(paths, progress=progress, max_entries=max_entries)
        if len(paths) == 1:
            if json_out:
                _print_json(one.to_dict())
            else:
                from .render.text import format_findings

                sys.stdout.write(format_findings(one))
            return
        if json_out:
            _print_json(several.to_dict())
        elif several.files:
            from .render.text import format_fleet_findings

            sys.stdout.write(format_fleet_findings(several))
        for e in several.errors.values():
            typer.echo(f"snaplab: error: {e}", err=True)
        if several.errors:
            raise typer.Exit(EXIT_BAD_INPUT)

    _run(work, debug)


@app.command()
def diff(
    before: Annotated[Path, typer.Argument(help="The earlier snapshot (baseline).", show_default=False)],
    after: Annotated[Path, typer.Argument(help="The later snapshot.", show_default=False)],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Also write the diff as HTML.")] = None,
    stages: StagesOpt = False,
    category: CategoryOpt = None,
    categories_file: CategoriesFileOpt = None,
    max_entries: MaxEntriesOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """What changed between two snapshots of one job: totals, categories, allocation sites."""

    def work() -> None:
        _note_memory("diff", max_entries, before, after)
        with progress_bar(quiet) as progress:
            result = api.diff(
                before,
                after,
                output=output,
                stages=stages,
                category=category,
                categories_file=categories_file,
                progress=progress,
                max_entries=max_entries,
            )
        if json_out:
            _print_json(result.to_dict())
        else:
            from .render.compare import format_diff

            sys.stdout.write(format_diff(result))
            if result.stages is not None:
                from .render.stages import format_stages_diff

                sys.stdout.write("\n" + format_stages_diff(result.stages))
        if output is not None:
            _wrote(output)

    _run(work, debug)


@app.command()
def ranks(
    snapshots: Annotated[
        list[Path],
        typer.Argument(
            help="Snapshots of the ranks (rank read from 'rank<N>' in the name; files that share a number"
            " or have none are labelled by host or file name)."
        ),
    ],
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", help="Parallel worker processes [default: CPUs].")] = None,
    scheduler: Annotated[
        str | None,
        typer.Option(help="Parse on a Dask cluster: its scheduler address (tcp://host:8786), or 'local'."),
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Also write the table as HTML.")] = None,
    max_entries: MaxEntriesOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """One row per rank: peak, reserved, allocated, fragmentation, OOM; outliers flagged within their pipeline stage."""

    def work() -> None:
        _note(None if max_entries is not None or scheduler is not None else api.ranks_memory_note(snapshots, jobs))
        with progress_bar(quiet) as progress:
            result = api.ranks(
                list(snapshots),
                jobs=jobs,
                scheduler=scheduler,
                output=output,
                progress=progress,
                max_entries=max_entries,
            )
        rows, errors = result
        if json_out and rows:
            _print_json(result.to_dict())
        elif rows:
            from .render.compare import format_ranks

            sys.stdout.write(format_ranks(rows, *result.pipeline()))
        from .render.compare import rank_notice

        if output is not None and not errors:
            _wrote(output)
        _note(rank_notice(rows))
        for e in errors.values():
            typer.echo(f"snaplab: error: {e}", err=True)
        if errors:
            raise typer.Exit(EXIT_BAD_INPUT)

    _run(work, debug)


@app.command()
def check(
    snapshot: SnapshotArg,
    max_reserved: Annotated[str | None, typer.Option(help="Largest allowed reserved memory, e.g. 40GiB.")] = None,
    max_allocated: Annotated[str | None, typer.Option(help="Largest allowed allocated memory.")] = None,
    max_peak: Annotated[str | None, typer.Option(help="Largest allowed peak requested (from the trace).")] = None,
    max_fragmentation: Annotated[
        float | None, typer.Option(help="Largest allowed external fragmentation (0..1).")
    ] = None,
    no_oom: Annotated[
        bool,
        typer.Option(
            "--no-oom/--allow-oom", help="Fail if the trace holds an OOM (the default; --allow-oom to pass one)."
        ),
    ] = True,
    no_leaks: Annotated[bool, typer.Option("--no-leaks", help="Fail if memory leaks across iterations.")] = False,
    baseline: Annotated[Path | None, typer.Option(help="Snapshot to compare against.")] = None,
    max_growth: Annotated[str | None, typer.Option(help="Largest allowed growth over --baseline, e.g. 5%.")] = None,
    max_entries: MaxEntriesOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """CI gate: exit 0 when every limit holds, 1 with one line per violated limit otherwise."""

    def work() -> None:
        _note_memory("check", max_entries, snapshot, baseline)
        with progress_bar(quiet) as progress:
            violations = api.check(
                snapshot,
                max_reserved=max_reserved,
                max_allocated=max_allocated,
                max_peak=max_peak,
                max_fragmentation=max_fragmentation,
                no_oom=no_oom,
                no_leaks=no_leaks,
                baseline=baseline,
                max_growth=max_growth,
                progress=progress,
                max_entries=max_entries,
            )
        if json_out:
            _print_json(violations.to_dict())
        else:
            for v in violations:
                typer.echo(f"FAIL {v.limit}: {v.message}")
            if not violations:
                typer.echo("ok: all limits hold" + ("" if no_oom else " (an OOM allowed: --allow-oom)"))
        if violations:
            raise typer.Exit(EXIT_GATE_FAILED)

    _run(work, debug)


@app.command()
def export(
    snapshot: SnapshotArg,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Folder to write the tables into; with --format perfetto, the JSON file to write "
            "(default: reports/<snapshot name>.perfetto.json).",
            show_default=False,
        ),
    ] = None,
    format: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            help="parquet, csv or json (JSON lines): the frames; perfetto: memory over time as a Chrome trace "
            "(Perfetto, chrome://tracing): counters of allocated, reserved, requested and per category, a slice "
            "per allocation with its stack.",
        ),
    ] = "parquet",
    max_slices: Annotated[
        int,
        typer.Option(
            help="perfetto: allocation slices per device at most (those alive at the peak first, then the largest)."
        ),
    ] = DEFAULT_MAX_SLICES,
    category: CategoryOpt = None,
    categories_file: CategoriesFileOpt = None,
    max_entries: MaxEntriesOpt = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write the frames (segments, blocks, events, stacks...) for pandas, DuckDB or Polars, or memory over time as
    a trace for Perfetto."""

    def work() -> None:
        _note_memory("export", max_entries, snapshot)
        with progress_bar(quiet) as progress:
            written = api.export(
                snapshot,
                output=output,
                format=format,
                max_slices=max_slices,
                category=category,
                categories_file=categories_file,
                progress=progress,
                max_entries=max_entries,
            )
        for p in written:
            typer.echo(str(p))

    _run(work, debug)


@app.command()
def whatif(
    snapshot: SnapshotArg,
    settings: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="KEY:VALUE as in PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True, max_split_size_mb:128, "
            "roundup_power2_divisions:4, garbage_collection_threshold:0.8); repeat for one combined scenario.",
        ),
    ] = None,
    defaults: Annotated[
        bool, typer.Option("--defaults", help="Apply --set to PyTorch's defaults, not to the recorded settings.")
    ] = False,
    memory_limit: Annotated[
        str | None,
        typer.Option(
            help="Device capacity or per-process limit the job ran under, e.g. 40GiB [default: from the OOM]."
        ),
    ] = None,
    max_entries: MaxEntriesOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Would other allocator settings have avoided this OOM? Replays the trace through a model of the allocator."""

    def work() -> None:
        _note_memory("whatif", max_entries, snapshot)
        with progress_bar(quiet) as progress:
            result = api.whatif(
                snapshot,
                settings=settings,
                defaults=defaults,
                memory_limit=memory_limit,
                progress=progress,
                max_entries=max_entries,
            )
        if json_out:
            _print_json(result.to_dict())
        else:
            from .render.text import format_whatif

            sys.stdout.write(format_whatif(result))

    _run(work, debug)


class ReportFormat(str, Enum):
    html = "html"
    md = "md"
    png = "png"


@app.command()
def report(
    snapshot: SnapshotArg,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="File to write [default: reports/<snapshot name>.<format>]."),
    ] = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
    format: Annotated[
        ReportFormat,
        typer.Option(
            "--format", help="html: one self-contained page; md: Markdown for a ticket; png: the first screen."
        ),
    ] = ReportFormat.html,
    memory_limit: FitMemoryLimitOpt = None,
    recorded_batch: RecordedBatchOpt = None,
    category: CategoryOpt = None,
    categories_file: CategoriesFileOpt = None,
    max_entries: MaxEntriesOpt = None,
) -> None:
    """Write one self-contained HTML report (plots, OOM cause, top allocation sites, findings),
    or with --format md|png the answer for a ticket. It leads with what fits: under --memory-limit,
    in samples with --batch (both default to what the capture recorded)."""

    def work() -> None:
        _note_memory("report", max_entries, snapshot)
        with progress_bar(quiet) as progress:
            path = api.report(
                snapshot,
                output=output,
                progress=progress,
                format=format.value,
                memory_limit=memory_limit,
                recorded_batch=recorded_batch,
                category=category,
                categories_file=categories_file,
                max_entries=max_entries,
            )
        _wrote(path)

    _run(work, debug)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False}
)
def run(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="The script to run (or the module, with -m).", show_default=False)],
    module: Annotated[bool, typer.Option("-m", "--module", help="Run TARGET as a module, like python -m.")] = False,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the snapshots.")] = Path(DEFAULT_OUT_DIR),
    max_entries: Annotated[
        int, typer.Option(help="Trace ring-buffer size (allocator events kept).")
    ] = CAPTURE_DEFAULTS.max_entries,
    stacks: Annotated[
        str, typer.Option(help="python (fast) or all (adds C++ frames; slow to dump).")
    ] = CAPTURE_DEFAULTS.stacks,
    context: Annotated[
        str, typer.Option(help="What torch records: state, alloc or all (frees too).")
    ] = CAPTURE_DEFAULTS.context,
    on_oom: Annotated[
        bool, typer.Option("--on-oom/--no-on-oom", help="Dump when an OOM happens.")
    ] = CAPTURE_DEFAULTS.on_oom,
    every_n_steps: Annotated[
        int | None, typer.Option(help="Also dump every N calls of recording.step() (API use).")
    ] = CAPTURE_DEFAULTS.every_n_steps,
    prefix: Annotated[
        str, typer.Option(help="File names start with it: <prefix>_rank<R>_<host>_<time>[_<why>].pickle.")
    ] = CAPTURE_DEFAULTS.prefix,
    tag_modules: Annotated[
        bool,
        typer.Option(
            "--tag-modules/--no-tag-modules",
            help="Tag allocations with the module that made them, for memory by module (torch >= 2.10).",
        ),
    ] = CAPTURE_DEFAULTS.tag_modules,
    batch_size: Annotated[
        int | None,
        typer.Option(help="The batch size in samples, written beside each snapshot: reports give batches in samples."),
    ] = CAPTURE_DEFAULTS.batch_size,
    debug: DebugOpt = False,
) -> None:
    """Run a training program with memory recording; dumps on exit and on OOM, one file per rank.

    Arguments after the script go to the script: snaplab run train.py --lr 0.1. Under torchrun:
    torchrun --nproc_per_node 8 -m snapshot_lab run train.py. The exit code is the program's.
    """
    code = _run(
        lambda: api.run(
            target,
            list(ctx.args),
            module=module,
            out=out,
            max_entries=max_entries,
            stacks=stacks,
            context=context,
            on_oom=on_oom,
            every_n_steps=every_n_steps,
            prefix=prefix,
            tag_modules=tag_modules,
            batch_size=batch_size,
        ),
        debug,
    )
    raise typer.Exit(code)


@app.command()
def plan(
    snapshot: SnapshotArg,
    world_size: Annotated[int, typer.Option(help="GPUs to plan for.", show_default=False)],
    strategy: Annotated[
        str | None,
        typer.Option(
            help="ddp, zero1, fsdp (FSDP2; zero2/zero3 = without/with reshard after forward), fsdp1, tp, pp or "
            "fsdp+tp [default: a table of the usual choices].",
        ),
    ] = None,
    bucket_view: Annotated[
        bool, typer.Option("--bucket-view/--no-bucket-view", help="DDP's gradient_as_bucket_view.")
    ] = False,
    bucket_cap_mb: Annotated[float, typer.Option(help="DDP's bucket_cap_mb.")] = 25.0,
    reshard_after_forward: Annotated[
        bool,
        typer.Option(
            "--reshard-after-forward/--no-reshard-after-forward",
            help="FSDP2 reshard_after_forward; FSDP1: FULL_SHARD / SHARD_GRAD_OP.",
        ),
    ] = True,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel degree (tp: the world size; fsdp+tp: 2).")] = None,
    tp_layers: Annotated[
        str,
        typer.Option(
            help="Which layers tensor parallelism shards: blocks (Linear layers of the repeated blocks) or all."
        ),
    ] = "blocks",
    microbatches: Annotated[int | None, typer.Option(help="Pipeline microbatches [default: 4 per stage].")] = None,
    schedule: Annotated[str, typer.Option(help="Pipeline schedule: 1f1b or gpipe.")] = "1f1b",
    pp_split: Annotated[
        str | None, typer.Option(help="Blocks per pipeline stage, e.g. 4,4 [default: even, rest to the last].")
    ] = None,
    memory_limit: Annotated[
        str | None,
        typer.Option(help="Memory per GPU to fit in, e.g. 80GiB [default: the device's capacity from the sidecar]."),
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Also write the plan as HTML.")] = None,
    max_entries: MaxEntriesOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """How much memory per GPU under DDP, FSDP/ZeRO, tensor or pipeline parallelism: the recorded run, replayed."""

    def work() -> None:
        _note_memory("plan", max_entries, snapshot)
        with progress_bar(quiet) as progress:
            result = api.plan(
                snapshot,
                world_size=world_size,
                strategy=strategy,
                bucket_view=bucket_view,
                bucket_cap_mb=bucket_cap_mb,
                reshard_after_forward=reshard_after_forward,
                tp=tp,
                tp_layers=tp_layers,
                microbatches=microbatches,
                schedule=schedule,
                pp_split=pp_split,
                memory_limit=memory_limit,
                output=output,
                progress=progress,
                max_entries=max_entries,
            )
        if json_out:
            _print_json(result.to_dict())
        else:
            from .render.plan import format_plan

            sys.stdout.write(format_plan(result, snapshot.name))
        if output is not None:
            _wrote(output)

    _run(work, debug)


@app.command()
def fit(
    snapshot: SnapshotArg,
    memory_limit: FitMemoryLimitOpt = None,
    recorded_batch: RecordedBatchOpt = None,
    batch_scale: Annotated[float, typer.Option(help="The batch to predict, as a multiple of the recorded one.")] = 1.0,
    checkpointing: Annotated[
        bool, typer.Option("--checkpointing", help="Predict with activation checkpointing of every repeated block.")
    ] = False,
    bf16: Annotated[bool, typer.Option("--bf16", help="Predict under bf16 autocast.")] = False,
    optimizer: Annotated[
        str | None,
        typer.Option(
            help="The optimizer, when the stacks do not name it: adamw, adamw-fused, sgd-momentum, 8-bit adam, ..."
        ),
    ] = None,
    max_entries: MaxEntriesOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """What makes this job fit: the whole step under other batches and levers, and the largest batch per lever."""

    def work() -> None:
        _note_memory("fit", max_entries, snapshot)
        with progress_bar(quiet) as progress:
            result = api.fit(
                snapshot,
                memory_limit=memory_limit,
                recorded_batch=recorded_batch,
                batch_scale=batch_scale,
                checkpointing=checkpointing,
                bf16=bf16,
                optimizer=optimizer,
                progress=progress,
                max_entries=max_entries,
            )
        if json_out:
            _print_json(result.to_dict())
        else:
            from .render.fit import format_fit

            sys.stdout.write(format_fit(result, snapshot.name))

    _run(work, debug)


@app.command()
def mcp(debug: DebugOpt = False) -> None:
    """Serve stats, findings, fit, whatif, diff and ranks to an assistant: a Model Context Protocol server on
    stdin/stdout whose tools return the --json answers (needs the optional mcp extra of snapshot-lab)."""
    _run(api.mcp, debug)


def main() -> None:
    """Console-script entry point. The process ends with ``os._exit`` once its output is flushed:
    the interpreter's teardown frees every object a large snapshot made, one by one, for nothing
    (0.14 s of a 1M-entry report; issue #23). Every file was closed by then, every child joined."""
    try:
        app()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if done.code is not None and not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (| head): nothing more to say
            code = code or 1
    os._exit(code)


if __name__ == "__main__":
    main()
