"""The Python API: the same operations as the command line, with the same names and options.

>>> import snapshot_lab
>>> s = snapshot_lab.stats("sample_snapshots/oom_fragmentation.pickle.gz")
>>> s.oom.cause
'fragmentation'
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import multiprocessing
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, overload

from . import notebook
from ._gc import release_freed_memory
from .aside import Aside, Worker, one_process, spread
from .capture import CAPTURE_DEFAULTS, DEFAULT_OUT_DIR, CaptureOptions
from .errors import OutputError, ParameterError, SnaplabError, SnapshotFormatError, UsageError
from .frames import SnapshotFrames, build_frames
from .load import load_snapshot, pickle_size
from .load.sidecar import sidecar_batch_size
from .metrics import SnapshotStats, compute_stats
from .metrics._memo import forget_named
from .metrics.allocator.whatif import MemoryLimit
from .metrics.categories.custom import CategoryRuleError, CategoryRules, category_rules, parse_rule, rules_from_mapping
from .metrics.comparison.compare import (
    Limits,
    RankRow,
    SnapshotDiff,
    SnapshotSummary,
    check_limits,
    diff_summaries,
    host_of,
    rank_pipeline,
    rank_rows,
    summarize,
)
from .metrics.comparison.stages import compare_stages
from .metrics.diagnose import Diagnosis, device_whatifs, diagnose
from .metrics.findings import Finding, FleetFindings, compute_fleet_findings
from .metrics.history.stages import Stages, file_stages
from .metrics.parallel.pipeline import PipelineSkew
from .metrics.recording import recording_of
from .progress import NullProgress, ProgressSink
from .render.perfetto import DEFAULT_MAX_SLICES
from .results import FileFindings, Leaks, Ranks, Violations, WhatIfs
from .units import parse_bytes


def json_text(obj: Any) -> str:
    """The text of every ``--json`` answer (a result's ``to_dict()``), as the command line prints it
    and the MCP tools return it."""
    return json.dumps(obj, indent=2, sort_keys=False, default=str)


def load_frames(
    snapshot: str | Path, *, progress: ProgressSink | None = None, max_entries: int | None = None
) -> SnapshotFrames:
    """Load a snapshot file and return its frames (segments, blocks, events, stacks...).

    ``max_entries``: read each device's last ``max_entries`` trace entries only, as if torch had
    recorded with ``_record_memory_history(max_entries=...)``: a file too large for the machine's
    memory is analysed from its last entries (the answers say how many were left out); the
    state at the dump (segments, blocks) is read whole. None: every entry."""
    _check_max_entries(max_entries)
    progress = progress or NullProgress()
    snap = load_snapshot(snapshot, progress=progress, max_entries=max_entries)
    progress.stage("Building frames")
    return build_frames(snap, consume=True)


def _memory_to_tell() -> int | None:
    """The memory available, where a note can say what a file may need of it before reading:
    None without the C extensions (then the window does not bound the reading) or on a system
    that does not say (:func:`~.sizing.available_memory`)."""
    from . import sizing
    from ._compiled import compiled

    return sizing.available_memory() if compiled("snapshot_lab.load._decode") is not None else None


def memory_note(snapshot: str | Path, command: str) -> str | None:
    """One line when ``command`` (``"report"``, ``"stats"``, ``"findings"``, ``"leaks"``,
    ``"whatif"``, ``"fit"``, ``"plan"``, ``"diff"``, ``"check"``, ``"export"``) may need more
    memory for this file than the machine has available, naming the ``max_entries`` that fits
    (:mod:`snapshot_lab.sizing`); None when it fits, or where that cannot be told before reading:
    a JSON file, a compressed one that does not state its size (:func:`~.load.pickle_size`),
    :func:`_memory_to_tell`."""
    from . import sizing
    from .units import format_bytes

    size = pickle_size(snapshot)
    available = _memory_to_tell() if size is not None else None
    if size is None or available is None:
        return None
    need = sizing.memory_need(command, size.bytes, available)
    if need is None:
        return None
    fields = {
        "name": Path(snapshot).name,
        "size": format_bytes(size.bytes) + (" decompressed" if size.compressed else ""),
        "entries": need.entries,
        "command": command,
        "need": format_bytes(need.need),
        "available": format_bytes(need.available),
    }
    if need.window is None:
        return sizing.NOTE_NO_WINDOW.format(**fields)
    return sizing.NOTE.format(**fields, window=need.window, window_need=format_bytes(need.window_need))


def _diagnose_frames(frames: SnapshotFrames, stats_: SnapshotStats) -> Diagnosis:
    """:func:`~.metrics.diagnose.diagnose` as every command but the report asks it: without the
    categories' timelines, the what-if's replays spread over the CPUs."""
    return diagnose(frames, stats_, with_category_timelines=False, spread=spread)


def ranks_memory_note(snapshots: Sequence[str | Path], jobs: int | None = None) -> str | None:
    """One line when :func:`ranks`' ``jobs`` workers may need more memory at once than the machine
    has available (the largest pickles read together), naming fewer ``jobs`` or the
    ``max_entries`` that fits each; None when they fit, or where that cannot be told before reading
    (files whose pickle's size is not known before reading are left out: see :func:`memory_note`)."""
    from . import sizing
    from .units import format_bytes

    paths = list(dict.fromkeys(str(p) for p in snapshots))
    sizes = [size.bytes for size in map(pickle_size, paths) if size is not None]
    available = _memory_to_tell() if sizes else None
    if available is None:
        return None
    workers = _rank_jobs(jobs, len(paths))
    need = sizing.ranks_need(sizes, workers, available)
    if need is None:
        return None
    remedies = [sizing.RANKS_FEWER.format(fewer=need.fewer)] if need.fewer else []
    remedies += [sizing.RANKS_WINDOW.format(window=need.window)] if need.window else []
    return sizing.RANKS_NOTE.format(
        files=len(sizes),
        size=format_bytes(sum(sizes)),
        entries=sizing.entries_at_most(sum(sizes)),
        jobs=workers,
        need=format_bytes(need.need),
        available=format_bytes(need.available),
        remedy=" or ".join(remedies) if remedies else sizing.RANKS_ELSEWHERE,
    )


def _rank_jobs(jobs: int | None, files: int) -> int:
    """The worker processes :func:`ranks` reads ``files`` files with: ``jobs``, else the CPUs; at
    most one per file."""
    return max(1, min(jobs or os.cpu_count() or 1, files))


def _check_max_entries(max_entries: int | None) -> None:
    if max_entries is not None and (type(max_entries) is not int or max_entries < 1):
        raise ParameterError(
            "max_entries", "{max_entries} must be a whole number of 1 or more, not {got!r}", got=max_entries
        )


def _stats_beside(frames: SnapshotFrames) -> SnapshotStats:
    """:func:`compute_stats`, the recording described by a forked child beside the rest
    (:class:`~.aside.Aside`; here where no second CPU can be had): at 5M entries a second of
    the statistics' wall time."""
    described = Aside(lambda: recording_of(frames))
    if not described.forked:
        described.result()  # computed here, then first, as compute_stats does: before the memoised arrays
    return compute_stats(frames, recording=described.result)


def _read_rules_file(path: str | Path) -> object:
    """A rules file's content: TOML (``.toml``) or JSON (any other name)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else "cannot read it as UTF-8 text"
        raise ParameterError(
            "categories_file", "{categories_file} {path}: {problem}", path=str(path), problem=problem
        ) from None
    try:
        if str(path).endswith(".toml"):
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ParameterError("categories_file", "{categories_file}: TOML needs Python 3.11; use JSON") from None
            return tomllib.loads(text)
        return json.loads(text)
    except ValueError as exc:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        if isinstance(exc, ParameterError):
            raise
        problem = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ParameterError(
            "categories_file", "{categories_file} {path}: {problem}", path=str(path), problem=problem
        ) from None


def rules_of(category: list[str] | None = None, categories_file: str | Path | None = None) -> CategoryRules | None:
    """The user's category rules (:mod:`snapshot_lab.metrics.categories.custom`): each of
    ``category`` (``NAME=KIND:PATTERN``) in order, then those of ``categories_file``; None when
    neither is given (the built-in categories alone). A bad rule is a :class:`ParameterError`."""
    rules = []
    for text in category or []:
        try:
            rules.append(parse_rule(text))
        except CategoryRuleError as exc:
            raise ParameterError("category", "{category}: {problem}", problem=exc) from None
    if categories_file is not None:
        content = _read_rules_file(categories_file)
        try:
            rules += rules_from_mapping(content)
        except CategoryRuleError as exc:
            raise ParameterError(
                "categories_file", "{categories_file} {path}: {problem}", path=str(categories_file), problem=exc
            ) from None
    try:
        return category_rules(rules)
    except CategoryRuleError as exc:
        raise ParameterError("category", "{category}: {problem}", problem=exc) from None


def stats(
    snapshot: str | Path,
    *,
    stages: bool = False,
    compiled_regions: bool = False,
    category: list[str] | None = None,
    categories_file: str | Path | None = None,
    progress: ProgressSink | None = None,
    max_entries: int | None = None,
) -> SnapshotStats:
    """Torch's memory counters, fragmentation and OOM cause for one snapshot file; with
    ``stages``, also memory by the file's ``record_function`` ranges (``result.stages``); with
    ``compiled_regions``, memory by ``torch.compile``'d region (``result.compiled_regions``: what
    each allocated and its peak, from trace entries recorded with ``compile_context=True``).
    ``category``/``categories_file``: your own categories, rules on the allocations' stacks tried
    before the built-in ones (:func:`rules_of`; ``result.categories`` and the devices' show them).
    ``max_entries``: the last entries of each device's trace only (:func:`load_frames`)."""
    from .metrics.history.compiled import compiled_regions as regions_of
    from .metrics.stats.summary import with_category_rules

    rules = rules_of(category, categories_file)
    frames = load_frames(snapshot, progress=progress, max_entries=max_entries)
    (progress or NullProgress()).stage("Computing statistics")
    result = _stats_beside(frames)
    if rules is not None:
        result = with_category_rules(result, frames, rules)
    if stages:
        result = replace(result, stages=file_stages(frames, rules))
    if compiled_regions:
        result = replace(result, compiled_regions=regions_of(frames))
    return notebook.Stats.of(result)


def _read_and_diagnose(
    snapshot: str | Path, progress: ProgressSink | None, max_entries: int | None = None
) -> tuple[SnapshotStats, Diagnosis]:
    frames = load_frames(snapshot, progress=progress, max_entries=max_entries)
    (progress or NullProgress()).stage("Analysing")
    stats_ = _stats_beside(frames)
    return stats_, _diagnose_frames(frames, stats_)


def leaks(snapshot: str | Path, *, progress: ProgressSink | None = None, max_entries: int | None = None) -> Leaks:
    """Leak suspects per device (``{device: LeakAnalysis}``): sites whose surviving memory grows
    every iteration. ``max_entries``: the last entries of each device's trace only (:func:`load_frames`)."""
    return Leaks(_read_and_diagnose(snapshot, progress, max_entries)[1].leaks)


Files = list[str] | list[Path] | list[str | Path] | tuple[str | Path, ...]  # several snapshot files


@overload
def findings(
    snapshot: str | Path, *, progress: ProgressSink | None = None, max_entries: int | None = None
) -> FileFindings: ...
@overload
def findings(
    snapshot: Files, *, progress: ProgressSink | None = None, max_entries: int | None = None
) -> FleetFindings: ...
def findings(
    snapshot: str | Path | Files, *, progress: ProgressSink | None = None, max_entries: int | None = None
) -> FileFindings | FleetFindings:
    """Findings with evidence and advice, most severe first.

    Given several files (a list; the ranks of one job), each file's own findings and the
    findings across them (``pipeline-stage-imbalance``, from the pipeline stages the capture
    sidecars or the file names tell): a :class:`FleetFindings`, whose ``errors`` name the files
    that could not be read (the others are still analysed). A file given twice is read once.
    ``max_entries``: the last entries of each device's trace only (:func:`load_frames`)."""
    if isinstance(snapshot, (str, os.PathLike)):
        return FileFindings(_read_and_diagnose(snapshot, progress, max_entries)[1].findings)
    _check_max_entries(max_entries)
    progress = progress or NullProgress()
    paths = list(dict.fromkeys(str(p) for p in snapshot))
    own: dict[str, list[Finding]] = {}
    summaries: dict[str, SnapshotSummary] = {}
    errors: dict[str, str] = {}
    for i, p in enumerate(paths):
        progress.stage(f"Analysing {i + 1} of {len(paths)}: {Path(p).name}")
        try:
            own[p], summaries[p] = _findings_and_summary(p, max_entries)
        except SnaplabError as exc:
            errors[p] = exc.message()
    return FleetFindings(own, compute_fleet_findings(summaries), errors)


def _findings_and_summary(snapshot: str, max_entries: int | None = None) -> tuple[list[Finding], SnapshotSummary]:
    """One file's findings and its small summary (its frames go when this returns)."""
    frames = load_frames(snapshot, max_entries=max_entries)
    stats_ = _stats_beside(frames)
    dg = _diagnose_frames(frames, stats_)
    return dg.findings, summarize(frames, stats_, dg, with_sites=False)


def default_report_path(snapshot: str | Path, format: str = "html") -> Path:
    """``reports/<snapshot name without .pickle/.json and compression suffixes>.html`` (``.md``,
    ``.png`` for those formats)."""
    name = Path(snapshot).name
    for suffix in (".gz", ".xz", ".zst", ".zstd", ".bz2"):
        name = name.removesuffix(suffix)
    for suffix in (".pickle", ".pkl", ".json"):
        name = name.removesuffix(suffix)
    return Path("reports") / f"{name or 'snapshot'}.{format}"


def report(
    snapshot: str | Path,
    *,
    output: str | Path | None = None,
    progress: ProgressSink | None = None,
    format: str = "html",
    memory_limit: str | None = None,
    recorded_batch: int | None = None,
    category: list[str] | None = None,
    categories_file: str | Path | None = None,
    max_entries: int | None = None,
) -> Path:
    """Write the report of a snapshot; returns the path written. ``format``: ``"html"`` (one
    self-contained page), ``"md"`` (GitHub-flavoured Markdown for a ticket, under 65,536
    characters) or ``"png"`` (the first screen as an image). ``memory_limit`` (like ``6GiB``) and
    ``recorded_batch`` (the recorded batch in samples) are :func:`fit`'s: the answer the report
    leads with says what fits under that limit, in samples (both default to what the capture
    sidecar recorded, else the limit the run ran out of and multiples of the recorded batch).
    ``category``/``categories_file``: your own categories in the category table and figure
    (:func:`rules_of`). ``max_entries``: the last entries of each device's trace only
    (:func:`load_frames`; the report says how many it left out).

    The file appears only when the report is complete (written to a temporary file, then
    renamed), so a failure never leaves a half-written report behind.
    """
    # matplotlib and jinja2 load only when a report is made; matplotlib by the worker that draws
    # the figures, started first, so that it imports it while the snapshot is read
    from .report import DRAWN, REPORT_FORMATS

    if format not in REPORT_FORMATS:
        raise ParameterError(
            "format", "{format} must be one of {choices}, not {got!r}", choices=", ".join(REPORT_FORMATS), got=format
        )
    limit, batch = _fit_inputs(memory_limit, recorded_batch)
    rules = rules_of(category, categories_file)
    out = Path(output) if output is not None else default_report_path(snapshot, format)
    drawer = Worker(DRAWN)
    try:
        write_atomic(out, _report_content(snapshot, progress, format, drawer, (batch, limit), rules, max_entries))
    finally:
        drawer.close()
    return notebook.ReportFile(out)


def _report_content(
    snapshot: str | Path,
    progress: ProgressSink | None,
    format: str,
    drawer: Worker,
    batch_and_limit: tuple[int | None, int | None] = (None, None),
    rules: CategoryRules | None = None,
    max_entries: int | None = None,
) -> str | bytes:
    """What :func:`report` writes, the figures drawn by ``drawer``; ``batch_and_limit``: the
    recorded batch and the memory limit fit's answer is given (None: the sidecar's, fit's own);
    ``rules``: the user's category rules (None: the built-in categories alone); ``max_entries``:
    :func:`load_frames`'."""
    from .report import build_report, fit_summary

    frames = load_frames(snapshot, progress=progress, max_entries=max_entries)
    batch, limit = batch_and_limit
    (progress or NullProgress()).stage("Computing statistics")
    stats_ = _stats_beside(frames)
    # fit's answer is needed last and the what-if replays only by the findings: each computed
    # beside the rest, in a forked child (aside.py), where the machine has a CPU to spare. Forked
    # after the statistics, whose memoised tables (categories, lifetimes) fit reads too: at 1M
    # entries its child then spends 1.6 s of CPU instead of 2.1
    release_freed_memory()  # the children start from this process's pages
    fit_answer = Aside(
        lambda: fit_summary(frames, recorded_batch=batch, memory_limit=limit), first=lambda: _unread_by_fit(frames)
    )
    whatifs = Aside(lambda: device_whatifs(frames, stats_, spread))
    return build_report(
        frames, stats_, progress, fit_answer, format=format, whatifs=whatifs.result, drawer=drawer, category_rules=rules
    )


def _unread_by_fit(frames: SnapshotFrames) -> None:
    """In fit's child, before it starts: the statistics' timeline, which fit does not read (24
    bytes an entry, 114 MiB at 5M), dropped and its pages given back, for that child is the
    report's largest process (were fit to read it, it would compute it again)."""
    forget_named(frames, "timeline")


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes) to ``path`` via a temporary file in the same folder."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(path, exc.strerror or str(exc)) from None
    try:
        if isinstance(text, bytes):
            with os.fdopen(fd, "wb") as fb:
                fb.write(text)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; a report is for sharing
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(path, exc.strerror or str(exc)) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- comparing


def summarize_file(
    snapshot: str | Path,
    with_sites: bool = True,
    rules: CategoryRules | None = None,
    max_entries: int | None = None,
) -> SnapshotSummary:
    """The small summary ``diff``, ``ranks`` and ``check`` compare (module-level, so a process
    pool or a Dask worker can run it and send back only the summary); ``rules``: the user's
    category rules for its categories (:func:`rules_of`); ``max_entries``: :func:`load_frames`'."""
    frames = load_frames(snapshot, max_entries=max_entries)
    stats_ = _stats_beside(frames)
    return summarize(frames, stats_, _diagnose_frames(frames, stats_), with_sites, rules)


def _summarize_alone(snapshot: str | Path, max_entries: int | None = None) -> SnapshotSummary:
    """:func:`summarize_file` without its sites, for a worker that other files' workers share the
    machine with (a Dask worker): from now on this process computes everything itself, spreading
    no replay over the CPUs (:func:`~.aside.one_process`), as ``ranks``' own pool workers do."""
    one_process()
    return summarize_file(snapshot, False, None, max_entries)


def _read_for_diff(
    snapshot: str | Path,
    rules: CategoryRules | None,
    stages: bool,
    explorers: Payload | None,
    key: str,
    max_entries: int | None = None,
) -> tuple[SnapshotSummary, Stages | None]:
    """A file's summary and, with ``stages``, the stages of its first device with ranges; with
    ``explorers``, its explorer added to the diff page's (``key``: "a" or "b"). Its frames are
    read once (each device's last ``max_entries`` entries, when given) and dropped before the
    next file is read."""
    frames = load_frames(snapshot, max_entries=max_entries)
    stats_ = _stats_beside(frames)
    summary = summarize(frames, stats_, _diagnose_frames(frames, stats_), rules=rules)
    found = next((st for st in file_stages(frames, rules).values() if st.ranges), None) if stages else None
    if explorers is not None:
        from .render.explorer import add_diff_explorer

        add_diff_explorer(explorers, frames, key, Path(snapshot).name, rules, stats_)
    return summary, found


def diff(
    before: str | Path,
    after: str | Path,
    *,
    output: str | Path | None = None,
    stages: bool = False,
    category: list[str] | None = None,
    categories_file: str | Path | None = None,
    progress: ProgressSink | None = None,
    max_entries: int | None = None,
) -> SnapshotDiff:
    """What changed between two snapshots of the same job; with ``output``, also written as HTML
    (the two traces' explorers side by side, linked); with ``stages``, also their
    ``record_function`` ranges compared by name (``result.stages``); ``category``/
    ``categories_file``: your own categories, compared like the built-in ones (:func:`rules_of`);
    ``max_entries``: each file's last entries only (:func:`load_frames`)."""
    rules = rules_of(category, categories_file)
    progress = progress or NullProgress()
    explorers = None
    if output is not None:
        from .render.explorer import Payload

        explorers = Payload(linked=True)
    progress.stage("Reading the first snapshot")
    a, stages_a = _read_for_diff(before, rules, stages, explorers, "a", max_entries)
    progress.stage("Reading the second snapshot")
    b, stages_b = _read_for_diff(after, rules, stages, explorers, "b", max_entries)
    result = diff_summaries(a, b)
    if stages:
        result = replace(result, stages=compare_stages(stages_a, stages_b))
    if output is not None:
        from . import __version__
        from .render.compare import render_diff_html

        write_atomic(Path(output), render_diff_html(result, __version__, explorers))
    return notebook.Diff.of(result)


def _ranks_on_dask(
    paths: list[str],
    scheduler: str,
    jobs: int,
    progress: ProgressSink,
    take: Callable[[str, Any], None],
    max_entries: int | None = None,
) -> None:
    """Parse each file on a Dask worker; only the small summaries come back. ``scheduler`` is a
    scheduler address (tcp://host:8786) or 'local' for a LocalCluster of ``jobs`` processes. The
    workers must see the files at the same paths (a shared filesystem)."""
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise ParameterError(
            "scheduler", "{scheduler} needs dask.distributed: pip install 'snapshot-lab[dask]'"
        ) from None
    cluster = None
    try:
        if scheduler == "local":
            cluster = LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True, dashboard_address=None)
            client = Client(cluster)
        else:
            client = Client(scheduler, timeout="30s")
    except (OSError, TimeoutError) as exc:
        raise ParameterError(
            "scheduler", "cannot reach the Dask scheduler {address}: {problem}", address=scheduler, problem=exc
        ) from None
    try:
        futures = client.map(_summarize_alone, paths, max_entries=max_entries, pure=False)
        owner = {f.key: p for f, p in zip(futures, paths, strict=True)}
        for i, fut in enumerate(as_completed(futures)):
            take(owner[fut.key], fut.result)
            progress.update(i + 1)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def ranks(
    snapshots: list[str | Path],
    *,
    jobs: int | None = None,
    scheduler: str | None = None,
    output: str | Path | None = None,
    progress: ProgressSink | None = None,
    max_entries: int | None = None,
) -> Ranks:
    """One row per rank file, outliers flagged; files are parsed in parallel by ``jobs``
    processes, each holding one snapshot at a time (or on a Dask cluster with ``scheduler``:
    an address, or 'local'). The rank comes from ``rank<N>`` in the file name; files that share a
    number, or have none, are all compared too, each row labelled by its host (from the capture
    sidecar or the name) or its file name (``RankRow.label``). A file given twice is read once.
    When the files span several pipeline stages (from the capture sidecars' parallel layout, or
    ``pp1``/``stage1`` in the names), each rank is compared only with the ranks of its own stage
    (``RankRow.group``) and the stages with each other: :func:`pipeline`.
    ``max_entries``: each file's last entries only (:func:`load_frames`), which bounds each
    worker's memory. Returns the rows and, per file that could not be read, its error (a
    :class:`Ranks`, which unpacks as ``rows, errors``)."""
    _check_max_entries(max_entries)
    progress = progress or NullProgress()
    paths = list(dict.fromkeys(str(p) for p in snapshots))
    jobs = _rank_jobs(jobs, len(paths))
    progress.stage(f"Reading {len(paths)} snapshots", total=len(paths))
    summaries: dict[str, SnapshotSummary] = {}
    errors: dict[str, str] = {}

    def take(path: str, fut_result: Callable[[], Any]) -> None:
        try:
            summaries[path] = fut_result()
        except SnaplabError as exc:
            errors[path] = exc.message()

    if scheduler is not None:
        _ranks_on_dask(paths, scheduler, jobs, progress, take, max_entries)
    elif jobs == 1:
        for i, p in enumerate(paths):
            take(p, functools.partial(summarize_file, p, False, None, max_entries))
            progress.update(i + 1)
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        # one file per worker, each computed in its worker alone: the pool uses the CPUs already
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=one_process) as pool:
            futures = {pool.submit(summarize_file, p, False, None, max_entries): p for p in paths}
            for i, fut in enumerate(concurrent.futures.as_completed(futures)):
                take(futures[fut], fut.result)
                progress.update(i + 1)
    from .load import load_sidecar

    read = {p: summaries[p] for p in paths if p in summaries}
    rows = rank_rows(read, {p: host_of(p, load_sidecar(p)) for p in read})
    if output is not None and rows:
        skew, across = rank_pipeline(rows)
        import pandas as pd

        from . import __version__
        from .plots.common import figure_png_data_uri
        from .plots.compare import plot_ranks
        from .render.compare import render_ranks_html

        chart = pd.DataFrame(
            {
                "rank": [r.label for r in rows],
                "peak": [r.summary.peak_requested_bytes for r in rows],
                "reserved": [r.summary.reserved for r in rows],
                "outlier": [bool(r.flags) for r in rows],
            }
        )
        png = figure_png_data_uri(plot_ranks(chart))
        write_atomic(Path(output), render_ranks_html(rows, errors, png, __version__, skew, across))
    return Ranks(rows, errors)


def pipeline(rows: list[RankRow]) -> tuple[PipelineSkew | None, list[Finding]]:
    """For the rows ``ranks`` returned: the pipeline's stages side by side (None unless the
    files span two pipeline stages; stages come from the capture sidecars or the file names)
    and the findings across the files (``pipeline-stage-imbalance``)."""
    return rank_pipeline(rows)


def check(
    snapshot: str | Path,
    *,
    max_reserved: str | None = None,
    max_allocated: str | None = None,
    max_peak: str | None = None,
    max_fragmentation: float | None = None,
    no_oom: bool = True,
    no_leaks: bool = False,
    baseline: str | Path | None = None,
    max_growth: str | None = None,
    progress: ProgressSink | None = None,
    max_entries: int | None = None,
) -> Violations:
    """Limits for CI gates; returns the violated ones (empty: all limits hold). Sizes are
    strings like ``40GiB`` (a unit is required); ``max_growth`` like ``5%`` or ``0.05``. An
    out-of-memory error in the trace fails the gate unless ``no_oom=False``. ``max_entries``:
    each file's last entries only (:func:`load_frames`)."""

    growth: float | None = None
    if max_growth is not None:
        try:
            g = max_growth.strip()
            growth = float(g[:-1]) / 100 if g.endswith("%") else float(g)
        except ValueError:
            raise ParameterError(
                "max_growth", "{max_growth}: not a percentage: {got!r} (try 5%)", got=max_growth
            ) from None
        if baseline is None:
            raise ParameterError("max_growth", "{max_growth} needs {baseline} (the snapshot to compare against)")
    limits = Limits(
        max_reserved_bytes=_size_or_none(max_reserved, "max_reserved"),
        max_allocated_bytes=_size_or_none(max_allocated, "max_allocated"),
        max_peak_bytes=_size_or_none(max_peak, "max_peak"),
        max_fragmentation=max_fragmentation,
        no_oom=no_oom,
        no_leaks=no_leaks,
        max_growth=growth,
    )
    (progress or NullProgress()).stage("Reading")
    summary = summarize_file(snapshot, with_sites=False, max_entries=max_entries)
    base = summarize_file(baseline, with_sites=False, max_entries=max_entries) if baseline is not None else None
    return Violations(check_limits(summary, limits, base))


EXPORT_FORMATS = ("parquet", "csv", "json", "perfetto")


def export(
    snapshot: str | Path,
    *,
    output: str | Path | None = None,
    format: str = "parquet",
    max_slices: int = DEFAULT_MAX_SLICES,
    category: list[str] | None = None,
    categories_file: str | Path | None = None,
    progress: ProgressSink | None = None,
    max_entries: int | None = None,
) -> list[Path]:
    """Write the frames (segments, blocks, events, stack_frames, stacks, annotations) to
    ``output/<table>.<format>`` (``parquet``, ``csv``, ``json``: JSON lines), or with
    ``format="perfetto"`` memory over time as one Chrome trace JSON file that Perfetto and
    ``chrome://tracing`` open (``output``: the file; default
    ``reports/<snapshot name>.perfetto.json``): counters of allocated, reserved and requested
    bytes and of each category, and a slice per allocation with its stack, at most
    ``max_slices`` per device (those alive at the peak first, then the largest); with
    ``category``/``categories_file``, your own categories' counters and slices (:func:`rules_of`;
    Perfetto only: the tables hold no categories); ``max_entries``: each device's last entries only
    (:func:`load_frames`). Returns the files written."""
    if format not in EXPORT_FORMATS:
        raise ParameterError("format", "{format} must be one of {choices}", choices=", ".join(EXPORT_FORMATS))
    if max_slices < 0:
        raise ParameterError("max_slices", "{max_slices} must be 0 or more")
    rules = rules_of(category, categories_file)
    if rules is not None and format != "perfetto":
        raise ParameterError("category", "{category} needs {format:perfetto} (the tables hold no categories)")
    if format == "perfetto":
        out = Path(output) if output is not None else default_report_path(snapshot, "perfetto.json")
        return [_export_perfetto(snapshot, out, max_slices, progress, rules, max_entries)]
    if output is None:
        raise ParameterError("output", "{output} is needed: the folder to write the tables into")
    if format == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ParameterError(
                "format", "parquet needs pyarrow: pip install 'snapshot-lab[parquet]' (or {format:csv})"
            ) from None
    frames = load_frames(snapshot, progress=progress, max_entries=max_entries)
    return _write_tables(frames, Path(output), format)


def _write_tables(frames: SnapshotFrames, out: Path, format: str) -> list[Path]:
    """Each frame to ``out/<table>.<format>``, each file whole or not at all."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(out, exc.strerror or str(exc)) from None
    written = []
    for name in ("segments", "blocks", "events", "stack_frames", "stacks", "annotations"):
        df = getattr(frames, name)
        path = out / f"{name}.{format}"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            if format == "parquet":
                df.to_parquet(tmp, index=False)
            elif format == "csv":
                df.to_csv(tmp, index=False)
            else:
                df.to_json(tmp, orient="records", lines=True)
            os.replace(tmp, path)
        except OSError as exc:
            raise OutputError(path, exc.strerror or str(exc)) from None
        written.append(path)
    return written


def _export_perfetto(
    snapshot: str | Path,
    out: Path,
    max_slices: int,
    progress: ProgressSink | None,
    rules: CategoryRules | None = None,
    max_entries: int | None = None,
) -> Path:
    """The Perfetto trace of ``snapshot`` written to ``out`` (:mod:`snapshot_lab.render.perfetto`)."""
    import json

    from . import __version__
    from .render.perfetto import build_perfetto_trace

    frames = load_frames(snapshot, progress=progress, max_entries=max_entries)
    (progress or NullProgress()).stage("Building the trace")
    trace = build_perfetto_trace(
        frames, source=Path(snapshot).name, version=__version__, max_slices=max_slices, category_rules=rules
    )
    write_atomic(out, json.dumps(trace, separators=(",", ":"), ensure_ascii=False))
    return out


# --------------------------------------------------------------------------- MCP


def mcp() -> None:
    """Serve the analysis commands (stats, findings, fit, whatif, diff, ranks) as a Model Context
    Protocol server over stdin/stdout until the client closes them (:mod:`snapshot_lab.mcp_server`;
    needs ``pip install "snapshot-lab[mcp]"``, else a :class:`UsageError`)."""
    from .mcp_server import serve

    serve()


# --------------------------------------------------------------------------- capture


def run(
    target: str,
    args: list[str] | None = None,
    *,
    module: bool = False,
    out: str | Path = Path(DEFAULT_OUT_DIR),
    max_entries: int = CAPTURE_DEFAULTS.max_entries,
    stacks: str = CAPTURE_DEFAULTS.stacks,
    context: str = CAPTURE_DEFAULTS.context,
    on_oom: bool = CAPTURE_DEFAULTS.on_oom,
    every_n_steps: int | None = CAPTURE_DEFAULTS.every_n_steps,
    prefix: str = CAPTURE_DEFAULTS.prefix,
    tag_modules: bool = CAPTURE_DEFAULTS.tag_modules,
    batch_size: int | None = CAPTURE_DEFAULTS.batch_size,
) -> int:
    """Run a Python program (``python target args...``, or ``python -m target`` with ``module``)
    with memory recording on; returns its exit code. Snapshots go to ``out``; the recording
    options are :class:`~snapshot_lab.capture.CaptureOptions`'."""
    import runpy

    from .capture import recording

    argv = [target, *(args or [])]
    if not module and not Path(target).is_file():
        raise ParameterError("target", "no such script: {script}", script=target)
    old_argv, old_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = argv
    if not module:
        sys.path.insert(0, str(Path(target).resolve().parent))
    code = 0
    try:
        options = CaptureOptions(max_entries, stacks, context, on_oom, every_n_steps, prefix, tag_modules, batch_size)
        with recording.from_options(out, options) as rec:
            try:
                if module:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(target, run_name="__main__")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    sys.stderr.write(f"{exc.code}\n")
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # the program's own error: reported as python would, exit 1
                traceback.print_exc()
                rec.exit_reason = "exception"
                rec.exception_type = type(exc).__name__
                code = 1
    finally:
        sys.argv = old_argv
        if not module and sys.path and old_path0 is not None and sys.path[0] != old_path0:
            sys.path.pop(0)
    return code


# --------------------------------------------------------------------------- allocator what-if


def _size_or_none(text: str | None, parameter: str) -> int | None:
    """A size parameter in bytes (None when not given); a bad size is an error naming ``parameter``."""
    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise ParameterError(parameter, "{" + parameter + "}: {problem}", problem=exc) from None


def _fit_inputs(memory_limit: str | None, recorded_batch: int | None) -> tuple[int | None, int | None]:
    """:func:`fit`'s and :func:`report`'s ``memory_limit`` in bytes and ``recorded_batch``, checked."""
    limit = _size_or_none(memory_limit, "memory_limit")
    if recorded_batch is not None and recorded_batch < 1:
        raise ParameterError("recorded_batch", "{recorded_batch} must be at least 1")
    return limit, recorded_batch


def whatif(
    snapshot: str | Path,
    *,
    settings: list[str] | None = None,
    defaults: bool = False,
    memory_limit: str | None = None,
    progress: ProgressSink | None = None,
    max_entries: int | None = None,
) -> WhatIfs:
    """Replay each device's trace through the allocator model: a check under the recorded
    settings, then ``settings`` (``KEY:VALUE`` as in PYTORCH_CUDA_ALLOC_CONF, one scenario applied
    on top of the recorded settings, or PyTorch's defaults with ``defaults``) or, with none, a
    grid of sensible alternatives. ``memory_limit`` like ``40GiB``. ``max_entries``: each device's last
    entries only (:func:`load_frames`)."""
    from .metrics.allocator.whatif import analyse_whatif, infer_memory_limit, recorded_settings, scenarios_for
    from .metrics.history.timeline import device_timeline

    limit = _size_or_none(memory_limit, "memory_limit")
    frames = load_frames(snapshot, progress=progress, max_entries=max_entries)
    (progress or NullProgress()).stage("Replaying")
    stats_ = _stats_beside(frames)
    recorded = recorded_settings(frames.info.allocator_settings)
    out = []
    for dev in stats_.devices:
        if limit is not None:
            dev_limit = MemoryLimit(limit, "--memory-limit (taken as a per-process cap)")
        else:
            ts = stats_.devices[dev].torch_stats
            tl = device_timeline(frames, dev, ts["requested_bytes.all.current"], ts["reserved_bytes.all.current"])
            dev_limit = infer_memory_limit(frames, dev, tl.peak_reserved_bytes if tl else None)
        try:
            scenarios = scenarios_for(recorded, settings or [], defaults, dev_limit.bytes)
        except ValueError as exc:
            raise ParameterError("settings", "{settings}: {problem}", problem=exc) from None
        w = analyse_whatif(frames, dev, scenarios, dev_limit.bytes, dev_limit.is_cap, spread)
        out.append(replace(w, memory_limit_source=dev_limit.source, memory_limit_inferred=dev_limit.inferred))
    return WhatIfs(out)


# --------------------------------------------------------------------------- parallel plan

from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from .metrics.plan import MemoryPlan, PlanTable
    from .render.explorer import Payload


@contextlib.contextmanager
def _refused(snapshot: str | Path, what: str, unsupported: type[Exception]) -> Iterator[None]:
    """A snapshot the analysis cannot use is bad input (exit 3); a bad value of a parameter that
    names it passes through; any other ``ValueError`` is a usage error."""
    try:
        yield
    except unsupported as exc:
        raise SnapshotFormatError(snapshot, f"cannot {what} from this snapshot: {exc}") from None
    except ParameterError:
        raise  # already names its parameter
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def plan(
    snapshot: str | Path,
    *,
    world_size: int,
    strategy: str | None = None,
    bucket_view: bool = False,
    bucket_cap_mb: float = 25.0,
    reshard_after_forward: bool = True,
    tp: int | None = None,
    tp_layers: str = "blocks",
    microbatches: int | None = None,
    schedule: str = "1f1b",
    pp_split: str | None = None,
    memory_limit: str | None = None,
    output: str | Path | None = None,
    progress: ProgressSink | None = None,
    max_entries: int | None = None,
) -> MemoryPlan | PlanTable:
    """Memory per GPU if the recorded single-GPU job ran under ``strategy`` over ``world_size``
    GPUs: ``ddp``, ``zero1``, ``fsdp`` (FSDP2; ``zero2``/``zero3`` are FSDP2 without/with
    ``reshard_after_forward``), ``fsdp1``, ``tp``, ``pp`` or ``fsdp+tp``; without ``strategy``,
    a :class:`PlanTable` of the usual choices. ``pp_split`` like ``"4,4"`` (blocks per stage);
    ``memory_limit`` like ``80GiB`` (default: the device's capacity from the capture sidecar).
    With ``output``, also written as HTML. ``max_entries``: each device's last entries only
    (:func:`load_frames`)."""
    from .metrics.plan import PlanUnsupported, Strategy, plan_memory, plan_table

    limit = _size_or_none(memory_limit, "memory_limit")
    split: tuple[int, ...] | None = None
    if pp_split is not None:
        try:
            split = tuple(int(x) for x in pp_split.split(",") if x.strip())
        except ValueError:
            raise ParameterError(
                "pp_split", "{pp_split}: blocks per stage, like 4,4 (got {got!r})", got=pp_split
            ) from None
    if world_size < 1:
        raise ParameterError("world_size", "{world_size} must be at least 1")
    chosen = None
    if strategy is not None:
        chosen = Strategy(
            strategy,
            world_size,
            bucket_view=bucket_view,
            bucket_cap_mb=bucket_cap_mb,
            reshard_after_forward=reshard_after_forward,
            tp=tp,
            tp_layers=tp_layers,
            microbatches=microbatches,
            schedule=schedule,
            pp_split=split,
        )
        try:
            chosen = chosen.resolved()
        except ValueError as exc:
            raise ParameterError("strategy", "{strategy}: {problem}", problem=exc) from None
    frames = load_frames(snapshot, progress=progress, max_entries=max_entries)
    (progress or NullProgress()).stage("Planning")
    source = "--memory-limit" if limit is not None else ""
    result: MemoryPlan | PlanTable
    with _refused(snapshot, "plan", PlanUnsupported):
        if chosen is not None:
            result = plan_memory(frames, chosen, memory_limit=limit, memory_limit_source=source, spread=spread)
        else:
            result = plan_table(frames, world_size, memory_limit=limit, memory_limit_source=source, spread=spread)
    if output is not None:
        from . import __version__
        from .render.plan import render_plan_html

        write_atomic(Path(output), render_plan_html(result, Path(snapshot).name, __version__))
    return result


# --------------------------------------------------------------------------- what makes it fit

if TYPE_CHECKING:
    from .metrics.fit import FitResult


def fit(
    snapshot: str | Path,
    *,
    memory_limit: str | None = None,
    recorded_batch: int | None = None,
    batch_scale: float = 1.0,
    checkpointing: bool = False,
    bf16: bool = False,
    optimizer: str | None = None,
    progress: ProgressSink | None = None,
    max_entries: int | None = None,
) -> FitResult:
    """The smallest change that makes the job fit: one whole training step (forward, backward,
    optimizer step) predicted at ``batch_scale`` times the recorded batch under the levers asked
    for (``checkpointing``, ``bf16``), and, under ``memory_limit`` (like ``6GiB``; default: the
    limit the recorded run ran out of, else the device's capacity), the largest batch per lever,
    in samples when ``recorded_batch`` is given (default: the batch size the capture sidecar
    recorded, if any). ``optimizer`` (``adamw``, ``sgd-momentum``...)
    when the stacks do not name it (a run that failed before its first step). ``max_entries``:
    each device's last entries only (:func:`load_frames`; the window must hold a step)."""
    from .metrics.fit import compute_fit
    from .metrics.fit.model import FitUnsupported

    limit, batch = _fit_inputs(memory_limit, recorded_batch)
    if not batch_scale > 0:
        raise ParameterError("batch_scale", "{batch_scale} must be positive")
    frames = load_frames(snapshot, progress=progress, max_entries=max_entries)
    (progress or NullProgress()).stage("Fitting")
    with _refused(snapshot, "fit", FitUnsupported):
        return compute_fit(
            frames,
            memory_limit=limit,
            recorded_batch=batch if batch is not None else sidecar_batch_size(frames.info.capture),
            batch_scale=batch_scale,
            checkpointing=checkpointing,
            bf16=bf16,
            optimizer=optimizer,
            spread=spread,
        )
