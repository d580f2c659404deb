// Arguments of axpby.metal, shared by the kernel and host C++ -- the layout of every
// vllm-metal src/metal/<op>_args.h: plain fixed-width fields, 64-bit strides and offsets
// (in elements), bound at buffer(0).  The host side static_asserts size and offsets.
#pragma once
#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstdint>
#endif

struct AxpbyArgs {
    uint32_t n_cols;        // elements per row
    uint32_t n_rows;
    int64_t  x_row_stride;  // may be negative (rows read in reverse)
    int64_t  y_row_stride;
    uint64_t x_offset;      // element offset of row 0 of x
    uint64_t y_offset;
    float    alpha;
    float    beta;
};
