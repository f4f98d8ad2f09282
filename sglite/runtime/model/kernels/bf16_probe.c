/*
 * Whether AVX512-BF16 dot products pay on this CPU: the one measured fact behind the bf16
 * product paths (gguf_amx.c's vector path, and which dtype the prefill scratch GEMM runs in).
 *
 * A `vdpbf16ps` does twice the flops of a `vfmadd231ps` of the same width, and on most CPUs that
 * have it runs as fast (AMD Zen 4/5). Some do not: an Intel Xeon whose AMX is hidden (a VM) ran
 * it at a quarter of the FMA's rate, so there every bf16 product (the tile GEMM's dot products
 * and oneDNN's bf16 GEMM alike) was slower than float32. The flags cannot tell the two apart, so
 * the rates are timed once per process: twelve independent chains of each instruction, a few
 * thousand rounds (tens of microseconds), best of three, alternated.
 *
 * Invariant: the answer is computed once per process (pthread_once) and never changes.
 * SGLITE_BF16_DOT=0 or =1 in the environment decides instead of the timing.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__x86_64__)
#define PROBE_ROUNDS 4096

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define TWELVE(op)                                                                            \
  op " %%zmm12, %%zmm13, %%zmm0\n\t" op " %%zmm12, %%zmm13, %%zmm1\n\t" op                    \
     " %%zmm12, %%zmm13, %%zmm2\n\t" op " %%zmm12, %%zmm13, %%zmm3\n\t" op                    \
     " %%zmm12, %%zmm13, %%zmm4\n\t" op " %%zmm12, %%zmm13, %%zmm5\n\t" op                    \
     " %%zmm12, %%zmm13, %%zmm6\n\t" op " %%zmm12, %%zmm13, %%zmm7\n\t" op                    \
     " %%zmm12, %%zmm13, %%zmm8\n\t" op " %%zmm12, %%zmm13, %%zmm9\n\t" op                    \
     " %%zmm12, %%zmm13, %%zmm10\n\t" op " %%zmm12, %%zmm13, %%zmm11\n\t"
#define CLOBBERS                                                                              \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",     \
      "xmm11"

/* Seconds for PROBE_ROUNDS rounds of twelve independent instructions (the registers' values
 * are whatever they hold: throughput does not depend on them). */
static double time_dot(void) {
  const double start = seconds();
  for (int i = 0; i < PROBE_ROUNDS; i++) __asm__ volatile(TWELVE("vdpbf16ps")::: CLOBBERS);
  return seconds() - start;
}

static double time_fma(void) {
  const double start = seconds();
  for (int i = 0; i < PROBE_ROUNDS; i++) __asm__ volatile(TWELVE("vfmadd231ps")::: CLOBBERS);
  return seconds() - start;
}

static int64_t measure_percent(void) {
  double dot = 1e9, fma = 1e9;
  for (int round = 0; round < 3; round++) {
    const double d = time_dot(), f = time_fma();
    dot = d < dot ? d : dot;
    fma = f < fma ? f : fma;
  }
  return dot > 0.0 ? (int64_t)(100.0 * fma / dot + 0.5) : 0;
}
#else
static int64_t measure_percent(void) { return 0; }
#endif

static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static int64_t probe_percent = 0;
static int64_t probe_pays = 0;

static void probe(void) {
  probe_percent = measure_percent();
  const char *setting = getenv("SGLITE_BF16_DOT");
  if (setting != NULL && (strcmp(setting, "0") == 0 || strcmp(setting, "1") == 0))
    probe_pays = setting[0] == '1' && probe_percent > 0;
  else
    probe_pays = probe_percent >= BF16_DOT_PAYS_PERCENT;
}

int64_t bf16_dot_speed_percent(void) {
  pthread_once(&probe_once, probe);
  return probe_percent;
}

int64_t bf16_dot_pays(void) {
  pthread_once(&probe_once, probe);
  return probe_pays;
}
