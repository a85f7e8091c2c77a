/*
 * test/test_optim.h - the optimizers' tests (--optimizer adamw|muon|adamw8bit; doc/optimizers.md).
 *
 * CPU: 8-bit AdamW's quantization map (every code, the nearest-value rounding against a plain
 * scan, the round trip of every representable value) and its update rule against fp32-state
 * AdamW over many steps; Newton-Schulz in double against the polar factor it approximates; the
 * option checks. GPU (skipped without one): the quantization kernel bit for bit against the CPU,
 * the fused 8-bit AdamW kernel and Muon's step against test/reference.h, and resuming each
 * optimizer bit-exactly, and refusing to resume one optimizer's checkpoint with another.
 * test_gpt.cu includes it after its helpers (random_array, CHECK_CLOSE, make_shard_dir, SMALL_RUN,
 * compare_logged_steps); run_command is testing.h's.
 */
#ifndef TEST_OPTIM_H
#define TEST_OPTIM_H

// The maps: 0 and 1 at the ends, strictly increasing, m's negative half the mirror of its positive
// half; q8_encode is the nearest table value (ties to the lower code) as a plain scan finds it;
// every table value times a power-of-two absmax comes back as its own code; the rounding error is
// at most half the gap to the next value.
static int test_q8_map(void) {
    int failed = 0;
    const Q8Maps* maps = q8_maps();
    EXPECT(maps->m[0] == 0.0f && maps->m[127] == 1.0f && maps->v[0] == 0.0f && maps->v[255] == 1.0f, "the ends");
    for (int c = 1; c < 256; c++) EXPECT(maps->v[c] > maps->v[c - 1], "v's map does not increase at %d", c);
    for (int c = 1; c < 128; c++) {
        EXPECT(maps->m[c] > maps->m[c - 1], "m's map does not increase at %d", c);
        EXPECT(maps->m[128 + c] == -maps->m[c], "m's negative code %d", 128 + c);
    }
    EXPECT(fabs(maps->v[1] - 1e-7) < 1e-13 && fabs(maps->m[1] - 1e-6) < 1e-12, "smallest values %g %g", maps->v[1],
           maps->m[1]);
    for (int is_signed = 0; is_signed < 2; is_signed++) {
        const float* map = is_signed ? maps->m : maps->v;
        int n = is_signed ? 128 : 256;
        for (int c = 0; c < 256; c++) {
            if (is_signed && c == 128) continue;  // -0: never produced
            for (float absmax : {1.0f, 0.25f, 1024.0f}) {
                float x = q8_decode((uint8_t)c, absmax, map);
                EXPECT(q8_encode(x, absmax, map, is_signed) == c, "%s code %d with absmax %g does not round-trip",
                       is_signed ? "m" : "v", c, absmax);
            }
        }
        int mismatches = 0;
        double worst = 0.0;
        for (int i = 0; i < 200000; i++) {
            float absmax = (float)exp(rand_normal() * 5);
            float a = (float)pow(rand_uniform(), 1 + 6 * rand_uniform());  // many decades
            float x = (is_signed && rand_uniform() < 0.5 ? -a : a) * absmax;
            float q = fabsf(x) / absmax;
            q = q > 1.0f ? 1.0f : q;
            int best = 0;
            for (int c = 1; c < n; c++)
                if (fabsf(q - map[c]) < fabsf(q - map[best])) best = c;
            int want = is_signed && x < 0.0f && best ? 128 | best : best;
            uint8_t got = q8_encode(x, absmax, map, is_signed);
            mismatches += got != want;
            int mag = got & (is_signed ? 127 : 255);
            double gap = mag + 1 < n ? map[mag + 1] - map[mag] : map[mag] - map[mag - 1];
            if (mag > 0) gap = fmax(gap, map[mag] - map[mag - 1]);
            worst = fmax(worst, fabs(q - map[mag]) / gap);
        }
        EXPECT(mismatches == 0, "%s: %d codes differ from the nearest value", is_signed ? "m" : "v", mismatches);
        EXPECT(worst <= 0.5 + 1e-6, "%s: rounding error %.3f of a gap", is_signed ? "m" : "v", worst);
    }
    return TEST_RESULT;
}

// 8-bit AdamW against AdamW with fp32 state, 200 steps on 8 blocks of one tensor whose gradients
// are noisy and spread over about 4 decades within each block (harsher than a layer's rows): the
// weights must move the same way, to within the rounding of the moments.
static int test_adamw8bit_tracks_adamw(void) {
    int failed = 0;
    size_t n = 8 * Q8_BLOCK;
    double *p32 = random_array(n, 0.02), *p8 = (double*)malloc(n * 8), *m = (double*)calloc(n, 8);
    double *v = (double*)calloc(n, 8), *g = (double*)malloc(n * 8), *scale = (double*)malloc(n * 8);
    memcpy(p8, p32, n * 8);
    uint8_t *qm = (uint8_t*)calloc(n, 1), *qv = (uint8_t*)calloc(n, 1);
    float *am = (float*)calloc(n / Q8_BLOCK, 4), *av = (float*)calloc(n / Q8_BLOCK, 4);
    for (size_t i = 0; i < n; i++) scale[i] = 1e-3 * exp(2 * rand_normal());  // about 4 decades
    double* p0 = (double*)malloc(n * 8);
    memcpy(p0, p32, n * 8);
    for (int t = 1; t <= 200; t++) {
        for (size_t i = 0; i < n; i++) g[i] = scale[i] * (0.5 + rand_normal());  // a signal and noise
        ref_adamw_step(p32, m, v, g, n, 1e-3, 0.9, 0.95, 1e-8, 0.1, t);
        ref_adamw8bit_step(p8, qm, qv, am, av, g, n, 1e-3, 0.9, 0.95, 1e-8, 0.1, t);
    }
    double *d32 = (double*)malloc(n * 8), *d8 = (double*)malloc(n * 8);
    for (size_t i = 0; i < n; i++) d32[i] = p32[i] - p0[i], d8[i] = p8[i] - p0[i];
    double err = rel_l2(d8, d32, n);
    printf("    200 steps: relative L2 distance of the 8-bit updates from fp32 AdamW's: %.4f\n", err);
    // measured 0.085 (storing v rather than sqrt(v), this diverged: 7.07)
    EXPECT(err < 0.15, "8-bit AdamW drifts from AdamW: %.4f", err);
    free(p32); free(p8); free(m); free(v); free(g); free(scale); free(qm); free(qv); free(am); free(av);
    free(p0); free(d32); free(d8);
    return TEST_RESULT;
}

// Newton-Schulz in double, for a wide and a tall matrix: NS(G^T) = NS(G)^T; the result's singular
// values lie in Muon's band (their mean square, ||X||^2 / r, is about 0.6 to 1.25); and it points
// where the polar factor U V^T of G points (the cubic Newton-Schulz iteration run to convergence).
static int test_newton_schulz_reference(void) {
    int failed = 0;
    const int shapes[][2] = {{24, 40}, {56, 16}};
    for (auto& shape : shapes) {
        int R = shape[0], C = shape[1], r = R < C ? R : C;
        size_t n = (size_t)R * C;
        double *g = random_array(n, 1.0), *x = (double*)malloc(n * 8), *gt = (double*)malloc(n * 8);
        double *xt = (double*)malloc(n * 8), *back = (double*)malloc(n * 8);
        ref_newton_schulz(x, g, R, C, MUON_NS_STEPS);
        ref_transpose(gt, g, R, C);
        ref_newton_schulz(xt, gt, C, R, MUON_NS_STEPS);
        ref_transpose(back, xt, C, R);
        EXPECT(rel_l2(back, x, n) < 1e-12, "%dx%d: NS of the transpose is not the transpose", R, C);
        // the polar factor: cubic Newton-Schulz X = 1.5 X - 0.5 X X^T X from G / ||G||_F
        double *polar = (double*)malloc(n * 8), *pt = (double*)malloc(n * 8), *ppt = (double*)malloc((size_t)R * R * 8);
        double *pppt = (double*)malloc(n * 8), norm = 0.0;
        for (size_t i = 0; i < n; i++) norm += g[i] * g[i];
        for (size_t i = 0; i < n; i++) polar[i] = g[i] / sqrt(norm);
        for (int it = 0; it < 200; it++) {
            ref_transpose(pt, polar, R, C);
            ref_matmul(ppt, polar, pt, R, C, R);
            ref_matmul(pppt, ppt, polar, R, R, C);
            for (size_t i = 0; i < n; i++) polar[i] = 1.5 * polar[i] - 0.5 * pppt[i];
        }
        double dot = 0.0, xx = 0.0, pp = 0.0;
        for (size_t i = 0; i < n; i++) dot += x[i] * polar[i], xx += x[i] * x[i], pp += polar[i] * polar[i];
        double cosine = dot / sqrt(xx * pp);
        EXPECT(fabs(pp - r) < 1e-6, "%dx%d: the polar factor did not converge (%g vs %d)", R, C, pp, r);
        EXPECT(cosine > 0.97, "%dx%d: cosine with U V^T %.4f", R, C, cosine);
        // singular values in about [0.6, 1.25]: their mean square, ||X||^2 / r
        double ms = xx / r;
        EXPECT(ms > 0.5 && ms < 1.4, "%dx%d: mean squared singular value %.3f", R, C, ms);
        printf("    %dx%d: cosine with U V^T %.4f, mean squared singular value %.3f\n", R, C, cosine, ms);
        free(g); free(x); free(gt); free(xt); free(back); free(polar); free(pt); free(ppt); free(pppt);
    }
    return TEST_RESULT;
}

// The flags' domain checks, before any GPU is needed: one line and exit code 2.
static int test_optimizer_options(void) {
    int failed = 0;
    if (access("./train_gpt", X_OK) != 0) {
        printf("    ./train_gpt is not built\n");
        return TEST_FAIL;
    }
    struct {
        const char* args;
        const char* says;
    } cases[] = {
        {"--optimizer sgd", "bad value 'sgd' for --optimizer: it takes 'adamw', 'muon' or 'adamw8bit'"},
        {"--optimizer Muon", "bad value 'Muon' for --optimizer"},
        {"--optimizer muon --zero 1", "--optimizer muon needs every matrix whole"},
        {"--optimizer muon --zero 2", "use --zero 0"},
        {"--muon-lr -1", "--muon-lr must be"},
        {"--muon-momentum 1", "--muon-momentum in [0, 1)"},
    };
    for (auto& c : cases) {
        char cmd[256], line[512];
        snprintf(cmd, sizeof(cmd), "./train_gpt %s", c.args);
        int code = run_command(cmd, line, sizeof(line));
        EXPECT(code == 2 && strstr(line, c.says), "'%s': exit %d, '%s'", c.args, code, line);
    }
    return TEST_RESULT;
}

// The quantization kernel's codes and scales equal the CPU's bit for bit, for both maps, on
// blocks whose magnitudes span many decades.
static int test_q8_gpu_round_trip(void) {
    REQUIRE_GPU();
    int failed = 0;
    size_t n = 1000 * Q8_BLOCK;
    double* x = random_array(n, 1.0);
    for (size_t i = 0; i < n; i++) x[i] *= exp(4 * rand_normal());
    for (int is_signed = 0; is_signed < 2; is_signed++) {
        if (!is_signed)
            for (size_t i = 0; i < n; i++) x[i] = x[i] * x[i];
        float* d_x = to_device_f32(x, n);
        uint8_t* d_codes = (uint8_t*)device_alloc_poisoned(n);
        float* d_absmax = (float*)device_alloc_poisoned(n / Q8_BLOCK * 4);
        q8_quantize(d_codes, d_absmax, d_x, n, is_signed, 0);
        uint8_t* codes = (uint8_t*)malloc(n);
        float* absmax = (float*)malloc(n / Q8_BLOCK * 4);
        CUDA_CHECK(cudaMemcpy(codes, d_codes, n, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(absmax, d_absmax, n / Q8_BLOCK * 4, cudaMemcpyDeviceToHost));
        const float* map = is_signed ? q8_maps()->m : q8_maps()->v;
        int bad_codes = 0, bad_scales = 0;
        for (size_t b = 0; b < n / Q8_BLOCK; b++) {
            float a = 0.0f;
            for (int j = 0; j < Q8_BLOCK; j++) a = fmaxf(a, fabsf((float)x[b * Q8_BLOCK + j]));
            bad_scales += a != absmax[b];
            for (int j = 0; j < Q8_BLOCK; j++)
                bad_codes += codes[b * Q8_BLOCK + j] != q8_encode((float)x[b * Q8_BLOCK + j], a, map, is_signed);
        }
        EXPECT(bad_codes == 0 && bad_scales == 0, "%s: %d codes and %d scales differ from the CPU's",
               is_signed ? "signed" : "unsigned", bad_codes, bad_scales);
        free(codes); free(absmax);
        void* dev[] = {d_x, d_codes, d_absmax};
        for (void* d : dev) CUDA_CHECK(cudaFree(d));
    }
    free(x);
    return TEST_RESULT;
}

// The fused 8-bit AdamW kernel over a range (blocks 3 .. 3+nb of a buffer) against
// ref_adamw8bit_step: the master weights' update, their bf16 halves, and the new state decoded.
static int test_adamw8bit_gpu_kernel(void) {
    REQUIRE_GPU();
    int failed = 0;
    size_t nb = 500, n = (nb + 6) * Q8_BLOCK, begin = 3 * Q8_BLOCK, len = nb * Q8_BLOCK;
    double *p = random_array(n, 1.0), *g = random_array(n, 0.1);
    uint8_t *qm = (uint8_t*)malloc(n), *qv = (uint8_t*)malloc(n), *flags = (uint8_t*)malloc(n / Q8_BLOCK);
    float *am = (float*)malloc(n / Q8_BLOCK * 4), *av = (float*)malloc(n / Q8_BLOCK * 4);
    for (size_t i = 0; i < n; i++) qm[i] = (uint8_t)(rand_uniform() * 256), qv[i] = (uint8_t)(rand_uniform() * 256);
    for (size_t b = 0; b < n / Q8_BLOCK; b++)
        am[b] = (float)(0.01 * exp(rand_normal())), av[b] = (float)(1e-4 * exp(rand_normal())), flags[b] = b % 3 != 0;
    float *d_g = to_device_f32(g, n), *d_am, *d_av;
    uint8_t *d_qm, *d_qv, *d_flags;
    bf16* d_w;
    int16_t* d_low;
    to_device_master(p, n, &d_w, &d_low);
    CUDA_CHECK(cudaMalloc(&d_qm, n));
    CUDA_CHECK(cudaMalloc(&d_qv, n));
    CUDA_CHECK(cudaMalloc(&d_flags, n / Q8_BLOCK));
    CUDA_CHECK(cudaMalloc(&d_am, n / Q8_BLOCK * 4));
    CUDA_CHECK(cudaMalloc(&d_av, n / Q8_BLOCK * 4));
    CUDA_CHECK(cudaMemcpy(d_qm, qm, n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_qv, qv, n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_flags, flags, n / Q8_BLOCK, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_am, am, n / Q8_BLOCK * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_av, av, n / Q8_BLOCK * 4, cudaMemcpyHostToDevice));
    OptimConfig o = {1e-3f, 0.1f, 0.1f, 0.9f, 0.95f, 1e-8f, 0.0f, 4, 50, 0, 0.2f};  // no clipping
    int t = 7;
    OptimScalars host_scalars = {t, 0, 0, 0, 0, 0, 0};
    OptimScalars* d_scalars;
    CUDA_CHECK(cudaMalloc(&d_scalars, sizeof(OptimScalars)));
    CUDA_CHECK(cudaMemcpy(d_scalars, &host_scalars, sizeof(OptimScalars), cudaMemcpyHostToDevice));
    optimizer_schedule(&o, d_scalars, 0);
    size_t b0 = begin / Q8_BLOCK;
    adamw8bit_step(d_w + begin, d_low + begin, d_g + begin, d_qm + begin, d_qv + begin, d_am + b0, d_av + b0,
                   d_flags + b0, len, &o, d_scalars, 0);
    double* gp = from_device_master(d_w, d_low, n);
    double* gpb = from_device_bf16(d_w + begin, len);
    uint8_t *gqm = (uint8_t*)malloc(n), *gqv = (uint8_t*)malloc(n);
    float *gam = (float*)malloc(n / Q8_BLOCK * 4), *gav = (float*)malloc(n / Q8_BLOCK * 4);
    CUDA_CHECK(cudaMemcpy(gqm, d_qm, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gqv, d_qv, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gam, d_am, n / Q8_BLOCK * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gav, d_av, n / Q8_BLOCK * 4, cudaMemcpyDeviceToHost));
    // the reference: decay per block as the flags say (two calls per block keep it simple)
    double lr = learning_rate(&o, t), *want = (double*)malloc(n * 8), *gf = (double*)malloc(n * 8);
    for (size_t i = 0; i < n; i++) want[i] = (float)p[i], gf[i] = (float)g[i];
    for (size_t b = b0; b < b0 + nb; b++)
        ref_adamw8bit_step(want + b * Q8_BLOCK, qm + b * Q8_BLOCK, qv + b * Q8_BLOCK, am + b, av + b, gf + b * Q8_BLOCK,
                           Q8_BLOCK, lr, o.beta1, o.beta2, o.eps, flags[b] ? o.weight_decay : 0.0, t + 1);
    double *dgot = (double*)malloc(len * 8), *dwant = (double*)malloc(len * 8);
    double *m_got = (double*)malloc(len * 8), *m_want = (double*)malloc(len * 8);
    double *v_got = (double*)malloc(len * 8), *v_want = (double*)malloc(len * 8);
    const Q8Maps* maps = q8_maps();
    int far_codes = 0;
    for (size_t i = begin; i < begin + len; i++) {
        size_t b = i / Q8_BLOCK, k = i - begin;
        dgot[k] = gp[i] - (float)p[i];
        dwant[k] = want[i] - (float)p[i];
        m_got[k] = q8_decode(gqm[i], gam[b], maps->m), m_want[k] = q8_decode(qm[i], am[b], maps->m);
        v_got[k] = q8_decode(gqv[i], gav[b], maps->v), v_want[k] = q8_decode(qv[i], av[b], maps->v);  // sqrt(v)
        far_codes += abs((int)(gqm[i] & 127) - (int)(qm[i] & 127)) > 1 || abs((int)gqv[i] - (int)qv[i]) > 1;
    }
    CHECK_CLOSE("adamw8bit update", dgot, dwant, len, 1e-3);
    CHECK_CLOSE("adamw8bit bf16 halves", gpb, want + begin, len, 4e-3);
    CHECK_CLOSE("adamw8bit m (decoded)", m_got, m_want, len, 1e-3);
    CHECK_CLOSE("adamw8bit sqrt(v) (decoded)", v_got, v_want, len, 1e-3);
    EXPECT(far_codes == 0, "%d codes more than one step from the reference's", far_codes);
    bool outside_same = true;
    for (size_t i = 0; i < n; i++)
        if ((i < begin || i >= begin + len) && gp[i] != (float)p[i]) outside_same = false;
    EXPECT(outside_same, "elements outside the range changed");
    free(p); free(g); free(qm); free(qv); free(flags); free(am); free(av); free(gp); free(gpb); free(gqm); free(gqv);
    free(gam); free(gav); free(want); free(gf); free(dgot); free(dwant); free(m_got); free(m_want); free(v_got);
    free(v_want);
    void* dev[] = {d_w, d_low, d_g, d_qm, d_qv, d_flags, d_am, d_av, d_scalars};
    for (void* d : dev) CUDA_CHECK(cudaFree(d));
    return TEST_RESULT;
}

// Muon's step on the GPU (fp32 momentum, bf16 Newton-Schulz through matmul()) against
// ref_muon_step in double, for a wide and a tall matrix: the momentum to fp32 accuracy, the
// update to bf16's (five steps of bf16 products).
static int test_muon_gpu_step(void) {
    REQUIRE_GPU();
    int failed = 0;
    matmul_init();
    const int shapes[][2] = {{96, 160}, {256, 64}};
    for (auto& shape : shapes) {
        int R = shape[0], C = shape[1];
        size_t n = (size_t)R * C, side = R < C ? R : C;
        double *p = random_array(n, 0.02), *g = random_array(n, 0.01), *buf = random_array(n, 0.01);
        float *d_g = to_device_f32(g, n), *d_buf = to_device_f32(buf, n), *d_partials;
        bf16* d_w;
        int16_t* d_low;
        to_device_master(p, n, &d_w, &d_low);
        MuonScratch w;
        CUDA_CHECK(cudaMalloc(&w.u, n * 4));
        CUDA_CHECK(cudaMalloc(&w.x, n * 2));
        CUDA_CHECK(cudaMalloc(&w.y, n * 2));
        CUDA_CHECK(cudaMalloc(&w.a, side * side * 2));
        CUDA_CHECK(cudaMalloc(&w.b, side * side * 2));
        CUDA_CHECK(cudaMalloc(&w.norm_sq, 4));
        CUDA_CHECK(cudaMalloc(&d_partials, REDUCE_BLOCKS * 4));
        OptimConfig o = {1e-3f, 0.1f, 0.0f, 0.9f, 0.95f, 1e-8f, 0.0f, 0, 50, 0, 0.2f, 0.02f, 0.95f};
        OptimScalars host_scalars = {10, 0, 0, 0, 0, 0, 0, 0};
        OptimScalars* d_scalars;
        CUDA_CHECK(cudaMalloc(&d_scalars, sizeof(OptimScalars)));
        CUDA_CHECK(cudaMemcpy(d_scalars, &host_scalars, sizeof(OptimScalars), cudaMemcpyHostToDevice));
        optimizer_schedule(&o, d_scalars, 0);
        muon_matrix_step(d_w, d_low, d_g, d_buf, R, C, &w, d_partials, &o, d_scalars, 0);
        CUDA_CHECK(cudaMemcpy(&host_scalars, d_scalars, sizeof(OptimScalars), cudaMemcpyDeviceToHost));
        OptimConfig muon = o;
        muon.lr = o.muon_lr;
        double lr = learning_rate(&muon, 10);
        EXPECT(fabs(host_scalars.muon_lr - lr) < 1e-6 * lr, "device Muon lr %.9g vs host %.9g", host_scalars.muon_lr, lr);
        double *want = (double*)malloc(n * 8), *want_buf = (double*)malloc(n * 8), *gf = (double*)malloc(n * 8);
        for (size_t i = 0; i < n; i++) want[i] = (float)p[i], want_buf[i] = (float)buf[i], gf[i] = (float)g[i];
        ref_muon_step(want, want_buf, gf, R, C, lr, o.muon_momentum);
        double *gp = from_device_master(d_w, d_low, n), *gbuf = from_device_f32(d_buf, n), *gpb = from_device_bf16(d_w, n);
        double *dgot = (double*)malloc(n * 8), *dwant = (double*)malloc(n * 8);
        for (size_t i = 0; i < n; i++) dgot[i] = gp[i] - (float)p[i], dwant[i] = want[i] - (float)p[i];
        double err = rel_l2(dgot, dwant, n);
        printf("    %dx%d: relative L2 error of Muon's update (bf16 Newton-Schulz vs fp64) %.4f\n", R, C, err);
        CHECK_CLOSE("muon momentum", gbuf, want_buf, n, 1e-6);
        CHECK_CLOSE("muon update", dgot, dwant, n, 5e-2);
        CHECK_CLOSE("muon bf16 halves", gpb, want, n, 4e-3);
        free(p); free(g); free(buf); free(want); free(want_buf); free(gf); free(gp); free(gbuf); free(gpb); free(dgot);
        free(dwant);
        void* dev[] = {d_w, d_low, d_g, d_buf, w.u, w.x, w.y, w.a, w.b, w.norm_sq, d_partials, d_scalars};
        for (void* d : dev) CUDA_CHECK(cudaFree(d));
    }
    matmul_free();
    return TEST_RESULT;
}

// For Muon and 8-bit AdamW (AdamW is gpu_resume_is_bit_exact's): 10 steps straight against 5,
// stop, resume, 5 more: every logged loss and gradient norm identical. Then resuming the
// checkpoint with another optimizer is one line naming both, and exit 1.
static int test_resume_each_optimizer(void) {
    REQUIRE_GPU();
    int failed = 0;
    char dir[64], cmd[2048], path[256], path_b[256], line[512];
    EXPECT(make_shard_dir(dir, 60000, 512), "shard");
    const char* optimizers[] = {"muon", "adamw8bit"};
    for (const char* opt : optimizers) {
        snprintf(cmd, sizeof(cmd), SMALL_RUN "--optimizer %s --muon-lr 0.01 --train-data '%s/train_*.bin' --steps 10 "
                 "--ckpt-every 0 --out %s/%s_straight > /dev/null", opt, dir, dir, opt);
        EXPECT(system(cmd) == 0, "straight run failed: %s", cmd);
        snprintf(cmd, sizeof(cmd), SMALL_RUN "--optimizer %s --muon-lr 0.01 --train-data '%s/train_*.bin' --steps 10 "
                 "--ckpt-every 3 --stop-at 5 --out %s/%s_split > /dev/null", opt, dir, dir, opt);
        EXPECT(system(cmd) == 0, "first half failed: %s", cmd);
        snprintf(cmd, sizeof(cmd), SMALL_RUN "--optimizer %s --muon-lr 0.01 --train-data '%s/train_*.bin' --steps 10 "
                 "--ckpt-every 3 --resume latest --out %s/%s_split > /dev/null", opt, dir, dir, opt);
        EXPECT(system(cmd) == 0, "resumed half failed: %s", cmd);
        snprintf(path, sizeof(path), "%s/%s_straight/log.jsonl", dir, opt);
        snprintf(path_b, sizeof(path_b), "%s/%s_split/log.jsonl", dir, opt);
        failed |= compare_logged_steps(path, path_b, 1, 10);
        const char* other = strcmp(opt, "muon") ? "muon" : "adamw";
        snprintf(cmd, sizeof(cmd), SMALL_RUN "--optimizer %s --train-data '%s/train_*.bin' --steps 12 --resume latest "
                 "--out %s/%s_split", other, dir, dir, opt);
        int code = run_command(cmd, line, sizeof(line));
        char expect[128];
        snprintf(expect, sizeof(expect), "written with --optimizer %s, and this run has --optimizer %s", opt, other);
        EXPECT(code == 1 && strstr(line, expect), "resuming %s with %s: exit %d, '%s'", opt, other, code, line);
    }
    // and an AdamW checkpoint refuses 8-bit AdamW
    snprintf(cmd, sizeof(cmd), SMALL_RUN "--train-data '%s/train_*.bin' --steps 3 --out %s/adamw > /dev/null", dir, dir);
    EXPECT(system(cmd) == 0, "adamw run failed: %s", cmd);
    snprintf(cmd, sizeof(cmd), SMALL_RUN "--optimizer adamw8bit --train-data '%s/train_*.bin' --steps 5 --resume latest "
             "--out %s/adamw", dir, dir);
    int code = run_command(cmd, line, sizeof(line));
    EXPECT(code == 1 && strstr(line, "--optimizer adamw, and this run has --optimizer adamw8bit"), "exit %d, '%s'", code,
           line);
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

static const TestCase optim_tests[] = {
    {"optim_q8_map", test_q8_map},
    {"optim_adamw8bit_tracks_adamw", test_adamw8bit_tracks_adamw},
    {"optim_newton_schulz_reference", test_newton_schulz_reference},
    {"optim_options", test_optimizer_options},
    {"gpu_optim_q8_round_trip", test_q8_gpu_round_trip},
    {"gpu_optim_adamw8bit_kernel", test_adamw8bit_gpu_kernel},
    {"gpu_optim_muon_step", test_muon_gpu_step},
    {"gpu_optim_resume_each_optimizer", test_resume_each_optimizer},
};
static const int n_optim_tests = sizeof(optim_tests) / sizeof(optim_tests[0]);

#endif
