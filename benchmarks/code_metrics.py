"""Readability numbers of a Python package, per file and in total (issue #22).

For every ``.py`` file under the given paths (default ``snapshot_lab/``) it counts:

- parameters: every function and lambda parameter except ``self``/``cls``, and how many are one or two letters;
- assigned names: every name bound by an assignment, a ``for``/``with``/``except`` target, a comprehension,
  a walrus or an import alias, and how many are one or two letters (``_`` is not counted);
- lines over 100 characters;
- trailing comments (a comment after code on the same line) and those whose line is over 80 characters;
- string literals over 100 characters, docstrings excluded (an f-string counts its literal text).

Usage::

    python benchmarks/code_metrics.py [PATH ...] [--files] [--json]
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from dataclasses import asdict, dataclass, fields
from pathlib import Path

SHORT_NAME_MAX = 2
LONG_LINE = 100
LONG_COMMENT_LINE = 80
LONG_STRING = 100


@dataclass
class FileMetrics:
    """The counts of one file (or the sum over several)."""

    parameters: int = 0
    short_parameters: int = 0
    assigned: int = 0
    short_assigned: int = 0
    lines: int = 0
    long_lines: int = 0
    trailing_comments: int = 0
    long_trailing_comments: int = 0
    long_strings: int = 0

    def add(self, other: FileMetrics) -> None:
        """Add another file's counts to these."""
        for field in fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def shares(self) -> dict[str, float]:
        """The short-name shares, in percent."""
        return {
            "short_parameters_pct": round(100 * self.short_parameters / max(self.parameters, 1), 1),
            "short_assigned_pct": round(100 * self.short_assigned / max(self.assigned, 1), 1),
        }


def _is_short(name: str) -> bool:
    return name != "_" and len(name) <= SHORT_NAME_MAX


def _docstring_nodes(tree: ast.AST) -> set[int]:
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return docstrings


def _literal_length(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value)
    if isinstance(node, ast.JoinedStr):
        return sum(len(part.value) for part in node.values if isinstance(part, ast.Constant))
    return 0


def _count_names(tree: ast.AST, metrics: FileMetrics) -> None:
    inside_fstring: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inside_fstring.update(id(part) for part in node.values)
    docstrings = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.arguments):
            every = [*node.posonlyargs, *node.args, *node.kwonlyargs]
            every += [arg for arg in (node.vararg, node.kwarg) if arg is not None]
            for arg in every:
                if arg.arg in ("self", "cls"):
                    continue
                metrics.parameters += 1
                metrics.short_parameters += _is_short(arg.arg)
        bound: list[str] = []
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.append(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.append(node.name)
        elif isinstance(node, ast.alias) and node.asname:
            bound.append(node.asname)
        for name in bound:
            if name == "_":
                continue
            metrics.assigned += 1
            metrics.short_assigned += _is_short(name)
        if id(node) in docstrings or id(node) in inside_fstring:
            continue
        if _literal_length(node) > LONG_STRING:
            metrics.long_strings += 1


def _count_lines(source: str, metrics: FileMetrics) -> None:
    lines = source.splitlines()
    metrics.lines = len(lines)
    metrics.long_lines = sum(len(line) > LONG_LINE for line in lines)
    code_rows: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for token in tokens:
        if token.type not in skip:
            code_rows.update(range(token.start[0], token.end[0] + 1))
    for token in tokens:
        if token.type == tokenize.COMMENT and token.start[0] in code_rows:
            metrics.trailing_comments += 1
            metrics.long_trailing_comments += len(lines[token.start[0] - 1]) > LONG_COMMENT_LINE


def measure_file(path: Path) -> FileMetrics:
    """Count one file."""
    source = path.read_text(encoding="utf-8")
    metrics = FileMetrics()
    _count_names(ast.parse(source), metrics)
    _count_lines(source, metrics)
    return metrics


def measure(paths: list[Path]) -> tuple[dict[str, FileMetrics], FileMetrics]:
    """Count every ``.py`` file under ``paths``; return the per-file counts and their sum."""
    per_file: dict[str, FileMetrics] = {}
    for root in paths:
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for path in files:
            per_file[str(path)] = measure_file(path)
    total = FileMetrics()
    for metrics in per_file.values():
        total.add(metrics)
    return per_file, total


def _row(name: str, metrics: FileMetrics) -> str:
    shares = metrics.shares()
    return (
        f"{name:<55} params {metrics.short_parameters:4}/{metrics.parameters:<5} "
        f"({shares['short_parameters_pct']:5.1f}%)  names {metrics.short_assigned:4}/{metrics.assigned:<5} "
        f"({shares['short_assigned_pct']:5.1f}%)  >100 {metrics.long_lines:4}  "
        f"trailing# {metrics.trailing_comments:4} (>80: {metrics.long_trailing_comments:3})  "
        f"str>100 {metrics.long_strings:4}"
    )


def main(argv: list[str] | None = None) -> int:
    """Print the counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("snapshot_lab")])
    parser.add_argument("--files", action="store_true", help="one row per file")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    per_file, total = measure(args.paths)
    if args.json:
        payload = {
            "files": {name: {**asdict(metrics), **metrics.shares()} for name, metrics in per_file.items()},
            "total": {**asdict(total), **total.shares()},
        }
        json.dump(payload, sys.stdout, indent=1)
        print()
        return 0
    if args.files:
        for name, metrics in per_file.items():
            print(_row(name, metrics))
    print(_row(f"TOTAL ({len(per_file)} files)", total))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
