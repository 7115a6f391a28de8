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
 * registers: half the bytes streamed; products and sums in float32); x and out are float32.
 *
 * Paths, chosen at run time from the CPU: AVX-512F (16 lanes, 6 rows x 4 vectors), AVX2 + FMA +
 * F16C (8 lanes, 6 rows x 2 vectors), and portable C. Threads: OpenMP over groups of outputs,
 * with the count the caller passes (torch's), in the runtime torch already loaded (libgomp.so.1 by
 * soname: one thread pool). The GIL is released while it runs. The caller (linear.py) checks
 * shapes, dtypes and contiguity; this file trusts its arguments.
 *
 * rms_norm: out = x / sqrt(mean(x^2) + eps) * w over rows of H float32 values, in one pass per
 * row instead of torch's six ops (~40 us of dispatch a call for SmolLM2's 576 values, 61 calls a
 * forward). The sum is accumulated in double, so it rounds no worse than torch's float32 mean.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#define BLOCK 16 /* outputs per column block (the layout), whatever the vector width */

enum { W_F32 = 0, W_F16 = 1 };

/* ---- portable C ------------------------------------------------------------------------- */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

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
        for (int64_t k = 0; k < K; k++) {                                                                      \
            VEC wv[NV];                                                                                        \
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
static const tile_fn avx512_tiles[] = {NULL, tile_avx512_1, tile_avx512_2, tile_avx512_3, tile_avx512_4,
                                       tile_avx512_5, tile_avx512_6};
BLOCKS(avx512, AVX512, 16, 4, 6, avx512_tiles)

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

static void gemm(const float *x, const void *w, float *out, int64_t M, int64_t K, int64_t N, int kind, int threads,
                 int portable) {
    const char *name;
    int64_t group;
    blocks_fn run = pick(N, &name, &group);
    if (portable) run = blocks_portable, group = 1;
    int64_t groups = N / BLOCK / group;
    /* chunks of whole groups, a few per thread: static, so each thread streams one contiguous range */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) run(x, w, out, M, K, N, g * group, (g + 1) * group, kind);
}

static PyObject *py_gemm(PyObject *self, PyObject *args) {
    unsigned long long x, w, out;
    long long M, K, N;
    int kind, threads, portable = 0;
    if (!PyArg_ParseTuple(args, "KKKLLLii|p", &out, &x, &w, &M, &K, &N, &kind, &threads, &portable)) return NULL;
    if (M < 0 || K < 1 || N < 0 || N % BLOCK || (kind != W_F32 && kind != W_F16) || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "gemm: N must be a multiple of 16, K >= 1, kind 0 or 1, threads >= 1");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    gemm((const float *)(uintptr_t)x, (const void *)(uintptr_t)w, (float *)(uintptr_t)out, M, K, N, kind, threads,
         portable);
    Py_END_ALLOW_THREADS
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

static PyObject *py_path(PyObject *self, PyObject *args) {
    long long N;
    if (!PyArg_ParseTuple(args, "L", &N)) return NULL;
    const char *name;
    int64_t group;
    pick(N, &name, &group);
    return PyUnicode_FromString(name);
}

static PyMethodDef methods[] = {
    {"gemm", py_gemm, METH_VARARGS,
     "gemm(out_ptr, x_ptr, w_ptr, M, K, N, kind, threads, portable=False): out[M,N] = x[M,K] @ W^T, W blocked "
     "[N/16, K, 16] (kind 0: float32, 1: float16; portable: the C path whatever the CPU has, for tests)"},
    {"path", py_path, METH_VARARGS, "path(N) -> the instruction set used for N outputs"},
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(out_ptr, x_ptr, w_ptr, rows, H, eps): out = x / sqrt(mean(x^2) + eps) * w, float32 rows of H"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    __builtin_cpu_init();
    has_avx512 = __builtin_cpu_supports("avx512f");
    has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return PyModule_Create(&module);
}
