/* Lightning indexer scores on CPU for ascend_dsa::lightning_indexer (kernels/lightning_indexer_native.py);
 * kernels/native.py builds and loads this file. Plain C (GCC vector extensions), no torch headers.
 *
 * For one query token (H heads of dim D) and the keys s = 0 .. n-1 of one batch row:
 *   score[s] = sum_h w[h] * relu(q[h] . key[s])                                  (fp32 accumulation)
 * Key s is row s of a [S, D] matrix (row stride `row_stride` values), or, through a paged cache's block table,
 * row s % block_size of block table[s / block_size] (block stride `block_stride` values). Keys are fp32,
 * bf16 or fp16 (fp16 needs the compiler's _Float16: li_has_f16).
 *
 * The scores never form an [H, S] matrix: a block of 4 or 8 keys is scored for all heads in registers, heads
 * 16 to a vector (the query transposed to [D, H]), and reduced to one score per key. Two micro-kernels:
 * - fp32: the block's keys converted to fp32, one fused multiply-add per (key, dim, 16 heads);
 * - bf16 dot products (AVX512-BF16, bf16 query and keys): the query as bf16 pairs [D/2, H], one vdpbf16ps per
 *   (key, pair of dims, 16 heads) straight on the stored keys (products exact, sums in fp32 as above).
 * OpenMP threads take chunks of CHUNK keys dynamically.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

/* Register tiles (keys x head vectors): the accumulators, the query vectors and a broadcast key value must fit
 * the level's registers. One head vector (at most VL heads) takes KB_ONE keys; more take KB_MANY keys against up
 * to MAX_NB vectors (32 registers: 4 x 4 + 4; 16 registers: 6 x 2 + 2). */
#define KB_ONE 8
#if NREG >= 32
#define KB_MANY 4
#define MAX_NB 4
#else
#define KB_MANY 6
#define MAX_NB 2
#endif
#define KB_MAX 8
#define PF_KEYS 96  /* keys ahead whose rows are prefetched (caches cold after other work: ~3%) */
#define PARALLEL_MIN_MACS (1 << 22)   /* below ~0.1 ms of work the calling thread scores every key: waking a
                                         team costs more, and far more when another process holds a core */
#define CHUNK 504  /* keys per unit of work: threads take chunks as they come (a thread still waking up from
                      sleep takes fewer), a multiple of KB_ONE and KB_MANY */

int li_has_f16(void) {
#ifdef __FLT16_MANT_DIG__
    return 1;
#else
    return 0;
#endif
}

int li_has_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

struct keys {
    const char *base;          /* key (or cache) data */
    int dtype;
    int64_t row_stride;        /* values between rows (within a block when paged) */
    int64_t block_stride;      /* values between blocks of a paged cache */
    const int32_t *table;      /* block table row of this batch, or NULL */
    int64_t block_size;
};

static const char *key_row(const struct keys *k, int64_t s) {
    size_t item = k->dtype == F32 ? 4 : 2;
    int64_t offset = k->table ? (int64_t)k->table[s / k->block_size] * k->block_stride
                                    + (s % k->block_size) * k->row_stride
                              : s * k->row_stride;
    return k->base + offset * (int64_t)item;
}

/* sum_j w[j] * relu(acc[j]) over nb head vectors; w [h] is followed by h lane masks (all ones for a real head,
 * zero for padding), so a padded head, whose zero query meets an infinite key as 0 * inf = NaN, adds nothing. */
static float weighted_relu_sum(const vf *acc, const float *w, int64_t h, int nb) {
    vf total = {0};
    for (int j = 0; j < nb; j++) {
        vf term = relu(acc[j]) * vload(w + j * VL);
        vi real;
        memcpy(&real, w + h + j * VL, sizeof real);
        total += (vf)((vi)term & real);
    }
    return hsum(total);
}

/* fp32 micro-kernel: kb keys (fp32 rows kf[k][0:d]) against nb VL-head vectors of qt [d][h] from head hb.
 * Always inlined with constant kb and nb, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_f32(const float *const *kf, const float *qt,
                                                            const float *w, int64_t d, int64_t h, int64_t hb,
                                                            const int kb, const int nb, float *out) {
    vf acc[KB_MAX][MAX_NB] = {{{0}}};
    for (int64_t i = 0; i < d; i++) {
        const float *qrow = qt + i * h + hb;
        vf qv[MAX_NB];
        for (int j = 0; j < nb; j++) qv[j] = vload(qrow + j * VL);
        for (int k = 0; k < kb; k++) {
            float kv = kf[k][i];
            for (int j = 0; j < nb; j++) acc[k][j] += qv[j] * kv;
        }
    }
    for (int k = 0; k < kb; k++) out[k] += weighted_relu_sum(acc[k], w + hb, h, nb);
}

#ifdef __AVX512BF16__
/* bf16 micro-kernel: kb stored bf16 rows against nb 16-head vectors of the pair-packed query qp [d/2][h]. */
static inline __attribute__((always_inline)) void block_bf16(const char *const *rows, const uint32_t *qp,
                                                             const float *w, int64_t d, int64_t h, int64_t hb,
                                                             const int kb, const int nb, float *out) {
    __m512 acc[KB_MAX][MAX_NB];
    for (int k = 0; k < kb; k++)
        for (int j = 0; j < nb; j++) acc[k][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d / 2; p++) {
        const uint32_t *qrow = qp + p * h + hb;
        __m512bh qv[MAX_NB];
        for (int j = 0; j < nb; j++) qv[j] = (__m512bh)_mm512_loadu_si512(qrow + j * VL);
        for (int k = 0; k < kb; k++) {
            int32_t pair;
            memcpy(&pair, rows[k] + 4 * p, sizeof pair);
            __m512bh kv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < nb; j++) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], qv[j], kv);
        }
    }
    for (int k = 0; k < kb; k++) {
        vf lanes[MAX_NB];
        memcpy(lanes, acc[k], (size_t)nb * sizeof(vf));
        out[k] += weighted_relu_sum(lanes, w + hb, h, nb);
    }
}
#endif

/* The rows of keys s0 .. s0+kb-1 (clamped to n-1): one block-table lookup unless the keys cross a block. */
static void key_rows(const struct keys *k, int64_t s0, int kb, int64_t n, const char **rows) {
    size_t item = k->dtype == F32 ? 4 : 2;
    const char *first = key_row(k, s0);
    int64_t room = k->table ? k->block_size - s0 % k->block_size : kb;
    for (int i = 0; i < kb; i++)
        rows[i] = s0 + i >= n ? key_row(k, n - 1)
                : i < room  ? first + (int64_t)i * k->row_stride * (int64_t)item
                            : key_row(k, s0 + i);
}

/* One block of kb keys scored for every head into out[kb], nb (1..4) 16-head vectors at a time. */
#define SCORE_BLOCK(KB_, NB_)                                                                  \
    do {                                                                                       \
        if (qp) {                                                                              \
            BF16_BLOCK(KB_, NB_);                                                              \
        } else {                                                                               \
            block_f32(kf_rows, qt, w, d, h, hb, KB_, NB_, out);                                \
        }                                                                                      \
    } while (0)
#ifdef __AVX512BF16__
#define BF16_BLOCK(KB_, NB_) block_bf16(rows, qp, w, d, h, hb, KB_, NB_, out)
#else
#define BF16_BLOCK(KB_, NB_) ((void)0)
#endif

/* Scores of keys [start, end) into score[start:end], kf a buffer of KB_MAX fp32 rows (unused with qp). One
 * head vector takes blocks of KB_ONE keys, more vectors KB_MANY keys (see the register tiles above). */
static void score_range(const struct keys *k, const float *qt, const uint32_t *qp, const float *w, int64_t d,
                        int64_t h, int64_t start, int64_t end, int64_t n, float *kf, float *score) {
    int kb = h == VL ? KB_ONE : KB_MANY;
    for (int64_t s0 = start; s0 < end; s0 += kb) {
        const char *rows[KB_MAX];
        key_rows(k, s0, kb, n, rows);
        if (s0 + PF_KEYS < end) {
            const char *ahead[KB_MAX];
            key_rows(k, s0 + PF_KEYS, kb, n, ahead);
            size_t bytes = (size_t)d * (k->dtype == F32 ? 4 : 2);
            for (int i = 0; i < kb; i++)
                for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(ahead[i] + off, 0, 3);
        }
        const float *kf_rows[KB_MAX];
        for (int i = 0; !qp && i < kb; i++) {
            if (k->dtype == F32) {
                kf_rows[i] = (const float *)rows[i];      /* fp32 keys are read where they are stored */
            } else {
                row_to_f32(kf + i * d, rows[i], k->dtype, d);
                kf_rows[i] = kf + i * d;
            }
        }
        float out[KB_MAX] = {0};
        for (int64_t hb = 0; hb < h; hb += MAX_NB * VL) {
            int nb = (int)((h - hb) / VL < MAX_NB ? (h - hb) / VL : MAX_NB);
            if (kb == KB_ONE) SCORE_BLOCK(KB_ONE, 1);
            else if (nb == 1) SCORE_BLOCK(KB_MANY, 1);
#if MAX_NB == 4
            else if (nb == 2) SCORE_BLOCK(KB_MANY, 2);
            else if (nb == 3) SCORE_BLOCK(KB_MANY, 3);
            else SCORE_BLOCK(KB_MANY, 4);
#else
            else SCORE_BLOCK(KB_MANY, 2);
#endif
        }
        for (int i = 0; i < kb && s0 + i < end; i++) score[s0 + i] = out[i];
    }
}

/* score[0:n] for query q [h][d] (fp32) with head weights w [h] (fp32). Heads are padded to a multiple of 16
 * with zero queries and weights (they add nothing). bf16_dot: score bf16 keys with bf16 dot products (q must
 * hold bf16 values, d must be even; needs li_has_bf16_dot). Returns 0, or -1 when out of memory. */
int li_scores(const void *key, int dtype, int64_t row_stride, int64_t block_stride, const int32_t *table,
               int64_t block_size, int64_t n, const float *q, const float *w, int64_t h, int64_t d, int bf16_dot,
               float *score) {
    struct keys k = {key, dtype, row_stride, block_stride, table, block_size};
    int64_t hp = (h + VL - 1) / VL * VL;
    float *qt = calloc((size_t)(hp * d), sizeof(float));
    float *wp = calloc((size_t)(2 * hp), sizeof(float));   /* weights, then lane masks */
    uint32_t *qp = bf16_dot ? calloc((size_t)(hp * (d / 2)), sizeof(uint32_t)) : NULL;
    if (!qt || !wp || (bf16_dot && !qp)) {
        free(qt);
        free(wp);
        free(qp);
        return -1;
    }
    memcpy(wp, w, (size_t)h * sizeof(float));
    memset(wp + hp, 0xFF, (size_t)h * sizeof(float));
    for (int64_t j = 0; j < h; j++)
        for (int64_t i = 0; i < d; i++) qt[i * hp + j] = q[j * d + i];
    for (int64_t p = 0; qp && p < d / 2; p++)
        for (int64_t j = 0; j < h; j++) {
            uint32_t lo, hi;
            memcpy(&lo, &q[j * d + 2 * p], 4);
            memcpy(&hi, &q[j * d + 2 * p + 1], 4);
            qp[p * hp + j] = (lo >> 16) | (hi & 0xffff0000u);
        }
    int64_t chunks = (n + CHUNK - 1) / CHUNK;
    int failed = 0;
#pragma omp parallel reduction(| : failed) if (n * hp * d >= PARALLEL_MIN_MACS)
    {
        float *kf = bf16_dot ? NULL : malloc((size_t)(KB_MAX * d) * sizeof(float));
        failed = !bf16_dot && !kf;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t c = 0; c < chunks; c++)
            if (!failed)
                score_range(&k, qt, qp, wp, d, hp, c * CHUNK, c * CHUNK + CHUNK < n ? c * CHUNK + CHUNK : n, n, kf,
                            score);
        free(kf);
    }
    free(qt);
    free(wp);
    free(qp);
    return failed ? -1 : 0;
}

/* Order-preserving unsigned key of a float: larger floats give larger keys, every NaN (whatever its sign bit) above
 * +inf, as torch.topk ranks them; -0 and +0 equal. */
static inline uint32_t order_key(float f) {
    uint32_t u;
    if (f != f) return UINT32_MAX;
    f = f == 0.0f ? 0.0f : f;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The key T of the take-th largest score, and how many keys equal to T belong to the top take: radix select,
 * 8 bits at a time from the top. */
static uint32_t select_threshold(const uint32_t *keys, int64_t n, int64_t take, int64_t *ties) {
    uint32_t prefix = 0, mask = 0;
    int64_t need = take;
    for (int shift = 24; shift >= 0; shift -= 8) {
        int64_t hist[256] = {0};
        for (int64_t i = 0; i < n; i++)
            if ((keys[i] & mask) == prefix) hist[(keys[i] >> shift) & 0xFFu]++;
        int b = 255;
        while (hist[b] < need) need -= hist[b--];
        prefix |= (uint32_t)b << shift;
        mask |= 0xFFu << shift;
    }
    *ties = need;
    return prefix;
}

/* Sorts sel[0:m] by key descending, index ascending among equal keys (LSD radix sort, 8 bits a pass, stable). */
static void sort_selected(int32_t *sel, int32_t *tmp, const uint32_t *keys, int64_t m) {
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < m; i++) count[255 - ((keys[sel[i]] >> shift) & 0xFFu) + 1]++;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int64_t i = 0; i < m; i++) tmp[count[255 - ((keys[sel[i]] >> shift) & 0xFFu)]++] = sel[i];
        memcpy(sel, tmp, (size_t)m * sizeof *sel);
    }
}

/* The k largest of score[0:n], sorted descending (equal scores by position), as positions idx [k] and values
 * val [k]; positions -1 and values -inf pad the rest when n < k, and a key scoring -inf is reported as -1.
 * Returns 0, or -1 when out of memory. */
int li_topk(const float *score, int64_t n, int64_t k, int32_t *idx, float *val) {
    int64_t take = k < n ? k : n;
    for (int64_t i = take; i < k; i++) {
        idx[i] = -1;
        val[i] = -INFINITY;
    }
    if (take == 0) return 0;
    uint32_t *keys = malloc((size_t)n * sizeof *keys);
    int32_t *tmp = malloc((size_t)take * sizeof *tmp);
    if (!keys || !tmp) {
        free(keys);
        free(tmp);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) keys[i] = order_key(score[i]);
    int64_t ties, m = 0;
    uint32_t t = select_threshold(keys, n, take, &ties);
    for (int64_t i = 0; i < n; i++)
        if (keys[i] > t || (keys[i] == t && ties-- > 0)) idx[m++] = (int32_t)i;
    sort_selected(idx, tmp, keys, m);
    for (int64_t i = 0; i < m; i++) {
        val[i] = score[idx[i]];
        idx[i] = val[i] == -INFINITY ? -1 : idx[i];     /* a key scoring -inf counts as masked, as in the torch path */
    }
    free(keys);
    free(tmp);
    return 0;
}
