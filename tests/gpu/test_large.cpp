// 64-bit offsets: a problem whose tensors hold more than 2^31 elements (B = 2, 40 heads, a 31×59×111 grid of
// 3360 tiles, D = 128: 2.2e9 elements, 4.4 GB per bf16 tensor). The inputs are generated on the device from a
// hash of each element's logical index, so the host recomputes any element without a 4 GB copy; the whole op
// forward and the sparse forward then run, and query tiles of the last batch and head (offsets far past
// 2^31) are checked against a reference computed here in double, using the GPU's own selection read back
// from the workspace. Needs about 30 GB of device memory; skipped with a warning where that is not free.
#include "support/gpu.hpp"
#include "support/host.hpp"

#include <vsa/gpu/op.hpp>
#include <vsa/numeric.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace vsa {
namespace test {
namespace {

// A value k/64 (k in -128..127) for logical element `index` of tensor `seed`, the same on host and device.
// Such values are exact in bf16, so the host knows the stored element without any rounding.
VSA_HOST_DEVICE inline float hashed_value(uint64_t seed, uint64_t index) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + index;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<int>(z >> 56) - 128) * (1.0f / 64.0f);
}

// The bf16 bits of a float that bf16 holds exactly: its upper half.
VSA_HOST_DEVICE inline uint16_t exact_bf16(float x) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  const uint32_t u = __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
#endif
  return static_cast<uint16_t>(u >> 16);
}

inline double from_bits(uint16_t x, bool bf16) { return bf16 ? bf16_to_float(x) : fp16_to_float(x); }

struct fill_params {
  uint16_t* data;
  int64_t batch, tokens, heads, dim;
  int64_t batch_stride, token_stride, head_stride;
  tile_geometry geo;
  uint64_t seed;
};

// Every element of a tiled [B, S, H, D] view: the hashed value on valid slots, zero on padding slots.
__global__ void fill_kernel(fill_params p) {
  const int64_t total = p.batch * p.tokens * p.heads * p.dim;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t d = e % p.dim, h = (e / p.dim) % p.heads, s = (e / (p.dim * p.heads)) % p.tokens,
                  b = e / (p.dim * p.heads * p.tokens);
    const bool valid = (s % tile_tokens) < p.geo.valid(s / tile_tokens);
    const float x = valid ? hashed_value(p.seed, static_cast<uint64_t>(e)) : 0.0f;
    p.data[b * p.batch_stride + s * p.token_stride + h * p.head_stride + d] = exact_bf16(x);
  }
}

// A device allocation that may fail: the test is skipped then, instead of failing.
class large_buffer {
public:
  explicit large_buffer(std::size_t bytes) {
    if (device_malloc(&ptr_, bytes) != gpu::success) {
      ptr_ = nullptr;
      (void)gpu::last_error(); // clear the failed allocation's error
    }
  }
  large_buffer(const large_buffer&) = delete;
  large_buffer& operator=(const large_buffer&) = delete;
  ~large_buffer() {
    if (ptr_ != nullptr) (void)device_free(ptr_);
  }
  void* get() const { return ptr_; }
  explicit operator bool() const { return ptr_ != nullptr; }

private:
  void* ptr_ = nullptr;
};

struct large_config {
  int64_t q_heads, kv_heads;
  layout order;
};

// The view of a dense tensor in `order`.
tensor view_of(void* data, const problem& p, int64_t heads, layout order) {
  const int64_t tokens = tile_geometry(p.grid).tiled_tokens();
  return order == layout::bshd ? bshd<void*>(data, p.batch, tokens, heads, p.head_dim)
                               : bhsd<void*>(data, p.batch, tokens, heads, p.head_dim);
}

// The host's copy of what fill_kernel wrote at (b, s, h, d): the value after rounding to the dtype.
struct hashed_tensor {
  uint64_t seed;
  int64_t tokens, heads, dim;
  const tile_geometry* geo;
  bool bf16;
  double at(int64_t b, int64_t s, int64_t h, int64_t d) const {
    if ((s % tile_tokens) >= geo->valid(s / tile_tokens)) return 0.0;
    const uint64_t e = static_cast<uint64_t>(((b * tokens + s) * heads + h) * dim + d);
    return hashed_value(seed, e); // exact in bf16
  }
};

// D elements of row (b, s, h) of a device view, as doubles.
std::vector<double> download_row(const tensor& t, int64_t b, int64_t s, int64_t h, int64_t dim, bool bf16) {
  std::vector<uint16_t> bits(static_cast<std::size_t>(dim));
  const int64_t offset = b * t.batch_stride + s * t.token_stride + h * t.head_stride;
  VSA_REQUIRE_RT(copy_to_host(bits.data(), static_cast<const uint16_t*>(t.data) + offset, bits.size() * 2));
  std::vector<double> r(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) r[i] = from_bits(bits[i], bf16);
  return r;
}

template <class T> std::vector<T> download_at(const void* base, std::size_t byte_offset, int64_t count) {
  std::vector<T> r(static_cast<std::size_t>(count));
  VSA_REQUIRE_RT(copy_to_host(r.data(), static_cast<const unsigned char*>(base) + byte_offset, r.size() * sizeof(T)));
  return r;
}

bool enough_memory(std::size_t need) {
  std::size_t free_bytes = 0, total = 0;
#if VSA_RUNTIME_HIP
  const bool ok = hipMemGetInfo(&free_bytes, &total) == hipSuccess;
#else
  const bool ok = cudaMemGetInfo(&free_bytes, &total) == cudaSuccess;
#endif
  return ok && free_bytes > need + (std::size_t(1) << 30);
}

} // namespace

TEST_CASE("64-bit offsets: the whole op and the sparse forward past 2^31 elements", "[gpu][large]") {
  const large_config configs[] = {{40, 40, layout::bshd}, {40, 8, layout::bhsd}};
  for (const large_config& c : configs) {
    DYNAMIC_SECTION("Hq " << c.q_heads << " Hkv " << c.kv_heads << (c.order == layout::bshd ? " bshd" : " bhsd")) {
      const problem p = make_problem({31, 59, 111}, 2, c.q_heads, c.kv_heads, 128, dtype::bf16);
      const tile_geometry geo(p.grid);
      const int64_t n = geo.num_tiles(), tokens = geo.tiled_tokens(), dim = p.head_dim;
      const int64_t q_elements = p.batch * tokens * p.q_heads * dim, kv_elements = p.batch * tokens * p.kv_heads * dim;
      REQUIRE(q_elements > (int64_t(1) << 31));
      const bool bf16 = p.type == dtype::bf16;
      const std::size_t q_bytes = static_cast<std::size_t>(q_elements) * 2,
                        kv_bytes = static_cast<std::size_t>(kv_elements) * 2;

      options opt;
      opt.top_k = 12;
      detail::op_workspace w;
      REQUIRE(detail::plan_op(p, opt, w).is_ok());
      const std::size_t forward_bytes = detail::whole_workspace_bytes(w, false);
      const std::size_t need =
          3 * q_bytes + 2 * kv_bytes + forward_bytes + static_cast<std::size_t>(p.batch * p.q_heads * tokens) * 4;
      if (!enough_memory(need)) {
        WARN("skipped: needs " << (need >> 20) << " MiB of free device memory");
        return;
      }
      large_buffer q_buf(q_bytes), k_buf(kv_bytes), v_buf(kv_bytes), o_buf(q_bytes), o_s_buf(q_bytes),
          ws(forward_bytes), lse_buf(static_cast<std::size_t>(p.batch * p.q_heads * tokens) * 4);
      if (!q_buf || !k_buf || !v_buf || !o_buf || !o_s_buf || !ws || !lse_buf) {
        WARN("skipped: a device allocation failed (needs " << (need >> 20) << " MiB)");
        return;
      }

      const tensor q = view_of(q_buf.get(), p, p.q_heads, c.order), k = view_of(k_buf.get(), p, p.kv_heads, c.order),
                   v = view_of(v_buf.get(), p, p.kv_heads, c.order), o = view_of(o_buf.get(), p, p.q_heads, c.order),
                   o_s = view_of(o_s_buf.get(), p, p.q_heads, c.order);
      const hashed_tensor hq{1, tokens, p.q_heads, dim, &geo, bf16}, hk{2, tokens, p.kv_heads, dim, &geo, bf16},
          hv{3, tokens, p.kv_heads, dim, &geo, bf16};
      for (const auto& [view, hashed] : {std::make_pair(q, hq), std::make_pair(k, hk), std::make_pair(v, hv)}) {
        const fill_params fp{static_cast<uint16_t*>(view.data),
                             p.batch,
                             tokens,
                             hashed.heads,
                             dim,
                             view.batch_stride,
                             view.token_stride,
                             view.head_stride,
                             geo,
                             hashed.seed};
        fill_kernel<<<4096, 256>>>(fp);
        VSA_REQUIRE_RT(gpu::last_error());
      }
      VSA_REQUIRE_RT(gpu_sync());

      // The whole op (no gate: o = o_s + o_c), then the sparse forward on the op's own lists.
      const forward_io io{q, k, v, {}, o};
      std::size_t bytes = forward_bytes;
      const status sf = forward(p, opt, io, ws.get(), bytes, nullptr);
      INFO(sf.message());
      REQUIRE(sf.is_ok());
      const const_index_lists lists{static_cast<const int32_t*>(ws.get()) + w.q2k / 4,
                                    static_cast<const int32_t*>(ws.get()) + w.q2k_count / 4, w.capacity, nullptr,
                                    nullptr};
      const float scale = 1.f / std::sqrt(static_cast<float>(dim));
      const status ss =
          sparse_attention_forward(p, scale, q, k, v, lists, o_s, static_cast<float*>(lse_buf.get()), nullptr);
      INFO(ss.message());
      REQUIRE(ss.is_ok());
      VSA_REQUIRE_RT(gpu_sync());

      for (const int64_t h : {p.q_heads - 1, p.q_heads / 2}) {
        const int64_t b = p.batch - 1, hk_head = h / (p.q_heads / p.kv_heads), bh = b * p.q_heads + h;
        INFO("b " << b << " h " << h << " (kv head " << hk_head << ")");
        // Means of every key and value tile of the kv head, rounded to the dtype as the GPU stores them.
        std::vector<double> k_c(static_cast<std::size_t>(n * dim)), v_c(k_c.size());
        for (int64_t t = 0; t < n; ++t) {
          const int valid = geo.valid(t);
          for (int64_t d = 0; d < dim; ++d) {
            double sk = 0, sv = 0;
            for (int s = 0; s < valid; ++s) {
              sk += hk.at(b, t * tile_tokens + s, hk_head, d);
              sv += hv.at(b, t * tile_tokens + s, hk_head, d);
            }
            k_c[static_cast<std::size_t>(t * dim + d)] = round_to(sk / valid, p.type);
            v_c[static_cast<std::size_t>(t * dim + d)] = round_to(sv / valid, p.type);
          }
        }
        for (const int64_t i : {n - 1, n / 2, int64_t(7)}) {
          INFO("query tile " << i);
          const int valid_i = geo.valid(i);
          // Block mean of the query tile, coarse scores and o_c, compared with the workspace's.
          std::vector<double> q_c(static_cast<std::size_t>(dim));
          for (int64_t d = 0; d < dim; ++d) {
            double s = 0;
            for (int r = 0; r < valid_i; ++r) s += hq.at(b, i * tile_tokens + r, h, d);
            q_c[static_cast<std::size_t>(d)] = round_to(s / valid_i, p.type);
          }
          std::vector<double> scores_ref(static_cast<std::size_t>(n));
          double max_score = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (int64_t d = 0; d < dim; ++d)
              s += q_c[static_cast<std::size_t>(d)] * k_c[static_cast<std::size_t>(j * dim + d)];
            scores_ref[static_cast<std::size_t>(j)] = scale * s;
            max_score = std::max(max_score, scale * s);
          }
          double denominator = 0;
          std::vector<double> o_c_ref(static_cast<std::size_t>(dim), 0.0);
          for (int64_t j = 0; j < n; ++j) {
            const double e = std::exp(scores_ref[static_cast<std::size_t>(j)] - max_score);
            denominator += e;
            for (int64_t d = 0; d < dim; ++d)
              o_c_ref[static_cast<std::size_t>(d)] += e * v_c[static_cast<std::size_t>(j * dim + d)];
          }
          for (double& x : o_c_ref) x = round_to(x / denominator, p.type);
          const std::vector<float> scores = download_at<float>(
              ws.get(), w.state_bytes + w.scores + static_cast<std::size_t>((bh * n + i) * n) * 4, n);
          CHECK(rel_error(std::vector<double>(scores.begin(), scores.end()), scores_ref) < 1e-2);
          const std::vector<uint16_t> o_c_bits =
              download_at<uint16_t>(ws.get(), w.o_c + static_cast<std::size_t>((bh * n + i) * dim) * 2, dim);
          std::vector<double> o_c(static_cast<std::size_t>(dim));
          for (int64_t d = 0; d < dim; ++d)
            o_c[static_cast<std::size_t>(d)] = from_bits(o_c_bits[static_cast<std::size_t>(d)], bf16);
          CHECK(rel_error(o_c, o_c_ref) < 2e-2);

          // The selection: the top-k of the GPU's own scores row (ties to the lower index), ascending.
          const std::vector<int32_t> row = download_at<int32_t>(
              ws.get(), w.q2k + static_cast<std::size_t>((bh * n + i) * w.capacity) * 4, w.capacity);
          const int32_t count =
              download_at<int32_t>(ws.get(), w.q2k_count + static_cast<std::size_t>(bh * n + i) * 4, 1)[0];
          REQUIRE(count == w.top_k);
          std::vector<int32_t> order(static_cast<std::size_t>(n));
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
            const float a = scores[static_cast<std::size_t>(x)], c2 = scores[static_cast<std::size_t>(y)];
            if (std::isnan(a) || std::isnan(c2)) return !std::isnan(a) && std::isnan(c2);
            return a > c2;
          });
          std::vector<int32_t> expect(order.begin(), order.begin() + w.top_k);
          std::sort(expect.begin(), expect.end());
          CHECK(std::vector<int32_t>(row.begin(), row.begin() + count) == expect);

          // Sparse attention of every valid query row over the selected tiles, then o = o_s + o_c.
          const std::vector<float> lse_op = download_at<float>(
              ws.get(), w.lse + static_cast<std::size_t>(bh * tokens + i * tile_tokens) * 4, tile_tokens);
          const std::vector<float> lse_sparse = download_at<float>(
              lse_buf.get(), static_cast<std::size_t>(bh * tokens + i * tile_tokens) * 4, tile_tokens);
          std::vector<double> got_o, want_o, got_o_s, want_o_s, got_lse, want_lse;
          for (int64_t s = 0; s < tile_tokens; ++s) {
            const int64_t slot = i * tile_tokens + s;
            const std::vector<double> row_o = download_row(o, b, slot, h, dim, bf16),
                                      row_o_s = download_row(o_s, b, slot, h, dim, bf16);
            if (s >= valid_i) {
              // Padding rows: zeros, and lse = +inf.
              CHECK(std::all_of(row_o.begin(), row_o.end(), [](double x) { return x == 0.0; }));
              CHECK(std::all_of(row_o_s.begin(), row_o_s.end(), [](double x) { return x == 0.0; }));
              CHECK(std::isinf(lse_sparse[static_cast<std::size_t>(s)]));
              CHECK(std::isinf(lse_op[static_cast<std::size_t>(s)]));
              continue;
            }
            std::vector<double> qrow(static_cast<std::size_t>(dim));
            for (int64_t d = 0; d < dim; ++d) qrow[static_cast<std::size_t>(d)] = hq.at(b, slot, h, d);
            std::vector<double> logits;
            std::vector<int64_t> keys;
            for (int32_t j : expect)
              for (int r = 0; r < geo.valid(j); ++r) {
                const int64_t key = int64_t(j) * tile_tokens + r;
                double dot = 0;
                for (int64_t d = 0; d < dim; ++d) dot += qrow[static_cast<std::size_t>(d)] * hk.at(b, key, hk_head, d);
                logits.push_back(scale * dot);
                keys.push_back(key);
              }
            const double m = *std::max_element(logits.begin(), logits.end());
            double sum = 0;
            std::vector<double> acc(static_cast<std::size_t>(dim), 0.0);
            for (std::size_t t = 0; t < logits.size(); ++t) {
              const double e = std::exp(logits[t] - m);
              sum += e;
              for (int64_t d = 0; d < dim; ++d) acc[static_cast<std::size_t>(d)] += e * hv.at(b, keys[t], hk_head, d);
            }
            for (int64_t d = 0; d < dim; ++d) {
              const double fine = acc[static_cast<std::size_t>(d)] / sum;
              want_o_s.push_back(round_to(fine, p.type));
              want_o.push_back(round_to(fine + o_c[static_cast<std::size_t>(d)], p.type));
              got_o_s.push_back(row_o_s[static_cast<std::size_t>(d)]);
              got_o.push_back(row_o[static_cast<std::size_t>(d)]);
            }
            want_lse.push_back(m + std::log(sum));
            want_lse.push_back(m + std::log(sum));
            got_lse.push_back(lse_op[static_cast<std::size_t>(s)]);
            got_lse.push_back(lse_sparse[static_cast<std::size_t>(s)]);
          }
          CHECK(rel_error(got_o, want_o) < 1e-2);
          CHECK(rel_error(got_o_s, want_o_s) < 1e-2);
          CHECK(rel_error(got_lse, want_lse) < 1e-4);
        }
      }
    }
  }
}

} // namespace test
} // namespace vsa
