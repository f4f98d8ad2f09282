/*
 * gguf_amx.c's weight side: a GGUF block's values decoded straight to bfloat16 (Q4_K, Q6_K and
 * the blocks of 32; Q5_K through the float decoder), each value computed as gguf_blocks.c's
 * float decoder computes it, then rounded. Included by gguf_amx.c alone, inside its tile-GEMM
 * section.
 */
#ifndef SGLITE_KERNELS_GGUF_BF16_DECODE_H
#define SGLITE_KERNELS_GGUF_BF16_DECODE_H
#include "gguf_bits.h"
#include "gguf_quads.h"

/* A Q4_K super-block's 256 values as bf16. A group of 32 has 16 possible values (d sc q -
 * dmin mn for q = 0..15): they are computed and rounded once, as the float decoder computes
 * each, and the nibbles look them up. The eight groups' scales and mins are unpacked together;
 * one vector holds the tables of a chunk's two groups (low nibbles index 0-15, high 16-31). */
static inline void q4k_bf16(const uint8_t *b, uint16_t *out) {
  const float d = half(b), dmin = half(b + 2);
  uint32_t w[3];
  memcpy(w, b + 4, 12);
  const uint32_t low6 = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  const __m128i sc = _mm_setr_epi32((int)(w[0] & low6),
                                    (int)((w[2] & four) | (((w[0] >> 6) & two) << 4)), 0, 0);
  const __m128i mn = _mm_setr_epi32((int)(w[1] & low6),
                                    (int)(((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4)), 0, 0);
  /* d sc and -dmin mn of each group, in lanes 0-7 (kept in registers: a round trip through
   * memory stalls on store forwarding) */
  const __m512 scale = _mm512_castps256_ps512(
      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)), _mm256_set1_ps(d)));
  const __m512 offset = _mm512_castps256_ps512(
      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)), _mm256_set1_ps(-dmin)));
  const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i second = _mm512_set1_epi16(16);
  for (int c = 0; c < 4; c++) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
    const __m512i g = _mm512_set1_epi32(2 * c), g1 = _mm512_set1_epi32(2 * c + 1);
    const __m512 lo = _mm512_fmadd_ps(q, _mm512_permutexvar_ps(g, scale),
                                      _mm512_permutexvar_ps(g, offset));
    const __m512 hi = _mm512_fmadd_ps(q, _mm512_permutexvar_ps(g1, scale),
                                      _mm512_permutexvar_ps(g1, offset));
    const __m512i tables = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    const __m512i first_idx = _mm512_cvtepu8_epi16(low4(bytes));
    const __m512i second_idx = _mm512_or_si512(_mm512_cvtepu8_epi16(high4(bytes)), second);
    _mm512_storeu_si512(out + 64 * c, _mm512_permutexvar_epi16(first_idx, tables));
    _mm512_storeu_si512(out + 64 * c + 32, _mm512_permutexvar_epi16(second_idx, tables));
  }
}

/* A Q6_K super-block's 256 values as bf16: d sc (q - 32) per group of 16, as the float decoder
 * computes them (its sixteen d sc products at once, each group's picked from the vector). */
static inline void q6k_bf16(const uint8_t *b, uint16_t *out) {
  const __m512 scales = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
      _mm512_set1_ps(half(b + 208)));
  for (int h = 0; h < 2; h++) {
    __m256i q[4];
    q6k_half(b, h, q);
    for (int s = 0; s < 4; s++) {
      const int g = 8 * h + 2 * s;
      const __m512 lo = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q[s]))),
          _mm512_permutexvar_ps(_mm512_set1_epi32(g), scales));
      const __m512 hi = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q[s], 1))),
          _mm512_permutexvar_ps(_mm512_set1_epi32(g + 1), scales));
      _mm512_storeu_si512(out + 128 * h + 32 * s, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

/* A block of 32's values as bf16 (Q4_0, Q4_1, Q5_0, Q5_1: d q + m as the float decoder's FMA
 * computes it, for each of the 16 or 32 possible q at once, rounded, then looked up by the
 * block's integers; Q8_0: d q per value). */
static inline void b32_bf16(int64_t type, const uint8_t *b, uint16_t *out) {
  float m;
  const float d = b32_scale(type, b, &m);
  const __m256i q = b32_ints(type, b);
  if (type == GGML_TYPE_Q8_0) {
    const __m512 lo = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), _mm512_set1_ps(d));
    const __m512 hi = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
        _mm512_set1_ps(d));
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    return;
  }
  const __m512 first = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 lo = _mm512_fmadd_ps(first, _mm512_set1_ps(d), _mm512_set1_ps(m));
  const __m512 hi = _mm512_fmadd_ps(_mm512_add_ps(first, _mm512_set1_ps(16.0f)),
                                    _mm512_set1_ps(d), _mm512_set1_ps(m));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table));
}

/* Values [v0, v0 + count) of a row of `type` as bf16 straight from its blocks (the types
 * gguf_gemm_amx serves; v0 and count whole blocks). */
static void decode_span_bf16(int64_t type, const uint8_t *row, int64_t v0, int64_t count,
                             uint16_t *out) {
  if (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K) {
    const int64_t bytes = type == GGML_TYPE_Q4_K ? 144 : 210;
    for (int64_t v = 0; v < count; v += 256) {
      const uint8_t *b = row + (v0 + v) / 256 * bytes;
      for (int l = 0; l < 4; l++) /* a block's (at most 210 bytes) */
        _mm_prefetch((const char *)b + DECODE_PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
      if (type == GGML_TYPE_Q4_K)
        q4k_bf16(b, out + v);
      else
        q6k_bf16(b, out + v);
    }
    return;
  }
  if (type == GGML_TYPE_Q5_K) {
    gguf_decode_span(type, row, v0, count, span_buf);
    for (int64_t v = 0; v < count; v += 16)
      _mm256_storeu_si256((__m256i *)(out + v), to_bf16x16(_mm512_loadu_ps(span_buf + v)));
    return;
  }
  const int64_t bytes = gguf_row_bytes(type, 32);
  for (int64_t v = 0; v < count; v += 32) {
    const uint8_t *b = row + (v0 + v) / 32 * bytes;
    if (v % 256 == 0) /* eight blocks: at most 272 bytes */
      for (int l = 0; l < 5; l++)
        _mm_prefetch((const char *)b + DECODE_PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
    b32_bf16(type, b, out + v);
  }
}

#endif
