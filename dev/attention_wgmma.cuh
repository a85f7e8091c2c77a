/*
 * attention_wgmma.cuh - version 3 of the attention ladder: FlashAttention-2's algorithm on Hopper's
 * warpgroup matrix instructions (wgmma, sm_90a), the first wgmma rung. It lost to version 4
 * (lib/attention.cuh) at every shape, forward and backward, and left the trainer.
 *
 * Same API and layouts as the other versions (lib/attention.cuh's header). Blocks of two
 * warpgroups (256 threads), each owning 64 rows of every accumulator; tiles double-buffered by
 * cp.async from all threads (no TMA, no warp specialization). The backward is three kernels: delta;
 * dK, dV over KV tiles (each block loops over the G query heads and every query tile at or below
 * the diagonal, accumulating in registers); dQ over query tiles, recomputing P and dP: 7 matrix
 * products in all instead of 5, the price of determinism without an ordered dQ sum. It builds on
 * lib/attention.cuh (the helpers) and lib/ptx.cuh (the wgmma wrappers), which it includes, and on
 * attention_fa2.cuh (cp.async, the softmax step), which must be included first.
 * Public host API, at the bottom:
 *   attention_forward_wgmma(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, D, stream)
 *   attention_backward_wgmma(dq, dk, dv, scratch, dout, out, lse, q, k, v, qkv_stride, dqkv_stride,
 *                            B, T, Hq, Hkv, D, stream)   scratch: B*Hq*T floats (delta)
 * H100, D = 128, T = 512 / 1024 / 2048 / 4096: forward 209 / 289 / 358 / 419 TFLOP/s, backward
 * 164 / 217 / 266 / 287 (doc/attention.md).
 */
#include "../lib/ptx.cuh"
#include "../lib/attention.cuh"

// ----------------------------------------------------------------------------------------------
// Tile loads into the panel layout: thread i copies chunk i % (D/8) of rows i / (D/8) + n*RSTEP.

template <int D, int ROWS, int THREADS>
static __device__ __forceinline__ void wg_load_tile(bf16* tile, const bf16* g, long stride, int row0, int T) {
    constexpr int CHUNKS = D / 8, RSTEP = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && RSTEP % 8 == 0 && ROWS % RSTEP == 0, "tile rows must split evenly");
    const int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    const uint32_t dst = attn_smem_u32(tile) + (c / 8) * ROWS * 128 + r * 128 + (((c % 8) ^ (r & 7)) << 4);
    const bf16* src = g + (long)(row0 + r) * stride + c * 8;
#pragma unroll
    for (int it = 0; it < ROWS / RSTEP; ++it) {
        const bool in = row0 + r + it * RSTEP < T;
        attn_cp_async16(dst + it * RSTEP * 128, in ? src : g, in);
        src += RSTEP * stride;
    }
}

// ----------------------------------------------------------------------------------------------
// Forward: one block of 2 warpgroups per (128 query rows, b, query head); warpgroup w owns rows
// 64w .. 64w+63, warp x of it rows 64w + 16x .. +15 (the accumulator rows). KV tiles of BN keys from
// the diagonal down, two buffers, one barrier per tile (loads of tile j-1 overlap tile j).
// Per tile and warpgroup: S = Q K^T (D/16 wgmma, operands in shared memory), mask, online softmax
// (version 2's code, per warp), O += P V (BN/16 k-steps x D/64 wgmma n64).
// Shared memory: Q [128][D], K [2][BN][D], V [2][BN][D] bf16, in 64-column panels.
template <int D, int BN>
__global__ void __launch_bounds__(256, 1)
    wg_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ q,
                      const bf16* __restrict__ k, const bf16* __restrict__ v, int stride, int T, int Hq, int Hkv,
                      float scale_log2) {
    constexpr int BM = 128, THREADS = 256, NT = BN / 8, DT = D / 8;
    static_assert((BN == 64 || BN == 128) && (D == 64 || D == 128), "tile sizes");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(attn_smem);
    bf16* Ks = Qs + BM * D;       // [2][BN * D]
    bf16* Vs = Ks + 2 * BN * D;   // [2][BN * D]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int q_tile = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const int m0 = q_tile * BM;
    const int wrow = warp * 16;  // this warp's accumulator rows inside the tile
    const bf16* qg = q + (long)b * T * stride + h * D;
    const bf16* kg = k + (long)b * T * stride + hk * D;
    const bf16* vg = v + (long)b * T * stride + hk * D;
    const int n_tiles = (min(T, m0 + BM) + BN - 1) / BN;

    float o[1][DT][4], row_max[1][2], row_sum[1][2];
    attn_zero(o[0]);
    row_max[0][0] = row_max[0][1] = -INFINITY;
    row_sum[0][0] = row_sum[0][1] = 0.f;

    wg_load_tile<D, BM, THREADS>(Qs, qg, stride, m0, T);
    wg_load_tile<D, BN, THREADS>(Ks, kg, stride, (n_tiles - 1) * BN, T);
    wg_load_tile<D, BN, THREADS>(Vs, vg, stride, (n_tiles - 1) * BN, T);
    attn_cp_async_commit();

    for (int j = n_tiles - 1; j >= 0; --j) {
        const int n0 = j * BN, buf = (n_tiles - 1 - j) & 1;
        attn_cp_async_wait<0>();  // tile j (and Q) landed ...
        wg_fence_proxy_async();  // ... is ordered before the tensor cores' reads ...
        __syncthreads();         // ... of every thread; every warp is done with tile j+1's buffer
        if (j > 0) {
            wg_load_tile<D, BN, THREADS>(Ks + (buf ^ 1) * BN * D, kg, stride, n0 - BN, T);
            wg_load_tile<D, BN, THREADS>(Vs + (buf ^ 1) * BN * D, vg, stride, n0 - BN, T);
            attn_cp_async_commit();
        }
        if (n0 > m0 + wg * 64 + 63) continue;  // no key of the tile is visible to this warpgroup

        const uint32_t qs = attn_smem_u32(Qs) + wg * 64 * 128;
        const uint32_t ks = attn_smem_u32(Ks + buf * BN * D), vs = attn_smem_u32(Vs + buf * BN * D);
        float s[1][NT][4];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const uint64_t da = wg_desc(qs + (kk / 4) * BM * 128 + (kk % 4) * 32);
            const uint64_t db = wg_desc(ks + (kk / 4) * BN * 128 + (kk % 4) * 32);
            if (kk == 0) wg_mma_ss<BN, 0>(s[0], da, db);
            else wg_mma_ss<BN, 1>(s[0], da, db);
        }
        wg_commit();
        wg_wait<0>();
        wg_fence_regs(s[0]);
        if (n0 + BN - 1 > m0 + wrow) {  // the tile crosses this warp's diagonal: mask key > query
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = m0 + wrow + (lane >> 2) + 8 * (i >> 1);
                    const int col = n0 + nt * 8 + 2 * (lane & 3) + (i & 1);
                    if (col > row) s[0][nt][i] = -INFINITY;
                }
        }
        attn_fwd_softmax<D, 1, NT>(o, s, row_max, row_sum, scale_log2);

        uint32_t pa[BN / 16][4];  // P in bf16, packed before the chain so no wgmma waits on a register write
        attn_pack_a(pa, s[0]);
        wg_rs_chain<D, BN>(o[0], pa, vs);
        wg_wait<0>();
        wg_fence_regs(o[0]);
    }

    // O /= l, and the logsumexp of the row in natural log
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = row_sum[0][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[r] = 1.f / l;
        const int t = m0 + wrow + (lane >> 2) + 8 * r;
        if (t < T && (lane & 3) == 0) lse[((long)b * Hq + h) * T + t] = (row_max[0][r] + __log2f(l)) * ATTN_LN2;
    }
    attn_store_rows<D>(out + (long)b * T * Hq * D + h * D, (long)Hq * D, m0 + wrow, T, o[0], inv[0], inv[1], lane);
}

template <int D, int BN>
static void wg_forward_launch(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int B,
                              int T, int Hq, int Hkv, cudaStream_t stream) {
    auto kernel = wg_forward_kernel<D, BN>;
    const int smem = (128 + 4 * BN) * D * (int)sizeof(bf16);
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    kernel<<<dim3(ceil_div(T, 128), B * Hq), 256, smem, stream>>>(out, lse, q, k, v, stride, T, Hq, Hkv,
                                                                    ATTN_LOG2E / sqrtf((float)D));
    CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// Backward on wgmma: two deterministic kernels (the math is in lib/attention.cuh's Backward comment
// above attn_delta_kernel) with every product a warpgroup chain.
//
// dK, dV: one block of 2 warpgroups per (128 keys, b, KV head); warpgroup w owns keys 64w .. 64w+63
// and their dK, dV (64 x D fp32 each) in registers. Per query tile of BM rows (Q, dO, lse, delta
// double-buffered by cp.async), per warpgroup: S^T = K_w Q^T and dP^T = V_w dO^T (two SS chains,
// one commit), then P^T and dS^T in registers, then dV += P^T dO and dK += dS^T Q (RS chains, dO
// and Q read MN-major). Shared memory: K, V [128][D]; Q, dO [2][BM][D]; lse*log2e, delta [2][BM].
template <int D, int BM, int MINB>
__global__ void __launch_bounds__(256, MINB)
    wg_backward_dkdv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta,
                            const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                            int stride, int dstride, int T, int Hq, int Hkv, float scale, float scale_log2) {
    constexpr int THREADS = 256, BN = 128, NT = BM / 8, DT = D / 8;
    static_assert(BM == 32 || BM == 64 || BM == 128, "query tile");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Ks = reinterpret_cast<bf16*>(attn_smem);
    bf16* Vs = Ks + BN * D;
    bf16* Qs = Vs + BN * D;       // [2][BM * D]
    bf16* dOs = Qs + 2 * BM * D;  // [2][BM * D]
    float* lse_s = reinterpret_cast<float*>(dOs + 2 * BM * D);  // [2][BM]
    float* dl_s = lse_s + 2 * BM;                              // [2][BM]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int G = Hq / Hkv;
    const int b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv;
    const int n0 = blockIdx.x * BN;  // KV tile 0, the one with the most work, launches first
    const int wrow = warp * 16;      // this warp's accumulator rows (keys) inside the tile
    const int qt_first = n0 / BM, per_head = (T + BM - 1) / BM - qt_first, iters = G * per_head;
    const long dstride_o = (long)Hq * D;

    wg_load_tile<D, BN, THREADS>(Ks, k + (long)b * T * stride + hk * D, stride, n0, T);
    wg_load_tile<D, BN, THREADS>(Vs, v + (long)b * T * stride + hk * D, stride, n0, T);
    auto load_query_tile = [&](int it, int buf) {
        const int hh = hk * G + it / per_head, m0 = (qt_first + it % per_head) * BM;
        wg_load_tile<D, BM, THREADS>(Qs + buf * BM * D, q + (long)b * T * stride + hh * D, stride, m0, T);
        wg_load_tile<D, BM, THREADS>(dOs + buf * BM * D, dout + (long)b * T * dstride_o + hh * D, dstride_o, m0, T);
        const float* lse_g = lse + ((long)b * Hq + hh) * T;
        const float* dl_g = delta + ((long)b * Hq + hh) * T;
        for (int i = threadIdx.x; i < BM; i += THREADS) {
            const int t = m0 + i;
            lse_s[buf * BM + i] = t < T ? lse_g[t] * ATTN_LOG2E : INFINITY;  // P = 0 past T
            dl_s[buf * BM + i] = t < T ? dl_g[t] : 0.f;
        }
    };
    load_query_tile(0, 0);
    attn_cp_async_commit();

    float dk_acc[DT][4], dv_acc[DT][4];
    attn_zero(dk_acc);
    attn_zero(dv_acc);
    const uint32_t ks = attn_smem_u32(Ks) + wg * 64 * 128, vs = attn_smem_u32(Vs) + wg * 64 * 128;

    for (int it = 0; it < iters; ++it) {
        const int buf = it & 1;
        if (it + 1 < iters) {
            load_query_tile(it + 1, buf ^ 1);
            attn_cp_async_commit();
            attn_cp_async_wait<1>();
        } else {
            attn_cp_async_wait<0>();
        }
        wg_fence_proxy_async();
        __syncthreads();
        const int m0 = (qt_first + it % per_head) * BM;
        if (m0 + BM - 1 >= n0 + wg * 64) {  // some query of the tile sees some key of this warpgroup
            const uint32_t qs = attn_smem_u32(Qs + buf * BM * D), dos = attn_smem_u32(dOs + buf * BM * D);
            const bool diag = m0 < n0 + wrow + 15;  // some query of the tile precedes some key of this warp

            float s[NT][4], dp[NT][4];  // S^T then P^T; dP^T then dS^T
            wg_ss_pair<D, BN, BM>(s, dp, ks, vs, qs, dos);

            attn_bwd_p_ds_t(s, dp, lse_s + buf * BM, dl_s + buf * BM, diag, m0, n0 + wrow, lane, scale_log2);
            uint32_t pa[BM / 16][4], dsa[BM / 16][4];  // P^T and dS^T in bf16, A-operand layout
            attn_pack_a(pa, s);
            attn_pack_a(dsa, dp);
            wg_rs_chain<D, BM>(dv_acc, pa, dos);  // dV += P^T dO
            wg_rs_chain<D, BM>(dk_acc, dsa, qs);  // dK += dS^T Q
            wg_wait<0>();
            wg_fence_regs(dv_acc);
            wg_fence_regs(dk_acc);
        }
        __syncthreads();  // every warp is done with buffer buf before it is refilled
    }
    attn_store_rows<D>(dk + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dk_acc, scale, scale, lane);
    attn_store_rows<D>(dv + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dv_acc, 1.f, 1.f, lane);
}

// dQ: one block of 2 warpgroups per (128 queries, b, query head); warpgroup w owns queries
// 64w .. 64w+63 and their dQ (64 x D fp32) in registers. Per KV tile of BN keys (K, V double-buffered
// by cp.async), per warpgroup: S = Q_w K^T and dP = dO_w V^T (two SS chains), P and dS in registers,
// dQ += dS K (RS chain, K read MN-major). Shared memory: Q, dO [128][D]; K, V [2][BN][D].
template <int D, int BN, int MINB>
__global__ void __launch_bounds__(256, MINB)
    wg_backward_dq_kernel(bf16* __restrict__ dq, const bf16* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ delta, const bf16* __restrict__ q, const bf16* __restrict__ k,
                          const bf16* __restrict__ v, int stride, int dstride, int T, int Hq, int Hkv, float scale,
                          float scale_log2) {
    constexpr int THREADS = 256, BM = 128, NT = BN / 8, DT = D / 8;
    static_assert(BN == 32 || BN == 64 || BN == 128, "key tile");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(attn_smem);
    bf16* dOs = Qs + BM * D;
    bf16* Ks = dOs + BM * D;     // [2][BN * D]
    bf16* Vs = Ks + 2 * BN * D;  // [2][BN * D]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int q_tile = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const int m0 = q_tile * BM, wrow = warp * 16;
    const bf16* kg = k + (long)b * T * stride + hk * D;
    const bf16* vg = v + (long)b * T * stride + hk * D;
    const int n_tiles = (min(T, m0 + BM) + BN - 1) / BN;

    wg_load_tile<D, BM, THREADS>(Qs, q + (long)b * T * stride + h * D, stride, m0, T);
    wg_load_tile<D, BM, THREADS>(dOs, dout + (long)b * T * Hq * D + h * D, (long)Hq * D, m0, T);
    wg_load_tile<D, BN, THREADS>(Ks, kg, stride, 0, T);
    wg_load_tile<D, BN, THREADS>(Vs, vg, stride, 0, T);
    attn_cp_async_commit();

    float lse2[2], dl[2];  // of rows g and g+8 of this warp
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int t = m0 + wrow + (lane >> 2) + 8 * r;
        lse2[r] = t < T ? lse[((long)b * Hq + h) * T + t] * ATTN_LOG2E : INFINITY;
        dl[r] = t < T ? delta[((long)b * Hq + h) * T + t] : 0.f;
    }
    float dq_acc[DT][4];
    attn_zero(dq_acc);
    const uint32_t qs = attn_smem_u32(Qs) + wg * 64 * 128, dos = attn_smem_u32(dOs) + wg * 64 * 128;

    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1, n0 = j * BN;
        if (j + 1 < n_tiles) {
            wg_load_tile<D, BN, THREADS>(Ks + (buf ^ 1) * BN * D, kg, stride, n0 + BN, T);
            wg_load_tile<D, BN, THREADS>(Vs + (buf ^ 1) * BN * D, vg, stride, n0 + BN, T);
            attn_cp_async_commit();
            attn_cp_async_wait<1>();
        } else {
            attn_cp_async_wait<0>();
        }
        wg_fence_proxy_async();
        __syncthreads();
        if (n0 <= m0 + wg * 64 + 63) {  // some key of the tile is visible to some query of this warpgroup
            const uint32_t ks = attn_smem_u32(Ks + buf * BN * D), vs = attn_smem_u32(Vs + buf * BN * D);
            const bool diag = n0 + BN - 1 > m0 + wrow;

            float s[NT][4], dp[NT][4];  // S then P; dP then dS
            wg_ss_pair<D, BM, BN>(s, dp, qs, dos, ks, vs);

#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float p = attn_exp2(fmaf(s[nt][i], scale_log2, -lse2[i >> 1]));
                    if (diag && n0 + nt * 8 + 2 * (lane & 3) + (i & 1) > m0 + wrow + (lane >> 2) + 8 * (i >> 1)) p = 0.f;
                    dp[nt][i] = p * (dp[nt][i] - dl[i >> 1]);
                }
            uint32_t dsa[BN / 16][4];  // dS in bf16, A-operand layout
            attn_pack_a(dsa, dp);
            wg_rs_chain<D, BN>(dq_acc, dsa, ks);
            wg_wait<0>();
            wg_fence_regs(dq_acc);
        }
        __syncthreads();  // every warp is done with buffer buf before it is refilled
    }
    attn_store_rows<D>(dq + (long)b * T * dstride + h * D, dstride, m0 + wrow, T, dq_acc, scale, scale, lane);
}

template <int D, int BM, int MINB = 1>
static void wg_backward_dkdv_launch(bf16* dk, bf16* dv, const bf16* dout, const float* lse, const float* delta,
                                    const bf16* q, const bf16* k, const bf16* v, int stride, int dstride, int B, int T,
                                    int Hq, int Hkv, cudaStream_t stream) {
    auto kernel = wg_backward_dkdv_kernel<D, BM, MINB>;
    const int smem = (2 * 128 + 4 * BM) * D * (int)sizeof(bf16) + 4 * BM * (int)sizeof(float);
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const float scale = 1.f / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, 128), B * Hkv), 256, smem, stream>>>(dk, dv, dout, lse, delta, q, k, v, stride, dstride,
                                                                     T, Hq, Hkv, scale, scale * ATTN_LOG2E);
    CUDA_CHECK(cudaGetLastError());
}

template <int D, int BN, int MINB = 1>
static void wg_backward_dq_launch(bf16* dq, const bf16* dout, const float* lse, const float* delta, const bf16* q,
                                  const bf16* k, const bf16* v, int stride, int dstride, int B, int T, int Hq, int Hkv,
                                  cudaStream_t stream) {
    auto kernel = wg_backward_dq_kernel<D, BN, MINB>;
    const int smem = (2 * 128 + 4 * BN) * D * (int)sizeof(bf16);
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const float scale = 1.f / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, 128), B * Hq), 256, smem, stream>>>(dq, dout, lse, delta, q, k, v, stride, dstride, T, Hq,
                                                                    Hkv, scale, scale * ATTN_LOG2E);
    CUDA_CHECK(cudaGetLastError());
}

// The entry points. Tiles, the best of those timed by `./dev/attention tune` on an H100 (doc/attention.md):
//   D = 128: forward 128 queries x 128 keys; dK/dV 128 keys x 64 queries; dQ 128 queries x 128 keys.
//   D = 64:  forward 128 x 64;               dK/dV 128 x 128;            dQ 128 x 64, 2 blocks/SM.
static void attention_forward_wgmma(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                                    int qkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {out, q, k, v};
    attn_check_args("attention_forward_wgmma", ptrs, 4, qkv_stride, B, T, Hq, Hkv, D);
    if (D == 64) wg_forward_launch<64, 64>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
    else wg_forward_launch<128, 128>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
}

static void attention_backward_wgmma(bf16* dq, bf16* dk, bf16* dv, float* delta, const bf16* dout, const bf16* out,
                                     const float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                                     int dqkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {dq, dk, dv, dout, out, q, k, v};
    attn_check_args("attention_backward_wgmma", ptrs, 8, qkv_stride, B, T, Hq, Hkv, D);
    attn_delta_launch(delta, nullptr, nullptr, dout, out, B, T, T, Hq, D, stream);
    if (D == 64) {
        wg_backward_dkdv_launch<64, 128, 1>(dk, dv, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq, Hkv,
                                           stream);
        wg_backward_dq_launch<64, 64, 2>(dq, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq, Hkv, stream);
    } else {
        wg_backward_dkdv_launch<128, 64, 1>(dk, dv, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq, Hkv,
                                            stream);
        wg_backward_dq_launch<128, 128, 1>(dq, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq, Hkv,
                                           stream);
    }
}
