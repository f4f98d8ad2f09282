/*
 * gguf_a8.c's products of one weight row against R x rows rounded to int8 for the blocks of 32
 * (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; with AVX-512 VNNI eight blocks at a time) and for Q5_0 rows in
 * quads (gguf_quads.h). Included by gguf_a8.c alone, after gguf_a8_kquant_rows.h (row_sums,
 * prefetch_ahead): every function is inlined into its row_products.
 */
#ifndef SGLITE_KERNELS_GGUF_A8_B32_ROWS_H
#define SGLITE_KERNELS_GGUF_A8_B32_ROWS_H
#include "gguf_a8_kquant_rows.h"
#include "gguf_quads.h"

#if defined(__AVX2__) && defined(__FMA__)
/* One block of 32 (group g) of one weight row against R x rows. */
static inline __attribute__((always_inline)) void b32_group(const int R, int64_t type,
                                                            const uint8_t *b, int64_t g,
                                                            const rounded_x *x, int64_t m0,
                                                            row_sums *s) {
  const int64_t k = x->k, groups = k / QK;
  float mn;
  const float d = b32_scale(type, b, &mn);
  __m256i q = b32_ints(type, b), sign = _mm256_setzero_si256();
  if (type == GGML_TYPE_Q8_0) { /* |q| times xq with q's sign */
    sign = q;
    q = _mm256_sign_epi8(sign, sign);
  }
  for (int m = 0; m < R; m++) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + (m0 + m) * k + g * QK));
    if (type == GGML_TYPE_Q8_0) xv = _mm256_sign_epi8(xv, sign);
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1));
    const int64_t i = (m0 + m) * groups + g;
    s->acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x->dx32[i]), s->acc[m]);
    s->off[m] += mn * x->dxsum32[i];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The scales d and the offsets per unit of xq (b32_scale's mn) of eight blocks of 32 from `b`
 * (`bytes` apart), as vectors: one gather of each block's first four bytes (d, and Q4_1/Q5_1's
 * min after it). */
static inline void b32_scales8(int64_t type, const uint8_t *b, int64_t bytes, __m256 *d,
                               __m256 *mn) {
  int32_t w[8];
  for (int i = 0; i < 8; i++) memcpy(&w[i], b + i * bytes, 4);
  const __m256i words = _mm256_loadu_si256((const __m256i *)w);
  *d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
  const float times = b32_offset_in_d(type);
  if (b32_has_min(type))
    *mn = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(words, 16)));
  else
    *mn = times != 0.0f ? _mm256_mul_ps(*d, _mm256_set1_ps(times)) : _mm256_setzero_ps();
}
#endif


/* Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) of one weight row against R x rows. With VNNI,
 * eight blocks at a time: their scales as vectors, and each two blocks' 64 integers against
 * 64 xq in one vpdpbusd, whose int32 lanes 0-7 and 8-15 are the two blocks' (the same integers
 * as the AVX2 path's); Q8_0's signed values as |q| times xq with q's sign. */
static inline __attribute__((always_inline)) void b32_row(const int R, const int prefetch,
                                                          int64_t type,
                                                          const uint8_t *row, const rounded_x *x,
                                                          int64_t m0, row_sums *s) {
  const int64_t k = x->k, groups = k / QK;
  const int64_t bytes = type_block_bytes(type);
  int64_t g = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[A8_ROWS];
  __m256 off[A8_ROWS];
  for (int m = 0; m < R; m++) {
    acc[m] = _mm512_setzero_ps();
    off[m] = _mm256_setzero_ps();
  }
  for (; g + 8 <= groups; g += 8) {
    const uint8_t *b = row + g * bytes;
    prefetch_ahead(prefetch, b, 5); /* eight blocks: at most 272 bytes */
    __m256 d, mn;
    b32_scales8(type, b, bytes, &d, &mn);
    __m512i w[4];
    __mmask64 negative[4] = {0, 0, 0, 0};
    for (int p = 0; p < 4; p++) {
      w[p] = b32_pair_ints(type, b + 2 * p * bytes, bytes);
      if (type == GGML_TYPE_Q8_0) {
        negative[p] = _mm512_movepi8_mask(w[p]);
        w[p] = _mm512_abs_epi8(w[p]);
      }
    }
    for (int m = 0; m < R; m++) {
      const int64_t i = (m0 + m) * groups + g;
      const __m512 scale = _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_loadu_ps(x->dx32 + i)));
      off[m] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(x->dxsum32 + i), off[m]);
      for (int p = 0; p < 4; p++) {
        __m512i xv = _mm512_loadu_si512((const void *)(x->q + (m0 + m) * k + (g + 2 * p) * QK));
        if (type == GGML_TYPE_Q8_0)
          xv = _mm512_mask_sub_epi8(xv, negative[p], _mm512_setzero_si512(), xv);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[p], xv);
        const __m512i pick = _mm512_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p,
                                               2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                               2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, scale),
                                 acc[m]);
      }
    }
  }
  for (int m = 0; m < R; m++) {
    s->acc[m] = _mm256_add_ps(s->acc[m], _mm256_add_ps(_mm512_castps512_ps256(acc[m]),
                                                       _mm512_extractf32x8_ps(acc[m], 1)));
    s->off[m] += hsum_ps(off[m]);
  }
#endif
  for (; g < groups; g++) {
    prefetch_ahead(prefetch, row + g * bytes, 1); /* at most 34 bytes */
    b32_group(R, type, row + g * bytes, g, x, m0, s);
  }
}

/* A Q5_0 row in quads (gguf_quads.h) against R x rows: each quad's four d times each x row's
 * scales as one vector (their offsets summed in four lanes), each pair of blocks' 64 integers
 * from one 32-byte load of nibbles and one 64-bit broadcast of fifth bits shifted per 64-bit
 * lane, a pair's two blocks summed into two accumulators per x row. */
static inline __attribute__((always_inline)) void q5_0_quads_row(const int R, const int prefetch,
                                                                 const uint8_t *row,
                                                                 const rounded_x *x, int64_t m0,
                                                                 row_sums *s) {
  const int64_t k = x->k, groups = k / QK;
  const __m256i nibble = _mm256_set1_epi8(0x0f), fifth = _mm256_set1_epi8(0x10);
  const __m256i right = _mm256_setr_epi64x(0, 1, 2, 3), left = _mm256_setr_epi64x(1, 2, 3, 4);
  __m256 second[A8_ROWS];
  __m128 off[A8_ROWS];
  for (int m = 0; m < R; m++) {
    second[m] = _mm256_setzero_ps();
    off[m] = _mm_setzero_ps();
  }
  for (int64_t g = 0; g < groups; g += 4) {
    const uint8_t *b = row + g / 4 * QUAD_BYTES;
    prefetch_ahead(prefetch, b, 2);
    int64_t halves;
    memcpy(&halves, b, 8);
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi64_si128(halves));
    const __m128 mn = _mm_mul_ps(d, _mm_set1_ps(-16.0f));
    float scale[A8_ROWS][4];
    for (int m = 0; m < R; m++) {
      const int64_t i = (m0 + m) * groups + g;
      _mm_storeu_ps(scale[m], _mm_mul_ps(d, _mm_loadu_ps(x->dx32 + i)));
      off[m] = _mm_fmadd_ps(mn, _mm_loadu_ps(x->dxsum32 + i), off[m]);
    }
    for (int p = 0; p < 2; p++) {
      const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 24 + 32 * p));
      int64_t word;
      memcpy(&word, b + 8 + 8 * p, 8);
      const __m256i h = _mm256_set1_epi64x(word);
      const __m256i qa =
          _mm256_or_si256(_mm256_and_si256(v, nibble),
                          _mm256_and_si256(_mm256_srlv_epi64(h, right), fifth));
      const __m256i qb =
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble),
                          _mm256_and_si256(_mm256_sllv_epi64(h, left), fifth));
      for (int m = 0; m < R; m++) {
        const int8_t *xq = x->q + (m0 + m) * k + (g + 2 * p) * QK;
        const __m256i ones = _mm256_set1_epi16(1);
        const __m256i da = _mm256_madd_epi16(
            _mm256_maddubs_epi16(qa, _mm256_loadu_si256((const __m256i *)xq)), ones);
        const __m256i db = _mm256_madd_epi16(
            _mm256_maddubs_epi16(qb, _mm256_loadu_si256((const __m256i *)(xq + QK))), ones);
        s->acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(da),
                                    _mm256_broadcast_ss(&scale[m][2 * p]), s->acc[m]);
        second[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(db),
                                    _mm256_broadcast_ss(&scale[m][2 * p + 1]), second[m]);
      }
    }
  }
  for (int m = 0; m < R; m++) {
    s->acc[m] = _mm256_add_ps(s->acc[m], second[m]);
    s->off_vec[m] = _mm_add_ps(s->off_vec[m], off[m]);
  }
}
#endif /* __AVX2__ && __FMA__ */
#endif
