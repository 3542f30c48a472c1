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

from pathlib import Path

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
