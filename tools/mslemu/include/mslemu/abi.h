/* mslemu C ABI: what a generated kernel library (kernels.so) exports.  Plain C, so a
 * host (Python ctypes, the vllm-metal C++ runtime via dlopen/dlsym) can include it
 * without the emulator's fiber runtime.
 *
 *   int mslemu_dispatch(const char *name, const mslemu_launch *L);
 *   int mslemu_dispatch_fc(const char *name, const mslemu_launch *L,
 *                          const mslemu_function_constant *fc, uint32_t n_fc);
 *   int mslemu_set_function_constant(const char *idx, const void *v, unsigned long n);
 *   const char *mslemu_kernel_name(int i);   // i-th host name (sorted), NULL past the end
 *   const char *mslemu_last_error(void);     // message of the calling thread's last failure
 *
 * Return codes: 0 ok; MSLEMU_E_NO_KERNEL unknown kernel name or function-constant index;
 * MSLEMU_E_FC_SIZE wrong function-constant size; MSLEMU_E_LAUNCH invalid launch (more
 * than 1024 threads per threadgroup, NULL arrays, threadgroup memory over 32 KiB under
 * MSLEMU_STRICT); MSLEMU_E_KERNEL the kernel failed (MSLEMU_STRICT violation, unbound
 * buffer or threadgroup memory, threadgroup variables over the limit; in checked builds an
 * out-of-bounds access or a race).  A failed dispatch
 * abandons the remaining threadgroups, so outputs are partially written.  Out-of-bounds
 * accesses are detected only by checked builds (include/mslemu/checks.h, which also find
 * races); elsewhere they corrupt memory or crash the process as on a CPU.
 *
 * Grid and threadgroup sizes of 0 are treated as 1 (a zero-initialised y/z is fine);
 * skip empty dispatches on the host.
 *
 * Threading contract: every entry point may be called from any host thread.  One mutex
 * per library serialises them: a dispatch runs alone (it already uses every core through
 * its own worker threads) and never sees a half-written function constant.  Function
 * constants are library-global state, like a pipeline specialised at creation, and
 * set_function_constant followed by dispatch is two calls: a host that dispatches with
 * different constant values from several threads must use mslemu_dispatch_fc, which sets
 * the constants and dispatches under one hold of the lock.  Buffers are the caller's:
 * two dispatches writing the same memory are the caller's race, as on a GPU.
 */
#ifndef MSLEMU_ABI_H
#define MSLEMU_ABI_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mslemu_launch {
  void *const *buffers;         /* [[buffer(i)]] -> buffers[i] (NULL: unbound) */
  const uint64_t *buffer_sizes; /* bytes (informational, may be NULL) */
  uint32_t n_buffers;
  const uint64_t *tg_mem_len;   /* [[threadgroup(i)]] dynamic sizes in bytes */
  uint32_t n_tg_mem;
  uint32_t grid[3];             /* threadgroups per grid (dispatchThreadgroups) or */
                                /* threads per grid (dispatchThreads, nonuniform=1) */
  uint32_t tg[3];               /* threads per threadgroup */
  uint32_t nonuniform;          /* 1: grid is in threads (dispatchThreads) */
  uint32_t n_workers;           /* 0 = auto (MSLEMU_THREADS or hw concurrency) */
} mslemu_launch;

/* One function-constant value for mslemu_dispatch_fc: index as written in
 * [[function_constant(index)]] (decimal string), value bytes of exactly the constant's size. */
typedef struct mslemu_function_constant {
  const char *index;
  const void *value;
  unsigned long size;
} mslemu_function_constant;

/* Counting builds only (Library(..., accounting=True), -DMSLEMU_ACCOUNTING): what the
 * library's last dispatch did, from every load and store of the compiled
 * kernel (clang's address-sanitizer instrumentation calls back into the runtime).
 * "Unique" counts each byte once per launch; "tg_unique" once per threadgroup, summed
 * over threadgroups (a DRAM estimate for caches that serve one threadgroup).  simdgroup
 * matrix loads/stores count once per simdgroup, not once per lane.
 *   const mslemu_counts *mslemu_last_counts(void);   (dlsym it; NULL in normal builds) */
#define MSLEMU_MAX_COUNTED_BUFFERS 32
typedef struct mslemu_buffer_counts {
  uint64_t read, written;                       /* bytes, every access of every thread */
  uint64_t read_unique, written_unique;         /* distinct bytes over the launch */
  uint64_t read_tg_unique, written_tg_unique;   /* distinct bytes per threadgroup, summed */
  uint64_t read_simd, written_simd;             /* like read/written, but lanes of a simdgroup
                                                   loading the same address in the same (n-th)
                                                   access count once: a broadcast */
  uint64_t lane_loads, lane_load_slots;         /* lane utilisation: loads summed over lanes, and
                                                   per simdgroup 32 x its busiest lane's loads,
                                                   summed (equal: no lane waited on a sibling) */
} mslemu_buffer_counts;

typedef struct mslemu_counts {
  uint64_t threads, threadgroups, simdgroups;
  uint64_t threadgroup_memory;    /* bytes, largest threadgroup: variables + [[threadgroup(i)]] */
  uint64_t threadgroup_read, threadgroup_written;  /* bytes through threadgroup memory */
  uint64_t barriers;              /* threadgroup_barrier calls, summed over threads */
  uint64_t simd_ops;              /* simd_* collectives + simdgroup_barrier, summed over threads */
  uint64_t matrix_loads, matrix_stores;  /* simdgroup_load/store, per simdgroup */
  uint64_t matrix_macs;           /* simdgroup_multiply(_accumulate): M*N*K per call per simdgroup */
  uint32_t n_buffers;
  uint32_t pad_;
  mslemu_buffer_counts buffers[MSLEMU_MAX_COUNTED_BUFFERS];
  uint64_t uneven_simdgroups;     /* simdgroups whose lanes did not all load a buffer equally often */
} mslemu_counts;
typedef const mslemu_counts *(*mslemu_last_counts_fn)(void);

#define MSLEMU_E_NO_KERNEL (-1)
#define MSLEMU_E_FC_SIZE (-2)
#define MSLEMU_E_LAUNCH (-3)
#define MSLEMU_E_KERNEL (-4)

/* dlsym targets */
typedef int (*mslemu_dispatch_fn)(const char *name, const mslemu_launch *L);
typedef int (*mslemu_dispatch_fc_fn)(const char *name, const mslemu_launch *L,
                                     const mslemu_function_constant *fc, uint32_t n_fc);
typedef int (*mslemu_set_function_constant_fn)(const char *idx, const void *v, unsigned long n);
typedef const char *(*mslemu_kernel_name_fn)(int i);
typedef const char *(*mslemu_last_error_fn)(void);

#ifdef __cplusplus
}
#endif
#endif /* MSLEMU_ABI_H */
