/*
 * Decode attention's block kernels (attention.c includes this once): one block of up to
 * ATTN_BLOCK tokens attended by the query heads of one kv head, updating their online-softmax
 * states and accumulators. Three variants: float32 FMAs with every head's q and accumulator in
 * registers (AVX-512, NEON, plain C), one head at a time (AVX2, whose 16 registers would spill),
 * and bf16 dot products for a bf16 cache (AVX512-BF16).
 */
#ifndef SGLITE_KERNELS_ATTENTION_BLOCKS_H
#define SGLITE_KERNELS_ATTENTION_BLOCKS_H
#include "common.h"

#define ATTN_BLOCK 64
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_HEADS 128
/* How many tokens ahead of the one scored its K and V rows (this kv head's, every cache line)
 * are prefetched: at long contexts they come from memory, the weights having evicted them, and
 * one line ahead per row left the rest of each row to wait on memory. V is fetched during the
 * K pass, so the block's V pass finds it in cache. */
#define KV_PREFETCH_TOKENS 8

/* Every cache line of a token's K and V rows for one kv head (`row_bytes` from byte `at`). */
static inline void prefetch_kv(const void *k_cache, const void *v_cache, int64_t at,
                               int64_t row_bytes) {
  for (int64_t line = 0; line < row_bytes; line += 64) {
    __builtin_prefetch((const char *)k_cache + at + line);
    __builtin_prefetch((const char *)v_cache + at + line);
  }
}

/* Online-softmax state of one query head over the tokens seen so far. */
typedef struct {
  float m, l;
} softmax_state;

/* Exponentiates a block's scores sc[0..n) against the running max (in place) and updates st;
 * returns the factor the head's accumulator is rescaled by. */
static inline float softmax_block(float *sc, int64_t n, softmax_state *st) {
  float block_max = st->m;
  int64_t i = 0;
#if VEC > 1
  vec_t most = vset(block_max);
  for (; i + VEC <= n; i += VEC) most = vmax(vload(sc, i, 0), most);
  block_max = vmax_lanes(most);
#endif
  for (; i < n; i++) block_max = sc[i] > block_max ? sc[i] : block_max;
  const float correction = fast_expf(st->m - block_max);
  float sum = 0.0f;
  int64_t j = 0;
#if VEC > 1
  vec_t partial = vzero();
  for (; j + VEC <= n; j += VEC) {
    const vec_t e = vexp(vsub(vload(sc, j, 0), vset(block_max)));
    vstore(sc + j, e);
    partial = vadd(partial, e);
  }
  sum = vsum(partial);
#endif
  for (; j < n; j++) {
    sc[j] = fast_expf(sc[j] - block_max);
    sum += sc[j];
  }
  st->l = st->l * correction + sum;
  st->m = block_max;
  return correction;
}

/*
 * One block of n tokens for the `group` query heads of one kv head: scores, softmax update and
 * V accumulation. q (scaled) and acc are [group][head_dim] floats; always inlined into callers
 * that fix `group` and `nvec`, so they live in registers for the block.
 */
static inline __attribute__((always_inline)) void attend_block(
    const int group, const int64_t nvec, int dtype, const float *q, float *acc,
    softmax_state *st, const void *k_cache, const void *v_cache, const int64_t *slots, int64_t n,
    int64_t kv_width, int64_t kv_off) {
  const int64_t head_dim = nvec * VEC;
  const size_t elem = dtype ? 2 : 4;
  vec_t qv[MAX_GROUP][MAX_HEAD_DIM / VEC], av[MAX_GROUP][MAX_HEAD_DIM / VEC];
  vec_t kv[MAX_HEAD_DIM / VEC];
  float sc[MAX_GROUP][ATTN_BLOCK];
  for (int g = 0; g < group; g++)
    for (int64_t v = 0; v < nvec; v++) {
      qv[g][v] = vload(q, g * head_dim + v * VEC, 0);
      av[g][v] = vload(acc, g * head_dim + v * VEC, 0);
    }
  for (int64_t j = 0; j < n; j++) {
    if (j + KV_PREFETCH_TOKENS < n)
      prefetch_kv(k_cache, v_cache, (slots[j + KV_PREFETCH_TOKENS] * kv_width + kv_off) * elem,
                  head_dim * (int64_t)elem);
    const int64_t k_off = slots[j] * kv_width + kv_off;
    for (int64_t v = 0; v < nvec; v++) kv[v] = vload(k_cache, k_off + v * VEC, dtype);
    for (int g = 0; g < group; g++) {
      vec_t dot = vmul(qv[g][0], kv[0]);
      for (int64_t v = 1; v < nvec; v++) dot = vfma(qv[g][v], kv[v], dot);
      sc[g][j] = vsum(dot);
    }
  }
  for (int g = 0; g < group; g++) {
    const vec_t vc = vset(softmax_block(sc[g], n, &st[g]));
    for (int64_t v = 0; v < nvec; v++) av[g][v] = vmul(av[g][v], vc);
  }
  for (int64_t j = 0; j < n; j++) {
    const int64_t v_off = slots[j] * kv_width + kv_off;
    for (int64_t v = 0; v < nvec; v++) kv[v] = vload(v_cache, v_off + v * VEC, dtype);
    for (int g = 0; g < group; g++) {
      const vec_t p = vset(sc[g][j]);
      for (int64_t v = 0; v < nvec; v++) av[g][v] = vfma(p, kv[v], av[g][v]);
    }
  }
  for (int g = 0; g < group; g++)
    for (int64_t v = 0; v < nvec; v++) vstore(acc + g * head_dim + v * VEC, av[g][v]);
}

/*
 * attend_block one query head at a time, for 8-wide vectors: AVX2 has 16 vector registers, and
 * attend_block's q and acc of every head of a group (2 x group x head_dim / 8 of them) spill to
 * the stack for every token. Here a head's q or acc (head_dim / 8 registers) stays in registers
 * while the block's K or V rows, read once from memory per block, come again from L1 per head.
 */
static inline __attribute__((always_inline)) void attend_block_per_head(
    const int group, const int64_t nvec, int dtype, const float *q, float *acc,
    softmax_state *st, const void *k_cache, const void *v_cache, const int64_t *slots, int64_t n,
    int64_t kv_width, int64_t kv_off) {
  const int64_t head_dim = nvec * VEC;
  const size_t elem = dtype ? 2 : 4;
  float sc[ATTN_BLOCK];
  for (int g = 0; g < group; g++) {
    vec_t qv[MAX_HEAD_DIM / VEC];
    for (int64_t v = 0; v < nvec; v++) qv[v] = vload(q, g * head_dim + v * VEC, 0);
    for (int64_t j = 0; j < n; j++) {
      if (g == 0 && j + KV_PREFETCH_TOKENS < n) /* the first head reads the block from memory */
        prefetch_kv(k_cache, v_cache, (slots[j + KV_PREFETCH_TOKENS] * kv_width + kv_off) * elem,
                    head_dim * (int64_t)elem);
      const int64_t k_off = slots[j] * kv_width + kv_off;
      vec_t even = vmul(qv[0], vload(k_cache, k_off, dtype));
      vec_t odd = vzero();
      for (int64_t v = 1; v < nvec; v++) {
        const vec_t kv = vload(k_cache, k_off + v * VEC, dtype);
        if (v % 2) odd = vfma(qv[v], kv, odd);
        else even = vfma(qv[v], kv, even);
      }
      sc[j] = vsum(vadd(even, odd));
    }
    const float correction = softmax_block(sc, n, &st[g]);
    vec_t av[MAX_HEAD_DIM / VEC];
    const vec_t vc = vset(correction);
    for (int64_t v = 0; v < nvec; v++) av[v] = vmul(vload(acc, g * head_dim + v * VEC, 0), vc);
    for (int64_t jj = 0; jj < n; jj++) {
      const int64_t v_off = slots[jj] * kv_width + kv_off;
      const vec_t pv = vset(sc[jj]);
      for (int64_t v = 0; v < nvec; v++)
        av[v] = vfma(pv, vload(v_cache, v_off + v * VEC, dtype), av[v]);
    }
    for (int64_t v = 0; v < nvec; v++) vstore(acc + g * head_dim + v * VEC, av[v]);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* Lane j of the result is the sum of v[j]'s 16 lanes (a transposed reduction: 45 shuffles and
 * adds for 16 dot products, where a horizontal sum per product takes 8 operations). */
static inline __m512 lane_sums16(const __m512 v[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; i++)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xee));
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                       _mm512_shuffle_f32x4(low, high, 0xdd));
}

/* The next block's K and V lines (this kv head's rows), prefetched into L2 a few at a time
 * while the current block computes: spread over the block's work, they keep memory busy
 * throughout, where prefetching a run of tokens at once left it idle between bursts. */
typedef struct {
  const char *k, *v;     /* the caches' bytes at this kv head's offset */
  const int64_t *slots;  /* the next block's slots */
  int64_t row_stride;    /* bytes from one slot's rows to the next's */
  int64_t row_bytes;     /* bytes of one row (this kv head's) */
  int64_t token, tokens; /* the token whose lines are next, of the block's */
  int64_t offset;        /* the next line's offset in that token's K row, then V row */
} kv_prefetch;

static inline void prefetch_lines(kv_prefetch *p, int64_t count) {
  for (int64_t i = 0; i < count && p->token < p->tokens; i++) {
    const int64_t in_v = p->offset >= p->row_bytes;
    const char *row = (in_v ? p->v : p->k) + p->slots[p->token] * p->row_stride;
    __builtin_prefetch(row + p->offset - in_v * p->row_bytes, 0, 2);
    p->offset += 64;
    if (p->offset == 2 * p->row_bytes) {
      p->offset = 0;
      p->token++;
    }
  }
}

/* q against one token's K row: 16 lanes of pair products, whose sum is the score. */
static inline __attribute__((always_inline)) __m512 k_dot(const __m512bh *qv, const int64_t pairs,
                                                          const uint16_t *k_row) {
  __m512 dot = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t c = 0; c < pairs; c++) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512((const void *)(k_row + 32 * c));
    dot = _mm512_dpbf16_ps(dot, qv[c], k);
  }
  return dot;
}

/*
 * attend_block for a bf16 cache with AVX512-BF16, both products in `vdpbf16ps` (32 products
 * per instruction, where a float32 FMA takes 16): a query head's scores for 16 tokens at a
 * time, each token's K row against the head's q (q unscaled, so its bf16 values are exact; the
 * scale applied to the scores), the 16 dot products reduced together; then P V for every head
 * of the group 16 dims at a time, the accumulators (float32) in registers. q and acc are
 * [group][head_dim] floats; `ahead` tokens have slots from `slots` on (this block's n and the
 * next block's, whose K and V lines are prefetched while this one computes).
 */
static inline __attribute__((always_inline)) void attend_block_bf16(
    const int group, const int64_t pairs, float scale, const float *q, float *acc,
    softmax_state *st, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slots,
    int64_t n, int64_t ahead, int64_t kv_width, int64_t kv_off) {
  const int64_t head_dim = 32 * pairs;
  const int64_t next_n = ahead - n < ATTN_BLOCK ? ahead - n : ATTN_BLOCK;
  kv_prefetch next = {.k = (const char *)(k_cache + kv_off),
                      .v = (const char *)(v_cache + kv_off),
                      .slots = slots + n,
                      .row_stride = kv_width * 2,
                      .row_bytes = head_dim * 2,
                      .token = 0,
                      .tokens = next_n,
                      .offset = 0};
  /* one float past the block for an odd block's pad, and 32 for the pairs' vector reads */
  float sc[MAX_GROUP][ATTN_BLOCK + 32], correction[MAX_GROUP];
  for (int g = 0; g < group; g++) {
    __m512bh qv[MAX_HEAD_DIM / 32];
    for (int64_t c = 0; c < pairs; c++) {
      const float *qc = q + g * head_dim + 32 * c;
      qv[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qc + 16), _mm512_loadu_ps(qc));
    }
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t m = n - j0 < 16 ? n - j0 : 16;
      __m512 dots[16];
      prefetch_lines(&next, 16);
      if (m == 16) { /* a whole group of 16 tokens: every accumulator in a register */
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++)
          dots[t] = k_dot(qv, pairs, k_cache + slots[j0 + t] * kv_width + kv_off);
      } else {
        for (int t = 0; t < 16; t++)
          dots[t] = t < m ? k_dot(qv, pairs, k_cache + slots[j0 + t] * kv_width + kv_off)
                          : _mm512_setzero_ps();
      }
      const __m512 scores = _mm512_mul_ps(lane_sums16(dots), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(sc[g] + j0, (__mmask16)((1u << m) - 1), scores);
    }
    correction[g] = softmax_block(sc[g], n, &st[g]);
  }
  /* P V with `vdpbf16ps` too: the weights rounded to bf16 (as PyTorch's bf16 attention rounds
   * them for its P V product; the sums l stay float32), two tokens' V rows interleaved value by
   * value so each instruction takes a pair of tokens for 16 dims. */
  uint32_t p_pairs[MAX_GROUP][ATTN_BLOCK / 2];
  for (int g = 0; g < group; g++) {
    float *p = sc[g];
    if (n % 2) p[n] = 0.0f; /* an odd block's last token pairs with nothing */
    for (int64_t j = 0; j < n; j += 32) {
      const __m512 lo = _mm512_loadu_ps(p + j), hi = _mm512_loadu_ps(p + j + 16);
      _mm512_storeu_si512((void *)(p_pairs[g] + j / 2), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
  const __m512i interleave = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
      35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t d = 0; d < head_dim; d += 16) {
    __m512 av[MAX_GROUP];
    for (int g = 0; g < group; g++)
      av[g] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * head_dim + d), _mm512_set1_ps(correction[g]));
    for (int64_t j = 0; j < n; j += 2) {
      prefetch_lines(&next, 1);
      const __m512i v0 = _mm512_castsi256_si512(
          _mm256_loadu_si256((const __m256i *)(v_cache + slots[j] * kv_width + kv_off + d)));
      const __m512i v1 = j + 1 < n ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                         (const __m256i *)(v_cache + slots[j + 1] * kv_width +
                                                           kv_off + d)))
                                   : _mm512_setzero_si512();
      const __m512bh pair = (__m512bh)_mm512_permutex2var_epi16(v0, interleave, v1);
      for (int g = 0; g < group; g++)
        av[g] = _mm512_dpbf16_ps(av[g], (__m512bh)_mm512_set1_epi32((int)p_pairs[g][j / 2]), pair);
    }
    for (int g = 0; g < group; g++) _mm512_storeu_ps(acc + g * head_dim + d, av[g]);
  }
}
#define SGLITE_ATTENTION_BF16_DOT 1
#endif

#endif
