// The linear-attention branch on the GPU, forward and backward:
//   o_i = φ(q_i)·(Σ_j φ(k_j) v_jᵀ) / (φ(q_i)·Σ_j φ(k_j) + eps)
// over the valid tokens j of the whole sequence, per batch and query head h (kv head h / (Hq / Hkv)).
// Tiled tensors hold N·64 slots whose padding slots are left out of the sums and written 0; raster tensors
// hold T·H·W tokens. The kernels and the stored form of the state are described in
// detail/linear_attention_kernels.hpp.
//
// Scratch memory follows the two-phase convention: called with workspace == nullptr, an entry point sets
// workspace_bytes and returns. The size depends on the problem and on the current device (how many blocks
// it keeps resident), so query it on the device that runs the call. Results are bitwise reproducible on a
// given device: every sum is taken by one thread in a fixed order.
#pragma once

#include "../geometry.hpp"
#include "../validate.hpp"
#include "detail/linear_attention_kernels.hpp"

#include <algorithm>
#include <climits>
#include <cmath>

namespace vsa {
namespace gpu {
namespace detail {
namespace linear {

// The feature map is a template parameter of the kernels, not a value they test per element: each φ compiles
// to its own straight-line code (no branches between the three in the inner loops), chosen once here.
template <class E, int D, feature_map F> struct config {
  using element = E;
  static constexpr int head_dim = D;
  static constexpr feature_map phi = F;
};

template <class E, int D, class Fn> status dispatch_phi(feature_map phi, Fn&& f) {
  if (phi == feature_map::softmax) return f(config<E, D, feature_map::softmax>{});
  if (phi == feature_map::elu1) return f(config<E, D, feature_map::elu1>{});
  return f(config<E, D, feature_map::relu>{});
}

// Calls f(config<E, D, F>{}) for the problem's dtype, head dim and feature map (validated before: bf16/fp16,
// 64/128, one of the three maps).
template <class Fn> status dispatch(dtype t, int64_t d, feature_map phi, Fn&& f) {
  if (t == dtype::bf16 && d == 128) return dispatch_phi<bf16_type, 128>(phi, f);
  if (t == dtype::bf16 && d == 64) return dispatch_phi<bf16_type, 64>(phi, f);
  if (t == dtype::fp16 && d == 128) return dispatch_phi<fp16_type, 128>(phi, f);
  if (t == dtype::fp16 && d == 64) return dispatch_phi<fp16_type, 64>(phi, f);
  return status::error(errc::bad_argument, "no kernel for %s with head dim %lld", dtype_name(t), (long long)d);
}

inline status check_arguments(const problem& p, feature_map phi, float eps, token_order order) {
  status s = check_problem(p, target::gpu);
  if (!s) return s;
  const int f = static_cast<int>(phi), o = static_cast<int>(order);
  if (f < 0 || f > 2) return status::error(errc::bad_argument, "phi: not a feature_map value (%d)", f);
  if (!(eps >= 0.0f) || !std::isfinite(eps))
    return status::error(errc::bad_argument, "eps: must be >= 0 and finite, got %g", static_cast<double>(eps));
  if (o < 0 || o > 1) return status::error(errc::bad_argument, "order: not a token_order value (%d)", o);
  return status::ok();
}

inline int64_t sequence_tokens(const problem& p, token_order order) {
  const tile_geometry geo(p.grid);
  return order == token_order::tiled ? geo.tiled_tokens() : geo.raster_tokens();
}

inline sequence make_sequence(const problem& p, token_order order) {
  const tile_geometry geo(p.grid);
  const int64_t tokens = sequence_tokens(p, order);
  return {geo, tokens, (tokens + 63) / 64, order == token_order::tiled ? 1 : 0};
}

// Blocks of `kernel` the device keeps resident at once (multiprocessors × blocks per multiprocessor).
template <class Kernel> status resident_blocks(Kernel kernel, int threads, int smem, int64_t& slots) {
  status s = runtime_status(allow_dynamic_shared(kernel, smem), "setting the kernel's shared-memory size");
  int device = 0, sms = 0, per_sm = 0;
  if (s) s = runtime_status(current_device(&device), "querying the current device");
  if (s) s = runtime_status(multiprocessor_count(&sms, device), "querying the multiprocessor count");
#if VSA_RUNTIME_HIP
  if (s)
    s = runtime_status(hipOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, reinterpret_cast<const void*>(kernel),
                                                                    threads, static_cast<std::size_t>(smem)),
                       "querying the kernel's occupancy");
#else
  if (s)
    s = runtime_status(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, static_cast<std::size_t>(smem)),
        "querying the kernel's occupancy");
#endif
  if (!s) return s;
  slots = static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  return status::ok();
}

// Slices per head for `heads` heads of `units` work units each, on `slots` resident blocks: the count that
// minimizes (rounds of blocks) × (units per block + `extra`, a slice's fixed cost in units), the smaller
// count on ties. Equal slices run as one round where they can, without a short last round.
inline int64_t choose_slices(int64_t heads, int64_t units, int64_t slots, int64_t extra) {
  int64_t best = 1, best_cost = -1;
  const int64_t limit = std::min<int64_t>(std::max<int64_t>(units, 1), 4 * slots);
  for (int64_t s = 1; s <= limit; ++s) {
    const int64_t rounds = (heads * s + slots - 1) / slots;
    const int64_t cost = rounds * ((units + s - 1) / s + extra);
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// Slices and workspace offsets of one call.
struct plan {
  bool hopper = false; // the kernels run as Hopper code: their shared memory includes tile_slack
  int64_t heads_kv = 0, heads_q = 0;
  int64_t slices_state = 0, slices_apply = 0, slices_query = 0, slices_key = 0;
  std::size_t partial = 0, state_kvn = 0, state_vec = 0, grad_kvn = 0, grad_vec = 0, rows = 0, bytes = 0;

  template <class T> T* at(void* base, std::size_t off) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(base) + off);
  }
};

template <class E, int D, feature_map F> status make_plan(const problem& p, token_order order, bool backward, plan& w) {
  const sequence seq = make_sequence(p, order);
  w.heads_kv = p.batch * p.kv_heads;
  w.heads_q = p.batch * p.q_heads;
  // All the kernels are built for the same architectures; the state kernel's code version stands for them.
  status s = runs_as_hopper(state_kernel<E, D, F>, w.hopper);
  if (!s) return s;
  int64_t slots = 0;
  s = resident_blocks(state_kernel<E, D, F>, state_shape<E, D>::threads, state_shape<E, D>::smem(w.hopper), slots);
  if (!s) return s;
  // A slice's record is (D + 2) / 64 chunks' worth of K and V traffic, written once and read back once.
  w.slices_state = choose_slices(w.heads_kv, seq.chunks, slots, 2 * ((D + 2 + 63) / 64));
  if (!backward) {
    s = resident_blocks(apply_kernel<E, D, F>, apply_shape<E, D>::threads, apply_shape<E, D>::smem(w.hopper), slots);
    if (!s) return s;
    w.slices_apply = choose_slices(w.heads_q, seq.chunks, slots, 1);
  } else {
    s = resident_blocks(query_grad_kernel<E, D, F>, query_grad_shape<E, D>::threads,
                        query_grad_shape<E, D>::smem(w.hopper), slots);
    if (!s) return s;
    w.slices_query = choose_slices(w.heads_q, seq.chunks, slots, 2 * ((D + 2 + 63) / 64));
    s = resident_blocks(key_grad_kernel<E, D, F>, key_grad_shape<E, D>::threads, key_grad_shape<E, D>::smem(w.hopper),
                        slots);
    if (!s) return s;
    w.slices_key = choose_slices(w.heads_kv, seq.chunks, slots, 1);
  }
  const int64_t blocks = std::max({w.heads_kv * w.slices_state, w.heads_q * std::max(w.slices_apply, w.slices_query),
                                   w.heads_kv * w.slices_key, w.heads_kv * D});
  if (blocks > INT_MAX)
    return status::error(errc::bad_grid, "batch x heads: %lld blocks are more than one launch takes",
                         (long long)blocks);

  const std::size_t rec = sizeof(float) * static_cast<std::size_t>(record<D>::floats);
  const std::size_t records = static_cast<std::size_t>(
      std::max(w.slices_state * w.heads_kv, backward ? w.slices_query * w.heads_q : int64_t(0)));
  const std::size_t hk = static_cast<std::size_t>(w.heads_kv), d = D;
  std::size_t off = 0;
  const auto take = [&](std::size_t bytes) {
    const std::size_t at = off;
    off += vsa::detail::align_up(bytes);
    return at;
  };
  w.partial = take(records * rec);
  w.state_kvn = take(hk * d * d * 2);
  w.state_vec = take(hk * 3 * d * sizeof(float));
  if (backward) {
    w.grad_kvn = take(hk * d * d * 2);
    w.grad_vec = take(hk * 2 * d * sizeof(float));
    w.rows = take(static_cast<std::size_t>(w.slices_query * w.heads_q) * 64 * sizeof(float));
  }
  w.bytes = off;
  return status::ok();
}

// Launches of the stages; each returns the launch's status.
// The copy engine's map of one [B, S, H, D] tensor of a call (hopper_tma.hpp); false where it does not encode,
// and the kernel then copies without it.
template <class Tensor>
bool encode_map(tma_map& map, const Tensor& t, const problem& p, int64_t tokens, int64_t heads, int64_t d) {
  return encode_tile_map(map, t.data, p.batch, tokens, heads, d, t.batch_stride, t.token_stride, t.head_stride);
}

template <class E, int D, feature_map F> status run_state(const problem& p, const plan& w, const sequence& seq,
                                                          const_tensor k, const_tensor v, void* workspace,
                                                          state_view state, stream_t stream) {
  state_params sp{};
  sp.k = make_operand(k);
  sp.v = make_operand(v);
  sp.seq = seq;
  sp.kv_heads = p.kv_heads;
  sp.slices = w.slices_state;
  sp.heads_total = w.heads_kv;
  sp.partial = w.at<float>(workspace, w.partial);
  // On Hopper K and V go through the copy engine where both maps encode (hopper_tma.hpp); the maps end at the
  // sequence's last token, so the copy engine fills a short last raster chunk with zeros.
  sp.tma = 0;
  if (w.hopper && encode_map(sp.k_map, k, p, seq.tokens, p.kv_heads, D) &&
      encode_map(sp.v_map, v, p, seq.tokens, p.kv_heads, D))
    sp.tma = 1;
  // The state kernel starts in stream order: apply, two launches on, reads its first Q tiles before it waits
  // (runtime.hpp: launch), which is sound only if the kernels before the call had finished when this one began.
  // Every later kernel is launched with overlap and waits before it touches what earlier kernels wrote.
  status s = launch("linear attention (state)", state_kernel<E, D, F>,
                    dim3(static_cast<unsigned>(w.heads_kv * w.slices_state)), dim3(state_shape<E, D>::threads),
                    state_shape<E, D>::smem(w.hopper), stream, false, sp);
  if (!s) return s;

  state_reduce_params rp{};
  rp.partial = sp.partial;
  rp.slices = w.slices_state;
  rp.heads_total = w.heads_kv;
  rp.inv_count = static_cast<float>(1.0 / static_cast<double>(tile_geometry(p.grid).raster_tokens()));
  rp.state = state;
  return launch("linear attention (state reduction)", state_reduce_kernel<E, D>,
                dim3(static_cast<unsigned>(w.heads_kv * D)), dim3(D), 0, stream, true, rp);
}

// Where a call's state lives: in the caller's linear_state where one is given (KVn of every head, then z, m, σ
// of every head), otherwise in the workspace.
inline std::size_t state_matrix_bytes(const problem& p) {
  return vsa::detail::align_up(static_cast<std::size_t>(p.batch * p.kv_heads * p.head_dim * p.head_dim) * 2);
}
inline state_view state_in(const plan& w, void* workspace, void* saved, const problem& p) {
  if (saved != nullptr)
    return {static_cast<uint16_t*>(saved),
            reinterpret_cast<float*>(static_cast<unsigned char*>(saved) + state_matrix_bytes(p))};
  return {w.at<uint16_t>(workspace, w.state_kvn), w.at<float>(workspace, w.state_vec)};
}

} // namespace linear
} // namespace detail
} // namespace gpu

// The state of a call: per batch and kv head the D × D matrix KVn (16-bit) and the vectors z, m, σ (fp32), as
// detail/linear_attention_kernels.hpp describes them. linear_attention_forward can leave it in a buffer of the
// caller's (linear_state_bytes(p) bytes, 256-byte aligned; 0.4 MB for wan2.1), and linear_attention_backward
// can take it from there instead of recomputing it from k and v: one pass over k and v and two kernels fewer,
// and the same gradients bit for bit. The buffer must hold the state of a forward of the same problem, feature
// map, order, k and v, run on the same device (the slices of its sums depend on the device); nothing can
// check that. data == nullptr: the forward keeps no state, the backward recomputes it.
struct linear_state {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// 0 for a problem the GPU entry points reject.
inline std::size_t linear_state_bytes(const problem& p) {
  if (!check_problem(p, target::gpu)) return 0;
  return gpu::detail::linear::state_matrix_bytes(p) +
         vsa::detail::align_up(static_cast<std::size_t>(p.batch * p.kv_heads * 3 * p.head_dim) * sizeof(float));
}

namespace gpu {
namespace detail {
namespace linear {
// No buffer means none is kept (forward) or the state is recomputed (backward).
inline status check_state(const linear_state& state, const problem& p) {
  if (state.data == nullptr) return status::ok();
  return check_buffer("state", state.data, state.bytes, linear_state_bytes(p));
}
} // namespace linear
} // namespace detail
} // namespace gpu

// o_l [B, S, Hq, D]: the linear-attention branch of q [B, S, Hq, D] over k, v [B, S, Hkv, D]. S = N·64
// (tiled order; padding slots are excluded and written 0) or T·H·W (raster order). eps >= 0. Where
// state.data is set, the call's state is also left there for the backward (linear_state).
inline status linear_attention_forward(const problem& p, feature_map phi, float eps, token_order order, const_tensor q,
                                       const_tensor k, const_tensor v, tensor o_l, linear_state state, void* workspace,
                                       std::size_t& workspace_bytes, gpu::stream_t stream) {
  namespace gl = gpu::detail::linear;
  status s = gl::check_arguments(p, phi, eps, order);
  if (!s) return s;
  return gl::dispatch(p.type, p.head_dim, phi, [&](auto cfg) -> status {
    using C = decltype(cfg);
    using E = typename C::element;
    constexpr int D = C::head_dim;
    constexpr feature_map F = C::phi;
    gl::plan w;
    status st = gl::make_plan<E, D, F>(p, order, false, w);
    if (!st) return st;
    if (workspace == nullptr) {
      workspace_bytes = w.bytes;
      return status::ok();
    }
    const int64_t tokens = gl::sequence_tokens(p, order);
    if (st) st = check_tensor("q", q, p, p.q_heads, tokens, target::gpu);
    if (st) st = check_tensor("k", k, p, p.kv_heads, tokens, target::gpu);
    if (st) st = check_tensor("v", v, p, p.kv_heads, tokens, target::gpu);
    if (st) st = check_tensor("o_l", o_l, p, p.q_heads, tokens, target::gpu);
    if (st) st = check_workspace(workspace, workspace_bytes, w.bytes);
    if (st) st = gl::check_state(state, p);
    if (st) {
      st = check_linear_forward_disjoint(p, q, k, v, o_l, state.data, linear_state_bytes(p), workspace, w.bytes);
    }
    if (!st) return st;

    const gl::sequence seq = gl::make_sequence(p, order);
    const gl::state_view sv = gl::state_in(w, workspace, state.data, p);
    st = gl::run_state<E, D, F>(p, w, seq, k, v, workspace, sv, stream);
    if (!st) return st;
    gl::apply_params ap{};
    ap.q = gpu::detail::make_operand(q);
    ap.o = gpu::detail::make_operand(o_l);
    ap.seq = seq;
    ap.q_heads = p.q_heads;
    ap.group = p.q_heads / p.kv_heads;
    ap.slices = w.slices_apply;
    ap.kvn = sv.kvn;
    ap.vec = sv.vec;
    ap.eps = eps;
    // On Hopper Q and O go through the copy engine where both maps encode (hopper_tma.hpp).
    ap.tma = 0;
    if (w.hopper && gl::encode_map(ap.q_map, q, p, tokens, p.q_heads, D) &&
        gl::encode_map(ap.o_map, o_l, p, tokens, p.q_heads, D))
      ap.tma = 1;
    return gpu::launch("linear attention (apply)", gl::apply_kernel<E, D, F>,
                       dim3(static_cast<unsigned>(w.heads_q * w.slices_apply)), dim3(gl::apply_shape<E, D>::threads),
                       gl::apply_shape<E, D>::smem(w.hopper), stream, true, ap);
  });
}

inline status linear_attention_forward(const problem& p, feature_map phi, float eps, token_order order, const_tensor q,
                                       const_tensor k, const_tensor v, tensor o_l, void* workspace,
                                       std::size_t& workspace_bytes, gpu::stream_t stream) {
  return linear_attention_forward(p, phi, eps, order, q, k, v, o_l, linear_state{}, workspace, workspace_bytes, stream);
}

// dq [B, S, Hq, D], dk and dv [B, S, Hkv, D] of linear_attention_forward given d_o = dL/do_l (same order
// and layout rules; dk and dv sum over the q heads of each group). The state is taken from `state` where
// state.data is set (linear_state), otherwise recomputed from k and v.
inline status linear_attention_backward(const problem& p, feature_map phi, float eps, token_order order, const_tensor q,
                                        const_tensor k, const_tensor v, const_tensor d_o, tensor dq, tensor dk,
                                        tensor dv, linear_state state, void* workspace, std::size_t& workspace_bytes,
                                        gpu::stream_t stream) {
  namespace gl = gpu::detail::linear;
  status s = gl::check_arguments(p, phi, eps, order);
  if (!s) return s;
  return gl::dispatch(p.type, p.head_dim, phi, [&](auto cfg) -> status {
    using C = decltype(cfg);
    using E = typename C::element;
    constexpr int D = C::head_dim;
    constexpr feature_map F = C::phi;
    gl::plan w;
    status st = gl::make_plan<E, D, F>(p, order, true, w);
    if (!st) return st;
    if (workspace == nullptr) {
      workspace_bytes = w.bytes;
      return status::ok();
    }
    const int64_t tokens = gl::sequence_tokens(p, order);
    if (st) st = check_tensor("q", q, p, p.q_heads, tokens, target::gpu);
    if (st) st = check_tensor("k", k, p, p.kv_heads, tokens, target::gpu);
    if (st) st = check_tensor("v", v, p, p.kv_heads, tokens, target::gpu);
    if (st) st = check_tensor("d_o", d_o, p, p.q_heads, tokens, target::gpu);
    if (st) st = check_tensor("dq", dq, p, p.q_heads, tokens, target::gpu);
    if (st) st = check_tensor("dk", dk, p, p.kv_heads, tokens, target::gpu);
    if (st) st = check_tensor("dv", dv, p, p.kv_heads, tokens, target::gpu);
    if (st) st = check_workspace(workspace, workspace_bytes, w.bytes);
    if (st) st = gl::check_state(state, p);
    if (st) {
      st = check_linear_backward_disjoint(p, q, k, v, d_o, state.data, linear_state_bytes(p), dq, dk, dv, workspace,
                                          w.bytes);
    }
    if (!st) return st;

    const gl::sequence seq = gl::make_sequence(p, order);
    const gl::state_view sv = gl::state_in(w, workspace, state.data, p);
    if (state.data == nullptr) {
      st = gl::run_state<E, D, F>(p, w, seq, k, v, workspace, sv, stream);
      if (!st) return st;
    }

    gl::query_grad_params qp{};
    qp.q = gpu::detail::make_operand(q);
    qp.d_o = gpu::detail::make_operand(d_o);
    qp.dq = gpu::detail::make_operand(dq);
    qp.seq = seq;
    qp.q_heads = p.q_heads;
    qp.group = p.q_heads / p.kv_heads;
    qp.slices = w.slices_query;
    qp.heads_total = w.heads_q;
    qp.kvn = sv.kvn;
    qp.vec = sv.vec;
    qp.eps = eps;
    qp.partial = w.at<float>(workspace, w.partial);
    qp.rows = w.at<float>(workspace, w.rows);
    // On Hopper Q and dO in and dq out through the copy engine where the kernel has the shared memory for it
    // and all three maps encode (hopper_tma.hpp); the maps end at the sequence's last token, so a short last
    // raster chunk is zero-filled on the way in and clipped on the way out.
    qp.tma = 0;
    if (w.hopper && gl::query_grad_shape<E, D>::tma && gl::encode_map(qp.q_map, q, p, tokens, p.q_heads, D) &&
        gl::encode_map(qp.do_map, d_o, p, tokens, p.q_heads, D) &&
        gl::encode_map(qp.dq_map, dq, p, tokens, p.q_heads, D))
      qp.tma = 1;
    st = gpu::launch("linear attention backward (query side)", gl::query_grad_kernel<E, D, F>,
                     dim3(static_cast<unsigned>(w.heads_q * w.slices_query)), dim3(gl::query_grad_shape<E, D>::threads),
                     gl::query_grad_shape<E, D>::smem(w.hopper), stream, true, qp);
    if (!st) return st;

    gl::grad_reduce_params rp{};
    rp.partial = qp.partial;
    rp.slices = w.slices_query;
    rp.q_heads = p.q_heads;
    rp.kv_heads = p.kv_heads;
    rp.group = qp.group;
    rp.heads_total = w.heads_q;
    rp.state_vec = qp.vec;
    rp.grad = {w.at<uint16_t>(workspace, w.grad_kvn), w.at<float>(workspace, w.grad_vec)};
    st = gpu::launch("linear attention backward (state gradient)", gl::grad_reduce_kernel<E, D>,
                     dim3(static_cast<unsigned>(w.heads_kv * D)), dim3(D), 0, stream, true, rp);
    if (!st) return st;

    gl::key_grad_params kp{};
    kp.k = gpu::detail::make_operand(k);
    kp.v = gpu::detail::make_operand(v);
    kp.dk = gpu::detail::make_operand(dk);
    kp.dv = gpu::detail::make_operand(dv);
    kp.seq = seq;
    kp.kv_heads = p.kv_heads;
    kp.slices = w.slices_key;
    kp.state_vec = qp.vec;
    kp.grad_kvn = rp.grad.kvn;
    kp.grad_vec = rp.grad.vec;
    // On Hopper K, V in and dk, dv out through the copy engine where all four maps encode (hopper_tma.hpp);
    // the maps end at the sequence's last token, so a short last raster chunk is zero-filled on the way in
    // and clipped on the way out.
    kp.tma = 0;
    if (w.hopper && gl::encode_map(kp.k_map, k, p, tokens, p.kv_heads, D) &&
        gl::encode_map(kp.v_map, v, p, tokens, p.kv_heads, D) &&
        gl::encode_map(kp.dk_map, dk, p, tokens, p.kv_heads, D) &&
        gl::encode_map(kp.dv_map, dv, p, tokens, p.kv_heads, D))
      kp.tma = 1;
    return gpu::launch("linear attention backward (key side)", gl::key_grad_kernel<E, D, F>,
                       dim3(static_cast<unsigned>(w.heads_kv * w.slices_key)), dim3(gl::key_grad_shape<E, D>::threads),
                       gl::key_grad_shape<E, D>::smem(w.hopper), stream, true, kp);
  });
}

inline status linear_attention_backward(const problem& p, feature_map phi, float eps, token_order order, const_tensor q,
                                        const_tensor k, const_tensor v, const_tensor d_o, tensor dq, tensor dk,
                                        tensor dv, void* workspace, std::size_t& workspace_bytes,
                                        gpu::stream_t stream) {
  return linear_attention_backward(p, phi, eps, order, q, k, v, d_o, dq, dk, dv, linear_state{}, workspace,
                                   workspace_bytes, stream);
}

} // namespace vsa
