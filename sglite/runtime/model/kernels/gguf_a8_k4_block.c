/*
 * Q4_K weights times several x rows rounded to int8 (a8_rounding.h), eight weight rows at a time,
 * on AVX2 builds without VNNI (K4_LANES without K4_LANES_VNNI): gguf_a8.c's GEMV takes it for
 * K4_BLOCK_MIN_XROWS or more x rows, where its per-row products (k4_row_lanes) are bound by the
 * loads and operations around each x row's `vpmaddubsw`s rather than by the multiplies.
 *
 * Layout: a super-block of eight weight rows is decoded once for all x rows into 64 vectors whose
 * 32-bit lane r holds 4 consecutive integers of weight row r (the rows' nibble bytes transposed as
 * stored, 8x8 transposes of 32-bit groups, then split into low and high nibbles), with the rows'
 * scales and mins transposed alike. An x row's 4 int8 values are broadcast as `vpmaddubsw`'s
 * signed operand, so one instruction adds 4 products to each of the eight rows' sums without
 * horizontal sums, and each weight vector loaded serves XSTEP x rows.
 *
 * Values: k4_row_lanes' bit for bit, so a row's result does not depend on which path computed
 * it (nor on the other rows). That kernel keeps, per row, eight int32 lanes per super-block (lane
 * c + 4 h: chunk c's dwords 4 h .. 4 h + 3 of its two groups, each group's int16 sum times its
 * scale) and four of mins times x's group sums, scaled in float into eight and four accumulators
 * and summed in sum256's order at the end. Here each such lane is a vector of the eight rows' (the
 * same integers: the same sums of the same products), followed by the same float operations in
 * the same order, lane by lane.
 */
#include "a8_rounding.h"
#include "gguf_bits.h"

#if defined(K4_LANES) && !defined(K4_LANES_VNNI)
#include "gguf_a8_k4_block.h"

#define QK 32
#define QK_K 256
/* x rows that share each load of a weight vector */
#define XSTEP 4
/* How far ahead of the super-block being decoded each row's bytes are prefetched: the rows
 * stream from memory in a decode pass, where the hardware prefetchers stop at each 4 KB page. */
#define PREFETCH_AHEAD 1024

/* The 8 x 32 bytes at rows[r] + offset transposed by 32-bit groups: t[i] lane r = group i of
 * row r's 32 bytes. */
static inline void transpose_groups(const uint8_t *const rows[K4_BLOCK_ROWS], int64_t offset,
                                    __m256i t[8]) {
  __m256i c[8], a[8], b[8];
  for (int r = 0; r < 8; r++) c[r] = _mm256_loadu_si256((const __m256i *)(rows[r] + offset));
  for (int r = 0; r < 8; r += 2) {
    a[r] = _mm256_unpacklo_epi32(c[r], c[r + 1]);
    a[r + 1] = _mm256_unpackhi_epi32(c[r], c[r + 1]);
  }
  for (int r = 0; r < 8; r += 4)
    for (int h = 0; h < 2; h++) {
      b[r + h] = _mm256_unpacklo_epi64(a[r + h], a[r + h + 2]);
      b[r + h + 2] = _mm256_unpackhi_epi64(a[r + h], a[r + h + 2]);
    }
  /* b[0..3]: rows 0-3, groups (0, 4), (2, 6), (1, 5), (3, 7) by 128-bit lane; b[4..7]: rows 4-7 */
  static const int order[4] = {0, 2, 1, 3};
  for (int j = 0; j < 4; j++) {
    t[order[j]] = _mm256_permute2x128_si256(b[j], b[j + 4], 0x20);
    t[order[j] + 4] = _mm256_permute2x128_si256(b[j], b[j + 4], 0x31);
  }
}

/* A super-block of the eight rows (byte offset `at` in each): its 64 integer vectors (w[g][i]:
 * group g's values 4 i .. 4 i + 3, lane r = row r), its group scales (sc[g], both int16 halves
 * of lane r = row r's scale of group g), its mins by pairs of groups (mn[j], lane r = row r's
 * mins of groups 2 j and 2 j + 1 as int16) and d, dmin as floats. */
typedef struct {
  __m256i w[8][8];
  __m256i sc[8];
  __m256i mn[4];
  __m256 d, dmin;
} k4_block;

/* Bytes 8 h .. 8 h + 7 of v as the low 16 bits of eight int32 lanes. */
static inline __m256i bytes_to_lanes(__m128i v, int h) {
  return _mm256_cvtepu8_epi32(h ? _mm_srli_si128(v, 8) : v);
}

/* The eight rows' scales, mins, d and dmin of the super-block at byte offset `at` (k4_block). */
static inline void block_scales(const uint8_t *const rows[K4_BLOCK_ROWS], int64_t at,
                                k4_block *blk) {
  __m128i v[8], a[8], b[8], c[8];
  for (int r = 0; r < 8; r++) v[r] = k_scales16(rows[r] + at + 4);
  /* transposed: c[0..3] groups (0, 1), (2, 3), (4, 5), (6, 7)'s scales, c[4..7] their mins,
   * each 8 bytes in row order */
  for (int r = 0; r < 8; r += 2) {
    a[r] = _mm_unpacklo_epi8(v[r], v[r + 1]);     /* scales */
    a[r + 1] = _mm_unpackhi_epi8(v[r], v[r + 1]); /* mins */
  }
  for (int r = 0; r < 8; r += 4)
    for (int h = 0; h < 2; h++) {
      b[r + 2 * h] = _mm_unpacklo_epi16(a[r + h], a[r + h + 2]);     /* groups 0-3 */
      b[r + 2 * h + 1] = _mm_unpackhi_epi16(a[r + h], a[r + h + 2]); /* groups 4-7 */
    }
  for (int q = 0; q < 4; q++) { /* b[q] (rows 0-3) with b[q + 4] (rows 4-7) */
    const int dst = (q & 2 ? 4 : 0) + 2 * (q & 1);
    c[dst] = _mm_unpacklo_epi32(b[q], b[q + 4]);
    c[dst + 1] = _mm_unpackhi_epi32(b[q], b[q + 4]);
  }
  for (int g = 0; g < 8; g++) {
    const __m256i s = bytes_to_lanes(c[g / 2], g & 1);
    blk->sc[g] = _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
  }
  for (int j = 0; j < 4; j++)
    blk->mn[j] = _mm256_or_si256(bytes_to_lanes(c[4 + j], 0),
                                 _mm256_slli_epi32(bytes_to_lanes(c[4 + j], 1), 16));
  int32_t dd[8];
  for (int r = 0; r < 8; r++) memcpy(&dd[r], rows[r] + at, 4);
  const __m256i both = _mm256_setr_epi32(dd[0], dd[1], dd[2], dd[3], dd[4], dd[5], dd[6], dd[7]);
  const __m256i halves = _mm256_shuffle_epi8(
      both, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8,
                             9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  /* 64-bit lanes: d of rows 0-3, dmin 0-3, d 4-7, dmin 4-7 */
  blk->d = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(halves, 0x08)));
  blk->dmin = _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(halves, 0x0d)));
}

static inline void decode_block(const uint8_t *const rows[K4_BLOCK_ROWS], int64_t at,
                                k4_block *blk) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  for (int c = 0; c < 4; c++) { /* chunk c: low nibbles group 2c, high nibbles group 2c + 1 */
    __m256i t[8];
    transpose_groups(rows, at + 16 + 32 * c, t);
    for (int i = 0; i < 8; i++) {
      blk->w[2 * c][i] = _mm256_and_si256(t[i], nibble);
      blk->w[2 * c + 1][i] = _mm256_and_si256(_mm256_srli_epi16(t[i], 4), nibble);
    }
  }
  block_scales(rows, at, blk);
}

static inline __m256i broadcast4(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

/* Lane l of k4_row_lanes' sums (l = c + 4 h) holds chunk c's values of dwords 4 h .. 4 h + 3 of
 * both its groups (2 c: low nibbles, 2 c + 1: high): here, for X x rows (xq[0..X-1]), one vector
 * of eight rows' such sums, scaled by the groups' scales, per lane (lanes[m][l]). Each weight
 * vector loaded serves the X rows. */
static inline __attribute__((always_inline)) void lane_sums(const int X, const k4_block *blk,
                                                            const int8_t *const xq[XSTEP],
                                                            __m256i lanes[XSTEP][8]) {
  for (int c = 0; c < 4; c++)
    for (int h = 0; h < 2; h++) {
      __m256i scaled[XSTEP];
      for (int m = 0; m < X; m++) scaled[m] = _mm256_setzero_si256();
      for (int e = 0; e < 2; e++) {
        const int g = 2 * c + e;
        const __m256i *w = blk->w[g] + 4 * h;
        const __m256i w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
        for (int m = 0; m < X; m++) {
          const int8_t *xg = xq[m] + 32 * g + 16 * h;
          __m256i p = _mm256_maddubs_epi16(w0, broadcast4(xg));
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w1, broadcast4(xg + 4)));
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w2, broadcast4(xg + 8)));
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w3, broadcast4(xg + 12)));
          scaled[m] = _mm256_add_epi32(scaled[m], _mm256_madd_epi16(p, blk->sc[g]));
        }
      }
      for (int m = 0; m < X; m++) lanes[m][c + 4 * h] = scaled[m];
    }
}

/* x row m's super-block `sb` (its lane sums `lanes`) into its accumulators. */
static inline __attribute__((always_inline)) void add_block(const k4_block *blk,
                                                            const rounded_x *x, int64_t m,
                                                            int64_t sb, const __m256i lanes[8],
                                                            __m256 acc[8], __m256 off[4]) {
  const int64_t k = x->k, blocks = k / QK_K;
  const __m256 dx = _mm256_set1_ps(x->dx[m * blocks + sb]);
  const __m256 d = _mm256_mul_ps(blk->d, dx), dmin = _mm256_mul_ps(blk->dmin, dx);
  for (int l = 0; l < 8; l++) acc[l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes[l]), d, acc[l]);
  const int16_t *sums = x->sum32 + m * (k / QK) + 8 * sb;
  for (int j = 0; j < 4; j++) {
    int32_t pair;
    memcpy(&pair, sums + 2 * j, 4);
    const __m256i mins = _mm256_madd_epi16(blk->mn[j], _mm256_set1_epi32(pair));
    off[j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), dmin, off[j]);
  }
}

/* sum256's order of additions (common.h) over eight vectors' lanes, lane by lane. */
static inline __m256 sum8(const __m256 v[8]) {
  const __m256 a = _mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6]));
  const __m256 b = _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7]));
  return _mm256_add_ps(a, b);
}

void k4_block_products(const uint8_t *const rows[K4_BLOCK_ROWS], const rounded_x *x,
                       int64_t m0, int64_t m1, float *out) {
  const int64_t k = x->k, blocks = k / QK_K, xrows = m1 - m0;
  /* per x row, k4_row_lanes' eight lanes of scaled sums and four of offsets, by weight row */
  __m256 acc[K4_BLOCK_XROWS][8], off[K4_BLOCK_XROWS][4];
  for (int64_t m = 0; m < xrows; m++) {
    for (int l = 0; l < 8; l++) acc[m][l] = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) off[m][j] = _mm256_setzero_ps();
  }
  k4_block blk;
  for (int64_t sb = 0; sb < blocks; sb++) {
    for (int r = 0; r < K4_BLOCK_ROWS; r++) /* the rows' bytes a few super-blocks ahead */
      prefetch_bytes(rows[r] + sb * 144 + PREFETCH_AHEAD, 144);
    decode_block(rows, sb * 144, &blk);
    for (int64_t m = 0; m < xrows; m += XSTEP) {
      const int X = xrows - m < XSTEP ? (int)(xrows - m) : XSTEP;
      const int8_t *xq[XSTEP];
      for (int i = 0; i < XSTEP; i++) xq[i] = x->q + (m0 + m + (i < X ? i : 0)) * k + sb * QK_K;
      __m256i lanes[XSTEP][8];
      if (X == XSTEP)
        lane_sums(XSTEP, &blk, xq, lanes);
      else if (X == 3)
        lane_sums(3, &blk, xq, lanes);
      else if (X == 2)
        lane_sums(2, &blk, xq, lanes);
      else
        lane_sums(1, &blk, xq, lanes);
      for (int i = 0; i < X; i++)
        add_block(&blk, x, m0 + m + i, sb, lanes[i], acc[m + i], off[m + i]);
    }
  }
  /* row_products' ending: the lanes' sum, plus (0 + the offsets' lanes' sum) */
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t m = 0; m < xrows; m++) {
    const __m256 offsets[8] = {off[m][0], off[m][1], off[m][2], off[m][3], zero, zero, zero, zero};
    const __m256 total = _mm256_add_ps(sum8(acc[m]), _mm256_add_ps(zero, sum8(offsets)));
    _mm256_storeu_ps(out + m * K4_BLOCK_ROWS, total);
  }
}
#endif
