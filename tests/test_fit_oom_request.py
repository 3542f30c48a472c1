"""fit on a run that ran out of memory on a request no batch or lever could serve: the request
alone is more than the memory limit (issue #20). It says so first; the report lists it after the
OOM finding's advice, not as "what makes it fit"."""

from __future__ import annotations

from snapshot_lab.api import compute_stats
from snapshot_lab.metrics.fit import compute_fit
from snapshot_lab.render.fit import format_fit
from snapshot_lab.report import build_report

from .conftest import sample_truth


def test_a_request_larger_than_the_limit_is_named_and_not_sized_as_the_step(real_frames):
    """Lightning's OOM sample: two whole steps of a small GPT-2 (269 MiB), then a 1.5 TiB request.
    fit said "batch 501x fits" at the top of the OOM report; the request is now what it says first."""
    frames = real_frames("lightning_oom_oom")
    r = compute_fit(frames)
    requested = sample_truth("lightning_oom_oom")["workload"]["requested_bytes"]
    assert r.oom_request_over_limit == requested == 1_649_267_441_664
    assert r.memory_limit_bytes is not None and requested > r.memory_limit_bytes
    assert r.to_dict()["oom_request_over_limit_bytes"] == requested
    assert format_fit(r).startswith("The run ran out of memory on a request of 1.5 TiB, alone more than the 79.2 GiB")
    html = build_report(frames, compute_stats(frames))
    assert isinstance(html, str)
    assert html.index("the job needed more than the device had") < html.index("The run ran out of memory on a request")
    # nor does a parallel layout serve it (every GPU has as much memory): no plan is offered
    assert "fits with" not in html and "pipeline, 2 stages" not in html


def test_a_request_the_batch_explains_is_not_named(real_frames):
    """A job that doubles its batch every step until a 256 MiB request fails under a 3 GiB cap: the
    step as recorded fits (at the smaller batch recorded), as in Lightning's case, so "the step fits
    yet the run failed" would name it too; the request is smaller than the limit, and the batch is
    the answer."""
    r = compute_fit(real_frames("capture_oomx_oom_rank0"))
    assert r.levers[0].lever == "as recorded" and r.levers[0].fits is True
    assert sample_truth("capture_oomx_oom_rank0")["workload"]["requested_bytes"] == 256 << 20
    assert r.oom_request_over_limit is None
    assert not format_fit(r).startswith("The run ran out of memory")
