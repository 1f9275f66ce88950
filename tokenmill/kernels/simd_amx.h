/* The tile layer: Intel AMX's int8 tile multiply (AMX-TILE + AMX-INT8, Sapphire Rapids and
 * later Xeons), for the integer GEMM (gemm.c) on AVX-512 builds.
 *
 * Why: one TDPBSUD multiplies a 16 x 64 byte tile by a 64 x 16 one, 16K multiply-adds, in
 * the time AVX-512 VNNI takes for a few hundred: ~3 T multiply-adds/s on one Sapphire
 * Rapids core against ~0.3 for vpdpbusd (benchmarks/README.md). The GEMM's tile of code
 * quads (tw [K/4, RT]: quad q of row l at tw[q * RT + l]) is already the B operand's layout,
 * and its activations ([T, K] bytes) the A operand's, so the tiles load in place.
 *
 * The contract (TM_AMX 1 where compiled in, with TM_AMX_NAME for tm_isa):
 *   amx_ready()             whether this process may use the tiles: Linux grants the tile
 *                           state on request (arch_prctl), once per process; 0 where the
 *                           kernel refuses, or TOKENMILL_AMX=0 asks (then the GEMM runs
 *                           on VNNI)
 *   amx_config()            this thread's tiles for one 32-value block per product: A 16
 *                           rows x 32 bytes, B 8 rows of code quads, C 16 x 16 int32
 *   amx_dots(set, c, a, lda, b, ldb)
 *                           starts one block's products on tile set `set` (0 or 1, a
 *                           constant: two sets let one block's products run while the
 *                           previous one's are read) and stores them to c [16][16]: c[r][l]
 *                           = the sum over the block's 32 values k of a[r * lda + k] (int8)
 *                           times code(l, k) (unsigned bytes in quads: b + (k / 4) * ldb
 *                           bytes, row l's four at byte 4 l). All 16 rows of a are read.
 *   amx_hilo(c, t) -> vi    256 c[t] + c[8 + t]: a 16-bit activation's sums, from its high
 *                           byte's row t and its low byte's row 8 + t (gemm.c)
 *   amx_release()           this thread is done with the tiles (cheaper context switches)
 *
 * TM_EMULATE_AMX builds the same contract in plain C on any AVX-512 build (SIMDe included),
 * so the tests run the GEMM's AMX path on every x86-64 host; the hardware needs the
 * AMX-TILE and AMX-INT8 targets (-march=native on such a CPU, or -march=sapphirerapids).
 */
#ifndef TM_SIMD_AMX_H
#define TM_SIMD_AMX_H

#if TM_W == 16 && TM_DOT8 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(TM_EMULATE_AMX)
#define TM_AMX 1
#define TM_AMX_NAME "+amx"
#include <sys/syscall.h>
#include <unistd.h>

static inline int amx_ready(void) {
    static int state = -1; /* -1 not asked yet; a race asks twice, harmlessly */
    if (state < 0) {
        enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
        const char *off = getenv("TOKENMILL_AMX"); /* "0": VNNI only, to compare the two */
        state = !(off && strcmp(off, "0") == 0) &&
                syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return state;
}

/* Tiles: set 0 C 0, A 1, B 2; set 1 C 3, A 4, B 5 (each set its own, so that the two
 * sets' loads and products never wait on each other). */
static inline void amx_config(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int s = 0; s < 2; s++) {
        cfg.rows[3 * s] = 16, cfg.colsb[3 * s] = 64;                   /* C */
        cfg.rows[3 * s + 1] = 16, cfg.colsb[3 * s + 1] = QK;     /* A */
        cfg.rows[3 * s + 2] = QK / 4, cfg.colsb[3 * s + 2] = 64; /* B */
    }
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* gcc does not see ldtilecfg read cfg */
    _tile_loadconfig(&cfg);
}

static inline void amx_release(void) { _tile_release(); }

static inline __attribute__((always_inline)) void amx_dots(int set, int32_t *c, const int8_t *a, int lda,
                                                           const int32_t *b, int ldb) {
    if (set) {
        _tile_loadd(5, b, ldb);
        _tile_loadd(4, a, lda);
        _tile_zero(3);
        _tile_dpbsud(3, 4, 5);
        _tile_stored(3, c, 64);
    } else {
        _tile_loadd(2, b, ldb);
        _tile_loadd(1, a, lda);
        _tile_zero(0);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, c, 64);
    }
}

#elif TM_W == 16 && TM_DOT8 && defined(TM_EMULATE_AMX)
#define TM_AMX 1
#define TM_AMX_NAME "+amx(emulated)"
static inline int amx_ready(void) { return 1; }
static inline void amx_config(void) {}
static inline void amx_release(void) {}

static inline void amx_dots(int set, int32_t *c, const int8_t *a, int lda, const int32_t *b, int ldb) {
    const uint8_t *codes = (const uint8_t *)b;
    (void)set;
    for (int r = 0; r < 16; r++)
        for (int l = 0; l < 16; l++) {
            int32_t s = 0;
            for (int k = 0; k < QK; k++) s += a[r * lda + k] * codes[(k / 4) * ldb + 4 * l + k % 4];
            c[16 * r + l] = s;
        }
}

#else
#define TM_AMX 0
#define TM_AMX_NAME ""
#endif

#if TM_AMX
static inline __attribute__((always_inline)) vi amx_hilo(const int32_t *c, int t) {
    return vi_add(_mm512_slli_epi32(vi_load(c + 16 * t), 8), vi_load(c + 16 * (8 + t)));
}
#endif

#endif
