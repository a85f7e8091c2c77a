/*
 * dev/matmul_wgmma.cuh - versions 3 to 9 and 11 of the matmul ladder: Hopper's GEMM. The kernel itself is
 * the trainer's, lib/matmul_hopper.cuh (TMA loads on an mbarrier ring, wgmma from swizzled shared
 * memory, a producer warpgroup and two consumers; its header has the work split, the layouts and
 * the epilogues); this file holds what only the ladder runs of it, as launch configurations:
 *   3  one block per 128 x 256 output tile, in row-major order; the epilogue stores from registers;
 *   4  the same kernel on a persistent grid (one block per SM) that walks the tiles in groups of 8
 *      tile rows, so that the operands of the tiles in flight stay in L2 and the loads of a block's
 *      next tile overlap the epilogue of this one;
 *   5  version 4 with the epilogue through shared memory and TMA stores, which the consumers hand
 *      off and leave running under the next tile's products, with K split where there are fewer
 *      tiles than SMs, and with tiles 192 wide where 256 would leave a wave's SMs idle (below);
 *   6  version 5 with the next kernel's work in the epilogue: the residual added
 *      (hopper_forward_residual, here: it ties cuBLASLt, so the trainer does not run it), SwiGLU
 *      (hopper_forward_swiglu) and SwiGLU's backward in down's input gradient
 *      (hopper_backward_swiglu), both in lib/matmul_hopper.cuh, both run by the trainer;
 *   7  version 5 with stream-K (the walk and its fix-up: HopperStreamK, lib/matmul_hopper.cuh) where
 *      version 5's units would leave more than a tenth of the last wave's SMs idle
 *      (hopper_stream_k_blocks, below), elsewhere version 5's plan 256 wide; the ladder's only;
 *   8  version 5's plan (HopperMatmul<5>::gemm with FP8 element types and the operands' scale_inv
 *      pointers) on FP8 operands, both K-major; the kernel's FP8 path: lib/matmul_hopper.cuh;
 *   9  versions 5 and 6 in clusters of two blocks (the kernel's CLUSTER = 2): the blocks of a
 *      cluster take two tiles one above the other, which read the same tile of B, and each loads
 *      half of it into both by TMA multicast, so L2 serves B once for two tiles; in all else
 *      version 5's plan (its tile width and its splits of K, both blocks of a cluster on one split);
 *  11  version 5 in ping-pong (the kernel's PP): tiles 128 x 192, each a consumer's whole, dealt to
 *      the two consumers in turn, so that one's epilogue runs under the other's products; never
 *      splits K (version 10, ping-pong of 64-row tiles, was taken out: doc/matmul.md); and
 *      SwiGLU's forward the same way in tiles 192 x 128 (hopper_forward_swiglu<1, true>, the
 *      trainer's).
 *
 * Version 5's split of K: a product with fewer tiles than half the SMs (a weight gradient of a small
 * matrix: 18 tiles for 132 SMs, K = 32768) cuts each tile's k-blocks into `splits` runs, so that
 * tiles x splits units fill the SMs (splits = SMs / tiles, no run under HOP_MIN_SPLIT_KB k-blocks).
 * Unit u is split u / tiles of tile u % tiles; it stores its fp32 partial product by TMA into a
 * workspace [splits][M][N], and a second kernel sums the partials in split order, 0 first, and
 * stores (bf16) or adds (fp32) the sum to C: the result depends on the shape and the SM count,
 * never on timing. The workspace is at most one partial tile per SM (16.5 MiB on 132 SMs); version 7
 * reuses it for its partials, one tile a block.
 *
 * Every wait of the kernel is bounded (MM_TIMEOUT, lib/matmul_hopper.cuh).
 * Shapes: M, N, K multiples of 8 (16-byte TMA row strides: mm_tiled_shape_problem).
 */
#ifndef DEV_MATMUL_WGMMA_CUH
#define DEV_MATMUL_WGMMA_CUH

#include "../lib/matmul_hopper.cuh"  // the kernel, hopper_launch, hopper_forward_swiglu, hopper_backward_swiglu
#include "matmul_common.cuh"

constexpr int HOP_MIN_SPLIT_KB = 8;  // version 5: k-blocks a split runs at least (its partial costs a tile's traffic)

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

// The map of a matrix [batches][rows][cols] of `type` (elements of `bytes` bytes) in boxes of 128
// bytes a row (a column of the 128-byte swizzle) and box_rows rows, for the ladder's maps that
// lib/attention.cuh's bf16 cache does not make: fp32 C and its split partials, FP8 operands.
static CUtensorMap hopper_encode_map(const void* base, CUtensorMapDataType type, int bytes, int cols, int rows,
                                     int batches, int box_rows) {
    CUtensorMap map;
    const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)rows, (cuuint64_t)batches};
    const cuuint64_t strides[2] = {(cuuint64_t)cols * bytes, (cuuint64_t)rows * cols * bytes};
    const cuuint32_t box[3] = {(cuuint32_t)(128 / bytes), (cuuint32_t)box_rows, 1}, elem_strides[3] = {1, 1, 1};
    const CUresult r = tma_encode_fn()(&map, type, 3, const_cast<void*>(base), dims, strides, box, elem_strides,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "matmul: cuTensorMapEncodeTiled failed (%d) for a [%d][%d][%d] of %d-byte elements\n", (int)r,
                batches, rows, cols, bytes);
        exit(1);
    }
    return map;
}

// The map of an fp32 matrix [batches][rows][cols] for version 5's stores (C of a weight gradient,
// or the split partials): boxes {32 columns (128 bytes), 64 rows, 1}. The last map is kept, since
// the ladder calls one shape many times in a row.
static CUtensorMap hopper_f32_map(const float* base, int cols, int rows, int batches) {
    static CUtensorMap map;
    static const float* map_base = nullptr;
    static int map_dims[3];
    if (base == map_base && cols == map_dims[0] && rows == map_dims[1] && batches == map_dims[2]) return map;
    map = hopper_encode_map(base, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, cols, rows, batches, 64);
    map_base = base, map_dims[0] = cols, map_dims[1] = rows, map_dims[2] = batches;
    return map;
}

// An operand's map: bf16 through lib/attention.cuh's cache (boxes {64, box_rows}), K-major or not;
// FP8 (K-major only) encoded anew, boxes {128 k, box_rows} (a microsecond or two of host time a
// call, under the products of every timed shape).
template <typename T>
static CUtensorMap hopper_operand_map(const T* p, int cols, int rows, int box_rows) {
    if constexpr (sizeof(T) == 2) return tma_tensor_map(p, cols, cols, rows, 1, box_rows);
    else return hopper_encode_map(p, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, cols, rows, 1, box_rows);
}

// Version 5's split partials (and version 7's): one buffer, grown when a product needs more (floats of them); like the
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

// C's own map for the TMA epilogue: bf16 boxes {64, 64} (the attention cache's), or fp32 {32, 64}.
template <typename OutT>
static CUtensorMap hopper_c_map(OutT* c, int M, int N) {
    if constexpr (sizeof(OutT) == 2) return tma_tensor_map(c, N, N, M, 1, 64);
    else return hopper_f32_map(c, N, M, 1);
}

// Version 7's choice: stream-K where version 5's units (tiles x splits) would leave more than a
// tenth of their last wave's SMs idle (the trainer's shapes of 48, 96 and 192 tiles; 30 and 18
// tiles split 4 and 7 ways fill 91% and 95%, and keep version 5's plan). Its grid: a block an SM,
// or fewer where the k-blocks are few, so that no range is shorter than HOP_MIN_SPLIT_KB; 0 for
// version 5's plan.
static int hopper_stream_k_blocks(int tiles, int k_blocks, int sms) {
    const int units = tiles * hopper_splits(tiles, k_blocks, sms), slots = ceil_div(units, sms) * sms;
    if (10 * units >= 9 * slots) return 0;
    return (int)std::max(1L, std::min((long)sms, (long)tiles * k_blocks / HOP_MIN_SPLIT_KB));
}

// Version 7's workspace: the partials (hopper_workspace) and a flag per consumer of each of `grid`
// blocks, zeroed once; each launch takes the next epoch. Like the tensor-map caches, it assumes one
// stream at a time, and launches in order (a CUDA graph would replay one epoch).
static HopperStreamK hopper_stream_k_workspace(int grid) {
    static int* flags = nullptr;
    static int have = 0, epoch = 0;
    if (grid > have) {
        if (flags) CUDA_CHECK(cudaFree(flags));
        CUDA_CHECK(cudaMalloc(&flags, 2 * grid * sizeof(int)));
        CUDA_CHECK(cudaMemset(flags, 0, 2 * grid * sizeof(int)));
        have = grid, epoch = 0;
    }
    float* partials = hopper_workspace((size_t)grid * 2 * (HOP_BN / 8) * 128 * 4);
    return {reinterpret_cast<float4*>(partials), flags, ++epoch};
}

// Version 5's tile width: HOP_BN, or HOP_BN_NARROW where that plan (tiles and splits of K as
// hopper_splits makes them) takes clearly less time, counted as waves of units x a unit's k-blocks
// x the tile's width: a block's time per k-block grows with the width it multiplies. "Clearly":
// under 0.9 of the wide plan's count, since a narrow tile moves more bytes through shared memory per
// product (its 40 KiB stage feeds 3/4 of the wide one's products with 5/6 of its bytes). At the
// trainer's shapes that picks 192 where 256 leaves a quarter of the SMs idle: the default config's
// gate_up dW and head dx (96 tiles become 128), its down dW (96 units, 48 tiles in 2 splits, become
// 132: 66 tiles in 2 splits); and 1b's qkv dW, 192 tiles (1.45 waves), which become 264 (2 waves).
static int hopper_tile_n(int tiles_m, int N, int k_blocks, int sms) {
    auto cost = [&](int bn) {
        const int tiles = tiles_m * ceil_div(N, bn), splits = hopper_splits(tiles, k_blocks, sms);
        return (double)ceil_div(tiles * splits, sms) * ceil_div(k_blocks, splits) * bn;
    };
    return cost(HOP_BN_NARROW) < 0.9 * cost(HOP_BN) ? HOP_BN_NARROW : HOP_BN;
}

// VERSION 3: a block per tile, row-major order; 4: persistent, grouped walk; 5: 4 with the TMA
// epilogue and split K, its tiles 192 wide where hopper_tile_n says; 6: 5 never split, the plain
// product whose accumulators version 6's fused epilogues round (each output one fp32 sum in k order,
// as theirs), against which the ladder checks the bits of SwiGLU's fused backward; 7: 5 with
// stream-K where its units fill the SMs badly; 9: 5 in clusters of two (a K-major B in boxes of
// BN / 2 rows, one a block); 11: 5 in ping-pong, tiles 192 wide, one split. All but versions 5 and
// 9's narrow plans and version 11 take tiles 256 wide.
template <int VERSION>
struct HopperMatmul {
    template <bool A_K, bool B_K, typename OutT, typename AT = bf16, typename BT = bf16>
    static void gemm(OutT* c, const AT* a, const BT* b, int M, int N, int K, cudaStream_t s,
                     const float* a_scale_inv = nullptr, const float* b_scale_inv = nullptr) {
        if constexpr (VERSION == 11) {
            plan<HOP_BN_NARROW, A_K, B_K>(c, a, b, M, N, K, s, a_scale_inv, b_scale_inv);
        } else {
            // (FP8 operands, version 8, stay 256 wide)
            if constexpr ((VERSION == 5 || VERSION == 9) && sizeof(AT) == 2) {
                if (hopper_tile_n(ceil_div(M, HOP_BM), N, hopper_k_blocks<AT>(K), hopper_sms()) == HOP_BN_NARROW)
                    return plan<HOP_BN_NARROW, A_K, B_K>(c, a, b, M, N, K, s, a_scale_inv, b_scale_inv);
            }
            plan<HOP_BN, A_K, B_K>(c, a, b, M, N, K, s, a_scale_inv, b_scale_inv);
        }
    }

    // The product in tiles BN wide.
    template <int BN, bool A_K, bool B_K, typename OutT, typename AT, typename BT>
    static void plan(OutT* c, const AT* a, const BT* b, int M, int N, int K, cudaStream_t s, const float* a_scale_inv,
                     const float* b_scale_inv) {
        const int sms = hopper_sms(), k_blocks = hopper_k_blocks<AT>(K);
        // 2-D maps as 3-D ones of one batch: {row length, rows, 1}, boxes {128 bytes, box rows}
        const CUtensorMap tm_a = A_K ? hopper_operand_map(a, K, M, HOP_BM) : hopper_operand_map(a, M, K, 64);
        const CUtensorMap tm_b = B_K ? hopper_operand_map(b, K, N, BN) : hopper_operand_map(b, N, K, 64);
        HopperFusion scales = {};  // version 8's: real = a_scale_inv b_scale_inv x the FP8 product
        scales.a_scale_inv = a_scale_inv, scales.b_scale_inv = b_scale_inv;
        const int tiles_m = ceil_div(M, HOP_BM), tiles_n = ceil_div(N, BN), tiles = tiles_m * tiles_n;
        if constexpr (VERSION < 5) {
            const int grid = VERSION == 4 ? hopper_grid<1>(tiles_m, tiles_n) : tiles;
            hopper_launch<A_K, B_K, OutT, HOP_EPI_REGISTERS>(tm_a, tm_b, CUtensorMap{}, HopperFusion{}, c, M, N, K,
                                                             grid, VERSION == 4 ? HOP_GROUP_M : 1, 1, s);
            return;
        }
        if constexpr (VERSION == 7) {
            if (const int grid = hopper_stream_k_blocks(tiles, k_blocks, sms)) {
                hopper_launch<A_K, B_K, OutT, HOP_EPI_STREAM_K>(tm_a, tm_b, hopper_c_map(c, M, N), HopperFusion{}, c,
                                                                M, N, K, grid, HOP_GROUP_M, 1, s,
                                                                hopper_stream_k_workspace(grid));
                return;
            }
        }
        constexpr bool PING_PONG = VERSION == 11;  // a consumer a tile 128 x 192
        const int splits = VERSION == 6 || PING_PONG ? 1 : hopper_splits(tiles, k_blocks, sms);
        constexpr int CLUSTER = VERSION == 9 ? 2 : 1;
        // version 9: each block of a cluster loads half of B's tile (a K-major B in boxes of BN / 2 rows)
        const CUtensorMap tm_b_load = CLUSTER == 2 && B_K ? hopper_operand_map(b, K, N, BN / 2) : tm_b;
        if (splits == 1) {
            hopper_launch<A_K, B_K, OutT, HOP_EPI_TMA, AT, BT, CLUSTER, BN, PING_PONG>(
                tm_a, tm_b_load, hopper_c_map(c, M, N), scales, c, M, N, K, hopper_grid<CLUSTER>(tiles_m, tiles_n),
                HOP_GROUP_M, 1, s);
            return;
        }
        float* ws = hopper_workspace((size_t)splits * M * N);
        hopper_launch<A_K, B_K, float, HOP_EPI_TMA, AT, BT, CLUSTER, BN>(
            tm_a, tm_b_load, hopper_f32_map(ws, N, M, splits), scales, ws, M, N, K,
            hopper_grid<CLUSTER>(tiles_m, tiles_n * splits), HOP_GROUP_M, splits, s);
        const long plane = (long)M * N;
        hopper_split_sum_kernel<<<(int)std::min<long>(ceil_div(plane / 4, 256L), 8L * sms), 256, 0, s>>>(c, ws, plane,
                                                                                                     splits);
        LAUNCH_CHECK();
    }
};

// Version 6, the forward with the residual fused: y[N, O] = x[N, I] W[O, I]^T + residual[N, O], as
// the trainer's attn_out and down forwards (cuBLASLt's beta = 1, out of place). No split of K: M is
// the tokens, many tiles. CLUSTER 2: version 9's clusters of two, W's tile in halves.
template <int CLUSTER>
static void hopper_forward_residual(bf16* y, const bf16* x, const bf16* W, const bf16* residual, int N, int I, int O,
                                    cudaStream_t s) {
    const int M = N, NC = O, K = I;  // the GEMM: C[M][NC] = A[M][K] B[K][NC] + residual
    HopperFusion fuse = {};
    fuse.in[0] = tma_tensor_map(residual, NC, NC, M, 1, HOP_BM);  // read through the ring, a chunk a stage
    hopper_launch<true, true, bf16, HOP_EPI_RESIDUAL, bf16, bf16, CLUSTER>(
        tma_tensor_map(x, K, K, M, 1, HOP_BM), tma_tensor_map(W, K, K, NC, 1, HOP_BN / CLUSTER),
        tma_tensor_map(y, NC, NC, M, 1, 64), fuse, y, M, NC, K,
        hopper_grid<CLUSTER>(ceil_div(M, HOP_BM), ceil_div(NC, HOP_BN)), HOP_GROUP_M, 1, s);
}

#endif
