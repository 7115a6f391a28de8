/* The stream linear for int8 and 4-bit weights (_cpu_quant.c), called by _cpu_kernels.c's gemm. */
#ifndef SPECRL_CPU_QUANT_H
#define SPECRL_CPU_QUANT_H
#include <stdint.h>

/* Reads the CPU's instruction sets once (the module's init). */
void quant_init(void);

enum { QUANT_BEST, QUANT_PORTABLE, QUANT_AVX2 }; /* a path to force (tests) */

/* out[M, N] = x[M, K] @ W^T for W blocked as _cpu_quant.c describes (kind 3: int8, 4: 4-bit), K a
 * multiple of 32, N of 16; force: QUANT_BEST, or the path named (every path gives the same bits); prefetch:
 * bytes ahead of each weight group to prefetch (0: none; the same bits either way).
 * 0, or -1 when memory ran out. */
int gemm_quant(const float *x, const void *w, float *out, int64_t M, int64_t K, int64_t N, int kind, int threads,
               int force, int64_t prefetch);

/* The instruction set gemm_quant uses: "avx512_vnni", "avx2" or "portable". */
const char *quant_path_name(void);
#endif
