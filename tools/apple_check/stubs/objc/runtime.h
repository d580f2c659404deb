// Stub for tools/apple_check: the Objective-C runtime declarations metal-cpp
// uses, with their Apple signatures. Type-checking only, never linked.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef struct objc_class* Class;
struct objc_object {
  Class isa;
};
typedef struct objc_object* id;
typedef struct objc_selector* SEL;
typedef signed char BOOL;
#ifdef __cplusplus
class Protocol;
#else
typedef struct objc_object Protocol;
#endif

id objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);
SEL sel_registerName(const char* str);

#ifdef __cplusplus
}
#endif
