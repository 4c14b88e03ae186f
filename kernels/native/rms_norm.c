/* RMSNorm of a few rows (decode) for kernels/rms_norm.py; kernels/native.py builds and loads this file. Plain C,
 * no torch headers, one thread (a decode row is 1-8K values: a parallel region would cost more than the work).
 *
 * For each row r of x [rows][n] (fp32, bf16 or fp16; rows contiguous):
 *   rstd[r] = 1 / sqrt(sum_i x[r][i]^2 / n + eps)          fp32
 *   y[r][i] = x[r][i] * rstd[r] * gamma[i]                  fp32, rounded once to x's dtype (nearest even)
 * gamma is fp32 [n]. Values are converted a vector at a time (simd.h). fp16 needs the compiler's _Float16
 * (rn_has_f16).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

int rn_has_f16(void) { return FLOAT_IO_HAS_F16; }

#define PIECE 256   /* values converted, scaled and stored together (a stack buffer) */

static float sum_squares(const char *x, int dtype, int64_t n) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf v = vload_any(x, dtype, i);
        acc += v * v;
    }
    float sum = hsum(acc);
    for (; i < n; i++) sum += load_value(x, dtype, i) * load_value(x, dtype, i);
    return sum;
}

void rn_rows(const void *x, int dtype, int64_t rows, int64_t n, const float *gamma, float eps, void *y, float *rstd) {
    const int64_t item = elem_bytes(dtype);
    float piece[PIECE];
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * n * item;
        char *yr = (char *)y + r * n * item;
        float s = 1.0f / sqrtf(sum_squares(xr, dtype, n) / (float)n + eps);
        rstd[r] = s;
        for (int64_t i0 = 0; i0 < n; i0 += PIECE) {
            int64_t m = n - i0 < PIECE ? n - i0 : PIECE;
            row_to_f32(piece, xr + i0 * item, dtype, m);
#pragma omp simd
            for (int64_t i = 0; i < m; i++) piece[i] = piece[i] * s * gamma[i0 + i];
            row_from_f32(yr + i0 * item, dtype, piece, m);
        }
    }
}
