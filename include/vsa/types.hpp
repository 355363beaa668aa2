// Vocabulary of the library: element types, status codes, problem shapes, tensor views and index lists.
// Everything here is plain host code, usable from any C++17 compiler; device code sees the same types.
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define VSA_HOST_DEVICE __host__ __device__
#else
#define VSA_HOST_DEVICE
#endif

namespace vsa {

// Storage type of q, k, v, o and their gradients. The GPU kernels take bf16 and fp16; the CPU reference
// also takes f32 and f64, so that gradients can be checked against finite differences in double.
enum class dtype : int { bf16 = 0, fp16 = 1, f32 = 2, f64 = 3 };

inline constexpr std::size_t dtype_size(dtype t) { return t == dtype::f64 ? 8 : t == dtype::f32 ? 4 : 2; }

inline constexpr const char* dtype_name(dtype t) {
  return t == dtype::bf16 ? "bf16" : t == dtype::fp16 ? "fp16" : t == dtype::f32 ? "f32" : "f64";
}

// One code per kind of rejected argument, so that callers can branch on it; the message says which argument.
enum class errc : int {
  ok = 0,
  null_pointer,       // a required pointer is null
  misaligned_pointer, // a pointer or stride breaks the alignment the vector loads need
  bad_head_dim,       // head_dim not supported (64 or 128)
  bad_dtype,          // element type not supported by this entry point
  bad_batch,          // batch < 1
  bad_heads,          // q_heads or kv_heads < 1, or kv_heads does not divide q_heads
  bad_grid,           // a grid dimension < 1, or a size that overflows
  bad_tokens,         // a tensor's token count does not match the grid
  bad_strides,        // strides that overlap or leave the head dim non-contiguous
  bad_top_k,          // k outside [1, N], or a sparsity outside [0, 1)
  bad_index,          // caller-supplied index lists with out-of-range or repeated tiles
  bad_workspace,      // workspace missing or smaller than asked for
  bad_argument,       // any other argument out of its domain (scale, epsilon, enum value)
  unsupported,        // the build has no kernel for this (no GPU platform compiled in)
  runtime_error,      // the GPU runtime reported an error
  aliased,            // an output shares memory with another argument of the call
};

inline constexpr const char* errc_name(errc e) {
  switch (e) {
  case errc::ok:
    return "ok";
  case errc::null_pointer:
    return "null_pointer";
  case errc::misaligned_pointer:
    return "misaligned_pointer";
  case errc::bad_head_dim:
    return "bad_head_dim";
  case errc::bad_dtype:
    return "bad_dtype";
  case errc::bad_batch:
    return "bad_batch";
  case errc::bad_heads:
    return "bad_heads";
  case errc::bad_grid:
    return "bad_grid";
  case errc::bad_tokens:
    return "bad_tokens";
  case errc::bad_strides:
    return "bad_strides";
  case errc::bad_top_k:
    return "bad_top_k";
  case errc::bad_index:
    return "bad_index";
  case errc::bad_workspace:
    return "bad_workspace";
  case errc::bad_argument:
    return "bad_argument";
  case errc::unsupported:
    return "unsupported";
  case errc::runtime_error:
    return "runtime_error";
  case errc::aliased:
    return "aliased";
  }
  return "unknown";
}

// The result of every call: a code and a readable message. Trivially copyable and allocation-free, so
// it can be returned from any layer, including the inside of an inference engine's hot loop.
class status {
public:
  status() = default;
  static status ok() { return status(); }
  static status error(errc code, const char* fmt, ...)
#if defined(__GNUC__)
      __attribute__((format(printf, 2, 3)))
#endif
  {
    status s;
    s.code_ = code;
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(s.message_, sizeof(s.message_), fmt, args);
    va_end(args);
    return s;
  }
  bool is_ok() const { return code_ == errc::ok; }
  explicit operator bool() const { return is_ok(); }
  errc code() const { return code_; }
  const char* message() const { return code_ == errc::ok ? "ok" : message_; }

private:
  errc code_ = errc::ok;
  char message_[192] = {};
};

// The latent video grid, in tokens: T frames × H rows × W columns.
struct grid3 {
  int64_t t = 0, h = 0, w = 0;
};

// Shape of one problem. q has q_heads heads; k and v have kv_heads (grouped-query attention when
// kv_heads < q_heads; kv_heads divides q_heads, query head h reads key/value head h / (q_heads / kv_heads)).
struct problem {
  int64_t batch = 1;
  int64_t q_heads = 1;
  int64_t kv_heads = 1;
  int64_t head_dim = 128;
  grid3 grid{};
  dtype type = dtype::bf16;
};

// A view of a [B, S, H, D] tensor through element strides; the head-dim axis is contiguous (stride 1).
// `tokens` is S as the caller allocated it: it is checked against what the grid implies (N·64 slots in
// tiled order, T·H·W in raster order). [B, S, H, D] and [B, H, S, D] are both expressed by the strides.
template <class Ptr> struct basic_tensor {
  Ptr data = nullptr;
  int64_t tokens = 0;
  int64_t batch_stride = 0;
  int64_t token_stride = 0;
  int64_t head_stride = 0;

  constexpr basic_tensor() = default;
  constexpr basic_tensor(Ptr d, int64_t s, int64_t batch, int64_t token, int64_t head)
      : data(d), tokens(s), batch_stride(batch), token_stride(token), head_stride(head) {}
  // A writable view is also a read-only one.
  template <class Other, class = std::enable_if_t<std::is_convertible<Other, Ptr>::value>>
  constexpr basic_tensor(const basic_tensor<Other>& o)
      : basic_tensor(o.data, o.tokens, o.batch_stride, o.token_stride, o.head_stride) {}
};
using tensor = basic_tensor<void*>;
using const_tensor = basic_tensor<const void*>;

// Views of a dense [B, S, H, D] or [B, H, S, D] buffer.
template <class Ptr> basic_tensor<Ptr> bshd(Ptr data, int64_t batch, int64_t tokens, int64_t heads, int64_t head_dim) {
  (void)batch;
  return {data, tokens, tokens * heads * head_dim, heads * head_dim, head_dim};
}
template <class Ptr> basic_tensor<Ptr> bhsd(Ptr data, int64_t batch, int64_t tokens, int64_t heads, int64_t head_dim) {
  (void)batch;
  return {data, tokens, heads * tokens * head_dim, head_dim, tokens * head_dim};
}
inline const_tensor as_const(const tensor& t) {
  return {t.data, t.tokens, t.batch_stride, t.token_stride, t.head_stride};
}

// Index lists of the sparse pass, per batch and query head (b, h) and N tiles per head.
//  q2k:        [B·Hq·N, q2k_capacity] int32; row (b, h, i) holds the key tiles of query tile i, ascending,
//              in its first q2k_count[(b·Hq + h)·N + i] slots.
//  k2q:        [B·Hq, N·q2k_capacity] int32; the lists of head (b, h) packed one after another: key tile j
//              of that head owns k2q[(b·Hq + h)·N·q2k_capacity + k2q_offset[(b·Hq + h)·(N+1) + j] ...
//              up to the next offset), the query tiles that selected j, ascending.
//  k2q_offset: [B·Hq, N + 1] int32, relative to the head's start; entry 0 is 0.
template <class Ptr> struct basic_index_lists {
  Ptr q2k = nullptr;
  Ptr q2k_count = nullptr;
  int64_t q2k_capacity = 0;
  Ptr k2q = nullptr;
  Ptr k2q_offset = nullptr;

  constexpr basic_index_lists() = default;
  constexpr basic_index_lists(Ptr q2k_, Ptr count, int64_t capacity, Ptr k2q_ = nullptr, Ptr offset = nullptr)
      : q2k(q2k_), q2k_count(count), q2k_capacity(capacity), k2q(k2q_), k2q_offset(offset) {}
  template <class Other, class = std::enable_if_t<std::is_convertible<Other, Ptr>::value>>
  constexpr basic_index_lists(const basic_index_lists<Other>& o)
      : basic_index_lists(o.q2k, o.q2k_count, o.q2k_capacity, o.k2q, o.k2q_offset) {}
};
using index_lists = basic_index_lists<int32_t*>;
using const_index_lists = basic_index_lists<const int32_t*>;
inline const_index_lists as_const(const index_lists& x) {
  return {x.q2k, x.q2k_count, x.q2k_capacity, x.k2q, x.k2q_offset};
}

// Joint attention (HunyuanVideo and the like): one sequence holds the video's tokens and `count` text or
// condition tokens, the extra tokens, before the video (first) or after it. A tensor of the joint op holds
// S = N·64 + count tokens: the video part is N·64 slots in tiled order (tile_geometry::tiled_tokens()), laid out
// exactly as the tensors of the video-only op, and the extra tokens are plain rows, any count, with no padding:
//   first = true:  [count extra tokens][N·64 video slots]
//   first = false: [N·64 video slots][count extra tokens]
// (An output of the whole op in raster order holds T·H·W video tokens in place of the N·64 slots.)
// A video query attends to the key tiles selected for it and to every extra token; an extra query attends to
// every valid video token and every extra token. The coarse branch, the selection and the gate see the video
// part only. count = 0 is the video-only op.
struct extra_tokens {
  int64_t count = 0;
  bool first = false; // the extra tokens precede the video tokens

  // Token of the first video slot, and of the first extra token, in a joint tensor of `video` video tokens.
  VSA_HOST_DEVICE int64_t video_start() const { return first ? count : 0; }
  VSA_HOST_DEVICE int64_t extra_start(int64_t video) const { return first ? 0 : video; }
};

// A packed batch (varlen): samples of different latent grids in one sequence, as an inference engine batches requests
// of different sizes. Sample s holds N_s tiles (tile_geometry(grids[s]).num_tiles()); its N_s·64 tiled slots follow the
// previous sample's, so that the tensors of a packed call are [1, N·64, H, D] views, N = Σ N_s, with no padding
// between samples beyond each sample's own partial tiles. Tiles are numbered across the batch: sample s owns tiles
// first_s … first_s + N_s − 1, first_s = Σ_{r<s} N_r, and a q2k row of one of them lists tiles of the same sample (an
// entry of another sample is the caller's error: it costs results, never memory safety). `grids` is host memory of
// `samples` entries; the heads, head dim and element type are the batch's.
struct packed_problem {
  int64_t q_heads = 1;
  int64_t kv_heads = 1;
  int64_t head_dim = 128;
  dtype type = dtype::bf16;
  const grid3* grids = nullptr;
  int64_t samples = 0;
};

// Feature map of the linear-attention branch.
enum class feature_map : int { softmax = 0, elu1 = 1, relu = 2 };

// Order of the tokens of a tensor: tiled (every tile in 64 consecutive slots) or raster (t, h, w).
enum class token_order : int { tiled = 0, raster = 1 };

// How the whole op picks its key tiles and scales its scores.
struct options {
  int64_t top_k = 0;     // key tiles per query tile; 0: derived from sparsity
  double sparsity = 0.9; // used when top_k == 0: k = clamp(ceil((1 - sparsity)·N), 1, N)
  float scale = 0.0f;    // softmax scale; 0: 1/sqrt(head_dim)
  // Optional caller-supplied q2k lists (q2k, q2k_count, q2k_capacity; k2q fields ignored). When set, the
  // op skips block means, coarse attention and selection: o = o_s, and the gate must be absent.
  const_index_lists q2k{};
  // Order of the op's outputs: o, as forward() writes it and backward() reads it, and the gradients dq, dk,
  // dv and dgate. raster: T·H·W tokens, every valid slot's row at its token, so that a model takes them with no
  // untile pass (nothing is written for padding slots); tiled: N·64 slots, padding slots written zero. The
  // other tensors are ordered by input_order.
  token_order output_order = token_order::tiled;
  // Order of the op's inputs: q, k, v and gate as forward() takes them, and d_o as backward() does. raster: T·H·W
  // tokens, and the op makes the tiled copies its kernels read inside the passes that read every token anyway
  // (the block means, and the combine's backward; a plain tile pass where the caller supplied the lists):
  // forward() writes the tiled q, k, v and gate into forward_io::tiled, the caller's memory, and backward() takes
  // those as its q, k, v and gate (or the caller's own tiled copies), d_o in raster order. tiled: N·64 slots.
  token_order input_order = token_order::tiled;
};

// Tensors of the whole op, all [B, S, H, D] views in tiled order (S = N·64; o and the gradients in raster order
// when options::output_order says so, the forward's inputs and d_o when options::input_order does). gate may have
// a null data pointer (g = 1); then dgate must be null too.
struct tiled_inputs {
  tensor q, k, v, gate; // N·64 slots each, padding slots written zero; gate null where the op has no gate
};
struct forward_io {
  const_tensor q, k, v, gate;
  tensor o;
  tiled_inputs tiled{}; // input_order raster: where forward() puts the tiled copies of q, k, v and gate
};
struct backward_io {
  const_tensor q, k, v, gate, o, d_o;
  tensor dq, dk, dv, dgate;
};

// The whole op's memory in two parts, for a caller that keeps only what the backward needs between the two
// passes (a training framework holding one state per layer): `state`, written by forward() and read, not
// changed, by backward(); and `scratch`, either pass's temporary memory, free for any other use once the
// call's work on its stream is done. Two-phase like a workspace: called with state == nullptr, forward() and
// backward() only set both sizes (the scratch that pass needs). Both pointers 256-byte aligned.
struct op_buffers {
  void* state = nullptr;
  std::size_t state_bytes = 0;
  void* scratch = nullptr;
  std::size_t scratch_bytes = 0;
};

} // namespace vsa
