/* Fused elementwise passes of the decoder: residual add + RMSNorm, per-head q/k RMSNorm, gated
 * activations (SiLU or GELU-tanh times up), RoPE + KV store,
 * and the per-row max + argmax greedy sampling reads off the logits. Each touches its data once
 * instead of once per PyTorch op. See common.h for conventions. */
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
#if VEC > 1
    vec_t acc = vzero();
    for (; i + VEC <= dim; i += VEC) {
      vec_t v = vload(a->residual, off + i, dtype);
      if (a->x != NULL) {
        v = vround_to(vadd(v, vload(a->x, off + i, dtype)), dtype);
        vstore_as(a->residual, off + i, v, dtype);
      }
      vstore(buf + i, v);
      acc = vfma(v, v, acc);
    }
    ss = vsum(acc);
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
#if VEC > 1
    const vec_t vinv = vset(inv);
    for (; i + VEC <= dim; i += VEC) {
      const vec_t normed = vround_to(vmul(vload(buf, i, 0), vinv), dtype);
      vstore_as(a->out, off + i, vmul(normed, vload(a->weight, i, dtype)), dtype);
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
  int dtype, act;
  const void *gate_up;
  void *out;
  int64_t inter;
} act_mul_args;

static void act_mul_rows(void *p, int64_t begin, int64_t end) {
  const act_mul_args *a = p;
  const int64_t inter = a->inter;
  const int dtype = a->dtype, gelu = a->act == ACT_GELU_TANH;
  for (int64_t r = begin; r < end; r++) {
    const int64_t in_off = r * 2 * inter, out_off = r * inter;
    int64_t i = 0;
#if VEC > 1
    for (; i + VEC <= inter; i += VEC) {
      const vec_t g = vload(a->gate_up, in_off + i, dtype);
      const vec_t u = vload(a->gate_up, in_off + inter + i, dtype);
      vstore_as(a->out, out_off + i, vgated(g, u, gelu), dtype);
    }
#endif
    for (; i < inter; i++) {
      const float g = load(a->gate_up, in_off + i, dtype);
      const float u = load(a->gate_up, in_off + inter + i, dtype);
      const float arg = gelu ? g * (GELU_2C + GELU_2C3 * g * g) : g;
      store(a->out, out_off + i, g / (1.0f + fast_expf(-arg)) * u, dtype);
    }
  }
}

/* out[r, i] = act(gate_up[r, i]) * gate_up[r, inter + i], act = ACT_SILU or ACT_GELU_TANH. */
void act_mul(int dtype, int act, const void *gate_up, void *out, int64_t rows, int64_t inter,
             int threads) {
  act_mul_args a = {dtype, act, gate_up, out, inter};
  parallel_range(act_mul_rows, &a, rows, rows_per_chunk(inter), threads,
                 rows * inter >= PARALLEL_MIN_ELEMS);
}

typedef struct {
  int dtype;
  void *qkv;
  int64_t width, heads, kv_heads, head_dim;
  const void *q_weight, *k_weight;
  float eps;
} head_norm_args;

static void head_norm_rows(void *p, int64_t begin, int64_t end) {
  const head_norm_args *a = p;
  const int dtype = a->dtype;
  const int64_t d = a->head_dim;
  for (int64_t t = begin; t < end; t++) {
    for (int64_t h = 0; h < a->heads + a->kv_heads; h++) {
      const int64_t off = t * a->width + h * d;
      const void *w = h < a->heads ? a->q_weight : a->k_weight;
      float ss = 0.0f;
      for (int64_t i = 0; i < d; i++) {
        const float v = load(a->qkv, off + i, dtype);
        ss += v * v;
      }
      const float inv = 1.0f / sqrtf(ss / (float)d + a->eps);
      for (int64_t i = 0; i < d; i++)
        store(a->qkv, off + i, round_to(load(a->qkv, off + i, dtype) * inv, dtype) * load(w, i, dtype),
              dtype);
    }
  }
}

/*
 * RMSNorm of every query head (weight q_weight [head_dim]) and key head (k_weight) of `qkv`
 * [tokens, width] in place (Qwen3, Gemma 3 normalize them before RoPE); v is left alone. The
 * normalized value is rounded to the storage dtype before the weight multiplies it, as in
 * add_rms_norm.
 */
void head_rms_norm(int dtype, void *qkv, int64_t tokens, int64_t width, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, const void *q_weight, const void *k_weight,
                   float eps, int threads) {
  head_norm_args a = {dtype, qkv, width, heads, kv_heads, head_dim, q_weight, k_weight, eps};
  parallel_range(head_norm_rows, &a, tokens, rows_per_chunk(width), threads,
                 tokens * width >= PARALLEL_MIN_ELEMS);
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
#if VEC > 1
      for (; i + VEC <= half; i += VEC) {
        const vec_t x1 = vload(a->qkv, base + i, dtype), x2 = vload(a->qkv, base + half + i, dtype);
        const vec_t cv = vload(c, i, 0), sv = vload(s, i, 0);
        vstore_as(a->qkv, base + i, vfmsub(x1, cv, vmul(x2, sv)), dtype);
        vstore_as(a->qkv, base + half + i, vfma(x2, cv, vmul(x1, sv)), dtype);
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

/* The first index in row[0:n) holding `target`, or the first NaN when `target` is NaN; a block
 * of 64 is tested with vector compares before it is searched. */
static int64_t first_index_of(const float *row, int64_t n, float target) {
  const int want_nan = target != target;
  for (int64_t b = 0; b < n; b += 64) {
    const int64_t end = b + 64 < n ? b + 64 : n;
    int hit = 0;
    if (want_nan) {
#pragma omp simd reduction(| : hit)
      for (int64_t i = b; i < end; i++) hit |= row[i] != row[i];
    } else {
#pragma omp simd reduction(| : hit)
      for (int64_t i = b; i < end; i++) hit |= row[i] == target;
    }
    if (!hit) continue;
    for (int64_t i = b; i < end; i++)
      if (want_nan ? row[i] != row[i] : row[i] == target) return i;
  }
  return 0; /* not reached: `target` is one of the row's values */
}

/*
 * Per row of x [rows, n] float32: the largest value and the first index holding it, as
 * torch.max(dim=-1) gives them (a row with a NaN reports NaN and the first NaN's index). Greedy
 * sampling needs exactly this, and here it is one pass on the calling thread. PyTorch would make
 * two passes (amax for the NaN check, then max), each dispatched to its OpenMP team, which may
 * have gone to sleep on an idle core and must be woken first.
 */
void row_max(const float *x, int64_t rows, int64_t n, float *values, int64_t *indices) {
  for (int64_t r = 0; r < rows; r++) {
    const float *row = x + r * n;
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
      best = row[i] > best ? row[i] : best;
      nan |= row[i] != row[i];
    }
    values[r] = nan ? NAN : best;
    indices[r] = first_index_of(row, n, values[r]);
  }
}
