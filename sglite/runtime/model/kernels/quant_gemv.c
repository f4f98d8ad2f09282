/*
 * Weight-only quantized matrix-vector products for small batches: y[m, n] = sum_k x[m, k] W[n, k]
 * for m < rows <= QGEMV_MAX_ROWS, reading each weight once for all rows (decode is bound by
 * weight bytes, so the rows come almost free).
 *
 * int8: W = q[n, k] * scale[n]  (q int8 [N, K], scale float32 [N]).
 * int4: groups of 32 input columns, GGUF Q4_1 layout: byte j of a group's 16 bytes holds value j
 *   in its low nibble and value j + 16 in its high nibble; per group an f16 pair (scale, offset)
 *   with W = q * scale + offset (Q4_0's (q - 8) * d is scale d, offset -8 d).
 *   packed: uint8 [N, K / 2]; scale_offset: f16 [N, K / 32, 2].
 * x and y are float32 or bfloat16 (`dtype`); accumulation is float32. See common.h.
 * Vector paths: AVX-512 (int4 with VNNI), AVX2 with FMA (int4 by vpmaddubsw), else scalar. The
 * integer int4 paths (asked for with round_x: w4a8) round x to int8 per group of 32; the float
 * ones (int4) keep it in float32. Rounding makes y jump when x crosses a rounding boundary, so a
 * tiny change of x (another batch, a cached prefix) can move a model's logits far more than
 * float rounding would.
 */
#include "common.h"

#define Q4_GROUP 32

/* x rows converted to float32 once per call (each is read N times). */
static float *load_x(int dtype, const void *x, int64_t rows, int64_t k) {
  float *xf = (float *)malloc((size_t)(rows * k) * sizeof(float));
  if (xf != NULL)
    for (int64_t m = 0; m < rows; m++) load_row(x, m * k, k, xf + m * k, dtype);
  return xf;
}

#if VEC == 8
/* In place, per group of 32: the order in which the AVX2 float int4 block unpacks a group's
 * values (four vectors of 8: values 0-7, 8-15, 16-23, 24-31, each as lanes 0,4,1,5,2,6,3,7). */
static void permute_x_groups(float *xf, int64_t rows, int64_t k) {
  static const int lane[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  float tmp[Q4_GROUP];
  for (int64_t m = 0; m < rows; m++)
    for (int64_t g = 0; g < k / Q4_GROUP; g++) {
      float *xg = xf + m * k + g * Q4_GROUP;
      for (int v = 0; v < 4; v++)
        for (int l = 0; l < 8; l++) tmp[v * 8 + l] = xg[v * 8 + lane[l]];
      memcpy(xg, tmp, sizeof(tmp));
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* acc[m][a] += scale * (w . x_m) over group g of R rows of x (float32): `w` is the group's 32
 * weights as 4 vectors of 8 in the order x's group is stored in. The float GEMVs' inner step. */
static inline __attribute__((always_inline)) void group_dot_rows(const int R, __m256 acc[][2],
                                                                 const int a, const __m256 w[4],
                                                                 __m256 scale, const float *xf,
                                                                 int64_t k, int64_t g) {
  for (int m = 0; m < R; m++) {
    const float *xg = xf + m * k + g * 32;
    __m256 p0 = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
    __m256 p1 = _mm256_mul_ps(w[1], _mm256_loadu_ps(xg + 8));
    p0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), p0);
    p1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), p1);
    acc[m][a] = _mm256_fmadd_ps(scale, _mm256_add_ps(p0, p1), acc[m][a]);
  }
}

/* Group g of an int4 row (Q4_1 nibbles at `pn`, scale `scale`) into acc[m][a]. Each 8 bytes are
 * broadcast and shifted per lane, so lanes hold values 0,4,1,5,2,6,3,7 of the 8 (then the same
 * for the high nibbles): x must be stored in that order (permute_x_groups). */
static inline __attribute__((always_inline)) void int4_float_group(const int R, __m256 acc[][2],
                                                                   const int a,
                                                                   const uint8_t *pn,
                                                                   float scale, const float *xf,
                                                                   int64_t k, int64_t g) {
  const __m256i low_shifts = _mm256_setr_epi32(0, 0, 8, 8, 16, 16, 24, 24);
  const __m256i high_shifts = _mm256_setr_epi32(4, 4, 12, 12, 20, 20, 28, 28);
  const __m256i nibble = _mm256_set1_epi32(0x0f);
  int64_t half0, half1;
  memcpy(&half0, pn + g * 16, 8);
  memcpy(&half1, pn + g * 16 + 8, 8);
  const __m256i b0 = _mm256_set1_epi64x(half0), b1 = _mm256_set1_epi64x(half1);
  const __m256 w[4] = {
      _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b0, low_shifts), nibble)),
      _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b1, low_shifts), nibble)),
      _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b0, high_shifts), nibble)),
      _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b1, high_shifts), nibble))};
  group_dot_rows(R, acc, a, w, _mm256_set1_ps(scale), xf, k, g);
}

static inline __m256 widen8(const int8_t *p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Group g of a Q8_0 row (int8 values at `qn`) into acc[m][a]. */
static inline __attribute__((always_inline)) void q8_group(const int R, __m256 acc[][2],
                                                           const int a, const int8_t *qn,
                                                           float scale, const float *xf,
                                                           int64_t k, int64_t g) {
  const int8_t *qg = qn + g * 32;
  const __m256 w[4] = {widen8(qg), widen8(qg + 8), widen8(qg + 16), widen8(qg + 24)};
  group_dot_rows(R, acc, a, w, _mm256_set1_ps(scale), xf, k, g);
}
#endif

/* Weight rows requested ahead of the one being read (prefetch_bytes). */
#define PREFETCH_ROWS 8

/*
 * One int8 output row block for a fixed row count R (inlined per R, so accumulators stay in
 * registers). Two accumulators per row break the FMA dependency chain.
 */
static inline __attribute__((always_inline)) void int8_block(
    const int R, int dtype, const float *xf, const int8_t *q, const float *scale, void *y,
    int64_t n0, int64_t n1, int64_t n_out, int64_t k) {
  for (int64_t n = n0; n < n1; n++) {
    const int8_t *qn = q + n * k;
    if (n + PREFETCH_ROWS < n1) prefetch_bytes(qn + PREFETCH_ROWS * k, k);
    vec_t acc[QGEMV_MAX_ROWS][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = vzero();
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 32 <= k; i += 32) {
      const __m128i b0 = _mm_loadu_si128((const __m128i *)(qn + i));
      const __m128i b1 = _mm_loadu_si128((const __m128i *)(qn + i + 16));
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0));
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1));
      for (int m = 0; m < R; m++) {
        acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + m * k + i), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + m * k + i + 16), acc[m][1]);
      }
    }
#elif VEC == 8
    if (R <= 2) { /* four FMA chains per row: two would wait on the FMA latency */
      __m256 extra[2][2];
      for (int m = 0; m < R; m++) extra[m][0] = extra[m][1] = _mm256_setzero_ps();
      for (; i + 32 <= k; i += 32)
        for (int h = 0; h < 2; h++) {
          const int8_t *qh = qn + i + 16 * h;
          const __m256 w0 =
              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qh)));
          const __m256 w1 =
              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qh + 8))));
          for (int m = 0; m < R; m++) {
            const float *xh = xf + m * k + i + 16 * h;
            __m256 *c = h ? extra[m] : acc[m];
            c[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xh), c[0]);
            c[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xh + 8), c[1]);
          }
        }
      for (int m = 0; m < R; m++) {
        acc[m][0] = _mm256_add_ps(acc[m][0], extra[m][0]);
        acc[m][1] = _mm256_add_ps(acc[m][1], extra[m][1]);
      }
    }
    for (; i + 16 <= k; i += 16) {
      const __m256 w0 =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qn + i))));
      const __m256 w1 = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qn + i + 8))));
      for (int m = 0; m < R; m++) {
        acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xf + m * k + i), acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xf + m * k + i + 8), acc[m][1]);
      }
    }
#endif
    for (int m = 0; m < R; m++) {
      float sum = vsum(acc[m][0]) + vsum(acc[m][1]);
      for (int64_t j = i; j < k; j++) sum += (float)qn[j] * xf[m * k + j];
      store(y, m * n_out + n, sum * scale[n], dtype);
    }
  }
}

/*
 * One int4 output row block for a fixed row count R. Per row, the f16 (scale, offset) pairs are
 * widened once; the offset part is sum_g offset_g * (sum of x over group g).
 */
static inline __attribute__((always_inline)) void int4_block(
    const int R, int dtype, const float *xf, const float *xsum, const uint8_t *packed,
    const uint16_t *scale_offset, void *y, int64_t n0, int64_t n1, int64_t n_out, int64_t k) {
  const int64_t groups = k / Q4_GROUP;
  float so[2 * groups];
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t *pn = packed + n * (k / 2);
    const uint16_t *son = scale_offset + n * groups * 2;
    int64_t c = 0;
#ifdef __AVX512F__
    for (; c + 16 <= 2 * groups; c += 16)
      _mm512_storeu_ps(so + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(son + c))));
#elif defined(__F16C__)
    for (; c + 8 <= 2 * groups; c += 8)
      _mm256_storeu_ps(so + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(son + c))));
#endif
    for (; c < 2 * groups; c++) so[c] = f16_to_f32(son[c]);
    float off[QGEMV_MAX_ROWS];
    for (int m = 0; m < R; m++) {
      /* xsum holds (0, sum of x over g) pairs: the offset part is one contiguous dot product
       * with the (scale, offset) pairs (per group, GCC gathers the offsets with permutes and
       * adds them one by one, a serial chain as long as the row has groups). */
      const float *pairs = xsum + m * 2 * groups;
      float o = 0.0f;
      int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
      __m256 vo = _mm256_setzero_ps();
      for (; c + 8 <= 2 * groups; c += 8)
        vo = _mm256_fmadd_ps(_mm256_loadu_ps(so + c), _mm256_loadu_ps(pairs + c), vo);
      o = sum256(vo);
#endif
      for (; c < 2 * groups; c++) o += so[c] * pairs[c];
      off[m] = o;
    }
#ifdef __AVX512F__
    __m512 acc[QGEMV_MAX_ROWS][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; g++) {
      const __m128i bytes = _mm_loadu_si128((const __m128i *)(pn + g * (Q4_GROUP / 2)));
      const __m512 wl = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
      const __m512 wh =
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
      const __m512 vs = _mm512_set1_ps(so[2 * g]);
      const int a = (int)(g & 1);
      for (int m = 0; m < R; m++) {
        const float *xg = xf + m * k + g * Q4_GROUP;
        __m512 p = _mm512_mul_ps(wl, _mm512_loadu_ps(xg));
        p = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xg + 16), p);
        acc[m][a] = _mm512_fmadd_ps(vs, p, acc[m][a]);
      }
    }
    for (int m = 0; m < R; m++)
      store(y, m * n_out + n, _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])) + off[m],
            dtype);
#elif VEC == 8
    /* xf here is x permuted per group (permute_x_groups) to match the lanes the shifts give. */
    if (n + PREFETCH_ROWS < n1) {
      prefetch_bytes(pn + PREFETCH_ROWS * (k / 2), k / 2);
      prefetch_bytes(son + PREFETCH_ROWS * groups * 2, groups * 4);
    }
    __m256 acc[QGEMV_MAX_ROWS][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    /* Group g adds into acc[m][g & 1]; a step's two groups are written out so that the chain
     * index is a constant and the accumulators stay in registers. */
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      int4_float_group(R, acc, 0, pn, so[2 * g], xf, k, g);
      int4_float_group(R, acc, 1, pn, so[2 * g + 2], xf, k, g + 1);
    }
    if (g < groups) int4_float_group(R, acc, 0, pn, so[2 * g], xf, k, g);
    for (int m = 0; m < R; m++)
      store(y, m * n_out + n, vsum(_mm256_add_ps(acc[m][0], acc[m][1])) + off[m], dtype);
#else
    for (int m = 0; m < R; m++) {
      float sum = 0.0f;
      for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = pn + g * (Q4_GROUP / 2);
        const float *xg = xf + m * k + g * Q4_GROUP;
        float p = 0.0f;
        for (int64_t j = 0; j < Q4_GROUP / 2; j++)
          p += (float)(b[j] & 0x0f) * xg[j] + (float)(b[j] >> 4) * xg[j + Q4_GROUP / 2];
        sum += so[2 * g] * p;
      }
      store(y, m * n_out + n, sum + off[m], dtype);
    }
#endif
  }
}

#include "quant_gemv_int4_dot.h"

#define FOR_EACH_ROWS(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
#define INT8_SPECIAL(R)                                                                       \
  static void int8_rows##R(int dtype, const float *xf, const int8_t *q, const float *scale,   \
                           void *y, int64_t n0, int64_t n1, int64_t n_out, int64_t k) {      \
    int8_block(R, dtype, xf, q, scale, y, n0, n1, n_out, k);                                  \
  }
#define INT4_SPECIAL(R)                                                                       \
  static void int4_rows##R(int dtype, const float *xf, const float *xsum, const uint8_t *p,  \
                           const uint16_t *so, void *y, int64_t n0, int64_t n1,             \
                           int64_t n_out, int64_t k) {                                       \
    int4_block(R, dtype, xf, xsum, p, so, y, n0, n1, n_out, k);                               \
  }
FOR_EACH_ROWS(INT8_SPECIAL)
FOR_EACH_ROWS(INT4_SPECIAL)
#ifdef INT4_INTEGER_DOT
FOR_EACH_ROWS(INT4_VNNI_SPECIAL)
typedef void (*int4_vnni_fn)(int, const int8_t *, const float *, const float *, const uint8_t *,
                             const uint16_t *, void *, int64_t, int64_t, int64_t, int64_t);
#define LIST_INT4_VNNI(R) int4_vnni_rows##R,
static const int4_vnni_fn int4_vnni_by_rows[QGEMV_MAX_ROWS] = {FOR_EACH_ROWS(LIST_INT4_VNNI)};
#endif

typedef void (*int8_fn)(int, const float *, const int8_t *, const float *, void *, int64_t,
                        int64_t, int64_t, int64_t);
typedef void (*int4_fn)(int, const float *, const float *, const uint8_t *, const uint16_t *,
                        void *, int64_t, int64_t, int64_t, int64_t);
#define LIST_INT8(R) int8_rows##R,
#define LIST_INT4(R) int4_rows##R,
static const int8_fn int8_by_rows[QGEMV_MAX_ROWS] = {FOR_EACH_ROWS(LIST_INT8)};
static const int4_fn int4_by_rows[QGEMV_MAX_ROWS] = {FOR_EACH_ROWS(LIST_INT4)};

/*
 * Output rows per parallel chunk: about CHUNKS_PER_THREAD chunks per thread, at least
 * MIN_CHUNK_ROWS, a multiple of 16 (whole cache lines of a float32 y). Each chunk restarts the weight
 * stream (the prefetches run within a chunk), so fewer, longer chunks read faster than fixed
 * small ones. Several chunks per thread keep the work balanced when a thread starts late.
 */
#define MIN_CHUNK_ROWS 64
#define CHUNKS_PER_THREAD 4
static int64_t chunk_rows(int64_t n_out, int threads) {
  const int64_t parts = (int64_t)(threads > 1 ? threads : 1) * CHUNKS_PER_THREAD;
  const int64_t rows = ((n_out + parts - 1) / parts + 15) / 16 * 16;
  return rows > MIN_CHUNK_ROWS ? rows : MIN_CHUNK_ROWS;
}

/* Arguments of one GEMV for the thread pool (each kernel uses the fields it needs). */
typedef struct {
  int dtype;
  const float *xf;   /* x in float32 */
  const int8_t *xq;  /* x rounded to int8 per group (VNNI int4) */
  const float *dxx;  /* their scales */
  const float *xsum; /* int4: (0 or c_g, sum of x over group g) pairs per row */
  const void *weight;
  const void *scale;
  void *unused;
  void *y;
  int64_t n_out, k, rows;
} gemv_args;

static void int8_range(void *p, int64_t n0, int64_t n1) {
  const gemv_args *a = p;
  int8_by_rows[a->rows - 1](a->dtype, a->xf, a->weight, a->scale, a->y, n0, n1, a->n_out, a->k);
}

static void int4_range(void *p, int64_t n0, int64_t n1) {
  const gemv_args *a = p;
  int4_by_rows[a->rows - 1](a->dtype, a->xf, a->xsum, a->weight, a->scale, a->y, n0, n1,
                            a->n_out, a->k);
}

#ifdef INT4_INTEGER_DOT
static void int4_vnni_range(void *p, int64_t n0, int64_t n1) {
  const gemv_args *a = p;
  int4_vnni_by_rows[a->rows - 1](a->dtype, a->xq, a->dxx, a->xsum, a->weight, a->scale, a->y,
                                 n0, n1, a->n_out, a->k);
}
#endif

/*
 * One Q8_0 output row block for a fixed row count R (GGUF Q8_0: int8 values [N, K], an f16
 * scale per group of 32 [N, K / 32]; x stays float32): y = sum_g scale_g (q_g . x_g).
 */
static inline __attribute__((always_inline)) void q8_block(const int R, int dtype, const float *xf,
                                                           const int8_t *q,
                                                           const uint16_t *scales, void *y,
                                                           int64_t n0, int64_t n1, int64_t n_out,
                                                           int64_t k) {
  const int64_t groups = k / Q4_GROUP;
  for (int64_t n = n0; n < n1; n++) {
    const int8_t *qn = q + n * k;
    const uint16_t *sn = scales + n * groups;
    if (n + PREFETCH_ROWS < n1) prefetch_bytes(qn + PREFETCH_ROWS * k, k);
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[QGEMV_MAX_ROWS][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    int64_t g = 0; /* two groups a step, as in int4_block */
    for (; g + 2 <= groups; g += 2) {
      q8_group(R, acc, 0, qn, f16_to_f32(sn[g]), xf, k, g);
      q8_group(R, acc, 1, qn, f16_to_f32(sn[g + 1]), xf, k, g + 1);
    }
    if (g < groups) q8_group(R, acc, 0, qn, f16_to_f32(sn[g]), xf, k, g);
    for (int m = 0; m < R; m++)
      store(y, m * n_out + n, sum256(_mm256_add_ps(acc[m][0], acc[m][1])), dtype);
#else
    for (int m = 0; m < R; m++) {
      float sum = 0.0f;
      for (int64_t g = 0; g < groups; g++) {
        float p = 0.0f;
        for (int64_t j = 0; j < Q4_GROUP; j++)
          p += (float)qn[g * Q4_GROUP + j] * xf[m * k + g * Q4_GROUP + j];
        sum += f16_to_f32(sn[g]) * p;
      }
      store(y, m * n_out + n, sum, dtype);
    }
#endif
  }
}
#define Q8_SPECIAL(R)                                                                         \
  static void q8_rows##R(int dtype, const float *xf, const int8_t *q, const uint16_t *sc,     \
                         void *y, int64_t n0, int64_t n1, int64_t n_out, int64_t k) {        \
    q8_block(R, dtype, xf, q, sc, y, n0, n1, n_out, k);                                       \
  }
FOR_EACH_ROWS(Q8_SPECIAL)
typedef void (*q8_fn)(int, const float *, const int8_t *, const uint16_t *, void *, int64_t,
                      int64_t, int64_t, int64_t);
#define LIST_Q8(R) q8_rows##R,
static const q8_fn q8_by_rows[QGEMV_MAX_ROWS] = {FOR_EACH_ROWS(LIST_Q8)};

static void q8_range(void *p, int64_t n0, int64_t n1) {
  const gemv_args *a = p;
  q8_by_rows[a->rows - 1](a->dtype, a->xf, a->weight, a->scale, a->y, n0, n1, a->n_out, a->k);
}

/* GGUF Q8_0 weights (see q8_block) times a few rows of x. Returns 0 on success, -1 when out of
 * memory, rows > QGEMV_MAX_ROWS or k % 32 != 0. */
int q8_gemv(int dtype, const void *x, const int8_t *q, const uint16_t *scales, void *y,
            int64_t rows, int64_t n_out, int64_t k, int threads) {
  if (rows < 1 || rows > QGEMV_MAX_ROWS || k % Q4_GROUP) return -1;
  float *xf = load_x(dtype, x, rows, k);
  if (xf == NULL) return -1;
  gemv_args a = {dtype, xf, NULL, NULL, NULL, q, scales, NULL, y, n_out, k, rows};
  parallel_range(q8_range, &a, n_out, chunk_rows(n_out, threads), threads, n_out * k >= 65536);
  free(xf);
  return 0;
}

/* Returns 0 on success, -1 when out of memory or rows > QGEMV_MAX_ROWS. */
int int8_gemv(int dtype, const void *x, const int8_t *q, const float *scale, void *y,
              int64_t rows, int64_t n_out, int64_t k, int threads) {
  if (rows < 1 || rows > QGEMV_MAX_ROWS) return -1;
  float *xf = load_x(dtype, x, rows, k);
  if (xf == NULL) return -1;
  gemv_args a = {dtype, xf, NULL, NULL, NULL, q, scale, NULL, y, n_out, k, rows};
  parallel_range(int8_range, &a, n_out, chunk_rows(n_out, threads), threads,
                 n_out * k >= 65536);
  free(xf);
  return 0;
}

/* Returns 0 on success, -1 when out of memory, rows > QGEMV_MAX_ROWS or k % 32 != 0.
 * round_x: where the build has an integer int4 kernel (AVX2, AVX-512 VNNI), round x to int8 per
 * group of 32 and use it (w4a8: integer dot products, several products per instruction, where
 * the float path converts every weight to float first); else x
 * stays float32 (int4: the product of the dequantized weights, to float rounding). */
int int4_gemv(int dtype, const void *x, const uint8_t *packed, const uint16_t *scale_offset,
              void *y, int64_t rows, int64_t n_out, int64_t k, int threads, int round_x) {
  if (rows < 1 || rows > QGEMV_MAX_ROWS || k % Q4_GROUP) return -1;
  const int64_t groups = k / Q4_GROUP;
  float *xf = load_x(dtype, x, rows, k);
  /* (0, sum of x over group g) pairs, the layout of the (scale, offset) pairs they meet. */
  float *xsum = (float *)calloc((size_t)(rows * groups * 2), sizeof(float));
  if (xf == NULL || xsum == NULL) {
    free(xf);
    free(xsum);
    return -1;
  }
  for (int64_t m = 0; m < rows; m++)
    for (int64_t g = 0; g < groups; g++) {
      float s = 0.0f;
      for (int64_t j = 0; j < Q4_GROUP; j++) s += xf[m * k + g * Q4_GROUP + j];
      xsum[(m * groups + g) * 2 + 1] = s;
    }
#ifdef INT4_INTEGER_DOT
  if (round_x && groups % 2 == 0) {
    int8_t *xq = (int8_t *)malloc((size_t)(rows * k));
    float *dxx = (float *)malloc((size_t)(rows * groups * 8) * sizeof(float));
    const int ok = xq != NULL && dxx != NULL;
    if (ok) {
      quantize_x_groups(xf, xsum, rows, k, xq, dxx);
      gemv_args a = {dtype, NULL, xq, dxx, xsum, packed, scale_offset, NULL, y, n_out, k, rows};
      parallel_range(int4_vnni_range, &a, n_out, chunk_rows(n_out, threads), threads,
                     n_out * k >= 65536);
    }
    free(xq);
    free(dxx);
    free(xf);
    free(xsum);
    return ok ? 0 : -1;
  }
#else
  (void)round_x; /* no integer int4 kernel in this build */
#endif
#if VEC == 8
  permute_x_groups(xf, rows, k);
#endif
  gemv_args a = {dtype, xf, NULL, NULL, xsum, packed, scale_offset, NULL, y, n_out, k, rows};
  parallel_range(int4_range, &a, n_out, chunk_rows(n_out, threads), threads,
                 n_out * k >= 65536);
  free(xf);
  free(xsum);
  return 0;
}

typedef struct {
  int dtype;
  const uint8_t *packed;
  const uint16_t *scale_offset;
  void *out;
  int64_t k;
} dequant_args;

static void dequant_rows(void *p, int64_t n0, int64_t n1) {
  const dequant_args *a = p;
  const int64_t k = a->k, groups = k / Q4_GROUP;
  for (int64_t n = n0; n < n1; n++) {
    for (int64_t g = 0; g < groups; g++) {
      const float scale = f16_to_f32(a->scale_offset[(n * groups + g) * 2]);
      const float offset = f16_to_f32(a->scale_offset[(n * groups + g) * 2 + 1]);
      const uint8_t *b = a->packed + n * (k / 2) + g * (Q4_GROUP / 2);
      const int64_t base = n * k + g * Q4_GROUP;
      for (int64_t j = 0; j < Q4_GROUP / 2; j++) {
        store(a->out, base + j, (float)(b[j] & 0x0f) * scale + offset, a->dtype);
        store(a->out, base + j + Q4_GROUP / 2, (float)(b[j] >> 4) * scale + offset, a->dtype);
      }
    }
  }
}

/* The dense weight [N, K] (in dtype) an int4 weight stands for: for matmuls with many rows. */
void int4_dequantize(int dtype, const uint8_t *packed, const uint16_t *scale_offset, void *out,
                     int64_t n_out, int64_t k, int threads) {
  dequant_args a = {dtype, packed, scale_offset, out, k};
  parallel_range(dequant_rows, &a, n_out, chunk_rows(n_out, threads), threads,
                 n_out * k >= 65536);
}

