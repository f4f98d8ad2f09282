/*
 * Decode attention over the paged KV pool: one query token per row reads its K/V rows straight
 * from the pool through the row's slot table (cost grows with the tokens attended; nothing is
 * copied). See common.h for conventions.
 *
 * Work is split by row and, when there are few rows, by token range too (split-K, as
 * flash-decoding does; partial softmax states are merged at the end). Within a task, tokens go
 * in blocks of ATTN_BLOCK, and each block is attended by every kv head in turn: a slot's K/V for
 * all heads are adjacent in the pool, so a block's cache lines are read from memory once.
 *
 * A bf16 cache on a CPU with AVX512-BF16 takes attend_block_bf16 (bf16 dot products for Q K and
 * P V, the next block prefetched while one computes); elsewhere the block is float32 FMAs.
 */
#include "common.h"

#define ATTN_BLOCK 64
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_HEADS 128
/* Tokens per split when a row's context is cut into ranges for parallelism. */
#define SPLIT_MIN_TOKENS 256
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

/* A block function for a bf16 cache taking q unscaled (attend_block_bf16). */
typedef void (*bf16_block_fn)(float, const float *, float *, softmax_state *, const uint16_t *,
                              const uint16_t *, const int64_t *, int64_t, int64_t, int64_t,
                              int64_t);

typedef void (*block_fn)(int, const float *, float *, softmax_state *, const void *, const void *,
                         const int64_t *, int64_t, int64_t, int64_t);

/* Specializations for common (query heads per kv head, head_dim) pairs. */
#define BLOCK_SPECIAL(G, HD)                                                                   \
  static void block_g##G##_d##HD(int dtype, const float *q, float *acc, softmax_state *st,    \
                                 const void *kc, const void *vc, const int64_t *slots,        \
                                 int64_t n, int64_t kv_width, int64_t kv_off) {               \
    if (VEC == 8)                                                                              \
      attend_block_per_head(G, HD / VEC, dtype, q, acc, st, kc, vc, slots, n, kv_width, kv_off); \
    else                                                                                       \
      attend_block(G, HD / VEC, dtype, q, acc, st, kc, vc, slots, n, kv_width, kv_off);        \
  }
#define BLOCK_GROUPS(HD)                                                                       \
  BLOCK_SPECIAL(1, HD) BLOCK_SPECIAL(2, HD) BLOCK_SPECIAL(3, HD) BLOCK_SPECIAL(4, HD)         \
  BLOCK_SPECIAL(5, HD) BLOCK_SPECIAL(6, HD) BLOCK_SPECIAL(7, HD) BLOCK_SPECIAL(8, HD)
#if VEC > 1
BLOCK_GROUPS(64)
BLOCK_GROUPS(128)
#endif

#ifdef SGLITE_ATTENTION_BF16_DOT
#define BF16_SPECIAL(G, HD)                                                                    \
  static void bf16_g##G##_d##HD(float scale, const float *q, float *acc, softmax_state *st,   \
                                const uint16_t *kc, const uint16_t *vc, const int64_t *slots, \
                                int64_t n, int64_t ahead, int64_t kv_width, int64_t kv_off) { \
    attend_block_bf16(G, HD / 32, scale, q, acc, st, kc, vc, slots, n, ahead, kv_width,       \
                      kv_off);                                                                 \
  }
#define BF16_GROUPS(HD)                                                                        \
  BF16_SPECIAL(1, HD) BF16_SPECIAL(2, HD) BF16_SPECIAL(3, HD) BF16_SPECIAL(4, HD)             \
  BF16_SPECIAL(5, HD) BF16_SPECIAL(6, HD) BF16_SPECIAL(7, HD) BF16_SPECIAL(8, HD)
BF16_GROUPS(64)
BF16_GROUPS(128)
#endif

typedef struct {
  int dtype;
  const void *q;
  int64_t q_stride;
  const void *k_cache, *v_cache;
  const int64_t *table;
  int64_t table_stride;
  const int64_t *lens;
  void *out;
  int64_t rows, heads, kv_heads, group, head_dim, nvec, window;
  float scale;
  int64_t splits;       /* token ranges per row (1 = no split) */
  int64_t span;         /* tokens per range; 0 = the row's context cut into `splits` equal ones */
  float *partial;       /* splits > 1: per (row, split): heads x (m, l) then heads x head_dim */
  block_fn special;     /* specialized for (group, nvec), or NULL */
  bf16_block_fn bf16;   /* a bf16 cache's dot-product block for (group, head_dim), or NULL */
} attention_args;

static void generic_block(const attention_args *a, const float *q, float *acc, softmax_state *st,
                          const int64_t *slots, int64_t n, int64_t ahead, int64_t kv_off) {
  if (a->bf16 != NULL)
    a->bf16(a->scale, q, acc, st, a->k_cache, a->v_cache, slots, n, ahead,
            a->kv_heads * a->head_dim, kv_off);
  else if (a->special != NULL)
    a->special(a->dtype, q, acc, st, a->k_cache, a->v_cache, slots, n,
               a->kv_heads * a->head_dim, kv_off);
  else
    attend_block((int)a->group, a->nvec, a->dtype, q, acc, st, a->k_cache, a->v_cache, slots, n,
                 a->kv_heads * a->head_dim, kv_off);
}

/* Row b over tokens [begin, end) of its (windowed) context: all heads, block by block. */
static void attend_range(const attention_args *a, int64_t b, int64_t begin, int64_t end,
                         float *q, float *acc, softmax_state *st) {
  const int64_t heads = a->heads, head_dim = a->head_dim;
  const float q_scale = a->bf16 != NULL ? 1.0f : a->scale; /* bf16 blocks scale the scores */
  for (int64_t h = 0; h < heads; h++) {
    for (int64_t d = 0; d < head_dim; d++) {
      q[h * head_dim + d] = load(a->q, b * a->q_stride + h * head_dim + d, a->dtype) * q_scale;
      acc[h * head_dim + d] = 0.0f;
    }
    st[h].m = -INFINITY;
    st[h].l = 0.0f;
  }
  const int64_t *slots = a->table + b * a->table_stride;
  for (int64_t t0 = begin; t0 < end; t0 += ATTN_BLOCK) {
    const int64_t n = (end - t0 < ATTN_BLOCK) ? end - t0 : ATTN_BLOCK;
    for (int64_t kh = 0; kh < a->kv_heads; kh++) {
      const int64_t h0 = kh * a->group;
      generic_block(a, q + h0 * head_dim, acc + h0 * head_dim, st + h0, slots + t0, n, end - t0,
                    kh * head_dim);
    }
  }
}

static void context_range(const attention_args *a, int64_t b, int64_t *begin, int64_t *end) {
  const int64_t len = a->lens[b];
  *begin = (a->window > 0 && len > a->window) ? len - a->window : 0;
  *end = len;
}

static void attention_tasks(void *p, int64_t first, int64_t last) {
  const attention_args *a = p;
  const int64_t heads = a->heads, head_dim = a->head_dim;
  float *qbuf = malloc((size_t)(2 * heads * head_dim) * sizeof(float));
  softmax_state *st = malloc((size_t)heads * sizeof(softmax_state));
  if (qbuf == NULL || st == NULL) {
    free(qbuf);
    free(st);
    return;
  }
  float *acc = qbuf + heads * head_dim;
  for (int64_t task = first; task < last; task++) {
    const int64_t b = task / a->splits, s = task % a->splits;
    int64_t begin, end;
    context_range(a, b, &begin, &end);
    if (a->partial != NULL) {
      const int64_t span = a->span ? a->span : (end - begin + a->splits - 1) / a->splits;
      const int64_t lo = begin + s * span, hi = lo + span < end ? lo + span : end;
      attend_range(a, b, lo, hi > lo ? hi : lo, qbuf, acc, st);
      float *dst = a->partial + task * heads * (2 + head_dim);
      for (int64_t h = 0; h < heads; h++) {
        dst[2 * h] = st[h].m;
        dst[2 * h + 1] = st[h].l;
      }
      memcpy(dst + 2 * heads, acc, (size_t)(heads * head_dim) * sizeof(float));
      continue;
    }
    attend_range(a, b, begin, end, qbuf, acc, st);
    for (int64_t h = 0; h < heads; h++) {
      const float inv = st[h].l > 0.0f ? 1.0f / st[h].l : 0.0f;
      for (int64_t d = 0; d < head_dim; d++)
        store(a->out, b * heads * head_dim + h * head_dim + d, acc[h * head_dim + d] * inv,
              a->dtype);
    }
  }
  free(qbuf);
  free(st);
}

/* Combine the split partial states of every row into the output. */
static void merge_splits(const attention_args *a) {
  const int64_t heads = a->heads, head_dim = a->head_dim, stride = heads * (2 + head_dim);
  for (int64_t b = 0; b < a->rows; b++)
    for (int64_t h = 0; h < heads; h++) {
      const float *base = a->partial + b * a->splits * stride;
      float mx = -INFINITY;
      for (int64_t s = 0; s < a->splits; s++)
        if (base[s * stride + 2 * h + 1] > 0.0f && base[s * stride + 2 * h] > mx)
          mx = base[s * stride + 2 * h];
      float total = 0.0f;
      float o[MAX_HEAD_DIM] = {0};
      for (int64_t s = 0; s < a->splits; s++) {
        const float *part = base + s * stride;
        if (part[2 * h + 1] <= 0.0f) continue; /* an empty range */
        const float w = fast_expf(part[2 * h] - mx);
        total += part[2 * h + 1] * w;
        for (int64_t d = 0; d < head_dim; d++) o[d] += part[2 * heads + h * head_dim + d] * w;
      }
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < head_dim; d++)
        store(a->out, b * heads * head_dim + h * head_dim + d, o[d] * inv, a->dtype);
    }
}

static bf16_block_fn bf16_block(int dtype, int64_t group, int64_t head_dim) {
#ifdef SGLITE_ATTENTION_BF16_DOT
  static const bf16_block_fn by_group64[8] = {bf16_g1_d64, bf16_g2_d64, bf16_g3_d64, bf16_g4_d64,
                                              bf16_g5_d64, bf16_g6_d64, bf16_g7_d64, bf16_g8_d64};
  static const bf16_block_fn by_group128[8] = {bf16_g1_d128, bf16_g2_d128, bf16_g3_d128,
                                               bf16_g4_d128, bf16_g5_d128, bf16_g6_d128,
                                               bf16_g7_d128, bf16_g8_d128};
  if (dtype != DTYPE_BFLOAT16 || group < 1 || group > 8) return NULL;
  if (head_dim == 64) return by_group64[group - 1];
  if (head_dim == 128) return by_group128[group - 1];
#endif
  (void)dtype;
  (void)group;
  (void)head_dim;
  return NULL;
}

static block_fn special_block(int64_t group, int64_t nvec) {
#if VEC > 1
  static const block_fn by_group64[8] = {block_g1_d64, block_g2_d64, block_g3_d64, block_g4_d64,
                                         block_g5_d64, block_g6_d64, block_g7_d64, block_g8_d64};
  static const block_fn by_group128[8] = {block_g1_d128, block_g2_d128, block_g3_d128,
                                          block_g4_d128, block_g5_d128, block_g6_d128,
                                          block_g7_d128, block_g8_d128};
  if (group >= 1 && group <= 8 && nvec * VEC == 64) return by_group64[group - 1];
  if (group >= 1 && group <= 8 && nvec * VEC == 128) return by_group128[group - 1];
#endif
  (void)group;
  (void)nvec;
  return NULL;
}

/*
 * Row b attends to the K/V at slots table[b, start:len[b]] (start = len - window when a sliding
 * window is set, else 0) with its `heads` query heads; query head h reads kv head
 * h / (heads / kv_heads). q: [rows, q_stride] with head h at q[b, h * head_dim]; out:
 * [rows, heads * head_dim]; caches: [slots, kv_heads, head_dim]; table: [rows, table_stride]
 * int64. Requires heads / kv_heads <= MAX_GROUP, heads <= MAX_HEADS and head_dim <=
 * MAX_HEAD_DIM, a multiple of VEC (the caller checks).
 */
int paged_decode_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, const int64_t *table, int64_t table_stride,
                           const int64_t *lens, void *out, int64_t rows, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                           int threads, int64_t fixed_span) {
  const int64_t group = heads / kv_heads, nvec = head_dim / VEC;
  attention_args a = {.dtype = dtype,
                      .q = q,
                      .q_stride = q_stride,
                      .k_cache = k_cache,
                      .v_cache = v_cache,
                      .table = table,
                      .table_stride = table_stride,
                      .lens = lens,
                      .out = out,
                      .rows = rows,
                      .heads = heads,
                      .kv_heads = kv_heads,
                      .group = group,
                      .head_dim = head_dim,
                      .nvec = nvec,
                      .window = window,
                      .scale = scale,
                      .splits = 1,
                      .span = 0,
                      .partial = NULL,
                      .special = special_block(group, nvec),
                      .bf16 = bf16_block(dtype, group, head_dim)};
  int64_t attended = 0, longest = 0;
  for (int64_t b = 0; b < rows; b++) {
    int64_t begin, end;
    context_range(&a, b, &begin, &end);
    attended += end - begin;
    longest = end - begin > longest ? end - begin : longest;
  }
  const int parallel = threads > 1 && attended * kv_heads >= PARALLEL_MIN_ATTN;
  if (fixed_span > 0) {
    /* Always through the ranges and the merge, even for one range: the same rounding for
     * every row whatever its neighbours. */
    a.span = fixed_span;
    a.splits = longest > 0 ? (longest + fixed_span - 1) / fixed_span : 1;
    a.partial = malloc((size_t)(rows * a.splits * heads * (2 + head_dim)) * sizeof(float));
    if (a.partial == NULL) return -1;
  } else if (parallel && rows < 2 * threads && longest >= 2 * SPLIT_MIN_TOKENS) {
    int64_t splits = (2 * threads + rows - 1) / rows;
    if (splits > longest / SPLIT_MIN_TOKENS) splits = longest / SPLIT_MIN_TOKENS;
    a.partial = malloc((size_t)(rows * splits * heads * (2 + head_dim)) * sizeof(float));
    if (a.partial != NULL) a.splits = splits;
  }
  parallel_range(attention_tasks, &a, rows * a.splits, 1, threads, parallel);
  if (a.partial != NULL) merge_splits(&a);
  free(a.partial);
  return 0;
}

/* Limits the Python side checks before calling paged_decode_attention. */
int64_t attention_max_group(void) { return MAX_GROUP; }
int64_t attention_max_head_dim(void) { return MAX_HEAD_DIM; }
int64_t attention_vec_width(void) { return VEC; }
int64_t attention_max_heads(void) { return MAX_HEADS; }
