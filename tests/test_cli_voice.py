"""The CLI as one voice (issue #21): every command that writes a file confirms it the same way,
`check` never passes an OOM by default, sizes need a unit, and the what-if's header says how a
limit was inferred once."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_GATE_FAILED, EXIT_USAGE

from .conftest import sample_path

runner = CliRunner()


def _writers(tmp_path):
    one, two = str(sample_path("ddp_bucketview_rank0")), str(sample_path("ddp_bucketview_rank1"))
    return {
        "report": ["report", one],
        "diff": ["diff", one, two],
        "plan": ["plan", str(sample_path("single_mlp")), "--world-size", "2"],
        "ranks": ["ranks", one, two, "--jobs", "1"],
    }


@pytest.mark.parametrize("command", ["report", "diff", "plan", "ranks"])
def test_every_written_file_is_confirmed_the_same_way(tmp_path, command):
    out = tmp_path / f"{command}.html"
    r = runner.invoke(app, [*_writers(tmp_path)[command], "-o", str(out), "-q"])
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 1000
    assert f"wrote {out}" in r.stderr.splitlines()
    assert str(out) not in r.stdout


def test_check_fails_an_oom_by_default():
    """With no limit given, an OOM snapshot must not pass a CI gate ('ok: all limits hold')."""
    r = runner.invoke(app, ["check", str(sample_path("oom_fragmentation")), "--json"])
    assert r.exit_code == EXIT_GATE_FAILED
    assert [v["limit"] for v in json.loads(r.stdout)["violations"]] == ["no_oom"]
    allowed = runner.invoke(app, ["check", str(sample_path("oom_fragmentation")), "--allow-oom"])
    assert allowed.exit_code == 0 and "an OOM allowed" in allowed.stdout
    healthy = runner.invoke(app, ["check", str(sample_path("transformer_varlen"))])
    assert healthy.exit_code == 0 and healthy.stdout.strip() == "ok: all limits hold"


@pytest.mark.parametrize(
    "args",
    [
        ["check", "transformer_varlen", "--max-reserved", "40"],
        ["check", "transformer_varlen", "--max-peak", "2.5"],
        ["whatif", "oom_capacity", "--memory-limit", "6442450944"],
    ],
)
def test_sizes_without_a_unit_are_refused(args):
    command, name, *rest = args
    r = runner.invoke(app, [command, str(sample_path(name)), *rest])
    assert r.exit_code == EXIT_USAGE
    assert "a size needs a unit" in r.output


def test_sizes_with_a_unit_still_work():
    r = runner.invoke(app, ["check", str(sample_path("transformer_varlen")), "--max-reserved", "40B"])
    assert r.exit_code == EXIT_GATE_FAILED and "exceeds 40 B" in r.stdout


def test_the_whatif_header_says_how_the_limit_was_inferred_once():
    r = runner.invoke(app, ["whatif", str(sample_path("oom_capacity"))])
    assert r.exit_code == 0, r.output
    header = r.stdout.splitlines()[0]
    assert header.count("(inferred") == 1


@pytest.mark.parametrize("size", ["lots", "-3GiB", "nanGiB", "infGiB", "GiB"])
def test_a_size_that_is_no_size_gets_one_clear_line(size):
    """Before, ``lots`` reached ``float()`` and the user read "could not convert string to float"."""
    r = runner.invoke(app, ["check", str(sample_path("transformer_varlen")), "--max-reserved", size])
    assert r.exit_code == EXIT_USAGE
    assert f"not a byte size: {size!r}" in r.output and "float" not in r.output
