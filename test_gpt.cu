/*
 * test_gpt.cu - the test suite: `make test` builds it and runs it; CI runs it without a GPU.
 *
 * It #includes train_gpt.cu itself (with TRAIN_GPT_NO_MAIN), so the tests exercise exactly the
 * code that trains, and checks it against independent computations:
 *  - CPU tests (always): config validation, the parameter table, the HF name mapping, the
 *    learning-rate schedule, the FLOP count, --recompute auto's choice from the memory plan, a
 *    finite-difference check of the CPU reference's gradients in fp64, the HF export's files, the
 *    command line; then the suites of test/: data (test_data.h), checkpoints (test_ckpt.h), comm.h
 *    (test_comm.h), bad input (test_inputs.h), FP8's roundings (test_fp8.h) and the optimizers'
 *    arithmetic (test_optim.h).
 *  - GPU tests (skipped without a GPU): every kernel against the CPU reference on fresh random
 *    inputs of awkward sizes, the whole model's loss and every gradient tensor against the CPU
 *    reference for several configs, bit-exact determinism, the same gradients whichever layers
 *    recompute, training, ZeRO's modes on one GPU, ./train_gpt's checkpoints, resume, export and
 *    init-from, FP8 mode and the optimizers' kernels and resumes; `gpu2_*` tests need two GPUs
 *    (data parallelism).
 * Every GPU output is poisoned (filled with NaN) before the run, so an unwritten element fails.
 * Inputs are random with a seed printed at the start (set TEST_SEED to repeat a run).
 * Usage: ./test_gpt [substring]   runs the tests whose name contains the substring.
 */
#define TRAIN_GPT_NO_MAIN
#include "train_gpt.cu"
#include "test/testing.h"
#include "test/reference.h"
#include "test/test_data.h"
#include "test/test_ckpt.h"
#include "test/test_comm.h"
#include "test/test_inputs.h"
#include <cuda_fp8.h>
#include <sys/wait.h>
#include <unistd.h>

// ----------------------------------------------------------------------------------------------
// Helpers

static uint64_t g_rng = 1;

static double rand_uniform(void) {  // in [0, 1)
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (g_rng >> 11) * (1.0 / 9007199254740992.0);
}

static double rand_normal(void) {
    double u1 = rand_uniform() + 1e-300, u2 = rand_uniform();
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

static double* random_array(size_t n, double scale) {
    double* x = (double*)malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) x[i] = scale * rand_normal();
    return x;
}

static const Fp8Mode FP8_OFF = {false, FP8_DELAYED, false, false};  // every product in bf16

// A model on the GPU with k = recompute_layers: planned and built as the trainer does it.
static void gpt_create(GPT* m, const ModelConfig* cfg, int B, int T, int recompute_layers, int loss_chunk,
                       const Sharding* dp, OptimizerKind optimizer, Fp8Mode fp8) {
    gpt_plan(m, cfg, B, T, recompute_layers, loss_chunk, dp, optimizer, fp8);
    gpt_build(m);
}

static double round_bf16(double x) { return (double)__bfloat162float(__float2bfloat16((float)x)); }

// Uploads x as bf16 into the device buffer d (a model's weights or activations, say), rounding x
// in place to the values the GPU sees.
static void upload_bf16(bf16* d, double* x, size_t n) {
    bf16* host = (bf16*)malloc(n * sizeof(bf16));
    for (size_t i = 0; i < n; i++) {
        host[i] = __float2bfloat16((float)x[i]);
        x[i] = __bfloat162float(host[i]);
    }
    CUDA_CHECK(cudaMemcpy(d, host, n * sizeof(bf16), cudaMemcpyHostToDevice));
    free(host);
}

// The same into a new device buffer (256 bytes of slack past the end).
static bf16* to_device_bf16(double* x, size_t n) {
    bf16* d;
    CUDA_CHECK(cudaMalloc(&d, n * sizeof(bf16) + 256));
    upload_bf16(d, x, n);
    return d;
}

static float* to_device_f32(const double* x, size_t n) {
    float* host = (float*)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) host[i] = (float)x[i];
    float* d;
    CUDA_CHECK(cudaMalloc(&d, n * sizeof(float) + 256));
    CUDA_CHECK(cudaMemcpy(d, host, n * sizeof(float), cudaMemcpyHostToDevice));
    free(host);
    return d;
}

// The trainer's RoPE tables for T positions of head_dim D on the device: cos [T, D/2], then sin.
static float* device_rope_tables(int T, int D, float theta) {
    float* host = (float*)malloc((size_t)T * D * 4);
    rope_tables(host, host + (size_t)T * D / 2, T, D, theta);
    float* d;
    CUDA_CHECK(cudaMalloc(&d, (size_t)T * D * 4));
    CUDA_CHECK(cudaMemcpy(d, host, (size_t)T * D * 4, cudaMemcpyHostToDevice));
    free(host);
    return d;
}

static int* to_device_int(const int* x, int n) {
    int* d;
    CUDA_CHECK(cudaMalloc(&d, n * sizeof(int)));
    CUDA_CHECK(cudaMemcpy(d, x, n * sizeof(int), cudaMemcpyHostToDevice));
    return d;
}

static double* from_device_bf16(const bf16* d, size_t n) {
    bf16* host = (bf16*)malloc(n * sizeof(bf16));
    CUDA_CHECK(cudaMemcpy(host, d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    double* x = (double*)malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) x[i] = __bfloat162float(host[i]);
    free(host);
    return x;
}

static double* from_device_f32(const float* d, size_t n) {
    float* host = (float*)malloc(n * sizeof(float));
    CUDA_CHECK(cudaMemcpy(host, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    double* x = (double*)malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) x[i] = host[i];
    free(host);
    return x;
}

// Master weights on the device (kernels.cuh, master_split): x's n values taken as fp32, their bf16
// halves into a new buffer *w and their low halves into a new buffer *low. And back, joined.
static void to_device_master(const double* x, size_t n, bf16** w, int16_t** low) {
    bf16* host_w = (bf16*)malloc(n * sizeof(bf16));
    int16_t* host_low = (int16_t*)malloc(n * sizeof(int16_t));
    for (size_t i = 0; i < n; i++) host_w[i] = master_split((float)x[i], &host_low[i]);
    CUDA_CHECK(cudaMalloc(w, n * sizeof(bf16) + 256));
    CUDA_CHECK(cudaMalloc(low, n * sizeof(int16_t) + 256));
    CUDA_CHECK(cudaMemcpy(*w, host_w, n * sizeof(bf16), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(*low, host_low, n * sizeof(int16_t), cudaMemcpyHostToDevice));
    free(host_w);
    free(host_low);
}

static double* from_device_master(const bf16* w, const int16_t* low, size_t n) {
    bf16* host_w = (bf16*)malloc(n * sizeof(bf16));
    int16_t* host_low = (int16_t*)malloc(n * sizeof(int16_t));
    CUDA_CHECK(cudaMemcpy(host_w, w, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(host_low, low, n * sizeof(int16_t), cudaMemcpyDeviceToHost));
    double* x = (double*)malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) x[i] = master_join(host_w[i], host_low[i]);
    free(host_w);
    free(host_low);
    return x;
}

// Whether two device buffers hold the same bytes (a bit-for-bit comparison of two kernels' outputs).
static bool device_bytes_equal(const void* a, const void* b, size_t bytes) {
    unsigned char *host_a = (unsigned char*)malloc(bytes), *host_b = (unsigned char*)malloc(bytes);
    CUDA_CHECK(cudaMemcpy(host_a, a, bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(host_b, b, bytes, cudaMemcpyDeviceToHost));
    const bool same = memcmp(host_a, host_b, bytes) == 0;
    free(host_a);
    free(host_b);
    return same;
}

static void* device_alloc_poisoned(size_t bytes) {
    void* d;
    CUDA_CHECK(cudaMalloc(&d, bytes + 256));
    CUDA_CHECK(cudaMemset(d, 0xFF, bytes + 256));  // 0xFFFF is a NaN in bf16, 0xFFFFFFFF in fp32
    return d;
}

// ||a - b|| / ||b|| in double, NaN-aware: any NaN in a makes it infinite. For double or float data.
template <typename T>
static double rel_l2(const T* a, const T* b, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite((double)a[i])) return INFINITY;
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

#define CHECK_CLOSE(name, got, want, n, tol)                                                           \
    do {                                                                                               \
        double err_ = rel_l2(got, want, n);                                                            \
        EXPECT(err_ <= (tol), "%s: relative L2 error %.3g > %.3g", name, err_, (double)(tol));         \
    } while (0)

// ----------------------------------------------------------------------------------------------
// CPU tests

static const ModelConfig SANE_CONFIGS[] = {
    {50304, 768, 12, 6, 2, 128, 2048, 1024, 10000.0f, 1e-6f},   // default
    {50304, 1024, 28, 16, 8, 128, 3072, 1024, 1e6f, 1e-6f},     // medium
    {50304, 2048, 16, 32, 8, 64, 8192, 1024, 1e6f, 1e-6f},      // ~1B
    {50304, 512, 3, 8, 1, 64, 1376, 333, 10000.0f, 1e-5f},      // MQA, odd layers, odd seq
    {32000, 512, 4, 4, 4, 128, 1024, 2048, 10000.0f, 1e-6f},    // MHA
};

static int test_config_accepts_sane_configs(void) {
    int failed = 0;
    char err[256];
    for (size_t i = 0; i < sizeof(SANE_CONFIGS) / sizeof(SANE_CONFIGS[0]); i++)
        EXPECT(config_check(&SANE_CONFIGS[i], err, sizeof(err)), "config %zu rejected: %s", i, err);
    return TEST_RESULT;
}

static int test_config_rejects_bad_configs(void) {
    int failed = 0;
    struct {
        const char* field;  // the rejection must name it
        ModelConfig c;
    } cases[] = {
        {"head_dim", {50304, 768, 12, 6, 2, 96, 2048, 1024, 1e4f, 1e-6f}},
        {"n_head", {50304, 768, 12, 6, 4, 128, 2048, 1024, 1e4f, 1e-6f}},
        {"vocab", {50257, 768, 12, 6, 2, 128, 2048, 1024, 1e4f, 1e-6f}},
        {"d_model", {50304, 770, 12, 6, 2, 128, 2048, 1024, 1e4f, 1e-6f}},
        {"d_model", {50304, 16384, 12, 128, 8, 128, 2048, 1024, 1e4f, 1e-6f}},
        {"n_layer", {50304, 768, 0, 6, 2, 128, 2048, 1024, 1e4f, 1e-6f}},
        {"ffn_dim", {50304, 768, 12, 6, 2, 128, 2049, 1024, 1e4f, 1e-6f}},
        {"seq_len", {50304, 768, 12, 6, 2, 128, 2048, 0, 1e4f, 1e-6f}},
        {"rope_theta", {50304, 768, 12, 6, 2, 128, 2048, 1024, -1.0f, 1e-6f}},
        {"norm_eps", {50304, 768, 12, 6, 2, 128, 2048, 1024, 1e4f, 0.0f}},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char err[256] = "";
        bool ok = config_check(&cases[i].c, err, sizeof(err));
        EXPECT(!ok, "config with a bad %s accepted", cases[i].field);
        EXPECT(strstr(err, cases[i].field) != NULL, "error '%s' does not name %s", err, cases[i].field);
    }
    return TEST_RESULT;
}

// The layout: aligned, disjoint tensors; each layer's tensors inside its bucket, the buckets
// tiling the buffer in order, and every layer's bucket the same; the flags the optimizer reads (decay; with Muon, Muon's matrices)
// matching each tensor's kind; and the parameter count against an independent formula.
static int test_param_table_layout(void) {
    int failed = 0;
    for (size_t ci = 0; ci < sizeof(SANE_CONFIGS) / sizeof(SANE_CONFIGS[0]); ci++) {
        const ModelConfig* c = &SANE_CONFIGS[ci];
        ParamTable pt;
        param_table_build(&pt, c, 1);
        uint8_t *flags = param_flags(&pt, c, false), *muon_flags = param_flags(&pt, c, true);
        size_t end = 0, count = 0;
        for (int i = 0; i < pt.n_tensors; i++) {
            const ParamTensor* t = &pt.tensors[i];
            size_t n = (size_t)(t->rows * t->cols);
            int bucket = t->layer >= 0 ? t->layer : c->n_layer;
            EXPECT(t->offset % PARAM_ALIGN == 0, "%s not aligned", t->name);
            EXPECT(t->offset >= end, "%s overlaps its predecessor", t->name);
            EXPECT(t->offset >= pt.bucket_offset[bucket] && t->offset + n <= pt.bucket_offset[bucket + 1],
                   "%s outside bucket %d", t->name, bucket);
            bool matrix = t->kind == P_QKV || t->kind == P_ATTN_OUT || t->kind == P_GATE_UP || t->kind == P_DOWN;
            EXPECT(t->decay == (t->kind == P_EMBED || matrix), "%s: wrong decay flag", t->name);
            int with_muon = (t->decay ? PARAM_FLAG_DECAY : 0) | (matrix ? PARAM_FLAG_MUON : 0);
            for (size_t j = 0; j < n; j += PARAM_ALIGN)
                if (flags[(t->offset + j) / PARAM_ALIGN] != t->decay ||
                    muon_flags[(t->offset + j) / PARAM_ALIGN] != with_muon) {
                    EXPECT(false, "%s: the optimizer's flag at element %zu is wrong", t->name, j);
                    break;
                }
            EXPECT(param(&pt, t->kind, t->layer) == t, "lookup of %s", t->name);
            // FP8's AdamW (adamw_making_fp8_weights) finds a kind's matrix in layer l a bucket per layer on
            EXPECT(t->layer < 0 || t->offset == param(&pt, t->kind, 0)->offset + t->layer * bucket_len(&pt, 0),
                   "%s is not %d buckets after layer 0's", t->name, t->layer);
            end = t->offset + n;
            count += n;
        }
        EXPECT(pt.bucket_offset[0] == 0 && pt.bucket_offset[c->n_layer + 1] == pt.n_elements, "buckets do not tile");
        for (int b = 0; b <= c->n_layer; b++)
            EXPECT(pt.bucket_offset[b] < pt.bucket_offset[b + 1], "bucket %d is empty", b);
        EXPECT(end <= pt.n_elements, "table overflows its buffer");
        // independent count: embedding + per layer (qkv, o, gate_up, down, 4 norms) + final norm
        size_t C = c->d_model, D = c->head_dim, F = c->ffn_dim, Hq = c->n_head, Hkv = c->n_kv_head;
        size_t expect = (size_t)c->vocab_size * C + C +
                        c->n_layer * (C * (Hq + 2 * Hkv) * D + Hq * D * C + 3 * C * F + 2 * C + 2 * D);
        EXPECT(count == expect && param_count(&pt) == expect, "config %zu: %zu parameters, expected %zu", ci, count,
               expect);
        free(flags);
        free(muon_flags);
        param_table_free(&pt);
    }
    return TEST_RESULT;
}

// The parameter table pads each bucket for W ranks, and ZeRO cuts it into W pieces (owned_part);
// the checkpoint cuts its used elements into S shards (bucket_split). Over awkward configs and
// world sizes: every bucket is a multiple of W x PARAM_ALIGN long with less than that of padding,
// the W pieces are equal, aligned and consecutive and each holds exactly bucket_split's range of
// real elements for that rank, and those ranges tile the used elements.
static int test_param_table_buckets_split_evenly(void) {
    int failed = 0;
    const int worlds[] = {1, 2, 3, 7, 8};
    for (size_t ci = 0; ci < sizeof(SANE_CONFIGS) / sizeof(SANE_CONFIGS[0]); ci++)
        for (int wi = 0; wi < 5; wi++) {
            int W = worlds[wi];
            GPT m;
            memset(&m, 0, sizeof(m));
            m.cfg = SANE_CONFIGS[ci];
            m.dp.world = W, m.dp.zero = W > 1 ? 1 : 0;
            param_table_build(&m.table, &m.cfg, W);
            for (int b = 0; b <= m.cfg.n_layer; b++) {
                size_t start = m.table.bucket_offset[b], len = bucket_len(&m.table, b), used = m.table.bucket_used[b];
                size_t unit = (size_t)W * PARAM_ALIGN, real = 0;
                EXPECT(len % unit == 0 && len >= used && len - used < unit, "config %zu W %d bucket %d: %zu elements "
                       "for %zu used", ci, W, b, len, used);
                CommShards shards = bucket_split(used, W);
                for (int r = 0; r < W; r++) {
                    m.dp.rank = r;
                    size_t begin, end;
                    owned_part(&m, b, &begin, &end);
                    CommRange mine = comm_shard_range(&shards, r);
                    EXPECT(end - begin == len / W && begin == start + r * (len / W) && begin % PARAM_ALIGN == 0,
                           "config %zu W %d bucket %d rank %d: piece [%zu, %zu)", ci, W, b, r, begin, end);
                    EXPECT(mine.end <= used && start + mine.begin >= begin && start + mine.end <= end &&
                           mine.begin == real, "config %zu W %d bucket %d rank %d: real [%zu, %zu) outside its piece",
                           ci, W, b, r, mine.begin, mine.end);
                    real = mine.end > real ? mine.end : real;
                }
                EXPECT(real == used, "config %zu W %d bucket %d: the pieces hold %zu of %zu", ci, W, b, real, used);
            }
            param_table_free(&m.table);
        }
    return TEST_RESULT;
}

// Every element of every parameter is exported exactly once under an HF name.
static int test_hf_names_cover_every_parameter(void) {
    int failed = 0;
    GPT m;
    memset(&m, 0, sizeof(m));
    m.cfg = SANE_CONFIGS[3];
    param_table_build(&m.table, &m.cfg, 1);
    int n = hf_tensors(&m, NULL);
    HfTensor* hf = (HfTensor*)malloc(n * sizeof(HfTensor));
    hf_tensors(&m, hf);
    EXPECT(n == 2 + 11 * m.cfg.n_layer, "%d HF tensors", n);
    unsigned char* seen = (unsigned char*)calloc(m.table.n_elements, 1);
    for (int i = 0; i < n; i++)
        for (int64_t j = 0; j < hf[i].rows * hf[i].cols; j++) seen[hf[i].offset + j]++;
    for (int i = 0; i < m.table.n_tensors; i++) {
        const ParamTensor* t = &m.table.tensors[i];
        for (int64_t j = 0; j < t->rows * t->cols; j++)
            if (seen[t->offset + j] != 1) {
                EXPECT(false, "%s element %lld exported %d times", t->name, (long long)j, seen[t->offset + j]);
                break;
            }
    }
    free(seen);
    free(hf);
    param_table_free(&m.table);
    return TEST_RESULT;
}

static int test_learning_rate_schedules(void) {
    int failed = 0;
    OptimConfig o = {1e-3f, 0.1f, 0.0f, 0.9f, 0.95f, 1e-8f, 1.0f, 10, 110, 0, 0.2f};
    EXPECT(fabsf(learning_rate(&o, 0) - 1e-4f) < 1e-9f, "warmup starts at lr/warmup: %g", learning_rate(&o, 0));
    EXPECT(fabsf(learning_rate(&o, 9) - 1e-3f) < 1e-9f, "warmup ends at lr");
    EXPECT(fabsf(learning_rate(&o, 10) - 1e-3f) < 1e-7f, "cosine starts at lr");
    EXPECT(fabsf(learning_rate(&o, 109) - 1e-4f) < 1e-7f, "cosine ends at min lr: %g", learning_rate(&o, 109));
    EXPECT(fabsf(learning_rate(&o, 60) - 5.5e-4f) < 2e-5f, "cosine midpoint: %g", learning_rate(&o, 60));
    for (int s = 11; s < 110; s++) EXPECT(learning_rate(&o, s) <= learning_rate(&o, s - 1), "cosine rises at %d", s);
    o.wsd = 1;  // decay over the last 20% = 22 steps: 88..109
    EXPECT(learning_rate(&o, 87) == 1e-3f, "WSD stable phase");
    EXPECT(learning_rate(&o, 88) < 1e-3f && learning_rate(&o, 88) > 9e-4f, "WSD decay starts");
    EXPECT(fabsf(learning_rate(&o, 109) - 1e-4f) < 1e-7f, "WSD ends at min lr: %g", learning_rate(&o, 109));
    return TEST_RESULT;
}

// The master weights' two halves (kernels.cuh, master_split): every fp32 value comes back bit for bit
// from its bf16 half and its low half, and the bf16 half is the value rounded to the nearest bf16,
// as CUDA's own cast (ties to even) rounds it but on exact ties, which go away from zero. Values:
// every low pattern under a few bf16 values of both signs (ties among them), normals at scales
// from 1e-30 to 1e30, subnormals, zeros, the largest finite values (whose rounding overflows to
// infinity, the join still exact), infinities; a NaN stays a NaN.
static int test_master_halves_round_trip(void) {
    int failed = 0;
    size_t n_values = 0, n_ties = 0, bad_join = 0, bad_round = 0;
    uint32_t highs[] = {0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0000, 0x8000, 0x0001, 0x7F7F, 0xFF7F, 0x7F80, 0x4B00};
    const int n_normals = 200000;
    for (size_t k = 0; k < sizeof(highs) / sizeof(highs[0]) * 65536 + n_normals; k++) {
        float x;
        if (k < sizeof(highs) / sizeof(highs[0]) * 65536) {
            uint32_t bits = highs[k / 65536] << 16 | (uint32_t)(k % 65536);
            if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFF)) continue;  // NaNs: below
            memcpy(&x, &bits, 4);
        } else {
            x = (float)(rand_normal() * pow(10.0, -30 + 60 * rand_uniform()));
        }
        int16_t low;
        bf16 w = master_split(x, &low);
        float back = master_join(w, low);
        bad_join += memcmp(&back, &x, 4) != 0;
        double wd = __bfloat162float(w), rne = __bfloat162float(__float2bfloat16(x));
        bool tie = wd != rne && fabs(wd - x) == fabs(rne - x);
        n_ties += tie;
        bad_round += !(wd == rne || (tie && fabs(wd) > fabs(rne)));
        n_values++;
    }
    EXPECT(bad_join == 0, "%zu of %zu values did not come back bit for bit", bad_join, n_values);
    EXPECT(bad_round == 0, "%zu of %zu bf16 halves are not the nearest bf16", bad_round, n_values);
    EXPECT(n_ties >= 5, "only %zu ties were tried", n_ties);  // the five even highs' 0x8000
    float nan = NAN;
    int16_t low;
    bf16 w = master_split(nan, &low);
    EXPECT(isnan(master_join(w, low)) && isnan(__bfloat162float(w)), "a NaN did not stay a NaN");
    return TEST_RESULT;
}

// What the head's fused forward (hopper_logits_exp) refuses, through the check it shares with the
// SwiGLU products: x [R, C], E [V, C] and probs [R, V] want C and V multiples of 8 and 16-byte
// aligned operands; any R goes.
static int test_hopper_logits_requirements(void) {
    int failed = 0;
    alignas(16) static bf16 buf[64];
    bf16 *p = buf, *odd = buf + 1;
    struct {
        const bf16* x;
        int R, C, V;
        bool ok;
        const char* what;
    } cases[] = {
        {p, 1, 8, 8, true, "the smallest shape"},
        {p, 4097, 768, 50304, true, "rows no multiple of 8 or of a tile"},
        {p, 0, 8, 8, false, "no rows"},
        {p, 16, 12, 8, false, "d_model 12: x's and E's rows do not start on 16 bytes"},
        {p, 16, 8, 50257, false, "V 50257: the exponentials' rows do not start on 16 bytes"},
        {odd, 16, 8, 8, false, "x not 16-byte aligned"},
    };
    for (auto& tc : cases) {
        const char* problem = hopper_logits_problem(p, tc.x, p, tc.R, tc.C, tc.V);
        EXPECT((problem == NULL) == tc.ok, "%s: %s", tc.what, problem ? problem : "accepted");
    }
    return TEST_RESULT;
}

// What our Hopper GEMM's fused gate/up forward and down backward accept (lib/matmul_hopper.cuh):
// the trainer takes those paths exactly where hopper_swiglu_problem and
// hopper_swiglu_backward_problem say NULL, and cuBLASLt's otherwise.
static int test_hopper_swiglu_requirements(void) {
    int failed = 0;
    alignas(16) static bf16 buf[64];
    bf16 *p = buf, *odd = buf + 1;  // 16-byte aligned, and 2 bytes past that
    struct {
        bool backward;      // the down input gradient's (dy [N, O], W [O, I], I = F), else the gate/up forward's
        const bf16* tested;  // the forward's x, the backward's gate_up; the other operands are p
        int N, I, O;
        bool ok;
        const char* what;
    } cases[] = {
        {false, p, 1, 8, 16, true, "the smallest shape: one row, I 8, F 8"},
        {false, p, 2201, 200, 2000, true, "rows not a multiple of 8 or of a tile; I and F multiples of 8 only"},
        {false, p, 0, 8, 16, false, "no rows"},
        {false, p, 16, 12, 16, false, "I 12: x's rows do not start on 16 bytes"},
        {false, p, 16, 8, 24, false, "F 12: the up halves do not start on 16 bytes"},
        {false, p, 16, 8, 15, false, "O odd: no gate/up split"},
        {false, odd, 16, 8, 16, false, "x not 16-byte aligned"},
        {true, p, 1, 8, 8, true, "backward, the smallest shape: one row, F 8, d_model 8"},
        {true, p, 2201, 1000, 200, true, "backward, rows no multiple of 8 or of a tile; F and d_model multiples of 8"},
        {true, p, 0, 8, 8, false, "backward, no rows"},
        {true, p, 16, 12, 8, false, "backward, F 12: the up halves do not start on 16 bytes"},
        {true, p, 16, 8, 12, false, "backward, d_model 12: dy's rows do not start on 16 bytes"},
        {true, odd, 16, 8, 8, false, "backward, gate_up not 16-byte aligned"},
    };
    for (auto& tc : cases) {
        const char* problem = tc.backward ? hopper_swiglu_backward_problem(p, NULL, p, p, tc.tested, tc.N, tc.I, tc.O)
                                          : hopper_swiglu_problem(p, p, tc.tested, p, tc.N, tc.I, tc.O);
        EXPECT((problem == NULL) == tc.ok, "%s: %s", tc.what, problem ? problem : "accepted");
    }
    EXPECT(hopper_swiglu_backward_problem(p, p, p, p, p, 16, 8, 8) == NULL &&
               hopper_swiglu_backward_problem(p, odd, p, p, p, 16, 8, 8) != NULL,
           "the backward with an act to remake: a 16-byte aligned act must be accepted, a misaligned one refused");
    return TEST_RESULT;
}

static int test_flops_per_token(void) {
    int failed = 0;
    // the same count written out for the default model, as the PyTorch baseline counts it:
    double d = 768, L = 12, V = 50304, dq = 768, dkv = 256, F = 2048, T = 1024;
    double expect = 6 * (L * (d * dq + 2 * d * dkv + dq * d + 3 * d * F) + V * d) + 12 * L * dq * T;
    EXPECT(fabs(flops_per_token(&DEFAULT_CONFIG) - expect) < 1.0, "%.0f vs %.0f", flops_per_token(&DEFAULT_CONFIG),
           expect);
    return TEST_RESULT;
}

static size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// FP8 mode's memory for a model of config c with N rows per micro-batch and P parameters, from
// the shapes: two arrays of scales, the weights and their transposes (a byte each), the inputs'
// codes and their transposes (N x the widest input), and the output gradients' (N x the widest
// output, or with the head in FP8 a chunk's dlogits if larger); each carve but the last rounded up.
static size_t fp8_bytes_expected(const ModelConfig* c, size_t N, size_t P, size_t loss_chunk, bool head) {
    size_t C = c->d_model, F = c->ffn_dim, A = (size_t)c->n_head * c->head_dim, Q = qkv_dim(c);
    size_t widest_in = C > A ? C : A, widest_out = Q > 2 * F ? Q : 2 * F;
    widest_in = F > widest_in ? F : widest_in;
    widest_out = C > widest_out ? C : widest_out;
    size_t dy = N * widest_out;
    if (head && loss_chunk * c->vocab_size > dy) dy = loss_chunk * c->vocab_size;
    size_t scales = round_up_256(fp8_n_scales(c) * sizeof(Fp8Scale));
    return 2 * scales + 2 * round_up_256(P) + 2 * round_up_256(N * widest_in) + round_up_256(dy) + dy;
}

// --recompute auto's choice (recompute_layers_that_fit), on the host, for several models, GPU
// counts, FP8 modes and headrooms, against an independent computation. Each layer recomputed
// beyond the first saves its recomputable tensors (each carve rounded up to 256 bytes): all four
// in bf16 and with FP8's current scaling; with delayed scaling only q/k/v, since every layer
// shares the norms' and SwiGLU's outputs anyway, so that its plan at k = 0 is the bf16 plan's
// less L - 1 layers' norm and SwiGLU outputs, plus FP8's own memory. An FP8 plan also holds
// d_mlp_act [N, F], the down input gradient, which BF16's fused SwiGLU backward never stores (all
// these shapes are ones our GEMM takes). So the plan at k is
// expected(k) = plan(0) - max(k - 1, 0) x per_layer: checked against the plan at every k. The
// fewest k that fit F free bytes with headroom H then has a closed form: 0 if plan(0) + H <= F,
// else 1 + ceil((plan(0) + H - F) / per_layer) if that is at most L, else none. Swept over F at
// every boundary, the choice must match it, be monotone in F, leave the plan at k fitting and the
// plan at k - 1 not, and end in one line naming the shortfall when even k = L does not fit.
static int test_recompute_auto_choice(void) {
    int failed = 0;
    const ModelConfig one_b = {50304, 2048, 16, 32, 8, 64, 8192, 1024, 1e6f, 1e-6f};
    const ModelConfig odd = {512, 128, 3, 4, 2, 64, 256, 77, 1e4f, 1e-6f};
    const ModelConfig one_layer = {256, 128, 1, 2, 2, 64, 192, 130, 1e4f, 1e-6f};
    const Fp8Mode delayed = {true, FP8_DELAYED, false, false}, delayed_head = {true, FP8_DELAYED, true, false};
    const Fp8Mode current = {true, FP8_CURRENT, false, false};
    const size_t margin = RECOMPUTE_MARGIN_BYTES;
    struct {
        const ModelConfig* c;
        int B;
        Sharding dp;
        Fp8Mode fp8;
        size_t headroom;
    } cases[] = {
        {&DEFAULT_CONFIG, 32, ONE_GPU, FP8_OFF, margin}, {&DEFAULT_CONFIG, 32, ONE_GPU, delayed, margin},
        {&DEFAULT_CONFIG, 32, ONE_GPU, current, margin}, {&one_b, 8, {0, 2, 1, NULL}, delayed_head, margin},
        {&one_b, 8, {1, 4, 2, NULL}, FP8_OFF, margin},   {&odd, 3, ONE_GPU, FP8_OFF, 0},
        {&one_layer, 2, ONE_GPU, FP8_OFF, 0},
    };
    for (auto& tc : cases) {
        const ModelConfig* c = tc.c;
        int L = c->n_layer;
        size_t N = (size_t)tc.B * c->seq_len, headroom = tc.headroom;
        size_t norms = 2 * round_up_256(N * c->d_model * 2) + round_up_256(N * c->ffn_dim * 2);
        size_t qkv = round_up_256(N * qkv_dim(c) * 2);
        bool norms_shared = tc.fp8.on && tc.fp8.scaling == FP8_DELAYED;
        size_t per_layer = norms_shared ? qkv : norms + qkv;
        GPT bf16_plan;
        gpt_plan(&bf16_plan, c, tc.B, c->seq_len, 0, 4096, &tc.dp, OPTIMIZER_ADAMW, FP8_OFF);
        size_t expected[MAX_LAYERS + 1];
        expected[0] = gpt_bytes_total(&bf16_plan);
        if (tc.fp8.on)
            expected[0] += fp8_bytes_expected(c, N, bf16_plan.table.n_elements, bf16_plan.loss_chunk, tc.fp8.head) +
                           round_up_256(N * c->ffn_dim * 2);
        if (norms_shared) expected[0] -= (size_t)(L - 1) * norms;
        gpt_plan_free(&bf16_plan);
        for (int k = 0; k <= L; k++) {
            GPT m;
            gpt_plan(&m, c, tc.B, c->seq_len, k, 4096, &tc.dp, OPTIMIZER_ADAMW, tc.fp8);
            expected[k] = expected[0] - (k > 1 ? (size_t)(k - 1) * per_layer : 0);
            EXPECT(gpt_bytes_total(&m) == expected[k], "L %d, %d recomputed, fp8 %d (%s): the plan is %zu bytes, "
                   "expected %zu", L, k, tc.fp8.on, FP8_SCALING_NAMES[tc.fp8.scaling], gpt_bytes_total(&m),
                   expected[k]);
            gpt_plan_free(&m);
        }
        GPT m;
        gpt_plan(&m, c, tc.B, c->seq_len, L, 4096, &tc.dp, OPTIMIZER_ADAMW, tc.fp8);
        size_t frees[3 * (MAX_LAYERS + 1) + 2], n_frees = 0;
        frees[n_frees++] = 0;
        for (int k = L; k >= 0; k--)
            for (int d = -1; d <= 1; d++) frees[n_frees++] = expected[k] + headroom + d;
        frees[n_frees++] = (size_t)1 << 50;
        qsort(frees, n_frees, sizeof(size_t), [](const void* a, const void* b) {
            size_t x = *(const size_t*)a, y = *(const size_t*)b;
            return (x > y) - (x < y);
        });
        int previous = L + 1;
        for (size_t i = 0; i < n_frees; i++) {
            size_t f = frees[i], need0 = expected[0] + headroom;
            int want = f >= need0 ? 0 : -1;
            if (want < 0 && L >= 2) {
                size_t k = 1 + (need0 - f + per_layer - 1) / per_layer;
                want = k <= (size_t)L ? (int)k : -1;
            }
            char err[512] = "";
            int k = recompute_layers_that_fit(&m, f, headroom, err, sizeof(err));
            EXPECT(k == want, "L %d, %zu bytes free, headroom %zu: chose %d, expected %d", L, f, headroom, k, want);
            int as_count = k < 0 ? L + 1 : k;
            EXPECT(as_count <= previous, "L %d: %d layers at %zu bytes free, after %d at fewer", L, k, f, previous);
            previous = as_count;
            if (k >= 0) {
                EXPECT(m.recompute_layers == k && gpt_bytes_total(&m) + headroom <= f,
                       "L %d: the plan at %d does not fit", L, k);
                GPT fewer;
                if (k > 0) {
                    gpt_plan(&fewer, c, tc.B, c->seq_len, k - 1, 4096, &tc.dp, OPTIMIZER_ADAMW, tc.fp8);
                    EXPECT(gpt_bytes_total(&fewer) + headroom > f, "L %d: %d layers fit but %d were chosen", L, k - 1,
                           k);
                    gpt_plan_free(&fewer);
                }
            } else {
                EXPECT(err[0] && !strchr(err, '\n') && strstr(err, "needs") && strstr(err, "lower --batch"),
                       "L %d, %zu bytes free: no choice, and the line is '%s'", L, f, err);
            }
        }
        EXPECT(previous == 0, "L %d: plenty of memory should recompute nothing (%d)", L, previous);
        printf("    L %d, B %d, %d GPU(s), fp8 %s, headroom %.2f GiB: plan %.2f GiB at k = 0, %zu bytes (%.3f GiB) per "
               "recomputed layer\n", L, tc.B, tc.dp.world, tc.fp8.on ? FP8_SCALING_NAMES[tc.fp8.scaling] : "off",
               gib(headroom), gib(expected[0]), per_layer, gib(per_layer));
        gpt_plan_free(&m);
    }
    return TEST_RESULT;
}

// --max-memory (plan_within_limit, recompute_room), on the host: for the default model and 1b, a
// limit at each plan's size, one byte under and one over, and GPUs with plenty of memory free or
// less than the limit. --recompute auto must pick the fewest recomputed layers whose plan takes at
// most the limit and leaves the margin free (found here by planning every k in turn), or none; the
// limit check must pass that plan and refuse the plan with one layer fewer, in one line that
// names the flag and says what would lower it.
static int test_recompute_within_max_memory(void) {
    int failed = 0;
    const ModelConfig one_b = {50304, 2048, 16, 32, 8, 64, 8192, 1024, 1e6f, 1e-6f};
    struct {
        const ModelConfig* c;
        int B;
    } cases[] = {{&DEFAULT_CONFIG, 32}, {&one_b, 8}};
    const size_t margin = RECOMPUTE_MARGIN_BYTES;
    for (auto& tc : cases) {
        const ModelConfig* c = tc.c;
        int L = c->n_layer;
        size_t plan[MAX_LAYERS + 1];
        for (int k = 0; k <= L; k++) {
            GPT m;
            gpt_plan(&m, c, tc.B, c->seq_len, k, 4096, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
            plan[k] = gpt_bytes_total(&m);
            gpt_plan_free(&m);
        }
        GPT m;
        gpt_plan(&m, c, tc.B, c->seq_len, L, 4096, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
        int checked = 0;
        for (int k = 0; k <= L; k++)
            for (int d = -1; d <= 1; d++) {
                size_t limit = plan[k] + d;
                size_t frees[] = {(size_t)1 << 50, limit + margin / 2};
                for (size_t f : frees) {
                    int want = -1;  // the fewest k whose plan keeps to the limit and to f with the margin
                    for (int j = L; j >= 0; j--)
                        if (plan[j] <= limit && plan[j] + margin <= f) want = j;
                    char err[512] = "";
                    int got = recompute_layers_that_fit(&m, recompute_room(f, limit), margin, err, sizeof(err));
                    EXPECT(got == want, "L %d, limit %zu, %zu free: chose %d, expected %d", L, limit, f, got, want);
                    if (got < 0) continue;
                    EXPECT(plan_within_limit(&m, limit, err, sizeof(err)), "L %d: the chosen plan (%d) is refused: %s",
                           L, got, err);
                    if (got == 0) continue;
                    GPT fewer;
                    gpt_plan(&fewer, c, tc.B, c->seq_len, got - 1, 4096, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
                    bool over = !plan_within_limit(&fewer, limit, err, sizeof(err));
                    EXPECT(over || plan[got - 1] + margin > f, "L %d, limit %zu: %d layers would keep to it", L, limit,
                           got - 1);
                    if (over)
                        EXPECT(!strchr(err, '\n') && strstr(err, "--max-memory") && strstr(err, "lower --batch"),
                               "the line: '%s'", err);
                    gpt_plan_free(&fewer);
                    checked++;
                }
            }
        EXPECT(checked > L, "L %d: only %d choices checked", L, checked);
        char err[512];
        EXPECT(plan_within_limit(&m, 0, err, sizeof(err)), "no limit refused a plan");
        gpt_plan_free(&m);
    }
    return TEST_RESULT;
}

// A tiny model for the reference checks. head_dim 8 is fine on the CPU (the GPU needs 64 or 128).
static const ModelConfig TINY = {24, 16, 2, 4, 2, 8, 24, 5, 10000.0f, 1e-5f};

static double* random_params(const ModelConfig* c, const ParamTable* pt, double matrix_std) {
    double* p = (double*)calloc(pt->n_elements, sizeof(double));
    for (int i = 0; i < pt->n_tensors; i++) {
        const ParamTensor* t = &pt->tensors[i];
        bool norm = !t->decay;
        for (int64_t j = 0; j < t->rows * t->cols; j++)
            p[t->offset + j] = norm ? 1.0 + 0.2 * rand_normal() : matrix_std * rand_normal();
    }
    (void)c;
    return p;
}

static uint16_t* random_window(int B, int T, int V) {
    uint16_t* w = (uint16_t*)malloc((size_t)B * (T + 1) * sizeof(uint16_t));
    for (int i = 0; i < B * (T + 1); i++) w[i] = (uint16_t)(rand_uniform() * V);
    return w;
}

// The CPU reference's gradient of every tensor against central differences, in fp64.
static int test_reference_gradients_match_finite_differences(void) {
    int failed = 0;
    ParamTable pt;
    param_table_build(&pt, &TINY, 1);
    double* p = random_params(&TINY, &pt, 0.5);
    double* g = (double*)calloc(pt.n_elements, sizeof(double));
    double* scratch = (double*)calloc(pt.n_elements, sizeof(double));
    int B = 2, T = TINY.seq_len;
    uint16_t* window = random_window(B, T, TINY.vocab_size);
    ref_forward_backward(&TINY, &pt, p, g, window, B, T);
    double worst = 0.0;
    for (int i = 0; i < pt.n_tensors; i++) {
        const ParamTensor* t = &pt.tensors[i];
        for (int probe = 0; probe < 4; probe++) {
            size_t j = t->offset + (size_t)(rand_uniform() * t->rows * t->cols);
            double h = 1e-5, saved = p[j];
            p[j] = saved + h;
            double up = ref_forward_backward(&TINY, &pt, p, scratch, window, B, T);
            p[j] = saved - h;
            double down = ref_forward_backward(&TINY, &pt, p, scratch, window, B, T);
            p[j] = saved;
            double fd = (up - down) / (2 * h);
            double err = fabs(fd - g[j]) / fmax(1e-6, fabs(fd) + fabs(g[j]));
            if (err > worst) worst = err;
            EXPECT(err < 1e-5, "%s[%zu]: analytic %.10g vs finite difference %.10g", t->name, j - t->offset, g[j], fd);
        }
    }
    printf("    worst relative difference %.2e over %d tensors\n", worst, pt.n_tensors);
    free(p);
    free(g);
    free(scratch);
    free(window);
    free(pt.tensors);
    return TEST_RESULT;
}

// The export writes every HF tensor with the values of its rows of the flat buffer.
static int test_export_hf_files(void) {
    int failed = 0;
    GPT m;
    memset(&m, 0, sizeof(m));
    m.cfg = (ModelConfig){64, 16, 2, 4, 2, 64, 24, 8, 5e5f, 1e-6f};
    param_table_build(&m.table, &m.cfg, 1);
    float* w = (float*)calloc(m.table.n_elements, sizeof(float));
    for (size_t i = 0; i < m.table.n_elements; i++) w[i] = (float)rand_normal();
    char dir[64], err[512];
    EXPECT(make_test_dir(dir, sizeof(dir), "test_gpt_export") == 0, "mkdtemp");
    EXPECT(export_hf(&m, w, dir, err, sizeof(err)), "export failed: %s", err);
    char path[1024];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    StFile f;
    if (st_open(&f, path, err, sizeof(err)) != 0) {
        EXPECT(false, "reading the export back: %s", err);
    } else {
        int n = hf_tensors(&m, NULL);
        HfTensor* hf = (HfTensor*)malloc(n * sizeof(HfTensor));
        hf_tensors(&m, hf);
        for (int i = 0; i < n; i++) {
            const StTensor* t = st_find(&f, hf[i].name);
            EXPECT(t != NULL, "%s missing", hf[i].name);
            if (!t) continue;
            int64_t count = hf[i].rows * hf[i].cols;
            EXPECT(t->dtype == ST_F32 && t->ndim == (hf[i].rows == 1 ? 1 : 2), "%s dtype/shape", hf[i].name);
            EXPECT(memcmp(t->data, w + hf[i].offset, count * sizeof(float)) == 0, "%s values differ", hf[i].name);
        }
        free(hf);
        st_close(&f);
    }
    snprintf(path, sizeof(path), "%s/config.json", dir);
    FILE* cf = fopen(path, "r");
    EXPECT(cf != NULL, "config.json missing");
    if (cf) {
        char text[4096] = "";
        size_t len = fread(text, 1, sizeof(text) - 1, cf);
        text[len] = '\0';
        fclose(cf);
        EXPECT(strstr(text, "\"head_dim\": 64") && strstr(text, "\"tie_word_embeddings\": true") &&
                   strstr(text, "\"rope_theta\": 500000") && strstr(text, "\"rms_norm_eps\": 9.99999997e-07") &&
                   strstr(text, "\"num_key_value_heads\": 2"),
               "config.json lacks an explicit field:\n%s", text);
    }
    failed |= remove_test_dir(dir);
    free(w);
    free(m.table.tensors);
    return TEST_RESULT;
}

static int test_command_line(void) {
    int failed = 0;
    if (access("./train_gpt", X_OK) != 0) {
        printf("    ./train_gpt not built; run make\n");
        return TEST_FAIL;
    }
    struct {
        const char* args;
        int code;
        const char* says;
    } cases[] = {
        {"--bogus", 2, "unknown flag"},
        {"--batch", 2, "needs a value"},
        {"--batch 0", 2, "--batch"},
        {"--lr abc", 2, "bad value"},
        {"--steps 12x", 2, "bad value"},
        {"--head-dim 96", 2, "head_dim"},
        {"--heads 6 --kv-heads 4", 2, "n_head"},
        {"--batch 4 --total-batch 1000", 2, "--total-batch"},
    };
    char line[512], cmd[256];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(cmd, sizeof(cmd), "./train_gpt %s", cases[i].args);
        int code = run_command(cmd, line, sizeof(line));
        EXPECT(code == cases[i].code && strstr(line, cases[i].says), "'%s' exited %d saying '%s'", cmd, code, line);
    }
    FILE* p = popen("./train_gpt --help", "r");
    char help[16384] = "";
    size_t len = p ? fread(help, 1, sizeof(help) - 1, p) : 0;
    help[len] = '\0';
    int status = p ? pclose(p) : -1;
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "--help exit status");
    EXPECT(strstr(help, "--total-batch") && strstr(help, "(1024)"), "--help lists flags with defaults");
    EXPECT(strstr(help, "--optimizer       'adamw', 'muon' or 'adamw8bit': ") &&
               strstr(help, "--fp8-scaling     'delayed' or 'current': "),
           "--help lists the words of --optimizer and --fp8-scaling");
    if (!g_have_gpu) {
        int code = run_command("./train_gpt --bench --bench-steps 1", line, sizeof(line));
        EXPECT(code == 1 && strstr(line, "no CUDA GPU"), "without a GPU: exit %d, '%s'", code, line);
    }
    return TEST_RESULT;
}

// ----------------------------------------------------------------------------------------------
// GPU kernel tests: each against its CPU reference on fresh random inputs.
// Tolerances: the inputs are exactly the bf16 values both sides see; the GPU rounds its outputs
// to bf16 (relative error up to 2^-9 ~ 2e-3 per element, ~1e-3 in L2), so elementwise kernels must
// agree to 4e-3 in relative L2. Kernels that also round intermediates (attention's P to bf16
// before the PV product; the backward's dS) get 1.5e-2.

// sum_partials: sums of partial rows gathered and added up in one launch (more than a launch takes,
// of different widths, strides and counts, = and +=) keep the bits of each added up alone, and
// match the fp64 sums of the same floats.
static int test_kernel_sum_partials(void) {
    REQUIRE_GPU();
    int failed = 0;
    enum { JOBS = PARTIAL_SUMS_MAX + 2 };
    const int shape[JOBS][3] = {{512, 768, 768}, {37, 128, 256}, {1, 8, 8},   {3, 2056, 2056},
                                {600, 64, 64},   {2, 1, 1},      {131, 96, 200}, {64, 8192, 8192}};  // n, C, stride
    float *d_partials[JOBS], *d_batched[JOBS], *d_alone[JOBS];
    double *partials[JOBS], *start[JOBS];
    PartialSums sums = {};
    for (int k = 0; k < JOBS; k++) {
        const int n = shape[k][0], C = shape[k][1], stride = shape[k][2];
        partials[k] = random_array((size_t)n * stride, 1.0);
        start[k] = random_array(C, 1.0);
        d_partials[k] = to_device_f32(partials[k], (size_t)n * stride);
        d_batched[k] = k % 2 ? to_device_f32(start[k], C) : (float*)device_alloc_poisoned(C * 4);
        d_alone[k] = k % 2 ? to_device_f32(start[k], C) : (float*)device_alloc_poisoned(C * 4);
        sum_partials(&sums, d_batched[k], d_partials[k], n, C, stride, k % 2, 0);
        sum_partials(NULL, d_alone[k], d_partials[k], n, C, stride, k % 2, 0);
    }
    EXPECT(sums.n == JOBS - PARTIAL_SUMS_MAX, "a full list was not added up at once (%d left)", sums.n);
    sum_partials_flush(&sums, 0);
    EXPECT(sums.n == 0, "the flush left %d sums", sums.n);
    for (int k = 0; k < JOBS; k++) {
        const int n = shape[k][0], C = shape[k][1], stride = shape[k][2];
        double *got = from_device_f32(d_batched[k], C), *alone = from_device_f32(d_alone[k], C);
        double* want = (double*)malloc(C * 8);
        for (int c = 0; c < C; c++) {
            want[c] = k % 2 ? (float)start[k][c] : 0.0;
            for (int p = 0; p < n; p++) want[c] += (float)partials[k][(size_t)p * stride + c];
        }
        char name[64];
        snprintf(name, sizeof(name), "sum %d: %d x %d", k, n, C);
        CHECK_CLOSE(name, got, want, C, 1e-5);
        EXPECT(!memcmp(got, alone, C * 8), "sum %d: added up with others, its bits differ from alone", k);
        free(got), free(alone), free(want), free(partials[k]), free(start[k]);
        CUDA_CHECK(cudaFree(d_partials[k]));
        CUDA_CHECK(cudaFree(d_batched[k]));
        CUDA_CHECK(cudaFree(d_alone[k]));
    }
    return TEST_RESULT;
}

static int test_kernel_rmsnorm(void) {
    REQUIRE_GPU();
    int failed = 0;
    int shapes[][2] = {{1, 8}, {77, 768}, {300, 2056}, {64, 8192}};
    for (int k = 0; k < 4; k++) {
        int N = shapes[k][0], C = shapes[k][1];
        bool accumulate = k % 2;  // dw += onto random values, or dw = over NaNs
        double *x = random_array((size_t)N * C, 2.0), *w = random_array(C, 1.0), *dy = random_array((size_t)N * C, 1.0);
        double* dres0 = random_array((size_t)N * C, 1.0);
        bf16 *d_x = to_device_bf16(x, (size_t)N * C), *d_w = to_device_bf16(w, C);
        bf16 *d_dy = to_device_bf16(dy, (size_t)N * C), *d_dres = to_device_bf16(dres0, (size_t)N * C);
        bf16* d_y = (bf16*)device_alloc_poisoned((size_t)N * C * 2);
        bf16* d_y_remade = (bf16*)device_alloc_poisoned((size_t)N * C * 2);  // the backward's copy of y
        float* d_rstd = (float*)device_alloc_poisoned(N * 4);
        double* dw0 = random_array(C, 1.0);
        float* d_dw = accumulate ? to_device_f32(dw0, C) : (float*)device_alloc_poisoned(C * 4);
        float* partials = (float*)device_alloc_poisoned((size_t)ceil_div(N, rmsnorm_bwd_rows(N)) * C * 4);
        rmsnorm_forward(d_y, d_rstd, d_x, d_w, N, C, 1e-6f, 0);
        rmsnorm_backward(d_dres, d_dw, partials, d_y_remade, d_dy, d_x, d_w, d_rstd, N, C, accumulate, NULL, 0);
        double *y = (double*)malloc((size_t)N * C * 8), *rstd = (double*)malloc(N * 8);
        ref_rmsnorm_forward(y, rstd, x, w, N, C, 1e-6);
        double* dres = (double*)malloc((size_t)N * C * 8);
        memcpy(dres, dres0, (size_t)N * C * 8);
        double* dw = (double*)malloc(C * 8);
        for (int c = 0; c < C; c++) dw[c] = accumulate ? (float)dw0[c] : 0.0;
        ref_rmsnorm_backward(dres, dw, dy, x, w, rstd, N, C);
        double *gy = from_device_bf16(d_y, (size_t)N * C), *gr = from_device_f32(d_rstd, N);
        double *gres = from_device_bf16(d_dres, (size_t)N * C), *gdw = from_device_f32(d_dw, C);
        char name[64];
        snprintf(name, sizeof(name), "rmsnorm %dx%d y", N, C);
        CHECK_CLOSE(name, gy, y, (size_t)N * C, 4e-3);
        CHECK_CLOSE("rstd", gr, rstd, N, 1e-5);
        CHECK_CLOSE("d_residual", gres, dres, (size_t)N * C, 4e-3);
        CHECK_CLOSE("dw", gdw, dw, C, 1e-4);
        // the output the backward remakes for a recomputing layer: the forward's bits
        EXPECT(device_bytes_equal(d_y, d_y_remade, (size_t)N * C * 2), "rmsnorm %dx%d: the backward's y differs from "
               "the forward's", N, C);
        double* all[] = {x, w, dy, dres0, dw0, y, rstd, dres, dw, gy, gr, gres, gdw};
        for (double* a : all) free(a);
        void* dev[] = {d_x, d_w, d_dy, d_dres, d_y, d_y_remade, d_rstd, d_dw, partials};
        for (void* d : dev) CUDA_CHECK(cudaFree(d));
    }
    return TEST_RESULT;
}

static int test_kernel_qk_norm_rope(void) {
    REQUIRE_GPU();
    int failed = 0;
    int shapes[][5] = {{2, 37, 6, 2, 128}, {1, 100, 4, 1, 64}, {3, 9, 4, 4, 64}, {1, 1, 2, 1, 128}};
    for (int k = 0; k < 4; k++) {
        const int* s = shapes[k];
        int B = s[0], T = s[1], Hq = s[2], Hkv = s[3], D = s[4], N = B * T, H = Hq + 2 * Hkv;
        bool accumulate = k % 2;  // the norm weights' gradients += onto random values, or = over NaNs
        size_t n = (size_t)N * H * D;
        double theta = 10000.0;
        double *qkv = random_array(n, 1.5), *wq = random_array(D, 1.0), *wk = random_array(D, 1.0);
        double* dout = random_array(n, 1.0);
        bf16 *d_qkv = to_device_bf16(qkv, n), *d_wq = to_device_bf16(wq, D), *d_wk = to_device_bf16(wk, D);
        bf16* d_rot = (bf16*)device_alloc_poisoned(n * 2);
        bf16* d_grad = to_device_bf16(dout, n);
        float* d_rstd = (float*)device_alloc_poisoned((size_t)N * (Hq + Hkv) * 4);
        double *dwq = random_array(D, 1.0), *dwk = random_array(D, 1.0);
        float* d_dwq = accumulate ? to_device_f32(dwq, D) : (float*)device_alloc_poisoned(D * 4);
        float* d_dwk = accumulate ? to_device_f32(dwk, D) : (float*)device_alloc_poisoned(D * 4);
        for (int i = 0; i < D; i++) {  // what the reference adds onto
            dwq[i] = accumulate ? (float)dwq[i] : 0.0;
            dwk[i] = accumulate ? (float)dwk[i] : 0.0;
        }
        float* partials = (float*)device_alloc_poisoned(qk_norm_rope_backward_partials(N, T, Hq, Hkv, D) * 4);
        float* d_rope = device_rope_tables(T, D, (float)theta);
        qk_norm_rope_forward(d_rot, d_rstd, d_qkv, d_wq, d_wk, d_rope, d_rope + (size_t)T * D / 2, N, T, Hq, Hkv, D,
                             1e-6f, 0);
        qk_norm_rope_backward(d_grad, d_dwq, d_dwk, partials, d_qkv, d_rstd, d_wq, d_wk, d_rope,
                              d_rope + (size_t)T * D / 2, NULL, N, T, Hq, Hkv, D, accumulate, NULL, 0);
        double *rot = (double*)malloc(n * 8), *rstd = (double*)malloc((size_t)N * (Hq + Hkv) * 8);
        double* dqkv = (double*)malloc(n * 8);
        ref_qk_norm_rope_forward(rot, rstd, qkv, wq, wk, N, T, Hq, Hkv, D, 1e-6, theta);
        ref_qk_norm_rope_backward(dqkv, dwq, dwk, dout, qkv, rstd, wq, wk, N, T, Hq, Hkv, D, theta);
        double *grot = from_device_bf16(d_rot, n), *gdq = from_device_bf16(d_grad, n);
        double *gwq = from_device_f32(d_dwq, D), *gwk = from_device_f32(d_dwk, D);
        // the forward writes the query and key heads only: the value heads' slots keep their poison
        size_t n_qk = (size_t)N * (Hq + Hkv) * D, at = 0, v_written = 0;
        double *grot_qk = (double*)malloc(n_qk * 8), *rot_qk = (double*)malloc(n_qk * 8);
        for (size_t i = 0; i < n; i++) {
            if ((int)(i / D % H) < Hq + Hkv) {
                grot_qk[at] = grot[i];
                rot_qk[at++] = rot[i];
            } else {
                v_written += !isnan(grot[i]);
            }
        }
        CHECK_CLOSE("qk_norm_rope forward", grot_qk, rot_qk, n_qk, 4e-3);
        EXPECT(v_written == 0, "the forward wrote %zu entries of the value heads' slots", v_written);
        CHECK_CLOSE("qk_norm_rope backward dx", gdq, dqkv, n, 4e-3);
        CHECK_CLOSE("dq_norm", gwq, dwq, D, 1e-4);
        CHECK_CLOSE("dk_norm", gwk, dwk, D, 1e-4);
        double* all[] = {qkv, wq, wk, dout, rot, rstd, dqkv, dwq, dwk, grot, gdq, gwq, gwk, grot_qk, rot_qk};
        for (double* a : all) free(a);
        void* dev[] = {d_qkv, d_wq, d_wk, d_rot, d_grad, d_rstd, d_dwq, d_dwk, partials, d_rope};
        for (void* d : dev) CUDA_CHECK(cudaFree(d));
    }
    return TEST_RESULT;
}

// The attention forward with its output's E4M3 codes (FP8 training's fused path), on the inputs
// that gave `out_plain` [no] (the plain forward's bf16 output), at a scale twice the largest that
// fits its amax, so that the largest values saturate as a cast's would: the bf16 output must be
// the plain forward's bit for bit, each code the reference's rounding of that very bf16 value at
// the scale (test/reference.h), the amax recorded max |out| exactly, and nothing written past the end.
static int check_attention_codes(const char* name, const double* out_plain, size_t no, const bf16* d_qkv, int Q, int B,
                                 int T, int Hq, int Hkv, int D) {
    int failed = 0;
    double amax = 0.0;
    for (size_t i = 0; i < no; i++) amax = fmax(amax, fabs(out_plain[i]));
    Fp8Scale s = fp8_scale_initial(false), after;
    int k = fp8_scale_exponent((float)amax, s.max) + 1;
    s.scale = ldexpf(1.0f, k), s.scale_inv = ldexpf(1.0f, -k);
    Fp8Scale* d_s;
    CUDA_CHECK(cudaMalloc(&d_s, sizeof(s)));
    CUDA_CHECK(cudaMemcpy(d_s, &s, sizeof(s), cudaMemcpyHostToDevice));
    bf16* d_out = (bf16*)device_alloc_poisoned(no * 2);
    float* d_lse = (float*)device_alloc_poisoned((size_t)B * Hq * T * 4);
    uint8_t* d_codes = (uint8_t*)device_alloc_poisoned(no);  // and 256 poisoned bytes past the end
    attention_forward(d_out, d_lse, d_qkv, d_qkv + Hq * D, d_qkv + (Hq + Hkv) * D, Q, B, T, Hq, Hkv, D, 0, d_codes,
                      d_s);
    double* out = from_device_bf16(d_out, no);
    uint8_t* codes = (uint8_t*)malloc(no + 256);
    CUDA_CHECK(cudaMemcpy(codes, d_codes, no + 256, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&after, d_s, sizeof(after), cudaMemcpyDeviceToHost));
    EXPECT(!memcmp(out, out_plain, no * sizeof(double)), "%s: the bf16 output changes with the codes asked for", name);
    size_t wrong = 0, saturated = 0, overrun = 0;
    for (size_t i = 0; i < no; i++) {
        wrong += codes[i] != ref_fp8_encode(out_plain[i] * s.scale, false);
        saturated += fabs(out_plain[i] * s.scale) > s.max;
    }
    for (size_t i = no; i < no + 256; i++) overrun += codes[i] != 0xFF;
    EXPECT(wrong == 0, "%s: %zu of %zu codes differ from the reference's rounding of the bf16 output", name, wrong, no);
    EXPECT(saturated > 0, "%s: no value saturates at scale 2^%d", name, k);
    EXPECT(overrun == 0, "%s: %zu bytes written past the codes' end", name, overrun);
    EXPECT(after.amax == (float)amax && after.scale == s.scale, "%s: amax %.9g (want %.9g), scale %g (was %g)", name,
           after.amax, amax, after.scale, s.scale);
    free(out);
    free(codes);
    void* dev[] = {d_s, d_out, d_lse, d_codes};
    for (void* d : dev) CUDA_CHECK(cudaFree(d));
    return failed;
}

static int test_kernel_attention(void) {
    REQUIRE_GPU();
    int failed = 0;
    // B, T, Hq, Hkv, D: GQA, MQA, MHA, both head dims, T of 1, odd and past a tile
    // the sixth shape takes the head_dim 64 forward's long-sequence kernel (T > 1024); the last has
    // enough (b, KV head)s for the backward's block order to make groups (63 a group: their Q and dO
    // fill 16 MiB), the last of them partial
    int shapes[][5] = {{2, 77, 6, 2, 128}, {1, 300, 4, 1, 64}, {2, 64, 4, 4, 64}, {1, 1, 2, 1, 128}, {1, 257, 2, 2, 128},
                       {1, 1100, 4, 2, 64}, {33, 257, 4, 2, 128}};
    for (auto& s : shapes) {
        int B = s[0], T = s[1], Hq = s[2], Hkv = s[3], D = s[4], N = B * T, Q = (Hq + 2 * Hkv) * D;
        size_t nq = (size_t)N * Q, no = (size_t)N * Hq * D;
        double *qkv = random_array(nq, 1.0), *dout = random_array(no, 1.0);
        bf16 *d_qkv = to_device_bf16(qkv, nq), *d_dout = to_device_bf16(dout, no);
        bf16* d_out = (bf16*)device_alloc_poisoned(no * 2);
        bf16* d_dqkv = (bf16*)device_alloc_poisoned(nq * 2);
        float* d_lse = (float*)device_alloc_poisoned((size_t)B * Hq * T * 4);
        float* d_scratch = (float*)device_alloc_poisoned(attention_backward_scratch_bytes(B, T, Hq, D));
        attention_forward(d_out, d_lse, d_qkv, d_qkv + Hq * D, d_qkv + (Hq + Hkv) * D, Q, B, T, Hq, Hkv, D, 0);
        // the backward's reference uses the GPU's bf16 output, as the GPU backward does
        double* out_gpu = from_device_bf16(d_out, no);
        // deterministic (twice: bitwise equal), then with dQ summed in any order
        double* gd_runs[3];
        for (int run = 0; run < 3; run++) {
            CUDA_CHECK(cudaMemset(d_dqkv, 0xFF, nq * 2));
            attention_backward(d_dqkv, d_dqkv + Hq * D, d_dqkv + (Hq + Hkv) * D, d_scratch, d_dout, d_out, d_lse,
                               d_qkv, d_qkv + Hq * D, d_qkv + (Hq + Hkv) * D, Q, Q, B, T, Hq, Hkv, D, 0, run < 2);
            gd_runs[run] = from_device_bf16(d_dqkv, nq);
        }
        double *out = (double*)malloc(no * 8), *lse = (double*)malloc((size_t)B * Hq * T * 8);
        double* dqkv = (double*)malloc(nq * 8);
        ref_attention_forward(out, lse, qkv, qkv + Hq * D, qkv + (Hq + Hkv) * D, Q, B, T, Hq, Hkv, D);
        ref_attention_backward(dqkv, dqkv + Hq * D, dqkv + (Hq + Hkv) * D, dout, out, lse, qkv, qkv + Hq * D,
                               qkv + (Hq + Hkv) * D, Q, B, T, Hq, Hkv, D);
        double *glse = from_device_f32(d_lse, (size_t)B * Hq * T), *gd = gd_runs[0];
        char name[96];
        snprintf(name, sizeof(name), "attention B%d T%d Hq%d Hkv%d D%d out", B, T, Hq, Hkv, D);
        CHECK_CLOSE(name, out_gpu, out, no, 1.5e-2);
        failed |= check_attention_codes(name, out_gpu, no, d_qkv, Q, B, T, Hq, Hkv, D);
        CHECK_CLOSE("lse", glse, lse, (size_t)B * Hq * T, 1e-4);
        CHECK_CLOSE("dqkv", gd, dqkv, nq, 1.5e-2);
        EXPECT(memcmp(gd_runs[0], gd_runs[1], nq * sizeof(double)) == 0, "%s", "deterministic backward repeats bitwise");
        CHECK_CLOSE("dqkv (dQ summed in any order)", gd_runs[2], dqkv, nq, 1.5e-2);
        double* all[] = {qkv, dout, out_gpu, out, lse, dqkv, glse, gd_runs[0], gd_runs[1], gd_runs[2]};
        for (double* a : all) free(a);
        void* dev[] = {d_qkv, d_dout, d_out, d_dqkv, d_lse, d_scratch};
        for (void* d : dev) CUDA_CHECK(cudaFree(d));
    }
    return TEST_RESULT;
}

// The trainer's backward leaves dQ in attention's fp32 accumulators and the QK norm's backward reads
// it there, tile by tile (qk_norm_rope_backward_q_kernel, through attn_dq_tile_load). Against the
// path through bf16 rows (attention_backward converting dq, the QK backward reading it), with dQ
// summed in a fixed order: every byte of d_qkv (query and key heads' dx, dv) must agree, and the
// norm weights' gradients to rounding (their partial sums group the rows otherwise: per query tile,
// and the key heads' tasks in blocks of their own); with dQ summed in any order, all to rounding.
static int test_kernel_qk_backward_reads_dq_accumulators(void) {
    REQUIRE_GPU();
    int failed = 0;
    // B, T, Hq, Hkv, D: both head dims (query tiles of 64 and 128 rows), T past a tile and not a multiple
    int shapes[][5] = {{2, 77, 6, 2, 128}, {1, 300, 4, 1, 64}, {2, 129, 2, 1, 128}, {1, 130, 4, 2, 64}};
    for (auto& sh : shapes) {
        int B = sh[0], T = sh[1], Hq = sh[2], Hkv = sh[3], D = sh[4], N = B * T, Q = (Hq + 2 * Hkv) * D;
        size_t nq = (size_t)N * Q, no = (size_t)N * Hq * D, n_rstd = (size_t)N * (Hq + Hkv);
        double *qkv = random_array(nq, 1.5), *wq = random_array(D, 1.0), *wk = random_array(D, 1.0);
        double* dout = random_array(no, 1.0);
        bf16 *d_qkv = to_device_bf16(qkv, nq), *d_wq = to_device_bf16(wq, D), *d_wk = to_device_bf16(wk, D);
        bf16 *d_dout = to_device_bf16(dout, no), *d_rot = (bf16*)device_alloc_poisoned(nq * 2);
        bf16* d_out = (bf16*)device_alloc_poisoned(no * 2);
        float *d_rstd = (float*)device_alloc_poisoned(n_rstd * 4), *d_lse = (float*)device_alloc_poisoned(no / D * 4);
        float* d_scratch = (float*)device_alloc_poisoned(attention_backward_scratch_bytes(B, T, Hq, D));
        float* partials = (float*)device_alloc_poisoned(qk_norm_rope_backward_partials(N, T, Hq, Hkv, D) * 4);
        float* d_rope = device_rope_tables(T, D, 10000.0f);
        const bf16 *q = d_rot, *k = d_rot + Hq * D, *v = d_qkv + (Hq + Hkv) * D;
        qk_norm_rope_forward(d_rot, d_rstd, d_qkv, d_wq, d_wk, d_rope, d_rope + (size_t)T * D / 2, N, T, Hq, Hkv, D,
                             1e-6f, 0);
        attention_forward(d_out, d_lse, q, k, v, Q, B, T, Hq, Hkv, D, 0);
        for (int det = 1; det >= 0; det--) {
            double *dqkv[2], *dw[2][2];  // [through bf16 rows, from the accumulators]
            for (int from_acc = 0; from_acc < 2; from_acc++) {
                bf16* d_dqkv = (bf16*)device_alloc_poisoned(nq * 2);
                float *d_dwq = (float*)device_alloc_poisoned(D * 4), *d_dwk = (float*)device_alloc_poisoned(D * 4);
                attention_backward(from_acc ? NULL : d_dqkv, d_dqkv + Hq * D, d_dqkv + (Hq + Hkv) * D, d_scratch,
                                   d_dout, d_out, d_lse, q, k, v, Q, Q, B, T, Hq, Hkv, D, 0, det);
                qk_norm_rope_backward(d_dqkv, d_dwq, d_dwk, partials, d_qkv, d_rstd, d_wq, d_wk, d_rope,
                                      d_rope + (size_t)T * D / 2, from_acc ? attn_dq_acc(d_scratch, B, T, Hq) : NULL,
                                      N, T, Hq, Hkv, D, false, NULL, 0);
                dqkv[from_acc] = from_device_bf16(d_dqkv, nq);
                dw[from_acc][0] = from_device_f32(d_dwq, D);
                dw[from_acc][1] = from_device_f32(d_dwk, D);
                void* dev[] = {d_dqkv, d_dwq, d_dwk};
                for (void* d : dev) CUDA_CHECK(cudaFree(d));
            }
            char name[128];
            snprintf(name, sizeof(name), "B%d T%d Hq%d Hkv%d D%d %s", B, T, Hq, Hkv, D,
                     det ? "deterministic" : "dQ in any order");
            if (det) {
                EXPECT(!memcmp(dqkv[0], dqkv[1], nq * sizeof(double)), "%s: d_qkv differs from the bf16 path", name);
                CHECK_CLOSE("dq_norm (summed per query tile)", dw[1][0], dw[0][0], D, 1e-5);
                CHECK_CLOSE("dk_norm (key heads' blocks)", dw[1][1], dw[0][1], D, 1e-5);
            } else {
                CHECK_CLOSE(name, dqkv[1], dqkv[0], nq, 1e-2);
                CHECK_CLOSE("dq_norm (dQ in any order)", dw[1][0], dw[0][0], D, 1e-2);
            }
            double* all[] = {dqkv[0], dqkv[1], dw[0][0], dw[0][1], dw[1][0], dw[1][1]};
            for (double* a : all) free(a);
        }
        double* all[] = {qkv, wq, wk, dout};
        for (double* a : all) free(a);
        void* dev[] = {d_qkv, d_wq, d_wk, d_dout, d_rot, d_out, d_rstd, d_lse, d_scratch, partials, d_rope};
        for (void* d : dev) CUDA_CHECK(cudaFree(d));
    }
    return TEST_RESULT;
}

static int test_kernel_swiglu(void) {
    REQUIRE_GPU();
    int failed = 0;
    int shapes[][2] = {{1, 8}, {77, 2048}, {33, 1376}};
    for (auto& s : shapes) {
        int N = s[0], F = s[1];
        size_t n = (size_t)N * F;
        double *gu = random_array(2 * n, 2.0), *dy = random_array(n, 1.0);
        bf16 *d_gu = to_device_bf16(gu, 2 * n), *d_dy = to_device_bf16(dy, n);
        bf16* d_out = (bf16*)device_alloc_poisoned(n * 2);
        bf16* d_dgu = (bf16*)device_alloc_poisoned(2 * n * 2);
        swiglu_forward(d_out, d_gu, N, F, 0);
        swiglu_backward(d_dgu, d_dy, d_gu, N, F, 0);
        double *out = (double*)malloc(n * 8), *dgu = (double*)malloc(2 * n * 8);
        ref_swiglu_forward(out, gu, N, F);
        ref_swiglu_backward(dgu, dy, gu, N, F);
        double *gout = from_device_bf16(d_out, n), *gdgu = from_device_bf16(d_dgu, 2 * n);
        CHECK_CLOSE("swiglu forward", gout, out, n, 4e-3);
        CHECK_CLOSE("swiglu backward", gdgu, dgu, 2 * n, 4e-3);
        double* all[] = {gu, dy, out, dgu, gout, gdgu};
        for (double* a : all) free(a);
        void* dev[] = {d_gu, d_dy, d_out, d_dgu};
        for (void* d : dev) CUDA_CHECK(cudaFree(d));
    }
    return TEST_RESULT;
}

// Random targets, but row 0 aims at logit 0 and row 1 at logit V - 1 (the row's two ends).
static int* random_targets(int N, int V) {
    int* targets = (int*)malloc(N * sizeof(int));
    for (int i = 0; i < N; i++) targets[i] = i == 0 ? 0 : i == 1 ? V - 1 : (int)(rand_uniform() * V);
    return targets;
}

// V: multiples of 8 (config_check's rule) from one vector to Qwen3's 151936; 4104 ends one vector
// into a second sweep of the block; 65536 and 151936 are longer than the shared memory a block
// keeps, so their remainder is read a second time. The dlogits overwrite the logits, so they cannot
// be poisoned; a dlogit left unwritten keeps its logit, far from any gradient.
static int test_kernel_cross_entropy(void) {
    REQUIRE_GPU();
    int failed = 0;
    int shapes[][2] = {{1, 8}, {37, 1000}, {5, 4104}, {5, 50304}, {3, 65536}, {3, 151936}};
    EXPECT(65536 * (int)sizeof(bf16) > cross_entropy_cache_bytes(), "a 65536-logit row fits in %d bytes of shared "
           "memory: the test no longer runs the kernel's second read", cross_entropy_cache_bytes());
    for (auto& s : shapes) {
        int N = s[0], V = s[1];
        size_t n = (size_t)N * V;
        double* z = random_array(n, 3.0);
        int* targets = random_targets(N, V);
        int* d_targets = to_device_int(targets, N);
        bf16* d_z = to_device_bf16(z, n);
        float* d_losses = (float*)device_alloc_poisoned(N * 4);
        double d_loss = 1.0 / (3 * N);
        cross_entropy(d_z, d_losses, d_targets, N, V, (float)d_loss, 0);
        double *losses = (double*)malloc(N * 8), *dz = (double*)malloc(n * 8);
        ref_cross_entropy(losses, dz, z, targets, N, V, d_loss);
        double *gl = from_device_f32(d_losses, N), *gdz = from_device_bf16(d_z, n);
        char name[64];
        // fp32 with fast-math exponentials summed over up to 150K logits: ~1e-5 relative is normal
        snprintf(name, sizeof(name), "cross-entropy %dx%d losses", N, V);
        CHECK_CLOSE(name, gl, losses, N, 1e-4);
        snprintf(name, sizeof(name), "cross-entropy %dx%d dlogits", N, V);
        CHECK_CLOSE(name, gdz, dz, n, 4e-3);
        free(z); free(targets); free(losses); free(dz); free(gl); free(gdz);
        CUDA_CHECK(cudaFree(d_targets)); CUDA_CHECK(cudaFree(d_z)); CUDA_CHECK(cudaFree(d_losses));
    }
    return TEST_RESULT;
}

// The cross-entropy kernel as it was before the row stayed on chip (issue 12): the same per-logit
// arithmetic (kernels.cuh's online_softmax_add and cross_entropy_grad) in the same order, with the
// plainest data movement: one vector at a time, and the second pass reads the row from memory
// again. The trainer's kernel must give the same bits, so its cache, its batched loads and its
// second read of a long row's remainder changed no loss and no gradient.
__global__ void two_pass_cross_entropy_kernel(bf16* logits, float* losses, const int* targets, int V, float d_loss) {
    bf16* z = logits + (size_t)blockIdx.x * V;
    const int target = targets[blockIdx.x];
    const float z_target = __bfloat162float(z[target]);
    float m = -FLT_MAX, sum = 0.0f;
    for (int i = threadIdx.x * 8; i < V; i += blockDim.x * 8) {
        bf16x8 v = load8(z + i);
        for (int k = 0; k < 8; k++) online_softmax_add(__bfloat162float(v.v[k]), &m, &sum);
    }
    const float row_max = block_max(m);
    float total = block_sum(sum * __expf(m - row_max));
    float lse = row_max + logf(total);
    if (threadIdx.x == 0) losses[blockIdx.x] = lse - z_target;
    for (int i = threadIdx.x * 8; i < V; i += blockDim.x * 8) {
        bf16x8 v = load8(z + i);
        for (int k = 0; k < 8; k++) v.v[k] = cross_entropy_grad(v.v[k], lse, i + k == target, d_loss);
        store8(z + i, v);
    }
}

// The trainer's kernel against the two-pass one, bit for bit, on the same logits; then both timed
// at the default chunk (4096 rows) for GPT-2's and Qwen3's vocabularies. The kernel is in place, so
// the timed runs work on its own output: the time does not depend on the values.
static int test_kernel_cross_entropy_matches_two_pass(void) {
    REQUIRE_GPU();
    int failed = 0;
    int shapes[][2] = {{1, 8}, {37, 1000}, {5, 4104}, {3, 65536}, {4096, 50304}, {4096, 151936}};
    for (auto& s : shapes) {
        int N = s[0], V = s[1];
        size_t n = (size_t)N * V;
        bf16 *d_old, *d_new;
        int16_t* low;  // the draws' low halves, unused
        CUDA_CHECK(cudaMalloc(&d_old, n * sizeof(bf16)));
        CUDA_CHECK(cudaMalloc(&d_new, n * sizeof(bf16)));
        CUDA_CHECK(cudaMalloc(&low, n * sizeof(int16_t)));
        init_normal(d_old, low, n, 0.0f, 3.0f, g_rng, 0, 0);
        CUDA_CHECK(cudaFree(low));
        CUDA_CHECK(cudaMemcpy(d_new, d_old, n * sizeof(bf16), cudaMemcpyDeviceToDevice));
        int* targets = random_targets(N, V);
        int* d_targets = to_device_int(targets, N);
        float* d_losses_old = (float*)device_alloc_poisoned(N * 4);
        float* d_losses_new = (float*)device_alloc_poisoned(N * 4);
        const float d_loss = 1.0f / (3 * N);
        two_pass_cross_entropy_kernel<<<N, CE_THREADS>>>(d_old, d_losses_old, d_targets, V, d_loss);
        LAUNCH_CHECK();
        cross_entropy(d_new, d_losses_new, d_targets, N, V, d_loss, 0);
        EXPECT(device_bytes_equal(d_losses_old, d_losses_new, N * 4), "%dx%d: the losses differ from the two-pass "
               "kernel's", N, V);
        EXPECT(device_bytes_equal(d_old, d_new, n * sizeof(bf16)), "%dx%d: the dlogits differ from the two-pass "
               "kernel's", N, V);
        if (N >= 4096) {
            float old_ms = time_median_ms([&] {
                two_pass_cross_entropy_kernel<<<N, CE_THREADS>>>(d_old, d_losses_old, d_targets, V, d_loss);
            }, 2, 9);
            float new_ms = time_median_ms([&] { cross_entropy(d_new, d_losses_new, d_targets, N, V, d_loss, 0); },
                                          2, 9);
            double gb = 2.0 * n * sizeof(bf16) / 1e9;  // one read and one write of the chunk
            printf("    %dx%d: two-pass %.3f ms, one read %.3f ms (%.0f and %.0f GB/s of one read + one write)\n",
                   N, V, old_ms, new_ms, gb / old_ms * 1e3, gb / new_ms * 1e3);
        }
        free(targets);
        void* dev[] = {d_old, d_new, d_targets, d_losses_old, d_losses_new};
        for (void* d : dev) CUDA_CHECK(cudaFree(d));
    }
    return TEST_RESULT;
}

// The BF16 output head as the trainer runs it (head_and_loss, through head_chunk_fused: the shift,
// our GEMM with the softmax's exponentials in its epilogue, head_loss, then dE and dx by cuBLASLt)
// against the fp64 cross-entropy of the fp64 logits of the same bf16 x and E: losses, dL/dx
// (d_xnorm) and dE, all poisoned first. V = 1000 (6 tiles of 192 columns, the last 40 wide), d_model
// 200 (K not a multiple of 64), 300 rows in chunks of 256 and 44; then V = 9000, d_model 64, 600 rows
// in chunks of 512 and 88 (188 tiles a chunk: more than an H100's SMs). Two rows are made to order,
// x along E[target]: row 5 with a target logit of -100, a loss of about 100 nats (some logit 64 past
// the target's: the epilogue marks the row and head_loss_kernel remakes it), and row 9 with one of
// +15, a confident prediction (p_t about 1 - 5e-4 at V 1000, where dL/dz_t is the others' sum);
// both rows' dx are checked on their own too. A second run must repeat every bit, and the forward
// alone (validation's) the losses' bits.
static int test_kernel_head_fused(void) {
    REQUIRE_GPU();
    int failed = 0;
    const struct {
        int V, C, B, T, chunk;
    } shapes[] = {{1000, 200, 2, 150, 256}, {9000, 64, 1, 600, 512}};
    for (auto& sh : shapes) {
        const int V = sh.V, C = sh.C;
        ModelConfig c = {V, C, 1, 2, 1, 64, 64, sh.T, 1e4f, 1e-6f};
        GPT m;
        gpt_create(&m, &c, sh.B, sh.T, 0, sh.chunk, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
        const int N = m.N;
        Activations* a = &m.act;
        EXPECT(head_fused(&m), "V %d, C %d: the fused head refused", V, C);
        Uploader up;
        uploader_create(&up, N, V);
        uint16_t* window = random_window(sh.B, sh.T, V);
        int* targets = (int*)malloc(N * sizeof(int));
        for (int n = 0; n < N; n++) targets[n] = window[(n / sh.T) * (sh.T + 1) + n % sh.T + 1];
        double *x = random_array((size_t)N * C, 1.0), *E = random_array((size_t)V * C, 0.15);
        upload_bf16(P(&m, P_EMBED, 0), E, (size_t)V * C);  // rounds E to what the GPU holds
        const double target_dot5 = -100.0, target_dot9 = 15.0;  // x_r . E[t_r] of the two made rows
        for (int r : {5, 9}) {
            const double* e = E + (size_t)targets[r] * C;
            double norm2 = 0.0;
            for (int k = 0; k < C; k++) norm2 += e[k] * e[k];
            for (int k = 0; k < C; k++) x[(size_t)r * C + k] = (r == 5 ? target_dot5 : target_dot9) / norm2 * e[k];
        }
        upload_bf16(a->xnorm_final, x, (size_t)N * C);
        double* z = (double*)malloc((size_t)N * V * 8);
        ref_linear_forward(z, x, E, N, C, V);
        double z_max5 = -INFINITY;
        for (int v = 0; v < V; v++) z_max5 = fmax(z_max5, z[(size_t)5 * V + v]);
        EXPECT(z_max5 - z[(size_t)5 * V + targets[5]] > HOP_EXP_MAX + 16, "row 5's logits span %.1f past its target's: "
               "the test no longer runs the remade row", z_max5 - z[(size_t)5 * V + targets[5]]);
        const double d_loss = 1.0 / (3.0 * N);
        double *losses = (double*)malloc(N * 8), *dz = (double*)malloc((size_t)N * V * 8);
        ref_cross_entropy(losses, dz, z, targets, N, V, d_loss);
        double *dx = (double*)malloc((size_t)N * C * 8), *dE = (double*)calloc((size_t)V * C, 8);
        ref_linear_backward(dx, dE, dz, x, E, N, C, V);

        Batch b = upload_batch(&up, &m, window);
        float* d_loss_sum = (float*)device_alloc_poisoned(4);
        const size_t n_bytes[3] = {(size_t)N * 4, (size_t)N * C * 2, (size_t)V * C * 4};
        const void* outputs[3] = {a->losses, a->d_xnorm, G(&m, P_EMBED, 0)};
        void* bits[2][3];
        for (int run = 0; run < 2; run++) {
            for (int k = 0; k < 3; k++) CUDA_CHECK(cudaMemset((void*)outputs[k], 0xFF, n_bytes[k]));  // NaN
            head_and_loss(&m, &b, (float)d_loss, true, d_loss_sum, false);
            CUDA_CHECK(cudaStreamSynchronize(m.stream));
            const int error = mm_error_take();
            EXPECT(error == MM_OK, "V %d, C %d: %s", V, C, mm_error_text(error));
            for (int k = 0; k < 3; k++) {
                bits[run][k] = malloc(n_bytes[k]);
                CUDA_CHECK(cudaMemcpy(bits[run][k], outputs[k], n_bytes[k], cudaMemcpyDeviceToHost));
            }
        }
        for (int k = 0; k < 3; k++)
            EXPECT(!memcmp(bits[0][k], bits[1][k], n_bytes[k]), "V %d, C %d: a second run differs (output %d)", V, C,
                   k);
        double *gl = from_device_f32(a->losses, N), *gdx = from_device_bf16(a->d_xnorm, (size_t)N * C);
        double* gdE = from_device_f32(G(&m, P_EMBED, 0), (size_t)V * C);
        char name[96];
        // the losses from fp32 sums of exponentials (fast-math, ~1e-6 each); dx and dE carry bf16
        // roundings of P' and of x_scaled or dx (2^-9 relative each)
        snprintf(name, sizeof(name), "head V %d, C %d: losses", V, C);
        CHECK_CLOSE(name, gl, losses, N, 1e-4);
        EXPECT(fabs(gl[5] - losses[5]) < 1e-4 * losses[5], "V %d, C %d: the remade row's loss %.6f, not %.6f", V, C,
               gl[5], losses[5]);
        snprintf(name, sizeof(name), "head V %d, C %d: dx", V, C);
        CHECK_CLOSE(name, gdx, dx, (size_t)N * C, 1e-2);
        snprintf(name, sizeof(name), "head V %d, C %d: dE", V, C);
        CHECK_CLOSE(name, gdE, dE, (size_t)V * C, 1e-2);
        for (int r : {5, 9}) {
            snprintf(name, sizeof(name), "head V %d, C %d: row %d of dx", V, C, r);
            CHECK_CLOSE(name, gdx + (size_t)r * C, dx + (size_t)r * C, C, 1e-2);
        }
        CUDA_CHECK(cudaMemset(a->losses, 0xFF, n_bytes[0]));
        head_and_loss(&m, &b, (float)d_loss, false, d_loss_sum, false);  // validation's forward alone
        CUDA_CHECK(cudaStreamSynchronize(m.stream));
        float* eval_losses = (float*)malloc(n_bytes[0]);
        CUDA_CHECK(cudaMemcpy(eval_losses, a->losses, n_bytes[0], cudaMemcpyDeviceToHost));
        EXPECT(!memcmp(eval_losses, bits[1][0], n_bytes[0]), "V %d, C %d: the forward alone's losses differ", V, C);
        free(eval_losses);
        free(window); free(targets); free(x); free(E); free(z); free(losses); free(dz); free(dx); free(dE);
        free(gl); free(gdx); free(gdE);
        for (int run = 0; run < 2; run++)
            for (int k = 0; k < 3; k++) free(bits[run][k]);
        CUDA_CHECK(cudaFree(d_loss_sum));
        uploader_free(&up);
        gpt_free(&m);
    }
    return TEST_RESULT;
}

// The fused BF16 head against the three passes it replaces (cuBLASLt's logits, cross_entropy, the
// backward's products on dlogits), at the default config's chunk: 4096 rows, V 50304, d_model 768,
// random x and E with logits of standard deviation about 3. Losses, dx and dE must agree within
// the two paths' bf16 roundings (the old one rounds the logits before the softmax, the new one
// does not); each path's time for the chunk, forward and backward, is printed (the median of 9).
static int test_kernel_head_fused_matches_three_passes(void) {
    REQUIRE_GPU();
    int failed = 0;
    const int V = 50304, C = 768, T = 1024, B = 4;
    ModelConfig c = {V, C, 1, 6, 2, 128, 2048, T, 1e4f, 1e-6f};
    GPT m;
    gpt_create(&m, &c, B, T, 0, B * T, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
    const int N = m.N;
    Activations* a = &m.act;
    Uploader up;
    uploader_create(&up, N, V);
    uint16_t* window = random_window(B, T, V);
    double *x = random_array((size_t)N * C, 1.0), *E = random_array((size_t)V * C, 0.11);
    upload_bf16(a->xnorm_final, x, (size_t)N * C);
    upload_bf16(P(&m, P_EMBED, 0), E, (size_t)V * C);
    Batch b = upload_batch(&up, &m, window);
    const float d_loss = 1.0f / N;
    float* d_loss_sum = (float*)device_alloc_poisoned(4);
    auto fused = [&] { head_and_loss(&m, &b, d_loss, true, d_loss_sum, false); };
    auto three_passes = [&] {
        layer_forward(&m, P_EMBED, 0, N, a->logits, a->xnorm_final, NULL);
        cross_entropy(a->logits, a->losses, b.targets, N, V, d_loss, m.stream);
        layer_backward(&m, P_EMBED, 0, N, a->d_xnorm, a->logits, a->xnorm_final, false);
    };
    double* got[2][3];  // each path's losses, dx, dE
    float ms[2];
    for (int path = 0; path < 2; path++) {
        auto run = [&] { path ? fused() : three_passes(); };
        run();
        CUDA_CHECK(cudaStreamSynchronize(m.stream));
        got[path][0] = from_device_f32(a->losses, N);
        got[path][1] = from_device_bf16(a->d_xnorm, (size_t)N * C);
        got[path][2] = from_device_f32(G(&m, P_EMBED, 0), (size_t)V * C);
        ms[path] = time_median_ms(run, 2, 9);
    }
    const int error = mm_error_take();
    EXPECT(error == MM_OK, "%s", mm_error_text(error));
    CHECK_CLOSE("4096 x 50304 losses, fused against three passes", got[1][0], got[0][0], N, 1e-3);
    CHECK_CLOSE("4096 x 50304 dx, fused against three passes", got[1][1], got[0][1], (size_t)N * C, 2e-2);
    CHECK_CLOSE("4096 x 50304 dE, fused against three passes", got[1][2], got[0][2], (size_t)V * C, 2e-2);
    printf("    4096 x 50304 x 768, forward and backward: three passes %.3f ms, fused %.3f ms\n", ms[0], ms[1]);
    for (int path = 0; path < 2; path++)
        for (int k = 0; k < 3; k++) free(got[path][k]);
    free(window); free(x); free(E);
    CUDA_CHECK(cudaFree(d_loss_sum));
    uploader_free(&up);
    gpt_free(&m);
    return TEST_RESULT;
}

// The three matmul forms on shapes that are not multiples of any tile.
static int test_kernel_matmuls(void) {
    REQUIRE_GPU();
    int failed = 0;
    matmul_init();
    int shapes[][3] = {{1, 8, 8}, {77, 264, 136}, {300, 768, 1280}, {1000, 56, 2000}};
    for (int k = 0; k < 4; k++) {
        int N = shapes[k][0], I = shapes[k][1], O = shapes[k][2];
        bool accumulate = k % 2;  // dW += onto random values, or dW = over NaNs
        double *x = random_array((size_t)N * I, 1.0), *W = random_array((size_t)O * I, 1.0);
        double *res = random_array((size_t)N * O, 1.0), *dy = random_array((size_t)N * O, 1.0);
        double* dW0 = random_array((size_t)O * I, 1.0);
        bf16 *d_x = to_device_bf16(x, (size_t)N * I), *d_W = to_device_bf16(W, (size_t)O * I);
        bf16 *d_res = to_device_bf16(res, (size_t)N * O), *d_dy = to_device_bf16(dy, (size_t)N * O);
        float* d_dW = accumulate ? to_device_f32(dW0, (size_t)O * I) : (float*)device_alloc_poisoned((size_t)O * I * 4);
        bf16* d_y = (bf16*)device_alloc_poisoned((size_t)N * O * 2);
        bf16* d_dx = (bf16*)device_alloc_poisoned((size_t)N * I * 2);
        linear_forward(d_y, d_x, d_W, d_res, N, I, O, 0);
        linear_backward_input(d_dx, d_dy, d_W, N, I, O, 0);
        linear_backward_weight(d_dW, d_dy, d_x, N, I, O, accumulate, 0);
        double *y = (double*)malloc((size_t)N * O * 8), *dx = (double*)malloc((size_t)N * I * 8);
        double* dW = (double*)malloc((size_t)O * I * 8);
        ref_linear_forward(y, x, W, N, I, O);
        for (size_t i = 0; i < (size_t)N * O; i++) y[i] += res[i];
        for (size_t i = 0; i < (size_t)O * I; i++) dW[i] = accumulate ? (float)dW0[i] : 0.0;
        ref_linear_backward(dx, dW, dy, x, W, N, I, O);
        double *gy = from_device_bf16(d_y, (size_t)N * O), *gdx = from_device_bf16(d_dx, (size_t)N * I);
        double* gdW = from_device_f32(d_dW, (size_t)O * I);
        char name[64];
        snprintf(name, sizeof(name), "linear %dx%dx%d forward", N, I, O);
        CHECK_CLOSE(name, gy, y, (size_t)N * O, 4e-3);
        CHECK_CLOSE("backward input", gdx, dx, (size_t)N * I, 4e-3);
        CHECK_CLOSE("backward weight", gdW, dW, (size_t)O * I, 1e-5);
        double* all[] = {x, W, res, dy, dW0, y, dx, dW, gy, gdx, gdW};
        for (double* a : all) free(a);
        void* dev[] = {d_x, d_W, d_res, d_dy, d_dW, d_y, d_dx};
        for (void* d : dev) CUDA_CHECK(cudaFree(d));
    }
    matmul_free();
    return TEST_RESULT;
}

// Tuning (g_matmul_tune) may only change speed: at a trainer's shapes, where cuBLASLt offers
// candidates that differ, every form gives the same bytes untuned, on each candidate that tuning
// takes in turn, and tuned. The calls that accumulate in place (y += x W^T over the residual,
// dW +=) are the first of their shapes to tune, so a check of the candidates that failed to put D
// back would show. The tuned forward is also held against the CPU on its first 64 rows.
typedef struct {
    bf16 *y_inplace, *y, *dx;
    float* dW;
} LinearOutputs;

static void linear_forms(LinearOutputs* o, const bf16* x, const bf16* W, const bf16* res, const bf16* dy,
                         const float* dW0, int N, int I, int O) {
    CUDA_CHECK(cudaMemcpy(o->y_inplace, res, (size_t)N * O * 2, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaMemcpy(o->dW, dW0, (size_t)O * I * 4, cudaMemcpyDeviceToDevice));
    linear_forward(o->y_inplace, x, W, o->y_inplace, N, I, O, 0);  // the residual added in place
    linear_forward(o->y, x, W, NULL, N, I, O, 0);
    linear_backward_input(o->dx, dy, W, N, I, O, 0);
    linear_backward_weight(o->dW, dy, x, N, I, O, true, 0);
}

static int test_kernel_matmul_tuning(void) {
    REQUIRE_GPU();
    int failed = 0;
    matmul_init();
    const int N = 4096, I = 768, O = 1280;  // the default config's QKV projection at a quarter batch
    double *x = random_array((size_t)N * I, 1.0), *W = random_array((size_t)O * I, 0.05);
    double *res = random_array((size_t)N * O, 1.0), *dy = random_array((size_t)N * O, 1.0);
    double* dW0 = random_array((size_t)O * I, 1.0);
    bf16 *d_x = to_device_bf16(x, (size_t)N * I), *d_W = to_device_bf16(W, (size_t)O * I);
    bf16 *d_res = to_device_bf16(res, (size_t)N * O), *d_dy = to_device_bf16(dy, (size_t)N * O);
    float* d_dW0 = to_device_f32(dW0, (size_t)O * I);
    const size_t y_bytes = (size_t)N * O * 2, dx_bytes = (size_t)N * I * 2, dW_bytes = (size_t)O * I * 4;
    LinearOutputs out[2];  // untuned, then each call after
    for (LinearOutputs& o : out) {
        o.y_inplace = (bf16*)device_alloc_poisoned(y_bytes);
        o.y = (bf16*)device_alloc_poisoned(y_bytes);
        o.dx = (bf16*)device_alloc_poisoned(dx_bytes);
        o.dW = (float*)device_alloc_poisoned(dW_bytes);
    }
    g_matmul_tune = MATMUL_TUNE_OFF;
    linear_forms(&out[0], d_x, d_W, d_res, d_dy, d_dW0, N, I, O);
    g_matmul_tune = MATMUL_TUNE_CHECK;
    for (int call = 0; call <= MATMUL_CANDIDATES + 1; call++) {  // checking, timing each candidate in turn, tuned
        if (call == 1) g_matmul_tune = MATMUL_TUNE_TIME;
        if (call == MATMUL_CANDIDATES + 1) matmul_tune_finish();
        linear_forms(&out[1], d_x, d_W, d_res, d_dy, d_dW0, N, I, O);
        EXPECT(device_bytes_equal(out[1].y_inplace, out[0].y_inplace, y_bytes), "call %d: y += x W^T differs", call);
        EXPECT(device_bytes_equal(out[1].y, out[0].y, y_bytes), "call %d: y = x W^T differs", call);
        EXPECT(device_bytes_equal(out[1].dx, out[0].dx, dx_bytes), "call %d: dx differs", call);
        EXPECT(device_bytes_equal(out[1].dW, out[0].dW, dW_bytes), "call %d: dW += differs", call);
    }
    EXPECT(g_matmul_tune == MATMUL_TUNE_OFF, "tuning still open after matmul_tune_finish");
    int moved = 0;
    for (int i = 0; i < g_n_plans; i++) {
        const MatmulPlan* p = &g_plans[i];
        EXPECT(p->n_same >= 1 && p->chosen >= 0 && p->us_first > 0.0f,
               "plan %d: %d candidates with the same bits, chosen %d, candidate 0 at %.1f us", i, p->n_same,
               p->chosen, p->us_first);
        moved += p->chosen > 0;
    }
    const int rows = 64;
    double *y = (double*)malloc((size_t)rows * O * 8), *gy = from_device_bf16(out[1].y_inplace, (size_t)rows * O);
    ref_linear_forward(y, x, W, rows, I, O);
    for (size_t i = 0; i < (size_t)rows * O; i++) y[i] += res[i];
    CHECK_CLOSE("tuned y += x W^T, first 64 rows", gy, y, (size_t)rows * O, 4e-3);
    printf("    %d shapes tuned, %d run another candidate than the heuristic's first\n", g_n_plans, moved);
    double* all[] = {x, W, res, dy, dW0, y, gy};
    for (double* a : all) free(a);
    void* dev[] = {d_x, d_W, d_res, d_dy, d_dW0};
    for (void* d : dev) CUDA_CHECK(cudaFree(d));
    for (LinearOutputs& o : out) {
        void* outs[] = {o.y_inplace, o.y, o.dx, o.dW};
        for (void* d : outs) CUDA_CHECK(cudaFree(d));
    }
    matmul_free();
    return TEST_RESULT;
}

// FP8 through the same matmul wrapper: operands whose values are exact in E4M3 / E5M2 (so only
// the product's accumulation and the output's rounding differ from fp64), per-tensor scales as
// device pointers, a bf16 result (also with an alpha, which multiplies with the scales), and an
// E4M3 result with its own scale and amax.
static double fp8_round(double x, bool e5m2) {  // the value the GPU stores (round to nearest even)
    return e5m2 ? (double)(float)__nv_fp8_e5m2((float)x) : (double)(float)__nv_fp8_e4m3((float)x);
}

static void* to_device_fp8(const double* x, size_t n, bool e5m2) {
    uint8_t* host = (uint8_t*)malloc(n);
    for (size_t i = 0; i < n; i++)
        host[i] = e5m2 ? __nv_fp8_e5m2((float)x[i]).__x : __nv_fp8_e4m3((float)x[i]).__x;
    void* d;
    CUDA_CHECK(cudaMalloc(&d, n));
    CUDA_CHECK(cudaMemcpy(d, host, n, cudaMemcpyHostToDevice));
    free(host);
    return d;
}

static int test_kernel_matmul_fp8(void) {
    REQUIRE_GPU();
    int failed = 0;
    matmul_init();
    int N = 96, I = 160, O = 208;  // y[N, O] = x[N, I] W[O, I]^T, the forward's TN form
    double *x = random_array((size_t)N * I, 2.0), *W = random_array((size_t)O * I, 1.0);
    for (size_t i = 0; i < (size_t)N * I; i++) x[i] = fp8_round(x[i], true);
    for (size_t i = 0; i < (size_t)O * I; i++) W[i] = fp8_round(W[i], false);
    void *d_x = to_device_fp8(x, (size_t)N * I, true), *d_W = to_device_fp8(W, (size_t)O * I, false);
    // x's, W's and y8's scales (a result's scale multiplies: stored = real * scale) and y8's amax,
    // 16 bytes apart (cuBLASLt's alignment for scale pointers)
    double scales_host[16] = {0.5, 0, 0, 0, 0.25, 0, 0, 0, 8.0, 0, 0, 0, 0.0};
    float* d_scales = to_device_f32(scales_host, 16);
    bf16* d_y = (bf16*)device_alloc_poisoned((size_t)N * O * 2);
    uint8_t* d_y8 = (uint8_t*)device_alloc_poisoned((size_t)N * O);
    MatmulOperand x_op = {d_x, CUDA_R_8F_E5M2, d_scales, NULL}, W_op = {d_W, CUDA_R_8F_E4M3, d_scales + 4, NULL};
    matmul(mm_bf16(d_y), 1.0f, W_op, x_op, NULL, 0.0f, O, N, I, true, false, 0);
    MatmulOperand y8_op = {d_y8, CUDA_R_8F_E4M3, d_scales + 8, d_scales + 12};
    matmul(y8_op, 1.0f, W_op, x_op, NULL, 0.0f, O, N, I, true, false, 0);
    double* y = (double*)malloc((size_t)N * O * 8);
    ref_linear_forward(y, x, W, N, I, O);
    double amax = 0;
    for (size_t i = 0; i < (size_t)N * O; i++) {
        y[i] *= scales_host[0] * scales_host[4];
        amax = fmax(amax, fabs(y[i]));
    }
    double* gy = from_device_bf16(d_y, (size_t)N * O);
    CHECK_CLOSE("fp8 x fp8 -> bf16", gy, y, (size_t)N * O, 4e-3);
    // alpha multiplies with the operands' scales (D = alpha scale_a scale_b op(A) op(B)), through the
    // same plan: alpha is no part of its key
    int plans = g_n_plans;
    matmul(mm_bf16(d_y), 3.0f, W_op, x_op, NULL, 0.0f, O, N, I, true, false, 0);
    EXPECT(g_n_plans == plans, "another alpha made %d new plans, want 0", g_n_plans - plans);
    double *gy_alpha = from_device_bf16(d_y, (size_t)N * O), *y_alpha = (double*)malloc((size_t)N * O * 8);
    for (size_t i = 0; i < (size_t)N * O; i++) y_alpha[i] = 3.0 * y[i];
    CHECK_CLOSE("fp8 x fp8 -> bf16, alpha 3", gy_alpha, y_alpha, (size_t)N * O, 4e-3);
    free(gy_alpha);
    free(y_alpha);
    uint8_t* y8 = (uint8_t*)malloc((size_t)N * O);
    CUDA_CHECK(cudaMemcpy(y8, d_y8, (size_t)N * O, cudaMemcpyDeviceToHost));
    double *gy8 = (double*)malloc((size_t)N * O * 8), *want8 = (double*)malloc((size_t)N * O * 8);
    for (size_t i = 0; i < (size_t)N * O; i++) {
        __nv_fp8_e4m3 v;
        v.__x = y8[i];
        gy8[i] = (double)(float)v;
        want8[i] = fp8_round(y[i] * scales_host[8], false);
    }
    CHECK_CLOSE("fp8 x fp8 -> e4m3 (scaled)", gy8, want8, (size_t)N * O, 4e-2);
    // fast accumulation: a plan of its own (the key holds it), and the same product, less exactly:
    // the accumulators keep about 14 bits (2^-14 per addition, ~sqrt(K) of them: ~1e-3 here)
    plans = g_n_plans;
    matmul(mm_bf16(d_y), 1.0f, W_op, x_op, NULL, 0.0f, O, N, I, true, false, 0, true);
    EXPECT(g_n_plans == plans + 1, "fast accumulation made %d new plans, want 1", g_n_plans - plans);
    double* gy_fast = from_device_bf16(d_y, (size_t)N * O);
    CHECK_CLOSE("fp8 x fp8 -> bf16, fast accumulation", gy_fast, y, (size_t)N * O, 1e-2);
    free(gy_fast);
    double* got_amax = from_device_f32(d_scales + 12, 1);
    // Hopper's FP8 products accumulate in narrower registers than fp32 before cuBLASLt promotes
    // them (we saw 2.6e-5 relative on this shape), so the amax is held to 1e-3
    EXPECT(fabs(*got_amax - amax) < 1e-3 * amax, "amax %.7g vs %.7g", *got_amax, amax);
    free(x); free(W); free(y); free(gy); free(y8); free(gy8); free(want8); free(got_amax);
    void* dev[] = {d_x, d_W, d_scales, d_y, d_y8};
    for (void* d : dev) CUDA_CHECK(cudaFree(d));
    matmul_free();
    return TEST_RESULT;
}

// Awkward shapes for the tests of the trainer's two fused MLP GEMMs (lib/matmul_hopper.cuh), as a
// model config and a batch, run in the last layer of the model (the weights' offset): rows past a
// multiple of 8 and of the 128-row tile, K = d_model not a multiple of the 64-wide k-block, features
// not a multiple of a tile (the forward's 128, the backward's 256: the last tile's boxes cross F),
// more tiles than an H100 has SMs (the persistent walk comes round), a K of 16 k-blocks (the
// 4-stage ring wraps).
static const struct {
    ModelConfig c;
    int B;
} FUSED_MLP_SHAPES[] = {
    {{64, 200, 2, 2, 1, 64, 2000, 1100, 1e4f, 1e-6f}, 2},  // N 2200 (18 row tiles, the last 24 rows), K 200, F 2000:
                                                          // forward 288 tiles, backward 144 (the last 208 features)
    {{64, 72, 1, 2, 1, 64, 8, 13, 1e4f, 1e-6f}, 1},        // N 13, K 72, F 8: one tile, mostly edge
    {{64, 1024, 2, 2, 1, 64, 264, 150, 1e4f, 1e-6f}, 2},   // N 300, K 1024, F 264 (features 128 + 128 + 8, 256 + 8)
};

// The trainer's gate/up forward in BF16 (mlp_gate_up: our Hopper GEMM with SwiGLU in its epilogue)
// on FUSED_MLP_SHAPES: gate_up against the fp64 product, and mlp_act bit for bit against
// swiglu_forward run on the gate_up it wrote (the bits the backward's recompute makes), both
// outputs poisoned with NaN first; a second run must repeat the bits.
static int test_kernel_gate_up_swiglu(void) {
    REQUIRE_GPU();
    int failed = 0;
    for (auto& tc : FUSED_MLP_SHAPES) {
        const ModelConfig* c = &tc.c;
        GPT m;
        gpt_create(&m, c, tc.B, c->seq_len, 0, 4096, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
        const int N = m.N, I = c->d_model, F = c->ffn_dim, l = c->n_layer - 1;
        const size_t n_gu = (size_t)N * 2 * F, n_act = (size_t)N * F;
        Activations* a = &m.act;
        EXPECT(gate_up_fused(&m, l), "N %d, I %d, F %d: the fused path refused", N, I, F);
        double *x = random_array((size_t)N * I, 1.0), *W = random_array((size_t)2 * F * I, 1.0);
        upload_bf16(a->xnorm_mlp[l], x, (size_t)N * I);
        upload_bf16(P(&m, P_GATE_UP, l), W, (size_t)2 * F * I);
        uint16_t* bits[2];  // each run's gate_up, then its act, as stored
        for (int run = 0; run < 2; run++) {
            CUDA_CHECK(cudaMemset(a->gate_up[l], 0xFF, n_gu * 2));  // NaN
            CUDA_CHECK(cudaMemset(a->mlp_act[l], 0xFF, n_act * 2));
            mlp_gate_up(&m, l);
            CUDA_CHECK(cudaStreamSynchronize(m.stream));
            const int error = mm_error_take();
            EXPECT(error == MM_OK, "N %d, I %d, F %d: %s", N, I, F, mm_error_text(error));
            bits[run] = (uint16_t*)malloc((n_gu + n_act) * 2);
            CUDA_CHECK(cudaMemcpy(bits[run], a->gate_up[l], n_gu * 2, cudaMemcpyDeviceToHost));
            CUDA_CHECK(cudaMemcpy(bits[run] + n_gu, a->mlp_act[l], n_act * 2, cudaMemcpyDeviceToHost));
        }
        EXPECT(!memcmp(bits[0], bits[1], (n_gu + n_act) * 2), "N %d, I %d, F %d: a second run differs", N, I, F);
        double* gu = (double*)malloc(n_gu * 8);
        ref_linear_forward(gu, x, W, N, I, 2 * F);
        double* ggu = from_device_bf16(a->gate_up[l], n_gu);
        char name[96];
        snprintf(name, sizeof(name), "gate_up N %d, I %d, F %d", N, I, F);
        CHECK_CLOSE(name, ggu, gu, n_gu, 4e-3);
        bf16* d_act = (bf16*)device_alloc_poisoned(n_act * 2);
        swiglu_forward(d_act, a->gate_up[l], N, F, m.stream);
        uint16_t* want_act = (uint16_t*)malloc(n_act * 2);
        CUDA_CHECK(cudaMemcpy(want_act, d_act, n_act * 2, cudaMemcpyDeviceToHost));
        size_t differ = 0;
        for (size_t i = 0; i < n_act; i++) differ += bits[1][n_gu + i] != want_act[i];
        EXPECT(differ == 0, "N %d, I %d, F %d: act differs from swiglu_forward on its gate_up in %zu of %zu entries", N,
               I, F, differ, n_act);
        free(x); free(W); free(gu); free(ggu); free(want_act); free(bits[0]); free(bits[1]);
        CUDA_CHECK(cudaFree(d_act));
        gpt_free(&m);
    }
    return TEST_RESULT;
}

// The trainer's down backward in BF16 (mlp_down_backward: our Hopper GEMM for d_mlp_act = dy W_down
// with SwiGLU's backward in its epilogue, then dW_down by cuBLASLt) on FUSED_MLP_SHAPES, against the
// fp64 reference: d_gate_up = swiglu_backward(dy W_down, gate_up) and dW_down += dy^T mlp_act.
// d_gate_up is poisoned with NaN first, and a second run must repeat its bits. Tolerance: d_gate_up
// carries two bf16 roundings, d_mlp_act's (in the epilogue) and its own, each of relative RMS about
// 2^-8 / sqrt(3) = 2.3e-3 (bf16 keeps 8 significant bits), so about 3.2e-3 together: we allow
// 6e-3; a wrong row, feature or half gives errors of order 1. (The bits against swiglu_backward
// on the kernel's own plain product: the ladder's check, dev/matmul.cu.) Then the same in a layer
// that recomputes (remakes_norms), whose mlp_act, poisoned, the epilogue remakes: d_gate_up must
// have the first model's bits, act swiglu_forward's on gate_up (and the fp64 SwiGLU's values), and
// dW_down must be the product with that act, so it ran after the act was stored.
static int test_kernel_down_swiglu_backward(void) {
    REQUIRE_GPU();
    int failed = 0;
    for (auto& tc : FUSED_MLP_SHAPES) {
        const ModelConfig* c = &tc.c;
        const int C = c->d_model, F = c->ffn_dim, l = c->n_layer - 1, N = tc.B * c->seq_len;
        const size_t n_gu = (size_t)N * 2 * F, n_dy = (size_t)N * C, n_act = (size_t)N * F, n_w = (size_t)C * F;
        double *dy = random_array(n_dy, 1.0), *W = random_array(n_w, 1.0);
        double *gu = random_array(n_gu, 1.0), *act = random_array(n_act, 1.0);
        uint16_t* kept_bits = NULL;  // d_gate_up of the layer that keeps its act
        for (int remake = 0; remake < 2; remake++) {
            GPT m;
            gpt_create(&m, c, tc.B, c->seq_len, remake ? c->n_layer : 0, 4096, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
            Activations* a = &m.act;
            EXPECT(down_swiglu_fused(&m, l), "N %d, C %d, F %d: the fused path refused", N, C, F);
            EXPECT(remakes_norms(&m, l) == (remake == 1), "N %d, C %d, F %d: remakes_norms is not %d", N, C, F,
                   remake);
            upload_bf16(a->d_residual, dy, n_dy);
            upload_bf16(P(&m, P_DOWN, l), W, n_w);
            upload_bf16(a->gate_up[l], gu, n_gu);
            if (remake) CUDA_CHECK(cudaMemset(a->mlp_act[l], 0xFF, n_act * 2));  // NaN: the epilogue must write it
            else upload_bf16(a->mlp_act[l], act, n_act);
            uint16_t* bits[2];  // each run's d_gate_up, as stored
            for (int run = 0; run < 2; run++) {
                CUDA_CHECK(cudaMemset(a->d_gate_up, 0xFF, n_gu * 2));  // NaN
                CUDA_CHECK(cudaMemset(G(&m, P_DOWN, l), 0xFF, n_w * 4));  // NaN: the first write sets dW
                mlp_down_backward(&m, l, false);
                CUDA_CHECK(cudaStreamSynchronize(m.stream));
                const int error = mm_error_take();
                EXPECT(error == MM_OK, "N %d, C %d, F %d: %s", N, C, F, mm_error_text(error));
                bits[run] = (uint16_t*)malloc(n_gu * 2);
                CUDA_CHECK(cudaMemcpy(bits[run], a->d_gate_up, n_gu * 2, cudaMemcpyDeviceToHost));
            }
            EXPECT(!memcmp(bits[0], bits[1], n_gu * 2), "N %d, C %d, F %d, remake %d: a second run differs", N, C, F,
                   remake);
            double* used_act = remake ? from_device_bf16(a->mlp_act[l], n_act) : act;  // what dW_down read
            double *d_mlp_act = (double*)malloc(n_act * 8), *dW = (double*)calloc(n_w, 8);
            ref_linear_backward(d_mlp_act, dW, dy, used_act, W, N, F, C);
            double* g_dW = from_device_f32(G(&m, P_DOWN, l), n_w);
            char name[96];
            snprintf(name, sizeof(name), "dW_down N %d, C %d, F %d, remake %d", N, C, F, remake);
            CHECK_CLOSE(name, g_dW, dW, n_w, 1e-4);  // fp32 sums of exact bf16 products
            if (!remake) {
                double* dgu = (double*)malloc(n_gu * 8);
                ref_swiglu_backward(dgu, d_mlp_act, gu, N, F);
                double* g_dgu = from_device_bf16(a->d_gate_up, n_gu);
                snprintf(name, sizeof(name), "d_gate_up N %d, C %d, F %d", N, C, F);
                CHECK_CLOSE(name, g_dgu, dgu, n_gu, 6e-3);
                free(dgu); free(g_dgu);
                kept_bits = bits[0];
            } else {
                EXPECT(!memcmp(kept_bits, bits[0], n_gu * 2), "N %d, C %d, F %d: remaking act changed d_gate_up", N,
                       C, F);
                double* want = (double*)malloc(n_act * 8);
                ref_swiglu_forward(want, gu, N, F);
                snprintf(name, sizeof(name), "remade act N %d, C %d, F %d", N, C, F);
                CHECK_CLOSE(name, used_act, want, n_act, 4e-3);
                bf16* d_act = (bf16*)device_alloc_poisoned(n_act * 2);
                swiglu_forward(d_act, a->gate_up[l], N, F, m.stream);
                EXPECT(device_bytes_equal(d_act, a->mlp_act[l], n_act * 2), "N %d, C %d, F %d: the remade act "
                       "differs from swiglu_forward's", N, C, F);
                free(want); free(used_act); free(kept_bits);
                CUDA_CHECK(cudaFree(d_act));
                free(bits[0]);
            }
            free(d_mlp_act); free(dW); free(g_dW); free(bits[1]);
            gpt_free(&m);
        }
        free(dy); free(W); free(gu); free(act);
    }
    return TEST_RESULT;
}

static int test_kernel_embedding_and_reductions(void) {
    REQUIRE_GPU();
    int failed = 0;
    // embedding forward/backward through upload_batch's bucketing, with many repeated tokens
    ModelConfig c = {64, 72, 1, 2, 1, 64, 8, 50, 1e4f, 1e-6f};
    GPT m;
    gpt_create(&m, &c, 3, 50, 0, 4096, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
    Uploader up;
    uploader_create(&up, m.N, c.vocab_size);
    uint16_t* window = random_window(3, 50, 11);  // tokens < 11: heavy repetition
    double* E = random_array((size_t)64 * 72, 1.0);
    upload_bf16(P(&m, P_EMBED, 0), E, (size_t)64 * 72);
    Batch b = upload_batch(&up, &m, window);
    double* dx = random_array((size_t)m.N * 72, 1.0);
    bf16* d_dx = to_device_bf16(dx, (size_t)m.N * 72);
    bf16* d_x = (bf16*)device_alloc_poisoned((size_t)m.N * 72 * 2);
    CUDA_CHECK(cudaMemsetAsync(m.grads, 0, m.table.n_elements * 4, m.stream));
    embedding_forward(d_x, b.inputs, P(&m, P_EMBED, 0), m.N, 72, m.stream);
    embedding_backward(G(&m, P_EMBED, 0), d_dx, b.bucket_start, b.bucket_pos, b.bucket_token, b.n_buckets, m.N, 64, 72,
                       m.stream);
    CUDA_CHECK(cudaStreamSynchronize(m.stream));
    double *x = (double*)malloc((size_t)m.N * 72 * 8), *dE = (double*)calloc((size_t)64 * 72, 8);
    for (int n = 0; n < m.N; n++) {
        int tok = window[(n / 50) * 51 + n % 50];
        for (int ch = 0; ch < 72; ch++) {
            x[(size_t)n * 72 + ch] = E[(size_t)tok * 72 + ch];
            dE[(size_t)tok * 72 + ch] += dx[(size_t)n * 72 + ch];
        }
    }
    double *gx = from_device_bf16(d_x, (size_t)m.N * 72), *gdE = from_device_f32(G(&m, P_EMBED, 0), (size_t)64 * 72);
    CHECK_CLOSE("embedding forward", gx, x, (size_t)m.N * 72, 0.0);
    CHECK_CLOSE("embedding backward", gdE, dE, (size_t)64 * 72, 1e-6);
    // reductions: sum and sum of squares of a long vector
    size_t n = 1000003;
    double* v = random_array(n, 1.0);
    // the tail of n % 4 = 3 that the 16-byte loads leave is read singly: made large (8, exact in fp32), so that a
    // tail dropped or counted twice moves the sum by 24 and the sum of squares by 192 (2e-4 of its 1e6), past both bounds
    for (size_t i = n - n % 4; i < n; i++) v[i] = 8.0;
    float* d_v = to_device_f32(v, n);
    float* d_out = (float*)device_alloc_poisoned(8);
    reduce_sum(d_out, d_v, n, false, false, m.act.partials, 0);
    reduce_sum(d_out + 1, d_v, n, true, false, m.act.partials, 0);
    double* got = from_device_f32(d_out, 2);
    double sum = 0, sq = 0;
    for (size_t i = 0; i < n; i++) {
        sum += (float)v[i];
        sq += (double)(float)v[i] * (float)v[i];
    }
    EXPECT(fabs(got[0] - sum) < 1e-3 * sqrt((double)n), "sum %.6f vs %.6f", got[0], sum);
    EXPECT(fabs(got[1] - sq) / sq < 1e-5, "sum of squares %.6f vs %.6f", got[1], sq);
    free(window); free(E); free(dx); free(x); free(dE); free(gx); free(gdE); free(v); free(got);
    void* dev[] = {d_dx, d_x, d_v, d_out};
    for (void* d : dev) CUDA_CHECK(cudaFree(d));
    uploader_free(&up);
    gpt_free(&m);
    return TEST_RESULT;
}

// AdamW over a range of a buffer with decay flags per PARAM_ALIGN block, after the schedule
// kernel: the device's learning rate and bias corrections against the host's, the update of the
// fp32 master weights (their two halves joined) against fp64, their bf16 halves the nearest bf16,
// the elements outside the range untouched, and the bf16 halves read and written where they were
// asked to be (the start of their own buffer, as ZeRO keeps a piece in its place in the full
// weights, the rest of that buffer poisoned).
static int test_kernel_adamw(void) {
    REQUIRE_GPU();
    int failed = 0;
    size_t n = 100000, begin = 3 * PARAM_ALIGN, end = n - 1001, m = end - begin;  // 98615: 4-wide, a tail of 3
    double *p = random_array(n, 1.0), *g = random_array(n, 0.1), *m0 = random_array(n, 0.01), *v0 = random_array(n, 0.01);
    for (size_t i = 0; i < n; i++) v0[i] = fabs(v0[i]);
    bf16* w = (bf16*)malloc(n * 2);
    int16_t* low = (int16_t*)malloc(n * 2);
    for (size_t i = 0; i < n; i++) w[i] = master_split((float)p[i], &low[i]);
    float *d_g = to_device_f32(g, n), *d_m = to_device_f32(m0, n), *d_v = to_device_f32(v0, n);
    bf16* d_w = (bf16*)device_alloc_poisoned(n * 2);
    int16_t* d_low;
    CUDA_CHECK(cudaMalloc(&d_low, n * 2));
    CUDA_CHECK(cudaMemcpy(d_w, w + begin, m * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_low, low, n * 2, cudaMemcpyHostToDevice));
    size_t n_blocks = (n + PARAM_ALIGN - 1) / PARAM_ALIGN;
    uint8_t* flags = (uint8_t*)malloc(n_blocks);
    for (size_t i = 0; i < n_blocks; i++) flags[i] = rand_uniform() < 0.6;
    uint8_t* d_flags;
    CUDA_CHECK(cudaMalloc(&d_flags, n_blocks));
    CUDA_CHECK(cudaMemcpy(d_flags, flags, n_blocks, cudaMemcpyHostToDevice));
    double norm_sq = 0;
    for (size_t i = 0; i < n; i++) norm_sq += (double)(float)g[i] * (float)g[i];
    OptimConfig o = {1e-3f, 0.1f, 0.1f, 0.9f, 0.95f, 1e-8f, 1.0f, 4, 50, 0, 0.2f};
    int t = 7;  // 0-based step: the update is AdamW's t+1-th
    OptimScalars host_scalars = {t, 0, 0, 0, 0, (float)norm_sq, 0};
    OptimScalars* d_scalars;
    CUDA_CHECK(cudaMalloc(&d_scalars, sizeof(OptimScalars)));
    CUDA_CHECK(cudaMemcpy(d_scalars, &host_scalars, sizeof(OptimScalars), cudaMemcpyHostToDevice));
    optimizer_schedule(&o, d_scalars, 0);
    adamw_step(d_w, d_low + begin, d_g + begin, d_m + begin, d_v + begin, d_flags + begin / PARAM_ALIGN, m, &o,
               d_scalars, 0);
    CUDA_CHECK(cudaMemcpy(&host_scalars, d_scalars, sizeof(OptimScalars), cudaMemcpyDeviceToHost));
    double lr = learning_rate(&o, t), bc1 = 1 - pow(o.beta1, t + 1), bc2 = 1 - pow(o.beta2, t + 1);
    EXPECT(host_scalars.step == t + 1, "step %d after the update, expected %d", host_scalars.step, t + 1);
    EXPECT(fabs(host_scalars.lr - lr) < 1e-6 * lr, "device lr %.9g vs host %.9g", host_scalars.lr, lr);
    EXPECT(fabs(host_scalars.bias_corr1 - bc1) < 1e-5 && fabs(host_scalars.bias_corr2 - bc2) < 1e-5,
           "bias corrections %.7f %.7f vs %.7f %.7f", host_scalars.bias_corr1, host_scalars.bias_corr2, bc1, bc2);
    double scale = sqrt(norm_sq) > o.grad_clip ? o.grad_clip / sqrt(norm_sq) : 1.0;
    bf16* got_w = (bf16*)malloc(n * 2);
    int16_t* got_low = (int16_t*)malloc(n * 2);
    CUDA_CHECK(cudaMemcpy(got_w, d_w, n * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_low, d_low, n * 2, cudaMemcpyDeviceToHost));
    // compare the update (p_new - p_old), which is ~lr: fp32 arithmetic on it must hold to 1e-3
    double *dgot = (double*)malloc(m * 8), *dwant = (double*)malloc(m * 8);
    size_t not_nearest = 0;
    for (size_t i = begin; i < end; i++) {
        double gi = (float)g[i] * scale, mi = o.beta1 * (float)m0[i] + (1 - o.beta1) * gi;
        double vi = o.beta2 * (float)v0[i] + (1 - o.beta2) * gi * gi, pi = (float)p[i];
        double wd = flags[i / PARAM_ALIGN] ? o.weight_decay : 0.0;
        float got = master_join(got_w[i - begin], got_low[i]);
        dgot[i - begin] = got - pi;
        dwant[i - begin] = pi - lr * ((mi / bc1) / (sqrt(vi / bc2) + o.eps) + wd * pi) - pi;
        double half = __bfloat162float(got_w[i - begin]), rne = round_bf16(got);  // ties aside, the same
        not_nearest += half != rne && fabs(half - got) != fabs(rne - got);
    }
    CHECK_CLOSE("adamw update", dgot, dwant, m, 1e-3);
    EXPECT(not_nearest == 0, "%zu bf16 halves are not their weight's nearest bf16", not_nearest);
    size_t changed = 0;
    for (size_t i = 0; i < n; i++) changed += (i < begin || i >= end) && got_low[i] != low[i];
    const uint16_t poison = 0xFFFF;  // device_alloc_poisoned's, past the range's bf16 halves
    for (size_t i = m; i < n; i++) changed += memcmp(&got_w[i], &poison, 2) != 0;
    EXPECT(changed == 0, "%zu elements outside [begin, end) changed", changed);
    free(p); free(g); free(m0); free(v0); free(w); free(low); free(got_w); free(got_low); free(dgot); free(dwant);
    free(flags);
    void* dev[] = {d_w, d_low, d_g, d_m, d_v, d_flags, d_scalars};
    for (void* d : dev) CUDA_CHECK(cudaFree(d));
    return TEST_RESULT;
}

// ----------------------------------------------------------------------------------------------
// Whole-model GPU tests

// Runs the GPU model on `window` with parameters `p` (rounded to bf16 in place, as the GPU sees
// them); returns the loss and fills grads (fp32 widened) of the flat layout.
static double gpu_forward_backward(GPT* m, Uploader* up, double* p, const uint16_t* window, double* grads, int accum) {
    size_t n = m->table.n_elements;
    float* host = (float*)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        p[i] = round_bf16(p[i]);
        host[i] = (float)p[i];
    }
    gpt_upload_state(m, host, NULL);
    for (int i = 0; i < m->table.n_tensors; i++) {  // NaN: the first micro-batch must set every gradient
        const ParamTensor* t = &m->table.tensors[i];
        CUDA_CHECK(cudaMemsetAsync(m->grads + t->offset, 0xFF, (size_t)(t->rows * t->cols) * 4, m->stream));
    }
    for (int micro = 0; micro < accum; micro++) {
        Batch b = upload_batch(up, m, window + (size_t)micro * m->B * (m->T + 1));
        forward_backward(m, &b, micro, accum);
    }
    float loss_sum;
    CUDA_CHECK(cudaMemcpyAsync(&loss_sum, &m->scalars->loss_sum, 4, cudaMemcpyDeviceToHost, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    double* g = from_device_f32(m->grads, n);
    memcpy(grads, g, n * sizeof(double));
    free(g);
    free(host);
    return loss_sum / ((double)m->N * accum);
}

// Loss and every gradient tensor against the fp64 CPU reference, on configs that cover GQA, MQA,
// MHA, both head dims, odd layer counts and a sequence length that is no multiple of a tile.
// Tolerances: the GPU rounds every activation to bf16 (relative 2^-9 per rounding) through
// several layers. A matrix's gradient is a sum of products of such values and lands near 1e-2
// relative L2: we allow 3e-2. A norm weight's gradient is a sum over every token (and head) of
// terms of both signs that mostly cancel, so the same absolute rounding errors are large next to
// the small total: we measured up to 2.5e-2 and allow 8e-2. A wrong formula or index shows errors
// of order 1 in either. Every case runs its gate/up forward and its down backward through our fused
// GEMMs (gate_up_fused, down_swiglu_fused: d_model and ffn_dim are multiples of 8, the case checks
// it), the first with N = 154 rows, no multiple of 8; test_fp8_gpu_model_gradients_vs_bf16 checks
// that FP8 takes cuBLASLt's path.
static int test_model_matches_reference(void) {
    REQUIRE_GPU();
    int failed = 0;
    struct {
        ModelConfig c;
        int B, accum, recompute_layers;
    } cases[] = {
        {{512, 128, 3, 4, 2, 64, 256, 77, 10000.0f, 1e-6f}, 2, 1, 2},    // GQA, odd layers, odd T, 2 of 3 recomputed
        {{256, 256, 2, 2, 1, 128, 384, 64, 1e6f, 1e-5f}, 2, 1, 2},       // MQA, head_dim 128, every layer recomputed
        {{256, 128, 1, 2, 2, 64, 192, 130, 10000.0f, 1e-6f}, 1, 2, 0},   // MHA, gradient accumulation
    };
    for (auto& tc : cases) {
        const ModelConfig* c = &tc.c;
        GPT m;
        // loss_chunk 100: several chunks
        gpt_create(&m, c, tc.B, c->seq_len, tc.recompute_layers, 100, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
        for (int l = 0; l < c->n_layer; l++) {
            EXPECT(gate_up_fused(&m, l), "layer %d's gate/up is not fused", l);
            EXPECT(down_swiglu_fused(&m, l), "layer %d's down backward is not fused", l);
        }
        EXPECT(head_fused(&m), "the head is not fused");
        Uploader up;
        uploader_create(&up, m.N, c->vocab_size);
        double* p = random_params(c, &m.table, 0.08);
        uint16_t* window = random_window(tc.B * tc.accum, c->seq_len, c->vocab_size);
        double* g_gpu = (double*)calloc(m.table.n_elements, sizeof(double));
        double loss_gpu = gpu_forward_backward(&m, &up, p, window, g_gpu, tc.accum);
        double* g_ref = (double*)calloc(m.table.n_elements, sizeof(double));
        double loss_ref = 0.0;
        for (int micro = 0; micro < tc.accum; micro++)
            loss_ref += ref_forward_backward(c, &m.table, p, g_ref, window + (size_t)micro * tc.B * (c->seq_len + 1),
                                             tc.B, c->seq_len);
        loss_ref /= tc.accum;
        for (size_t i = 0; i < m.table.n_elements; i++) g_ref[i] /= tc.accum;
        EXPECT(fabs(loss_gpu - loss_ref) < 5e-3 * loss_ref, "loss %.6f vs reference %.6f", loss_gpu, loss_ref);
        double worst[2] = {0.0, 0.0};  // matrices, norm weights
        const char* worst_name[2] = {"", ""};
        for (int i = 0; i < m.table.n_tensors; i++) {
            const ParamTensor* t = &m.table.tensors[i];
            double err = rel_l2(g_gpu + t->offset, g_ref + t->offset, (size_t)(t->rows * t->cols));
            int is_norm = !t->decay;
            if (err > worst[is_norm]) {
                worst[is_norm] = err;
                worst_name[is_norm] = t->name;
            }
            EXPECT(err < (is_norm ? 8e-2 : 3e-2), "gradient of %s: relative L2 error %.3g", t->name, err);
        }
        printf("    L%d Hq%d Hkv%d D%d T%d: loss %.5f vs %.5f; worst gradients: %s %.2e, %s %.2e\n", c->n_layer,
               c->n_head, c->n_kv_head, c->head_dim, c->seq_len, loss_gpu, loss_ref, worst_name[0], worst[0],
               worst_name[1], worst[1]);
        free(p); free(window); free(g_gpu); free(g_ref);
        uploader_free(&up);
        gpt_free(&m);
    }
    return TEST_RESULT;
}

// Same seed, same batch: bit-identical loss and gradients; and recomputation changes nothing, for
// any number k of recomputed layers: none, some (the first of two: one layer shares the buffers,
// the other keeps its own) or all.
static int test_model_deterministic(void) {
    REQUIRE_GPU();
    int failed = 0;
    ModelConfig c = {4096, 256, 2, 4, 2, 64, 512, 200, 1e4f, 1e-6f};
    uint16_t* window = random_window(4, c.seq_len, c.vocab_size);
    const int recompute_layers[] = {0, 0, 1, 2};  // the first two runs are identical
    const int runs = 4;
    double* grads[runs];
    double loss[runs];
    for (int run = 0; run < runs; run++) {
        GPT m;
        gpt_create(&m, &c, 4, c.seq_len, recompute_layers[run], 333, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
        Uploader up;
        uploader_create(&up, m.N, c.vocab_size);
        ParamTable* pt = &m.table;
        g_rng = 12345;  // the same parameters every run
        double* p = random_params(&c, pt, 0.05);
        grads[run] = (double*)calloc(pt->n_elements, sizeof(double));
        loss[run] = gpu_forward_backward(&m, &up, p, window, grads[run], 1);
        free(p);
        uploader_free(&up);
        if (run == 1) {
            EXPECT(loss[0] == loss[1], "losses differ between identical runs: %.9g %.9g", loss[0], loss[1]);
            EXPECT(memcmp(grads[0], grads[1], pt->n_elements * 8) == 0, "gradients differ between identical runs");
        } else if (run > 1) {
            EXPECT(loss[run] == loss[0], "recomputing %d of %d layers changes the loss: %.9g, not %.9g",
                   recompute_layers[run], c.n_layer, loss[run], loss[0]);
            EXPECT(memcmp(grads[0], grads[run], pt->n_elements * 8) == 0,
                   "recomputing %d of %d layers changes the gradients", recompute_layers[run], c.n_layer);
        }
        gpt_free(&m);
    }
    for (int i = 0; i < runs; i++) free(grads[i]);
    free(window);
    return TEST_RESULT;
}

// backward()'s hook: it fires once per gradient bucket, layers L-1 down to 0 then bucket L, and at
// each call that bucket's gradients are final. The hook copies the bucket (on the stream, in
// order) when it fires; after the step the copies must equal the final gradients bit for bit.
typedef struct {
    float* snapshot;  // a device copy of the gradient buffer, filled bucket by bucket
    int order[MAX_LAYERS + 1];
    int calls;
} HookRecord;

static void record_bucket(void* ctx, const GPT* m, int bucket) {
    HookRecord* r = (HookRecord*)ctx;
    if (r->calls <= m->cfg.n_layer) r->order[r->calls] = bucket;
    r->calls++;
    size_t begin = m->table.bucket_offset[bucket], end = m->table.bucket_offset[bucket + 1];
    CUDA_CHECK(cudaMemcpyAsync(r->snapshot + begin, m->grads + begin, (end - begin) * sizeof(float),
                               cudaMemcpyDeviceToDevice, m->stream));
}

static int test_model_bucket_hook(void) {
    REQUIRE_GPU();
    int failed = 0;
    ModelConfig c = {1024, 128, 3, 2, 1, 64, 256, 64, 1e4f, 1e-6f};
    GPT m;
    gpt_create(&m, &c, 2, c.seq_len, c.n_layer, 4096, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
    gpt_init(&m, 3);
    Uploader up;
    uploader_create(&up, m.N, c.vocab_size);
    HookRecord rec = {};
    CUDA_CHECK(cudaMalloc(&rec.snapshot, m.table.n_elements * sizeof(float)));
    CUDA_CHECK(cudaMemset(rec.snapshot, 0, m.table.n_elements * sizeof(float)));
    m.grads_ready = record_bucket;
    m.grads_ready_ctx = &rec;
    uint16_t* window = random_window(2, c.seq_len, c.vocab_size);
    Batch b = upload_batch(&up, &m, window);
    forward_backward(&m, &b, 0, 1);
    CUDA_CHECK(cudaStreamSynchronize(m.stream));
    EXPECT(rec.calls == c.n_layer + 1, "%d hook calls, expected %d", rec.calls, c.n_layer + 1);
    for (int i = 0; i < rec.calls && i <= c.n_layer; i++)
        EXPECT(rec.order[i] == (i < c.n_layer ? c.n_layer - 1 - i : c.n_layer), "call %d was bucket %d", i,
               rec.order[i]);
    double *snap = from_device_f32(rec.snapshot, m.table.n_elements), *final_grads = from_device_f32(m.grads, m.table.n_elements);
    for (int bucket = 0; bucket <= c.n_layer; bucket++) {
        size_t begin = m.table.bucket_offset[bucket], end = m.table.bucket_offset[bucket + 1];
        EXPECT(!memcmp(snap + begin, final_grads + begin, (end - begin) * sizeof(double)),
               "bucket %d changed after its hook fired", bucket);
    }
    double norm = 0;
    for (size_t i = 0; i < m.table.n_elements; i++) norm += final_grads[i] * final_grads[i];
    EXPECT(norm > 0, "no gradient at all");
    free(snap); free(final_grads); free(window);
    CUDA_CHECK(cudaFree(rec.snapshot));
    uploader_free(&up);
    gpt_free(&m);
    return TEST_RESULT;
}

// ZeRO 1 and 2 against ZeRO 0 on one GPU, where the collectives are copies. This runs all of the
// sharding's bookkeeping (pieces, ring buffers, gathers) without NCCL; the 2-GPU tests check the
// collectives. Without accumulation the three modes must train bit for bit alike. With it, ZeRO 1
// still must; ZeRO 2 sums each micro-batch's gradients before adding them across micro-batches,
// and the embedding gets two contributions per micro-batch (the head and the lookup), so its sum
// is associated differently. So ZeRO 2 with accumulation is held to three things: it repeats bit
// for bit; after one step its weights are ZeRO 0's to 1e-6 (relative L2: only the fp32 sums'
// order differs); after six, its losses and weights are ZeRO 0's to 1e-2. Not 1e-6 there: once
// the fp32 weights differ in their last bits, some of their bf16 halves may round the other way,
// one bf16 step (2^-8 relative) each, and from there the runs part as any two bf16 runs do. How
// far depends on whether and where such a flip happens: seen from 0 to 7e-5 in the loss and 1e-9
// to 1.5e-4 in the weights, with the inputs of different seeds. A micro-batch's gradient lost or
// counted twice moves the weights by the update itself, lr = 3e-3 against weights of about 0.02:
// 1e-1, ten times the bound.
static void zero_mode_run(int zero, int accum, const ModelConfig* c, const uint16_t* windows, int steps,
                          float* losses, float** master) {
    CommEnv env = {};
    env.world = env.local_world = 1;
    env.launcher = "single";
    Comm comm;
    char err[256];
    if (comm_open(&comm, &env, 10.0, err, sizeof(err)) != 0) printf("    %s\n", err);
    Sharding dp = {0, 1, zero, &comm};
    GPT m;
    gpt_create(&m, c, 2, c->seq_len, c->n_layer, 4096, &dp, OPTIMIZER_ADAMW, FP8_OFF);
    gpt_init(&m, 11);
    Uploader up;
    uploader_create(&up, m.N, c->vocab_size);
    OptimConfig o = {3e-3f, 0.1f, 0.1f, 0.9f, 0.95f, 1e-8f, 1.0f, 2, steps, 0, 0.0f};
    for (int step = 0; step < steps; step++) {  // the same batch every step: the loss must fall
        for (int micro = 0; micro < accum; micro++) {
            Batch b = upload_batch(&up, &m, windows + (size_t)micro * 2 * (c->seq_len + 1));
            forward_backward(&m, &b, micro, accum);
        }
        optimizer_step(&m, &o);
        CUDA_CHECK(cudaMemcpy(&losses[step], &m.scalars->loss_sum, sizeof(float), cudaMemcpyDeviceToHost));
    }
    *master = (float*)malloc(m.table.n_elements * sizeof(float));
    gpt_gather_master(&m, *master);
    uploader_free(&up);
    gpt_free(&m);
    comm_close(&comm);
}

static int test_zero_modes_agree_on_one_gpu(void) {
    REQUIRE_GPU();
    int failed = 0;
    ModelConfig c = {1024, 128, 3, 4, 2, 64, 256, 64, 1e4f, 1e-6f};
    const int steps = 6;
    uint16_t* windows = random_window(2 * 2, c.seq_len, c.vocab_size);
    ParamTable pt;
    param_table_build(&pt, &c, 1);
    size_t bytes = pt.n_elements * 4;
    for (int accum = 1; accum <= 2; accum++) {
        float losses[3][steps], *master[3];
        for (int zero = 0; zero < 3; zero++) zero_mode_run(zero, accum, &c, windows, steps, losses[zero], &master[zero]);
        for (int zero = 1; zero < 3; zero++) {
            if (zero == 1 || accum == 1) {
                EXPECT(!memcmp(losses[0], losses[zero], sizeof(losses[0])), "accum %d: ZeRO-%d's losses differ", accum,
                       zero);
                EXPECT(!memcmp(master[0], master[zero], bytes), "accum %d: ZeRO-%d's weights differ", accum, zero);
                continue;
            }
            float again_losses[steps], *again, one_loss[2], *one_step[2];
            zero_mode_run(2, 2, &c, windows, steps, again_losses, &again);
            EXPECT(!memcmp(again_losses, losses[2], sizeof(again_losses)) && !memcmp(again, master[2], bytes),
                   "accum 2: ZeRO-2 does not repeat itself bit for bit");
            for (int k = 0; k < 2; k++) zero_mode_run(2 * k, 2, &c, windows, 1, &one_loss[k], &one_step[k]);
            double first = rel_l2(one_step[1], one_step[0], pt.n_elements), worst = 0;
            for (int i = 0; i < steps; i++) worst = fmax(worst, fabs(losses[2][i] - losses[0][i]) / losses[0][i]);
            double last = rel_l2(master[2], master[0], pt.n_elements);
            EXPECT(one_loss[0] == one_loss[1] && first < 1e-6, "accum 2: after one step ZeRO-2's weights are %.2e "
                   "apart (loss %.7g against %.7g)", first, one_loss[1], one_loss[0]);
            EXPECT(worst < 1e-2 && last < 1e-2, "accum 2: after %d steps ZeRO-2's losses are %.2e, weights %.2e apart",
                   steps, worst, last);
            printf("    accum 2: ZeRO-2 against ZeRO-0: weights %.1e apart after one step; after %d, losses %.1e, "
                   "weights %.1e (relative)\n", first, steps, worst, last);
            free(again);
            free(one_step[0]);
            free(one_step[1]);
        }
        EXPECT(losses[0][steps - 1] < 0.9f * losses[0][0], "the loss did not fall: %g -> %g", losses[0][0],
               losses[0][steps - 1]);
        for (int zero = 0; zero < 3; zero++) free(master[zero]);
    }
    param_table_free(&pt);
    free(windows);
    return TEST_RESULT;
}

// A few AdamW steps on one batch must drive its loss down (the optimizer is wired right).
static int test_model_trains(void) {
    REQUIRE_GPU();
    int failed = 0;
    ModelConfig c = {1024, 128, 2, 2, 1, 64, 256, 64, 1e4f, 1e-6f};
    GPT m;
    gpt_create(&m, &c, 4, c.seq_len, c.n_layer, 4096, &ONE_GPU, OPTIMIZER_ADAMW, FP8_OFF);
    gpt_init(&m, 7);
    Uploader up;
    uploader_create(&up, m.N, c.vocab_size);
    uint16_t* window = random_window(4, c.seq_len, c.vocab_size);
    OptimConfig o = {3e-3f, 1.0f, 0.1f, 0.9f, 0.95f, 1e-8f, 1.0f, 0, 30, 0, 0.0f};
    float first = 0, last = 0;
    for (int step = 0; step < 30; step++) {
        Batch b = upload_batch(&up, &m, window);
        forward_backward(&m, &b, 0, 1);
        optimizer_step(&m, &o);
        float loss_sum;
        CUDA_CHECK(cudaMemcpy(&loss_sum, &m.scalars->loss_sum, 4, cudaMemcpyDeviceToHost));
        if (step == 0) first = loss_sum / m.N;
        last = loss_sum / m.N;
    }
    EXPECT(fabsf(first - logf(c.vocab_size)) < 0.1f, "initial loss %.4f, expected ln(V) = %.4f", first, logf(c.vocab_size));
    EXPECT(last < 0.5f * first, "loss %.4f -> %.4f after 30 steps on one batch", first, last);
    printf("    loss %.4f -> %.4f\n", first, last);
    free(window);
    uploader_free(&up);
    gpt_free(&m);
    return TEST_RESULT;
}

// ----------------------------------------------------------------------------------------------
// The trainer as a user runs it: checkpoints, resume, export and init-from (GPU; they run the
// ./train_gpt binary on a small model and a generated shard).

// A temporary directory (into dir, 64 bytes) with train_000000.bin of n random tokens < vocab;
// returns false on error.
static bool make_shard_dir(char* dir, size_t n, int vocab) {
    if (make_test_dir(dir, 64, "test_gpt_run")) return false;
    uint16_t* tokens = (uint16_t*)malloc(n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) tokens[i] = (uint16_t)(rand_uniform() * vocab);
    char path[256], err[512];
    snprintf(path, sizeof(path), "%s/train_000000.bin", dir);
    bool ok = shard_write(path, tokens, n, err, sizeof(err)) == 0;
    if (!ok) printf("    %s\n", err);
    free(tokens);
    return ok;
}

// The JSON log's text for one step's loss and grad norm (printed with 9 significant digits,
// which round-trips a float exactly), or "" when the step is not logged.
static void logged_step(const char* log_path, int step, char* out, size_t len) {
    out[0] = '\0';
    FILE* f = fopen(log_path, "r");
    if (!f) return;
    char line[1024], key[32];
    snprintf(key, sizeof(key), "{\"step\": %d, \"loss\"", step);
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, key, strlen(key))) {
            const char* end = strstr(line, ", \"lr\"");
            snprintf(out, len, "%.*s", end ? (int)(end - line) : 0, line);
        }
    fclose(f);
}

// Steps first..last of two runs' log.jsonl must log the same loss and gradient norm, to the bit;
// returns 1 (having said which step differs) if they do not.
static int compare_logged_steps(const char* log_a, const char* log_b, int first, int last) {
    int failed = 0;
    char a[512], b[512];
    for (int step = first; step <= last; step++) {
        logged_step(log_a, step, a, sizeof(a));
        logged_step(log_b, step, b, sizeof(b));
        EXPECT(a[0] && !strcmp(a, b), "step %d: '%s' in %s vs '%s' in %s", step, a, log_a, b, log_b);
    }
    return failed;
}

#define SMALL_RUN                                                                                        \
    "./train_gpt --vocab 512 --d-model 128 --layers 2 --heads 4 --kv-heads 2 --head-dim 64 --ffn 256 " \
    "--seq 64 --batch 4 --total-batch 512 --warmup 2 --lr 3e-3 --val-data '' --sample-every 0 "

// Train 10 steps straight; train 5 (checkpoint, stop), resume, train 5 more: steps 6..10 must log
// bit-identical losses and gradient norms, with gradient accumulation on and mid-epoch. In BF16,
// and in FP8 with delayed scaling (the layers, then the head too), validating every 3 steps and
// at the stop: the scales' amax histories travel in the checkpoint, and an evaluation leaves no
// trace in them.
static int test_resume_is_bit_exact(void) {
    REQUIRE_GPU();
    int failed = 0;
    char dir[64], cmd[2048], path[256], path_b[256], extra[256];
    EXPECT(make_shard_dir(dir, 60000, 512), "shard");
    const char* quiet = "> /dev/null";
    const char* modes[] = {"bf16", "fp8", "fp8_head"};
    const char* mode_flags[] = {"", "--fp8 1", "--fp8 1 --fp8-head 1"};
    const char* splits[] = {"split", "fp8_split", "fp8_head_split"};
    for (int k = 0; k < 3; k++) {
        snprintf(extra, sizeof(extra), k ? "%s --val-data '%s/train_*.bin' --val-every 3 --val-batches 2" : "",
                 mode_flags[k], dir);
        snprintf(cmd, sizeof(cmd), SMALL_RUN "%s --train-data '%s/train_*.bin' --steps 10 --ckpt-every 0 --out %s/%s_straight %s",
                 extra, dir, dir, modes[k], quiet);
        EXPECT(system(cmd) == 0, "straight run failed: %s", cmd);
        snprintf(cmd, sizeof(cmd), SMALL_RUN "%s --train-data '%s/train_*.bin' --steps 10 --ckpt-every 3 --stop-at 5 --out %s/%s "
                 "%s", extra, dir, dir, splits[k], quiet);
        EXPECT(system(cmd) == 0, "first half failed: %s", cmd);
        snprintf(cmd, sizeof(cmd), SMALL_RUN "%s --train-data '%s/train_*.bin' --steps 10 --ckpt-every 3 --resume latest --out "
                 "%s/%s %s", extra, dir, dir, splits[k], quiet);
        EXPECT(system(cmd) == 0, "resumed half failed: %s", cmd);
        snprintf(path, sizeof(path), "%s/%s_straight/log.jsonl", dir, modes[k]);
        snprintf(path_b, sizeof(path_b), "%s/%s/log.jsonl", dir, splits[k]);
        failed |= compare_logged_steps(path, path_b, 1, 10);
    }
    snprintf(path, sizeof(path), "%s/fp8_split/ckpt_10/fp8_scales.bin", dir);
    EXPECT(access(path, F_OK) == 0, "the FP8 run's checkpoint has no fp8_scales.bin");
    // keep-last 2: checkpoints 10 and 9 remain (3, 5 and 6 were deleted), latest names 10
    snprintf(path, sizeof(path), "%s/split/ckpt_3", dir);
    EXPECT(access(path, F_OK) != 0, "ckpt_3 should have been pruned");
    snprintf(path, sizeof(path), "%s/split/ckpt_10/manifest.json", dir);
    EXPECT(access(path, F_OK) == 0, "ckpt_10 missing");
    // a damaged checkpoint is one clear error naming the file, never a silent fresh start
    snprintf(path, sizeof(path), "%s/split/ckpt_10/optimizer.0-of-1.safetensors", dir);
    FILE* f = fopen(path, "r+b");
    EXPECT(f != NULL, "open %s", path);
    if (f) {
        fseek(f, 1000, SEEK_SET);
        fputc(0x5A ^ fgetc(f), f);
        fclose(f);
    }
    snprintf(cmd, sizeof(cmd), SMALL_RUN "--train-data '%s/train_*.bin' --steps 12 --resume latest --out %s/split", dir, dir);
    char line[512];
    int code = run_command(cmd, line, sizeof(line));
    EXPECT(code == 1 && strstr(line, "optimizer.0-of-1.safetensors"), "damaged checkpoint: exit %d, '%s'", code, line);
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

// --recompute 0, 1 and auto train alike: 6 steps each (gradient accumulation on) log the same
// losses and gradient norms to the bit, and the auto run says in its header how many layers it
// recomputes (on a GPU with room, none: this model's plan is a few MiB).
static int test_recompute_auto_trains_alike(void) {
    REQUIRE_GPU();
    int failed = 0;
    char dir[64], cmd[2048], path[256], path_b[256];
    EXPECT(make_shard_dir(dir, 60000, 512), "shard");
    const char* modes[] = {"0", "1", "auto"};
    for (int i = 0; i < 3; i++) {
        snprintf(cmd, sizeof(cmd), SMALL_RUN "--train-data '%s/train_*.bin' --steps 6 --ckpt-every 0 --recompute %s "
                 "--out %s/rc_%s > %s/rc_%s.txt", dir, modes[i], dir, modes[i], dir, modes[i]);
        EXPECT(system(cmd) == 0, "run failed: %s", cmd);
    }
    snprintf(path, sizeof(path), "%s/rc_0/log.jsonl", dir);
    for (int i = 1; i < 3; i++) {
        snprintf(path_b, sizeof(path_b), "%s/rc_%s/log.jsonl", dir, modes[i]);
        failed |= compare_logged_steps(path, path_b, 1, 6);
    }
    snprintf(cmd, sizeof(cmd), "grep -q 'recompute auto: 0 of 2 layers' %s/rc_auto.txt && grep -q "
             "'(recompute 2 of 2 layers)' %s/rc_1.txt", dir, dir);
    EXPECT(system(cmd) == 0, "the headers do not say 'recompute auto: 0 of 2 layers' and 'recompute 2 of 2 layers' "
           "(%s/rc_*.txt)", dir);
    if (!failed) {
        snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
        EXPECT(system(cmd) == 0, "cleanup");
    }
    return TEST_RESULT;
}

// --cuda-graph 1 (the default) against eager launches (--cuda-graph 0), 10 steps without
// accumulation (the mode graphs capture): the same losses and gradient norms to the bit, in BF16
// with recomputation on and off, in FP8 with delayed scaling (the graph holds the fused path of a
// calibrated step) and with current scaling, the head in FP8 too, and with Muon and 8-bit AdamW;
// validating every 3 steps (one batch each, so a slot's graph runs both after a step and after a
// validation) and checkpointing every 3 (the graph waits for the snapshot). A graph run stopped at
// step 5 and resumed with graphs must match too. With accumulation the run must say in one line
// that its steps run eagerly.
static int test_cuda_graph_matches_eager(void) {
    REQUIRE_GPU();
    int failed = 0;
    char dir[64], cmd[2048], run[1024], path[256], path_b[256], line[512];
    EXPECT(make_shard_dir(dir, 60000, 512), "shard");
    const char* modes[] = {"bf16", "bf16_no_recompute", "fp8", "fp8_head_no_recompute", "fp8_current", "muon",
                           "adamw8bit"};
    const char* mode_flags[] = {"", "--recompute 0", "--fp8 1", "--fp8 1 --fp8-head 1 --recompute 0",
                                "--fp8 1 --fp8-scaling current", "--optimizer muon", "--optimizer adamw8bit"};
    for (int k = 0; k < 7; k++) {
        snprintf(run, sizeof(run), SMALL_RUN "%s --total-batch 0 --steps 10 --train-data '%s/train_*.bin' "
                 "--val-data '%s/train_*.bin' --val-every 3 --val-batches 1", mode_flags[k], dir, dir);
        const char* variants[][2] = {{"eager", "--cuda-graph 0 --ckpt-every 0"},
                                     {"graph", "--cuda-graph 1 --ckpt-every 3"},
                                     {"split", "--cuda-graph 1 --ckpt-every 3 --stop-at 5"},
                                     {"split", "--cuda-graph 1 --ckpt-every 3 --resume latest"}};
        for (int v = 0; v < 4; v++) {
            snprintf(cmd, sizeof(cmd), "%s %s --out %s/%s_%s > %s/%s_%s%d.txt", run, variants[v][1], dir, modes[k],
                     variants[v][0], dir, modes[k], variants[v][0], v);
            EXPECT(system(cmd) == 0, "run failed: %s", cmd);
        }
        snprintf(cmd, sizeof(cmd), "grep -q 'cuda graph: step 5 captured' %s/%s_graph1.txt && "
                 "grep -q 'cuda graph: step 10 captured' %s/%s_split3.txt", dir, modes[k], dir, modes[k]);
        EXPECT(system(cmd) == 0, "%s: the graph runs did not capture after their warm-up (%s)", modes[k], cmd);
        snprintf(path, sizeof(path), "%s/%s_eager/log.jsonl", dir, modes[k]);
        for (int v = 1; v < 3; v++) {
            snprintf(path_b, sizeof(path_b), "%s/%s_%s/log.jsonl", dir, modes[k], variants[v][0]);
            failed |= compare_logged_steps(path, path_b, 1, 10);
        }
    }
    snprintf(cmd, sizeof(cmd), SMALL_RUN "--cuda-graph 1 --steps 2 --ckpt-every 0 --train-data '%s/train_*.bin' "
             "--out %s/accum | grep 'cuda graph' 1>&2", dir, dir);
    run_command(cmd, line, sizeof(line));
    EXPECT(strstr(line, "cuda graph: off, every step runs eagerly: gradient accumulation") && !strstr(line, "captured"),
           "with accumulation: '%s'", line);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    EXPECT(system(cmd) == 0, "cleanup");
    return TEST_RESULT;
}

// kill -9 at an arbitrary moment while checkpoints are being written asynchronously every step:
// the run resumes from `latest`, which must be complete and verify.
static int test_kill_during_checkpoint_then_resume(void) {
    REQUIRE_GPU();
    int failed = 0;
    char dir[64], cmd[2048], line[512];
    EXPECT(make_shard_dir(dir, 400000, 8192), "shard");
    const char* model = "./train_gpt --vocab 8192 --d-model 512 --layers 4 --heads 4 --kv-heads 2 --head-dim 128 "
                        "--ffn 1024 --seq 128 --batch 8 --val-data '' --sample-every 0 ";
    for (int attempt = 0; attempt < 3; attempt++) {
        snprintf(cmd, sizeof(cmd), "rm -rf %s/out; %s --train-data '%s/train_*.bin' --steps 100000 --ckpt-every 1 "
                 "--out %s/out > %s/log.txt 2>&1 & pid=$!; sleep %d.%d; kill -9 $pid; wait $pid 2>/dev/null; true",
                 dir, model, dir, dir, dir, 4 + attempt, (int)(rand_uniform() * 10));
        EXPECT(system(cmd) == 0, "background run");
        // resume from what `latest` names and run two more steps
        char latest_path[256], latest[64] = "";
        snprintf(latest_path, sizeof(latest_path), "%s/out/latest", dir);
        FILE* f = fopen(latest_path, "r");
        if (f) {
            if (!fgets(latest, sizeof(latest), f)) latest[0] = '\0';
            fclose(f);
        }
        int step = 0;
        if (sscanf(latest, "ckpt_%d", &step) != 1) {
            EXPECT(false, "no checkpoint written before the kill (latest: '%s')", latest);
            continue;
        }
        snprintf(cmd, sizeof(cmd), "%s --train-data '%s/train_*.bin' --steps 100000 --stop-at %d --ckpt-every 1 "
                 "--resume latest --out %s/out", model, dir, step + 2, dir);
        int code = run_command(cmd, line, sizeof(line));
        EXPECT(code == 0, "resume after kill -9 at checkpoint %d: exit %d, '%s'", step, code, line);
        snprintf(cmd, sizeof(cmd), "ls -d %s/out/*.tmp 2>/dev/null | grep -q .", dir);
        EXPECT(system(cmd) != 0, "a .tmp directory survived the resume");
        printf("    killed after checkpoint %d, resumed to %d\n", step, step + 2);
    }
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

// A full disk: the output directory on a 12 MB tmpfs, where the first checkpoint (~17 MB) cannot
// be written. By default that stops training with one line and exit 1; with --ckpt-keep-going 1
// training finishes, reporting each failure. Either way no half-written checkpoint is left behind.
// Needs root to mount the tmpfs; skipped (and says so) where that is not possible.
static int test_checkpoint_on_full_disk(void) {
    REQUIRE_GPU();
    int failed = 0;
    char dir[64], cmd[2048], line[512];
    EXPECT(make_shard_dir(dir, 60000, 512), "shard");
    snprintf(cmd, sizeof(cmd), "mkdir -p %s/full && mount -t tmpfs -o size=12m tmpfs %s/full 2>/dev/null", dir, dir);
    if (system(cmd) != 0) {
        printf("    skipped: cannot mount a small tmpfs here (needs root)\n");
        remove_test_dir(dir);
        return TEST_SKIP;
    }
    const char* model = "./train_gpt --vocab 8192 --d-model 256 --layers 2 --heads 4 --kv-heads 2 --head-dim 64 "
                        "--ffn 512 --seq 64 --batch 4 --val-data '' --sample-every 0 --steps 6 --ckpt-every 2 ";
    snprintf(cmd, sizeof(cmd), "%s --train-data '%s/train_*.bin' --out %s/full/stop", model, dir, dir);
    int code = run_command(cmd, line, sizeof(line));
    EXPECT(code == 1 && strstr(line, "checkpoint of step 2 failed"), "default: exit %d, '%s'", code, line);
    snprintf(cmd, sizeof(cmd), "%s --train-data '%s/train_*.bin' --out %s/full/go --ckpt-keep-going 1", model, dir, dir);
    code = run_command(cmd, line, sizeof(line));
    EXPECT(code == 1 && strstr(line, "carrying on"), "keep going: exit %d, first line '%s'", code, line);
    snprintf(cmd, sizeof(cmd), "grep -c '\"step\": 6,' %s/full/go/log.jsonl | grep -qx 1", dir);
    EXPECT(system(cmd) == 0, "with --ckpt-keep-going 1 the run reaches step 6");
    snprintf(cmd, sizeof(cmd), "ls -d %s/full/*/ckpt_* 2>/dev/null | grep -q .", dir);
    EXPECT(system(cmd) != 0, "a partial checkpoint directory was left on the full disk");
    snprintf(cmd, sizeof(cmd), "umount %s/full; rm -rf %s", dir, dir);
    EXPECT(system(cmd) == 0, "cleanup");
    return TEST_RESULT;
}

// Export, then start a new run from the export: it must hold exactly the same weights.
static int test_export_then_init_from(void) {
    REQUIRE_GPU();
    int failed = 0;
    char dir[64], cmd[2048];
    EXPECT(make_shard_dir(dir, 20000, 512), "shard");
    snprintf(cmd, sizeof(cmd), SMALL_RUN "--train-data '%s/train_*.bin' --steps 3 --ckpt-every 0 --out %s/a --export %s/a/hf > /dev/null",
             dir, dir, dir);
    EXPECT(system(cmd) == 0, "train and export: %s", cmd);
    snprintf(cmd, sizeof(cmd), "./train_gpt --seq 64 --batch 4 --val-data '' --sample-every 0 --train-data '%s/train_*.bin' "
             "--steps 0 --ckpt-every 0 --init-from %s/a/hf --out %s/b --export %s/b/hf > /dev/null", dir, dir, dir, dir);
    EXPECT(system(cmd) == 0, "init-from and export: %s", cmd);
    snprintf(cmd, sizeof(cmd), "cmp -s %s/a/hf/model.safetensors %s/b/hf/model.safetensors", dir, dir);
    EXPECT(system(cmd) == 0, "init-from did not reproduce the exported weights");
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

// ----------------------------------------------------------------------------------------------
// Data parallelism on two GPUs (skipped with fewer): ./train_gpt --gpus 2 in each ZeRO mode against
// one GPU with twice the accumulation, on the same tokens per optimizer step.

static int gpu_count(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
#define REQUIRE_TWO_GPUS()                                                       \
    do {                                                                         \
        if (!g_have_gpu || gpu_count() < 2) return TEST_SKIP;                    \
    } while (0)

// A figure ("loss", "grad_norm") of steps 1..n of a run's log.jsonl, as printed (9 significant
// digits); returns how many steps were logged.
static int logged_figures(const char* log_path, const char* key, double* out, int n) {
    int got = 0;
    char quoted[64];
    snprintf(quoted, sizeof(quoted), "\"%s\": ", key);
    for (int step = 1; step <= n; step++) {
        char line[512];
        logged_step(log_path, step, line, sizeof(line));
        const char* p = strstr(line, quoted);
        if (!p) break;
        out[got++] = atof(p + strlen(quoted));
    }
    return got;
}

#define DP_STEPS 50

// The same tokens per step on 2 GPUs (every ZeRO mode, NCCL over sockets only, and launched by
// torchrun where it is installed) and on 1 GPU with twice the accumulation. Two ranks add two
// numbers per gradient element whatever the collective, so ZeRO 1 and 2 agree bit for bit, and
// so does every rerun. ZeRO 0 sums the squares of the gradient norm over the whole buffer where
// ZeRO 1 and 2 sum each rank's pieces and add the two sums: the norm differs in its last bits, and
// once the clip is active (norm > 1) so does the update. One GPU adds its micro-batches in another
// order. Those are said as figures, held to 1e-2 over the 50 steps. A rerun of ZeRO 2 with
// --recompute auto (the ranks agree on how many layers recompute, and that changes no number)
// must equal ZeRO 1 too.
static int test_two_gpus_match_one(void) {
    REQUIRE_TWO_GPUS();
    int failed = 0;
    char dir[64], cmd[2048], path[256];
    EXPECT(make_shard_dir(dir, 200000, 512), "shard");
    bool have_torchrun = system("command -v torchrun > /dev/null 2>&1") == 0;
    const char* runs[] = {"one", "zero0", "zero1", "zero2", "zero2_recompute_auto", "zero2_sockets", "torchrun_zero1"};
    const char* flags[] = {"", "--gpus 2 --zero 0", "--gpus 2 --zero 1", "--gpus 2 --zero 2",
                           "--gpus 2 --zero 2 --recompute auto", "--gpus 2 --zero 2", "--zero 1"};
    const char* launch[] = {"", "", "", "", "", "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 ",
                            "torchrun --standalone --nproc_per_node 2 --no-python "};
    int n_runs = have_torchrun ? 7 : 6;
    double loss[7][DP_STEPS], norm[7][DP_STEPS];
    for (int r = 0; r < n_runs; r++) {
        snprintf(cmd, sizeof(cmd), "%s" SMALL_RUN "--ckpt-every 0 --steps %d %s --train-data '%s/train_*.bin' --out %s/%s "
                 "> %s/%s.txt 2>&1", launch[r], DP_STEPS, flags[r], dir, dir, runs[r], dir, runs[r]);
        EXPECT(system(cmd) == 0, "run %s failed: %s", runs[r], cmd);
        snprintf(path, sizeof(path), "%s/%s/log.jsonl", dir, runs[r]);
        EXPECT(logged_figures(path, "loss", loss[r], DP_STEPS) == DP_STEPS &&
               logged_figures(path, "grad_norm", norm[r], DP_STEPS) == DP_STEPS, "run %s logged fewer than %d steps",
               runs[r], DP_STEPS);
    }
    for (int r = 3; r < n_runs; r++)
        EXPECT(!memcmp(loss[2], loss[r], sizeof(loss[2])) && !memcmp(norm[2], norm[r], sizeof(norm[2])),
               "%s differs from zero1", runs[r]);
    snprintf(cmd, sizeof(cmd), "grep -q 'recompute auto: .* on every rank, the most any rank needs' %s/%s.txt", dir,
             runs[4]);
    EXPECT(system(cmd) == 0, "the --recompute auto run on 2 GPUs does not say that the ranks agreed (%s/%s.txt)", dir,
           runs[4]);
    double worst[2] = {0, 0};  // ZeRO 0 and 1 GPU against ZeRO 1
    int first_apart = 0, clipped = 0;
    for (int i = 0; i < DP_STEPS; i++) {
        worst[0] = fmax(worst[0], fabs(loss[1][i] - loss[2][i]) / loss[2][i]);
        worst[1] = fmax(worst[1], fabs(loss[0][i] - loss[2][i]) / loss[2][i]);
        if (!first_apart && loss[1][i] != loss[2][i]) first_apart = i + 1;
        clipped += norm[2][i] > 1.0;
    }
    EXPECT(loss[0][0] == loss[2][0] && loss[1][0] == loss[2][0], "step 1: %.9g on 1 GPU, %.9g ZeRO 0, %.9g ZeRO 1",
           loss[0][0], loss[1][0], loss[2][0]);
    EXPECT(worst[0] < 1e-2 && worst[1] < 1e-2, "drifting apart: ZeRO 0 %.3g, 1 GPU %.3g relative", worst[0], worst[1]);
    printf("    %d steps on 2 GPUs: ZeRO 1, 2, sockets only%s identical; ZeRO 0 identical up to step %d, then within "
           "%.2e (%d of %d steps clipped); 1 GPU within %.2e\n", DP_STEPS, have_torchrun ? ", torchrun" : "",
           first_apart ? first_apart - 1 : DP_STEPS, worst[0], clipped, DP_STEPS, worst[1]);
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

// ZeRO 2 on two GPUs: each rank writes its shard of the moments into the checkpoint (and no
// receipt stays behind); resuming on two GPUs is bit-exact; a two-GPU checkpoint resumes on one GPU
// and a one-GPU checkpoint on two, each saying it resharded and going on where the straight run
// went (to the reduction order's rounding).
static int test_two_gpus_sharded_checkpoints(void) {
    REQUIRE_TWO_GPUS();
    int failed = 0;
    char dir[64], cmd[2048], path[256], extra[256];
    EXPECT(make_shard_dir(dir, 60000, 512), "shard");
    struct { const char* out; const char* flags; } runs[] = {
        {"straight", "--gpus 2 --zero 2 --ckpt-every 0"},
        {"split", "--gpus 2 --zero 2 --ckpt-every 5 --stop-at 5"},
        {"split", "--gpus 2 --zero 2 --ckpt-every 0 --resume latest"},
        {"to_one", "--ckpt-every 0 --resume %s/split/ckpt_5"},
        {"single", "--ckpt-every 5 --stop-at 5"},
        {"to_two", "--gpus 2 --zero 1 --ckpt-every 0 --resume %s/single/ckpt_5"},
    };
    for (int r = 0; r < 6; r++) {
        snprintf(extra, sizeof(extra), runs[r].flags, dir);
        snprintf(cmd, sizeof(cmd), SMALL_RUN "--steps 10 --train-data '%s/train_*.bin' --out %s/%s %s > %s/run%d.txt 2>&1",
                 dir, dir, runs[r].out, extra, dir, r);
        EXPECT(system(cmd) == 0, "run %d failed: %s", r, cmd);
    }
    snprintf(cmd, sizeof(cmd), "cd %s/split/ckpt_5 && grep -q '\"optimizer.0-of-2.safetensors\"' manifest.json && "
             "grep -q '\"optimizer.1-of-2.safetensors\"' manifest.json && ! ls receipt.* 2>/dev/null", dir);
    EXPECT(system(cmd) == 0, "ckpt_5 does not hold both shards and only them (%s/split/ckpt_5)", dir);
    snprintf(cmd, sizeof(cmd), "grep -q resharded %s/run3.txt && grep -q resharded %s/run5.txt", dir, dir);
    EXPECT(system(cmd) == 0, "a resume on another GPU count did not say it resharded (%s/run3.txt, run5.txt)", dir);
    // steps 6..10 of each run's log against the straight run's
    const char* outs[] = {"straight", "split", "to_one", "to_two"};
    char text[4][5][512];
    double loss[4][5];
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 5; k++) {
            snprintf(path, sizeof(path), "%s/%s/log.jsonl", dir, outs[i]);
            logged_step(path, 6 + k, text[i][k], sizeof(text[i][k]));
            const char* p = strstr(text[i][k], "\"loss\": ");
            loss[i][k] = p ? atof(p + 8) : NAN;
            EXPECT(p, "%s: step %d not logged", outs[i], 6 + k);
        }
    for (int k = 0; k < 5; k++)
        EXPECT(!strcmp(text[0][k], text[1][k]), "2 GPUs resumed, step %d: '%s' vs straight '%s'", 6 + k, text[1][k],
               text[0][k]);
    double worst[2] = {0, 0};
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 5; k++) worst[i] = fmax(worst[i], fabs(loss[2 + i][k] - loss[0][k]) / loss[0][k]);
    EXPECT(worst[0] < 1e-3 && worst[1] < 1e-3, "resharded resumes drift: %.3g (2 -> 1 GPU), %.3g (1 -> 2)", worst[0],
           worst[1]);
    printf("    2 GPUs resumed bit-exactly; steps 6-10 resharded 2 -> 1 GPU within %.2e, 1 -> 2 within %.2e\n",
           worst[0], worst[1]);
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

// kill -9 of one rank: under --gpus the launcher stops the other at once and says which rank died;
// started by hand (as a multi-node launcher would leave them), the survivor's watchdog stops it
// within --timeout. Either way the run resumes from `latest`, on 1 GPU as on 2.
static int test_two_gpus_kill_and_resume(void) {
    REQUIRE_TWO_GPUS();
    int failed = 0;
    char dir[64], cmd[4096], line[512];
    EXPECT(make_shard_dir(dir, 400000, 512), "shard");
    snprintf(cmd, sizeof(cmd), SMALL_RUN "--gpus 2 --zero 1 --ckpt-every 1 --steps 100000 --train-data '%s/train_*.bin' "
             "--out %s/out > %s/launch.txt 2>&1 & sleep 8; pkill -9 -n -f 'train_gpt.*%s/out'; wait; true", dir, dir,
             dir, dir);
    EXPECT(system(cmd) == 0, "launch");
    snprintf(cmd, sizeof(cmd), "grep -c 'was killed by signal 9' %s/launch.txt > /dev/null", dir);
    EXPECT(system(cmd) == 0, "the launcher did not say which rank died (see %s/launch.txt)", dir);
    // by hand: two ranks on a fixed port, rank 1 killed; rank 0 must stop within --timeout 15 s
    snprintf(cmd, sizeof(cmd), "export MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2; "
             "start=$(date +%%s); for r in 0 1; do RANK=$r LOCAL_RANK=$r " SMALL_RUN "--zero 2 --timeout 15 "
             "--ckpt-every 0 --steps 100000 --train-data '%s/train_*.bin' --out %s/byhand > %s/rank$r.txt 2>&1 & "
             "done; sleep 10; pkill -9 -f 'train_gpt.*byhand.*' -n; wait; echo $(( $(date +%%s) - start )) >&2", dir,
             dir, dir);
    int code = run_command(cmd, line, sizeof(line));
    snprintf(cmd, sizeof(cmd), "grep -q 'rank 0 of 2' %s/rank0.txt", dir);
    EXPECT(code == 0 && system(cmd) == 0, "rank 0 did not stop with one line (%s/rank0.txt)", dir);
    EXPECT(atoi(line) < 10 + 15 + 20, "rank 0 took %s s to stop", line);
    const char* resumes[] = {"", "--gpus 2 --zero 2"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof(cmd), SMALL_RUN "%s --resume latest --train-data '%s/train_*.bin' --out %s/out "
                 "--steps 100000 --stop-at $(( $(sed 's/ckpt_//' %s/out/latest) + 2 )) --ckpt-every 0 2>&1 "
                 "| grep -q 'resumed from'", resumes[i], dir, dir, dir);
        code = run_command(cmd, line, sizeof(line));
        EXPECT(code == 0, "resume %s from the 2-GPU checkpoint failed", resumes[i][0] ? "on 2 GPUs" : "on 1 GPU");
    }
    failed |= remove_test_dir(dir);
    return TEST_RESULT;
}

// FP8's and the optimizers' tests use the whole-model and run helpers above.
#include "test/test_fp8.h"
#include "test/test_optim.h"

static const TestCase model_tests[] = {
    {"config_accepts_sane_configs", test_config_accepts_sane_configs},
    {"config_rejects_bad_configs", test_config_rejects_bad_configs},
    {"param_table_layout", test_param_table_layout},
    {"param_table_buckets_split_evenly", test_param_table_buckets_split_evenly},
    {"hf_names_cover_every_parameter", test_hf_names_cover_every_parameter},
    {"learning_rate_schedules", test_learning_rate_schedules},
    {"master_halves_round_trip", test_master_halves_round_trip},
    {"hopper_swiglu_requirements", test_hopper_swiglu_requirements},
    {"hopper_logits_requirements", test_hopper_logits_requirements},
    {"flops_per_token", test_flops_per_token},
    {"recompute_auto_choice", test_recompute_auto_choice},
    {"recompute_within_max_memory", test_recompute_within_max_memory},
    {"reference_gradients_match_finite_differences", test_reference_gradients_match_finite_differences},
    {"export_hf_files", test_export_hf_files},
    {"command_line", test_command_line},
    {"gpu_kernel_sum_partials", test_kernel_sum_partials},
    {"gpu_kernel_rmsnorm", test_kernel_rmsnorm},
    {"gpu_kernel_qk_norm_rope", test_kernel_qk_norm_rope},
    {"gpu_kernel_attention", test_kernel_attention},
    {"gpu_kernel_qk_backward_reads_dq_accumulators", test_kernel_qk_backward_reads_dq_accumulators},
    {"gpu_kernel_swiglu", test_kernel_swiglu},
    {"gpu_kernel_cross_entropy", test_kernel_cross_entropy},
    {"gpu_kernel_cross_entropy_matches_two_pass", test_kernel_cross_entropy_matches_two_pass},
    {"gpu_kernel_head_fused", test_kernel_head_fused},
    {"gpu_kernel_head_fused_matches_three_passes", test_kernel_head_fused_matches_three_passes},
    {"gpu_kernel_matmuls", test_kernel_matmuls},
    {"gpu_kernel_matmul_tuning", test_kernel_matmul_tuning},
    {"gpu_kernel_matmul_fp8", test_kernel_matmul_fp8},
    {"gpu_kernel_gate_up_swiglu", test_kernel_gate_up_swiglu},
    {"gpu_kernel_down_swiglu_backward", test_kernel_down_swiglu_backward},
    {"gpu_kernel_embedding_and_reductions", test_kernel_embedding_and_reductions},
    {"gpu_kernel_adamw", test_kernel_adamw},
    {"gpu_model_matches_reference", test_model_matches_reference},
    {"gpu_model_deterministic", test_model_deterministic},
    {"gpu_model_bucket_hook", test_model_bucket_hook},
    {"gpu_zero_modes_agree_on_one_gpu", test_zero_modes_agree_on_one_gpu},
    {"gpu_model_trains", test_model_trains},
    {"gpu_resume_is_bit_exact", test_resume_is_bit_exact},
    {"gpu_recompute_auto_trains_alike", test_recompute_auto_trains_alike},
    {"gpu_cuda_graph_matches_eager", test_cuda_graph_matches_eager},
    {"gpu_kill_during_checkpoint_then_resume", test_kill_during_checkpoint_then_resume},
    {"gpu_checkpoint_on_full_disk", test_checkpoint_on_full_disk},
    {"gpu_export_then_init_from", test_export_then_init_from},
    {"gpu2_two_gpus_match_one", test_two_gpus_match_one},
    {"gpu2_sharded_checkpoints", test_two_gpus_sharded_checkpoints},
    {"gpu2_kill_and_resume", test_two_gpus_kill_and_resume},
};

int main(int argc, char** argv) {
    program_name = "test_gpt";
    const char* filter = argc > 1 ? argv[1] : NULL;
    int n_devices = 0;
    g_have_gpu = cudaGetDeviceCount(&n_devices) == cudaSuccess && n_devices > 0;
    const char* seed_env = getenv("TEST_SEED");
    uint64_t seed = seed_env ? strtoull(seed_env, NULL, 10) : (uint64_t)time(NULL);
    g_rng = seed ? seed : 1;
    printf("test_gpt: %s; seed %llu (TEST_SEED=%llu repeats this run)\n",
           g_have_gpu ? "GPU present" : "no GPU: GPU tests are skipped", (unsigned long long)seed,
           (unsigned long long)seed);
    struct {
        const TestCase* tests;
        int n;
    } suites[] = {
        {model_tests, (int)(sizeof(model_tests) / sizeof(model_tests[0]))},
        {data_tests, n_data_tests},
        {ckpt_tests, n_ckpt_tests},
        {comm_tests, n_comm_tests},
        {fp8_tests, n_fp8_tests},
        {input_tests, n_input_tests},
        {optim_tests, n_optim_tests},
    };
    int passed = 0, failed = 0, skipped = 0, matched = 0;
    for (auto& suite : suites)
        for (int i = 0; i < suite.n; i++) matched += !filter || strstr(suite.tests[i].name, filter) != NULL;
    // a mistyped filter must not pass as "0 passed, 0 failed"
    if (matched == 0) usage_error("no test name contains '%s'", filter);
    for (auto& suite : suites)
        for (int i = 0; i < suite.n; i++) {
            const TestCase* t = &suite.tests[i];
            if (filter && !strstr(t->name, filter)) continue;
            double t0 = now_seconds();
            int r = t->fn();
            const char* word = r == TEST_PASS ? "ok" : r == TEST_FAIL ? "FAILED" : "skipped";
            printf("%-52s %s (%.1f s)\n", t->name, word, now_seconds() - t0);
            fflush(stdout);
            if (r == TEST_PASS) passed++;
            else if (r == TEST_FAIL) failed++;
            else skipped++;
        }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}
