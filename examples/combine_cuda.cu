// The MoE combine step through the torch-free CUDA API (csrc/cuda/scatter_add_cuda.h): 6 tokens,
// 4 experts x capacity 2, bf16 rows, float32 routing weights, padding slots marked -1, on a
// stream, in memory the caller owns. A plan of the slot -> token index serves the combine and
// the gather that dispatches the gradient back to the slots. Then what a bad index does in the
// default (deferred) check mode and in sync mode. `make cuda` compiles it; it needs a GPU to run
// (scripts/gpu_check.sh runs it): .build/cuda/combine_cuda_example
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "scatter_add_cuda.h"

namespace sa = scatter_add;
namespace sc = scatter_add::cuda;

#define CHECK(call)                                                                  \
  do {                                                                               \
    const cudaError_t e = (call);                                                    \
    if (e != cudaSuccess) {                                                          \
      std::printf("%s failed: %s\n", #call, cudaGetErrorString(e));                  \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

int main() {
  const int64_t tokens = 6, slots = 8, hidden = 64;
  std::vector<__nv_bfloat16> expert_out(slots * hidden);
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t j = 0; j < hidden; ++j) expert_out[s * hidden + j] = __float2bfloat16(float(s + 1));
  const std::vector<int32_t> slot_token = {0, 3, 1, -1, 0, 2, 5, 4};  // -1: empty slot
  const std::vector<float> slot_weight = {0.5f, 1, 1, 1, 0.5f, 1, 1, 1};

  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  __nv_bfloat16 *y, *src, *grad_slots;
  int32_t* index;
  float* weight;
  CHECK(cudaMalloc(&y, tokens * hidden * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&src, slots * hidden * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&grad_slots, slots * hidden * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&index, slots * sizeof(int32_t)));
  CHECK(cudaMalloc(&weight, slots * sizeof(float)));
  CHECK(cudaMemsetAsync(y, 0, tokens * hidden * sizeof(__nv_bfloat16), stream));
  CHECK(cudaMemcpyAsync(src, expert_out.data(), expert_out.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice, stream));
  CHECK(cudaMemcpyAsync(index, slot_token.data(), slots * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  CHECK(cudaMemcpyAsync(weight, slot_weight.data(), slots * sizeof(float), cudaMemcpyHostToDevice, stream));

  const sa::Matrix out{y, tokens, hidden, hidden, sa::DType::bf16};
  const sa::ConstMatrix in{src, slots, hidden, hidden, sa::DType::bf16};
  const sa::IndexVector idx{index, slots, sa::IndexType::i32};
  const sa::WeightVector w{weight, slots, sa::DType::f32};
  // One plan for the combine (index_add) and the gradient's dispatch (gather), built once.
  void* plan_mem;
  const size_t plan_bytes = sc::Plan::bytes(slots, tokens);
  CHECK(cudaMalloc(&plan_mem, plan_bytes));
  try {
    const sc::Plan plan = sc::Plan::build(idx, tokens, /*ignore_index=*/-1, plan_mem, plan_bytes, stream);
    sc::index_add_rows(out, plan, in, w, stream);
    // d(y)/d(src) rows: grad_slots[s] = weight[s] * y[token(s)] (zero rows for empty slots).
    sc::gather_rows({grad_slots, slots, hidden, hidden, sa::DType::bf16}, out, plan, w, stream);
  } catch (const sa::Error& e) {
    std::printf("unexpected error: %s\n", e.what());
    return 1;
  }
  std::vector<__nv_bfloat16> host(tokens * hidden), grad(slots * hidden);
  CHECK(cudaMemcpyAsync(host.data(), y, host.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost, stream));
  CHECK(cudaMemcpyAsync(grad.data(), grad_slots, grad.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost, stream));
  CHECK(cudaStreamSynchronize(stream));
  // token 0 = 0.5 * 1 + 0.5 * 5 = 3; token 3 = slot 1 = 2; slot 4's gradient row = 0.5 * y[0] = 1.5
  std::printf("token 0: %g, token 3: %g, slot 4 grad: %g, empty slot 3 grad: %g\n", __bfloat162float(host[0]),
              __bfloat162float(host[3 * hidden]), __bfloat162float(grad[4 * hidden]), __bfloat162float(grad[3 * hidden]));
  if (__bfloat162float(host[0]) != 3.f || __bfloat162float(host[3 * hidden]) != 2.f ||
      __bfloat162float(grad[4 * hidden]) != 1.5f || __bfloat162float(grad[3 * hidden]) != 0.f)
    return 1;

  // A bad index (9 for 6 tokens) writes nothing. Deferred (the default): the call returns at once
  // and the error comes from check_errors(true) (or from the next call after the GPU ran it).
  const size_t ws_bytes = sc::workspace_bytes(slots, tokens);
  void* ws;
  CHECK(cudaMalloc(&ws, ws_bytes));
  const std::vector<int32_t> bad = {0, 3, 1, 9, 0, 2, 5, 4};
  CHECK(cudaMemcpyAsync(index, bad.data(), slots * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  try {
    sc::index_add_rows(out, idx, in, {}, -1, ws, ws_bytes, stream);
    std::printf("the call returned without waiting\n");
    sc::check_errors(/*wait=*/true);
    std::printf("no error for index 9\n");
    return 1;
  } catch (const sa::Error& e) {
    std::printf("deferred error as expected: %s\n", e.what());
  }
  // sync: the call waits for its stream and throws.
  try {
    sc::index_add_rows(out, idx, in, {}, -1, ws, ws_bytes, stream, sc::IndexCheck::sync);
    std::printf("no error for index 9 in sync mode\n");
    return 1;
  } catch (const sa::Error& e) {
    std::printf("sync error as expected: %s\n", e.what());
  }
  std::vector<__nv_bfloat16> after(tokens * hidden);
  CHECK(cudaMemcpy(after.data(), y, after.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < after.size(); ++i)
    if (__bfloat162float(after[i]) != __bfloat162float(host[i])) return 1;
  std::printf("y untouched after the errors\n");
  cudaFree(ws);
  cudaFree(plan_mem);
  cudaFree(weight);
  cudaFree(index);
  cudaFree(grad_slots);
  cudaFree(src);
  cudaFree(y);
  cudaStreamDestroy(stream);
  return 0;
}
