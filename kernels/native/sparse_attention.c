/* Sparse flash attention on CPU for ascend_dsa::sparse_flash_attention (kernels/sparse_flash_attention.py);
 * kernels/native.py builds and loads this file. Plain C (GCC vector extensions), no torch headers.
 *
 * For every query token t of one batch row: over the KV rows listed in rows[t][0..M) (-1 = skipped),
 *   logit[r] = q[t,h] . kv[r] + q_rope[t,h] . rope[r]           (q already multiplied by scale_value)
 *   out[t,h] = sum_r softmax(logit)[r] * value[r],  smax[t,h] = max logit,  ssum[t,h] = sum exp(logit - smax)
 * in fp32. Each selected row is read once: a chunk of CHUNK rows is converted to fp32 into a per-thread buffer,
 * scored for all heads, and folded into a running (max, sum, out) with an online softmax. A token's rows are
 * split across the OpenMP threads when there are fewer tokens than threads; the partial results are merged.
 * Heads are padded to a multiple of 16 and head dims to a multiple of 16 in the buffers (zeros), so that the
 * micro-kernels work on whole vectors: logits hold 16 heads of one row per vector (query transposed), the
 * weighted sum 16 heads x 16 dims in registers over the chunk's rows.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VL 16          /* fp32 lanes of one vector */
#define CHUNK 32       /* rows converted and scored together */
#define RB 8           /* rows per logit micro-kernel */

enum { F32 = 0, BF16 = 1, F16 = 2 };

typedef float vf __attribute__((vector_size(VL * sizeof(float))));

int sfa_has_f16(void) {
#ifdef __FLT16_MANT_DIG__
    return 1;
#else
    return 0;
#endif
}

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Per-thread scratch slots, grown on demand and kept across calls (OpenMP threads persist):
 * 0 chunk buffers, 1 running state of the parts, 2 transposed query. */
static __thread struct { float *p; size_t cap; } slots[3];

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
    if (dtype == BF16) {
        const uint16_t *restrict s = src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            union { uint32_t u; float f; } c = { .u = (uint32_t)s[i] << 16 };
            dst[i] = c.f;
        }
    } else if (dtype == F16) {
#ifdef __FLT16_MANT_DIG__
        const _Float16 *restrict s = src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
#endif
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
    for (int64_t i = n; i < n_pad; i++) dst[i] = 0.0f;
}

static int elem_size(int dtype) { return dtype == F32 ? 4 : 2; }

static void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 0);
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
    union { int32_t i; float f; } s = { .i = (n.i - 0x4B400000 + 127) << 23 };
    return p * s.f;
}

struct shape { int64_t H, Hp, DL, DLp, DR, DRp; };

struct source {
    const char *kv, *value, *rope;       /* value NULL: the kv rows are the values */
    int64_t kv_stride, value_stride, rope_stride;   /* bytes between rows */
    int kv_dtype, rope_dtype;
};

/* s[r][Hp] = kbuf[r] . qT + rbuf[r] . qrT for r < n (rows padded to RB; extra rows give unused logits). */
static void logits(const struct shape *sh, const float *kbuf, const float *rbuf, const float *qT,
                   const float *qrT, int64_t n, float *s) {
    for (int64_t hb = 0; hb < sh->Hp; hb += VL) {
        for (int64_t r0 = 0; r0 < n; r0 += RB) {
            vf acc[RB] = {0};
            const float *k0 = kbuf + r0 * sh->DLp;
            for (int64_t d = 0; d < sh->DLp; d++) {
                vf qv = *(const vf *)(qT + d * sh->Hp + hb);
#pragma GCC unroll 8
                for (int i = 0; i < RB; i++) acc[i] += k0[i * sh->DLp + d] * qv;
            }
            if (rbuf) {
                const float *r0p = rbuf + r0 * sh->DRp;
                for (int64_t d = 0; d < sh->DRp; d++) {
                    vf qv = *(const vf *)(qrT + d * sh->Hp + hb);
#pragma GCC unroll 8
                    for (int i = 0; i < RB; i++) acc[i] += r0p[i * sh->DRp + d] * qv;
                }
            }
#pragma GCC unroll 8
            for (int i = 0; i < RB; i++) *(vf *)(s + (r0 + i) * sh->Hp + hb) = acc[i];
        }
    }
}

/* acc[h][DLp] += sum_{r<n} p[r][h] * vbuf[r] for all Hp heads, 16 heads x 16 lanes in registers. */
static void weighted_values(const struct shape *sh, const float *p, const float *vbuf, int64_t n, float *acc) {
    for (int64_t h0 = 0; h0 < sh->Hp; h0 += VL) {
        for (int64_t d = 0; d < sh->DLp; d += VL) {
            vf a[VL];
#pragma GCC unroll 16
            for (int i = 0; i < VL; i++) a[i] = *(vf *)(acc + (h0 + i) * sh->DLp + d);
            for (int64_t r = 0; r < n; r++) {
                vf v = *(const vf *)(vbuf + r * sh->DLp + d);
                const float *pr = p + r * sh->Hp + h0;
#pragma GCC unroll 16
                for (int i = 0; i < VL; i++) a[i] += pr[i] * v;
            }
#pragma GCC unroll 16
            for (int i = 0; i < VL; i++) *(vf *)(acc + (h0 + i) * sh->DLp + d) = a[i];
        }
    }
}

/* Online softmax step: s[r][h] (r < n) become exp(s - m_new); m, l and acc are rescaled to the new max. */
static void softmax_step(const struct shape *sh, float *s, int64_t n, float *m, float *l, float *acc) {
    int64_t Hp = sh->Hp;
    float mc[Hp], corr[Hp], sum[Hp];
    for (int64_t h = 0; h < Hp; h++) mc[h] = m[h];
    for (int64_t r = 0; r < n; r++)
#pragma omp simd
        for (int64_t h = 0; h < Hp; h++) mc[h] = s[r * Hp + h] > mc[h] ? s[r * Hp + h] : mc[h];
    int rescale = 0;
    for (int64_t h = 0; h < Hp; h++) {
        corr[h] = m[h] == mc[h] ? 1.0f : exp_neg(m[h] - mc[h]);
        rescale |= corr[h] != 1.0f && l[h] != 0.0f;
        m[h] = mc[h];
        sum[h] = 0.0f;
    }
    for (int64_t r = 0; r < n; r++)
#pragma omp simd
        for (int64_t h = 0; h < Hp; h++) {
            float e = exp_neg(s[r * Hp + h] - mc[h]);
            s[r * Hp + h] = e;
            sum[h] += e;
        }
    for (int64_t h = 0; h < Hp; h++) l[h] = l[h] * corr[h] + sum[h];
    if (rescale)
        for (int64_t h = 0; h < Hp; h++)
#pragma omp simd
            for (int64_t d = 0; d < sh->DLp; d++) acc[h * sh->DLp + d] *= corr[h];
}

/* Converts the chunk's rows into kbuf (and rbuf, vbuf) and prefetches the next chunk's rows. */
static void load_chunk(const struct shape *sh, const struct source *src, const int64_t *rows, int64_t n,
                       const int64_t *next, int64_t n_next, float *kbuf, float *rbuf, float *vbuf) {
    int64_t kv_bytes = sh->DL * elem_size(src->kv_dtype), rope_bytes = sh->DR * elem_size(src->rope_dtype);
    for (int64_t i = 0; i < n_next; i++) {
        prefetch_row(src->kv + next[i] * src->kv_stride, kv_bytes);
        if (src->rope) prefetch_row(src->rope + next[i] * src->rope_stride, rope_bytes);
        if (src->value) prefetch_row(src->value + next[i] * src->value_stride, kv_bytes);
    }
    for (int64_t i = 0; i < n; i++) {
        to_f32(kbuf + i * sh->DLp, src->kv + rows[i] * src->kv_stride, src->kv_dtype, sh->DL, sh->DLp);
        if (src->rope)
            to_f32(rbuf + i * sh->DRp, src->rope + rows[i] * src->rope_stride, src->rope_dtype, sh->DR, sh->DRp);
        if (src->value)
            to_f32(vbuf + i * sh->DLp, src->value + rows[i] * src->value_stride, src->kv_dtype, sh->DL, sh->DLp);
    }
}

static int64_t part_floats(const struct shape *sh) { return 2 * sh->Hp + sh->Hp * sh->DLp; }

/* Folds the rows rows[0..count) (-1 skipped) into a part: m [Hp], l [Hp], acc [Hp][DLp]. 0 on no memory. */
static int attend_part(const struct shape *sh, const struct source *src, const float *qT, const float *qrT,
                       const int64_t *rows, int64_t count, float *part) {
    int64_t Hp = sh->Hp, DLp = sh->DLp;
    float *m = part, *l = part + Hp, *acc = part + 2 * Hp;
    float *buf = scratch(0, (size_t)CHUNK * (2 * DLp + sh->DRp + Hp + 4));
    if (!buf) return 0;
    float *kbuf = buf, *vbuf = kbuf + CHUNK * DLp, *rbuf = vbuf + CHUNK * DLp, *s = rbuf + CHUNK * sh->DRp;
    int64_t *chunk = (int64_t *)(s + CHUNK * Hp), *next = chunk + CHUNK;
    for (int64_t h = 0; h < Hp; h++) { m[h] = -INFINITY; l[h] = 0.0f; }
    memset(acc, 0, Hp * DLp * sizeof(float));
    int64_t j = 0, n = 0;
    while (j < count && n < CHUNK) { if (rows[j] >= 0) chunk[n++] = rows[j]; j++; }
    while (n > 0) {
        int64_t n_next = 0;
        while (j < count && n_next < CHUNK) { if (rows[j] >= 0) next[n_next++] = rows[j]; j++; }
        load_chunk(sh, src, chunk, n, next, n_next, kbuf, rbuf, src->value ? vbuf : NULL);
        logits(sh, kbuf, src->rope ? rbuf : NULL, qT, qrT, n, s);
        softmax_step(sh, s, n, m, l, acc);
        weighted_values(sh, s, src->value ? vbuf : kbuf, n, acc);
        memcpy(chunk, next, n_next * sizeof(int64_t));
        n = n_next;
    }
    return 1;
}

/* x [H][D] -> xT [Dp][Hp], zero padded. */
static void transpose_pad(const float *x, int64_t H, int64_t D, int64_t Hp, int64_t Dp, float *xT) {
    memset(xT, 0, Dp * Hp * sizeof(float));
    for (int64_t h = 0; h < H; h++)
        for (int64_t d = 0; d < D; d++) xT[d * Hp + h] = x[h * D + d];
}

/* The transposed query of token t in this thread's slot 2: qT [DLp][Hp], then qrT [DRp][Hp]. */
static float *query_T(const struct shape *sh, const float *q, const float *q_rope, int64_t t) {
    float *qT = scratch(2, (size_t)(sh->DLp + sh->DRp) * sh->Hp);
    if (!qT) return NULL;
    transpose_pad(q + t * sh->H * sh->DL, sh->H, sh->DL, sh->Hp, sh->DLp, qT);
    if (q_rope) transpose_pad(q_rope + t * sh->H * sh->DR, sh->H, sh->DR, sh->Hp, sh->DRp, qT + sh->DLp * sh->Hp);
    return qT;
}

/* Merges `parts` parts (part_floats apart) into heads [h0, h1) of one token's out [H][DL], smax, ssum. */
static void finish(const struct shape *sh, const float *parts, int nparts, int64_t h0, int64_t h1, float *out,
                   float *smax, float *ssum) {
    int64_t pf = part_floats(sh);
    for (int64_t h = h0; h < h1; h++) {
        float mx = -INFINITY, sum = 0.0f, w[nparts];
        for (int p = 0; p < nparts; p++) mx = parts[p * pf + h] > mx ? parts[p * pf + h] : mx;
        for (int p = 0; p < nparts; p++) {
            float mp = parts[p * pf + h];
            w[p] = mp == -INFINITY ? 0.0f : exp_neg(mp - mx);
            sum += parts[p * pf + sh->Hp + h] * w[p];
        }
        smax[h] = mx;
        ssum[h] = sum;
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f, *o = out + h * sh->DL;
        for (int64_t d = 0; d < sh->DL; d++) o[d] = 0.0f;
        for (int p = 0; p < nparts; p++) {
            const float *a = parts + p * pf + 2 * sh->Hp + h * sh->DLp;
            float wp = w[p] * inv;
#pragma omp simd
            for (int64_t d = 0; d < sh->DL; d++) o[d] += a[d] * wp;
        }
    }
}

/* One thread per token. Returns 0 when scratch memory could not be allocated. */
static int attend_tokens(const struct shape *sh, const struct source *src, const float *q, const float *q_rope,
                         const int64_t *rows, int64_t T, int64_t M, int threads, float *out, float *smax,
                         float *ssum) {
    int ok = 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(&& : ok)
    for (int64_t t = 0; t < T; t++) {
        float *qT = query_T(sh, q, q_rope, t), *part = scratch(1, part_floats(sh));
        if (!qT || !part || !attend_part(sh, src, qT, qT + sh->DLp * sh->Hp, rows + t * M, M, part)) {
            ok = 0;
            continue;
        }
        finish(sh, part, 1, 0, sh->H, out + t * sh->H * sh->DL, smax + t * sh->H, ssum + t * sh->H);
    }
    return ok;
}

/* Each token's rows split across the threads, the parts merged. */
static int attend_split(const struct shape *sh, const struct source *src, const float *q, const float *q_rope,
                        const int64_t *rows, int64_t T, int64_t M, int threads, float *out, float *smax,
                        float *ssum) {
    int ok = 1;
    int64_t pf = part_floats(sh);
    float *parts = scratch(1, (size_t)threads * pf);
    if (!parts) return 0;
#pragma omp parallel num_threads(threads) reduction(&& : ok)
    {
        int tid = omp_get_thread_num(), n = omp_get_num_threads();
        for (int64_t t = 0; t < T; t++) {
            float *qT = query_T(sh, q, q_rope, t);
            int64_t lo = M * tid / n, hi = M * (tid + 1) / n;
            ok = ok && qT && attend_part(sh, src, qT, qT + sh->DLp * sh->Hp, rows + t * M + lo, hi - lo,
                                         parts + tid * pf);
#pragma omp barrier
            int64_t h0 = sh->H * tid / n, h1 = sh->H * (tid + 1) / n;
            finish(sh, parts, n, h0, h1, out + t * sh->H * sh->DL, smax + t * sh->H, ssum + t * sh->H);
#pragma omp barrier
        }
    }
    return ok;
}

/* Entry point. q [T][H][DL] and q_rope [T][H][DR] (or NULL) fp32, scale included; rows [T][M] row numbers
 * of kv (and value, rope) with -1 for skipped entries; row strides in elements; value NULL when the kv rows
 * are the values, rope NULL without rope. Outputs out [T][H][DL], smax [T][H], ssum [T][H] fp32. A token's
 * rows are split across the `threads` threads when T < threads and M >= split_rows.
 * Returns 1, or 0 when scratch memory could not be allocated. */
int sfa_attend(const float *q, const float *q_rope, const int64_t *rows, int64_t T, int64_t M, int64_t H,
               int64_t DL, int64_t DR, const void *kv, int64_t kv_stride, const void *value, int64_t value_stride,
               const void *rope, int64_t rope_stride, int kv_dtype, int rope_dtype, int threads,
               int64_t split_rows, float *out, float *smax, float *ssum) {
    struct shape sh = { H, round_up(H, VL), DL, round_up(DL, VL), rope ? DR : 0, rope ? round_up(DR, VL) : 0 };
    struct source src = { kv, value, rope, kv_stride * elem_size(kv_dtype), value_stride * elem_size(kv_dtype),
                          rope_stride * elem_size(rope_dtype), kv_dtype, rope_dtype };
    threads = threads < 1 ? 1 : threads;
    if (T < threads && M >= split_rows)
        return attend_split(&sh, &src, q, q_rope, rows, T, M, threads, out, smax, ssum);
    return attend_tokens(&sh, &src, q, q_rope, rows, T, M, threads, out, smax, ssum);
}
