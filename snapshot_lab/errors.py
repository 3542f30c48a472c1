"""Errors that reach the user, each with the process exit code it maps to.

Exit codes (documented in the README):

==== =====================================================================
0    success
1    a gate failed (``snaplab check``) — reserved for commands that judge
2    usage error (bad option or argument; typer/click's own code)
3    the input is not a readable snapshot (missing, truncated, garbage, unsafe)
4    the output could not be written
70   internal error: a bug in snaplab (rerun with ``--debug`` for a traceback)
==== =====================================================================
"""

from __future__ import annotations

import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_GATE_FAILED = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_OUTPUT = 4
EXIT_INTERNAL = 70


class SnaplabError(Exception):
    """Base class for errors reported to the user as one line, without a traceback."""

    exit_code = EXIT_INTERNAL

    def message(self) -> str:
        return str(self)


class SnapshotFormatError(SnaplabError):
    """The file is not a snapshot snaplab can read (or refuses to read)."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class OutputError(SnaplabError):
    """An output file or folder could not be written."""

    exit_code = EXIT_OUTPUT

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: cannot write: {reason}")


class UsageError(SnaplabError):
    """Options that make no sense together (found after parsing)."""

    exit_code = EXIT_USAGE


# How a parameter is written in a message: its name, and with a value (``{format:csv}`` in a
# template) the name given that value.
Spelling = Callable[[str, str | None], str]


def python_spelling(parameter: str, value: str | None) -> str:
    """A parameter as a Python caller writes it: ``pp_split``, ``format='csv'``, ``tp=4``."""
    if value is None:
        return parameter
    try:
        float(value)
    except ValueError:
        return f"{parameter}={value!r}"
    return f"{parameter}={value}"


class _Spelled:
    """One parameter's place in a template; its format spec is the value it is shown with."""

    def __init__(self, parameter: str, spelling: Spelling) -> None:
        self.parameter = parameter
        self.spelling = spelling

    def __format__(self, value: str) -> str:
        return self.spelling(self.parameter, value or None)


class ParameterError(UsageError, ValueError):
    """A bad value for one parameter of an :mod:`snapshot_lab.api` function, said in the API's
    words (``pp_split: blocks per stage...``); the command line says it in its own
    (``--pp-split: ...``) through :meth:`spelled`.

    ``template`` names parameters in braces (``"{max_growth} needs {baseline}"``; ``{format:csv}``
    or ``{tp:{n}}`` for a parameter with a value); ``values`` fill the other fields (``{got!r}``),
    and are never read as a template themselves, except another ``ParameterError``, which is
    spelled the same way (``"{strategy}: {problem}"`` around the strategy's own error). It is a
    ``ValueError`` too, as a bad argument is in Python.
    """

    def __init__(self, parameter: str, template: str, **values: Any) -> None:
        self.parameter = parameter
        self.template = template
        self.values = values
        super().__init__(self.spelled(python_spelling))

    def spelled(self, spelling: Spelling) -> str:
        """The message with every parameter written by ``spelling`` (name, value or None)."""
        values = {
            name: value.spelled(spelling) if isinstance(value, ParameterError) else value
            for name, value in self.values.items()
        }
        fields = {
            name: _Spelled(name, spelling)
            for _, name, _, _ in string.Formatter().parse(self.template)
            if name and name not in values
        }
        return self.template.format(**fields, **values)
