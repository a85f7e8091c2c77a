/*
 * lib/attention.cuh - causal grouped-query self-attention on Hopper (sm_90a), forward and backward,
 * bf16 in and out, fp32 softmax statistics: the FlashAttention-3-style kernels the trainer runs
 * (version 4 of the dev/ ladder; attention_forward / attention_backward at the bottom), and the
 * helpers every version in dev/ shares (attn_*: exp2, bf16 packing, the online softmax step, row
 * stores from registers or staged for TMA, the delta kernel, argument checks; the backward's wgmma
 * chains).
 *
 * How it fits: kernels.cuh includes it where attention comes in a training step, so train_gpt and
 * test_gpt reach it there; dev/attention.cu and its versions include it directly. The PTX wrappers
 * underneath (wgmma, mbarrier, TMA, bulk copies) are lib/ptx.cuh's; doc/attention.md has the
 * measurements and the versions that lost.
 *
 * Conventions a reader must know:
 *  - Layout: q, k and v are token-major with a common row stride, so they may point into one packed
 *    qkv buffer: element (b, t, h, d) of q is q[(b*T + t)*qkv_stride + h*D + d] (h < Hq; k and v
 *    alike with h < Hkv). KV head j serves query heads j*G .. j*G+G-1, G = Hq/Hkv, indexed in place,
 *    never copied. out is [B, T, Hq, D]. D is 64 or 128 (a template parameter); any T >= 1.
 *  - lse is [B, Hq, T], the natural-log logsumexp of the scaled scores. Inside, the softmax runs in
 *    base 2: scores are scaled by scale * log2(e), and the backward reads lse2 = lse * log2(e).
 *  - Determinism: the backward writes (=) dq, dk, dv; dk and dv sum over the G query heads of their
 *    KV head inside one thread block in a fixed order, and the dQ partial sums are added in a fixed
 *    order too, so a run repeats bit for bit (unless attention_backward is asked for any order).
 */
#ifndef ATTENTION_CUH
#define ATTENTION_CUH

#include <math.h>
#include "cuda_check.h"
#include "fp8_codes.cuh"  // the forward's optional E4M3 copy of its output: FP8 training's fused path
#include "ptx.cuh"

// The softmax runs in base 2 (exp2 is one instruction): scores are scaled by scale * ATTN_LOG2E,
// and a base-2 logsumexp times ATTN_LN2 is the natural-log lse that the API keeps.
static constexpr float ATTN_LOG2E = 1.44269504089f;  // log2(e)
static constexpr float ATTN_LN2 = 0.69314718056f;    // ln(2) = 1 / log2(e)

// ----------------------------------------------------------------------------------------------
// The kernels: FlashAttention-3's structure on Hopper. A block is a producer warpgroup, which only
// moves data (TMA loads on an mbarrier ring; in the backward also the bulk reduce of dQ), and two or
// three consumer warpgroups, which only compute: every product is a warpgroup matrix instruction
// chain (wgmma), each consumer owning 64 rows of every accumulator. Products whose operands both sit
// in shared memory (S = Q K^T, dP = dO V^T, their transposes, and dQ = dS K) read the tiles
// directly; products with P or dS on the left take them from registers (the accumulator layout is
// the A-operand layout). The online softmax runs in base 2.
//   forward (ws_forward_kernel): one block per SM taking query tiles from a work queue; per tile,
//     the KV tiles from the diagonal down; the softmax of tile i overlaps S = Q K^T of tile i+1 on
//     the tensor cores, the consumers take turns at issuing their products (one's softmax under
//     the other's products), and the next tile's loads overlap this one's epilogue, whose O goes
//     out by TMA from shared memory.
//   backward (ws_backward_kernel): one pass per KV tile over the query tiles at or below the
//     diagonal, 5 products per tile pair; dK and dV stay in registers (stored by TMA at the end),
//     dQ partial sums are added into fp32 accumulators in global memory in a fixed order
//     (deterministic) or, on request, in any order.
//
// Shared memory is laid out as wgmma's 128-byte swizzle expects: a [R][D] tile is D/64 panels of
// [R][64] (128-byte rows); 16-byte chunk c of row r of a panel sits at chunk c ^ (r & 7), each panel
// 1024-byte aligned. A K-major descriptor advances 32 bytes per 16-element k-step inside a panel; an
// MN-major one advances 16 rows (2048 bytes) per step. TMA writes tiles in exactly this layout.
//
// Measured on an H100 SXM (B*T = 16K tokens, causal FLOPs counted once), D = 128, T = 512 / 1024 /
// 2048 / 4096: forward 269 / 398 / 474 / 526 TFLOP/s, backward 215 / 319 / 408 / 457 (2026-11-24,
// the backward's block order in groups; doc/attention.md).
// First the helpers (shared-memory addresses, exp2, bf16 packing, the softmax step, row stores,
// delta), which the versions in dev/ share, then the kernels and their launchers.

// ----------------------------------------------------------------------------------------------
// Small device helpers

static __device__ __forceinline__ uint32_t attn_smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}


static __device__ __forceinline__ float attn_exp2(float x) {  // 2^x; 2^-inf = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ uint32_t attn_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low 16 bits
    return *reinterpret_cast<uint32_t*>(&v);
}

// The A operand of a register-sourced wgmma (or mma.m16n8k16) from a warp's fp32 accumulator tile
// x (16 rows x 8*NT columns): k-step kk takes the 8-column blocks 2kk and 2kk+1, rounded to bf16.
template <int NT>
static __device__ __forceinline__ void attn_pack_a(uint32_t (&a)[NT / 2][4], const float (&x)[NT][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        a[kk][0] = attn_pack_bf16(x[2 * kk][0], x[2 * kk][1]);
        a[kk][1] = attn_pack_bf16(x[2 * kk][2], x[2 * kk][3]);
        a[kk][2] = attn_pack_bf16(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        a[kk][3] = attn_pack_bf16(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
}

template <int N>
static __device__ __forceinline__ void attn_zero(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
}

// Writes a warp's 16 x D fp32 accumulator (times mul) as bf16 rows row0+g and row0+g+8 of a
// token-major tensor g; rows at or past T are skipped. With `codes` (a tensor of the same layout,
// one byte an element), also the E4M3 codes of those bf16 values at codes_scale, raising
// *codes_amax to their largest magnitude (lib/fp8_codes.cuh: the very codes a cast of g makes);
// g NULL: the codes alone (the forward stores O by TMA: attn_stage_store).
template <int D>
static __device__ __forceinline__ void attn_store_rows(bf16* g, long stride, int row0, int T,
                                                      const float (&acc)[D / 8][4], float mul0,
                                                      float mul1, int lane, uint8_t* codes = nullptr,
                                                      float codes_scale = 0.f, float* codes_amax = nullptr) {
    const int r0 = row0 + (lane >> 2), c0 = 2 * (lane & 3);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows r0 and r0 + 8
            if (r0 + 8 * half >= T) continue;
            const long at = (long)(r0 + 8 * half) * stride + dt * 8 + c0;
            const float mul = half ? mul1 : mul0;
            const __nv_bfloat162 v = __floats2bfloat162_rn(acc[dt][2 * half] * mul, acc[dt][2 * half + 1] * mul);
            if (g) *reinterpret_cast<__nv_bfloat162*>(g + at) = v;
            if (codes)
                *reinterpret_cast<uint16_t*>(codes + at) = fp8_encode2<__NV_E4M3>(v.x, v.y, codes_scale, codes_amax);
        }
}

// A consumer warpgroup's 64 x D accumulator (the forward's O at the end of an item, the backward's
// dK or dV at the end of its block), by all its 128 threads: times each row's mul, rounded to bf16
// as attn_store_rows rounds it, staged in shared memory at `stage`, a panel of 64 rows x 128 bytes
// in the 128-byte swizzle for each 64 columns (panel_bytes apart), then stored by one TMA copy a
// panel at (column col0, row row0, batch b) of map, whose bounds clip the rows at or past T. Thread
// 0 issues the copies and, before the buffer is written, waits until its earlier copies have read
// it (the forward stages every item in the same buffer); `bar` is the consumer's named barrier for
// the hand-offs. The warps go on while the copy engine writes: from registers, each warp's 4-byte
// stores left every 32-byte sector half written by each instruction.
template <int D>
static __device__ __forceinline__ void attn_stage_store(unsigned char* stage, int panel_bytes, const CUtensorMap* map,
                                                        const float (&acc)[D / 8][4], float mul0, float mul1,
                                                        int col0, int row0, int b, int bar) {
    const int tid = threadIdx.x & 127;
    if (tid == 0) bulk_wait<true>();  // this thread's earlier copies have read the buffer
    named_barrier(bar, 128);
#pragma unroll
    for (int p = 0; p < D / 64; ++p)
        wg_stage_panel(stage + p * panel_bytes, [&](int jj, int h) {
            const float(&d)[4] = acc[8 * p + jj];
            const float mul = h ? mul1 : mul0;
            return __floats2bfloat162_rn(d[2 * h] * mul, d[2 * h + 1] * mul);
        });
    wg_fence_proxy_async();  // the writes above, before the copy engine reads them
    named_barrier(bar, 128);
    if (tid == 0)
#pragma unroll
        for (int p = 0; p < D / 64; ++p)
            tma_store_3d<false>(map, attn_smem_u32(stage + p * panel_bytes), col0 + 64 * p, row0, b);
}

// Online softmax of one tile of scores (one warp's 16 rows, NT 8-column blocks), in place: s becomes
// P = 2^(s*scale_log2 - m_new), unnormalized; the running row sums are rescaled and extended, and
// alpha = 2^(m_old - m_new) is returned for O, which the caller rescales once the previous tile's
// P V has left the tensor cores (ws_forward_kernel), or at once (dev/'s versions 2 and 3).
template <int NT>
static __device__ __forceinline__ void attn_softmax_tile(float (&s)[NT][4], float (&row_max)[2], float (&row_sum)[2],
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

// O *= alpha row-wise (rows g and g+8 of the warp's accumulator tile).
template <int DT>
static __device__ __forceinline__ void attn_rescale(float (&o)[DT][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        o[dt][0] *= alpha[0];
        o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1];
        o[dt][3] *= alpha[1];
    }
}

// ----------------------------------------------------------------------------------------------
// Backward. With s = scale * q.k, P = exp(s - lse), O = P V and dO given:
//   dV = P^T dO,   dP = dO V^T,   dS = P o (dP - delta),   delta_i = sum_d dO_id O_id = rowsum(P o dP),
//   dQ = scale * dS K,   dK = scale * dS^T Q   (o: elementwise product).
// Computed with every (KV tile, query tile) pair visited once: dK, dV summed in registers over the
// query tiles, dQ summed over the KV tiles in global memory (ws_backward_kernel).

// The backward's per-row inputs, for each (b, h, t) row of a [B, Hq, Tp] layout (Tp >= T pads
// each head's rows): delta[(b*Hq + h)*Tp + t] = sum_d dout[b, t, h, d] * out[b, t, h, d], and, when
// lse2 is given, lse2[...] = lse[b, h, t] * log2 e, the logsumexp in the kernels' base 2. Pad rows
// (t >= T) get delta 0 and lse2 +inf, so that P = exp2(s - lse2) is 0 there. A row is D / 8 lanes
// (D = 64 or 128, attn_check_args), each reading 16 bytes of dout and of out, so that a warp keeps
// 32 such loads of each in flight (4 or 2 rows); the lanes of a row then add up by shuffles.
__global__ void attn_delta_kernel(float* __restrict__ delta, float* __restrict__ lse2, const float* __restrict__ lse,
                                 const bf16* __restrict__ dout, const bf16* __restrict__ out, int T, int Tp, int Hq,
                                 int D, long rows) {
    const int lanes = D / 8, lane = threadIdx.x & 31, part = lane % lanes;
    const long row = ((long)blockIdx.x * blockDim.x + threadIdx.x) / lanes;
    const long bh = row / Tp;
    const int t = (int)(row % Tp);
    float acc = 0.f;
    if (row < rows && t < T) {  // every lane stays to the shuffles, past the last row too
        const long off = (((bh / Hq) * T + t) * Hq + bh % Hq) * D + 8 * part;
        const uint4 a = *reinterpret_cast<const uint4*>(dout + off), c = *reinterpret_cast<const uint4*>(out + off);
        const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
        const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&c);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 xf = __bfloat1622float2(x[i]), yf = __bfloat1622float2(y[i]);
            acc += xf.x * yf.x + xf.y * yf.y;
        }
    }
    for (int o = lanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (row < rows && part == 0) {
        delta[row] = acc;
        if (lse2) lse2[row] = t < T ? lse[bh * T + t] * ATTN_LOG2E : INFINITY;
    }
}


// The backward's elementwise step on a warp's transposed tile, in place: rows are keys key0 + g and
// key0 + g + 8, columns queries q0 + 8nt + 2i (+1) (lane = 4g + i). On entry s = S^T and dp = dP^T;
// on return s = P^T = 2^(s * scale_log2 - lse2[q]) (0 where the query precedes the key, checked
// only when diag) and dp = dS^T = P^T o (dP^T - delta[q]). lse2 (lse * log2 e; +inf past T, so
// P = 0 there) and dl (delta) hold the tile's per-query values in shared memory.
template <int NT>
static __device__ __forceinline__ void attn_bwd_p_ds_t(float (&s)[NT][4], float (&dp)[NT][4], const float* lse2,
                                                      const float* dl, bool diag, int q0, int key0, int lane,
                                                      float scale_log2) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int c = nt * 8 + 2 * (lane & 3);
        const float2 l2 = *reinterpret_cast<const float2*>(lse2 + c);
        const float2 d2 = *reinterpret_cast<const float2*>(dl + c);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float p = attn_exp2(fmaf(s[nt][i], scale_log2, -((i & 1) ? l2.y : l2.x)));
            if (diag && q0 + c + (i & 1) < key0 + (lane >> 2) + 8 * (i >> 1)) p = 0.f;
            s[nt][i] = p;
            dp[nt][i] = p * (dp[nt][i] - ((i & 1) ? d2.y : d2.x));
        }
    }
}

// ----------------------------------------------------------------------------------------------
// Launchers. The tile configuration of each kernel is a template argument, so the dev/ ladder can
// time alternatives; attention_forward / attention_backward below pick the measured best.

template <typename Kernel>
static void attn_allow_smem(Kernel kernel, int bytes) {
    if (bytes > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// delta [B, Hq, T] (lse2 null), or delta and lse2 [B, Hq, Tp] with pad rows (attn_delta_kernel).
static void attn_delta_launch(float* delta, float* lse2, const float* lse, const bf16* dout, const bf16* out, int B,
                             int T, int Tp, int Hq, int D, cudaStream_t stream) {
    const long rows = (long)B * Hq * Tp;
    attn_delta_kernel<<<ceil_div(rows * (D / 8), 256), 256, 0, stream>>>(delta, lse2, lse, dout, out, T, Tp, Hq, D,
                                                                        rows);
    CUDA_CHECK(cudaGetLastError());
}

// Argument checks shared by both entry points: one line naming the bad value, then exit(1).
static void attn_check_args(const char* fn, const void* const* ptrs, int nptrs, int stride, int B, int T,
                           int Hq, int Hkv, int D) {
    if (D != 64 && D != 128) {
        fprintf(stderr, "%s: head_dim %d is not supported; the kernels are built for 64 and 128\n", fn, D);
        exit(1);
    }
    if (B < 1 || T < 1 || Hkv < 1 || Hq % Hkv != 0 || B * Hq > 65535) {
        fprintf(stderr, "%s: bad shape B=%d T=%d Hq=%d Hkv=%d (need B, T >= 1, Hq a multiple of Hkv, "
                        "B*Hq <= 65535)\n", fn, B, T, Hq, Hkv);
        exit(1);
    }
    if (stride % 8 != 0 || stride < Hq * D) {
        fprintf(stderr, "%s: row stride %d must be a multiple of 8 elements and at least Hq*D = %d\n", fn,
                stride, Hq * D);
        exit(1);
    }
    for (int i = 0; i < nptrs; ++i)
        if ((uintptr_t)ptrs[i] % 16 != 0) {
            fprintf(stderr, "%s: pointer argument %d (%p) is not 16-byte aligned\n", fn, i, ptrs[i]);
            exit(1);
        }
}

// ----------------------------------------------------------------------------------------------
// The backward's paired wgmma chains, shared by every backward kernel on wgmma.

// s = A1 B1^T and dp = A2 B2^T over a k dimension of D (two SS chains, one commit, waited): A1, A2
// are 64-row slices of [RA][D] tiles, B1, B2 [N][D] tiles, all K-major in 64-column panels (RA and
// N rows apart). The dK/dV side computes S^T = K Q^T, dP^T = V dO^T; the dQ side S = Q K^T, dP = dO V^T.
template <int D, int RA, int N>
static __device__ __forceinline__ void wg_ss_pair(float (&s)[N / 8][4], float (&dp)[N / 8][4], uint32_t a1,
                                                  uint32_t a2, uint32_t b1, uint32_t b2) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t a_off = (kk / 4) * RA * 128 + (kk % 4) * 32, b_off = (kk / 4) * N * 128 + (kk % 4) * 32;
        if (kk == 0) {
            wg_mma_ss<N, 0>(s, wg_desc(a1 + a_off), wg_desc(b1 + b_off));
            wg_mma_ss<N, 0>(dp, wg_desc(a2 + a_off), wg_desc(b2 + b_off));
        } else {
            wg_mma_ss<N, 1>(s, wg_desc(a1 + a_off), wg_desc(b1 + b_off));
            wg_mma_ss<N, 1>(dp, wg_desc(a2 + a_off), wg_desc(b2 + b_off));
        }
    }
    wg_commit();
    wg_wait<0>();
    wg_fence_regs(s);
    wg_fence_regs(dp);
}

// acc (+)= A B for a warpgroup's 64 rows: A (64 x K, bf16) from registers in attn_pack_a's layout, B
// a [K][D] tile in 64-column panels (K rows apart) read MN-major. Committed, not waited for. O += P V,
// dV += P^T dO, dK += dS^T Q and version 3's dQ += dS K are all this chain.
template <int D, int K>
static __device__ __forceinline__ void wg_rs_chain(float (&acc)[D / 8][4], const uint32_t (&a)[K / 16][4], uint32_t b) {
    wg_fence_regs(acc);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        wg_mma_rs_n64_tb<0, D / 8>(acc, a[kk], wg_desc(b + kk * 16 * 128));
        if constexpr (D == 128) wg_mma_rs_n64_tb<8, D / 8>(acc, a[kk], wg_desc(b + K * 128 + kk * 16 * 128));
    }
    wg_commit();
}

// ----------------------------------------------------------------------------------------------
// TMA tensor maps, encoded on the host once per distinct set of arguments, then taken from a cache.

// A 3-D map {cols, T, B} over base (row stride `stride` elements, batch stride T*stride), box
// {64, rows, 1}, 128-byte swizzle, out-of-bounds elements read as zero.
static CUtensorMap tma_tensor_map_encode(const bf16* base, int cols, int stride, int T, int B, int rows) {
    CUtensorMap m;
    const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[2] = {(cuuint64_t)stride * sizeof(bf16), (cuuint64_t)T * stride * sizeof(bf16)};
    const cuuint32_t box[3] = {64, (cuuint32_t)rows, 1}, estr[3] = {1, 1, 1};
    const CUresult r = tma_encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16*>(base), dims, strides,
                                      box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "attention: cuTensorMapEncodeTiled failed (%d) for cols %d, stride %d, T %d, B %d, "
                        "box rows %d\n", (int)r, cols, stride, T, B, rows);
        exit(1);
    }
    return m;
}

// The maps encoded so far, keyed by every argument of tma_tensor_map. A map is a function of those
// arguments alone, so a hit is exactly what encoding would return, even for a buffer freed and its
// address reused. The trainer launches attention and its two MLP GEMMs (lib/matmul_hopper.cuh) on
// the same buffers every step. Attention: with recompute on (the default), at most 7 maps in all
// (q of the forward and of the backward, k, v, dO, dK, dV) and the forward's output O, one per
// layer; without it, at most 5 per layer and those of dO, dK and dV. The gate/up forward: 4 per
// layer (W's halves, gate_up's halves) and x and act, which without recompute are per layer too;
// the down backward: W_down and gate_up's halves (read, 128-row boxes) per layer, dy and
// d_gate_up's halves: at 256 layers at most 2060 maps with recompute, 3590 without. The table (open
// addressing, linear probing) holds those under its 3/4 fill limit; a miss past the limit empties it
// first. Like the launchers' static state, it assumes one host thread launches the kernels.
#define TMA_MAP_SLOTS 8192  // a power of two
struct TmaMapKey {
    const bf16* base;
    int cols, stride, T, B, rows;
};
struct TmaMapSlot {
    TmaMapKey key;
    bool used;
    CUtensorMap map;
};
static TmaMapSlot tma_map_slots[TMA_MAP_SLOTS];
static int tma_map_used;

static bool tma_map_key_equal(const TmaMapKey& a, const TmaMapKey& b) {
    return a.base == b.base && a.cols == b.cols && a.stride == b.stride && a.T == b.T && a.B == b.B &&
           a.rows == b.rows;
}

// The home slot of a key: the fields folded in by FNV-1a's step, then murmur3's 64-bit finalizer,
// so that base addresses which differ only in high bits still spread over the table.
static int tma_map_home(const TmaMapKey& k) {
    const uint64_t fields[6] = {(uint64_t)(uintptr_t)k.base, (uint64_t)(uint32_t)k.cols, (uint64_t)(uint32_t)k.stride,
                                (uint64_t)(uint32_t)k.T, (uint64_t)(uint32_t)k.B, (uint64_t)(uint32_t)k.rows};
    uint64_t h = 0xCBF29CE484222325ull;
    for (int i = 0; i < 6; ++i) h = (h ^ fields[i]) * 0x100000001B3ull;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    return (int)(h & (TMA_MAP_SLOTS - 1));
}

// The map of tma_tensor_map_encode(base, cols, stride, T, B, rows), encoded on its first use only.
static CUtensorMap tma_tensor_map(const bf16* base, int cols, int stride, int T, int B, int rows) {
    const TmaMapKey key = {base, cols, stride, T, B, rows};
    int i = tma_map_home(key);
    for (; tma_map_slots[i].used; i = (i + 1) & (TMA_MAP_SLOTS - 1))  // ends: the table is never full
        if (tma_map_key_equal(tma_map_slots[i].key, key)) return tma_map_slots[i].map;
    if (tma_map_used >= TMA_MAP_SLOTS / 4 * 3) {  // fuller than the trainer needs: start over
        for (int j = 0; j < TMA_MAP_SLOTS; ++j) tma_map_slots[j].used = false;
        tma_map_used = 0;
        i = tma_map_home(key);
    }
    TmaMapSlot* slot = &tma_map_slots[i];
    slot->key = key;
    slot->map = tma_tensor_map_encode(base, cols, stride, T, B, rows);
    slot->used = true;
    tma_map_used++;
    return slot->map;
}

// ----------------------------------------------------------------------------------------------
// The order of the work, forward and backward alike: `heads` heads of `tiles` tiles each (the
// forward's query tiles, the backward's KV tiles), walked in groups of `group` heads (the last
// group may hold fewer), each group tile by tile and, within a tile, head by head. The launcher
// sizes a group so that what its heads share (the forward's K and V, the backward's Q and dO)
// stays in L2 while the group's tiles are in flight: as many heads as fit in `mib` MiB, at least one.
static int attn_group_heads(double mib, double bytes_per_head, int heads) {
    return (int)fmin((double)heads, fmax(1.0, mib * 1048576.0 / bytes_per_head));
}

// Item w of that walk: its tile (0 .. tiles-1) and its head.
static __device__ __forceinline__ void attn_group_walk(int w, int tiles, int heads, int group, int* tile, int* head) {
    const int g0 = w / (tiles * group) * group, in_group = min(group, heads - g0), j = w - g0 * tiles;
    *tile = j / in_group;
    *head = g0 + j % in_group;
}

// The forward's work queue: a ticket counter per kernel instantiation. Item i < gridDim.x is block
// i's first; the others go to whichever block asks next. Every block asks until it draws an item
// past the end, so exactly `items` tickets are drawn in a launch, and the block that draws the last
// one resets the counter for the next launch (launches on one stream never overlap).
template <int D, int BN, int NC>
__device__ int ws_ticket;

template <int D, int BN, int NC>
static __device__ __forceinline__ int ws_next_item(int items, int grid) {
    const int ticket = atomicAdd(&ws_ticket<D, BN, NC>, 1);
    if (ticket == items - 1) atomicExch(&ws_ticket<D, BN, NC>, 0);
    return grid + ticket;
}

// ----------------------------------------------------------------------------------------------
// Forward (version 4). Work items are (BM = 64*NC query rows, b, query head) tiles; a persistent
// grid of one block per SM takes them from a queue (ws_next_item), longest first within groups of
// heads whose K and V fit in L2. A block is NC+1 warpgroups: NC = 2 (384 threads, 128 x 128 tiles),
// or 3 at D = 64 and T > 1024 (512 threads, 192 queries x 128 keys):
//   warpgroup 0, the producer: shrinks to 24 registers (32 at NC = 3); one thread claims items and
//     issues every TMA load: per item Q (once the consumers are done with the last one), then for
//     each KV tile of BN keys (from the diagonal down) K and V into a 2-stage ring, each stage
//     guarded by a full barrier (TMA bytes) and an empty barrier (one arrive per consumer warp
//     once its wgmma reads are done). The ring runs on across items, so the next item's loads
//     overlap this one's last products and epilogue.
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
// The consumers take turns at issuing those products (ping-pong: round robin on named barriers), so
// that one consumer's products run while the others compute their softmax.
// End of an item: O /= l and lse = (m + log2 l) ln 2; lse stored from registers, O staged in the
// consumer's buffer and stored by TMA (attn_stage_store, named barriers NC+2 ..), so the consumer
// starts its next item while the copy engine writes O; with `codes` (FP8 training's fused path,
// doc/fp8.md) also O's E4M3 codes at codes_scale->scale, from the same bf16 values, from registers
// (attn_store_rows), and at the end of the block O's amax over its rows into codes_scale->amax: a
// max over the consumer warps, published once (fp8_publish_amax).
// Shared memory: Q [BM][D], K [2][BN][D], V [2][BN][D] bf16 in 64-column panels, O's staging
// [NC][64][D], the item slot, then 10 mbarriers (D = 128: 192 KiB; D = 64: 96 or 112 KiB). One
// block per SM (the register file is full).
template <int D, int BN, int NC>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
    ws_forward_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                      float* __restrict__ lse,
                      uint8_t* __restrict__ codes, Fp8Scale* codes_scale, int B, int T, int Hq, int Hkv,
                      int group_heads, float scale_log2) {
    constexpr int BM = 64 * NC, NT = BN / 8, DT = D / 8, PANELS = D / 64;
    // Register budget: the block starts with the launch-bounds cap (168 registers a thread for 384
    // threads, 128 for 512) and the whole 64K file; the producer hands back all but PROD_REGS, and
    // the consumers take what that frees: 128*24 + 256*240 = 128*32 + 384*160 = 65536 - 1024 or 65536.
    constexpr int PROD_REGS = NC == 2 ? 24 : 32, CONS_REGS = NC == 2 ? 240 : 160;
    static_assert((BN == 64 || BN == 128) && (D == 64 || D == 128) && (NC == 2 || NC == 3), "tile sizes");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(attn_smem);  // [BM * D]
    bf16* Ks = Qs + BM * D;      // [2][BN * D]
    bf16* Vs = Ks + 2 * BN * D;  // [2][BN * D]
    bf16* o_stage = Vs + 2 * BN * D;  // [NC][64 * D]: each consumer's O on its way out (attn_stage_store)
    int* item_slot = reinterpret_cast<int*>(o_stage + NC * 64 * D);  // the item whose Q is loaded
    const uint32_t bars = attn_smem_u32(item_slot + 4);
    // barrier addresses: q_full, q_empty, k_full[2], v_full[2], k_empty[2], v_empty[2]
    const uint32_t q_full = bars, q_empty = bars + 8, k_full = bars + 16, v_full = bars + 32, k_empty = bars + 48,
                   v_empty = bars + 64;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int BH = B * Hq, q_tiles = (T + BM - 1) / BM, items = q_tiles * BH;
    // Work items: (query tile, b*Hq + h) pairs, ordered in groups of group_heads heads (attn_group_walk;
    // chosen by the launcher so that a group's K and V stay in L2 while its tiles are in flight); inside a group the
    // longest rows (the last query tiles) come first. Block i starts with item i, then takes the next
    // unclaimed one from a ticket counter (ws_next_item), so blocks that drew short items take more.
    struct Item { int b, h, m0, n_tiles; };
    auto item_of = [&](int w) {
        Item it;
        int tile, bh;
        attn_group_walk(w, q_tiles, BH, group_heads, &tile, &bh);
        it.b = bh / Hq;
        it.h = bh % Hq;
        it.m0 = (q_tiles - 1 - tile) * BM;
        it.n_tiles = (min(T, it.m0 + BM) + BN - 1) / BN;
        return it;
    };

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 4 * NC);  // one arrive per consumer warp once its last S is done
        for (int s = 0; s < 2; ++s) {
            mbar_init(k_full + 8 * s, 1);
            mbar_init(v_full + 8 * s, 1);
            mbar_init(k_empty + 8 * s, 4 * NC);
            mbar_init(v_empty + 8 * s, 4 * NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Q is reloaded per item j (the phase parity of its barriers is j & 1) once the consumers have
    // issued their last S = Q K^T of the previous item: the load overlaps that item's last P V and
    // epilogue. The KV ring runs on across items: t counts the KV tiles this block has loaded, t & 1
    // is the stage, (t >> 1) & 1 the parity of its full barrier's phase. (A second Q stage, loading
    // a whole item ahead, measured slower at long T: doc/attention.md.)
    if (wg == 0) {  // producer
        setmaxnreg_dec<PROD_REGS>();
        if (threadIdx.x == 0) {
            int t = 0;
            for (int j = 0, w = blockIdx.x;; ++j, w = ws_next_item<D, BN, NC>(items, gridDim.x)) {
                if (j > 0) mbar_wait(q_empty, (j - 1) & 1);  // the consumers are done with the last Q
                *item_slot = w;  // published by the arrival below
                if (w >= items) {  // no work left: tell the consumers
                    mbar_arrive(q_full);
                    break;
                }
                const Item it = item_of(w);
                const int hk = it.h / (Hq / Hkv);
                mbar_expect_tx(q_full, BM * D * sizeof(bf16));
                for (int p = 0; p < PANELS; ++p)
                    tma_load_3d(attn_smem_u32(Qs + p * BM * 64), &tm_q, it.h * D + p * 64, it.m0, it.b, q_full);
                for (int i = 0; i < it.n_tiles; ++i, ++t) {
                    const int st = t & 1, n0 = (it.n_tiles - 1 - i) * BN;
                    const uint32_t parity = ((t >> 1) - 1) & 1;  // the phase KV tile t-2 completed
                    if (t >= 2) mbar_wait(k_empty + 8 * st, parity);
                    mbar_expect_tx(k_full + 8 * st, BN * D * sizeof(bf16));
                    for (int p = 0; p < PANELS; ++p)
                        tma_load_3d(attn_smem_u32(Ks + st * BN * D + p * BN * 64), &tm_k, hk * D + p * 64, n0, it.b,
                                    k_full + 8 * st);
                    if (t >= 2) mbar_wait(v_empty + 8 * st, parity);
                    mbar_expect_tx(v_full + 8 * st, BN * D * sizeof(bf16));
                    for (int p = 0; p < PANELS; ++p)
                        tma_load_3d(attn_smem_u32(Vs + st * BN * D + p * BN * 64), &tm_v, hk * D + p * 64, n0, it.b,
                                    v_full + 8 * st);
                }
            }
        }
        return;
    }

    // consumers
    setmaxnreg_inc<CONS_REGS>();
    const int cw = wg - 1, wrow = cw * 64 + (warp & 3) * 16;  // this warp's rows inside the tile
    const uint32_t qs = attn_smem_u32(Qs) + cw * 64 * 128;
    float o[DT][4], s[NT][4], row_max[2], row_sum[2], alpha[2];
    uint32_t pa[BN / 16][4];  // P of the previous tile in bf16: the A operand of O += P V
    const float codes_mul = codes ? codes_scale->scale : 0.f;
    float codes_amax = 0.f;  // of this thread's O values over every item

    // S = Q K^T of ring stage st into s (issued and committed, not waited for)
    auto issue_s = [&](int st) {
        const uint32_t ks = attn_smem_u32(Ks + st * BN * D);
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
    // O += P V of ring stage st (issued and committed, not waited for)
    auto issue_pv = [&](int st) { wg_rs_chain<D, BN>(o, pa, attn_smem_u32(Vs + st * BN * D)); };
    // mask key > query where the tile of keys n0.. crosses this warp's diagonal, then the softmax step
    auto softmax = [&](int m0, int n0) {
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
        attn_softmax_tile<NT>(s, row_max, row_sum, alpha, scale_log2);
    };

    // The consumers take turns at issuing their products (FlashAttention-3's ping-pong): consumer c
    // issues once consumer c - 1 has (round robin on named barriers 2 .. NC+1: c waits at its own,
    // the one before arrives there), so that one consumer's products run on the tensor cores while
    // the others compute their softmax. The last consumer hands the first turn to consumer 0, and
    // consumer 0 takes the last one's final turn at the end.
    auto turn_begin = [&]() { named_barrier(2 + cw, 256); };
    auto turn_end = [&]() { named_barrier_arrive(2 + (cw + 1) % NC, 256); };
    if (cw == NC - 1) turn_end();

    int t = 0;  // as the producer's
    for (int j = 0;; ++j) {
        mbar_wait(q_full, j & 1);
        const int w = *item_slot;
        if (w >= items) break;
        const Item it = item_of(w);
        const int m0 = it.m0, last = it.n_tiles - 1;
        attn_zero(o);
        row_max[0] = row_max[1] = -INFINITY;
        row_sum[0] = row_sum[1] = 0.f;
        mbar_wait(k_full + 8 * (t & 1), (t >> 1) & 1);
        turn_begin();
        issue_s(t & 1);
        turn_end();
        wg_wait<0>();
        wg_fence_regs(s);
        if (lane == 0) {
            mbar_arrive(k_empty + 8 * (t & 1));
            if (last == 0) mbar_arrive(q_empty);
        }
        softmax(m0, last * BN);  // O is zero: no rescale
        attn_pack_a(pa, s);
        for (int i = 1; i <= last; ++i) {
            const int tc = t + i, st = tc & 1, prev = (tc - 1) & 1;
            mbar_wait(k_full + 8 * st, (tc >> 1) & 1);
            mbar_wait(v_full + 8 * prev, ((tc - 1) >> 1) & 1);
            turn_begin();
            issue_s(st);
            issue_pv(prev);
            turn_end();
            wg_wait<1>();  // S_i is done; P_{i-1} V_{i-1} may still run
            wg_fence_regs(s);
            if (lane == 0) {
                mbar_arrive(k_empty + 8 * st);
                if (i == last) mbar_arrive(q_empty);  // the producer may load the next item's Q
            }
            softmax(m0, (last - i) * BN);
            wg_wait<0>();  // O += P_{i-1} V_{i-1} done
            wg_fence_regs(o);
            if (lane == 0) mbar_arrive(v_empty + 8 * prev);
            attn_rescale<DT>(o, alpha);
            attn_pack_a(pa, s);
        }
        t += last;
        mbar_wait(v_full + 8 * (t & 1), (t >> 1) & 1);
        turn_begin();
        issue_pv(t & 1);
        turn_end();
        wg_wait<0>();
        wg_fence_regs(o);
        if (lane == 0) mbar_arrive(v_empty + 8 * (t & 1));
        ++t;

        // O /= l, and the logsumexp of the row in natural log; the producer is already loading the
        // next item's tiles
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = row_sum[r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            inv[r] = 1.f / l;
            const int tq = m0 + wrow + (lane >> 2) + 8 * r;
            if (tq < T && (lane & 3) == 0)
                lse[((long)it.b * Hq + it.h) * T + tq] = (row_max[r] + __log2f(l)) * ATTN_LN2;
        }
        attn_stage_store<D>(reinterpret_cast<unsigned char*>(o_stage + cw * 64 * D), 64 * 128, &tm_o, o, inv[0], inv[1],
                            it.h * D, m0 + cw * 64, it.b, 2 + NC + cw);
        if (codes)
            attn_store_rows<D>(nullptr, (long)Hq * D, m0 + wrow, T, o, inv[0], inv[1], lane,
                               codes + (long)it.b * T * Hq * D + it.h * D, codes_mul, &codes_amax);
    }
    if ((threadIdx.x & 127) == 0) bulk_wait<false>();  // O's copies done before the block's shared memory goes
    if (cw == 0) turn_begin();  // the last consumer's final turn_end
    if (codes) {  // the block's amax: the producer has left, so a named barrier over the consumers
        __shared__ float warp_amax[4 * NC];
        for (int offset = 16; offset > 0; offset >>= 1)
            codes_amax = fmaxf(codes_amax, __shfl_xor_sync(0xffffffffu, codes_amax, offset));
        if (lane == 0) warp_amax[warp - 4] = codes_amax;
        named_barrier(1, 128 * NC);
        if (threadIdx.x == 128) {
            for (int i = 1; i < 4 * NC; ++i) codes_amax = fmaxf(codes_amax, warp_amax[i]);
            fp8_publish_amax(codes_scale, codes_amax);
        }
    }
}

// PERSIST: a grid of one block per SM, each taking work items until none is left (the next item's
// loads overlap this one's epilogue); otherwise one block per item. Item groups hold the heads whose
// K and V (shared by G query heads) fit in L2_MIB MiB. codes: attention_forward's.
template <int D, int BN, int NC, bool PERSIST = true, int L2_MIB = 4>
static void ws_forward_launch(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int B,
                              int T, int Hq, int Hkv, cudaStream_t stream, uint8_t* codes = nullptr,
                              Fp8Scale* codes_scale = nullptr) {
    constexpr int BM = 64 * NC;
    auto kernel = ws_forward_kernel<D, BN, NC>;
    const int smem = (BM + 4 * BN + NC * 64) * D * (int)sizeof(bf16) + 16 + 10 * 8;
    static int sms = 0;
    if (!sms) {
        attn_allow_smem(kernel, smem);
        int dev;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    }
    const CUtensorMap tq = tma_tensor_map(q, Hq * D, stride, T, B, BM);
    const CUtensorMap tk = tma_tensor_map(k, Hkv * D, stride, T, B, BN);
    const CUtensorMap tv = tma_tensor_map(v, Hkv * D, stride, T, B, BN);
    const CUtensorMap to = tma_tensor_map(out, Hq * D, Hq * D, T, B, 64);
    const int items = ceil_div(T, BM) * B * Hq, grid = PERSIST && items > sms ? sms : items;
    const int group_heads = attn_group_heads(L2_MIB, 4.0 * T * D / (Hq / Hkv), B * Hq);  // K and V a head
    kernel<<<grid, 128 * (NC + 1), smem, stream>>>(tq, tk, tv, to, lse, codes, codes_scale, B, T, Hq, Hkv,
                                                   group_heads, ATTN_LOG2E / sqrtf((float)D));
    CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// Backward (version 4): FlashAttention-2's single pass over (KV tile, query tile) pairs, 5 products
// per pair, in FlashAttention-3's shape. The math is in the Backward comment above attn_delta_kernel:
//   S^T = K Q^T, dP^T = V dO^T, P^T = exp2(S^T*scale_log2 - lse2), dS^T = P^T o (dP^T - delta),
//   dV += P^T dO, dK += dS^T Q (kept in registers for the block's keys), dQ += dS K (partial sums
//   over the block's keys, added into fp32 accumulators in global memory).
// One block of 3 warpgroups per (BN = 128 keys, b, KV head), looping over every query tile of BM
// rows at or below the diagonal, from the last one down, and per tile over the G query heads of the
// KV head:
//   warpgroup 0, the producer (24 registers): thread 0 loads K and V once, then Q, dO (TMA, 3-D
//     maps, 128-byte swizzle) and the tile's lse2 and delta (1-D bulk copies of the padded rows
//     attn_delta_kernel writes) into a 2-stage ring (full / empty mbarriers); thread 32 is the dQ
//     writer: once the consumers have left a tile's dQ share in shared memory (dq_full), it adds
//     it into the global accumulators with one bulk reduce (cp.reduce.async.bulk .add.f32) and
//     frees the staging buffer (dq_empty) as soon as the copy engine has read it.
//   warpgroups 1 and 2, the consumers (240 registers): consumer c owns keys n0 + 64c .. +63. Per tile:
//     the two SS chains S^T, dP^T; P^T and dS^T in registers (attn_bwd_p_ds_t); dS^T also stored
//     to shared memory; the RS chains dV += P^T dO, dK += dS^T Q; a named barrier (both halves of
//     dS^T stored); then consumer c computes its 64 x 64 share of the tile's dQ = dS K over all
//     128 keys, reading dS (MN-major: keys are the k dimension) and K (MN-major) from shared memory:
//     D = 128, BM = 64: columns 64c .. 64c+63;  D = 64, BM = 128: rows 64c .. 64c+63.
//     The share goes to the staging buffer in fragment order (float4 per register block and thread,
//     conflict-free); ws_dq_convert_kernel later maps it back to (row, column). After the last
//     tile, dK and dV of the consumer's keys are staged where those keys' K and V rows were (both
//     consumers past their last product: a named barrier) and stored by TMA (attn_stage_store).
// Determinism (DET): the fp32 adds into one dQ tile come from the KV tiles 0 .. nmax of its rows,
// and are made in a fixed order, from KV tile 0 up, by a per-tile semaphore: the writer of KV tile
// n waits until the tile's count is n, adds (the first, n = 0, stores instead, so no zeroing pass is
// needed), waits for completion and increments the count (release). Without DET the adds are plain
// reductions in any order (the accumulators are zeroed first).
// The order of the work. A causal block's length is its number of query tiles: KV tile 0 has them
// all, the last KV tile one or two. Blocks are numbered in groups of `group` (b, KV head)s, KV tile
// first within a group: the group's KV tiles 0 start before its KV tiles 1, and so on, so that the
// shortest blocks come last and the last wave leaves few SMs idle. (Numbered the other way, each
// (b, KV head)'s last KV tile first, which adds from the top down needed, its longest block came
// last: Nsight Compute counted the SMs idle for 13% of medium's launch, and 23% of the default
// config's.) The group keeps L2's reuse: every KV tile of a head reads the same Q and dO tiles, so
// a group's Q and dO (ATTN_BWD_GROUP_MIB of them) are read while the group runs; with all
// heads one group, the KV tiles of a head ran too far apart and the backward lost 30% at T = 1024.
// A block waits only on blocks of lower number, dispatched before it. Walking the query tiles from
// the last one down, KV tiles n - 1 and n reach tile m at the same step of their walks; KV tile n
// mostly starts some blocks after n - 1 and trails it without waiting, and where the two start
// together (a group in the first wave) it waits about one add a step. (From the diagonal up, KV
// tile n would reach each tile (BN / BM) G steps before n - 1 and wait for it.)
// Shared memory: K, V [128][D]; Q, dO [2][BM][D]; dS^T [2][BM/64 panels][128 keys][64]; dQ staging
// BM*D fp32; lse2, delta [2][BM]; 7 mbarriers: 193 KiB at D = 128 (BM = 64) and 194 KiB at D = 64
// (BM = 128). One block per SM.
template <int D, int BM, bool DET>
__global__ void __launch_bounds__(384, 1)
    ws_backward_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                       const __grid_constant__ CUtensorMap tm_dk, const __grid_constant__ CUtensorMap tm_dv,
                       float* __restrict__ dq_acc, int* __restrict__ dq_sem, const float* __restrict__ lse2,
                       const float* __restrict__ delta, int T, int Tp, int Hq, int Hkv, int group, float scale,
                       float scale_log2) {
    constexpr int BN = 128, NT = BM / 8, DT = D / 8, PANELS = D / 64;
    static_assert((D == 128 && BM == 64) || (D == 64 && BM == 128), "each consumer's dQ share is one 64 x 64 block");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Ks = reinterpret_cast<bf16*>(attn_smem);
    bf16* Vs = Ks + BN * D;
    bf16* Qs = Vs + BN * D;                               // [2][BM * D]
    bf16* dOs = Qs + 2 * BM * D;                          // [2][BM * D]
    bf16* dSs = dOs + 2 * BM * D;                         // [2][BN * BM]
    float* dQs = reinterpret_cast<float*>(dSs + 2 * BN * BM);  // [BM * D], fragment order
    float* lse_s = dQs + BM * D;                          // [2][BM]
    float* dl_s = lse_s + 2 * BM;                         // [2][BM]
    const uint32_t bars = attn_smem_u32(dl_s + 2 * BM);
    // barrier addresses: kv_full, full[2], empty[2], dq_full, dq_empty
    const uint32_t kv_full = bars, full = bars + 8, empty = bars + 24, dq_full = bars + 40, dq_empty = bars + 48;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int G = Hq / Hkv, N = (T + BN - 1) / BN, M = (T + BM - 1) / BM;
    int n, bkv;  // the block's KV tile and (b * Hkv + hk): groups of `group` (b, KV head)s, KV tile first
    attn_group_walk((int)blockIdx.x, N, (int)gridDim.x / N, group, &n, &bkv);
    const int b = bkv / Hkv, hk = bkv % Hkv, n0 = n * BN;
    const int iters = G * (M - n0 / BM);  // iteration it: query tile M - 1 - it / G of query head hk * G + it % G

    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        for (int st = 0; st < 2; ++st) {
            mbar_init(full + 8 * st, 1);
            mbar_init(empty + 8 * st, 8);  // one arrive per consumer warp
        }
        mbar_init(dq_full, 8);
        mbar_init(dq_empty, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) {  // the loads
            mbar_expect_tx(kv_full, 2 * BN * D * sizeof(bf16));
            for (int p = 0; p < PANELS; ++p) {
                tma_load_3d(attn_smem_u32(Ks + p * BN * 64), &tm_k, hk * D + p * 64, n0, b, kv_full);
                tma_load_3d(attn_smem_u32(Vs + p * BN * 64), &tm_v, hk * D + p * 64, n0, b, kv_full);
            }
            for (int it = 0; it < iters; ++it) {
                const int st = it & 1, hh = hk * G + it % G, m0 = (M - 1 - it / G) * BM;
                if (it >= 2) mbar_wait(empty + 8 * st, ((it >> 1) - 1) & 1);  // the phase tile it-2 completed
                const uint32_t bar = full + 8 * st;
                mbar_expect_tx(bar, 2 * BM * D * sizeof(bf16) + 2 * BM * sizeof(float));
                for (int p = 0; p < PANELS; ++p) {
                    tma_load_3d(attn_smem_u32(Qs + st * BM * D + p * BM * 64), &tm_q, hh * D + p * 64, m0, b, bar);
                    tma_load_3d(attn_smem_u32(dOs + st * BM * D + p * BM * 64), &tm_do, hh * D + p * 64, m0, b, bar);
                }
                const long row = ((long)b * Hq + hh) * Tp + m0;
                bulk_load(attn_smem_u32(lse_s + st * BM), lse2 + row, BM * sizeof(float), bar);
                bulk_load(attn_smem_u32(dl_s + st * BM), delta + row, BM * sizeof(float), bar);
            }
        } else if (threadIdx.x == 32) {  // the dQ writer
            for (int it = 0; it < iters; ++it) {
                const int hh = hk * G + it % G, m = M - 1 - it / G;
                const long tile = ((long)b * Hq + hh) * (Tp / BM) + m;
                float* dst = dq_acc + tile * BM * D;
                mbar_wait(dq_full, it & 1);
                if constexpr (DET) {
                    const int turn = n;  // KV tiles 0 .. n-1 add first
                    while (load_acquire_gpu(dq_sem + tile) != turn) {
                    }
                    fence_proxy_async_global();
                    if (turn == 0) bulk_store<false>(dst, attn_smem_u32(dQs), BM * D * sizeof(float));
                    else bulk_store<true>(dst, attn_smem_u32(dQs), BM * D * sizeof(float));
                    bulk_wait<false>();
                    mbar_arrive(dq_empty);
                    fence_proxy_async_global();
                    add_release_gpu(dq_sem + tile, 1);
                } else {
                    bulk_store<true>(dst, attn_smem_u32(dQs), BM * D * sizeof(float));
                    bulk_wait<true>();
                    mbar_arrive(dq_empty);
                }
            }
            bulk_wait<false>();
        }
        return;
    }

    // consumers
    setmaxnreg_inc<240>();
    const int cw = wg - 1, ct = threadIdx.x - 128 * wg, wrow = cw * 64 + (warp & 3) * 16;  // this warp's keys
    const uint32_t ks = attn_smem_u32(Ks) + cw * 64 * 128, vs = attn_smem_u32(Vs) + cw * 64 * 128;
    float dk_acc[DT][4], dv_acc[DT][4];
    attn_zero(dk_acc);
    attn_zero(dv_acc);
    mbar_wait(kv_full, 0);

    for (int it = 0; it < iters; ++it) {
        const int st = it & 1, m0 = (M - 1 - it / G) * BM;
        mbar_wait(full + 8 * st, (it >> 1) & 1);
        const uint32_t qs = attn_smem_u32(Qs + st * BM * D), dos = attn_smem_u32(dOs + st * BM * D);

        float s[NT][4], dp[NT][4];  // S^T then P^T; dP^T then dS^T
        wg_ss_pair<D, BN, BM>(s, dp, ks, vs, qs, dos);
        attn_bwd_p_ds_t(s, dp, lse_s + st * BM, dl_s + st * BM, m0 < n0 + wrow + 15, m0, n0 + wrow, lane, scale_log2);
        uint32_t pa[BM / 16][4], dsa[BM / 16][4];  // P^T and dS^T in bf16, A-operand layout
        attn_pack_a(pa, s);
        attn_pack_a(dsa, dp);

        // dS^T to shared memory, the same bf16 values: panel nt/8 holds queries 64*(nt/8) .. +63; row
        // = key (0 .. 127), 128 bytes; 16-byte chunk (nt%8) ^ (key & 7) (conflict-free: the 32 lanes
        // hit 8 chunks x 4 words). Rows key and key + 8 share the swizzle.
        bf16* dS = dSs + (it & 1) * BN * BM;
        const int key = wrow + (lane >> 2);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            unsigned char* at = reinterpret_cast<unsigned char*>(dS) + (nt / 8) * BN * 128 + key * 128 +
                                (((nt % 8) ^ (key & 7)) << 4) + (lane & 3) * 4;
            *reinterpret_cast<uint32_t*>(at) = dsa[nt / 2][2 * (nt & 1)];
            *reinterpret_cast<uint32_t*>(at + 8 * 128) = dsa[nt / 2][2 * (nt & 1) + 1];
        }

        wg_rs_chain<D, BM>(dv_acc, pa, dos);  // dV += P^T dO
        wg_rs_chain<D, BM>(dk_acc, dsa, qs);  // dK += dS^T Q

        wg_fence_proxy_async();     // this thread's dS^T stores, before the tensor cores read them ...
        named_barrier(1, 256);   // ... and both consumers' halves stored
        float dq[8][4];             // this consumer's 64 x 64 share of dQ (unscaled)
        const uint32_t a_base = attn_smem_u32(dS) + (BM == 128 ? cw : 0) * BN * 128;
        const uint32_t b_base = attn_smem_u32(Ks) + (BM == 64 ? cw : 0) * BN * 128;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            if (kk == 0) wg_mma_ss<64, 0, 1, 1>(dq, wg_desc(a_base), wg_desc(b_base));
            else wg_mma_ss<64, 1, 1, 1>(dq, wg_desc(a_base + kk * 16 * 128), wg_desc(b_base + kk * 16 * 128));
        }
        wg_commit();
        wg_wait<0>();
        wg_fence_regs(dv_acc);
        wg_fence_regs(dk_acc);
        wg_fence_regs(dq);
        if (lane == 0) mbar_arrive(empty + 8 * st);  // Q, dO, lse2, delta of this stage are free

        if (it >= 1) mbar_wait(dq_empty, (it - 1) & 1);  // the writer has read the previous share
        float4* stage = reinterpret_cast<float4*>(dQs) + cw * 8 * 128 + ct;
#pragma unroll
        for (int j = 0; j < 8; ++j) stage[j * 128] = make_float4(dq[j][0], dq[j][1], dq[j][2], dq[j][3]);
        wg_fence_proxy_async();
        __syncwarp();
        if (lane == 0) mbar_arrive(dq_full);
    }
    // dK and dV of the consumer's 64 keys, staged where its keys' K and V rows lie, once both
    // consumers' last products (which read all of K) are done, and stored by TMA
    named_barrier(1, 256);
    unsigned char *k_rows = reinterpret_cast<unsigned char*>(Ks) + cw * 64 * 128,
                  *v_rows = reinterpret_cast<unsigned char*>(Vs) + cw * 64 * 128;
    attn_stage_store<D>(k_rows, BN * 128, &tm_dk, dk_acc, scale, scale, hk * D, n0 + cw * 64, b, 2 + cw);
    attn_stage_store<D>(v_rows, BN * 128, &tm_dv, dv_acc, 1.f, 1.f, hk * D, n0 + cw * 64, b, 2 + cw);
    if (ct == 0) bulk_wait<false>();  // the copies done before the block's shared memory goes
}

// The backward's query tile (rows of dQ a block accumulates): 64 at D = 128, 128 at D = 64; and
// how many a head has: its rows padded to Tp, T rounded up to 128 (the scratch's layout, below).
static __host__ __device__ constexpr int attn_bwd_query_tile(int D) { return D == 128 ? 64 : 128; }
static int attn_bwd_padded_T(int T) { return ceil_div(T, 128) * 128; }
static int attn_bwd_query_tiles(int T, int D) { return attn_bwd_padded_T(T) / attn_bwd_query_tile(D); }
constexpr int ATTN_DQ_PITCH_PAD = 8;  // bf16 after each row of a dQ tile in shared memory

// Query tile m of head bh = b*Hq + h of the accumulated dQ, from ws_backward_kernel's fragment
// order into shared memory as rows: tile[r * (D + 8) + c] = scale * dQ[row m*BM + r][c], rounded
// to bf16, by a block of 256 threads: thread (c, i) reads consumer c's thread i's 8 float4 (as they
// were stored: coalesced) and puts them in their places; the caller syncs before reading. A row is
// padded by 16 bytes, so the fragment writes, 8 rows by 4 pairs a warp, fall in 32 different banks.
template <int D, int BM>
static __device__ __forceinline__ void attn_dq_tile_load(bf16* tile, const float* __restrict__ dq_acc, int bh, int m,
                                                         int Tp, float scale) {
    constexpr int PITCH = D + ATTN_DQ_PITCH_PAD;
    const int cw = threadIdx.x >> 7, ct = threadIdx.x & 127, lane = ct & 31, w = ct >> 5;
    const float4* src = reinterpret_cast<const float4*>(dq_acc + ((long)bh * (Tp / BM) + m) * BM * D) + cw * 8 * 128 + ct;
    const int r0 = (BM == 128 ? 64 * cw : 0) + 16 * w + (lane >> 2);  // the tile's row and column of this thread
    const int c0 = (BM == 64 ? 64 * cw : 0) + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float4 x = src[j * 128];
        *reinterpret_cast<uint32_t*>(tile + r0 * PITCH + c0 + 8 * j) = attn_pack_bf16(x.x * scale, x.y * scale);
        *reinterpret_cast<uint32_t*>(tile + (r0 + 8) * PITCH + c0 + 8 * j) = attn_pack_bf16(x.z * scale, x.w * scale);
    }
}

// dq[b, t, h, :] = scale * the accumulated dQ: one block of 256 threads per (query tile, b*Hq + h)
// loads the tile (attn_dq_tile_load), then writes its rows out 16 bytes a thread. (Written straight
// from the fragments, 4 bytes at a time across 8 rows, the stores ran at about 1.6 TB/s.)
template <int D, int BM>
__global__ void __launch_bounds__(256)
    ws_dq_convert_kernel(bf16* __restrict__ dq, const float* __restrict__ dq_acc, int dstride, int T, int Tp, int Hq,
                         float scale) {
    constexpr int PITCH = D + ATTN_DQ_PITCH_PAD;
    __shared__ __align__(16) bf16 tile[BM * PITCH];
    const int m = blockIdx.x, bh = blockIdx.y, b = bh / Hq, h = bh % Hq;
    attn_dq_tile_load<D, BM>(tile, dq_acc, bh, m, Tp, scale);
    __syncthreads();
    bf16* out = dq + (long)b * T * dstride + h * D;
    for (int at = threadIdx.x; at < BM * D / 8; at += 256) {
        const int r = at / (D / 8), chunk = at % (D / 8), row = m * BM + r;
        if (row < T)
            *reinterpret_cast<uint4*>(out + (long)row * dstride + 8 * chunk) =
                *reinterpret_cast<const uint4*>(tile + r * PITCH + 8 * chunk);
    }
}

// Where the dQ accumulators lie in the backward's scratch (after lse2 and delta): for
// ws_backward_launch, and for attn_dq_tile_load once attention_backward has run with dq NULL.
static float* attn_dq_acc(float* scratch, int B, int T, int Hq) {
    return scratch + 2 * (size_t)B * Hq * attn_bwd_padded_T(T);
}

// Scratch of the backward, bytes: lse2 and delta [B*Hq][Tp]; the dQ accumulators (fp32), one BM x D
// block per (b*Hq + h, query tile) in ws_backward_kernel's fragment order; a semaphore per such block
// (int, at most Tp/64 per head); Tp = T rounded up to 128.
static size_t attention_backward_scratch_bytes(int B, int T, int Hq, int D) {
    const size_t rows = (size_t)B * Hq * attn_bwd_padded_T(T);
    return rows * (2 + D) * sizeof(float) + rows / 64 * sizeof(int);
}

// The Q and dO a group of the backward's block order reads, MiB: 8 and 24 lost to 16 in the ladder
// (doc/attention.md, "The backward's block order").
constexpr double ATTN_BWD_GROUP_MIB = 16.0;

template <int D, int BM, bool DET>
static void ws_backward_launch(bf16* dq, bf16* dk, bf16* dv, float* scratch, const bf16* dout, const bf16* out,
                               const float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int dstride,
                               int B, int T, int Hq, int Hkv, cudaStream_t stream) {
    const int Tp = attn_bwd_padded_T(T);
    const size_t rows = (size_t)B * Hq * Tp;
    float* lse2 = scratch;
    float* delta = lse2 + rows;
    float* dq_acc = attn_dq_acc(scratch, B, T, Hq);  // after delta
    int* dq_sem = reinterpret_cast<int*>(dq_acc + rows * D);
    attn_delta_launch(delta, lse2, lse, dout, out, B, T, Tp, Hq, D, stream);
    if (DET) CUDA_CHECK(cudaMemsetAsync(dq_sem, 0, rows / BM * sizeof(int), stream));
    else CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, rows * D * sizeof(float), stream));

    auto kernel = ws_backward_kernel<D, BM, DET>;
    const int smem = (2 * 128 + 4 * BM) * D * (int)sizeof(bf16) + 2 * 128 * BM * (int)sizeof(bf16) +
                     (BM * D + 4 * BM) * (int)sizeof(float) + 7 * 8;
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const CUtensorMap tq = tma_tensor_map(q, Hq * D, stride, T, B, BM);
    const CUtensorMap tk = tma_tensor_map(k, Hkv * D, stride, T, B, 128);
    const CUtensorMap tv = tma_tensor_map(v, Hkv * D, stride, T, B, 128);
    const CUtensorMap tdo = tma_tensor_map(dout, Hq * D, Hq * D, T, B, BM);
    const CUtensorMap tdk = tma_tensor_map(dk, Hkv * D, dstride, T, B, 64);
    const CUtensorMap tdv = tma_tensor_map(dv, Hkv * D, dstride, T, B, 64);
    const float scale = 1.f / sqrtf((float)D);
    // a group of the block order: the (b, KV head)s whose G query heads' Q and dO fit in
    // ATTN_BWD_GROUP_MIB (ws_backward_kernel, "The order of the work")
    const int group = attn_group_heads(ATTN_BWD_GROUP_MIB, 4.0 * (Hq / Hkv) * T * D, B * Hkv);
    kernel<<<ceil_div(T, 128) * B * Hkv, 384, smem, stream>>>(tq, tk, tv, tdo, tdk, tdv, dq_acc, dq_sem, lse2, delta,
                                                              T, Tp, Hq, Hkv, group, scale, scale * ATTN_LOG2E);
    CUDA_CHECK(cudaGetLastError());
    if (!dq) return;  // dQ stays in the accumulators (attn_dq_tile_load)
    ws_dq_convert_kernel<D, BM><<<dim3(Tp / BM, B * Hq), 256, 0, stream>>>(dq, dq_acc, dstride, T, Tp, Hq, scale);
    CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// The entry points. Tiles, the best of those timed by `./dev/attention tune` on an H100 (doc/attention.md):
//   forward: 128 queries x 128 keys, 2 consumers; at D = 64 and T > 1024, 192 x 128, 3 consumers.
//   backward: 128 keys x 64 queries at D = 128, 128 x 128 at D = 64.
// codes (null: none): also out's E4M3 codes [B, T, Hq, D], one byte an element, at codes_scale's
// scale, and out's amax raised into codes_scale->amax (FP8 training's fused path: the attention
// output's product then reads these codes, and no cast reads out back; doc/fp8.md).
static void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                              int B, int T, int Hq, int Hkv, int D, cudaStream_t stream, uint8_t* codes = nullptr,
                              Fp8Scale* codes_scale = nullptr) {
    const void* ptrs[] = {out, q, k, v, codes};
    attn_check_args("attention_forward", ptrs, 5, qkv_stride, B, T, Hq, Hkv, D);
    if (codes && !codes_scale) {
        fprintf(stderr, "attention_forward: FP8 codes asked for without their scale\n");
        exit(1);
    }
    if (D == 128) ws_forward_launch<128, 128, 2>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream, codes, codes_scale);
    else if (T <= 1024)
        ws_forward_launch<64, 128, 2>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream, codes, codes_scale);
    else ws_forward_launch<64, 128, 3>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream, codes, codes_scale);
}

// scratch: attention_backward_scratch_bytes(B, T, Hq, D) bytes, 16-byte aligned, contents ignored.
// dq NULL: dQ is left in the scratch's fp32 accumulators, for attn_dq_tile_load to read (until the
// scratch is used again), not converted into bf16 rows. deterministic = false adds the dQ partial
// sums in whatever order they come (fp32 atomics in L2): results then vary in the last bits run to
// run; it is faster only at long T (doc/attention.md).
static void attention_backward(bf16* dq, bf16* dk, bf16* dv, float* scratch, const bf16* dout, const bf16* out,
                               const float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                               int dqkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream,
                               bool deterministic = true) {
    const void* ptrs[] = {dq, dk, dv, dout, out, q, k, v, scratch};
    attn_check_args("attention_backward", ptrs, 9, qkv_stride, B, T, Hq, Hkv, D);
    if (dqkv_stride % 8 != 0 || dqkv_stride < Hq * D) {
        fprintf(stderr, "attention_backward: dqkv_stride %d must be a multiple of 8 and at least Hq*D = %d\n",
                dqkv_stride, Hq * D);
        exit(1);
    }
    constexpr int BM64 = attn_bwd_query_tile(64), BM128 = attn_bwd_query_tile(128);
    if (D == 64 && deterministic)
        ws_backward_launch<64, BM64, true>(dq, dk, dv, scratch, dout, out, lse, q, k, v, qkv_stride, dqkv_stride, B, T,
                                           Hq, Hkv, stream);
    else if (D == 64)
        ws_backward_launch<64, BM64, false>(dq, dk, dv, scratch, dout, out, lse, q, k, v, qkv_stride, dqkv_stride, B, T,
                                            Hq, Hkv, stream);
    else if (deterministic)
        ws_backward_launch<128, BM128, true>(dq, dk, dv, scratch, dout, out, lse, q, k, v, qkv_stride, dqkv_stride, B,
                                             T, Hq, Hkv, stream);
    else
        ws_backward_launch<128, BM128, false>(dq, dk, dv, scratch, dout, out, lse, q, k, v, qkv_stride, dqkv_stride, B,
                                              T, Hq, Hkv, stream);
}

#endif
