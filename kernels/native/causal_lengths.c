/* Mask to sequence lengths for ascend_dsa::causal_lengths (kernels/causal_lengths.py); kernels/native.py builds and
 * loads this file. Plain C, no torch headers, one thread (a decode mask is one row of the cache's length).
 *
 * mask [B][S1][S2] with element strides sb, sq, sk: bool (kind 0, true = visible) or fp32 additive (kind 1: 0 =
 * visible, <= ADDITIVE_MASKED = masked, anything else is an error). Per batch row: each query row must see a
 * prefix of the keys, and row t sees max(count of the last row - (S1 - 1 - t), 0) keys (right-down causal);
 * lengths_k[b] = the last row's count. Returns 0, 1 when a row is not right-down causal, 2 when an additive
 * mask holds another value.
 */
#include <stdint.h>

#define ADDITIVE_MASKED -1e30f

/* Visible keys of one row, or -1 when they are not a prefix, -2 for a value an additive mask cannot hold. */
static int64_t visible_prefix(const void *mask, int kind, int64_t at, int64_t sk, int64_t n) {
    int64_t count = -1;
    for (int64_t s = 0; s < n; s++) {
        int visible;
        if (kind == 0) {
            visible = ((const uint8_t *)mask)[at + s * sk] != 0;
        } else {
            float v = ((const float *)mask)[at + s * sk];
            if (v != 0.0f && !(v <= ADDITIVE_MASKED)) return -2;
            visible = v == 0.0f;
        }
        if (!visible && count < 0) count = s;
        if (visible && count >= 0) return -1;
    }
    return count < 0 ? n : count;
}

int cl_lengths(const void *mask, int kind, int64_t B, int64_t S1, int64_t S2, int64_t sb, int64_t sq, int64_t sk,
               int32_t *lengths_k) {
    for (int64_t b = 0; b < B; b++) {
        int64_t last = S1 ? visible_prefix(mask, kind, b * sb + (S1 - 1) * sq, sk, S2) : 0;
        if (last < 0) return last == -2 ? 2 : 1;
        for (int64_t t = 0; t + 1 < S1; t++) {
            int64_t want = last - (S1 - 1 - t), got = visible_prefix(mask, kind, b * sb + t * sq, sk, S2);
            if (got == -2) return 2;
            if (got != (want > 0 ? want : 0)) return 1;
        }
        lengths_k[b] = (int32_t)last;
    }
    return 0;
}
