// o = o_s + g ⊙ o_c (the coarse output broadcast over its tile), and its backward for the gate and o_c.
#pragma once

#include "detail.hpp"

namespace vsa {
namespace reference {

namespace detail {

// Writes every slot of o: o_s + g ⊙ o_c on valid slots, 0 on padding. gate.data null means g = 1.
// o_c holds p.type values [B, Hq, N, D]; o_s holds fine_type values (the whole op passes its o_s unrounded,
// as the GPU's epilogue adds to the fp32 accumulator).
inline void combine_core(const problem& p, const const_tensor& o_s, const const_tensor& gate, const void* o_c,
                         const tensor& o, dtype fine_type) {
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), dim = p.head_dim;
  const const_tensor out = as_const(o);
  parallel_for(p.batch * p.q_heads * n, [&](int64_t begin, int64_t end) {
    std::vector<double> coarse(dim), fine(dim), g(dim, 1.0);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % n, bh = row / n, b = bh / p.q_heads, h = bh % p.q_heads;
      load_row(o_c, row * dim, dim, p.type, coarse.data());
      for (int r = 0; r < tile_tokens; ++r) {
        const int64_t token = i * tile_tokens + r;
        if (r >= geo.valid(i)) {
          std::fill(fine.begin(), fine.end(), 0.0);
        } else {
          load_row(o_s.data, tensor_offset(o_s, b, token, h), dim, fine_type, fine.data());
          if (gate.data != nullptr) load_row(gate.data, tensor_offset(gate, b, token, h), dim, p.type, g.data());
          for (int64_t d = 0; d < dim; ++d) fine[d] += g[d] * coarse[d];
        }
        store_row(o.data, tensor_offset(out, b, token, h), dim, p.type, fine.data());
      }
    }
  });
}

// dgate = dO ⊙ o_c on valid slots (0 on padding) when dgate.data is set; d_o_c[b, h, i] = sum over the
// valid slots of tile i of g ⊙ dO, as doubles [B, Hq, N, D].
inline void combine_backward_core(const problem& p, const const_tensor& d_o, const const_tensor& gate, const void* o_c,
                                  const tensor& dgate, double* d_o_c) {
  const tile_geometry geo(p.grid);
  const int64_t n = geo.num_tiles(), dim = p.head_dim;
  const const_tensor dg = as_const(dgate);
  parallel_for(p.batch * p.q_heads * n, [&](int64_t begin, int64_t end) {
    std::vector<double> coarse(dim), grad(dim), g(dim, 1.0), out(dim);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % n, bh = row / n, b = bh / p.q_heads, h = bh % p.q_heads;
      load_row(o_c, row * dim, dim, p.type, coarse.data());
      double* sum = d_o_c + row * dim;
      std::fill(sum, sum + dim, 0.0);
      for (int r = 0; r < tile_tokens; ++r) {
        const int64_t token = i * tile_tokens + r;
        const bool valid = r < geo.valid(i);
        if (valid) {
          load_row(d_o.data, tensor_offset(d_o, b, token, h), dim, p.type, grad.data());
          if (gate.data != nullptr) load_row(gate.data, tensor_offset(gate, b, token, h), dim, p.type, g.data());
          for (int64_t d = 0; d < dim; ++d) sum[d] += g[d] * grad[d];
        }
        if (dgate.data != nullptr) {
          for (int64_t d = 0; d < dim; ++d) out[d] = valid ? grad[d] * coarse[d] : 0.0;
          store_row(dgate.data, tensor_offset(dg, b, token, h), dim, p.type, out.data());
        }
      }
    }
  });
}

// The gate and its gradient: both present, or both absent (g = 1). A joint op's gate holds the extra tokens too,
// as q does (they are not read).
inline status check_gate(const problem& p, const const_tensor& gate, const void* dgate_data, bool want_dgate,
                         const extra_tokens& extra = {}) {
  if (gate.data == nullptr) {
    if (want_dgate && dgate_data != nullptr)
      return status::error(errc::bad_argument, "dgate: must be null when gate is null (g = 1 has no gradient)");
    return status::ok();
  }
  if (want_dgate && dgate_data == nullptr)
    return status::error(errc::null_pointer, "dgate: data is null while gate is given");
  return check_tiled("gate", gate, p, p.q_heads, extra);
}

} // namespace detail

inline status combine(const problem& p, const_tensor o_s, const_tensor gate, const void* o_c, tensor o) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  if (!(s = detail::check_tiled("o_s", o_s, p, p.q_heads))) return s;
  if (!(s = detail::check_gate(p, gate, nullptr, false))) return s;
  if (!(s = detail::check_array("o_c", o_c))) return s;
  if (!(s = detail::check_tiled("o", o, p, p.q_heads))) return s;
  if (!(s = check_combine_disjoint(p, o_s, gate, o_c, o))) return s;
  return detail::guarded("combine", [&]() {
    detail::combine_core(p, o_s, gate, o_c, o, p.type);
    return status::ok();
  });
}

inline status combine_backward(const problem& p, const_tensor d_o, const_tensor gate, const void* o_c, tensor dgate,
                               void* d_o_c) {
  status s = check_problem(p, target::cpu);
  if (!s) return s;
  if (!(s = detail::check_tiled("d_o", d_o, p, p.q_heads))) return s;
  if (!(s = detail::check_gate(p, gate, dgate.data, true))) return s;
  if (!(s = detail::check_array("o_c", o_c))) return s;
  if (dgate.data != nullptr && !(s = detail::check_tiled("dgate", dgate, p, p.q_heads))) return s;
  if (!(s = detail::check_array("d_o_c", d_o_c))) return s;
  if (!(s = check_combine_backward_disjoint(p, d_o, gate, o_c, dgate, d_o_c))) return s;
  return detail::guarded("combine_backward", [&]() {
    const int64_t size = p.batch * p.q_heads * tile_geometry(p.grid).num_tiles() * p.head_dim;
    std::vector<double> sum(size);
    detail::combine_backward_core(p, d_o, gate, o_c, dgate, sum.data());
    detail::store_array(d_o_c, size, p.type, sum.data());
    return status::ok();
  });
}

} // namespace reference
} // namespace vsa
