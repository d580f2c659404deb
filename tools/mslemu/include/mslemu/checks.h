// mslemu checked builds (-DMSLEMU_CHECKS, mslemu.Library(..., checks=True) or MSLEMU_CHECKS=1):
// every load and store of the kernel calls back here (clang's address-sanitizer
// instrumentation in callback mode, as for counting builds), and the callback
//   - traps out-of-bounds device accesses: each bound buffer runs on a private copy with
//     64 KiB red zones on both sides, so an access outside [base, base + size) is an error
//     naming the kernel, the [[buffer(i)]], the byte offset and the thread, and never
//     touches host memory; threadgroup accesses past the declared variables or past a
//     [[threadgroup(i)]] length are errors too;
//   - detects threadgroup-memory races: a byte written by one thread and read or written
//     by another with no threadgroup_barrier(mem_threadgroup) between them (nor, inside one
//     simdgroup, a simdgroup_barrier(mem_threadgroup)) is an error naming the kernel, the
//     variable or [[threadgroup(i)]], the offset and both threads;
//   - detects device write-write races: a byte written by two threads of different
//     threadgroups, or of one threadgroup with no threadgroup_barrier(mem_device) between;
//   - with MSLEMU_SCHEDULE=seed, preempts the running thread at one shared-memory access in
//     eight (seeded), so other threads interleave inside a barrier interval.
// Atomics are bound-checked but never races.  A checked launch runs on one worker thread.
#pragma once
#ifdef MSLEMU_CHECKS
#ifdef MSLEMU_ACCOUNTING
#error "a build either counts (MSLEMU_ACCOUNTING) or checks (MSLEMU_CHECKS), not both"
#endif
#define MSLEMU_NOASAN __attribute__((no_sanitize("address")))

namespace mslemu {

constexpr size_t kCheckRedzone = 65536;
constexpr uint32_t kMaxCheckedBuffers = 64;

// One access of threadgroup memory: the barrier phase it happened in (0: none), the thread,
// and its simdgroup's simdgroup_barrier count then.
struct TgAccess {
  uint32_t phase;
  uint16_t tid;
  uint16_t sg_phase;
};
struct TgShadow {
  TgAccess w, r0, r1;  // last write; first and latest other reader of the phase
};
struct DevWrite {
  uint32_t tg;  // 1 + threadgroup index; 0: never written
  uint32_t phase;
  uint16_t tid;
};

// A private copy of bound buffers whose host ranges overlap (one binding, or aliases).
struct CheckedGroup {
  char *map = nullptr;
  size_t map_len = 0;
  uintptr_t base = 0, end = 0;  // the copy's data
  uintptr_t host = 0;           // host address of base
  DevWrite *writes = nullptr;   // per byte, allocated at the first non-atomic write
  bool written = false;         // copied back only then (inputs may be read-only memory)
};

struct Checks {
  uint32_t n_buffers = 0;
  std::vector<void *> ptrs;           // the launch's buffers, redirected to the copies
  std::vector<int> group_of;          // [[buffer(i)]] -> group (-1: not checked)
  std::vector<uint64_t> sizes;
  std::vector<CheckedGroup> groups;
  std::vector<TgShadow> arena_sh;     // threadgroup variables, by byte offset
  std::vector<std::vector<TgShadow>> dyn_sh;  // [[threadgroup(i)]]
  bool busy = false;
};

inline thread_local Checks *tl_checks __attribute__((tls_model("initial-exec"))) = nullptr;

#ifdef MSLEMU_IMPLEMENTATION
bool checks_begin(Checks &C, const mslemu_launch *L, mslemu_launch &copy) {
  C.n_buffers = L->n_buffers;
  C.ptrs.assign(L->buffers, L->buffers + L->n_buffers);
  C.group_of.assign(L->n_buffers, -1);
  C.sizes.assign(L->n_buffers, 0);
  copy.buffers = C.ptrs.data();
  if (!L->buffer_sizes) return true;  // sizes unknown: nothing to bound
  std::vector<uint32_t> idx;
  for (uint32_t i = 0; i < L->n_buffers && i < kMaxCheckedBuffers; ++i)
    if (L->buffers[i]) idx.push_back(i);
  auto lo = [&](uint32_t i) { return (uintptr_t)L->buffers[i]; };
  auto hi = [&](uint32_t i) { return (uintptr_t)L->buffers[i] + L->buffer_sizes[i]; };
  std::sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return lo(a) < lo(b); });
  for (size_t k = 0; k < idx.size();) {  // merge overlapping host ranges into one copy
    uintptr_t s = lo(idx[k]), e = hi(idx[k]);
    size_t j = k + 1;
    while (j < idx.size() && lo(idx[j]) < e) e = e > hi(idx[j]) ? e : hi(idx[j]), ++j;
    CheckedGroup g;
    const size_t align = s & 63;  // keep the host's alignment
    g.map_len = (kCheckRedzone + align + (e - s) + kCheckRedzone + 4095) & ~(size_t)4095;
    void *m = mmap(nullptr, g.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return false;
    g.map = (char *)m;
    g.base = (uintptr_t)g.map + kCheckRedzone + align;
    g.end = g.base + (e - s);
    g.host = s;
    memcpy((void *)g.base, (const void *)s, e - s);
    for (size_t q = k; q < j; ++q) {
      C.group_of[idx[q]] = (int)C.groups.size();
      C.sizes[idx[q]] = L->buffer_sizes[idx[q]];
      C.ptrs[idx[q]] = (void *)(g.base + (lo(idx[q]) - s));
    }
    C.groups.push_back(g);
    k = j;
  }
  return true;
}

void checks_end(Checks &C, const mslemu_launch *L) {
  (void)L;
  for (auto &g : C.groups) {
    if (g.written) memcpy((void *)g.host, (const void *)g.base, g.end - g.base);  // also of a failed launch
    munmap(g.map, g.map_len);
    delete[] g.writes;
  }
  C.groups.clear();
}
#else
bool checks_begin(Checks &C, const mslemu_launch *L, mslemu_launch &copy);
void checks_end(Checks &C, const mslemu_launch *L);
#endif

MSLEMU_NOASAN inline void check_fail(Checks *C, const char *msg) {
  C->busy = false;
  kernel_fail(msg);
}

MSLEMU_NOASAN inline void describe_thread(char *out, size_t n, uint32_t tid) {
  const ThreadCtx &c = tl_fiber->ctx;
  const uint32_t x = tid % c.tptg.x, y = (tid / c.tptg.x) % c.tptg.y, z = tid / (c.tptg.x * c.tptg.y);
  snprintf(out, n, "thread %u (position %u,%u,%u, simdgroup %u lane %u)", tid, x, y, z, tid / kSimdWidth,
           tid % kSimdWidth);
}

// The [[buffer(i)]] of group g closest to address a, and a's byte offset from its base.
MSLEMU_NOASAN inline uint32_t nearest_binding(Checks *C, int g, uintptr_t a, int64_t *off) {
  uint32_t best = 0;
  uint64_t best_d = ~0ull;
  for (uint32_t i = 0; i < C->n_buffers && i < kMaxCheckedBuffers; ++i) {
    if (C->group_of[i] != g) continue;
    const uintptr_t b = (uintptr_t)C->ptrs[i], e = b + C->sizes[i];
    const uint64_t d = a < b ? b - a : (a >= e ? a - e + 1 : 0);
    if (d < best_d) best_d = d, best = i;
  }
  *off = (int64_t)(a - (uintptr_t)C->ptrs[best]);
  return best;
}

MSLEMU_NOASAN inline bool tg_ordered(const TgAccess &r, uint32_t phase, uint32_t tid, uint16_t sg_phase) {
  if (r.phase != phase) return true;  // empty (0), or before a threadgroup_barrier(mem_threadgroup)
  if (r.tid == tid) return true;
  return r.tid / kSimdWidth == tid / kSimdWidth && r.sg_phase != sg_phase;  // simdgroup_barrier
}

MSLEMU_NOASAN inline void tg_race(Checks *C, const char *what, size_t off, size_t n, bool write, const TgAccess &r,
                                  bool r_wrote) {
  char a[96], b[96], msg[512];
  describe_thread(a, sizeof a, tl_fiber->tid);
  describe_thread(b, sizeof b, r.tid);
  const u3 g = tl_fiber->ctx.tgpig;
  snprintf(msg, sizeof msg,
           "threadgroup memory race in kernel `%s`, threadgroup %u,%u,%u: %s %s %s at byte offset %zu (%zu-byte "
           "access), which %s %s with no threadgroup_barrier(mem_flags::mem_threadgroup) between them",
           tl_worker->ls->kernel, g.x, g.y, g.z, a, write ? "writes" : "reads", what, off, n, b,
           r_wrote ? "wrote" : "read");
  check_fail(C, msg);
}

// A threadgroup access of n bytes at offset off of one region (shadow sh, name for messages).
MSLEMU_NOASAN inline void tg_access(Checks *C, std::vector<TgShadow> &sh, const char *what, size_t off, size_t n,
                                    bool write) {
  Worker *w = tl_worker;
  Fiber *f = tl_fiber;
  if (sh.size() < off + n) sh.resize(off + n, TgShadow{});
  const uint32_t phase = w->tg_phase, tid = f->tid;
  const uint16_t sgp = (uint16_t)w->sgs[f->sg].phase;
  const TgAccess me{phase, (uint16_t)tid, sgp};
  for (size_t i = off; i < off + n; ++i) {
    TgShadow &s = sh[i];
    if (!tg_ordered(s.w, phase, tid, sgp)) tg_race(C, what, i, n, write, s.w, true);
    if (write) {
      if (!tg_ordered(s.r0, phase, tid, sgp)) tg_race(C, what, i, n, write, s.r0, false);
      if (!tg_ordered(s.r1, phase, tid, sgp)) tg_race(C, what, i, n, write, s.r1, false);
      s.w = me;
    } else if (s.r0.phase != phase || s.r0.tid == tid) {
      s.r0 = me;
    } else {
      s.r1 = me;
    }
  }
}

MSLEMU_NOASAN inline void dev_write(Checks *C, CheckedGroup &g, int gi, uintptr_t a, size_t n) {
  Worker *w = tl_worker;
  const size_t len = g.end - g.base;
  if (!g.writes) g.writes = new DevWrite[len ? len : 1]();
  const uint32_t tg = w->tg_index + 1, tid = tl_fiber->tid;
  for (uintptr_t p = a; p < a + n; ++p) {
    DevWrite &d = g.writes[p - g.base];
    if (d.tg && (d.tg != tg || (d.tid != tid && d.phase == w->dev_phase))) {
      int64_t off;
      const uint32_t bi = nearest_binding(C, gi, p, &off);
      const LaunchState &ls = *w->ls;
      const uint32_t o = d.tg - 1, nx = ls.tgpg.x, nxy = ls.tgpg.x * ls.tgpg.y;
      const u3 me = tl_fiber->ctx.tgpig;
      char msg[512];
      snprintf(msg, sizeof msg,
               "device memory race in kernel `%s`: [[buffer(%u)]] byte offset %lld is written by thread %u of "
               "threadgroup %u,%u,%u and by thread %u of threadgroup %u,%u,%u%s",
               ls.kernel, bi, (long long)off, d.tid, o % nx, (o % nxy) / nx, o / nxy, tid, me.x, me.y, me.z,
               d.tg == tg ? " with no threadgroup_barrier(mem_flags::mem_device) between them" : "");
      check_fail(C, msg);
    }
    d = DevWrite{tg, w->dev_phase, (uint16_t)tid};
  }
}

MSLEMU_NOASAN inline void check_access(uintptr_t a, size_t n, bool write) {
  Checks *C = tl_checks;
  Fiber *f = tl_fiber;
  if (!C || !f || C->busy || f->mute) return;
  C->busy = true;
  Worker *w = tl_worker;
  bool shared = false;
  char msg[512];
  // threadgroup variables
  const uintptr_t ab = (uintptr_t)w->tg_arena.data();
  if (a >= ab && a < ab + w->tg_arena.size()) {
    const size_t off = a - ab;
    if (off + n > w->tg_arena_used) {
      snprintf(msg, sizeof msg, "out-of-bounds threadgroup %s in kernel `%s`: byte offset %zu (%zu-byte access) is "
               "past the %zu bytes of threadgroup variables", write ? "write" : "read", w->ls->kernel, off, n,
               w->tg_arena_used);
      check_fail(C, msg);
    }
    const char *what = "a threadgroup variable";
    char name[160];
    for (auto &v : w->tg_vars)
      if (a >= (uintptr_t)v.p && a < (uintptr_t)v.p + v.size) {
        snprintf(name, sizeof name, "`%s` (offset %zu in the variable)", v.name, (size_t)(a - (uintptr_t)v.p));
        what = name;
      }
    if (!f->in_atomic) tg_access(C, C->arena_sh, what, off, n, write);
    shared = true;
  }
  // [[threadgroup(i)]]
  for (size_t i = 0; !shared && i < w->tg_mem.size(); ++i) {
    const uintptr_t b = (uintptr_t)w->tg_mem[i].data(), e = b + w->tg_mem[i].size();
    if (a + n <= b || a >= e + kCheckRedzone) continue;
    if (a < b || a + n > e) {
      snprintf(msg, sizeof msg, "out-of-bounds threadgroup %s in kernel `%s`: [[threadgroup(%zu)]] (%zu bytes) at "
               "byte offset %lld (%zu-byte access)", write ? "write" : "read", w->ls->kernel, i, (size_t)(e - b),
               (long long)(a - b), n);
      check_fail(C, msg);
    }
    if (C->dyn_sh.size() < w->tg_mem.size()) C->dyn_sh.resize(w->tg_mem.size());
    char what[48];
    snprintf(what, sizeof what, "[[threadgroup(%zu)]]", i);
    if (!f->in_atomic) tg_access(C, C->dyn_sh[i], what, a - b, n, write);
    shared = true;
  }
  // device buffers (private copies with red zones)
  for (size_t gi = 0; !shared && gi < C->groups.size(); ++gi) {
    CheckedGroup &g = C->groups[gi];
    if (a + n <= g.base - kCheckRedzone || a >= g.end + kCheckRedzone) continue;
    if (a < g.base || a + n > g.end) {
      int64_t off;
      const uint32_t bi = nearest_binding(C, (int)gi, a, &off);
      char t[96];
      describe_thread(t, sizeof t, f->tid);
      const u3 tg = f->ctx.tgpig;
      snprintf(msg, sizeof msg, "out-of-bounds device %s in kernel `%s`: [[buffer(%u)]] (%llu bytes) at byte offset "
               "%lld (%zu-byte access: index %lld), %s of threadgroup %u,%u,%u", write ? "write" : "read",
               w->ls->kernel, bi, (unsigned long long)C->sizes[bi], (long long)off, n,
               (long long)(off >= 0 ? off / (int64_t)n : -((-off + (int64_t)n - 1) / (int64_t)n)), t, tg.x, tg.y, tg.z);
      check_fail(C, msg);
    }
    g.written |= write;
    if (write && !f->in_atomic) dev_write(C, g, (int)gi, a, n);
    shared = true;
  }
  C->busy = false;
  // schedule fuzzing: let other threads run before this shared access
  if (shared && w->ls->schedule && !f->in_atomic && (splitmix64(w->rng) & 7) == 0) yield_to_scheduler();
}

}  // namespace mslemu

#ifdef MSLEMU_IMPLEMENTATION
#define MSLEMU_ON_ACCESS(a, n, write) mslemu::check_access(a, n, write)
#include "mslemu/asan_hooks.h"
#undef MSLEMU_ON_ACCESS
#endif  // MSLEMU_IMPLEMENTATION
#endif  // MSLEMU_CHECKS
