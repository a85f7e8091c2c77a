/*
 * attention_v4.cuh - version 4 of the attention ladder: the forward pass in FlashAttention-3's
 * shape on Hopper (sm_90a): TMA tile loads on an mbarrier pipeline, a producer warpgroup that only
 * issues TMA, two consumer warpgroups, and softmax of one tile overlapped with the next tile's
 * S = Q K^T on the tensor cores. The backward is still version 3's (kernels.cuh).
 *
 * Same API and layouts as versions 2 and 3 (attention_fa2.cuh's header): q, k and v are token-major
 * with a common row stride (they may point into one packed qkv buffer), KV head j serves query heads
 * j*G .. j*G+G-1 in place, out is [B, T, Hq, D], lse [B, Hq, T] the natural-log logsumexp of the
 * scaled scores. It builds on kernels.cuh (include it first): the attn_* helpers (exp2, bf16
 * packing, row stores, argument checks) and version 3's wgmma wrappers (wg_*) are used, not copied.
 * Public host API, at the bottom:
 *   attention_forward_v4(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, D, stream)
 *   attention_backward_v4(...)  = version 3's attention_backward (same arguments)
 *
 * The one convention to know: each of q, k, v is seen by the copy engine through a 3-D tensor map
 * {columns, T, B} over its own base pointer (row stride qkv_stride, batch stride T*qkv_stride), with
 * a box of {64 columns, rows, 1}: one box is one 64-column panel of a tile, written by TMA in the
 * 128-byte swizzle that wgmma's descriptors expect (16-byte chunk c of row r at c ^ (r & 7), the
 * layout version 3 built by hand). Rows at or past T of a batch fall outside the map, so TMA fills
 * them with zeros: the last tile needs no bounds checks, only the causal mask (a key past T is
 * past every real query) and a guard on the stores.
 */
#include <cuda.h>          // CUtensorMap and its enums (types only: no -lcuda)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled, fetched through the runtime

// ----------------------------------------------------------------------------------------------
// mbarrier and TMA wrappers (PTX ISA: "mbarrier", "cp.async.bulk.tensor").

static __device__ __forceinline__ void v4_bar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// The producer's arrival on a full barrier: one arrive, plus bytes the TMA copies will complete.
static __device__ __forceinline__ void v4_bar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void v4_bar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Spins until the barrier's phase with the given parity has completed.
static __device__ __forceinline__ void v4_bar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// One box {64 columns, rows, 1} at (column c0, row t0, batch b) of a 3-D tensor map into shared
// memory at dst; completes its bytes on bar.
static __device__ __forceinline__ void v4_tma_load(uint32_t dst, const CUtensorMap* map, int c0, int t0, int b,
                                                   uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(t0), "r"(b), "r"(bar)
        : "memory");
}
template <int N>
static __device__ __forceinline__ void v4_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
static __device__ __forceinline__ void v4_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Online softmax of one tile of scores (one warp's 16 rows, NT 8-column blocks), in place: s becomes
// P = 2^(s*scale_log2 - m_new), unnormalized; the running row sums are rescaled and extended, and
// alpha = 2^(m_old - m_new) is returned for O, which the caller rescales once the previous tile's
// P V has left the tensor cores (that is the split from kernels.cuh's attn_fwd_softmax).
template <int NT>
static __device__ __forceinline__ void v4_softmax(float (&s)[NT][4], float (&row_max)[2], float (&row_sum)[2],
                                                  float (&alpha)[2], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(row_max[r], mx * scale_log2);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with no visible key yet
        alpha[r] = attn_exp2(row_max[r] - m_use);
        row_max[r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = attn_exp2(fmaf(s[nt][2 * r + e], scale_log2, -m_use));
                s[nt][2 * r + e] = p;
                sum += p;
            }
        row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
}

// ----------------------------------------------------------------------------------------------
// Forward. One block of NC+1 warpgroups per (BM = 64*NC query rows, b, query head); NC = 2 at
// D = 128 (384 threads, 128 x 128 tiles), 3 at D = 64 (512 threads, 192 queries x 128 keys):
//   warpgroup 0, the producer: shrinks to 24 registers (32 at NC = 3); one thread issues every TMA
//     load: Q once,
//     then for each KV tile of BN keys (from the diagonal down, as version 3) K and V into a
//     2-stage ring, each stage guarded by a full barrier (TMA bytes) and an empty barrier (one
//     arrive per consumer warp once its wgmma reads are done).
//   warpgroups 1 .. NC, the consumers: grow to 240 registers (160 at NC = 3); consumer c owns
//     query rows m0 + 64c .. +63 (warp x of it rows 16x .. 16x+15, the accumulator rows). A tile
//     wholly above a consumer's diagonal is still computed, fully masked (-inf rows give P = 0),
//     so that every consumer walks the same pipeline.
// Per consumer and tile i (m_i, l_i running max and sum, base 2):
//   S_i = Q K_i^T        issued before the softmax of the previous tile is finished with O:
//   O  += P_{i-1} V_{i-1} issued right after it; while both run on the tensor cores the warps
//                        wait only for S_i, then mask it (diagonal tiles) and compute
//   P_i = 2^(S_i*scale - m_i), l_i, alpha_i = 2^(m_{i-1} - m_i); then wait for P_{i-1} V_{i-1},
//   O *= alpha_i, and pack P_i to bf16 for the next iteration's O += P_i V_i.
// End: O /= l, lse = (m + log2 l) ln 2.
// Shared memory: Q [BM][D], K [2][BN][D], V [2][BN][D] bf16 in 64-column panels, then 9 mbarriers
// (D = 128: 160 KiB; D = 64: 88 KiB). One block per SM either way (the register file is full).
template <int D, int BN, int NC>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
    v4_forward_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_v, bf16* __restrict__ out, float* __restrict__ lse,
                      int T, int Hq, int Hkv, float scale_log2) {
    constexpr int BM = 64 * NC, NT = BN / 8, DT = D / 8, PANELS = D / 64;
    // Register budget: the block starts with the launch-bounds cap (168 registers a thread for 384
    // threads, 128 for 512) and the whole 64K file; the producer hands back all but PROD_REGS, and
    // the consumers take what that frees: 128*24 + 256*240 = 128*32 + 384*160 = 65536 - 1024 or 65536.
    constexpr int PROD_REGS = NC == 2 ? 24 : 32, CONS_REGS = NC == 2 ? 240 : 160;
    static_assert((BN == 64 || BN == 128) && (D == 64 || D == 128) && (NC == 2 || NC == 3), "tile sizes");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(attn_smem);
    bf16* Ks = Qs + BM * D;      // [2][BN * D]
    bf16* Vs = Ks + 2 * BN * D;  // [2][BN * D]
    const uint32_t bars = attn_smem_u32(Vs + 2 * BN * D);
    // barrier addresses: q_full, k_full[2], v_full[2], k_empty[2], v_empty[2]
    const uint32_t q_full = bars, k_full = bars + 8, v_full = bars + 24, k_empty = bars + 40, v_empty = bars + 56;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int q_tile = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const int m0 = q_tile * BM;
    const int n_tiles = (min(T, m0 + BM) + BN - 1) / BN;

    if (threadIdx.x == 0) {
        v4_bar_init(q_full, 1);
        for (int s = 0; s < 2; ++s) {
            v4_bar_init(k_full + 8 * s, 1);
            v4_bar_init(v_full + 8 * s, 1);
            v4_bar_init(k_empty + 8 * s, 4 * NC);  // one arrive per consumer warp
            v4_bar_init(v_empty + 8 * s, 4 * NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer
        v4_setmaxnreg_dec<PROD_REGS>();
        if (threadIdx.x == 0) {
            v4_bar_expect_tx(q_full, BM * D * sizeof(bf16));
            for (int p = 0; p < PANELS; ++p)
                v4_tma_load(attn_smem_u32(Qs + p * BM * 64), &tm_q, h * D + p * 64, m0, b, q_full);  // BM rows
            for (int i = 0; i < n_tiles; ++i) {
                const int s = i & 1, n0 = (n_tiles - 1 - i) * BN;
                const uint32_t parity = ((i >> 1) - 1) & 1;  // the phase tile i-2 completed
                if (i >= 2) v4_bar_wait(k_empty + 8 * s, parity);
                v4_bar_expect_tx(k_full + 8 * s, BN * D * sizeof(bf16));
                for (int p = 0; p < PANELS; ++p)
                    v4_tma_load(attn_smem_u32(Ks + s * BN * D + p * BN * 64), &tm_k, hk * D + p * 64, n0, b,
                                k_full + 8 * s);
                if (i >= 2) v4_bar_wait(v_empty + 8 * s, parity);
                v4_bar_expect_tx(v_full + 8 * s, BN * D * sizeof(bf16));
                for (int p = 0; p < PANELS; ++p)
                    v4_tma_load(attn_smem_u32(Vs + s * BN * D + p * BN * 64), &tm_v, hk * D + p * 64, n0, b,
                                v_full + 8 * s);
            }
        }
        return;
    }

    // consumers
    v4_setmaxnreg_inc<CONS_REGS>();
    const int cw = wg - 1, wrow = cw * 64 + (warp & 3) * 16;  // this warp's rows inside the tile
    const uint32_t qs = attn_smem_u32(Qs) + cw * 64 * 128;
    float o[DT][4], s[NT][4], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f}, alpha[2];
    uint32_t pa[BN / 16][4];  // P of the previous tile in bf16: the A operand of O += P V
    attn_zero(o);

    // S = Q K_i^T into s (issued and committed, not waited for)
    auto issue_s = [&](int i) {
        const uint32_t ks = attn_smem_u32(Ks + (i & 1) * BN * D);
        wg_fence_regs(s);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const uint64_t da = wg_desc(qs + (kk / 4) * BM * 128 + (kk % 4) * 32);
            const uint64_t db = wg_desc(ks + (kk / 4) * BN * 128 + (kk % 4) * 32);
            if (kk == 0) wg_mma_ss<BN, 0>(s, da, db);
            else wg_mma_ss<BN, 1>(s, da, db);
        }
        wg_commit();
    };
    // O += P V_i (issued and committed, not waited for)
    auto issue_pv = [&](int i) {
        const uint32_t vs = attn_smem_u32(Vs + (i & 1) * BN * D);
        wg_fence_regs(o);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            wg_mma_rs_n64_tb<0, DT>(o, pa[kk], wg_desc(vs + kk * 16 * 128));
            if constexpr (D == 128) wg_mma_rs_n64_tb<8, DT>(o, pa[kk], wg_desc(vs + BN * 128 + kk * 16 * 128));
        }
        wg_commit();
    };
    // mask key > query where tile i crosses this warp's diagonal, then the softmax step
    auto softmax = [&](int i) {
        const int n0 = (n_tiles - 1 - i) * BN;
        if (n0 + BN - 1 > m0 + wrow) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = m0 + wrow + (lane >> 2) + 8 * (e >> 1);
                    const int col = n0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                    if (col > row) s[nt][e] = -INFINITY;
                }
        }
        v4_softmax<NT>(s, row_max, row_sum, alpha, scale_log2);
    };
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            pa[kk][0] = attn_pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            pa[kk][1] = attn_pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            pa[kk][2] = attn_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[kk][3] = attn_pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
    };

    v4_bar_wait(q_full, 0);
    v4_bar_wait(k_full, 0);
    issue_s(0);
    wg_wait<0>();
    wg_fence_regs(s);
    if (lane == 0) v4_bar_arrive(k_empty);
    softmax(0);  // O is zero: no rescale
    pack_p();
    for (int i = 1; i < n_tiles; ++i) {
        const int st = i & 1, prev = (i - 1) & 1;
        v4_bar_wait(k_full + 8 * st, (i >> 1) & 1);
        issue_s(i);
        v4_bar_wait(v_full + 8 * prev, ((i - 1) >> 1) & 1);
        issue_pv(i - 1);
        wg_wait<1>();  // S_i is done; P_{i-1} V_{i-1} may still run
        wg_fence_regs(s);
        if (lane == 0) v4_bar_arrive(k_empty + 8 * st);
        softmax(i);
        wg_wait<0>();  // O += P_{i-1} V_{i-1} done
        wg_fence_regs(o);
        if (lane == 0) v4_bar_arrive(v_empty + 8 * prev);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt][0] *= alpha[0];
            o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1];
            o[dt][3] *= alpha[1];
        }
        pack_p();
    }
    const int last = n_tiles - 1;
    v4_bar_wait(v_full + 8 * (last & 1), (last >> 1) & 1);
    issue_pv(last);
    wg_wait<0>();
    wg_fence_regs(o);

    // O /= l, and the logsumexp of the row in natural log
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[r] = 1.f / l;
        const int t = m0 + wrow + (lane >> 2) + 8 * r;
        if (t < T && (lane & 3) == 0) lse[((long)b * Hq + h) * T + t] = (row_max[r] + __log2f(l)) * 0.69314718056f;
    }
    attn_store_rows<D>(out + (long)b * T * Hq * D + h * D, (long)Hq * D, m0 + wrow, T, o, inv[0], inv[1], lane);
}

// ----------------------------------------------------------------------------------------------
// Host side: the tensor maps and the launch.

// cuTensorMapEncodeTiled from the driver, through the runtime (so the program needs no -lcuda).
static PFN_cuTensorMapEncodeTiled_v12000 v4_encode_fn() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (!fn) {
        cudaDriverEntryPointQueryResult qres;
        void* p = nullptr;
        CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &qres));
        if (qres != cudaDriverEntryPointSuccess || !p) {
            fprintf(stderr, "attention_forward_v4: the driver has no cuTensorMapEncodeTiled (query result %d); "
                            "TMA needs a CUDA 12+ driver\n", (int)qres);
            exit(1);
        }
        fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
    return fn;
}

// A 3-D map {cols, T, B} over base (row stride `stride` elements, batch stride T*stride), box
// {64, rows, 1}, 128-byte swizzle, out-of-bounds elements read as zero.
static CUtensorMap v4_tensor_map(const bf16* base, int cols, int stride, int T, int B, int rows) {
    CUtensorMap m;
    const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[2] = {(cuuint64_t)stride * sizeof(bf16), (cuuint64_t)T * stride * sizeof(bf16)};
    const cuuint32_t box[3] = {64, (cuuint32_t)rows, 1}, estr[3] = {1, 1, 1};
    const CUresult r = v4_encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16*>(base), dims, strides,
                                      box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "attention_forward_v4: cuTensorMapEncodeTiled failed (%d) for cols %d, stride %d, T %d, B %d, "
                        "box rows %d\n", (int)r, cols, stride, T, B, rows);
        exit(1);
    }
    return m;
}

template <int D, int BN, int NC>
static void v4_forward_launch(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int B,
                              int T, int Hq, int Hkv, cudaStream_t stream) {
    constexpr int BM = 64 * NC;
    auto kernel = v4_forward_kernel<D, BN, NC>;
    const int smem = (BM + 4 * BN) * D * (int)sizeof(bf16) + 9 * 8;
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const CUtensorMap tq = v4_tensor_map(q, Hq * D, stride, T, B, BM);
    const CUtensorMap tk = v4_tensor_map(k, Hkv * D, stride, T, B, BN);
    const CUtensorMap tv = v4_tensor_map(v, Hkv * D, stride, T, B, BN);
    kernel<<<dim3(ceil_div(T, BM), B * Hq), 128 * (NC + 1), smem, stream>>>(tq, tk, tv, out, lse, T, Hq, Hkv,
                                                                    1.44269504089f / sqrtf((float)D));
    CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// The entry points (same checks as version 3).

static void attention_forward_v4(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                                 int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {out, q, k, v};
    attn_check_args("attention_forward_v4", ptrs, 4, qkv_stride, B, T, Hq, Hkv, D);
    if (D == 64) v4_forward_launch<64, 128, 3>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
    else v4_forward_launch<128, 128, 2>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
}

// The backward is version 3's for now (kernels.cuh): the forward was this rung's target.
static void attention_backward_v4(bf16* dq, bf16* dk, bf16* dv, float* delta, const bf16* dout, const bf16* out,
                                  const float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                                  int dqkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    attention_backward(dq, dk, dv, delta, dout, out, lse, q, k, v, qkv_stride, dqkv_stride, B, T, Hq, Hkv, D, stream);
}
