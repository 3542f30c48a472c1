"""The atheris (libFuzzer) target: ``python -m tests.fuzz.fuzz_snaplab [libFuzzer options] [corpus dirs]``.

snaplab's own modules are instrumented for coverage (not pandas or numpy: their branches would
drown snaplab's). libFuzzer keeps the inputs that reach new code; the custom mutator below mixes
its byte mutations with structure-aware ones (:mod:`tests.fuzz.mutate`). Every input goes
through :class:`tests.fuzz.contract.Contract`.

Environment:
  SNAPLAB_FUZZ_WORKDIR   scratch folder (default: a temporary one)
  SNAPLAB_FUZZ_RECORD    a folder: record each contract violation there (one folder per class,
                         the smallest input and its traceback) and go on, instead of stopping
  SNAPLAB_FUZZ_STATS     a file: the session's counters as JSON, written every 1000 inputs
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["snapshot_lab"]):
    import snapshot_lab
    import snapshot_lab.api
    import snapshot_lab.cli
    import snapshot_lab.frames
    import snapshot_lab.load
    import snapshot_lab.metrics
    import snapshot_lab.report  # noqa: F401

from . import mutate as mut
from .contract import Contract, ContractViolation, measure_baselines
from .seeds import ROOT, seed_corpus

sys.setrecursionlimit(20000)

WORKDIR = Path(os.environ.get("SNAPLAB_FUZZ_WORKDIR") or tempfile.mkdtemp(prefix="snaplab-fuzz-"))
RECORD = os.environ.get("SNAPLAB_FUZZ_RECORD")
STATS = os.environ.get("SNAPLAB_FUZZ_STATS")

_seeds = seed_corpus()
_contract = Contract(WORKDIR / f"w{os.getpid()}", ROOT / "sample_snapshots" / "oom_capacity.pickle.xz")
_contract.baselines = measure_baselines(_contract, list(_seeds.values()))
_violations: dict[str, int] = {}


def _record(v: ContractViolation, data: bytes) -> None:
    assert RECORD is not None
    folder = Path(RECORD) / hashlib.sha1(v.signature.encode()).hexdigest()[:12]
    folder.mkdir(parents=True, exist_ok=True)
    _violations[v.signature] = _violations.get(v.signature, 0) + 1
    best = folder / "input.bin"
    if not best.exists() or len(data) < best.stat().st_size:
        best.write_bytes(data)
        (folder / "violation.txt").write_text(f"{v.signature}\n\n{v.detail}\n")


def _write_stats() -> None:
    if STATS:
        d = _contract.stats.to_dict() | {"violations": _violations, "pid": os.getpid()}
        Path(STATS).write_text(json.dumps(d, indent=1))


def test_one_input(data: bytes) -> None:
    try:
        _contract.run(data)
    except ContractViolation as v:
        if RECORD is None:
            raise
        _record(v, data)
    if STATS and _contract.stats.inputs % 1000 == 0:
        _write_stats()


_seed_list = list(_seeds.values())


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.3:  # most mutants are refused; start often from a real (valid) seed
        data = rng.choice(_seed_list)
    out = mut.mutate(data, rng, byte_mutator=lambda d: atheris.Mutate(d, max(len(d), 64) * 2))
    if len(out) <= max_size:
        return out
    if len(data) <= max_size and rng.random() < 0.5:
        return data
    return out[:max_size]  # never more than libFuzzer allows (a seed itself can be larger)


def main() -> None:
    atexit.register(_write_stats)
    argv = list(sys.argv)
    seeds_dir = WORKDIR / "seeds"
    seeds_dir.mkdir(parents=True, exist_ok=True)
    for name, data in _seeds.items():
        (seeds_dir / name).write_bytes(data)
    argv.append(str(seeds_dir))  # read after the corpus folder given (new inputs go to the first)
    atheris.Setup(argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
