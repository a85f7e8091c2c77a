/*
 * dev/matmul_common.cuh - what the versions of the matmul ladder (dev/matmul.cu) share: the three
 * products of a linear layer written as one GEMM in two operand layouts, the naive store, and the
 * shape rule of the tiled versions.
 *
 * A linear layer y = x W^T with x [N, I], W [O, I] and y [N, O], row-major as the trainer stores
 * them, takes three products (kernels.cuh, "Matmuls through cuBLASLt"). Each is C[M][N'] (+)=
 * sum_k A[m][k] B[k][n] with A stored K-major ([M][K], k contiguous) or M-major ([K][M]) and B
 * stored K-major ([N'][K]) or N-major ([K][N']):
 *   forward          y  = x W^T    M = N, N' = O, K = I    A = x  K-major    B = W  K-major  (W is [O][I])
 *   backward input   dx = dy W     M = N, N' = I, K = O    A = dy K-major    B = W  N-major  (W is [K][N'])
 *   backward weight  dW += dy^T x  M = O, N' = I, K = N    A = dy M-major    B = x  N-major  (dy is [K][M])
 * The first two write bf16 C (=); the weight gradient is fp32 and accumulated (+=), as the trainer
 * keeps it across micro-batches. Every version is one GEMM template, gemm<A_K, B_K>(c, a, b, M, N,
 * K, stream), C's type deduced (bf16: overwritten, float: accumulated); mm_forward and the two
 * backward adapters below give it the signatures of kernels.cuh's linear_forward (without its
 * residual), linear_backward_input and linear_backward_weight, so that the ladder calls every
 * version and cuBLASLt the same way.
 */
#ifndef DEV_MATMUL_COMMON_CUH
#define DEV_MATMUL_COMMON_CUH

#include "../lib/matmul_hopper.cuh"  // mm_store_pair, mm_error

// The three products as calls of a version V's GEMM (V::gemm<A_K, B_K>).
template <typename V>
static void mm_forward(bf16* y, const bf16* x, const bf16* W, int N, int I, int O, cudaStream_t s) {
    V::template gemm<true, true>(y, x, W, N, O, I, s);
}
template <typename V>
static void mm_backward_input(bf16* dx, const bf16* dy, const bf16* W, int N, int I, int O, cudaStream_t s) {
    V::template gemm<true, false>(dx, dy, W, N, I, O, s);
}
template <typename V>
static void mm_backward_weight(float* dW, const bf16* dy, const bf16* x, int N, int I, int O, cudaStream_t s) {
    V::template gemm<false, false>(dW, dy, x, O, I, N, s);
}

// Versions 2-5 move 16-byte chunks (cp.async, TMA), so every row of every operand starts on 16
// bytes: each of M, N and K, the row length of some operand in some form, is a multiple of 8 (the
// trainer's sides all are). NULL when (M, N, K) is fine, else why not.
static const char* mm_tiled_shape_problem(int M, int N, int K) {
    return (M % 8 || N % 8 || K % 8) ? "sides must be multiples of 8" : NULL;
}

// The FP8 products (version 8, and cuBLASLt's FP8 matmul) read every operand K-major, its rows 16-byte
// aligned TMA boxes and cuBLASLt's leading dimensions (multiples of 16 bytes): M, N and K multiples of 16.
static const char* mm_fp8_shape_problem(int M, int N, int K) {
    return (M % 16 || N % 16 || K % 16) ? "FP8: sides must be multiples of 16" : NULL;
}

// The naive version's store: c[at] = v as bf16, or += v in fp32 (the caller checks bounds). Its
// pair, mm_store_pair, and the flag a Hopper kernel raises where it gives up instead of hanging
// (mm_error, MM_TIMEOUT), are lib/matmul_hopper.cuh's, which the trainer runs.
template <typename OutT>
static __device__ __forceinline__ void mm_store_one(OutT* c, long at, float v) {
    if constexpr (sizeof(OutT) == 2) c[at] = __float2bfloat16(v);
    else c[at] += v;
}

#endif
