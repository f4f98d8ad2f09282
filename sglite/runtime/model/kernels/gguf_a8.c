/*
 * GGUF block weights times activations rounded to int8 (llama.cpp's arithmetic): y = x W^T
 * for any number of x rows, the weight read as the file stores it (gguf_blocks.c's layouts).
 *
 * Each x row is rounded per span of S values (S = 256 when k is whole super-blocks, else 32):
 * xq = round(x / dx), dx = max|x| / 127, with the sums of xq over every 16 and 32 values. A
 * row's product is then sum over blocks of (weight scale) (dx of its span) (integer dot of the
 * weight's integers with xq), plus the formats' offsets (Q4_0 -8, Q5_0 -16, Q6_K -32, the k-quants'
 * and Q4_1/Q5_1's mins) times the xq sums: the dequantized weight times the rounded x, to float
 * rounding. On AVX2 the integer dots are `vpmaddubsw` (weight integers as unsigned bytes, at most
 * 63, times xq: pairs of products in int16, no saturation) and `vpmaddwd` with the group
 * scales; a k-quant super-block is summed in int32 and scaled once. With AVX-512 VNNI, blocks
 * of 32 go eight at a time (their scales as vectors, two blocks per `vpdpbusd`), and Q4_K /
 * Q6_K 64 values a vector (`vpmaddubsw`, then `vpdpwssd` with the group scales). Elsewhere a
 * weight row is decoded to float32 and dotted with xq dx. Each thread reads its rows as
 * STREAMS interleaved sequences, every block prefetching its row's bytes PREFETCH_BYTES ahead
 * (but for one x row read as one stream, which the hardware prefetchers keep ahead of).
 *
 * Invariant: a row's result depends on that x row alone (not on the other rows, their number or
 * the thread count): every output is computed by one thread in one fixed order, so prefill,
 * decode and any batch give a token the same values. On AVX-512 VNNI builds where 512-bit
 * operations are split, two or more rows may take Q4_K through k4_row_lanes (the same integer
 * sums, their float sums rounded in another order) unless the caller asks for row-independent
 * results; AVX2 builds take it for every row count, and for K4_BLOCK_MIN_XROWS or more x rows
 * compute Q4_K rows eight at a time (gguf_a8_k4_block.c: k4_row_lanes' values bit for bit).
 *
 * The row products live in gguf_a8_kquant_rows.h (k-quants) and gguf_a8_b32_rows.h (blocks of
 * 32, Q5_0 in quads); here the choice of kernel per row (row_products) and the threads' row
 * ranges (a8_range).
 */
#include "a8_rounding.h"
#include "gguf_a8_b32_rows.h"
#include "gguf_a8_k4_block.h"
#include "gguf_a8_kquant_rows.h"
#include "gguf_bits.h"
#include "gguf_quads.h"

#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void row_products(const int R, const int prefetch,
                                                               const int narrow,
                                                               int64_t type, const uint8_t *row,
                                                               const rounded_x *x, int64_t m0,
                                                               float *out) {
  row_sums s;
  for (int m = 0; m < R; m++) {
    s.acc[m] = _mm256_setzero_ps();
    s.off[m] = 0.0f;
    s.off_vec[m] = _mm_setzero_ps();
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (type == GGML_TYPE_Q4_K && !narrow)
    k4_row_vnni(R, prefetch, row, x, m0, &s);
  else if (type == GGML_TYPE_Q6_K && !narrow)
    k6_row_vnni(R, prefetch, row, x, m0, &s);
  else
#else
  (void)narrow;
#endif
#ifdef K4_LANES_VNNI
  if (R >= 2 && type == GGML_TYPE_Q4_K && x->q_lanes != NULL)
    k4_row_lanes(R, prefetch, row, x, m0, &s);
  else
#elif defined(K4_LANES)
  if (type == GGML_TYPE_Q4_K && x->q_lanes != NULL)
    k4_row_lanes(R, prefetch, row, x, m0, &s);
  else
#endif
  if (type == GGUF_QUADS_Q5_0)
    q5_0_quads_row(R, prefetch, row, x, m0, &s);
  else if (type == GGML_TYPE_Q4_K)
    k4_k5_row(R, prefetch, 0, row, x, m0, &s);
  else if (type == GGML_TYPE_Q6_K)
    k6_row(R, prefetch, row, x, m0, &s);
  else if (type == GGML_TYPE_Q5_K)
    k4_k5_row(R, prefetch, 1, row, x, m0, &s);
  else /* each block-of-32 type compiled on its own: no per-block branch on the type */
    switch (type) {
      case GGML_TYPE_Q4_0:
        b32_row(R, prefetch, GGML_TYPE_Q4_0, row, x, m0, &s);
        break;
      case GGML_TYPE_Q4_1:
        b32_row(R, prefetch, GGML_TYPE_Q4_1, row, x, m0, &s);
        break;
      case GGML_TYPE_Q5_0:
        b32_row(R, prefetch, GGML_TYPE_Q5_0, row, x, m0, &s);
        break;
      case GGML_TYPE_Q5_1:
        b32_row(R, prefetch, GGML_TYPE_Q5_1, row, x, m0, &s);
        break;
      default:
        b32_row(R, prefetch, GGML_TYPE_Q8_0, row, x, m0, &s);
    }
  for (int m = 0; m < R; m++) {
    const float off_lanes = hsum_ps(_mm256_zextps128_ps256(s.off_vec[m]));
    out[m] = hsum_ps(s.acc[m]) + (s.off[m] + off_lanes);
  }
}
#else
/* Portable: the weight row decoded to float32 (`decoded`, k values), dotted with xq dx. */
static inline void row_products_decoded(const int R, const float *decoded, const rounded_x *x,
                                        int64_t m0, float *out) {
  const int64_t k = x->k, spans = k / x->span;
  for (int m = 0; m < R; m++) {
    const int8_t *xq = x->q + (m0 + m) * k;
    float total = 0.0f;
    for (int64_t s = 0; s < spans; s++) {
      float part = 0.0f;
      for (int64_t j = s * x->span; j < (s + 1) * x->span; j++) part += decoded[j] * (float)xq[j];
      total += part * x->dx[(m0 + m) * spans + s];
    }
    out[m] = total;
  }
}
#endif

typedef struct {
  int dtype;
  const rounded_x *x;
  const gguf_part_t *parts;
  void *y;
  int64_t n_out;
  int narrow;      /* k-quants through the 256-bit path (vectors_512_split) */
  int64_t streams; /* interleaved sequences a thread reads its rows as */
} a8_args;

/* Weight rows of one tile: read once from memory, then in cache for every group of x rows. */
#define TILE_ROWS 16

/* A thread reads its rows as STREAMS interleaved sequences, far apart in memory, taking a row
 * of each in turn: on Intel one sequential stream leaves the core's hardware prefetchers
 * waiting on a single run of lines while the products compute, and two keep more lines in
 * flight. Where 512-bit operations run as two halves (AMD Zen 4) the k-quants take the 256-bit
 * path (its sums cost fewer issue slots there than the 512-bit path's shuffles); there rows of
 * at most SHORT_ROW_BYTES are read as two streams too (a short row is a short run, which one
 * stream's prefetchers do not keep ahead of), longer ones as one (STREAMS_SPLIT), which its
 * prefetchers keep ahead of those products (docs/benchmarks.md). */
#define STREAMS 2
#define STREAMS_SPLIT 1

/* The streams a thread reads its rows of `parts` (k values each) as. */
static int64_t row_streams(const gguf_part_t *parts, int64_t k, int split) {
  if (!split) return STREAMS;
  return gguf_row_bytes(parts->type, k) <= SHORT_ROW_BYTES ? STREAMS : STREAMS_SPLIT;
}

/* The weight row at position v of the interleaved order of rows [n0, n0 + len * streams):
 * stream v % streams, its (v / streams)-th row; rows past n1 are skipped by the caller. */
static inline int64_t stream_row(int64_t v, int64_t n0, int64_t len, int64_t streams) {
  return n0 + (v % streams) * len + v / streams;
}

/* The x rows of the chunk at m0 of `rows` split into the fewest chunks of at most `most`, their
 * sizes at most one apart: a chunk decodes each weight block once for all its rows, and a last
 * chunk of one row would decode them all again for a row's products (5 rows as 3 + 2, not
 * 4 + 1). */
static inline int chunk_rows(int64_t rows, int64_t m0, int most) {
  const int64_t left = rows - m0, chunks = (left + most - 1) / most;
  return (int)((left + chunks - 1) / chunks);
}

#if defined(__AVX2__) && defined(__FMA__)
/* row_products of weight row `row` and x rows m0 .. m0 + R - 1 (R <= A8_ROWS, a runtime value),
 * into y. */
static inline __attribute__((always_inline)) void row_to_y(const a8_args *a, int R, int prefetch,
                                                           int64_t type, const uint8_t *row,
                                                           int64_t n, int64_t m0) {
  const rounded_x *x = a->x;
  float out[A8_ROWS];
  if (R == 4)
    row_products(4, 1, a->narrow, type, row, x, m0, out);
  else if (R == 3)
    row_products(3, 1, a->narrow, type, row, x, m0, out);
  else if (R == 2)
    row_products(2, 1, a->narrow, type, row, x, m0, out);
  else if (prefetch)
    row_products(1, 1, a->narrow, type, row, x, m0, out);
  else
    row_products(1, 0, a->narrow, type, row, x, m0, out);
  for (int m = 0; m < R; m++) store(a->y, (m0 + m) * a->n_out + n, out[m], a->dtype);
}
#endif

#ifdef K4_BLOCKS
/* Fewest x rows for which Q4_K rows take k4_block_products (the same values as k4_row_lanes'). */
#define K4_BLOCK_MIN_XROWS 8

/* The Q4_K rows among tile positions [t0, t1) (rows of [n0, n1) in a8_range's order) times
 * every x row: eight at a time through k4_block_products, a last group of fewer through
 * row_products (a8_range leaves them all to this). */
static void k4_tile_blocks(const a8_args *a, int64_t t0, int64_t t1, int64_t n0, int64_t n1,
                           int64_t len) {
  const rounded_x *x = a->x;
  const uint8_t *rows[K4_BLOCK_ROWS];
  int64_t outputs[K4_BLOCK_ROWS];
  float out[K4_BLOCK_XROWS * K4_BLOCK_ROWS];
  int count = 0;
  for (int64_t v = t0; v < t1; v++) {
    const int64_t n = stream_row(v, n0, len, a->streams);
    int64_t type;
    if (n >= n1) continue;
    const uint8_t *row = stacked_row(a->parts, n, x->k, &type);
    if (type != GGML_TYPE_Q4_K) continue;
    rows[count] = row;
    outputs[count++] = n;
    if (count < K4_BLOCK_ROWS) continue;
    for (int64_t m0 = 0, m1; m0 < x->rows; m0 = m1) {
      m1 = m0 + chunk_rows(x->rows, m0, K4_BLOCK_XROWS);
      k4_block_products(rows, x, m0, m1, out);
      for (int64_t m = m0; m < m1; m++)
        for (int r = 0; r < K4_BLOCK_ROWS; r++)
          store(a->y, m * a->n_out + outputs[r], out[(m - m0) * K4_BLOCK_ROWS + r], a->dtype);
    }
    count = 0;
  }
  for (int r = 0; r < count; r++)
    for (int64_t m0 = 0, R; m0 < x->rows; m0 += R) {
      R = chunk_rows(x->rows, m0, A8_ROWS);
      row_to_y(a, (int)R, 1, GGML_TYPE_Q4_K, rows[r], outputs[r], m0);
    }
}
#endif

static void a8_range(void *p, int64_t n0, int64_t n1) {
  const a8_args *a = p;
  const rounded_x *x = a->x;
  const int64_t k = x->k;
  const int64_t streams = a->streams;
  const int64_t len = (n1 - n0 + streams - 1) / streams;
#if defined(__AVX2__) && defined(__FMA__)
  /* One x row read as one stream (split hosts' long rows): the products are too short for the
   * software prefetches to lead, and the hardware prefetchers, left alone, keep further ahead */
  const int prefetch = !(x->rows == 1 && streams == 1);
#else
  float *decoded = (float *)malloc((size_t)(TILE_ROWS * k) * sizeof(float));
  if (decoded == NULL) abort(); /* a few KB: out of memory is not recoverable here */
  uint8_t stored[STORED_ROW_BYTES(k)]; /* a quads row in the file's layout */
#endif
  const int64_t positions = len * streams;
#ifdef K4_BLOCKS
  const int blocks = x->rows >= K4_BLOCK_MIN_XROWS; /* Q4_K rows: k4_tile_blocks' */
#else
  const int blocks = 0;
  (void)blocks; /* read only where the products are AVX2's */
#endif
  for (int64_t t0 = 0; t0 < positions; t0 += TILE_ROWS) {
    const int64_t t1 = t0 + TILE_ROWS < positions ? t0 + TILE_ROWS : positions;
#ifdef K4_BLOCKS
    if (blocks) k4_tile_blocks(a, t0, t1, n0, n1, len);
#endif
#if !(defined(__AVX2__) && defined(__FMA__))
    for (int64_t v = t0; v < t1; v++) {
      const int64_t n = stream_row(v, n0, len, streams);
      if (n >= n1) continue;
      int64_t type;
      const void *row = gguf_stored_row(a->parts, n, k, stored, &type);
      gguf_decode_row(type, row, k, decoded + (v - t0) * k);
    }
#endif
    for (int64_t m0 = 0, R; m0 < x->rows; m0 += R) {
      R = chunk_rows(x->rows, m0, A8_ROWS);
      for (int64_t v = t0; v < t1; v++) {
        const int64_t n = stream_row(v, n0, len, streams);
        if (n >= n1) continue;
#if defined(__AVX2__) && defined(__FMA__)
        int64_t type;
        const uint8_t *row = stacked_row(a->parts, n, k, &type);
        if (blocks && type == GGML_TYPE_Q4_K) continue; /* k4_tile_blocks' */
        row_to_y(a, (int)R, prefetch, type, row, n, m0);
#else
        float out[A8_ROWS];
        row_products_decoded(R, decoded + (v - t0) * k, x, m0, out);
        for (int m = 0; m < R; m++) store(a->y, (m0 + m) * a->n_out + n, out[m], a->dtype);
#endif
      }
    }
  }
#if !(defined(__AVX2__) && defined(__FMA__))
  free(decoded);
#endif
}

int gguf_gemv_a8(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                 int64_t n_out, int64_t k, int threads, int row_independent) {
  if (rows < 1 || k % QK || !gguf_parts_valid(parts, n_out, k)) return -1;
  const int split = (int)vectors_512_split();
  /* x in the lane order too where Q4_K parts take k4_row_lanes. With VNNI (split 512-bit
   * operations) for several rows only: one row's product is bound by reading the weight, and
   * the transposes cost it more than the fewer products save; never where every row count must
   * give the same bits. On AVX2 builds for every row count: cheaper for one row too, and every
   * row's result the same bits whatever the rows */
  const int q4k = type_rows(parts, n_out, GGML_TYPE_Q4_K) > 0;
#ifdef K4_LANES_VNNI
  const int lanes = split && rows >= 2 && !row_independent && q4k;
#else /* round_x ignores it where K4_LANES is not built */
  const int lanes = q4k;
  (void)row_independent;
#endif
  rounded_x rx;
  if (round_x(dtype, x, rows, k, threads, lanes, &rx)) return -1;
  a8_args a = {dtype, &rx, parts, y, n_out, split, row_streams(parts, k, split)};
  const int64_t pieces = 4 * (threads > 1 ? threads : 1);
  int64_t chunk = ((n_out + pieces - 1) / pieces + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  if (chunk < 32) chunk = 32;
  parallel_range(a8_range, &a, n_out, chunk, threads, rows * n_out * k >= 65536);
  free_rounded(&rx);
  return 0;
}
