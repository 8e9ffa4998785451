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

/* 1 once Linux lets this process use the tile registers (asked once per library). */
static int amx_tiles_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

#endif
