/*
 * Shared helpers of the CPU kernels: bfloat16 conversion, a small vector abstraction (AVX-512
 * when the compiler targets it, else AVX2 with FMA, else NEON on aarch64, else scalar), a
 * vectorizable exp, and the work thresholds. Code written against vec_t (vload, vfma, vexp,
 * vstore_as, ...) runs on all four; `#if VEC > 1` guards the vector loops whose scalar tails
 * finish the rows.
 *
 * Conventions of every kernel: tensors are row-major and contiguous in their last dimension;
 * `dtype` is 0 for float32 and 1 for bfloat16 (activations, weights and the KV pool share it).
 * Math is float32; results are rounded to the storage dtype once, on store (round to nearest
 * even). Parallelism: `parallel_range` on the pool of threadpool.c, with the thread count the
 * caller passes (torch's own pool size), so the process never runs more compute threads than
 * torch does.
 */
#ifndef SGLITE_KERNELS_COMMON_H
#define SGLITE_KERNELS_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "threadpool.h"
#ifdef __F16C__
#include <immintrin.h>
#endif
/* A build whose AMX kernel (gguf_amx.c) can run: AMX tiles with bf16, AVX512-BF16, Linux (whose
 * permission call enables the tiles). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define SGLITE_AMX 1
#endif
/* A build whose tile GEMM (gguf_amx.c) can run: on AMX tiles, or with AVX512-BF16 dot
 * products where the CPU has no AMX. */
#if defined(SGLITE_AMX) || (defined(__AVX512BF16__) && defined(__AVX512F__))
#define SGLITE_TILE_GEMM 1
#endif

/* Work (elements, or token x kv-head pairs for attention) below which a pass runs on the calling
 * thread: waking the pool costs more than it saves, and far more when another process holds a
 * core (a parallel region then waits for a time slice). */
#define PARALLEL_MIN_ELEMS 32768
/* sqrt(2 / pi) and GELU's cubic coefficient, doubled: gelu_tanh(g) = g * sigmoid(2 z) with
 * z = sqrt(2 / pi) (g + 0.044715 g^3), since 0.5 (1 + tanh(z)) = sigmoid(2 z). */
#define GELU_2C 1.5957691216057308f
#define GELU_2C3 0.0713548162726009f
#define PARALLEL_MIN_ATTN 1024

/* panel_gemm.c's row pass, which quant_gemm.c runs over the panels it dequantizes: y[r, 0:cols]
 * (row stride ldy) = x[r] . panel (+ bias) for all rows; `next` (or NULL) is prefetched. */
void panel_rows(const float *x, int64_t rows, int64_t k, const float *panel, const float *next,
                float *y, int64_t ldy, int64_t cols, const float *bias);

/* gguf_blocks.c's row decoding, which quant_gemm.c runs for QUANT_GEMM_GGUF: row n of a GGUF
 * weight (its bytes and type), and the float32 values of a row of k values of `type`. */
const void *gguf_part_row(const gguf_part_t *parts, int64_t n, int64_t k, int64_t *type);
/* Row n as the file stores it, and its block type: gguf_part_row's view, or a tiled or quads
 * part's row rebuilt into `scratch` (STORED_ROW_BYTES(k): the widest row, Q8_0's). */
const uint8_t *gguf_stored_row(const gguf_part_t *parts, int64_t n, int64_t k, uint8_t *scratch,
                               int64_t *type);
#define STORED_ROW_BYTES(k) ((k) / 32 * 34)
/* Whether the parts are row ranges of supported types covering exactly n_out rows of k values. */
int gguf_parts_valid(const gguf_part_t *parts, int64_t n_out, int64_t k);
void gguf_decode_row(int64_t type, const void *row, int64_t k, float *out);
/* Values [v0, v0 + count) of such a row (v0 and count whole blocks of `type`). */
void gguf_decode_span(int64_t type, const void *row, int64_t v0, int64_t count, float *out);

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The sum of an AVX2 vector's 8 lanes (for kernels written in AVX2 whatever VEC is). */
static inline float sum256(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

/* An IEEE half (the int4 weights' scales and offsets) as float32. */
static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else { /* subnormal: normalize */
      int e = -1;
      uint32_t m = mant;
      do {
        e++;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

static inline float load(const void *p, int64_t i, int dtype) {
  return dtype ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dtype) {
  if (dtype)
    ((uint16_t *)p)[i] = f32_to_bf16(v);
  else
    ((float *)p)[i] = v;
}

/* Round a float32 through the storage dtype (identity for float32). */
static inline float round_to(float v, int dtype) {
  return dtype ? bf16_to_f32(f32_to_bf16(v)) : v;
}

static inline void load_row(const void *p, int64_t off, int64_t n, float *dst, int dtype) {
  if (dtype) {
    const uint16_t *s = (const uint16_t *)p + off;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
  } else {
    memcpy(dst, (const float *)p + off, (size_t)n * sizeof(float));
  }
}

/*
 * Ask for `bytes` at `p` ahead of use. The GEMV kernels stream weights row after row, and each
 * row of a decode-size weight is short (288 bytes for int4 at k = 576): the hardware prefetcher
 * restarts at every 4 KB page and every chunk, so requesting the rows a few ahead keeps memory
 * busy across those restarts instead of stalling on each one.
 */
static inline void prefetch_bytes(const void *p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* exp(x) for float32 to ~2 ulp, written so loops over it vectorize (libm's expf does not
 * without -ffast-math, which would also break the -inf handling the softmax needs): clamps,
 * round-to-nearest by the 1.5 * 2^23 trick, a degree-6 polynomial, and 2^n built in the
 * exponent bits. exp(-inf) gives ~1e-38, which every caller treats as 0. */
static inline float fast_expf(float x) {
  x = fminf(fmaxf(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  union {
    int32_t i;
    float f;
  } scale = {.i = ((int32_t)n + 127) << 23};
  return p * scale.f;
}

#include "vec.h"

/* act(g) * u, act silu (gelu 0) or gelu_tanh (g sigmoid(2c g + 2c 0.044715 g^3)): the one
 * formula act_mul and the gated GEMMs share, so a fused product equals the unfused one. */
static inline vec_t vgated(vec_t g, vec_t u, int gelu) {
  const vec_t arg = gelu ? vmul(g, vfma(vmul(g, g), vset(GELU_2C3), vset(GELU_2C))) : g;
  return vmul(vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), arg)))), u);
}

typedef void (*range_fn)(void *ctx, int64_t begin, int64_t end);
typedef struct {
  range_fn fn;
  void *ctx;
  int64_t n, per_chunk;
} range_job_t;

static void range_chunk(void *p, int64_t c) {
  const range_job_t *job = p;
  const int64_t begin = c * job->per_chunk;
  const int64_t end = begin + job->per_chunk < job->n ? begin + job->per_chunk : job->n;
  job->fn(job->ctx, begin, end);
}

/* Set (per thread) while decode_layers runs: kernels then share work on threadpool.c's pool.
 * Called from Python, between PyTorch ops, they use OpenMP instead: torch's own OpenMP threads
 * are awake right after its ops, while the pool's would need waking for every kernel. */
extern __thread int sglite_in_native_step;

/* fn(ctx, begin, end) over [0, n) in chunks of `per_chunk`, in parallel when `parallel` (else
 * in one call on this thread). */
static inline void parallel_range(range_fn fn, void *ctx, int64_t n, int64_t per_chunk,
                                  int threads, int parallel) {
  if (!parallel || threads <= 1 || n <= per_chunk) {
    fn(ctx, 0, n);
    return;
  }
  range_job_t job = {fn, ctx, n, per_chunk};
  const int64_t chunks = (n + per_chunk - 1) / per_chunk;
  if (sglite_in_native_step) {
    parallel_chunks(range_chunk, &job, chunks, threads);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; c++) range_chunk(&job, c);
}
#endif
