#!/usr/bin/env bash
# The optimizers' device run (doc/optimizers.md), one call of about 6-8 minutes on an H100:
#   1. build train_gpt and test_gpt; run the optimizer tests and the AdamW/resume tests on the GPU
#   2. per-step cost: ./train_gpt --bench for adamw, adamw8bit, muon (default config)
#   3. convergence: 300 steps on the default corpus (data/default), the default config, one init and
#      one data order (--seed 1337), validation every 25 steps: adamw at --lr 6e-4 (default) and
#      1.2e-3, adamw8bit at 6e-4, muon at --muon-lr 0.01, 0.02, 0.04 (its AdamW part at 6e-4)
#   4. one table (stdout and optim_summary.txt), the curves against steps and against wall-clock
#      (optim_curves.png), every log in optim_logs.tgz
# Usage (on the device machine, from the repo root, data/default present): bash scripts/optim_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/optim_logs.XXXXXX)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOGS/gpu.txt"
t0=$(date +%s)

echo "=== build"
make -j16 train_gpt test_gpt 2>&1 | grep -E "error|warning" | head -20
[ -x ./train_gpt ] && [ -x ./test_gpt ] || { echo "build failed"; exit 1; }
echo "build done at $(( $(date +%s) - t0 )) s"

echo "=== tests"
for f in optim gpu_kernel_adamw gpu_resume_is_bit_exact; do ./test_gpt $f; done 2>&1 | tee "$LOGS/test.log" \
  | grep -vE "^\S+ +(ok|skipped) \(|^test_gpt:"
echo "tests done at $(( $(date +%s) - t0 )) s"

echo "=== bench"
for opt in adamw adamw8bit muon; do
  ./train_gpt --bench --optimizer $opt --out /tmp/optim_bench 2>&1 | tee "$LOGS/bench_$opt.log" \
    | grep -aE "^optimizer:|memory plan|^\{|error"
done
echo "bench done at $(( $(date +%s) - t0 )) s"

echo "=== converge"
runs=("adamw_lr6e-4|--optimizer adamw --lr 6e-4"
      "adamw_lr1.2e-3|--optimizer adamw --lr 1.2e-3"
      "adamw8bit_lr6e-4|--optimizer adamw8bit --lr 6e-4"
      "muon_lr0.01|--optimizer muon --muon-lr 0.01"
      "muon_lr0.02|--optimizer muon --muon-lr 0.02"
      "muon_lr0.04|--optimizer muon --muon-lr 0.04")
for run in "${runs[@]}"; do
  name=${run%%|*}; args=${run#*|}
  if [ $(( $(date +%s) - t0 )) -gt 430 ]; then echo "skipping $name: out of time"; continue; fi
  rm -rf "/tmp/optim_$name"
  ./train_gpt $args --seed 1337 --steps 300 --val-every 25 --sample-every 0 --ckpt-every 0 --out "/tmp/optim_$name" \
    > "$LOGS/train_$name.log" 2>&1
  cp "/tmp/optim_$name/log.jsonl" "$LOGS/$name.jsonl" 2>/dev/null
  echo "$name ($args): $(grep -a 'val loss' "$LOGS/train_$name.log" | tail -1 | cut -c1-40) at $(( $(date +%s) - t0 )) s"
done

echo "=== summary"
python3 - "$LOGS" "$OUT" <<'PY' | tee "$LOGS/optim_summary.txt"
import glob, json, os, re, sys
logs, out = sys.argv[1], sys.argv[2]

def load(path):
    train, val = {}, {}
    for line in open(path):
        r = json.loads(line)
        (train if "loss" in r else val)[r["step"]] = r
    return train, val

runs = {}
for path in sorted(glob.glob(os.path.join(logs, "*.jsonl"))):
    name = os.path.basename(path)[:-6]
    train, val = load(path)
    if not train:
        continue
    t1 = train[min(train)]["elapsed_s"]  # wall clock from the end of step 1 (startup left out)
    curve = [(s, v["val_loss"], train[s]["elapsed_s"] - t1) for s, v in sorted(val.items()) if s in train]
    ms = sorted(r["ms"] for s, r in train.items() if s > 10)
    runs[name] = {"curve": curve, "ms": ms[len(ms) // 2] if ms else float("nan")}

bench = {}
for opt in ("adamw", "adamw8bit", "muon"):
    path = os.path.join(logs, "bench_%s.log" % opt)
    if not os.path.exists(path):
        continue
    text = open(path, errors="replace").read()
    js = [json.loads(l) for l in text.splitlines() if l.startswith("{")]
    plan = re.search(r"optimizer ([0-9.]+) \|", text)
    per = re.search(r"its state ([0-9.]+) bytes per parameter", text)
    bench[opt] = {"ms": js[-1]["ms_per_step"] if js else float("nan"),
                  "opt_gib": float(plan.group(1)) if plan else float("nan"),
                  "bytes_per_param": float(per.group(1)) if per else float("nan")}

print("per-step cost (--bench, default config):")
print("| optimizer | ms/step | vs adamw | optimizer memory (GiB) | state bytes/param |")
print("|---|---|---|---|---|")
base = bench.get("adamw", {}).get("ms", float("nan"))
for opt, b in bench.items():
    print("| %s | %.2f | %+.1f%% | %.2f | %.3f |" % (opt, b["ms"], 100 * (b["ms"] / base - 1), b["opt_gib"],
                                                   b["bytes_per_param"]))

def reach(curve, target):  # first validation at or below target: (step, seconds)
    for s, v, t in curve:
        if v <= target:
            return s, t
    return None, None

ref = runs.get("adamw_lr6e-4")
target = ref["curve"][-1][1] if ref and ref["curve"] else None
print("\nvalidation loss, 300 steps, default corpus and config, seed 1337 (one init, one data order):")
print("| run | val@100 | val@200 | val@300 | train ms/step (median) | wall s to 300 | steps to adamw's val@300 | s to it |")
print("|---|---|---|---|---|---|---|---|")
for name, r in runs.items():
    c = {s: (v, t) for s, v, t in r["curve"]}
    get = lambda s: "%.4f" % c[s][0] if s in c else "-"
    s_hit, t_hit = reach(r["curve"], target) if target else (None, None)
    wall = "%.1f" % c[300][1] if 300 in c else "-"
    print("| %s | %s | %s | %s | %.2f | %s | %s | %s |" % (name, get(100), get(200), get(300), r["ms"], wall,
          s_hit if s_hit else "not reached", "%.1f" % t_hit if t_hit is not None else "-"))
if ref and "adamw8bit_lr6e-4" in runs:
    a = {s: v for s, v, _ in ref["curve"]}
    b = {s: v for s, v, _ in runs["adamw8bit_lr6e-4"]["curve"]}
    worst = max((abs(b[s] - a[s]) / a[s] for s in a if s in b and s >= 25), default=float("nan"))
    print("\nadamw8bit vs adamw (lr 6e-4): largest relative gap in validation loss from step 25 on: %.2f%%" % (100 * worst))

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(13, 5))
    for name, r in runs.items():
        s, v, t = zip(*r["curve"]) if r["curve"] else ((), (), ())
        ax[0].plot(s, v, marker=".", label=name)
        ax[1].plot(t, v, marker=".", label=name)
    for a, x in zip(ax, ("step", "wall-clock seconds after step 1")):
        a.set_xlabel(x); a.set_ylabel("validation loss"); a.grid(alpha=0.3); a.legend(fontsize=8)
        a.set_ylim(top=min(8.0, a.get_ylim()[1]))
    fig.suptitle("adamw / adamw8bit / muon, 300 steps, default config and corpus")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "optim_curves.png"), dpi=110)
    print("\nplot: optim_curves.png")
except Exception as e:
    print("\nno plot (%s)" % e)
PY
cp "$LOGS/optim_summary.txt" "$OUT/"
tar -czf "$OUT/optim_logs.tgz" -C "$LOGS" .
echo "done at $(( $(date +%s) - t0 )) s; in \$OUT: optim_summary.txt optim_curves.png optim_logs.tgz"
