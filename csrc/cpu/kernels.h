// The table of kernels one ISA translation unit provides, and the entry points to each table.
// Every kernel works on a column range [c0, c1) so that wide rows can be split across threads,
// and every one follows the summation contract of scatter_add.h: acc starts from out's value,
// acc = fma(w, s, acc) (acc + s unweighted) per contribution in increasing source order, in the
// accumulator type (float for f32/bf16/f16, double for f64), rounded once to the storage type.
#pragma once

#include <cstddef>
#include <cstdint>

namespace scatter_add {
namespace cpu {

// Planned rows: plan rows [r0, r1) of a CSR (rows, offsets, sources), each summed into its out row.
struct RowsJob {
  void* out;
  int64_t out_stride;  // elements
  const void* src;
  int64_t src_stride;
  const int64_t* rows;
  const int64_t* offsets;
  const int64_t* sources;
  int64_t num_sources;  // offsets[R]; bounds the prefetch of upcoming source rows
  const void* w;        // accumulator type, indexed by source id; null when unweighted
  bool far;             // the walk moves more bytes than the caches hold (CpuPolicy::kFarWalkBytes)
};
using AddRowsFn = void (*)(const RowsJob& job, int64_t r0, int64_t r1, int64_t c0, int64_t c1);

// Direct: sources [i0, i1) in order, each added into out[index[i]] when that row is in
// [row_lo, row_hi) and the index is not ignored. The scratch kernels (bf16/fp16) add into a
// float32 scratch instead, scratch_stride accumulators per slot:
//   dense (slot_base null): every row r has slot r; slot_bits marks the touched rows
//   sparse: only the rows whose bit is set in slot_bits (rows with several contributions) have
//     a slot, slot_base[r >> 6] + the number of bits of slot_bits[r >> 6] below bit r & 63; any
//     other row is added in place (one contribution, one rounding)
struct DirectJob {
  void* out;
  int64_t out_stride;
  void* scratch;
  int64_t scratch_stride;
  const void* src;
  int64_t src_stride;
  const void* index;  // int32 or int64 (the kernel's template)
  const void* w;      // accumulator type, indexed by source id; null when unweighted
  bool has_ignore;
  int64_t ignore;
  int64_t row_lo, row_hi;
  const uint64_t* slot_bits;
  const int64_t* slot_base;
  bool prefetch;       // prefetch destination rows ahead (out larger than the caches)
  uint8_t* mark_rows;   // dense: the add sets byte r for each row r it touches (a plain store:
                        // a bit would be a read-modify-write, chained through memory)
  void* scratch_orig;   // dense, unmarked: the scratch as copied in (same layout); the copy back
                        // with no row set writes only the rows whose sum differs from it
  bool long_runs;       // sorted index whose runs are long: one-column runs summed run by run
  uint64_t* touched;    // touched slots (a slot per row, none filled in advance): bit r is set by
                        // row r's first contribution, which fills its slot from out
  bool compact;         // a row split's in-place walk: each block of entries compacted to this
                        // thread's own first (direct_compacts)
  bool every_entry;     // the direct walk adds every entry: none is ignored and every row is in
                        // [row_lo, row_hi) (false wherever a row split narrows them)
};
using AddDirectFn = void (*)(const DirectJob& job, int64_t i0, int64_t i1, int64_t c0, int64_t c1);

// The scratch rows: load (out -> scratch) or store (scratch -> out, rounding once) the rows whose
// bit is set in words [w0, w1) of `rows` (null: every row in [row_lo, row_hi); on the way back
// with a scratch_orig snapshot, only those whose sum differs from it); columns
// [c0, c1) of out at slot column c - c0.
using ScratchFn = void (*)(const DirectJob& job, const uint64_t* rows, int64_t w0, int64_t w1, int64_t c0,
                           int64_t c1, bool to_out);

// Gather: dst[i] = w[i] * x[index[i]] for i in [i0, i1); ignored rows become zero.
struct GatherJob {
  void* dst;
  int64_t dst_stride;
  const void* x;
  int64_t x_stride;
  const void* index;
  const void* w;  // accumulator type, indexed by i; null when unweighted
  bool has_ignore;
  int64_t ignore;
  bool stream;  // unweighted rows written by non-temporal stores (CpuPolicy::kStreamAboveBytes)
};
using GatherFn = void (*)(const GatherJob& job, int64_t i0, int64_t i1, int64_t c0, int64_t c1);

// dst_row[c] = round(w * x_row[c]) for c in [c0, c1), w converted to the accumulator type.
using ScaleRowFn = void (*)(void* dst_row, const void* x_row, double w, int64_t c0, int64_t c1);

// Small products (small_matmul.cpp): y[i][o] = round(sum over c of x[i][c] * w[o][c]) for
// rows i < m and w rows [o0, o1), bfloat16 in and out, each sum in float32. Every element is
// summed by the same operations whichever range it falls in, so a split changes no bits.
struct SmallMatmulJob {
  uint16_t* y;
  int64_t y_stride;
  const uint16_t* x;
  int64_t x_stride;
  const uint16_t* w;
  int64_t w_stride;
  int64_t m, cols;
  const float* xf;  // small_matmul_nn: x widened to float32, rows of `cols`
};
using SmallMatmulFn = void (*)(const SmallMatmulJob& job, int64_t o0, int64_t o1);
// small_matmul_nn: y[i][o] = round(sum over c of x[i][c] * w[c][o]) for columns [o0, o1), each
// sum one FMA per c in increasing order (AVX2, for every level from it: kernels_avx2.cpp).
void small_matmul_nn_avx2(const SmallMatmulJob& job, int64_t o0, int64_t o1);

// The index pass every call makes before its first write (validate.cpp, scan_index): whether any
// entry that is not ignore_index lies outside [0, n), how many are ignore_index, and (when asked)
// whether the index is sorted (non-decreasing). In each level's vectors: compiled for the
// baseline, the int64 compares had no vector form (SSE2) and the pass took a third of a float32
// D = 1 call's walk.
struct IndexCheck {
  bool bad;
  bool sorted;
  int64_t ignored;
};
using IndexCheckFn = IndexCheck (*)(const void* index, int64_t k, int64_t n, bool has_ignore, int64_t ignore,
                                    bool want_sorted);

// A two-thread row split's deal (strategy_direct.cpp): entries [i0, i1) copied, with their
// source rows and weights, to positions p0 on (rows below `cut`, the first thread's) and p1 on
// (the second's), upward; or, downward, from the last entry to the first, to positions p0 and p1
// down, so that the positions again hold the entries in increasing source order. An entry at
// ignore is dropped (the scalar loop stores it at `trash`, so that no store waits on a branch).
// Returns the positions after the last written of each thread (below the first, downward). The
// AVX-512 levels deal 16 entries (8 of an int64 index) at a time by compress and masked stores,
// for rows of 2 or 4 bytes back to back and weights of 4 bytes; the others entry by entry.
struct DealJob {
  const void* index;
  const unsigned char* src;
  size_t src_row_bytes;  // bytes from one source row to the next
  size_t row_bytes;      // bytes copied per row
  const unsigned char* w;
  size_t w_bytes;  // bytes per weight (0: none)
  int64_t cut;
  bool has_ignore;
  int64_t ignore;
  void* ids;
  unsigned char* rows;
  unsigned char* ws;
};
struct DealEnds {
  int64_t p0, p1;
};
using DealFn = DealEnds (*)(const DealJob& job, int64_t i0, int64_t i1, int64_t p0, int64_t p1, int64_t trash);

struct KernelTable {
  IndexCheckFn index_check[2];   // [index is int64]
  DealFn deal[2][2];             // [index is int64][downward]
  AddRowsFn rows[4][2];          // [DType][weighted]
  AddDirectFn direct[4][2][2];   // [DType][weighted][index is int64]
  AddDirectFn runs[4][2][2];     // a sorted index: runs summed in registers
  AddDirectFn scratch_add[4][2][2];  // bf16/f16 only: direct into the float32 scratch
  ScratchFn scratch_copy[4];     // bf16/f16 only
  GatherFn gather[4][2][2];      // [DType][weighted][index is int64]
  ScaleRowFn scale[4];           // [DType]
  SmallMatmulFn small_matmul;    // from the AVX2 level; null at the scalar one
  SmallMatmulFn small_matmul_nn;  // the same
};

const KernelTable& kernels_scalar();
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();
const KernelTable& kernels_avx512_bf16();
// kernels_avx512_bf16 with small_matmul on AMX tiles (built where the compiler has AMX; used
// where amx_tiles() is true).
const KernelTable& kernels_avx512_amx();

}  // namespace cpu
}  // namespace scatter_add
