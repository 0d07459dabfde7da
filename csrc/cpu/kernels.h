// The table of row kernels one ISA translation unit provides, and the entry points to each table.
// A row kernel works on the column range [c0, c1) of one row, so rows can be split across threads.
#pragma once

#include <cstdint>

namespace scatter_add {
namespace cpu {

// out_row[c] = round(out_row[c] + sum_k w[ids[k]] * src[ids[k] * src_stride + c]), summed in k order
// in the accumulator type (float for f32/bf16/f16, double for f64). w (accumulator type, indexed
// by source id) is ignored by the unweighted kernel.
using AddRowFn = void (*)(void* out_row, const void* src, int64_t src_stride, const int64_t* ids,
                          int64_t n, const void* w, int64_t c0, int64_t c1);
// dst_row[c] = round(w * x_row[c]) for c in [c0, c1), w converted to the accumulator type.
using ScaleRowFn = void (*)(void* dst_row, const void* x_row, double w, int64_t c0, int64_t c1);

struct KernelTable {
  AddRowFn add[4][2];  // [DType][weighted]
  ScaleRowFn scale[4];  // [DType]
};

const KernelTable& kernels_scalar();
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();
const KernelTable& kernels_avx512_bf16();

}  // namespace cpu
}  // namespace scatter_add
