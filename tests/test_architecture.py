"""The one-way pipeline, checked: which package may import what, and CLI/API parity."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import snapshot_lab
from snapshot_lab import api, cli

PKG = Path(snapshot_lab.__file__).parent

ALLOWED = {
    "typer": ("cli.py",),
    "jinja2": ("render/",),
    "matplotlib": ("plots/",),
    # torch, lazily, only where a training job runs: capture, its module tags, the framework
    # callbacks and the pytest plugin; never the analysis
    "torch": ("capture", "module_tags.py", "integrations/", "pytest_plugin.py"),
    "lightning": ("integrations/",),
    "pytorch_lightning": ("integrations/",),
    "transformers": ("integrations/",),
    "pytest": ("pytest_plugin.py",),
    "pickle": ("load/", "capture.py"),  # capture writes snapshots; only load/ reads them
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_only_the_owner_imports(module):
    offenders = []
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG).as_posix()
        if module in _imports(f) and not rel.startswith(ALLOWED[module]):
            offenders.append(rel)
    assert offenders == []


def test_metrics_are_pure():
    for f in (PKG / "metrics").rglob("*.py"):
        src = f.read_text()
        assert "print(" not in src, f
        assert "import matplotlib" not in src and "open(" not in src, f


def _params(fn) -> dict[str, object]:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()}


CLI_ONLY = {"json_out", "quiet", "debug", "ctx"}
API_ONLY = {"progress", "args"}


@pytest.mark.parametrize(
    "name", ["stats", "leaks", "findings", "report", "diff", "ranks", "check", "export", "whatif", "run", "plan"]
)
def test_cli_and_api_share_names_and_defaults(name):
    cli_params = {k: v for k, v in _params(getattr(cli, name)).items() if k not in CLI_ONLY}
    api_params = {k: v for k, v in _params(getattr(api, name)).items() if k not in API_ONLY}
    assert set(cli_params) == set(api_params)
    for k, v in api_params.items():
        if v is not inspect.Parameter.empty:
            assert cli_params[k] == v, k
