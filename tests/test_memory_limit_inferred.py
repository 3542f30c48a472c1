"""The per-process cap an OOM ran under, which the snapshot does not record, read from the bounds
the trace sets (``allocator.whatif._cap_between``): every segment reserved fit under it, and the
failing request's segment, after the allocator freed its cache, did not.

Every capped OOM recording among the samples lies between its bounds (the first test). Where a
whole or half GiB lies between them, the smallest such stands in: it is the cap of every fit
recording under 6 or 8 GiB but two and of the capture runs under 1, 2 and 3 GiB. The lower bound
alone (the simpler rule, the peak reserved) was 4.9 to 6.0 GiB for the 6 GiB caps, and the
largest batches an OOM's report gave followed it down: GPT-2's checkpointing+bf16, for one.
"""

from __future__ import annotations

import json

import pytest

from snapshot_lab.metrics.allocator.whatif import infer_memory_limit
from snapshot_lab.metrics.plan.planner import _recorded_reserved_peak

from .conftest import SAMPLES, sample_names

GiB = 1 << 30


def _cap(name: str) -> int | None:
    workload = json.loads((SAMPLES / f"{name}.truth.json").read_text()).get("workload", {})
    cap = workload.get("cap_bytes") or workload.get("memory_cap_bytes")
    return int(cap) if cap else None


def _capped_ooms() -> list[str]:
    out = []
    for name in sample_names():
        if not name.startswith(("fit_", "capture_")) or _cap(name) is None:
            continue
        if "oom" in name:
            out.append(name)
    return out


def _bounds(source: str) -> tuple[int, int]:
    import re

    low, high = re.findall(r"\(([\d,]+) bytes\)", source)[:2]
    return int(low.replace(",", "")), int(high.replace(",", ""))


@pytest.mark.parametrize("name", _capped_ooms())
def test_the_cap_lies_between_the_bounds_the_trace_sets(real_frames, name):
    frames = real_frames(name)
    limit = infer_memory_limit(frames, 0, _recorded_reserved_peak(frames, 0))
    if not limit.inferred:  # the capture sidecar recorded the observer's limit
        assert limit.bytes == _cap(name)
        return
    low, high = _bounds(limit.source)
    assert low <= _cap(name) <= high, (low, _cap(name), high)
    assert low <= limit.bytes <= high


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fit_gpt2_b32_oom_python", 6 * GiB),  # peak reserved 5.87 GiB
        ("fit_llama_b32_oom_python", 6 * GiB),  # 5.63
        ("fit_resnet34_b512_oom_python", 6 * GiB),  # 5.28
        ("fit_gpt2m_b32_oom_python", 8 * GiB),  # 7.82, under an 8 GiB cap
        # the failing request (1.5 GiB of attention weights) leaves 4.9 to 6.4 GiB: 5 GiB, the
        # smallest whole GiB between, is not the cap; never below the peak reserved all the same
        ("fit_qwen2_b32_oom_python", 5 * GiB),
    ],
)
def test_the_roundest_size_between_the_bounds_stands_in(real_frames, name, expected):
    frames = real_frames(name)
    limit = infer_memory_limit(frames, 0, _recorded_reserved_peak(frames, 0))
    assert limit.inferred and limit.is_cap
    assert limit.bytes == expected
    assert "the roundest size between them, stands in" in limit.source


def test_a_cap_with_no_round_size_between_its_bounds_keeps_the_peak_reserved(real_frames):
    """The what-if's caps are fractions of measured peaks: 1.74 GiB lies between 1.58 and 1.76."""
    frames = real_frames("whatif_gc_capB")
    peak = _recorded_reserved_peak(frames, 0)
    limit = infer_memory_limit(frames, 0, peak)
    assert limit.bytes == peak and limit.source.endswith("the lower bound stands in")
