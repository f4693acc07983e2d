/* What fused_ops.c (inference) and fused_train_ops.c (training) share: bf16 conversions as
 * torch rounds them, the RMSNorm statistic, and exp. Static inline: each file gets its copy. */
#ifndef FURLONG_FUSED_OPS_H
#define FURLONG_FUSED_OPS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float from_bf16(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even, as torch's c10::BFloat16 does (a NaN stays a quiet NaN) */
static inline bf16 to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    bf16 rounded = (bf16)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    return f != f ? 0x7FC0 : rounded; /* a select, not a branch: the loops stay vectorised */
}

/* 1 / sqrt(mean(x^2) + eps) in fp32, as torch's rsqrt(x.pow(2).mean(-1) + eps); the sum runs
 * in LANES independent partial sums, which the compiler vectorises without reassociating */
#define LANES 16

static inline float rstd_f32(const float *x, int64_t n, float eps) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * x[i + j];
    for (; i < n; i++) acc[0] += x[i] * x[i];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    return 1.0f / sqrtf(s / (float)n + eps);
}

static inline float rstd_bf16(const bf16 *x, int64_t n, float eps) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            float v = from_bf16(x[i + j]);
            acc[j] += v * v;
        }
    for (; i < n; i++) acc[0] += from_bf16(x[i]) * from_bf16(x[i]);
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    return 1.0f / sqrtf(s / (float)n + eps);
}

/* exp(x) for x clamped to [-87.3, 88.3]: 2^n p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the
 * degree-6 Taylor polynomial (relative error ~2e-7); straight-line code the compiler vectorises
 * (libm's expf is a call it cannot) */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#endif
