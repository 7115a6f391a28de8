/* The stream linear for quantized weights (int8 and 4-bit): integer dot products on activations
 * quantized to int8 per group of 32 inputs, as llama.cpp multiplies its Q8_0 and Q4_1 weights.
 *
 * Why: converting each weight to float32 for an FMA made the float path compute-bound at 14.6 GB/s a
 * core (int8 1.49x and 4-bit 1.42x bfloat16 at one row, against the 1.6x and 2.5x that their bytes
 * allow). An integer dot product multiplies 4 byte pairs a 32-bit lane in one instruction and needs no
 * conversion: the weight bytes feed it as they are stored.
 *
 * The math, for one row x [K] float32, one output o and one group g of 32 inputs:
 *   activations: amax = max |x[32g:32g+32]|, dx = amax / 127, xq = round(x * (127 / amax)) in int8
 *                (round half to even; a group of zeros has dx = 0 and xq = 0): x ~= dx * xq.
 *   int8 (w = s[o,g] * q, q in -127..127):   y += float(sum_i q xq) * (s[o,g] * dx)
 *   4-bit (w = d[o,g] * q + m[o,g], q 0..15): y += float(sum_i q xq) * (d[o,g] * dx), then
 *                                            y += m[o,g] * (dx * float(sum_i xq))
 * so y is the dequantized weights times the rounded x, exactly as for int8. (The minimums take the rounded
 * x's sum, as llama.cpp's Q8_1 does, not x's own: with x's own, y gains m * sum_i (dx xq - x), which no
 * other term cancels; measured on SmolLM2 against float32, KL 1.2e-2 nats a token instead of 2.2e-3.)
 * The sums over i are integers, exact whichever instructions add them; each `y +=` is one fused
 * multiply-add in the order written, the same in every path below and for every row count. So a row
 * gives the same bits alone (a decode step) and beside others (a verify), on AVX-512 VNNI, AVX2 and in
 * C: greedy speculation stays exact, and the C path is the vector paths' reference, bit for bit.
 *
 * Weight layout (the packing is specrl.models.linear's): a column block holds 16 outputs; its groups of
 * 32 inputs follow one another, each one contiguous stretch:
 *   int8:  8 rows of 64 bytes (row r: output j's q + 128 for inputs 4r..4r+3 at bytes 4j..4j+3), then the
 *          group's 16 float32 scales: 576 bytes a group, 1.125 a weight.
 *   4-bit: 4 rows of 64 bytes (row r, byte 4j + t: output j's q for input 8r + t in the low nibble,
 *          8r + 4 + t in the high one), then 16 float16 scales d and 16 float16 minimums m: 320 bytes a
 *          group, 0.625 a weight (Q4_1's bits).
 * 64 bytes = one 32-bit lane per output holding 4 consecutive inputs: what VPDPBUSD (u8 x s8, 4 pairs
 * a lane, into int32) takes, with the 4 activations broadcast to every lane. VPDPBUSD wants its first
 * operand unsigned: 4-bit q is; int8 q is stored as q + 128 (the byte q ^ 0x80) and the accumulator
 * starts at -128 * sum_i xq. AVX2 has no VPDPBUSD: VPMADDUBSW (u8 x s8 pairs into
 * saturating int16) then VPMADDWD by ones; int8 goes through it as |q| times xq with q's sign
 * (2 x 127 x 127 fits int16), 4-bit as it is (2 x 15 x 127), its group's 8 pair sums added in int16 first.
 */
#include "_cpu_amx.h"
#include "_cpu_half.h"
#include "_cpu_quant.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16
#define GROUP 32
#define ROWS 6 /* rows an AVX2 register tile takes at most (16 ymm: two accumulators and two sums a row) */
/* Rows an AVX-512 tile takes at most (32 zmm: an accumulator and a sum a row). 8, not AVX2's 6: a tile unpacks
 * each group once for its rows, and 8 rows (a B=8 step) were two tiles of 4. `bench linears`, AMX Xeon, 2 threads,
 * 22.8 GB/s, alternating builds (6 / 8): q4 "stream" 8 rows over 1 row 1.38x / 0.91-1.03x, 16 rows 2.24x /
 * 1.38-1.68x. */
#define VNNI_ROWS 8
/* A tile streams one column block: each thread then reads one contiguous range, block after block. Tiles over
 * four blocks at once (four interleaved streams, as the float kernels' tiles) were measured 4-21% slower at 1-16
 * rows on SmolLM2's matmuls (AVX-512 EPYC, 2 threads; q4 at one row 3.68 -> 2.81 ms): this path is not
 * compute-bound, its streams are what the memory system follows. */
#define UNROLL _Pragma("GCC unroll 8") /* the tiles' loops, so that their sums stay in registers */
/* Software prefetch, `prefetch` bytes ahead of each group (the caller's choice, 0: none): each block is one
 * contiguous stream, which the hardware prefetcher follows, and whether running ahead of it pays differs by CPU:
 * 2 or 4 KB ahead made SmolLM2's matmuls 15-20% slower at 1 and 8 rows on the AVX-512 EPYC and 10-15% faster at
 * 1-5 rows on the AVX2 EPYC (2 threads). So the calibration measures both calls ("stream", "stream prefetch") per
 * shape and row count on the machine itself (specrl.models.linear). */
#define PREFETCH(grp, gb)                                                                                             \
    if (a->prefetch)                                                                                                  \
        for (size_t l = 0; l < (gb); l += 64) _mm_prefetch((const char *)(grp) + a->prefetch + l, _MM_HINT_T0);
enum { KIND_I8 = 3, KIND_Q4 = 4 }; /* _cpu_kernels' weight kinds */

static int has_vnni = 0, has_avx2 = 0;

void quant_init(void) {
    has_vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vnni");
    has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static inline size_t group_bytes(int kind) { return kind == KIND_I8 ? 8 * 64 + 64 : 4 * 64 + 64; }

/* ---- activations ------------------------------------------------------------------------- */

typedef struct {
    int8_t *q;     /* [M, K]: x quantized per group */
    float *scale;  /* [M, K / 32]: dx */
    float *sum;    /* [M, K / 32]: dx * sum(xq), the rounded x's sum (4-bit minimums' factor) */
    int32_t *qsum; /* [M, K / 32]: the group's xq summed (int8's offset on VNNI) */
    void *buffer;
    int64_t prefetch; /* bytes ahead of a group to prefetch into L1 (0: none; PREFETCH says why) */
} acts;

/* One group of 32 x values -> its 32 xq, dx, dx * sum(xq) (the rounded x's sum) and sum(xq). Rounding is to
 * nearest even, as the vector conversions round. */
static void quantize_group_c(const float *x, int8_t *q, float *scale, float *sum, int32_t *qsum) {
    float amax = 0;
    for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    int32_t total = 0;
    for (int i = 0; i < GROUP; i++) {
        const float r = nearbyintf(x[i] * inv);
        q[i] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : (int32_t)r);
        total += q[i];
    }
    *scale = amax / 127.0f, *sum = *scale * (float)total, *qsum = total;
}

__attribute__((target("avx512f,avx512bw"))) static void quantize_group_avx512(const float *x, int8_t *q, float *scale,
                                                                              float *sum, int32_t *qsum) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512i qa = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), lo), hi);
    const __m512i qb = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)), lo), hi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    *scale = amax / 127.0f, *sum = *scale * (float)*qsum;
}

__attribute__((target("avx2"))) static void quantize_group_avx2(const float *x, int8_t *q, float *scale, float *sum,
                                                                int32_t *qsum) {
    __m256 v[4], mag = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        mag = _mm256_max_ps(mag, _mm256_and_ps(v[k], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mag), _mm256_extractf128_ps(mag, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    int32_t lanes[32], total = 0;
    for (int k = 0; k < 4; k++)
        _mm256_storeu_si256((__m256i *)(lanes + 8 * k),
                            _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv)),
                                                              _mm256_set1_epi32(-127)), _mm256_set1_epi32(127)));
    for (int i = 0; i < GROUP; i++) q[i] = (int8_t)lanes[i], total += lanes[i];
    *qsum = total;
    *scale = amax / 127.0f, *sum = *scale * (float)total;
}

typedef void (*quantize_fn)(const float *, int8_t *, float *, float *, int32_t *);

static int quantize_rows(const float *x, int64_t M, int64_t K, quantize_fn quantize, acts *a) {
    const int64_t G = K / GROUP;
    const size_t q_bytes = ((size_t)M * K + 63) / 64 * 64, per_group = (size_t)M * G * 4;
    a->buffer = aligned_alloc(64, (q_bytes + 3 * per_group + 63) / 64 * 64);
    if (a->buffer == NULL) return -1;
    a->q = (int8_t *)a->buffer;
    a->scale = (float *)((char *)a->buffer + q_bytes);
    a->sum = a->scale + M * G;
    a->qsum = (int32_t *)(a->sum + M * G);
    for (int64_t r = 0; r < M * G; r++) /* group r: row r / G, inputs 32 (r % G) on: x's order */
        quantize(x + r * GROUP, a->q + r * GROUP, a->scale + r, a->sum + r, a->qsum + r);
    return 0;
}

static inline int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- portable C: the reference ------------------------------------------------------------ */

static void blocks_portable(const acts *a, const uint8_t *w, float *out, int64_t M, int64_t K, int64_t N, int64_t b0,
                            int64_t b1, int kind) {
    const int64_t G = K / GROUP;
    const size_t gb = group_bytes(kind);
    for (int64_t b = b0; b < b1; b++)
        for (int64_t m = 0; m < M; m++) {
            float acc[BLOCK] = {0};
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *grp = w + ((size_t)b * G + g) * gb;
                const int8_t *xq = a->q + m * K + g * GROUP;
                const float dx = a->scale[m * G + g];
                for (int j = 0; j < BLOCK; j++) {
                    int32_t isum = 0;
                    if (kind == KIND_I8) {
                        for (int i = 0; i < GROUP; i++) isum += (grp[(i / 4) * 64 + 4 * j + i % 4] - 128) * xq[i];
                        acc[j] = fmaf((float)isum, ((const float *)(grp + 512))[j] * dx, acc[j]);
                    } else {
                        for (int i = 0; i < GROUP; i++) {
                            const uint8_t byte = grp[(i / 8) * 64 + 4 * j + i % 4];
                            isum += (i % 8 < 4 ? byte & 15 : byte >> 4) * xq[i];
                        }
                        const uint16_t *params = (const uint16_t *)(grp + 256);
                        acc[j] = fmaf((float)isum, half_to_float(params[j]) * dx, acc[j]);
                        acc[j] = fmaf(half_to_float(params[BLOCK + j]), a->sum[m * G + g], acc[j]);
                    }
                }
            }
            memcpy(out + m * N + b * BLOCK, acc, sizeof acc);
        }
}

/* ---- AVX-512 VNNI: one block a tile, one 16-lane vector --------------------------------------- */

#define VNNI "avx512f,avx512bw,avx512vnni,f16c"

/* The group's integer sums s[i] of MR rows; int8 rows start at -128 * sum(xq). */
#define VNNI_SUMS_I8(MR)                                                                                              \
    UNROLL for (int i = 0; i < MR; i++) s[i] = _mm512_set1_epi32(-128 * a->qsum[(m0 + i) * G + g]);                \
    UNROLL for (int r = 0; r < 8; r++) {                                                                              \
        const __m512i wv = _mm512_loadu_si512(grp + r * 64);                                                          \
        UNROLL for (int i = 0; i < MR; i++)                                                                           \
            s[i] = _mm512_dpbusd_epi32(s[i], wv, _mm512_set1_epi32(four_bytes(a->q + (m0 + i) * K + g * GROUP + 4 * r))); \
    }

#define VNNI_SUMS_Q4(MR)                                                                                              \
    UNROLL for (int i = 0; i < MR; i++) s[i] = _mm512_setzero_si512();                                              \
    UNROLL for (int r = 0; r < 4; r++) {                                                                              \
        const __m512i bytes = _mm512_loadu_si512(grp + r * 64);                                                       \
        UNROLL for (int half = 0; half < 2; half++) { /* low nibbles: inputs 8r..8r+3; high: 8r+4..8r+7 */            \
            const __m512i nib = _mm512_and_si512(half ? _mm512_srli_epi16(bytes, 4) : bytes, low4);                   \
            UNROLL for (int i = 0; i < MR; i++)                                                                       \
                s[i] = _mm512_dpbusd_epi32(                                                                           \
                    s[i], nib, _mm512_set1_epi32(four_bytes(a->q + (m0 + i) * K + g * GROUP + 8 * r + 4 * half)));  \
        }                                                                                                             \
    }

#define VNNI_TILE(KIND, SUMS, MR)                                                                                     \
    __attribute__((target(VNNI))) static void vnni_##KIND##_##MR(const acts *a, const uint8_t *w, float *out,         \
                                                                 int64_t K, int64_t N, int64_t m0, int64_t b0) {      \
        const int64_t G = K / GROUP;                                                                                  \
        const __m512i low4 = _mm512_set1_epi8(15);                                                                    \
        (void)low4;                                                                                                   \
        __m512 acc[MR];                                                                                               \
        UNROLL for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();                                             \
        for (int64_t g = 0; g < G; g++) {                                                                             \
            const uint8_t *grp = w + ((size_t)b0 * G + g) * group_bytes(KIND);                                        \
            PREFETCH(grp, group_bytes(KIND))                                                                          \
            __m512i s[MR];                                                                                            \
            SUMS(MR)                                                                                                  \
            if (KIND == KIND_I8) {                                                                                    \
                const __m512 scale = _mm512_loadu_ps((const float *)(grp + 512));                                     \
                UNROLL for (int i = 0; i < MR; i++)                                                                   \
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]),                                                \
                                             _mm512_mul_ps(scale, _mm512_set1_ps(a->scale[(m0 + i) * G + g])), acc[i]); \
            } else {                                                                                                  \
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 256)));                   \
                const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 288)));                  \
                UNROLL for (int i = 0; i < MR; i++) {                                                                 \
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]),                                                \
                                             _mm512_mul_ps(d, _mm512_set1_ps(a->scale[(m0 + i) * G + g])), acc[i]);   \
                    acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sum[(m0 + i) * G + g]), acc[i]);                   \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
        UNROLL for (int i = 0; i < MR; i++) _mm512_storeu_ps(out + (m0 + i) * N + b0 * BLOCK, acc[i]);                \
    }

#define VNNI_TILES(KIND, SUMS)                                                                                        \
    VNNI_TILE(KIND, SUMS, 1) VNNI_TILE(KIND, SUMS, 2) VNNI_TILE(KIND, SUMS, 3)                                        \
    VNNI_TILE(KIND, SUMS, 4) VNNI_TILE(KIND, SUMS, 5) VNNI_TILE(KIND, SUMS, 6)                                        \
    VNNI_TILE(KIND, SUMS, 7) VNNI_TILE(KIND, SUMS, 8)
VNNI_TILES(KIND_I8, VNNI_SUMS_I8)
VNNI_TILES(KIND_Q4, VNNI_SUMS_Q4)

typedef void (*tile_fn)(const acts *, const uint8_t *, float *, int64_t, int64_t, int64_t, int64_t);
#define TILE_TABLE(PREFIX, KIND)                                                                                      \
    {NULL, PREFIX##_##KIND##_1, PREFIX##_##KIND##_2, PREFIX##_##KIND##_3,                                             \
     PREFIX##_##KIND##_4, PREFIX##_##KIND##_5, PREFIX##_##KIND##_6}
#define VNNI_TABLE(KIND) {NULL, vnni_##KIND##_1, vnni_##KIND##_2, vnni_##KIND##_3, vnni_##KIND##_4, vnni_##KIND##_5, \
                          vnni_##KIND##_6, vnni_##KIND##_7, vnni_##KIND##_8}
static const tile_fn vnni_i8[] = VNNI_TABLE(KIND_I8), vnni_q4[] = VNNI_TABLE(KIND_Q4);

/* ---- AVX2: one block a tile, two 8-lane vectors ---------------------------------------------- */

#define AVX2 "avx2,fma,f16c"

__attribute__((target(AVX2))) static inline __m256i madd_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

#define AVX2_SUMS_I8(MR)                                                                                              \
    UNROLL for (int i = 0; i < MR; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();                                   \
    UNROLL for (int r = 0; r < 8; r++) {                                                                              \
        __m256i wv[2], mag[2];                                                                                        \
        UNROLL for (int h = 0; h < 2; h++) {                                                                          \
            wv[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(grp + r * 64 + 32 * h)), flip);             \
            mag[h] = _mm256_abs_epi8(wv[h]);                                                                          \
        }                                                                                                             \
        UNROLL for (int i = 0; i < MR; i++) {                                                                         \
            const __m256i xb = _mm256_set1_epi32(four_bytes(a->q + (m0 + i) * K + g * GROUP + 4 * r));                \
            UNROLL for (int h = 0; h < 2; h++)                                                                        \
                s[i][h] = _mm256_add_epi32(s[i][h], madd_u8s8(mag[h], _mm256_sign_epi8(xb, wv[h])));                  \
        }                                                                                                             \
    }

/* 4-bit: a VPMADDUBSW lane is 2 products of at most 15 x 127, so the group's 8 of them (4 rows of low and high
 * nibbles) sum in int16 to at most 8 x 2 x 15 x 127 = 30,480 < 32,767: exact, and one VPMADDWD a group instead of
 * one per VPMADDUBSW; the two share the multiply ports, which bound this loop from 2 rows on (a 5-row q4 forward's
 * matmuls 5.76 -> 4.53 ms on the AVX2 EPYC, one row unchanged). IN_ORDER keeps each row's adds a chain: GCC's
 * reassociation would make a tree of them and hold every product of the group at once, spilled to the stack. */
#define IN_ORDER(v) __asm__("" : "+x"(v))
#define AVX2_SUMS_Q4(MR)                                                                                              \
    UNROLL for (int i = 0; i < MR; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();                                   \
    UNROLL for (int r = 0; r < 4; r++) {                                                                              \
        __m256i lo[2], hi[2];                                                                                         \
        UNROLL for (int h = 0; h < 2; h++) {                                                                          \
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(grp + r * 64 + 32 * h));                       \
            lo[h] = _mm256_and_si256(bytes, low4);                                                                    \
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);                                              \
        }                                                                                                             \
        UNROLL for (int i = 0; i < MR; i++) {                                                                         \
            const int8_t *xq = a->q + (m0 + i) * K + g * GROUP + 8 * r;                                               \
            const __m256i x0 = _mm256_set1_epi32(four_bytes(xq)), x1 = _mm256_set1_epi32(four_bytes(xq + 4));         \
            UNROLL for (int h = 0; h < 2; h++) {                                                                      \
                s[i][h] = _mm256_add_epi16(s[i][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x0),                 \
                                                                     _mm256_maddubs_epi16(hi[h], x1)));               \
                IN_ORDER(s[i][h]);                                                                                    \
            }                                                                                                         \
        }                                                                                                             \
    }                                                                                                                 \
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int h = 0; h < 2; h++) s[i][h] = _mm256_madd_epi16(s[i][h], ones);

#define AVX2_TILE(KIND, SUMS, MR)                                                                                     \
    __attribute__((target(AVX2))) static void avx2_##KIND##_##MR(                                                 \
        const acts *a, const uint8_t *w, float *out, int64_t K, int64_t N, int64_t m0, int64_t b0) {                  \
        const int64_t G = K / GROUP;                                                                                  \
        const size_t gb = group_bytes(KIND);                                                                          \
        const __m256i low4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80); /* back to q */               \
        const __m256i ones = _mm256_set1_epi16(1);                                                                    \
        (void)low4, (void)flip, (void)ones;                                                                           \
        __m256 acc[MR][2];                                                                                            \
        UNROLL for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                              \
        for (int64_t g = 0; g < G; g++) {                                                                             \
            const uint8_t *grp = w + ((size_t)b0 * G + g) * gb;                                                       \
            PREFETCH(grp, gb)                                                                                         \
            __m256i s[MR][2];                                                                                         \
            SUMS(MR)                                                                                                  \
            UNROLL for (int h = 0; h < 2; h++) {                                                                      \
                if (KIND == KIND_I8) {                                                                                \
                    const __m256 scale = _mm256_loadu_ps((const float *)(grp + 512) + 8 * h);                         \
                    UNROLL for (int i = 0; i < MR; i++)                                                               \
                        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][h]),                                      \
                                                    _mm256_mul_ps(scale, _mm256_set1_ps(a->scale[(m0 + i) * G + g])), \
                                                    acc[i][h]);                                                       \
                } else {                                                                                              \
                    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 256) + h));              \
                    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(grp + 288) + h));             \
                    UNROLL for (int i = 0; i < MR; i++) {                                                             \
                        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][h]),                                      \
                                                    _mm256_mul_ps(d, _mm256_set1_ps(a->scale[(m0 + i) * G + g])),     \
                                                    acc[i][h]);                                                       \
                        acc[i][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->sum[(m0 + i) * G + g]), acc[i][h]);         \
                    }                                                                                                 \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
        UNROLL for (int i = 0; i < MR; i++)                                                                           \
            UNROLL for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + (m0 + i) * N + b0 * BLOCK + 8 * h, acc[i][h]);  \
    }

#define AVX2_TILES(KIND, SUMS)                                                                                        \
    AVX2_TILE(KIND, SUMS, 1) AVX2_TILE(KIND, SUMS, 2) AVX2_TILE(KIND, SUMS, 3)                                        \
    AVX2_TILE(KIND, SUMS, 4) AVX2_TILE(KIND, SUMS, 5) AVX2_TILE(KIND, SUMS, 6)
AVX2_TILES(KIND_I8, AVX2_SUMS_I8)
AVX2_TILES(KIND_Q4, AVX2_SUMS_Q4)
static const tile_fn avx2_i8[] = TILE_TABLE(avx2, KIND_I8), avx2_q4[] = TILE_TABLE(avx2, KIND_Q4);

/* ---- AMX-INT8: 16 outputs x up to 16 rows a tile product ------------------------------------- */

/* A group of one block is already an AMX B tile: 8 rows of 64 bytes, row r holding each output's 4 weight bytes
 * for inputs 4r..4r+3 (int8; q4's nibbles are split into that shape first, low nibbles of row r -> tile row 2r,
 * high -> 2r + 1). TDPBSUD multiplies the rows' xq (signed, the A tile: R rows x 32 bytes straight from the
 * quantized activations, stride K) by those bytes (unsigned) into R x 16 int32: the group's integer sums, the
 * same integers as VPDPBUSD's (int8's -128 sum(xq) is subtracted after). The float steps that follow are the VNNI
 * path's, in its order, so every row gets the VNNI path's bits at any row count. One tile product replaces the
 * 8 R VPDPBUSD (and their broadcasts) of a group.
 * The sums reach the vector unit only through memory (a tile store), and a tile load of q4's unpacked bytes
 * only after their vector stores: neither forwards, each waits for the stores to reach L1. So the loop is
 * pipelined by chunks of 4 groups: chunk c's products (4 accumulator tiles) and stores, then chunk c + 1's unpacking
 * (int8's groups are copied: a tile load straight from the stream was slower), then chunk c - 1's float steps, each
 * reading what an earlier step stored. Where it pays: from about 8-16 rows. A tile product of K = 32 (a group:
 * each has its own scales) keeps the unit busy about as long as a full one, so at few rows the 8 R VPDPBUSD it
 * replaces cost less (1 thread, weights in L2, ns a group of one block, VNNI / AMX: q4 7.3 / 19.1 at 1 row,
 * 17.4 / 25.9 at 5, 28.7 / 29.9 at 8, 52.7 / 38.7 at 16). */
#define AMX_I8 "amx-tile,amx-int8,avx512f,avx512bw,f16c"
#define AMX_CHUNK 4 /* groups a chunk: accumulator tiles 0-3, A tiles 4-5 and B tiles 6-7 alternate */
#define AMX_ROWS _Pragma("GCC unroll 16")

static int has_amx_int8 = 0; /* the CPU has AMX-INT8 and Linux let this process use it (_cpu_kernels' init) */

void quant_allow_amx(int allowed) { has_amx_int8 = allowed && has_vnni && __builtin_cpu_supports("amx-int8"); }

/* Tiles for R rows: C R x 16 int32, A R x 32 int8, B 8 x 64 bytes. */
__attribute__((target("amx-tile"))) static void amx_rows(int64_t R) {
    const uint8_t r = (uint8_t)R, rows[8] = {r, r, r, r, r, r, 8, 8};
    const uint16_t colsb[8] = {64, 64, 64, 64, GROUP, GROUP, 64, 64};
    amx_configure_tiles(rows, colsb);
}

/* Group gg's integer sums of rows m0.. into tile TC, stored to sums (the intrinsics take literal tile numbers). */
#define AMX_PRODUCT(TC, TA, TB, gg, b_src, sums_out)                                                                  \
    {                                                                                                                 \
        _tile_zero(TC);                                                                                               \
        _tile_loadd(TA, a->q + m0 * K + (gg) * GROUP, K);                                                             \
        _tile_loadd(TB, (b_src), 64);                                                                                 \
        _tile_dpbsud(TC, TA, TB);                                                                                     \
        _tile_stored(TC, (sums_out), 64);                                                                             \
    }

#define AMX_BLOCK(KIND)                                                                                               \
    /* group grp's weights -> the B tile's 8 rows of 64 bytes in L1 (q4: its nibbles split; int8: copied, since a \
     * tile load from beyond L1 was measured 3x slower: 36 against 19 ns a group at one row, 1 thread, from L2) */ \
    __attribute__((target(AMX_I8), always_inline)) static inline void amx_unpack_##KIND(const uint8_t *grp, uint8_t *tile) { \
        const __m512i low4 = _mm512_set1_epi8(15);                                                                    \
        (void)low4;                                                                                                   \
        UNROLL for (int r = 0; r < 8 / (KIND == KIND_Q4 ? 2 : 1); r++) {                                              \
            const __m512i bytes = _mm512_loadu_si512(grp + r * 64);                                                   \
            if (KIND == KIND_Q4) {                                                                                    \
                _mm512_store_si512(tile + 128 * r, _mm512_and_si512(bytes, low4));                                    \
                _mm512_store_si512(tile + 128 * r + 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4));         \
            } else {                                                                                                  \
                _mm512_store_si512(tile + 64 * r, bytes);                                                             \
            }                                                                                                         \
        }                                                                                                             \
    }                                                                                                                 \
    /* the float steps of groups g0..g0+n-1 from their stored sums, in group order (the VNNI path's) */              \
    __attribute__((target(AMX_I8), always_inline)) static inline void amx_scale_##KIND(                                              \
        const acts *a, const uint8_t *w, __m512 *acc, int32_t (*sums)[16][BLOCK], int64_t G, int64_t m0, int64_t R,   \
        int64_t b0, int64_t g0, int64_t n) {                                                                          \
        for (int64_t j = 0; j < n; j++) {                                                                             \
            const int64_t g = g0 + j;                                                                                 \
            const uint8_t *grp = w + ((size_t)b0 * G + g) * group_bytes(KIND);                                        \
            if (KIND == KIND_I8) {                                                                                    \
                const __m512 scale = _mm512_loadu_ps((const float *)(grp + 512));                                     \
                AMX_ROWS for (int64_t i = 0; i < R; i++) {                                                            \
                    const __m512i s = _mm512_sub_epi32(_mm512_load_si512(sums[j][i]),                                 \
                                                       _mm512_set1_epi32(128 * a->qsum[(m0 + i) * G + g]));           \
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),                                                   \
                                             _mm512_mul_ps(scale, _mm512_set1_ps(a->scale[(m0 + i) * G + g])), acc[i]); \
                }                                                                                                     \
            } else {                                                                                                  \
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 256)));                   \
                const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(grp + 288)));                  \
                AMX_ROWS for (int64_t i = 0; i < R; i++) {                                                            \
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[j][i])),                       \
                                             _mm512_mul_ps(d, _mm512_set1_ps(a->scale[(m0 + i) * G + g])), acc[i]);   \
                    acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sum[(m0 + i) * G + g]), acc[i]);                  \
                }                                                                                                     \
            }                                                                                                         \
        }                                                                                                             \
    }                                                                                                                 \
    __attribute__((target(AMX_I8), always_inline)) static inline void amx_##KIND(                                     \
        const acts *a, const uint8_t *w, float *out, int64_t K, int64_t N, int64_t m0, const int64_t R, int64_t b0) { \
        const int64_t G = K / GROUP;                                                                                  \
        const size_t gb = group_bytes(KIND);                                                                          \
        _Alignas(64) int32_t sums[2][AMX_CHUNK][16][BLOCK]; /* chunk c's in sums[c % 2] */                             \
        _Alignas(64) uint8_t unpacked[2][AMX_CHUNK][8 * 64]; /* chunk c's B tiles in unpacked[c % 2] */               \
        __m512 acc[16];                                                                                               \
        AMX_ROWS for (int64_t i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();                                        \
        const uint8_t *wb = w + (size_t)b0 * G * gb;                                                                  \
        for (int64_t j = 0; j < AMX_CHUNK && j < G; j++) amx_unpack_##KIND(wb + j * gb, unpacked[0][j]);             \
        for (int64_t c = 0, g0 = 0; g0 < G; c++, g0 += AMX_CHUNK) {                                                   \
            const int64_t n = G - g0 < AMX_CHUNK ? G - g0 : AMX_CHUNK;                                                \
            const uint8_t *grp = wb + g0 * gb;                                                                        \
            PREFETCH(grp, AMX_CHUNK * gb)                                                                             \
            int32_t(*out_sums)[16][BLOCK] = sums[c % 2];                                                              \
            uint8_t(*tiles)[8 * 64] = unpacked[c % 2];                                                                \
            AMX_PRODUCT(0, 4, 6, g0, tiles[0], out_sums[0])                                                           \
            if (n > 1) AMX_PRODUCT(1, 5, 7, g0 + 1, tiles[1], out_sums[1])                                            \
            if (n > 2) AMX_PRODUCT(2, 4, 6, g0 + 2, tiles[2], out_sums[2])                                            \
            if (n > 3) AMX_PRODUCT(3, 5, 7, g0 + 3, tiles[3], out_sums[3])                                            \
            for (int64_t j = 0; j < AMX_CHUNK && g0 + AMX_CHUNK + j < G; j++)                                         \
                amx_unpack_##KIND(grp + (AMX_CHUNK + j) * gb, unpacked[(c + 1) % 2][j]);                              \
            if (c) amx_scale_##KIND(a, w, acc, sums[(c + 1) % 2], G, m0, R, b0, g0 - AMX_CHUNK, AMX_CHUNK);          \
        }                                                                                                             \
        const int64_t last = (G - 1) / AMX_CHUNK * AMX_CHUNK; /* the last chunk's first group */                    \
        amx_scale_##KIND(a, w, acc, sums[(last / AMX_CHUNK) % 2], G, m0, R, b0, last, G - last);                      \
        AMX_ROWS for (int64_t i = 0; i < R; i++) _mm512_storeu_ps(out + (m0 + i) * N + b0 * BLOCK, acc[i]);           \
    }
AMX_BLOCK(KIND_I8)
AMX_BLOCK(KIND_Q4)

/* One function a row count, so that the rows' accumulators stay in registers (the loops over rows unrolled). */
#define AMX_TILE(KIND, MR)                                                                                            \
    __attribute__((target(AMX_I8))) static void amx_##KIND##_##MR(const acts *a, const uint8_t *w, float *out,       \
                                                                  int64_t K, int64_t N, int64_t m0, int64_t b0) {     \
        amx_##KIND(a, w, out, K, N, m0, MR, b0);                                                                      \
    }
#define AMX_TILES(KIND)                                                                                               \
    AMX_TILE(KIND, 1) AMX_TILE(KIND, 2) AMX_TILE(KIND, 3) AMX_TILE(KIND, 4) AMX_TILE(KIND, 5) AMX_TILE(KIND, 6)       \
    AMX_TILE(KIND, 7) AMX_TILE(KIND, 8) AMX_TILE(KIND, 9) AMX_TILE(KIND, 10) AMX_TILE(KIND, 11) AMX_TILE(KIND, 12)    \
    AMX_TILE(KIND, 13) AMX_TILE(KIND, 14) AMX_TILE(KIND, 15) AMX_TILE(KIND, 16)
AMX_TILES(KIND_I8)
AMX_TILES(KIND_Q4)
#define AMX_TABLE(KIND)                                                                                               \
    {NULL, amx_##KIND##_1, amx_##KIND##_2, amx_##KIND##_3, amx_##KIND##_4, amx_##KIND##_5, amx_##KIND##_6,            \
     amx_##KIND##_7, amx_##KIND##_8, amx_##KIND##_9, amx_##KIND##_10, amx_##KIND##_11, amx_##KIND##_12,               \
     amx_##KIND##_13, amx_##KIND##_14, amx_##KIND##_15, amx_##KIND##_16}
static const tile_fn amx_i8[] = AMX_TABLE(KIND_I8), amx_q4[] = AMX_TABLE(KIND_Q4);

/* Every block of this thread's share, its rows in chunks of at most 16 (near-equal: 20 -> 10 + 10); the tiles are
 * configured once a chunk size. */
__attribute__((target("amx-tile"))) static void amx_blocks(const acts *a, const uint8_t *w, float *out, int64_t M,
                                                          int64_t K, int64_t N, int64_t b0, int64_t b1, int kind) {
    const int64_t chunks = (M + 15) / 16;
    int64_t configured = 0;
    for (int64_t b = b0; b < b1; b++)
        for (int64_t c = 0, m = 0; c < chunks; c++) {
            const int64_t end = M * (c + 1) / chunks;
            if (end - m != configured) amx_rows(configured = end - m);
            (kind == KIND_I8 ? amx_i8 : amx_q4)[end - m](a, w, out, K, N, m, b);
            m = end;
        }
    _tile_release();
}

/* ---- rows: an embedding lookup from the packed weights --------------------------------------- */

/* Weight rows `ids` (outputs) dequantized to float32 [n, K]: a tied head's embedding lookup, without unpacking
 * whole blocks. int8: float(q) * s; 4-bit: float(q) * d + m, two roundings (no fused multiply-add: the same bits
 * as specrl.models.linear's torch reference, `_quantized_rows`). */
__attribute__((optimize("fp-contract=off"))) int quant_rows(const void *w, const int64_t *ids, int64_t n, int64_t K,
                                                             int64_t N, int kind, float *out) {
    const int64_t G = K / GROUP;
    const size_t gb = group_bytes(kind);
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= N) return -1;
    for (int64_t r = 0; r < n; r++) {
        const int64_t block = ids[r] / BLOCK, j = ids[r] % BLOCK;
        float *row = out + r * K;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *grp = (const uint8_t *)w + ((size_t)block * G + g) * gb;
            if (kind == KIND_I8) {
                float scale;
                memcpy(&scale, grp + 512 + 4 * j, 4);
                for (int i = 0; i < GROUP; i++)
                    row[g * GROUP + i] = (float)(int8_t)(grp[(i / 4) * 64 + 4 * j + i % 4] ^ 0x80) * scale;
            } else {
                uint16_t d16, m16;
                memcpy(&d16, grp + 256 + 2 * j, 2);
                memcpy(&m16, grp + 288 + 2 * j, 2);
                const float d = half_to_float(d16), m = half_to_float(m16);
                for (int i = 0; i < GROUP; i++) {
                    const uint8_t byte = grp[(i / 8) * 64 + 4 * j + i % 4];
                    const float scaled = (float)(i % 8 < 4 ? byte & 15 : byte >> 4) * d;
                    row[g * GROUP + i] = scaled + m;
                }
            }
        }
    }
    return 0;
}

/* ---- dispatch ---------------------------------------------------------------------------- */

enum { Q_VNNI, Q_AVX2, Q_PORTABLE, Q_AMX };

/* force: QUANT_BEST (VNNI, else AVX2, else C), QUANT_AMX (AMX-INT8 tiles where the CPU has them, else as
 * QUANT_BEST: the calibration times it as a call of its own), or the AVX2 or C path (tests; a CPU without AVX2
 * takes C) */
static int quant_path(int force) {
    if (force == QUANT_PORTABLE || !has_avx2) return Q_PORTABLE;
    if (force == QUANT_AMX && has_amx_int8) return Q_AMX;
    return has_vnni && force != QUANT_AVX2 ? Q_VNNI : Q_AVX2;
}

const char *quant_path_name(int force) {
    static const char *names[] = {"avx512_vnni", "avx2", "portable", "amx_int8"};
    return names[quant_path(force)];
}

/* Block b0 for every row: ceil(M / rows) tiles of near-equal rows, at most `rows` each (AVX2's 8 rows: 4 + 4,
 * not 6 + 2: each tile re-reads the weights from L1 and unpacks them again, whatever its rows). */
static void run_blocks(const tile_fn *tiles, int64_t rows, const acts *a, const uint8_t *w, float *out, int64_t M,
                       int64_t K, int64_t N, int64_t b0) {
    const int64_t chunks = (M + rows - 1) / rows;
    for (int64_t c = 0, m = 0; c < chunks; c++) {
        const int64_t end = M * (c + 1) / chunks;
        tiles[end - m](a, w, out, K, N, m, b0);
        m = end;
    }
}

int gemm_quant(const float *x, const void *w, float *out, int64_t M, int64_t K, int64_t N, int kind, int threads,
               int force, int64_t prefetch) {
    const int path = quant_path(force), i8 = kind == KIND_I8;
    acts a;
    if (quantize_rows(x, M, K, path == Q_VNNI || path == Q_AMX ? quantize_group_avx512
                               : path == Q_AVX2                  ? quantize_group_avx2
                                                                 : quantize_group_c,
                      &a))
        return -1;
    a.prefetch = prefetch;
    const tile_fn *tiles = path == Q_VNNI ? (i8 ? vnni_i8 : vnni_q4) : (i8 ? avx2_i8 : avx2_q4);
    if (path == Q_AMX) {
        /* each thread one contiguous range of blocks, as the static loop below gives it */
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            const int64_t blocks = N / BLOCK, n = omp_get_num_threads(), t = omp_get_thread_num();
            if (blocks * t / n < blocks * (t + 1) / n)
                amx_blocks(&a, (const uint8_t *)w, out, M, K, N, blocks * t / n, blocks * (t + 1) / n, kind);
        }
        free(a.buffer);
        return 0;
    }
    /* blocks in static chunks, a few per thread: each thread streams one contiguous range */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < N / BLOCK; b++) {
        if (path == Q_PORTABLE) blocks_portable(&a, (const uint8_t *)w, out, M, K, N, b, b + 1, kind);
        else run_blocks(tiles, path == Q_VNNI ? VNNI_ROWS : ROWS, &a, (const uint8_t *)w, out, M, K, N, b);
    }
    free(a.buffer);
    return 0;
}
