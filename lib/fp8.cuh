/*
 * lib/fp8.cuh - FP8 training's pieces: the formats, the cast kernels and the per-tensor scales.
 *
 * Two 8-bit floating-point formats (OCP FP8, what Hopper's tensor cores multiply):
 *   E4M3  sign, 4 exponent bits (bias 7), 3 mantissa bits: largest 448, smallest subnormal 2^-9,
 *         relative spacing 2^-3; no infinities (S.1111.111 is NaN). For weights and activations.
 *   E5M2  sign, 5 exponent bits (bias 15), 2 mantissa bits: largest 57344, smallest 2^-16,
 *         relative spacing 2^-2; IEEE-style infinities. For gradients, whose range is wider.
 * A tensor is stored as q = fp8(x * scale), one scale per tensor, and read as x = q * scale_inv.
 * The conversion rounds to nearest even and saturates (cvt.rn.satfinite): a value beyond the
 * largest finite one becomes that value, never an infinity. test/reference.h holds the same
 * rounding in plain C, and the tests hold the kernels here to it code for code.
 *
 * Scales are powers of two (the largest 2^k with amax * 2^k <= the format's largest value), so
 * scaling is exact and only the rounding to 8 bits loses anything. Where amax comes from:
 *   current  the amax of the tensor being cast, measured by a pass over it first (fp8_amax_kernel)
 *   delayed  the largest amax of the last FP8_HISTORY optimizer steps; each cast records its
 *            tensor's amax as it goes (one pass), and fp8_update_scales rolls the history at the
 *            end of the step. Before the first step has filled the history, casts use current.
 * Everything lives on the device in an array of Fp8Scale (lib/fp8_codes.cuh), one per tensor role;
 * during a step the host never reads a scale (checkpoints and --fp8-log-scales copy them out at a
 * step's end). The convention to know: `scale` multiplies into FP8, `scale_inv` (what a matmul
 * takes as its operand's scale, and the first field so that it is 16-byte aligned as cuBLASLt
 * wants) multiplies back out.
 *
 * The cast kernel writes the row-major copy, the transposed copy, or both (Hopper's FP8 matmuls
 * take only the TN form, so the backward's products need transposed operands; doc/fp8.md). What
 * it casts comes from a producer: a bf16 tensor in memory, or (fused) the output of RMSNorm,
 * SwiGLU or SwiGLU's backward computed on the spot from that kernel's inputs, so that the bf16
 * tensor is never written nor read again. Three kernels write codes of their own instead: the
 * forward's RMSNorm, which needs whole rows for its rstd (fp8_rmsnorm_kernel); AdamW's update of
 * the weight matrices, which writes W and W^T as it writes the new weights (fp8_adamw_kernel); and
 * the attention forward, beside its bf16 output (lib/attention.cuh). A fused cast needs its scale
 * before the data exists: delayed scaling once the history holds a step. Every writer of codes goes
 * through lib/fp8_codes.cuh's conversion and amax, so the fused codes are the very bits a plain
 * cast would make.
 */
#ifndef FP8_CUH
#define FP8_CUH

#include "../kernels.cuh"
#include "fp8_codes.cuh"  // Fp8Scale, fp8_encode2, fp8_publish_amax: what the attention forward shares

#define FP8_E4M3_MAX 448.0f
#define FP8_E5M2_MAX 57344.0f

typedef enum { FP8_DELAYED, FP8_CURRENT } Fp8Scaling;
static const char* const FP8_SCALING_NAMES[] = {"delayed", "current"};  // by Fp8Scaling: --fp8-scaling's words

// A fresh scale for a tensor of the given format: 1, and an empty history.
static Fp8Scale fp8_scale_initial(bool e5m2) {
    Fp8Scale s;
    memset(&s, 0, sizeof(s));
    s.scale_inv = s.scale = 1.0f;
    s.max = e5m2 ? FP8_E5M2_MAX : FP8_E4M3_MAX;
    return s;
}

// k such that 2^k is the largest power of two with amax * 2^k <= max (0 for an amax of 0 or one
// that is not finite), from the exponents alone: amax = ma 2^ea, max = mf 2^ef, ma and mf in
// [0.5, 1). Clamped to +-120 so that 2^k and 2^-k stay normal floats.
__host__ __device__ static inline int fp8_scale_exponent(float amax, float max) {
    if (!(amax > 0.0f) || !(amax <= 3.0e38f)) return 0;
    int ea, ef;
    float ma = frexpf(amax, &ea), mf = frexpf(max, &ef);
    int k = ef - ea - (ma > mf ? 1 : 0);
    return k < -120 ? -120 : k > 120 ? 120 : k;
}

__device__ static inline void fp8_set_scale(Fp8Scale* s, float amax) {
    int k = fp8_scale_exponent(amax, s->max);
    s->scale = ldexpf(1.0f, k);
    s->scale_inv = ldexpf(1.0f, -k);
}

// The max over the block (block_max: every thread calling), published once (fp8_publish_amax).
__device__ static inline void fp8_record_amax(Fp8Scale* s, float amax) {
    amax = block_max(amax);
    if (threadIdx.x == 0) fp8_publish_amax(s, amax);
}

// s->amax = max |x| over n elements (n a multiple of 8; s->amax zeroed before); 256 threads a block.
__global__ static void fp8_amax_kernel(const bf16* x, size_t n, Fp8Scale* s) {
    float amax = 0.0f;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n; i += (size_t)gridDim.x * blockDim.x * 8) {
        bf16x8 v = load8(x + i);
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(__bfloat162float(v.v[j])));
    }
    fp8_record_amax(s, amax);
}

// Producers: where a cast's values come from. A producer yields the 8 values at (row, col .. col + 7)
// of the tensor being cast, as bf16 rounded exactly as the kernel that makes that tensor rounds
// them (it runs the same function of kernels.cuh). The plain cast reads a bf16 tensor; the others
// compute a tensor that then never exists in bf16, from what that kernel would have read: a fused
// cast stores the very codes, and records the very amax, of that kernel followed by a plain cast,
// and saves the bf16 tensor's write and read. Rows and cols are the tensor's; col a multiple of 8.
struct Fp8FromBf16 {  // x [rows, cols] as it is in memory
    const bf16* x;
    int cols;
    __device__ bf16x8 operator()(int row, int col) const { return load8(x + (size_t)row * cols + col); }
};

struct Fp8FromRmsnorm {  // RMSNorm's output [rows, cols], from its input x, the rstd it saved and its weight
    const bf16* x;
    const float* rstd;
    const bf16* weight;
    int cols;
    __device__ bf16x8 operator()(int row, int col) const {
        return rmsnorm_apply8(load8(x + (size_t)row * cols + col), rstd[row], load8(weight + col));
    }
};

struct Fp8FromSwiglu {  // SwiGLU's output [rows, F], from gate_up [rows, 2F]
    const bf16* gate_up;
    int F;
    __device__ bf16x8 operator()(int row, int col) const {
        const bf16* gu = gate_up + (size_t)row * 2 * F;
        return swiglu8(load8(gu + col), load8(gu + F + col));
    }
};

struct Fp8FromSwigluBackward {  // d_gate_up [rows, 2F] = [d_gate | d_up], from d_out [rows, F] and gate_up
    const bf16* d_out;
    const bf16* gate_up;
    int F;
    __device__ bf16x8 operator()(int row, int col) const {
        int f = col < F ? col : col - F;  // F is a multiple of 8: the 8 columns lie in one half
        const bf16* gu = gate_up + (size_t)row * 2 * F;
        bf16x8 dg, du;
        swiglu_backward8(&dg, &du, load8(gu + f), load8(gu + F + f), load8(d_out + (size_t)row * F + f));
        return col < F ? dg : du;
    }
};

// 8 values to 8 FP8 codes at `scale` (one 8-byte store), raising *amax to their largest magnitude.
template <__nv_fp8_interpretation_t FORMAT>
__device__ static inline uint2 fp8_encode8(const bf16x8& v, float scale, float* amax) {
    uint2 packed;
    uint16_t* q = (uint16_t*)&packed;
    for (int j = 0; j < 4; j++) q[j] = fp8_encode2<FORMAT>(v.v[2 * j], v.v[2 * j + 1], scale, amax);
    return packed;
}

// The transposed copy of a tile of codes in shared memory: tile[TR][LD] holds rows r0.. and
// columns c0.. of a tensor [rows, cols] (rows a multiple of 8); out_t [cols, rows] receives them, a
// thread writing 8 consecutive rows of one column with one 8-byte store (TR / 8 threads a column,
// 256 threads a block). The block has filled the tile and passed a barrier.
template <int TR, int TC, int LD>
__device__ __forceinline__ void fp8_store_transposed(const uint8_t (*tile)[LD], uint8_t* out_t, int rows, int cols,
                                                     int r0, int c0) {
    constexpr int THREADS_PER_COL = TR / 8;
    int r = (threadIdx.x % THREADS_PER_COL) * 8;
    for (int c = threadIdx.x / THREADS_PER_COL; c < TC; c += 256 / THREADS_PER_COL) {
        if (c0 + c >= cols || r0 + r >= rows) continue;
        uint2 packed;
        uint8_t* q = (uint8_t*)&packed;
        for (int j = 0; j < 8; j++) q[j] = tile[r + j][c];
        *(uint2*)(out_t + (size_t)(c0 + c) * rows + r0 + r) = packed;
    }
}

// Cast the tensor x yields [rows, cols] to FP8: out [rows, cols] and/or out_t [cols, rows].
// Tile: 64 x 64 elements per block of 256 threads; thread t takes 8 consecutive columns of rows
// t/8 and t/8 + 32, writes them to `out` at once and to a shared tile, from which, after a
// barrier, it writes 8 consecutive rows of one column to `out_t`. rows and cols are multiples of
// 8. Scale: `current` takes it from the amax in s (measured before, by fp8_amax_kernel) and block
// (0, 0) publishes it; delayed takes s->scale and records the amax.
#define FP8_TILE 64
template <__nv_fp8_interpretation_t FORMAT, typename Producer>
__global__ static void __launch_bounds__(256) fp8_cast_kernel(uint8_t* out, uint8_t* out_t, Producer x, int rows,
                                                              int cols, Fp8Scale* s, bool current) {
    __shared__ __align__(16) uint8_t tile[FP8_TILE][FP8_TILE + 8];
    float scale = current ? ldexpf(1.0f, fp8_scale_exponent(s->amax, s->max)) : s->scale;
    if (current && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) fp8_set_scale(s, s->amax);
    int r0 = blockIdx.y * FP8_TILE, c0 = blockIdx.x * FP8_TILE;
    int tc = (threadIdx.x % 8) * 8, tr = threadIdx.x / 8;
    float amax = 0.0f;
    for (int pass = 0; pass < 2; pass++) {
        int r = tr + pass * 32;
        if (r0 + r >= rows || c0 + tc >= cols) continue;
        uint2 packed = fp8_encode8<FORMAT>(x(r0 + r, c0 + tc), scale, &amax);
        if (out) *(uint2*)(out + (size_t)(r0 + r) * cols + c0 + tc) = packed;
        if (out_t) *(uint2*)&tile[r][tc] = packed;
    }
    if (out_t) {
        __syncthreads();
        fp8_store_transposed<FP8_TILE, FP8_TILE>(tile, out_t, rows, cols, r0, c0);
    }
    if (!current) fp8_record_amax(s, amax);
}

// What AdamW's step reads and writes, for the update that makes the FP8 weights (below): the flat
// buffers from their element 0 (ZeRO 0's whole buffers), the decay flags, the settings and the
// step's scalars on the device.
typedef struct {
    bf16* params;          // the master weights' bf16 halves
    int16_t* master_low;   // and their low halves (kernels.cuh, master_split)
    const float* grads;
    float* m;
    float* v;
    const uint8_t* flags;  // one per PARAM_ALIGN elements, as adamw_kernel reads them
    OptimConfig o;
    const OptimScalars* s;
} AdamwBuffers;

// AdamW's step on a weight matrix [rows, cols] (its elements from `first` on in every flat buffer)
// with its E4M3 copies made in the same pass (doc/fp8.md): the step on each element as adamw_kernel
// takes it (adamw4, master_store4: the same arithmetic, the same bits), writing what adamw_kernel
// writes (both moments, both halves of the master weights), then the codes of the new bf16 weights
// at the delayed scale s->scale into W (weights) and, through a shared tile, W^T (weights_t), and
// their amax recorded: what a delayed cast of the bf16 weights after AdamW would store and record. One
// launch serves a kind's matrix in every layer (blockIdx.z: the layer): they have one shape and lie
// layer_stride elements apart in every flat buffer, their weight scales scale_stride apart. AdamW's
// elements only: a flag's PARAM_FLAG_MUON is not looked at (Muon keeps the unfused path).
//
// A block takes 32 rows of 128 columns; a warp takes 128 columns of one row, a float4 a thread as
// in adamw_kernel (each load instruction of a warp reads 512 consecutive bytes), 8 rows a pass, 4
// passes. Every pass's loads come first: the stores may alias them as far as the compiler knows,
// so it would otherwise issue a pass's loads only after the previous pass's stores; this way a
// thread has 256 bytes on the way. At the 1b shapes (H100) the update with its casts took 10.76 ms,
// against 12.20 for AdamW then the casts and 14.1 for 64 x 64 tiles of 8 elements a thread.
#define FP8_ADAMW_ROWS 32
#define FP8_ADAMW_COLS 128
__global__ static void __launch_bounds__(256) fp8_adamw_kernel(uint8_t* weights, uint8_t* weights_t, AdamwBuffers a,
                                                               size_t first, int rows, int cols, size_t layer_stride,
                                                               Fp8Scale* s, int scale_stride) {
    constexpr int PASSES = FP8_ADAMW_ROWS / 8;
    __shared__ __align__(16) uint8_t tile[FP8_ADAMW_ROWS][FP8_ADAMW_COLS + 16];
    first += blockIdx.z * layer_stride;
    s += blockIdx.z * scale_stride;
    const float scale = s->scale, clip_scale = clip_scale_of(a.o, a.s);
    const float lr = a.s->lr, bias_corr1 = a.s->bias_corr1, bias_corr2 = a.s->bias_corr2;
    const int r0 = blockIdx.y * FP8_ADAMW_ROWS, c0 = blockIdx.x * FP8_ADAMW_COLS;
    const int tr = threadIdx.x / 32, tc = (threadIdx.x % 32) * 4;  // pass k: row r0 + tr + 8k, columns c0 + tc..+3
    float4 g[PASSES], m[PASSES], v[PASSES], p[PASSES];
#pragma unroll
    for (int k = 0; k < PASSES; k++) {
        size_t i = first + (size_t)(r0 + tr + 8 * k) * cols + c0 + tc;
        if (r0 + tr + 8 * k < rows && c0 + tc < cols)
            g[k] = *(const float4*)(a.grads + i), m[k] = *(float4*)(a.m + i), v[k] = *(float4*)(a.v + i),
            p[k] = master_load4(a.params, a.master_low, i / 4);
    }
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < PASSES; k++) {
        int r = tr + 8 * k;
        if (r0 + r >= rows || c0 + tc >= cols) continue;
        size_t i = first + (size_t)(r0 + r) * cols + c0 + tc;  // a multiple of 4: the float4 shares a flag
        float wd = (a.flags[i / PARAM_ALIGN] & PARAM_FLAG_DECAY) ? a.o.weight_decay : 0.0f;
        adamw4(scaled4(g[k], clip_scale), &m[k], &v[k], &p[k], wd, a.o, lr, bias_corr1, bias_corr2);
        *(float4*)(a.m + i) = m[k];
        *(float4*)(a.v + i) = v[k];
        Bf16x4 w = master_store4(p[k], a.params, a.master_low, i / 4);
        uint32_t codes = fp8_encode2<__NV_E4M3>(w.pair[0].x, w.pair[0].y, scale, &amax) |
                         (uint32_t)fp8_encode2<__NV_E4M3>(w.pair[1].x, w.pair[1].y, scale, &amax) << 16;
        *(uint32_t*)(weights + i) = codes;
        *(uint32_t*)&tile[r][tc] = codes;
    }
    __syncthreads();
    fp8_store_transposed<FP8_ADAMW_ROWS, FP8_ADAMW_COLS>(tile, weights_t + first, rows, cols, r0, c0);
    fp8_record_amax(s, amax);
}

// RMSNorm straight to E4M3 at the delayed scale s->scale (the fused forward's QKV and GATE_UP
// inputs): rmsnorm_forward_kernel's rows, warps and rstd (saved for the backward as it saves it),
// each row's values cast as they are computed; the amax recorded. The bf16 output never exists.
__global__ static void __launch_bounds__(256) fp8_rmsnorm_kernel(uint8_t* out, float* rstd, const bf16* in,
                                                                 const bf16* weight, int N, int C, float eps,
                                                                 Fp8Scale* s) {
    int row = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
    float scale = s->scale, amax = 0.0f;
    if (row < N) {  // no early return: every thread joins the block's amax
        const bf16* x = in + (size_t)row * C;
        float r = rmsnorm_rstd(x, C, eps, lane);
        for (int c = lane * 8; c < C; c += 32 * 8)
            *(uint2*)(out + (size_t)row * C + c) =
                fp8_encode8<__NV_E4M3>(rmsnorm_apply8(load8(x + c), r, load8(weight + c)), scale, &amax);
        if (lane == 0) rstd[row] = r;
    }
    fp8_record_amax(s, amax);
}

// After an optimizer step (delayed scaling): each tensor's amax joins its history, the scale is
// set from the history's largest, and amax starts again from 0.
__global__ static void fp8_update_kernel(Fp8Scale* scales, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    Fp8Scale* s = scales + i;
    float newest = s->amax, most = newest;
    for (int h = FP8_HISTORY - 1; h > 0; h--) {
        s->history[h] = s->history[h - 1];
        most = fmaxf(most, s->history[h]);
    }
    s->history[0] = newest;
    s->amax = 0.0f;
    fp8_set_scale(s, most);
}

// How a cast finds its scale: from the history (delayed), from a pass over the tensor first
// (current), or from the amax such a pass left in s for this same tensor earlier (current: the
// backward's transposed copy of an activation the forward already measured). Delayed scaling's
// first step, before the history holds anything, calibrates: it measures as current scaling does
// but keeps the largest amax of the step (over micro-batches and the head's loss chunks) instead of
// starting from 0, so that the history's first entry is the step's amax, as every later entry is;
// a cast then scales by the largest amax seen so far, which covers its own.
typedef enum { FP8_CAST_DELAYED, FP8_CAST_MEASURE, FP8_CAST_MEASURED, FP8_CAST_CALIBRATE } Fp8CastScale;

static void fp8_check_shape(int rows, int cols) {
    if (rows % 8 != 0 || cols % 8 != 0) {
        fprintf(stderr, "fp8_cast: a %d x %d tensor; FP8 needs both sides multiples of 8\n", rows, cols);
        exit(1);
    }
}

// Casts what the producer x yields, with the scale found as `how` says. A producer other than a
// bf16 tensor has no values in memory to measure first: its `how` is DELAYED or MEASURED.
template <typename Producer>
static void fp8_produce(uint8_t* out, uint8_t* out_t, Producer x, int rows, int cols, bool e5m2, Fp8Scale* s,
                        Fp8CastScale how, cudaStream_t stream) {
    fp8_check_shape(rows, cols);
    dim3 grid(ceil_div(cols, FP8_TILE), ceil_div(rows, FP8_TILE));
    bool current = how != FP8_CAST_DELAYED;
    if (e5m2) fp8_cast_kernel<__NV_E5M2><<<grid, 256, 0, stream>>>(out, out_t, x, rows, cols, s, current);
    else fp8_cast_kernel<__NV_E4M3><<<grid, 256, 0, stream>>>(out, out_t, x, rows, cols, s, current);
    LAUNCH_CHECK();
}

// The plain cast of a bf16 tensor x [rows, cols]; FP8_CAST_MEASURE and _CALIBRATE measure its amax
// first (the one from 0, the other onto the step's amax so far).
static void fp8_cast(uint8_t* out, uint8_t* out_t, const bf16* x, int rows, int cols, bool e5m2, Fp8Scale* s,
                     Fp8CastScale how, cudaStream_t stream) {
    fp8_check_shape(rows, cols);
    if (how == FP8_CAST_MEASURE || how == FP8_CAST_CALIBRATE) {
        size_t n = (size_t)rows * cols;
        if (how == FP8_CAST_MEASURE) CUDA_CHECK(cudaMemsetAsync(&s->amax, 0, sizeof(float), stream));
        int blocks = (int)(ceil_div(n / 8, 256) < 1024 ? ceil_div(n / 8, 256) : 1024);
        fp8_amax_kernel<<<blocks, 256, 0, stream>>>(x, n, s);
        LAUNCH_CHECK();
    }
    fp8_produce(out, out_t, Fp8FromBf16{x, cols}, rows, cols, e5m2, s, how, stream);
}

// y = rmsnorm(in) [N, C] into E4M3 codes `out`, and rstd [N]; delayed scaling only.
static void fp8_rmsnorm_forward(uint8_t* out, float* rstd, const bf16* in, const bf16* weight, int N, int C, float eps,
                                Fp8Scale* s, cudaStream_t stream) {
    fp8_check_shape(N, C);
    fp8_rmsnorm_kernel<<<ceil_div(N, 8), 256, 0, stream>>>(out, rstd, in, weight, N, C, eps, s);
    LAUNCH_CHECK();
}

// AdamW's step on n_layers matrices [rows, cols] of one kind (the first from element `first` of
// ZeRO 0's whole flat buffers, the next layer_stride elements on), each made into E4M3 W and W^T at
// its delayed weight scale (the first at s, the next scale_stride on) as it is updated.
static void fp8_adamw_matrices(uint8_t* weights, uint8_t* weights_t, const AdamwBuffers* a, size_t first, int rows,
                               int cols, int n_layers, size_t layer_stride, Fp8Scale* s, int scale_stride,
                               cudaStream_t stream) {
    fp8_check_shape(rows, cols);  // and first, layer_stride: multiples of PARAM_ALIGN, so float4s align
    dim3 grid(ceil_div(cols, FP8_ADAMW_COLS), ceil_div(rows, FP8_ADAMW_ROWS), n_layers);
    fp8_adamw_kernel<<<grid, 256, 0, stream>>>(weights, weights_t, *a, first, rows, cols, layer_stride, s,
                                               scale_stride);
    LAUNCH_CHECK();
}

static void fp8_update_scales(Fp8Scale* scales, int n, cudaStream_t stream) {
    fp8_update_kernel<<<ceil_div(n, 128), 128, 0, stream>>>(scales, n);
    LAUNCH_CHECK();
}

// A matmul operand stored in FP8 with the scale s.
static MatmulOperand fp8_operand(const uint8_t* p, bool e5m2, Fp8Scale* s) {
    return (MatmulOperand){(void*)p, e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, &s->scale_inv, NULL};
}

#endif
