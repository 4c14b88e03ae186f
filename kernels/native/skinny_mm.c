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
 */
#include <omp.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

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
