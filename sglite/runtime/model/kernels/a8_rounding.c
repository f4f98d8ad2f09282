/* gguf_a8.c's activations rounded to int8 (see a8_rounding.h). */
#include "a8_rounding.h"

#include "common.h"

#define QK 32
#define QK_K 256

#if defined(__AVX2__)
/* The largest |x| of n values (n a multiple of 8), NaNs ignored as fmaxf ignores them: max_ps
 * returns its second operand when either is NaN. */
static float abs_max(const float *x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8)
    acc = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), magnitude), acc);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

/* q = lrintf(x * inv) for n values (n a multiple of 32): cvtps2dq rounds as lrintf does, to
 * nearest even in the default rounding mode; |x * inv| <= 127 packs without saturating. */
static void round_values(const float *x, int64_t n, float inv, int8_t *q) {
  const __m256 scale = _mm256_set1_ps(inv);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t j = 0; j < n; j += 32) {
    __m256i v[4];
    for (int i = 0; i < 4; i++)
      v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * i), scale));
    const __m256i bytes =
        _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(bytes, order));
  }
}
#else
static float abs_max(const float *x, int64_t n) {
  float amax = 0.0f;
  for (int64_t j = 0; j < n; j++) amax = fmaxf(amax, fabsf(x[j]));
  return amax;
}

static void round_values(const float *x, int64_t n, float inv, int8_t *q) {
  for (int64_t j = 0; j < n; j++) q[j] = (int8_t)lrintf(x[j] * inv);
}
#endif

void free_rounded(rounded_x *r) {
  free(r->q);
  free(r->dx);
  free(r->sum16);
  free(r->sum32);
  free(r->dx32);
  free(r->dxsum32);
  free(r->q_lanes);
}

#ifdef K4_LANES
/* Row q's super-blocks in K4_LANES order into out (see a8_rounding.h). */
static void lanes_row(const int8_t *q, int64_t k, int8_t *out) {
  for (int64_t sb = 0; sb < k / QK_K; sb++) {
    __m256i lo[4], hi[4];
    k4_lanes(q + sb * QK_K, 64, lo);
    k4_lanes(q + sb * QK_K + 32, 64, hi);
    for (int j = 0; j < 4; j++) {
      _mm256_storeu_si256((__m256i *)(out + sb * QK_K + 64 * j), lo[j]);
      _mm256_storeu_si256((__m256i *)(out + sb * QK_K + 64 * j + 32), hi[j]);
    }
  }
}
#endif

typedef struct {
  int dtype;
  const void *x;
  rounded_x *r;
  int failed;
} round_args;

/* Rows [m0, m1) of x rounded into r. */
static void round_rows(void *p, int64_t m0, int64_t m1) {
  round_args *a = p;
  rounded_x *r = a->r;
  const int64_t k = r->k, spans = k / r->span;
  float *xf = (float *)malloc((size_t)k * sizeof(float));
  if (xf == NULL) {
    a->failed = 1;
    return;
  }
  for (int64_t m = m0; m < m1; m++) {
    load_row(a->x, m * k, k, xf, a->dtype);
    int8_t *q = r->q + m * k;
    for (int64_t s = 0; s < spans; s++) {
      const float *xs = xf + s * r->span;
      const float amax = abs_max(xs, r->span);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      r->dx[m * spans + s] = amax / 127.0f;
      round_values(xs, r->span, inv, q + s * r->span);
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
#ifdef K4_LANES
    if (r->q_lanes != NULL) lanes_row(q, k, r->q_lanes + m * k);
#endif
  }
  free(xf);
}

/* x values below which rounding runs on the calling thread alone. */
#define ROUND_PARALLEL_MIN (1 << 16)

int round_x(int dtype, const void *x, int64_t rows, int64_t k, int threads, int lanes,
            rounded_x *r) {
  r->rows = rows;
  r->k = k;
  r->span = k % QK_K == 0 ? QK_K : QK;
  r->q = (int8_t *)malloc((size_t)(rows * k));
  r->dx = (float *)malloc((size_t)(rows * (k / r->span)) * sizeof(float));
  r->sum16 = (int16_t *)malloc((size_t)(rows * (k / 16)) * sizeof(int16_t));
  r->sum32 = (int16_t *)malloc((size_t)(rows * (k / QK)) * sizeof(int16_t));
  r->dx32 = (float *)malloc((size_t)(rows * (k / QK)) * sizeof(float));
  r->dxsum32 = (float *)malloc((size_t)(rows * (k / QK)) * sizeof(float));
  r->q_lanes = NULL;
#ifdef K4_LANES
  if (lanes && k % QK_K == 0 && (r->q_lanes = (int8_t *)malloc((size_t)(rows * k))) == NULL) {
    free_rounded(r);
    return -1;
  }
#else
  (void)lanes;
#endif
  if (!r->q || !r->dx || !r->sum16 || !r->sum32 || !r->dx32 || !r->dxsum32) {
    free_rounded(r);
    return -1;
  }
  round_args a = {dtype, x, r, 0};
  parallel_range(round_rows, &a, rows, 8, threads, rows * k >= ROUND_PARALLEL_MIN);
  if (a.failed) {
    free_rounded(r);
    return -1;
  }
  return 0;
}
