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
import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
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
    """Whether work may go to a forked child: ``fork`` exists, there are two CPUs or more,
    ``SNAPLAB_JOBS`` does not say 1 (:func:`workers`), and this process is no daemon (which may not
    have children)."""
    if mp.current_process().daemon:  # itself a worker (an Aside's child, Dask's): it may have none
        return False
    return "fork" in mp.get_all_start_methods() and workers() > 1


def workers() -> int:
    """How many processes :func:`spread` may use: ``SNAPLAB_JOBS`` where it names a number (1:
    this one alone), else every CPU this process may run on."""
    jobs = os.environ.get(JOBS_VARIABLE, "").strip()
    if jobs.isdigit():
        return max(1, min(int(jobs), cpus()))
    return cpus()


def one_process() -> None:
    """From now on this process computes everything itself (no :class:`Aside` child): for a
    process pool's worker, the pool having spread the work over the CPUs already."""
    os.environ[JOBS_VARIABLE] = "1"


def _started(target: Callable[..., None], args: tuple[Any, ...]) -> Any:
    """A daemon child forked to run ``target(*args)``, started; None where it could not be."""
    child = mp.get_context("fork").Process(target=target, args=args, daemon=True)
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork in a threaded process (a progress bar's refresh
            # thread, a worker's reader): the child only computes and writes to its pipe
            warnings.simplefilter("ignore", DeprecationWarning)
            child.start()
    except OSError:
        return None
    return child


class Aside(Generic[T]):
    """``fn()``, computed in a forked child from now on, or here at :meth:`result`. ``first``:
    called in the child alone, before ``fn`` (what the child may drop of this process's state,
    which ``fn`` does not read, so that its memory is the child's no more)."""

    def __init__(self, fn: Callable[[], T], first: Callable[[], None] | None = None) -> None:
        self._fn = fn
        self._first = first
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
        receive, send = mp.get_context("fork").Pipe(duplex=False)
        child = _started(_run_child, (self._fn, send, self._first))
        send.close()
        if child is None:
            receive.close()
            return
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


class Beside(Generic[T]):
    """``fn()``, computed by a thread of this process from now on: for work that spends its time
    outside the interpreter's lock (reading a file, hashing it), beside the rest.
    :meth:`result` waits for it and raises what ``fn`` raised."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # raised by result(), in the caller's thread
            self._error = exc

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def _silenced() -> None:
    """A child's standard streams go to the null device, as new objects: a thread of the parent
    (a progress bar's refresh) may have held the old ones' locks when it forked, and a warning
    the child prints (matplotlib building its font cache) would wait on them forever."""
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the child's until it exits)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115


def _run_child(fn: Callable[[], Any], send: Connection, first: Callable[[], None] | None = None) -> None:
    """The child's whole life: nothing it does reaches stderr; any failure sends (False, None)
    and the parent computes the value again, raising the error itself."""
    _silenced()
    try:
        if first is not None:
            first()
        message: tuple[bool, Any] = (True, fn())
    except BaseException:
        message = (False, None)
    try:
        _send(send, message, (False, None))
    finally:
        send.close()


def _send(conn: Connection, message: tuple[Any, ...], instead: tuple[Any, ...]) -> None:
    """``message`` to the parent, else (a value that does not pickle) ``instead``: not done."""
    try:
        conn.send(message)
    except BaseException:
        with contextlib.suppress(BaseException):
            conn.send(instead)


class Worker:
    """A forked child, started now, that imports ``module`` while this process goes on (the
    report's figures: matplotlib, imported while the snapshot is read), then runs
    ``module.<name>(*args)`` for each :meth:`submit`, in order. A thread here collects what it
    sends back, so it never waits for this process to read. Where no child can be had, or it
    fails at a job (raises, dies, sends what does not unpickle), the job is computed here at
    :meth:`result`: the same value either way, and an error raised here."""

    def __init__(self, module: str) -> None:
        self._module = module
        self._jobs: list[tuple[str, tuple[Any, ...]]] = []
        self._sent: dict[int, tuple[bool, Any]] = {}
        self._arrived = threading.Condition()
        self._child: Any = None
        self._to_child: Connection | None = None
        self._reader: threading.Thread | None = None
        # jobs, pickled, for the sender thread (None: no more): a write to the child's pipe
        # waits while the child draws, and this process has its own work to do meanwhile
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        if may_fork():
            self._start()

    @property
    def forked(self) -> bool:
        return self._child is not None

    def _start(self) -> None:
        jobs_in, jobs_out = mp.get_context("fork").Pipe(duplex=False)
        results_in, results_out = mp.get_context("fork").Pipe(duplex=False)
        child = _started(_serve, (self._module, jobs_in, results_out, (jobs_out, results_in)))
        jobs_in.close()
        results_out.close()
        if child is None:
            jobs_out.close()
            results_in.close()
            return
        self._child, self._to_child = child, jobs_out
        self._reader = threading.Thread(target=self._read, args=(results_in,), daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_jobs, args=(jobs_out,), daemon=True)
        self._sender.start()

    def _send_jobs(self, jobs: Connection) -> None:
        """The sender thread: each job the outbox holds to the child, in order, until None; where
        a write fails (the child is gone) the jobs not yet answered are computed here."""
        while (data := self._outbox.get()) is not None:
            try:
                jobs.send_bytes(data)
            except Exception:
                with self._arrived:
                    self._to_child = None
                    self._arrived.notify_all()
                break
        jobs.close()

    def _read(self, results: Connection) -> None:
        """The reader thread: every (job, sent, value) the child sends, until it closes its end."""
        try:
            while True:
                job, sent, value = results.recv()
                with self._arrived:
                    self._sent[job] = (bool(sent), value)
                    self._arrived.notify_all()
        except Exception:  # the child closed its end, died, or sent what does not unpickle
            pass
        finally:
            results.close()
            with self._arrived:
                self._reader = None
                self._arrived.notify_all()

    def submit(self, name: str, *args: Any) -> int:
        """Ask for ``module.<name>(*args)``; returns the job for :meth:`result`."""
        job = len(self._jobs)
        self._jobs.append((name, args))
        if self._to_child is not None:
            try:  # pickled now, as the arguments are at this moment; sent by the sender thread
                self._outbox.put(bytes(ForkingPickler.dumps((job, name, args))))
            except Exception:  # the arguments do not pickle: this and later jobs computed here
                self._close_outbox()
        return job

    def _close_outbox(self) -> None:
        """No more jobs to the child: the sender thread sends those queued, then closes the pipe."""
        with self._arrived:
            self._to_child = None
            self._arrived.notify_all()
        self._outbox.put(None)

    def result(self, job: int) -> Any:
        """The value of a job: the child's when it sent one, else computed here."""
        with self._arrived:
            while job not in self._sent and self._reader is not None and self._to_child is not None:
                self._arrived.wait()
            sent, value = self._sent.pop(job, (False, None))
        if sent:
            return value
        name, args = self._jobs[job]
        return getattr(importlib.import_module(self._module), name)(*args)

    def close(self) -> None:
        """Let the child go (it ends when its job pipe closes)."""
        if self._to_child is not None:
            self._close_outbox()
        if self._sender is not None:
            self._sender.join(timeout=5)
            self._sender = None
        if self._child is not None:
            self._child.join(timeout=5)


def _serve(module: str, jobs: Connection, results: Connection, parents: tuple[Connection, ...]) -> None:
    """The worker's whole life: import, then answer every job until the pipe closes; nothing it
    does reaches stderr, and a job that fails is sent back as not done. It first closes its copies
    of the parent's ends (``parents``): its own write end would keep it waiting for jobs forever."""
    _silenced()
    for end in parents:
        end.close()
    try:
        target: Any = importlib.import_module(module)
    except BaseException:
        target = None
    while True:
        try:
            job, name, args = jobs.recv()
        except BaseException:  # the parent closed its end: no more jobs
            break
        try:
            message: tuple[int, bool, Any] = (job, True, getattr(target, name)(*args))
        except BaseException:
            message = (job, False, None)
        _send(results, message, (job, False, None))
    results.close()


# --------------------------------------------------------------------------- spread


def spread(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Each of ``jobs`` computed, in order, over up to :func:`workers` processes: this one takes
    jobs 0, n, 2n..., a child forked for each other share takes its own (copy-on-write: nothing is
    pickled on the way in). Children are forked with ``os.fork``, so an :class:`Aside`'s child
    (a daemon) may spread its work too. A job a child could not send back (it raised, the child
    died, the value does not pickle) is computed here: the values, and the first error raised, are
    those of computing the jobs in turn. For pure jobs of a second or more (allocator replays)."""
    n = min(len(jobs), workers(), _room_for()) if _may_spread() else 1
    if n <= 1:
        return [job() for job in jobs]
    children = [child for child in (_fork_share(jobs, k, n) for k in range(1, n)) if child is not None]
    sent: dict[int, Any] = {}
    errors: dict[int, Exception] = {}
    try:
        for i in range(0, len(jobs), n):
            try:
                sent[i] = jobs[i]()
            except Exception as exc:  # raised below, in the jobs' order
                errors[i] = exc
        while children:
            sent.update(_collect(*children[0]))
            children.pop(0)
    except BaseException:  # interrupted: the children's work is wanted no more
        _kill(children)
        raise
    out = []
    for i, job in enumerate(jobs):
        if i in errors:
            raise errors[i]
        out.append(sent[i] if i in sent else job())
    return out


def _room_for() -> int:
    """How many processes the memory available allows: this one, and a child for each time what
    it holds now fits in ``HEADROOM`` of the memory available (a child may come to need as much as
    its parent: fit's levers at 5M trace entries each built about a quarter of it); every CPU's
    where the system does not say (:func:`~.sizing.available_memory`, this process's RSS)."""
    from .sizing import HEADROOM, available_memory

    available, held = available_memory(), _resident_bytes()
    if available is None or not held:
        return sys.maxsize
    return 1 + int(available * HEADROOM) // held


def _resident_bytes(statm: str = "/proc/self/statm") -> int | None:
    """This process's resident memory in bytes (Linux), or None where the system does not say."""
    try:
        with open(statm) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _may_spread() -> bool:
    """Whether :func:`spread` may fork: as :func:`may_fork`, but a daemon may (``os.fork`` is not
    multiprocessing's, which refuses a daemon children)."""
    return hasattr(os, "fork") and "fork" in mp.get_all_start_methods() and workers() > 1


def _fork_share(jobs: Sequence[Callable[[], Any]], k: int, n: int) -> tuple[int, int] | None:
    """A child forked to compute jobs k, k + n, ...: (its pid, the pipe's end to read them from);
    None where it could not be forked."""
    read, write = os.pipe()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process: see _started
            pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        return None
    if pid == 0:  # the child: never returns to the caller's stack
        status = 1
        try:
            os.close(read)
            _silenced()
            _write_share(write, jobs, k, n)
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    return pid, read


def _write_share(fd: int, jobs: Sequence[Callable[[], Any]], k: int, n: int) -> None:
    """In the child: each of its jobs' values that could be computed and pickled, as one pickle
    of {job: value}, to ``fd``."""
    values: dict[int, bytes] = {}
    for i in range(k, len(jobs), n):
        with contextlib.suppress(Exception):  # an interrupt ends the child: the parent computes its share
            values[i] = bytes(ForkingPickler.dumps(jobs[i]()))
    data = memoryview(ForkingPickler.dumps(values))
    while data:
        data = data[os.write(fd, data) :]
    os.close(fd)


def _collect(pid: int, fd: int) -> dict[int, Any]:
    """The values a child sent ({} where it sent nothing whole), once it has exited."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    os.waitpid(pid, 0)
    out = {}
    try:
        values = ForkingPickler.loads(b"".join(chunks))
        for i, value in values.items():
            with contextlib.suppress(Exception):
                out[i] = ForkingPickler.loads(value)
    except Exception:  # the child died before it wrote the whole pickle
        return {}
    return out


def _kill(children: list[tuple[int, int]]) -> None:
    """Children not collected yet, killed and reaped (their pipes closed)."""
    for pid, fd in children:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
