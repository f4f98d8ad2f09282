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
#define PARALLEL_MIN_ATTN 4096

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

/*
 * Decode attention over the paged pool: row b attends to the K/V at slots table[b, start:len[b]]
 * (start = len - window when a sliding window is set, else 0) with its `heads` query heads;
 * query head h reads kv head h / (heads / kv_heads).
 * q: [rows, q_stride] with head h at q[b, h * head_dim]; out: [rows, heads * head_dim];
 * caches: [slots, kv_heads, head_dim]; table: [rows, table_stride] int64.
 * One task per (kv head, row), rows of one kv head adjacent so rows sharing a prefix reuse it
 * from cache. Online softmax over blocks of ATTN_BLOCK tokens: no buffer grows with the context.
 */
void paged_decode_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, const int64_t *table, int64_t table_stride,
                            const int64_t *lens, void *out, int64_t rows, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                            int threads) {
  const int64_t group = heads / kv_heads;
  const int64_t kv_width = kv_heads * head_dim;
  int64_t attended = 0;
  for (int64_t b = 0; b < rows; b++) attended += lens[b];
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) \
    if (attended * kv_heads >= PARALLEL_MIN_ATTN)
  for (int64_t task = 0; task < kv_heads * rows; task++) {
    const int64_t kh = task / rows, b = task % rows;
    const int64_t len = lens[b];
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    float qf[group][head_dim], acc[group][head_dim], kf[head_dim], vf[head_dim];
    float m[group], l[group], sc[group][ATTN_BLOCK];
    for (int64_t g = 0; g < group; g++) {
      load_row(q, b * q_stride + (kh * group + g) * head_dim, head_dim, qf[g], dtype);
      for (int64_t d = 0; d < head_dim; d++) {
        qf[g][d] *= scale;
        acc[g][d] = 0.0f;
      }
      m[g] = -INFINITY;
      l[g] = 0.0f;
    }
    const int64_t *slots = table + b * table_stride;
    for (int64_t t0 = start; t0 < len; t0 += ATTN_BLOCK) {
      const int64_t n = (len - t0 < ATTN_BLOCK) ? len - t0 : ATTN_BLOCK;
      float block_max[group];
      for (int64_t g = 0; g < group; g++) block_max[g] = -INFINITY;
      for (int64_t j = 0; j < n; j++) {
        load_row(k_cache, slots[t0 + j] * kv_width + kh * head_dim, head_dim, kf, dtype);
        for (int64_t g = 0; g < group; g++) {
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; d++) s += qf[g][d] * kf[d];
          sc[g][j] = s;
          if (s > block_max[g]) block_max[g] = s;
        }
      }
      for (int64_t g = 0; g < group; g++) {
        const float new_max = block_max[g] > m[g] ? block_max[g] : m[g];
        const float correction = expf(m[g] - new_max);
        l[g] *= correction;
        for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= correction;
        for (int64_t j = 0; j < n; j++) {
          sc[g][j] = expf(sc[g][j] - new_max);
          l[g] += sc[g][j];
        }
        m[g] = new_max;
      }
      for (int64_t j = 0; j < n; j++) {
        load_row(v_cache, slots[t0 + j] * kv_width + kh * head_dim, head_dim, vf, dtype);
        for (int64_t g = 0; g < group; g++) {
          const float p = sc[g][j];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * vf[d];
        }
      }
    }
    for (int64_t g = 0; g < group; g++) {
      const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
      const int64_t off = b * heads * head_dim + (kh * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; d++) store(out, off + d, acc[g][d] * inv, dtype);
    }
  }
}
