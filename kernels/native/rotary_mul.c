/* RoPE for ascend_dsa::rotary_mul (kernels/rowwise/rotary_mul.py); kernels/native/loader.py builds and loads this
 * file. Plain C, no torch headers.
 *
 * out = x * c + rot(x) * s over 4-D fp32 or bf16 tensors given by sizes and element strides (c and s broadcast:
 * stride 0), rot(x)[i] = -x[i + D/2] (i < D/2), x[i - D/2] (i >= D/2) in mode 0 ("half"), and -x[i + 1] (even i),
 * x[i - 1] (odd i) in mode 1 ("interleave"). Each product and the sum are rounded to the dtype in this order (no
 * fused multiply-add; bf16: fp32 arithmetic rounded to nearest even after every step), as the unfused torch
 * expression x1 * c - x2 * s, x2 * c + x1 * s rounds them: results are equal bit for bit (-(a * b) == a * (-b)).
 *
 * Rows whose last dim is contiguous in all four tensors go a vector at a time (simd.h): halves as two vectors D/2
 * apart, pairs as one vector and its lanes swapped in twos; any other layout goes value by value. A call of at
 * least PARALLEL_MIN values splits its rows over OpenMP threads (torch's pool); a decode call stays on the calling
 * thread, where a parallel region would cost more than the work.
 */
#pragma GCC optimize("fp-contract=off")
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define PARALLEL_MIN (1 << 16)

/* The value rounded to bf16 (nearest even) and widened back to fp32: one rounding step of bf16 arithmetic. */
static inline vf vround_bf16(vf v) { return (vf)(__builtin_convertvector(vbf16_bits(v), vu) << 16); }

static inline float round_bf16(float v) {
    uint16_t h;
    store_value(&h, BF16, 0, v);
    return load_value(&h, BF16, 0);
}

/* a * b + r * t with each step rounded to the dtype (bf16: after each of the three). */
static inline vf vterm(vf a, vf b, vf r, vf t, int bf16) {
    vf p = a * b, q = r * t;
    if (bf16) {
        p = vround_bf16(p);
        q = vround_bf16(q);
    }
    return p + q;           /* the store rounds the sum */
}

static inline float term(float a, float b, float r, float t, int bf16) {
    float p = a * b, q = r * t;
    if (bf16) {
        p = round_bf16(p);
        q = round_bf16(q);
    }
    return p + q;
}

/* One contiguous row of d values in "half" mode: o1 = x1 c1 + x2 (-s1), o2 = x2 c2 + x1 s2. */
static void half_row(const char *x, const char *c, const char *s, char *o, int64_t d, int dtype) {
    const int64_t h = d / 2;
    const int bf16 = dtype == BF16;
    int64_t i = 0;
    for (; i + VL <= h; i += VL) {
        vf x1 = vload_any(x, dtype, i), x2 = vload_any(x, dtype, i + h);
        vstore_f32_bf16(o, dtype, i, vterm(x1, vload_any(c, dtype, i), x2, -vload_any(s, dtype, i), bf16));
        vstore_f32_bf16(o, dtype, i + h,
                        vterm(x2, vload_any(c, dtype, i + h), x1, vload_any(s, dtype, i + h), bf16));
    }
    for (; i < h; i++) {
        float x1 = load_value(x, dtype, i), x2 = load_value(x, dtype, i + h);
        store_value(o, dtype, i, term(x1, load_value(c, dtype, i), x2, -load_value(s, dtype, i), bf16));
        store_value(o, dtype, i + h, term(x2, load_value(c, dtype, i + h), x1, load_value(s, dtype, i + h), bf16));
    }
}

/* One contiguous row of d values in "interleave" mode: each pair (a, b) gives (a c0 + b (-s0), b c1 + a s1). */
static void pair_row(const char *x, const char *c, const char *s, char *o, int64_t d, int dtype) {
    const vi lane = LANES;
    const vi swap = lane ^ 1;
    const vf sign = pick((lane & 1) == 0, splat(-1.0f), splat(1.0f));
    const int bf16 = dtype == BF16;
    int64_t i = 0;
    for (; i + VL <= d; i += VL) {
        vf v = vload_any(x, dtype, i), t = vload_any(s, dtype, i) * sign;
        vstore_f32_bf16(o, dtype, i, vterm(v, vload_any(c, dtype, i), __builtin_shuffle(v, swap), t, bf16));
    }
    for (; i < d; i += 2) {
        float a = load_value(x, dtype, i), b = load_value(x, dtype, i + 1);
        store_value(o, dtype, i, term(a, load_value(c, dtype, i), b, -load_value(s, dtype, i), bf16));
        store_value(o, dtype, i + 1, term(b, load_value(c, dtype, i + 1), a, load_value(s, dtype, i + 1), bf16));
    }
}

/* One row of any strides (in values), value by value. */
static void strided_row(const char *x, const char *c, const char *s, char *o, int64_t d, int64_t xs, int64_t cs,
                        int64_t ss, int64_t os, int mode, int dtype) {
    const int bf16 = dtype == BF16;
    for (int64_t i = 0; i < d; i++) {
        int first = mode == 0 ? i < d / 2 : i % 2 == 0;
        int64_t j = mode == 0 ? (first ? i + d / 2 : i - d / 2) : (first ? i + 1 : i - 1);
        float sv = load_value(s, dtype, i * ss);
        store_value(o, dtype, i * os, term(load_value(x, dtype, i * xs), load_value(c, dtype, i * cs),
                                           load_value(x, dtype, j * xs), first ? -sv : sv, bf16));
    }
}

/* sizes [4]; xs, cs, ss, os: element strides of x, c, s and out [4]; mode 0 half, 1 interleave; dtype F32 or BF16. */
void ro_apply(const void *x, const void *c, const void *s, void *out, const int64_t *sizes, const int64_t *xs,
              const int64_t *cs, const int64_t *ss, const int64_t *os, int mode, int dtype) {
    const int64_t d = sizes[3], n1 = sizes[1], n2 = sizes[2], rows = sizes[0] * n1 * n2, item = elem_bytes(dtype);
    const int dense = xs[3] == 1 && cs[3] == 1 && ss[3] == 1 && os[3] == 1;
#pragma omp parallel for schedule(static) if (rows * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t a = r / (n1 * n2), b = r / n2 % n1, n = r % n2;
        const char *xr = (const char *)x + (a * xs[0] + b * xs[1] + n * xs[2]) * item;
        const char *cr = (const char *)c + (a * cs[0] + b * cs[1] + n * cs[2]) * item;
        const char *sr = (const char *)s + (a * ss[0] + b * ss[1] + n * ss[2]) * item;
        char *orow = (char *)out + (a * os[0] + b * os[1] + n * os[2]) * item;
        if (!dense)
            strided_row(xr, cr, sr, orow, d, xs[3], cs[3], ss[3], os[3], mode, dtype);
        else if (mode == 0)
            half_row(xr, cr, sr, orow, d, dtype);
        else
            pair_row(xr, cr, sr, orow, d, dtype);
    }
}
