/*
 * The C ABI of the kernels library: every function Python calls, the structs it passes and the
 * constants both sides use. native.py reads this file to declare the functions to ctypes, to
 * build the structs and to learn the constants, so the contract is written once, here.
 *
 * native.py parses a small subset of C, so declarations here keep to it: `enum { NAME = integer,
 * ... };` for constants, `typedef struct { type name, *name; ... } name_t;` for structs (fields of
 * int, int64_t, float, pointers or an earlier struct), and prototypes `ret name(type arg, ...);`
 * returning void, int or int64_t with arguments of int, int64_t, float or pointers. Functions
 * returning int answer 0 when done and -1 when they refused (the caller then uses PyTorch).
 * Conventions of the tensors they take: see common.h.
 */
#ifndef SGLITE_KERNELS_H
#define SGLITE_KERNELS_H
#include <stdint.h>

/* `dtype` arguments: the activations', weights' and KV pool's storage type. */
enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

/* Gated MLP activations (act_mul, decode_layers): ModelConfig.hidden_act. */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* Rows one quantized or dense GEMV call takes (quant_gemv.c, dense_gemv_rows). */
enum { QGEMV_MAX_ROWS = 8 };
/* float32 rows an int4 (float x) weight goes through its GEMV; from 3 rows the quantized GEMM
 * is faster (it dequantizes each weight once for all rows). */
enum { INT4_FLOAT_GEMV_MAX_ROWS = 2 };
/* float32 rows a GGUF block weight goes through gguf_gemv before the quantized GEMM. */
enum { GGUF_FLOAT_GEMV_MAX_ROWS = 2 };
/* bf16 rows from which a GGUF weight's product runs on AMX tiles where the CPU has them
 * (gguf_amx.c decodes the whole weight per call, which fewer rows' GEMVs do not repay); a
 * weight mostly of Q6_K blocks, slower to decode, from AMX_MIN_ROWS_Q6_K (gguf_amx_min_rows). */
enum { AMX_MIN_ROWS = 6, AMX_MIN_ROWS_Q6_K = 9 };
/* The same rows where gguf_amx.c multiplies with AVX512-BF16 dot products (no AMX): its
 * products cost more than the tiles', so the int8 GEMVs keep more rows. A Q6_K-mostly weight
 * of short rows (k <= SHORT_ROW_VALUES: an output head) switches at BF16_DOT_MIN_ROWS_Q6_K_SHORT:
 * the GEMV's cost per weight row and x row (its sums and store) weighs more there. */
enum { BF16_DOT_MIN_ROWS = 12, BF16_DOT_MIN_ROWS_Q6_K = 24, BF16_DOT_MIN_ROWS_Q6_K_SHORT = 14 };
enum { SHORT_ROW_VALUES = 4096 };
/* bf16_probe.c: AVX512-BF16 dot products pay where a vdpbf16ps runs at least this many percent
 * of a vfmadd231ps's rate (at 50 it does as many flops: twice the flops per instruction). Where
 * they do not (and there is no AMX), no weight goes to gguf_amx.c (gguf_amx_min_rows returns
 * KERNEL_OFF_ROWS) and the prefill scratch GEMM runs in float32. KERNEL_OFF_ROWS: a row count
 * no batch reaches, the threshold of a kernel that does not serve a weight here. */
enum { BF16_DOT_PAYS_PERCENT = 50, KERNEL_OFF_ROWS = 1073741824 };
/* Rows of x the int8 GEMV (gguf_a8.c) takes together: each weight block is decoded once for
 * a group of them, so a product of A8_ROWS + 1 rows decodes every block twice. */
enum { A8_ROWS = 4 };
/* Rows from which a batch rounding activations takes gguf_gemm_a8 instead of gguf_gemv_a8
 * (where the tile GEMM does not take it first; never in deterministic mode, whose products keep
 * one kernel for every row count): A8_GEMM_MIN_ROWS_Q6_K for a weight mostly of Q6_K blocks,
 * slower to decode (gguf_a8_gemm_min_rows). Measured on an Intel host without AMX, per weight
 * (bench_products) and in whole decode passes (bench_pass_rows; docs/benchmarks.md). */
enum { A8_GEMM_MIN_ROWS = 3, A8_GEMM_MIN_ROWS_Q6_K = 5 };
/* The thresholds where the CPU runs 512-bit operations as two halves (vectors_512_split: AMD
 * Zen 4), measured there per kind of weight (docs/benchmarks.md). There the
 * GEMV reads k-quant rows longer than SHORT_ROW_BYTES as one stream (gguf_a8.c), and the GEMM
 * takes those weights from A8_GEMM_MIN_ROWS_LONG_SPLIT rows; shorter rows from
 * A8_GEMM_MIN_ROWS_SPLIT (A8_GEMM_MIN_ROWS_Q6_K_SPLIT mostly of Q6_K), blocks of 32 from
 * A8_GEMM_MIN_ROWS_B32_SPLIT. */
enum {
  A8_GEMM_MIN_ROWS_SPLIT = 4,
  A8_GEMM_MIN_ROWS_Q6_K_SPLIT = 5,
  A8_GEMM_MIN_ROWS_LONG_SPLIT = 3,
  A8_GEMM_MIN_ROWS_B32_SPLIT = 5
};
/* Bytes of a weight row up to which a thread of the int8 GEMV reads its rows as two streams
 * where 512-bit operations run as two halves (one stream past it: gguf_a8.c's row_streams). */
enum { SHORT_ROW_BYTES = 2048 };
/* Rows decode_layers takes (quantized layers in bf16: at most QGEMV_MAX_ROWS; the caller picks). */
enum { NATIVE_MAX_ROWS = 256 };

/* Tokens per range of a row's context in decode attention (paged_decode_attention). */
enum { ATTENTION_SPAN = 256 };

/* quant_gemm's weight formats (QUANT_GEMM_GGUF: `weight` is a gguf_part_t array). */
enum { QUANT_GEMM_INT8 = 1, QUANT_GEMM_INT4 = 2, QUANT_GEMM_Q8_0 = 3, QUANT_GEMM_GGUF = 4 };

/* GGUF's quantized block types the kernels read as stored (ggml's type ids; gguf_blocks.c). */
enum {
  GGML_TYPE_Q4_0 = 2,
  GGML_TYPE_Q4_1 = 3,
  GGML_TYPE_Q5_0 = 6,
  GGML_TYPE_Q5_1 = 7,
  GGML_TYPE_Q8_0 = 8,
  GGML_TYPE_Q4_K = 12,
  GGML_TYPE_Q5_K = 13,
  GGML_TYPE_Q6_K = 14
};
/* Part types of ours, not ggml's: Q5_0, Q8_0, Q4_K or Q6_K rows tiled 16 at a time (gguf_tiles.h),
 * GGUF_TILED_BASE plus ggml's type, which only gguf_gemm_a8 multiplies (every other product
 * kernel refuses such a part; gguf_dequantize reads its rows). */
enum {
  GGUF_TILED_BASE = 1000,
  GGUF_TILED_Q5_0 = 1006,
  GGUF_TILED_Q8_0 = 1008,
  GGUF_TILED_Q4_K = 1012,
  GGUF_TILED_Q6_K = 1014,
  GGUF_TILE_ROWS = 16 /* rows per tile */
};
/* A part type of ours: Q5_0 rows in quads, four blocks of 32 at a time (gguf_quads.h), for the
 * int8 GEMV on AVX2 builds without VNNI; the VNNI GEMM and the tile GEMM refuse such a part. */
enum { GGUF_QUADS_Q5_0 = 900 };
/* Row ranges of one GGUF weight (a fused projection's parts, each in its own type). */
enum { GGUF_MAX_PARTS = 4 };

/* One row range of a GGUF weight [n_out, k]: `rows` rows of `type` blocks at `data` (row after
 * row, gguf_row_bytes(type, k) each). A weight is an array of these, in row order, whose rows
 * add up to n_out (at most GGUF_MAX_PARTS). */
typedef struct {
  int64_t type;
  int64_t rows;
  const void *data;
} gguf_part_t;

/* A projection's weight format in the decode step (linear_t.kind). */
enum {
  LINEAR_DENSE = 0,   /* [n_out, k] in the activation dtype */
  LINEAR_INT8 = 1,    /* int8 values, a float32 scale per output row */
  LINEAR_INT4 = 2,    /* GGUF Q4_1 nibbles, f16 (scale, offset) per 32 inputs */
  LINEAR_PANELS = 3,  /* float32 in panel_gemm's panels */
  LINEAR_INT4_A8 = 4, /* LINEAR_INT4 whose GEMVs round x to int8 (w4a8) */
  LINEAR_Q8_0 = 5,    /* GGUF Q8_0: int8 values, an f16 scale per 32 inputs */
  LINEAR_GGUF = 6,    /* GGUF blocks as the file stores them: weight is a gguf_part_t array */
  LINEAR_GGUF_A8 = 7  /* LINEAR_GGUF whose products round x to int8 (gguf_gemv_a8), any rows */
};

typedef struct {
  int64_t kind; /* LINEAR_* */
  int64_t n_out, k;
  const void *weight; /* dense: [n_out, k] dtype; int8 and q8_0: int8 values; int4: packed
                         nibbles; panels: float32 as panel_gemm reads them; gguf: parts */
  const void *scale;  /* int8: float32 [n_out]; int4: f16 (scale, offset) pairs; q8_0: f16
                         [n_out, k / 32]; else NULL */
  const void *bias;   /* dtype [n_out] or NULL */
  int64_t amx_min_rows; /* gguf kinds: bf16 rows from which AMX tiles take it (at load:
                           gguf_amx_min_rows); else unused */
  int64_t a8_gemm_min_rows; /* LINEAR_GGUF_A8: rows from which gguf_gemm_a8 takes it (at load:
                               gguf_a8_gemm_min_rows); else unused */
} linear_t;

typedef struct {
  const void *input_norm, *post_norm; /* dtype [hidden]: before attention, before the MLP */
  const void *attn_out_norm, *mlp_out_norm; /* dtype [hidden] on the attention / MLP output,
                                               or NULL (only Gemma 3 has them) */
  const void *q_norm, *k_norm;              /* dtype [head_dim] per-head norms, or NULL */
  linear_t qkv, o, gate_up, down;
  void *k_cache, *v_cache; /* [slots, kv_heads, head_dim] dtype */
  int64_t window;          /* sliding window, 0 = full attention */
  int64_t rope;            /* the RoPE table pair it rotates with: 0 global, 1 local */
} layer_t;

/* Instruction-set extensions a build uses (kernel_isa's bits). */
enum {
  ISA_AVX2_FMA = 1,
  ISA_F16C = 2,
  ISA_AVX512 = 4,
  ISA_AVX512_BF16 = 8,
  ISA_AVX512_VNNI = 16,
  ISA_NEON = 32,
  ISA_AMX = 64 /* AMX tiles with bf16 (gguf_amx.c) */
};

/* build_info.c: the ISA_* bits this build was compiled with. */
int64_t kernel_isa(void);

/* elementwise.c */
void add_rms_norm(int dtype, const void *x, void *residual, const void *weight, void *out,
                  int64_t rows, int64_t dim, float eps, int threads);
void act_mul(int dtype, int act, const void *gate_up, void *out, int64_t rows, int64_t inter,
             int threads);
void head_rms_norm(int dtype, void *qkv, int64_t tokens, int64_t width, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, const void *q_weight, const void *k_weight,
                   float eps, int threads);
void rope_store_kv(int dtype, void *qkv, int64_t tokens, int64_t heads, int64_t kv_heads,
                   int64_t head_dim, const int64_t *positions, const float *cos_table,
                   const float *sin_table, void *k_cache, void *v_cache,
                   const int64_t *out_slots, int threads);
void row_max(const float *x, int64_t rows, int64_t n, float *values, int64_t *indices);

/* attention.c, extend_attention.c */
/* A row's context is cut into ranges of ATTENTION_SPAN tokens from its start, whatever the
 * batch and thread count (the ranges are the parallel tasks), and the ranges' softmax states
 * merged in order, so each row's output depends on its own query and context only. Returns -1
 * when the ranges' scratch cannot be allocated. */
int paged_decode_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, const int64_t *table, int64_t table_stride,
                           const int64_t *lens, void *out, int64_t rows, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, float scale, int64_t window,
                           int threads);
int extend_attention(int dtype, const void *q, int64_t q_stride, const void *k_cache,
                     const void *v_cache, const int64_t *slots, const int64_t *slot_off,
                     const int64_t *q_start, const int64_t *prefix, const int64_t *ext,
                     int64_t num_seqs, void *out, int64_t heads, int64_t kv_heads, int64_t dim,
                     float scale, int64_t window, int threads);
/* Limits the attention kernels were built with (they depend on the vector width). */
int64_t attention_max_group(void);
int64_t attention_max_head_dim(void);
int64_t attention_vec_width(void);
int64_t attention_max_heads(void);

/* quant_gemv.c */
int int8_gemv(int dtype, const void *x, const int8_t *q, const float *scale, void *y,
              int64_t rows, int64_t n_out, int64_t k, int threads);
int int4_gemv(int dtype, const void *x, const uint8_t *packed, const uint16_t *scale_offset,
              void *y, int64_t rows, int64_t n_out, int64_t k, int threads, int round_x);
int q8_gemv(int dtype, const void *x, const int8_t *q, const uint16_t *scales, void *y,
            int64_t rows, int64_t n_out, int64_t k, int threads);
void int4_dequantize(int dtype, const uint8_t *packed, const uint16_t *scale_offset, void *out,
                     int64_t n_out, int64_t k, int threads);

/* gguf_blocks.c. gguf_row_bytes: bytes of a row of k values of `type`, -1 when unsupported or
 * k is not whole blocks. gguf_gemv: y [rows, n_out] = x W^T for rows <= QGEMV_MAX_ROWS, x kept
 * in float32. gguf_dequantize: out[i] = row ids[i] of W (ids NULL: row i, for i < n_ids) in
 * dtype. Both return -1 for parts that do not cover n_out rows of supported types. */
int64_t gguf_row_bytes(int64_t type, int64_t k);
int gguf_gemv(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
              int64_t n_out, int64_t k, int threads);
int gguf_dequantize(int dtype, const gguf_part_t *parts, const int64_t *ids, int64_t n_ids,
                    int64_t n_out, int64_t k, void *out, int threads);

/* gguf_a8.c: y [rows, n_out] = x W^T for any rows, x rounded to int8 per span of 256 values
 * (32 when k is not whole super-blocks) as llama.cpp rounds it; each row's result depends on
 * that row alone, and with `row_independent` is the same bits whatever the row count (else a
 * row computed beside others may differ in float rounding: a faster path for several rows).
 * -1 for parts that do not cover n_out rows of supported types. */
int gguf_gemv_a8(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                 int64_t n_out, int64_t k, int threads, int row_independent);
/* gguf_a8_gemm.c: the same product for many rows with 512-bit VNNI (AVX512-VNNI builds): each
 * Q4_K / Q6_K super-block (or two blocks of 32 of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) of 16 weight
 * rows decoded once for every x row, x rounded as gguf_gemv_a8 rounds it (values equal to its to
 * float rounding; each row's result depends on that row alone). -1 where the build lacks
 * VNNI-512, k is not whole decoding units (256 values for the k-quants, 64 for blocks of 32), or
 * a part is of another type (Q5_K) or not in whole blocks of 16 rows. */
int gguf_gemm_a8(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                 int64_t n_out, int64_t k, int threads);
/* Its gated form for a fused [gate; up] weight of n_out rows (n_out / 2 a multiple of 16), act
 * = ACT_SILU or ACT_GELU_TANH: y [rows, n_out / 2] = act(x G^T) * (x U^T), equal bit for bit to
 * gguf_gemm_a8 followed by act_mul (gate and up rounded to dtype first), without the
 * [rows, n_out] product in memory. -1 where gguf_gemm_a8 would refuse, or n_out does not fit. */
int gguf_gemm_a8_glu(int dtype, int act, const void *x, const gguf_part_t *parts, void *y,
                     int64_t rows, int64_t n_out, int64_t k, int threads);
/* gguf_tiles.c: rows [rows, k] of `type` blocks (Q5_0, Q8_0, Q4_K or Q6_K) at src tiled into dst (the
 * same bytes) for gguf_gemm_a8 as a part of type GGUF_TILED_BASE + type, 16 rows at a time on
 * up to `threads` threads. -1 for another type, unless rows is a multiple of 16 and k of the
 * type's block. */
int gguf_tile(int64_t type, const void *src, void *dst, int64_t rows, int64_t k, int threads);
/* gguf_quads.c: rows [rows, k] of Q5_0 blocks at src in quads into dst (the same bytes; dst may
 * be src: the weight arena lays each piece out as it reads it, on its own threads). -1 unless k
 * is a multiple of 128. */
int gguf_quad_q5_0(const void *src, void *dst, int64_t rows, int64_t k);
/* Whether this build's int8 GEMV reads Q5_0 in quads faster than in the file's rows (AVX2
 * without AVX-512 VNNI: its products there are bound by the vector units' work per block). */
int gguf_quads_pay(void);
/* The rows from which a weight of these parts takes gguf_gemm_a8 (1 with a tiled part, the
 * GEMM being its only kernel; else A8_GEMM_MIN_ROWS, or
 * A8_GEMM_MIN_ROWS_Q6_K when Q6_K parts hold most of its rows; the _SPLIT pair where
 * vectors_512_split); KERNEL_OFF_ROWS where
 * gguf_gemm_a8 cannot serve it (no VNNI-512 build, k or the parts not as it reads them). */
int64_t gguf_a8_gemm_min_rows(const gguf_part_t *parts, int64_t n_out, int64_t k);

/* gguf_amx.c: y [rows, n_out] = x W^T for bf16 x on AMX tiles, or with AVX512-BF16 dot
 * products where the CPU has no AMX (the weight decoded to bf16 a block of rows at a time,
 * sums in float32, each row's result independent of the others). -1 where the build has
 * neither, x is not bf16, k is not a multiple of 32 or its buffers cannot be allocated.
 * amx_gemm_available: 1 when it runs on AMX tiles here (an AMX build, CPU and OS permission);
 * tile_gemm_available: 1 when it runs here at all. */
int gguf_gemm_amx(int dtype, const void *x, const gguf_part_t *parts, void *y, int64_t rows,
                  int64_t n_out, int64_t k, int threads);
int64_t amx_gemm_available(void);
int64_t tile_gemm_available(void);
/* bf16_probe.c: a vdpbf16ps's measured rate in percent of a vfmadd231ps's (0 where the build has
 * no AVX512-BF16), timed once per process; bf16_dot_pays: 1 when that is at least
 * BF16_DOT_PAYS_PERCENT (SGLITE_BF16_DOT=0/1 in the environment decides instead). */
int64_t bf16_dot_speed_percent(void);
int64_t bf16_dot_pays(void);
/* cpu_kind.c: 1 where the CPU runs a 512-bit vector operation as two 256-bit halves (AMD Zen 4),
 * read from CPUID once (SGLITE_VECTORS_512_SPLIT=0/1 decides instead); 0 elsewhere (Intel, AMD
 * Zen 5, other architectures). There gguf_gemv_a8 takes the k-quants' 256-bit path and reads
 * a thread's rows as one stream. */
int64_t vectors_512_split(void);
/* gguf_amx.c: y [rows, n_out / 2] = act(x G^T) * (x U^T) for a weight [G; U] of n_out rows
 * (a multiple of 32), act = ACT_SILU or ACT_GELU_TANH: gguf_gemm_amx's product with act_mul's
 * arithmetic on its bf16-rounded halves, bit for bit, without the [rows, n_out] intermediate.
 * -1 where gguf_gemm_amx would refuse, or for another act or n_out. */
int gguf_gemm_amx_glu(int dtype, int act, const void *x, const gguf_part_t *parts, void *y,
                      int64_t rows, int64_t n_out, int64_t k, int threads);
/* The bf16 rows from which a weight of these parts (rows of k values) goes to gguf_gemm_amx:
 * AMX_MIN_ROWS_Q6_K when Q6_K parts hold most of its rows, else AMX_MIN_ROWS
 * (BF16_DOT_MIN_ROWS_Q6_K, _Q6_K_SHORT for short rows, and BF16_DOT_MIN_ROWS without AMX);
 * KERNEL_OFF_ROWS where neither AMX nor bf16 dot products pay here (bf16_dot_pays). */
int64_t gguf_amx_min_rows(const gguf_part_t *parts, int64_t n_out, int64_t k);

/* quant_gemm.c, panel_gemm.c. quant_gemm with row_independent != 0 never takes its panel path
 * (used from GEMM_PANEL_MIN_ROWS rows, whose tiles sum over k in another order), so a row's
 * result is the same whatever the row count (deterministic mode). */
int quant_gemm(int kind, const float *x, const void *weight, const void *scale,
               const float *bias, float *y, int64_t rows, int64_t n_out, int64_t k, int threads,
               int row_independent);
void panel_gemm(const float *x, const float *panels, const float *bias, float *y, int64_t rows,
                int64_t n_out, int64_t k, int threads);
/* Output columns per panel (the vector width it was built with). */
int64_t panel_width(void);

/* decode_step.c */
int dense_gemv_rows(int dtype, const void *x, const void *w, void *y, int64_t rows, int64_t n_out,
                    int64_t k, int threads);
/* deterministic != 0: every row's result depends on its own token and context only (not on
 * the other rows, their number or the thread count): float32 quantized projections always take
 * quant_gemm (whose rows are independent), attention in its fixed ranges (ATTENTION_SPAN). */
int decode_layers(int dtype, int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, int64_t inter, int act, float eps, float attn_scale,
                  int64_t n_layers, const layer_t *layers, void *residual,
                  const int64_t *positions, const float *cos0, const float *sin0,
                  const float *cos1, const float *sin1, const int64_t *out_slots,
                  const int64_t *table, int64_t table_stride, const int64_t *lens, int threads,
                  int deterministic);

#endif
