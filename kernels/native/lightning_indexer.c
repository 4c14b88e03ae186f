/* Lightning indexer scores on CPU for ascend_dsa::lightning_indexer (kernels/indexer/native.py);
 * kernels/native/loader.py builds and loads this file. Plain C (GCC vector extensions), no torch headers.
 *
 * For one query token (H heads of dim D) and the keys s = 0 .. n-1 of one batch row:
 *   score[s] = sum_h w[h] * relu(q[h] . key[s])                                  (fp32 accumulation)
 * Key s is row s of a [S, D] matrix (row stride `row_stride` values), or, through a paged cache's block table,
 * row s % block_size of block table[s / block_size] (block stride `block_stride` values). Keys are fp32,
 * bf16 or fp16 (fp16 needs the compiler's _Float16: li_has_f16), or MXFP8: float8_e4m3fn codes with one E8M0
 * scale byte e per 32 values (value 2^(e-127) * code; e = 255 is NaN), the scale rows paged like the key rows
 * (`scale`, `scale_row` and `scale_block` bytes). An MXFP8 row is decoded exactly (a code has 4 significant bits)
 * where it is scored: into the chunk's fp32 rows, or into a few bf16 rows for the bf16 dot products, never into a
 * copy of the cache.
 *
 * The scores never form an [H, S] matrix. Two micro-kernels:
 * - fp32: a chunk of KC keys is widened to fp32 once (whole vectors: bf16 by a 16-bit shift, fp16 by the
 *   hardware's conversion), then scored one block of heads at a time (the query packed per block, [D][heads of
 *   the block], so a block's query stays in L1 while the chunk's keys go past it): a register tile of keys x
 *   head vectors takes one fused multiply-add per (key, dim, vector), and the ReLU, the weights and the sum over
 *   the block's heads are applied to the tile in registers, into one vector of partial sums per key, reduced to
 *   the key's score once all blocks are done;
 * - bf16 dot products (AVX512-BF16, bf16 query and keys): the query as bf16 pairs [D/2, H], one vdpbf16ps per
 *   (key, pair of dims, 16 heads) straight on the stored keys (products exact, sums in fp32 as above).
 * OpenMP threads (torch's pool: right after a torch op its threads are still spinning, so they start at once)
 * take chunks of CHUNK keys as they come; a call with little work runs on the calling thread.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "topk_select.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

/* fp32 register tiles (keys x head vectors): the accumulators, the block's query vectors and a broadcast key
 * value fit the level's registers (16: 6 x 2 + 2 + 1; 32: 6 x 4 + 4 + 1), at most TILE_MAX keys. */
#if NREG >= 32
#define NB_MAX 4
#else
#define NB_MAX 2
#endif
#define TILE_MAX 8
#define TILE_KEYS(nb) ((NREG - 1 - (nb)) / (nb) < TILE_MAX ? (NREG - 1 - (nb)) / (nb) : TILE_MAX)
#define KC 48      /* keys widened to fp32 at a time: a multiple of every TILE_KEYS (6 and 8) */
#define KC_ALIGN 24   /* a chunk's rows are zero-padded to a multiple of this: of every TILE_KEYS too */
#define CHUNK 480  /* keys per unit of work, a multiple of KC: threads take chunks as they come (a thread still
                      waking up from sleep takes fewer) */
#define PARALLEL_MIN_MACS (1 << 22)   /* below ~0.1 ms of work the calling thread scores every key: waking a
                                         team costs more, and far more when another process holds a core */

int li_has_f16(void) {
#ifdef __FLT16_MANT_DIG__
    return 1;
#else
    return 0;
#endif
}

int li_has_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

struct keys {
    const char *base;          /* key (or cache) data */
    int dtype;
    int64_t row_stride;        /* values between rows (within a block when paged) */
    int64_t block_stride;      /* values between blocks of a paged cache */
    const int32_t *table;      /* block table row of this batch, or NULL */
    int64_t block_size;
    const uint8_t *scale;      /* MXFP8 keys: their E8M0 scale bytes (rows of d / MX_GROUP); int8 keys: the bytes of
                                * their fp32 scales (one a row); else NULL */
    int64_t scale_row;         /* bytes between scale rows (within a block when paged) */
    int64_t scale_block;       /* bytes between blocks of the paged scales */
};

static const char *key_row(const struct keys *k, int64_t s) {
    int64_t offset = k->table ? (int64_t)k->table[s / k->block_size] * k->block_stride
                                    + (s % k->block_size) * k->row_stride
                              : s * k->row_stride;
    return k->base + offset * elem_bytes(k->dtype);
}

#define MX_GROUP 32   /* values per E8M0 scale of an MXFP8 key */

static const uint8_t *scale_row(const struct keys *k, int64_t s) {
    return k->scale + (k->table ? (int64_t)k->table[s / k->block_size] * k->scale_block
                                       + (s % k->block_size) * k->scale_row
                                : s * k->scale_row);
}

/* 2^(e - 127) for an E8M0 byte e (e = 0: 2^-127, a subnormal float); e = 255 is NaN. */
static inline float e8m0_factor(uint8_t e) {
    uint32_t bits = e == 255 ? 0x7FC00000u : e == 0 ? 0x00400000u : (uint32_t)e << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The d values of MXFP8 key s as fp32 (d a multiple of MX_GROUP, itself a multiple of VL). */
static void e4m3_row_f32(const struct keys *k, int64_t s, int64_t d, float *dst) {
    const uint8_t *row = (const uint8_t *)key_row(k, s), *sc = scale_row(k, s);
    for (int64_t g = 0; g < d; g += MX_GROUP) {
        vf f = splat(e8m0_factor(sc[g / MX_GROUP]));
        for (int64_t i = g; i < g + MX_GROUP; i += VL) vstore(dst + i, e4m3_vec(row + i, f));
    }
}

/* The d values of int8 key s times its fp32 scale, as fp32 (one rounding a value, as the torch path's product). */
static void i8_row_f32(const struct keys *k, int64_t s, int64_t d, float *dst) {
    const int8_t *row = (const int8_t *)key_row(k, s);
    float f;
    memcpy(&f, scale_row(k, s), sizeof f);
    for (int64_t i = 0; i < d; i++) dst[i] = (float)row[i] * f;
}

/* Key s as fp32 values at dst: widened a vector at a time (row_to_f32), MXFP8 / int8 decoded with their scales. */
static void key_f32(const struct keys *k, int64_t s, int64_t d, float *dst) {
    if (k->dtype == E4M3) e4m3_row_f32(k, s, d, dst);
    else if (k->dtype == I8) i8_row_f32(k, s, d, dst);
    else row_to_f32(dst, key_row(k, s), k->dtype, d);
}

/* Starts the way into the cache of key s's row (and scale row). */
static void prefetch_key(const struct keys *k, int64_t s, int64_t d) {
    const char *row = key_row(k, s);
    for (int64_t off = 0; off < d * elem_bytes(k->dtype); off += 64) __builtin_prefetch(row + off, 0, 3);
    if (k->scale) __builtin_prefetch(scale_row(k, s), 0, 3);
}

/* Partial sums tot[0:kb] += w * relu(acc) over the nb head vectors of a tile (a max and a fused multiply-add per
 * vector); w [h] is followed by h lane masks (all ones for a real head, zero for padding) that clear a padded
 * head's dot product first, so a padded head, whose zero query meets an infinite key as 0 * inf = NaN, adds
 * nothing. */
static inline __attribute__((always_inline)) void add_weighted_relu(vf acc[TILE_MAX][NB_MAX], const float *w,
                                                                    int64_t h, const int kb, const int nb,
                                                                    vf *tot) {
    for (int j = 0; j < nb; j++) {
        vf wv = vload(w + j * VL);
        vi real;
        memcpy(&real, w + h + j * VL, sizeof real);
        for (int k = 0; k < kb; k++) tot[k] += relu((vf)((vi)acc[k][j] & real)) * wv;
    }
}

/* fp32 micro-kernel: kb keys (rows kf[k*d : k*d+d]) against the nb head vectors of a block, query qb [d][nb*VL].
 * Always inlined with constant kb and nb, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_f32(const float *kf, const float *qb, const float *w,
                                                           int64_t d, int64_t h, const int kb, const int nb,
                                                           vf *tot) {
    vf acc[TILE_MAX][NB_MAX] = {{{0}}};
    for (int64_t i = 0; i < d; i++) {
        vf qv[NB_MAX];
        for (int j = 0; j < nb; j++) qv[j] = vload(qb + (i * nb + j) * VL);
        for (int k = 0; k < kb; k++) {
            float kv = kf[k * d + i];     /* a scalar operand: broadcast straight from memory */
            for (int j = 0; j < nb; j++) acc[k][j] += qv[j] * kv;
        }
    }
    add_weighted_relu(acc, w, h, kb, nb, tot);
}

/* The keys [0, m) of a chunk (kf, m a multiple of KC_ALIGN) against one block of nb head vectors. */
static inline __attribute__((always_inline)) void block_f32(const float *kf, int64_t m, const float *qb,
                                                            const float *w, int64_t d, int64_t h, const int nb,
                                                            vf *tot) {
    const int kb = TILE_KEYS(nb);
    for (int64_t s = 0; s < m; s += kb) tile_f32(kf + s * d, qb, w, d, h, kb, nb, tot + s);
}

/* Keys c0 .. c0+m-1 widened to fp32 rows kf [m][d], then zero rows up to a multiple of KC_ALIGN; the rows of
 * the next chunk are prefetched (caches cold after other work). */
static int64_t widen_chunk(const struct keys *k, int64_t c0, int64_t m, int64_t next, int64_t d, float *kf) {
    for (int64_t i = 0; i < next; i++) prefetch_key(k, c0 + m + i, d);
    for (int64_t i = 0; i < m; i++) key_f32(k, c0 + i, d, kf + i * d);
    int64_t padded = (m + KC_ALIGN - 1) / KC_ALIGN * KC_ALIGN;
    memset(kf + m * d, 0, (size_t)((padded - m) * d) * sizeof(float));
    return padded;
}

/* Scores of keys [start, end) into score[start:end]: chunks of KC keys widened into kf [KC][d], each scored
 * against every block of heads of the packed query qp (blocks of NB_MAX vectors, the last one narrower). */
static void score_range_f32(const struct keys *k, const float *qp, const float *w, int64_t d, int64_t h,
                            int64_t start, int64_t end, float *kf, float *score) {
    for (int64_t c0 = start; c0 < end; c0 += KC) {
        int64_t m = end - c0 < KC ? end - c0 : KC;
        int64_t after = end - c0 - m;
        int64_t padded = widen_chunk(k, c0, m, after < KC ? after : KC, d, kf);
        vf tot[KC] = {{0}};
        for (int64_t hb = 0; hb < h; hb += NB_MAX * VL) {
            int nb = (int)((h - hb) / VL < NB_MAX ? (h - hb) / VL : NB_MAX);
            const float *qb = qp + hb * d;
            if (nb == NB_MAX) block_f32(kf, padded, qb, w + hb, d, h, NB_MAX, tot);
            else if (nb == 1) block_f32(kf, padded, qb, w + hb, d, h, 1, tot);
#if NB_MAX == 4
            else if (nb == 2) block_f32(kf, padded, qb, w + hb, d, h, 2, tot);
            else block_f32(kf, padded, qb, w + hb, d, h, 3, tot);
#endif
        }
        for (int64_t i = 0; i < m; i++) score[c0 + i] = hsum(tot[i]);
    }
}

/* The query q [h][d] packed for the fp32 micro-kernel: per block of NB_MAX head vectors (the last one holding
 * the rest), [d][heads of the block], heads padded with zeros to hp. */
static void pack_query(const void *q, int q_dtype, int64_t h, int64_t hp, int64_t d, float *qp) {
    for (int64_t hb = 0; hb < hp; hb += NB_MAX * VL) {
        int64_t width = hp - hb < NB_MAX * VL ? hp - hb : NB_MAX * VL;
        for (int64_t i = 0; i < d; i++)
            for (int64_t j = 0; j < width; j++) qp[hb * d + i * width + j] = hb + j < h ? load_value(q, q_dtype, (hb + j) * d + i) : 0.0f;
    }
}

#ifdef __AVX512BF16__
/* bf16 register tiles: one 16-head vector takes KB_ONE keys, more take KB_MANY keys against up to MAX_NB vectors
 * (32 registers: 4 x 4 + 4). */
#define KB_ONE 8
#define KB_MANY 4
#define MAX_NB 4
#define PF_KEYS 96  /* keys ahead whose rows are prefetched */

/* bf16 micro-kernel: kb stored bf16 rows against nb 16-head vectors of the pair-packed query qp [d/2][h]. */
static inline __attribute__((always_inline)) void block_bf16(const char *const *rows, const uint32_t *qp,
                                                             const float *w, int64_t d, int64_t h, int64_t hb,
                                                             const int kb, const int nb, vf *tot) {
    __m512 acc[KB_ONE][MAX_NB];
    for (int k = 0; k < kb; k++)
        for (int j = 0; j < nb; j++) acc[k][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d / 2; p++) {
        const uint32_t *qrow = qp + p * h + hb;
        __m512bh qv[MAX_NB];
        for (int j = 0; j < nb; j++) qv[j] = (__m512bh)_mm512_loadu_si512(qrow + j * VL);
        for (int k = 0; k < kb; k++) {
            int32_t pair;
            memcpy(&pair, rows[k] + 4 * p, sizeof pair);
            __m512bh kv = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < nb; j++) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], qv[j], kv);
        }
    }
    vf lanes[TILE_MAX][NB_MAX];
    for (int k = 0; k < kb; k++) memcpy(lanes[k], acc[k], (size_t)nb * sizeof(vf));
    add_weighted_relu(lanes, w + hb, h, kb, nb, tot);
}

/* The rows of keys s0 .. s0+kb-1 (clamped to n-1): one block-table lookup unless the keys cross a block. */
static void key_rows(const struct keys *k, int64_t s0, int kb, int64_t n, const char **rows) {
    const char *first = key_row(k, s0);
    int64_t room = k->table ? k->block_size - s0 % k->block_size : kb;
    for (int i = 0; i < kb; i++)
        rows[i] = s0 + i >= n ? key_row(k, n - 1)
                : i < room  ? first + (int64_t)i * k->row_stride * 2
                            : key_row(k, s0 + i);
}

/* 32 e4m3 codes at p as bf16 values times 2^(e - 127) for the E8M0 byte e (255: NaN). A code shifted 7 bits up
 * into a 16-bit lane (sign kept) is an fp16 of its value times 2^-8, subnormals included; vcvtph2ps widens it
 * exactly, vscalefps multiplies by 2^(e - 127 + 8) in one rounding (exact but for results past fp32's range), and
 * the bf16 rounding is exact (4 significant bits). The NaN codes (magnitude 0x7F) read 1.875 * 2^-8 that way:
 * they are set to NaN. */
static inline __m512i e4m3x32_bf16(const uint8_t *p, uint8_t e) {
    __m256i bytes = _mm256_loadu_si256((const __m256i *)p);
    __m512i half = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                                    _mm512_set1_epi16((short)0xBF80));
    __m512 power = _mm512_set1_ps(e == 255 ? NAN : (float)(e - 119));
    __m512 lo = _mm512_scalef_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(half)), power);
    __m512 hi = _mm512_scalef_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)), power);
    __m512i out = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    __mmask32 nan = _mm256_cmpeq_epi8_mask(_mm256_and_si256(bytes, _mm256_set1_epi8(0x7F)), _mm256_set1_epi8(0x7F));
    return _mm512_mask_mov_epi16(out, nan, _mm512_set1_epi16(0x7FC0));
}

/* The rows of MXFP8 keys s0 .. s0+kb-1 (clamped to n-1) decoded into bf16 rows buf [kb][d] (e4m3x32_bf16: exact
 * but for bf16 subnormals, which the bf16 dot products count as zero anyway). */
static void e4m3_rows_bf16(const struct keys *k, int64_t s0, int kb, int64_t n, int64_t d, uint16_t *buf,
                           const char **rows) {
    for (int i = 0; i < kb; i++) {
        const uint8_t *row = (const uint8_t *)key_row(k, s0 + i < n ? s0 + i : n - 1);
        const uint8_t *sc = scale_row(k, s0 + i < n ? s0 + i : n - 1);
        uint16_t *out = buf + i * d;
        for (int64_t g = 0; g < d; g += MX_GROUP) _mm512_storeu_si512(out + g, e4m3x32_bf16(row + g, sc[g / MX_GROUP]));
        rows[i] = (const char *)out;
    }
}

/* Scores of bf16 keys [start, end) into score[start:end] with bf16 dot products, straight on the stored rows
 * (MXFP8 keys: on kb rows at a time decoded into buf [KB_ONE][d] bf16). */
static void score_range_bf16(const struct keys *k, const uint32_t *qp, const float *w, int64_t d, int64_t h,
                             int64_t start, int64_t end, int64_t n, uint16_t *buf, float *score) {
    int kb = h == VL ? KB_ONE : KB_MANY;
    for (int64_t s0 = start; s0 < end; s0 += kb) {
        const char *rows[KB_ONE];
        if (k->dtype == E4M3) e4m3_rows_bf16(k, s0, kb, n, d, buf, rows);
        else key_rows(k, s0, kb, n, rows);
        for (int i = 0; s0 + PF_KEYS < end && i < kb; i++)
            prefetch_key(k, s0 + PF_KEYS + i < n ? s0 + PF_KEYS + i : n - 1, d);
        vf tot[KB_ONE] = {{0}};
        for (int64_t hb = 0; hb < h; hb += MAX_NB * VL) {
            int nb = (int)((h - hb) / VL < MAX_NB ? (h - hb) / VL : MAX_NB);
            if (kb == KB_ONE) block_bf16(rows, qp, w, d, h, hb, KB_ONE, 1, tot);
            else if (nb == 1) block_bf16(rows, qp, w, d, h, hb, KB_MANY, 1, tot);
            else if (nb == 2) block_bf16(rows, qp, w, d, h, hb, KB_MANY, 2, tot);
            else if (nb == 3) block_bf16(rows, qp, w, d, h, hb, KB_MANY, 3, tot);
            else block_bf16(rows, qp, w, d, h, hb, KB_MANY, 4, tot);
        }
        for (int i = 0; i < kb && s0 + i < end; i++) score[s0 + i] = hsum(tot[i]);
    }
}
#endif

#ifdef AMX_TILES
/* AMX (amx_bf16 level): 16 keys at a time, as one A tile straight from the stored rows (16 rows x 32 dims; rows
 * that are not 16 equally spaced ones, a tail or keys across cache blocks, are copied into a zero-padded tile
 * first), against B tiles of the pair-packed query qp [d/2][h] (16 pairs x 16 heads: the VNNI layout it already
 * has); C tiles hold 16 keys x 16 heads in fp32, up to 4 head blocks per pass. The products are exact and summed
 * in fp32, as in the AVX512-BF16 kernel (bf16 denormals count as zero). Each thread loads the tile configuration
 * when it starts a range and releases the tiles after. */
#include "amx_tiles.h"

/* C tiles 0..nb-1 += A (tile 4: the keys' 32 dims from pair p0) x B (the query pairs p0.., heads hb + 16 j). */
static inline void amx_step(const uint32_t *qp, int64_t h, int64_t hb, int64_t p0, int nb) {
    const uint32_t *b = qp + p0 * h + hb;
    _tile_loadd(5, b, h * 4);
    _tile_dpbf16ps(0, 4, 5);
    if (nb > 1) { _tile_loadd(6, b + 16, h * 4); _tile_dpbf16ps(1, 4, 6); }
    if (nb > 2) { _tile_loadd(7, b + 32, h * 4); _tile_dpbf16ps(2, 4, 7); }
    if (nb > 3) { _tile_loadd(5, b + 48, h * 4); _tile_dpbf16ps(3, 4, 5); }
}

/* The 16 keys whose rows are `rows` (stride bytes apart from rows) against every head of qp: tot[16] += the
 * weighted ReLU partial sums (add_weighted_relu). c: a thread buffer of 16 x 64 fp32. */
static void amx_keys(const char *rows, int64_t stride, const uint32_t *qp, const float *w, int64_t d, int64_t h,
                     float *c, vf *tot) {
    for (int64_t hb = 0; hb < h; hb += 4 * VL) {
        int nb = (int)((h - hb) / VL < 4 ? (h - hb) / VL : 4);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t p0 = 0; p0 < d / 2; p0 += 16) {
            _tile_loadd(4, rows + p0 * 4, stride);
            amx_step(qp, h, hb, p0, nb);
        }
        _tile_stored(0, c, 4 * VL * 4); _tile_stored(1, c + VL, 4 * VL * 4);
        _tile_stored(2, c + 2 * VL, 4 * VL * 4); _tile_stored(3, c + 3 * VL, 4 * VL * 4);
        for (int half = 0; half < 2; half++) {
            vf lanes[TILE_MAX][NB_MAX];
            for (int k = 0; k < TILE_MAX; k++) memcpy(lanes[k], c + (half * TILE_MAX + k) * 4 * VL, sizeof lanes[k]);
            if (nb == 4) add_weighted_relu(lanes, w + hb, h, TILE_MAX, 4, tot + half * TILE_MAX);
            else if (nb == 3) add_weighted_relu(lanes, w + hb, h, TILE_MAX, 3, tot + half * TILE_MAX);
            else if (nb == 2) add_weighted_relu(lanes, w + hb, h, TILE_MAX, 2, tot + half * TILE_MAX);
            else add_weighted_relu(lanes, w + hb, h, TILE_MAX, 1, tot + half * TILE_MAX);
        }
    }
}

/* Scores of bf16 keys [start, end) with AMX tiles (d a multiple of 32). pad: a thread buffer of 16 x d bf16. */
static void score_range_amx(const struct keys *k, const uint32_t *qp, const float *w, int64_t d, int64_t h,
                            int64_t start, int64_t end, int64_t n, float *c, uint16_t *pad, float *score) {
    amx_configure();
    int64_t row_bytes = k->row_stride * 2;
    for (int64_t s0 = start; s0 < end; s0 += 16) {
        int64_t m = end - s0 < 16 ? end - s0 : 16;
        const char *rows = key_row(k, s0);
        int64_t stride = row_bytes;
        int in_block = !k->table || s0 % k->block_size + m <= k->block_size;
        if (m < 16 || !in_block) {         /* copy the keys' rows into a zero-padded tile */
            const char *src[16];
            key_rows(k, s0, (int)m, n, src);
            for (int i = 0; i < 16; i++) {
                if (i < m) memcpy(pad + i * d, src[i], (size_t)(2 * d));
                else memset(pad + i * d, 0, (size_t)(2 * d));
            }
            rows = (const char *)pad;
            stride = 2 * d;
        } else if (s0 + 16 + 16 < end) {
            const char *ahead = key_row(k, s0 + 32 < n ? s0 + 32 : n - 1);
            for (int i = 0; i < 16; i++)
                for (int64_t off = 0; off < 2 * d; off += 64) __builtin_prefetch(ahead + i * row_bytes + off, 0, 3);
        }
        vf tot[16] = {{0}};
        amx_keys(rows, stride, qp, w, d, h, c, tot);
        for (int64_t i = 0; i < m; i++) score[s0 + i] = hsum(tot[i]);
    }
    _tile_release();
}
#endif

/* The query q [h][d] (stored as q_dtype) packed for the micro-kernel in use (fp32: pack_query; bf16 dot products:
 * bf16 pairs [d/2][hp]), or NULL when out of memory. */
static void *packed_query(const void *q, int q_dtype, int64_t h, int64_t hp, int64_t d, int bf16_dot) {
    if (!bf16_dot) {
        float *qp = malloc((size_t)(hp * d) * sizeof(float));
        if (qp) pack_query(q, q_dtype, h, hp, d, qp);
        return qp;
    }
    uint32_t *qp = calloc((size_t)(hp * (d / 2)), sizeof(uint32_t));
    for (int64_t p = 0; qp && p < d / 2; p++)
        for (int64_t j = 0; j < h; j++) {
            float lo = load_value(q, q_dtype, j * d + 2 * p), hi = load_value(q, q_dtype, j * d + 2 * p + 1);
            uint32_t lo_bits, hi_bits;
            memcpy(&lo_bits, &lo, 4);
            memcpy(&hi_bits, &hi, 4);
            qp[p * hp + j] = (lo_bits >> 16) | (hi_bits & 0xffff0000u);
        }
    return qp;
}

/* Bytes of a thread's buffer: the fp32 kernel's KC x d widened keys; AMX's 16 x 64 fp32 C tiles and 16 x d bf16
 * padded keys. */
static size_t thread_floats(int64_t d, int bf16_dot) {
    size_t floats = bf16_dot ? (size_t)(16 * 4 * VL + 8 * d + 16) : (size_t)(KC * d);
    return floats * sizeof(float);
}

/* Scores of keys [start, end) by the micro-kernel in use; kf: the thread's buffer (thread_floats). */
static void score_range(const struct keys *k, const void *qp, const float *w, int64_t d, int64_t h, int64_t start,
                        int64_t end, int64_t n, int bf16_dot, float *kf, float *score) {
#ifdef AMX_TILES
    if (bf16_dot && d % 32 == 0 && k->dtype == BF16) {
        score_range_amx(k, qp, w, d, h, start, end, n, kf, (uint16_t *)(kf + 16 * 4 * VL), score);
        return;
    }
#endif
#ifdef __AVX512BF16__
    if (bf16_dot) {
        score_range_bf16(k, qp, w, d, h, start, end, n, (uint16_t *)(kf + 16 * 4 * VL), score);
        return;
    }
#endif
    (void)n;
    (void)bf16_dot;
    score_range_f32(k, qp, w, d, h, start, end, kf, score);
}

/* Keys per unit of work of one row's scoring: CHUNK, or fewer where the threads would get under four units
 * each (many cores): 480, 240 or 96 keys, multiples of KC and of the bf16 and AMX blocks. */
static int64_t chunk_keys(int64_t n, int threads) {
    if (n >= (int64_t)CHUNK * 4 * threads) return CHUNK;
    return n >= (int64_t)(CHUNK / 2) * 4 * threads ? CHUNK / 2 : CHUNK / 5;
}

/* One query row ready for the micro-kernels: the packed query qp (packed_query), the weights wp [hp] then hp lane
 * masks, heads padded to hp (a multiple of VL) with zero queries and weights (they add nothing). */
struct row_query {
    void *qp;
    float *wp;
    int64_t hp;
};

/* Fills rq for query q [h][d] (of type q_dtype) and weights w [h]. Returns 0, or -1 when out of memory (rq then
 * holds nothing to free). */
static int row_query_init(struct row_query *rq, const void *q, int q_dtype, const float *w, int64_t h, int64_t d,
                          int bf16_dot) {
    rq->hp = (h + VL - 1) / VL * VL;
    rq->qp = packed_query(q, q_dtype, h, rq->hp, d, bf16_dot);
    rq->wp = calloc((size_t)(2 * rq->hp), sizeof(float));
    if (!rq->qp || !rq->wp) {
        free(rq->qp);
        free(rq->wp);
        return -1;
    }
    memcpy(rq->wp, w, (size_t)h * sizeof(float));
    memset(rq->wp + rq->hp, 0xFF, (size_t)h * sizeof(float));
    return 0;
}

static void row_query_free(struct row_query *rq) {
    free(rq->qp);
    free(rq->wp);
}

/* score[0:n] for query q [h][d] (contiguous, of type q_dtype: F32, BF16 or F16) with head weights w [h] (fp32),
 * on `threads` OpenMP threads (one below PARALLEL_MIN_MACS). Keys of type dtype; E4M3 keys are MXFP8 with their scale
 * rows, I8 keys int8 with one fp32 scale a row (struct keys). bf16_dot: score bf16 or MXFP8 keys with bf16 dot products (q must hold bf16 values, d must be
 * even; needs li_has_bf16_dot). Returns 0, -1 when out of memory, -2 for E4M3 or I8 keys without scales or E4M3 keys with d
 * not a multiple of MX_GROUP. */
int li_scores(const void *key, int dtype, int64_t row_stride, int64_t block_stride, const int32_t *table,
               int64_t block_size, const uint8_t *scale, int64_t scale_row, int64_t scale_block, int64_t n,
               const void *q, int q_dtype, const float *w, int64_t h, int64_t d, int bf16_dot, int threads,
               float *score) {
    struct keys k = {key, dtype, row_stride, block_stride, table, block_size, scale, scale_row, scale_block};
    if ((dtype == E4M3 && (!scale || d % MX_GROUP)) || (dtype == I8 && !scale)) return -2;
    struct row_query rq;
    if (row_query_init(&rq, q, q_dtype, w, h, d, bf16_dot)) return -1;
    int64_t hp = rq.hp, chunk = chunk_keys(n, threads), chunks = (n + chunk - 1) / chunk;
    int failed = 0;
    if (threads > 1 && n * hp * d >= PARALLEL_MIN_MACS) {
#pragma omp parallel reduction(| : failed) num_threads(threads)
        {
            float *kf = malloc(thread_floats(d, bf16_dot));
            failed = !kf;
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t c = 0; c < chunks; c++)
                if (!failed)
                    score_range(&k, rq.qp, rq.wp, d, hp, c * chunk, c * chunk + chunk < n ? c * chunk + chunk : n,
                                n, bf16_dot, kf, score);
            free(kf);
        }
    } else {    /* no team at all: an `if (0)` parallel region still builds a team of one (~2 us a prefill row) */
        float *kf = malloc(thread_floats(d, bf16_dot));
        failed = !kf;
        for (int64_t c = 0; kf && c < chunks; c++)
            score_range(&k, rq.qp, rq.wp, d, hp, c * chunk, c * chunk + chunk < n ? c * chunk + chunk : n, n,
                        bf16_dot, kf, score);
        free(kf);
    }
    row_query_free(&rq);
    return failed ? -1 : 0;
}

/* The selected pairs [take] (of with_next) written as positions idx [k] and values val [k] (li_topk's outputs,
 * -1 / -inf past take); returns li_topk's tie code. */
static int topk_write(const float *score, const struct topk_pair *pairs, int64_t take, int64_t with_next, int64_t k,
                      int32_t *idx, float *val) {
    for (int64_t i = take; i < k; i++) {
        idx[i] = -1;
        val[i] = -INFINITY;
    }
    for (int64_t i = 0; i < take; i++) {
        val[i] = score[pairs[i].pos];
        idx[i] = val[i] == -INFINITY ? -1 : pairs[i].pos;  /* a key scoring -inf counts as masked, as in torch */
    }
    return with_next > take && pairs[take].key == pairs[take - 1].key && val[take - 1] != -INFINITY;
}

/* The k largest of score[0:n], sorted descending (equal scores by position), as positions idx [k] and values
 * val [k]; positions -1 and values -inf pad the rest when n < k, and a key scoring -inf is reported as -1.
 * Returns 0; 1 when the k-th and (k+1)-th largest scores are equal, NaN or +inf included (which of the equal keys
 * are kept is then torch.topk's choice: the caller decides; equal -inf keys are all reported as -1 anyway); -1
 * when out of memory. */
int li_topk(const float *score, int64_t n, int64_t k, int32_t *idx, float *val) {
    int64_t take = k < n ? k : n, with_next = k < n ? k + 1 : n;
    if (take == 0) return topk_write(score, NULL, 0, 0, k, idx, val);
    uint32_t *keys = malloc((size_t)n * sizeof *keys);
    int32_t *list = malloc((size_t)n * sizeof *list);
    struct topk_pair *pairs = malloc((size_t)(2 * with_next) * sizeof *pairs);
    int tie = -1;
    if (keys && list && pairs) {
        topk_select(score, n, with_next, keys, list, pairs, pairs + with_next);
        tie = topk_write(score, pairs, take, with_next, k, idx, val);
    }
    free(keys);
    free(list);
    free(pairs);
    return tie;
}

/* Buffers of row_topk_parallel: order keys and cut-bin positions [n], the chunks' split pairs [n], the sort's
 * [with_next], (pairs, positions) counts per chunk, a digit count per thread, the threads' scoring buffers. */
struct row_select {
    uint32_t *keys;
    int32_t *list, *hists;
    struct topk_pair *stage, *tmp;
    int64_t *counts;
    char *kf;
};

static void row_select_free(struct row_select *r) {
    free(r->keys);
    free(r->list);
    free(r->hists);
    free(r->stage);
    free(r->tmp);
    free(r->counts);
    free(r->kf);
}

static int row_select_init(struct row_select *r, int64_t n, int64_t with_next, int64_t chunks, int threads,
                           size_t kf_bytes) {
    r->keys = malloc((size_t)n * sizeof *r->keys);
    r->list = malloc((size_t)n * sizeof *r->list);
    r->hists = calloc((size_t)threads * TOPK_BINS, sizeof *r->hists);
    r->stage = malloc((size_t)n * sizeof *r->stage);
    r->tmp = malloc((size_t)with_next * sizeof *r->tmp);
    r->counts = malloc((size_t)(2 * chunks) * sizeof *r->counts);
    r->kf = malloc((size_t)threads * kf_bytes);
    if (r->keys && r->list && r->hists && r->stage && r->tmp && r->counts && r->kf) return 0;
    row_select_free(r);
    return -1;
}

/* The chunks' split pairs and cut-bin positions (stage, list: each chunk's own stretch, counts) joined in chunk
 * order, which is position order, at the front of stage and list; *m and *c their lengths. */
static void join_chunks(struct row_select *r, int64_t chunks, int64_t chunk, int64_t *m, int64_t *c) {
    *m = *c = 0;
    for (int64_t ch = 0; ch < chunks; ch++) {
        memmove(r->stage + *m, r->stage + ch * chunk, (size_t)r->counts[2 * ch] * sizeof *r->stage);
        memmove(r->list + *c, r->list + ch * chunk, (size_t)r->counts[2 * ch + 1] * sizeof *r->list);
        *m += r->counts[2 * ch];
        *c += r->counts[2 * ch + 1];
    }
}

/* One decode row's scores and top-k on a team of threads, without a serial pass over its keys: each thread scores
 * chunks as they come and counts their order keys' top digits; the counts are summed and the cut bin found
 * (topk_cut); each chunk is split at it (topk_split) in its own stretch; the calling thread joins the stretches
 * and finishes (topk_finish). Same result as li_scores then li_topk. */
static int row_topk_parallel(const struct keys *k, const struct row_query *rq, int64_t d, int64_t n, int bf16_dot,
                             int threads, int64_t k_out, float *score, int32_t *idx, float *val) {
    int64_t take = k_out < n ? k_out : n, with_next = k_out < n ? k_out + 1 : n, need = with_next;
    int64_t chunk = chunk_keys(n, threads), chunks = (n + chunk - 1) / chunk, m, c;
    size_t kf_bytes = thread_floats(d, bf16_dot);
    struct row_select r;
    if (row_select_init(&r, n, with_next, chunks, threads, kf_bytes)) return -1;
    uint32_t b = 0;
#pragma omp parallel num_threads(threads)
    {
        int32_t *hist = r.hists + omp_get_thread_num() * TOPK_BINS;
        float *kf = (float *)(r.kf + omp_get_thread_num() * kf_bytes);
#pragma omp for schedule(dynamic, 1)
        for (int64_t ch = 0; ch < chunks; ch++) {
            int64_t s0 = ch * chunk, s1 = s0 + chunk < n ? s0 + chunk : n;
            score_range(k, rq->qp, rq->wp, d, rq->hp, s0, s1, n, bf16_dot, kf, score);
            for (int64_t i = s0; i < s1; i++) {
                r.keys[i] = order_key(score[i]);
                hist[r.keys[i] >> (32 - TOPK_DIGIT)]++;
            }
        }
#pragma omp for schedule(static)      /* rows of threads that took no chunk (or were not started) are zeros */
        for (int bin = 0; bin < TOPK_BINS; bin++)
            for (int t = 1; t < threads; t++) r.hists[bin] += r.hists[t * TOPK_BINS + bin];
#pragma omp single
        b = topk_cut(r.hists, TOPK_BINS, &need);
#pragma omp for schedule(static)
        for (int64_t ch = 0; ch < chunks; ch++) {
            int64_t s0 = ch * chunk, s1 = s0 + chunk < n ? s0 + chunk : n, mm = 0, cc = 0;
            topk_split(r.keys, s0, s1, b, r.stage + s0, &mm, r.list + s0, &cc);
            r.counts[2 * ch] = mm;
            r.counts[2 * ch + 1] = cc;
        }
    }
    join_chunks(&r, chunks, chunk, &m, &c);
    topk_finish(r.keys, r.list, c, need, r.stage, m, r.tmp);
    int tie = topk_write(score, r.stage, take, with_next, k_out, idx, val);
    row_select_free(&r);
    return tie;
}

/* One decode row: the scores of keys 0 .. n-1 into score [n], then their k largest into idx [k] and val [k]: with
 * enough work for a team and keys for the histograms, row_topk_parallel; else li_scores, then li_topk. Returns
 * li_topk's code (0; 1: equal scores at the cut), or -1 when out of memory. */
int li_row_topk(const void *key, int dtype, int64_t row_stride, int64_t block_stride, const int32_t *table,
                int64_t block_size, const uint8_t *scale, int64_t scale_row, int64_t scale_block, int64_t n,
                const void *q, int q_dtype, const float *w, int64_t h, int64_t d, int bf16_dot, int threads,
                int64_t k, float *score, int32_t *idx, float *val) {
    int64_t hp = (h + VL - 1) / VL * VL, with_next = k < n ? k + 1 : n;
    if (threads < 2 || n * hp * d < PARALLEL_MIN_MACS || n * with_next <= TOPK_SMALL) {
        if (li_scores(key, dtype, row_stride, block_stride, table, block_size, scale, scale_row, scale_block, n, q,
                      q_dtype, w, h, d, bf16_dot, threads, score))
            return -1;
        return li_topk(score, n, k, idx, val);
    }
    struct keys keys = {key, dtype, row_stride, block_stride, table, block_size, scale, scale_row, scale_block};
    struct row_query rq;
    if (row_query_init(&rq, q, q_dtype, w, h, d, bf16_dot)) return -1;
    int code = row_topk_parallel(&keys, &rq, d, n, bf16_dot, threads, k, score, idx, val);
    row_query_free(&rq);
    return code;
}

/* Several query rows of one batch (a prefill): row t (t < rows) scores keys 0 .. limits[t]-1 with query
 * q + t * q_row_stride values (type q_dtype) and weights w + t * w_row_stride, and writes its k largest into
 * idx + t * k and val + t * k (li_topk). The rows are shared by `threads` OpenMP threads as they come (when the
 * call has PARALLEL_MIN_MACS of work), each row scored on one thread: a prefill row has too few keys for its own
 * team (a row's keys are split across threads only in li_row_topk, at decode). tie[t] is li_topk's code for
 * row t (1: equal scores straddle the cut, which the caller settles as torch.topk would). Returns 0, or -1 when
 * out of memory. */
int li_rows_topk(const void *key, int dtype, int64_t row_stride, int64_t block_stride, const int32_t *table,
                 int64_t block_size, const uint8_t *scale, int64_t scale_row, int64_t scale_block,
                 const int64_t *limits, int64_t rows, const void *q, int q_dtype,
                 int64_t q_row_stride, const float *w, int64_t w_row_stride, int64_t h, int64_t d, int bf16_dot,
                 int threads, int64_t k, int32_t *idx, float *val, int32_t *tie) {
    int64_t most = 1, keys = 0, q_item = elem_bytes(q_dtype);
    for (int64_t t = 0; t < rows; t++) {
        most = limits[t] > most ? limits[t] : most;
        keys += limits[t] > 0 ? limits[t] : 0;
    }
    int failed = 0;   /* little work (a short prompt) stays on the calling thread, as in li_scores */
#pragma omp parallel num_threads(threads > 1 ? threads : 1) reduction(| : failed) \
    if (threads > 1 && rows > 1 && keys * h * d >= PARALLEL_MIN_MACS)
    {
        float *score = malloc((size_t)most * sizeof(float));
        failed = !score;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < rows; t++) {
            if (failed || limits[t] <= 0) {
                if (limits[t] <= 0) tie[t] = 0;
                continue;
            }
            int code = li_row_topk(key, dtype, row_stride, block_stride, table, block_size, scale, scale_row,
                                   scale_block, limits[t],
                                   (const char *)q + t * q_row_stride * q_item, q_dtype, w + t * w_row_stride, h, d,
                                   bf16_dot, 1, k, score, idx + t * k, val + t * k);
            failed |= code < 0;
            tie[t] = code > 0;
        }
        free(score);
    }
    return failed ? -1 : 0;
}

/* What a plan (kernels/indexer/native.py) fixes for every call of one signature. Strides in elements:
 * q [B][S1][heads][dim] rows of `heads * dim` values (q_dtype), weights fp32, keys BSND (key_batch given per call:
 * the cache grows) or a paged cache [num_blocks][block_size][1][dim] (block_stride values between blocks) through an
 * int32 block table [B][table_row];
 * the lengths [B] are int32 or int64 (lq64, lk64). */
struct li_call_args {
    int64_t batch, s1, heads, dim, k, block_size, num_blocks, block_stride, q_batch, q_row, w_batch, w_row, key_row,
        table_row, scale_row, scale_block;
    int lq64, lk64, causal, key_dtype, q_dtype, bf16_dot;
};

enum { LI_OK = 0, LI_NO_MEMORY = 1, LI_BAD_QUERY_LENGTH = 2, LI_BAD_KEY_LENGTH = 3, LI_BAD_BLOCK_TABLE = 4,
       LI_TIES = 5, LI_PADDED = 6, LI_BAD_KEY_SCALE = 7 };

static int64_t length_at(const void *lengths, int is64, int64_t b, int64_t otherwise) {
    if (!lengths) return otherwise;
    return is64 ? ((const int64_t *)lengths)[b] : ((const int32_t *)lengths)[b];
}

/* The data checks of a call (kernels/indexer/checks.sequence_lengths): lengths within [0, S1] and [0, capacity],
 * the used block-table entries within [0, num_blocks); lq and lk get the lengths. */
static int li_check_call(const struct li_call_args *a, const int32_t *table, const void *lq_len, const void *lk_len,
                         int64_t capacity, int64_t *lq, int64_t *lk) {
    if (a->key_dtype == E4M3 && a->dim % MX_GROUP) return LI_BAD_KEY_SCALE;
    for (int64_t b = 0; b < a->batch; b++) {
        lq[b] = length_at(lq_len, a->lq64, b, a->s1);
        lk[b] = length_at(lk_len, a->lk64, b, capacity);
        if (lq[b] < 0 || lq[b] > a->s1) return LI_BAD_QUERY_LENGTH;
        if (lk[b] < 0 || lk[b] > capacity) return LI_BAD_KEY_LENGTH;
        for (int64_t i = 0; table && i < (lk[b] + a->block_size - 1) / a->block_size; i++) {
            int32_t block = table[b * a->table_row + i];
            if (block < 0 || block >= a->num_blocks) return LI_BAD_BLOCK_TABLE;
        }
    }
    return LI_OK;
}

/* Rows [from, s1) of one batch's outputs: no key (-1, -inf). */
static void no_keys(int64_t k, int64_t from, int64_t s1, int32_t *idx, float *val) {
    for (int64_t i = from * k; i < s1 * k; i++) {
        idx[i] = -1;
        val[i] = -INFINITY;
    }
}

/* The keys query row t of a batch with lq query rows and lk keys sees: all lk, or with the causal mask the first
 * lk - lq + t + 1. */
static int64_t row_limit(const struct li_call_args *a, int64_t lq, int64_t lk, int64_t t) {
    int64_t limit = a->causal ? lk - lq + t + 1 : lk;
    return limit < 0 ? 0 : (limit > lk ? lk : limit);
}

/* Where batch b's keys (and an MXFP8 key's scales, `scale`: scale_batch bytes between batches of BSND scales) are
 * under a call's layout: a BSND tensor's rows from its batch offset (key_batch values apart), a paged cache's
 * through the batch's block-table row. */
static struct keys batch_keys(const struct li_call_args *a, int64_t b, const void *key, int64_t key_batch,
                              const void *scale, int64_t scale_batch, const int32_t *table) {
    struct keys k = {(const char *)key + (table ? 0 : b * key_batch * elem_bytes(a->key_dtype)), a->key_dtype,
                     a->key_row, table ? a->block_stride : 0, table ? table + b * a->table_row : NULL,
                     table ? a->block_size : 1, scale ? (const uint8_t *)scale + (table ? 0 : b * scale_batch) : NULL,
                     a->scale_row, table ? a->scale_block : 0};
    return k;
}

/* One batch's query rows: li_row_topk for a decode row (its keys shared by the threads), li_rows_topk for
 * several; limits [lq] scratch. Returns 0, 1 when some row has equal scores at the cut (tie [lq]), -1 out of
 * memory. */
static int li_batch(const struct li_call_args *a, int64_t b, const char *q, const float *w, const char *key,
                    int64_t key_batch, const void *scale, int64_t scale_batch, const int32_t *table, int64_t lq, int64_t lk, int threads, float *scores,
                    int64_t *limits, int32_t *idx, float *val, int32_t *tie) {
    int64_t item = elem_bytes(a->q_dtype);
    struct keys k = batch_keys(a, b, key, key_batch, scale, scale_batch, table);
    const char *qb = q + b * a->q_batch * item;
    const float *wb = w + b * a->w_batch;
    for (int64_t t = 0; t < lq; t++) {
        tie[t] = 0;
        limits[t] = row_limit(a, lq, lk, t);
        if (limits[t] == 0) no_keys(a->k, t, t + 1, idx, val);
    }
    if (lq == 1) {
        if (limits[0] == 0) return 0;
        int code = li_row_topk(k.base, k.dtype, k.row_stride, k.block_stride, k.table, k.block_size, k.scale,
                               k.scale_row, k.scale_block, limits[0], qb,
                               a->q_dtype, wb, a->heads, a->dim, a->bf16_dot, threads, a->k, scores, idx, val);
        tie[0] = code > 0;
        return code < 0 ? -1 : code > 0;
    }
    if (li_rows_topk(k.base, k.dtype, k.row_stride, k.block_stride, k.table, k.block_size, k.scale, k.scale_row,
                     k.scale_block, limits, lq, qb,
                     a->q_dtype, a->q_row, wb, a->w_row, a->heads, a->dim, a->bf16_dot, threads, a->k, idx, val, tie))
        return -1;
    int any = 0;
    for (int64_t t = 0; t < lq; t++) any |= tie[t];
    return any;
}

/* One whole call of the op over every batch (the plan's entry): key_starts (int32 or int64 [B], or NULL) with a
 * start > 0 returns LI_PADDED before anything is written (the caller takes the padded rows' path); then the
 * checks (li_check_call), then every batch's rows, rows past a batch's query length set to -1 / -inf. capacity:
 * key positions (rows of BSND keys, blocks x block size of a paged cache); tie [B][S1]: rows with equal scores at the
 * cut (LI_TIES: the caller settles them as torch.topk would). MXFP8 keys (key_dtype E4M3) and int8 keys (I8, one
 * fp32 scale a row) read their scale bytes at key_scale (scale_batch bytes between batches of BSND scales); without
 * them, or MXFP8 with a dim that is not a multiple of MX_GROUP, the call returns LI_BAD_KEY_SCALE. Returns
 * LI_OK, LI_TIES, LI_PADDED, a failed check's code or LI_NO_MEMORY. */
int li_call(const struct li_call_args *a, const void *q, const float *w, const void *key, int64_t key_batch,
            const void *key_scale, int64_t scale_batch, const int32_t *table, const void *lq_len, const void *lk_len, const void *starts, int starts64,
            int64_t capacity, int threads, int32_t *idx, float *val, int32_t *tie) {
    for (int64_t b = 0; starts && b < a->batch; b++)
        if (length_at(starts, starts64, b, 0) != 0) return LI_PADDED;
    int64_t lq[a->batch], lk[a->batch];
    int status = (a->key_dtype == E4M3 || a->key_dtype == I8) && !key_scale ? LI_BAD_KEY_SCALE
                                                    : li_check_call(a, table, lq_len, lk_len, capacity, lq, lk);
    if (status != LI_OK) return status;
    int64_t *limits = malloc((size_t)(a->s1 > 0 ? a->s1 : 1) * sizeof *limits);
    float *scores = malloc((size_t)(capacity > 0 ? capacity : 1) * sizeof *scores);   /* a decode row's scores */
    if (!limits || !scores) {
        free(limits);
        free(scores);
        return LI_NO_MEMORY;
    }
    int ties = 0;
    for (int64_t b = 0; b < a->batch && status == LI_OK; b++) {
        int64_t out = b * a->s1 * a->k;
        int code = li_batch(a, b, q, w, key, key_batch, key_scale, scale_batch, table, lq[b], lk[b], threads, scores,
                            limits, idx + out,
                            val + out, tie + b * a->s1);
        no_keys(a->k, lq[b], a->s1, idx + out, val + out);
        for (int64_t t = lq[b]; t < a->s1; t++) tie[b * a->s1 + t] = 0;
        status = code < 0 ? LI_NO_MEMORY : LI_OK;
        ties |= code > 0;
    }
    free(limits);
    free(scores);
    return status == LI_OK && ties ? LI_TIES : status;
}

/* The scores of the rows li_call flagged in tie [batch][s1] (its arguments again), into matrix [tied rows][capacity]
 * in row order, the row's position b * s1 + t into rows [tied rows]: keys the row sees scored, the rest -inf, as the
 * masked score matrix of an eager model holds them. The caller keeps k of each row with torch.topk, whose choice
 * among equal scores depends on the row's length (kernels/indexer/native._settle_ties), and li_place_rows
 * puts them in the outputs. matrix and rows have room for batch * s1 rows. Returns the number of rows, or minus one
 * of li_call's codes. */
int64_t li_tied_scores(const struct li_call_args *a, const void *q, const float *w, const void *key,
                       int64_t key_batch, const void *key_scale, int64_t scale_batch, const int32_t *table, const void *lq_len, const void *lk_len,
                       int64_t capacity, int threads, const int32_t *tie, float *matrix, int64_t *rows) {
    int64_t lq[a->batch], lk[a->batch], item = elem_bytes(a->q_dtype), count = 0;
    int status = (a->key_dtype == E4M3 || a->key_dtype == I8) && !key_scale ? LI_BAD_KEY_SCALE
                                                    : li_check_call(a, table, lq_len, lk_len, capacity, lq, lk);
    for (int64_t b = 0; b < a->batch && status == LI_OK; b++) {
        struct keys k = batch_keys(a, b, key, key_batch, key_scale, scale_batch, table);
        for (int64_t t = 0; t < lq[b] && status == LI_OK; t++) {
            if (!tie[b * a->s1 + t]) continue;
            int64_t n = row_limit(a, lq[b], lk[b], t);
            float *row = matrix + count * capacity;
            const char *qt = (const char *)q + (b * a->q_batch + t * a->q_row) * item;
            if (li_scores(k.base, k.dtype, k.row_stride, k.block_stride, k.table, k.block_size, k.scale, k.scale_row,
                          k.scale_block, n, qt, a->q_dtype,
                          w + b * a->w_batch + t * a->w_row, a->heads, a->dim, a->bf16_dot, threads, row))
                status = LI_NO_MEMORY;
            for (int64_t s = n; s < capacity; s++) row[s] = -INFINITY;
            rows[count++] = b * a->s1 + t;
        }
    }
    return status == LI_OK ? count : -status;
}

/* Row rows[i] of the outputs idx / val [..][k] from row i of torch.topk's top_val / top_idx [count][k] (int64
 * positions): a position scoring -inf is reported as -1, as li_topk reports it. */
void li_place_rows(const int64_t *rows, int64_t count, int64_t k, const float *top_val, const int64_t *top_idx,
                   int32_t *idx, float *val) {
    for (int64_t i = 0; i < count; i++)
        for (int64_t j = 0; j < k; j++) {
            float v = top_val[i * k + j];
            val[rows[i] * k + j] = v;
            idx[rows[i] * k + j] = v == -INFINITY ? -1 : (int32_t)top_idx[i * k + j];
        }
}
