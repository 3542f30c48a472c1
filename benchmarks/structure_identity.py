"""Proof that a change to the plan's training structure or to the fit's step evidence leaves both
identical: every field of ``training_structure`` and ``step_evidence`` on every device of every
snapshot, dumped with one tree's code and compared with another's (frames with ``DataFrame.equals``
and the same dtypes, arrays with the same dtype and values, every other value with ``==`` and the
same type), and the CPU time each took.

    git archive main | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python benchmarks/structure_identity.py dump /tmp/base.pkl sample_snapshots/*.pickle*
    PYTHONPATH=$PWD python benchmarks/structure_identity.py dump /tmp/new.pkl sample_snapshots/*.pickle*
    python benchmarks/structure_identity.py compare /tmp/base.pkl /tmp/new.pkl
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from snapshot_lab import api
from snapshot_lab.metrics.fit.model import FitUnsupported, step_evidence
from snapshot_lab.metrics.plan import PlanUnsupported
from snapshot_lab.metrics.plan.structure import training_structure


def plain(value: Any) -> Any:
    """Dataclasses as dicts (with their class's name), sequences as (type name, items)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {"__class__": type(value).__name__}
        out.update({field.name: plain(getattr(value, field.name)) for field in dataclasses.fields(value)})
        return out
    if isinstance(value, list | tuple):
        return (type(value).__name__, [plain(item) for item in value])
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value


def dump_one(path: str) -> dict[int, dict[str, Any]]:
    frames = api.load_frames(path)
    devices = sorted(int(device) for device in pd.unique(frames.events["device"])) if len(frames.events) else []
    out: dict[int, dict[str, Any]] = {}
    for device in devices:
        entry: dict[str, Any] = {}
        start = time.process_time()
        try:
            entry["structure"] = plain(training_structure(frames, device))
        except (PlanUnsupported, ValueError) as exc:
            entry["structure_error"] = f"{type(exc).__name__}: {exc}"
        middle = time.process_time()
        try:
            entry["evidence"] = plain(step_evidence(frames, device))
        except (FitUnsupported, ValueError) as exc:
            entry["evidence_error"] = f"{type(exc).__name__}: {exc}"
        entry["seconds"] = (middle - start, time.process_time() - middle)
        if "structure" in entry:  # as it stands once the evidence is made (its users may add to it)
            entry["structure_after"] = plain(training_structure(frames, device))
        out[device] = entry
    return out


def differences(old: Any, new: Any, where: str, found: list[str]) -> None:
    """Append to ``found`` every place where ``new`` is not exactly ``old``."""
    if type(old) is not type(new):
        found.append(f"{where}: {type(old).__name__} became {type(new).__name__}")
    elif isinstance(old, pd.DataFrame):
        if list(old.columns) != list(new.columns) or not old.dtypes.equals(new.dtypes):
            found.append(f"{where}: columns or dtypes differ")
        elif not old.index.equals(new.index) or not old.equals(new):
            found.append(f"{where}: values differ in {[c for c in old.columns if not old[c].equals(new[c])]}")
    elif isinstance(old, np.ndarray):
        equal_nan = old.dtype.kind == "f"
        if old.dtype != new.dtype or old.shape != new.shape:
            found.append(f"{where}: array {old.dtype}{old.shape} became {new.dtype}{new.shape}")
        elif old.dtype == object:
            if any(a != b or type(a) is not type(b) for a, b in zip(old.tolist(), new.tolist(), strict=True)):
                found.append(f"{where}: values differ")
        elif not np.array_equal(old, new, equal_nan=equal_nan):
            found.append(f"{where}: values differ")
    elif isinstance(old, dict):
        if old.keys() != new.keys():
            found.append(f"{where}: keys {sorted(map(str, old))} became {sorted(map(str, new))}")
        for key in old.keys() & new.keys():
            if key != "seconds":
                differences(old[key], new[key], f"{where}.{key}", found)
    elif isinstance(old, tuple) and len(old) == 2 and isinstance(old[1], list):
        if old[0] != new[0] or len(old[1]) != len(new[1]):
            found.append(f"{where}: {old[0]} of {len(old[1])} became {new[0]} of {len(new[1])}")
        else:
            for i, (a, b) in enumerate(zip(old[1], new[1], strict=True)):
                differences(a, b, f"{where}[{i}]", found)
    elif not (isinstance(old, float) and np.isnan(old) and np.isnan(new)) and old != new:
        found.append(f"{where}: {old!r} became {new!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump")
    dump.add_argument("output")
    dump.add_argument("snapshots", nargs="+")
    compare = sub.add_parser("compare")
    compare.add_argument("old")
    compare.add_argument("new")
    args = parser.parse_args()
    if args.command == "dump":
        result = {Path(path).name: dump_one(path) for path in args.snapshots}
        Path(args.output).write_bytes(pickle.dumps(result, protocol=5))
        return 0
    old, new = (pickle.loads(Path(path).read_bytes()) for path in (args.old, args.new))
    found: list[str] = []
    differences(old, new, "", found)
    for name, data in (("old", old), ("new", new)):
        structure = sum(entry["seconds"][0] for devices in data.values() for entry in devices.values())
        evidence = sum(entry["seconds"][1] for devices in data.values() for entry in devices.values())
        print(f"{name}: training_structure {structure:.2f}s, step_evidence {evidence:.2f}s (CPU, first call)")
    print("\n".join(found[:50]) or f"identical on {len(old)} snapshots")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
