// Argument checks shared by the CPU reference and the GPU entry points. Every public call runs these
// before touching memory, so a bad shape comes back as an error naming the argument, never as a crash
// or a write outside the outputs.
#pragma once

#include "geometry.hpp"
#include "types.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace vsa {

// What an entry point accepts: the GPU kernels take bf16/fp16 and head dim 64/128, aligned for 16-byte
// vector loads; the CPU reference takes any dtype and head dims 1..256.
enum class target : int { cpu = 0, gpu = 1 };

namespace detail {

inline constexpr int64_t size_limit = int64_t(1) << 60; // keeps every product below int64 overflow

// Every piece of a workspace starts on a 256-byte boundary (what the runtimes' allocators give, and more than
// any kernel's vector loads need): n rounded up to it. The one rule for every entry point's workspace.
inline constexpr int workspace_alignment = 256;
template <class T> constexpr T align_up(T n) {
  return (n + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
}

// a·b, or -1 when it would pass size_limit (operands are non-negative).
inline int64_t checked_mul(int64_t a, int64_t b) {
  if (a < 0 || b < 0) return -1;
  if (a != 0 && b > size_limit / a) return -1;
  return a * b;
}

// The softmax scale the whole op uses: options.scale, or 1/sqrt(head_dim) when it is 0. Stages take the
// resolved value and reject anything that is not positive and finite.
inline float resolve_scale(const problem& p, const options& opt) {
  return opt.scale != 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
}
inline status check_scale(float scale) {
  if (!(scale > 0.0f) || !std::isfinite(scale))
    return status::error(errc::bad_argument, "scale: must be positive and finite, got %g", static_cast<double>(scale));
  return status::ok();
}

} // namespace detail

inline status check_problem(const problem& p, target where) {
  if (p.batch < 1) return status::error(errc::bad_batch, "batch: must be >= 1, got %lld", (long long)p.batch);
  if (p.q_heads < 1 || p.kv_heads < 1)
    return status::error(errc::bad_heads, "q_heads/kv_heads: must be >= 1, got %lld/%lld", (long long)p.q_heads,
                         (long long)p.kv_heads);
  if (p.q_heads % p.kv_heads != 0)
    return status::error(errc::bad_heads, "kv_heads: %lld does not divide q_heads %lld", (long long)p.kv_heads,
                         (long long)p.q_heads);
  const int t = static_cast<int>(p.type);
  if (t < 0 || t > 3) return status::error(errc::bad_dtype, "type: not a dtype value (%d)", t);
  if (where == target::gpu) {
    if (p.head_dim != 64 && p.head_dim != 128)
      return status::error(errc::bad_head_dim, "head_dim: the GPU kernels take 64 or 128, got %lld",
                           (long long)p.head_dim);
    if (p.type != dtype::bf16 && p.type != dtype::fp16)
      return status::error(errc::bad_dtype, "type: the GPU kernels take bf16 or fp16, got %s", dtype_name(p.type));
  } else if (p.head_dim < 1 || p.head_dim > 256) {
    return status::error(errc::bad_head_dim, "head_dim: must be in 1..256, got %lld", (long long)p.head_dim);
  }
  if (p.grid.t < 1 || p.grid.h < 1 || p.grid.w < 1)
    return status::error(errc::bad_grid, "grid: every dimension must be >= 1, got %lldx%lldx%lld", (long long)p.grid.t,
                         (long long)p.grid.h, (long long)p.grid.w);
  // Every size the library forms is at most batch · heads · (tiled tokens) · head_dim, and the index lists
  // at most batch · heads · N²; both must stay far from int64 overflow.
  int64_t n = detail::checked_mul(detail::checked_mul(p.grid.t, p.grid.h), p.grid.w);
  const int64_t tiles = n < 0 ? -1 : tile_geometry(p.grid).num_tiles();
  int64_t elems = detail::checked_mul(detail::checked_mul(detail::checked_mul(tiles, tile_tokens), p.q_heads),
                                      detail::checked_mul(p.batch, p.head_dim));
  int64_t pairs = detail::checked_mul(detail::checked_mul(tiles, tiles), detail::checked_mul(p.batch, p.q_heads));
  if (n < 0 || elems < 0 || pairs < 0)
    return status::error(errc::bad_grid, "grid: %lldx%lldx%lld with batch %lld and %lld heads overflows the sizes",
                         (long long)p.grid.t, (long long)p.grid.h, (long long)p.grid.w, (long long)p.batch,
                         (long long)p.q_heads);
  if (tiles > (int64_t(1) << 30))
    return status::error(errc::bad_grid, "grid: %lld tiles is more than the 2^30 the int32 index lists hold",
                         (long long)tiles);
  return status::ok();
}

// A packed batch (packed_problem): at least one sample, every grid's dimensions >= 1, and the batch as one problem of
// N = Σ N_s tiles, `whole`, whose sizes every check of the one-grid entry points then takes: batch 1, the batch's
// heads, head dim and type, and a grid of N whole tiles (4 × 4 × 4N), so that its tensors hold N·64 slots. Only the
// tiles' valid counts differ from that grid's, which the kernels take from the samples' grids. The rows of the batch
// stay below 2^31 (the kernels' tile table holds each tile's first row as an int32).
inline status check_packed_problem(const packed_problem& pp, target where, problem& whole) {
  if (pp.samples < 1) return status::error(errc::bad_batch, "samples: must be >= 1, got %lld", (long long)pp.samples);
  if (pp.grids == nullptr) return status::error(errc::null_pointer, "grids: pointer is null");
  int64_t tiles = 0;
  for (int64_t s = 0; s < pp.samples; ++s) {
    const grid3 g = pp.grids[s];
    if (g.t < 1 || g.h < 1 || g.w < 1)
      return status::error(errc::bad_grid, "grids[%lld]: every dimension must be >= 1, got %lldx%lldx%lld",
                           (long long)s, (long long)g.t, (long long)g.h, (long long)g.w);
    if (detail::checked_mul(detail::checked_mul(g.t, g.h), g.w) < 0)
      return status::error(errc::bad_grid, "grids[%lld]: %lldx%lldx%lld overflows the sizes", (long long)s,
                           (long long)g.t, (long long)g.h, (long long)g.w);
    const int64_t n = tile_geometry(g).num_tiles(); // below 2^60 (checked_mul above), and so is the sum below
    if (n > int64_t(INT32_MAX) / tile_tokens - tiles)
      return status::error(errc::unsupported, "grids: samples 0..%lld hold more than 2^31 slots", (long long)s);
    tiles += n;
  }
  whole = problem{};
  whole.batch = 1;
  whole.q_heads = pp.q_heads;
  whole.kv_heads = pp.kv_heads;
  whole.head_dim = pp.head_dim;
  whole.type = pp.type;
  whole.grid = {tile_edge, tile_edge, tile_edge * tiles};
  return check_problem(whole, where);
}

// The extra tokens of the joint op (extra_tokens): a count >= 0 whose tensors, batch · heads · (N·64 + count) ·
// head_dim elements, stay far from int64 overflow as the video's do (check_problem runs first).
inline status check_extra_tokens(const problem& p, const extra_tokens& extra) {
  if (extra.count < 0)
    return status::error(errc::bad_argument, "extra.count: must be >= 0, got %lld", (long long)extra.count);
  const int64_t slots = tile_geometry(p.grid).tiled_tokens();
  const int64_t tokens = extra.count > detail::size_limit - slots ? -1 : slots + extra.count;
  const int64_t elems =
      detail::checked_mul(detail::checked_mul(tokens, p.q_heads), detail::checked_mul(p.batch, p.head_dim));
  if (elems < 0)
    return status::error(errc::bad_argument, "extra.count: %lld tokens with batch %lld and %lld heads overflow",
                         (long long)extra.count, (long long)p.batch, (long long)p.q_heads);
  return status::ok();
}

// A [B, S, H, D] view: present, S as expected, head dim contiguous, no two (b, s, h) rows overlapping,
// and (for the GPU) 16-byte aligned rows.
template <class Ptr> status check_tensor(const char* name, const basic_tensor<Ptr>& x, const problem& p, int64_t heads,
                                         int64_t expected_tokens, target where) {
  if (x.data == nullptr) return status::error(errc::null_pointer, "%s: data is null", name);
  if (x.tokens != expected_tokens)
    return status::error(errc::bad_tokens, "%s: holds %lld tokens, the grid needs %lld", name, (long long)x.tokens,
                         (long long)expected_tokens);
  if (x.batch_stride < 0 || x.token_stride < 0 || x.head_stride < 0)
    return status::error(errc::bad_strides, "%s: negative stride", name);
  // Sort the three outer axes by stride; each must step past everything the smaller ones span.
  struct axis {
    int64_t stride, extent;
  } ax[3] = {{x.batch_stride, p.batch}, {x.token_stride, x.tokens}, {x.head_stride, heads}};
  std::sort(ax, ax + 3, [](const axis& a, const axis& b) { return a.stride < b.stride; });
  int64_t span = p.head_dim; // the contiguous head-dim row
  for (const axis& a : ax) {
    if (a.extent <= 1) continue;
    if (a.stride < span)
      return status::error(
          errc::bad_strides, "%s: strides (batch %lld, token %lld, head %lld) overlap or cut the head dim (%lld)", name,
          (long long)x.batch_stride, (long long)x.token_stride, (long long)x.head_stride, (long long)p.head_dim);
    span = detail::checked_mul(a.stride, a.extent);
    if (span < 0) return status::error(errc::bad_strides, "%s: strides overflow", name);
  }
  if (where == target::gpu) {
    const int64_t vec = 16 / static_cast<int64_t>(dtype_size(p.type));
    if (reinterpret_cast<std::uintptr_t>(x.data) % 16 != 0)
      return status::error(errc::misaligned_pointer, "%s: data must be 16-byte aligned", name);
    if (x.batch_stride % vec != 0 || x.token_stride % vec != 0 || x.head_stride % vec != 0)
      return status::error(errc::misaligned_pointer, "%s: strides must be multiples of %lld elements (16 bytes)", name,
                           (long long)vec);
  }
  return status::ok();
}

// A tensor of the joint op: `video` video tokens (N·64 slots, or T·H·W for an output in raster order) and the
// extra tokens; the message names both parts. With no extra tokens it is check_tensor.
template <class Ptr> status check_joint_tensor(const char* name, const basic_tensor<Ptr>& x, const problem& p,
                                               int64_t heads, int64_t video, const extra_tokens& extra, target where) {
  if (x.data != nullptr && extra.count != 0 && x.tokens != video + extra.count)
    return status::error(errc::bad_tokens, "%s: holds %lld tokens, %lld video and %lld extra tokens need %lld", name,
                         (long long)x.tokens, (long long)video, (long long)extra.count,
                         (long long)(video + extra.count));
  return check_tensor(name, x, p, heads, video + extra.count, where);
}

// The memory an argument covers, for the aliasing checks (check_disjoint): its byte interval, and for a
// tensor view also its exact element set, offsets Σ i_a·stride_a + c (i_a < extent_a, c < row) in elements of
// `elem` bytes, so that views interleaved in one buffer (q, k and v of a packed qkv tensor, or dq, dk and dv
// of its gradient) count as disjoint. An empty footprint (a null optional argument) overlaps nothing.
struct footprint {
  const char* name = "";
  std::uintptr_t lo = 0, hi = 0; // [lo, hi)
  int axes = 0;                  // 0: a plain buffer, the interval alone
  int64_t stride[3] = {0, 0, 0}, extent[3] = {0, 0, 0}, row = 0, elem = 1;
};

// A [B, S, H, D] view that check_tensor accepted (the outer axes sorted by stride, axes of extent 1 dropped).
template <class Ptr>
footprint view_footprint(const char* name, const basic_tensor<Ptr>& x, const problem& p, int64_t heads) {
  footprint f;
  f.name = name;
  if (x.data == nullptr) return f;
  f.elem = static_cast<int64_t>(dtype_size(p.type));
  f.row = p.head_dim;
  const int64_t strides[3] = {x.batch_stride, x.token_stride, x.head_stride}, extents[3] = {p.batch, x.tokens, heads};
  int64_t last = p.head_dim; // offset one past the last element
  for (int a = 0; a < 3; ++a) {
    last += (extents[a] - 1) * strides[a];
    if (extents[a] <= 1) continue;
    int at = f.axes++;
    for (; at > 0 && f.stride[at - 1] > strides[a]; --at)
      f.stride[at] = f.stride[at - 1], f.extent[at] = f.extent[at - 1];
    f.stride[at] = strides[a];
    f.extent[at] = extents[a];
  }
  f.lo = reinterpret_cast<std::uintptr_t>(x.data);
  f.hi = f.lo + static_cast<std::uintptr_t>(last * f.elem);
  return f;
}
inline footprint buffer_footprint(const char* name, const void* data, std::size_t bytes) {
  footprint f;
  f.name = name;
  if (data == nullptr || bytes == 0) return f;
  f.lo = reinterpret_cast<std::uintptr_t>(data);
  f.hi = f.lo + bytes;
  return f;
}

// The arrays of index lists as arguments of a call (the k2q ones only where the call reads them).
struct list_footprints {
  footprint q2k, count, k2q, offset;
};
inline list_footprints lists_footprint(const problem& p, const const_index_lists& idx, bool with_k2q) {
  const int64_t n = tile_geometry(p.grid).num_tiles(), rows = p.batch * p.q_heads * n;
  const std::size_t list_bytes = sizeof(int32_t) * static_cast<std::size_t>(rows * idx.q2k_capacity);
  list_footprints f;
  f.q2k = buffer_footprint("q2k", idx.q2k, list_bytes);
  f.count = buffer_footprint("q2k_count", idx.q2k_count, sizeof(int32_t) * static_cast<std::size_t>(rows));
  if (with_k2q) {
    f.k2q = buffer_footprint("k2q", idx.k2q, list_bytes);
    f.offset = buffer_footprint("k2q_offset", idx.k2q_offset,
                                sizeof(int32_t) * static_cast<std::size_t>(p.batch * p.q_heads * (n + 1)));
  }
  return f;
}

namespace detail {
// Whether r = Σ m_a·stride_a + c for some m_a in (-b.extent_a, a.extent_a) over axes < n and |c| < row: i.e.
// whether element offset r of b's start is also an element of a (a and b of the same strides). Each stride is
// at least the span of the axes below it in both views (check_tensor), so after axis n - 1 the residual must
// be below its stride in magnitude: two candidates for m a level.
inline bool offset_in_difference(const footprint& a, const footprint& b, int n, int64_t r) {
  if (n == 0) return r > -a.row && r < a.row;
  const int64_t s = a.stride[n - 1];
  const int64_t m0 = r >= 0 ? r / s : -((-r + s - 1) / s); // floor(r / s)
  for (int64_t m = m0; m <= m0 + 1; ++m)
    if (m > -b.extent[n - 1] && m < a.extent[n - 1] && offset_in_difference(a, b, n - 1, r - m * s)) return true;
  return false;
}
} // namespace detail

inline bool overlaps(const footprint& a, const footprint& b) {
  if (a.lo == a.hi || b.lo == b.hi || a.hi <= b.lo || b.hi <= a.lo) return false;
  bool same_shape = a.axes > 0 && a.axes == b.axes && a.elem == b.elem && a.row == b.row;
  for (int x = 0; same_shape && x < a.axes; ++x) same_shape = a.stride[x] == b.stride[x];
  const int64_t bytes = static_cast<int64_t>(b.lo) - static_cast<int64_t>(a.lo);
  if (!same_shape || bytes % a.elem != 0) return true; // the intervals meet: taken as overlapping
  return detail::offset_in_difference(a, b, a.axes, bytes / a.elem);
}

// Every output against every other output and every input: an output written over memory the call still
// reads (o over q, dq over d_o, scratch over a tensor) would make it read what it has already overwritten.
// In-place use is not supported by any entry point.
inline status check_disjoint(std::initializer_list<footprint> outputs, std::initializer_list<footprint> inputs) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    for (auto x = o + 1; x != outputs.end(); ++x)
      if (overlaps(*o, *x)) return status::error(errc::aliased, "%s and %s: outputs share memory", o->name, x->name);
    for (const footprint& x : inputs)
      if (overlaps(*o, x))
        return status::error(errc::aliased, "%s: shares memory with %s, which the call reads", o->name, x.name);
  }
  return status::ok();
}

// The aliasing checks of the whole op's passes and of the sparse stage, one list of arguments each for the GPU
// entry points and the reference: `state` and `scratch` with the bytes the pass uses, `lists` the caller's q2k
// lists (empty where the op selects its own), `workspace` the sparse backward's (null for the reference, which
// takes none), k2q read where `with_k2q`, `extra` the joint op's extra tokens (they lengthen the sparse pass's lse;
// the views carry their own token counts).
// The forward's tiled copies (forward_io::tiled) are outputs where `tiled_copies` (options::input_order raster).
inline status check_forward_disjoint(const problem& p, const forward_io& io, const void* state, std::size_t state_bytes,
                                     const void* scratch, std::size_t scratch_bytes, const const_index_lists& lists,
                                     bool tiled_copies = false) {
  const list_footprints l = lists_footprint(p, lists, false);
  const tiled_inputs t = tiled_copies ? io.tiled : tiled_inputs{};
  return check_disjoint(
      {view_footprint("o", io.o, p, p.q_heads), buffer_footprint("state", state, state_bytes),
       buffer_footprint("scratch", scratch, scratch_bytes), view_footprint("tiled.q", t.q, p, p.q_heads),
       view_footprint("tiled.k", t.k, p, p.kv_heads), view_footprint("tiled.v", t.v, p, p.kv_heads),
       view_footprint("tiled.gate", t.gate, p, p.q_heads)},
      {view_footprint("q", io.q, p, p.q_heads), view_footprint("k", io.k, p, p.kv_heads),
       view_footprint("v", io.v, p, p.kv_heads), view_footprint("gate", io.gate, p, p.q_heads), l.q2k, l.count});
}
inline status check_backward_disjoint(const problem& p, const backward_io& io, const void* state,
                                      std::size_t state_bytes, const void* scratch, std::size_t scratch_bytes,
                                      const const_index_lists& lists) {
  const list_footprints l = lists_footprint(p, lists, false);
  return check_disjoint({view_footprint("dq", io.dq, p, p.q_heads), view_footprint("dk", io.dk, p, p.kv_heads),
                         view_footprint("dv", io.dv, p, p.kv_heads), view_footprint("dgate", io.dgate, p, p.q_heads),
                         buffer_footprint("scratch", scratch, scratch_bytes)},
                        {view_footprint("q", io.q, p, p.q_heads), view_footprint("k", io.k, p, p.kv_heads),
                         view_footprint("v", io.v, p, p.kv_heads), view_footprint("gate", io.gate, p, p.q_heads),
                         view_footprint("o", io.o, p, p.q_heads), view_footprint("d_o", io.d_o, p, p.q_heads),
                         buffer_footprint("state", state, state_bytes), l.q2k, l.count});
}
// tile and untile: the output against the input (a tile's slots are not a raster token's, so no overlap is safe).
inline status check_layout_disjoint(const problem& p, int64_t heads, const const_tensor& raster,
                                    const const_tensor& tiled, bool to_tiled) {
  const footprint r = view_footprint("raster", raster, p, heads), t = view_footprint("tiled", tiled, p, heads);
  return to_tiled ? check_disjoint({t}, {r}) : check_disjoint({r}, {t});
}
// The elements of the tile means of the query heads, [B, Hq, N, D], and of the kv heads, [B, Hkv, N, D].
struct means_elements {
  std::size_t q, k;
};
inline means_elements coarse_elements(const problem& p) {
  const std::size_t n = static_cast<std::size_t>(tile_geometry(p.grid).num_tiles());
  return {static_cast<std::size_t>(p.batch * p.q_heads * p.head_dim) * n,
          static_cast<std::size_t>(p.batch * p.kv_heads * p.head_dim) * n};
}
// The bytes of o_c and d_o_c, [B, Hq, N, D] in p.type.
inline std::size_t coarse_bytes(const problem& p) { return dtype_size(p.type) * coarse_elements(p).q; }
// The bytes of the coarse scores, [B, Hq, N, N] fp32, and of lse_c, [B, Hq, N] fp32.
inline std::size_t scores_bytes(const problem& p) {
  const std::size_t n = static_cast<std::size_t>(tile_geometry(p.grid).num_tiles());
  return sizeof(float) * static_cast<std::size_t>(p.batch * p.q_heads) * n * n;
}
inline std::size_t lse_c_bytes(const problem& p) {
  return sizeof(float) * static_cast<std::size_t>(p.batch * p.q_heads * tile_geometry(p.grid).num_tiles());
}
// combine: o against the gate and o_c, and against o_s unless o is o_s itself (the same view), which is safe: each
// element of o_s is read before it is written, by the same thread on the GPU and in the same row on the CPU.
inline status check_combine_disjoint(const problem& p, const const_tensor& o_s, const const_tensor& gate,
                                     const void* o_c, const tensor& o) {
  const bool in_place = o.data == o_s.data && o.batch_stride == o_s.batch_stride &&
                        o.token_stride == o_s.token_stride && o.head_stride == o_s.head_stride;
  const footprint out = view_footprint("o", o, p, p.q_heads), g = view_footprint("gate", gate, p, p.q_heads),
                  oc = buffer_footprint("o_c", o_c, coarse_bytes(p));
  if (in_place) return check_disjoint({out}, {g, oc});
  return check_disjoint({out}, {view_footprint("o_s", o_s, p, p.q_heads), g, oc});
}
// combine_backward: dgate and d_o_c against each other and every input.
inline status check_combine_backward_disjoint(const problem& p, const const_tensor& d_o, const const_tensor& gate,
                                              const void* o_c, const tensor& dgate, const void* d_o_c,
                                              const tensor& d_o_tiled = {}) {
  return check_disjoint({view_footprint("dgate", dgate, p, p.q_heads),
                         buffer_footprint("d_o_c", d_o_c, coarse_bytes(p)),
                         view_footprint("d_o_tiled", d_o_tiled, p, p.q_heads)},
                        {view_footprint("d_o", d_o, p, p.q_heads), view_footprint("gate", gate, p, p.q_heads),
                         buffer_footprint("o_c", o_c, coarse_bytes(p))});
}
// The bytes of the sparse pass's lse, [B, Hq, N·64 + extra tokens] fp32.
inline std::size_t lse_bytes(const problem& p, const extra_tokens& extra = {}) {
  return sizeof(float) *
         static_cast<std::size_t>(p.batch * p.q_heads * (tile_geometry(p.grid).tiled_tokens() + extra.count));
}
// block_means: the means (and their fp32 copies) against each other and the tensors they are taken of.
// With `tiled` (block_means_tiling), the tiled copies are outputs too, and the gate an input.
inline status check_means_disjoint(const problem& p, const const_tensor& q, const const_tensor& k,
                                   const const_tensor& v, const void* q_c, const void* k_c, const void* v_c,
                                   const float* q_c_f32, const float* k_c_f32, const const_tensor& gate = {},
                                   const tiled_inputs* tiled = nullptr) {
  const means_elements m = coarse_elements(p);
  const std::size_t e = dtype_size(p.type);
  const tiled_inputs t = tiled != nullptr ? *tiled : tiled_inputs{};
  return check_disjoint(
      {buffer_footprint("q_c", q_c, m.q * e), buffer_footprint("k_c", k_c, m.k * e),
       buffer_footprint("v_c", v_c, m.k * e), buffer_footprint("q_c_f32", q_c_f32, m.q * sizeof(float)),
       buffer_footprint("k_c_f32", k_c_f32, m.k * sizeof(float)), view_footprint("tiled.q", t.q, p, p.q_heads),
       view_footprint("tiled.k", t.k, p, p.kv_heads), view_footprint("tiled.v", t.v, p, p.kv_heads),
       view_footprint("tiled.gate", t.gate, p, p.q_heads)},
      {view_footprint("q", q, p, p.q_heads), view_footprint("k", k, p, p.kv_heads),
       view_footprint("v", v, p, p.kv_heads), view_footprint("gate", gate, p, p.q_heads)});
}
// Inputs in raster order and the tiled copies made of them (block_means_tiling, the whole op's input_order raster):
// q, k, v and the gate of T·H·W tokens, tiled.q, k, v and gate of N·64 slots, tiled.gate given exactly when the
// gate is.
inline status check_raster_inputs(const problem& p, const const_tensor& q, const const_tensor& k, const const_tensor& v,
                                  const const_tensor& gate, const tiled_inputs& tiled, target where) {
  const tile_geometry geo(p.grid);
  const int64_t raster = geo.raster_tokens(), slots = geo.tiled_tokens();
  status s = check_tensor("q", q, p, p.q_heads, raster, where);
  if (s) s = check_tensor("k", k, p, p.kv_heads, raster, where);
  if (s) s = check_tensor("v", v, p, p.kv_heads, raster, where);
  if (s && gate.data != nullptr) s = check_tensor("gate", gate, p, p.q_heads, raster, where);
  if (s) s = check_tensor("tiled.q", tiled.q, p, p.q_heads, slots, where);
  if (s) s = check_tensor("tiled.k", tiled.k, p, p.kv_heads, slots, where);
  if (s) s = check_tensor("tiled.v", tiled.v, p, p.kv_heads, slots, where);
  if (s && gate.data == nullptr && tiled.gate.data != nullptr)
    s = status::error(errc::bad_argument, "tiled.gate: given without a gate");
  if (s && gate.data != nullptr) s = check_tensor("tiled.gate", tiled.gate, p, p.q_heads, slots, where);
  return s;
}
// select_top_k: q2k, q2k_count and the workspace (null and 0 for the reference) against each other and the scores.
inline status check_top_k_disjoint(const problem& p, const float* scores, const index_lists& idx, const void* workspace,
                                   std::size_t workspace_bytes) {
  const list_footprints l = lists_footprint(p, as_const(idx), false);
  return check_disjoint({l.q2k, l.count, buffer_footprint("workspace", workspace, workspace_bytes)},
                        {buffer_footprint("scores", scores, scores_bytes(p))});
}
// build_k2q: k2q, k2q_offset and the workspace against each other and the q2k lists they are built from.
inline status check_k2q_disjoint(const problem& p, const index_lists& idx, const void* workspace,
                                 std::size_t workspace_bytes) {
  const list_footprints l = lists_footprint(p, as_const(idx), true);
  return check_disjoint({l.k2q, l.offset, buffer_footprint("workspace", workspace, workspace_bytes)}, {l.q2k, l.count});
}
// coarse_scores: the scores against the fp32 means they are formed from.
inline status check_coarse_scores_disjoint(const problem& p, const float* q_c, const float* k_c, const float* scores) {
  const means_elements m = coarse_elements(p);
  return check_disjoint(
      {buffer_footprint("scores", scores, scores_bytes(p))},
      {buffer_footprint("q_c", q_c, m.q * sizeof(float)), buffer_footprint("k_c", k_c, m.k * sizeof(float))});
}
// coarse_attention: o_c, its residual (one byte an element, null when not asked for) and lse_c against each other
// and the scores and v_c.
inline status check_coarse_forward_disjoint(const problem& p, const float* scores, const void* v_c, const void* o_c,
                                            const int8_t* o_c_residual, const float* lse_c) {
  const means_elements m = coarse_elements(p);
  return check_disjoint(
      {buffer_footprint("o_c", o_c, coarse_bytes(p)), buffer_footprint("o_c_residual", o_c_residual, m.q),
       buffer_footprint("lse_c", lse_c, lse_c_bytes(p))},
      {buffer_footprint("scores", scores, scores_bytes(p)), buffer_footprint("v_c", v_c, m.k * dtype_size(p.type))});
}
// coarse_attention_backward: dq_c, dk_c, dv_c (fp32) and the workspace (null and 0 for the reference) against each
// other and every input: the means, the scores, o_c and its residual, d_o_c and lse_c.
inline status check_coarse_backward_disjoint(const problem& p, const void* q_c, const void* k_c, const void* v_c,
                                             const float* scores, const void* o_c, const int8_t* o_c_residual,
                                             const void* d_o_c, const float* lse_c, const float* dq_c,
                                             const float* dk_c, const float* dv_c, const void* workspace,
                                             std::size_t workspace_bytes) {
  const means_elements m = coarse_elements(p);
  const std::size_t e = dtype_size(p.type);
  return check_disjoint(
      {buffer_footprint("dq_c", dq_c, m.q * sizeof(float)), buffer_footprint("dk_c", dk_c, m.k * sizeof(float)),
       buffer_footprint("dv_c", dv_c, m.k * sizeof(float)), buffer_footprint("workspace", workspace, workspace_bytes)},
      {buffer_footprint("q_c", q_c, m.q * e), buffer_footprint("k_c", k_c, m.k * e),
       buffer_footprint("v_c", v_c, m.k * e), buffer_footprint("scores", scores, scores_bytes(p)),
       buffer_footprint("o_c", o_c, coarse_bytes(p)), buffer_footprint("o_c_residual", o_c_residual, m.q),
       buffer_footprint("d_o_c", d_o_c, coarse_bytes(p)), buffer_footprint("lse_c", lse_c, lse_c_bytes(p))});
}
inline status check_sparse_forward_disjoint(const problem& p, const const_tensor& q, const const_tensor& k,
                                            const const_tensor& v, const const_index_lists& idx, const tensor& o_s,
                                            const float* lse, const extra_tokens& extra = {}) {
  const list_footprints l = lists_footprint(p, idx, false);
  return check_disjoint({view_footprint("o_s", o_s, p, p.q_heads), buffer_footprint("lse", lse, lse_bytes(p, extra))},
                        {view_footprint("q", q, p, p.q_heads), view_footprint("k", k, p, p.kv_heads),
                         view_footprint("v", v, p, p.kv_heads), l.q2k, l.count});
}
// joint_sparse_attention_forward: as check_sparse_forward_disjoint, the workspace with the outputs.
inline status check_joint_forward_disjoint(const problem& p, const const_tensor& q, const const_tensor& k,
                                           const const_tensor& v, const const_index_lists& idx, const tensor& o_s,
                                           const float* lse, const extra_tokens& extra, const void* workspace,
                                           std::size_t workspace_bytes) {
  const list_footprints l = lists_footprint(p, idx, false);
  return check_disjoint({view_footprint("o_s", o_s, p, p.q_heads), buffer_footprint("lse", lse, lse_bytes(p, extra)),
                         buffer_footprint("workspace", workspace, workspace_bytes)},
                        {view_footprint("q", q, p, p.q_heads), view_footprint("k", k, p, p.kv_heads),
                         view_footprint("v", v, p, p.kv_heads), l.q2k, l.count});
}
inline status check_sparse_backward_disjoint(const problem& p, const const_tensor& q, const const_tensor& k,
                                             const const_tensor& v, const const_tensor& o_s, const const_tensor& d_o,
                                             const float* lse, const const_index_lists& idx, bool with_k2q,
                                             const tensor& dq, const tensor& dk, const tensor& dv,
                                             const void* workspace, std::size_t workspace_bytes,
                                             const extra_tokens& extra = {}) {
  const list_footprints l = lists_footprint(p, idx, with_k2q);
  return check_disjoint({view_footprint("dq", dq, p, p.q_heads), view_footprint("dk", dk, p, p.kv_heads),
                         view_footprint("dv", dv, p, p.kv_heads),
                         buffer_footprint("workspace", workspace, workspace_bytes)},
                        {view_footprint("q", q, p, p.q_heads), view_footprint("k", k, p, p.kv_heads),
                         view_footprint("v", v, p, p.kv_heads), view_footprint("o_s", o_s, p, p.q_heads),
                         view_footprint("d_o", d_o, p, p.q_heads), buffer_footprint("lse", lse, lse_bytes(p, extra)),
                         l.q2k, l.count, l.k2q, l.offset});
}
// linear_attention_forward: o_l, the state it leaves (null where none is kept) and the workspace against each other
// and q, k, v (the reference keeps no state and takes no workspace: null and 0). In place (o_l as q's own view) is
// not offered, unlike combine: it would bind the apply kernel to reading every Q tile before it writes that tile's O.
inline status check_linear_forward_disjoint(const problem& p, const const_tensor& q, const const_tensor& k,
                                            const const_tensor& v, const tensor& o_l, const void* state,
                                            std::size_t state_bytes, const void* workspace,
                                            std::size_t workspace_bytes) {
  return check_disjoint({view_footprint("o_l", o_l, p, p.q_heads), buffer_footprint("state", state, state_bytes),
                         buffer_footprint("workspace", workspace, workspace_bytes)},
                        {view_footprint("q", q, p, p.q_heads), view_footprint("k", k, p, p.kv_heads),
                         view_footprint("v", v, p, p.kv_heads)});
}
// linear_attention_backward: dq, dk, dv and the workspace against each other and every input: q, k, v, d_o and the
// state it reads (null where it recomputes it; null and 0 for both in the reference).
inline status check_linear_backward_disjoint(const problem& p, const const_tensor& q, const const_tensor& k,
                                             const const_tensor& v, const const_tensor& d_o, const void* state,
                                             std::size_t state_bytes, const tensor& dq, const tensor& dk,
                                             const tensor& dv, const void* workspace, std::size_t workspace_bytes) {
  return check_disjoint({view_footprint("dq", dq, p, p.q_heads), view_footprint("dk", dk, p, p.kv_heads),
                         view_footprint("dv", dv, p, p.kv_heads),
                         buffer_footprint("workspace", workspace, workspace_bytes)},
                        {view_footprint("q", q, p, p.q_heads), view_footprint("k", k, p, p.kv_heads),
                         view_footprint("v", v, p, p.kv_heads), view_footprint("d_o", d_o, p, p.q_heads),
                         buffer_footprint("state", state, state_bytes)});
}

// A plain pointer argument (index lists, statistics, coarse tensors).
template <class T> status check_pointer(const char* name, T* ptr, std::size_t align) {
  if (ptr == nullptr) return status::error(errc::null_pointer, "%s: pointer is null", name);
  if (reinterpret_cast<std::uintptr_t>(ptr) % align != 0)
    return status::error(errc::misaligned_pointer, "%s: must be %zu-byte aligned", name, align);
  return status::ok();
}

// A caller's scratch buffer `name` of `given` bytes, of which `needed` are used: 256-byte aligned and large
// enough (the workspace of every entry point, the linear branch's kept state).
inline status check_buffer(const char* name, const void* buffer, std::size_t given, std::size_t needed) {
  if (needed == 0) return status::ok();
  if (buffer == nullptr) return status::error(errc::bad_workspace, "%s: null, %zu bytes needed", name, needed);
  if (reinterpret_cast<std::uintptr_t>(buffer) % detail::workspace_alignment != 0)
    return status::error(errc::misaligned_pointer, "%s: must be %d-byte aligned", name, detail::workspace_alignment);
  if (given < needed) return status::error(errc::bad_workspace, "%s: %zu bytes given, %zu needed", name, given, needed);
  return status::ok();
}
inline status check_workspace(const void* workspace, std::size_t given, std::size_t needed) {
  return check_buffer("workspace", workspace, given, needed);
}

// The capacity of q2k rows (caller lists, or the index stages'): 1..N.
inline status check_q2k_capacity(const problem& p, int64_t capacity) {
  const int64_t n = tile_geometry(p.grid).num_tiles();
  if (capacity < 1 || capacity > n)
    return status::error(errc::bad_index, "q2k_capacity: must be in 1..%lld, got %lld", (long long)n,
                         (long long)capacity);
  return status::ok();
}

// Caller-supplied q2k lists, checked on the host: every count in [0, capacity], capacity <= N, every entry
// in [0, N), each row strictly ascending (which also rules out repeats).
inline status check_q2k_host(const problem& p, const const_index_lists& idx) {
  const int64_t n = tile_geometry(p.grid).num_tiles();
  if (idx.q2k == nullptr || idx.q2k_count == nullptr)
    return status::error(errc::null_pointer, "q2k: list or count pointer is null");
  if (status s = check_q2k_capacity(p, idx.q2k_capacity); !s) return s;
  const int64_t rows = p.batch * p.q_heads * n;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t c = idx.q2k_count[r];
    if (c < 0 || c > idx.q2k_capacity)
      return status::error(errc::bad_index, "q2k_count[%lld] = %d is outside 0..%lld", (long long)r, c,
                           (long long)idx.q2k_capacity);
    const int32_t* row = idx.q2k + r * idx.q2k_capacity;
    for (int32_t j = 0; j < c; ++j) {
      if (row[j] < 0 || row[j] >= n)
        return status::error(errc::bad_index, "q2k[%lld][%d] = %d is not a tile (N = %lld)", (long long)r, j, row[j],
                             (long long)n);
      if (j > 0 && row[j] <= row[j - 1])
        return status::error(errc::bad_index, "q2k[%lld]: entries %d and %d are repeated or not ascending",
                             (long long)r, j - 1, j);
    }
  }
  return status::ok();
}

// The op's k from options (resolve_top_k), or the error naming the one option that was used: top_k when it is
// set, sparsity otherwise, with the range it must be in.
inline status resolve_op_top_k(int64_t num_tiles, const options& opt, int64_t& k) {
  k = resolve_top_k(num_tiles, opt);
  if (k != 0) return status::ok();
  if (opt.top_k != 0)
    return status::error(errc::bad_top_k, "top_k: %lld is outside 1..%lld (the grid's tiles)", (long long)opt.top_k,
                         (long long)num_tiles);
  return status::error(errc::bad_top_k, "sparsity: %g is outside [0, 1) (it sets k when top_k is 0)", opt.sparsity);
}

// The token count of the whole op's outputs (o and the gradients) under options::output_order, or the error
// naming a value that is not a token_order.
// The forward's inputs as the op's passes after the first read them: the caller's, or with options::input_order raster
// their tiled copies (forward_io::tiled), which the op writes first.
namespace detail {
inline forward_io tiled_view(const forward_io& io, bool raster_in) {
  if (!raster_in) return io;
  forward_io t = io;
  t.q = io.tiled.q;
  t.k = io.tiled.k;
  t.v = io.tiled.v;
  t.gate = io.tiled.gate;
  return t;
}
} // namespace detail

// The token count of a tensor in `order` (`name`: the option that gave it, for the error): N·64 slots tiled, T·H·W
// tokens raster.
inline status tokens_in_order(const problem& p, token_order order, const char* name, int64_t& tokens) {
  const tile_geometry geo(p.grid);
  switch (order) {
  case token_order::tiled:
    tokens = geo.tiled_tokens();
    return status::ok();
  case token_order::raster:
    tokens = geo.raster_tokens();
    return status::ok();
  }
  return status::error(errc::bad_argument, "%s: not a token_order value (%d)", name, static_cast<int>(order));
}
// The whole op's inputs q, k, v, gate and d_o (options::input_order), and its outputs o and the gradients
// (options::output_order).
inline status input_tokens(const problem& p, const options& opt, int64_t& tokens) {
  return tokens_in_order(p, opt.input_order, "input_order", tokens);
}
inline status output_tokens(const problem& p, const options& opt, int64_t& tokens) {
  return tokens_in_order(p, opt.output_order, "output_order", tokens);
}

} // namespace vsa
