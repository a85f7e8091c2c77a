/*
 * lib/cuda_check.h - the one error convention for GPU calls, and the few definitions every CUDA
 * file of train_gpt shares (the bf16 type name, ceil_div, and time_median_ms, the one timer of the
 * dev/ ladders and the tests).
 *
 * Every CUDA runtime call goes through CUDA_CHECK, every cuBLASLt call through CUBLAS_CHECK, every
 * NCCL call that completes before it returns through NCCL_CHECK, and every kernel launch is
 * followed by LAUNCH_CHECK(), which catches bad launch parameters. A failure is one line naming
 * the call, its file and line, and the library's own error string, then exit(1).
 */
#ifndef CUDA_CHECK_H
#define CUDA_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <nccl.h>
#include <algorithm>
#include <vector>

typedef __nv_bfloat16 bf16;

static inline void cuda_check_(cudaError_t err, const char* what, const char* file, int line) {
    if (err != cudaSuccess) {
        fprintf(stderr, "CUDA error at %s:%d: %s: %s\n", file, line, what, cudaGetErrorString(err));
        exit(1);
    }
}
#define CUDA_CHECK(call) cuda_check_((call), #call, __FILE__, __LINE__)
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

static inline void cublas_check_(cublasStatus_t status, const char* what, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuBLASLt error at %s:%d: %s: %s\n", file, line, what, cublasLtGetStatusString(status));
        exit(1);
    }
}
#define CUBLAS_CHECK(call) cublas_check_((call), #call, __FILE__, __LINE__)

static inline void nccl_check_(ncclResult_t result, const char* what, const char* file, int line) {
    if (result != ncclSuccess) {
        fprintf(stderr, "NCCL error at %s:%d: %s: %s\n", file, line, what, ncclGetErrorString(result));
        exit(1);
    }
}
#define NCCL_CHECK(call) nccl_check_((call), #call, __FILE__, __LINE__)

static inline int ceil_div(long a, long b) { return (int)((a + b - 1) / b); }

// Timing: the median of `reps` runs of f() (each bracketed by CUDA events on the default stream)
// after `warmup` unmeasured runs.
template <typename F>
static float time_median_ms(F f, int warmup, int reps) {
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    for (int i = 0; i < warmup; ++i) f();
    std::vector<float> ms(reps);
    for (int i = 0; i < reps; ++i) {
        CUDA_CHECK(cudaEventRecord(start));
        f();
        CUDA_CHECK(cudaEventRecord(stop));
        CUDA_CHECK(cudaEventSynchronize(stop));
        CUDA_CHECK(cudaEventElapsedTime(&ms[i], start, stop));
    }
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    std::sort(ms.begin(), ms.end());
    return ms[reps / 2];
}

#endif
