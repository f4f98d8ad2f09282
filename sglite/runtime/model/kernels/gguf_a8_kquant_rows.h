/*
 * gguf_a8.c's products of one weight row against R x rows rounded to int8, for the k-quants
 * (Q4_K, Q5_K, Q6_K) on AVX2 builds, and with AVX-512 VNNI their 64-values-a-vector forms; the
 * per-row sums they add to (row_sums) and the prefetch every row kernel shares. Included by
 * gguf_a8.c alone: every function is inlined into its row_products, with R and `prefetch`
 * constants there.
 *
 * Values: a super-block's integer dots are exact (int16 pairs, int32 sums); each is scaled in
 * float as the comments say, in a fixed order, so a row's result depends on that x row alone.
 */
#ifndef SGLITE_KERNELS_GGUF_A8_KQUANT_ROWS_H
#define SGLITE_KERNELS_GGUF_A8_KQUANT_ROWS_H
#include "a8_rounding.h"
#include "gguf_bits.h"

#define QK 32
#define QK_K 256

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

/* v made in a register here (no instruction): GCC otherwise expands a chain of vector additions
 * at its last use (TER), its every product computed first and held to the end, where the
 * registers do not hold them (spilled to the stack and read back). */
#define A8_PIN(v) __asm__("" : "+v"(v))

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

#include "gguf_a8_k4_lanes.h"

/* Q6_K super-blocks of one weight row against R x rows: the integers q in 0..63 times xq, less
 * 32 times the sums of xq, each group of 16 scaled by its int8 scale. */
static inline __attribute__((always_inline)) void k6_row(const int R, const int prefetch,
                                                         const uint8_t *row,
                                                         const rounded_x *x, int64_t m0,
                                                         row_sums *s) {
  const int64_t k = x->k, blocks = k / QK_K;
  const __m256i low_bits = _mm256_set1_epi8(0x0f), two_bits = _mm256_set1_epi8(0x30);
  for (int64_t blk = 0; blk < blocks; blk++) {
    const uint8_t *b = row + blk * 210;
    prefetch_ahead(prefetch, b, 4);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    /* -32 times the scales (-4064..4096: int16) times xq's sums: the offsets' integers */
    const __m256i sc_offset = _mm256_slli_epi16(_mm256_sub_epi16(_mm256_setzero_si256(), sc16), 5);
    __m256i isum[A8_ROWS];
    for (int m = 0; m < R; m++) {
      const __m256i sums =
          _mm256_loadu_si256((const __m256i *)(x->sum16 + (m0 + m) * (k / 16) + 16 * blk));
      isum[m] = _mm256_madd_epi16(sc_offset, sums);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
      /* Both 128-bit lanes hold scales 8h..8h+7; run s takes 8h + 2s (values 0-15) in the low
       * lane and 8h + 2s + 1 (values 16-31) in the high one. */
      const __m256i lane_scales = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                    : _mm256_permute2x128_si256(sc16, sc16, 0x00);
      const __m256i lo0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
      const __m256i lo1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
      /* bits 2r, 2r + 1 of each hb byte at bits 4, 5 (what a 16-bit shift moves across bytes
       * is masked off): fewer operations than byte_bits' shift, mask and shift back */
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(lo0, low_bits),
                          _mm256_and_si256(_mm256_slli_epi16(hb, 4), two_bits)),
          _mm256_or_si256(_mm256_and_si256(lo1, low_bits),
                          _mm256_and_si256(_mm256_slli_epi16(hb, 2), two_bits)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), low_bits),
                          _mm256_and_si256(hb, two_bits)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), low_bits),
                          _mm256_and_si256(_mm256_srli_epi16(hb, 2), two_bits)),
      };
#pragma GCC unroll 4
      for (int r = 0; r < 4; r++) {
        const __m256i ctrl = _mm256_setr_epi8(
            4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r,
            4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r, 4 * r + 1, 4 * r + 2, 4 * r + 3,
            4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3,
            4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3, 4 * r + 2, 4 * r + 3);
        const __m256i sv = _mm256_shuffle_epi8(lane_scales, ctrl);
#pragma GCC unroll 8
        for (int m = 0; m < R; m++) {
          const int8_t *xq = x->q + (m0 + m) * k + blk * QK_K + 128 * h + 32 * r;
          const __m256i p = _mm256_maddubs_epi16(q[r], _mm256_loadu_si256((const __m256i *)xq));
          isum[m] = add_madd16(isum[m], p, sv);
          A8_PIN(isum[m]);
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
#endif /* __AVX2__ && __FMA__ */
#endif
