// Stage 7 on the GPU: o = o_s + g ⊙ o_c, the coarse output of each tile broadcast over its slots, and the
// backward of that sum for the gate and for o_c.
//
// The forward is elementwise and laid out like the tiling copy: a block per quarter tile, 16-byte vectors,
// four vectors in flight per thread. The backward needs a sum over each tile's slots (d_o_c), so it is
// laid out like the block means: a block per (batch, head, tile), row groups summed in fp32.
#pragma once

#include "../geometry.hpp"
#include "../validate.hpp"
#include "block_means.hpp"
#include "primitives.hpp"

#include <type_traits>

namespace vsa {
namespace gpu {
namespace detail {

inline constexpr int combine_threads = 256;
inline constexpr int combine_slots = 16;
inline constexpr int combine_unroll = 4;

struct combine_params {
  vector_view<const uint4> o_s, gate; // gate.data null: g = 1
  const uint4* o_c;                   // [B, Hq, N, D]
  vector_view<uint4> o;
  tile_geometry geo;
  int64_t batch;
  unsigned heads;
  int vec_shift; // log2 of the vectors per row
};

template <class E> __global__ void __launch_bounds__(combine_threads) combine_kernel(combine_params p) {
  const int64_t tiles = p.geo.num_tiles();
  constexpr int quarters = tile_tokens / combine_slots;
  const int64_t items = p.batch * tiles * quarters;
  const unsigned row_vectors = p.heads << p.vec_shift;
  const unsigned vec_mask = (1u << p.vec_shift) - 1u;
  const unsigned count = combine_slots * row_vectors;
  const bool gated = p.gate.data != nullptr;

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int quarter = static_cast<int>(item % quarters);
    const int64_t n = (item / quarters) % tiles, b = item / quarters / tiles;
    const int first_slot = quarter * combine_slots;
    const int valid = p.geo.valid(n);
    for (unsigned base = threadIdx.x; base < count; base += combine_threads * combine_unroll) {
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      uint4 fine[combine_unroll], gate[combine_unroll], coarse[combine_unroll];
      uint4* target[combine_unroll];
      bool padding[combine_unroll];
#pragma unroll
      for (int u = 0; u < combine_unroll; ++u) {
        const unsigned i = base + u * combine_threads;
        fine[u] = gate[u] = coarse[u] = zero;
        target[u] = nullptr;
        padding[u] = true;
        if (i >= count) continue;
        const unsigned s = i / row_vectors, hv = i - s * row_vectors;
        const unsigned h = hv >> p.vec_shift, v = hv & vec_mask;
        const int64_t slot = n * tile_tokens + first_slot + s;
        target[u] = p.o.row(b, slot, h) + v;
        padding[u] = first_slot + static_cast<int>(s) >= valid;
        if (padding[u]) continue;
        fine[u] = p.o_s.row(b, slot, h)[v];
        coarse[u] = p.o_c[(((b * p.heads + h) * tiles + n) << p.vec_shift) + v];
        if (gated) gate[u] = p.gate.row(b, slot, h)[v];
      }
#pragma unroll
      for (int u = 0; u < combine_unroll; ++u) {
        if (target[u] == nullptr) continue;
        if (padding[u]) {
          *target[u] = zero;
          continue;
        }
        float f[8], c[8], g[8];
        unpack8<E>(fine[u], f);
        unpack8<E>(coarse[u], c);
        if (gated) {
          unpack8<E>(gate[u], g);
#pragma unroll
          for (int e = 0; e < 8; ++e) f[e] += g[e] * c[e];
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) f[e] += c[e];
        }
        *target[u] = pack8<E>(f);
      }
    }
  }
}

struct combine_backward_params {
  vector_view<const uint4> d_o, gate; // gate.data null: g = 1
  const uint4* o_c;                   // [B, Hq, N, D]
  vector_view<uint4> dgate;           // data null when gate is
  uint16_t* d_o_c;                    // [B, Hq, N, D]
  int64_t batch, heads;
  bool dgate_raster; // dgate in raster order: valid slots at their tokens, padding slots nowhere (one grid only)
  // d_o in raster order (one grid only): its tiled copy goes here, padding slots zero, for the passes after this one.
  vector_view<uint4> d_o_tiled; // data null: d_o is tiled
};

// Tiles: where each tile's valid count comes from, tile_geometry (one grid) or packed_tiles (a packed batch's table,
// block_means.hpp), whose outputs are in tiled order only.
template <class E, int D, class Tiles> __global__ void __launch_bounds__(tile_row_threads)
    combine_backward_kernel(combine_backward_params p, Tiles geo) {
  using L = tile_row_layout<D>;
  constexpr bool one_grid = std::is_same<Tiles, tile_geometry>::value;
  __shared__ __align__(16) float partial[L::groups][D];
  const int64_t tiles = geo.num_tiles();
  const int64_t items = p.batch * tiles * p.heads;
  const int group = threadIdx.x / L::vectors, vec = threadIdx.x % L::vectors;
  const bool gated = p.gate.data != nullptr;

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t h = item % p.heads, n = (item / p.heads) % tiles, b = item / p.heads / tiles;
    const int valid = geo.valid(n);
    const int64_t first = n * tile_tokens;
    raster_rows tokens{};
    bool raster_in = false;
    if constexpr (one_grid) {
      raster_in = p.d_o_tiled.data != nullptr;
      if (p.dgate_raster || raster_in) tokens = geo.raster_rows_of(n);
    }
    float coarse[8];
    unpack8<E>(p.o_c[((b * p.heads + h) * tiles + n) * L::vectors + vec], coarse);

    uint4 grad[L::rows_per_thread], gate[L::rows_per_thread];
#pragma unroll
    for (int r = 0; r < L::rows_per_thread; ++r) {
      const int row = group + r * L::groups;
      grad[r] = make_uint4(0u, 0u, 0u, 0u);
      gate[r] = grad[r];
      if (row < valid) {
        grad[r] = p.d_o.row(b, raster_in ? tokens.token(row) : first + row, h)[vec];
        if (gated) gate[r] = p.gate.row(b, first + row, h)[vec];
      }
    }
    if (raster_in) {
#pragma unroll
      for (int r = 0; r < L::rows_per_thread; ++r) p.d_o_tiled.row(b, first + group + r * L::groups, h)[vec] = grad[r];
    }
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < L::rows_per_thread; ++r) {
      const int row = group + r * L::groups;
      float d[8];
      unpack8<E>(grad[r], d);
      if (gated) {
        float g[8], dg[8];
        unpack8<E>(gate[r], g);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          sum[e] += g[e] * d[e];
          dg[e] = d[e] * coarse[e];
        }
        // Padding rows were loaded as zeros, so their dgate comes out as zeros too (tiled order; raster order has
        // no place for them).
        if (one_grid && p.dgate_raster) {
          if (row < valid) p.dgate.row(b, tokens.token(row), h)[vec] = pack8<E>(dg);
        } else {
          p.dgate.row(b, first + row, h)[vec] = row < valid ? pack8<E>(dg) : make_uint4(0u, 0u, 0u, 0u);
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) sum[e] += d[e];
      }
    }
    const float total = sum_row_groups<D>(sum, partial, group, vec);
    if (threadIdx.x < D) p.d_o_c[((b * p.heads + h) * tiles + n) * D + threadIdx.x] = E::from_float(total);
    __syncthreads(); // partial is rewritten by the next item
  }
}

// The gate and its gradient: both present or both absent (g = 1 has no gradient).
inline status check_gate_pair(const const_tensor& gate, const void* dgate) {
  if (gate.data == nullptr && dgate != nullptr)
    return status::error(errc::bad_argument, "dgate: must be null when gate is null (g = 1 has no gradient)");
  if (gate.data != nullptr && dgate == nullptr)
    return status::error(errc::null_pointer, "dgate: data is null while gate is given");
  return status::ok();
}

} // namespace detail
} // namespace gpu

namespace detail {

// The backward kernel over the tiles of `geo` (tile_geometry, or gpu::detail::packed_tiles with dgate_raster false and
// no d_o_tiled), the arguments checked. d_o_tiled.data set: d_o is in raster order, and its tiled copy goes there.
template <class Tiles> status launch_combine_backward(const problem& p, const Tiles& geo, const const_tensor& d_o,
                                                      const const_tensor& gate, const void* o_c, const tensor& dgate,
                                                      void* d_o_c, bool dgate_raster, gpu::stream_t stream,
                                                      const tensor& d_o_tiled = {}) {
  namespace gd = gpu::detail;
  const gd::combine_backward_params bp{gd::make_vector_view<const uint4>(d_o),
                                       gd::make_vector_view<const uint4>(gate),
                                       static_cast<const uint4*>(o_c),
                                       gd::make_vector_view<uint4>(dgate),
                                       static_cast<uint16_t*>(d_o_c),
                                       p.batch,
                                       p.q_heads,
                                       dgate_raster,
                                       gd::make_vector_view<uint4>(d_o_tiled)};
  const unsigned blocks = gd::grid_blocks(p.batch * geo.num_tiles() * p.q_heads);
  return gd::dispatch_element(p.type, [&](auto element) {
    using E = decltype(element);
    const auto kernel =
        p.head_dim == 64 ? gd::combine_backward_kernel<E, 64, Tiles> : gd::combine_backward_kernel<E, 128, Tiles>;
    return gpu::launch("combine_backward", kernel, blocks, gd::tile_row_threads, 0, stream, false, bp, geo);
  });
}

} // namespace detail

// o [B, N·64, Hq, D] = o_s + g ⊙ o_c[b, h, tile] on valid slots, 0 on padding slots. o_s, gate and o are tiled
// views; gate.data may be null (g = 1); o_c is [B, Hq, N, D] contiguous in p.type. o may be the same view as
// o_s (each element is read before it is written by the same thread); any other overlap of o with an input is
// rejected (errc::aliased), as are dgate and d_o_c sharing memory with anything in the backward.
inline status combine(const problem& p, const_tensor o_s, const_tensor gate, const void* o_c, tensor o,
                      gpu::stream_t stream) {
  status s = check_problem(p, target::gpu);
  const tile_geometry geo(p.grid);
  if (s) s = check_tensor("o_s", o_s, p, p.q_heads, geo.tiled_tokens(), target::gpu);
  if (s && gate.data != nullptr) s = check_tensor("gate", gate, p, p.q_heads, geo.tiled_tokens(), target::gpu);
  if (s) s = check_pointer("o_c", o_c, 16);
  if (s) s = check_tensor("o", o, p, p.q_heads, geo.tiled_tokens(), target::gpu);
  if (s && p.q_heads > 65536)
    return status::error(errc::bad_heads, "q_heads: combine takes at most 65536, got %lld", (long long)p.q_heads);
  if (s) s = check_combine_disjoint(p, o_s, gate, o_c, o);
  if (!s) return s;
  namespace gd = gpu::detail;
  const gd::combine_params cp{gd::make_vector_view<const uint4>(o_s),
                              gd::make_vector_view<const uint4>(gate),
                              static_cast<const uint4*>(o_c),
                              gd::make_vector_view<uint4>(o),
                              geo,
                              p.batch,
                              static_cast<unsigned>(p.q_heads),
                              p.head_dim == 64 ? 3 : 4};
  const unsigned blocks = gd::grid_blocks(p.batch * geo.num_tiles() * (tile_tokens / gd::combine_slots));
  return gd::dispatch_element(p.type, [&](auto element) {
    using E = decltype(element);
    return gpu::launch("combine", gd::combine_kernel<E>, blocks, gd::combine_threads, 0, stream, false, cp);
  });
}

// Backward of combine for the gate and o_c: dgate = dO ⊙ o_c on valid slots (0 on padding), and
// d_o_c [B, Hq, N, D] (p.type) = the sum over each tile's valid slots of g ⊙ dO, accumulated in fp32.
// gate.data null means g = 1, and then dgate.data must be null too. dgate_order raster: dgate holds T·H·W
// tokens, each valid slot's gradient at its token (the whole op's options::output_order). d_o_tiled given: d_o
// holds T·H·W tokens in raster order, and the call also writes its tiled copy there (N·64 slots, padding slots
// zero: tile() of d_o, fused into this pass, which reads every row of d_o anyway).
inline status combine_backward(const problem& p, const_tensor d_o, const_tensor gate, const void* o_c, tensor dgate,
                               void* d_o_c, gpu::stream_t stream, token_order dgate_order = token_order::tiled,
                               tensor d_o_tiled = {}) {
  status s = check_problem(p, target::gpu);
  const tile_geometry geo(p.grid);
  const bool raster = dgate_order == token_order::raster, raster_in = d_o_tiled.data != nullptr;
  if (s) s = check_tensor("d_o", d_o, p, p.q_heads, raster_in ? geo.raster_tokens() : geo.tiled_tokens(), target::gpu);
  if (s && raster_in) s = check_tensor("d_o_tiled", d_o_tiled, p, p.q_heads, geo.tiled_tokens(), target::gpu);
  if (s) s = gpu::detail::check_gate_pair(gate, dgate.data);
  if (s && gate.data != nullptr) s = check_tensor("gate", gate, p, p.q_heads, geo.tiled_tokens(), target::gpu);
  if (s) s = check_pointer("o_c", o_c, 16);
  if (s && dgate.data != nullptr) {
    s = check_tensor("dgate", dgate, p, p.q_heads, raster ? geo.raster_tokens() : geo.tiled_tokens(), target::gpu);
  }
  if (s) s = check_pointer("d_o_c", d_o_c, 16);
  if (s) s = check_combine_backward_disjoint(p, d_o, gate, o_c, dgate, d_o_c, d_o_tiled);
  if (!s) return s;
  return detail::launch_combine_backward(p, geo, d_o, gate, o_c, dgate, d_o_c, raster, stream, d_o_tiled);
}

} // namespace vsa
