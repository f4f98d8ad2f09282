/*
 * gguf_a8_kquant_rows.h's Q4_K products with each 32-bit lane tied to a group of the
 * super-block (K4_LANES builds, a8_rounding.h: x rows rounded in that order): a super-block's
 * scales as multipliers of its lane-tied sums (k4_lane_scales) and one weight row's super-blocks
 * against R x rows (k4_row_lanes), with VNNI where the build has it (K4_LANES_VNNI). Included by
 * gguf_a8_kquant_rows.h alone, after the helpers it shares (add_madd16, spread_int16,
 * k4_add_block, prefetch_ahead).
 */
#ifndef SGLITE_KERNELS_GGUF_A8_K4_LANES_H
#define SGLITE_KERNELS_GGUF_A8_K4_LANES_H

#ifdef K4_LANES
/* A Q4_K super-block's scales as multipliers of its lane-tied sums (lane l: group 2 (l % 4) in
 * `even`, 2 (l % 4) + 1 in `odd`): int32 lanes for VNNI's vpmulld, else int16 lanes (both halves
 * of a 32-bit lane the same) for vpmaddwd; its mins as int16 (k4_add_block's `mn16`). */
static inline __attribute__((always_inline)) void k4_lane_scales(const uint8_t *b, __m256i *even,
                                                                 __m256i *odd, __m128i *mn16) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m128i scales_mins = k_scales16(b + 4);
#else /* on the integer units, where AVX2's vector units are this kernel's bound */
  uint32_t sc[2], mn[2];
  k_scales8(b + 4, sc, mn);
  const __m128i scales_mins = _mm_set_epi32((int)mn[1], (int)mn[0], (int)sc[1], (int)sc[0]);
#endif
  *mn16 = _mm_cvtepu8_epi16(_mm_srli_si128(scales_mins, 8));
#ifdef K4_LANES_VNNI
  *even = _mm256_cvtepu8_epi32(
      _mm_shuffle_epi8(scales_mins, _mm_setr_epi8(0, 2, 4, 6, 0, 2, 4, 6, -1, -1, -1, -1, -1, -1,
                                                  -1, -1)));
  *odd = _mm256_cvtepu8_epi32(
      _mm_shuffle_epi8(scales_mins, _mm_setr_epi8(1, 3, 5, 7, 1, 3, 5, 7, -1, -1, -1, -1, -1, -1,
                                                  -1, -1)));
#else
  *even = _mm256_cvtepu8_epi16(
      _mm_shuffle_epi8(scales_mins, _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 0, 0, 2, 2, 4, 4, 6, 6)));
  *odd = _mm256_cvtepu8_epi16(
      _mm_shuffle_epi8(scales_mins, _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 1, 1, 3, 3, 5, 5, 7, 7)));
#endif
}

/* Q4_K super-blocks of one weight row against R x rows with each 32-bit lane tied to a group
 * (K4_LANES): the nibble bytes transposed as x->q_lanes is, so a lane's products add up to its
 * group's sum and the groups' 6-bit scales multiply those sums once per super-block, where
 * k4_k5_row scales every 32 values' products for every x row. With VNNI one vpdpbusd per 32
 * values, the scales by vpmulld; on AVX2 one vpmaddubsw per 32 values, the four of the low (or
 * high) nibbles summed in int16 (a lane's 8 products of at most 15 x 127: no overflow), then
 * one vpmaddwd with the scales: 10 multiplies per super-block and x row where k4_k5_row takes
 * 16. The same integers per super-block; its float sums differ in rounding. */
static inline __attribute__((always_inline)) void k4_row_lanes(const int R, const int prefetch,
                                                               const uint8_t *row,
                                                               const rounded_x *x, int64_t m0,
                                                               row_sums *s) {
  const int64_t k = x->k, blocks = k / QK_K;
  const __m256i nibble = _mm256_set1_epi8(0x0f);
#ifndef K4_LANES_VNNI
  /* s's sums as locals over the super-blocks: acc[m], and off_vec of rows 2i and 2i + 1 as the
   * halves of off[i] (an odd last row's in off_last) */
  __m256 acc[A8_ROWS], off[A8_ROWS / 2];
  __m128 off_last = R % 2 ? s->off_vec[R - 1] : _mm_setzero_ps();
  for (int m = 0; m < R; m++) acc[m] = s->acc[m];
  for (int m = 0; m + 1 < R; m += 2) off[m / 2] = _mm256_set_m128(s->off_vec[m + 1], s->off_vec[m]);
#endif
  for (int64_t blk = 0; blk < blocks; blk++) {
    const uint8_t *b = row + blk * 144;
    prefetch_ahead(prefetch, b, 3); /* 144 bytes */
    __m256i s_lo, s_hi;
    __m128i mn16;
    k4_lane_scales(b, &s_lo, &s_hi, &mn16);
    __m256i t[4];
    k4_lanes(b + 16, 32, t);
    int32_t dd_bits;
    memcpy(&dd_bits, b, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(dd_bits)); /* d, dmin: one conversion */
#ifdef K4_LANES_VNNI
    __m256i lo[4], hi[4];
    for (int j = 0; j < 4; j++) {
      lo[j] = _mm256_and_si256(t[j], nibble);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(t[j], 4), nibble);
    }
    for (int m = 0; m < R; m++) {
      const int8_t *xq = x->q_lanes + (m0 + m) * k + blk * QK_K;
      __m256i sum_lo = _mm256_setzero_si256(), sum_hi = _mm256_setzero_si256();
      for (int j = 0; j < 4; j++) {
        sum_lo =
            _mm256_dpbusd_epi32(sum_lo, lo[j], _mm256_loadu_si256((const __m256i *)(xq + 64 * j)));
        sum_hi = _mm256_dpbusd_epi32(sum_hi, hi[j],
                                     _mm256_loadu_si256((const __m256i *)(xq + 64 * j + 32)));
      }
      const __m256i both =
          _mm256_add_epi32(_mm256_mullo_epi32(sum_lo, s_lo), _mm256_mullo_epi32(sum_hi, s_hi));
      k4_add_block(both, dd, mn16, x, m0 + m, blk, m, s);
    }
#else
    /* chunk j's low and high nibbles made once, then met by every x row (lo[j] meets its
     * xv[2 j], hi[j] xv[2 j + 1]): row m's sums of them in int16, sum_lo[m] and sum_hi[m] */
    __m256i sum_lo[A8_ROWS], sum_hi[A8_ROWS];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      const __m256i lo = _mm256_and_si256(t[j], nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(t[j], 4), nibble);
#pragma GCC unroll 8
      for (int m = 0; m < R; m++) {
        const __m256i *xv = (const __m256i *)(x->q_lanes + (m0 + m) * k + blk * QK_K) + 2 * j;
        const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(xv));
        const __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xv + 1));
        sum_lo[m] = j ? _mm256_add_epi16(sum_lo[m], p_lo) : p_lo;
        sum_hi[m] = j ? _mm256_add_epi16(sum_hi[m], p_hi) : p_hi;
        A8_PIN(sum_lo[m]);
        A8_PIN(sum_hi[m]);
      }
    }
    /* k4_add_block's operations, lane by lane, on the local acc and off (not that function:
     * it works on s, and two rows' offsets share one vector here) */
    __m128 scaled[A8_ROWS]; /* d dx, dmin dx */
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) {
      const __m256i both = _mm256_add_epi32(_mm256_madd_epi16(sum_lo[m], s_lo),
                                            _mm256_madd_epi16(sum_hi[m], s_hi));
      scaled[m] = _mm_mul_ps(dd, _mm_broadcast_ss(x->dx + (m0 + m) * blocks + blk));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), _mm256_broadcastss_ps(scaled[m]), acc[m]);
    }
#pragma GCC unroll 4
    for (int m = 0; m + 1 < R; m += 2) {
      const __m256i sums =
          _mm256_loadu2_m128i((const __m128i *)(x->sum32 + (m0 + m + 1) * (k / QK) + 8 * blk),
                              (const __m128i *)(x->sum32 + (m0 + m) * (k / QK) + 8 * blk));
      const __m256i mins = _mm256_madd_epi16(_mm256_broadcastsi128_si256(mn16), sums);
      const __m256 dmin = _mm256_permute_ps(_mm256_set_m128(scaled[m + 1], scaled[m]), 0x55);
      off[m / 2] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), dmin, off[m / 2]);
    }
    if (R % 2) {
      const __m128i sums =
          _mm_loadu_si128((const __m128i *)(x->sum32 + (m0 + R - 1) * (k / QK) + 8 * blk));
      const __m128i mins = _mm_madd_epi16(mn16, sums);
      off_last =
          _mm_fnmadd_ps(_mm_cvtepi32_ps(mins), _mm_permute_ps(scaled[R - 1], 0x55), off_last);
    }
#endif
  }
#ifndef K4_LANES_VNNI
  for (int m = 0; m < R; m++) {
    s->acc[m] = acc[m];
    s->off_vec[m] = m == R - 1 && R % 2 ? off_last
                    : m % 2         ? _mm256_extractf128_ps(off[m / 2], 1)
                                    : _mm256_castps256_ps128(off[m / 2]);
  }
#endif
}
#endif

#endif
