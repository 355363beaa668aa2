// The GPU entry points the binding calls, as plain functions over the library's own types: compiled by nvcc
// (gpu_kernels.cu) apart from the torch glue, which only sees these declarations.
#pragma once

#include <vsa/types.hpp>

#include <cstddef>

namespace vsa_torch {
namespace gpu {

// `stream` is the cudaStream_t of the call.
vsa::status tile(const vsa::problem& p, int64_t heads, vsa::const_tensor raster, vsa::tensor tiled, void* stream);
vsa::status untile(const vsa::problem& p, int64_t heads, vsa::const_tensor tiled, vsa::tensor raster, void* stream);

// The whole op, with the extra tokens of joint attention (none: the video-only op).
vsa::status forward(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                    const vsa::forward_io& io, vsa::op_buffers& mem, void* stream);
vsa::status backward(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                     const vsa::backward_io& io, vsa::op_buffers& mem, void* stream);
vsa::status selected_lists(const vsa::problem& p, const vsa::extra_tokens& extra, const vsa::options& opt,
                           const void* state, vsa::const_index_lists& lists);

vsa::status sparse_forward(const vsa::problem& p, float scale, vsa::const_tensor q, vsa::const_tensor k,
                           vsa::const_tensor v, vsa::const_index_lists lists, vsa::tensor o, float* lse, void* stream);
// The sparse backward on caller q2k lists: the k2q lists are built in `scratch` first (scratch == nullptr:
// sets scratch_bytes only).
vsa::status sparse_backward(const vsa::problem& p, float scale, vsa::const_tensor q, vsa::const_tensor k,
                            vsa::const_tensor v, vsa::const_tensor o, vsa::const_tensor d_o, const float* lse,
                            vsa::const_index_lists lists, vsa::tensor dq, vsa::tensor dk, vsa::tensor dv, void* scratch,
                            std::size_t& scratch_bytes, void* stream);

vsa::status linear_forward(const vsa::problem& p, vsa::feature_map phi, float eps, vsa::token_order order,
                           vsa::const_tensor q, vsa::const_tensor k, vsa::const_tensor v, vsa::tensor o,
                           void* workspace, std::size_t& workspace_bytes, void* stream);
vsa::status linear_backward(const vsa::problem& p, vsa::feature_map phi, float eps, vsa::token_order order,
                            vsa::const_tensor q, vsa::const_tensor k, vsa::const_tensor v, vsa::const_tensor d_o,
                            vsa::tensor dq, vsa::tensor dk, vsa::tensor dv, void* workspace,
                            std::size_t& workspace_bytes, void* stream);

} // namespace gpu
} // namespace vsa_torch
