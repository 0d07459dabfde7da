// scatter_add: exact, deterministic row-wise scatter-add and gather. Public C++ API, no torch.
//
//   index_add_rows:  out[index[i], :] += weight[i] * src[i, :]     for i < K  (weight optional, 1)
//   gather_rows:     dst[i, :] = weight[i] * x[index[i], :]        for i < K  (weight optional, 1)
//
// Matrices are row-major views: a pointer, rows, cols, a row stride in elements and a dtype;
// the column stride is 1. bf16/fp16 rows are accumulated in float32 and float64 in float64, then
// rounded once per output element. Duplicate indices are summed in source-row order, so results
// are bitwise identical for every thread count and every run. Every argument is validated before
// the first write: on error a scatter_add::Error is thrown and the output is left untouched.
// Every pointer must be aligned to its element size (a misaligned one is refused).
//
// Summation contract (the same bits whatever runs): each output element starts from out's value,
// adds its contributions in increasing source order as fma(w, s, acc) (acc + s unweighted) in
// float32 (float64 for f64), and is rounded once to the storage type, round-to-nearest-even,
// keeping subnormals. Every CPU strategy, ISA level and thread count gives these bits (a NaN's
// payload and sign may differ: where two NaNs meet, which one an add keeps depends on the walk).
//
// Strategies (CPU): index_add_rows picks one by a cost model (csrc/cpu/policy.h), gather_rows
// copies by the index (the model's pick at every shape measured); any one can be forced with
// Options::strategy, set_strategy() or SCATTER_ADD_CPU_STRATEGY, for tests and benchmarks. All
// give the same bits.
//
// Plans: a Plan is the sort of an index by destination row (CSR). Build it once and pass it to
// many index_add_rows/gather_rows calls that share the index (MoE forward + backward).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace scatter_add {

enum class DType : int { f32 = 0, f64 = 1, bf16 = 2, f16 = 3 };
enum class IndexType : int { i32 = 0, i64 = 1 };

const char* dtype_name(DType t);
size_t dtype_size(DType t);

// A read-only [rows, cols] view. row_stride is in elements; any value >= 0 is accepted for inputs.
struct ConstMatrix {
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  DType dtype = DType::f32;
};

// A writable [rows, cols] view. row_stride >= cols when rows > 1 (rows may not alias each other).
struct Matrix {
  void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  DType dtype = DType::f32;
  operator ConstMatrix() const { return {data, rows, cols, row_stride, dtype}; }
};

// A contiguous 1-D index of int32 or int64 values.
struct IndexVector {
  const void* data = nullptr;
  int64_t size = 0;
  IndexType type = IndexType::i64;
};

// An optional contiguous 1-D weight (any float dtype). data == nullptr means "no weight" (all 1).
struct WeightVector {
  const void* data = nullptr;
  int64_t size = 0;
  DType dtype = DType::f32;
};

// How index_add_rows runs on the CPU.
//   direct  no sort: sources are walked in order and added into their rows (bf16/fp16 rows that
//           receive several contributions are summed in a float32 scratch of the touched rows)
//   count   a plan by counting sort, O(N + K), then each destination row summed by one thread
//   radix   a plan by radix sort of (row, source) pairs, O(K) per 8-11 bits of N, then the same
// And gather_rows: direct copies row by row in index order; count and radix build a plan by
// that sort and copy each x row once to all its destinations.
enum class Strategy : int { automatic = 0, direct = 1, count = 2, radix = 3 };
const char* strategy_name(Strategy s);  // "auto", "direct", "count", "radix"

struct Options {
  std::optional<int64_t> ignore_index;  // index value to skip (gather writes zero rows for it)
  int num_threads = 0;                  // 0: the default (set_num_threads or hardware concurrency)
  Strategy strategy = Strategy::automatic;  // automatic: set_strategy()'s, else the cost model's
};

// Thrown on bad input. kind says which Python exception a binding should raise.
class Error : public std::runtime_error {
 public:
  enum class Kind { index, value };
  Error(Kind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// Counting sort of an index by destination row: a CSR of source rows per touched destination row.
// Source ids inside each row are in increasing order, which fixes the summation order.
class Plan {
 public:
  // Validates every index value against [0, num_rows) (ignore_index excepted) and builds the plan
  // by counting or radix sort, whichever the cost model (or `method`: count or radix) picks.
  static Plan build(const IndexVector& index, int64_t num_rows,
                    std::optional<int64_t> ignore_index = std::nullopt,
                    Strategy method = Strategy::automatic);
  // Same, reusing this plan's memory.
  void rebuild(const IndexVector& index, int64_t num_rows,
               std::optional<int64_t> ignore_index = std::nullopt,
               Strategy method = Strategy::automatic);

  int64_t num_rows() const { return num_rows_; }        // N, the destination row count
  int64_t num_entries() const { return num_entries_; }  // K, the index length
  int64_t num_distinct() const { return static_cast<int64_t>(rows_.size()); }  // R
  std::optional<int64_t> ignore_index() const { return ignore_index_; }

  const std::vector<int64_t>& rows() const { return rows_; }        // [R] distinct rows, ascending
  const std::vector<int64_t>& offsets() const { return offsets_; }  // [R + 1]
  const std::vector<int64_t>& sources() const { return sources_; }  // [kept] source ids by row
  const std::vector<int64_t>& ignored() const { return ignored_; }  // source ids equal to ignore
  // Bytes of memory the plan's buffers hold, which rebuild reuses.
  size_t capacity_bytes() const;

 private:
  int64_t num_rows_ = 0;
  int64_t num_entries_ = 0;
  std::optional<int64_t> ignore_index_;
  std::vector<int64_t> rows_, offsets_, sources_, ignored_;
  std::vector<int64_t> scratch_;  // sort scratch kept for rebuild
};

// out[index[i], :] += weight[i] * src[i, :]. out is [N, D], src is [K, D].
void index_add_rows(const Matrix& out, const IndexVector& index, const ConstMatrix& src,
                    const WeightVector& weight = {}, const Options& options = {});
// The same with a prebuilt plan (its ignore_index is used; options.ignore_index must match or be
// unset).
void index_add_rows(const Matrix& out, const Plan& plan, const ConstMatrix& src,
                    const WeightVector& weight = {}, const Options& options = {});

// dst[i, :] = weight[i] * x[index[i], :]; rows with ignore_index become zero. x is [N, D], dst is [K, D].
void gather_rows(const Matrix& dst, const ConstMatrix& x, const IndexVector& index,
                 const WeightVector& weight = {}, const Options& options = {});
void gather_rows(const Matrix& dst, const ConstMatrix& x, const Plan& plan,
                 const WeightVector& weight = {}, const Options& options = {});

// y = x @ w.T for bfloat16 x [m, h], w [o, h] (an expert's weight as transformers stores it) and
// y [m, o]: each element the float32 sum of its h products (each product of two bf16 values is
// exact in float32 unless it overflows or underflows; summed in 8 or 16 lanes, then the lanes in a
// fixed order), rounded once. Made for an MoE expert's products: each
// row of w is read once for a few rows of x, and a tile of w rows is passed by every row of x
// while it is in the cache. Threads split the rows of w, and each element is summed by the same
// operations whatever the number of rows, so the bits depend on neither (they do depend on the
// ISA level: 8 lanes at avx2, 16 from avx512; and on AMX tiles, see amx_tiles(), for rows of up
// to 65536 columns, each element is summed in 32-column steps by the tiles' dot products, with w's tiles read as they lie and x
// packed once per call; the tiles count subnormal inputs as zero and flush subnormal sums to
// zero, as torch's own bf16 products on AMX do). Returns false, writing nothing, when no kernel
// serves the call (the scalar level); throws Error on a dtype, shape or overlap problem.
bool small_matmul(const Matrix& y, const ConstMatrix& x, const ConstMatrix& w, const Options& options = {});

// y = x @ w for bfloat16 x [m, h], w [h, o] and y [m, o] (the products of an expert's backward:
// g @ W_e for the input's gradient, g.T @ x for the weight's, with x.T / g.T copied by the
// caller): each element the float32 sum of its h products, one FMA per product in increasing
// order of h, rounded once; the same bits on every thread count, row count and ISA level.
// Returns false, writing nothing, at the scalar level; throws Error as small_matmul does ("x has
// 16 columns but w has 15 rows", "y has shape [2, 4] but x @ w has shape [2, 5]").
bool small_matmul_nn(const Matrix& y, const ConstMatrix& x, const ConstMatrix& w, const Options& options = {});

// small_matmul over the blocks of an MoE layer's experts in one call: w holds `groups` weights of
// o rows each back to back ([groups * o, h], an [E, o, h] parameter or a range of its experts),
// and rows [ends[g - 1], ends[g]) of x and y (ends[-1] = 0) are block g: y[block] = x[block] @
// w_g.T. Rows of y from ends[groups - 1] on are not written. Every element has the bits that
// small_matmul gives for its block alone; threads split the o columns and walk every block, so a
// call is one parallel region where a loop of small_matmul calls pays one per block. Returns
// false, writing nothing, at the scalar level; throws Error as small_matmul does, and for the
// groups ("w has 10 rows, not a multiple of groups = 3", "ends[1] = 2 is smaller than ends[0] =
// 3", "ends[2] = 9 is past x's 8 rows").
bool small_matmul_grouped(const Matrix& y, const ConstMatrix& x, const ConstMatrix& w, const int64_t* ends,
                          int64_t groups, const Options& options = {});

// True when two row-major views may share an element: exact for views with the same row stride
// and rows no longer than it (e.g. two column slices of one matrix) and for single-row views,
// conservative (true when their byte ranges meet) otherwise. A 1-D buffer is a one-row view.
bool views_may_overlap(const ConstMatrix& a, const ConstMatrix& b);

// A 2-D view with any strides: element (i, j) is element_size bytes at
// data + (i * row_stride + j * col_stride) * element_size, strides in elements and >= 0.
struct StridedView {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0, row_stride = 0, col_stride = 1;
  size_t element_size = 1;
};
// The same question for strided views: exact when both have the same strides and element size
// (e.g. interleaved columns b[:, ::2] and b[:, 1::2]) or reduce to row-major views as above,
// conservative otherwise (or when deciding would take more than 2^16 steps).
bool views_may_overlap(const StridedView& a, const StridedView& b);

// Threads: the default count used when Options::num_threads == 0. 0 restores hardware concurrency.
void set_num_threads(int n);
int get_num_threads();

// CPU instruction-set level of the row kernels. SCATTER_ADD_CPU_ISA=scalar|avx2|avx512|avx512_bf16
// caps the level (it never raises it above what the CPU and OS support; an unknown name leaves
// the best level in place).
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3 };
const char* isa_name(Isa isa);
// The best level this CPU and OS support, at most the highest level compiled (CMake's
// SCATTER_ADD_MAX_ISA, every level by default).
Isa supported_isa();
Isa active_isa();     // the level in use (after SCATTER_ADD_CPU_ISA and set_isa)
// Forces a level for tests (clamped to supported_isa()); returns the level now in use.
Isa set_isa(Isa isa);
// Whether small_matmul and small_matmul_grouped multiply on AMX tiles: at the avx512_bf16 level,
// on a CPU with AMX-BF16 whose OS grants this process the tile state (Linux 5.16 or later), in a
// build whose compiler has AMX, unless SCATTER_ADD_CPU_AMX=0 (read once) or set_amx_tiles(false).
// The sums are float32 in 32-column steps, rounded once, but not in the order of the vector
// kernels: their bits differ from the same call without tiles.
bool amx_tiles();
// Turns the tiles on or off for tests and benchmarks; returns amx_tiles() after the change.
bool set_amx_tiles(bool on);

// The process-wide strategy used when Options::strategy is automatic: SCATTER_ADD_CPU_STRATEGY
// (auto, direct, count or radix; read once, an unknown name raises Error at the first call) or
// set_strategy(). automatic means the cost model chooses.
Strategy get_strategy();
void set_strategy(Strategy s);

}  // namespace scatter_add
