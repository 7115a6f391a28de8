/* The target runtime's CPU kernels: the "stream" linear (below) and a fused RMSNorm.
 *
 * gemm: out[M, N] = x[M, K] @ W^T for a weight W [N, K] held in column blocks: the storage of
 * specrl.models.linear's "stream" calls, built for the few rows of a decode or verify step,
 * where reading the weight once is the whole cost.
 *
 * Layout: W is kept as [N / 16, K, 16] (block b, input k, lane j) = W[16 b + j, k]: each block of
 * 16 outputs is one contiguous stream over K. The kernel is the outer-product form of a GEMM
 * micro-kernel: for a group of NV vectors of outputs and up to MR rows of x, the MR x NV
 * accumulators stay in registers while k runs over K; each step loads NV weight vectors once and
 * multiplies each by MR broadcast x values. The weight group is read from memory by its first MR
 * rows and from L2 by any further ones, so a verify over 5 positions streams the same bytes as
 * one position; there are no horizontal sums. Weights are float32 or float16 (converted in
 * registers: half the bytes streamed; products and sums in float32) or bfloat16 in pairs of inputs
 * (below: AMX tiles or AVX512-BF16 dot products on x rounded to bf16); x and out are float32. int8 and
 * 4-bit weights (kinds 3 and 4) take integer dot products on x quantized to int8: _cpu_quant.c.
 *
 * Paths, chosen at run time from the CPU: AVX-512F (16 lanes, 6 rows x 4 vectors; 12 rows x 2
 * vectors for chunks of 7-12 rows), AVX2 + FMA + F16C (8 lanes, 6 rows x 2 vectors), and portable C;
 * for bfloat16, AMX, AVX512-BF16 or C. Threads:
 * OpenMP over groups of outputs, with the count the caller passes (torch's), in the runtime torch already loaded (libgomp.so.1 by
 * soname: one thread pool). The GIL is released while it runs. The caller (linear.py) checks
 * shapes, dtypes and contiguity; this file trusts its arguments.
 *
 * attend: one layer's rotary embedding, KV-cache write and attention for the few tokens a row of a
 * decode or verify step feeds (T <= 64), in one call instead of ~25 torch ops (SDPA alone took
 * 91 us a layer at context 300, B = 1, T = 1, on the AVX2 EPYC). Each (sequence, query head) pair
 * reads its keys and values once for all the sequence's tokens.
 *
 * silu_mul: SwiGLU's silu(gate) * up over the fused gate|up output, one pass.
 *
 * layer: a whole decoder layer of a decode or verify step (norms, the four stream linears, attend,
 * SwiGLU, residuals) in one call, when every linear of the layer streams.
 *
 * rms_norm: out = x / sqrt(mean(x^2) + eps) * w over rows of H float32 values, in one pass per
 * row instead of torch's six ops (~40 us of dispatch a call for SmolLM2's 576 values, 61 calls a
 * forward). The sum is accumulated in double, so it rounds no worse than torch's float32 mean.
 *
 * release_threads: the calling thread's OpenMP worker threads exit (specrl.models.compute_threads
 * says why and who calls it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <omp.h>
#include <string.h>
#include <stdlib.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_cpu_amx.h"
#include "_cpu_exp.h"
#include "_cpu_half.h"
#include "_cpu_peak.h"
#include "_cpu_quant.h"
#include "_cpu_sample.h"


#define BLOCK 16 /* outputs per column block (the layout), whatever the vector width */
/* Each column block the tile streams is prefetched PF_AHEAD inputs ahead (2 KB of float16): on the
 * AVX2 EPYC (2 threads, 26-29 GB/s read) the layers' and head's matmuls took 11.6 against 13.4 ms a
 * forward at 1 row and 19.6 against 22.5 at 5 (median of 8, side by side; 128 and 256 ahead no better). */
#define PF_AHEAD 64

enum { W_F32 = 0, W_F16 = 1, W_BF16 = 2, W_I8 = 3, W_Q4 = 4 };
/* gemm's path: the best the CPU has; portable C; bfloat16 on AVX512-BF16 even where AMX is there; int8
 * and 4-bit on AVX2 even where VNNI is there (the last three for tests). One path for every row count: AMX and AVX512-BF16 sum in different
 * orders (7e-7 apart on [3072, 576]), and a verify must compute each row as a decode step does,
 * bit for bit, or greedy speculation could pick another token than plain decoding. */
/* 3: int8/4-bit on AVX2; 4: int8/4-bit on AMX-INT8 tiles where the CPU has them (a call the calibration times) */
enum { PATH_BEST = 0, PATH_PORTABLE = 1, PATH_NO_AMX = 2, PATH_AVX2 = 3, PATH_AMX_INT8 = 4 };

/* ---- portable C ------------------------------------------------------------------------- */

/* Column blocks [b0, b1) for every x row. */
static void blocks_portable(const float *x, const void *w, float *out, int64_t M, int64_t K, int64_t N,
                            int64_t b0, int64_t b1, int kind) {
    for (int64_t b = b0; b < b1; b++) {
        for (int64_t m = 0; m < M; m++) {
            float acc[BLOCK] = {0};
            for (int64_t k = 0; k < K; k++) {
                float xv = x[m * K + k];
                size_t at = ((size_t)b * K + k) * BLOCK;
                for (int j = 0; j < BLOCK; j++)
                    acc[j] += xv * (kind == W_F32 ? ((const float *)w)[at + j] : half_to_float(((const uint16_t *)w)[at + j]));
            }
            memcpy(out + m * N + b * BLOCK, acc, sizeof acc);
        }
    }
}

/* ---- vector paths ----------------------------------------------------------------------- */

__attribute__((target("avx2,fma,f16c"))) static inline __m256 load8(const void *w, size_t i, int kind) {
    if (kind == W_F32) return _mm256_loadu_ps((const float *)w + i);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
}

__attribute__((target("avx512f"))) static inline __m512 load16(const void *w, size_t i, int kind) {
    if (kind == W_F32) return _mm512_loadu_ps((const float *)w + i);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
}

/* vector v (of NV) of a group at column block b0, input k: block b0 + v*LANES/BLOCK, lane offset
 * (v*LANES) % BLOCK. */
#define AT(b0, v, k, LANES) ((((size_t)(b0) + (size_t)(v) * (LANES) / BLOCK) * K + (k)) * BLOCK + ((v) * (LANES)) % BLOCK)

/* One tile: MRV rows (compile time, so the MRV x NV accumulators live in registers) from row m0,
 * against the NV * LANES outputs from column block b0. */
#define TILE(NAME, ISA, VEC, LANES, NV, LOAD, FMA, ZERO, BCAST, STORE, MRV)                                    \
    __attribute__((target(ISA))) static void tile_##NAME##_##MRV(const float *x, const void *w, float *out,   \
                                                                  int64_t K, int64_t N, int64_t m0,            \
                                                                  int64_t b0, int kind) {                      \
        VEC acc[MRV][NV];                                                                                      \
        for (int i = 0; i < MRV; i++)                                                                          \
            for (int v = 0; v < NV; v++) acc[i][v] = ZERO();                                                  \
        const size_t esize = kind == W_F32 ? 4 : 2;                                                            \
        for (int64_t k = 0; k < K; k++) {                                                                      \
            VEC wv[NV];                                                                                        \
            for (int v = 0; v < NV; v += BLOCK / (LANES))                                                     \
                _mm_prefetch((const char *)w + (AT(b0, v, k, LANES) + PF_AHEAD * BLOCK) * esize, _MM_HINT_T0);  \
            for (int v = 0; v < NV; v++) wv[v] = LOAD(w, AT(b0, v, k, LANES), kind);                           \
            for (int i = 0; i < MRV; i++) {                                                                    \
                VEC xv = BCAST(x[(m0 + i) * K + k]);                                                           \
                for (int v = 0; v < NV; v++) acc[i][v] = FMA(xv, wv[v], acc[i][v]);                            \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < MRV; i++)                                                                          \
            for (int v = 0; v < NV; v++) STORE(out + (m0 + i) * N + b0 * BLOCK + v * LANES, acc[i][v]);        \
    }

typedef void (*tile_fn)(const float *, const void *, float *, int64_t, int64_t, int64_t, int64_t, int);

/* Column blocks [b0, b1) (a whole number of groups) for every x row: tiles of MRMAX rows, then one
 * of the rows left (TILES[r]: the tile of r rows). */
#define BLOCKS(NAME, ISA, LANES, NV, MRMAX, TILES)                                                             \
    __attribute__((target(ISA))) static void blocks_##NAME(const float *x, const void *w, float *out,         \
                                                           int64_t M, int64_t K, int64_t N, int64_t b0,        \
                                                           int64_t b1, int kind) {                             \
        const int64_t per_group = (int64_t)(NV) * (LANES) / BLOCK;                                             \
        for (int64_t b = b0; b < b1; b += per_group) {                                                         \
            int64_t m = 0;                                                                                     \
            for (; m + MRMAX <= M; m += MRMAX) TILES[MRMAX](x, w, out, K, N, m, b, kind);                      \
            if (m < M) TILES[M - m](x, w, out, K, N, m, b, kind);                                              \
        }                                                                                                      \
    }

#define AVX2 "avx2,fma,f16c"
#define AVX2_TILE(MRV) TILE(avx2, AVX2, __m256, 8, 2, load8, _mm256_fmadd_ps, _mm256_setzero_ps, _mm256_set1_ps, _mm256_storeu_ps, MRV)
AVX2_TILE(1) AVX2_TILE(2) AVX2_TILE(3) AVX2_TILE(4) AVX2_TILE(5) AVX2_TILE(6)
static const tile_fn avx2_tiles[] = {NULL, tile_avx2_1, tile_avx2_2, tile_avx2_3, tile_avx2_4, tile_avx2_5, tile_avx2_6};
BLOCKS(avx2, AVX2, 8, 2, 6, avx2_tiles) /* 6 x 2 accumulators + 2 weight vectors + 1 broadcast: 15 of 16 registers */

#define AVX512 "avx512f"
/* 6 x 4 accumulators + 4 weight vectors + 1 broadcast: 29 of 32 registers. (8 x 3 measured the same
 * at 8 rows and slower at 1-5 on [3072, 576], a layer's largest weight.) */
#define AVX512_TILE(MRV) TILE(avx512, AVX512, __m512, 16, 4, load16, _mm512_fmadd_ps, _mm512_setzero_ps, _mm512_set1_ps, _mm512_storeu_ps, MRV)
AVX512_TILE(1) AVX512_TILE(2) AVX512_TILE(3) AVX512_TILE(4) AVX512_TILE(5) AVX512_TILE(6)
/* 7-12 rows: 12 x 2 accumulators + 2 weight vectors + 1 broadcast: 27 of 32 registers, over a group's two
 * halves (see WIDE_ROWS). */
#define AVX512_WIDE_TILE(MRV) TILE(avx512w, AVX512, __m512, 16, 2, load16, _mm512_fmadd_ps, _mm512_setzero_ps, _mm512_set1_ps, _mm512_storeu_ps, MRV)
AVX512_WIDE_TILE(7) AVX512_WIDE_TILE(8) AVX512_WIDE_TILE(9) AVX512_WIDE_TILE(10) AVX512_WIDE_TILE(11)
AVX512_WIDE_TILE(12)
/* up to 6 rows over four blocks; 7-12 rows over two (chunk_rows) */
static const tile_fn avx512_tiles[] = {NULL, tile_avx512_1, tile_avx512_2, tile_avx512_3, tile_avx512_4,
                                       tile_avx512_5, tile_avx512_6, tile_avx512w_7, tile_avx512w_8,
                                       tile_avx512w_9, tile_avx512w_10, tile_avx512w_11, tile_avx512w_12};

/* Row chunks: M rows in ceil(M / 12) chunks of near-equal size (13 rows: 7 + 6, not 12 + 1). A chunk of
 * up to 6 rows takes the 6 x 4 tile over a group of four blocks; one of 7-12 rows the 12 x 2 tile over
 * each half of the group. Why wide tiles: every chunk after a group's first re-reads the group's
 * weights and multiplies them at a few rows, which a tile of few accumulators cannot hide; past 6 rows
 * the 6 x 4 tile left a whole extra pass (bf16 SmolLM2 forward, AVX-512 EPYC, 2 threads: 6 rows 13.5 ms,
 * 7 rows 15.4, while 1 -> 6 rows cost +2.5). */
#define WIDE_ROWS 12
static inline int64_t chunk_rows(int64_t M, int64_t m) {
    const int64_t chunks = (M + WIDE_ROWS - 1) / WIDE_ROWS, done = m * chunks / M; /* chunks before row m */
    return (M * (done + 1) + chunks - 1) / chunks - m;
}

__attribute__((target(AVX512))) static void blocks_avx512(const float *x, const void *w, float *out, int64_t M,
                                                          int64_t K, int64_t N, int64_t b0, int64_t b1, int kind) {
    for (int64_t b = b0; b < b1; b += 4)
        for (int64_t m = 0, rows; m < M; m += rows) {
            rows = chunk_rows(M, m);
            avx512_tiles[rows](x, w, out, K, N, m, b, kind);
            if (rows > 6) avx512_tiles[rows](x, w, out, K, N, m, b + 2, kind);
        }
}

/* ---- bfloat16 weights --------------------------------------------------------------------- */

/* bfloat16 weights are kept in pairs of inputs, [N / 16, K / 2, 16, 2] (block b, pair p, lane j, e) =
 * W[16 b + j, 2 p + e]: each 64-byte row of a block is 16 outputs x 2 inputs, which is both what
 * one AVX512-BF16 dot-product instruction takes and the row of an AMX B tile (16 such rows = 32
 * inputs). x is rounded to bfloat16 once per call (round to nearest even), then the products of
 * two bf16 values are exact in float32 and summed there. Paths: AMX (tiles of 16 rows x 64
 * outputs, K a multiple of 32), AVX512-BF16 (6 rows x 4 vectors, as the float32 tile), portable C. */

static int has_avx512_bf16 = 0, has_amx = 0; /* has_amx: the CPU has AMX-BF16 and Linux let us use it */

static uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void blocks_bf16_portable(const uint16_t *xb, const uint16_t *w, float *out, int64_t M, int64_t K, int64_t N,
                                 int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
        for (int64_t m = 0; m < M; m++) {
            float acc[BLOCK] = {0};
            for (int64_t k = 0; k < K; k++) {
                const float xv = bf16_to_float(xb[m * K + k]);
                const uint16_t *row = w + ((size_t)b * K + (k & ~(int64_t)1)) * BLOCK + (k & 1);
                for (int j = 0; j < BLOCK; j++) acc[j] += xv * bf16_to_float(row[2 * j]);
            }
            memcpy(out + m * N + b * BLOCK, acc, sizeof acc);
        }
}

/* AVX512-BF16: MRV rows x NV blocks (NV = 4 up to 6 rows, 2 for 7-12: chunk_rows); per input pair, NV weight
 * rows (64 bytes each) and one 32-bit broadcast of the row's two x values per row. */
#define BF16_TILE(NV, MRV)                                                                                     \
    __attribute__((target("avx512f,avx512bf16"))) static void tile_bf16_##NV##_##MRV(                          \
        const uint16_t *xb, const uint16_t *w, float *out, int64_t K, int64_t N, int64_t m0, int64_t b0) {     \
        __m512 acc[MRV][NV];                                                                                   \
        for (int i = 0; i < MRV; i++)                                                                          \
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_setzero_ps();                                      \
        const uint16_t *wb = w + (size_t)b0 * K * BLOCK;                                                       \
        for (int64_t p = 0; p < K / 2; p++) {                                                                  \
            __m512i wv[NV];                                                                                    \
            for (int v = 0; v < NV; v++) {                                                                     \
                const uint16_t *row = wb + ((size_t)v * K / 2 + p) * 2 * BLOCK;                                \
                _mm_prefetch((const char *)(row + PF_AHEAD * BLOCK), _MM_HINT_T0);                             \
                wv[v] = _mm512_loadu_si512((const void *)row);                                                 \
            }                                                                                                  \
            for (int i = 0; i < MRV; i++) {                                                                    \
                uint32_t pair;                                                                                 \
                memcpy(&pair, xb + (m0 + i) * K + 2 * p, 4);                                                   \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);                                    \
                for (int v = 0; v < NV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xv, (__m512bh)wv[v]);     \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < MRV; i++)                                                                          \
            for (int v = 0; v < NV; v++) _mm512_storeu_ps(out + (m0 + i) * N + (b0 + v) * BLOCK, acc[i][v]);   \
    }
BF16_TILE(4, 1) BF16_TILE(4, 2) BF16_TILE(4, 3) BF16_TILE(4, 4) BF16_TILE(4, 5) BF16_TILE(4, 6)
BF16_TILE(2, 7) BF16_TILE(2, 8) BF16_TILE(2, 9) BF16_TILE(2, 10) BF16_TILE(2, 11) BF16_TILE(2, 12)
typedef void (*bf16_tile_fn)(const uint16_t *, const uint16_t *, float *, int64_t, int64_t, int64_t, int64_t);
/* up to 6 rows over four blocks; 7-12 rows over two (chunk_rows) */
static const bf16_tile_fn bf16_tiles[] = {NULL, tile_bf16_4_1, tile_bf16_4_2, tile_bf16_4_3, tile_bf16_4_4,
                                          tile_bf16_4_5, tile_bf16_4_6, tile_bf16_2_7, tile_bf16_2_8, tile_bf16_2_9,
                                          tile_bf16_2_10, tile_bf16_2_11, tile_bf16_2_12};

__attribute__((target("avx512f,avx512bf16"))) static void blocks_bf16_avx512(
    const uint16_t *xb, const uint16_t *w, float *out, int64_t M, int64_t K, int64_t N, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += 4)
        for (int64_t m = 0, rows; m < M; m += rows) {
            rows = chunk_rows(M, m);
            bf16_tiles[rows](xb, w, out, K, N, m, b);
            if (rows > 6) bf16_tiles[rows](xb, w, out, K, N, m, b + 2);
        }
}

/* AMX: tiles 0-3 accumulate 16 rows x 4 blocks (float32), tile 4 holds 16 rows x 32 inputs of x,
 * tiles 5-7 a block's 32 inputs (16 pairs x 16 outputs: 1 KB of the block's stream). xb has its
 * rows padded to a multiple of 16 with zeros; a last partial row group is stored through `part`.
 * The rows of a group share each weight tile: a verify over 16 positions streams what one does. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_configure(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure_tiles(rows, colsb);
}

__attribute__((target("amx-tile"))) static void amx_release(void) { _tile_release(); }

#define AMX_STORE(T, J)                                                                                        \
    if (full) _tile_stored(T, out + m0 * N + (b + J) * BLOCK, N * 4);                                          \
    else _tile_stored(T, part[J], BLOCK * 4);

__attribute__((target("amx-tile,amx-bf16"))) static void blocks_bf16_amx(
    const uint16_t *xb, const uint16_t *w, float *out, int64_t M, int64_t K, int64_t N, int64_t b0, int64_t b1) {
    float part[4][16][BLOCK];
    const size_t stride = (size_t)K * BLOCK; /* one block's stream, in bf16 values */
    for (int64_t b = b0; b < b1; b += 4) {
        const uint16_t *wb = w + (size_t)b * stride;
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int full = M - m0 >= 16;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < K; k += 32) {
                const uint16_t *wk = wb + (size_t)k * BLOCK;
                _tile_loadd(4, xb + m0 * K + k, K * 2);
                _tile_loadd(5, wk, 64);
                _tile_loadd(6, wk + stride, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(7, wk + 2 * stride, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, wk + 3 * stride, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 4, 5);
            }
            AMX_STORE(0, 0) AMX_STORE(1, 1) AMX_STORE(2, 2) AMX_STORE(3, 3)
            if (!full)
                for (int64_t r = 0; r < M - m0; r++)
                    for (int j = 0; j < 4; j++) memcpy(out + (m0 + r) * N + (b + j) * BLOCK, part[j][r], BLOCK * 4);
        }
    }
}

/* x [M, K] float32 -> bfloat16 [rows, K], rows >= M (the rest zero). */
__attribute__((target("avx512f,avx512bf16"))) static void round_rows_avx512(const float *x, uint16_t *xb, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    for (; i < n; i++) xb[i] = float_to_bf16(x[i]);
}

static uint16_t *round_rows(const float *x, int64_t M, int64_t K, int64_t rows, int path) {
    uint16_t *xb = aligned_alloc(64, ((size_t)rows * K * 2 + 63) / 64 * 64);
    if (xb == NULL) return NULL;
    if (has_avx512_bf16 && path != PATH_PORTABLE) round_rows_avx512(x, xb, M * K);
    else
        for (int64_t i = 0; i < M * K; i++) xb[i] = float_to_bf16(x[i]);
    memset(xb + M * K, 0, (size_t)(rows - M) * K * 2);
    return xb;
}

enum { BF16_AMX, BF16_AVX512, BF16_PORTABLE };

/* The bfloat16 path for N outputs of K inputs: AMX needs K in whole tiles (32) and the vector paths
 * whole groups of 4 blocks. */
static int bf16_path(int64_t N, int64_t K, int path) {
    const int fours = (N / BLOCK) % 4 == 0;
    if (has_amx && path == PATH_BEST && K % 32 == 0 && fours) return BF16_AMX;
    if (has_avx512_bf16 && path != PATH_PORTABLE && fours) return BF16_AVX512;
    return BF16_PORTABLE;
}

/* bfloat16 weights: 0 on success, -1 when the rounded x could not be allocated. */
static int gemm_bf16(const float *x, const uint16_t *w, float *out, int64_t M, int64_t K, int64_t N, int threads,
                     int path) {
    const int64_t blocks = N / BLOCK;
    const int chosen = bf16_path(N, K, path), amx = chosen == BF16_AMX, vec = chosen == BF16_AVX512;
    uint16_t *xb = round_rows(x, M, K, amx ? (M + 15) / 16 * 16 : M, path);
    if (xb == NULL) return -1;
    const int64_t group = amx || vec ? 4 : 1, groups = blocks / group;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (amx) amx_configure();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (amx) blocks_bf16_amx(xb, w, out, M, K, N, g * group, (g + 1) * group);
            else if (vec) blocks_bf16_avx512(xb, w, out, M, K, N, g * group, (g + 1) * group);
            else blocks_bf16_portable(xb, w, out, M, K, N, g * group, (g + 1) * group);
        }
        if (amx) amx_release();
    }
    free(xb);
    return 0;
}

/* ---- dispatch --------------------------------------------------------------------------- */

typedef void (*blocks_fn)(const float *, const void *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int);

/* -> the path for N outputs, and how many column blocks one of its groups spans. */
static int has_avx512 = -1, has_avx2 = -1; /* read once from the CPU (the module's init), not per call */

static blocks_fn pick(int64_t N, const char **name, int64_t *group) {
    int64_t blocks = N / BLOCK;
    if (blocks % 4 == 0 && has_avx512) { *name = "avx512f"; *group = 4; return blocks_avx512; }
    if (has_avx2) { *name = "avx2"; *group = 1; return blocks_avx2; }
    *name = "portable";
    *group = 1;
    return blocks_portable;
}

/* 0 on success, -1 when memory ran out (bfloat16 weights round x into a buffer first). */
/* prefetch: int8 and 4-bit weights' software prefetch distance in bytes (0: none; _cpu_quant.c) */
static int gemm(const float *x, const void *w, float *out, int64_t M, int64_t K, int64_t N, int kind, int threads,
                int path, int64_t prefetch) {
    if (kind == W_BF16) return gemm_bf16(x, (const uint16_t *)w, out, M, K, N, threads, path);
    if (kind >= W_I8)
        return gemm_quant(x, w, out, M, K, N, kind, threads,
                          path == PATH_PORTABLE   ? QUANT_PORTABLE
                          : path == PATH_AVX2     ? QUANT_AVX2
                          : path == PATH_AMX_INT8 ? QUANT_AMX
                                                  : QUANT_BEST,
                          prefetch);
    const char *name;
    int64_t group;
    blocks_fn run = pick(N, &name, &group);
    if (path == PATH_PORTABLE) run = blocks_portable, group = 1;
    int64_t groups = N / BLOCK / group;
    /* chunks of whole groups, a few per thread: static, so each thread streams one contiguous range */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) run(x, w, out, M, K, N, g * group, (g + 1) * group, kind);
    return 0;
}

static PyObject *py_gemm(PyObject *self, PyObject *args) {
    unsigned long long x, w, out;
    long long M, K, N;
    int kind, threads, path = PATH_BEST;
    long long prefetch = 0;
    if (!PyArg_ParseTuple(args, "KKKLLLii|iL", &out, &x, &w, &M, &K, &N, &kind, &threads, &path, &prefetch))
        return NULL;
    if (M < 0 || K < 1 || N < 0 || N % BLOCK || kind < W_F32 || kind > W_Q4 || (kind == W_BF16 && K % 2) ||
        (kind >= W_I8 && K % 32) || threads < 1 || prefetch < 0 || path < PATH_BEST || path > PATH_AMX_INT8) {
        PyErr_SetString(PyExc_ValueError, "gemm: N must be a multiple of 16, K >= 1 (even for bfloat16, a multiple of "
                                          "32 for int8 and 4-bit), kind 0-4, threads >= 1, path 0-4, prefetch >= 0");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = gemm((const float *)(uintptr_t)x, (const void *)(uintptr_t)w, (float *)(uintptr_t)out, M, K, N, kind,
                  threads, path, prefetch);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static void rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t H, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * H;
        float *o = out + r * H;
        double sq = 0.0;
        for (int64_t h = 0; h < H; h++) sq += (double)xr[h] * xr[h];
        float scale = (float)(1.0 / sqrt(sq / (double)H + eps));
        for (int64_t h = 0; h < H; h++) o[h] = xr[h] * scale * w[h];
    }
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x, w, out;
    long long rows, H;
    double eps;
    if (!PyArg_ParseTuple(args, "KKKLLd", &out, &x, &w, &rows, &H, &eps)) return NULL;
    if (rows < 0 || H < 1) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: rows >= 0 and H >= 1");
        return NULL;
    }
    rms_norm((const float *)(uintptr_t)x, (const float *)(uintptr_t)w, (float *)(uintptr_t)out, rows, H, eps);
    Py_RETURN_NONE;
}

/* ---- decode attention ------------------------------------------------------------------- */

#define ATT_MAX_ROWS 64 /* tokens of one sequence a call: decode and verify steps (prefill takes SDPA) */
#define ATT_MAX_D 256
#define ATT_KEYS 64 /* keys a block */

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < d; e++) s += a[e] * b[e];
    return s;
}

typedef struct {
    float *qkv;             /* [N, (NH + 2 KVH) D]: this step's projections, q and k rotated in place */
    float *out;             /* [N, NH D] */
    float *kc, *vc;         /* one layer's cache [S, KVH, MAX, D] */
    const float *cos, *sin; /* [B T, D] at each token's position (sin with rotate-half's sign) */
    const int64_t *slots;   /* [B] */
    const int64_t *positions, *flat; /* positions [B T]; flat [N]: token i is b T + t = flat[i] */
    const int64_t *first;   /* [sequences + 1]: tokens first[q] .. first[q+1]-1 are one sequence's */
    int64_t N, T, nh, kvh, d, max_len;
} attend_args;

/* Token i: rotate its q and k heads (x cos + swap_halves(x) sin) and store its k and v. */
static inline __attribute__((always_inline)) void rope_store_body(const attend_args *a, int64_t i) {
    const int64_t d = a->d, half = d / 2, width = (a->nh + 2 * a->kvh) * d, f = a->flat[i];
    float *row = a->qkv + i * width, tmp[ATT_MAX_D];
    const float *c = a->cos + f * d, *s = a->sin + f * d;
    for (int64_t h = 0; h < a->nh + a->kvh; h++) {
        float *x = row + h * d;
        memcpy(tmp, x, d * sizeof(float));
#pragma omp simd
        for (int64_t e = 0; e < half; e++) x[e] = tmp[e] * c[e] + tmp[e + half] * s[e];
#pragma omp simd
        for (int64_t e = half; e < d; e++) x[e] = tmp[e] * c[e] + tmp[e - half] * s[e];
    }
    const int64_t p = a->positions[f], slot = a->slots[f / a->T];
    for (int64_t g = 0; g < a->kvh; g++) {
        size_t at = (((size_t)slot * a->kvh + g) * a->max_len + p) * d;
        memcpy(a->kc + at, row + (a->nh + g) * d, d * sizeof(float));
        memcpy(a->vc + at, row + (a->nh + a->kvh + g) * d, d * sizeof(float));
    }
}

/* What the task (sequence q, query head h) reads and writes: its tokens i0 .. i0+rows-1, their q of
 * head h (rows q_stride apart), the K and V of its slot's KV head, its output rows. */
typedef struct {
    int64_t i0, rows, q_stride, out_stride;
    const float *q, *K, *V;
    float *out;
} attend_task;

static inline __attribute__((always_inline)) attend_task task_of(const attend_args *a, int64_t q, int64_t h,
                                                                 int64_t d) {
    attend_task t;
    t.i0 = a->first[q], t.rows = a->first[q + 1] - t.i0;
    t.q_stride = (a->nh + 2 * a->kvh) * d, t.out_stride = a->nh * d;
    const int64_t g = h / (a->nh / a->kvh), slot = a->slots[a->flat[t.i0] / a->T];
    t.q = a->qkv + t.i0 * t.q_stride + h * d;
    t.K = a->kc + ((size_t)slot * a->kvh + g) * a->max_len * d;
    t.V = a->vc + ((size_t)slot * a->kvh + g) * a->max_len * d;
    t.out = a->out + t.i0 * t.out_stride + h * d;
    return t;
}

/* Sequence q, query head h: its tokens' softmax(q k^T / sqrt(D)) v over the keys at or before each
 * token's position, a block of keys at a time with a running max (flash attention's update). A
 * token's result depends on its own position and the cache only, not on how many tokens or
 * sequences share the call: a verify computes what a plain step would. Written for the vectoriser:
 * four keys' dot products at once (four independent sums), and the output row kept in registers
 * while the block's values are added (D a constant in the D = 64 instance). */
static inline __attribute__((always_inline)) void attend_body(const attend_args *a, int64_t q, int64_t h,
                                                              const int64_t d) {
    const attend_task task = task_of(a, q, h, d);
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t r = 0; r < task.rows; r++) {
        float qs[ATT_MAX_D], acc[ATT_MAX_D], sc[ATT_KEYS], m = -INFINITY, l = 0.0f;
        const float *src = task.q + r * task.q_stride;
        for (int64_t e = 0; e < d; e++) qs[e] = src[e] * scale, acc[e] = 0.0f;
        const int64_t keys = a->positions[a->flat[task.i0 + r]] + 1;
        for (int64_t j0 = 0; j0 < keys; j0 += ATT_KEYS) {
            const int64_t n = keys - j0 < ATT_KEYS ? keys - j0 : ATT_KEYS;
            const float *kb = task.K + j0 * d, *vb = task.V + j0 * d;
            int64_t jj = 0;
            for (; jj + 4 <= n; jj += 4) {
                const float *k0 = kb + jj * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t e = 0; e < d; e++) s0 += qs[e] * k0[e], s1 += qs[e] * k1[e], s2 += qs[e] * k2[e], s3 += qs[e] * k3[e];
                sc[jj] = s0, sc[jj + 1] = s1, sc[jj + 2] = s2, sc[jj + 3] = s3;
            }
            for (; jj < n; jj++) sc[jj] = dot(qs, kb + jj * d, d);
            float top = m;
            for (jj = 0; jj < n; jj++) top = sc[jj] > top ? sc[jj] : top;
            float corr = m == -INFINITY ? 0.0f : exp_nonpos(m - top), sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (jj = 0; jj < n; jj++) {
                float e = exp_nonpos(sc[jj] - top);
                sc[jj] = e;
                sum += e;
            }
            l = l * corr + sum;
            m = top;
            float t[ATT_MAX_D];
            for (int64_t e = 0; e < d; e++) t[e] = acc[e] * corr;
            for (jj = 0; jj < n; jj++) {
                const float w = sc[jj], *v = vb + jj * d;
#pragma omp simd
                for (int64_t e = 0; e < d; e++) t[e] += w * v[e];
            }
            for (int64_t e = 0; e < d; e++) acc[e] = t[e];
        }
        float *o = task.out + r * task.out_stride, inv = 1.0f / l;
        for (int64_t e = 0; e < d; e++) o[e] = acc[e] * inv;
    }
}

static void rope_store_portable(const attend_args *a, int64_t i) { rope_store_body(a, i); }
/* D = 64 (SmolLM2, most small Llamas) as a constant: the loops over D unroll into whole vectors. */
#define ATTEND_FN(NAME, ISA)                                                                                     \
    ISA static void attend_##NAME(const attend_args *a, int64_t q, int64_t h) {                                \
        if (a->d == 64) attend_body(a, q, h, 64);                                                                \
        else attend_body(a, q, h, a->d);                                                                         \
    }
ATTEND_FN(portable, )
__attribute__((target("avx2,fma"))) static void rope_store_avx2(const attend_args *a, int64_t i) { rope_store_body(a, i); }
ATTEND_FN(avx2_generic, __attribute__((target("avx2,fma"))))

/* attend_body for D = 64 in AVX2 registers: q and the output row are 8 vectors each; four keys'
 * dot products run as four independent FMA chains, summed across lanes together (two hadds). The
 * loop runs over blocks of keys outside and the sequence's tokens inside, so a verify's tokens
 * share each block while it is in L1 (each token's running max, sum and output row wait in
 * memory between blocks): the same arithmetic per token, in the same order, as alone. */
__attribute__((target("avx2,fma"))) static void attend_avx2(const attend_args *a, int64_t q, int64_t h) {
    if (a->d != 64) {
        attend_avx2_generic(a, q, h);
        return;
    }
    enum { D = 64, NV = D / 8 };
    const attend_task task = task_of(a, q, h, D);
    float accs[ATT_MAX_ROWS][D] __attribute__((aligned(32))), qs[ATT_MAX_ROWS][D] __attribute__((aligned(32)));
    float ms[ATT_MAX_ROWS], ls[ATT_MAX_ROWS];
    int64_t keys[ATT_MAX_ROWS], most = 0;
    for (int64_t r = 0; r < task.rows; r++) {
        const float *src = task.q + r * task.q_stride;
        for (int v = 0; v < NV; v++) {
            _mm256_store_ps(qs[r] + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(src + 8 * v), _mm256_set1_ps(0.125f)));
            _mm256_store_ps(accs[r] + 8 * v, _mm256_setzero_ps());
        }
        ms[r] = -INFINITY, ls[r] = 0.0f;
        keys[r] = a->positions[a->flat[task.i0 + r]] + 1;
        most = keys[r] > most ? keys[r] : most;
    }
    float sc[ATT_KEYS] __attribute__((aligned(32)));
    for (int64_t j0 = 0; j0 < most; j0 += ATT_KEYS) {
        const float *kb = task.K + j0 * D, *vb = task.V + j0 * D;
        for (int64_t r = 0; r < task.rows; r++) {
            const int64_t n = keys[r] - j0 < ATT_KEYS ? keys[r] - j0 : ATT_KEYS; /* keys this token sees */
            if (n <= 0) continue;
            __m256 qv[NV], acc[NV];
            for (int v = 0; v < NV; v++) qv[v] = _mm256_load_ps(qs[r] + 8 * v);
            int64_t jj = 0;
            for (; jj + 4 <= n; jj += 4) {
                const float *k0 = kb + jj * D;
                __m256 s0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0)), s1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0 + D));
                __m256 s2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0 + 2 * D)), s3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0 + 3 * D));
                for (int v = 1; v < NV; v++) {
                    s0 = _mm256_fmadd_ps(qv[v], _mm256_loadu_ps(k0 + 8 * v), s0);
                    s1 = _mm256_fmadd_ps(qv[v], _mm256_loadu_ps(k0 + D + 8 * v), s1);
                    s2 = _mm256_fmadd_ps(qv[v], _mm256_loadu_ps(k0 + 2 * D + 8 * v), s2);
                    s3 = _mm256_fmadd_ps(qv[v], _mm256_loadu_ps(k0 + 3 * D + 8 * v), s3);
                }
                __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
                _mm_storeu_ps(sc + jj, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
            }
            for (; jj < n; jj++) {
                __m256 s0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kb + jj * D));
                for (int v = 1; v < NV; v++) s0 = _mm256_fmadd_ps(qv[v], _mm256_loadu_ps(kb + jj * D + 8 * v), s0);
                __m128 x = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
                x = _mm_hadd_ps(x, x);
                sc[jj] = _mm_cvtss_f32(_mm_hadd_ps(x, x));
            }
            const float m = ms[r];
            __m256 vmax = _mm256_set1_ps(m);
            for (jj = 0; jj + 8 <= n; jj += 8) vmax = _mm256_max_ps(vmax, _mm256_load_ps(sc + jj));
            float top, lanes[8];
            _mm256_storeu_ps(lanes, vmax);
            top = lanes[0];
            for (int i = 1; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
            for (; jj < n; jj++) top = sc[jj] > top ? sc[jj] : top;
            const float corr = m == -INFINITY ? 0.0f : exp_nonpos(m - top);
            __m256 vsum = _mm256_setzero_ps(), vtop = _mm256_set1_ps(top);
            for (jj = 0; jj + 8 <= n; jj += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(sc + jj), vtop));
                _mm256_store_ps(sc + jj, e);
                vsum = _mm256_add_ps(vsum, e);
            }
            float sum = 0.0f;
            _mm256_storeu_ps(lanes, vsum);
            for (int i = 0; i < 8; i++) sum += lanes[i];
            for (; jj < n; jj++) sc[jj] = exp_nonpos(sc[jj] - top), sum += sc[jj];
            ls[r] = ls[r] * corr + sum;
            ms[r] = top;
            const __m256 c = _mm256_set1_ps(corr);
            for (int v = 0; v < NV; v++) acc[v] = _mm256_mul_ps(_mm256_load_ps(accs[r] + 8 * v), c);
            for (jj = 0; jj < n; jj++) {
                const __m256 w = _mm256_set1_ps(sc[jj]);
                const float *vj = vb + jj * D;
                for (int v = 0; v < NV; v++) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * v), acc[v]);
            }
            for (int v = 0; v < NV; v++) _mm256_store_ps(accs[r] + 8 * v, acc[v]);
        }
    }
    for (int64_t r = 0; r < task.rows; r++) {
        float *o = task.out + r * task.out_stride;
        const __m256 inv = _mm256_set1_ps(1.0f / ls[r]);
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(o + 8 * v, _mm256_mul_ps(_mm256_load_ps(accs[r] + 8 * v), inv));
    }
}

/* All tokens' rotations and cache writes, then every (sequence, query head) pair's attention. */
static void attend(attend_args *a, int64_t sequences, int threads, int portable) {
    void (*store)(const attend_args *, int64_t) = rope_store_portable;
    void (*att)(const attend_args *, int64_t, int64_t) = attend_portable;
    if (!portable && has_avx2) store = rope_store_avx2, att = attend_avx2; /* AVX-512 CPUs too: D = 64 fits 8 ymm */
    const int64_t nh = a->nh;
    int equal_rows = 1;
    for (int64_t q = 1; q < sequences; q++) equal_rows &= a->first[q + 1] - a->first[q] == a->first[1] - a->first[0];
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < a->N; i++) store(a, i);
        /* Rows of unequal length (a suffix draft of 16 beside rows of 1): tasks go to threads as
         * they free up. A static split gave one thread the long row's every head (SmolLM2's 9
         * heads, B = 4, context 200, 2 threads, both builds alternating in one process: rows
         * [5,1,1,1] 60.8 -> 43.8 us a layer, [9,1,1,1] 94.9 -> 64.1, [17,1,1,1] 135.5 -> 84.3).
         * Equal rows (a plain step, a head draft for every row) split statically: handing them out
         * one by one cost a plain B = 8 bfloat16 step 4.6% on an AMX Xeon (418 against 438 tok/s,
         * 8 alternating rounds). A task's result does not depend on its thread either way. */
        if (equal_rows) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < sequences * nh; task++) att(a, task / nh, task % nh);
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < sequences * nh; task++) att(a, task / nh, task % nh);
        }
    }
}

/* The shapes `attend` takes: N tokens of up to ATT_MAX_ROWS a sequence, NH a multiple of KVH, even D. */
static int attend_shape_ok(int64_t N, int64_t T, int64_t nh, int64_t kvh, int64_t d, int64_t max_len, int threads) {
    return N >= 1 && T >= 1 && T <= ATT_MAX_ROWS && kvh >= 1 && nh % kvh == 0 && d >= 2 && d % 2 == 0 &&
           d <= ATT_MAX_D && max_len >= 1 && threads >= 1;
}

/* -> first [sequences + 1] (PyMem; NULL with MemoryError set): each sequence's first token index, for
 * `attend_args.first`. flat [N] is ascending (b T + t), so a sequence's tokens are consecutive. */
static int64_t *sequence_starts(const int64_t *flat, int64_t N, int64_t T, int64_t *sequences) {
    int64_t *first = PyMem_Malloc((N + 1) * sizeof(int64_t));
    if (first == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    *sequences = 0;
    for (int64_t i = 0; i < N; i++)
        if (i == 0 || flat[i] / T != flat[i - 1] / T) first[(*sequences)++] = i;
    first[*sequences] = N;
    return first;
}

static PyObject *py_attend(PyObject *self, PyObject *args) {
    unsigned long long out, qkv, kc, vc, cos, sin, slots, positions, flat;
    long long N, T, nh, kvh, d, max_len;
    int threads, portable = 0;
    if (!PyArg_ParseTuple(args, "KKKKKKKKKLLLLLLi|p", &out, &qkv, &kc, &vc, &cos, &sin, &slots, &positions, &flat,
                          &N, &T, &nh, &kvh, &d, &max_len, &threads, &portable))
        return NULL;
    if (!attend_shape_ok(N, T, nh, kvh, d, max_len, threads)) {
        PyErr_Format(PyExc_ValueError, "attend: needs N >= 1, 1 <= T <= %d, NH a multiple of KVH, even D <= %d, "
                     "threads >= 1", ATT_MAX_ROWS, ATT_MAX_D);
        return NULL;
    }
    attend_args a = {(float *)(uintptr_t)qkv, (float *)(uintptr_t)out, (float *)(uintptr_t)kc,
                     (float *)(uintptr_t)vc, (const float *)(uintptr_t)cos, (const float *)(uintptr_t)sin,
                     (const int64_t *)(uintptr_t)slots, (const int64_t *)(uintptr_t)positions,
                     (const int64_t *)(uintptr_t)flat, NULL, N, T, nh, kvh, d, max_len};
    int64_t sequences, *first = sequence_starts(a.flat, N, T, &sequences);
    if (first == NULL) return NULL;
    a.first = first;
    Py_BEGIN_ALLOW_THREADS
    attend(&a, sequences, threads, portable);
    Py_END_ALLOW_THREADS
    PyMem_Free(first);
    Py_RETURN_NONE;
}

/* ---- SwiGLU ----------------------------------------------------------------------------- */

/* out[r, i] = silu(g) * u with g = gate_up[r, i], u = gate_up[r, I + i] (the fused gate|up linear's
 * output): one pass instead of chunk + silu + mul (~30 us of dispatch a layer). */
static void silu_mul_portable(const float *gate_up, float *out, int64_t rows, int64_t I, int64_t i0) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = i0; i < I; i++) {
            const float g = gate_up[r * 2 * I + i];
            out[r * I + i] = g / (1.0f + expf(-g)) * gate_up[r * 2 * I + I + i];
        }
}

__attribute__((target("avx2,fma"))) static void silu_mul_avx2(const float *gate_up, float *out, int64_t rows, int64_t I) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const int64_t whole = I / 8 * 8;
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * I, *u = g + I;
        for (int64_t i = 0; i < whole; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
            _mm256_storeu_ps(out + r * I + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
    }
    if (whole < I) silu_mul_portable(gate_up, out, rows, I, whole);
}

static void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t I, int portable) {
    if (has_avx2 && !portable) silu_mul_avx2(gate_up, out, rows, I);
    else silu_mul_portable(gate_up, out, rows, I, 0);
}

/* The arguments of a row-wise op: (out, x, rows, cols, portable=False), rows >= 0 and cols >= 1. */
typedef struct { unsigned long long out, x; long long rows, cols; int portable; } row_op_args;

static int parse_row_op(PyObject *args, const char *name, row_op_args *a) {
    a->portable = 0;
    if (!PyArg_ParseTuple(args, "KKLL|p", &a->out, &a->x, &a->rows, &a->cols, &a->portable)) return 0;
    if (a->rows < 0 || a->cols < 1) {
        PyErr_Format(PyExc_ValueError, "%s: rows >= 0 and a row of at least 1 value", name);
        return 0;
    }
    return 1;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    row_op_args a;   /* cols: I, half of gate_up's row */
    if (!parse_row_op(args, "silu_mul", &a)) return NULL;
    silu_mul((const float *)(uintptr_t)a.x, (float *)(uintptr_t)a.out, a.rows, a.cols, a.portable);
    Py_RETURN_NONE;
}

/* ---- argmax ------------------------------------------------------------------------------ */

/* The first index of the largest of V finite floats (a row of logits). Why not torch's argmax: it
 * read a 49k row in ~40 us on 2 threads of an AVX-512 EPYC, and a greedy verify step takes one per
 * verified position. Pass 1 finds the max (4 x 8 lanes), pass 2 the first index holding it (it
 * stops there). */
static int64_t argmax_portable(const float *x, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

__attribute__((target("avx2"))) static int64_t argmax_avx2(const float *x, int64_t V) {
    if (V < 32) return argmax_portable(x, V);
    __m256 m0 = _mm256_loadu_ps(x), m1 = m0, m2 = m0, m3 = m0;
    int64_t i = 0;
    for (; i + 32 <= V; i += 32) {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
        m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + i + 16));
        m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + i + 24));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    float m = lanes[0];
    for (int l = 1; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; i < V; i++) m = x[i] > m ? x[i] : m;
    const __m256 target = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= V; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < V; i++)
        if (x[i] == m) return i;
    return 0; /* only for non-finite input */
}

static PyObject *py_quant_rows(PyObject *self, PyObject *args) {
    unsigned long long out, w, ids;
    long long n, K, N;
    int kind;
    if (!PyArg_ParseTuple(args, "KKKLLLi", &out, &w, &ids, &n, &K, &N, &kind)) return NULL;
    if (n < 0 || K < 32 || K % 32 || N < 0 || N % BLOCK || (kind != W_I8 && kind != W_Q4)) {
        PyErr_SetString(PyExc_ValueError, "quant_rows: K a multiple of 32, N of 16, kind 3 (int8) or 4 (4-bit)");
        return NULL;
    }
    if (quant_rows((const void *)(uintptr_t)w, (const int64_t *)(uintptr_t)ids, n, K, N, kind,
                   (float *)(uintptr_t)out)) {
        PyErr_SetString(PyExc_IndexError, "quant_rows: a row id outside the weight's rows");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_argmax_rows(PyObject *self, PyObject *args) {
    row_op_args a;   /* cols: V */
    if (!parse_row_op(args, "argmax_rows", &a)) return NULL;
    const float *xs = (const float *)(uintptr_t)a.x;
    int64_t *o = (int64_t *)(uintptr_t)a.out;
    for (int64_t r = 0; r < a.rows; r++)
        o[r] = has_avx2 && !a.portable ? argmax_avx2(xs + r * a.cols, a.cols) : argmax_portable(xs + r * a.cols, a.cols);
    Py_RETURN_NONE;
}

/* log softmax(x)_i at i = argmax x, i.e. -log sum_j exp(x_j - m) with m = max x: the log q of a greedy draft (at
 * temperature 1), what the reward stream records beside it. Through torch a logsumexp over an 8k-id draft row took
 * ~50 us at B = 1 (2 threads, Xeon), a seventh of a drafter pass; here one more pass over the row. */
static float neg_log_sum_exp_portable(const float *x, int64_t V, float m) {
    float s = 0.0f;
    for (int64_t i = 0; i < V; i++) s += exp_nonpos(x[i] - m);
    return -logf(s);
}

__attribute__((target("avx2,fma"))) static float neg_log_sum_exp_avx2(const float *x, int64_t V, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    float lanes[8], s = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++) s += lanes[l];
    for (; i < V; i++) s += exp_nonpos(x[i] - m);
    return -logf(s);
}

static PyObject *py_argmax_logprob_rows(PyObject *self, PyObject *args) {
    unsigned long long out, logprob, x;
    long long rows, V;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "KKKLL|p", &out, &logprob, &x, &rows, &V, &portable)) return NULL;
    if (rows < 0 || V < 1) {
        PyErr_SetString(PyExc_ValueError, "argmax_logprob_rows: rows >= 0 and a row of at least 1 value");
        return NULL;
    }
    const float *xs = (const float *)(uintptr_t)x;
    int64_t *o = (int64_t *)(uintptr_t)out;
    float *lp = (float *)(uintptr_t)logprob;
    const int vector = has_avx2 && !portable;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = xs + r * V;
        o[r] = vector ? argmax_avx2(row, V) : argmax_portable(row, V);
        lp[r] = vector ? neg_log_sum_exp_avx2(row, V, row[o[r]]) : neg_log_sum_exp_portable(row, V, row[o[r]]);
    }
    Py_RETURN_NONE;
}

static PyObject *py_sample_rows(PyObject *self, PyObject *args) {
    unsigned long long tokens, log_normaliser, logits, inv_temperature, uniforms, top_k;
    long long rows, V;
    int threads, portable = 0;
    if (!PyArg_ParseTuple(args, "KKKLLKKKi|p", &tokens, &log_normaliser, &logits, &rows, &V, &inv_temperature,
                          &uniforms, &top_k, &threads, &portable))
        return NULL;
    if (rows < 0 || V < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "sample_rows: rows >= 0, a row of at least 1 logit, threads >= 1");
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = sample_rows((const float *)(uintptr_t)logits, rows, V, (const float *)(uintptr_t)inv_temperature,
                         (const float *)(uintptr_t)uniforms, (const int64_t *)(uintptr_t)top_k, (int64_t *)(uintptr_t)tokens,
                         (float *)(uintptr_t)log_normaliser, threads, portable);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ---- one decoder layer ------------------------------------------------------------------ */

/* A decode or verify step's whole layer when its four linears stream (blocked weights of one kind):
 * out = x1 + down(silu_mul(gate_up(rms_norm(x1)))), x1 = x + o(attend(qkv(rms_norm(x)))). The same
 * kernels in the same order as the per-op path (llama.py), so the same values to the bit; what it
 * saves is the Python and dispatch between them (~3.7 ms of a 16.9 ms SmolLM2 forward at B = 1). */
/* One decoder layer's weights for `decoder_layer`: what `layer` takes as arguments and `layers` reads from a row
 * of its table (LAYER_FIELDS int64 values: the four blocked weights, the weights' kind, the two norms' float32
 * weights, then for each of the four linears its gemm path and its int8/4-bit prefetch distance in bytes: the
 * stream call the calibration chose for it at this row count). */
enum { LW_QKV, LW_O, LW_GU, LW_DOWN, LW_KIND, LW_NORM_IN, LW_NORM_POST, LW_CALL, LAYER_FIELDS = LW_CALL + 8 };
#define LW_PATH(i) ((int)lw[LW_CALL + 2 * (i)])
#define LW_PF(i) lw[LW_CALL + 2 * (i) + 1]

/* One layer of a decode or verify step: y = x + attention(norm(x)), then y += mlp(norm(y)); the cache arguments
 * (`a`: its k and v pointers already this layer's) as `attend` takes them. -> 0, or nonzero when memory ran out. */
static int decoder_layer(float *y, const float *xin, float *scratch, const int64_t *lw, double eps, int64_t H,
                         int64_t Wq, int64_t I, attend_args *a, int64_t sequences, int threads) {
    const int64_t N = a->N, nh = a->nh, d = a->d;
    const int kind = (int)lw[LW_KIND];
    float *h = scratch, *qkv = h + N * H, *att = qkv + N * Wq, *o = att + N * nh * d;
    float *x1 = o + N * H, *h2 = x1 + N * H, *gu = h2 + N * H, *act = gu + N * 2 * I, *dn = act + N * I;
    a->qkv = qkv;
    a->out = att;
    int status = 0;
    rms_norm(xin, (const float *)(uintptr_t)lw[LW_NORM_IN], h, N, H, eps);
    status |= gemm(h, (const void *)(uintptr_t)lw[LW_QKV], qkv, N, H, Wq, kind, threads, LW_PATH(0), LW_PF(0));
    attend(a, sequences, threads, 0);
    status |= gemm(att, (const void *)(uintptr_t)lw[LW_O], o, N, nh * d, H, kind, threads, LW_PATH(1), LW_PF(1));
    for (int64_t i = 0; i < N * H; i++) x1[i] = xin[i] + o[i];
    rms_norm(x1, (const float *)(uintptr_t)lw[LW_NORM_POST], h2, N, H, eps);
    status |= gemm(h2, (const void *)(uintptr_t)lw[LW_GU], gu, N, H, 2 * I, kind, threads, LW_PATH(2), LW_PF(2));
    silu_mul(gu, act, N, I, 0);
    status |= gemm(act, (const void *)(uintptr_t)lw[LW_DOWN], dn, N, I, H, kind, threads, LW_PATH(3), LW_PF(3));
    for (int64_t i = 0; i < N * H; i++) y[i] = x1[i] + dn[i];
    return status;
}

/* A linear's stream call (gemm path, prefetch distance) as a layer row holds it. */
static int calls_ok(const int64_t *lw) {
    for (int i = 0; i < 4; i++)
        if (LW_PATH(i) < PATH_BEST || LW_PATH(i) > PATH_AMX_INT8 || LW_PF(i) < 0) {
            PyErr_SetString(PyExc_ValueError, "layer: a linear's gemm path must be 0-4 and its prefetch >= 0");
            return 0;
        }
    return 1;
}

static int layer_shapes_ok(int64_t N, int64_t T, int64_t nh, int64_t kvh, int64_t d, int64_t max_len, int threads,
                           int64_t H, int64_t Wq, int64_t I, int64_t kind) {
    if (!attend_shape_ok(N, T, nh, kvh, d, max_len, threads) || H % BLOCK || Wq % BLOCK || (2 * I) % BLOCK ||
        Wq != (nh + 2 * kvh) * d || kind < W_F32 || kind > W_Q4 || (kind >= W_I8 && (H % 32 || I % 32 ||
        (nh * d) % 32)) || (kind == W_BF16 && (H % 2 || I % 2 || d % 2))) {
        PyErr_SetString(PyExc_ValueError, "layer: shapes the stream kernel and attend cannot take");
        return 0;
    }
    return 1;
}

static PyObject *py_layer(PyObject *self, PyObject *args) {
    unsigned long long out, x, scratch, norm_in, norm_post;
    unsigned long long kc, vc, cos, sin, slots, positions, flat;
    long long H, Wq, I, N, T, nh, kvh, d, max_len;
    int64_t lw[LAYER_FIELDS] = {0};
    int kind, threads;
    double eps;
    int64_t *call = lw + LW_CALL;
    if (!PyArg_ParseTuple(args, "KKKLLLLiKKdLLLKKKKKKKLLLLLLi|LLLLLLLL", &out, &x, &scratch, &lw[LW_QKV], &lw[LW_O],
                          &lw[LW_GU], &lw[LW_DOWN], &kind, &norm_in, &norm_post, &eps, &H, &Wq, &I, &kc, &vc, &cos,
                          &sin, &slots, &positions, &flat, &N, &T, &nh, &kvh, &d, &max_len, &threads, &call[0],
                          &call[1], &call[2], &call[3], &call[4], &call[5], &call[6], &call[7]))
        return NULL;
    if (!layer_shapes_ok(N, T, nh, kvh, d, max_len, threads, H, Wq, I, kind) || !calls_ok(lw)) return NULL;
    lw[LW_KIND] = kind, lw[LW_NORM_IN] = (int64_t)norm_in, lw[LW_NORM_POST] = (int64_t)norm_post;
    attend_args a = {NULL, NULL, (float *)(uintptr_t)kc, (float *)(uintptr_t)vc, (const float *)(uintptr_t)cos,
                     (const float *)(uintptr_t)sin, (const int64_t *)(uintptr_t)slots,
                     (const int64_t *)(uintptr_t)positions, (const int64_t *)(uintptr_t)flat, NULL, N, T, nh, kvh,
                     d, max_len};
    int64_t sequences, *first = sequence_starts(a.flat, N, T, &sequences);
    if (first == NULL) return NULL;
    a.first = first;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decoder_layer((float *)(uintptr_t)out, (const float *)(uintptr_t)x, (float *)(uintptr_t)scratch, lw, eps,
                           H, Wq, I, &a, sequences, threads);
    Py_END_ALLOW_THREADS
    PyMem_Free(first);
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Every layer of a decode or verify step in one call: the Python between 30 `layer` calls was ~0.3 ms of a 4-5 ms
 * q4 forward (AVX2 EPYC), while the other compute thread waited. table: [L, LAYER_FIELDS] int64; layer i reads
 * x (i = 0) or the other buffer and writes buffers[i % 2]; the caches' layer i lies layer_bytes past k and v. */
static PyObject *py_layers(PyObject *self, PyObject *args) {
    unsigned long long buf0, buf1, x, scratch, table;
    unsigned long long kc, vc, cos, sin, slots, positions, flat;
    long long L, layer_bytes, H, Wq, I, N, T, nh, kvh, d, max_len;
    int threads;
    double eps;
    if (!PyArg_ParseTuple(args, "KKKKKLdLLLKKLKKKKKLLLLLLi", &buf0, &buf1, &x, &scratch, &table, &L, &eps, &H, &Wq,
                          &I, &kc, &vc, &layer_bytes, &cos, &sin, &slots, &positions, &flat, &N, &T, &nh, &kvh, &d,
                          &max_len, &threads))
        return NULL;
    const int64_t *rows = (const int64_t *)(uintptr_t)table;
    for (long long i = 0; i < L; i++)
        if (!layer_shapes_ok(N, T, nh, kvh, d, max_len, threads, H, Wq, I, rows[i * LAYER_FIELDS + LW_KIND]) ||
            !calls_ok(rows + i * LAYER_FIELDS))
            return NULL;
    attend_args a = {NULL, NULL, NULL, NULL, (const float *)(uintptr_t)cos, (const float *)(uintptr_t)sin,
                     (const int64_t *)(uintptr_t)slots, (const int64_t *)(uintptr_t)positions,
                     (const int64_t *)(uintptr_t)flat, NULL, N, T, nh, kvh, d, max_len};
    int64_t sequences, *first = sequence_starts(a.flat, N, T, &sequences);
    if (first == NULL) return NULL;
    a.first = first;
    float *buffers[2] = {(float *)(uintptr_t)buf0, (float *)(uintptr_t)buf1};
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < L && !status; i++) {
        a.kc = (float *)(uintptr_t)(kc + i * layer_bytes);
        a.vc = (float *)(uintptr_t)(vc + i * layer_bytes);
        status = decoder_layer(buffers[i % 2], i == 0 ? (const float *)(uintptr_t)x : buffers[(i + 1) % 2],
                               (float *)(uintptr_t)scratch, rows + i * LAYER_FIELDS, eps, H, Wq, I, &a, sequences,
                               threads);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(first);
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_path(PyObject *self, PyObject *args) {
    long long N, K = 32;
    int kind = W_F32, path = PATH_BEST;
    if (!PyArg_ParseTuple(args, "L|iLi", &N, &kind, &K, &path)) return NULL;
    if (kind == W_BF16) {
        static const char *names[] = {"amx", "avx512_bf16", "portable"};
        return PyUnicode_FromString(names[bf16_path(N, K, PATH_BEST)]);
    }
    if (kind >= W_I8) return PyUnicode_FromString(quant_path_name(path == PATH_AMX_INT8 ? QUANT_AMX : QUANT_BEST));
    const char *name;
    int64_t group;
    pick(N, &name, &group);
    return PyUnicode_FromString(name);
}

static PyObject *py_peak_macs(PyObject *self, PyObject *args) {
    const char *name;
    int threads, repeats = 3;
    if (!PyArg_ParseTuple(args, "si|i", &name, &threads, &repeats)) return NULL;
    double rate;
    Py_BEGIN_ALLOW_THREADS rate = peak_macs(name, threads, repeats);
    Py_END_ALLOW_THREADS return PyFloat_FromDouble(rate);
}

static PyObject *py_release_threads(PyObject *self, PyObject *noargs) {
    /* omp_pause_soft frees the calling thread's pool (OpenMP 5.0; libgomp since GCC 9): its
     * workers exit and the runtime counts them no more. -1: called inside a parallel region. */
    return PyLong_FromLong(omp_pause_resource_all(omp_pause_soft));
}

static PyMethodDef methods[] = {
    {"gemm", py_gemm, METH_VARARGS,
     "gemm(out_ptr, x_ptr, w_ptr, M, K, N, kind, threads, path=0, prefetch=0): out[M,N] = x[M,K] @ W^T, W blocked "
     "[N/16, K, 16] (kind 0: float32, 1: float16), [N/16, K/2, 16, 2] (kind 2: bfloat16) or [N/16, K+K/8, 16] (kind 3: int8, "
     "groups of 32 inputs with their float32 scales) or bytes [N/16, 10 K] (kind 4: 4-bit, Q4_1's groups of 32 "
     "with float16 scales and minimums), both as _cpu_quant.c lays them out; path: 0 the best the CPU has, 1 "
     "portable C (tests), 2 bfloat16 without AMX, 3 int8 and 4-bit on AVX2 without VNNI, 4 int8 and 4-bit on "
     "AMX-INT8 tiles where the CPU has them"},
    {"path", py_path, METH_VARARGS, "path(N, kind=0, K=32, path=0) -> the instruction set used for N outputs (of K inputs); int8 and 4-bit "
     "weights with path=4 (AMX-INT8 tiles): amx_int8 where the CPU has them, else the best path's"},
    {"attend", py_attend, METH_VARARGS,
     "attend(out, qkv, k_cache, v_cache, cos, sin, slots, positions, flat, N, T, NH, KVH, D, MAX, threads, "
     "portable=False): rotary embedding, cache write and causal attention of one layer for N tokens of a "
     "decode or verify step (float32; pointers as integers)"},
    {"layer", py_layer, METH_VARARGS,
     "layer(out, x, scratch, w_qkv, w_o, w_gate_up, w_down, kind, norm_in, norm_post, eps, H, Wq, I, k_cache, "
     "v_cache, cos, sin, slots, positions, flat, N, T, NH, KVH, D, MAX, threads, *calls): one decoder layer of a "
     "decode or verify step over blocked weights (float32 activations; pointers as integers; calls: each of the four "
     "linears' gemm path and int8/4-bit prefetch distance in bytes, in pairs, default 0)"},
    {"layers", py_layers, METH_VARARGS,
     "layers(buffer0, buffer1, x, scratch, table, L, eps, H, Wq, I, k_cache, v_cache, layer_bytes, cos, sin, slots, "
     "positions, flat, N, T, NH, KVH, D, MAX, threads): L decoder layers in one call, layer i's weights in row i of "
     "table [L, 15] int64 (w_qkv, w_o, w_gate_up, w_down, kind, norm_in, norm_post, then each linear's gemm path and "
     "prefetch distance); layer i "
     "writes buffer i % 2 (the last layer's output: buffer (L - 1) % 2)"},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(out_ptr, gate_up_ptr, rows, I, portable=False): out[r] = silu(gate_up[r, :I]) * gate_up[r, I:], float32"},
    {"quant_rows", py_quant_rows, METH_VARARGS,
     "quant_rows(out, w, ids, n, K, N, kind): out[n, K] float32 = rows ids (int64, each in [0, N)) of an int8 (kind "
     "3) or 4-bit (kind 4) blocked weight of N rows (a multiple of 16), dequantized: an embedding lookup"},
    {"sample_rows", py_sample_rows, METH_VARARGS,
     "sample_rows(tokens, log_normaliser, logits, rows, V, inv_temperature, uniforms, top_k, threads, portable=False): "
     "tokens[r] (int64) = the inverse-CDF draw of softmax(logits[r] * inv_temperature[r]) with uniforms[r] over the "
     "ids top_k[r] keeps (top_k: 0 for none, or int64 [rows], 0 keeping every id), log_normaliser[r] (float32) = log "
     "sum exp over those ids (pointers as integers)"},
    {"argmax_rows", py_argmax_rows, METH_VARARGS,
     "argmax_rows(out, x, rows, V, portable=False): out[r] (int64) = first index of the max of row r of x (float32)"},
    {"argmax_logprob_rows", py_argmax_logprob_rows, METH_VARARGS,
     "argmax_logprob_rows(out, logprob, x, rows, V, portable=False): out[r] (int64) = first index of the max of row r "
     "of x (float32), logprob[r] (float32) = log softmax of row r at that index"},
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(out_ptr, x_ptr, w_ptr, rows, H, eps): out = x / sqrt(mean(x^2) + eps) * w, float32 rows of H"},
    {"peak_macs", py_peak_macs, METH_VARARGS,
     "peak_macs(instruction, threads, repeats=3) -> multiply-adds a second of a loop of that instruction on that many "
     "threads (avx2_fma, avx512_fma, avx2_int8, avx512_vnni, avx512_bf16; _cpu_peak.c); -1 where the CPU lacks it"},
    {"release_threads", py_release_threads, METH_NOARGS,
     "release_threads() -> 0 once the calling thread's OpenMP worker threads have exited (-1 inside a parallel region)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    __builtin_cpu_init();
    quant_init();
    sample_init();
    has_avx512 = __builtin_cpu_supports("avx512f");
    has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    unsigned int a, b, c, d;
    if (has_avx512 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) has_avx512_bf16 = (a >> 5) & 1;
    /* Linux hands out AMX's 8 KB of tile state only to a process that asks (5.16+) */
    const int tiles = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 24) & 1) && amx_request_tiles();
    has_amx = tiles && has_avx512_bf16 && ((d >> 22) & 1);
    quant_allow_amx(tiles);
    return PyModule_Create(&module);
}
