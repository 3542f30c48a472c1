"""The integration examples of the README and the docs pages, run as written (each code block
after an ``<!-- example: NAME -->`` line), against the stand-ins CI has instead of torch,
Lightning and transformers. The same integrations ran for real on a GPU
(sample_snapshots/jobs/integrations_gpu.py)."""

from __future__ import annotations

import re
import shutil

import pytest

from .conftest import ROOT, sample_path
from .fake_frameworks import FakeLightningModule, install_fake_lightning, install_fake_transformers
from .fake_torch import FakeTorch
from .test_pytest_plugin import FAKE_CUDA, _plugin_args

pytest_plugins = ["pytester"]

PAGE_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in PAGE_FILES}
EXAMPLE = re.compile(r"<!-- example: ([\w-]+) -->")
TESTED = {"lightning", "transformers", "module-tags", "notebook", "pytest"}


def page_with(name: str) -> str:
    """The text of the one page (README.md or docs/**.md) that holds example ``name``."""
    pages = [text for text in PAGES.values() if f"<!-- example: {name} -->" in text]
    assert len(pages) == 1, f"example {name!r} is in {len(pages)} pages, not one"
    return pages[0]


def example(name: str) -> str:
    m = re.search(rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)```", page_with(name), re.DOTALL)
    assert m, f"example {name!r} is not followed by a python block"
    return m.group(1)


def test_every_example_is_tested():
    """An example added to a page without a test here would go unchecked."""
    found = {name for text in PAGES.values() for name in EXAMPLE.findall(text)}
    assert found == TESTED


@pytest.fixture
def fake_torch(monkeypatch, tmp_path):
    fake = FakeTorch()
    fake.install(monkeypatch)
    monkeypatch.setattr("snapshot_lab.capture._OBSERVER_ATTACHED", False)
    monkeypatch.chdir(tmp_path)
    return fake


def test_lightning_example(fake_torch, monkeypatch, tmp_path):
    install_fake_lightning(monkeypatch)
    exec(example("lightning"), {"model": FakeLightningModule(), "loader": None})
    snaps = sorted((tmp_path / "snaps").glob("*.pickle"))
    assert sorted(p.name.rsplit("_", 1)[-1] for p in snaps)[1:] == ["step1000.pickle", "step500.pickle"]
    assert len(snaps) == 3 and len(list((tmp_path / "snaps").glob("*.html"))) == 1


def test_transformers_example(fake_torch, monkeypatch, tmp_path):
    install_fake_transformers(monkeypatch)
    exec(example("transformers"), {"model": object(), "dataset": None})
    assert len(list((tmp_path / "snaps").glob("*.pickle"))) == 3
    assert len(list((tmp_path / "snaps").glob("*.html"))) == 1


def test_module_tags_example(monkeypatch, tmp_path, capsys):
    FakeTorch(version="2.9.1").install(monkeypatch)  # no _set_memory_metadata: tags say why
    monkeypatch.setattr("snapshot_lab.capture._OBSERVER_ATTACHED", False)
    monkeypatch.chdir(tmp_path)
    steps = []
    exec(example("module-tags"), {"model": None, "loader": [1, 2, 3], "train_step": lambda m, b: steps.append(b)})
    assert steps == [1, 2, 3] and len(list((tmp_path / "snaps").glob("*.pickle"))) == 1
    out = capsys.readouterr().out
    assert out.startswith("False per-module attribution needs PyTorch >= 2.10")


def test_notebook_example(monkeypatch, tmp_path):
    (tmp_path / "sample_snapshots").mkdir()
    shutil.copy(sample_path("oom_fragmentation"), tmp_path / "sample_snapshots" / "oom_fragmentation.pickle")
    monkeypatch.chdir(tmp_path)
    code = example("notebook")
    lines = code.strip().splitlines()
    ns: dict = {}
    exec(lines[0], ns)
    shown = [eval(line.split("#")[0], ns) for line in lines[1:] if line.strip()]  # what a cell displays
    assert all("snaplab-nb" in obj._repr_html_() for obj in shown)
    assert (tmp_path / "reports" / "oom_fragmentation.html").exists()


def test_pytest_example(pytester):
    pytester.makeconftest(FAKE_CUDA)
    pytester.makepyfile(test_memory=example("pytest"))
    r = pytester.runpytest(*_plugin_args(), "-p", "no:cacheprovider", "-rf")
    r.assert_outcomes(failed=1)
    page = page_with("pytest")
    shown = re.search(r"```text\n(.*?)```", page[page.index("<!-- example: pytest -->") :], re.DOTALL).group(1)
    out = r.stdout.str()
    for line in shown.strip().splitlines()[1:]:  # the first is pytest's own header of the failure
        expected = re.escape(line.strip()).replace(re.escape("<host>_<time>"), r"\S+")
        assert re.search(expected.replace(r"test_memory\.py:", r"\S*test_memory\.py:"), out), line
