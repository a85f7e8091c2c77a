#!/usr/bin/env python3
"""plot_log.py - one picture of a run: train_gpt's out/log.jsonl as a PNG (`make plot`).

Four panels against the optimizer step: train and validation loss, tokens/s, the learning rate,
and the gradient norm. The log is appended to by every run in the same --out directory; the
picture shows the latest run: a record of step 1 starts a new run, and a step logged twice (a run
resumed from a checkpoint older than its last logged step) keeps its later record.

Usage: python3 scripts/plot_log.py [LOG] [PNG]     (defaults: out/log.jsonl, out/log.png)
Needs matplotlib (pip install matplotlib, or Debian's python3-matplotlib).
"""
import json
import sys


def latest_run(path):
    """The records of the latest run: {step: record} for training steps and for validations."""
    train, val = {}, {}
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                sys.exit(f"plot_log: {path}:{line_no}: not a JSON line")
            step = record.get("step")
            if "loss" in record:
                if step == 1:
                    train, val = {}, {}
                train[step] = record
            elif "val_loss" in record:
                val[step] = record
    return train, val


def main():
    log = sys.argv[1] if len(sys.argv) > 1 else "out/log.jsonl"
    png = sys.argv[2] if len(sys.argv) > 2 else log.rsplit(".", 1)[0] + ".png"
    try:
        train, val = latest_run(log)
    except OSError as e:
        sys.exit(f"plot_log: {log}: {e.strerror} (train first: make train)")
    if not train:
        sys.exit(f"plot_log: {log} holds no training steps")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_log: needs matplotlib (pip install matplotlib, or apt install python3-matplotlib)")

    steps = sorted(train)
    col = lambda key: [train[s][key] for s in steps]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    ax[0][0].plot(steps, col("loss"), label="train", lw=1)
    if val:
        vs = sorted(val)
        ax[0][0].plot(vs, [val[s]["val_loss"] for s in vs], "o-", label="validation", ms=4)
    ax[0][0].set_title("loss")
    ax[0][0].legend()
    ax[0][1].plot(steps, [t / 1e3 for t in col("tokens_per_s")], lw=1)
    ax[0][1].set_title("throughput (K tokens/s)")
    ax[1][0].plot(steps, col("lr"), lw=1)
    ax[1][0].set_title("learning rate")
    ax[1][1].plot(steps, col("grad_norm"), lw=1)
    ax[1][1].set_title("gradient norm (before clipping)")
    for a in ax.flat:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    last = train[steps[-1]]
    fig.suptitle(f"{log}: {len(steps)} steps, last loss {last['loss']:.4f}"
                 + (f", last val loss {val[max(val)]['val_loss']:.4f}" if val else ""))
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
