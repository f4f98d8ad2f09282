/* Tiling a Q5_0 weight's rows for gguf_a8_gemm.c (the layout: gguf_tiles.h). */
#include "gguf_tiles.h"

int gguf_tile_q5_0(const void *src, void *dst, int64_t rows, int64_t k) {
  if (rows < 1 || rows % TILE_WROWS || k < 32 || k % 32) return -1;
  const int64_t blocks = k / 32, row_bytes = blocks * 22;
  const uint8_t *in = src;
  uint8_t *out = dst;
  for (int64_t t = 0; t < rows / TILE_WROWS; t++)
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
  return 0;
}
