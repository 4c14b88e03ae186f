/* AttnRes over depth for a few rows (decode) for kernels/attn_res.py; kernels/native/loader.py builds and loads this file.
 * Plain C, no torch headers, one thread (a decode step has one row of a few blocks).
 *
 * For every row r (of `rows`), the values v_0..v_{n-1} = blocks[i][r] and, when given, v_n = partial[r]
 * (fp32, bf16 or fp16, rows of d contiguous values), and every pseudo-query s of q [S][d] (fp32) with the norm
 * weight w [d] (fp32, NULL: ones) folded in, wq_s = q_s * w (rounded to fp32, as the torch path forms it):
 *   logit[i][s] = (v_i . wq_s) / sqrt(mean(v_i^2) + eps)
 *   out[s][r]   = sum_i softmax_i(logit[.][s]) v_i           fp32, rounded once to the values' dtype
 * fp16 needs the compiler's _Float16 (ar_has_f16).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

int ar_has_f16(void) { return FLOAT_IO_HAS_F16; }

/* The values of row r as fp32 rows vals[m][d] (m = n or n + 1). */
static void gather_values(const void *blocks, const void *partial, int dtype, int64_t n, int64_t rows, int64_t d,
                          int64_t r, float *vals) {
    const int64_t item = elem_bytes(dtype);
    for (int64_t i = 0; i < n; i++) row_to_f32(vals + i * d, (const char *)blocks + (i * rows + r) * d * item, dtype, d);
    if (partial) row_to_f32(vals + n * d, (const char *)partial + r * d * item, dtype, d);
}

/* Returns 0, or -1 when the working buffers could not be allocated. */
int ar_rows(const void *blocks, const void *partial, int dtype, int64_t n, int64_t rows, int64_t d,
            const float *q, const float *w, int64_t S, float eps, void *out) {
    int64_t m = n + (partial != NULL);
    float *vals = malloc((size_t)(m * d) * sizeof(float)), *logit = malloc((size_t)(m * S) * sizeof(float));
    float *acc = malloc((size_t)d * sizeof(float)), *wq = malloc((size_t)(S * d) * sizeof(float));
    if (!vals || !logit || !acc || !wq) {
        free(vals);
        free(logit);
        free(acc);
        free(wq);
        return -1;
    }
    for (int64_t j = 0; j < S * d; j++) wq[j] = w ? q[j] * w[j % d] : q[j];
    for (int64_t r = 0; r < rows; r++) {
        gather_values(blocks, partial, dtype, n, rows, d, r, vals);
        for (int64_t i = 0; i < m; i++) {
            const float *v = vals + i * d;
            float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
            for (int64_t j = 0; j < d; j++) sq += v[j] * v[j];
            float rms_inv = 1.0f / sqrtf(sq / (float)d + eps);
            for (int64_t s = 0; s < S; s++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t j = 0; j < d; j++) dot += v[j] * wq[s * d + j];
                logit[i * S + s] = dot * rms_inv;
            }
        }
        for (int64_t s = 0; s < S; s++) {
            float top = -INFINITY, sum = 0.0f;
            for (int64_t i = 0; i < m; i++) top = logit[i * S + s] > top ? logit[i * S + s] : top;
            for (int64_t i = 0; i < m; i++) {
                logit[i * S + s] = expf(logit[i * S + s] - top);
                sum += logit[i * S + s];
            }
            memset(acc, 0, (size_t)d * sizeof(float));
            for (int64_t i = 0; i < m; i++) {
                float p = logit[i * S + s] / sum;
                const float *v = vals + i * d;
#pragma omp simd
                for (int64_t j = 0; j < d; j++) acc[j] += p * v[j];
            }
            row_from_f32((char *)out + (s * rows + r) * d * elem_bytes(dtype), dtype, acc, d);
        }
    }
    free(vals);
    free(logit);
    free(acc);
    free(wq);
    return 0;
}
