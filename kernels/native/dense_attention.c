/* Dense softmax attention on CPU for small head dims (kernels/aten/dense_attention.py binds the compiled graphs'
 * aten._scaled_dot_product_flash_attention_for_cpu calls to it); kernels/native/loader.py builds and loads this file.
 * Plain C (GCC vector extensions), no torch headers.
 *
 *   out[b,h,i] = sum_j softmax_j(scale * q[b,h,i] . k[b,g,j]) v[b,g,j],   lse[b,h,i] = log sum_j exp(...)
 * over the keys j visible to query i (all of them, or j <= i when causal: top-left aligned, as torch's kernel),
 * with g = h / (Hq / Hk) (grouped-query attention). fp32 throughout.
 *
 * Keys are cut into blocks of BK and queries into blocks of BQ; a job is (b, h, query block), spread over the
 * OpenMP threads, longest (causal) jobs first. Keys and values are packed once per call: k transposed per KV
 * head ([Dk][S], so that a score block is BK/VL vectors wide whatever Dk is) and v zero-padded to whole vectors
 * ([S][Dvp]). A job keeps its output rows, running max and running sum in a local buffer and, for each group
 * of ROWS query rows and each key block, computes the scores (ROWS x SCORE_VECTORS vectors of keys at a time
 * in registers; none past the group's last visible key), the online softmax in base 2 (exp over the visible
 * prefix of each row only: masked keys weigh exactly 0) and the P.V product.
 *
 * Columns of v past the last column that is non-zero in any KV head take no part in the products: their
 * outputs are 0 (NaN in rows whose softmax is NaN, as sum p * 0 would give). fuse_attention zero-pads v to q's
 * head dim for torch's kernel (which wants one head size), so MLA's narrower v costs only its real columns.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define BK 128                  /* keys per block */
#define BQ 64                   /* queries per job */
#define ROWS 4                  /* query rows per micro-kernel */
#if NREG >= 32
#define SCORE_VECTORS 4         /* key vectors per score micro-kernel: ROWS x 4 accumulators in registers */
#else
#define SCORE_VECTORS 2         /* 16 registers: ROWS x 2 accumulators, 2 key vectors and a broadcast */
#endif
#define KV (BK / VL)            /* vectors of one score row */
#define MAX_DV 256              /* the largest head dims */
#define MAX_DV_VECTORS (MAX_DV / VL)
#define LN2 0.693147180559945309f

struct attention_args {
    const float *q, *k, *v;
    float *out, *lse;
    int64_t batch, hq, hk, lq, lk, dk, dv;
    int64_t q_stride[3], k_stride[3], v_stride[3], out_stride[3], lse_stride[3];
    float scale;
    int causal;
};

struct packed {
    float *kt, *vp;     /* [B*Hk][Dk][Sp], [B*Hk][Sp][Dvp] */
    int64_t sp, dvp, dv_used;
};

static void pack_head(const struct attention_args *a, const struct packed *p, int64_t b, int64_t g,
                      int64_t *last_column) {
    const float *k = a->k + b * a->k_stride[0] + g * a->k_stride[1];
    const float *v = a->v + b * a->v_stride[0] + g * a->v_stride[1];
    float *kt = p->kt + (b * a->hk + g) * a->dk * p->sp, *vp = p->vp + (b * a->hk + g) * p->sp * p->dvp;
    int64_t last = -1;
    memset(kt, 0, (size_t)(a->dk * p->sp) * sizeof(float));
    memset(vp, 0, (size_t)(p->sp * p->dvp) * sizeof(float));
    for (int64_t j = 0; j < a->lk; j++) {
        for (int64_t d = 0; d < a->dk; d++) kt[d * p->sp + j] = k[j * a->k_stride[2] + d];
        for (int64_t c = 0; c < a->dv; c++) {
            float x = v[j * a->v_stride[2] + c];
            vp[j * p->dvp + c] = x;
            last = x != 0.0f && c > last ? c : last;
        }
    }
    *last_column = last;
}

static int pack(const struct attention_args *a, struct packed *p) {
    p->sp = (a->lk + BK - 1) / BK * BK;
    p->dvp = (a->dv + VL - 1) / VL * VL;
    size_t kt_bytes = (size_t)(a->batch * a->hk * a->dk * p->sp) * sizeof(float);
    size_t vp_bytes = (size_t)(a->batch * a->hk * p->sp * p->dvp) * sizeof(float);
    p->kt = aligned_alloc(64, (kt_bytes + 63) / 64 * 64);
    p->vp = aligned_alloc(64, (vp_bytes + 63) / 64 * 64);
    if (!p->kt || !p->vp) return -1;
    int64_t last = -1, heads = a->batch * a->hk;
#pragma omp parallel for schedule(static) reduction(max : last) if (heads > 1)
    for (int64_t bg = 0; bg < heads; bg++) {
        int64_t head_last;
        pack_head(a, p, bg / a->hk, bg % a->hk, &head_last);
        last = head_last > last ? head_last : last;
    }
    p->dv_used = last + 1;
    return 0;
}

/* s[r][0:SCORE_VECTORS * VL] = q_r . k_j for ROWS rows of the (scaled) query block and the keys at kt (row
 * stride sp). */
static inline void score_rows(const float *qs, int64_t dk, const float *kt, int64_t sp, float *s) {
    vf acc[ROWS][SCORE_VECTORS] = {0};
    for (int64_t d = 0; d < dk; d++) {
        const vf *kd = (const vf *)(kt + d * sp);
        vf kv[SCORE_VECTORS];
        for (int c = 0; c < SCORE_VECTORS; c++) kv[c] = kd[c];
        for (int r = 0; r < ROWS; r++) {
            float x = qs[r * dk + d];
            for (int c = 0; c < SCORE_VECTORS; c++) acc[r][c] += x * kv[c];
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < SCORE_VECTORS; c++) ((vf *)(s + r * BK))[c] = acc[r][c];
}

static inline float exp2_neg1(float x) { return exp2_neg(splat(x))[0]; }

/* Online softmax over one row's visible scores s[0:n] (the rest of the row becomes 0): updates the running max m
 * and sum l and returns the factor the row's output accumulator is to be multiplied by. */
static inline float softmax_row(vf *s, int n, float *m, float *l) {
    const vi lane = LANES;
    const int nv = (n + VL - 1) / VL;
    vf mx = splat(*m), sum = {0};
    for (int c = 0; c < nv; c++) s[c] = pick(lane + c * VL < n, s[c], splat(-INFINITY));
    for (int c = 0; c < nv; c++) mx = vmax(mx, s[c]);
    float top = hmax(mx);
    for (int c = 0; c < nv; c++) {
        s[c] = pick(s[c] == splat(-INFINITY), (vf){0}, exp2_neg(s[c] - top));
        sum += s[c];
    }
    for (int c = nv; c < KV; c++) s[c] = (vf){0};
    float corr = *m == top ? 1.0f : exp2_neg1(*m - top);
    *l = *l * corr + hsum(sum);
    *m = top;
    return corr;
}

/* o[r][c0:c0+NV] = o[r] * corr[r] + sum_j s[r][j] vp[j] over j < n, for ROWS rows (dvp: vp's row stride). */
#define VALUE_ROWS(NAME, NV)                                                                                    \
    static inline void NAME(const float *s, int n, const float *vp, int64_t dvp, int c0, const float *corr,  \
                            vf *o) {                                                                          \
        vf acc[ROWS][NV];                                                                                     \
        for (int r = 0; r < ROWS; r++)                                                                        \
            for (int c = 0; c < NV; c++) acc[r][c] = o[r * MAX_DV_VECTORS + c0 + c] * corr[r];                \
        for (int j = 0; j < n; j++) {                                                                         \
            const vf *vj = (const vf *)(vp + j * dvp) + c0;                                                   \
            for (int r = 0; r < ROWS; r++)                                                                    \
                for (int c = 0; c < NV; c++) acc[r][c] += s[r * BK + j] * vj[c];                              \
        }                                                                                                     \
        for (int r = 0; r < ROWS; r++)                                                                        \
            for (int c = 0; c < NV; c++) o[r * MAX_DV_VECTORS + c0 + c] = acc[r][c];                          \
    }
VALUE_ROWS(value_rows1, 1)
VALUE_ROWS(value_rows2, 2)

static void value_rows(const float *s, int n, const float *vp, int64_t dvp, int nv, const float *corr, vf *o) {
    int c0 = 0;
    for (; c0 + 2 <= nv; c0 += 2) value_rows2(s, n, vp, dvp, c0, corr, o);
    if (c0 < nv) value_rows1(s, n, vp, dvp, c0, corr, o);
}

/* Keys visible to query row i of a block starting at key j0 (causal: keys <= i). */
static inline int visible(const struct attention_args *a, int64_t i, int64_t j0) {
    int64_t end = a->causal && i + 1 < a->lk ? i + 1 : a->lk;
    int64_t n = end - j0;
    return n < 0 ? 0 : n > BK ? BK : (int)n;
}

struct row_state {
    float m[ROWS], l[ROWS];
    vf o[ROWS * MAX_DV_VECTORS];
};

/* One group of ROWS query rows from row i0 against every key block it sees. */
static void attend_rows(const struct attention_args *a, const struct packed *p, const float *qs, int64_t i0,
                        int rows, const float *kt, const float *vp, struct row_state *st) {
    const int nv = (int)((p->dv_used + VL - 1) / VL);
    float s[ROWS * BK] __attribute__((aligned(64)));
    int64_t last = a->causal ? (i0 + rows < a->lk ? i0 + rows : a->lk) : a->lk;
    for (int r = 0; r < ROWS; r++) st->m[r] = -INFINITY, st->l[r] = 0.0f;
    memset(st->o, 0, sizeof st->o);
    for (int64_t j0 = 0; j0 < last; j0 += BK) {
        for (int c = 0; c < BK && j0 + c < last; c += SCORE_VECTORS * VL)      /* no keys past the group's last */
            score_rows(qs, a->dk, kt + j0 + c, p->sp, s + c);
        float corr[ROWS];
        int widest = 0;
        for (int r = 0; r < ROWS; r++) {
            int n = r < rows ? visible(a, i0 + r, j0) : 0;
            widest = n > widest ? n : widest;
            corr[r] = softmax_row((vf *)(s + r * BK), n, &st->m[r], &st->l[r]);
        }
        value_rows(s, widest, vp + j0 * p->dvp, p->dvp, nv, corr, st->o);
    }
}

static void write_rows(const struct attention_args *a, const struct packed *p, int64_t b, int64_t h, int64_t i0,
                       int rows, const struct row_state *st) {
    for (int r = 0; r < rows; r++) {
        float *out = a->out + b * a->out_stride[0] + h * a->out_stride[1] + (i0 + r) * a->out_stride[2];
        const float *o = (const float *)(st->o + r * MAX_DV_VECTORS);
        float *lse = a->lse + b * a->lse_stride[0] + h * a->lse_stride[1] + (i0 + r) * a->lse_stride[2];
        if (st->m[r] == -INFINITY && st->l[r] == 0.0f) {    /* every logit -inf (no NaN): 0 and lse 0, as torch */
            for (int64_t c = 0; c < a->dv; c++) out[c] = 0.0f;
            *lse = 0.0f;
            continue;
        }
        float inv = 1.0f / st->l[r], tail = st->l[r] != st->l[r] ? st->l[r] : 0.0f;
        for (int64_t c = 0; c < a->dv; c++) out[c] = c < p->dv_used ? o[c] * inv : tail;
        *lse = st->m[r] == INFINITY ? INFINITY : (st->m[r] + log2f(st->l[r])) * LN2;    /* a +inf logit: torch's */
    }
}

static void run_job(const struct attention_args *a, const struct packed *p, int64_t job, int64_t blocks) {
    int64_t heads = a->batch * a->hq, bh = job % heads, qb = blocks - 1 - job / heads;   /* longest first */
    int64_t b = bh / a->hq, h = bh % a->hq, g = h / (a->hq / a->hk);
    const float *kt = p->kt + (b * a->hk + g) * a->dk * p->sp, *vp = p->vp + (b * a->hk + g) * p->sp * p->dvp;
    float qs[ROWS * MAX_DV];
    struct row_state st;
    for (int64_t i0 = qb * BQ; i0 < (qb + 1) * BQ && i0 < a->lq; i0 += ROWS) {
        int rows = a->lq - i0 < ROWS ? (int)(a->lq - i0) : ROWS;
        const float scale = a->scale * LOG2E;        /* scores in base 2: exp(x) = 2^(x log2 e) */
        for (int r = 0; r < ROWS; r++) {
            const float *q = a->q + b * a->q_stride[0] + h * a->q_stride[1] + (i0 + r) * a->q_stride[2];
            for (int64_t d = 0; d < a->dk; d++) qs[r * a->dk + d] = r < rows ? q[d] * scale : 0.0f;
        }
        attend_rows(a, p, qs, i0, rows, kt, vp, &st);
        write_rows(a, p, b, h, i0, rows, &st);
    }
}

/* Returns 0, or -1 when the head dims are too large or memory ran out (the caller uses torch's kernel). */
int da_attention(const struct attention_args *a) {
    if (a->dk > MAX_DV || a->dv > MAX_DV || a->hk <= 0 || a->hq % a->hk != 0) return -1;
    struct packed p = {0};
    if (pack(a, &p) != 0) {
        free(p.kt);
        free(p.vp);
        return -1;
    }
    int64_t blocks = (a->lq + BQ - 1) / BQ, jobs = a->batch * a->hq * blocks;
#pragma omp parallel for schedule(dynamic, 1) if (jobs > 1)
    for (int64_t job = 0; job < jobs; job++) run_job(a, &p, job, blocks);
    free(p.kt);
    free(p.vp);
    return 0;
}
