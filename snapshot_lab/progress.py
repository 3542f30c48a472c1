"""Progress on stderr for long work: a rich progress bar, silent when stderr is not a terminal
or when the user asked for ``--quiet``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class ProgressSink(Protocol):
    def stage(self, description: str, total: float | None = None) -> None: ...
    def update(self, completed: float) -> None: ...


class NullProgress:
    """Does nothing; the default for the Python API."""

    def stage(self, description: str, total: float | None = None) -> None:
        pass

    def update(self, completed: float) -> None:
        pass


class _RichProgress:
    def __init__(self, progress: object) -> None:
        self._p = progress
        self._task: object | None = None

    def stage(self, description: str, total: float | None = None) -> None:
        p = self._p
        if self._task is not None:
            p.update(self._task, completed=p.tasks[-1].total or 1, total=p.tasks[-1].total or 1)  # type: ignore[attr-defined]
        self._task = p.add_task(description, total=total)  # type: ignore[attr-defined]

    def update(self, completed: float) -> None:
        if self._task is not None:
            self._p.update(self._task, completed=completed)  # type: ignore[attr-defined]


@contextmanager
def progress_bar(quiet: bool = False) -> Iterator[ProgressSink]:
    """A progress sink on stderr; a no-op unless stderr is an interactive terminal."""
    if quiet or not sys.stderr.isatty():
        yield NullProgress()
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class _BytesWhenKnown(ProgressColumn):
        """Bytes read for the reading stage; nothing for stages without a size."""

        def __init__(self) -> None:
            super().__init__()
            self._bytes = DownloadColumn(binary_units=True)

        def render(self, task: Any) -> Any:
            return self._bytes.render(task) if task.total and task.total > 1 else Text("")

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        _BytesWhenKnown(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as p:
        yield _RichProgress(p)
