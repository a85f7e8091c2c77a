/*
 * dev/common.h - helpers shared by the dev/ kernel ladders: random inputs (on the host, and on the
 * device for the large timing shapes, bf16 or fp32), NaN poisoning of outputs, error metrics
 * against a reference, and the CPU FP64 reference of causal GQA
 * attention (forward and backward) that every attention version is checked against.
 *
 * Convention: references take the bf16 inputs already widened to float (the exact values the GPU
 * sees) and compute in double; the metrics report max |gpu - ref| and ||gpu - ref|| / ||ref||,
 * and count non-finite GPU values, which always fail a check. It includes kernels.cuh for the
 * trainer's splitmix64 (and, through it, lib/cuda_check.h's definitions, time_median_ms among them).
 */
#ifndef DEV_COMMON_H
#define DEV_COMMON_H

#include <math.h>
#include <string.h>
#include <algorithm>
#include <vector>
#include "../kernels.cuh"  // splitmix64

// ----------------------------------------------------------------------------------------------
// Random numbers: kernels.cuh's splitmix64, the same generator on host and device.

// Uniform in [-scale, scale); scale = sqrt(3) gives unit variance.
static __host__ __device__ inline float uniform_at(uint64_t seed, uint64_t i, float scale) {
    const uint64_t r = splitmix64(seed * 0x100000001B3ull + i);
    return scale * ((float)(r >> 40) * (2.0f / 16777216.0f) - 1.0f);
}

static void fill_uniform_host(std::vector<bf16>& x, uint64_t seed, float scale) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = __float2bfloat16(uniform_at(seed, i, scale));
}

// bf16 (rounded to nearest, as fill_uniform_host does) or fp32 (uniform_at's value itself).
template <typename T>
__global__ void fill_uniform_kernel(T* x, size_t n, uint64_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        if constexpr (sizeof(T) == 2) x[i] = __float2bfloat16(uniform_at(seed, i, scale));
        else x[i] = uniform_at(seed, i, scale);
    }
}
template <typename T>
static void fill_uniform_device(T* x, size_t n, uint64_t seed, float scale) {
    fill_uniform_kernel<<<1024, 256>>>(x, n, seed, scale);
    CUDA_CHECK(cudaGetLastError());
}

// All-ones bytes: NaN as bf16 (0xFFFF) and as fp32 (0xFFFFFFFF), so an unwritten element shows.
static void poison(void* p, size_t bytes) { CUDA_CHECK(cudaMemset(p, 0xFF, bytes)); }

// ----------------------------------------------------------------------------------------------
// Error metrics

typedef struct {
    double max_abs;  // max |x - ref|
    double rel_l2;   // ||x - ref|| / ||ref||
    long nonfinite;  // elements of x that are NaN or inf
} ErrStat;

static void err_add(ErrStat* e, double x, double ref, double* num, double* den) {
    if (!isfinite(x)) { e->nonfinite++; return; }
    const double d = fabs(x - ref);
    if (d > e->max_abs) e->max_abs = d;
    *num += d * d;
    *den += ref * ref;
}

// Compares rows of a strided bf16 tensor [rows][stride] (first cols columns) with ref [rows][cols].
static ErrStat compare_bf16(const std::vector<bf16>& x, long stride, long offset, const std::vector<double>& ref,
                            long rows, long cols) {
    ErrStat e = {0, 0, 0};
    double num = 0, den = 0;
    for (long r = 0; r < rows; ++r)
        for (long c = 0; c < cols; ++c)
            err_add(&e, __bfloat162float(x[r * stride + offset + c]), ref[r * cols + c], &num, &den);
    e.rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
    return e;
}
static ErrStat compare_f32(const std::vector<float>& x, const std::vector<double>& ref) {
    ErrStat e = {0, 0, 0};
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) err_add(&e, x[i], ref[i], &num, &den);
    e.rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
    return e;
}

// ----------------------------------------------------------------------------------------------
// CPU FP64 reference of causal GQA attention. q [B, T, Hq, D], k and v [B, T, Hkv, D] (dense,
// float), scale 1/sqrt(D); query head h reads KV head h / (Hq/Hkv).
//   forward:  out [B, T, Hq, D], lse [B, Hq, T] (natural log)
//   backward: given dout [B, T, Hq, D]: dq [B, T, Hq, D], dk and dv [B, T, Hkv, D] (summed over
//             the query heads of each KV head), with dS = P o (dP - rowsum(P o dP)).

typedef struct {
    int B, T, Hq, Hkv, D;
} AttnShape;

static void cpu_attention(const AttnShape& s, const float* q, const float* k, const float* v, const float* dout,
                          std::vector<double>& out, std::vector<double>& lse, std::vector<double>& dq,
                          std::vector<double>& dk, std::vector<double>& dv) {
    const int B = s.B, T = s.T, Hq = s.Hq, Hkv = s.Hkv, D = s.D, G = Hq / Hkv;
    const double scale = 1.0 / sqrt((double)D);
    out.assign((size_t)B * T * Hq * D, 0.0);
    lse.assign((size_t)B * Hq * T, 0.0);
    dq.assign((size_t)B * T * Hq * D, 0.0);
    dk.assign((size_t)B * T * Hkv * D, 0.0);
    dv.assign((size_t)B * T * Hkv * D, 0.0);
    std::vector<double> P((size_t)T * T), dP((size_t)T * T);
    auto qi = [&](int b, int t, int h) { return ((size_t)(b * T + t) * Hq + h) * D; };
    auto ki = [&](int b, int t, int h) { return ((size_t)(b * T + t) * Hkv + h) * D; };
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < Hq; ++h) {
            const int hk = h / G;
            for (int i = 0; i < T; ++i) {  // P = softmax(scale * q k^T), causal
                double mx = -INFINITY;
                for (int j = 0; j <= i; ++j) {
                    double acc = 0;
                    for (int d = 0; d < D; ++d) acc += (double)q[qi(b, i, h) + d] * k[ki(b, j, hk) + d];
                    P[(size_t)i * T + j] = acc * scale;
                    mx = std::max(mx, acc * scale);
                }
                double sum = 0;
                for (int j = 0; j <= i; ++j) sum += exp(P[(size_t)i * T + j] - mx);
                for (int j = 0; j <= i; ++j) P[(size_t)i * T + j] = exp(P[(size_t)i * T + j] - mx) / sum;
                lse[((size_t)b * Hq + h) * T + i] = mx + log(sum);
                for (int d = 0; d < D; ++d) {
                    double acc = 0;
                    for (int j = 0; j <= i; ++j) acc += P[(size_t)i * T + j] * v[ki(b, j, hk) + d];
                    out[qi(b, i, h) + d] = acc;
                }
            }
            for (int i = 0; i < T; ++i) {  // dP = dO V^T, dS = P o (dP - delta), in place in dP
                double delta = 0;
                for (int j = 0; j <= i; ++j) {
                    double acc = 0;
                    for (int d = 0; d < D; ++d) acc += (double)dout[qi(b, i, h) + d] * v[ki(b, j, hk) + d];
                    dP[(size_t)i * T + j] = acc;
                    delta += P[(size_t)i * T + j] * acc;
                }
                for (int j = 0; j <= i; ++j) dP[(size_t)i * T + j] = P[(size_t)i * T + j] * (dP[(size_t)i * T + j] - delta);
            }
            for (int i = 0; i < T; ++i)  // dQ = scale dS K; dK += scale dS^T Q; dV += P^T dO
                for (int j = 0; j <= i; ++j) {
                    const double ds = dP[(size_t)i * T + j] * scale, p = P[(size_t)i * T + j];
                    for (int d = 0; d < D; ++d) {
                        dq[qi(b, i, h) + d] += ds * k[ki(b, j, hk) + d];
                        dk[ki(b, j, hk) + d] += ds * q[qi(b, i, h) + d];
                        dv[ki(b, j, hk) + d] += p * dout[qi(b, i, h) + d];
                    }
                }
        }
}

#endif
