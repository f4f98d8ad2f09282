/*
 * GGUF's quantized weights read as the file stores them (ggml's block layouts), so a model
 * needs no other copy of them: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32 values) and Q4_K,
 * Q5_K, Q6_K (super-blocks of 256). A matrix [n_out, k] is rows of blocks; a fused projection
 * (q/k/v, gate/up) is up to GGUF_MAX_PARTS row ranges, each in its own type (`gguf_part_t`,
 * ranges in order, covering n_out rows).
 *
 * Every product dequantizes a span of a weight row (up to 256 values) into a float32 buffer on
 * the stack (L1) and takes its dot products with the x rows from there: the weight bytes are
 * read once from memory per call whatever the row count, and one block decoder per type serves
 * the GEMV (`gguf_gemv`, a few rows), the quantized GEMM (quant_gemm.c, any row count),
 * embedding lookups and dense copies (`gguf_dequantize`).
 *
 * Values: Q4_0 d (q - 8); Q4_1 d q + m; Q5_0 d (q - 16); Q5_1 d q + m; Q8_0 d q; Q4_K and Q5_K
 * per group of 32 (d sc) q - dmin mn with 6-bit sc, mn; Q6_K per group of 16 d sc (q - 32) with
 * int8 sc. The vector decoders (AVX2) compute the same float32 values as the scalar ones, which
 * are the reference (and the path of other CPUs).
 */
#include "gguf_bits.h"
#include "gguf_quads.h"
#include "gguf_tiles.h"

#define QK 32
#define QK_K 256
/* Values one buffer holds: a k-quant super-block, or 8 blocks of 32. */
#define SPAN 256

int64_t gguf_block_values(int64_t type) { return type_block_values(type); }

int64_t gguf_row_bytes(int64_t type, int64_t k) {
  const int64_t values = gguf_block_values(type);
  if (values == 0 || k % values || (type == GGUF_QUADS_Q5_0 && k % QUAD_VALUES)) return -1;
  return k / values * type_block_bytes(type);
}

/* ------------------------------------------------------------------ scalar block decoders */

/* The 32 values of a block of 32 whose 16 bytes `qs` hold value j in the low nibble of byte j
 * and value j + 16 in the high one, each plus 16 where bit j of `high` is set. */
static void nibbles32(const uint8_t *qs, uint32_t high, float scale, float offset, float *out) {
  for (int j = 0; j < 16; j++) {
    const int lo = (qs[j] & 0x0f) | (((high >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4);
    out[j] = (float)lo * scale + offset;
    out[j + 16] = (float)hi * scale + offset;
  }
}

static __attribute__((unused)) void scalar_block(int64_t type, const uint8_t *b, float *out) {
  switch (type) {
    case GGML_TYPE_Q4_0: {
      const float d = half(b);
      nibbles32(b + 2, 0, d, -8.0f * d, out);
      return;
    }
    case GGML_TYPE_Q4_1:
      nibbles32(b + 4, 0, half(b), half(b + 2), out);
      return;
    case GGML_TYPE_Q5_0: {
      uint32_t high;
      memcpy(&high, b + 2, 4);
      const float d = half(b);
      nibbles32(b + 6, high, d, -16.0f * d, out);
      return;
    }
    case GGML_TYPE_Q5_1: {
      uint32_t high;
      memcpy(&high, b + 4, 4);
      nibbles32(b + 8, high, half(b), half(b + 2), out);
      return;
    }
    case GGML_TYPE_Q8_0: {
      const float d = half(b);
      for (int j = 0; j < QK; j++) out[j] = (float)(int8_t)b[2 + j] * d;
      return;
    }
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: {
      const int five = type == GGML_TYPE_Q5_K;
      const float d = half(b), dmin = half(b + 2);
      const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
      for (int c = 0; c < 4; c++) { /* 64 values: groups 2c (low nibbles), 2c + 1 (high) */
        for (int half_ = 0; half_ < 2; half_++) {
          const int g = 2 * c + half_;
          int sc, mn;
          k_scale_min(scales, g, &sc, &mn);
          const float scale = d * (float)sc, offset = -dmin * (float)mn;
          for (int l = 0; l < 32; l++) {
            int q = half_ ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0x0f;
            if (five) q |= ((qh[l] >> g) & 1) << 4;
            out[64 * c + 32 * half_ + l] = (float)q * scale + offset;
          }
        }
      }
      return;
    }
    case GGML_TYPE_Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t *sc = (const int8_t *)(b + 192);
      const float d = half(b + 208);
      for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
          const uint8_t lo0 = ql[64 * h + l], lo1 = ql[64 * h + 32 + l], hb = qh[32 * h + l];
          const int q[4] = {(lo0 & 0x0f) | ((hb & 3) << 4), (lo1 & 0x0f) | (((hb >> 2) & 3) << 4),
                            (lo0 >> 4) | (((hb >> 4) & 3) << 4), (lo1 >> 4) | (((hb >> 6) & 3) << 4)};
          for (int s = 0; s < 4; s++)
            out[128 * h + 32 * s + l] = d * (float)sc[8 * h + 2 * s + l / 16] * (float)(q[s] - 32);
        }
      return;
    }
    default:
      return;
  }
}

/* ------------------------------------------------------------------ AVX2 block decoders */
#if defined(__AVX2__) && defined(__FMA__)
/* 32 byte values (signed or not) to float32 times scale plus offset: out[0..32). The first 16
 * take (s0, o0), the last 16 (s1, o1). */
static inline void bytes_out(__m256i v, int is_signed, float s0, float o0, float s1, float o1,
                             float *out) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  const __m128i parts[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
  for (int i = 0; i < 4; i++) {
    const __m256i w32 = is_signed ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]);
    const __m256 s = _mm256_set1_ps(i < 2 ? s0 : s1), o = _mm256_set1_ps(i < 2 ? o0 : o1);
    _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(w32), s, o));
  }
}

static void vector_block(int64_t type, const uint8_t *b, float *out) {
  switch (type) {
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q8_0: {
      float m;
      const float d = b32_scale(type, b, &m);
      bytes_out(b32_ints(type, b), type == GGML_TYPE_Q8_0, d, m, d, m, out);
      return;
    }
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: {
      const int five = type == GGML_TYPE_Q5_K;
      const float d = half(b), dmin = half(b + 2);
      const uint8_t *qs = b + (five ? 48 : 16);
      const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
      for (int c = 0; c < 4; c++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        for (int h = 0; h < 2; h++) {
          const int g = 2 * c + h;
          int sc, mn;
          k_scale_min(b + 4, g, &sc, &mn);
          __m256i q = h ? high4(bytes) : low4(bytes);
          if (five) q = _mm256_or_si256(q, byte_bits(qh, g, 1, 4));
          const float s = d * (float)sc, o = -dmin * (float)mn;
          bytes_out(q, 0, s, o, s, o, out + 64 * c + 32 * h);
        }
      }
      return;
    }
    case GGML_TYPE_Q6_K: {
      const int8_t *sc = (const int8_t *)(b + 192);
      const float d = half(b + 208);
      for (int h = 0; h < 2; h++) {
        __m256i q[4];
        q6k_half(b, h, q);
        for (int s = 0; s < 4; s++) {
          const int8_t *g = sc + 8 * h + 2 * s;
          bytes_out(q[s], 1, d * (float)g[0], 0.0f, d * (float)g[1], 0.0f, out + 128 * h + 32 * s);
        }
      }
      return;
    }
    default:
      return;
  }
}
#define decode_block vector_block
#else
#define decode_block scalar_block
#endif

/* Values [v0, v0 + count) of a weight row of `type` (v0 and count whole blocks) into out. */
static inline void decode_span(int64_t type, const uint8_t *row, int64_t v0, int64_t count,
                               float *out) {
  const int64_t values = gguf_block_values(type), bytes = type_block_bytes(type);
  for (int64_t v = 0; v < count; v += values)
    decode_block(type, row + (v0 + v) / values * bytes, out + v);
}

void gguf_decode_row(int64_t type, const void *row, int64_t k, float *out) {
  decode_span(type, (const uint8_t *)row, 0, k, out);
}

void gguf_decode_span(int64_t type, const void *row, int64_t v0, int64_t count, float *out) {
  decode_span(type, (const uint8_t *)row, v0, count, out);
}

const void *gguf_part_row(const gguf_part_t *parts, int64_t n, int64_t k, int64_t *type) {
  return stacked_row(parts, n, k, type);
}

/* ------------------------------------------------------------------ GEMV */

/* acc[m] += buf . x[m] over `count` values for R rows of x (row stride k). */
static inline __attribute__((always_inline)) void span_dot(const int R, const float *buf,
                                                           const float *x, int64_t k,
                                                           int64_t count, float *acc) {
#if VEC > 1
  vec_t a[QGEMV_MAX_ROWS][2];
  for (int m = 0; m < R; m++) a[m][0] = a[m][1] = vzero();
  for (int64_t i = 0; i < count; i += 2 * VEC) {
    const vec_t w0 = vload(buf, i, 0), w1 = vload(buf, i + VEC, 0);
    for (int m = 0; m < R; m++) {
      a[m][0] = vfma(w0, vload(x, m * k + i, 0), a[m][0]);
      a[m][1] = vfma(w1, vload(x, m * k + i + VEC, 0), a[m][1]);
    }
  }
  for (int m = 0; m < R; m++) acc[m] += vsum(vadd(a[m][0], a[m][1]));
#else
  for (int m = 0; m < R; m++) {
    float s = 0.0f;
    for (int64_t i = 0; i < count; i++) s += buf[i] * x[m * k + i];
    acc[m] += s;
  }
#endif
}

/* A row's dot products with R rows of x through the decoded buffer (any type). */
static inline __attribute__((always_inline)) void row_dot_decoded(const int R, int64_t type,
                                                                  const uint8_t *row,
                                                                  const float *xf, int64_t k,
                                                                  float *acc) {
  float buf[SPAN] __attribute__((aligned(64)));
  for (int64_t v0 = 0; v0 < k; v0 += SPAN) {
    const int64_t count = k - v0 < SPAN ? k - v0 : SPAN;
    decode_span(type, row, v0, count, buf);
    span_dot(R, buf, xf + v0, k, count, acc);
  }
}

#include "gguf_float_rows.h"

typedef struct {
  int dtype;
  const float *xf;
  const float *xsum; /* sums of x over each group of 32, per row */
  const gguf_part_t *parts;
  void *y;
  int64_t rows, n_out, k;
} gguf_gemv_args;

static inline __attribute__((always_inline)) void gemv_rows(const int R, const gguf_gemv_args *a,
                                                            int64_t n0, int64_t n1) {
  const int64_t k = a->k;
  uint8_t scratch[STORED_ROW_BYTES(k)];
  for (int64_t n = n0; n < n1; n++) {
    int64_t type;
    const uint8_t *row = gguf_stored_row(a->parts, n, k, scratch, &type);
    const int64_t row_bytes = gguf_row_bytes(type, k);
    if (n + 4 < n1 && row != scratch) prefetch_bytes(row + 4 * row_bytes, row_bytes);
    float acc[QGEMV_MAX_ROWS] = {0};
#if defined(__AVX2__) && defined(__FMA__)
    row_dot_fused(R, type, row, a->xf, a->xsum, k, acc);
#else
    row_dot_decoded(R, type, row, a->xf, k, acc);
#endif
    for (int m = 0; m < R; m++) store(a->y, m * a->n_out + n, acc[m], a->dtype);
  }
}

#define GGUF_GEMV_SPECIAL(R) \
  static void gguf_gemv_rows##R(const gguf_gemv_args *a, int64_t n0, int64_t n1) { \
    gemv_rows(R, a, n0, n1);                                                         \
  }
GGUF_GEMV_SPECIAL(1)
GGUF_GEMV_SPECIAL(2)
GGUF_GEMV_SPECIAL(4)

static void gguf_gemv_range(void *p, int64_t n0, int64_t n1) {
  const gguf_gemv_args *a = p;
  /* Rows of x in groups of 4, 2 and 1, each group over the same weight row while it is in L1. */
  for (int64_t m0 = 0; m0 < a->rows;) {
    gguf_gemv_args group = *a;
    const int64_t left = a->rows - m0;
    group.xf = a->xf + m0 * a->k;
    group.xsum = a->xsum + m0 * (a->k / QK);
    group.y = (char *)a->y + m0 * a->n_out * (a->dtype ? 2 : 4);
    if (left >= 4) {
      gguf_gemv_rows4(&group, n0, n1);
      m0 += 4;
    } else if (left >= 2) {
      gguf_gemv_rows2(&group, n0, n1);
      m0 += 2;
    } else {
      gguf_gemv_rows1(&group, n0, n1);
      m0 += 1;
    }
  }
}

int gguf_parts_valid(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  int64_t covered = 0;
  for (int i = 0; i < GGUF_MAX_PARTS && covered < n_out; i++) {
    if (parts[i].rows < 1 || gguf_row_bytes(parts[i].type, k) < 0) return 0;
    covered += parts[i].rows;
  }
  return covered == n_out;
}

int gguf_gemv(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
              int64_t n_out, int64_t k, int threads) {
  if (rows < 1 || rows > QGEMV_MAX_ROWS || k % QK || !gguf_parts_valid(parts, n_out, k))
    return -1;
  const int64_t groups = k / QK;
  float *xf = (float *)malloc((size_t)(rows * k) * sizeof(float));
  float *xsum = (float *)malloc((size_t)(rows * groups) * sizeof(float));
  if (xf == NULL || xsum == NULL) {
    free(xf);
    free(xsum);
    return -1;
  }
  for (int64_t m = 0; m < rows; m++) {
    load_row(x, m * k, k, xf + m * k, dtype);
    for (int64_t g = 0; g < groups; g++) {
      float s = 0.0f;
      for (int64_t j = 0; j < QK; j++) s += xf[m * k + g * QK + j];
      xsum[m * groups + g] = s;
    }
#if defined(__AVX2__) && defined(__FMA__)
    permute_x_strided(xf + m * k, k);
#endif
  }
  gguf_gemv_args a = {dtype, xf, xsum, parts, y, rows, n_out, k};
  const int64_t parts_per_thread = 4 * (threads > 1 ? threads : 1);
  int64_t chunk = ((n_out + parts_per_thread - 1) / parts_per_thread + 15) / 16 * 16;
  if (chunk < 32) chunk = 32;
  parallel_range(gguf_gemv_range, &a, n_out, chunk, threads, n_out * k >= 65536);
  free(xf);
  free(xsum);
  return 0;
}

/* ------------------------------------------------------------------ dequantization */

typedef struct {
  int dtype;
  const gguf_part_t *parts;
  const int64_t *ids;
  void *out;
  int64_t k;
} gguf_dequant_args;

const uint8_t *gguf_stored_row(const gguf_part_t *parts, int64_t n, int64_t k, uint8_t *scratch,
                               int64_t *type) {
  for (; n >= parts->rows; parts++) n -= parts->rows;
  if (parts->type == GGUF_QUADS_Q5_0) {
    gguf_unquad_row(parts->data, n, k, scratch);
    *type = GGML_TYPE_Q5_0;
    return scratch;
  }
  if (parts->type < GGUF_TILED_BASE) return stacked_row(parts, n, k, type);
  *type = untiled_type(parts->type);
  gguf_untile_row(parts->type, parts->data, n, k, scratch);
  return scratch;
}

static void gguf_dequant_range(void *p, int64_t i0, int64_t i1) {
  const gguf_dequant_args *a = p;
  const int64_t k = a->k;
  float buf[SPAN] __attribute__((aligned(64)));
  uint8_t untiled[STORED_ROW_BYTES(k)];
  for (int64_t i = i0; i < i1; i++) {
    int64_t type;
    const uint8_t *src = gguf_stored_row(a->parts, a->ids ? a->ids[i] : i, k, untiled, &type);
    if (a->dtype == 0) {
      decode_span(type, src, 0, k, (float *)a->out + i * k);
      continue;
    }
    for (int64_t v0 = 0; v0 < k; v0 += SPAN) { /* bf16: through the buffer */
      const int64_t count = k - v0 < SPAN ? k - v0 : SPAN; /* whole blocks: a multiple of VEC */
      decode_span(type, src, v0, count, buf);
      for (int64_t j = 0; j < count; j += VEC)
        vstore_as(a->out, i * k + v0 + j, vload(buf, j, 0), 1);
    }
  }
}

int gguf_dequantize(int dtype, const gguf_part_t *parts, const int64_t *ids, int64_t n_ids,
                    int64_t n_out, int64_t k, void *out, int threads) {
  gguf_part_t as_stored[GGUF_MAX_PARTS];
  untiled_parts(parts, n_out, as_stored);
  if (!gguf_parts_valid(as_stored, n_out, k)) return -1;
  if (ids != NULL)
    for (int64_t i = 0; i < n_ids; i++)
      if (ids[i] < 0 || ids[i] >= n_out) return -1;
  gguf_dequant_args a = {dtype, parts, ids, out, k};
  parallel_range(gguf_dequant_range, &a, n_ids, 16, threads, n_ids * k >= 65536);
  return 0;
}
