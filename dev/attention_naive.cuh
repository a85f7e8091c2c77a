/*
 * dev/attention_naive.cuh - version 1 of the attention ladder: the readable reference on the GPU.
 * Every intermediate is materialized in fp32 scratch of B*Hq*T*T floats (two such buffers, grown
 * on demand and never freed): S = scale * Q K^T (causal, -inf above the diagonal), P = softmax(S)
 * in place, O = P V, each by a plain kernel with one thread per output element and no tiling.
 * The backward recomputes P from lse, then dS = P o (dO V^T - delta), dQ = scale dS K,
 * dK = scale dS^T Q and dV = P^T dO, the last two summed over the query heads of each KV head.
 * Same API and layouts as attention_fa2.cuh (token-major q/k/v with a row stride; KV head
 * h / (Hq/Hkv) for query head h). It is slow and memory-hungry by design: it exists to be obviously
 * right, and to show what the fused kernels save.
 */
#include "../lib/cuda_check.h"

static float* naive_scratch[2] = {nullptr, nullptr};
static size_t naive_scratch_floats = 0;

static void naive_reserve(size_t floats) {
    if (floats <= naive_scratch_floats) return;
    for (int i = 0; i < 2; ++i) {
        if (naive_scratch[i]) CUDA_CHECK(cudaFree(naive_scratch[i]));
        CUDA_CHECK(cudaMalloc(&naive_scratch[i], floats * sizeof(float)));
    }
    naive_scratch_floats = floats;
}

// S[bh, i, j] = scale * q_i . k_j for j <= i, else -inf. grid (ceil(T*T/256), B*Hq).
__global__ void naive_scores_kernel(float* S, const bf16* q, const bf16* k, int stride, int T, int Hq, int Hkv,
                                    int D, float scale) {
    const long ij = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (ij >= (long)T * T) return;
    const int i = (int)(ij / T), j = (int)(ij % T);
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    float acc = -INFINITY;
    if (j <= i) {
        const bf16* qr = q + ((long)b * T + i) * stride + h * D;
        const bf16* kr = k + ((long)b * T + j) * stride + hk * D;
        acc = 0.f;
        for (int d = 0; d < D; ++d) acc += __bfloat162float(qr[d]) * __bfloat162float(kr[d]);
        acc *= scale;
    }
    S[(long)blockIdx.y * T * T + ij] = acc;
}

// Row softmax in place, one warp per row of S; lse = max + log(sum).
__global__ void naive_softmax_kernel(float* S, float* lse, int T, long rows) {
    const long row = blockIdx.x * (long)(blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    float* s = S + row * T;
    const int n = (int)(row % T) + 1;  // keys 0..i
    float mx = -INFINITY;
    for (int j = lane; j < n; j += 32) mx = fmaxf(mx, s[j]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int j = lane; j < n; j += 32) sum += expf(s[j] - mx);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    for (int j = lane; j < T; j += 32) s[j] = j < n ? expf(s[j] - mx) / sum : 0.f;
    if (lane == 0) lse[row] = mx + logf(sum);
}

// out[b, i, h, d] = sum_j P[bh, i, j] v[b, j, hk, d]. grid (ceil(T*D/256), B*Hq).
__global__ void naive_pv_kernel(bf16* out, const float* P, const bf16* v, int stride, int T, int Hq, int Hkv, int D) {
    const long id = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (id >= (long)T * D) return;
    const int i = (int)(id / D), d = (int)(id % D);
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const float* p = P + ((long)blockIdx.y * T + i) * T;
    float acc = 0.f;
    for (int j = 0; j <= i; ++j) acc += p[j] * __bfloat162float(v[((long)b * T + j) * stride + hk * D + d]);
    out[(((long)b * T + i) * Hq + h) * D + d] = __float2bfloat16(acc);
}

static void naive_attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                                    int qkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    naive_reserve((size_t)B * Hq * T * T);
    float* S = naive_scratch[0];
    naive_scores_kernel<<<dim3(ceil_div((long)T * T, 256), B * Hq), 256, 0, stream>>>(S, q, k, qkv_stride, T, Hq, Hkv,
                                                                                     D, 1.f / sqrtf((float)D));
    CUDA_CHECK(cudaGetLastError());
    const long rows = (long)B * Hq * T;
    naive_softmax_kernel<<<ceil_div(rows, 8), 256, 0, stream>>>(S, lse, T, rows);
    CUDA_CHECK(cudaGetLastError());
    naive_pv_kernel<<<dim3(ceil_div((long)T * D, 256), B * Hq), 256, 0, stream>>>(out, S, v, qkv_stride, T, Hq, Hkv, D);
    CUDA_CHECK(cudaGetLastError());
}

// P = exp(S - lse) in place, and dS[bh, i, j] = P (dO_i . v_j - delta_i), delta = rowsum(dO o O).
__global__ void naive_dsoft_kernel(float* P, float* dS, const float* lse, const float* delta, const bf16* dout,
                                   const bf16* v, int stride, int T, int Hq, int Hkv, int D) {
    const long ij = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (ij >= (long)T * T) return;
    const int i = (int)(ij / T), j = (int)(ij % T);
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const long at = (long)blockIdx.y * T * T + ij, row = (long)blockIdx.y * T + i;
    float p = 0.f, ds = 0.f;
    if (j <= i) {
        p = expf(P[at] - lse[row]);
        const bf16* dor = dout + (((long)b * T + i) * Hq + h) * D;
        const bf16* vr = v + ((long)b * T + j) * stride + hk * D;
        float dp = 0.f;
        for (int d = 0; d < D; ++d) dp += __bfloat162float(dor[d]) * __bfloat162float(vr[d]);
        ds = p * (dp - delta[row]);
    }
    P[at] = p;
    dS[at] = ds;
}

// delta[bh, i] = sum_d dout[b, i, h, d] out[b, i, h, d]; one thread per row.
__global__ void naive_delta_kernel(float* delta, const bf16* dout, const bf16* out, int T, int Hq, int D, long rows) {
    const long row = blockIdx.x * (long)blockDim.x + threadIdx.x;  // (b, h, i)
    if (row >= rows) return;
    const int i = (int)(row % T), h = (int)(row / T % Hq), b = (int)(row / T / Hq);
    const long at = (((long)b * T + i) * Hq + h) * D;
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += __bfloat162float(dout[at + d]) * __bfloat162float(out[at + d]);
    delta[row] = acc;
}

// dq[b, i, h, d] = scale * sum_j dS[bh, i, j] k[b, j, hk, d]. grid (ceil(T*D/256), B*Hq).
__global__ void naive_dq_kernel(bf16* dq, const float* dS, const bf16* k, int stride, int dstride, int T, int Hq,
                                int Hkv, int D, float scale) {
    const long id = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (id >= (long)T * D) return;
    const int i = (int)(id / D), d = (int)(id % D);
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const float* ds = dS + ((long)blockIdx.y * T + i) * T;
    float acc = 0.f;
    for (int j = 0; j <= i; ++j) acc += ds[j] * __bfloat162float(k[((long)b * T + j) * stride + hk * D + d]);
    dq[((long)b * T + i) * dstride + h * D + d] = __float2bfloat16(acc * scale);
}

// dk[b, j, hk, d] = scale * sum_{h of hk} sum_i dS[bh, i, j] q[b, i, h, d]; dv likewise with P and
// dout. grid (ceil(T*D/256), B*Hkv).
__global__ void naive_dkdv_kernel(bf16* dk, bf16* dv, const float* P, const float* dS, const bf16* q,
                                  const bf16* dout, int stride, int dstride, int T, int Hq, int Hkv, int D,
                                  float scale) {
    const long id = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (id >= (long)T * D) return;
    const int j = (int)(id / D), d = (int)(id % D);
    const int b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv, G = Hq / Hkv;
    float acc_k = 0.f, acc_v = 0.f;
    for (int h = hk * G; h < hk * G + G; ++h) {
        const long bh = (long)b * Hq + h;
        for (int i = j; i < T; ++i) {
            const long at = (bh * T + i) * T + j;
            acc_k += dS[at] * __bfloat162float(q[((long)b * T + i) * stride + h * D + d]);
            acc_v += P[at] * __bfloat162float(dout[(((long)b * T + i) * Hq + h) * D + d]);
        }
    }
    dk[((long)b * T + j) * dstride + hk * D + d] = __float2bfloat16(acc_k * scale);
    dv[((long)b * T + j) * dstride + hk * D + d] = __float2bfloat16(acc_v);
}

static void naive_attention_backward(bf16* dq, bf16* dk, bf16* dv, float* delta, const bf16* dout, const bf16* out,
                                     const float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                                     int dqkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    naive_reserve((size_t)B * Hq * T * T);
    float *P = naive_scratch[0], *dS = naive_scratch[1];
    const float scale = 1.f / sqrtf((float)D);
    const long rows = (long)B * Hq * T;
    naive_delta_kernel<<<ceil_div(rows, 256), 256, 0, stream>>>(delta, dout, out, T, Hq, D, rows);
    CUDA_CHECK(cudaGetLastError());
    const dim3 grid_tt(ceil_div((long)T * T, 256), B * Hq);
    naive_scores_kernel<<<grid_tt, 256, 0, stream>>>(P, q, k, qkv_stride, T, Hq, Hkv, D, scale);
    CUDA_CHECK(cudaGetLastError());
    naive_dsoft_kernel<<<grid_tt, 256, 0, stream>>>(P, dS, lse, delta, dout, v, qkv_stride, T, Hq, Hkv, D);
    CUDA_CHECK(cudaGetLastError());
    naive_dq_kernel<<<dim3(ceil_div((long)T * D, 256), B * Hq), 256, 0, stream>>>(dq, dS, k, qkv_stride, dqkv_stride,
                                                                                 T, Hq, Hkv, D, scale);
    CUDA_CHECK(cudaGetLastError());
    naive_dkdv_kernel<<<dim3(ceil_div((long)T * D, 256), B * Hkv), 256, 0, stream>>>(
        dk, dv, P, dS, q, dout, qkv_stride, dqkv_stride, T, Hq, Hkv, D, scale);
    CUDA_CHECK(cudaGetLastError());
}
