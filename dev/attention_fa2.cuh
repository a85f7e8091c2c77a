/*
 * attention_fa2.cuh - FlashAttention-2 style causal GQA self-attention for Hopper/Ampere
 * (sm_80+, built for sm_90a): forward and deterministic backward, bf16 in and out, fp32 softmax
 * statistics, tensor cores through mma.sync.m16n8k16 (inline PTX), ldmatrix, cp.async tile loads.
 *
 * The one convention to know: q, k and v are token-major with a common row stride, so they may
 * point into one packed qkv buffer; element (b, t, h, d) of q is q[(b*T + t)*qkv_stride + h*D + d]
 * (h < Hq; k and v alike with h < Hkv). KV head j serves query heads j*G .. j*G+G-1, G = Hq/Hkv,
 * and is indexed in place, never copied per query head. The backward writes (=) dq, dk, dv with the
 * row stride dqkv_stride; dk and dv sum over the G query heads of their KV head, inside one thread
 * block in a fixed order, so the backward is bitwise deterministic (no floating-point atomics).
 *
 * This is version 2 of the ladder: it lost to versions 3 and 4 and stays here as the story of how
 * we got there. It builds on lib/attention.cuh, whose attention helpers (exp2, bf16 packing, the
 * softmax step, row stores, the delta kernel, argument checks: attn_*) every version shares, and
 * includes it. The cp.async wrappers and the softmax step with O rescaled at once, which
 * version 3 (attention_wgmma.cuh) also uses, are defined here. Public host API, at the bottom:
 *   attention_forward_fa2(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, D, stream)
 *   attention_backward_fa2(dq, dk, dv, delta, dout, out, lse, q, k, v, qkv_stride, dqkv_stride,
 *                          B, T, Hq, Hkv, D, stream)
 * D is 64 or 128 (a template parameter of every kernel); any T >= 1 (the last tile is masked).
 *
 * Shared-memory tiles hold rows of D bf16 (128 or 256 bytes); the 16-byte chunk c of row r sits at
 * chunk c ^ (r & 7), so the 8 rows that one ldmatrix phase reads hit 8 different bank groups.
 * Fragment layouts are those of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"):
 * lane = 4*g + i; an fp32 accumulator tile holds rows g and g+8, columns 2i and 2i+1.
 *
 * Measured (H100 SXM, B*T = 16K tokens, causal FLOPs counted once; doc/attention.md): D=128,
 * T = 512/1024/2048/4096: forward 198/251/290/323 TFLOP/s, backward 141/172/197/205; D=64 (Hq 32):
 * forward 193/237/282/312, backward 120/156/181/199. Errors vs FP64: rel-L2 <= 3.5e-3.
 * Version 3 (attention_wgmma.cuh) has the same API on Hopper's wgmma: at D=128, 6-30% faster
 * forward and 16-40% faster backward (more at long T); version 4 (lib/attention.cuh) is the
 * trainer's.
 */
#include "../lib/attention.cuh"


static __device__ __forceinline__ void fa2_ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
static __device__ __forceinline__ void fa2_ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// c (16x8 fp32) += a (16x16 bf16, row-major) * b (16x8 bf16, column-major).
static __device__ __forceinline__ void fa2_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ----------------------------------------------------------------------------------------------
// cp.async (sm_80+) and the softmax step with O rescaled at once (versions 2 and 3).

// 16-byte async copy global -> shared; when pred is false nothing is read and 16 zero bytes land.
static __device__ __forceinline__ void attn_cp_async16(uint32_t dst, const void* src, bool pred) {
    int src_bytes = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
static __device__ __forceinline__ void attn_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void attn_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The softmax step of MT row tiles with O rescaled at once; the caller then adds P V to O.
template <int D, int MT, int NT>
static __device__ __forceinline__ void attn_fwd_softmax(float (&o)[MT][D / 8][4], float (&s)[MT][NT][4],
                                                       float (&row_max)[MT][2], float (&row_sum)[MT][2],
                                                       float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float alpha[2];
        attn_softmax_tile<NT>(s[mt], row_max[mt], row_sum[mt], alpha, scale_log2);
        attn_rescale<D / 8>(o[mt], alpha);
    }
}

// ----------------------------------------------------------------------------------------------
// Tiles in shared memory: rows of D bf16, 16-byte chunks XOR-swizzled by the row's low 3 bits.

template <int D>
static __device__ __forceinline__ int fa2_swz(int row, int col) {  // col: a multiple of 8
    return row * D + ((((col >> 3) ^ (row & 7))) << 3);
}

// Copies rows row0 .. row0+ROWS-1 of a token-major tensor (row t at g + t*stride) into a tile;
// rows at or past T are zero-filled, so masked columns never multiply garbage (0 * NaN). Thread
// i copies chunk i % (D/8) of rows i / (D/8) + n * THREADS/(D/8): one running source pointer and
// a fixed swizzle (the row step is a multiple of 8), so no per-row address stays in a register.
template <int D, int ROWS, int THREADS>
static __device__ __forceinline__ void fa2_load_tile(bf16* tile, const bf16* g, long stride, int row0,
                                                     int T) {
    constexpr int CHUNKS = D / 8, RSTEP = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && RSTEP % 8 == 0 && ROWS % RSTEP == 0, "tile rows must split evenly");
    const int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    const uint32_t dst = attn_smem_u32(tile) + 2 * fa2_swz<D>(r, c * 8);
    const bf16* src = g + (long)(row0 + r) * stride + c * 8;
#pragma unroll
    for (int it = 0; it < ROWS / RSTEP; ++it) {
        const bool in = row0 + r + it * RSTEP < T;
        attn_cp_async16(dst + it * RSTEP * D * 2, in ? src : g, in);
        src += RSTEP * stride;
    }
}

// ----------------------------------------------------------------------------------------------
// Warp-level matrix products on the tiles. Each warp owns MT m16 row tiles (16*MT rows).

// Each lane's byte offset inside a tile for the three ldmatrix patterns, at k = 0 and row 0. The
// XOR swizzle makes the k-step a XOR: with tiles 256-byte aligned, the chunk field (bits 4-7) of
// offset ^ (2*kk << 4) is ((2*kk + half) ^ (row & 7)), so each load costs one LOP3 and an
// immediate row offset, and no per-(k, n) address lives in a register.
template <int D>
static __device__ __forceinline__ uint32_t fa2_lane_a(int lane) {  // A 16x16: rows lane&15, half lane>>4
    return (lane & 15) * 2 * D + (((lane >> 4) ^ (lane & 7)) << 4);
}
template <int D>
static __device__ __forceinline__ uint32_t fa2_lane_b(int lane) {  // B from [n][k]: n half lane>>4, k half bit 3
    return (((lane >> 4) & 1) * 8 + (lane & 7)) * 2 * D + ((((lane >> 3) & 1) ^ (lane & 7)) << 4);
}
template <int D>
static __device__ __forceinline__ uint32_t fa2_lane_bt(int lane) {  // B from [k][n]: k half bit 3, n half lane>>4
    return (((lane >> 3) & 1) * 8 + (lane & 7)) * 2 * D + ((((lane >> 4) & 1) ^ (lane & 7)) << 4);
}

// acc[MT][NT] += A[a_row0 .. a_row0+16*MT, 0..D) * B[0 .. 8*NT, 0..D)^T, both tiles row-major in
// shared memory (A's rows are the output rows, B's rows the output columns): S = Q K^T and kin.
// a_base, b_base: shared addresses of the tiles (256-byte aligned); a_row0: a multiple of 16.
template <int D, int MT, int NT>
static __device__ __forceinline__ void fa2_mma_abt(float (&acc)[MT][NT][4], uint32_t a_base,
                                                   int a_row0, uint32_t b_base, int lane) {
    static_assert(NT % 2 == 0, "B fragments are loaded two n-tiles at a time");
    const uint32_t a_lane = a_base + a_row0 * 2 * D + fa2_lane_a<D>(lane);
    const uint32_t b_lane = b_base + fa2_lane_b<D>(lane);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) fa2_ldmatrix_x4(a[mt], (a_lane ^ (kk << 5)) + mt * 16 * 2 * D);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];  // n-tile 2np: b[0], b[1]; n-tile 2np+1: b[2], b[3]
            fa2_ldmatrix_x4(b, (b_lane ^ (kk << 5)) + np * 16 * 2 * D);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                fa2_mma(acc[mt][2 * np], a[mt], b[0], b[1]);
                fa2_mma(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// acc[MT][D/8] += P * B[0 .. 8*KT, 0..D): P (16*MT x 8*KT) is an fp32 accumulator in registers,
// rounded to bf16 and reused in place as the A operand (its C and A fragment layouts match); B is
// a row-major tile whose rows are the reduction index: O = P V, dV = P^T dO, dK = dS^T Q, dQ = dS K.
template <int D, int MT, int KT>
static __device__ __forceinline__ void fa2_mma_pv(float (&acc)[MT][D / 8][4],
                                                  const float (&p)[MT][KT][4], uint32_t b_base,
                                                  int lane) {
    const uint32_t b_lane = b_base + fa2_lane_bt<D>(lane);
#pragma unroll
    for (int kk = 0; kk < KT / 2; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = attn_pack_bf16(p[mt][2 * kk][0], p[mt][2 * kk][1]);
            a[mt][1] = attn_pack_bf16(p[mt][2 * kk][2], p[mt][2 * kk][3]);
            a[mt][2] = attn_pack_bf16(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
            a[mt][3] = attn_pack_bf16(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t b[4];
            fa2_ldmatrix_x4_trans(b, (b_lane ^ (dp << 5)) + kk * 16 * 2 * D);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                fa2_mma(acc[mt][2 * dp], a[mt], b[0], b[1]);
                fa2_mma(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
            }
        }
    }
}



// ----------------------------------------------------------------------------------------------
// Forward: one thread block per (BM query rows, b, query head); WARPS warps, each owning
// MT = BM/(16*WARPS) m16 tiles. The block walks the KV tiles of BN keys from the diagonal down to
// key 0 (so masking happens first); tiles wholly above the diagonal are never visited. Online
// softmax in base 2 on scores scaled by scale*log2(e); lse = ln2 * (m + log2 l).
// KV_BUFS = 2 (the default): two K and V buffers, one barrier per tile; K_{j-1} and V_{j-1} load
// while tile j computes. KV_BUFS = 1 (run 1): one K and one V buffer, two barriers per tile; V_j
// loads while S = Q K_j^T runs, K_{j-1} while the softmax and O += P V_j run.
// Shared memory: Q [BM][D], K [KV_BUFS][BN][D], V [KV_BUFS][BN][D] bf16.

// S = Q K^T for a warp's rows, with key > query masked to -inf where the tile crosses the diagonal.
template <int D, int MT, int NT>
static __device__ __forceinline__ void fa2_fwd_scores(float (&s)[MT][NT][4], uint32_t qs, uint32_t ks, int m0,
                                                      int wrow, int n0, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) attn_zero(s[mt]);
    fa2_mma_abt<D, MT, NT>(s, qs, wrow, ks, lane);
    if (n0 + NT * 8 - 1 > m0 + wrow) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = m0 + wrow + mt * 16 + (lane >> 2) + 8 * (i >> 1);
                    const int col = n0 + nt * 8 + 2 * (lane & 3) + (i & 1);
                    if (col > row) s[mt][nt][i] = -INFINITY;
                }
    }
}


template <int D, int BM, int BN, int WARPS, int MINB, int KV_BUFS = 2>
__global__ void __launch_bounds__(WARPS * 32, MINB)
    fa2_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ q,
                       const bf16* __restrict__ k, const bf16* __restrict__ v, int stride, int T,
                       int Hq, int Hkv, float scale_log2) {
    constexpr int THREADS = WARPS * 32, MT = BM / (16 * WARPS), NT = BN / 8, DT = D / 8;
    static_assert(BM % (16 * WARPS) == 0 && BN % 16 == 0, "bad tile sizes");
    static_assert(KV_BUFS == 1 || KV_BUFS == 2, "one or two K/V buffers");
    extern __shared__ __align__(1024) unsigned char fa2_smem[];  // 256-byte alignment: see fa2_lane_a
    bf16* Qs = reinterpret_cast<bf16*>(fa2_smem);
    bf16* Ks = Qs + BM * D;            // [KV_BUFS][BN * D]
    bf16* Vs = Ks + KV_BUFS * BN * D;  // [KV_BUFS][BN * D]
    const uint32_t qs = attn_smem_u32(Qs);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q_tile = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const int m0 = q_tile * BM;
    const int wrow = warp * MT * 16;  // first row of this warp inside the tile
    const bf16* qg = q + (long)b * T * stride + h * D;
    const bf16* kg = k + (long)b * T * stride + hk * D;
    const bf16* vg = v + (long)b * T * stride + hk * D;
    const int n_tiles = (min(T, m0 + BM) + BN - 1) / BN;

    float o[MT][DT][4];
    float row_max[MT][2], row_sum[MT][2];  // row_max in units of scale*log2(e); row_sum per thread
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        attn_zero(o[mt]);
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    fa2_load_tile<D, BM, THREADS>(Qs, qg, stride, m0, T);
    fa2_load_tile<D, BN, THREADS>(Ks, kg, stride, (n_tiles - 1) * BN, T);
    if constexpr (KV_BUFS == 2) fa2_load_tile<D, BN, THREADS>(Vs, vg, stride, (n_tiles - 1) * BN, T);
    attn_cp_async_commit();

    for (int j = n_tiles - 1; j >= 0; --j) {
        const int n0 = j * BN;
        const bool active = n0 <= m0 + wrow + MT * 16 - 1;  // some key of the tile is visible to the warp
        float s[MT][NT][4];
        if constexpr (KV_BUFS == 2) {
            const int buf = (n_tiles - 1 - j) & 1;
            attn_cp_async_wait<0>();  // tile j (and Q)
            __syncthreads();         // ... visible to all; every warp is done with tile j+1's buffer
            if (j > 0) {
                fa2_load_tile<D, BN, THREADS>(Ks + (buf ^ 1) * BN * D, kg, stride, n0 - BN, T);
                fa2_load_tile<D, BN, THREADS>(Vs + (buf ^ 1) * BN * D, vg, stride, n0 - BN, T);
                attn_cp_async_commit();
            }
            if (active) {
                fa2_fwd_scores<D, MT, NT>(s, qs, attn_smem_u32(Ks + buf * BN * D), m0, wrow, n0, lane);
                attn_fwd_softmax<D, MT, NT>(o, s, row_max, row_sum, scale_log2);
                fa2_mma_pv<D, MT, NT>(o, s, attn_smem_u32(Vs + buf * BN * D), lane);
            }
        } else {
            attn_cp_async_wait<0>();  // K_j (and Q)
            __syncthreads();         // ... visible to all; every warp is done with V_{j+1}
            fa2_load_tile<D, BN, THREADS>(Vs, vg, stride, n0, T);
            attn_cp_async_commit();
            if (active) fa2_fwd_scores<D, MT, NT>(s, qs, attn_smem_u32(Ks), m0, wrow, n0, lane);
            attn_cp_async_wait<0>();  // V_j
            __syncthreads();         // ... visible to all; every warp is done with K_j
            if (j > 0) {
                fa2_load_tile<D, BN, THREADS>(Ks, kg, stride, n0 - BN, T);
                attn_cp_async_commit();
            }
            if (active) {
                attn_fwd_softmax<D, MT, NT>(o, s, row_max, row_sum, scale_log2);
                fa2_mma_pv<D, MT, NT>(o, s, attn_smem_u32(Vs), lane);
            }
        }
    }

    // O /= l, and the logsumexp of the row in natural log
    bf16* og = out + (long)b * T * Hq * D + h * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = row_sum[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            inv[r] = 1.f / l;
            const int t = m0 + wrow + mt * 16 + (lane >> 2) + 8 * r;
            if (t < T && (lane & 3) == 0)
                lse[((long)b * Hq + h) * T + t] = (row_max[mt][r] + __log2f(l)) * ATTN_LN2;
        }
        attn_store_rows<D>(og, (long)Hq * D, m0 + wrow + mt * 16, T, o[mt], inv[0], inv[1], lane);
    }
}


// dK, dV: one thread block per (BN = 16*WARPS keys, b, KV head); warp w owns keys w*16 .. w*16+15
// and keeps their dK and dV (16 x D fp32 each) in registers. The block loops over the G query heads
// and, for each, the query tiles of BM rows from the diagonal to T; Q, dO, lse and delta of the next
// tile load (cp.async, two buffers) while the current one computes, per warp, all transposed:
//   S^T = K Q^T,  P^T = 2^(S^T*scale*log2e - lse*log2e),  dV += P^T dO,  dP^T = V dO^T,
//   dS^T = P^T o (dP^T - delta),  dK += dS^T Q;  at the end dK *= scale.
// Shared memory: K, V [BN][D]; Q, dO [2][BM][D] bf16; lse*log2e, delta [2][BM] fp32.
template <int D, int BM, int WARPS, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB)
    fa2_backward_dkdv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* __restrict__ dout,
                             const float* __restrict__ lse, const float* __restrict__ delta,
                             const bf16* __restrict__ q, const bf16* __restrict__ k,
                             const bf16* __restrict__ v, int stride, int dstride, int T, int Hq,
                             int Hkv, float scale, float scale_log2) {
    constexpr int THREADS = WARPS * 32, BN = 16 * WARPS, NT = BM / 8, DT = D / 8;
    static_assert(BM % 16 == 0, "bad tile sizes");
    extern __shared__ __align__(1024) unsigned char fa2_smem[];  // 256-byte alignment: see fa2_lane_a
    bf16* Ks = reinterpret_cast<bf16*>(fa2_smem);
    bf16* Vs = Ks + BN * D;
    bf16* Qs = Vs + BN * D;       // [2][BM * D]
    bf16* dOs = Qs + 2 * BM * D;  // [2][BM * D]
    float* lse_s = reinterpret_cast<float*>(dOs + 2 * BM * D);  // [2][BM]
    float* dl_s = lse_s + 2 * BM;                              // [2][BM]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int G = Hq / Hkv;
    const int b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv;
    const int n0 = blockIdx.x * BN;  // KV tile 0, the one with the most work, launches first
    const int wrow = warp * 16;
    const int qt_first = n0 / BM, per_head = (T + BM - 1) / BM - qt_first, iters = G * per_head;
    const long dstride_o = (long)Hq * D;  // row stride of dout

    fa2_load_tile<D, BN, THREADS>(Ks, k + (long)b * T * stride + hk * D, stride, n0, T);
    fa2_load_tile<D, BN, THREADS>(Vs, v + (long)b * T * stride + hk * D, stride, n0, T);
    // loads query tile `it` of the flattened (head, tile) loop into buffer buf
    auto load_query_tile = [&](int it, int buf) {
        const int hh = hk * G + it / per_head, m0 = (qt_first + it % per_head) * BM;
        fa2_load_tile<D, BM, THREADS>(Qs + buf * BM * D, q + (long)b * T * stride + hh * D, stride, m0, T);
        fa2_load_tile<D, BM, THREADS>(dOs + buf * BM * D, dout + (long)b * T * dstride_o + hh * D,
                                      dstride_o, m0, T);
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

    float dk_acc[1][DT][4], dv_acc[1][DT][4];
    attn_zero(dk_acc[0]);
    attn_zero(dv_acc[0]);

    for (int it = 0; it < iters; ++it) {
        const int buf = it & 1;
        if (it + 1 < iters) {
            load_query_tile(it + 1, buf ^ 1);
            attn_cp_async_commit();
            attn_cp_async_wait<1>();
        } else {
            attn_cp_async_wait<0>();
        }
        __syncthreads();
        const int m0 = (qt_first + it % per_head) * BM;
        if (m0 + BM - 1 >= n0 + wrow) {  // some query of the tile sees some key of this warp
            const uint32_t qs = attn_smem_u32(Qs + buf * BM * D), dos = attn_smem_u32(dOs + buf * BM * D);
            const float* lse2 = lse_s + buf * BM;
            const float* dl = dl_s + buf * BM;
            const bool diag = m0 < n0 + wrow + 15;  // some query of the tile precedes some key

            float s[1][NT][4];  // S^T, then P^T
            attn_zero(s[0]);
            fa2_mma_abt<D, 1, NT>(s, attn_smem_u32(Ks), wrow, qs, lane);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int c = nt * 8 + 2 * (lane & 3);
                const float2 l2 = *reinterpret_cast<const float2*>(lse2 + c);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float p = attn_exp2(fmaf(s[0][nt][i], scale_log2, -((i & 1) ? l2.y : l2.x)));
                    if (diag && m0 + c + (i & 1) < n0 + wrow + (lane >> 2) + 8 * (i >> 1)) p = 0.f;
                    s[0][nt][i] = p;
                }
            }
            fa2_mma_pv<D, 1, NT>(dv_acc, s, dos, lane);

            float dp[1][NT][4];  // dP^T, then dS^T
            attn_zero(dp[0]);
            fa2_mma_abt<D, 1, NT>(dp, attn_smem_u32(Vs), wrow, dos, lane);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float2 d2 = *reinterpret_cast<const float2*>(dl + nt * 8 + 2 * (lane & 3));
#pragma unroll
                for (int i = 0; i < 4; ++i) dp[0][nt][i] = s[0][nt][i] * (dp[0][nt][i] - ((i & 1) ? d2.y : d2.x));
            }
            fa2_mma_pv<D, 1, NT>(dk_acc, dp, qs, lane);
        }
        __syncthreads();  // every warp is done with buffer buf before it is refilled
    }

    attn_store_rows<D>(dk + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dk_acc[0], scale, scale, lane);
    attn_store_rows<D>(dv + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dv_acc[0], 1.f, 1.f, lane);
}

// dQ: one thread block per (BM = 16*WARPS queries, b, query head); warp w owns queries w*16 ..
// w*16+15 and their dQ (16 x D fp32) in registers, with their lse and delta. The block walks the
// KV tiles of BN keys from key 0 to the diagonal; K and V of the next tile load (cp.async, two
// buffers) while the current one computes, per warp:
//   S = Q K^T,  P = 2^(S*scale*log2e - lse*log2e),  dP = dO V^T,  dS = P o (dP - delta),
//   dQ += dS K;  at the end dQ *= scale.
// Shared memory: Q, dO [BM][D]; K, V [2][BN][D] bf16.
template <int D, int BN, int WARPS, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB)
    fa2_backward_dq_kernel(bf16* __restrict__ dq, const bf16* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ delta,
                           const bf16* __restrict__ q, const bf16* __restrict__ k,
                           const bf16* __restrict__ v, int stride, int dstride, int T, int Hq,
                           int Hkv, float scale, float scale_log2) {
    constexpr int THREADS = WARPS * 32, BM = 16 * WARPS, NT = BN / 8, DT = D / 8;
    static_assert(BN % 16 == 0, "bad tile sizes");
    extern __shared__ __align__(1024) unsigned char fa2_smem[];  // 256-byte alignment: see fa2_lane_a
    bf16* Qs = reinterpret_cast<bf16*>(fa2_smem);
    bf16* dOs = Qs + BM * D;
    bf16* Ks = dOs + BM * D;      // [2][BN * D]
    bf16* Vs = Ks + 2 * BN * D;   // [2][BN * D]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q_tile = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const int m0 = q_tile * BM, wrow = warp * 16;
    const bf16* kg = k + (long)b * T * stride + hk * D;
    const bf16* vg = v + (long)b * T * stride + hk * D;
    const int n_tiles = (min(T, m0 + BM) + BN - 1) / BN;

    fa2_load_tile<D, BM, THREADS>(Qs, q + (long)b * T * stride + h * D, stride, m0, T);
    fa2_load_tile<D, BM, THREADS>(dOs, dout + (long)b * T * Hq * D + h * D, (long)Hq * D, m0, T);
    fa2_load_tile<D, BN, THREADS>(Ks, kg, stride, 0, T);
    fa2_load_tile<D, BN, THREADS>(Vs, vg, stride, 0, T);
    attn_cp_async_commit();

    float lse2[2], dl[2];  // of rows g and g+8 of this warp
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int t = m0 + wrow + (lane >> 2) + 8 * r;
        lse2[r] = t < T ? lse[((long)b * Hq + h) * T + t] * ATTN_LOG2E : INFINITY;
        dl[r] = t < T ? delta[((long)b * Hq + h) * T + t] : 0.f;
    }
    float dq_acc[1][DT][4];
    attn_zero(dq_acc[0]);

    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1, n0 = j * BN;
        if (j + 1 < n_tiles) {
            fa2_load_tile<D, BN, THREADS>(Ks + (buf ^ 1) * BN * D, kg, stride, n0 + BN, T);
            fa2_load_tile<D, BN, THREADS>(Vs + (buf ^ 1) * BN * D, vg, stride, n0 + BN, T);
            attn_cp_async_commit();
            attn_cp_async_wait<1>();
        } else {
            attn_cp_async_wait<0>();
        }
        __syncthreads();
        if (n0 <= m0 + wrow + 15) {  // some key of the tile is visible to some query of this warp
            const uint32_t ks = attn_smem_u32(Ks + buf * BN * D), vs = attn_smem_u32(Vs + buf * BN * D);
            const bool diag = n0 + BN - 1 > m0 + wrow;

            float s[1][NT][4];  // S, then P
            attn_zero(s[0]);
            fa2_mma_abt<D, 1, NT>(s, attn_smem_u32(Qs), wrow, ks, lane);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float p = attn_exp2(fmaf(s[0][nt][i], scale_log2, -lse2[i >> 1]));
                    if (diag && n0 + nt * 8 + 2 * (lane & 3) + (i & 1) > m0 + wrow + (lane >> 2) + 8 * (i >> 1))
                        p = 0.f;
                    s[0][nt][i] = p;
                }
            float dp[1][NT][4];  // dP, then dS
            attn_zero(dp[0]);
            fa2_mma_abt<D, 1, NT>(dp, attn_smem_u32(dOs), wrow, vs, lane);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) dp[0][nt][i] = s[0][nt][i] * (dp[0][nt][i] - dl[i >> 1]);
            fa2_mma_pv<D, 1, NT>(dq_acc, dp, ks, lane);
        }
        __syncthreads();  // every warp is done with buffer buf before it is refilled
    }
    attn_store_rows<D>(dq + (long)b * T * dstride + h * D, dstride, m0 + wrow, T, dq_acc[0], scale, scale, lane);
}


template <int D, int BM, int BN, int WARPS, int MINB, int KV_BUFS = 2>
static void fa2_forward_launch(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                               int stride, int B, int T, int Hq, int Hkv, cudaStream_t stream) {
    auto kernel = fa2_forward_kernel<D, BM, BN, WARPS, MINB, KV_BUFS>;
    const int smem = (BM + 2 * KV_BUFS * BN) * D * (int)sizeof(bf16);
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const float scale_log2 = ATTN_LOG2E / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, BM), B * Hq), WARPS * 32, smem, stream>>>(out, lse, q, k, v, stride, T, Hq, Hkv,
                                                                       scale_log2);
    CUDA_CHECK(cudaGetLastError());
}


template <int D, int BM, int WARPS, int MINB>
static void fa2_backward_dkdv_launch(bf16* dk, bf16* dv, const bf16* dout, const float* lse,
                                     const float* delta, const bf16* q, const bf16* k, const bf16* v,
                                     int stride, int dstride, int B, int T, int Hq, int Hkv,
                                     cudaStream_t stream) {
    constexpr int BN = 16 * WARPS;
    auto kernel = fa2_backward_dkdv_kernel<D, BM, WARPS, MINB>;
    const int smem = (2 * BN + 4 * BM) * D * (int)sizeof(bf16) + 4 * BM * (int)sizeof(float);
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const float scale = 1.f / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, BN), B * Hkv), WARPS * 32, smem, stream>>>(
        dk, dv, dout, lse, delta, q, k, v, stride, dstride, T, Hq, Hkv, scale, scale * ATTN_LOG2E);
    CUDA_CHECK(cudaGetLastError());
}

template <int D, int BN, int WARPS, int MINB>
static void fa2_backward_dq_launch(bf16* dq, const bf16* dout, const float* lse, const float* delta,
                                   const bf16* q, const bf16* k, const bf16* v, int stride, int dstride,
                                   int B, int T, int Hq, int Hkv, cudaStream_t stream) {
    constexpr int BM = 16 * WARPS;
    auto kernel = fa2_backward_dq_kernel<D, BN, WARPS, MINB>;
    const int smem = (2 * BM + 4 * BN) * D * (int)sizeof(bf16);
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const float scale = 1.f / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, BM), B * Hq), WARPS * 32, smem, stream>>>(
        dq, dout, lse, delta, q, k, v, stride, dstride, T, Hq, Hkv, scale, scale * ATTN_LOG2E);
    CUDA_CHECK(cudaGetLastError());
}


// ----------------------------------------------------------------------------------------------
// Public API (see the file's header for layouts). Tile choices per head_dim, the best of those
// timed by `./dev/attention tune` on an H100 (doc/attention.md), all 4 warps:
//   D = 128: forward 128 queries x 64 keys; dK/dV 64 keys x 64 queries; dQ 64 queries x 64 keys.
//   D = 64:  forward 128 x 128;             dK/dV 64 x 128;            dQ 64 x 128.

// Causal GQA self-attention, bf16 in/out, fp32 softmax statistics. Scale 1/sqrt(D).
// out: [B, T, Hq, D] contiguous. lse: [B, Hq, T] fp32, natural-log logsumexp of the scaled scores.
static void attention_forward_fa2(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                              int qkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {out, q, k, v};
    attn_check_args("attention_forward_fa2", ptrs, 4, qkv_stride, B, T, Hq, Hkv, D);
    if (D == 64) fa2_forward_launch<64, 128, 128, 4, 2>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
    else fa2_forward_launch<128, 128, 64, 4, 2>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
}

// Backward: writes (=) dq, dk, dv with row stride dqkv_stride (indexed like q/k/v); dk, dv sum over
// the G query heads of a KV head. delta: caller-provided scratch [B, Hq, T] fp32 (rowsum(dout*out)).
// dout, out: [B, T, Hq, D] contiguous. Deterministic: no atomics, a fixed summation order.
static void attention_backward_fa2(bf16* dq, bf16* dk, bf16* dv, float* delta, const bf16* dout, const bf16* out,
                               const float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                               int dqkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {dq, dk, dv, dout, out, q, k, v};
    attn_check_args("attention_backward_fa2", ptrs, 8, qkv_stride, B, T, Hq, Hkv, D);
    if (dqkv_stride % 8 != 0 || dqkv_stride < Hq * D) {
        fprintf(stderr, "attention_backward_fa2: dqkv_stride %d must be a multiple of 8 and at least Hq*D = %d\n",
                dqkv_stride, Hq * D);
        exit(1);
    }
    attn_delta_launch(delta, nullptr, nullptr, dout, out, B, T, T, Hq, D, stream);
    if (D == 64) {
        fa2_backward_dkdv_launch<64, 128, 4, 2>(dk, dv, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T,
                                               Hq, Hkv, stream);
        fa2_backward_dq_launch<64, 128, 4, 2>(dq, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq,
                                             Hkv, stream);
    } else {
        fa2_backward_dkdv_launch<128, 64, 4, 2>(dk, dv, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T,
                                                Hq, Hkv, stream);
        fa2_backward_dq_launch<128, 64, 4, 2>(dq, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq,
                                              Hkv, stream);
    }
}
