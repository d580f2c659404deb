// Stub for tools/apple_check (see runtime.h). On Apple these are declared
// without prototypes (OBJC_OLD_DISPATCH_PROTOTYPES=0); metal-cpp casts them.
// The _fpret/_stret variants exist on x86-64 Macs only; metal-cpp refers to
// them when the target is not arm64, which is the case for this Linux check.
#pragma once

#include <objc/runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

void objc_msgSend(void);
void objc_msgSend_fpret(void);
void objc_msgSend_stret(void);

#ifdef __cplusplus
}
#endif
