/* Tiling a weight's rows for gguf_a8_gemm.c, and reading a tiled row back (the layouts:
 * gguf_tiles.h). */
#include "gguf_tiles.h"
#include "threadpool.h"

/* A run of 4-byte words of each row's block stored as word vectors (gguf_tiles.h). */
typedef struct {
  int64_t from;  /* byte offset in a row's block */
  int64_t at;    /* byte offset of its first vector in the tiled block */
  int64_t words; /* vectors (4-byte words per row) */
} word_segment;

/* How a block type other than Q5_0 is tiled: its block's values and bytes, where its f16 d
 * lies in a row's block (the 16 rows' d first in the tiled block; -1: none apart), its word
 * segments. */
typedef struct {
  int64_t values, bytes, d_at, segments;
  word_segment segment[3];
} word_tiling;

/* Q4_K: d, dmin and the 12 scale bytes (4 words), then the 128 nibble bytes (32). Q6_K: after
 * the 16 rows' d (bytes 0-31), the 16 int8 scales (4 words), ql (128 bytes: 32 words) and qh
 * (64 bytes: 16). Q8_0: after the rows' d, the 32 values (8 words). */
static const word_tiling Q4_K_TILING = {256, 144, -1, 2, {{0, 0, 4}, {16, 256, 32}}};
static const word_tiling Q6_K_TILING = {256, 210, 208, 3,
                                        {{192, 32, 4}, {0, 288, 32}, {128, 2336, 16}}};
static const word_tiling Q8_0_TILING = {32, 34, 0, 1, {{2, 32, 8}}};

static const word_tiling *word_tiling_of(int64_t type) {
  switch (type) {
    case GGML_TYPE_Q4_K:
      return &Q4_K_TILING;
    case GGML_TYPE_Q6_K:
      return &Q6_K_TILING;
    case GGML_TYPE_Q8_0:
      return &Q8_0_TILING;
    default:
      return NULL;
  }
}

/* Tile t (rows 16t..16t+15) of Q5_0 rows of k values. */
static void tile_q5_0(const uint8_t *in, uint8_t *out, int64_t t, int64_t k) {
  const int64_t blocks = k / 32, row_bytes = blocks * 22;
  for (int64_t j = 0; j < blocks; j++) {
    uint8_t *tile_block = out + (t * blocks + j) * TILED_Q5_0_BLOCK_BYTES;
    uint64_t masks[8] = {0};
    for (int64_t r = 0; r < TILE_WROWS; r++) {
      const uint8_t *b = in + (t * TILE_WROWS + r) * row_bytes + j * 22;
      uint32_t qh;
      memcpy(&qh, b + 2, 4);
      memcpy(tile_block + 2 * r, b, 2);
      for (int g = 0; g < 8; g++) masks[g] |= (uint64_t)((qh >> (4 * g)) & 0xf) << (4 * r);
      for (int c = 0; c < 4; c++) memcpy(tile_block + 96 + 64 * c + 4 * r, b + 6 + 4 * c, 4);
    }
    memcpy(tile_block + 32, masks, sizeof(masks));
  }
}

/* Row r of a tile's block (`row`: its bytes in the file's layout) into the tiled block `tiled`,
 * or back (to_tile = 0). */
static void block_words(const word_tiling *wt, uint8_t *row, uint8_t *tiled, int64_t r,
                      int to_tile) {
  for (int64_t s = 0; s < wt->segments; s++) {
    const word_segment *seg = &wt->segment[s];
    for (int64_t i = 0; i < seg->words; i++) {
      uint8_t *word = tiled + seg->at + 64 * i + 4 * r, *own = row + seg->from + 4 * i;
      memcpy(to_tile ? word : own, to_tile ? own : word, 4);
    }
  }
  if (wt->d_at >= 0) {
    uint8_t *d = tiled + 2 * r, *own = row + wt->d_at;
    memcpy(to_tile ? d : own, to_tile ? own : d, 2);
  }
}

/* What gguf_tile's threads share. */
typedef struct {
  int64_t type, k;
  const word_tiling *wt; /* NULL for Q5_0 */
  const uint8_t *src;
  uint8_t *dst;
} tile_job;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && \
    defined(__AVX2__) && defined(__FMA__)
#include "gguf_a8_gemm_decode.h"

/* Tile t of Q4_K rows through the 512-bit transposes the VNNI GEMM decodes the file's rows
 * with (row_words4, row_words: the same word vectors the tile holds), each stored whole: a
 * tenth of the word-by-word copy's time. */
static void tile_q4k_vectors(const tile_job *job, int64_t t) {
  const int64_t blocks = job->k / QK_K, row_bytes = blocks * 144;
  const uint8_t *rows[WROWS];
  for (int r = 0; r < WROWS; r++) rows[r] = job->src + (t * WROWS + r) * row_bytes;
  for (int64_t b = 0; b < blocks; b++) {
    uint8_t *tiled = job->dst + (t * blocks + b) * TILED_Q4_K_SB_BYTES;
    __m512i head[4], p[32];
    row_words4(rows, b * 144, head);
    row_words(rows, b * 144 + 16, 2, p);
    for (int j = 0; j < 4; j++) _mm512_storeu_si512((void *)(tiled + 64 * j), head[j]);
    for (int i = 0; i < 32; i++) _mm512_storeu_si512((void *)(tiled + 256 + 64 * i), p[i]);
  }
}
#define TILE_Q4K_VECTORS 1
#endif

/* Tile t of the job's rows (a parallel_chunks chunk). */
static void tile_one(void *ctx, int64_t t) {
  const tile_job *job = ctx;
  if (job->wt == NULL) {
    tile_q5_0(job->src, job->dst, t, job->k);
    return;
  }
#ifdef TILE_Q4K_VECTORS
  if (job->type == GGML_TYPE_Q4_K) {
    tile_q4k_vectors(job, t);
    return;
  }
#endif
  const word_tiling *wt = job->wt;
  const int64_t blocks = job->k / wt->values, row_bytes = blocks * wt->bytes;
  for (int64_t b = 0; b < blocks; b++) {
    uint8_t *tiled = job->dst + (t * blocks + b) * TILE_WROWS * wt->bytes;
    for (int64_t r = 0; r < TILE_WROWS; r++) {
      uint8_t *row = (uint8_t *)job->src + (t * TILE_WROWS + r) * row_bytes + b * wt->bytes;
      block_words(wt, row, tiled, r, 1);
    }
  }
}

int gguf_tile(int64_t type, const void *src, void *dst, int64_t rows, int64_t k, int threads) {
  const word_tiling *wt = word_tiling_of(type);
  const int64_t values = type == GGML_TYPE_Q5_0 ? 32 : wt != NULL ? wt->values : 0;
  if (values == 0 || rows < 1 || rows % TILE_WROWS || k < values || k % values) return -1;
  tile_job job = {type, k, wt, src, dst};
  parallel_chunks(tile_one, &job, rows / TILE_WROWS, threads);
  return 0;
}

void gguf_untile_row(int64_t type, const void *data, int64_t n, int64_t k, uint8_t *out) {
  const int64_t stored = untiled_type(type), t = n / TILE_WROWS, r = n % TILE_WROWS;
  if (stored == GGML_TYPE_Q5_0) {
    const int64_t blocks = k / 32;
    for (int64_t j = 0; j < blocks; j++) {
      const uint8_t *tile_block =
          (const uint8_t *)data + (t * blocks + j) * TILED_Q5_0_BLOCK_BYTES;
      uint8_t *b = out + j * 22;
      uint64_t masks[8];
      memcpy(masks, tile_block + 32, sizeof(masks));
      uint32_t qh = 0;
      for (int g = 0; g < 8; g++) qh |= (uint32_t)((masks[g] >> (4 * r)) & 0xf) << (4 * g);
      memcpy(b, tile_block + 2 * r, 2);
      memcpy(b + 2, &qh, 4);
      for (int c = 0; c < 4; c++) memcpy(b + 6 + 4 * c, tile_block + 96 + 64 * c + 4 * r, 4);
    }
    return;
  }
  const word_tiling *wt = word_tiling_of(stored);
  const int64_t blocks = k / wt->values;
  for (int64_t b = 0; b < blocks; b++) {
    /* read only: block_words copies from `tiled` when untiling */
    uint8_t *tiled = (uint8_t *)data + (t * blocks + b) * TILE_WROWS * wt->bytes;
    block_words(wt, out + b * wt->bytes, tiled, r, 0);
  }
}

void untiled_parts(const gguf_part_t *parts, int64_t n_out,
                   gguf_part_t as_stored[GGUF_MAX_PARTS]) {
  int64_t covered = 0;
  for (int64_t i = 0; i < GGUF_MAX_PARTS; i++) {
    as_stored[i] = (gguf_part_t){0};
    if (covered >= n_out) continue; /* past the weight's parts: never read */
    as_stored[i] = parts[i];
    as_stored[i].type = untiled_type(parts[i].type);
    covered += parts[i].rows > 0 ? parts[i].rows : n_out; /* gguf_parts_valid refuses it */
  }
}
