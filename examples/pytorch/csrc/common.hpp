// What the CPU and CUDA kernels of the binding share: torch tensors as the library's views, the problem a
// call describes, the library's status as a Python exception, and the layout of every output.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vsa/geometry.hpp>
#include <vsa/types.hpp>
#include <vsa/validate.hpp>

#include <cstdint>
#include <string>

namespace vsa_torch {

// A rejected argument is a ValueError carrying the library's message; a runtime failure is a RuntimeError.
inline void check(const vsa::status& s, const char* op) {
  if (s) return;
  const bool runtime = s.code() == vsa::errc::runtime_error || s.code() == vsa::errc::unsupported;
  TORCH_CHECK(!runtime, "vsa.", op, ": ", s.message());
  TORCH_CHECK_VALUE(false, "vsa.", op, ": ", s.message());
}

inline vsa::dtype to_dtype(const at::Tensor& x, const char* op, const char* name) {
  switch (x.scalar_type()) {
  case at::kBFloat16:
    return vsa::dtype::bf16;
  case at::kHalf:
    return vsa::dtype::fp16;
  case at::kFloat:
    return vsa::dtype::f32;
  case at::kDouble:
    return vsa::dtype::f64;
  default:
    TORCH_CHECK_VALUE(false, "vsa.", op, ": ", name, ": dtype ", x.scalar_type(),
                      " is not one of bfloat16, float16, float32, float64");
  }
  return vsa::dtype::bf16;
}

inline vsa::grid3 to_grid(at::IntArrayRef grid, const char* op) {
  TORCH_CHECK_VALUE(grid.size() == 3, "vsa.", op, ": grid: must be (T, H, W), got ", grid.size(), " values");
  return {grid[0], grid[1], grid[2]};
}

// A [B, S, H, D] tensor (any strides, the head dim contiguous) on the device and of the type of `like`.
inline void check_bshd(const at::Tensor& x, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK_VALUE(x.dim() == 4, "vsa.", op, ": ", name, ": must be [B, S, H, D], got ", x.dim(), " dimensions");
  TORCH_CHECK_VALUE(x.device() == like.device(), "vsa.", op, ": ", name, ": on ", x.device(), ", q on ", like.device());
  TORCH_CHECK_VALUE(x.scalar_type() == like.scalar_type(), "vsa.", op, ": ", name, ": dtype ", x.scalar_type(),
                    ", q is ", like.scalar_type());
  TORCH_CHECK_VALUE(x.size(3) == 1 || x.stride(3) == 1, "vsa.", op, ": ", name,
                    ": the head dim must be contiguous (stride 1)");
  TORCH_CHECK_VALUE(x.size(0) == like.size(0) && x.size(3) == like.size(3), "vsa.", op, ": ", name, ": shape ",
                    x.sizes(), " does not match q's batch and head dim ", like.sizes());
}

// The problem of q [B, S, Hq, D] and k [B, S, Hkv, D] over `grid`.
inline vsa::problem make_problem(const at::Tensor& q, const at::Tensor& k, at::IntArrayRef grid, const char* op) {
  check_bshd(q, q, op, "q");
  check_bshd(k, q, op, "k");
  vsa::problem p;
  p.batch = q.size(0);
  p.q_heads = q.size(2);
  p.kv_heads = k.size(2);
  p.head_dim = q.size(3);
  p.grid = to_grid(grid, op);
  p.type = to_dtype(q, op, "q");
  return p;
}

template <class Ptr> vsa::basic_tensor<Ptr> view_of(const at::Tensor& x) {
  return {static_cast<Ptr>(x.data_ptr()), x.size(1), x.stride(0), x.stride(1), x.stride(2)};
}
inline vsa::const_tensor in(const at::Tensor& x) { return view_of<const void*>(x); }
inline vsa::tensor out(const at::Tensor& x) { return view_of<void*>(x); }
inline bool present(const c10::optional<at::Tensor>& x) { return x.has_value() && x->defined(); }
inline vsa::const_tensor in(const c10::optional<at::Tensor>& x) { return present(x) ? in(*x) : vsa::const_tensor{}; }

// An output of `tokens` tokens and `heads` heads laid out as `like` is: [B, H, S, D] memory when like's head
// stride exceeds its token stride, [B, S, H, D] otherwise (the fake kernels in Python follow the same rule).
inline at::Tensor empty_like_layout(const at::Tensor& like, int64_t tokens, int64_t heads) {
  const int64_t b = like.size(0), d = like.size(3);
  if (like.stride(2) > like.stride(1)) return at::empty({b, heads, tokens, d}, like.options()).transpose(1, 2);
  return at::empty({b, tokens, heads, d}, like.options());
}

// The whole op's options; q2k, when given, are caller lists [B, Hq, N, capacity] and counts [B, Hq, N] (int32);
// raster_out: o and the gradients in raster order (options::output_order).
inline vsa::options make_options(const vsa::problem& p, const at::Tensor& q, int64_t top_k, double sparsity,
                                 double scale, const c10::optional<at::Tensor>& q2k,
                                 const c10::optional<at::Tensor>& q2k_count, const char* op, bool raster_out = false,
                                 bool raster_in = false) {
  vsa::options opt;
  opt.output_order = raster_out ? vsa::token_order::raster : vsa::token_order::tiled;
  opt.input_order = raster_in ? vsa::token_order::raster : vsa::token_order::tiled;
  opt.top_k = top_k;
  opt.sparsity = sparsity;
  opt.scale = static_cast<float>(scale);
  TORCH_CHECK_VALUE(present(q2k) == present(q2k_count), "vsa.", op, ": q2k and q2k_count: give both or neither");
  if (!present(q2k)) return opt;
  const int64_t n = vsa::tile_geometry(p.grid).num_tiles();
  for (const at::Tensor* t : {&*q2k, &*q2k_count}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt, "vsa.", op, ": q2k lists: must be int32");
    TORCH_CHECK_VALUE(t->device() == q.device(), "vsa.", op, ": q2k lists: on ", t->device(), ", q on ", q.device());
    TORCH_CHECK_VALUE(t->is_contiguous(), "vsa.", op, ": q2k lists: must be contiguous");
  }
  TORCH_CHECK_VALUE(q2k->dim() == 4 && q2k->size(0) == p.batch && q2k->size(1) == p.q_heads && q2k->size(2) == n,
                    "vsa.", op, ": q2k: must be [B, Hq, N, capacity] = [", p.batch, ", ", p.q_heads, ", ", n,
                    ", k], got ", q2k->sizes());
  TORCH_CHECK_VALUE(q2k_count->numel() == p.batch * p.q_heads * n, "vsa.", op,
                    ": q2k_count: must hold B·Hq·N = ", p.batch * p.q_heads * n, " counts, got ", q2k_count->numel());
  opt.q2k = vsa::const_index_lists(q2k->data_ptr<int32_t>(), q2k_count->data_ptr<int32_t>(), q2k->size(3));
  return opt;
}

inline vsa::feature_map to_feature_map(int64_t phi, const char* op) {
  TORCH_CHECK_VALUE(phi >= 0 && phi <= 2, "vsa.", op, ": phi: must be 0 (softmax), 1 (elu1) or 2 (relu), got ", phi);
  return static_cast<vsa::feature_map>(phi);
}

// `bytes` bytes of scratch or state, 256-byte aligned as the library asks (torch's CPU allocator aligns to 64;
// its CUDA allocator to 512, where the slack goes unused).
inline at::Tensor bytes_tensor(std::size_t bytes, const at::Tensor& like) {
  constexpr int64_t align = 256;
  at::Tensor raw = at::empty({static_cast<int64_t>(bytes) + align}, like.options().dtype(at::kByte));
  const auto address = reinterpret_cast<std::uintptr_t>(raw.data_ptr());
  const int64_t skip = static_cast<int64_t>((align - address % align) % align);
  return raw.narrow(0, skip, static_cast<int64_t>(bytes));
}

inline void* data_or_null(const at::Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr(); }

} // namespace vsa_torch
