/* The AMX tile instructions the amx_bf16 kernels use, in plain C, so that this level's code can be tested (and run
 * under the sanitizers) on a CPU without AMX: a build with -DASCEND_DSA_AMX_EMULATED instead of -mamx-tile
 * -mamx-bf16 (kernels/native/cpu_isa.py, ASCEND_DSA_AMX_EMULATED=1). Slow; for correctness only, never for speed.
 *
 * Each thread has eight tiles and a configuration of its own, as on the hardware, following the Intel SDM: a load
 * fills a tile's configured rows x bytes from memory and zeroes the rest; a store writes the configured rows x
 * bytes; TDPBF16PS adds to C[m][n], for each pair k of A's row m, A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1] (bf16
 * values, exact products, fp32 sums; bf16 denormals read as zero and fp32 denormal results flushed to zero). What
 * the hardware faults on aborts with a message: a tile instruction before this thread's configuration, a tile the
 * configuration leaves empty, tile shapes a dot product cannot combine. */
#ifndef ASCEND_DSA_AMX_EMULATED_H
#define ASCEND_DSA_AMX_EMULATED_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct amx_emulated_tile {
    int rows, colsb;
    uint8_t data[16][64];
};

static __thread struct {
    int configured;
    struct amx_emulated_tile tile[8];
} amx_emulated;

static long amx_emulated_count;        /* tile dot products this library has run, all threads */

/* For tests: that count (a kernel whose tile path became unreachable would leave it at 0). */
long amx_emulated_products(void) { return __atomic_load_n(&amx_emulated_count, __ATOMIC_RELAXED); }

static void amx_emulated_fault(const char *what, int t) {
    fprintf(stderr, "ascend-dsa AMX emulation: %s (tile %d)\n", what, t);
    abort();
}

static struct amx_emulated_tile *amx_emulated_tile(int t) {
    if (!amx_emulated.configured) amx_emulated_fault("tile instruction before _tile_loadconfig on this thread", t);
    if (t < 0 || t > 7 || amx_emulated.tile[t].rows == 0) amx_emulated_fault("tile not configured", t);
    return &amx_emulated.tile[t];
}

/* The 64-byte configuration: palette (byte 0), bytes per row of tile t (uint16 at 16 + 2t), rows (byte 48 + t). */
static void amx_emulated_loadconfig(const void *config) {
    const uint8_t *c = config;
    if (c[0] != 1) amx_emulated_fault("palette other than 1", -1);
    for (int t = 0; t < 8; t++) {
        struct amx_emulated_tile *x = &amx_emulated.tile[t];
        x->colsb = c[16 + 2 * t] | c[17 + 2 * t] << 8;
        x->rows = c[48 + t];
        if (x->colsb > 64 || x->rows > 16 || (x->rows == 0) != (x->colsb == 0) || x->colsb % 4)
            amx_emulated_fault("configuration out of range", t);
        memset(x->data, 0, sizeof x->data);
    }
    amx_emulated.configured = 1;
}

static void amx_emulated_release(void) { memset(&amx_emulated, 0, sizeof amx_emulated); }

static void amx_emulated_zero(int t) { memset(amx_emulated_tile(t)->data, 0, sizeof amx_emulated.tile[0].data); }

static void amx_emulated_load(int t, const void *base, long stride) {
    struct amx_emulated_tile *x = amx_emulated_tile(t);
    memset(x->data, 0, sizeof x->data);
    for (int r = 0; r < x->rows; r++) memcpy(x->data[r], (const char *)base + r * stride, (size_t)x->colsb);
}

static void amx_emulated_store(int t, void *base, long stride) {
    struct amx_emulated_tile *x = amx_emulated_tile(t);
    for (int r = 0; r < x->rows; r++) memcpy((char *)base + r * stride, x->data[r], (size_t)x->colsb);
}

static float amx_emulated_bf16(const uint8_t *p) {
    uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    float x;
    memcpy(&x, &bits, 4);
    return fpclassify(x) == FP_SUBNORMAL ? copysignf(0.0f, x) : x;
}

static void amx_emulated_dpbf16ps(int tc, int ta, int tb) {
    struct amx_emulated_tile *c = amx_emulated_tile(tc), *a = amx_emulated_tile(ta), *b = amx_emulated_tile(tb);
    int pairs = a->colsb / 4, columns = c->colsb / 4;
    if (a->rows != c->rows || b->rows != pairs || b->colsb != c->colsb)
        amx_emulated_fault("tile shapes a bf16 dot product cannot combine", tc);
    __atomic_add_fetch(&amx_emulated_count, 1, __ATOMIC_RELAXED);
    for (int m = 0; m < c->rows; m++)
        for (int k = 0; k < pairs; k++)
            for (int n = 0; n < columns; n++) {
                float sum;
                memcpy(&sum, c->data[m] + 4 * n, 4);
                for (int e = 0; e < 2; e++)
                    sum += amx_emulated_bf16(a->data[m] + 4 * k + 2 * e)
                           * amx_emulated_bf16(b->data[k] + 4 * n + 2 * e);
                if (fpclassify(sum) == FP_SUBNORMAL) sum = copysignf(0.0f, sum);
                memcpy(c->data[m] + 4 * n, &sum, 4);
            }
}

/* The intrinsics' names (immintrin.h's own definitions replaced). */
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) amx_emulated_loadconfig(config)
#define _tile_release() amx_emulated_release()
#define _tile_zero(t) amx_emulated_zero(t)
#define _tile_loadd(t, base, stride) amx_emulated_load(t, base, stride)
#define _tile_stored(t, base, stride) amx_emulated_store(t, base, stride)
#define _tile_dpbf16ps(c, a, b) amx_emulated_dpbf16ps(c, a, b)

#endif
