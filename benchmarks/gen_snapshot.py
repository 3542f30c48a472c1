"""Write a realistic large snapshot of N trace entries, modelled on a real one.

The template is a real snapshot recorded on a GPU (default: the bundled GPT-2 training run).
Its steady-state iterations are repeated until N entries: the same action mix, sizes, address
reuse and stacks. As in real pickles, every entry gets its own ``frames`` list while frame
dicts are shared objects (pickle memoises them). ``--extra-frames`` adds outer frames (a
training framework's loop) to deepen stacks to what large jobs record (~180 bytes per entry on
disk at the default, matching "1M entries ≈ 180 MB").

    python benchmarks/gen_snapshot.py 1000000 /tmp/snap_1m.pickle
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snapshot_lab.load import load_snapshot  # noqa: E402

DEFAULT_TEMPLATE = ROOT / "sample_snapshots" / "transformer_varlen.pickle.xz"


def outer_frames(n: int) -> list[dict[str, Any]]:
    names = [
        "fit",
        "_run",
        "run_stage",
        "_run_train",
        "advance",
        "run",
        "training_step",
        "optimizer_step",
        "_call_strategy_hook",
        "step",
        "closure",
        "wrapper",
        "__call__",
        "main",
        "<module>",
        "run_path",
    ]
    return [
        {
            "name": names[i % len(names)],
            "filename": f"/opt/venv/lib/python3.12/site-packages/lightning/loop_{i}.py",
            "line": 100 + i,
        }
        for i in range(n)
    ]


def generate(n_entries: int, template: Path = DEFAULT_TEMPLATE, extra_frames: int = 22) -> dict[str, Any]:
    snap = load_snapshot(template)
    trace = snap.device_traces[0]
    # steady state: from the first optimizer step on (the template's second half)
    body = [e for e in trace[len(trace) // 2 :] if e["action"] != "snapshot"]
    outer = outer_frames(extra_frames)
    span_us = body[-1]["time_us"] - body[0]["time_us"] + 1000
    t0 = trace[0]["time_us"]
    out: list[dict[str, Any]] = []
    rep = 0
    deep: dict[int, list[dict[str, Any]]] = {}
    while len(out) < n_entries:
        shift = rep * span_us
        for e in body:
            if len(out) >= n_entries:
                break
            ne = dict(e)
            ne["time_us"] = e["time_us"] - body[0]["time_us"] + t0 + shift
            frames = e.get("frames")
            if frames:
                base = deep.get(id(frames))
                if base is None:
                    base = deep[id(frames)] = frames + outer
                ne["frames"] = list(base)  # a new list per entry, shared frame dicts
            out.append(ne)
        rep += 1
    return {
        "segments": [dict(s) for s in snap.segments],
        "device_traces": [out],
        "allocator_settings": snap.allocator_settings,
        "external_annotations": [],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("entries", type=int)
    ap.add_argument("output", type=Path)
    ap.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE)
    ap.add_argument("--extra-frames", type=int, default=22)
    a = ap.parse_args()
    snap = generate(a.entries, a.template, a.extra_frames)
    with a.output.open("wb") as f:
        pickle.dump(snap, f, protocol=4)
    size = a.output.stat().st_size
    print(f"{a.output}: {a.entries:,} entries, {size / 1e6:.1f} MB ({size / a.entries:.0f} B/entry)")


if __name__ == "__main__":
    main()
