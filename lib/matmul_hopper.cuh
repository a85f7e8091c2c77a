/*
 * lib/matmul_hopper.cuh - our own Hopper GEMM (sm_90a): one kernel template, TMA loads into a ring
 * of shared-memory stages guarded by mbarriers, warpgroup matrix products (wgmma) reading both
 * operands from shared memory, a producer warpgroup and two consumer warpgroups, on a persistent
 * grid; its epilogue, a template parameter, stores through shared memory and TMA, with the next
 * kernel's work fused in where that pays.
 *
 * How it fits: the trainer runs four instantiations of it, all at the bottom: the gate/up forward
 * with SwiGLU in its epilogue (hopper_forward_swiglu: gate_up and act = silu(gate) * up in one
 * launch, in ping-pong: 1.36x cuBLASLt plus swiglu_forward at the default config, 1.14x at 1b;
 * doc/matmul.md), and its mirror in the backward, the down matrix's input gradient with SwiGLU's
 * backward in its epilogue (hopper_backward_swiglu: d_gate_up from d_mlp_act = dy W_down, which is
 * never stored), in a layer that recomputes also remaking the forward's act from the gate and up it
 * reads anyway; and the output head's forward with the softmax's exponentials in its epilogue
 * (hopper_logits_exp, in ping-pong: the logits are never stored, kernels.cuh's head_loss_kernel
 * makes loss and gradient from what it leaves); every other matmul of the trainer stays with
 * cuBLASLt through kernels.cuh's matmul(). The kernel is the matmul ladder's (dev/matmul.cu): its
 * versions 3 to 9 and 11 are this kernel's launch configurations and epilogues
 * (dev/matmul_wgmma.cuh): 3 and 4 store from registers, 5 by TMA (and splits K), 6 adds the
 * residual or applies SwiGLU or its backward, 7 (the ladder's only) stores as 5 on a stream-K walk
 * (HopperStreamK, below), 8 (the ladder's only) is 5 on FP8 operands (below), 9 (the ladder's only)
 * is 5 and 6 in clusters of two blocks that share B's tile (below); versions 5 and 9 take tiles 192
 * wide where 256 would leave SMs idle (the template's BN, below); and 11 is 5 in ping-pong, a whole
 * 128 x 192 tile a consumer (the template's PP, below), which the head's forward takes, and 6's
 * SwiGLU forward in ping-pong, tiles 192 x 128, which the trainer's gate/up forward takes.
 * train_gpt.cu includes this file after kernels.cuh, whose swiglu8 and swiglu_backward8 and
 * lib/attention.cuh helpers (the tensor-map cache, shared addresses, bf16 packing) it uses.
 *
 * Work split: a 128 x 256 output tile, k-blocks of 64, a 4-stage ring of A [128 x 64] and B
 * [256 x 64] tiles (4 x 48 KiB = 192 KiB of shared memory), 384 threads (versions 5 and 9's
 * narrow tiles, BN = HOP_BN_NARROW: 128 x 192, B [192 x 64], 40 KiB a stage, everything else the
 * same; ping-pong's, below):
 *   warpgroup 0, the producer, shrinks to 40 registers; one thread waits for a free stage (its
 *     empty barrier), announces the bytes to come on the stage's full barrier and issues the TMA
 *     loads, k-block after k-block and tile after tile;
 *   warpgroups 1 and 2, the consumers, grow to 232 registers; consumer c owns rows 64c .. 64c+63
 *     of the tile (a 64 x 256 fp32 accumulator, 128 registers a thread). Per k-block it waits for
 *     the full barrier, issues 4 wgmma m64n256k16 (one per 16 k), commits them, waits for the
 *     previous k-block's group, and hands that stage back (one arrive per warp). At the end of a
 *     tile it stores the accumulator (the epilogues, below).
 * The stage and barrier phase of ring use t (the k-blocks, and version 6's input chunks below,
 * counted over the block's whole walk) are t % 4 and (t / 4) & 1 on both sides, so the ring runs on
 * from one tile into the next (ping-pong's consumers keep their phases otherwise: below). A
 * persistent block walks tiles blockIdx, blockIdx + grid, ... in groups of 8 tile rows
 * (hopper_tile_of), so that the operands of the tiles in flight stay in L2,
 * and loads its next tile while this one's epilogue stores (version 7 walks a contiguous range of
 * all the tiles' k-blocks instead: HopperStreamK).
 *
 * Shared-memory layouts (TMA writes them with the 128-byte swizzle, wgmma reads them through
 * descriptors; lib/ptx.cuh): a K-major operand tile is [rows][64 k], 128-byte rows, one TMA box; a
 * k-step of 16 advances the descriptor 32 bytes. An MN-major tile is 64-column panels [64 k][64 mn]
 * of 8 KiB, one box each: consumer c's A is panel c; B's four panels are one wgmma operand whose
 * descriptor's leading offset is the panel size; a k-step advances 16 rows, 2048 bytes. Boxes
 * that cross the matrix's edge are zero-filled by TMA (and still count their full bytes); panels
 * wholly past M or N are not loaded, and only feed rows or columns the epilogue does not store.
 *
 * The TMA epilogue: each consumer writes its 64 x 256 accumulator in chunks of 64 rows x 128 bytes
 * (64 bf16 or 32 fp32 columns) into one of its two 8 KiB staging buffers (32 KiB in all, 224 KiB
 * with the ring), in the 128-byte swizzle, which puts the 8 rows a warp's store touches in 8
 * different bank groups; its first thread then issues one TMA store of the chunk (bf16 C: a store;
 * fp32 C: a reduction that adds it to C in L2, so dW += needs no load) and goes on. A buffer is
 * written again only once the store of two chunks before has read it (cp.async.bulk.wait_group.read
 * 1), so the last stores of a tile drain while the next tile's products run. TMA clips the boxes
 * at the matrix's edges. The fused epilogues (one split of K):
 *   SwiGLU: W [2F][K] holds the gate rows, then the up rows. A tile takes features f .. f+127: its
 *     256-row B tile is W's gate rows f .. f+127 and up rows F+f .., two TMA boxes a stage through
 *     two maps (each half's edge zero-filled at F), so that in wgmma's m64n256 accumulator the
 *     thread holding gate column c of a row also holds up column c + 128 (in ping-pong, 64
 *     features, a 128-row B tile and m64n128: up column c + 64). Per 64 features the
 *     epilogue stores three chunks: gate and up (gate_up [M][2F], kept for the backward, through two
 *     maps of row stride 2F) and act = swiglu8(gate, up) of the bf16-rounded values [M][F], the
 *     very function and inputs of swiglu_forward, so the bits are the trainer's.
 *   SwiGLU's backward, in the down matrix's input gradient d_mlp_act [M][F] = dy [M][K] W [K][F]
 *     (dy K-major, W N-major): the tile is the plain product's; per 64 features the epilogue rounds
 *     the accumulator to bf16 (d_mlp_act as it would be stored), takes gate and up of the same
 *     entries from gate_up [M][2F], and stores d_gate and d_up = swiglu_backward8(gate, up, d_mlp_act)
 *     into d_gate_up's two halves (two maps of row stride 2F): the very function and inputs of
 *     swiglu_backward on the stored d_mlp_act, so the bits are the trainer's. Its second form
 *     (EPI_SWIGLU_BWD_ACT, a layer that recomputes) stores first act = silu(gate) * up of the same
 *     entries, rounded as swiglu_forward rounds it: the forward's act remade for dW_down at the
 *     cost of one store, where a recompute would read all of gate_up again. A form of its own, not
 *     a flag: the flag's registers made the consumers spill.
 *   residual (the ladder's only: it ties cuBLASLt's beta = 1, doc/matmul.md): y = acc + residual,
 *     rounded once to bf16.
 *   The softmax's exponentials, in the output head's forward z = x E^T (hopper_store_logits_exp):
 *     exp(z - shift) of each row's own shift (its target's logit) stored in place of z, and their
 *     sums per row over the tile's columns (the target's left out) written as partials.
 *   What these epilogues read (the residual; gate and up) comes through the ring, not from the
 *   consumers' own loads: after a tile's k-blocks the producer loads the tile's chunks of it, one
 *   stage a chunk of 64 columns ([128 rows][64] boxes: the residual's, or gate's into the stage's A
 *   tile and up's into its B tile), so the first ones land while the tile's last k-blocks are
 *   multiplied; each consumer waits for a chunk's stage, reads the entries of its own accumulator
 *   from shared memory (the swizzle of its stores), hands the stage back and goes on, and the next
 *   tile's k-blocks fill the freed stages while the epilogue stores. (Read by the consumers straight
 *   into registers, a chunk ahead, the loads left the backward's product neither bound by the SMs
 *   nor by memory: 30% and 52% of their peaks in Nsight Compute.)
 *
 * FP8 operands (version 8; AT, BT: __nv_fp8_e4m3 or __nv_fp8_e5m2, the trainer's TN products of
 * doc/fp8.md): a k-block is 128 deep, so the tiles are the same 128-byte rows and the same bytes;
 * both operands K-major (FP8 wgmma has no transpose). The tensor cores sum FP8 products in less
 * than fp32 (doc/matmul.md, version 8), so a consumer sums each k-block afresh, in two halves of
 * 128 columns (4 wgmma m64n128k32 into 64 scratch registers, waited for), and adds each into its fp32
 * accumulator with the CUDA cores, times alpha = the product of the operands' scale_inv (device
 * floats, read once a launch): "promotion" every 128 k, as cuBLASLt does. Version 5's epilogue and
 * split K then store the real values, bf16 or fp32 +=.
 *
 * Clusters of two (version 9; the template's CLUSTER = 2, a launch attribute): the two blocks of a
 * cluster walk pairs of tiles one above the other (row tiles 2p and 2p + 1, the second past M when
 * the rows make an odd number: it loads no A and stores nothing), which read the same B tile, and
 * where K is split the same split of it; each block's producer loads half of it (K-major: BN / 2
 * of its rows, SwiGLU: the gate or the up rows, N-major: panels 0 and 1, or the rest) into both
 * blocks' shared memory by one TMA multicast, and both full barriers count the whole tile's bytes.
 * A stage is then written by both producers, so it is free only once both blocks' consumers are
 * done with it: every consumer warp arrives on its own block's empty barrier and on the other's
 * (counts of 16), and the blocks meet at a cluster barrier after setting up their barriers and
 * before leaving, so that neither signals a departed block.
 * L2 then serves B once a pair instead of twice. Measured (doc/matmul.md): 0-4% ahead of version 5
 * on the plain products at the default config's shapes, level to 7% behind at 1b's; on the fused
 * forms level with version 6 at the default config (-1% to +2%), 1-3% behind at 1b. L2 was not what
 * held these back, so the trainer keeps clusters of one. With version 5's narrow tiles and split K
 * (the ladder's version 9 since), the two weight gradients where version 5 stays furthest behind
 * cuBLASLt (default gate_up's and down's dW, one wave of units each) come within 5% of it.
 * (The arrive on the other block's barrier first had cluster-scope release semantics; on the
 * consumers' path every k-block, it made every product about 35% slower.)
 *
 * Ping-pong (version 11; the template's PP): the block's i-th tile, 128 x 192, is consumer i % 2's
 * whole, so one consumer's epilogue runs while the other's products run. The consumer multiplies
 * both m64 row blocks of the tile, two wgmma m64n192k16 a k-step into two accumulators of 96
 * registers a thread (192 in all: the consumers grow to 240 registers, the producer shrinks to
 * 24). A stage, A [128 x 64] and B [192 x 64] (40 KiB), then feeds one consumer: its empty
 * barrier counts that consumer's 4 warps, and each consumer has a set of full barriers of its own,
 * on which the producer announces the stages of that consumer's tiles. A consumer waits on its set
 * only for its own uses, in order, holding the parity of its next wait on each stage in a bit
 * (`phases`): on a set shared by both, a consumer waiting for a stage's use u could see the phase of
 * use u - 2 (the other consumer's tile) complete, of the same parity, and run ahead. Version 10, the
 * ping-pong of 64-row tiles (taken out; doc/matmul.md), fed 64 x 256 x 64 products with a stage of
 * 40 KiB; version 11's stage feeds 128 x 192 x 64, 1.5 times as many, within 11% of version 5's
 * bytes a product. SwiGLU's forward takes the same products in the other shape (hopper_tile_m):
 * tiles 192 x 128, A [192 x 64] and B [128 x 64] a stage (40 KiB), three m64n128k16 a k-step into
 * three accumulators of 64 registers, each tile 64 gate and the same 64 up features, so that its
 * epilogue stores whole 64-column chunks of gate, up and act; 128 x 192 would hold 96 features.
 * Only the epilogues that read no inputs through the ring take it (an input chunk in the ring would
 * hold the other consumer's k-blocks back behind this one's epilogue).
 *
 * Determinism: with one split of K (all the trainer runs) each output is one fp32 sum over k in a
 * fixed order, whatever the grid; the ladder's split K and stream-K sum their partials in a fixed
 * order too.
 *
 * Bounded waits: every mbarrier wait (and stream-K's flag wait) gives up after HOP_WAIT_TRIES
 * tries of at most HOP_WAIT_HINT_NS each (about a second; no legitimate wait here lasts a
 * millisecond), raises MM_TIMEOUT in mm_error and returns, so that a broken pipeline ends as a
 * raised flag (the ladder reads it after each shape, the trainer with each step's figures) rather
 * than a hung program. One edge is left (found by reading, not seen): the consumers' 128 threads
 * wait on a full barrier each on their own, so if one gives up just as the phase completes, it
 * leaves while the others go on to the epilogue's named barrier and wait there for it; stream-K's
 * flag wait avoids this (one thread waits, bar.red shares the outcome), the mbarrier waits do not
 * yet. Only an already broken pipeline can get there. The cluster barrier (version 9) has no
 * bound, but a thread that gave up has left, and a departed thread does not hold it up.
 */
#ifndef MATMUL_HOPPER_CUH
#define MATMUL_HOPPER_CUH

#include <stdint.h>
#include <algorithm>
#include <initializer_list>
#include <type_traits>
#include <cuda_fp8.h>  // __nv_fp8_e4m3, __nv_fp8_e5m2: the FP8 operands' element types
#include "../kernels.cuh"  // swiglu8, swiglu_backward8, bf16x8; through it lib/attention.cuh: tma_tensor_map (the
                           // encoded-map cache), attn_smem_u32, attn_allow_smem, attn_pack_bf16

constexpr int HOP_BM = 128, HOP_BN = 256, HOP_BK = 64, HOP_STAGES = 4, HOP_THREADS = 384;
// A k-block's depth for operands of type T: 128-byte rows, 64 bf16 (HOP_BK) or 128 FP8 elements, so
// the tiles, the ring and the swizzle are the same bytes for both.
template <typename T>
constexpr int hop_bk = 128 / (int)sizeof(T);
template <typename T>
static int hopper_k_blocks(int K) { return (K + hop_bk<T> - 1) / hop_bk<T>; }
constexpr int HOP_PANEL_BYTES = 64 * 64 * 2;         // one [64][64] bf16 panel
// A stage's B tile for tiles bn columns wide: 32 KiB (4 panels) at HOP_BN, 24 KiB (3) at the
// narrow width HOP_BN_NARROW, which versions 5 and 9 take where 256 would leave a wave's SMs idle
// (dev/matmul_wgmma.cuh, hopper_tile_n).
constexpr int HOP_BN_NARROW = 192;
// Ping-pong's SwiGLU forward (version 11) turns the tile around: 192 rows x 128 columns, 64 gate and
// the same 64 up features (the file's comment, "Ping-pong"; hopper_tile_m).
constexpr int HOP_PP_SWIGLU_BM = 192, HOP_PP_SWIGLU_BN = 128;
static __host__ __device__ constexpr int hop_b_bytes(int bn) { return bn * HOP_BK * 2; }
// A stage's A tile for tiles bm rows high: 16 KiB at HOP_BM, 24 KiB for SwiGLU's forward in
// ping-pong (HOP_PP_SWIGLU_BM).
static __host__ __device__ constexpr int hop_a_bytes(int bm) { return bm * HOP_BK * 2; }
static __host__ __device__ constexpr int hopper_ring_bytes(int bn, int bm = HOP_BM) {
    return HOP_STAGES * (hop_a_bytes(bm) + hop_b_bytes(bn));
}
constexpr int HOP_OUT_BUF_BYTES = 64 * 128, HOP_OUT_BUFS = 2;               // version 5: a consumer's staging
constexpr int HOP_OUT_BYTES = 2 * HOP_OUT_BUFS * HOP_OUT_BUF_BYTES;         // 32 KiB for the two consumers
// The ring, version 5's staging buffers, and the barriers: 192 KiB + 64 B, or 224 KiB + 64 B (of
// 227 KiB); tiles 192 wide, 160 KiB + 64 B or 192 KiB + 64 B (a fifth stage would not fit).
// Ping-pong (version 11, tiles 128 x 192 or 192 x 128) has a second set of full barriers: 192 KiB + 96 B.
constexpr int hopper_smem_bytes(bool tma_store, int bn = HOP_BN, bool ping_pong = false, int bm = HOP_BM) {
    return hopper_ring_bytes(bn, bm) + (tma_store ? HOP_OUT_BYTES : 0) + (ping_pong ? 3 : 2) * HOP_STAGES * 8;
}
constexpr int HOP_PROD_REGS = 40, HOP_CONS_REGS = 232;  // 128 * 40 + 256 * 232 = 64512 <= 65536
// Ping-pong (version 11): a consumer holds a whole tile, 192 accumulators a thread
constexpr int HOP_PP_PROD_REGS = 24, HOP_PP_CONS_REGS = 240;  // 128 * 24 + 256 * 240 = 64512 <= 65536
constexpr int HOP_GROUP_M = 8;                          // versions 4 and 5: tile rows per group
constexpr int HOP_WAIT_TRIES = 1 << 20, HOP_WAIT_HINT_NS = 1000;

// Why a kernel gave up, raised in mm_error (0: it did not). A wait that runs past its bound raises
// MM_TIMEOUT and returns; MM_MISALIGNED: the shared memory was not 1024-byte aligned, as the
// 128-byte swizzle needs. The flag stays raised until mm_error_take clears it.
enum { MM_OK = 0, MM_TIMEOUT = 1, MM_MISALIGNED = 2 };
__device__ int mm_error;

static int mm_error_take(void) {  // reads and clears the flag (the device must be idle)
    int e = MM_OK;
    CUDA_CHECK(cudaMemcpyFromSymbol(&e, mm_error, sizeof(int)));
    const int zero = MM_OK;
    CUDA_CHECK(cudaMemcpyToSymbol(mm_error, &zero, sizeof(int)));
    return e;
}

static const char* mm_error_text(int error) {
    return error == MM_TIMEOUT ? "an mbarrier wait timed out" : "shared memory not 1024-byte aligned";
}

// The register epilogue's store (the ladder's versions 2 to 4): c[at], c[at + 1] = v0, v1 as bf16,
// or += in fp32. The caller checks bounds; a pair starts at an even column of a row of even
// length, so it is 4- or 8-byte aligned.
template <typename OutT>
static __device__ __forceinline__ void mm_store_pair(OutT* c, long at, float v0, float v1) {
    if constexpr (sizeof(OutT) == 2) {
        *reinterpret_cast<__nv_bfloat162*>(c + at) = __floats2bfloat162_rn(v0, v1);
    } else {
        float2* p = reinterpret_cast<float2*>(c + at);
        float2 old = *p;
        old.x += v0;
        old.y += v1;
        *p = old;
    }
}

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

// Unit `unit` of a walk of tiles x splits units of tile_m x tile_n tiles: its tile's first row m0
// and column n0, its split, and the split's k-blocks kb0 .. kb1-1 (k_blocks cut in `splits` nearly
// equal runs, none empty while splits <= k_blocks).
struct HopperUnit {
    int m0, n0, split, kb0, kb1;
};
static __device__ __forceinline__ HopperUnit hopper_unit(int unit, int tiles_m, int tiles_n, int tile_m, int tile_n,
                                                         int group_m, int k_blocks, int splits) {
    const int tiles = tiles_m * tiles_n, split = unit / tiles;
    int tm, tn;
    hopper_tile_of(unit % tiles, tiles_m, tiles_n, group_m, &tm, &tn);
    return {tm * tile_m, tn * tile_n, split, split * k_blocks / splits, (split + 1) * k_blocks / splits};
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

// The epilogues (the kernel's EPI): versions 3 and 4 store from registers; version 5 stages C in
// shared memory and stores it by TMA; version 6 does the same with the next kernel's work fused in:
// the residual added (y = x W^T + residual), or SwiGLU (gate_up and act = silu(gate) * up), or, in
// the down matrix's input gradient, SwiGLU's backward (d_gate_up from d_mlp_act = dy W and gate_up),
// with or without the forward's act remade from the same gate and up (a recomputing layer's), or,
// in the output head's forward, the softmax's exponentials (exp(logit - a row's shift) and their
// partial row sums) in place of the logits; version 7 is version 5's on a stream-K walk, where a
// piece of a tile hands its partial to the tile's owner.
enum HopperEpilogue {
    HOP_EPI_REGISTERS,
    HOP_EPI_TMA,
    HOP_EPI_RESIDUAL,
    HOP_EPI_SWIGLU,
    HOP_EPI_SWIGLU_BWD,
    HOP_EPI_SWIGLU_BWD_ACT,
    HOP_EPI_LOGITS_EXP,
    HOP_EPI_STREAM_K
};

// A tile's rows: HOP_BM, but HOP_PP_SWIGLU_BM in ping-pong's SwiGLU forward, whose tile is three m64
// row blocks.
static __host__ __device__ constexpr int hopper_tile_m(int epi, bool pp) {
    return pp && epi == HOP_EPI_SWIGLU ? HOP_PP_SWIGLU_BM : HOP_BM;
}

// Version 7's stream-K walk. The k-blocks of all tiles, tile after tile in the walk's order
// (tiles x k_blocks in all), are cut in gridDim.x nearly equal contiguous ranges, one a block, so
// that every SM gets the same share of the products; a range may start and end inside a tile.
// Block b's units are the tiles its range touches, each clipped to the range. A tile's first piece
// (k-block 0 on) belongs to its owner, the block whose range it is; every later piece is the first
// unit of the next blocks' ranges. Such a block stores that piece's fp32 partial in its slot of the
// workspace and raises its flag; the owner, after its own piece (the last unit of its range), waits
// for the flags of blocks b+1, b+2, ... in turn and adds their partials in that order, then stores
// the tile as version 5 does. The sum's order is fixed by the shape and the grid, never by timing.
// Each block writes at most one partial, so the workspace is one tile a block (128 KiB, 16.5 MiB on
// 132 SMs). A flag holds the number of the launch that wrote it (epoch), so no launch need clear
// them. The owner waits only on blocks of higher index, which start their ranges with the awaited
// piece; blocks are dispatched in index order and the grid is one block an SM, so they are running.
// The other epilogues take an empty one (hopper_launch's default) and never read it.
struct HopperStreamK {
    float4* partials;  // [grid][2 consumers][HOP_BN / 8][128 threads]: d[j] of each consumer thread
    int* flags;        // [grid][2 consumers]: = epoch once that consumer's partial is written
    int epoch;         // this launch's number (from 1); flags of other launches never hold it
};
constexpr int HOP_SK_BARRIER = 3;  // named barriers 3, 4: the two consumers' fix-up waits (1, 2: staging)

// The first k-block (over all tiles, tile after tile) of block b's range among `blocks`.
static __device__ __forceinline__ long hopper_sk_begin(int b, long total, int blocks) { return b * total / blocks; }

// Version 7: a piece of a tile that another block finishes, by all 128 threads of consumer cw: its
// fp32 accumulator into this block's workspace slot in accumulator order (thread tid's d[j] at
// [j][tid], so a warp's store is 512 contiguous bytes, and the owner's same thread reads it back),
// then the flag raised once every thread's stores are visible at gpu scope.
static __device__ __forceinline__ void hopper_sk_put(const float (&acc)[HOP_BN / 8][4], const HopperStreamK& sk,
                                                     int cw) {
    const int tid = threadIdx.x & 127, slot = 2 * blockIdx.x + cw;
    float4* dst = sk.partials + (size_t)slot * (HOP_BN / 8) * 128 + tid;
#pragma unroll
    for (int j = 0; j < HOP_BN / 8; ++j) __stcg(dst + j * 128, make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
    __threadfence();
    named_barrier(HOP_SK_BARRIER + cw, 128);
    if (tid == 0) store_release_gpu(sk.flags + slot, sk.epoch);
}

// A flag wait that gives up like hopper_wait: false (and MM_TIMEOUT raised) after HOP_WAIT_TRIES
// tries HOP_WAIT_HINT_NS apart, or within 1024 tries once another thread of the launch has given up.
static __device__ __forceinline__ bool hopper_wait_flag(const int* flag, int value) {
    for (int i = 0; i < HOP_WAIT_TRIES; ++i) {
        if (load_acquire_gpu(flag) == value) return true;
        if ((i & 1023) == 1023 && *(volatile int*)&mm_error != MM_OK) return false;
        __nanosleep(HOP_WAIT_HINT_NS);
    }
    atomicExch(&mm_error, MM_TIMEOUT);
    return false;
}

// Version 7, the fix-up of a tile this block owns but did not finish, by all 128 threads of consumer
// cw: its last `rest` k-blocks are the first pieces of the ranges of blocks blockIdx.x + 1, + 2, ...
// (of `total` k-blocks among gridDim.x); their partials are added to acc in that order, each once
// its flag holds this launch's epoch (thread 0 waits; the barrier passes its verdict and orders the
// reads after its acquire; the reads skip L1, which may hold an earlier launch's lines). False when
// a wait timed out.
static __device__ __forceinline__ bool hopper_sk_fixup(float (&acc)[HOP_BN / 8][4], const HopperStreamK& sk, int cw,
                                                       int rest, long total) {
    const int tid = threadIdx.x & 127;
    for (int b = blockIdx.x + 1; rest > 0; ++b) {
        const int slot = 2 * b + cw;
        const bool seen = tid != 0 || hopper_wait_flag(sk.flags + slot, sk.epoch);
        if (!named_barrier_and(HOP_SK_BARRIER + cw, 128, seen)) return false;
        const float4* src = sk.partials + (size_t)slot * (HOP_BN / 8) * 128 + tid;
#pragma unroll
        for (int j = 0; j < HOP_BN / 8; ++j) {
            const float4 p = __ldcg(src + j * 128);
            acc[j][0] += p.x, acc[j][1] += p.y, acc[j][2] += p.z, acc[j][3] += p.w;
        }
        rest -= (int)(hopper_sk_begin(b + 1, total, gridDim.x) - hopper_sk_begin(b, total, gridDim.x));
    }
    return true;
}

// Version 6's operands beyond A, B and C (unused by the other epilogues), and version 8's scales.
// SwiGLU: the kernel's B map (tm_b) is W's gate half [F][K] and b_up its up half, C's map (tm_c)
// gate_up's gate half [M][F] (row stride 2F) and c_up its up half, act the map of act [M][F]. What
// an epilogue reads, through the ring, are the maps in[] (boxes {64 columns, 128 rows}): the
// residual's [M][N], C's shape; or, in SwiGLU's backward (N = F), the forward's gate_up [M][2F], its
// gate half in[0] and up half in[1] (row stride 2F), whose entries match d_mlp_act's. There C's map
// is d_gate_up's gate half [M][F] and c_up its up half; with act remade (EPI_SWIGLU_BWD_ACT), act is
// its map, as in the forward.
// The output head's (EPI_LOGITS_EXP; M = R rows of a chunk, N = V): row r's shift (its target's
// logit) and target are read; its exponentials' sum over tile column n (the target's own left
// out) goes to partials[r * hopper_logits_tiles(V) + n], the target's z = logit - shift to
// target_z[r], and overflow[r] is set to 1 if some z of the row passes HOP_EXP_MAX (kernels.cuh,
// head_loss_kernel).
struct HopperLogits {
    const float* shift;
    const int* targets;
    float *partials, *target_z;
    int* overflow;
};
struct HopperFusion {
    CUtensorMap b_up, c_up, act, in[2];
    const float *a_scale_inv, *b_scale_inv;  // version 8 (FP8 operands): stored -> real, each a device float
    HopperLogits logits;
};
// The largest exponent the head's epilogue takes: exp(64) = 6e27, so that a row's sum of up to
// Qwen3's 151936 of them, and the input gradient's products over them, stay far inside fp32.
constexpr float HOP_EXP_MAX = 64.0f;
// The head's tiles are ping-pong's (version 11), 192 columns wide.
constexpr int HOP_LOGITS_BN = HOP_BN_NARROW;
// The partial sums a row of the head's product leaves: one per tile of bn columns of V.
static __host__ __device__ __forceinline__ int hopper_logits_tiles(int V, int bn = HOP_LOGITS_BN) {
    return (V + bn - 1) / bn;
}

// How many [128 rows][64 columns] boxes an epilogue reads per chunk of 64 columns (each chunk one
// stage of the ring): the residual, or gate and up; the other epilogues read nothing.
static __host__ __device__ constexpr int hopper_epi_inputs(int epi) {
    return epi == HOP_EPI_RESIDUAL ? 1 : epi == HOP_EPI_SWIGLU_BWD || epi == HOP_EPI_SWIGLU_BWD_ACT ? 2 : 0;
}

// A consumer's view of the ring: the shared memory (stage s's A tile at a + s * a_bytes, its B tile
// at b + s * b_bytes) and the barriers (full + 8s, empty + 8s); in a cluster of two, also the other
// block's empty barriers (peer_empty + 8s, in the cluster's shared window; 0: no cluster).
struct HopperRing {
    const unsigned char *a, *b;
    int a_bytes, b_bytes;
    uint32_t full, empty, peer_empty;
};

// Hands stage st back, once per consumer warp: to this block's producer and, in a cluster, to the
// other block's, whose multicast writes half of this block's B tile into the stage too.
static __device__ __forceinline__ void hopper_release(const HopperRing& ring, int st) {
    mbar_arrive(ring.empty + 8 * st);
    if (ring.peer_empty) mbar_arrive_cluster(ring.peer_empty + 8 * st);
}

// One chunk of a consumer's epilogue, run by all 128 threads of consumer cw: 64 rows x 128 bytes of
// T (64 bf16 or 32 fp32 columns), whose word for row r + 8h and columns 8jj + 2i, +1 is word(jj, h)
// (two bf16 packed in a uint32_t, or a float2), staged in one of the consumer's two buffers in the
// 128-byte swizzle and stored by one TMA copy at (c0, t0, batch) of map (added to C when add).
// *chunks counts the consumer's chunks over its walk: chunk e goes to buffer e % 2, once the copy of
// chunk e - 2 has read it.
template <typename T, typename Word>
static __device__ __forceinline__ void hopper_stage_store(unsigned char* bufs, int cw, int* chunks,
                                                          const CUtensorMap* map, int c0, int t0, int batch, bool add,
                                                          Word word) {
    static_assert(sizeof(decltype(word(0, 0))) == 2 * sizeof(T), "a word is two columns of T");
    const int tid = threadIdx.x & 127;
    unsigned char* buf = bufs + (*chunks % HOP_OUT_BUFS) * HOP_OUT_BUF_BYTES;
    if (tid == 0) bulk_wait_read_but<HOP_OUT_BUFS - 1>();  // the copy that used buf last has read it
    named_barrier(1 + cw, 128);
    wg_stage_panel(buf, word);
    wg_fence_proxy_async();  // the writes above, before the copy engine reads them
    named_barrier(1 + cw, 128);
    if (tid == 0) {
        if (add) tma_store_3d<true>(map, attn_smem_u32(buf), c0, t0, batch);
        else tma_store_3d<false>(map, attn_smem_u32(buf), c0, t0, batch);
    }
    ++*chunks;
}

// What version 6's epilogue reads for one chunk of 64 columns, by all 128 threads of consumer cw:
// waits for the chunk's stage (ring use *t), reads the entries that match this thread's
// accumulator (rows 64cw + r and + 8, columns 8jj + 2i, +1 of the chunk, a pair a word) of each of
// the N_IN boxes (the stage's A tile, then its B tile) into in[], and hands the stage back. A
// consumer whose rows lie past M (read = false) takes and hands back the stages all the same, so
// that both count the ring alike. False when the wait timed out.
template <int N_IN>
static __device__ __forceinline__ bool hopper_take_inputs(uint32_t (&in)[N_IN][8][2], const HopperRing& ring, int* t,
                                                          int cw, bool read) {
    const int st = *t % HOP_STAGES, tid = threadIdx.x & 127, r = 64 * cw + wg_acc_row(tid);
    if (!hopper_wait(ring.full + 8 * st, (*t / HOP_STAGES) & 1)) return false;
    const unsigned char* box[2] = {ring.a + st * ring.a_bytes, ring.b + st * ring.b_bytes};
    if (read)
#pragma unroll
        for (int k = 0; k < N_IN; ++k)
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                const int b = (8 * jj + 2 * wg_acc_pair(tid)) * 2;
                in[k][jj][0] = *reinterpret_cast<const uint32_t*>(box[k] + swizzle_128b(r, b));
                in[k][jj][1] = *reinterpret_cast<const uint32_t*>(box[k] + swizzle_128b(r + 8, b));
            }
    __syncwarp();  // the warp's reads, before its arrive frees the stage
    if ((threadIdx.x & 31) == 0) hopper_release(ring, st);
    ++*t;
    return true;
}

static __device__ __forceinline__ float hopper_bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
static __device__ __forceinline__ float hopper_bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// The output head's epilogue (EPI_LOGITS_EXP), by all 128 threads of consumer cw: for its rows r of
// logits z[r][c] = acc - shift[r] (the tile's columns n0 .. n0+BN-1, rows row0 .. row0+63) it stores
// exp(z) in bf16, in place of the logits, and sums exp(z) over the tile's columns but the target's,
// whose z it keeps instead: the softmax's denominator in partial sums, the target's term left out
// (kernels.cuh's head_loss_kernel adds it back, and writes the others' sum over it). A z past
// HOP_EXP_MAX is clamped there, and its row marked for head_loss_kernel to remake; a NaN passes
// through. A row's columns are spread over the 4 threads of a quad (lib/ptx.cuh), whose sums are
// added by two shuffles: each partial is one fixed order of fp32 adds.
template <int BN>
static __device__ __forceinline__ void hopper_store_logits_exp(const float (&acc)[BN / 8][4],
                                                               const CUtensorMap* tm_c, const HopperLogits& lg,
                                                               unsigned char* bufs, int cw, int* chunks, int row0,
                                                               int n0, int M, int N) {
    constexpr int COLS = 64, J_PER_CHUNK = COLS / 8;  // bf16: a chunk's columns, and its d[j]
    const int tid = threadIdx.x & 127, r = row0 + wg_acc_row(tid), pair = 2 * wg_acc_pair(tid);
    float shift[2], sum[2] = {0.f, 0.f};
    int target[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows r and r + 8
        const bool in = r + 8 * h < M;
        shift[h] = in ? lg.shift[r + 8 * h] : 0.f;
        target[h] = in ? lg.targets[r + 8 * h] : -1;
    }
#pragma unroll
    for (int q = 0; q < BN / COLS; ++q) {
        const int col0 = n0 + q * COLS;
        if (col0 >= N) break;
        uint32_t p[J_PER_CHUNK][2];
#pragma unroll
        for (int jj = 0; jj < J_PER_CHUNK; ++jj)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float e[2];
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const int col = col0 + 8 * jj + pair + k;
                    const float z = acc[q * J_PER_CHUNK + jj][2 * h + k] - shift[h];
                    e[k] = __expf(z > HOP_EXP_MAX ? HOP_EXP_MAX : z);  // a NaN is not > HOP_EXP_MAX: it passes on
                    if (col == target[h]) lg.target_z[r + 8 * h] = z;
                    else if (col < N) sum[h] += e[k];
                    if (z > HOP_EXP_MAX && col < N) lg.overflow[r + 8 * h] = 1;
                }
                p[jj][h] = attn_pack_bf16(e[0], e[1]);
            }
        hopper_stage_store<bf16>(bufs, cw, chunks, tm_c, col0, row0, 0, false, [&](int jj, int h) { return p[jj][h]; });
    }
    const int tiles_n = hopper_logits_tiles(N, BN);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
        if (pair == 0 && r + 8 * h < M) lg.partials[(size_t)(r + 8 * h) * tiles_n + n0 / BN] = sum[h];
    }
}

// Versions 5 and 6's epilogue, run by all 128 threads of consumer cw: its 64 x BN accumulator
// (rows row0 .. row0+63, columns from n0; splits > 1: split `batch`'s partial) in chunks of 128
// bytes a row. EPI_TMA: C itself, bf16 or fp32 (added to C when add). EPI_RESIDUAL: bf16 acc +
// residual. EPI_SWIGLU: the 256 columns are gate columns n0 .. n0+127 (d[0..15]) and the up columns
// of the same features (d[16..31]), so this thread holds gate and up of each feature it holds; per
// 64 features it stores gate, up and act = swiglu8(gate, up) of the bf16-rounded values, as
// swiglu_forward computes from the stored gate_up. EPI_SWIGLU_BWD: the 256 columns are d_mlp_act's
// features n0 .., rounded to bf16 as a stored d_mlp_act would be; with gate and up of the same
// entries swiglu_backward8 makes d_gate and d_up, stored per 64 features into d_gate_up's two
// halves: swiglu_backward's bits on that d_mlp_act. EPI_SWIGLU_BWD_ACT stores act = silu(gate) * up
// of the same entries first (swiglu1 two features a word, rounded as swiglu8 rounds them:
// swiglu_forward's bits on the stored gate_up). The residual, gate and up come a chunk at a time
// through the ring (hopper_take_inputs; ring use *t). Chunks wholly past M or N (SwiGLU: F) are
// skipped, the same for the whole warpgroup (a chunk past M still takes its stage); TMA clips the
// others. False when a wait for the ring timed out.
template <int EPI, typename T, int BN>
static __device__ __forceinline__ bool hopper_store_tma(const float (&acc)[BN / 8][4], const HopperRing& ring,
                                                        int* t, const CUtensorMap* tm_c, const HopperFusion& fuse,
                                                        unsigned char* bufs, int cw, int row0, int n0, int batch,
                                                        bool add, int M, int N, int* chunks) {
    constexpr int COLS = 128 / sizeof(T), J_PER_CHUNK = COLS / 8;  // a chunk's columns, and its d[j]
    static_assert(hopper_epi_inputs(EPI) == 0 || sizeof(T) == 2, "the ring's input chunks are 64 bf16 columns");
    if (hopper_epi_inputs(EPI) == 0 && row0 >= M) return true;
    if constexpr (EPI == HOP_EPI_SWIGLU) {
#pragma unroll
        for (int q = 0; q < BN / 2 / COLS; ++q) {
            const int f0 = n0 + q * COLS;
            if (f0 >= N) break;
            uint32_t gate[J_PER_CHUNK][2], up[J_PER_CHUNK][2], act[J_PER_CHUNK][2];
#pragma unroll
            for (int jj = 0; jj < J_PER_CHUNK; ++jj)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int j = q * J_PER_CHUNK + jj;
                    gate[jj][h] = attn_pack_bf16(acc[j][2 * h], acc[j][2 * h + 1]);
                    up[jj][h] = attn_pack_bf16(acc[j + BN / 16][2 * h], acc[j + BN / 16][2 * h + 1]);
                }
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int p = 0; p < J_PER_CHUNK / 4; ++p) {  // 8 features at a time, as swiglu8 takes them
                    bf16x8 g, u;
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        reinterpret_cast<uint32_t*>(g.v)[w] = gate[4 * p + w][h];
                        reinterpret_cast<uint32_t*>(u.v)[w] = up[4 * p + w][h];
                    }
                    const bf16x8 y = swiglu8(g, u);
#pragma unroll
                    for (int w = 0; w < 4; ++w) act[4 * p + w][h] = reinterpret_cast<const uint32_t*>(y.v)[w];
                }
            const CUtensorMap* maps[3] = {tm_c, &fuse.c_up, &fuse.act};  // gate, up, act: 64 features each
            const uint32_t(*words[3])[2] = {gate, up, act};
#pragma unroll
            for (int o = 0; o < 3; ++o)
                hopper_stage_store<T>(bufs, cw, chunks, maps[o], f0, row0, 0, false,
                                      [&](int jj, int h) { return words[o][jj][h]; });
        }
    } else if constexpr (EPI == HOP_EPI_SWIGLU_BWD || EPI == HOP_EPI_SWIGLU_BWD_ACT) {
#pragma unroll
        for (int q = 0; q < HOP_BN / COLS; ++q) {
            const int f0 = n0 + q * COLS;
            if (f0 >= N) break;
            uint32_t gate_up[2][8][2];  // gate's entries, then up's
            if (!hopper_take_inputs<2>(gate_up, ring, t, cw, row0 < M)) return false;
            if (row0 >= M) continue;
            if constexpr (EPI == HOP_EPI_SWIGLU_BWD_ACT)  // first: only gate and up are held beside acc
                hopper_stage_store<T>(bufs, cw, chunks, &fuse.act, f0, row0, 0, false, [&](int jj, int h) {
                    const uint32_t g = gate_up[0][jj][h], u = gate_up[1][jj][h];
                    return attn_pack_bf16(swiglu1(hopper_bf16_lo(g), hopper_bf16_lo(u)),
                                          swiglu1(hopper_bf16_hi(g), hopper_bf16_hi(u)));
                });
            uint32_t d_gate[J_PER_CHUNK][2], d_up[J_PER_CHUNK][2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int p = 0; p < J_PER_CHUNK / 4; ++p) {  // 8 features at a time, as swiglu_backward8 takes them
                    bf16x8 g, u, dy, dg, du;
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        const int jj = 4 * p + w;
                        const float (&d)[4] = acc[q * J_PER_CHUNK + jj];
                        reinterpret_cast<uint32_t*>(dy.v)[w] = attn_pack_bf16(d[2 * h], d[2 * h + 1]);
                        reinterpret_cast<uint32_t*>(g.v)[w] = gate_up[0][jj][h];
                        reinterpret_cast<uint32_t*>(u.v)[w] = gate_up[1][jj][h];
                    }
                    swiglu_backward8(&dg, &du, g, u, dy);
#pragma unroll
                    for (int w = 0; w < 4; ++w) {
                        d_gate[4 * p + w][h] = reinterpret_cast<const uint32_t*>(dg.v)[w];
                        d_up[4 * p + w][h] = reinterpret_cast<const uint32_t*>(du.v)[w];
                    }
                }
            hopper_stage_store<T>(bufs, cw, chunks, tm_c, f0, row0, 0, false,
                                  [&](int jj, int h) { return d_gate[jj][h]; });
            hopper_stage_store<T>(bufs, cw, chunks, &fuse.c_up, f0, row0, 0, false,
                                  [&](int jj, int h) { return d_up[jj][h]; });
        }
    } else if constexpr (EPI == HOP_EPI_LOGITS_EXP) {
        hopper_store_logits_exp<BN>(acc, tm_c, fuse.logits, bufs, cw, chunks, row0, n0, M, N);
    } else {
#pragma unroll
        for (int q = 0; q < BN / COLS; ++q) {
            const int col0 = n0 + q * COLS;
            if (col0 >= N) break;
            if constexpr (EPI == HOP_EPI_RESIDUAL) {
                uint32_t residual[1][8][2];
                if (!hopper_take_inputs<1>(residual, ring, t, cw, row0 < M)) return false;
                if (row0 >= M) continue;
                hopper_stage_store<T>(bufs, cw, chunks, tm_c, col0, row0, batch, false, [&](int jj, int h) {
                    const float (&d)[4] = acc[q * J_PER_CHUNK + jj];
                    const uint32_t rw = residual[0][jj][h];
                    return attn_pack_bf16(d[2 * h] + hopper_bf16_lo(rw), d[2 * h + 1] + hopper_bf16_hi(rw));
                });
            } else if constexpr (sizeof(T) == 2) {
                hopper_stage_store<T>(bufs, cw, chunks, tm_c, col0, row0, batch, add, [&](int jj, int h) {
                    const float (&d)[4] = acc[q * J_PER_CHUNK + jj];
                    return attn_pack_bf16(d[2 * h], d[2 * h + 1]);
                });
            } else {
                hopper_stage_store<T>(bufs, cw, chunks, tm_c, col0, row0, batch, add, [&](int jj, int h) {
                    const float (&d)[4] = acc[q * J_PER_CHUNK + jj];
                    return make_float2(d[2 * h], d[2 * h + 1]);
                });
            }
        }
    }
    return true;
}

// EPI (HopperEpilogue): HOP_EPI_REGISTERS, versions 3 and 4, stores to c from registers (tm_c
// unused); the others store through tm_c (c unused): HOP_EPI_TMA (version 5) bf16 C, fp32 C added
// to (splits 1), or the fp32 partials of `splits` > 1 (batch = split); version 6's fused epilogues
// (splits 1) with the operands of `fuse`. HOP_EPI_SWIGLU walks tiles of BN / 2 features (N = F):
// its B tile is W's BN / 2 gate rows of them and the BN / 2 up rows (tm_b and fuse.b_up), two boxes
// a stage.
// HOP_EPI_SWIGLU_BWD (and _ACT) is the plain input gradient's product (N = F), tile for tile.
// HOP_EPI_STREAM_K (version 7, splits 1): version 5's epilogue on the stream-K walk of `sk`.
// BN: the tile's width, HOP_BN; or HOP_BN_NARROW (versions 5 and 9's plain bf16 products, stored
// by TMA, where that fills the waves better; ping-pong's tiles): B's tile, the accumulator (96
// registers a thread instead of 128) and wgmma's n shrink with it, and a stage is 40 KiB.
// PP (version 11, splits 1, the TMA epilogues that read no inputs): ping-pong, a tile a consumer
// (the file's comment), 128 x HOP_BN_NARROW, or for SwiGLU 192 x 128 (hopper_tile_m).
template <bool A_K, bool B_K, typename OutT, int EPI, typename AT = bf16, typename BT = bf16, int CLUSTER = 1,
          int BN = HOP_BN, bool PP = false>
__global__ void __launch_bounds__(HOP_THREADS, 1)
    hopper_matmul_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                         const __grid_constant__ CUtensorMap tm_c, const __grid_constant__ HopperFusion fuse,
                         OutT* __restrict__ c, int M, int N, int K, int group_m, int splits,
                         const __grid_constant__ HopperStreamK sk) {
    constexpr bool TMA_STORE = EPI != HOP_EPI_REGISTERS, SWIGLU = EPI == HOP_EPI_SWIGLU;
    constexpr bool STREAM_K = EPI == HOP_EPI_STREAM_K;
    constexpr int TILE_N = SWIGLU ? BN / 2 : BN;  // the columns of C (SwiGLU: features) a tile covers
    constexpr int BM = hopper_tile_m(EPI, PP);    // and its rows
    constexpr int A_BYTES = hop_a_bytes(BM), B_BYTES = hop_b_bytes(BN), RING_BYTES = hopper_ring_bytes(BN, BM);
    constexpr bool FP8 = sizeof(AT) == 1;                 // version 8
    constexpr int BK = hop_bk<AT>;
    static_assert(sizeof(AT) == sizeof(BT) && (!FP8 || std::is_same_v<BT, __nv_fp8_e4m3>),
                  "operands: both bf16, or FP8 with B in E4M3 (the trainer's pairs, lib/ptx.cuh)");
    static_assert(!FP8 || (A_K && B_K && (EPI == HOP_EPI_TMA)),
                  "FP8 wgmma takes K-major operands only (the TN form), stored by version 5's epilogue");
    static_assert(!SWIGLU || (A_K && B_K), "SwiGLU fuses into the forward, whose operands are K-major");
    static_assert((EPI != HOP_EPI_SWIGLU_BWD && EPI != HOP_EPI_SWIGLU_BWD_ACT) || (A_K && !B_K && sizeof(OutT) == 2),
                  "SwiGLU's backward fuses into an input gradient: dy K-major, W N-major, bf16 out");
    static_assert(EPI != HOP_EPI_LOGITS_EXP || (A_K && B_K && sizeof(OutT) == 2),
                  "the softmax's exponentials fuse into the head's forward: x and E K-major, bf16 out");
    constexpr bool MULTICAST = CLUSTER == 2;  // version 9: B's tile shared by a cluster of two blocks
    constexpr uint16_t BOTH_BLOCKS = (1 << CLUSTER) - 1;  // a multicast's cta_mask: every block of the cluster
    static_assert(CLUSTER == 1 || (MULTICAST && TMA_STORE && !STREAM_K),
                  "clusters of two, on the TMA epilogues' grid walk");
    constexpr int EPI_INPUTS = hopper_epi_inputs(EPI);  // boxes an epilogue chunk reads through the ring
    static_assert(BN == HOP_BN ||
                      (BN == HOP_BN_NARROW && !FP8 && (EPI == HOP_EPI_TMA || (PP && EPI == HOP_EPI_LOGITS_EXP))) ||
                      (BN == HOP_PP_SWIGLU_BN && PP && SWIGLU),
                  "tiles HOP_BN_NARROW wide: versions 5 and 9's plain bf16 products, ping-pong's (and the head's); "
                  "HOP_PP_SWIGLU_BN wide: ping-pong's SwiGLU");
    static_assert(!PP || ((BN == HOP_BN_NARROW || SWIGLU) && CLUSTER == 1 && !FP8 && !STREAM_K && TMA_STORE &&
                          EPI_INPUTS == 0),
                  "ping-pong: a tile a consumer, on the TMA epilogues that read no inputs");
    constexpr int ROW_BLOCKS = PP ? BM / 64 : 1;  // a consumer's m64 row blocks (ping-pong: all the tile's)
    constexpr int FULL_SETS = PP ? 2 : 1;         // ping-pong: a set of full barriers a consumer
    extern __shared__ __align__(1024) unsigned char hopper_smem[];
    const uint32_t a_tiles = attn_smem_u32(hopper_smem), b_tiles = a_tiles + HOP_STAGES * A_BYTES;
    unsigned char* out_bufs = hopper_smem + RING_BYTES;  // version 5: consumer c's are the c-th pair
    const uint32_t full = a_tiles + RING_BYTES + (TMA_STORE ? HOP_OUT_BYTES : 0);  // 8 bytes a barrier
    const uint32_t empty = full + 8 * HOP_STAGES * FULL_SETS;
    if (a_tiles % 1024 != 0) {  // the same for every thread: all leave
        if (threadIdx.x == 0) atomicExch(&mm_error, MM_MISALIGNED);
        return;
    }
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + TILE_N - 1) / TILE_N;
    const int k_blocks = (K + BK - 1) / BK;
    // version 9: a cluster walks pairs of tiles, one above the other (the second past M when
    // tiles_m is odd), block rank r taking row tile 2p + r of pair row p
    const int rank = MULTICAST ? (int)cluster_rank() : 0;
    const int units = (MULTICAST ? (tiles_m + 1) / 2 : tiles_m) * tiles_n * splits;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    // The block's units: first, first + step, ... below last; version 7: the tiles its range
    // sk_begin .. sk_end-1 of all k-blocks touches, each clipped to it (block_unit).
    int first = blockIdx.x / CLUSTER, last = units, step = gridDim.x / CLUSTER;
    const long sk_total = STREAM_K ? (long)units * k_blocks : 0;
    const long sk_begin = hopper_sk_begin(blockIdx.x, sk_total, gridDim.x);
    const long sk_end = hopper_sk_begin(blockIdx.x + 1, sk_total, gridDim.x);
    if constexpr (STREAM_K) first = (int)(sk_begin / k_blocks), last = (int)((sk_end - 1) / k_blocks) + 1, step = 1;
    auto block_unit = [&](int unit) {
        if constexpr (MULTICAST) {  // pair rows: a group of group_m tile rows is group_m / 2 of them
            HopperUnit u =
                hopper_unit(unit, (tiles_m + 1) / 2, tiles_n, BM, TILE_N, max(1, group_m / 2), k_blocks, splits);
            u.m0 = 2 * u.m0 + rank * BM;
            return u;
        }
        HopperUnit u = hopper_unit(unit, tiles_m, tiles_n, BM, TILE_N, group_m, k_blocks, splits);
        if constexpr (STREAM_K) {
            const long tile_begin = (long)unit * k_blocks;
            u.kb0 = sk_begin > tile_begin ? (int)(sk_begin - tile_begin) : 0;
            u.kb1 = sk_end < tile_begin + k_blocks ? (int)(sk_end - tile_begin) : k_blocks;
        }
        return u;
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < HOP_STAGES * FULL_SETS; ++s) mbar_init(full + 8 * s, 1);  // the producer's arrive
        for (int s = 0; s < HOP_STAGES; ++s)
            mbar_init(empty + 8 * s, (PP ? 4 : 8) * CLUSTER);  // one arrive per consumer warp taking it
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if constexpr (MULTICAST) cluster_sync();  // both blocks' barriers set up before either signals the other's
    else __syncthreads();

    if (wg == 0) {  // producer
        setmaxnreg_dec<PP ? HOP_PP_PROD_REGS : HOP_PROD_REGS>();
        // Ring use t (a k-block, or an epilogue's chunk): once the stage's previous use (t - STAGES)
        // is done (its empty phase use-1 completed), announce the bytes to come on its full barrier.
        auto claim = [&](int t, uint32_t bar, uint32_t bytes) {
            const int st = t % HOP_STAGES, use = t / HOP_STAGES;
            if (use > 0 && !hopper_wait(empty + 8 * st, (use - 1) & 1)) return false;
            mbar_expect_tx(bar, bytes);
            return true;
        };
        if (threadIdx.x == 0) {
            int t = 0;  // stages loaded so far
            for (int unit = first, i = 0; unit < last; unit += step, ++i) {
                const HopperUnit u = block_unit(unit);
                const uint32_t full_set = full + (PP ? 8 * HOP_STAGES * (i & 1) : 0);  // (ping-pong: its consumer's)
                // (a cluster's second tile past M loads no A, nor a K-major B its half wholly past N:
                // what they would feed is never stored)
                const int a_panels = max(0, min(BM / 64, (M - u.m0 + 63) / 64));
                const int b_panels = min(BN / 64, (N - u.n0 + 63) / 64);
                const int b_halves = MULTICAST && B_K && !SWIGLU && N - u.n0 <= BN / 2 ? 1 : 2;
                const uint32_t bytes = (A_K ? (a_panels ? A_BYTES : 0) : a_panels * HOP_PANEL_BYTES) +
                                       (B_K ? b_halves * (B_BYTES / 2) : b_panels * HOP_PANEL_BYTES);
                for (int kb = u.kb0; kb < u.kb1; ++kb, ++t) {
                    const int st = t % HOP_STAGES;
                    const uint32_t bar = full_set + 8 * st;
                    if (!claim(t, bar, bytes)) return;
                    const uint32_t as = a_tiles + st * A_BYTES, bs = b_tiles + st * B_BYTES;
                    const int k0 = kb * BK;
                    if constexpr (A_K) {
                        if (a_panels) tma_load_3d(as, &tm_a, k0, u.m0, 0, bar);  // box {64 k, BM m}
                    } else {
                        for (int p = 0; p < a_panels; ++p)  // boxes {64 m, 64 k}
                            tma_load_3d(as + p * HOP_PANEL_BYTES, &tm_a, u.m0 + 64 * p, k0, 0, bar);
                    }
                    if constexpr (MULTICAST) {  // this block's half of B, into both blocks
                        // (tm_b's boxes are BN / 2 rows; SwiGLU: rank 0 the gate rows, rank 1 the up rows)
                        const uint32_t half = bs + rank * (B_BYTES / 2);
                        if constexpr (SWIGLU)
                            tma_load_3d_multicast(half, rank ? &fuse.b_up : &tm_b, k0, u.n0, 0, bar, BOTH_BLOCKS);
                        else if constexpr (B_K) {
                            if (rank < b_halves)
                                tma_load_3d_multicast(half, &tm_b, k0, u.n0 + rank * (BN / 2), 0, bar, BOTH_BLOCKS);
                        } else
                            for (int p = 2 * rank; p < min(2 * rank + 2, b_panels); ++p)
                                tma_load_3d_multicast(bs + p * HOP_PANEL_BYTES, &tm_b, u.n0 + 64 * p, k0, 0, bar,
                                                      BOTH_BLOCKS);
                    } else if constexpr (SWIGLU) {  // boxes {64 k, BN / 2 features}: gate rows, then up rows
                        tma_load_3d(bs, &tm_b, k0, u.n0, 0, bar);
                        tma_load_3d(bs + B_BYTES / 2, &fuse.b_up, k0, u.n0, 0, bar);
                    } else if constexpr (B_K) {
                        tma_load_3d(bs, &tm_b, k0, u.n0, 0, bar);  // box {64 k, BN n}
                    } else {
                        for (int p = 0; p < b_panels; ++p)  // boxes {64 n, 64 k}
                            tma_load_3d(bs + p * HOP_PANEL_BYTES, &tm_b, u.n0 + 64 * p, k0, 0, bar);
                    }
                }
                // then what the tile's epilogue reads, a stage a chunk of 64 columns (hopper_take_inputs)
                for (int col0 = u.n0; EPI_INPUTS > 0 && col0 < min(u.n0 + BN, N); col0 += 64, ++t) {
                    const int st = t % HOP_STAGES;
                    const uint32_t bar = full + 8 * st;
                    if (!claim(t, bar, u.m0 < M ? EPI_INPUTS * BM * 128 : 0)) return;
                    if (u.m0 >= M) continue;  // a cluster's second tile past M: the stage is taken, empty
                    tma_load_3d(a_tiles + st * A_BYTES, &fuse.in[0], col0, u.m0, 0, bar);
                    if (EPI_INPUTS > 1) tma_load_3d(b_tiles + st * B_BYTES, &fuse.in[1], col0, u.m0, 0, bar);
                }
            }
        }
        return;
    }

    // consumers
    setmaxnreg_inc<PP ? HOP_PP_CONS_REGS : HOP_CONS_REGS>();
    const int cw = wg - 1;
    const bool store_thread = TMA_STORE && (threadIdx.x & 127) == 0;  // issues the consumer's TMA stores
    // wgmma's accumulator layout (lib/ptx.cuh): d[j] holds columns 8j .. 8j+7; ping-pong: the tile's row blocks
    float accs[ROW_BLOCKS][BN / 8][4];
    auto& acc = accs[0];
    uint32_t phases = 0;  // ping-pong: bit s, the parity of this consumer's next wait on stage s
    // version 8: real = alpha x the product of the stored FP8 values, read once a launch (the scales are the device's)
    const float alpha = FP8 ? *fuse.a_scale_inv * *fuse.b_scale_inv : 1.0f;
    int t = 0;                // stages consumed so far (k-blocks, and version 6's input chunks)
    int chunks = 0;           // versions 5, 6: chunks this consumer has staged
    const HopperRing ring = {hopper_smem, hopper_smem + HOP_STAGES * A_BYTES, A_BYTES, B_BYTES, full, empty,
                             MULTICAST ? cluster_map_shared(empty, rank ^ 1) : 0u};
    for (int unit = first, i = 0; unit < last; unit += step, ++i) {
        const HopperUnit u = block_unit(unit);
        if (PP && (i & 1) != cw) {  // the other consumer's tile: its k-blocks go by
            t += u.kb1 - u.kb0;
            continue;
        }
#pragma unroll
        for (int rb = 0; rb < ROW_BLOCKS; ++rb)
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) accs[rb][j][e] = 0.f;
        for (int kb = u.kb0; kb < u.kb1; ++kb, ++t) {
            const int st = t % HOP_STAGES;
            const uint32_t parity = PP ? (phases >> st) & 1 : (t / HOP_STAGES) & 1;
            if (PP) phases ^= 1u << st;
            if (!hopper_wait(full + 8 * (PP ? HOP_STAGES * cw + st : st), parity)) {
                wg_wait<0>();                          // leave no product in flight
                if (store_thread) bulk_wait<false>();  // nor a store reading shared memory
                return;
            }
            constexpr uint32_t A_ROW_BLOCK = A_K ? 64 * 128 : HOP_PANEL_BYTES;  // A's rows 64.. in a stage
            const uint32_t as = a_tiles + st * A_BYTES + (PP ? 0 : cw * A_ROW_BLOCK);
            const uint32_t bs = b_tiles + st * B_BYTES;
            if constexpr (FP8) {
                // Version 8: the tensor cores sum FP8 products in less than fp32 (the promotion in
                // doc/matmul.md), so each k-block's 128 k are summed afresh, 128 columns at a time
                // (4 m64n128k32 into part, the first overwriting it), and then added, times alpha,
                // into the fp32 totals acc by the CUDA cores. The stage is free once both halves are.
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float part[BN / 16][4];
                    wg_fence();
#pragma unroll
                    for (int kk = 0; kk < BK / 32; ++kk)
                        wg_mma_fp8_n128<std::is_same_v<AT, __nv_fp8_e5m2>>(
                            part, wg_desc(as + kk * 32), wg_desc(bs + h * (BN / 2) * 128 + kk * 32), kk > 0);
                    wg_commit();
                    wg_wait<0>();
                    wg_fence_regs(part);
#pragma unroll
                    for (int j = 0; j < BN / 16; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            acc[h * BN / 16 + j][e] = fmaf(alpha, part[j][e], acc[h * BN / 16 + j][e]);
                }
                if (lane == 0) hopper_release(ring, st);
                continue;
            }
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < HOP_BK / 16; ++kk) {
                const uint32_t a_step = A_K ? kk * 32 : kk * 16 * 128;
                const uint64_t da = wg_desc(as + a_step);
                const uint64_t db = B_K ? wg_desc(bs + kk * 32) : wg_desc(bs + kk * 16 * 128, HOP_PANEL_BYTES);
                wg_mma_ss<BN, 1, A_K ? 0 : 1, B_K ? 0 : 1>(acc, da, db);
#pragma unroll
                for (int rb = 1; rb < ROW_BLOCKS; ++rb)  // ping-pong: the tile's other row blocks, times the same B
                    wg_mma_ss<BN, 1, A_K ? 0 : 1, B_K ? 0 : 1>(accs[rb], wg_desc(as + rb * A_ROW_BLOCK + a_step), db);
            }
            wg_commit();
            wg_wait<1>();  // k-block kb-1's products are done: its stage can be refilled
            if (kb > u.kb0 && lane == 0) hopper_release(ring, (t - 1) % HOP_STAGES);
        }
        if constexpr (!FP8) {  // (version 8 waited for each k-block and handed its stage back)
            wg_wait<0>();
#pragma unroll
            for (int rb = 0; rb < ROW_BLOCKS; ++rb) wg_fence_regs(accs[rb]);
            if (u.kb1 > u.kb0 && lane == 0) hopper_release(ring, (t - 1) % HOP_STAGES);
        }

        if constexpr (STREAM_K) {
            if (u.kb0 > 0) {  // a later piece of a tile: its owner adds it
                hopper_sk_put(acc, sk, cw);
                continue;
            }
            if (u.kb1 < k_blocks && !hopper_sk_fixup(acc, sk, cw, k_blocks - u.kb1, sk_total)) {
                if (store_thread) bulk_wait<false>();  // the wait timed out: leave no store reading shared memory
                return;
            }
        }
        if constexpr (PP) {  // the whole tile is this consumer's, all its row blocks (no inputs: no wait to fail)
#pragma unroll
            for (int rb = 0; rb < ROW_BLOCKS; ++rb)
                hopper_store_tma<EPI, OutT, BN>(accs[rb], ring, &t, &tm_c, fuse,
                                                out_bufs + cw * HOP_OUT_BUFS * HOP_OUT_BUF_BYTES, cw, u.m0 + 64 * rb,
                                                u.n0, u.split, sizeof(OutT) == 4 && splits == 1, M, N, &chunks);
        } else if constexpr (TMA_STORE) {
            if (!hopper_store_tma<STREAM_K ? HOP_EPI_TMA : EPI, OutT, BN>(
                    acc, ring, &t, &tm_c, fuse, out_bufs + cw * HOP_OUT_BUFS * HOP_OUT_BUF_BYTES, cw, u.m0 + 64 * cw,
                    u.n0, u.split, sizeof(OutT) == 4 && splits == 1, M, N, &chunks)) {
                if (store_thread) bulk_wait<false>();  // a wait for the ring timed out
                return;
            }
        } else {
            // Versions 3 and 4: warp w of the consumer holds rows 16w + g and 16w + g + 8 of its 64,
            // columns 8j + 2i and 8j + 2i + 1 of d[j] (lane = 4g + i).
            const int row = u.m0 + cw * 64 + (warp & 3) * 16 + (lane >> 2), col0 = u.n0 + 2 * (lane & 3);
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = col0 + 8 * j;
                if (col >= N) continue;
                if (row < M) mm_store_pair(c, (long)row * N + col, acc[j][0], acc[j][1]);
                if (row + 8 < M) mm_store_pair(c, (long)(row + 8) * N + col, acc[j][2], acc[j][3]);
            }
        }
    }
    if (store_thread) bulk_wait<false>();  // every store done before the block's shared memory goes
    // and, in a cluster, the other block's last arrives on this block's barriers done too
    if constexpr (MULTICAST) cluster_sync();
}

// A launch of `grid` blocks of the kernel with `smem` bytes of shared memory on stream s, in
// clusters of `cluster` blocks (1: a plain launch); *attr holds the cluster's attribute.
static cudaLaunchConfig_t hopper_launch_config(int grid, int smem, int cluster, cudaStream_t s,
                                               cudaLaunchAttribute* attr) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid), config.blockDim = dim3(HOP_THREADS), config.dynamicSmemBytes = smem;
    config.stream = s;
    *attr = {};
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = cluster, attr->val.clusterDim.y = 1, attr->val.clusterDim.z = 1;
    config.attrs = attr, config.numAttrs = cluster > 1;
    return config;
}

// One launch of the kernel, its shared memory allowed first (past the 48 KiB default); CLUSTER 2:
// in clusters of two blocks (grid even), whose B tiles each load half of (version 9); BN: the
// tiles' width (tm_b's K-major boxes BN rows, or BN / 2 in clusters of two).
template <bool A_K, bool B_K, typename OutT, int EPI, typename AT = bf16, typename BT = bf16, int CLUSTER = 1,
          int BN = HOP_BN, bool PP = false>
static void hopper_launch(const CUtensorMap& tm_a, const CUtensorMap& tm_b, const CUtensorMap& tm_c,
                          const HopperFusion& fuse, OutT* c, int M, int N, int K, int grid, int group_m, int splits,
                          cudaStream_t s, const HopperStreamK& sk = {}) {
    constexpr int smem = hopper_smem_bytes(EPI != HOP_EPI_REGISTERS, BN, PP, hopper_tile_m(EPI, PP));
    if (PP && splits != 1) {  // a consumer's tile is its whole product: nothing would add the splits
        fprintf(stderr, "hopper_launch: ping-pong takes K in one split, not %d\n", splits);
        exit(1);
    }
    auto kernel = hopper_matmul_kernel<A_K, B_K, OutT, EPI, AT, BT, CLUSTER, BN, PP>;
    attn_allow_smem(kernel, smem);
    cudaLaunchAttribute cluster;
    const cudaLaunchConfig_t config = hopper_launch_config(grid, smem, CLUSTER, s, &cluster);
    CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, tm_a, tm_b, tm_c, fuse, c, M, N, K, group_m, splits, sk));
}

// The SMs of the current device: the persistent grid's size.
static int hopper_sms(void) {
    static int sms = 0;
    if (!sms) {
        int device;
        CUDA_CHECK(cudaGetDevice(&device));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    }
    return sms;
}

// How many clusters of two blocks of the kernel the GPU runs at once. A cluster's blocks run on SMs
// of one GPC, and GPCs may hold odd numbers of SMs, so this can be less than SMs / 2; a persistent
// grid of more clusters than this would run its last ones after the others' whole walks.
static int hopper_cluster_slots(void) {
    static int slots = 0;
    if (!slots) {
        auto kernel = hopper_matmul_kernel<true, true, bf16, HOP_EPI_TMA, bf16, bf16, 2>;
        // the most a cluster instance takes: one block an SM, at either tile width
        constexpr int smem = hopper_smem_bytes(true);
        attn_allow_smem(kernel, smem);
        cudaLaunchAttribute cluster;
        const cudaLaunchConfig_t config = hopper_launch_config(hopper_sms() / 2 * 2, smem, 2, 0, &cluster);
        CUDA_CHECK(cudaOccupancyMaxActiveClusters(&slots, kernel, &config));
        if (slots < 1) {
            fprintf(stderr, "matmul: no cluster of two blocks of our GEMM fits on this GPU\n");
            exit(1);
        }
    }
    return slots;
}

// The persistent grid for tiles_m x tiles_n tiles of C: a block an SM, or (CLUSTER 2) a cluster of
// two blocks for each pair of tiles (tiles_m rounded up to even), as many as run at once.
template <int CLUSTER>
static int hopper_grid(int tiles_m, int tiles_n) {
    if (CLUSTER == 1) return std::min(tiles_m * tiles_n, hopper_sms());
    return 2 * std::min((tiles_m + 1) / 2 * tiles_n, hopper_cluster_slots());
}

// What the trainer's fused products need of their operands, or NULL when they are fine: TMA's row
// strides and base addresses are multiples of 16 bytes, so the product's inner width K (d_model in
// all three: the gate/up forward's I, the down input gradient's O, the head's C) and the output's
// width F (SwiGLU's features, where the up halves start F elements in; the head's vocabulary V) are
// multiples of 8, and every operand is 16-byte aligned. The rows N may be any number: TMA
// zero-fills and clips the edge tiles. The one place these are checked, through the three below:
// the trainer takes a fused path only where they say NULL, and the ladder skips what they refuse.
static const char* hopper_operands_problem(int N, int K, int F, std::initializer_list<const bf16*> operands) {
    if (N < 1 || K < 1 || F < 1) return "empty matrices";
    if (K % 8) return "the product's inner width (d_model) must be a multiple of 8";
    if (F % 8) return "the output's width (the features F, or the vocabulary) must be a multiple of 8";
    for (const bf16* p : operands)  // (NULL: an output not asked for)
        if ((uintptr_t)p % 16) return "every operand must be 16-byte aligned";
    return NULL;
}

// The gate/up forward's (hopper_forward_swiglu): x [N, I], W [O, I] with O = 2F.
static const char* hopper_swiglu_problem(const bf16* gate_up, const bf16* act, const bf16* x, const bf16* W, int N,
                                         int I, int O) {
    if (O % 2) return "O must be even: F gate rows, then F up rows";
    return hopper_operands_problem(N, I, O / 2, {gate_up, act, x, W});
}

// The down input gradient's (hopper_backward_swiglu): dy [N, O], W [O, I] with I = F, gate_up and
// d_gate_up [N, 2F], act [N, F] or NULL (nothing remade).
static const char* hopper_swiglu_backward_problem(const bf16* d_gate_up, const bf16* act, const bf16* dy,
                                                  const bf16* W, const bf16* gate_up, int N, int I, int O) {
    return hopper_operands_problem(N, O, I, {d_gate_up, act, dy, W, gate_up});
}

// The gate/up forward with SwiGLU fused (the ladder's versions 6 and 11, the trainer's BF16 gate/up
// forward): gate_up[N, 2F] = x[N, I] W[2F, I]^T and act[N, F] = silu(gate) * up, with the bits of
// kernels.cuh's swiglu_forward run on the stored gate_up, in one launch; for operands that
// hopper_swiglu_problem accepts (else it exits with that line). A tile takes 128 features (PP: 64):
// W's gate rows and up rows of them, each half of W, gate_up and act a map of its own, whose edges
// TMA zero-fills (loads) and clips (stores). One split of K, so the result repeats bit for bit (each
// output one fp32 sum in k order, in every form). CLUSTER 2 (the ladder's version 9): in clusters of
// two blocks, one loading the gate rows of both, the other the up rows; the same bits, no faster
// (doc/matmul.md). PP (version 11, the trainer's): ping-pong, tiles of HOP_PP_SWIGLU_BM rows x 64
// features, a consumer's whole.
template <int CLUSTER = 1, bool PP = false>
static void hopper_forward_swiglu(bf16* gate_up, bf16* act, const bf16* x, const bf16* W, int N, int I, int O,
                                  cudaStream_t s) {
    if (const char* problem = hopper_swiglu_problem(gate_up, act, x, W, N, I, O)) {
        fprintf(stderr, "hopper_forward_swiglu: %s (N %d, I %d, O %d)\n", problem, N, I, O);
        exit(1);
    }
    constexpr int BN = PP ? HOP_PP_SWIGLU_BN : HOP_BN, BM = hopper_tile_m(HOP_EPI_SWIGLU, PP);  // BN / 2 features
    const int M = N, F = O / 2, K = I;
    HopperFusion fuse = {};
    fuse.b_up = tma_tensor_map(W + (size_t)F * K, K, K, F, 1, BN / 2);
    fuse.c_up = tma_tensor_map(gate_up + F, F, 2 * F, M, 1, 64);
    fuse.act = tma_tensor_map(act, F, F, M, 1, 64);
    hopper_launch<true, true, bf16, HOP_EPI_SWIGLU, bf16, bf16, CLUSTER, BN, PP>(
        tma_tensor_map(x, K, K, M, 1, BM), tma_tensor_map(W, K, K, F, 1, BN / 2),
        tma_tensor_map(gate_up, F, 2 * F, M, 1, 64), fuse, gate_up, M, F, K,
        hopper_grid<CLUSTER>(ceil_div(M, BM), ceil_div(F, BN / 2)), HOP_GROUP_M, 1, s);
}

// The down matrix's input gradient with SwiGLU's backward fused (the ladder's version 6, the
// trainer's BF16 MLP backward): d_mlp_act[N, F] = dy[N, O] W[O, I], I = F, never stored, and
// d_gate_up[N, 2F] = [d_gate | d_up] of swiglu_backward8 on it (rounded to bf16, as it would be
// stored) and on gate_up [N, 2F]: the bits of kernels.cuh's swiglu_backward run on this kernel's
// plain product, in one launch; for operands that hopper_swiglu_backward_problem accepts (else it
// exits with that line). A tile is 128 rows x 256 features of d_mlp_act, as in the plain dx; its
// epilogue reads their gate and up entries from gate_up and stores d_gate and d_up through a map of
// each half of d_gate_up. With act not NULL it also stores act[N, F] = silu(gate) * up, the bits
// swiglu_forward makes from gate_up: the forward's SwiGLU output remade for a layer that
// recomputes it, at the cost of its store alone, since gate and up are read here anyway. One split
// of K, so the result repeats bit for bit. CLUSTER 2 (the ladder's version 9): in clusters of two
// blocks, each loading two of the four panels of W's tile into both; the same bits, no faster
// (doc/matmul.md), so the trainer runs 1.
template <int CLUSTER = 1>
static void hopper_backward_swiglu(bf16* d_gate_up, bf16* act, const bf16* dy, const bf16* W, const bf16* gate_up,
                                   int N, int I, int O, cudaStream_t s) {
    if (const char* problem = hopper_swiglu_backward_problem(d_gate_up, act, dy, W, gate_up, N, I, O)) {
        fprintf(stderr, "hopper_backward_swiglu: %s (N %d, I %d, O %d)\n", problem, N, I, O);
        exit(1);
    }
    const int M = N, F = I, K = O;  // the GEMM: d_mlp_act[M][F] = dy[M][K] W[K][F]
    HopperFusion fuse = {};
    fuse.c_up = tma_tensor_map(d_gate_up + F, F, 2 * F, M, 1, 64);
    fuse.in[0] = tma_tensor_map(gate_up, F, 2 * F, M, 1, HOP_BM);
    fuse.in[1] = tma_tensor_map(gate_up + F, F, 2 * F, M, 1, HOP_BM);
    if (act) fuse.act = tma_tensor_map(act, F, F, M, 1, 64);
    const CUtensorMap tm_dy = tma_tensor_map(dy, K, K, M, 1, HOP_BM), tm_w = tma_tensor_map(W, F, F, K, 1, 64);
    const CUtensorMap tm_d_gate = tma_tensor_map(d_gate_up, F, 2 * F, M, 1, 64);
    const int grid = hopper_grid<CLUSTER>(ceil_div(M, HOP_BM), ceil_div(F, HOP_BN));
    // two instances of the kernel: act's stores are compiled out of the other (a runtime choice
    // in one would hold registers that the consumers, at 232, do not have to spare)
    const auto launch = act ? hopper_launch<true, false, bf16, HOP_EPI_SWIGLU_BWD_ACT, bf16, bf16, CLUSTER>
                            : hopper_launch<true, false, bf16, HOP_EPI_SWIGLU_BWD, bf16, bf16, CLUSTER>;
    launch(tm_dy, tm_w, tm_d_gate, fuse, d_gate_up, M, F, K, grid, HOP_GROUP_M, 1, s, HopperStreamK{});
}

// The head's fused forward's (hopper_logits_exp): x [R, C], E [V, C], probs [R, V].
static const char* hopper_logits_problem(const bf16* probs, const bf16* x, const bf16* E, int R, int C, int V) {
    return hopper_operands_problem(R, C, V, {probs, x, E});
}

// The output head's forward with the softmax's exponentials fused (the trainer's BF16 head): for a
// chunk of R rows x [R, C] and the tied embedding E [V, C], the logits z = x E^T are never stored;
// probs[R, V] = exp(z - shift[r]) in bf16 is, with each row's sums over tiles of HOP_LOGITS_BN
// columns but its target's, the target's z, and the overflow marks (HopperLogits); kernels.cuh's
// head_loss_kernel makes the loss and dL/dlogits from them. In ping-pong (version 11), which holds
// the epilogue's exponentials under the other consumer's products: the chunk's forward and backward
// 1.380 ms against 1.417 in version 5's cooperative tiles (gpu_kernel_head_fused_matches_three_passes,
// default config, H100; doc/perf.md). For operands that hopper_logits_problem accepts (else it exits
// with that line). One split of K, so the result repeats bit for bit.
static void hopper_logits_exp(bf16* probs, const HopperLogits& logits, const bf16* x, const bf16* E, int R, int C,
                              int V, cudaStream_t s) {
    if (const char* problem = hopper_logits_problem(probs, x, E, R, C, V)) {
        fprintf(stderr, "hopper_logits_exp: %s (R %d, C %d, V %d)\n", problem, R, C, V);
        exit(1);
    }
    HopperFusion fuse = {};
    fuse.logits = logits;
    // The walk's group is every tile row of the chunk: each column tile of E (192 x C) is loaded
    // once, for all of the chunk's rows, whose x stays in L2 (6 MiB at the default config); in
    // groups of 8 tile rows E (74 MiB, more than the L2) went through L2 once a group. In one call
    // alternating with groups of 8 (default config): 53.75 and 54.00 ms a step against 54.21, 54.09.
    const int tiles_m = ceil_div(R, HOP_BM);
    hopper_launch<true, true, bf16, HOP_EPI_LOGITS_EXP, bf16, bf16, 1, HOP_LOGITS_BN, true>(
        tma_tensor_map(x, C, C, R, 1, HOP_BM), tma_tensor_map(E, C, C, V, 1, HOP_LOGITS_BN),
        tma_tensor_map(probs, V, V, R, 1, 64), fuse, probs, R, V, C,
        hopper_grid<1>(tiles_m, hopper_logits_tiles(V)), tiles_m, 1, s);
}

#endif
