/*
 * Whether this CPU runs 512-bit vector instructions as two 256-bit halves: the fact behind the
 * int8 kernels' row thresholds (gguf_a8_gemm_min_rows). AMD Zen 4 (family 0x19 with AVX-512)
 * issues a 512-bit operation over two cycles of its 256-bit units, so the VNNI GEMM's
 * transposes and shuffles cost twice what they cost on Intel's 512-bit units, and the GEMV
 * keeps more rows before the GEMM pays; Zen 5 (family 0x1a) and Intel run them whole.
 *
 * Invariant: read from CPUID once per process (pthread_once); it never changes.
 * SGLITE_VECTORS_512_SPLIT=0 or =1 in the environment decides instead (tests run both paths on
 * any x86 host).
 */
#include "kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static int64_t read_cpuid(void) {
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return 0;
  char vendor[13];
  memcpy(vendor, &ebx, 4);
  memcpy(vendor + 4, &edx, 4);
  memcpy(vendor + 8, &ecx, 4);
  vendor[12] = '\0';
  if (strcmp(vendor, "AuthenticAMD") != 0 || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  const unsigned int base = (eax >> 8) & 0xf;
  const unsigned int family = base == 0xf ? base + ((eax >> 20) & 0xff) : base;
  return family == 0x19;
}

/* CPUID traps to the hypervisor in a VM (microseconds): read once, for a kernel's every call. */
static pthread_once_t split_once = PTHREAD_ONCE_INIT;
static int64_t split = 0;

static void read_split(void) {
  const char *setting = getenv("SGLITE_VECTORS_512_SPLIT");
  if (setting != NULL && (strcmp(setting, "0") == 0 || strcmp(setting, "1") == 0))
    split = setting[0] == '1';
  else
    split = read_cpuid();
}

int64_t vectors_512_split(void) {
  pthread_once(&split_once, read_split);
  return split;
}
#else
int64_t vectors_512_split(void) { return 0; }
#endif
