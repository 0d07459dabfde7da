// Argument checks of the public entry points. Everything here runs before the first write, so an
// error leaves the output untouched. Messages name the argument, the position and the value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "scatter_add/scatter_add.h"

namespace scatter_add {
namespace cpu {

[[noreturn]] void fail(const char* op, Error::Kind kind, const std::string& msg);

// Shapes, dtypes, strides, null pointers, address-space overflow and overlap of index_add_rows'
// arguments (k is the index length; index_bytes its size, 0 when a plan is passed).
void check_add_args(const char* op, const Matrix& out, const ConstMatrix& src,
                    const WeightVector& weight, int64_t k, const void* index_data,
                    size_t index_bytes);
// The same for gather_rows.
void check_gather_args(const char* op, const Matrix& dst, const ConstMatrix& x,
                       const WeightVector& weight, const void* index_data, size_t index_bytes);
// The same for small_matmul: bf16 views y [m, o], x [m, h], w [o, h], y overlapping neither.
// nn: y = x @ w with w [h, o] (small_matmul_nn) rather than x @ w.T with w [o, h].
void check_small_matmul_args(const char* op, const Matrix& y, const ConstMatrix& x, const ConstMatrix& w,
                             bool nn = false);
// check_small_matmul_args for each block's product, and the groups: groups >= 1 dividing w's rows,
// ends non-decreasing within [0, x.rows].
void check_small_matmul_grouped_args(const char* op, const Matrix& y, const ConstMatrix& x, const ConstMatrix& w,
                                     const int64_t* ends, int64_t groups);
// The index vector itself (type, length against the [K, D] operand, null data).
void check_index(const char* op, const IndexVector& index, int64_t k_expected, const char* rows_of);
// A plan must match the [N, D] operand's rows, the [K, D] operand's rows and ignore_index.
void check_plan(const char* op, const Plan& plan, int64_t n, const char* n_name, int64_t k,
                const char* k_name, const Options& options);

size_t index_bytes(const IndexVector& index);

// Set bits of a word. The generic code is built for any x86-64, where __builtin_popcountll is a
// call into libgcc (no POPCNT instruction): this takes a dozen instructions inline.
inline int popcount64(uint64_t x) {
  x -= (x >> 1) & 0x5555555555555555ull;
  x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
  x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
  return static_cast<int>((x * 0x0101010101010101ull) >> 56);
}

// What one pass over the index values learns; bad values throw Error(index) naming the first.
struct IndexScan {
  int64_t kept = 0;      // entries not equal to ignore_index
  int64_t repeated = 0;  // rows that appear more than once (only when `seen` was given)
  bool sorted = false;   // values non-decreasing (only when asked for)
};
// Validates every value against [0, n) (ignore excepted). With `seen` (n bits, zeroed by the
// caller), also marks each kept row; with `repeated` too, each row met a second time; with `block_counts` (zeroed, (n >> block_shift) + 1 entries), counts kept
// entries per block of 2^block_shift rows.
IndexScan scan_index(const IndexVector& index, int64_t n, std::optional<int64_t> ignore,
                     uint64_t* seen = nullptr, uint64_t* repeated = nullptr,
                     int64_t* block_counts = nullptr, int block_shift = 0, bool want_sorted = false);

}  // namespace cpu
}  // namespace scatter_add
