/* Router selection for a few tokens (decode) for ascend_dsa::moe_gating_top_k (kernels/moe/gating.py);
 * kernels/native/loader.py builds and loads this file. Plain C, no torch headers, one thread.
 *
 * Per row r of norm [rows][E] (the router's normalised scores, fp32, computed by the caller):
 *   score = norm + bias (bias may be NULL)
 *   with G = group_count > 1 groups of E / G experts: each group's score is its max (group_mode 0) or the sum
 *   of its two largest scores (group_mode 1); the experts outside the k_group best groups score -inf
 *   idx[r] = the k best scores, best first, ties to the lower index (groups likewise)
 *   y[r][j] = norm[idx[r][j]], divided by (sum of the k + eps) when renorm, times scale
 * fp32 throughout, each value rounded as the torch path rounds it. A row with a non-finite score is not
 * handled (return 1): the caller takes the torch path, which orders NaN as torch.topk does.
 */
#include <math.h>
#include <stdint.h>

#define MAX_EXPERTS 4096

/* Whether (a, ia) ranks before (b, ib): larger value first, then the lower index. */
static int ranks_before(float a, int64_t ia, float b, int64_t ib) { return a > b || (a == b && ia < ib); }

/* The k best of v[n] (k <= n), best first, into out. */
static void best_k(const float *v, int64_t n, int64_t k, int32_t *out) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++) {
            int taken = 0;
            for (int64_t p = 0; p < j && !taken; p++) taken = out[p] == i;
            if (!taken && (best < 0 || ranks_before(v[i], i, v[best], best))) best = i;
        }
        out[j] = (int32_t)best;
    }
}

/* Group score of e values: the max, or the max plus the largest of the others (mode 1). */
static float group_score(const float *s, int64_t e, int mode) {
    int64_t top = 0;
    for (int64_t i = 1; i < e; i++) top = s[i] > s[top] ? i : top;
    if (mode == 0 || e < 2) return s[top];
    float second = -INFINITY;
    for (int64_t i = 0; i < e; i++) second = i != top && s[i] > second ? s[i] : second;
    return s[top] + second;
}

/* Sets the experts outside the k_group best groups of score[E] to -inf. */
static void mask_groups(float *score, int64_t E, int64_t k_group, int64_t groups, int mode) {
    float gs[MAX_EXPERTS];
    int32_t keep[MAX_EXPERTS];
    int64_t per = E / groups;
    for (int64_t g = 0; g < groups; g++) gs[g] = group_score(score + g * per, per, mode);
    best_k(gs, groups, k_group, keep);
    for (int64_t g = 0; g < groups; g++) {
        int kept = 0;
        for (int64_t p = 0; p < k_group; p++) kept |= keep[p] == g;
        if (!kept)
            for (int64_t i = 0; i < per; i++) score[g * per + i] = -INFINITY;
    }
}

/* Runs the selection (file comment). Returns 0, 1 for a non-finite score, 2 for sizes it does not take (beyond
 * MAX_EXPERTS, or groups that do not split the experts: the caller checked them, this keeps every read in bounds). */
int mg_select(const float *norm, const float *bias, int64_t rows, int64_t E, int64_t k, int64_t k_group,
              int64_t groups, int group_mode, int renorm, float eps, float scale, float *y, int32_t *idx) {
    if (E < 1 || E > MAX_EXPERTS || k < 1 || k > E || groups < 1 || E % groups != 0 || k_group < 1 || k_group > groups)
        return 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *n = norm + r * E;
        float score[MAX_EXPERTS];
        for (int64_t i = 0; i < E; i++) {
            score[i] = bias ? n[i] + bias[i] : n[i];
            if (!isfinite(score[i])) return 1;
        }
        if (groups > 1) mask_groups(score, E, k_group, groups, group_mode);
        int32_t *out = idx + r * k;
        best_k(score, E, k, out);
        float sum = 0.0f, *yr = y + r * k;
        for (int64_t j = 0; j < k; j++) sum += n[out[j]];
        for (int64_t j = 0; j < k; j++) yr[j] = (renorm ? n[out[j]] / (sum + eps) : n[out[j]]) * scale;
    }
    return 0;
}
