/*
 * Q4_K weights times several int8-rounded x rows, eight weight rows at a time, on AVX2 builds
 * without VNNI (gguf_a8_k4_block.c); gguf_a8.c's GEMV takes it for K4_BLOCK_MIN_XROWS or more
 * x rows.
 */
#ifndef SGLITE_KERNELS_GGUF_A8_K4_BLOCK_H
#define SGLITE_KERNELS_GGUF_A8_K4_BLOCK_H
#include "a8_rounding.h"

#if defined(K4_LANES) && !defined(K4_LANES_VNNI)
#define K4_BLOCKS 1
/* Weight rows a block decodes together (one 32-bit lane each), and most x rows per call. */
#define K4_BLOCK_ROWS 8
#define K4_BLOCK_XROWS 16

/* out[m * K4_BLOCK_ROWS + r] = the product of weight row rows[r] (Q4_K, x->k values) and x row
 * m0 + m, for m0 <= m0 + m < m1, m1 - m0 <= K4_BLOCK_XROWS: k4_row_lanes' values bit for bit. */
void k4_block_products(const uint8_t *const rows[K4_BLOCK_ROWS], const rounded_x *x,
                       int64_t m0, int64_t m1, float *out);
#endif
#endif
