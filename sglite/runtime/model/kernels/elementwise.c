/* Fused elementwise passes of the decoder: residual add + RMSNorm, SiLU * up, RoPE + KV store.
 * Each touches its data once instead of once per PyTorch op. See common.h for conventions. */
#include "common.h"

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
      store(out, out_off + i, g / (1.0f + fast_expf(-g)) * u, dtype);
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

