// Accuracy at the scales models produce: q and k multiplied by s ∈ {1, 4, 16, 32, 64} (v, dO and the gate unit
// normal), the whole op and the sparse pass alone, forward and every gradient, against the CPU reference in
// double on the GPU's own lists (so that near-tied selections do not count). Full and partial tiles, head dim
// 64 and 128, bf16 and fp16, GQA.
//
// What is asserted (README.md, accuracy): up to s = 32 every output and gradient of the whole op within 1.5e-2
// relative (L2) and its norm within 2% of the reference's; at s = 64 the whole op's dq and dk no worse than the
// sparse pass's alone on the same inputs and lists; the op on caller lists never worse than the sparse pass. The
// unit-scale tests elsewhere would not see the errors this guards against: at s ≥ 16 a row's softmax is close to
// one-hot, its gradient a near cancellation, and a rounding that is harmless at unit scale (of o before the row
// term, of the row sums against the rounded P, of the tile means before the coarse scores) became the whole
// gradient (0.19 relative at s = 32 before the fix).
//
// VSA_TEST_REPORT=1 prints a line of errors per case.
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/op.hpp>
#include <vsa/reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace vsa {
namespace test {
namespace {

struct accuracy_case {
  grid3 grid;
  int64_t q_heads, kv_heads, head_dim;
  dtype type;
};

std::string describe(const accuracy_case& c, double s) {
  char text[128];
  std::snprintf(text, sizeof(text), "%lldx%lldx%lld Hq%lld Hkv%lld D%lld %s s=%g", (long long)c.grid.t,
                (long long)c.grid.h, (long long)c.grid.w, (long long)c.q_heads, (long long)c.kv_heads,
                (long long)c.head_dim, dtype_name(c.type), s);
  return text;
}

// 8×8×8: full tiles (N = 8, k = 1); 5×9×13 and 6×10×7: partial tiles of 1 to 48 tokens on every axis.
std::vector<accuracy_case> cases() {
  return {
      {{8, 8, 8}, 4, 4, 64, dtype::bf16},   {{8, 8, 8}, 4, 2, 128, dtype::bf16},  {{5, 9, 13}, 4, 4, 64, dtype::bf16},
      {{5, 9, 13}, 4, 2, 128, dtype::bf16}, {{6, 10, 7}, 4, 4, 128, dtype::bf16}, {{8, 8, 8}, 4, 4, 128, dtype::fp16},
      {{5, 9, 13}, 4, 2, 64, dtype::fp16},
  };
}

bool report() {
  const char* e = std::getenv("VSA_TEST_REPORT");
  return e != nullptr && e[0] == '1';
}

struct compared {
  double error = 0, norm_ratio = 1;
};
compared compare(const host_tensor& got, const host_tensor& want) {
  const double n = norm(want);
  return {rel_error(got, want), n > 0 ? norm(got) / n : 0.0};
}

// The reference in double, inputs widened from the GPU's: `type` becomes f64.
host_tensor widened(const host_tensor& x) { return x.converted(dtype::f64, x.order); }

} // namespace

TEST_CASE("the whole op and the sparse pass at the scales models produce", "[gpu][op][accuracy]") {
  for (const accuracy_case& c : cases()) {
    for (const double s : {1.0, 4.0, 16.0, 32.0, 64.0}) {
      VSA_TEST_RNG(g, "accuracy");
      INFO(describe(c, s));
      const problem p = make_problem(c.grid, 1, c.q_heads, c.kv_heads, c.head_dim, c.type);
      problem p64 = p;
      p64.type = dtype::f64;
      const tile_geometry geo(p.grid);
      const int64_t n = geo.num_tiles(), tokens = geo.tiled_tokens(), rows = p.q_heads * n;
      host_tensor q(c.type, 1, tokens, p.q_heads, c.head_dim), k(c.type, 1, tokens, p.kv_heads, c.head_dim),
          v(c.type, 1, tokens, p.kv_heads, c.head_dim), gate(c.type, 1, tokens, p.q_heads, c.head_dim),
          d_o(c.type, 1, tokens, p.q_heads, c.head_dim);
      fill_tiled_normal(q, p.grid, g, s);
      fill_tiled_normal(k, p.grid, g, s);
      for (host_tensor* x : {&v, &gate, &d_o}) fill_tiled_normal(*x, p.grid, g);
      const options opt{};

      // The GPU op, forward and backward.
      const device_tensor dq_in(q), dk_in(k), dv_in(v), dgate_in(gate), ddo(d_o);
      device_tensor o(q, poisoned), dq(q, poisoned), dk(k, poisoned), dv(k, poisoned), dg(q, poisoned);
      const forward_io fio{dq_in.cview(), dk_in.cview(), dv_in.cview(), dgate_in.cview(), o.view()};
      std::size_t fbytes = 0, bbytes = 0;
      REQUIRE(forward(p, opt, fio, nullptr, fbytes, nullptr).is_ok());
      REQUIRE(backward(p, opt, backward_io{}, nullptr, bbytes, nullptr).is_ok());
      device_buffer ws(std::max(fbytes, bbytes));
      ws.poison();
      std::size_t bytes = ws.bytes();
      REQUIRE(forward(p, opt, fio, ws.get(), bytes, nullptr).is_ok());
      const backward_io bio{dq_in.cview(), dk_in.cview(), dv_in.cview(), dgate_in.cview(), o.cview(),
                            ddo.cview(),   dq.view(),     dk.view(),     dv.view(),        dg.view()};
      REQUIRE(backward(p, opt, bio, ws.get(), bytes, nullptr).is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      for (const device_tensor* t : {&o, &dq, &dk, &dv, &dg}) {
        CHECK(t->all_written());
        CHECK(t->canaries_intact());
      }

      // The op's own lists, for the reference and for the sparse pass alone.
      detail::op_workspace w;
      REQUIRE(detail::plan_op(p, opt, w).is_ok());
      std::vector<int32_t> q2k = ws.download<int32_t>(w.q2k, rows * w.top_k),
                           count = ws.download<int32_t>(w.q2k_count, rows), k2q(q2k.size()),
                           offset(p.q_heads * (n + 1));
      const index_lists host_lists{q2k.data(), count.data(), w.top_k, k2q.data(), offset.data()};
      REQUIRE(reference::build_k2q(p, host_lists).is_ok());

      // The reference op in double on those lists.
      const host_tensor q64 = widened(q), k64 = widened(k), v64 = widened(v), gate64 = widened(gate),
                        d_o64 = widened(d_o);
      host_tensor o_ref(dtype::f64, 1, tokens, p.q_heads, c.head_dim),
          dq_ref = o_ref, dg_ref = o_ref, dk_ref(dtype::f64, 1, tokens, p.kv_heads, c.head_dim), dv_ref = dk_ref;
      std::size_t rf = 0, rb = 0;
      const forward_io rfio{q64.cview(), k64.cview(), v64.cview(), gate64.cview(), o_ref.view()};
      REQUIRE(reference::forward_on_lists(p64, opt, rfio, as_const(host_lists), nullptr, rf).is_ok());
      REQUIRE(reference::backward(p64, opt, backward_io{}, nullptr, rb).is_ok());
      aligned_buffer rws(std::max(rf, rb));
      std::size_t rbytes = rws.size();
      REQUIRE(reference::forward_on_lists(p64, opt, rfio, as_const(host_lists), rws.data(), rbytes).is_ok());
      const backward_io rbio{q64.cview(),   k64.cview(),   v64.cview(),   gate64.cview(), o_ref.cview(),
                             d_o64.cview(), dq_ref.view(), dk_ref.view(), dv_ref.view(),  dg_ref.view()};
      REQUIRE(reference::backward(p64, opt, rbio, rws.data(), rbytes).is_ok());

      // The sparse pass alone on the same inputs and lists, GPU and reference.
      const float scale = 1.f / std::sqrt(float(c.head_dim));
      const int64_t cap = w.top_k;
      device_buffer l_q2k(q2k.size() * 4), l_count(count.size() * 4), l_k2q(k2q.size() * 4),
          l_offset(offset.size() * 4), lse(rows * 64 * 4);
      l_q2k.upload_bytes(q2k.data(), q2k.size() * 4);
      l_count.upload_bytes(count.data(), count.size() * 4);
      l_k2q.upload_bytes(k2q.data(), k2q.size() * 4);
      l_offset.upload_bytes(offset.data(), offset.size() * 4);
      const const_index_lists dl{l_q2k.as<int32_t>(), l_count.as<int32_t>(), cap, l_k2q.as<int32_t>(),
                                 l_offset.as<int32_t>()};
      device_tensor os(q, poisoned), sq(q, poisoned), sk(k, poisoned), sv(k, poisoned);
      REQUIRE(sparse_attention_forward(p, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), dl, os.view(),
                                       lse.as<float>(), nullptr)
                  .is_ok());
      std::size_t sbytes = 0;
      REQUIRE(sparse_attention_backward(p, scale, {}, {}, {}, {}, {}, nullptr, dl, {}, {}, {}, nullptr, sbytes, nullptr)
                  .is_ok());
      device_buffer sws(sbytes);
      REQUIRE(sparse_attention_backward(p, scale, dq_in.cview(), dk_in.cview(), dv_in.cview(), os.cview(), ddo.cview(),
                                        lse.as<float>(), dl, sq.view(), sk.view(), sv.view(), sws.get(), sbytes,
                                        nullptr)
                  .is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      host_tensor os_ref(dtype::f64, 1, tokens, p.q_heads, c.head_dim),
          sq_ref = os_ref, sk_ref(dtype::f64, 1, tokens, p.kv_heads, c.head_dim), sv_ref = sk_ref;
      std::vector<float> lse_ref(rows * 64);
      REQUIRE(reference::sparse_attention_forward(p64, scale, q64.cview(), k64.cview(), v64.cview(),
                                                  as_const(host_lists), os_ref.view(), lse_ref.data())
                  .is_ok());
      REQUIRE(reference::sparse_attention_backward(p64, scale, q64.cview(), k64.cview(), v64.cview(), os_ref.cview(),
                                                   d_o64.cview(), lse_ref.data(), as_const(host_lists), sq_ref.view(),
                                                   sk_ref.view(), sv_ref.view())
                  .is_ok());

      // The op on caller lists: no coarse branch, o = o_s, its row term from the residual instead of o alone.
      options own = opt;
      own.q2k = dl;
      device_tensor lo(q, poisoned), lq(q, poisoned), lk(k, poisoned), lv(k, poisoned);
      const forward_io lfio{dq_in.cview(), dk_in.cview(), dv_in.cview(), const_tensor{}, lo.view()};
      REQUIRE(forward(p, own, lfio, ws.get(), bytes, nullptr).is_ok());
      const backward_io lbio{dq_in.cview(), dk_in.cview(), dv_in.cview(), const_tensor{}, lo.cview(),
                             ddo.cview(),   lq.view(),     lk.view(),     lv.view(),      tensor{}};
      REQUIRE(backward(p, own, lbio, ws.get(), bytes, nullptr).is_ok());
      VSA_REQUIRE_RT(gpu_sync());
      const compared ldq = compare(lq.download(), sq_ref), ldk = compare(lk.download(), sk_ref);

      const compared eo = compare(o.download(), o_ref), edq = compare(dq.download(), dq_ref),
                     edk = compare(dk.download(), dk_ref), edv = compare(dv.download(), dv_ref),
                     edg = compare(dg.download(), dg_ref), sdq = compare(sq.download(), sq_ref),
                     sdk = compare(sk.download(), sk_ref), sdv = compare(sv.download(), sv_ref);
      if (report())
        std::printf("accuracy %-34s op o %.2e dq %.2e dk %.2e dv %.2e dgate %.2e | sparse dq %.2e dk %.2e dv %.2e | "
                    "op on lists dq %.2e dk %.2e\n",
                    describe(c, s).c_str(), eo.error, edq.error, edk.error, edv.error, edg.error, sdq.error, sdk.error,
                    sdv.error, ldq.error, ldk.error);
      const compared* op_grads[] = {&edq, &edk, &edv, &edg};
      CHECK(eo.error < 1e-2);
      if (s <= 32) {
        for (const compared* e : op_grads) {
          CHECK(e->error < 1.5e-2);
          CHECK(std::fabs(e->norm_ratio - 1.0) < 0.02);
        }
      } else {
        // At s = 64 a row's softmax is one-hot to within the rounding of P itself, which the sparse pass has
        // too: the whole op must add nothing to it.
        CHECK(edq.error <= 1.1 * sdq.error + 2e-3);
        CHECK(edk.error <= 1.1 * sdk.error + 2e-3);
        CHECK(edv.error < 1.5e-2);
        CHECK(edg.error < 1.5e-2);
      }
      // On caller lists the op is the sparse pass with a row term from o before rounding: never worse than it.
      CHECK(ldq.error <= 1.1 * sdq.error + 2e-3);
      CHECK(ldk.error <= 1.1 * sdk.error + 2e-3);
      // The sparse pass alone takes its row term from the 16-bit o its caller passes back (as FlashAttention
      // does), which bounds it less tightly at large s (README.md, accuracy). NaN never passes: rel_error is
      // +inf when either side holds one.
      CHECK(sdq.error < 3e-2);
      CHECK(sdk.error < 3e-2);
      CHECK(sdv.error < 1.5e-2);
    }
  }
}

} // namespace test
} // namespace vsa
