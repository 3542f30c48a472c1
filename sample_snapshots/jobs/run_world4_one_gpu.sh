#!/usr/bin/env bash
# Issue #24, what a one-GPU machine allows: world size 4 with the four ranks sharing GPU 0 over
# gloo (SNAPLAB_ONE_GPU=1 in train_parallel.py), for DDP (both bucket-view settings) and tensor
# parallelism (degree 4), on both models of workloads_parallel.py. Each rank is its own process
# with its own caching allocator, so its snapshot and memory_stats() are what that rank used;
# only the collectives differ from NCCL (gloo stages CUDA tensors through the host).
#
#   bash sample_snapshots/jobs/run_world4_one_gpu.sh OUT_DIR [base|sharded]
#
# "zero_prefetch": ZeRO-1, and FSDP2 at a small batch (64 rows for the MLP, 4 sequences for the GPT) with and without an explicit 3-unit prefetch
# (the peak set by several units' gathered parameters at once, and the same job without it).
# "sharded" tries FSDP2, FSDP1 and a 4-stage pipeline the same way; gloo lacks some of their
# collectives on CUDA tensors, so each may fail (its log says why).
set -u
out=${1:-/tmp/ws4}
case ${2:-base} in
  base) specs=("ddp_nobucketview --strategy ddp --bucket-view 0" "ddp_bucketview --strategy ddp --bucket-view 1"
               "tp --strategy tp") ;;
  sharded) specs=("fsdp2_reshard --strategy fsdp2 --reshard 1" "fsdp2_noreshard --strategy fsdp2 --reshard 0"
                  "fsdp1_fullshard --strategy fsdp1 --sharding FULL_SHARD"
                  "pp_gpipe --strategy pp --schedule gpipe --microbatches 8"
                  "pp_1f1b --strategy pp --schedule 1f1b --microbatches 8") ;;
  zero_prefetch) specs=("zero1 --strategy zero1 --bucket-view 0"
                        "fsdp2_prefetch3_small --strategy fsdp2 --reshard 1 --prefetch 3 --batch SMALL"
                        "fsdp2_default_small --strategy fsdp2 --reshard 1 --batch SMALL") ;;
  *) echo "unknown spec set: $2" >&2; exit 2 ;;
esac
mkdir -p "$out/final" "$out/raw" "$out/logs"
export SNAPLAB_ONE_GPU=1 PYTHONPATH=$PWD OMP_NUM_THREADS=2 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
runner=(-m snapshot_lab run)
python3 -c "import snapshot_lab.cli" 2>/dev/null || runner=(sample_snapshots/jobs/capture_run.py)
port=29811
for model in ${MODELS:-transformer mlp}; do
  for spec in "${specs[@]}"; do
    small=$([ $model = mlp ] && echo 64 || echo 4)  # activations far below one unit's parameters
    set -- ${spec//SMALL/$small}
    name="${1}_ws4gloo_${model}"; shift
    port=$((port + 1))
    ( python3 -m torch.distributed.run --nnodes 1 --nproc_per_node 4 --master_addr 127.0.0.1 --master_port $port \
        "${runner[@]}" --out "$out/raw/$name" --max-entries 1000000 --stacks python \
        sample_snapshots/jobs/train_parallel.py "$@" --model $model --name "$name" --final-dir "$out/final" \
        > "$out/logs/$name.log" 2>&1; echo "$name rc=$?" ) &
  done
done
wait
