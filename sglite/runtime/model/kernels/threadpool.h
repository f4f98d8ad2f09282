/* Work sharing for the kernels (see threadpool.c for why not OpenMP). */
#ifndef SGLITE_KERNELS_THREADPOOL_H
#define SGLITE_KERNELS_THREADPOOL_H
#include <stdint.h>

typedef void (*chunk_fn)(void *ctx, int64_t chunk);

/* Run fn(ctx, c) for every c in [0, n_chunks) on up to `threads` threads (the caller is one of
 * them) and return when all are done. Calls from several threads at once are safe: a call that
 * finds the pool busy runs its chunks on the calling thread. */
void parallel_chunks(chunk_fn fn, void *ctx, int64_t n_chunks, int threads);

#endif
