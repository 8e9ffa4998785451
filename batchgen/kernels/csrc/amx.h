/*
 * AMX tiles: the tile configuration's layout and the process's permission to use the tile
 * registers. Included by the kernel sources that run on tiles where the CPU has AMX-BF16.
 */
#ifndef BATCHGEN_AMX_H
#define BATCHGEN_AMX_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for a state component for this process */
#define XFEATURE_XTILEDATA 18      /* the AMX tile registers */

/* The operand of ldtilecfg (palette 1): bytes per row and rows of each of tmm0-15. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* The tiles of a GEMM block (bf16_gemm.c, int8_gemm.c): four accumulators (top / bottom rows x
 * left / right columns), two row tiles, two weight tiles. */
#define C_TOP_LEFT 0
#define C_TOP_RIGHT 1
#define C_BOTTOM_LEFT 2
#define C_BOTTOM_RIGHT 3
#define X_TOP 4
#define X_BOTTOM 5
#define W_LEFT 6
#define W_RIGHT 7

/* A GEMM block's tiles, every one 64 bytes a row: the accumulators and row tiles of the top and
 * bottom 16 rows hold `top` and `bottom` rows (0: that tile unused), the weight tiles 16 rows (64
 * bytes of inputs each: 16 bf16 pairs or 16 int8 quads). Needs immintrin.h first. */
static inline void configure_block_tiles(int top, int bottom) {
    TileConfig config = {.palette_id = 1};
    int rows[8] = {top, top, bottom, bottom, top, bottom, 16, 16};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = (uint8_t)rows[t];
        config.bytes_per_row[t] = rows[t] > 0 ? 64 : 0;
    }
    _tile_loadconfig(&config);
}

/* 1 once Linux lets this process use the tile registers (asked once per library). */
static int amx_tiles_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

#endif
