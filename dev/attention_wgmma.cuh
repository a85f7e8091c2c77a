/*
 * dev/attention_wgmma.cuh - version 3 of the attention ladder, first step: version 2's algorithm
 * (attention_fa2.cuh, whose helpers this file uses; include it first) on Hopper's warpgroup matrix
 * instructions (wgmma, sm_90a). A block is two warpgroups (256 threads); each warpgroup owns 64 rows
 * of every accumulator (query rows in the forward and dQ kernels, key rows in the dK/dV kernel).
 * Products whose operands both sit in shared memory (S = Q K^T, dP = dO V^T and their transposes)
 * are one chain of wgmma.m64nNk16 reading the tiles directly (no ldmatrix); products with P or dS
 * on the left take them from registers (the accumulator layout is the A-operand layout, as with
 * mma.sync) and read the right operand MN-major ("transposed") from shared memory. Tiles are
 * double-buffered and loaded by cp.async from all threads, as in version 2. Not yet here (the next
 * rungs): TMA loads on mbarriers, producer/consumer warp specialization, softmax overlapped with the
 * next tile's products. Same API as version 2: attention_forward_wgmma, attention_backward_wgmma.
 *
 * Shared-memory layout is the one wgmma's 128-byte swizzle expects: a [R][D] tile is D/64 panels of
 * [R][64] (128-byte rows); 16-byte chunk c of row r of a panel sits at chunk c ^ (r & 7), with each
 * panel 1024-byte aligned. A K-major descriptor advances 32 bytes per 16-element k-step inside a
 * panel; an MN-major one advances 16 rows (2048 bytes) per step, and each of those wgmma covers one
 * 64-column panel of its output, so the leading-byte offset never comes into play.
 *
 * Measured (H100 SXM, B*T = 16K tokens, causal FLOPs counted once; doc/attention.md): D=128,
 * T = 512/1024/2048/4096: forward 209/289/358/419 TFLOP/s, backward 164/217/266/287 (version 2:
 * 198/251/290/323 and 141/172/197/205); D=64: forward 200/257/300/325, backward 148/194/228/252.
 * Same errors as version 2 (rel-L2 <= 3.5e-3), the backward as deterministic.
 */


// ----------------------------------------------------------------------------------------------
// wgmma wrappers. Each warpgroup-wide instruction is issued by all 128 threads of a warpgroup.

static __device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's earlier generic-proxy shared-memory writes (cp.async data once waited for)
// before later async-proxy reads (wgmma operands); a barrier must follow.
static __device__ __forceinline__ void wg_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accumulator registers across a wgmma issue or wait.
template <int N>
static __device__ __forceinline__ void wg_fence_regs(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading-byte offset (unused
// here: 16 bytes), stride-byte offset 1024 (eight 128-byte rows), base offset 0.
static __device__ __forceinline__ uint64_t wg_desc(uint32_t smem_addr) {
    uint64_t d = 0;
    d |= (uint64_t)((smem_addr & 0x3FFFF) >> 4);
    d |= (uint64_t)1 << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}

// d[N/8][4] (+)= A (64 x 16, shared, K-major) * B (N rows x 16, shared, K-major)^T; SCALE_D = 0
// overwrites d. Accumulator layout per warp w of the warpgroup: rows 16w + g and 16w + g + 8,
// columns 8j + 2i, 8j + 2i + 1 in d[j] (lane = 4g + i), the mma.m16n8 layout repeated.
template <int SCALE_D>
static __device__ __forceinline__ void wg_mma_ss_n32(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D));
}

template <int SCALE_D>
static __device__ __forceinline__ void wg_mma_ss_n64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D));
}

template <int SCALE_D>
static __device__ __forceinline__ void wg_mma_ss_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D));
}

// The SS product for N in {32, 64, 128}.
template <int N, int SCALE_D>
static __device__ __forceinline__ void wg_mma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (N == 32) wg_mma_ss_n32<SCALE_D>(d, desc_a, desc_b);
    else if constexpr (N == 64) wg_mma_ss_n64<SCALE_D>(d, desc_a, desc_b);
    else wg_mma_ss_n128<SCALE_D>(d, desc_a, desc_b);
}

// d[OFF .. OFF+7][4] += A (64 x 16 bf16 in registers, the mma.m16n8k16 A layout per warp) *
// B (16 x 64, shared, MN-major: each k row holds 64 contiguous columns, hence trans-b = 1).
template <int OFF, int N8>
static __device__ __forceinline__ void wg_mma_rs_n64_tb(float (&d)[N8][4], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[OFF + 0][0]), "+f"(d[OFF + 0][1]), "+f"(d[OFF + 0][2]), "+f"(d[OFF + 0][3]),
          "+f"(d[OFF + 1][0]), "+f"(d[OFF + 1][1]), "+f"(d[OFF + 1][2]), "+f"(d[OFF + 1][3]),
          "+f"(d[OFF + 2][0]), "+f"(d[OFF + 2][1]), "+f"(d[OFF + 2][2]), "+f"(d[OFF + 2][3]),
          "+f"(d[OFF + 3][0]), "+f"(d[OFF + 3][1]), "+f"(d[OFF + 3][2]), "+f"(d[OFF + 3][3]),
          "+f"(d[OFF + 4][0]), "+f"(d[OFF + 4][1]), "+f"(d[OFF + 4][2]), "+f"(d[OFF + 4][3]),
          "+f"(d[OFF + 5][0]), "+f"(d[OFF + 5][1]), "+f"(d[OFF + 5][2]), "+f"(d[OFF + 5][3]),
          "+f"(d[OFF + 6][0]), "+f"(d[OFF + 6][1]), "+f"(d[OFF + 6][2]), "+f"(d[OFF + 6][3]),
          "+f"(d[OFF + 7][0]), "+f"(d[OFF + 7][1]), "+f"(d[OFF + 7][2]), "+f"(d[OFF + 7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}

// ----------------------------------------------------------------------------------------------
// Tile loads into the panel layout: thread i copies chunk i % (D/8) of rows i / (D/8) + n*RSTEP.

template <int D, int ROWS, int THREADS>
static __device__ __forceinline__ void wg_load_tile(bf16* tile, const bf16* g, long stride, int row0, int T) {
    constexpr int CHUNKS = D / 8, RSTEP = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && RSTEP % 8 == 0 && ROWS % RSTEP == 0, "tile rows must split evenly");
    const int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    const uint32_t dst = fa2_smem_u32(tile) + (c / 8) * ROWS * 128 + r * 128 + (((c % 8) ^ (r & 7)) << 4);
    const bf16* src = g + (long)(row0 + r) * stride + c * 8;
#pragma unroll
    for (int it = 0; it < ROWS / RSTEP; ++it) {
        const bool in = row0 + r + it * RSTEP < T;
        fa2_cp_async16(dst + it * RSTEP * 128, in ? src : g, in);
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
    extern __shared__ __align__(1024) unsigned char fa2_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(fa2_smem);
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
    fa2_zero(o[0]);
    row_max[0][0] = row_max[0][1] = -INFINITY;
    row_sum[0][0] = row_sum[0][1] = 0.f;

    wg_load_tile<D, BM, THREADS>(Qs, qg, stride, m0, T);
    wg_load_tile<D, BN, THREADS>(Ks, kg, stride, (n_tiles - 1) * BN, T);
    wg_load_tile<D, BN, THREADS>(Vs, vg, stride, (n_tiles - 1) * BN, T);
    fa2_cp_async_commit();

    for (int j = n_tiles - 1; j >= 0; --j) {
        const int n0 = j * BN, buf = (n_tiles - 1 - j) & 1;
        fa2_cp_async_wait<0>();  // tile j (and Q) landed ...
        wg_fence_proxy_async();  // ... is ordered before the tensor cores' reads ...
        __syncthreads();         // ... of every thread; every warp is done with tile j+1's buffer
        if (j > 0) {
            wg_load_tile<D, BN, THREADS>(Ks + (buf ^ 1) * BN * D, kg, stride, n0 - BN, T);
            wg_load_tile<D, BN, THREADS>(Vs + (buf ^ 1) * BN * D, vg, stride, n0 - BN, T);
            fa2_cp_async_commit();
        }
        if (n0 > m0 + wg * 64 + 63) continue;  // no key of the tile is visible to this warpgroup

        const uint32_t qs = fa2_smem_u32(Qs) + wg * 64 * 128;
        const uint32_t ks = fa2_smem_u32(Ks + buf * BN * D), vs = fa2_smem_u32(Vs + buf * BN * D);
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
        fa2_fwd_softmax<D, 1, NT>(o, s, row_max, row_sum, scale_log2);

        uint32_t pa[BN / 16][4];  // P in bf16, packed before the chain so no wgmma waits on a register write
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            pa[kk][0] = fa2_pack_bf16(s[0][2 * kk][0], s[0][2 * kk][1]);
            pa[kk][1] = fa2_pack_bf16(s[0][2 * kk][2], s[0][2 * kk][3]);
            pa[kk][2] = fa2_pack_bf16(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
            pa[kk][3] = fa2_pack_bf16(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
        }
        wg_fence_regs(o[0]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            wg_mma_rs_n64_tb<0, DT>(o[0], pa[kk], wg_desc(vs + kk * 16 * 128));
            if constexpr (D == 128) wg_mma_rs_n64_tb<8, DT>(o[0], pa[kk], wg_desc(vs + BN * 128 + kk * 16 * 128));
        }
        wg_commit();
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
        if (t < T && (lane & 3) == 0) lse[((long)b * Hq + h) * T + t] = (row_max[0][r] + __log2f(l)) * 0.69314718056f;
    }
    fa2_store_rows<D>(out + (long)b * T * Hq * D + h * D, (long)Hq * D, m0 + wrow, T, o[0], inv[0], inv[1], lane);
}

template <int D, int BN>
static void wg_forward_launch(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int B,
                              int T, int Hq, int Hkv, cudaStream_t stream) {
    auto kernel = wg_forward_kernel<D, BN>;
    const int smem = (128 + 4 * BN) * D * (int)sizeof(bf16);
    static bool configured = false;
    if (!configured) { fa2_allow_smem(kernel, smem); configured = true; }
    kernel<<<dim3(ceil_div(T, 128), B * Hq), 256, smem, stream>>>(out, lse, q, k, v, stride, T, Hq, Hkv,
                                                                    1.44269504089f / sqrtf((float)D));
    CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// Backward on wgmma: version 2's two deterministic kernels (same math, same per-element code; see
// the Backward comment in attention_fa2.cuh) with every product a warpgroup chain.
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
    extern __shared__ __align__(1024) unsigned char fa2_smem[];
    bf16* Ks = reinterpret_cast<bf16*>(fa2_smem);
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
            lse_s[buf * BM + i] = t < T ? lse_g[t] * 1.44269504089f : INFINITY;  // P = 0 past T
            dl_s[buf * BM + i] = t < T ? dl_g[t] : 0.f;
        }
    };
    load_query_tile(0, 0);
    fa2_cp_async_commit();

    float dk_acc[DT][4], dv_acc[DT][4];
    fa2_zero(dk_acc);
    fa2_zero(dv_acc);
    const uint32_t ks = fa2_smem_u32(Ks) + wg * 64 * 128, vs = fa2_smem_u32(Vs) + wg * 64 * 128;

    for (int it = 0; it < iters; ++it) {
        const int buf = it & 1;
        if (it + 1 < iters) {
            load_query_tile(it + 1, buf ^ 1);
            fa2_cp_async_commit();
            fa2_cp_async_wait<1>();
        } else {
            fa2_cp_async_wait<0>();
        }
        wg_fence_proxy_async();
        __syncthreads();
        const int m0 = (qt_first + it % per_head) * BM;
        if (m0 + BM - 1 >= n0 + wg * 64) {  // some query of the tile sees some key of this warpgroup
            const uint32_t qs = fa2_smem_u32(Qs + buf * BM * D), dos = fa2_smem_u32(dOs + buf * BM * D);
            const float* lse2 = lse_s + buf * BM;
            const float* dl = dl_s + buf * BM;
            const bool diag = m0 < n0 + wrow + 15;  // some query of the tile precedes some key of this warp

            float s[NT][4], dp[NT][4];  // S^T then P^T; dP^T then dS^T
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const uint32_t a_off = (kk / 4) * BN * 128 + (kk % 4) * 32, b_off = (kk / 4) * BM * 128 + (kk % 4) * 32;
                if (kk == 0) {
                    wg_mma_ss<BM, 0>(s, wg_desc(ks + a_off), wg_desc(qs + b_off));
                    wg_mma_ss<BM, 0>(dp, wg_desc(vs + a_off), wg_desc(dos + b_off));
                } else {
                    wg_mma_ss<BM, 1>(s, wg_desc(ks + a_off), wg_desc(qs + b_off));
                    wg_mma_ss<BM, 1>(dp, wg_desc(vs + a_off), wg_desc(dos + b_off));
                }
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(s);
            wg_fence_regs(dp);

            uint32_t pa[BM / 16][4], dsa[BM / 16][4];  // P^T and dS^T in bf16, A-operand layout
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int c = nt * 8 + 2 * (lane & 3);
                const float2 l2 = *reinterpret_cast<const float2*>(lse2 + c);
                const float2 d2 = *reinterpret_cast<const float2*>(dl + c);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float p = fa2_exp2(fmaf(s[nt][i], scale_log2, -((i & 1) ? l2.y : l2.x)));
                    if (diag && m0 + c + (i & 1) < n0 + wrow + (lane >> 2) + 8 * (i >> 1)) p = 0.f;
                    s[nt][i] = p;
                    dp[nt][i] = p * (dp[nt][i] - ((i & 1) ? d2.y : d2.x));
                }
            }
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                pa[kk][0] = fa2_pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                pa[kk][1] = fa2_pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                pa[kk][2] = fa2_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[kk][3] = fa2_pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                dsa[kk][0] = fa2_pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
                dsa[kk][1] = fa2_pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
                dsa[kk][2] = fa2_pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
                dsa[kk][3] = fa2_pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
            }
            wg_fence_regs(dv_acc);
            wg_fence_regs(dk_acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                wg_mma_rs_n64_tb<0, DT>(dv_acc, pa[kk], wg_desc(dos + kk * 16 * 128));
                wg_mma_rs_n64_tb<0, DT>(dk_acc, dsa[kk], wg_desc(qs + kk * 16 * 128));
                if constexpr (D == 128) {
                    wg_mma_rs_n64_tb<8, DT>(dv_acc, pa[kk], wg_desc(dos + BM * 128 + kk * 16 * 128));
                    wg_mma_rs_n64_tb<8, DT>(dk_acc, dsa[kk], wg_desc(qs + BM * 128 + kk * 16 * 128));
                }
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(dv_acc);
            wg_fence_regs(dk_acc);
        }
        __syncthreads();  // every warp is done with buffer buf before it is refilled
    }
    fa2_store_rows<D>(dk + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dk_acc, scale, scale, lane);
    fa2_store_rows<D>(dv + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dv_acc, 1.f, 1.f, lane);
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
    extern __shared__ __align__(1024) unsigned char fa2_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(fa2_smem);
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
    fa2_cp_async_commit();

    float lse2[2], dl[2];  // of rows g and g+8 of this warp
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int t = m0 + wrow + (lane >> 2) + 8 * r;
        lse2[r] = t < T ? lse[((long)b * Hq + h) * T + t] * 1.44269504089f : INFINITY;
        dl[r] = t < T ? delta[((long)b * Hq + h) * T + t] : 0.f;
    }
    float dq_acc[DT][4];
    fa2_zero(dq_acc);
    const uint32_t qs = fa2_smem_u32(Qs) + wg * 64 * 128, dos = fa2_smem_u32(dOs) + wg * 64 * 128;

    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1, n0 = j * BN;
        if (j + 1 < n_tiles) {
            wg_load_tile<D, BN, THREADS>(Ks + (buf ^ 1) * BN * D, kg, stride, n0 + BN, T);
            wg_load_tile<D, BN, THREADS>(Vs + (buf ^ 1) * BN * D, vg, stride, n0 + BN, T);
            fa2_cp_async_commit();
            fa2_cp_async_wait<1>();
        } else {
            fa2_cp_async_wait<0>();
        }
        wg_fence_proxy_async();
        __syncthreads();
        if (n0 <= m0 + wg * 64 + 63) {  // some key of the tile is visible to some query of this warpgroup
            const uint32_t ks = fa2_smem_u32(Ks + buf * BN * D), vs = fa2_smem_u32(Vs + buf * BN * D);
            const bool diag = n0 + BN - 1 > m0 + wrow;

            float s[NT][4], dp[NT][4];  // S then P; dP then dS
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const uint32_t a_off = (kk / 4) * BM * 128 + (kk % 4) * 32, b_off = (kk / 4) * BN * 128 + (kk % 4) * 32;
                if (kk == 0) {
                    wg_mma_ss<BN, 0>(s, wg_desc(qs + a_off), wg_desc(ks + b_off));
                    wg_mma_ss<BN, 0>(dp, wg_desc(dos + a_off), wg_desc(vs + b_off));
                } else {
                    wg_mma_ss<BN, 1>(s, wg_desc(qs + a_off), wg_desc(ks + b_off));
                    wg_mma_ss<BN, 1>(dp, wg_desc(dos + a_off), wg_desc(vs + b_off));
                }
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(s);
            wg_fence_regs(dp);

            uint32_t dsa[BN / 16][4];  // dS in bf16, A-operand layout
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float p = fa2_exp2(fmaf(s[nt][i], scale_log2, -lse2[i >> 1]));
                    if (diag && n0 + nt * 8 + 2 * (lane & 3) + (i & 1) > m0 + wrow + (lane >> 2) + 8 * (i >> 1)) p = 0.f;
                    dp[nt][i] = p * (dp[nt][i] - dl[i >> 1]);
                }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                dsa[kk][0] = fa2_pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
                dsa[kk][1] = fa2_pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
                dsa[kk][2] = fa2_pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
                dsa[kk][3] = fa2_pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
            }
            wg_fence_regs(dq_acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                wg_mma_rs_n64_tb<0, DT>(dq_acc, dsa[kk], wg_desc(ks + kk * 16 * 128));
                if constexpr (D == 128) wg_mma_rs_n64_tb<8, DT>(dq_acc, dsa[kk], wg_desc(ks + BN * 128 + kk * 16 * 128));
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(dq_acc);
        }
        __syncthreads();  // every warp is done with buffer buf before it is refilled
    }
    fa2_store_rows<D>(dq + (long)b * T * dstride + h * D, dstride, m0 + wrow, T, dq_acc, scale, scale, lane);
}

template <int D, int BM, int MINB = 1>
static void wg_backward_dkdv_launch(bf16* dk, bf16* dv, const bf16* dout, const float* lse, const float* delta,
                                    const bf16* q, const bf16* k, const bf16* v, int stride, int dstride, int B, int T,
                                    int Hq, int Hkv, cudaStream_t stream) {
    auto kernel = wg_backward_dkdv_kernel<D, BM, MINB>;
    const int smem = (2 * 128 + 4 * BM) * D * (int)sizeof(bf16) + 4 * BM * (int)sizeof(float);
    static bool configured = false;
    if (!configured) { fa2_allow_smem(kernel, smem); configured = true; }
    const float scale = 1.f / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, 128), B * Hkv), 256, smem, stream>>>(dk, dv, dout, lse, delta, q, k, v, stride, dstride,
                                                                     T, Hq, Hkv, scale, scale * 1.44269504089f);
    CUDA_CHECK(cudaGetLastError());
}

template <int D, int BN, int MINB = 1>
static void wg_backward_dq_launch(bf16* dq, const bf16* dout, const float* lse, const float* delta, const bf16* q,
                                  const bf16* k, const bf16* v, int stride, int dstride, int B, int T, int Hq, int Hkv,
                                  cudaStream_t stream) {
    auto kernel = wg_backward_dq_kernel<D, BN, MINB>;
    const int smem = (2 * 128 + 4 * BN) * D * (int)sizeof(bf16);
    static bool configured = false;
    if (!configured) { fa2_allow_smem(kernel, smem); configured = true; }
    const float scale = 1.f / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, 128), B * Hq), 256, smem, stream>>>(dq, dout, lse, delta, q, k, v, stride, dstride, T, Hq,
                                                                    Hkv, scale, scale * 1.44269504089f);
    CUDA_CHECK(cudaGetLastError());
}

// Version 3's entry points, with the API of attention_forward / attention_backward. Tiles, the best
// of those timed by `./dev/attention tune` on an H100 (doc/attention.md):
//   D = 128: forward 128 queries x 128 keys; dK/dV 128 keys x 64 queries; dQ 128 queries x 128 keys.
//   D = 64:  forward 128 x 64;               dK/dV 128 x 128;            dQ 128 x 64, 2 blocks/SM.
static void attention_forward_wgmma(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                                    int qkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {out, q, k, v};
    fa2_check_args("attention_forward_wgmma", ptrs, 4, qkv_stride, B, T, Hq, Hkv, D);
    if (D == 64) wg_forward_launch<64, 64>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
    else wg_forward_launch<128, 128>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
}

static void attention_backward_wgmma(bf16* dq, bf16* dk, bf16* dv, float* delta, const bf16* dout, const bf16* out,
                                     const float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                                     int dqkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {dq, dk, dv, dout, out, q, k, v};
    fa2_check_args("attention_backward_wgmma", ptrs, 8, qkv_stride, B, T, Hq, Hkv, D);
    if (dqkv_stride % 8 != 0 || dqkv_stride < Hq * D) {
        fprintf(stderr, "attention_backward_wgmma: dqkv_stride %d must be a multiple of 8 and at least Hq*D = %d\n",
                dqkv_stride, Hq * D);
        exit(1);
    }
    fa2_delta_launch(delta, dout, out, B, T, Hq, D, stream);
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
