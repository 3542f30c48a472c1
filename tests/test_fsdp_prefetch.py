"""fsdp-prefetch-peak (issue #24): FSDP2's prefetched parameters setting the peak.

Real runs (``sample_snapshots/jobs/run_world4_one_gpu.sh zero_prefetch``: world size 4, four
ranks on one H100 over gloo): the MLP of ``workloads_parallel.py`` at a small batch with each
unit prefetching the next three (``fsdp2_prefetch3_small``), the same job at FSDP2's default
(``fsdp2_default_small``), and the GPT decoder both ways. Hold-out: every FSDP2 run recorded for
issues #14/#15 at world size 2 over NCCL, and FSDP2 at world size 4 at the usual batch.

A simpler rule, "more than two all-gather outputs alive at once somewhere in the trace", fires
on the GPT with prefetch too (five at once), whose peak activations set: the rule looks at
the peak only.
"""

from __future__ import annotations

import pytest

from snapshot_lab.metrics.diagnose import diagnose
from snapshot_lab.metrics.findings.base import FindingContext
from snapshot_lab.metrics.findings.fsdp_prefetch import gathered_at_peak
from snapshot_lab.metrics.stats.summary import compute_stats

POSITIVE = [f"fsdp2_prefetch3_small_ws4gloo_mlp_rank{rank}" for rank in range(4)]
NEGATIVE = [
    *(f"fsdp2_default_small_ws4gloo_{model}_rank{rank}" for model in ("mlp", "transformer") for rank in range(4)),
    *(f"fsdp2_prefetch3_small_ws4gloo_transformer_rank{rank}" for rank in range(4)),
    *(
        f"fsdp2_{kind}_{model}_rank{rank}"
        for kind in ("reshard", "noreshard")
        for model in ("mlp", "transformer")
        for rank in range(2)
    ),
    *(f"fsdp2_{kind}_ws4gloo_{model}_rank0" for kind in ("reshard", "noreshard") for model in ("mlp", "transformer")),
    "single_mlp",
    "fsdp1_fullshard_mlp_rank0",
]


def _findings(real_frames, name):
    frames = real_frames(name)
    return [f for f in diagnose(frames, compute_stats(frames), False).findings if f.id == "fsdp-prefetch-peak"]


@pytest.mark.parametrize("name", POSITIVE)
def test_raised_where_prefetch_set_the_peak(real_frames, name):
    (finding,) = _findings(real_frames, name)
    # one unit is Linear(2048, 2048) in fp32, unsharded: its weight and bias; the unit in use plus
    # three prefetched
    unit = (2048 * 2048 + 2048) * 4
    assert finding.evidence["unit_bytes"] == unit
    assert finding.evidence["units_gathered_at_peak"] == 4
    assert finding.evidence["gathered_bytes_at_peak"] == 4 * unit
    assert finding.savings_bytes == 2 * unit  # back to FSDP2's default of one unit ahead
    assert "set_modules_to_forward_prefetch" in finding.advice


@pytest.mark.parametrize("name", NEGATIVE)
def test_silent_elsewhere(real_frames, name):
    assert _findings(real_frames, name) == []


def test_the_gpt_with_prefetch_gathers_more_but_its_peak_is_activations(real_frames):
    """The GPT with the same prefetch: three outputs alive at its peak, under 15% of it."""
    frames = real_frames("fsdp2_prefetch3_small_ws4gloo_transformer_rank0")
    diagnosis = diagnose(frames, compute_stats(frames), False)
    ctx = FindingContext(compute_stats(frames), frames, diagnosis.timelines)
    outputs, nbytes, _ = gathered_at_peak(ctx, 0)
    assert outputs == 3
    assert nbytes / diagnosis.timelines[0].peak_requested_bytes < 0.15
