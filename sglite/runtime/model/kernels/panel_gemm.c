/*
 * Dense float32 products, any batch size: y[M, N] = x[M, K] W^T (+ bias), with W packed once
 * into panels of PANEL output columns: panels[ceil(N / PANEL)][K][PANEL] (the last panel
 * zero-padded). A thread takes whole panels; for each it runs every row tile of x against it,
 * so each weight byte comes from memory once per call and the later tiles find the panel in
 * the cache. A panel is one contiguous stream of K * 64 bytes, which the hardware prefetcher
 * follows; the first tile also requests the next panel, a panel's compute ahead.
 *
 * Why not oneDNN's packed float32 GEMM: with the weights streamed from memory (a model's layers
 * do not fit in the cache) it reads them well below the memory's speed at small batches, and at
 * larger ones its tiles wait on weights not yet in the cache. Here each panel is one contiguous
 * stream, read once per call, that the prefetcher keeps ahead of the compute.
 */
#include "common.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PANEL_SIMD 1
#endif

#define PANEL 16
/* Rows per tile: 2 accumulators per row, 12 in all, enough independent FMA chains to cover the
 * FMA latency, with registers left for the two weight vectors and a broadcast. */
#define TILE_ROWS 6
/* Panels per parallel chunk. */
#define PANELS_PER_CHUNK 2

typedef struct {
  const float *x, *panels, *bias;
  float *y;
  int64_t rows, n_out, k;
} panel_args;

/* out[r, 0:cols] (row stride ldy) = x[r] . panel (+ bias) for R rows of x starting at `x`. */
static inline __attribute__((always_inline)) void panel_tile(const int R, const float *x,
                                                             int64_t k, const float *panel,
                                                             const float *next, float *out,
                                                             int64_t ldy, int64_t cols,
                                                             const float *bias) {
  float tmp[TILE_ROWS][PANEL];
#ifdef PANEL_SIMD
  /* Named accumulators: with an array GCC spilled all twelve to the stack every step. */
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  const float *ahead = next != NULL ? next : panel; /* re-requesting cached lines costs little */
  for (int64_t i = 0; i < k; i++) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * PANEL);
    const __m256 w1 = _mm256_loadu_ps(panel + i * PANEL + 8);
    __builtin_prefetch(ahead + i * PANEL, 0, 3);
#define PANEL_ROW(r, lo, hi)                               \
  if (R > r) {                                             \
    const __m256 xv = _mm256_broadcast_ss(x + r * k + i);  \
    lo = _mm256_fmadd_ps(w0, xv, lo);                      \
    hi = _mm256_fmadd_ps(w1, xv, hi);                      \
  }
    PANEL_ROW(0, a0, a1)
    PANEL_ROW(1, a2, a3)
    PANEL_ROW(2, a4, a5)
    PANEL_ROW(3, a6, a7)
    PANEL_ROW(4, a8, a9)
    PANEL_ROW(5, a10, a11)
#undef PANEL_ROW
  }
  const __m256 sums[TILE_ROWS][2] = {{a0, a1}, {a2, a3}, {a4, a5}, {a6, a7}, {a8, a9}, {a10, a11}};
  for (int r = 0; r < R; r++) {
    _mm256_storeu_ps(tmp[r], sums[r][0]);
    _mm256_storeu_ps(tmp[r] + 8, sums[r][1]);
  }
#else
  (void)next;
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < PANEL; j++) tmp[r][j] = 0.0f;
    for (int64_t i = 0; i < k; i++)
      for (int j = 0; j < PANEL; j++) tmp[r][j] += x[r * k + i] * panel[i * PANEL + j];
  }
#endif
  for (int r = 0; r < R; r++)
    for (int64_t j = 0; j < cols; j++) out[r * ldy + j] = tmp[r][j] + (bias ? bias[j] : 0.0f);
}

#define PANEL_TILE_SPECIAL(R)                                                                 \
  static void panel_tile##R(const float *x, int64_t k, const float *panel, const float *next, \
                            float *out, int64_t ldy, int64_t cols, const float *bias) {       \
    panel_tile(R, x, k, panel, next, out, ldy, cols, bias);                                   \
  }
PANEL_TILE_SPECIAL(1)
PANEL_TILE_SPECIAL(2)
PANEL_TILE_SPECIAL(3)
PANEL_TILE_SPECIAL(4)
PANEL_TILE_SPECIAL(5)
PANEL_TILE_SPECIAL(6)
typedef void (*panel_tile_fn)(const float *, int64_t, const float *, const float *, float *,
                              int64_t, int64_t, const float *);
static const panel_tile_fn tile_by_rows[TILE_ROWS] = {panel_tile1, panel_tile2, panel_tile3,
                                                      panel_tile4, panel_tile5, panel_tile6};

/* y[r, 0:cols] (row stride ldy) = x[r] . panel (+ bias) for all `rows` rows of x; `next` (or
 * NULL) is the panel to request into the cache meanwhile. */
void panel_rows(const float *x, int64_t rows, int64_t k, const float *panel, const float *next,
                float *y, int64_t ldy, int64_t cols, const float *bias) {
  /* Tiles of near-equal size (32 rows: 6, 6, 5, 5, 5, 5): a small last tile would leave too
   * few FMA chains to hide their latency. */
  const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
  for (int64_t t = 0, r0 = 0; t < tiles; t++) {
    const int64_t n = (rows - r0) / (tiles - t) + ((rows - r0) % (tiles - t) != 0);
    tile_by_rows[n - 1](x + r0 * k, k, panel, r0 == 0 ? next : NULL, y + r0 * ldy, ldy, cols,
                        bias);
    r0 += n;
  }
}

static void panel_range(void *p, int64_t p0, int64_t p1) {
  const panel_args *a = p;
  const int64_t k = a->k, n_panels = (a->n_out + PANEL - 1) / PANEL;
  for (int64_t q = p0; q < p1; q++) {
    const float *panel = a->panels + q * k * PANEL;
    const float *next = q + 1 < n_panels ? panel + k * PANEL : NULL;
    const int64_t col = q * PANEL;
    const int64_t cols = a->n_out - col < PANEL ? a->n_out - col : PANEL;
    panel_rows(a->x, a->rows, k, panel, next, a->y + col, a->n_out, cols,
               a->bias ? a->bias + col : NULL);
  }
}

/* y [rows, n_out] = x [rows, k] W^T + bias (bias may be NULL), W as panels (see the top). */
void panel_gemm(const float *x, const float *panels, const float *bias, float *y, int64_t rows,
                int64_t n_out, int64_t k, int threads) {
  panel_args a = {x, panels, bias, y, rows, n_out, k};
  const int64_t n_panels = (n_out + PANEL - 1) / PANEL;
  parallel_range(panel_range, &a, n_panels, PANELS_PER_CHUNK, threads,
                 rows * n_out * k >= 65536);
}

int64_t panel_width(void) { return PANEL; }
