"""CaptureOptions: the capture options, their defaults and checks in one place, and every
entry point forwarding one of them whole (tests/test_architecture.py checks the signatures)."""

from __future__ import annotations

import pytest

from snapshot_lab.capture import CAPTURE_DEFAULTS, CaptureError, CaptureOptions, recording
from snapshot_lab.integrations._session import CaptureSession

from .fake_torch import FakeTorch


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stacks": "cpp"}, "stacks must be 'python' or 'all', not 'cpp'"),
        ({"context": "none"}, "context must be 'state', 'alloc' or 'all', not 'none'"),
        ({"max_entries": 0}, "max_entries must be at least 1"),
        ({"every_n_steps": 0}, "every_n_steps must be at least 1"),
    ],
)
def test_bad_options_fail_when_built_wherever_they_are_given(options, message):
    for build in (CaptureOptions, lambda **kw: recording("x", **kw), CaptureSession):
        with pytest.raises(CaptureError) as caught:
            build(**options)
        assert caught.value.message() == message


def test_the_defaults_are_the_dataclass_defaults():
    assert CaptureOptions() == CAPTURE_DEFAULTS
    assert recording().options == CAPTURE_DEFAULTS
    assert CaptureSession().options == CAPTURE_DEFAULTS
    assert CaptureOptions.names() == (
        "max_entries",
        "stacks",
        "context",
        "on_oom",
        "every_n_steps",
        "prefix",
        "tag_modules",
        "batch_size",
    )


def test_an_unknown_option_is_refused():
    with pytest.raises(TypeError):
        CaptureSession(stack="python")


def test_recording_from_options_keeps_every_option(tmp_path):
    options = CaptureOptions(
        max_entries=7,
        stacks="all",
        context="alloc",
        on_oom=False,
        every_n_steps=3,
        prefix="run",
        tag_modules=False,
    )
    rec = recording.from_options(tmp_path, options, dump_on_exit=False)
    assert rec.options == options and rec.out_dir == tmp_path and not rec.dump_on_exit


def test_the_session_forwards_every_option_to_its_recording(tmp_path, monkeypatch):
    fake = FakeTorch()
    fake.install(monkeypatch)
    monkeypatch.setattr("snapshot_lab.capture._OBSERVER_ATTACHED", False)
    session = CaptureSession(tmp_path, max_entries=9, stacks="all", prefix="job", tag_modules=False)
    session.start()
    assert session.rec is not None
    assert session.rec.options == session.options
    assert session.rec._tags is None  # tag_modules=False reaches the recording: no tags at all
    assert fake.history_calls[0][1]["max_entries"] == 9
    session.stop()
    (written,) = session.written
    assert written.name.startswith("job_rank0_")
