/*
 * dev/attention.cu - the attention ladder: causal GQA self-attention, forward and backward, bf16 in
 * and out, checked against a CPU FP64 reference and timed against each other.
 *
 * Versions (same API and layouts: attention_fa2.cuh's header):
 *   1  naive (attention_naive.cuh): scores, softmax and both products materialized in fp32
 *      scratch, one thread per output element. The readable reference. ~1 TFLOP/s.
 *   2  FlashAttention-2 style (attention_fa2.cuh): tiles in shared memory by cp.async, mma.sync
 *      m16n8k16 on tensor cores, online softmax, causal tiles skipped; deterministic backward in
 *      three kernels (delta, dK/dV over KV tiles, dQ over query tiles). H100, D=128, T=1024..4096:
 *      forward 251-323 TFLOP/s, backward 172-205.
 *   3  Hopper wgmma (attention_wgmma.cuh), first step: version 2's algorithm with every product a
 *      warpgroup wgmma chain (operands straight from shared memory, P and dS from registers), two
 *      warpgroups per block, cp.async loads. H100, D=128, T=1024..4096: forward 289-419 TFLOP/s,
 *      backward 217-287.
 *   4  FlashAttention-3's shape (lib/attention.cuh: the trainer's kernels): TMA loads (3-D tensor
 *      maps, 128-byte swizzle) on mbarrier rings, a producer warpgroup (setmaxnreg 24) and 2
 *      consumer warpgroups (3 in the forward at D=64, T>1024). Forward: a persistent grid fed by a
 *      work queue, S of the next tile issued before the softmax of this one. Backward: one pass, 5
 *      products per tile pair, dQ partial sums bulk-reduced into fp32 global accumulators in a
 *      fixed order (semaphores) or, as "atomic dq", in any order. H100, D=128, T=1024..4096:
 *      forward 385-554 TFLOP/s, backward 265-407.
 * The full tables, the tile tuning behind each version and the PyTorch SDPA figures of the same
 * runs are in doc/attention.md.
 *
 * Usage: ./dev/attention          check every version, then time every version
 *        ./dev/attention N        check and time version N only (digits: "34" runs 3 and 4)
 *        ./dev/attention tune     check, then time each tile configuration (tuneN: version N's only)
 *        a second argument `check` skips the timing (./dev/attention 2 check)
 * Each run first checks on small shapes with fresh random inputs (outputs poisoned with NaN; max
 * abs and relative-L2 error of out, lse, dq, dk, dv; the backward run twice and compared bitwise),
 * then times at B*T = 16K tokens, T in {512, 1024, 2048, 4096}; head_dim 128 with Hq 16, Hkv 8 (the
 * medium model's heads) and head_dim 64 with Hq 32, Hkv 8 (the 1b model's). Causal FLOPs count the
 * unmasked half only: forward 4*B*Hq*T^2*D/2, backward 2.5x that. Inputs (>= 128 MiB per shape)
 * exceed the 50 MiB L2, so no rotation is needed.
 */
#include "../lib/attention.cuh"  // version 4 (the trainer's) and the helpers the other versions share
#include "common.h"
#include "attention_naive.cuh"
#include "attention_fa2.cuh"
#include "attention_wgmma.cuh"

typedef void (*FwdFn)(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride, int B,
                      int T, int Hq, int Hkv, int D, cudaStream_t stream);
typedef void (*BwdFn)(bf16* dq, bf16* dk, bf16* dv, float* scratch, const bf16* dout, const bf16* out,
                      const float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                      int dqkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream);
typedef void (*DkdvFn)(bf16* dk, bf16* dv, const bf16* dout, const float* lse, const float* delta, const bf16* q,
                       const bf16* k, const bf16* v, int stride, int dstride, int B, int T, int Hq, int Hkv, int D,
                       cudaStream_t stream);
typedef void (*DqFn)(bf16* dq, const bf16* dout, const float* lse, const float* delta, const bf16* q, const bf16* k,
                     const bf16* v, int stride, int dstride, int B, int T, int Hq, int Hkv, int D,
                     cudaStream_t stream);

// ----------------------------------------------------------------------------------------------
// Version 2's tile configurations, as functions of the common signature (dispatching on D).

template <int BM, int BN, int W, int MINB, int KV_BUFS = 2>
static void fwd_cfg(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int B, int T,
                    int Hq, int Hkv, int D, cudaStream_t st) {
    if (D == 64) fa2_forward_launch<64, BM, BN, W, MINB, KV_BUFS>(out, lse, q, k, v, stride, B, T, Hq, Hkv, st);
    else fa2_forward_launch<128, BM, BN, W, MINB, KV_BUFS>(out, lse, q, k, v, stride, B, T, Hq, Hkv, st);
}
template <int BM, int W, int MINB>
static void dkdv_cfg(bf16* dk, bf16* dv, const bf16* dout, const float* lse, const float* delta, const bf16* q,
                     const bf16* k, const bf16* v, int stride, int dstride, int B, int T, int Hq, int Hkv, int D,
                     cudaStream_t st) {
    if (D == 64)
        fa2_backward_dkdv_launch<64, BM, W, MINB>(dk, dv, dout, lse, delta, q, k, v, stride, dstride, B, T, Hq, Hkv, st);
    else
        fa2_backward_dkdv_launch<128, BM, W, MINB>(dk, dv, dout, lse, delta, q, k, v, stride, dstride, B, T, Hq, Hkv, st);
}
template <int BN, int W, int MINB>
static void dq_cfg(bf16* dq, const bf16* dout, const float* lse, const float* delta, const bf16* q, const bf16* k,
                   const bf16* v, int stride, int dstride, int B, int T, int Hq, int Hkv, int D, cudaStream_t st) {
    if (D == 64) fa2_backward_dq_launch<64, BN, W, MINB>(dq, dout, lse, delta, q, k, v, stride, dstride, B, T, Hq, Hkv, st);
    else fa2_backward_dq_launch<128, BN, W, MINB>(dq, dout, lse, delta, q, k, v, stride, dstride, B, T, Hq, Hkv, st);
}

// An implementation under test: a version's public pair, or one tile configuration of version 2
// (fwd plus, when bwd is null, delta + dkdv + dq). dims: bit 0 = runs at D 64, bit 1 = at D 128.
// Version 4's forward without FP8 codes (the ladder times the bf16 output), and its backward with
// its dQ sums in a fixed order (the default) or in any order.
static void attention_forward_bf16(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride,
                                   int B, int T, int Hq, int Hkv, int D, cudaStream_t st) {
    attention_forward(out, lse, q, k, v, stride, B, T, Hq, Hkv, D, st);
}
static void attention_backward_det(bf16* dq, bf16* dk, bf16* dv, float* scratch, const bf16* dout, const bf16* out,
                                   const float* lse, const bf16* q, const bf16* k, const bf16* v, int stride,
                                   int dstride, int B, int T, int Hq, int Hkv, int D, cudaStream_t st) {
    attention_backward(dq, dk, dv, scratch, dout, out, lse, q, k, v, stride, dstride, B, T, Hq, Hkv, D, st, true);
}
static void attention_backward_atomic(bf16* dq, bf16* dk, bf16* dv, float* scratch, const bf16* dout, const bf16* out,
                                      const float* lse, const bf16* q, const bf16* k, const bf16* v, int stride,
                                      int dstride, int B, int T, int Hq, int Hkv, int D, cudaStream_t st) {
    attention_backward(dq, dk, dv, scratch, dout, out, lse, q, k, v, stride, dstride, B, T, Hq, Hkv, D, st, false);
}

typedef struct {
    int version;
    const char* name;
    int dims;
    FwdFn fwd;
    BwdFn bwd;
    DkdvFn dkdv;
    DqFn dq;
    bool nondet;  // the backward may differ run to run (fp32 atomics): not checked for repeatability
} Impl;

static const Impl VERSIONS[] = {
    {1, "naive", 3, naive_attention_forward, naive_attention_backward, nullptr, nullptr},
    {2, "fa2", 3, attention_forward_fa2, attention_backward_fa2, nullptr, nullptr},
    {3, "wgmma", 3, attention_forward_wgmma, attention_backward_wgmma, nullptr, nullptr},
    {4, "tma-ws", 3, attention_forward_bf16, attention_backward_det, nullptr, nullptr},
    {4, "tma-ws atomic dq", 3, attention_forward_bf16, attention_backward_atomic, nullptr, nullptr, true},
};
// Tuning candidates; the default backward pieces are the first of each list.
template <int BN>
static void wg_cfg(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int B, int T,
                   int Hq, int Hkv, int D, cudaStream_t st) {
    if (D == 64) wg_forward_launch<64, BN>(out, lse, q, k, v, stride, B, T, Hq, Hkv, st);
    else wg_forward_launch<128, BN>(out, lse, q, k, v, stride, B, T, Hq, Hkv, st);
}

template <int BM, int MINB = 1>
static void wg_dkdv_cfg(bf16* dk, bf16* dv, const bf16* dout, const float* lse, const float* delta, const bf16* q,
                        const bf16* k, const bf16* v, int stride, int dstride, int B, int T, int Hq, int Hkv, int D,
                        cudaStream_t st) {
    if (D == 64) wg_backward_dkdv_launch<64, BM, MINB>(dk, dv, dout, lse, delta, q, k, v, stride, dstride, B, T, Hq, Hkv, st);
    else wg_backward_dkdv_launch<128, BM, MINB>(dk, dv, dout, lse, delta, q, k, v, stride, dstride, B, T, Hq, Hkv, st);
}
template <int BN, int MINB = 1>
static void wg_dq_cfg(bf16* dq, const bf16* dout, const float* lse, const float* delta, const bf16* q, const bf16* k,
                      const bf16* v, int stride, int dstride, int B, int T, int Hq, int Hkv, int D, cudaStream_t st) {
    if (D == 64) wg_backward_dq_launch<64, BN, MINB>(dq, dout, lse, delta, q, k, v, stride, dstride, B, T, Hq, Hkv, st);
    else wg_backward_dq_launch<128, BN, MINB>(dq, dout, lse, delta, q, k, v, stride, dstride, B, T, Hq, Hkv, st);
}

// Version 4's forward tiles: BN keys per tile, NC consumer warpgroups (64*NC query rows); D128_NC is
// NC at D = 128, where 3 consumers of a 128-key tile would spill; PERSIST false: one block per work
// item instead of one per SM taking items from the queue; L2_MIB: the K/V footprint of an item group.
template <int BN, int NC, int D128_NC = 2, bool PERSIST = true, int L2_MIB = 4>
static void v4_cfg(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int B, int T,
                   int Hq, int Hkv, int D, cudaStream_t st) {
    if (D == 64) ws_forward_launch<64, BN, NC, PERSIST, L2_MIB>(out, lse, q, k, v, stride, B, T, Hq, Hkv, st);
    else ws_forward_launch<128, BN, D128_NC, PERSIST, L2_MIB>(out, lse, q, k, v, stride, B, T, Hq, Hkv, st);
}

static const Impl TUNE[] = {
    {4, "tma 128x128", 3, v4_cfg<128, 2>, attention_backward_det, nullptr, nullptr},
    {4, "tma 128x128 1 MiB", 3, v4_cfg<128, 2, 2, true, 1>, attention_backward_det, nullptr, nullptr},
    {4, "tma 128x128 64 MiB", 3, v4_cfg<128, 2, 2, true, 64>, attention_backward_det, nullptr, nullptr},
    {4, "tma 128x128 per item", 3, v4_cfg<128, 2, 2, false>, attention_backward_det, nullptr, nullptr},
    {4, "tma 192x128", 1, v4_cfg<128, 3>, attention_backward_det, nullptr, nullptr},
    {4, "tma 192q x 64k", 3, v4_cfg<64, 3, 3>, attention_backward_det, nullptr, nullptr},
    {2, "fwd BM128 BN64 4w", 3, fwd_cfg<128, 64, 4, 2>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "fwd 128x64 4w 1buf", 3, fwd_cfg<128, 64, 4, 2, 1>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "fwd 128x128 4w 1buf", 1, fwd_cfg<128, 128, 4, 2, 1>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {3, "wgmma fwd BN128", 3, wg_cfg<128>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {3, "wgmma fwd BN64", 3, wg_cfg<64>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {3, "wgmma dkdv BM64", 3, wg_cfg<128>, nullptr, wg_dkdv_cfg<64>, dq_cfg<64, 4, 2>},
    {3, "wgmma dkdv BM32", 3, wg_cfg<128>, nullptr, wg_dkdv_cfg<32>, dq_cfg<64, 4, 2>},
    {3, "wgmma dq BN64", 3, wg_cfg<128>, nullptr, dkdv_cfg<64, 4, 2>, wg_dq_cfg<64>},
    {3, "wgmma dq BN128", 3, wg_cfg<128>, nullptr, dkdv_cfg<64, 4, 2>, wg_dq_cfg<128>},
    {3, "wgmma dq BN32", 3, wg_cfg<128>, nullptr, dkdv_cfg<64, 4, 2>, wg_dq_cfg<32>},
    {3, "wgmma dkdv BM32 2blk", 1, wg_cfg<128>, nullptr, wg_dkdv_cfg<32, 2>, dq_cfg<64, 4, 2>},
    {3, "wgmma dkdv BM64 2blk", 1, wg_cfg<128>, nullptr, wg_dkdv_cfg<64, 2>, dq_cfg<64, 4, 2>},
    {3, "wgmma dkdv BM128", 1, wg_cfg<128>, nullptr, wg_dkdv_cfg<128>, dq_cfg<64, 4, 2>},
    {3, "wgmma dq BN64 2blk", 1, wg_cfg<128>, nullptr, dkdv_cfg<64, 4, 2>, wg_dq_cfg<64, 2>},
    {2, "fwd BM64 BN64 4w", 3, fwd_cfg<64, 64, 4, 3>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "fwd BM128 BN64 8w", 3, fwd_cfg<128, 64, 8, 1>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "fwd BM128 BN64 8w2", 3, fwd_cfg<128, 64, 8, 2>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "fwd BM128 BN32 4w", 3, fwd_cfg<128, 32, 4, 2>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "fwd BM64 BN128 4w", 1, fwd_cfg<64, 128, 4, 2>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "fwd BM128 BN128 4w", 1, fwd_cfg<128, 128, 4, 2>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "dkdv BN64 BM32 4w", 3, fwd_cfg<128, 64, 4, 2>, nullptr, dkdv_cfg<32, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "dkdv BN64 BM128 4w", 1, fwd_cfg<128, 64, 4, 2>, nullptr, dkdv_cfg<128, 4, 2>, dq_cfg<64, 4, 2>},
    {2, "dkdv BN128 BM64 8w", 3, fwd_cfg<128, 64, 4, 2>, nullptr, dkdv_cfg<64, 8, 1>, dq_cfg<64, 4, 2>},
    {2, "dkdv BN128 BM32 8w", 3, fwd_cfg<128, 64, 4, 2>, nullptr, dkdv_cfg<32, 8, 1>, dq_cfg<64, 4, 2>},
    {2, "dq BM64 BN32 4w", 3, fwd_cfg<128, 64, 4, 2>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<32, 4, 3>},
    {2, "dq BM64 BN128 4w", 1, fwd_cfg<128, 64, 4, 2>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<128, 4, 2>},
    {2, "dq BM128 BN64 8w", 3, fwd_cfg<128, 64, 4, 2>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<64, 8, 1>},
    {2, "dq BM128 BN32 8w", 3, fwd_cfg<128, 64, 4, 2>, nullptr, dkdv_cfg<64, 4, 2>, dq_cfg<32, 8, 1>},
};

// ----------------------------------------------------------------------------------------------
// Buffers of one shape: a packed qkv (row stride (Hq + 2*Hkv)*D + pad), a packed dqkv (its own
// pad), out, lse, dout, delta.

typedef struct {
    AttnShape s;
    int stride, dstride;
    bf16 *qkv, *dqkv, *out, *dout;
    float *lse, *delta;  // delta: the backward's scratch (its first B*Hq*T floats are delta)
    size_t scratch_bytes;
} Bufs;

static Bufs bufs_alloc(AttnShape s, int pad, int dpad) {
    Bufs b;
    b.s = s;
    b.stride = (s.Hq + 2 * s.Hkv) * s.D + pad;
    b.dstride = (s.Hq + 2 * s.Hkv) * s.D + dpad;
    const size_t bt = (size_t)s.B * s.T;
    CUDA_CHECK(cudaMalloc(&b.qkv, bt * b.stride * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&b.dqkv, bt * b.dstride * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&b.out, bt * s.Hq * s.D * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&b.dout, bt * s.Hq * s.D * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&b.lse, (size_t)s.B * s.Hq * s.T * sizeof(float)));
    b.scratch_bytes = std::max((size_t)s.B * s.Hq * s.T * sizeof(float), attention_backward_scratch_bytes(s.B, s.T, s.Hq, s.D));
    CUDA_CHECK(cudaMalloc(&b.delta, b.scratch_bytes));
    return b;
}
static void bufs_free(Bufs* b) {
    CUDA_CHECK(cudaFree(b->qkv));
    CUDA_CHECK(cudaFree(b->dqkv));
    CUDA_CHECK(cudaFree(b->out));
    CUDA_CHECK(cudaFree(b->dout));
    CUDA_CHECK(cudaFree(b->lse));
    CUDA_CHECK(cudaFree(b->delta));
}
static const bf16* q_of(const Bufs& b) { return b.qkv; }
static const bf16* k_of(const Bufs& b) { return b.qkv + b.s.Hq * b.s.D; }
static const bf16* v_of(const Bufs& b) { return b.qkv + (b.s.Hq + b.s.Hkv) * b.s.D; }

static void run_fwd(const Impl& im, const Bufs& b) {
    const AttnShape& s = b.s;
    im.fwd(b.out, b.lse, q_of(b), k_of(b), v_of(b), b.stride, s.B, s.T, s.Hq, s.Hkv, s.D, 0);
}
static void run_bwd(const Impl& im, const Bufs& b) {
    const AttnShape& s = b.s;
    bf16 *dq = b.dqkv, *dk = b.dqkv + s.Hq * s.D, *dv = b.dqkv + (s.Hq + s.Hkv) * s.D;
    if (im.bwd) {
        im.bwd(dq, dk, dv, b.delta, b.dout, b.out, b.lse, q_of(b), k_of(b), v_of(b), b.stride, b.dstride, s.B, s.T,
               s.Hq, s.Hkv, s.D, 0);
    } else {
        attn_delta_launch(b.delta, nullptr, nullptr, b.dout, b.out, s.B, s.T, s.T, s.Hq, s.D, 0);
        im.dkdv(dk, dv, b.dout, b.lse, b.delta, q_of(b), k_of(b), v_of(b), b.stride, b.dstride, s.B, s.T, s.Hq,
                s.Hkv, s.D, 0);
        im.dq(dq, b.dout, b.lse, b.delta, q_of(b), k_of(b), v_of(b), b.stride, b.dstride, s.B, s.T, s.Hq, s.Hkv,
              s.D, 0);
    }
}

template <typename T>
static std::vector<T> download(const T* p, size_t n) {
    std::vector<T> h(n);
    CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

// ----------------------------------------------------------------------------------------------
// Check: every implementation against the CPU FP64 reference on small shapes.

typedef struct {
    AttnShape s;
    int pad, dpad;
} CheckCase;

static std::vector<CheckCase> check_cases() {
    std::vector<CheckCase> cs;
    const int heads[3][2] = {{6, 2}, {4, 1}, {4, 4}};
    const int Ts[4] = {1, 77, 256, 300};
    for (int D : {64, 128})
        for (int hi = 0; hi < 3; ++hi)
            for (int T : Ts) cs.push_back({{2, T, heads[hi][0], heads[hi][1], D}, hi == 0 ? 0 : 8, hi == 2 ? 16 : 0});
    for (int D : {64, 128})
        for (int T : {7, 100, 1000}) cs.push_back({{1, T, 4, 2, D}, 8, 8});
    return cs;
}

static double worst_err[32][2];  // per implementation slot and D (0: 64, 1: 128): worst rel-L2

// Returns the number of failed checks.
static int check_all(const std::vector<Impl>& impls) {
    printf("check vs CPU FP64 reference: rel-L2 error (max abs) of out, lse, dq, dk, dv; 'det' = backward bitwise "
           "repeatable\n");
    int failures = 0;
    uint64_t seed = 1234;
    for (const CheckCase& c : check_cases()) {
        const AttnShape s = c.s;
        const size_t bt = (size_t)s.B * s.T;
        Bufs b = bufs_alloc(s, c.pad, c.dpad);
        // fresh random inputs: qkv packed with its pad, dout dense; unit-variance uniform
        std::vector<bf16> hqkv(bt * b.stride), hdout(bt * s.Hq * s.D);
        fill_uniform_host(hqkv, seed++, 1.7320508f);
        fill_uniform_host(hdout, seed++, 1.7320508f);
        CUDA_CHECK(cudaMemcpy(b.qkv, hqkv.data(), hqkv.size() * sizeof(bf16), cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(b.dout, hdout.data(), hdout.size() * sizeof(bf16), cudaMemcpyHostToDevice));
        std::vector<float> q(bt * s.Hq * s.D), k(bt * s.Hkv * s.D), v(bt * s.Hkv * s.D), dout(hdout.size());
        for (size_t r = 0; r < bt; ++r) {
            for (int i = 0; i < s.Hq * s.D; ++i) q[r * s.Hq * s.D + i] = __bfloat162float(hqkv[r * b.stride + i]);
            for (int i = 0; i < s.Hkv * s.D; ++i) {
                k[r * s.Hkv * s.D + i] = __bfloat162float(hqkv[r * b.stride + s.Hq * s.D + i]);
                v[r * s.Hkv * s.D + i] = __bfloat162float(hqkv[r * b.stride + (s.Hq + s.Hkv) * s.D + i]);
            }
        }
        for (size_t i = 0; i < hdout.size(); ++i) dout[i] = __bfloat162float(hdout[i]);
        std::vector<double> rout, rlse, rdq, rdk, rdv;
        cpu_attention(s, q.data(), k.data(), v.data(), dout.data(), rout, rlse, rdq, rdk, rdv);

        for (size_t ii = 0; ii < impls.size(); ++ii) {
            const Impl& im = impls[ii];
            if (!(im.dims & (s.D == 64 ? 1 : 2))) continue;
            poison(b.out, bt * s.Hq * s.D * sizeof(bf16));
            poison(b.lse, (size_t)s.B * s.Hq * s.T * sizeof(float));
            poison(b.dqkv, bt * b.dstride * sizeof(bf16));
            poison(b.delta, b.scratch_bytes);
            run_fwd(im, b);
            run_bwd(im, b);
            CUDA_CHECK(cudaDeviceSynchronize());
            const std::vector<bf16> out = download(b.out, bt * s.Hq * s.D);
            const std::vector<float> lse = download(b.lse, (size_t)s.B * s.Hq * s.T);
            const std::vector<bf16> dqkv = download(b.dqkv, bt * b.dstride);
            poison(b.dqkv, bt * b.dstride * sizeof(bf16));
            run_bwd(im, b);
            const std::vector<bf16> dqkv2 = download(b.dqkv, bt * b.dstride);
            const bool det = memcmp(dqkv.data(), dqkv2.data(), dqkv.size() * sizeof(bf16)) == 0;

            const ErrStat e[5] = {
                compare_bf16(out, s.Hq * s.D, 0, rout, bt, s.Hq * s.D),
                compare_f32(lse, rlse),
                compare_bf16(dqkv, b.dstride, 0, rdq, bt, s.Hq * s.D),
                compare_bf16(dqkv, b.dstride, s.Hq * s.D, rdk, bt, s.Hkv * s.D),
                compare_bf16(dqkv, b.dstride, (s.Hq + s.Hkv) * s.D, rdv, bt, s.Hkv * s.D),
            };
            const double tol[5] = {1e-2, 1e-4, 3e-2, 3e-2, 2e-2};
            bool ok = det || im.nondet;
            double worst = 0;
            for (int i = 0; i < 5; ++i) {
                ok = ok && e[i].nonfinite == 0 && e[i].rel_l2 < tol[i];
                worst = std::max(worst, e[i].nonfinite ? INFINITY : e[i].rel_l2);
            }
            double& w = worst_err[ii][s.D == 128];
            w = std::max(w, worst);
            failures += !ok;
            printf("%s v%d %-18s B%d T%-4d Hq%d Hkv%d D%-3d |", ok ? "ok  " : "FAIL", im.version, im.name, s.B, s.T,
                   s.Hq, s.Hkv, s.D);
            for (int i = 0; i < 5; ++i) {
                if (e[i].nonfinite) printf(" %ld NaN/inf", e[i].nonfinite);
                else printf(" %.1e(%.0e)", e[i].rel_l2, e[i].max_abs);
            }
            printf(" | det %s\n", det ? "yes" : "NO");
        }
        bufs_free(&b);
    }
    return failures;
}

// ----------------------------------------------------------------------------------------------
// Timing at B*T = 16K tokens.

static void time_all(const std::vector<Impl>& impls, bool tune) {
    printf("\n%-3s %-18s %4s %5s %3s %3s %3s | %8s %8s | %8s %8s | %8s\n", "ver", "impl", "D", "T", "B", "Hq", "Hkv",
           "fwd ms", "TFLOP/s", "bwd ms", "TFLOP/s", "max err");
    for (int D : {128, 64})
        for (int T : {512, 1024, 2048, 4096}) {
            const AttnShape s = {16384 / T, T, 2048 / D, 8, D};
            Bufs b = bufs_alloc(s, 0, 0);
            const size_t bt = (size_t)s.B * s.T;
            fill_uniform_device(b.qkv, bt * b.stride, 77 + T + D, 1.7320508f);
            fill_uniform_device(b.dout, bt * s.Hq * s.D, 99 + T + D, 1.7320508f);
            const double fwd_flops = 4.0 * s.B * s.Hq * (double)T * T * D / 2;
            for (size_t ii = 0; ii < impls.size(); ++ii) {
                const Impl& im = impls[ii];
                if (!(im.dims & (D == 64 ? 1 : 2))) continue;
                const bool slow = im.version == 1;
                const int warmup = slow ? 1 : 5, reps = slow ? 3 : 30;
                const float fms = time_median_ms([&] { run_fwd(im, b); }, warmup, reps);
                run_fwd(im, b);
                const float bms = time_median_ms([&] { run_bwd(im, b); }, warmup, reps);
                printf("%-3d %-18s %4d %5d %3d %3d %3d | %8.3f %8.1f | %8.3f %8.1f | %8.1e\n", im.version, im.name, D,
                       T, s.B, s.Hq, s.Hkv, fms, fwd_flops / fms / 1e9, bms, 2.5 * fwd_flops / bms / 1e9,
                       worst_err[ii][D == 128]);
                fflush(stdout);
            }
            bufs_free(&b);
        }
    if (tune) printf("(tune: each configuration row changes one kernel; the other two are the defaults)\n");
}

int main(int argc, char** argv) {
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, %.0f MiB L2\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0);
    std::vector<Impl> impls;
    bool tune = false;
    if (argc > 1 && strncmp(argv[1], "tune", 4) == 0) {  // "tune": all; "tune2": version 2's only
        tune = true;
        const int only = atoi(argv[1] + 4);
        for (const Impl& im : TUNE)
            if (only == 0 || im.version == only) impls.push_back(im);
    } else {
        const char* want = argc > 1 ? argv[1] : "";  // digits: the versions to run ("34": 3 and 4)
        for (const Impl& im : VERSIONS)
            if (!*want || strchr(want, '0' + im.version)) impls.push_back(im);
        if (impls.empty()) {
            fprintf(stderr, "usage: %s [version | tune]; version %s is not built (versions: 1 naive, 2 fa2, 3 wgmma, 4 tma-ws)\n", argv[0],
                    argv[1]);
            return 1;
        }
    }
    const int failures = check_all(impls);
    printf("%s: %d failed checks\n", failures ? "CHECK FAILED" : "all checks passed", failures);
    if (!(argc > 2 && strcmp(argv[2], "check") == 0)) time_all(impls, tune);
    return failures ? 1 : 0;
}
