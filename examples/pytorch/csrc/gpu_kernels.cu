// The library's GPU entry points behind gpu_api.hpp: the one file of the binding that nvcc compiles, and
// the only one that includes the kernels (torch's headers stay out of it).
#include "gpu_api.hpp"

#include <vsa/gpu/layout.hpp>
#include <vsa/gpu/linear_attention.hpp>
#include <vsa/gpu/op.hpp>

namespace vsa_torch {
namespace gpu {
namespace {
vsa::gpu::stream_t as_stream(void* s) { return static_cast<vsa::gpu::stream_t>(s); }
} // namespace

vsa::status tile(const vsa::problem& p, int64_t heads, vsa::const_tensor raster, vsa::tensor tiled, void* stream) {
  return vsa::tile(p, heads, raster, tiled, as_stream(stream));
}
vsa::status untile(const vsa::problem& p, int64_t heads, vsa::const_tensor tiled, vsa::tensor raster, void* stream) {
  return vsa::untile(p, heads, tiled, raster, as_stream(stream));
}

vsa::status forward(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                    const vsa::forward_io& io, vsa::op_buffers& mem, void* stream) {
  return vsa::joint_forward(p, extra, opt, io, mem, as_stream(stream));
}
vsa::status backward(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                     const vsa::backward_io& io, vsa::op_buffers& mem, void* stream) {
  return vsa::joint_backward(p, extra, opt, io, mem, as_stream(stream));
}
vsa::status selected_lists(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                           const void* state, vsa::const_index_lists& lists) {
  return vsa::joint_selected_lists(p, extra, opt, state, lists);
}

vsa::status sparse_forward(const vsa::problem& p, float scale, vsa::const_tensor q, vsa::const_tensor k,
                           vsa::const_tensor v, vsa::const_index_lists lists, vsa::tensor o, float* lse, void* stream) {
  return vsa::sparse_attention_forward(p, scale, q, k, v, lists, o, lse, as_stream(stream));
}

vsa::status sparse_backward(const vsa::problem& p, float scale, vsa::const_tensor q, vsa::const_tensor k,
                            vsa::const_tensor v, vsa::const_tensor o, vsa::const_tensor d_o, const float* lse,
                            vsa::const_index_lists lists, vsa::tensor dq, vsa::tensor dk, vsa::tensor dv, void* scratch,
                            std::size_t& scratch_bytes, void* stream) {
  // scratch: the k2q lists and their offsets, build_k2q's workspace, then the backward's.
  const int64_t n = vsa::tile_geometry(p.grid).num_tiles(), bh = p.batch * p.q_heads;
  const std::size_t k2q_bytes = vsa::detail::align_up(static_cast<std::size_t>(bh * n * lists.q2k_capacity) * 4);
  const std::size_t offset_bytes = vsa::detail::align_up(static_cast<std::size_t>(bh * (n + 1)) * 4);
  vsa::index_lists probe{};
  probe.q2k_capacity = lists.q2k_capacity;
  std::size_t index_bytes = 0, backward_bytes = 0;
  vsa::status s = vsa::build_k2q(p, probe, nullptr, index_bytes, nullptr);
  if (s)
    s = vsa::sparse_attention_backward(p, scale, q, k, v, o, d_o, lse, lists, dq, dk, dv, nullptr, backward_bytes,
                                       nullptr);
  if (!s) return s;
  index_bytes = vsa::detail::align_up(index_bytes);
  const std::size_t need = k2q_bytes + offset_bytes + index_bytes + backward_bytes;
  if (scratch == nullptr) {
    scratch_bytes = need;
    return vsa::status::ok();
  }
  if (!(s = vsa::check_buffer("scratch", scratch, scratch_bytes, need))) return s;
  unsigned char* at = static_cast<unsigned char*>(scratch);
  vsa::index_lists idx{const_cast<int32_t*>(lists.q2k), const_cast<int32_t*>(lists.q2k_count), lists.q2k_capacity,
                       reinterpret_cast<int32_t*>(at), reinterpret_cast<int32_t*>(at + k2q_bytes)};
  s = vsa::build_k2q(p, idx, at + k2q_bytes + offset_bytes, index_bytes, as_stream(stream));
  if (!s) return s;
  return vsa::sparse_attention_backward(p, scale, q, k, v, o, d_o, lse, vsa::as_const(idx), dq, dk, dv,
                                        at + k2q_bytes + offset_bytes + index_bytes, backward_bytes, as_stream(stream));
}

vsa::status linear_forward(const vsa::problem& p, vsa::feature_map phi, float eps, vsa::token_order order,
                           vsa::const_tensor q, vsa::const_tensor k, vsa::const_tensor v, vsa::tensor o,
                           void* workspace, std::size_t& workspace_bytes, void* stream) {
  return vsa::linear_attention_forward(p, phi, eps, order, q, k, v, o, workspace, workspace_bytes, as_stream(stream));
}
vsa::status linear_backward(const vsa::problem& p, vsa::feature_map phi, float eps, vsa::token_order order,
                            vsa::const_tensor q, vsa::const_tensor k, vsa::const_tensor v, vsa::const_tensor d_o,
                            vsa::tensor dq, vsa::tensor dk, vsa::tensor dv, void* workspace,
                            std::size_t& workspace_bytes, void* stream) {
  return vsa::linear_attention_backward(p, phi, eps, order, q, k, v, d_o, dq, dk, dv, workspace, workspace_bytes,
                                        as_stream(stream));
}

} // namespace gpu
} // namespace vsa_torch
