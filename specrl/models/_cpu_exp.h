/* e^x on the CPU, scalar and 8 lanes: what attention's softmax, SwiGLU's sigmoid and the sampler share. */
#ifndef SPECRL_CPU_EXP_H
#define SPECRL_CPU_EXP_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* e^x for finite x <= 0: x = n ln2 + r (|r| <= ln2 / 2), 2^n from the exponent bits, e^r by its
 * degree-6 Taylor polynomial (relative error ~1e-7); 0 below -87. Branch-free, so the loops over a
 * block of keys vectorise. */
static inline __attribute__((always_inline)) float exp_nonpos(float x) {
    float t = x * 1.44269504f;
    int n = (int)(t - 0.5f); /* round to nearest: t <= 0 */
    float r = x - (float)n * 0.693145752f - (float)n * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

/* e^x, 8 lanes, x clamped to [-87, 88]: exp_nonpos's reduction and polynomial with FMA. */
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

#endif
