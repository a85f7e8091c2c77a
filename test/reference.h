/*
 * test/reference.h - the CPU reference: the same model's forward and backward in plain C, in double.
 *
 * It shares train_gpt.cu's ModelConfig and parameter table (it is included after train_gpt.cu),
 * so that a flat buffer of parameters or gradients means the same thing on both sides; only the
 * arithmetic differs. Each operation is a small function that test_gpt.cu also checks the GPU
 * kernels against one by one; ref_forward_backward() chains them into the whole model.
 * It is written for clarity, not speed: loops in the order of the math, no tiling, and everything
 * in fp64 so that a finite-difference gradient check can hold it to ~1e-7.
 *
 * Shapes follow train_gpt.cu: rows are tokens (n = b*T + t), parameter matrices are [out, in].
 */
#ifndef REFERENCE_H
#define REFERENCE_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

// y = x W^T, x [N, I], W [O, I], y [N, O]
static void ref_linear_forward(double* y, const double* x, const double* W, int N, int I, int O) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < O; o++) {
            double sum = 0.0;
            for (int i = 0; i < I; i++) sum += x[(size_t)n * I + i] * W[(size_t)o * I + i];
            y[(size_t)n * O + o] = sum;
        }
}

// dx = dy W (overwrites), dW += dy^T x
static void ref_linear_backward(double* dx, double* dW, const double* dy, const double* x, const double* W, int N,
                                int I, int O) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < I; i++) {
            double sum = 0.0;
            for (int o = 0; o < O; o++) sum += dy[(size_t)n * O + o] * W[(size_t)o * I + i];
            dx[(size_t)n * I + i] = sum;
        }
    for (int o = 0; o < O; o++)
        for (int i = 0; i < I; i++) {
            double sum = 0.0;
            for (int n = 0; n < N; n++) sum += dy[(size_t)n * O + o] * x[(size_t)n * I + i];
            dW[(size_t)o * I + i] += sum;
        }
}

// y = w * x / sqrt(mean(x^2) + eps) per row of C; rstd = 1 / sqrt(mean(x^2) + eps)
static void ref_rmsnorm_forward(double* y, double* rstd, const double* x, const double* w, int N, int C, double eps) {
    for (int n = 0; n < N; n++) {
        const double* xr = x + (size_t)n * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += xr[c] * xr[c];
        double r = 1.0 / sqrt(ss / C + eps);
        for (int c = 0; c < C; c++) y[(size_t)n * C + c] = w[c] * xr[c] * r;
        rstd[n] = r;
    }
}

// dx += rstd * (g - x_hat * mean(g * x_hat)), g = dy * w;   dw += sum_n dy * x_hat
static void ref_rmsnorm_backward(double* dx, double* dw, const double* dy, const double* x, const double* w,
                                 const double* rstd, int N, int C) {
    for (int n = 0; n < N; n++) {
        const double *xr = x + (size_t)n * C, *dyr = dy + (size_t)n * C;
        double r = rstd[n], dot = 0.0;
        for (int c = 0; c < C; c++) dot += dyr[c] * w[c] * xr[c] * r;
        for (int c = 0; c < C; c++) {
            double x_hat = xr[c] * r;
            dx[(size_t)n * C + c] += r * (dyr[c] * w[c] - x_hat * dot / C);
            dw[c] += dyr[c] * x_hat;
        }
    }
}

// The RoPE angle of position t and pair i: t * theta^(-2i/D).
static double ref_rope_angle(int t, int i, int D, double theta) { return t * pow(theta, -2.0 * i / D); }

// Per-head RMSNorm of q and k heads (weights wq, wk of length D), then rotate-half RoPE; value
// heads are copied. qkv and out are [N, (Hq + 2Hkv) D]; rstd is [N, Hq + Hkv].
static void ref_qk_norm_rope_forward(double* out, double* rstd, const double* qkv, const double* wq,
                                     const double* wk, int N, int T, int Hq, int Hkv, int D, double eps,
                                     double theta) {
    int H = Hq + 2 * Hkv;
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            const double* x = qkv + ((size_t)n * H + h) * D;
            double* y = out + ((size_t)n * H + h) * D;
            if (h >= Hq + Hkv) {
                memcpy(y, x, D * sizeof(double));
                continue;
            }
            const double* w = h < Hq ? wq : wk;
            double ss = 0.0;
            for (int d = 0; d < D; d++) ss += x[d] * x[d];
            double r = 1.0 / sqrt(ss / D + eps);
            rstd[(size_t)n * (Hq + Hkv) + h] = r;
            for (int i = 0; i < D / 2; i++) {
                double a_lo = w[i] * x[i] * r, a_hi = w[i + D / 2] * x[i + D / 2] * r;
                double angle = ref_rope_angle(n % T, i, D, theta);
                y[i] = a_lo * cos(angle) - a_hi * sin(angle);
                y[i + D / 2] = a_hi * cos(angle) + a_lo * sin(angle);
            }
        }
}

// Backward of the above: dqkv (overwritten) from dout; value heads pass dout through.
static void ref_qk_norm_rope_backward(double* dqkv, double* dwq, double* dwk, const double* dout, const double* qkv,
                                      const double* rstd, const double* wq, const double* wk, int N, int T, int Hq,
                                      int Hkv, int D, double theta) {
    int H = Hq + 2 * Hkv;
    double* da = (double*)malloc(D * sizeof(double));
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            const double* x = qkv + ((size_t)n * H + h) * D;
            const double* dy = dout + ((size_t)n * H + h) * D;
            double* dx = dqkv + ((size_t)n * H + h) * D;
            if (h >= Hq + Hkv) {
                memcpy(dx, dy, D * sizeof(double));
                continue;
            }
            const double* w = h < Hq ? wq : wk;
            double* dw = h < Hq ? dwq : dwk;
            double r = rstd[(size_t)n * (Hq + Hkv) + h];
            for (int i = 0; i < D / 2; i++) {  // rotate the gradient back
                double angle = ref_rope_angle(n % T, i, D, theta);
                da[i] = dy[i] * cos(angle) + dy[i + D / 2] * sin(angle);
                da[i + D / 2] = dy[i + D / 2] * cos(angle) - dy[i] * sin(angle);
            }
            double dot = 0.0;
            for (int d = 0; d < D; d++) {
                dw[d] += da[d] * x[d] * r;
                dot += da[d] * w[d] * x[d] * r;
            }
            for (int d = 0; d < D; d++) dx[d] = r * (da[d] * w[d] - x[d] * r * dot / D);
        }
    free(da);
}

// Causal GQA attention. q, k, v rows have stride `stride`: q[(b*T + t)*stride + h*D + d].
// out [B, T, Hq, D]; lse [B, Hq, T] = logsumexp over s <= t of q.k / sqrt(D).
static void ref_attention_forward(double* out, double* lse, const double* q, const double* k, const double* v,
                                  int stride, int B, int T, int Hq, int Hkv, int D) {
    int G = Hq / Hkv;
    double scale = 1.0 / sqrt((double)D);
    double* p = (double*)malloc(T * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++)
            for (int t = 0; t < T; t++) {
                const double* qr = q + ((size_t)b * T + t) * stride + h * D;
                double mx = -INFINITY;
                for (int s = 0; s <= t; s++) {
                    const double* kr = k + ((size_t)b * T + s) * stride + (h / G) * D;
                    double dot = 0.0;
                    for (int d = 0; d < D; d++) dot += qr[d] * kr[d];
                    p[s] = dot * scale;
                    if (p[s] > mx) mx = p[s];
                }
                double sum = 0.0;
                for (int s = 0; s <= t; s++) sum += exp(p[s] - mx);
                lse[((size_t)b * Hq + h) * T + t] = mx + log(sum);
                double* o = out + (((size_t)b * T + t) * Hq + h) * D;
                for (int d = 0; d < D; d++) o[d] = 0.0;
                for (int s = 0; s <= t; s++) {
                    double w = exp(p[s] - mx) / sum;
                    const double* vr = v + ((size_t)b * T + s) * stride + (h / G) * D;
                    for (int d = 0; d < D; d++) o[d] += w * vr[d];
                }
            }
    free(p);
}

// With P = softmax(S), S = q k^T / sqrt(D), O = P V:
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),  dQ = dS K / sqrt(D),  dK = dS^T Q / sqrt(D),
// dK and dV summed over the query heads of a group. dq, dk, dv (stride `stride`) are overwritten.
static void ref_attention_backward(double* dq, double* dk, double* dv, const double* dout, const double* out,
                                   const double* lse, const double* q, const double* k, const double* v, int stride,
                                   int B, int T, int Hq, int Hkv, int D) {
    int G = Hq / Hkv;
    double scale = 1.0 / sqrt((double)D);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            for (int d = 0; d < Hq * D; d++) dq[((size_t)b * T + t) * stride + d] = 0.0;
            for (int d = 0; d < Hkv * D; d++) {
                dk[((size_t)b * T + t) * stride + d] = 0.0;
                dv[((size_t)b * T + t) * stride + d] = 0.0;
            }
        }
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq; h++)
            for (int t = 0; t < T; t++) {
                const double* qr = q + ((size_t)b * T + t) * stride + h * D;
                const double* dor = dout + (((size_t)b * T + t) * Hq + h) * D;
                const double* orow = out + (((size_t)b * T + t) * Hq + h) * D;
                double delta = 0.0;
                for (int d = 0; d < D; d++) delta += dor[d] * orow[d];
                double l = lse[((size_t)b * Hq + h) * T + t];
                for (int s = 0; s <= t; s++) {
                    size_t kv = ((size_t)b * T + s) * stride + (h / G) * D;
                    double dot = 0.0, dp = 0.0;
                    for (int d = 0; d < D; d++) {
                        dot += qr[d] * k[kv + d];
                        dp += dor[d] * v[kv + d];
                    }
                    double p = exp(dot * scale - l);
                    double ds = p * (dp - delta);
                    for (int d = 0; d < D; d++) {
                        dv[kv + d] += p * dor[d];
                        dq[((size_t)b * T + t) * stride + h * D + d] += ds * k[kv + d] * scale;
                        dk[kv + d] += ds * qr[d] * scale;
                    }
                }
            }
}

// out = silu(gate) * up with gate_up rows [gate (F) | up (F)]
static void ref_swiglu_forward(double* out, const double* gate_up, int N, int F) {
    for (int n = 0; n < N; n++)
        for (int f = 0; f < F; f++) {
            double g = gate_up[(size_t)n * 2 * F + f], u = gate_up[(size_t)n * 2 * F + F + f];
            out[(size_t)n * F + f] = g / (1.0 + exp(-g)) * u;
        }
}

static void ref_swiglu_backward(double* d_gate_up, const double* dout, const double* gate_up, int N, int F) {
    for (int n = 0; n < N; n++)
        for (int f = 0; f < F; f++) {
            double g = gate_up[(size_t)n * 2 * F + f], u = gate_up[(size_t)n * 2 * F + F + f];
            double sig = 1.0 / (1.0 + exp(-g)), dy = dout[(size_t)n * F + f];
            d_gate_up[(size_t)n * 2 * F + f] = dy * u * sig * (1.0 + g * (1.0 - sig));
            d_gate_up[(size_t)n * 2 * F + F + f] = dy * g * sig;
        }
}

// Per-row loss = logsumexp(z) - z[target]; dz = (softmax(z) - onehot) * d_loss (overwrites).
static void ref_cross_entropy(double* losses, double* dlogits, const double* logits, const int* targets, int N, int V,
                              double d_loss) {
    for (int n = 0; n < N; n++) {
        const double* z = logits + (size_t)n * V;
        double mx = -INFINITY, sum = 0.0;
        for (int v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
        for (int v = 0; v < V; v++) sum += exp(z[v] - mx);
        double lse = mx + log(sum);
        losses[n] = lse - z[targets[n]];
        for (int v = 0; v < V; v++) dlogits[(size_t)n * V + v] = (exp(z[v] - lse) - (v == targets[n])) * d_loss;
    }
}

// The whole model: returns the mean loss over the B*T next-token predictions of `window`
// (B rows of T+1 tokens) and adds its gradient to `grads` (same flat layout as `params`).
static double ref_forward_backward(const ModelConfig* c, const ParamTable* pt, const double* params, double* grads,
                                   const uint16_t* window, int B, int T) {
    int N = B * T, C = c->d_model, F = c->ffn_dim, Q = qkv_dim(c), A = c->n_head * c->head_dim, V = c->vocab_size;
    int Hq = c->n_head, Hkv = c->n_kv_head, D = c->head_dim, L = c->n_layer;
    double eps = c->norm_eps, theta = c->rope_theta;
#define W(kind, l) (params + param(pt, kind, l)->offset)
#define DW(kind, l) (grads + param(pt, kind, l)->offset)
#define ALLOC(n) ((double*)calloc((size_t)(n), sizeof(double)))
    int* inputs = (int*)malloc(N * sizeof(int));
    int* targets = (int*)malloc(N * sizeof(int));
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            inputs[b * T + t] = window[b * (T + 1) + t];
            targets[b * T + t] = window[b * (T + 1) + t + 1];
        }
    // activations, per layer
    double* x = ALLOC((size_t)(L + 1) * N * C);       // residual stream entering each layer
    double* x_mid = ALLOC((size_t)L * N * C);
    double* xn1 = ALLOC((size_t)L * N * C);
    double* r1 = ALLOC((size_t)L * N);
    double* qkv = ALLOC((size_t)L * N * Q);
    double* qkv_rot = ALLOC((size_t)L * N * Q);
    double* rqk = ALLOC((size_t)L * N * (Hq + Hkv));
    double* att = ALLOC((size_t)L * N * A);
    double* lse = ALLOC((size_t)L * B * Hq * T);
    double* xn2 = ALLOC((size_t)L * N * C);
    double* r2 = ALLOC((size_t)L * N);
    double* gu = ALLOC((size_t)L * N * 2 * F);
    double* act = ALLOC((size_t)L * N * F);
    double* xnf = ALLOC((size_t)N * C);
    double* rf = ALLOC(N);
    double* logits = ALLOC((size_t)N * V);
    double* dlogits = ALLOC((size_t)N * V);
    double* losses = ALLOC(N);
    double* tmp = ALLOC((size_t)N * (C > Q ? (C > 2 * F ? C : 2 * F) : (Q > 2 * F ? Q : 2 * F)));

    // forward
    for (int n = 0; n < N; n++)
        for (int ch = 0; ch < C; ch++) x[(size_t)n * C + ch] = W(P_EMBED, 0)[(size_t)inputs[n] * C + ch];
    for (int l = 0; l < L; l++) {
        double* xl = x + (size_t)l * N * C;
        double* xm = x_mid + (size_t)l * N * C;
        double* xnext = x + (size_t)(l + 1) * N * C;
        ref_rmsnorm_forward(xn1 + (size_t)l * N * C, r1 + (size_t)l * N, xl, W(P_ATTN_NORM, l), N, C, eps);
        ref_linear_forward(qkv + (size_t)l * N * Q, xn1 + (size_t)l * N * C, W(P_QKV, l), N, C, Q);
        ref_qk_norm_rope_forward(qkv_rot + (size_t)l * N * Q, rqk + (size_t)l * N * (Hq + Hkv), qkv + (size_t)l * N * Q,
                                 W(P_Q_NORM, l), W(P_K_NORM, l), N, T, Hq, Hkv, D, eps, theta);
        const double* qr = qkv_rot + (size_t)l * N * Q;
        ref_attention_forward(att + (size_t)l * N * A, lse + (size_t)l * B * Hq * T, qr, qr + Hq * D,
                              qr + (Hq + Hkv) * D, Q, B, T, Hq, Hkv, D);
        ref_linear_forward(tmp, att + (size_t)l * N * A, W(P_ATTN_OUT, l), N, A, C);
        for (size_t i = 0; i < (size_t)N * C; i++) xm[i] = xl[i] + tmp[i];
        ref_rmsnorm_forward(xn2 + (size_t)l * N * C, r2 + (size_t)l * N, xm, W(P_MLP_NORM, l), N, C, eps);
        ref_linear_forward(gu + (size_t)l * N * 2 * F, xn2 + (size_t)l * N * C, W(P_GATE_UP, l), N, C, 2 * F);
        ref_swiglu_forward(act + (size_t)l * N * F, gu + (size_t)l * N * 2 * F, N, F);
        ref_linear_forward(tmp, act + (size_t)l * N * F, W(P_DOWN, l), N, F, C);
        for (size_t i = 0; i < (size_t)N * C; i++) xnext[i] = xm[i] + tmp[i];
    }
    ref_rmsnorm_forward(xnf, rf, x + (size_t)L * N * C, W(P_FINAL_NORM, 0), N, C, eps);
    ref_linear_forward(logits, xnf, W(P_EMBED, 0), N, C, V);
    ref_cross_entropy(losses, dlogits, logits, targets, N, V, 1.0 / N);
    double loss = 0.0;
    for (int n = 0; n < N; n++) loss += losses[n];
    loss /= N;

    // backward
    double* dx = ALLOC((size_t)N * C);       // dL/d(residual stream)
    double* dxn = ALLOC((size_t)N * C);
    double* dbig = ALLOC((size_t)N * (Q > 2 * F ? Q : 2 * F));
    double* dbig2 = ALLOC((size_t)N * (Q > F ? Q : F));
    double* datt = ALLOC((size_t)N * A);
    ref_linear_backward(dxn, DW(P_EMBED, 0), dlogits, xnf, W(P_EMBED, 0), N, C, V);
    ref_rmsnorm_backward(dx, DW(P_FINAL_NORM, 0), dxn, x + (size_t)L * N * C, W(P_FINAL_NORM, 0), rf, N, C);
    for (int l = L - 1; l >= 0; l--) {
        ref_linear_backward(dbig2, DW(P_DOWN, l), dx, act + (size_t)l * N * F, W(P_DOWN, l), N, F, C);
        ref_swiglu_backward(dbig, dbig2, gu + (size_t)l * N * 2 * F, N, F);
        ref_linear_backward(dxn, DW(P_GATE_UP, l), dbig, xn2 + (size_t)l * N * C, W(P_GATE_UP, l), N, C, 2 * F);
        ref_rmsnorm_backward(dx, DW(P_MLP_NORM, l), dxn, x_mid + (size_t)l * N * C, W(P_MLP_NORM, l),
                             r2 + (size_t)l * N, N, C);
        ref_linear_backward(datt, DW(P_ATTN_OUT, l), dx, att + (size_t)l * N * A, W(P_ATTN_OUT, l), N, A, C);
        const double* qr = qkv_rot + (size_t)l * N * Q;
        ref_attention_backward(dbig2, dbig2 + Hq * D, dbig2 + (Hq + Hkv) * D, datt, att + (size_t)l * N * A,
                               lse + (size_t)l * B * Hq * T, qr, qr + Hq * D, qr + (Hq + Hkv) * D, Q, B, T, Hq, Hkv, D);
        ref_qk_norm_rope_backward(dbig, DW(P_Q_NORM, l), DW(P_K_NORM, l), dbig2, qkv + (size_t)l * N * Q,
                                  rqk + (size_t)l * N * (Hq + Hkv), W(P_Q_NORM, l), W(P_K_NORM, l), N, T, Hq, Hkv, D,
                                  theta);
        ref_linear_backward(dxn, DW(P_QKV, l), dbig, xn1 + (size_t)l * N * C, W(P_QKV, l), N, C, Q);
        ref_rmsnorm_backward(dx, DW(P_ATTN_NORM, l), dxn, x + (size_t)l * N * C, W(P_ATTN_NORM, l),
                             r1 + (size_t)l * N, N, C);
    }
    for (int n = 0; n < N; n++)
        for (int ch = 0; ch < C; ch++) DW(P_EMBED, 0)[(size_t)inputs[n] * C + ch] += dx[(size_t)n * C + ch];

    double* all[] = {x, x_mid, xn1, r1, qkv, qkv_rot, rqk, att, lse, xn2, r2, gu, act, xnf, rf, logits, dlogits,
                     losses, tmp, dx, dxn, dbig, dbig2, datt};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) free(all[i]);
    free(inputs);
    free(targets);
#undef W
#undef DW
#undef ALLOC
    return loss;
}

// ----------------------------------------------------------------------------------------------
// FP8 rounding, as the GPU's saturating conversion (cvt.rn.satfinite) does it. Both formats are
// sign, exponent, mantissa: E4M3 (bias 7, largest 448 = 1.75 * 2^8, no infinities, S.1111.111 is
// NaN) and E5M2 (bias 15, largest 57344 = 1.75 * 2^15, IEEE-style infinities and NaNs). Rounding
// is to the nearest representable value, ties to the even mantissa; anything beyond the largest
// finite value (infinities included) becomes that value with its sign; NaN stays NaN.

typedef struct {
    int man_bits, bias;
    double max;
} RefFp8Format;

static const RefFp8Format REF_E4M3 = {3, 7, 448.0}, REF_E5M2 = {2, 15, 57344.0};

static RefFp8Format ref_fp8_format(bool e5m2) { return e5m2 ? REF_E5M2 : REF_E4M3; }

// The value of an FP8 code (NaN for NaN codes, +-inf for E5M2's infinities).
static double ref_fp8_decode(uint8_t code, bool e5m2) {
    RefFp8Format f = ref_fp8_format(e5m2);
    int exp_bits = 7 - f.man_bits, sign = code >> 7;
    int e = (code >> f.man_bits) & ((1 << exp_bits) - 1), man = code & ((1 << f.man_bits) - 1);
    double v;
    if (!e5m2 && e == 15 && man == 7) v = NAN;
    else if (e5m2 && e == 31) v = man ? NAN : INFINITY;
    else if (e == 0) v = ldexp(man, 1 - f.bias - f.man_bits);                 // subnormal
    else v = ldexp((1 << f.man_bits) + man, e - f.bias - f.man_bits);         // normal
    return sign ? -v : v;
}

// x rounded to the format's grid: the spacing at |x| is 2^(exponent - man_bits), never finer
// than the subnormals'; rint rounds ties to even, and an even multiple of the spacing is an
// even mantissa. Then saturation to +-max.
static double ref_fp8_round(double x, bool e5m2) {
    RefFp8Format f = ref_fp8_format(e5m2);
    if (isnan(x)) return NAN;
    double a = fabs(x);
    if (a >= f.max) return copysign(f.max, x);
    int e = a > 0 ? ilogb(a) : 1 - f.bias;
    if (e < 1 - f.bias) e = 1 - f.bias;
    double spacing = ldexp(1.0, e - f.man_bits);
    double r = rint(a / spacing) * spacing;
    return copysign(r > f.max ? f.max : r, x);
}

// The code of ref_fp8_round(x): the positive code whose value it is, with x's sign bit.
static uint8_t ref_fp8_encode(double x, bool e5m2) {
    if (isnan(x)) return e5m2 ? 0x7E : 0x7F;
    double r = fabs(ref_fp8_round(x, e5m2));
    for (int c = 0; c < 0x7F; c++)
        if (ref_fp8_decode((uint8_t)c, e5m2) == r) return (uint8_t)(c | (signbit(x) ? 0x80 : 0));
    return 0xFF;  // unreachable: every rounded value has a code
}

// ----------------------------------------------------------------------------------------------
// The optimizers' update rules (kernels.cuh; doc/optimizers.md), on one small tensor, in double.

// AdamW's step t (1-based) on n elements with gradient g (already clipped): m, v, p updated.
static void ref_adamw_step(double* p, double* m, double* v, const double* g, size_t n, double lr, double beta1,
                           double beta2, double eps, double wd, int t) {
    double bc1 = 1 - pow(beta1, t), bc2 = 1 - pow(beta2, t);
    for (size_t i = 0; i < n; i++) {
        m[i] = beta1 * m[i] + (1 - beta1) * g[i];
        v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
        p[i] -= lr * ((m[i] / bc1) / (sqrt(v[i] / bc2) + eps) + wd * p[i]);
    }
}

// 8-bit AdamW's step on n elements (a multiple of Q8_BLOCK): m and r = sqrt(v) are codes of
// kernels.cuh's maps with one absmax per block; each block is dequantized, updated as AdamW in
// double, and requantized against its new absmax (rounded to float, as the GPU stores it).
static void ref_adamw8bit_step(double* p, uint8_t* qm, uint8_t* qv, float* absmax_m, float* absmax_v, const double* g,
                               size_t n, double lr, double beta1, double beta2, double eps, double wd, int t) {
    const Q8Maps* maps = q8_maps();
    double m[Q8_BLOCK], v[Q8_BLOCK];
    for (size_t b = 0; b < n / Q8_BLOCK; b++) {
        size_t at = b * Q8_BLOCK;
        for (int j = 0; j < Q8_BLOCK; j++) {
            m[j] = q8_decode(qm[at + j], absmax_m[b], maps->m);
            double r = q8_decode(qv[at + j], absmax_v[b], maps->v);
            v[j] = r * r;
        }
        ref_adamw_step(p + at, m, v, g + at, Q8_BLOCK, lr, beta1, beta2, eps, wd, t);
        float am = 0.0f, av = 0.0f;
        for (int j = 0; j < Q8_BLOCK; j++) {
            am = fmaxf(am, fabsf((float)m[j]));
            av = fmaxf(av, (float)sqrt(v[j]));
        }
        for (int j = 0; j < Q8_BLOCK; j++) {
            qm[at + j] = q8_encode((float)m[j], am, maps->m, true);
            qv[at + j] = q8_encode((float)sqrt(v[j]), av, maps->v, false);
        }
        absmax_m[b] = am;
        absmax_v[b] = av;
    }
}

// c[R, C] = a[R, K] b[K, C], row-major.
static void ref_matmul(double* c, const double* a, const double* b, int R, int K, int C) {
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            double sum = 0.0;
            for (int k = 0; k < K; k++) sum += a[(size_t)i * K + k] * b[(size_t)k * C + j];
            c[(size_t)i * C + j] = sum;
        }
}

static void ref_transpose(double* out, const double* x, int R, int C) {
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) out[(size_t)j * R + i] = x[(size_t)i * C + j];
}

// Muon's Newton-Schulz iteration on u [R, C] (row-major): X = u / (||u|| + 1e-7), then `steps` times
// X = a X + (b A + c A A) X with A = X X^T, on X^T when R > C. Writes X to out.
static void ref_newton_schulz(double* out, const double* u, int R, int C, int steps) {
    bool tall = R > C;
    int r = tall ? C : R, c = tall ? R : C;
    size_t n = (size_t)R * C;
    double *x = (double*)malloc(n * 8), *a = (double*)malloc((size_t)r * r * 8), *aa = (double*)malloc((size_t)r * r * 8);
    double *bx = (double*)malloc(n * 8);
    if (tall) ref_transpose(x, u, R, C);
    else memcpy(x, u, n * 8);
    double norm = 0.0;
    for (size_t i = 0; i < n; i++) norm += x[i] * x[i];
    norm = sqrt(norm) + 1e-7;
    for (size_t i = 0; i < n; i++) x[i] /= norm;
    double *xt = (double*)malloc(n * 8);
    for (int s = 0; s < steps; s++) {
        ref_transpose(xt, x, r, c);
        ref_matmul(a, x, xt, r, c, r);
        ref_matmul(aa, a, a, r, r, r);
        for (size_t i = 0; i < (size_t)r * r; i++) aa[i] = MUON_NS_B * a[i] + MUON_NS_C * aa[i];  // B
        ref_matmul(bx, aa, x, r, r, c);
        for (size_t i = 0; i < n; i++) x[i] = MUON_NS_A * x[i] + bx[i];
    }
    if (tall) ref_transpose(out, x, r, c);
    else memcpy(out, x, n * 8);
    free(x); free(a); free(aa); free(bx); free(xt);
}

// One Muon step of the matrix p [R, C] with gradient g (clipped) and momentum buf, learning rate lr.
static void ref_muon_step(double* p, double* buf, const double* g, int R, int C, double lr, double mu) {
    size_t n = (size_t)R * C;
    double *u = (double*)malloc(n * 8), *x = (double*)malloc(n * 8);
    for (size_t i = 0; i < n; i++) {
        buf[i] = mu * buf[i] + (1 - mu) * g[i];
        u[i] = (1 - mu) * g[i] + mu * buf[i];
    }
    ref_newton_schulz(x, u, R, C, MUON_NS_STEPS);
    double scale = sqrt(R > C ? (double)R / C : 1.0);
    for (size_t i = 0; i < n; i++) p[i] -= lr * scale * x[i];
    free(u);
    free(x);
}

#endif
