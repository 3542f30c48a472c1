"""The bound rule of tests/fit_known_misses.py: a known miss that gets worse fails, one that gets
within its tolerance fails too (its entry is no longer true), a refusal must stay that refusal."""

from __future__ import annotations

import pytest

from snapshot_lab.metrics.fit.model import FitUnsupported, FitUnsupportedOom

from .fit_known_misses import (
    BatchMiss,
    PeakMiss,
    Refusal,
    Tally,
    attempt,
    check_exact,
    check_largest,
    check_peak,
    check_refused,
    check_tally,
    tally,
)

HIGH = PeakMiss(+0.2115, "high")
LOW = PeakMiss(-0.3104, "low")


def test_a_peak_miss_holds_within_its_margin_of_today():
    check_peak(+0.2115, 0.10, HIGH)
    check_peak(+0.2164, 0.10, HIGH)  # 0.49 points worse
    check_peak(+0.15, 0.10, HIGH)  # better, still outside
    check_peak(-0.3150, 0.10, LOW)
    check_peak(+0.04, 0.10, None)


@pytest.mark.parametrize(
    ("error", "known"), [(+0.2170, HIGH), (-0.25, HIGH), (+0.25, LOW), (-0.3160, LOW), (-1.0, HIGH), (0.11, None)]
)
def test_a_peak_that_gets_worse_or_changes_sign_fails(error, known):
    with pytest.raises(AssertionError):
        check_peak(error, 0.10, known)


@pytest.mark.parametrize("error", [+0.09, -0.05, 0.0])
def test_a_peak_miss_within_tolerance_says_move_it(error):
    with pytest.raises(pytest.fail.Exception, match=r"now within tolerance.*move it out of OUTSIDE"):
        check_peak(error, 0.10, HIGH)


def test_a_largest_batch_miss_no_further_and_never_to_the_unsafe_side():
    safe, unsafe = BatchMiss(235, 327, "low"), BatchMiss(39, 24, "high")
    check_largest(235, 327, max(2, 0.15 * 327), safe)
    check_largest(270, 327, max(2, 0.15 * 327), safe)
    check_largest(35, 24, max(1, 0.4 * 24), unsafe)
    check_largest(14, 24, max(1, 0.4 * 24), unsafe)  # 10 below where 15 above was known: no further
    for predicted, known, real in ((234, safe, 327), (360, safe, 327), (40, unsafe, 24), (8, unsafe, 24)):
        with pytest.raises(AssertionError):
            check_largest(predicted, real, 1, known)
    with pytest.raises(AssertionError, match="the real run is"):
        check_largest(235, 330, 1, safe)
    with pytest.raises(pytest.fail.Exception, match="now within tolerance"):
        check_largest(320, 327, max(2, 0.15 * 327), safe)


def test_exactly_or_no_further_than_the_known_miss():
    check_exact(69, 69, None)
    check_exact(28, 27, BatchMiss(28, 27, "one high"))
    with pytest.raises(AssertionError):
        check_exact(68, 69, None)
    with pytest.raises(AssertionError):
        check_exact(29, 27, BatchMiss(28, 27, "one high"))
    with pytest.raises(pytest.fail.Exception, match="now exact"):
        check_exact(27, 27, BatchMiss(28, 27, "one high"))


def test_a_refusal_stays_that_refusal_for_that_reason():
    known = Refusal("FitUnsupportedOom", "before its first repeated block completed", "why")

    def refuse(exception, message):
        def call():
            raise exception(message)

        return call

    check_refused(attempt(refuse(FitUnsupportedOom, "ran out before its first repeated block completed: ...")), known)
    with pytest.raises(AssertionError):  # the parent class is not the same refusal
        check_refused(attempt(refuse(FitUnsupported, "before its first repeated block completed")), known)
    with pytest.raises(AssertionError):  # another reason
        check_refused(attempt(refuse(FitUnsupportedOom, "no training step")), known)
    with pytest.raises(pytest.fail.Exception, match="now answers"):
        check_refused(attempt(lambda: (1 << 30, 2 << 30)), known)
    with pytest.raises(RuntimeError):  # anything but a FitUnsupported is raised, not taken for a refusal
        attempt(refuse(RuntimeError, "boom"))


def test_the_counts_as_benchmarks_fit_accuracy_tallies_them():
    # (no-retry, largest, real, at most): exact; one above in its range; two below; a range missing
    # the real run; one short whose range's top (the tensors alone at the limit) holds it
    found = tally([(3, 3, 3, None), (25, 28, 27, None), (133, 133, 135, None), (None, 39, 24, None), (18, 18, 19, 22)])
    assert found == Tally(answers=5, exact=1, within_one=2, in_range=3, sure_runs=4)
    check_tally(found, found, "same")
    for pinned in (Tally(5, 2, 2, 3, 4), Tally(5, 1, 1, 3, 4), Tally(5, 1, 2, 2, 4)):
        with pytest.raises(pytest.fail.Exception):
            check_tally(found, pinned, "changed")
