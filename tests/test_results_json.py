"""``--json`` comes from the result objects' ``to_dict()`` (issue #22), byte for byte what the
command line printed when it still built the JSON itself.

``tests/pins/cli_json.json`` holds ``ranks``, ``check``, ``leaks``, ``whatif --set`` and one
file's ``findings`` JSON on real samples, captured with the code before the change (the
pipeline pair; DDP ranks with a missing file; a gate failing on reserved memory and leaks, on an
OOM, on growth over a baseline, and one passing). tests/test_golden.py pins more samples of
leaks, whatif and findings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import app
from snapshot_lab.results import Leaks, Ranks, Violations, WhatIfs

ROOT = Path(__file__).resolve().parents[1]
PINNED = json.loads((Path(__file__).parent / "pins" / "cli_json.json").read_text())

runner = CliRunner()


def _printed(obj: object) -> str:
    """What the command line prints for a dict (cli._print_json)."""
    return json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"


@pytest.mark.parametrize("case", sorted(PINNED))
def test_json_output_is_unchanged(case, monkeypatch):
    monkeypatch.chdir(ROOT)  # the pinned arguments are relative to the checkout
    pinned = PINNED[case]
    r = runner.invoke(app, pinned["args"])
    assert (r.exit_code, r.stdout) == (pinned["exit_code"], pinned["stdout"])


def test_ranks_result_prints_itself(monkeypatch):
    monkeypatch.chdir(ROOT)
    pinned = PINNED["ranks_json_ddp_missing"]
    result = api.ranks(pinned["args"][1:4], jobs=1)
    assert isinstance(result, Ranks)
    rows, errors = result  # still unpacks as it always did
    assert [row.rank for row in rows] == [0, 1] and list(errors) == ["sample_snapshots/missing_rank2.pickle"]
    assert _printed(result.to_dict()) == pinned["stdout"]


def test_check_result_prints_itself(monkeypatch):
    monkeypatch.chdir(ROOT)
    violations = api.check("sample_snapshots/leak_graph.pickle.xz", max_reserved="500MiB", no_leaks=True)
    assert isinstance(violations, Violations) and [v.limit for v in violations] == ["max_reserved", "no_leaks"]
    assert _printed(violations.to_dict()) == PINNED["check_json_leak"]["stdout"]


def test_leaks_and_whatif_results_print_themselves(monkeypatch):
    monkeypatch.chdir(ROOT)
    leaks = api.leaks("sample_snapshots/leak_graph.pickle.xz")
    assert isinstance(leaks, Leaks) and leaks.to_dict()["growth_bytes_per_iteration"] == 409604
    assert _printed(leaks.to_dict()) == PINNED["leaks_json_leak_graph"]["stdout"]
    whatifs = api.whatif("sample_snapshots/whatif_default_uncapped.pickle.xz", settings=["expandable_segments:True"])
    assert isinstance(whatifs, WhatIfs)
    assert _printed(whatifs.to_dict()) == PINNED["whatif_json_set"]["stdout"]
    assert WhatIfs().to_dict()["scenarios"] == []  # no device: the shape stays
