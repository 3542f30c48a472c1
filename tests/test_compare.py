"""diff, ranks, check and export on real snapshots."""

from __future__ import annotations

import json
import os
import re

import pandas as pd
import pytest
from typer.testing import CliRunner

from snapshot_lab import api, load_frames
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_USAGE
from snapshot_lab.metrics.comparison.compare import SnapshotSummary, rank_of, rank_outliers

from .conftest import sample_path, sample_truth

runner = CliRunner()
MiB = 2**20


def test_diff_of_a_change_ddp_bucket_view():
    """before: gradient_as_bucket_view=False; after: True — the gradients disappear."""
    d = api.diff(sample_path("ddp_nobucketview_rank0"), sample_path("ddp_bucketview_rank0"))
    cats = {c.name: c for c in d.categories}
    param = sample_truth("ddp_bucketview_rank0")["workload"]["param_bytes"]
    assert cats["gradient"].before >= param and cats["gradient"].after == 0
    assert cats["ddp_bucket"].delta == 0
    totals = {c.name: c for c in d.totals}
    before = sample_truth("ddp_nobucketview_rank0")["memory_stats"]["0"]["reserved_bytes.all.current"]
    after = sample_truth("ddp_bucketview_rank0")["memory_stats"]["0"]["reserved_bytes.all.current"]
    assert (totals["reserved_bytes"].before, totals["reserved_bytes"].after) == (before, after)
    assert d.findings_gone == ["ddp-bucket-duplicate-grads"]
    # the gradients were allocated on autograd's thread (no Python stack): they are gone
    (no_stack,) = [s for s in d.sites if s.site == "<no stack recorded: gradient>"]
    assert no_stack.status == "gone" and -no_stack.delta_bytes >= param


@pytest.mark.parametrize("mode", ["all", "python"])
def test_diff_names_the_gradients_after_their_autograd_node(mode):
    """Issue #12, section 1: the +96 MiB of separate gradients between the two gloo DDP rank
    files sit on the backward op that made them. With C++ stacks the site is the autograd node
    (not an ATen internal such as create_out); with Python stacks, which record nothing on the
    autograd thread, the stackless gradients are one group named by their category."""
    d = api.diff(sample_path(f"gloo_bucketview_{mode}_rank0"), sample_path(f"gloo_nobucketview_{mode}_rank0"))
    P = sample_truth("gloo_nobucketview_all_rank0")["workload"]["param_bytes"]
    top = d.sites[0]
    assert top.delta_bytes == pytest.approx(P, rel=0.01) and top.status in ("new", "grown")
    if mode == "all":
        assert (top.site, top.detail) == ("AddmmBackward0 (backward)", "aten::mm")
    else:
        assert top.site == "<no stack recorded: gradient>"
    assert not any("create_out" in s.site for s in d.sites)


def test_diff_same_job_two_steps(tmp_path):
    r = runner.invoke(
        app,
        [
            "diff",
            str(sample_path("transformer_varlen_step4")),
            str(sample_path("transformer_varlen")),
            "--json",
            "-o",
            str(tmp_path / "d.html"),
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    # a clean training loop: the state after step 4 and after step 8 is the same
    assert {t["name"]: t["delta"] for t in out["totals"]}["allocated_bytes"] == 0
    assert all(s["status"] == "same" for s in out["sites"])
    html = (tmp_path / "d.html").read_text()
    # the page carries both traces' explorers (#39): their data, and the one script its CSP allows
    assert "Memory diff" in html and html.count("<script") == 2
    assert 'id="explorer-a"' in html and 'id="explorer-b"' in html
    assert "script-src &#39;sha256-" in html and not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)


def test_diff_of_leaking_run_against_clean_finds_sites():
    d = api.diff(sample_path("cnn_clean"), sample_path("leak_graph"))
    assert "leak-suspect" in d.findings_new
    assert d.sites[0].status in ("new", "grown")
    assert abs(d.sites[0].delta_bytes) >= abs(d.sites[-1].delta_bytes)  # sorted by bytes


def test_rank_names():
    assert rank_of("/x/oom_rank12.pickle") == 12
    assert rank_of("snap_rank-3_host_2024.pickle.gz") == 3
    assert rank_of("plain.pickle") is None  # no number: a row of its own, labelled by file name


def test_ranks_on_ddp_run(tmp_path):
    files = [sample_path("ddp_nobucketview_rank0"), sample_path("ddp_nobucketview_rank1")]
    rows, errors = api.ranks(files, jobs=2, output=tmp_path / "r.html")
    assert errors == {}
    assert [r.rank for r in rows] == [0, 1]
    for r in rows:
        truth = sample_truth(f"ddp_nobucketview_rank{r.rank}")["memory_stats"][str(r.rank)]
        assert r.summary.reserved == truth["reserved_bytes.all.current"]
        assert r.summary.peak_requested_bytes == truth["requested_bytes.all.peak"]
        assert r.flags == []  # balanced ranks
    assert "Memory across 2 ranks" in (tmp_path / "r.html").read_text()


def _summary(peak: int, reserved: int, oom: str | None = None) -> SnapshotSummary:
    return SnapshotSummary(
        "x",
        [0],
        {"reserved_bytes.all.current": reserved, "allocated_bytes.all.current": peak // 2},
        0.1,
        0,
        0,
        peak,
        reserved,
        oom,
        4 * MiB if oom else None,
        {},
        [],
        0,
    )


def test_rank_outliers_flag_the_odd_one():
    ranks = {i: _summary(10_000 * MiB, 11_000 * MiB) for i in range(8)}
    ranks[5] = _summary(12_500 * MiB, 13_000 * MiB, oom="capacity")
    flags = rank_outliers(ranks)
    assert [r for r, f in flags.items() if f] == [5]
    assert flags[5][0] == "peak requested 12.21 GiB is 25% above the median 9.77 GiB"
    assert any("out of memory" in f for f in flags[5])


def test_ranks_cli_with_a_bad_file(tmp_path):
    bad = tmp_path / "job_rank9.pickle"
    bad.write_bytes(b"not a pickle")
    r = runner.invoke(app, ["ranks", str(sample_path("ddp_nobucketview_rank1")), str(bad), "--json", "-j", "1"])
    assert r.exit_code == EXIT_BAD_INPUT
    out = json.loads(r.stdout)
    assert [x["rank"] for x in out["ranks"]] == [1]
    assert list(out["errors"]) == [str(bad)]


def test_check_gate():
    ok = runner.invoke(
        app,
        [
            "check",
            str(sample_path("transformer_varlen")),
            "--max-reserved",
            "3GiB",
            "--no-oom",
            "--no-leaks",
            "--baseline",
            str(sample_path("transformer_varlen_step4")),
            "--max-growth",
            "5%",
        ],
    )
    assert ok.exit_code == 0 and "ok" in ok.stdout
    bad = runner.invoke(app, ["check", str(sample_path("leak_graph")), "--max-reserved", "500MiB", "--no-leaks"])
    assert bad.exit_code == EXIT_GATE_FAILED
    lines = bad.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("FAIL max_reserved") and lines[1].startswith("FAIL no_leaks")
    oom = runner.invoke(app, ["check", str(sample_path("oom_fragmentation")), "--no-oom", "--json"])
    assert oom.exit_code == EXIT_GATE_FAILED
    assert json.loads(oom.stdout)["violations"][0]["limit"] == "no_oom"


def test_check_growth_against_baseline():
    v = api.check(sample_path("leak_graph"), baseline=sample_path("cnn_clean"), max_growth="5%")
    assert {x.limit for x in v} >= {"max_growth:allocated"}


@pytest.mark.parametrize(
    "args", [["--max-reserved", "lots"], ["--max-growth", "5%"], ["--max-growth", "x%", "--baseline", "y"]]
)
def test_check_usage_errors(args):
    r = runner.invoke(app, ["check", str(sample_path("cnn_clean")), *args])
    assert r.exit_code == EXIT_USAGE
    assert r.stderr.startswith("snaplab: error:")


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_export_round_trip(tmp_path, fmt):
    pytest.importorskip("pyarrow") if fmt == "parquet" else None
    written = api.export(sample_path("cuda_graph"), output=tmp_path, format=fmt)
    frames = load_frames(sample_path("cuda_graph"))
    assert sorted(p.name for p in written) == sorted(
        f"{n}.{fmt}" for n in ("segments", "blocks", "events", "stack_frames", "stacks", "annotations")
    )
    read = {"csv": pd.read_csv, "parquet": pd.read_parquet, "json": lambda p: pd.read_json(p, lines=True)}[fmt]
    blocks = read(tmp_path / f"blocks.{fmt}")
    assert len(blocks) == len(frames.blocks)
    assert int(blocks["size_bytes"].sum()) == int(frames.blocks["size_bytes"].sum())
    events = read(tmp_path / f"events.{fmt}")
    assert len(events) == len(frames.events)


def test_export_bad_format(tmp_path):
    r = runner.invoke(app, ["export", str(sample_path("cuda_graph")), "-o", str(tmp_path), "-f", "xlsx"])
    assert r.exit_code == EXIT_USAGE


def test_ranks_on_a_dask_local_cluster(tmp_path):
    """16 rank files parsed by Dask workers (a LocalCluster); only summaries come back."""
    pytest.importorskip("distributed")
    files = []
    for r in range(16):
        src = sample_path("ddp_nobucketview_rank1" if r % 2 else "ddp_nobucketview_rank0")
        dst = tmp_path / f"job_rank{r}.pickle.xz"
        dst.write_bytes(src.read_bytes())
        files.append(dst)
    files.append(tmp_path / "job_rank16.pickle")
    files[-1].write_bytes(b"garbage")
    rows, errors = api.ranks(files, jobs=2, scheduler="local")
    assert [r.rank for r in rows] == list(range(16))
    truth = sample_truth("ddp_nobucketview_rank0")["memory_stats"]["0"]["reserved_bytes.all.current"]
    assert {r.summary.reserved for r in rows} == {truth}
    assert all(r.flags == [] for r in rows)
    assert list(errors) == [str(files[-1])]


def test_a_dask_worker_summarises_alone(monkeypatch):
    """A Dask worker shares its machine with the other files' workers: it spreads no replay over
    the CPUs (SNAPLAB_JOBS=1 from then on, as ranks' own pool workers), the same summary."""
    from snapshot_lab import aside

    monkeypatch.delenv(aside.JOBS_VARIABLE, raising=False)
    path = sample_path("ddp_nobucketview_rank0")
    expected = api.summarize_file(path, with_sites=False)
    monkeypatch.setenv(aside.JOBS_VARIABLE, "")  # put back as it was after the test
    assert api._summarize_alone(path) == expected
    assert os.environ[aside.JOBS_VARIABLE] == "1" and aside.workers() == 1
