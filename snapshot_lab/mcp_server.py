"""snaplab as a Model Context Protocol server over stdio: ``snaplab mcp``.

An assistant asks the same questions as the command line, with the same answers: the tools
``stats``, ``findings``, ``fit``, ``whatif``, ``diff`` and ``ranks`` each return the JSON text that
``snaplab <tool> --json`` prints (the result's ``to_dict()``, through :func:`snapshot_lab.api.json_text`),
and take the Python API's parameters, less those that write files or reach other machines
(``output``, ``scheduler``). The limits are the command line's: every file is read by the same
loader (a restricted unpickler that refuses every global, the size and shape checks); a path
that is missing, not a snapshot or unsafe is a tool error of one line, never a traceback; the
server writes nothing. Unlike the command line's, an error never quotes the file: the loader's
reasons can quote a file's first bytes or a key read from it, which would let a client read a
few bytes of any file this process can open, so quoted text is cut out (:func:`client_message`).
A path that is not a regular file (a directory, a FIFO, a device) is refused before it is opened.

The ``mcp`` SDK is an optional extra (``pip install "snapshot-lab[mcp]"``), imported only here
and only when the server starts.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable
from typing import Any

from . import __version__, api
from .errors import EXIT_INTERNAL, ParameterError, SnaplabError, SnapshotFormatError, UsageError

INSTALL_HINT = "snaplab mcp needs the MCP SDK: pip install 'snapshot-lab[mcp]'"
INSTRUCTIONS = (
    "Answers from PyTorch CUDA memory snapshot files (torch.cuda.memory._dump_snapshot), offline. "
    "Pass paths of snapshot files on this machine. Every tool returns the JSON of `snaplab <tool> --json`."
)


# quoted text in a reason (a Python repr of bytes or str, either quote): it may come from the file
_QUOTED = re.compile(r"b?'(?:[^'\\]|\\.)*'" + r'|b?"(?:[^"\\]|\\.)*"')
_FILE_START = re.compile(r";? *file starts with .*$")


def client_message(exc: SnaplabError) -> str:
    """The one line a client is told: the command line's, with any quoted text of a snapshot
    error (file bytes, keys read from the file) replaced by ``'…'``; a rules file's error is not
    told at all (it would quote the file's keys)."""
    if isinstance(exc, ParameterError) and exc.parameter == "categories_file":
        return "categories_file: not a rules file snaplab can use (`snaplab stats --categories-file` says why)"
    if not isinstance(exc, SnapshotFormatError):
        return exc.message()
    reason = _QUOTED.sub("'…'", _FILE_START.sub("", exc.reason))
    return f"{exc.path}: {reason}"


def require_regular_files(paths: Iterable[str]) -> None:
    """Refuse, before anything opens it, a path that exists but is not a regular file (a FIFO
    would block the server, a device would stream forever); a missing path is left to the
    loader's own message."""
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise SnapshotFormatError(path, "not a regular file")


def _answer(compute: Callable[[], Any], paths: Iterable[str] = ()) -> str:
    """The JSON text of ``compute()``'s result, or a tool error of one line (an error snaplab
    expected: :func:`client_message`; anything else: the exception's type only, since its text
    may quote what was read)."""
    from mcp.server.mcpserver.exceptions import ToolError

    try:
        require_regular_files(paths)
        return api.json_text(compute().to_dict())
    except SnaplabError as exc:
        raise ToolError(client_message(exc)) from None
    except Exception as exc:
        raise ToolError(
            f"internal error: {type(exc).__name__} (a bug, exit {EXIT_INTERNAL} on the command line)"
        ) from None


def stats(
    snapshot: str,
    stages: bool = False,
    compiled_regions: bool = False,
    category: list[str] | None = None,
    categories_file: str | None = None,
    max_entries: int | None = None,
) -> str:
    """Torch's memory counters of a snapshot file (exactly as torch.cuda.memory_stats() had them at the
    dump: reserved_bytes.all.current, allocated_bytes.all.peak, ...), fragmentation per pool, the OOM and
    its cause, bytes by category; stages: also memory by the file's record_function ranges;
    compiled_regions: also memory by torch.compile'd region; category: your own categories,
    NAME=KIND:PATTERN (kinds file:, func:, frame: globs, re: a regex on file:line:function), tried before
    the built-in ones (categories_file: a TOML or JSON file of them); max_entries: read only each
    device's last N trace entries (a file too large for the memory): `snaplab stats --json [--stages]
    [--compiled-regions] [--category ...] [--max-entries N]`."""
    return _answer(
        lambda: api.stats(
            snapshot,
            stages=stages,
            compiled_regions=compiled_regions,
            category=category,
            categories_file=categories_file,
            max_entries=max_entries,
        ),
        [snapshot],
    )


def findings(snapshot: str | list[str], max_entries: int | None = None) -> str:
    """What is wrong, with evidence, the memory at stake and advice (OOM by fragmentation or capacity,
    leaks, DDP duplicate gradients, cache churn, imbalance): `snaplab findings --json [--max-entries N]`.
    One file, or several (the ranks of one job: each file's findings and those across the files)."""
    paths = [snapshot] if isinstance(snapshot, str) else list(dict.fromkeys(snapshot))

    def compute() -> Any:
        if len(paths) == 1:
            return api.findings(paths[0], max_entries=max_entries)
        several = api.findings(paths, max_entries=max_entries)
        if not several.files:
            raise UsageError("; ".join(several.errors.values()) or "no snapshot files given")
        return several

    return _answer(compute, paths)


def fit(
    snapshot: str,
    memory_limit: str | None = None,
    recorded_batch: int | None = None,
    batch_scale: float = 1.0,
    checkpointing: bool = False,
    bf16: bool = False,
    optimizer: str | None = None,
    max_entries: int | None = None,
) -> str:
    """What makes this job fit: the whole step's peak under other batches and levers, and the largest
    batch per lever under memory_limit (like '6GiB'; default: the limit the run ran out of, else the
    device's capacity); recorded_batch (samples) gives answers in samples; max_entries: the trace's
    last N entries only: `snaplab fit --json`."""
    return _answer(
        lambda: api.fit(
            snapshot,
            memory_limit=memory_limit,
            recorded_batch=recorded_batch,
            batch_scale=batch_scale,
            checkpointing=checkpointing,
            bf16=bf16,
            optimizer=optimizer,
            max_entries=max_entries,
        ),
        [snapshot],
    )


def whatif(
    snapshot: str,
    settings: list[str] | None = None,
    defaults: bool = False,
    memory_limit: str | None = None,
    max_entries: int | None = None,
) -> str:
    """Would other allocator settings have avoided the OOM: the trace replayed through a model of the
    allocator. settings: KEY:VALUE as in PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True, ...), one
    combined scenario; none: a grid of alternatives; max_entries: the trace's last N entries only:
    `snaplab whatif --json`."""
    return _answer(
        lambda: api.whatif(
            snapshot, settings=settings, defaults=defaults, memory_limit=memory_limit, max_entries=max_entries
        ),
        [snapshot],
    )


def diff(
    before: str,
    after: str,
    stages: bool = False,
    category: list[str] | None = None,
    categories_file: str | None = None,
    max_entries: int | None = None,
) -> str:
    """What changed between two snapshots of one job: totals, categories, allocation sites, modules,
    findings; stages: also the record_function ranges of the two compared by name; category and
    categories_file: your own categories, as in stats; max_entries: each file's last N trace entries
    only: `snaplab diff --json [--stages] [--category ...] [--max-entries N]`."""
    return _answer(
        lambda: api.diff(
            before, after, stages=stages, category=category, categories_file=categories_file, max_entries=max_entries
        ),
        [before, after],
    )


def ranks(snapshots: list[str], jobs: int | None = None, max_entries: int | None = None) -> str:
    """One row per rank file (peak, reserved, allocated, fragmentation, OOM), outliers flagged within
    their pipeline stage; jobs: parallel worker processes on this machine; max_entries: each file's
    last N trace entries only: `snaplab ranks --json [--max-entries N]`."""

    def compute() -> Any:
        result = api.ranks(list(snapshots), jobs=jobs, max_entries=max_entries)
        if not result.rows:
            raise UsageError("; ".join(result.errors.values()) or "no snapshot files given")
        return result

    return _answer(compute, snapshots)


TOOLS: tuple[Callable[..., str], ...] = (stats, findings, fit, whatif, diff, ranks)


def build_server() -> Any:
    """The server, its tools registered (raises :class:`UsageError` without the SDK)."""
    try:
        from mcp.server.mcpserver import MCPServer
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    server = MCPServer("snaplab", version=__version__, instructions=INSTRUCTIONS, log_level="WARNING")
    for tool in TOOLS:
        server.add_tool(tool, structured_output=False)
    return server


def serve() -> None:
    """Answer MCP requests on stdin/stdout until the client closes them."""
    build_server().run("stdio")
