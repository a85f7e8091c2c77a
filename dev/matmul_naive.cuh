/*
 * dev/matmul_naive.cuh - version 1 of the matmul ladder: one thread per output element, a plain
 * loop over k in fp32, operands read straight from global memory. The GPU-side correctness
 * baseline: any shape (M, N, K >= 1), every form of dev/matmul_common.cuh.
 *
 * A block is 32 x 8 threads: threadIdx.x walks the columns n, so a warp shares its row of A (one
 * broadcast load per k) and reads 32 neighbouring columns of B: coalesced when B is N-major, 32
 * rows apart when it is K-major (W in the forward), where the L1 cache serves the next 15 k of
 * each row from the same 32-byte sector.
 */
#ifndef DEV_MATMUL_NAIVE_CUH
#define DEV_MATMUL_NAIVE_CUH

#include "matmul_common.cuh"

template <bool A_K, bool B_K, typename OutT>
__global__ void naive_matmul_kernel(OutT* __restrict__ c, const bf16* __restrict__ a, const bf16* __restrict__ b,
                                    int M, int N, int K) {
    const int n = blockIdx.x * 32 + threadIdx.x, m = blockIdx.y * 8 + threadIdx.y;
    if (m >= M || n >= N) return;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) {
        const float av = __bfloat162float(a[A_K ? (long)m * K + k : (long)k * M + m]);
        const float bv = __bfloat162float(b[B_K ? (long)n * K + k : (long)k * N + n]);
        acc = fmaf(av, bv, acc);
    }
    mm_store_one(c, (long)m * N + n, acc);
}

struct NaiveMatmul {
    template <bool A_K, bool B_K, typename OutT>
    static void gemm(OutT* c, const bf16* a, const bf16* b, int M, int N, int K, cudaStream_t s) {
        const dim3 grid(ceil_div(N, 32), ceil_div(M, 8));
        naive_matmul_kernel<A_K, B_K><<<grid, dim3(32, 8), 0, s>>>(c, a, b, M, N, K);
        LAUNCH_CHECK();
    }
};

#endif
