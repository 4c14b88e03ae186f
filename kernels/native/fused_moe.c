/* Routed SwiGLU experts token by token (a decode token, a short prefill) for ascend_dsa::fused_moe
 * (kernels/moe/fused_moe_native.py);
 * kernels/native/loader.py builds and loads this file. Plain C, no torch headers.
 *
 * For the token x [H] (fp32) and its k experts ids[j] with routing weights rw[j], taken in the order of their
 * ids (equal ids in the order given: the order the torch path sums them):
 *   g[i] = w13[e][i] . x,  u[i] = w13[e][I + i] . x            (i < I; w13 [E][2I][H], rows contiguous)
 *   h[i] = silu(g[i]) * u[i]                                    silu(g) = g / (1 + exp(-g))
 *   out[c] += (w2[e][c] . h) * rw[j]                            (c < H; w2 [E][H][I], rows contiguous)
 * in fp32, out [H] zeroed first. A decode step reads each selected expert's weights once, so the time is the
 * time to stream them: the rows of each product are split across the OpenMP threads when the expert is large
 * (PARALLEL_MIN_WEIGHTS), else one thread does everything (a tiny model's experts: the call costs less than
 * waking a team). Dot products sum in another order than a BLAS gemv: results agree to fp32 rounding.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define PARALLEL_MIN_WEIGHTS (1 << 18)   /* values of one expert's w13 below which one thread does the token */
#define PARALLEL_MIN_MACS (1 << 22)      /* a call's products below which one thread does every token */

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* silu(w13[i] . x) * (w13[inter + i] . x) */
static inline float gate_up_row(const float *x, int64_t hidden, const float *w13, int64_t inter, int64_t i) {
    float g = dot(w13 + i * hidden, x, hidden), u = dot(w13 + (inter + i) * hidden, x, hidden);
    return g / (1.0f + expf(-g)) * u;
}

/* h[i] = silu(w13[i] . x) * (w13[inter + i] . x) for i < inter; the rows split across a team when `parallel`
 * (otherwise no parallel region at all: an `if (0)` region still builds a team of one, ~1 us a product). */
static void gate_up(const float *x, int64_t hidden, const float *w13, int64_t inter, int parallel, float *h) {
    if (parallel) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < inter; i++) h[i] = gate_up_row(x, hidden, w13, inter, i);
    } else {
        for (int64_t i = 0; i < inter; i++) h[i] = gate_up_row(x, hidden, w13, inter, i);
    }
}

/* out[c] += (w2[c] . h) * weight for c < hidden (a team as gate_up). */
static void down(const float *h, int64_t inter, const float *w2, int64_t hidden, float weight, int parallel,
                 float *out) {
    if (parallel) {
#pragma omp parallel for schedule(static)
        for (int64_t c = 0; c < hidden; c++) out[c] += dot(w2 + c * inter, h, inter) * weight;
    } else {
        for (int64_t c = 0; c < hidden; c++) out[c] += dot(w2 + c * inter, h, inter) * weight;
    }
}

/* One token's experts into out [hidden] (zeroed first), in order of their ids; h [inter] and order [k] scratch. */
static void token_experts(const float *x, int64_t hidden, const float *w13, const float *w2, int64_t inter,
                          const int64_t *ids, const float *rw, int64_t k, int parallel, float *h, int64_t *order,
                          float *out) {
    for (int64_t j = 0; j < k; j++) {            /* stable insertion sort of the slots by expert id */
        int64_t p = j;
        for (; p > 0 && ids[order[p - 1]] > ids[j]; p--) order[p] = order[p - 1];
        order[p] = j;
    }
    for (int64_t c = 0; c < hidden; c++) out[c] = 0.0f;
    for (int64_t n = 0; n < k; n++) {
        int64_t j = order[n];
        const float *e13 = w13 + ids[j] * 2 * inter * hidden, *e2 = w2 + ids[j] * hidden * inter;
        gate_up(x, hidden, e13, inter, parallel, h);
        down(h, inter, e2, hidden, rw[j], parallel, out);
    }
}

static int ids_in_range(const int64_t *ids, int64_t n, int64_t experts) {
    for (int64_t j = 0; j < n; j++)
        if (ids[j] < 0 || ids[j] >= experts) return 0;
    return 1;
}

/* Returns 0, -1 when the intermediate row could not be allocated, or 1 when an id is outside [0, experts)
 * (nothing computed: the caller raises). */
int fm_token(const float *x, int64_t hidden, const float *w13, const float *w2, int64_t experts, int64_t inter,
             const int64_t *ids, const float *rw, int64_t k, float *out) {
    if (!ids_in_range(ids, k, experts)) return 1;
    float *h = malloc((size_t)(inter > 0 ? inter : 1) * sizeof(float));
    int64_t *order = malloc((size_t)(k > 0 ? k : 1) * sizeof(int64_t));
    if (h && order)
        token_experts(x, hidden, w13, w2, inter, ids, rw, k, 2 * inter * hidden >= PARALLEL_MIN_WEIGHTS, h, order,
                      out);
    int failed = !h || !order;
    free(h);
    free(order);
    return failed ? -1 : 0;
}

/* fm_token for each of `tokens` tokens (a short prefill, where the torch path's per-expert calls cost more than
 * the arithmetic): x [tokens][hidden] rows x_row values apart, ids and rw [tokens][k], out [tokens][hidden]. The
 * tokens are shared by `threads` OpenMP threads when the call has PARALLEL_MIN_MACS of work. Same returns. */
int fm_tokens(const float *x, int64_t tokens, int64_t x_row, int64_t hidden, const float *w13, const float *w2,
              int64_t experts, int64_t inter, const int64_t *ids, const float *rw, int64_t k, int threads,
              float *out) {
    if (!ids_in_range(ids, tokens * k, experts)) return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads > 1 ? threads : 1) reduction(| : failed) \
    if (threads > 1 && tokens > 1 && tokens * k * 3 * inter * hidden >= PARALLEL_MIN_MACS)
    {
        float *h = malloc((size_t)(inter > 0 ? inter : 1) * sizeof(float));
        int64_t *order = malloc((size_t)(k > 0 ? k : 1) * sizeof(int64_t));
        failed = !h || !order;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++)
            if (!failed)
                token_experts(x + t * x_row, hidden, w13, w2, inter, ids + t * k, rw + t * k, k, 0, h, order,
                              out + t * hidden);
        free(h);
        free(order);
    }
    return failed ? -1 : 0;
}
