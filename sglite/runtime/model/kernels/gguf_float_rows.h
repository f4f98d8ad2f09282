/*
 * gguf_blocks.c's fused float products for AVX2 (its GEMV's few rows, `row_dot_fused`): a
 * weight row's blocks decoded in registers and multiplied by each x row at once, rather than
 * through the decoded span buffer. Included by gguf_blocks.c alone, after its block decoders.
 */
#ifndef SGLITE_KERNELS_GGUF_FLOAT_ROWS_H
#define SGLITE_KERNELS_GGUF_FLOAT_ROWS_H
#include "gguf_bits.h"

#define QK 32

#if defined(__AVX2__) && defined(__FMA__)
/*
 * Fused products for AVX2: a group's 32 values are assembled as signed bytes (every format's
 * integers fit: 0..31, or q - 8 / q - 16 / q - 32), widened to float, and multiplied by each x
 * row in one chain per group, which its scale then multiplies into the row's accumulator;
 * offsets (Q4_1, Q5_1, the k-quants' mins) add min * (sum of x over the group), from sums taken
 * once per call. A k-quant super-block's scales are decoded once, as vectors. The values and
 * products are those of the decoded buffer, summed in another order.
 */
#define ACC_CHAINS 2

/* x is permuted per group of 32 (permute_x_strided) so that vector j of a group holds values
 * 4i + j (i = 0..8): the order in which the dword lanes of 32 loaded bytes give them by shifts
 * alone (no shuffles, which compete for one or two ports). */
static void permute_x_strided(float *x, int64_t n) {
  float tmp[QK];
  for (int64_t g = 0; g + QK <= n; g += QK) {
    for (int j = 0; j < 4; j++)
      for (int i = 0; i < 8; i++) tmp[8 * j + i] = x[g + 4 * i + j];
    memcpy(x + g, tmp, sizeof(tmp));
  }
}

/* 32 signed bytes (values 0..31 in order) as floats in the strided order. */
static inline void widen32(__m256i q, __m256 w[4]) {
  w[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q, 24), 24));
  w[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q, 16), 24));
  w[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q, 8), 24));
  w[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(q, 24));
}

/* The low (shift 0) or high (shift 4) nibbles of 32 bytes as floats in the strided order. */
static inline void nibble_floats(__m256i packed, int shift, __m256 w[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0f);
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(packed, shift), mask));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(packed, 8 + shift), mask));
  w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(packed, 16 + shift), mask));
  w[3] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(packed, 24 + shift), mask));
}

/* acc[m][chain] += scale * (w . x_m) for 32 values; `scale` per lane (lanes 0-3 hold values
 * 0-15 of the group, lanes 4-7 values 16-31: Q6_K's two scales). */
static inline __attribute__((always_inline)) void dot32(const int R, const __m256 w[4],
                                                        __m256 scale, const float *x, int64_t k,
                                                        __m256 acc[][ACC_CHAINS], int chain) {
  for (int m = 0; m < R; m++) {
    const float *xm = x + m * k;
    const __m256 pa = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8),
                                      _mm256_mul_ps(w[0], _mm256_loadu_ps(xm)));
    const __m256 pb = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24),
                                      _mm256_mul_ps(w[2], _mm256_loadu_ps(xm + 16)));
    acc[m][chain] = _mm256_fmadd_ps(scale, _mm256_add_ps(pa, pb), acc[m][chain]);
  }
}

/* A Q4_K / Q5_K super-block's eight 6-bit scales and mins (see k_scale_min) as floats times
 * d and dmin: scale[0..8), min[0..8). */
static inline void k_scales(const uint8_t *b, float *scale, float *min) {
  uint32_t w[3];
  memcpy(w, b + 4, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, two = 0x03030303;
  const uint32_t sc[2] = {w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & two) << 4)};
  const uint32_t mn[2] = {w[1] & low6, ((w[2] >> 4) & low4) | (((w[1] >> 6) & two) << 4)};
  const __m128i s8 = _mm_set_epi32(0, 0, (int)sc[1], (int)sc[0]);
  const __m128i m8 = _mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]);
  _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(half(b)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s8))));
  _mm256_storeu_ps(min, _mm256_mul_ps(_mm256_set1_ps(half(b + 2)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m8))));
}

/* off[m] -= min[0..8) . xsum[m][0..8) (a super-block's offset part). */
static inline __attribute__((always_inline)) void k_offsets(const int R, const float *min,
                                                            const float *xsum, int64_t groups,
                                                            __m256 off[]) {
  const __m256 mv = _mm256_loadu_ps(min);
  for (int m = 0; m < R; m++)
    off[m] = _mm256_fnmadd_ps(mv, _mm256_loadu_ps(xsum + m * groups), off[m]);
}

static inline __attribute__((always_inline)) void q4k_q5k_row(const int R, const int five,
                                                              const uint8_t *row,
                                                              const float *xf,
                                                              const float *xsum, int64_t k,
                                                              __m256 acc[][ACC_CHAINS],
                                                              __m256 off[]) {
  const int64_t bytes = five ? 176 : 144, groups = k / QK;
  for (int64_t blk = 0; blk < k / QK_K; blk++) {
    const uint8_t *b = row + blk * bytes, *qs = b + (five ? 48 : 16);
    float scale[8], min[8];
    k_scales(b, scale, min);
    k_offsets(R, min, xsum + blk * 8, groups, off);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
      __m256 w[2][4];
      for (int h = 0; h < 2; h++) {
        if (five)
          widen32(_mm256_or_si256(h ? high4(packed) : low4(packed), byte_bits(qh, 2 * c + h, 1, 4)),
                  w[h]);
        else
          nibble_floats(packed, 4 * h, w[h]);
      }
      for (int h = 0; h < 2; h++)
        dot32(R, w[h], _mm256_broadcast_ss(scale + 2 * c + h), xf + blk * QK_K + 64 * c + 32 * h,
              k, acc, h);
    }
  }
}

static inline __attribute__((always_inline)) void q6k_row(const int R, const uint8_t *row,
                                                          const float *xf, int64_t k,
                                                          __m256 acc[][ACC_CHAINS]) {
  for (int64_t blk = 0; blk < k / QK_K; blk++) {
    const uint8_t *b = row + blk * 210;
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m256 d = _mm256_set1_ps(half(b + 208));
    float scale[16];
    _mm256_storeu_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))));
    _mm256_storeu_ps(scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                    _mm_unpackhi_epi64(sc8, sc8)))));
    for (int h = 0; h < 2; h++) {
      __m256i q[4];
      q6k_half(b, h, q);
      for (int s = 0; s < 4; s++) {
        __m256 w[4];
        widen32(q[s], w);
        const float *g = scale + 8 * h + 2 * s;
        const __m256 two = _mm256_set_m128(_mm_broadcast_ss(g + 1), _mm_broadcast_ss(g));
        dot32(R, w, two, xf + blk * QK_K + 128 * h + 32 * s, k, acc, s & 1);
      }
    }
  }
}

/* A block of 32 values of a 32-value type as signed bytes, its scale and its min (0 where the
 * format has none). */
static inline __m256i block32(int64_t type, const uint8_t *b, float *min) {
  *min = 0.0f;
  switch (type) {
    case GGML_TYPE_Q4_0:
      return _mm256_sub_epi8(nibble_bytes(b + 2), _mm256_set1_epi8(8));
    case GGML_TYPE_Q4_1:
      *min = half(b + 2);
      return nibble_bytes(b + 4);
    case GGML_TYPE_Q5_0: {
      uint32_t high;
      memcpy(&high, b + 2, 4);
      const __m256i q = _mm256_or_si256(nibble_bytes(b + 6), bits_to_0x10(high));
      return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    }
    default: { /* Q5_1 */
      uint32_t high;
      memcpy(&high, b + 4, 4);
      *min = half(b + 2);
      return _mm256_or_si256(nibble_bytes(b + 8), bits_to_0x10(high));
    }
  }
}

static inline __attribute__((always_inline)) void q8_0_row(const int R, const uint8_t *row,
                                                           const float *xf, int64_t k,
                                                           __m256 acc[][ACC_CHAINS]) {
  for (int64_t g = 0; g < k / QK; g++) {
    const uint8_t *b = row + g * 34;
    __m256 w[4];
    widen32(_mm256_loadu_si256((const __m256i *)(b + 2)), w);
    dot32(R, w, _mm256_set1_ps(half(b)), xf + g * QK, k, acc, (int)(g & 1));
  }
}

static inline __attribute__((always_inline)) void block32_row(const int R, int64_t type,
                                                              const uint8_t *row,
                                                              const float *xf,
                                                              const float *xsum, int64_t k,
                                                              __m256 acc[][ACC_CHAINS],
                                                              float *off) {
  const int64_t bytes = type_block_bytes(type), groups = k / QK;
  for (int64_t g = 0; g < groups; g++) {
    float mn;
    const __m256i q = block32(type, row + g * bytes, &mn);
    __m256 w[4];
    widen32(q, w);
    dot32(R, w, _mm256_set1_ps(half(row + g * bytes)), xf + g * QK, k, acc, (int)(g & 1));
    for (int m = 0; m < R; m++) off[m] += mn * xsum[m * groups + g];
  }
}

static inline __attribute__((always_inline)) void row_dot_fused(const int R, int64_t type,
                                                                const uint8_t *row,
                                                                const float *xf,
                                                                const float *xsum, int64_t k,
                                                                float *out) {
  __m256 acc[QGEMV_MAX_ROWS][ACC_CHAINS], off_v[QGEMV_MAX_ROWS];
  float off[QGEMV_MAX_ROWS];
  for (int m = 0; m < R; m++) {
    acc[m][0] = acc[m][1] = off_v[m] = _mm256_setzero_ps();
    off[m] = 0.0f;
  }
  if (type == GGML_TYPE_Q4_K)
    q4k_q5k_row(R, 0, row, xf, xsum, k, acc, off_v);
  else if (type == GGML_TYPE_Q5_K)
    q4k_q5k_row(R, 1, row, xf, xsum, k, acc, off_v);
  else if (type == GGML_TYPE_Q6_K)
    q6k_row(R, row, xf, k, acc);
  else if (type == GGML_TYPE_Q8_0)
    q8_0_row(R, row, xf, k, acc);
  else
    block32_row(R, type, row, xf, xsum, k, acc, off);
  for (int m = 0; m < R; m++)
    out[m] = sum256(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), off_v[m])) + off[m];
}
#endif /* AVX2 and FMA */
#endif
