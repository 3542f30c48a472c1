"""What ``snapshot_lab.metrics._memo`` keeps per object, and what a caller may drop of it."""

from __future__ import annotations

from snapshot_lab.metrics import _memo


class Owner:
    """Any object the memo may key on (frames in the package)."""


def test_forget_named_drops_that_table_for_every_argument_and_nothing_else():
    owner = Owner()
    keys = [("timeline", 0, 1, 2), ("timeline", 1, 1, 2), "timeline", "timelines", ("other", "timeline"), "categories"]
    for key in keys:
        _memo.memo(owner, key, lambda key=key: str(key))
    _memo.forget_named(owner, "timeline")
    assert sorted(map(str, _memo._STORE[id(owner)])) == sorted(map(str, keys[3:]))
    assert _memo.memo(owner, ("timeline", 0, 1, 2), lambda: "again") == "again"  # computed anew
    _memo.forget_named(Owner(), "timeline")  # an object it keeps nothing for: nothing to do
