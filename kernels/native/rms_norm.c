/* RMSNorm of a few rows (decode) for kernels/rms_norm.py; kernels/native.py builds and loads this file. Plain C,
 * no torch headers, one thread (a decode row is 1-8K values: a parallel region would cost more than the work).
 *
 * For each row r of x [rows][n] (fp32, bf16 or fp16; rows contiguous):
 *   rstd[r] = 1 / sqrt(sum_i x[r][i]^2 / n + eps)          fp32
 *   y[r][i] = x[r][i] * rstd[r] * gamma[i]                  fp32, rounded once to x's dtype (nearest even)
 * gamma is fp32 [n]. fp16 needs the compiler's _Float16 (rn_has_f16).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "float_io.h"

int rn_has_f16(void) { return FLOAT_IO_HAS_F16; }

void rn_rows(const void *x, int dtype, int64_t rows, int64_t n, const float *gamma, float eps, void *y,
             float *rstd) {
    for (int64_t r = 0; r < rows; r++) {
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            float v = load_value(x, dtype, r * n + i);
            sum += v * v;
        }
        float s = 1.0f / sqrtf(sum / (float)n + eps);
        rstd[r] = s;
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            store_value(y, dtype, r * n + i, load_value(x, dtype, r * n + i) * s * gamma[i]);
    }
}
