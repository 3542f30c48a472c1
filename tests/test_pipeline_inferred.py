"""Pipeline stages inferred from the stacks (issue #19, part 5): rank files without a sidecar and
without stage tokens in their names (``job_r0.pickle.xz``), whose stacks show
``torch.distributed.pipelining``. Only the last stage computes the loss
(``_maybe_compute_loss``); the inferred stage is said to be inferred, and ``ranks`` and the
findings compare stages instead of calling the pair peers.

Hold-out: the rule was written on the 1F1B GPT pair; it is checked on both schedules (GPipe, 1F1B)
and both models, with the files given in reverse order (a simpler rule, "the files in the order
given are the stages in order", puts the last stage first there), and a DDP pair (no pipelining
frames) must not be taken for a pipeline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from snapshot_lab import api, load_frames
from snapshot_lab.metrics.comparison.compare import rank_pipeline
from snapshot_lab.metrics.parallel.parallelism import layout_from_pipeline_stacks
from snapshot_lab.metrics.parallel.schedule import schedule_from_trace

from .conftest import SAMPLES, sample_path, sample_truth

PAIRS = [f"pp_{schedule}_{model}" for schedule in ("1f1b", "gpipe") for model in ("mlp", "transformer")]


def _anonymous_pair(tmp_path, pair: str) -> list[str]:
    """The two ranks' snapshots copied under names with no stage or rank token, without sidecars."""
    out = []
    for rank, name in ((0, "alpha"), (1, "beta")):
        dest = tmp_path / f"{pair}_{name}.pickle.xz"
        shutil.copyfile(sample_path(f"{pair}_rank{rank}"), dest)
        out.append(str(dest))
    return out


@pytest.mark.parametrize("pair", PAIRS)
def test_the_stage_the_stacks_show_is_the_recorded_one(pair):
    for rank in (0, 1):
        layout = layout_from_pipeline_stacks(load_frames(sample_path(f"{pair}_rank{rank}")))
        assert layout is not None and layout.source == "stacks"
        assert layout.pp_stage == sample_truth(f"{pair}_rank{rank}")["workload"]["pp_stage"]


@pytest.mark.parametrize("pair", PAIRS)
def test_ranks_compare_the_inferred_stages(tmp_path, pair):
    first, last = _anonymous_pair(tmp_path, pair)
    rows, _ = api.ranks([last, first], jobs=1)  # reverse order: the order given does not decide
    by_file = {row.label: row for row in rows}
    assert by_file[Path(first).name].group == "pp earlier stage (inferred from the stacks)"
    assert by_file[Path(last).name].group == "pp last stage (inferred from the stacks)"
    skew, _ = rank_pipeline(rows)  # the stages are compared with each other
    assert skew is not None and len(skew.stages) == 2


def test_a_ddp_pair_is_no_pipeline():
    for rank in (0, 1):
        assert layout_from_pipeline_stacks(load_frames(sample_path(f"ddp_nobucketview_transformer_rank{rank}"))) is None


# every pipelined recording: two stages and four, both schedules, both models, every rank
PIPELINED = sorted({p.name.split(".")[0] for p in SAMPLES.glob("pp_*_rank*.pickle.xz")})


@pytest.mark.parametrize("name", PIPELINED)
def test_the_schedule_the_trace_shows_is_the_recorded_one(name):
    """Issue #37: the schedule from the order of the trace, the sidecar's as the truth. GPipe's
    microbatches are not counted (one run of forwards per step holds no unit), 1F1B's are."""
    recorded = json.loads((SAMPLES / f"{name}.meta.json").read_text())["parallel"]["pp"]
    read = schedule_from_trace(load_frames(sample_path(name)))
    assert read is not None
    assert read.schedule == recorded["schedule"]
    assert read.microbatches == (recorded["microbatches"] if read.schedule == "1F1B" else None)
    assert read.runs >= 3  # a complete run or more per recorded step


@pytest.mark.parametrize(
    "name",
    [
        "ddp_nobucketview_transformer_rank0",
        "fsdp2_reshard_transformer_rank0",
        "tp_transformer_rank0",
        "grad_plain_python",
        "grad_accum_python",
    ],
)
def test_no_schedule_where_nothing_is_pipelined(name):
    assert schedule_from_trace(load_frames(sample_path(name))) is None


def test_a_gpipe_pair_without_sidecars_names_its_schedule(tmp_path):
    """The pair the issue named: findings over two anonymous GPipe files say GPipe, and that it
    was read from the traces (a sidecar's schedule is said plainly)."""
    files = _anonymous_pair(tmp_path, "pp_gpipe_transformer")
    found = [f for f in api.findings(files).to_dict()["findings"] if f["id"] == "pipeline-stage-imbalance"]
    assert len(found) == 1
    assert "; GPipe, read from the order of the traces)" in found[0]["title"]
    assert found[0]["evidence"]["schedule"] == "GPipe" and found[0]["evidence"]["schedule_from_trace"] is True
    assert "GPipe keeps all M microbatches in flight" in found[0]["advice"]
