/* The CPU's peak multiply-add rate for the instruction a stream kernel multiplies with: the compute floor
 * under a forward's cost (specrl.apps.bench.floors). Measured, not taken from a data sheet: the clock a
 * core keeps under vector load, and how many of these instructions it issues a cycle, differ between CPUs
 * of one name and between sessions.
 *
 * A loop of the instruction alone, on independent accumulators (enough to hide its latency behind its
 * throughput: 2 issues a cycle x 4-7 cycles of latency), on `threads` OpenMP threads at once, each over its own
 * registers: 8 accumulators in AVX2's 16 registers, 12 in AVX-512's 32 (GCC spilled 12 AVX2 accumulators to the
 * stack, which read 72 instead of 98 G multiply-adds/s on the AVX2 EPYC). Multiply-adds per instruction:
 *   avx2_fma     VFMADD231PS ymm                 8  (float32 and float16 weights on AVX2)
 *   avx512_fma   VFMADD231PS zmm                16  (the same on AVX-512)
 *   avx2_int8    VPMADDUBSW + VPMADDWD ymm      32  (int8 and 4-bit weights on AVX2: u8 x s8 pairs, then int32)
 *   avx512_vnni  VPDPBUSD zmm                   64  (int8 and 4-bit weights on AVX-512 VNNI)
 *   avx512_bf16  VDPBF16PS zmm                  32  (bfloat16 weights without AMX)
 *   amx_bf16     TDPBF16PS 16x16 tiles        8192  (bfloat16 weights on AMX: 16 rows x 16 outputs x 32)
 *   amx_int8     TDPBSUD 16x16 tiles         16384  (int8 and 4-bit weights on AMX: 16 rows x 16 outputs x 64)
 * AMX's loops keep 4 accumulator tiles over 2 A and 2 B tiles (every tile register), as the kernels do; a tile
 * instruction's rate is its full 16-row shape's, which a kernel reaches only with 16 rows: at fewer rows the
 * floor it gives is optimistic (the unit takes about as long for a 16-row tile as for a shorter one).
 * The accumulators are summed into a volatile sink, so no loop can be dropped as dead code; the values
 * themselves mean nothing (floats stay finite and far from denormals: nothing slows a lane).
 */
#include "_cpu_peak.h"
#include "_cpu_amx.h"

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define YMM_CHAINS 8
#define ZMM_CHAINS 12
#define MIN_SECONDS 0.02 /* per measurement: long enough for the clock to settle, short enough for a bench */

typedef double (*loop_fn)(long steps); /* -> a value that depends on every step */

__attribute__((target("avx2,fma"))) static double loop_avx2_fma(long steps) {
    __m256 v[YMM_CHAINS];
    const __m256 a = _mm256_set1_ps(0.5f), b = _mm256_set1_ps(0.5f);
    for (int i = 0; i < YMM_CHAINS; i++) v[i] = _mm256_set1_ps((float)i / YMM_CHAINS);
    for (long n = 0; n < steps; n++)
        for (int i = 0; i < YMM_CHAINS; i++) v[i] = _mm256_fmadd_ps(v[i], a, b); /* tends to 1 */
    float lanes[8], total = 0;
    for (int i = 0; i < YMM_CHAINS; i++) {
        _mm256_storeu_ps(lanes, v[i]);
        total += lanes[0];
    }
    return total;
}

__attribute__((target("avx512f"))) static double loop_avx512_fma(long steps) {
    __m512 v[ZMM_CHAINS];
    const __m512 a = _mm512_set1_ps(0.5f), b = _mm512_set1_ps(0.5f);
    for (int i = 0; i < ZMM_CHAINS; i++) v[i] = _mm512_set1_ps((float)i / ZMM_CHAINS);
    for (long n = 0; n < steps; n++)
        for (int i = 0; i < ZMM_CHAINS; i++) v[i] = _mm512_fmadd_ps(v[i], a, b);
    float total = 0;
    for (int i = 0; i < ZMM_CHAINS; i++) total += _mm512_reduce_add_ps(v[i]);
    return total;
}

__attribute__((target("avx2"))) static double loop_avx2_int8(long steps) {
    __m256i v[YMM_CHAINS];
    const __m256i s = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < YMM_CHAINS; i++) v[i] = _mm256_set1_epi8((char)(i + 1));
    for (long n = 0; n < steps; n++)
        for (int i = 0; i < YMM_CHAINS; i++) v[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(v[i], s), ones);
    int32_t lanes[8];
    double total = 0;
    for (int i = 0; i < YMM_CHAINS; i++) {
        _mm256_storeu_si256((__m256i *)lanes, v[i]);
        total += lanes[0];
    }
    return total;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double loop_avx512_vnni(long steps) {
    __m512i v[ZMM_CHAINS];
    const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
    for (int i = 0; i < ZMM_CHAINS; i++) v[i] = _mm512_set1_epi32(i);
    for (long n = 0; n < steps; n++)
        for (int i = 0; i < ZMM_CHAINS; i++) v[i] = _mm512_dpbusd_epi32(v[i], u, s);
    double total = 0;
    for (int i = 0; i < ZMM_CHAINS; i++) total += _mm512_reduce_add_epi32(v[i]);
    return total;
}

__attribute__((target("avx512f,avx512bf16"))) static double loop_avx512_bf16(long steps) {
    __m512 v[ZMM_CHAINS];
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.25f), _mm512_set1_ps(0.25f));
    for (int i = 0; i < ZMM_CHAINS; i++) v[i] = _mm512_set1_ps((float)i / ZMM_CHAINS);
    for (long n = 0; n < steps; n++)
        for (int i = 0; i < ZMM_CHAINS; i++) v[i] = _mm512_dpbf16_ps(v[i], a, a); /* + 0.125 a step: no overflow */
    float total = 0;
    for (int i = 0; i < ZMM_CHAINS; i++) total += _mm512_reduce_add_ps(v[i]);
    return total;
}

/* AMX: every tile 16 rows x 64 bytes, configured per thread. */
__attribute__((target("amx-tile"))) static void amx_full_tiles(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure_tiles(rows, colsb);
}

/* 4 tile products a step into tiles 0-3, from A tiles 4-5 and B tiles 6-7 loaded once. */
#define AMX_LOOP(NAME, TARGET, PRODUCT, TYPE, FILL)                                                                   \
    __attribute__((target(TARGET))) static double NAME(long steps) {                                                  \
        TYPE src[16 * 64 / sizeof(TYPE)], out[16 * 64 / sizeof(TYPE)];                                                 \
        for (size_t i = 0; i < sizeof src / sizeof *src; i++) src[i] = FILL;                                          \
        amx_full_tiles();                                                                                             \
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);                                                   \
        _tile_loadd(4, src, 64); _tile_loadd(5, src, 64); _tile_loadd(6, src, 64); _tile_loadd(7, src, 64);           \
        for (long n = 0; n < steps; n++) {                                                                            \
            PRODUCT(0, 4, 6);                                                                                         \
            PRODUCT(1, 4, 7);                                                                                         \
            PRODUCT(2, 5, 6);                                                                                         \
            PRODUCT(3, 5, 7);                                                                                         \
        }                                                                                                             \
        _tile_stored(0, out, 64);                                                                                     \
        _tile_release();                                                                                              \
        return (double)out[0];                                                                                        \
    }
AMX_LOOP(loop_amx_int8, "amx-tile,amx-int8", _tile_dpbsud, int8_t, 1)   /* int32 sums wrap: no lane slows */
AMX_LOOP(loop_amx_bf16, "amx-tile,amx-bf16", _tile_dpbf16ps, uint16_t, 0x3e80) /* 0.25: + 2 a step, finite */

typedef struct {
    const char *name;
    const char *features[3]; /* what the CPU must have (__builtin_cpu_supports names) */
    loop_fn loop;
    int macs; /* multiply-adds a step of the loop does: its instructions' times its accumulators */
} instruction;

static const instruction INSTRUCTIONS[] = {
    {"avx2_fma", {"avx2", "fma", NULL}, loop_avx2_fma, 8 * YMM_CHAINS},
    {"avx512_fma", {"avx512f", NULL, NULL}, loop_avx512_fma, 16 * ZMM_CHAINS},
    {"avx2_int8", {"avx2", NULL, NULL}, loop_avx2_int8, 32 * YMM_CHAINS},
    {"avx512_vnni", {"avx512f", "avx512bw", "avx512vnni"}, loop_avx512_vnni, 64 * ZMM_CHAINS},
    {"avx512_bf16", {"avx512f", "avx512bf16", NULL}, loop_avx512_bf16, 32 * ZMM_CHAINS},
    {"amx_bf16", {"amx-tile", "amx-bf16", NULL}, loop_amx_bf16, 4 * 16 * 16 * 32},
    {"amx_int8", {"amx-tile", "amx-int8", NULL}, loop_amx_int8, 4 * 16 * 16 * 64},
};

static const instruction *find(const char *name) {
    for (size_t i = 0; i < sizeof INSTRUCTIONS / sizeof *INSTRUCTIONS; i++)
        if (strcmp(INSTRUCTIONS[i].name, name) == 0) return &INSTRUCTIONS[i];
    return NULL;
}

static int supported(const instruction *ins) {
    for (int i = 0; i < 3 && ins->features[i]; i++) {
        /* __builtin_cpu_supports takes a literal: compare against the names this table uses */
        const char *f = ins->features[i];
        int ok = strcmp(f, "avx2") == 0         ? __builtin_cpu_supports("avx2")
                 : strcmp(f, "fma") == 0        ? __builtin_cpu_supports("fma")
                 : strcmp(f, "avx512f") == 0    ? __builtin_cpu_supports("avx512f")
                 : strcmp(f, "avx512bw") == 0   ? __builtin_cpu_supports("avx512bw")
                 : strcmp(f, "avx512vnni") == 0 ? __builtin_cpu_supports("avx512vnni")
                 : strcmp(f, "avx512bf16") == 0 ? __builtin_cpu_supports("avx512bf16")
                 : strcmp(f, "amx-tile") == 0   ? __builtin_cpu_supports("amx-tile") && amx_request_tiles()
                 : strcmp(f, "amx-int8") == 0   ? __builtin_cpu_supports("amx-int8")
                 : strcmp(f, "amx-bf16") == 0   ? __builtin_cpu_supports("amx-bf16")
                                                : 0;
        if (!ok) return 0;
    }
    return 1;
}

static volatile double sink;

/* One timed run of `steps` steps on every thread -> multiply-adds a second, all threads together. */
static double rate(const instruction *ins, long steps, int threads, double *seconds) {
    double total = 0;
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += ins->loop(steps);
    *seconds = omp_get_wtime() - start;
    sink = total;
    return (double)ins->macs * steps * threads / *seconds;
}

double peak_macs(const char *name, int threads, int repeats) {
    const instruction *ins = find(name);
    if (ins == NULL || !supported(ins) || threads < 1) return -1;
    double seconds = 0, best = 0;
    long steps = 1000;
    while (rate(ins, steps, threads, &seconds), seconds < MIN_SECONDS) steps *= 2; /* also the warm-up */
    for (int r = 0; r < repeats; r++) {
        const double measured = rate(ins, steps, threads, &seconds);
        if (measured > best) best = measured;
    }
    return best;
}
