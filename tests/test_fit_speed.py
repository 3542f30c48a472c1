"""fit's replay made faster (issue #23) gives what it gave before: the operations' order is the
lexsort of (position, free after allocation) it was, shared by tapes with the same positions; the
compiled engine's ``run_tape`` (the tape by row) answers as the Python model and as the engine's
general ``run`` over the same stream; a replay is memoised per engine, so a test comparing the two
engines still runs both.

Real cases: the tapes of ``fit_gpt2_b4_complete_python`` (a whole step, with its blocks) and
``fit_resnet50_b512_oom_python`` (extrapolated from a forward that ran out of memory, so its
positions are fractional and tie at the start); ``test_native_replay`` compares every sample and
made-up streams under every setting.
"""

from __future__ import annotations

import numpy as np
import pytest

from snapshot_lab.metrics.allocator import native
from snapshot_lab.metrics.allocator.model import AllocatorSettings
from snapshot_lab.metrics.fit import levers as lv
from snapshot_lab.metrics.fit.model import step_evidence
from snapshot_lab.metrics.fit.tape import NEVER, Tape, make_tape, ordered_ops, simulate

compiled = pytest.mark.skipif(not native.available(), reason="the compiled replay is not built")
CASES = [("fit_gpt2_b4_complete_python", None), ("fit_resnet50_b512_oom_python", "sgd-momentum")]


def _lexsorted(tape: Tape) -> tuple[np.ndarray, np.ndarray]:
    """The order as it was defined: allocations then frees, sorted by position, then kind."""
    rows = np.arange(len(tape))
    freed = np.isfinite(tape.end)
    pos = np.r_[tape.start, tape.end[freed]]
    kind = np.r_[np.zeros(len(tape), dtype=np.int64), np.ones(int(freed.sum()), dtype=np.int64)]
    which = np.r_[rows, rows[freed]]
    order = np.lexsort((kind, pos))
    return which[order], kind[order].astype(bool)


@pytest.mark.parametrize(("name", "optimizer"), CASES)
def test_the_order_is_the_lexsort_for_every_lever(real_frames, name, optimizer):
    ev = step_evidence(real_frames(name), 0, optimizer)
    tapes = [ev.tape, lv.bf16_autocast(ev.tape, ev)]
    if ev.blocks:
        tapes.append(lv.checkpoint(ev.tape, ev.blocks))
    for tape in tapes:
        which, is_free = ordered_ops(tape)
        expected_which, expected_free = _lexsorted(tape)
        assert which.dtype == expected_which.dtype and np.array_equal(which, expected_which)
        assert is_free.dtype == expected_free.dtype and np.array_equal(is_free, expected_free)
    positions = np.r_[tape.start, tape.end[np.isfinite(tape.end)]]
    assert np.unique(positions).size < positions.size  # ties, broken by kind and row


def test_ties_keep_rows_in_order_and_allocations_first():
    """Three rows at one position, one freed where another is allocated: allocations first, rows
    in order among equals."""
    tape = make_tape(
        np.array([0.0, 0.0, 0.0, 1.0]), np.array([1.0, NEVER, 1.0, 2.0]), np.full(4, 512.0), np.zeros(4), "activation"
    )
    which, is_free = ordered_ops(tape)
    assert which.tolist() == [0, 1, 2, 3, 0, 2, 3]
    assert is_free.tolist() == [False, False, False, False, True, True, True]


def test_a_tape_rescaled_shares_its_order():
    """A lever that only rescales sizes keeps the position arrays: the order is sorted once."""
    tape = make_tape(np.arange(5.0), np.arange(5.0) + 2, np.full(5, 512.0), np.ones(5), "activation")
    half = tape.scaled(np.array([True, False, True, False, True]), 0.5)
    assert ordered_ops(half)[0] is ordered_ops(tape)[0]
    moved = make_tape(np.arange(5.0), np.arange(5.0) + 3, np.full(5, 512.0), np.ones(5), "activation")
    assert ordered_ops(moved)[0] is not ordered_ops(tape)[0]


def test_a_tapes_names_are_one_byte_a_row():
    """A category or phase (given as one string or as an array of names) is held as one byte a
    row: as an object array it cost a pointer a row (8 bytes; 16 of a tape's 65 bytes a row)."""
    tape = make_tape(np.arange(1000.0), np.arange(1000.0) + 1, np.full(1000, 512.0), np.zeros(1000), "activation")
    assert tape.category.codes.nbytes == 1000 and tape.phase.codes.nbytes == 1000
    assert set(tape.category) == {"activation"} and set(tape.phase) == {"forward"}
    assert tape.stream.tolist() == [0] * 1000 and tape.block.tolist() == [-1] * 1000
    names = np.array(["gradient", "parameter"] * 500, dtype=object)
    given = make_tape(np.arange(1000.0), np.arange(1000.0) + 1, np.full(1000, 512.0), np.zeros(1000), names)
    assert given.category.codes.nbytes == 1000 and given.category.tolist() == names.tolist()


def test_labels_answer_as_the_array_of_names_did():
    """Each question the fit's code asks of a tape's category or phase, asked of the labels and of
    the object array they replace, on rows whose names differ between the parts joined."""
    from snapshot_lab.metrics.fit.labels import Labels

    first = np.array(["forward", "backward", "forward", "step"], dtype=object)
    second = np.array(["data", "forward"], dtype=object)
    joined = Labels.concat([Labels.of(first, 4), Labels.of(second, 2), Labels.of("backward", 3)])
    names = np.concatenate([first, second, np.array(["backward"] * 3, dtype=object)])
    assert joined.tolist() == names.tolist() and len(joined) == joined.size == 9
    for name in ("forward", "backward", "data", "step", "setup"):
        assert (joined == name).tolist() == (names == name).tolist()
        assert (joined != name).tolist() == (names != name).tolist()
    assert joined.isin(["data", "step", "setup"]).tolist() == np.isin(names, ["data", "step", "setup"]).tolist()
    rows = np.array([8, 0, 4])
    assert joined[rows].tolist() == ["backward", "forward", "data"]
    assert joined[names == "forward"].tolist() == ["forward"] * 3
    assert np.asarray(joined).tolist() == names.tolist() and np.asarray(joined).dtype == object
    assert np.isin(joined, ["step"]).tolist() == (names == "step").tolist()  # read as an array: the names
    twice = Labels(np.array([0, 1, 2, 3], dtype=np.int8), ("input", "activation", "workspace", "activation"))
    assert (twice == "activation").tolist() == [False, True, False, True] and twice.isin(["activation"]).sum() == 2
    assert twice.tolist() == ["input", "activation", "workspace", "activation"]


@compiled
@pytest.mark.parametrize(("name", "optimizer"), CASES)
def test_run_tape_answers_as_the_engines_general_run(real_frames, monkeypatch, name, optimizer):
    """The same replay through ``run`` (one key per row, every column gathered per operation),
    under a cap that stops it part way and without one."""
    monkeypatch.delenv(native.ENV_PURE_PYTHON, raising=False)
    ev = step_evidence(real_frames(name), 0, optimizer)
    sizes = ev.tape.sizes(2.0)
    which, is_free = ordered_ops(ev.tape)
    made = sizes[which] > 0
    ops = (np.where(is_free[made], native.FREE, native.ALLOC_KEEP), which[made], sizes[which[made]])
    stream = ev.tape.stream[which[made]]
    free_run = simulate(ev.tape, 2.0, AllocatorSettings()).peak_reserved_bytes
    for limit in (None, free_run // 2):
        by_row = native.engine(AllocatorSettings(), limit, limit_is_cap=True, top_down=True)
        general = native.engine(AllocatorSettings(), limit, limit_is_cap=True, top_down=True)
        stop = by_row.run_tape(which, is_free, sizes, native.column(ev.tape.stream))
        stop_general, _, _ = general.run(
            *(native.column(c) for c in (*ops, stream)), native.column(-np.ones(made.sum())), None, None
        )
        assert (stop >= 0) == (stop_general >= 0) == (limit is not None)
        assert by_row.stats()[:8] == general.stats()[:8]


@compiled
def test_run_tape_checks_its_inputs(monkeypatch):
    """A row out of range, columns of the wrong length or type: a Python exception, never a crash."""
    monkeypatch.delenv(native.ENV_PURE_PYTHON, raising=False)
    engine = native.engine(AllocatorSettings(), None)
    assert engine is not None
    which, is_free = native.column([0, 0]), np.array([False, True])
    size, stream = native.column([4096]), native.column([0])
    assert engine.run_tape(which, is_free, size, stream) == -1
    with pytest.raises(ValueError):
        engine.run_tape(native.column([0, 1]), is_free, size, stream)  # row 1 of 1
    with pytest.raises(ValueError):
        engine.run_tape(which, is_free, size, native.column([0, 0]))  # a stream per row
    with pytest.raises(TypeError):
        engine.run_tape(which, np.array([0, 1]), size, stream)  # flags as int64
    with pytest.raises(TypeError):
        engine.run_tape(which, is_free, size.astype(np.float64), stream)
    with pytest.raises(native.Unsupported):
        engine.run_tape(native.column([0]), np.array([False]), native.column([1 << 60]), stream)


@compiled
def test_each_engine_replays_a_tape_once(monkeypatch):
    """The replay is kept per engine: switching to the Python model replays again (and agrees)."""
    monkeypatch.delenv(native.ENV_PURE_PYTHON, raising=False)
    tape = make_tape(np.arange(6.0), np.arange(6.0) + 2.5, np.full(6, 3 << 20), np.zeros(6), "activation")
    fast = simulate(tape, 1.0, AllocatorSettings())
    assert simulate(tape, 1.0, AllocatorSettings()) is fast
    monkeypatch.setenv(native.ENV_PURE_PYTHON, "1")
    python = simulate(tape, 1.0, AllocatorSettings())
    assert python is not fast and python == fast
    assert fast.peak_allocated_bytes == 3 * (3 << 20)


def _doubled(value, limit: int) -> int:
    """The search the boundary replaced: doubling, then bisection."""
    from snapshot_lab.metrics.fit.search import MAX_UNITS

    lo, hi = 1, 2
    while hi < MAX_UNITS and value(hi) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if value(mid) <= limit else (lo, mid)
    return lo


@pytest.mark.parametrize("seed", range(40))
def test_the_boundary_search_finds_what_doubling_found(seed):
    """The interpolating search answers as doubling and bisection did for any growing peak:
    straight lines, steps, curves, and limits past MAX_UNITS (capped below it as before)."""
    from snapshot_lab.metrics.fit.search import MAX_UNITS, _boundary

    rng = np.random.default_rng(seed)
    base, slope = int(rng.integers(0, 10**9)), int(rng.integers(1, 10**7))
    step, square = int(rng.integers(1, 50)), int(rng.integers(0, 1000))
    shapes = [
        lambda n: base + slope * n,
        lambda n: base + slope * (n // step) * step,
        lambda n: base + slope * n + n * n * square,
    ]
    for value in shapes:
        for limit in (value(1), value(1) + 1, value(int(rng.integers(2, 5000))), value(MAX_UNITS) + 5):
            got = _boundary(value, value(1), limit)
            assert got == _doubled(value, limit)
            assert 1 <= got < MAX_UNITS


def test_a_tape_whose_peak_can_shrink_with_the_batch_is_not_taken_as_growing():
    """A size that shrinks with the batch (made-up) is searched by doubling, not by the boundary."""
    from snapshot_lab.metrics.fit.search import PeakCurve

    def tape(per_batch: list[float]) -> Tape:
        two = np.array([0.0, 1.0])
        return Tape(
            start=two,
            end=np.array([NEVER, NEVER]),
            fixed=np.array([100.0, 5000.0]),
            per_batch=np.array(per_batch),
            category=np.array(["activation"] * 2, dtype=object),
            stream=np.zeros(2, dtype=np.int64),
            phase=np.array(["forward"] * 2, dtype=object),
            block=np.full(2, -1, dtype=np.int64),
            autocast=np.zeros(2, dtype=np.int8),
        )

    assert PeakCurve(tape([512.0, 0.0])).monotone is True
    shrinking = PeakCurve(tape([512.0, -1.0]))
    assert shrinking.monotone is False
    # sizes round up to 512-byte blocks: 100 + 512 n takes n + 1 of them, 5000 - n ten
    assert shrinking.peak(1.0) == 1024 + 5120
    assert shrinking.largest(1, 6 * 512) == 0
    assert shrinking.largest(1, 512 * 5 + 5120) == 4
