/* AMX tile helpers shared by the kernels that multiply on tiles (qlinear.c, prefill_attention.c).
 *
 * AMX_AVAILABLE: the compiler targets AMX-TILE + AMX-BF16 on Linux (the library is built with
 * -march=native, so this is the CPU's own answer). At run time a kernel also needs the OS's
 * permission for the tile state and the process switch (TOKENOS_DISABLE_AMX=1 clears it): both are
 * kernels_amx_ready(), defined in qlinear.c. */
#ifndef TOKENOS_AMX_H
#define TOKENOS_AMX_H

#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) \
    && defined(__linux__)
#include <immintrin.h>
#define AMX_AVAILABLE 1

int kernels_amx_ready(void);

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* ldtilecfg of cfg. GCC 12's _tile_loadconfig does not tell the optimizer that it reads *cfg, so where
 * it is inlined the stores filling a local config can be dropped as dead, and ldtilecfg then faults on
 * the stack garbage left in its reserved bytes; the empty asm takes cfg's address, so they stay. */
static inline void amx_load_config(const amx_tilecfg *cfg) {
    __asm__ __volatile__("" : : "r"(cfg) : "memory");
    _tile_loadconfig(cfg);
}

/* Every kernel here uses all eight tiles as 16 rows of 64 bytes (16 x 16 fp32, or 16 x 32 bf16), so
 * one configuration serves them all; it is per thread, set inside each parallel region. */
static inline void amx_configure(void) {
    amx_tilecfg cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    amx_load_config(&cfg);
}

/* The few-row layout (qlinear.c's qgemv_amx): tiles 0-1 and 2-3 accumulate `rows` x 16 fp32 (alternate
 * weight groups), tile 4 holds `rows` activation rows of 32 bf16, tiles 6-7 hold B (16 pair rows of 64
 * bytes). Tiles of `rows` rows read and write only the rows that exist, so no padded copy of the
 * activations is needed. */
static inline void amx_configure_rows(int rows) {
    amx_tilecfg cfg = {0};
    cfg.palette = 1;
    const int used[7] = {0, 1, 2, 3, 4, 6, 7};
    for (int i = 0; i < 7; i++) {
        int t = used[i];
        cfg.rows[t] = t >= 6 ? 16 : rows, cfg.colsb[t] = 64;
    }
    amx_load_config(&cfg);
}
#else
#define AMX_AVAILABLE 0
#endif

#endif
