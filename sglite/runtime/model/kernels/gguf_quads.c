/* Q5_0 rows to quads and back (the layout: gguf_quads.h). */
#include "gguf_quads.h"

#define BLOCK 22 /* a Q5_0 block's bytes: f16 d, 32 fifth bits, 16 nibble bytes */

/* Value i's nibble of the Q5_0 block at b (value i in the low nibble of byte i, i < 16, value
 * i + 16 in its high one). */
static inline uint8_t nibble(const uint8_t *b, int i) {
  return i < 16 ? b[6 + i] & 0x0f : b[6 + i - 16] >> 4;
}

/* Bit positions of value 8 l + b's fifth bit in a pair's word (gguf_quads.h). */
static inline int first_bit(int i) { return 8 * (i % 8) + 4 + i / 8; }
static inline int second_bit(int i) { return 8 * (i % 8) + 3 - i / 8; }

/* Four file blocks at `in` as one quad at `out`. */
static void quad_of_blocks(const uint8_t *in, uint8_t *out) {
  for (int j = 0; j < 4; j++) memcpy(out + 2 * j, in + BLOCK * j, 2);
  for (int p = 0; p < 2; p++) {
    const uint8_t *a = in + BLOCK * 2 * p, *b = a + BLOCK;
    uint32_t high_a, high_b;
    memcpy(&high_a, a + 2, 4);
    memcpy(&high_b, b + 2, 4);
    uint64_t word = 0;
    for (int i = 0; i < 32; i++) {
      word |= (uint64_t)((high_a >> i) & 1) << first_bit(i);
      word |= (uint64_t)((high_b >> i) & 1) << second_bit(i);
    }
    memcpy(out + 8 + 8 * p, &word, 8);
    for (int i = 0; i < 32; i++) out[24 + 32 * p + i] = nibble(a, i) | nibble(b, i) << 4;
  }
}

/* One quad at `in` as its four file blocks at `out`. */
static void blocks_of_quad(const uint8_t *in, uint8_t *out) {
  for (int p = 0; p < 2; p++) {
    uint64_t word;
    memcpy(&word, in + 8 + 8 * p, 8);
    const uint8_t *nibbles = in + 24 + 32 * p;
    uint8_t *a = out + BLOCK * 2 * p, *b = a + BLOCK;
    uint32_t high_a = 0, high_b = 0;
    for (int i = 0; i < 32; i++) {
      high_a |= (uint32_t)((word >> first_bit(i)) & 1) << i;
      high_b |= (uint32_t)((word >> second_bit(i)) & 1) << i;
    }
    memcpy(a, in + 4 * p, 2);
    memcpy(b, in + 4 * p + 2, 2);
    memcpy(a + 2, &high_a, 4);
    memcpy(b + 2, &high_b, 4);
    for (int i = 0; i < 16; i++) {
      a[6 + i] = (nibbles[i] & 0x0f) | (nibbles[i + 16] & 0x0f) << 4;
      b[6 + i] = (nibbles[i] >> 4) | (nibbles[i + 16] & 0xf0);
    }
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
