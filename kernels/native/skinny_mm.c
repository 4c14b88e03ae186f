/* y = x @ w and y = x @ w^T for a few rows of x (decode-sized linear layers), fp32, for kernels/aten/skinny_mm.py;
 * kernels/native/loader.py builds and loads this file. Plain C, no torch headers.
 *
 * sm_mm: x [M][K] (row stride ldx), w [K][N] (row stride ldw, rows contiguous), y [M][N] contiguous. At decode a
 * linear layer reads its whole weight matrix for one row of x, so its time is the time to stream w from
 * memory: each OpenMP thread streams a contiguous range of w's rows (what hardware prefetchers follow best)
 * into its own partial [M][N] in cache, and the partials are summed after a barrier, the threads splitting
 * the columns. sm_mm_nt: w [N][K] (an nn.Linear weight as stored): each thread streams a contiguous range of
 * w's rows, one dot product per row and row of x. fp32 sums in a different order than a BLAS gemm: results
 * agree to fp32 rounding.
 *
 * sm_gemv_bf16: the bf16 products, batched (B independent products: aten.bmm; B = 1: aten.mm), fp32 sums,
 * bf16 results rounded to nearest even (as torch rounds its fp32 sums). The output columns of all batches,
 * B * N of them, are split across the OpenMP threads in contiguous shares, so each thread streams its own part of
 * the weights. A weight is read in either layout, whichever has unit stride:
 * - rows along k (w_k == 1: an [N, K] weight as stored, which the graph passes to mm as its transposed view):
 *   one dot product per output, BF16_DOT_ROWS weight rows at a time (x read once for them); at the avx512_bf16
 *   level by vdpbf16ps on the stored values (pairs of products exact, summed in fp32; the tail of k by a masked
 *   load), elsewhere each vector of bf16 widened by a 16-bit shift and summed by fused multiply-adds;
 * - rows along n (w_n == 1: a [K, N] weight): each thread's columns in blocks of COL_BLOCK, whose fp32 sums stay
 *   in cache while k runs over the weight rows, ROW_UNROLL rows per pass.
 */
#include <omp.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define ROW_UNROLL 4   /* weight rows folded into the partial sums per pass over them (a quarter of the traffic) */
#define PARALLEL_MIN_WEIGHTS (1 << 18)   /* weight values (1 MB) below which one thread streams them all: waking a
                                            second thread costs more, and far more when another process holds its
                                            core */

/* acc [M][N] += x[:, k0:k1] @ w[k0:k1, :], ROW_UNROLL rows of w at a time. */
static void accumulate_rows(const float *x, int64_t M, int64_t k0, int64_t k1, int64_t ldx, const float *w,
                            int64_t ldw, int64_t N, float *acc) {
    int64_t k = k0;
    for (; k + ROW_UNROLL <= k1; k += ROW_UNROLL)
        for (int64_t m = 0; m < M; m++) {
            const float *restrict r0 = w + k * ldw, *restrict r1 = r0 + ldw, *restrict r2 = r1 + ldw,
                                  *restrict r3 = r2 + ldw;
            const float *xm = x + m * ldx + k;
            float x0 = xm[0], x1 = xm[1], x2 = xm[2], x3 = xm[3], *restrict a = acc + m * N;
#pragma omp simd
            for (int64_t j = 0; j < N; j++) a[j] += x0 * r0[j] + x1 * r1[j] + x2 * r2[j] + x3 * r3[j];
        }
    for (; k < k1; k++)
        for (int64_t m = 0; m < M; m++) {
            const float *restrict row = w + k * ldw;
            float xv = x[m * ldx + k], *restrict a = acc + m * N;
#pragma omp simd
            for (int64_t j = 0; j < N; j++) a[j] += xv * row[j];
        }
}

/* Returns 0, or -1 when the partial sums could not be allocated. */
int sm_mm(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t ldw, int64_t N, float *y) {
    if (K * N < PARALLEL_MIN_WEIGHTS) {          /* one thread, straight into y */
        memset(y, 0, (size_t)(M * N) * sizeof(float));
        accumulate_rows(x, M, 0, K, ldx, w, ldw, N, y);
        return 0;
    }
    int threads = omp_get_max_threads();
    size_t per_thread = (size_t)(M * N);
    float *part = malloc((size_t)threads * per_thread * sizeof(float));
    if (!part) return -1;
#pragma omp parallel num_threads(threads)
    {
        int me = omp_get_thread_num(), n = omp_get_num_threads();
        float *acc = part + (size_t)me * per_thread;
        memset(acc, 0, per_thread * sizeof(float));
        accumulate_rows(x, M, K * me / n, K * (me + 1) / n, ldx, w, ldw, N, acc);
#pragma omp barrier
        int64_t j0 = (int64_t)per_thread * me / n, j1 = (int64_t)per_thread * (me + 1) / n;
        for (int64_t j = j0; j < j1; j++) {
            float s = 0.0f;
            for (int t = 0; t < n; t++) s += part[(size_t)t * per_thread + j];
            y[j] = s;
        }
    }
    free(part);
    return 0;
}

/* y [M][N] = x [M][K] @ w^T for w [N][K] (row stride ldw). */
void sm_mm_nt(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t ldw, int64_t N,
              float *y) {
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)
    for (int64_t n = 0; n < N; n++) {
        const float *restrict row = w + n * ldw;
        for (int64_t m = 0; m < M; m++) {
            const float *restrict xm = x + m * ldx;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; k++) s += xm[k] * row[k];
            y[m * N + n] = s;
        }
    }
}

/* ---- bf16 products (sm_gemv_bf16; header comment) ---- */

#define MAX_ROWS 4         /* rows of x a call takes (kernels/aten/skinny_mm.py MAX_ROWS) */
#define BF16_DOT_ROWS 4    /* weight rows per pass of the dot form (x read once for them; M x 4 sums in registers) */
#define COL_BLOCK 2048     /* columns per block of the [K, N] form: MAX_ROWS x 8 KB of fp32 sums */
#define BF16_PARALLEL_MIN (1 << 19)   /* bf16 weight values (1 MB) below which one thread reads them all */
#define PAIRS (2 * VL)     /* bf16 values in one vector of VL 32-bit lanes */

/* PAIRS bf16 values at p, as VL 32-bit lanes of two values each; even_bf16 / odd_bf16 widen the values at even /
 * odd positions to fp32 (the low half shifted up, the high half masked): two instructions per PAIRS values. */
static inline vu vload_pairs(const uint16_t *p) {
    vu v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf even_bf16(vu v) { return (vf)(v << 16); }

static inline vf odd_bf16(vu v) { return (vf)(v & 0xFFFF0000u); }

/* s[m][r] = x[m] . w[r] over K values for M rows of x (row stride ldx) and R weight rows (row stride ldw):
 * widened to fp32 PAIRS values at a time (the even and the odd ones apart: each sum takes both), fused
 * multiply-adds, the tail by VL values and then one at a time. M and R are constants at every call, so the sums
 * live in registers. */
static inline __attribute__((always_inline)) void dots_widened(const uint16_t *restrict x, int64_t ldx, const int M,
        const uint16_t *restrict w, int64_t ldw, const int R, int64_t K, float s[MAX_ROWS][BF16_DOT_ROWS]) {
    vf acc[MAX_ROWS][BF16_DOT_ROWS];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) acc[m][r] = splat(0.0f);
    int64_t k = 0;
    for (; k + PAIRS <= K; k += PAIRS) {
        vf we[BF16_DOT_ROWS], wo[BF16_DOT_ROWS];
        for (int r = 0; r < R; r++) {
            vu v = vload_pairs(w + r * ldw + k);
            we[r] = even_bf16(v);
            wo[r] = odd_bf16(v);
        }
        for (int m = 0; m < M; m++) {
            vu v = vload_pairs(x + m * ldx + k);
            vf xe = even_bf16(v), xo = odd_bf16(v);
            for (int r = 0; r < R; r++) {
                acc[m][r] += xe * we[r];
                acc[m][r] += xo * wo[r];
            }
        }
    }
    for (; k + VL <= K; k += VL) {
        vf wv[BF16_DOT_ROWS];
        for (int r = 0; r < R; r++) wv[r] = vload_bf16(w + r * ldw + k);
        for (int m = 0; m < M; m++) {
            vf xv = vload_bf16(x + m * ldx + k);
            for (int r = 0; r < R; r++) acc[m][r] += xv * wv[r];
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            float sum = hsum(acc[m][r]);
            for (int64_t t = k; t < K; t++) sum += load_value(x, BF16, m * ldx + t) * load_value(w, BF16, r * ldw + t);
            s[m][r] = sum;
        }
}

#ifdef __AVX512BF16__
/* As dots_widened, by vdpbf16ps on the stored bf16 pairs; the tail of k by a masked load (zeros past K). */
static inline __attribute__((always_inline)) void dots_bf16(const uint16_t *restrict x, int64_t ldx, const int M,
        const uint16_t *restrict w, int64_t ldw, const int R, int64_t K, float s[MAX_ROWS][BF16_DOT_ROWS]) {
    __m512 acc[MAX_ROWS][BF16_DOT_ROWS];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[BF16_DOT_ROWS];
        for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * ldw + k);
        for (int m = 0; m < M; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    if (k < K) {
        __mmask32 tail = _cvtu32_mask32((1u << (K - k)) - 1u);
        __m512bh wv[BF16_DOT_ROWS];
        for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * ldw + k);
        for (int m = 0; m < M; m++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * ldx + k);
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) s[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}
#define DOTS dots_bf16
#else
#define DOTS dots_widened
#endif

/* y[m][n] for n in [j0, j1): dots of x's M rows with the weight rows w + n * ldw (k contiguous). */
static inline __attribute__((always_inline)) void dot_columns(const uint16_t *x, int64_t ldx, const int M,
        const uint16_t *w, int64_t ldw, int64_t K, int64_t j0, int64_t j1, uint16_t *y, int64_t ldy) {
    float s[MAX_ROWS][BF16_DOT_ROWS];
    int64_t n = j0;
    for (; n + BF16_DOT_ROWS <= j1; n += BF16_DOT_ROWS) {
        DOTS(x, ldx, M, w + n * ldw, ldw, BF16_DOT_ROWS, K, s);
        for (int m = 0; m < M; m++)
            for (int r = 0; r < BF16_DOT_ROWS; r++) store_value(y + m * ldy, BF16, n + r, s[m][r]);
    }
    for (; n < j1; n++) {
        DOTS(x, ldx, M, w + n * ldw, ldw, 1, K, s);
        for (int m = 0; m < M; m++) store_value(y + m * ldy, BF16, n, s[m][0]);
    }
}

/* acc[m][0, nb) += x[m][k] * w[k][0, nb) for k in [0, K), ROW_UNROLL weight rows per pass over acc. Each whole
 * group of PAIRS columns keeps its even columns' sums, then its odd ones' (even_bf16, odd_bf16: store_sums puts
 * them back in order); the columns past the last group are in order. */
static inline __attribute__((always_inline)) void accumulate_bf16_rows(const uint16_t *x, int64_t ldx, const int M,
        const uint16_t *w, int64_t ldw, int64_t K, int64_t nb, float acc[MAX_ROWS][COL_BLOCK]) {
    int64_t k = 0;
    for (; k + ROW_UNROLL <= K; k += ROW_UNROLL) {
        const uint16_t *r0 = w + k * ldw, *r1 = r0 + ldw, *r2 = r1 + ldw, *r3 = r2 + ldw;
        float xs[MAX_ROWS][ROW_UNROLL];
        for (int m = 0; m < M; m++)
            for (int u = 0; u < ROW_UNROLL; u++) xs[m][u] = load_value(x, BF16, m * ldx + k + u);
        int64_t j = 0;
        for (; j + PAIRS <= nb; j += PAIRS) {
            vu v0 = vload_pairs(r0 + j), v1 = vload_pairs(r1 + j), v2 = vload_pairs(r2 + j), v3 = vload_pairs(r3 + j);
            for (int m = 0; m < M; m++) {
                float *a = acc[m] + j;
                vstore(a, vload(a) + xs[m][0] * even_bf16(v0) + xs[m][1] * even_bf16(v1) + xs[m][2] * even_bf16(v2) +
                              xs[m][3] * even_bf16(v3));
                vstore(a + VL, vload(a + VL) + xs[m][0] * odd_bf16(v0) + xs[m][1] * odd_bf16(v1) +
                                   xs[m][2] * odd_bf16(v2) + xs[m][3] * odd_bf16(v3));
            }
        }
        for (; j < nb; j++)
            for (int m = 0; m < M; m++)
                acc[m][j] += xs[m][0] * load_value(r0, BF16, j) + xs[m][1] * load_value(r1, BF16, j) +
                             xs[m][2] * load_value(r2, BF16, j) + xs[m][3] * load_value(r3, BF16, j);
    }
    for (; k < K; k++)
        for (int m = 0; m < M; m++) {
            float xv = load_value(x, BF16, m * ldx + k);
            int64_t j = 0;
            for (; j + PAIRS <= nb; j += PAIRS) {
                vu v = vload_pairs(w + k * ldw + j);
                vstore(acc[m] + j, vload(acc[m] + j) + xv * even_bf16(v));
                vstore(acc[m] + j + VL, vload(acc[m] + j + VL) + xv * odd_bf16(v));
            }
            for (; j < nb; j++) acc[m][j] += xv * load_value(w, BF16, k * ldw + j);
        }
}

/* y[0, nb) = acc[0, nb) rounded to bf16, acc in accumulate_bf16_rows's order: a group's even and odd sums
 * rounded, then put together as the group's PAIRS values. */
static void store_sums(uint16_t *y, const float *acc, int64_t nb) {
    int64_t j = 0;
    for (; j + PAIRS <= nb; j += PAIRS) {
        vu bits = vbf16_rounded(vload(acc + j)) | (vbf16_rounded(vload(acc + j + VL)) << 16);
        memcpy(y + j, &bits, sizeof bits);
    }
    for (; j < nb; j++) store_value(y, BF16, j, acc[j]);
}

/* y[m][n] for n in [j0, j1) of x @ w with w [K, N] (row stride ldw, n contiguous), COL_BLOCK columns at a time. */
static inline __attribute__((always_inline)) void row_columns(const uint16_t *x, int64_t ldx, const int M,
        const uint16_t *w, int64_t ldw, int64_t K, int64_t j0, int64_t j1, uint16_t *y, int64_t ldy) {
    float acc[MAX_ROWS][COL_BLOCK] __attribute__((aligned(64)));
    for (int64_t jb = j0; jb < j1; jb += COL_BLOCK) {
        int64_t nb = j1 - jb < COL_BLOCK ? j1 - jb : COL_BLOCK;
        for (int m = 0; m < M; m++) memset(acc[m], 0, (size_t)nb * sizeof(float));
        accumulate_bf16_rows(x, ldx, M, w + jb, ldw, K, nb, acc);
        for (int m = 0; m < M; m++) store_sums(y + m * ldy + jb, acc[m], nb);
    }
}

struct gemv_shape {         /* one call's sizes and strides (elements), as sm_gemv_bf16 takes them */
    int64_t M, K, N, x_batch, ldx, w_batch, w_k, w_n, y_batch, ldy;
};

/* The columns [j0, j1) of batch b, for a constant M. */
static inline __attribute__((always_inline)) void gemv_columns(const struct gemv_shape *s, const int M,
        const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t b, int64_t j0, int64_t j1) {
    x += b * s->x_batch;
    w += b * s->w_batch;
    y += b * s->y_batch;
    if (s->w_k == 1)
        dot_columns(x, s->ldx, M, w, s->w_n, s->K, j0, j1, y, s->ldy);
    else
        row_columns(x, s->ldx, M, w, s->w_k, s->K, j0, j1, y, s->ldy);
}

static void gemv_segment(const struct gemv_shape *s, const uint16_t *x, const uint16_t *w, uint16_t *y,
                         int64_t b, int64_t j0, int64_t j1) {
    switch (s->M) {         /* constant M per case: the sums stay in registers */
    case 1: gemv_columns(s, 1, x, w, y, b, j0, j1); break;
    case 2: gemv_columns(s, 2, x, w, y, b, j0, j1); break;
    case 3: gemv_columns(s, 3, x, w, y, b, j0, j1); break;
    default: gemv_columns(s, 4, x, w, y, b, j0, j1); break;
    }
}

/* y[b] = x[b] @ w[b] for b < B: x [B][M][K] bf16 (strides x_batch, ldx, 1), w [B][K][N] bf16 (strides w_batch,
 * w_k, w_n with w_k or w_n equal to 1), y [B][M][N] bf16 (strides y_batch, ldy, 1). Returns 0, or -1 (nothing
 * written) when M is not 1..MAX_ROWS or neither w_k nor w_n is 1. */
int sm_gemv_bf16(const uint16_t *x, int64_t B, int64_t M, int64_t K, int64_t x_batch, int64_t ldx,
                 const uint16_t *w, int64_t w_batch, int64_t w_k, int64_t w_n, int64_t N, uint16_t *y,
                 int64_t y_batch, int64_t ldy) {
    if (M < 1 || M > MAX_ROWS || (w_k != 1 && w_n != 1)) return -1;
    struct gemv_shape s = {M, K, N, x_batch, ldx, w_batch, w_k, w_n, y_batch, ldy};
    int64_t units = B * N;  /* output columns of every batch, split in contiguous shares */
#pragma omp parallel if (units * K >= BF16_PARALLEL_MIN)
    {
        int me = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t u = units * me / n, end = units * (me + 1) / n;
        while (u < end) {
            int64_t b = u / N, j0 = u % N, j1 = N - j0 < end - u ? N : j0 + (end - u);
            gemv_segment(&s, x, w, y, b, j0, j1);
            u += j1 - j0;
        }
    }
    return 0;
}

/* Evicts the cache lines of [p, p + bytes) from every cache level (x86: clflush; returns 1), so that a
 * measurement sees the weight as a decode step does: read from memory once per step, after every other
 * layer's weights went through the caches. Returns 0 where there is no such instruction (nothing evicted). */
int sm_evict(const void *p, int64_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
    const char *c = (const char *)p;
    for (int64_t off = 0; off < bytes; off += 64) _mm_clflush(c + off);
    _mm_mfence();
    return 1;
#else
    (void)p;
    (void)bytes;
    return 0;
#endif
}
