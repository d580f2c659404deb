// Stub for tools/apple_check: libdispatch object types as seen from C++.
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
