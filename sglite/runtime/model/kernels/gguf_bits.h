/*
 * Pieces of GGUF's block layouts both block kernels read (gguf_blocks.c with float activations,
 * gguf_a8.c with int8 ones): the f16 scales, and on AVX2 a block's nibbles and high bits as
 * byte vectors.
 */
#ifndef SGLITE_KERNELS_GGUF_BITS_H
#define SGLITE_KERNELS_GGUF_BITS_H
#include "common.h"

static inline float half(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return f16_to_f32(h);
}

#if defined(__AVX2__) && defined(__FMA__)
/* Bytes j of the result: 0x10 where bit j of `bits` is set, else 0. */
static inline __m256i bits_to_0x10(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                          2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)bits), spread);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* The nibbles of a 32-block's 16 bytes as 32 byte values in order (see nibbles32). */
static inline __m256i nibble_bytes(const uint8_t *qs) {
  const __m128i b = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

static inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline __m256i high4(__m256i v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
}
/* Bits [shift, shift + width) of every byte, moved to bit `to`. */
static inline __m256i byte_bits(__m256i v, int shift, int mask, int to) {
  const __m256i m = _mm256_set1_epi8((char)mask);
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, shift), m), to);
}
#endif
#endif
