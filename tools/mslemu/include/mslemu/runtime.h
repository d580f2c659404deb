// mslemu runtime: cooperative fiber scheduler that executes one Metal
// threadgroup at a time per OS worker thread.  Every simulated GPU thread is
// a fiber with its own stack; threadgroup_barrier / simd_* collectives are
// cooperative yield points resolved by the scheduler.
//
// Included by metal_cpu_shim.h BEFORE any MSL keyword macro is defined.
//
// The C ABI of a generated kernel library (mslemu_launch, entry points, error codes) is
// in abi.h, which a host can include on its own.  Threading contract (details in abi.h):
// any host thread may call any entry point; one mutex per library (api_mu below) makes
// each dispatch and each function-constant write run alone; mslemu_dispatch_fc sets
// constants and dispatches under one lock hold, which is what a multi-threaded host needs.
//
// Environment (read at every dispatch): MSLEMU_THREADS, MSLEMU_STACK_KB, MSLEMU_POISON,
// MSLEMU_STRICT, MSLEMU_VERBOSE, MSLEMU_SCHEDULE (fuzzed fiber and threadgroup order).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__) && !defined(MSLEMU_UCONTEXT)
#define MSLEMU_UCONTEXT 1
#endif
#ifdef MSLEMU_UCONTEXT
#include <ucontext.h>
#endif

#include "abi.h"

namespace mslemu {

struct u3 { uint32_t x, y, z; };

// Per-simulated-thread built-in values.
struct ThreadCtx {
  u3 tpig;    // thread_position_in_grid
  u3 tgpig;   // threadgroup_position_in_grid
  u3 tpitg;   // thread_position_in_threadgroup
  u3 tptg;    // threads_per_threadgroup (actual size of this threadgroup)
  u3 dtptg;   // dispatch_threads_per_threadgroup (nominal)
  u3 tgpg;    // threadgroups_per_grid
  u3 tpg;     // threads_per_grid
  uint32_t tiitg;  // thread_index_in_threadgroup
  uint32_t sgitg;  // simdgroup_index_in_threadgroup
  uint32_t tiisg;  // thread_index_in_simdgroup
  uint32_t sgptg;  // simdgroups_per_threadgroup
};

enum class FState : uint8_t { Runnable, Barrier, Simd, Done, Aborted };

constexpr int kSimdWidth = 32;
constexpr int kSlotBytes = 64;  // max bytes exchanged per lane per collective
constexpr size_t kTgMemLimit = 32768;  // Apple GPUs: maxThreadgroupMemoryLength (checked with MSLEMU_STRICT)

struct Fiber {
  void *sp = nullptr;          // saved stack pointer (asm switch)
#ifdef MSLEMU_UCONTEXT
  ucontext_t uc;
#endif
  FState state = FState::Done;
  uint32_t lane = 0, sg = 0, tid = 0;
  uint64_t site = 0;           // call-site key of the pending sync op
  uint32_t active_mask = 0;    // participating lanes of the last collective
  uint64_t epoch = 0;          // id of the last resolved collective (result cache key)
  bool mute = false;           // accesses are the emulator's or a redundant lane's: not counted or checked
  bool in_atomic = false;      // inside an atomic_* function (checked builds: not a race)
  uint32_t fence = 0;          // mem_flags of the pending barrier
  uint32_t acct_seq = 0;       // counting builds: device accesses so far in this threadgroup
#ifdef MSLEMU_ACCOUNTING
  uint32_t acct_loads[MSLEMU_MAX_COUNTED_BUFFERS] = {};  // device loads per buffer (lane utilisation)
#endif
  ThreadCtx ctx{};
};

struct SimdGroup {
  alignas(64) unsigned char slots[kSimdWidth][kSlotBytes];
  alignas(64) unsigned char snap[kSimdWidth][kSlotBytes];
  alignas(64) unsigned char cache[kSlotBytes];  // reduction result shared by the group
  uint64_t cache_epoch = ~0ull;
  uint32_t live_mask = 0;
  uint32_t phase = 0;  // simdgroup_barrier(mem_threadgroup) releases so far (race detector)
};

typedef void (*KernelBody)();

struct LaunchState {
  const mslemu_launch *L;
  KernelBody body;
  u3 tgpg;       // threadgroups per grid
  u3 tpg;        // threads per grid
  u3 tg;         // nominal threads per threadgroup
  std::atomic<uint64_t> next_tg{0};
  uint64_t n_tg = 0;
  std::atomic<uint64_t> warn_barrier_after_exit{0};
  std::atomic<uint64_t> warn_divergent_barrier{0};
  const char *kernel = "";  // host name, for error messages
  bool poison = false;   // MSLEMU_POISON
  uint64_t schedule = 0; // MSLEMU_SCHEDULE: seed of the fuzzed fiber / threadgroup order (0: in order)
  bool strict = false;   // MSLEMU_STRICT
  size_t tg_mem_dynamic = 0;  // bytes of [[threadgroup(i)]] memory, for the strict limit
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::string err;       // first failure
};

struct Worker {
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> sgs;
  std::vector<char *> stacks;  // usable stack bottoms (a guard page lies below each)
  size_t stack_size = 0;
  void *sched_sp = nullptr;
#ifdef MSLEMU_UCONTEXT
  ucontext_t sched_uc;
#endif
  std::vector<std::vector<unsigned char>> tg_mem;  // dynamic [[threadgroup(i)]]
  // threadgroup-scope variables declared in kernels (`threadgroup float x[32];`)
  struct TgVar { const void *key; void *p; size_t size; const char *name; };
  std::vector<TgVar> tg_vars;
  std::vector<unsigned char> tg_arena;
  size_t tg_arena_used = 0;
  uint64_t epoch = 0;
  // barrier releases with mem_threadgroup / mem_device, counted over the worker's life so
  // a record from an earlier threadgroup never looks current (race detector)
  uint32_t tg_phase = 1, dev_phase = 1;
  uint32_t tg_index = 0;  // linear index of the running threadgroup
  uint64_t rng = 0;       // schedule fuzzing state (splitmix64)
  LaunchState *ls = nullptr;
  ~Worker() {
    for (char *s : stacks) munmap(s - 4096, stack_size + 4096);
  }
};

// --- thread-local scheduler state (one OS worker thread == one threadgroup at a time)
// initial-exec: avoid a __tls_get_addr call per access inside a dlopen'ed .so
inline thread_local Worker *tl_worker __attribute__((tls_model("initial-exec"))) = nullptr;
inline thread_local Fiber *tl_fiber __attribute__((tls_model("initial-exec"))) = nullptr;

// The first live lane of the caller's simdgroup: simdgroup-matrix operations are emulated
// redundantly by every lane, but are one operation of the simdgroup (counted and checked once).
inline bool simd_leader() {
  Fiber *f = tl_fiber;
  uint32_t live = tl_worker->sgs[f->sg].live_mask;
  return live && f->lane == (uint32_t)__builtin_ctz(live);
}

// Silences the accesses of a scope for counting and checking builds (the redundant lanes
// of a simdgroup-matrix load/store, the emulator's own poisoning).
struct AccessMute {
  bool prev;
  // The barriers on both sides of each store keep the optimiser from dropping one as dead
  // (the instrumentation that reads the flag is inserted after optimisation), also
  // between two scopes in a row.
  explicit AccessMute(bool mute) : prev(tl_fiber->mute) {
    __asm__ __volatile__("" ::: "memory");
    tl_fiber->mute = prev || mute;
    __asm__ __volatile__("" ::: "memory");
  }
  ~AccessMute() {
    __asm__ __volatile__("" ::: "memory");
    tl_fiber->mute = prev;
    __asm__ __volatile__("" ::: "memory");
  }
};

// Marks an atomic operation: checked builds bound-check it but never report it as a race.
struct AtomicScope {
  AtomicScope() {  // barriers: as in AccessMute
    __asm__ __volatile__("" ::: "memory");
    if (tl_fiber) tl_fiber->in_atomic = true;
    __asm__ __volatile__("" ::: "memory");
  }
  ~AtomicScope() {
    __asm__ __volatile__("" ::: "memory");
    if (tl_fiber) tl_fiber->in_atomic = false;
    __asm__ __volatile__("" ::: "memory");
  }
};

inline uint64_t splitmix64(uint64_t &s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace mslemu

#include "accounting.h"

// ---- x86-64 context switch ---------------------------------------------------
#ifndef MSLEMU_UCONTEXT
extern "C" void mslemu_ctx_switch(void **save_sp, void *load_sp);
extern "C" void mslemu_fiber_trampoline();
#ifdef MSLEMU_IMPLEMENTATION
__asm__(R"(
.text
.globl mslemu_ctx_switch
.hidden mslemu_ctx_switch
.type mslemu_ctx_switch,@function
mslemu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size mslemu_ctx_switch,.-mslemu_ctx_switch

.globl mslemu_fiber_trampoline
.hidden mslemu_fiber_trampoline
.type mslemu_fiber_trampoline,@function
mslemu_fiber_trampoline:
  movq %rbx, %rdi
  andq $-16, %rsp
  call mslemu_fiber_main@PLT
  ud2
.size mslemu_fiber_trampoline,.-mslemu_fiber_trampoline
)");
#endif
#endif

extern "C" void mslemu_fiber_main(mslemu::Fiber *f);

namespace mslemu {

[[noreturn]] inline void fatal(const char *msg) {
  fprintf(stderr, "mslemu fatal: %s\n", msg);
  abort();
}

inline void yield_to_scheduler() {
  Worker *w = tl_worker;
  Fiber *f = tl_fiber;
#ifdef MSLEMU_UCONTEXT
  swapcontext(&f->uc, &w->sched_uc);
#else
  mslemu_ctx_switch(&f->sp, w->sched_sp);
#endif
}

// Record the first failure of a launch; the schedulers stop at their next switch.
inline void launch_fail(LaunchState &ls, const std::string &msg) {
  std::lock_guard<std::mutex> g(ls.err_mu);
  if (!ls.failed.load()) ls.err = msg;
  ls.failed.store(true);
}

// Called on a fiber: fail the launch and never resume this fiber (its stack is
// simply abandoned; kernels own no resources that need unwinding).
[[noreturn]] inline void kernel_fail(const std::string &msg) {
  launch_fail(*tl_worker->ls, msg);
  tl_fiber->state = FState::Aborted;
  yield_to_scheduler();
  fatal("resumed an aborted fiber");
}

}  // namespace mslemu

#include "checks.h"

#ifdef MSLEMU_IMPLEMENTATION
extern "C" void mslemu_fiber_main(mslemu::Fiber *f) {
  using namespace mslemu;
  tl_fiber = f;
  tl_worker->ls->body();
  f->state = FState::Done;
  yield_to_scheduler();
  fatal("resumed a finished fiber");
}
// float -> bfloat16 libcalls: clang emits them, but libgcc < 13 (Debian 12) lacks them.
extern "C" __attribute__((weak)) __bf16 __truncsfbf2(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) u = (u | 0x00400000u) >> 16;  // quiet NaN
  else u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;                     // round to nearest even
  uint16_t h = (uint16_t)u;
  __bf16 r;
  memcpy(&r, &h, 2);
  return r;
}
extern "C" __attribute__((weak)) __bf16 __truncdfbf2(double d) { return __truncsfbf2((float)d); }
#ifdef MSLEMU_UCONTEXT
static void mslemu_uc_entry(unsigned lo, unsigned hi) {
  mslemu_fiber_main((mslemu::Fiber *)(((uintptr_t)hi << 32) | lo));
}
#endif
#endif

namespace mslemu {

struct KernelEntry {
  const char *name;
  KernelBody body;
};
struct FunctionConstantEntry {
  const char *index;
  void *addr;
  unsigned long size;
};

size_t default_stack_size();
int run_launch(const mslemu_launch *L, KernelBody body, const char *kernel = "");
const char *last_error();
int api_dispatch(const KernelEntry *kernels, const FunctionConstantEntry *fcs, const char *name,
                 const mslemu_launch *L, const mslemu_function_constant *set, uint32_t n_set);
int api_set_function_constant(const FunctionConstantEntry *fcs, const char *idx, const void *v, unsigned long n);
const char *api_kernel_name(const KernelEntry *kernels, int i);
const mslemu_counts *api_last_counts();

#ifdef MSLEMU_IMPLEMENTATION
// Per-thread last error, kept off TLS: every dlopened kernel library's TLS block takes
// glibc's small static-TLS reserve (initial-exec, see tl_worker), so it must stay tiny.
static std::mutex g_errors_mutex;
static std::deque<std::pair<std::thread::id, std::string>> g_errors;  // stable references

static std::string &thread_error() {
  std::lock_guard<std::mutex> lock(g_errors_mutex);
  const std::thread::id me = std::this_thread::get_id();
  for (auto &e : g_errors)
    if (e.first == me) return e.second;
  g_errors.emplace_back(me, std::string());
  return g_errors.back().second;
}
#ifdef MSLEMU_ACCOUNTING
// not thread_local: a library's static TLS must stay tiny (initial-exec, see tl_worker)
static mslemu_counts tl_last_counts;
const mslemu_counts *api_last_counts() { return &tl_last_counts; }
#else
const mslemu_counts *api_last_counts() { return nullptr; }
#endif

static int set_error(int code, const std::string &msg) {
  thread_error() = msg;
  return code;
}

const char *last_error() { return thread_error().c_str(); }

static bool env_flag(const char *n) {
  const char *e = getenv(n);
  return e && *e && *e != '0';
}

size_t default_stack_size() {
  const char *e = getenv("MSLEMU_STACK_KB");
  size_t kb = e ? (size_t)atol(e) : 64;
  if (kb < 16) kb = 16;
  return kb * 1024;
}

static void prepare_fiber(Worker &w, Fiber &f, char *stack) {
#ifdef MSLEMU_UCONTEXT
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = stack;
  f.uc.uc_stack.ss_size = w.stack_size;
  f.uc.uc_link = nullptr;
  uintptr_t p = (uintptr_t)&f;
  makecontext(&f.uc, (void (*)())mslemu_uc_entry, 2, (unsigned)(p & 0xffffffffu), (unsigned)(p >> 32));
#else
  // Build the frame that mslemu_ctx_switch pops: [r15][r14][r13][r12][rbx][rbp][ret]
  // (MXCSR / x87 control word are not switched: kernels never change the FP environment.)
  // Stagger stack tops so 1024 fibers do not all alias the same L1 cache sets.
  uintptr_t stagger = ((uintptr_t)(&f - w.fibers.data()) * 320) & 4095;
  uintptr_t top = ((uintptr_t)stack + w.stack_size - stagger) & ~(uintptr_t)15;
  uint64_t *sp = (uint64_t *)top;
  *--sp = 0;                                      // alignment pad
  *--sp = (uint64_t)(uintptr_t)&mslemu_fiber_trampoline;  // ret
  *--sp = 0;                                      // rbp
  *--sp = (uint64_t)(uintptr_t)&f;                // rbx -> arg for fiber_main
  *--sp = 0; *--sp = 0; *--sp = 0; *--sp = 0;     // r12..r15
  f.sp = sp;
#endif
}

static inline void switch_to(Worker &w, Fiber &f) {
  tl_fiber = &f;
#ifdef MSLEMU_UCONTEXT
  swapcontext(&w.sched_uc, &f.uc);
#else
  mslemu_ctx_switch(&w.sched_sp, f.sp);
#endif
  tl_fiber = nullptr;
}

static void run_threadgroup(Worker &w, LaunchState &ls, u3 tgpos) {
  const mslemu_launch *L = ls.L;
  u3 tsz = ls.tg;
  if (L->nonuniform) {  // partial edge threadgroups
    uint32_t rem;
    rem = ls.tpg.x - tgpos.x * ls.tg.x; tsz.x = rem < tsz.x ? rem : tsz.x;
    rem = ls.tpg.y - tgpos.y * ls.tg.y; tsz.y = rem < tsz.y ? rem : tsz.y;
    rem = ls.tpg.z - tgpos.z * ls.tg.z; tsz.z = rem < tsz.z ? rem : tsz.z;
  }
  const uint32_t T = tsz.x * tsz.y * tsz.z;
  const uint32_t nsg = (T + kSimdWidth - 1) / kSimdWidth;
#ifdef MSLEMU_ACCOUNTING
  if (tl_acct) {
    tl_acct->c.threads += T;
    tl_acct->c.simdgroups += nsg;
    tl_acct->c.threadgroups += 1;
  }
#endif
  if (ls.poison)  // 0xff bytes: NaN as float/half, all-ones as integers
    for (auto &m : w.tg_mem) memset(m.data(), 0xff, m.size());
  ++w.tg_phase;  // nothing recorded by an earlier threadgroup is current
  ++w.dev_phase;
  if (ls.schedule) w.rng = ls.schedule * 0x2545F4914F6CDD1Dull + w.tg_index;
  w.tg_vars.clear();
  if (ls.poison && w.tg_arena_used) memset(w.tg_arena.data(), 0xff, w.tg_arena_used);
  w.tg_arena_used = 0;
  for (uint32_t s = 0; s < nsg; ++s) {
    uint32_t lanes = (s + 1 == nsg) ? T - s * kSimdWidth : kSimdWidth;
    w.sgs[s].live_mask = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
  }
  uint32_t t = 0;
  for (uint32_t z = 0; z < tsz.z; ++z)
    for (uint32_t y = 0; y < tsz.y; ++y)
      for (uint32_t x = 0; x < tsz.x; ++x, ++t) {
        Fiber &f = w.fibers[t];
        f.state = FState::Runnable;
        f.tid = t; f.lane = t % kSimdWidth; f.sg = t / kSimdWidth;
        f.site = 0; f.active_mask = 0; f.acct_seq = 0; f.mute = false; f.in_atomic = false;
#ifdef MSLEMU_ACCOUNTING
        memset(f.acct_loads, 0, sizeof f.acct_loads);
#endif
        ThreadCtx &c = f.ctx;
        c.tpitg = {x, y, z};
        c.tgpig = tgpos;
        c.tptg = tsz;
        c.dtptg = ls.tg;
        c.tgpg = ls.tgpg;
        c.tpg = ls.tpg;
        c.tpig = {tgpos.x * ls.tg.x + x, tgpos.y * ls.tg.y + y, tgpos.z * ls.tg.z + z};
        c.tiitg = t; c.sgitg = f.sg; c.tiisg = f.lane; c.sgptg = nsg;
        prepare_fiber(w, f, w.stacks[t]);
      }
  uint32_t live = T;
  std::vector<uint32_t> order;  // MSLEMU_SCHEDULE: a fresh random fiber order every pass
  if (ls.schedule) {
    order.resize(T);
    for (uint32_t i = 0; i < T; ++i) order[i] = i;
  }
  while (live) {
    bool ran = false;
    if (ls.schedule)
      for (uint32_t i = T; i > 1; --i) std::swap(order[i - 1], order[splitmix64(w.rng) % i]);
    for (uint32_t j = 0; j < T; ++j) {
      Fiber &f = w.fibers[ls.schedule ? order[j] : j];
      if (f.state != FState::Runnable) continue;
      ran = true;
      switch_to(w, f);
      if (f.state == FState::Aborted) return;  // abandon the whole threadgroup
      if (f.state == FState::Done) {
        --live;
        w.sgs[f.sg].live_mask &= ~(1u << f.lane);
      }
    }
    if (!live) break;
    if (ran) {  // a fiber preempted at a memory access (checked builds) is still runnable
      bool runnable = false;
      for (uint32_t i = 0; i < T && !runnable; ++i) runnable = w.fibers[i].state == FState::Runnable;
      if (runnable) continue;
    }
    // 1) resolve simd-group collectives: lanes waiting at the same call site form
    //    the active set (divergent lanes elsewhere / exited lanes are inactive).
    bool resolved = false;
    for (uint32_t s = 0; s < nsg; ++s) {
      Fiber *base = &w.fibers[s * kSimdWidth];
      uint32_t lanes = (s + 1 == nsg) ? T - s * kSimdWidth : kSimdWidth;
      uint32_t pending = 0;
      for (uint32_t l = 0; l < lanes; ++l)
        if (base[l].state == FState::Simd) pending |= 1u << l;
      while (pending) {
        uint32_t first = __builtin_ctz(pending);
        uint64_t site = base[first].site;
        uint32_t mask = 0;
        for (uint32_t m = pending; m; m &= m - 1) {
          uint32_t l = __builtin_ctz(m);
          if (base[l].site == site) mask |= 1u << l;
        }
        pending &= ~mask;
        SimdGroup &g = w.sgs[s];
        const uint64_t ep = ++w.epoch;
        if (base[first].fence & 2u) ++g.phase;  // simdgroup_barrier(mem_threadgroup)
        for (uint32_t m = mask; m; m &= m - 1) {
          uint32_t l = __builtin_ctz(m);
          memcpy(g.snap[l], g.slots[l], kSlotBytes);
          base[l].active_mask = mask;
          base[l].epoch = ep;
          base[l].state = FState::Runnable;
        }
        resolved = true;
      }
    }
    if (resolved) continue;
    // 2) every live thread now waits at threadgroup_barrier -> release.
    uint64_t site = 0; bool first = true, divergent = false;
    for (uint32_t i = 0; i < T; ++i) {
      Fiber &f = w.fibers[i];
      if (f.state != FState::Barrier) continue;
      if (first) {
        site = f.site;
        first = false;
        if (f.fence & 1u) ++w.dev_phase;  // mem_device orders device memory
        if (f.fence & 2u) ++w.tg_phase;   // mem_threadgroup orders threadgroup memory
      }
      else if (f.site != site) divergent = true;
      f.state = FState::Runnable;
    }
    if (live != T) ls.warn_barrier_after_exit.fetch_add(1, std::memory_order_relaxed);
    if (divergent) ls.warn_divergent_barrier.fetch_add(1, std::memory_order_relaxed);
    if (ls.strict && (live != T || divergent)) {
      char msg[256];
      snprintf(msg, sizeof msg, "%s (MSLEMU_STRICT, threadgroup %u,%u,%u)",
               live != T ? "threadgroup_barrier reached after some threads of the threadgroup returned"
                         : "threads of one threadgroup wait at different threadgroup_barrier call sites",
               tgpos.x, tgpos.y, tgpos.z);
      launch_fail(ls, msg);
      return;
    }
  }
#ifdef MSLEMU_ACCOUNTING
  if (tl_acct) acct_lanes(*tl_acct, w.fibers.data(), T);
#endif
}

static void worker_loop(LaunchState *ls, size_t stack_size) {
  const mslemu_launch *L = ls->L;
  Worker w;
  w.ls = ls;
  const uint32_t T = ls->tg.x * ls->tg.y * ls->tg.z;
  w.stack_size = stack_size;
  w.fibers.resize(T);
  w.sgs.resize((T + kSimdWidth - 1) / kSimdWidth);
  w.stacks.reserve(T);
  for (uint32_t i = 0; i < T; ++i) {
    // guard page below each stack catches overflow (SIGSEGV instead of silent corruption)
    char *m = (char *)mmap(nullptr, stack_size + 4096, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      launch_fail(*ls, "mmap of a fiber stack failed");
      return;
    }
    mprotect(m, 4096, PROT_NONE);
    w.stacks.push_back(m + 4096);
  }
  w.tg_mem.resize(L->n_tg_mem);
  for (uint32_t i = 0; i < L->n_tg_mem; ++i) {
    w.tg_mem[i].assign((L->tg_mem_len[i] + 15) & ~15ull, 0);
#ifdef MSLEMU_CHECKS
    w.tg_mem[i].reserve(w.tg_mem[i].size() + kCheckRedzone);  // an overflow lands in our own memory
#endif
  }
  w.tg_arena.assign(1 << 20, 0);  // the real limit (32 KiB) is checked under MSLEMU_STRICT
  tl_worker = &w;
#ifdef MSLEMU_ACCOUNTING
  if (tl_acct) acct_worker(*tl_acct, w);
#endif
  const uint64_t nx = ls->tgpg.x, nxy = (uint64_t)ls->tgpg.x * ls->tgpg.y;
  // MSLEMU_SCHEDULE: threadgroups in the order i -> (a i + b) mod n, gcd(a, n) = 1
  uint64_t pa = 1, pb = 0;
  if (ls->schedule && ls->n_tg > 1) {
    uint64_t s = ls->schedule;
    pb = splitmix64(s) % ls->n_tg;
    for (;;) {
      pa = 1 + splitmix64(s) % (ls->n_tg - 1);
      uint64_t a = pa, b = ls->n_tg;
      while (b) { uint64_t t = a % b; a = b; b = t; }
      if (a == 1) break;
    }
  }
  while (!ls->failed.load(std::memory_order_relaxed)) {
    uint64_t i = ls->next_tg.fetch_add(1, std::memory_order_relaxed);
    if (i >= ls->n_tg) break;
    if (ls->schedule) i = (unsigned __int128)(pa * (unsigned __int128)i + pb) % ls->n_tg;
    w.tg_index = (uint32_t)i;
    u3 p{(uint32_t)(i % nx), (uint32_t)((i % nxy) / nx), (uint32_t)(i / nxy)};
#ifdef MSLEMU_ACCOUNTING
    if (tl_acct) tl_acct->tg_id = (uint32_t)(i + 1);
#endif
    run_threadgroup(w, *ls, p);
#ifdef MSLEMU_ACCOUNTING
    if (tl_acct && w.tg_arena_used + ls->tg_mem_dynamic > tl_acct->c.threadgroup_memory)
      tl_acct->c.threadgroup_memory = w.tg_arena_used + ls->tg_mem_dynamic;
#endif
  }
  tl_worker = nullptr;
}

int run_launch(const mslemu_launch *L, KernelBody body, const char *kernel) {
  if (!L) return set_error(MSLEMU_E_LAUNCH, "mslemu_launch is NULL");
  LaunchState ls;
  ls.L = L;
  ls.body = body;
  ls.kernel = kernel;
  ls.tg = {L->tg[0] ? L->tg[0] : 1, L->tg[1] ? L->tg[1] : 1, L->tg[2] ? L->tg[2] : 1};
  const uint64_t T = (uint64_t)ls.tg.x * ls.tg.y * ls.tg.z;
  if (T > 1024) {
    char msg[160];
    snprintf(msg, sizeof msg, "threads per threadgroup %u x %u x %u = %llu exceeds 1024", ls.tg.x, ls.tg.y,
             ls.tg.z, (unsigned long long)T);
    return set_error(MSLEMU_E_LAUNCH, msg);
  }
  if (L->n_tg_mem && !L->tg_mem_len) return set_error(MSLEMU_E_LAUNCH, "n_tg_mem > 0 but tg_mem_len is NULL");
  if (L->n_buffers && !L->buffers) return set_error(MSLEMU_E_LAUNCH, "n_buffers > 0 but buffers is NULL");
  u3 g{L->grid[0] ? L->grid[0] : 1, L->grid[1] ? L->grid[1] : 1, L->grid[2] ? L->grid[2] : 1};
  if (L->nonuniform) {
    ls.tpg = g;
    ls.tgpg = {(g.x + ls.tg.x - 1) / ls.tg.x, (g.y + ls.tg.y - 1) / ls.tg.y, (g.z + ls.tg.z - 1) / ls.tg.z};
  } else {
    ls.tgpg = g;
    ls.tpg = {g.x * ls.tg.x, g.y * ls.tg.y, g.z * ls.tg.z};
  }
  ls.n_tg = (uint64_t)ls.tgpg.x * ls.tgpg.y * ls.tgpg.z;
  ls.poison = env_flag("MSLEMU_POISON");
  ls.strict = env_flag("MSLEMU_STRICT");
  if (const char *e = getenv("MSLEMU_SCHEDULE")) ls.schedule = strtoull(e, nullptr, 0);
  for (uint32_t i = 0; i < L->n_tg_mem; ++i) ls.tg_mem_dynamic += (L->tg_mem_len[i] + 15) & ~15ull;
  if (ls.strict && ls.tg_mem_dynamic > kTgMemLimit) {
    char msg[160];
    snprintf(msg, sizeof msg, "threadgroup memory lengths total %zu bytes, over the %zu-byte limit (MSLEMU_STRICT)",
             ls.tg_mem_dynamic, kTgMemLimit);
    return set_error(MSLEMU_E_LAUNCH, msg);
  }
  unsigned nw = L->n_workers;
  if (!nw) {
    const char *e = getenv("MSLEMU_THREADS");
    nw = e ? (unsigned)atoi(e) : std::thread::hardware_concurrency();
  }
  if (nw < 1) nw = 1;
  if (nw > ls.n_tg) nw = (unsigned)ls.n_tg;
  size_t ss = default_stack_size();
#ifdef MSLEMU_CHECKS
  // checking runs on this thread alone, on guarded copies of the buffers
  Checks checks;
  mslemu_launch copy = *L;
  if (!checks_begin(checks, L, copy)) {
    checks_end(checks, L);  // the copies made so far
    return set_error(MSLEMU_E_LAUNCH, "mmap of a checked buffer copy failed");
  }
  ls.L = &copy;
  tl_checks = &checks;
  worker_loop(&ls, ss);
  tl_checks = nullptr;
  checks_end(checks, L);
  if (false) {
#elif defined(MSLEMU_ACCOUNTING)
  // counting runs on this thread alone: exact first-touch maps, no atomics
  Acct acct;
  acct_begin(acct, L);
  tl_acct = &acct;
  worker_loop(&ls, ss);
  tl_acct = nullptr;
  tl_last_counts = acct.c;
  if (false) {
#else
  if (nw <= 1) {
    worker_loop(&ls, ss);
  } else {
#endif
    std::vector<std::thread> th;
    for (unsigned i = 0; i < nw; ++i) th.emplace_back(worker_loop, &ls, ss);
    for (auto &t : th) t.join();
  }
  if (env_flag("MSLEMU_VERBOSE") && (ls.warn_barrier_after_exit || ls.warn_divergent_barrier))
    fprintf(stderr, "mslemu: warning: %llu barrier(s) released after thread exit, %llu divergent barrier(s)\n",
            (unsigned long long)ls.warn_barrier_after_exit.load(), (unsigned long long)ls.warn_divergent_barrier.load());
  if (ls.failed.load()) {
    if (env_flag("MSLEMU_VERBOSE")) fprintf(stderr, "mslemu: kernel failed: %s\n", ls.err.c_str());
    return set_error(MSLEMU_E_KERNEL, ls.err);
  }
  return 0;
}

// One lock per kernel library (this TU); see the threading contract at the top.
static std::mutex api_mu;

static int set_constant_locked(const FunctionConstantEntry *fcs, const char *idx, const void *v, unsigned long n) {
  for (const FunctionConstantEntry *e = fcs; e->index; ++e) {
    if (strcmp(e->index, idx)) continue;
    if (n != e->size) {
      char msg[160];
      snprintf(msg, sizeof msg, "function constant %s has %lu bytes, got %lu", idx, e->size, n);
      return set_error(MSLEMU_E_FC_SIZE, msg);
    }
    memcpy(e->addr, v, n);
    return 0;
  }
  return set_error(MSLEMU_E_NO_KERNEL, std::string("no [[function_constant(") + idx + ")]] in this library");
}

int api_set_function_constant(const FunctionConstantEntry *fcs, const char *idx, const void *v, unsigned long n) {
  if (!idx || !v) return set_error(MSLEMU_E_NO_KERNEL, "function constant index or value is NULL");
  std::lock_guard<std::mutex> g(api_mu);
  return set_constant_locked(fcs, idx, v, n);
}

int api_dispatch(const KernelEntry *kernels, const FunctionConstantEntry *fcs, const char *name,
                 const mslemu_launch *L, const mslemu_function_constant *set, uint32_t n_set) {
  if (!name) return set_error(MSLEMU_E_NO_KERNEL, "kernel name is NULL");
  const KernelEntry *k = kernels;
  while (k->name && strcmp(k->name, name)) ++k;
  if (!k->name) return set_error(MSLEMU_E_NO_KERNEL, std::string("no kernel named ") + name);
  std::lock_guard<std::mutex> g(api_mu);
  for (uint32_t i = 0; i < n_set; ++i) {
    if (!set[i].index || !set[i].value) return set_error(MSLEMU_E_NO_KERNEL, "function constant index or value is NULL");
    int r = set_constant_locked(fcs, set[i].index, set[i].value, set[i].size);
    if (r) return r;
  }
  return run_launch(L, k->body, k->name);
}

const char *api_kernel_name(const KernelEntry *kernels, int i) {
  if (i < 0) return nullptr;
  for (int j = 0; kernels[j].name; ++j)
    if (j == i) return kernels[j].name;
  return nullptr;
}
#endif  // MSLEMU_IMPLEMENTATION

// ---- accessors used by the shim ----------------------------------------------
inline const ThreadCtx &ctx() { return tl_fiber->ctx; }

inline void barrier_wait(uint64_t site, uint32_t fence = 2) {
#ifdef MSLEMU_ACCOUNTING
  if (tl_acct) ++tl_acct->c.barriers;
#endif
  Fiber *f = tl_fiber;
  f->site = site;
  f->fence = fence;
  f->state = FState::Barrier;
  yield_to_scheduler();
}

// Publish `bytes` of this lane's data, wait until all active lanes of the
// simdgroup have arrived at the same call site, return the snapshot table.
// `fence`: mem_flags of a simdgroup_barrier (0 for the other collectives).
inline const unsigned char (*simd_exchange(const void *data, size_t bytes, uint64_t site, uint32_t *mask,
                                           SimdGroup **grp = nullptr, uint64_t *epoch = nullptr,
                                           uint32_t fence = 0))[kSlotBytes] {
  Fiber *f = tl_fiber;
  SimdGroup &g = tl_worker->sgs[f->sg];
  if (bytes) memcpy(g.slots[f->lane], data, bytes);
  f->site = site;
  f->fence = fence;
  f->state = FState::Simd;
  yield_to_scheduler();
  f = tl_fiber;
  *mask = f->active_mask;
  if (grp) *grp = &g;
  if (epoch) *epoch = f->epoch;
  return g.snap;
}

// Storage of a `threadgroup T x;` declared inside a kernel: one instance per
// running threadgroup, shared by all its fibers (looked up by a per-declaration key).
inline void *tg_var_lookup(const void *key, size_t size, size_t align, const char *name = "") {
  Worker *w = tl_worker;
  for (auto &e : w->tg_vars)
    if (e.key == key) return e.p;
  size_t off = (w->tg_arena_used + align - 1) & ~(align - 1);
  if (off + size > w->tg_arena.size()) kernel_fail("threadgroup variables exceed the emulator's 1 MiB arena");
  const LaunchState &ls = *w->ls;
  if (ls.strict && off + size + ls.tg_mem_dynamic > kTgMemLimit) {
    char msg[200];
    snprintf(msg, sizeof msg, "threadgroup memory (%zu bytes of threadgroup variables + %zu bytes of [[threadgroup(i)]]) "
             "is over the %zu-byte limit (MSLEMU_STRICT)", off + size, ls.tg_mem_dynamic, kTgMemLimit);
    kernel_fail(msg);
  }
  void *p = w->tg_arena.data() + off;
  w->tg_arena_used = off + size;
  AccessMute mute(true);  // poisoning is the emulator's, not the kernel's, traffic
  if (ls.poison) memset(p, 0xff, size);
  w->tg_vars.push_back(Worker::TgVar{key, p, size, name});
  return p;
}

inline void *buffer_ptr(uint32_t i) {
  const mslemu_launch *L = tl_worker->ls->L;
  if (i >= L->n_buffers || !L->buffers[i]) {
    char msg[96];
    snprintf(msg, sizeof msg, "kernel reads [[buffer(%u)]] which was not bound", i);
    kernel_fail(msg);
  }
  return L->buffers[i];
}
inline void *tg_mem_ptr(uint32_t i) {
  Worker *w = tl_worker;
  if (i >= w->tg_mem.size() || w->tg_mem[i].empty()) {
    char msg[128];
    snprintf(msg, sizeof msg, "kernel uses [[threadgroup(%u)]] but no threadgroup memory length was set", i);
    kernel_fail(msg);
  }
  return w->tg_mem[i].data();
}

}  // namespace mslemu
