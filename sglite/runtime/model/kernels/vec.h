/*
 * The kernels' one vector type, picked at compile time: `vec_t` of VEC float lanes over AVX-512
 * (16), AVX2 + FMA (8), NEON on aarch64 (4), or one plain float, with the same operations on
 * each (load / store in the storage dtype, FMA, sums and maxima over lanes, bf16 rounding,
 * fast_expf). Included by common.h alone, after its scalar helpers (load, store, round_to,
 * fast_expf's constants), which the vector forms mirror.
 */
#ifndef SGLITE_KERNELS_VEC_H
#define SGLITE_KERNELS_VEC_H

#ifdef __AVX512F__
#include <immintrin.h>
#define VEC 16
typedef __m512 vec_t;
static inline vec_t vload(const void *p, int64_t i, int dtype) {
  if (dtype) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps((const float *)p + i);
}
static inline vec_t vzero(void) { return _mm512_setzero_ps(); }
static inline vec_t vset(float x) { return _mm512_set1_ps(x); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec_t vmul(vec_t a, vec_t b) { return _mm512_mul_ps(a, b); }
static inline vec_t vadd(vec_t a, vec_t b) { return _mm512_add_ps(a, b); }
static inline vec_t vsub(vec_t a, vec_t b) { return _mm512_sub_ps(a, b); }
static inline vec_t vdiv(vec_t a, vec_t b) { return _mm512_div_ps(a, b); }
static inline vec_t vfmsub(vec_t a, vec_t b, vec_t c) { return _mm512_fmsub_ps(a, b, c); }
static inline float vsum(vec_t a) { return _mm512_reduce_add_ps(a); }
/* Lanewise `a > b ? a : b` (b where a is NaN); the largest lane. */
static inline vec_t vmax(vec_t a, vec_t b) { return _mm512_max_ps(a, b); }
static inline float vmax_lanes(vec_t a) { return _mm512_reduce_max_ps(a); }
static inline void vstore(float *p, vec_t a) { _mm512_storeu_ps(p, a); }
/* Round 16 floats to bf16 (nearest even), as 16 packed halves. */
static inline __m256i to_bf16x16(__m512 v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}
/* Store 16 floats at p[i] in the storage dtype. */
static inline void vstore_as(void *p, int64_t i, __m512 v, int dtype) {
  if (dtype)
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), to_bf16x16(v));
  else
    _mm512_storeu_ps((float *)p + i, v);
}
/* v rounded through the storage dtype (identity for float32). */
static inline __m512 vround_to(__m512 v, int dtype) {
  if (!dtype) return v;
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}
/* fast_expf on 16 lanes; 2^n is applied with vscalefps. */
static inline __m512 vexp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC 8
typedef __m256 vec_t;
static inline vec_t vload(const void *p, int64_t i, int dtype) {
  if (dtype) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps((const float *)p + i);
}
static inline vec_t vzero(void) { return _mm256_setzero_ps(); }
static inline vec_t vset(float x) { return _mm256_set1_ps(x); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec_t vmul(vec_t a, vec_t b) { return _mm256_mul_ps(a, b); }
static inline vec_t vadd(vec_t a, vec_t b) { return _mm256_add_ps(a, b); }
static inline vec_t vsub(vec_t a, vec_t b) { return _mm256_sub_ps(a, b); }
static inline vec_t vdiv(vec_t a, vec_t b) { return _mm256_div_ps(a, b); }
static inline vec_t vfmsub(vec_t a, vec_t b, vec_t c) { return _mm256_fmsub_ps(a, b, c); }
/* Lanewise `a > b ? a : b` (b where a is NaN); the largest lane. */
static inline vec_t vmax(vec_t a, vec_t b) { return _mm256_max_ps(a, b); }
static inline float vmax_lanes(vec_t a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
static inline float vsum(vec_t a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline void vstore(float *p, vec_t a) { _mm256_storeu_ps(p, a); }
/* Round 8 floats to bf16 (nearest even), as 8 packed halves (NaN payloads are not kept). */
static inline __m128i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  /* packus works per 128-bit lane: keep quadwords 0 and 2, which hold the 8 results. */
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}
/* Store 8 floats at p[i] in the storage dtype. */
static inline void vstore_as(void *p, int64_t i, __m256 v, int dtype) {
  if (dtype)
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), to_bf16x8(v));
  else
    _mm256_storeu_ps((float *)p + i, v);
}
/* v rounded through the storage dtype (identity for float32). */
static inline __m256 vround_to(__m256 v, int dtype) {
  if (!dtype) return v;
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(v)), 16));
}
/* fast_expf on 8 lanes; 2^n is built in the exponent bits (n stays in [-126, 127]). */
static inline __m256 vexp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* Arm (Graviton, Apple Silicon under Linux): NEON's four float lanes, FMA included. */
#include <arm_neon.h>
#define VEC 4
typedef float32x4_t vec_t;
static inline vec_t vload(const void *p, int64_t i, int dtype) {
  if (dtype) return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p + i), 16));
  return vld1q_f32((const float *)p + i);
}
static inline vec_t vzero(void) { return vdupq_n_f32(0.0f); }
static inline vec_t vset(float x) { return vdupq_n_f32(x); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return vfmaq_f32(c, a, b); }
static inline vec_t vmul(vec_t a, vec_t b) { return vmulq_f32(a, b); }
static inline vec_t vadd(vec_t a, vec_t b) { return vaddq_f32(a, b); }
static inline vec_t vsub(vec_t a, vec_t b) { return vsubq_f32(a, b); }
static inline vec_t vdiv(vec_t a, vec_t b) { return vdivq_f32(a, b); }
static inline vec_t vfmsub(vec_t a, vec_t b, vec_t c) { return vnegq_f32(vfmsq_f32(c, a, b)); }
static inline float vsum(vec_t a) { return vaddvq_f32(a); }
/* Lanewise `a > b ? a : b` (b where a is NaN); the largest lane. */
static inline vec_t vmax(vec_t a, vec_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline float vmax_lanes(vec_t a) { return vmaxvq_f32(a); }
static inline void vstore(float *p, vec_t a) { vst1q_f32(p, a); }
/* Round 4 floats to bf16 (nearest even), as 4 packed halves (NaN payloads are not kept). */
static inline uint16x4_t to_bf16x4(vec_t v) {
  const uint32x4_t u = vreinterpretq_u32_f32(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  return vshrn_n_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), lsb)), 16);
}
/* Store 4 floats at p[i] in the storage dtype. */
static inline void vstore_as(void *p, int64_t i, vec_t v, int dtype) {
  if (dtype)
    vst1_u16((uint16_t *)p + i, to_bf16x4(v));
  else
    vst1q_f32((float *)p + i, v);
}
/* v rounded through the storage dtype (identity for float32). */
static inline vec_t vround_to(vec_t v, int dtype) {
  if (!dtype) return v;
  return vreinterpretq_f32_u32(vshll_n_u16(to_bf16x4(v), 16));
}
/* fast_expf on 4 lanes; 2^n is built in the exponent bits (n stays in [-126, 127]). */
static inline vec_t vexp(vec_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.0f)), vdupq_n_f32(88.0f));
  const vec_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  vec_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmaq_f32(r, n, vdupq_n_f32(2.12194440e-4f));
  vec_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), vmulq_f32(p, r), r);
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
#else
/* Portable fallback: one "vector" is one float. */
#define VEC 1
typedef float vec_t;
static inline vec_t vload(const void *p, int64_t i, int dtype) { return load(p, i, dtype); }
static inline vec_t vzero(void) { return 0.0f; }
static inline vec_t vset(float x) { return x; }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return a * b + c; }
static inline vec_t vmul(vec_t a, vec_t b) { return a * b; }
static inline vec_t vadd(vec_t a, vec_t b) { return a + b; }
static inline vec_t vsub(vec_t a, vec_t b) { return a - b; }
static inline vec_t vdiv(vec_t a, vec_t b) { return a / b; }
static inline vec_t vfmsub(vec_t a, vec_t b, vec_t c) { return a * b - c; }
static inline vec_t vexp(vec_t x) { return fast_expf(x); }
static inline vec_t vround_to(vec_t v, int dtype) { return round_to(v, dtype); }
static inline float vsum(vec_t a) { return a; }
static inline vec_t vmax(vec_t a, vec_t b) { return a > b ? a : b; }
static inline float vmax_lanes(vec_t a) { return a; }
static inline void vstore(float *p, vec_t a) { *p = a; }
static inline void vstore_as(void *p, int64_t i, vec_t v, int dtype) { store(p, i, v, dtype); }
#endif

#endif
