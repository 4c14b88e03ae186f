/* Sparse flash attention on CPU for ascend_dsa::sparse_flash_attention (kernels/sparse_attention/sparse_flash_attention.py);
 * kernels/native/loader.py builds and loads this file. Plain C (GCC vector extensions), no torch headers.
 *
 * For every query token t of one batch row: over the KV rows its sparse_indices select (struct selection),
 *   logit[r] = scale_value * (q[t,h] . kv[r] + q_rope[t,h] . rope[r])
 *   out[t,h] = sum_r softmax(logit)[r] * value[r],  smax[t,h] = max logit,  ssum[t,h] = sum exp(logit - smax)
 * in fp32. Each selected row is read once: a chunk of CHUNK rows (fp32 rows where they are stored, other
 * dtypes converted to fp32 into a per-thread buffer) is scored for all heads and folded into a running
 * (max, sum, out) with an online softmax. A token's rows are
 * split across the OpenMP threads when there are fewer tokens than threads; the partial results are merged.
 * Heads and head dims are padded to a multiple of the level's vector width VL (simd.h) in the buffers (zeros), so
 * that the micro-kernels work on whole vectors: logits hold VL heads of one row per vector (query transposed),
 * the weighted sum VL heads x VL dims in registers over the chunk's rows; with 16 lanes and at most 8 heads the
 * fp32 micro-kernels and the softmax work on 8 (half the work of padding them to 16). fp16 rows need F16C or
 * the compiler's _Float16 (sfa_has_f16); the bf16 mode needs AVX512-BF16 (sfa_has_bf16_dot); the caller checks
 * both.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define CHUNK 64       /* rows converted and scored together (the weighted sum reads and writes acc once a chunk) */
#define AMX_CHUNK 32   /* the same on tiles: the probabilities' A tile holds 32 rows */
#define PARALLEL_MIN_MACS (1 << 21)   /* tokens x entries x heads x dims below which one thread does every token */
#define RB 8           /* rows per logit micro-kernel */

int sfa_has_f16(void) {
#ifdef __FLT16_MANT_DIG__
    return 1;
#else
    return 0;
#endif
}

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int sfa_has_bf16_dot(void);

static int sfa_has_amx(void) {
#ifdef AMX_TILES
    return 1;
#else
    return 0;
#endif
}

/* Per-thread scratch slots, grown on demand and kept across calls (OpenMP threads persist):
 * 0 chunk buffers, 1 running state of the parts, 2 transposed query; sfa_call's 3 query and 4 query rope widened
 * to fp32, 5 fp32 output of a 16-bit one. */
static __thread struct { float *p; size_t cap; } slots[6];

static float *scratch(int slot, size_t floats) {
    if (floats > slots[slot].cap) {
        free(slots[slot].p);
        size_t cap = (size_t)round_up((int64_t)floats, 4096);
        slots[slot].p = aligned_alloc(64, cap * sizeof(float));
        slots[slot].cap = slots[slot].p ? cap : 0;
        if (slots[slot].p) memset(slots[slot].p, 0, cap * sizeof(float));
    }
    return slots[slot].p;
}

/* n values of type `dtype` at src to fp32 at dst, zero-filled up to n_pad. */
static void to_f32(float *restrict dst, const void *src, int dtype, int64_t n, int64_t n_pad) {
    row_to_f32(dst, src, dtype, n);
    for (int64_t i = n; i < n_pad; i++) dst[i] = 0.0f;
}

static int elem_size(int dtype) { return dtype == F32 ? 4 : 2; }

/* Starts a row's way into the cache: its first line by a load, the rest by prefetches. Prefetches alone, one
 * chunk ahead, hardly helped once other work had evicted the rows (AMD EPYC Zen 4, forced avx2, 2048 rows of 16K,
 * 2 threads: 0.95 -> 0.82 ms after evicting 64 MB, alternated in one process); a load is not dropped. */
static void prefetch_row(const char *row, int64_t bytes) {
    (void)*(volatile const char *)row;
    for (int64_t off = 64; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
}

/* exp(x) for x <= 0 to ~2 ulp; below -87 it returns about 1e-38 rather than 0. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f + 12582912.0f;        /* 1.5 * 2^23: rounds x*log2(e) */
    union { float f; int32_t i; } n = { .f = t };
    float k = t - 12582912.0f;
    float r = x - k * 0.693145751953125f - k * 1.428606765330187045e-06f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } s = { .u = ((uint32_t)n.i - 0x4B400000u + 127u) << 23 };   /* unsigned: no UB for any x */
    return p * s.f;
}

/* The larger of a and b, NaN when either is (as torch's amax): a NaN logit makes its head's row NaN throughout. */
static inline float nan_max(float a, float b) { return b > a || b != b ? b : a; }

struct shape {
    int64_t H, Hp, DL, DLp, DR, DRp;
    int64_t Ha;         /* heads the fp32 micro-kernels and the softmax work on: 8 when H <= 8 < VL, else Hp */
    float scale;
    int bf16;           /* bf16 dot products straight from the stored rows (see the AVX512-BF16 section) */
    int amx;            /* the bf16 mode on AMX tiles (see the AMX section) */
};

struct source {
    const char *kv, *value, *rope;       /* value NULL: the kv rows are the values */
    int64_t kv_stride, value_stride, rope_stride;   /* bytes between rows */
    int kv_dtype, rope_dtype;
};

typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));

/* The logits micro-kernel for one head block: RB rows (pointers; past n the last row again) against W heads of
 * the transposed query (W = VL: vf, 8: vf8), into s[r][hb .. hb+W). */
#define LOGITS_BLOCK(T, W)                                                                            \
    do {                                                                                               \
        T acc[RB] = {0};                                                                               \
        for (int64_t d = 0; d < sh->DLp; d++) {                                                        \
            T qv = *(const T *)(qT + d * sh->Hp + hb);                                                 \
            _Pragma("GCC unroll 8") for (int i = 0; i < RB; i++) acc[i] += k[i][d] * qv;               \
        }                                                                                              \
        for (int64_t d = 0; rrow && d < sh->DRp; d++) {                                               \
            T qv = *(const T *)(qrT + d * sh->Hp + hb);                                                \
            _Pragma("GCC unroll 8") for (int i = 0; i < RB; i++) acc[i] += r[i][d] * qv;               \
        }                                                                                              \
        _Pragma("GCC unroll 8") for (int i = 0; i < RB; i++) *(T *)(s + (r0 + i) * sh->Hp + hb) = acc[i]; \
    } while (0)

/* acc[i][0..1] += rows[i][0:dims] . the two head vectors at hb, hb + VL of the transposed query qT [dims][Hp]. */
static inline __attribute__((always_inline)) void dots_two_vectors(vf acc[RB / 2][2], const float *const *rows,
                                                                   const float *qT, int64_t dims, int64_t Hp,
                                                                   int64_t hb) {
    for (int64_t d = 0; d < dims; d++) {
        vf q0 = vload(qT + d * Hp + hb), q1 = vload(qT + d * Hp + hb + VL);
#pragma GCC unroll 4
        for (int i = 0; i < RB / 2; i++) {
            float x = rows[i][d];
            acc[i][0] += x * q0;
            acc[i][1] += x * q1;
        }
    }
}

/* Two head vectors (hb, hb + VL) of RB / 2 rows k[0..], r[0..] into s_rows[i][hb ..]: per dim two query loads and
 * RB / 2 broadcasts for RB fused multiply-adds, where LOGITS_BLOCK's one-vector tile loads once per multiply-add
 * (load-bound on AVX2). */
static inline __attribute__((always_inline)) void logits_two_vectors(const struct shape *sh, const float *const *k,
                                                                     const float *const *r, const float *qT,
                                                                     const float *qrT, int64_t hb, float *s_rows) {
    vf acc[RB / 2][2] = {{{0}}};
    dots_two_vectors(acc, k, qT, sh->DLp, sh->Hp, hb);
    if (r) dots_two_vectors(acc, r, qrT, sh->DRp, sh->Hp, hb);
    for (int i = 0; i < RB / 2; i++) {
        vstore(s_rows + i * sh->Hp + hb, acc[i][0]);
        vstore(s_rows + i * sh->Hp + hb + VL, acc[i][1]);
    }
}

/* s[r][h] = krow[r] . qT[:, h] + rrow[r] . qrT[:, h] for r < n and the first Ha heads (rows padded to RB;
 * extra rows give unused logits): pairs of head vectors by logits_two_vectors, an odd one left by LOGITS_BLOCK. */
static void logits(const struct shape *sh, const float *const *krow, const float *const *rrow, const float *qT,
                   const float *qrT, int64_t n, float *s) {
    for (int64_t r0 = 0; r0 < n; r0 += RB) {
        const float *k[RB], *r[RB];
        for (int i = 0; i < RB; i++) {
            k[i] = krow[r0 + i < n ? r0 + i : n - 1];
            r[i] = rrow ? rrow[r0 + i < n ? r0 + i : n - 1] : NULL;
        }
        if (sh->Ha == 8) {
            int64_t hb = 0;
            LOGITS_BLOCK(vf8, 8);
        } else {
            int64_t hb = 0;
            for (; hb + 2 * VL <= sh->Hp; hb += 2 * VL)
                for (int half = 0; half < 2; half++)
                    logits_two_vectors(sh, k + half * RB / 2, rrow ? r + half * RB / 2 : NULL, qT, qrT, hb,
                                       s + (r0 + half * RB / 2) * sh->Hp);
            if (hb < sh->Hp) LOGITS_BLOCK(vf, VL);
        }
    }
}

/* acc[h][DLp] += sum_{r<n} p[r][h] * vrow[r] over W heads from h0 and DV vectors of dims from d, held in
 * registers across the chunk's rows: per row DV value loads and W broadcasts for W * DV multiply-adds. */
#define VALUES_TILE(W, DV, d)                                                                             \
    do {                                                                                                  \
        vf a[W][DV];                                                                                      \
        _Pragma("GCC unroll 16") for (int i = 0; i < W; i++)                                             \
            _Pragma("GCC unroll 2") for (int j = 0; j < DV; j++)                                          \
                a[i][j] = vload(acc + (h0 + i) * sh->DLp + (d) + j * VL);                                 \
        for (int64_t r = 0; r < n; r++) {                                                                 \
            vf v[DV];                                                                                     \
            _Pragma("GCC unroll 2") for (int j = 0; j < DV; j++) v[j] = vload(vrow[r] + (d) + j * VL);    \
            const float *pr = p + r * sh->Hp + h0;                                                        \
            _Pragma("GCC unroll 16") for (int i = 0; i < W; i++)                                         \
                _Pragma("GCC unroll 2") for (int j = 0; j < DV; j++) a[i][j] += pr[i] * v[j];             \
        }                                                                                                 \
        _Pragma("GCC unroll 16") for (int i = 0; i < W; i++)                                             \
            _Pragma("GCC unroll 2") for (int j = 0; j < DV; j++)                                          \
                vstore(acc + (h0 + i) * sh->DLp + (d) + j * VL, a[i][j]);                                 \
    } while (0)

/* W heads from h0 against every dim: two vectors at a time, the last one alone when DLp / VL is odd. */
#define VALUES_BLOCK(W)                                                                                   \
    do {                                                                                                  \
        int64_t d = 0;                                                                                    \
        for (; d + 2 * VL <= sh->DLp; d += 2 * VL) VALUES_TILE(W, 2, d);                                  \
        if (d < sh->DLp) VALUES_TILE(W, 1, d);                                                            \
    } while (0)

/* Heads per weighted-sum tile: 2 x W accumulators, 2 value vectors and a broadcast fit the registers (16 of
 * AVX2's and SSE's, 32 of AVX-512's and NEON's), and each multiply-add needs under one load (one value vector
 * against all heads of a tile was load-bound on AVX2: 9 loads per 8 multiply-adds). */
#define VALUES_HEADS (VL == 16 ? 8 : 4)

/* acc[h][DLp] += sum_{r<n} p[r][h] * vrow[r] for the first Ha heads. */
static void weighted_values(const struct shape *sh, const float *p, const float *const *vrow, int64_t n,
                            float *acc) {
    for (int64_t h0 = 0; h0 < sh->Ha; h0 += VALUES_HEADS) VALUES_BLOCK(VALUES_HEADS);
}

/* Online softmax step: s[r][h] (r < n) become exp(s - m_new); m, l and acc are rescaled to the new max. */
static void softmax_step(const struct shape *sh, float *s, int64_t n, float *m, float *l, float *acc,
                         float *heads_tmp) {
    int64_t Hp = sh->Hp, Ha = sh->Ha;
    float *mc = heads_tmp, *corr = heads_tmp + Hp, *sum = heads_tmp + 2 * Hp;   /* heap: heads may be many */
    for (int64_t h = 0; h < Ha; h++) mc[h] = m[h];
    for (int64_t r = 0; r < n; r++)
#pragma omp simd
        for (int64_t h = 0; h < Ha; h++) mc[h] = nan_max(mc[h], s[r * Hp + h]);
    int rescale = 0;
    for (int64_t h = 0; h < Ha; h++) {
        corr[h] = m[h] == mc[h] ? 1.0f : exp_neg(m[h] - mc[h]);
        rescale |= corr[h] != 1.0f && l[h] != 0.0f;
        m[h] = mc[h];
        sum[h] = 0.0f;
    }
    const int64_t hv = Ha / VL * VL;     /* heads in whole vectors; the rest (Ha = 8 < VL) one by one */
    for (int64_t r = 0; r < n; r++) {
        float *sr = s + r * Hp;
        for (int64_t h = 0; h < hv; h += VL) {      /* a scalar exp_neg loop: not vectorized by gcc 12 */
            vf e = exp2_neg((vload(sr + h) - vload(mc + h)) * LOG2E);
            vstore(sr + h, e);
            vstore(sum + h, vload(sum + h) + e);
        }
        for (int64_t h = hv; h < Ha; h++) {
            float e = exp_neg(sr[h] - mc[h]);
            sr[h] = e;
            sum[h] += e;
        }
    }
    for (int64_t h = 0; h < Ha; h++) l[h] = l[h] * corr[h] + sum[h];
    if (rescale)
        for (int64_t h = 0; h < Ha; h++)
#pragma omp simd
            for (int64_t d = 0; d < sh->DLp; d++) acc[h * sh->DLp + d] *= corr[h];
}

static void prefetch_chunk(const struct shape *sh, const struct source *src, const int64_t *rows, int64_t n) {
    int64_t kv_bytes = sh->DL * elem_size(src->kv_dtype), rope_bytes = sh->DR * elem_size(src->rope_dtype);
    for (int64_t i = 0; i < n; i++) {
        prefetch_row(src->kv + rows[i] * src->kv_stride, kv_bytes);
        if (src->rope) prefetch_row(src->rope + rows[i] * src->rope_stride, rope_bytes);
        if (src->value) prefetch_row(src->value + rows[i] * src->value_stride, kv_bytes);
    }
}

/* fp32 rows of width `d` (padded to dp) for the chunk's rows of one tensor: the stored rows themselves when they
 * are fp32 and need no padding, else converted into buf. */
static void chunk_rows(const char *base, int64_t stride, int dtype, int64_t d, int64_t dp, const int64_t *rows,
                       int64_t n, float *buf, const float **out) {
    for (int64_t i = 0; i < n; i++) {
        const char *row = base + rows[i] * stride;
        if (dtype == F32 && d == dp) {
            out[i] = (const float *)row;
        } else {
            to_f32(buf + i * dp, row, dtype, d, dp);
            out[i] = buf + i * dp;
        }
    }
}

/* One chunk in fp32: row pointers (converting rows that are not fp32), logits, online softmax step, weighted
 * sum. */
static void chunk_f32(const struct shape *sh, const struct source *src, const float *qT, const float *qrT,
                      const int64_t *rows, int64_t n, float *kbuf, float *rbuf, float *vbuf, float *s, float *m,
                      float *l, float *acc, float *heads_tmp) {
    const float *krow[CHUNK], *rrow[CHUNK], *vrow[CHUNK];
    chunk_rows(src->kv, src->kv_stride, src->kv_dtype, sh->DL, sh->DLp, rows, n, kbuf, krow);
    if (src->rope) chunk_rows(src->rope, src->rope_stride, src->rope_dtype, sh->DR, sh->DRp, rows, n, rbuf, rrow);
    if (src->value) chunk_rows(src->value, src->value_stride, src->kv_dtype, sh->DL, sh->DLp, rows, n, vbuf, vrow);
    logits(sh, krow, src->rope ? rrow : NULL, qT, qrT, n, s);
    softmax_step(sh, s, n, m, l, acc, heads_tmp);
    weighted_values(sh, s, src->value ? vrow : krow, n, acc);
}

#ifdef __AVX512BF16__
#include <immintrin.h>
/* AVX512-BF16 (bf16 query, KV and output): the logits come from bf16 dot products of the stored rows with
 * the bf16 query (exact products, fp32 sums; scale_value applied to the sum), and the weighted sum from bf16
 * dot products of probabilities rounded once to bf16 with pairs of stored value rows interleaved in
 * registers. No row is converted to fp32; the query is transposed to [D/2][Hp] pairs of bf16. */
int sfa_has_bf16_dot(void) { return 1; }

static inline uint32_t load_u32(const uint16_t *p) {
    uint32_t x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* fp32 to bf16 bits, rounded to nearest even (finite x). */
static inline uint32_t bf16_bits(float x) {
    union { float f; uint32_t u; } c = { .f = x };
    return (c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16;
}

/* One head block of logits for rows r0.. (RB of them, the last row repeated past n) from pairs of dims. */
static inline void dot_rows_bf16(const uint16_t *const *rows, int64_t r0, int64_t n, const uint32_t *qT,
                                 int64_t pairs, int64_t Hp, __m512 *acc) {
    const uint16_t *k[RB];
    for (int i = 0; i < RB; i++) k[i] = rows[r0 + i < n ? r0 + i : n - 1];
    for (int64_t d = 0; d < pairs; d++) {
        __m512bh qv = (__m512bh)_mm512_load_si512(qT + d * Hp);
#pragma GCC unroll 8
        for (int i = 0; i < RB; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_set1_epi32((int)load_u32(k[i] + 2 * d)));
    }
}

static void logits_bf16(const struct shape *sh, const uint16_t *const *krow, const uint16_t *const *rrow,
                        const uint32_t *qT, const uint32_t *qrT, int64_t n, float *s) {
    __m512 scale = _mm512_set1_ps(sh->scale);
    for (int64_t hb = 0; hb < sh->Hp; hb += VL) {
        for (int64_t r0 = 0; r0 < n; r0 += RB) {
            __m512 acc[RB];
            for (int i = 0; i < RB; i++) acc[i] = _mm512_setzero_ps();
            dot_rows_bf16(krow, r0, n, qT + hb, sh->DL / 2, sh->Hp, acc);
            if (rrow) dot_rows_bf16(rrow, r0, n, qrT + hb, sh->DR / 2, sh->Hp, acc);
            for (int i = 0; i < RB; i++) _mm512_store_ps(s + (r0 + i) * sh->Hp + hb, _mm512_mul_ps(acc[i], scale));
        }
    }
}

/* pb[j][h] = the bf16 pair (p[2j][h], p[2j+1][h]), zero past row n. */
static void pack_probs(const struct shape *sh, const float *p, int64_t n, uint32_t *pb) {
    for (int64_t j = 0; j < (n + 1) / 2; j++) {
        const float *e = p + 2 * j * sh->Hp, *o = e + sh->Hp;
        int odd = 2 * j + 1 < n;
#pragma omp simd
        for (int64_t h = 0; h < sh->Hp; h++) pb[j * sh->Hp + h] = bf16_bits(e[h]) | (odd ? bf16_bits(o[h]) << 16 : 0);
    }
}

static void weighted_values_bf16(const struct shape *sh, const uint32_t *pb, const uint16_t *const *vrow,
                                 int64_t n, float *acc) {
    static const uint16_t order[32] = { 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47 };
    const __m512i interleave = _mm512_loadu_si512(order);
    for (int64_t h0 = 0; h0 < sh->Hp; h0 += VL) {
        for (int64_t d = 0; d < sh->DL; d += VL) {
            __m512 a[VL];
            for (int i = 0; i < VL; i++) a[i] = _mm512_load_ps(acc + (h0 + i) * sh->DLp + d);
            for (int64_t j = 0; j < (n + 1) / 2; j++) {
                __m512i e = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vrow[2 * j] + d)));
                __m512i o = _mm512_castsi256_si512(
                    _mm256_loadu_si256((const __m256i *)(vrow[2 * j + 1 < n ? 2 * j + 1 : 2 * j] + d)));
                __m512bh v = (__m512bh)_mm512_permutex2var_epi16(e, interleave, o);
                const uint32_t *pj = pb + j * sh->Hp + h0;
#pragma GCC unroll 16
                for (int i = 0; i < VL; i++) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32((int)pj[i]), v);
            }
            for (int i = 0; i < VL; i++) _mm512_store_ps(acc + (h0 + i) * sh->DLp + d, a[i]);
        }
    }
}

/* One chunk in bf16: row pointers, logits, online softmax step, weighted sum. */
static void chunk_bf16(const struct shape *sh, const struct source *src, const uint32_t *qT, const int64_t *rows,
                       int64_t n, float *s, uint32_t *pb, float *m, float *l, float *acc, float *heads_tmp) {
    const uint16_t *krow[CHUNK], *rrow[CHUNK], *vrow[CHUNK];
    for (int64_t i = 0; i < n; i++) {
        krow[i] = (const uint16_t *)(src->kv + rows[i] * src->kv_stride);
        rrow[i] = src->rope ? (const uint16_t *)(src->rope + rows[i] * src->rope_stride) : NULL;
        vrow[i] = src->value ? (const uint16_t *)(src->value + rows[i] * src->value_stride) : krow[i];
    }
    logits_bf16(sh, krow, src->rope ? rrow : NULL, qT, qT + (sh->DL / 2) * sh->Hp, n, s);
    softmax_step(sh, s, n, m, l, acc, heads_tmp);
    pack_probs(sh, s, n, pb);
    weighted_values_bf16(sh, pb, vrow, n, acc);
}
#else
int sfa_has_bf16_dot(void) { return 0; }
#endif

#ifdef AMX_TILES
/* AMX (amx_bf16 level), in the bf16 mode when DL and DL + DR are multiples of 32: the same arithmetic as above
 * (exact products, fp32 sums; probabilities rounded once to bf16) on tiles. Logits: the chunk's rows, kv then
 * rope, copied one after another into A tiles (16 rows x 32 dims) against the pair-packed query as B tiles
 * (16 pairs x 16 heads, the layout transpose_pairs gives), two row blocks per B tile. Weighted sum: the
 * probabilities transposed to bf16 A tiles (16 heads x 32 rows) against the chunk's value rows interleaved in
 * pairs as B tiles (16 pairs of rows x 16 dims), into C tiles loaded from and stored back to acc. */
#include "amx_tiles.h"

static int64_t amx_scratch_floats(const struct shape *sh) {
    return (AMX_CHUNK * (sh->DL + sh->DR) + sh->Hp * AMX_CHUNK + AMX_CHUNK * sh->DL) / 2;
}

static void logits_amx(const struct shape *sh, const uint16_t *kt, const uint32_t *qT, int64_t n, float *s) {
    int64_t E = sh->DL + sh->DR, Hp = sh->Hp;
    for (int64_t hb = 0; hb < Hp; hb += 16) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t p0 = 0; p0 < E / 2; p0 += 16) {
            _tile_loadd(5, qT + p0 * Hp + hb, Hp * 4);
            _tile_loadd(2, kt + 2 * p0, E * 2);
            _tile_dpbf16ps(0, 2, 5);
            if (n > 16) {
                _tile_loadd(3, kt + 16 * E + 2 * p0, E * 2);
                _tile_dpbf16ps(1, 3, 5);
            }
        }
        _tile_stored(0, s + hb, Hp * 4);
        if (n > 16) _tile_stored(1, s + 16 * Hp + hb, Hp * 4);
    }
    for (int64_t r = 0; r < n; r++)
        for (int64_t h = 0; h < Hp; h += VL) vstore(s + r * Hp + h, vload(s + r * Hp + h) * sh->scale);
}

/* vb [AMX_CHUNK/2][DL] pairs: (value row 2j, value row 2j+1) dim by dim, zero rows past n. */
static void pair_values(const struct shape *sh, const uint16_t *const *vrow, int64_t n, uint16_t *vb) {
    static const uint16_t order[32] = { 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47 };
    const __m512i interleave = _mm512_loadu_si512(order);
    for (int64_t j = 0; j < AMX_CHUNK / 2; j++) {
        uint16_t *out = vb + j * 2 * sh->DL;
        for (int64_t d = 0; d < sh->DL; d += 16) {
            __m512i e = 2 * j < n ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vrow[2 * j] + d)))
                                  : _mm512_setzero_si512();
            __m512i o = 2 * j + 1 < n
                            ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vrow[2 * j + 1] + d)))
                            : _mm512_setzero_si512();
            _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(e, interleave, o));
        }
    }
}

static void weighted_values_amx(const struct shape *sh, const float *p, const uint16_t *vb, int64_t n,
                                uint16_t *pa, float *acc) {
    int64_t Hp = sh->Hp, DL = sh->DL;
    for (int64_t h = 0; h < Hp; h++)
        for (int64_t r = 0; r < AMX_CHUNK; r++)
            pa[h * AMX_CHUNK + r] = r < n ? (uint16_t)bf16_bits(p[r * Hp + h]) : 0;
    for (int64_t h0 = 0; h0 < Hp; h0 += 16) {
        float *a = acc + h0 * sh->DLp;
        _tile_loadd(2, pa + h0 * AMX_CHUNK, AMX_CHUNK * 2);
        for (int64_t d = 0; d < DL; d += 32) {
            _tile_loadd(0, a + d, sh->DLp * 4);
            _tile_loadd(1, a + d + 16, sh->DLp * 4);
            _tile_loadd(5, vb + 2 * d, DL * 4);
            _tile_loadd(6, vb + 2 * d + 32, DL * 4);
            _tile_dpbf16ps(0, 2, 5);
            _tile_dpbf16ps(1, 2, 6);
            _tile_stored(0, a + d, sh->DLp * 4);
            _tile_stored(1, a + d + 16, sh->DLp * 4);
        }
    }
}

/* One chunk on tiles: the rows copied for the logits, online softmax step, values paired, weighted sum. amx:
 * the thread's amx_scratch_floats buffer. */
static void chunk_amx(const struct shape *sh, const struct source *src, const uint32_t *qT, const int64_t *rows,
                      int64_t n, float *s, float *m, float *l, float *acc, float *heads_tmp, float *amx) {
    int64_t E = sh->DL + sh->DR;
    uint16_t *kt = (uint16_t *)amx, *pa = kt + AMX_CHUNK * E, *vb = pa + sh->Hp * AMX_CHUNK;
    const uint16_t *vrow[AMX_CHUNK];
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *k = (const uint16_t *)(src->kv + rows[i] * src->kv_stride);
        memcpy(kt + i * E, k, (size_t)sh->DL * 2);
        if (src->rope) memcpy(kt + i * E + sh->DL, src->rope + rows[i] * src->rope_stride, (size_t)sh->DR * 2);
        vrow[i] = src->value ? (const uint16_t *)(src->value + rows[i] * src->value_stride) : k;
    }
    logits_amx(sh, kt, qT, n, s);
    softmax_step(sh, s, n, m, l, acc, heads_tmp);
    pair_values(sh, vrow, n, vb);
    weighted_values_amx(sh, s, vb, n, pa, acc);
}
#endif

static int64_t part_floats(const struct shape *sh) { return 2 * sh->Hp + sh->Hp * sh->DLp; }

/* Which rows the query tokens select: token t's entries idx[t * idx_stride + j] (j < K), each standing for
 * positions i * block ... i * block + block - 1 (i = -1: none); positions >= limit(t) are skipped, and a
 * position p is row p (BSND) or row table[p / block_size] * block_size + p % block_size (paged). */
struct selection {
    const char *idx, *table;
    int idx64, table64;     /* int64 entries (else int32) */
    int64_t idx_stride, K, block, block_size, lq, lkv;
    int causal;         /* sparse_mode 3: limit(t) = lkv - lq + t + 1, clamped to [0, lkv]; else lkv */
    int64_t start;      /* entries below it are skipped (a left-padded row's key start; block 1) */
};

/* Entry i of an int64 (is64) or int32 array. */
static inline int64_t int_at(const char *base, int is64, int64_t i) {
    return is64 ? ((const int64_t *)base)[i] : ((const int32_t *)base)[i];
}

static int64_t token_limit(const struct selection *sel, int64_t t) {
    if (!sel->causal) return sel->lkv;
    int64_t limit = sel->lkv - sel->lq + t + 1;
    return limit < 0 ? 0 : (limit > sel->lkv ? sel->lkv : limit);
}

/* A cursor over entries [j, end) of one token (position k inside entry j). */
struct cursor { const char *idx; int64_t j, k, end, limit; };

/* Up to `max` next selected row numbers from the cursor. */
static int64_t next_rows(const struct selection *sel, struct cursor *c, int64_t *rows, int64_t max) {
    int64_t n = 0;
    const int64_t last_entry = c->limit > 0 ? (c->limit - 1) / sel->block : -1;   /* entries past it see nothing */
    while (c->j < c->end && n < max) {
        const int64_t entry = int_at(c->idx, sel->idx64, c->j);
        /* entry <= last_entry keeps entry * block below limit: no overflow whatever the index or block size */
        int64_t p = entry < sel->start || entry > last_entry ? c->limit : entry * sel->block + c->k;
        if (p >= c->limit) {
            c->j++;
            c->k = 0;
            continue;
        }
        rows[n++] = sel->table ? int_at(sel->table, sel->table64, p / sel->block_size) * sel->block_size
                                     + p % sel->block_size
                               : p;
        if (++c->k == sel->block) {
            c->j++;
            c->k = 0;
        }
    }
    return n;
}

/* Folds the rows the cursor selects into a part: m [Hp], l [Hp], acc [Hp][DLp]. 0 on no memory. */
static int attend_part(const struct shape *sh, const struct source *src, const float *qT, const float *qrT,
                       const struct selection *sel, struct cursor cur, float *part) {
    int64_t Hp = sh->Hp, DLp = sh->DLp;
    float *m = part, *l = part + Hp, *acc = part + 2 * Hp;
    size_t own = (size_t)CHUNK * (2 * DLp + sh->DRp + Hp + 4) + 3 * (size_t)Hp;
#ifdef AMX_TILES
    size_t tiles = sh->amx ? (size_t)amx_scratch_floats(sh) : 0;
#else
    size_t tiles = 0;
#endif
    float *buf = scratch(0, own + tiles);
    if (!buf) return 0;
    float *kbuf = buf, *vbuf = kbuf + CHUNK * DLp, *rbuf = vbuf + CHUNK * DLp, *s = rbuf + CHUNK * sh->DRp;
    int64_t *chunk = (int64_t *)(s + CHUNK * Hp), *next = chunk + CHUNK;
    float *heads_tmp = (float *)(next + CHUNK);
    for (int64_t h = 0; h < Hp; h++) { m[h] = -INFINITY; l[h] = 0.0f; }
    memset(acc, 0, Hp * DLp * sizeof(float));
    int64_t most = sh->amx ? AMX_CHUNK : CHUNK, n = next_rows(sel, &cur, chunk, most);
#ifdef AMX_TILES
    if (sh->amx) amx_configure();
#endif
    while (n > 0) {
        int64_t n_next = next_rows(sel, &cur, next, most);
        prefetch_chunk(sh, src, next, n_next);
#ifdef AMX_TILES
        if (sh->amx) {
            chunk_amx(sh, src, (const uint32_t *)qT, chunk, n, s, m, l, acc, heads_tmp, buf + own);
        } else
#endif
#ifdef __AVX512BF16__
        if (sh->bf16) {
            chunk_bf16(sh, src, (const uint32_t *)qT, chunk, n, s, (uint32_t *)kbuf, m, l, acc, heads_tmp);
        } else
#endif
        {
            chunk_f32(sh, src, qT, qrT, chunk, n, kbuf, rbuf, vbuf, s, m, l, acc, heads_tmp);
        }
        memcpy(chunk, next, n_next * sizeof(int64_t));
        n = n_next;
    }
#ifdef AMX_TILES
    if (sh->amx) _tile_release();
#endif
    return 1;
}

/* scale * x [H][D] -> xT [Dp][Hp], zero padded. */
static void transpose_pad(const float *x, int64_t H, int64_t D, int64_t Hp, int64_t Dp, float scale, float *xT) {
    memset(xT, 0, Dp * Hp * sizeof(float));
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++) xT[d * Hp + h] = x[h * D + d] * scale;
}

/* bf16 mode: x [H][D] (bf16 values) -> xT [D/2][Hp], each entry the bf16 pair of dims 2d, 2d+1. */
static void transpose_pairs(const float *x, int64_t H, int64_t D, int64_t Hp, uint32_t *xT) {
    memset(xT, 0, D / 2 * Hp * sizeof(uint32_t));
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D / 2; d++) {
            union { float f; uint32_t u; } lo = { .f = x[h * D + 2 * d] }, hi = { .f = x[h * D + 2 * d + 1] };
            xT[d * Hp + h] = (lo.u >> 16) | (hi.u & 0xFFFF0000u);
        }
}

/* The transposed query of token t in this thread's slot 2: qT [DLp][Hp], then qrT [DRp][Hp] (bf16 mode: the
 * pairs, [DL/2][Hp] then [DR/2][Hp]). */
static float *query_T(const struct shape *sh, const float *q, const float *q_rope, int64_t t) {
    float *qT = scratch(2, (size_t)(sh->DLp + sh->DRp) * sh->Hp);
    if (!qT) return NULL;
    const float *qt = q + t * sh->H * sh->DL, *qrt = q_rope ? q_rope + t * sh->H * sh->DR : NULL;
    if (sh->bf16) {
        transpose_pairs(qt, sh->H, sh->DL, sh->Hp, (uint32_t *)qT);
        if (qrt) transpose_pairs(qrt, sh->H, sh->DR, sh->Hp, (uint32_t *)qT + sh->DL / 2 * sh->Hp);
        return qT;
    }
    transpose_pad(qt, sh->H, sh->DL, sh->Hp, sh->DLp, sh->scale, qT);
    if (qrt) transpose_pad(qrt, sh->H, sh->DR, sh->Hp, sh->DRp, sh->scale, qT + sh->DLp * sh->Hp);
    return qT;
}

/* Merges `parts` parts (part_floats apart) into heads [h0, h1) of one token's out [H][DL], smax, ssum. */
static void finish(const struct shape *sh, const float *parts, int nparts, int64_t h0, int64_t h1, float *out,
                   float *smax, float *ssum) {
    int64_t pf = part_floats(sh);
    for (int64_t h = h0; h < h1; h++) {
        float mx = -INFINITY, sum = 0.0f, w[nparts];
        for (int p = 0; p < nparts; p++) mx = nan_max(mx, parts[p * pf + h]);
        for (int p = 0; p < nparts; p++) {
            float mp = parts[p * pf + h];
            w[p] = mp == -INFINITY ? 0.0f : exp_neg(mp - mx);
            sum += parts[p * pf + sh->Hp + h] * w[p];
        }
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f, *o = out + h * sh->DL;
        if (mx != mx || mx == INFINITY || mx == -INFINITY) {    /* non-finite logits (the op's docstring) */
            float fill = mx == -INFINITY ? 0.0f : NAN;
            smax[h] = mx == -INFINITY ? mx : NAN;
            ssum[h] = fill;
            for (int64_t d = 0; d < sh->DL; d++) o[d] = fill;
            continue;
        }
        smax[h] = mx;
        ssum[h] = sum;
        for (int64_t d = 0; d < sh->DL; d++) o[d] = 0.0f;
        for (int p = 0; p < nparts; p++) {
            const float *a = parts + p * pf + 2 * sh->Hp + h * sh->DLp;
            float wp = w[p] * inv;
#pragma omp simd
            for (int64_t d = 0; d < sh->DL; d++) o[d] += a[d] * wp;
        }
    }
}

static struct cursor token_cursor(const struct selection *sel, int64_t t, int64_t lo, int64_t hi) {
    struct cursor c = { sel->idx + t * sel->idx_stride * (sel->idx64 ? 8 : 4), lo, 0, hi, token_limit(sel, t) };
    return c;
}

/* One thread per token. Returns 0 when scratch memory could not be allocated. */
static int attend_tokens(const struct shape *sh, const struct source *src, const struct selection *sel,
                         const float *q, const float *q_rope, int threads, float *out, float *smax, float *ssum) {
    int ok = 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(&& : ok) \
    if (sel->lq * sel->K * sh->Hp * (sh->DLp + sh->DRp) >= PARALLEL_MIN_MACS)
    for (int64_t t = 0; t < sel->lq; t++) {
        float *qT = query_T(sh, q, q_rope, t), *part = scratch(1, part_floats(sh));
        if (!qT || !part
            || !attend_part(sh, src, qT, qT + sh->DLp * sh->Hp, sel, token_cursor(sel, t, 0, sel->K), part)) {
            ok = 0;
            continue;
        }
        finish(sh, part, 1, 0, sh->H, out + t * sh->H * sh->DL, smax + t * sh->H, ssum + t * sh->H);
    }
    return ok;
}

/* The merge of attend_split's parts shared by the team: thread tid of n takes its stretch of the lq x H (token,
 * head) pairs. One thread merging every part read all of them from the other cores' caches (16 threads: 16 parts
 * of Hp x DLp floats per token). */
static void finish_share(const struct shape *sh, const float *parts, int n, int tid, int64_t lq, float *out,
                         float *smax, float *ssum) {
    int64_t pf = part_floats(sh), pairs = lq * sh->H;
    for (int64_t u = pairs * tid / n; u < pairs * (tid + 1) / n; u++) {
        int64_t t = u / sh->H, h = u % sh->H;
        finish(sh, parts + t * n * pf, n, h, h + 1, out + t * sh->H * sh->DL, smax + t * sh->H, ssum + t * sh->H);
    }
}

/* Each token's entries split across the threads (lq < threads), one part per token and thread, merged by the
 * team after a barrier (finish_share). */
static int attend_split(const struct shape *sh, const struct source *src, const struct selection *sel,
                        const float *q, const float *q_rope, int threads, float *out, float *smax, float *ssum) {
    int failed = 0;
    int64_t pf = part_floats(sh), K = sel->K;
    float *parts = scratch(1, (size_t)(sel->lq * threads) * pf);
    if (!parts) return 0;
#pragma omp parallel num_threads(threads)
    {
        int tid = omp_get_thread_num(), n = omp_get_num_threads(), ok = 1;
        for (int64_t t = 0; t < sel->lq && ok; t++) {
            float *qT = query_T(sh, q, q_rope, t);
            struct cursor cur = token_cursor(sel, t, K * tid / n, K * (tid + 1) / n);
            ok = qT && attend_part(sh, src, qT, qT + sh->DLp * sh->Hp, sel, cur, parts + (t * n + tid) * pf);
        }
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int stop;
#pragma omp atomic read
        stop = failed;
        if (!stop) finish_share(sh, parts, n, tid, sel->lq, out, smax, ssum);
    }
    return !failed;
}

/* Entry point, for the first lq query tokens of one batch. q [lq][H][DL] and q_rope [lq][H][DR] (or NULL)
 * fp32, without scale; the selection as in struct selection (idx and table int64, or int32 where idx64 / table64
 * is 0; table NULL for BSND KV); row strides in
 * elements; value NULL when the kv rows are the values, rope NULL without rope. Outputs out [lq][H][DL],
 * smax [lq][H], ssum [lq][H] fp32. A token's entries are split across the `threads` threads when
 * lq < threads and K * block >= split_rows. bf16_dot asks for the AVX512-BF16 mode (q holding bf16 values,
 * bf16 output): taken when built with it, the rows are bf16, DL is a multiple of 16 and DR even.
 * Entries below `start` are skipped (a left-padded row: its keys begin there; block 1).
 * Returns 1, or 0 when scratch memory could not be allocated. */
int sfa_attend(const float *q, const float *q_rope, int64_t H, int64_t DL, int64_t DR, const void *idx, int idx64,
               int64_t idx_stride, int64_t K, int64_t block, int64_t lq, int64_t lkv, int causal, int64_t start,
               const void *table, int table64, int64_t block_size, const void *kv, int64_t kv_stride, const void *value,
               int64_t value_stride, const void *rope, int64_t rope_stride, int kv_dtype, int rope_dtype,
               float scale, int bf16_dot, int threads, int64_t split_rows, float *out, float *smax, float *ssum) {
    DR = rope ? DR : 0;
    int bf16 = sfa_has_bf16_dot() && bf16_dot && kv_dtype == BF16 && DL % VL == 0 && DR % 2 == 0
               && (!rope || rope_dtype == BF16);
    int64_t Hp = round_up(H, VL);
    struct shape sh = { H, Hp, DL, round_up(DL, VL), DR, round_up(DR, VL), VL > 8 && H <= 8 && !bf16 ? 8 : Hp, scale,
                          bf16, sfa_has_amx() && bf16 && DL % 32 == 0 && (DL + DR) % 32 == 0 };
    struct source src = { kv, value, rope, kv_stride * elem_size(kv_dtype), value_stride * elem_size(kv_dtype),
                          rope_stride * elem_size(rope_dtype), kv_dtype, rope_dtype };
    struct selection sel = { idx, table, idx64, table64, idx_stride, K, block, block_size, lq, lkv, causal, start };
    threads = threads < 1 ? 1 : threads;
    if (lq < threads && K * block >= split_rows)
        return attend_split(&sh, &src, &sel, q, q_rope, threads, out, smax, ssum);
    return attend_tokens(&sh, &src, &sel, q, q_rope, threads, out, smax, ssum);
}

/* What a plan (kernels/sparse_attention/plan.py) fixes for every call of one signature: sizes, strides in elements, dtypes.
 * q and q_rope (of q_dtype: F32, BF16 or F16, both) have each batch's rows contiguous, and the output is of
 * q_dtype too (bf16 ones ask sfa_attend for its bf16 dot products); sparse_indices [B][S1][1][K], the lengths [B]
 * and the block table [B][table_row] are int32 or int64 (the *64 flags). */
struct sfa_call_args {
    int64_t batch, s1, H, DL, DR, K, block, block_size, num_blocks;
    int64_t q_batch, qr_batch, idx_batch, idx_token, table_row, kv_stride, value_stride, rope_stride, split_rows;
    int idx64, table64, lq64, lkv64, causal, kv_dtype, rope_dtype, q_dtype;
};

enum { SFA_OK = 0, SFA_NO_MEMORY = 1, SFA_BAD_QUERY_LENGTH = 2, SFA_BAD_KV_LENGTH = 3, SFA_BAD_INDEX = 4,
       SFA_BAD_BLOCK_TABLE = 5, SFA_PADDED_BLOCKS = 6 };

/* The data checks of a call (kernels/sparse_attention/checks.check_data, kernels/indexer/checks.sequence_lengths): each batch's
 * lengths within [0, S1] and [0, capacity], the block-table entries of its used blocks within [0, num_blocks),
 * every index entry >= -1. The lengths go to lq and lkv. */
static int check_call(const struct sfa_call_args *a, const char *idx, const char *table, const char *lq_len,
                      const char *lkv_len, int64_t capacity, int64_t *lq, int64_t *lkv) {
    for (int64_t b = 0; b < a->batch; b++) {
        lq[b] = lq_len ? int_at(lq_len, a->lq64, b) : a->s1;
        lkv[b] = lkv_len ? int_at(lkv_len, a->lkv64, b) : capacity;
        if (lq[b] < 0 || lq[b] > a->s1) return SFA_BAD_QUERY_LENGTH;
        if (lkv[b] < 0 || lkv[b] > capacity) return SFA_BAD_KV_LENGTH;
        for (int64_t i = 0; table && i < (lkv[b] + a->block_size - 1) / a->block_size; i++) {
            int64_t block = int_at(table, a->table64, b * a->table_row + i);
            if (block < 0 || block >= a->num_blocks) return SFA_BAD_BLOCK_TABLE;
        }
    }
    for (int64_t i = 0; i < a->batch * a->s1 * a->K; i++)
        if (int_at(idx, a->idx64, i) < -1) return SFA_BAD_INDEX;
    return SFA_OK;
}

/* The n values of a query at x + offset elements (of type dtype) as fp32: x itself for F32, else widened into the
 * calling thread's scratch slot (NULL when it cannot be allocated). */
static const float *query_f32(const void *x, int dtype, int64_t offset, int64_t n, int slot) {
    if (dtype == F32) return (const float *)x + offset;
    float *f = scratch(slot, (size_t)n);
    if (f) row_to_f32(f, (const char *)x + offset * 2, dtype, n);
    return f;
}

/* One whole call of the op over every batch (the plan's entry): check_call, then sfa_attend per batch; tokens past
 * a batch's query length get out 0, smax -inf, ssum 0 (the outputs need no filling before). q and q_rope are
 * read and out is written as a->q_dtype (16-bit queries widened to fp32 here, a batch at a time; a 16-bit output
 * rounded to nearest even from the fp32 result). starts (int32 or int64 [B], starts64; or NULL): each batch's key
 * start, entries below it skipped (kernels/indexer/key_windows.py; only with block 1, else SFA_PADDED_BLOCKS for a start
 * > 0, which the caller refuses). capacity: positions of the KV (rows of a BSND cache, blocks x block size of a
 * paged one); kv_batch, value_batch, rope_batch: elements between batches (0 when paged). Returns SFA_OK or the
 * first failed check's code (SFA_NO_MEMORY: the scratch memory could not be allocated, the outputs of some batch
 * are not written). */
int sfa_call(const struct sfa_call_args *a, const void *q, const void *q_rope, const void *idx, const void *table,
             const void *lq_len, const void *lkv_len, const void *starts, int starts64, int64_t capacity,
             const void *kv, int64_t kv_batch,
             const void *value, int64_t value_batch, const void *rope, int64_t rope_batch, float scale, int threads,
             void *out, float *smax, float *ssum) {
    int64_t lq[a->batch], lkv[a->batch], start[a->batch];
    int status = check_call(a, idx, table, lq_len, lkv_len, capacity, lq, lkv);
    if (status != SFA_OK) return status;
    for (int64_t b = 0; b < a->batch; b++) {
        start[b] = starts ? int_at(starts, starts64, b) : 0;
        if (start[b] != 0 && a->block != 1) return SFA_PADDED_BLOCKS;
    }
    int64_t kv_item = elem_size(a->kv_dtype), rope_item = elem_size(a->rope_dtype), out_item = elem_size(a->q_dtype);
    int64_t DR = rope ? a->DR : 0, idx_item = a->idx64 ? 8 : 4, table_item = a->table64 ? 8 : 4, row = a->H * a->DL;
    for (int64_t b = 0; b < a->batch; b++) {
        char *ob = (char *)out + b * a->s1 * row * out_item;
        float *mx = smax + b * a->s1 * a->H, *sm = ssum + b * a->s1 * a->H;
        const float *qb = query_f32(q, a->q_dtype, b * a->q_batch, lq[b] * row, 3);
        const float *qrb = q_rope && DR ? query_f32(q_rope, a->q_dtype, b * a->qr_batch, lq[b] * a->H * DR, 4)
                                        : NULL;
        float *o = a->q_dtype == F32 ? (float *)ob : scratch(5, (size_t)(lq[b] * row));
        if (lq[b] > 0
            && (!qb || (q_rope && DR && !qrb) || !o
                || !sfa_attend(qb, qrb, a->H, a->DL, DR, (const char *)idx + b * a->idx_batch * idx_item, a->idx64,
                               a->idx_token, a->K, a->block, lq[b], lkv[b], a->causal, start[b],
                               table ? (const char *)table + b * a->table_row * table_item : NULL, a->table64,
                               a->block_size, (const char *)kv + b * kv_batch * kv_item, a->kv_stride,
                               value ? (const char *)value + b * value_batch * kv_item : NULL, a->value_stride,
                               rope ? (const char *)rope + b * rope_batch * rope_item : NULL, a->rope_stride,
                               a->kv_dtype, a->rope_dtype, scale, a->q_dtype == BF16, threads, a->split_rows, o, mx,
                               sm)))
            return SFA_NO_MEMORY;
        if (a->q_dtype != F32) row_from_f32(ob, a->q_dtype, o, lq[b] * row);
        memset(ob + lq[b] * row * out_item, 0, (size_t)((a->s1 - lq[b]) * row * out_item));
        memset(sm + lq[b] * a->H, 0, (size_t)((a->s1 - lq[b]) * a->H) * sizeof(float));
        for (int64_t i = lq[b] * a->H; i < a->s1 * a->H; i++) mx[i] = -INFINITY;
    }
    return SFA_OK;
}

/* The fp8 rows of a decode step, for sfa_attend to read as fp32: row slots[i] of float8_e4m3fn codes (at
 * codes + slots[i] * stride bytes) decoded into out[i] (d floats, contiguous), each of its `tiles` tiles of d / tiles
 * values times its fp32 scale (at scales + slots[i] * scale_stride + tile). Exact (e4m3_vec) up to the one fp32
 * product, as the torch path's dequantization. Rows go across `threads` OpenMP threads. */
void sfa_gather_e4m3(const uint8_t *codes, int64_t stride, const float *scales, int64_t scale_stride, int64_t tiles,
                     const int64_t *slots, int64_t n, int64_t d, float *out, int threads) {
    int64_t tile = d / tiles;
#pragma omp parallel for num_threads(threads) schedule(static) if (n * d >= (1 << 16))
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = codes + slots[i] * stride;
        const float *sc = scales + slots[i] * scale_stride;
        float *dst = out + i * d;
        for (int64_t t = 0; t < tiles; t++) {
            vf f = splat(sc[t]);
            int64_t j = t * tile, end = j + tile;
            for (; j + VL <= end; j += VL) vstore(dst + j, e4m3_vec(row + j, f));
            if (j < end) {    /* a tile's last values, fewer than VL: decoded from a zero-padded copy */
                uint8_t tail[VL] = {0};
                float wide[VL];
                memcpy(tail, row + j, (size_t)(end - j));
                vstore(wide, e4m3_vec(tail, f));
                memcpy(dst + j, wide, (size_t)(end - j) * sizeof(float));
            }
        }
    }
}
