"""The analysis commands' ``--json`` output, byte for byte, on a few diverse samples.

``tests/golden/<sample>/<output>.json`` holds what ``benchmarks/json_golden.py`` wrote for the
sample (exit code, stdout and stderr of one command): an OOM, a DDP rank, an FSDP rank, a
pipeline rank (and the findings across its two ranks), a sample tagged by module and a what-if
sample. A refactor must leave them unchanged; a change that means to change an output
regenerates them (and says so in its commit)::

    python benchmarks/json_golden.py /tmp/golden --samples "$(python -m tests.test_golden)" \\
        --only stats,findings,leaks,whatif,plan_table_2

and copies those under ``tests/golden/`` over (the pipeline's rank 1 only for the findings
across the pair; the what-if sample without its plan).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
SAMPLES = [
    "oom_fragmentation.pickle",
    "ddp_bucketview_rank0.pickle.xz",
    "fsdp2_reshard_transformer_rank0.pickle.xz",
    "pp_gpipe_transformer_rank*.pickle.xz",
    "modtags_gpt2_python.pickle.xz",
    "whatif_default_capA.pickle.xz",
]


def _json_golden():
    spec = importlib.util.spec_from_file_location("json_golden", ROOT / "benchmarks/json_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _outputs() -> list[Path]:
    return sorted(GOLDEN.rglob("*.json"))


def test_the_golden_outputs_cover_the_samples():
    folders = {path.parent.name for path in _outputs()}
    assert folders == {
        "oom_fragmentation",
        "ddp_bucketview_rank0",
        "fsdp2_reshard_transformer_rank0",
        "pp_gpipe_transformer_rank0",
        "pp_gpipe_transformer_pair",
        "modtags_gpt2_python",
        "whatif_default_capA",
    }


@pytest.mark.parametrize("golden", _outputs(), ids=lambda path: f"{path.parent.name}/{path.stem}")
def test_json_output_is_unchanged(golden, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recorded arguments are relative to the checkout
    arguments = json.loads(golden.read_text())["arguments"]
    assert _json_golden().run_command(arguments) == golden.read_text()


if __name__ == "__main__":
    print(",".join(SAMPLES))
