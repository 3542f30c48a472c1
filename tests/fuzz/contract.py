"""The contract every input must keep, whatever its bytes (issue #13):

- the analysis completes, or it raises :class:`SnapshotFormatError` whose message is one short,
  printable line that names the field at fault (``device_traces[0][1532].size: expected ...``)
  or says what is wrong with the file as a whole (truncated, corrupt compressed data, a bomb);
- never any other exception, never a warning or anything else on stderr;
- never a partial report file;
- bounded time: no stage takes more than 10x the CPU time it takes on the unmutated seeds
  (plus a one-second floor for noise; scaled by the input's size over the largest seed's);
  bounded memory is libFuzzer's ``-rss_limit_mb`` and the loader's own limits.

:func:`check_input` runs the loader and every check of the frame builder on every input (the
cheap stage), and, on a fraction chosen by the input's hash (so a replay takes the same path),
everything else: the frames, ``stats``, ``findings``, ``leaks``, ``whatif``, ``report`` (the HTML
written and parsed back), ``diff``, ``export``, ``check``, and the real command line (in process,
stderr captured: exactly one line for a refused input).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import sys
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from snapshot_lab import api
from snapshot_lab.errors import SnapshotFormatError
from snapshot_lab.frames import build_frames, check_frames
from snapshot_lab.load import load_snapshot

from .pending import known_pending

# how often (1 in N of the inputs that load, by hash) the costlier stages run
# (SNAPLAB_FUZZ_SAMPLING="16,1600,16000" to change; each must divide the next)
EVERY_FRAMES, EVERY_ANALYSIS, EVERY_OUTPUTS = (
    int(x) for x in os.environ.get("SNAPLAB_FUZZ_SAMPLING", "16,1600,16000").split(",")
)

TIME_FACTOR = 10.0
TIME_FLOOR_S = 1.0  # timer resolution, caches, the garbage collector: noise no input causes

# A refusal either names the field (a path into the snapshot, then ': ') or says what is wrong
# with the file as a whole. Anything else is a Python error leaking through.
_FIELD = re.compile(
    r"^(segments|device_traces|allocator_settings|external_annotations)"
    r"""(\[(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\]'"]*)\]|\.[A-Za-z_]\w*)*: """
)
_FILE_LEVEL = (
    "no such file",
    "empty file",
    "empty after decompression",
    "not a PyTorch memory snapshot",
    "truncated file",
    "corrupt compressed data",
    "corrupt zstd data",
    "not a valid pickle",
    "not a valid pickle or JSON",
    "invalid JSON",
    "refused: ",
    "segments: 'segments' is a",
)


class ContractViolation(AssertionError):
    """An input broke the contract; ``signature`` names the class of bug (for deduplication)."""

    def __init__(self, signature: str, detail: str) -> None:
        self.signature = signature
        self.detail = detail
        super().__init__(f"{signature}\n{detail}")


@dataclass
class Stats:
    inputs: int = 0
    refused: int = 0
    loaded: int = 0
    frames: int = 0
    analysed: int = 0
    outputs: int = 0
    pending_skipped: int = 0
    slowest: dict[str, float] = field(default_factory=dict)  # stage -> worst time / baseline

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_refusal(exc: SnapshotFormatError, path: Path) -> None:
    msg = str(exc)
    if "\n" in msg or "\r" in msg or not msg.isprintable():
        raise ContractViolation("message:not-one-printable-line", repr(msg[:2000]))
    if not msg.startswith(f"{path}: "):
        raise ContractViolation("message:no-path", repr(msg[:500]))
    reason = exc.reason
    if len(reason) > 400:
        raise ContractViolation("message:too-long", repr(reason[:500]))
    if not (_FIELD.match(reason) or reason.startswith(_FILE_LEVEL)):
        raise ContractViolation("message:names-no-field", repr(reason[:500]))


def _signature(exc: BaseException) -> str:
    """Exception type and the innermost snaplab frame: one crash class."""
    where = "?"
    for fs in traceback.extract_tb(exc.__traceback__):
        if "snapshot_lab" in fs.filename:
            where = f"{fs.filename.split('snapshot_lab/')[-1]}:{fs.name}"
    return f"crash:{type(exc).__name__}@{where}"


@contextlib.contextmanager
def _quiet_checked(stage: str) -> Iterator[None]:
    """stderr and warnings captured; any output at all breaks the contract."""
    err = io.StringIO()
    old_err, old_hook = sys.stderr, sys.excepthook
    sys.stderr = err
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        sys.stderr, sys.excepthook = old_err, old_hook
    if caught:
        w = caught[0]
        raise ContractViolation(
            f"stderr:warning:{w.category.__name__}@{Path(w.filename).name}:{w.lineno}", f"{stage}: {w.message}"
        )
    if err.getvalue():
        first = err.getvalue().strip().splitlines()[-1][:120] if err.getvalue().strip() else "blank"
        raise ContractViolation(f"stderr:{first[:60]}", f"{stage}: {err.getvalue()[:2000]}")


class _HTMLCheck(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)


def _check_html(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    p = _HTMLCheck()
    p.feed(text)
    p.close()
    if "html" not in p.tags or "body" not in p.tags or not text.rstrip().endswith("</html>"):
        raise ContractViolation("report:incomplete-html", f"{len(text)} chars, tags {p.tags[:10]}")


class Contract:
    """Checks inputs against the contract; ``workdir`` holds the files written (reused)."""

    def __init__(self, workdir: Path, reference: Path, baselines: dict[str, float] | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.reference = reference  # a clean snapshot: the other side of diff and check --baseline
        self.baselines = baselines or {}
        self.seed_data_size = 0  # bytes of the largest seed, decompressed
        self._data = b""
        self._everything = False
        self.stats = Stats()
        from typer.testing import CliRunner

        from snapshot_lab.cli import app

        self._runner = CliRunner()
        self._app = app

    # ---------------------------------------------------------------- stages

    def _timed(self, stage: str, fn: Callable[[], Any]) -> Any:
        t0 = time.process_time()  # CPU time: other processes on a busy machine do not count
        out = fn()
        dt = time.process_time() - t0
        if self._over(stage, dt):
            # a collection of the fuzzing process's own garbage (the mutants' reference cycles)
            # can land inside any stage: slow only if it is slow again with the heap collected
            gc.collect()
            t0 = time.process_time()
            fn()
            dt = min(dt, time.process_time() - t0)
        self._check_time(stage, dt)
        return out

    def _over(self, stage: str, dt: float) -> bool:
        base = self.baselines.get(stage)
        return bool(base) and dt > TIME_FACTOR * base + TIME_FLOOR_S

    def _check_time(self, stage: str, dt: float) -> None:
        """No stage may take more than TIME_FACTOR times its worst time on the seeds, scaled by
        how much more data the input holds than the largest seed (a mutation that repeats a
        list a thousand times makes a file a thousand times larger: reading it takes longer,
        and that is not a bug; reading it more slowly per byte would be)."""
        base = self.baselines.get(stage)
        if not base:
            return
        if dt > TIME_FACTOR * base + TIME_FLOOR_S:
            scale = max(1.0, data_size(self._data) / self.seed_data_size) if self.seed_data_size else 1.0
            ratio = dt / (base * scale)
            if ratio > TIME_FACTOR + TIME_FLOOR_S / (base * scale):
                raise ContractViolation(f"slow:{stage}", f"{dt:.2f} s, baseline {base:.3f} s, data {scale:.1f}x")
        else:
            ratio = dt / base
        if ratio > self.stats.slowest.get(stage, 0.0):
            self.stats.slowest[stage] = ratio

    def _cli(self, args: list[str]) -> None:
        r = self._runner.invoke(self._app, args)
        if r.exit_code not in (0, 1, 3):
            raise ContractViolation(f"cli:exit-{r.exit_code}:{args[0]}", (r.stderr or "")[:2000])
        if r.exit_code == 3:
            lines = r.stderr.splitlines()
            if len(lines) != 1 or not lines[0].startswith("snaplab: error: "):
                raise ContractViolation(f"cli:stderr-not-one-line:{args[0]}", r.stderr[:2000])

    def run(self, data: bytes, everything: bool = False) -> None:
        """Check one input; raises ContractViolation (pending cases are counted and skipped).
        ``everything``: every stage, whatever the input's hash says."""
        self.stats.inputs += 1
        self._data = data
        path = self.workdir / "input.pickle"
        path.write_bytes(data)
        h = 0 if everything else zlib.crc32(data)
        self._everything = everything
        try:
            self._run(path, h)
        except ContractViolation:
            raise
        except SnapshotFormatError as exc:
            raise ContractViolation("refused-late:" + exc.reason[:40], str(exc)[:500]) from exc
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            if known_pending(exc) is not None:
                self.stats.pending_skipped += 1
                return
            detail = "".join(traceback.format_exception(exc))[-4000:]
            raise ContractViolation(_signature(exc), detail) from exc

    def _run(self, path: Path, h: int) -> None:
        with _quiet_checked("load"):
            try:
                snap = self._timed("load", lambda: load_snapshot(path))
                self._timed("check_frames", lambda: check_frames(snap))
            except SnapshotFormatError as exc:
                self.stats.refused += 1
                check_refusal(exc, path)
                if self._everything or h % 200 == 1:  # the command line says the same, in one line
                    self._cli(["stats", str(path)])
                return
        self.stats.loaded += 1
        if (h >> 8) % EVERY_FRAMES:
            return
        with _quiet_checked("frames"):
            self._timed("frames", lambda: build_frames(load_snapshot(path), consume=True))  # re-runnable
        self.stats.frames += 1
        if (h >> 8) % EVERY_ANALYSIS:
            return
        with _quiet_checked("analysis"):
            self._timed("stats", lambda: api.stats(path).to_dict())
            self._timed("findings", lambda: [f.to_dict() for f in api.findings(path)])
            self._timed("leaks", lambda: {d: la.to_dict() for d, la in api.leaks(path).items()})
            self._timed("whatif", lambda: [w.to_dict() for w in api.whatif(path)])
        self.stats.analysed += 1
        if (h >> 8) % EVERY_OUTPUTS:
            return
        self.outputs(path)

    def outputs(self, path: Path) -> None:
        """The commands that write files, and the command line."""
        out = self.workdir / "out"
        html = out / "report.html"
        with contextlib.suppress(FileNotFoundError):
            html.unlink()
        with _quiet_checked("outputs"):
            try:
                self._timed("report", lambda: api.report(path, output=html))
            except ContractViolation:
                raise
            except BaseException:
                if html.exists() or list(out.glob(".report.html.*")):
                    raise ContractViolation("report:partial-file", str(html)) from None
                raise
            _check_html(html)
            self._timed("diff", lambda: api.diff(self.reference, path, output=out / "diff.html").to_dict())
            self._timed("export", lambda: api.export(path, output=out / "export", format="csv"))
            self._timed(
                "check",
                lambda: api.check(
                    path,
                    max_reserved="1GiB",
                    max_peak="1GiB",
                    max_fragmentation=0.5,
                    no_oom=True,
                    no_leaks=True,
                    baseline=self.reference,
                    max_growth="5%",
                ),
            )
            for cmd in ("stats", "findings", "leaks", "whatif", "check"):
                self._cli([cmd, str(path), "--json"] if cmd != "check" else [cmd, str(path)])
        self.stats.outputs += 1


def data_size(data: bytes) -> int:
    """Bytes of snapshot in a file: decompressed when it is compressed (counted, not kept)."""
    from snapshot_lab.load.compression import open_decompressed, sniff_compression

    comp = sniff_compression(data[:8])
    if comp is None:
        return len(data)
    n = 0
    try:
        with open_decompressed(io.BytesIO(data), comp) as f:
            while chunk := f.read(1 << 20):
                n += len(chunk)
                if n > 4 << 30:
                    break
    except Exception:
        pass
    return max(n, len(data))


def measure_baselines(contract: Contract, seeds: list[bytes], analysis_seeds: int = 2) -> dict[str, float]:
    """Each stage's worst time over the unmutated seeds (analysis stages: over a few of them)."""
    base: dict[str, float] = {}

    def keep(stage: str, fn: Callable[[], Any]) -> None:
        t0 = time.process_time()
        fn()
        base[stage] = max(base.get(stage, 0.0), time.process_time() - t0)

    path = contract.workdir / "seed.pickle"
    contract.seed_data_size = max(data_size(d) for d in seeds)
    for i, data in enumerate(seeds):
        path.write_bytes(data)
        try:
            snap = load_snapshot(path)
        except SnapshotFormatError:
            continue
        keep("load", lambda: load_snapshot(path))
        keep("check_frames", lambda s=snap: check_frames(s))
        keep("frames", lambda: build_frames(load_snapshot(path)))
        if i < analysis_seeds:
            keep("stats", lambda: api.stats(path))
            keep("findings", lambda: api.findings(path))
            keep("leaks", lambda: api.leaks(path))
            keep("whatif", lambda: api.whatif(path))
            keep("report", lambda: api.report(path, output=contract.workdir / "seed.html"))
            keep("diff", lambda: api.diff(contract.reference, path))
            keep("export", lambda: api.export(path, output=contract.workdir / "seed_export", format="csv"))
            keep("check", lambda: api.check(path, max_reserved="1GiB", baseline=contract.reference))
    # the slowest analysis of the seeds actually measured is the bound for all (a mutated input
    # can come from the largest seed); the cheap stages were measured on every seed
    return base
