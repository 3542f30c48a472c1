"""The compiled allocator replay (``metrics/allocator/_replay.c``, issue #23) gives the results of
the pure-Python model (``metrics/allocator/model.py``, the reference) to the byte.

Every replay it runs is run here with both: the what-if scenarios, the planned programs and fit's
tape simulation, on every sample snapshot, and on made-up streams that reach each setting, caps
that run out of memory, expandable segments and sizes the engine refuses. When the extension is
not built, the compiled half is skipped and the Python model must be the one in use.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest

from snapshot_lab.metrics.allocator import native
from snapshot_lab.metrics.allocator.model import AllocatorSettings
from snapshot_lab.metrics.allocator.whatif import analyse_whatif, infer_memory_limit, quick_grid, recorded_settings
from snapshot_lab.metrics.fit.tape import NEVER, make_tape, simulate
from snapshot_lab.metrics.plan.program import MB_KEY, Program, replay

from .conftest import sample_names

MiB = 1 << 20
T = TypeVar("T")

compiled = pytest.mark.skipif(not native.available(), reason="the compiled replay is not built")

SETTINGS = {
    "default": AllocatorSettings(),
    "expandable": AllocatorSettings(expandable_segments=True),
    "max_split_64": AllocatorSettings(max_split_size=64 * MiB),
    "max_split_200_no_rounding": AllocatorSettings(max_split_size=200 * MiB, max_non_split_rounding=0),
    "max_split_21_no_rounding": AllocatorSettings(max_split_size=21 * MiB, max_non_split_rounding=0),
    "roundup_4": AllocatorSettings(roundup_power2_divisions=(4,) * 16),
    "roundup_mixed": AllocatorSettings(roundup_power2_divisions=(1, 2, 4, 8, 16, 3, 5, 0, 0, 0, 0, 0, 0, 0, 0, 7)),
    "gc_0.5": AllocatorSettings(garbage_collection_threshold=0.5),
    "gc_0.8_max_split_64": AllocatorSettings(garbage_collection_threshold=0.8, max_split_size=64 * MiB),
    "expandable_roundup_4": AllocatorSettings(expandable_segments=True, roundup_power2_divisions=(4,) * 16),
}
LIMITS = [None, 60 * MiB, 300 * MiB, 1 << 30]


def _both(monkeypatch: pytest.MonkeyPatch, run: Callable[[], T]) -> tuple[T, T]:
    """``run`` with the Python model, then with the compiled engine; the engine must have run
    everything (no fallback to the Python model on the way)."""
    monkeypatch.setenv(native.ENV_PURE_PYTHON, "1")
    python = run()
    monkeypatch.delenv(native.ENV_PURE_PYTHON)
    before = native.fallbacks()
    fast = run()
    assert native.fallbacks() == before, "the compiled engine gave up on a stream it should replay"
    return python, fast


def _same_replay(a: Any, b: Any) -> None:
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), name
        else:
            assert x == y, name


# --------------------------------------------------------------------------- which path is in use


def test_the_backend_says_which_path_is_in_use(monkeypatch):
    monkeypatch.delenv(native.ENV_PURE_PYTHON, raising=False)
    assert native.backend() == ("compiled" if native.available() else "pure-python")
    assert native.enabled() == native.available()
    monkeypatch.setenv(native.ENV_PURE_PYTHON, "1")
    assert native.backend() == "pure-python" and not native.enabled()
    assert native.engine(AllocatorSettings(), None) is None


def test_without_the_extension_the_python_model_runs(monkeypatch):
    """A machine with no compiler installs no extension: every replay runs in Python."""
    monkeypatch.setattr(native, "_compiled", None)
    monkeypatch.delenv(native.ENV_PURE_PYTHON, raising=False)
    assert not native.available() and native.backend() == "pure-python"
    assert native.engine(AllocatorSettings(), None) is None
    tape = make_tape(np.array([0, 1]), np.array([NEVER, 2]), np.array([3 * MiB, 5 * MiB]), np.zeros(2), "a")
    assert simulate(tape, 1.0, AllocatorSettings()).peak_reserved_bytes == 20 * MiB  # one segment serves both


# --------------------------------------------------------------------------- every sample


def _program_of(frames: Any, device: int) -> Program:
    """The recorded device's trace as a planned program: its allocations, frees, the frees a
    stream still held (free_requested) and an empty_cache() where it freed a segment."""
    ev = frames.events[frames.events["device"] == device]
    program = Program()
    source = program.source_id("activation", "recorded")
    rows = zip(
        ev["action"].astype(str).tolist(),
        ev["address"].fillna(-1).astype("int64").tolist(),
        ev["size_bytes"].fillna(0).astype("int64").tolist(),
        ev["stream"].fillna(0).astype("int64").tolist(),
        strict=True,
    )
    for i, (action, address, size, stream) in enumerate(rows):
        if action == "alloc":
            program.alloc(address, size, stream, source, i, size)
        elif action == "free_completed":
            program.free(address, i)
        elif action == "free_requested":
            program.free_requested(address, i)
        elif action == "segment_free":
            program.empty_cache(i)
    return program


def _tape_of(program: Program) -> Any:
    """The program's allocations as a fit tape: each alive from its allocation to its free."""
    start: dict[int, int] = {}
    rows: list[tuple[int, float, int, int]] = []
    for i, (kind, key) in enumerate(zip(program.kind, program.key, strict=True)):
        if kind == 0:
            if key in start:
                rows.append((start[key], i, program.size[start[key]], program.stream[start[key]]))
            start[key] = i
        elif kind == 1 and key in start:
            j = start.pop(key)
            rows.append((j, i, program.size[j], program.stream[j]))
    rows += [(j, NEVER, program.size[j], program.stream[j]) for j in start.values()]
    if not rows:
        rows = [(0, NEVER, 512, 0)]
    at, end, size, stream = (np.array(c) for c in zip(*rows, strict=True))
    sizes = size.astype(np.float64)
    return make_tape(at.astype(np.float64), end.astype(np.float64), sizes / 2, sizes / 2, "activation", stream)


@compiled
@pytest.mark.parametrize("name", sample_names())
def test_every_sample_replays_the_same_in_both(real_frames, monkeypatch, name):
    """What-if (the report's scenarios under the limit it infers), the trace replayed as a planned
    program (under the recorded settings, expandable segments and a cap at 3/4 of its peak) and as
    a fit tape at twice its batch: the same results, to the byte, from both engines."""
    frames = real_frames(name)
    device = int(frames.events["device"].min()) if len(frames.events) else 0
    base = recorded_settings(frames.info.allocator_settings)
    limit = infer_memory_limit(frames, device, None)
    scenarios = [base, *quick_grid(base, limit.bytes)]
    python, fast = _both(monkeypatch, lambda: analyse_whatif(frames, device, scenarios, limit.bytes, limit.is_cap))
    assert json.dumps(fast.to_dict(), sort_keys=True) == json.dumps(python.to_dict(), sort_keys=True)

    program = _program_of(frames, device)
    expandable = AllocatorSettings(expandable_segments=True)
    first, _ = _both(monkeypatch, lambda: replay(program, base))
    cap = first.peak_reserved_bytes * 3 // 4
    for settings, cap_or_none in ((base, None), (expandable, None), (base, cap), (expandable, cap)):
        python_r, fast_r = _both(monkeypatch, lambda s=settings, c=cap_or_none: replay(program, s, c, True))
        _same_replay(python_r, fast_r)

    tape = _tape_of(program)
    for settings, cap_or_none in ((base, None), (expandable, cap)):
        python_s, fast_s = _both(monkeypatch, lambda s=settings, c=cap_or_none: simulate(tape, 2.0, s, c))
        assert fast_s == python_s


# --------------------------------------------------------------------------- made-up streams


def _random_program(rng: np.random.Generator, count: int) -> Program:
    program = Program()
    sources = [program.source_id("activation", "a"), program.source_id("parameter", "p")]
    sizes = [100, 512, 4000, MiB, MiB + 1, 3 * MiB, 9 * MiB, 11 * MiB, 30 * MiB, 100 * MiB, 300 * MiB]
    live: list[int] = []
    for i in range(count):
        r = rng.random()
        if r < 0.5 or not live:
            key = int(rng.integers(60)) + int(rng.choice([0, MB_KEY]))
            size = int(rng.choice(sizes)) + int(rng.integers(-50, 50))
            program.alloc(key, size, int(rng.choice([0, 0, 3])), sources[i % 2], i, size)
            live.append(key)
        elif r < 0.85:
            program.free(live[int(rng.integers(len(live)))], i)
        elif r < 0.95:
            program.free_requested(live[int(rng.integers(len(live)))], i)
        else:
            program.empty_cache(i)
    return program


@compiled
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("limit", LIMITS)
def test_each_setting_and_cap_replays_the_same(monkeypatch, setting, limit):
    """Random programs reach every rule: splits, oversize blocks, rounding, garbage collection
    under a cap, releases and retries before an OOM, expandable segments mapped and unmapped."""
    rng = np.random.default_rng(abs(hash((setting, limit))) % (1 << 32))
    ooms = 0
    for trial in range(40):
        program = _random_program(rng, int(rng.integers(1, 400)))
        cap = bool(trial % 2)
        python, fast = _both(monkeypatch, lambda p=program, c=cap: replay(p, SETTINGS[setting], limit, c))
        _same_replay(python, fast)
        ooms += python.oom_at is not None
        tape = _tape_of(program)
        python_s, fast_s = _both(monkeypatch, lambda t=tape: simulate(t, 1.5, SETTINGS[setting], limit))
        assert fast_s == python_s
    if limit == 60 * MiB:
        assert ooms > 0  # the small cap runs out of memory: the OOM path is compared too


def _leaky_program(rng: np.random.Generator, count: int) -> Program:
    """A job that keeps most of what it allocates, asks for more each time and frees the rest at
    random: the holes it leaves are too small for what comes next, so the pools hold thousands of
    free blocks between live ones, as in a recording of a leak."""
    program = Program()
    source = program.source_id("activation", "a")
    live: list[int] = []
    for i in range(count):
        if live and rng.random() < 0.4:
            program.free(live.pop(int(rng.integers(len(live)))), i)
        elif i % 2500 == 2499:
            program.empty_cache(i)
        else:
            size = (i // 4 + 1) * 512 + int(rng.integers(0, 400)) + int(rng.choice([0, 0, 0, 2 * MiB, 22 * MiB]))
            program.alloc(i, size, int(rng.choice([0, 0, 0, 5])), source, i, size)
            live.append(i)
    return program


def _engine_after(program: Program, settings: AllocatorSettings, limit: int | None = None) -> Any:
    """The compiled engine once it has run the whole program (the limit a cap)."""
    engine = native.engine(settings, limit, limit_is_cap=True)
    assert engine is not None
    count = len(program)
    columns = (program.kind, program.key, program.size, program.stream, np.arange(count))
    zeros = [np.zeros(count, dtype=np.int64) for _ in range(2)]
    engine.run(*[native.column(c) for c in columns], *zeros)
    return engine


def _free_blocks_after(program: Program, settings: AllocatorSettings) -> int:
    layout = _engine_after(program, settings).layout()
    return sum(not allocated for chain in layout for _size, allocated in chain)


@compiled
@pytest.mark.parametrize("setting", ["default", "expandable", "max_split_21_no_rounding", "gc_0.8_max_split_64"])
def test_pools_of_thousands_of_free_blocks_replay_the_same(monkeypatch, setting):
    """The engine's pools are search trees threaded through the blocks: deep ones, with blocks
    entering and leaving at every depth, keep the Python model's order exactly."""
    program = _leaky_program(np.random.default_rng(23), 20_000)
    assert _free_blocks_after(program, SETTINGS[setting]) > 1_000
    first, _ = _both(monkeypatch, lambda: replay(program, SETTINGS[setting]))
    for cap in (None, first.peak_reserved_bytes * 2 // 3):
        python, fast = _both(monkeypatch, lambda c=cap: replay(program, SETTINGS[setting], c, True))
        _same_replay(python, fast)
        assert (python.oom_at is not None) == (cap is not None)
    tape = _tape_of(program)
    python_s, fast_s = _both(monkeypatch, lambda: simulate(tape, 1.0, SETTINGS[setting], None))
    assert fast_s == python_s


@compiled
def test_a_release_walks_down_a_pool_of_hundreds_of_oversize_blocks(monkeypatch):
    """Under a cap, a request larger than every cached block makes the allocator give back the
    oversize blocks from the largest down until enough is freed: the walk crosses the pool from
    end to middle, and both replays release the same blocks."""
    program = Program()
    source = program.source_id("activation", "a")
    sizes = [22 * MiB + 2 * MiB * k for k in range(300)]
    for k, size in enumerate(sizes):
        program.alloc(k, size, 0, source, k, size)
    for k in range(300):
        program.free(k, 300 + k)
    program.alloc(1000, 75 << 30, 0, source, 600, 75 << 30)
    settings = SETTINGS["max_split_21_no_rounding"]
    python, fast = _both(monkeypatch, lambda: replay(program, settings, sum(sizes), True))
    _same_replay(python, fast)
    assert python.oom_at is None
    released = list(itertools.accumulate(reversed(sizes)))
    given_back = next(total for total in released if total >= 75 << 30)  # the largest first, no more
    stats = native.stats_of(_engine_after(program, settings, sum(sizes)))
    assert stats.alloc_retries == 0  # enough came back without emptying the cache
    assert stats.reserved_bytes == sum(sizes) - given_back + (75 << 30)
    assert stats.cuda_free_calls == released.index(given_back) + 1 > 128  # more than one chunk's keys


@compiled
def test_sizes_the_engine_refuses_fall_back_to_python(monkeypatch):
    """A size out of the engine's range (from an untrusted file) is replayed by the Python model,
    with the same answer; negative and zero sizes are the allocator's smallest block."""
    program = Program()
    source = program.source_id("activation", "a")
    for i, size in enumerate([-5, 0, 1 << 62, 7]):
        program.alloc(i, size, 0, source, i, max(size, 0))
    monkeypatch.setenv(native.ENV_PURE_PYTHON, "1")
    python = replay(program, AllocatorSettings())
    monkeypatch.delenv(native.ENV_PURE_PYTHON)
    before = native.fallbacks()
    fast = replay(program, AllocatorSettings())
    assert native.fallbacks() == before + 1
    _same_replay(python, fast)
    assert python.peak_allocated_bytes == (1 << 62) + 3 * 512


@compiled
def test_the_engine_checks_its_inputs(monkeypatch):
    """Columns of the wrong type or length, an unknown operation and a size out of range are
    refused with a Python exception (never a crash)."""
    monkeypatch.delenv(native.ENV_PURE_PYTHON, raising=False)
    engine = native.engine(AllocatorSettings(), None)
    assert engine is not None
    ops = [native.column([native.ALLOC]), native.column([1]), native.column([1 << 60]), native.column([0])]
    with pytest.raises(native.Unsupported):
        engine.run(*ops, native.column([0]), None, None)
    with pytest.raises(ValueError):
        engine.run(*ops, native.column([0, 1]), None, None)  # columns of different lengths
    with pytest.raises(TypeError):
        engine.run(*ops[:3], np.zeros(1, dtype=np.float64), native.column([0]), None, None)
    bad = native.column([99])
    with pytest.raises(ValueError):
        engine.run(bad, *ops[1:], native.column([0]), None, None)
