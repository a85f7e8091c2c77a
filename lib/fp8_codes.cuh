/*
 * lib/fp8_codes.cuh - what every kernel that writes FP8 shares: the per-tensor scale record
 * (Fp8Scale), bf16 values to FP8 codes at that scale with their amax (fp8_encode2), and a block's
 * amax published into the record (fp8_publish_amax).
 *
 * Two kinds of kernel write FP8: lib/fp8.cuh's casts (a bf16 tensor, or a fused producer's values)
 * and lib/attention.cuh's forward, which can write its output's E4M3 codes beside the bf16 output
 * (the fused path of doc/fp8.md). Both write through these functions, so the same bf16 values at the
 * same scale give the same codes and the same amax, bit for bit, whichever kernel made them. This
 * header needs nothing of kernels.cuh, which includes attention.cuh before anything FP8 exists;
 * lib/fp8.cuh holds the rest: the formats' story, the casts, where scales come from, their update.
 */
#ifndef FP8_CODES_CUH
#define FP8_CODES_CUH

#include <cuda_fp8.h>
#include "cuda_check.h"

#define FP8_HISTORY 16

// One scaled tensor: x is stored as q = fp8(x * scale) and read back as q * scale_inv.
typedef struct __align__(16) {
    float scale_inv;              // stored -> real: what the matmul multiplies by
    float scale;                  // real -> stored
    float amax;                   // delayed: max |x| cast since the last update (as bits: atomicMax)
    float max;                    // the format's largest finite value (448 or 57344)
    float history[FP8_HISTORY];   // delayed: the amax of the last steps, newest first
} Fp8Scale;

// Two bf16 values to two FP8 codes at `scale` (the low byte is lo's), raising *amax to their larger
// magnitude. The conversion rounds to nearest even and saturates (cvt.rn.satfinite): a value beyond
// the largest finite one becomes that value, never an infinity or a NaN.
template <__nv_fp8_interpretation_t FORMAT>
__device__ static inline uint16_t fp8_encode2(bf16 lo, bf16 hi, float scale, float* amax) {
    float a = __bfloat162float(lo), b = __bfloat162float(hi);
    *amax = fmaxf(*amax, fmaxf(fabsf(a), fabsf(b)));
    return __nv_cvt_float2_to_fp8x2(make_float2(a * scale, b * scale), __NV_SATFINITE, FORMAT);
}

// s->amax = max(s->amax, amax), called by one thread of a block with the block's amax: one atomicMax,
// and only when the block's max exceeds what s->amax already holds (thousands of blocks updating one
// address one warp at a time cost more than a cast itself: measured, 9 ms of a 71 ms step).
// Non-negative floats order as their bits, and a max does not depend on the order, so the result
// is deterministic.
__device__ static inline void fp8_publish_amax(Fp8Scale* s, float amax) {
    if (amax > *(volatile float*)&s->amax) atomicMax((unsigned int*)&s->amax, __float_as_uint(amax));
}

#endif
