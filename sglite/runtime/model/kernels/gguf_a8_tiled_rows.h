/*
 * gguf_a8_gemm.c's products of a few x rows with a tiled k-quant super-block (gguf_tiles.h)
 * whose integers are built in registers as they are multiplied: no decoded block is stored and
 * loaded back. Each equals, bit for bit, the decoded block's products (gguf_a8_gemm.c's
 * block_rows after decode_q4k_tiled / decode_q6k_tiled): the same integer sums, scaled and added
 * in the same order, so a row's result still depends on that x row alone. Included by
 * gguf_a8_gemm.c alone, inside its VNNI-512 section (after gguf_a8_gemm_decode.h, within its
 * loop-unrolled products).
 */
#ifndef SGLITE_KERNELS_GGUF_A8_TILED_ROWS_H
#define SGLITE_KERNELS_GGUF_A8_TILED_ROWS_H
#include "a8_rounding.h"
#include "gguf_a8_gemm_decode.h"

/* The x rows a tiled super-block's integers are multiplied with as they are built (FUSED_ROWS at
 * a time; fewer: the tail's count). */
#define FUSED_ROWS 6

/* sums[m] (products) += x rows m0..m0+R-1 times the tiled Q4_K super-block at `tiled`
 * (super-block sb of x), its nibbles split as they are multiplied: no decoded vector is stored
 * and loaded back (for a few rows those stores and loads would cost about as much as the
 * products). Equal bit for bit to decode_q4k_tiled then block_rows(R, 32): the same integer
 * sums, scaled and added in the same order. One x row sums each group as two chains. */
static inline __attribute__((always_inline)) void q4k_tiled_rows(const int R,
                                                                 const uint8_t *tiled,
                                                                 const rounded_x *x, int64_t m0,
                                                                 int64_t sb, decoded_block *blk,
                                                                 float *sums) {
  const int64_t k = x->k;
  const int chains = R == 1 ? 2 : 1;
  __m512i head[4];
  for (int j = 0; j < 4; j++) head[j] = load_ahead(tiled + 64 * j);
  q4k_scales(head, blk);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 total[FUSED_ROWS];
  for (int m = 0; m < R; m++) total[m] = _mm512_setzero_ps();
  for (int c = 0; c < 4; c++) {
    /* groups 2c (low nibbles) and 2c + 1 (high) */
    __m512i low[FUSED_ROWS][2], high[FUSED_ROWS][2];
    for (int m = 0; m < R; m++)
      for (int i = 0; i < chains; i++) low[m][i] = high[m][i] = _mm512_setzero_si512();
    for (int t = 0; t < 8; t++) {
      const __m512i w = load_ahead(tiled + 256 + 64 * (8 * c + t));
      const __m512i lo = _mm512_and_si512(w, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), nibble);
      for (int m = 0; m < R; m++) {
        const int8_t *xq = x->q + (m0 + m) * k + sb * QK_K + 64 * c + 4 * t;
        int32_t lo4, hi4;
        memcpy(&lo4, xq, 4);
        memcpy(&hi4, xq + 32, 4);
        low[m][t % chains] = _mm512_dpbusd_epi32(low[m][t % chains], lo, _mm512_set1_epi32(lo4));
        high[m][t % chains] =
            _mm512_dpbusd_epi32(high[m][t % chains], hi, _mm512_set1_epi32(hi4));
      }
    }
    for (int m = 0; m < R; m++) {
      if (chains == 2) {
        low[m][0] = _mm512_add_epi32(low[m][0], low[m][1]);
        high[m][0] = _mm512_add_epi32(high[m][0], high[m][1]);
      }
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low[m][0]),
                                 _mm512_load_ps(blk->scale[2 * c]), total[m]);
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high[m][0]),
                                 _mm512_load_ps(blk->scale[2 * c + 1]), total[m]);
    }
  }
  for (int m = 0; m < R; m++) add_row_total(1, blk, x, m0 + m, sb, total[m], sums);
}

/* sums[m] (products) += x rows m0..m0+R-1 times the tiled Q6_K super-block at `tiled`
 * (super-block sb of x; starts: q6k_group_starts), its integers built as they are multiplied,
 * as q4k_tiled_rows does for Q4_K. Equal bit for bit to decode_q6k_tiled then
 * block_rows(R, 16). */
static inline __attribute__((always_inline)) void q6k_tiled_rows(const int R,
                                                                 const uint8_t *tiled,
                                                                 const rounded_x *x,
                                                                 const int32_t *starts, int64_t m0,
                                                                 int64_t sb, decoded_block *blk,
                                                                 float *sums) {
  const int64_t k = x->k;
  const int chains = R == 1 ? 2 : 1;
  for (int64_t at = 0; at < TILED_Q6_K_SB_BYTES; at += 64) {
    _mm_prefetch((const char *)(tiled + at + TILED_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(tiled + at + TILED_AHEAD_L2), _MM_HINT_T1);
  }
  __m512i scales[4];
  for (int j = 0; j < 4; j++) scales[j] = _mm512_loadu_si512((const void *)(tiled + 32 + 64 * j));
  q6k_scales(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tiled)), scales, blk);
  const uint8_t *ql = tiled + 288, *qh = tiled + 2336;
  __m512 total[FUSED_ROWS];
  for (int m = 0; m < R; m++) total[m] = _mm512_setzero_ps();
  /* unrolled whole: the shifts below then take their counts as immediates */
#pragma GCC unroll 2
  for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
      /* groups g (t < 4) and g + 1 */
      const int g = 8 * h + 2 * s;
      __m512i dot[FUSED_ROWS][2][2];
      for (int m = 0; m < R; m++)
        for (int i = 0; i < 2; i++) {
          dot[m][i][0] = _mm512_set1_epi32(starts[(m0 + m) * (k / 16) + sb * 16 + g + i]);
          if (chains == 2) dot[m][i][1] = _mm512_setzero_si512();
        }
      for (int t = 0; t < 8; t++) {
        const __m512i low =
            _mm512_loadu_si512((const void *)(ql + 64 * (16 * h + 8 * (s & 1) + t)));
        const __m512i high = _mm512_loadu_si512((const void *)(qh + 64 * (8 * h + t)));
        const __m512i w = q6k_values(low, high, s);
        for (int m = 0; m < R; m++) {
          int32_t four;
          memcpy(&four, x->q + (m0 + m) * k + sb * QK_K + 128 * h + 32 * s + 4 * t, 4);
          __m512i *chain = &dot[m][t >> 2][t % chains];
          *chain = _mm512_dpbusd_epi32(*chain, w, _mm512_set1_epi32(four));
        }
      }
      for (int m = 0; m < R; m++)
        for (int i = 0; i < 2; i++) {
          const __m512i sum =
              chains == 2 ? _mm512_add_epi32(dot[m][i][0], dot[m][i][1]) : dot[m][i][0];
          total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_load_ps(blk->scale[g + i]),
                                     total[m]);
        }
    }
  for (int m = 0; m < R; m++) add_row_total(0, blk, x, m0 + m, sb, total[m], sums);
}

#endif
