// Stub for tools/apple_check: the CoreFoundation names metal-cpp uses, plus
// the standard C headers the real umbrella header pulls in (metal-cpp relies
// on them, e.g. INFINITY from <math.h>).
#pragma once

#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <locale.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef double CFTimeInterval;
typedef const struct __CFString* CFStringRef;
CFStringRef __CFStringMakeConstantString(const char* cStr);

#ifdef __cplusplus
}
#endif
