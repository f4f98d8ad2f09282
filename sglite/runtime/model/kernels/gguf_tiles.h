/*
 * Q5_0, Q8_0, Q4_K and Q6_K weights tiled 16 rows at a time for gguf_a8_gemm.c (part types
 * GGUF_TILED_BASE plus ggml's type: GGUF_TILED_Q5_0 ...).
 *
 * The GEMM multiplies a block of 16 weight rows with every x row as vectors whose 32-bit lane r
 * holds 4 consecutive integers of row r. From the file's layout it gets them by transposing the
 * 16 rows' bytes and unpacking each row's block on its own, which costs more than the products
 * at a few x rows (a draft model's passes, a verification, one decode row); tiled, the same bytes
 * are stored already in lane order, so a block decodes with a few loads, masks and shifts. The
 * tiled weight's products are the untiled weight's GEMM bit for bit.
 *
 * Q5_0 layout (the same bytes as the file's: 22 per 32 values per row): tile t holds rows
 * 16t..16t+15 and, for each block j of 32 values in row order, 352 bytes:
 *   - bytes 0-31: the 16 rows' scales d (f16), row r at 2r;
 *   - bytes 32-95: 8 masks of 64 bits; mask g's bit 4r + i is the fifth bit of value 4g + i of
 *     row r (bit 4g + i of the row's qh);
 *   - bytes 96-351: 4 vectors of 64 bytes; vector c's byte 4r + i is the row's qs byte 4c + i:
 *     value 4c + i's low 4 bits in its low nibble, value 16 + 4c + i's in its high one.
 * A weight's value is d (q - 16) with q its 5 bits, as in the file.
 *
 * Q8_0, Q4_K and Q6_K layouts: tile t holds, for each block b (32 or 256 values) in row order,
 * the 16 rows' bytes of that block (16 x 34, 144 or 210) as "word vectors": a segment of W words
 * of 4 bytes at byte `from` of each row's block is W vectors of 64 bytes, vector i's bytes
 * 4r..4r+3 being row r's bytes from + 4i..from + 4i + 3 (gguf_tiles.c's word_tiling). Q8_0's
 * and Q6_K's d (f16) of the 16 rows come first, row r at 2r.
 */
#ifndef SGLITE_KERNELS_GGUF_TILES_H
#define SGLITE_KERNELS_GGUF_TILES_H
#include "common.h"

/* Rows per tile, and bytes per tile and block of 32 values. */
#define TILE_WROWS GGUF_TILE_ROWS
#define TILED_Q5_0_BLOCK_BYTES (TILE_WROWS * 22)

/* Bytes of one tiled super-block (16 rows) of a k-quant. */
#define TILED_Q4_K_SB_BYTES (TILE_WROWS * 144)
#define TILED_Q6_K_SB_BYTES (TILE_WROWS * 210)
#define TILED_Q8_0_BLOCK_BYTES (TILE_WROWS * 34)

/* The stored type of a part type (a tiled one's untiled type). */
static inline int64_t untiled_type(int64_t type) {
  return type > GGUF_TILED_BASE ? type - GGUF_TILED_BASE : type;
}

/* The parts (covering n_out rows) with each tiled one's type as its untiled type's, into
 * as_stored: what gguf_parts_valid checks for a weight whose kernel reads tiled parts. */
void untiled_parts(const gguf_part_t *parts, int64_t n_out,
                   gguf_part_t as_stored[GGUF_MAX_PARTS]);

/* Row n of a tiled part (data: its tiles, k values a row; type: a tiled type) as the file
 * stores it, into out (the row's bytes). */
void gguf_untile_row(int64_t type, const void *data, int64_t n, int64_t k, uint8_t *out);

#if defined(__AVX512BW__) && defined(__AVX512F__)
/* Blocks 2p and 2p + 1 of the tile at `tile` (k values per row): w[g] lane r holds values
 * 4g..4g+3 of the pair's 64 (unsigned, 0..31), scale[j] and offset[j] block j's d and 16 d per
 * row (offset: the -16 per unit of x's group sum, subtracted). */
static inline void tiled_q5_0_pair(const uint8_t *tile, int64_t p, __m512i w[16],
                                   float scale[2][TILE_WROWS], float offset[2][TILE_WROWS]) {
  const __m512i nibble = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
  for (int j = 0; j < 2; j++) {
    const uint8_t *b = tile + (2 * p + j) * TILED_Q5_0_BLOCK_BYTES;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    _mm512_storeu_ps(scale[j], d);
    _mm512_storeu_ps(offset[j], _mm512_mul_ps(d, _mm512_set1_ps(16.0f)));
    for (int c = 0; c < 4; c++) {
      const __m512i v = _mm512_loadu_si512((const void *)(b + 96 + 64 * c));
      uint64_t low_bits, high_bits;
      memcpy(&low_bits, b + 32 + 8 * c, 8);
      memcpy(&high_bits, b + 32 + 8 * (c + 4), 8);
      const __m512i low = _mm512_and_si512(v, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      w[8 * j + c] = _mm512_mask_add_epi8(low, (__mmask64)low_bits, low, sixteen);
      w[8 * j + c + 4] = _mm512_mask_add_epi8(high, (__mmask64)high_bits, high, sixteen);
    }
  }
}

/* Blocks 2p and 2p + 1 of the tiled Q8_0 tile at `tile`, as tiled_q5_0_pair: w[g] lane r holds
 * values 4g..4g+3 of the pair's 64 plus 128 (vpdpbusd's unsigned operand), offset 128 d. */
static inline void tiled_q8_0_pair(const uint8_t *tile, int64_t p, __m512i w[16],
                                   float scale[2][TILE_WROWS], float offset[2][TILE_WROWS]) {
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int j = 0; j < 2; j++) {
    const uint8_t *b = tile + (2 * p + j) * TILED_Q8_0_BLOCK_BYTES;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    _mm512_storeu_ps(scale[j], d);
    _mm512_storeu_ps(offset[j], _mm512_mul_ps(d, _mm512_set1_ps(128.0f)));
    for (int c = 0; c < 8; c++)
      w[8 * j + c] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(b + 32 + 64 * c)), flip);
  }
}
#endif
#endif
