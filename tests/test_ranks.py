"""``ranks`` over files that share a rank number or have none: copies of the real rank
snapshots under colliding names, through the API, CliRunner and the console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import app
from snapshot_lab.metrics.comparison.compare import (
    SnapshotSummary,
    host_of,
    rank_labels,
    rank_of,
    rank_outliers,
    rank_rows,
)
from snapshot_lab.render.compare import format_ranks, rank_notice

from .conftest import SAMPLES, sample_path, sample_truth

runner = CliRunner()
MiB = 2**20


def _copy(src: str, dst: Path, host: str | None = None) -> Path:
    """A copy of a real sample under another name; with ``host``, its capture sidecar too,
    with that host."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sample_path(src), dst)
    if host is not None:
        meta = json.loads((SAMPLES / f"{src}.meta.json").read_text())
        meta["host"] = host
        (dst.parent / (dst.name.removesuffix(".pickle.xz") + ".meta.json")).write_text(json.dumps(meta))
    return dst


def _reserved(name: str) -> int:
    truth = sample_truth(name)["memory_stats"]
    return sum(d["reserved_bytes.all.current"] for d in truth.values())


def test_rank_and_host_from_names_and_sidecars():
    assert rank_of("/x/oom_rank12.pickle") == 12
    assert rank_of("snap_rank-3_host_2024.pickle.gz") == 3
    assert rank_of("/runs/rank7/plain.pickle") is None  # only the file's own name counts
    assert rank_of("plain.pickle") is None
    # snaplab run's own naming, a node token, a sidecar (which wins), nothing
    assert host_of("snaps/snapshot_rank3_node-7_20261123-003246.pickle") == "node-7"
    assert host_of("snaps/snapshot_rank3_gpu.a100.local_20261123-003246_oom.pickle") == "gpu.a100.local"
    assert host_of("node3_rank0.pickle") == "node3"
    assert host_of("job_rank0_nid001234.pickle.xz") == "nid001234"
    assert host_of("node3_rank0.pickle", {"host": "gpu-17"}) == "gpu-17"
    assert host_of("node3_rank0.pickle", {"host": ""}) == "node3"
    assert host_of("x_rank0.pickle", {"host": " gpu 17\n<b>\x1b[2J "}) == "gpu-17-<b>-[2J"
    assert host_of("a_rank0.pickle") is None
    assert host_of("snap_rank-3_host_2024.pickle.gz") is None
    assert host_of("run2_rank0.pickle") is None


def test_labels_are_unique_and_say_where_they_come_from():
    paths = [
        "d/a_rank0.pickle",
        "d/b_rank0.pickle",
        "d/c_rank1.pickle",
        "d/node3_rank2.pickle",
        "d/node4_rank2.pickle",
        "run1/x_rank5_vm_20260101-000000.pickle",
        "run2/x_rank5_vm_20260101-000000.pickle",
        "run1/plain.pickle",
        "run2/plain.pickle",
        "other.pickle",
        "3",  # a file named like a rank label
        "w_rank3.pickle",
    ]
    hosts = {p: host_of(p) for p in paths}
    labels = rank_labels(paths, hosts)
    assert labels == {
        "d/a_rank0.pickle": (0, "a_rank0.pickle", "file"),
        "d/b_rank0.pickle": (0, "b_rank0.pickle", "file"),
        "d/c_rank1.pickle": (1, "1", "rank"),
        "d/node3_rank2.pickle": (2, "node3/rank2", "host"),
        "d/node4_rank2.pickle": (2, "node4/rank2", "host"),
        # same rank, same host (two runs side by side): the host does not tell them apart
        "run1/x_rank5_vm_20260101-000000.pickle": (5, "run1/x_rank5_vm_20260101-000000.pickle", "file"),
        "run2/x_rank5_vm_20260101-000000.pickle": (5, "run2/x_rank5_vm_20260101-000000.pickle", "file"),
        "run1/plain.pickle": (None, "run1/plain.pickle", "file"),
        "run2/plain.pickle": (None, "run2/plain.pickle", "file"),
        "other.pickle": (None, "other.pickle", "file"),
        "3": (None, "./3", "file"),
        "w_rank3.pickle": (3, "3", "rank"),
    }


def _summary(peak: int) -> SnapshotSummary:
    return SnapshotSummary(
        "x", [0], {"reserved_bytes.all.current": peak, "allocated_bytes.all.current": peak}, 0.1, 0, 0, peak, peak,
        None, None, {}, [], 0,
    )  # fmt: skip


def test_rows_of_a_fleet_with_local_ranks_are_ordered_and_compared_together():
    """64 nodes x 8 local ranks, named node<N>_rank<local>: 512 rows, labelled node/rank, one
    median over all of them; the odd one out is found by its label."""
    summaries = {f"dumps/node{n}_rank{r}.pickle": _summary(10_000 * MiB) for n in range(64) for r in range(8)}
    summaries["dumps/node17_rank3.pickle"] = _summary(14_000 * MiB)
    rows = rank_rows(summaries, {p: host_of(p) for p in summaries})
    assert len(rows) == 512
    assert [r.rank for r in rows] == sorted(r.rank for r in rows)  # by rank first
    assert rows[63].label == "node63/rank0" and rows[64].label == "node0/rank1"
    assert [r.label for r in rows[:3]] == ["node0/rank0", "node1/rank0", "node2/rank0"]  # then by host
    assert len({r.label for r in rows}) == 512
    (odd,) = [r for r in rows if r.flags]
    assert odd.label == "node17/rank3" and odd.host == "node17" and odd.rank == 3
    notice = rank_notice(rows)
    assert notice is not None and "\n" not in notice
    assert notice.startswith("ranks 0–7 are each in several files (512 files)")
    assert "labelled host/rank (e.g. node0/rank0)" in notice
    assert format_ranks(rows).startswith("512 files; 1 stands out: node17/rank3: peak requested 13.67 GiB is 40% above")
    odd_names = rank_rows({"a\nb_rank0.pickle": _summary(MiB), "c_rank0.pickle": _summary(MiB)})
    assert "\n" not in (rank_notice(odd_names) or "\n")
    # a fleet without collisions keeps the plain rank numbers and says nothing
    plain = rank_rows({f"oom_rank{r}.pickle": _summary(10_000 * MiB) for r in (10, 2, 1)})
    assert [r.label for r in plain] == ["1", "2", "10"] and rank_notice(plain) is None


def test_api_ranks_with_shared_and_missing_rank_numbers(tmp_path):
    """The issue's example, plus a file without a rank number and a third copy of rank 0 from
    another node: every file gets a row, and the comparison runs over all of them."""
    files = [
        _copy("ddp_nobucketview_rank0", tmp_path / "a_rank0.pickle.xz"),
        _copy("ddp_nobucketview_rank0", tmp_path / "b_rank0.pickle.xz"),
        _copy("ddp_nobucketview_rank1", tmp_path / "c_rank1.pickle.xz"),
        _copy("ddp_nobucketview_rank1", tmp_path / "node3_rank0.pickle.xz"),
        _copy("capture_ddp_rank1", tmp_path / "last.pickle.xz"),
    ]
    rows, errors = api.ranks([*files, files[0]], jobs=2, output=tmp_path / "ranks.html")
    assert errors == {}
    got = [(r.rank, r.label, r.labelled_by, r.host) for r in rows]
    assert got == [
        (0, "a_rank0.pickle.xz", "file", None),
        (0, "b_rank0.pickle.xz", "file", None),
        (0, "node3/rank0", "host", "node3"),
        (1, "1", "rank", None),
        (None, "last.pickle.xz", "file", None),
    ]
    assert [r.summary.reserved for r in rows] == [
        _reserved("ddp_nobucketview_rank0"),
        _reserved("ddp_nobucketview_rank0"),
        _reserved("ddp_nobucketview_rank1"),
        _reserved("ddp_nobucketview_rank1"),
        _reserved("capture_ddp_rank1"),
    ]
    # the 3x-batch rank stands out against the median of all five rows
    assert [r.label for r in rows if r.flags] == ["last.pickle.xz"]
    html = (tmp_path / "ranks.html").read_text()
    assert "Memory across 5 files" in html
    assert "node3/rank0" in html and "a_rank0.pickle.xz" in html and '<p class="note">' in html
    assert "<script" not in html and "http://" not in html and "https://" not in html


def test_api_ranks_hosts_from_sidecars(tmp_path):
    """Rank 0 of two nodes (capture sidecars say node3 and node4) and rank 0 of two runs on one
    host (the original sidecars both say 'vm')."""
    files = [
        _copy("capture_ddp_rank0", tmp_path / "n3" / "job_rank0.pickle.xz", host="node3"),
        _copy("capture_ddp_rank0", tmp_path / "n4" / "job_rank0.pickle.xz", host="node4"),
        _copy("capture_ddp_rank1", tmp_path / "n4" / "job_rank1.pickle.xz", host="node4"),
        _copy("capture_ddp_rank0", tmp_path / "old" / "capture_ddp_rank0.pickle.xz", host="vm"),
        _copy("capture_ddp_rank0", tmp_path / "new" / "capture_ddp_rank0.pickle.xz", host="vm"),
    ]
    rows, errors = api.ranks(files, jobs=1)
    assert errors == {}
    assert [(r.label, r.host) for r in rows] == [
        ("node3/rank0", "node3"),
        ("node4/rank0", "node4"),
        ("new/capture_ddp_rank0.pickle.xz", "vm"),
        ("old/capture_ddp_rank0.pickle.xz", "vm"),
        ("1", "node4"),
    ]
    assert {r.summary.reserved for r in rows[:4]} == {_reserved("capture_ddp_rank0")}


@pytest.fixture()
def colliding(tmp_path: Path) -> list[Path]:
    return [
        _copy("ddp_nobucketview_rank0", tmp_path / "a_rank0.pickle.xz"),
        _copy("ddp_nobucketview_rank0", tmp_path / "b_rank0.pickle.xz"),
        _copy("ddp_nobucketview_rank1", tmp_path / "c_rank1.pickle.xz"),
        _copy("ddp_nobucketview_rank1", tmp_path / "plain.pickle.xz"),
    ]


NOTICE = (
    "snaplab: note: rank 0 is in 2 files and 1 file has no rank number in its name: those rows are labelled by "
    "file name (e.g. a_rank0.pickle.xz); all 4 files are compared together\n"
)


def test_cli_ranks_json_and_html(colliding, tmp_path):
    out_html = tmp_path / "ranks.html"
    r = runner.invoke(app, ["ranks", *map(str, colliding), "--json", "-j", "2", "-o", str(out_html)])
    assert r.exit_code == 0, r.output
    assert r.stderr == f"wrote {out_html}\n" + NOTICE  # the file confirmed, then the one note
    out = json.loads(r.stdout)
    assert out["errors"] == {}
    assert [(x["rank"], x["label"], x["host"]) for x in out["ranks"]] == [
        (0, "a_rank0.pickle.xz", None),
        (0, "b_rank0.pickle.xz", None),
        (1, "1", None),
        (None, "plain.pickle.xz", None),
    ]
    assert [x["path"] for x in out["ranks"]] == [str(colliding[i]) for i in (0, 1, 2, 3)]
    assert [x["reserved_bytes"] for x in out["ranks"]] == [_reserved("ddp_nobucketview_rank0")] * 2 + [
        _reserved("ddp_nobucketview_rank1")
    ] * 2
    html = out_html.read_text()
    assert "Memory across 4 files" in html and "plain.pickle.xz" in html
    assert "rank 0 is in 2 files" in html


def test_cli_ranks_text_with_a_bad_file_too(colliding, tmp_path):
    bad = tmp_path / "d_rank0.pickle"
    bad.write_bytes(b"not a pickle")
    r = runner.invoke(app, ["ranks", *map(str, colliding), str(bad), "-j", "1"])
    assert r.exit_code == 3  # the unreadable file still fails the run, as before
    lines = r.stderr.splitlines()
    assert lines[0] == NOTICE.strip() and lines[1].startswith(f"snaplab: error: {bad}")
    assert r.stdout.startswith("4 files, none stands out.")
    table = r.stdout.splitlines()[4:]
    assert [line.split()[0] for line in table] == ["a_rank0.pickle.xz", "b_rank0.pickle.xz", "1", "plain.pickle.xz"]


def test_console_script_ranks_with_shared_numbers(colliding, tmp_path):
    exe = shutil.which("snaplab", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "snapshot_lab"]
    p = subprocess.run(
        [*cmd, "ranks", *map(str, colliding), "--json", "-o", str(tmp_path / "ranks.html")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    # the written file confirmed, then one note: no progress bar, no error
    assert p.stderr == f"wrote {tmp_path / 'ranks.html'}\n" + NOTICE
    assert [x["label"] for x in json.loads(p.stdout)["ranks"]] == [
        "a_rank0.pickle.xz",
        "b_rank0.pickle.xz",
        "1",
        "plain.pickle.xz",
    ]
    assert (tmp_path / "ranks.html").stat().st_size > 0


def test_two_ranks_are_compared_with_each_other_not_with_their_median():
    """capture_ddp: rank 1 ran a 3x batch. With two files the median is their mean, half way to
    the odd one ('43% above the median 3.05 GiB' undersold a rank holding 2.5x its peer's memory):
    the flag says it against the peer."""
    rows, errors = api.ranks([sample_path("capture_ddp_rank0"), sample_path("capture_ddp_rank1")], jobs=1)
    assert errors == {} and rows[0].flags == []
    peaks = [r.summary.peak_requested_bytes for r in rows]
    assert peaks == [1_860_534_280, 4_682_797_064]  # requested_bytes.all.peak of each rank
    assert rows[1].flags[0] == "peak requested 4.36 GiB is 2.5× its peer's 1.73 GiB"
    assert rows[1].flags[1].startswith("reserved 4.65 GiB is 2.5× its peer's")


def test_a_rank_far_below_its_peer_says_its_share_and_many_ranks_a_multiple_of_the_median():
    low = rank_outliers({0: _summary(10_000 * MiB), 1: _summary(2_000 * MiB)})
    assert low[0][0] == "peak requested 9.77 GiB is 5.0× its peer's 1.95 GiB"  # a pair: each flag says the other
    assert low[1][0] == "peak requested 1.95 GiB is 20% of its peer's 9.77 GiB"
    many = rank_outliers({i: _summary(10_000 * MiB) for i in range(4)} | {4: _summary(25_000 * MiB)})
    assert many[4][0] == "peak requested 24.41 GiB is 2.5× the median 9.77 GiB"
