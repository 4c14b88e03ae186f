/* The indexer's decode row (scores and top-k, one thread and a team: the team splits the selection) and sparse
 * attention's decode call (one thread, and entries split across a team) of the generic build, against plain
 * double-precision references. Built for aarch64 and run under qemu by tests/kernels/test_aarch64.py; prints one
 * line per check and exits 1 when one is wrong. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int li_row_topk(const void *key, int dtype, int64_t row_stride, int64_t block_stride, const int32_t *table,
                int64_t block_size, const uint8_t *scale, int64_t scale_row, int64_t scale_block, int64_t n,
                const void *q, int q_dtype, const float *w, int64_t h, int64_t d, int bf16_dot, int threads,
                int64_t k, float *score, int32_t *idx, float *val);
int sfa_attend(const float *q, const float *q_rope, int64_t H, int64_t DL, int64_t DR, const void *idx, int idx64,
               int64_t idx_stride, int64_t K, int64_t block, int64_t lq, int64_t lkv, int causal, int64_t start,
               const void *table, int table64, int64_t block_size, const void *kv, int64_t kv_stride, const void *value,
               int64_t value_stride, const void *rope, int64_t rope_stride, int kv_dtype, int rope_dtype,
               float scale, int bf16_dot, int threads, int64_t split_rows, float *out, float *smax, float *ssum);

static float rnd(void) { return (float)rand() / RAND_MAX * 2.0f - 1.0f; }

static int check_indexer(int threads) {
    const int64_t n = 6000, h = 64, d = 128, k = 512;
    float *key = malloc(n * d * 4), *q = malloc(h * d * 4), w[64], *score = malloc(n * 4), *ref = malloc(n * 4), val[512];
    int32_t idx[512];
    for (int64_t i = 0; i < n * d; i++) key[i] = rnd();
    for (int64_t i = 0; i < h * d; i++) q[i] = rnd();
    for (int j = 0; j < h; j++) w[j] = rnd();
    if (li_row_topk(key, 0, d, 0, NULL, 1, NULL, 0, 0, n, q, 0, w, h, d, 0, threads, k, score, idx, val) < 0) return 1;
    for (int64_t s = 0; s < n; s++) {
        double t = 0;
        for (int j = 0; j < h; j++) {
            double dot = 0;
            for (int64_t x = 0; x < d; x++) dot += (double)q[j * d + x] * key[s * d + x];
            t += w[j] * (dot > 0 ? dot : 0);
        }
        ref[s] = (float)t;
    }
    int bad = 0;
    for (int64_t i = 0; i < k; i++) {
        if (fabsf(ref[idx[i]] - val[i]) > 1e-3f * (1 + fabsf(val[i]))) bad++;
        if (i && val[i] > val[i - 1]) bad++;
    }
    int64_t above = 0;                 /* keys whose reference score beats the k-th kept value by a margin */
    for (int64_t s = 0; s < n; s++) above += ref[s] > val[k - 1] + 1e-3f * (1 + fabsf(val[k - 1]));
    bad += above > k;
    printf("indexer, %d threads: %s\n", threads, bad ? "WRONG" : "ok");
    free(key); free(q); free(score); free(ref);
    return bad != 0;
}

static int check_sfa(int threads) {
    const int64_t H = 16, DL = 64, DR = 16, S = 4000, K = 512;
    float *q = malloc(H * DL * 4), *qr = malloc(H * DR * 4), *kv = malloc(S * DL * 4), *rope = malloc(S * DR * 4);
    float *out = malloc(H * DL * 4), smax[16], ssum[16];
    int64_t *idx = malloc(K * 8);
    for (int64_t i = 0; i < H * DL; i++) q[i] = rnd();
    for (int64_t i = 0; i < H * DR; i++) qr[i] = rnd();
    for (int64_t i = 0; i < S * DL; i++) kv[i] = rnd();
    for (int64_t i = 0; i < S * DR; i++) rope[i] = rnd();
    for (int64_t i = 0; i < K; i++) idx[i] = (i * 7919) % S;
    float scale = 0.1f;
    if (!sfa_attend(q, qr, H, DL, DR, idx, 1, K, K, 1, 1, S, 1, 0, NULL, 1, 1, kv, DL, NULL, 0, rope, DR, 0, 0, scale,
                    0, threads, 256, out, smax, ssum)) return 1;
    int bad = 0;
    for (int64_t hh = 0; hh < H; hh++) {
        double lg[512], mx = -1e30, sum = 0;
        for (int64_t r = 0; r < K; r++) {
            double t = 0;
            for (int64_t x = 0; x < DL; x++) t += (double)q[hh * DL + x] * kv[idx[r] * DL + x];
            for (int64_t x = 0; x < DR; x++) t += (double)qr[hh * DR + x] * rope[idx[r] * DR + x];
            lg[r] = t * scale;
            mx = lg[r] > mx ? lg[r] : mx;
        }
        for (int64_t r = 0; r < K; r++) sum += exp(lg[r] - mx);
        for (int64_t x = 0; x < DL; x++) {
            double o = 0;
            for (int64_t r = 0; r < K; r++) o += exp(lg[r] - mx) / sum * kv[idx[r] * DL + x];
            if (fabs(o - out[hh * DL + x]) > 1e-4) bad++;
        }
        if (fabs(mx - smax[hh]) > 1e-4 || fabs(sum - ssum[hh]) > 1e-3 * sum) bad++;
    }
    printf("sparse attention, %d threads: %s\n", threads, bad ? "WRONG" : "ok");
    free(q); free(qr); free(kv); free(rope); free(out); free(idx);
    return bad != 0;
}

int main(void) {
    int bad = 0;
    for (int threads = 1; threads <= 4; threads += 3) bad |= check_indexer(threads) | check_sfa(threads);
    return bad;
}
