/* The CPU's peak multiply-add rate for one kernel instruction (_cpu_peak.c), exposed by _cpu_kernels.c. */
#ifndef SPECRL_CPU_PEAK_H
#define SPECRL_CPU_PEAK_H

/* Multiply-adds a second on `threads` threads at once for the instruction named ("avx2_fma", "avx512_fma",
 * "avx2_int8", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"), the best of `repeats` timed runs of >= 20 ms each; -1 for a name
 * this CPU cannot run (or does not know). */
double peak_macs(const char *name, int threads, int repeats);
#endif
