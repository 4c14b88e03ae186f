/* RMSNorm rows for kernels/rowwise/rms_norm.py; kernels/native/loader.py builds and loads this file. Plain C, no torch headers.
 *
 * For each row r of x [rows][n] (fp32, bf16 or fp16; each row contiguous, row r at x + r * x_stride values):
 *   rstd[r] = 1 / sqrt(sum_i x[r][i]^2 / n + eps)          fp32
 *   y[r][i] = x[r][i] * rstd[r] * gamma[i]                  fp32, rounded once to x's dtype (nearest even)
 * gamma is fp32 [n]; y is contiguous. rn_add_rows (contiguous summands) first forms x = x1 + x2 (the fp32 sum
 * rounded to the dtype, as eager's add rounds it), stores it, and normalizes that rounded sum: one pass over the
 * inputs instead of an add and a norm.
 * Values are converted a vector at a time (simd.h). fp16 needs the compiler's _Float16 (rn_has_f16).
 * A call of at least PARALLEL_MIN values splits its rows over OpenMP threads (torch's pool); a decode row (1-8K
 * values) stays on the calling thread, where a parallel region would cost more than the work.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PIECE 256   /* values converted, scaled and stored together (a stack buffer) */
#define PARALLEL_MIN (1 << 16)

int rn_has_f16(void) { return FLOAT_IO_HAS_F16; }

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

/* y row = x row * s * gamma: fp32 and bf16 a vector at a time, fp16 (and the tail) a PIECE at a time. */
static void scale_row(const char *xr, int dtype, int64_t n, float s, const float *gamma, char *yr) {
    const int64_t item = elem_bytes(dtype);
    int64_t i0 = 0;
    if (dtype != F16)
        for (; i0 + VL <= n; i0 += VL)
            vstore_f32_bf16(yr, dtype, i0, vload_any(xr, dtype, i0) * s * vload(gamma + i0));
    float piece[PIECE];
    for (; i0 < n; i0 += PIECE) {
        int64_t m = n - i0 < PIECE ? n - i0 : PIECE;
        row_to_f32(piece, xr + i0 * item, dtype, m);
#pragma omp simd
        for (int64_t i = 0; i < m; i++) piece[i] = piece[i] * s * gamma[i0 + i];
        row_from_f32(yr + i0 * item, dtype, piece, m);
    }
}

/* x row = a row + b row, rounded to the dtype (as scale_row); returns the sum of squares of the rounded values,
 * added in sum_squares' order (rn_add_rows equals rn_rows of the sum bit for bit). */
static float add_row(const char *ar, const char *br, int dtype, int64_t n, char *xr) {
    const int64_t item = elem_bytes(dtype);
    int64_t i0 = 0;
    vf acc = {0};
    if (dtype == F32) {
        for (; i0 + VL <= n; i0 += VL) {
            vf v = vload((const float *)ar + i0) + vload((const float *)br + i0);
            vstore((float *)xr + i0, v);
            acc += v * v;
        }
    } else if (dtype == BF16) {
        for (; i0 + VL <= n; i0 += VL) {
            vh h = vbf16_bits(vload_bf16((const uint16_t *)ar + i0) + vload_bf16((const uint16_t *)br + i0));
            memcpy((uint16_t *)xr + i0, &h, sizeof h);
            vf v = vload_bf16(&h);
            acc += v * v;
        }
    }
    if (i0 == n) return hsum(acc);
    float pa[PIECE], pb[PIECE];
    for (; i0 < n; i0 += PIECE) {
        int64_t m = n - i0 < PIECE ? n - i0 : PIECE;
        row_to_f32(pa, ar + i0 * item, dtype, m);
        row_to_f32(pb, br + i0 * item, dtype, m);
#pragma omp simd
        for (int64_t i = 0; i < m; i++) pa[i] += pb[i];
        row_from_f32(xr + i0 * item, dtype, pa, m);
    }
    return sum_squares(xr, dtype, n);
}

static float rstd_of(float sum_squares, int64_t n, float eps) { return 1.0f / sqrtf(sum_squares / (float)n + eps); }

void rn_rows(const void *x, int dtype, int64_t rows, int64_t n, int64_t x_stride, const float *gamma, float eps,
             void *y, float *rstd) {
    const int64_t item = elem_bytes(dtype);
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_stride * item;
        rstd[r] = rstd_of(sum_squares(xr, dtype, n), n, eps);
        scale_row(xr, dtype, n, rstd[r], gamma, (char *)y + r * n * item);
    }
}

void rn_add_rows(const void *x1, const void *x2, int dtype, int64_t rows, int64_t n, const float *gamma, float eps,
                 void *x, void *y, float *rstd) {
    const int64_t item = elem_bytes(dtype);
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        int64_t at = r * n * item;
        rstd[r] = rstd_of(add_row((const char *)x1 + at, (const char *)x2 + at, dtype, n, (char *)x + at), n, eps);
        scale_row((const char *)x + at, dtype, n, rstd[r], gamma, (char *)y + at);
    }
}
