// The only C++ that includes torch, and only torch's stable ABI (torch/csrc/stable, torch/headeronly):
// one binary runs on every torch from TORCH_TARGET_VERSION on. It holds the schemas of the per-build
// op namespace TORCH_EXTENSION_NAME, the CPU (and, with SCATTER_ADD_CUDA, CUDA) implementations over
// the torch-free core, and an empty abi3 Python module whose import runs the registrations. The fake
// (meta) implementations and autograd are registered from Python with torch.library.
//
//   scatter_add_(Tensor(a!) input, Tensor index, Tensor src, Tensor? weight, int? ignore_index) -> ()
//   index_add(Tensor input, Tensor index, Tensor src, Tensor? weight, int? ignore_index) -> Tensor
//   gather(Tensor input, Tensor index, Tensor? weight, int? ignore_index) -> Tensor
//
// Errors. Through the stable ABI a kernel can only raise RuntimeError, so every error this file
// raises is a std::runtime_error whose message is "<Kind>: <op>: <what>": IndexError for bad index
// values, ValueError for shapes, dtypes, devices, strides, overlap and bad argument values,
// TypeError for None given for a tensor argument (any other wrong argument type is refused by
// torch's schema check before a kernel runs). The messages are word for word those of the fake
// kernels' checks (scatter_add/_checks.py). Python sees exactly that message; the Python API
// re-raises it as <Kind>. Every check runs before the first write, so input is untouched after any
// error.
#if defined(SCATTER_ADD_NO_PYTHON_H)
// No Python headers on the build machine (python3-dev missing, as it may be on a GPU image): the
// few declarations the empty module below needs, as the stable ABI (abi3) has fixed them since
// Python 3.2: the module definition's layout and PyModule_Create2 with PYTHON_ABI_VERSION 3.
#include <cstddef>
extern "C" {
typedef struct _object PyObject;
struct SaPyModuleDefBase {
  std::ptrdiff_t ob_refcnt;
  void* ob_type;
  PyObject* (*m_init)(void);
  std::ptrdiff_t m_index;
  PyObject* m_copy;
};
struct PyModuleDef {
  SaPyModuleDefBase m_base;
  const char* m_name;
  const char* m_doc;
  std::ptrdiff_t m_size;
  void *m_methods, *m_slots, *m_traverse, *m_clear, *m_free;
};
PyObject* PyModule_Create2(PyModuleDef* def, int apiver);
}
#define PyMODINIT_FUNC __attribute__((visibility("default"))) PyObject*
#define PyModuleDef_HEAD_INIT {1, nullptr, nullptr, 0, nullptr}
#define PyModule_Create(def) PyModule_Create2(def, 3)
#else
#define Py_LIMITED_API 0x03090000
#include <Python.h>
#endif

// Without a target version the headers allow everything the installed torch has, and the binary
// would silently need that torch or newer. With one, every header outside the stable ABI
// (ATen/ATen.h, torch/library.h, c10/cuda/...) stops the build with #error.
#ifndef TORCH_TARGET_VERSION
#error "compile with -DTORCH_TARGET_VERSION=<(major << 56) | (minor << 48)>, the oldest torch to support"
#endif

// torch >= 2.14's headers reach shim functions newer than the target through dlsym (on their
// error path). glibc 2.34 moved dlsym into libc under a new symbol version, which a module linked
// here would require; every glibc still exports the original version (libdl's before 2.34, a
// compatibility alias in libc since), so the reference is bound to that one. See also
// manylinux_compat.cpp.
#if defined(__GLIBC__) && defined(__x86_64__)
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
#elif defined(__GLIBC__) && defined(__aarch64__)
__asm__(".symver dlsym,dlsym@GLIBC_2.17");
#endif

#if defined(SCATTER_ADD_CUDA) || defined(CUDA_KERNEL)
#define SA_WITH_CUDA 1
#ifndef USE_CUDA
#define USE_CUDA 1  // the C shim declares its CUDA entry points (the current stream) under USE_CUDA
#endif
#endif

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "scatter_add/scatter_add.h"

#if defined(SA_WITH_CUDA)
#include <torch/csrc/stable/accelerator.h>

#include "scatter_add_cuda.h"
#endif

#ifndef TORCH_EXTENSION_NAME
#error "compile with -DTORCH_EXTENSION_NAME=<per-build op namespace>"
#endif

namespace sa = scatter_add;
using torch::stable::Tensor;

namespace scatter_add_torch {
namespace {

// --- errors ----------------------------------------------------------------------------------

enum class Kind { index, value, type };

// Throws "<Kind>: <op>: <what...>" (see the top of the file).
template <class... A>
[[noreturn]] void fail(Kind kind, const char* op, const A&... what) {
  std::ostringstream s;
  s << (kind == Kind::index ? "IndexError: " : kind == Kind::value ? "ValueError: " : "TypeError: ") << op
    << ": ";
  (s << ... << what);
  throw std::runtime_error(s.str());
}

// --- tensor metadata, read once per tensor through the C shim ---------------------------------

// The shim's dtype and device codes this file compares against, read once when the library loads.
struct Codes {
  int32_t f32, f64, bf16, f16, i32, i64;
  int32_t cpu, cuda, meta;
};
const Codes kCodes = {aoti_torch_dtype_float32(),     aoti_torch_dtype_float64(),
                      aoti_torch_dtype_bfloat16(),    aoti_torch_dtype_float16(),
                      aoti_torch_dtype_int32(),       aoti_torch_dtype_int64(),
                      aoti_torch_device_type_cpu(),   aoti_torch_device_type_cuda(),
                      aoti_torch_device_type_meta()};

// What the checks read from one tensor: a handful of shim calls, each made once per call of an op.
struct Info {
  const Tensor* t = nullptr;
  int64_t dim = 0;
  const int64_t* size = nullptr;    // [dim], borrowed from the tensor
  const int64_t* stride = nullptr;  // [dim], borrowed from the tensor
  int32_t dtype = 0, device_type = 0, device_index = 0;

  explicit Info(const Tensor& x) : t(&x) {
    AtenTensorHandle h = x.get();
    int64_t* p = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(h, &dim));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(h, &p));
    size = p;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(h, &p));
    stride = p;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(h, &dtype));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(h, &device_type));
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(h, &device_index));
  }
  bool same_device(const Info& o) const {
    return device_type == o.device_type && device_index == o.device_index;
  }
  void* data() const { return t->data_ptr(); }
};

// Messages print shapes, dtypes and devices as torch does: [6, 4], Float, cuda:0.
struct Shape {
  const Info& i;
};
std::ostream& operator<<(std::ostream& s, Shape x) {
  s << '[';
  for (int64_t d = 0; d < x.i.dim; ++d) s << (d ? ", " : "") << x.i.size[d];
  return s << ']';
}
struct DTypeName {
  const Info& i;
};
std::ostream& operator<<(std::ostream& s, DTypeName x) {
  try {
    return s << torch::headeronly::toString(x.i.t->scalar_type());
  } catch (const std::exception&) {  // a dtype newer than the target version's headers
    return s << "dtype code " << x.i.dtype;
  }
}
struct DeviceName {
  const Info& i;
};
std::ostream& operator<<(std::ostream& s, DeviceName x) {
  const int32_t t = x.i.device_type;
  if (t == kCodes.cpu) s << "cpu";
  else if (t == kCodes.cuda) s << "cuda";
  else if (t == kCodes.meta) s << "meta";
  else if (t == aoti_torch_device_type_xpu()) s << "xpu";
  else if (t == aoti_torch_device_type_mps()) s << "mps";
  else s << "device type " << t;
  if (x.i.device_index >= 0) s << ':' << x.i.device_index;
  return s;
}

bool is_data_dtype(int32_t d) {
  return d == kCodes.f32 || d == kCodes.f64 || d == kCodes.bf16 || d == kCodes.f16;
}

sa::DType core_dtype(int32_t d) {
  if (d == kCodes.f32) return sa::DType::f32;
  if (d == kCodes.f64) return sa::DType::f64;
  if (d == kCodes.bf16) return sa::DType::bf16;
  return sa::DType::f16;  // is_data_dtype() was checked before
}

int64_t element_size(int32_t d) {
  if (d == kCodes.f64 || d == kCodes.i64) return 8;
  if (d == kCodes.f32 || d == kCodes.i32) return 4;
  if (d == kCodes.bf16 || d == kCodes.f16) return 2;
  return static_cast<int64_t>(aoti_torch_dtype_element_size(d));
}

// --- argument checks ---------------------------------------------------------------------------

void check_args(const char* op, const Info& input, const Info& index, const Info* src,
                const Info* weight) {
  if (input.dim != 2) fail(Kind::value, op, "input must be 2-D [N, D], got shape ", Shape{input});
  if (index.dim != 1) fail(Kind::value, op, "index must be 1-D [K], got shape ", Shape{index});
  if (index.dtype != kCodes.i32 && index.dtype != kCodes.i64)
    fail(Kind::value, op, "index must be int32 or int64, got ", DTypeName{index});
  if (!is_data_dtype(input.dtype))
    fail(Kind::value, op, "input must be float32, float64, bfloat16 or float16, got ", DTypeName{input});
  if (!index.same_device(input))
    fail(Kind::value, op, "index is on ", DeviceName{index}, " but input is on ", DeviceName{input});
  const int64_t k = index.size[0];
  if (src != nullptr) {
    if (src->dim != 2) fail(Kind::value, op, "src must be 2-D [K, D], got shape ", Shape{*src});
    if (src->dtype != input.dtype)
      fail(Kind::value, op, "src dtype ", DTypeName{*src}, " does not match input dtype ", DTypeName{input});
    if (!src->same_device(input))
      fail(Kind::value, op, "src is on ", DeviceName{*src}, " but input is on ", DeviceName{input});
    if (src->size[0] != k)
      fail(Kind::value, op, "src has ", src->size[0], " rows but index has ", k, " entries");
    if (src->size[1] != input.size[1])
      fail(Kind::value, op, "src has ", src->size[1], " columns but input has ", input.size[1]);
  }
  if (weight != nullptr) {
    if (weight->dim != 1 || weight->size[0] != k)
      fail(Kind::value, op, "weight must be 1-D with ", k, " entries (one per index), got shape ",
           Shape{*weight});
    if (!is_data_dtype(weight->dtype))
      fail(Kind::value, op, "weight must be float32, float64, bfloat16 or float16, got ", DTypeName{*weight});
    if (!weight->same_device(input))
      fail(Kind::value, op, "weight is on ", DeviceName{*weight}, " but input is on ", DeviceName{input});
  }
}

// --- overlap, decided on the elements each view touches (the core's views_may_overlap) ----------

// A 1-D or 2-D tensor as the strided view the core's overlap test takes, with its real strides, so
// that interleaved views (b[:, ::2] and b[:, 1::2]) are told apart element by element. A 1-D tensor
// is one row; a transpose is taken as its rows (the same elements), which the test can compare
// with other rows.
sa::StridedView overlap_view(const Info& i) {
  sa::StridedView v;
  v.data = i.data();
  v.element_size = static_cast<size_t>(element_size(i.dtype));
  if (i.dim == 1) {
    v.rows = 1, v.row_stride = 0, v.cols = i.size[0], v.col_stride = i.stride[0];
  } else {
    v.rows = i.size[0], v.row_stride = i.stride[0], v.cols = i.size[1], v.col_stride = i.stride[1];
    if (v.rows > 1 && v.cols > 1 && v.row_stride == 1 && v.col_stride != 1) {  // a transpose
      std::swap(v.rows, v.cols);
      std::swap(v.row_stride, v.col_stride);
    }
  }
  return v;
}

// The test is exact for two views with the same strides. A dimension of one element may take any
// stride, and a view turned (its rows as columns) touches the same elements: `b` is turned, and
// the strides of such dimensions in either view are set, when that gives the two views the same
// strides.
void align_strides(sa::StridedView& a, sa::StridedView& b) {
  auto match = [](int64_t n, int64_t& s, int64_t m, int64_t& t) {  // (size, stride) pairs
    if (n > 1 && m > 1) return s == t;
    if (n > 1) t = s;
    else if (m > 1) s = t;
    else s = t = 0;
    return true;
  };
  sa::StridedView x = a, y = b;
  if (match(x.rows, x.row_stride, y.rows, y.row_stride) && match(x.cols, x.col_stride, y.cols, y.col_stride)) {
    a = x, b = y;
    return;
  }
  x = a, y = b;
  std::swap(y.rows, y.cols);
  std::swap(y.row_stride, y.col_stride);
  if (match(x.rows, x.row_stride, y.rows, y.row_stride) && match(x.cols, x.col_stride, y.cols, y.col_stride))
    a = x, b = y;
}

// The destination of an in-place op: no two of its elements may be one memory location (an
// expanded tensor), since the kernels write every element once and in parallel.
void check_writable(const char* op, const Info& input) {
  const int64_t r = input.size[0], c = input.size[1];
  if (r <= 1 && c <= 1) return;
  const int64_t s0 = input.stride[0], s1 = input.stride[1];
  if (c <= 1 || s1 == 1) {
    if (r > 1 && s0 < c)
      fail(Kind::value, op, "input row stride ", s0, " is smaller than its row length ", c,
           " (rows would alias; expanded tensors cannot be written in place)");
    return;
  }
  // Two dimensions (a, na), (b, nb) alias when di*a == dj*b for some 0 < di < na, 0 < dj < nb: the
  // smallest such pair is (b/g, a/g), g = gcd(a, b); a zero stride over more than one element
  // aliases at once.
  bool alias = (r > 1 && s0 == 0) || (c > 1 && s1 == 0);
  if (!alias && r > 1 && c > 1) {
    const int64_t g = std::gcd(s0, s1);
    alias = s1 / g < r && s0 / g < c;
  }
  if (alias)
    fail(Kind::value, op, "input has elements that share memory (shape ", Shape{input}, ", strides [",
         s0, ", ", s1, "]; expanded tensors cannot be written in place)");
}

void check_no_overlap(const char* op, const Info& input, const Info& other, const char* other_name) {
  sa::StridedView a = overlap_view(input), b = overlap_view(other);
  align_strides(a, b);
  if (sa::views_may_overlap(a, b))
    fail(Kind::value, op, other_name, " memory overlaps input (in-place aliasing is not supported)");
}

// --- tensors made here, through the C shim's direct entry points (no dispatcher lookup) ---------

Tensor empty_2d(int64_t rows, int64_t cols, int32_t dtype, const Info& like) {
  const int64_t size[2] = {rows, cols}, stride[2] = {cols, 1};
  AtenTensorHandle h = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(
      aoti_torch_empty_strided(2, size, stride, dtype, like.device_type, like.device_index, &h));
  return Tensor(h);
}

Tensor empty_1d(int64_t n, int32_t dtype, const Info& like) {
  const int64_t size[1] = {n}, stride[1] = {1};
  AtenTensorHandle h = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(
      aoti_torch_empty_strided(1, size, stride, dtype, like.device_type, like.device_index, &h));
  return Tensor(h);
}

void copy_into(const Tensor& dst, const Tensor& src) {
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_copy_(dst.get(), src.get(), 0));
}

// A dense copy of a 1-D or 2-D tensor, in `dtype`.
Tensor dense_copy(const Tensor& x, const Info& i, int32_t dtype) {
  Tensor out = i.dim == 1 ? empty_1d(i.size[0], dtype, i) : empty_2d(i.size[0], i.size[1], dtype, i);
  copy_into(out, x);
  return out;
}

// --- views for the core --------------------------------------------------------------------------

// Rows the core can read or write in place: unit column stride (or one column).
bool unit_columns(const Info& i) { return i.size[1] <= 1 || i.stride[1] == 1; }
bool dense_1d(const Info& i) { return i.size[0] <= 1 || i.stride[0] == 1; }

// A tensor as the core reads it: the tensor itself when its layout suits the core, else a dense
// copy (in `dtype`, which may differ from the tensor's: the CUDA kernels take float32 / float64
// weights).
struct Operand {
  Tensor t;
  Info info;
  Operand(const Tensor& x, const Info& i, bool usable, int32_t dtype)
      : t(usable && dtype == i.dtype ? x : dense_copy(x, i, dtype)), info(t.get() == x.get() ? i : Info(t)) {}
  Operand(const Tensor& x, const Info& i, bool usable) : Operand(x, i, usable, i.dtype) {}
};

// A 2-D tensor with unit column stride as the core's view of its rows.
sa::Matrix matrix_of(const Info& i) {
  const int64_t stride = i.size[0] > 1 ? i.stride[0] : i.size[1];
  return {i.data(), i.size[0], i.size[1], stride, core_dtype(i.dtype)};
}
sa::Matrix matrix_of(const Operand& m) { return matrix_of(m.info); }

sa::IndexVector index_of(const Operand& m) {
  return {m.t.data_ptr(), m.info.size[0],
          m.info.dtype == kCodes.i32 ? sa::IndexType::i32 : sa::IndexType::i64};
}

sa::WeightVector weight_of(const std::optional<Operand>& w) {
  if (!w) return {};
  return {w->t.data_ptr(), w->info.size[0], core_dtype(w->info.dtype)};
}

// Calls into the core, whose errors read "<core function>: <what>": the op's name replaces the
// function's, and the error's kind becomes the tag.
template <class F>
void call_core(const char* op, F&& f) {
  try {
    f();
  } catch (const sa::Error& e) {
    const char* msg = e.what();
    const char* colon = std::strstr(msg, ": ");
    fail(e.kind() == sa::Error::Kind::index ? Kind::index : Kind::value, op,
         colon != nullptr ? colon + 2 : msg);
  }
}

// --- the ops, for any backend ---------------------------------------------------------------------
//
// A backend B provides:
//   static int32_t weight_dtype(int32_t weight, int32_t data)   the dtype its kernels take weights in
//   static void add(Matrix out, IndexVector, ConstMatrix src, WeightVector, optional<int64_t> ignore,
//                   const Info& input)
//   static void gather(Matrix dst, ConstMatrix x, IndexVector, WeightVector, optional<int64_t>,
//                      const Info& input)

// None given for a Tensor argument reaches a kernel as an undefined tensor: refused before any shim
// call reads it.
const Tensor& defined(const char* op, const char* name, const Tensor& t) {
  if (!t.defined()) fail(Kind::type, op, name, " must be a tensor, got None");
  return t;
}

struct Args {
  Info in, ix;
  std::optional<Info> sr, wi;
  Args(const char* op, const Tensor& input, const Tensor& index, const Tensor* src,
       const std::optional<Tensor>& weight)
      : in(defined(op, "input", input)), ix(defined(op, "index", index)) {
    if (src != nullptr) sr.emplace(defined(op, "src", *src));
    if (weight) wi.emplace(defined(op, "weight", *weight));
  }
};

// out[index[i]] += weight[i] * src[i] for checked arguments, in place in `out` (a contiguous copy
// is made and copied back when out has a column stride).
template <class B>
void add_checked(const char* op, const Tensor& out, const Info& oi, const Tensor& index, const Args& a,
                 const Tensor& src, const std::optional<Tensor>& weight,
                 std::optional<int64_t> ignore_index) {
  const bool direct = unit_columns(oi);
  const Operand o(out, oi, direct);
  // src is read in place when its rows suit the core, and when the core's own overlap test, which
  // compares rows, finds them apart from out's: its elements were found apart from input's above,
  // so a copy settles only what that test cannot (as with views of other row strides).
  bool src_direct = unit_columns(*a.sr);
  if (src_direct && direct) src_direct = !sa::views_may_overlap(matrix_of(o), matrix_of(*a.sr));
  const Operand s(src, *a.sr, src_direct);
  const Operand i(index, a.ix, dense_1d(a.ix));
  std::optional<Operand> w;
  if (weight) w.emplace(*weight, *a.wi, dense_1d(*a.wi), B::weight_dtype(a.wi->dtype, oi.dtype));
  call_core(op, [&] { B::add(matrix_of(o), index_of(i), matrix_of(s), weight_of(w), ignore_index, oi); });
  if (!direct) copy_into(out, o.t);
}

template <class B>
void scatter_add_op(const Tensor& input, const Tensor& index, const Tensor& src,
                    const std::optional<Tensor> weight, std::optional<int64_t> ignore_index) {
  const char* op = "scatter_add";
  const Args a(op, input, index, &src, weight);
  check_args(op, a.in, a.ix, &*a.sr, a.wi ? &*a.wi : nullptr);
  check_writable(op, a.in);
  check_no_overlap(op, a.in, *a.sr, "src");
  check_no_overlap(op, a.in, a.ix, "index");
  if (a.wi) check_no_overlap(op, a.in, *a.wi, "weight");
  add_checked<B>(op, input, a.in, index, a, src, weight, ignore_index);
}

// index_add: scatter_add_ into a fresh contiguous copy of input, which overlaps nothing.
template <class B>
Tensor index_add_op(const Tensor& input, const Tensor& index, const Tensor& src,
                    const std::optional<Tensor> weight, std::optional<int64_t> ignore_index) {
  const char* op = "index_add";
  const Args a(op, input, index, &src, weight);
  check_args(op, a.in, a.ix, &*a.sr, a.wi ? &*a.wi : nullptr);
  Tensor out = dense_copy(input, a.in, a.in.dtype);
  const Info oi(out);
  add_checked<B>(op, out, oi, index, a, src, weight, ignore_index);
  return out;
}

template <class B>
Tensor gather_op(const Tensor& input, const Tensor& index, const std::optional<Tensor> weight,
                 std::optional<int64_t> ignore_index) {
  const char* op = "gather";
  const Args a(op, input, index, nullptr, weight);
  check_args(op, a.in, a.ix, nullptr, a.wi ? &*a.wi : nullptr);
  const Operand x(input, a.in, unit_columns(a.in));
  const Operand i(index, a.ix, dense_1d(a.ix));
  std::optional<Operand> w;
  if (weight) w.emplace(*weight, *a.wi, dense_1d(*a.wi), B::weight_dtype(a.wi->dtype, a.in.dtype));
  Tensor dst = empty_2d(a.ix.size[0], a.in.size[1], a.in.dtype, a.in);
  const Operand d(dst, Info(dst), true);
  call_core(op, [&] { B::gather(matrix_of(d), matrix_of(x), index_of(i), weight_of(w), ignore_index, a.in); });
  return dst;
}

// --- backends ------------------------------------------------------------------------------------

struct Cpu {
  static int32_t weight_dtype(int32_t weight, int32_t) { return weight; }  // any of the four
  static sa::Options options(std::optional<int64_t> ignore_index) {
    sa::Options o;
    o.ignore_index = ignore_index;
    o.num_threads = static_cast<int>(torch::stable::get_num_threads());  // torch's, as set_num_threads
    return o;
  }
  static void add(const sa::Matrix& out, const sa::IndexVector& index, const sa::ConstMatrix& src,
                  const sa::WeightVector& weight, std::optional<int64_t> ignore_index, const Info&) {
    sa::index_add_rows(out, index, src, weight, options(ignore_index));
  }
  static void gather(const sa::Matrix& dst, const sa::ConstMatrix& x, const sa::IndexVector& index,
                     const sa::WeightVector& weight, std::optional<int64_t> ignore_index, const Info&) {
    sa::gather_rows(dst, x, index, weight, options(ignore_index));
  }
};

// y = x @ w.T (small_matmul) or x @ w (small_matmul_nn) for bfloat16 CPU matrices (an MoE
// expert's products, see sa::small_matmul); false, with y untouched, where the core has no
// kernel for the call (the caller multiplies with torch). y, x and w: 2-D, rows with unit
// column stride.
template <bool NN>
bool small_matmul_op(const Tensor& y, const Tensor& x, const Tensor& w) {
  const char* op = NN ? "small_matmul_nn" : "small_matmul";
  const Info oi(defined(op, "y", y)), xi(defined(op, "x", x)), wi(defined(op, "w", w));
  const std::pair<const char*, const Info*> args[] = {{"y", &oi}, {"x", &xi}, {"w", &wi}};
  for (const auto& [name, i] : args) {
    if (i->device_type != kCodes.cpu) fail(Kind::value, op, name, " must be on the CPU, got ", DeviceName{*i});
    if (i->dim != 2) fail(Kind::value, op, name, " must be 2-D, got shape ", Shape{*i});
    if (i->dtype != kCodes.bf16) fail(Kind::value, op, name, " must be BFloat16, got ", DTypeName{*i});
    if (!unit_columns(*i)) fail(Kind::value, op, name, " must have contiguous rows, got strides (", i->stride[0], ", ", i->stride[1], ")");
  }
  bool ran = false;
  call_core(op, [&] {
    ran = (NN ? sa::small_matmul_nn : sa::small_matmul)(matrix_of(oi), matrix_of(xi), matrix_of(wi), Cpu::options(std::nullopt));
  });
  return ran;
}

// small_matmul over blocks of rows (an MoE layer's experts in one call): y[block g] = x[block g]
// @ w[g].T, w [G, o, h] with its experts back to back (a range of an [E, o, h] parameter), block g
// the rows [ends[g - 1], ends[g]); ends 1-D int32 or int64 on the CPU, G entries.
bool small_matmul_grouped_op(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& ends) {
  const char* op = "small_matmul_grouped";
  const Info oi(defined(op, "y", y)), xi(defined(op, "x", x)), wi(defined(op, "w", w)), ei(defined(op, "ends", ends));
  const std::pair<const char*, const Info*> args[] = {{"y", &oi}, {"x", &xi}, {"w", &wi}, {"ends", &ei}};
  for (const auto& [name, i] : args)
    if (i->device_type != kCodes.cpu) fail(Kind::value, op, name, " must be on the CPU, got ", DeviceName{*i});
  for (const auto& [name, i] : {args[0], args[1]}) {
    if (i->dim != 2) fail(Kind::value, op, name, " must be 2-D, got shape ", Shape{*i});
    if (i->dtype != kCodes.bf16) fail(Kind::value, op, name, " must be BFloat16, got ", DTypeName{*i});
    if (!unit_columns(*i)) fail(Kind::value, op, name, " must have contiguous rows, got strides (", i->stride[0], ", ", i->stride[1], ")");
  }
  if (wi.dim != 3) fail(Kind::value, op, "w must be 3-D [experts, out, in], got shape ", Shape{wi});
  if (wi.dtype != kCodes.bf16) fail(Kind::value, op, "w must be BFloat16, got ", DTypeName{wi});
  const int64_t g = wi.size[0], o = wi.size[1], h = wi.size[2];
  if (g == 0) fail(Kind::value, op, "w must hold at least one expert, got shape ", Shape{wi});
  const int64_t row = o > 1 ? wi.stride[1] : h;
  if ((h > 1 && wi.stride[2] != 1) || (o > 1 && wi.stride[1] < h) || (g > 1 && o > 0 && wi.stride[0] != o * row))
    fail(Kind::value, op, "w must hold its experts' rows back to back (strides (o * s, s, 1), s >= in), got strides (",
         wi.stride[0], ", ", wi.stride[1], ", ", wi.stride[2], ")");
  if (ei.dim != 1 || ei.size[0] != g)
    fail(Kind::value, op, "ends must be 1-D with ", g, " entries (one per expert of w), got shape ", Shape{ei});
  if (ei.dtype != kCodes.i32 && ei.dtype != kCodes.i64)
    fail(Kind::value, op, "ends must be int32 or int64, got ", DTypeName{ei});
  std::vector<int64_t> e(static_cast<size_t>(g));
  const char* base = static_cast<const char*>(ei.data());
  for (int64_t i = 0; i < g; ++i)
    e[static_cast<size_t>(i)] = ei.dtype == kCodes.i32 ? reinterpret_cast<const int32_t*>(base)[i * ei.stride[0]]
                                                       : reinterpret_cast<const int64_t*>(base)[i * ei.stride[0]];
  int64_t rows = 0;
  if (__builtin_mul_overflow(g, o, &rows)) fail(Kind::value, op, "w has more rows than int64 holds, shape ", Shape{wi});
  const sa::ConstMatrix wm{wi.data(), rows, h, row, sa::DType::bf16};
  bool ran = false;
  call_core(op, [&] {
    ran = sa::small_matmul_grouped(matrix_of(oi), matrix_of(xi), wm, e.data(), g, Cpu::options(std::nullopt));
  });
  return ran;
}

// Whether small_matmul (and small_matmul_grouped) multiply on AMX tiles here (sa::amx_tiles):
// set = -1 asks; 0 or 1 turns the tiles off or on for the process (tests, benchmarks) and returns
// what is then in effect. x only places the call on the CPU. The MoE module asks once per
// process and routes its blocks by that answer: to run it without the tiles, set
// SCATTER_ADD_CPU_AMX=0 before the process starts.
bool small_matmul_tiles_op(const Tensor& x, int64_t set) {
  const char* op = "small_matmul_tiles";
  const Info xi(defined(op, "x", x));
  if (xi.device_type != kCodes.cpu) fail(Kind::value, op, "x must be on the CPU, got ", DeviceName{xi});
  if (set < -1 || set > 1) fail(Kind::value, op, "set must be -1 (ask), 0 (off) or 1 (on), got ", set);
  return set < 0 ? sa::amx_tiles() : sa::set_amx_tiles(set == 1);
}

#if defined(SA_WITH_CUDA)
// CUDA: weights in the accumulator dtype, a workspace from torch's caching allocator, torch's
// current stream on the input's device.
struct Cuda {
  static int32_t weight_dtype(int32_t, int32_t data) { return data == kCodes.f64 ? kCodes.f64 : kCodes.f32; }

  // SCATTER_ADD_CUDA_CHECK, read at every call (see csrc/cuda/scatter_add_cuda.h): how a bad index
  // value is reported. deferred (default, also when unset or empty): the call does not wait for
  // the GPU; the next call of this library made after the GPU ran the bad one raises IndexError and
  // does nothing itself. sync: the call waits for its stream and raises at once (for debugging).
  // trap: a device-side trap, a CUDA error at the next synchronisation. Called inside call_core,
  // which names the op in the message.
  static sa::cuda::IndexCheck index_check() {
    const char* v = std::getenv("SCATTER_ADD_CUDA_CHECK");
    if (v == nullptr || std::strcmp(v, "") == 0 || std::strcmp(v, "deferred") == 0)
      return sa::cuda::IndexCheck::deferred;
    if (std::strcmp(v, "sync") == 0) return sa::cuda::IndexCheck::sync;
    if (std::strcmp(v, "trap") == 0) return sa::cuda::IndexCheck::trap;
    throw sa::Error(sa::Error::Kind::value,
                    std::string("cuda: SCATTER_ADD_CUDA_CHECK must be 'deferred', 'sync' or 'trap', got '") + v + "'");
  }
  static cudaStream_t stream(const Info& like) {
    void* s = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(like.device_index, &s));
    return static_cast<cudaStream_t>(s);
  }
  static Tensor workspace(size_t bytes, const Info& like) {
    return empty_1d(static_cast<int64_t>(bytes), aoti_torch_dtype_uint8(), like);
  }
  static void add(const sa::Matrix& out, const sa::IndexVector& index, const sa::ConstMatrix& src,
                  const sa::WeightVector& weight, std::optional<int64_t> ignore_index, const Info& input) {
    const torch::stable::accelerator::DeviceGuard guard(input.device_index);
    const auto check = index_check();
    const size_t bytes = sa::cuda::workspace_bytes(index.size, out.rows);
    const Tensor ws = workspace(bytes, input);
    sa::cuda::index_add_rows(out, index, src, weight, ignore_index, ws.data_ptr(), bytes, stream(input), check);
  }
  static void gather(const sa::Matrix& dst, const sa::ConstMatrix& x, const sa::IndexVector& index,
                     const sa::WeightVector& weight, std::optional<int64_t> ignore_index, const Info& input) {
    const torch::stable::accelerator::DeviceGuard guard(input.device_index);
    const auto check = index_check();
    const size_t bytes = sa::cuda::gather_workspace_bytes();
    const Tensor ws = workspace(bytes, input);
    sa::cuda::gather_rows(dst, x, index, weight, ignore_index, ws.data_ptr(), bytes, stream(input), check);
  }
};
#endif

}  // namespace
}  // namespace scatter_add_torch

STABLE_TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("scatter_add_(Tensor(a!) input, Tensor index, Tensor src, Tensor? weight=None, "
        "int? ignore_index=None) -> ()");
  m.def("index_add(Tensor input, Tensor index, Tensor src, Tensor? weight=None, "
        "int? ignore_index=None) -> Tensor");
  m.def("gather(Tensor input, Tensor index, Tensor? weight=None, int? ignore_index=None) -> Tensor");
  // The same kernels under ops with nothing registered above the backend (no autograd, in-place or
  // batching kernels): the Python API calls these when a call has nothing to record, skipping the
  // dispatch-key guard the ops above would need (about 0.75 us of a 3-4 us tiny call).
  m.def("scatter_add_plain_(Tensor(a!) input, Tensor index, Tensor src, Tensor? weight=None, "
        "int? ignore_index=None) -> ()");
  m.def("index_add_plain(Tensor input, Tensor index, Tensor src, Tensor? weight=None, "
        "int? ignore_index=None) -> Tensor");
  m.def("gather_plain(Tensor input, Tensor index, Tensor? weight=None, int? ignore_index=None) -> Tensor");
  // y = x @ w.T (small_matmul) and y = x @ w (small_matmul_nn), bf16, CPU (the MoE experts'
  // products); each returns whether it ran. Nothing registered above the backend: callers use them
  // only with nothing to record.
  m.def("small_matmul(Tensor(a!) y, Tensor x, Tensor w) -> bool");
  m.def("small_matmul_nn(Tensor(a!) y, Tensor x, Tensor w) -> bool");
  m.def("small_matmul_grouped(Tensor(a!) y, Tensor x, Tensor w, Tensor ends) -> bool");
  m.def("small_matmul_tiles(Tensor x, int set=-1) -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  using B = scatter_add_torch::Cpu;
  m.impl("scatter_add_", TORCH_BOX(&scatter_add_torch::scatter_add_op<B>));
  m.impl("index_add", TORCH_BOX(&scatter_add_torch::index_add_op<B>));
  m.impl("gather", TORCH_BOX(&scatter_add_torch::gather_op<B>));
  m.impl("scatter_add_plain_", TORCH_BOX(&scatter_add_torch::scatter_add_op<B>));
  m.impl("index_add_plain", TORCH_BOX(&scatter_add_torch::index_add_op<B>));
  m.impl("gather_plain", TORCH_BOX(&scatter_add_torch::gather_op<B>));
  m.impl("small_matmul", TORCH_BOX(&scatter_add_torch::small_matmul_op<false>));
  m.impl("small_matmul_nn", TORCH_BOX(&scatter_add_torch::small_matmul_op<true>));
  m.impl("small_matmul_grouped", TORCH_BOX(&scatter_add_torch::small_matmul_grouped_op));
  m.impl("small_matmul_tiles", TORCH_BOX(&scatter_add_torch::small_matmul_tiles_op));
}

#if defined(SA_WITH_CUDA)
STABLE_TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m) {
  using B = scatter_add_torch::Cuda;
  m.impl("scatter_add_", TORCH_BOX(&scatter_add_torch::scatter_add_op<B>));
  m.impl("index_add", TORCH_BOX(&scatter_add_torch::index_add_op<B>));
  m.impl("gather", TORCH_BOX(&scatter_add_torch::gather_op<B>));
  m.impl("scatter_add_plain_", TORCH_BOX(&scatter_add_torch::scatter_add_op<B>));
  m.impl("index_add_plain", TORCH_BOX(&scatter_add_torch::index_add_op<B>));
  m.impl("gather_plain", TORCH_BOX(&scatter_add_torch::gather_op<B>));
}
#endif

// The module itself is empty: importing it runs the registrations above. It is the only symbol the
// library exports (see torch-ext/CMakeLists.txt).
#define SA_CAT(a, b) a##b
#define SA_PYINIT(name) SA_CAT(PyInit_, name)
#define SA_STR2(x) #x
#define SA_STR(x) SA_STR2(x)
extern "C" PyMODINIT_FUNC SA_PYINIT(TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, SA_STR(TORCH_EXTENSION_NAME), nullptr, 0,
                            nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
