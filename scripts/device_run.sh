#!/usr/bin/env bash
# One device call: build everything, run the test suite on the GPU, benchmark train_gpt beside
# PyTorch (torch_baseline.py: not in this repository; put it in the ignored .bench/), and compare
# an export against transformers.
# Usage (on the device machine, from the repo root): bash scripts/device_run.sh [steps...]
#   steps: any of build test dev bench before same plot torch train ckpt graph hf (default: build test bench torch hf).
#   Logs go to $OUT (or /tmp/out). `before` and `same` need an older build carried as .bench/train_gpt_before.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
steps=${*:-build test bench torch hf}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $steps; do
  echo "=== $step"
  case $step in
    build) make -j16 all 2>&1 | grep -E "error|warning" | head -30; ls -la train_gpt test_gpt ;;
    dev)
      ./dev/attention 2>&1 | tee "$OUT/attention.log" | grep -vE "^ok " | tail -40
      ./dev/matmul 2>&1 | tee "$OUT/matmul.log" | grep -vE "^ok " | tail -60 ;;
    test) ./test_gpt 2>&1 | tee "$OUT/test.log" | grep -vE "^\S+ +ok \(" ;;
    bench)
      for rc in 1 0 auto; do
        ./train_gpt --bench --recompute $rc --out /tmp/bench_out 2>&1 | tee "$OUT/bench_rc$rc.log" | grep -E "memory plan|^\{|error" ;
      done ;;
    before)
      for rc in 1 0; do
        .bench/train_gpt_before --bench --recompute $rc --out /tmp/bench_before 2>&1 | tee "$OUT/before_rc$rc.log" \
          | grep -E "^\{|error" ;
      done ;;
    same)
      # The same run with the older build and this one: step 1's loss and gradient norm (same init,
      # same batch) must be identical; later steps agree closely.
      .bench/train_gpt_before --bench --bench-steps 5 --out /tmp/same_before 2>&1 | grep -E "^step +([1-9]|10)/" > "$OUT/same_before.log"
      ./train_gpt --bench --bench-steps 5 --out /tmp/same_after 2>&1 | grep -E "^step +([1-9]|10)/" > "$OUT/same_after.log"
      paste -d'\n' "$OUT/same_before.log" "$OUT/same_after.log" | cut -c1-60 ;;
    plot)
      # A real run as `make train` starts it (the default corpus, carried in data/), then make plot.
      rm -rf out && ./train_gpt 2>&1 | tee "$OUT/train_default.log" | grep -aE "step +(1|50|100|200|300)/|val|sample|error|checkpoint"
      make plot && cp out/log.png out/log.jsonl "$OUT/" ;;
    torch)
      PYTHONUNBUFFERED=1 python3 .bench/torch_baseline.py --model-size small --n-head 6 --n-kv-head 2 --head-dim 128 \
        --compile default --rope-theta 10000 2>&1 | tee "$OUT/torch_small.log" | tail -2 ;;
    train)
      ./train_gpt --steps 120 --val-every 40 --sample-every 60 --ckpt-every 0 --out /tmp/train_out 2>&1 \
        | tee "$OUT/train.log" | grep -aE "step +(1|20|40|60|80|100|120)/|val|sample|error|memory plan" ;;
    ckpt)
      # The cost of asynchronous checkpoints at the default config: 200 steps with a checkpoint every
      # 50 steps and without; wall clock per step over steps 2..199 (the last step's checkpoint and
      # the wait for it at exit are outside the window).
      for every in 0 50; do
        rm -rf /tmp/ckpt_out; ./train_gpt --steps 200 --val-every 0 --val-data '' --sample-every 0 --ckpt-every $every \
          --out /tmp/ckpt_out > "$OUT/ckpt_every$every.log" 2>&1
        python3 -c "import json,sys; r=[json.loads(l) for l in open('/tmp/ckpt_out/log.jsonl') if 'loss' in l]; \
          print('ckpt-every $every: steps 2..199: %.2f ms/step wall clock, %.2f ms/step GPU events' % \
          (1e3*(r[198]['elapsed_s']-r[0]['elapsed_s'])/198, sum(x['ms'] for x in r[1:199])/198))"
        grep -a "checkpoint of step" "$OUT/ckpt_every$every.log"; ls /tmp/ckpt_out | tr '\n' ' '; echo
      done ;;
    sizes)
      # torch_baseline.py's medium and 1b models (--model-size), ours and PyTorch's, then a config
      # that cannot fit.
      ./train_gpt --bench --d-model 1024 --layers 28 --heads 16 --kv-heads 8 --head-dim 128 --ffn 3072 --batch 16 \
        --rope-theta 1e6 2>&1 | tee "$OUT/bench_medium.log" | grep -aE "^\{|error"
      PYTHONUNBUFFERED=1 python3 .bench/torch_baseline.py --model-size medium --compile default 2>&1 \
        | tee "$OUT/torch_medium.log" | tail -2 | head -1
      ./train_gpt --bench --d-model 2048 --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --ffn 8192 --batch 8 \
        --rope-theta 1e6 2>&1 | tee "$OUT/bench_1b.log" | grep -aE "^\{|error"
      PYTHONUNBUFFERED=1 python3 .bench/torch_baseline.py --model-size 1b --compile default 2>&1 \
        | tee "$OUT/torch_1b.log" | tail -2 | head -1
      ./train_gpt --bench --d-model 2048 --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --ffn 8192 --batch 512 \
        --recompute 0; echo "exit code $?" ;;
    graph)
      # --cuda-graph 1 (doc/perf.md): its test, then --bench eagerly and with graphs, back to back, in
      # BF16 and FP8 at the default config and at 1b; the JSON lines give ms/step and tokens/s.
      ./test_gpt cuda_graph 2>&1 | tee "$OUT/graph_test.log" | tail -2
      one_b="--d-model 2048 --layers 16 --heads 32 --kv-heads 8 --head-dim 64 --ffn 8192 --batch 8 --rope-theta 1e6"
      for size in default 1b; do
        args=""; [ $size = 1b ] && args=$one_b
        for fp8 in 0 1; do
          for graph in 0 1; do
            echo "--- $size --fp8 $fp8 --cuda-graph $graph" | tee -a "$OUT/graph_bench.log"
            ./train_gpt --bench $args --fp8 $fp8 --cuda-graph $graph --out /tmp/graph_out 2>&1 \
              | tee -a "$OUT/graph_bench.log" | grep -aE "^\{|error|cuda graph"
          done
        done
      done ;;
    hf)
      rm -rf /tmp/hf && ./train_gpt --bench --bench-steps 20 --batch 4 --seq 256 --out /tmp/hf_out --dump-grads /tmp/hf \
        > "$OUT/hf_dump.log" 2>&1; tail -1 "$OUT/hf_dump.log"
      cp /tmp/hf/grads.json "$OUT/hf_grads.json" 2>/dev/null
      python3 scripts/hf_check.py /tmp/hf --also-bf16 2>&1 | tee "$OUT/hf_check.log" | tail -25 ;;
  esac
done
