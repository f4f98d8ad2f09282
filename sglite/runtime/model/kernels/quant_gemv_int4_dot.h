/*
 * quant_gemv.c's int4 products in integers (w4a8: x rounded to int8 per group of 32): with VNNI,
 * one `vpdpbusd` per pair of groups (int4_block_vnni); on AVX2, `vpmaddubsw` on pairs of groups
 * interleaved (int4_block_avx2); and x's rounding laid out for them (quantize_x_groups).
 * Defines INT4_INTEGER_DOT where a build has one (and INT4_PAIR_INTERLEAVED on AVX2) and
 * INT4_VNNI_SPECIAL(R), each row count's function. Included by quant_gemv.c alone, after its
 * float paths (Q4_GROUP, store, vsum).
 */
#ifndef SGLITE_KERNELS_QUANT_GEMV_INT4_DOT_H
#define SGLITE_KERNELS_QUANT_GEMV_INT4_DOT_H
#include "common.h"

#ifdef __AVX512VNNI__
/*
 * int4 with VNNI: x is quantized per group of 32 to int8 (xq, scale dx), and each pair of
 * groups takes one `vpdpbusd` (4-bit weights as unsigned bytes times xq), so the weights are
 * never widened to float: W x = sum_g s_g dx_g (q . xq)_g + sum_g offset_g (sum of x over g).
 * `dxx[m][pair]` holds (dx of group 2p) x 8 then (dx of group 2p + 1) x 8. Needs an even group
 * count (the caller checks).
 */
static inline __attribute__((always_inline)) void int4_block_vnni(
    const int R, int dtype, const int8_t *xq, const float *dxx, const float *xsum2,
    const uint8_t *packed, const uint16_t *scale_offset, void *y, int64_t n0, int64_t n1,
    int64_t n_out, int64_t k) {
  const int64_t groups = k / Q4_GROUP, pairs = groups / 2, halves = 2 * groups;
  float so[halves + 16];
  const __m512i pick_scales = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i mask = _mm256_set1_epi8(0x0f);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t *pn = packed + n * (k / 2);
    const uint16_t *son = scale_offset + n * halves;
    /* Widen the row's (scale, offset) pairs; the offset part of every x row is one dot product
     * of them with xsum2 = (0, sum of x over group g) pairs. */
    __m512 offacc[QGEMV_MAX_ROWS];
    for (int m = 0; m < R; m++) offacc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < halves; c += 16) {
      const __mmask16 valid = halves - c >= 16 ? 0xffff : (__mmask16)((1u << (halves - c)) - 1);
      const __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, son + c));
      _mm512_storeu_ps(so + c, v);
      for (int m = 0; m < R; m++)
        offacc[m] = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(valid, xsum2 + m * halves + c),
                                    offacc[m]);
    }
    __m512 acc[QGEMV_MAX_ROWS][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
      const __m256i bytes = _mm256_loadu_si256((const __m256i *)(pn + p * Q4_GROUP));
      const __m256i low = _mm256_and_si256(bytes, mask);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
      __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
      w = _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0));
      const __m512 s =
          _mm512_permutexvar_ps(pick_scales, _mm512_castps128_ps512(_mm_loadu_ps(so + 4 * p)));
      const int a = (int)(p & 1);
      for (int m = 0; m < R; m++) {
        const __m512i xv = _mm512_loadu_si512((const void *)(xq + m * k + p * 2 * Q4_GROUP));
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
        const __m512 scale = _mm512_mul_ps(s, _mm512_loadu_ps(dxx + (m * pairs + p) * 16));
        acc[m][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[m][a]);
      }
    }
    for (int m = 0; m < R; m++) {
      const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), offacc[m]);
      store(y, m * n_out + n, _mm512_reduce_add_ps(total), dtype);
    }
  }
}
#define INT4_VNNI_SPECIAL(R)                                                                  \
  static void int4_vnni_rows##R(int dtype, const int8_t *xq, const float *dxx,               \
                                const float *xsum, const uint8_t *p, const uint16_t *so,     \
                                void *y, int64_t n0, int64_t n1, int64_t n_out, int64_t k) { \
    int4_block_vnni(R, dtype, xq, dxx, xsum, p, so, y, n0, n1, n_out, k);                     \
  }
#endif

#if !defined(__AVX512VNNI__) && VEC == 8
#define INT4_INTEGER_DOT 1
#define INT4_PAIR_INTERLEAVED 1
/*
 * int4 on AVX2, with the arithmetic of int4_block_vnni one pair of groups at a time: the 32
 * bytes of a pair give the low nibbles of both groups (values 0-15 of each) and the high nibbles
 * (values 16-31), which meet xq stored pair-interleaved to match (quantize_x_groups):
 * `vpmaddubsw` (4-bit weights as unsigned bytes times xq, pairs of products in int16), the low
 * and high halves added in int16 (at most 4 x 15 x 127, no saturation), `vpmaddwd` with ones,
 * then one float FMA per pair scaled by (s_g dx_g) for group g in each 128-bit lane.
 * `sv` holds the row's scales as (s of group 2p) x 4 then (s of group 2p + 1) x 4 per pair, and
 * `dxv[m][pair]` the x scales the same way.
 */
static inline __attribute__((always_inline)) void int4_pair_avx2(
    const int R, __m256 acc[][3], const int a, int64_t p, const uint8_t *pn, const float *sv,
    const int8_t *xq, const float *dxv, int64_t pairs, int64_t k, __m256i mask, __m256i ones) {
  const __m256i bytes = _mm256_loadu_si256((const __m256i *)(pn + p * Q4_GROUP));
  const __m256i low = _mm256_and_si256(bytes, mask);
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
  const __m256 s = _mm256_loadu_ps(sv + 8 * p);
  for (int m = 0; m < R; m++) {
    const int8_t *xp = xq + m * k + p * 2 * Q4_GROUP;
    const __m256i lo = _mm256_maddubs_epi16(low, _mm256_loadu_si256((const __m256i *)xp));
    const __m256i hi =
        _mm256_maddubs_epi16(high, _mm256_loadu_si256((const __m256i *)(xp + Q4_GROUP)));
    const __m256i dot = _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones);
    const __m256 scale = _mm256_mul_ps(s, _mm256_loadu_ps(dxv + (m * pairs + p) * 8));
    acc[m][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m][a]);
  }
}

static inline __attribute__((always_inline)) void int4_block_avx2(
    const int R, int dtype, const int8_t *xq, const float *dxv, const float *xsum2,
    const uint8_t *packed, const uint16_t *scale_offset, void *y, int64_t n0, int64_t n1,
    int64_t n_out, int64_t k) {
  const int64_t groups = k / Q4_GROUP, pairs = groups / 2, halves = 2 * groups;
  float sv[pairs * 8];
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i first_pair = _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0);
  const __m256i second_pair = _mm256_set_epi32(6, 6, 6, 6, 4, 4, 4, 4);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t *pn = packed + n * (k / 2);
    const uint16_t *son = scale_offset + n * halves;
    if (n + PREFETCH_ROWS < n1) {
      prefetch_bytes(pn + PREFETCH_ROWS * (k / 2), k / 2);
      prefetch_bytes(son + PREFETCH_ROWS * halves, halves * 2);
    }
    /* Chains 0 and 1 take alternate pairs, chain 2 the offsets. */
    __m256 acc[QGEMV_MAX_ROWS][3];
    for (int m = 0; m < R; m++)
      for (int c = 0; c < 3; c++) acc[m][c] = _mm256_setzero_ps();
    /* Widen the (scale, offset) pairs of two pairs of groups at a time into sv; the offset part
     * (their dot product with xsum2) goes into chain 2 as vectors. */
    float off[QGEMV_MAX_ROWS] = {0};
    int64_t c = 0;
    for (; c + 8 <= halves; c += 8) {
      const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(son + c)));
      _mm256_storeu_ps(sv + 2 * c, _mm256_permutevar8x32_ps(v, first_pair));
      _mm256_storeu_ps(sv + 2 * c + 8, _mm256_permutevar8x32_ps(v, second_pair));
      for (int m = 0; m < R; m++)
        acc[m][2] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xsum2 + m * halves + c), acc[m][2]);
    }
    if (c < halves) { /* one pair left: the group count is even, so halves % 4 == 0 */
      float t[4];
      for (int j = 0; j < 4; j++) {
        t[j] = f16_to_f32(son[c + j]);
        for (int m = 0; m < R; m++) off[m] += t[j] * xsum2[m * halves + c + j];
      }
      for (int j = 0; j < 4; j++) {
        sv[2 * c + j] = t[0];
        sv[2 * c + 4 + j] = t[2];
      }
    }
    int64_t p = 0;
    if (R <= 4)
      for (; p + 2 <= pairs; p += 2)
        for (int a = 0; a < 2; a++)
          int4_pair_avx2(R, acc, a, p + a, pn, sv, xq, dxv, pairs, k, mask, ones);
    for (; p < pairs; p++) int4_pair_avx2(R, acc, 0, p, pn, sv, xq, dxv, pairs, k, mask, ones);
    for (int m = 0; m < R; m++) {
      const __m256 total = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), acc[m][2]);
      store(y, m * n_out + n, vsum(total) + off[m], dtype);
    }
  }
}
#define INT4_VNNI_SPECIAL(R)                                                                  \
  static void int4_vnni_rows##R(int dtype, const int8_t *xq, const float *dxx,               \
                                const float *xsum, const uint8_t *p, const uint16_t *so,     \
                                void *y, int64_t n0, int64_t n1, int64_t n_out, int64_t k) { \
    int4_block_avx2(R, dtype, xq, dxx, xsum, p, so, y, n0, n1, n_out, k);                     \
  }
#elif defined(__AVX512VNNI__)
#define INT4_INTEGER_DOT 1
#endif

#ifdef INT4_INTEGER_DOT
/*
 * Per group of 32: xq = round(x / dx) with dx = max|x| / 127; xq and dxx laid out as this
 * build's int4 kernel wants (pair-interleaved on AVX2: see int4_block_avx2).
 * Fills the c_g slots of the (0, sum of x over g) pairs in xsum2; the (c_g, sum) pairs meet the
 * (scale, offset) pairs in one dot product, with
 * c_g = 8 (sum x - dx sum xq): that moves the integer part to (q - 8) xq, whose rounding error
 * is half that of q xq, and keeps the rest exact: W x = sum s dx (q - 8).xq + sum (o + 8 s) sum x.
 */
static void quantize_x_groups(const float *xf, float *xsum2, int64_t rows, int64_t k,
                              int8_t *xq, float *dxx) {
  const int64_t groups = k / Q4_GROUP, pairs = groups / 2;
  for (int64_t m = 0; m < rows; m++)
    for (int64_t g = 0; g < groups; g++) {
      const float *xg = xf + m * k + g * Q4_GROUP;
      float amax = 0.0f;
      for (int64_t j = 0; j < Q4_GROUP; j++) amax = fmaxf(amax, fabsf(xg[j]));
      const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t qsum = 0;
      for (int64_t j = 0; j < Q4_GROUP; j++) {
        const int8_t v = (int8_t)lrintf(xg[j] * inv);
#ifdef INT4_PAIR_INTERLEAVED
        /* Pair p: values 0-15 of groups 2p and 2p + 1, then values 16-31 of both. */
        const int64_t at = (g / 2) * 2 * Q4_GROUP + (j / 16) * Q4_GROUP + (g % 2) * 16 + j % 16;
#else
        const int64_t at = g * Q4_GROUP + j;
#endif
        xq[m * k + at] = v;
        qsum += v;
      }
#ifdef INT4_PAIR_INTERLEAVED
      float *dst = dxx + (m * pairs + g / 2) * 8 + (g % 2) * 4;
      for (int j = 0; j < 4; j++) dst[j] = dx;
#else
      float *dst = dxx + (m * pairs + g / 2) * 16 + (g % 2) * 8;
      for (int j = 0; j < 8; j++) dst[j] = dx;
#endif
      const float sum = xsum2[m * 2 * groups + 2 * g + 1]; /* in place: the c_g slot was 0 */
      xsum2[m * 2 * groups + 2 * g] = 8.0f * (sum - dx * (float)qsum);
    }
}
#endif
#endif
