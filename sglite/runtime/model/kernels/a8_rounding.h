/*
 * Activations rounded to int8 as llama.cpp rounds them, for gguf_a8.c's integer dot products:
 * per row and span of S values (S = 256 when k is whole super-blocks, else 32), xq = round(x /
 * dx) with dx = max|x| / 127, plus the per-group sums and scales the block kernels use.
 */
#ifndef SGLITE_KERNELS_A8_ROUNDING_H
#define SGLITE_KERNELS_A8_ROUNDING_H
#include <stdint.h>

/* x rounded to int8, per row: `span` values share a scale. */
typedef struct {
  int64_t rows, k, span;
  int8_t *q;      /* [rows, k] */
  float *dx;      /* [rows, k / span] */
  int16_t *sum16; /* [rows, k / 16]: sums of q over each 16 values */
  int16_t *sum32; /* [rows, k / 32] */
  float *dx32;    /* [rows, k / 32]: each group of 32's dx (its span's) */
  float *dxsum32; /* [rows, k / 32]: dx32 times sum32 (x's sum over the group, for offsets) */
  int8_t *q_lanes; /* [rows, k]: q in K4_LANES order (NULL where unused: see there) */
} rounded_x;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* Where 32-bit lanes are tied to a k-quant's groups of 32 (gguf_a8_kquant_rows.h's Q4_K): a
 * super-block's 256 xq as eight vectors, lo[j] and hi[j] (j = 0..3, stored lo[0], hi[0], lo[1],
 * ...), whose lane l holds 4 consecutive values of group 2 (l % 4) (lo) or 2 (l % 4) + 1 (hi),
 * those at 16 (l / 4) + 4 j of it. Q4_K's 128 nibble bytes, 32 per pair of groups, transposed
 * by k4_lanes give its integers in the same order, so each lane's products add up to its
 * group's sum with no scale between them (one vpdpbusd per 32 values with VNNI; on AVX2 a
 * vpmaddubsw per 32 values, four summed in int16, then one vpmaddwd with the scales). Built
 * where such products run: k is whole super-blocks on an AVX2 or AVX-512 build. */
#define K4_LANES 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* Lane-tied sums by vpdpbusd (gguf_a8_kquant_rows.h); without it, by vpmaddubsw, and Q4_K rows
 * of several x rows eight at a time (gguf_a8_k4_block.c). */
#define K4_LANES_VNNI 1
#endif
/* The 4 x 32 bytes at p, p + stride, p + 2 stride, p + 3 stride transposed by 32-bit groups:
 * t[j] lane l = group j + 4 (l / 4) of the 32 bytes at p + (l % 4) stride. */
static inline void k4_lanes(const void *p, int64_t stride, __m256i t[4]) {
  const char *b = (const char *)p;
  const __m256i c0 = _mm256_loadu_si256((const __m256i *)b);
  const __m256i c1 = _mm256_loadu_si256((const __m256i *)(b + stride));
  const __m256i c2 = _mm256_loadu_si256((const __m256i *)(b + 2 * stride));
  const __m256i c3 = _mm256_loadu_si256((const __m256i *)(b + 3 * stride));
  const __m256i a0 = _mm256_unpacklo_epi32(c0, c1), a1 = _mm256_unpackhi_epi32(c0, c1);
  const __m256i a2 = _mm256_unpacklo_epi32(c2, c3), a3 = _mm256_unpackhi_epi32(c2, c3);
  t[0] = _mm256_unpacklo_epi64(a0, a2);
  t[1] = _mm256_unpackhi_epi64(a0, a2);
  t[2] = _mm256_unpacklo_epi64(a1, a3);
  t[3] = _mm256_unpackhi_epi64(a1, a3);
}
#endif

/* x [rows, k] (dtype) rounded into r (its buffers allocated here), rows shared among `threads`
 * threads; `lanes`: also q_lanes, where built (K4_LANES). -1 when out of memory. */
int round_x(int dtype, const void *x, int64_t rows, int64_t k, int threads, int lanes,
            rounded_x *r);
/* Free r's buffers. */
void free_rounded(rounded_x *r);

#endif
