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
 */
#include "a8_rounding.h"
#include "gguf_a8_k4_block.h"
#include "gguf_bits.h"

#define QK 32
#define QK_K 256

/* Rows of x a kernel call takes together (each weight block decoded once for all of them). */
#define A8_ROWS 4

#if defined(__AVX2__) && defined(__FMA__)
/* How far ahead of the block being computed its row's bytes are prefetched (a stream's weight
 * rows are contiguous, so this runs into its next rows): far enough that the loads of a block
 * find it in cache, which the hardware prefetchers, stopping at every 4 KB page, do not ensure. */
#define PREFETCH_BYTES 2048

/* `lines` cache lines (a block's) PREFETCH_BYTES ahead of block `b`, where `prefetch` (a
 * constant in every inlined caller) says so. */
static inline __attribute__((always_inline)) void prefetch_ahead(const int prefetch,
                                                                 const uint8_t *b,
                                                                 const int lines) {
  if (!prefetch) return;
  for (int l = 0; l < lines; l++)
    _mm_prefetch((const char *)b + PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
}

static inline float hsum_ps(__m256 v) { return sum256(v); }

/* acc + the int16 pair products of p and s summed per int32 lane (one vpdpwssd with VNNI). */
static inline __m256i add_madd16(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

/* int16 j (0..7) of each 128-bit lane, in every int16 of that lane. */
static inline __m256i spread_int16(__m256i v, int j) {
  const __m256i ctrl = _mm256_set1_epi16((short)((2 * j) | ((2 * j + 1) << 8)));
  return _mm256_shuffle_epi8(v, ctrl);
}

typedef struct {
  __m256 acc[A8_ROWS];     /* scaled products */
  float off[A8_ROWS];      /* offsets */
  __m128 off_vec[A8_ROWS]; /* more offsets, per lane (summed into the result with off) */
} row_sums;

/* A Q4_K / Q5_K super-block's sums for x row `xrow` (its s->acc / off_vec index m): `isum`, its
 * scaled integers (8 lanes), times d and x's scale; its groups' mins (`mn16`, int16) times x's
 * group sums, times dmin and x's scale, subtracted. `dd`: d, dmin as floats. */
static inline __attribute__((always_inline)) void k4_add_block(__m256i isum, __m128 dd,
                                                               __m128i mn16, const rounded_x *x,
                                                               int64_t xrow, int64_t blk, int m,
                                                               row_sums *s) {
  const int64_t k = x->k;
  const __m128 scaled = _mm_mul_ps(dd, _mm_broadcast_ss(x->dx + xrow * (k / QK_K) + blk));
  s->acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcastss_ps(scaled), s->acc[m]);
  const __m128i sums = _mm_loadu_si128((const __m128i *)(x->sum32 + xrow * (k / QK) + 8 * blk));
  const __m128i mins = _mm_madd_epi16(mn16, sums);
  s->off_vec[m] = _mm_fnmadd_ps(_mm_cvtepi32_ps(mins), _mm_permute_ps(scaled, 0x55), s->off_vec[m]);
}

/* Q4_K (five = 0) / Q5_K super-blocks of one weight row against R x rows. */
static inline __attribute__((always_inline)) void k4_k5_row(const int R, const int prefetch,
                                                            const int five,
                                                            const uint8_t *row,
                                                            const rounded_x *x, int64_t m0,
                                                            row_sums *s) {
  const int64_t k = x->k, blocks = k / QK_K, bytes = five ? 176 : 144;
  for (int64_t blk = 0; blk < blocks; blk++) {
    const uint8_t *b = row + blk * bytes, *qs = b + (five ? 48 : 16);
    prefetch_ahead(prefetch, b, 3); /* 144 or 176 bytes */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i scales_mins = _mm256_cvtepu8_epi16(k_scales16(b + 4));
    const __m128i sc16 = _mm256_castsi256_si128(scales_mins);
    const __m128i mn16 = _mm256_extracti128_si256(scales_mins, 1);
#else /* on the integer units, where AVX2's vector units are this kernel's bound */
    uint32_t sc[2], mn[2];
    k_scales8(b + 4, sc, mn);
    const __m128i sc16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc[1], (int)sc[0]));
    const __m128i mn16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]));
#endif
    const __m256i scales = _mm256_broadcastsi128_si256(sc16);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    /* the low and high nibbles' sums as two chains: one `vpdpwssd` chain's latency bounds a
     * row's products at one x row (a short row's product is bound by that, not by memory) */
    __m256i isum[A8_ROWS], isum_high[A8_ROWS];
    for (int m = 0; m < R; m++) isum[m] = isum_high[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
      __m256i lo = low4(packed), hi = high4(packed);
      if (five) {
        lo = _mm256_or_si256(lo, byte_bits(qh, 2 * c, 1, 4));
        hi = _mm256_or_si256(hi, byte_bits(qh, 2 * c + 1, 1, 4));
      }
      const __m256i s_lo = spread_int16(scales, 2 * c), s_hi = spread_int16(scales, 2 * c + 1);
      for (int m = 0; m < R; m++) {
        const int8_t *xq = x->q + (m0 + m) * k + blk * QK_K + 64 * c;
        const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq));
        const __m256i p_hi =
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32)));
        isum[m] = add_madd16(isum[m], p_lo, s_lo);
        isum_high[m] = add_madd16(isum_high[m], p_hi, s_hi);
      }
    }
    int32_t dd_bits;
    memcpy(&dd_bits, b, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(dd_bits)); /* d, dmin: one conversion */
    for (int m = 0; m < R; m++)
      k4_add_block(_mm256_add_epi32(isum[m], isum_high[m]), dd, mn16, x, m0 + m, blk, m, s);
  }
}

#ifdef K4_LANES
/* A Q4_K super-block's scales as multipliers of its lane-tied sums (lane l: group 2 (l % 4) in
 * `even`, 2 (l % 4) + 1 in `odd`): int32 lanes for VNNI's vpmulld, else int16 lanes (both halves
 * of a 32-bit lane the same) for vpmaddwd; its mins as int16 (k4_add_block's `mn16`). */
static inline __attribute__((always_inline)) void k4_lane_scales(const uint8_t *b, __m256i *even,
                                                                 __m256i *odd, __m128i *mn16) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m128i scales_mins = k_scales16(b + 4);
#else /* on the integer units, where AVX2's vector units are this kernel's bound */
  uint32_t sc[2], mn[2];
  k_scales8(b + 4, sc, mn);
  const __m128i scales_mins = _mm_set_epi32((int)mn[1], (int)mn[0], (int)sc[1], (int)sc[0]);
#endif
  *mn16 = _mm_cvtepu8_epi16(_mm_srli_si128(scales_mins, 8));
#ifdef K4_LANES_VNNI
  *even = _mm256_cvtepu8_epi32(
      _mm_shuffle_epi8(scales_mins, _mm_setr_epi8(0, 2, 4, 6, 0, 2, 4, 6, -1, -1, -1, -1, -1, -1,
                                                  -1, -1)));
  *odd = _mm256_cvtepu8_epi32(
      _mm_shuffle_epi8(scales_mins, _mm_setr_epi8(1, 3, 5, 7, 1, 3, 5, 7, -1, -1, -1, -1, -1, -1,
                                                  -1, -1)));
#else
  *even = _mm256_cvtepu8_epi16(
      _mm_shuffle_epi8(scales_mins, _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 0, 0, 2, 2, 4, 4, 6, 6)));
  *odd = _mm256_cvtepu8_epi16(
      _mm_shuffle_epi8(scales_mins, _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 1, 1, 3, 3, 5, 5, 7, 7)));
#endif
}

/* Q4_K super-blocks of one weight row against R x rows with each 32-bit lane tied to a group
 * (K4_LANES): the nibble bytes transposed as x->q_lanes is, so a lane's products add up to its
 * group's sum and the groups' 6-bit scales multiply those sums once per super-block, where
 * k4_k5_row scales every 32 values' products for every x row. With VNNI one vpdpbusd per 32
 * values, the scales by vpmulld; on AVX2 one vpmaddubsw per 32 values, the four of the low (or
 * high) nibbles summed in int16 (a lane's 8 products of at most 15 x 127: no overflow), then
 * one vpmaddwd with the scales: 10 multiplies per super-block and x row where k4_k5_row takes
 * 16. The same integers per super-block; its float sums differ in rounding. */
static inline __attribute__((always_inline)) void k4_row_lanes(const int R, const int prefetch,
                                                               const uint8_t *row,
                                                               const rounded_x *x, int64_t m0,
                                                               row_sums *s) {
  const int64_t k = x->k, blocks = k / QK_K;
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  for (int64_t blk = 0; blk < blocks; blk++) {
    const uint8_t *b = row + blk * 144;
    prefetch_ahead(prefetch, b, 3); /* 144 bytes */
    __m256i s_lo, s_hi;
    __m128i mn16;
    k4_lane_scales(b, &s_lo, &s_hi, &mn16);
    __m256i t[4], lo[4], hi[4];
    k4_lanes(b + 16, 32, t);
    for (int j = 0; j < 4; j++) {
      lo[j] = _mm256_and_si256(t[j], nibble);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(t[j], 4), nibble);
    }
    int32_t dd_bits;
    memcpy(&dd_bits, b, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(dd_bits)); /* d, dmin: one conversion */
    for (int m = 0; m < R; m++) {
      const int8_t *xq = x->q_lanes + (m0 + m) * k + blk * QK_K;
#ifdef K4_LANES_VNNI
      __m256i sum_lo = _mm256_setzero_si256(), sum_hi = _mm256_setzero_si256();
      for (int j = 0; j < 4; j++) {
        sum_lo =
            _mm256_dpbusd_epi32(sum_lo, lo[j], _mm256_loadu_si256((const __m256i *)(xq + 64 * j)));
        sum_hi = _mm256_dpbusd_epi32(sum_hi, hi[j],
                                     _mm256_loadu_si256((const __m256i *)(xq + 64 * j + 32)));
      }
      const __m256i both =
          _mm256_add_epi32(_mm256_mullo_epi32(sum_lo, s_lo), _mm256_mullo_epi32(sum_hi, s_hi));
#else
      const __m256i *xv = (const __m256i *)xq; /* lo[j] meets xv[2 j], hi[j] xv[2 j + 1] */
      __m256i sum_lo = _mm256_maddubs_epi16(lo[0], _mm256_loadu_si256(xv));
      __m256i sum_hi = _mm256_maddubs_epi16(hi[0], _mm256_loadu_si256(xv + 1));
      for (int j = 1; j < 4; j++) {
        const __m256i p_lo = _mm256_maddubs_epi16(lo[j], _mm256_loadu_si256(xv + 2 * j));
        const __m256i p_hi = _mm256_maddubs_epi16(hi[j], _mm256_loadu_si256(xv + 2 * j + 1));
        sum_lo = _mm256_add_epi16(sum_lo, p_lo);
        sum_hi = _mm256_add_epi16(sum_hi, p_hi);
      }
      const __m256i both =
          _mm256_add_epi32(_mm256_madd_epi16(sum_lo, s_lo), _mm256_madd_epi16(sum_hi, s_hi));
#endif
      k4_add_block(both, dd, mn16, x, m0 + m, blk, m, s);
    }
  }
}
#endif

/* Q6_K super-blocks of one weight row against R x rows: the integers q in 0..63 times xq, less
 * 32 times the sums of xq, each group of 16 scaled by its int8 scale. */
static inline __attribute__((always_inline)) void k6_row(const int R, const int prefetch,
                                                         const uint8_t *row,
                                                         const rounded_x *x, int64_t m0,
                                                         row_sums *s) {
  const int64_t k = x->k, blocks = k / QK_K;
  for (int64_t blk = 0; blk < blocks; blk++) {
    const uint8_t *b = row + blk * 210;
    prefetch_ahead(prefetch, b, 4);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    __m256i isum[A8_ROWS];
    for (int m = 0; m < R; m++) {
      const __m256i sums =
          _mm256_loadu_si256((const __m256i *)(x->sum16 + (m0 + m) * (k / 16) + 16 * blk));
      isum[m] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                 _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5));
    }
    for (int h = 0; h < 2; h++) {
      /* Both 128-bit lanes hold scales 8h..8h+7; run s takes 8h + 2s (values 0-15) in the low
       * lane and 8h + 2s + 1 (values 16-31) in the high one. */
      const __m256i lane_scales = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                    : _mm256_permute2x128_si256(sc16, sc16, 0x00);
      const __m256i lo0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
      const __m256i lo1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
      const __m256i q[4] = {
          _mm256_or_si256(low4(lo0), byte_bits(hb, 0, 3, 4)),
          _mm256_or_si256(low4(lo1), byte_bits(hb, 2, 3, 4)),
          _mm256_or_si256(high4(lo0), byte_bits(hb, 4, 3, 4)),
          _mm256_or_si256(high4(lo1), byte_bits(hb, 6, 3, 4)),
      };
      for (int r = 0; r < 4; r++) {
        const __m256i ctrl = _mm256_setr_epi8(
            4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r,
            4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r + 2, 4 * r + 3,
            4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3,
            4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3);
        const __m256i sv = _mm256_shuffle_epi8(lane_scales, ctrl);
        for (int m = 0; m < R; m++) {
          const int8_t *xq = x->q + (m0 + m) * k + blk * QK_K + 128 * h + 32 * r;
          const __m256i p = _mm256_maddubs_epi16(q[r], _mm256_loadu_si256((const __m256i *)xq));
          isum[m] = add_madd16(isum[m], p, sv);
        }
      }
    }
    const float d = half(b + 208);
    for (int m = 0; m < R; m++) {
      const float dx = x->dx[(m0 + m) * blocks + blk];
      s->acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_set1_ps(d * dx), s->acc[m]);
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The int32 lanes of a 512-bit sum folded to 256 bits (integers: exact). */
static inline __m256i fold_epi32(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* Q4_K super-blocks of one weight row against R x rows, 64 values a vector: a chunk's 32 bytes
 * as its low nibbles (group 2c) and high nibbles (group 2c + 1), `vpmaddubsw` with xq, and
 * `vpdpwssd` with the groups' scales spread over the lanes by `vpermd` (the same integer sums as
 * k4_k5_row's, in fewer instructions per x row). */
static inline __attribute__((always_inline)) void k4_row_vnni(const int R, const int prefetch,
                                                              const uint8_t *row,
                                                              const rounded_x *x, int64_t m0,
                                                              row_sums *s) {
  const int64_t k = x->k, blocks = k / QK_K;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i high_by_4 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512i spread[2]; /* dword lanes 0-7 take scale pair 2c (mod 4), 8-15 pair 2c + 1 */
  for (int c = 0; c < 2; c++)
    spread[c] = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
  for (int64_t blk = 0; blk < blocks; blk++) {
    const uint8_t *b = row + blk * 144, *qs = b + 16;
    prefetch_ahead(prefetch, b, 3);
    const __m256i scales_mins = _mm256_cvtepu8_epi16(k_scales16(b + 4));
    const __m128i sc16 = _mm256_castsi256_si128(scales_mins);
    const __m128i mn16 = _mm256_extracti128_si256(scales_mins, 1);
    /* each scale twice in a dword: groups 0-3, then 4-7 */
    const __m512i pairs[2] = {_mm512_castsi128_si512(_mm_unpacklo_epi16(sc16, sc16)),
                              _mm512_castsi128_si512(_mm_unpackhi_epi16(sc16, sc16))};
    __m512i w[4], sv[4];
    for (int c = 0; c < 4; c++) {
      const __m512i both =
          _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
      w[c] = _mm512_and_si512(_mm512_srlv_epi16(both, high_by_4), nibble);
      sv[c] = _mm512_permutexvar_epi32(spread[c & 1], pairs[c >> 1]);
    }
    const float d = half(b), dmin = half(b + 2);
    for (int m = 0; m < R; m++) {
      const int8_t *xq = x->q + (m0 + m) * k + blk * QK_K;
      __m512i isum = _mm512_setzero_si512();
      for (int c = 0; c < 4; c++) {
        const __m512i p = _mm512_maddubs_epi16(w[c], _mm512_loadu_si512((const void *)(xq + 64 * c)));
        isum = _mm512_dpwssd_epi32(isum, p, sv[c]);
      }
      const float dx = x->dx[(m0 + m) * blocks + blk];
      s->acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_epi32(isum)), _mm256_set1_ps(d * dx),
                                  s->acc[m]);
      const __m128i sums = _mm_loadu_si128((const __m128i *)(x->sum32 + (m0 + m) * (k / QK) + 8 * blk));
      const __m128i mins = _mm_madd_epi16(mn16, sums);
      s->off_vec[m] = _mm_fnmadd_ps(_mm_cvtepi32_ps(mins), _mm_set1_ps(dmin * dx), s->off_vec[m]);
    }
  }
}

/* Q6_K super-blocks of one weight row against R x rows, 64 values a vector: each half's 64
 * low-bit bytes give values 0-63 (low nibbles) and 64-127 (high nibbles), their 2 high bits
 * from one broadcast of the half's 32 high-bit bytes (the high 256 bits shifted 2 further), then
 * as k4_row_vnni with 16 groups of 16. */
static inline __attribute__((always_inline)) void k6_row_vnni(const int R, const int prefetch,
                                                              const uint8_t *row,
                                                              const rounded_x *x, int64_t m0,
                                                              row_sums *s) {
  const int64_t k = x->k, blocks = k / QK_K;
  const __m512i nibble = _mm512_set1_epi8(0x0f), two_bits = _mm512_set1_epi8(0x30);
  const __m512i high_by_2 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  /* vpermd indices into `pairs` (dwords 0-3: groups 0-3, 4-7: 8-11, 8-11: 4-7, 12-15: 12-15):
   * vector v's dword lane i takes group 4v + i / 4 */
  __m512i spread[4];
  for (int v = 0; v < 4; v++) {
    int32_t at[16];
    for (int i = 0; i < 16; i++) {
      const int g = 4 * v + i / 4;
      at[i] = g >= 4 && g < 8 ? g + 4 : g >= 8 && g < 12 ? g - 4 : g;
    }
    spread[v] = _mm512_loadu_si512((const void *)at);
  }
  for (int64_t blk = 0; blk < blocks; blk++) {
    const uint8_t *b = row + blk * 210;
    prefetch_ahead(prefetch, b, 4);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    const __m512i pairs = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_unpacklo_epi16(sc16, sc16)), _mm256_unpackhi_epi16(sc16, sc16),
        1);
    __m512i w[4], sv[4];
    for (int h = 0; h < 2; h++) {
      const __m512i lo = _mm512_loadu_si512((const void *)(b + 64 * h));
      const __m512i hb =
          _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
      const __m512i hb_shifted = _mm512_srlv_epi16(hb, high_by_2);
      w[2 * h] = _mm512_or_si512(_mm512_and_si512(lo, nibble),
                                 _mm512_and_si512(_mm512_slli_epi16(hb_shifted, 4), two_bits));
      w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), nibble),
                                     _mm512_and_si512(hb_shifted, two_bits));
    }
    for (int v = 0; v < 4; v++) sv[v] = _mm512_permutexvar_epi32(spread[v], pairs);
    const float d = half(b + 208);
    for (int m = 0; m < R; m++) {
      const int8_t *xq = x->q + (m0 + m) * k + blk * QK_K;
      const __m256i sums =
          _mm256_loadu_si256((const __m256i *)(x->sum16 + (m0 + m) * (k / 16) + 16 * blk));
      const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5);
      __m512i isum = _mm512_setzero_si512();
      for (int v = 0; v < 4; v++) {
        const __m512i p = _mm512_maddubs_epi16(w[v], _mm512_loadu_si512((const void *)(xq + 64 * v)));
        isum = _mm512_dpwssd_epi32(isum, p, sv[v]);
      }
      const __m256i total = _mm256_sub_epi32(fold_epi32(isum), offset);
      const float dx = x->dx[(m0 + m) * blocks + blk];
      s->acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * dx), s->acc[m]);
    }
  }
}
#endif

/* One block of 32 (group g) of one weight row against R x rows. */
static inline __attribute__((always_inline)) void b32_group(const int R, int64_t type,
                                                            const uint8_t *b, int64_t g,
                                                            const rounded_x *x, int64_t m0,
                                                            row_sums *s) {
  const int64_t k = x->k, groups = k / QK;
  float mn;
  const float d = b32_scale(type, b, &mn);
  __m256i q = b32_ints(type, b), sign = _mm256_setzero_si256();
  if (type == GGML_TYPE_Q8_0) { /* |q| times xq with q's sign */
    sign = q;
    q = _mm256_sign_epi8(sign, sign);
  }
  for (int m = 0; m < R; m++) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + (m0 + m) * k + g * QK));
    if (type == GGML_TYPE_Q8_0) xv = _mm256_sign_epi8(xv, sign);
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1));
    const int64_t i = (m0 + m) * groups + g;
    s->acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x->dx32[i]), s->acc[m]);
    s->off[m] += mn * x->dxsum32[i];
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The scales d and the offsets per unit of xq (b32_scale's mn) of eight blocks of 32 from `b`
 * (`bytes` apart), as vectors: one gather of each block's first four bytes (d, and Q4_1/Q5_1's
 * min after it). */
static inline void b32_scales8(int64_t type, const uint8_t *b, int64_t bytes, __m256 *d,
                               __m256 *mn) {
  int32_t w[8];
  for (int i = 0; i < 8; i++) memcpy(&w[i], b + i * bytes, 4);
  const __m256i words = _mm256_loadu_si256((const __m256i *)w);
  *d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
  const float times = b32_offset_in_d(type);
  if (b32_has_min(type))
    *mn = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(words, 16)));
  else
    *mn = times != 0.0f ? _mm256_mul_ps(*d, _mm256_set1_ps(times)) : _mm256_setzero_ps();
}
#endif


/* Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) of one weight row against R x rows. With VNNI,
 * eight blocks at a time: their scales as vectors, and each two blocks' 64 integers against
 * 64 xq in one vpdpbusd, whose int32 lanes 0-7 and 8-15 are the two blocks' (the same integers
 * as the AVX2 path's); Q8_0's signed values as |q| times xq with q's sign. */
static inline __attribute__((always_inline)) void b32_row(const int R, const int prefetch,
                                                          int64_t type,
                                                          const uint8_t *row, const rounded_x *x,
                                                          int64_t m0, row_sums *s) {
  const int64_t k = x->k, groups = k / QK;
  const int64_t bytes = type_block_bytes(type);
  int64_t g = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[A8_ROWS];
  __m256 off[A8_ROWS];
  for (int m = 0; m < R; m++) {
    acc[m] = _mm512_setzero_ps();
    off[m] = _mm256_setzero_ps();
  }
  for (; g + 8 <= groups; g += 8) {
    const uint8_t *b = row + g * bytes;
    prefetch_ahead(prefetch, b, 5); /* eight blocks: at most 272 bytes */
    __m256 d, mn;
    b32_scales8(type, b, bytes, &d, &mn);
    __m512i w[4];
    __mmask64 negative[4] = {0, 0, 0, 0};
    for (int p = 0; p < 4; p++) {
      w[p] = b32_pair_ints(type, b + 2 * p * bytes, bytes);
      if (type == GGML_TYPE_Q8_0) {
        negative[p] = _mm512_movepi8_mask(w[p]);
        w[p] = _mm512_abs_epi8(w[p]);
      }
    }
    for (int m = 0; m < R; m++) {
      const int64_t i = (m0 + m) * groups + g;
      const __m512 scale = _mm512_castps256_ps512(_mm256_mul_ps(d, _mm256_loadu_ps(x->dx32 + i)));
      off[m] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(x->dxsum32 + i), off[m]);
      for (int p = 0; p < 4; p++) {
        __m512i xv = _mm512_loadu_si512((const void *)(x->q + (m0 + m) * k + (g + 2 * p) * QK));
        if (type == GGML_TYPE_Q8_0)
          xv = _mm512_mask_sub_epi8(xv, negative[p], _mm512_setzero_si512(), xv);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[p], xv);
        const __m512i pick = _mm512_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p,
                                               2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                               2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, scale),
                                 acc[m]);
      }
    }
  }
  for (int m = 0; m < R; m++) {
    s->acc[m] = _mm256_add_ps(s->acc[m], _mm256_add_ps(_mm512_castps512_ps256(acc[m]),
                                                       _mm512_extractf32x8_ps(acc[m], 1)));
    s->off[m] += hsum_ps(off[m]);
  }
#endif
  for (; g < groups; g++) {
    prefetch_ahead(prefetch, row + g * bytes, 1); /* at most 34 bytes */
    b32_group(R, type, row + g * bytes, g, x, m0, s);
  }
}

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
  if (type == GGML_TYPE_Q4_K)
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
    for (int64_t m0 = 0; m0 < x->rows; m0 += K4_BLOCK_XROWS) {
      const int64_t m1 = m0 + K4_BLOCK_XROWS < x->rows ? m0 + K4_BLOCK_XROWS : x->rows;
      k4_block_products(rows, x, m0, m1, out);
      for (int64_t m = m0; m < m1; m++)
        for (int r = 0; r < K4_BLOCK_ROWS; r++)
          store(a->y, m * a->n_out + outputs[r], out[(m - m0) * K4_BLOCK_ROWS + r], a->dtype);
    }
    count = 0;
  }
  for (int r = 0; r < count; r++)
    for (int64_t m0 = 0; m0 < x->rows; m0 += A8_ROWS) {
      const int R = x->rows - m0 >= A8_ROWS ? A8_ROWS : (int)(x->rows - m0);
      row_to_y(a, R, 1, GGML_TYPE_Q4_K, rows[r], outputs[r], m0);
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
      const void *row = stacked_row(a->parts, n, k, &type);
      gguf_decode_row(type, row, k, decoded + (v - t0) * k);
    }
#endif
    for (int64_t m0 = 0; m0 < x->rows; m0 += A8_ROWS) {
      const int64_t left = x->rows - m0;
      for (int64_t v = t0; v < t1; v++) {
        const int64_t n = stream_row(v, n0, len, streams);
        if (n >= n1) continue;
        const int R = left >= A8_ROWS ? A8_ROWS : (int)left;
#if defined(__AVX2__) && defined(__FMA__)
        int64_t type;
        const uint8_t *row = stacked_row(a->parts, n, k, &type);
        if (blocks && type == GGML_TYPE_Q4_K) continue; /* k4_tile_blocks' */
        row_to_y(a, R, prefetch, type, row, n, m0);
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
