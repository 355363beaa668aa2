// vsa's GPU entry points as XLA FFI handlers, and the host functions the Python side calls through ctypes at
// trace time (sizes and argument checks), in one shared library: the sizes Python asks XLA for are the ones the
// handlers then carve up, computed by the same code.
//
// Memory: XLA owns every byte. Each call's scratch is one extra uint8 result whose size the host functions give;
// nothing here allocates. XLA aligns its buffers to 128 bytes at most, the library wants 256 for its state and
// scratch, so every scratch request carries 256 bytes of slack and the handler aligns inside it. The whole op's
// state is the exception: it lives from the forward to the backward as a JAX array, whose address differs
// between the two calls, so its bytes always start at offset 0 of that array. Where its address is not 256-byte
// aligned the pass runs on an aligned copy in the scratch instead (the forward copies it out at the end, the
// backward copies it in first), which is why both passes' scratch has room for the state as well.
#include <xla/ffi/api/ffi.h>

#include <vsa/gpu/layout.hpp>
#include <vsa/gpu/op.hpp>

#include <cstdint>
#include <cstdio>
#include <string>

namespace ffi = xla::ffi;

// The problem as the Python side describes it (vsa_jax/_library.py mirrors this layout with ctypes).
struct vsa_jax_problem {
  int64_t batch, q_heads, kv_heads, head_dim, grid_t, grid_h, grid_w, dtype;
};

namespace vsa_jax {
namespace {

constexpr std::size_t alignment = vsa::detail::workspace_alignment;
constexpr std::size_t aligned_size(std::size_t n) { return vsa::detail::align_up(n); }
bool is_aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % alignment == 0; }

vsa::problem to_problem(const vsa_jax_problem& d) {
  vsa::problem p;
  p.batch = d.batch;
  p.q_heads = d.q_heads;
  p.kv_heads = d.kv_heads;
  p.head_dim = d.head_dim;
  p.grid = {d.grid_t, d.grid_h, d.grid_w};
  p.type = static_cast<vsa::dtype>(d.dtype);
  return p;
}

vsa::options to_options(int64_t top_k, double sparsity, float scale) {
  vsa::options opt;
  opt.top_k = top_k;
  opt.sparsity = sparsity;
  opt.scale = scale;
  return opt;
}

// What the whole op needs beyond its inputs and outputs, and the scratch results Python asks XLA for.
struct op_plan {
  int64_t top_k = 0;
  std::size_t state_bytes = 0, forward_scratch = 0, backward_scratch = 0;
  std::size_t forward_request() const { return alignment + aligned_size(state_bytes) + aligned_size(forward_scratch); }
  std::size_t backward_request() const {
    return alignment + aligned_size(state_bytes) + aligned_size(backward_scratch);
  }
};

vsa::status plan_op(const vsa::problem& p, const vsa::options& opt, op_plan& plan) {
  vsa::op_buffers f, b;
  vsa::status s = vsa::forward(p, opt, vsa::forward_io{}, f, nullptr);
  if (s) s = vsa::backward(p, opt, vsa::backward_io{}, b, nullptr);
  if (s) s = vsa::resolve_op_top_k(vsa::tile_geometry(p.grid).num_tiles(), opt, plan.top_k);
  if (s) s = vsa::detail::check_scale(vsa::detail::resolve_scale(p, opt));
  plan.state_bytes = f.state_bytes;
  plan.forward_scratch = f.scratch_bytes;
  plan.backward_scratch = b.scratch_bytes;
  return s;
}

// The sparse backward on caller lists first builds their transpose, the k2q lists, in its scratch: the lists,
// their offsets, the index builder's workspace, then the backward's own.
struct sparse_plan {
  std::size_t k2q = 0, offsets = 0, index = 0, backward = 0;
  std::size_t request() const { return alignment + k2q + offsets + index + backward; }
};

vsa::status plan_sparse_backward(const vsa::problem& p, int64_t capacity, float scale, sparse_plan& plan) {
  const int64_t n = vsa::tile_geometry(p.grid).num_tiles();
  // Stand-in pointers: only the capacity is checked here, the lists themselves at run time.
  static const int32_t stand_in[1] = {0};
  const vsa::const_index_lists lists(stand_in, stand_in, capacity);
  vsa::status s = vsa::check_problem(p, vsa::target::gpu);
  if (s) s = vsa::detail::check_lists(p, lists, false);
  if (s) s = vsa::detail::check_scale(scale);
  if (!s) return s;
  vsa::index_lists probe{};
  probe.q2k_capacity = capacity;
  if (!(s = vsa::build_k2q(p, probe, nullptr, plan.index, nullptr))) return s;
  const std::size_t heads = static_cast<std::size_t>(p.batch * p.q_heads);
  plan.k2q = aligned_size(heads * static_cast<std::size_t>(n * capacity) * sizeof(int32_t));
  plan.offsets = aligned_size(heads * static_cast<std::size_t>(n + 1) * sizeof(int32_t));
  plan.index = aligned_size(plan.index);
  plan.backward = aligned_size(vsa::sparse_attention_backward_workspace(p, capacity));
  return s;
}

// Hands out 256-byte aligned pieces of one scratch result.
class carver {
public:
  carver(void* base, std::size_t bytes) {
    const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(base);
    const std::size_t skip = (alignment - at % alignment) % alignment;
    next_ = static_cast<unsigned char*>(base) + skip;
    left_ = bytes > skip ? bytes - skip : 0;
  }
  // n bytes, or null when the scratch is too small (the caller checked its size against the plan first).
  void* take(std::size_t n) {
    n = aligned_size(n);
    if (n > left_) return nullptr;
    void* p = next_;
    next_ += n;
    left_ -= n;
    return p;
  }

private:
  unsigned char* next_;
  std::size_t left_;
};

// ---- the handlers' arguments ----------------------------------------------------------------------------

// A rejected argument is INVALID_ARGUMENT carrying the library's message; a runtime failure is INTERNAL.
ffi::Error to_error(const vsa::status& s, const char* op) {
  if (s) return ffi::Error::Success();
  const bool runtime = s.code() == vsa::errc::runtime_error || s.code() == vsa::errc::unsupported;
  return ffi::Error(runtime ? ffi::ErrorCode::kInternal : ffi::ErrorCode::kInvalidArgument,
                    std::string("vsa.") + op + ": " + s.message());
}

vsa::status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return vsa::status::ok();
  return vsa::status::error(vsa::errc::runtime_error, "%s: %s", what, cudaGetErrorString(e));
}

vsa::status to_dtype(ffi::DataType t, vsa::dtype& out) {
  switch (t) {
  case ffi::DataType::BF16:
    out = vsa::dtype::bf16;
    return vsa::status::ok();
  case ffi::DataType::F16:
    out = vsa::dtype::fp16;
    return vsa::status::ok();
  default:
    return vsa::status::error(vsa::errc::bad_dtype, "q: the GPU kernels take bf16 or fp16 (XLA type %d)",
                              static_cast<int>(t));
  }
}

using dims = ffi::AnyBuffer::Dimensions;

// x must be exactly [d0, d1, ...] (the library then checks the token count against the grid and the alignment).
vsa::status check_shape(const char* name, dims x, std::initializer_list<int64_t> want) {
  bool same = x.size() == want.size();
  std::size_t i = 0;
  for (int64_t w : want) same = same && x[i++] == w;
  if (same) return vsa::status::ok();
  std::string got, expected;
  for (std::size_t j = 0; j < x.size(); ++j) got += (j ? ", " : "") + std::to_string(x[j]);
  i = 0;
  for (int64_t w : want) expected += (i++ ? ", " : "") + std::to_string(w);
  return vsa::status::error(vsa::errc::bad_tokens, "%s: shape [%s], expected [%s]", name, got.c_str(),
                            expected.c_str());
}

// The problem of q [B, S, Hq, D] and k [B, S, Hkv, D] over the grid.
vsa::status problem_of(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, int64_t t, int64_t h, int64_t w,
                       vsa::problem& p) {
  const dims dq = q.dimensions(), dk = k.dimensions();
  if (dq.size() != 4 || dk.size() != 4)
    return vsa::status::error(vsa::errc::bad_argument, "q and k: must be [B, S, H, D]");
  vsa::status s = to_dtype(q.element_type(), p.type);
  if (!s) return s;
  if (k.element_type() != q.element_type()) return vsa::status::error(vsa::errc::bad_dtype, "k: its dtype is not q's");
  if (dk[0] != dq[0] || dk[3] != dq[3]) return check_shape("k", dk, {dq[0], dk[1], dk[2], dq[3]});
  p.batch = dq[0];
  p.q_heads = dq[2];
  p.kv_heads = dk[2];
  p.head_dim = dq[3];
  p.grid = {t, h, w};
  return vsa::check_problem(p, vsa::target::gpu);
}

// Dense [B, S, H, D] views of a buffer or a result.
vsa::const_tensor in(const ffi::AnyBuffer& x) {
  const dims d = x.dimensions();
  return vsa::bshd(static_cast<const void*>(x.untyped_data()), d[0], d[1], d[2], d[3]);
}
vsa::tensor out(ffi::Result<ffi::AnyBuffer>& x) {
  const dims d = x->dimensions();
  return vsa::bshd(x->untyped_data(), d[0], d[1], d[2], d[3]);
}

// A [B, S, heads, D] argument or result of q's type. The views carry each array's own token count, which the
// library checks against the grid; batch and head dim are q's in every view, so a mismatch there is caught here.
vsa::status check_operand(const char* name, const ffi::AnyBuffer& x, ffi::DataType type, const vsa::problem& p,
                          int64_t heads) {
  const dims d = x.dimensions();
  if (x.element_type() != type) return vsa::status::error(vsa::errc::bad_dtype, "%s: its dtype is not q's", name);
  if (d.size() == 4 && d[0] == p.batch && d[2] == heads && d[3] == p.head_dim) return vsa::status::ok();
  return check_shape(name, d, {p.batch, d.size() == 4 ? d[1] : -1, heads, p.head_dim});
}

vsa::status check_bytes(const char* name, const ffi::AnyBuffer& x, std::size_t need, bool exact) {
  const std::size_t given = x.size_bytes();
  if (x.element_type() == ffi::DataType::U8 && (exact ? given == need : given >= need)) return vsa::status::ok();
  return vsa::status::error(vsa::errc::bad_workspace, "%s: %zu bytes given, %zu %s (uint8)", name, given, need,
                            exact ? "expected" : "needed");
}

// q2k [B, Hq, N, capacity] and q2k_count [B, Hq, N], int32.
vsa::status lists_of(const ffi::AnyBuffer& q2k, const ffi::AnyBuffer& count, const vsa::problem& p,
                     vsa::const_index_lists& lists) {
  const int64_t n = vsa::tile_geometry(p.grid).num_tiles();
  if (q2k.element_type() != ffi::DataType::S32 || count.element_type() != ffi::DataType::S32)
    return vsa::status::error(vsa::errc::bad_index, "q2k lists: must be int32");
  const dims d = q2k.dimensions();
  const int64_t capacity = d.size() == 4 ? d[3] : 0;
  vsa::status s = check_shape("q2k", d, {p.batch, p.q_heads, n, capacity});
  if (s) s = check_shape("q2k_count", count.dimensions(), {p.batch, p.q_heads, n});
  lists = vsa::const_index_lists(static_cast<const int32_t*>(q2k.untyped_data()),
                                 static_cast<const int32_t*>(count.untyped_data()), capacity);
  return s;
}

// ---- the whole op -----------------------------------------------------------------------------------------

// A result, checked as an argument is.
vsa::status check_result(const char* name, ffi::Result<ffi::AnyBuffer>& x, ffi::DataType type, const vsa::problem& p,
                         int64_t heads) {
  return check_operand(name, *x, type, p, heads);
}

// o, the state the backward reads, the selected lists (when q2k is [B, Hq, N, k]; empty results otherwise) and
// the scratch. gate: [B, S, Hq, D], or an empty array for g = 1.
vsa::status forward_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer gate,
                         ffi::Result<ffi::AnyBuffer>& o, ffi::Result<ffi::AnyBuffer>& state,
                         ffi::Result<ffi::AnyBuffer>& q2k, ffi::Result<ffi::AnyBuffer>& q2k_count,
                         ffi::Result<ffi::AnyBuffer>& scratch, int64_t t, int64_t h, int64_t w, int64_t top_k,
                         double sparsity, float scale) {
  vsa::problem p;
  vsa::status s = problem_of(q, k, t, h, w, p);
  const vsa::options opt = to_options(top_k, sparsity, scale);
  op_plan plan;
  if (s) s = plan_op(p, opt, plan);
  if (!s) return s;
  const int64_t n = vsa::tile_geometry(p.grid).num_tiles();
  const ffi::DataType type = q.element_type();
  const bool gated = gate.dimensions().size() != 1, selection = q2k->dimensions().size() == 4;
  if (s) s = check_operand("v", v, type, p, p.kv_heads);
  if (s && gated) s = check_operand("gate", gate, type, p, p.q_heads);
  if (s) s = check_result("o", o, type, p, p.q_heads);
  if (s) s = check_bytes("state", *state, plan.state_bytes, true);
  if (s) s = check_bytes("scratch", *scratch, plan.forward_request(), false);
  if (s && selection) s = check_shape("q2k", q2k->dimensions(), {p.batch, p.q_heads, n, plan.top_k});
  if (s && selection) s = check_shape("q2k_count", q2k_count->dimensions(), {p.batch, p.q_heads, n});
  if (!s) return s;

  carver c(scratch->untyped_data(), scratch->size_bytes());
  void* const kept = state->untyped_data();
  void* const staging = c.take(plan.state_bytes);
  vsa::op_buffers mem{is_aligned(kept) ? kept : staging, plan.state_bytes, c.take(plan.forward_scratch),
                      plan.forward_scratch};
  const vsa::forward_io io{in(q), in(k), in(v), gated ? in(gate) : vsa::const_tensor{}, out(o)};
  if (!(s = vsa::forward(p, opt, io, mem, stream))) return s;
  const cudaMemcpyKind d2d = cudaMemcpyDeviceToDevice;
  if (selection) {
    vsa::const_index_lists lists;
    if (!(s = vsa::selected_lists(p, opt, mem.state, lists))) return s;
    s = cuda_status(cudaMemcpyAsync(q2k->untyped_data(), lists.q2k, q2k->size_bytes(), d2d, stream), "q2k copy");
    if (!s) return s;
    s = cuda_status(cudaMemcpyAsync(q2k_count->untyped_data(), lists.q2k_count, q2k_count->size_bytes(), d2d, stream),
                    "q2k_count copy");
    if (!s) return s;
  }
  if (mem.state != kept) s = cuda_status(cudaMemcpyAsync(kept, mem.state, plan.state_bytes, d2d, stream), "state copy");
  return s;
}

// dq, dk, dv and dgate (an empty result without a gate) from dO and the forward's state.
vsa::status backward_impl(cudaStream_t stream, ffi::AnyBuffer d_o, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::AnyBuffer gate, ffi::AnyBuffer o, ffi::AnyBuffer state, ffi::Result<ffi::AnyBuffer>& dq,
                          ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                          ffi::Result<ffi::AnyBuffer>& dgate, ffi::Result<ffi::AnyBuffer>& scratch, int64_t t,
                          int64_t h, int64_t w, int64_t top_k, double sparsity, float scale) {
  vsa::problem p;
  vsa::status s = problem_of(q, k, t, h, w, p);
  const vsa::options opt = to_options(top_k, sparsity, scale);
  op_plan plan;
  if (s) s = plan_op(p, opt, plan);
  if (!s) return s;
  const ffi::DataType type = q.element_type();
  const bool gated = gate.dimensions().size() != 1;
  if (s) s = check_operand("v", v, type, p, p.kv_heads);
  if (s && gated) s = check_operand("gate", gate, type, p, p.q_heads);
  if (s) s = check_operand("o", o, type, p, p.q_heads);
  if (s) s = check_operand("d_o", d_o, type, p, p.q_heads);
  if (s) s = check_result("dq", dq, type, p, p.q_heads);
  if (s) s = check_result("dk", dk, type, p, p.kv_heads);
  if (s) s = check_result("dv", dv, type, p, p.kv_heads);
  if (s && gated) s = check_result("dgate", dgate, type, p, p.q_heads);
  if (s) s = check_bytes("state", state, plan.state_bytes, true);
  if (s) s = check_bytes("scratch", *scratch, plan.backward_request(), false);
  if (!s) return s;

  carver c(scratch->untyped_data(), scratch->size_bytes());
  void* const kept = state.untyped_data();
  void* const staging = c.take(plan.state_bytes);
  vsa::op_buffers mem{is_aligned(kept) ? kept : staging, plan.state_bytes, c.take(plan.backward_scratch),
                      plan.backward_scratch};
  if (mem.state != kept) {
    s = cuda_status(cudaMemcpyAsync(mem.state, kept, plan.state_bytes, cudaMemcpyDeviceToDevice, stream), "state copy");
    if (!s) return s;
  }
  const vsa::backward_io io{in(q),   in(k),   in(v),   gated ? in(gate) : vsa::const_tensor{}, in(o), in(d_o),
                            out(dq), out(dk), out(dv), gated ? out(dgate) : vsa::tensor{}};
  return vsa::backward(p, opt, io, mem, stream);
}

// ---- sparse attention on caller lists ---------------------------------------------------------------------

// o_s and the fp32 log-sum-exp [B, Hq, N·64].
vsa::status sparse_forward_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::AnyBuffer q2k, ffi::AnyBuffer q2k_count, ffi::Result<ffi::AnyBuffer>& o,
                                ffi::Result<ffi::AnyBuffer>& lse, int64_t t, int64_t h, int64_t w, float scale) {
  vsa::problem p;
  vsa::status s = problem_of(q, k, t, h, w, p);
  vsa::const_index_lists lists;
  if (s) s = lists_of(q2k, q2k_count, p, lists);
  if (!s) return s;
  const int64_t tokens = vsa::tile_geometry(p.grid).tiled_tokens();
  if (s) s = check_operand("v", v, q.element_type(), p, p.kv_heads);
  if (s) s = check_result("o", o, q.element_type(), p, p.q_heads);
  if (s && lse->element_type() != ffi::DataType::F32)
    s = vsa::status::error(vsa::errc::bad_dtype, "lse: must be float32");
  if (s) s = check_shape("lse", lse->dimensions(), {p.batch, p.q_heads, tokens});
  if (!s) return s;
  return vsa::sparse_attention_forward(p, scale, in(q), in(k), in(v), lists, out(o),
                                       static_cast<float*>(lse->untyped_data()), stream);
}

// dq, dk, dv: the k2q lists are built in the scratch, then the backward walks both lists.
vsa::status sparse_backward_impl(cudaStream_t stream, ffi::AnyBuffer d_o, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                 ffi::AnyBuffer v, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer q2k,
                                 ffi::AnyBuffer q2k_count, ffi::Result<ffi::AnyBuffer>& dq,
                                 ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv,
                                 ffi::Result<ffi::AnyBuffer>& scratch, int64_t t, int64_t h, int64_t w, float scale) {
  vsa::problem p;
  vsa::status s = problem_of(q, k, t, h, w, p);
  vsa::const_index_lists lists;
  if (s) s = lists_of(q2k, q2k_count, p, lists);
  sparse_plan plan;
  if (s) s = plan_sparse_backward(p, lists.q2k_capacity, scale, plan);
  if (!s) return s;
  const int64_t tokens = vsa::tile_geometry(p.grid).tiled_tokens();
  const ffi::DataType type = q.element_type();
  if (s) s = check_operand("v", v, type, p, p.kv_heads);
  if (s) s = check_operand("o", o, type, p, p.q_heads);
  if (s) s = check_operand("d_o", d_o, type, p, p.q_heads);
  if (s) s = check_result("dq", dq, type, p, p.q_heads);
  if (s) s = check_result("dk", dk, type, p, p.kv_heads);
  if (s) s = check_result("dv", dv, type, p, p.kv_heads);
  if (s && lse.element_type() != ffi::DataType::F32)
    s = vsa::status::error(vsa::errc::bad_dtype, "lse: must be float32");
  if (s) s = check_shape("lse", lse.dimensions(), {p.batch, p.q_heads, tokens});
  if (s) s = check_bytes("scratch", *scratch, plan.request(), false);
  if (!s) return s;

  carver c(scratch->untyped_data(), scratch->size_bytes());
  vsa::index_lists idx{const_cast<int32_t*>(lists.q2k), const_cast<int32_t*>(lists.q2k_count), lists.q2k_capacity,
                       static_cast<int32_t*>(c.take(plan.k2q)), static_cast<int32_t*>(c.take(plan.offsets))};
  void* const index_ws = c.take(plan.index);
  void* const backward_ws = c.take(plan.backward);
  std::size_t index_bytes = plan.index, backward_bytes = plan.backward;
  if (!(s = vsa::build_k2q(p, idx, index_ws, index_bytes, stream))) return s;
  return vsa::sparse_attention_backward(p, scale, in(q), in(k), in(v), in(o), in(d_o),
                                        static_cast<const float*>(lse.untyped_data()), vsa::as_const(idx), out(dq),
                                        out(dk), out(dv), backward_ws, backward_bytes, stream);
}

// ---- tiling -----------------------------------------------------------------------------------------------

// raster [B, T·H·W, H, D] <-> tiled [B, N·64, H, D].
template <bool ToTiled> vsa::status layout_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer>& y,
                                                int64_t t, int64_t h, int64_t w) {
  vsa::problem p;
  vsa::status s = problem_of(x, x, t, h, w, p);
  if (s) s = check_result("output", y, x.element_type(), p, p.q_heads);
  if (!s) return s;
  return ToTiled ? vsa::tile(p, p.q_heads, in(x), out(y), stream) : vsa::untile(p, p.q_heads, in(x), out(y), stream);
}

// ---- the handlers -----------------------------------------------------------------------------------------

using buffer = ffi::AnyBuffer;
using result = ffi::Result<ffi::AnyBuffer>;

ffi::Error forward(cudaStream_t stream, buffer q, buffer k, buffer v, buffer gate, result o, result state, result q2k,
                   result q2k_count, result scratch, int64_t t, int64_t h, int64_t w, int64_t top_k, double sparsity,
                   float scale) {
  return to_error(
      forward_impl(stream, q, k, v, gate, o, state, q2k, q2k_count, scratch, t, h, w, top_k, sparsity, scale),
      "forward");
}

ffi::Error backward(cudaStream_t stream, buffer d_o, buffer q, buffer k, buffer v, buffer gate, buffer o, buffer state,
                    result dq, result dk, result dv, result dgate, result scratch, int64_t t, int64_t h, int64_t w,
                    int64_t top_k, double sparsity, float scale) {
  return to_error(
      backward_impl(stream, d_o, q, k, v, gate, o, state, dq, dk, dv, dgate, scratch, t, h, w, top_k, sparsity, scale),
      "backward");
}

ffi::Error sparse_forward(cudaStream_t stream, buffer q, buffer k, buffer v, buffer q2k, buffer q2k_count, result o,
                          result lse, int64_t t, int64_t h, int64_t w, float scale) {
  return to_error(sparse_forward_impl(stream, q, k, v, q2k, q2k_count, o, lse, t, h, w, scale), "sparse_attention");
}

ffi::Error sparse_backward(cudaStream_t stream, buffer d_o, buffer q, buffer k, buffer v, buffer o, buffer lse,
                           buffer q2k, buffer q2k_count, result dq, result dk, result dv, result scratch, int64_t t,
                           int64_t h, int64_t w, float scale) {
  return to_error(
      sparse_backward_impl(stream, d_o, q, k, v, o, lse, q2k, q2k_count, dq, dk, dv, scratch, t, h, w, scale),
      "sparse_attention_backward");
}

ffi::Error tile(cudaStream_t stream, buffer x, result y, int64_t t, int64_t h, int64_t w) {
  return to_error(layout_impl<true>(stream, x, y, t, h, w), "tile");
}

ffi::Error untile(cudaStream_t stream, buffer x, result y, int64_t t, int64_t h, int64_t w) {
  return to_error(layout_impl<false>(stream, x, y, t, h, w), "untile");
}

} // namespace
} // namespace vsa_jax

// The bindings: the stream first, then the arguments and results in the handlers' order, then the attributes
// (matched by name). The calls launch the same work for the same buffers every time and never wait for the
// device, so XLA may capture them in its command buffers (CUDA graphs).
using stream_ctx = ffi::PlatformStream<cudaStream_t>;
using vsa_jax::buffer;

XLA_FFI_DEFINE_HANDLER_SYMBOL(vsa_jax_forward, vsa_jax::forward,
                              ffi::Ffi::Bind()
                                  .Ctx<stream_ctx>()
                                  .Arg<buffer>() // q
                                  .Arg<buffer>() // k
                                  .Arg<buffer>() // v
                                  .Arg<buffer>() // gate, or an empty array
                                  .Ret<buffer>() // o
                                  .Ret<buffer>() // state
                                  .Ret<buffer>() // q2k, or an empty array
                                  .Ret<buffer>() // q2k_count, or an empty array
                                  .Ret<buffer>() // scratch
                                  .Attr<int64_t>("grid_t")
                                  .Attr<int64_t>("grid_h")
                                  .Attr<int64_t>("grid_w")
                                  .Attr<int64_t>("top_k")
                                  .Attr<double>("sparsity")
                                  .Attr<float>("scale"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(vsa_jax_backward, vsa_jax::backward,
                              ffi::Ffi::Bind()
                                  .Ctx<stream_ctx>()
                                  .Arg<buffer>() // d_o
                                  .Arg<buffer>() // q
                                  .Arg<buffer>() // k
                                  .Arg<buffer>() // v
                                  .Arg<buffer>() // gate, or an empty array
                                  .Arg<buffer>() // o
                                  .Arg<buffer>() // state
                                  .Ret<buffer>() // dq
                                  .Ret<buffer>() // dk
                                  .Ret<buffer>() // dv
                                  .Ret<buffer>() // dgate, or an empty array
                                  .Ret<buffer>() // scratch
                                  .Attr<int64_t>("grid_t")
                                  .Attr<int64_t>("grid_h")
                                  .Attr<int64_t>("grid_w")
                                  .Attr<int64_t>("top_k")
                                  .Attr<double>("sparsity")
                                  .Attr<float>("scale"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(vsa_jax_sparse_forward, vsa_jax::sparse_forward,
                              ffi::Ffi::Bind()
                                  .Ctx<stream_ctx>()
                                  .Arg<buffer>() // q
                                  .Arg<buffer>() // k
                                  .Arg<buffer>() // v
                                  .Arg<buffer>() // q2k
                                  .Arg<buffer>() // q2k_count
                                  .Ret<buffer>() // o
                                  .Ret<buffer>() // lse
                                  .Attr<int64_t>("grid_t")
                                  .Attr<int64_t>("grid_h")
                                  .Attr<int64_t>("grid_w")
                                  .Attr<float>("scale"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(vsa_jax_sparse_backward, vsa_jax::sparse_backward,
                              ffi::Ffi::Bind()
                                  .Ctx<stream_ctx>()
                                  .Arg<buffer>() // d_o
                                  .Arg<buffer>() // q
                                  .Arg<buffer>() // k
                                  .Arg<buffer>() // v
                                  .Arg<buffer>() // o
                                  .Arg<buffer>() // lse
                                  .Arg<buffer>() // q2k
                                  .Arg<buffer>() // q2k_count
                                  .Ret<buffer>() // dq
                                  .Ret<buffer>() // dk
                                  .Ret<buffer>() // dv
                                  .Ret<buffer>() // scratch
                                  .Attr<int64_t>("grid_t")
                                  .Attr<int64_t>("grid_h")
                                  .Attr<int64_t>("grid_w")
                                  .Attr<float>("scale"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(vsa_jax_tile, vsa_jax::tile,
                              ffi::Ffi::Bind()
                                  .Ctx<stream_ctx>()
                                  .Arg<buffer>() // raster
                                  .Ret<buffer>() // tiled
                                  .Attr<int64_t>("grid_t")
                                  .Attr<int64_t>("grid_h")
                                  .Attr<int64_t>("grid_w"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(vsa_jax_untile, vsa_jax::untile,
                              ffi::Ffi::Bind()
                                  .Ctx<stream_ctx>()
                                  .Arg<buffer>() // tiled
                                  .Ret<buffer>() // raster
                                  .Attr<int64_t>("grid_t")
                                  .Attr<int64_t>("grid_h")
                                  .Attr<int64_t>("grid_w"),
                              {ffi::Traits::kCmdBufferCompatible});

// ---- host functions for the Python side (ctypes, at trace time) -------------------------------------------
//
// Each returns the library's error code (0: accepted) and writes its message into `message`.

namespace vsa_jax {
namespace {
int report(const vsa::status& s, char* message, int64_t size) {
  if (message != nullptr && size > 0) std::snprintf(message, static_cast<std::size_t>(size), "%s", s.message());
  return static_cast<int>(s.code());
}
} // namespace
} // namespace vsa_jax

extern "C" {

// vsa::check_problem for the GPU kernels.
int vsa_jax_check_problem(const vsa_jax_problem* d, char* message, int64_t size) {
  return vsa_jax::report(vsa::check_problem(vsa_jax::to_problem(*d), vsa::target::gpu), message, size);
}

// vsa::check_tensor of a dense [B, tokens, heads, D] array against the token count the grid gives (its address
// is XLA's to choose, so an aligned stand-in takes its place).
int vsa_jax_check_tensor(const vsa_jax_problem* d, const char* name, int64_t tokens, int64_t heads,
                         int64_t expected_tokens, char* message, int64_t size) {
  const vsa::problem p = vsa_jax::to_problem(*d);
  const vsa::const_tensor x =
      vsa::bshd(reinterpret_cast<const void*>(vsa_jax::alignment), p.batch, tokens, heads, p.head_dim);
  return vsa_jax::report(vsa::check_tensor(name, x, p, heads, expected_tokens, vsa::target::gpu), message, size);
}

// The whole op: sizes[0] the state's bytes, [1] and [2] the forward's and the backward's scratch results, [3] k.
int vsa_jax_op_sizes(const vsa_jax_problem* d, int64_t top_k, double sparsity, float scale, int64_t* sizes,
                     char* message, int64_t size) {
  vsa_jax::op_plan plan;
  const vsa::status s = vsa_jax::plan_op(vsa_jax::to_problem(*d), vsa_jax::to_options(top_k, sparsity, scale), plan);
  if (s) {
    sizes[0] = static_cast<int64_t>(plan.state_bytes);
    sizes[1] = static_cast<int64_t>(plan.forward_request());
    sizes[2] = static_cast<int64_t>(plan.backward_request());
    sizes[3] = plan.top_k;
  }
  return vsa_jax::report(s, message, size);
}

// Sparse attention on caller lists of `capacity` entries a row: sizes[0] the backward's scratch result.
int vsa_jax_sparse_sizes(const vsa_jax_problem* d, int64_t capacity, float scale, int64_t* sizes, char* message,
                         int64_t size) {
  vsa_jax::sparse_plan plan;
  const vsa::status s = vsa_jax::plan_sparse_backward(vsa_jax::to_problem(*d), capacity, scale, plan);
  if (s) sizes[0] = static_cast<int64_t>(plan.request());
  return vsa_jax::report(s, message, size);
}

// vsa::check_q2k_host on lists in host memory: what the GPU kernels take on trust.
int vsa_jax_check_lists(const vsa_jax_problem* d, const int32_t* q2k, const int32_t* q2k_count, int64_t capacity,
                        char* message, int64_t size) {
  const vsa::const_index_lists lists(q2k, q2k_count, capacity);
  return vsa_jax::report(vsa::check_q2k_host(vsa_jax::to_problem(*d), lists), message, size);
}

} // extern "C"
