/*
 * gguf_a8_gemm.c's weight side: a super-block (256 values) of 16 Q4_K or Q6_K weight rows,
 * read from the file's rows (their bytes transposed as stored) or from a tile (gguf_tiles.h:
 * already in lane order), decoded into 64 vectors whose 32-bit lane r holds 4 consecutive
 * integers of weight row r, with the 16 rows' group scales (and Q4_K's mins) unpacked as
 * vectors; the next block's rows prefetched into L2 as one decodes (prefetch_next). Included
 * inside a VNNI-512 section by gguf_a8_gemm.c, and by gguf_tiles.c for the transposes
 * (row_words4, row_words) that write Q4_K tiles.
 */
#ifndef SGLITE_KERNELS_GGUF_A8_GEMM_DECODE_H
#define SGLITE_KERNELS_GGUF_A8_GEMM_DECODE_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "a8_rounding.h"
#include "gguf_bits.h"
#include "gguf_tiles.h"
#include "transpose16.h"

#define QK_K 256
/* Weight rows a decoded block covers: one 32-bit lane each. */
#define WROWS 16

/* Bytes [from, from + bytes) of each of the next block's 16 rows (none when next is NULL),
 * fetched into L2 while this block decodes: its 16 rows are 16 streams, more than the hardware
 * prefetchers follow, and with few x rows a block's products are too short to hide its loads
 * (into L1, the prefetched lines would evict the block being decoded). */
static inline void prefetch_next(const uint8_t *const next[WROWS], int64_t from, int64_t bytes) {
  if (next == NULL) return;
  for (int r = 0; r < WROWS; r++) {
    const uintptr_t first = ((uintptr_t)(next[r] + from)) & ~(uintptr_t)63;
    for (uintptr_t line = first; line < (uintptr_t)(next[r] + from + bytes); line += 64)
      _mm_prefetch((const char *)line, _MM_HINT_T1);
  }
}

/* One super-block of 16 weight rows, decoded. */
typedef struct {
  __m512i w[QK_K / 4];     /* w[g]: values 4g..4g+3 of each row, row r in lane r */
  __m512i min_pairs[4];    /* Q4_K: row r's mins of groups 2p (low half) and 2p + 1, lane r */
  float scale[16][WROWS];  /* group j's scale of each row (8 groups of 32, or 16 of 16) */
  float dmin[WROWS];       /* Q4_K: each row's scale of its mins */
} decoded_block;

/* The 16 bytes at rows[r] + offset of each of the 16 rows, as four vectors: t[j] lane r holds
 * bytes 4j..4j+3 of row r's 16 (a 16x4 transpose of 32-bit groups, done per 128-bit lane). */
static inline void row_words4(const uint8_t *const rows[WROWS], int64_t offset, __m512i t[4]) {
  __m512i a[4]; /* a[g], 128-bit lane l: row 4l + g */
#define ROW16(r) _mm_loadu_si128((const __m128i *)(rows[r] + offset))
  for (int g = 0; g < 4; g++) {
    __m512i v = _mm512_castsi128_si512(ROW16(g));
    v = _mm512_inserti32x4(v, ROW16(4 + g), 1);
    v = _mm512_inserti32x4(v, ROW16(8 + g), 2);
    a[g] = _mm512_inserti32x4(v, ROW16(12 + g), 3);
  }
#undef ROW16
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  t[0] = _mm512_unpacklo_epi64(t0, t2);
  t[1] = _mm512_unpackhi_epi64(t0, t2);
  t[2] = _mm512_unpacklo_epi64(t1, t3);
  t[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The 16 rows' 4-byte groups 16h..16h+15 of the `bytes` at rows[r] + offset (bytes = 64 per h):
 * p[16h + i] lane r holds bytes 4(16h + i)..+3 of row r. */
static inline void row_words(const uint8_t *const rows[WROWS], int64_t offset, int halves,
                             __m512i *p) {
  for (int h = 0; h < halves; h++) {
    __m512i *v = p + 16 * h;
    for (int r = 0; r < WROWS; r++)
      v[r] = _mm512_loadu_si512((const void *)(rows[r] + offset + 64 * h));
    transpose16(v);
  }
}

/* Byte j % 4 of word w's lanes (unsigned) as floats. */
static inline __m512 byte_floats(__m512i w, int j) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 8 * (j & 3)),
                                             _mm512_set1_epi32(0xff)));
}

/* A Q4_K super-block's scales of 16 rows from its head's words (d, dmin and the 12 scale bytes
 * as 4 word vectors): all 16 rows' unpacked at once, as k_scales8 unpacks one row's. */
static inline void q4k_scales(const __m512i head[4], decoded_block *out) {
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head[0]));
  const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head[0], 16)));
  const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), four = _mm512_set1_epi32(0x0f0f0f0f);
  const __m512i top2 = _mm512_set1_epi32(0x30303030); /* bits 6-7 of a byte, moved to 4-5 */
  const __m512i sc[2] = {
      _mm512_and_si512(head[1], low6),
      _mm512_or_si512(_mm512_and_si512(head[3], four),
                      _mm512_and_si512(_mm512_srli_epi32(head[1], 2), top2))};
  const __m512i mn[2] = {
      _mm512_and_si512(head[2], low6),
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(head[3], 4), four),
                      _mm512_and_si512(_mm512_srli_epi32(head[2], 2), top2))};
  for (int j = 0; j < 8; j++)
    _mm512_store_ps(out->scale[j], _mm512_mul_ps(d, byte_floats(sc[j >> 2], j)));
  _mm512_store_ps(out->dmin, dmin);
  for (int q = 0; q < 4; q++) {
    /* bytes 2(q & 1), 2(q & 1) + 1 of the lane: mins of groups 2q and 2q + 1, as int16 */
    const __m512i two = _mm512_srli_epi32(mn[q >> 1], 16 * (q & 1));
    out->min_pairs[q] = _mm512_or_si512(
        _mm512_and_si512(two, _mm512_set1_epi32(0xff)),
        _mm512_slli_epi32(_mm512_and_si512(two, _mm512_set1_epi32(0xff00)), 8));
  }
}

/* A Q4_K super-block of 16 rows from its words (head: as q4k_scales; p: the 128 nibble bytes as
 * 32, each lane a row's 4 bytes): the nibbles of 4 bytes hold 4 values of two groups, split
 * here. */
static inline void q4k_from_words(const __m512i head[4], const __m512i p[32],
                                  decoded_block *out) {
  q4k_scales(head, out);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; c++)
    for (int t = 0; t < 8; t++) {
      /* bytes 32c + 4t..: low nibbles are values 64c + 4t.., high ones 64c + 32 + 4t.. */
      const __m512i w = p[8 * c + t];
      out->w[16 * c + t] = _mm512_and_si512(w, nibble);
      out->w[16 * c + 8 + t] = _mm512_and_si512(_mm512_srli_epi32(w, 4), nibble);
    }
}

/* Super-block sb of the 16 Q4_K rows at rows[r]: the rows' bytes transposed as stored. */
static void decode_q4k(const uint8_t *const rows[WROWS], int64_t sb, decoded_block *out) {
  const int64_t at = sb * 144;
  __m512i head[4], p[32];
  row_words4(rows, at, head);
  row_words(rows, at + 16, 2, p);
  q4k_from_words(head, p, out);
}

/* Bytes ahead of a tiled block's loads that each load prefetches into L1 (TILED_AHEAD) and into
 * L2 (TILED_AHEAD_L2): a tiled weight is one contiguous run per range of blocks, which the
 * hardware prefetchers alone leave behind; L1 alone cannot hold enough lines in flight to read
 * at the memory's rate, so lines further on are asked of L2 first. */
#define TILED_AHEAD 4096
#define TILED_AHEAD_L2 16384

/* A tiled super-block's vector at `at`, the lines TILED_AHEAD and TILED_AHEAD_L2 bytes further
 * prefetched. */
static inline __m512i load_ahead(const uint8_t *at) {
  _mm_prefetch((const char *)(at + TILED_AHEAD), _MM_HINT_T0);
  _mm_prefetch((const char *)(at + TILED_AHEAD_L2), _MM_HINT_T1);
  return _mm512_loadu_si512((const void *)at);
}

/* A tiled Q4_K super-block (gguf_tiles.h): its words as stored. */
static void decode_q4k_tiled(const uint8_t *tiled, decoded_block *out) {
  __m512i head[4], p[32];
  for (int j = 0; j < 4; j++) head[j] = load_ahead(tiled + 64 * j);
  for (int i = 0; i < 32; i++) p[i] = load_ahead(tiled + 256 + 64 * i);
  q4k_from_words(head, p, out);
}

/* A Q6_K super-block's 16 group scales of 16 rows (d: the rows' scales; scales: the int8 group
 * scales as 4 word vectors). */
static inline void q6k_scales(__m512 d, const __m512i scales[4], decoded_block *out) {
  for (int j = 0; j < 16; j++) {
    const __m512i byte = _mm512_srai_epi32(_mm512_slli_epi32(scales[j >> 2], 24 - 8 * (j & 3)), 24);
    _mm512_store_ps(out->scale[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(byte)));
  }
}

/* Q6_K's values 128h + 32s + 4t.. of each row (0..63) from the word vectors holding their low 4
 * bits (`low`: ql bytes 64h + 32(s & 1) + 4t.., nibble s >> 1) and high 2 (`high`: qh bytes
 * 32h + 4t.., bits 2s and 2s + 1). */
static inline __m512i q6k_values(__m512i low, __m512i high, int s) {
  const __m512i nibble = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(0x30);
  const __m512i lo4 = _mm512_and_si512(_mm512_srli_epi32(low, 4 * (s >> 1)), nibble);
  const __m512i hi2 =
      s < 2 ? _mm512_slli_epi32(high, 4 - 2 * s) : _mm512_srli_epi32(high, 2 * s - 4);
  return _mm512_or_si512(lo4, _mm512_and_si512(hi2, two));
}

/* A Q6_K super-block of 16 rows from its words (d: the rows' scales; scales: the 16 int8 group
 * scales as 4 word vectors; ql: the low 4 bits as 32, qh: the high 2 as 16): values q in 0..63
 * (the block's -32 is in the offset). */
static inline void q6k_from_words(__m512 d, const __m512i scales[4], const __m512i ql[32],
                                  const __m512i qh[16], decoded_block *out) {
  q6k_scales(d, scales, out);
  for (int h = 0; h < 2; h++)
    for (int s = 0; s < 4; s++)
      for (int t = 0; t < 8; t++)
        out->w[32 * h + 8 * s + t] = q6k_values(ql[16 * h + 8 * (s & 1) + t], qh[8 * h + t], s);
}

/* Super-block sb of the 16 Q6_K rows at rows[r], as decode_q4k. */
static void decode_q6k(const uint8_t *const rows[WROWS], int64_t sb, decoded_block *out) {
  const int64_t at = sb * 210;
  uint16_t dh[WROWS];
  for (int r = 0; r < WROWS; r++) memcpy(&dh[r], rows[r] + at + 208, 2);
  __m512i scales[4], ql[32], qh[16];
  row_words4(rows, at + 192, scales);
  row_words(rows, at, 2, ql);
  row_words(rows, at + 128, 1, qh);
  q6k_from_words(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh)), scales, ql, qh, out);
}

/* A tiled Q6_K super-block (gguf_tiles.h): its d and words as stored. */
static void decode_q6k_tiled(const uint8_t *tiled, decoded_block *out) {
  __m512i scales[4], ql[32], qh[16];
  _mm_prefetch((const char *)(tiled + TILED_AHEAD + 3296), _MM_HINT_T0); /* its last line */
  for (int j = 0; j < 4; j++) scales[j] = load_ahead(tiled + 32 + 64 * j);
  for (int i = 0; i < 32; i++) ql[i] = load_ahead(tiled + 288 + 64 * i);
  for (int i = 0; i < 16; i++) qh[i] = load_ahead(tiled + 2336 + 64 * i);
  q6k_from_words(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tiled)), scales, ql, qh,
                 out);
}

/* sums[m] (a row's products, 16 lanes) += `total` (x row m's products with the decoded
 * super-block sb before x's scale) less Q4_K's mins times x's group sums where `q4k` (one
 * `vpdpwssd` per two groups, scaled by dmin), scaled by x's dx for the super-block. */
static inline __attribute__((always_inline)) void add_row_total(const int q4k,
                                                                const decoded_block *blk,
                                                                const rounded_x *x, int64_t m,
                                                                int64_t sb, __m512 total,
                                                                float *sums) {
  const int64_t k = x->k;
  if (q4k) {
    const int16_t *xsums = x->sum32 + m * (k / 32) + sb * 8;
    __m512i mins = _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) {
      int32_t two;
      memcpy(&two, xsums + 2 * p, 4);
      mins = _mm512_dpwssd_epi32(mins, blk->min_pairs[p], _mm512_set1_epi32(two));
    }
    total = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_load_ps(blk->dmin), total);
  }
  float *acc = sums + 2 * m * WROWS;
  const __m512 dx = _mm512_set1_ps(x->dx[m * (k / QK_K) + sb]);
  _mm512_store_ps(acc, _mm512_fmadd_ps(total, dx, _mm512_load_ps(acc)));
}

/* Super-block sb of the 16 weight rows at rows[r] (Q4_K or Q6_K: `type`, or tiled: rows[0] is
 * the tile, its super-blocks one after another). */
static __attribute__((unused)) void decode_block(int64_t type, const uint8_t *const rows[WROWS],
                                                 int64_t sb, decoded_block *out) {
  switch (type) {
    case GGML_TYPE_Q4_K:
      decode_q4k(rows, sb, out);
      break;
    case GGUF_TILED_Q4_K:
      decode_q4k_tiled(rows[0] + sb * TILED_Q4_K_SB_BYTES, out);
      break;
    case GGUF_TILED_Q6_K:
      decode_q6k_tiled(rows[0] + sb * TILED_Q6_K_SB_BYTES, out);
      break;
    default:
      decode_q6k(rows, sb, out);
  }
}

#endif
