/* One token a row from softmax(x / T) (or from its k most likely ids: top-k), by the inverse CDF with a uniform u
 * (kernels/verify.py's rule: the first id whose running sum of weights exceeds u times their total), and the row's
 * log normaliser: what a plain sampled step needs of its logits.
 *
 * Why: through torch the same draw is a softmax, a copy, a cumsum and a searchsorted over the whole vocabulary
 * (`specrl bench kernels`, SmolLM2's 49k ids, 2 threads, Zen 4 EPYC: 0.304 ms at B = 1, 1.085 at B = 8; here 0.042
 * and 0.131), about a tenth of a q4 decode step. Two passes:
 *   1. m = max_i x_i (and, with top-k, the k-th largest x: `kth_largest`; ids below it weigh 0, those tied with it
 *      stay, as torch's top-k filter keeps them);
 *   2. w_i = exp((x_i - m) / T) (0 where (x_i - m) / T < -87), summed per block of BLOCK_IDS ids: s_b; the total
 *      S = s_0 + s_1 + ... in order; log normaliser m / T + log S.
 * Then the block sums again, in the same order, until the running sum passes u S (the same float additions as S's,
 * so for u < 1 some block does), and in that block its weights one by one (`block_weights`: the same arithmetic as
 * the block's sum); where that block's own running sum falls short by rounding, its last id of positive weight.
 * Ids of weight 0 are never drawn. The law is softmax(x / T)'s up to float rounding (relative ~1e-6 a token). */
#include "_cpu_sample.h"

#include "_cpu_exp.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

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

/* Weight of one id: exp((x - m) * inv_t), 0 below the floor or with a logit under `least` (top-k's k-th largest;
 * -inf: no top-k). */
static inline float weight_c(float x, float m, float inv_t, float least) {
    const float d = (x - m) * inv_t;
    return d < EXP_FLOOR || x < least ? 0.0f : exp_nonpos(d);
}

static float block_sum_c(const float *x, int64_t n, float m, float inv_t, float least) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += weight_c(x[i], m, inv_t, least);
    return s;
}

/* An order-preserving key of a float's bits: a < b iff key(a) < key(b) (finite floats and infinities). */
static inline uint32_t order_key(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

#define SELECT_BUCKETS 2048 /* the keys' top 11 bits: sign, exponent, 2 bits of mantissa */
#define SELECT_SHIFT 21
#define SELECT_FLOATS(V) ((V) + 4 * SELECT_BUCKETS) /* kth_largest's scratch: a copy of the row, then the counts */

/* The k-th largest of x [V] (1 <= k <= V): a histogram of the keys' top bits (4 interleaved counts, so that runs of
 * one bucket do not wait on one counter), the bucket holding the k-th largest from the top, then a quickselect among
 * that bucket's values only, copied into `copy` [V]; `counts` [4 * SELECT_BUCKETS] is scratch. A quickselect over
 * the whole row took 40-400 us a 49k row, data-dependent (its comparisons mispredict); this is two passes over x. */
static float kth_largest(const float *x, int64_t V, int64_t k, float *copy, uint32_t (*counts)[SELECT_BUCKETS]) {
    memset(counts, 0, 4 * SELECT_BUCKETS * sizeof(uint32_t));
    int64_t i = 0;
    for (; i + 4 <= V; i += 4)
        for (int c = 0; c < 4; c++) counts[c][order_key(x[i + c]) >> SELECT_SHIFT]++;
    for (; i < V; i++) counts[0][order_key(x[i]) >> SELECT_SHIFT]++;
    int64_t above = 0, bucket = SELECT_BUCKETS - 1;
    for (;; bucket--) {
        const int64_t here = (int64_t)counts[0][bucket] + counts[1][bucket] + counts[2][bucket] + counts[3][bucket];
        if (above + here >= k || bucket == 0) break;
        above += here;
    }
    int64_t n = 0;
    for (i = 0; i < V; i++)
        if ((int64_t)(order_key(x[i]) >> SELECT_SHIFT) == bucket) copy[n++] = x[i];
    /* quickselect, descending, for rank k - above among the bucket's n values */
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - above - 1;
    while (lo < hi) {
        const float pivot = copy[lo + (hi - lo) / 2];
        int64_t a = lo, b = hi;
        while (a <= b) {
            while (copy[a] > pivot) a++;
            while (copy[b] < pivot) b--;
            if (a <= b) {
                const float t = copy[a];
                copy[a++] = copy[b], copy[b--] = t;
            }
        }
        if (want <= b) hi = b;
        else if (want >= a) lo = a;
        else return copy[want];
    }
    return copy[want];
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
__attribute__((target("avx2,fma"))) static inline __m256 weights8(const float *x, __m256 m, __m256 inv_t, __m256 least) {
    const __m256 v = _mm256_loadu_ps(x), d = _mm256_mul_ps(_mm256_sub_ps(v, m), inv_t);
    const __m256 kept = _mm256_and_ps(_mm256_cmp_ps(d, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ),
                                      _mm256_cmp_ps(v, least, _CMP_GE_OQ));
    return _mm256_and_ps(exp8(d), kept);
}

/* A block's sum: its whole groups of 8 in lanes, then across the lanes, then its tail one by one. */
__attribute__((target("avx2,fma"))) static float block_sum_avx2(const float *x, int64_t n, float m, float inv_t,
                                                                  float least) {
    const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t), lv = _mm256_set1_ps(least);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, weights8(x + i, mv, tv, lv));
    float lanes[8], s = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++) s += lanes[l];
    for (; i < n; i++) s += weight_c(x[i], m, inv_t, least);
    return s;
}

/* w [n] = the weights of a block's n <= BLOCK_IDS ids, as block_sum_avx2 sums them (groups of 8 in lanes, the tail
 * in C). */
__attribute__((target("avx2,fma"))) static void block_weights_avx2(const float *x, int64_t n, float m, float inv_t,
                                                                    float least, float *w) {
    const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t), lv = _mm256_set1_ps(least);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(w + i, weights8(x + i, mv, tv, lv));
    for (; i < n; i++) w[i] = weight_c(x[i], m, inv_t, least);
}

static void block_weights(const float *x, int64_t n, float m, float inv_t, float least, float *w, int vector) {
    if (vector) {
        block_weights_avx2(x, n, m, inv_t, least, w);
        return;
    }
    for (int64_t i = 0; i < n; i++) w[i] = weight_c(x[i], m, inv_t, least);
}

/* top_k: 0 (off) or the ids kept; copy: scratch for the selection, SELECT_FLOATS(V) floats. */
static int64_t sample_row(const float *x, int64_t V, float inv_t, float u, int64_t top_k, float *sums, float *copy,
                          float *log_normaliser, int vector) {
    const float m = vector ? row_max_avx2(x, V) : row_max(x, V);
    const float least = top_k > 0 && top_k < V ? kth_largest(x, V, top_k, copy, (uint32_t(*)[SELECT_BUCKETS])(copy + V))
                                               : -INFINITY;
    const int64_t blocks = (V + BLOCK_IDS - 1) / BLOCK_IDS;
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n = b + 1 < blocks ? BLOCK_IDS : V - b * BLOCK_IDS;
        sums[b] = vector ? block_sum_avx2(x + b * BLOCK_IDS, n, m, inv_t, least)
                         : block_sum_c(x + b * BLOCK_IDS, n, m, inv_t, least);
        total += sums[b];
    }
    *log_normaliser = m * inv_t + logf(total);
    const float threshold = u * total;
    float before = 0.0f;
    int64_t b = 0;
    for (; b + 1 < blocks && before + sums[b] <= threshold; b++) before += sums[b];
    const int64_t n = b + 1 < blocks ? BLOCK_IDS : V - b * BLOCK_IDS;
    float w[BLOCK_IDS];
    block_weights(x + b * BLOCK_IDS, n, m, inv_t, least, w, vector);
    int64_t last = -1;
    for (int64_t i = 0; i < n; i++) {
        if (w[i] <= 0.0f) continue;
        last = i;
        before += w[i];
        if (before > threshold) return b * BLOCK_IDS + i;
    }
    if (last >= 0) return b * BLOCK_IDS + last;
    /* a block of total weight 0 (only when every later block is too): the last id of positive weight */
    for (int64_t i = V - 1; i > 0; i--)
        if (weight_c(x[i], m, inv_t, least) > 0.0f) return i;
    return 0;
}

int sample_rows(const float *logits, int64_t rows, int64_t V, const float *inv_temperature, const float *uniforms,
                const int64_t *top_k, int64_t *tokens, float *log_normaliser, int threads, int portable) {
    const int64_t blocks = (V + BLOCK_IDS - 1) / BLOCK_IDS, per_thread = blocks + (top_k != NULL ? SELECT_FLOATS(V) : 0);
    const int vector = has_avx2 && !portable;
    const int team = threads > 1 && rows > 1 ? threads : 1;
    /* every thread's block sums (and top-k's selection scratch) in one allocation a call */
    float *scratch = malloc((size_t)team * per_thread * sizeof(float));
    if (scratch == NULL) return -1;
#pragma omp parallel for schedule(static) num_threads(team) if (team > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *sums = scratch + (size_t)omp_get_thread_num() * per_thread;
        tokens[r] = sample_row(logits + r * V, V, inv_temperature[r], uniforms[r], top_k ? top_k[r] : 0, sums,
                               sums + blocks, log_normaliser + r, vector);
    }
    free(scratch);
    return 0;
}
