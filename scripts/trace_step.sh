#!/usr/bin/env bash
# trace_step.sh - where a training step's GPU time goes, as it runs: builds train_gpt and the CUPTI
# recorder (tools/steptrace.c), runs `./train_gpt --bench` with it loaded, and prints, over the
# whole steps after the warm-up (a step: from an embedding forward to the next one), the step's span
# against its kernel time, the idle time between kernels and where it falls, and the kernel time
# per kernel, largest first. Durations are the run's own: kernels overlap where they do, caches
# are warm, clocks are what the card's power limit allows (doc/perf.md, "The step's timeline").
# On the GPU machine, from the repository root: OUT (default /tmp/trace) receives trace.csv (one
# line a kernel) and train.log. ARGS: more flags for train_gpt (e.g. ARGS="--fp8 1"); STEPS: timed
# steps of --bench (default 8; the first 5 steps, eager warm-up and the graph's capture, are left out).
set -uo pipefail
OUT=${OUT:-/tmp/trace}; mkdir -p "$OUT"
make -j16 train_gpt libsteptrace.so > "$OUT/build.log" 2>&1 || { echo "build failed: $OUT/build.log"; exit 1; }
CUDA_INJECTION64_PATH=$PWD/libsteptrace.so TRACE_OUT=$OUT/trace.csv \
    ./train_gpt --bench --bench-steps ${STEPS:-8} ${ARGS:-} --out "$OUT/run" > "$OUT/train.log" 2>&1 ||
    { echo "train_gpt failed: $(tail -2 "$OUT/train.log")"; exit 1; }
grep -a '^{"bench"' "$OUT/train.log" | python3 -c "import json, sys
print('train_gpt --bench under the recorder: %.2f ms a step' % json.load(sys.stdin)['ms_per_step'])"
python3 - "$OUT/trace.csv" <<'PY'
import collections, functools, re, subprocess, sys
rows = []
for line in open(sys.argv[1]).read().splitlines()[1:]:
    start, end, stream, smem, dyn, blocks, name = line.split(',', 6)
    rows.append((int(start), int(end), name))
rows.sort()
names = sorted(set(r[2] for r in rows))
try:  # CUDA's demangler; without it the names stay mangled
    out = subprocess.run(['cu++filt'], input='\n'.join(names), capture_output=True, text=True).stdout.splitlines()
except FileNotFoundError:
    out = []
demangled = dict(zip(names, out)) if len(out) == len(names) else {}
# our GEMM's instances by their epilogue: the template's EPI, HopperEpilogue's value, named as
# lib/matmul_hopper.cuh declares it
enum = re.search(r'enum HopperEpilogue \{([^}]*)\}', open('lib/matmul_hopper.cuh').read()).group(1)
EPILOGUES = [e.strip() for e in enum.split(',') if e.strip()]
OURS = {'HOP_EPI_SWIGLU': 'our GEMM: gate/up + SwiGLU', 'HOP_EPI_SWIGLU_BWD': 'our GEMM: down dx + SwiGLU bwd',
        'HOP_EPI_SWIGLU_BWD_ACT': 'our GEMM: down dx + SwiGLU bwd + act',
        'HOP_EPI_LOGITS_EXP': 'our GEMM: head logits + exp'}
@functools.lru_cache(maxsize=None)
def short(name):
    d = demangled.get(name, name)
    d = re.sub(r'^void ', '', d)
    if d.startswith('hopper_matmul_kernel<'):
        epi = EPILOGUES[int(re.sub(r'\(\w+\)', '', d.split('<', 1)[1].split(',')[3]).strip())]
        return OURS.get(epi, 'our GEMM, ' + epi)
    base = d.split('(')[0].split('<')[0]
    if 'nvjet' in base or 'gemm' in base.lower() or 'cublas' in base.lower():
        return 'cuBLASLt ' + re.sub(r'^.*::', '', base)[:48]
    return base[:56]
starts = [i for i, r in enumerate(rows) if 'embedding_forward' in r[2]]
steps = list(zip(starts[:-1], starts[1:]))[5:]
if not steps:
    sys.exit('no whole step after the warm-up among %d kernels: raise STEPS' % len(rows))
n = len(steps)
span = busy = total = 0
idle_after = collections.Counter(); idle_count = collections.Counter()
per_kernel = collections.Counter(); launches = collections.Counter()
for a, b in steps:
    span += rows[b][0] - rows[a][0]
    covered_to = rows[a][0]
    for i in range(a, b):
        s, e, name = rows[i]
        if s > covered_to and i > a:  # the GPU ran no kernel from covered_to to s
            key = short(rows[i - 1][2]) + ' -> ' + short(name)
            idle_after[key] += s - covered_to; idle_count[key] += 1
        busy += max(0, e - max(s, covered_to)); covered_to = max(covered_to, e)
        per_kernel[short(name)] += e - s; launches[short(name)] += 1; total += e - s
idle = span - busy
print('%d steps, %d kernels a step: span %.3f ms, kernels summed %.3f ms, GPU idle %.3f ms a step (%.1f%%)' % (
    n, steps[0][1] - steps[0][0], span / n / 1e6, total / n / 1e6, idle / n / 1e6, 100 * idle / span))
print('the longest idle transitions (ms a step, count a step, mean us):')
for k, v in idle_after.most_common(8):
    print('  %7.3f %4d %6.2f  %s' % (v / n / 1e6, idle_count[k] / n, v / idle_count[k] / 1e3, k))
print('kernel time (ms a step, share of the kernel time, launches a step):')
for k, v in per_kernel.most_common(40):
    print('  %7.3f %5.1f%% %4d  %s' % (v / n / 1e6, 100 * v / total, launches[k] / n, k))
PY
