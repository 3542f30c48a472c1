"""Griffe extension for the API page: the docstrings' Sphinx roles as Markdown code.

The package's docstrings cross-reference with Sphinx roles (``:class:`~snapshot_lab.x.Y```),
which Markdown would show as they are; this rewrites each into a code span of the name
(``Y``, or the full path when the ``~`` is missing), before mkdocstrings renders the page.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2).strip()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *args: Any, **kwargs: Any) -> None:
        obj = kwargs.get("obj", args[1] if len(args) > 1 else None)
        docstring = getattr(obj, "docstring", None)
        if docstring is not None and ":" in docstring.value:
            docstring.value = ROLE.sub(_code, docstring.value)
