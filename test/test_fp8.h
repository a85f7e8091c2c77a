/*
 * test/test_fp8.h - FP8 mode's tests: the rounding of both formats on every code, the cast
 * kernels and the scales against the CPU reference (test/reference.h), the FP8 products of one
 * layer, the whole model's FP8 gradients (the head's in FP8 too, fast accumulation) against its
 * BF16 ones, the scales' log (--fp8-log-scales) against a checkpoint's scales, and on two GPUs
 * the ranks' agreement on their scales and a bit-exact resume.
 *
 * test_gpt.cu includes it after its whole-model helpers (gpu_forward_backward, random_params) and
 * its run helpers (make_shard_dir, SMALL_RUN, compare_logged_steps, gpu_count), which the tests
 * here use, and runs fp8_tests. The kernel tests are exact: inputs are bf16,
 * scales powers of two, so the GPU's codes must equal the reference's bit for bit. Only the
 * matmuls' accumulation (and their outputs' rounding) is held to a tolerance.
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
// and all three ways of finding the scale: row-major and transposed codes equal the reference's,
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
        for (int how = 0; how < 3; how++) {  // Fp8CastScale: delayed, measure, measured
            Fp8Scale s = fp8_scale_initial(e5m2);
            // delayed: a scale 4x too large for this amax, so the largest values saturate
            int k = fp8_scale_exponent((float)amax, s.max);
            s.scale = ldexpf(1.0f, how == FP8_CAST_DELAYED ? k + 2 : 0);
            s.amax = how == FP8_CAST_MEASURED ? (float)amax : 0.0f;
            CUDA_CHECK(cudaMemcpy(d_s, &s, sizeof(s), cudaMemcpyHostToDevice));
            fp8_cast(d_out, d_out_t, d_x, rows, cols, e5m2, d_s, (Fp8CastScale)how, 0);
            CUDA_CHECK(cudaMemcpy(out, d_out, n, cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(out_t, d_out_t, n, cudaMemcpyDeviceToHost));
            Fp8Scale after = fp8_scale_download(d_s);
            double scale = how == FP8_CAST_DELAYED ? ldexp(1.0, k + 2) : ldexp(1.0, k);
            EXPECT(after.amax == (float)amax, "format %d how %d: amax %g, want %g", e5m2, how, after.amax, amax);
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
    gpt_create(&m, &FP8_TEST_CONFIG, 2, FP8_TEST_CONFIG.seq_len, false, 128, &ONE_GPU, OPTIMIZER_ADAMW);
    gpt_enable_fp8(&m, FP8_CURRENT, false, false);
    const ParamTensor* t = param(&m.table, P_GATE_UP, 0);
    int N = m.N, O = (int)t->rows, I = (int)t->cols;
    double *W = random_array((size_t)O * I, 0.05), *x = random_array((size_t)N * I, 1.0);
    double* dy = random_array((size_t)N * O, 1e-4);  // gradient-sized: E5M2's scale must lift them
    for (size_t i = 0; i < (size_t)O * I; i++) W[i] = round_bf16(W[i]);
    for (size_t i = 0; i < (size_t)N * I; i++) x[i] = round_bf16(x[i]);
    for (size_t i = 0; i < (size_t)N * O; i++) dy[i] = round_bf16(dy[i]);
    bf16* d_W = to_device_bf16(W, (size_t)O * I);
    CUDA_CHECK(cudaMemcpy(m.params + t->offset, d_W, (size_t)O * I * 2, cudaMemcpyDeviceToDevice));
    bf16 *d_x = to_device_bf16(x, (size_t)N * I), *d_dy = to_device_bf16(dy, (size_t)N * O);
    bf16 *d_y = (bf16*)device_alloc_poisoned((size_t)N * O * 2), *d_dx = (bf16*)device_alloc_poisoned((size_t)N * I * 2);
    CUDA_CHECK(cudaMemset(m.grads, 0, m.table.n_elements * 4));
    m.fp8.weights_stale = true;
    fp8_cast_weights(&m, 0);
    fp8_cast_weights(&m, 1);
    layer_forward(&m, P_GATE_UP, 0, N, d_y, d_x, NULL);
    layer_backward(&m, P_GATE_UP, 0, N, d_dx, d_dy, d_x);
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
    void* dev[] = {d_W, d_x, d_dy, d_y, d_dx};
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
// factor; dy's error also flows into every earlier layer. Measured on this config on an H100:
// 0.16 to 0.22 relative L2 for the matrices, 0.30 for the worst norm weight (sums over tokens
// and heads that cancel more), loss within 1.4e-4. We allow 0.35 and 0.6 (1.6-2x the measured),
// and 2e-3 on the loss. A wrong scale (by a factor of two at least, being a power of two), a wrong
// transpose or a wrong format shows errors of 1 or more. The test also runs delayed scaling,
// calibrated on the same batch: its scales are then the current ones, so its gradients must
// equal current scaling's bit for bit.
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
            gpt_create(&m, c, B, c->seq_len, v.recompute, 128, &ONE_GPU, OPTIMIZER_ADAMW);
            if (run == 1) gpt_enable_fp8(&m, FP8_CURRENT, v.head, v.fast_accum);
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
        EXPECT(fabs(loss[1] - loss[0]) < 2e-3 * loss[0], "%s: loss %.5f in FP8 vs %.5f in BF16", what, loss[1], loss[0]);
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
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    EXPECT(system(cmd) == 0, "cleanup");
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
    if (!g_have_gpu || gpu_count() < 2) return TEST_SKIP;
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
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    EXPECT(system(cmd) == 0, "cleanup");
    return TEST_RESULT;
}

// FP8 with delayed scaling, ZeRO 1 on two GPUs, validating every 3 steps: 10 steps straight, and
// 5 (checkpoint, stop) then resumed to 10; steps 6..10 must log bit-identical losses and gradient
// norms. The checkpoint holds rank 0's scales, which are every rank's only because the ranks
// agree on their amaxes each step: before that, rank 1 resumed on rank 0's scales and drifted.
static int test_fp8_two_gpus_resume_is_bit_exact(void) {
    if (!g_have_gpu || gpu_count() < 2) return TEST_SKIP;
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
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    EXPECT(system(cmd) == 0, "cleanup");
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
};
static const int n_fp8_tests = sizeof(fp8_tests) / sizeof(fp8_tests[0]);

#endif
