"""``RanksResult.to_dict()`` and ``CheckResult.to_dict()`` print exactly what ``ranks --json`` and
``check --json`` print (the CLI is to build its JSON from them)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import app
from snapshot_lab.metrics.compare import CheckResult, RanksResult

from .conftest import sample_path

runner = CliRunner()


def _as_cli_prints(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"


def test_ranks_result_is_what_ranks_json_prints():
    files = [str(sample_path(f"pp_gpipe_transformer_rank{r}")) for r in (0, 1)]
    printed = runner.invoke(app, ["ranks", *files, "--json", "-j", "1", "-q"]).stdout
    rows, errors = api.ranks(files, jobs=1)
    result = RanksResult.of(rows, errors)
    assert result.pipeline is not None and [f.id for f in result.findings] == ["pipeline-stage-imbalance"]
    assert _as_cli_prints(result.to_dict()) == printed


def test_check_result_is_what_check_json_prints():
    args = ["--max-reserved", "500MiB", "--no-leaks"]
    printed = runner.invoke(app, ["check", str(sample_path("leak_graph")), *args, "--json", "-q"]).stdout
    violations = api.check(sample_path("leak_graph"), max_reserved="500MiB", no_leaks=True)
    result = CheckResult(violations)
    assert not result.ok and [v.limit for v in violations] == ["max_reserved", "no_leaks"]
    assert _as_cli_prints(result.to_dict()) == printed
