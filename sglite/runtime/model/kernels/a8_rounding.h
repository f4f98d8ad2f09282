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
} rounded_x;

/* x [rows, k] (dtype) rounded into r (its buffers allocated here), rows shared among `threads`
 * threads. -1 when out of memory. */
int round_x(int dtype, const void *x, int64_t rows, int64_t k, int threads, rounded_x *r);
/* Free r's buffers. */
void free_rounded(rounded_x *r);

#endif
