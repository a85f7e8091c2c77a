/*
 * dev/matmul_wgmma.cuh - versions 3 and 4 of the matmul ladder: Hopper's GEMM. TMA loads into a
 * ring of shared-memory stages guarded by mbarriers, warpgroup matrix products (wgmma) reading both
 * operands from shared memory, a producer warpgroup and two consumer warpgroups. Version 3 runs
 * one block per output tile; version 4 is the same kernel on a persistent grid (one block per SM)
 * that walks the tiles in groups of tile rows, so that the operands of the tiles in flight stay in
 * L2 and the loads of a block's next tile overlap the epilogue of this one.
 *
 * Work split: a 128 x 256 output tile, k-blocks of 64, a 4-stage ring of A [128 x 64] and B
 * [256 x 64] tiles (4 x 48 KiB = 192 KiB of shared memory), 384 threads:
 *   warpgroup 0, the producer, shrinks to 40 registers; one thread waits for a free stage (its
 *     empty barrier), announces the bytes to come on the stage's full barrier and issues the TMA
 *     loads, k-block after k-block and tile after tile;
 *   warpgroups 1 and 2, the consumers, grow to 232 registers; consumer c owns rows 64c .. 64c+63
 *     of the tile (a 64 x 256 fp32 accumulator, 128 registers a thread). Per k-block it waits for
 *     the full barrier, issues 4 wgmma m64n256k16 (one per 16 k), commits them, waits for the
 *     previous k-block's group, and hands that stage back (one arrive per warp). At the end of a
 *     tile it stores the accumulator straight from registers (bf16, or fp32 added to C).
 * The stage and barrier phase of k-block t (counted over the block's whole walk) are t % 4 and
 * (t / 4) & 1 on both sides, so the ring runs on from one tile into the next.
 *
 * Shared-memory layouts (TMA writes them with the 128-byte swizzle, wgmma reads them through
 * descriptors; lib/ptx.cuh): a K-major operand tile is [rows][64 k], 128-byte rows, one TMA box; a
 * k-step of 16 advances the descriptor 32 bytes. An MN-major tile is 64-column panels [64 k][64 mn]
 * of 8 KiB, one box each: consumer c's A is panel c; B's four panels are one wgmma operand whose
 * descriptor's leading offset is the panel size; a k-step advances 16 rows, 2048 bytes. Boxes
 * that cross the matrix's edge are zero-filled by TMA (and still count their full bytes); panels
 * wholly past M or N are not loaded, and only feed rows or columns the epilogue does not store.
 *
 * No wait can hang: every mbarrier wait gives up after HOP_WAIT_TRIES tries of at most
 * HOP_WAIT_HINT_NS each (about a second; no legitimate wait here lasts a millisecond), raises
 * MM_TIMEOUT and returns.
 *
 * Shapes: M, N, K multiples of 8 (16-byte TMA row strides: mm_tiled_shape_problem).
 */
#ifndef DEV_MATMUL_WGMMA_CUH
#define DEV_MATMUL_WGMMA_CUH

#include "../lib/attention.cuh"  // tma_tensor_map (the encoded-map cache), attn_smem_u32, attn_allow_smem
#include "matmul_common.cuh"

constexpr int HOP_BM = 128, HOP_BN = 256, HOP_BK = 64, HOP_STAGES = 4, HOP_THREADS = 384;
constexpr int HOP_PANEL_BYTES = 64 * 64 * 2;         // one [64][64] bf16 panel
constexpr int HOP_A_BYTES = HOP_BM * HOP_BK * 2;       // 16 KiB: 2 panels
constexpr int HOP_B_BYTES = HOP_BN * HOP_BK * 2;       // 32 KiB: 4 panels
constexpr int HOP_SMEM_BYTES = HOP_STAGES * (HOP_A_BYTES + HOP_B_BYTES) + 2 * HOP_STAGES * 8;  // + the barriers
constexpr int HOP_PROD_REGS = 40, HOP_CONS_REGS = 232;  // 128 * 40 + 256 * 232 = 64512 <= 65536
constexpr int HOP_GROUP_M = 8;                          // version 4's tile rows per group
constexpr int HOP_WAIT_TRIES = 1 << 20, HOP_WAIT_HINT_NS = 1000;

// Tile t of the walk, as (tile row tm, tile column tn): groups of group_m tile rows, each group
// walked column by column (group_m = 1: row by row, in launch order). Consecutive tiles share B's
// column tile and, within a column, A's row tiles of one group, so a grid's worth of tiles in
// flight reads about group_m row tiles of A and grid/group_m column tiles of B.
static __host__ __device__ __forceinline__ void hopper_tile_of(int t, int tiles_m, int tiles_n, int group_m, int* tm,
                                                           int* tn) {
    const int per_group = group_m * tiles_n, first = t / per_group * group_m;
    const int rows = min(tiles_m - first, group_m), in_group = t % per_group;
    *tm = first + in_group % rows;
    *tn = in_group / rows;
}

// mbar wait that gives up: false (and MM_TIMEOUT raised) after HOP_WAIT_TRIES tries, or at once
// (within 1024 tries) when some other thread of the launch has given up already, so that a broken
// pipeline costs a launch about one bound, not one per wave of blocks.
static __device__ __forceinline__ bool hopper_wait(uint32_t bar, uint32_t parity) {
    for (int i = 0; i < HOP_WAIT_TRIES; ++i) {
        if (mbar_try_wait(bar, parity, HOP_WAIT_HINT_NS)) return true;
        if ((i & 1023) == 1023 && *(volatile int*)&mm_error != MM_OK) return false;
    }
    atomicExch(&mm_error, MM_TIMEOUT);
    return false;
}

template <bool A_K, bool B_K, typename OutT>
__global__ void __launch_bounds__(HOP_THREADS, 1)
    hopper_matmul_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                     OutT* __restrict__ c, int M, int N, int K, int group_m) {
    extern __shared__ __align__(1024) unsigned char hopper_smem[];
    const uint32_t a_tiles = attn_smem_u32(hopper_smem), b_tiles = a_tiles + HOP_STAGES * HOP_A_BYTES;
    const uint32_t full = b_tiles + HOP_STAGES * HOP_B_BYTES, empty = full + 8 * HOP_STAGES;  // 8 bytes each
    if (a_tiles % 1024 != 0) {  // the same for every thread: all leave
        if (threadIdx.x == 0) atomicExch(&mm_error, MM_MISALIGNED);
        return;
    }
    const int tiles_m = (M + HOP_BM - 1) / HOP_BM, tiles_n = (N + HOP_BN - 1) / HOP_BN, tiles = tiles_m * tiles_n;
    const int k_blocks = (K + HOP_BK - 1) / HOP_BK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;

    if (threadIdx.x == 0) {
        for (int s = 0; s < HOP_STAGES; ++s) {
            mbar_init(full + 8 * s, 1);   // the producer's arrive (with the expected bytes)
            mbar_init(empty + 8 * s, 8);  // one arrive per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer
        setmaxnreg_dec<HOP_PROD_REGS>();
        if (threadIdx.x == 0) {
            int t = 0;  // k-blocks loaded so far
            for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
                int tm, tn;
                hopper_tile_of(tile, tiles_m, tiles_n, group_m, &tm, &tn);
                const int m0 = tm * HOP_BM, n0 = tn * HOP_BN;
                const int a_panels = min(2, (M - m0 + 63) / 64), b_panels = min(4, (N - n0 + 63) / 64);
                const uint32_t bytes = (A_K ? HOP_A_BYTES : a_panels * HOP_PANEL_BYTES) +
                                       (B_K ? HOP_B_BYTES : b_panels * HOP_PANEL_BYTES);
                for (int kb = 0; kb < k_blocks; ++kb, ++t) {
                    const int st = t % HOP_STAGES, use = t / HOP_STAGES;
                    const uint32_t bar = full + 8 * st;
                    // the stage's previous use (k-block t - STAGES) is done once its phase use-1 completed
                    if (use > 0 && !hopper_wait(empty + 8 * st, (use - 1) & 1)) return;
                    mbar_expect_tx(bar, bytes);
                    const uint32_t as = a_tiles + st * HOP_A_BYTES, bs = b_tiles + st * HOP_B_BYTES;
                    const int k0 = kb * HOP_BK;
                    if constexpr (A_K) {
                        tma_load_3d(as, &tm_a, k0, m0, 0, bar);  // box {64 k, 128 m}
                    } else {
                        for (int p = 0; p < a_panels; ++p)  // boxes {64 m, 64 k}
                            tma_load_3d(as + p * HOP_PANEL_BYTES, &tm_a, m0 + 64 * p, k0, 0, bar);
                    }
                    if constexpr (B_K) {
                        tma_load_3d(bs, &tm_b, k0, n0, 0, bar);  // box {64 k, 256 n}
                    } else {
                        for (int p = 0; p < b_panels; ++p)  // boxes {64 n, 64 k}
                            tma_load_3d(bs + p * HOP_PANEL_BYTES, &tm_b, n0 + 64 * p, k0, 0, bar);
                    }
                }
            }
        }
        return;
    }

    // consumers
    setmaxnreg_inc<HOP_CONS_REGS>();
    const int cw = wg - 1;
    float acc[HOP_BN / 8][4];  // wgmma's accumulator layout (lib/ptx.cuh): d[j] holds columns 8j .. 8j+7
    int t = 0;                // k-blocks consumed so far
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int tm, tn;
        hopper_tile_of(tile, tiles_m, tiles_n, group_m, &tm, &tn);
        const int m0 = tm * HOP_BM, n0 = tn * HOP_BN;
#pragma unroll
        for (int j = 0; j < HOP_BN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
        for (int kb = 0; kb < k_blocks; ++kb, ++t) {
            const int st = t % HOP_STAGES;
            if (!hopper_wait(full + 8 * st, (t / HOP_STAGES) & 1)) {
                wg_wait<0>();  // leave no product in flight
                return;
            }
            const uint32_t as = a_tiles + st * HOP_A_BYTES + cw * (A_K ? 64 * 128 : HOP_PANEL_BYTES);
            const uint32_t bs = b_tiles + st * HOP_B_BYTES;
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < HOP_BK / 16; ++kk) {
                const uint64_t da = wg_desc(as + (A_K ? kk * 32 : kk * 16 * 128));
                const uint64_t db = B_K ? wg_desc(bs + kk * 32) : wg_desc(bs + kk * 16 * 128, HOP_PANEL_BYTES);
                wg_mma_ss<HOP_BN, 1, A_K ? 0 : 1, B_K ? 0 : 1>(acc, da, db);
            }
            wg_commit();
            wg_wait<1>();  // k-block kb-1's products are done: its stage can be refilled
            if (kb > 0 && lane == 0) mbar_arrive(empty + 8 * ((t - 1) % HOP_STAGES));
        }
        wg_wait<0>();
        wg_fence_regs(acc);
        if (k_blocks > 0 && lane == 0) mbar_arrive(empty + 8 * ((t - 1) % HOP_STAGES));

        // Epilogue: warp w of the consumer holds rows 16w + g and 16w + g + 8 of its 64, columns
        // 8j + 2i and 8j + 2i + 1 of d[j] (lane = 4g + i).
        const int row = m0 + cw * 64 + (warp & 3) * 16 + (lane >> 2), col0 = n0 + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < HOP_BN / 8; ++j) {
            const int col = col0 + 8 * j;
            if (col >= N) continue;
            if (row < M) mm_store_pair(c, (long)row * N + col, acc[j][0], acc[j][1]);
            if (row + 8 < M) mm_store_pair(c, (long)(row + 8) * N + col, acc[j][2], acc[j][3]);
        }
    }
}

// PERSISTENT false: version 3 (a block per tile, row-major order); true: version 4.
template <bool PERSISTENT>
struct HopperMatmul {
    template <bool A_K, bool B_K, typename OutT>
    static void gemm(OutT* c, const bf16* a, const bf16* b, int M, int N, int K, cudaStream_t s) {
        static int sms = 0;
        if (!sms) CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        // 2-D maps as 3-D ones of one batch: {row length, rows, 1}, boxes {64, box rows}
        const CUtensorMap tm_a = A_K ? tma_tensor_map(a, K, K, M, 1, HOP_BM) : tma_tensor_map(a, M, M, K, 1, 64);
        const CUtensorMap tm_b = B_K ? tma_tensor_map(b, K, K, N, 1, HOP_BN) : tma_tensor_map(b, N, N, K, 1, 64);
        const int tiles = ceil_div(M, HOP_BM) * ceil_div(N, HOP_BN);
        const int grid = PERSISTENT ? std::min(tiles, sms) : tiles;
        attn_allow_smem(hopper_matmul_kernel<A_K, B_K, OutT>, HOP_SMEM_BYTES);
        hopper_matmul_kernel<A_K, B_K><<<grid, HOP_THREADS, HOP_SMEM_BYTES, s>>>(tm_a, tm_b, c, M, N, K,
                                                                            PERSISTENT ? HOP_GROUP_M : 1);
        LAUNCH_CHECK();
    }
};

#endif
