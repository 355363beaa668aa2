// The CUDA kernels of the binding's ops: the library's GPU entry points (gpu_api.hpp) on the caller's
// device and torch's current stream, scratch from torch's caching allocator. Nothing here waits for the
// device, so the ops can be captured in CUDA graphs.
#include "gpu_api.hpp"
#include "ops_impl.hpp"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace vsa_torch {
namespace {

class cuda_backend {
public:
  static constexpr vsa::target target = vsa::target::gpu;
  explicit cuda_backend(const at::Tensor& x)
      : like_(x), guard_(check_cuda(x)), stream_(at::cuda::getCurrentCUDAStream(x.device().index()).stream()) {}
  static vsa::status forward_query(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                                   vsa::op_buffers& mem) {
    return gpu::forward(p, extra, opt, vsa::forward_io{}, mem, nullptr);
  }

  vsa::status tile(const vsa::problem& p, int64_t h, vsa::const_tensor x, vsa::tensor y) {
    return gpu::tile(p, h, x, y, stream_);
  }
  vsa::status untile(const vsa::problem& p, int64_t h, vsa::const_tensor x, vsa::tensor y) {
    return gpu::untile(p, h, x, y, stream_);
  }
  vsa::status forward(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                      const vsa::forward_io& io, vsa::op_buffers& mem) {
    return gpu::forward(p, extra, opt, io, mem, stream_);
  }
  vsa::status backward(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                       const vsa::backward_io& io, vsa::op_buffers& mem) {
    return gpu::backward(p, extra, opt, io, mem, stream_);
  }
  vsa::status selected_lists(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                             const void* state, vsa::const_index_lists& lists) {
    return gpu::selected_lists(p, extra, opt, state, lists);
  }
  vsa::status sparse_forward(const vsa::problem& p, float scale, vsa::const_tensor q, vsa::const_tensor k,
                             vsa::const_tensor v, vsa::const_index_lists lists, vsa::tensor o, float* lse) {
    return gpu::sparse_forward(p, scale, q, k, v, lists, o, lse, stream_);
  }
  vsa::status sparse_backward(const vsa::problem& p, float scale, vsa::const_tensor q, vsa::const_tensor k,
                              vsa::const_tensor v, vsa::const_tensor o, vsa::const_tensor d_o, const float* lse,
                              vsa::const_index_lists lists, vsa::tensor dq, vsa::tensor dk, vsa::tensor dv) {
    return with_scratch([&](void* ws, std::size_t& bytes) {
      return gpu::sparse_backward(p, scale, q, k, v, o, d_o, lse, lists, dq, dk, dv, ws, bytes, stream_);
    });
  }
  vsa::status linear_forward(const vsa::problem& p, vsa::feature_map phi, float eps, vsa::token_order order,
                             vsa::const_tensor q, vsa::const_tensor k, vsa::const_tensor v, vsa::tensor o) {
    return with_scratch([&](void* ws, std::size_t& bytes) {
      return gpu::linear_forward(p, phi, eps, order, q, k, v, o, ws, bytes, stream_);
    });
  }
  vsa::status linear_backward(const vsa::problem& p, vsa::feature_map phi, float eps, vsa::token_order order,
                              vsa::const_tensor q, vsa::const_tensor k, vsa::const_tensor v, vsa::const_tensor d_o,
                              vsa::tensor dq, vsa::tensor dk, vsa::tensor dv) {
    return with_scratch([&](void* ws, std::size_t& bytes) {
      return gpu::linear_backward(p, phi, eps, order, q, k, v, d_o, dq, dk, dv, ws, bytes, stream_);
    });
  }

private:
  // The two-phase workspace protocol of an entry point `call(workspace, bytes)`: its size asked with a null
  // workspace, then the call on that much scratch from torch's allocator.
  template <class Call> vsa::status with_scratch(const Call& call) {
    std::size_t bytes = 0;
    const vsa::status s = call(nullptr, bytes);
    if (!s) return s;
    at::Tensor scratch = bytes_tensor(bytes, like_);
    return call(data_or_null(scratch), bytes);
  }

  static c10::Device check_cuda(const at::Tensor& x) {
    TORCH_CHECK_VALUE(x.is_cuda(), "vsa: the CUDA kernel was given a tensor on ", x.device());
    return x.device();
  }
  const at::Tensor& like_;
  c10::cuda::CUDAGuard guard_;
  void* stream_;
};

const bool registered = [] {
  cuda_sizes() = &sizes_of<cuda_backend>;
  return true;
}();

} // namespace
} // namespace vsa_torch

TORCH_LIBRARY_IMPL(vsa, CUDA, m) { vsa_torch::register_kernels<vsa_torch::cuda_backend>(m); }
