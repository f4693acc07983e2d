/* FastForward's inference elementwise work, fused: on CPU a decode step's RMSNorms and rotary
 * embeddings are dozens of tiny ATen ops of 2-5 us each, more time than their arithmetic.
 * Each function here is one pass over rows of a model-dtype tensor (fp32, or bf16 held as
 * uint16 bits) and rounds where HF's modules round: every bf16 op's result goes back to bf16,
 * statistics stay in fp32. Single-threaded: inference rows are few.
 * Built and loaded by furlong/models/fused_kernels.py, which checks every tensor's dtype, shape
 * and strides before it passes a pointer here. */
#include "fused_ops.h"

/* Per row of n: when d is given, x += d first (the residual add, in place); then
 * y = w * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps). x rows are x_stride apart, d's are
 * d_stride apart, y is dense. */
void rms_norm_f32(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w,
                  float *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * x_stride;
        float *yr = y + r * n;
        if (d) {
            const float *dr = d + r * d_stride;
            for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
        }
        float rstd = rstd_f32(xr, n, eps);
        for (int64_t i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * rstd);
    }
}

void rms_norm_bf16(bf16 *x, int64_t x_stride, const bf16 *d, int64_t d_stride, const bf16 *w,
                   bf16 *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        bf16 *xr = x + r * x_stride;
        bf16 *yr = y + r * n;
        if (d) {
            const bf16 *dr = d + r * d_stride;
            for (int64_t i = 0; i < n; i++) xr[i] = to_bf16(from_bf16(xr[i]) + from_bf16(dr[i]));
        }
        float rstd = rstd_bf16(xr, n, eps);
        for (int64_t i = 0; i < n; i++) {
            float x_hat = from_bf16(to_bf16(from_bf16(xr[i]) * rstd));
            yr[i] = to_bf16(from_bf16(w[i]) * x_hat);
        }
    }
}

/* One head of hd values, in place: the optional per-head RMSNorm (weight w, Qwen3's q_norm and
 * k_norm), then the rotary embedding x * cos + rotate_half(x) * sin with rotate_half's sign
 * folded into sin: out[i] = x[i] cos[i] + x[(i + hd/2) % hd] sin[i]. tmp holds hd floats. */
static void head_f32(float *x, const float *w, const float *cs, const float *sn, int64_t hd,
                     float eps, float *tmp) {
    if (w) {
        float rstd = rstd_f32(x, hd, eps);
        for (int64_t i = 0; i < hd; i++) tmp[i] = w[i] * (x[i] * rstd);
    } else {
        memcpy(tmp, x, hd * sizeof *x);
    }
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) x[i] = tmp[i] * cs[i] + tmp[i + half] * sn[i];
    for (int64_t i = half; i < hd; i++) x[i] = tmp[i] * cs[i] + tmp[i - half] * sn[i];
}

static inline float mul_bf16(float a, float b) { return from_bf16(to_bf16(a * b)); }

static void head_bf16(bf16 *x, const bf16 *w, const bf16 *cs, const bf16 *sn, int64_t hd,
                      float eps, float *tmp) {
    if (w) {
        float rstd = rstd_bf16(x, hd, eps);
        for (int64_t i = 0; i < hd; i++)
            tmp[i] = mul_bf16(from_bf16(w[i]), mul_bf16(from_bf16(x[i]), rstd));
    } else {
        for (int64_t i = 0; i < hd; i++) tmp[i] = from_bf16(x[i]);
    }
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++)
        x[i] = to_bf16(mul_bf16(tmp[i], from_bf16(cs[i])) + mul_bf16(tmp[i + half], from_bf16(sn[i])));
    for (int64_t i = half; i < hd; i++)
        x[i] = to_bf16(mul_bf16(tmp[i], from_bf16(cs[i])) + mul_bf16(tmp[i - half], from_bf16(sn[i])));
}

/* q [rows, q_heads, hd] and k [rows, k_heads, hd], in place: every head through head_*() with
 * row r's cos/sin (dense [rows, hd]); q_w and k_w are NULL when the model has no per-head norm.
 * Each row's heads are dense; rows are q_ld and k_ld elements apart (q and k may be column
 * slices of one q/k/v GEMM output). hd is even and at most 1024. */
void qk_rope_f32(float *q, float *k, const float *q_w, const float *k_w, const float *cs,
                 const float *sn, int64_t rows, int64_t q_heads, int64_t k_heads, int64_t hd,
                 int64_t q_ld, int64_t k_ld, float q_eps, float k_eps) {
    float tmp[1024];
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cs + r * hd, *s = sn + r * hd;
        for (int64_t h = 0; h < q_heads; h++) head_f32(q + r * q_ld + h * hd, q_w, c, s, hd, q_eps, tmp);
        for (int64_t h = 0; h < k_heads; h++) head_f32(k + r * k_ld + h * hd, k_w, c, s, hd, k_eps, tmp);
    }
}

void qk_rope_bf16(bf16 *q, bf16 *k, const bf16 *q_w, const bf16 *k_w, const bf16 *cs,
                  const bf16 *sn, int64_t rows, int64_t q_heads, int64_t k_heads, int64_t hd,
                  int64_t q_ld, int64_t k_ld, float q_eps, float k_eps) {
    float tmp[1024];
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *c = cs + r * hd, *s = sn + r * hd;
        for (int64_t h = 0; h < q_heads; h++) head_bf16(q + r * q_ld + h * hd, q_w, c, s, hd, q_eps, tmp);
        for (int64_t h = 0; h < k_heads; h++) head_bf16(k + r * k_ld + h * hd, k_w, c, s, hd, k_eps, tmp);
    }
}
