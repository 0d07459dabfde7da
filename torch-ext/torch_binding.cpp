// The only C++ that includes torch: schemas of the per-build op namespace TORCH_EXTENSION_NAME,
// the CPU (and, with SCATTER_ADD_CUDA, CUDA) implementations over the torch-free core, the Meta
// implementations used by FakeTensor / torch.compile, and an empty abi3 Python module whose
// import runs the registrations. Autograd is registered from Python with torch.library.
//
//   scatter_add_(Tensor(a!) input, Tensor index, Tensor src, Tensor? weight, int? ignore_index) -> ()
//   index_add(Tensor input, Tensor index, Tensor src, Tensor? weight, int? ignore_index) -> Tensor
//   gather(Tensor input, Tensor index, Tensor? weight, int? ignore_index) -> Tensor
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "scatter_add/scatter_add.h"

#if defined(SCATTER_ADD_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "scatter_add_cuda.h"
#endif

#ifndef TORCH_EXTENSION_NAME
#error "compile with -DTORCH_EXTENSION_NAME=<per-build op namespace>"
#endif

namespace sa = scatter_add;
using at::Tensor;

namespace scatter_add_torch {

sa::DType to_dtype(const Tensor& t, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return sa::DType::f32;
    case at::kDouble: return sa::DType::f64;
    case at::kBFloat16: return sa::DType::bf16;
    case at::kHalf: return sa::DType::f16;
    default:
      TORCH_CHECK_VALUE(false, arg, " must be float32, float64, bfloat16 or float16, got ",
                        t.scalar_type());
  }
}

namespace {

std::string shape_of(const Tensor& t) { return c10::str(t.sizes()); }

// [begin, end) bytes a strided tensor can touch; empty for numel() == 0.
std::pair<uintptr_t, uintptr_t> byte_span(const Tensor& t) {
  if (t.numel() == 0) return {0, 0};
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t ext = (t.size(d) - 1) * t.stride(d);
    (ext < 0 ? lo : hi) += ext;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const int64_t es = static_cast<int64_t>(t.element_size());
  return {base + lo * es, base + (hi + 1) * es};
}

bool overlap(const Tensor& a, const Tensor& b) {
  auto x = byte_span(a), y = byte_span(b);
  return x.first < x.second && y.first < y.second && x.first < y.second && y.first < x.second;
}

}  // namespace

void check_args(const char* op, const Tensor& input, const Tensor& index, const Tensor* src,
                const c10::optional<Tensor>& weight) {
  TORCH_CHECK_VALUE(input.dim() == 2, op, ": input must be 2-D [N, D], got shape ", shape_of(input));
  TORCH_CHECK_VALUE(index.dim() == 1, op, ": index must be 1-D [K], got shape ", shape_of(index));
  TORCH_CHECK(index.scalar_type() == at::kInt || index.scalar_type() == at::kLong, op,
              ": index must be int32 or int64, got ", index.scalar_type());
  to_dtype(input, "input");
  TORCH_CHECK(index.device() == input.device(), op, ": index is on ", index.device(),
              " but input is on ", input.device());
  const int64_t k = index.size(0);
  if (src != nullptr) {
    TORCH_CHECK_VALUE(src->dim() == 2, op, ": src must be 2-D [K, D], got shape ", shape_of(*src));
    TORCH_CHECK(src->scalar_type() == input.scalar_type(), op, ": src dtype ", src->scalar_type(),
                " does not match input dtype ", input.scalar_type());
    TORCH_CHECK(src->device() == input.device(), op, ": src is on ", src->device(),
                " but input is on ", input.device());
    TORCH_CHECK_VALUE(src->size(0) == k, op, ": src has ", src->size(0), " rows but index has ", k,
                      " entries");
    TORCH_CHECK_VALUE(src->size(1) == input.size(1), op, ": src has ", src->size(1),
                      " columns but input has ", input.size(1));
  }
  if (weight.has_value()) {
    const Tensor& w = *weight;
    TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == k, op, ": weight must be 1-D with ", k,
                      " entries (one per index), got shape ", shape_of(w));
    TORCH_CHECK(at::isFloatingType(w.scalar_type()), op, ": weight must be a float tensor, got ",
                w.scalar_type());
    TORCH_CHECK(w.device() == input.device(), op, ": weight is on ", w.device(),
                " but input is on ", input.device());
  }
}

void check_no_overlap(const char* op, const Tensor& out, const char* out_name, const Tensor& other,
                      const char* other_name) {
  if (out.device().is_meta() || other.device().is_meta()) return;
  TORCH_CHECK_VALUE(!overlap(out, other), op, ": ", other_name, " memory overlaps ", out_name,
                    " (in-place aliasing is not supported)");
}

sa::Matrix matrix_of(const Tensor& t) {
  const int64_t stride = t.size(0) > 1 ? t.stride(0) : t.size(1);
  return {t.data_ptr(), t.size(0), t.size(1), stride, to_dtype(t, "tensor")};
}

bool unit_columns(const Tensor& t) {
  return (t.size(1) <= 1 || t.stride(1) == 1) && (t.size(0) <= 1 || t.stride(0) >= 0);
}

Tensor rows_view(const Tensor& t) { return unit_columns(t) ? t : t.contiguous(); }

sa::IndexVector index_of(const Tensor& index) {
  return {index.data_ptr(), index.numel(),
          index.scalar_type() == at::kInt ? sa::IndexType::i32 : sa::IndexType::i64};
}

sa::WeightVector weight_of(const c10::optional<Tensor>& w) {
  if (!w.has_value()) return {};
  return {w->data_ptr(), w->numel(), to_dtype(*w, "weight")};
}

// Calls into the core and turns its errors into IndexError / ValueError for Python, with the
// core's function name replaced by the op's.
template <class F>
void call_core(const char* op, F&& f) {
  try {
    f();
  } catch (const sa::Error& e) {
    // Core messages read "<core function>: <what>"; the op's name replaces the function's.
    std::string msg = e.what();
    const auto colon = msg.find(": ");
    if (colon != std::string::npos) msg = msg.substr(colon + 2);
    if (e.kind() == sa::Error::Kind::index) TORCH_CHECK_INDEX(false, op, ": ", msg);
    TORCH_CHECK_VALUE(false, op, ": ", msg);
  }
}

namespace {

sa::Options options_of(const c10::optional<int64_t>& ignore_index) {
  sa::Options o;
  if (ignore_index.has_value()) o.ignore_index = *ignore_index;
  o.num_threads = at::get_num_threads();
  return o;
}

// The tensor-level work shared by every backend: checks, views, the in-place copy-back; `core`
// runs the kernel on raw views: core(out, index, src_or_x, weight).
template <class Core>
void scatter_add_into(const char* op, const Tensor& input, const Tensor& index, const Tensor& src,
                      const c10::optional<Tensor>& weight, Core&& core) {
  check_args(op, input, index, &src, weight);
  check_no_overlap(op, input, "input", src, "src");
  check_no_overlap(op, input, "input", index, "index");
  if (weight) check_no_overlap(op, input, "input", *weight, "weight");
  const Tensor s = rows_view(src);
  const Tensor idx = index.contiguous();
  const c10::optional<Tensor> w = weight ? c10::optional<Tensor>(weight->contiguous()) : c10::nullopt;
  // A non-unit column stride in input: work on a contiguous copy, then copy back.
  const bool direct = unit_columns(input);
  Tensor out = direct ? input : input.contiguous();
  call_core(op, [&] { core(matrix_of(out), index_of(idx), matrix_of(s), weight_of(w)); });
  if (!direct) input.copy_(out);
}

template <class Core>
Tensor gather_from(const Tensor& input, const Tensor& index, const c10::optional<Tensor>& weight, Core&& core) {
  check_args("gather", input, index, nullptr, weight);
  const Tensor x = rows_view(input);
  const Tensor idx = index.contiguous();
  const c10::optional<Tensor> w = weight ? c10::optional<Tensor>(weight->contiguous()) : c10::nullopt;
  Tensor dst = at::empty({index.size(0), input.size(1)}, input.options());
  call_core("gather", [&] { core(matrix_of(dst), index_of(idx), matrix_of(x), weight_of(w)); });
  return dst;
}

void scatter_add_cpu(const Tensor& input, const Tensor& index, const Tensor& src,
                     const c10::optional<Tensor>& weight, c10::optional<int64_t> ignore_index) {
  scatter_add_into("scatter_add", input, index, src, weight, [&](auto o, auto i, auto s, auto w) {
    sa::index_add_rows(o, i, s, w, options_of(ignore_index));
  });
}


Tensor gather_cpu(const Tensor& input, const Tensor& index, const c10::optional<Tensor>& weight,
                  c10::optional<int64_t> ignore_index) {
  return gather_from(input, index, weight, [&](auto d, auto i, auto x, auto w) {
    sa::gather_rows(d, x, i, w, options_of(ignore_index));
  });
}

#if defined(SCATTER_ADD_CUDA)
// CUDA: weights converted to the accumulator dtype, a workspace from torch's caching allocator,
// the current stream.
c10::optional<Tensor> acc_weight(const c10::optional<Tensor>& w, const Tensor& data) {
  if (!w) return w;
  return w->to(data.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

Tensor cuda_workspace(const Tensor& index, size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, index.options().dtype(at::kByte));
}

// SCATTER_ADD_CUDA_CHECK=trap: report bad indices with a device-side trap instead of waiting for
// the stream (see csrc/cuda/scatter_add_cuda.h); read at every call.
sa::cuda::IndexCheck cuda_index_check() {
  const char* v = std::getenv("SCATTER_ADD_CUDA_CHECK");
  if (v == nullptr || std::strcmp(v, "") == 0 || std::strcmp(v, "host") == 0) return sa::cuda::IndexCheck::host_error;
  if (std::strcmp(v, "trap") == 0) return sa::cuda::IndexCheck::device_trap;
  TORCH_CHECK_VALUE(false, "SCATTER_ADD_CUDA_CHECK must be 'host' or 'trap', got '", v, "'");
}

void scatter_add_cuda(const Tensor& input, const Tensor& index, const Tensor& src,
                      const c10::optional<Tensor>& weight, c10::optional<int64_t> ignore_index) {
  const c10::cuda::CUDAGuard guard(input.device());
  check_args("scatter_add", input, index, &src, weight);
  const auto w = acc_weight(weight, input);
  const auto check = cuda_index_check();
  Tensor ws = cuda_workspace(index, sa::cuda::workspace_bytes(index.numel(), input.size(0), input.size(1),
                                                              to_dtype(input, "input")));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  scatter_add_into("scatter_add", input, index, src, w, [&](auto o, auto i, auto s, auto wv) {
    sa::cuda::index_add_rows(o, i, s, wv, ignore_index, ws.data_ptr(), ws.numel(), stream, check);
  });
}

Tensor gather_cuda(const Tensor& input, const Tensor& index, const c10::optional<Tensor>& weight,
                   c10::optional<int64_t> ignore_index) {
  const c10::cuda::CUDAGuard guard(input.device());
  check_args("gather", input, index, nullptr, weight);
  const auto w = acc_weight(weight, input);
  const auto check = cuda_index_check();
  Tensor ws = cuda_workspace(index, sa::cuda::gather_workspace_bytes());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  return gather_from(input, index, w, [&](auto d, auto i, auto x, auto wv) {
    sa::cuda::gather_rows(d, x, i, wv, ignore_index, ws.data_ptr(), ws.numel(), stream, check);
  });
}
#endif

// index_add = scatter_add_ into a contiguous clone, for any backend's scatter_add_.
using ScatterAddFn = void (*)(const Tensor&, const Tensor&, const Tensor&, const c10::optional<Tensor>&,
                              c10::optional<int64_t>);
template <ScatterAddFn ScatterAdd>
Tensor index_add_with(const Tensor& input, const Tensor& index, const Tensor& src,
                      const c10::optional<Tensor>& weight, c10::optional<int64_t> ignore_index) {
  check_args("index_add", input, index, &src, weight);
  Tensor out = input.clone(at::MemoryFormat::Contiguous);
  ScatterAdd(out, index, src, weight, ignore_index);
  return out;
}

}  // namespace
}  // namespace scatter_add_torch

#define SA_LIBRARY(NAME, M) TORCH_LIBRARY(NAME, M)
#define SA_LIBRARY_IMPL(NAME, KEY, M) TORCH_LIBRARY_IMPL(NAME, KEY, M)

SA_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("scatter_add_(Tensor(a!) input, Tensor index, Tensor src, Tensor? weight=None, "
        "int? ignore_index=None) -> ()");
  m.def("index_add(Tensor input, Tensor index, Tensor src, Tensor? weight=None, "
        "int? ignore_index=None) -> Tensor");
  m.def("gather(Tensor input, Tensor index, Tensor? weight=None, int? ignore_index=None) -> Tensor");
}

SA_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("scatter_add_", &scatter_add_torch::scatter_add_cpu);
  m.impl("index_add", &scatter_add_torch::index_add_with<&scatter_add_torch::scatter_add_cpu>);
  m.impl("gather", &scatter_add_torch::gather_cpu);
}

#if defined(SCATTER_ADD_CUDA)
SA_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m) {
  m.impl("scatter_add_", &scatter_add_torch::scatter_add_cuda);
  m.impl("index_add", &scatter_add_torch::index_add_with<&scatter_add_torch::scatter_add_cuda>);
  m.impl("gather", &scatter_add_torch::gather_cuda);
}
#endif

// The module itself is empty: importing it runs the registrations above.
#define SA_CAT(a, b) a##b
#define SA_PYINIT(name) SA_CAT(PyInit_, name)
#define SA_STR2(x) #x
#define SA_STR(x) SA_STR2(x)
extern "C" PyMODINIT_FUNC SA_PYINIT(TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, SA_STR(TORCH_EXTENSION_NAME), nullptr, 0,
                            nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
