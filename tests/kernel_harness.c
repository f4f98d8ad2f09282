/*
 * Runs the kernels of kernels.h on fixed pseudo-random inputs and prints every output value,
 * one per line as "<case> <value>". tests/test_kernel_portability.py builds it for several
 * targets (the portable C path, this host's vector path, aarch64's NEON under qemu) and checks
 * that each prints what the portable C path prints, to float rounding.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static uint32_t seed = 12345;
static float next_float(void) { /* uniform in [-1, 1) */
  seed = seed * 1664525u + 1013904223u;
  return (float)(seed >> 8) / (float)(1 << 23) - 1.0f;
}
static void fill(float *x, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i++) x[i] = next_float() * scale;
}
static uint16_t to_bf16(float f) { /* truncation: any bf16 value will do as an input */
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static void as_bf16(const float *x, uint16_t *out, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = to_bf16(x[i]);
}
static void print(const char *name, const void *y, int64_t n, int dtype) {
  for (int64_t i = 0; i < n; i++)
    printf("%s %.7e\n", name,
           dtype ? from_bf16(((const uint16_t *)y)[i]) : (double)((const float *)y)[i]);
}

enum { ROWS = 3, DIM = 72, N = 40, K = 96, HEADS = 4, KV_HEADS = 2, HEAD_DIM = 64, SLOTS = 48 };
static const uint16_t F16_SCALES[] = {0x2800, 0x2C00, 0x3000}; /* 1/32, 1/16, 1/8 */
static const uint16_t F16_OFFSETS[] = {0xB400, 0xB800};         /* -1/4, -1/2 */

static void norms_and_activations(int dtype) {
  float x[ROWS * DIM], res[ROWS * DIM], w[DIM], gate_up[ROWS * 2 * DIM];
  fill(x, ROWS * DIM, 1.0f), fill(res, ROWS * DIM, 2.0f), fill(w, DIM, 1.0f);
  fill(gate_up, ROWS * 2 * DIM, 4.0f);
  uint16_t xb[ROWS * DIM], resb[ROWS * DIM], wb[DIM], gub[ROWS * 2 * DIM];
  as_bf16(x, xb, ROWS * DIM), as_bf16(res, resb, ROWS * DIM), as_bf16(w, wb, DIM);
  as_bf16(gate_up, gub, ROWS * 2 * DIM);
  float out[ROWS * 2 * DIM];
  add_rms_norm(dtype, dtype ? (void *)xb : x, dtype ? (void *)resb : res, dtype ? (void *)wb : w,
               out, ROWS, DIM, 1e-6f, 1);
  print(dtype ? "rms_norm_bf16" : "rms_norm", out, ROWS * DIM, dtype);
  print(dtype ? "residual_bf16" : "residual", dtype ? (void *)resb : res, ROWS * DIM, dtype);
  for (int act = ACT_SILU; act <= ACT_GELU_TANH; act++) {
    act_mul(dtype, act, dtype ? (void *)gub : gate_up, out, ROWS, DIM, 1);
    print(act == ACT_SILU ? (dtype ? "silu_bf16" : "silu") : (dtype ? "gelu_bf16" : "gelu"),
          out, ROWS * DIM, dtype);
  }
}

static void attention(int dtype) {
  const int64_t width = (HEADS + 2 * KV_HEADS) * HEAD_DIM;
  static float q[ROWS * (HEADS + 2 * KV_HEADS) * HEAD_DIM], k[SLOTS * KV_HEADS * HEAD_DIM],
      v[SLOTS * KV_HEADS * HEAD_DIM], out[ROWS * HEADS * HEAD_DIM];
  static uint16_t qb[sizeof(q) / 4], kb[sizeof(k) / 4], vb[sizeof(v) / 4];
  fill(q, ROWS * width, 1.0f), fill(k, SLOTS * KV_HEADS * HEAD_DIM, 1.0f);
  fill(v, SLOTS * KV_HEADS * HEAD_DIM, 1.0f);
  as_bf16(q, qb, ROWS * width), as_bf16(k, kb, SLOTS * KV_HEADS * HEAD_DIM);
  as_bf16(v, vb, SLOTS * KV_HEADS * HEAD_DIM);
  int64_t table[ROWS * 16], lens[ROWS] = {5, 16, 11};
  for (int64_t r = 0; r < ROWS; r++)
    for (int64_t j = 0; j < 16; j++) table[r * 16 + j] = (r * 7 + j * 3) % SLOTS;
  for (int64_t window = 0; window <= 4; window += 4) {
    paged_decode_attention(dtype, dtype ? (void *)qb : q, width, dtype ? (void *)kb : k,
                           dtype ? (void *)vb : v, table, 16, lens, out, ROWS, HEADS, KV_HEADS,
                           HEAD_DIM, 0.125f, window, 1);
    print(dtype ? "attention_bf16" : "attention", out, ROWS * HEADS * HEAD_DIM, dtype);
  }
}

static void products(int dtype) {
  float x[ROWS * K], w[N * K], bias[N], y[8 * N];
  fill(x, ROWS * K, 1.0f), fill(w, N * K, 0.5f), fill(bias, N, 1.0f);
  uint16_t xb[ROWS * K], wb[N * K];
  as_bf16(x, xb, ROWS * K), as_bf16(w, wb, N * K);
  const void *xs = dtype ? (void *)xb : x;
  if (dense_gemv_rows(dtype, xs, dtype ? (void *)wb : w, y, ROWS, N, K, 1) == 0)
    print(dtype ? "dense_gemv_bf16" : "dense_gemv", y, ROWS * N, dtype);
  int8_t q8[N * K];
  float scale[N];
  uint16_t scales16[N * K / 32], scale_offset[N * K / 32 * 2];
  uint8_t packed[N * K / 2];
  for (int64_t i = 0; i < N * K; i++) q8[i] = (int8_t)((int)(next_float() * 127.0f));
  for (int64_t n = 0; n < N; n++) scale[n] = 0.01f * (float)(1 + n % 5);
  for (int64_t g = 0; g < N * K / 32; g++) {
    scales16[g] = F16_SCALES[g % 3];
    scale_offset[2 * g] = F16_SCALES[(g + 1) % 3];
    scale_offset[2 * g + 1] = F16_OFFSETS[g % 2];
  }
  for (int64_t i = 0; i < N * K / 2; i++) packed[i] = (uint8_t)(seed = seed * 1664525u + 1);
  if (int8_gemv(dtype, xs, q8, scale, y, ROWS, N, K, 1) == 0)
    print(dtype ? "int8_gemv_bf16" : "int8_gemv", y, ROWS * N, dtype);
  if (q8_gemv(dtype, xs, q8, scales16, y, ROWS, N, K, 1) == 0)
    print(dtype ? "q8_gemv_bf16" : "q8_gemv", y, ROWS * N, dtype);
  if (int4_gemv(dtype, xs, packed, scale_offset, y, ROWS, N, K, 1, 0) == 0)
    print(dtype ? "int4_gemv_bf16" : "int4_gemv", y, ROWS * N, dtype);
  if (dtype) return; /* the GEMMs below take float32 rows */
  const void *weights[] = {q8, packed, q8};
  const void *scales[] = {scale, scale_offset, scales16};
  for (int kind = QUANT_GEMM_INT8; kind <= QUANT_GEMM_Q8_0; kind++)
    for (int independent = 0; independent <= 1; independent++)
      if (quant_gemm(kind, x, weights[kind - 1], scales[kind - 1], bias, y, ROWS, N, K, 1,
                     independent) == 0)
        print(independent ? "quant_gemm_rows" : "quant_gemm", y, ROWS * N, 0);
  const int64_t p = panel_width(), panels = (N + p - 1) / p;
  float *packed_panels = calloc((size_t)(panels * K * p), sizeof(float));
  for (int64_t n = 0; n < N; n++)
    for (int64_t i = 0; i < K; i++) packed_panels[(n / p) * K * p + i * p + n % p] = w[n * K + i];
  panel_gemm(x, packed_panels, bias, y, ROWS, N, K, 1);
  print("panel_gemm", y, ROWS * N, 0);
  free(packed_panels);
}

/* Random blocks of a GGUF type for `rows` rows of GK values: random bytes, with every f16
 * scale field set to a small finite value (random f16 bits would include NaNs). */
enum { GK = 256, GROWS = 12 };
static void gguf_blocks(int64_t type, uint8_t *data, int64_t rows) {
  const int64_t row_bytes = gguf_row_bytes(type, GK);
  for (int64_t i = 0; i < rows * row_bytes; i++) data[i] = (uint8_t)(seed = seed * 1664525u + 1);
  const int64_t per = type >= GGML_TYPE_Q4_K ? 256 : 32, block = row_bytes / (GK / per);
  for (int64_t b = 0; b < rows * (GK / per); b++) {
    uint8_t *blk = data + b * block;
    /* k-quants multiply d by 6- or 8-bit sub-scales: 2^-10 keeps weights near 1 */
    const uint16_t s = type >= GGML_TYPE_Q4_K ? 0x1400 : F16_SCALES[b % 3];
    const uint16_t o = F16_OFFSETS[b % 2];
    const int64_t at = type == GGML_TYPE_Q6_K ? 208 : 0; /* d's offset in the block */
    memcpy(blk + at, &s, 2);
    if (type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1 || type == GGML_TYPE_Q4_K ||
        type == GGML_TYPE_Q5_K)
      memcpy(blk + 2, type >= GGML_TYPE_Q4_K ? &s : &o, 2); /* min (or dmin) */
  }
}

static void gguf_products(int dtype) {
  static const int64_t types[] = {GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0,
                                  GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K,
                                  GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};
  static uint8_t data[8][GROWS * GK * 2]; /* Q8_0 takes 34 bytes per 32 values */
  static float x[ROWS * GK], y[ROWS * 2 * GROWS], dense[2 * GROWS * GK];
  uint16_t xb[ROWS * GK];
  fill(x, ROWS * GK, 1.0f);
  as_bf16(x, xb, ROWS * GK);
  const void *xs = dtype ? (void *)xb : x;
  for (int t = 0; t < 8; t++) {
    gguf_blocks(types[t], data[t], GROWS);
    /* Two parts of two types (as a fused projection): this one and the next. */
    const gguf_part_t parts[2] = {{types[t], GROWS, data[t]},
                                  {types[(t + 7) % 8], GROWS, data[(t + 7) % 8]}};
    const int64_t n = t == 0 ? GROWS : 2 * GROWS; /* t = 0: the next part is not made yet */
    if (gguf_gemv(dtype, xs, parts, y, ROWS, n, GK, 1) == 0)
      print(dtype ? "gguf_gemv_bf16" : "gguf_gemv", y, ROWS * n, dtype);
    if (gguf_gemv_a8(dtype, xs, parts, y, ROWS, n, GK, 1, 0) == 0)
      print(dtype ? "gguf_gemv_a8_bf16" : "gguf_gemv_a8", y, ROWS * n, dtype);
    if (gguf_dequantize(dtype, parts, NULL, n, n, GK, dense, 1) == 0)
      print(dtype ? "gguf_dequantize_bf16" : "gguf_dequantize", dense, n * GK, dtype);
    if (dtype == 0 && quant_gemm(QUANT_GEMM_GGUF, x, parts, NULL, NULL, y, ROWS, n, GK, 1, 0) == 0)
      print("gguf_gemm", y, ROWS * n, 0);
  }
}

int main(void) {
  printf("vec_width %lld\n", (long long)attention_vec_width());
  for (int dtype = DTYPE_FLOAT32; dtype <= DTYPE_BFLOAT16; dtype++) {
    norms_and_activations(dtype);
    attention(dtype);
    products(dtype);
    gguf_products(dtype);
  }
  return 0;
}
