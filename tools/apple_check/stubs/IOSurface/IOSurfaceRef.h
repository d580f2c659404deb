// Stub for tools/apple_check.
#pragma once

typedef struct __IOSurface* IOSurfaceRef;
