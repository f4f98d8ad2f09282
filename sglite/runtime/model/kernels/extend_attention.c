/*
 * Causal attention of EXTEND batches (prefill, chunked prefill, multi-turn suffixes) over the
 * paged KV pool, bfloat16, with AVX512-BF16 dot products. See common.h for conventions.
 *
 * Why: attention is a large part of a long prefill, and PyTorch's CPU flash attention stays far
 * below the core's bf16 peak; this kernel keeps the work in bf16 pair dot products
 * (`vdpbf16ps`), two products per float32 lane and instruction.
 *
 * Sequence s has prefix[s] cached tokens and ext[s] new ones; its slots (prefix + new, in order)
 * are slots[slot_off[s] : slot_off[s] + prefix[s] + ext[s]] and its new tokens are rows
 * q_start[s] .. q_start[s] + ext[s] - 1 of q and out. New token i sits at position prefix + i
 * and sees keys 0 .. prefix + i (and, with a sliding window, only the last `window` of them).
 * This pass's K/V are already in the pool (rope_store_kv runs first), so every key is read from
 * the pool through the slot list; nothing is gathered or copied per layer.
 *
 * A task is (sequence, kv head, block of tokens): its query rows are the block's tokens times
 * the kv head's `group` query heads (row r = token r / group, head r % group), up to XA_ROWS.
 * Keys go in blocks of XA_KEYS with an online softmax (flash attention):
 *   scores  S[n][r] = q_r . k_n      rows in vector lanes: the row max and sum are vertical ops,
 *                                    and k_n's pairs are broadcast straight from the pool;
 *   probs   P = exp(S * scale - m)   rounded to bf16, pairs of keys interleaved per row;
 *   output  O[r][:] += P[r][n] v_n   head dims in lanes, V pairs of keys interleaved per dim.
 */
#include "common.h"

#define XA_LANES 16
#define XA_MAX_MV 6 /* query rows per task, in vectors of 16 */
#define XA_ROWS (XA_MAX_MV * XA_LANES)
#define XA_KEYS 32 /* keys per block (even) */
#define XA_MAX_DIM 128
#define XA_NEG (-1e30f) /* masked score: finite, so a fully masked block gives no NaN */

typedef struct {
  const uint16_t *q;
  int64_t q_stride;
  const uint16_t *k_cache, *v_cache;
  const int64_t *slots, *slot_off, *q_start, *prefix, *ext;
  uint16_t *out;
  int64_t heads, kv_heads, group, dim, window;
  float scale;
  int64_t tokens_per_task;
  const int64_t *tasks; /* per task: sequence, kv head, first token (of the sequence's new) */
} xattn_args;

#if defined(__AVX512BF16__)

static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

/* A bf16 pair read as one 32-bit word from 2-byte aligned memory. */
typedef int32_t pair_t __attribute__((aligned(2), may_alias));

/*
 * S[n][r] = sum_d Q[r][d] K[n][d] for keys n < nk (rows in MV vectors of lanes). qp holds the
 * query rows' bf16 pairs transposed, qp[p][r] = (Q[r][2p], Q[r][2p+1]); krow[n] points at key
 * n's head in the pool.
 */
static inline __attribute__((always_inline)) void scores_block(
    const int MV, const int32_t *qp, const uint16_t *const *krow, int64_t nk, int64_t pairs,
    float *s) {
  for (int64_t n0 = 0; n0 < nk; n0 += 4) {
    const pair_t *k[4];
    for (int i = 0; i < 4; i++) k[i] = (const pair_t *)krow[n0 + i < nk ? n0 + i : nk - 1];
    __m512 acc[4][XA_MAX_MV];
    for (int i = 0; i < 4; i++)
      for (int v = 0; v < MV; v++) acc[i][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
      __m512i qv[XA_MAX_MV];
      for (int v = 0; v < MV; v++) qv[v] = _mm512_loadu_si512(qp + p * XA_ROWS + v * XA_LANES);
      for (int i = 0; i < 4; i++) {
        const __m512bh kb = as_bh(_mm512_set1_epi32(k[i][p]));
        for (int v = 0; v < MV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], as_bh(qv[v]), kb);
      }
    }
    for (int i = 0; i < 4 && n0 + i < nk; i++)
      for (int v = 0; v < MV; v++) _mm512_storeu_ps(s + (n0 + i) * XA_ROWS + v * XA_LANES, acc[i][v]);
  }
}

/*
 * O[r][:] = O[r][:] * alpha[r] + sum_j P[r][2j..2j+1] . V[2j..2j+1][:] for rows r < rows, six
 * rows and 64 dims at a time. pp[j][r] = (P[r][2j], P[r][2j+1]); vp[j][c] = the 16 dims of
 * chunk c as (V[2j][d], V[2j+1][d]) pairs.
 */
static void values_block(const int32_t *pp, const int32_t *vp, int64_t npairs, const float *alpha,
                         float *o, int64_t rows, int64_t dim) {
  const int64_t chunks = dim / XA_LANES;
  for (int64_t r0 = 0; r0 < rows; r0 += 6) {
    const int nr = rows - r0 < 6 ? (int)(rows - r0) : 6;
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
      __m512 acc[6][4];
      for (int i = 0; i < nr; i++) {
        const __m512 a = _mm512_set1_ps(alpha[r0 + i]);
        for (int c = 0; c < 4; c++)
          acc[i][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + (r0 + i) * dim + (c0 + c) * XA_LANES));
      }
      for (int64_t j = 0; j < npairs; j++) {
        __m512bh vv[4];
        for (int c = 0; c < 4; c++)
          vv[c] = as_bh(_mm512_loadu_si512(vp + (j * chunks + c0 + c) * XA_LANES));
        for (int i = 0; i < nr; i++) {
          const __m512bh pb = as_bh(_mm512_set1_epi32(pp[j * XA_ROWS + r0 + i]));
          for (int c = 0; c < 4; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pb, vv[c]);
        }
      }
      for (int i = 0; i < nr; i++)
        for (int c = 0; c < 4; c++)
          _mm512_storeu_ps(o + (r0 + i) * dim + (c0 + c) * XA_LANES, acc[i][c]);
    }
  }
}

/* V rows 2j and 2j+1 of the block interleaved per dim: vp[j][c] as in values_block. A missing
 * odd key reads as zeros. */
static void pack_values(const uint16_t *const *vrow, int64_t nk, int64_t dim, int32_t *vp) {
  static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,
                                      37, 6, 38, 7, 39, 8,  40, 9,  41, 10, 42,
                                      11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_loadu_si512(lo_idx);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t chunks = dim / XA_LANES;
  for (int64_t j = 0; 2 * j < nk; j++) {
    const uint16_t *a = vrow[2 * j];
    const uint16_t *b = 2 * j + 1 < nk ? vrow[2 * j + 1] : NULL;
    for (int64_t c = 0; c < chunks; c += 2) {
      const __m512i va = _mm512_loadu_si512(a + c * XA_LANES);
      const __m512i vb = b ? _mm512_loadu_si512(b + c * XA_LANES) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (j * chunks + c) * XA_LANES, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(vp + (j * chunks + c + 1) * XA_LANES,
                          _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

/* Scratch of one task (heap: too big for a worker's stack). */
typedef struct {
  int32_t qp[XA_MAX_DIM / 2 * XA_ROWS];
  float s[XA_KEYS * XA_ROWS];
  int32_t pp[XA_KEYS / 2 * XA_ROWS];
  int32_t vp[XA_KEYS / 2 * XA_MAX_DIM];
  float o[XA_ROWS * XA_MAX_DIM];
  float alpha[XA_ROWS];
  const uint16_t *krow[XA_KEYS], *vrow[XA_KEYS];
} xattn_scratch;

/* Softmax update of one block for MV row vectors: scale and mask S, new running max, P = exp,
 * running sums, per-row rescale factors alpha; P written as interleaved bf16 pairs. */
static inline __attribute__((always_inline)) void softmax_block(
    const int MV, xattn_scratch *w, int64_t nk, int64_t key0, const __m512i *qpos, int masked,
    int64_t window, float scale, __m512 *m, __m512 *l) {
  static const uint16_t pair_idx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                        21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                        11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_loadu_si512(pair_idx);
  const __m512 vscale = _mm512_set1_ps(scale), neg = _mm512_set1_ps(XA_NEG);
  for (int v = 0; v < MV; v++) {
    float *col = w->s + v * XA_LANES;
    __m512 mx = m[v];
    for (int64_t n = 0; n < nk; n++) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(col + n * XA_ROWS), vscale);
      if (masked) {
        const __m512i kp = _mm512_set1_epi32((int32_t)(key0 + n));
        __mmask16 ok = _mm512_cmp_epi32_mask(kp, qpos[v], _MM_CMPINT_LE);
        if (window > 0)
          ok &= _mm512_cmp_epi32_mask(
              kp, _mm512_sub_epi32(qpos[v], _mm512_set1_epi32((int32_t)window)), _MM_CMPINT_NLE);
        x = _mm512_mask_blend_ps(ok, neg, x);
      }
      _mm512_storeu_ps(col + n * XA_ROWS, x);
      mx = _mm512_max_ps(mx, x);
    }
    const __m512 alpha = vexp(_mm512_sub_ps(m[v], mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t n = 0; n < nk; n += 2) {
      const __m512 e0 = vexp(_mm512_sub_ps(_mm512_loadu_ps(col + n * XA_ROWS), mx));
      const __m512 e1 = n + 1 < nk
                            ? vexp(_mm512_sub_ps(_mm512_loadu_ps(col + (n + 1) * XA_ROWS), mx))
                            : _mm512_setzero_ps();
      /* Low half of cvtne2ps is its second operand: words 0-15 = e0, 16-31 = e1. */
      const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
      /* The sum of the rounded weights, so each row's weights sum to exactly one. */
      const __m512 r0 = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm512_castsi512_si256(pair)), 16));
      const __m512 r1 = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pair, 1)), 16));
      sum = _mm512_add_ps(sum, _mm512_add_ps(r0, r1));
      _mm512_storeu_si512(w->pp + (n / 2) * XA_ROWS + v * XA_LANES,
                          _mm512_permutexvar_epi16(interleave, pair));
    }
    l[v] = _mm512_fmadd_ps(l[v], alpha, sum);
    m[v] = mx;
    _mm512_storeu_ps(w->alpha + v * XA_LANES, alpha);
  }
}

/* One task with MV row vectors (a compile-time constant in each specialization). */
static inline __attribute__((always_inline)) void run_task(const int MV, const xattn_args *a,
                                                           const int64_t *task, xattn_scratch *w) {
  const int64_t seq = task[0], kvh = task[1], t0 = task[2];
  const int64_t group = a->group, dim = a->dim, pairs = dim / 2;
  const int64_t ext = a->ext[seq], prefix = a->prefix[seq];
  const int64_t ntok = ext - t0 < a->tokens_per_task ? ext - t0 : a->tokens_per_task;
  const int64_t rows = ntok * group;
  const int64_t kv_width = a->kv_heads * dim;
  const int64_t *slots = a->slots + a->slot_off[seq];
  /* Query rows, transposed into pairs; rows past `rows` are zeros. */
  memset(w->qp, 0, sizeof(int32_t) * (size_t)(pairs * XA_ROWS));
  for (int64_t r = 0; r < rows; r++) {
    const pair_t *qrow = (const pair_t *)(a->q + (a->q_start[seq] + t0 + r / group) * a->q_stride +
                                            (kvh * group + r % group) * dim);
    for (int64_t p = 0; p < pairs; p++) w->qp[p * XA_ROWS + r] = qrow[p];
  }
  memset(w->o, 0, sizeof(float) * (size_t)(rows * dim));
  __m512i qpos[XA_MAX_MV];
  __m512 m[XA_MAX_MV], l[XA_MAX_MV];
  for (int v = 0; v < MV; v++) {
    int32_t pos[XA_LANES];
    for (int i = 0; i < XA_LANES; i++) {
      const int64_t r = v * XA_LANES + i;
      pos[i] = (int32_t)(prefix + t0 + (r < rows ? r / group : ntok - 1));
    }
    qpos[v] = _mm512_loadu_si512(pos);
    m[v] = _mm512_set1_ps(XA_NEG);
    l[v] = _mm512_setzero_ps();
  }
  const int64_t first_pos = prefix + t0, last_pos = prefix + t0 + ntok - 1;
  int64_t begin = 0;
  if (a->window > 0 && first_pos - a->window + 1 > 0) begin = first_pos - a->window + 1;
  begin -= begin % XA_KEYS;
  for (int64_t key0 = begin; key0 <= last_pos; key0 += XA_KEYS) {
    const int64_t nk = last_pos + 1 - key0 < XA_KEYS ? last_pos + 1 - key0 : XA_KEYS;
    for (int64_t n = 0; n < nk; n++) {
      const int64_t off = slots[key0 + n] * kv_width + kvh * dim;
      w->krow[n] = a->k_cache + off;
      w->vrow[n] = a->v_cache + off;
    }
    /* A mask only where some key is past some row's position or before its window. */
    const int masked = key0 + nk - 1 > first_pos ||
                       (a->window > 0 && key0 <= last_pos - a->window);
    scores_block(MV, w->qp, w->krow, nk, pairs, w->s);
    softmax_block(MV, w, nk, key0, qpos, masked, a->window, a->scale, m, l);
    pack_values(w->vrow, nk, dim, w->vp);
    values_block(w->pp, w->vp, (nk + 1) / 2, w->alpha, w->o, rows, dim);
  }
  float inv[XA_ROWS];
  for (int v = 0; v < MV; v++) _mm512_storeu_ps(inv + v * XA_LANES, _mm512_div_ps(_mm512_set1_ps(1.0f), l[v]));
  for (int64_t r = 0; r < rows; r++) {
    uint16_t *dst =
        a->out + (a->q_start[seq] + t0 + r / group) * a->heads * dim + (kvh * group + r % group) * dim;
    const __m512 s = _mm512_set1_ps(inv[r]);
    for (int64_t d = 0; d < dim; d += XA_LANES)
      _mm256_storeu_si256((__m256i *)(dst + d),
                          to_bf16x16(_mm512_mul_ps(s, _mm512_loadu_ps(w->o + r * dim + d))));
  }
}

static void task_range(void *p, int64_t first, int64_t last) {
  const xattn_args *a = p;
  xattn_scratch *w = aligned_alloc(64, (sizeof(xattn_scratch) + 63) / 64 * 64);
  if (w == NULL) return;
  for (int64_t t = first; t < last; t++) {
    const int64_t *task = a->tasks + 3 * t;
    const int64_t ntok = a->ext[task[0]] - task[2];
    const int64_t rows = (ntok < a->tokens_per_task ? ntok : a->tokens_per_task) * a->group;
    switch ((rows + XA_LANES - 1) / XA_LANES) {
      case 1: run_task(1, a, task, w); break;
      case 2: run_task(2, a, task, w); break;
      case 3: run_task(3, a, task, w); break;
      case 4: run_task(4, a, task, w); break;
      case 5: run_task(5, a, task, w); break;
      default: run_task(6, a, task, w); break;
    }
  }
  free(w);
}

typedef struct {
  int64_t seq, kvh, t0, work;
} task_t;

static int by_work_desc(const void *x, const void *y) {
  const task_t *a = x, *b = y;
  return (a->work < b->work) - (a->work > b->work);
}

#endif /* __AVX512BF16__ */

/*
 * Attention of every sequence's new tokens (layout in the header comment); q rows of width
 * q_stride with head h at h * dim, out [tokens, heads * dim], caches [slots, kv_heads, dim], all
 * bfloat16. Returns 0, or -1 when this build or these shapes are not supported (the caller then
 * uses its PyTorch path): bfloat16 only, dim a multiple of 64 up to XA_MAX_DIM, group <= XA_ROWS.
 */
int extend_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                     const void *v_cache, const int64_t *slots, const int64_t *slot_off,
                     const int64_t *q_start, const int64_t *prefix, const int64_t *ext,
                     int64_t num_seqs, void *out, int64_t heads, int64_t kv_heads, int64_t dim,
                     float scale, int64_t window, int threads) {
#if defined(__AVX512BF16__)
  const int64_t group = heads / kv_heads;
  if (dtype != 1 || dim % 64 != 0 || dim > XA_MAX_DIM || group > XA_ROWS || group < 1 ||
      heads != group * kv_heads)
    return -1;
  const int64_t per_task = XA_ROWS / group;
  int64_t count = 0;
  for (int64_t s = 0; s < num_seqs; s++) count += kv_heads * ((ext[s] + per_task - 1) / per_task);
  task_t *order = malloc(sizeof(task_t) * (size_t)(count ? count : 1));
  int64_t *tasks = malloc(sizeof(int64_t) * 3 * (size_t)(count ? count : 1));
  if (order == NULL || tasks == NULL) {
    free(order);
    free(tasks);
    return -1;
  }
  int64_t n = 0, work = 0;
  for (int64_t s = 0; s < num_seqs; s++)
    for (int64_t t0 = 0; t0 < ext[s]; t0 += per_task)
      for (int64_t h = 0; h < kv_heads; h++) {
        int64_t keys = prefix[s] + t0 + per_task;
        if (window > 0 && keys > window + per_task) keys = window + per_task;
        order[n++] = (task_t){s, h, t0, keys};
        work += keys;
      }
  /* Longest first, so the dynamic schedule ends with short tasks on every thread. */
  qsort(order, (size_t)n, sizeof(task_t), by_work_desc);
  for (int64_t i = 0; i < n; i++) {
    tasks[3 * i] = order[i].seq;
    tasks[3 * i + 1] = order[i].kvh;
    tasks[3 * i + 2] = order[i].t0;
  }
  free(order);
  const xattn_args a = {.q = q,
                        .q_stride = q_stride,
                        .k_cache = k_cache,
                        .v_cache = v_cache,
                        .slots = slots,
                        .slot_off = slot_off,
                        .q_start = q_start,
                        .prefix = prefix,
                        .ext = ext,
                        .out = out,
                        .heads = heads,
                        .kv_heads = kv_heads,
                        .group = group,
                        .dim = dim,
                        .window = window,
                        .scale = scale,
                        .tokens_per_task = per_task,
                        .tasks = tasks};
  const int parallel = threads > 1 && n > 1 && work * per_task >= PARALLEL_MIN_ATTN;
  parallel_range(task_range, (void *)&a, n, 1, threads, parallel);
  free(tasks);
  return 0;
#else
  (void)dtype, (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)slots;
  (void)slot_off, (void)q_start, (void)prefix, (void)ext, (void)num_seqs, (void)out;
  (void)heads, (void)kv_heads, (void)dim, (void)scale, (void)window, (void)threads;
  return -1;
#endif
}
