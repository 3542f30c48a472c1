"""Packaging: the distribution's name, its one version, its license and what goes into it.

``snaplab`` on PyPI is an unrelated project, so every install line this project prints or
documents must name ``snapshot-lab`` (or the checkout, ``.``): ``pip install "snaplab[dask]"``
would install a stranger's package. Building, checking and installing the wheel is done by
``.ci/run`` (the build backend comes from the network); here, what can be read offline.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import re
from pathlib import Path

import pytest

from .conftest import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

DISTRIBUTION = "snapshot-lab"
# what an install line may name besides this project: pip itself, torch (which recording needs),
# pre-commit (CONTRIBUTING.md) and atheris (the fuzzer, a test dependency)
OTHER_DISTRIBUTIONS = {"pip", "torch", "pre-commit", "atheris"}

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _texts() -> dict[str, str]:
    """Every file a user reads an install line in: the package (messages, docstrings), README,
    docs, CHANGELOG, CONTRIBUTING, CI and pre-commit, the examples and benchmarks."""
    paths = [
        *(ROOT / "snapshot_lab").rglob("*.py"),
        *(ROOT / "snapshot_lab").rglob("*.j2"),
        *(ROOT / "docs").rglob("*.md"),
        *(p for folder in ("examples", "benchmarks") for p in (ROOT / folder).glob("*.*")),
        *(ROOT / p for p in ("README.md", "CHANGELOG.md", "CONTRIBUTING.md", "pyproject.toml", ".ci/run")),
        ROOT / ".pre-commit-config.yaml",
    ]
    texts = {".md", ".py", ".ipynb", ".toml", ".yaml", ".j2", ""}  # "" is .ci/run
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in paths if p.is_file() and p.suffix in texts}


INSTALL = re.compile(r"pip3? install\b([^\n`|;#()]*)")


def install_targets(text: str) -> list[str]:
    """The requirements named by each ``pip install ...`` in ``text`` (options and paths left out)."""
    targets = []
    for match in INSTALL.finditer(text):
        for word in match.group(1).split("&&")[0].split():
            word = word.strip("'\"\\").rstrip(",:")
            word = word[:-1] if len(word) > 1 and word.endswith(".") else word  # end of a sentence
            if not word or word.startswith(("-", "$")) or "/" in word:
                continue  # an option, a shell variable, a path (dist/*.whl)
            targets.append(word)
    return targets


def distribution_name(requirement: str) -> str:
    """``snapshot-lab[dask]`` -> ``snapshot-lab``; ``.[test]`` -> ``.``; ``torch>=2.1`` -> ``torch``."""
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0] or "."


def test_install_targets_parser():
    assert install_targets("pip install . && snaplab report x") == ["."]  # the checkout
    assert install_targets("""`pip install "snaplab[lightning]"`, then""") == ["snaplab[lightning]"]
    assert install_targets("pip install 'snapshot-lab[dask]'") == ["snapshot-lab[dask]"]
    assert install_targets("python -m pip install -q --upgrade pip") == ["pip"]
    assert install_targets("pip install torch (snaplab's analysis commands do not need it)") == ["torch"]
    assert install_targets('pip install ".[test]" && pytest') == [".[test]"]
    assert install_targets('pip install -e ".[test]" && pytest') == [".[test]"]
    assert install_targets("Without ``pip install``, load it") == []
    assert distribution_name(".[test]") == "." and distribution_name("snapshot-lab[a,b]") == DISTRIBUTION


@pytest.mark.parametrize("path", sorted(_texts()))
def test_install_lines_name_this_distribution(path):
    text = _texts()[path]
    wrong = [t for t in install_targets(text) if distribution_name(t) not in {".", DISTRIBUTION, *OTHER_DISTRIBUTIONS}]
    assert not wrong, f"{path}: install lines name {wrong}; this project's distribution is {DISTRIBUTION!r}"
    # extras spelled with the old name anywhere (``"snaplab[transformers]"`` after an "or")
    assert not re.findall(r"\bsnaplab\[", text), f"{path}: 'snaplab[...]' names another project's package"


def test_distribution_name_and_entry_points():
    project = PYPROJECT["project"]
    assert project["name"] == DISTRIBUTION
    assert project["scripts"] == {"snaplab": "snapshot_lab.cli:main"}


def test_version_has_one_source():
    """pyproject reads the version from the package, where ``snaplab --version`` reads it too."""
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "snapshot_lab.__version__"}
    # setuptools reads a literal without importing the package
    tree = ast.parse((ROOT / "snapshot_lab" / "__init__.py").read_text())
    literal = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    import snapshot_lab

    assert literal == [snapshot_lab.__version__]
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", snapshot_lab.__version__)


def test_license_is_spdx_with_its_file():
    project = PYPROJECT["project"]
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))  # not with an SPDX license
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "snaplab developers" in text
    backend = PYPROJECT["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(7[7-9]|[89]\d)(\.\d+)*", r) for r in backend), backend  # PEP 639


def test_package_data_covers_every_non_python_file():
    """The wheel (and the sdist, which setuptools fills from the same list) carries the templates,
    the CSS and py.typed; a file added beside them without a pattern would be missing on install."""
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["snapshot_lab"]
    package = ROOT / "snapshot_lab"
    data = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*")
        # compiled extensions built in place (setup.py build_ext --inplace) are not data
        if p.is_file() and p.suffix not in {".py", ".pyc", ".so", ".pyd"} and "__pycache__" not in p.parts
    ]
    assert "py.typed" in data and any(p.startswith("render/templates/") for p in data)
    missing = [p for p in data if not any(fnmatch.fnmatch(p, pattern) for pattern in patterns)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["snapshot_lab*"]  # no samples, no tests


def test_extras_for_docs_and_release():
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {e: {distribution_name(r) for r in reqs} for e, reqs in extras.items()}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= names["docs"]
    assert {"build", "twine"} <= names["release"]


def test_readme_opens_with_the_commands_ci_runs():
    """.ci/run runs the README's first two commands, byte for byte."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)[:2]
    assert blocks == [
        "pip install . && snaplab report sample_snapshots/oom_fragmentation.pickle",
        'pip install -e ".[test]" && pytest',
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert all(block in ci for block in blocks)
    assert (ROOT / "sample_snapshots" / "oom_fragmentation.pickle").is_file()
    assert len(readme.splitlines()) <= 200


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert targets and all((ROOT / t).exists() for t in targets), [t for t in targets if not (ROOT / t).exists()]


def test_pytest_plugin_entry_point():
    assert PYPROJECT["project"]["entry-points"]["pytest11"] == {"snaplab": "snapshot_lab.pytest_plugin"}
    assert Path(ROOT / "snapshot_lab" / "pytest_plugin.py").is_file()


def test_cli_reference_covers_every_command_and_option():
    """The docs' CLI page is generated by docs/hooks/cli_reference.py at build time; it must name
    every command and every option of the app as it is now (including commands added later)."""
    import typer

    from snapshot_lab.cli import app

    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py")
    assert spec and spec.loader
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.on_page_markdown(f"# CLI\n\n{hook.MARKER}\n", page=None, config=None, files=None)
    assert hook.MARKER not in page
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        assert f"## `snaplab {name}`" in page
        for param in command.params:
            for opt in [*param.opts, *param.secondary_opts]:
                shown = f"`{opt}`" if opt.startswith("-") else f"`{opt.upper()}`"
                assert shown in page, (name, opt)
    assert "`--version`" in page
