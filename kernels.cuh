/*
 * kernels.cuh - every CUDA kernel train_gpt runs, and the one cuBLASLt wrapper all matmuls use.
 *
 * Read it top to bottom in the order of a training step: embedding, RMSNorm, the per-head QK norm
 * with rotary embedding, attention, SwiGLU, the chunked cross-entropy, then the reductions (global
 * gradient norm, loss sum) and the fused AdamW update. Each forward kernel is followed by its
 * backward, whose comment states the derivative it computes.
 *
 * Conventions a reader must know:
 *  - Activations are bf16, row-major, one row per token: x[n, c] with n = b*T + t.
 *  - Every reduction accumulates in fp32, and every reduction across rows is deterministic: a
 *    fixed grid writes per-block partial sums, and a second kernel adds them in a fixed order.
 *    There are no floating-point atomics anywhere, so a run repeats bit for bit on the same GPU.
 *  - Parameter gradients are fp32 and accumulate (+=) so that micro-batches add up; they are
 *    zeroed once per optimizer step. The gradient of the residual stream is bf16 and is updated
 *    in place as the backward walks down the layers.
 *  - Rows are read in 16-byte vectors of 8 bf16, so every row length must be a multiple of 8
 *    (train_gpt's config check enforces this before anything is allocated).
 */
#ifndef KERNELS_CUH
#define KERNELS_CUH

#include <math.h>
#include <float.h>
#include <cublasLt.h>
#include "cuda_common.h"

// ----------------------------------------------------------------------------------------------
// Small device helpers

// Eight bf16 values moved as one 16-byte load or store.
struct __align__(16) bf16x8 {
    bf16 v[8];
};
__device__ __forceinline__ bf16x8 load8(const bf16* p) { return *reinterpret_cast<const bf16x8*>(p); }
__device__ __forceinline__ void store8(bf16* p, const bf16x8& x) { *reinterpret_cast<bf16x8*>(p) = x; }

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets the result.
__device__ float block_sum(float x) {
    __shared__ float warp_totals[32];
    __shared__ float total;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    x = warp_sum(x);
    if (lane == 0) warp_totals[warp] = x;
    __syncthreads();
    if (warp == 0) {
        float y = lane < n_warps ? warp_totals[lane] : 0.0f;
        y = warp_sum(y);
        if (lane == 0) total = y;
    }
    __syncthreads();
    float result = total;
    __syncthreads();  // so that a second call may reuse the shared slots
    return result;
}

#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

// ----------------------------------------------------------------------------------------------
// Deterministic reductions

// Many kernels below produce one row of partial sums per block: partials[p * stride + c] for
// p < n_partials, c < C. This adds them up and accumulates into dst (+=). A block owns 32 columns;
// its 32 thread rows each sum every 32nd partial row, and thread row 0 then adds the 32 sums in
// order: a fixed order (deterministic), with enough loads in flight to run at memory speed.
__global__ void sum_partials_kernel(float* dst, const float* partials, int n_partials, int C, int stride) {
    __shared__ float row_sums[32][33];  // +1: no bank conflicts on the transposed read
    int c = blockIdx.x * 32 + threadIdx.x;
    float sum = 0.0f;
    if (c < C)
        for (int p = threadIdx.y; p < n_partials; p += 32) sum += partials[(size_t)p * stride + c];
    row_sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float total = 0.0f;
        for (int y = 0; y < 32; y++) total += row_sums[y][threadIdx.x];
        dst[c] += total;
    }
}

static void sum_partials(float* dst, const float* partials, int n_partials, int C, int stride, cudaStream_t s) {
    sum_partials_kernel<<<ceil_div(C, 32), dim3(32, 32), 0, s>>>(dst, partials, n_partials, C, stride);
    LAUNCH_CHECK();
}

// Sum (or sum of squares) of a long fp32 vector in two fixed-shape passes: REDUCE_BLOCKS blocks
// each stride over the vector and write one partial; one block then adds the partials in order.
// `out` receives the total (accumulate = false) or has it added (accumulate = true).
#define REDUCE_BLOCKS 512
template <bool SQUARE>
__global__ void reduce_partials_kernel(float* partials, const float* x, size_t n) {
    float sum = 0.0f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i];
        sum += SQUARE ? v * v : v;
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

__global__ void reduce_final_kernel(float* out, const float* partials, int n, bool accumulate) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += partials[i];
    sum = block_sum(sum);
    if (threadIdx.x == 0) *out = accumulate ? *out + sum : sum;
}

// scratch must hold REDUCE_BLOCKS floats.
static void reduce_sum(float* out, const float* x, size_t n, bool square, bool accumulate, float* scratch,
                       cudaStream_t s) {
    if (square) reduce_partials_kernel<true><<<REDUCE_BLOCKS, 512, 0, s>>>(scratch, x, n);
    else reduce_partials_kernel<false><<<REDUCE_BLOCKS, 512, 0, s>>>(scratch, x, n);
    LAUNCH_CHECK();
    reduce_final_kernel<<<1, 512, 0, s>>>(out, scratch, REDUCE_BLOCKS, accumulate);
    LAUNCH_CHECK();
}

// ----------------------------------------------------------------------------------------------
// Initialization: a counter-based normal RNG, so that every element's value depends only on the
// seed and its index (not on the launch shape), and fp32 -> bf16 casts.

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// p[i] = mean + std * N(0, 1), the normal drawn by Box-Muller from the hash of (seed, i).
__global__ void init_normal_kernel(float* p, size_t n, float mean, float std, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = splitmix64(seed ^ splitmix64(i));
        float u1 = ((h >> 40) + 1) * (1.0f / 16777217.0f);  // in (0, 1]: log() stays finite
        float u2 = ((h >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
        p[i] = mean + std * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    }
}

static void init_normal(float* p, size_t n, float mean, float std, uint64_t seed, cudaStream_t s) {
    init_normal_kernel<<<1024, 256, 0, s>>>(p, n, mean, std, seed);
    LAUNCH_CHECK();
}

__global__ void cast_to_bf16_kernel(bf16* out, const float* in, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(in[i]);
}

static void cast_to_bf16(bf16* out, const float* in, size_t n, cudaStream_t s) {
    cast_to_bf16_kernel<<<1024, 256, 0, s>>>(out, in, n);
    LAUNCH_CHECK();
}

// ----------------------------------------------------------------------------------------------
// Token embedding. Forward: x[n, :] = E[token[n], :].

__global__ void embedding_forward_kernel(bf16* out, const int* tokens, const bf16* embed, int N, int C) {
    size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * 8;  // first of 8 elements
    if (i >= (size_t)N * C) return;
    int n = (int)(i / C), c = (int)(i % C);
    store8(out + i, load8(embed + (size_t)tokens[n] * C + c));
}

static void embedding_forward(bf16* out, const int* tokens, const bf16* embed, int N, int C, cudaStream_t s) {
    embedding_forward_kernel<<<ceil_div((size_t)N * C / 8, 256), 256, 0, s>>>(out, tokens, embed, N, C);
    LAUNCH_CHECK();
}

// Backward: dE[v, :] += sum over positions n with token[n] == v of dx[n, :].
// Many positions share a token, so a naive scatter-add would need atomics. Instead the host sorts
// the positions by token (a stable counting sort of the batch it already holds): bucket u holds the
// positions of token bucket_token[u], in increasing order, at bucket_pos[bucket_start[u] ..
// bucket_start[u+1]). One block owns one bucket (and 8*blockDim.x columns of it), adds its rows in
// that fixed order and writes the one row of dE it owns: deterministic and free of races.
__global__ void embedding_backward_kernel(float* d_embed, const bf16* dx, const int* bucket_start,
                                          const int* bucket_pos, const int* bucket_token, int C) {
    int u = blockIdx.x;
    int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c >= C) return;
    float sum[8] = {0};
    for (int j = bucket_start[u]; j < bucket_start[u + 1]; j++) {
        bf16x8 g = load8(dx + (size_t)bucket_pos[j] * C + c);
        for (int k = 0; k < 8; k++) sum[k] += __bfloat162float(g.v[k]);
    }
    float* row = d_embed + (size_t)bucket_token[u] * C + c;
    for (int k = 0; k < 8; k++) row[k] += sum[k];
}

static void embedding_backward(float* d_embed, const bf16* dx, const int* bucket_start, const int* bucket_pos,
                               const int* bucket_token, int n_buckets, int C, cudaStream_t s) {
    dim3 grid(n_buckets, ceil_div(C, 8 * 128));
    embedding_backward_kernel<<<grid, 128, 0, s>>>(d_embed, dx, bucket_start, bucket_pos, bucket_token, C);
    LAUNCH_CHECK();
}

// ----------------------------------------------------------------------------------------------
// RMSNorm: y = w * x / rms(x), rms(x) = sqrt(mean(x^2) + eps), over the C channels of each row.
// One warp per row; the forward saves rstd = 1/rms(x) per row for the backward.

__global__ void rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* in, const bf16* weight,
                                       int N, int C, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const bf16* x = in + (size_t)row * C;
    float sum_sq = 0.0f;
    for (int c = lane * 8; c < C; c += 32 * 8) {
        bf16x8 v = load8(x + c);
        for (int k = 0; k < 8; k++) {
            float f = __bfloat162float(v.v[k]);
            sum_sq += f * f;
        }
    }
    float r = rsqrtf(warp_sum(sum_sq) / C + eps);
    for (int c = lane * 8; c < C; c += 32 * 8) {
        bf16x8 v = load8(x + c), w = load8(weight + c), y;
        for (int k = 0; k < 8; k++)
            y.v[k] = __float2bfloat16(__bfloat162float(v.v[k]) * r * __bfloat162float(w.v[k]));
        store8(out + (size_t)row * C + c, y);
    }
    if (lane == 0) rstd[row] = r;
}

static void rmsnorm_forward(bf16* out, float* rstd, const bf16* in, const bf16* weight, int N, int C, float eps,
                            cudaStream_t s) {
    rmsnorm_forward_kernel<<<ceil_div(N, 8), 256, 0, s>>>(out, rstd, in, weight, N, C, eps);
    LAUNCH_CHECK();
}

// Backward. With x_hat = x * rstd and g = dy * w (elementwise),
//   dL/dx = rstd * (g - x_hat * mean(g * x_hat))      (the mean over the row's C channels)
//   dL/dw = sum over rows of dy * x_hat
// dL/dx is added into d_residual (the norm reads the residual stream, whose gradient already holds
// the contribution of the skip connection). Each block takes RMSNORM_BWD_ROWS consecutive rows;
// each of its 4 warps keeps its own fp32 dw row in shared memory, and the block writes their sum
// as its partial (sum_partials adds the blocks' partials in order).
#define RMSNORM_BWD_ROWS 64
#define RMSNORM_BWD_WARPS 4
__global__ void rmsnorm_backward_kernel(bf16* d_residual, float* dw_partials, const bf16* dy, const bf16* in,
                                        const bf16* weight, const float* rstd, int N, int C) {
    extern __shared__ float dw_warp[];  // [RMSNORM_BWD_WARPS][C]
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float* my_dw = dw_warp + warp * C;
    for (int c = lane; c < C; c += 32) my_dw[c] = 0.0f;
    __syncwarp();
    int row_end = min(N, (blockIdx.x + 1) * RMSNORM_BWD_ROWS);
    for (int row = blockIdx.x * RMSNORM_BWD_ROWS + warp; row < row_end; row += RMSNORM_BWD_WARPS) {
        const bf16* x = in + (size_t)row * C;
        const bf16* g_out = dy + (size_t)row * C;
        bf16* d_res = d_residual + (size_t)row * C;
        float r = rstd[row];
        float dot = 0.0f;  // sum over c of g * x_hat
        for (int c = lane * 8; c < C; c += 32 * 8) {
            bf16x8 xv = load8(x + c), gv = load8(g_out + c), wv = load8(weight + c);
            for (int k = 0; k < 8; k++)
                dot += __bfloat162float(gv.v[k]) * __bfloat162float(wv.v[k]) * __bfloat162float(xv.v[k]) * r;
        }
        float mean_dot = warp_sum(dot) / C;
        for (int c = lane * 8; c < C; c += 32 * 8) {
            bf16x8 xv = load8(x + c), gv = load8(g_out + c), wv = load8(weight + c), rv = load8(d_res + c);
            for (int k = 0; k < 8; k++) {
                float x_hat = __bfloat162float(xv.v[k]) * r;
                float dyk = __bfloat162float(gv.v[k]);
                float g = dyk * __bfloat162float(wv.v[k]);
                rv.v[k] = __float2bfloat16(__bfloat162float(rv.v[k]) + r * (g - x_hat * mean_dot));
                my_dw[c + k] += dyk * x_hat;
            }
            store8(d_res + c, rv);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < RMSNORM_BWD_WARPS; w++) sum += dw_warp[w * C + c];
        dw_partials[(size_t)blockIdx.x * C + c] = sum;
    }
}

// dw_partials must hold ceil(N / RMSNORM_BWD_ROWS) * C floats.
static void rmsnorm_backward(bf16* d_residual, float* d_weight, float* dw_partials, const bf16* dy, const bf16* in,
                             const bf16* weight, const float* rstd, int N, int C, cudaStream_t s) {
    int blocks = ceil_div(N, RMSNORM_BWD_ROWS);
    size_t smem = RMSNORM_BWD_WARPS * C * sizeof(float);
    CUDA_CHECK(cudaFuncSetAttribute(rmsnorm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    rmsnorm_backward_kernel<<<blocks, 32 * RMSNORM_BWD_WARPS, smem, s>>>(d_residual, dw_partials, dy, in, weight,
                                                                         rstd, N, C);
    LAUNCH_CHECK();
    sum_partials(d_weight, dw_partials, blocks, C, C, s);
}

// ----------------------------------------------------------------------------------------------
// Per-head QK RMSNorm followed by rotary position embedding (Qwen3), on the fused QKV rows.
//
// A row of qkv holds Hq query heads, then Hkv key heads, then Hkv value heads, D channels each.
// For each query and key head: a = w * x / rms(x) (w is q_norm or k_norm, length D), then the
// rotate-half RoPE at the row's position t pairs channel i with i + D/2 (i < D/2):
//   y[i]       = a[i] cos(t f_i) - a[i + D/2] sin(t f_i)
//   y[i + D/2] = a[i + D/2] cos(t f_i) + a[i] sin(t f_i),    f_i = theta^(-2i/D).
// Value heads are copied unchanged, so that qkv_rot has the same layout as qkv and attention reads
// q, k and v from one buffer. One warp per (row, head); lane l owns pairs i = l + 32j. The tables
// rope_cos and rope_sin are [T, D/2] fp32.

template <int D>
__global__ void qk_norm_rope_forward_kernel(bf16* qkv_rot, float* rstd, const bf16* qkv, const bf16* q_weight,
                                            const bf16* k_weight, const float* rope_cos, const float* rope_sin,
                                            int N, int T, int Hq, int Hkv, float eps) {
    constexpr int PAIRS = D / 64;  // pairs (i, i + D/2) per lane
    const int H = Hq + 2 * Hkv;
    size_t task = blockIdx.x * (size_t)(blockDim.x / 32) + threadIdx.x / 32;
    if (task >= (size_t)N * H) return;
    const int lane = threadIdx.x % 32, n = (int)(task / H), h = (int)(task % H), t = n % T;
    const bf16* x = qkv + (size_t)n * H * D + h * D;
    bf16* y = qkv_rot + (size_t)n * H * D + h * D;
    if (h >= Hq + Hkv) {  // a value head
        for (int i = lane; i < D; i += 32) y[i] = x[i];
        return;
    }
    const bf16* w = h < Hq ? q_weight : k_weight;
    float lo[PAIRS], hi[PAIRS], sum_sq = 0.0f;
    for (int j = 0; j < PAIRS; j++) {
        lo[j] = __bfloat162float(x[lane + 32 * j]);
        hi[j] = __bfloat162float(x[lane + 32 * j + D / 2]);
        sum_sq += lo[j] * lo[j] + hi[j] * hi[j];
    }
    float r = rsqrtf(warp_sum(sum_sq) / D + eps);
    for (int j = 0; j < PAIRS; j++) {
        int i = lane + 32 * j;
        float a_lo = lo[j] * r * __bfloat162float(w[i]);
        float a_hi = hi[j] * r * __bfloat162float(w[i + D / 2]);
        float c = rope_cos[t * (D / 2) + i], s = rope_sin[t * (D / 2) + i];
        y[i] = __float2bfloat16(a_lo * c - a_hi * s);
        y[i + D / 2] = __float2bfloat16(a_hi * c + a_lo * s);
    }
    if (lane == 0) rstd[(size_t)n * (Hq + Hkv) + h] = r;
}

// Backward, in place on d_qkv: on entry its q and k heads hold dL/dy (attention's dq, dk), on exit
// dL/dx; the value heads are left as they are. RoPE is a rotation, so dL/da is dL/dy rotated back:
//   da[i] = dy[i] cos + dy[i + D/2] sin,   da[i + D/2] = dy[i + D/2] cos - dy[i] sin,
// and then, as for RMSNorm, with x_hat = x * rstd and g = da * w:
//   dx = rstd * (g - x_hat * mean(g * x_hat)),   dw += da * x_hat (summed over rows and heads).
// Each block takes QK_BWD_TASKS consecutive (row, head) tasks and writes one partial row of
// [dq_norm (D) | dk_norm (D)].
#define QK_BWD_TASKS 256
#define QK_BWD_WARPS 8
template <int D>
__global__ void qk_norm_rope_backward_kernel(bf16* d_qkv, float* dw_partials, const bf16* qkv, const float* rstd,
                                             const bf16* q_weight, const bf16* k_weight, const float* rope_cos,
                                             const float* rope_sin, int N, int T, int Hq, int Hkv) {
    constexpr int PAIRS = D / 64;
    __shared__ float dw_warp[QK_BWD_WARPS][2 * D];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, H = Hq + 2 * Hkv;
    float dw_q[2 * PAIRS] = {0}, dw_k[2 * PAIRS] = {0};  // this lane's channels: lo pairs, then hi pairs
    size_t task_end = min((size_t)N * (Hq + Hkv), (blockIdx.x + 1) * (size_t)QK_BWD_TASKS);
    for (size_t task = blockIdx.x * (size_t)QK_BWD_TASKS + warp; task < task_end; task += QK_BWD_WARPS) {
        const int n = (int)(task / (Hq + Hkv)), h = (int)(task % (Hq + Hkv)), t = n % T;
        const bf16* x = qkv + (size_t)n * H * D + h * D;
        bf16* dx = d_qkv + (size_t)n * H * D + h * D;
        const bf16* w = h < Hq ? q_weight : k_weight;
        float* dw = h < Hq ? dw_q : dw_k;
        const float r = rstd[(size_t)n * (Hq + Hkv) + h];
        float x_hat[2 * PAIRS], g[2 * PAIRS], dot = 0.0f;
        for (int j = 0; j < PAIRS; j++) {
            int i = lane + 32 * j;
            float c = rope_cos[t * (D / 2) + i], s = rope_sin[t * (D / 2) + i];
            float dy_lo = __bfloat162float(dx[i]), dy_hi = __bfloat162float(dx[i + D / 2]);
            float da_lo = dy_lo * c + dy_hi * s, da_hi = dy_hi * c - dy_lo * s;
            x_hat[j] = __bfloat162float(x[i]) * r;
            x_hat[PAIRS + j] = __bfloat162float(x[i + D / 2]) * r;
            dw[j] += da_lo * x_hat[j];
            dw[PAIRS + j] += da_hi * x_hat[PAIRS + j];
            g[j] = da_lo * __bfloat162float(w[i]);
            g[PAIRS + j] = da_hi * __bfloat162float(w[i + D / 2]);
            dot += g[j] * x_hat[j] + g[PAIRS + j] * x_hat[PAIRS + j];
        }
        float mean_dot = warp_sum(dot) / D;
        for (int j = 0; j < PAIRS; j++) {
            int i = lane + 32 * j;
            dx[i] = __float2bfloat16(r * (g[j] - x_hat[j] * mean_dot));
            dx[i + D / 2] = __float2bfloat16(r * (g[PAIRS + j] - x_hat[PAIRS + j] * mean_dot));
        }
    }
    for (int j = 0; j < PAIRS; j++) {
        int i = lane + 32 * j;
        dw_warp[warp][i] = dw_q[j];
        dw_warp[warp][i + D / 2] = dw_q[PAIRS + j];
        dw_warp[warp][D + i] = dw_k[j];
        dw_warp[warp][D + i + D / 2] = dw_k[PAIRS + j];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * D; c += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < QK_BWD_WARPS; w++) sum += dw_warp[w][c];
        dw_partials[(size_t)blockIdx.x * 2 * D + c] = sum;
    }
}

static void qk_norm_rope_forward(bf16* qkv_rot, float* rstd, const bf16* qkv, const bf16* q_weight,
                                 const bf16* k_weight, const float* rope_cos, const float* rope_sin, int N, int T,
                                 int Hq, int Hkv, int D, float eps, cudaStream_t s) {
    size_t tasks = (size_t)N * (Hq + 2 * Hkv);
    int blocks = ceil_div(tasks, 8);
    if (D == 64)
        qk_norm_rope_forward_kernel<64><<<blocks, 256, 0, s>>>(qkv_rot, rstd, qkv, q_weight, k_weight, rope_cos,
                                                               rope_sin, N, T, Hq, Hkv, eps);
    else
        qk_norm_rope_forward_kernel<128><<<blocks, 256, 0, s>>>(qkv_rot, rstd, qkv, q_weight, k_weight, rope_cos,
                                                                rope_sin, N, T, Hq, Hkv, eps);
    LAUNCH_CHECK();
}

// dw_partials must hold ceil(N * (Hq + Hkv) / QK_BWD_TASKS) * 2 * D floats.
static void qk_norm_rope_backward(bf16* d_qkv, float* dq_weight, float* dk_weight, float* dw_partials,
                                  const bf16* qkv, const float* rstd, const bf16* q_weight, const bf16* k_weight,
                                  const float* rope_cos, const float* rope_sin, int N, int T, int Hq, int Hkv, int D,
                                  cudaStream_t s) {
    int blocks = ceil_div((size_t)N * (Hq + Hkv), QK_BWD_TASKS);
    if (D == 64)
        qk_norm_rope_backward_kernel<64><<<blocks, 32 * QK_BWD_WARPS, 0, s>>>(
            d_qkv, dw_partials, qkv, rstd, q_weight, k_weight, rope_cos, rope_sin, N, T, Hq, Hkv);
    else
        qk_norm_rope_backward_kernel<128><<<blocks, 32 * QK_BWD_WARPS, 0, s>>>(
            d_qkv, dw_partials, qkv, rstd, q_weight, k_weight, rope_cos, rope_sin, N, T, Hq, Hkv);
    LAUNCH_CHECK();
    sum_partials(dq_weight, dw_partials, blocks, D, 2 * D, s);
    sum_partials(dk_weight, dw_partials + D, blocks, D, 2 * D, s);
}

// ----------------------------------------------------------------------------------------------
// Attention: causal grouped-query self-attention, bf16 in and out, fp32 softmax statistics.
//
// These are version 3 of the dev/ ladder (dev/attention.cu; doc/attention.md has the measurements):
// FlashAttention-2's algorithm on Hopper's warpgroup matrix instructions (wgmma, sm_90a). A block
// is two warpgroups (256 threads); each owns 64 rows of every accumulator (query rows in the
// forward and dQ kernels, key rows in the dK/dV kernel). Products whose operands both sit in shared
// memory (S = Q K^T, dP = dO V^T and their transposes) are wgmma chains reading the tiles
// directly; products with P or dS on the left take them from registers (the accumulator layout is
// the A-operand layout) and read the right operand MN-major from shared memory. Tiles are
// double-buffered and loaded with cp.async. The online softmax runs in base 2.
//
// Layout: q, k and v are token-major with a common row stride, so they may point into one packed
// qkv buffer: element (b, t, h, d) of q is q[(b*T + t)*qkv_stride + h*D + d] (h < Hq; k and v alike
// with h < Hkv). KV head j serves query heads j*G .. j*G+G-1, G = Hq/Hkv, indexed in place, never
// copied. out is [B, T, Hq, D]; lse is [B, Hq, T], the natural-log logsumexp of the scaled scores.
// The backward writes (=) dq, dk, dv; dk and dv sum over the G query heads of their KV head inside
// one thread block in a fixed order, so it is bitwise deterministic (no floating-point atomics).
// D is 64 or 128 (a template parameter); any T >= 1 (the last tile is masked).
//
// Shared memory is laid out as wgmma's 128-byte swizzle expects: a [R][D] tile is D/64 panels of
// [R][64] (128-byte rows); 16-byte chunk c of row r of a panel sits at chunk c ^ (r & 7), each panel
// 1024-byte aligned. A K-major descriptor advances 32 bytes per 16-element k-step inside a panel; an
// MN-major one advances 16 rows (2048 bytes) per step.
//
// Measured on an H100 SXM (B*T = 16K tokens, causal FLOPs counted once): D = 128, T = 512 / 1024 /
// 2048 / 4096: forward 207 / 295 / 365 / 411 TFLOP/s, backward 164 / 222 / 264 / 292.
// First the helpers (PTX wrappers, the softmax step, row stores, delta), which version 2 in dev/
// shares, then the kernels and their launchers.

// ----------------------------------------------------------------------------------------------
// PTX wrappers

static __device__ __forceinline__ uint32_t attn_smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16-byte async copy global -> shared; when pred is false nothing is read and 16 zero bytes land.
static __device__ __forceinline__ void attn_cp_async16(uint32_t dst, const void* src, bool pred) {
    int src_bytes = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
static __device__ __forceinline__ void attn_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void attn_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}


static __device__ __forceinline__ float attn_exp2(float x) {  // 2^x; 2^-inf = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ uint32_t attn_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low 16 bits
    return *reinterpret_cast<uint32_t*>(&v);
}

template <int N>
static __device__ __forceinline__ void attn_zero(float (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.f;
}

// Writes a warp's 16 x D fp32 accumulator (times mul) as bf16 rows row0+g and row0+g+8 of a
// token-major tensor; rows at or past T are skipped.
template <int D>
static __device__ __forceinline__ void attn_store_rows(bf16* g, long stride, int row0, int T,
                                                      const float (&acc)[D / 8][4], float mul0,
                                                      float mul1, int lane) {
    const int r0 = row0 + (lane >> 2), c0 = 2 * (lane & 3);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        if (r0 < T)
            *reinterpret_cast<uint32_t*>(g + (long)r0 * stride + dt * 8 + c0) =
                attn_pack_bf16(acc[dt][0] * mul0, acc[dt][1] * mul0);
        if (r0 + 8 < T)
            *reinterpret_cast<uint32_t*>(g + (long)(r0 + 8) * stride + dt * 8 + c0) =
                attn_pack_bf16(acc[dt][2] * mul1, acc[dt][3] * mul1);
    }
}

// Online softmax of one tile of scores, in place (s becomes P, unnormalized); the running row
// sums and O are rescaled by 2^(m_old - m_new). The caller then adds P V to O.
template <int D, int MT, int NT>
static __device__ __forceinline__ void attn_fwd_softmax(float (&o)[MT][D / 8][4], float (&s)[MT][NT][4],
                                                       float (&row_max)[MT][2], float (&row_sum)[MT][2],
                                                       float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(row_max[mt][r], mx * scale_log2);
            const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with no visible key yet
            const float alpha = attn_exp2(row_max[mt][r] - m_use);  // rescales the old sums and O
            row_max[mt][r] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = attn_exp2(fmaf(s[mt][nt][2 * r + e], scale_log2, -m_use));
                    s[mt][nt][2 * r + e] = p;
                    sum += p;
                }
            row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                o[mt][dt][2 * r] *= alpha;
                o[mt][dt][2 * r + 1] *= alpha;
            }
        }
}

// ----------------------------------------------------------------------------------------------
// Backward. With s = scale * q.k, P = exp(s - lse), O = P V and dO given:
//   dV = P^T dO,   dP = dO V^T,   dS = P o (dP - delta),   delta_i = sum_d dO_id O_id = rowsum(P o dP),
//   dQ = scale * dS K,   dK = scale * dS^T Q   (o: elementwise product).
// Three kernels: delta; dK,dV over KV tiles (each block loops over the G query heads and every
// query tile at or below the diagonal, accumulating in registers); dQ over query tiles. dQ's
// kernel recomputes P and dP (7 matrix products in all instead of FA2's 5 with atomics): the price
// of determinism.

// delta[b, h, t] = sum_d dout[b, t, h, d] * out[b, t, h, d]; one warp per (b, t, h) row.
__global__ void attn_delta_kernel(float* __restrict__ delta, const bf16* __restrict__ dout,
                                 const bf16* __restrict__ out, int T, int Hq, int D, long rows) {
    const long row = (long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(dout + row * D);
    const __nv_bfloat162* c = reinterpret_cast<const __nv_bfloat162*>(out + row * D);
    float acc = 0.f;
    for (int i = lane; i < D / 2; i += 32) {
        const float2 x = __bfloat1622float2(a[i]), y = __bfloat1622float2(c[i]);
        acc += x.x * y.x + x.y * y.y;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
        const long bt = row / Hq;
        const int h = (int)(row % Hq), t = (int)(bt % T), b = (int)(bt / T);
        delta[((long)b * Hq + h) * T + t] = acc;
    }
}

// ----------------------------------------------------------------------------------------------
// Launchers. The tile configuration of each kernel is a template argument, so the dev/ ladder can
// time alternatives; attention_forward / attention_backward below pick the measured best.

template <typename Kernel>
static void attn_allow_smem(Kernel kernel, int bytes) {
    if (bytes > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

static void attn_delta_launch(float* delta, const bf16* dout, const bf16* out, int B, int T, int Hq, int D,
                             cudaStream_t stream) {
    const long rows = (long)B * T * Hq;
    attn_delta_kernel<<<ceil_div(rows, 8), 256, 0, stream>>>(delta, dout, out, T, Hq, D, rows);
    CUDA_CHECK(cudaGetLastError());
}

// Argument checks shared by both entry points: one line naming the bad value, then exit(1).
static void attn_check_args(const char* fn, const void* const* ptrs, int nptrs, int stride, int B, int T,
                           int Hq, int Hkv, int D) {
    if (D != 64 && D != 128) {
        fprintf(stderr, "%s: head_dim %d is not supported; the kernels are built for 64 and 128\n", fn, D);
        exit(1);
    }
    if (B < 1 || T < 1 || Hkv < 1 || Hq % Hkv != 0 || B * Hq > 65535) {
        fprintf(stderr, "%s: bad shape B=%d T=%d Hq=%d Hkv=%d (need B, T >= 1, Hq a multiple of Hkv, "
                        "B*Hq <= 65535)\n", fn, B, T, Hq, Hkv);
        exit(1);
    }
    if (stride % 8 != 0 || stride < Hq * D) {
        fprintf(stderr, "%s: row stride %d must be a multiple of 8 elements and at least Hq*D = %d\n", fn,
                stride, Hq * D);
        exit(1);
    }
    for (int i = 0; i < nptrs; ++i)
        if ((uintptr_t)ptrs[i] % 16 != 0) {
            fprintf(stderr, "%s: pointer argument %d (%p) is not 16-byte aligned\n", fn, i, ptrs[i]);
            exit(1);
        }
}

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

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading-byte offset (unused
// here: 16 bytes), stride-byte offset 1024 (eight 128-byte rows), base offset 0.
static __device__ __forceinline__ uint64_t wg_desc(uint32_t smem_addr) {
    uint64_t d = 0;
    d |= (uint64_t)((smem_addr & 0x3FFFF) >> 4);
    d |= (uint64_t)1 << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}

// d[N/8][4] (+)= A (64 x 16, shared, K-major) * B (N rows x 16, shared, K-major)^T; SCALE_D = 0
// overwrites d. Accumulator layout per warp w of the warpgroup: rows 16w + g and 16w + g + 8,
// columns 8j + 2i, 8j + 2i + 1 in d[j] (lane = 4g + i), the mma.m16n8 layout repeated.
template <int SCALE_D>
static __device__ __forceinline__ void wg_mma_ss_n32(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D));
}

template <int SCALE_D>
static __device__ __forceinline__ void wg_mma_ss_n64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D));
}

template <int SCALE_D>
static __device__ __forceinline__ void wg_mma_ss_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D));
}

// The SS product for N in {32, 64, 128}.
template <int N, int SCALE_D>
static __device__ __forceinline__ void wg_mma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (N == 32) wg_mma_ss_n32<SCALE_D>(d, desc_a, desc_b);
    else if constexpr (N == 64) wg_mma_ss_n64<SCALE_D>(d, desc_a, desc_b);
    else wg_mma_ss_n128<SCALE_D>(d, desc_a, desc_b);
}

// d[OFF .. OFF+7][4] += A (64 x 16 bf16 in registers, the mma.m16n8k16 A layout per warp) *
// B (16 x 64, shared, MN-major: each k row holds 64 contiguous columns, hence trans-b = 1).
template <int OFF, int N8>
static __device__ __forceinline__ void wg_mma_rs_n64_tb(float (&d)[N8][4], const uint32_t (&a)[4], uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[OFF + 0][0]), "+f"(d[OFF + 0][1]), "+f"(d[OFF + 0][2]), "+f"(d[OFF + 0][3]),
          "+f"(d[OFF + 1][0]), "+f"(d[OFF + 1][1]), "+f"(d[OFF + 1][2]), "+f"(d[OFF + 1][3]),
          "+f"(d[OFF + 2][0]), "+f"(d[OFF + 2][1]), "+f"(d[OFF + 2][2]), "+f"(d[OFF + 2][3]),
          "+f"(d[OFF + 3][0]), "+f"(d[OFF + 3][1]), "+f"(d[OFF + 3][2]), "+f"(d[OFF + 3][3]),
          "+f"(d[OFF + 4][0]), "+f"(d[OFF + 4][1]), "+f"(d[OFF + 4][2]), "+f"(d[OFF + 4][3]),
          "+f"(d[OFF + 5][0]), "+f"(d[OFF + 5][1]), "+f"(d[OFF + 5][2]), "+f"(d[OFF + 5][3]),
          "+f"(d[OFF + 6][0]), "+f"(d[OFF + 6][1]), "+f"(d[OFF + 6][2]), "+f"(d[OFF + 6][3]),
          "+f"(d[OFF + 7][0]), "+f"(d[OFF + 7][1]), "+f"(d[OFF + 7][2]), "+f"(d[OFF + 7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}

// ----------------------------------------------------------------------------------------------
// Tile loads into the panel layout: thread i copies chunk i % (D/8) of rows i / (D/8) + n*RSTEP.

template <int D, int ROWS, int THREADS>
static __device__ __forceinline__ void wg_load_tile(bf16* tile, const bf16* g, long stride, int row0, int T) {
    constexpr int CHUNKS = D / 8, RSTEP = THREADS / CHUNKS;
    static_assert(THREADS % CHUNKS == 0 && RSTEP % 8 == 0 && ROWS % RSTEP == 0, "tile rows must split evenly");
    const int r = threadIdx.x / CHUNKS, c = threadIdx.x % CHUNKS;
    const uint32_t dst = attn_smem_u32(tile) + (c / 8) * ROWS * 128 + r * 128 + (((c % 8) ^ (r & 7)) << 4);
    const bf16* src = g + (long)(row0 + r) * stride + c * 8;
#pragma unroll
    for (int it = 0; it < ROWS / RSTEP; ++it) {
        const bool in = row0 + r + it * RSTEP < T;
        attn_cp_async16(dst + it * RSTEP * 128, in ? src : g, in);
        src += RSTEP * stride;
    }
}

// ----------------------------------------------------------------------------------------------
// Forward: one block of 2 warpgroups per (128 query rows, b, query head); warpgroup w owns rows
// 64w .. 64w+63, warp x of it rows 64w + 16x .. +15 (the accumulator rows). KV tiles of BN keys from
// the diagonal down, two buffers, one barrier per tile (loads of tile j-1 overlap tile j).
// Per tile and warpgroup: S = Q K^T (D/16 wgmma, operands in shared memory), mask, online softmax
// (version 2's code, per warp), O += P V (BN/16 k-steps x D/64 wgmma n64).
// Shared memory: Q [128][D], K [2][BN][D], V [2][BN][D] bf16, in 64-column panels.
template <int D, int BN>
__global__ void __launch_bounds__(256, 1)
    wg_forward_kernel(bf16* __restrict__ out, float* __restrict__ lse, const bf16* __restrict__ q,
                      const bf16* __restrict__ k, const bf16* __restrict__ v, int stride, int T, int Hq, int Hkv,
                      float scale_log2) {
    constexpr int BM = 128, THREADS = 256, NT = BN / 8, DT = D / 8;
    static_assert((BN == 64 || BN == 128) && (D == 64 || D == 128), "tile sizes");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(attn_smem);
    bf16* Ks = Qs + BM * D;       // [2][BN * D]
    bf16* Vs = Ks + 2 * BN * D;   // [2][BN * D]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int q_tile = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const int m0 = q_tile * BM;
    const int wrow = warp * 16;  // this warp's accumulator rows inside the tile
    const bf16* qg = q + (long)b * T * stride + h * D;
    const bf16* kg = k + (long)b * T * stride + hk * D;
    const bf16* vg = v + (long)b * T * stride + hk * D;
    const int n_tiles = (min(T, m0 + BM) + BN - 1) / BN;

    float o[1][DT][4], row_max[1][2], row_sum[1][2];
    attn_zero(o[0]);
    row_max[0][0] = row_max[0][1] = -INFINITY;
    row_sum[0][0] = row_sum[0][1] = 0.f;

    wg_load_tile<D, BM, THREADS>(Qs, qg, stride, m0, T);
    wg_load_tile<D, BN, THREADS>(Ks, kg, stride, (n_tiles - 1) * BN, T);
    wg_load_tile<D, BN, THREADS>(Vs, vg, stride, (n_tiles - 1) * BN, T);
    attn_cp_async_commit();

    for (int j = n_tiles - 1; j >= 0; --j) {
        const int n0 = j * BN, buf = (n_tiles - 1 - j) & 1;
        attn_cp_async_wait<0>();  // tile j (and Q) landed ...
        wg_fence_proxy_async();  // ... is ordered before the tensor cores' reads ...
        __syncthreads();         // ... of every thread; every warp is done with tile j+1's buffer
        if (j > 0) {
            wg_load_tile<D, BN, THREADS>(Ks + (buf ^ 1) * BN * D, kg, stride, n0 - BN, T);
            wg_load_tile<D, BN, THREADS>(Vs + (buf ^ 1) * BN * D, vg, stride, n0 - BN, T);
            attn_cp_async_commit();
        }
        if (n0 > m0 + wg * 64 + 63) continue;  // no key of the tile is visible to this warpgroup

        const uint32_t qs = attn_smem_u32(Qs) + wg * 64 * 128;
        const uint32_t ks = attn_smem_u32(Ks + buf * BN * D), vs = attn_smem_u32(Vs + buf * BN * D);
        float s[1][NT][4];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const uint64_t da = wg_desc(qs + (kk / 4) * BM * 128 + (kk % 4) * 32);
            const uint64_t db = wg_desc(ks + (kk / 4) * BN * 128 + (kk % 4) * 32);
            if (kk == 0) wg_mma_ss<BN, 0>(s[0], da, db);
            else wg_mma_ss<BN, 1>(s[0], da, db);
        }
        wg_commit();
        wg_wait<0>();
        wg_fence_regs(s[0]);
        if (n0 + BN - 1 > m0 + wrow) {  // the tile crosses this warp's diagonal: mask key > query
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = m0 + wrow + (lane >> 2) + 8 * (i >> 1);
                    const int col = n0 + nt * 8 + 2 * (lane & 3) + (i & 1);
                    if (col > row) s[0][nt][i] = -INFINITY;
                }
        }
        attn_fwd_softmax<D, 1, NT>(o, s, row_max, row_sum, scale_log2);

        uint32_t pa[BN / 16][4];  // P in bf16, packed before the chain so no wgmma waits on a register write
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            pa[kk][0] = attn_pack_bf16(s[0][2 * kk][0], s[0][2 * kk][1]);
            pa[kk][1] = attn_pack_bf16(s[0][2 * kk][2], s[0][2 * kk][3]);
            pa[kk][2] = attn_pack_bf16(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
            pa[kk][3] = attn_pack_bf16(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
        }
        wg_fence_regs(o[0]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            wg_mma_rs_n64_tb<0, DT>(o[0], pa[kk], wg_desc(vs + kk * 16 * 128));
            if constexpr (D == 128) wg_mma_rs_n64_tb<8, DT>(o[0], pa[kk], wg_desc(vs + BN * 128 + kk * 16 * 128));
        }
        wg_commit();
        wg_wait<0>();
        wg_fence_regs(o[0]);
    }

    // O /= l, and the logsumexp of the row in natural log
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = row_sum[0][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv[r] = 1.f / l;
        const int t = m0 + wrow + (lane >> 2) + 8 * r;
        if (t < T && (lane & 3) == 0) lse[((long)b * Hq + h) * T + t] = (row_max[0][r] + __log2f(l)) * 0.69314718056f;
    }
    attn_store_rows<D>(out + (long)b * T * Hq * D + h * D, (long)Hq * D, m0 + wrow, T, o[0], inv[0], inv[1], lane);
}

template <int D, int BN>
static void wg_forward_launch(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int B,
                              int T, int Hq, int Hkv, cudaStream_t stream) {
    auto kernel = wg_forward_kernel<D, BN>;
    const int smem = (128 + 4 * BN) * D * (int)sizeof(bf16);
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    kernel<<<dim3(ceil_div(T, 128), B * Hq), 256, smem, stream>>>(out, lse, q, k, v, stride, T, Hq, Hkv,
                                                                    1.44269504089f / sqrtf((float)D));
    CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// Backward on wgmma: two deterministic kernels (the math is in the Backward comment above the
// delta kernel) with every product a warpgroup chain.
//
// dK, dV: one block of 2 warpgroups per (128 keys, b, KV head); warpgroup w owns keys 64w .. 64w+63
// and their dK, dV (64 x D fp32 each) in registers. Per query tile of BM rows (Q, dO, lse, delta
// double-buffered by cp.async), per warpgroup: S^T = K_w Q^T and dP^T = V_w dO^T (two SS chains,
// one commit), then P^T and dS^T in registers, then dV += P^T dO and dK += dS^T Q (RS chains, dO
// and Q read MN-major). Shared memory: K, V [128][D]; Q, dO [2][BM][D]; lse*log2e, delta [2][BM].
template <int D, int BM, int MINB>
__global__ void __launch_bounds__(256, MINB)
    wg_backward_dkdv_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const bf16* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta,
                            const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                            int stride, int dstride, int T, int Hq, int Hkv, float scale, float scale_log2) {
    constexpr int THREADS = 256, BN = 128, NT = BM / 8, DT = D / 8;
    static_assert(BM == 32 || BM == 64 || BM == 128, "query tile");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Ks = reinterpret_cast<bf16*>(attn_smem);
    bf16* Vs = Ks + BN * D;
    bf16* Qs = Vs + BN * D;       // [2][BM * D]
    bf16* dOs = Qs + 2 * BM * D;  // [2][BM * D]
    float* lse_s = reinterpret_cast<float*>(dOs + 2 * BM * D);  // [2][BM]
    float* dl_s = lse_s + 2 * BM;                              // [2][BM]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int G = Hq / Hkv;
    const int b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv;
    const int n0 = blockIdx.x * BN;  // KV tile 0, the one with the most work, launches first
    const int wrow = warp * 16;      // this warp's accumulator rows (keys) inside the tile
    const int qt_first = n0 / BM, per_head = (T + BM - 1) / BM - qt_first, iters = G * per_head;
    const long dstride_o = (long)Hq * D;

    wg_load_tile<D, BN, THREADS>(Ks, k + (long)b * T * stride + hk * D, stride, n0, T);
    wg_load_tile<D, BN, THREADS>(Vs, v + (long)b * T * stride + hk * D, stride, n0, T);
    auto load_query_tile = [&](int it, int buf) {
        const int hh = hk * G + it / per_head, m0 = (qt_first + it % per_head) * BM;
        wg_load_tile<D, BM, THREADS>(Qs + buf * BM * D, q + (long)b * T * stride + hh * D, stride, m0, T);
        wg_load_tile<D, BM, THREADS>(dOs + buf * BM * D, dout + (long)b * T * dstride_o + hh * D, dstride_o, m0, T);
        const float* lse_g = lse + ((long)b * Hq + hh) * T;
        const float* dl_g = delta + ((long)b * Hq + hh) * T;
        for (int i = threadIdx.x; i < BM; i += THREADS) {
            const int t = m0 + i;
            lse_s[buf * BM + i] = t < T ? lse_g[t] * 1.44269504089f : INFINITY;  // P = 0 past T
            dl_s[buf * BM + i] = t < T ? dl_g[t] : 0.f;
        }
    };
    load_query_tile(0, 0);
    attn_cp_async_commit();

    float dk_acc[DT][4], dv_acc[DT][4];
    attn_zero(dk_acc);
    attn_zero(dv_acc);
    const uint32_t ks = attn_smem_u32(Ks) + wg * 64 * 128, vs = attn_smem_u32(Vs) + wg * 64 * 128;

    for (int it = 0; it < iters; ++it) {
        const int buf = it & 1;
        if (it + 1 < iters) {
            load_query_tile(it + 1, buf ^ 1);
            attn_cp_async_commit();
            attn_cp_async_wait<1>();
        } else {
            attn_cp_async_wait<0>();
        }
        wg_fence_proxy_async();
        __syncthreads();
        const int m0 = (qt_first + it % per_head) * BM;
        if (m0 + BM - 1 >= n0 + wg * 64) {  // some query of the tile sees some key of this warpgroup
            const uint32_t qs = attn_smem_u32(Qs + buf * BM * D), dos = attn_smem_u32(dOs + buf * BM * D);
            const float* lse2 = lse_s + buf * BM;
            const float* dl = dl_s + buf * BM;
            const bool diag = m0 < n0 + wrow + 15;  // some query of the tile precedes some key of this warp

            float s[NT][4], dp[NT][4];  // S^T then P^T; dP^T then dS^T
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const uint32_t a_off = (kk / 4) * BN * 128 + (kk % 4) * 32, b_off = (kk / 4) * BM * 128 + (kk % 4) * 32;
                if (kk == 0) {
                    wg_mma_ss<BM, 0>(s, wg_desc(ks + a_off), wg_desc(qs + b_off));
                    wg_mma_ss<BM, 0>(dp, wg_desc(vs + a_off), wg_desc(dos + b_off));
                } else {
                    wg_mma_ss<BM, 1>(s, wg_desc(ks + a_off), wg_desc(qs + b_off));
                    wg_mma_ss<BM, 1>(dp, wg_desc(vs + a_off), wg_desc(dos + b_off));
                }
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(s);
            wg_fence_regs(dp);

            uint32_t pa[BM / 16][4], dsa[BM / 16][4];  // P^T and dS^T in bf16, A-operand layout
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int c = nt * 8 + 2 * (lane & 3);
                const float2 l2 = *reinterpret_cast<const float2*>(lse2 + c);
                const float2 d2 = *reinterpret_cast<const float2*>(dl + c);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float p = attn_exp2(fmaf(s[nt][i], scale_log2, -((i & 1) ? l2.y : l2.x)));
                    if (diag && m0 + c + (i & 1) < n0 + wrow + (lane >> 2) + 8 * (i >> 1)) p = 0.f;
                    s[nt][i] = p;
                    dp[nt][i] = p * (dp[nt][i] - ((i & 1) ? d2.y : d2.x));
                }
            }
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                pa[kk][0] = attn_pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                pa[kk][1] = attn_pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                pa[kk][2] = attn_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[kk][3] = attn_pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                dsa[kk][0] = attn_pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
                dsa[kk][1] = attn_pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
                dsa[kk][2] = attn_pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
                dsa[kk][3] = attn_pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
            }
            wg_fence_regs(dv_acc);
            wg_fence_regs(dk_acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) {
                wg_mma_rs_n64_tb<0, DT>(dv_acc, pa[kk], wg_desc(dos + kk * 16 * 128));
                wg_mma_rs_n64_tb<0, DT>(dk_acc, dsa[kk], wg_desc(qs + kk * 16 * 128));
                if constexpr (D == 128) {
                    wg_mma_rs_n64_tb<8, DT>(dv_acc, pa[kk], wg_desc(dos + BM * 128 + kk * 16 * 128));
                    wg_mma_rs_n64_tb<8, DT>(dk_acc, dsa[kk], wg_desc(qs + BM * 128 + kk * 16 * 128));
                }
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(dv_acc);
            wg_fence_regs(dk_acc);
        }
        __syncthreads();  // every warp is done with buffer buf before it is refilled
    }
    attn_store_rows<D>(dk + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dk_acc, scale, scale, lane);
    attn_store_rows<D>(dv + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dv_acc, 1.f, 1.f, lane);
}

// dQ: one block of 2 warpgroups per (128 queries, b, query head); warpgroup w owns queries
// 64w .. 64w+63 and their dQ (64 x D fp32) in registers. Per KV tile of BN keys (K, V double-buffered
// by cp.async), per warpgroup: S = Q_w K^T and dP = dO_w V^T (two SS chains), P and dS in registers,
// dQ += dS K (RS chain, K read MN-major). Shared memory: Q, dO [128][D]; K, V [2][BN][D].
template <int D, int BN, int MINB>
__global__ void __launch_bounds__(256, MINB)
    wg_backward_dq_kernel(bf16* __restrict__ dq, const bf16* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ delta, const bf16* __restrict__ q, const bf16* __restrict__ k,
                          const bf16* __restrict__ v, int stride, int dstride, int T, int Hq, int Hkv, float scale,
                          float scale_log2) {
    constexpr int THREADS = 256, BM = 128, NT = BN / 8, DT = D / 8;
    static_assert(BN == 32 || BN == 64 || BN == 128, "key tile");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(attn_smem);
    bf16* dOs = Qs + BM * D;
    bf16* Ks = dOs + BM * D;     // [2][BN * D]
    bf16* Vs = Ks + 2 * BN * D;  // [2][BN * D]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int q_tile = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int b = blockIdx.y / Hq, h = blockIdx.y % Hq, hk = h / (Hq / Hkv);
    const int m0 = q_tile * BM, wrow = warp * 16;
    const bf16* kg = k + (long)b * T * stride + hk * D;
    const bf16* vg = v + (long)b * T * stride + hk * D;
    const int n_tiles = (min(T, m0 + BM) + BN - 1) / BN;

    wg_load_tile<D, BM, THREADS>(Qs, q + (long)b * T * stride + h * D, stride, m0, T);
    wg_load_tile<D, BM, THREADS>(dOs, dout + (long)b * T * Hq * D + h * D, (long)Hq * D, m0, T);
    wg_load_tile<D, BN, THREADS>(Ks, kg, stride, 0, T);
    wg_load_tile<D, BN, THREADS>(Vs, vg, stride, 0, T);
    attn_cp_async_commit();

    float lse2[2], dl[2];  // of rows g and g+8 of this warp
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int t = m0 + wrow + (lane >> 2) + 8 * r;
        lse2[r] = t < T ? lse[((long)b * Hq + h) * T + t] * 1.44269504089f : INFINITY;
        dl[r] = t < T ? delta[((long)b * Hq + h) * T + t] : 0.f;
    }
    float dq_acc[DT][4];
    attn_zero(dq_acc);
    const uint32_t qs = attn_smem_u32(Qs) + wg * 64 * 128, dos = attn_smem_u32(dOs) + wg * 64 * 128;

    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1, n0 = j * BN;
        if (j + 1 < n_tiles) {
            wg_load_tile<D, BN, THREADS>(Ks + (buf ^ 1) * BN * D, kg, stride, n0 + BN, T);
            wg_load_tile<D, BN, THREADS>(Vs + (buf ^ 1) * BN * D, vg, stride, n0 + BN, T);
            attn_cp_async_commit();
            attn_cp_async_wait<1>();
        } else {
            attn_cp_async_wait<0>();
        }
        wg_fence_proxy_async();
        __syncthreads();
        if (n0 <= m0 + wg * 64 + 63) {  // some key of the tile is visible to some query of this warpgroup
            const uint32_t ks = attn_smem_u32(Ks + buf * BN * D), vs = attn_smem_u32(Vs + buf * BN * D);
            const bool diag = n0 + BN - 1 > m0 + wrow;

            float s[NT][4], dp[NT][4];  // S then P; dP then dS
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const uint32_t a_off = (kk / 4) * BM * 128 + (kk % 4) * 32, b_off = (kk / 4) * BN * 128 + (kk % 4) * 32;
                if (kk == 0) {
                    wg_mma_ss<BN, 0>(s, wg_desc(qs + a_off), wg_desc(ks + b_off));
                    wg_mma_ss<BN, 0>(dp, wg_desc(dos + a_off), wg_desc(vs + b_off));
                } else {
                    wg_mma_ss<BN, 1>(s, wg_desc(qs + a_off), wg_desc(ks + b_off));
                    wg_mma_ss<BN, 1>(dp, wg_desc(dos + a_off), wg_desc(vs + b_off));
                }
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(s);
            wg_fence_regs(dp);

            uint32_t dsa[BN / 16][4];  // dS in bf16, A-operand layout
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float p = attn_exp2(fmaf(s[nt][i], scale_log2, -lse2[i >> 1]));
                    if (diag && n0 + nt * 8 + 2 * (lane & 3) + (i & 1) > m0 + wrow + (lane >> 2) + 8 * (i >> 1)) p = 0.f;
                    dp[nt][i] = p * (dp[nt][i] - dl[i >> 1]);
                }
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                dsa[kk][0] = attn_pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
                dsa[kk][1] = attn_pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
                dsa[kk][2] = attn_pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
                dsa[kk][3] = attn_pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
            }
            wg_fence_regs(dq_acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                wg_mma_rs_n64_tb<0, DT>(dq_acc, dsa[kk], wg_desc(ks + kk * 16 * 128));
                if constexpr (D == 128) wg_mma_rs_n64_tb<8, DT>(dq_acc, dsa[kk], wg_desc(ks + BN * 128 + kk * 16 * 128));
            }
            wg_commit();
            wg_wait<0>();
            wg_fence_regs(dq_acc);
        }
        __syncthreads();  // every warp is done with buffer buf before it is refilled
    }
    attn_store_rows<D>(dq + (long)b * T * dstride + h * D, dstride, m0 + wrow, T, dq_acc, scale, scale, lane);
}

template <int D, int BM, int MINB = 1>
static void wg_backward_dkdv_launch(bf16* dk, bf16* dv, const bf16* dout, const float* lse, const float* delta,
                                    const bf16* q, const bf16* k, const bf16* v, int stride, int dstride, int B, int T,
                                    int Hq, int Hkv, cudaStream_t stream) {
    auto kernel = wg_backward_dkdv_kernel<D, BM, MINB>;
    const int smem = (2 * 128 + 4 * BM) * D * (int)sizeof(bf16) + 4 * BM * (int)sizeof(float);
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const float scale = 1.f / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, 128), B * Hkv), 256, smem, stream>>>(dk, dv, dout, lse, delta, q, k, v, stride, dstride,
                                                                     T, Hq, Hkv, scale, scale * 1.44269504089f);
    CUDA_CHECK(cudaGetLastError());
}

template <int D, int BN, int MINB = 1>
static void wg_backward_dq_launch(bf16* dq, const bf16* dout, const float* lse, const float* delta, const bf16* q,
                                  const bf16* k, const bf16* v, int stride, int dstride, int B, int T, int Hq, int Hkv,
                                  cudaStream_t stream) {
    auto kernel = wg_backward_dq_kernel<D, BN, MINB>;
    const int smem = (2 * 128 + 4 * BN) * D * (int)sizeof(bf16);
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const float scale = 1.f / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, 128), B * Hq), 256, smem, stream>>>(dq, dout, lse, delta, q, k, v, stride, dstride, T, Hq,
                                                                    Hkv, scale, scale * 1.44269504089f);
    CUDA_CHECK(cudaGetLastError());
}

// The entry points. Tiles, the best of those timed by `./dev/attention tune` on an H100 (doc/attention.md):
//   D = 128: forward 128 queries x 128 keys; dK/dV 128 keys x 64 queries; dQ 128 queries x 128 keys.
//   D = 64:  forward 128 x 64;               dK/dV 128 x 128;            dQ 128 x 64, 2 blocks/SM.
static void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                                    int qkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {out, q, k, v};
    attn_check_args("attention_forward", ptrs, 4, qkv_stride, B, T, Hq, Hkv, D);
    if (D == 64) wg_forward_launch<64, 64>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
    else wg_forward_launch<128, 128>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
}

static void attention_backward(bf16* dq, bf16* dk, bf16* dv, float* delta, const bf16* dout, const bf16* out,
                                     const float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                                     int dqkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {dq, dk, dv, dout, out, q, k, v};
    attn_check_args("attention_backward", ptrs, 8, qkv_stride, B, T, Hq, Hkv, D);
    if (dqkv_stride % 8 != 0 || dqkv_stride < Hq * D) {
        fprintf(stderr, "attention_backward: dqkv_stride %d must be a multiple of 8 and at least Hq*D = %d\n",
                dqkv_stride, Hq * D);
        exit(1);
    }
    attn_delta_launch(delta, dout, out, B, T, Hq, D, stream);
    if (D == 64) {
        wg_backward_dkdv_launch<64, 128, 1>(dk, dv, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq, Hkv,
                                           stream);
        wg_backward_dq_launch<64, 64, 2>(dq, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq, Hkv, stream);
    } else {
        wg_backward_dkdv_launch<128, 64, 1>(dk, dv, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq, Hkv,
                                            stream);
        wg_backward_dq_launch<128, 128, 1>(dq, dout, lse, delta, q, k, v, qkv_stride, dqkv_stride, B, T, Hq, Hkv,
                                           stream);
    }
}


// ----------------------------------------------------------------------------------------------
// SwiGLU: a row of gate_up holds [gate (F) | up (F)]; out = silu(gate) * up, silu(g) = g sigmoid(g).
// Backward: d_gate = d_out * up * sigmoid(g) * (1 + g (1 - sigmoid(g))),  d_up = d_out * silu(g).

__global__ void swiglu_forward_kernel(bf16* out, const bf16* gate_up, int N, int F) {
    size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * 8;
    if (i >= (size_t)N * F) return;
    size_t n = i / F, f = i % F;
    bf16x8 g = load8(gate_up + n * 2 * F + f), u = load8(gate_up + n * 2 * F + F + f), y;
    for (int k = 0; k < 8; k++) {
        float gk = __bfloat162float(g.v[k]);
        y.v[k] = __float2bfloat16(gk / (1.0f + __expf(-gk)) * __bfloat162float(u.v[k]));
    }
    store8(out + i, y);
}

__global__ void swiglu_backward_kernel(bf16* d_gate_up, const bf16* d_out, const bf16* gate_up, int N, int F) {
    size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * 8;
    if (i >= (size_t)N * F) return;
    size_t n = i / F, f = i % F;
    bf16x8 g = load8(gate_up + n * 2 * F + f), u = load8(gate_up + n * 2 * F + F + f), dy = load8(d_out + i);
    bf16x8 dg, du;
    for (int k = 0; k < 8; k++) {
        float gk = __bfloat162float(g.v[k]), uk = __bfloat162float(u.v[k]), dyk = __bfloat162float(dy.v[k]);
        float sig = 1.0f / (1.0f + __expf(-gk));
        dg.v[k] = __float2bfloat16(dyk * uk * sig * (1.0f + gk * (1.0f - sig)));
        du.v[k] = __float2bfloat16(dyk * gk * sig);
    }
    store8(d_gate_up + n * 2 * F + f, dg);
    store8(d_gate_up + n * 2 * F + F + f, du);
}

static void swiglu_forward(bf16* out, const bf16* gate_up, int N, int F, cudaStream_t s) {
    swiglu_forward_kernel<<<ceil_div((size_t)N * F / 8, 256), 256, 0, s>>>(out, gate_up, N, F);
    LAUNCH_CHECK();
}

static void swiglu_backward(bf16* d_gate_up, const bf16* d_out, const bf16* gate_up, int N, int F, cudaStream_t s) {
    swiglu_backward_kernel<<<ceil_div((size_t)N * F / 8, 256), 256, 0, s>>>(d_gate_up, d_out, gate_up, N, F);
    LAUNCH_CHECK();
}

// ----------------------------------------------------------------------------------------------
// Cross-entropy over one chunk of bf16 logits, fused with its gradient, in place.
// For a row with logits z and target y: loss = logsumexp(z) - z[y], and
//   dL/dz = (softmax(z) - onehot(y)) * d_loss,
// where d_loss = 1 / (number of tokens in the optimizer step) makes the step's loss a mean.
// One block per row: the first pass finds the max and the sum of exponentials online (each thread
// over its own 8-wide slices, then combined across the block), the second overwrites the logits
// with their gradient. Per-row losses go to `losses` for a deterministic sum later.

__global__ void cross_entropy_kernel(bf16* logits, float* losses, const int* targets, int V, float d_loss) {
    bf16* z = logits + (size_t)blockIdx.x * V;
    const int target = targets[blockIdx.x];
    const float z_target = __bfloat162float(z[target]);  // read before anyone overwrites it
    float m = -FLT_MAX, sum = 0.0f;
    for (int i = threadIdx.x * 8; i < V; i += blockDim.x * 8) {
        bf16x8 v = load8(z + i);
        for (int k = 0; k < 8; k++) {
            float x = __bfloat162float(v.v[k]);
            if (x > m) {
                sum = sum * __expf(m - x) + 1.0f;
                m = x;
            } else {
                sum += __expf(x - m);
            }
        }
    }
    // Combine (m, sum) across the block: rescale every thread's sum to the block's max.
    __shared__ float block_max;
    float mx = m;
    for (int offset = 16; offset > 0; offset >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
    __shared__ float warp_max[32];
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float b = -FLT_MAX;
        for (int w = 0; w < blockDim.x / 32; w++) b = fmaxf(b, warp_max[w]);
        block_max = b;
    }
    __syncthreads();
    float total = block_sum(sum * __expf(m - block_max));
    float lse = block_max + logf(total);
    if (threadIdx.x == 0) losses[blockIdx.x] = lse - z_target;
    for (int i = threadIdx.x * 8; i < V; i += blockDim.x * 8) {
        bf16x8 v = load8(z + i);
        for (int k = 0; k < 8; k++) {
            float p = __expf(__bfloat162float(v.v[k]) - lse);
            v.v[k] = __float2bfloat16((p - (i + k == target ? 1.0f : 0.0f)) * d_loss);
        }
        store8(z + i, v);
    }
}

static void cross_entropy(bf16* logits, float* losses, const int* targets, int rows, int V, float d_loss,
                          cudaStream_t s) {
    cross_entropy_kernel<<<rows, 512, 0, s>>>(logits, losses, targets, V, d_loss);
    LAUNCH_CHECK();
}

// ----------------------------------------------------------------------------------------------
// AdamW, fused with gradient clipping and the bf16 copy of the weights.
// With g = grad * clip_scale, clip_scale = min(1, max_norm / ||grad||) read from the device (so the
// host never waits for the norm):
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + lr * wd * p     (decoupled decay)
// Weight decay applies to elements [0, decay_end) of the flat buffer: train_gpt lays out the
// matrices first and the norm weights after them, so one boundary says what decays.

__global__ void adamw_kernel(float* master, bf16* params, const float* grads, float* m, float* v, size_t begin,
                             size_t end, size_t decay_end, float lr, float beta1, float beta2, float eps,
                             float weight_decay, float bias_corr1, float bias_corr2, const float* grad_norm_sq,
                             float max_norm) {
    float norm = sqrtf(*grad_norm_sq);
    float clip_scale = (max_norm > 0.0f && norm > max_norm) ? max_norm / norm : 1.0f;
    for (size_t i = begin + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < end;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = grads[i] * clip_scale;
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float p = master[i];
        float wd = i < decay_end ? weight_decay : 0.0f;
        p -= lr * ((mi / bias_corr1) / (sqrtf(vi / bias_corr2) + eps) + wd * p);
        master[i] = p;
        params[i] = __float2bfloat16(p);
    }
}

// ----------------------------------------------------------------------------------------------
// Matmuls through cuBLASLt.
//
// Every matmul of the model has one of three row-major forms, for a linear layer y = x W^T with
// x [N, I], W [O, I] (PyTorch's layout: one row per output feature) and y [N, O]:
//   forward          y  = x W^T (+ residual)           bf16 out
//   backward input   dx = dy W                         bf16 out
//   backward weight  dW += dy^T x                      fp32 out, accumulated (beta = 1)
// cuBLASLt is column-major, and a row-major matrix is its column-major transpose, so each form
// becomes one column-major call (the comments give the mapping). matmul() is the one place that
// talks to cuBLASLt; it caches the heuristic's choice of algorithm per shape.

typedef struct {
    int m, n, k;
    bool trans_a, trans_b, d_fp32, has_c;
    cublasLtMatmulAlgo_t algo;
} MatmulPlan;

static cublasLtHandle_t g_cublaslt;
static void* g_cublaslt_workspace;
static const size_t CUBLASLT_WORKSPACE_BYTES = 32u << 20;
static MatmulPlan g_plans[128];
static int g_n_plans;

static inline void cublas_check_(cublasStatus_t status, const char* what, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "cuBLASLt error at %s:%d: %s: %s\n", file, line, what, cublasLtGetStatusString(status));
        exit(1);
    }
}
#define CUBLAS_CHECK(call) cublas_check_((call), #call, __FILE__, __LINE__)

static void matmul_init(void) {
    CUBLAS_CHECK(cublasLtCreate(&g_cublaslt));
    CUDA_CHECK(cudaMalloc(&g_cublaslt_workspace, CUBLASLT_WORKSPACE_BYTES));
}

static void matmul_free(void) {
    CUBLAS_CHECK(cublasLtDestroy(g_cublaslt));
    CUDA_CHECK(cudaFree(g_cublaslt_workspace));
    g_n_plans = 0;
}

// Column-major D[m, n] = alpha * op(A)[m, k] op(B)[k, n] + beta * C, with bf16 A and B, fp32
// accumulation, and D (and C) either bf16 or fp32. All pointers are 256-byte aligned and every
// leading dimension is the stored matrix's row count, i.e. the matrices are dense.
static void matmul(void* d, const void* c, const bf16* a, const bf16* b, int m, int n, int k, bool trans_a,
                   bool trans_b, bool d_fp32, float beta, cudaStream_t stream) {
    cudaDataType_t d_type = d_fp32 ? CUDA_R_32F : CUDA_R_16BF;
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t layout_a, layout_b, layout_c;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_a, CUDA_R_16BF, trans_a ? k : m, trans_a ? m : k, trans_a ? k : m));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_b, CUDA_R_16BF, trans_b ? n : k, trans_b ? k : n, trans_b ? n : k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_c, d_type, m, n, m));

    bool has_c = beta != 0.0f;
    MatmulPlan* plan = NULL;
    for (int i = 0; i < g_n_plans; i++) {
        MatmulPlan* p = &g_plans[i];
        if (p->m == m && p->n == n && p->k == k && p->trans_a == trans_a && p->trans_b == trans_b &&
            p->d_fp32 == d_fp32 && p->has_c == has_c)
            plan = p;
    }
    if (!plan) {
        cublasLtMatmulPreference_t pref;
        CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &CUBLASLT_WORKSPACE_BYTES, sizeof(size_t)));
        cublasLtMatmulHeuristicResult_t result;
        int n_results = 0;
        CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(g_cublaslt, desc, layout_a, layout_b, layout_c, layout_c, pref, 1,
                                                    &result, &n_results));
        CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
        if (n_results == 0) {
            fprintf(stderr, "cuBLASLt has no algorithm for a %dx%dx%d matmul (trans %d%d, %s out)\n", m, n, k,
                    trans_a, trans_b, d_fp32 ? "fp32" : "bf16");
            exit(1);
        }
        if (g_n_plans == (int)(sizeof(g_plans) / sizeof(g_plans[0]))) g_n_plans = 0;  // full: start over
        plan = &g_plans[g_n_plans++];
        *plan = (MatmulPlan){m, n, k, trans_a, trans_b, d_fp32, has_c, result.algo};
    }
    const float alpha = 1.0f;
    CUBLAS_CHECK(cublasLtMatmul(g_cublaslt, desc, &alpha, a, layout_a, b, layout_b, &beta, has_c ? c : d, layout_c,
                                d, layout_c, &plan->algo, g_cublaslt_workspace, CUBLASLT_WORKSPACE_BYTES, stream));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(layout_a));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(layout_b));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(layout_c));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(desc));
}

// y[N, O] = x[N, I] W[O, I]^T (+ residual[N, O] when residual is not NULL).
// Column-major: D[m=O, n=N] = op_T(W, stored [I, O]) x^T (stored [I, N]), D stored [O, N] = y.
static void linear_forward(bf16* y, const bf16* x, const bf16* W, const bf16* residual, int N, int I, int O,
                           cudaStream_t s) {
    matmul(y, residual, W, x, O, N, I, true, false, false, residual ? 1.0f : 0.0f, s);
}

// dx[N, I] = dy[N, O] W[O, I].   Column-major: D[m=I, n=N] = W(stored [I, O]) dy^T(stored [O, N]).
static void linear_backward_input(bf16* dx, const bf16* dy, const bf16* W, int N, int I, int O, cudaStream_t s) {
    matmul(dx, NULL, W, dy, I, N, O, false, false, false, 0.0f, s);
}

// dW[O, I] += dy[N, O]^T x[N, I].   Column-major: D[m=I, n=O] = x^T(stored [I, N]) op_T(dy stored [O, N]).
static void linear_backward_weight(float* dW, const bf16* dy, const bf16* x, int N, int I, int O, cudaStream_t s) {
    matmul(dW, dW, x, dy, I, O, N, false, true, true, 1.0f, s);
}

#endif
