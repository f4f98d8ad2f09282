/*
 * Weight-only quantized products for batches past the GEMVs (quant_gemv.c): y[M, N] = x[M, K]
 * W^T (+ bias), x float32 (no activation rounding), W in quant_gemv.c's layouts: int4 (GGUF
 * Q4_1 nibbles [N, K / 2] with an f16 (scale, offset) per group of 32), int8 (values [N, K]
 * with a float32 scale per row) or GGUF Q8_0 (values [N, K], an f16 scale per group of 32).
 *
 * A thread takes chunks of GEMM_CHUNK_COLS output columns. It dequantizes a chunk's weight rows
 * into a float32 scratch (L2), then, for each block of rows of x, runs each GEMM_COLS of those
 * columns (L1) against the block in tiles of GEMM_TILE_ROWS x GEMM_COLS dot products (12 vector
 * accumulators along k, summed across lanes at the end). Each weight byte is read from memory
 * once per call and dequantized once, so a layer costs its quantized bytes in memory traffic
 * whatever the row count, and a model quantized this way needs no dense copy for large batches.
 *
 * Why dot products (vectors along k) and not panels (vectors along n, panel_gemm.c) up to 128
 * rows: the dequantized rows come out contiguous in k, and a tile loads 3 x vectors and 4
 * weight vectors per 12 FMAs, with no broadcasts; transposing a chunk into panels costs more
 * than it gains until there are many rows to run against it (panels_from_rows).
 */
#include "common.h"

#define Q4_GROUP 32
#define GEMM_COLS 4
#define GEMM_TILE_ROWS 3
/* Output columns per parallel chunk: a multiple of GEMM_COLS. */
#define GEMM_CHUNK_COLS 32

/* One int4 weight row (K values) from its nibbles and group (scale, offset) pairs. */
static void dequantize_int4_row(const uint8_t *packed, const uint16_t *scale_offset, int64_t k,
                                float *out) {
  for (int64_t g = 0; g < k / Q4_GROUP; g++) {
    const float scale = f16_to_f32(scale_offset[2 * g]);
    const float offset = f16_to_f32(scale_offset[2 * g + 1]);
    const uint8_t *b = packed + g * (Q4_GROUP / 2);
    float *o = out + g * Q4_GROUP;
#if defined(__AVX2__) && defined(__FMA__)
    const __m128i bytes = _mm_loadu_si128((const __m128i *)b);
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i low = _mm_and_si128(bytes, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 s = _mm256_set1_ps(scale), off = _mm256_set1_ps(offset);
#define DEQ8(src, dst) \
  _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(src)), s, off))
    DEQ8(low, o);
    DEQ8(_mm_srli_si128(low, 8), o + 8);
    DEQ8(high, o + 16);
    DEQ8(_mm_srli_si128(high, 8), o + 24);
#undef DEQ8
#else
    for (int j = 0; j < Q4_GROUP / 2; j++) {
      o[j] = (float)(b[j] & 0x0f) * scale + offset;
      o[j + Q4_GROUP / 2] = (float)(b[j] >> 4) * scale + offset;
    }
#endif
  }
}

#if VEC > 1 && defined(__x86_64__)
#define PIN(v) __asm__("" : "+v"(v))
#else
#define PIN(v) (void)0
#endif

/* One int8 weight row (K values) times its scale. */
static void dequantize_int8_row(const int8_t *values, float scale, int64_t k, float *out) {
  int64_t done = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 s = _mm256_set1_ps(scale);
  done = k - k % 8;
  for (int64_t i = 0; i < done; i += 8) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)(values + i));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
  }
#endif
  for (int64_t i = done; i < k; i++) out[i] = (float)values[i] * scale;
}

/* One GGUF Q8_0 weight row (K values) from its int8 values and f16 scale per group of 32. */
static void dequantize_q8_row(const int8_t *values, const uint16_t *scales, int64_t k,
                              float *out) {
  for (int64_t g = 0; g < k / Q4_GROUP; g++)
    dequantize_int8_row(values + g * Q4_GROUP, f16_to_f32(scales[g]), Q4_GROUP,
                        out + g * Q4_GROUP);
}

/* The lane sums of four vectors into out[0..3]. */
static inline void sum4(vec_t a, vec_t b, vec_t c, vec_t d, float out[GEMM_COLS]) {
#if VEC == 8
  /* Pairwise adds across the four at once: 3 hadds and one add instead of four reductions. */
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  out[0] = vsum(a);
  out[1] = vsum(b);
  out[2] = vsum(c);
  out[3] = vsum(d);
#endif
}

/* out[r][c] = x[r] . w[c] for R rows of x (row stride k) and the GEMM_COLS rows of w. */
static inline __attribute__((always_inline)) void dot_tile(const int R, const float *x,
                                                           const float *w, int64_t k,
                                                           float out[GEMM_TILE_ROWS][GEMM_COLS]) {
  /* Named accumulators: GCC spills an array of them to the stack (see panel_gemm.c). */
  vec_t a00 = vzero(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
        a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  const float *x1 = x + (R > 1 ? k : 0), *x2 = x + (R > 2 ? 2 * k : 0);
  for (int64_t i = 0; i < k; i += VEC) {
    vec_t v0 = vload(x, i, 0), v1 = vload(x1, i, 0), v2 = vload(x2, i, 0);
    /* Hold x and w vectors in registers: GCC otherwise reloads them for every FMA (24 loads
     * per 12 FMAs instead of 7), and the loads, not the FMAs, set the speed. */
    PIN(v0);
    PIN(v1);
    PIN(v2);
#define DOT_COL(c, acc0, acc1, acc2)          \
  {                                           \
    vec_t wv = vload(w, c * k + i, 0);        \
    PIN(wv);                                  \
    acc0 = vfma(v0, wv, acc0);                \
    if (R > 1) acc1 = vfma(v1, wv, acc1);     \
    if (R > 2) acc2 = vfma(v2, wv, acc2);     \
  }
    DOT_COL(0, a00, a10, a20)
    DOT_COL(1, a01, a11, a21)
    DOT_COL(2, a02, a12, a22)
    DOT_COL(3, a03, a13, a23)
#undef DOT_COL
  }
  sum4(a00, a01, a02, a03, out[0]);
  if (R > 1) sum4(a10, a11, a12, a13, out[1]);
  if (R > 2) sum4(a20, a21, a22, a23, out[2]);
}

static void dot_tile1(const float *x, const float *w, int64_t k, float out[][GEMM_COLS]) {
  dot_tile(1, x, w, k, out);
}
static void dot_tile2(const float *x, const float *w, int64_t k, float out[][GEMM_COLS]) {
  dot_tile(2, x, w, k, out);
}
static void dot_tile3(const float *x, const float *w, int64_t k, float out[][GEMM_COLS]) {
  dot_tile(3, x, w, k, out);
}

typedef struct {
  int kind; /* QUANT_GEMM_INT8, QUANT_GEMM_INT4, QUANT_GEMM_Q8_0 or QUANT_GEMM_GGUF */
  const float *x;
  const void *weight; /* int8 values, int4 nibbles or GGUF parts */
  const void *scale;  /* int8: float32 per row; int4: f16 (scale, offset) per group; Q8_0: f16
                         per group */
  const float *bias;
  float *y;
  int64_t rows, n_out, k;
  int row_independent; /* never the panel path (see kernels.h) */
  int failed;          /* set by a worker that could not get its scratch */
} quant_gemm_args;

/* This thread's dequantization scratch of at least `floats` floats (kept between calls), or
 * NULL when memory is short. */
static float *thread_scratch(int64_t floats) {
  static __thread float *scratch = NULL;
  static __thread int64_t capacity = 0;
  if (floats > capacity) {
    float *grown = realloc(scratch, (size_t)floats * sizeof(float));
    if (grown == NULL) return NULL;
    scratch = grown;
    capacity = floats;
  }
  return scratch;
}

/* Rows of x one pass over a chunk's columns takes: the block stays in L2 while every column
 * group of the chunk runs against it (with all rows at once, prefill-sized x was read from L3
 * once per group of 4 columns). */
#define GEMM_ROW_BLOCK 48
/* Rows from which a chunk runs as panels (panels_from_rows). */
#define GEMM_PANEL_MIN_ROWS 128


/* Rows [r0, r1) of x against the GEMM_COLS dequantized weight rows at `w` (columns n0 + c). */
static void tile_rows(const quant_gemm_args *a, const float *w, int64_t n0, int64_t cols,
                      int64_t r0, int64_t r1) {
  const int64_t k = a->k;
  for (; r0 < r1; r0 += GEMM_TILE_ROWS) {
    const int64_t rows = r1 - r0 < GEMM_TILE_ROWS ? r1 - r0 : GEMM_TILE_ROWS;
    float out[GEMM_TILE_ROWS][GEMM_COLS];
    const float *x = a->x + r0 * k;
    if (rows == 3)
      dot_tile3(x, w, k, out);
    else if (rows == 2)
      dot_tile2(x, w, k, out);
    else
      dot_tile1(x, w, k, out);
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < cols; c++)
        a->y[(r0 + r) * a->n_out + n0 + c] = out[r][c] + (a->bias ? a->bias[n0 + c] : 0.0f);
  }
}

/* The chunk's dequantized rows `w` ([width][k]) as panels of panel_gemm.c, each run against
 * every row of x there: from 128 rows its broadcast tiles beat the dot tiles, and the
 * transposing copy is paid once for that many rows. */
static void panels_from_rows(const quant_gemm_args *a, const float *w, float *panel,
                             int64_t first, int64_t width) {
  const int64_t k = a->k, pw = panel_width();
  for (int64_t c0 = 0; c0 < width; c0 += pw) {
    const int64_t cols = width - c0 < pw ? width - c0 : pw;
    for (int64_t i = 0; i < k; i++)
      for (int64_t c = 0; c < pw; c++) panel[i * pw + c] = c < cols ? w[(c0 + c) * k + i] : 0.0f;
    panel_rows(a->x, a->rows, k, panel, NULL, a->y + first + c0, a->n_out, cols,
               a->bias ? a->bias + first + c0 : NULL);
  }
}

static void quant_gemm_range(void *p, int64_t chunk0, int64_t chunk1) {
  quant_gemm_args *a = p;
  const int64_t k = a->k, groups = k / Q4_GROUP;
  float *w = thread_scratch((GEMM_CHUNK_COLS + panel_width()) * k);
  uint8_t stored[STORED_ROW_BYTES(k)]; /* a GGUF row rebuilt in the file's layout */
  if (w == NULL) {
    __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
    return;
  }
  for (int64_t chunk = chunk0; chunk < chunk1; chunk++) {
    const int64_t first = chunk * GEMM_CHUNK_COLS;
    const int64_t width = a->n_out - first < GEMM_CHUNK_COLS ? a->n_out - first : GEMM_CHUNK_COLS;
    const int64_t padded = (width + GEMM_COLS - 1) / GEMM_COLS * GEMM_COLS;
    for (int64_t c = 0; c < padded; c++) {
      const int64_t n = first + c;
      if (c < width && a->kind == QUANT_GEMM_INT4)
        dequantize_int4_row((const uint8_t *)a->weight + n * (k / 2),
                            (const uint16_t *)a->scale + n * groups * 2, k, w + c * k);
      else if (c < width && a->kind == QUANT_GEMM_GGUF) {
        int64_t type;
        const void *row = gguf_stored_row(a->weight, n, k, stored, &type);
        gguf_decode_row(type, row, k, w + c * k);
      } else if (c < width && a->kind == QUANT_GEMM_Q8_0)
        dequantize_q8_row((const int8_t *)a->weight + n * k, (const uint16_t *)a->scale + n * groups,
                          k, w + c * k);
      else if (c < width)
        dequantize_int8_row((const int8_t *)a->weight + n * k, ((const float *)a->scale)[n], k,
                            w + c * k);
      else
        memset(w + c * k, 0, (size_t)k * sizeof(float));
    }
    if (a->rows >= GEMM_PANEL_MIN_ROWS && !a->row_independent) {
      panels_from_rows(a, w, w + GEMM_CHUNK_COLS * k, first, width);
      continue;
    }
    for (int64_t r0 = 0; r0 < a->rows; r0 += GEMM_ROW_BLOCK) {
      const int64_t r1 = a->rows - r0 < GEMM_ROW_BLOCK ? a->rows : r0 + GEMM_ROW_BLOCK;
      for (int64_t c0 = 0; c0 < padded; c0 += GEMM_COLS) {
        const int64_t cols = width - c0 < GEMM_COLS ? width - c0 : GEMM_COLS;
        tile_rows(a, w + c0 * k, first + c0, cols, r0, r1);
      }
    }
  }
}

/* y [rows, n_out] = x [rows, k] W^T + bias (bias may be NULL), float32; W as `kind` says (see
 * the top). Returns 0, or -1 when k is not a multiple of 32 or memory is short (y is then
 * undefined). */
int quant_gemm(int kind, const float *x, const void *weight, const void *scale,
               const float *bias, float *y, int64_t rows, int64_t n_out, int64_t k, int threads,
               int row_independent) {
  /* k a multiple of 32: whole int4 groups, and whole vectors for the dot tiles (VEC <= 16). */
  if (rows < 1 || k < 1 || k % Q4_GROUP || kind < QUANT_GEMM_INT8 || kind > QUANT_GEMM_GGUF) return -1;
  quant_gemm_args a = {kind, x, weight, scale, bias, y, rows, n_out, k, row_independent, 0};
  const int64_t chunks = (n_out + GEMM_CHUNK_COLS - 1) / GEMM_CHUNK_COLS;
  parallel_range(quant_gemm_range, &a, chunks, 1, threads, rows * n_out * k >= 65536);
  return a.failed ? -1 : 0;
}
