/*
 * gguf_a8_gemm.c's blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): two blocks (64 values) of 16
 * weight rows decoded from the file's rows (their bytes transposed as stored) into 16 vectors
 * whose 32-bit lane r holds 4 consecutive integers of weight row r (a tile's pairs come in that
 * order already: gguf_tiles.h), and their products with a few x rows, each group's integer sums
 * scaled by its block's d and x's group scale. Included by gguf_a8_gemm.c alone, inside its
 * VNNI-512 section (after gguf_a8_gemm_decode.h, within its loop-unrolled products).
 */
#ifndef SGLITE_KERNELS_GGUF_A8_GEMM_PAIRS_H
#define SGLITE_KERNELS_GGUF_A8_GEMM_PAIRS_H
#include "a8_rounding.h"
#include "gguf_a8_gemm_decode.h"

/* X rows a pass takes against a decoded pair of blocks of 32: fewer than GEMM_ROWS, with two
 * chains of sums each (its groups are half a super-block's, so fewer products per scaling). */
#define PAIR_ROWS 4

/* Two blocks of 32 (64 values) of 16 weight rows, decoded. */
typedef struct {
  __m512i w[16];           /* w[g]: values 4g..4g+3 of each row, row r in lane r */
  float scale[2][WROWS];   /* block j's d of each row */
  float offset[2][WROWS];  /* block j's offset per unit of x's group sum (subtracted) */
} decoded_pair;

/* Blocks 2p and 2p + 1 of the 16 weight rows at rows[r] (block type `type`). */
static void decode_pair(int64_t type, const uint8_t *const rows[WROWS], int64_t p,
                        decoded_pair *out) {
  const int64_t bytes = type_block_bytes(type);
  /* vpdpbusd multiplies unsigned weight bytes: Q8_0's signed values go up by 128 */
  const int q8 = type == GGML_TYPE_Q8_0;
  __m512i v[WROWS];
  for (int r = 0; r < WROWS; r++) {
    const uint8_t *b = rows[r] + 2 * p * bytes;
    v[r] = b32_pair_ints(type, b, bytes);
    if (q8) v[r] = _mm512_xor_si512(v[r], _mm512_set1_epi8((char)0x80));
    for (int j = 0; j < 2; j++) {
      float mn;
      const float d = b32_scale(type, b + j * bytes, &mn);
      out->scale[j][r] = d;
      out->offset[j][r] = (q8 ? 128.0f * d : 0.0f) - mn;
    }
  }
  transpose16(v);
  for (int g = 0; g < 16; g++) out->w[g] = v[g];
}

/* sums[m] (2 vectors: products, offsets) += the decoded pair p's products with x rows
 * m0..m0+R-1: each block's integer sums scaled by its d and x's dx32. */
static inline __attribute__((always_inline)) void pair_rows(const int R, const decoded_pair *blk,
                                                            const rounded_x *x, int64_t m0,
                                                            int64_t p, float *sums) {
  const int64_t k = x->k, groups = k / 32;
  __m512 total[PAIR_ROWS], off[PAIR_ROWS];
  for (int m = 0; m < R; m++) {
    total[m] = _mm512_load_ps(sums + 2 * (m0 + m) * WROWS);
    off[m] = _mm512_load_ps(sums + (2 * (m0 + m) + 1) * WROWS);
  }
  for (int j = 0; j < 2; j++) {
    __m512i dot[PAIR_ROWS][2];
    for (int m = 0; m < R; m++) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    for (int q = 0; q < 8; q++) {
      const __m512i w = _mm512_load_si512((const void *)&blk->w[8 * j + q]);
      for (int m = 0; m < R; m++) {
        int32_t four;
        memcpy(&four, x->q + (m0 + m) * k + 64 * p + 32 * j + 4 * q, 4);
        dot[m][q & 1] = _mm512_dpbusd_epi32(dot[m][q & 1], w, _mm512_set1_epi32(four));
      }
    }
    const __m512 scale = _mm512_load_ps(blk->scale[j]), offset = _mm512_load_ps(blk->offset[j]);
    for (int m = 0; m < R; m++) {
      const int64_t i = (m0 + m) * groups + 2 * p + j;
      const __m512i both = _mm512_add_epi32(dot[m][0], dot[m][1]);
      const __m512 scaled = _mm512_mul_ps(scale, _mm512_set1_ps(x->dx32[i]));
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), scaled, total[m]);
      off[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x->dxsum32[i]), off[m]);
    }
  }
  for (int m = 0; m < R; m++) {
    _mm512_store_ps(sums + 2 * (m0 + m) * WROWS, total[m]);
    _mm512_store_ps(sums + (2 * (m0 + m) + 1) * WROWS, off[m]);
  }
}

#endif
