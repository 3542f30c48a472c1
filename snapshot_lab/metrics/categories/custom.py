"""Your own categories: rules on allocation stacks, tried before the built-in ones.

A rule is ``NAME=KIND:PATTERN``. ``KIND`` says what of each stack frame the pattern is matched
against:

- ``file:GLOB`` the frame's file path (``/`` separators; ``*`` matches ``/`` too, so
  ``file:*/models/gpt2.py`` or ``file:*modeling_llama.py``);
- ``func:GLOB`` the frame's function name (``func:*attn*``);
- ``frame:GLOB`` the frame as ``file:line:function`` (``frame:*train.py:42:*``);
- ``re:REGEX`` a Python regular expression searched in ``file:line:function``
  (``re:modeling_gpt2\\.py:\\d+:forward$``).

Globs are :mod:`fnmatch`'s, matched whole and case-sensitively. An allocation matches a rule when
any frame of its stack does; the rules are tried in the order given and the first that matches
labels it (later rules and the built-in ones are not consulted). A name that is a built-in category
(``activation``) forces that category; any other name is a new category, shown after the built-in
ones. Memory without a stack, or whose stack no rule matches, keeps its built-in category.

Only what is shown changes (the categories of ``stats``, the report, ``diff``, ``ranks`` and the
Perfetto export): the analyses that reason about what a built-in category means (fit, plan, the
findings, leaks, what-if) read the built-in categories whatever the rules say.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...frames import SnapshotFrames
from .rules import CATEGORIES, RULES

# what each kind of pattern is matched against (see the module docstring)
KINDS = ("file", "func", "frame", "re")
MAX_NAME_CHARS = 64
MAX_PATTERN_CHARS = 500
MAX_RULES = 100
# a category's name: a word, as the built-in ones are (it becomes a JSON key, a column, a CSS class)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
USER_RULE_PREFIX = "user:"  # the rule name of what a rule labelled: ``user:NAME=KIND:PATTERN``


class CategoryRuleError(ValueError):
    """A rule that cannot be used; the message says why in one line, quoting the rule."""


@dataclass(frozen=True)
class CategoryRule:
    """One rule: the category ``name`` of allocations with a frame that ``pattern`` of ``kind``
    matches."""

    name: str
    kind: str
    pattern: str

    @property
    def spec(self) -> str:
        """The rule as the user wrote it: ``NAME=KIND:PATTERN``."""
        return f"{self.name}={self.kind}:{self.pattern}"

    @property
    def rule_name(self) -> str:
        """What labelled the memory it matches, beside the built-in :data:`~.rules.RULES`."""
        return USER_RULE_PREFIX + self.spec

    def regex(self) -> re.Pattern[str]:
        """The pattern as a regular expression over the text of :meth:`subject`."""
        if self.kind == "re":
            return re.compile(self.pattern)
        return re.compile(r"\A" + fnmatch.translate(self.pattern))  # whole, as fnmatch matches

    def subject(self, files: pd.Series, lines: pd.Series, names: pd.Series) -> pd.Series:
        """The text of every frame this rule's pattern reads."""
        if self.kind == "file":
            return files
        if self.kind == "func":
            return names
        return files + ":" + lines.astype("int64").astype(str) + ":" + names


@dataclass(frozen=True)
class CategoryRules:
    """Rules in the order they are tried, with the vocabulary they make: the built-in
    categories, then each new name in the order of its first rule."""

    rules: tuple[CategoryRule, ...]

    @property
    def names(self) -> tuple[str, ...]:
        new = [r.name for r in self.rules if r.name not in CATEGORIES]
        return (*CATEGORIES, *dict.fromkeys(new))

    @property
    def rule_names(self) -> tuple[str, ...]:
        """The built-in rules, then one per user rule (codes beside :data:`~.rules.RULES`)."""
        return (*RULES, *(r.rule_name for r in self.rules))

    def codes(self) -> np.ndarray:
        """Each rule's category code (its index in :attr:`names`)."""
        index = {name: i for i, name in enumerate(self.names)}
        return np.array([index[r.name] for r in self.rules], dtype=np.int64)

    def to_dict(self) -> list[dict[str, str]]:
        return [{"name": r.name, "kind": r.kind, "pattern": r.pattern} for r in self.rules]


def parse_rule(text: str) -> CategoryRule:
    """``NAME=KIND:PATTERN`` as a rule; a :class:`CategoryRuleError` says what is wrong."""
    name, eq, rest = text.partition("=")
    name = name.strip()
    if not eq:
        raise CategoryRuleError(f"{text!r} is not NAME=KIND:PATTERN (like attention=func:*attn*)")
    kind, colon, pattern = rest.partition(":")
    return make_rule(name, kind.strip() if colon else "", pattern)


def make_rule(name: str, kind: str, pattern: str) -> CategoryRule:
    """A checked rule: a word of at most :data:`MAX_NAME_CHARS` for a name, a known kind, a
    pattern that compiles."""
    shown = name[:MAX_NAME_CHARS] + ("..." if len(name) > MAX_NAME_CHARS else "")
    if not name:
        raise CategoryRuleError("a category needs a name (NAME=KIND:PATTERN)")
    if len(name) > MAX_NAME_CHARS:
        raise CategoryRuleError(f"category name {shown!r} is longer than {MAX_NAME_CHARS} characters")
    if not _NAME.fullmatch(name):
        raise CategoryRuleError(
            f"category name {shown!r}: letters, digits, '_', '.' and '-' only, starting with a letter or '_'"
        )
    if kind not in KINDS:
        raise CategoryRuleError(
            f"rule for {name!r}: the pattern starts with its kind, one of {', '.join(k + ':' for k in KINDS)}"
        )
    if not pattern or len(pattern) > MAX_PATTERN_CHARS:
        raise CategoryRuleError(f"rule for {name!r}: the pattern must be 1 to {MAX_PATTERN_CHARS} characters")
    rule = CategoryRule(name, kind, pattern)
    try:
        rule.regex()
    except re.error as exc:
        raise CategoryRuleError(f"rule for {name!r}: not a regular expression: {exc}") from None
    return rule


def rules_from_mapping(mapping: object) -> list[CategoryRule]:
    """A rules file's content (``{name: pattern or [patterns]}``, in the file's order) as rules."""
    if not isinstance(mapping, dict):
        raise CategoryRuleError('expected a table of NAME = "KIND:PATTERN" (or a list of them)')
    out = []
    for name, value in mapping.items():
        patterns = value if isinstance(value, list) else [value]
        for pattern in patterns:
            if not isinstance(pattern, str):
                raise CategoryRuleError(f"the patterns of {str(name)[:MAX_NAME_CHARS]!r} must be strings")
            kind, colon, text = pattern.partition(":")
            out.append(make_rule(str(name), kind.strip() if colon else "", text))
    return out


def category_rules(rules: list[CategoryRule]) -> CategoryRules | None:
    """The rules to apply (None: none, the built-in categories alone)."""
    if len(rules) > MAX_RULES:
        raise CategoryRuleError(f"{len(rules)} rules: at most {MAX_RULES}")
    return CategoryRules(tuple(rules)) if rules else None


def stack_rules(frames: SnapshotFrames, rules: CategoryRules) -> np.ndarray:
    """Table stack_id -> index of the first rule one of its frames matches (-1: none); one slot
    more than the largest stack id, so that stack id -1 (no stack) reads -1."""
    sids = frames.stacks["stack_id"].to_numpy(dtype=np.int64)
    table = np.full(int(sids.max(initial=-1)) + 2, -1, dtype=np.int64)
    if frames.stacks.empty:
        return table
    sf = frames.stack_frames
    files = sf["filename"].astype(str).str.replace("\\", "/", regex=False)
    names, lines = sf["name"].astype(str), sf["line"]
    for i, rule in enumerate(rules.rules):
        search = rule.regex().search  # Python's re, as documented (pandas may hand strings to RE2)
        texts = rule.subject(files, lines, names).tolist()
        hit = np.fromiter((search(text) is not None for text in texts), dtype=bool, count=len(texts))
        frame_ids = sf.loc[hit, "frame_id"]
        matched = np.unique(sids[frames.stacks["frame_id"].isin(frame_ids).to_numpy()])
        first = matched[table[matched] < 0]  # an earlier rule keeps what it matched
        table[first] = i
    return table
