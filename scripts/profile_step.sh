#!/usr/bin/env bash
# profile_step.sh - where one training step's GPU time goes: builds train_gpt, runs a window of
# `./train_gpt --bench` launches under Nsight Compute (kernel durations only, clocks not locked),
# and prints the time per kernel over one step (from an embedding forward to the next), largest first.
# On the GPU machine, from the repository root, with $OUT set: writes $OUT/ncu.csv and $OUT/ncu.err.
# ARGS: more flags for train_gpt (e.g. ARGS="--fp8 1"); COUNT: launches profiled (two steps and more:
# the window starts anywhere in a step; a default-config step is about 400 launches, an FP8 one 560).
set -uo pipefail
make -j16 train_gpt > /dev/null 2>&1 || { echo build failed; exit 1; }
# skip the first steps' launches, then take two steps' worth and more
ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --launch-skip 1800 --launch-count ${COUNT:-1200} ./train_gpt --bench --bench-steps 2 ${ARGS:-} > $OUT/ncu.csv 2> $OUT/ncu.err
python3 - <<'PY'
import csv, collections, os, re
rows = list(csv.DictReader(l for l in open(os.environ['OUT'] + '/ncu.csv') if l.startswith('"')))
by_id = collections.OrderedDict()
for r in rows:
    if r['Metric Name'] == 'gpu__time_duration.sum':
        by_id[int(r['ID'])] = (r['Kernel Name'], float(r['Metric Value'].replace(',', '')))
# one whole step: from an embedding forward (a step's first kernel) up to the next one
ids = sorted(by_id)
starts = [i for i in ids if by_id[i][0].startswith('embedding_forward')]
if len(starts) < 2:
    raise SystemExit('no whole step among the %d launches profiled: raise COUNT' % len(ids))
step = [i for i in ids if starts[0] <= i < starts[1]]
tot = collections.Counter(); cnt = collections.Counter()
for i in step:
    name = by_id[i][0]
    short = name.split('(')[0].split('<')[0][:60]
    cast = re.search(r'fp8_cast_kernel<(?:\(\w+\))?(\d+)(?:,\s*(\w+))?>', name)  # format, producer
    if cast: short = 'fp8_cast_kernel %s %s' % ('E5M2' if cast.group(1) == '1' else 'E4M3', cast.group(2) or '')
    if 'gemm' in name.lower() or 'sm90' in name.lower() or 'cutlass' in name.lower(): short = 'cuBLASLt ' + short[:45]
    tot[short] += by_id[i][1]; cnt[short] += 1
total = sum(tot.values())
print('one step: %d kernels, %.2f ms of kernel time' % (len(step), total / 1e6))
for k, v in tot.most_common(30):
    print('%8.3f ms %5.1f%% %4d  %s' % (v / 1e6, 100 * v / total, cnt[k], k))
PY
tail -3 $OUT/ncu.err
