"""pytest plugin: fail a test whose CUDA memory peak exceeds a limit, and keep the evidence.

Installed with snaplab (entry point ``pytest11``), inert until asked::

    @pytest.mark.limit_cuda_memory("2 GiB")
    def test_forward_fits():
        ...

    pytest --snaplab-max-peak 20GiB                 # every test (a marker's own limit wins)
    pytest --snaplab-keep all --snaplab-dir snaps/  # keep a snapshot + report of every measured test

The peak is ``torch.cuda.max_memory_allocated()`` of each device, after
``torch.cuda.reset_peak_memory_stats()`` when the test starts (memory allocated before the test,
by a fixture say, counts: the peak is the device's, not the test's increment). While a measured
test runs, the allocator's history is recorded (``snapshot_lab.capture.recording``, Python stacks):
a test over its limit fails with a message that names the allocation sites live at the peak and
the paths of its snapshot and HTML report (``--snaplab-keep failed``, the default, keeps them for
tests that failed, ``all`` for every measured test, ``none`` for none). Without torch or without a
GPU, a marked test is skipped with the reason; ``--snaplab-max-peak`` then measures nothing and
says so in the header. Without ``pip install``, load it with ``-p snapshot_lab.pytest_plugin``.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .units import format_bytes, parse_bytes

MARKER = "limit_cuda_memory"
KEEP_CHOICES = ("failed", "all", "none")
DEFAULT_DIR = "snaplab-pytest"
MAX_SITES = 5


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("snaplab", "CUDA memory limits (snaplab)")
    group.addoption(
        "--snaplab-max-peak",
        metavar="SIZE",
        default=None,
        help="fail every test whose CUDA memory peak (torch.cuda.max_memory_allocated) exceeds SIZE, "
        f"e.g. 20GiB; @pytest.mark.{MARKER}(SIZE) sets one test's limit",
    )
    group.addoption(
        "--snaplab-keep",
        choices=KEEP_CHOICES,
        default="failed",
        help="keep a memory snapshot and its HTML report for the measured tests that failed (default), "
        "for all measured tests, or none",
    )
    group.addoption(
        "--snaplab-dir",
        metavar="DIR",
        default=DEFAULT_DIR,
        help=f"where kept snapshots and reports go (default: {DEFAULT_DIR}/ under the rootdir)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(size): fail the test if its CUDA memory peak exceeds size (e.g. '2 GiB'); "
        "skipped without a GPU (snaplab)",
    )
    config.pluginmanager.register(CudaMemoryLimits(config), "snaplab-cuda-memory")


def _size(value: object, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    try:
        return parse_bytes(str(value))
    except ValueError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None


@dataclass
class Measured:
    """One measured test, for the terminal summary."""

    nodeid: str
    limit_bytes: int
    source: str
    peaks: dict[int, int]
    over: dict[int, int]
    snapshot: Path | None = None
    report: Path | None = None
    sites: list[str] = field(default_factory=list)


# the failure message's first line, per device over the limit
OVER_LIMIT = (
    "CUDA memory peak {peak} on device {device} exceeds the limit of {limit} ({source}); {start} were already "
    "allocated when the test started"
)


class CudaMemoryLimits:
    """The plugin's state: options, whether CUDA is there, what was measured."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        max_peak = config.getoption("snaplab_max_peak")
        self.max_peak = _size(max_peak, "--snaplab-max-peak") if max_peak is not None else None
        self.keep: str = config.getoption("snaplab_keep")
        out = Path(config.getoption("snaplab_dir"))
        self.dir = out if out.is_absolute() else config.rootpath / out
        self.results: list[Measured] = []
        self._cuda: tuple[Any, str | None] | None = None

    def cuda(self) -> tuple[Any, str | None]:
        """(torch, None) when CUDA can be measured, else (None, why not); asked once."""
        if self._cuda is None:
            try:
                import torch
            except ImportError:
                self._cuda = (None, "torch is not installed")
            else:
                try:
                    available = bool(torch.cuda.is_available())
                except Exception as exc:
                    # a broken driver: say so, do not crash the session
                    self._cuda = (None, f"CUDA is not usable: {exc}")
                else:
                    self._cuda = (torch, None) if available else (None, "CUDA is not available")
        return self._cuda

    def limit_of(self, item: pytest.Item) -> tuple[int, str] | None:
        marker = item.get_closest_marker(MARKER)
        if marker is not None:
            size = marker.args[0] if marker.args else marker.kwargs.get("size")
            if size is None:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{MARKER} needs a size, e.g. '2 GiB'")
            return _size(
                size,
                f"{item.nodeid}: @pytest.mark.{MARKER}",
            ), f"@pytest.mark.{MARKER}({size!r})"
        if self.max_peak is not None:
            return self.max_peak, f"--snaplab-max-peak {format_bytes(self.max_peak)}"
        return None

    # -- hooks --------------------------------------------------------------------------------

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        if self.max_peak is None:
            return None
        torch, why = self.cuda()
        if torch is None:
            return f"snaplab: --snaplab-max-peak measures nothing: {why}"
        return f"snaplab: CUDA memory peak limit {format_bytes(self.max_peak)}, keep {self.keep}, dir {self.dir}"

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if item.get_closest_marker(MARKER) is None:
            return
        self.limit_of(item)  # a bad size is a usage error, before the test runs
        torch, why = self.cuda()
        if torch is None:
            pytest.skip(f"{MARKER}: {why}")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        limit = self.limit_of(item) if (self.max_peak is not None or item.get_closest_marker(MARKER)) else None
        torch = self.cuda()[0] if limit is not None else None
        if limit is None or torch is None:
            return (yield)
        return (yield from self._measure(item, torch, *limit))

    def _measure(
        self,
        item: pytest.Item,
        torch: Any,
        limit: int,
        source: str,
    ) -> Generator[None, object, object]:
        from .capture import CaptureError, recording

        out = Path(tempfile.mkdtemp(prefix="snaplab-")) if self.keep == "none" else self.dir
        prefix = re.sub(r"[^A-Za-z0-9._-]+", "_", item.nodeid).strip("_")[:120] or "test"
        rec = recording(out, stacks="python", on_oom=True, dump_on_exit=False, prefix=prefix)
        recorded = True
        try:
            rec.__enter__()
        except CaptureError as exc:  # measured anyway, without a snapshot
            item.add_report_section(
                "call",
                "snaplab",
                f"no memory history recorded: {exc.message()}",
            )
            recorded = False
        devices = range(int(torch.cuda.device_count()))
        # the allocator counts on the host, at each request: no synchronisation needed
        start = {device: int(torch.cuda.memory_allocated(device)) for device in devices}
        for device in devices:
            torch.cuda.reset_peak_memory_stats(device)
        error: BaseException | None = None
        result: object = None
        snapshot: Path | None = None
        peaks: dict[int, int] = {}
        over: dict[int, int] = {}
        failed = False
        try:
            try:
                result = yield
            except BaseException as exc:
                # the test's own failure: reported as it is, evidence added
                error = exc
            peaks = {device: int(torch.cuda.max_memory_allocated(device)) for device in devices}
            over = {device: peak for device, peak in peaks.items() if peak > limit}
            failed = bool(over) or error is not None
            if recorded and (over or self.keep == "all" or (failed and self.keep == "failed")):
                oom = [peak for peak in rec.written if peak.name.endswith("_oom.pickle")]
                # an OOM's snapshot was taken at the failing request: better evidence than the aftermath
                snapshot = oom[-1] if error is not None and oom else rec.dump("peak" if over else "test")
        finally:
            if recorded:
                # history off (dump_on_exit=False: nothing more written)
                rec.__exit__(None, None, None)
        measured = Measured(item.nodeid, limit, source, peaks, over)
        self.results.append(measured)
        keep_files = self.keep == "all" or (self.keep == "failed" and failed)
        message = self._explain(measured, start, snapshot, keep_files)
        if self.keep == "none":
            shutil.rmtree(out, ignore_errors=True)
        if error is not None:
            if message:
                item.add_report_section("call", "snaplab", message)
            raise error
        if over:
            pytest.fail(message, pytrace=False)
        if measured.snapshot is not None:
            item.add_report_section("call", "snaplab", message)
        return result

    def _explain(
        self,
        measured: Measured,
        start: dict[int, int],
        snapshot: Path | None,
        keep_files: bool,
    ) -> str:
        """The failure message (and, when files are kept, their paths in ``m``)."""
        lines = []
        worst = max(measured.peaks, key=lambda dev: measured.peaks[dev]) if measured.peaks else 0
        for device_index, peak in sorted(measured.over.items()):
            lines.append(
                OVER_LIMIT.format(
                    peak=format_bytes(peak),
                    device=device_index,
                    limit=format_bytes(measured.limit_bytes),
                    source=measured.source,
                    start=format_bytes(start.get(device_index, 0)),
                )
            )
        if not measured.over and measured.peaks:
            shown, cap = format_bytes(measured.peaks[worst]), format_bytes(measured.limit_bytes)
            lines.append(f"CUDA memory peak {shown} on device {worst}, limit {cap}")
        if snapshot is not None:
            device = max(measured.over, key=lambda dev: measured.over[dev]) if measured.over else worst
            try:
                sites, peak_at, before = peak_sites(snapshot, device, MAX_SITES)
            except Exception as exc:  # the analysis must not hide the verdict
                sites, peak_at, before = [], None, 0
                lines.append(f"(the snapshot could not be analysed: {exc})")
            if sites:
                lines.append(
                    "Top allocation sites live at the peak"
                    + (
                        f" ({format_bytes(peak_at)} requested at the peak):"
                        if peak_at is not None
                        else " (at the dump):"
                    )
                )
                for site in sites:
                    # of the whole peak, not of the trace's part
                    share = site.bytes / peak_at if peak_at else site.share
                    text = f"{format_bytes(site.bytes):>12}  {100 * share:5.1f}%  {site.label}"
                    if site.detail:
                        text += f" -> {site.detail}"
                    lines.append(text)
                    measured.sites.append(site.label)
                if peak_at and before > 0:
                    lines.append(
                        f"{format_bytes(before):>12}  {100 * before / peak_at:5.1f}%  "
                        "<allocated before the recording began (no site)>"
                    )
            if keep_files:
                measured.snapshot = snapshot
                lines.append(f"Snapshot: {_shown(snapshot)}")
                try:
                    from .api import report

                    measured.report = Path(
                        report(
                            snapshot,
                            output=snapshot.with_name(snapshot.name.removesuffix(".pickle") + ".html"),
                        )
                    )
                    lines.append(f"Report:   {_shown(measured.report)}")
                except Exception as exc:
                    lines.append(f"(no report: {exc})")
        return "\n".join(lines)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.results:
            return
        reporter = terminalreporter
        reporter.write_sep("=", "snaplab: CUDA memory peaks")
        rows = sorted(self.results, key=lambda measured: -max(measured.peaks.values(), default=0))
        for measured in rows[:30]:
            peak = max(measured.peaks.values(), default=0)
            verdict = "OVER" if measured.over else "ok"
            tail = (
                f"  report: {_shown(measured.report)}"
                if measured.report
                else (f"  snapshot: {_shown(measured.snapshot)}" if measured.snapshot else "")
            )
            limit = format_bytes(measured.limit_bytes)
            reporter.write_line(f"{verdict:4}  {format_bytes(peak):>11} / {limit:<11} {measured.nodeid}{tail}")
        if len(rows) > 30:
            reporter.write_line(f"... and {len(rows) - 30} more measured tests")


def _shown(path: Path | None) -> str:
    if path is None:
        return "—"
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return str(path)
    return rel if not rel.startswith("..") else str(path)


def peak_sites(
    snapshot: str | Path,
    device: int,
    limit: int = MAX_SITES,
) -> tuple[list[Any], int | None, int]:
    """The allocation sites live at the device's requested-bytes peak of the recorded trace,
    largest first, that peak, and the part of it allocated before the trace began; without a
    trace, the sites live at the dump, None and 0."""
    import numpy as np
    import pandas as pd

    from .api import load_frames
    from .metrics import compute_stats
    from .metrics.attribution.sites import alive_at, live_sites, snapshot_sites, top_sites
    from .metrics.categories import CATEGORIES, categorize
    from .metrics.history.lifetimes import device_lifetimes
    from .metrics.history.timeline import device_timeline

    frames = load_frames(snapshot)
    stats = compute_stats(frames)
    if device not in stats.devices:
        return [], None, 0
    torch_stats = stats.devices[device].torch_stats
    timeline = device_timeline(
        frames,
        device,
        torch_stats["requested_bytes.all.current"],
        torch_stats["reserved_bytes.all.current"],
    )
    sites = snapshot_sites(frames)
    if timeline is None:
        blocks = frames.blocks[frames.blocks["device"] == device]
        return live_sites(blocks, sites, limit), None, 0
    alive = alive_at(device_lifetimes(frames, device), timeline.peak_index)
    codes = categorize(frames).alloc_codes[device][alive.index.to_numpy()]
    cats = pd.Series(np.array(CATEGORIES, dtype=object)[codes], index=alive.index)
    before = timeline.peak_requested_bytes - int(alive["size_bytes"].sum())
    return (
        top_sites(
            alive["stack_id"],
            alive["size_bytes"],
            sites,
            limit,
            cats,
        ),
        timeline.peak_requested_bytes,
        before,
    )
