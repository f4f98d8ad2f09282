/*
 * GGUF weights (Q4_K, Q6_K and the blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) times many x rows
 * rounded to int8 (gguf_a8.c's rounding): y = x W^T with
 * 512-bit VNNI dot products, for decode batches of many rows and bf16 prefill, where the GEMV
 * (gguf_a8.c), which decodes a weight row once per 4 x rows and reduces each row's sums across
 * lanes, is bound by that work rather than by the products.
 *
 * Layout: a block of 16 weight rows is decoded, one super-block (256 values) at a time, into 64
 * vectors whose 32-bit lane r holds 4 consecutive integers of weight row r (a 16x16 transpose
 * of 32-bit groups). An x row's 4 rounded values are then broadcast as `vpdpbusd`'s signed
 * operand: one instruction adds 4 products to each of the 16 rows' sums, no horizontal sums.
 * A group's integer sums (32 values for Q4_K, 16 for Q6_K) are converted once and scaled by
 * the 16 rows' group scales as a vector; the offsets (Q4_K's mins, Q6_K's -32) by x's group sums
 * (rounded_x's dxsum32 / sum16). Each super-block is decoded once for all x rows. Blocks of 32
 * are decoded 64 values (two blocks) at a time the same way, their unsigned integers as stored
 * (Q8_0's signed ones plus 128, taken back through its offset) and each group's products scaled
 * by its block's d and x's group scale (dx32: x's span may be 32 values there).
 *
 * Values: the dequantized weight times the rounded x, as gguf_a8.c computes it, to float
 * rounding (the sums' order differs from the GEMV's). A row's result depends on that x row
 * alone: every output sums its groups in one fixed order whatever the row count.
 */
#include "a8_rounding.h"
#include "gguf_bits.h"

#define QK_K 256
/* Weight rows a decoded block covers: one 32-bit lane each. */
#define WROWS 16

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && \
    defined(__AVX2__) && defined(__FMA__)
#include "transpose16.h"

/* One super-block of 16 weight rows, decoded. */
typedef struct {
  __m512i w[QK_K / 4];  /* w[g]: values 4g..4g+3 of each row, row r in lane r */
  float scale[16][WROWS];  /* group j's scale of each row (8 groups of 32, or 16 of 16) */
  float offset[16][WROWS]; /* group j's offset per unit of x's group sum */
} decoded_block;

/* The 64 values 64c..64c+63 of a row (as bytes, in order) for c = 0..3 -> v[c][r]. */
static inline void q4k_row(const uint8_t *b, int r, decoded_block *out, __m512i v[4][WROWS]) {
  const float d = half(b), dmin = half(b + 2);
  uint32_t sc[2], mn[2];
  k_scales8(b + 4, sc, mn);
  for (int j = 0; j < 8; j++) {
    out->scale[j][r] = d * (float)((sc[j >> 2] >> (8 * (j & 3))) & 0xff);
    out->offset[j][r] = dmin * (float)((mn[j >> 2] >> (8 * (j & 3))) & 0xff);
  }
  for (int c = 0; c < 4; c++) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
    v[c][r] = _mm512_inserti64x4(_mm512_castsi256_si512(low4(packed)), high4(packed), 1);
  }
}

static inline void q6k_row(const uint8_t *b, int r, decoded_block *out, __m512i v[4][WROWS]) {
  const float d = half(b + 208);
  for (int j = 0; j < 16; j++) {
    const float scale = d * (float)(int8_t)b[192 + j];
    out->scale[j][r] = scale;
    out->offset[j][r] = 32.0f * scale;
  }
  const __m256i bias = _mm256_set1_epi8(32); /* back to q in 0..63: vpdpbusd's unsigned side */
  for (int h = 0; h < 2; h++) {
    __m256i q[4];
    q6k_half(b, h, q);
    for (int i = 0; i < 4; i++) q[i] = _mm256_add_epi8(q[i], bias);
    v[2 * h][r] = _mm512_inserti64x4(_mm512_castsi256_si512(q[0]), q[1], 1);
    v[2 * h + 1][r] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2]), q[3], 1);
  }
}

/* Super-block sb of the 16 weight rows at rows[r] (Q4_K or Q6_K: `type`). */
static void decode_block(int64_t type, const uint8_t *const rows[WROWS], int64_t sb,
                         decoded_block *out) {
  __m512i v[4][WROWS];
  for (int r = 0; r < WROWS; r++) {
    if (type == GGML_TYPE_Q4_K)
      q4k_row(rows[r] + sb * 144, r, out, v);
    else
      q6k_row(rows[r] + sb * 210, r, out, v);
  }
  for (int c = 0; c < 4; c++) {
    transpose16(v[c]);
    for (int j = 0; j < 16; j++) out->w[16 * c + j] = v[c][j];
  }
}

/* X rows taken together against a decoded block: their sums are independent chains of
 * `vpdpbusd` (its latency hidden) and each weight vector loaded is used R times. */
#define GEMM_ROWS 4

/* sums[m] (2 vectors: products, offsets) += the block's products with x rows m0..m0+R-1 over
 * super-block sb (groups of `size` values). */
static inline __attribute__((always_inline)) void block_rows(const int R, const int size,
                                                             const decoded_block *blk,
                                                             const rounded_x *x, int64_t m0,
                                                             int64_t sb, float *sums) {
  const int64_t k = x->k, blocks = k / QK_K;
  __m512 total[GEMM_ROWS], off[GEMM_ROWS];
  for (int m = 0; m < R; m++) {
    total[m] = _mm512_setzero_ps();
    off[m] = _mm512_load_ps(sums + (2 * (m0 + m) + 1) * WROWS);
  }
  for (int j = 0; j < QK_K / size; j++) {
    __m512i dot[GEMM_ROWS][2];
    for (int m = 0; m < R; m++) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    for (int q = 0; q < size / 4; q++) {
      const __m512i w = _mm512_load_si512((const void *)&blk->w[(size / 4) * j + q]);
      for (int m = 0; m < R; m++) {
        int32_t four;
        memcpy(&four, x->q + (m0 + m) * k + sb * QK_K + size * j + 4 * q, 4);
        dot[m][q & 1] = _mm512_dpbusd_epi32(dot[m][q & 1], w, _mm512_set1_epi32(four));
      }
    }
    const __m512 scale = _mm512_load_ps(blk->scale[j]), offset = _mm512_load_ps(blk->offset[j]);
    for (int m = 0; m < R; m++) {
      const int64_t i = m0 + m;
      const __m512i both = _mm512_add_epi32(dot[m][0], dot[m][1]);
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), scale, total[m]);
      const float xsum = size == 32 ? x->dxsum32[i * (k / 32) + sb * 8 + j]
                                    : x->dx[i * blocks + sb] * (float)x->sum16[i * (k / 16) + sb * 16 + j];
      off[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum), off[m]);
    }
  }
  for (int m = 0; m < R; m++) {
    float *acc = sums + 2 * (m0 + m) * WROWS;
    const __m512 dx = _mm512_set1_ps(x->dx[(m0 + m) * blocks + sb]);
    _mm512_store_ps(acc, _mm512_fmadd_ps(total[m], dx, _mm512_load_ps(acc)));
    _mm512_store_ps(acc + WROWS, off[m]);
  }
}

/* Two blocks of 32 (64 values) of 16 weight rows, decoded. */
typedef struct {
  __m512i w[16];           /* w[g]: values 4g..4g+3 of each row, row r in lane r */
  float scale[2][WROWS];   /* block j's d of each row */
  float offset[2][WROWS];  /* block j's offset per unit of x's group sum (subtracted) */
} decoded_pair;

/* Blocks 2p and 2p + 1 of the 16 weight rows at rows[r] (block type `type`). */
static void decode_pair(int64_t type, const uint8_t *const rows[WROWS], int64_t p,
                        decoded_pair *out) {
  const int64_t bytes = type_block_bytes(type);
  /* vpdpbusd multiplies unsigned weight bytes: Q8_0's signed values go up by 128 */
  const int q8 = type == GGML_TYPE_Q8_0;
  __m512i v[WROWS];
  for (int r = 0; r < WROWS; r++) {
    const uint8_t *b = rows[r] + 2 * p * bytes;
    v[r] = b32_pair_ints(type, b, bytes);
    if (q8) v[r] = _mm512_xor_si512(v[r], _mm512_set1_epi8((char)0x80));
    for (int j = 0; j < 2; j++) {
      float mn;
      const float d = b32_scale(type, b + j * bytes, &mn);
      out->scale[j][r] = d;
      out->offset[j][r] = (q8 ? 128.0f * d : 0.0f) - mn;
    }
  }
  transpose16(v);
  for (int g = 0; g < 16; g++) out->w[g] = v[g];
}

/* sums[m] (2 vectors: products, offsets) += the decoded pair p's products with x rows
 * m0..m0+R-1: each block's integer sums scaled by its d and x's dx32. */
static inline __attribute__((always_inline)) void pair_rows(const int R, const decoded_pair *blk,
                                                            const rounded_x *x, int64_t m0,
                                                            int64_t p, float *sums) {
  const int64_t k = x->k, groups = k / 32;
  __m512 total[GEMM_ROWS], off[GEMM_ROWS];
  for (int m = 0; m < R; m++) {
    total[m] = _mm512_load_ps(sums + 2 * (m0 + m) * WROWS);
    off[m] = _mm512_load_ps(sums + (2 * (m0 + m) + 1) * WROWS);
  }
  for (int j = 0; j < 2; j++) {
    __m512i dot[GEMM_ROWS][2];
    for (int m = 0; m < R; m++) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    for (int q = 0; q < 8; q++) {
      const __m512i w = _mm512_load_si512((const void *)&blk->w[8 * j + q]);
      for (int m = 0; m < R; m++) {
        int32_t four;
        memcpy(&four, x->q + (m0 + m) * k + 64 * p + 32 * j + 4 * q, 4);
        dot[m][q & 1] = _mm512_dpbusd_epi32(dot[m][q & 1], w, _mm512_set1_epi32(four));
      }
    }
    const __m512 scale = _mm512_load_ps(blk->scale[j]), offset = _mm512_load_ps(blk->offset[j]);
    for (int m = 0; m < R; m++) {
      const int64_t i = (m0 + m) * groups + 2 * p + j;
      const __m512i both = _mm512_add_epi32(dot[m][0], dot[m][1]);
      const __m512 scaled = _mm512_mul_ps(scale, _mm512_set1_ps(x->dx32[i]));
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), scaled, total[m]);
      off[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x->dxsum32[i]), off[m]);
    }
  }
  for (int m = 0; m < R; m++) {
    _mm512_store_ps(sums + 2 * (m0 + m) * WROWS, total[m]);
    _mm512_store_ps(sums + (2 * (m0 + m) + 1) * WROWS, off[m]);
  }
}

/* pair_rows for x rows [m0, m1). */
static void pair_row_range(const decoded_pair *blk, const rounded_x *x, int64_t p, int64_t m0,
                           int64_t m1, float *sums) {
  for (; m0 + GEMM_ROWS <= m1; m0 += GEMM_ROWS) pair_rows(GEMM_ROWS, blk, x, m0, p, sums);
  for (; m0 < m1; m0++) pair_rows(1, blk, x, m0, p, sums);
}

/* block_rows for x rows [m0, m1), R compiled per count and block type. */
static void block_row_range(int64_t type, const decoded_block *blk, const rounded_x *x,
                            int64_t sb, int64_t m0, int64_t m1, float *sums) {
  if (type == GGML_TYPE_Q4_K) {
    for (; m0 + GEMM_ROWS <= m1; m0 += GEMM_ROWS) block_rows(GEMM_ROWS, 32, blk, x, m0, sb, sums);
    for (; m0 < m1; m0++) block_rows(1, 32, blk, x, m0, sb, sums);
  } else {
    for (; m0 + GEMM_ROWS <= m1; m0 += GEMM_ROWS) block_rows(GEMM_ROWS, 16, blk, x, m0, sb, sums);
    for (; m0 < m1; m0++) block_rows(1, 16, blk, x, m0, sb, sums);
  }
}

typedef struct {
  int dtype;
  const rounded_x *x;
  const gguf_part_t *parts;
  void *y;
  int64_t n_out;
  int failed;
} gemm_args;

/* Bytes of rounded x a thread multiplies against the decoded super-blocks before moving on
 * (a chunk of x rows): kept in L2 with them, rather than every x row streamed from memory once
 * per block of 16 weight rows in a prefill's thousand rows. */
#define X_CHUNK_BYTES (256 << 10)

static int is_k_quant(int64_t type) {
  return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K;
}

/* One block of 16 weight rows (n..n+15, block type `type`, at rows[r]) against every x row into
 * sums: its super-blocks (or pairs of blocks of 32) decoded once into `decoded`, then
 * multiplied by the x rows a chunk at a time. */
static void gemm_block(int64_t type, const uint8_t *const rows[WROWS], const rounded_x *x,
                       void *decoded, float *sums) {
  const int64_t k = x->k;
  int64_t chunk = X_CHUNK_BYTES / k / GEMM_ROWS * GEMM_ROWS;
  if (chunk < GEMM_ROWS) chunk = GEMM_ROWS;
  memset(sums, 0, (size_t)(2 * x->rows * WROWS) * sizeof(float));
  if (is_k_quant(type)) {
    decoded_block *blk = decoded;
    for (int64_t sb = 0; sb < k / QK_K; sb++) decode_block(type, rows, sb, blk + sb);
    for (int64_t m0 = 0; m0 < x->rows; m0 += chunk) {
      const int64_t m1 = m0 + chunk < x->rows ? m0 + chunk : x->rows;
      for (int64_t sb = 0; sb < k / QK_K; sb++) block_row_range(type, blk + sb, x, sb, m0, m1, sums);
    }
    return;
  }
  decoded_pair *pairs = decoded;
  for (int64_t p = 0; p < k / 64; p++) decode_pair(type, rows, p, pairs + p);
  for (int64_t m0 = 0; m0 < x->rows; m0 += chunk) {
    const int64_t m1 = m0 + chunk < x->rows ? m0 + chunk : x->rows;
    for (int64_t p = 0; p < k / 64; p++) pair_row_range(pairs + p, x, p, m0, m1, sums);
  }
}

/* Weight row blocks [b0, b1) (of 16 rows) against every x row. */
static void gemm_range(void *p, int64_t b0, int64_t b1) {
  gemm_args *a = p;
  const rounded_x *x = a->x;
  const int64_t k = x->k, rows = x->rows;
  const size_t by_blocks = (size_t)(k / QK_K) * sizeof(decoded_block);
  const size_t by_pairs = (size_t)(k / 64) * sizeof(decoded_pair);
  void *decoded = aligned_alloc(64, by_blocks > by_pairs ? by_blocks : by_pairs);
  float *sums = aligned_alloc(64, (size_t)(2 * rows * WROWS) * sizeof(float));
  if (decoded == NULL || sums == NULL) {
    free(decoded);
    free(sums);
    a->failed = 1;
    return;
  }
  for (int64_t bi = b0; bi < b1; bi++) {
    const int64_t n = bi * WROWS;
    const uint8_t *row_at[WROWS];
    int64_t type;
    for (int r = 0; r < WROWS; r++) row_at[r] = stacked_row(a->parts, n + r, k, &type);
    gemm_block(type, row_at, x, decoded, sums);
    for (int64_t m = 0; m < rows; m++)
      for (int r = 0; r < WROWS; r++)
        store(a->y, m * a->n_out + n + r,
              sums[2 * m * WROWS + r] - sums[(2 * m + 1) * WROWS + r], a->dtype);
  }
  free(decoded);
  free(sums);
}

/* Whether every part is of a block type read here, in whole blocks of 16 rows and of k's
 * decoding units (super-blocks of 256, pairs of blocks of 32). */
static int parts_fit(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  for (int64_t seen = 0, i = 0; seen < n_out; seen += parts[i].rows, i++) {
    const int64_t type = parts[i].type;
    const int64_t unit = is_k_quant(type) ? QK_K : type_block_values(type) == 32 ? 64 : 0;
    if (unit == 0 || k % unit || parts[i].rows % WROWS) return 0;
  }
  return 1;
}

/* Whether gguf_gemm_a8 serves a weight of these parts. */
static int gemm_serves(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  return gguf_parts_valid(parts, n_out, k) && parts_fit(parts, n_out, k);
}

int gguf_gemm_a8(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                 int64_t n_out, int64_t k, int threads) {
  if (rows < 1 || !gemm_serves(parts, n_out, k)) return -1;
  rounded_x rx;
  if (round_x(dtype, x, rows, k, &rx)) return -1;
  gemm_args a = {dtype, &rx, parts, y, n_out, 0};
  const int64_t blocks = n_out / WROWS;
  const int64_t pieces = 4 * (threads > 1 ? threads : 1);
  const int64_t chunk = (blocks + pieces - 1) / pieces;
  parallel_range(gemm_range, &a, blocks, chunk > 0 ? chunk : 1, threads, 1);
  free_rounded(&rx);
  return a.failed ? -1 : 0;
}
#else
int gguf_gemm_a8(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                 int64_t n_out, int64_t k, int threads) {
  (void)dtype, (void)x, (void)parts, (void)y, (void)rows, (void)n_out, (void)k, (void)threads;
  return -1;
}

static int gemm_serves(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  (void)parts, (void)n_out, (void)k;
  return 0;
}
#endif

int64_t gguf_a8_gemm_min_rows(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  if (!gemm_serves(parts, n_out, k)) return KERNEL_OFF_ROWS;
  return q6k_mostly(parts, n_out) ? A8_GEMM_MIN_ROWS_Q6_K : A8_GEMM_MIN_ROWS;
}
