"""MkDocs hook: the CLI reference, generated from the typer app at build time so it cannot drift.

A page that holds the line ``<!-- snaplab-cli-reference -->`` gets it replaced by one section per
command of ``snapshot_lab.cli.app``: its help, its usage and every argument and option with its
help and default, read from the click command typer builds (``typer.main.get_command``). Only
attributes that click's and typer's own parameter classes share are used.
"""

from __future__ import annotations

import html
import re
from typing import Any

MARKER = "<!-- snaplab-cli-reference -->"


def _text(text: str | None) -> str:
    """Help text as Markdown that shows it literally (no HTML, no emphasis, no links)."""
    text = html.escape(text or "", quote=False)
    return re.sub(r"([\\`*_\[\]])", r"\\\1", text)


def _type_name(param: Any) -> str:
    click_type = getattr(param, "type", None)
    if click_type is not None and getattr(click_type, "name", None):
        return str(click_type.name).lower()
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    return getattr(annotation, "__name__", "text").lower()


def _is_flag(param: Any) -> bool:
    return bool(getattr(param, "is_flag", False))


def _names(param: Any) -> str:
    names = " / ".join(", ".join(f"`{o}`" for o in opts) for opts in (param.opts, param.secondary_opts) if opts)
    if not _is_flag(param):
        names += f" *{_type_name(param).upper()}*"
    if getattr(param, "multiple", False):
        names += " (repeatable)"
    return names


def _default(param: Any) -> str:
    if getattr(param, "show_default", None) is False or param.required:
        return ""
    default = param.default
    if default is None or (callable(default) and not isinstance(default, type)):
        return ""
    if _is_flag(param):
        if not param.secondary_opts:
            return ""
        chosen = param.opts if default else param.secondary_opts
        return f" \\[default: `{chosen[0]}`\\]"
    if isinstance(default, (list, tuple)):
        return "" if not default else f" \\[default: `{' '.join(map(str, default))}`\\]"
    return f" \\[default: `{default}`\\]"


def _usage(path: str, command: Any) -> str:
    words = [path, "[OPTIONS]"]
    for param in command.params:
        if getattr(param, "param_type_name", "") == "argument" or not getattr(param, "opts", [""])[0].startswith("-"):
            name = param.name.upper()
            if param.nargs == -1:
                name += "..."
            words.append(name if param.required else f"[{name}]")
    settings = getattr(command, "context_settings", None) or {}
    if getattr(command, "commands", None):
        words.append("COMMAND [ARGS]...")
    elif settings.get("ignore_unknown_options") or settings.get("allow_extra_args"):
        words.append("[ARGS]...")
    return " ".join(words)


def _is_argument(param: Any) -> bool:
    return not param.opts[0].startswith("-")


def _command_section(path: str, command: Any, level: int) -> list[str]:
    lines = [f"{'#' * level} `{path}`", ""]
    help_text = (command.help or "").strip()
    for paragraph in help_text.split("\n\n") if help_text else []:
        lines += [_text(paragraph), ""]
    lines += ["```text", _usage(path, command), "```", ""]
    arguments = [p for p in command.params if _is_argument(p) and not getattr(p, "hidden", False)]
    options = [p for p in command.params if not _is_argument(p) and not getattr(p, "hidden", False)]
    if arguments:
        lines += ["**Arguments**", ""]
        for param in arguments:
            required = " (required)" if param.required else ""
            lines.append(f"- `{param.name.upper()}`{required}: {_text(param.help)}")
        lines.append("")
    lines += ["**Options**", ""]
    for param in options:
        required = " (required)" if param.required else ""
        lines.append(f"- {_names(param)}{required}: {_text(param.help)}{_default(param)}")
    lines += ["- `-h`, `--help`: Show the help and exit.", ""]
    return lines


def cli_reference() -> str:
    import typer

    from snapshot_lab.cli import app

    group = typer.main.get_command(app)
    lines = _command_section("snaplab", group, 2)
    for name in sorted(group.commands):
        command = group.commands[name]
        if not getattr(command, "hidden", False):
            lines += _command_section(f"snaplab {name}", command, 2)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_reference())
    return markdown
