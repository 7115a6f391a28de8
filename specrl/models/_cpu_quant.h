/* The stream linear for int8 and 4-bit weights (_cpu_quant.c), called by _cpu_kernels.c's gemm. */
#ifndef SPECRL_CPU_QUANT_H
#define SPECRL_CPU_QUANT_H
#include <stdint.h>

/* Reads the CPU's instruction sets once (the module's init). */
void quant_init(void);

/* The process may use AMX tiles (Linux granted them: _cpu_kernels' init asks); the CPU's AMX-INT8 is checked here. */
void quant_allow_amx(int allowed);

/* a path to force: QUANT_AMX is a call the calibration times (AMX-INT8 tiles where there are), the others tests' */
enum { QUANT_BEST, QUANT_PORTABLE, QUANT_AVX2, QUANT_AMX };

/* out[M, N] = x[M, K] @ W^T for W blocked as _cpu_quant.c describes (kind 3: int8, 4: 4-bit), K a
 * multiple of 32, N of 16; force: QUANT_BEST, or the path named (every path gives the same bits); prefetch:
 * bytes ahead of each weight group to prefetch (0: none; the same bits either way).
 * 0, or -1 when memory ran out. */
int gemm_quant(const float *x, const void *w, float *out, int64_t M, int64_t K, int64_t N, int kind, int threads,
               int force, int64_t prefetch);

/* Rows `ids` (n of them, each in [0, N)) of W blocked as gemm_quant takes it, dequantized -> out [n, K] float32.
 * 0, or -1 for an id outside [0, N). */
int quant_rows(const void *w, const int64_t *ids, int64_t n, int64_t K, int64_t N, int kind, float *out);

/* The instruction set gemm_quant uses when forced so: "amx_int8", "avx512_vnni", "avx2" or "portable". */
const char *quant_path_name(int force);
#endif
