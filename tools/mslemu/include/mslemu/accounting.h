// mslemu accounting: what a launch moved and synchronised, for traffic budgets and
// roofline estimates.  Only in counting builds (-DMSLEMU_ACCOUNTING, mslemu.Library(...,
// accounting=True)): the kernel TU is compiled with clang's address-sanitizer
// instrumentation in callback mode, so every load and store the optimised kernel really
// performs calls __asan_load<N>/__asan_store<N> below, which attribute it to a bound
// buffer or to threadgroup memory.  Normal builds carry none of this.
//
// A counting launch runs on one worker thread, so the counters need no atomics and the
// per-threadgroup "first touch" maps are exact.
#pragma once
#ifdef MSLEMU_ACCOUNTING
#define MSLEMU_NOASAN __attribute__((no_sanitize("address")))

namespace mslemu {

struct AcctBuf {
  uintptr_t base = 0, end = 0;
  uint8_t *seen = nullptr;   // per byte: bit 0 read, bit 1 written (launch-unique)
  uint32_t *tg_r = nullptr;  // per byte: 1 + index of the last threadgroup that read it
  uint32_t *tg_w = nullptr;
};

// The first lane's n-th device access in a simdgroup, to spot broadcasts by the others.
struct AcctSeen {
  uintptr_t addr;
  uint32_t n;
  uint32_t tg;  // 1 + threadgroup index: entries of earlier threadgroups are stale
};

struct Acct {
  mslemu_counts c{};
  AcctSeen *seen_by_sg[32] = {};  // [simdgroup][access ordinal]
  uint32_t seen_cap[32] = {};
  AcctBuf bufs[MSLEMU_MAX_COUNTED_BUFFERS];
  uint32_t n_bufs = 0;
  uintptr_t tg_ranges[MSLEMU_MAX_COUNTED_BUFFERS + 1][2] = {};  // threadgroup memory of the worker
  uint32_t n_tg_ranges = 0;
  uint32_t tg_id = 0;  // 1 + linear index of the running threadgroup
  bool busy = false;   // inside acct_access (its own accesses do not count)
  ~Acct() {
    for (auto *p : seen_by_sg) free(p);
    for (uint32_t i = 0; i < n_bufs; ++i) {
      delete[] bufs[i].seen;
      delete[] bufs[i].tg_r;
      delete[] bufs[i].tg_w;
    }
  }
};

// The library's only extra TLS (static TLS is scarce for dlopened libraries: runtime.h).
inline thread_local Acct *tl_acct __attribute__((tls_model("initial-exec"))) = nullptr;

// Called for every instrumented access.  Only accesses made by a kernel fiber count (the
// scheduler's own bookkeeping runs with tl_fiber == nullptr); plain loops and pointers
// only: anything instrumented called from here would recurse.
MSLEMU_NOASAN inline void acct_access(uintptr_t a, size_t n, bool write) {
  Acct *A = tl_acct;
  if (!A || !tl_fiber || A->busy) return;
  const bool mute = tl_fiber->mute;
  A->busy = true;
  for (uint32_t i = 0; i < A->n_tg_ranges; ++i)
    if (a >= A->tg_ranges[i][0] && a < A->tg_ranges[i][1]) {
      if (!mute) (write ? A->c.threadgroup_written : A->c.threadgroup_read) += n;
      A->busy = false;
      return;
    }
  for (uint32_t i = 0; i < A->n_bufs; ++i) {
    AcctBuf &b = A->bufs[i];
    if (a < b.base || a >= b.end) continue;
    if (!write) ++tl_fiber->acct_loads[i];  // lane utilisation counts muted lanes' loads too
    if (mute) {  // keep this lane's access ordinals aligned with the leader's
      ++tl_fiber->acct_seq;
      break;
    }
    uintptr_t e = a + n > b.end ? b.end : a + n;  // an access running off the end counts what is inside
    mslemu_buffer_counts &bc = A->c.buffers[i];
    const uint8_t bit = write ? 2 : 1;
    uint32_t *last = write ? b.tg_w : b.tg_r;
    (write ? bc.written : bc.read) += e - a;
    // simdgroup broadcast: same ordinal, same address and size as the simdgroup's first lane
    Fiber *f = tl_fiber;
    uint32_t k = f->acct_seq++, sg = f->sg;
    if (k >= A->seen_cap[sg]) {
      uint32_t cap = k < 1024 ? 1024 : 2 * k;
      AcctSeen *p = (AcctSeen *)realloc(A->seen_by_sg[sg], cap * sizeof(AcctSeen));
      if (!p) abort();  // out of memory for the accounting tables
      for (uint32_t j = A->seen_cap[sg]; j < cap; ++j) p[j].tg = 0;
      A->seen_by_sg[sg] = p;
      A->seen_cap[sg] = cap;
    }
    AcctSeen &s = A->seen_by_sg[sg][k];
    if (s.tg != A->tg_id) {
      s = AcctSeen{a, (uint32_t)n, A->tg_id};
      (write ? bc.written_simd : bc.read_simd) += e - a;
    } else if (s.addr != a || s.n != n) {
      (write ? bc.written_simd : bc.read_simd) += e - a;
    }
    for (uintptr_t p = a; p < e; ++p) {
      size_t o = p - b.base;
      if (!(b.seen[o] & bit)) {
        b.seen[o] |= bit;
        ++(write ? bc.written_unique : bc.read_unique);
      }
      if (last[o] != A->tg_id) {
        last[o] = A->tg_id;
        ++(write ? bc.written_tg_unique : bc.read_tg_unique);
      }
    }
    break;  // an address bound twice counts for the first binding
  }
  A->busy = false;
}

// Lane utilisation of a finished threadgroup: per simdgroup and buffer, the device loads
// of its lanes against 32 x its busiest lane's.  The lanes of a simdgroup issue together,
// so a lane with fewer loads than the busiest (or a lane missing from a partial
// simdgroup) idled while its siblings loaded.  Per buffer, so a host can leave out its
// args struct; generic: it needs nothing from the kernel.
inline void acct_lanes(Acct &A, const Fiber *fibers, uint32_t T) {
  for (uint32_t s0 = 0; s0 < T; s0 += kSimdWidth) {
    bool uneven = false;
    for (uint32_t b = 0; b < A.n_bufs; ++b) {
      uint64_t sum = 0, most = 0;
      for (uint32_t t = s0; t < T && t < s0 + kSimdWidth; ++t) {
        sum += fibers[t].acct_loads[b];
        if (fibers[t].acct_loads[b] > most) most = fibers[t].acct_loads[b];
      }
      A.c.buffers[b].lane_loads += sum;
      A.c.buffers[b].lane_load_slots += kSimdWidth * most;
      uneven |= sum < kSimdWidth * most;
    }
    if (uneven) ++A.c.uneven_simdgroups;
  }
}

// The buffers of a launch, with per-byte maps sized to them.
inline void acct_begin(Acct &A, const mslemu_launch *L) {
  A.n_bufs = L->n_buffers < MSLEMU_MAX_COUNTED_BUFFERS ? L->n_buffers : MSLEMU_MAX_COUNTED_BUFFERS;
  A.c.n_buffers = A.n_bufs;
  for (uint32_t i = 0; i < A.n_bufs; ++i) {
    uint64_t size = L->buffer_sizes ? L->buffer_sizes[i] : 0;
    if (!L->buffers[i] || !size) continue;
    AcctBuf &b = A.bufs[i];
    b.base = (uintptr_t)L->buffers[i];
    b.end = b.base + size;
    b.seen = new uint8_t[size]();
    b.tg_r = new uint32_t[size]();
    b.tg_w = new uint32_t[size]();
  }
}

// Threadgroup memory of the worker (variables arena + [[threadgroup(i)]]).
inline void acct_worker(Acct &A, Worker &w) {
  A.n_tg_ranges = 0;
  A.tg_ranges[A.n_tg_ranges][0] = (uintptr_t)w.tg_arena.data();
  A.tg_ranges[A.n_tg_ranges++][1] = (uintptr_t)w.tg_arena.data() + w.tg_arena.size();
  for (auto &m : w.tg_mem) {
    if (m.empty() || A.n_tg_ranges > MSLEMU_MAX_COUNTED_BUFFERS) continue;
    A.tg_ranges[A.n_tg_ranges][0] = (uintptr_t)m.data();
    A.tg_ranges[A.n_tg_ranges++][1] = (uintptr_t)m.data() + m.size();
  }
}

// simdgroup-matrix work and poisoning count once per simdgroup / not at all (runtime.h)
inline bool acct_simd_leader() { return simd_leader(); }
using AcctMute = AccessMute;

}  // namespace mslemu

#ifdef MSLEMU_IMPLEMENTATION
#define MSLEMU_ON_ACCESS(a, n, write) mslemu::acct_access(a, n, write)
#include "mslemu/asan_hooks.h"
#undef MSLEMU_ON_ACCESS
#endif  // MSLEMU_IMPLEMENTATION
#endif  // MSLEMU_ACCOUNTING
