"""A long fuzzing campaign over every snaplab command (issue #13), in one command:

    python benchmarks/fuzz_campaign.py --inputs 1000000 --workers 2 --seed 1

It starts ``--workers`` libFuzzer processes (``python -m tests.fuzz.fuzz_snaplab``, atheris),
each with its own seed and a share of the inputs, over one shared corpus folder seeded with the
real snapshots of ``sample_snapshots/`` (cut small). Contract violations do not stop a worker:
each class is recorded once, with its smallest input and traceback, under ``OUT/violations``.
At the end it prints (and writes to ``OUT/summary.json``) the inputs tried, the coverage
libFuzzer reached (edges ``cov`` and features ``ft`` of snaplab's instrumented code), how many
inputs went through each stage, the slowest stage relative to the seeds, and the violations.
Needs ``pip install atheris`` (a test dependency). Exit code 1 when anything was violated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DONE = re.compile(r"(?:Done (\d+) runs in \d+ second|stat::number_of_executed_units: (\d+))")
_COV = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=1_000_000, help="inputs to try, over all workers")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "snaplab-fuzz-campaign")
    ap.add_argument("--max-len", type=int, default=1 << 18)
    ap.add_argument("--rss-limit-mb", type=int, default=3072)
    ap.add_argument("--timeout-s", type=int, default=120, help="libFuzzer's per-input hang limit")
    ap.add_argument("--max-total-time", type=int, default=0, help="stop each worker after this many seconds")
    ap.add_argument("--corpus-from", type=Path, help="start from the corpus of an earlier campaign")
    a = ap.parse_args()
    out: Path = a.out
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    if a.corpus_from:
        for f in a.corpus_from.iterdir():
            (corpus / f.name).write_bytes(f.read_bytes())
    (out / "violations").mkdir(exist_ok=True)
    started = time.time()
    procs = []
    per_worker = -(-a.inputs // a.workers)
    for w in range(a.workers):
        env = dict(
            os.environ,
            SNAPLAB_FUZZ_WORKDIR=str(out / f"work{w}"),
            SNAPLAB_FUZZ_RECORD=str(out / "violations"),
            SNAPLAB_FUZZ_STATS=str(out / f"stats{w}.json"),
            PYTHONPATH=str(ROOT),
        )
        cmd = [
            sys.executable,
            "-m",
            "tests.fuzz.fuzz_snaplab",
            f"-seed={a.seed + w}",
            f"-runs={per_worker}",
            f"-max_len={a.max_len}",
            f"-rss_limit_mb={a.rss_limit_mb}",
            f"-timeout={a.timeout_s}",
            "-print_final_stats=1",
            f"-max_total_time={a.max_total_time}",
            f"-artifact_prefix={out}/",
            str(corpus),
        ]
        log = (out / f"worker{w}.log").open("wb")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = [p.wait() for p, _ in procs]
    for _, log in procs:
        log.close()
    summary = summarise(out, a, codes, time.time() - started)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    sys.exit(1 if summary["violations"] or any(codes) else 0)


def summarise(out: Path, a: argparse.Namespace, codes: list[int], wall_s: float) -> dict[str, object]:
    inputs = 0
    cov = ft = 0
    for w in range(a.workers):
        text = (out / f"worker{w}.log").read_text(errors="replace")
        done = _DONE.findall(text)
        covs = _COV.findall(text)
        inputs += int(max(done[-1])) if done else (int(covs[-1][0]) if covs else 0)
        if covs:
            cov, ft = max(cov, int(covs[-1][1])), max(ft, int(covs[-1][2]))
    stages: dict[str, int] = {}
    slowest: dict[str, float] = {}
    pending = 0
    for w in range(a.workers):
        p = out / f"stats{w}.json"
        if not p.exists():
            continue
        s = json.loads(p.read_text())
        for k in ("inputs", "refused", "loaded", "frames", "analysed", "outputs"):
            stages[k] = stages.get(k, 0) + s.get(k, 0)
        pending += s.get("pending_skipped", 0)
        for k, v in s.get("slowest", {}).items():
            slowest[k] = round(max(slowest.get(k, 0.0), v), 2)
    violations = {}
    for folder in sorted((out / "violations").iterdir()):
        text = (folder / "violation.txt").read_text(errors="replace")
        violations[folder.name] = text.splitlines()[0]
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "inputs": inputs,
        "workers": a.workers,
        "seed": a.seed,
        "corpus_from": str(a.corpus_from) if a.corpus_from else None,
        "wall_s": round(wall_s),
        "inputs_per_s": round(inputs / wall_s, 1) if wall_s else None,
        "coverage_edges": cov,
        "coverage_features": ft,
        "stage_counts_sampled_at_last_stats_write": stages,
        "pending_skipped": pending,
        "slowest_stage_vs_seeds": slowest,
        "exit_codes": codes,
        "violations": violations,
    }


if __name__ == "__main__":
    main()
