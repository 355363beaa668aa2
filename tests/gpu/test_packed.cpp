// The sparse pass over a packed batch on the GPU (packed_attention.hpp), forward and backward, against each sample's
// own call of the one-grid pass on the same slots: bit for bit where the samples agree on the kernels' kind (all with
// narrow tiles, or none), within rounding where they do not; the forward also against the CPU reference. Partial tiles
// on every axis, GQA, both layouts and dtypes, both head dims, ragged lists with empty rows; outputs poisoned and
// checked fully written, canaries, the backward bitwise reproducible in either workspace; bad descriptors rejected.
#include "support/gpu.hpp"
#include "support/host.hpp"
#include "support/packed.hpp"

#include <vsa/gpu/packed_attention.hpp>
#include <vsa/reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace vsa {
namespace test {
namespace {

struct sample_lists {
  std::vector<q2k_lists> own;      // each sample's, over its own tiles
  std::vector<int32_t> q2k, count; // the batch's, over its tiles
  int64_t capacity = 0;
};

// Random ragged lists of each sample (every 7th row empty), and the batch's: each row's entries moved to the batch's
// numbering, rows of the largest capacity.
sample_lists make_lists(const packed_config& c, const batch_layout& b, rng& g) {
  sample_lists l;
  for (std::size_t s = 0; s < c.grids.size(); ++s) {
    const problem ps = make_problem(c.grids[s], 1, c.q_heads, c.kv_heads, c.head_dim, c.type);
    l.own.push_back(random_lists(ps, std::max<int64_t>(1, b.tiles[s] / 3), g));
    l.capacity = std::max(l.capacity, l.own.back().capacity);
  }
  l.q2k.assign(static_cast<std::size_t>(c.q_heads * b.total * l.capacity), -1);
  l.count.assign(static_cast<std::size_t>(c.q_heads * b.total), 0);
  for (std::size_t s = 0; s < c.grids.size(); ++s)
    for (int64_t h = 0; h < c.q_heads; ++h)
      for (int64_t i = 0; i < b.tiles[s]; ++i) {
        const int64_t from = h * b.tiles[s] + i, to = h * b.total + b.first[s] + i;
        const int32_t n = l.own[s].count[from];
        l.count[to] = n;
        for (int32_t e = 0; e < n; ++e)
          l.q2k[to * l.capacity + e] = l.own[s].q2k[from * l.own[s].capacity + e] + static_cast<int32_t>(b.first[s]);
      }
  return l;
}

void check_packed(const packed_config& c) {
  INFO(describe(c));
  VSA_TEST_RNG(g, "packed");
  const packed_problem pp = make_packed(c);
  const batch_layout b(c.grids);
  const sample_lists lists = make_lists(c, b, g);
  const host_tensor q = packed_input(c, b, c.q_heads, g), k = packed_input(c, b, c.kv_heads, g),
                    v = packed_input(c, b, c.kv_heads, g), d_o = packed_input(c, b, c.q_heads, g);
  const float scale = 1.f / std::sqrt(float(c.head_dim));
  const device_tensor dq_in(q), dk_in(k), dv_in(v), ddo(d_o);
  const device_buffer q2k(upload(lists.q2k)), count(upload(lists.count));
  const const_index_lists dl{q2k.as<int32_t>(), count.as<int32_t>(), lists.capacity, nullptr, nullptr};
  const int64_t rows = b.total * 64;

  // Forward: the batch, then each sample on its own slots of a second output.
  device_tensor o(q, poisoned), o_own(q, poisoned);
  device_buffer lse(sizeof(float) * c.q_heads * rows);
  lse.poison();
  const std::size_t fwd_bytes = packed_sparse_attention_forward_workspace(pp);
  CHECK(fwd_bytes >= sizeof(int32_t) * 2 * b.total);
  device_buffer fwd_ws(fwd_bytes);
  fwd_ws.poison();
  status st = packed_sparse_attention_forward(pp, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), dl, o.view(),
                                              lse.as<float>(), fwd_ws.get(), fwd_bytes, nullptr);
  INFO(st.message());
  REQUIRE(st.is_ok());
  VSA_REQUIRE_RT(gpu_sync());
  CHECK(o.all_written());
  CHECK(o.canaries_intact());
  CHECK(lse.canaries_intact());
  CHECK(fwd_ws.canaries_intact());
  const std::vector<float> lse_packed = lse.download<float>();

  std::vector<device_buffer> own_q2k, own_count, own_k2q, own_offset, own_lse;
  std::vector<const_index_lists> own_lists;
  for (std::size_t s = 0; s < c.grids.size(); ++s) {
    const problem ps = make_problem(c.grids[s], 1, c.q_heads, c.kv_heads, c.head_dim, c.type);
    const q2k_lists& l = lists.own[s];
    index_lists full{const_cast<int32_t*>(l.q2k.data()), const_cast<int32_t*>(l.count.data()), l.capacity, nullptr,
                     nullptr};
    std::vector<int32_t> k2q(l.q2k.size()), offset(c.q_heads * (b.tiles[s] + 1));
    full.k2q = k2q.data();
    full.k2q_offset = offset.data();
    REQUIRE(reference::build_k2q(ps, full).is_ok());
    own_q2k.emplace_back(upload(l.q2k));
    own_count.emplace_back(upload(l.count));
    own_k2q.emplace_back(upload(k2q));
    own_offset.emplace_back(upload(offset));
    own_lists.push_back({own_q2k.back().as<int32_t>(), own_count.back().as<int32_t>(), l.capacity,
                         own_k2q.back().as<int32_t>(), own_offset.back().as<int32_t>()});
    own_lse.emplace_back(sizeof(float) * c.q_heads * b.tiles[s] * 64);
    REQUIRE(sparse_attention_forward(ps, scale, sample_view(dq_in.cview(), b, s, c.type),
                                     sample_view(dk_in.cview(), b, s, c.type), sample_view(dv_in.cview(), b, s, c.type),
                                     own_lists.back(), sample_view(o_own.view(), b, s, c.type),
                                     own_lse.back().as<float>(), nullptr)
                .is_ok());
  }
  VSA_REQUIRE_RT(gpu_sync());
  check_against_samples(c, b, "o_s", o, o_own);
  int64_t lse_differ = 0, lse_far = 0;
  for (std::size_t s = 0; s < c.grids.size(); ++s) {
    const std::vector<float> own = own_lse[s].download<float>();
    const bool bitwise = c.same_kind || gpu::detail::has_narrow_tiles(tile_geometry(c.grids[s]));
    for (int64_t h = 0; h < c.q_heads; ++h)
      for (int64_t r = 0; r < b.tiles[s] * 64; ++r) {
        const float x = lse_packed[h * rows + b.first[s] * 64 + r], y = own[h * b.tiles[s] * 64 + r];
        if (std::memcmp(&x, &y, sizeof(float)) != 0) {
          lse_differ += bitwise ? 1 : 0;
          lse_far += lse_close(x, y) ? 0 : 1;
        }
      }
  }
  CHECK(lse_differ == 0);
  CHECK(lse_far == 0);

  // The forward of the first two samples against the CPU reference.
  for (std::size_t s = 0; s < 2; ++s) {
    const problem ps = make_problem(c.grids[s], 1, c.q_heads, c.kv_heads, c.head_dim, c.type);
    const host_tensor qs = sample_of(q, b, s), ks = sample_of(k, b, s), vs = sample_of(v, b, s);
    host_tensor o_ref = qs;
    std::vector<float> lse_ref(c.q_heads * b.tiles[s] * 64);
    REQUIRE(reference::sparse_attention_forward(ps, scale, qs.view(), ks.view(), vs.view(), lists.own[s].view(),
                                                o_ref.view(), lse_ref.data())
                .is_ok());
    CHECK(rel_error(sample_of(o.download(), b, s), o_ref) < 1e-2);
    int64_t lse_bad = 0;
    for (int64_t h = 0; h < c.q_heads; ++h)
      for (int64_t r = 0; r < b.tiles[s] * 64; ++r) {
        const float x = lse_packed[h * rows + b.first[s] * 64 + r], y = lse_ref[h * b.tiles[s] * 64 + r];
        lse_bad += lse_close(x, y) ? 0 : 1;
      }
    CHECK(lse_bad == 0);
  }

  // Backward: the batch in the size the query asks, again, and in the least workspace; each sample on its own slots in
  // the same two forms.
  std::size_t bytes = 0;
  REQUIRE(
      packed_sparse_attention_backward(pp, scale, {}, {}, {}, {}, {}, nullptr, dl, {}, {}, {}, nullptr, bytes, nullptr)
          .is_ok());
  CHECK(bytes == packed_sparse_attention_backward_workspace(pp, lists.capacity));
  const std::size_t least = packed_sparse_attention_backward_least_workspace(pp, lists.capacity);
  CHECK(least <= bytes);
  struct form {
    std::size_t size;
    bool least;
  };
  const form forms[] = {{bytes, false}, {bytes, false}, {least, true}, {least, true}};
  std::vector<std::vector<double>> runs;
  for (const form& f : forms) {
    INFO("workspace " << f.size << " of " << bytes);
    device_tensor dq(q, poisoned), dk(k, poisoned), dv(v, poisoned);
    device_buffer ws(f.size); // its own size, so that the canaries catch a write past it
    ws.poison();
    std::size_t size = f.size;
    st =
        packed_sparse_attention_backward(pp, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), o.cview(), ddo.cview(),
                                         lse.as<float>(), dl, dq.view(), dk.view(), dv.view(), ws.get(), size, nullptr);
    INFO(st.message());
    REQUIRE(st.is_ok());
    VSA_REQUIRE_RT(gpu_sync());
    CHECK(ws.canaries_intact());
    for (const device_tensor* t : {&dq, &dk, &dv}) {
      CHECK(t->all_written());
      CHECK(t->canaries_intact());
    }
    // Each sample's own backward on its slots, from the packed forward's o_s and lse.
    device_tensor dq_own(q, poisoned), dk_own(k, poisoned), dv_own(v, poisoned);
    for (std::size_t s = 0; s < c.grids.size(); ++s) {
      const problem ps = make_problem(c.grids[s], 1, c.q_heads, c.kv_heads, c.head_dim, c.type);
      const std::size_t own_bytes = f.least ? sparse_attention_backward_workspace(ps)
                                            : sparse_attention_backward_workspace(ps, lists.own[s].capacity);
      device_buffer own_ws(own_bytes);
      device_buffer own_lse_in(sizeof(float) * c.q_heads * b.tiles[s] * 64);
      std::vector<float> slice(c.q_heads * b.tiles[s] * 64);
      for (int64_t h = 0; h < c.q_heads; ++h)
        std::copy_n(lse_packed.begin() + h * rows + b.first[s] * 64, b.tiles[s] * 64,
                    slice.begin() + h * b.tiles[s] * 64);
      own_lse_in.upload_bytes(slice.data(), slice.size() * sizeof(float));
      std::size_t given = own_bytes;
      const status so = sparse_attention_backward(
          ps, scale, sample_view(dq_in.cview(), b, s, c.type), sample_view(dk_in.cview(), b, s, c.type),
          sample_view(dv_in.cview(), b, s, c.type), sample_view(o.cview(), b, s, c.type),
          sample_view(ddo.cview(), b, s, c.type), own_lse_in.as<float>(), own_lists[s],
          sample_view(dq_own.view(), b, s, c.type), sample_view(dk_own.view(), b, s, c.type),
          sample_view(dv_own.view(), b, s, c.type), own_ws.get(), given, nullptr);
      INFO(so.message());
      REQUIRE(so.is_ok());
      VSA_REQUIRE_RT(gpu_sync());
    }
    check_against_samples(c, b, "dq", dq, dq_own);
    check_against_samples(c, b, "dk", dk, dk_own);
    check_against_samples(c, b, "dv", dv, dv_own);
    std::vector<double> all = dq.download_raw(), kk = dk.download_raw(), vv = dv.download_raw();
    all.insert(all.end(), kk.begin(), kk.end());
    all.insert(all.end(), vv.begin(), vv.end());
    runs.push_back(all);
  }
  CHECK(runs[0] == runs[1]); // bitwise reproducible, in either workspace
  CHECK(runs[2] == runs[3]);
}

TEST_CASE("a packed batch is its samples' own sparse passes", "[gpu][packed][attention]") {
  for (const packed_config& c : packed_configs()) check_packed(c);
}

TEST_CASE("a packed batch's descriptor is checked", "[gpu][packed][errors]") {
  const packed_config c = packed_configs()[0];
  packed_problem pp = make_packed(c);
  const batch_layout b(c.grids);
  const int64_t tokens = b.total * 64;
  host_tensor shape(c.type, 1, tokens, c.q_heads, c.head_dim, c.order),
      kv_shape(c.type, 1, tokens, c.kv_heads, c.head_dim, c.order);
  device_tensor q(shape, poisoned), k(kv_shape, poisoned), v(kv_shape, poisoned), o(shape, poisoned);
  std::vector<int32_t> host_q2k(c.q_heads * b.total, 0), host_count(c.q_heads * b.total, 0);
  const device_buffer q2k(upload(host_q2k)), count(upload(host_count));
  device_buffer lse(sizeof(float) * c.q_heads * tokens);
  const const_index_lists dl{q2k.as<int32_t>(), count.as<int32_t>(), 1, nullptr, nullptr};
  const std::size_t bytes = packed_sparse_attention_forward_workspace(pp);
  device_buffer ws(bytes);
  const auto call = [&](const packed_problem& x, const_tensor qv, std::size_t given) {
    return packed_sparse_attention_forward(x, 0.125f, qv, k.cview(), v.cview(), dl, o.view(), lse.as<float>(), ws.get(),
                                           given, nullptr);
  };
  REQUIRE(call(pp, q.cview(), bytes).is_ok());
  VSA_REQUIRE_RT(gpu_sync());

  packed_problem none = pp;
  none.samples = 0;
  CHECK(call(none, q.cview(), bytes).code() == errc::bad_batch);
  CHECK(packed_sparse_attention_forward_workspace(none) == 0);
  packed_problem null_grids = pp;
  null_grids.grids = nullptr;
  CHECK(call(null_grids, q.cview(), bytes).code() == errc::null_pointer);
  std::vector<grid3> bad = c.grids;
  bad[1].h = 0;
  packed_problem bad_grid = pp;
  bad_grid.grids = bad.data();
  const status sg = call(bad_grid, q.cview(), bytes);
  CHECK(sg.code() == errc::bad_grid);
  CHECK(mentions(sg, "grids[1]"));
  // A tensor that does not hold the samples' slots: one sample more, one tile fewer.
  std::vector<grid3> more = c.grids;
  more.push_back({4, 4, 4});
  packed_problem longer = pp;
  longer.grids = more.data();
  longer.samples = static_cast<int64_t>(more.size());
  const status st = call(longer, q.cview(), packed_sparse_attention_forward_workspace(longer));
  CHECK(st.code() == errc::bad_tokens);
  CHECK(mentions(st, "q:"));
  const_tensor short_q = q.cview();
  short_q.tokens -= 64;
  CHECK(call(pp, short_q, bytes).code() == errc::bad_tokens);
  CHECK(call(pp, q.cview(), bytes - 8).code() == errc::bad_workspace);
  const const_index_lists too_long{q2k.as<int32_t>(), count.as<int32_t>(), b.total + 1, nullptr, nullptr};
  CHECK(packed_sparse_attention_forward(pp, 0.125f, q.cview(), k.cview(), v.cview(), too_long, o.view(),
                                        lse.as<float>(), ws.get(), bytes, nullptr)
            .code() == errc::bad_index);
  std::size_t asked = 0;
  CHECK(packed_sparse_attention_backward(pp, 0.125f, {}, {}, {}, {}, {}, nullptr, too_long, {}, {}, {}, nullptr, asked,
                                         nullptr)
            .code() == errc::bad_index);
  CHECK(packed_sparse_attention_backward_workspace(pp, b.total + 1) == 0);
}

} // namespace
} // namespace test
} // namespace vsa
