/* Depthwise 1-D convolution (stride 1, dilation 1, one filter per channel), fp32, for
 * kernels/aten/depthwise_conv1d.py; kernels/native/loader.py builds and loads this file. Plain C (GCC vector extensions),
 * no torch headers.
 *
 *   out[b][c][t] = bias[c] + sum_k w[c][k] * x[b][c][t + k - pad]     (x is zero outside [0, T))
 *
 * x [B][C][T], w [C][K], out [B][C][To] and bias [C] (or NULL) are read and written through their element
 * strides (any layout). Three ways through, all split over OpenMP threads:
 * - channels-last input (channel stride 1: the transposed [B, T, C] views linear-attention layers convolve)
 *   and K <= KMAX: tiles of VL channels x TB steps. VL steps at a time are VL channel vectors, summed over the
 *   taps from the VL + K - 1 input rows they read (each row loaded once; independent chains); then transposed
 *   in registers and stored as VL runs of VL steps of the output rows (or stored as they are when the output
 *   is channels-last too). Channels past the last multiple of VL take the third way.
 * - other inputs, fewer than VL output steps (decode): blocks of CBLOCK channels, one step at a time,
 *   vectorised along the channels.
 * - other inputs: one channel row at a time in blocks of RB steps; where all taps fall inside x and time is
 *   contiguous in x and the output, 8 vectors of steps at a time (independent chains); elsewhere one step at
 *   a time.
 * Sums run bias first, then in tap order; results agree with oneDNN to fp32 rounding.
 */
#include <stdint.h>
#include <string.h>

#define VL 8                  /* channels per vector (and steps per transposed block) */
#define TB 64                 /* output steps per channels-last tile (a multiple of VL) */
#define RB 2048               /* output steps per row block */
#define CBLOCK 256            /* channels per block of a short output */
#define KMAX 32               /* the most taps the channels-last tiles take (their weights sit on the stack) */
#define PARALLEL_MIN 32768    /* multiply-adds below which one thread does all the work (a fork costs more) */

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

typedef struct {
    const float *x;
    int64_t C, T, sxb, sxc, sxt;
    const float *w;
    int64_t swc, swk, K;
    const float *bias;
    int64_t sbias, pad;
    float *out;
    int64_t To, sob, soc, sot;
} Conv;

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Swaps bit `bit` of the row index with the same bit of the column index, for the row pairs r[i], r[i | bit]. */
static inline void swap_bit(vf r[VL], int bit, vi lo, vi hi) {
    for (int i = 0; i < VL; i++)
        if (!(i & bit)) {
            vf a = r[i], b = r[i | bit];
            r[i] = __builtin_shuffle(a, b, lo);
            r[i | bit] = __builtin_shuffle(a, b, hi);
        }
}

static inline void transpose(vf r[VL]) {
    swap_bit(r, 1, (vi){0, 8, 2, 10, 4, 12, 6, 14}, (vi){1, 9, 3, 11, 5, 13, 7, 15});
    swap_bit(r, 2, (vi){0, 1, 8, 9, 4, 5, 12, 13}, (vi){2, 3, 10, 11, 6, 7, 14, 15});
    swap_bit(r, 4, (vi){0, 1, 2, 3, 8, 9, 10, 11}, (vi){4, 5, 6, 7, 12, 13, 14, 15});
}

/* Stores v[s] (channels c0.. of step t0 + s, s < n) at o; transposed unless channels are the output's unit
 * stride. */
static void store_steps(const Conv *p, float *o, vf v[VL], int64_t n) {
    if (p->soc == 1) {
        for (int64_t s = 0; s < n; s++) memcpy(o + s * p->sot, &v[s], sizeof v[s]);
        return;
    }
    transpose(v);
    if (p->sot == 1 && n == VL) {
        for (int c = 0; c < VL; c++) memcpy(o + c * p->soc, &v[c], sizeof v[c]);
        return;
    }
    for (int c = 0; c < VL; c++)
        for (int64_t s = 0; s < n; s++) o[c * p->soc + s * p->sot] = v[c][s];
}

/* steps[s] = the sums of channels c0.. (xb points at them) for steps ts + s, s < n, any of them at the edges. */
static void edge_steps(const Conv *p, const float *xb, const vf *wk, vf bias, int64_t ts, int64_t n, vf *steps) {
    for (int64_t s = 0; s < n; s++) {
        int64_t t = ts + s, k_lo = max64(0, p->pad - t), k_hi = min64(p->K, p->T + p->pad - t);
        vf acc = bias;
        for (int64_t k = k_lo; k < k_hi; k++) acc += wk[k] * load(xb + (t + k - p->pad) * p->sxt);
        steps[s] = acc;
    }
}

/* steps[s] for VL steps whose taps all fall inside x, reading the VL + K - 1 input rows from x0 once each.
 * Inlined with a constant K where the caller has one, so the rows stay in registers. */
static inline __attribute__((always_inline)) void inner_steps(const float *x0, int64_t sxt, const vf *wk, vf bias,
                                                              int64_t K, vf *steps) {
    vf rows[VL + KMAX - 1];
    for (int64_t r = 0; r < VL + K - 1; r++) rows[r] = load(x0 + r * sxt);
    for (int s = 0; s < VL; s++) steps[s] = bias;
    for (int64_t k = 0; k < K; k++)
        for (int s = 0; s < VL; s++) steps[s] += wk[k] * rows[s + k];
}

/* Channels c0..c0+VL, steps t0..t0+TB of batch b, for a channel-stride-1 input (file comment). */
static void vector_tile(const Conv *p, int64_t b, int64_t c0, int64_t t0) {
    vf wk[KMAX], bias = {0}, steps[VL];
    for (int64_t k = 0; k < p->K; k++)
        for (int c = 0; c < VL; c++) wk[k][c] = p->w[(c0 + c) * p->swc + k * p->swk];
    if (p->bias)
        for (int c = 0; c < VL; c++) bias[c] = p->bias[(c0 + c) * p->sbias];
    const float *xb = p->x + b * p->sxb + c0;
    float *ob = p->out + b * p->sob + c0 * p->soc;
    int64_t t_end = min64(t0 + TB, p->To), sxt = p->sxt;
    for (int64_t ts = t0; ts < t_end; ts += VL) {
        int64_t n = min64(VL, t_end - ts);
        if (n < VL || ts < p->pad || ts + VL - 1 + p->K - 1 - p->pad >= p->T)
            edge_steps(p, xb, wk, bias, ts, n, steps);
        else if (p->K == 4) inner_steps(xb + (ts - p->pad) * sxt, sxt, wk, bias, 4, steps);
        else if (p->K == 3) inner_steps(xb + (ts - p->pad) * sxt, sxt, wk, bias, 3, steps);
        else inner_steps(xb + (ts - p->pad) * sxt, sxt, wk, bias, p->K, steps);
        for (int64_t s = n; s < VL; s++) steps[s] = bias;      /* (transposed, never stored) */
        store_steps(p, ob + ts * p->sot, steps, n);
    }
}

/* The sum of step t for the channel at xc / wc (stride-general; any step, taps outside x skipped). */
static float one_step(const Conv *p, const float *xc, const float *wc, float bias, int64_t t) {
    int64_t k_lo = max64(0, p->pad - t), k_hi = min64(p->K, p->T + p->pad - t);
    float acc = bias;
    for (int64_t k = k_lo; k < k_hi; k++) acc += wc[k * p->swk] * xc[(t + k - p->pad) * p->sxt];
    return acc;
}

/* Steps [a, e) of a time-contiguous channel into a time-contiguous output row, all taps inside x: 8 vectors of
 * steps at a time (independent chains), then one; returns where it stopped. */
static int64_t inner_vectors(const Conv *p, const float *xc, const float *wc, float bias, int64_t a, int64_t e,
                             float *o) {
    int64_t t = a;
    for (; t + 8 * VL <= e; t += 8 * VL) {
        vf acc[8];
        for (int j = 0; j < 8; j++) acc[j] = (vf){0} + bias;
        for (int64_t k = 0; k < p->K; k++) {
            const float *xk = xc + t + k - p->pad;
            float wv = wc[k * p->swk];
            for (int j = 0; j < 8; j++) acc[j] += wv * load(xk + j * VL);
        }
        for (int j = 0; j < 8; j++) memcpy(o + t + j * VL, &acc[j], sizeof acc[j]);
    }
    for (; t + VL <= e; t += VL) {
        vf acc = (vf){0} + bias;
        for (int64_t k = 0; k < p->K; k++) acc += wc[k * p->swk] * load(xc + t + k - p->pad);
        memcpy(o + t, &acc, sizeof acc);
    }
    return t;
}

/* Channel c, steps t0..t0+RB of batch b (file comment). */
static void row_block(const Conv *p, int64_t b, int64_t c, int64_t t0) {
    int64_t t_end = min64(t0 + RB, p->To);
    int64_t a = min64(max64(t0, p->pad), t_end), e = max64(min64(t_end, p->T - p->K + 1 + p->pad), a);
    float bias = p->bias ? p->bias[c * p->sbias] : 0.0f;
    const float *xc = p->x + b * p->sxb + c * p->sxc, *wc = p->w + c * p->swc;
    float *o = p->out + b * p->sob + c * p->soc;
    int64_t t = t0;
    for (; t < a; t++) o[t * p->sot] = one_step(p, xc, wc, bias, t);
    if (p->sxt == 1 && p->sot == 1) t = inner_vectors(p, xc, wc, bias, a, e, o);
    for (; t < t_end; t++) o[t * p->sot] = one_step(p, xc, wc, bias, t);
}

/* Channels [c0, c1) of batch b, every step, vectorised along the channels (file comment). */
static void channel_block(const Conv *p, int64_t b, int64_t c0, int64_t c1) {
    const float *xb = p->x + b * p->sxb;
    for (int64_t t = 0; t < p->To; t++) {
        int64_t k_lo = max64(0, p->pad - t), k_hi = min64(p->K, p->T + p->pad - t);
        float *o = p->out + b * p->sob + t * p->sot;
        if (p->bias) {
            for (int64_t c = c0; c < c1; c++) o[c * p->soc] = p->bias[c * p->sbias];
        } else {
            for (int64_t c = c0; c < c1; c++) o[c * p->soc] = 0.0f;
        }
        for (int64_t k = k_lo; k < k_hi; k++) {
            const float *xk = xb + (t + k - p->pad) * p->sxt;
#pragma omp simd
            for (int64_t c = c0; c < c1; c++) o[c * p->soc] += p->w[c * p->swc + k * p->swk] * xk[c * p->sxc];
        }
    }
}

/* The convolution (file comment); all sizes >= 1, T + 2 pad >= K. bias may be NULL. */
void dwc_conv1d(const float *x, int64_t B, int64_t C, int64_t T, int64_t sxb, int64_t sxc, int64_t sxt,
                const float *w, int64_t swc, int64_t swk, int64_t K, const float *bias, int64_t sbias, int64_t pad,
                float *out, int64_t To, int64_t sob, int64_t soc, int64_t sot) {
    Conv p = {x, C, T, sxb, sxc, sxt, w, swc, swk, K, bias, sbias, pad, out, To, sob, soc, sot};
    int64_t groups = (sxc == 1 && K <= KMAX) ? C / VL : 0, c_rows = groups * VL;
    int64_t tiles = (To + TB - 1) / TB, blocks = (To + RB - 1) / RB, cblocks = (C + CBLOCK - 1) / CBLOCK;
    int by_channel = groups == 0 && To < VL;
#pragma omp parallel if (B * C * To * K >= PARALLEL_MIN)
    {
#pragma omp for collapse(3) schedule(static) nowait
        for (int64_t b = 0; b < B; b++)
            for (int64_t tb = 0; tb < tiles; tb++)
                for (int64_t g = 0; g < groups; g++) vector_tile(&p, b, g * VL, tb * TB);
        if (by_channel) {
#pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < B; b++)
                for (int64_t cb = 0; cb < cblocks; cb++) channel_block(&p, b, cb * CBLOCK, min64(C, (cb + 1) * CBLOCK));
        } else {
#pragma omp for collapse(3) schedule(static)
            for (int64_t b = 0; b < B; b++)
                for (int64_t c = c_rows; c < C; c++)
                    for (int64_t tb = 0; tb < blocks; tb++) row_block(&p, b, c, tb * RB);
        }
    }
}
