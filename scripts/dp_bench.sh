#!/usr/bin/env bash
# One device call on a machine of 2+ GPUs: tokens/s per GPU of train_gpt on 1 GPU and on 2 GPUs
# in each ZeRO mode (weak scaling: the same micro-batch per GPU), beside PyTorch torch.compile on
# 1 GPU and DDP on 2 (torch_baseline.py, carried in .bench/), at the default config and at 1b.
# Prints one line per run; the JSON lines go to $OUT/dp_bench.jsonl.
# Usage (device machine, repo root, after make): bash scripts/dp_bench.sh [default|1b ...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log="$OUT/dp_bench.jsonl"
ours() {  # name, flags...
  local name=$1; shift
  ./train_gpt --bench --out /tmp/dp_bench_out "$@" 2>&1 | grep -a '^{' | sed "s/^{/{\"run\": \"$name\", /" | tee -a "$log" \
    | python3 -c 'import json,sys; [print("%-18s %9.0f tok/s/GPU %7.2f ms %6.2f GiB" % (r["run"], r["tokens_per_s_per_gpu"], r["ms_per_step"], r["peak_mem_gib"])) for r in map(json.loads, sys.stdin)]'
}
torch1() {  # name, torch_baseline flags...
  local name=$1; shift
  PYTHONUNBUFFERED=1 timeout 300 python3 .bench/torch_baseline.py --compile default "$@" 2>&1 | grep -a '^{' | tail -1 \
    | sed "s/^{/{\"run\": \"$name\", /" | tee -a "$log" \
    | python3 -c 'import json,sys; [print("%-18s %9.0f tok/s/GPU %7.2f ms %6.2f GiB" % (r["run"], r.get("tokens_per_s_per_gpu", r["tokens_per_s"]), r["ms_per_step_mean"], r["peak_mem_gib"])) for r in map(json.loads, sys.stdin)]'
}
torchddp() {  # name, torch_baseline flags...
  local name=$1; shift
  PYTHONUNBUFFERED=1 timeout 300 torchrun --standalone --nproc_per_node 2 .bench/torch_baseline.py --compile default --dp ddp "$@" 2>&1 \
    | grep -a '^{' | tail -1 | sed "s/^{/{\"run\": \"$name\", /" | tee -a "$log" \
    | python3 -c 'import json,sys; [print("%-18s %9.0f tok/s/GPU %7.2f ms %6.2f GiB   (raw: %s)" % (r["run"], r.get("tokens_per_s_per_gpu", r["tokens_per_s"] / 2), r["ms_per_step_mean"], r["peak_mem_gib"], {k: r[k] for k in r if "tokens" in k})) for r in map(json.loads, sys.stdin)]'
}
# TORCH=0 leaves PyTorch out (when its figures come from an earlier call); EXTRA="VAR=value ..."
# adds one more run of ZeRO 1 and 2 with those environment variables (e.g. NCCL_MAX_CTAS=8).
for size in ${*:-default 1b}; do
  echo "=== $size"
  if [ "$size" = 1b ]; then
    model="--d-model 2048 --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --ffn 8192 --batch 8 --rope-theta 1e6"
    tmodel="--model-size 1b"
  else
    model=""
    tmodel="--model-size small --n-head 6 --n-kv-head 2 --head-dim 128 --rope-theta 10000"
  fi
  ours "ours-1gpu-$size" $model
  for z in 0 1 2; do ours "ours-2gpu-z$z-$size" $model --gpus 2 --zero $z; done
  if [ -n "${EXTRA:-}" ]; then
    for z in 1 2; do (export $EXTRA; ours "ours-2gpu-z$z-${EXTRA// /_}-$size" $model --gpus 2 --zero $z); done
  fi
  [ "${TORCH:-1}" = 0 ] && continue
  torch1 "torch-1gpu-$size" $tmodel
  torchddp "torch-ddp-2gpu-$size" $tmodel
done
