// The ops of the binding: their schemas (namespace `vsa`), their CPU kernels on the library's reference,
// and the module's two helpers for the Python side. The CUDA kernels are registered by ops_cuda.cpp where
// the build has CUDA; autograd and the fake kernels of torch.compile live in Python (vsa_torch/).
#include "ops_impl.hpp"

#include <torch/extension.h>
#include <torch/library.h>

#include <vsa/reference.hpp>

namespace vsa_torch {
namespace {

struct cpu_backend {
  static constexpr vsa::target target = vsa::target::cpu;
  explicit cpu_backend(const at::Tensor& x) {
    TORCH_CHECK_VALUE(x.device().is_cpu(), "vsa: the CPU kernel was given a tensor on ", x.device());
  }
  static vsa::status forward_query(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                                   vsa::op_buffers& mem) {
    return vsa::reference::joint_forward(p, extra, opt, vsa::forward_io{}, mem);
  }

  vsa::status tile(const vsa::problem& p, int64_t h, vsa::const_tensor x, vsa::tensor y) {
    return vsa::reference::tile(p, h, x, y);
  }
  vsa::status untile(const vsa::problem& p, int64_t h, vsa::const_tensor x, vsa::tensor y) {
    return vsa::reference::untile(p, h, x, y);
  }
  // The whole op, with the extra tokens of joint attention (none: the video-only op).
  vsa::status forward(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                      const vsa::forward_io& io, vsa::op_buffers& mem) {
    return vsa::reference::joint_forward(p, extra, opt, io, mem);
  }
  vsa::status backward(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                       const vsa::backward_io& io, vsa::op_buffers& mem) {
    return vsa::reference::joint_backward(p, extra, opt, io, mem);
  }
  vsa::status selected_lists(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                             const void* state, vsa::const_index_lists& lists) {
    return vsa::reference::joint_selected_lists(p, extra, opt, state, lists);
  }
  vsa::status sparse_forward(const vsa::problem& p, float scale, vsa::const_tensor q, vsa::const_tensor k,
                             vsa::const_tensor v, vsa::const_index_lists lists, vsa::tensor o, float* lse) {
    // Caller lists are checked on the host, entry by entry (the GPU kernels trust them).
    vsa::status s = vsa::check_q2k_host(p, lists);
    return s ? vsa::reference::sparse_attention_forward(p, scale, q, k, v, lists, o, lse) : s;
  }
  vsa::status sparse_backward(const vsa::problem& p, float scale, vsa::const_tensor q, vsa::const_tensor k,
                              vsa::const_tensor v, vsa::const_tensor o, vsa::const_tensor d_o, const float* lse,
                              vsa::const_index_lists lists, vsa::tensor dq, vsa::tensor dk, vsa::tensor dv) {
    vsa::status s = vsa::check_q2k_host(p, lists);
    return s ? vsa::reference::sparse_attention_backward(p, scale, q, k, v, o, d_o, lse, lists, dq, dk, dv) : s;
  }
  vsa::status linear_forward(const vsa::problem& p, vsa::feature_map phi, float eps, vsa::token_order order,
                             vsa::const_tensor q, vsa::const_tensor k, vsa::const_tensor v, vsa::tensor o) {
    return vsa::reference::linear_attention_forward(p, phi, eps, order, q, k, v, o);
  }
  vsa::status linear_backward(const vsa::problem& p, vsa::feature_map phi, float eps, vsa::token_order order,
                              vsa::const_tensor q, vsa::const_tensor k, vsa::const_tensor v, vsa::const_tensor d_o,
                              vsa::tensor dq, vsa::tensor dk, vsa::tensor dv) {
    return vsa::reference::linear_attention_backward(p, phi, eps, order, q, k, v, d_o, dq, dk, dv);
  }
};

// The state size and k of a whole-op call, for the fake kernels: the problem as plain numbers.
pybind11::tuple op_sizes_py(int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                            std::vector<int64_t> grid, int64_t type, int64_t top_k, double sparsity,
                            int64_t q2k_capacity, bool cuda, int64_t extra, bool extra_first) {
  vsa::problem p;
  p.batch = batch;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.grid = to_grid(grid, "forward");
  TORCH_CHECK_VALUE(type >= 0 && type <= 3, "vsa.forward: dtype code ", type);
  p.type = static_cast<vsa::dtype>(type);
  vsa::options opt;
  opt.top_k = top_k;
  opt.sparsity = sparsity;
  // Caller lists only change the sizes through their capacity; any non-null pointer stands for them.
  static const int32_t stand_in = 0;
  if (q2k_capacity > 0) opt.q2k = vsa::const_index_lists(&stand_in, &stand_in, q2k_capacity);
  const vsa::extra_tokens ex{extra, extra_first};
  op_sizes s;
  if (cuda) {
    TORCH_CHECK(cuda_sizes() != nullptr, "vsa: this build of the binding has no CUDA kernels");
    s = cuda_sizes()(p, ex, opt);
  } else {
    s = sizes_of<cpu_backend>(p, ex, opt);
  }
  return pybind11::make_tuple(s.state_bytes, s.top_k);
}

} // namespace
} // namespace vsa_torch

TORCH_LIBRARY(vsa, m) {
  m.def("tile(Tensor x, int[] grid) -> Tensor");
  m.def("untile(Tensor x, int[] grid) -> Tensor");
  // extra, extra_first: the extra (text, condition) tokens of joint attention, after the video's tiled slots or
  // before them (the library's extra_tokens).
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor? gate, int[] grid, int top_k, float sparsity, float scale, "
        "Tensor? q2k, Tensor? q2k_count, bool return_selection, bool raster_out, int extra=0, bool extra_first=False) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  // forward on raster q, k, v and gate (the library's input_order raster): also the tiled copies the op made of them,
  // which backward takes as its q, k, v and gate, with d_o in raster order (raster_in).
  m.def("forward_raster(Tensor q, Tensor k, Tensor v, Tensor? gate, int[] grid, int top_k, float sparsity, "
        "float scale, Tensor? q2k, Tensor? q2k_count, bool return_selection, bool raster_out) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("backward(Tensor d_o, Tensor q, Tensor k, Tensor v, Tensor? gate, Tensor o, Tensor state, int[] grid, "
        "int top_k, float sparsity, float scale, Tensor? q2k, Tensor? q2k_count, bool raster_out, int extra=0, "
        "bool extra_first=False, bool raster_in=False) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("sparse_attention(Tensor q, Tensor k, Tensor v, Tensor q2k, Tensor q2k_count, int[] grid, float scale) -> "
        "(Tensor, Tensor)");
  m.def("sparse_attention_backward(Tensor d_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor q2k, "
        "Tensor q2k_count, int[] grid, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("linear_attention(Tensor q, Tensor k, Tensor v, int[] grid, int phi, float eps, bool raster) -> Tensor");
  m.def("linear_attention_backward(Tensor d_o, Tensor q, Tensor k, Tensor v, int[] grid, int phi, float eps, "
        "bool raster) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vsa, CPU, m) { vsa_torch::register_kernels<vsa_torch::cpu_backend>(m); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vsa's ops (torch.ops.vsa.*), registered on import";
  m.def("op_sizes", &vsa_torch::op_sizes_py, "state bytes and k of a whole-op call (for the fake kernels)");
  m.def(
      "has_cuda", []() { return vsa_torch::cuda_sizes() != nullptr; }, "whether CUDA kernels are built in");
}
