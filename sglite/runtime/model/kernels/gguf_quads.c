/* Q5_0 rows to quads and back (the layout: gguf_quads.h). */
#include "gguf_quads.h"
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define BLOCK 22 /* a Q5_0 block's bytes: f16 d, 32 fifth bits, 16 nibble bytes */

/* Bits 0-7 of `byte` at bit 0 of bytes 0-7: a fifth-bit word's bits for 8 values of a row of
 * values 8 l .. 8 l + 7, before their shift to lane l's position (gguf_quads.h). */
static inline uint64_t spread_bits(uint32_t byte) {
  /* byte b of the product holds bit b of `byte` alone (0 or 1 << b); adding 0x7f carries it
   * into bit 7 of its byte, and no further */
  const uint64_t picked = (byte * 0x0101010101010101ULL) & 0x8040201008040201ULL;
  return ((picked + 0x7f7f7f7f7f7f7f7fULL) >> 7) & 0x0101010101010101ULL;
}

/* Two 16-byte nibble arrays x, y as low = x's low nibbles | y's low nibbles << 4 and high =
 * x's high nibbles | y's high nibbles << 4: a pair's quad nibbles from its two blocks' (x, y:
 * the file's), and, y and x read from the quad's two halves, back (the same operation). */
static inline void pair_nibbles(const uint8_t *x, const uint8_t *y, uint8_t *low,
                                uint8_t *high) {
#if defined(__SSE2__)
  const __m128i vx = _mm_loadu_si128((const __m128i *)x), vy = _mm_loadu_si128((const __m128i *)y);
  const __m128i lo = _mm_set1_epi8(0x0f), hi = _mm_set1_epi8((char)0xf0);
  _mm_storeu_si128((__m128i *)low,
                   _mm_or_si128(_mm_and_si128(vx, lo), _mm_and_si128(_mm_slli_epi16(vy, 4), hi)));
  _mm_storeu_si128((__m128i *)high,
                   _mm_or_si128(_mm_and_si128(_mm_srli_epi16(vx, 4), lo), _mm_and_si128(vy, hi)));
#else
  for (int i = 0; i < 16; i++) {
    low[i] = (x[i] & 0x0f) | (uint8_t)(y[i] << 4);
    high[i] = (x[i] >> 4) | (y[i] & 0xf0);
  }
#endif
}

/* Four file blocks at `from` as one quad at `out` (which may be `from`: rearranged in place). */
static void quad_of_blocks(const uint8_t *from, uint8_t *out) {
  uint8_t in[QUAD_BYTES];
  memcpy(in, from, QUAD_BYTES);
  for (int j = 0; j < 4; j++) memcpy(out + 2 * j, in + BLOCK * j, 2);
  for (int p = 0; p < 2; p++) {
    const uint8_t *a = in + BLOCK * 2 * p, *b = a + BLOCK;
    uint64_t word = 0;
    for (int l = 0; l < 4; l++) /* values 8 l .. 8 l + 7: byte l of each block's fifth bits */
      word |= spread_bits(a[2 + l]) << (4 + l) | spread_bits(b[2 + l]) << (3 - l);
    memcpy(out + 8 + 8 * p, &word, 8);
    pair_nibbles(a + 6, b + 6, out + 24 + 32 * p, out + 40 + 32 * p);
  }
}

/* Bit 0 of bytes 0-7 of `x` (its other bits clear) as bits 0-7 of one byte. */
static inline uint8_t gather_bits(uint64_t x) {
  return (uint8_t)((x * 0x0102040810204080ULL) >> 56);
}

/* One quad at `in` as its four file blocks at `out`. */
static void blocks_of_quad(const uint8_t *in, uint8_t *out) {
  const uint64_t lowest = 0x0101010101010101ULL;
  for (int p = 0; p < 2; p++) {
    uint64_t word;
    memcpy(&word, in + 8 + 8 * p, 8);
    const uint8_t *nibbles = in + 24 + 32 * p;
    uint8_t *a = out + BLOCK * 2 * p, *b = a + BLOCK;
    memcpy(a, in + 4 * p, 2);
    memcpy(b, in + 4 * p + 2, 2);
    for (int l = 0; l < 4; l++) {
      a[2 + l] = gather_bits((word >> (4 + l)) & lowest);
      b[2 + l] = gather_bits((word >> (3 - l)) & lowest);
    }
    pair_nibbles(nibbles, nibbles + 16, a + 6, b + 6);
  }
}

int gguf_quad_q5_0(const void *src, void *dst, int64_t rows, int64_t k) {
  if (rows < 0 || k <= 0 || k % QUAD_VALUES) return -1;
  const int64_t quads = rows * (k / QUAD_VALUES);
  for (int64_t q = 0; q < quads; q++)
    quad_of_blocks((const uint8_t *)src + q * QUAD_BYTES, (uint8_t *)dst + q * QUAD_BYTES);
  return 0;
}

void gguf_unquad_row(const void *data, int64_t n, int64_t k, uint8_t *out) {
  const int64_t quads = k / QUAD_VALUES;
  const uint8_t *row = (const uint8_t *)data + n * quads * QUAD_BYTES;
  for (int64_t q = 0; q < quads; q++) blocks_of_quad(row + q * QUAD_BYTES, out + q * QUAD_BYTES);
}

int gguf_quads_pay(void) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512VNNI__)
  return 1;
#else
  return 0;
#endif
}
