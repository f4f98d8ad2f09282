/*
 * CPU kernels for the decoder: fused elementwise passes and paged decode attention.
 *
 * Why they exist: at batch 1 a decode step runs ~20 small ops per layer; unfused, each reads and
 * writes its activations and pays a dispatch, and attention over the paged pool first copies every
 * request's K/V into a padded tensor. Here each pass touches its data once, and attention reads
 * K/V rows straight from the pool through the slot table (cost grows with the tokens attended,
 * nothing is copied).
 *
 * Conventions: tensors are row-major and contiguous in their last dimension; `dtype` is 0 for
 * float32 and 1 for bfloat16 (activations, weights and the KV pool share it). Math is float32;
 * results are rounded to the storage dtype once, on store (round to nearest even).
 * Parallelism: OpenMP, with the thread count the caller passes (torch's own pool size), so the
 * process never runs more compute threads than torch does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ATTN_BLOCK 64
/* Work (elements, or token x kv-head pairs for attention) below which a pass runs on the calling
 * thread: waking the pool costs more than it saves, and far more when another process holds a
 * core (a parallel region then waits for a time slice). */
#define PARALLEL_MIN_ELEMS 32768
#define PARALLEL_MIN_ATTN 1024

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

static void load_row(const void *p, int64_t off, int64_t n, float *dst, int dtype) {
  if (dtype) {
    const uint16_t *s = (const uint16_t *)p + off;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
  } else {
    memcpy(dst, (const float *)p + off, (size_t)n * sizeof(float));
  }
}

/*
 * residual[r] += x[r] (when x is not NULL), then out[r] = rms_norm(residual[r]) * weight.
 * The sum is rounded to the storage dtype before the norm, as an unfused model computes it.
 */
void add_rms_norm(int dtype, const void *x, void *residual, const void *weight, void *out,
                  int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMS)
  for (int64_t r = 0; r < rows; r++) {
    float buf[dim];
    int64_t off = r * dim;
    double ss = 0.0;
    for (int64_t i = 0; i < dim; i++) {
      float v = load(residual, off + i, dtype);
      if (x != NULL) {
        v = round_to(v + load(x, off + i, dtype), dtype);
        store(residual, off + i, v, dtype);
      }
      buf[i] = v;
      ss += (double)v * v;
    }
    float inv = 1.0f / sqrtf((float)(ss / (double)dim) + eps);
    for (int64_t i = 0; i < dim; i++) {
      float normed = round_to(buf[i] * inv, dtype);
      store(out, off + i, normed * load(weight, i, dtype), dtype);
    }
  }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]. */
void silu_mul(int dtype, const void *gate_up, void *out, int64_t rows, int64_t inter,
              int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMS)
  for (int64_t r = 0; r < rows; r++) {
    const int64_t in_off = r * 2 * inter, out_off = r * inter;
    for (int64_t i = 0; i < inter; i++) {
      float g = load(gate_up, in_off + i, dtype);
      float u = load(gate_up, in_off + inter + i, dtype);
      store(out, out_off + i, g / (1.0f + expf(-g)) * u, dtype);
    }
  }
}

/*
 * Rotary embedding (rotate-half layout) applied in place to the q and k heads of `qkv`
 * [tokens, (heads + 2 * kv_heads) * head_dim], then k and v stored into the pool at `out_slots`.
 * `cos`/`sin` are float32 tables [max_pos, head_dim / 2] indexed by `positions`.
 */
void rope_store_kv(int dtype, void *qkv, int64_t tokens, int64_t heads, int64_t kv_heads,
                   int64_t head_dim, const int64_t *positions, const float *cos_table,
                   const float *sin_table, void *k_cache, void *v_cache,
                   const int64_t *out_slots, int threads) {
  const int64_t half = head_dim / 2;
  const int64_t width = (heads + 2 * kv_heads) * head_dim;
  const int64_t kv_width = kv_heads * head_dim;
  const size_t elem = dtype ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * width >= PARALLEL_MIN_ELEMS)
  for (int64_t t = 0; t < tokens; t++) {
    const float *c = cos_table + positions[t] * half;
    const float *s = sin_table + positions[t] * half;
    const int64_t row = t * width;
    for (int64_t h = 0; h < heads + kv_heads; h++) {
      const int64_t base = row + h * head_dim;
      for (int64_t i = 0; i < half; i++) {
        float x1 = load(qkv, base + i, dtype), x2 = load(qkv, base + half + i, dtype);
        store(qkv, base + i, x1 * c[i] - x2 * s[i], dtype);
        store(qkv, base + half + i, x2 * c[i] + x1 * s[i], dtype);
      }
    }
    const char *k_src = (const char *)qkv + (row + heads * head_dim) * elem;
    const char *v_src = k_src + kv_width * elem;
    memcpy((char *)k_cache + out_slots[t] * kv_width * elem, k_src, kv_width * elem);
    memcpy((char *)v_cache + out_slots[t] * kv_width * elem, v_src, kv_width * elem);
  }
}

/* exp(x) for float32 to ~2 ulp, branch-free so loops over it vectorize (libm's expf does not
 * without -ffast-math, which would also break the -inf handling the softmax needs). */
static inline float fast_expf(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}

#ifdef __AVX512F__
#include <immintrin.h>
#define VEC 16
typedef __m512 vec_t;
static inline vec_t vload(const void *p, int64_t i, int dtype) {
  if (dtype) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps((const float *)p + i);
}
static inline vec_t vzero(void) { return _mm512_setzero_ps(); }
static inline vec_t vset(float x) { return _mm512_set1_ps(x); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec_t vmul(vec_t a, vec_t b) { return _mm512_mul_ps(a, b); }
static inline float vsum(vec_t a) { return _mm512_reduce_add_ps(a); }
static inline void vstore(float *p, vec_t a) { _mm512_storeu_ps(p, a); }
#else
/* Portable fallback: one "vector" is one float. */
#define VEC 1
typedef float vec_t;
static inline vec_t vload(const void *p, int64_t i, int dtype) { return load(p, i, dtype); }
static inline vec_t vzero(void) { return 0.0f; }
static inline vec_t vset(float x) { return x; }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return a * b + c; }
static inline vec_t vmul(vec_t a, vec_t b) { return a * b; }
static inline float vsum(vec_t a) { return a; }
static inline void vstore(float *p, vec_t a) { *p = a; }
#endif

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

/*
 * Decode attention of one (kv head, row) task: the `group` query heads sharing kv head `kh`
 * attend to slots[start:len]. Each K/V row is loaded once and used by all of them; online
 * softmax over blocks of ATTN_BLOCK tokens, so no buffer grows with the context.
 * Always inlined into callers that fix `group` and `nvec`, so q and the accumulators stay in
 * registers and the loops unroll.
 */
static inline __attribute__((always_inline)) void attend_one(
    const int group, const int64_t nvec, int dtype, const void *q, int64_t q_off,
    const void *k_cache, const void *v_cache, const int64_t *slots, int64_t start, int64_t len,
    int64_t kv_width, int64_t kv_off, float scale, void *out, int64_t out_off) {
  const int64_t head_dim = nvec * VEC;
  const size_t elem = dtype ? 2 : 4;
  vec_t qv[MAX_GROUP][MAX_HEAD_DIM / VEC], acc[MAX_GROUP][MAX_HEAD_DIM / VEC];
  vec_t kv[MAX_HEAD_DIM / VEC];
  float m[MAX_GROUP], l[MAX_GROUP], sc[MAX_GROUP][ATTN_BLOCK];
  const vec_t vscale = vset(scale);
  for (int g = 0; g < group; g++) {
    for (int64_t v = 0; v < nvec; v++) {
      qv[g][v] = vmul(vload(q, q_off + g * head_dim + v * VEC, dtype), vscale);
      acc[g][v] = vzero();
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  for (int64_t t0 = start; t0 < len; t0 += ATTN_BLOCK) {
    const int64_t n = (len - t0 < ATTN_BLOCK) ? len - t0 : ATTN_BLOCK;
    for (int64_t j = 0; j < n; j++) {
      if (j + 4 < n)
        __builtin_prefetch((const char *)k_cache + (slots[t0 + j + 4] * kv_width + kv_off) * elem);
      const int64_t k_off = slots[t0 + j] * kv_width + kv_off;
      for (int64_t v = 0; v < nvec; v++) kv[v] = vload(k_cache, k_off + v * VEC, dtype);
      for (int g = 0; g < group; g++) {
        vec_t dot = vmul(qv[g][0], kv[0]);
        for (int64_t v = 1; v < nvec; v++) dot = vfma(qv[g][v], kv[v], dot);
        sc[g][j] = vsum(dot);
      }
    }
    for (int g = 0; g < group; g++) {
      float block_max = m[g];
      for (int64_t j = 0; j < n; j++) block_max = sc[g][j] > block_max ? sc[g][j] : block_max;
      const float correction = fast_expf(m[g] - block_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; j++) {
        sc[g][j] = fast_expf(sc[g][j] - block_max);
        sum += sc[g][j];
      }
      l[g] = l[g] * correction + sum;
      m[g] = block_max;
      const vec_t vc = vset(correction);
      for (int64_t v = 0; v < nvec; v++) acc[g][v] = vmul(acc[g][v], vc);
    }
    for (int64_t j = 0; j < n; j++) {
      if (j + 4 < n)
        __builtin_prefetch((const char *)v_cache + (slots[t0 + j + 4] * kv_width + kv_off) * elem);
      const int64_t v_off = slots[t0 + j] * kv_width + kv_off;
      for (int64_t v = 0; v < nvec; v++) kv[v] = vload(v_cache, v_off + v * VEC, dtype);
      for (int g = 0; g < group; g++) {
        const vec_t p = vset(sc[g][j]);
        for (int64_t v = 0; v < nvec; v++) acc[g][v] = vfma(p, kv[v], acc[g][v]);
      }
    }
  }
  for (int g = 0; g < group; g++) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    float tmp[MAX_HEAD_DIM];
    for (int64_t v = 0; v < nvec; v++) vstore(tmp + v * VEC, acc[g][v]);
    for (int64_t d = 0; d < head_dim; d++) store(out, out_off + g * head_dim + d, tmp[d] * inv, dtype);
  }
}

/* Specializations for common (query heads per kv head, head_dim / VEC) pairs. */
#define ATTEND_SPECIAL(G, NV)                                                                  \
  static void attend_g##G##_v##NV(int dtype, const void *q, int64_t q_off, const void *kc,    \
                                  const void *vc, const int64_t *slots, int64_t start,        \
                                  int64_t len, int64_t kv_width, int64_t kv_off, float scale, \
                                  void *out, int64_t out_off) {                               \
    attend_one(G, NV, dtype, q, q_off, kc, vc, slots, start, len, kv_width, kv_off, scale,     \
               out, out_off);                                                                  \
  }
#define ATTEND_GROUPS(NV)                                                                      \
  ATTEND_SPECIAL(1, NV) ATTEND_SPECIAL(2, NV) ATTEND_SPECIAL(3, NV) ATTEND_SPECIAL(4, NV)     \
  ATTEND_SPECIAL(5, NV) ATTEND_SPECIAL(6, NV) ATTEND_SPECIAL(7, NV) ATTEND_SPECIAL(8, NV)
#if VEC == 16
ATTEND_GROUPS(4)  /* head_dim 64 */
ATTEND_GROUPS(8)  /* head_dim 128 */
#endif

typedef void (*attend_fn)(int, const void *, int64_t, const void *, const void *,
                          const int64_t *, int64_t, int64_t, int64_t, int64_t, float, void *,
                          int64_t);

static attend_fn special_attend(int64_t group, int64_t nvec) {
#if VEC == 16
  static const attend_fn by_group64[8] = {attend_g1_v4, attend_g2_v4, attend_g3_v4,
                                          attend_g4_v4, attend_g5_v4, attend_g6_v4,
                                          attend_g7_v4, attend_g8_v4};
  static const attend_fn by_group128[8] = {attend_g1_v8, attend_g2_v8, attend_g3_v8,
                                           attend_g4_v8, attend_g5_v8, attend_g6_v8,
                                           attend_g7_v8, attend_g8_v8};
  if (group >= 1 && group <= 8 && nvec == 4) return by_group64[group - 1];
  if (group >= 1 && group <= 8 && nvec == 8) return by_group128[group - 1];
#endif
  (void)group;
  (void)nvec;
  return NULL;
}

/*
 * Decode attention over the paged pool: row b attends to the K/V at slots table[b, start:len[b]]
 * (start = len - window when a sliding window is set, else 0) with its `heads` query heads;
 * query head h reads kv head h / (heads / kv_heads).
 * q: [rows, q_stride] with head h at q[b, h * head_dim]; out: [rows, heads * head_dim];
 * caches: [slots, kv_heads, head_dim]; table: [rows, table_stride] int64.
 * One task per (kv head, row), rows of one kv head adjacent so rows sharing a prefix reuse it
 * from cache. Requires heads / kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM, a multiple of
 * VEC (the caller checks).
 */
void paged_decode_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, const int64_t *table, int64_t table_stride,
                            const int64_t *lens, void *out, int64_t rows, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                            int threads) {
  const int64_t group = heads / kv_heads;
  const int64_t nvec = head_dim / VEC;
  const int64_t kv_width = kv_heads * head_dim;
  const attend_fn special = special_attend(group, nvec);
  int64_t attended = 0;
  for (int64_t b = 0; b < rows; b++) attended += lens[b];
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) \
    if (attended * kv_heads >= PARALLEL_MIN_ATTN)
  for (int64_t task = 0; task < kv_heads * rows; task++) {
    const int64_t kh = task / rows, b = task % rows;
    const int64_t len = lens[b];
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    const int64_t q_off = b * q_stride + kh * group * head_dim;
    const int64_t out_off = b * heads * head_dim + kh * group * head_dim;
    const int64_t *slots = table + b * table_stride;
    if (special != NULL)
      special(dtype, q, q_off, k_cache, v_cache, slots, start, len, kv_width, kh * head_dim,
              scale, out, out_off);
    else
      attend_one((int)group, nvec, dtype, q, q_off, k_cache, v_cache, slots, start, len,
                 kv_width, kh * head_dim, scale, out, out_off);
  }
}

/* Limits the Python side checks before calling paged_decode_attention. */
int64_t attention_max_group(void) { return MAX_GROUP; }
int64_t attention_max_head_dim(void) { return MAX_HEAD_DIM; }
int64_t attention_vec_width(void) { return VEC; }
