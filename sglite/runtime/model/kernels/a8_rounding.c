/* gguf_a8.c's activations rounded to int8 (see a8_rounding.h). */
#include "a8_rounding.h"

#include "common.h"

#define QK 32
#define QK_K 256

void free_rounded(rounded_x *r) {
  free(r->q);
  free(r->dx);
  free(r->sum16);
  free(r->sum32);
  free(r->dx32);
  free(r->dxsum32);
}

int round_x(int dtype, const void *x, int64_t rows, int64_t k, rounded_x *r) {
  r->rows = rows;
  r->k = k;
  r->span = k % QK_K == 0 ? QK_K : QK;
  r->q = (int8_t *)malloc((size_t)(rows * k));
  r->dx = (float *)malloc((size_t)(rows * (k / r->span)) * sizeof(float));
  r->sum16 = (int16_t *)malloc((size_t)(rows * (k / 16)) * sizeof(int16_t));
  r->sum32 = (int16_t *)malloc((size_t)(rows * (k / QK)) * sizeof(int16_t));
  r->dx32 = (float *)malloc((size_t)(rows * (k / QK)) * sizeof(float));
  r->dxsum32 = (float *)malloc((size_t)(rows * (k / QK)) * sizeof(float));
  float *xf = (float *)malloc((size_t)k * sizeof(float));
  if (!r->q || !r->dx || !r->sum16 || !r->sum32 || !r->dx32 || !r->dxsum32 || !xf) {
    free(xf);
    free_rounded(r);
    return -1;
  }
  const int64_t spans = k / r->span;
  for (int64_t m = 0; m < rows; m++) {
    load_row(x, m * k, k, xf, dtype);
    int8_t *q = r->q + m * k;
    for (int64_t s = 0; s < spans; s++) {
      const float *xs = xf + s * r->span;
      float amax = 0.0f;
      for (int64_t j = 0; j < r->span; j++) amax = fmaxf(amax, fabsf(xs[j]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      r->dx[m * spans + s] = amax / 127.0f;
      for (int64_t j = 0; j < r->span; j++) q[s * r->span + j] = (int8_t)lrintf(xs[j] * inv);
    }
    for (int64_t g = 0; g < k / 16; g++) {
      int s = 0;
      for (int j = 0; j < 16; j++) s += q[16 * g + j];
      r->sum16[m * (k / 16) + g] = (int16_t)s;
    }
    for (int64_t g = 0; g < k / QK; g++) {
      const int64_t i = m * (k / QK) + g;
      r->sum32[i] = (int16_t)(r->sum16[m * (k / 16) + 2 * g] + r->sum16[m * (k / 16) + 2 * g + 1]);
      r->dx32[i] = r->dx[m * spans + g * QK / r->span];
      r->dxsum32[i] = r->dx32[i] * (float)r->sum32[i];
    }
  }
  free(xf);
  return 0;
}
