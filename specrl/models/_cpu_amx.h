/* AMX tiles: what every kernel that uses them shares (the Linux permission, one tile configuration). */
#ifndef SPECRL_CPU_AMX_H
#define SPECRL_CPU_AMX_H
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for an extended state component (AMX tiles) */
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX's 8 KB of tile state only to a process that asks (5.16+); asking again is harmless.
 * -> nonzero when granted. */
static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_tile_config;

/* This thread's tiles 0-7: rows[t] rows of colsb[t] bytes each (palette 1). */
__attribute__((target("amx-tile"))) static inline void amx_configure_tiles(const uint8_t rows[8],
                                                                         const uint16_t colsb[8]) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = rows[t], cfg.colsb[t] = colsb[t];
    /* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes, so it may drop the other stores */
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}
#endif
