"""`snaplab run` for a GPU machine where snaplab's analysis dependencies (pandas, typer, ...) are
missing: the same recording (snapshot_lab.capture, which needs only the standard library and
torch), without importing the rest of the package.

    python3 capture_run.py --out DIR [--max-entries N] [--stacks python|all] script.py [args...]
    torchrun --nproc_per_node 2 capture_run.py --out DIR script.py [args...]

workloads_parallel.py falls back to it when ``import snapshot_lab.cli`` fails.
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
import traceback
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def import_capture() -> Any:
    """snapshot_lab.capture, even when the package's __init__ cannot import its dependencies."""
    try:
        import snapshot_lab.capture as capture

        return capture
    except ImportError:
        pkg = types.ModuleType("snapshot_lab")
        pkg.__path__ = [str(ROOT / "snapshot_lab")]  # a namespace: __init__ is not run
        sys.modules["snapshot_lab"] = pkg
        return importlib.import_module("snapshot_lab.capture")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="snapshots")
    ap.add_argument("--max-entries", type=int, default=100_000)
    ap.add_argument("--stacks", default="python")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    capture = import_capture()
    sys.argv = [a.script, *a.args]
    sys.path.insert(0, str(Path(a.script).resolve().parent))
    code = 0
    with capture.recording(a.out, max_entries=a.max_entries, stacks=a.stacks) as rec:
        try:
            runpy.run_path(a.script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # as snapshot_lab.api.run: the program's error, exit 1
            traceback.print_exc()
            rec.exit_reason = "exception"
            rec.exception_type = type(exc).__name__
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
