#!/usr/bin/env bash
# Issue #24, what a one-GPU machine allows: world size 4 with the four ranks sharing GPU 0 over
# gloo (SNAPLAB_ONE_GPU=1 in train_parallel.py), for DDP (both bucket-view settings) and tensor
# parallelism (degree 4), on both models of workloads_parallel.py. Each rank is its own process
# with its own caching allocator, so its snapshot and memory_stats() are what that rank used;
# only the collectives differ from NCCL (gloo stages CUDA tensors through the host).
#
#   bash sample_snapshots/jobs/run_world4_one_gpu.sh OUT_DIR
set -u
out=${1:-/tmp/ws4}
mkdir -p "$out/final" "$out/raw" "$out/logs"
export SNAPLAB_ONE_GPU=1 PYTHONPATH=$PWD OMP_NUM_THREADS=2 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
runner=(-m snapshot_lab run)
python3 -c "import snapshot_lab.cli" 2>/dev/null || runner=(sample_snapshots/jobs/capture_run.py)
port=29811
for model in transformer mlp; do
  for spec in "ddp_nobucketview --strategy ddp --bucket-view 0" "ddp_bucketview --strategy ddp --bucket-view 1" \
              "tp --strategy tp"; do
    set -- $spec
    name="${1}_ws4gloo_${model}"; shift
    port=$((port + 1))
    ( python3 -m torch.distributed.run --nnodes 1 --nproc_per_node 4 --master_addr 127.0.0.1 --master_port $port \
        "${runner[@]}" --out "$out/raw/$name" --max-entries 1000000 --stacks python \
        sample_snapshots/jobs/train_parallel.py "$@" --model $model --name "$name" --final-dir "$out/final" \
        > "$out/logs/$name.log" 2>&1; echo "$name rc=$?" ) &
  done
done
wait
