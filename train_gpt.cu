/*
 * train_gpt.cu - train a Qwen3-architecture GQA transformer on NVIDIA GPUs, in one file.
 *
 * The model, top to bottom (shapes for one micro-batch of N = B*T tokens, C = d_model):
 *   x = embed[tokens]                                                          [N, C]
 *   for each layer:
 *     h    = rmsnorm(x) @ W_qkv^T                  q | k | v heads             [N, (Hq + 2 Hkv) D]
 *     q, k = rope(rmsnorm_per_head(q), rmsnorm_per_head(k))   (Qwen3's QK norm before RoPE)
 *     x    = x + attention(q, k, v) @ W_o^T        causal, KV head j serves query heads jG..jG+G-1
 *     x    = x + (silu(g) * u) @ W_down^T,  [g | u] = rmsnorm(x) @ W_gate_up^T
 *   logits = rmsnorm(x) @ embed^T                  tied output head, never materialized whole
 *   loss   = mean cross-entropy of the next token
 *
 * What lives where: kernels.cuh holds the CUDA kernels, the optimizers' kernels and the one matmul
 * wrapper; lib/matmul_hopper.cuh our own Hopper GEMM, which runs the BF16 gate/up forward with
 * SwiGLU in its epilogue and the down input gradient with SwiGLU's backward in its; lib/fp8.cuh
 * FP8's casts and scales; lib/config.h the ModelConfig and its reading from JSON; data.h the token
 * shards and loader; comm.h data parallelism over NCCL (ranks, collectives, ZeRO's shard
 * arithmetic); ckpt.h the safetensors and checkpoint files; doc/map.md is the map of the whole
 * repository. This file, in reading order: the config; the parameter table, which lays out every
 * tensor in one flat buffer; the activations; the model on the GPU (with FP8 mode); uploading
 * batches; forward; backward (with the hook where a bucket's gradients leave for the other ranks);
 * the optimizer step (AdamW, 8-bit AdamW or Muon, on this rank's pieces); HF export and checkpoints
 * (with ZeRO 1 and 2 every rank writes its optimizer shard); the command line; and the Trainer,
 * whose train_step() is one optimizer step and whose loop main() runs.
 *
 * Precision: bf16 weights and activations for compute (or FP8 for the layers' matmuls with --fp8 1,
 * and the head's with --fp8-head 1), fp32 accumulation everywhere, fp32 master weights (held as
 * the bf16 weights and their low 16 bits: kernels.cuh, master_split) and gradients, the optimizer's
 * state in fp32 (or 8 bits). One convention to know: parameters live in ONE flat buffer (the same
 * layout for the bf16 weights, the master weights' low halves and the gradients; the optimizer's
 * buffers hold this rank's pieces of it), laid out layer by layer, so that each layer's
 * gradients are one contiguous range (a "bucket") that is complete as soon as the backward has left
 * that layer. test_gpt.cu #includes this file with TRAIN_GPT_NO_MAIN defined, so tests run this
 * exact code.
 */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdbool.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <errno.h>
#include <sys/stat.h>
#include <pthread.h>
#include <cuda_fp16.h>
#include "kernels.cuh"
#include "lib/fp8.cuh"
#include "lib/matmul_hopper.cuh"
#include "data.h"
#include "lib/tokenizer.h"
#include "ckpt.h"
#include "lib/config.h"
#include "comm.h"

// ----------------------------------------------------------------------------------------------
// The model's configuration

// ModelConfig, its default and the reading of it from JSON are in lib/config.h (plain C, so that
// the fuzzers run the very code that reads config.json and manifests).

static int qkv_dim(const ModelConfig* c) { return (c->n_head + 2 * c->n_kv_head) * c->head_dim; }

// Says what is wrong with a config, in one line naming the constraint, before anything is
// allocated. The constraints come from the kernels: 16-byte row vectors (multiples of 8), the
// attention kernels (head_dim 64 or 128), shared memory (d_model), uint16 token ids, and GQA's
// grouping.
static bool config_check(const ModelConfig* c, char* err, size_t err_len) {
#define REQUIRE(cond, ...)                          \
    do {                                            \
        if (!(cond)) {                              \
            snprintf(err, err_len, __VA_ARGS__);    \
            return false;                           \
        }                                           \
    } while (0)
    REQUIRE(c->vocab_size > 0 && c->vocab_size <= 65536 && c->vocab_size % 8 == 0,
            "vocab size %d must be a multiple of 8 in [8, 65536] (tokens are uint16)", c->vocab_size);
    REQUIRE(c->d_model > 0 && c->d_model % 8 == 0 && c->d_model <= RMSNORM_MAX_C,
            "d_model %d must be a positive multiple of 8, at most %d (the RMSNorm backward keeps 4 fp32 rows "
            "of d_model in shared memory)", c->d_model, RMSNORM_MAX_C);
    REQUIRE(c->n_layer >= 1 && c->n_layer <= MAX_LAYERS, "n_layer %d must be in [1, %d]", c->n_layer, MAX_LAYERS);
    REQUIRE(c->n_head >= 1 && c->n_kv_head >= 1, "n_head %d and n_kv_head %d must be positive", c->n_head,
            c->n_kv_head);
    REQUIRE(c->n_head % c->n_kv_head == 0, "n_head %d must be a multiple of n_kv_head %d (GQA groups)", c->n_head,
            c->n_kv_head);
    REQUIRE(c->head_dim == 64 || c->head_dim == 128, "head_dim %d must be 64 or 128 (the attention kernels)",
            c->head_dim);
    REQUIRE(c->ffn_dim > 0 && c->ffn_dim % 8 == 0, "ffn_dim %d must be a positive multiple of 8", c->ffn_dim);
    REQUIRE(c->seq_len >= 1 && c->seq_len <= 131072, "seq_len %d must be in [1, 131072]", c->seq_len);
    REQUIRE(c->rope_theta > 0.0f, "rope_theta %g must be positive", c->rope_theta);
    REQUIRE(c->norm_eps > 0.0f && c->norm_eps < 1.0f, "norm_eps %g must be in (0, 1)", c->norm_eps);
#undef REQUIRE
    return true;
}

// ----------------------------------------------------------------------------------------------
// Data parallelism: who this process is among the ranks of a run (comm.h holds the NCCL side).
//
// Each rank holds the whole model in bf16 and runs its own micro-batches; the ranks' gradients are
// summed bucket by bucket (see the parameter table) as the backward completes them, on comm.h's
// stream, while the backward goes on. --zero says what else a rank holds in full:
//   0: everything: fp32 master weights, gradients and the optimizer's state. Each bucket is
//      all-reduced at the last micro-batch, and every rank runs the same update over everything.
//   1: the gradients, but the master weights and optimizer state only of its piece of each
//      bucket (a 1/W share). At the last micro-batch each bucket is reduce-scattered into the rank's piece;
//      the optimizer updates the pieces; the bf16 pieces are all-gathered into every rank's model.
//   2: the gradients only in pieces too. Every micro-batch reduce-scatters each bucket and adds it
//      into the piece; a layer's full-size gradients live only in a ring of two bucket buffers.
// Every bucket is padded to a multiple of W * PARAM_ALIGN elements, so its pieces are equal (as
// NCCL's reduce-scatter needs) and aligned. doc/data_parallel.md has what each mode holds and sends.

typedef struct {
    int rank, world, zero;
    Comm* comm;  // NULL: one GPU, ZeRO 0
} Sharding;

static const Sharding ONE_GPU = {0, 1, 0, NULL};

// ----------------------------------------------------------------------------------------------
// The parameter table: every tensor has a named entry with its shape, its place in the flat buffer
// and whether it decays. Nothing else in the program knows where a tensor lives.
//
// The layout is layer-major: layer 0's tensors, then layer 1's, ..., then the tensors outside the
// layers (the embedding and the final norm). So the backward, which walks down the layers,
// completes one contiguous range of the gradient buffer at a time. These ranges are the buckets:
// bucket l < L is layer l, bucket L is the embedding and the final norm (whose gradients are
// complete only when the backward reaches the embedding). comm.h sends a bucket as soon as it is
// complete, while the backward goes on.

typedef enum {
    // per layer, in the order they are laid out
    P_QKV, P_ATTN_OUT, P_GATE_UP, P_DOWN, P_ATTN_NORM, P_Q_NORM, P_K_NORM, P_MLP_NORM,
    // outside the layers
    P_EMBED, P_FINAL_NORM,
    N_PARAM_KINDS
} ParamKind;

#define N_LAYER_KINDS P_EMBED  // the kinds before P_EMBED repeat in every layer

typedef struct {
    const char* name;
    bool decay;   // AdamW's weight decay applies (matrices yes, norm weights no)
    bool hidden;  // a layer's matrix: --optimizer muon updates it (the embedding/head is AdamW's)
} ParamKindInfo;

static const ParamKindInfo PARAM_KINDS[N_PARAM_KINDS] = {
    {"qkv", true, true},      {"attn_out", true, true}, {"gate_up", true, true},    {"down", true, true},
    {"attn_norm", false, false}, {"q_norm", false, false}, {"k_norm", false, false}, {"mlp_norm", false, false},
    {"embed", true, false},   {"final_norm", false, false},
};

#define PARAM_NAME_MAX 48

typedef struct {
    ParamKind kind;
    int layer;          // -1 for tensors outside the layers
    int64_t rows, cols; // a norm weight is 1 x n
    size_t offset;      // in elements, into the flat buffers; a multiple of PARAM_ALIGN
    bool decay;
    char name[PARAM_NAME_MAX];  // e.g. "layers.3.qkv"
} ParamTensor;

typedef struct {
    ParamTensor* tensors;      // in layout order
    int n_tensors;
    int n_layers;
    size_t* bucket_offset;     // [L + 2]: bucket b is [bucket_offset[b], bucket_offset[b + 1]), a multiple
                               // of world * PARAM_ALIGN elements long
    size_t* bucket_used;       // [L + 1]: its first bucket_used[b] elements hold tensors, the rest is the
                               // padding to that multiple (the same for every world size)
    size_t n_elements;         // length of the flat buffers, padding included
} ParamTable;

// Every tensor starts on a PARAM_ALIGN-element boundary (256 bytes of the bf16 buffer, cuBLASLt's
// preferred alignment; kernels.cuh's AdamW reads one decay flag per PARAM_ALIGN elements); the
// padding between tensors is zero in every buffer and stays zero.

static void param_shape(const ModelConfig* c, ParamKind kind, int64_t* rows, int64_t* cols) {
    int64_t C = c->d_model, D = c->head_dim;
    switch (kind) {
    case P_EMBED: *rows = c->vocab_size; *cols = C; break;
    case P_QKV: *rows = qkv_dim(c); *cols = C; break;
    case P_ATTN_OUT: *rows = C; *cols = c->n_head * D; break;
    case P_GATE_UP: *rows = 2 * (int64_t)c->ffn_dim; *cols = C; break;
    case P_DOWN: *rows = C; *cols = c->ffn_dim; break;
    case P_Q_NORM: case P_K_NORM: *rows = 1; *cols = D; break;
    default: *rows = 1; *cols = C; break;  // the d_model-wide norms
    }
}

static void param_add(ParamTable* pt, const ModelConfig* c, ParamKind kind, int layer, size_t* offset) {
    ParamTensor* t = &pt->tensors[pt->n_tensors++];
    t->kind = kind;
    t->layer = layer;
    t->decay = PARAM_KINDS[kind].decay;
    param_shape(c, kind, &t->rows, &t->cols);
    t->offset = *offset;
    if (layer >= 0) snprintf(t->name, sizeof(t->name), "layers.%d.%s", layer, PARAM_KINDS[kind].name);
    else snprintf(t->name, sizeof(t->name), "%s", PARAM_KINDS[kind].name);
    *offset += ((size_t)(t->rows * t->cols) + PARAM_ALIGN - 1) / PARAM_ALIGN * PARAM_ALIGN;
}

// A bucket of `used` elements cut into n_shards pieces the way comm.h cuts every collective's
// buffer: equal, PARAM_ALIGN-aligned pieces, the last padded. The parameter table pads each bucket
// to comm_padded_len of this split, so ZeRO's pieces, the checkpoint's shards and the resharding
// plan all come from this one piece of arithmetic.
static CommShards bucket_split(size_t used, int n_shards) {
    CommShards shards;
    char err[256];
    if (comm_shards_init(&shards, used, n_shards, PARAM_ALIGN, err, sizeof(err)) != 0) die("%s", err);
    return shards;
}

// Pads a bucket that ends at *offset to a multiple of world * PARAM_ALIGN elements.
static void bucket_pad(size_t* offset, size_t bucket_start, int world) {
    CommShards shards = bucket_split(*offset - bucket_start, world);
    *offset = bucket_start + comm_padded_len(&shards);
}

static void param_table_build(ParamTable* pt, const ModelConfig* c, int world) {
    int L = c->n_layer;
    pt->n_layers = L;
    pt->n_tensors = 0;
    pt->tensors = (ParamTensor*)calloc((size_t)L * N_LAYER_KINDS + 2, sizeof(ParamTensor));
    pt->bucket_offset = (size_t*)calloc(L + 2, sizeof(size_t));
    pt->bucket_used = (size_t*)calloc(L + 1, sizeof(size_t));
    size_t offset = 0;
    for (int l = 0; l < L; l++) {
        pt->bucket_offset[l] = offset;
        for (int k = 0; k < N_LAYER_KINDS; k++) param_add(pt, c, (ParamKind)k, l, &offset);
        pt->bucket_used[l] = offset - pt->bucket_offset[l];
        bucket_pad(&offset, pt->bucket_offset[l], world);
    }
    pt->bucket_offset[L] = offset;
    param_add(pt, c, P_EMBED, -1, &offset);
    param_add(pt, c, P_FINAL_NORM, -1, &offset);
    pt->bucket_used[L] = offset - pt->bucket_offset[L];
    bucket_pad(&offset, pt->bucket_offset[L], world);
    pt->bucket_offset[L + 1] = offset;
    pt->n_elements = offset;
}

static void param_table_free(ParamTable* pt) {
    free(pt->tensors);
    free(pt->bucket_offset);
    free(pt->bucket_used);
}

static const ParamTensor* param(const ParamTable* pt, ParamKind kind, int layer) {
    if (kind == P_EMBED) return &pt->tensors[pt->n_tensors - 2];
    if (kind == P_FINAL_NORM) return &pt->tensors[pt->n_tensors - 1];
    return &pt->tensors[layer * N_LAYER_KINDS + kind];
}

static size_t bucket_len(const ParamTable* pt, int b) { return pt->bucket_offset[b + 1] - pt->bucket_offset[b]; }

static size_t param_count(const ParamTable* pt) {  // without padding
    size_t n = 0;
    for (int i = 0; i < pt->n_tensors; i++) n += (size_t)(pt->tensors[i].rows * pt->tensors[i].cols);
    return n;
}

// Muon orthogonalizes each linear map on its own: the fused matrices are row blocks of separate
// maps (qkv: q, k, v; gate_up: gate, up). Fills the blocks' row counts; returns how many (0: the
// tensor is not a hidden matrix, AdamW updates it).
static int muon_blocks(const ModelConfig* c, const ParamTensor* t, int64_t rows[3]) {
    if (!PARAM_KINDS[t->kind].hidden) return 0;
    if (t->kind == P_QKV) {
        rows[0] = (int64_t)c->n_head * c->head_dim;
        rows[1] = rows[2] = (int64_t)c->n_kv_head * c->head_dim;
        return 3;
    }
    if (t->kind == P_GATE_UP) {
        rows[0] = rows[1] = c->ffn_dim;
        return 2;
    }
    rows[0] = t->rows;
    return 1;
}

// The optimizer's view of the tensors: one flag byte per PARAM_ALIGN elements of the flat buffer
// (host array of n_elements / PARAM_ALIGN bytes): PARAM_FLAG_DECAY where weight decay applies, and
// with `muon` PARAM_FLAG_MUON on the hidden matrices, which Muon updates instead of AdamW. Padding
// has no flag.
static uint8_t* param_flags(const ParamTable* pt, const ModelConfig* c, bool muon) {
    uint8_t* flags = (uint8_t*)calloc(pt->n_elements / PARAM_ALIGN, 1);
    for (int i = 0; i < pt->n_tensors; i++) {
        const ParamTensor* t = &pt->tensors[i];
        size_t blocks = ((size_t)(t->rows * t->cols) + PARAM_ALIGN - 1) / PARAM_ALIGN;
        int64_t rows[3];
        int flag = (t->decay ? PARAM_FLAG_DECAY : 0) | (muon && muon_blocks(c, t, rows) ? PARAM_FLAG_MUON : 0);
        memset(flags + t->offset / PARAM_ALIGN, flag, blocks);
    }
    return flags;
}

// FLOPs per token of one training step (forward + backward), as the PyTorch baseline we measure
// against counts them: 6 per matmul weight (2 forward, 4 backward; the tied embedding counted
// once, as the output head; the lookup is no matmul) plus attention's two T x T products counted
// in full (12 L Hq D T), ignoring the causal mask, as PaLM and nanoGPT do. Norms, RoPE, softmax
// and the optimizer are not counted.
static double flops_per_token(const ModelConfig* c) {
    double C = c->d_model, Dq = (double)c->n_head * c->head_dim, Dkv = (double)c->n_kv_head * c->head_dim;
    double per_layer = C * Dq + 2 * C * Dkv + Dq * C + 3 * C * c->ffn_dim;
    double matmul_weights = c->n_layer * per_layer + (double)c->vocab_size * C;
    return 6 * matmul_weights + 12.0 * c->n_layer * Dq * c->seq_len;
}

// ----------------------------------------------------------------------------------------------
// Activations: what the forward keeps for the backward, per layer, and the backward's scratch.
// Recomputation is per layer: in the first k layers (--recompute: k = 0, k = L, or with `auto` the
// fewest that fit) the cheap elementwise outputs (both RMSNorm outputs, the normed and rotated
// q/k/v, the SwiGLU output) are not kept: those k layers write one shared set of buffers, and the
// backward makes them again before it needs them: the QK norm by running again, in BF16 the rest
// inside kernels the backward runs anyway (remakes_norms). The other L - k layers keep their own.
// The shared set is one layer's worth, so k = 1 saves nothing and each layer recomputed beyond the
// first saves one layer's set: 2 (2 N C + N (Hq+2Hkv) D + N F) bytes. With FP8's delayed scaling
// every layer shares the norms' and SwiGLU's outputs, whatever k (layers_sharing_norms), and a
// recomputed layer saves only its 2 N (Hq+2Hkv) D bytes of q/k/v.

// In the backward each norm leaves its weight gradient as partial sums (a row per block) in a slot
// of its own, and one launch a layer adds them all up (sum_partials_flush) rather than one a norm:
// the final norm's (with the last layer's), and a layer's MLP norm, QK norm and attention norm. The
// slots lie after attention's scratch, in the region the head's logits leave free in the backward.
enum NormSlot { SLOT_FINAL_NORM, SLOT_MLP_NORM, SLOT_QK_NORM, SLOT_ATTN_NORM, NORM_SLOTS };

typedef struct {
    // kept by the forward
    bf16* residual[MAX_LAYERS + 1];   // [N, C] residual stream entering layer l; [L] enters the final norm
    bf16* residual_mid[MAX_LAYERS];   // [N, C] after the attention block of layer l
    float* rstd_attn[MAX_LAYERS];     // [N]
    float* rstd_mlp[MAX_LAYERS];      // [N]
    float* rstd_qk[MAX_LAYERS];       // [N, Hq + Hkv]
    bf16* xnorm_attn[MAX_LAYERS];     // [N, C]            (shared by the recomputed layers)
    bf16* qkv[MAX_LAYERS];            // [N, (Hq+2Hkv) D]  the projection's output, before the norms
    bf16* qkv_rot[MAX_LAYERS];        // [N, (Hq+2Hkv) D]  normed and rotated q, k (shared, as above; v: qkv's)
    bf16* attn_out[MAX_LAYERS];       // [N, Hq D]
    float* lse[MAX_LAYERS];           // [B, Hq, T]        attention's logsumexp per query row
    bf16* xnorm_mlp[MAX_LAYERS];      // [N, C]            (shared, as above)
    bf16* gate_up[MAX_LAYERS];        // [N, 2F]
    bf16* mlp_act[MAX_LAYERS];        // [N, F]            (shared, as above)
    float* rstd_final;                // [N]
    bf16* xnorm_final;                // [N, C]
    bf16* logits;                     // [R, V]  a chunk of the output head's rows } one region: the head is
    float* attn_scratch;              // attention_backward's scratch               } done before the layers,
    float* norm_partials;             // [NORM_SLOTS][norm_slot] after it: NormSlot } which share the rest
    size_t norm_slot;                 // the floats of one norm's slot
    float* losses;                    // [N]     per-token loss
    // the backward's scratch, reused by every layer
    bf16* d_residual;                 // [N, C]  dL/d(residual stream), updated in place layer by layer
    bf16* d_xnorm;                    // [N, C]  dL/d(a norm's output)
    bf16* d_mlp_act;                  // [N, F]  (NULL where never stored: stores_d_mlp_act)
    bf16* d_gate_up;                  // [N, 2F]          } one region: the MLP's backward is done
    bf16* d_attn_out;                 // [N, Hq D]        } before the attention's begins
    bf16* d_qkv;                      // [N, (Hq+2Hkv) D] }
    // the BF16 head's scratch for one chunk of R rows (head_chunk_fused), in the same region: the
    // head is done before the MLP's backward begins
    float* head_shift;                // [R]     each row's target logit
    float* head_target_z;             // [R]     the target's logit less the shift (the product's epilogue)
    int* head_overflow;               // [R]     rows whose logits the epilogue could not take
    float* head_scale;                // [R]     d_loss / the row's sum of exponentials
    float* head_partials;             // [R, hopper_logits_tiles(V)]  the sums of exponentials per tile of the product
    bf16* head_x_scaled;              // [R, C]  x scaled by head_scale, the weight gradient's operand
    float* head_dx;                   // [R, C]  the input gradient's product before head_scale, fp32
    float* partials;                  // [REDUCE_BLOCKS] reduce_sum's partials (the loss, the gradient
                                      // norm, Muon's norms)
} Activations;

static float* norm_partials(const Activations* a, NormSlot slot) { return a->norm_partials + slot * a->norm_slot; }

// One micro-batch as it is uploaded: the inputs and targets, and the positions sorted by token for
// the deterministic embedding backward (see embedding_backward in kernels.cuh). The token groups
// are the embedding backward's "buckets" (not to be confused with the gradient buckets above).
typedef struct {
    int* inputs;         // [N]
    int* targets;        // [N]
    int* bucket_pos;     // [N]      positions grouped by token, increasing within a group
    int* bucket_token;   // [N]      the token of each group (first n_buckets entries)
    int* bucket_start;   // [N + 1]  group u is bucket_pos[bucket_start[u] .. bucket_start[u+1])
    int* n_buckets;      // [1]      how many groups
} Batch;

// The ints of one uploaded micro-batch, in the order of Batch's fields.
static size_t batch_ints(int N) { return 5 * (size_t)N + 2; }

static Batch batch_layout(int* base, int N) {
    Batch b;
    b.inputs = base;
    b.targets = base + N;
    b.bucket_pos = base + 2 * (size_t)N;
    b.bucket_token = base + 3 * (size_t)N;
    b.bucket_start = base + 4 * (size_t)N;
    b.n_buckets = base + 5 * (size_t)N + 1;
    return b;
}

// ----------------------------------------------------------------------------------------------
// The model on the GPU

struct GPT;
// Called by backward() on the model's stream as soon as gradient bucket `bucket` is complete for
// this micro-batch (layers L-1 down to 0, then bucket L); comm.h sends it from here.
typedef void (*GradsReadyHook)(void* ctx, const struct GPT* m, int bucket);

// FP8 mode (--fp8 1, lib/fp8.cuh): the four matrices of every layer multiply in FP8, and with
// --fp8-head 1 the output head too (its matrix is the tied embedding E [V, C]). Each matrix has
// three scaled tensors, its weight, its input activation and the gradient of its output, so a
// layer has FP8_ROLES x 4 scales and the head FP8_ROLES more (fp8_scale_index). The FP8 weights
// (and their transposes, for the input gradient) sit at the parameter table's offsets; the casts
// of activations and gradients go through scratch buffers that every layer (and the head's
// chunks) reuse.
typedef enum { FP8_ROLE_WEIGHT, FP8_ROLE_INPUT, FP8_ROLE_GRAD, FP8_ROLES } Fp8Role;
#define FP8_MATRICES 4  // P_QKV, P_ATTN_OUT, P_GATE_UP, P_DOWN: the layer kinds that are matrices
static const char* const FP8_ROLE_NAMES[FP8_ROLES] = {"W", "x", "dy"};

typedef struct {
    bool on;
    Fp8Scaling scaling;
    bool head;              // --fp8-head: the output head's products in FP8 too
    bool fast_accum;        // --fp8-fast-accum: the forward products accumulate without promotion
    bool calibrated;        // delayed: a step has filled the history (before that, casts measure)
    bool weights_stale;     // the bf16 weights changed since they were last cast (fp8_cast_weights); not
                            // after a step whose AdamW made the FP8 weights itself (fp8_weights_by_adamw)
    bool fuse;              // cast where the data is produced when the scales allow it (fp8_fused);
                            // on by default, off in the tests that compare the two paths
    bool fuse_weights;      // AdamW makes the FP8 weights when it can (fp8_weights_by_adamw); on by
                            // default, off in the tests that compare with the forward's cast
    Fp8Scale* scales;       // [fp8_n_scales]: the layers' (layer, role, kind), then the head's (role)
    Fp8Scale* scales_saved; // the same, and weights_stale, kept while an evaluation runs (fp8_eval)
    bool stale_saved;
    uint8_t* weights;       // [n_elements] E4M3 W [O, I] of each matrix (E [V, C] too), at its table offset
    uint8_t* weights_t;     // [n_elements] E4M3 W^T [I, O]
    uint8_t* x;             // [N, widest input]   E4M3 input of the forward's product
    uint8_t* x_t;           // [widest input, N]   E4M3 input, transposed, for the weight gradient
    uint8_t* dy;            // [N, widest output]  E5M2 output gradient, for the input gradient (the head:
                            //                     [R, V], a chunk's dlogits, where that is larger)
    uint8_t* dy_t;          // [widest output, N]  and transposed, for the weight gradient
    void* memory;           // the one allocation all of the above are carved from
    size_t bytes;
} GptFp8;

// FP8 mode as the command line asks for it (--fp8 and its flags), for gpt_plan; on = false: bf16.
typedef struct {
    bool on;
    Fp8Scaling scaling;
    bool head, fast_accum;
} Fp8Mode;

// An optimizer's state as tensors over the optimizer's buffers (opt_len elements): each holds one
// element of `bytes` bytes per `per` parameters (1, or one scale per Q8_BLOCK). They lie one after
// the other in one allocation, and a checkpoint stores each bucket's piece of each as
// "<name>.<bucket>". AdamW and Muon: exp_avg (Muon: the hidden matrices' momentum; AdamW's m
// elsewhere) and exp_avg_sq (unused by Muon's matrices); 8-bit AdamW: the codes and the per-block
// scales of m and of sqrt(v).
typedef struct {
    const char* name;
    StDtype dtype;
    int bytes, per;
} OptStateTensor;
#define MAX_OPT_STATE_TENSORS 4

// Each layout's tensors by name (opt_part's i), in the order of its table below: AdamW's and
// Muon's; 8-bit AdamW's, the codes and per-block absmax of m and of r = sqrt(v).
enum { OPT_EXP_AVG, OPT_EXP_AVG_SQ, N_OPT_FP32 };
enum { OPT_Q8_M, OPT_Q8_M_ABSMAX, OPT_Q8_R, OPT_Q8_R_ABSMAX, N_OPT_Q8 };

static int optimizer_state_tensors(OptimizerKind kind, const OptStateTensor** out) {
    static const OptStateTensor fp32[] = {{"exp_avg", ST_F32, 4, 1}, {"exp_avg_sq", ST_F32, 4, 1}};
    static const OptStateTensor q8[] = {{"exp_avg_q8", ST_U8, 1, 1}, {"exp_avg_absmax", ST_F32, 4, Q8_BLOCK},
                                        {"exp_avg_sq_root_q8", ST_U8, 1, 1}, {"exp_avg_sq_root_absmax", ST_F32, 4, Q8_BLOCK}};
    static_assert(sizeof(fp32) / sizeof(fp32[0]) == N_OPT_FP32 && sizeof(q8) / sizeof(q8[0]) == N_OPT_Q8,
                  "a state table and its names disagree");
    static_assert(N_OPT_Q8 <= MAX_OPT_STATE_TENSORS, "");
    if (kind == OPTIMIZER_ADAMW8BIT) {
        *out = q8;
        return N_OPT_Q8;
    }
    *out = fp32;
    return N_OPT_FP32;
}

typedef struct GPT {
    ModelConfig cfg;
    ParamTable table;
    int B, T, N;            // micro-batch shape, N = B * T
    int loss_chunk;         // R: rows of the output head processed at once
    int recompute_layers;   // k: layers 0 .. k-1 share the recomputable buffers and recompute them
    bool deterministic;     // attention backward: dQ sums in a fixed order (bitwise reproducible)
    Sharding dp;            // this rank among the data-parallel ranks
    // The flat buffers: bf16 weights and (ZeRO 0, 1) gradients are table.n_elements long; the
    // optimizer's buffers are opt_len long: everything (ZeRO 0) or this rank's pieces of the
    // buckets, one after the other (ZeRO 1, 2).
    bf16* params;           // bf16 weights used by forward and backward: the master weights' high halves
    float* grads;           // fp32, accumulated over micro-batches (NULL with ZeRO 2)
    size_t opt_len;
    size_t* opt_offset;     // [L + 1] where bucket b's owned part starts in the optimizer's buffers
    int16_t* master_low;    // the fp32 master weights' low halves (master_join), updated by the optimizer
    OptimizerKind optimizer;
    const OptStateTensor* opt_tensors;  // the optimizer's state tensors (optimizer_state_tensors)
    int n_opt_tensors;
    size_t opt_state_offset[MAX_OPT_STATE_TENSORS];  // bytes: where each starts in opt_state
    size_t opt_state_bytes;
    void* opt_state;        // the optimizer's state, one allocation (opt_part finds a tensor's element)
    uint8_t* decay_flags;   // [opt_len / PARAM_ALIGN] PARAM_FLAG_DECAY and PARAM_FLAG_MUON per block
    MuonScratch muon;       // --optimizer muon: Newton-Schulz's buffers, for the largest matrix
    void* muon_memory;
    float* grad_shard;      // [opt_len] the reduced gradients of the owned pieces (ZeRO 1, 2)
    float* grad_bucket[MAX_LAYERS + 1];  // where bucket b's gradients are written this micro-batch
    float* grad_ring[2];    // ZeRO 2: layer l's gradients in ring[l % 2], bucket L's in grad_tail
    float* grad_tail;
    float* rs_scratch;      // ZeRO 2: a reduce-scatter's output before it is added to grad_shard (one
                            // bucket's piece; used from the second micro-batch of a step on)
    cudaEvent_t ring_free[3];  // ZeRO 2: ring[i]'s (and, [2], grad_tail's) last reduce-scatter is done
    cudaEvent_t params_ready[MAX_LAYERS + 1];  // ZeRO 1, 2: bucket b's bf16 weights have arrived
    int micro, accum;       // the micro-batch being run, of how many this step
    OptimScalars* scalars;  // the step's scalars (step, lr, loss, gradient norm), on the device
    Activations act;
    float* rope_cos;        // [T, D/2]
    float* rope_sin;
    void* activation_memory;  // the two allocations the Activations are carved from
    void* scratch_memory;
    cudaStream_t stream;
    GradsReadyHook grads_ready;  // NULL on one GPU
    void* grads_ready_ctx;
    size_t bytes_params, bytes_grads, bytes_optimizer, bytes_activations, bytes_scratch;
    GptFp8 fp8;
} GPT;

// A rank's piece of bucket b (ZeRO 1, 2): the bucket is bucket_split's padded length, so len / world
// is that split's piece, padding included.
static size_t bucket_piece(const GPT* m, int b) { return bucket_len(&m->table, b) / m->dp.world; }

// The elements of bucket b this rank's optimizer owns: all of it (ZeRO 0), or its piece.
static void owned_part(const GPT* m, int b, size_t* begin, size_t* end) {
    size_t start = m->table.bucket_offset[b];
    if (m->dp.zero == 0) {
        *begin = start, *end = start + bucket_len(&m->table, b);
    } else {
        size_t piece = bucket_piece(m, b);
        *begin = start + m->dp.rank * piece, *end = *begin + piece;
    }
}

static int bucket_of(const ParamTensor* t, int n_layers) { return t->layer >= 0 ? t->layer : n_layers; }

static bf16* P(const GPT* m, ParamKind kind, int layer) { return m->params + param(&m->table, kind, layer)->offset; }
static float* G(const GPT* m, ParamKind kind, int layer) {
    const ParamTensor* t = param(&m->table, kind, layer);
    int b = bucket_of(t, m->table.n_layers);
    return m->grad_bucket[b] + (t->offset - m->table.bucket_offset[b]);
}

// Where optimizer element `at` (of this rank's optimizer buffers) of state tensor i lies in `base`,
// a copy of opt_state (on the device, or a host snapshot of it).
static void* opt_part(const GPT* m, const void* base, int i, size_t at) {
    const OptStateTensor* t = &m->opt_tensors[i];
    return (char*)base + m->opt_state_offset[i] + at / t->per * t->bytes;
}

// A bump allocator over one cudaMalloc: every carve is 256-byte aligned.
typedef struct {
    char* base;
    size_t used, size;
} Arena;

static void* arena_take(Arena* a, size_t bytes) {
    size_t start = (a->used + 255) / 256 * 256;
    a->used = start + bytes;
    return a->base ? (void*)(a->base + start) : NULL;  // base == NULL: only measuring
}

// Whether the MLP's backward stores d_mlp_act [N, F]: in BF16 our GEMM runs SwiGLU's backward in the
// down input gradient's epilogue (down_swiglu_fused) and never stores it, wherever the shapes allow
// (the arenas align every operand to 256 bytes); FP8's products, and shapes it refuses, store it.
static bool stores_d_mlp_act(const ModelConfig* c, int N, bool fp8) {
    return fp8 || hopper_operands_problem(N, c->d_model, c->ffn_dim, {}) != NULL;
}

// The BF16 head's scratch for a chunk of R rows (Activations), carved from `region`.
static void head_scratch_layout(Activations* a, Arena* region, size_t R, size_t C, size_t V) {
    a->head_shift = (float*)arena_take(region, R * 4);
    a->head_target_z = (float*)arena_take(region, R * 4);
    a->head_overflow = (int*)arena_take(region, R * 4);
    a->head_scale = (float*)arena_take(region, R * 4);
    a->head_partials = (float*)arena_take(region, R * hopper_logits_tiles((int)V) * 4);
    a->head_x_scaled = (bf16*)arena_take(region, R * C * 2);
    a->head_dx = (float*)arena_take(region, R * C * 4);
}

// Lays out (or, with a->base == NULL, just measures) the activations and scratch; layers
// 0 .. recompute_layers-1 share one qkv_rot, layers 0 .. norm_layers-1 (norm_layers >=
// recompute_layers) one set of the norms' and SwiGLU's outputs; d_mlp_act only where it is stored.
static void activations_layout(Activations* a, Arena* kept, Arena* scratch, const ModelConfig* c, int B, int T,
                               int loss_chunk, int recompute_layers, int norm_layers, bool d_mlp_act) {
    size_t N = (size_t)B * T, C = c->d_model, F = c->ffn_dim, Q = qkv_dim(c), A = (size_t)c->n_head * c->head_dim;
    size_t heads = (size_t)B * c->n_head * T;
    int L = c->n_layer;
    bf16 *xnorm_attn = NULL, *qkv_rot = NULL, *xnorm_mlp = NULL, *mlp_act = NULL;
    if (norm_layers > 0) {
        xnorm_attn = (bf16*)arena_take(kept, N * C * 2);
        xnorm_mlp = (bf16*)arena_take(kept, N * C * 2);
        mlp_act = (bf16*)arena_take(kept, N * F * 2);
    }
    if (recompute_layers > 0) qkv_rot = (bf16*)arena_take(kept, N * Q * 2);
    for (int l = 0; l <= L; l++) a->residual[l] = (bf16*)arena_take(kept, N * C * 2);
    for (int l = 0; l < L; l++) {
        a->residual_mid[l] = (bf16*)arena_take(kept, N * C * 2);
        a->rstd_attn[l] = (float*)arena_take(kept, N * 4);
        a->rstd_mlp[l] = (float*)arena_take(kept, N * 4);
        a->rstd_qk[l] = (float*)arena_take(kept, N * (c->n_head + c->n_kv_head) * 4);
        a->qkv[l] = (bf16*)arena_take(kept, N * Q * 2);
        a->attn_out[l] = (bf16*)arena_take(kept, N * A * 2);
        a->lse[l] = (float*)arena_take(kept, heads * 4);
        a->gate_up[l] = (bf16*)arena_take(kept, N * 2 * F * 2);
        bool shared = l < norm_layers;
        a->xnorm_attn[l] = shared ? xnorm_attn : (bf16*)arena_take(kept, N * C * 2);
        a->qkv_rot[l] = l < recompute_layers ? qkv_rot : (bf16*)arena_take(kept, N * Q * 2);
        a->xnorm_mlp[l] = shared ? xnorm_mlp : (bf16*)arena_take(kept, N * C * 2);
        a->mlp_act[l] = shared ? mlp_act : (bf16*)arena_take(kept, N * F * 2);
    }
    a->rstd_final = (float*)arena_take(kept, N * 4);
    a->xnorm_final = (bf16*)arena_take(kept, N * C * 2);
    a->losses = (float*)arena_take(kept, N * 4);

    size_t rmsnorm_partials = (size_t)ceil_div(N, rmsnorm_bwd_rows(N)) * C;
    size_t qk_partials = qk_norm_rope_backward_partials(N, T, c->n_head, c->n_kv_head, c->head_dim);
    a->norm_slot = ((rmsnorm_partials > qk_partials ? rmsnorm_partials : qk_partials) + 63) / 64 * 64;  // 256 bytes
    size_t logits_bytes = (size_t)loss_chunk * c->vocab_size * 2;
    size_t attn_bytes = (attention_backward_scratch_bytes(B, T, c->n_head, c->head_dim) + 255) / 256 * 256;
    size_t layer_bytes = attn_bytes + NORM_SLOTS * a->norm_slot * 4;
    char* head_or_layer = (char*)arena_take(scratch, logits_bytes > layer_bytes ? logits_bytes : layer_bytes);
    a->logits = (bf16*)head_or_layer;
    a->attn_scratch = (float*)head_or_layer;
    a->norm_partials = head_or_layer ? (float*)(head_or_layer + attn_bytes) : NULL;
    a->d_residual = (bf16*)arena_take(scratch, N * C * 2);
    a->d_xnorm = (bf16*)arena_take(scratch, N * C * 2);
    a->d_mlp_act = d_mlp_act ? (bf16*)arena_take(scratch, N * F * 2) : NULL;
    size_t attn_region = (N * A * 2 + 255) / 256 * 256 + N * Q * 2;
    Arena head = {NULL, 0, 0};
    head_scratch_layout(a, &head, loss_chunk, C, c->vocab_size);  // measures
    size_t region = std::max({attn_region, N * 2 * F * 2, head.used});
    char* shared = (char*)arena_take(scratch, region);
    a->d_gate_up = (bf16*)shared;
    a->d_attn_out = (bf16*)shared;
    a->d_qkv = shared ? (bf16*)(shared + (N * A * 2 + 255) / 256 * 256) : NULL;
    head = {shared, 0, region};
    head_scratch_layout(a, &head, loss_chunk, C, c->vocab_size);
    a->partials = (float*)arena_take(scratch, REDUCE_BLOCKS * 4);
}

// RoPE tables, computed as transformers does (fp32 inverse frequencies, fp32 angles), so that an
// exported model sees the same rotation: angle(t, i) = t * theta^(-2i/D).
static void rope_tables(float* cos_out, float* sin_out, int T, int D, float theta) {
    for (int i = 0; i < D / 2; i++) {
        float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)D);
        for (int t = 0; t < T; t++) {
            float angle = (float)t * inv_freq;
            cos_out[t * (D / 2) + i] = cosf(angle);
            sin_out[t * (D / 2) + i] = sinf(angle);
        }
    }
}

static double gib(size_t bytes) { return bytes / (double)(1ull << 30); }

// The state tensors' places in opt_state (256-byte aligned, one after the other).
static void gpt_plan_optimizer_state(GPT* m) {
    m->n_opt_tensors = optimizer_state_tensors(m->optimizer, &m->opt_tensors);
    size_t at = 0;
    for (int i = 0; i < m->n_opt_tensors; i++) {
        m->opt_state_offset[i] = at;
        at += (m->opt_len / m->opt_tensors[i].per * m->opt_tensors[i].bytes + 255) / 256 * 256;
    }
    m->opt_state_bytes = at;
}

// Muon's scratch for the largest hidden matrix block (elements) and the largest short side, carved
// from `a` (or, with a->base == NULL, measured).
static void muon_scratch_layout(MuonScratch* w, Arena* a, const GPT* m) {
    size_t most = 0, side = 0;
    for (int i = 0; i < m->table.n_tensors; i++) {
        const ParamTensor* t = &m->table.tensors[i];
        int64_t rows[3];
        int n = muon_blocks(&m->cfg, t, rows);
        for (int k = 0; k < n; k++) {
            size_t r = (size_t)rows[k], c = (size_t)t->cols, short_side = r < c ? r : c;
            most = r * c > most ? r * c : most;
            side = short_side > side ? short_side : side;
        }
    }
    w->u = (float*)arena_take(a, most * 4);
    w->x = (bf16*)arena_take(a, most * 2);
    w->y = (bf16*)arena_take(a, most * 2);
    w->a = (bf16*)arena_take(a, side * side * 2);
    w->b = (bf16*)arena_take(a, side * side * 2);
    w->norm_sq = (float*)arena_take(a, 4);
}

// The scales: every layer's FP8_ROLES x FP8_MATRICES, then the output head's FP8_ROLES (there
// whether or not --fp8-head uses them, so that fp8_scales.bin has one layout).
static size_t fp8_n_scales(const ModelConfig* c) { return ((size_t)c->n_layer * FP8_MATRICES + 1) * FP8_ROLES; }

// Where the scale of `role` of matrix `kind` (P_QKV .. P_DOWN of layer l, or P_EMBED: the head) is.
static size_t fp8_scale_index(const ModelConfig* c, Fp8Role role, ParamKind kind, int l) {
    if (kind == P_EMBED) return (size_t)c->n_layer * FP8_MATRICES * FP8_ROLES + role;
    return ((size_t)l * FP8_ROLES + role) * FP8_MATRICES + kind;
}

// Lays out (or, with a->base == NULL, measures) FP8 mode's memory: the scales and their saved
// copy, the E4M3 weights and their transposes, and the casts' scratch, sized by the widest input
// and output of the layers' matrices (and, with the head in FP8, by a chunk's dlogits).
static void fp8_layout(GptFp8* f, Arena* a, const GPT* m) {
    size_t widest_in = 0, widest_out = 0;
    for (int k = 0; k < FP8_MATRICES; k++) {
        const ParamTensor* t = param(&m->table, (ParamKind)k, 0);
        widest_in = (size_t)t->cols > widest_in ? (size_t)t->cols : widest_in;
        widest_out = (size_t)t->rows > widest_out ? (size_t)t->rows : widest_out;
    }
    size_t n_scales = fp8_n_scales(&m->cfg), P = m->table.n_elements, N = m->N;
    size_t dy_bytes = N * widest_out, head_dy_bytes = (size_t)m->loss_chunk * m->cfg.vocab_size;
    if (m->fp8.head && head_dy_bytes > dy_bytes) dy_bytes = head_dy_bytes;  // the head's input, [R, C], fits in x
    f->scales = (Fp8Scale*)arena_take(a, n_scales * sizeof(Fp8Scale));
    f->scales_saved = (Fp8Scale*)arena_take(a, n_scales * sizeof(Fp8Scale));
    f->weights = (uint8_t*)arena_take(a, P);
    f->weights_t = (uint8_t*)arena_take(a, P);
    f->x = (uint8_t*)arena_take(a, N * widest_in);
    f->x_t = (uint8_t*)arena_take(a, N * widest_in);
    f->dy = (uint8_t*)arena_take(a, dy_bytes);
    f->dy_t = (uint8_t*)arena_take(a, dy_bytes);
}

static size_t fp8_bytes(const GPT* m) {
    GptFp8 measured;
    Arena a = {NULL, 0, 0};
    fp8_layout(&measured, &a, m);
    return a.used;
}

// FP8 mode's memory on the GPU (part of gpt_allocate): the weight copies, the casts' scratch, and
// the scales, fresh (1, an empty history) until a checkpoint's replace them.
static void fp8_allocate(GPT* m) {
    GptFp8* f = &m->fp8;
    Arena a = {NULL, 0, f->bytes};
    CUDA_CHECK(cudaMalloc(&a.base, f->bytes));
    f->memory = a.base;
    fp8_layout(f, &a, m);
    size_t n_scales = fp8_n_scales(&m->cfg);
    Fp8Scale* host = (Fp8Scale*)xcalloc(n_scales, sizeof(Fp8Scale));
    for (int r = 0; r < FP8_ROLES; r++) {
        for (int l = 0; l < m->cfg.n_layer; l++)
            for (int k = 0; k < FP8_MATRICES; k++)
                host[fp8_scale_index(&m->cfg, (Fp8Role)r, (ParamKind)k, l)] = fp8_scale_initial(r == FP8_ROLE_GRAD);
        host[fp8_scale_index(&m->cfg, (Fp8Role)r, P_EMBED, 0)] = fp8_scale_initial(r == FP8_ROLE_GRAD);
    }
    CUDA_CHECK(cudaMemcpy(f->scales, host, n_scales * sizeof(Fp8Scale), cudaMemcpyHostToDevice));
    free(host);
}

// How many layers (the first ones) share one set of the norms' and SwiGLU's outputs (xnorm_attn,
// xnorm_mlp, mlp_act) and remake them in the backward: the recomputed layers, or with FP8's delayed
// scaling every layer. There the fused casts make those outputs themselves from the second step on
// (fp8_input), so the backward reads no bf16 copy of them, and a copy per layer would serve only
// the first step, which remakes them instead (the same kernels: the same bits).
static int layers_sharing_norms(const GPT* m) {
    return m->fp8.on && m->fp8.scaling == FP8_DELAYED ? m->cfg.n_layer : m->recompute_layers;
}

static size_t gpt_bytes_total(const GPT* m) {
    return m->bytes_params + m->bytes_grads + m->bytes_optimizer + m->bytes_activations + m->bytes_scratch +
           m->fp8.bytes + CUBLASLT_WORKSPACE_BYTES;
}

// Where each bucket's owned part sits in the optimizer's buffers, and their length.
static void gpt_plan_shards(GPT* m) {
    int L = m->table.n_layers;
    m->opt_offset = (size_t*)xcalloc(L + 1, sizeof(size_t));
    m->opt_len = 0;
    for (int b = 0; b <= L; b++) {
        size_t begin, end;
        owned_part(m, b, &begin, &end);
        m->opt_offset[b] = m->opt_len;
        m->opt_len += end - begin;
    }
}

// The longest of buckets [0, n) (n = L: the layers' buckets; n = L + 1: every bucket).
static size_t largest_bucket(const ParamTable* pt, int n) {
    size_t most = 0;
    for (int b = 0; b < n; b++) most = bucket_len(pt, b) > most ? bucket_len(pt, b) : most;
    return most;
}

// Sizes every buffer from the config and the ZeRO mode, before anything is allocated: weights
// (bf16 everywhere; the fp32 master's low halves only for the owned part), gradients (full, or with
// ZeRO 2 the ring, bucket L and the reduced pieces), the optimizer's state (and Muon's scratch), and
// the activations (measured by laying them out over no memory).
static void gpt_plan_memory(GPT* m) {
    const ParamTable* pt = &m->table;
    size_t P = pt->n_elements, S = m->opt_len, L = pt->n_layers, sharded = m->dp.zero > 0;
    m->bytes_params = P * 2 + S * 2;
    if (m->dp.zero < 2) m->bytes_grads = P * 4 + sharded * S * 4;
    else m->bytes_grads = (2 * largest_bucket(pt, L) + bucket_len(pt, L) + S + largest_bucket(pt, L + 1) / m->dp.world) * 4;
    gpt_plan_optimizer_state(m);
    Arena muon = {NULL, 0, 0};
    if (m->optimizer == OPTIMIZER_MUON) muon_scratch_layout(&m->muon, &muon, m);
    m->bytes_optimizer = m->opt_state_bytes + S / PARAM_ALIGN + muon.used;
    Arena kept = {NULL, 0, 0}, scratch = {NULL, 0, 0};
    activations_layout(&m->act, &kept, &scratch, &m->cfg, m->B, m->T, m->loss_chunk, m->recompute_layers,
                       layers_sharing_norms(m), stores_d_mlp_act(&m->cfg, m->N, m->fp8.on));
    m->bytes_activations = kept.used;
    m->bytes_scratch = scratch.used;
    m->fp8.bytes = m->fp8.on ? fp8_bytes(m) : 0;
}

// Whether the plan, with `headroom` bytes more for what is allocated after it, fits in free_bytes;
// if not, one line in err saying by how much and what to change.
static bool plan_fits(const GPT* m, size_t free_bytes, size_t headroom, char* err, size_t err_len) {
    size_t need = gpt_bytes_total(m) + headroom;
    if (need <= free_bytes) return true;
    char kept_free[96] = "";
    if (headroom)
        snprintf(kept_free, sizeof(kept_free), ", %.2f kept free for what is allocated after it", gib(headroom));
    snprintf(err, err_len, "this config needs %.2f GiB of GPU memory (activations %.2f with %d of %d layers "
             "recomputed%s) but %.2f GiB are free for it; lower --batch%s%s", gib(need), gib(m->bytes_activations),
             m->recompute_layers, m->cfg.n_layer, kept_free, gib(free_bytes),
             m->recompute_layers < m->cfg.n_layer ? ", or use --recompute auto or 1" : "",
             m->dp.world > 1 ? ", or a higher --zero" : "");
    return false;
}

// Exits with one line if the plan does not fit in the GPU's free memory.
static void gpt_check_fits(const GPT* m) {
    size_t free_bytes, total_bytes;
    char err[512];
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (!plan_fits(m, free_bytes, 0, err, sizeof(err))) die("%s", err);
}

// What --recompute auto keeps free beyond the plan: what no plan counts. The kernels' modules load
// at their first launch (lazy loading), NCCL connects its channels and allocates their buffers at
// the first collective of each kind, cudaMalloc rounds every allocation up to its page, and the
// uploader's buffers and the RoPE tables are not in the plan. A guess to be measured
// (doc/perf.md); 1 GiB is 1.3% of an H100.
#define RECOMPUTE_MARGIN_BYTES (1ull << 30)

// --recompute auto: the fewest recomputed layers k whose plan, with `headroom` bytes kept free for
// what is allocated after it, fits in free_bytes. A function of the plan and the bytes only (the
// tests call it without a GPU): it plans m at k = 0, 1, ... (memory falls as k grows, so the first
// k that fits is the fewest) and leaves m planned at the k it returns; -1, with plan_fits's line in
// err, when even k = L does not fit.
static int recompute_layers_that_fit(GPT* m, size_t free_bytes, size_t headroom, char* err, size_t err_len) {
    for (int k = 0; k <= m->cfg.n_layer; k++) {
        m->recompute_layers = k;
        gpt_plan_memory(m);
        if (plan_fits(m, free_bytes, headroom, err, err_len)) return k;
    }
    return -1;
}

// --max-memory: the most bytes a plan may take (limit; 0: no limit). Whether m's plan keeps to it;
// if not, one line in err, naming what the plan holds and what would lower it.
static bool plan_within_limit(const GPT* m, size_t limit, char* err, size_t err_len) {
    if (limit == 0 || gpt_bytes_total(m) <= limit) return true;
    snprintf(err, err_len, "--max-memory %.2f GiB: this config plans %.2f GiB (activations %.2f with %d of %d layers "
             "recomputed); lower --batch%s", gib(limit), gib(gpt_bytes_total(m)), gib(m->bytes_activations),
             m->recompute_layers, m->cfg.n_layer,
             m->recompute_layers < m->cfg.n_layer ? ", or use --recompute auto or 1" : "");
    return false;
}

// --recompute auto's room: the GPU's free bytes, or with a --max-memory limit at most the limit
// plus the margin recompute_layers_that_fit keeps free, so that the plan it picks takes at most
// the limit.
static size_t recompute_room(size_t free_bytes, size_t limit) {
    return limit && limit + RECOMPUTE_MARGIN_BYTES < free_bytes ? limit + RECOMPUTE_MARGIN_BYTES : free_bytes;
}

// The optimizer's flags for its buffers: the table's (param_flags; Muon's matrices are whole here,
// since Muon runs only with ZeRO 0), for the owned parts.
static void gpt_upload_decay_flags(GPT* m) {
    uint8_t* full = param_flags(&m->table, &m->cfg, m->optimizer == OPTIMIZER_MUON);
    uint8_t* owned = (uint8_t*)xcalloc(m->opt_len / PARAM_ALIGN, 1);
    for (int b = 0; b <= m->table.n_layers; b++) {
        size_t begin, end;
        owned_part(m, b, &begin, &end);
        memcpy(owned + m->opt_offset[b] / PARAM_ALIGN, full + begin / PARAM_ALIGN, (end - begin) / PARAM_ALIGN);
    }
    CUDA_CHECK(cudaMalloc(&m->decay_flags, m->opt_len / PARAM_ALIGN));
    CUDA_CHECK(cudaMemcpy(m->decay_flags, owned, m->opt_len / PARAM_ALIGN, cudaMemcpyHostToDevice));
    free(full);
    free(owned);
}

// The gradient buffers, and where each bucket's gradients are written: in place in the full
// buffer (ZeRO 0, 1), or in the ring and grad_tail (ZeRO 2). Zeroed once here, for the padding
// between tensors: no kernel writes it, and the norm and the optimizer read it (grads_accumulate).
static void gpt_allocate_grads(GPT* m) {
    const ParamTable* pt = &m->table;
    int L = pt->n_layers;
    if (m->dp.zero > 0) CUDA_CHECK(cudaMalloc(&m->grad_shard, m->opt_len * 4));
    if (m->dp.zero < 2) {
        CUDA_CHECK(cudaMalloc(&m->grads, pt->n_elements * 4));
        CUDA_CHECK(cudaMemsetAsync(m->grads, 0, pt->n_elements * 4, m->stream));
        for (int b = 0; b <= L; b++) m->grad_bucket[b] = m->grads + pt->bucket_offset[b];
        return;
    }
    for (int i = 0; i < 2; i++) {
        CUDA_CHECK(cudaMalloc(&m->grad_ring[i], largest_bucket(pt, L) * 4));
        CUDA_CHECK(cudaMemsetAsync(m->grad_ring[i], 0, largest_bucket(pt, L) * 4, m->stream));
    }
    CUDA_CHECK(cudaMalloc(&m->grad_tail, bucket_len(pt, L) * 4));
    CUDA_CHECK(cudaMemsetAsync(m->grad_tail, 0, bucket_len(pt, L) * 4, m->stream));
    CUDA_CHECK(cudaMalloc(&m->rs_scratch, largest_bucket(pt, L + 1) / m->dp.world * 4));
    for (int i = 0; i < 3; i++) {
        CUDA_CHECK(cudaEventCreateWithFlags(&m->ring_free[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventRecord(m->ring_free[i], m->stream));
    }
    for (int l = 0; l < L; l++) m->grad_bucket[l] = m->grad_ring[l % 2];
    m->grad_bucket[L] = m->grad_tail;
}

static void gpt_allocate(GPT* m) {
    size_t P = m->table.n_elements, S = m->opt_len;
    CUDA_CHECK(cudaMalloc(&m->params, P * 2));
    CUDA_CHECK(cudaMemsetAsync(m->params, 0, P * 2, m->stream));
    CUDA_CHECK(cudaMalloc(&m->master_low, S * 2));
    CUDA_CHECK(cudaMemsetAsync(m->master_low, 0, S * 2, m->stream));
    CUDA_CHECK(cudaMalloc(&m->opt_state, m->opt_state_bytes));  // all zero: m = v = 0 in every format
    CUDA_CHECK(cudaMemsetAsync(m->opt_state, 0, m->opt_state_bytes, m->stream));
    if (m->optimizer == OPTIMIZER_MUON) {
        Arena muon = {NULL, 0, 0};
        muon_scratch_layout(&m->muon, &muon, m);
        CUDA_CHECK(cudaMalloc(&muon.base, muon.used));
        muon.used = 0;
        m->muon_memory = muon.base;
        muon_scratch_layout(&m->muon, &muon, m);
    }
    if (m->dp.zero > 0) {
        for (int b = 0; b <= m->table.n_layers; b++)
            CUDA_CHECK(cudaEventCreateWithFlags(&m->params_ready[b], cudaEventDisableTiming));
    }
    gpt_allocate_grads(m);
    gpt_upload_decay_flags(m);
    CUDA_CHECK(cudaMalloc(&m->scalars, sizeof(OptimScalars)));
    CUDA_CHECK(cudaMemsetAsync(m->scalars, 0, sizeof(OptimScalars), m->stream));
    Arena kept = {NULL, 0, 0}, scratch = {NULL, 0, 0};
    CUDA_CHECK(cudaMalloc(&kept.base, m->bytes_activations));
    CUDA_CHECK(cudaMalloc(&scratch.base, m->bytes_scratch));
    m->activation_memory = kept.base;
    m->scratch_memory = scratch.base;
    activations_layout(&m->act, &kept, &scratch, &m->cfg, m->B, m->T, m->loss_chunk, m->recompute_layers,
                       layers_sharing_norms(m), stores_d_mlp_act(&m->cfg, m->N, m->fp8.on));
    if (m->fp8.on) fp8_allocate(m);

    int T = m->T, D = m->cfg.head_dim;
    size_t rope_n = (size_t)T * (D / 2);
    float* host_rope = (float*)malloc(2 * rope_n * sizeof(float));
    rope_tables(host_rope, host_rope + rope_n, T, D, m->cfg.rope_theta);
    CUDA_CHECK(cudaMalloc(&m->rope_cos, 2 * rope_n * sizeof(float)));
    m->rope_sin = m->rope_cos + rope_n;
    CUDA_CHECK(cudaMemcpy(m->rope_cos, host_rope, 2 * rope_n * sizeof(float), cudaMemcpyHostToDevice));
    free(host_rope);
}

// The model's plan, on the host only (no GPU needed): the parameter table, the shards and every
// buffer's size. dp says which rank of how many this is and the ZeRO mode (ONE_GPU on one GPU);
// `optimizer` which update rule, whose state is sized here (Muon needs dp->zero == 0); the first
// recompute_layers layers recompute (0 .. L); fp8 whether and how the matmuls run in FP8 (its
// shapes checked before: fp8_check_shapes).
static void gpt_plan(GPT* m, const ModelConfig* cfg, int B, int T, int recompute_layers, int loss_chunk,
                     const Sharding* dp, OptimizerKind optimizer, Fp8Mode fp8) {
    memset(m, 0, sizeof(*m));
    m->cfg = *cfg;
    m->optimizer = optimizer;
    m->B = B;
    m->T = T;
    m->N = B * T;
    m->recompute_layers = recompute_layers;
    m->deterministic = true;
    m->loss_chunk = loss_chunk < m->N ? loss_chunk : m->N;
    m->dp = *dp;
    m->accum = 1;
    m->fp8.on = fp8.on;
    m->fp8.scaling = fp8.scaling;
    m->fp8.head = fp8.head;
    m->fp8.fast_accum = fp8.fast_accum;
    m->fp8.fuse = true;
    m->fp8.fuse_weights = true;
    m->fp8.weights_stale = true;
    param_table_build(&m->table, cfg, dp->world);
    gpt_plan_shards(m);
    gpt_plan_memory(m);
}

static void gpt_plan_free(GPT* m) {
    param_table_free(&m->table);
    free(m->opt_offset);
}

// The planned model on the GPU, FP8's part included. A plan that cannot fit is one line, before
// any allocation (the cuBLASLt workspace is in the plan, so it is checked before matmul_init
// allocates it).
static void gpt_build(GPT* m) {
    gpt_check_fits(m);
    CUDA_CHECK(cudaStreamCreate(&m->stream));
    matmul_init();
    gpt_allocate(m);
}

static void gpt_free(GPT* m) {
    void* buffers[] = {m->master_low, m->params, m->grads, m->opt_state, m->muon_memory, m->decay_flags, m->scalars,
                       m->grad_shard, m->grad_ring[0], m->grad_ring[1], m->grad_tail,
                       m->rs_scratch, m->activation_memory, m->scratch_memory, m->rope_cos, m->fp8.memory};
    for (void* p : buffers) CUDA_CHECK(cudaFree(p));
    if (m->dp.zero == 2)
        for (int i = 0; i < 3; i++) CUDA_CHECK(cudaEventDestroy(m->ring_free[i]));
    if (m->dp.zero > 0)
        for (int b = 0; b <= m->table.n_layers; b++) CUDA_CHECK(cudaEventDestroy(m->params_ready[b]));
    CUDA_CHECK(cudaStreamDestroy(m->stream));
    matmul_free();
    gpt_plan_free(m);
}

// FP8 matmuls want every side a multiple of 16 bytes (cuBLASLt's leading dimensions), so the rows
// of a micro-batch, N = B x T, and both sides of the layers' matrices must be multiples of 16 (the
// head's, with --fp8-head, are the vocabulary and the loss chunk's rows). A function of the config
// alone, for check_options to call before anything is allocated: 0, or -1 with err.
static int fp8_check_shapes(const ModelConfig* c, long N, char* err, size_t err_len) {
    const char* needs = "--fp8 needs B x T and every matrix side a multiple of 16";
    if (N % 16) return fail(err, err_len, "%s (B x T is %ld)", needs, N);
    for (int k = 0; k < FP8_MATRICES; k++) {
        int64_t rows, cols;
        param_shape(c, (ParamKind)k, &rows, &cols);
        if (rows % 16 || cols % 16)
            return fail(err, err_len, "%s (%s is %lld x %lld)", needs, PARAM_KINDS[k].name, (long long)rows,
                        (long long)cols);
    }
    return 0;
}

// With ZeRO 1 and 2, each rank computes the new bf16 weights of its pieces only, writing them
// straight into their places in params (owned_params), and every bucket is then all-gathered in
// place on the comm stream. The buckets go in the order the forward needs them (the embedding's
// first, then layer by layer), each as soon as its own weights are ready, and the next forward
// waits for each bucket just before its first use (await_params): the sending of the later
// layers' weights overlaps the earlier layers' forward.
static int forward_order(int i, int n_layers) { return i == 0 ? n_layers : i - 1; }

static bf16* owned_params(const GPT* m, int b) {
    size_t begin, end;
    owned_part(m, b, &begin, &end);
    return m->params + begin;
}

static void send_params(GPT* m, int b) {
    Comm* c = m->dp.comm;
    comm_follow(c, m->stream);
    comm_all_gather(c, owned_params(m, b), m->params + m->table.bucket_offset[b], bucket_piece(m, b), sizeof(bf16));
    CUDA_CHECK(cudaEventRecord(m->params_ready[b], c->stream));
}

static void await_params(GPT* m, int b) {
    if (m->dp.zero > 0) CUDA_CHECK(cudaStreamWaitEvent(m->stream, m->params_ready[b], 0));
}

// The bf16 weights every rank computes with, once the master weights are set (init, resume): they
// are the master's high halves already, so with ZeRO 1/2 only each rank's pieces go to every rank.
static void publish_params(GPT* m) {
    m->fp8.weights_stale = true;
    if (m->dp.zero == 0) return;
    for (int i = 0; i <= m->table.n_layers; i++) send_params(m, forward_order(i, m->table.n_layers));
}

// Initialization as in GPT-2 and torch_baseline.py: matrices N(0, 0.02), norm weights 1.
// Each matrix draws from its own stream of the seed, numbered the embedding 0, then kind by kind
// and layer by layer (1 + kind L + layer), so its values depend neither on the layout of the flat
// buffer nor on the other tensors, nor on which rank initializes which part.
static void gpt_init(GPT* m, uint64_t seed) {
    CUDA_CHECK(cudaMemsetAsync(m->params, 0, m->table.n_elements * 2, m->stream));  // the padding
    CUDA_CHECK(cudaMemsetAsync(m->master_low, 0, m->opt_len * 2, m->stream));
    for (int i = 0; i < m->table.n_tensors; i++) {
        const ParamTensor* t = &m->table.tensors[i];
        int b = bucket_of(t, m->table.n_layers);
        size_t own_begin, own_end, n = (size_t)(t->rows * t->cols);
        owned_part(m, b, &own_begin, &own_end);
        size_t begin = t->offset > own_begin ? t->offset : own_begin;
        size_t end = t->offset + n < own_end ? t->offset + n : own_end;
        if (begin >= end) continue;
        bf16* w = m->params + begin;
        int16_t* low = m->master_low + m->opt_offset[b] + (begin - own_begin);
        uint64_t stream = t->kind == P_EMBED ? 0 : 1 + (uint64_t)t->kind * m->cfg.n_layer + t->layer;
        if (t->decay)
            init_normal(w, low, end - begin, 0.0f, 0.02f, seed * 1000003 + stream, begin - t->offset, m->stream);
        else
            init_normal(w, low, end - begin, 1.0f, 0.0f, 0, 0, m->stream);
    }
    publish_params(m);
}

static void print_memory_plan(const GPT* m) {
    const ModelConfig* c = &m->cfg;
    printf("model: vocab %d, d_model %d, %d layers, %d query heads, %d kv heads, head_dim %d, ffn %d, seq %d\n",
           c->vocab_size, c->d_model, c->n_layer, c->n_head, c->n_kv_head, c->head_dim, c->ffn_dim, c->seq_len);
    printf("parameters: %.2fM\n", param_count(&m->table) / 1e6);
    printf("optimizer: %s, its state %.3f bytes per parameter held%s\n", OPTIMIZER_NAMES[m->optimizer],
           (double)m->opt_state_bytes / m->opt_len,
           m->optimizer == OPTIMIZER_ADAMW8BIT ? " (AdamW's: 8)" : m->optimizer == OPTIMIZER_MUON ? " (momentum; v for AdamW's part)" : "");
    printf("memory plan (GiB): params %.2f (bf16 + the fp32 master's low halves) | grads %.2f | optimizer %.2f | "
           "activations %.2f (recompute %d of %d layers) | scratch %.2f (logits chunk %d rows) | cuBLASLt workspace "
           "%.2f | total %.2f\n",
           gib(m->bytes_params), gib(m->bytes_grads), gib(m->bytes_optimizer), gib(m->bytes_activations),
           m->recompute_layers, c->n_layer, gib(m->bytes_scratch), m->loss_chunk,
           gib(CUBLASLT_WORKSPACE_BYTES), gib(gpt_bytes_total(m)));
    if (m->fp8.on)
        printf("fp8: the layers' matrices%s in FP8 (%s scaling%s); its weight copies and scratch: %.2f GiB of the "
               "total\n", m->fp8.head ? " and the output head" : "", FP8_SCALING_NAMES[m->fp8.scaling],
               m->fp8.fast_accum ? ", fast accumulation in the forward" : "", gib(m->fp8.bytes));
}

// ----------------------------------------------------------------------------------------------
// Uploading micro-batches. The host splits the B x (T+1) window into inputs and targets and
// counting-sorts the positions by token for the embedding backward; one copy moves it all.
//
// The copy runs on its own stream, so that it overlaps the compute of the micro-batch before it.
// Two slots take turns, each a pinned host buffer and a device buffer. Slot k's copy waits (on the
// GPU) until the compute stream is done with slot k's previous batch; the compute stream waits
// (on the GPU) for the copy. The host waits only for slot k's previous copy to have left its
// pinned buffer, which happened before that batch's compute began: the host never waits for
// compute, so it can run ahead of the GPU.

typedef struct {
    int* host[2];            // pinned, batch_ints(N) each
    int* device[2];
    cudaEvent_t copied[2];   // the slot's last upload has landed
    cudaEvent_t consumed[2]; // the compute stream has passed the slot's last batch
    cudaStream_t copy_stream;
    int* counts;             // [V] the counting sort's scratch: occurrences of each token
    int* cursor;             // [V] and the next free slot of each token's bucket (-1: none yet)
    int next, N;
} Uploader;

static void uploader_create(Uploader* u, int N, int V) {
    u->N = N;
    u->next = 0;
    CUDA_CHECK(cudaStreamCreateWithFlags(&u->copy_stream, cudaStreamNonBlocking));
    for (int i = 0; i < 2; i++) {
        CUDA_CHECK(cudaMallocHost(&u->host[i], batch_ints(N) * sizeof(int)));
        CUDA_CHECK(cudaMalloc(&u->device[i], batch_ints(N) * sizeof(int)));
        CUDA_CHECK(cudaEventCreateWithFlags(&u->copied[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&u->consumed[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventRecord(u->copied[i], u->copy_stream));
        CUDA_CHECK(cudaEventRecord(u->consumed[i], u->copy_stream));
    }
    u->counts = (int*)calloc(V, sizeof(int));
    u->cursor = (int*)malloc(V * sizeof(int));
    for (int v = 0; v < V; v++) u->cursor[v] = -1;
}

static void uploader_free(Uploader* u) {
    CUDA_CHECK(cudaStreamSynchronize(u->copy_stream));
    for (int i = 0; i < 2; i++) {
        CUDA_CHECK(cudaFreeHost(u->host[i]));
        CUDA_CHECK(cudaFree(u->device[i]));
        CUDA_CHECK(cudaEventDestroy(u->copied[i]));
        CUDA_CHECK(cudaEventDestroy(u->consumed[i]));
    }
    CUDA_CHECK(cudaStreamDestroy(u->copy_stream));
    free(u->counts);
    free(u->cursor);
}

// Fills h from B rows of T+1 tokens: inputs, targets, and the positions grouped by token (a
// stable counting sort: count each token, then walk the positions in order, opening a group at a
// token's first appearance; cursor[tok] is the next free place of its group).
static void batch_prepare(Uploader* u, Batch* h, const uint16_t* window, int B, int T) {
    int N = B * T;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            h->inputs[b * T + t] = window[(size_t)b * (T + 1) + t];
            h->targets[b * T + t] = window[(size_t)b * (T + 1) + t + 1];
        }
    for (int n = 0; n < N; n++) u->counts[h->inputs[n]]++;
    int n_buckets = 0, start = 0;
    for (int n = 0; n < N; n++) {
        int tok = h->inputs[n];
        if (u->cursor[tok] < 0) {
            h->bucket_token[n_buckets] = tok;
            h->bucket_start[n_buckets++] = start;
            u->cursor[tok] = start;
            start += u->counts[tok];
        }
        h->bucket_pos[u->cursor[tok]++] = n;
    }
    h->bucket_start[n_buckets] = N;
    *h->n_buckets = n_buckets;
    for (int n = 0; n < N; n++) {
        u->counts[h->inputs[n]] = 0;
        u->cursor[h->inputs[n]] = -1;
    }
}

// Takes B rows of T+1 tokens; returns the batch's device layout, ready for the model's stream.
static Batch upload_batch(Uploader* u, GPT* m, const uint16_t* window) {
    int k = u->next;
    CUDA_CHECK(cudaEventRecord(u->consumed[k ^ 1], m->stream));  // the other slot's batch is in the stream
    CUDA_CHECK(cudaEventSynchronize(u->copied[k]));                // slot k's pinned buffer is free again
    Batch h = batch_layout(u->host[k], m->N);
    batch_prepare(u, &h, window, m->B, m->T);
    CUDA_CHECK(cudaStreamWaitEvent(u->copy_stream, u->consumed[k], 0));
    CUDA_CHECK(cudaMemcpyAsync(u->device[k], u->host[k], batch_ints(m->N) * sizeof(int), cudaMemcpyHostToDevice,
                               u->copy_stream));
    CUDA_CHECK(cudaEventRecord(u->copied[k], u->copy_stream));
    CUDA_CHECK(cudaStreamWaitEvent(m->stream, u->copied[k], 0));
    u->next = k ^ 1;
    return batch_layout(u->device[k], m->N);
}

// ----------------------------------------------------------------------------------------------
// Forward

// FP8 mode's scales and how they are found. A matrix (a layer's P_QKV .. P_DOWN, or the head's
// P_EMBED) has three scaled tensors (Fp8Role): its weight, its input and its output's gradient.
static Fp8Scale* fp8_scale(const GPT* m, Fp8Role role, ParamKind kind, int l) {
    return m->fp8.scales + fp8_scale_index(&m->cfg, role, kind, l);
}

// Current scaling measures every tensor; delayed calibrates (measures, keeping the step's largest
// amax) until a step has filled the history.
static Fp8CastScale fp8_how(const GPT* m) {
    if (m->fp8.scaling == FP8_CURRENT) return FP8_CAST_MEASURE;
    return m->fp8.calibrated ? FP8_CAST_DELAYED : FP8_CAST_CALIBRATE;
}

// The fused path (doc/fp8.md): with every scale known before the data exists (delayed scaling
// after the first step), the FP8 copies of RMSNorm's and SwiGLU's outputs and of SwiGLU's input
// gradient are cast where they are computed (fp8_input, fp8_grad), the backward's from what the
// forward keeps anyway; those bf16 tensors are then neither written nor read, and the backward
// recomputes neither norm nor SwiGLU. The attention forward writes its output's codes beside the
// bf16 output (fp8_attention_codes), which no cast then reads back in the forward. Otherwise the
// producing kernels write bf16 and a cast reads it.
static bool fp8_fused(const GPT* m) { return m->fp8.on && m->fp8.fuse && fp8_how(m) == FP8_CAST_DELAYED; }

// Whether layer l shares qkv_rot (activations_layout), and so remakes it in the backward: the first
// recompute_layers.
static bool recomputed(const GPT* m, int l) { return l < m->recompute_layers; }

// Whether layer l shares the norms' and SwiGLU's outputs, and so remakes them in the backward where
// the FP8 casts do not make them (layers_sharing_norms).
static bool shares_norms(const GPT* m, int l) { return l < layers_sharing_norms(m); }

// The parts of layer l's forward that a recomputed layer runs again in the backward: the two
// RMSNorms, the QK norm with RoPE, and SwiGLU.
static void attention_norm(GPT* m, int l) {
    const ModelConfig* c = &m->cfg;
    Activations* a = &m->act;
    rmsnorm_forward(a->xnorm_attn[l], a->rstd_attn[l], a->residual[l], P(m, P_ATTN_NORM, l), m->N, c->d_model,
                    c->norm_eps, m->stream);
}

static void qk_norm_rope(GPT* m, int l) {
    const ModelConfig* c = &m->cfg;
    Activations* a = &m->act;
    qk_norm_rope_forward(a->qkv_rot[l], a->rstd_qk[l], a->qkv[l], P(m, P_Q_NORM, l), P(m, P_K_NORM, l), m->rope_cos,
                         m->rope_sin, m->N, m->T, c->n_head, c->n_kv_head, c->head_dim, c->norm_eps, m->stream);
}

static void mlp_norm(GPT* m, int l) {
    const ModelConfig* c = &m->cfg;
    Activations* a = &m->act;
    rmsnorm_forward(a->xnorm_mlp[l], a->rstd_mlp[l], a->residual_mid[l], P(m, P_MLP_NORM, l), m->N, c->d_model,
                    c->norm_eps, m->stream);
}

static void mlp_swiglu(GPT* m, int l) {
    swiglu_forward(m->act.mlp_act[l], m->act.gate_up[l], m->N, m->cfg.ffn_dim, m->stream);
}

// A matrix product of the model over N rows: a layer's matrix (kind P_QKV .. P_DOWN, N = B x T)
// or the output head's (kind P_EMBED: the tied embedding, over a chunk of rows), in bf16 or, with
// FP8 mode on (and, for the head, --fp8-head), in FP8. Its shape is the table's: W [O, I]. In
// FP8 each product is the TN form cuBLASLt's FP8 kernels take (see matmul in kernels.cuh): the
// forward multiplies W by x as they are; the input gradient needs W^T (cast with W, once per
// optimizer step) and dy; the weight gradient needs x^T and dy^T, which the casts of the
// backward write in the same pass.
static bool fp8_product(const GPT* m, ParamKind kind) { return m->fp8.on && (kind != P_EMBED || m->fp8.head); }

// The fused path's E4M3 copy of matrix `kind`'s input x [N, I] in layer l: row-major into fp8.x
// for the forward, or transposed into fp8.x_t for the weight gradient. The kernel that makes x
// runs inside the cast: QKV's and GATE_UP's RMSNorm (the forward's computes rstd and saves it as
// the bf16 norm does; the backward's applies the saved one to the kept input), DOWN's SwiGLU on
// gate_up. ATTN_OUT's input is attention's output O: its row-major codes are already in fp8.x,
// written by the attention forward beside O (fp8_attention_codes), and its x^T is cast from O,
// which the backward keeps for attention's own backward.
static void fp8_input(GPT* m, ParamKind kind, int l, bool transposed) {
    Activations* a = &m->act;
    int N = m->N, I = (int)param(&m->table, kind, l)->cols;
    uint8_t *out = transposed ? NULL : m->fp8.x, *out_t = transposed ? m->fp8.x_t : NULL;
    Fp8Scale* sx = fp8_scale(m, FP8_ROLE_INPUT, kind, l);
    if (kind == P_QKV || kind == P_GATE_UP) {
        bool attn = kind == P_QKV;
        const bf16* x = attn ? a->residual[l] : a->residual_mid[l];
        float* rstd = attn ? a->rstd_attn[l] : a->rstd_mlp[l];
        const bf16* w = P(m, attn ? P_ATTN_NORM : P_MLP_NORM, l);
        if (transposed)
            fp8_produce(NULL, out_t, Fp8FromRmsnorm{x, rstd, w, I}, N, I, false, sx, FP8_CAST_DELAYED, m->stream);
        else
            fp8_rmsnorm_forward(out, rstd, x, w, N, I, m->cfg.norm_eps, sx, m->stream);
    } else if (kind == P_DOWN) {
        fp8_produce(out, out_t, Fp8FromSwiglu{a->gate_up[l], I}, N, I, false, sx, FP8_CAST_DELAYED, m->stream);
    } else if (transposed) {
        fp8_cast(NULL, out_t, a->attn_out[l], N, I, false, sx, FP8_CAST_DELAYED, m->stream);
    }
}

// Where the attention forward of layer l writes its output's E4M3 codes, ATTN_OUT's forward input:
// on the fused path fp8.x, at that input's scale, whose amax the attention kernel records as a cast
// would (lib/attention.cuh); elsewhere nowhere (NULL: only the bf16 O, which a cast then reads).
static uint8_t* fp8_attention_codes(const GPT* m, Fp8Scale** scale, int l) {
    if (!fp8_fused(m)) {
        *scale = NULL;
        return NULL;
    }
    *scale = fp8_scale(m, FP8_ROLE_INPUT, P_ATTN_OUT, l);
    return m->fp8.x;
}

// The fused path's E5M2 copies of matrix `kind`'s output gradient [N, O] in layer l, into fp8.dy
// and fp8.dy_t: GATE_UP's through SwiGLU's backward from d_mlp_act and gate_up (d_gate_up is never
// written); the others' from dy as it is.
static void fp8_grad(GPT* m, ParamKind kind, int l, const bf16* dy) {
    int N = m->N, O = (int)param(&m->table, kind, l)->rows;
    Fp8Scale* sg = fp8_scale(m, FP8_ROLE_GRAD, kind, l);
    if (kind == P_GATE_UP)
        fp8_produce(m->fp8.dy, m->fp8.dy_t, Fp8FromSwigluBackward{m->act.d_mlp_act, m->act.gate_up[l], O / 2}, N, O,
                    true, sg, FP8_CAST_DELAYED, m->stream);
    else
        fp8_cast(m->fp8.dy, m->fp8.dy_t, dy, N, O, true, sg, FP8_CAST_DELAYED, m->stream);
}

// Matrix `kind` of layer l (P_EMBED, 0: the head's E) in FP8 and transposed, from its bf16 weights.
static void fp8_cast_weight(GPT* m, ParamKind kind, int l) {
    const ParamTensor* t = param(&m->table, kind, l);
    fp8_cast(m->fp8.weights + t->offset, m->fp8.weights_t + t->offset, m->params + t->offset, (int)t->rows,
             (int)t->cols, false, fp8_scale(m, FP8_ROLE_WEIGHT, kind, l), fp8_how(m), m->stream);
}

// Layer l's four FP8 weights and their transposes, from the bf16 weights, when those changed and
// the update did not make them (fp8_weights_by_adamw); with the last layer's, the head's (with
// --fp8-head: the embedding's bucket arrived before layer 0).
static void fp8_cast_weights(GPT* m, int l) {
    if (!m->fp8.on || !m->fp8.weights_stale) return;
    for (int k = 0; k < FP8_MATRICES; k++) fp8_cast_weight(m, (ParamKind)k, l);
    if (l < m->cfg.n_layer - 1) return;
    if (m->fp8.head) fp8_cast_weight(m, P_EMBED, 0);
    m->fp8.weights_stale = false;
}

// y[N, O] = x[N, I] W^T (+ residual). On the fused FP8 path a layer's x codes come from fp8_input
// (x unused; ATTN_OUT's were written by the attention forward); the head's input is always cast
// as it is.
static void layer_forward(GPT* m, ParamKind kind, int l, int N, bf16* y, const bf16* x, const bf16* residual) {
    const ParamTensor* t = param(&m->table, kind, l);
    int O = (int)t->rows, I = (int)t->cols;
    if (!fp8_product(m, kind)) {
        linear_forward(y, x, m->params + t->offset, residual, N, I, O, m->stream);
        return;
    }
    GptFp8* f = &m->fp8;
    Fp8Scale *sw = fp8_scale(m, FP8_ROLE_WEIGHT, kind, l), *sx = fp8_scale(m, FP8_ROLE_INPUT, kind, l);
    if (fp8_fused(m) && kind != P_EMBED) fp8_input(m, kind, l, false);
    else fp8_cast(f->x, NULL, x, N, I, false, sx, fp8_how(m), m->stream);
    matmul(mm_bf16(y), 1.0f, fp8_operand(f->weights + t->offset, false, sw), fp8_operand(f->x, false, sx), residual,
           1.0f, O, N, I, true, false, m->stream, f->fast_accum);
}

// The MLP's gate/up product and SwiGLU in layer l: gate_up = xnorm_mlp W_gate_up^T [N, 2F], which
// the backward keeps, and mlp_act = silu(gate) * up [N, F]. In BF16 one kernel of our own does both
// (lib/matmul_hopper.cuh, in ping-pong): act is made in the product's epilogue, so gate_up is not
// read back, 1.36x cuBLASLt plus swiglu_forward at the default config (doc/matmul.md); its act has
// the very bits swiglu_forward makes from the stored gate_up, which is what the backward's recompute
// runs. It never splits K, so it repeats bit for bit. Where hopper_swiglu_problem refuses the
// operands, and in FP8, the product goes through layer_forward; FP8's fused casts then make SwiGLU
// themselves (fp8_input), else swiglu_forward does.
static bool gate_up_fused(const GPT* m, int l) {
    const ParamTensor* t = param(&m->table, P_GATE_UP, l);
    const Activations* a = &m->act;
    return !fp8_product(m, P_GATE_UP) && !hopper_swiglu_problem(a->gate_up[l], a->mlp_act[l], a->xnorm_mlp[l],
                                                                m->params + t->offset, m->N, (int)t->cols,
                                                                (int)t->rows);
}

static void mlp_gate_up(GPT* m, int l) {
    Activations* a = &m->act;
    if (gate_up_fused(m, l)) {
        const ParamTensor* t = param(&m->table, P_GATE_UP, l);
        hopper_forward_swiglu<1, true>(a->gate_up[l], a->mlp_act[l], a->xnorm_mlp[l], m->params + t->offset, m->N,
                                       (int)t->cols, (int)t->rows, m->stream);
        return;
    }
    layer_forward(m, P_GATE_UP, l, m->N, a->gate_up[l], a->xnorm_mlp[l], NULL);
    if (!fp8_fused(m)) mlp_swiglu(m, l);
}

// Whether this micro-batch's gradient writes add to the gradient buffers (+=, beta 1) or set them
// (=, beta 0). The first micro-batch of an optimizer step sets them, so nothing zeroes them and no
// product reads them back before its first write: at 1b that is 4.3 GB of memset and as much read
// a step saved. The padding between tensors, which no kernel writes and the norm and the optimizer
// read, stays zero from its allocation (gpt_allocate_grads; gpt_download_master, which borrows the
// buffers, zeroes them again). Later micro-batches add. With ZeRO 2 each micro-batch sets them:
// its buckets lie in ring slots that every micro-batch fills afresh, once the previous contents
// have been reduce-scattered into this rank's piece (grads_ready).
static bool grads_accumulate(const GPT* m) {
    return m->dp.zero < 2 && m->micro > 0;
}

// dW = dy^T x (or += with `accumulate`: grads_accumulate) and dx = dy W, for dy [N, O] and the
// matrix's input x [N, I] (as the forward saw it). On the fused FP8 path a layer's codes come from
// fp8_input and fp8_grad, made from what the forward kept (x unused, and GATE_UP's dy too); the
// head's are cast as they are.
static void layer_backward(GPT* m, ParamKind kind, int l, int N, bf16* dx, const bf16* dy, const bf16* x,
                           bool accumulate) {
    const ParamTensor* t = param(&m->table, kind, l);
    int O = (int)t->rows, I = (int)t->cols;
    float* dW = G(m, kind, l);
    if (!fp8_product(m, kind)) {
        linear_backward_weight(dW, dy, x, N, I, O, accumulate, m->stream);
        linear_backward_input(dx, dy, m->params + t->offset, N, I, O, m->stream);
        return;
    }
    GptFp8* f = &m->fp8;
    Fp8Scale *sw = fp8_scale(m, FP8_ROLE_WEIGHT, kind, l), *sx = fp8_scale(m, FP8_ROLE_INPUT, kind, l);
    Fp8Scale* sg = fp8_scale(m, FP8_ROLE_GRAD, kind, l);
    if (fp8_fused(m) && kind != P_EMBED) {
        fp8_grad(m, kind, l, dy);
        fp8_input(m, kind, l, true);
    } else {
        fp8_cast(f->dy, f->dy_t, dy, N, O, true, sg, fp8_how(m), m->stream);
        // x's scale is the one its forward cast used: delayed, the step's; current, the forward's amax
        fp8_cast(NULL, f->x_t, x, N, I, false, sx,
                 fp8_how(m) == FP8_CAST_DELAYED ? FP8_CAST_DELAYED : FP8_CAST_MEASURED, m->stream);
    }
    // dW [O, I] is column-major D[m = I, n = O] = op_T(A) B over k = N, with A = x^T (row-major
    // [I, N]) and B = dy^T (row-major [O, N]); with dW as C too (beta 1) it accumulates
    matmul(mm_f32(dW), 1.0f, fp8_operand(f->x_t, false, sx), fp8_operand(f->dy_t, true, sg), accumulate ? dW : NULL,
           1.0f, I, O, N, true, false, m->stream);
    // dx [N, I] is column-major D[m = I, n = N] = op_T(A) B over k = O, with A = W^T (row-major
    // [I, O]) and B = dy (row-major [N, O])
    matmul(mm_bf16(dx), 1.0f, fp8_operand(f->weights_t + t->offset, false, sw), fp8_operand(f->dy, true, sg), NULL, 0.0f,
           I, N, O, true, false, m->stream);
}

// Whether layer l remakes the norms' and SwiGLU's outputs in the backward (it shares them, and FP8's
// fused casts do not make them). In BF16 the backward's own kernels remake them where they already
// read the inputs, and no forward kernel runs again: SwiGLU's act comes out of the down input
// gradient's epilogue (mlp_down_backward), each norm's output out of the norm's backward
// (norm_matrix_backward), each with the very bits the forward's kernel stored, and the weight
// gradient that reads it runs after. FP8's casts (first step of delayed scaling, or current
// scaling) read them before the products, so there the forward's kernels run again first.
static bool remakes_norms(const GPT* m, int l) { return shares_norms(m, l) && !fp8_fused(m); }

// The down matrix's backward and SwiGLU's in layer l, from dy = d_residual [N, C]: dW_down += dy^T
// mlp_act, d_mlp_act = dy W_down [N, F], and d_gate_up = [d_gate | d_up] [N, 2F] from d_mlp_act and
// gate_up (kernels.cuh's swiglu_backward). In BF16 the input gradient is one kernel of our own
// (lib/matmul_hopper.cuh), the mirror of the forward's mlp_gate_up: SwiGLU's backward runs in its
// epilogue on d_mlp_act rounded to bf16 as a stored one would be, so d_mlp_act is neither written
// nor read, and d_gate_up has the very bits swiglu_backward makes from the kernel's plain product.
// It reads gate_up, which every layer keeps whatever --recompute says (activations_layout); in a
// layer that remakes mlp_act (remakes_norms) the epilogue stores act from it too, before dW_down
// reads it. It never splits K, so it repeats bit for bit. Where hopper_swiglu_backward_problem
// refuses the operands, and in FP8, the product goes through layer_backward into d_mlp_act; FP8's
// fused casts then run SwiGLU's backward themselves (fp8_grad), else swiglu_backward does.
static bool down_swiglu_fused(const GPT* m, int l) {
    const ParamTensor* t = param(&m->table, P_DOWN, l);
    const Activations* a = &m->act;
    return !fp8_product(m, P_DOWN) && !hopper_swiglu_backward_problem(a->d_gate_up, a->mlp_act[l], a->d_residual,
                                                                      m->params + t->offset, a->gate_up[l], m->N,
                                                                      (int)t->cols, (int)t->rows);
}

static void mlp_down_backward(GPT* m, int l, bool accumulate) {
    Activations* a = &m->act;
    bool remake = remakes_norms(m, l);
    if (down_swiglu_fused(m, l)) {
        const ParamTensor* t = param(&m->table, P_DOWN, l);
        int O = (int)t->rows, I = (int)t->cols;
        hopper_backward_swiglu(a->d_gate_up, remake ? a->mlp_act[l] : NULL, a->d_residual, m->params + t->offset,
                               a->gate_up[l], m->N, I, O, m->stream);
        linear_backward_weight(G(m, P_DOWN, l), a->d_residual, a->mlp_act[l], m->N, I, O, accumulate, m->stream);
        return;
    }
    if (remake) mlp_swiglu(m, l);
    layer_backward(m, P_DOWN, l, m->N, a->d_mlp_act, a->d_residual, a->mlp_act[l], accumulate);
    if (!fp8_fused(m))  // fused: SwiGLU's backward runs inside GATE_UP's cast of its output gradient
        swiglu_backward(a->d_gate_up, a->d_mlp_act, a->gate_up[l], m->N, m->cfg.ffn_dim, m->stream);
}

// The backward of a matrix that reads a norm's output xnorm (QKV the attention norm's, GATE_UP the
// MLP norm's) in layer l, from its output gradient dy, then the norm's: d_xnorm = dy W, dW (+)=
// dy^T xnorm, and rmsnorm_backward adds dL/d(norm's input) into d_residual. A layer that remakes
// xnorm (remakes_norms) gets it in BF16 from the norm's backward, which reads x and w anyway, so dW
// runs last; with FP8 products the norm's forward runs again first.
static void norm_matrix_backward(GPT* m, ParamKind kind, int l, const bf16* dy, bool accumulate, PartialSums* sums) {
    const ModelConfig* c = &m->cfg;
    Activations* a = &m->act;
    const ParamTensor* t = param(&m->table, kind, l);
    bool attn = kind == P_QKV;
    ParamKind norm = attn ? P_ATTN_NORM : P_MLP_NORM;
    bf16* xnorm = attn ? a->xnorm_attn[l] : a->xnorm_mlp[l];
    const bf16* x = attn ? a->residual[l] : a->residual_mid[l];
    const float* rstd = attn ? a->rstd_attn[l] : a->rstd_mlp[l];
    bool remake = remakes_norms(m, l), remade_by_norm = remake && !fp8_product(m, kind);
    if (remade_by_norm) {
        linear_backward_input(a->d_xnorm, dy, m->params + t->offset, m->N, (int)t->cols, (int)t->rows, m->stream);
    } else {
        if (remake && attn) attention_norm(m, l);
        if (remake && !attn) mlp_norm(m, l);
        layer_backward(m, kind, l, m->N, a->d_xnorm, dy, xnorm, accumulate);
    }
    float* partials = norm_partials(a, attn ? SLOT_ATTN_NORM : SLOT_MLP_NORM);
    rmsnorm_backward(a->d_residual, G(m, norm, l), partials, remade_by_norm ? xnorm : NULL, a->d_xnorm, x,
                     P(m, norm, l), rstd, m->N, c->d_model, accumulate, sums, m->stream);
    if (remade_by_norm)
        linear_backward_weight(G(m, kind, l), dy, xnorm, m->N, (int)t->cols, (int)t->rows, accumulate, m->stream);
}

// At an optimizer step, before the update: (delayed) the step's amaxes join the history, which
// gives the scales the new weights are cast with; the weights are about to change, stale until
// cast (by the update itself, fp8_weights_by_adamw, or when next used: fp8_cast_weights).
static void fp8_step_done(GPT* m) {
    GptFp8* f = &m->fp8;
    if (!f->on) return;
    if (f->scaling == FP8_DELAYED) {
        fp8_update_scales(f->scales, (int)fp8_n_scales(&m->cfg), m->stream);
        f->calibrated = true;
    }
    f->weights_stale = true;
}

// Data parallelism with delayed scaling: each rank's casts recorded the amaxes of its own
// micro-batches. Before they join the history, every rank takes their max over the ranks, so that
// every rank derives the same scales from the same history and a checkpoint's scales (rank 0's)
// are everyone's. One all-reduce of a few KB on the comm stream, queued behind the last bucket's
// gradients, which optimizer_step waits for anyway; the host reads nothing. It runs over the whole
// Fp8Scale array, all of whose fields are non-negative floats: the other fields agree on every
// rank already (or, after the first step, whose casts measured, are recomputed from the history
// by fp8_update_scales), and the max of equal values is that value. Current scaling measures each
// tensor as it is cast, on its own rank: agreeing there would take an all-reduce per cast, inside
// the step's critical path (doc/fp8.md).
static void fp8_agree_amaxes(GPT* m) {
    static_assert(sizeof(Fp8Scale) == (4 + FP8_HISTORY) * sizeof(float), "the max over ranks takes every field as a float");
    Comm* c = m->dp.comm;
    if (!m->fp8.on || m->fp8.scaling != FP8_DELAYED || !c || m->dp.world == 1) return;
    comm_follow(c, m->stream);
    comm_all_reduce(c, (float*)m->fp8.scales, fp8_n_scales(&m->cfg) * sizeof(Fp8Scale) / sizeof(float), ncclMax);
}

// Evaluation (validation, sampling) runs the FP8 forward too, and its casts would leave their
// amaxes in the delayed history (current casts set scales), and the weights cast: the scales and
// the weights' staleness are put back as training left them, so that a run that evaluates at
// step k goes on exactly as one resumed from step k.
static void fp8_eval(GPT* m, bool begin) {
    GptFp8* f = &m->fp8;
    if (!f->on) return;
    size_t bytes = fp8_n_scales(&m->cfg) * sizeof(Fp8Scale);
    CUDA_CHECK(cudaMemcpyAsync(begin ? f->scales_saved : f->scales, begin ? f->scales : f->scales_saved, bytes,
                               cudaMemcpyDeviceToDevice, m->stream));
    if (begin) f->stale_saved = f->weights_stale;
    else f->weights_stale = f->stale_saved;
}

// Runs the layers and the final norm; leaves xnorm_final [N, C] for the output head.
static void forward_layers(GPT* m, const Batch* batch) {
    const ModelConfig* c = &m->cfg;
    Activations* a = &m->act;
    int N = m->N, C = c->d_model, Q = qkv_dim(c);
    int Hq = c->n_head, Hkv = c->n_kv_head, D = c->head_dim;
    bool fused = fp8_fused(m);  // the matrices' casts run the norms and SwiGLU themselves (fp8_input)
    await_params(m, c->n_layer);  // the embedding's bucket (and the final norm's)
    embedding_forward(a->residual[0], batch->inputs, P(m, P_EMBED, 0), N, C, m->stream);
    for (int l = 0; l < c->n_layer; l++) {
        await_params(m, l);
        fp8_cast_weights(m, l);
        // attention block: residual_mid = residual + attention(qk_rope(rmsnorm(residual) W_qkv^T)) W_o^T
        if (!fused) attention_norm(m, l);
        layer_forward(m, P_QKV, l, N, a->qkv[l], a->xnorm_attn[l], NULL);
        qk_norm_rope(m, l);
        const bf16 *q = a->qkv_rot[l], *v = a->qkv[l] + (Hq + Hkv) * D;  // v is neither normed nor rotated
        Fp8Scale* codes_scale;
        uint8_t* codes = fp8_attention_codes(m, &codes_scale, l);
        attention_forward(a->attn_out[l], a->lse[l], q, q + Hq * D, v, Q, m->B, m->T, Hq, Hkv, D, m->stream, codes,
                          codes_scale);
        layer_forward(m, P_ATTN_OUT, l, N, a->residual_mid[l], a->attn_out[l], a->residual[l]);
        // MLP block: residual' = residual_mid + swiglu(rmsnorm(residual_mid) W_gate_up^T) W_down^T
        if (!fused) mlp_norm(m, l);
        mlp_gate_up(m, l);
        layer_forward(m, P_DOWN, l, N, a->residual[l + 1], a->mlp_act[l], a->residual_mid[l]);
    }
    rmsnorm_forward(a->xnorm_final, a->rstd_final, a->residual[c->n_layer], P(m, P_FINAL_NORM, 0), N, C,
                    c->norm_eps, m->stream);
}

// The BF16 head takes our GEMM with the softmax's exponentials in its epilogue, wherever
// hopper_logits_problem accepts the operands (every valid config: config_check asks for d_model
// and V multiples of 8, and the arenas align to 256 bytes); FP8's head (--fp8-head) keeps cuBLASLt's
// FP8 products and the cross-entropy kernel.
static bool head_fused(const GPT* m) {
    return !fp8_product(m, P_EMBED) && !hopper_logits_problem(m->act.logits, m->act.xnorm_final, P(m, P_EMBED, 0),
                                                              m->loss_chunk, m->cfg.d_model, m->cfg.vocab_size);
}

// One chunk of `rows` rows of the BF16 head, x [rows, C] (kernels.cuh, "The output head's loss
// without a pass over its logits", has the math): the shift (each row's target logit); probs = exp(z -
// shift) by the product itself, never the logits; the losses, each row's scale s and x_scaled = s x,
// and probs turned into P' (the target's entry); then, with `backward`, the two products that take
// the scale where it costs nothing: dE (+)= P'^T x_scaled, and dx = s P'E, summed in fp32 (head_dx)
// and rounded once as it is scaled. The softmax's gradient dL/dz = s P' is never written out.
static void head_chunk_fused(GPT* m, const bf16* x, const int* targets, float* losses, bf16* dx, int rows,
                             float d_loss, bool backward, bool accumulate_dE) {
    Activations* a = &m->act;
    int C = m->cfg.d_model, V = m->cfg.vocab_size;
    const bf16* E = P(m, P_EMBED, 0);
    head_shift(a->head_shift, a->head_overflow, x, E, targets, rows, C, m->stream);
    const HopperLogits logits = {a->head_shift, targets, a->head_partials, a->head_target_z, a->head_overflow};
    hopper_logits_exp(a->logits, logits, x, E, rows, C, V, m->stream);
    head_loss(losses, a->head_scale, a->head_x_scaled, a->logits, a->head_partials, a->head_target_z,
              a->head_overflow, x, E, targets, rows, V, C, hopper_logits_tiles(V), d_loss, m->stream);
    if (!backward) return;
    linear_backward_weight(G(m, P_EMBED, 0), a->logits, a->head_x_scaled, rows, C, V, accumulate_dE, m->stream);
    linear_backward_input(a->head_dx, a->logits, E, rows, C, V, m->stream);  // fp32: scaled, then rounded
    scale_rows(dx, a->head_dx, a->head_scale, rows, C, m->stream);
}

// The output head and the loss, R rows at a time, so that only an R x V chunk of logits exists.
// Per chunk: logits = xnorm_final E^T; the cross-entropy kernel turns them into per-token losses
// and, in place, into dL/dlogits (scaled by d_loss); with `backward`, the chunk's gradient flows
// on at once: d_xnorm = dlogits E and dE += dlogits^T xnorm_final. Both are the products of a
// matrix, E [V, C], over the chunk's rows (layer_forward, layer_backward; in FP8 with --fp8-head).
// That is the FP8 head's way. The BF16 head (head_fused) computes the same from one pass over
// the chunk, the forward product's own writes: head_chunk_fused, above.
// Adds the losses' sum to *loss_sum (or sets it, when accumulate is false). The first chunk writes
// dE as grads_accumulate says; the later ones add to it.
static void head_and_loss(GPT* m, const Batch* batch, float d_loss, bool backward, float* loss_sum, bool accumulate) {
    const ModelConfig* c = &m->cfg;
    Activations* a = &m->act;
    int N = m->N, C = c->d_model, V = c->vocab_size;
    bool fused = head_fused(m);
    for (int r0 = 0; r0 < N; r0 += m->loss_chunk) {
        int rows = N - r0 < m->loss_chunk ? N - r0 : m->loss_chunk;
        const bf16* x = a->xnorm_final + (size_t)r0 * C;
        bool accumulate_dE = r0 > 0 || grads_accumulate(m);
        if (fused) {
            head_chunk_fused(m, x, batch->targets + r0, a->losses + r0, a->d_xnorm + (size_t)r0 * C, rows, d_loss,
                             backward, accumulate_dE);
            continue;
        }
        layer_forward(m, P_EMBED, 0, rows, a->logits, x, NULL);
        cross_entropy(a->logits, a->losses + r0, batch->targets + r0, rows, V, d_loss, m->stream);
        if (backward) layer_backward(m, P_EMBED, 0, rows, a->d_xnorm + (size_t)r0 * C, a->logits, x, accumulate_dE);
    }
    reduce_sum(loss_sum, a->losses, N, false, accumulate, a->partials, m->stream);
}

// ----------------------------------------------------------------------------------------------
// Backward: from dL/d(xnorm_final), left in d_xnorm by head_and_loss, down to the embedding.
// Parameter gradients are set or accumulated as grads_accumulate says; d_residual carries
// dL/d(residual stream) down the layers.

// Before bucket b's gradients are first written in a micro-batch. With ZeRO 2 the bucket's buffer
// is a ring slot (or grad_tail) that the previous reduce-scatter from it may still be reading.
static void grads_open(GPT* m, int b) {
    if (m->dp.zero < 2) return;
    int slot = b == m->table.n_layers ? 2 : b % 2;
    CUDA_CHECK(cudaStreamWaitEvent(m->stream, m->ring_free[slot], 0));
}

// Bucket b's gradients are complete for this micro-batch: sum them across the ranks, on the comm
// stream while the backward goes on. ZeRO 0 and 1 wait for the last micro-batch (the gradients
// accumulate in place until then); ZeRO 2 sends every micro-batch's and keeps only its piece.
static void grads_ready(GPT* m, int b) {
    if (m->grads_ready) m->grads_ready(m->grads_ready_ctx, m, b);
    Comm* c = m->dp.comm;
    bool last = m->micro == m->accum - 1;
    if (!c || (m->dp.zero < 2 && !last)) return;
    size_t len = bucket_len(&m->table, b), piece = bucket_piece(m, b);
    float* owned = m->grad_shard + m->opt_offset[b];
    comm_follow(c, m->stream);
    if (m->dp.zero == 0) {
        comm_all_reduce(c, m->grad_bucket[b], len, ncclSum);
    } else if (m->dp.zero == 1 || m->micro == 0) {
        comm_reduce_scatter(c, m->grad_bucket[b], owned, piece);
    } else {
        comm_reduce_scatter(c, m->grad_bucket[b], m->rs_scratch, piece);
        add_into(owned, m->rs_scratch, piece, c->stream);
    }
    if (m->dp.zero == 2) CUDA_CHECK(cudaEventRecord(m->ring_free[b == m->table.n_layers ? 2 : b % 2], c->stream));
}

static void backward(GPT* m, const Batch* batch) {
    const ModelConfig* c = &m->cfg;
    Activations* a = &m->act;
    int N = m->N, C = c->d_model, Q = qkv_dim(c);
    int Hq = c->n_head, Hkv = c->n_kv_head, D = c->head_dim, L = c->n_layer;
    bool acc = grads_accumulate(m);
    PartialSums norm_sums = {};  // the norms' weight gradients of a layer, added up at its end
    CUDA_CHECK(cudaMemsetAsync(a->d_residual, 0, (size_t)N * C * sizeof(bf16), m->stream));
    rmsnorm_backward(a->d_residual, G(m, P_FINAL_NORM, 0), norm_partials(a, SLOT_FINAL_NORM), NULL, a->d_xnorm,
                     a->residual[L], P(m, P_FINAL_NORM, 0), a->rstd_final, N, C, acc, &norm_sums, m->stream);
    for (int l = L - 1; l >= 0; l--) {
        grads_open(m, l);
        // MLP block. d_residual = dL/d(residual[l+1]) flows both through the skip connection
        // (unchanged) and through the block, whose contribution rmsnorm_backward adds to it.
        mlp_down_backward(m, l, acc);
        norm_matrix_backward(m, P_GATE_UP, l, a->d_gate_up, acc, &norm_sums);
        // Attention block, the same way: d_residual is now dL/d(residual_mid[l]).
        if (recomputed(m, l)) qk_norm_rope(m, l);
        layer_backward(m, P_ATTN_OUT, l, N, a->d_attn_out, a->d_residual, a->attn_out[l], acc);
        // dk and dv into d_qkv; dq stays in the scratch's fp32 accumulators, whence the QK norm's
        // backward reads it (no bf16 copy written and read back)
        const bf16 *q = a->qkv_rot[l], *v = a->qkv[l] + (Hq + Hkv) * D;
        attention_backward(NULL, a->d_qkv + Hq * D, a->d_qkv + (Hq + Hkv) * D, a->attn_scratch, a->d_attn_out,
                           a->attn_out[l], a->lse[l], q, q + Hq * D, v, Q, Q, m->B, m->T, Hq, Hkv, D, m->stream,
                           m->deterministic);
        qk_norm_rope_backward(a->d_qkv, G(m, P_Q_NORM, l), G(m, P_K_NORM, l), norm_partials(a, SLOT_QK_NORM),
                              a->qkv[l], a->rstd_qk[l], P(m, P_Q_NORM, l), P(m, P_K_NORM, l), m->rope_cos, m->rope_sin,
                              attn_dq_acc(a->attn_scratch, m->B, m->T, Hq), N, m->T, Hq, Hkv, D, acc, &norm_sums,
                              m->stream);
        norm_matrix_backward(m, P_QKV, l, a->d_qkv, acc, &norm_sums);
        sum_partials_flush(&norm_sums, m->stream);
        grads_ready(m, l);  // layer l's gradients are complete
    }
    embedding_backward(G(m, P_EMBED, 0), a->d_residual, batch->bucket_start, batch->bucket_pos, batch->bucket_token,
                       batch->n_buckets, N, c->vocab_size, C, m->stream);
    grads_ready(m, L);  // and the embedding's and the final norm's
}

// Micro-batch `micro` of `accum` of a step: forward and backward. Gradients accumulate (the first
// micro-batch sets them: grads_accumulate), and so does the step's loss sum; dL/dloss_token =
// 1 / (all the step's tokens, over every rank).
static void forward_backward(GPT* m, const Batch* batch, int micro, int accum) {
    m->micro = micro;
    m->accum = accum;
    float d_loss = 1.0f / ((float)m->N * accum * m->dp.world);
    forward_layers(m, batch);
    grads_open(m, m->table.n_layers);  // the head writes the embedding's gradient first
    head_and_loss(m, batch, d_loss, true, &m->scalars->loss_sum, micro > 0);
    backward(m, batch);
}

// ----------------------------------------------------------------------------------------------
// The optimizer step: the global gradient norm (kept on the device for the clip inside the
// update), then the update of the parameters this rank owns, then the new bf16 weights to every
// rank. The update is AdamW, 8-bit AdamW, or Muon for the hidden matrices and AdamW for the rest
// (--optimizer; doc/optimizers.md). The learning rates and the bias corrections are computed on
// the device from the step count there (kernels.cuh), so the step takes nothing from the host.

// Sums `count` adjacent scalars of OptimScalars across the ranks (the loss, a sharded gradient norm).
static void sum_over_ranks(GPT* m, float* scalars, int count) {
    Comm* c = m->dp.comm;
    if (!c || m->dp.world == 1) return;
    comm_follow(c, m->stream);
    comm_all_reduce(c, scalars, count, ncclSum);
    comm_join(c, m->stream);
}

// AdamW, or 8-bit AdamW, over the n optimizer elements from `at` (Muon's elements are skipped by
// their flag), whose master weights' bf16 halves are at `params`.
static void adamw_range(GPT* m, const OptimConfig* o, const float* grads, size_t at, bf16* params, size_t n) {
    const uint8_t* flags = m->decay_flags + at / PARAM_ALIGN;
    void* st = m->opt_state;
    if (m->optimizer == OPTIMIZER_ADAMW8BIT)
        adamw8bit_step(params, m->master_low + at, grads + at, (uint8_t*)opt_part(m, st, OPT_Q8_M, at),
                       (uint8_t*)opt_part(m, st, OPT_Q8_R, at), (float*)opt_part(m, st, OPT_Q8_M_ABSMAX, at),
                       (float*)opt_part(m, st, OPT_Q8_R_ABSMAX, at), flags, n, o, m->scalars, m->stream);
    else
        adamw_step(params, m->master_low + at, grads + at, (float*)opt_part(m, st, OPT_EXP_AVG, at),
                   (float*)opt_part(m, st, OPT_EXP_AVG_SQ, at), flags, n, o, m->scalars, m->stream);
}

// Whether the update makes the FP8 weights itself (doc/fp8.md): AdamW's step on an FP8 matrix then
// writes W and W^T from its new bf16 weights in the same pass (fp8_adamw_matrices), at the scale
// the next forward's cast would use, which fp8_step_done has just set; the bf16 weights are not
// read again, and the forward's cast (fp8_cast_weights) has nothing left to do. It needs
// delayed scaling, the scale known before the weight exists (current scaling measures the new
// weight's amax first, a pass over it); ZeRO 0, this rank updating every weight (with ZeRO 1, 2 the
// other ranks' pieces arrive in bf16 by the all-gather, and the forward casts each matrix after
// await_params); and AdamW: Muon updates the matrices in its own kernels, and 8-bit AdamW's
// moments come in blocks of 128 consecutive elements with one scale each, which the update's
// 32 x 128 tiles cut across. Elsewhere, and for the weights a run starts from (initialized or
// loaded: publish_params marks them stale; on the first step the forward's cast calibrates), the
// forward's cast stays.
static bool fp8_weights_by_adamw(const GPT* m) {
    return m->fp8.on && m->fp8.fuse_weights && fp8_how(m) == FP8_CAST_DELAYED && m->dp.zero == 0 &&
           m->optimizer == OPTIMIZER_ADAMW;
}

// Whether tensor kind is a matrix with FP8 copies: a layer's four, and with --fp8-head the
// embedding (the head's matrix).
static bool fp8_matrix(const GPT* m, ParamKind kind) {
    return (kind < FP8_MATRICES || kind == P_EMBED) && fp8_product(m, kind);
}

// AdamW over all the flat buffers (ZeRO 0) with the FP8 weights made by the update: one launch
// for a kind's matrix in every layer (layer 0's stands for all: each layer's bucket has one
// length, so they lie a bucket apart), one for the head's; then adamw_range over the runs between
// the FP8 matrices (each layer's norms and its bucket's padding, the embedding unless the head is
// in FP8, the final norm).
static void adamw_making_fp8_weights(GPT* m, const OptimConfig* o) {
    const ParamTable* pt = &m->table;
    GptFp8* f = &m->fp8;
    AdamwBuffers adamw = {m->params, m->master_low, m->grads, (float*)opt_part(m, m->opt_state, OPT_EXP_AVG, 0),
                          (float*)opt_part(m, m->opt_state, OPT_EXP_AVG_SQ, 0), m->decay_flags, *o, m->scalars};
    for (int i = 0; i < pt->n_tensors; i++) {
        const ParamTensor* t = &pt->tensors[i];
        if (!fp8_matrix(m, t->kind) || t->layer > 0) continue;
        int scale_stride = (int)(fp8_scale_index(&m->cfg, FP8_ROLE_WEIGHT, t->kind, 1) -
                                 fp8_scale_index(&m->cfg, FP8_ROLE_WEIGHT, t->kind, 0));
        fp8_adamw_matrices(f->weights, f->weights_t, &adamw, t->offset, (int)t->rows, (int)t->cols,
                           t->layer == 0 ? pt->n_layers : 1, bucket_len(pt, 0), fp8_scale(m, FP8_ROLE_WEIGHT, t->kind, 0),
                           scale_stride, m->stream);
    }
    size_t done = 0;  // the elements before `done` are updated, or are an FP8 matrix's
    for (int i = 0; i < pt->n_tensors; i++) {
        const ParamTensor* t = &pt->tensors[i];
        if (!fp8_matrix(m, t->kind)) continue;
        if (t->offset > done) adamw_range(m, o, m->grads, done, m->params + done, t->offset - done);
        done = t->offset + (size_t)(t->rows * t->cols);  // a PARAM_ALIGN boundary: FP8 sides are multiples of 16
    }
    adamw_range(m, o, m->grads, done, m->params + done, m->opt_len - done);
    f->weights_stale = false;
}

// Muon over every hidden matrix block (ZeRO 0: this rank holds them whole); the momentum lives in
// exp_avg at the matrix's place.
static void muon_matrices(GPT* m, const OptimConfig* o) {
    for (int i = 0; i < m->table.n_tensors; i++) {
        const ParamTensor* t = &m->table.tensors[i];
        int64_t rows[3];
        int n = muon_blocks(&m->cfg, t, rows);
        size_t at = t->offset;
        for (int k = 0; k < n; at += (size_t)rows[k] * t->cols, k++)
            muon_matrix_step(m->params + at, m->master_low + at, m->grads + at,
                             (float*)opt_part(m, m->opt_state, OPT_EXP_AVG, at),
                             (int)rows[k], (int)t->cols, &m->muon, m->act.partials, o, m->scalars, m->stream);
    }
}

static void optimizer_step(GPT* m, const OptimConfig* o) {
    fp8_agree_amaxes(m);  // queued behind the last bucket's collective: the join below waits for both
    if (m->dp.comm) comm_join(m->dp.comm, m->stream);  // every bucket's collective is done
    const float* grads = m->dp.zero == 0 ? m->grads : m->grad_shard;
    reduce_sum(&m->scalars->grad_norm_sq, grads, m->opt_len, true, false, m->act.partials, m->stream);
    // The loss, and with ZeRO 1, 2 the norm (each rank holds a share): one all-reduce of both,
    // which sit side by side in OptimScalars.
    static_assert(offsetof(OptimScalars, grad_norm_sq) == offsetof(OptimScalars, loss_sum) + sizeof(float), "");
    sum_over_ranks(m, &m->scalars->loss_sum, m->dp.zero > 0 ? 2 : 1);
    optimizer_schedule(o, m->scalars, m->stream);
    fp8_step_done(m);  // the step's amaxes into the history: the scales the new weights are cast with
    if (m->dp.zero == 0) {
        if (fp8_weights_by_adamw(m)) adamw_making_fp8_weights(m, o);
        else adamw_range(m, o, grads, 0, m->params, m->opt_len);
        if (m->optimizer == OPTIMIZER_MUON) muon_matrices(m, o);
        return;
    }
    for (int i = 0; i <= m->table.n_layers; i++) {  // piece by piece, each sent as soon as it is updated
        int b = forward_order(i, m->table.n_layers);
        adamw_range(m, o, grads, m->opt_offset[b], owned_params(m, b), bucket_piece(m, b));
        send_params(m, b);
    }
}

// Sets the device's step count (the schedule's position), e.g. on resume.
static void set_step(GPT* m, int step) {
    CUDA_CHECK(cudaMemcpy(&m->scalars->step, &step, sizeof(int), cudaMemcpyHostToDevice));
}

// ----------------------------------------------------------------------------------------------
// Hugging Face export: transformers' Qwen3 names. Our fused qkv and gate_up matrices are row
// blocks [q; k; v] and [gate; up], so each HF tensor is a contiguous range of rows of ours.

// Longest HF tensor name ("model.layers.255.post_attention_layernorm.weight" is 49 bytes), with
// room for a prefix such as "exp_avg_sq.".
#define HF_NAME_MAX 96

typedef struct {
    char name[HF_NAME_MAX];
    size_t offset;       // into the flat buffer
    int64_t rows, cols;  // rows == 1 for vectors (written as 1-d tensors)
} HfTensor;

static int hf_tensors(const GPT* m, HfTensor* out) {
    const ModelConfig* c = &m->cfg;
    int n = 0;
    size_t D = c->head_dim, F = c->ffn_dim, C = c->d_model;
#define ADD(nm, off, r, cl)                                                   \
    do {                                                                      \
        if (out) {                                                            \
            snprintf(out[n].name, sizeof(out[n].name), "%s", nm);            \
            out[n].offset = (off);                                            \
            out[n].rows = (r);                                                \
            out[n].cols = (cl);                                               \
        }                                                                     \
        n++;                                                                  \
    } while (0)
    char name[HF_NAME_MAX];
    ADD("model.embed_tokens.weight", param(&m->table, P_EMBED, 0)->offset, c->vocab_size, C);
    ADD("model.norm.weight", param(&m->table, P_FINAL_NORM, 0)->offset, 1, C);
    for (int l = 0; l < c->n_layer; l++) {
        size_t qkv = param(&m->table, P_QKV, l)->offset, gate_up = param(&m->table, P_GATE_UP, l)->offset;
        size_t q_rows = c->n_head * D, kv_rows = c->n_kv_head * D;
#define LAYER(suffix, off, r, cl)                                            \
        snprintf(name, sizeof(name), "model.layers.%d.%s", l, suffix);        \
        ADD(name, off, r, cl)
        LAYER("input_layernorm.weight", param(&m->table, P_ATTN_NORM, l)->offset, 1, C);
        LAYER("self_attn.q_proj.weight", qkv, q_rows, C);
        LAYER("self_attn.k_proj.weight", qkv + q_rows * C, kv_rows, C);
        LAYER("self_attn.v_proj.weight", qkv + (q_rows + kv_rows) * C, kv_rows, C);
        LAYER("self_attn.q_norm.weight", param(&m->table, P_Q_NORM, l)->offset, 1, D);
        LAYER("self_attn.k_norm.weight", param(&m->table, P_K_NORM, l)->offset, 1, D);
        LAYER("self_attn.o_proj.weight", param(&m->table, P_ATTN_OUT, l)->offset, C, q_rows);
        LAYER("post_attention_layernorm.weight", param(&m->table, P_MLP_NORM, l)->offset, 1, C);
        LAYER("mlp.gate_proj.weight", gate_up, F, C);
        LAYER("mlp.up_proj.weight", gate_up + F * C, F, C);
        LAYER("mlp.down_proj.weight", param(&m->table, P_DOWN, l)->offset, C, F);
#undef LAYER
    }
#undef ADD
    return n;
}

// config.json as transformers' Qwen3Config reads it, every field that matters written explicitly.
static void hf_config_text(const ModelConfig* c, char* json, size_t len) {
    snprintf(json, len,
             "{\n  \"architectures\": [\"Qwen3ForCausalLM\"],\n  \"model_type\": \"qwen3\",\n"
             "  \"vocab_size\": %d,\n  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n"
             "  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n"
             "  \"head_dim\": %d,\n  \"hidden_act\": \"silu\",\n  \"max_position_embeddings\": %d,\n"
             "  \"rms_norm_eps\": %.9g,\n  \"rope_theta\": %.9g,\n  \"rope_scaling\": null,\n"
             "  \"tie_word_embeddings\": true,\n  \"attention_bias\": false,\n  \"attention_dropout\": 0.0,\n"
             "  \"use_sliding_window\": false,\n  \"sliding_window\": null,\n  \"max_window_layers\": %d,\n"
             "  \"initializer_range\": 0.02,\n  \"bos_token_id\": %d,\n  \"eos_token_id\": %d,\n"
             "  \"torch_dtype\": \"float32\"\n}\n",
             c->vocab_size, c->d_model, c->ffn_dim, c->n_layer, c->n_head, c->n_kv_head, c->head_dim,
             c->seq_len > 4096 ? c->seq_len : 4096, c->norm_eps, c->rope_theta, c->n_layer, GPT2_EOT, GPT2_EOT);
}

// The safetensors entries of a flat fp32 buffer under HF names. names must hold n * HF_NAME_MAX
// bytes; returns n.
static int hf_st_tensors(const GPT* m, const float* flat, StTensor* st, char* names) {
    int n = hf_tensors(m, NULL);
    HfTensor* hf = (HfTensor*)malloc(n * sizeof(HfTensor));
    hf_tensors(m, hf);
    for (int i = 0; i < n; i++) {
        snprintf(names + i * HF_NAME_MAX, HF_NAME_MAX, "%s", hf[i].name);
        st[i].name = names + i * HF_NAME_MAX;
        st[i].dtype = ST_F32;
        st[i].ndim = hf[i].rows == 1 ? 1 : 2;
        st[i].shape[0] = hf[i].rows == 1 ? hf[i].cols : hf[i].rows;
        st[i].shape[1] = hf[i].cols;
        st[i].data = flat + hf[i].offset;
    }
    free(hf);
    return n;
}

// Fills a flat fp32 buffer from a safetensors file in HF names, converting bf16 and fp16 to fp32.
// Every tensor must be there with the right shape.
static bool hf_st_load(const GPT* m, const StFile* f, float* flat, char* err, size_t err_len) {
    int n = hf_tensors(m, NULL);
    HfTensor* hf = (HfTensor*)malloc(n * sizeof(HfTensor));
    hf_tensors(m, hf);
    bool ok = true;
    for (int i = 0; i < n && ok; i++) {
        const char* name = hf[i].name;
        const StTensor* t = st_find(f, name);
        int64_t count = hf[i].rows * hf[i].cols;
        bool shape_ok = t && (hf[i].rows == 1 ? t->ndim == 1 && t->shape[0] == hf[i].cols
                                             : t->ndim == 2 && t->shape[0] == hf[i].rows && t->shape[1] == hf[i].cols);
        if (!t) {
            snprintf(err, err_len, "%s: tensor %s is missing", f->path, name);
            ok = false;
        } else if (!shape_ok) {
            snprintf(err, err_len, "%s: tensor %s has the wrong shape for this model config", f->path, name);
            ok = false;
        } else if (t->dtype != ST_F32 && t->dtype != ST_BF16 && t->dtype != ST_F16) {
            snprintf(err, err_len, "%s: tensor %s is %s; F32, BF16 or F16 expected", f->path, name,
                     st_dtype_name(t->dtype));
            ok = false;
        } else {
            float* dst = flat + hf[i].offset;
            const uint8_t* src = (const uint8_t*)t->data;  // may be unaligned in files of other writers
            for (int64_t j = 0; j < count; j++) {
                if (t->dtype == ST_F32) {
                    memcpy(&dst[j], src + 4 * j, 4);
                } else {
                    uint16_t bits;
                    memcpy(&bits, src + 2 * j, 2);
                    if (t->dtype == ST_BF16) {
                        uint32_t wide = (uint32_t)bits << 16;
                        memcpy(&dst[j], &wide, 4);
                    } else {
                        __half_raw raw;
                        raw.x = bits;
                        dst[j] = __half2float(__half(raw));
                    }
                }
            }
        }
    }
    free(hf);
    return ok;
}

// Writes dir/config.json and dir/model.safetensors (fp32). `weights` is a host copy of a flat
// parameter buffer in fp32: the master weights for an export, or the bf16 compute weights
// widened to fp32 when comparing computations (so that both sides see the same numbers).
static bool export_hf(const GPT* m, const float* weights, const char* dir, char* err, size_t err_len) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        snprintf(err, err_len, "cannot create export directory %s: %s", dir, strerror(errno));
        return false;
    }
    int n = hf_tensors(m, NULL);
    StTensor* st = (StTensor*)calloc(n, sizeof(StTensor));
    char* names = (char*)malloc((size_t)n * HF_NAME_MAX);
    hf_st_tensors(m, weights, st, names);
    char path[1024], config[2048];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    const char* meta[] = {"format", "pt"};
    bool ok = st_write(path, st, n, meta, 1, err, err_len) == 0;
    snprintf(path, sizeof(path), "%s/config.json", dir);
    hf_config_text(&m->cfg, config, sizeof(config));
    ok = ok && ck_write_file_atomic(path, config, strlen(config), err, err_len) == 0;
    free(st);
    free(names);
    return ok;
}

// A host copy of the bf16 weights or of the gradients (one GPU), widened to fp32.
static float* download_flat(const GPT* m, const void* device, bool is_bf16) {
    size_t n = m->table.n_elements;
    float* host = (float*)malloc(n * sizeof(float));
    if (is_bf16) {
        bf16* tmp = (bf16*)malloc(n * sizeof(bf16));
        CUDA_CHECK(cudaMemcpy(tmp, device, n * sizeof(bf16), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) host[i] = __bfloat162float(tmp[i]);
        free(tmp);
    } else {
        CUDA_CHECK(cudaMemcpy(host, device, n * sizeof(float), cudaMemcpyDeviceToHost));
    }
    return host;
}

// ----------------------------------------------------------------------------------------------
// Checkpoints: everything needed to continue a run as if it had never stopped.
//
// ckpt.h writes each checkpoint as a directory <out>/ckpt_<step>/ (files go into
// ckpt_<step>.tmp/, are fsynced, the directory is renamed, then `latest` is updated atomically;
// a manifest records every file's size and CRC32C). Ours holds:
//   model.safetensors      fp32 master weights under transformers' Qwen3 names
//   config.json            transformers' config: the directory also loads as a Qwen3 model
//   optimizer.<r>-of-<S>.safetensors   the optimizer's state tensors, shard r of S (below)
//   trainer_state.bin      the step count, the data loader's state and the trainer's RNGs
//   fp8_scales.bin         FP8 runs: the scales and their amax histories (lib/fp8.cuh)
// and the manifest's config object is the ModelConfig, which a resume must match exactly, with
// the number of optimizer shards and of GPUs of the run that wrote it. The learning rate is a
// function of the step, so the step restores the schedule's position.
//
// The optimizer's state is stored as the optimizer holds it: bucket by bucket, cut into S shards, one
// per rank with ZeRO 1 and 2 (each rank writes its own file), one with ZeRO 0 (rank 0 writes it).
// Shard r of bucket b is comm.h's CommShards range r of the bucket's used elements: exactly the
// piece owned_part gives rank r, padding excluded. A run with another number of shards builds its
// pieces from the old ones with comm_reshard_plan, so resuming on another number of GPUs is a
// matter of ranges. Rank 0 owns the checkpoint directory, writes the rest (gathering the master
// weights when they are sharded) and commits once every rank's receipt is in (ckpt.h).

#define TRAINER_STATE_MAGIC 0x54475054u  // "TGPT"
#define TRAINER_STATE_VERSION 1
#define CKPT_PEER_WAIT_S 600.0  // how long rank 0 waits for another rank's shard (a dead rank is
                                // caught sooner, by the comm watchdog)
typedef struct {
    uint32_t magic, version;
    int64_t step;            // optimizer steps completed
    uint64_t bench_rng;      // the synthetic-token generator of --bench
    uint64_t sample_rng;     // the text sampler's
    int32_t has_loader;
    LoaderState loader;      // the training loader, positioned at the next step's first batch
} TrainerState;

// FP8's scaling state: the delayed scales' amax histories decide the next steps' scales, so an
// FP8 run resumes bit for bit only with them. Rank 0's, which with data parallelism are every
// rank's (fp8_agree_amaxes). A header, then the Fp8Scale array (fp8_n_scales: the layers', then
// the head's). Version 2 added the head's scales and the head flag; a file of another version, a
// BF16 run, the other scaling or the other --fp8-head leaves the scales to start afresh.
#define FP8_STATE_MAGIC 0x38504654u  // "TFP8"
#define FP8_STATE_VERSION 2
typedef struct {
    uint32_t magic, version;
    int32_t scaling;         // Fp8Scaling
    int32_t calibrated;      // delayed: a step has filled the history
    int32_t head;            // --fp8-head: the head's scales are in use
    int32_t zero;            // 0: n_scales stays 8-byte aligned with no padding of unknown bytes
    int64_t n_scales;
} Fp8StateHeader;

static size_t fp8_state_bytes(const GPT* m) { return sizeof(Fp8StateHeader) + fp8_n_scales(&m->cfg) * sizeof(Fp8Scale); }

// The header of the snapshot being taken (its scales are copied from the device behind it).
static void fp8_state_header(const GPT* m, void* state) {
    Fp8StateHeader h = {FP8_STATE_MAGIC, FP8_STATE_VERSION, (int32_t)m->fp8.scaling, m->fp8.calibrated, m->fp8.head, 0,
                        (int64_t)fp8_n_scales(&m->cfg)};
    memcpy(state, &h, sizeof(h));
}

// Restores a snapshot into the model, or says in one line why the run starts its scales afresh.
static void fp8_state_restore(GPT* m, const void* state, size_t len, const char* dir) {
    Fp8StateHeader h = {};
    if (state && len >= sizeof(h)) memcpy(&h, state, sizeof(h));
    const char* why = !state || h.magic != FP8_STATE_MAGIC       ? "no FP8 scales"
                      : h.version != FP8_STATE_VERSION             ? "FP8 scales of another version"
                      : len != fp8_state_bytes(m)                  ? "FP8 scales of another model"
                      : h.scaling != (int32_t)m->fp8.scaling       ? "FP8 scales of the other scaling"
                      : h.head != (int32_t)m->fp8.head             ? "FP8 scales of the other --fp8-head"
                                                                   : NULL;
    if (why) {
        printf("fp8: %s holds %s; the scales start afresh\n", dir, why);
        return;
    }
    CUDA_CHECK(cudaMemcpy(m->fp8.scales, (const uint8_t*)state + sizeof(h), len - sizeof(h), cudaMemcpyHostToDevice));
    m->fp8.calibrated = h.calibrated != 0;
}

// Into how many shards this run cuts the optimizer state, and which one is this rank's.
static int optimizer_shards(const GPT* m) { return m->dp.zero > 0 ? m->dp.world : 1; }
static int optimizer_shard(const GPT* m) { return m->dp.zero > 0 ? m->dp.rank : 0; }

// The manifest's config object: the model (lib/config.h's fields), and how the run that wrote it
// was sharded.
static void checkpoint_config_json(const GPT* m, JsonWriter* w) {
    jw_object_begin(w);
    model_config_members(&m->cfg, w);
    jw_key(w, "optimizer_shards");
    jw_int(w, optimizer_shards(m));
    jw_key(w, "gpus");
    jw_int(w, m->dp.world);
    jw_key(w, "optimizer");
    jw_string(w, OPTIMIZER_NAMES[m->optimizer]);
    jw_object_end(w);
}

static void optimizer_file_name(char* out, size_t n, int shard, int n_shards) {
    snprintf(out, n, "optimizer.%d-of-%d.safetensors", shard, n_shards);
}

// The receipt (ckpt.h) by which the rank writing shard `shard` tells rank 0 its file is written.
static void receipt_name(char* out, size_t n, int shard) { snprintf(out, n, "receipt.%d", shard); }

// This rank's shard of the optimizer's state (a host copy of its opt_state) as one file: per state
// tensor and bucket b, "<name>.<b>", 1-d (AdamW, Muon: exp_avg.<b> and exp_avg_sq.<b>, fp32; 8-bit
// AdamW: the U8 codes and the F32 scales of both moments; a bucket with no elements here has none).
static int add_optimizer_shard(CkptWriter* w, const GPT* m, const void* opt_state, char* err, size_t err_len) {
    const ParamTable* pt = &m->table;
    int n_buckets = pt->n_layers + 1, shard = optimizer_shard(m), n_shards = optimizer_shards(m), n = 0;
    StTensor* st = (StTensor*)xcalloc(m->n_opt_tensors * n_buckets, sizeof(StTensor));
    char(*names)[32] = (char(*)[32])xcalloc(m->n_opt_tensors * n_buckets, 32);
    for (int k = 0; k < m->n_opt_tensors; k++) {
        const OptStateTensor* t = &m->opt_tensors[k];
        for (int b = 0; b < n_buckets; b++) {
            CommShards shards = bucket_split(pt->bucket_used[b], n_shards);
            CommRange mine = comm_shard_range(&shards, shard);
            if (mine.end == mine.begin) continue;
            snprintf(names[n], 32, "%s.%d", t->name, b);
            st[n] = (StTensor){names[n], t->dtype, 1, {(int64_t)((mine.end - mine.begin) / t->per)},
                               opt_part(m, opt_state, k, m->opt_offset[b])};
            n++;
        }
    }
    char file[64];
    optimizer_file_name(file, sizeof(file), shard, n_shards);
    int rc = ckpt_add_safetensors(w, file, st, n, NULL, 0, err, err_len);
    free(st);
    free(names);
    return rc;
}

// Rank 0's part of a checkpoint: it owns the directory, writes the model, the configs, the trainer
// state and its shard, and commits once every other shard's receipt has come in.
static bool checkpoint_write_owner(const GPT* m, const float* master, const void* opt_state, const void* fp8_state,
                                   const TrainerState* state, const char* out_dir, int keep_last, char* err,
                                   size_t err_len) {
    int n = hf_tensors(m, NULL);
    StTensor* st = (StTensor*)xcalloc(n, sizeof(StTensor));
    char* names = (char*)xmalloc((size_t)n * HF_NAME_MAX);
    hf_st_tensors(m, master, st, names);
    char hf_config[2048];
    hf_config_text(&m->cfg, hf_config, sizeof(hf_config));
    JsonWriter config;
    jw_init(&config, 0);
    checkpoint_config_json(m, &config);
    CkptWriter w;
    bool ok = ckpt_begin(&w, out_dir, state->step, err, err_len) == 0 &&
              ckpt_add_safetensors(&w, "model.safetensors", st, n, NULL, 0, err, err_len) == 0 &&
              ckpt_add_file(&w, "config.json", hf_config, strlen(hf_config), err, err_len) == 0 &&
              add_optimizer_shard(&w, m, opt_state, err, err_len) == 0 &&
              ckpt_add_file(&w, "trainer_state.bin", state, sizeof(*state), err, err_len) == 0 &&
              (!fp8_state || ckpt_add_file(&w, "fp8_scales.bin", fp8_state, fp8_state_bytes(m), err, err_len) == 0);
    for (int r = 1; ok && r < optimizer_shards(m); r++) {
        char receipt[32];
        receipt_name(receipt, sizeof(receipt), r);
        ok = ckpt_take_receipt(&w, receipt, CKPT_PEER_WAIT_S, err, err_len) == 0;
    }
    ok = ok && ckpt_commit(&w, jw_text(&config), keep_last, err, err_len) == 0;
    if (!ok) ckpt_abort(&w);
    jw_free(&config);
    free(st);
    free(names);
    return ok;
}

// Every other rank's part (ZeRO 1, 2): its shard of the optimizer's state into rank 0's directory,
// and a receipt that says what it wrote, or why it could not.
static bool checkpoint_write_shard(const GPT* m, const void* opt_state, int64_t step,
                                   const char* out_dir, char* err, size_t err_len) {
    CkptWriter w;
    char receipt[32];
    receipt_name(receipt, sizeof(receipt), optimizer_shard(m));
    if (ckpt_join(&w, out_dir, step, CKPT_PEER_WAIT_S, err, err_len) != 0) return false;
    bool ok = add_optimizer_shard(&w, m, opt_state, err, err_len) == 0;
    char receipt_err[1024];
    if (ckpt_send_receipt(&w, receipt, ok ? NULL : err, receipt_err, sizeof(receipt_err)) != 0 && ok) {
        snprintf(err, err_len, "%s", receipt_err);
        ok = false;
    }
    return ok;
}

// This run's pieces of the optimizer's state (opt_state's layout) from a checkpoint's S shard
// files, whatever S is: per bucket, comm_reshard_plan says which ranges of which old shards make
// this rank's piece. Only the files it names are mapped here (ckpt_open has already read every file
// of the checkpoint once, on every rank, to check its CRC32C). The ranges start and end on
// PARAM_ALIGN boundaries, so an 8-bit AdamW scale (one per Q8_BLOCK = PARAM_ALIGN elements) moves
// whole.
static bool read_optimizer_shards(const GPT* m, const CkptReader* r, int old_shards, void* opt_state, char* err,
                                  size_t err_len) {
    const ParamTable* pt = &m->table;
    StFile* files = (StFile*)xcalloc(old_shards, sizeof(StFile));
    CommCopy* copies = (CommCopy*)xcalloc(old_shards, sizeof(CommCopy));
    bool ok = true;
    for (int b = 0; ok && b <= pt->n_layers; b++) {
        CommShards from = bucket_split(pt->bucket_used[b], old_shards),
                   to = bucket_split(pt->bucket_used[b], optimizer_shards(m));
        int n_copies = 0;
        ok = comm_reshard_plan(&from, &to, optimizer_shard(m), copies, old_shards, &n_copies, err, err_len) == 0;
        for (int i = 0; ok && i < n_copies; i++) {
            const CommCopy* cp = &copies[i];
            StFile* f = &files[cp->old_rank];
            char file[64];
            optimizer_file_name(file, sizeof(file), cp->old_rank, old_shards);
            if (!f->map) ok = ckpt_open_safetensors(r, file, f, err, err_len) == 0;
            CommRange theirs = comm_shard_range(&from, cp->old_rank);
            for (int k = 0; ok && k < m->n_opt_tensors; k++) {
                const OptStateTensor* o = &m->opt_tensors[k];
                char name[32];
                snprintf(name, sizeof(name), "%s.%d", o->name, b);
                const StTensor* t = st_find(f, name);
                size_t len = (theirs.end - theirs.begin) / o->per;
                if (!t || t->dtype != o->dtype || t->ndim != 1 || t->shape[0] != (int64_t)len) {
                    snprintf(err, err_len, "%s/%s: tensor %s is missing or not %s [%zu]", r->dir, file, name,
                             st_dtypes[o->dtype].name, len);
                    ok = false;
                } else {
                    memcpy(opt_part(m, opt_state, k, m->opt_offset[b] + cp->new_offset),
                           (const uint8_t*)t->data + cp->old_offset / o->per * o->bytes, cp->count / o->per * o->bytes);
                }
            }
        }
    }
    for (int q = 0; q < old_shards; q++) st_close(&files[q]);
    free(files);
    free(copies);
    return ok;
}

// What a resume needs from the manifest's config: the model must match; the shards may differ.
static bool checkpoint_config_read(const GPT* m, const CkptReader* r, int* old_shards, int* old_gpus, char* err,
                                   size_t err_len) {
    int64_t shards, gpus;
    if (!model_config_matches(&m->cfg, &r->manifest, r->config, err, err_len)) return false;
    if (json_get_int(&r->manifest, r->config, "optimizer_shards", &shards) != 0 || shards < 1 || shards > 65536 ||
        json_get_int(&r->manifest, r->config, "gpus", &gpus) != 0 || gpus < 1 || gpus > 65536) {
        snprintf(err, err_len, "%s/manifest.json: the config has no \"optimizer_shards\" and \"gpus\" in [1, 65536]",
                 r->dir);
        return false;
    }
    // Checkpoints from before --optimizer existed have no "optimizer": they were AdamW's.
    const char* optimizer = "adamw";  // kept when the manifest has none
    json_get_string(&r->manifest, r->config, "optimizer", &optimizer);
    if (strcmp(optimizer, OPTIMIZER_NAMES[m->optimizer]) != 0) {
        snprintf(err, err_len, "%s was written with --optimizer %s, and this run has --optimizer %s: an optimizer's "
                 "state cannot continue as another's (resume with --optimizer %s)", r->dir, optimizer,
                 OPTIMIZER_NAMES[m->optimizer], optimizer);
        return false;
    }
    *old_shards = (int)shards;
    *old_gpus = (int)gpus;
    return true;
}

// What a resume takes from a checkpoint, in host memory.
typedef struct {
    float* master;              // [n_elements] the flat layout, zeroed padding
    void* opt_state;            // [opt_state_bytes] this rank's pieces of the optimizer's state, its layout
    TrainerState state;
    void* fp8_state;            // fp8_scales.bin (malloc'd), or NULL when the checkpoint has none
    size_t fp8_state_len;
    int old_shards, old_gpus;   // how the run that wrote it was sharded
} Restored;

// A listed file read whole (verified), or none when the manifest does not list it.
static bool read_optional_file(const CkptReader* r, const char* name, void** data, size_t* len, char* err,
                               size_t err_len) {
    *data = NULL;
    *len = 0;
    return !ckpt_find_file(r, name) || ckpt_read_file(r, name, data, len, err, err_len) == 0;
}

// Reads and verifies (checksums, config) a checkpoint directory into `out`, whose two arrays the
// caller allocated.
static bool checkpoint_read(const GPT* m, const char* dir, Restored* out, char* err, size_t err_len) {
    CkptReader r;
    if (ckpt_open(&r, dir, err, err_len) != 0) return false;
    bool ok = checkpoint_config_read(m, &r, &out->old_shards, &out->old_gpus, err, err_len);
    StFile model;
    memset(out->master, 0, m->table.n_elements * 4);
    memset(out->opt_state, 0, m->opt_state_bytes);
    if (ok && ckpt_open_safetensors(&r, "model.safetensors", &model, err, err_len) == 0) {
        ok = hf_st_load(m, &model, out->master, err, err_len);
        st_close(&model);
    } else {
        ok = false;
    }
    ok = ok && read_optimizer_shards(m, &r, out->old_shards, out->opt_state, err, err_len);
    void* bytes = NULL;
    size_t len = 0;
    if (ok && ckpt_read_file(&r, "trainer_state.bin", &bytes, &len, err, err_len) == 0) {
        const TrainerState* s = (const TrainerState*)bytes;
        if (len != sizeof(TrainerState) || s->magic != TRAINER_STATE_MAGIC || s->version != TRAINER_STATE_VERSION) {
            snprintf(err, err_len, "%s/trainer_state.bin: not a trainer state of this version of train_gpt", dir);
            ok = false;
        } else {
            out->state = *s;
        }
        free(bytes);
    } else {
        ok = false;
    }
    ok = ok && read_optional_file(&r, "fp8_scales.bin", &out->fp8_state, &out->fp8_state_len, err, err_len);
    ckpt_close(&r);
    return ok;
}

// n fp32 master weights on the host into their two halves (master_split), and back (master_join).
static void master_split_all(bf16* w, int16_t* low, const float* master, size_t n) {
    for (size_t i = 0; i < n; i++) w[i] = master_split(master[i], &low[i]);
}

static void master_join_all(float* master, const bf16* w, const int16_t* low, size_t n) {
    for (size_t i = 0; i < n; i++) master[i] = master_join(w[i], low[i]);
}

// Puts the master weights (a host copy of the whole flat layout, fp32) on the GPU, this rank's
// parts of them, split into their two halves, and the optimizer's state when given (a host copy of
// opt_state). The halves are made a bucket's part at a time, in host buffers one bucket long.
static void gpt_upload_state(GPT* m, const float* master, const void* opt_state) {
    size_t most = largest_bucket(&m->table, m->table.n_layers + 1);  // no rank's part of a bucket is longer
    bf16* w = (bf16*)xmalloc(most * sizeof(bf16));
    int16_t* low = (int16_t*)xmalloc(most * sizeof(int16_t));
    for (int b = 0; b <= m->table.n_layers; b++) {
        size_t begin, end;
        owned_part(m, b, &begin, &end);
        master_split_all(w, low, master + begin, end - begin);
        CUDA_CHECK(cudaMemcpy(m->params + begin, w, (end - begin) * 2, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(m->master_low + m->opt_offset[b], low, (end - begin) * 2, cudaMemcpyHostToDevice));
    }
    free(w);
    free(low);
    if (opt_state) CUDA_CHECK(cudaMemcpy(m->opt_state, opt_state, m->opt_state_bytes, cudaMemcpyHostToDevice));
    publish_params(m);
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
}

// The reverse, the master weights' two halves of the whole flat layout into pinned or pageable host
// memory: with ZeRO 0 two copies queued on `stream` (the model's, or the checkpointer's side stream
// behind the update); with ZeRO 1/2 on the comm stream, after `stream`'s work so far and joined back
// into it: the optimizer step's all-gathers have run there first, so the bf16 halves are whole on
// every rank, while the low halves come by an all-gather per bucket through a gradient buffer,
// which is free between steps and zeroed again after (its padding must read zero: grads_accumulate).
// Every rank must call it; the host arrays are filled on rank 0 only (other ranks pass NULL). The
// caller synchronizes, and joins the halves (master_join).
static void gpt_download_master(GPT* m, bf16* host_w, int16_t* host_low, cudaStream_t stream) {
    const ParamTable* pt = &m->table;
    size_t n = pt->n_elements;
    if (m->dp.zero == 0) {
        if (!host_w) return;
        CUDA_CHECK(cudaMemcpyAsync(host_w, m->params, n * 2, cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaMemcpyAsync(host_low, m->master_low, n * 2, cudaMemcpyDeviceToHost, stream));
        return;
    }
    Comm* c = m->dp.comm;
    comm_follow(c, stream);
    if (host_w) CUDA_CHECK(cudaMemcpyAsync(host_w, m->params, n * 2, cudaMemcpyDeviceToHost, c->stream));
    for (int b = 0; b <= pt->n_layers; b++) {
        float* whole = m->dp.zero == 1 ? m->grads + pt->bucket_offset[b]
                       : b == pt->n_layers ? m->grad_tail : m->grad_ring[0];
        comm_all_gather(c, m->master_low + m->opt_offset[b], whole, bucket_piece(m, b), sizeof(int16_t));
        if (host_low)
            CUDA_CHECK(cudaMemcpyAsync(host_low + pt->bucket_offset[b], whole, bucket_len(pt, b) * 2,
                                       cudaMemcpyDeviceToHost, c->stream));
        CUDA_CHECK(cudaMemsetAsync(whole, 0, bucket_len(pt, b) * 2, c->stream));
    }
    comm_join(c, stream);
}

// The master weights of the whole flat layout in fp32, into `host` on rank 0 (NULL on the other
// ranks, which must call it too): downloaded, then joined.
static void gpt_gather_master(GPT* m, float* host) {
    size_t n = m->table.n_elements;
    bf16* w = host ? (bf16*)xmalloc(n * sizeof(bf16)) : NULL;
    int16_t* low = host ? (int16_t*)xmalloc(n * sizeof(int16_t)) : NULL;
    gpt_download_master(m, w, low, m->stream);
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    if (host) master_join_all(host, w, low, n);
    free(w);
    free(low);
}

#ifndef TRAIN_GPT_NO_MAIN
// ----------------------------------------------------------------------------------------------
// The command line

// --recompute: how many layers recompute (activations_layout): none, every one, or the fewest that
// fit (trainer_choose_recompute).
typedef enum { RECOMPUTE_NONE, RECOMPUTE_ALL, RECOMPUTE_AUTO, N_RECOMPUTE } RecomputeChoice;
static const char* const RECOMPUTE_NAMES[N_RECOMPUTE] = {"0", "1", "auto"};

typedef struct {
    ModelConfig model;
    OptimConfig optim;
    int batch_size;          // B: sequences per micro-batch
    int total_batch_tokens;  // tokens per optimizer step over all GPUs; a multiple of B*T*GPUs (accumulation)
    int recompute;           // RecomputeChoice
    float max_memory;        // GiB the plan may take at most (0: no limit); --recompute auto chooses within it
    int deterministic;
    int loss_chunk;
    uint64_t seed;
    const char* train_data;
    const char* val_data;
    int val_every, val_batches;
    const char* out_dir;
    const char* export_dir;
    const char* dump_grads_dir;
    int bench, bench_steps;
    float peak_tflops;
    int sample_every, sample_len;
    const char* prompt;
    float temperature;
    const char* tokenizer_dir;
    uint64_t sample_seed;
    int ckpt_every, keep_last, ckpt_keep_going;
    int stop_at;
    const char* resume;
    char resume_dir[CK_PATH_MAX];  // the checkpoint --resume names ("latest" resolved in --out by check_inputs)
    const char* init_from;
    int gpus, zero;          // data parallelism: ranks started here (without a launcher), ZeRO mode
    const char* master;      // host:port of rank 0, for Slurm without MASTER_ADDR / MASTER_PORT
    float timeout;           // seconds without progress before a rank gives up on its peers
    const char* model_flag;  // a flag of the model's that config.json sets too (for --init-from's check)
    int fp8;                 // 1: the layers' matrices in FP8
    int fp8_scaling;         // Fp8Scaling
    int fp8_head;            // 1: the output head in FP8 too
    int fp8_fast_accum;      // 1: the FP8 forward products with cuBLASLt's fast accumulation
    int fp8_log_scales;      // 1: every logged step also logs the scales
    int optimizer;           // OptimizerKind
    int cuda_graph;          // 1 (default): each step replays one captured CUDA graph (StepGraph), where it can
    int matmul_tune;         // 1 (default): each cuBLASLt shape runs its fastest candidate with the same bits
} Options;

// OPT_BOOL: 0 or 1. OPT_CHOICE: one of the spec's words; the value (an int) is the word's index.
typedef enum { OPT_INT, OPT_BOOL, OPT_FLOAT, OPT_STR, OPT_U64, OPT_FLAG, OPT_CHOICE } OptType;
typedef struct {
    const char* name;
    OptType type;
    void* value;
    const char* help;
    const char* const* words;  // OPT_CHOICE: the words it takes, n_words of them
    int n_words;
} OptionSpec;

static int option_specs(Options* o, OptionSpec* specs) {
    OptionSpec all[] = {
        {"--vocab", OPT_INT, &o->model.vocab_size, "vocabulary size (rows of the tied embedding)"},
        {"--d-model", OPT_INT, &o->model.d_model, "model width"},
        {"--layers", OPT_INT, &o->model.n_layer, "number of transformer layers"},
        {"--heads", OPT_INT, &o->model.n_head, "query heads"},
        {"--kv-heads", OPT_INT, &o->model.n_kv_head, "key/value heads (1: MQA, = heads: MHA)"},
        {"--head-dim", OPT_INT, &o->model.head_dim, "channels per head (64 or 128)"},
        {"--ffn", OPT_INT, &o->model.ffn_dim, "SwiGLU hidden width"},
        {"--seq", OPT_INT, &o->model.seq_len, "sequence length T"},
        {"--rope-theta", OPT_FLOAT, &o->model.rope_theta, "RoPE base"},
        {"--norm-eps", OPT_FLOAT, &o->model.norm_eps, "RMSNorm epsilon"},
        {"--batch", OPT_INT, &o->batch_size, "sequences per micro-batch B"},
        {"--total-batch", OPT_INT, &o->total_batch_tokens, "tokens per optimizer step (0: one micro-batch)"},
        {"--steps", OPT_INT, &o->optim.total_steps, "optimizer steps"},
        {"--lr", OPT_FLOAT, &o->optim.lr, "peak learning rate"},
        {"--min-lr-frac", OPT_FLOAT, &o->optim.min_lr_frac, "final learning rate as a fraction of --lr"},
        {"--warmup", OPT_INT, &o->optim.warmup_steps, "linear warmup steps"},
        {"--wsd", OPT_BOOL, &o->optim.wsd, "1: warmup-stable-decay schedule; 0: cosine"},
        {"--decay-frac", OPT_FLOAT, &o->optim.decay_frac, "WSD: fraction of the steps spent decaying"},
        {"--weight-decay", OPT_FLOAT, &o->optim.weight_decay, "AdamW decoupled weight decay (matrices only)"},
        {"--beta1", OPT_FLOAT, &o->optim.beta1, "AdamW beta1"},
        {"--beta2", OPT_FLOAT, &o->optim.beta2, "AdamW beta2"},
        {"--adam-eps", OPT_FLOAT, &o->optim.eps, "AdamW epsilon"},
        {"--grad-clip", OPT_FLOAT, &o->optim.grad_clip, "clip the global gradient norm to this (0: off)"},
        {"--optimizer", OPT_CHOICE, &o->optimizer,
         "the update rule (muon: Muon for the layers' matrices, AdamW for the rest, --zero 0; adamw8bit: 8-bit moments)",
         OPTIMIZER_NAMES, N_OPTIMIZERS},
        {"--muon-lr", OPT_FLOAT, &o->optim.muon_lr, "Muon's peak learning rate (the schedule of --lr, scaled)"},
        {"--muon-momentum", OPT_FLOAT, &o->optim.muon_momentum, "Muon's (Nesterov) momentum"},
        {"--recompute", OPT_CHOICE, &o->recompute,
         "which layers recompute their norms, QK rope and SwiGLU in the backward (1: every one; auto: the fewest "
         "that fit the GPU's free memory, or --max-memory)", RECOMPUTE_NAMES, N_RECOMPUTE},
        {"--max-memory", OPT_FLOAT, &o->max_memory,
         "GiB of GPU memory the run may plan at most (0: no limit); with --recompute auto, the fewest recomputed "
         "layers that fit it"},
        {"--deterministic", OPT_BOOL, &o->deterministic,
         "1: bitwise reproducible steps; 0: attention adds dQ in any order (faster only at long seq)"},
        {"--loss-chunk", OPT_INT, &o->loss_chunk, "rows of logits materialized at once"},
        {"--seed", OPT_U64, &o->seed, "seed of the initialization (and of the data order)"},
        {"--train-data", OPT_STR, &o->train_data, "glob of training shards"},
        {"--val-data", OPT_STR, &o->val_data, "glob of validation shards"},
        {"--val-every", OPT_INT, &o->val_every, "validate every N steps (0: only at the end)"},
        {"--val-batches", OPT_INT, &o->val_batches, "micro-batches per validation (at most the split)"},
        {"--out", OPT_STR, &o->out_dir, "output directory (log.jsonl, exports)"},
        {"--export", OPT_STR, &o->export_dir, "after training, export transformers' Qwen3 format to DIR"},
        {"--dump-grads", OPT_STR, &o->dump_grads_dir,
         "after training, write one batch's loss, tokens and gradient norms with the weights to DIR"},
        {"--bench", OPT_FLAG, &o->bench, "benchmark on synthetic tokens; print one JSON line"},
        {"--bench-steps", OPT_INT, &o->bench_steps, "timed steps of --bench"},
        {"--peak-tflops", OPT_FLOAT, &o->peak_tflops, "the GPU's dense bf16 TFLOP/s, for MFU"},
        {"--sample-every", OPT_INT, &o->sample_every, "print text generated by the model every N steps (0: never)"},
        {"--sample-len", OPT_INT, &o->sample_len, "tokens generated per sample"},
        {"--prompt", OPT_STR, &o->prompt, "text the samples continue (empty: start of a document)"},
        {"--temperature", OPT_FLOAT, &o->temperature, "sampling temperature (0: greedy)"},
        {"--sample-seed", OPT_U64, &o->sample_seed, "seed of the text sampler"},
        {"--tokenizer", OPT_STR, &o->tokenizer_dir, "directory with GPT-2's encoder.json and vocab.bpe"},
        {"--ckpt-every", OPT_INT, &o->ckpt_every, "write a checkpoint to OUT/ckpt_<step> every N steps (0: never)"},
        {"--keep-last", OPT_INT, &o->keep_last, "checkpoints kept (older ones are deleted)"},
        {"--ckpt-keep-going", OPT_BOOL, &o->ckpt_keep_going,
         "1: a failed checkpoint write is reported and retried at the next interval; 0: it stops training"},
        {"--stop-at", OPT_INT, &o->stop_at,
         "stop after this step as if preempted (checkpointing it), to be resumed later (0: run to --steps)"},
        {"--resume", OPT_STR, &o->resume, "continue from a checkpoint: 'latest' (in --out) or its directory"},
        {"--init-from", OPT_STR, &o->init_from,
         "start from a transformers Qwen3 checkpoint directory (its config.json sets the model)"},
        {"--gpus", OPT_INT, &o->gpus, "GPUs of this machine to train on, one process each (no launcher needed); 0: all of them"},
        {"--zero", OPT_INT, &o->zero,
         "0: every GPU holds everything; 1: optimizer state sharded; 2: gradients sharded too"},
        {"--master", OPT_STR, &o->master, "host:port of rank 0 under Slurm when MASTER_ADDR/PORT are not set"},
        {"--timeout", OPT_FLOAT, &o->timeout, "seconds a rank waits for its peers (start-up, or a step) before it stops"},
        {"--fp8", OPT_BOOL, &o->fp8, "1: every layer's four matmuls in FP8 (E4M3 weights and activations, E5M2 gradients)"},
        {"--fp8-scaling", OPT_CHOICE, &o->fp8_scaling,
         "where FP8's per-tensor scales come from (delayed: an amax history of 16 steps; current: each tensor's amax, "
         "one more pass)",
         FP8_SCALING_NAMES, sizeof(FP8_SCALING_NAMES) / sizeof(FP8_SCALING_NAMES[0])},
        {"--fp8-head", OPT_BOOL, &o->fp8_head, "1: the output head's matmuls in FP8 too (needs --fp8 1)"},
        {"--fp8-fast-accum", OPT_BOOL, &o->fp8_fast_accum,
         "1: FP8 forward matmuls accumulate without promotion to fp32 (faster, less exact; needs --fp8 1)"},
        {"--fp8-log-scales", OPT_BOOL, &o->fp8_log_scales,
         "1: each step's log also gives the FP8 scales (exponent ranges, largest amax; needs --fp8 1)"},
        {"--cuda-graph", OPT_BOOL, &o->cuda_graph,
         "1: capture a step's launches once as a CUDA graph and replay it (modes it cannot capture say so and run "
         "eagerly); 0: launch every kernel of every step"},
        {"--matmul-tune", OPT_BOOL, &o->matmul_tune,
         "1: in the warm-up steps, time cuBLASLt's candidate algorithms in turn at each shape and keep the fastest "
         "whose result has the same bits as its first choice; 0: take its first choice"},
    };
    int n = (int)(sizeof(all) / sizeof(all[0]));
    if (specs) memcpy(specs, all, sizeof(all));
    return n;
}

static void options_default(Options* o) {
    memset(o, 0, sizeof(*o));
    o->model = DEFAULT_CONFIG;
    o->optim.lr = 6e-4f;
    o->optim.min_lr_frac = 0.1f;
    o->optim.weight_decay = 0.1f;
    o->optim.beta1 = 0.9f;
    o->optim.beta2 = 0.95f;
    o->optim.eps = 1e-8f;
    o->optim.grad_clip = 1.0f;
    o->optim.warmup_steps = 30;
    o->optim.total_steps = 300;
    o->optim.wsd = 0;
    o->optim.decay_frac = 0.2f;
    o->optim.muon_lr = 0.02f;
    o->optim.muon_momentum = 0.95f;
    o->optimizer = OPTIMIZER_ADAMW;
    o->batch_size = 32;
    o->recompute = RECOMPUTE_ALL;
    o->deterministic = 1;
    o->loss_chunk = 4096;
    o->seed = 1337;
    o->train_data = "data/default/train_*.bin";
    o->val_data = "data/default/val_*.bin";
    o->val_every = 50;
    o->val_batches = 20;
    o->out_dir = "out";
    o->bench_steps = 30;
    o->peak_tflops = 989.0f;
    o->sample_every = 100;
    o->sample_len = 64;
    o->prompt = "";
    o->temperature = 0.8f;
    o->tokenizer_dir = "data/tokenizer";
    o->sample_seed = 42;
    o->ckpt_every = 100;
    o->keep_last = 2;
    o->gpus = 1;
    o->zero = 0;
    o->timeout = 50.0f;
    o->fp8 = 0;
    o->fp8_scaling = FP8_DELAYED;
    o->fp8_head = 0;
    o->fp8_fast_accum = 0;
    o->fp8_log_scales = 0;
    o->cuda_graph = 1;  // 0.5-1% a step (doc/perf.md, "CUDA graphs")
    o->matmul_tune = 1;
}

// An OPT_CHOICE's words as a reader would list them: 'a', 'b' or 'c'.
static void choice_words(const OptionSpec* spec, char* out, size_t len) {
    size_t used = 0;
    out[0] = '\0';
    for (int k = 0; k < spec->n_words && used < len; k++)
        used += snprintf(out + used, len - used, "%s'%s'", k == 0 ? "" : k + 1 < spec->n_words ? ", " : " or ",
                         spec->words[k]);
}

static void print_help(void) {
    Options defaults;
    options_default(&defaults);
    OptionSpec specs[64];
    int n = option_specs(&defaults, specs);
    printf("usage: ./train_gpt [flags]\n\nTrains a Qwen3-architecture GQA transformer on one GPU. Flags (default):\n");
    for (int i = 0; i < n; i++) {
        char value[96];
        switch (specs[i].type) {
        case OPT_INT:
        case OPT_BOOL: snprintf(value, sizeof(value), "%d", *(int*)specs[i].value); break;
        case OPT_FLOAT: snprintf(value, sizeof(value), "%g", *(float*)specs[i].value); break;
        case OPT_U64: snprintf(value, sizeof(value), "%llu", (unsigned long long)*(uint64_t*)specs[i].value); break;
        case OPT_STR: snprintf(value, sizeof(value), "%s", *(const char**)specs[i].value ? *(const char**)specs[i].value : "none"); break;
        case OPT_FLAG: snprintf(value, sizeof(value), "off"); break;
        case OPT_CHOICE: snprintf(value, sizeof(value), "%s", specs[i].words[*(int*)specs[i].value]); break;
        }
        char words[256] = "";
        if (specs[i].type == OPT_CHOICE) choice_words(&specs[i], words, sizeof(words));
        printf("  %-17s %s%s%s (%s)\n", specs[i].name, words, words[0] ? ": " : "", specs[i].help, value);
    }
}

// v is not a value that spec's flag takes: exit 2, with what it does take.
static void bad_value(const OptionSpec* spec, const char* v) {
    char words[256];
    const char* domain = spec->type == OPT_BOOL    ? "0 or 1"
                         : spec->type == OPT_U64   ? "a whole number from 0 to 2^64-1"
                         : spec->type == OPT_INT   ? "a whole number that fits an int"
                         : spec->type == OPT_FLOAT ? "a finite number"
                                                   : words;
    if (spec->type == OPT_CHOICE) choice_words(spec, words, sizeof(words));
    usage_error("bad value '%s' for %s: it takes %s", v, spec->name, domain);
}

// Exits with code 2 and one line on an unknown flag or a bad value.
static void parse_args(Options* o, int argc, char** argv) {
    OptionSpec specs[64];
    int n = option_specs(o, specs);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            print_help();
            exit(0);
        }
        const OptionSpec* spec = NULL;
        for (int j = 0; j < n; j++)
            if (!strcmp(argv[i], specs[j].name)) spec = &specs[j];
        if (!spec) usage_error("unknown flag '%s' (see --help)", argv[i]);
        if (spec->type == OPT_FLAG) {
            *(int*)spec->value = 1;
            continue;
        }
        if (i + 1 >= argc) usage_error("flag %s needs a value (see --help)", argv[i]);
        const char* v = argv[++i];
        const ConfigField* field = config_field_of_flag(spec->name);
        if (field && field->hf) o->model_flag = spec->name;
        char* end = NULL;
        errno = 0;
        switch (spec->type) {
        case OPT_INT:
        case OPT_BOOL: {
            long x = strtol(v, &end, 10);
            if (x < -2147483647L || x > 2147483647L || (spec->type == OPT_BOOL && x != 0 && x != 1)) errno = ERANGE;
            *(int*)spec->value = (int)x;
            break;
        }
        case OPT_U64:  // strtoull would take "-1" as 2^64 - 1
            *(uint64_t*)spec->value = strtoull(v, &end, 10);
            if (strchr(v, '-')) errno = ERANGE;
            break;
        case OPT_FLOAT: *(float*)spec->value = strtof(v, &end); break;
        case OPT_CHOICE: {
            int k = 0;
            while (k < spec->n_words && strcmp(v, spec->words[k]) != 0) k++;
            if (k == spec->n_words) bad_value(spec, v);
            *(int*)spec->value = k;
            continue;
        }
        default: *(const char**)spec->value = v; continue;  // any string, the empty one included
        }
        if (errno != 0 || end == v || *end != '\0' || (spec->type == OPT_FLOAT && !isfinite(*(float*)spec->value)))
            bad_value(spec, v);
    }
}

// The checks that need no GPU; exits 2 with one line naming the problem.
static void check_options(const Options* o) {
    char err[256];
    if (!config_check(&o->model, err, sizeof(err))) usage_error("bad model config: %s", err);
    const OptimConfig* p = &o->optim;
    const char* problem = NULL;
    long tokens = (long)o->batch_size * o->model.seq_len;
    if (o->batch_size < 1) problem = "--batch must be at least 1";
    else if (tokens > (1L << 30)) problem = "--batch x --seq is too large";
    else if (o->total_batch_tokens < 0 || (o->total_batch_tokens > 0 && o->total_batch_tokens % tokens != 0))
        problem = "--total-batch must be a positive multiple of --batch x --seq";
    else if (p->total_steps < 0) problem = "--steps must be at least 0";
    else if (!(p->lr >= 0.0f) || !(p->min_lr_frac >= 0.0f && p->min_lr_frac <= 1.0f))
        problem = "--lr must be >= 0 and --min-lr-frac in [0, 1]";
    else if (p->warmup_steps < 0) problem = "--warmup must be at least 0";
    else if (!(p->beta1 >= 0.0f && p->beta1 < 1.0f && p->beta2 >= 0.0f && p->beta2 < 1.0f))
        problem = "--beta1 and --beta2 must be in [0, 1)";
    else if (!(p->eps > 0.0f) || p->grad_clip < 0.0f || p->weight_decay < 0.0f)
        problem = "--adam-eps must be > 0, --grad-clip and --weight-decay >= 0";
    else if (!(p->decay_frac >= 0.0f && p->decay_frac <= 1.0f)) problem = "--decay-frac must be in [0, 1]";
    else if (o->loss_chunk < 1) problem = "--loss-chunk must be at least 1";
    else if (o->val_every < 0 || o->val_batches < 0) problem = "--val-every and --val-batches must be >= 0";
    else if (o->bench_steps < 1) problem = "--bench-steps must be at least 1";
    else if (o->sample_every < 0 || o->sample_len < 1) problem = "--sample-every must be >= 0, --sample-len >= 1";
    else if (!(o->temperature >= 0.0f)) problem = "--temperature must be >= 0";
    else if (o->ckpt_every < 0 || o->keep_last < 1) problem = "--ckpt-every must be >= 0 and --keep-last >= 1";
    else if (o->stop_at < 0 || o->stop_at > p->total_steps) problem = "--stop-at must be in [0, --steps]";
    else if (!(o->peak_tflops > 0.0f)) problem = "--peak-tflops must be > 0";
    else if (o->resume && o->init_from) problem = "--resume and --init-from exclude each other";
    else if (o->gpus < 0 || o->gpus > 1024) problem = "--gpus must be in [0, 1024] (0: every GPU of this machine)";
    else if (o->zero < 0 || o->zero > 2) problem = "--zero must be 0, 1 or 2";
    else if (!(o->timeout >= 5.0f)) problem = "--timeout must be at least 5 seconds";
    else if (!(o->max_memory >= 0.0f)) problem = "--max-memory must be >= 0 GiB (0: no limit)";
    else if (!o->fp8 && (o->fp8_head || o->fp8_fast_accum || o->fp8_log_scales))
        problem = "--fp8-head, --fp8-fast-accum and --fp8-log-scales need --fp8 1";
    else if (o->fp8 && fp8_check_shapes(&o->model, tokens, err, sizeof(err)) < 0) problem = err;
    else if (o->fp8_head && (o->model.vocab_size % 16 != 0 || o->loss_chunk % 16 != 0))
        problem = "--fp8-head 1 needs the vocabulary size and --loss-chunk to be multiples of 16 (FP8 matmuls' sides)";
    else if (!(p->muon_lr >= 0.0f) || !(p->muon_momentum >= 0.0f && p->muon_momentum < 1.0f))
        problem = "--muon-lr must be >= 0 and --muon-momentum in [0, 1)";
    else if (o->optimizer == OPTIMIZER_MUON && o->zero != 0)
        problem = "--optimizer muon needs every matrix whole on each GPU: use --zero 0 (doc/optimizers.md says how "
                  "Muon could shard)";
    if (problem) usage_error("%s", problem);
}

// Synthetic tokens for --bench: B rows of T+1 tokens, uniform over the vocabulary, from a seeded
// xorshift generator. Returns `window`.
static const uint16_t* synthetic_batch(uint16_t* window, int B, int T, int vocab, uint64_t* state) {
    for (size_t i = 0; i < (size_t)B * (T + 1); i++) {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        window[i] = (uint16_t)(*state % vocab);
    }
    return window;
}

// The mean loss over up to max_batches micro-batches of the validation split on each rank (the
// ranks read disjoint batches). The losses add up on the device; the host reads the total once.
static float validate(GPT* m, Uploader* up, DataLoader* val, int max_batches) {
    loader_rewind(val);
    size_t n = loader_batches_per_epoch(val);
    if (max_batches > 0 && (size_t)max_batches < n) n = max_batches;
    for (size_t i = 0; i < n; i++) {
        Batch b = upload_batch(up, m, loader_next(val));
        forward_layers(m, &b);
        head_and_loss(m, &b, 0.0f, false, &m->scalars->val_loss_sum, i > 0);
    }
    sum_over_ranks(m, &m->scalars->val_loss_sum, 1);  // each rank read its own batches
    float loss_sum;
    CUDA_CHECK(cudaMemcpyAsync(&loss_sum, &m->scalars->val_loss_sum, sizeof(float), cudaMemcpyDeviceToHost, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return (float)(loss_sum / ((double)n * m->N * m->dp.world));
}

// Text from the model: extends the prompt by up to n_new tokens, each drawn from the softmax of
// the last position's logits at `temperature` (0: the most likely token). It reuses the training
// buffers: the prompt sits in row 0 of a B x T batch (the other rows and the tail hold
// end-of-text, which causal attention keeps from mattering), the layers run forward, and only the
// one row of logits needed is computed. Each token costs a forward pass over the whole batch,
// which is fine for a few dozen tokens every few hundred steps. Tokens are drawn from the
// tokenizer's vocabulary only (the padding rows of the embedding are never sampled).
static void sample_text(GPT* m, Uploader* up, const Tokenizer* tk, const TokenList* prompt, int n_new,
                        float temperature, uint64_t* rng, ByteBuf* text) {
    const int T = m->T, V = m->cfg.vocab_size, C = m->cfg.d_model, EOT = GPT2_EOT;
    const int n_vocab = tk->vocab_size < V ? tk->vocab_size : V;
    uint16_t* window = (uint16_t*)malloc((size_t)m->B * (T + 1) * sizeof(uint16_t));
    bf16* logits = (bf16*)malloc(V * sizeof(bf16));
    float* probs = (float*)malloc(V * sizeof(float));
    int* ids = (int*)malloc((T + 1) * sizeof(int));
    int len = 0;
    if (prompt->len == 0) ids[len++] = EOT;
    for (size_t i = 0; i < prompt->len && len < T; i++) ids[len++] = prompt->data[i];
    int first_new = len;
    while (len < T && len - first_new < n_new) {
        for (size_t i = 0; i < (size_t)m->B * (T + 1); i++) window[i] = EOT;
        for (int i = 0; i < len; i++) window[i] = (uint16_t)ids[i];
        Batch b = upload_batch(up, m, window);
        forward_layers(m, &b);
        linear_forward(m->act.logits, m->act.xnorm_final + (size_t)(len - 1) * C, P(m, P_EMBED, 0), NULL, 1, C, V,
                       m->stream);
        CUDA_CHECK(cudaMemcpyAsync(logits, m->act.logits, V * sizeof(bf16), cudaMemcpyDeviceToHost, m->stream));
        CUDA_CHECK(cudaStreamSynchronize(m->stream));
        int next = 0;
        for (int v = 1; v < n_vocab; v++)
            if (__bfloat162float(logits[v]) > __bfloat162float(logits[next])) next = v;
        if (temperature > 0.0f) {  // sample: p_v ~ exp((z_v - z_max) / temperature)
            float z_max = __bfloat162float(logits[next]), sum = 0.0f;
            for (int v = 0; v < n_vocab; v++) sum += probs[v] = expf((__bfloat162float(logits[v]) - z_max) / temperature);
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            float r = (float)((*rng >> 40) * (1.0 / 16777216.0)) * sum, acc = 0.0f;
            for (next = 0; next < n_vocab - 1; next++)
                if ((acc += probs[next]) > r) break;
        }
        ids[len++] = next;
        if (next == EOT) break;
    }
    char err[256];
    if (tokenizer_decode(tk, ids + first_new, len - first_new, text, err, sizeof(err)) != 0)
        byte_buf_append(text, err, strlen(err));
    free(window);
    free(logits);
    free(probs);
    free(ids);
}

// Writes one batch's loss, tokens and per-tensor gradient norms (HF names), plus the weights the
// GPU computed with, for scripts/hf_check.py to recompute in transformers.
static void dump_grads(GPT* m, Uploader* up, const uint16_t* window, const char* dir) {
    Batch b = upload_batch(up, m, window);
    forward_backward(m, &b, 0, 1);
    float loss_sum;
    CUDA_CHECK(cudaMemcpyAsync(&loss_sum, &m->scalars->loss_sum, 4, cudaMemcpyDeviceToHost, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    char err[512];
    float* weights = download_flat(m, m->params, true);
    float* grads = download_flat(m, m->grads, false);
    if (!export_hf(m, weights, dir, err, sizeof(err))) die("--dump-grads: %s", err);
    int n = hf_tensors(m, NULL);
    HfTensor* hf = (HfTensor*)malloc(n * sizeof(HfTensor));
    hf_tensors(m, hf);
    size_t cap = 64 + (size_t)m->N * 12 + (size_t)n * 128, len = 0;
    char* json = (char*)malloc(cap);
    len += snprintf(json + len, cap - len, "{\"loss\": %.9g, \"B\": %d, \"T\": %d, \"tokens\": [", loss_sum / m->N,
                    m->B, m->T);
    for (int i = 0; i < m->B * (m->T + 1); i++) len += snprintf(json + len, cap - len, i ? ",%d" : "%d", window[i]);
    len += snprintf(json + len, cap - len, "], \"grad_norms\": {");
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        double sq = 0.0;
        for (int64_t j = 0; j < hf[i].rows * hf[i].cols; j++) sq += (double)grads[hf[i].offset + j] * grads[hf[i].offset + j];
        total += sq;
        len += snprintf(json + len, cap - len, "%s\"%s\": %.9g", i ? ", " : "", hf[i].name, sqrt(sq));
    }
    len += snprintf(json + len, cap - len, "}, \"grad_norm\": %.9g}\n", sqrt(total));
    char path[1024];
    snprintf(path, sizeof(path), "%s/grads.json", dir);
    if (ck_write_file_atomic(path, json, len, err, sizeof(err)) != 0) die("--dump-grads: %s", err);
    printf("wrote %s (loss %.6f) and the weights it used\n", path, loss_sum / m->N);
    free(json);
    free(hf);
    free(weights);
    free(grads);
}

// Asynchronous checkpoints. At a checkpoint step the master weights and the optimizer's state are copied
// to pinned host memory on a side stream, after the step's optimizer update; the next optimizer
// update waits for that copy (forward and backward need not: they read only the bf16 weights).
// A host thread then writes the files while training goes on. Before the next snapshot, or at
// the end, the trainer waits for the write in flight and learns whether it succeeded.
typedef struct {
    const GPT* model;
    bool owner;              // rank 0: it owns the checkpoint directory and writes the master weights
    bool writes_shard;       // it writes a shard of the optimizer's state (rank 0; with ZeRO 1, 2 every rank)
    bf16* host_w;            // pinned, the owner's: the master weights' two halves, the whole flat layout
    int16_t* host_low;
    float* host_master;      // the owner's: the two joined in fp32, by the writer thread
    void* host_opt_state;    // pinned: this rank's optimizer state (opt_state_bytes)
    void* host_fp8;          // pinned, the owner's in FP8 runs: fp8_scales.bin's bytes
    cudaStream_t stream;
    cudaEvent_t ready;       // the optimizer update to snapshot is done
    cudaEvent_t copied;      // the snapshot is in host memory
    pthread_t thread;
    bool writing;            // a writer thread was started and not yet joined
    TrainerState state;
    const char* out_dir;
    int keep_last;
    bool failed;
    char err[1024];
    double write_seconds;    // how long the last write took, from the snapshot's landing
} Checkpointer;

static void checkpointer_create(Checkpointer* c, const GPT* m, const char* out_dir, int keep_last) {
    memset(c, 0, sizeof(*c));
    c->model = m;
    c->out_dir = out_dir;
    c->keep_last = keep_last;
    c->owner = m->dp.rank == 0;
    c->writes_shard = c->owner || m->dp.zero > 0;
    if (c->owner) {
        CUDA_CHECK(cudaMallocHost(&c->host_w, m->table.n_elements * sizeof(bf16)));
        CUDA_CHECK(cudaMallocHost(&c->host_low, m->table.n_elements * sizeof(int16_t)));
        c->host_master = (float*)xmalloc(m->table.n_elements * sizeof(float));
    }
    if (c->writes_shard) CUDA_CHECK(cudaMallocHost(&c->host_opt_state, m->opt_state_bytes));
    if (c->owner && m->fp8.on) CUDA_CHECK(cudaMallocHost(&c->host_fp8, fp8_state_bytes(m)));
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&c->copied, cudaEventDisableTiming));
}

static void* checkpoint_thread(void* arg) {
    Checkpointer* c = (Checkpointer*)arg;
    CUDA_CHECK(cudaEventSynchronize(c->copied));
    double t0 = now_seconds();
    if (c->owner) {
        master_join_all(c->host_master, c->host_w, c->host_low, c->model->table.n_elements);
        c->failed = !checkpoint_write_owner(c->model, c->host_master, c->host_opt_state, c->host_fp8, &c->state,
                                            c->out_dir, c->keep_last, c->err, sizeof(c->err));
    } else
        c->failed = !checkpoint_write_shard(c->model, c->host_opt_state, c->state.step, c->out_dir, c->err,
                                            sizeof(c->err));
    c->write_seconds = now_seconds() - t0;
    return NULL;
}

// Waits for the write in flight, if any. Returns false if it failed (the reason in c->err).
static bool checkpoint_wait(Checkpointer* c) {
    if (!c->writing) return true;
    pthread_join(c->thread, NULL);
    c->writing = false;
    if (!c->failed && c->owner)
        printf("checkpoint of step %lld written to %s/ckpt_%lld in %.2f s\n", (long long)c->state.step, c->out_dir,
               (long long)c->state.step, c->write_seconds);
    return !c->failed;
}

// Snapshots the state after the optimizer update just queued on the model's stream. Every rank
// calls it. The master weights go whole to rank 0 (with ZeRO 1/2 every rank joins the all-gathers
// that bring the pieces there); each rank that writes a shard copies its moments.
static void checkpoint_start(Checkpointer* c, GPT* m, const TrainerState* state) {
    if (m->dp.zero > 0) gpt_download_master(m, c->host_w, c->host_low, m->stream);  // NULL but on rank 0
    if (!c->writes_shard) return;
    if (c->host_fp8) {  // on the model's stream: the next forward's casts update the scales (a few KB)
        fp8_state_header(m, c->host_fp8);
        CUDA_CHECK(cudaMemcpyAsync((uint8_t*)c->host_fp8 + sizeof(Fp8StateHeader), m->fp8.scales,
                                   fp8_state_bytes(m) - sizeof(Fp8StateHeader), cudaMemcpyDeviceToHost, m->stream));
    }
    CUDA_CHECK(cudaEventRecord(c->ready, m->stream));
    CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->ready, 0));
    if (m->dp.zero == 0) gpt_download_master(m, c->host_w, c->host_low, c->stream);
    CUDA_CHECK(cudaMemcpyAsync(c->host_opt_state, m->opt_state, m->opt_state_bytes, cudaMemcpyDeviceToHost, c->stream));
    CUDA_CHECK(cudaEventRecord(c->copied, c->stream));
    c->state = *state;
    c->failed = false;
    if (pthread_create(&c->thread, NULL, checkpoint_thread, c) != 0) die("cannot start the checkpoint writer thread");
    c->writing = true;
}

static void checkpointer_free(Checkpointer* c) {
    checkpoint_wait(c);
    CUDA_CHECK(cudaFreeHost(c->host_w));
    CUDA_CHECK(cudaFreeHost(c->host_low));
    free(c->host_master);
    CUDA_CHECK(cudaFreeHost(c->host_opt_state));
    CUDA_CHECK(cudaFreeHost(c->host_fp8));
    CUDA_CHECK(cudaStreamDestroy(c->stream));
    CUDA_CHECK(cudaEventDestroy(c->ready));
    CUDA_CHECK(cudaEventDestroy(c->copied));
}

// After a failed checkpoint: stop (exit 1), or say so and carry on, per --ckpt-keep-going.
static void checkpoint_failed(const Checkpointer* c, bool keep_going) {
    warn("checkpoint of step %lld failed: %s; the previous checkpoint is intact%s", (long long)c->state.step, c->err,
         keep_going ? "; carrying on, retrying at the next interval" : "");
    if (!keep_going) exit(1);
}

// --init-from: the master weights from a transformers Qwen3 checkpoint directory (whose
// config.json already set the model config); exits with one line on any problem.
static void load_init_from(GPT* m, const char* dir) {
    char path[1024], err[1024];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    StFile weights;
    float* master = (float*)calloc(m->table.n_elements, sizeof(float));
    if (st_open(&weights, path, err, sizeof(err)) != 0 || !hf_st_load(m, &weights, master, err, sizeof(err))) {
        die("--init-from: %s", err);
    }
    st_close(&weights);
    gpt_upload_state(m, master, NULL);
    free(master);
    printf("initialized from %s\n", dir);
}

// --resume: weights, moments and trainer state from the checkpoint directory dir, verified; exits
// with one line on any problem, never starting silently from scratch.
static void resume_from(GPT* m, const char* dir, TrainerState* state) {
    char err[1024];
    Restored got = {};
    got.master = (float*)xmalloc(m->table.n_elements * sizeof(float));
    got.opt_state = xmalloc(m->opt_state_bytes);
    if (!checkpoint_read(m, dir, &got, err, sizeof(err))) die("--resume: %s", err);
    gpt_upload_state(m, got.master, got.opt_state);
    set_step(m, (int)got.state.step);
    if (m->fp8.on) fp8_state_restore(m, got.fp8_state, got.fp8_state_len, dir);
    *state = got.state;
    printf("resumed from %s at step %lld\n", dir, (long long)state->step);
    if (got.old_gpus != m->dp.world || got.old_shards != optimizer_shards(m))
        printf("the checkpoint was written on %d GPU(s) with the optimizer state in %d shard(s); this run has %d "
               "GPU(s) and %d: resharded\n", got.old_gpus, got.old_shards, m->dp.world, optimizer_shards(m));
    free(got.master);
    free(got.opt_state);
    free(got.fp8_state);
}

// ----------------------------------------------------------------------------------------------
// The Trainer: what a run owns besides the model (data, the batch uploader, the checkpointer,
// the log), and the loop's chapters as named functions.
//
// The host runs ahead of the GPU: train_step() only enqueues work, and the figures of step k
// (loss, gradient norm, learning rate, time) are read back once the GPU has finished it, while it
// already works on step k+1. Each step is bracketed by two events (its time on the GPU, stalls
// inside it included, validation between steps not) and ends by copying the device's
// OptimScalars into a pinned slot; log_steps() waits for the end event. Steps that validate, sample or
// stop are logged at once, since those need the model as it is after that step.

#define STEPS_IN_FLIGHT 3  // read-back slots: the step being logged, the one running, the next

// --cuda-graph 1 (the default): a step's launches (forward, backward, the optimizer) captured once
// and replayed, one cudaGraphLaunch in place of ~560 kernel launches (doc/perf.md). A replay
// runs exactly the kernels of the capture with exactly their arguments, so it equals an eager
// step only where everything the host decides was the same then as now:
//   - every pointer: the batch lies in the upload slot the capture saw, so there is a graph per
//     slot; the pinned buffers, the copy and the read-backs stay outside the graph, eager, as do
//     the events that time the step;
//   - the host's FP8 state: the capture is keyed by fp8.calibrated and fp8.weights_stale at the
//     step's start (the first delayed step measures, later ones use the history and fuse; a step
//     whose AdamW made the FP8 weights leaves nothing for the next forward to cast), and a
//     replay leaves them as the captured step left them;
//   - nothing in the step reads the device on the host, waits for it, or allocates (the learning
//     rate and bias corrections are computed on the device, cuBLASLt's workspace is allocated once);
//   - everything made on first use is made before: the first CUDA_GRAPH_WARMUP steps of a run are
//     eager, so that cuBLASLt's plans, the attention's TMA maps and kernel attributes exist, and
//     so that --matmul-tune can time cuBLASLt's candidates in them.
// A checkpoint's snapshot is waited for inside the graph (an external event wait node, which waits
// for the event's latest record at each replay).
#define CUDA_GRAPH_WARMUP 4  // 1 to check cuBLASLt's candidates, 3 to time them (kernels.cuh, "The choice")

typedef struct {
    cudaGraphExec_t exec;                  // NULL: not captured yet
    bool calibrated, weights_stale;        // the FP8 host state the captured step began from
    bool calibrated_after, stale_after;    // and the state it left
} StepGraph;

// Why this run's steps cannot be captured (NULL: they can), for the one line the run prints.
static const char* cuda_graph_blocker(bool parallel, int accum) {
    if (parallel) return "data parallelism: the NCCL collectives and the comm stream's events are not captured";
    if (accum > 1) return "gradient accumulation: each micro-batch's upload is prepared on the host between micro-batches";
    return NULL;
}

typedef struct {
    Options o;
    CommEnv env;                // this process's rank among the run's (rank 0 of 1 on one GPU)
    Comm comm;
    bool parallel;              // comm is open: several ranks, or one rank with --zero 1 or 2
    GPT model;
    int accum;                  // micro-batches per optimizer step
    int start_step;             // steps done before this run (resume)
    int step;                   // steps enqueued so far, start_step included
    int logged;                 // steps logged so far
    DataLoader train, val;
    bool have_val, sampling, checkpointing;
    uint16_t* synthetic;        // --bench's window of tokens
    uint64_t bench_rng, sample_rng;
    Uploader up;
    Checkpointer ckpt;
    Tokenizer tokenizer;
    TokenList prompt;
    FILE* log;
    OptimScalars* readback;     // pinned [STEPS_IN_FLIGHT]: the device's scalars after each step
    int* matmul_errors;         // pinned [STEPS_IN_FLIGHT]: mm_error after each step (lib/matmul_hopper.cuh)
    Fp8Scale* scales_readback;  // --fp8-log-scales: pinned [STEPS_IN_FLIGHT][ranks][fp8_n_scales]
    Fp8Scale* scales_gathered;  // and on several GPUs, every rank's scales on the device [ranks][...]
    cudaEvent_t step_start[STEPS_IN_FLIGHT], step_end[STEPS_IN_FLIGHT];  // a step's time is between them
    bool graphs_on;             // --cuda-graph 1 and nothing in this run stops a capture (cuda_graph_blocker)
    StepGraph graphs[2];        // by the upload slot the step's batch lies in
    cudaDeviceProp prop;
    double t_start, t_first_step, t_loop;  // wall clock: launch, first step done, loop entered
    double bench_ms;            // --bench: GPU time of the timed steps
    int bench_timed;
    float last_loss;
    size_t recompute_free;      // --recompute auto: the free bytes it saw
} Trainer;

// Data: the shards, or synthetic tokens for the benchmark; the tokenizer when sampling. Exits
// with one line naming the problem.
static void trainer_open_data(Trainer* t) {
    const Options* o = &t->o;
    int B = o->batch_size, T = o->model.seq_len;
    char err[1024];
    t->synthetic = (uint16_t*)malloc((size_t)B * (T + 1) * sizeof(uint16_t));
    if (!o->bench) {
        int rank = t->env.rank, world = t->env.world;
        if (loader_open(&t->train, o->train_data, B, T, rank, world, 1, o->seed, err, sizeof(err)) != 0) {
            die("%s", err);  // the loader's line says how to make the shards
        }
        t->have_val = o->val_data && o->val_data[0];
        if (t->have_val && loader_open(&t->val, o->val_data, B, T, rank, world, 0, 0, err, sizeof(err)) != 0) {
            die("%s", err);
        }
    }
    t->sampling = o->sample_every > 0 && !o->bench && t->env.rank == 0;
    if (t->sampling) {
        if (tokenizer_load(&t->tokenizer, o->tokenizer_dir, err, sizeof(err)) != 0) {
            die("%s; or --sample-every 0 to train without samples", err);
        }
        tokenizer_encode(&t->tokenizer, o->prompt, strlen(o->prompt), &t->prompt);
    }
}

// The output directory and the JSON log, on rank 0; the other ranks print nothing but errors.
static void trainer_open_log(Trainer* t) {
    const char* dir = t->o.out_dir;
    if (t->env.rank != 0) {
        if (!freopen("/dev/null", "w", stdout)) exit(1);
        return;
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) die("cannot create output directory %s: %s", dir, strerror(errno));
    char path[1024];
    snprintf(path, sizeof(path), "%s/log.jsonl", dir);
    t->log = fopen(path, "a");
    if (!t->log) die("cannot open %s: %s", path, strerror(errno));
}

// Without an NVIDIA driver loaded, CUDA says its runtime needs a newer driver; the plain fact is
// that this machine has no GPU train_gpt can use (the kernel module's file is the driver's sign).
static void require_gpu(cudaDeviceProp* prop, int local_rank) {
    int n_devices = 0;
    cudaError_t status = cudaGetDeviceCount(&n_devices);
    bool no_driver = access("/proc/driver/nvidia/version", F_OK) != 0;
    if (status != cudaSuccess || n_devices == 0) {
        die("no CUDA GPU found (%s); train_gpt needs an NVIDIA GPU",
            no_driver ? "no NVIDIA driver is loaded on this machine"
            : status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    }
    CUDA_CHECK(cudaGetDeviceProperties(prop, local_rank < n_devices ? local_rank : 0));
}

// With several ranks (or ZeRO 1/2 on one): this process's GPU, and the communicator of the run.
static void trainer_open_comm(Trainer* t) {
    t->parallel = t->env.world > 1 || t->o.zero > 0;
    if (!t->parallel) return;
    char err[1024];
    if (comm_open(&t->comm, &t->env, t->o.timeout, err, sizeof(err)) != 0) die("%s", err);
}

// --recompute auto: the fewest recomputed layers whose plan fits this GPU's free memory, keeping
// RECOMPUTE_MARGIN_BYTES free for what no plan counts, and takes at most --max-memory. Ranks may
// see different free memory: all take the largest k any rank needs (fewer recomputed layers need
// more memory, so the largest k is the one that fits on every rank), and then run the same layout
// at the same speed. A rank on which even k = L does not fit says so, and every rank stops; where
// even k = L is over --max-memory (and fits the GPU), k = L goes on to trainer_open_model's limit
// check, which says so.
static void trainer_choose_recompute(Trainer* t, size_t limit) {
    GPT* m = &t->model;
    int L = m->cfg.n_layer;
    size_t total_bytes;
    char err[512];
    CUDA_CHECK(cudaMemGetInfo(&t->recompute_free, &total_bytes));
    size_t room = recompute_room(t->recompute_free, limit);
    int k = recompute_layers_that_fit(m, room, RECOMPUTE_MARGIN_BYTES, err, sizeof(err));
    if (k < 0 && room < t->recompute_free) k = L;
    int agreed = t->parallel ? comm_max_int(&t->comm, k < 0 ? L + 1 : k) : k;
    if (k < 0) die("%s", err);
    if (agreed > L) die("--recompute auto: another rank's GPU cannot fit this config (its line says why)");
    m->recompute_layers = agreed;
    gpt_plan_memory(m);
}

// The model, its weights (fresh, --init-from or --resume) and the checkpointer.
static void trainer_open_model(Trainer* t) {
    const Options* o = &t->o;
    GPT* m = &t->model;
    Sharding dp = ONE_GPU;
    if (t->parallel) dp = (Sharding){t->env.rank, t->env.world, o->zero, &t->comm};
    Fp8Mode fp8 = {o->fp8 != 0, (Fp8Scaling)o->fp8_scaling, o->fp8_head != 0, o->fp8_fast_accum != 0};
    gpt_plan(m, &o->model, o->batch_size, o->model.seq_len, o->recompute == RECOMPUTE_NONE ? 0 : o->model.n_layer,
             o->loss_chunk, &dp, (OptimizerKind)o->optimizer, fp8);
    size_t limit = (size_t)((double)o->max_memory * (1ull << 30));
    if (o->recompute == RECOMPUTE_AUTO) trainer_choose_recompute(t, limit);
    char over[512];
    if (!plan_within_limit(m, limit, over, sizeof(over))) die("%s", over);
    gpt_build(m);
    m->deterministic = o->deterministic != 0;
    g_matmul_tune = o->matmul_tune ? MATMUL_TUNE_CHECK : MATMUL_TUNE_OFF;
    gpt_init(m, o->seed);
    if (o->init_from) load_init_from(m, o->init_from);
    t->bench_rng = o->seed * 0x9E3779B97F4A7C15ull + 1;
    t->sample_rng = splitmix64(o->sample_seed);
    if (o->resume) {
        TrainerState resumed = {};
        char err[1024];
        resume_from(m, o->resume_dir, &resumed);
        if (resumed.has_loader && !o->bench && loader_set_state(&t->train, &resumed.loader, err, sizeof(err)) != 0) {
            die("--resume: the data loader's state: %s", err);
        }
        t->start_step = (int)resumed.step;
        t->bench_rng = resumed.bench_rng;
        t->sample_rng = resumed.sample_rng;
    }
    t->checkpointing = o->ckpt_every > 0 && !o->bench;
    if (t->checkpointing) {
        char err[1024];
        if (t->env.rank == 0 && ckpt_cleanup(o->out_dir, err, sizeof(err)) < 0) die("%s", err);
        checkpointer_create(&t->ckpt, m, o->out_dir, o->keep_last);
    }
}

static void trainer_open(Trainer* t, const Options* o, const CommEnv* env) {
    memset(t, 0, sizeof(*t));
    t->t_start = now_seconds();
    t->o = *o;
    t->env = *env;
    int N = o->batch_size * o->model.seq_len;
    t->accum = o->total_batch_tokens > 0 ? o->total_batch_tokens / (N * env->world) : 1;
    if (o->bench) t->o.optim.total_steps = 5 + o->bench_steps;
    trainer_open_data(t);
    trainer_open_log(t);
    require_gpu(&t->prop, t->env.local_rank);
    trainer_open_comm(t);
    trainer_open_model(t);
    if (t->env.world > 1) comm_watchdog_start(&t->comm);
    t->step = t->logged = t->start_step;
    uploader_create(&t->up, N, o->model.vocab_size);
    CUDA_CHECK(cudaMallocHost(&t->readback, STEPS_IN_FLIGHT * sizeof(OptimScalars)));
    CUDA_CHECK(cudaMallocHost(&t->matmul_errors, STEPS_IN_FLIGHT * sizeof(int)));
    if (o->fp8_log_scales) {
        size_t bytes = env->world * fp8_n_scales(&o->model) * sizeof(Fp8Scale);
        CUDA_CHECK(cudaMallocHost(&t->scales_readback, STEPS_IN_FLIGHT * bytes));
        if (env->world > 1) CUDA_CHECK(cudaMalloc(&t->scales_gathered, bytes));
    }
    for (int i = 0; i < STEPS_IN_FLIGHT; i++) {
        CUDA_CHECK(cudaEventCreate(&t->step_start[i]));
        CUDA_CHECK(cudaEventCreate(&t->step_end[i]));
    }
    t->graphs_on = o->cuda_graph && !cuda_graph_blocker(t->parallel, t->accum);
}

static void print_run_header(const Trainer* t) {
    const GPT* m = &t->model;
    printf("device: %s, %d SMs, %.1f GiB\n", t->prop.name, t->prop.multiProcessorCount, gib(t->prop.totalGlobalMem));
    print_memory_plan(m);
    if (t->recompute_free) {
        char within[80] = "";
        if (t->o.max_memory > 0)
            snprintf(within, sizeof(within), "takes at most --max-memory %.2f GiB and ", t->o.max_memory);
        printf("recompute auto: %d of %d layers, the fewest whose plan %sfits in the %.2f GiB free with a margin of "
               "%.2f GiB kept free%s\n", m->recompute_layers, m->cfg.n_layer, within, gib(t->recompute_free),
               gib(RECOMPUTE_MARGIN_BYTES), m->dp.world > 1 ? "; on every rank, the most any rank needs" : "");
    }
    printf("batch: %d x %d tokens, %d micro-batches per step on each of %d GPUs (%d tokens); %d steps\n", m->B, m->T,
           t->accum, m->dp.world, m->N * t->accum * m->dp.world, t->o.optim.total_steps);
    if (t->parallel)
        printf("data parallel: %d ranks (launched by %s), ZeRO-%d; the memory plan above is per GPU\n",
               m->dp.world, t->env.launcher, m->dp.zero);
    if (t->o.cuda_graph && !t->graphs_on)
        printf("cuda graph: off, every step runs eagerly: %s\n", cuda_graph_blocker(t->parallel, t->accum));
    else if (t->graphs_on)
        printf("cuda graph: on after %d eager warm-up steps; validation, samples and checkpoint snapshots run "
               "eagerly between steps\n", CUDA_GRAPH_WARMUP);
}

// The next micro-batch's B rows of T+1 tokens.
static const uint16_t* next_window(Trainer* t) {
    const GPT* m = &t->model;
    if (t->o.bench) return synthetic_batch(t->synthetic, m->B, m->T, m->cfg.vocab_size, &t->bench_rng);
    return loader_next(&t->train);
}

// --fp8-log-scales: the scales as step `slot`'s optimizer step left them, copied into a pinned
// slot behind the step's scalars (read once the step is done, like them; nothing waits, and the
// run's numbers do not change). With several ranks every rank's array comes along (an all-gather
// of a few KB a step, after which the next forward also waits for ZeRO's weight all-gathers), so
// that rank 0 can say whether they agree: with delayed scaling they must, bit for bit
// (fp8_agree_amaxes); with current scaling each rank measured its own tensors.
static void fp8_scales_readback(Trainer* t, int slot) {
    GPT* m = &t->model;
    if (!t->o.fp8_log_scales) return;
    size_t n = fp8_n_scales(&m->cfg), world = m->dp.world;
    const Fp8Scale* from = m->fp8.scales;
    if (world > 1) {
        comm_follow(m->dp.comm, m->stream);
        comm_all_gather(m->dp.comm, m->fp8.scales, t->scales_gathered, n * sizeof(Fp8Scale) / sizeof(float),
                        sizeof(float));
        comm_join(m->dp.comm, m->stream);
        from = t->scales_gathered;
    }
    CUDA_CHECK(cudaMemcpyAsync(t->scales_readback + slot * world * n, from, world * n * sizeof(Fp8Scale),
                               cudaMemcpyDeviceToHost, m->stream));
}

// Micro-batch `micro` of the step, its batch uploaded (the first sets the gradients:
// grads_accumulate); the last runs the optimizer once the gradients are complete. `capturing`:
// inside a graph's capture, where the wait for the checkpoint's snapshot becomes a node that waits
// at each replay.
static void step_compute(Trainer* t, const Batch* batch, int micro, bool capturing) {
    GPT* m = &t->model;
    forward_backward(m, batch, micro, t->accum);
    if (micro < t->accum - 1) return;
    // The gradients are complete here; the optimizer may overwrite what the last snapshot copies.
    if (t->checkpointing)
        CUDA_CHECK(cudaStreamWaitEvent(m->stream, t->ckpt.copied, capturing ? cudaEventWaitExternal : cudaEventWaitDefault));
    optimizer_step(m, &t->o.optim);
}

// Captures step_compute for `batch` into g (nothing runs: the GPU sees the work at the launch).
// The host's side of the step runs as usual, so its FP8 state ends as the step leaves it.
static void step_graph_capture(Trainer* t, const Batch* batch, StepGraph* g) {
    GPT* m = &t->model;
    if (g->exec) CUDA_CHECK(cudaGraphExecDestroy(g->exec));
    g->calibrated = m->fp8.calibrated;
    g->weights_stale = m->fp8.weights_stale;
    cudaGraph_t graph;
    // thread-local: the checkpoint thread's event waits go on while this thread captures
    CUDA_CHECK(cudaStreamBeginCapture(m->stream, cudaStreamCaptureModeThreadLocal));
    step_compute(t, batch, 0, true);
    CUDA_CHECK(cudaStreamEndCapture(m->stream, &graph));
    size_t n_nodes = 0;
    CUDA_CHECK(cudaGraphGetNodes(graph, NULL, &n_nodes));
    CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    g->calibrated_after = m->fp8.calibrated;
    g->stale_after = m->fp8.weights_stale;
    printf("cuda graph: step %d captured, %zu nodes (upload slot %d%s)\n", t->step + 1, n_nodes, (int)(g - t->graphs),
           !m->fp8.on ? "" : g->calibrated ? ", fp8 calibrated" : ", fp8 measuring");
}

// The step by its graph (one micro-batch: graphs run without accumulation): captured now if there
// is none for the batch's slot or the host's FP8 state differs from the one it was captured from,
// then launched.
static void step_graph_replay(Trainer* t, const Batch* batch) {
    GPT* m = &t->model;
    StepGraph* g = &t->graphs[t->up.next ^ 1];  // the slot upload_batch just filled
    if (!g->exec || g->calibrated != m->fp8.calibrated || g->weights_stale != m->fp8.weights_stale)
        step_graph_capture(t, batch, g);
    CUDA_CHECK(cudaGraphLaunch(g->exec, m->stream));
    m->fp8.calibrated = g->calibrated_after;
    m->fp8.weights_stale = g->stale_after;
}

// One optimizer step: every micro-batch's forward and backward (gradients accumulate), then the
// optimizer, then the read-back of the step's scalars; with --cuda-graph 1 after the warm-up,
// one graph launch does the compute. Only enqueues work: nothing here waits for the GPU, but
// once, at the warm-up's end, for the matmul tuning's timings.
static void train_step(Trainer* t) {
    GPT* m = &t->model;
    int slot = t->step % STEPS_IN_FLIGHT;
    bool replay = t->graphs_on && t->step - t->start_step >= CUDA_GRAPH_WARMUP;
    if (g_matmul_tune != MATMUL_TUNE_OFF) {  // step 0 checks cuBLASLt's candidates, the warm-up's others time them
        if (t->step - t->start_step == 1) g_matmul_tune = MATMUL_TUNE_TIME;
        if (t->step - t->start_step == CUDA_GRAPH_WARMUP) {
            matmul_tune_finish();
            matmul_print_tuning();
        }
    }
    CUDA_CHECK(cudaEventRecord(t->step_start[slot], m->stream));
    for (int micro = 0; micro < t->accum; micro++) {
        Batch batch = upload_batch(&t->up, m, next_window(t));
        if (replay) step_graph_replay(t, &batch);
        else step_compute(t, &batch, micro, false);
    }
    CUDA_CHECK(cudaMemcpyAsync(&t->readback[slot], m->scalars, sizeof(OptimScalars), cudaMemcpyDeviceToHost,
                               m->stream));
    CUDA_CHECK(cudaMemcpyFromSymbolAsync(&t->matmul_errors[slot], mm_error, sizeof(int), 0, cudaMemcpyDeviceToHost,
                                         m->stream));
    fp8_scales_readback(t, slot);
    CUDA_CHECK(cudaEventRecord(t->step_end[slot], m->stream));
    t->step++;
}

static void format_duration(char* out, size_t len, double seconds) {
    int s = (int)(seconds + 0.5);
    if (s >= 3600) snprintf(out, len, "%dh%02dm", s / 3600, s / 60 % 60);
    else snprintf(out, len, "%dm%02ds", s / 60, s % 60);
}

// The scales of one role of one kind of matrix (P_EMBED: the head's), over the layers: the range of
// their exponents (each scale is 2^k) and the largest amax the step measured (delayed: the
// history's newest entry; current: the step's last cast's).
typedef struct {
    int k_min, k_max;
    float amax;
} Fp8ScaleRange;

static Fp8ScaleRange fp8_scale_range(const GPT* m, const Fp8Scale* scales, Fp8Role role, ParamKind kind) {
    Fp8ScaleRange r = {0, 0, 0.0f};
    int layers = kind == P_EMBED ? 1 : m->cfg.n_layer;
    for (int l = 0; l < layers; l++) {
        const Fp8Scale* s = scales + fp8_scale_index(&m->cfg, role, kind, l);
        int k = ilogbf(s->scale);
        float amax = m->fp8.scaling == FP8_DELAYED ? s->history[0] : s->amax;
        r.k_min = l == 0 || k < r.k_min ? k : r.k_min;
        r.k_max = l == 0 || k > r.k_max ? k : r.k_max;
        r.amax = fmaxf(r.amax, amax);
    }
    return r;
}

// Step `index`'s scales (its read-back slot), as one line on stdout and one in the JSON log:
// per matrix kind (and the head, when in FP8) and role, the exponents' range and the largest amax;
// on several GPUs, whether every rank holds the same bits.
static void log_fp8_scales(Trainer* t, int index) {
    const GPT* m = &t->model;
    if (!t->o.fp8_log_scales) return;
    size_t n = fp8_n_scales(&m->cfg), world = m->dp.world;
    const Fp8Scale* scales = t->scales_readback + (size_t)(index % STEPS_IN_FLIGHT) * world * n;
    bool same = true;
    for (size_t r = 1; r < world; r++) same = same && !memcmp(scales, scales + r * n, n * sizeof(Fp8Scale));
    char text[1024], json[2048];
    size_t tl = 0, jl = 0;
    tl += snprintf(text + tl, sizeof(text) - tl, "step %5d | fp8 scales 2^k, k over the layers (largest amax):",
                   index + 1);
    jl += snprintf(json + jl, sizeof(json) - jl, "{\"step\": %d, \"fp8_scales\": {", index + 1);
    ParamKind kinds[] = {P_QKV, P_ATTN_OUT, P_GATE_UP, P_DOWN, P_EMBED};
    int n_kinds = m->fp8.head ? 5 : 4;
    for (int i = 0; i < n_kinds; i++) {
        const char* name = kinds[i] == P_EMBED ? "head" : PARAM_KINDS[kinds[i]].name;
        tl += snprintf(text + tl, sizeof(text) - tl, "%s %s", i ? " |" : "", name);
        jl += snprintf(json + jl, sizeof(json) - jl, "%s\"%s\": {", i ? ", " : "", name);
        for (int role = 0; role < FP8_ROLES; role++) {
            Fp8ScaleRange r = fp8_scale_range(m, scales, (Fp8Role)role, kinds[i]);
            tl += snprintf(text + tl, sizeof(text) - tl, " %s %d..%d (%.2g)", FP8_ROLE_NAMES[role], r.k_min, r.k_max,
                           r.amax);
            jl += snprintf(json + jl, sizeof(json) - jl, "%s\"%s\": {\"k\": [%d, %d], \"amax\": %.9g}",
                           role ? ", " : "", FP8_ROLE_NAMES[role], r.k_min, r.k_max, r.amax);
        }
        jl += snprintf(json + jl, sizeof(json) - jl, "}");
    }
    jl += snprintf(json + jl, sizeof(json) - jl, "}");
    if (world > 1) {
        tl += snprintf(text + tl, sizeof(text) - tl, " | %s on the %d ranks", same ? "identical" : "different",
                       (int)world);
        jl += snprintf(json + jl, sizeof(json) - jl, ", \"fp8_ranks\": \"%s\"", same ? "identical" : "different");
    }
    printf("%s\n", text);
    if (t->log) {
        fprintf(t->log, "%s}\n", json);
        fflush(t->log);
    }
}

// Waits for step `index` (0-based) to finish on the GPU, then prints and appends its figures.
static void log_one_step(Trainer* t, int index) {
    const Options* o = &t->o;
    int slot = index % STEPS_IN_FLIGHT, total = o->optim.total_steps, done = index + 1;
    CUDA_CHECK(cudaEventSynchronize(t->step_end[slot]));
    if (t->matmul_errors[slot] != MM_OK)  // a wait of our GEMM gave up: its outputs are wrong
        die("step %d: our Hopper matmul (the MLP's gate/up forward or down backward) failed (%s)", index + 1,
            mm_error_text(t->matmul_errors[slot]));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, t->step_start[slot], t->step_end[slot]));
    const OptimScalars* s = &t->readback[slot];
    double now = now_seconds(), tokens = (double)t->model.N * t->accum * t->model.dp.world;
    if (t->parallel) t->comm.last_progress = now;  // the watchdog's sign of life
    if (index == t->start_step) t->t_first_step = now - t->t_start;
    if (index == t->start_step) t->t_loop = now;  // the ETA leaves out the first step's warm-up
    double per_step = index > t->start_step ? (now - t->t_loop) / (index - t->start_step) : ms / 1e3;
    double eta = per_step * (total - done), tok_s = tokens / (ms / 1e3);
    double mfu = tok_s / t->model.dp.world * flops_per_token(&t->model.cfg) / (o->peak_tflops * 1e12);
    float loss = s->loss_sum / (float)tokens, norm = sqrtf(s->grad_norm_sq);
    double mem = gib(gpt_bytes_total(&t->model));
    char eta_text[32];
    format_duration(eta_text, sizeof(eta_text), eta);
    printf("step %5d/%d | loss %8.4f | norm %7.4f | lr %.2e | %8.2f ms | %9.0f tok/s | MFU %5.1f%% | mem %.2f GiB | "
           "eta %s\n", done, total, loss, norm, s->lr, ms, tok_s, 100 * mfu, mem, eta_text);
    if (t->log) {
        fprintf(t->log, "{\"step\": %d, \"loss\": %.9g, \"grad_norm\": %.9g, \"lr\": %.9g, \"ms\": %.3f, "
                        "\"tokens_per_s\": %.1f, \"mfu\": %.5f, \"mem_gib\": %.3f, \"elapsed_s\": %.3f, "
                        "\"eta_s\": %.1f}\n", done, loss, norm, s->lr, ms, tok_s, mfu, mem, now - t->t_start, eta);
        fflush(t->log);
    }
    log_fp8_scales(t, index);
    if (o->bench && index >= t->start_step + 5) {
        t->bench_ms += ms;
        t->bench_timed++;
    }
    t->last_loss = loss;
    if (!isfinite(loss)) {
        die("loss is %f at step %d; stopping", loss, done);
    }
}

// Logs every step enqueued up to and including `index` that is not logged yet.
static void log_steps(Trainer* t, int index) {
    for (; t->logged <= index && t->logged < t->step; t->logged++) log_one_step(t, t->logged);
}

static bool every(int step_done, int interval) { return interval > 0 && step_done % interval == 0; }

// Checkpoint policy: every --ckpt-every steps and at the last step (--stop-at included). The
// snapshot is enqueued behind the step's optimizer update; a thread writes it while training goes on.
static void maybe_checkpoint(Trainer* t, int done, bool last) {
    if (!t->checkpointing || !(every(done, t->o.ckpt_every) || last)) return;
    if (!checkpoint_wait(&t->ckpt)) checkpoint_failed(&t->ckpt, t->o.ckpt_keep_going != 0);
    TrainerState state = {TRAINER_STATE_MAGIC, TRAINER_STATE_VERSION, done, t->bench_rng, t->sample_rng, 1, {}};
    loader_get_state(&t->train, &state.loader);
    checkpoint_start(&t->ckpt, &t->model, &state);
}

static void maybe_validate(Trainer* t, int done, bool last) {
    if (!t->have_val || !(every(done, t->o.val_every) || last)) return;
    fp8_eval(&t->model, true);
    float val_loss = validate(&t->model, &t->up, &t->val, t->o.val_batches);
    fp8_eval(&t->model, false);
    printf("step %5d/%d | val loss %8.4f\n", done, t->o.optim.total_steps, val_loss);
    if (t->log) {
        fprintf(t->log, "{\"step\": %d, \"val_loss\": %.6f}\n", done, val_loss);
        fflush(t->log);
    }
}

static void maybe_sample(Trainer* t, int done, bool last) {
    if (!t->sampling || !(every(done, t->o.sample_every) || last)) return;
    ByteBuf text = {NULL, 0, 0};
    fp8_eval(&t->model, true);
    sample_text(&t->model, &t->up, &t->tokenizer, &t->prompt, t->o.sample_len, t->o.temperature, &t->sample_rng,
                &text);
    fp8_eval(&t->model, false);
    printf("step %5d/%d | sample: %s%s\n", done, t->o.optim.total_steps, t->o.prompt, byte_buf_cstr(&text));
    free(text.data);
}

// What happens after step `index` was enqueued: its checkpoint snapshot, the previous step's log
// line (the GPU runs this step meanwhile), and, where the policies say so, this step's log line,
// validation and a sample. Returns false when the run stops here (--stop-at).
static bool after_step(Trainer* t, int index) {
    const Options* o = &t->o;
    int done = index + 1;
    bool stop = done == o->stop_at, last = done == o->optim.total_steps || stop;
    maybe_checkpoint(t, done, last);
    log_steps(t, index - 1);
    bool look_now = last || (t->have_val && every(done, o->val_every)) || (t->sampling && every(done, o->sample_every));
    if (look_now) log_steps(t, index);
    maybe_validate(t, done, last);
    maybe_sample(t, done, last);
    if (stop) printf("stopping after step %d (--stop-at)\n", done);
    return !stop;
}

static void print_bench_result(const Trainer* t) {
    const ModelConfig* c = &t->model.cfg;
    int world = t->model.dp.world;
    double ms = t->bench_ms / t->bench_timed, tok_s = (double)t->model.N * t->accum * world / (ms / 1e3);
    double flops = flops_per_token(c);
    printf("{\"bench\": \"train_gpt\", \"device\": \"%s\", \"gpus\": %d, \"zero\": %d, \"B\": %d, \"T\": %d, "
           "\"d_model\": %d, \"layers\": %d, \"heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"ffn\": %d, "
           "\"recompute\": \"%s\", \"recompute_layers\": %d, \"fp8\": \"%s\", \"fp8_head\": %d, "
           "\"fp8_fast_accum\": %d, \"optimizer\": \"%s\", \"matmul_tune\": %d, \"ms_per_step\": %.3f, "
           "\"tokens_per_s\": %.1f, \"tokens_per_s_per_gpu\": %.1f, "
           "\"mfu\": %.4f, \"flops_per_token\": %.6g, \"peak_mem_gib\": %.3f, \"first_step_s\": %.2f, "
           "\"final_loss\": %.4f}\n",
           t->prop.name, world, t->model.dp.zero, t->model.B, t->model.T, c->d_model, c->n_layer, c->n_head,
           c->n_kv_head, c->head_dim, c->ffn_dim, RECOMPUTE_NAMES[t->o.recompute], t->model.recompute_layers,
           t->o.fp8 ? FP8_SCALING_NAMES[t->o.fp8_scaling] : "off", t->o.fp8_head, t->o.fp8_fast_accum,
           OPTIMIZER_NAMES[t->o.optimizer], t->o.matmul_tune, ms, tok_s, tok_s / world,
           tok_s / world * flops / (t->o.peak_tflops * 1e12), flops, gib(gpt_bytes_total(&t->model)),
           t->t_first_step, t->last_loss);
}

// After the loop: the benchmark's line, the export, the gradient dump, the last checkpoint.
static void trainer_finish(Trainer* t) {
    const Options* o = &t->o;
    char err[1024];
    log_steps(t, t->step - 1);
    if (o->bench) print_bench_result(t);
    if (o->export_dir) {  // every rank joins the gather of the master weights; rank 0 writes
        bool writer = t->env.rank == 0;
        float* master = writer ? (float*)xmalloc(t->model.table.n_elements * sizeof(float)) : NULL;
        gpt_gather_master(&t->model, master);
        if (writer && !export_hf(&t->model, master, o->export_dir, err, sizeof(err))) die("--export: %s", err);
        printf("exported transformers' Qwen3 checkpoint to %s\n", o->export_dir);
        free(master);
    }
    if (o->dump_grads_dir) dump_grads(&t->model, &t->up, next_window(t), o->dump_grads_dir);
    if (t->checkpointing && !checkpoint_wait(&t->ckpt)) checkpoint_failed(&t->ckpt, false);
}

static void trainer_close(Trainer* t) {
    if (t->checkpointing) checkpointer_free(&t->ckpt);
    if (t->log) fclose(t->log);
    if (t->sampling) {
        tokenizer_free(&t->tokenizer);
        free(t->prompt.data);
    }
    if (!t->o.bench) {
        loader_close(&t->train);
        if (t->have_val) loader_close(&t->val);
    }
    for (int i = 0; i < STEPS_IN_FLIGHT; i++) {
        CUDA_CHECK(cudaEventDestroy(t->step_start[i]));
        CUDA_CHECK(cudaEventDestroy(t->step_end[i]));
    }
    CUDA_CHECK(cudaFreeHost(t->readback));
    CUDA_CHECK(cudaFreeHost(t->matmul_errors));
    CUDA_CHECK(cudaFreeHost(t->scales_readback));
    CUDA_CHECK(cudaFree(t->scales_gathered));
    free(t->synthetic);
    for (int i = 0; i < 2; i++)
        if (t->graphs[i].exec) CUDA_CHECK(cudaGraphExecDestroy(t->graphs[i].exec));
    uploader_free(&t->up);
    gpt_free(&t->model);
    if (t->parallel) comm_close(&t->comm);
}

// Which rank of how many this process is, from the launcher's environment (torchrun, Slurm, or
// --gpus's own); rank 0 of 1 without one. Exits 2 with one line on a malformed environment.
static void read_launch_env(const Options* o, CommEnv* env) {
    char err[1024];
    if (comm_env_read(env, NULL, o->master, err, sizeof(err)) != 0) usage_error("%s", err);
    long rank_tokens = (long)o->batch_size * o->model.seq_len * env->world;
    if (o->total_batch_tokens > 0 && o->total_batch_tokens % rank_tokens != 0) {
        usage_error("--total-batch %d must be a multiple of --batch x --seq x GPUs = %ld",
                    o->total_batch_tokens, rank_tokens);
    }
    if (env->world > 1 && o->dump_grads_dir) usage_error("--dump-grads runs on one GPU");
    static char name[64];
    if (env->world > 1) {
        snprintf(name, sizeof(name), "train_gpt rank %d of %d", env->rank, env->world);
        program_name = name;  // every line a rank says names it
    }
}

// --gpus N without a launcher: this process starts the N ranks and waits for them.
// --gpus 0: every GPU this process sees (the ranks are exec'd afresh, so asking CUDA here is safe).
// Counting them is the first look for a GPU, so main settles --gpus after every check that needs
// none: a bad flag is named as such on a machine without a GPU too. Under a launcher, --gpus must
// be the number of ranks it started (exit 2).
static void settle_gpus(Options* o, const CommEnv* env) {
    if (o->gpus == 0) {
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess || n < 1) die("--gpus 0 (every GPU): this machine has no CUDA GPU that this process can use");
        o->gpus = n;
    }
    if (strcmp(env->launcher, "single") && o->gpus > 1 && o->gpus != env->world) {
        usage_error("--gpus %d, but the launcher (%s) started %d ranks; leave out --gpus", o->gpus,
                    env->launcher, env->world);
    }
}

static int launch_ranks(int n, char** argv) {
    char err[1024];
    int status = comm_launch_local(n, argv, err, sizeof(err));
    if (status < 0) {
        warn("--gpus %d: %s", n, err);
        return 1;
    }
    return status;
}

// The model flags come from config.json with --init-from: giving one as well is an error (exit 2)
// rather than a silent choice between the two. --seq, which config.json does not hold, stays.
static void read_init_from_config(Options* o) {
    char err[CK_PATH_MAX + 256];
    if (!o->init_from) return;
    if (o->model_flag) {
        usage_error("%s with --init-from: the model is %s/config.json's; leave out the model flags",
                    o->model_flag, o->init_from);
    }
    if (hf_config_read(o->init_from, &o->model, err, sizeof(err)) != 0) die("--init-from: %s", err);
}

// What --init-from and --resume will read, checked before the GPU is looked for, so that a
// mistake in a path or a file is named as such and not as a missing GPU: --init-from's
// safetensors header; --resume's manifest, the sizes of the files it lists, and its config against
// this run's. The data and the tokenizer are checked next, by trainer_open_data. Exits 1 with one
// line. Sets o->resume_dir, where resume_from will read.
static void check_inputs(Options* o) {
    char err[CK_PATH_MAX + 512], path[CK_PATH_MAX];
    if (o->init_from) {
        StFile weights;
        snprintf(path, sizeof(path), "%s/model.safetensors", o->init_from);
        if (st_open(&weights, path, err, sizeof(err)) != 0) die("--init-from: %s", err);
        st_close(&weights);
    }
    if (o->resume) {
        CkptReader r;
        char why[512], fallback[CK_PATH_MAX + 512] = "";
        if (strcmp(o->resume, "latest") != 0) snprintf(o->resume_dir, sizeof(o->resume_dir), "%s", o->resume);
        else if (ckpt_resolve_latest(o->out_dir, o->resume_dir, sizeof(o->resume_dir), fallback, sizeof(fallback)) < 0)
            die("--resume latest: %s", fallback);
        const char* dir = o->resume_dir;
        if (ckpt_peek(&r, dir, err, sizeof(err)) != 0) die("--resume: %s", err);
        bool same = model_config_matches(&o->model, &r.manifest, r.config, why, sizeof(why));
        ckpt_close(&r);
        if (!same) die("--resume: %s/" CKPT_MANIFEST ": %s", dir, why);
        // 'latest' unreadable, the newest directory taken instead: said once the run is sure to go on
        if (fallback[0]) warn("--resume latest: %s", fallback);
    }
}

// A run: read the command line, open the data, the log and the model (fresh, from a transformers
// checkpoint, or resumed), take optimizer steps, then export and finish the last checkpoint.
int main(int argc, char** argv) {
    program_name = "train_gpt";
    Options o;
    options_default(&o);
    parse_args(&o, argc, argv);
    read_init_from_config(&o);
    check_options(&o);
    check_inputs(&o);
    CommEnv env;
    read_launch_env(&o, &env);
    settle_gpus(&o, &env);
    if (o.gpus > 1 && !strcmp(env.launcher, "single")) return launch_ranks(o.gpus, argv);

    Trainer t;
    trainer_open(&t, &o, &env);
    print_run_header(&t);
    for (int step = t.start_step; step < t.o.optim.total_steps; step++) {
        train_step(&t);
        if (!after_step(&t, step)) break;
    }
    trainer_finish(&t);
    trainer_close(&t);
    return 0;
}
#endif
