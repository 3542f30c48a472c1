"""Work done in a second process while this one goes on (issue #23: the report's wall time).

The report needs ``snaplab fit``'s answer only at its end, and the answer depends on nothing the
report computes on the way, so it can run beside the rest. :class:`Aside` forks a child that
computes it from the frames this process already holds (copy-on-write: nothing is pickled on the
way in) and sends the value back through a pipe; :meth:`Aside.result` waits for it.

Where a second process would not help or cannot be had (one CPU, no ``fork`` on the platform,
``SNAPLAB_JOBS=1``) or the child fails in any way (raises, dies, sends something that does not
unpickle), the value is computed here, when asked for: the answer is the same either way, and an
error is raised by this process, as it would have been without the child.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

T = TypeVar("T")

JOBS_VARIABLE = "SNAPLAB_JOBS"


def cpus() -> int:
    """CPUs this process may run on (its affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def may_fork() -> bool:
    """Whether work may go to a forked child: ``fork`` exists, there are two CPUs or more, and
    ``SNAPLAB_JOBS`` does not say 1."""
    jobs = os.environ.get(JOBS_VARIABLE, "").strip()
    if jobs.isdigit() and int(jobs) <= 1:
        return False
    return "fork" in mp.get_all_start_methods() and cpus() > 1


class Aside(Generic[T]):
    """``fn()``, computed in a forked child from now on, or here at :meth:`result`."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._done = False
        self._value: T | None = None
        self._child: Any = None
        self._conn: Connection | None = None
        if may_fork():
            self._start()

    @property
    def forked(self) -> bool:
        """Whether a child is computing the value (or did)."""
        return self._child is not None

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_run_child, args=(self._fn, send), daemon=True)
        try:
            with warnings.catch_warnings():
                # Python 3.12+ warns about fork in a threaded process (a progress bar's refresh
                # thread): the child only computes and writes to its pipe, it takes no lock
                warnings.simplefilter("ignore", DeprecationWarning)
                child.start()
        except OSError:
            receive.close()
            send.close()
            return
        send.close()
        self._child, self._conn = child, receive

    def result(self) -> T:
        """The value: the child's when it sent one, else computed here."""
        if not self._done:
            sent, value = self._from_child() if self._conn is not None else (False, None)
            self._value = value if sent else self._fn()
            self._done = True
        return self._value  # type: ignore[return-value]

    def _from_child(self) -> tuple[bool, Any]:
        """(True, the child's value), or (False, None) where it sent none."""
        assert self._conn is not None
        try:
            sent, value = self._conn.recv()
        except Exception:  # died, or sent something that does not unpickle
            sent, value = False, None
        finally:
            self._conn.close()
            self._conn = None
            self._child.join()
        return bool(sent), value


def _run_child(fn: Callable[[], Any], send: Connection) -> None:
    """The child's whole life: nothing it does reaches stderr; any failure sends (False, None)
    and the parent computes the value again, raising the error itself."""
    try:
        message: tuple[bool, Any] = (True, fn())
    except BaseException:
        message = (False, None)
    try:
        send.send(message)
    except BaseException:  # the value does not pickle
        with contextlib.suppress(BaseException):
            send.send((False, None))
    finally:
        send.close()
