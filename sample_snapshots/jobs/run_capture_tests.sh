#!/usr/bin/env bash
# On a 2-GPU machine: exercise `snaplab run` for real (single job, OOM job, 2-rank DDP under
# torchrun) and collect what it wrote into $1 (default /tmp/cap).
set -u
out=${1:-/tmp/cap}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m snapshot_lab run --out "$out/single" --every-n-steps 2 sample_snapshots/jobs/train_single.py
echo "single rc=$?"
python3 -m snapshot_lab run --out "$out/oom" sample_snapshots/jobs/train_oom.py
echo "oom rc=$? (expected 1: the job raised OutOfMemoryError)"
torchrun --standalone --nproc_per_node 2 -m snapshot_lab run --out "$out/ddp" sample_snapshots/jobs/train_ddp.py
echo "ddp rc=$?"
ls -la "$out"/*
