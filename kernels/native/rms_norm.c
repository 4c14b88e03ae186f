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

enum { F32 = 0, BF16 = 1, F16 = 2 };

int rn_has_f16(void) {
#ifdef __FLT16_MANT_DIG__
    return 1;
#else
    return 0;
#endif
}

static inline float load(const void *x, int dtype, int64_t i) {
    if (dtype == F32) return ((const float *)x)[i];
    if (dtype == BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
#ifdef __FLT16_MANT_DIG__
    return (float)((const _Float16 *)x)[i];
#else
    return 0.0f;
#endif
}

/* fp32 to bf16 bits, rounded to nearest even; NaN stays NaN. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline void store(void *y, int dtype, int64_t i, float v) {
    if (dtype == F32) {
        ((float *)y)[i] = v;
    } else if (dtype == BF16) {
        ((uint16_t *)y)[i] = to_bf16(v);
    } else {
#ifdef __FLT16_MANT_DIG__
        ((_Float16 *)y)[i] = (_Float16)v;
#endif
    }
}

void rn_rows(const void *x, int dtype, int64_t rows, int64_t n, const float *gamma, float eps, void *y,
             float *rstd) {
    for (int64_t r = 0; r < rows; r++) {
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            float v = load(x, dtype, r * n + i);
            sum += v * v;
        }
        float s = 1.0f / sqrtf(sum / (float)n + eps);
        rstd[r] = s;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) store(y, dtype, r * n + i, load(x, dtype, r * n + i) * s * gamma[i]);
    }
}
