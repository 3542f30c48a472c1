"""Errors in each one's own words (issue #22): the Python API names its parameters (``pp_split``),
the command line names its flags (``--pp-split``), translated from the API's error through the
typer options, not through a second table.

``tests/pins/cli_errors.json`` holds the one line each bad command printed on stderr when the
translation was introduced (captured before the change; four lines changed on purpose then:
``fit`` used to print the API's names, ``--memory-limit``/``--recorded-batch``/``--batch-scale``
now, and ``--max-growth needs --baseline (the snapshot to compare against)`` replaced
``... --baseline OLD_SNAPSHOT``, which a Python caller could not read).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import _flags, app
from snapshot_lab.errors import EXIT_USAGE, ParameterError, UsageError, python_spelling

from .conftest import sample_path

ROOT = Path(__file__).resolve().parents[1]
PINNED = json.loads((Path(__file__).parent / "pins" / "cli_errors.json").read_text())

runner = CliRunner()


# --------------------------------------------------------------------------- the API's words

API_CASES = {
    "plan_pp_split": (
        lambda: api.plan(sample_path("single_mlp"), world_size=2, strategy="pp", pp_split="4,x"),
        "pp_split",
        "pp_split: blocks per stage, like 4,4 (got '4,x')",
    ),
    "plan_world_size": (
        lambda: api.plan(sample_path("single_mlp"), world_size=0),
        "world_size",
        "world_size must be at least 1",
    ),
    "plan_memory_limit": (
        lambda: api.plan(sample_path("single_mlp"), world_size=2, strategy="fsdp", memory_limit="40"),
        "memory_limit",
        "memory_limit: a size needs a unit: '40' (try 40GiB, 512MiB, or 40B for bytes)",
    ),
    "plan_strategy": (
        lambda: api.plan(sample_path("single_mlp"), world_size=2, strategy="nope"),
        "strategy",
        "strategy: unknown strategy 'nope': one of ddp, zero1, fsdp, fsdp1, tp, pp, fsdp+tp (or zero2, zero3)",
    ),
    "check_max_peak": (
        lambda: api.check(sample_path("cnn_clean"), max_peak="2.5"),
        "max_peak",
        "max_peak: a size needs a unit: '2.5' (try 40GiB, 512MiB, or 40B for bytes)",
    ),
    "check_growth_no_baseline": (
        lambda: api.check(sample_path("cnn_clean"), max_growth="5%"),
        "max_growth",
        "max_growth needs baseline (the snapshot to compare against)",
    ),
    "check_growth_bad": (
        lambda: api.check(sample_path("cnn_clean"), max_growth="x%", baseline=sample_path("cnn_clean")),
        "max_growth",
        "max_growth: not a percentage: 'x%' (try 5%)",
    ),
    "export_format": (
        lambda: api.export(sample_path("cnn_clean"), output="/nonexistent/never-written", format="xml"),
        "format",
        "format must be one of parquet, csv, json, perfetto",
    ),
    "report_format": (
        lambda: api.report(sample_path("cnn_clean"), output="/nonexistent/never.pdf", format="pdf"),
        "format",
        "format must be one of html, md, png, not 'pdf'",
    ),
    "whatif_settings": (
        lambda: api.whatif(sample_path("cnn_clean"), settings=["x"]),
        "settings",
        "settings: expected KEY:VALUE, got 'x'",
    ),
    "fit_recorded_batch": (
        lambda: api.fit(sample_path("fit_gpt2_b4_complete_python"), recorded_batch=0),
        "recorded_batch",
        "recorded_batch must be at least 1",
    ),
    "fit_batch_scale": (
        lambda: api.fit(sample_path("fit_gpt2_b4_complete_python"), batch_scale=0),
        "batch_scale",
        "batch_scale must be positive",
    ),
}


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_an_api_error_names_the_parameter(case):
    call, parameter, message = API_CASES[case]
    with pytest.raises(ParameterError) as caught:
        call()
    assert caught.value.parameter == parameter
    assert str(caught.value) == caught.value.message() == message
    assert "--" not in message
    # a bad argument, as Python has it; and one line on the command line, as every usage error
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, UsageError)


def test_a_parameter_with_a_value_is_written_as_each_caller_writes_it():
    exc = ParameterError("format", "parquet needs pyarrow (or {format:csv})")
    assert exc.message() == "parquet needs pyarrow (or format='csv')"
    assert exc.spelled(lambda name, value: f"--{name} {value}") == "parquet needs pyarrow (or --format csv)"
    assert python_spelling("pp_split", None) == "pp_split"


def test_values_are_never_read_as_a_template():
    exc = ParameterError("pp_split", "{pp_split}: got {got!r}", got="{world_size}")
    assert exc.message() == "pp_split: got '{world_size}'"


# --------------------------------------------------------------------------- the command line's words


@pytest.mark.parametrize("case", sorted(PINNED))
def test_a_cli_error_names_the_flag_as_pinned(case, monkeypatch):
    monkeypatch.chdir(ROOT)  # the pinned arguments are relative to the checkout
    pinned = PINNED[case]
    r = runner.invoke(app, pinned["args"])
    assert (r.exit_code, r.stderr) == (pinned["exit_code"], pinned["stderr"])
    assert r.stdout == "" and "Traceback" not in r.output


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["plan", "single_mlp", "--strategy", "pp", "--world-size", "2", "--pp-split", "4,x"], "--pp-split:"),
        (["whatif", "cnn_clean", "--set", "x"], "--set:"),
        (["fit", "fit_gpt2_b4_complete_python", "--recorded-batch", "0"], "--recorded-batch must"),
        (["check", "cnn_clean", "--max-growth", "5%"], "--max-growth needs --baseline"),
    ],
)
def test_a_cli_error_names_the_flag(args, flag):
    command, name, *rest = args
    r = runner.invoke(app, [command, str(sample_path(name)), *rest, "-q"])
    assert r.exit_code == EXIT_USAGE
    assert r.stderr.startswith(f"snaplab: error: {flag}")
    assert "_" not in r.stderr.split(":")[2]  # no API parameter name in what it says is wrong


def test_each_parameter_name_means_one_flag_in_every_command():
    """The translation reads the typer options of all commands at once, so a name must not be
    two different flags in two commands (``format`` is ``--format`` in export and report)."""
    seen: dict[str, set[str]] = {}
    for command in typer.main.get_command(app).commands.values():
        for param in command.params:
            if param.param_type_name == "option":
                seen.setdefault(param.name, set()).add(next(o for o in param.opts if o.startswith("--")))
    assert {name: flags for name, flags in seen.items() if len(flags) > 1} == {}
    assert _flags()["settings"] == "--set" and _flags()["pp_split"] == "--pp-split"


def test_an_error_inside_another_is_spelled_the_same_way():
    """How a metric can name a parameter itself (the planner's ``tp``) and api add its own
    (``strategy``): both in the caller's words."""
    inner = ParameterError("tp", "tp over {n} GPUs needs {tp:{n}}", n=4)
    outer = ParameterError("strategy", "{strategy}: {problem}", problem=inner)
    assert outer.message() == "strategy: tp over 4 GPUs needs tp=4"
    assert outer.spelled(lambda name, value: f"--{name}" + (f" {value}" if value else "")) == (
        "--strategy: tp over 4 GPUs needs --tp 4"
    )
