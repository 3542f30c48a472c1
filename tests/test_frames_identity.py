"""The frames of every sample snapshot, and of a generated 100k-entry one, are identical to the
byte to those recorded in ``tests/frames_identity.json`` (dtypes, categories, index, values, the
data under nullable integers' masks).

The digests were recorded by ``benchmarks/frames_identity.py record`` with the code before the
loader and the frame builder were made faster; a change that means to alter the frames records
them again. The same script also compares ``snaplab stats --json`` of every sample
(``check``); that part is not a test here because the metrics behind it change on their own.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from snapshot_lab import load_frames
from snapshot_lab.frames import build_frames
from snapshot_lab.load import load_snapshot

from .conftest import ROOT, sample_names

sys.path.insert(0, str(ROOT / "benchmarks"))

import frames_identity

DIGESTS = json.loads((Path(__file__).parent / "frames_identity.json").read_text())


def _frames_only(digests: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in digests.items() if k != "stats_json"}


@pytest.mark.parametrize("name", sample_names())
def test_sample_frames_identical(name: str, real_frames) -> None:
    assert frames_identity.frames_digests(real_frames(name)) == _frames_only(DIGESTS[name])


def test_generated_frames_identical() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = frames_identity.generated_snapshot(Path(tmp))
        expected = DIGESTS[frames_identity.GENERATED_NAME]
        assert frames_identity.frames_digests(load_frames(path)) == expected
        # without consuming the trace lists (the notebook and check_frames path), the same frames
        assert frames_identity.frames_digests(build_frames(load_snapshot(path))) == expected


def test_every_sample_recorded() -> None:
    assert set(DIGESTS) == {*sample_names(), frames_identity.GENERATED_NAME}
