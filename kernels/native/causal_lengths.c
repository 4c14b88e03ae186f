/* Mask to sequence lengths for ascend_dsa::causal_lengths (kernels/indexer/causal_lengths.py); kernels/native/loader.py builds and
 * loads this file. Plain C, no torch headers, one thread (a decode mask is one row of the cache's length).
 *
 * mask [B][S1][S2] with element strides sb, sq, sk: bool (kind 0, true = visible) or fp32 additive (kind 1: 0 =
 * visible, <= ADDITIVE_MASKED = masked, anything else is an error). Per batch row: each query row must see one
 * run of keys [start, limit_t) with the same start for every row (start 0 unless `windows`: a left-padded batch),
 * and limit_t = the last row's limit - (S1 - 1 - t) (right-down causal; a row whose limit falls at or before the
 * start sees nothing). lengths_k[b] = the last row's limit, starts[b] = its start. Returns 0, 1 when a row does
 * not have that shape, 2 when an additive mask holds another value.
 */
#include <stdint.h>

#define ADDITIVE_MASKED -1e30f

/* The run of visible keys of one row: its length (*start: its first key; 0 and 0 for an empty row), -1 when the
 * visible keys are not one run, -2 for a value an additive mask cannot hold. */
static int64_t visible_run(const void *mask, int kind, int64_t at, int64_t sk, int64_t n, int64_t *start) {
    int64_t first = -1, end = -1;
    for (int64_t s = 0; s < n; s++) {
        int visible;
        if (kind == 0) {
            visible = ((const uint8_t *)mask)[at + s * sk] != 0;
        } else {
            float v = ((const float *)mask)[at + s * sk];
            if (v != 0.0f && !(v <= ADDITIVE_MASKED)) return -2;
            visible = v == 0.0f;
        }
        if (visible && first < 0) first = s;
        else if (visible && end >= 0) return -1;
        else if (!visible && first >= 0 && end < 0) end = s;
    }
    *start = first < 0 ? 0 : first;
    return first < 0 ? 0 : (end < 0 ? n : end) - first;
}

int cl_lengths(const void *mask, int kind, int windows, int64_t B, int64_t S1, int64_t S2, int64_t sb, int64_t sq,
               int64_t sk, int32_t *lengths_k, int32_t *starts) {
    for (int64_t b = 0; b < B; b++) {
        int64_t start = 0, run_start = 0;
        int64_t count = S1 ? visible_run(mask, kind, b * sb + (S1 - 1) * sq, sk, S2, &start) : 0;
        if (count < 0) return count == -2 ? 2 : 1;
        if (start != 0 && !windows) return 1;
        int64_t limit = start + count;
        for (int64_t t = 0; t + 1 < S1; t++) {
            int64_t want = limit - (S1 - 1 - t) - start;
            int64_t got = visible_run(mask, kind, b * sb + t * sq, sk, S2, &run_start);
            if (got == -2) return 2;
            if (got != (want > 0 ? want : 0) || (got > 0 && run_start != start)) return 1;
        }
        lengths_k[b] = (int32_t)limit;
        starts[b] = (int32_t)start;
    }
    return 0;
}
