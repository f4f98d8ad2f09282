/*
 * A small work-sharing thread pool for the kernels, in place of OpenMP's parallel regions.
 *
 * Why: an OpenMP region ends at a barrier that waits for every thread of the team. When another
 * process holds a core, the thread that lost it checks in one scheduler time slice late, and a
 * decode step runs hundreds of regions, so a busy neighbour can add hundreds of time slices to
 * one step. Here a job is a number of chunks claimed one at a time from a shared counter; the
 * calling thread claims chunks too and returns once every *claimed* chunk is done, so a worker
 * that is not running simply takes no chunks and costs nothing.
 *
 * Protocol: `claim` packs (generation << 32 | next chunk). The caller writes the job into the
 * slot of the next generation (two slots, alternating), resets `done`, then publishes the
 * generation with `next = 0`. A thread executes chunk c of generation g only after a CAS moved
 * claim from (g, c) to (g, c + 1); while g is current its slot cannot change (the caller only
 * rewrites it for g + 2, after g + 1 completed), so job fields read between loading `claim` and
 * that CAS are g's whenever the CAS succeeds. Idle workers spin briefly, then sleep on a futex.
 */
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define MAX_WORKERS 63
/* Polling rounds before a worker sleeps: enough to span the gap between a decode step's
 * back-to-back regions, few enough not to hold a core a neighbour needs for long. */
#define SPIN_ROUNDS 2000

typedef struct {
  chunk_fn fn;
  void *ctx;
  int64_t n_chunks;
  int active; /* workers with index < active take part */
} job_t;

static struct {
  pthread_mutex_t lock; /* guards worker creation */
  pthread_mutex_t busy; /* held by the thread whose job the pool runs */
  int workers;
  _Atomic uint64_t claim;
  _Atomic int64_t done;
  _Atomic uint32_t generation; /* futex word: bumped with every job */
  _Atomic int sleepers;
  job_t slots[2];
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .busy = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static void futex_wait(_Atomic uint32_t *word, uint32_t seen) {
#ifdef __linux__
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
  (void)word;
  (void)seen;
  sched_yield();
#endif
}

static void futex_wake_all(_Atomic uint32_t *word) {
#ifdef __linux__
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, MAX_WORKERS, NULL, NULL, 0);
#else
  (void)word;
#endif
}

/* Claim and run chunks of generation `gen` until none are left. `worker` = -1 for the caller. */
static void work_on(uint32_t gen, int worker) {
  for (;;) {
    uint64_t c = atomic_load_explicit(&pool.claim, memory_order_acquire);
    if ((uint32_t)(c >> 32) != gen) return;
    const job_t *job = &pool.slots[gen & 1];
    const chunk_fn fn = job->fn;
    void *ctx = job->ctx;
    const int64_t n = job->n_chunks;
    if (worker >= job->active) return;
    const uint32_t next = (uint32_t)c;
    if ((int64_t)next >= n) return;
    if (!atomic_compare_exchange_weak_explicit(&pool.claim, &c, c + 1, memory_order_acq_rel,
                                               memory_order_acquire))
      continue;
    fn(ctx, (int64_t)next);
    atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
  }
}

static void *worker_main(void *arg) {
  const int index = (int)(intptr_t)arg;
  uint32_t seen = atomic_load(&pool.generation);
  for (;;) {
    uint32_t gen = atomic_load_explicit(&pool.generation, memory_order_acquire);
    for (int spin = 0; gen == seen && spin < SPIN_ROUNDS; spin++) {
      cpu_relax();
      gen = atomic_load_explicit(&pool.generation, memory_order_acquire);
    }
    if (gen == seen) {
      atomic_fetch_add(&pool.sleepers, 1);
      futex_wait(&pool.generation, seen);
      atomic_fetch_sub(&pool.sleepers, 1);
      continue;
    }
    seen = gen;
    work_on(gen, index);
  }
  return NULL;
}

static void ensure_workers(int wanted) {
  if (wanted > MAX_WORKERS) wanted = MAX_WORKERS;
  if (pool.workers >= wanted) return;
  pthread_mutex_lock(&pool.lock);
  while (pool.workers < wanted) {
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)pool.workers) != 0) {
      pthread_attr_destroy(&attr);
      break;
    }
    pthread_attr_destroy(&attr);
    pool.workers++;
  }
  pthread_mutex_unlock(&pool.lock);
}

void parallel_chunks(chunk_fn fn, void *ctx, int64_t n_chunks, int threads) {
  if (n_chunks <= 0) return;
  if (threads <= 1 || n_chunks == 1 || pthread_mutex_trylock(&pool.busy) != 0) {
    for (int64_t c = 0; c < n_chunks; c++) fn(ctx, c);
    return;
  }
  ensure_workers(threads - 1);
  const uint32_t gen = atomic_load(&pool.generation) + 1;
  job_t *job = &pool.slots[gen & 1];
  job->fn = fn;
  job->ctx = ctx;
  job->n_chunks = n_chunks;
  job->active = threads - 1;
  atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
  atomic_store_explicit(&pool.claim, (uint64_t)gen << 32, memory_order_release);
  atomic_store_explicit(&pool.generation, gen, memory_order_release);
  if (atomic_load(&pool.sleepers) > 0) futex_wake_all(&pool.generation);
  work_on(gen, -1);
  while (atomic_load_explicit(&pool.done, memory_order_acquire) < n_chunks) cpu_relax();
  pthread_mutex_unlock(&pool.busy);
}
