/*
 * The decoder layers of a decode batch in one call: up to QGEMV_MAX_ROWS rows with quantized
 * or dense weights, up to NATIVE_MAX_ROWS with float32 weights in panels (panel_gemm.c) or
 * quantized weights and float32 rows (quant_gemm.c).
 *
 * Why: at batch 1 a layer is ~10 small operations; issued from Python each costs microseconds of
 * interpreter and dispatch time, which adds up to a large share of a step once the weights are
 * 4-bit. Here the same operations (the kernels of elementwise.c, attention.c and quant_gemv.c,
 * plus dense GEMV) run back to back in C. The math is the PyTorch path's, operation for
 * operation, so the two agree to float rounding (tests/test_native_decode.py).
 *
 * Per layer: x = rms_norm(residual); qkv = x Wqkv (+ b); [RMSNorm of each q and k head]; RoPE
 * on q, k and k, v into the pool; a = attention(q, pool) Wo (+ b) [then rms_norm(a)];
 * residual += a; x = rms_norm(residual); m = down(act(gate) * up) [then rms_norm(m)];
 * residual += m. Bracketed steps run where the layer has those norms (Qwen3, Gemma 3); act is
 * SiLU or GELU-tanh. The residual stream is updated in place; on return it holds the last
 * layer's output (before the final norm). See common.h for conventions.
 */
#include "common.h"

__thread int sglite_in_native_step = 0;

typedef struct {
  int dtype;
  const void *x, *w;
  void *y;
  int64_t rows, n_out, k;
} dense_args;

/* Output column range of a dense GEMV, rows handled in blocks of ROW_BLOCK (one accumulator
 * each); each weight row is read from memory once and from L1 for the later row blocks. */
#define ROW_BLOCK 8
static void dense_rows(void *p, int64_t n0, int64_t n1) {
  const dense_args *a = p;
  const int dtype = a->dtype;
  const int64_t k = a->k, rows = a->rows;
  for (int64_t n = n0; n < n1; n++) {
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
      const int64_t nr = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
      float sum[ROW_BLOCK];
      int64_t i = 0;
#if defined(__AVX512BF16__)
      if (dtype) {
        __m512 acc[ROW_BLOCK];
        for (int64_t m = 0; m < nr; m++) acc[m] = _mm512_setzero_ps();
        const uint16_t *wn = (const uint16_t *)a->w + n * k;
        for (; i + 32 <= k; i += 32) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(wn + i));
          for (int64_t m = 0; m < nr; m++) {
            const uint16_t *xm = (const uint16_t *)a->x + (r0 + m) * k + i;
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512((const void *)xm), wv);
          }
        }
        for (int64_t m = 0; m < nr; m++) sum[m] = _mm512_reduce_add_ps(acc[m]);
      } else
#endif
      {
        for (int64_t m = 0; m < nr; m++) sum[m] = 0.0f;
#if VEC > 1
        /* Two accumulators per row hide the FMA latency; the weight vector is loaded (and
         * widened from bf16) once for all rows of the block. */
        vec_t acc[ROW_BLOCK][2];
        for (int64_t m = 0; m < nr; m++) acc[m][0] = acc[m][1] = vzero();
        for (; i + 2 * VEC <= k; i += 2 * VEC) {
          const vec_t w0 = vload(a->w, n * k + i, dtype), w1 = vload(a->w, n * k + i + VEC, dtype);
          for (int64_t m = 0; m < nr; m++) {
            const int64_t xo = (r0 + m) * k + i;
            acc[m][0] = vfma(w0, vload(a->x, xo, dtype), acc[m][0]);
            acc[m][1] = vfma(w1, vload(a->x, xo + VEC, dtype), acc[m][1]);
          }
        }
        for (int64_t m = 0; m < nr; m++) sum[m] = vsum(vadd(acc[m][0], acc[m][1]));
#endif
      }
      for (int64_t m = 0; m < nr; m++) {
        float s = sum[m];
        const int64_t row = r0 + m;
#pragma omp simd reduction(+ : s)
        for (int64_t j = i; j < k; j++)
          s += load(a->x, row * k + j, dtype) * load(a->w, n * k + j, dtype);
        store(a->y, row * a->n_out + n, s, dtype);
      }
    }
  }
}

/* y = x W^T for a dense weight in the activation dtype, a few rows: one pass over W. */
static void dense_gemv(int dtype, const void *x, const void *w, void *y, int64_t rows,
                       int64_t n_out, int64_t k, int threads) {
  dense_args a = {dtype, x, w, y, rows, n_out, k};
  parallel_range(dense_rows, &a, n_out, 64, threads, n_out * k >= 65536);
}

/* dense_gemv for callers outside a decode step (the output projection); 0 = done. */
int dense_gemv_rows(int dtype, const void *x, const void *w, void *y, int64_t rows, int64_t n_out,
                    int64_t k, int threads) {
  if (rows < 1 || rows > ROW_BLOCK) return -1;
  dense_gemv(dtype, x, w, y, rows, n_out, k, threads);
  return 0;
}

static void add_bias(int dtype, const linear_t *l, void *y, int64_t rows) {
  for (int64_t m = 0; m < rows; m++)
    for (int64_t n = 0; n < l->n_out; n++)
      store(y, m * l->n_out + n, load(y, m * l->n_out + n, dtype) + load(l->bias, n, dtype),
            dtype);
}

/* Whether a GGUF weight's bf16 batch of `rows` goes to the AMX tiles: from the weight's
 * amx_min_rows (rows independent, but not the GEMV's or gguf_gemv_a8's sums, so deterministic
 * mode keeps one kernel for every row count). The kernel may still decline (no AMX here). */
static int amx_rows(int dtype, const linear_t *l, int64_t rows, int deterministic) {
  const int any_gguf = l->kind == LINEAR_GGUF || l->kind == LINEAR_GGUF_A8;
  return any_gguf && dtype == DTYPE_BFLOAT16 && !deterministic && rows >= l->amx_min_rows;
}

static int linear_rows(int dtype, const linear_t *l, const void *x, void *y, int64_t rows,
                       int threads, int deterministic);

/* activated = act(gate) * up of the fused gate_up projection: on AMX tiles in one pass where
 * linear_rows would take them (the same values, bit for bit), else the product into `gate_up`
 * and act_mul. */
static int gated_rows(int dtype, int act, const linear_t *l, const void *x, void *gate_up,
                      void *activated, int64_t rows, int64_t inter, int threads,
                      int deterministic) {
  if (amx_rows(dtype, l, rows, deterministic) && l->bias == NULL &&
      gguf_gemm_amx_glu(dtype, act, x, l->weight, activated, rows, l->n_out, l->k, threads) == 0)
    return 0;
  const int status = linear_rows(dtype, l, x, gate_up, rows, threads, deterministic);
  if (status == 0) act_mul(dtype, act, gate_up, activated, rows, inter, threads);
  return status;
}

static int linear_rows(int dtype, const linear_t *l, const void *x, void *y, int64_t rows,
                       int threads, int deterministic) {
  int status = 0;
  if (l->kind == LINEAR_PANELS) { /* adds the bias itself */
    if (dtype != 0) return -1;      /* panels are float32 only */
    panel_gemm(x, l->weight, l->bias, y, rows, l->n_out, l->k, threads);
    return 0;
  }
  if (amx_rows(dtype, l, rows, deterministic) &&
      gguf_gemm_amx(dtype, x, l->weight, y, rows, l->n_out, l->k, threads) == 0) {
    if (l->bias != NULL) add_bias(dtype, l, y, rows);
    return 0;
  }
  if (l->kind == LINEAR_GGUF && dtype == DTYPE_BFLOAT16 && rows > QGEMV_MAX_ROWS) {
    /* Deterministic (or AMX refused): the GEMV in chunks of its rows, rows independent. */
    const int64_t width = (int64_t)sizeof(uint16_t);
    for (int64_t r = 0; r < rows && status == 0; r += QGEMV_MAX_ROWS)
      status = gguf_gemv(dtype, (const char *)x + r * l->k * width, l->weight,
                         (char *)y + r * l->n_out * width,
                         rows - r < QGEMV_MAX_ROWS ? rows - r : QGEMV_MAX_ROWS, l->n_out, l->k,
                         threads);
    if (status == 0 && l->bias != NULL) add_bias(dtype, l, y, rows);
    return status;
  }
  if (l->kind == LINEAR_GGUF_A8) { /* any rows, rows independent: deterministic as it is */
    const int many = !deterministic && rows >= l->a8_gemm_min_rows;
    status = many ? gguf_gemm_a8(dtype, x, l->weight, y, rows, l->n_out, l->k, threads) : -1;
    if (status != 0)
      status = gguf_gemv_a8(dtype, x, l->weight, y, rows, l->n_out, l->k, threads, deterministic);
    /* a tiled weight has the GEMM only (its rows independent too) */
    if (status != 0 && !many)
      status = gguf_gemm_a8(dtype, x, l->weight, y, rows, l->n_out, l->k, threads);
    if (status == 0 && l->bias != NULL) add_bias(dtype, l, y, rows);
    return status;
  }
  const int int4 = l->kind == LINEAR_INT4 || l->kind == LINEAR_INT4_A8;
  const int q8 = l->kind == LINEAR_Q8_0;
  const int gguf = l->kind == LINEAR_GGUF;
  /* int4 with float x: the GEMM wins from 3 rows (its GEMV widens every weight for few rows). */
  int64_t gemv_rows = l->kind == LINEAR_INT4 && dtype == 0 ? INT4_FLOAT_GEMV_MAX_ROWS
                                                            : QGEMV_MAX_ROWS;
  /* Deterministic: one kernel for every row count. In float32 the quantized GEMM (its rows
   * are independent with row_independent; the GEMVs, faster for a row or two, sum in another
   * order); in bf16 the GEMVs (rows independent), the caller sending at most QGEMV_MAX_ROWS. */
  if (deterministic && dtype == 0) gemv_rows = 0;
  if (gguf && dtype == 0 && !deterministic) gemv_rows = GGUF_FLOAT_GEMV_MAX_ROWS;
  if ((int4 || q8 || gguf || l->kind == LINEAR_INT8) && rows > gemv_rows) {
    if (dtype != 0) return -1; /* quant_gemm takes float32 rows only; it adds the bias */
    const int kind = int4   ? QUANT_GEMM_INT4
                     : q8   ? QUANT_GEMM_Q8_0
                     : gguf ? QUANT_GEMM_GGUF
                            : QUANT_GEMM_INT8;
    return quant_gemm(kind, x, l->weight, l->scale, l->bias, y, rows, l->n_out, l->k, threads,
                      deterministic);
  }
  if (l->kind == LINEAR_INT8)
    status = int8_gemv(dtype, x, l->weight, l->scale, y, rows, l->n_out, l->k, threads);
  else if (q8)
    status = q8_gemv(dtype, x, l->weight, l->scale, y, rows, l->n_out, l->k, threads);
  else if (gguf)
    status = gguf_gemv(dtype, x, l->weight, y, rows, l->n_out, l->k, threads);
  else if (int4)
    status = int4_gemv(dtype, x, l->weight, l->scale, y, rows, l->n_out, l->k, threads,
                       l->kind == LINEAR_INT4_A8);
  else
    dense_gemv(dtype, x, l->weight, y, rows, l->n_out, l->k, threads);
  if (status == 0 && l->bias != NULL) add_bias(dtype, l, y, rows);
  return status;
}

/* Returns 0 on success, -1 when a buffer cannot be allocated or a kernel refuses (nothing about
 * the pool is then guaranteed: the caller fails the step). */
int decode_layers(int dtype, int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, int64_t inter, int act, float eps, float attn_scale,
                  int64_t n_layers, const layer_t *layers, void *residual,
                  const int64_t *positions, const float *cos0, const float *sin0,
                  const float *cos1, const float *sin1, const int64_t *out_slots,
                  const int64_t *table, int64_t table_stride, const int64_t *lens, int threads,
                  int deterministic) {
  if (rows < 1 || rows > NATIVE_MAX_ROWS) return -1;
  /* w4a8 rounds each GEMV row block's activations: not one kernel for every row count. */
  if (deterministic)
    for (int64_t l = 0; l < n_layers; l++)
      if (layers[l].qkv.kind == LINEAR_INT4_A8 || layers[l].o.kind == LINEAR_INT4_A8 ||
          layers[l].gate_up.kind == LINEAR_INT4_A8 || layers[l].down.kind == LINEAR_INT4_A8)
        return -1;
  sglite_in_native_step = 1;
  const size_t elem = dtype ? 2 : 4;
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim;
  void *x = malloc((size_t)(rows * hidden) * elem);
  void *qkv = malloc((size_t)(rows * qkv_width) * elem);
  void *attn = malloc((size_t)(rows * heads * head_dim) * elem);
  void *out = malloc((size_t)(rows * hidden) * elem);
  void *gate_up = malloc((size_t)(rows * 2 * inter) * elem);
  void *activated = malloc((size_t)(rows * inter) * elem);
  int status = (x && qkv && attn && out && gate_up && activated) ? 0 : -1;
  for (int64_t l = 0; l < n_layers && status == 0; l++) {
    const layer_t *layer = layers + l;
    if (l == 0)
      add_rms_norm(dtype, NULL, residual, layer->input_norm, x, rows, hidden, eps, threads);
    status = linear_rows(dtype, &layer->qkv, x, qkv, rows, threads, deterministic);
    if (status) break;
    if (layer->q_norm != NULL)
      head_rms_norm(dtype, qkv, rows, qkv_width, heads, kv_heads, head_dim, layer->q_norm,
                    layer->k_norm, eps, threads);
    rope_store_kv(dtype, qkv, rows, heads, kv_heads, head_dim, positions,
                  layer->rope ? cos1 : cos0, layer->rope ? sin1 : sin0, layer->k_cache,
                  layer->v_cache, out_slots, threads);
    status = paged_decode_attention(dtype, qkv, qkv_width, layer->k_cache, layer->v_cache,
                                    table, table_stride, lens, attn, rows, heads, kv_heads,
                                    head_dim, attn_scale, layer->window, threads);
    if (status) break;
    status = linear_rows(dtype, &layer->o, attn, out, rows, threads, deterministic);
    if (status) break;
    if (layer->attn_out_norm != NULL) /* in place: each row is read whole before it is written */
      add_rms_norm(dtype, NULL, out, layer->attn_out_norm, out, rows, hidden, eps, threads);
    add_rms_norm(dtype, out, residual, layer->post_norm, x, rows, hidden, eps, threads);
    status = gated_rows(dtype, act, &layer->gate_up, x, gate_up, activated, rows, inter, threads,
                        deterministic);
    if (status) break;
    status = linear_rows(dtype, &layer->down, activated, out, rows, threads, deterministic);
    if (status) break;
    if (layer->mlp_out_norm != NULL)
      add_rms_norm(dtype, NULL, out, layer->mlp_out_norm, out, rows, hidden, eps, threads);
    if (l + 1 < n_layers) {
      add_rms_norm(dtype, out, residual, layers[l + 1].input_norm, x, rows, hidden, eps, threads);
    } else {
      for (int64_t i = 0; i < rows * hidden; i++)
        store(residual, i, round_to(load(residual, i, dtype) + load(out, i, dtype), dtype),
              dtype);
    }
  }
  free(x);
  free(qkv);
  free(attn);
  free(out);
  free(gate_up);
  free(activated);
  sglite_in_native_step = 0;
  return status;
}

