/*
 * Decode attention over the paged KV pool: one query token per row reads its K/V rows straight
 * from the pool through the row's slot table (cost grows with the tokens attended; nothing is
 * copied). See common.h for conventions.
 *
 * Work is split by row and token range (split-K, as flash-decoding does): a row's context is
 * cut into ranges of ATTENTION_SPAN tokens from its start, whatever the batch, and the ranges'
 * partial softmax states merged in order, so a row's output is the same in any batch (a
 * verification's rows and decoding's one row alike). Within a task, tokens go
 * in blocks of ATTN_BLOCK, and each block is attended by every kv head in turn: a slot's K/V for
 * all heads are adjacent in the pool, so a block's cache lines are read from memory once.
 *
 * A bf16 cache on a CPU with AVX512-BF16 takes attend_block_bf16 (bf16 dot products for Q K and
 * P V, the next block prefetched while one computes); elsewhere the block is float32 FMAs.
 */
#include "attention_blocks.h"

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
  int64_t splits;       /* token ranges per row: the longest row's */
  int64_t span;         /* tokens per range */
  float *partial;       /* per (row, range): heads x (m, l) then heads x head_dim */
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
    const int64_t lo = begin + s * a->span, hi = lo + a->span < end ? lo + a->span : end;
    float *dst = a->partial + task * heads * (2 + head_dim);
    if (hi <= lo) { /* past a shorter row's end (the ranges are the longest row's): empty */
      for (int64_t h = 0; h < heads; h++) dst[2 * h + 1] = 0.0f;
      continue;
    }
    attend_range(a, b, lo, hi, qbuf, acc, st);
    for (int64_t h = 0; h < heads; h++) {
      dst[2 * h] = st[h].m;
      dst[2 * h + 1] = st[h].l;
    }
    memcpy(dst + 2 * heads, acc, (size_t)(heads * head_dim) * sizeof(float));
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
                           int threads) {
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
  a.span = ATTENTION_SPAN;
  a.splits = longest > 0 ? (longest + ATTENTION_SPAN - 1) / ATTENTION_SPAN : 1;
  a.partial = malloc((size_t)(rows * a.splits * heads * (2 + head_dim)) * sizeof(float));
  if (a.partial == NULL) return -1;
  parallel_range(attention_tasks, &a, rows * a.splits, 1, threads, parallel);
  merge_splits(&a);
  free(a.partial);
  return 0;
}

/* Limits the Python side checks before calling paged_decode_attention. */
int64_t attention_max_group(void) { return MAX_GROUP; }
int64_t attention_max_head_dim(void) { return MAX_HEAD_DIM; }
int64_t attention_vec_width(void) { return VEC; }
int64_t attention_max_heads(void) { return MAX_HEADS; }
