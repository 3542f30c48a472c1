"""The stack frames' file names with forward slashes, computed once per snapshot: the rules that
look for a library's files in the stacks (the pipeline's stages and schedule, the strategies)
match paths written on Linux and Windows alike."""

from __future__ import annotations

from typing import Any

from .._memo import memo


def slashed_filenames(stack_frames: Any) -> Any:
    """``stack_frames["filename"]`` as text with every backslash a slash (a pandas Series)."""
    return memo(
        stack_frames,
        "slashed_filenames",
        lambda: stack_frames["filename"].astype(str).str.replace("\\", "/", regex=False),
    )
