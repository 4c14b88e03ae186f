/* The KDA recurrence on CPU for ascend_dsa::chunk_kda (kernels/kda/native.py); kernels/native/loader.py builds and
 * loads this file. Plain C (GCC vector extensions), no torch headers.
 *
 * Per batch row b, head h and step t, with the state S [K][V] (fp32) and e_t = exp(g_t):
 *   u_t = beta_t (v_t - (k_t * e_t)^T S)                    [V]
 *   S   = Diag(e_t) S + k_t u_t^T                            the gated delta rule
 *   o_t = scale * q_t^T S                                    [V]
 * Each column of S evolves on its own (the decay and k_t act on rows), so the state is cut into tiles of up to
 * MAX_NV vectors of columns, one (b, h, tile) per job; a step reads and writes each element of the tile once,
 * updating it and accumulating o_t and, for the next step, (k_t+1 * e_t+1)^T S (PASS_NV vectors of columns at a
 * time down the rows, so that the accumulators stay in registers).
 *
 * The decay is applied lazily: the tile holds S~ with S = Diag(d) S~, d the product of the decays since the
 * last reset, so a step adds (k_t / d) u_t^T to S~ and reads it with q_t * d and k_t+1 * e_t+1 * d: three fused
 * multiply-adds per state element instead of a multiply and three. A step where some row's d would fall below
 * LAZY_MIN_DECAY first applies d to the tile (S~ becomes S, d resets to 1), so 1/d stays below
 * 1/LAZY_MIN_DECAY and S~ within that factor of S: no overflow and the same relative precision as the direct
 * form. Jobs are spread over the OpenMP threads when there is enough work (a decode step runs on the calling
 * thread).
 *
 * Inputs are fp32 and contiguous in fla's layout: q, k, e [B][T][H][K], v [B][T][H][V], beta [B][T][H];
 * state [B][H][K][V] is read as the initial state and overwritten with the final one; o is [B][T][H][V].
 * kda_recurrence_states also writes the state after each of the first n_states steps into states
 * [B][n_states][H][K][V] (checkpoints for speculative decoding's rollback), in the same pass: each is the tile
 * scaled by d, the very multiplication that gives the final state, so checkpoint t is bitwise the final state of
 * a run over the first t + 1 steps.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_NV (128 / VL)           /* vectors of state columns per job (128 columns) */
#define LAZY_MIN_DECAY 1e-18f       /* smallest cumulative decay kept out of the tile */
#if NREG >= 32
#define PASS_NV 2                   /* vectors of columns per pass over the tile rows (registers: 3 per vector) */
#else
#define PASS_NV 4                   /* 16 registers: 4 x 3 and the 3 broadcast factors (AVX2: 14.6 vs 16.3 ms) */
#endif
#define PREFETCH_STEPS 4            /* steps ahead whose inputs are requested */
#define PARALLEL_MIN_WORK (1 << 20) /* state elements x steps below which one thread does all the jobs */


struct kda_args {
    const float *q, *k, *e, *v, *beta;
    float *state, *o, *states;
    int64_t batch, steps, heads, dk, dv, n_states;
    float scale;
};

/* Per-row factors of one step (file comment); `decay` holds d, and the other rows are this step's. */
struct step_rows {
    float *decay, *add, *out, *next;
};

/* Fills the factors of step t (kn, en: the next step's k and e, NULL at the last step); returns whether the step
 * applies d to the tile (a direct step, which resets d to 1 afterwards). */
static int step_factors(const float *q, const float *k, const float *e, const float *kn, const float *en,
                        int64_t dk, const struct step_rows *r) {
    float *restrict d = r->decay, *restrict add = r->add, *restrict out = r->out, *restrict next = r->next;
    float smallest = 1.0f;
#pragma omp simd reduction(min : smallest)
    for (int64_t i = 0; i < dk; i++) {
        d[i] *= e[i];
        smallest = d[i] < smallest ? d[i] : smallest;
    }
    const int direct = smallest < LAZY_MIN_DECAY;
    if (direct) {
        memcpy(add, k, (size_t)dk * sizeof(float));
        memcpy(out, q, (size_t)dk * sizeof(float));
    } else {
#pragma omp simd
        for (int64_t i = 0; i < dk; i++) {
            add[i] = k[i] / d[i];
            out[i] = q[i] * d[i];
        }
    }
    if (kn == NULL)
        memset(next, 0, (size_t)dk * sizeof(float));
    else
#pragma omp simd
        for (int64_t i = 0; i < dk; i++) next[i] = kn[i] * en[i] * (direct ? 1.0f : d[i]);
    return direct;
}

/* One pass over the tile s (dk rows of nv vectors): the update with u, o into out, the next step's dot into next.
 * A direct step first multiplies each row by its decay (`scaled`, written out as its own loop so that the lazy
 * loop carries no test). */
static inline __attribute__((always_inline)) void tile_pass(vf *s, int64_t dk, const int nv, const vf *u,
                                                            const struct step_rows *r, int scaled, vf *out, vf *next) {
    for (int j = 0; j < nv; j++) out[j] = next[j] = (vf){0};
    if (scaled)
        for (int64_t i = 0; i < dk; i++)
            for (int j = 0; j < nv; j++) s[i * nv + j] *= r->decay[i];
    for (int j0 = 0; j0 < nv; j0 += PASS_NV)
        for (int64_t i = 0; i < dk; i++) {
            float a = r->add[i], qo = r->out[i], kn = r->next[i];
            for (int j = j0; j < j0 + (nv < PASS_NV ? nv : PASS_NV); j++) {
                vf x = s[i * nv + j] + a * u[j];
                s[i * nv + j] = x;
                out[j] += qo * x;
                next[j] += kn * x;
            }
        }
}

/* Asks for the rows of a later step: steps are heads x K floats apart, too far for the hardware prefetcher. */
static void prefetch_step(const struct kda_args *a, int64_t qk_at, int64_t v_at, int width) {
    for (int64_t i = 0; i < a->dk; i += 64 / sizeof(float)) {
        __builtin_prefetch(a->q + qk_at + i);
        __builtin_prefetch(a->k + qk_at + i);
        __builtin_prefetch(a->e + qk_at + i);
    }
    for (int i = 0; i < width; i += 64 / sizeof(float)) __builtin_prefetch(a->v + v_at + i);
}

/* Writes the state after step t, S = Diag(d) S~, into columns [col, col + width) of checkpoint t of (b, h). */
static void store_checkpoint(const struct kda_args *a, int64_t b, int64_t h, int64_t t, int64_t col, int width,
                             int nv, const vf *s, const float *decay) {
    float *dst = a->states + ((b * a->n_states + t) * a->heads + h) * a->dk * a->dv + col;
    for (int64_t i = 0; i < a->dk; i++) {
        const float *row = (const float *)(s + i * nv);
        for (int c = 0; c < width; c++) dst[i * a->dv + c] = row[c] * decay[i];
    }
}

/* Every step for one (b, h, tile) of `width` columns from `col`; s is the zero-padded tile of S. */
static inline __attribute__((always_inline)) void run_tile(const struct kda_args *a, int64_t b, int64_t h,
                                                           int64_t col, int width, const int nv, vf *s,
                                                           const struct step_rows *r) {
    const int64_t qk_step = a->heads * a->dk, v_step = a->heads * a->dv;
    const int64_t qk0 = (b * a->steps * a->heads + h) * a->dk, v0 = (b * a->steps * a->heads + h) * a->dv + col;
    vf acc[MAX_NV] = {0}, next[MAX_NV], out[MAX_NV], u[MAX_NV];
    for (int64_t i = 0; i < a->dk; i++) {
        r->decay[i] = 1.0f;
        for (int j = 0; j < nv; j++) acc[j] += a->k[qk0 + i] * a->e[qk0 + i] * s[i * nv + j];
    }
    for (int64_t t = 0; t < a->steps; t++) {
        const int64_t at = qk0 + t * qk_step, has_next = t + 1 < a->steps;
        if (t + PREFETCH_STEPS < a->steps)
            prefetch_step(a, at + PREFETCH_STEPS * qk_step, v0 + (t + PREFETCH_STEPS) * v_step, width);
        int direct = step_factors(a->q + at, a->k + at, a->e + at, has_next ? a->k + at + qk_step : NULL,
                                  has_next ? a->e + at + qk_step : NULL, a->dk, r);
        float bt = a->beta[(b * a->steps + t) * a->heads + h], vrow[MAX_NV * VL] = {0};
        memcpy(width == nv * VL ? (float *)u : vrow, a->v + v0 + t * v_step, (size_t)width * sizeof(float));
        for (int j = 0; j < nv; j++) {
            if (width < nv * VL) memcpy(&u[j], vrow + j * VL, sizeof(vf));
            u[j] = bt * (u[j] - acc[j]);
        }
        tile_pass(s, a->dk, nv, u, r, direct, out, next);
        if (direct)
            for (int64_t i = 0; i < a->dk; i++) r->decay[i] = 1.0f;
        for (int j = 0; j < nv; j++) {
            out[j] *= a->scale;
            acc[j] = next[j];
        }
        memcpy(a->o + v0 + t * v_step, out, (size_t)width * sizeof(float));
        if (t < a->n_states) store_checkpoint(a, b, h, t, col, width, nv, s, r->decay);
    }
    for (int64_t i = 0; i < a->dk; i++)     /* the final state: S = Diag(d) S~ */
        for (int j = 0; j < nv; j++) s[i * nv + j] *= r->decay[i];
}

/* Copies columns [col, col + width) of a [dk][dv] state into or out of a zero-padded tile of nv vectors a row. */
static void copy_tile(float *state, int64_t dk, int64_t dv, int64_t col, int width, int nv, vf *tile, int into_tile) {
    for (int64_t i = 0; i < dk; i++) {
        float *row = state + i * dv + col, *t = (float *)(tile + i * nv);
        if (into_tile) {
            memset(t, 0, (size_t)nv * sizeof(vf));
            memcpy(t, row, (size_t)width * sizeof(float));
        } else {
            memcpy(row, t, (size_t)width * sizeof(float));
        }
    }
}

/* One job with the tile width specialised (the vector loops are unrolled for nv). */
static void run_job(const struct kda_args *a, int64_t bh, int64_t col, int width, int nv, vf *tile,
                    const struct step_rows *r) {
    int64_t b = bh / a->heads, h = bh % a->heads;
    switch (nv) {
    case 1: run_tile(a, b, h, col, width, 1, tile, r); break;
    case 2: run_tile(a, b, h, col, width, 2, tile, r); break;
    case 4: run_tile(a, b, h, col, width, 4, tile, r); break;
#if MAX_NV > 8
    case 8: run_tile(a, b, h, col, width, 8, tile, r); break;
#endif
#if MAX_NV > 16
    case 16: run_tile(a, b, h, col, width, 16, tile, r); break;
#endif
    default: run_tile(a, b, h, col, width, MAX_NV, tile, r); break;
    }
}

/* Vectors of columns per tile: the fewest power of two up to MAX_NV that holds dv, else MAX_NV. */
static int tile_vectors(int64_t dv) {
    int nv = 1;
    while (nv < MAX_NV && (int64_t)nv * VL < dv) nv *= 2;
    return nv;
}

/* Runs the recurrence (file comment), writing the states after the first n_states <= steps steps into states
 * (NULL when n_states is 0). Returns 0, or -1 when a buffer could not be allocated. */
int kda_recurrence_states(const float *q, const float *k, const float *e, const float *v, const float *beta,
                          float scale, int64_t batch, int64_t steps, int64_t heads, int64_t dk, int64_t dv,
                          float *state, float *o, float *states, int64_t n_states) {
    if (steps == 0) return 0;   /* no step reads anything; the state stays as it is */
    const struct kda_args a = {q, k, e, v, beta, state, o, states, batch, steps, heads, dk, dv, n_states, scale};
    const int nv = tile_vectors(dv);
    const int64_t cols = (int64_t)nv * VL, tiles = (dv + cols - 1) / cols, jobs = batch * heads * tiles;
    const int parallel = jobs > 1 && steps * dk * dv * batch * heads >= PARALLEL_MIN_WORK;
    int failed = 0;
#pragma omp parallel if (parallel) reduction(| : failed)
    {
        size_t rows_bytes = ((size_t)dk * 4 * sizeof(float) + sizeof(vf) - 1) / sizeof(vf) * sizeof(vf);
        vf *tile = aligned_alloc(sizeof(vf), (size_t)dk * nv * sizeof(vf) + rows_bytes + sizeof(vf));
        float *rows = tile ? (float *)(tile + (size_t)dk * nv) : NULL;
        struct step_rows r = {rows, rows + dk, rows + 2 * dk, rows + 3 * dk};
        failed = tile == NULL;
#pragma omp for schedule(static)
        for (int64_t job = 0; job < jobs; job++) {
            if (tile == NULL) continue;
            int64_t bh = job / tiles, col = job % tiles * cols;
            int width = (int)(dv - col < cols ? dv - col : cols);
            float *head_state = state + bh * dk * dv;
            copy_tile(head_state, dk, dv, col, width, nv, tile, 1);
            run_job(&a, bh, col, width, nv, tile, &r);
            copy_tile(head_state, dk, dv, col, width, nv, tile, 0);
        }
        free(tile);
    }
    return failed ? -1 : 0;
}

#define KDA_GROWING_DECAY 2         /* kda_call: some log decay g > 0 (a state that grows) */
#define DECAY_BLOCK 4096            /* log decays per job of the decay pass */

/* exp(max(x, floor)) as 2^(x log2 e) (simd.h's exp2_neg): a NaN stays NaN, and x = 0 gives exactly 1. */
static inline vf decay_of(vf x, vf floor_v) { return exp2_neg(pick(x < floor_v, floor_v, x) * LOG2E); }

/* e = exp(max(g, floor)) for the n log decays g; returns whether some g > 0 (NaN is not). Blocks of DECAY_BLOCK
 * go to the threads when there are several. */
static int decays(const float *g, int64_t n, float floor_exponent, float *e) {
    int growing = 0;
#pragma omp parallel for if (n >= 16 * DECAY_BLOCK) schedule(static) reduction(| : growing)
    for (int64_t start = 0; start < n; start += DECAY_BLOCK) {
        const int64_t end = n - start < DECAY_BLOCK ? n : start + DECAY_BLOCK;
        const vf floor_v = splat(floor_exponent);
        vf top = splat(-INFINITY);
        int64_t i = start;
        for (; i + VL <= end; i += VL) {
            const vf x = vload(g + i);
            top = vmax(x, top);
            vstore(e + i, decay_of(x, floor_v));
        }
        if (i < end) {      /* the tail through a zero-padded vector */
            float lanes[VL] = {0};
            memcpy(lanes, g + i, (size_t)(end - i) * sizeof(float));
            const vf x = vload(lanes);
            top = vmax(x, top);
            vstore(lanes, decay_of(x, floor_v));
            memcpy(e + i, lanes, (size_t)(end - i) * sizeof(float));
        }
        growing |= hmax(top) > 0.0f;
    }
    return growing;
}

/* The op's native call (kernels/kda/native.py): g [B][T][H][K] is the log decay as the op takes it (checked:
 * a g > 0 returns KDA_GROWING_DECAY before anything is written; floored at floor_exponent), the state starts from
 * initial [B][H][K][V] (NULL: zeros; never written) in the caller's buffer `state`, then kda_recurrence_states.
 * Returns 0, KDA_GROWING_DECAY, or -1 when a buffer could not be allocated. */
int kda_call(const float *q, const float *k, const float *g, float floor_exponent, const float *v, const float *beta,
             float scale, int64_t batch, int64_t steps, int64_t heads, int64_t dk, int64_t dv, const float *initial,
             float *state, float *o, float *states, int64_t n_states) {
    const int64_t n = batch * steps * heads * dk;
    float *e = malloc((size_t)(n > 0 ? n : 1) * sizeof *e);
    if (!e) return -1;
    if (decays(g, n, floor_exponent, e)) {
        free(e);
        return KDA_GROWING_DECAY;
    }
    const size_t state_bytes = (size_t)(batch * heads * dk * dv) * sizeof(float);
    if (initial) memcpy(state, initial, state_bytes);
    else memset(state, 0, state_bytes);
    const int status = kda_recurrence_states(q, k, e, v, beta, scale, batch, steps, heads, dk, dv, state, o, states,
                                             n_states);
    free(e);
    return status;
}
