/* One token a row from softmax(x / T), by the inverse CDF with a uniform u (kernels/verify.py's rule: the first id
 * whose running sum of weights exceeds u times their total), and the row's log normaliser: what a plain sampled
 * step needs of its logits.
 *
 * Why: through torch the same draw is a softmax, a copy, a cumsum and a searchsorted over the whole vocabulary
 * (0.19 ms a row at B = 1, 0.5 ms a step at B = 8 for SmolLM2's 49k, 2 threads, AVX-512 EPYC), about a tenth of a
 * q4 decode step. Here it is two passes:
 *   1. m = max_i x_i;
 *   2. w_i = exp((x_i - m) / T) (0 where (x_i - m) / T < -87), summed per block of BLOCK_IDS ids: s_b; the total
 *      S = s_0 + s_1 + ... in order; log normaliser m / T + log S.
 * Then the block sums again, in the same order, until the running sum passes u S (the same float additions as
 * S's, so for u < 1 some block does), and in that block its weights one by one (recomputed by the same code);
 * where that block's own running sum falls short of the rest by rounding, its last id of positive weight. Ids of
 * weight 0 are never drawn. The law is softmax(x / T)'s up to float rounding (relative ~1e-6 a token). */
#include "_cpu_sample.h"

#include "_cpu_exp.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#define BLOCK_IDS 64
#define EXP_FLOOR -87.0f /* below it a weight is 0 (exp_nonpos's floor) */

static int has_avx2 = 0;

void sample_init(void) {
    has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static float row_max(const float *x, int64_t V) {
    float m = x[0];
    for (int64_t i = 1; i < V; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* Weight of one id: exp((x - m) * inv_t), 0 below the floor. */
static inline float weight_c(float x, float m, float inv_t) {
    const float d = (x - m) * inv_t;
    return d < EXP_FLOOR ? 0.0f : exp_nonpos(d);
}

static float block_sum_c(const float *x, int64_t n, float m, float inv_t) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += weight_c(x[i], m, inv_t);
    return s;
}

__attribute__((target("avx2,fma"))) static float row_max_avx2(const float *x, int64_t V) {
    if (V < 8) return row_max(x, V);
    __m256 m8 = _mm256_loadu_ps(x);
    int64_t i = 8;
    for (; i + 8 <= V; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    float m = lanes[0];
    for (int l = 1; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; i < V; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* The weights of 8 ids (the AVX2 twin of weight_c). */
__attribute__((target("avx2,fma"))) static inline __m256 weights8(const float *x, __m256 m, __m256 inv_t) {
    const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), m), inv_t);
    return _mm256_and_ps(exp8(d), _mm256_cmp_ps(d, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ));
}

/* A block's sum: its whole groups of 8 in lanes, then across the lanes, then its tail one by one. */
__attribute__((target("avx2,fma"))) static float block_sum_avx2(const float *x, int64_t n, float m, float inv_t) {
    const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, weights8(x + i, mv, tv));
    float lanes[8], s = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++) s += lanes[l];
    for (; i < n; i++) s += weight_c(x[i], m, inv_t);
    return s;
}

/* The weight of id i inside a block, as block_sum_* computed it (the tail's in C; the vector part in lanes). */
__attribute__((target("avx2,fma"))) static float weight_at_avx2(const float *x, int64_t i, int64_t n, float m,
                                                                 float inv_t) {
    if (i >= n / 8 * 8) return weight_c(x[i], m, inv_t);
    float lanes[8];
    _mm256_storeu_ps(lanes, weights8(x + i / 8 * 8, _mm256_set1_ps(m), _mm256_set1_ps(inv_t)));
    return lanes[i % 8];
}

static float weight_at_c(const float *x, int64_t i, int64_t n, float m, float inv_t) {
    (void)n;
    return weight_c(x[i], m, inv_t);
}

static int64_t sample_row(const float *x, int64_t V, float inv_t, float u, float *sums, float *log_normaliser,
                          int vector) {
    const float m = vector ? row_max_avx2(x, V) : row_max(x, V);
    const int64_t blocks = (V + BLOCK_IDS - 1) / BLOCK_IDS;
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n = b + 1 < blocks ? BLOCK_IDS : V - b * BLOCK_IDS;
        sums[b] = vector ? block_sum_avx2(x + b * BLOCK_IDS, n, m, inv_t) : block_sum_c(x + b * BLOCK_IDS, n, m, inv_t);
        total += sums[b];
    }
    *log_normaliser = m * inv_t + logf(total);
    const float threshold = u * total;
    float before = 0.0f;
    int64_t b = 0;
    for (; b + 1 < blocks && before + sums[b] <= threshold; b++) before += sums[b];
    const int64_t n = b + 1 < blocks ? BLOCK_IDS : V - b * BLOCK_IDS;
    const float *xb = x + b * BLOCK_IDS;
    int64_t last = -1;
    for (int64_t i = 0; i < n; i++) {
        const float w = vector ? weight_at_avx2(xb, i, n, m, inv_t) : weight_at_c(xb, i, n, m, inv_t);
        if (w <= 0.0f) continue;
        last = i;
        before += w;
        if (before > threshold) return b * BLOCK_IDS + i;
    }
    if (last >= 0) return b * BLOCK_IDS + last;
    /* a block of total weight 0 (only when every later block is too): the last id of positive weight */
    for (int64_t i = V - 1; i > 0; i--)
        if (weight_c(x[i], m, inv_t) > 0.0f) return i;
    return 0;
}

int sample_rows(const float *logits, int64_t rows, int64_t V, const float *inv_temperature, const float *uniforms,
                int64_t *tokens, float *log_normaliser, int threads, int portable) {
    const int64_t blocks = (V + BLOCK_IDS - 1) / BLOCK_IDS;
    const int vector = has_avx2 && !portable;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows > 1)
    {
        float *sums = malloc(blocks * sizeof(float));
        if (sums == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (sums != NULL)
                tokens[r] = sample_row(logits + r * V, V, inv_temperature[r], uniforms[r], sums, log_normaliser + r,
                                       vector);
        free(sums);
    }
    return failed ? -1 : 0;
}
