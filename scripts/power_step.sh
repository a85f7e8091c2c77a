#!/usr/bin/env bash
# power_step.sh - what a training step costs in energy: runs `./train_gpt --bench` (and, with TORCH
# set, torch_baseline.py) while nvidia-smi samples the card's power draw, SM clock and throttle
# reasons every 50 ms, and prints for each run its time a step, its mean power, the SM clock and
# the joules a step (mean power x time a step). On a card held at its power limit (an H100 at
# 700 W: doc/perf.md, "Energy a step") a step cannot be shorter than its energy over the limit,
# so J a step is the figure that work run side by side cannot move and fewer bytes or flops can.
# On the GPU machine, from the repository root (train_gpt built): ARGS: flags for train_gpt (e.g.
# ARGS="--fp8 1"); TORCH: flags for torch_baseline.py, which must lie in .bench/ (e.g.
# TORCH="--model-size small --n-head 6 --n-kv-head 2 --head-dim 128 --compile default
# --rope-theta 10000"); STEPS: timed steps of each (default 150); OUT (default /tmp/power)
# receives the samples and the logs.
# The samples counted: those above 350 W (the steps, not the start-up or torch's compilation), less
# their first 1.5 s and last 1 s: nvidia-smi's power.draw is an average over the last second or so
# (it climbs for a second after the load starts), so a run needs several seconds of steps, and
# STEPS keeps it there (150 steps of the default config: 8 s).
set -uo pipefail
OUT=${OUT:-/tmp/power}; mkdir -p "$OUT"

# measure LABEL COMMAND...: runs COMMAND under the sampler, then reports.
measure() {
    local label=$1; shift
    nvidia-smi --query-gpu=power.draw,clocks.sm,clocks_event_reasons.active --format=csv,noheader,nounits \
        -lms 50 > "$OUT/$label.csv" &
    local sampler=$!
    "$@" > "$OUT/$label.log" 2>&1 || echo "$label: the run failed, see $OUT/$label.log"
    kill $sampler; wait $sampler 2> /dev/null
    python3 - "$OUT/$label" "$label" <<'PY'
import json, statistics, sys
path, label = sys.argv[1:]
lines = open(path + '.log').read().splitlines()
ms = None
for l in lines:  # train_gpt's one JSON line, or torch_baseline.py's last result line
    if l.startswith('{"bench"'): ms = json.loads(l)['ms_per_step']
    elif l.startswith('{') and 'tokens_per_step' in l:
        r = json.loads(l)
        ms = r['tokens_per_step'] * 1000 / r['tokens_per_s']
samples = []
for l in open(path + '.csv'):
    f = [x.strip() for x in l.split(',')]
    try: samples.append((float(f[0]), float(f[1]), f[2]))
    except (ValueError, IndexError): pass
busy = [s for s in samples if s[0] > 350]
busy = busy[30: len(busy) - 20]  # 50 ms apart: the first 1.5 s and the last 1 s
if ms is None or len(busy) < 20:
    sys.exit('%s: no time a step, or too few samples at load (%d)' % (label, len(busy)))
watts = statistics.mean(s[0] for s in busy)
capped = sum(int(s[2], 16) & 0x4 != 0 for s in busy)  # 0x4: the software power cap holds the clock
print('%-12s %8.2f ms a step  %4.0f W  SM clock %4.0f MHz (median)  %6.1f J a step  power-capped in %d of %d samples'
      % (label, ms, watts, statistics.median(s[1] for s in busy), watts * ms / 1000, capped, len(busy)))
PY
}

nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
measure train_gpt ./train_gpt --bench --bench-steps ${STEPS:-150} ${ARGS:-} --out "$OUT/run"
if [ -n "${TORCH:-}" ]; then measure torch python3 .bench/torch_baseline.py --steps ${STEPS:-150} $TORCH; fi
