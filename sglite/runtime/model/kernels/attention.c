/*
 * Decode attention over the paged KV pool: one query token per row reads its K/V rows straight
 * from the pool through the row's slot table (cost grows with the tokens attended; nothing is
 * copied). See common.h for conventions.
 */
#include "common.h"

#define ATTN_BLOCK 64
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

/*
 * Decode attention of one (kv head, row) task: the `group` query heads sharing kv head `kh`
 * attend to slots[start:len]. Each K/V row is loaded once and used by all of them; online
 * softmax over blocks of ATTN_BLOCK tokens, so no buffer grows with the context.
 * Always inlined into callers that fix `group` and `nvec`, so q and the accumulators stay in
 * registers and the loops unroll.
 */
static inline __attribute__((always_inline)) void attend_one(
    const int group, const int64_t nvec, int dtype, const void *q, int64_t q_off,
    const void *k_cache, const void *v_cache, const int64_t *slots, int64_t start, int64_t len,
    int64_t kv_width, int64_t kv_off, float scale, void *out, int64_t out_off) {
  const int64_t head_dim = nvec * VEC;
  const size_t elem = dtype ? 2 : 4;
  vec_t qv[MAX_GROUP][MAX_HEAD_DIM / VEC], acc[MAX_GROUP][MAX_HEAD_DIM / VEC];
  vec_t kv[MAX_HEAD_DIM / VEC];
  float m[MAX_GROUP], l[MAX_GROUP], sc[MAX_GROUP][ATTN_BLOCK];
  const vec_t vscale = vset(scale);
  for (int g = 0; g < group; g++) {
    for (int64_t v = 0; v < nvec; v++) {
      qv[g][v] = vmul(vload(q, q_off + g * head_dim + v * VEC, dtype), vscale);
      acc[g][v] = vzero();
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  for (int64_t t0 = start; t0 < len; t0 += ATTN_BLOCK) {
    const int64_t n = (len - t0 < ATTN_BLOCK) ? len - t0 : ATTN_BLOCK;
    for (int64_t j = 0; j < n; j++) {
      if (j + 4 < n)
        __builtin_prefetch((const char *)k_cache + (slots[t0 + j + 4] * kv_width + kv_off) * elem);
      const int64_t k_off = slots[t0 + j] * kv_width + kv_off;
      for (int64_t v = 0; v < nvec; v++) kv[v] = vload(k_cache, k_off + v * VEC, dtype);
      for (int g = 0; g < group; g++) {
        vec_t dot = vmul(qv[g][0], kv[0]);
        for (int64_t v = 1; v < nvec; v++) dot = vfma(qv[g][v], kv[v], dot);
        sc[g][j] = vsum(dot);
      }
    }
    for (int g = 0; g < group; g++) {
      float block_max = m[g];
      for (int64_t j = 0; j < n; j++) block_max = sc[g][j] > block_max ? sc[g][j] : block_max;
      const float correction = fast_expf(m[g] - block_max);
      float sum = 0.0f;
      int64_t j = 0;
#ifdef __AVX512F__
      __m512 vsum_ = _mm512_setzero_ps();
      for (; j + 16 <= n; j += 16) {
        const __m512 e = vexp(_mm512_sub_ps(_mm512_loadu_ps(sc[g] + j), _mm512_set1_ps(block_max)));
        _mm512_storeu_ps(sc[g] + j, e);
        vsum_ = _mm512_add_ps(vsum_, e);
      }
      sum = _mm512_reduce_add_ps(vsum_);
#endif
      for (; j < n; j++) {
        sc[g][j] = fast_expf(sc[g][j] - block_max);
        sum += sc[g][j];
      }
      l[g] = l[g] * correction + sum;
      m[g] = block_max;
      const vec_t vc = vset(correction);
      for (int64_t v = 0; v < nvec; v++) acc[g][v] = vmul(acc[g][v], vc);
    }
    for (int64_t j = 0; j < n; j++) {
      if (j + 4 < n)
        __builtin_prefetch((const char *)v_cache + (slots[t0 + j + 4] * kv_width + kv_off) * elem);
      const int64_t v_off = slots[t0 + j] * kv_width + kv_off;
      for (int64_t v = 0; v < nvec; v++) kv[v] = vload(v_cache, v_off + v * VEC, dtype);
      for (int g = 0; g < group; g++) {
        const vec_t p = vset(sc[g][j]);
        for (int64_t v = 0; v < nvec; v++) acc[g][v] = vfma(p, kv[v], acc[g][v]);
      }
    }
  }
  for (int g = 0; g < group; g++) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    float tmp[MAX_HEAD_DIM];
    for (int64_t v = 0; v < nvec; v++) vstore(tmp + v * VEC, acc[g][v]);
    for (int64_t d = 0; d < head_dim; d++) store(out, out_off + g * head_dim + d, tmp[d] * inv, dtype);
  }
}

/* Specializations for common (query heads per kv head, head_dim / VEC) pairs. */
#define ATTEND_SPECIAL(G, NV)                                                                  \
  static void attend_g##G##_v##NV(int dtype, const void *q, int64_t q_off, const void *kc,    \
                                  const void *vc, const int64_t *slots, int64_t start,        \
                                  int64_t len, int64_t kv_width, int64_t kv_off, float scale, \
                                  void *out, int64_t out_off) {                               \
    attend_one(G, NV, dtype, q, q_off, kc, vc, slots, start, len, kv_width, kv_off, scale,     \
               out, out_off);                                                                  \
  }
#define ATTEND_GROUPS(NV)                                                                      \
  ATTEND_SPECIAL(1, NV) ATTEND_SPECIAL(2, NV) ATTEND_SPECIAL(3, NV) ATTEND_SPECIAL(4, NV)     \
  ATTEND_SPECIAL(5, NV) ATTEND_SPECIAL(6, NV) ATTEND_SPECIAL(7, NV) ATTEND_SPECIAL(8, NV)
#if VEC == 16
ATTEND_GROUPS(4)  /* head_dim 64 */
ATTEND_GROUPS(8)  /* head_dim 128 */
#endif

typedef void (*attend_fn)(int, const void *, int64_t, const void *, const void *,
                          const int64_t *, int64_t, int64_t, int64_t, int64_t, float, void *,
                          int64_t);

static attend_fn special_attend(int64_t group, int64_t nvec) {
#if VEC == 16
  static const attend_fn by_group64[8] = {attend_g1_v4, attend_g2_v4, attend_g3_v4,
                                          attend_g4_v4, attend_g5_v4, attend_g6_v4,
                                          attend_g7_v4, attend_g8_v4};
  static const attend_fn by_group128[8] = {attend_g1_v8, attend_g2_v8, attend_g3_v8,
                                           attend_g4_v8, attend_g5_v8, attend_g6_v8,
                                           attend_g7_v8, attend_g8_v8};
  if (group >= 1 && group <= 8 && nvec == 4) return by_group64[group - 1];
  if (group >= 1 && group <= 8 && nvec == 8) return by_group128[group - 1];
#endif
  (void)group;
  (void)nvec;
  return NULL;
}

/*
 * Decode attention over the paged pool: row b attends to the K/V at slots table[b, start:len[b]]
 * (start = len - window when a sliding window is set, else 0) with its `heads` query heads;
 * query head h reads kv head h / (heads / kv_heads).
 * q: [rows, q_stride] with head h at q[b, h * head_dim]; out: [rows, heads * head_dim];
 * caches: [slots, kv_heads, head_dim]; table: [rows, table_stride] int64.
 * One task per (kv head, row), rows of one kv head adjacent so rows sharing a prefix reuse it
 * from cache. Requires heads / kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM, a multiple of
 * VEC (the caller checks).
 */
typedef struct {
  int dtype;
  const void *q;
  int64_t q_stride;
  const void *k_cache, *v_cache;
  const int64_t *table;
  int64_t table_stride;
  const int64_t *lens;
  void *out;
  int64_t rows, heads, group, head_dim, nvec, kv_width, window;
  float scale;
  attend_fn special;
} attention_args;

static void attention_tasks(void *p, int64_t begin, int64_t end) {
  const attention_args *a = p;
  for (int64_t task = begin; task < end; task++) {
    const int64_t kh = task / a->rows, b = task % a->rows;
    const int64_t len = a->lens[b];
    const int64_t start = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int64_t q_off = b * a->q_stride + kh * a->group * a->head_dim;
    const int64_t out_off = b * a->heads * a->head_dim + kh * a->group * a->head_dim;
    const int64_t *slots = a->table + b * a->table_stride;
    if (a->special != NULL)
      a->special(a->dtype, a->q, q_off, a->k_cache, a->v_cache, slots, start, len, a->kv_width,
                 kh * a->head_dim, a->scale, a->out, out_off);
    else
      attend_one((int)a->group, a->nvec, a->dtype, a->q, q_off, a->k_cache, a->v_cache, slots,
                 start, len, a->kv_width, kh * a->head_dim, a->scale, a->out, out_off);
  }
}

void paged_decode_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, const int64_t *table, int64_t table_stride,
                            const int64_t *lens, void *out, int64_t rows, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                            int threads) {
  const int64_t group = heads / kv_heads;
  const int64_t nvec = head_dim / VEC;
  attention_args a = {dtype,        q,     q_stride, k_cache,  v_cache,
                      table,        table_stride,    lens,     out,      rows,
                      heads,        group, head_dim, nvec,     kv_heads * head_dim,
                      window,       scale, special_attend(group, nvec)};
  int64_t attended = 0;
  for (int64_t b = 0; b < rows; b++) attended += lens[b];
  /* One task per (kv head, row), so that tasks are balanced by the dynamic claiming. */
  parallel_range(attention_tasks, &a, kv_heads * rows, 1, threads,
                 attended * kv_heads >= PARALLEL_MIN_ATTN);
}

/* Limits the Python side checks before calling paged_decode_attention. */
int64_t attention_max_group(void) { return MAX_GROUP; }
int64_t attention_max_head_dim(void) { return MAX_HEAD_DIM; }
int64_t attention_vec_width(void) { return VEC; }
