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

#define QGEMV_MAX_ROWS 8
/* Rows decode_layers takes (quantized layers in bf16: at most QGEMV_MAX_ROWS; the caller
 * picks). */
#define NATIVE_MAX_ROWS 256

__thread int sglite_in_native_step = 0;

/* LINEAR_INT4_A8: int4 weights whose GEMVs round x to int8 (w4a8; quant_gemv.c). */
/* float32 int4 (float x) rows the GEMV takes: from 3 rows quant_gemm was 1.05-1.5x faster
 * (30 layers of the default model's shapes, AVX2). Keep in step with quantization.py. */
#define INT4_FLOAT_GEMV_MAX_ROWS 2
enum {
  LINEAR_DENSE = 0,
  LINEAR_INT8 = 1,
  LINEAR_INT4 = 2,
  LINEAR_PANELS = 3,
  LINEAR_INT4_A8 = 4,
  LINEAR_Q8_0 = 5 /* GGUF Q8_0 layout: int8 values, an f16 scale per 32 inputs */
};
/* quant_gemm's kind for GGUF Q8_0 weights (quant_gemm.c). */
#define QUANT_GEMM_Q8_0 3

typedef struct {
  int64_t kind;  /* LINEAR_* */
  int64_t n_out, k;
  const void *weight; /* dense: [n_out, k] dtype; int8: int8 values; int4: packed nibbles;
                         panels: float32 as panel_gemm reads them */
  const void *scale;  /* int8: float32 [n_out]; int4: f16 (scale, offset) pairs; q8_0: f16
                         [n_out, k / 32]; else NULL */
  const void *bias;   /* dtype [n_out] or NULL */
} linear_t;

typedef struct {
  const void *input_norm, *post_norm; /* dtype [hidden]: before attention, before the MLP */
  const void *attn_out_norm, *mlp_out_norm; /* dtype [hidden] on the attention / MLP output,
                                               or NULL (only Gemma 3 has them) */
  const void *q_norm, *k_norm;              /* dtype [head_dim] per-head norms, or NULL */
  linear_t qkv, o, gate_up, down;
  void *k_cache, *v_cache; /* [slots, kv_heads, head_dim] dtype */
  int64_t window;          /* sliding window, 0 = full attention */
  int64_t rope;            /* the RoPE table pair it rotates with: 0 global, 1 local */
} layer_t;

void panel_gemm(const float *x, const float *panels, const float *bias, float *y, int64_t rows,
                int64_t n_out, int64_t k, int threads);
int int8_gemv(int dtype, const void *x, const int8_t *q, const float *scale, void *y,
              int64_t rows, int64_t n_out, int64_t k, int threads);
int quant_gemm(int kind, const float *x, const void *weight, const void *scale,
               const float *bias, float *y, int64_t rows, int64_t n_out, int64_t k, int threads);
int int4_gemv(int dtype, const void *x, const uint8_t *packed, const uint16_t *scale_offset,
              void *y, int64_t rows, int64_t n_out, int64_t k, int threads, int round_x);
int q8_gemv(int dtype, const void *x, const int8_t *q, const uint16_t *scales, void *y,
            int64_t rows, int64_t n_out, int64_t k, int threads);
void add_rms_norm(int dtype, const void *x, void *residual, const void *weight, void *out,
                  int64_t rows, int64_t dim, float eps, int threads);
void act_mul(int dtype, int act, const void *gate_up, void *out, int64_t rows, int64_t inter,
             int threads);
void head_rms_norm(int dtype, void *qkv, int64_t tokens, int64_t width, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, const void *q_weight, const void *k_weight,
                   float eps, int threads);
void rope_store_kv(int dtype, void *qkv, int64_t tokens, int64_t heads, int64_t kv_heads,
                   int64_t head_dim, const int64_t *positions, const float *cos_table,
                   const float *sin_table, void *k_cache, void *v_cache,
                   const int64_t *out_slots, int threads);
void paged_decode_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, const int64_t *table, int64_t table_stride,
                            const int64_t *lens, void *out, int64_t rows, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                            int threads);

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

static int linear_rows(int dtype, const linear_t *l, const void *x, void *y, int64_t rows,
                       int threads) {
  int status = 0;
  if (l->kind == LINEAR_PANELS) { /* adds the bias itself */
    if (dtype != 0) return -1;      /* panels are float32 only */
    panel_gemm(x, l->weight, l->bias, y, rows, l->n_out, l->k, threads);
    return 0;
  }
  const int int4 = l->kind == LINEAR_INT4 || l->kind == LINEAR_INT4_A8;
  const int q8 = l->kind == LINEAR_Q8_0;
  /* int4 with float x: the GEMM wins from 3 rows (its GEMV widens every weight for few rows). */
  const int64_t gemv_rows = l->kind == LINEAR_INT4 && dtype == 0 ? INT4_FLOAT_GEMV_MAX_ROWS
                                                                  : QGEMV_MAX_ROWS;
  if ((int4 || q8 || l->kind == LINEAR_INT8) && rows > gemv_rows) {
    if (dtype != 0) return -1; /* quant_gemm takes float32 rows only; it adds the bias */
    const int kind = int4 ? LINEAR_INT4 : q8 ? QUANT_GEMM_Q8_0 : LINEAR_INT8;
    return quant_gemm(kind, x, l->weight, l->scale, l->bias, y, rows, l->n_out, l->k, threads);
  }
  if (l->kind == LINEAR_INT8)
    status = int8_gemv(dtype, x, l->weight, l->scale, y, rows, l->n_out, l->k, threads);
  else if (q8)
    status = q8_gemv(dtype, x, l->weight, l->scale, y, rows, l->n_out, l->k, threads);
  else if (int4)
    status = int4_gemv(dtype, x, l->weight, l->scale, y, rows, l->n_out, l->k, threads,
                       l->kind == LINEAR_INT4_A8);
  else
    dense_gemv(dtype, x, l->weight, y, rows, l->n_out, l->k, threads);
  if (status == 0 && l->bias != NULL)
    for (int64_t m = 0; m < rows; m++)
      for (int64_t n = 0; n < l->n_out; n++)
        store(y, m * l->n_out + n, load(y, m * l->n_out + n, dtype) + load(l->bias, n, dtype),
              dtype);
  return status;
}

/* Returns 0 on success, -1 when a buffer cannot be allocated or a kernel refuses (nothing about
 * the pool is then guaranteed: the caller fails the step). */
int decode_layers(int dtype, int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, int64_t inter, int act, float eps, float attn_scale,
                  int64_t n_layers, const layer_t *layers, void *residual,
                  const int64_t *positions, const float *cos0, const float *sin0,
                  const float *cos1, const float *sin1, const int64_t *out_slots,
                  const int64_t *table, int64_t table_stride, const int64_t *lens, int threads) {
  if (rows < 1 || rows > NATIVE_MAX_ROWS) return -1;
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
    status = linear_rows(dtype, &layer->qkv, x, qkv, rows, threads);
    if (status) break;
    if (layer->q_norm != NULL)
      head_rms_norm(dtype, qkv, rows, qkv_width, heads, kv_heads, head_dim, layer->q_norm,
                    layer->k_norm, eps, threads);
    rope_store_kv(dtype, qkv, rows, heads, kv_heads, head_dim, positions,
                  layer->rope ? cos1 : cos0, layer->rope ? sin1 : sin0, layer->k_cache,
                  layer->v_cache, out_slots, threads);
    paged_decode_attention(dtype, qkv, qkv_width, layer->k_cache, layer->v_cache, table,
                           table_stride, lens, attn, rows, heads, kv_heads, head_dim, attn_scale,
                           layer->window, threads);
    status = linear_rows(dtype, &layer->o, attn, out, rows, threads);
    if (status) break;
    if (layer->attn_out_norm != NULL) /* in place: each row is read whole before it is written */
      add_rms_norm(dtype, NULL, out, layer->attn_out_norm, out, rows, hidden, eps, threads);
    add_rms_norm(dtype, out, residual, layer->post_norm, x, rows, hidden, eps, threads);
    status = linear_rows(dtype, &layer->gate_up, x, gate_up, rows, threads);
    if (status) break;
    act_mul(dtype, act, gate_up, activated, rows, inter, threads);
    status = linear_rows(dtype, &layer->down, activated, out, rows, threads);
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

int64_t native_decode_max_rows(void) { return NATIVE_MAX_ROWS; }
