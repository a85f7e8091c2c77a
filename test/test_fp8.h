/*
 * test/test_fp8.h - FP8 mode's tests: the rounding of both formats on every code, the cast
 * kernels and the scales against the CPU reference (test/reference.h), the FP8 products of one
 * layer, the fused casts against the unfused path and the reference, the whole model's FP8
 * gradients (the head's in FP8 too, fast accumulation) against its BF16 ones, a fused step against
 * an unfused one, AdamW making the FP8 weights against AdamW then the forward's cast (one step, and
 * training), the scales' log (--fp8-log-scales) against a checkpoint's scales, and on two GPUs
 * the ranks' agreement on their scales and a bit-exact resume.
 *
 * test_gpt.cu includes it after its whole-model helpers (gpu_forward_backward, random_params) and
 * its run helpers (make_shard_dir, SMALL_RUN, compare_logged_steps, gpu_count), which the tests
 * here use, and runs fp8_tests. The kernel tests are exact: inputs are bf16,
 * scales powers of two, so the GPU's codes must equal the reference's bit for bit. Only the
 * matmuls' accumulation (and their outputs' rounding) is held to a tolerance, and the fused casts'
 * values against the fp64 reference (to a neighbouring code, rarely); the fused casts against the
 * unfused path, and a whole fused step against an unfused one, are exact.
 */
#ifndef TEST_FP8_H
#define TEST_FP8_H

// The values worth rounding for one format: every code's value, the midpoint of every two
// neighbours (a tie: it must go to the even code) and just above and below it, values beyond the
// largest (saturation), infinities and NaN.
static int fp8_probe_values(bool e5m2, float* out) {
    int n = 0;
    double prev = -1.0;
    for (int c = 0; c < 0x7F; c++) {
        double v = ref_fp8_decode((uint8_t)c, e5m2);
        if (!isfinite(v)) continue;
        if (prev >= 0.0) {
            double mid = (prev + v) / 2;
            float probes[] = {(float)mid, nextafterf((float)mid, 0.0f), nextafterf((float)mid, INFINITY)};
            for (float p : probes) out[n++] = p, out[n++] = -p;
        }
        out[n++] = (float)v, out[n++] = -(float)v;
        prev = v;
    }
    float beyond[] = {(float)(prev * 1.03), (float)(prev * 1.2), 1e30f, INFINITY, -INFINITY, NAN, 1e-30f};
    for (float b : beyond) out[n++] = b, out[n++] = -b;
    return n;
}

#define FP8_PROBES 2048

// Every code decodes to the value the format defines and encodes back to itself; every probe
// rounds as CUDA's own saturating conversion rounds it (its host implementation, so this runs
// in CI without a GPU).
static int test_fp8_rounding_every_code(void) {
    int failed = 0;
    for (int e5m2 = 0; e5m2 < 2; e5m2++) {
        __nv_fp8_interpretation_t format = e5m2 ? __NV_E5M2 : __NV_E4M3;
        int finite = 0;
        for (int c = 0; c < 256; c++) {
            double v = ref_fp8_decode((uint8_t)c, e5m2);
            __nv_fp8_storage_t code = (__nv_fp8_storage_t)c;
            float cuda_value = __half2float(__half(__nv_cvt_fp8_to_halfraw(code, format)));
            EXPECT((isnan(v) && isnan(cuda_value)) || v == cuda_value, "%s code 0x%02x: %g vs CUDA's %g",
                   e5m2 ? "e5m2" : "e4m3", c, v, cuda_value);
            if (!isfinite(v)) continue;
            finite++;
            if (v != 0.0 || c == 0 || c == 0x80) EXPECT(ref_fp8_encode(v, e5m2) == c, "code 0x%02x does not round-trip", c);
        }
        EXPECT(finite == (e5m2 ? 248 : 254), "%d finite codes", finite);
        EXPECT(ref_fp8_decode(e5m2 ? 0x7B : 0x7E, e5m2) == (e5m2 ? 57344.0 : 448.0), "largest value");
        EXPECT(ref_fp8_decode(1, e5m2) == (e5m2 ? ldexp(1.0, -16) : ldexp(1.0, -9)), "smallest subnormal");
        float* probes = (float*)malloc(FP8_PROBES * sizeof(float));
        int n = fp8_probe_values(e5m2, probes);
        for (int i = 0; i < n; i++) {
            uint8_t want = __nv_cvt_float_to_fp8(probes[i], __NV_SATFINITE, format);
            uint8_t got = ref_fp8_encode(probes[i], e5m2);
            bool both_nan = isnan(ref_fp8_decode(got, e5m2)) && isnan(ref_fp8_decode(want, e5m2));
            EXPECT(got == want || both_nan, "%s rounds %.9g to 0x%02x, CUDA to 0x%02x", e5m2 ? "e5m2" : "e4m3",
                   probes[i], got, want);
        }
        free(probes);
    }
    return TEST_RESULT;
}

// The scale is the largest power of two that keeps amax within the format.
static int test_fp8_scale_exponent(void) {
    int failed = 0;
    struct {
        float amax, max;
        int k;
    } cases[] = {{448.0f, 448.0f, 0}, {449.0f, 448.0f, -1}, {1.0f, 448.0f, 8}, {0.875f, 448.0f, 9},
                 {0.8751f, 448.0f, 8}, {1e-3f, 57344.0f, 25}, {0.0f, 448.0f, 0}, {INFINITY, 448.0f, 0},
                 {1e-40f, 448.0f, 120}};
    for (auto& c : cases) {
        int k = fp8_scale_exponent(c.amax, c.max);
        EXPECT(k == c.k, "amax %g max %g: k %d, want %d", c.amax, c.max, k, c.k);
        if (c.amax > 0 && isfinite(c.amax) && k < 120)
            EXPECT(ldexp(c.amax, k) <= c.max && ldexp(c.amax, k + 1) > c.max, "amax %g: 2^%d is not the largest", c.amax, k);
    }
    return TEST_RESULT;
}

// The device's conversion (the instruction the cast kernel uses) on every probe value.
__global__ static void fp8_convert_kernel(uint8_t* out, const float* in, int n, bool e5m2) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __nv_cvt_float_to_fp8(in[i], __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

static int test_fp8_gpu_rounding_every_code(void) {
    REQUIRE_GPU();
    int failed = 0;
    for (int e5m2 = 0; e5m2 < 2; e5m2++) {
        float* probes = (float*)malloc(FP8_PROBES * sizeof(float));
        int n = fp8_probe_values(e5m2, probes);
        float* d_in;
        uint8_t* d_out;
        CUDA_CHECK(cudaMalloc(&d_in, n * sizeof(float)));
        CUDA_CHECK(cudaMalloc(&d_out, n));
        CUDA_CHECK(cudaMemcpy(d_in, probes, n * sizeof(float), cudaMemcpyHostToDevice));
        fp8_convert_kernel<<<ceil_div(n, 256), 256>>>(d_out, d_in, n, e5m2);
        uint8_t* got = (uint8_t*)malloc(n);
        CUDA_CHECK(cudaMemcpy(got, d_out, n, cudaMemcpyDeviceToHost));
        for (int i = 0; i < n; i++) {
            uint8_t want = ref_fp8_encode(probes[i], e5m2);
            bool both_nan = isnan(ref_fp8_decode(got[i], e5m2)) && isnan(ref_fp8_decode(want, e5m2));
            EXPECT(got[i] == want || both_nan, "%s: GPU rounds %.9g to 0x%02x, reference to 0x%02x",
                   e5m2 ? "e5m2" : "e4m3", probes[i], got[i], want);
        }
        free(probes); free(got);
        CUDA_CHECK(cudaFree(d_in));
        CUDA_CHECK(cudaFree(d_out));
    }
    return TEST_RESULT;
}

static Fp8Scale fp8_scale_download(const Fp8Scale* d) {
    Fp8Scale s;
    CUDA_CHECK(cudaMemcpy(&s, d, sizeof(s), cudaMemcpyDeviceToHost));
    return s;
}

// The cast kernel on a tensor whose sides are no multiple of its 64 x 64 tile, in both formats
// and all four ways of finding the scale: row-major and transposed codes equal the reference's,
// the amax is exact, and a delayed scale that is too large saturates instead of overflowing.
static int test_fp8_gpu_cast_kernel(void) {
    REQUIRE_GPU();
    int failed = 0;
    int rows = 136, cols = 200;
    size_t n = (size_t)rows * cols;
    double* x = random_array(n, 3.0);
    for (size_t i = 0; i < n; i++) x[i] = round_bf16(x[i]);
    x[17] = round_bf16(-37.5);  // the amax, negative
    double amax = 37.5;
    bf16* d_x = to_device_bf16(x, n);
    uint8_t *d_out = (uint8_t*)device_alloc_poisoned(n), *d_out_t = (uint8_t*)device_alloc_poisoned(n);
    uint8_t *out = (uint8_t*)malloc(n), *out_t = (uint8_t*)malloc(n);
    Fp8Scale* d_s;
    CUDA_CHECK(cudaMalloc(&d_s, sizeof(Fp8Scale)));
    for (int e5m2 = 0; e5m2 < 2; e5m2++)
        for (int how = 0; how < 4; how++) {  // Fp8CastScale: delayed, measure, measured, calibrate
            Fp8Scale s = fp8_scale_initial(e5m2);
            // measure starts from 0 whatever amax holds; calibrate keeps the larger amax an earlier
            // micro-batch left (twice this tensor's), and its scale follows that
            double kept = how == FP8_CAST_CALIBRATE ? 2 * amax : amax;
            int k = fp8_scale_exponent((float)kept, s.max);
            // delayed: a scale 4x too large for this amax, so the largest values saturate
            s.scale = ldexpf(1.0f, how == FP8_CAST_DELAYED ? k + 2 : 0);
            s.amax = how == FP8_CAST_MEASURED ? (float)amax : how == FP8_CAST_DELAYED ? 0.0f : (float)(2 * amax);
            CUDA_CHECK(cudaMemcpy(d_s, &s, sizeof(s), cudaMemcpyHostToDevice));
            fp8_cast(d_out, d_out_t, d_x, rows, cols, e5m2, d_s, (Fp8CastScale)how, 0);
            CUDA_CHECK(cudaMemcpy(out, d_out, n, cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(out_t, d_out_t, n, cudaMemcpyDeviceToHost));
            Fp8Scale after = fp8_scale_download(d_s);
            double scale = how == FP8_CAST_DELAYED ? ldexp(1.0, k + 2) : ldexp(1.0, k);
            EXPECT(after.amax == (float)kept, "format %d how %d: amax %g, want %g", e5m2, how, after.amax, kept);
            if (how != FP8_CAST_DELAYED)
                EXPECT(after.scale == (float)scale && after.scale_inv == (float)(1.0 / scale),
                       "format %d how %d: scale %g / %g, want %g", e5m2, how, after.scale, after.scale_inv, scale);
            int wrong = 0, saturated = 0;
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < cols; c++) {
                    uint8_t want = ref_fp8_encode(x[(size_t)r * cols + c] * scale, e5m2);
                    saturated += fabs(x[(size_t)r * cols + c] * scale) > s.max;
                    wrong += out[(size_t)r * cols + c] != want || out_t[(size_t)c * rows + r] != want;
                }
            EXPECT(wrong == 0, "format %d how %d: %d of %zu codes differ from the reference", e5m2, how, wrong, n);
            EXPECT((how == FP8_CAST_DELAYED) == (saturated > 0), "format %d how %d: %d saturated", e5m2, how,
                   saturated);
        }
    free(x); free(out); free(out_t);
    void* dev[] = {d_x, d_out, d_out_t, d_s};
    for (void* d : dev) CUDA_CHECK(cudaFree(d));
    return TEST_RESULT;
}

// Delayed scaling's update: the amax joins the history (newest first, the oldest drops out), the
// scale follows the history's largest amax, and amax restarts at 0.
static int test_fp8_gpu_scale_update(void) {
    REQUIRE_GPU();
    int failed = 0;
    Fp8Scale s[2] = {fp8_scale_initial(false), fp8_scale_initial(true)};
    for (int h = 0; h < FP8_HISTORY; h++) s[0].history[h] = s[1].history[h] = 0.01f * (h + 1);
    s[0].history[FP8_HISTORY - 1] = 1000.0f;  // drops out: the scale follows 3.0 (newest), not 1000
    s[0].amax = 3.0f;
    s[1].amax = 0.001f;  // the history's 0.15 is the largest
    Fp8Scale* d;
    CUDA_CHECK(cudaMalloc(&d, sizeof(s)));
    CUDA_CHECK(cudaMemcpy(d, s, sizeof(s), cudaMemcpyHostToDevice));
    fp8_update_scales(d, 2, 0);
    Fp8Scale after[2];
    CUDA_CHECK(cudaMemcpy(after, d, sizeof(s), cudaMemcpyDeviceToHost));
    float most[2] = {3.0f, 0.15f};
    for (int i = 0; i < 2; i++) {
        EXPECT(after[i].history[0] == s[i].amax && after[i].amax == 0.0f, "slot %d: newest %g, amax %g", i,
               after[i].history[0], after[i].amax);
        for (int h = 1; h < FP8_HISTORY; h++)
            EXPECT(after[i].history[h] == s[i].history[h - 1], "slot %d: history[%d] %g", i, h, after[i].history[h]);
        float scale = ldexpf(1.0f, fp8_scale_exponent(most[i], s[i].max));
        EXPECT(after[i].scale == scale && after[i].scale_inv == 1.0f / scale, "slot %d: scale %g, want %g", i,
               after[i].scale, scale);
    }
    CUDA_CHECK(cudaFree(d));
    return TEST_RESULT;
}

// Whether code `got` is `want` or one of its two neighbours on the format's grid (and a number).
static bool fp8_same_or_next(uint8_t got, uint8_t want, bool e5m2) {
    if (got == want) return true;
    if (!isfinite(ref_fp8_decode(got, e5m2))) return false;
    int a = got & 0x7F, b = want & 0x7F;
    if ((got ^ want) & 0x80) return a + b <= 1;  // across zero: a zero and the smallest of the other sign
    return abs(a - b) == 1;
}

// One fused cast, on a tensor [rows, cols] whose sides are no multiple of the 64 x 64 tile, with
// a delayed scale into poisoned buffers (0xFF is a NaN in both formats); fused(out, out_t, s)
// runs it, writing both layouts, or (transposed false) only the row-major one:
//  - against the unfused path (the producing kernel wrote `unfused` in bf16, a plain cast reads
//    it): the same codes and the same amax, bit for bit;
//  - against the CPU reference's values `ref` rounded to bf16 and encoded at the same scale: each
//    code equal or, rarely, a neighbour (the kernel computes in fp32, with fast exponentials, so
//    a value within an fp32 rounding of a midpoint may round the other way; a wrong scale moves
//    codes by 4 or 8, a wrong value or place by anything);
//  - nothing written past the tensor's end.
template <typename Fused>
static int fp8_check_fused(const char* name, Fused fused, bool transposed, const bf16* unfused, const double* ref,
                           int rows, int cols, bool e5m2) {
    int failed = 0;
    size_t n = (size_t)rows * cols;
    double amax_ref = 0.0;
    for (size_t i = 0; i < n; i++) amax_ref = fmax(amax_ref, fabs(ref[i]));
    Fp8Scale s = fp8_scale_initial(e5m2);
    int k = fp8_scale_exponent((float)amax_ref, s.max);
    s.scale = ldexpf(1.0f, k), s.scale_inv = ldexpf(1.0f, -k);
    uint8_t* d_codes[4];  // unfused row-major, unfused transposed, fused row-major, fused transposed
    for (auto& d : d_codes) d = (uint8_t*)device_alloc_poisoned(n);
    Fp8Scale* d_s;
    CUDA_CHECK(cudaMalloc(&d_s, 2 * sizeof(Fp8Scale)));
    CUDA_CHECK(cudaMemcpy(d_s, &s, sizeof(s), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_s + 1, &s, sizeof(s), cudaMemcpyHostToDevice));
    fp8_cast(d_codes[0], d_codes[1], unfused, rows, cols, e5m2, d_s, FP8_CAST_DELAYED, 0);
    fused(d_codes[2], transposed ? d_codes[3] : NULL, d_s + 1);
    uint8_t* codes[4];
    for (int i = 0; i < 4; i++) {
        codes[i] = (uint8_t*)malloc(n + 256);
        CUDA_CHECK(cudaMemcpy(codes[i], d_codes[i], n + 256, cudaMemcpyDeviceToHost));
    }
    Fp8Scale after[2];
    CUDA_CHECK(cudaMemcpy(after, d_s, sizeof(after), cudaMemcpyDeviceToHost));
    EXPECT(!memcmp(codes[2], codes[0], n) && (!transposed || !memcmp(codes[3], codes[1], n)),
           "%s: the fused codes differ from the unfused path's", name);
    EXPECT(!memcmp(&after[1].amax, &after[0].amax, sizeof(float)), "%s: amax %.9g fused, %.9g unfused", name,
           after[1].amax, after[0].amax);
    EXPECT(fabs(after[1].amax - amax_ref) <= ldexp(amax_ref, -8), "%s: amax %.9g, the reference's %.9g", name,
           after[1].amax, amax_ref);
    int far = 0, next = 0, overrun = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            uint8_t want = ref_fp8_encode(round_bf16(ref[(size_t)r * cols + c]) * s.scale, e5m2);
            uint8_t got = codes[2][(size_t)r * cols + c], got_t = codes[3][(size_t)c * rows + r];
            far += !fp8_same_or_next(got, want, e5m2) || (transposed && !fp8_same_or_next(got_t, want, e5m2));
            next += got != want;
        }
    for (int i = 2; i < 4; i++)
        for (size_t j = i == 3 && !transposed ? 0 : n; j < n + 256; j++) overrun += codes[i][j] != 0xFF;
    EXPECT(far == 0 && next <= (int)(n / 1000), "%s: %d codes away from the reference's, %d a neighbour of it (of %zu)",
           name, far, next, n);
    EXPECT(overrun == 0, "%s: %d bytes written past the end (or into the unasked transposed copy)", name, overrun);
    for (int i = 0; i < 4; i++) {
        free(codes[i]);
        CUDA_CHECK(cudaFree(d_codes[i]));
    }
    CUDA_CHECK(cudaFree(d_s));
    return failed;
}

// The fused path's casts: the forward's RMSNorm straight to E4M3 (and its rstd, which must be the
// bf16 norm's), RMSNorm's output again from its input and saved rstd (the backward's producer),
// SwiGLU's from gate_up, SwiGLU's backward from d_out and gate_up (whose halves meet inside a
// tile here: F = 104).
static int test_fp8_gpu_fused_casts(void) {
    REQUIRE_GPU();
    int failed = 0;
    int rows = 136, C = 200, F = 104;
    double *x = random_array((size_t)rows * C, 2.0), *w = random_array(C, 1.0);
    bf16 *d_x = to_device_bf16(x, (size_t)rows * C), *d_w = to_device_bf16(w, C);
    bf16* d_y = (bf16*)device_alloc_poisoned((size_t)rows * C * 2);
    float *d_rstd = (float*)device_alloc_poisoned(rows * 4), *d_rstd_fused = (float*)device_alloc_poisoned(rows * 4);
    rmsnorm_forward(d_y, d_rstd, d_x, d_w, rows, C, 1e-6f, 0);
    double *y = (double*)malloc((size_t)rows * C * 8), *rstd_ref = (double*)malloc(rows * 8);
    ref_rmsnorm_forward(y, rstd_ref, x, w, rows, C, 1e-6);
    auto norm = [&](uint8_t* out, uint8_t*, Fp8Scale* s) {
        fp8_rmsnorm_forward(out, d_rstd_fused, d_x, d_w, rows, C, 1e-6f, s, 0);
    };
    failed |= fp8_check_fused("rmsnorm forward", norm, false, d_y, y, rows, C, false);
    double *rstd = from_device_f32(d_rstd, rows), *rstd_fused = from_device_f32(d_rstd_fused, rows);
    EXPECT(!memcmp(rstd, rstd_fused, rows * sizeof(double)), "the fused rmsnorm saved another rstd");
    auto norm_again = [&](uint8_t* out, uint8_t* out_t, Fp8Scale* s) {
        fp8_produce(out, out_t, Fp8FromRmsnorm{d_x, d_rstd, d_w, C}, rows, C, false, s, FP8_CAST_DELAYED, 0);
    };
    failed |= fp8_check_fused("rmsnorm from rstd", norm_again, true, d_y, y, rows, C, false);

    size_t n = (size_t)rows * F;
    double *gu = random_array(2 * n, 2.0), *d_out = random_array(n, 1e-3);  // gradient-sized
    bf16 *d_gu = to_device_bf16(gu, 2 * n), *d_dout = to_device_bf16(d_out, n);
    bf16 *d_act = (bf16*)device_alloc_poisoned(n * 2), *d_dgu = (bf16*)device_alloc_poisoned(2 * n * 2);
    swiglu_forward(d_act, d_gu, rows, F, 0);
    swiglu_backward(d_dgu, d_dout, d_gu, rows, F, 0);
    double *act = (double*)malloc(n * 8), *dgu = (double*)malloc(2 * n * 8);
    ref_swiglu_forward(act, gu, rows, F);
    ref_swiglu_backward(dgu, d_out, gu, rows, F);
    auto swiglu = [&](uint8_t* out, uint8_t* out_t, Fp8Scale* s) {
        fp8_produce(out, out_t, Fp8FromSwiglu{d_gu, F}, rows, F, false, s, FP8_CAST_DELAYED, 0);
    };
    auto swiglu_grad = [&](uint8_t* out, uint8_t* out_t, Fp8Scale* s) {
        fp8_produce(out, out_t, Fp8FromSwigluBackward{d_dout, d_gu, F}, rows, 2 * F, true, s, FP8_CAST_DELAYED, 0);
    };
    failed |= fp8_check_fused("swiglu", swiglu, true, d_act, act, rows, F, false);
    failed |= fp8_check_fused("swiglu backward", swiglu_grad, true, d_dgu, dgu, rows, 2 * F, true);
    double* all[] = {x, w, rstd, rstd_fused, y, rstd_ref, gu, d_out, act, dgu};
    for (double* a : all) free(a);
    void* dev[] = {d_x, d_w, d_y, d_rstd, d_rstd_fused, d_gu, d_dout, d_act, d_dgu};
    for (void* d : dev) CUDA_CHECK(cudaFree(d));
    return TEST_RESULT;
}

// The values a cast stores, read back: q * scale_inv for every element of x [n] at `scale`.
static double* fp8_dequantized(const double* x, size_t n, double scale, bool e5m2) {
    double* q = (double*)malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) q[i] = ref_fp8_decode(ref_fp8_encode(x[i] * scale, e5m2), e5m2) / scale;
    return q;
}

static const ModelConfig FP8_TEST_CONFIG = {512, 128, 2, 4, 2, 64, 256, 64, 10000.0f, 1e-6f};

// One layer's matrix through layer_forward and layer_backward in FP8 (the trainer's own calls),
// against the fp64 reference on the quantized values: the casts are exact, so what remains is
// the matmuls' accumulation and the rounding of their bf16 outputs (2^-9: 4e-3 relative L2
// allowed, as for the BF16 matmul tests) and of the fp32 weight gradient (1e-3: Hopper's FP8
// accumulators are narrower than fp32 before promotion).
static int test_fp8_gpu_layer_products(void) {
    REQUIRE_GPU();
    int failed = 0;
    GPT m;
    gpt_create(&m, &FP8_TEST_CONFIG, 2, FP8_TEST_CONFIG.seq_len, 0, 128, &ONE_GPU, OPTIMIZER_ADAMW,
               (Fp8Mode){true, FP8_CURRENT, false, false});
    const ParamTensor* t = param(&m.table, P_GATE_UP, 0);
    int N = m.N, O = (int)t->rows, I = (int)t->cols;
    double *W = random_array((size_t)O * I, 0.05), *x = random_array((size_t)N * I, 1.0);
    double* dy = random_array((size_t)N * O, 1e-4);  // gradient-sized: E5M2's scale must lift them
    for (size_t i = 0; i < (size_t)O * I; i++) W[i] = round_bf16(W[i]);
    for (size_t i = 0; i < (size_t)N * I; i++) x[i] = round_bf16(x[i]);
    for (size_t i = 0; i < (size_t)N * O; i++) dy[i] = round_bf16(dy[i]);
    upload_bf16(m.params + t->offset, W, (size_t)O * I);
    bf16 *d_x = to_device_bf16(x, (size_t)N * I), *d_dy = to_device_bf16(dy, (size_t)N * O);
    bf16 *d_y = (bf16*)device_alloc_poisoned((size_t)N * O * 2), *d_dx = (bf16*)device_alloc_poisoned((size_t)N * I * 2);
    CUDA_CHECK(cudaMemset(m.grads, 0xFF, m.table.n_elements * 4));  // NaN: the first write sets dW
    m.fp8.weights_stale = true;
    fp8_cast_weights(&m, 0);
    fp8_cast_weights(&m, 1);
    layer_forward(&m, P_GATE_UP, 0, N, d_y, d_x, NULL);
    layer_backward(&m, P_GATE_UP, 0, N, d_dx, d_dy, d_x, false);
    Fp8Scale sw = fp8_scale_download(fp8_scale(&m, FP8_ROLE_WEIGHT, P_GATE_UP, 0));
    Fp8Scale sx = fp8_scale_download(fp8_scale(&m, FP8_ROLE_INPUT, P_GATE_UP, 0));
    Fp8Scale sg = fp8_scale_download(fp8_scale(&m, FP8_ROLE_GRAD, P_GATE_UP, 0));
    double scales[3] = {sw.scale, sx.scale, sg.scale}, amax[3] = {0, 0, 0}, maxes[3] = {448, 448, 57344};
    double* arrays[3] = {W, x, dy};
    size_t sizes[3] = {(size_t)O * I, (size_t)N * I, (size_t)N * O};
    for (int a = 0; a < 3; a++) {
        for (size_t i = 0; i < sizes[a]; i++) amax[a] = fmax(amax[a], fabs(arrays[a][i]));
        double want = ldexp(1.0, fp8_scale_exponent((float)amax[a], (float)maxes[a]));
        EXPECT(scales[a] == want, "tensor %d: scale %g, want %g", a, scales[a], want);
    }
    double *Wq = fp8_dequantized(W, sizes[0], scales[0], false), *xq = fp8_dequantized(x, sizes[1], scales[1], false);
    double* dyq = fp8_dequantized(dy, sizes[2], scales[2], true);
    double *y = (double*)malloc(sizes[2] * 8), *dx = (double*)malloc(sizes[1] * 8), *dW = (double*)calloc(sizes[0], 8);
    ref_linear_forward(y, xq, Wq, N, I, O);
    ref_linear_backward(dx, dW, dyq, xq, Wq, N, I, O);
    double *gy = from_device_bf16(d_y, sizes[2]), *gdx = from_device_bf16(d_dx, sizes[1]);
    double* gdW = from_device_f32(m.grads + t->offset, sizes[0]);
    CHECK_CLOSE("fp8 forward", gy, y, sizes[2], 4e-3);
    CHECK_CLOSE("fp8 input gradient", gdx, dx, sizes[1], 4e-3);
    CHECK_CLOSE("fp8 weight gradient", gdW, dW, sizes[0], 1e-3);
    double* all[] = {W, x, dy, Wq, xq, dyq, y, dx, dW, gy, gdx, gdW};
    for (double* a : all) free(a);
    void* dev[] = {d_x, d_dy, d_y, d_dx};
    for (void* d : dev) CUDA_CHECK(cudaFree(d));
    gpt_free(&m);
    return TEST_RESULT;
}

// The whole model on one batch: FP8 gradients against BF16 gradients from the same parameters.
// What to expect: an E5M2 gradient carries a relative rounding error of up to 2^-3 (about 5% RMS
// over a binade), an E4M3 activation or weight up to 2^-4 (2.5%), so every product of a
// layer's backward is off by ~5.5% RMS element by element. A weight's gradient sums such
// products over the tokens, and at initialization those terms mostly cancel (the sum is a few
// times smaller than the sum of the terms' sizes), which multiplies the relative error by that
// factor; dy's error also flows into every earlier layer. Measured on this config on an H100
// over TEST_SEED 1 to 24 (48 cases): 0.20 to 0.24 relative L2 for the matrices, up to 0.35 for
// the worst norm weight (sums over tokens and heads that cancel more), the loss 9e-4 relative at
// the median and 3.5e-3 at worst (7 of the 48 beyond the 2e-3 once allowed). We allow 0.35 and
// 0.6 on gradients, 7e-3 on the loss (twice the worst measured). A wrong scale (by a factor of two
// at least, being a power of two), a wrong transpose or a wrong format shows errors of 1 or more.
// The test also runs delayed scaling,
// calibrated on the same batch: its scales are then the current ones, so its gradients (made on
// the fused path, fp8_fused) must equal current scaling's (unfused) bit for bit.
// With the head in FP8 (--fp8-head, in two chunks of 128 rows: the chunks' offsets count), the
// logits' operands are E4M3 and dlogits E5M2: one more E5M2 gradient above every layer, whose ~5%
// error per token reaches all of them (d_xnorm = dlogits E is dominated by the target's row), so
// the head's run is allowed 0.45 and 0.75; a wrong scale or chunk offset still shows errors of 1.
// Its delayed run is not compared: current scaling scales each chunk by its own amax, delayed
// both by one. With fast accumulation in the forward (K <= 256 here) the tolerances stay.
static int test_fp8_gpu_model_gradients_vs_bf16(void) {
    REQUIRE_GPU();
    int failed = 0;
    const ModelConfig* c = &FP8_TEST_CONFIG;
    int B = 4;
    struct {
        int recompute;
        bool head, fast_accum;
        double matrix_tol, norm_tol;
    } variants[] = {{0, false, false, 0.35, 0.6}, {1, false, false, 0.35, 0.6}, {1, true, false, 0.45, 0.75},
                    {1, false, true, 0.35, 0.6}};
    for (auto& v : variants) {
        ParamTable table;
        param_table_build(&table, c, 1);
        size_t n = table.n_elements;
        double* p = random_params(c, &table, 0.08);
        uint16_t* window = random_window(B, c->seq_len, c->vocab_size);
        double *g_bf = (double*)calloc(n, 8), *g_f8 = (double*)calloc(n, 8), *g_delayed = (double*)calloc(n, 8);
        double loss[3];  // BF16, FP8 current, FP8 delayed (one model at a time: matmul's state is global)
        for (int run = 0; run < 2; run++) {
            GPT m;
            gpt_create(&m, c, B, c->seq_len, v.recompute ? c->n_layer : 0, 128, &ONE_GPU, OPTIMIZER_ADAMW,
                       run == 1 ? (Fp8Mode){true, FP8_CURRENT, v.head, v.fast_accum} : FP8_OFF);
            for (int l = 0; l < c->n_layer; l++) {  // BF16: our fused GEMMs; FP8: cuBLASLt, SwiGLU apart
                EXPECT(gate_up_fused(&m, l) == (run == 0), "run %d, layer %d: the gate/up path", run, l);
                EXPECT(down_swiglu_fused(&m, l) == (run == 0), "run %d, layer %d: the down backward path", run, l);
            }
            Uploader up;
            uploader_create(&up, m.N, c->vocab_size);
            m.fp8.weights_stale = true;
            loss[run] = gpu_forward_backward(&m, &up, p, window, run ? g_f8 : g_bf, 1);
            if (run == 1) {  // delayed: the amaxes of this batch become the history, then the same batch again
                m.fp8.scaling = FP8_DELAYED;
                fp8_update_scales(m.fp8.scales, (int)fp8_n_scales(c), m.stream);
                m.fp8.calibrated = true;
                m.fp8.weights_stale = true;
                loss[2] = gpu_forward_backward(&m, &up, p, window, g_delayed, 1);
            }
            uploader_free(&up);
            gpt_free(&m);
        }
        char what[64];
        snprintf(what, sizeof(what), "recompute %d%s%s", v.recompute, v.head ? ", head in FP8" : "",
                 v.fast_accum ? ", fast accumulation" : "");
        EXPECT(fabs(loss[1] - loss[0]) < 7e-3 * loss[0], "%s: loss %.5f in FP8 vs %.5f in BF16", what, loss[1], loss[0]);
        double worst[2] = {0, 0};
        for (int i = 0; i < table.n_tensors; i++) {
            const ParamTensor* t = &table.tensors[i];
            double err = rel_l2(g_f8 + t->offset, g_bf + t->offset, (size_t)(t->rows * t->cols));
            worst[!t->decay] = fmax(worst[!t->decay], err);
            EXPECT(err < (t->decay ? v.matrix_tol : v.norm_tol), "%s: gradient of %s: FP8 vs BF16 relative L2 %.3g",
                   what, t->name, err);
        }
        if (!v.head)
            EXPECT(loss[2] == loss[1] && !memcmp(g_delayed, g_f8, n * 8),
                   "%s: delayed scaling calibrated on the batch differs from current scaling", what);
        printf("    %s: loss %.5f FP8 vs %.5f BF16; worst relative L2 of FP8 gradients: matrices %.3g, "
               "norm weights %.3g\n", what, loss[1], loss[0], worst[0], worst[1]);
        free(p); free(window); free(g_bf); free(g_f8); free(g_delayed);
        param_table_free(&table);
    }
    return TEST_RESULT;
}

// --fp8-log-scales (with the head in FP8): the run's numbers are those of the same run without it;
// each of its steps logs one line of scales on stdout and one in log.jsonl; and the last step's
// says what that step's checkpoint holds. The expected line is computed here from fp8_scales.bin:
// per kind and role, the range over the layers of log2 of the scales and the largest of the
// history's newest amaxes (delayed scaling), printed as the log prints them (%.9g round-trips a
// float). Then a resume of that checkpoint with the head in BF16 says its scales start afresh.
static int test_fp8_gpu_log_scales(void) {
    REQUIRE_GPU();
    int failed = 0;
    char dir[64], cmd[2048], path[256], path_b[256], err[256];
    EXPECT(make_shard_dir(dir, 60000, 512), "shard");
    const char* runs[] = {"plain", "logged"};
    for (int r = 0; r < 2; r++) {
        snprintf(cmd, sizeof(cmd), SMALL_RUN "--fp8 1 --fp8-head 1 %s --train-data '%s/train_*.bin' --steps 6 "
                 "--ckpt-every 6 --out %s/%s > %s/%s.txt", r ? "--fp8-log-scales 1" : "", dir, dir, runs[r], dir, runs[r]);
        EXPECT(system(cmd) == 0, "run failed: %s", cmd);
    }
    snprintf(path, sizeof(path), "%s/plain/log.jsonl", dir);
    snprintf(path_b, sizeof(path_b), "%s/logged/log.jsonl", dir);
    failed |= compare_logged_steps(path, path_b, 1, 6);
    snprintf(cmd, sizeof(cmd), "grep -c '\"fp8_scales\"' %s/logged/log.jsonl | grep -qx 6 && grep -c '^step .*fp8 scales' "
             "%s/logged.txt | grep -qx 6 && ! grep -q fp8_scales %s/plain/log.jsonl", dir, dir, dir);
    EXPECT(system(cmd) == 0, "not one scales line per step, on stdout and in log.jsonl, and only when asked (%s)", dir);
    char *log = NULL, *state = NULL;
    size_t log_len = 0, state_len = 0;
    snprintf(path, sizeof(path), "%s/logged/log.jsonl", dir);
    EXPECT(read_whole_file(path, SIZE_MAX, &log, &log_len, err, sizeof(err)) == 0, "%s", err);
    snprintf(path, sizeof(path), "%s/logged/ckpt_6/fp8_scales.bin", dir);
    EXPECT(read_whole_file(path, SIZE_MAX, &state, &state_len, err, sizeof(err)) == 0, "%s", err);
    const ModelConfig& c = FP8_TEST_CONFIG;  // SMALL_RUN's model (its shapes and layers)
    const char* line = log ? strstr(log, "{\"step\": 6, \"fp8_scales\"") : NULL;
    EXPECT(line, "no scales line for step 6");
    if (line && state && state_len == sizeof(Fp8StateHeader) + fp8_n_scales(&c) * sizeof(Fp8Scale)) {
        const Fp8Scale* scales = (const Fp8Scale*)(state + sizeof(Fp8StateHeader));
        ParamKind kinds[] = {P_QKV, P_ATTN_OUT, P_GATE_UP, P_DOWN, P_EMBED};
        for (ParamKind kind : kinds) {
            char want[512];
            size_t len = snprintf(want, sizeof(want), "\"%s\": {", kind == P_EMBED ? "head" : PARAM_KINDS[kind].name);
            for (int role = 0; role < FP8_ROLES; role++) {
                int lo = 1000, hi = -1000;
                float amax = 0.0f;
                for (int l = 0; l < (kind == P_EMBED ? 1 : c.n_layer); l++) {
                    const Fp8Scale* sc = &scales[fp8_scale_index(&c, (Fp8Role)role, kind, l)];
                    int k = (int)lround(log2(sc->scale));
                    lo = k < lo ? k : lo;
                    hi = k > hi ? k : hi;
                    amax = sc->history[0] > amax ? sc->history[0] : amax;
                }
                len += snprintf(want + len, sizeof(want) - len, "%s\"%s\": {\"k\": [%d, %d], \"amax\": %.9g}",
                                role ? ", " : "", FP8_ROLE_NAMES[role], lo, hi, amax);
            }
            const char* end = strchr(line, '\n');
            EXPECT(strstr(line, want) && strstr(line, want) < end, "step 6's line lacks %s (the checkpoint's)", want);
        }
    } else {
        EXPECT(false, "fp8_scales.bin of step 6: %zu bytes", state_len);
    }
    free(log);
    free(state);
    snprintf(cmd, sizeof(cmd), SMALL_RUN "--fp8 1 --train-data '%s/train_*.bin' --steps 7 --ckpt-every 0 --resume "
             "%s/logged/ckpt_6 --out %s/other | grep -q 'FP8 scales of the other --fp8-head; the scales start afresh'",
             dir, dir, dir);
    EXPECT(system(cmd) == 0, "a resume with the head in BF16 did not say its scales start afresh");
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

// Data parallelism with FP8 (two GPUs; skipped with fewer). Delayed scaling: every rank takes the
// max of the step's amaxes over the ranks before they join the history (fp8_agree_amaxes), so the
// ranks' scale arrays must be bit-identical after every step. --fp8-log-scales gathers every
// rank's array and says whether they are (memcmp on rank 0); the test reads that at each of 10
// steps, with the head in FP8 too. Its negative control: current scaling, where each rank
// measures its own tensors, must be said to differ at some step (else the check could not see
// rank 1 at all).
static int test_fp8_two_gpus_scales_agree(void) {
    REQUIRE_TWO_GPUS();
    int failed = 0;
    char dir[64], cmd[2048];
    EXPECT(make_shard_dir(dir, 60000, 512), "shard");
    const char* scalings[] = {"delayed", "current"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof(cmd), SMALL_RUN "--gpus 2 --zero 1 --fp8 1 --fp8-head 1 --fp8-scaling %s --fp8-log-scales 1 "
                 "--steps 10 --ckpt-every 0 --train-data '%s/train_*.bin' --out %s/%s > %s/%s.txt 2>&1", scalings[i], dir,
                 dir, scalings[i], dir, scalings[i]);
        EXPECT(system(cmd) == 0, "run failed: %s", cmd);
    }
    snprintf(cmd, sizeof(cmd), "grep -c '\"fp8_ranks\": \"identical\"' %s/delayed/log.jsonl | grep -qx 10 && "
             "! grep -q '\"fp8_ranks\": \"different\"' %s/delayed/log.jsonl", dir, dir);
    EXPECT(system(cmd) == 0, "delayed scaling: the 2 ranks' scales are not identical at each of the 10 steps (%s/delayed)",
           dir);
    snprintf(cmd, sizeof(cmd), "grep -q '\"fp8_ranks\": \"different\"' %s/current/log.jsonl", dir);
    EXPECT(system(cmd) == 0, "current scaling: the ranks' own amaxes were never seen to differ (%s/current)", dir);
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

// FP8 with delayed scaling, ZeRO 1 on two GPUs, validating every 3 steps: 10 steps straight, and
// 5 (checkpoint, stop) then resumed to 10; steps 6..10 must log bit-identical losses and gradient
// norms. The checkpoint holds rank 0's scales, which are every rank's only because the ranks
// agree on their amaxes each step: before that, rank 1 resumed on rank 0's scales and drifted.
static int test_fp8_two_gpus_resume_is_bit_exact(void) {
    REQUIRE_TWO_GPUS();
    int failed = 0;
    char dir[64], cmd[2048], path[256], path_b[256];
    EXPECT(make_shard_dir(dir, 60000, 512), "shard");
    const char* flags[] = {"--ckpt-every 0 --out %s/straight", "--ckpt-every 5 --stop-at 5 --out %s/split",
                           "--ckpt-every 0 --resume latest --out %s/split"};
    for (int r = 0; r < 3; r++) {
        char extra[256];
        snprintf(extra, sizeof(extra), flags[r], dir);
        snprintf(cmd, sizeof(cmd), SMALL_RUN "--gpus 2 --zero 1 --fp8 1 --val-data '%s/train_*.bin' --val-every 3 "
                 "--val-batches 2 --steps 10 --train-data '%s/train_*.bin' %s > %s/run%d.txt 2>&1", dir, dir, extra, dir, r);
        EXPECT(system(cmd) == 0, "run %d failed: %s", r, cmd);
    }
    snprintf(path, sizeof(path), "%s/straight/log.jsonl", dir);
    snprintf(path_b, sizeof(path_b), "%s/split/log.jsonl", dir);
    failed |= compare_logged_steps(path, path_b, 1, 10);
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

// The whole model, one delayed-scaling step after calibration (two micro-batches), with and without
// recompute, with the head in FP8 (--fp8-head), and with heads of 128 (the attention forward's other
// kernel): the fused path (fp8_fused) against the unfused one from the same scales, parameters
// and batches. The loss, every gradient and every scale (the amaxes the step recorded) must be
// equal bit for bit: among them the attention output's codes, which the fused path takes from the
// attention forward and the unfused one casts from its bf16 output. With recompute, the fused path
// must also leave the shared bf16 buffers of the norms' and SwiGLU's outputs untouched (poisoned
// before, poisoned after): it never makes them.
static int test_fp8_gpu_fused_step_is_bit_exact(void) {
    REQUIRE_GPU();
    int failed = 0;
    int B = 4, accum = 2;
    for (int variant = 0; variant < 4; variant++) {
        int recompute = variant == 1 || variant == 2;
        bool head = variant == 2;  // the head in FP8 too, which is cast as it is on either path
        ModelConfig config = FP8_TEST_CONFIG;
        if (variant == 3) config.head_dim = 128;
        const ModelConfig* c = &config;
        char what[64];
        snprintf(what, sizeof(what), "recompute %d%s, head_dim %d", recompute, head ? ", head in FP8" : "",
                 c->head_dim);
        GPT m;
        gpt_create(&m, c, B, c->seq_len, recompute ? c->n_layer : 0, 128, &ONE_GPU, OPTIMIZER_ADAMW,
                   (Fp8Mode){true, FP8_DELAYED, head, false});
        Uploader up;
        uploader_create(&up, m.N, c->vocab_size);
        size_t n = m.table.n_elements, n_scales = fp8_n_scales(c);
        double* p = random_params(c, &m.table, 0.08);
        uint16_t* window = random_window(B * accum, c->seq_len, c->vocab_size);
        double* scratch = (double*)calloc(n, 8);
        m.fp8.weights_stale = true;
        gpu_forward_backward(&m, &up, p, window, scratch, accum);  // uncalibrated: measures every tensor
        fp8_update_scales(m.fp8.scales, (int)n_scales, m.stream);
        m.fp8.calibrated = true;
        Fp8Scale* calibrated = (Fp8Scale*)malloc(n_scales * sizeof(Fp8Scale));
        CUDA_CHECK(cudaMemcpy(calibrated, m.fp8.scales, n_scales * sizeof(Fp8Scale), cudaMemcpyDeviceToHost));
        double loss[2], *grads[2];
        Fp8Scale* scales[2];
        bf16* shared[] = {m.act.xnorm_attn[0], m.act.xnorm_mlp[0], m.act.mlp_act[0]};
        size_t row_bytes[] = {(size_t)c->d_model * 2, (size_t)c->d_model * 2, (size_t)c->ffn_dim * 2}, shared_bytes[3];
        for (int i = 0; i < 3; i++) shared_bytes[i] = m.N * row_bytes[i];
        for (int fuse = 0; fuse < 2; fuse++) {
            CUDA_CHECK(cudaMemcpy(m.fp8.scales, calibrated, n_scales * sizeof(Fp8Scale), cudaMemcpyHostToDevice));
            for (int i = 0; i < 3; i++) CUDA_CHECK(cudaMemset(shared[i], 0xFF, shared_bytes[i]));
            m.fp8.fuse = fuse;
            m.fp8.weights_stale = true;
            EXPECT(fp8_fused(&m) == (fuse == 1), "%s: fp8_fused is %d with fuse %d", what, fp8_fused(&m),
                   fuse);
            grads[fuse] = (double*)calloc(n, 8);
            loss[fuse] = gpu_forward_backward(&m, &up, p, window, grads[fuse], accum);
            scales[fuse] = (Fp8Scale*)malloc(n_scales * sizeof(Fp8Scale));
            CUDA_CHECK(cudaMemcpy(scales[fuse], m.fp8.scales, n_scales * sizeof(Fp8Scale), cudaMemcpyDeviceToHost));
            for (int i = 0; fuse && recompute && i < 3; i++) {
                uint8_t* host = (uint8_t*)malloc(shared_bytes[i]);
                CUDA_CHECK(cudaMemcpy(host, shared[i], shared_bytes[i], cudaMemcpyDeviceToHost));
                size_t written = 0;
                for (size_t j = 0; j < shared_bytes[i]; j++) written += host[j] != 0xFF;
                EXPECT(written == 0, "fused: %zu bytes of shared buffer %d written", written, i);
                free(host);
            }
        }
        EXPECT(loss[1] == loss[0], "%s: loss %.9g fused, %.9g unfused", what, loss[1], loss[0]);
        for (int i = 0; i < m.table.n_tensors; i++) {
            const ParamTensor* t = &m.table.tensors[i];
            EXPECT(!memcmp(grads[1] + t->offset, grads[0] + t->offset, (size_t)(t->rows * t->cols) * 8),
                   "%s: the gradient of %s differs fused and unfused", what, t->name);
        }
        EXPECT(!memcmp(scales[1], scales[0], n_scales * sizeof(Fp8Scale)),
               "%s: the scales (their amaxes) differ fused and unfused", what);
        printf("    %s: loss %.6f both ways\n", what, loss[0]);
        for (int fuse = 0; fuse < 2; fuse++) free(grads[fuse]), free(scales[fuse]);
        free(p); free(window); free(scratch); free(calibrated);
        uploader_free(&up);
        gpt_free(&m);
    }
    return TEST_RESULT;
}

// The unfused FP8 path (current scaling: every cast measures, so the bf16 norms and SwiGLU are made,
// and recomputed, as in BF16) with k = 0, 1 and L = 2 recomputed layers, the head in FP8 too: the
// same parameters and batch give the same loss and every gradient bit for bit, and the same
// amaxes in the scales.
static int test_fp8_gpu_recompute_changes_nothing(void) {
    REQUIRE_GPU();
    int failed = 0;
    const ModelConfig* c = &FP8_TEST_CONFIG;
    int B = 4;
    const int recompute_layers[] = {0, 1, 2};
    double loss[3], *grads[3];
    Fp8Scale* scales[3];
    ParamTable table;
    param_table_build(&table, c, 1);
    size_t n = table.n_elements, n_scales = fp8_n_scales(c);
    double* p = random_params(c, &table, 0.08);
    uint16_t* window = random_window(B, c->seq_len, c->vocab_size);
    for (int run = 0; run < 3; run++) {
        GPT m;
        gpt_create(&m, c, B, c->seq_len, recompute_layers[run], 128, &ONE_GPU, OPTIMIZER_ADAMW,
                   (Fp8Mode){true, FP8_CURRENT, true, false});
        EXPECT(!fp8_fused(&m), "current scaling runs the fused path");
        Uploader up;
        uploader_create(&up, m.N, c->vocab_size);
        grads[run] = (double*)calloc(n, 8);
        loss[run] = gpu_forward_backward(&m, &up, p, window, grads[run], 1);
        scales[run] = (Fp8Scale*)malloc(n_scales * sizeof(Fp8Scale));
        CUDA_CHECK(cudaMemcpy(scales[run], m.fp8.scales, n_scales * sizeof(Fp8Scale), cudaMemcpyDeviceToHost));
        uploader_free(&up);
        gpt_free(&m);
    }
    for (int run = 1; run < 3; run++) {
        int k = recompute_layers[run];
        EXPECT(loss[run] == loss[0], "FP8, %d of %d layers recomputed: loss %.9g, not %.9g", k, c->n_layer, loss[run],
               loss[0]);
        for (int i = 0; i < table.n_tensors; i++) {
            const ParamTensor* t = &table.tensors[i];
            EXPECT(!memcmp(grads[run] + t->offset, grads[0] + t->offset, (size_t)(t->rows * t->cols) * 8),
                   "FP8, %d of %d layers recomputed: the gradient of %s differs", k, c->n_layer, t->name);
        }
        EXPECT(!memcmp(scales[run], scales[0], n_scales * sizeof(Fp8Scale)),
               "FP8, %d of %d layers recomputed: the scales (their amaxes) differ", k, c->n_layer);
    }
    printf("    loss %.6f with 0, 1 and 2 of 2 layers recomputed\n", loss[0]);
    for (int run = 0; run < 3; run++) free(grads[run]), free(scales[run]);
    free(p);
    free(window);
    param_table_free(&table);
    return TEST_RESULT;
}

// A model whose matrices end in partial 64 x 64 tiles, along both sides: d_model 80; qkv [256, 80],
// attn_out [80, 128], gate_up [288, 80], down [80, 144], the embedding [528, 80].
static const ModelConfig FP8_PARTIAL_TILES_CONFIG = {528, 80, 2, 2, 1, 64, 144, 64, 10000.0f, 1e-6f};

// What an optimizer step writes, read back from the device: the master and bf16 weights, the
// optimizer's state (both moments), the FP8 weights and their transposes, the scales.
typedef struct {
    float* master;
    bf16* params;
    uint8_t* opt_state;
    uint8_t* weights;
    uint8_t* weights_t;
    Fp8Scale* scales;
} Fp8StepState;

static Fp8StepState fp8_step_state_download(GPT* m) {
    size_t n = m->table.n_elements, n_scales = fp8_n_scales(&m->cfg);
    Fp8StepState s = {(float*)malloc(n * 4), (bf16*)malloc(n * 2), (uint8_t*)malloc(m->opt_state_bytes),
                      (uint8_t*)malloc(n), (uint8_t*)malloc(n), (Fp8Scale*)malloc(n_scales * sizeof(Fp8Scale))};
    gpt_gather_master(m, s.master);
    CUDA_CHECK(cudaMemcpy(s.params, m->params, n * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(s.opt_state, m->opt_state, m->opt_state_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(s.weights, m->fp8.weights, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(s.weights_t, m->fp8.weights_t, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(s.scales, m->fp8.scales, n_scales * sizeof(Fp8Scale), cudaMemcpyDeviceToHost));
    return s;
}

static void fp8_step_state_free(Fp8StepState* s) {
    free(s->master), free(s->params), free(s->opt_state), free(s->weights), free(s->weights_t), free(s->scales);
}

// Whether the update making the FP8 weights (a) and AdamW with the forward's cast (b) left every
// byte alike (the FP8 buffers whole: both paths leave the BF16 tensors' part as it was); and
// whether a wrote every code of every FP8 matrix (the buffers start as 0xFF: E4M3's NaN, which no
// finite weight rounds to). Says what differs; returns 1 if anything does.
static int fp8_step_states_agree(const GPT* m, const Fp8StepState* a, const Fp8StepState* b, const char* what) {
    int failed = 0;
    size_t n = m->table.n_elements, n_scales = fp8_n_scales(&m->cfg);
    EXPECT(!memcmp(a->master, b->master, n * 4), "%s: the master weights differ", what);
    EXPECT(!memcmp(a->params, b->params, n * 2), "%s: the bf16 weights differ", what);
    EXPECT(!memcmp(a->opt_state, b->opt_state, m->opt_state_bytes), "%s: the moments differ", what);
    EXPECT(!memcmp(a->weights, b->weights, n), "%s: the FP8 weights W differ", what);
    EXPECT(!memcmp(a->weights_t, b->weights_t, n), "%s: the FP8 weights W^T differ", what);
    EXPECT(!memcmp(a->scales, b->scales, n_scales * sizeof(Fp8Scale)), "%s: the scales differ", what);
    for (int i = 0; i < m->table.n_tensors; i++) {
        const ParamTensor* t = &m->table.tensors[i];
        if (!fp8_matrix(m, t->kind)) continue;
        size_t unwritten = 0;
        for (size_t j = t->offset; j < t->offset + (size_t)(t->rows * t->cols); j++)
            unwritten += (a->weights[j] == 0xFF) + (a->weights_t[j] == 0xFF);
        EXPECT(unwritten == 0, "%s: %zu codes of %s's W and W^T were not written", what, unwritten, t->name);
    }
    return failed;
}

// One AdamW step of an FP8 model (delayed scaling), from one state two ways: the update making the
// FP8 weights itself (fp8_weights_by_adamw) against AdamW alone followed by the forward's cast of
// every layer (fp8_cast_weights, as the next forward runs it), on matrices with partial tiles, the
// head in BF16 and in FP8. The master and bf16 weights, both moments, W and W^T and the scales
// (with each weight's amax recorded) must be equal byte for byte. The state: random weights,
// moments and gradients, whose norm (about 20) the clip at 1 scales down; weight decay on the
// matrices and the embedding, not on the norms (their flags); amaxes in the history that saturate
// some weights and not others. After the fused step nothing is left for the forward to cast.
static int test_fp8_gpu_adamw_makes_the_weights(void) {
    REQUIRE_GPU();
    int failed = 0;
    const ModelConfig* c = &FP8_PARTIAL_TILES_CONFIG;
    OptimConfig o = {1e-2f, 0.1f, 0.1f, 0.9f, 0.95f, 1e-8f, 1.0f, 2, 20, 0, 0.2f};
    for (int head = 0; head < 2; head++) {
        GPT m;
        gpt_create(&m, c, 2, c->seq_len, 0, 64, &ONE_GPU, OPTIMIZER_ADAMW, (Fp8Mode){true, FP8_DELAYED, head == 1, false});
        size_t n = m.table.n_elements, n_scales = fp8_n_scales(c);
        float *master = (float*)calloc(n, 4), *grads = (float*)calloc(n, 4);
        uint8_t* opt = (uint8_t*)calloc(m.opt_state_bytes, 1);
        float *exp_avg = (float*)opt_part(&m, opt, OPT_EXP_AVG, 0), *exp_avg_sq = (float*)opt_part(&m, opt, OPT_EXP_AVG_SQ, 0);
        for (int i = 0; i < m.table.n_tensors; i++) {
            const ParamTensor* t = &m.table.tensors[i];
            for (size_t j = t->offset; j < t->offset + (size_t)(t->rows * t->cols); j++) {
                master[j] = (float)(0.08 * rand_normal());
                grads[j] = (float)(0.05 * rand_normal());
                exp_avg[j] = (float)(0.01 * rand_normal());
                exp_avg_sq[j] = (float)(1e-4 * fabs(rand_normal()));
            }
        }
        Fp8Scale* scales = (Fp8Scale*)malloc(n_scales * sizeof(Fp8Scale));
        CUDA_CHECK(cudaMemcpy(scales, m.fp8.scales, n_scales * sizeof(Fp8Scale), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n_scales; i++) {  // the weights' largest magnitudes are about 0.35
            scales[i].history[0] = (float)(0.1 + 0.4 * rand_uniform());
            scales[i].amax = (float)(0.1 + 0.4 * rand_uniform());
        }
        Fp8StepState got[2];
        for (int fused = 0; fused < 2; fused++) {
            gpt_upload_state(&m, master, NULL);
            CUDA_CHECK(cudaMemcpy(m.grads, grads, n * 4, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(m.opt_state, opt, m.opt_state_bytes, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemcpy(m.fp8.scales, scales, n_scales * sizeof(Fp8Scale), cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaMemset(m.fp8.weights, 0xFF, n));
            CUDA_CHECK(cudaMemset(m.fp8.weights_t, 0xFF, n));
            set_step(&m, 5);
            m.fp8.calibrated = true;
            m.fp8.fuse_weights = fused == 1;
            optimizer_step(&m, &o);
            EXPECT(m.fp8.weights_stale == (fused == 0), "head %d: after the %s step the FP8 weights are %s", head,
                   fused ? "fused" : "unfused", m.fp8.weights_stale ? "stale" : "fresh");
            for (int l = 0; l < c->n_layer; l++) fp8_cast_weights(&m, l);
            got[fused] = fp8_step_state_download(&m);
        }
        char what[32];
        snprintf(what, sizeof(what), "head %s", head ? "in FP8" : "in BF16");
        failed |= fp8_step_states_agree(&m, &got[1], &got[0], what);
        size_t moved = 0;
        for (size_t j = 0; j < n; j++) moved += got[1].master[j] != master[j];
        EXPECT(moved > n / 2, "%s: the step moved %zu of %zu weights", what, moved, n);
        for (int fused = 0; fused < 2; fused++) fp8_step_state_free(&got[fused]);
        free(master), free(grads), free(opt), free(scales);
        gpt_free(&m);
    }
    return TEST_RESULT;
}

// Training with the update making the FP8 weights against training with it off (fuse_weights), from
// one initialization and the same batches: 4 steps of 2 micro-batches on the partial-tiles model,
// the head in BF16 and in FP8, with an evaluation after step 2 (a forward between fp8_eval's
// bracket, as validation runs it). The first step starts from initialized weights, which the
// forward casts (calibrating) on both; the later ones differ in where the weights are cast. Every
// step's loss, the evaluation's, and at the end the weights, moments, FP8 weights (the unfused
// run's cast as its next forward would cast them) and scales must be equal bit for bit.
static int test_fp8_gpu_adamw_weights_train_alike(void) {
    REQUIRE_GPU();
    int failed = 0;
    const ModelConfig* c = &FP8_PARTIAL_TILES_CONFIG;
    const int B = 2, accum = 2, steps = 4;
    OptimConfig o = {3e-3f, 0.1f, 0.1f, 0.9f, 0.95f, 1e-8f, 1.0f, 1, steps, 0, 0.0f};
    uint16_t* windows = random_window(B * (accum * steps + 1), c->seq_len, c->vocab_size);
    for (int head = 0; head < 2; head++) {
        float losses[2][steps + 1];
        Fp8StepState got[2];
        for (int fused = 0; fused < 2; fused++) {
            GPT m;
            gpt_create(&m, c, B, c->seq_len, 0, 64, &ONE_GPU, OPTIMIZER_ADAMW, (Fp8Mode){true, FP8_DELAYED, head == 1, false});
            m.fp8.fuse_weights = fused == 1;
            gpt_init(&m, 7);
            Uploader up;
            uploader_create(&up, m.N, c->vocab_size);
            for (int step = 0; step < steps; step++) {
                for (int micro = 0; micro < accum; micro++) {
                    Batch b = upload_batch(&up, &m, windows + (size_t)(step * accum + micro) * B * (c->seq_len + 1));
                    forward_backward(&m, &b, micro, accum);
                }
                optimizer_step(&m, &o);
                EXPECT(m.fp8.weights_stale == (fused == 0), "head %d, step %d: the FP8 weights are %s after the %s step",
                       head, step + 1, m.fp8.weights_stale ? "stale" : "fresh", fused ? "fused" : "unfused");
                CUDA_CHECK(cudaMemcpy(&losses[fused][step], &m.scalars->loss_sum, 4, cudaMemcpyDeviceToHost));
                if (step != 1) continue;
                fp8_eval(&m, true);
                Batch b = upload_batch(&up, &m, windows + (size_t)accum * steps * B * (c->seq_len + 1));
                forward_layers(&m, &b);
                head_and_loss(&m, &b, 0.0f, false, &m.scalars->val_loss_sum, false);
                fp8_eval(&m, false);
                CUDA_CHECK(cudaMemcpy(&losses[fused][steps], &m.scalars->val_loss_sum, 4, cudaMemcpyDeviceToHost));
            }
            for (int l = 0; l < c->n_layer; l++) fp8_cast_weights(&m, l);
            got[fused] = fp8_step_state_download(&m);
            uploader_free(&up);
            if (fused) {
                char what[32];
                snprintf(what, sizeof(what), "head %s", head ? "in FP8" : "in BF16");
                EXPECT(!memcmp(losses[0], losses[1], sizeof(losses[0])), "%s: the losses differ, the last %.9g fused, "
                       "%.9g unfused", what, losses[1][steps - 1], losses[0][steps - 1]);
                failed |= fp8_step_states_agree(&m, &got[1], &got[0], what);
                printf("    %s: losses %.6f .. %.6f, evaluation %.6f, both ways\n", what, losses[1][0] / m.N / accum,
                       losses[1][steps - 1] / m.N / accum, losses[1][steps] / m.N);
            }
            gpt_free(&m);
        }
        for (int fused = 0; fused < 2; fused++) fp8_step_state_free(&got[fused]);
    }
    free(windows);
    return TEST_RESULT;
}

static const TestCase fp8_tests[] = {
    {"fp8_rounding_every_code", test_fp8_rounding_every_code},
    {"fp8_scale_exponent", test_fp8_scale_exponent},
    {"gpu_fp8_rounding_every_code", test_fp8_gpu_rounding_every_code},
    {"gpu_fp8_cast_kernel", test_fp8_gpu_cast_kernel},
    {"gpu_fp8_scale_update", test_fp8_gpu_scale_update},
    {"gpu_fp8_layer_products", test_fp8_gpu_layer_products},
    {"gpu_fp8_model_gradients_vs_bf16", test_fp8_gpu_model_gradients_vs_bf16},
    {"gpu_fp8_log_scales", test_fp8_gpu_log_scales},
    {"gpu2_fp8_scales_agree", test_fp8_two_gpus_scales_agree},
    {"gpu2_fp8_resume_is_bit_exact", test_fp8_two_gpus_resume_is_bit_exact},
    {"gpu_fp8_fused_casts", test_fp8_gpu_fused_casts},
    {"gpu_fp8_fused_step_is_bit_exact", test_fp8_gpu_fused_step_is_bit_exact},
    {"gpu_fp8_recompute_changes_nothing", test_fp8_gpu_recompute_changes_nothing},
    {"gpu_fp8_adamw_makes_the_weights", test_fp8_gpu_adamw_makes_the_weights},
    {"gpu_fp8_adamw_weights_train_alike", test_fp8_gpu_adamw_weights_train_alike},
};
static const int n_fp8_tests = sizeof(fp8_tests) / sizeof(fp8_tests[0]);

#endif
