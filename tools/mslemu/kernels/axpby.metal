// y[r, c] = alpha * x[r, c] + beta * y[r, c] over strided 2-D views: exercises the
// args-header convention (uint32_t/int64_t/uint64_t fields shared with C++).
#include <metal_stdlib>
#include "axpby_args.h"
using namespace metal;

static_assert(sizeof(AxpbyArgs) == 48, "AxpbyArgs layout differs from the host");

kernel void axpby_f32(
        constant AxpbyArgs & args [[buffer(0)]],
        device const float * x    [[buffer(1)]],
        device       float * y    [[buffer(2)]],
        uint2 pos [[thread_position_in_grid]]) {
    if (pos.x >= args.n_cols || pos.y >= args.n_rows) {
        return;
    }
    const int64_t xi = (int64_t) args.x_offset + (int64_t) pos.y * args.x_row_stride + pos.x;
    const int64_t yi = (int64_t) args.y_offset + (int64_t) pos.y * args.y_row_stride + pos.x;
    y[yi] = args.alpha * x[xi] + args.beta * y[yi];
}
