/*
 * A 16x16 transpose of 32-bit elements in AVX-512 registers: the tile GEMM's x packing
 * (gguf_amx.c) and the int8 GEMM's weight blocks (gguf_a8_gemm.c) both need it.
 */
#ifndef SGLITE_KERNELS_TRANSPOSE16_H
#define SGLITE_KERNELS_TRANSPOSE16_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* r[j] (16 lanes of 32 bits) becomes column j of the 16x16 matrix whose rows were r[0..16). */
static inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  /* u[4g + j], 128-bit lane l: column 4l + j of rows 4g..4g+3. */
  for (int j = 0; j < 4; j++) {
    const __m512i w0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
    const __m512i x0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
    r[j] = _mm512_shuffle_i32x4(w0, x0, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(w0, x0, 0xdd);
    r[8 + j] = _mm512_shuffle_i32x4(w1, x1, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(w1, x1, 0xdd);
  }
}
#endif
#endif
