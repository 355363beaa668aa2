// Packed batches in the GPU tests (test_packed.cpp, test_packed_op.cpp): configurations of samples, the batch's
// layout of tiles, packed inputs, each sample's slots, and the comparison of packed outputs with each sample's own.
#pragma once

#include "gpu.hpp"
#include "host.hpp"

#include <vsa/gpu/packed_attention.hpp>

#include <string>
#include <type_traits>
#include <vector>

namespace vsa {
namespace test {

struct packed_config {
  std::vector<grid3> grids;
  int64_t q_heads, kv_heads, head_dim;
  dtype type;
  layout order;
  bool same_kind; // every sample narrow, or none: the packed kernels are each sample's own
};

inline std::string describe(const packed_config& c) {
  std::string s;
  for (const grid3& g : c.grids) s += std::to_string(g.t) + "x" + std::to_string(g.h) + "x" + std::to_string(g.w) + " ";
  return s + "Hq" + std::to_string(c.q_heads) + " Hkv" + std::to_string(c.kv_heads) + " D" +
         std::to_string(c.head_dim) + " " + dtype_name(c.type) + (c.order == layout::bshd ? " bshd" : " bhsd");
}

// More samples than one launch of the tile table takes (packed_table_samples): small grids, all with narrow tiles.
inline packed_config many_samples() {
  packed_config c{{}, 2, 1, 64, dtype::bf16, layout::bhsd, true};
  const grid3 grids[] = {{1, 1, 1}, {5, 6, 7}, {3, 2, 5}, {4, 4, 1}};
  for (int s = 0; s < 70; ++s) c.grids.push_back(grids[s % 4]);
  return c;
}

inline std::vector<packed_config> packed_configs() {
  return {
      // Every sample with narrow tiles (last tiles of 6, 6, 27 and 3 tokens).
      {{{5, 6, 7}, {9, 10, 11}, {7, 7, 7}, {5, 9, 7}}, 4, 2, 64, dtype::bf16, layout::bshd, true},
      // None: whole tiles, and partial ones of 48 tokens.
      {{{8, 8, 8}, {7, 8, 8}, {4, 12, 8}, {8, 4, 16}}, 2, 1, 128, dtype::fp16, layout::bhsd, true},
      // Mixed: the narrow kernels run the whole batch.
      {{{5, 6, 7}, {8, 8, 8}, {3, 4, 9}}, 2, 2, 128, dtype::bf16, layout::bshd, false},
      {{{12, 8, 8}, {1, 1, 1}}, 4, 1, 64, dtype::fp16, layout::bhsd, false},
      many_samples(),
  };
}

struct batch_layout {
  std::vector<int64_t> first, tiles; // each sample's first tile and tile count
  int64_t total = 0;
  explicit batch_layout(const std::vector<grid3>& grids) {
    for (const grid3& g : grids) {
      first.push_back(total);
      tiles.push_back(tile_geometry(g).num_tiles());
      total += tiles.back();
    }
  }
};

inline packed_problem make_packed(const packed_config& c) {
  packed_problem pp;
  pp.q_heads = c.q_heads;
  pp.kv_heads = c.kv_heads;
  pp.head_dim = c.head_dim;
  pp.type = c.type;
  pp.grids = c.grids.data();
  pp.samples = static_cast<int64_t>(c.grids.size());
  return pp;
}

// A packed tensor: normal values on the samples' valid slots, zeros on their padding slots.
inline host_tensor packed_input(const packed_config& c, const batch_layout& b, int64_t heads, rng& g) {
  host_tensor x(c.type, 1, b.total * 64, heads, c.head_dim, c.order);
  for (std::size_t s = 0; s < c.grids.size(); ++s) {
    const tile_geometry geo(c.grids[s]);
    for (int64_t slot = 0; slot < b.tiles[s] * 64; ++slot)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < c.head_dim; ++d)
          x.set(0, b.first[s] * 64 + slot, h, d, slot % 64 < geo.valid(slot / 64) ? g.normal() : 0.0);
  }
  return x;
}

// Sample s's slots of a packed tensor as a tensor of its own (host), and as a view into the device copy.
inline host_tensor sample_of(const host_tensor& x, const batch_layout& b, std::size_t s) {
  host_tensor y(x.type, 1, b.tiles[s] * 64, x.heads, x.dim, x.order);
  for (int64_t slot = 0; slot < y.tokens; ++slot)
    for (int64_t h = 0; h < x.heads; ++h)
      for (int64_t d = 0; d < x.dim; ++d) y.set(0, slot, h, d, x.get(0, b.first[s] * 64 + slot, h, d));
  return y;
}
template <class Ptr>
basic_tensor<Ptr> sample_view(const basic_tensor<Ptr>& x, const batch_layout& b, std::size_t s, dtype t) {
  using byte = std::conditional_t<std::is_const<std::remove_pointer_t<Ptr>>::value, const unsigned char, unsigned char>;
  return {static_cast<Ptr>(static_cast<byte*>(x.data) + b.first[s] * 64 * x.token_stride * dtype_size(t)),
          b.tiles[s] * 64, x.batch_stride, x.token_stride, x.head_stride};
}

// Raw values of the slots of sample s (every head), or of every sample where s < 0, in storage order.
inline std::vector<double> slots_of(const host_tensor& x, const batch_layout& b, int64_t s) {
  std::vector<double> r;
  for (int64_t e = 0; e < x.elements(); ++e) {
    const int64_t token = x.order == layout::bshd ? e / (x.heads * x.dim) : (e / x.dim) % x.tokens;
    const int64_t tile = token / 64;
    if (s < 0 || (tile >= b.first[s] && tile < b.first[s] + b.tiles[s])) r.push_back(x.at(e));
  }
  return r;
}

// The packed outputs against the per-sample ones: bitwise on the samples whose kernels are the same (all of them where
// the config says so, else those with narrow tiles), within rounding everywhere.
inline void check_against_samples(const packed_config& c, const batch_layout& b, const char* what,
                                  const device_tensor& packed, const device_tensor& per_sample) {
  INFO(what);
  const host_tensor x = packed.download(), y = per_sample.download();
  CHECK(rel_error(x, y) < 1e-2);
  for (std::size_t s = 0; s < c.grids.size(); ++s) {
    INFO("sample " << s);
    if (!c.same_kind && !gpu::detail::has_narrow_tiles(tile_geometry(c.grids[s]))) continue;
    // Counted, not compared as vectors: a failure then says how many elements differ and where, instead of printing
    // every value of the sample.
    const std::vector<double> xs = slots_of(x, b, static_cast<int64_t>(s)),
                              ys = slots_of(y, b, static_cast<int64_t>(s));
    REQUIRE(xs.size() == ys.size());
    std::size_t differ = 0, first = 0;
    for (std::size_t e = xs.size(); e-- > 0;)
      if (!(xs[e] == ys[e])) ++differ, first = e; // NaN differs from everything
    INFO("elements differing: " << differ << " of " << xs.size() << ", the first at " << first << ": "
                                << (differ ? xs[first] : 0.0) << " against " << (differ ? ys[first] : 0.0));
    CHECK(differ == 0);
  }
}

} // namespace test
} // namespace vsa
