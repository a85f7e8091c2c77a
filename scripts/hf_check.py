#!/usr/bin/env python3
"""hf_check.py - checks a train_gpt export against Hugging Face transformers' Qwen3.

Usage: python3 scripts/hf_check.py DIR [--loss-tol 2e-2] [--grad-rtol 5e-2] [--also-bf16]

DIR holds what train_gpt wrote: config.json and model.safetensors (transformers' Qwen3 layout, fp32
weights, tied embeddings) and grads.json, train_gpt's loss and gradient norms on one batch:
    {"loss": float, "B": int, "T": int, "tokens": [B*(T+1) ints, row b = sequence b],
     "grad_norms": {"<hf tensor name>": float, ...}, "grad_norm": float}
The inputs are tokens[:, :T] and the targets tokens[:, 1:]. This script loads the export with
Qwen3ForCausalLM in fp32 (TF32 off, eager attention), computes the mean cross-entropy over the B*T
positions and every parameter's gradient, and compares the loss (absolute difference) and each
gradient's L2 norm (relative difference) with train_gpt's. With tied embeddings the gradient of
model.embed_tokens.weight holds the output head's contribution too, as in train_gpt.

It prints the table worst first and the worst tensor, and exits 1 if the loss or any gradient norm
(or the global norm) is off by more than the tolerances, or if model.safetensors and the model
disagree on tensor names (missing or unexpected keys); 2 on bad input. --also-bf16 repeats the
run under bf16 autocast, for context: how far bf16 arithmetic alone moves the same numbers.
"""
import argparse
import json
import math
import os
import sys


def die(msg):
    print(f"hf_check: {msg}", file=sys.stderr)
    sys.exit(2)


def load_grads_json(path):
    try:
        with open(path) as f:
            g = json.load(f)
    except (OSError, ValueError) as e:
        die(f"{path}: {e}")
    for key, kind in (("loss", (int, float)), ("B", int), ("T", int), ("tokens", list),
                      ("grad_norms", dict), ("grad_norm", (int, float))):
        if not isinstance(g.get(key), kind):
            die(f"{path}: missing or mistyped \"{key}\"")
    B, T = g["B"], g["T"]
    if B < 1 or T < 1 or len(g["tokens"]) != B * (T + 1):
        die(f"{path}: {len(g['tokens'])} tokens, expected B*(T+1) = {B}*({T}+1) = {B * (T + 1)}")
    return g


def check_keys(model, info, st_path):
    """Every tensor of model.safetensors used, every parameter loaded: returns a list of problems."""
    from safetensors import safe_open
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            problems.append(f"{kind}: {sorted(map(str, info[kind]))}")
    with safe_open(st_path, framework="pt") as f:
        file_keys = set(f.keys())
    model_keys = set(model.state_dict().keys())
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if file_keys - model_keys:
        problems.append(f"in model.safetensors but not in Qwen3ForCausalLM: {sorted(file_keys - model_keys)}")
    if model_keys - tied - file_keys:
        problems.append(f"in Qwen3ForCausalLM but not in model.safetensors: {sorted(model_keys - tied - file_keys)}")
    return problems


def loss_and_grad_norms(model, tokens, B, T, device, bf16):
    """Mean cross-entropy over B*T positions in fp32 and each parameter's gradient L2 norm."""
    import torch
    import torch.nn.functional as F
    x = torch.tensor(tokens, dtype=torch.long, device=device).view(B, T + 1)
    inputs, targets = x[:, :T], x[:, 1:]
    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=inputs).logits
    logits = logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    # named_parameters lists a tied parameter once, under model.embed_tokens.weight
    norms = {name: p.grad.double().norm().item() if p.grad is not None else 0.0
             for name, p in model.named_parameters()}
    return loss.item(), norms


def rel_err(ours, ref):
    return abs(ours - ref) / max(abs(ref), 1e-12)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="directory with config.json, model.safetensors and grads.json")
    ap.add_argument("--loss-tol", type=float, default=2e-2, help="largest absolute loss difference (default 2e-2)")
    ap.add_argument("--grad-rtol", type=float, default=5e-2,
                    help="largest relative difference of a gradient norm (default 5e-2)")
    ap.add_argument("--also-bf16", action="store_true", help="also report the same under bf16 autocast")
    ap.add_argument("--device", default="cuda", help="torch device (default cuda)")
    args = ap.parse_args()

    st_path = os.path.join(args.dir, "model.safetensors")
    for name in ("config.json", "model.safetensors", "grads.json"):
        if not os.path.isfile(os.path.join(args.dir, name)):
            die(f"{os.path.join(args.dir, name)}: no such file")
    g = load_grads_json(os.path.join(args.dir, "grads.json"))

    try:
        import torch
        from transformers import Qwen3ForCausalLM
    except ImportError as e:
        die(f"needs torch, transformers and safetensors installed ({e})")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        die("no CUDA device; pass --device cpu to run on the CPU")
    # a true fp32 reference: no TF32 in matmuls or convolutions
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, info = Qwen3ForCausalLM.from_pretrained(args.dir, dtype=torch.float32, attn_implementation="eager",
                                                   output_loading_info=True)
    model.to(device).eval()  # eval: no dropout; gradients are computed all the same
    problems = check_keys(model, info, st_path)
    non_fp32 = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if non_fp32:
        problems.append(f"parameters not loaded as fp32: {non_fp32[:5]}")
    vocab = model.config.vocab_size
    bad = [t for t in g["tokens"] if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        die(f"grads.json: token {bad[0]!r} is not an integer in [0, {vocab})")

    B, T = g["B"], g["T"]
    loss32, norms32 = loss_and_grad_norms(model, g["tokens"], B, T, device, bf16=False)
    loss16, norms16 = (loss_and_grad_norms(model, g["tokens"], B, T, device, bf16=True)
                       if args.also_bf16 else (None, {}))

    ours = g["grad_norms"]
    missing = sorted(set(norms32) - set(ours))
    extra = sorted(set(ours) - set(norms32))
    if missing:
        problems.append(f"grads.json has no gradient norm for {missing}")
    if extra:
        problems.append(f"grads.json has gradient norms for tensors the model lacks: {extra}")

    # rows: (relative error, name, train_gpt's norm, hf fp32 norm, hf bf16 norm or None)
    rows = [(rel_err(ours[n], norms32[n]), n, ours[n], norms32[n], norms16.get(n)) for n in norms32 if n in ours]
    global32 = math.sqrt(sum(v * v for v in norms32.values()))
    global16 = math.sqrt(sum(v * v for v in norms16.values())) if norms16 else None
    rows.append((rel_err(g["grad_norm"], global32), "(global grad norm)", g["grad_norm"], global32, global16))
    rows.sort(key=lambda r: math.inf if math.isnan(r[0]) else r[0], reverse=True)

    loss_abs = abs(g["loss"] - loss32)
    print(f"export {args.dir}: B={B} T={T}, {len(norms32)} parameter tensors, device {device}")
    print(f"loss  train_gpt {g['loss']:.7f}  hf fp32 {loss32:.7f}  abs diff {loss_abs:.3e}  "
          f"rel {rel_err(g['loss'], loss32):.3e}  (tol {args.loss_tol:g} abs)")
    if loss16 is not None:
        print(f"      hf bf16 autocast {loss16:.7f}  (abs diff from hf fp32 {abs(loss16 - loss32):.3e})")
    print(f"\ngradient norms, worst first (tol {args.grad_rtol:g} relative):")
    print(f"{'rel err':>10}  {'train_gpt':>13}  {'hf fp32':>13}" + ("  {:>13}  {:>12}".format("hf bf16", "bf16 vs fp32")
                                                                 if args.also_bf16 else "") + "  name")
    for err, name, mine, ref, ref16 in rows:
        line = f"{err:10.3e}  {mine:13.6e}  {ref:13.6e}"
        if ref16 is not None:
            line += f"  {ref16:13.6e}  {rel_err(ref16, ref):12.3e}"
        print(f"{line}  {name}")
    print(f"\nworst tensor: {rows[0][1]} (relative error {rows[0][0]:.3e})")

    if loss_abs > args.loss_tol:
        problems.append(f"loss differs by {loss_abs:.3e} > {args.loss_tol:g}")
    over = [r[1] for r in rows if not r[0] <= args.grad_rtol]  # NaN counts as over
    if over:
        problems.append(f"{len(over)} gradient norm(s) off by more than {args.grad_rtol:g}: {over[:5]}")
    for p in problems:
        print(f"FAIL: {p}")
    print("FAIL" if problems else "PASS")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
