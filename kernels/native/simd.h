/* Vectors of the instruction-set level a kernel is built for (kernels/native/loader.py builds every kernel once per level
 * with that level's flags; kernels/native/cpu_isa.py picks the level at run time). Kernels write their loops on `vf`
 * (VL fp32 lanes, GCC vector extensions) and size their register tiles from NREG, so the same source gives
 * 16-lane AVX-512 code, 8-lane AVX2 code and 4-lane SSE2 / NEON code, each with tiles that fit its registers.
 *
 * Level      VL  NREG   widening of stored 16-bit values (whole vectors, never element by element)
 * avx512     16   32    bf16: vpmovzxwd + vpslld; fp16: vcvtph2ps zmm
 * avx2        8   16    bf16: vpmovzxwd + vpslld; fp16: vcvtph2ps ymm (F16C)
 * generic     4   16/32 bf16: unpack + shift; fp16: the compiler's _Float16 conversion
 */
#ifndef ASCEND_DSA_SIMD_H
#define ASCEND_DSA_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "float_io.h"

#if defined(__AVX512F__)
#define VL 16
#define NREG 32
#elif defined(__AVX2__)
#define VL 8
#define NREG 16
#elif defined(__aarch64__)
#define VL 4
#define NREG 32
#else
#define VL 4
#define NREG 16
#endif

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

/* The amx_bf16 level's tiles: its flags, or their C emulation for tests (amx_tiles.h). */
#if defined(__AMX_BF16__) || defined(ASCEND_DSA_AMX_EMULATED)
#define AMX_TILES 1
#endif

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(VL * sizeof(uint16_t))));

#if VL == 16
#define LANES {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#elif VL == 8
#define LANES {0, 1, 2, 3, 4, 5, 6, 7}
#else
#define LANES {0, 1, 2, 3}
#endif

static inline int64_t elem_bytes(int dtype) { return dtype == F32 ? 4 : dtype == E4M3 || dtype == I8 ? 1 : 2; }

static inline vf splat(float x) { return (vf){0} + x; }

static inline vf vload(const void *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(void *p, vf v) { memcpy(p, &v, sizeof v); }

/* mask ? yes : no, lane by lane (mask lanes all ones or all zeros, as comparisons give). */
static inline vf pick(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

static inline vf vmax(vf a, vf b) { return pick(a > b, a, b); }

typedef uint8_t vb __attribute__((vector_size(VL)));

/* VL float8_e4m3fn codes at p, times factor, as fp32: exact (a normal code's exponent and mantissa moved into
 * fp32's fields, a subnormal one m * 2^-9), then the factor, then the sign; the NaN codes (magnitude 0x7F) are NaN. */
static inline vf e4m3_vec(const uint8_t *p, vf factor) {
    vb b;
    memcpy(&b, p, sizeof b);
    vu u = __builtin_convertvector(b, vu), mag = u & 0x7Fu;
    vf normal = (vf)((mag << 20) + (120u << 23));
    vf sub = __builtin_convertvector((vi)mag, vf) * (1.0f / 512.0f);
    vf v = pick((vi)(mag < 8u), sub, normal) * factor;
    v = (vf)((vu)v | ((u & 0x80u) << 24));
    return pick((vi)(mag == 0x7Fu), splat(NAN), v);
}

/* max(a, 0) with NaN kept (as torch.relu): a NaN product must reach the score it belongs to. One max instruction
 * where the level has it (maxps returns its second operand when either is NaN, so max(0, a) keeps a NaN a; a -0
 * stays -0), else a compare and a mask. */
static inline vf relu(vf a) {
#if defined(__AVX512F__)
    return (vf)_mm512_max_ps(_mm512_setzero_ps(), (__m512)a);
#elif defined(__AVX2__)
    return (vf)_mm256_max_ps(_mm256_setzero_ps(), (__m256)a);
#elif defined(__SSE2__) && VL == 4
    return (vf)_mm_max_ps(_mm_setzero_ps(), (__m128)a);
#else
    return (vf)((vi)a & ((a > (vf){0}) | (a != a)));
#endif
}

/* Lane-wise tree reductions: log2(VL) shuffles. */
static inline float hsum(vf x) {
    const vi lane = LANES;
    for (int half = VL / 2; half > 0; half /= 2) x += __builtin_shuffle(x, lane ^ half);
    return x[0];
}

static inline float hmax(vf x) {
    const vi lane = LANES;
    for (int half = VL / 2; half > 0; half /= 2) x = vmax(x, __builtin_shuffle(x, lane ^ half));
    return x[0];
}

/* VL bf16 values to fp32: zero-extend to 32 bits and shift into the high half. */
static inline vf vload_bf16(const void *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

/* VL fp16 values to fp32 (needs FLOAT_IO_HAS_F16 where there is no F16C). */
static inline vf vload_f16(const void *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VL == 8
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#elif FLOAT_IO_HAS_F16
    _Float16 h[VL];
    memcpy(h, p, sizeof h);
    vf v;
    for (int i = 0; i < VL; i++) v[i] = (float)h[i];
    return v;
#else
    (void)p;
    return (vf){0};
#endif
}

/* VL values of type dtype (F32, BF16, F16) at element i of x, as fp32. */
static inline vf vload_any(const void *x, int dtype, int64_t i) {
    if (dtype == F32) return vload((const float *)x + i);
    if (dtype == BF16) return vload_bf16((const uint16_t *)x + i);
    return vload_f16((const uint16_t *)x + i);
}

/* n values of type dtype to fp32 at dst: whole vectors, then the tail one by one. */
static inline void row_to_f32(float *restrict dst, const void *src, int dtype, int64_t n) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
    int64_t i = 0;
    if (dtype == BF16)                       /* one loop per dtype: no test inside the loop */
        for (; i + VL <= n; i += VL) vstore(dst + i, vload_bf16(s + i));
    else
        for (; i + VL <= n; i += VL) vstore(dst + i, vload_f16(s + i));
    for (; i < n; i++) dst[i] = load_value(src, dtype, i);
}

/* VL fp32 values rounded to bf16 (nearest even; NaN stays NaN, quiet), the bits in each lane's low 16. */
static inline vu vbf16_rounded(vf x) {
    vu u = (vu)x;
    vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    vu nan = (u >> 16) | 0x40u;
    vu is_nan = (vu)((u & 0x7FFFFFFFu) > 0x7F800000u);
    return (rounded & ~is_nan) | (nan & is_nan);
}

/* VL fp32 values to bf16 bits, rounded to nearest even; NaN stays NaN (quiet). */
static inline vh vbf16_bits(vf x) { return __builtin_convertvector(vbf16_rounded(x), vh); }

/* VL fp32 values stored at element i of x as F32 or BF16 (nearest even, NaN stays NaN); fp16 rows go through
 * row_from_f32. */
static inline void vstore_f32_bf16(void *x, int dtype, int64_t i, vf v) {
    if (dtype == F32) {
        vstore((float *)x + i, v);
    } else {
        vh h = vbf16_bits(v);
        memcpy((uint16_t *)x + i, &h, sizeof h);
    }
}

/* n fp32 values at src stored as dtype at dst (bf16: nearest even, as store_value; fp16: the hardware's
 * rounding, nearest even): whole vectors, then the tail one by one. */
static inline void row_from_f32(void *dst, int dtype, const float *restrict src, int64_t n) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    int64_t i = 0;
    if (dtype == BF16) {
        for (; i + VL <= n; i += VL) {
            vh h = vbf16_bits(vload(src + i));
            memcpy((uint16_t *)dst + i, &h, sizeof h);
        }
    }
#if defined(__AVX512F__)
    else
        for (; i + VL <= n; i += VL)
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i),
                                _mm512_cvtps_ph((__m512)vload(src + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__) && VL == 8
    else
        for (; i + VL <= n; i += VL)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                             _mm256_cvtps_ph((__m256)vload(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) store_value(dst, dtype, i, src[i]);
}

#define LOG2E 1.44269504088896341f     /* exp(x) = 2^(x LOG2E) */

/* 2^x for x <= 0: x = k + f with k an integer and |f| <= 1/2, 2^f by its Taylor polynomial of degree 7 (error
 * below 1e-8, so ~1 ulp from the fp32 arithmetic); below -126 it gives 2^-126 (about 1e-38) rather than 0 and NaN
 * stays NaN. */
static inline vf exp2_neg(vf x) {
    x = pick(x < splat(-126.0f), splat(-126.0f), x);
    vf t = x + 12582912.0f; /* 1.5 * 2^23: rounds x to an integer k */
    vf f = x - (t - 12582912.0f);
    vf p = splat(1.5252733804e-5f);
    p = p * f + 1.5403530393e-4f;
    p = p * f + 1.3333558146e-3f;
    p = p * f + 9.6181291076e-3f;
    p = p * f + 5.5504108665e-2f;
    p = p * f + 2.4022650696e-1f;
    p = p * f + 6.9314718056e-1f;
    p = p * f + 1.0f;
    return p * (vf)((((vu)t) - 0x4B400000u + 127u) << 23);
}

#endif
