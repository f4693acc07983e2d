/* FastForward's training elementwise work, fused forward and backward: each RMSNorm is ~5 ATen
 * ops forward and ~8 backward, the MLP's silu(g) * u 2 forward and 3 backward, and the rotary
 * embedding 4 forward and 5 backward, each a full pass over memory. Here each is one pass.
 * Rounding follows HF's modules (and furlong's _RMSNorm backward): fp32 arithmetic, bf16
 * results rounded where an ATen op would round them.
 * Each call splits its rows (or elements) into contiguous parts over an OpenMP team of at most
 * `threads` (torch's own libgomp, so ATen's workers do the work rather than a second pool);
 * built without OpenMP, the team is the calling thread. fused_kernels.py checks every tensor
 * before its pointer comes here. */
#include "fused_ops.h"

#ifdef _OPENMP
#include <omp.h>
#define TEAM_SIZE omp_get_num_threads()
#define THREAD_ID omp_get_thread_num()
#else
#define TEAM_SIZE 1
#define THREAD_ID 0
#endif

/* This thread's part [*first, *first + *count) of total items split into the team's parts;
 * part starts are multiples of align (elements: 64, so threads share no cache line). */
static inline void my_part(int64_t total, int64_t align, int64_t *first, int64_t *count) {
    int64_t parts = TEAM_SIZE, step = (total + parts - 1) / parts;
    step = (step + align - 1) / align * align;
    int64_t a = THREAD_ID * step;
    *first = a < total ? a : total;
    *count = total - *first < step ? total - *first : step;
}

/* One kernel per macro, instantiated for fp32 and bf16 below: LOAD reads an element as fp32,
 * STORE writes a result in the tensor's dtype, and ROUND rounds an intermediate where ATen's op
 * would leave a bf16 result (the identity in fp32). */

/* y = w * (x * rstd) per row of n (dense), as rms_norm_f32 without the residual add, keeping
 * each row's rstd for the backward */
#define RMS_FWD(T, NAME, LOAD, STORE, ROUND, RSTD)                                             \
    void NAME(const T *x, const T *w, T *y, float *rstd, int64_t rows, int64_t n, float eps,   \
              int threads) {                                                                   \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)") {                        \
            int64_t first, count;                                                              \
            my_part(rows, 1, &first, &count);                                                  \
            for (int64_t r = first; r < first + count; r++) {                                  \
                const T *xr = x + r * n;                                                       \
                T *yr = y + r * n;                                                             \
                float s = RSTD(xr, n, eps);                                                    \
                rstd[r] = s;                                                                   \
                for (int64_t i = 0; i < n; i++)                                                \
                    yr[i] = STORE(LOAD(w[i]) * ROUND(LOAD(xr[i]) * s));                        \
            }                                                                                  \
        }                                                                                      \
    }

/* Per row: x_hat = x * rstd (fp32), gw = g * w; dx = rstd * (gw - x_hat * mean(gw * x_hat)),
 * two passes over the row (it stays in cache; gw recomputed in the second, so any width works),
 * and dw += g * x_hat summed in blocks of DW_BLOCK rows, each block's sum then added to this
 * thread's partial: a two-level sum, whose rounding grows with DW_BLOCK + rows / DW_BLOCK
 * rather than with rows. dw: [2, threads, n] zeros, the partials then the block sums. */
#define DW_BLOCK 64
#define RMS_BWD(T, NAME, LOAD, STORE)                                                          \
    void NAME(const T *g, const T *x, const T *w, const float *rstd, T *dx, float *dw,         \
              int64_t rows, int64_t n, int threads) {                                          \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)") {                        \
            int64_t first, count;                                                              \
            my_part(rows, 1, &first, &count);                                                  \
            float *my_dw = dw + THREAD_ID * n, *block = dw + (threads + THREAD_ID) * n;        \
            for (int64_t r = first; r < first + count; r++) {                                  \
                const T *gr = g + r * n, *xr = x + r * n;                                      \
                float s = rstd[r], acc[LANES] = {0};                                           \
                int64_t i = 0;                                                                 \
                for (; i + LANES <= n; i += LANES)                                             \
                    for (int j = 0; j < LANES; j++) {                                          \
                        float gi = LOAD(gr[i + j]), x_hat = LOAD(xr[i + j]) * s;               \
                        acc[j] += (gi * LOAD(w[i + j])) * x_hat;                               \
                        block[i + j] += gi * x_hat;                                            \
                    }                                                                          \
                for (; i < n; i++) {                                                           \
                    float gi = LOAD(gr[i]), x_hat = LOAD(xr[i]) * s;                           \
                    acc[0] += (gi * LOAD(w[i])) * x_hat;                                       \
                    block[i] += gi * x_hat;                                                    \
                }                                                                              \
                float dot = 0.0f;                                                              \
                for (int j = 0; j < LANES; j++) dot += acc[j];                                 \
                dot /= (float)n;                                                               \
                T *dxr = dx + r * n;                                                           \
                for (i = 0; i < n; i++)                                                        \
                    dxr[i] = STORE((LOAD(gr[i]) * LOAD(w[i]) - (LOAD(xr[i]) * s) * dot) * s);  \
                if ((r - first) % DW_BLOCK == DW_BLOCK - 1 || r == first + count - 1)          \
                    for (i = 0; i < n; i++) {                                                  \
                        my_dw[i] += block[i];                                                  \
                        block[i] = 0.0f;                                                       \
                    }                                                                          \
            }                                                                                  \
        }                                                                                      \
    }

static inline float sigmoid(float g) { return 1.0f / (1.0f + exp_f32(-g)); }

/* out = silu(g) * u over n elements; silu(g) = g * sigmoid(g) */
#define SILU_MUL_FWD(T, NAME, LOAD, STORE, ROUND)                                              \
    void NAME(const T *restrict g, const T *restrict u, T *restrict out, int64_t n,            \
              int threads) {                                                                   \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)") {                        \
            int64_t first, count;                                                              \
            my_part(n, 64, &first, &count);                                                    \
            for (int64_t i = first; i < first + count; i++) {                                  \
                float gi = LOAD(g[i]);                                                         \
                out[i] = STORE(ROUND(gi * sigmoid(gi)) * LOAD(u[i])); /* F.silu, then mul */   \
            }                                                                                  \
        }                                                                                      \
    }

/* du = grad * silu(g); dg = (grad * u) * s (1 + g (1 - s)), s = sigmoid(g): the product's and
 * then silu's backward */
#define SILU_MUL_BWD(T, NAME, LOAD, STORE, ROUND)                                              \
    void NAME(const T *restrict grad, const T *restrict g, const T *restrict u, T *restrict dg, \
              T *restrict du, int64_t n, int threads) {                                        \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)") {                        \
            int64_t first, count;                                                              \
            my_part(n, 64, &first, &count);                                                    \
            for (int64_t i = first; i < first + count; i++) {                                  \
                float gi = LOAD(g[i]), gr = LOAD(grad[i]), s = sigmoid(gi);                    \
                du[i] = STORE(gr * ROUND(gi * s));                                             \
                dg[i] = STORE(ROUND(gr * LOAD(u[i])) * (s * (1.0f + gi * (1.0f - s))));        \
            }                                                                                  \
        }                                                                                      \
    }

/* The rotary embedding of x [batch, seq, heads, hd] (last dim dense, any other strides) into
 * dense y, with cos and sign-folded sin [batch or 1, seq, hd] (cb: their batch step, 0 when
 * shared): fast_forward._rotate's x * cos + roll(x, hd / 2) * sin, each product rounded as
 * ATen rounds it. backward: that map's transpose, autograd's sum of the two paths' gradients,
 * g * cos + roll(g * sin). */
#define ROPE(T, NAME, LOAD, STORE, ROUND)                                                      \
    void NAME(const T *x, T *restrict y, const T *cs, const T *sn, int64_t batch, int64_t seq, \
              int64_t heads, int64_t hd, int64_t sb, int64_t st, int64_t sh, int64_t cb,      \
              int backward, int threads) {                                                     \
        int64_t half = hd / 2;                                                                 \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)") {                        \
            int64_t first, count;                                                              \
            my_part(batch * seq, 1, &first, &count);                                           \
            for (int64_t r = first; r < first + count; r++) {                                  \
                int64_t b = r / seq, t = r % seq;                                              \
                const T *c = cs + b * cb + t * hd, *s = sn + b * cb + t * hd;                  \
                for (int64_t h = 0; h < heads; h++) {                                          \
                    const T *xh = x + b * sb + t * st + h * sh;                                \
                    T *yh = y + (r * heads + h) * hd;                                          \
                    for (int64_t i = 0; i < hd; i++) {                                         \
                        int64_t j = i < half ? i + half : i - half;                            \
                        float turned = LOAD(xh[j]) * LOAD(s[backward ? j : i]);                \
                        yh[i] = STORE(ROUND(LOAD(xh[i]) * LOAD(c[i])) + ROUND(turned));        \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

#define AS_F32(v) (v)
#define BF16_ROUND(v) from_bf16(to_bf16(v))
RMS_FWD(float, rms_norm_fwd_f32, AS_F32, AS_F32, AS_F32, rstd_f32)
RMS_FWD(bf16, rms_norm_fwd_bf16, from_bf16, to_bf16, BF16_ROUND, rstd_bf16)
RMS_BWD(float, rms_norm_bwd_f32, AS_F32, AS_F32)
RMS_BWD(bf16, rms_norm_bwd_bf16, from_bf16, to_bf16)
SILU_MUL_FWD(float, silu_mul_fwd_f32, AS_F32, AS_F32, AS_F32)
SILU_MUL_FWD(bf16, silu_mul_fwd_bf16, from_bf16, to_bf16, BF16_ROUND)
SILU_MUL_BWD(float, silu_mul_bwd_f32, AS_F32, AS_F32, AS_F32)
SILU_MUL_BWD(bf16, silu_mul_bwd_bf16, from_bf16, to_bf16, BF16_ROUND)
ROPE(float, rope_f32, AS_F32, AS_F32, AS_F32)
ROPE(bf16, rope_bf16, from_bf16, to_bf16, BF16_ROUND)
