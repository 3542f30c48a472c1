"""Out-of-memory errors the job went on from (history/ooms.py): PyTorch's cuDNN convolutions
catch one on their workspace and try an algorithm that needs less. Recorded on an H100 under a
6 GiB cap (sample_snapshots/workloads_fit.py, group fit_boundary): ResNet-50 with checkpointing at
the largest batch that ran (162: 37 caught, two whole steps) and at one more (163: 84 caught,
then one that ended it).

Simpler rules and the real cases that break them:
- "every oom entry is an OOM of the job": 162 finished both its steps;
- "the last oom entry ended the job": 162's last one was caught too;
- "an oom followed by any event was caught": after the one that ended GPT-2's capped run (batch
  27, checkpointing) the trace frees 34 blocks (the stack unwinding), and after the one that
  ended ``capture_oomx_exception_rank0``, 34, then the dump's marker.
"""

from __future__ import annotations

import pytest

from snapshot_lab.metrics.fit import compute_fit
from snapshot_lab.metrics.history.ooms import fatal, recovered

from .conftest import sample_truth

# name: (oom entries, caught, steps the job finished)
RECORDED = {
    "fit_resnet50_b162_ckpt_capped_python": (37, 37, 2),
    "fit_resnet50_b163_ckpt_capped_python": (85, 84, 1),
    "fit_gpt2_b27_ckpt_capped_python": (1, 0, 1),
}
# every other sample with an OOM ended on its last one: frees and the dump's marker may follow it
ENDED = [
    "capture_oomx_exception_rank0",
    "lightning_oom_exception",
    "fit_gpt2_b32_oom_python",
    "oom_fragmentation",
    # the other capped boundary runs, each ended by its one OOM after a step (frees follow it)
    "fit_gpt2_b28_ckpt_capped_python",
    "fit_convnext_b194_ckpt_capped_python",
    "fit_convnext_b195_ckpt_capped_python",
    "fit_vit_b232_ckpt_capped_python",
    "fit_vit_b233_ckpt_capped_python",
]


@pytest.mark.parametrize("name", RECORDED)
def test_caught_ooms_are_told_from_the_one_that_ended_the_job(real_frames, name):
    n, caught, steps = RECORDED[name]
    truth = sample_truth(name)["workload"]
    assert truth["steps_done"] == steps
    assert len(truth["oom_observed"]) == n  # the OOM observer saw every one, caught or not
    events = real_frames(name).events
    assert int((events["action"] == "oom").sum()) == n
    assert int(recovered(events).sum()) == caught
    ended = fatal(events)
    assert len(ended) == n - caught
    if "oom" in truth:  # the request of the error that stopped it, as torch's message gives it
        asked = float(truth["oom"].split("Tried to allocate ")[1].split(" MiB")[0])
        assert -(-int(ended["size_bytes"].iloc[-1]) // (2 << 20)) * 2 == asked  # torch's message: 2 MiB units


@pytest.mark.parametrize("name", ENDED)
def test_an_oom_followed_by_frees_alone_ended_the_job(real_frames, name):
    events = real_frames(name).events
    assert not recovered(events).any()
    assert len(fatal(events)) == 1
    ooms = events[events["action"] == "oom"]
    after = events[events["event_index"] > int(ooms["event_index"].iloc[-1])]
    assert not (after["action"] == "alloc").any()


def test_a_job_that_went_on_is_not_said_to_have_run_out_of_memory(real_frames, real_diagnosis):
    frames = real_frames("fit_resnet50_b162_ckpt_capped_python")
    stats, diagnosis = real_diagnosis("fit_resnet50_b162_ckpt_capped_python")
    assert stats.devices[0].oom is None
    found = diagnosis.findings
    assert not [f for f in found if f.id in ("oom-capacity", "oom-fragmentation")]
    (caught,) = [f for f in found if f.id == "oom-recovered"]
    assert caught.severity == "warning"
    assert caught.evidence["recovered_count"] == 37
    assert caught.evidence["ended_by_an_oom"] is False
    assert caught.evidence["smallest_request_bytes"] == 394363392  # 376.09 MiB
    assert caught.title.startswith("37 allocations failed and the job went on:")
    assert diagnosis.timelines[0].ooms == ()  # no "out of memory" line on its timeline
    fit = compute_fit(frames)
    assert fit.workload == "training step"
    # the recorded batch ran: fit says it fits, and its largest batch is not below it
    as_recorded = fit.levers[0]
    assert (as_recorded.lever, as_recorded.fits) == ("as recorded", True)
    assert fit.largest_batch["as recorded"] >= 1.0
    # its reserved peak without a limit is above the limit it fits under, and the text says why
    from snapshot_lab.render.fit import FITS_UNDER_LIMIT, format_fit

    assert as_recorded.peak_reserved_bytes > fit.memory_limit_bytes
    assert FITS_UNDER_LIMIT in format_fit(fit)


def test_the_oom_that_ended_the_job_is_explained_with_the_caught_ones_counted(real_diagnosis):
    stats, diagnosis = real_diagnosis("fit_resnet50_b163_ckpt_capped_python")
    oom = stats.devices[0].oom
    assert oom is not None
    assert (oom.oom_count, oom.recovered_count) == (85, 84)
    assert oom.requested_bytes == 523436032  # 499.19 MiB: torch's "Tried to allocate 500.00 MiB"
    found = {f.id: f for f in diagnosis.findings}
    # fragmentation: replayed with the caught ones as tries, expandable segments serve its request
    assert found["oom-fragmentation"].severity == "critical"
    assert found["oom-recovered"].severity == "info"
    assert found["oom-recovered"].title.startswith("84 allocations failed and the job went on, until one ended it")
    assert len(diagnosis.timelines[0].ooms) == 1


@pytest.mark.parametrize("pure_python", [False, True])
def test_the_what_if_retries_a_refused_request_and_goes_on(real_frames, monkeypatch, pure_python):
    """The what-if replayed every oom entry as the request that ended the job: a capped ResNet-50
    that finished its steps was said to run out at its first caught error under the recorded
    settings and under every other. A caught one is now tried (a workspace, freed at once when
    served) and, refused again, the replay goes on; the recorded run's replay stays exact."""
    from snapshot_lab.metrics.allocator import native
    from snapshot_lab.metrics.allocator.model import recorded_settings
    from snapshot_lab.metrics.allocator.whatif import analyse_whatif

    if pure_python:
        monkeypatch.setenv(native.ENV_PURE_PYTHON, "1")
    for name, ended_at in (
        ("fit_resnet50_b162_ckpt_capped_python", None),
        ("fit_resnet50_b163_ckpt_capped_python", 5603),
    ):
        frames = real_frames(name)
        w = analyse_whatif(frames, 0, [recorded_settings(frames.info.allocator_settings)], 6 << 30)
        assert w.replay_check.exact
        (recorded,) = w.scenarios
        assert [o["event_index"] for o in recorded.ooms] == ([] if ended_at is None else [ended_at])
        assert recorded.recorded_oom_avoided is (None if ended_at is None else False)
