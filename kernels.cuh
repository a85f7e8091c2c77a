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
#include <cuda.h>          // CUtensorMap and its enums (types only: no -lcuda)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled, fetched through the runtime
#include "lib/cuda_check.h"

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
// The number of buckets varies from batch to batch, so it is read from the device (*n_buckets) and
// the grid is sized for the most a batch can have, min(N, V): the launch is the same every step,
// as a CUDA graph needs, and the blocks past the last bucket return at once.
__global__ void embedding_backward_kernel(float* d_embed, const bf16* dx, const int* bucket_start,
                                          const int* bucket_pos, const int* bucket_token, const int* n_buckets,
                                          int C) {
    int u = blockIdx.x;
    int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (u >= *n_buckets || c >= C) return;
    float sum[8] = {0};
    for (int j = bucket_start[u]; j < bucket_start[u + 1]; j++) {
        bf16x8 g = load8(dx + (size_t)bucket_pos[j] * C + c);
        for (int k = 0; k < 8; k++) sum[k] += __bfloat162float(g.v[k]);
    }
    float* row = d_embed + (size_t)bucket_token[u] * C + c;
    for (int k = 0; k < 8; k++) row[k] += sum[k];
}

static void embedding_backward(float* d_embed, const bf16* dx, const int* bucket_start, const int* bucket_pos,
                               const int* bucket_token, const int* n_buckets, int N, int V, int C, cudaStream_t s) {
    dim3 grid(N < V ? N : V, ceil_div(C, 8 * 128));
    embedding_backward_kernel<<<grid, 128, 0, s>>>(d_embed, dx, bucket_start, bucket_pos, bucket_token, n_buckets, C);
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
// These are version 4 of the dev/ ladder (dev/attention.cu; doc/attention.md has the measurements
// and the versions that lost): FlashAttention-3's structure on Hopper (sm_90a). A block is a
// producer warpgroup, which only moves data (TMA loads on an mbarrier ring; in the backward also the
// bulk reduce of dQ), and two or three consumer warpgroups, which only compute: every product is a
// warpgroup matrix instruction chain (wgmma), each consumer owning 64 rows of every accumulator.
// Products whose operands both sit in shared memory (S = Q K^T, dP = dO V^T, their transposes, and
// dQ = dS K) read the tiles directly; products with P or dS on the left take them from registers
// (the accumulator layout is the A-operand layout). The online softmax runs in base 2.
//   forward (ws_forward_kernel): one block per SM taking query tiles from a work queue; per tile,
//     the KV tiles from the diagonal down; the softmax of tile i overlaps S = Q K^T of tile i+1 on
//     the tensor cores, and the next tile's loads overlap this one's epilogue.
//   backward (ws_backward_kernel): one pass per KV tile over the query tiles at or below the
//     diagonal, 5 products per tile pair; dK and dV stay in registers, dQ partial sums are added
//     into fp32 accumulators in global memory in a fixed order (deterministic) or, on request, in
//     any order.
//
// Layout: q, k and v are token-major with a common row stride, so they may point into one packed
// qkv buffer: element (b, t, h, d) of q is q[(b*T + t)*qkv_stride + h*D + d] (h < Hq; k and v alike
// with h < Hkv). KV head j serves query heads j*G .. j*G+G-1, G = Hq/Hkv, indexed in place, never
// copied. out is [B, T, Hq, D]; lse is [B, Hq, T], the natural-log logsumexp of the scaled scores.
// The backward writes (=) dq, dk, dv; dk and dv sum over the G query heads of their KV head inside
// one thread block in a fixed order. D is 64 or 128 (a template parameter); any T >= 1.
//
// Shared memory is laid out as wgmma's 128-byte swizzle expects: a [R][D] tile is D/64 panels of
// [R][64] (128-byte rows); 16-byte chunk c of row r of a panel sits at chunk c ^ (r & 7), each panel
// 1024-byte aligned. A K-major descriptor advances 32 bytes per 16-element k-step inside a panel; an
// MN-major one advances 16 rows (2048 bytes) per step. TMA writes tiles in exactly this layout.
//
// Measured on an H100 SXM (B*T = 16K tokens, causal FLOPs counted once), D = 128, T = 512 / 1024 /
// 2048 / 4096: forward 269 / 387 / 475 / 533 TFLOP/s, backward 174 / 265 / 339 / 405.
// First the helpers (PTX wrappers, the softmax step, row stores, delta), which the versions in dev/
// share, then the kernels and their launchers.

// ----------------------------------------------------------------------------------------------
// PTX wrappers

static __device__ __forceinline__ uint32_t attn_smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
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

// The A operand of a register-sourced wgmma (or mma.m16n8k16) from a warp's fp32 accumulator tile
// x (16 rows x 8*NT columns): k-step kk takes the 8-column blocks 2kk and 2kk+1, rounded to bf16.
template <int NT>
static __device__ __forceinline__ void attn_pack_a(uint32_t (&a)[NT / 2][4], const float (&x)[NT][4]) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        a[kk][0] = attn_pack_bf16(x[2 * kk][0], x[2 * kk][1]);
        a[kk][1] = attn_pack_bf16(x[2 * kk][2], x[2 * kk][3]);
        a[kk][2] = attn_pack_bf16(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        a[kk][3] = attn_pack_bf16(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
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

// Online softmax of one tile of scores (one warp's 16 rows, NT 8-column blocks), in place: s becomes
// P = 2^(s*scale_log2 - m_new), unnormalized; the running row sums are rescaled and extended, and
// alpha = 2^(m_old - m_new) is returned for O, which the caller rescales once the previous tile's
// P V has left the tensor cores (ws_forward_kernel), or at once (dev/'s versions 2 and 3).
template <int NT>
static __device__ __forceinline__ void attn_softmax_tile(float (&s)[NT][4], float (&row_max)[2], float (&row_sum)[2],
                                                  float (&alpha)[2], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(row_max[r], mx * scale_log2);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with no visible key yet
        alpha[r] = attn_exp2(row_max[r] - m_use);
        row_max[r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = attn_exp2(fmaf(s[nt][2 * r + e], scale_log2, -m_use));
                s[nt][2 * r + e] = p;
                sum += p;
            }
        row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
}

// O *= alpha row-wise (rows g and g+8 of the warp's accumulator tile).
template <int DT>
static __device__ __forceinline__ void attn_rescale(float (&o)[DT][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        o[dt][0] *= alpha[0];
        o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1];
        o[dt][3] *= alpha[1];
    }
}

// ----------------------------------------------------------------------------------------------
// Backward. With s = scale * q.k, P = exp(s - lse), O = P V and dO given:
//   dV = P^T dO,   dP = dO V^T,   dS = P o (dP - delta),   delta_i = sum_d dO_id O_id = rowsum(P o dP),
//   dQ = scale * dS K,   dK = scale * dS^T Q   (o: elementwise product).
// Computed with every (KV tile, query tile) pair visited once: dK, dV summed in registers over the
// query tiles, dQ summed over the KV tiles in global memory (ws_backward_kernel).

// The backward's per-row inputs, one warp per (b, h, t) row of a [B, Hq, Tp] layout (Tp >= T pads
// each head's rows): delta[(b*Hq + h)*Tp + t] = sum_d dout[b, t, h, d] * out[b, t, h, d], and, when
// lse2 is given, lse2[...] = lse[b, h, t] * log2 e, the logsumexp in the kernels' base 2. Pad rows
// (t >= T) get delta 0 and lse2 +inf, so that P = exp2(s - lse2) is 0 there.
__global__ void attn_delta_kernel(float* __restrict__ delta, float* __restrict__ lse2, const float* __restrict__ lse,
                                 const bf16* __restrict__ dout, const bf16* __restrict__ out, int T, int Tp, int Hq,
                                 int D, long rows) {
    const long row = (long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const long bh = row / Tp;
    const int t = (int)(row % Tp);
    float acc = 0.f;
    if (t < T) {
        const long off = (((bh / Hq) * T + t) * Hq + bh % Hq) * D;
        const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(dout + off);
        const __nv_bfloat162* c = reinterpret_cast<const __nv_bfloat162*>(out + off);
        for (int i = lane; i < D / 2; i += 32) {
            const float2 x = __bfloat1622float2(a[i]), y = __bfloat1622float2(c[i]);
            acc += x.x * y.x + x.y * y.y;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    }
    if (lane == 0) {
        delta[row] = acc;
        if (lse2) lse2[row] = t < T ? lse[bh * T + t] * 1.44269504089f : INFINITY;
    }
}


// The backward's elementwise step on a warp's transposed tile, in place: rows are keys key0 + g and
// key0 + g + 8, columns queries q0 + 8nt + 2i (+1) (lane = 4g + i). On entry s = S^T and dp = dP^T;
// on return s = P^T = 2^(s * scale_log2 - lse2[q]) (0 where the query precedes the key, checked
// only when diag) and dp = dS^T = P^T o (dP^T - delta[q]). lse2 (lse * log2 e; +inf past T, so
// P = 0 there) and dl (delta) hold the tile's per-query values in shared memory.
template <int NT>
static __device__ __forceinline__ void attn_bwd_p_ds_t(float (&s)[NT][4], float (&dp)[NT][4], const float* lse2,
                                                      const float* dl, bool diag, int q0, int key0, int lane,
                                                      float scale_log2) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int c = nt * 8 + 2 * (lane & 3);
        const float2 l2 = *reinterpret_cast<const float2*>(lse2 + c);
        const float2 d2 = *reinterpret_cast<const float2*>(dl + c);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float p = attn_exp2(fmaf(s[nt][i], scale_log2, -((i & 1) ? l2.y : l2.x)));
            if (diag && q0 + c + (i & 1) < key0 + (lane >> 2) + 8 * (i >> 1)) p = 0.f;
            s[nt][i] = p;
            dp[nt][i] = p * (dp[nt][i] - ((i & 1) ? d2.y : d2.x));
        }
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

// delta [B, Hq, T] (lse2 null), or delta and lse2 [B, Hq, Tp] with pad rows (attn_delta_kernel).
static void attn_delta_launch(float* delta, float* lse2, const float* lse, const bf16* dout, const bf16* out, int B,
                             int T, int Tp, int Hq, int D, cudaStream_t stream) {
    const long rows = (long)B * Hq * Tp;
    attn_delta_kernel<<<ceil_div(rows, 8), 256, 0, stream>>>(delta, lse2, lse, dout, out, T, Tp, Hq, D, rows);
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
template <int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss_n32(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D), "n"(TA), "n"(TB));
}

template <int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss_n64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D), "n"(TA), "n"(TB));
}

template <int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
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
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D), "n"(TA), "n"(TB));
}

// The SS product for N in {32, 64, 128}. TA = 1 reads A MN-major (a [16 k][64 m] panel, each k row
// 64 contiguous m), TB = 1 reads B MN-major; either then advances 16 rows (2048 bytes) per k-step.
template <int N, int SCALE_D, int TA = 0, int TB = 0>
static __device__ __forceinline__ void wg_mma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (N == 32) wg_mma_ss_n32<SCALE_D, TA, TB>(d, desc_a, desc_b);
    else if constexpr (N == 64) wg_mma_ss_n64<SCALE_D, TA, TB>(d, desc_a, desc_b);
    else wg_mma_ss_n128<SCALE_D, TA, TB>(d, desc_a, desc_b);
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
// mbarrier, TMA and bulk-copy wrappers (PTX ISA: "mbarrier", "cp.async.bulk", "cp.async.bulk.tensor",
// "cp.reduce.async.bulk"), named barriers, and the acquire / release pair of the backward's dQ order.

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
static __device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
static __device__ __forceinline__ int load_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void add_release_gpu(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Orders this thread's generic-proxy global accesses with its bulk (async-proxy) ones.
static __device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ----------------------------------------------------------------------------------------------
// The backward's paired wgmma chains, shared by every backward kernel on wgmma.

// s = A1 B1^T and dp = A2 B2^T over a k dimension of D (two SS chains, one commit, waited): A1, A2
// are 64-row slices of [RA][D] tiles, B1, B2 [N][D] tiles, all K-major in 64-column panels (RA and
// N rows apart). The dK/dV side computes S^T = K Q^T, dP^T = V dO^T; the dQ side S = Q K^T, dP = dO V^T.
template <int D, int RA, int N>
static __device__ __forceinline__ void wg_ss_pair(float (&s)[N / 8][4], float (&dp)[N / 8][4], uint32_t a1,
                                                  uint32_t a2, uint32_t b1, uint32_t b2) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t a_off = (kk / 4) * RA * 128 + (kk % 4) * 32, b_off = (kk / 4) * N * 128 + (kk % 4) * 32;
        if (kk == 0) {
            wg_mma_ss<N, 0>(s, wg_desc(a1 + a_off), wg_desc(b1 + b_off));
            wg_mma_ss<N, 0>(dp, wg_desc(a2 + a_off), wg_desc(b2 + b_off));
        } else {
            wg_mma_ss<N, 1>(s, wg_desc(a1 + a_off), wg_desc(b1 + b_off));
            wg_mma_ss<N, 1>(dp, wg_desc(a2 + a_off), wg_desc(b2 + b_off));
        }
    }
    wg_commit();
    wg_wait<0>();
    wg_fence_regs(s);
    wg_fence_regs(dp);
}

// acc (+)= A B for a warpgroup's 64 rows: A (64 x K, bf16) from registers in attn_pack_a's layout, B
// a [K][D] tile in 64-column panels (K rows apart) read MN-major. Committed, not waited for. O += P V,
// dV += P^T dO, dK += dS^T Q and version 3's dQ += dS K are all this chain.
template <int D, int K>
static __device__ __forceinline__ void wg_rs_chain(float (&acc)[D / 8][4], const uint32_t (&a)[K / 16][4], uint32_t b) {
    wg_fence_regs(acc);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        wg_mma_rs_n64_tb<0, D / 8>(acc, a[kk], wg_desc(b + kk * 16 * 128));
        if constexpr (D == 128) wg_mma_rs_n64_tb<8, D / 8>(acc, a[kk], wg_desc(b + K * 128 + kk * 16 * 128));
    }
    wg_commit();
}

// ----------------------------------------------------------------------------------------------
// TMA tensor maps, encoded on the host at each launch.

// cuTensorMapEncodeTiled from the driver, through the runtime (so the program needs no -lcuda).
static PFN_cuTensorMapEncodeTiled_v12000 tma_encode_fn() {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (!fn) {
        cudaDriverEntryPointQueryResult qres;
        void* p = nullptr;
        CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &qres));
        if (qres != cudaDriverEntryPointSuccess || !p) {
            fprintf(stderr, "attention: the driver has no cuTensorMapEncodeTiled (query result %d); "
                            "TMA needs a CUDA 12+ driver\n", (int)qres);
            exit(1);
        }
        fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
    return fn;
}

// A 3-D map {cols, T, B} over base (row stride `stride` elements, batch stride T*stride), box
// {64, rows, 1}, 128-byte swizzle, out-of-bounds elements read as zero.
static CUtensorMap tma_tensor_map(const bf16* base, int cols, int stride, int T, int B, int rows) {
    CUtensorMap m;
    const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[2] = {(cuuint64_t)stride * sizeof(bf16), (cuuint64_t)T * stride * sizeof(bf16)};
    const cuuint32_t box[3] = {64, (cuuint32_t)rows, 1}, estr[3] = {1, 1, 1};
    const CUresult r = tma_encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16*>(base), dims, strides,
                                      box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "attention: cuTensorMapEncodeTiled failed (%d) for cols %d, stride %d, T %d, B %d, "
                        "box rows %d\n", (int)r, cols, stride, T, B, rows);
        exit(1);
    }
    return m;
}

// ----------------------------------------------------------------------------------------------
// The forward's work queue: a ticket counter per kernel instantiation. Item i < gridDim.x is block
// i's first; the others go to whichever block asks next. Every block asks until it draws an item
// past the end, so exactly `items` tickets are drawn in a launch, and the block that draws the last
// one resets the counter for the next launch (launches on one stream never overlap).
template <int D, int BN, int NC>
__device__ int ws_ticket;

template <int D, int BN, int NC>
static __device__ __forceinline__ int ws_next_item(int items, int grid) {
    const int ticket = atomicAdd(&ws_ticket<D, BN, NC>, 1);
    if (ticket == items - 1) atomicExch(&ws_ticket<D, BN, NC>, 0);
    return grid + ticket;
}

// ----------------------------------------------------------------------------------------------
// Forward (version 4). Work items are (BM = 64*NC query rows, b, query head) tiles; a persistent
// grid of one block per SM takes them from a queue (ws_next_item), longest first within groups of
// heads whose K and V fit in L2. A block is NC+1 warpgroups: NC = 2 (384 threads, 128 x 128 tiles),
// or 3 at D = 64 and T > 1024 (512 threads, 192 queries x 128 keys):
//   warpgroup 0, the producer: shrinks to 24 registers (32 at NC = 3); one thread claims items and
//     issues every TMA load: per item Q (once the consumers are done with the last one), then for
//     each KV tile of BN keys (from the diagonal down) K and V into a 2-stage ring, each stage
//     guarded by a full barrier (TMA bytes) and an empty barrier (one arrive per consumer warp
//     once its wgmma reads are done). The ring runs on across items, so the next item's loads
//     overlap this one's last products and epilogue.
//   warpgroups 1 .. NC, the consumers: grow to 240 registers (160 at NC = 3); consumer c owns
//     query rows m0 + 64c .. +63 (warp x of it rows 16x .. 16x+15, the accumulator rows). A tile
//     wholly above a consumer's diagonal is still computed, fully masked (-inf rows give P = 0),
//     so that every consumer walks the same pipeline.
// Per consumer and tile i (m_i, l_i running max and sum, base 2):
//   S_i = Q K_i^T        issued before the softmax of the previous tile is finished with O:
//   O  += P_{i-1} V_{i-1} issued right after it; while both run on the tensor cores the warps
//                        wait only for S_i, then mask it (diagonal tiles) and compute
//   P_i = 2^(S_i*scale - m_i), l_i, alpha_i = 2^(m_{i-1} - m_i); then wait for P_{i-1} V_{i-1},
//   O *= alpha_i, and pack P_i to bf16 for the next iteration's O += P_i V_i.
// End of an item: O /= l, lse = (m + log2 l) ln 2, stored straight from registers.
// Shared memory: Q [BM][D], K [2][BN][D], V [2][BN][D] bf16 in 64-column panels, the item slot, then
// 10 mbarriers (D = 128: 160 KiB; D = 64: 80 or 88 KiB). One block per SM (the register file is full).
template <int D, int BN, int NC>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
    ws_forward_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_v, bf16* __restrict__ out, float* __restrict__ lse,
                      int B, int T, int Hq, int Hkv, int group_heads, float scale_log2) {
    constexpr int BM = 64 * NC, NT = BN / 8, DT = D / 8, PANELS = D / 64;
    // Register budget: the block starts with the launch-bounds cap (168 registers a thread for 384
    // threads, 128 for 512) and the whole 64K file; the producer hands back all but PROD_REGS, and
    // the consumers take what that frees: 128*24 + 256*240 = 128*32 + 384*160 = 65536 - 1024 or 65536.
    constexpr int PROD_REGS = NC == 2 ? 24 : 32, CONS_REGS = NC == 2 ? 240 : 160;
    static_assert((BN == 64 || BN == 128) && (D == 64 || D == 128) && (NC == 2 || NC == 3), "tile sizes");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Qs = reinterpret_cast<bf16*>(attn_smem);  // [BM * D]
    bf16* Ks = Qs + BM * D;      // [2][BN * D]
    bf16* Vs = Ks + 2 * BN * D;  // [2][BN * D]
    int* item_slot = reinterpret_cast<int*>(Vs + 2 * BN * D);  // the item whose Q is loaded
    const uint32_t bars = attn_smem_u32(item_slot + 4);
    // barrier addresses: q_full, q_empty, k_full[2], v_full[2], k_empty[2], v_empty[2]
    const uint32_t q_full = bars, q_empty = bars + 8, k_full = bars + 16, v_full = bars + 32, k_empty = bars + 48,
                   v_empty = bars + 64;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int BH = B * Hq, q_tiles = (T + BM - 1) / BM, items = q_tiles * BH;
    // Work items: (query tile, b*Hq + h) pairs, ordered in groups of group_heads heads (chosen by the
    // launcher so that a group's K and V stay in L2 while its tiles are in flight); inside a group the
    // longest rows (the last query tiles) come first. Block i starts with item i, then takes the next
    // unclaimed one from a ticket counter (ws_next_item), so blocks that drew short items take more.
    struct Item { int b, h, m0, n_tiles; };
    auto item_of = [&](int w) {
        Item it;
        const int g = w / (q_tiles * group_heads), wg_ = w % (q_tiles * group_heads);
        const int heads = min(group_heads, BH - g * group_heads), bh = g * group_heads + wg_ % heads;
        it.b = bh / Hq;
        it.h = bh % Hq;
        it.m0 = (q_tiles - 1 - wg_ / heads) * BM;
        it.n_tiles = (min(T, it.m0 + BM) + BN - 1) / BN;
        return it;
    };

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 4 * NC);  // one arrive per consumer warp once its last S is done
        for (int s = 0; s < 2; ++s) {
            mbar_init(k_full + 8 * s, 1);
            mbar_init(v_full + 8 * s, 1);
            mbar_init(k_empty + 8 * s, 4 * NC);
            mbar_init(v_empty + 8 * s, 4 * NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // Q is reloaded per item j (the phase parity of its barriers is j & 1) once the consumers have
    // issued their last S = Q K^T of the previous item: the load overlaps that item's last P V and
    // epilogue. The KV ring runs on across items: t counts the KV tiles this block has loaded, t & 1
    // is the stage, (t >> 1) & 1 the parity of its full barrier's phase. (A second Q stage, loading
    // a whole item ahead, measured slower at long T: doc/attention.md.)
    if (wg == 0) {  // producer
        setmaxnreg_dec<PROD_REGS>();
        if (threadIdx.x == 0) {
            int t = 0;
            for (int j = 0, w = blockIdx.x;; ++j, w = ws_next_item<D, BN, NC>(items, gridDim.x)) {
                if (j > 0) mbar_wait(q_empty, (j - 1) & 1);  // the consumers are done with the last Q
                *item_slot = w;  // published by the arrival below
                if (w >= items) {  // no work left: tell the consumers
                    mbar_arrive(q_full);
                    break;
                }
                const Item it = item_of(w);
                const int hk = it.h / (Hq / Hkv);
                mbar_expect_tx(q_full, BM * D * sizeof(bf16));
                for (int p = 0; p < PANELS; ++p)
                    tma_load_3d(attn_smem_u32(Qs + p * BM * 64), &tm_q, it.h * D + p * 64, it.m0, it.b, q_full);
                for (int i = 0; i < it.n_tiles; ++i, ++t) {
                    const int st = t & 1, n0 = (it.n_tiles - 1 - i) * BN;
                    const uint32_t parity = ((t >> 1) - 1) & 1;  // the phase KV tile t-2 completed
                    if (t >= 2) mbar_wait(k_empty + 8 * st, parity);
                    mbar_expect_tx(k_full + 8 * st, BN * D * sizeof(bf16));
                    for (int p = 0; p < PANELS; ++p)
                        tma_load_3d(attn_smem_u32(Ks + st * BN * D + p * BN * 64), &tm_k, hk * D + p * 64, n0, it.b,
                                    k_full + 8 * st);
                    if (t >= 2) mbar_wait(v_empty + 8 * st, parity);
                    mbar_expect_tx(v_full + 8 * st, BN * D * sizeof(bf16));
                    for (int p = 0; p < PANELS; ++p)
                        tma_load_3d(attn_smem_u32(Vs + st * BN * D + p * BN * 64), &tm_v, hk * D + p * 64, n0, it.b,
                                    v_full + 8 * st);
                }
            }
        }
        return;
    }

    // consumers
    setmaxnreg_inc<CONS_REGS>();
    const int cw = wg - 1, wrow = cw * 64 + (warp & 3) * 16;  // this warp's rows inside the tile
    const uint32_t qs = attn_smem_u32(Qs) + cw * 64 * 128;
    float o[DT][4], s[NT][4], row_max[2], row_sum[2], alpha[2];
    uint32_t pa[BN / 16][4];  // P of the previous tile in bf16: the A operand of O += P V

    // S = Q K^T of ring stage st into s (issued and committed, not waited for)
    auto issue_s = [&](int st) {
        const uint32_t ks = attn_smem_u32(Ks + st * BN * D);
        wg_fence_regs(s);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const uint64_t da = wg_desc(qs + (kk / 4) * BM * 128 + (kk % 4) * 32);
            const uint64_t db = wg_desc(ks + (kk / 4) * BN * 128 + (kk % 4) * 32);
            if (kk == 0) wg_mma_ss<BN, 0>(s, da, db);
            else wg_mma_ss<BN, 1>(s, da, db);
        }
        wg_commit();
    };
    // O += P V of ring stage st (issued and committed, not waited for)
    auto issue_pv = [&](int st) { wg_rs_chain<D, BN>(o, pa, attn_smem_u32(Vs + st * BN * D)); };
    // mask key > query where the tile of keys n0.. crosses this warp's diagonal, then the softmax step
    auto softmax = [&](int m0, int n0) {
        if (n0 + BN - 1 > m0 + wrow) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = m0 + wrow + (lane >> 2) + 8 * (e >> 1);
                    const int col = n0 + nt * 8 + 2 * (lane & 3) + (e & 1);
                    if (col > row) s[nt][e] = -INFINITY;
                }
        }
        attn_softmax_tile<NT>(s, row_max, row_sum, alpha, scale_log2);
    };

    int t = 0;  // as the producer's
    for (int j = 0;; ++j) {
        mbar_wait(q_full, j & 1);
        const int w = *item_slot;
        if (w >= items) break;
        const Item it = item_of(w);
        const int m0 = it.m0, last = it.n_tiles - 1;
        attn_zero(o);
        row_max[0] = row_max[1] = -INFINITY;
        row_sum[0] = row_sum[1] = 0.f;
        mbar_wait(k_full + 8 * (t & 1), (t >> 1) & 1);
        issue_s(t & 1);
        wg_wait<0>();
        wg_fence_regs(s);
        if (lane == 0) {
            mbar_arrive(k_empty + 8 * (t & 1));
            if (last == 0) mbar_arrive(q_empty);
        }
        softmax(m0, last * BN);  // O is zero: no rescale
        attn_pack_a(pa, s);
        for (int i = 1; i <= last; ++i) {
            const int tc = t + i, st = tc & 1, prev = (tc - 1) & 1;
            mbar_wait(k_full + 8 * st, (tc >> 1) & 1);
            issue_s(st);
            mbar_wait(v_full + 8 * prev, ((tc - 1) >> 1) & 1);
            issue_pv(prev);
            wg_wait<1>();  // S_i is done; P_{i-1} V_{i-1} may still run
            wg_fence_regs(s);
            if (lane == 0) {
                mbar_arrive(k_empty + 8 * st);
                if (i == last) mbar_arrive(q_empty);  // the producer may load the next item's Q
            }
            softmax(m0, (last - i) * BN);
            wg_wait<0>();  // O += P_{i-1} V_{i-1} done
            wg_fence_regs(o);
            if (lane == 0) mbar_arrive(v_empty + 8 * prev);
            attn_rescale<DT>(o, alpha);
            attn_pack_a(pa, s);
        }
        t += last;
        mbar_wait(v_full + 8 * (t & 1), (t >> 1) & 1);
        issue_pv(t & 1);
        wg_wait<0>();
        wg_fence_regs(o);
        if (lane == 0) mbar_arrive(v_empty + 8 * (t & 1));
        ++t;

        // O /= l, and the logsumexp of the row in natural log; the producer is already loading the
        // next item's tiles
        float inv[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = row_sum[r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            inv[r] = 1.f / l;
            const int tq = m0 + wrow + (lane >> 2) + 8 * r;
            if (tq < T && (lane & 3) == 0)
                lse[((long)it.b * Hq + it.h) * T + tq] = (row_max[r] + __log2f(l)) * 0.69314718056f;
        }
        attn_store_rows<D>(out + (long)it.b * T * Hq * D + it.h * D, (long)Hq * D, m0 + wrow, T, o, inv[0], inv[1],
                           lane);
    }
}

// PERSIST: a grid of one block per SM, each taking work items until none is left (the next item's
// loads overlap this one's epilogue); otherwise one block per item. Item groups hold the heads whose
// K and V (shared by G query heads) fit in L2_MIB MiB.
template <int D, int BN, int NC, bool PERSIST = true, int L2_MIB = 4>
static void ws_forward_launch(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int B,
                              int T, int Hq, int Hkv, cudaStream_t stream) {
    constexpr int BM = 64 * NC;
    auto kernel = ws_forward_kernel<D, BN, NC>;
    const int smem = (BM + 4 * BN) * D * (int)sizeof(bf16) + 16 + 10 * 8;
    static int sms = 0;
    if (!sms) {
        attn_allow_smem(kernel, smem);
        int dev;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    }
    const CUtensorMap tq = tma_tensor_map(q, Hq * D, stride, T, B, BM);
    const CUtensorMap tk = tma_tensor_map(k, Hkv * D, stride, T, B, BN);
    const CUtensorMap tv = tma_tensor_map(v, Hkv * D, stride, T, B, BN);
    const int items = ceil_div(T, BM) * B * Hq, grid = PERSIST && items > sms ? sms : items;
    const double kv_bytes_per_head = 4.0 * T * D / (Hq / Hkv);
    const int group_heads = (int)fmin((double)B * Hq, fmax(1.0, L2_MIB * 1048576.0 / kv_bytes_per_head));
    kernel<<<grid, 128 * (NC + 1), smem, stream>>>(tq, tk, tv, out, lse, B, T, Hq, Hkv, group_heads,
                                                   1.44269504089f / sqrtf((float)D));
    CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// Backward (version 4): FlashAttention-2's single pass over (KV tile, query tile) pairs, 5 products
// per pair, in FlashAttention-3's shape. The math is in the Backward comment above attn_delta_kernel:
//   S^T = K Q^T, dP^T = V dO^T, P^T = exp2(S^T*scale_log2 - lse2), dS^T = P^T o (dP^T - delta),
//   dV += P^T dO, dK += dS^T Q (kept in registers for the block's keys), dQ += dS K (partial sums
//   over the block's keys, added into fp32 accumulators in global memory).
// One block of 3 warpgroups per (BN = 128 keys, b, KV head), looping over the G query heads of the KV
// head and, per head, every query tile of BM rows at or below the diagonal:
//   warpgroup 0, the producer (24 registers): thread 0 loads K and V once, then Q, dO (TMA, 3-D
//     maps, 128-byte swizzle) and the tile's lse2 and delta (1-D bulk copies of the padded rows
//     attn_delta_kernel writes) into a 2-stage ring (full / empty mbarriers); thread 32 is the dQ
//     writer: once the consumers have left a tile's dQ share in shared memory (dq_full), it adds
//     it into the global accumulators with one bulk reduce (cp.reduce.async.bulk .add.f32) and
//     frees the staging buffer (dq_empty) as soon as the copy engine has read it.
//   warpgroups 1 and 2, the consumers (240 registers): consumer c owns keys n0 + 64c .. +63. Per tile:
//     the two SS chains S^T, dP^T; P^T and dS^T in registers (attn_bwd_p_ds_t); dS^T also stored
//     to shared memory; the RS chains dV += P^T dO, dK += dS^T Q; a named barrier (both halves of
//     dS^T stored); then consumer c computes its 64 x 64 share of the tile's dQ = dS K over all
//     128 keys, reading dS (MN-major: keys are the k dimension) and K (MN-major) from shared memory:
//     D = 128, BM = 64: columns 64c .. 64c+63;  D = 64, BM = 128: rows 64c .. 64c+63.
//     The share goes to the staging buffer in fragment order (float4 per register block and thread,
//     conflict-free); ws_dq_convert_kernel later maps it back to (row, column).
// Determinism (DET): the fp32 adds into one dQ tile come from the KV tiles 0 .. nmax of its rows,
// and are made in a fixed order, from nmax down to 0, by a per-tile semaphore: the writer of KV
// tile n waits until the tile's count is nmax - n, adds (the first, n = nmax, stores instead, so no
// zeroing pass is needed), waits for completion and increments the count (release). Blocks are
// numbered so that within a (b, KV head) the later KV tiles start first: KV tile n reaches query tile
// m two iterations after KV tile n + 1 did, so in steady state nobody waits. Without DET the adds
// are plain reductions in any order (the accumulators are zeroed first) and the longest blocks
// (KV tile 0) start first.
// Shared memory: K, V [128][D]; Q, dO [2][BM][D]; dS^T [2][BM/64 panels][128 keys][64]; dQ staging
// BM*D fp32; lse2, delta [2][BM]; 7 mbarriers: 193 KiB at D = 128 (BM = 64) and 194 KiB at D = 64
// (BM = 128). One block per SM.
template <int D, int BM, bool DET>
__global__ void __launch_bounds__(384, 1)
    ws_backward_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                       bf16* __restrict__ dk, bf16* __restrict__ dv, float* __restrict__ dq_acc,
                       int* __restrict__ dq_sem, const float* __restrict__ lse2, const float* __restrict__ delta,
                       int dstride, int T, int Tp, int Hq, int Hkv, float scale, float scale_log2) {
    constexpr int BN = 128, NT = BM / 8, DT = D / 8, PANELS = D / 64;
    static_assert((D == 128 && BM == 64) || (D == 64 && BM == 128), "each consumer's dQ share is one 64 x 64 block");
    extern __shared__ __align__(1024) unsigned char attn_smem[];
    bf16* Ks = reinterpret_cast<bf16*>(attn_smem);
    bf16* Vs = Ks + BN * D;
    bf16* Qs = Vs + BN * D;                               // [2][BM * D]
    bf16* dOs = Qs + 2 * BM * D;                          // [2][BM * D]
    bf16* dSs = dOs + 2 * BM * D;                         // [2][BN * BM]
    float* dQs = reinterpret_cast<float*>(dSs + 2 * BN * BM);  // [BM * D], fragment order
    float* lse_s = dQs + BM * D;                          // [2][BM]
    float* dl_s = lse_s + 2 * BM;                         // [2][BM]
    const uint32_t bars = attn_smem_u32(dl_s + 2 * BM);
    // barrier addresses: kv_full, full[2], empty[2], dq_full, dq_empty
    const uint32_t kv_full = bars, full = bars + 8, empty = bars + 24, dq_full = bars + 40, dq_empty = bars + 48;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
    const int G = Hq / Hkv, N = (T + BN - 1) / BN, M = (T + BM - 1) / BM;
    const int n = DET ? N - 1 - (int)blockIdx.x : (int)blockIdx.x;
    const int b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv, n0 = n * BN;
    const int qt_first = n0 / BM, per_head = M - qt_first, iters = G * per_head;

    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        for (int st = 0; st < 2; ++st) {
            mbar_init(full + 8 * st, 1);
            mbar_init(empty + 8 * st, 8);  // one arrive per consumer warp
        }
        mbar_init(dq_full, 8);
        mbar_init(dq_empty, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {  // producer
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) {  // the loads
            mbar_expect_tx(kv_full, 2 * BN * D * sizeof(bf16));
            for (int p = 0; p < PANELS; ++p) {
                tma_load_3d(attn_smem_u32(Ks + p * BN * 64), &tm_k, hk * D + p * 64, n0, b, kv_full);
                tma_load_3d(attn_smem_u32(Vs + p * BN * 64), &tm_v, hk * D + p * 64, n0, b, kv_full);
            }
            for (int it = 0; it < iters; ++it) {
                const int st = it & 1, hh = hk * G + it / per_head, m0 = (qt_first + it % per_head) * BM;
                if (it >= 2) mbar_wait(empty + 8 * st, ((it >> 1) - 1) & 1);  // the phase tile it-2 completed
                const uint32_t bar = full + 8 * st;
                mbar_expect_tx(bar, 2 * BM * D * sizeof(bf16) + 2 * BM * sizeof(float));
                for (int p = 0; p < PANELS; ++p) {
                    tma_load_3d(attn_smem_u32(Qs + st * BM * D + p * BM * 64), &tm_q, hh * D + p * 64, m0, b, bar);
                    tma_load_3d(attn_smem_u32(dOs + st * BM * D + p * BM * 64), &tm_do, hh * D + p * 64, m0, b, bar);
                }
                const long row = ((long)b * Hq + hh) * Tp + m0;
                bulk_load(attn_smem_u32(lse_s + st * BM), lse2 + row, BM * sizeof(float), bar);
                bulk_load(attn_smem_u32(dl_s + st * BM), delta + row, BM * sizeof(float), bar);
            }
        } else if (threadIdx.x == 32) {  // the dQ writer
            for (int it = 0; it < iters; ++it) {
                const int hh = hk * G + it / per_head, m = qt_first + it % per_head;
                const long tile = ((long)b * Hq + hh) * (Tp / BM) + m;
                float* dst = dq_acc + tile * BM * D;
                mbar_wait(dq_full, it & 1);
                if constexpr (DET) {
                    const int turn = min(N - 1, (m * BM + BM - 1) / BN) - n;  // KV tiles above n add first
                    while (load_acquire_gpu(dq_sem + tile) != turn) {
                    }
                    fence_proxy_async_global();
                    if (turn == 0) bulk_store<false>(dst, attn_smem_u32(dQs), BM * D * sizeof(float));
                    else bulk_store<true>(dst, attn_smem_u32(dQs), BM * D * sizeof(float));
                    bulk_wait<false>();
                    mbar_arrive(dq_empty);
                    fence_proxy_async_global();
                    add_release_gpu(dq_sem + tile, 1);
                } else {
                    bulk_store<true>(dst, attn_smem_u32(dQs), BM * D * sizeof(float));
                    bulk_wait<true>();
                    mbar_arrive(dq_empty);
                }
            }
            bulk_wait<false>();
        }
        return;
    }

    // consumers
    setmaxnreg_inc<240>();
    const int cw = wg - 1, ct = threadIdx.x - 128 * wg, wrow = cw * 64 + (warp & 3) * 16;  // this warp's keys
    const uint32_t ks = attn_smem_u32(Ks) + cw * 64 * 128, vs = attn_smem_u32(Vs) + cw * 64 * 128;
    float dk_acc[DT][4], dv_acc[DT][4];
    attn_zero(dk_acc);
    attn_zero(dv_acc);
    mbar_wait(kv_full, 0);

    for (int it = 0; it < iters; ++it) {
        const int st = it & 1, m0 = (qt_first + it % per_head) * BM;
        mbar_wait(full + 8 * st, (it >> 1) & 1);
        const uint32_t qs = attn_smem_u32(Qs + st * BM * D), dos = attn_smem_u32(dOs + st * BM * D);

        float s[NT][4], dp[NT][4];  // S^T then P^T; dP^T then dS^T
        wg_ss_pair<D, BN, BM>(s, dp, ks, vs, qs, dos);
        attn_bwd_p_ds_t(s, dp, lse_s + st * BM, dl_s + st * BM, m0 < n0 + wrow + 15, m0, n0 + wrow, lane, scale_log2);
        uint32_t pa[BM / 16][4], dsa[BM / 16][4];  // P^T and dS^T in bf16, A-operand layout
        attn_pack_a(pa, s);
        attn_pack_a(dsa, dp);

        // dS^T to shared memory, the same bf16 values: panel nt/8 holds queries 64*(nt/8) .. +63; row
        // = key (0 .. 127), 128 bytes; 16-byte chunk (nt%8) ^ (key & 7) (conflict-free: the 32 lanes
        // hit 8 chunks x 4 words). Rows key and key + 8 share the swizzle.
        bf16* dS = dSs + (it & 1) * BN * BM;
        const int key = wrow + (lane >> 2);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            unsigned char* at = reinterpret_cast<unsigned char*>(dS) + (nt / 8) * BN * 128 + key * 128 +
                                (((nt % 8) ^ (key & 7)) << 4) + (lane & 3) * 4;
            *reinterpret_cast<uint32_t*>(at) = dsa[nt / 2][2 * (nt & 1)];
            *reinterpret_cast<uint32_t*>(at + 8 * 128) = dsa[nt / 2][2 * (nt & 1) + 1];
        }

        wg_rs_chain<D, BM>(dv_acc, pa, dos);  // dV += P^T dO
        wg_rs_chain<D, BM>(dk_acc, dsa, qs);  // dK += dS^T Q

        wg_fence_proxy_async();     // this thread's dS^T stores, before the tensor cores read them ...
        named_barrier(1, 256);   // ... and both consumers' halves stored
        float dq[8][4];             // this consumer's 64 x 64 share of dQ (unscaled)
        const uint32_t a_base = attn_smem_u32(dS) + (BM == 128 ? cw : 0) * BN * 128;
        const uint32_t b_base = attn_smem_u32(Ks) + (BM == 64 ? cw : 0) * BN * 128;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            if (kk == 0) wg_mma_ss<64, 0, 1, 1>(dq, wg_desc(a_base), wg_desc(b_base));
            else wg_mma_ss<64, 1, 1, 1>(dq, wg_desc(a_base + kk * 16 * 128), wg_desc(b_base + kk * 16 * 128));
        }
        wg_commit();
        wg_wait<0>();
        wg_fence_regs(dv_acc);
        wg_fence_regs(dk_acc);
        wg_fence_regs(dq);
        if (lane == 0) mbar_arrive(empty + 8 * st);  // Q, dO, lse2, delta of this stage are free

        if (it >= 1) mbar_wait(dq_empty, (it - 1) & 1);  // the writer has read the previous share
        float4* stage = reinterpret_cast<float4*>(dQs) + cw * 8 * 128 + ct;
#pragma unroll
        for (int j = 0; j < 8; ++j) stage[j * 128] = make_float4(dq[j][0], dq[j][1], dq[j][2], dq[j][3]);
        wg_fence_proxy_async();
        __syncwarp();
        if (lane == 0) mbar_arrive(dq_full);
    }
    attn_store_rows<D>(dk + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dk_acc, scale, scale, lane);
    attn_store_rows<D>(dv + (long)b * T * dstride + hk * D, dstride, n0 + wrow, T, dv_acc, 1.f, 1.f, lane);
}

// dq[b, t, h, :] = scale * the accumulated dQ, from the fragment order of ws_backward_kernel: one block
// of 256 threads per (query tile, b*Hq + h); thread (c, i) reads consumer c's thread i's 8 float4.
template <int D, int BM>
__global__ void __launch_bounds__(256)
    ws_dq_convert_kernel(bf16* __restrict__ dq, const float* __restrict__ dq_acc, int dstride, int T, int Tp, int Hq,
                         float scale) {
    const int cw = threadIdx.x >> 7, ct = threadIdx.x & 127, lane = ct & 31, w = ct >> 5;
    const int m = blockIdx.x, bh = blockIdx.y, b = bh / Hq, h = bh % Hq;
    const float4* src = reinterpret_cast<const float4*>(dq_acc + ((long)bh * (Tp / BM) + m) * BM * D) + cw * 8 * 128 + ct;
    const int row0 = m * BM + (BM == 128 ? 64 * cw : 0) + 16 * w + (lane >> 2);
    const int col0 = (BM == 64 ? 64 * cw : 0) + 2 * (lane & 3);
    bf16* out = dq + (long)b * T * dstride + h * D + col0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float4 x = src[j * 128];
        if (row0 < T)
            *reinterpret_cast<uint32_t*>(out + (long)row0 * dstride + 8 * j) = attn_pack_bf16(x.x * scale, x.y * scale);
        if (row0 + 8 < T)
            *reinterpret_cast<uint32_t*>(out + (long)(row0 + 8) * dstride + 8 * j) =
                attn_pack_bf16(x.z * scale, x.w * scale);
    }
}

// Scratch of the backward, bytes: lse2 and delta [B*Hq][Tp]; the dQ accumulators (fp32), one BM x D
// block per (b*Hq + h, query tile) in ws_backward_kernel's fragment order; a semaphore per such block
// (int, at most Tp/64 per head); Tp = T rounded up to 128.
static size_t attention_backward_scratch_bytes(int B, int T, int Hq, int D) {
    const size_t rows = (size_t)B * Hq * ceil_div(T, 128) * 128;
    return rows * (2 + D) * sizeof(float) + rows / 64 * sizeof(int);
}

template <int D, int BM, bool DET>
static void ws_backward_launch(bf16* dq, bf16* dk, bf16* dv, float* scratch, const bf16* dout, const bf16* out,
                               const float* lse, const bf16* q, const bf16* k, const bf16* v, int stride, int dstride,
                               int B, int T, int Hq, int Hkv, cudaStream_t stream) {
    const int Tp = ceil_div(T, 128) * 128;
    const size_t rows = (size_t)B * Hq * Tp;
    float* lse2 = scratch;
    float* delta = lse2 + rows;
    float* dq_acc = delta + rows;
    int* dq_sem = reinterpret_cast<int*>(dq_acc + rows * D);
    attn_delta_launch(delta, lse2, lse, dout, out, B, T, Tp, Hq, D, stream);
    if (DET) CUDA_CHECK(cudaMemsetAsync(dq_sem, 0, rows / BM * sizeof(int), stream));
    else CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, rows * D * sizeof(float), stream));

    auto kernel = ws_backward_kernel<D, BM, DET>;
    const int smem = (2 * 128 + 4 * BM) * D * (int)sizeof(bf16) + 2 * 128 * BM * (int)sizeof(bf16) +
                     (BM * D + 4 * BM) * (int)sizeof(float) + 7 * 8;
    static bool configured = false;
    if (!configured) { attn_allow_smem(kernel, smem); configured = true; }
    const CUtensorMap tq = tma_tensor_map(q, Hq * D, stride, T, B, BM);
    const CUtensorMap tk = tma_tensor_map(k, Hkv * D, stride, T, B, 128);
    const CUtensorMap tv = tma_tensor_map(v, Hkv * D, stride, T, B, 128);
    const CUtensorMap tdo = tma_tensor_map(dout, Hq * D, Hq * D, T, B, BM);
    const float scale = 1.f / sqrtf((float)D);
    kernel<<<dim3(ceil_div(T, 128), B * Hkv), 384, smem, stream>>>(tq, tk, tv, tdo, dk, dv, dq_acc, dq_sem, lse2, delta,
                                                                   dstride, T, Tp, Hq, Hkv, scale,
                                                                   scale * 1.44269504089f);
    CUDA_CHECK(cudaGetLastError());
    ws_dq_convert_kernel<D, BM><<<dim3(Tp / BM, B * Hq), 256, 0, stream>>>(dq, dq_acc, dstride, T, Tp, Hq, scale);
    CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------
// The entry points. Tiles, the best of those timed by `./dev/attention tune` on an H100 (doc/attention.md):
//   forward: 128 queries x 128 keys, 2 consumers; at D = 64 and T > 1024, 192 x 128, 3 consumers.
//   backward: 128 keys x 64 queries at D = 128, 128 x 128 at D = 64.
static void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                              int B, int T, int Hq, int Hkv, int D, cudaStream_t stream) {
    const void* ptrs[] = {out, q, k, v};
    attn_check_args("attention_forward", ptrs, 4, qkv_stride, B, T, Hq, Hkv, D);
    if (D == 128) ws_forward_launch<128, 128, 2>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
    else if (T <= 1024) ws_forward_launch<64, 128, 2>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
    else ws_forward_launch<64, 128, 3>(out, lse, q, k, v, qkv_stride, B, T, Hq, Hkv, stream);
}

// scratch: attention_backward_scratch_bytes(B, T, Hq, D) bytes, 16-byte aligned, contents ignored.
// deterministic = false adds the dQ partial sums in whatever order they come (fp32 atomics in L2):
// results then vary in the last bits run to run; it is faster only at long T (doc/attention.md).
static void attention_backward(bf16* dq, bf16* dk, bf16* dv, float* scratch, const bf16* dout, const bf16* out,
                               const float* lse, const bf16* q, const bf16* k, const bf16* v, int qkv_stride,
                               int dqkv_stride, int B, int T, int Hq, int Hkv, int D, cudaStream_t stream,
                               bool deterministic = true) {
    const void* ptrs[] = {dq, dk, dv, dout, out, q, k, v, scratch};
    attn_check_args("attention_backward", ptrs, 9, qkv_stride, B, T, Hq, Hkv, D);
    if (dqkv_stride % 8 != 0 || dqkv_stride < Hq * D) {
        fprintf(stderr, "attention_backward: dqkv_stride %d must be a multiple of 8 and at least Hq*D = %d\n",
                dqkv_stride, Hq * D);
        exit(1);
    }
    if (D == 64 && deterministic)
        ws_backward_launch<64, 128, true>(dq, dk, dv, scratch, dout, out, lse, q, k, v, qkv_stride, dqkv_stride, B, T,
                                          Hq, Hkv, stream);
    else if (D == 64)
        ws_backward_launch<64, 128, false>(dq, dk, dv, scratch, dout, out, lse, q, k, v, qkv_stride, dqkv_stride, B,
                                           T, Hq, Hkv, stream);
    else if (deterministic)
        ws_backward_launch<128, 64, true>(dq, dk, dv, scratch, dout, out, lse, q, k, v, qkv_stride, dqkv_stride, B, T,
                                          Hq, Hkv, stream);
    else
        ws_backward_launch<128, 64, false>(dq, dk, dv, scratch, dout, out, lse, q, k, v, qkv_stride, dqkv_stride, B,
                                           T, Hq, Hkv, stream);
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
// The optimizer: the learning-rate schedule and AdamW, fused with gradient clipping and the bf16
// copy of the weights. Everything a step needs lives on the device (OptimScalars below): a
// one-thread kernel advances the step and evaluates the schedule there, so the host never passes
// per-step values and a step can be replayed as a CUDA graph.

typedef struct {
    float lr, min_lr_frac, weight_decay, beta1, beta2, eps, grad_clip;
    int warmup_steps, total_steps;
    int wsd;            // 0: warmup then cosine to min_lr; 1: warmup, stable, then linear decay (WSD)
    float decay_frac;   // WSD: the last fraction of the steps that decays
} OptimConfig;

// The learning rate of step `step` (0-based). Warmup: linear from lr/warmup to lr. Then cosine:
// from lr down to min_lr at the last step; or WSD: lr until the last decay_frac of the steps,
// then linear down to min_lr. The same code runs on the host (tests, --help) and the device.
__host__ __device__ static float learning_rate(const OptimConfig* o, int step) {
    float min_lr = o->lr * o->min_lr_frac;
    if (step < o->warmup_steps) return o->lr * (step + 1) / o->warmup_steps;
    if (o->total_steps <= o->warmup_steps) return o->lr;
    if (o->wsd) {
        int decay_start = o->total_steps - (int)(o->decay_frac * o->total_steps);
        if (decay_start < o->warmup_steps) decay_start = o->warmup_steps;
        if (step < decay_start) return o->lr;
        float progress = (float)(step - decay_start + 1) / (float)(o->total_steps - decay_start);
        return o->lr + (min_lr - o->lr) * progress;
    }
    int cosine_steps = o->total_steps - 1 - o->warmup_steps;  // the last step reaches min_lr
    float progress = cosine_steps > 0 ? (float)(step - o->warmup_steps) / cosine_steps : 1.0f;
    if (progress > 1.0f) progress = 1.0f;
    return min_lr + 0.5f * (o->lr - min_lr) * (1.0f + cosf(3.14159265358979f * progress));
}

// The step's scalars, in device memory. `step` counts the optimizer steps done; the others
// describe the step being taken (lr, bias corrections) or just taken (loss_sum, grad_norm_sq).
typedef struct {
    int step;
    float lr;
    float bias_corr1, bias_corr2;  // 1 - beta^t for t = step + 1
    float loss_sum;                // sum of the per-token losses over the step's micro-batches
    float grad_norm_sq;            // of the whole (unclipped) gradient
    float val_loss_sum;            // sum over a validation pass
} OptimScalars;

__global__ void optimizer_schedule_kernel(OptimScalars* s, OptimConfig o) {
    int step = s->step;
    s->lr = learning_rate(&o, step);
    s->bias_corr1 = 1.0f - powf(o.beta1, (float)(step + 1));
    s->bias_corr2 = 1.0f - powf(o.beta2, (float)(step + 1));
    s->step = step + 1;
}

// Every parameter tensor starts on a PARAM_ALIGN-element boundary of the flat buffers (train_gpt's
// parameter table), so one flag per PARAM_ALIGN elements says whether weight decay applies there.
#define PARAM_ALIGN 128

// With g = grad * clip_scale, clip_scale = min(1, max_norm / ||grad||) read from the device:
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + lr * wd * p     (decoupled decay)
// over elements [begin, end) of the flat buffers, wd = weight_decay where decay[i / PARAM_ALIGN].
__global__ void adamw_kernel(float* master, bf16* params, const float* grads, float* m, float* v,
                             const uint8_t* decay, size_t begin, size_t end, OptimConfig o, const OptimScalars* s) {
    float norm = sqrtf(s->grad_norm_sq);
    float clip_scale = (o.grad_clip > 0.0f && norm > o.grad_clip) ? o.grad_clip / norm : 1.0f;
    float lr = s->lr, bias_corr1 = s->bias_corr1, bias_corr2 = s->bias_corr2;
    for (size_t i = begin + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < end;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = grads[i] * clip_scale;
        float mi = o.beta1 * m[i] + (1.0f - o.beta1) * g;
        float vi = o.beta2 * v[i] + (1.0f - o.beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float p = master[i];
        float wd = decay[i / PARAM_ALIGN] ? o.weight_decay : 0.0f;
        p -= lr * ((mi / bias_corr1) / (sqrtf(vi / bias_corr2) + o.eps) + wd * p);
        master[i] = p;
        params[i] = __float2bfloat16(p);
    }
}

// One optimizer step over elements [begin, end): advance the schedule, then update. The gradient
// norm must already be in s->grad_norm_sq.
static void adamw_step(float* master, bf16* params, const float* grads, float* m, float* v, const uint8_t* decay,
                       size_t begin, size_t end, const OptimConfig* o, OptimScalars* s, cudaStream_t stream) {
    optimizer_schedule_kernel<<<1, 1, 0, stream>>>(s, *o);
    LAUNCH_CHECK();
    adamw_kernel<<<1024, 256, 0, stream>>>(master, params, grads, m, v, decay, begin, end, *o, s);
    LAUNCH_CHECK();
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
// talks to cuBLASLt, for every operand type: bf16 and fp32, and FP8 (E4M3, E5M2) with a scale per
// tensor. cuBLASLt's FP8 kernels take only the "TN" form (trans_a and not trans_b) and want every
// leading dimension a multiple of 16 bytes; the per-tensor scales are device pointers, so nothing
// about them ever goes through the host.
//
// Descriptors, layouts and the heuristic's choice of algorithm are made once per shape and kept
// in a plan; a call finds its plan, sets the scale pointers, and launches.

// One operand of a matmul: where it is, its element type, and for FP8 the device pointer of the
// factor that turns its stored values into real ones (NULL: unscaled). For the result, `scale`
// divides (FP8 results are stored as real / scale) and `amax`, when not NULL, receives max |real|.
typedef struct {
    void* ptr;
    cudaDataType_t type;
    const float* scale;
    float* amax;
} MatmulOperand;

static MatmulOperand mm_bf16(const bf16* p) { return (MatmulOperand){(void*)p, CUDA_R_16BF, NULL, NULL}; }
static MatmulOperand mm_f32(float* p) { return (MatmulOperand){p, CUDA_R_32F, NULL, NULL}; }

typedef struct {  // what makes two calls the same plan; all ints, so no padding for memcmp to trip on
    int m, n, k;
    int trans_a, trans_b, has_c, scale_a, scale_b, scale_d, amax_d;
    int a_type, b_type, d_type;  // cudaDataType_t
} MatmulKey;

typedef struct {
    MatmulKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t layout_a, layout_b, layout_c, layout_d;
    cublasLtMatmulAlgo_t algo;
} MatmulPlan;

#define MATMUL_MAX_PLANS 256
static cublasLtHandle_t g_cublaslt;
static void* g_cublaslt_workspace;
static const size_t CUBLASLT_WORKSPACE_BYTES = 32u << 20;
static MatmulPlan g_plans[MATMUL_MAX_PLANS];
static int g_n_plans;

static void matmul_init(void) {
    CUBLAS_CHECK(cublasLtCreate(&g_cublaslt));
    CUDA_CHECK(cudaMalloc(&g_cublaslt_workspace, CUBLASLT_WORKSPACE_BYTES));
}

static void matmul_free(void) {
    for (int i = 0; i < g_n_plans; i++) {
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(g_plans[i].layout_a));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(g_plans[i].layout_b));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(g_plans[i].layout_c));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(g_plans[i].layout_d));
        CUBLAS_CHECK(cublasLtMatmulDescDestroy(g_plans[i].desc));
    }
    g_n_plans = 0;
    CUBLAS_CHECK(cublasLtDestroy(g_cublaslt));
    CUDA_CHECK(cudaFree(g_cublaslt_workspace));
}

static bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

// Sets the scale and amax pointers that the call's operands carry (NULL ones are left unset).
static void matmul_set_scales(cublasLtMatmulDesc_t desc, const MatmulOperand* a, const MatmulOperand* b,
                              const MatmulOperand* d) {
    const struct {
        cublasLtMatmulDescAttributes_t attribute;
        const void* pointer;
    } scales[] = {{CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a->scale},
                  {CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b->scale},
                  {CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, d->scale},
                  {CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, d->amax}};
    for (const auto& s : scales)
        if (s.pointer) CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, s.attribute, &s.pointer, sizeof(s.pointer)));
}

// Makes the plan for `key`: the descriptor with its fixed attributes, the four layouts, and the
// heuristic's first algorithm. C has D's type, except that an FP8 result takes a bf16 C
// (cuBLASLt's rule: C is never FP8). The heuristic sees the first call's scale and amax pointers:
// cuBLASLt chooses among its FP8 kernels by which of them are set.
static MatmulPlan matmul_plan_make(const MatmulKey* key, const MatmulOperand* a, const MatmulOperand* b,
                                   const MatmulOperand* d) {
    MatmulPlan p;
    p.key = *key;
    const int m = key->m, n = key->n, k = key->k;
    cublasOperation_t op_a = key->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = key->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    matmul_set_scales(p.desc, a, b, d);
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_a, (cudaDataType_t)key->a_type, key->trans_a ? k : m, key->trans_a ? m : k,
                                            key->trans_a ? k : m));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_b, (cudaDataType_t)key->b_type, key->trans_b ? n : k, key->trans_b ? k : n,
                                            key->trans_b ? n : k));
    cudaDataType_t c_type = is_fp8((cudaDataType_t)key->d_type) ? CUDA_R_16BF : (cudaDataType_t)key->d_type;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_c, c_type, m, n, m));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_d, (cudaDataType_t)key->d_type, m, n, m));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &CUBLASLT_WORKSPACE_BYTES, sizeof(size_t)));
    cublasLtMatmulHeuristicResult_t result;
    int n_results = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(g_cublaslt, p.desc, p.layout_a, p.layout_b, p.layout_c, p.layout_d,
                                                pref, 1, &result, &n_results));
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (n_results == 0) {
        fprintf(stderr, "cuBLASLt has no algorithm for a %dx%dx%d matmul (trans %d%d, types %d %d -> %d)\n", m, n, k,
                key->trans_a, key->trans_b, (int)key->a_type, (int)key->b_type, (int)key->d_type);
        exit(1);
    }
    p.algo = result.algo;
    return p;
}

static MatmulPlan* matmul_plan(const MatmulKey* key, const MatmulOperand* a, const MatmulOperand* b,
                               const MatmulOperand* d) {
    for (int i = 0; i < g_n_plans; i++)
        if (!memcmp(&g_plans[i].key, key, sizeof(*key))) return &g_plans[i];
    if (g_n_plans == MATMUL_MAX_PLANS) {
        fprintf(stderr, "matmul: more than %d distinct matmul shapes; raise MATMUL_MAX_PLANS\n", MATMUL_MAX_PLANS);
        exit(1);
    }
    g_plans[g_n_plans] = matmul_plan_make(key, a, b, d);
    return &g_plans[g_n_plans++];
}

// Column-major D[m, n] = op(A)[m, k] op(B)[k, n] (+ beta C, of D's shape, when c is not NULL),
// accumulated in fp32. Scales (FP8): D = scale_d^-1 * (scale_a scale_b op(A) op(B) + beta C).
// All pointers are 256-byte aligned and every leading dimension is the stored matrix's row count.
static void matmul(MatmulOperand d, MatmulOperand a, MatmulOperand b, const void* c, float beta, int m, int n, int k,
                   bool trans_a, bool trans_b, cudaStream_t stream) {
    if ((is_fp8(a.type) || is_fp8(b.type)) && (!trans_a || trans_b)) {
        fprintf(stderr, "matmul: FP8 operands need the TN form (trans_a and not trans_b)\n");
        exit(1);
    }
    const MatmulKey key = {m, n, k, trans_a, trans_b, c != NULL, a.scale != NULL, b.scale != NULL, d.scale != NULL,
                           d.amax != NULL, a.type, b.type, d.type};
    MatmulPlan* plan = matmul_plan(&key, &a, &b, &d);
    matmul_set_scales(plan->desc, &a, &b, &d);
    const float alpha = 1.0f;
    const float beta_used = c ? beta : 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(g_cublaslt, plan->desc, &alpha, a.ptr, plan->layout_a, b.ptr, plan->layout_b,
                                &beta_used, c ? c : d.ptr, plan->layout_c, d.ptr, plan->layout_d, &plan->algo,
                                g_cublaslt_workspace, CUBLASLT_WORKSPACE_BYTES, stream));
}

// y[N, O] = x[N, I] W[O, I]^T (+ residual[N, O] when residual is not NULL).
// Column-major: D[m=O, n=N] = op_T(W, stored [I, O]) x^T (stored [I, N]), D stored [O, N] = y.
static void linear_forward(bf16* y, const bf16* x, const bf16* W, const bf16* residual, int N, int I, int O,
                           cudaStream_t s) {
    matmul(mm_bf16(y), mm_bf16(W), mm_bf16(x), residual, 1.0f, O, N, I, true, false, s);
}

// dx[N, I] = dy[N, O] W[O, I].   Column-major: D[m=I, n=N] = W(stored [I, O]) dy^T(stored [O, N]).
static void linear_backward_input(bf16* dx, const bf16* dy, const bf16* W, int N, int I, int O, cudaStream_t s) {
    matmul(mm_bf16(dx), mm_bf16(W), mm_bf16(dy), NULL, 0.0f, I, N, O, false, false, s);
}

// dW[O, I] += dy[N, O]^T x[N, I].   Column-major: D[m=I, n=O] = x^T(stored [I, N]) op_T(dy stored [O, N]).
static void linear_backward_weight(float* dW, const bf16* dy, const bf16* x, int N, int I, int O, cudaStream_t s) {
    matmul(mm_f32(dW), mm_bf16(x), mm_bf16(dy), dW, 1.0f, I, O, N, false, true, s);
}

#endif
