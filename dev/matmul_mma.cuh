/*
 * dev/matmul_mma.cuh - version 2 of the matmul ladder: the tiled GEMM of the FlashAttention-2 era
 * (sm_80 instructions, built for sm_90a): mma.sync.m16n8k16 on the tensor cores, fragments loaded
 * by ldmatrix, tiles brought in by cp.async through a multi-stage shared-memory ring.
 *
 * Work split: one block of 8 warps per 128 x 128 output tile; warp w owns the 64 x 32 piece at rows
 * 64 (w / 4), columns 32 (w % 4): 4 m16 tiles x 4 n8 tiles, 64 fp32 accumulators a thread. The k
 * dimension goes by blocks of 64 through a 3-stage ring: while the warps multiply k-block j, the
 * copies of j+1 and j+2 are in flight. Shared memory: 3 x (16 + 16) KiB = 96 KiB.
 *
 * Tiles keep the operand's global orientation, so that every cp.async moves 16 contiguous bytes:
 * A is [128 m][64 k] when K-major, [64 k][128 m] when M-major; B is [128 n][64 k] or [64 k][128 n].
 * Rows are 128 or 256 bytes, chunk c of row r stored at c ^ (r & 7) (fa2_swz), so the 8 rows one
 * ldmatrix phase reads hit 8 different bank groups. A K-major operand is read by ldmatrix, an
 * MN-major one by ldmatrix.trans, which hands each lane the same fragment from the transposed
 * tile. The warp-level helpers (ldmatrix, mma, cp.async, the swizzle and each lane's ldmatrix row)
 * are version 2 of the attention ladder's (dev/attention_fa2.cuh), reused as they are.
 *
 * Shapes: M, N, K multiples of 8 (mm_tiled_shape_problem); edge tiles are zero-filled on load
 * (cp.async with a source size of 0) and masked on store.
 */
#ifndef DEV_MATMUL_MMA_CUH
#define DEV_MATMUL_MMA_CUH

#include "attention_fa2.cuh"
#include "matmul_common.cuh"

constexpr int MMA_BM = 128, MMA_BN = 128, MMA_BK = 64, MMA_STAGES = 3, MMA_THREADS = 256;
constexpr int MMA_TILE_BYTES = MMA_BM * MMA_BK * 2;  // one operand's tile, A's or B's (BM = BN)
constexpr int MMA_SMEM_BYTES = MMA_STAGES * 2 * MMA_TILE_BYTES;

// Copies rows r0 .. r0+ROWS-1, columns c0 .. c0+COLS-1 of a row-major [rows][cols] matrix into a
// swizzled [ROWS][COLS] tile at shared address `tile`; chunks past the matrix's edge land as zeros
// (cols is a multiple of 8, so a 16-byte chunk is wholly inside or outside). Thread i copies chunk
// i % (COLS/8) of rows i / (COLS/8) + RSTEP*j: the row step is a multiple of 8, so the swizzle of
// a thread's chunks is the same for every j.
template <int ROWS, int COLS>
static __device__ __forceinline__ void mma_load_tile(uint32_t tile, const bf16* g, int rows, int cols, int r0,
                                                     int c0) {
    constexpr int CHUNKS = COLS / 8, RSTEP = MMA_THREADS / CHUNKS;
    static_assert(RSTEP % 8 == 0 && ROWS % RSTEP == 0, "tile rows must split evenly over the threads");
    const int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    const bool col_in = c0 + 8 * c < cols;
    const uint32_t dst = tile + 2 * fa2_swz<COLS>(r, 8 * c);
#pragma unroll
    for (int j = 0; j < ROWS / RSTEP; ++j) {
        const int row = r0 + r + j * RSTEP;
        const bool in = col_in && row < rows;
        attn_cp_async16(dst + j * RSTEP * COLS * 2, in ? g + (long)row * cols + c0 + 8 * c : g, in);
    }
}

template <bool A_K, bool B_K, typename OutT>
__global__ void __launch_bounds__(MMA_THREADS, 2) mma_matmul_kernel(OutT* __restrict__ c, const bf16* __restrict__ a,
                                                                 const bf16* __restrict__ b, int M, int N, int K) {
    extern __shared__ __align__(1024) unsigned char mma_smem[];
    const uint32_t a_tiles = attn_smem_u32(mma_smem), b_tiles = a_tiles + MMA_STAGES * MMA_TILE_BYTES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
    const int m0 = blockIdx.y * MMA_BM, n0 = blockIdx.x * MMA_BN, k_blocks = (K + MMA_BK - 1) / MMA_BK;

    auto load_stage = [&](int kb) {
        const uint32_t at = a_tiles + (kb % MMA_STAGES) * MMA_TILE_BYTES;
        const uint32_t bt = b_tiles + (kb % MMA_STAGES) * MMA_TILE_BYTES;
        const int k0 = kb * MMA_BK;
        if constexpr (A_K) mma_load_tile<MMA_BM, MMA_BK>(at, a, M, K, m0, k0);
        else mma_load_tile<MMA_BK, MMA_BM>(at, a, K, M, k0, m0);
        if constexpr (B_K) mma_load_tile<MMA_BN, MMA_BK>(bt, b, N, K, n0, k0);
        else mma_load_tile<MMA_BK, MMA_BN>(bt, b, K, N, k0, n0);
    };

    // This lane's ldmatrix byte offset in a stage's tile for the warp's first m16 tile (A) or
    // first pair of n8 tiles (B) at k = 0. The other tiles and k-steps are a XOR on the chunk field
    // (bits 4-6; see fa2_lane_a) or a whole number of rows away:
    //   A K-major [128 m][64 k], 128-byte rows: m16 tile mt +16 rows, k-step kk ^ (2 kk chunks)
    //   A M-major [64 k][128 m], 256-byte rows: m16 tile mt ^ (2 mt chunks), k-step +16 rows
    //   B K-major [128 n][64 k]: n16 pair np +16 rows, k-step ^ (2 kk chunks)
    //   B N-major [64 k][128 n]: n16 pair np ^ (2 np chunks), k-step +16 rows
    // The warp's own offset: 64 rows (A K-major) or 64 columns, 128 bytes (A M-major); 32 rows (B
    // K-major) or 32 columns (B N-major: 4 chunks, split into a XOR on chunk bit 2 and whole 8-chunk
    // halves of the 256-byte row).
    const uint32_t a_lane = A_K ? wm * 64 * 128 + fa2_lane_a<64>(lane) : wm * 128 + fa2_lane_b<128>(lane);
    const uint32_t b_lane = B_K ? wn * 32 * 128 + fa2_lane_b<64>(lane)
                                : (wn >> 1) * 128 + (fa2_lane_bt<128>(lane) ^ ((wn & 1) << 6));

    float acc[4][4][4] = {};  // [m16 tile][n8 tile][fragment]
#pragma unroll
    for (int s = 0; s < MMA_STAGES - 1; ++s) {
        if (s < k_blocks) load_stage(s);
        attn_cp_async_commit();  // one group per stage, empty or not, so the count below holds
    }
    for (int kb = 0; kb < k_blocks; ++kb) {
        // Groups committed so far: kb + STAGES - 1; at most STAGES - 2 pending means k-block kb has
        // landed (for this thread; the barrier makes it so for all, and it also says every warp
        // is done with k-block kb-1, whose stage the next copy overwrites).
        attn_cp_async_wait<MMA_STAGES - 2>();
        __syncthreads();
        if (kb + MMA_STAGES - 1 < k_blocks) load_stage(kb + MMA_STAGES - 1);
        attn_cp_async_commit();

        const uint32_t as = a_tiles + (kb % MMA_STAGES) * MMA_TILE_BYTES;
        const uint32_t bs = b_tiles + (kb % MMA_STAGES) * MMA_TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < MMA_BK / 16; ++kk) {
            uint32_t af[4][4];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                if constexpr (A_K) fa2_ldmatrix_x4(af[mt], as + (a_lane ^ (kk << 5)) + mt * 16 * 128);
                else fa2_ldmatrix_x4_trans(af[mt], as + (a_lane ^ (mt << 5)) + kk * 16 * 256);
            }
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                uint32_t bf[4];  // n8 tile 2np: bf[0], bf[1]; n8 tile 2np+1: bf[2], bf[3]
                if constexpr (B_K) fa2_ldmatrix_x4(bf, bs + (b_lane ^ (kk << 5)) + np * 16 * 128);
                else fa2_ldmatrix_x4_trans(bf, bs + (b_lane ^ (np << 5)) + kk * 16 * 256);
#pragma unroll
                for (int mt = 0; mt < 4; ++mt) {
                    fa2_mma(acc[mt][2 * np], af[mt], bf[0], bf[1]);
                    fa2_mma(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
                }
            }
        }
    }
    attn_cp_async_wait<0>();  // only empty groups can be pending; leave none behind

    // The accumulator layout of mma.m16n8: lane 4g + i holds rows g and g + 8, columns 2i, 2i + 1.
    const int g = lane >> 2, i = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int row = m0 + wm * 64 + mt * 16 + g, col = n0 + wn * 32 + nt * 8 + 2 * i;
            if (col >= N) continue;
            if (row < M) mm_store_pair(c, (long)row * N + col, acc[mt][nt][0], acc[mt][nt][1]);
            if (row + 8 < M) mm_store_pair(c, (long)(row + 8) * N + col, acc[mt][nt][2], acc[mt][nt][3]);
        }
}

struct MmaMatmul {
    template <bool A_K, bool B_K, typename OutT>
    static void gemm(OutT* c, const bf16* a, const bf16* b, int M, int N, int K, cudaStream_t s) {
        attn_allow_smem(mma_matmul_kernel<A_K, B_K, OutT>, MMA_SMEM_BYTES);
        const dim3 grid(ceil_div(N, MMA_BN), ceil_div(M, MMA_BM));
        mma_matmul_kernel<A_K, B_K><<<grid, MMA_THREADS, MMA_SMEM_BYTES, s>>>(c, a, b, M, N, K);
        LAUNCH_CHECK();
    }
};

#endif
