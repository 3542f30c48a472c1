"""The command line's options, each said once (issue #22): ``--json``, ``--quiet`` and ``--debug``
(and the snapshot argument) come from the shared ``Annotated`` types of ``cli.py``, so their
flags and help are the same in every command; every command and every option has help."""

from __future__ import annotations

import inspect

import pytest
import typer.main

from snapshot_lab import cli

COMMANDS = typer.main.get_command(cli.app).commands  # type: ignore[attr-defined]

SHARED = {"json_out": "JsonOpt", "quiet": "QuietOpt", "debug": "DebugOpt"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_common_options_come_from_one_place(name):
    parameters = inspect.signature(getattr(cli, name)).parameters
    declared = {param: str(parameters[param].annotation) for param in SHARED if param in parameters}
    assert declared == {param: SHARED[param] for param in declared}
    assert "debug" in declared  # every command can show a traceback
    if "snapshot" in parameters and name != "findings":  # findings takes several files
        assert str(parameters["snapshot"].annotation) == "SnapshotArg"


def test_the_shared_options_read_the_same_everywhere():
    helps: dict[str, set[tuple[tuple[str, ...], str]]] = {}
    for command in COMMANDS.values():
        for param in command.params:
            if param.name in SHARED:
                helps.setdefault(param.name, set()).add((tuple(param.opts), param.help))
    assert {name: len(forms) for name, forms in helps.items()} == {"json_out": 1, "quiet": 1, "debug": 1}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_and_option_has_help(name):
    command = COMMANDS[name]
    assert command.help and len(command.help.split()) >= 5
    options = [param for param in command.params if param.param_type_name == "option"]
    assert [param.name for param in options if not param.help] == []
    arguments = [param for param in command.params if param.param_type_name == "argument"]
    assert [param.name for param in arguments if not getattr(param, "help", None)] == []
