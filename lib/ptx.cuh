/*
 * lib/ptx.cuh - inline-PTX wrappers for the Hopper (sm_90a) instructions CUDA C++ does not expose:
 * warpgroup matrix products (wgmma: fence, commit, wait, shared-memory descriptors, the products
 * with both operands in shared memory and with A in registers, and the FP8 product), mbarriers, TMA tensor loads (and
 * cuTensorMapEncodeTiled, fetched through the runtime to encode their maps) and stores, clusters (TMA
 * multicast, another block's shared memory and barriers, the cluster barrier), setmaxnreg,
 * bulk copies and bulk reductions with their waits, named barriers, the gpu-scope acquire / release
 * pair, and the async-proxy fences; beside them, where a wgmma accumulator's entries lie and how it
 * is staged in the 128-byte swizzle for a TMA store (wg_stage_panel).
 *
 * How it fits: lib/attention.cuh builds its kernels on these, and so does our Hopper GEMM
 * (lib/matmul_hopper.cuh), the matmul ladder's versions 3 to 11; each wrapper is one instruction (or
 * one fixed group), named for it.
 *
 * Conventions a reader must know: shared-memory operands are 32-bit shared-window addresses
 * (__cvta_generic_to_shared), not pointers; every wgmma wrapper is issued by all 128 threads of a
 * warpgroup; descriptors describe wgmma's 128-byte swizzle (64-column bf16 panels of 128-byte rows,
 * 1024-byte aligned), the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B.
 */
#ifndef PTX_CUH
#define PTX_CUH

#include <stdint.h>
#include <cuda.h>          // CUtensorMap and its enums (types only: no -lcuda)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled, fetched through the runtime
#include "cuda_check.h"

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

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading-byte offset, stride-byte
// offset 1024 (eight 128-byte rows), base offset 0. The leading-byte offset matters only for an
// MN-major operand wider than one 64-column panel (N > 64): it is the distance between its panels
// (CUTLASS's canonical MN-major layout, ((64 mn, panels), (8 k, k/8)) : ((1, LBO), (128 B, SBO)));
// K-major operands and single panels ignore it (16 bytes by convention).
static __device__ __forceinline__ uint64_t wg_desc(uint32_t smem_addr, uint32_t lead_bytes = 16) {
    uint64_t d = 0;
    d |= (uint64_t)((smem_addr & 0x3FFFF) >> 4);
    d |= (uint64_t)((lead_bytes & 0x3FFFF) >> 4) << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}

// The accumulator's operands of a wgmma's inline asm, in register order (%0, %1, ... of its
// list): the 4 floats of d[j] (WG_ACC1), or of the rows j .. j+n-1 (WG_ACCn).
#define WG_ACC1(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define WG_ACC2(j) WG_ACC1(j), WG_ACC1((j) + 1)
#define WG_ACC4(j) WG_ACC2(j), WG_ACC2((j) + 2)
#define WG_ACC8(j) WG_ACC4(j), WG_ACC4((j) + 4)
#define WG_ACC16(j) WG_ACC8(j), WG_ACC8((j) + 8)

// d[N/8][4] (+)= A (64 x 16, shared, K-major) * B (N rows x 16, shared, K-major)^T; SCALE_D = 0
// overwrites d. Accumulator layout per warp w of the warpgroup: rows 16w + g and 16w + g + 8,
// columns 8j + 2i, 8j + 2i + 1 in d[j] (lane = 4g + i), the mma.m16n8 layout repeated.
template <int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss_n32(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : WG_ACC4(0)
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D), "n"(TA), "n"(TB));
}

template <int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss_n64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : WG_ACC8(0)
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D), "n"(TA), "n"(TB));
}

template <int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : WG_ACC16(0)
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D), "n"(TA), "n"(TB));
}

template <int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss_n192(float (&d)[24][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, %99, %100;\n}\n"
        : WG_ACC16(0), WG_ACC8(16)
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D), "n"(TA), "n"(TB));
}

template <int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss_n256(float (&d)[32][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : WG_ACC16(0), WG_ACC16(16)
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D), "n"(TA), "n"(TB));
}

// The SS product for N in {32, 64, 128, 192, 256}. TA = 1 reads A MN-major (a [16 k][64 m] panel, each k
// row 64 contiguous m), TB = 1 reads B MN-major (N > 64: N/64 such panels, the descriptor's leading
// offset apart); either then advances 16 rows (2048 bytes) per k-step.
template <int N, int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (N == 32) wg_mma_ss_n32<SCALE_D, TA, TB>(d, desc_a, desc_b);
    else if constexpr (N == 64) wg_mma_ss_n64<SCALE_D, TA, TB>(d, desc_a, desc_b);
    else if constexpr (N == 128) wg_mma_ss_n128<SCALE_D, TA, TB>(d, desc_a, desc_b);
    else if constexpr (N == 192) wg_mma_ss_n192<SCALE_D, TA, TB>(d, desc_a, desc_b);
    else wg_mma_ss_n256<SCALE_D, TA, TB>(d, desc_a, desc_b);
}

// The FP8 product: d[16][4] (+)= A (64 x 32, shared, K-major) * B (128 rows x 32, shared, K-major)^T,
// A in E5M2 where A_E5M2 (else E4M3), B in E4M3; accumulate = 0 overwrites d. FP8 wgmma has no
// transpose: both operands are K-major, a k-step of 32 is 32 bytes as bf16's k16 is, so the
// 128-byte-swizzle descriptors above serve unchanged. Only the pairs the trainer's FP8 products
// take (doc/fp8.md: x W^T is E4M3 x E4M3; dy W and dy^T x read dy, the row operand, in E5M2). The
// accumulator layout is wg_mma_ss's for N = 128.
#define WG_MMA_FP8_N128(types)                                                                        \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32." types " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n" \
                 : WG_ACC16(0) \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))
template <bool A_E5M2>
static __device__ __forceinline__ void wg_mma_fp8_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b,
                                                      int accumulate) {
    if constexpr (A_E5M2) WG_MMA_FP8_N128("e5m2.e4m3");
    else WG_MMA_FP8_N128("e4m3.e4m3");
}
#undef WG_MMA_FP8_N128

// d[OFF .. OFF+7][4] += A (64 x 16 bf16 in registers, the mma.m16n8k16 A layout per warp) *
// B (16 x 64, shared, MN-major: each k row holds 64 contiguous columns, hence trans-b = 1).
template <int OFF, int N8>
static __device__ __forceinline__ void wg_mma_rs_n64_tb(float (&d)[N8][4], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : WG_ACC8(OFF)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}
#undef WG_ACC1
#undef WG_ACC2
#undef WG_ACC4
#undef WG_ACC8
#undef WG_ACC16

// ----------------------------------------------------------------------------------------------
// mbarrier, TMA and bulk-copy wrappers (PTX ISA: "mbarrier", "cp.async.bulk", "cp.async.bulk.tensor",
// "cp.reduce.async.bulk", "cp.reduce.async.bulk.tensor"), named barriers, and the acquire / release
// pair of the backward's dQ order.

static __device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// The producer's arrival on a full barrier: one arrive, plus bytes the TMA copies will complete.
static __device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Spins until the barrier's phase with the given parity has completed.
static __device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// One bounded try: true once the phase with the given parity has completed. If it has not, the
// thread may be suspended for up to about hint_ns nanoseconds first (the suspend-time hint of
// try_wait, PTX ISA 7.8), so a caller can bound a wait by counting tries.
static __device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity, uint32_t hint_ns) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity), "r"(hint_ns)
        : "memory");
    return done != 0;
}
// Where byte b (0..127) of row `row` lies in a [rows][128 bytes] box in the 128-byte swizzle, as
// TMA lays it out: its 16-byte slot b / 16 moves to slot (b / 16) ^ (row % 8), so the 8 rows that a
// warp's accumulator entries span fall in 8 different bank groups.
static __device__ __forceinline__ int swizzle_128b(int row, int b) {
    return row * 128 + ((((b >> 4) ^ (row & 7)) << 4) | (b & 15));
}
// Where thread tid (0..127) of a warpgroup holds its wgmma accumulator (wg_mma_ss's layout): rows
// r and r + 8 of the warpgroup's 64, columns 8j + 2i and 8j + 2i + 1 of d[j]. Since (r + 8) % 8 =
// r % 8, both rows fall in the same swizzle phase.
static __device__ __forceinline__ int wg_acc_row(int tid) { return (tid >> 5) * 16 + ((tid & 31) >> 2); }
static __device__ __forceinline__ int wg_acc_pair(int tid) { return tid & 3; }
// One [64 rows][128 bytes] panel of a warpgroup's accumulator written into shared memory at `panel`
// in the 128-byte swizzle, a TMA box's layout, by all 128 threads: word(jj, h) (a bf16 pair or a
// float2: columns 8jj + 2i, +1 of row r + 8h of the panel, 64 bf16 or 32 fp32 columns) goes where
// TMA will read it. The epilogues that store an accumulator by TMA stage it this way: our GEMM's
// (lib/matmul_hopper.cuh) and attention's (lib/attention.cuh). A fence and a barrier must follow
// before the copy.
template <typename Word>
static __device__ __forceinline__ void wg_stage_panel(unsigned char* panel, Word word) {
    using W = decltype(word(0, 0));
    constexpr int GROUPS = 128 / (int)sizeof(W) / 4;  // the panel's groups of 8 columns
    const int tid = threadIdx.x & 127, r = wg_acc_row(tid), i = wg_acc_pair(tid);
#pragma unroll
    for (int jj = 0; jj < GROUPS; ++jj) {
        const int b = (8 * jj + 2 * i) * (int)sizeof(W) / 2;  // columns 8jj + 2i, +1: byte b of the row
        *reinterpret_cast<W*>(panel + swizzle_128b(r, b)) = word(jj, 0);
        *reinterpret_cast<W*>(panel + swizzle_128b(r + 8, b)) = word(jj, 1);
    }
}
// One box {64 columns, rows, 1} at (column c0, row t0, batch b) of a 3-D tensor map into shared
// memory at dst; completes its bytes on bar.
static __device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int t0, int b,
                                                   uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(t0), "r"(b), "r"(bar)
        : "memory");
}

// Thread-block clusters (PTX ISA: "Cluster", "mapa", "barrier.cluster"). The blocks of a cluster
// run at once on neighbouring SMs and may address each other's shared memory: tma_load_3d_multicast
// writes one box into the same offset of every block of cta_mask (bit r: the block of rank r) and
// completes its bytes on the barrier at bar's offset in each of them.
static __device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int t0,
                                                             int b, uint32_t bar, uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
        "{%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(t0), "r"(b), "r"(bar), "h"(cta_mask)
        : "memory");
}
static __device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// The address, in the cluster's shared window, of the same offset as addr in the block of rank `rank`.
static __device__ __forceinline__ uint32_t cluster_map_shared(uint32_t addr, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
    return remote;
}
// An arrive on another block's mbarrier (its address from cluster_map_shared). Its release is the
// default, CTA scope: what it orders are this warpgroup's wgmma reads of a stage, done before it
// (wgmma.wait_group), and the other block's producer then only overwrites that stage through TMA.
static __device__ __forceinline__ void mbar_arrive_cluster(uint32_t remote_bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}
// Every thread of the cluster's blocks that has not exited arrives, then waits for the others: the
// cluster's __syncthreads (exited threads do not hold it up).
static __device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

template <int N>
static __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
static __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// bytes (a multiple of 16; both addresses 16-byte aligned) from global src to shared dst, on bar.
static __device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// dst = src (ADD false) or dst += src (ADD true, fp32 adds in L2), bytes from shared to global, as
// one committed bulk group of this thread.
template <bool ADD>
static __device__ __forceinline__ void bulk_store(float* dst, uint32_t src, uint32_t bytes) {
    if constexpr (ADD)
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                     "r"(bytes)
                     : "memory");
    else
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
                     : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until this thread's bulk groups have read their shared source (READ) or fully completed.
template <bool READ>
static __device__ __forceinline__ void bulk_wait() {
    if constexpr (READ) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Waits until at most N of this thread's bulk groups have not yet read their shared source, so
// that the buffer of every older group may be written again.
template <int N>
static __device__ __forceinline__ void bulk_wait_read_but() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// One box of a 3-D tensor map from shared memory at src to global memory at (column c0, row t0,
// batch b), as one committed bulk group of this thread: stored (ADD false) or added to what is
// there (ADD true, in L2, in the map's type). Elements outside the tensor are not written; src has
// the map's swizzle, written by this block's threads, whose writes a fence.proxy.async.shared::cta
// and a barrier must order before the copy.
template <bool ADD>
static __device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int t0, int b) {
    if constexpr (ADD)
        asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                     ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(t0), "r"(b)
                     : "memory");
    else
        asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                     ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(t0), "r"(b)
                     : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
static __device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts this thread's arrival at barrier id (of `threads` in all) without waiting for the others.
static __device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
static __device__ __forceinline__ int load_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void add_release_gpu(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ void store_release_gpu(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// bar.sync of `threads` threads on barrier id that also returns whether pred held in all of them.
static __device__ __forceinline__ bool named_barrier_and(int id, int threads, bool pred) {
    int all;
    asm volatile("{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n"
                 " selp.s32 %0, 1, 0, q;\n}\n"
                 : "=r"(all)
                 : "r"((int)pred), "r"(id), "r"(threads)
                 : "memory");
    return all;
}
// Orders this thread's generic-proxy global accesses with its bulk (async-proxy) ones.
static __device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ----------------------------------------------------------------------------------------------
// TMA tensor maps are encoded on the host, by the driver's cuTensorMapEncodeTiled.

// cuTensorMapEncodeTiled from the driver, through the runtime (so the program needs no -lcuda).
static PFN_cuTensorMapEncodeTiled_v12000 tma_encode_fn() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (!fn) {
        cudaDriverEntryPointQueryResult qres;
        void* p = nullptr;
        CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &qres));
        if (qres != cudaDriverEntryPointSuccess || !p) {
            fprintf(stderr, "tma_encode_fn: the driver has no cuTensorMapEncodeTiled (query result %d); "
                            "TMA needs a CUDA 12+ driver\n", (int)qres);
            exit(1);
        }
        fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
    return fn;
}

#endif
