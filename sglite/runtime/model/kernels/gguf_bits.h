/*
 * Pieces of GGUF's block layouts the block kernels read (gguf_blocks.c with float activations,
 * gguf_a8.c and gguf_a8_gemm.c with int8 ones, gguf_amx.c decoding to bf16): the f16 scales, the
 * k-quants' 6-bit scales, on AVX2 a block's nibbles and high bits as byte vectors, and on
 * AVX-512 two blocks of 32's integers as one vector.
 */
#ifndef SGLITE_KERNELS_GGUF_BITS_H
#define SGLITE_KERNELS_GGUF_BITS_H
#include "common.h"

static inline float half(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return f16_to_f32(h);
}

/* Values per block of a GGUF block type: 32, or 256 for the k-quants (0: not one we read). A
 * Q5_0 part in quads (gguf_quads.h) counts as blocks of 32 of 22 bytes: its rows are as long,
 * but only the kernels that know it read their bytes. */
static inline int64_t type_block_values(int64_t type) {
  switch (type) {
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_0:
    case GGUF_QUADS_Q5_0:
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q8_0:
      return 32;
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K:
    case GGML_TYPE_Q6_K:
      return 256;
    default:
      return 0;
  }
}

/* Bytes per block of a GGUF block type (0: not one we read). */
static inline int64_t type_block_bytes(int64_t type) {
  switch (type) {
    case GGML_TYPE_Q4_0:
      return 18;
    case GGML_TYPE_Q4_1:
      return 20;
    case GGML_TYPE_Q5_0:
    case GGUF_QUADS_Q5_0:
      return 22;
    case GGML_TYPE_Q5_1:
      return 24;
    case GGML_TYPE_Q8_0:
      return 34;
    case GGML_TYPE_Q4_K:
      return 144;
    case GGML_TYPE_Q5_K:
      return 176;
    case GGML_TYPE_Q6_K:
      return 210;
    default:
      return 0;
  }
}

/* Row n of a weight's stacked parts (valid ones: gguf_parts_valid): its bytes and block type.
 * Inline, as the GEMVs look up every weight row. */
static inline const uint8_t *stacked_row(const gguf_part_t *parts, int64_t n, int64_t k,
                                         int64_t *type) {
  for (;; parts++) {
    if (n < parts->rows) {
      *type = parts->type;
      const int64_t row_bytes = k / type_block_values(parts->type) * type_block_bytes(parts->type);
      return (const uint8_t *)parts->data + n * row_bytes;
    }
    n -= parts->rows;
  }
}

/* The 6-bit scale and min of group j (0..7) of a Q4_K / Q5_K super-block's 12 scale bytes. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

/* The 6-bit scales (sc) and mins (mn) of a Q4_K / Q5_K super-block's 12 scale bytes, group j in
 * byte j % 4 of word j / 4 (k_scale_min's values, eight at once, on the integer units). */
static inline void k_scales8(const uint8_t *s, uint32_t sc[2], uint32_t mn[2]) {
  uint32_t w[3];
  memcpy(w, s, 12);
  const uint32_t low6 = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  sc[0] = w[0] & low6;
  sc[1] = (w[2] & four) | (((w[0] >> 6) & two) << 4);
  mn[0] = w[1] & low6;
  mn[1] = ((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4);
}

/* Rows of a weight's n_out held by parts of block type `type`. */
static inline int64_t type_rows(const gguf_part_t *parts, int64_t n_out, int64_t type) {
  int64_t rows = 0;
  for (int64_t seen = 0, i = 0; seen < n_out && i < GGUF_MAX_PARTS && parts[i].rows > 0;
       seen += parts[i].rows, i++)
    if (parts[i].type == type) rows += parts[i].rows;
  return rows;
}

/* Rows of a weight's n_out held by Q6_K parts. */
static inline int64_t q6k_rows(const gguf_part_t *parts, int64_t n_out) {
  return type_rows(parts, n_out, GGML_TYPE_Q6_K);
}

/* Whether Q6_K parts hold most of a weight's n_out rows (it decodes slower: later thresholds). */
static inline int q6k_mostly(const gguf_part_t *parts, int64_t n_out) {
  return 2 * q6k_rows(parts, n_out) > n_out;
}

/* Whether a block of 32 stores its min after its scale (Q4_1, Q5_1); the other types' offset
 * per unit of the integers is b32_offset_in_d times the scale: -8 (Q4_0), -16 (Q5_0), 0 (Q8_0). */
static inline int b32_has_min(int64_t type) {
  return type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1;
}
static inline float b32_offset_in_d(int64_t type) {
  return type == GGML_TYPE_Q4_0 ? -8.0f : type == GGML_TYPE_Q5_0 ? -16.0f : 0.0f;
}

/* A block of 32's scale d; *mn its offset per unit of the integers (b32_has_min,
 * b32_offset_in_d): its values are d q + mn. */
static inline float b32_scale(int64_t type, const uint8_t *b, float *mn) {
  const float d = half(b), times = b32_offset_in_d(type);
  *mn = b32_has_min(type) ? half(b + 2) : times != 0.0f ? times * d : 0.0f;
  return d;
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
/* Half h (values 128h..128h + 127) of a Q6_K super-block as four vectors of 32 signed bytes
 * q - 32 (values 128h + 32s + l in q[s]): 4 bits from ql, 2 from qh. */
static inline void q6k_half(const uint8_t *b, int h, __m256i q[4]) {
  const __m256i lo0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
  const __m256i lo1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
  const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
  const __m256i bias = _mm256_set1_epi8(32);
  q[0] = _mm256_sub_epi8(_mm256_or_si256(low4(lo0), byte_bits(hb, 0, 3, 4)), bias);
  q[1] = _mm256_sub_epi8(_mm256_or_si256(low4(lo1), byte_bits(hb, 2, 3, 4)), bias);
  q[2] = _mm256_sub_epi8(_mm256_or_si256(high4(lo0), byte_bits(hb, 4, 3, 4)), bias);
  q[3] = _mm256_sub_epi8(_mm256_or_si256(high4(lo1), byte_bits(hb, 6, 3, 4)), bias);
}

/* A block of 32's integers as 32 bytes in value order: unsigned for Q4/Q5, Q8_0's signed. */
static inline __m256i b32_ints(int64_t type, const uint8_t *b) {
  switch (type) {
    case GGML_TYPE_Q4_0:
      return nibble_bytes(b + 2);
    case GGML_TYPE_Q4_1:
      return nibble_bytes(b + 4);
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1: {
      const int one = type == GGML_TYPE_Q5_1;
      uint32_t high;
      memcpy(&high, b + (one ? 4 : 2), 4);
      return _mm256_or_si256(nibble_bytes(b + (one ? 8 : 6)), bits_to_0x10(high));
    }
    default:
      return _mm256_loadu_si256((const __m256i *)(b + 2));
  }
}

/* A Q4_K / Q5_K super-block's 6-bit scales and mins (k_scale_min's values) from its 12 scale
 * bytes at s, with vector instructions: bytes 0-7 the scales of groups 0-7, 8-15 their mins.
 * Reads 16 bytes (the super-block's nibbles follow its scales). */
static inline __m128i k_scales16(const uint8_t *s) {
  const __m128i v = _mm_loadu_si128((const __m128i *)s);
  const __m128i a =
      _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7));
  const __m128i b =
      _mm_shuffle_epi8(v, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
  /* groups 4-7: 4 low bits from bytes 8-11 (the mins' high nibbles), 2 high bits from the
   * top of bytes 0-7 */
  const __m128i b_shifted = _mm_blend_epi16(b, _mm_srli_epi16(b, 4), 0xc0);
  const __m128i top = _mm_srli_epi16(_mm_and_si128(a, _mm_set1_epi8((char)0xc0)), 2);
  const __m128i high = _mm_or_si128(_mm_and_si128(b_shifted, _mm_set1_epi8(0x0f)), top);
  const __m128i low = _mm_and_si128(a, _mm_set1_epi8(0x3f));
  return _mm_blend_epi32(low, high, 0xa);
}
#endif

#if defined(__AVX512BW__)
/* Two consecutive blocks' integers (b32_ints of each) as one vector: for Q4_0/Q4_1 each block's
 * 16 nibble bytes loaded twice, the second copy shifted to its high nibbles (five operations for
 * the pair, where two b32_ints and a merge take eleven); Q5_0/Q5_1 add their fifth bits through
 * a byte mask (two b32_ints take some thirty operations). */
static inline __m512i b32_pair_ints(int64_t type, const uint8_t *b, int64_t bytes) {
  if (type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1) {
    const int64_t at = type == GGML_TYPE_Q4_0 ? 2 : 4;
    const __m256i q0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + at)));
    const __m256i q1 =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + bytes + at)));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
    /* 128-bit lanes 1 and 3 (int16 lanes 8-15, 24-31) take the high nibbles */
    const __m512i shifted = _mm512_mask_srli_epi16(both, 0xff00ff00u, both, 4);
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0f));
  }
  if (type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q5_1) {
    /* the nibbles as Q4's, then 16 added where the block's 32 high bits (bit j: value j) are
     * set: the two blocks' bits are one 64-bit mask over the 64 bytes */
    const int64_t high_at = type == GGML_TYPE_Q5_0 ? 2 : 4, at = high_at + 4;
    uint32_t high[2];
    memcpy(&high[0], b + high_at, 4);
    memcpy(&high[1], b + bytes + high_at, 4);
    const __m256i q0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + at)));
    const __m256i q1 =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + bytes + at)));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
    const __m512i nibbles =
        _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xff00ff00u, both, 4), _mm512_set1_epi8(0x0f));
    const __mmask64 set = (__mmask64)high[0] | ((__mmask64)high[1] << 32);
    return _mm512_mask_add_epi8(nibbles, set, nibbles, _mm512_set1_epi8(16));
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(b32_ints(type, b)), b32_ints(type, b + bytes),
                            1);
}
#endif /* __AVX512BW__ */
#endif
