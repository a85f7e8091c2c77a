/*
 * dev/matmul.cu - the matmul ladder (issue 12): the three products of every linear layer of the
 * trainer, forward y = x W^T, input gradient dx = dy W and weight gradient dW += dy^T x (bf16 in,
 * fp32 accumulation, bf16 out; dW fp32 and accumulated, as the trainer keeps it), each version
 * checked against a CPU FP64 reference and timed at the trainer's own shapes beside cuBLASLt.
 *
 * Versions (the forms and their operand layouts: dev/matmul_common.cuh):
 *   0  cuBLASLt through kernels.cuh's linear_forward / linear_backward_input /
 *      linear_backward_weight: the trainer's own calls, the reference column of the table.
 *   1  naive (matmul_naive.cuh): a thread per output, an fp32 loop over k. Any shape.
 *   2  mma.sync (matmul_mma.cuh): 128 x 128 tiles, 8 warps of 64 x 32, ldmatrix, a 3-stage
 *      cp.async ring.
 *   3  Hopper (matmul_wgmma.cuh): 128 x 256 tiles, TMA loads on a 4-stage mbarrier ring, wgmma
 *      m64n256k16 from swizzled shared memory, a producer warpgroup and two consumer warpgroups;
 *      a block per tile.
 *   4  version 3's kernel on a persistent grid (a block per SM) walking the tiles in groups of 8
 *      tile rows; a block's next tile loads while this one's epilogue stores.
 *   5  version 4 whose epilogue stages C in shared memory and stores it by TMA (fp32 dW added in
 *      L2 by a TMA reduction), the stores running on under the next tile's products; where there
 *      are fewer tiles than half the SMs, K is split and the fp32 partials summed in a fixed order
 *      by a second kernel; where tiles 128 x 192 fill the SMs' waves clearly better than 128 x 256
 *      (96 tiles become 128: default gate_up's dW, the head's dx), it takes those.
 *   6  version 5's kernel with the next kernel's work fused into its epilogue, where the trainer
 *      runs one after the product: the residual added (attn_out, down: y = x W^T + residual, as
 *      cuBLASLt's beta = 1), SwiGLU (gate_up: a tile takes 128 gate and the same 128 up features,
 *      and stores gate_up and act = silu(gate) * up) and SwiGLU's backward (down's input gradient
 *      d_mlp_act = dy W, from which the epilogue makes d_gate_up with gate_up, never storing
 *      d_mlp_act), with or without act remade from the same gate_up (a recomputing layer's: the
 *      trainer's third instance, "dx+swiglu_bwd+act"). It has only these fused forms (its plain
 *      ones would be version 5's), timed against cuBLASLt plus the trainer's separate steps, in a
 *      table of their own.
 *   7  version 5 (256 wide) with stream-K where its units would leave more than a tenth of the last
 *      wave's SMs idle (96 tiles on 132 SMs): every block an equal share of all the tiles' k-blocks,
 *      a range that may start and end inside a tile; a tile's pieces are summed by the block that owns its
 *      first one, in range order, so the bits depend on the shape and the SM count only.
 *   8  version 5 on FP8 operands, the products the trainer's --fp8 1 runs through cuBLASLt (forms
 *      "fwd fp8", "dx fp8", "dW fp8": the TN form, E4M3 x E4M3 forward, E5M2 dy x E4M3 backward):
 *      wgmma m64n128k32 from the same 128-byte rows, each k-block of 128 summed afresh and promoted
 *      into fp32 times the operands' scales; timed against cuBLASLt's FP8 matmul (kernels.cuh's
 *      matmul() with the same scale pointers) in a table of their own. It has only these forms.
 *   9  versions 5 and 6 (plain forms and fused ones) in clusters of two blocks: the two take tiles
 *      one above the other, which read the same tile of B, and each loads half of that tile into
 *      both blocks' shared memory by TMA multicast, so L2 serves B once a pair; version 5's tile
 *      widths and splits of K; each output the same fp32 sum in the same order as versions 5 and 6
 *      make it.
 *  11  version 5 in ping-pong: tiles 128 x 192, each one consumer warpgroup's whole (two m64n192
 *      products a k-step into 192 accumulator registers a thread), dealt to the two consumers in
 *      turn, so that one's epilogue runs while the other's products do; its own full barriers a
 *      consumer; K never split. (Version 10, ping-pong of 64 x 256 tiles, was tried and taken out:
 *      doc/matmul.md.) One fused form, SwiGLU's forward ("fwd+swiglu"), in tiles 192 x 128 (three
 *      m64n128 products a k-step: 64 gate and the same 64 up features). The trainer runs both: the
 *      head's forward with the exponentials' epilogue, and the gate/up forward with SwiGLU.
 * Versions 2-7, 9 and 11 (and cuBLASLt here) take sides that are multiples of 8 (SwiGLU: F too), the FP8
 * forms (version 8, cuBLASLt) multiples of 16; a shape a version cannot take is skipped, with a word. Resource use (-Xptxas -v) and the figures:
 * doc/matmul.md.
 *
 * Usage: ./dev/matmul            check and time every version
 *        ./dev/matmul N          version N only, cuBLASLt beside it (digits: "56" runs 5 and 6; "8": FP8;
 *                                version 11 is the letter b: "5b")
 *        a second argument `check` skips the timing (./dev/matmul 3 check)
 *
 * Shapes: the trainer's, from its own parameter table (param_shape, qkv_dim in train_gpt.cu), for
 * the default config (batch 32 x 1024 tokens) and for 1b (the scripts' --d-model 2048 --heads 32
 * --kv-heads 8 --head-dim 64 --ffn 8192 --batch 8): the layers' qkv, attn_out, gate_up and down
 * matrices and the output head, whose rows go LOSS_CHUNK at a time; each in its three forms, and
 * the fused forms of attn_out, down (fwd+res), gate_up (fwd+swiglu) and down (dx+swiglu_bwd, and
 * dx+swiglu_bwd+act against cuBLASLt's dx, swiglu_backward and swiglu_forward). The
 * plain forward is timed without the residual that the trainer adds in attn_out's and down's.
 *
 * Checks: first small awkward shapes (sides that are not multiples of the tiles, K not a multiple
 * of 64, more tiles than SMs, few tiles on a long K, 8 x 8 x 8, odd sides for the naive version),
 * every entry; then each trainer shape on a 64 x 64 grid of sampled entries (the first and last row
 * and column among them). Inputs are uniform with unit variance; the reference sums the exact bf16
 * inputs in fp64. An entry passes when |gpu - ref| <= 2^-7 |ref| + 2^-10 sqrt(sum_k (a_k b_k)^2):
 * the first term is twice the rounding of a bf16 output (bf16 keeps 8 significant bits: a relative
 * error up to 2^-8); the second covers the fp32 accumulation in any order (its rounding errors grow
 * like sqrt(K) 2^-24 times the partial sums, under 2^-16 of that norm for K <= 65536). Simulated on
 * the CPU (fp32 sums in k order, then bf16; K = 8 .. 50304, 300 dot products each), correct results
 * stay under 0.44 of the tolerance, while one k-block of 64 lost puts the median entry at 3.7 (K =
 * 50304) to 30 (K = 768) times it: among the thousands of entries checked such a bug cannot hide. A
 * bf16 output is poisoned with NaN before each checked run; an fp32 dW is filled with known values,
 * which it accumulates onto. A second run from the same start must then give the same bits, as
 * the trainer's determinism asks (a split K summed in an order that timing sets would not), with
 * no bf16 entry left NaN. The residual form's reference adds the bf16 residual; SwiGLU's gate_up is
 * checked as the product, and its act, whole, against the trainer's swiglu_forward run on that
 * gate_up on the GPU: the same bits, or it fails. SwiGLU's backward: the version's plain dx (version
 * 6: its kernel unsplit, the same fp32 sums its epilogue rounds) is checked as the product, and the
 * fused d_gate_up, whole, against the trainer's swiglu_backward run on that dx and gate_up: the
 * same bits, or it fails. The FP8 forms' operands are codes: the device rounds uniform_at's values
 * times 2^7 (E4M3) or 2^12 (E5M2) to FP8 (fill_fp8_device), the reference rounds the same values
 * with test/reference.h's ref_fp8_round and sums those real values (times 2^-7, 2^-12) in fp64;
 * the tolerance is the bf16 one above, its norm taken over the rounded operands (version 8 promotes
 * to fp32 every 128 k: doc/matmul.md says why the check would catch a kernel that did not).
 *
 * Timing: CUDA events, the median of 10 runs after 3 warm-ups (naive: its checked run alone);
 * TFLOP/s = 2 M N K / time; "x" is cuBLASLt's time over the version's (1.00: level with it).
 * Operands are not rotated through memory: those of most shapes exceed the 50 MiB L2.
 *
 * Robustness: each version runs in its own child process, forked before any CUDA call, so that a
 * crash (a sticky CUDA error) or a hang costs it only the shape it happened at: the parent marks
 * that shape, starts a fresh child after it (up to MAX_CHILD_DEATHS times), and kills a child that
 * reports nothing for STALL_LIMIT_S seconds. Kernels that wait on mbarriers bound every wait
 * (MM_TIMEOUT).
 */
#define TRAIN_GPT_NO_MAIN
#include "../train_gpt.cu"  // the parameter table, DEFAULT_CONFIG, and the cuBLASLt wrappers
#include "common.h"
#include "../test/reference.h"  // ref_fp8_round: the FP8 forms' reference operands
#include "matmul_naive.cuh"
#include "matmul_mma.cuh"
#include "matmul_wgmma.cuh"
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <string>
#include <thread>

static const int LOSS_CHUNK = 4096;          // train_gpt's --loss-chunk default: the head's rows at a time
static const float UNIT_UNIFORM = 1.7320508f;  // sqrt(3): uniform in [-sqrt 3, sqrt 3) has variance 1
static const int SAMPLES = 64;               // rows and columns checked at a trainer shape
static const double STALL_LIMIT_S = 60;     // a child that reports nothing for so long is killed
static const int MAX_CHILD_DEATHS = 3;       // crashed or killed children before a version is given up

// ----------------------------------------------------------------------------------------------
// The forms, the versions

// The three products, then the fused forms: forwards with the next kernel's work done in the
// epilogue (version 6), the residual added (attn_out's and down's: y = x W^T + residual) or SwiGLU
// applied (gate_up's: gate_up = x W^T and act = silu(gate) * up), timed against cuBLASLt with that
// work done as the trainer does it (beta = 1; swiglu_forward after the product).
// One fused form is a backward: down's input gradient with SwiGLU's backward after it (d_gate_up
// from d_mlp_act = dy W and gate_up), against cuBLASLt's dx and then swiglu_backward; and the same
// remaking the forward's act from gate_up (a recomputing layer), against those and swiglu_forward.
// Last, the three products in FP8 as the trainer's --fp8 1 runs them (doc/fp8.md, "Layouts"): every
// operand K-major (the TN form), C[M][N] = A[M][K] B[N][K]^T, A and B the codes of real values
// stored times a power-of-two scale: the forward x (E4M3) W^T (E4M3); the input gradient dy (E5M2)
// by B = W^T [I][O] (E4M3); the weight gradient dy^T [O][N] (E5M2) by x^T [I][N] (E4M3), fp32 +=.
typedef enum { FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD_RESIDUAL, FORWARD_SWIGLU, BACKWARD_INPUT_SWIGLU,
               BACKWARD_INPUT_SWIGLU_ACT, FP8_FORWARD, FP8_BACKWARD_INPUT, FP8_BACKWARD_WEIGHT, N_FORMS } Form;
static const char* FORM_NAMES[N_FORMS] = {"fwd", "dx", "dW", "fwd+res", "fwd+swiglu", "dx+swiglu_bwd",
                                          "dx+swiglu_bwd+act", "fwd fp8", "dx fp8", "dW fp8"};
static const bool A_KMAJOR[N_FORMS] = {true, true, false, true, true, true, true, true, true, true};
static const bool B_KMAJOR[N_FORMS] = {true, false, false, true, true, false, false, true, true, true};
static bool swiglu_backward_form(Form f) { return f == BACKWARD_INPUT_SWIGLU || f == BACKWARD_INPUT_SWIGLU_ACT; }
static bool fused_form(Form f) { return f >= FORWARD_RESIDUAL && f < FP8_FORWARD; }
static bool fp8_form(Form f) { return f >= FP8_FORWARD; }
static bool weight_form(Form f) { return f == BACKWARD_WEIGHT || f == FP8_BACKWARD_WEIGHT; }  // fp32 C, +=
// The FP8 forms' operands: A in E5M2 (dy) but in the forward; B always E4M3. Stored = real x
// 2^exponent, E4M3's 2^7 and E5M2's 2^12 (uniform values of unit variance, |x| < 1.74, stay below
// 448 and 57344: nothing saturates); the products take 2^-7 and 2^-12 back through their scale_inv.
static bool fp8_a_e5m2(Form f) { return f != FP8_FORWARD; }
static int fp8_exponent(bool e5m2) { return e5m2 ? 12 : 7; }

typedef void (*Bf16Fn)(bf16* out, const bf16* a, const bf16* b, int N, int I, int O, cudaStream_t s);
typedef void (*WeightFn)(float* dW, const bf16* dy, const bf16* x, int N, int I, int O, cudaStream_t s);
typedef void (*ResidualFn)(bf16* y, const bf16* x, const bf16* W, const bf16* residual, int N, int I, int O,
                           cudaStream_t s);
typedef void (*SwigluFn)(bf16* gate_up, bf16* act, const bf16* x, const bf16* W, int N, int I, int O, cudaStream_t s);
// act: NULL, or where the forward's act [N, F] is remade from gate_up
typedef void (*SwigluBackwardFn)(bf16* d_gate_up, bf16* d_act, bf16* act, const bf16* dy, const bf16* W,
                                 const bf16* gate_up, int N, int I, int O, cudaStream_t s);
// An FP8 form: c (bf16, or fp32 +=) [M][N] = a_scale_inv b_scale_inv a [M][K] b [N][K]^T, the scales device floats.
typedef void (*Fp8Fn)(Form form, void* c, const uint8_t* a, const uint8_t* b, const float* a_scale_inv,
                      const float* b_scale_inv, int M, int N, int K, cudaStream_t s);

typedef struct {
    int version;
    const char* name;
    Bf16Fn forward, backward_input;  // forward(y, x, W, ...), backward_input(dx, dy, W, ...)
    WeightFn backward_weight;        // backward_weight(dW, dy, x, ...)
    ResidualFn forward_residual;     // the fused forms (NULL: the version has none; nor has version 6 the
    SwigluFn forward_swiglu;         // plain three, which are version 5's)
    SwigluBackwardFn backward_swiglu;
    Bf16Fn swiglu_bwd_product;       // the plain dx whose bf16 output backward_swiglu's SwiGLU step reads
    Fp8Fn fp8;                       // the FP8 forms (NULL: none)
    bool sides_of_8;                 // runs only shapes whose sides are multiples of 8
    int warmup, reps;                // timing; reps 0: the checked run's own time (the naive version)
} Impl;

static void cublaslt_forward(bf16* y, const bf16* x, const bf16* W, int N, int I, int O, cudaStream_t s) {
    linear_forward(y, x, W, NULL, N, I, O, s);
}
// dW += dy^T x, as every version here computes it (the trainer's later micro-batches; its first sets dW).
static void cublaslt_backward_weight(float* dW, const bf16* dy, const bf16* x, int N, int I, int O, cudaStream_t s) {
    linear_backward_weight(dW, dy, x, N, I, O, true, s);
}
// The trainer's own two steps: the product, then swiglu_forward on the stored gate_up (O = 2F).
static void cublaslt_forward_swiglu(bf16* gate_up, bf16* act, const bf16* x, const bf16* W, int N, int I, int O,
                                    cudaStream_t s) {
    linear_forward(gate_up, x, W, NULL, N, I, O, s);
    swiglu_forward(act, gate_up, N, O / 2, s);
}
// And the backward's: dx = d_mlp_act [N, I = F] into d_act, then swiglu_backward reads it back (and
// a recomputing layer's swiglu_forward makes act again from gate_up).
static void cublaslt_backward_swiglu(bf16* d_gate_up, bf16* d_act, bf16* act, const bf16* dy, const bf16* W,
                                     const bf16* gate_up, int N, int I, int O, cudaStream_t s) {
    linear_backward_input(d_act, dy, W, N, I, O, s);
    swiglu_backward(d_gate_up, d_act, gate_up, N, I, s);
    if (act) swiglu_forward(act, gate_up, N, I, s);
}
// The trainer's FP8 products: kernels.cuh's matmul() in the TN form with the operands' scale_inv
// pointers, as layer_forward and layer_backward call it. Row-major C[M][N] = A B^T is column-major
// D[N, M] = op_T(B) A; the weight gradient adds to C (beta 1).
static void cublaslt_fp8(Form form, void* c, const uint8_t* a, const uint8_t* b, const float* a_scale_inv,
                         const float* b_scale_inv, int M, int N, int K, cudaStream_t s) {
    const MatmulOperand A = {(void*)a, fp8_a_e5m2(form) ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, a_scale_inv, NULL};
    const MatmulOperand B = {(void*)b, CUDA_R_8F_E4M3, b_scale_inv, NULL};
    if (weight_form(form)) matmul(mm_f32((float*)c), 1.0f, B, A, c, 1.0f, N, M, K, true, false, s);
    else matmul(mm_bf16((bf16*)c), 1.0f, B, A, NULL, 0.0f, N, M, K, true, false, s);
}
// Version 8: version 5's plan (TMA store, split K) on FP8 operands, the scales' product in the epilogue.
static void hopper_fp8(Form form, void* c, const uint8_t* a, const uint8_t* b, const float* a_scale_inv,
                       const float* b_scale_inv, int M, int N, int K, cudaStream_t s) {
    typedef HopperMatmul<5> V;
    const __nv_fp8_e4m3* b8 = (const __nv_fp8_e4m3*)b;
    if (weight_form(form))
        V::gemm<true, true>((float*)c, (const __nv_fp8_e5m2*)a, b8, M, N, K, s, a_scale_inv, b_scale_inv);
    else if (fp8_a_e5m2(form))
        V::gemm<true, true>((bf16*)c, (const __nv_fp8_e5m2*)a, b8, M, N, K, s, a_scale_inv, b_scale_inv);
    else V::gemm<true, true>((bf16*)c, (const __nv_fp8_e4m3*)a, b8, M, N, K, s, a_scale_inv, b_scale_inv);
}

// Versions 6 and 9: one launch, d_mlp_act never stored (d_act unused).
template <int CLUSTER>
static void hopper_backward_swiglu_form(bf16* d_gate_up, bf16*, bf16* act, const bf16* dy, const bf16* W,
                                        const bf16* gate_up, int N, int I, int O, cudaStream_t s) {
    hopper_backward_swiglu<CLUSTER>(d_gate_up, act, dy, W, gate_up, N, I, O, s);
}

static const Impl IMPLS[] = {
    {0, "cuBLASLt", cublaslt_forward, linear_backward_input<bf16>, cublaslt_backward_weight, linear_forward,
     cublaslt_forward_swiglu, cublaslt_backward_swiglu, linear_backward_input<bf16>, cublaslt_fp8, true, 3, 10},
    {1, "naive", mm_forward<NaiveMatmul>, mm_backward_input<NaiveMatmul>, mm_backward_weight<NaiveMatmul>, NULL, NULL,
     NULL, NULL, NULL, false, 0, 0},
    {2, "mma.sync", mm_forward<MmaMatmul>, mm_backward_input<MmaMatmul>, mm_backward_weight<MmaMatmul>, NULL, NULL,
     NULL, NULL, NULL, true, 3, 10},
    {3, "wgmma", mm_forward<HopperMatmul<3>>, mm_backward_input<HopperMatmul<3>>, mm_backward_weight<HopperMatmul<3>>,
     NULL, NULL, NULL, NULL, NULL, true, 3, 10},
    {4, "wgmma persistent", mm_forward<HopperMatmul<4>>, mm_backward_input<HopperMatmul<4>>,
     mm_backward_weight<HopperMatmul<4>>, NULL, NULL, NULL, NULL, NULL, true, 3, 10},
    {5, "TMA+split-K", mm_forward<HopperMatmul<5>>, mm_backward_input<HopperMatmul<5>>,
     mm_backward_weight<HopperMatmul<5>>, NULL, NULL, NULL, NULL, NULL, true, 3, 10},
    {6, "fused epilogues", NULL, NULL, NULL, hopper_forward_residual<1>, hopper_forward_swiglu<1>,
     hopper_backward_swiglu_form<1>, mm_backward_input<HopperMatmul<6>>, NULL, true, 3, 10},
    {7, "stream-K", mm_forward<HopperMatmul<7>>, mm_backward_input<HopperMatmul<7>>,
     mm_backward_weight<HopperMatmul<7>>, NULL, NULL, NULL, NULL, NULL, true, 3, 10},
    {8, "FP8", NULL, NULL, NULL, NULL, NULL, NULL, NULL, hopper_fp8, true, 3, 10},
    {9, "clusters of 2", mm_forward<HopperMatmul<9>>, mm_backward_input<HopperMatmul<9>>,
     mm_backward_weight<HopperMatmul<9>>, hopper_forward_residual<2>, hopper_forward_swiglu<2>,
     hopper_backward_swiglu_form<2>, mm_backward_input<HopperMatmul<6>>, NULL, true, 3, 10},
    {11, "ping-pong 128x192", mm_forward<HopperMatmul<11>>, mm_backward_input<HopperMatmul<11>>,
     mm_backward_weight<HopperMatmul<11>>, NULL, hopper_forward_swiglu<1, true>, NULL, NULL, NULL, true, 3, 10},
};
// A version's letter on the command line: its digit, or (11) 'b'.
static char version_letter(int v) { return v < 10 ? '0' + v : 'a' + v - 10; }
static const int N_IMPLS = sizeof(IMPLS) / sizeof(IMPLS[0]);

static bool has_form(const Impl& im, Form f) {
    switch (f) {
    case FORWARD: return im.forward;
    case BACKWARD_INPUT: return im.backward_input;
    case BACKWARD_WEIGHT: return im.backward_weight;
    case FORWARD_RESIDUAL: return im.forward_residual;
    case FORWARD_SWIGLU: return im.forward_swiglu;
    case BACKWARD_INPUT_SWIGLU:
    case BACKWARD_INPUT_SWIGLU_ACT: return im.backward_swiglu;
    default: return im.fp8;
    }
}
// The report's tables: the plain forms, the fused ones, the FP8 ones.
typedef enum { PLAIN_TABLE, FUSED_TABLE, FP8_TABLE } Table;
static Table table_of(Form f) { return fp8_form(f) ? FP8_TABLE : fused_form(f) ? FUSED_TABLE : PLAIN_TABLE; }
static bool has_table(const Impl& im, Table t) {
    if (t == FUSED_TABLE) return im.forward_residual || im.forward_swiglu || im.backward_swiglu;
    return t == PLAIN_TABLE ? im.forward != NULL : im.fp8 != NULL;
}

// ----------------------------------------------------------------------------------------------
// Cases: one form at one shape, with the entries it checks and their reference.

typedef struct {
    std::string name;  // "default qkv", "check"
    Form form;
    int tok, I, O;     // the trainer's N, I, O (x [N, I], W [O, I]; SwiGLU: O = 2F)
    int M, N, K;       // the GEMM: C[M][N] (+)= A[M][K] B[K][N] (matmul_common.cuh)
    bool timed;        // a trainer shape: sampled entries checked, then timed
    uint64_t seed;     // A's values come from seed, B's from seed + 1, an fp32 C's or a residual's from seed + 2
    std::vector<int> rows, cols;    // the entries checked: every (rows[i], cols[j])
    std::vector<double> ref, norm;  // for each: the fp64 reference, and sqrt(sum_k (a_k b_k)^2)
} Case;

static Case make_case(const std::string& name, Form form, int tok, int I, int O, bool timed, uint64_t seed) {
    Case c;
    c.name = name;
    c.form = form;
    c.tok = tok, c.I = I, c.O = O;
    if (form == BACKWARD_INPUT || swiglu_backward_form(form) || form == FP8_BACKWARD_INPUT)
        c.M = tok, c.N = I, c.K = O;
    else if (form == FORWARD || fused_form(form) || form == FP8_FORWARD) c.M = tok, c.N = O, c.K = I;
    else c.M = O, c.N = I, c.K = tok;
    c.timed = timed;
    c.seed = seed;
    return c;
}

// n indices in [0, size): all of them when they fit, else the first, the last and n - 2 spread at
// random (splitmix64; repeats are harmless).
static std::vector<int> sample_indices(int size, int n, uint64_t seed) {
    std::vector<int> v;
    if (size <= n) {
        for (int i = 0; i < size; ++i) v.push_back(i);
        return v;
    }
    v.push_back(0);
    v.push_back(size - 1);
    for (int i = 2; i < n; ++i) v.push_back((int)(splitmix64(seed * 0x9E3779B97F4A7C15ull + i) % size));
    return v;
}

// The trainer's shapes: for each config, each matrix in each form.
static void add_trainer_cases(std::vector<Case>& cases) {
    ModelConfig one_b = DEFAULT_CONFIG;
    one_b.d_model = 2048, one_b.n_head = 32, one_b.n_kv_head = 8, one_b.head_dim = 64, one_b.ffn_dim = 8192;
    const struct {
        const char* name;
        ModelConfig cfg;
        int batch;
    } configs[] = {{"default", DEFAULT_CONFIG, 32}, {"1b", one_b, 8}};
    const ParamKind kinds[] = {P_QKV, P_ATTN_OUT, P_GATE_UP, P_DOWN, P_EMBED};
    for (const auto& cf : configs)
        for (ParamKind kind : kinds) {
            int64_t rows, cols;  // the matrix W [O, I]
            param_shape(&cf.cfg, kind, &rows, &cols);
            const int tokens = cf.batch * cf.cfg.seq_len;
            const int tok = kind == P_EMBED ? std::min(LOSS_CHUNK, tokens) : tokens;
            const std::string name = std::string(cf.name) + " " + (kind == P_EMBED ? "head" : PARAM_KINDS[kind].name);
            for (Form f : {FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FP8_FORWARD, FP8_BACKWARD_INPUT, FP8_BACKWARD_WEIGHT})
                cases.push_back(make_case(name, f, tok, (int)cols, (int)rows, true, 1000 + 10 * cases.size()));
            const bool residual = kind == P_ATTN_OUT || kind == P_DOWN;  // the trainer's residual adds
            if (residual || kind == P_GATE_UP)
                cases.push_back(make_case(name, residual ? FORWARD_RESIDUAL : FORWARD_SWIGLU, tok, (int)cols,
                                          (int)rows, true, 1000 + 10 * cases.size()));
            if (kind == P_DOWN)  // its input gradient feeds SwiGLU's backward (and remakes act)
                for (Form f : {BACKWARD_INPUT_SWIGLU, BACKWARD_INPUT_SWIGLU_ACT})
                    cases.push_back(make_case(name, f, tok, (int)cols, (int)rows, true, 1000 + 10 * cases.size()));
        }
}

// The small shapes, as (N, I, O): each form puts them in other roles (make_case).
static void add_check_cases(std::vector<Case>& cases) {
    const int shapes[][3] = {
        {384, 320, 512},   // whole tiles; 5 to 8 k-blocks
        {136, 72, 264},    // edge tiles everywhere, K = 72 / 264 / 136
        {200, 200, 120},
        {128, 1024, 256},  // k-blocks wrap the rings several times
        {1416, 24, 3080},  // more 128 x 256 tiles than SMs: the persistent walk comes round again
        {2000, 136, 200},  // dW: 2 tiles, K = 2000 (32 k-blocks): version 5 splits K in 4 (fp32 partials)
        {136, 200, 2000},  // dx: the same in bf16; SwiGLU's F = 1000, its last tile 104 features (its
                           // backward's: F = 200, a tile of 200 features, K = 2000)
        {1280, 136, 264},  // version 7's ranges start and end inside tiles: dW 3 tiles x 20 k-blocks on 7 blocks
                           // (fp32 +=), dx 10 x 5 on 6 (bf16), fwd 20 x 3 on 7
        {144, 80, 272},    // FP8 (sides of 16): edge tiles everywhere, K = 80 / 272 / 144, k-blocks of 128 cut short
        {2000, 144, 208},  // FP8 dW: 2 tiles, K = 2000 (16 k-blocks of 128): version 8 splits K in 2
        {1408, 32, 3072},  // FP8: 132 tiles of fwd, K = 32 (a quarter of a k-block); dW 24 tiles, K = 1408
        {128, 2048, 256},  // FP8 fwd: 1 tile, K = 2048 (16 k-blocks of 128): version 8 splits K in 2, bf16 out
        {8, 8, 8},
        {77, 19, 33},      // odd sides: the naive version only
    };
    for (const auto& s : shapes)  // fused forms too: SwiGLU where F (O / 2; its backward's: I) is a multiple of 8
        for (int f = 0; f < N_FORMS; ++f) cases.push_back(make_case("check", (Form)f, s[0], s[1], s[2], false, 7 + 10 * cases.size()));
}

// ----------------------------------------------------------------------------------------------
// The CPU reference: fp64 sums of the bf16 inputs, read by storage index exactly as the device
// filled them (fill_uniform_device: element i of a buffer is uniform_at(seed, i) rounded to bf16).
// FP8 operands: the same uniform values times 2^e, rounded by the device's conversion to codes
// (fill_fp8_device); the reference rounds them with test/reference.h's ref_fp8_round (the value
// of ref_fp8_encode's code, ref_fp8_decode(ref_fp8_encode(x))), an independent rounding, and takes
// 2^-e back: the real value the product's scales make of the code.

static double operand_at(uint64_t seed, size_t i) {
    return (double)__bfloat162float(__float2bfloat16(uniform_at(seed, i, UNIT_UNIFORM)));
}

static double fp8_operand_at(uint64_t seed, size_t i, bool e5m2) {
    const int e = fp8_exponent(e5m2);
    return ldexp(ref_fp8_round(ldexp((double)uniform_at(seed, i, UNIT_UNIFORM), e), e5m2), -e);
}

// The device's FP8 operand: codes of uniform_at(seed, i) x 2^e, rounded to nearest even and saturated
// (the conversion lib/fp8.cuh's casts run).
__global__ void fill_fp8_kernel(uint8_t* x, size_t n, uint64_t seed, float scale, bool e5m2) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __nv_cvt_float_to_fp8(uniform_at(seed, i, UNIT_UNIFORM) * scale, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}
static void fill_fp8_device(uint8_t* x, size_t n, uint64_t seed, bool e5m2) {
    fill_fp8_kernel<<<1024, 256>>>(x, n, seed, ldexpf(1.0f, fp8_exponent(e5m2)), e5m2);
    LAUNCH_CHECK();
}

static void case_reference(Case* c) {
    const int M = c->M, N = c->N, K = c->K;
    const bool ak = A_KMAJOR[c->form], bk = B_KMAJOR[c->form];
    const size_t nr = c->rows.size(), nc = c->cols.size();
    const bool fp8 = fp8_form(c->form), a_e5m2 = fp8_a_e5m2(c->form);
    std::vector<double> a(nr * K), b(nc * K);  // the checked rows of A, the checked columns of B
    for (size_t i = 0; i < nr; ++i)
        for (int k = 0; k < K; ++k) {
            const size_t m = c->rows[i], at = ak ? m * K + k : (size_t)k * M + m;
            a[i * K + k] = fp8 ? fp8_operand_at(c->seed, at, a_e5m2) : operand_at(c->seed, at);
        }
    for (size_t j = 0; j < nc; ++j)
        for (int k = 0; k < K; ++k) {
            const size_t n = c->cols[j], at = bk ? n * K + k : (size_t)k * N + n;
            b[j * K + k] = fp8 ? fp8_operand_at(c->seed + 1, at, false) : operand_at(c->seed + 1, at);
        }
    c->ref.assign(nr * nc, 0.0);
    c->norm.assign(nr * nc, 0.0);
    for (size_t i = 0; i < nr; ++i)
        for (size_t j = 0; j < nc; ++j) {
            double sum = 0, sq = 0;
            for (int k = 0; k < K; ++k) {
                const double p = a[i * K + k] * b[j * K + k];
                sum += p;
                sq += p * p;
            }
            const size_t at = (size_t)c->rows[i] * N + c->cols[j];
            if (weight_form(c->form)) sum += uniform_at(c->seed + 2, at, 1.0f);  // dW += ...: onto its start
            if (c->form == FORWARD_RESIDUAL) sum += operand_at(c->seed + 2, at);       // + the bf16 residual
            c->ref[i * nc + j] = sum;
            c->norm[i * nc + j] = sqrt(sq);
        }
}

static void compute_references(std::vector<Case>& cases) {
    const unsigned n_threads = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < n_threads; ++t)
        pool.emplace_back([&cases, t, n_threads] {
            for (size_t i = t; i < cases.size(); i += n_threads) case_reference(&cases[i]);
        });
    for (std::thread& th : pool) th.join();
}

// ----------------------------------------------------------------------------------------------
// Running one version on one case (in a child process)

// NO_FORM: the version has no such form (the fused ones but for cuBLASLt and versions 6 and 9, and
// version 11's SwiGLU forward; the plain ones in version 6); such cases are left out of its counts.
typedef enum { NOT_RUN, OK, WRONG, TIMEOUT, SKIPPED, CRASHED, HUNG, NO_FORM } Status;
static const char* STATUS_NAMES[] = {"not run", "ok", "FAIL", "TIMEOUT", "skip", "CRASHED", "HUNG", "-"};

typedef struct {  // what a child reports of one case, through its pipe
    int index;
    int status;
    float err;  // the worst |gpu - ref| / tolerance over the checked entries
    float ms;   // median time (timed cases that passed)
} Record;

template <typename T>
__global__ void gather_kernel(float* out, const T* c, const int* rows, const int* cols, int nr, int nc, int ldc) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < (long)nr * nc; i += (long)gridDim.x * blockDim.x) {
        const long at = (long)rows[i / nc] * ldc + cols[i % nc];
        if constexpr (sizeof(T) == 2) out[i] = __bfloat162float(c[at]);
        else out[i] = c[at];
    }
}

// The checked entries of the output, as floats.
static std::vector<float> gather_checked(const Case& c, const void* out) {
    const int nr = (int)c.rows.size(), nc = (int)c.cols.size();
    int *rows, *cols;
    float* vals;
    CUDA_CHECK(cudaMalloc(&rows, nr * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&cols, nc * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&vals, (size_t)nr * nc * sizeof(float)));
    CUDA_CHECK(cudaMemcpy(rows, c.rows.data(), nr * sizeof(int), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(cols, c.cols.data(), nc * sizeof(int), cudaMemcpyHostToDevice));
    if (weight_form(c.form)) gather_kernel<<<256, 256>>>(vals, (const float*)out, rows, cols, nr, nc, c.N);
    else gather_kernel<<<256, 256>>>(vals, (const bf16*)out, rows, cols, nr, nc, c.N);
    LAUNCH_CHECK();
    std::vector<float> h((size_t)nr * nc);
    CUDA_CHECK(cudaMemcpy(h.data(), vals, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(rows));
    CUDA_CHECK(cudaFree(cols));
    CUDA_CHECK(cudaFree(vals));
    return h;
}

static const char* case_label(const Case& c, char* buf, size_t len) {
    snprintf(buf, len, "%s %s (M %d N %d K %d)", c.name.c_str(), FORM_NAMES[c.form], c.M, c.N, c.K);
    return buf;
}

// Compares against the reference; prints the worst entry of a failed check. Returns OK or WRONG.
static Status check_output(const Impl& im, const Case& c, const void* out, float* worst) {
    const std::vector<float> got = gather_checked(c, out);
    const size_t nc = c.cols.size();
    double worst_ratio = -1;
    size_t worst_at = 0, bad = 0, nonfinite = 0;
    for (size_t e = 0; e < got.size(); ++e) {
        const double d = fabs((double)got[e] - c.ref[e]);
        const double tol = ldexp(fabs(c.ref[e]), -7) + ldexp(c.norm[e], -10);
        const double ratio = !std::isfinite(got[e]) ? INFINITY : d == 0 ? 0 : d / tol;
        nonfinite += !std::isfinite(got[e]);
        bad += ratio > 1;
        if (ratio > worst_ratio) worst_ratio = ratio, worst_at = e;
    }
    *worst = (float)worst_ratio;
    if (bad == 0) return OK;
    char label[96];
    printf("FAIL v%d %s, %s: %zu of %zu entries off (%zu NaN/inf); worst at row %d col %d: %g, reference %g "
           "(%.1f x the tolerance)\n", im.version, im.name, case_label(c, label, sizeof label), bad, got.size(),
           nonfinite, c.rows[worst_at / nc], c.cols[worst_at % nc], got[worst_at], c.ref[worst_at], worst_ratio);
    return WRONG;
}

// A case's buffers on the device: the operands, the output (dx+swiglu_bwd: d_gate_up [M][2N]), and
// the fused forms' second operand: the residual [M][N] (read), act [M][N/2] (written) or gate_up
// [M][2N] (read); dx+swiglu_bwd's d_act [M][N] holds cuBLASLt's d_mlp_act and the check's plain product,
// and with +act, act [M][N] the remade SwiGLU output.
// FP8 forms: a and b hold codes, and scale_inv the two operands' factors (a's at [0], b's at [4]:
// cuBLASLt's scale pointers are 16-byte aligned).
typedef struct {
    bf16 *a, *b;
    void* out;
    bf16 *extra, *d_act, *act;
    float* scale_inv;
} Buffers;

// The entries of a case's output: d_gate_up is two of d_mlp_act's [M][N].
static size_t output_entries(const Case& c) {
    return (size_t)c.M * c.N * (swiglu_backward_form(c.form) ? 2 : 1);
}

static void run_form(const Impl& im, const Case& c, const Buffers& d) {
    switch (c.form) {
    case FORWARD: im.forward((bf16*)d.out, d.a, d.b, c.tok, c.I, c.O, 0); break;                // y = x W^T
    case BACKWARD_INPUT: im.backward_input((bf16*)d.out, d.a, d.b, c.tok, c.I, c.O, 0); break;  // dx = dy W
    case BACKWARD_WEIGHT: im.backward_weight((float*)d.out, d.a, d.b, c.tok, c.I, c.O, 0); break;  // dW += dy^T x
    case FORWARD_RESIDUAL: im.forward_residual((bf16*)d.out, d.a, d.b, d.extra, c.tok, c.I, c.O, 0); break;
    case FORWARD_SWIGLU: im.forward_swiglu((bf16*)d.out, d.extra, d.a, d.b, c.tok, c.I, c.O, 0); break;  // gate_up, act
    case BACKWARD_INPUT_SWIGLU:  // d_gate_up
        im.backward_swiglu((bf16*)d.out, d.d_act, NULL, d.a, d.b, d.extra, c.tok, c.I, c.O, 0);
        break;
    case BACKWARD_INPUT_SWIGLU_ACT:  // d_gate_up and act
        im.backward_swiglu((bf16*)d.out, d.d_act, d.act, d.a, d.b, d.extra, c.tok, c.I, c.O, 0);
        break;
    default:
        im.fp8(c.form, d.out, (const uint8_t*)d.a, (const uint8_t*)d.b, d.scale_inv, d.scale_inv + 4, c.M, c.N, c.K, 0);
        break;
    }
}

// The outputs before a run: an fp32 dW its known starting values, bf16 outputs (act, d_act too) NaN.
static void reset_output(const Case& c, const Buffers& d) {
    const size_t n = (size_t)c.M * c.N;
    if (weight_form(c.form)) fill_uniform_device((float*)d.out, n, c.seed + 2, 1.0f);
    else poison(d.out, output_entries(c) * sizeof(bf16));
    if (c.form == FORWARD_SWIGLU) poison(d.extra, n / 2 * sizeof(bf16));
    if (swiglu_backward_form(c.form)) poison(d.d_act, n * sizeof(bf16));
    if (c.form == BACKWARD_INPUT_SWIGLU_ACT) poison(d.act, n * sizeof(bf16));
}

// Counts the 16-bit words in which x and y differ and, where they are bf16 values, those of x that
// are not finite (so that an output left at its NaN poison counts, whatever y holds).
__global__ void count_differences_kernel(const uint16_t* x, const uint16_t* y, size_t n, bool bf16_words,
                                         unsigned long long* count) {
    unsigned long long mine = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        mine += x[i] != y[i] || (bf16_words && (x[i] & 0x7F80) == 0x7F80);
    if (mine) atomicAdd(count, mine);
}

static unsigned long long count_differences(const void* x, const void* y, size_t words, bool bf16_words) {
    unsigned long long *count, differ = 0;
    CUDA_CHECK(cudaMalloc(&count, sizeof *count));
    CUDA_CHECK(cudaMemset(count, 0, sizeof *count));
    count_differences_kernel<<<256, 256>>>((const uint16_t*)x, (const uint16_t*)y, words, bf16_words, count);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpy(&differ, count, sizeof differ, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(count));
    return differ;
}

// SwiGLU's act, checked whole against a second, independent path: the trainer's swiglu_forward run
// on the gate_up it came from (the forward's: the version's own, itself checked against the
// reference; the backward's +act: its input), which must give the very same bits (both round as
// swiglu8 does). OK, or WRONG with a line saying how many entries differ.
static Status check_swiglu_act(const Impl& im, const Case& c, const Buffers& d) {
    const bool backward = c.form == BACKWARD_INPUT_SWIGLU_ACT;
    const int F = backward ? c.N : c.N / 2;
    const size_t n = (size_t)c.M * F;
    bf16* act;
    CUDA_CHECK(cudaMalloc(&act, n * sizeof(bf16)));
    swiglu_forward(act, backward ? d.extra : (const bf16*)d.out, c.M, F, 0);
    const unsigned long long differ = count_differences(backward ? d.act : d.extra, act, n, true);
    CUDA_CHECK(cudaFree(act));
    if (differ == 0) return OK;
    char label[96];
    printf("FAIL v%d %s, %s: act differs from swiglu_forward on its gate_up (or is not finite) in %llu of %zu "
           "entries\n", im.version, im.name, case_label(c, label, sizeof label), differ, n);
    return WRONG;
}

// SwiGLU's backward, checked in two steps. The version's plain dx (swiglu_bwd_product: cuBLASLt's
// own, or version 6's kernel with the TMA epilogue and one split of K, whose accumulators the fused
// epilogue rounds alike: the same products in the same order) goes into d_act and is checked
// against the reference; then the fused run's d_gate_up, whole, must equal bit for bit the trainer's
// swiglu_backward_kernel run on the GPU on that d_act and on gate_up. OK, WRONG (with a line saying
// where) or TIMEOUT; *worst is the product's, as check_output reports it.
static Status check_swiglu_backward(const Impl& im, const Case& c, const Buffers& d, float* worst) {
    poison(d.d_act, (size_t)c.M * c.N * sizeof(bf16));
    im.swiglu_bwd_product(d.d_act, d.a, d.b, c.tok, c.I, c.O, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    char label[96];
    const int error = mm_error_take();
    if (error != MM_OK) {
        printf("FAIL v%d %s, %s, its plain product: %s\n", im.version, im.name, case_label(c, label, sizeof label),
               mm_error_text(error));
        return TIMEOUT;
    }
    const Status product = check_output(im, c, d.d_act, worst);
    if (product != OK) return product;
    const size_t n = output_entries(c);
    bf16* want;
    CUDA_CHECK(cudaMalloc(&want, n * sizeof(bf16)));
    swiglu_backward(want, d.d_act, d.extra, c.M, c.N, 0);
    const unsigned long long differ = count_differences(d.out, want, n, true);
    CUDA_CHECK(cudaFree(want));
    if (differ == 0) return OK;
    printf("FAIL v%d %s, %s: d_gate_up differs from swiglu_backward on its plain product (or is not finite) in %llu "
           "of %zu entries\n", im.version, im.name, case_label(c, label, sizeof label), differ, n);
    return WRONG;
}

// The trainer is deterministic, so every version must be: a second run from the same starting
// values must give the same bits in every entry, act's too (a split K summed in an order set by
// timing would not), and no bf16 entry may be left NaN. OK, or WRONG with a line saying how many
// 16-bit words differ.
static Status check_repeatable(const Impl& im, const Case& c, const Buffers& d) {
    const bool weight = weight_form(c.form);
    const bf16* act = c.form == FORWARD_SWIGLU ? d.extra : c.form == BACKWARD_INPUT_SWIGLU_ACT ? d.act : NULL;
    const size_t bytes = output_entries(c) * (weight ? sizeof(float) : sizeof(bf16));
    const size_t act_bytes = act ? bytes / 2 : 0;  // half the forward's gate_up, half the backward's d_gate_up
    unsigned char* first;  // the first run's output, then its act
    CUDA_CHECK(cudaMalloc(&first, bytes + act_bytes));
    CUDA_CHECK(cudaMemcpy(first, d.out, bytes, cudaMemcpyDeviceToDevice));
    if (act) CUDA_CHECK(cudaMemcpy(first + bytes, act, act_bytes, cudaMemcpyDeviceToDevice));
    reset_output(c, d);
    run_form(im, c, d);
    unsigned long long differ = count_differences(first, d.out, bytes / 2, !weight);
    if (act) differ += count_differences(first + bytes, act, act_bytes / 2, true);
    CUDA_CHECK(cudaFree(first));
    const int error = mm_error_take();
    if (differ == 0 && error == MM_OK) return OK;
    char label[96];
    if (error != MM_OK) {
        printf("FAIL v%d %s, %s, its second run: %s\n", im.version, im.name, case_label(c, label, sizeof label),
               mm_error_text(error));
        return TIMEOUT;
    }
    printf("FAIL v%d %s, %s: a second run differs from the first (or is NaN) in %llu of %zu 16-bit words\n",
           im.version, im.name, case_label(c, label, sizeof label), differ, (bytes + act_bytes) / 2);
    return WRONG;
}

// Checks (and, for a trainer shape, times) one version at one case.
static Record run_case(const Impl& im, const Case& c, int index, bool timing) {
    Record r = {index, NOT_RUN, 0, 0};
    char label[96];
    if (!has_form(im, c.form)) {
        r.status = NO_FORM;
        return r;
    }
    const bool fp8 = fp8_form(c.form);
    const char* problem = fp8 ? mm_fp8_shape_problem(c.M, c.N, c.K)
                        : im.sides_of_8 ? mm_tiled_shape_problem(c.M, c.N, c.K) : NULL;
    if (!problem && c.form == FORWARD_SWIGLU)  // its operands are allocated below, 256-byte aligned
        problem = hopper_swiglu_problem(NULL, NULL, NULL, NULL, c.tok, c.I, c.O);
    if (!problem && swiglu_backward_form(c.form))
        problem = hopper_swiglu_backward_problem(NULL, NULL, NULL, NULL, NULL, c.tok, c.I, c.O);
    if (problem) {
        printf("skip v%d %s, %s: %s\n", im.version, im.name, case_label(c, label, sizeof label), problem);
        r.status = SKIPPED;
        return r;
    }
    const bool weight = weight_form(c.form);
    const size_t a_n = (size_t)c.M * c.K, b_n = (size_t)c.K * c.N, c_n = (size_t)c.M * c.N;
    const bool swiglu_bwd = swiglu_backward_form(c.form);
    const size_t operand_bytes = fp8 ? 1 : sizeof(bf16);
    Buffers d = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    CUDA_CHECK(cudaMalloc(&d.a, a_n * operand_bytes));
    CUDA_CHECK(cudaMalloc(&d.b, b_n * operand_bytes));
    CUDA_CHECK(cudaMalloc(&d.out, output_entries(c) * (weight ? sizeof(float) : sizeof(bf16))));
    if (fused_form(c.form))  // residual [M][N], act [M][N/2], gate_up [M][2N]
        CUDA_CHECK(cudaMalloc(&d.extra, (swiglu_bwd ? 2 : 1) * c_n * sizeof(bf16)));
    if (swiglu_bwd) CUDA_CHECK(cudaMalloc(&d.d_act, c_n * sizeof(bf16)));
    if (c.form == BACKWARD_INPUT_SWIGLU_ACT) CUDA_CHECK(cudaMalloc(&d.act, c_n * sizeof(bf16)));
    if (fp8) {
        const bool a_e5m2 = fp8_a_e5m2(c.form);
        fill_fp8_device((uint8_t*)d.a, a_n, c.seed, a_e5m2);
        fill_fp8_device((uint8_t*)d.b, b_n, c.seed + 1, false);
        const float scale_inv[8] = {ldexpf(1.0f, -fp8_exponent(a_e5m2)), 0, 0, 0, ldexpf(1.0f, -fp8_exponent(false))};
        CUDA_CHECK(cudaMalloc(&d.scale_inv, sizeof scale_inv));
        CUDA_CHECK(cudaMemcpy(d.scale_inv, scale_inv, sizeof scale_inv, cudaMemcpyHostToDevice));
    } else {
        fill_uniform_device(d.a, a_n, c.seed, UNIT_UNIFORM);
        fill_uniform_device(d.b, b_n, c.seed + 1, UNIT_UNIFORM);
    }
    if (c.form == FORWARD_RESIDUAL || swiglu_bwd)
        fill_uniform_device(d.extra, (swiglu_bwd ? 2 : 1) * c_n, c.seed + 2, UNIT_UNIFORM);
    reset_output(c, d);
    CUDA_CHECK(cudaDeviceSynchronize());
    mm_error_take();

    cudaEvent_t start, stop;  // around the checked run: the naive version's only timing
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    CUDA_CHECK(cudaEventRecord(start));
    run_form(im, c, d);
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaDeviceSynchronize());
    float checked_ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&checked_ms, start, stop));
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    const int error = mm_error_take();
    if (error != MM_OK) {
        printf("FAIL v%d %s, %s: %s\n", im.version, im.name, case_label(c, label, sizeof label), mm_error_text(error));
        r.status = TIMEOUT;
    } else {
        r.status = swiglu_bwd ? check_swiglu_backward(im, c, d, &r.err) : check_output(im, c, d.out, &r.err);
        if (r.status == OK && (c.form == FORWARD_SWIGLU || c.form == BACKWARD_INPUT_SWIGLU_ACT))
            r.status = check_swiglu_act(im, c, d);
        if (r.status == OK) r.status = check_repeatable(im, c, d);
    }
    if (r.status == OK && c.timed && timing)
        r.ms = im.reps == 0 ? checked_ms : time_median_ms([&] { run_form(im, c, d); }, im.warmup, im.reps);
    CUDA_CHECK(cudaFree(d.a));
    CUDA_CHECK(cudaFree(d.b));
    CUDA_CHECK(cudaFree(d.out));
    CUDA_CHECK(cudaFree(d.extra));
    CUDA_CHECK(cudaFree(d.d_act));
    CUDA_CHECK(cudaFree(d.act));
    CUDA_CHECK(cudaFree(d.scale_inv));
    return r;
}

// A child's life: cases first .. end, one record each down the pipe as soon as it is known. After
// two timeouts the version is taken for broken (each costs up to a second or so per kernel).
static void child_main(const Impl& im, const std::vector<Case>& cases, size_t first, bool timing, int fd) {
    if (first == 0 && im.version == 0) {
        cudaDeviceProp prop;
        CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
        printf("device: %s, %d SMs, %.0f MiB L2\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0);
    }
    matmul_init();
    int timeouts = 0;
    for (size_t i = first; i < cases.size(); ++i) {
        Record r = {(int)i, NOT_RUN, 0, 0};  // after two timeouts: not run, which counts as failed
        if (timeouts < 2) r = run_case(im, cases[i], (int)i, timing);
        timeouts += r.status == TIMEOUT;
        fflush(stdout);
        if (write(fd, &r, sizeof r) != (ssize_t)sizeof r) exit(1);
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Runs a version over every case in child processes, filling results[case]. A child that dies
// (a CUDA error exits, a fault kills) or stalls loses only the case it was in: it is marked, and a
// fresh child goes on from the next one; after MAX_CHILD_DEATHS the version's other cases are not run.
static void run_isolated(const Impl& im, const std::vector<Case>& cases, bool timing, std::vector<Record>& results) {
    size_t next = 0;
    for (int deaths = 0; next < cases.size(); ++deaths) {
        if (deaths == MAX_CHILD_DEATHS) {
            printf("v%d %s: %d child processes lost; its remaining %zu cases are not run\n", im.version, im.name,
                   deaths, cases.size() - next);
            return;
        }
        int fds[2];
        if (pipe(fds) != 0) {
            perror("pipe");
            exit(1);
        }
        fflush(stdout);
        fflush(stderr);
        const pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            exit(1);
        }
        if (pid == 0) {
            close(fds[0]);
            child_main(im, cases, next, timing, fds[1]);
            fflush(stdout);
            exit(0);
        }
        close(fds[1]);
        fcntl(fds[0], F_SETFL, O_NONBLOCK);
        int status = 0, last = (int)next - 1;
        bool hung = false;
        double progress = now_s();
        for (bool done = false; !done;) {
            done = waitpid(pid, &status, WNOHANG) == pid;
            Record r;
            while (read(fds[0], &r, sizeof r) == (ssize_t)sizeof r) {  // records are small: whole or none
                results[r.index] = r;
                last = r.index;
                progress = now_s();
            }
            if (!done && now_s() - progress > STALL_LIMIT_S) {
                kill(pid, SIGKILL);
                waitpid(pid, &status, 0);
                hung = done = true;
            }
            if (!done) usleep(20000);
        }
        close(fds[0]);
        if (!hung && WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
        const int bad = last + 1;  // the case it was in
        if (bad >= (int)cases.size()) return;
        char label[96];
        printf("%s v%d %s, %s: the child process %s; going on with a fresh one\n", hung ? "HUNG" : "CRASHED",
               im.version, im.name, case_label(cases[bad], label, sizeof label),
               hung ? "reported nothing for a minute and was killed" : "died (its error is above)");
        results[bad].status = hung ? HUNG : CRASHED;
        next = bad + 1;
    }
}

// ----------------------------------------------------------------------------------------------
// The report

static bool failed(int status) { return status != OK && status != SKIPPED && status != NO_FORM; }

static void print_summary(const Impl& im, const std::vector<Case>& cases, const std::vector<Record>& res) {
    for (int timed = 0; timed < 2; ++timed) {
        int n = 0, ok = 0, skipped = 0;
        double worst = 0;
        for (size_t i = 0; i < cases.size(); ++i) {
            if (cases[i].timed != (bool)timed || !has_form(im, cases[i].form)) continue;
            ++n;
            ok += res[i].status == OK;
            skipped += res[i].status == SKIPPED;
            if (res[i].status == OK) worst = std::max(worst, (double)res[i].err);
        }
        printf("%s v%d %-17s %-14s %2d ok, %d skipped, %d failed of %d (worst error %.3f of the tolerance)\n",
               ok + skipped == n ? "ok  " : "FAIL", im.version, im.name, timed ? "trainer shapes" : "check shapes",
               ok, skipped, n - ok - skipped, n, worst);
    }
}

// One table: the timed cases of the plain forms, the fused ones or the FP8 ones, for the chosen
// versions that have such forms, cuBLASLt first.
static void print_table(Table table, const std::vector<int>& chosen, const std::vector<Case>& cases,
                        const std::vector<std::vector<Record>>& res) {
    const bool fused = table == FUSED_TABLE;
    std::vector<size_t> cols;  // indices into chosen, after cuBLASLt's
    for (size_t v = 1; v < chosen.size(); ++v)
        if (has_table(IMPLS[chosen[v]], table)) cols.push_back(v);
    if (table != PLAIN_TABLE && cols.empty()) return;
    if (table == FP8_TABLE)
        printf("\nFP8 (the TN form, operands' scales applied; dx and dW read dy in E5M2): TFLOP/s (x: cuBLASLt's "
               "FP8 time through matmul() / the version's)\n");
    else if (fused)
        printf("\nFused forms: the product and the next kernel's work; cuBLASLt's column is the trainer's way (the "
               "residual with beta = 1; swiglu_forward after the product, swiglu_backward after dx, and with +act "
               "swiglu_forward after that), TFLOP/s count "
               "the product's 2 M N K\n");
    else
        printf("\nTFLOP/s (x: cuBLASLt's time / the version's) at the trainer's shapes; "
               "C[M][N] (+)= A[M][K] B[K][N]\n");
    printf("%-16s %-17s %6s %6s %6s | %-16s", "shape", "form", "M", "N", "K", "v0 cuBLASLt");
    for (size_t v : cols) printf(" | v%d %-13.13s", IMPLS[chosen[v]].version, IMPLS[chosen[v]].name);
    printf("\n%-16s %-17s %6s %6s %6s | %7s %8s", "", "", "", "", "", "ms", "TFLOP/s");
    for (size_t v = 0; v < cols.size(); ++v) printf(" | %8s %7s", fused ? "ms" : "TFLOP/s", "x");
    printf("\n");
    for (size_t i = 0; i < cases.size(); ++i) {
        const Case& c = cases[i];
        if (!c.timed || table_of(c.form) != table) continue;
        const double flop = 2.0 * c.M * c.N * c.K;
        const Record& ref = res[0][i];
        printf("%-16s %-17s %6d %6d %6d | ", c.name.c_str(), FORM_NAMES[c.form], c.M, c.N, c.K);
        if (ref.status == OK && ref.ms > 0) printf("%7.3f %8.1f", ref.ms, flop / ref.ms / 1e9);
        else printf("%16s", STATUS_NAMES[ref.status]);
        for (size_t v : cols) {
            const Record& r = res[v][i];
            if (r.status == OK && r.ms > 0) {
                if (fused) printf(" | %8.3f", r.ms);
                else printf(" | %8.1f", flop / r.ms / 1e9);
                if (ref.status == OK && ref.ms > 0) printf(" %6.2fx", ref.ms / r.ms);
                else printf(" %7s", "-");
            } else {
                printf(" | %16s", STATUS_NAMES[r.status]);
            }
        }
        printf("\n");
    }
}

int main(int argc, char** argv) {
    const char* want = argc > 1 ? argv[1] : "";  // digits: the versions to run beside cuBLASLt
    const bool timing = !(argc > 2 && strcmp(argv[2], "check") == 0);
    std::vector<int> chosen = {0};  // indices into IMPLS; cuBLASLt first, always
    for (int i = 1; i < N_IMPLS; ++i)
        if (!*want || strchr(want, version_letter(IMPLS[i].version))) chosen.push_back(i);
    const bool bad_versions =
        *want && (strspn(want, "0123456789b") != strlen(want) || (chosen.size() == 1 && !strchr(want, '0')));
    if (bad_versions || argc > 3 || (argc == 3 && timing)) {
        fprintf(stderr, "usage: %s [versions] [check]; versions are digits of 0 cuBLASLt, 1 naive, 2 mma.sync, "
                        "3 wgmma, 4 wgmma persistent, 5 TMA store and split K, 6 fused epilogues, 7 stream-K, 8 FP8, "
                        "9 clusters of two, b (11) ping-pong, "
                        "in one word (not '%s'%s)\n", argv[0],
                want, argc > 2 ? " followed by more than `check`" : "");
        return 1;
    }

    std::vector<Case> cases;
    add_check_cases(cases);
    add_trainer_cases(cases);
    for (size_t i = 0; i < cases.size(); ++i) {
        Case& c = cases[i];
        c.rows = sample_indices(c.M, c.timed ? SAMPLES : c.M, c.seed + 3);
        c.cols = sample_indices(c.N, c.timed ? SAMPLES : c.N, c.seed + 4);
    }
    const double t0 = now_s();
    compute_references(cases);
    printf("CPU FP64 reference of %zu cases in %.1f s; each version runs in its own process\n", cases.size(),
           now_s() - t0);

    std::vector<std::vector<Record>> results(chosen.size(), std::vector<Record>(cases.size(), Record{0, NOT_RUN, 0, 0}));
    for (size_t v = 0; v < chosen.size(); ++v) run_isolated(IMPLS[chosen[v]], cases, timing, results[v]);

    printf("\nchecks: every entry of the small shapes, %d x %d sampled entries of each trainer shape\n", SAMPLES,
           SAMPLES);
    int failures = 0;
    for (size_t v = 0; v < chosen.size(); ++v) {
        print_summary(IMPLS[chosen[v]], cases, results[v]);
        for (size_t i = 0; i < cases.size(); ++i)
            failures += has_form(IMPLS[chosen[v]], cases[i].form) && failed(results[v][i].status);
    }
    if (timing) {
        print_table(PLAIN_TABLE, chosen, cases, results);
        print_table(FUSED_TABLE, chosen, cases, results);
        print_table(FP8_TABLE, chosen, cases, results);
    }
    printf("%s: %d failed checks\n", failures ? "CHECK FAILED" : "all checks passed", failures);
    return failures ? 1 : 0;
}
