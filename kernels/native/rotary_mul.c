/* RoPE on a few fp32 rows (decode) for ascend_dsa::rotary_mul (kernels/rowwise/rotary_mul.py); kernels/native/loader.py builds
 * and loads this file. Plain C, no torch headers, one thread.
 *
 * out = x * c + rot(x) * s over 4-D tensors given by sizes and element strides (c and s broadcast: stride 0),
 * rot(x)[i] = -x[i + D/2] (i < D/2), x[i - D/2] (i >= D/2) in mode 0 ("half"), and -x[i + 1] (even i), x[i - 1]
 * (odd i) in mode 1 ("interleave"). Each product and the sum are rounded to fp32 in this order (no fused
 * multiply-add), as the unfused torch expression x * c + x_swapped * (s * sign) rounds them: results are equal
 * bit for bit.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>

/* Partner index and sign of position i in the last dim of size d. */
static int64_t partner(int64_t i, int64_t d, int mode, float *sign) {
    if (mode == 0) {
        *sign = i < d / 2 ? -1.0f : 1.0f;
        return i < d / 2 ? i + d / 2 : i - d / 2;
    }
    *sign = i % 2 == 0 ? -1.0f : 1.0f;
    return i % 2 == 0 ? i + 1 : i - 1;
}

void ro_rows(const float *x, const float *c, const float *s, float *out, const int64_t *sizes,
             const int64_t *xs, const int64_t *cs, const int64_t *ss, const int64_t *os, int mode) {
    const int64_t d = sizes[3];
    for (int64_t a = 0; a < sizes[0]; a++)
        for (int64_t b = 0; b < sizes[1]; b++)
            for (int64_t n = 0; n < sizes[2]; n++) {
                const float *xr = x + a * xs[0] + b * xs[1] + n * xs[2];
                const float *cr = c + a * cs[0] + b * cs[1] + n * cs[2];
                const float *sr = s + a * ss[0] + b * ss[1] + n * ss[2];
                float *orow = out + a * os[0] + b * os[1] + n * os[2];
                for (int64_t i = 0; i < d; i++) {
                    float sign;
                    int64_t j = partner(i, d, mode, &sign);
                    float direct = xr[i * xs[3]] * cr[i * cs[3]];
                    float rotated = xr[j * xs[3]] * (sr[i * ss[3]] * sign);
                    orow[i * os[3]] = direct + rotated;
                }
            }
}
