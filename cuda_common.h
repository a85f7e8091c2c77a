/*
 * cuda_common.h - the few definitions every CUDA file of train_gpt shares: the one error-check
 * macro per library (CUDA runtime, cuBLASLt, NCCL), the bf16 type name, and small integer helpers.
 *
 * Every CUDA, cuBLASLt and NCCL call in the project goes through these macros, so a failure is
 * always one line naming the call's file and line and the library's own error string, followed by
 * exit(1). After each kernel launch, CUDA_CHECK(cudaGetLastError()) catches bad launch parameters.
 */
#ifndef CUDA_COMMON_H
#define CUDA_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

static inline void cuda_check_(cudaError_t err, const char* what, const char* file, int line) {
    if (err != cudaSuccess) {
        fprintf(stderr, "CUDA error at %s:%d: %s: %s\n", file, line, what, cudaGetErrorString(err));
        exit(1);
    }
}
#define CUDA_CHECK(call) cuda_check_((call), #call, __FILE__, __LINE__)

static inline int ceil_div(long a, long b) { return (int)((a + b - 1) / b); }

#endif
