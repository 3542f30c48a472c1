"""What every framework callback does, whatever the framework: one recording per training run.

Start (once the framework knows the model), count optimizer steps, stop at the end of training or
on an exception, then optionally write the HTML report of the last snapshot beside it. Nothing in
here may stop a training job: without CUDA, or when a dump or the report fails, it logs and goes on.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import types
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..capture import (
    DEFAULT_OUT_DIR,
    CaptureError,
    CaptureOptions,
    recording,
    with_capture_options,
)
from ..module_tags import ModuleTags, tag_modules

log = logging.getLogger("snapshot_lab.integrations")


class CaptureSession:
    """One ``recording`` per training run, driven by a framework's callback hooks."""

    def __init__(
        self,
        out: str | os.PathLike[str] = DEFAULT_OUT_DIR,
        *,
        report: bool = False,
        **options: Any,
    ) -> None:
        """The options are :class:`~snapshot_lab.capture.CaptureOptions`' fields, as keywords
        (bad ones fail here, when the callback is made); ``report``: write the HTML report of the
        last snapshot."""
        self.options = CaptureOptions(**options)
        self.out = Path(out)
        self.report = report
        self.rec: recording | None = None
        self.tags: ModuleTags | None = None
        self.written: list[Path] = []  # snapshots of every run of this callback
        self.reports: list[Path] = []
        self.disabled: str | None = None  # why nothing is recorded (no CUDA...)
        self._atexit = False

    # help() and inspect.signature() list the options one by one, with their defaults
    __init__.__signature__ = with_capture_options(__init__)  # type: ignore[attr-defined]

    @classmethod
    def from_options(
        cls, out: str | os.PathLike[str], options: CaptureOptions, *, report: bool = False
    ) -> CaptureSession:
        """A session recording with ``options`` (what the framework callbacks build)."""
        return cls(out, **asdict(options), report=report)

    @property
    def active(self) -> bool:
        return self.rec is not None

    def start(self, model: Any = None) -> None:
        """Begin recording (a no-op when already recording)."""
        if self.rec is not None:
            return
        rec = recording.from_options(self.out, self.options)
        try:
            rec.__enter__()
        except CaptureError as exc:
            self.disabled = exc.message()
            log.warning("snaplab: not recording GPU memory: %s", self.disabled)
            return
        self.rec = rec
        self.disabled = None
        if self.options.tag_modules and model is not None:
            self.tags = tag_modules(model)
        # a run that dies without telling its callbacks still leaves a snapshot
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True

    def saw_batch_size(self, *holders: Any) -> None:
        """The batch size the framework knows (the first readable ``batch_size`` of ``holders``:
        a dataloader, a datamodule, hyperparameters...), for the sidecar; the ``batch_size``
        option, when given, wins. A no-op when not recording or when none is readable."""
        if self.rec is None or self.options.batch_size is not None:
            return
        found = readable_batch_size(*holders)
        if found is not None:
            self.rec.batch_size = found

    def step(self) -> None:
        """One optimizer step (dumps every ``every_n_steps``)."""
        if self.rec is not None:
            self.rec.step()

    def stop(self, exception: BaseException | None = None) -> Path | None:
        """Dump the final snapshot (``_exception`` with one), stop recording, write the report if
        asked; returns the report's path, if one was written. A no-op when not recording."""
        rec = self.rec
        if rec is None:
            return None
        self.rec = None
        if self.tags is not None:
            self.tags.remove()
            self.tags = None
        exc_tb: types.TracebackType | None = exception.__traceback__ if exception is not None else None
        try:
            rec.__exit__(type(exception) if exception is not None else None, exception, exc_tb)
        except Exception as exc:
            # recording never raises from a dump; this is belt and braces
            log.warning("snaplab: stopping the recording failed: %s", exc)
        self.written.extend(rec.written)
        return self.write_report(rec.written)

    def write_report(self, written: list[Path]) -> Path | None:
        if not self.report or not written:
            return None
        snapshot = written[-1]
        output = snapshot.with_name(snapshot.name.removesuffix(".pickle") + ".html")
        try:
            from ..api import report

            path = Path(report(snapshot, output=output))
        except Exception as exc:
            # the training finished: a report that fails must not fail it
            log.warning("snaplab: could not write the report of %s: %s", snapshot, exc)
            return None
        self.reports.append(path)
        log.info("snaplab: wrote %s", path)
        return path


def readable_batch_size(*holders: Any) -> int | None:
    """The first ``batch_size`` of ``holders`` (an attribute or a mapping's key) that is a
    positive int; reading never fails (a property that raises counts as unreadable)."""
    for holder in holders:
        try:
            value = holder.get("batch_size") if isinstance(holder, dict) else getattr(holder, "batch_size", None)
        except Exception:  # a framework property that cannot answer yet
            continue
        if type(value) is int and value > 0:
            return value
    return None


class SessionCallback:
    """What the framework callbacks share: their options (those of :class:`CaptureSession`:
    :class:`~snapshot_lab.capture.CaptureOptions`' and ``report``), one :class:`CaptureSession`,
    and what it wrote."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.session = CaptureSession(*args, **kwargs)

    # help() and inspect.signature() show the session's keywords and their docs
    functools.update_wrapper(__init__, CaptureSession.__init__, assigned=("__doc__",))

    @property
    def written(self) -> list[Path]:
        """Every snapshot written so far (all ranks write their own, named by rank)."""
        return list(self.session.written)

    @property
    def reports(self) -> list[Path]:
        """The HTML reports written (with ``report=True``)."""
        return list(self.session.reports)
