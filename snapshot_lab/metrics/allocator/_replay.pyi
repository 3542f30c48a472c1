"""Type stub of the compiled allocator replay (``_replay.c``); see :mod:`.native`."""

from typing import Any

class Unsupported(ValueError): ...

class Engine:
    def __init__(
        self,
        max_split_size: int | None,
        max_non_split_rounding: int,
        divisions: tuple[int, ...],
        gc_threshold: float,
        expandable: bool,
        limit: int | None,
        limit_is_cap: bool,
        top_down: bool,
    ) -> None: ...
    def run(
        self,
        kind: Any,
        key: Any,
        size: Any,
        stream: Any,
        index: Any,
        block_size_out: Any | None,
        level_out: Any | None,
    ) -> tuple[int, bool | None, list[int]]: ...
    def run_tape(self, which: Any, is_free: Any, size: Any, stream: Any) -> int: ...
    def stats(self) -> tuple[int, int, int, int, int, int, int, list[tuple[int, int]], int]: ...
    def reset_stats(self) -> None: ...
    def mark_placed(self) -> None: ...
    def free_unplaced(self) -> None: ...
    def layout(self) -> list[list[tuple[int, bool]]]: ...
