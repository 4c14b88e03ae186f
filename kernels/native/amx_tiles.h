/* AMX tile configuration shared by the kernels of the amx_bf16 level (built with -mamx-tile -mamx-bf16; the
 * process asked the OS for the tile state first: kernels/native/cpu_isa.py). Every tile is 16 rows of 64 bytes: a bf16
 * A tile is 16 rows x 32 values, a B tile 16 pairs of rows x 16 columns (VNNI pairs), a C tile 16 x 16 fp32. The
 * configuration is per thread: a kernel loads it before its first tile instruction on a thread and releases the
 * tiles when done (so that the OS need not save them). Built with -DASCEND_DSA_AMX_EMULATED instead, the tile
 * instructions run in C (amx_emulated.h), for testing on a CPU without AMX. */
#ifndef ASCEND_DSA_AMX_TILES_H
#define ASCEND_DSA_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#ifdef ASCEND_DSA_AMX_EMULATED
#include "amx_emulated.h"
#endif

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Eight tiles of 16 rows x 64 bytes on this thread. */
static inline void amx_configure(void) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&c);
}

#endif
