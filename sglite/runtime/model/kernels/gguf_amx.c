/*
 * y [rows, n_out] = x W^T for a GGUF weight with bfloat16 products summed in float32, for
 * bfloat16 x and batches of many rows (prefill, large decode batches, a speculative draft's
 * verification), where decoding the weight once per call costs less than the products it feeds:
 * on AMX tiles (Intel's matrix units) where the CPU has them, else with AVX512-BF16 dot products
 * (`vdpbf16ps`, e.g. AMD Zen 4), the same decoded blocks and the same C tiles.
 *
 * Why not the scratch and PyTorch's GEMM: that decodes the whole weight to memory and oneDNN
 * then reorders it into its own tile layout, two passes over a dense copy per call. Here a thread
 * decodes a block of weight rows into a buffer that stays in its L2 cache, in the layout a tile
 * loads directly, and multiplies it with every x row before moving on.
 *
 * Layout: the weight rows are the tiles' A operand (16 rows x 32 values, row-major, as decoded);
 * x is the B operand, packed once per call into AMX's pair layout (for each 16 x rows and 32
 * values, 16 rows of pairs: pair p of x row j at [p][j]), which is a 16x16 transpose of 32-bit
 * pairs. A C tile then holds y transposed (weight rows by x rows) and is transposed back on store.
 * Without AMX, a C tile row (one weight row against the 16 x rows) is one vector: each pair of
 * the weight row broadcast and dotted with the packed pairs of x.
 *
 * Values: the weight's values as gguf_blocks.c decodes them (computed here the same way,
 * straight to bf16, for every type but Q5_K; tested bit for bit), rounded to bfloat16 as the
 * scratch path rounds them; each output sums its k products in a fixed order whatever the row
 * count or the row's place in the batch, so a row's result depends on that row alone.
 */
#include "gguf_bits.h"
#include "gguf_quads.h"
#include "transpose16.h"

#ifdef SGLITE_TILE_GEMM
/* Weight rows one C tile covers, x rows one C tile covers, values one tile step takes. */
#define TILE 16
#define KSTEP 32
/* Bytes of decoded weight a thread keeps per block (in its L2 with the x panel it meets). */
#define BLOCK_BYTES (512 * 1024)
/* Values of k one pass decodes and multiplies (a multiple of every block type's values). */
#define CHUNK 2048
/* How far ahead of the super-block being decoded its row's bytes are prefetched: decoding is
 * slower than the memory, and without this each block's loads wait on memory in turn. */
#define DECODE_PREFETCH_BYTES 4096

#ifdef SGLITE_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config_t;

/* 0 not asked yet, 1 granted, -1 refused (the products then take the vector path). Racing
 * first callers all ask; the kernel grants the same answer to each. */
static int amx_permission = 0;

/* SGLITE_AMX=0 in the environment keeps the tiles off (the vector path, as on CPUs without). */
static int amx_enabled(void) {
  if (amx_permission == 0) {
    const char *setting = getenv("SGLITE_AMX");
    const int off = setting != NULL && strcmp(setting, "0") == 0;
    amx_permission =
        !off && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
  }
  return amx_permission == 1;
}
#else
static int amx_enabled(void) { return 0; }
#endif

#ifdef SGLITE_AMX
/* Tiles 0-3 accumulate C (2 weight-row tiles x 2 x-row tiles), 4-5 hold A, 6-7 hold B. */
static void load_tile_config(void) {
  tile_config_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; t++) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = TILE;
  }
  _tile_loadconfig(&cfg);
}
#endif

typedef struct {
  const uint16_t *x; /* bf16 [rows, k] */
  uint16_t *packed;  /* [x_tiles][k / KSTEP][TILE pairs][TILE rows][2] */
  int64_t rows, k;
} pack_args;

/* x rows of tiles [t0, t1) into the pair layout; rows past the last are zeros. */
static void pack_x_tiles(void *p, int64_t t0, int64_t t1) {
  const pack_args *a = p;
  const int64_t steps = a->k / KSTEP;
  for (int64_t t = t0; t < t1; t++) {
    for (int64_t s = 0; s < steps; s++) {
      __m512i r[16];
      for (int j = 0; j < TILE; j++) {
        const int64_t row = t * TILE + j;
        r[j] = row < a->rows ? _mm512_loadu_si512(a->x + row * a->k + s * KSTEP)
                             : _mm512_setzero_si512();
      }
      transpose16(r);
      uint16_t *dst = a->packed + (t * steps + s) * TILE * KSTEP;
      for (int q = 0; q < 16; q++) _mm512_storeu_si512(dst + q * KSTEP, r[q]);
    }
  }
}

typedef struct {
  const gguf_part_t *parts;
  const uint16_t *packed;
  void *y; /* bf16 [rows, n_out] */
  int64_t rows, n_out, k, block_rows, chunk;
  int failed; /* set by a thread whose buffers could not grow (its blocks left unwritten) */
  int act;    /* -1: y = x W^T; else ACT_*: y [rows, n_out / 2] = act(gate) * up (W = [gate; up]) */
} gemm_args;

/* A thread's buffers, grown to the largest call: a decoded row span, the decoded weight block
 * (block_rows x chunk bf16) and the float32 sums of its C tiles between k chunks. */
static __thread float *span_buf = NULL, *sums_buf = NULL;
static __thread uint16_t *block_buf = NULL;
static __thread int64_t span_cap = 0, block_cap = 0, sums_cap = 0;

static int grow(void **buf, int64_t *cap, int64_t bytes) {
  if (*cap >= bytes) return 0;
  free(*buf);
  *buf = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
  *cap = *buf ? bytes : 0;
  return *buf ? 0 : -1;
}

#include "gguf_bf16_decode.h"

/* Values [v0, v0 + count) of the weight's rows [n0, n0 + rows) as bf16 into `out` (row-major,
 * count per row); rows from `end` on are zeros. */
static void decode_block_span(const gemm_args *a, int64_t n0, int64_t rows, int64_t end,
                              int64_t v0, int64_t count, uint16_t *out) {
  for (int64_t i = 0; i < rows; i++) {
    uint16_t *dst = out + i * count;
    if (n0 + i >= end) {
      memset(dst, 0, count * sizeof *dst);
      continue;
    }
    int64_t type;
    const void *row = gguf_part_row(a->parts, n0 + i, a->k, &type);
    decode_span_bf16(type, row, v0, count, dst);
  }
}

/* Four C tiles (2 weight tiles from n0 by 2 x tiles from m0) transposed into y, from `c`. */
static void store_y(const gemm_args *a, const float *c, int64_t n0, int64_t m0) {
  uint16_t *y = a->y;
  for (int ti = 0; ti < 4; ti++) { /* tile (weight half wi, x half xi) */
    const int wi = ti >> 1, xi = ti & 1;
    const int64_t n = n0 + wi * TILE, m = m0 + xi * TILE;
    if (n >= a->n_out || m >= a->rows) continue;
    __m512i r[16];
    for (int q = 0; q < 16; q++) r[q] = _mm512_loadu_si512(c + ti * TILE * TILE + q * TILE);
    transpose16(r);
    const int64_t cols = a->n_out - n < TILE ? a->n_out - n : TILE;
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    for (int j = 0; j < TILE && m + j < a->rows; j++)
      _mm256_mask_storeu_epi16(y + (m + j) * a->n_out + n, mask,
                               to_bf16x16(_mm512_castsi512_ps(r[j])));
  }
}

/* The gated product of C tiles 0/1 (gate rows n.. by x tiles from m) and 2/3 (the up rows of
 * the same columns) into y [rows, n_out / 2]: gate and up rounded to bf16 and act(gate) * up
 * computed by act_mul's vgated (common.h), so the result equals the unfused product's,
 * bit for bit. */
static void store_y_glu(const gemm_args *a, const float *c, int64_t n, int64_t m) {
  uint16_t *y = a->y;
  const int64_t width = a->n_out / 2;
  if (n >= width) return;
  const int gelu = a->act == ACT_GELU_TANH;
  const int64_t cols = width - n < TILE ? width - n : TILE;
  const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
  for (int xi = 0; xi < 2; xi++) {
    const int64_t mx = m + xi * TILE;
    if (mx >= a->rows) continue;
    __m512i r[16];
    for (int q = 0; q < 16; q++) {
      const __m512 g = vround_to(_mm512_loadu_ps(c + xi * TILE * TILE + q * TILE), 1);
      const __m512 u = vround_to(_mm512_loadu_ps(c + (2 + xi) * TILE * TILE + q * TILE), 1);
      r[q] = _mm512_castps_si512(vgated(g, u, gelu));
    }
    transpose16(r);
    for (int j = 0; j < TILE && mx + j < a->rows; j++)
      _mm256_mask_storeu_epi16(y + (mx + j) * width + n, mask,
                               to_bf16x16(_mm512_castsi512_ps(r[j])));
  }
}

#include "gguf_tile_products.h"

/* vector_tile's lanes for x tile pair xp's last tile: 8 when it is the batch's last tile and
 * holds at most 8 rows. */
static inline int last_lanes(const gemm_args *a, int64_t xp, const uint16_t *x1) {
  const int64_t last = 2 * xp + (x1 != NULL), rows = a->rows - last * TILE;
  return rows <= 8 ? 8 : TILE;
}

/* Weight blocks [b0, b1) of `block_rows` decoded rows. Per block and chunk of k: decode the
 * chunk, then multiply it with every x tile pair, two weight tiles at a time, carrying the sums
 * across chunks in sums_buf (the chunk keeps the decoded block and an x panel in L2). Gated
 * (act >= 0): a block is `block_rows / 2` gate rows and the up rows of the same columns, and
 * each tile pair is a gate tile and its up tile. */
static void gemm_blocks(void *p, int64_t b0, int64_t b1) {
  gemm_args *a = p;
  const int64_t k = a->k, steps = k / KSTEP, xtiles = (a->rows + TILE - 1) / TILE;
  const int64_t pairs = (xtiles + 1) / 2, wpairs = a->block_rows / (2 * TILE);
  const int64_t quad = 4 * TILE * TILE; /* floats of one pair-by-pair product */
  const int64_t slots = a->chunk == k ? 1 : pairs * wpairs; /* sums kept across chunks */
  const int glu = a->act >= 0;
  const int64_t half = a->block_rows / 2, width = a->n_out / 2;
  if (grow((void **)&span_buf, &span_cap, a->chunk * (int64_t)sizeof(float)) ||
      grow((void **)&block_buf, &block_cap, a->block_rows * a->chunk * (int64_t)sizeof(uint16_t)) ||
      grow((void **)&sums_buf, &sums_cap, slots * quad * (int64_t)sizeof(float)))
  {
    __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED); /* the call reports -1: another path */
    return;
  }
  const int tiles = amx_enabled();
#ifdef SGLITE_AMX
  if (tiles) load_tile_config();
#endif
  const size_t xtile = (size_t)TILE * KSTEP; /* uint16 per packed tile */
  for (int64_t b = b0; b < b1; b++) {
    const int64_t n_base = b * (glu ? half : a->block_rows);
    for (int64_t v0 = 0; v0 < k; v0 += a->chunk) {
      const int64_t count = k - v0 < a->chunk ? k - v0 : a->chunk;
      const int64_t s0 = v0 / KSTEP, ns = count / KSTEP;
      if (glu) {
        decode_block_span(a, n_base, half, width, v0, count, block_buf);
        decode_block_span(a, width + n_base, half, a->n_out, v0, count, block_buf + half * count);
      } else {
        decode_block_span(a, n_base, a->block_rows, a->n_out, v0, count, block_buf);
      }
      for (int64_t xp = 0; xp < pairs; xp++) {
        const uint16_t *x0 = a->packed + (2 * xp * steps + s0) * xtile;
        const uint16_t *x1 = 2 * xp + 1 < xtiles ? x0 + steps * xtile : NULL; /* lone last */
        for (int64_t wp = 0; wp < wpairs; wp++) {
          const uint16_t *w0 = block_buf + (glu ? wp : 2 * wp) * TILE * count;
          const uint16_t *w1 = glu ? w0 + half * count : w0 + TILE * count;
          float *c = sums_buf + (slots == 1 ? 0 : (xp * wpairs + wp) * quad);
          tile_product(tiles, w0, w1, count, x0, x1, ns, c, v0 == 0, last_lanes(a, xp, x1));
          if (v0 + count < k) continue;
          if (glu)
            store_y_glu(a, c, n_base + wp * TILE, 2 * xp * TILE);
          else
            store_y(a, c, n_base + 2 * wp * TILE, 2 * xp * TILE);
        }
      }
    }
  }
#ifdef SGLITE_AMX
  if (tiles) _tile_release();
#endif
}

/* gguf_gemm_amx, or with act >= 0 its gated form (see gemm_args). */
static int gemm_amx(int dtype, int act, const void *x, const gguf_part_t *parts, void *y,
                    int64_t rows, int64_t n_out, int64_t k, int threads) {
  if (dtype != DTYPE_BFLOAT16 || k % KSTEP || rows <= 0) return -1;
  if (act >= 0 && n_out % (2 * TILE)) return -1; /* whole gate tiles, up tiles alike */
  if (!gguf_parts_valid(parts, n_out, k) || gguf_has_quads(parts, n_out)) return -1;
  const int64_t xtiles = (rows + TILE - 1) / TILE;
  uint16_t *packed = aligned_alloc(64, (size_t)(xtiles * TILE * k) * sizeof(uint16_t));
  if (packed == NULL) return -1;
  pack_args pa = {x, packed, rows, k};
  parallel_range(pack_x_tiles, &pa, xtiles, 1, threads, xtiles * k >= PARALLEL_MIN_ELEMS);
  /* k in chunks of at most CHUNK values (whole blocks of every part's type), weight rows per
   * block a multiple of two tiles, as many as BLOCK_BYTES hold (to 256). */
  const int64_t chunk = k <= CHUNK ? k : CHUNK;
  int64_t block_rows = BLOCK_BYTES / (chunk * (int64_t)sizeof(uint16_t)) / (2 * TILE) * (2 * TILE);
  block_rows = block_rows < 2 * TILE ? 2 * TILE : block_rows > 256 ? 256 : block_rows;
  const int64_t per_thread = (n_out + threads - 1) / (threads > 0 ? threads : 1);
  while (block_rows > 2 * TILE && block_rows > per_thread) block_rows -= 2 * TILE;
  gemm_args ga = {parts, packed, y, rows, n_out, k, block_rows, chunk, 0, act};
  /* A gated block covers block_rows / 2 output columns (gate and up rows for each). */
  const int64_t covered = act >= 0 ? block_rows / 2 : block_rows;
  const int64_t blocks = ((act >= 0 ? n_out / 2 : n_out) + covered - 1) / covered;
  parallel_range(gemm_blocks, &ga, blocks, 1, threads, 1);
  free(packed);
  return ga.failed ? -1 : 0;
}

int gguf_gemm_amx(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                  int64_t n_out, int64_t k, int threads) {
  return gemm_amx(dtype, -1, x, parts, y, rows, n_out, k, threads);
}

int gguf_gemm_amx_glu(int dtype, int act, const void *x, const gguf_part_t *parts, void *y,
                      int64_t rows, int64_t n_out, int64_t k, int threads) {
  if (act != ACT_SILU && act != ACT_GELU_TANH) return -1;
  return gemm_amx(dtype, act, x, parts, y, rows, n_out, k, threads);
}

int64_t amx_gemm_available(void) { return amx_enabled(); }
int64_t tile_gemm_available(void) { return 1; }

#else
int gguf_gemm_amx(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                  int64_t n_out, int64_t k, int threads) {
  (void)dtype, (void)x, (void)parts, (void)y, (void)rows, (void)n_out, (void)k, (void)threads;
  return -1;
}

int gguf_gemm_amx_glu(int dtype, int act, const void *x, const gguf_part_t *parts, void *y,
                      int64_t rows, int64_t n_out, int64_t k, int threads) {
  (void)dtype, (void)act, (void)x, (void)parts, (void)y, (void)rows, (void)n_out, (void)k;
  (void)threads;
  return -1;
}

int64_t amx_gemm_available(void) { return 0; }
int64_t tile_gemm_available(void) { return 0; }
#endif

int64_t gguf_amx_min_rows(const gguf_part_t *parts, int64_t n_out, int64_t k) {
  if (gguf_has_quads(parts, n_out)) return KERNEL_OFF_ROWS; /* gemm_amx declines them */
  const int q6k = q6k_mostly(parts, n_out);
  if (amx_gemm_available()) return q6k ? AMX_MIN_ROWS_Q6_K : AMX_MIN_ROWS;
  if (!tile_gemm_available() || !bf16_dot_pays()) return KERNEL_OFF_ROWS;
  if (!q6k) return BF16_DOT_MIN_ROWS;
  return k <= SHORT_ROW_VALUES ? BF16_DOT_MIN_ROWS_Q6_K_SHORT : BF16_DOT_MIN_ROWS_Q6_K;
}
