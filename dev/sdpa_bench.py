"""
dev/sdpa_bench.py - times PyTorch's scaled_dot_product_attention (causal, bf16) on the shapes of
./dev/attention's timing table, so that our kernels can be read beside PyTorch's back-ends.

Back-ends: FLASH_ATTENTION and CUDNN_ATTENTION (torch.nn.attention.sdpa_kernel), with
enable_gqa=True; a back-end that refuses GQA is run on K/V expanded to Hq heads (marked 'kv
expanded'), and one that refuses the shape is reported as unsupported. Tensors are [B, H, T, D]
contiguous (PyTorch's preferred layout). Same FLOP convention as ./dev/attention: causal counts
the unmasked half, forward 4*B*Hq*T^2*D/2, backward 2.5x that. Timing: CUDA events around each
call, 5 warm-up calls, median of 30; the backward is torch.autograd.grad of the output with a
random upstream gradient (the forward outside the timed region).

Usage: python3 dev/sdpa_bench.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, warmup=5, reps=30):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def bench(backend, B, T, Hq, Hkv, D):
    g = torch.Generator(device="cuda").manual_seed(T * 7 + D)
    mk = lambda h: (torch.rand(B, h, T, D, device="cuda", generator=g) * 2 - 1).mul(3 ** 0.5).to(torch.bfloat16)
    q, k, v, dout = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
    note = ""
    with sdpa_kernel([backend]):
        try:
            q.requires_grad_(True); k.requires_grad_(True); v.requires_grad_(True)
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out = fwd()
        except RuntimeError:
            # this back-end has no GQA: give it K/V with Hq heads (not counted in the FLOPs)
            k = k.detach().repeat_interleave(Hq // Hkv, dim=1).requires_grad_(True)
            v = v.detach().repeat_interleave(Hq // Hkv, dim=1).requires_grad_(True)
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out = fwd()
            note = "kv expanded"
        with torch.no_grad():
            fms = median_ms(lambda: F.scaled_dot_product_attention(
                q.detach(), k.detach(), v.detach(), is_causal=True, enable_gqa=(note == "")))
        bms = median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    return fms, bms, note


def main():
    name = torch.cuda.get_device_name()
    print(f"device: {name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'backend':<8} {'D':>4} {'T':>5} {'B':>3} {'Hq':>3} {'Hkv':>3} | {'fwd ms':>8} {'TFLOP/s':>8} | "
          f"{'bwd ms':>8} {'TFLOP/s':>8} | note")
    for D in (128, 64):
        for T in (512, 1024, 2048, 4096):
            B, Hq, Hkv = 16384 // T, 2048 // D, 8
            fwd_flops = 4.0 * B * Hq * T * T * D / 2
            for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    fms, bms, note = bench(backend, B, T, Hq, Hkv, D)
                except RuntimeError as e:
                    print(f"{label:<8} {D:>4} {T:>5} {B:>3} {Hq:>3} {Hkv:>3} | unsupported: {str(e).splitlines()[0][:80]}")
                    continue
                print(f"{label:<8} {D:>4} {T:>5} {B:>3} {Hq:>3} {Hkv:>3} | {fms:8.3f} {fwd_flops / fms / 1e9:8.1f} | "
                      f"{bms:8.3f} {2.5 * fwd_flops / bms / 1e9:8.1f} | {note}", flush=True)


if __name__ == "__main__":
    main()
