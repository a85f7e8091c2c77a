/*
 * dev/matmul_wgmma.cuh - versions 3, 4 and 5 of the matmul ladder: Hopper's GEMM. TMA loads into a
 * ring of shared-memory stages guarded by mbarriers, warpgroup matrix products (wgmma) reading both
 * operands from shared memory, a producer warpgroup and two consumer warpgroups. Version 3 runs
 * one block per output tile; version 4 is the same kernel on a persistent grid (one block per SM)
 * that walks the tiles in groups of tile rows, so that the operands of the tiles in flight stay in
 * L2 and the loads of a block's next tile overlap the epilogue of this one. Version 5 is version 4
 * with an epilogue through shared memory and TMA stores, which the consumers hand off and leave
 * running under the next tile's products, and with K split where there are fewer tiles than SMs.
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
 *     tile it stores the accumulator: versions 3 and 4 straight from registers (bf16, or fp32
 *     added to C); version 5 through shared memory (below).
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
 * Version 5's epilogue: each consumer writes its 64 x 256 accumulator in chunks of 64 rows x 128
 * bytes (64 bf16 or 32 fp32 columns) into one of its two 8 KiB staging buffers (32 KiB in all, 224
 * KiB with the ring), in the 128-byte swizzle, which puts the 8 rows a warp's store touches in 8
 * different bank groups; its first thread then issues one TMA store of the chunk (bf16 C: a store;
 * fp32 C: a reduction that adds it to C in L2, so dW += needs no load) and goes on. A buffer is
 * written again only once the store of two chunks before has read it (cp.async.bulk.wait_group.read
 * 1), so the last stores of a tile drain while the next tile's products run. TMA clips the boxes
 * at the matrix's edges.
 *
 * Version 5's split of K: a product with fewer tiles than half the SMs (a weight gradient of a small
 * matrix: 18 tiles for 132 SMs, K = 32768) cuts each tile's k-blocks into `splits` runs, so that
 * tiles x splits units fill the SMs (splits = SMs / tiles, no run under HOP_MIN_SPLIT_KB k-blocks).
 * Unit u is split u / tiles of tile u % tiles; it stores its fp32 partial product by TMA into a
 * workspace [splits][M][N], and a second kernel sums the partials in split order, 0 first, and
 * stores (bf16) or adds (fp32) the sum to C: the result depends on the shape and the SM count,
 * never on timing. The workspace is at most one partial tile per SM (16.5 MiB on 132 SMs).
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
constexpr int HOP_RING_BYTES = HOP_STAGES * (HOP_A_BYTES + HOP_B_BYTES);
constexpr int HOP_OUT_BUF_BYTES = 64 * 128, HOP_OUT_BUFS = 2;               // version 5: a consumer's staging
constexpr int HOP_OUT_BYTES = 2 * HOP_OUT_BUFS * HOP_OUT_BUF_BYTES;         // 32 KiB for the two consumers
constexpr int HOP_MIN_SPLIT_KB = 8;  // version 5: k-blocks a split runs at least (its partial costs a tile's traffic)
// The ring, version 5's staging buffers, and the barriers: 192 KiB + 64 B, or 224 KiB + 64 B (of 227 KiB).
constexpr int hopper_smem_bytes(bool tma_store) {
    return HOP_RING_BYTES + (tma_store ? HOP_OUT_BYTES : 0) + 2 * HOP_STAGES * 8;
}
constexpr int HOP_PROD_REGS = 40, HOP_CONS_REGS = 232;  // 128 * 40 + 256 * 232 = 64512 <= 65536
constexpr int HOP_GROUP_M = 8;                          // versions 4 and 5: tile rows per group
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

// Unit `unit` of a walk of tiles x splits units: its tile's first row m0 and column n0, its split,
// and the split's k-blocks kb0 .. kb1-1 (k_blocks cut in `splits` nearly equal runs, none empty
// while splits <= k_blocks).
struct HopperUnit {
    int m0, n0, split, kb0, kb1;
};
static __device__ __forceinline__ HopperUnit hopper_unit(int unit, int tiles_m, int tiles_n, int group_m, int k_blocks,
                                                         int splits) {
    const int tiles = tiles_m * tiles_n, split = unit / tiles;
    int tm, tn;
    hopper_tile_of(unit % tiles, tiles_m, tiles_n, group_m, &tm, &tn);
    return {tm * HOP_BM, tn * HOP_BN, split, split * k_blocks / splits, (split + 1) * k_blocks / splits};
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

// Version 5's epilogue, run by all 128 threads of consumer cw: its 64 x 256 accumulator (rows
// row0 .. row0+63 of C, columns n0 ..) in chunks of 64 rows x 128 bytes, T = bf16 (64 columns) or
// float (32), each staged in one of the consumer's two buffers and stored by one TMA copy (added to
// C when add) at batch `batch` of tm_c. *chunks counts the consumer's chunks over its walk: chunk e
// goes to buffer e % 2, once the copy of chunk e - 2 has read it. Chunks wholly past M or N are
// skipped (the same for the whole warpgroup).
template <typename T>
static __device__ __forceinline__ void hopper_store_tma(const float (&acc)[HOP_BN / 8][4], const CUtensorMap* tm_c,
                                                        unsigned char* bufs, int cw, int row0, int n0, int batch,
                                                        bool add, int M, int N, int* chunks) {
    constexpr int COLS = 128 / sizeof(T), J_PER_CHUNK = COLS / 8;  // a chunk's columns, and its d[j]
    const int tid = threadIdx.x & 127, lane = tid & 31;
    const int r = (tid >> 5) * 16 + (lane >> 2), i = lane & 3;  // rows r and r + 8 of the 64, (r + 8) % 8 = r % 8
    if (row0 >= M) return;
#pragma unroll
    for (int q = 0; q < HOP_BN / COLS; ++q) {
        const int col0 = n0 + q * COLS;
        if (col0 >= N) break;
        unsigned char* buf = bufs + (*chunks % HOP_OUT_BUFS) * HOP_OUT_BUF_BYTES;
        if (tid == 0) bulk_wait_read_but<HOP_OUT_BUFS - 1>();  // the copy that used buf last has read it
        named_barrier(1 + cw, 128);
#pragma unroll
        for (int jj = 0; jj < J_PER_CHUNK; ++jj) {
            // d[j] holds columns 8j + 2i, 8j + 2i + 1: byte b of a 128-byte row, stored (128-byte
            // swizzle) in 16-byte slot (b / 16) ^ (row % 8)
            const int j = q * J_PER_CHUNK + jj, b = (8 * jj + 2 * i) * (int)sizeof(T);
            const int at = ((((b >> 4) ^ (r & 7)) << 4) | (b & 15)) + r * 128;
            if constexpr (sizeof(T) == 2) {
                *reinterpret_cast<uint32_t*>(buf + at) = attn_pack_bf16(acc[j][0], acc[j][1]);
                *reinterpret_cast<uint32_t*>(buf + at + 8 * 128) = attn_pack_bf16(acc[j][2], acc[j][3]);
            } else {
                *reinterpret_cast<float2*>(buf + at) = make_float2(acc[j][0], acc[j][1]);
                *reinterpret_cast<float2*>(buf + at + 8 * 128) = make_float2(acc[j][2], acc[j][3]);
            }
        }
        wg_fence_proxy_async();  // the writes above, before the copy engine reads them
        named_barrier(1 + cw, 128);
        if (tid == 0) {
            if (add) tma_store_3d<true>(tm_c, attn_smem_u32(buf), col0, row0, batch);
            else tma_store_3d<false>(tm_c, attn_smem_u32(buf), col0, row0, batch);
        }
        ++*chunks;
    }
}

// TMA_STORE false: versions 3 and 4, whose epilogue stores to c from registers (tm_c unused);
// true: version 5, which stores through tm_c (c unused): bf16 C, fp32 C added to (splits 1), or the
// fp32 partials of `splits` > 1 (batch = split).
template <bool A_K, bool B_K, typename OutT, bool TMA_STORE>
__global__ void __launch_bounds__(HOP_THREADS, 1)
    hopper_matmul_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                         const __grid_constant__ CUtensorMap tm_c, OutT* __restrict__ c, int M, int N, int K,
                         int group_m, int splits) {
    extern __shared__ __align__(1024) unsigned char hopper_smem[];
    const uint32_t a_tiles = attn_smem_u32(hopper_smem), b_tiles = a_tiles + HOP_STAGES * HOP_A_BYTES;
    unsigned char* out_bufs = hopper_smem + HOP_RING_BYTES;  // version 5: consumer c's are the c-th pair
    const uint32_t full = a_tiles + HOP_RING_BYTES + (TMA_STORE ? HOP_OUT_BYTES : 0);  // 8 bytes a barrier
    const uint32_t empty = full + 8 * HOP_STAGES;
    if (a_tiles % 1024 != 0) {  // the same for every thread: all leave
        if (threadIdx.x == 0) atomicExch(&mm_error, MM_MISALIGNED);
        return;
    }
    const int tiles_m = (M + HOP_BM - 1) / HOP_BM, tiles_n = (N + HOP_BN - 1) / HOP_BN;
    const int units = tiles_m * tiles_n * splits, k_blocks = (K + HOP_BK - 1) / HOP_BK;
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
            for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
                const HopperUnit u = hopper_unit(unit, tiles_m, tiles_n, group_m, k_blocks, splits);
                const int a_panels = min(2, (M - u.m0 + 63) / 64), b_panels = min(4, (N - u.n0 + 63) / 64);
                const uint32_t bytes = (A_K ? HOP_A_BYTES : a_panels * HOP_PANEL_BYTES) +
                                       (B_K ? HOP_B_BYTES : b_panels * HOP_PANEL_BYTES);
                for (int kb = u.kb0; kb < u.kb1; ++kb, ++t) {
                    const int st = t % HOP_STAGES, use = t / HOP_STAGES;
                    const uint32_t bar = full + 8 * st;
                    // the stage's previous use (k-block t - STAGES) is done once its phase use-1 completed
                    if (use > 0 && !hopper_wait(empty + 8 * st, (use - 1) & 1)) return;
                    mbar_expect_tx(bar, bytes);
                    const uint32_t as = a_tiles + st * HOP_A_BYTES, bs = b_tiles + st * HOP_B_BYTES;
                    const int k0 = kb * HOP_BK;
                    if constexpr (A_K) {
                        tma_load_3d(as, &tm_a, k0, u.m0, 0, bar);  // box {64 k, 128 m}
                    } else {
                        for (int p = 0; p < a_panels; ++p)  // boxes {64 m, 64 k}
                            tma_load_3d(as + p * HOP_PANEL_BYTES, &tm_a, u.m0 + 64 * p, k0, 0, bar);
                    }
                    if constexpr (B_K) {
                        tma_load_3d(bs, &tm_b, k0, u.n0, 0, bar);  // box {64 k, 256 n}
                    } else {
                        for (int p = 0; p < b_panels; ++p)  // boxes {64 n, 64 k}
                            tma_load_3d(bs + p * HOP_PANEL_BYTES, &tm_b, u.n0 + 64 * p, k0, 0, bar);
                    }
                }
            }
        }
        return;
    }

    // consumers
    setmaxnreg_inc<HOP_CONS_REGS>();
    const int cw = wg - 1;
    const bool store_thread = TMA_STORE && (threadIdx.x & 127) == 0;  // issues the consumer's TMA stores
    float acc[HOP_BN / 8][4];  // wgmma's accumulator layout (lib/ptx.cuh): d[j] holds columns 8j .. 8j+7
    int t = 0;                // k-blocks consumed so far
    int chunks = 0;           // version 5: chunks this consumer has staged
    for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
        const HopperUnit u = hopper_unit(unit, tiles_m, tiles_n, group_m, k_blocks, splits);
#pragma unroll
        for (int j = 0; j < HOP_BN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
        for (int kb = u.kb0; kb < u.kb1; ++kb, ++t) {
            const int st = t % HOP_STAGES;
            if (!hopper_wait(full + 8 * st, (t / HOP_STAGES) & 1)) {
                wg_wait<0>();                          // leave no product in flight
                if (store_thread) bulk_wait<false>();  // nor a store reading shared memory
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
            if (kb > u.kb0 && lane == 0) mbar_arrive(empty + 8 * ((t - 1) % HOP_STAGES));
        }
        wg_wait<0>();
        wg_fence_regs(acc);
        if (u.kb1 > u.kb0 && lane == 0) mbar_arrive(empty + 8 * ((t - 1) % HOP_STAGES));

        if constexpr (TMA_STORE) {
            hopper_store_tma<OutT>(acc, &tm_c, out_bufs + cw * HOP_OUT_BUFS * HOP_OUT_BUF_BYTES, cw, u.m0 + 64 * cw,
                                   u.n0, u.split, sizeof(OutT) == 4 && splits == 1, M, N, &chunks);
        } else {
            // Versions 3 and 4: warp w of the consumer holds rows 16w + g and 16w + g + 8 of its 64,
            // columns 8j + 2i and 8j + 2i + 1 of d[j] (lane = 4g + i).
            const int row = u.m0 + cw * 64 + (warp & 3) * 16 + (lane >> 2), col0 = u.n0 + 2 * (lane & 3);
#pragma unroll
            for (int j = 0; j < HOP_BN / 8; ++j) {
                const int col = col0 + 8 * j;
                if (col >= N) continue;
                if (row < M) mm_store_pair(c, (long)row * N + col, acc[j][0], acc[j][1]);
                if (row + 8 < M) mm_store_pair(c, (long)(row + 8) * N + col, acc[j][2], acc[j][3]);
            }
        }
    }
    if (store_thread) bulk_wait<false>();  // every store done before the block's shared memory goes
}

// Version 5's second kernel: c = sum_s ws[s] (bf16) or c += sum_s ws[s] (fp32), ws being the
// `splits` partials [splits][plane], summed in split order; four entries a thread (plane, M N, is
// a multiple of 8).
template <typename OutT>
__global__ void hopper_split_sum_kernel(OutT* c, const float* ws, long plane, int splits) {
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < plane / 4; q += (long)gridDim.x * blockDim.x) {
        float4 sum = reinterpret_cast<const float4*>(ws)[q];
        for (int s = 1; s < splits; ++s) {
            const float4 p = reinterpret_cast<const float4*>(ws + s * plane)[q];
            sum.x += p.x, sum.y += p.y, sum.z += p.z, sum.w += p.w;
        }
        if constexpr (sizeof(OutT) == 2) {
            reinterpret_cast<uint2*>(c)[q] = make_uint2(attn_pack_bf16(sum.x, sum.y), attn_pack_bf16(sum.z, sum.w));
        } else {
            float4 old = reinterpret_cast<float4*>(c)[q];
            old.x += sum.x, old.y += sum.y, old.z += sum.z, old.w += sum.w;
            reinterpret_cast<float4*>(c)[q] = old;
        }
    }
}

// The map of an fp32 matrix [batches][rows][cols] for version 5's stores (C of a weight gradient,
// or the split partials): boxes {32 columns (128 bytes), 64 rows, 1}, the 128-byte swizzle. The
// last map is kept, since the ladder calls one shape many times in a row.
static CUtensorMap hopper_f32_map(const float* base, int cols, int rows, int batches) {
    static CUtensorMap map;
    static const float* map_base = nullptr;
    static int map_dims[3];
    if (base == map_base && cols == map_dims[0] && rows == map_dims[1] && batches == map_dims[2]) return map;
    const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)rows, (cuuint64_t)batches};
    const cuuint64_t strides[2] = {(cuuint64_t)cols * sizeof(float), (cuuint64_t)rows * cols * sizeof(float)};
    const cuuint32_t box[3] = {32, 64, 1}, elem_strides[3] = {1, 1, 1};
    const CUresult r = tma_encode_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<float*>(base), dims,
                                       strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                       CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "matmul: cuTensorMapEncodeTiled failed (%d) for an fp32 [%d][%d][%d]\n", (int)r, batches,
                rows, cols);
        exit(1);
    }
    map_base = base, map_dims[0] = cols, map_dims[1] = rows, map_dims[2] = batches;
    return map;
}

// Version 5's split partials: one buffer, grown when a product needs more (floats of them); like the
// tensor-map caches, it assumes one stream at a time.
static float* hopper_workspace(size_t floats) {
    static float* ws = nullptr;
    static size_t have = 0;
    if (floats > have) {
        if (ws) CUDA_CHECK(cudaFree(ws));
        CUDA_CHECK(cudaMalloc(&ws, floats * sizeof(float)));
        have = floats;
    }
    return ws;
}

// Version 5's number of splits of K: as many as fill the SMs with units of tiles x splits, so 1
// from half as many tiles as SMs up; none shorter than HOP_MIN_SPLIT_KB k-blocks.
static int hopper_splits(int tiles, int k_blocks, int sms) {
    return std::max(1, std::min(sms / std::max(tiles, 1), k_blocks / HOP_MIN_SPLIT_KB));
}

template <bool A_K, bool B_K, typename OutT, bool TMA_STORE>
static void hopper_launch(const CUtensorMap& tm_a, const CUtensorMap& tm_b, const CUtensorMap& tm_c, OutT* c, int M,
                          int N, int K, int grid, int group_m, int splits, cudaStream_t s) {
    attn_allow_smem(hopper_matmul_kernel<A_K, B_K, OutT, TMA_STORE>, hopper_smem_bytes(TMA_STORE));
    hopper_matmul_kernel<A_K, B_K, OutT, TMA_STORE>
        <<<grid, HOP_THREADS, hopper_smem_bytes(TMA_STORE), s>>>(tm_a, tm_b, tm_c, c, M, N, K, group_m, splits);
    LAUNCH_CHECK();
}

// VERSION 3: a block per tile, row-major order; 4: persistent, grouped walk; 5: 4 with the TMA
// epilogue and split K.
template <int VERSION>
struct HopperMatmul {
    template <bool A_K, bool B_K, typename OutT>
    static void gemm(OutT* c, const bf16* a, const bf16* b, int M, int N, int K, cudaStream_t s) {
        static int sms = 0;
        if (!sms) CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        // 2-D maps as 3-D ones of one batch: {row length, rows, 1}, boxes {64, box rows}
        const CUtensorMap tm_a = A_K ? tma_tensor_map(a, K, K, M, 1, HOP_BM) : tma_tensor_map(a, M, M, K, 1, 64);
        const CUtensorMap tm_b = B_K ? tma_tensor_map(b, K, K, N, 1, HOP_BN) : tma_tensor_map(b, N, N, K, 1, 64);
        const int tiles = ceil_div(M, HOP_BM) * ceil_div(N, HOP_BN);
        if constexpr (VERSION < 5) {
            const int grid = VERSION == 4 ? std::min(tiles, sms) : tiles;
            hopper_launch<A_K, B_K, OutT, false>(tm_a, tm_b, CUtensorMap{}, c, M, N, K, grid,
                                                 VERSION == 4 ? HOP_GROUP_M : 1, 1, s);
            return;
        }
        const int splits = hopper_splits(tiles, ceil_div(K, HOP_BK), sms);
        if (splits == 1) {  // C's own map: bf16 boxes {64, 64} (the attention cache's), or fp32 {32, 64}
            CUtensorMap tm_c;
            if constexpr (sizeof(OutT) == 2) tm_c = tma_tensor_map(c, N, N, M, 1, 64);
            else tm_c = hopper_f32_map(c, N, M, 1);
            hopper_launch<A_K, B_K, OutT, true>(tm_a, tm_b, tm_c, c, M, N, K, std::min(tiles, sms), HOP_GROUP_M, 1, s);
            return;
        }
        float* ws = hopper_workspace((size_t)splits * M * N);
        hopper_launch<A_K, B_K, float, true>(tm_a, tm_b, hopper_f32_map(ws, N, M, splits), ws, M, N, K,
                                             tiles * splits, HOP_GROUP_M, splits, s);
        const long plane = (long)M * N;
        hopper_split_sum_kernel<<<(int)std::min<long>(ceil_div(plane / 4, 256L), 8L * sms), 256, 0, s>>>(c, ws, plane,
                                                                                                     splits);
        LAUNCH_CHECK();
    }
};

#endif
