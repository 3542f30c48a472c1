"""``ranks`` with the parallel layout: coordinates from the capture sidecar or the file name,
ranks compared within their pipeline stage, stages compared as the pipeline's skew. Real
2-GPU recordings (``pp_*``, ``tp_*``, ``fsdp*``, ``ddp_*``, ``capture_ddp_*``), copied under
other names and with edited sidecars to make larger fleets, and synthetic summaries."""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from snapshot_lab import api, load_frames
from snapshot_lab.cli import app
from snapshot_lab.metrics import compute_stats
from snapshot_lab.metrics.categories import category_levels_at, compute_categories
from snapshot_lab.metrics.comparison.compare import SnapshotSummary, rank_groups, rank_rows
from snapshot_lab.metrics.history.timeline import compute_timeline
from snapshot_lab.metrics.parallel.parallelism import (
    ParallelLayout,
    layout_from_name,
    layout_from_sidecar,
    pipeline_stages,
)
from snapshot_lab.render.compare import format_ranks, layout_text

from .conftest import SAMPLES, sample_names, sample_path, sample_truth

runner = CliRunner()
MiB = 2**20
PP = [f"pp_{s}_{m}" for s in ("gpipe", "1f1b") for m in ("transformer", "mlp")]


def _meta(name: str) -> dict[str, Any]:
    return json.loads((SAMPLES / f"{name}.meta.json").read_text())


def _copy(src: str, dst: Path, parallel: dict[str, Any] | None = None, sidecar: bool = True) -> Path:
    """A copy of a real sample; with ``sidecar``, its capture sidecar too, its ``parallel`` key
    updated with ``parallel`` (one level deep)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sample_path(src), dst)
    if sidecar:
        meta = _meta(src)
        for k, v in (parallel or {}).items():
            meta["parallel"][k] = {**meta["parallel"].get(k, {}), **v} if isinstance(v, dict) else v
        (dst.parent / (dst.name.removesuffix(".pickle.xz") + ".meta.json")).write_text(json.dumps(meta))
    return dst


# --------------------------------------------------------------------------- where a rank sits


def test_layout_from_the_sidecars_of_the_real_recordings():
    lay = layout_from_sidecar(_meta("pp_1f1b_transformer_rank1"))
    assert lay == ParallelLayout(
        source="sidecar",
        coordinates={"pp": 1, "tp": 0, "dp": 0, "fsdp": 0, "cp": 0},
        degrees={"pp": 2, "tp": 1, "dp": 1, "fsdp": 1, "cp": 1},
        strategies=["pipeline"],
        world_size=2,
        num_stages=2,
        schedule="1F1B",
        microbatches=8,
    )
    assert layout_text(lay) == "pp 1"
    assert layout_from_sidecar(_meta("tp_mlp_rank1")).coordinates["tp"] == 1  # type: ignore[union-attr]
    assert layout_text(layout_from_sidecar(_meta("ddp_bucketview_mlp_rank1"))) == "dp 1"
    assert layout_text(layout_from_sidecar(_meta("fsdp2_reshard_mlp_rank1"))) == "fsdp 1"
    # an older capture (no "parallel" key), a failed detection, no sidecar: no layout
    assert layout_from_sidecar(_meta("capture_ddp_rank1")) is None
    assert layout_from_sidecar({"parallel": {"world_size": 2, "rank": 0, "error": "RuntimeError: x"}}) is None
    assert layout_from_sidecar(None) is None


def test_layout_from_a_hostile_sidecar():
    """A sidecar is a file anyone can edit: wrong types are dropped, strings made one short line."""
    lay = layout_from_sidecar(
        {
            "parallel": {
                "coordinates": {"pp": True, "tp": "1", "dp": -1, "cp": 2.0, "fsdp": 3},
                "degrees": {"pp": [2], "fsdp": 4},
                "pp": {"stage": 1, "schedule": "<b>1F1B</b>\n\x1b[2J" + "x" * 100, "microbatches": "8"},
                "strategies": "pipeline",
            }
        }
    )
    assert lay is not None
    assert lay.coordinates == {"fsdp": 3, "pp": 1} and lay.degrees == {"fsdp": 4}
    assert lay.schedule is not None and len(lay.schedule) == 40 and "\n" not in lay.schedule
    assert lay.microbatches is None and lay.strategies == []
    assert layout_from_sidecar({"parallel": [1, 2]}) is None


@pytest.mark.parametrize(
    ("name", "coords"),
    [
        ("job_pp1_rank3.pickle", {"pp": 1}),
        ("job_pp_1_tp-0_dp3_rank3.pickle.xz", {"pp": 1, "tp": 0, "dp": 3}),
        ("snap_stage2_rank5.pickle", {"pp": 2}),
        ("llama/pipe1-tp_rank1.pickle", {"pp": 1, "tp": 1}),
        ("run_pp-rank3.pickle", {"pp": 3}),
        ("dir_pp9/stage0.pickle", {"pp": 0}),  # only the file's own name counts
        ("x_tp0_tp1.pickle", {"tp": 1}),  # the last spelling wins, as for rank<N>
        ("CP1_EP2.pickle", {"cp": 1, "ep": 2}),
    ],
)
def test_coordinates_from_file_names(name, coords):
    lay = layout_from_name(name)
    assert lay is not None and lay.source == "file name" and lay.coordinates == coords


@pytest.mark.parametrize(
    "name",
    [
        "fsdp2_reshard_mlp_rank0.pickle",  # FSDP's version, not a coordinate
        "pp_1f1b_transformer_rank0.pickle",  # a schedule
        "ddp_bucketview_rank1.pickle",
        "tp_transformer_rank0.pickle",
        "snapshot_rank3_gpu-pp1node_20261123-003246.pickle",
        "stage.pickle",
    ],
)
def test_names_without_coordinates(name):
    assert layout_from_name(name) is None


def test_no_sample_name_reads_as_coordinates():
    """The real samples' names (pp_1f1b_*, fsdp2_*, tp_*...) spell strategies, not coordinates."""
    assert [n for n in sample_names() if layout_from_name(f"{n}.pickle.xz") is not None] == []


def test_only_the_pipeline_samples_have_pipeline_stages():
    """Every sample's sidecar: a pipeline stage other than 0 only on the pp_* recordings (two
    stages, and four over NCCL), so the pipeline's skew and its finding cannot come from any other
    sample."""
    staged = {}
    for n in sample_names():
        side = SAMPLES / f"{n}.meta.json"
        lay = layout_from_sidecar(json.loads(side.read_text())) if side.exists() else None
        if lay is not None and lay.pp_stage:
            staged[n] = lay.pp_stage
    four_stages = {
        f"pp_{s}_ws4nccl_{m}_rank{r}": r for s in ("gpipe", "1f1b") for m in ("transformer", "mlp") for r in (1, 2, 3)
    }
    assert staged == {**{f"{p}_rank1": 1 for p in PP}, **four_stages}


def test_groups_only_when_the_files_span_several_stages():
    stage0 = ParallelLayout("sidecar", {"pp": 0, "dp": 0})
    assert pipeline_stages({"a": stage0, "b": ParallelLayout("sidecar", {"pp": 0, "dp": 1}), "c": None}) is None
    lays = {"a": stage0, "b": ParallelLayout("file name", {"pp": 1}), "c": None}
    assert pipeline_stages(lays) == {"a": 0, "b": 1, "c": None}
    assert rank_groups(lays) == {"a": "pp stage 0", "b": "pp stage 1", "c": "pp stage unknown"}


# --------------------------------------------------------------------------- the summary


@pytest.mark.parametrize("name", ["pp_1f1b_transformer_rank0", "pp_gpipe_mlp_rank1", "dataparallel"])
def test_categories_at_the_peak_are_the_timeline_row(name):
    """``category_levels_at`` is the category timeline's row at the peak, without the timeline;
    on the pipeline recordings (whose traces cover the whole run) they add up to the peak."""
    frames = load_frames(sample_path(name))
    stats = compute_stats(frames)
    for dev, d in stats.devices.items():
        ts = d.torch_stats
        tl = compute_timeline(frames.events, dev, ts["requested_bytes.all.current"], ts["reserved_bytes.all.current"])
        assert tl is not None
        first = int(frames.events.loc[frames.events["device"] == dev, "event_index"].iloc[0])
        row = compute_categories(frames, dev).timeline.iloc[tl.peak_index - first]  # type: ignore[union-attr]
        levels = category_levels_at(frames, dev, tl.peak_index)
        assert levels == {c: int(v) for c, v in row.items()}
        if name.startswith("pp_"):
            assert (
                sum(levels.values())
                == tl.peak_requested_bytes
                == sample_truth(name)["memory_stats"][str(dev)]["requested_bytes.all.peak"]
            )


def test_the_summary_carries_the_layout_and_the_peak():
    s = api.summarize_file(sample_path("pp_1f1b_transformer_rank0"), with_sites=False)
    assert s.layout is not None and s.layout.pp_stage == 0 and s.layout.schedule == "1F1B"
    assert s.peak_requested_bytes == sum(s.peak_categories.values())
    assert round(s.peak_categories["inflight_activation"] / MiB) == 195  # 2 microbatches in flight
    assert s.peak_sites[0]["bytes"] >= s.peak_sites[-1]["bytes"] and len(s.peak_sites) <= 50
    assert sum(r["bytes"] for r in s.peak_sites) == s.peak_requested_bytes  # every site (fewer than 50)
    blob = pickle.dumps(s)
    assert len(blob) < 16_000 and pickle.loads(blob) == s  # travels from workers and Dask
    old = api.summarize_file(sample_path("capture_ddp_rank1"), with_sites=False)
    assert old.layout is None and old.peak_categories["activation"] > 0


# --------------------------------------------------------------------------- ranks, real files


def _rows(files: list[Path], jobs: int = 2):
    rows, errors = api.ranks(files, jobs=jobs)
    assert errors == {}
    return rows


@pytest.mark.parametrize("pair", PP)
def test_ranks_of_a_pipeline_pair(pair):
    """Each stage is its own group (of one): the stages are not outliers of each other, and the
    pipeline's skew names them."""
    rows = _rows([sample_path(f"{pair}_rank{r}") for r in (0, 1)])
    assert [(r.group, r.group_size, r.flags) for r in rows] == [("pp stage 0", 1, []), ("pp stage 1", 1, [])]
    skew, _ = api.pipeline(rows)
    assert skew is not None and [s.stage for s in skew.stages] == [0, 1]
    assert (skew.num_stages, skew.microbatches) == (2, 8)
    assert skew.schedule == ("GPipe" if "gpipe" in pair else "1F1B")
    for s, r in zip(skew.stages, rows, strict=True):
        assert (
            s.peak_requested_bytes
            == sample_truth(f"{pair}_rank{r.rank}")["memory_stats"][str(r.rank)]["requested_bytes.all.peak"]
        )


@pytest.mark.parametrize(
    "pair", ["tp_transformer", "tp_mlp", "fsdp2_reshard_mlp", "fsdp1_fullshard_transformer", "ddp_bucketview_mlp"]
)
def test_ranks_without_a_pipeline_compare_everyone(pair):
    """TP peers, FSDP shards and DDP replicas are one group: as before, plus their coordinates."""
    rows = _rows([sample_path(f"{pair}_rank{r}") for r in (0, 1)])
    assert all(r.group is None and r.group_size is None and r.flags == [] for r in rows)
    kind = {"tp": "tp", "fs": "fsdp", "dd": "dp"}[pair[:2]]
    assert [r.layout.coordinates[kind] for r in rows if r.layout is not None] == [0, 1]
    assert api.pipeline(rows) == (None, [])


def test_an_old_capture_is_compared_as_before():
    """capture_ddp: an older sidecar without 'parallel'; rank 1 runs a 3x batch and stands out."""
    rows = _rows([sample_path(f"capture_ddp_rank{r}") for r in (0, 1)])
    assert [r.layout for r in rows] == [None, None]
    assert [bool(r.flags) for r in rows] == [False, True]
    assert rows[1].flags[0] == "peak requested 4.36 GiB is 2.5× its peer's 1.73 GiB"
    assert api.pipeline(rows) == (None, [])
    assert rows[1].to_dict()["coordinates"] == {} and rows[1].to_dict()["group"] is None


def _fleet(tmp: Path, odd: str | None = None) -> list[Path]:
    """dp=2 x pp=2 out of the 1F1B transformer's two stages: world rank r is stage r % 2 of
    replica r // 2. With ``odd``, replica 1 of stage 0 is that recording instead."""
    files = []
    for r in range(4):
        stage, dp = r % 2, r // 2
        src = odd if (odd and r == 2) else f"pp_1f1b_transformer_rank{stage}"
        par = {"world_size": 4, "rank": r, "degrees": {"dp": 2}, "coordinates": {"dp": dp}}
        files.append(_copy(src, tmp / f"job_rank{r}.pickle.xz", par))
    return files


def test_a_fleet_of_replicated_stages(tmp_path):
    rows = _rows(_fleet(tmp_path))
    assert [(r.rank, r.group, r.group_size, layout_text(r.layout)) for r in rows] == [
        (0, "pp stage 0", 2, "pp 0 · dp 0"),
        (1, "pp stage 1", 2, "pp 1 · dp 0"),
        (2, "pp stage 0", 2, "pp 0 · dp 1"),
        (3, "pp stage 1", 2, "pp 1 · dp 1"),
    ]
    assert all(r.flags == [] for r in rows)
    skew, found = api.pipeline(rows)
    assert skew is not None and [s.files for s in skew.stages] == [
        [str(tmp_path / "job_rank0.pickle.xz"), str(tmp_path / "job_rank2.pickle.xz")],
        [str(tmp_path / "job_rank1.pickle.xz"), str(tmp_path / "job_rank3.pickle.xz")],
    ]
    assert found == []  # 1F1B's skew is normal here (see test_pipeline.py)
    text = format_ranks(rows, skew, found)
    assert "Pipeline skew across 2 stages (1F1B, 8 microbatches), not outliers" in text
    assert "1F1B keeps up to S-s microbatches in flight on stage s" in text


def test_a_real_outlier_still_stands_out_within_its_stage(tmp_path):
    """One replica of stage 0 ran GPipe (all 8 microbatches in flight): flagged against its
    stage's median, and the stage is still represented by its usual replica."""
    rows = _rows(_fleet(tmp_path, odd="pp_gpipe_transformer_rank0"))
    flagged = [r for r in rows if r.flags]
    assert [r.rank for r in flagged] == [2]
    assert flagged[0].flags[0].endswith("of pp stage 0") and "its peer's" in flagged[0].flags[0]
    skew, _ = api.pipeline(rows)
    assert skew is not None and skew.stages[0].path == str(tmp_path / "job_rank0.pickle.xz")


def test_stages_from_file_names(tmp_path):
    """No sidecar: 'stage<N>' in the names; the schedule is unknown and said so."""
    files = [
        _copy(f"pp_gpipe_transformer_rank{r}", tmp_path / f"gpt_stage{r}_rank{r}.pickle.xz", sidecar=False)
        for r in (0, 1)
    ]
    rows = _rows(files, jobs=1)
    assert [(r.layout.source if r.layout else None, r.group) for r in rows] == [
        ("file name", "pp stage 0"),
        ("file name", "pp stage 1"),
    ]
    skew, found = api.pipeline(rows)
    assert skew is not None and skew.schedule is None and skew.num_stages is None
    assert [f.id for f in found] == ["pipeline-stage-imbalance"]
    assert "schedule unknown" in found[0].title
    assert "inflight_under_1f1b_estimate" not in found[0].evidence


def _summary(path: str, peak: int, inflight: int, stage: int | None, schedule: str = "1F1B") -> SnapshotSummary:
    lay = (
        ParallelLayout("sidecar", {"pp": stage}, {"pp": 4}, num_stages=4, schedule=schedule, microbatches=8)
        if stage is not None
        else None
    )
    cats = {"parameter": 200 * MiB, "optimizer_state": 400 * MiB, "inflight_activation": inflight}
    cats["activation"] = peak - sum(cats.values())
    return SnapshotSummary(
        path, [0], {"reserved_bytes.all.current": peak, "allocated_bytes.all.current": peak // 2}, 0.1, 0, 0,
        peak, peak, None, None, {}, [], 0, [], lay, cats, [],
    )  # fmt: skip


def test_a_deep_1f1b_pipeline_is_skew_not_outliers():
    """4 stages x 2 replicas under 1F1B, 200 MiB in flight per microbatch: stage s holds 4 - s
    microbatches. Against the median of all 8 ranks, both stage-0 ranks would be 27% above it
    (what ``ranks`` said before); within their stages nobody stands out, until one replica of
    stage 2 holds 50% more than its twin."""
    per_mb = 200 * MiB
    summaries = {
        (p := f"job_rank{4 * dp + s}.pickle"): _summary(p, 800 * MiB + (4 - s) * per_mb, (4 - s) * per_mb, s)
        for dp in range(2)
        for s in range(4)
    }
    flat = rank_rows({p: replace(s, layout=None) for p, s in summaries.items()})
    assert sorted(r.rank for r in flat if r.flags) == [0, 4]
    rows = rank_rows(summaries)
    assert all(r.flags == [] for r in rows)
    assert {r.group for r in rows} == {f"pp stage {s}" for s in range(4)}
    skew, found = api.pipeline(rows)
    assert skew is not None and [s.microbatches_in_flight for s in skew.stages] == [4, 3, 2, 1]
    assert skew.inflight_difference_bytes == skew.spread_bytes == 3 * per_mb
    (f,) = found
    assert f.evidence["dominated_by"] == "inflight_activation" and f.savings_bytes == 300 * MiB
    assert "ScheduleInterleaved1F1B" in f.advice and "1F1B keeps up to S-s microbatches" in f.advice
    summaries["job_rank6.pickle"] = _summary("job_rank6.pickle", 1800 * MiB, 2 * per_mb, 2)  # stage 2, replica 1
    odd = [r for r in rank_rows(summaries) if r.flags]
    assert [r.rank for r in odd] == [6] and odd[0].flags[0].endswith("of pp stage 2")


# --------------------------------------------------------------------------- output


def test_cli_ranks_json_text_and_html_of_a_pipeline(tmp_path):
    files = _fleet(tmp_path / "in", odd="pp_gpipe_transformer_rank0")
    out_html = tmp_path / "ranks.html"
    r = runner.invoke(app, ["ranks", *map(str, files), "--json", "-j", "2", "-o", str(out_html)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [
        (x["rank"], x["coordinates"], x["coordinates_from"], x["group"], x["group_size"]) for x in out["ranks"]
    ] == [
        (0, {"pp": 0, "tp": 0, "dp": 0, "fsdp": 0, "cp": 0}, "sidecar", "pp stage 0", 2),
        (1, {"pp": 1, "tp": 0, "dp": 0, "fsdp": 0, "cp": 0}, "sidecar", "pp stage 1", 2),
        (2, {"pp": 0, "tp": 0, "dp": 1, "fsdp": 0, "cp": 0}, "sidecar", "pp stage 0", 2),
        (3, {"pp": 1, "tp": 0, "dp": 1, "fsdp": 0, "cp": 0}, "sidecar", "pp stage 1", 2),
    ]
    assert [x["outlier"] for x in out["ranks"]] == [False, False, True, False]
    assert (
        out["ranks"][0]["inflight_activation_bytes_at_peak"]
        == out["pipeline"]["stages"][0]["inflight_activation_bytes"]
    )
    pipe = out["pipeline"]
    assert (pipe["schedule"], pipe["microbatches"], pipe["num_stages"]) == ("1F1B", 8, 2)
    assert [s["stage"] for s in pipe["stages"]] == [0, 1] and pipe["heaviest_stage"] == 1
    assert out["findings"] == []
    text = runner.invoke(app, ["ranks", *map(str, files), "-j", "1"]).stdout
    assert text.splitlines()[2].split() == ["rank", "layout", "peak", "requested", "reserved", "allocated",
                                            "stranded", "flags"]  # fmt: skip
    assert "of pp stage 0" in text and "Pipeline skew across 2 stages" in text
    html = out_html.read_text()
    assert 'id="pipeline"' in html and "pp 0 · dp 1" in html and "pp stage 0" in html
    assert "<script" not in html and "http://" not in html and "https://" not in html


def test_cli_ranks_shows_the_finding(tmp_path):
    files = [sample_path(f"pp_gpipe_transformer_rank{r}") for r in (0, 1)]
    out_html = tmp_path / "ranks.html"
    r = runner.invoke(app, ["ranks", *map(str, files), "--json", "-o", str(out_html)])
    assert r.exit_code == 0, r.output
    (f,) = json.loads(r.stdout)["findings"]
    assert f["id"] == "pipeline-stage-imbalance" and f["evidence"]["heaviest_stage"] == 1
    html = out_html.read_text()
    assert "Findings across the files" in html and "pipeline-stage-imbalance" in html
    text = runner.invoke(app, ["ranks", *map(str, files)]).stdout
    assert "WARNING  pipeline-stage-imbalance: Pipeline stage 1 peaks" in text


def test_hostile_schedule_is_escaped(tmp_path):
    files = [
        _copy(f"pp_gpipe_mlp_rank{r}", tmp_path / f"x_rank{r}.pickle.xz", {"pp": {"schedule": "<img src=x>"}})
        for r in (0, 1)
    ]
    rows, _ = api.ranks(files, jobs=1, output=tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    assert "<img src=x>" not in html and "&lt;img" in html
    assert rows[0].layout is not None and rows[0].layout.schedule == "<img-src=x>"
