/* A plain sampled step's draw from a row of logits (_cpu_sample.c). */
#ifndef SPECRL_CPU_SAMPLE_H
#define SPECRL_CPU_SAMPLE_H
#include <stdint.h>

void sample_init(void);

/* logits [rows, V] float32, inv_temperature [rows] (1 / T > 0), uniforms [rows] in [0, 1), top_k [rows] (NULL, or 0:
 * every id; k: the k most likely and those tied with the k-th) -> tokens [rows] int64, the inverse-CDF draw of
 * softmax(x / T) over the kept ids with u, and log_normaliser [rows] float32 = log sum over the kept ids of
 * exp(x_i / T); rows split over `threads`; portable: the C path even where the CPU has AVX2 (tests). 0, or -1 when
 * memory ran out. */
int sample_rows(const float *logits, int64_t rows, int64_t V, const float *inv_temperature, const float *uniforms,
                const int64_t *top_k, int64_t *tokens, float *log_normaliser, int threads, int portable);
#endif
