/*
 * gguf_amx.c's products: C tiles of 16 decoded bf16 weight rows by 16 packed x rows, on AMX
 * tiles (amx_product) or, without AMX, with AVX512-BF16 dot products (vector_product: a C tile
 * row is one vector, each pair of the weight row broadcast and dotted with x's packed pairs).
 * Included by gguf_amx.c alone, inside its tile-GEMM section (after its TILE / KSTEP and the
 * AMX tile configuration).
 */
#ifndef SGLITE_KERNELS_GGUF_TILE_PRODUCTS_H
#define SGLITE_KERNELS_GGUF_TILE_PRODUCTS_H

/* C tiles of weight rows w0/w1 (bf16, row stride `wstride` values) by packed x tiles x0/x1
 * over `steps` steps of KSTEP values, added to the sums in `c` (from zero when `first`) and
 * stored back there. x1 NULL (a lone last x tile): only the two tiles of x0, half the products
 * (a batch of at most 16 rows would otherwise pay for 32). */
#ifdef SGLITE_AMX
static inline void amx_product(const uint16_t *w0, const uint16_t *w1, int64_t wstride,
                                const uint16_t *x0, const uint16_t *x1, int64_t steps, float *c,
                                int first) {
  const size_t xtile = (size_t)TILE * KSTEP;
  const size_t stride = (size_t)wstride * sizeof(uint16_t);
  if (first) {
    _tile_zero(0);
    _tile_zero(2);
  } else {
    _tile_loadd(0, c, 64);
    _tile_loadd(2, c + 2 * TILE * TILE, 64);
  }
  if (x1 == NULL) {
    for (int64_t s = 0; s < steps; s++) {
      _tile_loadd(4, w0 + s * KSTEP, stride);
      _tile_loadd(5, w1 + s * KSTEP, stride);
      _tile_loadd(6, x0 + s * xtile, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
    }
    _tile_stored(0, c, 64);
    _tile_stored(2, c + 2 * TILE * TILE, 64);
    return;
  }
  if (first) {
    _tile_zero(1);
    _tile_zero(3);
  } else {
    _tile_loadd(1, c + TILE * TILE, 64);
    _tile_loadd(3, c + 3 * TILE * TILE, 64);
  }
  for (int64_t s = 0; s < steps; s++) {
    _tile_loadd(4, w0 + s * KSTEP, stride);
    _tile_loadd(5, w1 + s * KSTEP, stride);
    _tile_loadd(6, x0 + s * xtile, 64);
    _tile_loadd(7, x1 + s * xtile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + TILE * TILE, 64);
  _tile_stored(2, c + 2 * TILE * TILE, 64);
  _tile_stored(3, c + 3 * TILE * TILE, 64);
}
#endif

static inline __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* Eight weight rows (`wh`) against a tile's packed x over `steps` steps, added to C rows `ch`
 * (from zero when `first`): an accumulator per weight row, a lane per x row, each step's 16
 * pairs of the weight row broadcast against the packed x pairs. One body for both widths:
 * rows16 takes the tile's 16 x rows, rows8 its first 8 (256-bit vectors, half the work). */
#define WEIGHT_ROWS(NAME, ACC, BH, ZERO, LOAD, STORE, LOADX, SET1, DOT)                        \
  static inline void NAME(const uint16_t *wh, int64_t wstride, const uint16_t *x,             \
                          int64_t steps, float *ch, int first) {                              \
    const size_t xtile = (size_t)TILE * KSTEP;                                                \
    ACC acc[8];                                                                               \
    for (int q = 0; q < 8; q++) acc[q] = first ? ZERO() : LOAD(ch + q * TILE);                \
    for (int64_t s = 0; s < steps; s++)                                                       \
      for (int p = 0; p < KSTEP / 2; p++) {                                                   \
        const BH xv = (BH)LOADX(x + s * xtile + p * 2 * TILE);                                \
        for (int q = 0; q < 8; q++) {                                                         \
          int32_t pair;                                                                       \
          memcpy(&pair, wh + q * wstride + s * KSTEP + 2 * p, 4);                              \
          acc[q] = DOT(acc[q], (BH)SET1(pair), xv);                                           \
        }                                                                                     \
      }                                                                                       \
    for (int q = 0; q < 8; q++) STORE(ch + q * TILE, acc[q]);                                 \
  }
WEIGHT_ROWS(rows16, __m512, __m512bh, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps,
            _mm512_loadu_si512, _mm512_set1_epi32, _mm512_dpbf16_ps)
WEIGHT_ROWS(rows8, __m256, __m256bh, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps,
            load256, _mm256_set1_epi32, _mm256_dpbf16_ps)

/* One C tile as amx_product computes it, eight weight rows at a time (accumulators in
 * registers). `lanes` 8: only the tile's first 8 x rows are real (a last tile of at most 8
 * rows), by rows8; the other 8 sums are left zero. */
static inline void vector_tile(const uint16_t *w, int64_t wstride, const uint16_t *x,
                               int64_t steps, float *c, int first, int lanes) {
  for (int half = 0; half < 2; half++) {
    const uint16_t *wh = w + 8 * half * wstride;
    float *ch = c + 8 * half * TILE;
    if (lanes == TILE) {
      rows16(wh, wstride, x, steps, ch, first);
      continue;
    }
    rows8(wh, wstride, x, steps, ch, first);
    for (int q = 0; q < 8; q++) _mm256_storeu_ps(ch + q * TILE + 8, _mm256_setzero_ps());
  }
}

/* amx_product's four C tiles (two without x1) by vector_tile; `last_lanes`: vector_tile's
 * lanes for the pair's last x tile (x1, or x0 without it). */
static inline void vector_product(const uint16_t *w0, const uint16_t *w1, int64_t wstride,
                                  const uint16_t *x0, const uint16_t *x1, int64_t steps, float *c,
                                  int first, int last_lanes) {
  const int64_t t = TILE * TILE;
  const int lanes0 = x1 == NULL ? last_lanes : TILE;
  vector_tile(w0, wstride, x0, steps, c, first, lanes0);
  vector_tile(w1, wstride, x0, steps, c + 2 * t, first, lanes0);
  if (x1 == NULL) return;
  vector_tile(w0, wstride, x1, steps, c + t, first, last_lanes);
  vector_tile(w1, wstride, x1, steps, c + 3 * t, first, last_lanes);
}

/* The C tiles of w0/w1 by x0/x1 (see amx_product), on AMX tiles when `tiles`; else by
 * vector_product (`last_lanes`: 8 when the pair's last x tile holds at most 8 rows, else 16). */
static inline void tile_product(int tiles, const uint16_t *w0, const uint16_t *w1,
                                int64_t wstride, const uint16_t *x0, const uint16_t *x1,
                                int64_t steps, float *c, int first, int last_lanes) {
#ifdef SGLITE_AMX
  if (tiles) {
    amx_product(w0, w1, wstride, x0, x1, steps, c, first);
    return;
  }
#endif
  (void)tiles;
  vector_product(w0, w1, wstride, x0, x1, steps, c, first, last_lanes);
}

#endif
