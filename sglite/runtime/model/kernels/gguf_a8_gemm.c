/*
 * GGUF weights (Q4_K, Q6_K and the blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) times many x rows
 * rounded to int8 (gguf_a8.c's rounding): y = x W^T with
 * 512-bit VNNI dot products, for decode batches of many rows and bf16 prefill, where the GEMV
 * (gguf_a8.c), which decodes a weight row once per 4 x rows and reduces each row's sums across
 * lanes, is bound by that work rather than by the products.
 *
 * Layout: a block of 16 weight rows is decoded, one super-block (256 values) at a time, into 64
 * vectors whose 32-bit lane r holds 4 consecutive integers of weight row r: the rows' bytes are
 * transposed as stored (16x16 transposes of 32-bit groups) and split into integers afterwards,
 * the 16 rows' scales unpacked as vectors at once. An x row's 4 rounded values are then broadcast as `vpdpbusd`'s signed
 * operand: one instruction adds 4 products to each of the 16 rows' sums, no horizontal sums.
 * A group's integer sums (32 values for Q4_K, 16 for Q6_K) are converted once and scaled by
 * the 16 rows' group scales as a vector. The K-quants' offsets stay in the integers, off the
 * unit the products use (a float multiply-add per group and x row there costs an eighth of the
 * products): Q6_K's -32 starts each group's sum at -32 times x's sum over it, Q4_K's mins times
 * x's group sums take one `vpdpwssd` per two groups, scaled by dmin once per super-block. Each
 * super-block is decoded once for all x rows. Blocks of 32
 * are decoded 64 values (two blocks) at a time the same way (gguf_a8_gemm_pairs.h), their unsigned integers as stored
 * (Q8_0's signed ones plus 128, taken back through its offset) and each group's products scaled
 * by its block's d and x's group scale (dx32: x's span may be 32 values there). A tiled k-quant
 * super-block (gguf_tiles.h: the 16 rows' words already in lane order) is not decoded into a
 * buffer while the x rows fit a chunk: its integers are built in registers as they are
 * multiplied, six x rows at a time (gguf_a8_tiled_rows.h), which spares the decoded
 * vectors' stores and loads (at one row those cost about what the products do).
 *
 * Values: the dequantized weight times the rounded x, as gguf_a8.c computes it, to float
 * rounding (the sums' order differs from the GEMV's). A row's result depends on that x row
 * alone: every output sums its groups in one fixed order whatever the row count.
 */
#include "a8_rounding.h"
#include "gguf_bits.h"
#include "gguf_tiles.h"

#define QK_K 256
/* Weight rows a decoded block covers: one 32-bit lane each (gguf_a8_gemm_decode.h). */
#define WROWS 16

static int is_k_quant(int64_t type) {
  const int64_t stored = untiled_type(type);
  return stored == GGML_TYPE_Q4_K || stored == GGML_TYPE_Q6_K;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && \
    defined(__AVX2__) && defined(__FMA__)
#include "gguf_a8_gemm_decode.h"

/* The products' loops (block_rows to block_row_range) are compiled with GCC's loop unrolling:
 * 1.02-1.03x on the 1.5B's projections at 1000 rows, unchanged at 4-12 (docs/benchmarks.md). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("unroll-loops")
#endif

/* X rows taken together against a decoded block: their sums are independent chains of
 * `vpdpbusd` (its latency hidden) and each weight vector loaded is used R times. */
#define GEMM_ROWS 6

/* sums[m] (products) += the block's products with x rows m0..m0+R-1 over super-block sb (groups
 * of `size` values: 32, Q4_K; 16, Q6_K). The offsets are taken in the integer sums: Q6_K's -32
 * as each group's sum's start (q6k_starts: -32 times x's sum over the group), Q4_K's mins as one
 * `vpdpwssd` per two groups (the mins and x's group sums as int16 pairs), scaled by dmin once
 * per super-block. */
static inline __attribute__((always_inline)) void block_rows(const int R, const int size,
                                                             const decoded_block *blk,
                                                             const rounded_x *x,
                                                             const int32_t *q6k_starts,
                                                             int64_t m0, int64_t sb, float *sums) {
  const int64_t k = x->k;
  __m512 total[GEMM_ROWS];
  for (int m = 0; m < R; m++) total[m] = _mm512_setzero_ps();
  /* Few x rows: a row's group sum as `chains` independent chains of `vpdpbusd` (its latency
   * is several cycles), added at the end (integers: the same sum). */
  const int chains = R == 1 ? 4 : R == 2 ? 2 : 1;
  for (int j = 0; j < QK_K / size; j++) {
    __m512i dot[GEMM_ROWS][4];
    for (int m = 0; m < R; m++) {
      dot[m][0] = size == 32 ? _mm512_setzero_si512()
                             : _mm512_set1_epi32(q6k_starts[(m0 + m) * (k / 16) + sb * 16 + j]);
      for (int c = 1; c < chains; c++) dot[m][c] = _mm512_setzero_si512();
    }
    for (int q = 0; q < size / 4; q++) {
      const __m512i w = _mm512_load_si512((const void *)&blk->w[(size / 4) * j + q]);
      for (int m = 0; m < R; m++) {
        int32_t four;
        memcpy(&four, x->q + (m0 + m) * k + sb * QK_K + size * j + 4 * q, 4);
        dot[m][q % chains] = _mm512_dpbusd_epi32(dot[m][q % chains], w, _mm512_set1_epi32(four));
      }
    }
    for (int m = 0; m < R; m++)
      for (int c = 1; c < chains; c++) dot[m][0] = _mm512_add_epi32(dot[m][0], dot[m][c]);
    const __m512 scale = _mm512_load_ps(blk->scale[j]);
    for (int m = 0; m < R; m++)
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), scale, total[m]);
  }
  for (int m = 0; m < R; m++) add_row_total(size == 32, blk, x, m0 + m, sb, total[m], sums);
}

#include "gguf_a8_tiled_rows.h"

#include "gguf_a8_gemm_pairs.h"

/* The rows left after whole passes (fewer than GEMM_ROWS, or PAIR_ROWS), each count compiled
 * (R is a constant in each call). */
#define TAIL_CASES_3(call)    \
  case 1: call(1); break; \
  case 2: call(2); break; \
  case 3: call(3); break;
#define TAIL_CASES_5(call)    \
  TAIL_CASES_3(call)      \
  case 4: call(4); break; \
  case 5: call(5); break;
_Static_assert(GEMM_ROWS == 6 && PAIR_ROWS == 4 && FUSED_ROWS == 6,
               "the tail cases cover a pass's rows but one");

/* pair_rows for x rows [m0, m1). */
static void pair_row_range(const decoded_pair *blk, const rounded_x *x, int64_t p, int64_t m0,
                           int64_t m1, float *sums) {
  for (; m0 + PAIR_ROWS <= m1; m0 += PAIR_ROWS) pair_rows(PAIR_ROWS, blk, x, m0, p, sums);
#define PAIR(R) pair_rows(R, blk, x, m0, p, sums)
  switch (m1 - m0) { TAIL_CASES_3(PAIR) default: break; }
#undef PAIR
}

/* block_rows for x rows [m0, m1) over groups of `size` values (32: Q4_K, 16: Q6_K). */
static inline __attribute__((always_inline)) void block_range(const int size,
                                                              const decoded_block *blk,
                                                              const rounded_x *x,
                                                              const int32_t *q6k_starts,
                                                              int64_t sb, int64_t m0, int64_t m1,
                                                              float *sums) {
  for (; m0 + GEMM_ROWS <= m1; m0 += GEMM_ROWS)
    block_rows(GEMM_ROWS, size, blk, x, q6k_starts, m0, sb, sums);
#define BLOCK(R) block_rows(R, size, blk, x, q6k_starts, m0, sb, sums)
  switch (m1 - m0) { TAIL_CASES_5(BLOCK) default: break; }
#undef BLOCK
}

/* block_rows for x rows [m0, m1), R compiled per count and block type. */
static void block_row_range(int64_t type, const decoded_block *blk, const rounded_x *x,
                            const int32_t *q6k_starts, int64_t sb, int64_t m0, int64_t m1,
                            float *sums) {
  if (untiled_type(type) == GGML_TYPE_Q4_K)
    block_range(32, blk, x, NULL, sb, m0, m1, sums);
  else
    block_range(16, blk, x, q6k_starts, sb, m0, m1, sums);
}

/* A tiled k-quant super-block (`type`: GGUF_TILED_Q4_K or _Q6_K) times x rows [m0, m1): its
 * integers built as they are multiplied, FUSED_ROWS rows at a time; R compiled per count. */
static void tiled_rows(int64_t type, const uint8_t *tiled, const rounded_x *x,
                       const int32_t *starts, int64_t sb, int64_t m0, int64_t m1,
                       decoded_block *blk, float *sums) {
#define Q4K(R) q4k_tiled_rows(R, tiled, x, m0, sb, blk, sums)
#define Q6K(R) q6k_tiled_rows(R, tiled, x, starts, m0, sb, blk, sums)
  if (type == GGUF_TILED_Q4_K) {
    for (; m0 + FUSED_ROWS <= m1; m0 += FUSED_ROWS) Q4K(FUSED_ROWS);
    switch (m1 - m0) { TAIL_CASES_5(Q4K) default: break; }
  } else {
    for (; m0 + FUSED_ROWS <= m1; m0 += FUSED_ROWS) Q6K(FUSED_ROWS);
    switch (m1 - m0) { TAIL_CASES_5(Q6K) default: break; }
  }
#undef Q4K
#undef Q6K
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

typedef struct {
  int dtype;
  int act; /* -1: y = x W^T; else ACT_*: y [rows, n_out / 2] = act(gate) * up (W = [gate; up]) */
  const rounded_x *x;
  const int32_t *q6k_starts; /* q6k_group_starts (NULL without Q6_K parts) */
  const gguf_part_t *parts;
  void *y;
  int64_t n_out;
  int two_streams; /* range_position's */
  int failed;
} gemm_args;

/* Bytes of rounded x a thread multiplies against the decoded super-blocks before moving on
 * (a chunk of x rows): kept in L2 with them, rather than every x row streamed from memory once
 * per block of 16 weight rows in a prefill's thousand rows. */
#define X_CHUNK_BYTES (256 << 10)

/* Pair p of the 16 rows at rows[r] decoded, the next block's (`next`, or NULL) prefetched: a
 * tiled part's rows[r] = the tile + r times a sixteenth of a tiled pair's bytes, each row a
 * slice of them. */
static void decode_pair_at(int64_t type, const uint8_t *const rows[WROWS],
                           const uint8_t *const next[WROWS], int64_t p, decoded_pair *out) {
  if (type == GGUF_TILED_Q5_0) {
    prefetch_next(next, p * 2 * TILED_Q5_0_BLOCK_BYTES, 44);
    tiled_q5_0_pair(rows[0], p, out->w, out->scale, out->offset);
  } else if (type == GGUF_TILED_Q8_0) {
    prefetch_next(next, p * 2 * TILED_Q8_0_BLOCK_BYTES, 68);
    tiled_q8_0_pair(rows[0], p, out->w, out->scale, out->offset);
  } else {
    const int64_t pair_bytes = 2 * type_block_bytes(type);
    prefetch_next(next, p * pair_bytes, pair_bytes);
    decode_pair(type, rows, p, out);
  }
}

/* One block of 16 weight rows (n..n+15, block type `type`, at rows[r]) against every x row into
 * sums: its super-blocks (or pairs of blocks of 32) decoded once into `decoded`, then
 * multiplied by the x rows a chunk at a time; the next block's rows (`next`, of the same
 * type; NULL for none) are prefetched as this one decodes. */
static void gemm_block(int64_t type, const uint8_t *const rows[WROWS],
                       const uint8_t *const next[WROWS], const rounded_x *x,
                       const int32_t *q6k_starts, void *decoded, float *sums) {
  const int64_t k = x->k;
  int64_t chunk = X_CHUNK_BYTES / k / GEMM_ROWS * GEMM_ROWS;
  if (chunk < GEMM_ROWS) chunk = GEMM_ROWS;
  memset(sums, 0, (size_t)(2 * x->rows * WROWS) * sizeof(float));
  if (is_k_quant(type)) {
    decoded_block *blk = decoded;
    /* a tiled block prefetches as it loads (load_ahead), the file's rows the next block's */
    const int64_t sb_bytes = type_block_bytes(untiled_type(type));
    const uint8_t *const *ahead = type == untiled_type(type) ? next : NULL;
    if (x->rows <= chunk && type != untiled_type(type)) { /* multiplied as it is built */
      const int64_t tiled_bytes =
          type == GGUF_TILED_Q4_K ? TILED_Q4_K_SB_BYTES : TILED_Q6_K_SB_BYTES;
      for (int64_t sb = 0; sb < k / QK_K; sb++)
        tiled_rows(type, rows[0] + sb * tiled_bytes, x, q6k_starts, sb, 0, x->rows, blk, sums);
      return;
    }
    if (x->rows <= chunk) { /* each super-block multiplied as it is decoded, still in L1 */
      for (int64_t sb = 0; sb < k / QK_K; sb++) {
        prefetch_next(ahead, sb * sb_bytes, sb_bytes);
        decode_block(type, rows, sb, blk);
        block_row_range(type, blk, x, q6k_starts, sb, 0, x->rows, sums);
      }
      return;
    }
    for (int64_t sb = 0; sb < k / QK_K; sb++) {
      prefetch_next(ahead, sb * sb_bytes, sb_bytes);
      decode_block(type, rows, sb, blk + sb);
    }
    for (int64_t m0 = 0; m0 < x->rows; m0 += chunk) {
      const int64_t m1 = m0 + chunk < x->rows ? m0 + chunk : x->rows;
      for (int64_t sb = 0; sb < k / QK_K; sb++)
        block_row_range(type, blk + sb, x, q6k_starts, sb, m0, m1, sums);
    }
    return;
  }
  decoded_pair *pairs = decoded;
  const int fused = x->rows <= chunk; /* each pair multiplied as it is decoded, still in L1 */
  for (int64_t p = 0; p < k / 64; p++) {
    decoded_pair *pair = fused ? pairs : pairs + p;
    decode_pair_at(type, rows, next, p, pair);
    if (fused) pair_row_range(pair, x, p, 0, x->rows, sums);
  }
  if (fused) return;
  for (int64_t m0 = 0; m0 < x->rows; m0 += chunk) {
    const int64_t m1 = m0 + chunk < x->rows ? m0 + chunk : x->rows;
    for (int64_t p = 0; p < k / 64; p++) pair_row_range(pairs + p, x, p, m0, m1, sums);
  }
}

/* The 16 rows of weight row block bi (rows[r] = row 16 bi + r) and their block type; in a
 * tiled part, rows[r] = the tile + r times 44 (Q5_0) or a super-block's bytes (gemm_block). */
static void block_rows_at(const gguf_part_t *parts, int64_t bi, int64_t k,
                          const uint8_t *rows[WROWS], int64_t *type) {
  int64_t n = bi * WROWS;
  while (n >= parts->rows) n -= (parts++)->rows;
  if (parts->type > GGUF_TILED_BASE) {
    /* rows[r]: row r's sixteenth of a tiled decoding unit (a super-block, a pair of blocks) */
    const int64_t stored = untiled_type(parts->type), bytes = type_block_bytes(stored);
    const int64_t row_bytes = k / type_block_values(stored) * bytes;
    const uint8_t *tile = (const uint8_t *)parts->data + n * row_bytes;
    const int64_t unit = is_k_quant(stored) ? bytes : 2 * bytes;
    for (int r = 0; r < WROWS; r++) rows[r] = tile + unit * r;
    *type = parts->type;
    return;
  }
  for (int r = 0; r < WROWS; r++) rows[r] = stacked_row(parts, n + r, k, type);
}

/* Row m's 16 outputs of a block's sums (products less offsets). */
static inline __m512 block_out(const float *sums, int64_t m) {
  const float *acc = sums + 2 * m * WROWS;
  return _mm512_sub_ps(_mm512_load_ps(acc), _mm512_load_ps(acc + WROWS));
}

/* act(gate) * up of 16 columns of every x row into y [rows, n_out / 2] at column `col`: gate
 * and up rounded to the dtype, then act_mul's vgated (common.h). */
static void store_glu(const gemm_args *a, const float *gate, const float *up, int64_t col) {
  const int gelu = a->act == ACT_GELU_TANH;
  for (int64_t m = 0; m < a->x->rows; m++) {
    const __m512 g = vround_to(block_out(gate, m), a->dtype);
    const __m512 u = vround_to(block_out(up, m), a->dtype);
    vstore_as(a->y, m * (a->n_out / 2) + col, vgated(g, u, gelu), a->dtype);
  }
}

/* The weight row blocks a range's position i stands for: block i, or with act >= 0 gate block
 * i / 2 (i even) and the up block of the same columns (i odd). */
static int64_t range_block(const gemm_args *a, int64_t i) {
  return a->act < 0 ? i : i / 2 + (i & 1) * (a->n_out / 2 / WROWS);
}

/* The range position a thread takes j-th of its n (in units of `unit` positions, a gate block
 * and its up block together): with `two`, the units of the range's two halves in turn, so that
 * a thread reads its weights as two streams, which keep more of the memory's reads in flight
 * than one (tiled weights are one contiguous stream per range); else in order, one stream,
 * which reads faster where 512-bit operations run as two halves (AMD Zen 4: a whole 1.5B pass
 * of tiled Q4_K 0.92-0.98x the two streams' time at 1 to 16 rows, the file's rows 0.98-1.0x),
 * as the GEMV's rows there. */
static inline int64_t range_position(int two, int64_t j, int64_t n, int64_t unit) {
  if (!two) return j;
  const int64_t units = n / unit, half = (units + 1) / 2, u = j / unit;
  return ((u & 1) ? half + u / 2 : u / 2) * unit + j % unit;
}

/* Weight row blocks at range positions [b0, b1) (of 16 rows) against every x row: each block's
 * outputs stored as it is done, or with act >= 0 each gate block's and its up block's together
 * (positions in pairs). */
static void gemm_range(void *p, int64_t b0, int64_t b1) {
  gemm_args *a = p;
  const rounded_x *x = a->x;
  const int64_t k = x->k, rows = x->rows;
  const size_t by_blocks = (size_t)(k / QK_K) * sizeof(decoded_block);
  const size_t by_pairs = (size_t)(k / 64) * sizeof(decoded_pair);
  const size_t sums_bytes = (size_t)(2 * rows * WROWS) * sizeof(float);
  void *decoded = aligned_alloc(64, by_blocks > by_pairs ? by_blocks : by_pairs);
  float *sums = aligned_alloc(64, 2 * sums_bytes); /* a gate block's, then its up block's */
  if (decoded == NULL || sums == NULL) {
    free(decoded);
    free(sums);
    a->failed = 1;
    return;
  }
  const int64_t unit = a->act >= 0 ? 2 : 1, n = (b1 - b0) * unit;
  b0 *= unit;
  const uint8_t *row_at[WROWS], *next_at[WROWS];
  int64_t type = -1, next_type = -1;
  if (n > 0) block_rows_at(a->parts, range_block(a, b0), k, row_at, &type);
  for (int64_t j = 0; j < n; j++) {
    const int64_t i = b0 + range_position(a->two_streams, j, n, unit);
    const int has_next = j + 1 < n;
    if (has_next) {
      const int64_t next = b0 + range_position(a->two_streams, j + 1, n, unit);
      block_rows_at(a->parts, range_block(a, next), k, next_at, &next_type);
    }
    float *block_sums = sums + (a->act >= 0 && (i & 1) ? 2 * rows * WROWS : 0);
    /* a next block of another part's type has other row sizes: not prefetched */
    gemm_block(type, row_at, has_next && next_type == type ? next_at : NULL, x, a->q6k_starts,
               decoded, block_sums);
    if (a->act >= 0) {
      if (i & 1) store_glu(a, sums, block_sums, (i / 2) * WROWS);
    } else {
      for (int64_t m = 0; m < rows; m++)
        vstore_as(a->y, m * a->n_out + i * WROWS, block_out(sums, m), a->dtype);
    }
    if (has_next) {
      memcpy(row_at, next_at, sizeof(row_at));
      type = next_type;
    }
  }
  free(decoded);
  free(sums);
}

/* Whether every part is of a block type read here, in whole blocks of 16 rows and of k's
 * decoding units (super-blocks of 256, pairs of blocks of 32). */
static int parts_fit(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  for (int64_t seen = 0, i = 0; seen < n_out; seen += parts[i].rows, i++) {
    const int64_t type = untiled_type(parts[i].type);
    const int64_t unit = is_k_quant(type) ? QK_K : type_block_values(type) == 32 ? 64 : 0;
    if (unit == 0 || k % unit || parts[i].rows % WROWS || type == GGUF_QUADS_Q5_0) return 0;
  }
  return 1;
}

/* Whether gguf_gemm_a8 serves a weight of these parts (tiled ones read as their untiled type's;
 * not a part in quads). */
static int gemm_serves(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  gguf_part_t as_stored[GGUF_MAX_PARTS];
  untiled_parts(parts, n_out, as_stored);
  return gguf_parts_valid(as_stored, n_out, k) && parts_fit(parts, n_out, k);
}

/* Q6_K's -32 per group of 16 in x's integer sums: -32 times x's sum over each 16 values,
 * [rows, k / 16] (NULL when out of memory). */
static int32_t *q6k_group_starts(const rounded_x *rx) {
  const int64_t n = rx->rows * (rx->k / 16);
  int32_t *starts = malloc((size_t)n * sizeof(int32_t));
  if (starts != NULL)
    for (int64_t i = 0; i < n; i++) starts[i] = -32 * (int32_t)rx->sum16[i];
  return starts;
}

/* gguf_gemm_a8, or with act >= 0 its gated form (see gemm_args). */
static int gemm_a8(int dtype, int act, const void *x, const gguf_part_t *parts, void *y,
                   int64_t rows, int64_t n_out, int64_t k, int threads) {
  if (rows < 1 || !gemm_serves(parts, n_out, k)) return -1;
  if (act >= 0 && n_out % (2 * WROWS)) return -1; /* whole gate blocks, up blocks alike */
  rounded_x rx;
  if (round_x(dtype, x, rows, k, threads, 0, &rx)) return -1;
  int32_t *q6k_starts = NULL;
  const int64_t q6k = q6k_rows(parts, n_out) + type_rows(parts, n_out, GGUF_TILED_Q6_K);
  if (q6k > 0 && (q6k_starts = q6k_group_starts(&rx)) == NULL) {
    free_rounded(&rx);
    return -1;
  }
  gemm_args a = {dtype, act, &rx, q6k_starts, parts, y, n_out, !vectors_512_split(), 0};
  const int64_t blocks = (act >= 0 ? n_out / 2 : n_out) / WROWS;
  const int64_t pieces = 4 * (threads > 1 ? threads : 1);
  const int64_t chunk = (blocks + pieces - 1) / pieces;
  parallel_range(gemm_range, &a, blocks, chunk > 0 ? chunk : 1, threads, 1);
  free(q6k_starts);
  free_rounded(&rx);
  return a.failed ? -1 : 0;
}

int gguf_gemm_a8(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                 int64_t n_out, int64_t k, int threads) {
  return gemm_a8(dtype, -1, x, parts, y, rows, n_out, k, threads);
}

int gguf_gemm_a8_glu(int dtype, int act, const void *x, const gguf_part_t *parts, void *y,
                     int64_t rows, int64_t n_out, int64_t k, int threads) {
  if (act != ACT_SILU && act != ACT_GELU_TANH) return -1;
  return gemm_a8(dtype, act, x, parts, y, rows, n_out, k, threads);
}
#else
int gguf_gemm_a8(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                 int64_t n_out, int64_t k, int threads) {
  (void)dtype, (void)x, (void)parts, (void)y, (void)rows, (void)n_out, (void)k, (void)threads;
  return -1;
}

int gguf_gemm_a8_glu(int dtype, int act, const void *x, const gguf_part_t *parts, void *y,
                     int64_t rows, int64_t n_out, int64_t k, int threads) {
  (void)dtype, (void)act, (void)x, (void)parts, (void)y, (void)rows, (void)n_out, (void)k;
  (void)threads;
  return -1;
}

static int gemm_serves(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  (void)parts, (void)n_out, (void)k;
  return 0;
}
#endif

int64_t gguf_a8_gemm_min_rows(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  if (!gemm_serves(parts, n_out, k)) return KERNEL_OFF_ROWS;
  for (int64_t i = 0, covered = 0; covered < n_out; covered += parts[i++].rows)
    if (parts[i].type > GGUF_TILED_BASE) return 1;
  const int q6k = q6k_mostly(parts, n_out);
  if (!vectors_512_split()) return q6k ? A8_GEMM_MIN_ROWS_Q6_K : A8_GEMM_MIN_ROWS;
  if (!is_k_quant(parts->type)) return A8_GEMM_MIN_ROWS_B32_SPLIT;
  if (gguf_row_bytes(parts->type, k) > SHORT_ROW_BYTES) return A8_GEMM_MIN_ROWS_LONG_SPLIT;
  return q6k ? A8_GEMM_MIN_ROWS_Q6_K_SPLIT : A8_GEMM_MIN_ROWS_SPLIT;
}
