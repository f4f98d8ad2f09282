/* Fused elementwise passes of the decoder: residual add + RMSNorm, SiLU * up, RoPE + KV store.
 * Each touches its data once instead of once per PyTorch op. See common.h for conventions. */
#include "common.h"

/* Rows per parallel chunk: enough work per chunk to be worth handing to another thread. */
static int64_t rows_per_chunk(int64_t row_elems) {
  const int64_t rows = PARALLEL_MIN_ELEMS / (row_elems > 0 ? row_elems : 1);
  return rows > 0 ? rows : 1;
}

typedef struct {
  int dtype;
  const void *x;
  void *residual;
  const void *weight;
  void *out;
  int64_t dim;
  float eps;
} add_rms_norm_args;

static void add_rms_norm_rows(void *p, int64_t begin, int64_t end) {
  const add_rms_norm_args *a = p;
  const int dtype = a->dtype;
  const int64_t dim = a->dim;
  float *buf = malloc((size_t)dim * sizeof(float));
  if (buf == NULL) return; /* a few KB */
  for (int64_t r = begin; r < end; r++) {
    const int64_t off = r * dim;
    int64_t i = 0;
    float ss = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= dim; i += 16) {
      __m512 v = vload(a->residual, off + i, dtype);
      if (a->x != NULL) {
        v = vround_to(_mm512_add_ps(v, vload(a->x, off + i, dtype)), dtype);
        vstore_as(a->residual, off + i, v, dtype);
      }
      _mm512_storeu_ps(buf + i, v);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
#endif
    for (; i < dim; i++) {
      float v = load(a->residual, off + i, dtype);
      if (a->x != NULL) {
        v = round_to(v + load(a->x, off + i, dtype), dtype);
        store(a->residual, off + i, v, dtype);
      }
      buf[i] = v;
      ss += v * v;
    }
    const float inv = 1.0f / sqrtf(ss / (float)dim + a->eps);
    i = 0;
#ifdef __AVX512F__
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; i + 16 <= dim; i += 16) {
      const __m512 normed = vround_to(_mm512_mul_ps(_mm512_loadu_ps(buf + i), vinv), dtype);
      vstore_as(a->out, off + i, _mm512_mul_ps(normed, vload(a->weight, i, dtype)), dtype);
    }
#endif
    for (; i < dim; i++)
      store(a->out, off + i, round_to(buf[i] * inv, dtype) * load(a->weight, i, dtype), dtype);
  }
  free(buf);
}

/*
 * residual[r] += x[r] (when x is not NULL), then out[r] = rms_norm(residual[r]) * weight.
 * The sum is rounded to the storage dtype before the norm, as an unfused model computes it.
 */
void add_rms_norm(int dtype, const void *x, void *residual, const void *weight, void *out,
                  int64_t rows, int64_t dim, float eps, int threads) {
  add_rms_norm_args a = {dtype, x, residual, weight, out, dim, eps};
  parallel_range(add_rms_norm_rows, &a, rows, rows_per_chunk(dim), threads,
                 rows * dim >= PARALLEL_MIN_ELEMS);
}

typedef struct {
  int dtype;
  const void *gate_up;
  void *out;
  int64_t inter;
} silu_mul_args;

static void silu_mul_rows(void *p, int64_t begin, int64_t end) {
  const silu_mul_args *a = p;
  const int64_t inter = a->inter;
  const int dtype = a->dtype;
  for (int64_t r = begin; r < end; r++) {
    const int64_t in_off = r * 2 * inter, out_off = r * inter;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= inter; i += 16) {
      const __m512 g = vload(a->gate_up, in_off + i, dtype);
      const __m512 u = vload(a->gate_up, in_off + inter + i, dtype);
      const __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
      vstore_as(a->out, out_off + i, _mm512_mul_ps(silu, u), dtype);
    }
#endif
    for (; i < inter; i++) {
      const float g = load(a->gate_up, in_off + i, dtype);
      const float u = load(a->gate_up, in_off + inter + i, dtype);
      store(a->out, out_off + i, g / (1.0f + fast_expf(-g)) * u, dtype);
    }
  }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]. */
void silu_mul(int dtype, const void *gate_up, void *out, int64_t rows, int64_t inter,
              int threads) {
  silu_mul_args a = {dtype, gate_up, out, inter};
  parallel_range(silu_mul_rows, &a, rows, rows_per_chunk(inter), threads,
                 rows * inter >= PARALLEL_MIN_ELEMS);
}

typedef struct {
  int dtype;
  void *qkv;
  int64_t heads, kv_heads, head_dim;
  const int64_t *positions;
  const float *cos_table, *sin_table;
  void *k_cache, *v_cache;
  const int64_t *out_slots;
} rope_args;

static void rope_rows(void *p, int64_t begin, int64_t end) {
  const rope_args *a = p;
  const int dtype = a->dtype;
  const int64_t head_dim = a->head_dim, half = head_dim / 2;
  const int64_t width = (a->heads + 2 * a->kv_heads) * head_dim;
  const int64_t kv_width = a->kv_heads * head_dim;
  const size_t elem = dtype ? 2 : 4;
  for (int64_t t = begin; t < end; t++) {
    const float *c = a->cos_table + a->positions[t] * half;
    const float *s = a->sin_table + a->positions[t] * half;
    const int64_t row = t * width;
    for (int64_t h = 0; h < a->heads + a->kv_heads; h++) {
      const int64_t base = row + h * head_dim;
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= half; i += 16) {
        const __m512 x1 = vload(a->qkv, base + i, dtype), x2 = vload(a->qkv, base + half + i, dtype);
        const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
        vstore_as(a->qkv, base + i, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)), dtype);
        vstore_as(a->qkv, base + half + i, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)), dtype);
      }
#endif
      for (; i < half; i++) {
        const float x1 = load(a->qkv, base + i, dtype), x2 = load(a->qkv, base + half + i, dtype);
        store(a->qkv, base + i, x1 * c[i] - x2 * s[i], dtype);
        store(a->qkv, base + half + i, x2 * c[i] + x1 * s[i], dtype);
      }
    }
    const char *k_src = (const char *)a->qkv + (row + a->heads * head_dim) * elem;
    const char *v_src = k_src + kv_width * elem;
    memcpy((char *)a->k_cache + a->out_slots[t] * kv_width * elem, k_src, kv_width * elem);
    memcpy((char *)a->v_cache + a->out_slots[t] * kv_width * elem, v_src, kv_width * elem);
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
  rope_args a = {dtype,     qkv,       heads,   kv_heads, head_dim, positions,
                 cos_table, sin_table, k_cache, v_cache,  out_slots};
  const int64_t width = (heads + 2 * kv_heads) * head_dim;
  parallel_range(rope_rows, &a, tokens, rows_per_chunk(width), threads,
                 tokens * width >= PARALLEL_MIN_ELEMS);
}
