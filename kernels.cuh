/*
 * kernels.cuh - every CUDA kernel train_gpt runs, the optimizer's kernels, and the one matmul
 * wrapper all matmuls use but two (the BF16 gate/up forward and down input gradient, which run
 * lib/matmul_hopper.cuh's GEMM with SwiGLU, or its backward, in the epilogue).
 *
 * Read it top to bottom: small helpers, the deterministic reductions (global gradient norm, loss
 * sum), the master weights' two halves and initialization; then the kernels in the order of a
 * training step: embedding, RMSNorm, the per-head QK norm with rotary embedding, attention (in
 * lib/attention.cuh, included at the top, since the QK norm's backward reads the dQ that
 * attention's backward leaves; its PTX wrappers are in lib/ptx.cuh), SwiGLU, the chunked
 * cross-entropy and the BF16 head's loss from what its fused product leaves; then the optimizer (the
 * learning-rate schedule; the fused AdamW update; 8-bit AdamW's quantization map and its fused
 * update), the cuBLASLt wrapper (with its tuning: which of cuBLASLt's algorithms each shape runs),
 * then Muon (momentum and Newton-Schulz), whose iteration multiplies through that wrapper.
 * Each forward kernel is followed by its backward, whose comment states the derivative it computes.
 *
 * Conventions a reader must know:
 *  - Activations are bf16, row-major, one row per token: x[n, c] with n = b*T + t.
 *  - Every reduction accumulates in fp32, and every reduction across rows is deterministic: a
 *    fixed grid writes per-block partial sums, and a second kernel adds them in a fixed order.
 *    There are no floating-point atomics anywhere, so a run repeats bit for bit on the same GPU.
 *  - Parameter gradients are fp32. Their first write in an optimizer step sets them (beta 0);
 *    later ones (more micro-batches, the head's later chunks) add to them (+=, beta 1): every
 *    gradient kernel that may write first takes `accumulate` (the embedding's lookup backward
 *    always adds: the tied output head has written first), so the gradients are never zeroed (a
 *    memset of 4 bytes a parameter) nor read before their first write. The gradient of the
 *    residual stream is bf16 and is updated in place as the backward walks down the layers.
 *  - Rows are read in 16-byte vectors of 8 bf16, so every row length must be a multiple of 8
 *    (train_gpt's config check enforces this before anything is allocated).
 */
#ifndef KERNELS_CUH
#define KERNELS_CUH

#include <math.h>
#include <float.h>
#include <string.h>
#include <type_traits>  // linear_backward_input's output types
#include "lib/cuda_check.h"
#include "lib/util.h"  // xmalloc
#include "lib/attention.cuh"  // attention, below in the step's order; the QK norm's backward reads its dQ

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

__device__ __forceinline__ float warp_max(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
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

// Max over a whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets the result.
// A max is exact, so any order gives the same bits: every thread reads the warps' maxima itself,
// which saves block_sum's second barrier.
__device__ float block_max(float x) {
    __shared__ float warp_maxima[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    x = warp_max(x);
    if (lane == 0) warp_maxima[warp] = x;
    __syncthreads();
    float result = warp_maxima[0];
    for (int w = 1; w < n_warps; w++) result = fmaxf(result, warp_maxima[w]);
    __syncthreads();  // so that a second call may reuse the shared slots
    return result;
}

// ----------------------------------------------------------------------------------------------
// Deterministic reductions

// Many kernels below produce one row of partial sums per block: partials[p * stride + c] for
// p < n_partials, c < C. This adds them up into dst (=), or onto it (+=, accumulate). A block owns 32 columns;
// its 32 thread rows each sum every 32nd partial row, and thread row 0 then adds the 32 sums in
// order: a fixed order (deterministic), with enough loads in flight to run at memory speed.
// Such sums come in small groups (a layer's four norms in the backward), and each alone is a launch
// of a few microseconds that hardly fills the GPU, so a launch takes up to PARTIAL_SUMS_MAX of them
// (blockIdx.y: which); every one is added in the same order whatever its company, so the bits are too.
typedef struct {
    float* dst;
    const float* partials;
    int n_partials, C, stride, accumulate;
} PartialSum;
#define PARTIAL_SUMS_MAX 6
typedef struct {
    PartialSum sum[PARTIAL_SUMS_MAX];
    int n;
} PartialSums;

__global__ void sum_partials_kernel(const PartialSums sums) {
    __shared__ float row_sums[32][33];  // +1: no bank conflicts on the transposed read
    const PartialSum job = sums.sum[blockIdx.y];
    if (blockIdx.x * 32 >= job.C) return;  // the whole block: a narrower sum than the launch's widest
    int c = blockIdx.x * 32 + threadIdx.x;
    float sum = 0.0f;
    if (c < job.C) {
        // 16 loads issued ahead of their adds, which keep their order: a long job (the QK norm's
        // 4096 partial rows at medium) is 128 loads a thread
#pragma unroll 16
        for (int p = threadIdx.y; p < job.n_partials; p += 32) sum += job.partials[(size_t)p * job.stride + c];
    }
    row_sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && c < job.C) {
        float total = 0.0f;
        for (int y = 0; y < 32; y++) total += row_sums[y][threadIdx.x];
        job.dst[c] = job.accumulate ? job.dst[c] + total : total;
    }
}

// Adds up every sum gathered in `sums`, in one launch, and empties it.
static void sum_partials_flush(PartialSums* sums, cudaStream_t s) {
    if (sums->n == 0) return;
    int widest = 0;
    for (int i = 0; i < sums->n; i++) widest = sums->sum[i].C > widest ? sums->sum[i].C : widest;
    sum_partials_kernel<<<dim3(ceil_div(widest, 32), sums->n), dim3(32, 32), 0, s>>>(*sums);
    LAUNCH_CHECK();
    sums->n = 0;
}

// One sum of partial rows: gathered into `sums` for a later sum_partials_flush (which a full list
// gets at once), or, with sums NULL, added up now.
static void sum_partials(PartialSums* sums, float* dst, const float* partials, int n_partials, int C, int stride,
                         bool accumulate, cudaStream_t s) {
    PartialSums now = {};
    PartialSums* into = sums ? sums : &now;
    if (into->n == PARTIAL_SUMS_MAX) sum_partials_flush(into, s);
    into->sum[into->n++] = PartialSum{dst, partials, n_partials, C, stride, accumulate};
    if (!sums) sum_partials_flush(into, s);
}

// A block's own partial row, from the rows its threads summed into shared memory (visible after a
// __syncthreads): dst[c] = the sum over r < n_rows, in order, of rows[r * pitch + slot(c)], c < C.
template <typename Slot>
static __device__ __forceinline__ void block_partial_row(float* dst, const float* rows, int n_rows, int pitch, int C,
                                                         Slot slot) {
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int r = 0; r < n_rows; r++) sum += rows[r * pitch + slot(c)];
        dst[c] = sum;
    }
}

// Sum (or sum of squares) of a long fp32 vector in two fixed-shape passes: REDUCE_BLOCKS blocks
// each stride over the vector and write one partial; one block then adds the partials in order.
// `out` receives the total (accumulate = false) or has it added (accumulate = true). A thread reads
// four floats at a time (16 bytes: x must be 16-byte aligned, as every buffer of the plan is; the
// gradient norm is a pass over 4 bytes a parameter at memory speed), then the last n % 4 singly.
#define REDUCE_BLOCKS 512
template <bool SQUARE>
__global__ void reduce_partials_kernel(float* partials, const float* x, size_t n) {
    float sum = 0.0f;
    size_t n4 = n / 4, thread = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (size_t q = thread; q < n4; q += (size_t)gridDim.x * blockDim.x) {
        float4 v = ((const float4*)x)[q];
        sum += SQUARE ? (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w) : (v.x + v.y) + (v.z + v.w);
    }
    if (4 * n4 + thread < n) sum += SQUARE ? x[4 * n4 + thread] * x[4 * n4 + thread] : x[4 * n4 + thread];
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
// The master weights in two halves, and initialization: a counter-based normal RNG, so that every
// element's value depends only on the seed and its index (not on the launch shape).
//
// The optimizer updates fp32 master weights, and the model computes with their bf16 roundings.
// Read as an integer, a weight's fp32 bits are its bf16 rounding's 16 bits shifted up 16 places
// plus a small signed remainder. The bf16 half is the weight the model computes with (the flat
// `params` buffer), so beside it the optimizer keeps only the remainder, an int16 (`master_low`):
// 2 bytes a parameter instead of a 4-byte fp32 copy, and AdamW moves 28 bytes a parameter instead
// of 30. Nothing is lost: master_join gives back the very fp32 bits master_split was given, which
// is what checkpoints and exports store (doc/optimizers.md).
//
// The rounding is to nearest with ties away from zero, not ties to even. Adding 0x8000 to the bits
// and keeping the top 16 carries into the bf16's last place exactly when the 16 bits dropped are
// 0x8000 or more, for either sign (fp32 is sign and magnitude); the remainder, the bits less the
// bf16's shifted up, then lies in [-0x8000, 0x7FFF], an int16's range. Ties to even would need one
// value more (a tie rounded down leaves +0x8000). The two roundings differ on exact ties only, one
// weight in 2^17. A NaN stays a NaN (the carry could reach the sign bit), its payload not kept.
__host__ __device__ __forceinline__ bf16 master_split(float p, int16_t* low) {
    uint32_t bits;
    memcpy(&bits, &p, 4);
    uint32_t high = p != p ? (bits >> 16) | 0x40 : (bits + 0x8000u) >> 16;
    *low = (int16_t)(int32_t)(bits - (high << 16));
    __nv_bfloat16_raw raw;
    raw.x = (unsigned short)high;
    return bf16(raw);
}

__host__ __device__ __forceinline__ float master_join(bf16 w, int16_t low) {
    __nv_bfloat16_raw raw = w;
    uint32_t bits = ((uint32_t)raw.x << 16) + (uint32_t)(int32_t)low;
    float p;
    memcpy(&p, &bits, 4);
    return p;
}

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Master weights w[i], low[i] = mean + std * N(0, 1), the normal drawn by Box-Muller from the hash
// of (seed, first + i): element first + i of a tensor gets the same value whichever part of the
// tensor is initialized.
__global__ void init_normal_kernel(bf16* w, int16_t* low, size_t n, float mean, float std, uint64_t seed,
                                   size_t first) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = splitmix64(seed ^ splitmix64(first + i));
        float u1 = ((h >> 40) + 1) * (1.0f / 16777217.0f);  // in (0, 1]: log() stays finite
        float u2 = ((h >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
        w[i] = master_split(mean + std * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2), &low[i]);
    }
}

static void init_normal(bf16* w, int16_t* low, size_t n, float mean, float std, uint64_t seed, size_t first,
                        cudaStream_t s) {
    init_normal_kernel<<<1024, 256, 0, s>>>(w, low, n, mean, std, seed, first);
    LAUNCH_CHECK();
}

// y += x over n fp32 elements (ZeRO-2 adds each micro-batch's reduced gradients to its shard).
__global__ void add_into_kernel(float* y, const float* x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] += x[i];
}

static void add_into(float* y, const float* x, size_t n, cudaStream_t s) {
    add_into_kernel<<<1024, 256, 0, s>>>(y, x, n);
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

// Backward: dE[v, :] += sum over positions n with token[n] == v of dx[n, :]. Always +=: the
// embedding is tied to the output head, whose backward has written all of dE before this runs.
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

// The forward's two halves, shared with FP8's fused RMSNorm (lib/fp8.cuh), which must produce the
// very same rstd and values: rstd of one row x [C], by one warp (every lane gets it); y for 8
// channels of a row, rounded to bf16 as the forward stores it.
__device__ __forceinline__ float rmsnorm_rstd(const bf16* x, int C, float eps, int lane) {
    float sum_sq = 0.0f;
    for (int c = lane * 8; c < C; c += 32 * 8) {
        bf16x8 v = load8(x + c);
        for (int k = 0; k < 8; k++) {
            float f = __bfloat162float(v.v[k]);
            sum_sq += f * f;
        }
    }
    return rsqrtf(warp_sum(sum_sq) / C + eps);
}

__device__ __forceinline__ bf16x8 rmsnorm_apply8(const bf16x8& x, float r, const bf16x8& w) {
    bf16x8 y;
    for (int k = 0; k < 8; k++) y.v[k] = __float2bfloat16(__bfloat162float(x.v[k]) * r * __bfloat162float(w.v[k]));
    return y;
}

__global__ void rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* in, const bf16* weight,
                                       int N, int C, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const bf16* x = in + (size_t)row * C;
    float r = rmsnorm_rstd(x, C, eps, lane);
    for (int c = lane * 8; c < C; c += 32 * 8)
        store8(out + (size_t)row * C + c, rmsnorm_apply8(load8(x + c), r, load8(weight + c)));
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
// the contribution of the skip connection). With y not NULL the kernel also writes the forward's
// output y = x_hat * w again, for a layer that recomputes it (--recompute): it reads x and w
// anyway, and rmsnorm_apply8 on the saved rstd gives the very bits rmsnorm_forward stored, so the
// weight gradient that needs y runs after this kernel and no forward kernel reads x a second time.
// Each block takes `rows` consecutive rows (from rmsnorm_bwd_rows); each of its warps (4, or 8 on
// rows of 1024 channels or fewer: rmsnorm_bwd_warps) keeps its own fp32 dw row in shared memory,
// and the block writes their sum as its partial (sum_partials adds the blocks' partials in order).
// Lane l owns channels 256i + 8l + k (k < 8), which its 16-byte loads bring; in the warp's dw row
// channel 256i + 8l + k lies at 256i + 32k + l (rmsnorm_dw_slot), so that the 32 lanes adding their
// channel k hit 32 different banks (at 256i + 8l + k, 8 lanes shared each bank: 11.0M bank
// conflicts a launch at the default config, 0.35M now, and the launch 1-6% faster).
// The kernel is bound by memory latency, so it needs many warps in flight: 64 rows a block when
// that makes 512 blocks or more (the default config's 32768 rows), fewer down to 16 otherwise (at
// 1b's 8192 rows, 64 left 128 blocks of 4 warps for 132 SMs, at 0.9 TB/s: 5% of an FP8 step).
// Past 512 blocks more gain nothing: 16 rows a block at the default config (2048 blocks) ran as
// fast as 64 (doc/perf.md). More warps a block did: at the default config's rows of 768, 512
// blocks of 4 warps ran at 2.06 TB/s, of 8 warps at 2.41 (98 against 84 us a launch, H100); at
// medium's rows of 1024 the two were level, and at 1b's 2048 (16 rows a block, 2 a warp) 8 warps
// were 15% slower, the block's fixed work (its dw rows zeroed, summed and written) a larger share.
static int rmsnorm_bwd_rows(int N) {
    int rows = 64;
    while (rows > 16 && ceil_div(N, rows) < 512) rows /= 2;
    return rows;
}
static int rmsnorm_bwd_warps(int C) { return C <= 1024 ? 8 : 4; }
#define RMSNORM_MAX_C 8192  // the widest row: 4 warps keep one fp32 row each in shared memory (128 KiB)
// Where channel c (= 256i + 8l + k) of a warp's dw row lies: 256i + 32k + l. A row takes C rounded
// up to 256 floats.
static __device__ __forceinline__ int rmsnorm_dw_slot(int c) { return (c & ~255) | ((c & 7) << 5) | ((c >> 3) & 31); }
static __host__ __device__ int rmsnorm_dw_row(int C) { return (C + 255) / 256 * 256; }
__global__ void rmsnorm_backward_kernel(bf16* d_residual, float* dw_partials, bf16* y, const bf16* dy,
                                        const bf16* in, const bf16* weight, const float* rstd, int N, int C,
                                        int rows) {
    extern __shared__ float dw_warp[];  // [warps][rmsnorm_dw_row(C)], rmsnorm_dw_slot's order
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32, dw_row = rmsnorm_dw_row(C);
    float* my_dw = dw_warp + warp * dw_row;
    for (int c = lane; c < dw_row; c += 32) my_dw[c] = 0.0f;
    __syncwarp();
    int row_end = min(N, (blockIdx.x + 1) * rows);
    for (int row = blockIdx.x * rows + warp; row < row_end; row += warps) {
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
                my_dw[rmsnorm_dw_slot(c + k)] += dyk * x_hat;
            }
            store8(d_res + c, rv);
            if (y) store8(y + (size_t)row * C + c, rmsnorm_apply8(xv, r, wv));
        }
    }
    __syncthreads();
    block_partial_row(dw_partials + (size_t)blockIdx.x * C, dw_warp, warps, dw_row, C,
                      [](int c) { return rmsnorm_dw_slot(c); });
}

// dw_partials must hold ceil(N / rmsnorm_bwd_rows(N)) * C floats, left alone until d_weight's sum is
// added up: now (sums NULL) or at sums' flush; y is [N, C] or NULL.
static void rmsnorm_backward(bf16* d_residual, float* d_weight, float* dw_partials, bf16* y, const bf16* dy,
                             const bf16* in, const bf16* weight, const float* rstd, int N, int C, bool accumulate,
                             PartialSums* sums, cudaStream_t s) {
    int rows = rmsnorm_bwd_rows(N), blocks = ceil_div(N, rows), warps = rmsnorm_bwd_warps(C);
    size_t smem = warps * rmsnorm_dw_row(C) * sizeof(float);
    // once, for the widest row allowed (4 x 8192 floats, more than 8 warps' rows of at most 1024),
    // so no launch sets it again
    static bool configured = false;
    if (!configured) {
        int most = rmsnorm_bwd_warps(RMSNORM_MAX_C) * RMSNORM_MAX_C * (int)sizeof(float);
        CUDA_CHECK(cudaFuncSetAttribute(rmsnorm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
        configured = true;
    }
    rmsnorm_backward_kernel<<<blocks, 32 * warps, smem, s>>>(d_residual, dw_partials, y, dy, in, weight, rstd, N,
                                                             C, rows);
    LAUNCH_CHECK();
    sum_partials(sums, d_weight, dw_partials, blocks, C, C, accumulate, s);
}

// ----------------------------------------------------------------------------------------------
// Per-head QK RMSNorm followed by rotary position embedding (Qwen3), on the fused QKV rows.
//
// A row of qkv holds Hq query heads, then Hkv key heads, then Hkv value heads, D channels each.
// For each query and key head: a = w * x / rms(x) (w is q_norm or k_norm, length D), then the
// rotate-half RoPE at the row's position t pairs channel i with i + D/2 (i < D/2):
//   y[i]       = a[i] cos(t f_i) - a[i + D/2] sin(t f_i)
//   y[i + D/2] = a[i + D/2] cos(t f_i) + a[i] sin(t f_i),    f_i = theta^(-2i/D).
// qkv_rot has qkv's layout, but only its query and key heads are written: the value heads would be
// plain copies, so attention reads v from qkv itself (the same row stride) and their slots in
// qkv_rot stay unwritten (2 of the 10 heads a row at the default config: a fifth of the bytes). A
// (row, q or k head) task is D/16 lanes (8 at D = 128, 4 at D = 64), lane k of it owning the pairs
// i = 8k .. 8k+7: it reads and writes them 16 bytes at a time (x, w, and the fp32 tables rope_cos
// and rope_sin, [T, D/2]), and the task's lanes add up sum(x^2) by shuffles. (One warp per task,
// 2-byte accesses, ran at 2 TB/s.)

template <int D>
__global__ void qk_norm_rope_forward_kernel(bf16* qkv_rot, float* rstd, const bf16* qkv, const bf16* q_weight,
                                            const bf16* k_weight, const float* rope_cos, const float* rope_sin,
                                            int N, int T, int Hq, int Hkv, float eps) {
    constexpr int LANES = D / 16;
    const int H = Hq + 2 * Hkv, normed = Hq + Hkv, k = threadIdx.x % LANES, i0 = 8 * k;  // a row: H heads
    const size_t task = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / LANES;  // (row, q or k head)
    const bool live = task < (size_t)N * normed;  // every lane stays to the shuffles, past the last task too
    const int n = live ? (int)(task / normed) : 0, h = (int)(task % normed), t = n % T;
    const bf16* x = qkv + (size_t)n * H * D + h * D;
    bf16* y = qkv_rot + (size_t)n * H * D + h * D;
    bf16x8 lo = live ? load8(x + i0) : bf16x8{}, hi = live ? load8(x + i0 + D / 2) : bf16x8{};
    float sum_sq = 0.0f;
    for (int e = 0; e < 8; e++) {
        float a = __bfloat162float(lo.v[e]), b = __bfloat162float(hi.v[e]);
        sum_sq += a * a + b * b;
    }
    for (int offset = LANES / 2; offset > 0; offset >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    if (!live) return;
    float r = rsqrtf(sum_sq / D + eps);
    const bf16* w = h < Hq ? q_weight : k_weight;
    bf16x8 w_lo = load8(w + i0), w_hi = load8(w + i0 + D / 2), y_lo, y_hi;
    const float4* cos4 = reinterpret_cast<const float4*>(rope_cos + t * (D / 2) + i0);
    const float4* sin4 = reinterpret_cast<const float4*>(rope_sin + t * (D / 2) + i0);
    float4 cs[2] = {cos4[0], cos4[1]}, sn[2] = {sin4[0], sin4[1]};
    const float *c = &cs[0].x, *sv = &sn[0].x;  // the 8 pairs' cos and sin, in order
    for (int e = 0; e < 8; e++) {
        float a_lo = __bfloat162float(lo.v[e]) * r * __bfloat162float(w_lo.v[e]);
        float a_hi = __bfloat162float(hi.v[e]) * r * __bfloat162float(w_hi.v[e]);
        y_lo.v[e] = __float2bfloat16(a_lo * c[e] - a_hi * sv[e]);
        y_hi.v[e] = __float2bfloat16(a_hi * c[e] + a_lo * sv[e]);
    }
    store8(y + i0, y_lo);
    store8(y + i0 + D / 2, y_hi);
    if (k == 0) rstd[(size_t)n * (Hq + Hkv) + h] = r;
}

// Backward, in place on d_qkv: on entry its q and k heads hold dL/dy (attention's dq, dk), on exit
// dL/dx; the value heads are left as they are. RoPE is a rotation, so dL/da is dL/dy rotated back:
//   da[i] = dy[i] cos + dy[i + D/2] sin,   da[i + D/2] = dy[i + D/2] cos - dy[i] sin,
// and then, as for RMSNorm, with x_hat = x * rstd and g = da * w:
//   dx = rstd * (g - x_hat * mean(g * x_hat)),   dw += da * x_hat (summed over rows and heads).
// As in the forward, a (row, head) task is D/16 lanes, lane k owning channels i0 = 8k .. 8k+7 and
// their partners + D/2 in 16-byte accesses. One task's work, by its lanes (every lane of the warp
// calls it, live or not, for the shuffles): dy_lo, dy_hi its channels' dL/dy (read only when
// live); writes dx and puts da * x_hat of its 16 channels into dw (zeros when not live).
template <int D>
static __device__ __forceinline__ void qk_norm_rope_backward_task(bool live, const bf16x8& dy_lo, const bf16x8& dy_hi,
                                                                  bf16* dx, const bf16* x, const bf16* w, float r,
                                                                  const float* rope_cos, const float* rope_sin, int t,
                                                                  int i0, float (&dw)[16]) {
    float x_hat[16], g[16], dot = 0.0f;
    for (int e = 0; e < 16; e++) dw[e] = 0.0f;
    if (live) {
        bf16x8 x_lo = load8(x + i0), x_hi = load8(x + i0 + D / 2), w_lo = load8(w + i0), w_hi = load8(w + i0 + D / 2);
        const float4* cos4 = reinterpret_cast<const float4*>(rope_cos + t * (D / 2) + i0);
        const float4* sin4 = reinterpret_cast<const float4*>(rope_sin + t * (D / 2) + i0);
        float4 cs[2] = {cos4[0], cos4[1]}, sn[2] = {sin4[0], sin4[1]};
        const float *c = &cs[0].x, *sv = &sn[0].x;
        for (int e = 0; e < 8; e++) {
            float lo = __bfloat162float(dy_lo.v[e]), hi = __bfloat162float(dy_hi.v[e]);
            float da_lo = lo * c[e] + hi * sv[e], da_hi = hi * c[e] - lo * sv[e];
            x_hat[e] = __bfloat162float(x_lo.v[e]) * r;
            x_hat[8 + e] = __bfloat162float(x_hi.v[e]) * r;
            dw[e] = da_lo * x_hat[e];
            dw[8 + e] = da_hi * x_hat[8 + e];
            g[e] = da_lo * __bfloat162float(w_lo.v[e]);
            g[8 + e] = da_hi * __bfloat162float(w_hi.v[e]);
            dot += g[e] * x_hat[e] + g[8 + e] * x_hat[8 + e];
        }
    }
    for (int offset = D / 32; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (live) {
        const float mean_dot = dot / D;
        bf16x8 out_lo, out_hi;
        for (int e = 0; e < 8; e++) {
            out_lo.v[e] = __float2bfloat16(r * (g[e] - x_hat[e] * mean_dot));
            out_hi.v[e] = __float2bfloat16(r * (g[8 + e] - x_hat[8 + e] * mean_dot));
        }
        store8(dx + i0, out_lo);
        store8(dx + i0 + D / 2, out_hi);
    }
}

// The kernel over (row, head) tasks of heads first_head .. Hq+Hkv-1 (0: all; Hq: the key heads,
// when the query heads' run from dQ's accumulators, below), dL/dy read from d_qkv. Each block
// takes QK_BWD_TASKS consecutive tasks and writes one partial row of [dq_norm (D) | dk_norm (D)];
// a warp runs 32 / (D/16) tasks side by side (its slots); each lane sums its channels' dw over the
// tasks it runs, and the block adds those sums in a fixed order (warp, then slot) into its partial.
#define QK_BWD_TASKS 256
#define QK_BWD_WARPS 8
template <int D>
__global__ void qk_norm_rope_backward_kernel(bf16* d_qkv, float* dw_partials, const bf16* qkv, const float* rstd,
                                             const bf16* q_weight, const bf16* k_weight, const float* rope_cos,
                                             const float* rope_sin, int N, int T, int Hq, int Hkv, int first_head) {
    constexpr int LANES = D / 16, SLOTS = 32 / LANES;
    __shared__ float dw_slot[QK_BWD_WARPS * SLOTS][2 * D];  // 32 KB at D = 64 and at D = 128
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, k = lane % LANES, slot = lane / LANES, i0 = 8 * k;
    const int H = Hq + 2 * Hkv, heads = Hq + Hkv - first_head;
    float dw_q[16] = {0}, dw_k[16] = {0};  // channels i0 .. i0+7, then i0 + D/2 .. i0 + D/2 + 7
    const size_t begin = blockIdx.x * (size_t)QK_BWD_TASKS;
    const size_t task_end = min((size_t)N * heads, begin + QK_BWD_TASKS);
    for (size_t base = begin + warp * SLOTS; base < task_end; base += QK_BWD_WARPS * SLOTS) {  // the warp as one
        const size_t task = base + slot;
        const bool live = task < task_end;  // every lane stays to the shuffle
        const int n = live ? (int)(task / heads) : 0, h = first_head + (int)(task % heads), t = n % T;
        const bool is_q = h < Hq;
        bf16* dx = d_qkv + (size_t)n * H * D + h * D;
        const bf16x8 dy_lo = live ? load8(dx + i0) : bf16x8{}, dy_hi = live ? load8(dx + i0 + D / 2) : bf16x8{};
        float dw[16];
        qk_norm_rope_backward_task<D>(live, dy_lo, dy_hi, dx, qkv + (size_t)n * H * D + h * D,
                                      is_q ? q_weight : k_weight, live ? rstd[(size_t)n * (Hq + Hkv) + h] : 0.0f,
                                      rope_cos, rope_sin, t, i0, dw);
        for (int e = 0; e < 16; e++) {
            dw_q[e] += is_q ? dw[e] : 0.0f;
            dw_k[e] += is_q ? 0.0f : dw[e];
        }
    }
    float* mine = dw_slot[warp * SLOTS + slot];
    for (int e = 0; e < 8; e++) {
        mine[i0 + e] = dw_q[e];
        mine[i0 + D / 2 + e] = dw_q[8 + e];
        mine[D + i0 + e] = dw_k[e];
        mine[D + i0 + D / 2 + e] = dw_k[8 + e];
    }
    __syncthreads();
    block_partial_row(dw_partials + (size_t)blockIdx.x * 2 * D, &dw_slot[0][0], QK_BWD_WARPS * SLOTS, 2 * D, 2 * D,
                      [](int c) { return c; });
}

// The query heads' backward straight from attention's dQ accumulators (attention_backward with dq
// NULL), which saves the bf16 dq that its conversion would write and the kernel above read back: a
// block of 256 threads per (query tile of BM rows, b*Hq + h) loads the tile as attention's
// conversion does (attn_dq_tile_load: the same bf16 values), then runs the tile's rows, 256 / (D/16)
// at a time, from shared memory, and writes one partial row of dq_norm (D): its lanes' sums over
// their rows, added in a fixed order (row group by row group).
template <int D>
__global__ void __launch_bounds__(256)
    qk_norm_rope_backward_q_kernel(bf16* d_qkv, float* dw_partials, const float* dq_acc, float dq_scale,
                                   const bf16* qkv, const float* rstd, const bf16* q_weight, const float* rope_cos,
                                   const float* rope_sin, int T, int Hq, int Hkv) {
    constexpr int BM = attn_bwd_query_tile(D), PITCH = D + ATTN_DQ_PITCH_PAD, LANES = D / 16, GROUPS = 256 / LANES;
    __shared__ __align__(16) bf16 tile[BM * PITCH];
    __shared__ float dw_group[GROUPS][D];  // 16 KB at D = 64 and at D = 128
    const int m = blockIdx.x, bh = blockIdx.y, b = bh / Hq, h = bh % Hq, H = Hq + 2 * Hkv;
    const int group = threadIdx.x / LANES, i0 = 8 * (threadIdx.x % LANES);
    attn_dq_tile_load<D, BM>(tile, dq_acc, bh, m, gridDim.x * BM, dq_scale);  // gridDim.x: the query tiles
    __syncthreads();
    float dw_q[16] = {0};
    for (int r = group; r < BM; r += GROUPS) {  // BM is a multiple of GROUPS: every lane runs every round
        const int t = m * BM + r, n = b * T + t;
        const bool live = t < T;
        const bf16x8 dy_lo = *reinterpret_cast<const bf16x8*>(tile + r * PITCH + i0);
        const bf16x8 dy_hi = *reinterpret_cast<const bf16x8*>(tile + r * PITCH + i0 + D / 2);
        float dw[16];
        const size_t at = (size_t)n * H * D + h * D;
        qk_norm_rope_backward_task<D>(live, dy_lo, dy_hi, d_qkv + at, qkv + at, q_weight,
                                      live ? rstd[(size_t)n * (Hq + Hkv) + h] : 0.0f, rope_cos, rope_sin,
                                      live ? t : 0, i0, dw);
        for (int e = 0; e < 16; e++) dw_q[e] += dw[e];
    }
    for (int e = 0; e < 8; e++) {
        dw_group[group][i0 + e] = dw_q[e];
        dw_group[group][i0 + D / 2 + e] = dw_q[8 + e];
    }
    __syncthreads();
    block_partial_row(dw_partials + ((size_t)bh * gridDim.x + m) * D, &dw_group[0][0], GROUPS, D, D,
                      [](int c) { return c; });
}

static void qk_norm_rope_forward(bf16* qkv_rot, float* rstd, const bf16* qkv, const bf16* q_weight,
                                 const bf16* k_weight, const float* rope_cos, const float* rope_sin, int N, int T,
                                 int Hq, int Hkv, int D, float eps, cudaStream_t s) {
    size_t tasks = (size_t)N * (Hq + Hkv);
    int blocks = ceil_div(tasks * (D / 16), 256);
    if (D == 64)
        qk_norm_rope_forward_kernel<64><<<blocks, 256, 0, s>>>(qkv_rot, rstd, qkv, q_weight, k_weight, rope_cos,
                                                               rope_sin, N, T, Hq, Hkv, eps);
    else
        qk_norm_rope_forward_kernel<128><<<blocks, 256, 0, s>>>(qkv_rot, rstd, qkv, q_weight, k_weight, rope_cos,
                                                                rope_sin, N, T, Hq, Hkv, eps);
    LAUNCH_CHECK();
}

// The partial sums qk_norm_rope_backward needs, floats: the bf16 path's, or the accumulator path's
// (the key heads' blocks, then the query heads' tiles), whichever is more.
static size_t qk_norm_rope_backward_partials(int N, int T, int Hq, int Hkv, int D) {
    const size_t all_heads = (size_t)ceil_div((size_t)N * (Hq + Hkv), QK_BWD_TASKS) * 2 * D;
    const size_t q_tiles = (size_t)attn_bwd_query_tiles(T, D) * (N / T) * Hq;
    const size_t from_acc = (size_t)ceil_div((size_t)N * Hkv, QK_BWD_TASKS) * 2 * D + q_tiles * D;
    return all_heads > from_acc ? all_heads : from_acc;
}

// dw_partials: qk_norm_rope_backward_partials floats, left alone until the weights' sums are added
// up (now, sums NULL, or at sums' flush). dq_acc: NULL (the query heads' dL/dy in d_qkv), or
// attn_dq_acc of the scratch that attention_backward just ran on with dq NULL: then the query heads
// run from it (qk_norm_rope_backward_q_kernel) and the kernel above takes the key heads.
static void qk_norm_rope_backward(bf16* d_qkv, float* dq_weight, float* dk_weight, float* dw_partials,
                                  const bf16* qkv, const float* rstd, const bf16* q_weight, const bf16* k_weight,
                                  const float* rope_cos, const float* rope_sin, const float* dq_acc, int N, int T,
                                  int Hq, int Hkv, int D, bool accumulate, PartialSums* sums, cudaStream_t s) {
    const int first_head = dq_acc ? Hq : 0, blocks = ceil_div((size_t)N * (Hq + Hkv - first_head), QK_BWD_TASKS);
    auto kernel = D == 64 ? qk_norm_rope_backward_kernel<64> : qk_norm_rope_backward_kernel<128>;
    kernel<<<blocks, 32 * QK_BWD_WARPS, 0, s>>>(d_qkv, dw_partials, qkv, rstd, q_weight, k_weight, rope_cos, rope_sin,
                                                N, T, Hq, Hkv, first_head);
    LAUNCH_CHECK();
    sum_partials(sums, dk_weight, dw_partials + D, blocks, D, 2 * D, accumulate, s);
    if (!dq_acc) {
        sum_partials(sums, dq_weight, dw_partials, blocks, D, 2 * D, accumulate, s);
        return;
    }
    float* q_partials = dw_partials + (size_t)blocks * 2 * D;
    const dim3 tiles(attn_bwd_query_tiles(T, D), N / T * Hq);
    const float dq_scale = 1.f / sqrtf((float)D);  // attention's softmax scale, as its backward computes it
    auto q_kernel = D == 64 ? qk_norm_rope_backward_q_kernel<64> : qk_norm_rope_backward_q_kernel<128>;
    q_kernel<<<tiles, 256, 0, s>>>(d_qkv, q_partials, dq_acc, dq_scale, qkv, rstd, q_weight, rope_cos, rope_sin, T, Hq,
                                   Hkv);
    LAUNCH_CHECK();
    sum_partials(sums, dq_weight, q_partials, tiles.x * tiles.y, D, D, accumulate, s);
}

// ----------------------------------------------------------------------------------------------
// Attention: causal grouped-query self-attention, forward and backward: lib/attention.cuh (included
// at the top, since the QK norm's backward above reads the dQ that attention's backward leaves).

// ----------------------------------------------------------------------------------------------
// SwiGLU: a row of gate_up holds [gate (F) | up (F)]; out = silu(gate) * up, silu(g) = g sigmoid(g).
// Backward: d_gate = d_out * up * sigmoid(g) * (1 + g (1 - sigmoid(g))),  d_up = d_out * silu(g).

// Both directions for 8 channels, rounded to bf16 as the kernels store them. FP8's fused casts
// (lib/fp8.cuh) run the same functions and must store the very same values; our GEMM's epilogues
// (lib/matmul_hopper.cuh) too, one channel at a time where they hold two (swiglu1, then rounded).
__device__ __forceinline__ float swiglu1(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

__device__ __forceinline__ bf16x8 swiglu8(const bf16x8& g, const bf16x8& u) {
    bf16x8 y;
    for (int k = 0; k < 8; k++) y.v[k] = __float2bfloat16(swiglu1(__bfloat162float(g.v[k]), __bfloat162float(u.v[k])));
    return y;
}

__device__ __forceinline__ void swiglu_backward8(bf16x8* dg, bf16x8* du, const bf16x8& g, const bf16x8& u,
                                                 const bf16x8& dy) {
    for (int k = 0; k < 8; k++) {
        float gk = __bfloat162float(g.v[k]), uk = __bfloat162float(u.v[k]), dyk = __bfloat162float(dy.v[k]);
        float sig = 1.0f / (1.0f + __expf(-gk));
        dg->v[k] = __float2bfloat16(dyk * uk * sig * (1.0f + gk * (1.0f - sig)));
        du->v[k] = __float2bfloat16(dyk * gk * sig);
    }
}

__global__ void swiglu_forward_kernel(bf16* out, const bf16* gate_up, int N, int F) {
    size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * 8;
    if (i >= (size_t)N * F) return;
    size_t n = i / F, f = i % F;
    store8(out + i, swiglu8(load8(gate_up + n * 2 * F + f), load8(gate_up + n * 2 * F + F + f)));
}

__global__ void swiglu_backward_kernel(bf16* d_gate_up, const bf16* d_out, const bf16* gate_up, int N, int F) {
    size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * 8;
    if (i >= (size_t)N * F) return;
    size_t n = i / F, f = i % F;
    bf16x8 dg, du;
    swiglu_backward8(&dg, &du, load8(gate_up + n * 2 * F + f), load8(gate_up + n * 2 * F + F + f), load8(d_out + i));
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
// One block of CE_THREADS per row, two passes: the first finds the max and the sum of exponentials
// online (each thread over its own 8-wide vectors j = t, t + CE_THREADS, ... in that order, then
// combined across the block), the second overwrites the logits with their gradient.
// The row is read from memory once. The first pass also keeps the row's first n_cached vectors in
// shared memory and the second pass takes them from there; n_cached is the whole row when it fits
// in half an SM's shared memory (about 57K logits on an H100: GPT-2's 50304 fit, so two blocks
// share an SM and one's reductions and writes overlap the other's reads), and otherwise as much as
// fits; the rest of a longer row (Qwen3's 151936) is read again. Each thread keeps and takes back
// only its own vectors, so the cache needs no barrier. Each thread issues CE_UNROLL loads before it
// uses them, so enough bytes are in flight to run at memory speed. V is a multiple of 8 (16-byte
// vectors; config_check enforces it). Per-row losses go to `losses` for a deterministic sum later.
#define CE_THREADS 512  // a row's block; it fixes which logits each thread sums, and so the bits
#define CE_UNROLL 4     // vectors a thread loads before it uses the first

// One logit x into a thread's running max m and sum of exp(z - m) over the logits it has seen:
// when x is a new max, the sum so far is rescaled to it.
__device__ __forceinline__ void online_softmax_add(float x, float* m, float* sum) {
    if (x > *m) {
        *sum = *sum * __expf(*m - x) + 1.0f;
        *m = x;
    } else {
        *sum += __expf(x - *m);
    }
}

// dL/dz of one logit z, given the row's logsumexp: (softmax(z) - onehot) * d_loss.
__device__ __forceinline__ bf16 cross_entropy_grad(bf16 z, float lse, bool is_target, float d_loss) {
    float p = __expf(__bfloat162float(z) - lse);
    return __float2bfloat16((p - (is_target ? 1.0f : 0.0f)) * d_loss);
}

__global__ void __launch_bounds__(CE_THREADS, 2)
    cross_entropy_kernel(bf16* logits, float* losses, const int* targets, int V, int n_cached, float d_loss) {
    extern __shared__ bf16x8 row_cache[];  // [n_cached]: vector j holds logits 8j .. 8j + 7
    bf16* z = logits + (size_t)blockIdx.x * V;
    const int n_vec = V / 8, target = targets[blockIdx.x];
    const float z_target = __bfloat162float(z[target]);  // read before anyone overwrites it
    float m = -FLT_MAX, sum = 0.0f;
    for (int j0 = threadIdx.x; j0 < n_vec; j0 += CE_UNROLL * CE_THREADS) {
        bf16x8 v[CE_UNROLL];
#pragma unroll
        for (int u = 0; u < CE_UNROLL; u++)
            if (j0 + u * CE_THREADS < n_vec) v[u] = load8(z + 8 * (j0 + u * CE_THREADS));
#pragma unroll
        for (int u = 0; u < CE_UNROLL; u++) {
            const int j = j0 + u * CE_THREADS;
            if (j >= n_vec) break;
            if (j < n_cached) row_cache[j] = v[u];
            for (int k = 0; k < 8; k++) online_softmax_add(__bfloat162float(v[u].v[k]), &m, &sum);
        }
    }
    // Combine (m, sum) across the block: rescale every thread's sum to the block's max.
    const float row_max = block_max(m);
    float total = block_sum(sum * __expf(m - row_max));
    float lse = row_max + logf(total);
    if (threadIdx.x == 0) losses[blockIdx.x] = lse - z_target;
    for (int j0 = threadIdx.x; j0 < n_vec; j0 += CE_UNROLL * CE_THREADS) {
        bf16x8 v[CE_UNROLL];
#pragma unroll
        for (int u = 0; u < CE_UNROLL; u++) {
            const int j = j0 + u * CE_THREADS;
            if (j < n_vec) v[u] = j < n_cached ? row_cache[j] : load8(z + 8 * j);
        }
#pragma unroll
        for (int u = 0; u < CE_UNROLL; u++) {
            const int j = j0 + u * CE_THREADS;
            if (j >= n_vec) break;
            for (int k = 0; k < 8; k++) v[u].v[k] = cross_entropy_grad(v[u].v[k], lse, 8 * j + k == target, d_loss);
            store8(z + 8 * j, v[u]);
        }
    }
}

// The shared memory a block may keep its row in: half of an SM's, less what the system reserves
// per block and the block reductions' own slots, so that two blocks fit on an SM. Asked of the
// device once, which also allows the kernel that much (and prefers shared memory over L1: the rows
// stream through, nothing is read twice from L1).
static int cross_entropy_cache_bytes(void) {
    static int bytes = 0;
    if (!bytes) {
        int dev, per_sm, reserved;
        cudaFuncAttributes attr;
        CUDA_CHECK(cudaGetDevice(&dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
        CUDA_CHECK(cudaFuncGetAttributes(&attr, cross_entropy_kernel));
        bytes = (per_sm / 2 - reserved - (int)attr.sharedSizeBytes) / (int)sizeof(bf16x8) * (int)sizeof(bf16x8);
        CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        CUDA_CHECK(cudaFuncSetAttribute(cross_entropy_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
    }
    return bytes;
}

static void cross_entropy(bf16* logits, float* losses, const int* targets, int rows, int V, float d_loss,
                          cudaStream_t s) {
    const int n_cached = min(V / 8, cross_entropy_cache_bytes() / (int)sizeof(bf16x8));
    cross_entropy_kernel<<<rows, CE_THREADS, n_cached * sizeof(bf16x8), s>>>(logits, losses, targets, V, n_cached,
                                                                            d_loss);
    LAUNCH_CHECK();
}

// ----------------------------------------------------------------------------------------------
// The output head's loss without a pass over its logits (the BF16 head; train_gpt.cu's head_and_loss).
// The cross-entropy above reads the R x V logits a matmul wrote and writes dL/dlogits over them: a
// read and a write of 412 MB a chunk at the default config. Here the head's forward product
// (lib/matmul_hopper.cuh, hopper_logits_exp) writes in place of the logits z the exponentials
//   P[r][j] = exp(z[r][j] - c_r)
// for a shift c_r known before it runs: the target's own logit, x_r . E[t_r] (head_shift_kernel).
// Its epilogue also sums them per tile, all but the target's, whose exponent z[r][t] - c_r (about 0)
// it keeps. With O_r = the others' sum and S_r = exp(z[r][t] - c_r) + O_r = exp(lse_r - c_r):
//   loss_r       = lse_r - z[r][t] = log S_r - (z[r][t] - c_r)
//   dL/dz[r][j]  = d_loss (P[r][j] / S_r - [j == t_r])
// head_loss_kernel writes -O_r over the target's entry of P; call that P'. Then every entry of
// dL/dz_r is s_r P'[r][j] with s_r = d_loss / S_r (at the target: d_loss (p_t - 1) = -d_loss O_r / S_r),
// and the backward's two products take s without a pass over P':
//   dx = dL/dz E   = diag(s) (P' E)       s scales the R x C product (scale_rows)
//   dE += dL/dz^T x = P'^T (diag(s) x)    s scales the R x C input (x_scaled, head_loss_kernel)
// The target's entry is written, not subtracted later: for a confident prediction p_t - 1 is a small
// difference of near-equal numbers, and only the others' sum gives it to full precision.
// Why the target's logit as the shift: it is one of the row's terms, so S_r >= ~1 however far below
// the max every logit lies; and z - c_r exceeds a bound only when the token's loss does (loss >= max
// z - z[t]). The epilogue clamps the exponent at HOP_EXP_MAX (64: a loss past 64 nats, a model
// betting e^-64 against the target) and marks the row; head_loss_kernel remakes such a row from x and
// E itself, shifted by its own max (head_row_exact): slow, and exact, for a row that should never come.

// Part of a logit x . e (C a multiple of 8): the 8-wide vectors at c0, c0 + step, ... below C, in
// that order.
__device__ __forceinline__ float head_dot(const bf16* x, const bf16* e, int c0, int C, int step) {
    float dot = 0.0f;
    for (int c = c0; c < C; c += step) {
        const bf16x8 a = load8(x + c), b = load8(e + c);
        for (int k = 0; k < 8; k++) dot = fmaf(__bfloat162float(a.v[k]), __bfloat162float(b.v[k]), dot);
    }
    return dot;
}

// c[r] = x[r] . E[targets[r]] in fp32 (one warp a row, each lane every 32nd vector, then summed
// across the warp), and the row's overflow mark cleared for the product's epilogue.
__global__ void head_shift_kernel(float* shift, int* overflow, const bf16* x, const bf16* E, const int* targets, int R,
                                  int C) {
    const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= R) return;
    const float dot = warp_sum(head_dot(x + (size_t)r * C, E + (size_t)targets[r] * C, 8 * lane, C, 8 * 32));
    if (lane == 0) shift[r] = dot, overflow[r] = 0;
}

// A row the epilogue marked (some z - c past HOP_EXP_MAX), remade by the whole block from x_r and E:
// its logits (each thread every blockDim.x-th), their max m, then probs_r = exp(z - m) and, with the
// shift now m, the target's exponent and the others' sum. Twice the row's V x C products, by one
// block: only a row whose loss passes 64 nats comes here.
__device__ void head_row_exact(bf16* probs_r, float* target_z, float* others, const bf16* x_r, const bf16* E,
                               int target, int V, int C) {
    float m = -FLT_MAX;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, head_dot(x_r, E + (size_t)j * C, 0, C, 8));
    m = block_max(m);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float z = head_dot(x_r, E + (size_t)j * C, 0, C, 8) - m, p = __expf(z);
        probs_r[j] = __float2bfloat16(p);
        if (j == target) *target_z = z;  // the one thread that owns j writes it (shared memory)
        else sum += p;
    }
    *others = block_sum(sum);  // block_sum's barriers also publish *target_z
}

// One row r of a chunk (a block of HEAD_THREADS): the others' sum O from the epilogue's partials (in
// a fixed order), or the row remade; then loss, the row's scale s = d_loss / S (scale[r], for dx),
// x_scaled[r] = s x[r] (for dE), and -O over the target's entry of probs.
#define HEAD_THREADS 256
__global__ void __launch_bounds__(HEAD_THREADS)
    head_loss_kernel(float* losses, float* scale, bf16* x_scaled, bf16* probs, const float* partials,
                     const float* target_z, const int* overflow, const bf16* x, const bf16* E, const int* targets,
                     int n_tiles, int V, int C, float d_loss) {
    __shared__ float z_t;
    const int r = blockIdx.x, target = targets[r];
    const bf16* x_r = x + (size_t)r * C;
    float others = 0.0f;
    for (int k = threadIdx.x; k < n_tiles; k += blockDim.x) others += partials[(size_t)r * n_tiles + k];
    others = block_sum(others);
    if (threadIdx.x == 0) z_t = target_z[r];
    if (overflow[r]) head_row_exact(probs + (size_t)r * V, &z_t, &others, x_r, E, target, V, C);
    __syncthreads();
    const float S = expf(z_t) + others, s = d_loss / S;
    if (threadIdx.x == 0) {
        losses[r] = logf(S) - z_t;
        scale[r] = s;
        probs[(size_t)r * V + target] = __float2bfloat16(-others);
    }
    for (int c = 8 * threadIdx.x; c < C; c += 8 * blockDim.x) {
        bf16x8 v = load8(x_r + c);
        for (int k = 0; k < 8; k++) v.v[k] = __float2bfloat16(s * __bfloat162float(v.v[k]));
        store8(x_scaled + (size_t)r * C + c, v);
    }
}

// out[r][c] = bf16(scale[r] in[r][c]) over R x C (C a multiple of 8): the head's input gradient.
__global__ void scale_rows_kernel(bf16* out, const float* in, const float* scale, int R, int C) {
    const size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * 8;
    if (i >= (size_t)R * C) return;
    const float s = scale[i / C];
    const float4 a = *reinterpret_cast<const float4*>(in + i), b = *reinterpret_cast<const float4*>(in + i + 4);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    bf16x8 o;
    for (int k = 0; k < 8; k++) o.v[k] = __float2bfloat16(s * v[k]);
    store8(out + i, o);
}

static void head_shift(float* shift, int* overflow, const bf16* x, const bf16* E, const int* targets, int R, int C,
                       cudaStream_t s) {
    head_shift_kernel<<<ceil_div(R, 8), 256, 0, s>>>(shift, overflow, x, E, targets, R, C);
    LAUNCH_CHECK();
}

static void head_loss(float* losses, float* scale, bf16* x_scaled, bf16* probs, const float* partials,
                      const float* target_z, const int* overflow, const bf16* x, const bf16* E, const int* targets,
                      int R, int V, int C, int n_tiles, float d_loss, cudaStream_t s) {
    head_loss_kernel<<<R, HEAD_THREADS, 0, s>>>(losses, scale, x_scaled, probs, partials, target_z, overflow, x, E,
                                                targets, n_tiles, V, C, d_loss);
    LAUNCH_CHECK();
}

static void scale_rows(bf16* out, const float* in, const float* scale, int R, int C, cudaStream_t s) {
    scale_rows_kernel<<<ceil_div((size_t)R * C / 8, 256), 256, 0, s>>>(out, in, scale, R, C);
    LAUNCH_CHECK();
}

// ----------------------------------------------------------------------------------------------
// The optimizer: the learning-rate schedule and AdamW, fused with gradient clipping and the bf16
// copy of the weights. Everything a step needs lives on the device (OptimScalars below): a
// one-thread kernel advances the step and evaluates the schedule there, so the host never passes
// per-step values and a step can be replayed as a CUDA graph.

// --optimizer: which update rule the step runs (doc/optimizers.md says what each computes).
typedef enum { OPTIMIZER_ADAMW, OPTIMIZER_MUON, OPTIMIZER_ADAMW8BIT, N_OPTIMIZERS } OptimizerKind;
static const char* const OPTIMIZER_NAMES[N_OPTIMIZERS] = {"adamw", "muon", "adamw8bit"};

typedef struct {
    float lr, min_lr_frac, weight_decay, beta1, beta2, eps, grad_clip;
    int warmup_steps, total_steps;
    int wsd;            // 0: warmup then cosine to min_lr; 1: warmup, stable, then linear decay (WSD)
    float decay_frac;   // WSD: the last fraction of the steps that decays
    float muon_lr;      // Muon's peak learning rate for the hidden matrices (same schedule shape as lr)
    float muon_momentum;
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
    float muon_lr;                 // Muon's learning rate this step (the schedule with peak muon_lr)
} OptimScalars;

__global__ void optimizer_schedule_kernel(OptimScalars* s, OptimConfig o) {
    int step = s->step;
    s->lr = learning_rate(&o, step);
    OptimConfig muon = o;
    muon.lr = o.muon_lr;
    s->muon_lr = learning_rate(&muon, step);
    s->bias_corr1 = 1.0f - powf(o.beta1, (float)(step + 1));
    s->bias_corr2 = 1.0f - powf(o.beta2, (float)(step + 1));
    s->step = step + 1;
}

// Every parameter tensor starts on a PARAM_ALIGN-element boundary of the flat buffers (train_gpt's
// parameter table), so one flag byte per PARAM_ALIGN elements says how the optimizer treats them:
// whether weight decay applies, and (--optimizer muon) whether Muon rather than AdamW updates them.
#define PARAM_ALIGN 128
#define PARAM_FLAG_DECAY 1
#define PARAM_FLAG_MUON 2

// The gradient clip's factor, min(1, max_norm / ||grad||), from the norm on the device.
__device__ __forceinline__ float clip_scale_of(const OptimConfig& o, const OptimScalars* s) {
    float norm = sqrtf(s->grad_norm_sq);
    return (o.grad_clip > 0.0f && norm > o.grad_clip) ? o.grad_clip / norm : 1.0f;
}

// With g = grad * clip_scale_of(...):
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + lr * wd * p     (decoupled decay)
// for the n elements the pointers start at, wd = weight_decay where flags[i / PARAM_ALIGN] has
// PARAM_FLAG_DECAY (so a range must start on a PARAM_ALIGN boundary, as every tensor and every ZeRO
// piece does). Elements flagged PARAM_FLAG_MUON are left alone: Muon updates them.
//
// One element of the update above: its moments m and v in place, its new fp32 weight returned. The
// one place the formula is written: the fp32 and the 8-bit kernels both call it, so they agree to
// the bit on the same moments.
__device__ __forceinline__ float adamw_element(float g, float p, float* m, float* v, float wd, const OptimConfig& o,
                                               float lr, float bias_corr1, float bias_corr2) {
    *m = o.beta1 * *m + (1.0f - o.beta1) * g;
    *v = o.beta2 * *v + (1.0f - o.beta2) * g * g;
    return p - lr * ((*m / bias_corr1) / (sqrtf(*v / bias_corr2) + o.eps) + wd * p);
}

// adamw_element on four consecutive elements held as float4s (g the clipped gradient), the way
// both vector paths run it: adamw_kernel below and FP8's update that makes the weights
// (fp8_adamw_kernel, lib/fp8.cuh), which must store the same bits.
__device__ __forceinline__ void adamw4(float4 g, float4* m, float4* v, float4* p, float wd, const OptimConfig& o,
                                       float lr, float bias_corr1, float bias_corr2) {
    float *gk = &g.x, *mk = &m->x, *vk = &v->x, *pk = &p->x;
    for (int k = 0; k < 4; k++) pk[k] = adamw_element(gk[k], pk[k], &mk[k], &vk[k], wd, o, lr, bias_corr1, bias_corr2);
}

__device__ __forceinline__ float4 scaled4(float4 x, float a) { return make_float4(x.x * a, x.y * a, x.z * a, x.w * a); }

// Four consecutive master weights (the section on initialization says how they are held): their
// bf16 halves in one 8-byte load, their low halves in another.
__device__ __forceinline__ float4 master_load4(const bf16* params, const int16_t* low, size_t q) {
    uint2 w = ((const uint2*)params)[q], l = ((const uint2*)low)[q];
    const bf16* wk = (const bf16*)&w;
    const int16_t* lk = (const int16_t*)&l;
    return make_float4(master_join(wk[0], lk[0]), master_join(wk[1], lk[1]), master_join(wk[2], lk[2]),
                       master_join(wk[3], lk[3]));
}

// The reverse: four new master weights stored in their two halves, 8-byte stores each. Returns the
// bf16 halves, as pairs, for FP8's update that casts them (fp8_adamw_kernel, lib/fp8.cuh).
typedef union {
    __nv_bfloat162 pair[2];
    uint2 bytes;
} Bf16x4;
__device__ __forceinline__ Bf16x4 master_store4(float4 p, bf16* params, int16_t* low, size_t q) {
    union {
        int16_t k[4];
        uint2 bytes;
    } lows;
    __nv_bfloat162 xy = {master_split(p.x, &lows.k[0]), master_split(p.y, &lows.k[1])};
    __nv_bfloat162 zw = {master_split(p.z, &lows.k[2]), master_split(p.w, &lows.k[3])};
    Bf16x4 w = {{xy, zw}};
    ((uint2*)params)[q] = w.bytes;
    ((uint2*)low)[q] = lows.bytes;
    return {{xy, zw}};  // built again: a union of bf16 pairs has no copy constructor to return w with
}

// Four consecutive elements a thread: 16-byte loads and stores (8 bytes for either half of the
// master weights), so that more bytes are in flight per thread; the kernel moves 28 bytes a
// parameter and is bound by memory bandwidth (15% of a 1b FP8 step). The four share one flag
// (PARAM_ALIGN is a multiple of 4, and a range starts on a PARAM_ALIGN boundary, so the vectors
// are aligned too); a range's last n % 4 elements are done one by one, by the n % 4 threads after
// the groups' (adamw_step gives each group and each of those a thread).
__global__ void adamw_kernel(bf16* params, int16_t* master_low, const float* grads, float* m, float* v,
                             const uint8_t* flags, size_t n, OptimConfig o, const OptimScalars* s) {
    float clip_scale = clip_scale_of(o, s);
    float lr = s->lr, bias_corr1 = s->bias_corr1, bias_corr2 = s->bias_corr2;
    size_t n4 = n / 4, q = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (q < n4) {
        uint8_t flag = flags[q * 4 / PARAM_ALIGN];
        if (flag & PARAM_FLAG_MUON) return;
        float wd = (flag & PARAM_FLAG_DECAY) ? o.weight_decay : 0.0f;
        float4 mq = ((float4*)m)[q], vq = ((float4*)v)[q], p = master_load4(params, master_low, q);
        adamw4(scaled4(((const float4*)grads)[q], clip_scale), &mq, &vq, &p, wd, o, lr, bias_corr1, bias_corr2);
        ((float4*)m)[q] = mq;
        ((float4*)v)[q] = vq;
        master_store4(p, params, master_low, q);
        return;
    }
    size_t i = 4 * n4 + (q - n4);  // the tail: fewer than 4
    if (i < n && !(flags[i / PARAM_ALIGN] & PARAM_FLAG_MUON)) {
        float wd = (flags[i / PARAM_ALIGN] & PARAM_FLAG_DECAY) ? o.weight_decay : 0.0f;
        float p = adamw_element(grads[i] * clip_scale, master_join(params[i], master_low[i]), &m[i], &v[i], wd, o, lr,
                                bias_corr1, bias_corr2);
        params[i] = master_split(p, &master_low[i]);
    }
}

// An optimizer step is one optimizer_schedule (the step's learning rate and bias corrections),
// then adamw_step (or adamw8bit_step; with Muon also muon_matrix_step per hidden matrix) over one
// or more ranges of the flat buffers (the trainer updates bucket by bucket, so that each bucket's
// new weights can be sent while the next is updated): each pointer points at the range's first
// element, and params, the master weights' bf16 halves, may be elsewhere than the others (ZeRO
// keeps a rank's bf16 piece in its place in the full buffer, its low halves, moments and gradients
// in the rank's own). The gradient norm must already be in s->grad_norm_sq.
static void optimizer_schedule(const OptimConfig* o, OptimScalars* s, cudaStream_t stream) {
    optimizer_schedule_kernel<<<1, 1, 0, stream>>>(s, *o);
    LAUNCH_CHECK();
}

// One thread for each group of four elements (and one for each of the tail's), 256 threads a
// block, so 1024 elements a block: the blocks come and go as the GPU takes them. A grid of one wave
// of resident blocks striding over the range, each thread one group after another, moved the same
// bytes 8% slower: at 1b's 1.08 billion parameters 10.8 ms against 10.0 (2.79 against 3.01 TB/s,
// H100; doc/perf.md).
static void adamw_step(bf16* params, int16_t* master_low, const float* grads, float* m, float* v, const uint8_t* flags,
                       size_t n, const OptimConfig* o, const OptimScalars* s, cudaStream_t stream) {
    if (n == 0) return;
    int grid = ceil_div(n / 4 + n % 4, 256);
    adamw_kernel<<<grid, 256, 0, stream>>>(params, master_low, grads, m, v, flags, n, *o, s);
    LAUNCH_CHECK();
}

// ----------------------------------------------------------------------------------------------
// 8-bit AdamW (--optimizer adamw8bit): both moments stored as one byte per element plus one fp32
// scale (the block's absolute maximum) per Q8_BLOCK elements: 2 + 8/128 bytes per parameter
// instead of 8. The update itself is AdamW's, in fp32, on the fp32 master weights.
//
// Block size: Q8_BLOCK = PARAM_ALIGN = 128. Every tensor and every ZeRO piece starts on such a
// boundary, so no block straddles two tensors (a block's scale never mixes an embedding row's
// moments with a norm's) or two ZeRO pieces: a piece's state is a plain range of codes and scales,
// and resharding a checkpoint stays a matter of ranges. Small blocks also keep an outlier from
// flattening its neighbours (bitsandbytes uses 256 to 2048; smaller is more precise, and 128 costs
// 4/128 bytes per element per moment).
//
// The map (one table of 256 values per moment, built on the host, the same table on both sides):
// a "dynamic exponent" code, as in Dettmers et al. 2022's dynamic tree quantization. The leading
// zeros of the code's magnitude bits choose a decade, the bits after the first one a linear
// fraction within it:  value = 10^-k * (0.1 + 0.9 (f + 1) / 2^r), with k leading zeros, r bits
// left after the leading one, f their value; code 0 is 0. So the top decade [0.1, 1] gets the
// most codes (relative spacing ~1%) and each decade below half as many, down to 10^-7 (v, 8
// magnitude bits) or 10^-6 (m, sign + 7 bits). m is signed and roughly symmetric. The second
// moment is stored as its root r = sqrt(v), unsigned: v ~ g^2 spans twice the decades of g within
// a block, and a v rounded to 0 while m is not makes m / (sqrt(v) + eps) explode (the CPU test
// test_adamw8bit_tracks_adamw saw exactly that, storing v itself, when a block's gradients spread
// over 4 decades); r's 7 decades cover gradients 10^7 apart, and r's relative rounding error is
// the update's. A linear map would round most of a block to 0. Quantizing is rounding to the
// nearest table value (ties down) of |x| / absmax.
#define Q8_BLOCK PARAM_ALIGN

typedef struct {
    float m[256];  // signed: code c < 128 is +mag[c], 128 + c is -mag[c]
    float v[256];  // unsigned, increasing (for sqrt(v))
} Q8Maps;

// The magnitude table of `bits` bits (7 for m, 8 for v): increasing, t[0] = 0, t[2^bits - 1] = 1.
static void q8_magnitudes(float* t, int bits) {
    t[0] = 0.0f;
    for (int c = 1; c < (1 << bits); c++) {
        int lead = bits - 1;  // the position of the highest set bit
        while (!(c >> lead & 1)) lead--;
        int k = bits - 1 - lead, r = lead, f = c & ((1 << r) - 1);
        t[c] = (float)(pow(10.0, -k) * (0.1 + 0.9 * (f + 1) / (double)(1 << r)));
    }
}

static const Q8Maps* q8_maps(void) {
    static Q8Maps maps;
    static bool built = false;
    if (!built) {
        q8_magnitudes(maps.m, 7);
        for (int c = 0; c < 128; c++) maps.m[128 + c] = -maps.m[c];
        q8_magnitudes(maps.v, 8);
        built = true;
    }
    return &maps;
}

// The code of the table value nearest to a in [0, 1] among t[0..n) (increasing), ties to the lower.
// Compares and subtractions only: the same result on the host and the device.
__host__ __device__ static inline int q8_nearest(const float* t, int n, float a) {
    int lo = 0, hi = n - 1;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (t[mid] <= a) lo = mid;
        else hi = mid;
    }
    return a - t[lo] <= t[hi] - a ? lo : hi;
}

// x as a code of `map` (Q8Maps.m when is_signed, else Q8Maps.v) relative to absmax >= |x|.
// The division is correctly rounded on the device too (--use_fast_math would otherwise make it
// approximate), so the codes match a CPU's bit for bit.
__host__ __device__ static inline uint8_t q8_encode(float x, float absmax, const float* map, bool is_signed) {
    if (!(absmax > 0.0f)) return 0;
#ifdef __CUDA_ARCH__
    float a = __fdiv_rn(fabsf(x), absmax);
#else
    float a = fabsf(x) / absmax;
#endif
    a = a > 1.0f ? 1.0f : a;
    if (!is_signed) return (uint8_t)q8_nearest(map, 256, a);
    int c = q8_nearest(map, 128, a);
    return (uint8_t)(x < 0.0f && c ? 128 | c : c);
}

__host__ __device__ static inline float q8_decode(uint8_t code, float absmax, const float* map) {
    return map[code] * absmax;
}

// One thread block of Q8_BLOCK threads per quantization block (grid-stride over the blocks):
// each thread dequantizes its element's m and r = sqrt(v) (code value * the block's absmax), runs
// AdamW's update in fp32 as adamw_kernel does, writes the master weight's two halves; then
// the block takes the new absmax of |m| and of r, and every thread requantizes its element.
// n is a multiple of Q8_BLOCK (every range the trainer passes is).
__global__ void __launch_bounds__(Q8_BLOCK) adamw8bit_kernel(bf16* params, int16_t* master_low, const float* grads,
                                                             uint8_t* qm, uint8_t* qv, float* absmax_m,
                                                             float* absmax_v, const uint8_t* flags, size_t n_blocks,
                                                             OptimConfig o, const OptimScalars* s, Q8Maps maps) {
    __shared__ float map_m[256], map_v[256];
    for (int i = threadIdx.x; i < 256; i += Q8_BLOCK) map_m[i] = maps.m[i], map_v[i] = maps.v[i];
    __syncthreads();
    float clip_scale = clip_scale_of(o, s);
    float lr = s->lr, bias_corr1 = s->bias_corr1, bias_corr2 = s->bias_corr2;
    for (size_t b = blockIdx.x; b < n_blocks; b += gridDim.x) {
        size_t i = b * Q8_BLOCK + threadIdx.x;
        float g = grads[i] * clip_scale;
        float mi = q8_decode(qm[i], absmax_m[b], map_m), ri = q8_decode(qv[i], absmax_v[b], map_v), vi = ri * ri;
        float wd = (flags[b] & PARAM_FLAG_DECAY) ? o.weight_decay : 0.0f;
        float p = adamw_element(g, master_join(params[i], master_low[i]), &mi, &vi, wd, o, lr, bias_corr1, bias_corr2);
        params[i] = master_split(p, &master_low[i]);
        ri = sqrtf(vi);
        float am = block_max(fabsf(mi)), av = block_max(ri);
        qm[i] = q8_encode(mi, am, map_m, true);
        qv[i] = q8_encode(ri, av, map_v, false);
        if (threadIdx.x == 0) absmax_m[b] = am, absmax_v[b] = av;
    }
}

// adamw_step's 8-bit twin over n elements (a multiple of Q8_BLOCK); absmax_m, absmax_v and flags
// point at the range's first block.
static void adamw8bit_step(bf16* params, int16_t* master_low, const float* grads, uint8_t* qm, uint8_t* qv,
                           float* absmax_m, float* absmax_v, const uint8_t* flags, size_t n, const OptimConfig* o,
                           const OptimScalars* s, cudaStream_t stream) {
    size_t n_blocks = n / Q8_BLOCK;
    int grid = n_blocks < 8192 ? (int)n_blocks : 8192;
    if (grid == 0) return;
    adamw8bit_kernel<<<grid, Q8_BLOCK, 0, stream>>>(params, master_low, grads, qm, qv, absmax_m, absmax_v, flags,
                                                     n_blocks, *o, s, *q8_maps());
    LAUNCH_CHECK();
}

// The quantization round trip alone (tests): codes of x (n a multiple of Q8_BLOCK) with each
// block's absmax, signed (m's map) or not (v's).
__global__ void q8_quantize_kernel(uint8_t* codes, float* absmax, const float* x, size_t n_blocks, bool is_signed,
                                   Q8Maps maps) {
    __shared__ float map[256];
    for (int i = threadIdx.x; i < 256; i += Q8_BLOCK) map[i] = is_signed ? maps.m[i] : maps.v[i];
    __syncthreads();
    for (size_t b = blockIdx.x; b < n_blocks; b += gridDim.x) {
        size_t i = b * Q8_BLOCK + threadIdx.x;
        float a = block_max(fabsf(x[i]));
        codes[i] = q8_encode(x[i], a, map, is_signed);
        if (threadIdx.x == 0) absmax[b] = a;
    }
}

static void q8_quantize(uint8_t* codes, float* absmax, const float* x, size_t n, bool is_signed, cudaStream_t stream) {
    q8_quantize_kernel<<<1024, Q8_BLOCK, 0, stream>>>(codes, absmax, x, n / Q8_BLOCK, is_signed, *q8_maps());
    LAUNCH_CHECK();
}

// ----------------------------------------------------------------------------------------------
// Matmuls through cuBLASLt.
//
// Every matmul of the model has one of three row-major forms, for a linear layer y = x W^T with
// x [N, I], W [O, I] (PyTorch's layout: one row per output feature) and y [N, O]:
//   forward          y  = x W^T (+ residual)           bf16 out
//   backward input   dx = dy W                         bf16 out
//   backward weight  dW  = dy^T x, or += (beta = 1)    fp32 out
// cuBLASLt is column-major, and a row-major matrix is its column-major transpose, so each form
// becomes one column-major call (the comments give the mapping). matmul() is the one place that
// talks to cuBLASLt, for every operand type: bf16 and fp32, and FP8 (E4M3, E5M2) with a scale per
// tensor. cuBLASLt's FP8 kernels take only the "TN" form (trans_a and not trans_b) and want every
// leading dimension a multiple of 16 bytes; the per-tensor scales are device pointers, so nothing
// about them ever goes through the host. Measured on an H100 with CUDA 13's cuBLASLt: a scale or
// amax pointer must be 16-byte aligned (else the call is "not supported"), and an amax is
// computed only for an FP8 result. matmul() checks both rules and says so in one line.
//
// FP8 products may also run with fast accumulation (cuBLASLt's FAST_ACCUM): the tensor cores'
// narrower accumulators are then never promoted to fp32 along k, which is faster and less
// exact; train_gpt offers it for the forward products only (--fp8-fast-accum, doc/fp8.md).
//
// Descriptors, layouts and the choice of algorithm are made once per shape and kept in a plan; a
// call finds its plan, sets the scale pointers, and launches.
//
// The choice. cuBLASLt's heuristic ranks its algorithms for a shape by a model of the GPU, and its
// first is not always the fastest at our shapes (doc/perf.md, "cuBLASLt's candidates"). Tuning
// (train_gpt's --matmul-tune, over its warm-up steps) goes in two phases, g_matmul_tune:
//  - MATMUL_TUNE_CHECK (the first step): a shape's first call outside a graph capture runs each of
//    the heuristic's candidates once on the call's own operands and keeps those whose result has
//    the same bits as the first's (a fingerprint of D over every byte). A candidate that sums in
//    another order (split-K, mostly) is never taken, so tuning never changes a number: runs
//    repeat, resume and match the references bit for bit whichever candidate the clock favours.
//  - MATMUL_TUNE_TIME (the next steps): each shape's calls run in turn on those candidates, each
//    between two events, inside real steps: the operands, caches and power-capped clocks the step
//    will have. (Timed alone, back to back, candidates rank otherwise: at the 1b config the
//    alone-fastest made the step 0.8% slower.)
// matmul_tune_finish() closes tuning: a shape takes the candidate with the least mean time if it
// beats the heuristic's first by MATMUL_TUNE_MARGIN. A kernel's time is not all it costs: the card
// runs at its power limit, so a faster kernel that draws more power slows the others. Taking every
// win, however small, left the 1b step up to 0.7% slower; the margin keeps the clear ones (the
// default config's head and QKV forward products, 12-16% faster in the step).
//
// Two products do not come here: the BF16 gate/up forward and the BF16 down input gradient, whose
// SwiGLU and SwiGLU backward our own Hopper GEMM computes in its epilogue (lib/matmul_hopper.cuh;
// train_gpt.cu's mlp_gate_up and mlp_down_backward; doc/matmul.md).

// One operand of a matmul: where it is, its element type, and for FP8 the device pointer of the
// factor that turns its stored values into real ones (NULL: unscaled). For the result it is the
// other way round: `scale` multiplies (an FP8 result is stored as real * scale), and `amax`, when
// not NULL, receives max |real| over the result, before that scale.
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
    int trans_a, trans_b, has_c, scale_a, scale_b, scale_d, amax_d, fast_accum;
    int a_type, b_type, d_type;  // cudaDataType_t
} MatmulKey;

#define MATMUL_CANDIDATES 8  // the heuristic's first 8 (it offers no more at our shapes)

typedef struct {
    MatmulKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t layout_a, layout_b, layout_c, layout_d;
    cublasLtMatmulAlgo_t algo;                           // what a call runs, but while tuning times candidates
    cublasLtMatmulAlgo_t candidates[MATMUL_CANDIDATES];  // the heuristic's, best first
    int n_candidates;
    int same[MATMUL_CANDIDATES];   // the candidates with candidate 0's bits (same[0] = 0), n_same of them;
    int n_same;                    // 0 until tuning has run each once on a call's operands
    int n_timed;                   // calls timed so far; candidate same[n_timed % n_same] runs next
    double ms_sum[MATMUL_CANDIDATES];  // per candidate: the timed calls' total, and their count
    int n_samples[MATMUL_CANDIDATES];
    int chosen;                 // index of algo among the candidates once tuning has finished; -1 before
    float us_first, us_chosen;  // mean time of a call with candidate 0 and with the chosen one
} MatmulPlan;

// One timed call while tuning is open: which plan and candidate, between which events (made with
// the slot's first use, and kept for the slot's next: matmul_free destroys them).
typedef struct {
    MatmulPlan* plan;
    int candidate;
    cudaEvent_t start, stop;
} MatmulSample;
#define MATMUL_MAX_SAMPLES 4096  // beyond these, calls run untimed (medium's warm-up times about 700)

#define MATMUL_MAX_PLANS 256
static cublasLtHandle_t g_cublaslt;
static void* g_cublaslt_workspace;
static const size_t CUBLASLT_WORKSPACE_BYTES = 32u << 20;
static MatmulPlan g_plans[MATMUL_MAX_PLANS];
static int g_n_plans;
typedef enum { MATMUL_TUNE_OFF, MATMUL_TUNE_CHECK, MATMUL_TUNE_TIME } MatmulTunePhase;  // above
static MatmulTunePhase g_matmul_tune;  // OFF: calls run the heuristic's first, or what tuning chose
#define MATMUL_TUNE_MARGIN 0.03f       // how much faster than the heuristic's first a candidate must be
static MatmulSample g_samples[MATMUL_MAX_SAMPLES];
static int g_n_samples;

static void matmul_init(void) {
    CUBLAS_CHECK(cublasLtCreate(&g_cublaslt));
    CUDA_CHECK(cudaMalloc(&g_cublaslt_workspace, CUBLASLT_WORKSPACE_BYTES));
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
    MatmulPlan p = {};  // untuned: no candidate checked or timed yet
    p.key = *key;
    const int m = key->m, n = key->n, k = key->k;
    cublasOperation_t op_a = key->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = key->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    const int8_t fast_accum = 1;
    if (key->fast_accum)
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
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
    cublasLtMatmulHeuristicResult_t results[MATMUL_CANDIDATES];
    int n_results = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(g_cublaslt, p.desc, p.layout_a, p.layout_b, p.layout_c, p.layout_d,
                                                pref, MATMUL_CANDIDATES, results, &n_results));
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (n_results == 0) {
        fprintf(stderr, "cuBLASLt has no algorithm for a %dx%dx%d matmul (trans %d%d, types %d %d -> %d)\n", m, n, k,
                key->trans_a, key->trans_b, (int)key->a_type, (int)key->b_type, (int)key->d_type);
        exit(1);
    }
    p.n_candidates = n_results;
    for (int i = 0; i < n_results; i++) p.candidates[i] = results[i].algo;
    p.algo = p.candidates[0];
    p.chosen = -1;
    return p;
}

// A 64-bit fingerprint of n 4-byte words (a result's size is a multiple of 4 bytes: its rows are
// multiples of 8 elements): the sum, mod 2^64, of each word mixed with its index (splitmix64's
// finalizer). Integer sums commute, so the atomics leave it the same every run; two results that
// differ anywhere differ here but with probability about 2^-64.
__device__ unsigned long long g_fingerprint;

__global__ void fingerprint_kernel(const uint32_t* words, size_t n) {
    unsigned long long h = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned long long z = ((unsigned long long)i << 32 | words[i]) + 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        h += z ^ (z >> 31);
    }
    for (int offset = 16; offset > 0; offset >>= 1) h += __shfl_xor_sync(0xffffffffu, h, offset);
    if (threadIdx.x % 32 == 0) atomicAdd(&g_fingerprint, h);
}

static unsigned long long fingerprint(const void* p, size_t bytes, cudaStream_t s) {
    const unsigned long long zero = 0;
    CUDA_CHECK(cudaMemcpyToSymbolAsync(g_fingerprint, &zero, sizeof(zero), 0, cudaMemcpyHostToDevice, s));
    fingerprint_kernel<<<264, 256, 0, s>>>((const uint32_t*)p, bytes / 4);
    CUDA_CHECK(cudaGetLastError());
    unsigned long long h;
    CUDA_CHECK(cudaMemcpyFromSymbolAsync(&h, g_fingerprint, sizeof(h), 0, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    return h;
}

// Everything one cublasLtMatmul call takes but the algorithm.
typedef struct {
    const MatmulPlan* plan;
    const float* alpha;
    const void *a, *b;
    const float* beta;
    const void *c, *d;
    cudaStream_t stream;
} MatmulCall;

static cublasStatus_t matmul_run(const MatmulCall* call, const cublasLtMatmulAlgo_t* algo) {
    const MatmulPlan* p = call->plan;
    return cublasLtMatmul(g_cublaslt, p->desc, call->alpha, call->a, p->layout_a, call->b, p->layout_b, call->beta,
                          call->c, p->layout_c, (void*)call->d, p->layout_d, algo, g_cublaslt_workspace,
                          CUBLASLT_WORKSPACE_BYTES, call->stream);
}

// Tuning's first part (above): runs every candidate once on this call's operands and keeps in
// plan->same those whose result has candidate 0's bits. D is written many times; where it is also
// C (an accumulating call) its bytes are kept on the host and put back before each run and at the
// end, so the call that follows sees what it would have seen without tuning.
static void matmul_check_candidates(MatmulPlan* plan, const MatmulCall* call, size_t d_bytes) {
    void* saved = NULL;
    if (call->c == call->d && *call->beta != 0.0f) {
        saved = xmalloc(d_bytes);
        CUDA_CHECK(cudaMemcpyAsync(saved, call->d, d_bytes, cudaMemcpyDeviceToHost, call->stream));
    }
    unsigned long long reference = 0;
    plan->n_same = 0;
    for (int i = 0; i < plan->n_candidates; i++) {
        if (saved) CUDA_CHECK(cudaMemcpyAsync((void*)call->d, saved, d_bytes, cudaMemcpyHostToDevice, call->stream));
        cublasStatus_t status = matmul_run(call, &plan->candidates[i]);
        if (i == 0) CUBLAS_CHECK(status);  // the heuristic's first must run: it is what untuned calls take
        if (status != CUBLAS_STATUS_SUCCESS) continue;
        unsigned long long h = fingerprint(call->d, d_bytes, call->stream);
        if (i == 0) reference = h;
        if (h == reference) plan->same[plan->n_same++] = i;
    }
    if (saved) {
        CUDA_CHECK(cudaMemcpyAsync((void*)call->d, saved, d_bytes, cudaMemcpyHostToDevice, call->stream));
        CUDA_CHECK(cudaStreamSynchronize(call->stream));
        free(saved);
    }
}

// Tuning's second part: this call runs the plan's next candidate in turn, between two events.
static void matmul_timed_run(MatmulPlan* plan, const MatmulCall* call) {
    if (g_n_samples == MATMUL_MAX_SAMPLES) {
        CUBLAS_CHECK(matmul_run(call, &plan->algo));
        return;
    }
    MatmulSample* sample = &g_samples[g_n_samples++];
    sample->plan = plan;
    sample->candidate = plan->same[plan->n_timed++ % plan->n_same];
    if (!sample->start) {
        CUDA_CHECK(cudaEventCreate(&sample->start));
        CUDA_CHECK(cudaEventCreate(&sample->stop));
    }
    CUDA_CHECK(cudaEventRecord(sample->start, call->stream));
    CUBLAS_CHECK(matmul_run(call, &plan->candidates[sample->candidate]));
    CUDA_CHECK(cudaEventRecord(sample->stop, call->stream));
}

// Closes tuning: waits for the timed calls, and gives every tuned plan its fastest candidate by
// mean time if that beats candidate 0 by the margin (a candidate never timed is not taken).
// Plans made later take the heuristic's first.
static void matmul_tune_finish(void) {
    for (int i = 0; i < g_n_samples; i++) {
        MatmulSample* sample = &g_samples[i];
        CUDA_CHECK(cudaEventSynchronize(sample->stop));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, sample->start, sample->stop));
        sample->plan->ms_sum[sample->candidate] += ms;
        sample->plan->n_samples[sample->candidate]++;
    }
    g_n_samples = 0;
    for (int i = 0; i < g_n_plans; i++) {
        MatmulPlan* p = &g_plans[i];
        if (p->n_samples[0] == 0) continue;  // never timed
        p->chosen = 0;
        p->us_first = p->us_chosen = (float)(1000.0 * p->ms_sum[0] / p->n_samples[0]);
        for (int c = 1; c < p->n_candidates; c++) {
            if (p->n_samples[c] == 0) continue;
            float us = (float)(1000.0 * p->ms_sum[c] / p->n_samples[c]);
            if (us < p->us_chosen && us < p->us_first * (1.0f - MATMUL_TUNE_MARGIN)) {
                p->chosen = c;
                p->us_chosen = us;
            }
        }
        p->algo = p->candidates[p->chosen];
    }
    g_matmul_tune = MATMUL_TUNE_OFF;
}

static void matmul_free(void) {
    matmul_tune_finish();  // a run shorter than its warm-up leaves timed calls behind
    for (int i = 0; i < MATMUL_MAX_SAMPLES && g_samples[i].start; i++) {
        CUDA_CHECK(cudaEventDestroy(g_samples[i].start));
        CUDA_CHECK(cudaEventDestroy(g_samples[i].stop));
        g_samples[i].start = g_samples[i].stop = NULL;
    }
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

// One line on what tuning chose: the shapes timed, those that run another candidate than the
// heuristic's first, and one call of each of those in the steps that timed them, before and after.
static void matmul_print_tuning(void) {
    int timed = 0, moved = 0;
    double us_first = 0.0, us_chosen = 0.0;
    for (int i = 0; i < g_n_plans; i++) {
        const MatmulPlan* p = &g_plans[i];
        if (p->chosen < 0) continue;
        timed++;
        if (p->chosen == 0) continue;
        moved++;
        us_first += p->us_first;
        us_chosen += p->us_chosen;
    }
    printf("matmul tuning: %d cuBLASLt shapes timed in the warm-up steps; %d run a candidate at least %.0f%% faster "
           "than the heuristic's first, with the same bits (one call of each: %.0f -> %.0f us)\n", timed, moved,
           100 * MATMUL_TUNE_MARGIN, us_first, us_chosen);
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

// Column-major D[m, n] = alpha op(A)[m, k] op(B)[k, n] (+ beta C, of D's shape, when c is not
// NULL), accumulated in fp32 (FP8 products: in the tensor cores' narrower accumulators, promoted to
// fp32 along k unless fast_accum) and scaled by alpha in fp32 before the one rounding to D's type.
// Scales (FP8): D = scale_d * (alpha scale_a scale_b op(A) op(B) + beta C), cuBLASLt's rule: alpha
// and beta come from the host (the default pointer mode) and multiply with the device scales.
// All pointers are 256-byte aligned and every leading dimension is the stored matrix's row count.
static void matmul(MatmulOperand d, float alpha, MatmulOperand a, MatmulOperand b, const void* c, float beta, int m,
                   int n, int k, bool trans_a, bool trans_b, cudaStream_t stream, bool fast_accum = false) {
    if ((is_fp8(a.type) || is_fp8(b.type)) && (!trans_a || trans_b)) {
        fprintf(stderr, "matmul: FP8 operands need the TN form (trans_a and not trans_b)\n");
        exit(1);
    }
    if (fast_accum && !(is_fp8(a.type) && is_fp8(b.type))) {
        fprintf(stderr, "matmul: fast accumulation is for FP8 products only\n");
        exit(1);
    }
    const void* scale_pointers[] = {a.scale, b.scale, d.scale, d.amax};
    for (const void* p : scale_pointers)
        if ((uintptr_t)p % 16 != 0) {
            fprintf(stderr, "matmul: scale and amax pointers must be 16-byte aligned (%p is not)\n", p);
            exit(1);
        }
    if (d.amax && !is_fp8(d.type)) {
        fprintf(stderr, "matmul: cuBLASLt computes the amax of FP8 results only\n");
        exit(1);
    }
    const MatmulKey key = {m, n, k, trans_a, trans_b, c != NULL, a.scale != NULL, b.scale != NULL, d.scale != NULL,
                           d.amax != NULL, fast_accum, a.type, b.type, d.type};
    MatmulPlan* plan = matmul_plan(&key, &a, &b, &d);
    matmul_set_scales(plan->desc, &a, &b, &d);
    const float beta_used = c ? beta : 0.0f;
    // Without a C, D is passed as C (unread with beta 0), except for an FP8 D, whose C layout is
    // bf16: cuBLASLt refuses C == D with different layouts, and takes a null C there.
    const void* c_ptr = c ? c : is_fp8(d.type) ? NULL : d.ptr;
    const MatmulCall call = {plan, &alpha, a.ptr, b.ptr, &beta_used, c_ptr, d.ptr, stream};
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (g_matmul_tune != MATMUL_TUNE_OFF) CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (g_matmul_tune != MATMUL_TUNE_OFF && capture == cudaStreamCaptureStatusNone) {
        if (plan->n_same == 0)
            matmul_check_candidates(plan, &call, (size_t)m * n * (d.type == CUDA_R_32F ? 4 : is_fp8(d.type) ? 1 : 2));
        if (g_matmul_tune == MATMUL_TUNE_TIME) {
            matmul_timed_run(plan, &call);
            return;
        }
    }
    CUBLAS_CHECK(matmul_run(&call, &plan->algo));
}

// y[N, O] = x[N, I] W[O, I]^T (+ residual[N, O] when residual is not NULL).
// Column-major: D[m=O, n=N] = op_T(W, stored [I, O]) x^T (stored [I, N]), D stored [O, N] = y.
static void linear_forward(bf16* y, const bf16* x, const bf16* W, const bf16* residual, int N, int I, int O,
                           cudaStream_t s) {
    matmul(mm_bf16(y), 1.0f, mm_bf16(W), mm_bf16(x), residual, 1.0f, O, N, I, true, false, s);
}

// dx[N, I] = dy[N, O] W[O, I], dx bf16 or fp32 (OutT).
// Column-major: D[m=I, n=N] = W(stored [I, O]) dy^T(stored [O, N]).
template <typename OutT>
static void linear_backward_input(OutT* dx, const bf16* dy, const bf16* W, int N, int I, int O, cudaStream_t s) {
    static_assert(std::is_same_v<OutT, bf16> || std::is_same_v<OutT, float>, "dx is bf16 or fp32");
    const MatmulOperand d = std::is_same_v<OutT, float> ? mm_f32((float*)dx) : mm_bf16((bf16*)dx);
    matmul(d, 1.0f, mm_bf16(W), mm_bf16(dy), NULL, 0.0f, I, N, O, false, false, s);
}

// dW[O, I] = dy[N, O]^T x[N, I], or += with accumulate (then dW is also C, beta 1).
// Column-major: D[m=I, n=O] = x^T(stored [I, N]) op_T(dy stored [O, N]).
static void linear_backward_weight(float* dW, const bf16* dy, const bf16* x, int N, int I, int O, bool accumulate,
                                   cudaStream_t s) {
    matmul(mm_f32(dW), 1.0f, mm_bf16(x), mm_bf16(dy), accumulate ? dW : NULL, 1.0f, I, O, N, false, true, s);
}

// ----------------------------------------------------------------------------------------------
// Muon (--optimizer muon; Jordan et al. 2024, the GPT-2 speedrun's optimizer) for the layers'
// hidden matrices; the embedding/head and the norm weights stay with AdamW (PARAM_FLAG_MUON marks
// which elements Muon owns). It comes after the matmul wrapper because its Newton-Schulz iteration
// is three bf16 matmuls a step. For a matrix G [R, C] (row-major, as the parameter table stores
// it; the fused qkv and gate_up matrices are orthogonalized per block: q, k, v, gate, up):
//   buf = mu buf + (1 - mu) g                 momentum, fp32, kept in the m buffer (g clipped as AdamW's)
//   u   = (1 - mu) g + mu buf                 Nesterov's look-ahead
//   X   = bf16(u / (||u||_F + 1e-7))          every singular value now <= 1
//   5 times: A = X X^T, B = b A + c A A, X = a X + B X,   (a, b, c) = (3.4445, -4.7750, 2.0315)
//   p  -= lr_muon * sqrt(max(1, R / C)) * X   (no weight decay on Muon's matrices)
// The quintic X -> aX + b (XX^T)X + c (XX^T)^2 X maps each singular value s to
// s (a + b s^2 + c s^4), which pushes every s in (0, 1] towards [0.7, 1.2] in 5 steps while
// keeping the singular vectors: X ends near U V^T of u = U S V^T, the orthogonalized update
// (every direction of the update gets the same step size). When R > C it runs on X^T, so that A
// is the smaller side's square. The scale sqrt(max(1, R/C)) is Keller Jordan's: it keeps the
// update's RMS per element comparable across shapes.

#define MUON_NS_STEPS 5
static const float MUON_NS_A = 3.4445f, MUON_NS_B = -4.7750f, MUON_NS_C = 2.0315f;

// Muon's scratch, sized for the largest matrix (elements) and the largest square of its short side.
typedef struct {
    float* u;         // [elements] the Nesterov update in fp32
    bf16 *x, *y;      // [elements] the iterate and the next one
    bf16 *a, *b;      // [short side^2] A, B
    float* norm_sq;   // one float: ||u||^2
} MuonScratch;

// buf = mu buf + (1 - mu) g;  u = (1 - mu) g + mu buf, over n elements (g = grads * the clip scale).
__global__ void muon_momentum_kernel(float* buf, float* u, const float* grads, size_t n, OptimConfig o,
                                     const OptimScalars* s) {
    float clip_scale = clip_scale_of(o, s), mu = o.muon_momentum;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = grads[i] * clip_scale;
        float b = mu * buf[i] + (1.0f - mu) * g;
        buf[i] = b;
        u[i] = (1.0f - mu) * g + mu * b;
    }
}

// x = bf16(u / (sqrt(norm_sq) + 1e-7))
__global__ void muon_normalize_kernel(bf16* x, const float* u, size_t n, const float* norm_sq) {
    float inv = 1.0f / (sqrtf(*norm_sq) + 1e-7f);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16(u[i] * inv);
}

// p -= lr_muon * scale * x on the master weight, held in its two halves.
__global__ void muon_update_kernel(bf16* params, int16_t* master_low, const bf16* x, size_t n, float scale,
                                   const OptimScalars* s) {
    float step = s->muon_lr * scale;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float p = master_join(params[i], master_low[i]) - step * __bfloat162float(x[i]);
        params[i] = master_split(p, &master_low[i]);
    }
}

// Five Newton-Schulz steps on X [R, C] (row-major bf16, in w->x, already scaled to norm <= 1);
// returns the buffer that holds the result (w->x or w->y). In cuBLASLt's column-major terms the
// buffer is Y = X^T [C, R]. R <= C: A = Y^T Y = X X^T [R, R], and X' = B X + a X is
// Y' = Y B^T + a Y. R > C: the iteration runs on X^T, which is Y itself: A = Y Y^T [C, C],
// Y' = B Y + a Y, and Y' read back row-major is the result's X' [R, C].
static bf16* newton_schulz5(const MuonScratch* w, int R, int C, cudaStream_t stream) {
    bf16 *x = w->x, *y = w->y;
    bool wide = R <= C;
    int r = wide ? R : C;
    for (int step = 0; step < MUON_NS_STEPS; step++) {
        if (wide) matmul(mm_bf16(w->a), 1.0f, mm_bf16(x), mm_bf16(x), NULL, 0.0f, R, R, C, true, false, stream);
        else matmul(mm_bf16(w->a), 1.0f, mm_bf16(x), mm_bf16(x), NULL, 0.0f, C, C, R, false, true, stream);
        matmul(mm_bf16(w->b), MUON_NS_C, mm_bf16(w->a), mm_bf16(w->a), w->a, MUON_NS_B, r, r, r, false, false, stream);
        if (wide) matmul(mm_bf16(y), 1.0f, mm_bf16(x), mm_bf16(w->b), x, MUON_NS_A, C, R, R, false, true, stream);
        else matmul(mm_bf16(y), 1.0f, mm_bf16(w->b), mm_bf16(x), x, MUON_NS_A, C, R, C, false, false, stream);
        bf16* t = x;
        x = y;
        y = t;
    }
    return x;
}

// One Muon update of the matrix [R, C] whose master weights (bf16 and low halves), gradient and
// momentum start at the given pointers. partials: REDUCE_BLOCKS floats of scratch for the norm.
static void muon_matrix_step(bf16* params, int16_t* master_low, const float* grads, float* buf, int R, int C,
                             const MuonScratch* w, float* partials, const OptimConfig* o, const OptimScalars* s,
                             cudaStream_t stream) {
    size_t n = (size_t)R * C;
    muon_momentum_kernel<<<1024, 256, 0, stream>>>(buf, w->u, grads, n, *o, s);
    LAUNCH_CHECK();
    reduce_sum(w->norm_sq, w->u, n, true, false, partials, stream);
    muon_normalize_kernel<<<1024, 256, 0, stream>>>(w->x, w->u, n, w->norm_sq);
    LAUNCH_CHECK();
    const bf16* x = newton_schulz5(w, R, C, stream);
    muon_update_kernel<<<1024, 256, 0, stream>>>(params, master_low, x, n, sqrtf(fmaxf(1.0f, (float)R / C)), s);
    LAUNCH_CHECK();
}

#endif
