/* Reading and writing fp32 / bf16 / fp16 values as fp32, shared by the native kernels that take any of the three
 * (rms_norm.c, attn_res.c). fp16 needs the compiler's _Float16 (FLOAT_IO_HAS_F16). bf16 results are rounded to
 * nearest even; NaN stays NaN. */
#ifndef ASCEND_DSA_FLOAT_IO_H
#define ASCEND_DSA_FLOAT_IO_H

#include <stdint.h>
#include <string.h>

/* E4M3: float8_e4m3fn codes, I8: int8 codes; each read by the kernels that say so */
enum { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, I8 = 4 };

#ifdef __FLT16_MANT_DIG__
#define FLOAT_IO_HAS_F16 1
#else
#define FLOAT_IO_HAS_F16 0
#endif

static inline float load_value(const void *x, int dtype, int64_t i) {
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

static inline void store_value(void *y, int dtype, int64_t i, float v) {
    if (dtype == F32) {
        ((float *)y)[i] = v;
    } else if (dtype == BF16) {
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        ((uint16_t *)y)[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)((u >> 16) | 0x40u)
                                                             : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    } else {
#ifdef __FLT16_MANT_DIG__
        ((_Float16 *)y)[i] = (_Float16)v;
#endif
    }
}

#endif
