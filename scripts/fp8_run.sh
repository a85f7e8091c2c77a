#!/usr/bin/env bash
# FP8 mode's device runs (doc/fp8.md): tests, benchmarks beside torch_baseline.py, convergence.
# Usage (on the device machine, from the repo root): bash scripts/fp8_run.sh [steps...]
#   test      build, then the FP8 tests and the matmul and whole-model tests
#   bench     ours: BF16, FP8 delayed, FP8 current, at the default config and at 1b
#   options   ours, FP8 delayed: plain, --fp8-fast-accum 1, --fp8-head 1, at the default config and at 1b
#   torch     torch_baseline.py (in the ignored .bench/) BF16 torch.compile and --fp8 tensorwise, both sizes
#   profile   the kernels of FP8 steps at the default config, as they run (scripts/trace_step.sh)
#   converge  300 steps on the default corpus: BF16 (seeds 1337, 1338), FP8 delayed and current; then 1b
#   converge_options  the same 300 steps at the default config: FP8 plain, with fast accumulation, with the head
# Logs go to $OUT (or /tmp/out), one summary line per run on stdout.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ONE_B="--d-model 2048 --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --ffn 8192 --batch 8 --rope-theta 1e6"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for step in ${*:-test bench}; do
  echo "=== $step"
  case $step in
    test)
      make -j16 train_gpt test_gpt 2>&1 | grep -E "error|warning" | head -20
      for f in fp8 gpu_kernel_matmul gpu_model gpu_resume; do ./test_gpt $f; done 2>&1 | tee "$OUT/test.log" | grep -vE "^\S+ +ok \(" ;;
    bench)
      for size in default 1b; do
        args=""; [ $size = 1b ] && args=$ONE_B
        for mode in "--fp8 0" "--fp8 1 --fp8-scaling delayed" "--fp8 1 --fp8-scaling current"; do
          echo "--- $size $mode"
          ./train_gpt --bench $args $mode --out /tmp/bench_out 2>&1 | tee -a "$OUT/bench.log" | grep -aE "^\{|error|fp8:"
        done
      done ;;
    options)
      for size in default 1b; do
        args=""; [ $size = 1b ] && args=$ONE_B
        for mode in "" "--fp8-fast-accum 1" "--fp8-head 1"; do
          echo "--- $size --fp8 1 $mode"
          ./train_gpt --bench $args --fp8 1 $mode --out /tmp/bench_out 2>&1 | tee -a "$OUT/options.log" | grep -aE "^\{|error"
        done
      done ;;
    torch)
      for size in small 1b; do
        args="--model-size 1b --compile default"
        [ $size = small ] && args="--model-size small --n-head 6 --n-kv-head 2 --head-dim 128 --compile default --rope-theta 10000"
        for fp8 in "" "--fp8 tensorwise"; do
          echo "--- torch $size $fp8"
          PYTHONUNBUFFERED=1 python3 .bench/torch_baseline.py $args $fp8 2>&1 | tee -a "$OUT/torch.log" | tail -2 | head -1
        done
      done ;;
    profile)
      ARGS="--fp8 1" OUT="$OUT/trace_fp8" bash scripts/trace_step.sh 2>&1 | tee "$OUT/profile_fp8.log" ;;
    converge)
      for size in default 1b; do
        args=""; [ $size = 1b ] && args=$ONE_B
        runs=("--seed 1337" "--seed 1338" "--seed 1337 --fp8 1 --fp8-scaling delayed" "--seed 1337 --fp8 1 --fp8-scaling current")
        for run in "${runs[@]}"; do
          name=$(echo "$size $run" | tr -d '-' | tr ' ' '_')
          ./train_gpt $args $run --steps 300 --val-every 100 --sample-every 0 --ckpt-every 0 --out /tmp/conv \
            > "$OUT/conv_$name.log" 2>&1
          echo "$size $run: $(grep -aE '^step +300/' "$OUT/conv_$name.log" | cut -c1-60) | $(grep -a 'val' "$OUT/conv_$name.log" | tail -1)"
        done
      done ;;
    converge_options)
      for mode in "" "--fp8-fast-accum 1" "--fp8-head 1"; do
        name=$(echo "fp8 $mode" | tr -d '-' | tr ' ' '_')
        ./train_gpt --fp8 1 $mode --steps 300 --val-every 100 --sample-every 0 --ckpt-every 0 --out /tmp/conv \
          > "$OUT/conv_$name.log" 2>&1
        echo "--fp8 1 $mode: $(grep -aE '^step +300/' "$OUT/conv_$name.log" | cut -c1-60) | $(grep -a 'val' "$OUT/conv_$name.log" | tail -1)"
      done ;;
  esac
done
