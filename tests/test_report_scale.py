"""Issue #40 (the report's time at scale): work not done twice, and no wait on a busy worker."""

from __future__ import annotations

import time

from snapshot_lab import api, aside
from snapshot_lab.metrics import compute_stats
from snapshot_lab.render.explorer import Payload, add_diff_explorer

from .conftest import sample_path
from .test_aside import forks


def test_the_diff_explorer_given_the_stats_is_the_one_that_computes_them():
    frames = api.load_frames(sample_path("capture_single_step2"))
    computed, given = Payload(linked=True), Payload(linked=True)
    add_diff_explorer(computed, frames, "a", "step2")
    add_diff_explorer(given, frames, "a", "step2", stats=compute_stats(frames))
    assert given.to_json() == computed.to_json()


@forks
def test_a_job_is_handed_to_a_busy_worker_without_waiting_for_it():
    """While the child sleeps, a job larger than the pipe's buffer is queued at once (before: the
    write waited for the child to read it), then answered."""
    worker = aside.Worker("time")
    assert worker.forked
    text = "x" * (4 << 20)  # 4 MiB: far more than a pipe holds
    asleep = worker.submit("sleep", 2.0)
    started = time.monotonic()
    echoed = worker.submit("strftime", text)
    assert time.monotonic() - started < 1.0
    assert worker.result(asleep) is None
    assert worker.result(echoed) == text
    worker.close()
