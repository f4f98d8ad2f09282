/* What this build of the library was compiled for, so the server and the benchmarks can say
 * which path ran (kernels.h's ISA_* bits). */
#include "common.h"

int64_t kernel_isa(void) {
  int64_t bits = 0;
#if defined(__AVX2__) && defined(__FMA__)
  bits |= ISA_AVX2_FMA;
#endif
#ifdef __F16C__
  bits |= ISA_F16C;
#endif
#ifdef __AVX512F__
  bits |= ISA_AVX512;
#endif
#ifdef __AVX512BF16__
  bits |= ISA_AVX512_BF16;
#endif
#ifdef __AVX512VNNI__
  bits |= ISA_AVX512_VNNI;
#endif
#ifdef SGLITE_AMX
  bits |= ISA_AMX;
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
  bits |= ISA_NEON;
#endif
  return bits;
}
