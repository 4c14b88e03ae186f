/* Top-k of fp32 scores as torch.topk ranks them, for the native kernels (lightning_indexer.c): the k largest,
 * sorted descending, equal scores by position, every NaN above +inf, -0 equal to +0.
 *
 * Each score becomes an order-preserving unsigned key. One pass over all n keys counts their top TOPK_DIGIT bits;
 * the bin that holds the k-th largest is found from the top, a second pass keeps the keys above it and lists the
 * keys in it (in position order), and only that short list is refined digit by digit. The k kept keys are then
 * sorted by a stable radix sort of (key, position) pairs, so equal keys keep position order. Few keys (a prefill
 * row of a short prompt) are inserted into a sorted list instead. The phases (topk_cut, topk_split, topk_finish)
 * also serve a decode row whose keys are scored by several threads: each counts and splits its own chunks.
 */
#ifndef ASCEND_DSA_TOPK_SELECT_H
#define ASCEND_DSA_TOPK_SELECT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TOPK_DIGIT 11
#define TOPK_BINS (1 << TOPK_DIGIT)
#define TOPK_SMALL 8192   /* n x take below which insertion beats the histograms (32 KiB zeroed a call) */

struct topk_pair {
    uint32_t key;
    int32_t pos;
};

/* Order-preserving unsigned key of a float: larger floats give larger keys, every NaN (whatever its sign bit)
 * above +inf, as torch.topk ranks them; -0 and +0 equal. */
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t magnitude = u & 0x7FFFFFFFu;
    u = magnitude ? u : 0;                                            /* -0 as +0 */
    uint32_t key = u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);  /* negative: ~u; else u with the top bit */
    return magnitude > 0x7F800000u ? UINT32_MAX : key;                /* no branch: signs come in random order */
}

/* The digit whose bin holds the need-th largest key, from the counts hist [bins] of one digit; need becomes how
 * many keys of that bin still belong to the top. */
static uint32_t topk_cut(const int32_t *hist, uint32_t bins, int64_t *need) {
    uint32_t b = bins - 1;
    while (hist[b] < *need) *need -= hist[b--];
    return b;
}

/* Over the positions list[0:c] (keys `keys`), the digit (keys >> shift) & (bins - 1) holding the need-th largest:
 * the keys with a larger digit go to out (from *m on), the list keeps the ones with that digit (in order), and
 * need becomes how many of them still belong to the top. Returns the new length of the list. */
static int64_t topk_refine(const uint32_t *keys, int32_t *list, int64_t c, int shift, uint32_t bins,
                           int64_t *need, struct topk_pair *out, int64_t *m) {
    int32_t hist[TOPK_BINS] = {0};
    for (int64_t i = 0; i < c; i++) hist[(keys[list[i]] >> shift) & (bins - 1)]++;
    uint32_t b = topk_cut(hist, bins, need);
    int64_t kept = 0;
    for (int64_t i = 0; i < c; i++) {
        uint32_t digit = (keys[list[i]] >> shift) & (bins - 1);
        if (digit > b) out[(*m)++] = (struct topk_pair){keys[list[i]], list[i]};
        else if (digit == b) list[kept++] = list[i];
    }
    return kept;
}

/* Sorts p[0:m] by key descending, keeping the order of equal keys: LSD radix sort, 8 bits a pass (a pass whose
 * digit is the same for every key is skipped); tmp holds m pairs. */
static void topk_sort(struct topk_pair *p, struct topk_pair *tmp, int64_t m) {
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < m; i++) count[255 - ((p[i].key >> shift) & 0xFFu) + 1]++;
        if (count[255 - ((p[0].key >> shift) & 0xFFu) + 1] == m) continue;
        for (int b = 0; b < 256; b++) count[b + 1] += count[b];
        for (int64_t i = 0; i < m; i++) tmp[count[255 - ((p[i].key >> shift) & 0xFFu)]++] = p[i];
        memcpy(p, tmp, (size_t)m * sizeof *p);
    }
}

/* topk_select for few keys (n * take <= TOPK_SMALL): insertion into the sorted pairs[0:take], each key after the
 * kept keys equal to it (they came first), so equal keys keep position order without the histograms. */
static void topk_insert(const float *score, int64_t n, int64_t take, struct topk_pair *pairs) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t key = order_key(score[i]);
        if (m == take && key <= pairs[m - 1].key) continue;
        int64_t j = m < take ? m++ : m - 1;
        for (; j > 0 && pairs[j - 1].key < key; j--) pairs[j] = pairs[j - 1];
        pairs[j] = (struct topk_pair){key, (int32_t)i};
    }
}

/* Keys start .. end-1 split at the cut digit b (top TOPK_DIGIT bits): (key, position) pairs of larger digits to
 * pairs[*m ...], positions of digit b to list[*c ...], both in position order. */
static void topk_split(const uint32_t *keys, int64_t start, int64_t end, uint32_t b, struct topk_pair *pairs,
                       int64_t *m, int32_t *list, int64_t *c) {
    const int shift = 32 - TOPK_DIGIT;
    int64_t mm = *m, cc = *c;
    for (int64_t i = start; i < end; i++) {     /* written always, kept by the count: no branch on random digits */
        uint32_t digit = keys[i] >> shift;
        pairs[mm] = (struct topk_pair){keys[i], (int32_t)i};
        list[cc] = (int32_t)i;
        mm += digit > b;
        cc += digit == b;
    }
    *m = mm;
    *c = cc;
}

/* After topk_split: the list's c keys (the cut bin) refined by the lower digits, the need largest of them
 * appended to pairs[0:m], and the take pairs sorted (tmp: take pairs). */
static void topk_finish(const uint32_t *keys, int32_t *list, int64_t c, int64_t need, struct topk_pair *pairs,
                        int64_t m, struct topk_pair *tmp) {
    const int shift = 32 - TOPK_DIGIT;
    c = topk_refine(keys, list, c, shift - TOPK_DIGIT, TOPK_BINS, &need, pairs, &m);
    c = topk_refine(keys, list, c, 0, 1u << (shift - TOPK_DIGIT), &need, pairs, &m);
    for (int64_t i = 0; i < need; i++) pairs[m++] = (struct topk_pair){keys[list[i]], list[i]};   /* equal keys */
    topk_sort(pairs, tmp, m);
}

/* The take (1 <= take <= n) largest of score[0:n] in pairs[0:take], sorted as torch.topk sorts them (header).
 * scratch: n keys and n positions; tmp: take pairs. */
static void topk_select(const float *score, int64_t n, int64_t take, uint32_t *keys, int32_t *list,
                        struct topk_pair *pairs, struct topk_pair *tmp) {
    if (n * take <= TOPK_SMALL) {
        topk_insert(score, n, take, pairs);
        return;
    }
    const int shift = 32 - TOPK_DIGIT;
    for (int64_t i = 0; i < n; i++) keys[i] = order_key(score[i]);
    int32_t hist[2][TOPK_BINS] = {{0}};     /* two tables: runs of equal digits do not wait on one counter */
    for (int64_t i = 0; i < n; i++) hist[i & 1][keys[i] >> shift]++;
    for (int i = 0; i < TOPK_BINS; i++) hist[0][i] += hist[1][i];
    int64_t need = take, m = 0, c = 0;
    uint32_t b = topk_cut(hist[0], TOPK_BINS, &need);
    topk_split(keys, 0, n, b, pairs, &m, list, &c);
    topk_finish(keys, list, c, need, pairs, m, tmp);
}

#endif
