// clang's address-sanitizer entry points in callback mode (-fsanitize=address -mllvm
// -asan-instrumentation-with-call-threshold=0, no stack or global instrumentation), for the
// instrumented builds (counting: accounting.h, checking: checks.h). Every load and store the
// optimised kernel performs, and its mem intrinsics, report to MSLEMU_ON_ACCESS(address,
// bytes, is_write), which the including header defines. Included once, inside
// MSLEMU_IMPLEMENTATION.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

extern "C" {
static void *(*volatile mslemu_real_memcpy)(void *, const void *, size_t) = memcpy;
static void *(*volatile mslemu_real_memmove)(void *, const void *, size_t) = memmove;
static void *(*volatile mslemu_real_memset)(void *, int, size_t) = memset;
MSLEMU_NOASAN void __asan_init() {}
MSLEMU_NOASAN void __asan_version_mismatch_check_v8() {}
MSLEMU_NOASAN void __asan_handle_no_return() {}
#define MSLEMU_ASAN_SIZED(n)                                                                          \
  MSLEMU_NOASAN void __asan_load##n(uintptr_t a) { MSLEMU_ON_ACCESS(a, n, false); }                   \
  MSLEMU_NOASAN void __asan_store##n(uintptr_t a) { MSLEMU_ON_ACCESS(a, n, true); }
MSLEMU_ASAN_SIZED(1)
MSLEMU_ASAN_SIZED(2)
MSLEMU_ASAN_SIZED(4)
MSLEMU_ASAN_SIZED(8)
MSLEMU_ASAN_SIZED(16)
#undef MSLEMU_ASAN_SIZED
MSLEMU_NOASAN void __asan_loadN(uintptr_t a, size_t n) { MSLEMU_ON_ACCESS(a, n, false); }
MSLEMU_NOASAN void __asan_storeN(uintptr_t a, size_t n) { MSLEMU_ON_ACCESS(a, n, true); }
// memcpy/memset/memmove in instrumented code (struct copies of GGUF blocks, ...)
MSLEMU_NOASAN void *__asan_memcpy(void *d, const void *s, size_t n) {
  MSLEMU_ON_ACCESS((uintptr_t)s, n, false);
  MSLEMU_ON_ACCESS((uintptr_t)d, n, true);
  return mslemu_real_memcpy(d, s, n);
}
MSLEMU_NOASAN void *__asan_memmove(void *d, const void *s, size_t n) {
  MSLEMU_ON_ACCESS((uintptr_t)s, n, false);
  MSLEMU_ON_ACCESS((uintptr_t)d, n, true);
  return mslemu_real_memmove(d, s, n);
}
MSLEMU_NOASAN void *__asan_memset(void *d, int c, size_t n) {
  MSLEMU_ON_ACCESS((uintptr_t)d, n, true);
  return mslemu_real_memset(d, c, n);
}
// what clang calls for mem intrinsics inside no_sanitize functions
MSLEMU_NOASAN void *__sanitizer_internal_memcpy(void *d, const void *s, size_t n) { return mslemu_real_memcpy(d, s, n); }
MSLEMU_NOASAN void *__sanitizer_internal_memmove(void *d, const void *s, size_t n) { return mslemu_real_memmove(d, s, n); }
MSLEMU_NOASAN void *__sanitizer_internal_memset(void *d, int c, size_t n) { return mslemu_real_memset(d, c, n); }
}
