/*
 * Q5_0 rows in quads: each row's blocks of 32 four at a time in 88 bytes (the file's 22 per
 * block), laid out so that an AVX2 build without VNNI decodes two blocks' 64 integers from one
 * 32-byte load and one 64-bit broadcast of their fifth bits, where the file's layout needs a
 * shuffle, a compare and four more operations per block (the int8 GEMV's Q5_0 products there
 * are bound by its vector units, not by reading the weight: docs/cpu.md). A part of type
 * GGUF_QUADS_Q5_0 holds rows of k values, k a multiple of QUAD_VALUES; quad q of a row holds
 * its blocks 4 q .. 4 q + 3 (A, B, C, D):
 *
 *   bytes  0-7   the four blocks' f16 d;
 *   bytes  8-15  A and B's fifth bits as one 64-bit word: bit 8 b + 4 + l is that of value
 *                8 l + b of A, bit 8 b + 3 - l that of value 8 l + b of B (b 0..7, l 0..3), so
 *                that the word broadcast to four 64-bit lanes, lane l shifted right by l (A) or
 *                left by l + 1 (B), has each value's fifth bit at bit 4 of its byte;
 *   bytes 16-23  C and D's, alike;
 *   bytes 24-55  A and B's nibbles: byte i = value i of A | value i of B << 4;
 *   bytes 56-87  C and D's.
 *
 * The int8 GEMV (gguf_a8.c) reads such rows directly; every other kernel that accepts them
 * reads a row through gguf_stored_row (common.h: the file's layout, rebuilt into a buffer). The VNNI GEMM
 * and the tile GEMM refuse them: the loader holds Q5_0 parts in quads only on AVX2 builds
 * without VNNI, where neither runs.
 */
#ifndef SGLITE_KERNELS_GGUF_QUADS_H
#define SGLITE_KERNELS_GGUF_QUADS_H
#include "common.h"

#define QUAD_VALUES 128
#define QUAD_BYTES 88

/* Row `n` of `k` values of a quads part's data, rebuilt in the file's Q5_0 layout into `out`
 * (k / 32 * 22 bytes). */
void gguf_unquad_row(const void *data, int64_t n, int64_t k, uint8_t *out);

/* Whether any of the weight's parts (covering n_out rows) is in quads. */
static inline int gguf_has_quads(const gguf_part_t *parts, int64_t n_out) {
  int64_t covered = 0;
  for (int i = 0; i < GGUF_MAX_PARTS && covered < n_out && parts[i].rows > 0; i++) {
    if (parts[i].type == GGUF_QUADS_Q5_0) return 1;
    covered += parts[i].rows;
  }
  return 0;
}
#endif
